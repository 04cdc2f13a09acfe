"""The RemBERT encoder and every embedding variant of "Rethinking Embedding Coupling in Pre-trained
Language Models" (Chung, Févry, Tsai, Johnson, Ruder; ICLR 2021).

The paper's ideas, each in one named place:
  - decoupled embeddings (Section 4, Table 2): the output embedding `MLMHead.decoder` is its own
    matrix unless `tie_embeddings=True`, which reuses the input word embedding (the coupled baseline);
  - a small input embedding (Section 4, Table 3): words are embedded in `input_embedding_size` (E_in)
    dimensions and `Encoder.embedding_projection` maps them up to `hidden_size` (H);
  - a larger output embedding (Section 5, Table 4): `MLMHead.dense` maps H to `output_embedding_size`
    (E_out), which may exceed H; the head is dropped for fine-tuning;
  - pre-training-only capacity (Section 5, Table 5): `MaskedLM.pretraining_layers` are Transformer
    layers on top of the kept `Encoder`, used for pre-training and dropped for fine-tuning.

The computation and the weight names follow Hugging Face's `modeling_rembert.py`: the released
RemBERT checkpoint loads with `MaskedLM.from_hf` and matches it numerically. Unlike there, the masked-LM
head gathers the masked positions first (google-research/bert's `gather_indexes`), skipping about 85%
of the output layer, the largest matrix of the model. This file imports only torch and the standard
library (`safetensors` inside the two functions that read and write transformers' files): it copies alone.
"""

import hashlib
import json
import os
import pickle
import re
import stat
import warnings
import zipfile
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


class DataError(ValueError):
    """Bad input: a data file, a checkpoint or a Hugging Face directory. The message names it."""


@dataclass
class ModelConfig:
    vocab_size: int = field(default=250300, metadata={"help": "word pieces; at least the tokenizer's"})
    hidden_size: int = field(default=1152, metadata={"help": "H, the Transformer width"})
    num_layers: int = field(default=32, metadata={"help": "Transformer layers kept for fine-tuning"})
    num_heads: int = field(default=18, metadata={"help": "attention heads"})
    intermediate_size: int = field(default=4608, metadata={"help": "feed-forward width"})
    input_embedding_size: int = field(default=256, metadata={"help": "E_in, the input embedding width (§4)"})
    output_embedding_size: int = field(default=1664, metadata={"help": "E_out, the MLM head's width (§5)"})
    tie_embeddings: bool = field(default=False, metadata={"help": "coupled: one matrix in and out (E_in == E_out)"})
    pretraining_only_layers: int = field(default=0, metadata={"help": "pre-training-only layers on top (Table 5)"})
    max_position_embeddings: int = field(default=512, metadata={"help": "longest sequence"})
    type_vocab_size: int = field(default=2, metadata={"help": "segment types"})
    layer_norm_eps: float = field(default=1e-12, metadata={"help": "LayerNorm epsilon"})
    dropout: float = field(default=0.1, metadata={"help": "hidden and attention dropout"})

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name == "pretraining_only_layers" else 1
            if f.type is int and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"ModelConfig.{f.name} must be an int >= {least}, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.tie_embeddings and self.input_embedding_size != self.output_embedding_size:
            raise ValueError(f"tie_embeddings (one matrix in and out) needs input_embedding_size == "
                             f"output_embedding_size, got {self.input_embedding_size} and {self.output_embedding_size}")
        if not 0.0 < self.layer_norm_eps < float("inf"):
            raise ValueError(f"ModelConfig.layer_norm_eps must be a positive number, got {self.layer_norm_eps}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")


# ----------------------------------------------------------------------------------------------
# Transformer layer (post-LayerNorm, as BERT and RemBERT)

class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout  # of the attention probabilities
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, mask):
        B, T, H = x.shape
        q, k, v = (f(x).view(B, T, self.num_heads, H // self.num_heads).transpose(1, 2)  # (B, heads, T, head_dim)
                   for f in (self.query, self.key, self.value))
        # Padding gets the compute dtype's most negative number (bf16's under autocast), not -inf: a row that is all
        # padding (a padded evaluation batch) then stays finite.
        bias = None if mask is None else q.new_zeros(mask.shape).masked_fill(mask, torch.finfo(q.dtype).min)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, T, H))


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, mask):
        x = self.attention_norm(x + self.dropout(self.attention(x, mask)))
        return self.output_norm(x + self.dropout(self.output(F.gelu(self.intermediate(x)))))


def padding_mask(attention_mask):
    """(B, T) attention mask (non-zero: a token, as transformers reads it) -> (B, 1, 1, T), True at padding."""
    return None if attention_mask is None else (attention_mask == 0)[:, None, None, :]


# ----------------------------------------------------------------------------------------------
# Input side: E_in-wide embeddings, projected up to H (Section 4)

class Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        E = config.input_embedding_size
        self.word_embeddings = nn.Embedding(config.vocab_size, E)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, E)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, E)
        self.norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids, token_type_ids):
        T, max_T = input_ids.shape[1], self.position_embeddings.num_embeddings
        if T > max_T:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings {max_T}")
        # Slicing the table (not an arange) creates no tensor on the host: XLA-safe.
        x = self.word_embeddings(input_ids) + self.position_embeddings.weight[:T]
        return self.dropout(self.norm(x + self.token_type_embeddings(token_type_ids)))  # (B, T, E_in)


class Encoder(nn.Module):
    """What fine-tuning keeps: embeddings, the E_in -> H projection, `num_layers` layers, the pooler."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.embedding_projection = (nn.Identity() if config.input_embedding_size == config.hidden_size
                                     else nn.Linear(config.input_embedding_size, config.hidden_size))
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        # Only the sentence classifier uses the pooler; MLM pre-training leaves it untouched.
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.apply(init_weights)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, output_hidden_states=False):
        """Hidden states (B, T, H); with `output_hidden_states`, also the list of each layer's input and the output."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        mask = padding_mask(attention_mask)
        x = self.embedding_projection(self.embeddings(input_ids, token_type_ids))  # (B, T, H)
        hidden_states = [x]
        for layer in self.layers:
            x = layer(x, mask)
            hidden_states.append(x)
        return (x, hidden_states) if output_hidden_states else x

    def pool(self, hidden):
        return torch.tanh(self.pooler(hidden[:, 0]))  # (B, H), from the [CLS] position

    @classmethod
    def from_hf(cls, path):
        """The encoder of a Hugging Face RemBERT directory (see `MaskedLM.from_hf`)."""
        config, state = _read_hf(path)
        encoder = cls(config)
        if not _load_hf_encoder(encoder, state, path):
            warnings.warn(f"{path} has no pooler: it keeps its fresh initialisation")
        return encoder


# ----------------------------------------------------------------------------------------------
# Output side: the masked-LM head with its own E_out-wide output embedding (Sections 4 and 5)

class MLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.output_embedding_size)
        self.norm = nn.LayerNorm(config.output_embedding_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.output_embedding_size, config.vocab_size)  # the output embedding

    def forward(self, x):
        return self.decoder(self.norm(F.gelu(self.dense(x))))


class MaskedLM(nn.Module):
    """The pre-training model: `encoder` (kept), `pretraining_layers` and `head` (both dropped)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.pretraining_layers = nn.ModuleList(Layer(config) for _ in range(config.pretraining_only_layers))
        self.head = MLMHead(config)
        self.pretraining_layers.apply(init_weights)
        self.head.apply(init_weights)
        self.tie_weights()

    def tie_weights(self):
        """The coupled model's one matrix in and out (again after a move to XLA, which copies it per module)."""
        if self.config.tie_embeddings:
            self.head.decoder.weight = self.encoder.embeddings.word_embeddings.weight  # (V, E) both ways

    def forward(self, input_ids, token_type_ids=None, attention_mask=None,
                masked_positions=None, masked_ids=None, masked_weights=None):
        """Logits (B*P, V) at `masked_positions` (B, P), row b*P + p for position p of sequence b (bert's layout), or
        (B, T, V) at every position when None; with `masked_ids` (B, P), the loss: the mean cross-entropy weighted by
        `masked_weights` (0: padding), or else by ids != -100."""
        x = self.encoder(input_ids, token_type_ids, attention_mask)
        mask = padding_mask(attention_mask)
        for layer in self.pretraining_layers:
            x = layer(x, mask)
        if masked_positions is None:
            logits = self.head(x)  # (B, T, V), as transformers' RemBertForMaskedLM
        else:  # google-research/bert's gather_indexes: the masked positions' rows (B*P, H), the head on them alone
            rows = torch.gather(x, 1, masked_positions[:, :, None].expand(-1, -1, x.shape[-1])).flatten(0, 1)
            logits = self.head(rows)
        if masked_ids is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, -2).float(), masked_ids.flatten(), reduction="none")
        weights = (masked_ids != -100 if masked_weights is None else masked_weights).flatten().float()
        return logits, (loss * weights).sum() / weights.sum().clamp(min=1.0)

    @classmethod
    def from_checkpoint(cls, path):
        """The model of a pretrain.py checkpoint directory (torch.distributed.checkpoint's shards, read by one process
        however many wrote them), every file checked first."""
        import torch.distributed.checkpoint as dcp
        info = read_checkpoint_info(path)
        try:
            model = cls(ModelConfig(**info["config"]))
            with warnings.catch_warnings():  # (that this one process reads alone, which DCP warns of)
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.load({"model": model.state_dict()}, storage_reader=checkpoint_reader(path), no_dist=True)
        except (Exception, dcp.CheckpointException) as e:  # (a BaseException: whatever the shards do not fit)
            raise DataError(f"{path}: the weights do not fit the saved config: {one_line(e)}") from None
        return model

    @classmethod
    def from_hf(cls, path):
        """A RemBERT directory in the Hugging Face layout, as `save_pretrained` writes it (e.g. google/rembert; its
        weights in one file). The released checkpoint has no MLM head: the head keeps its initialisation."""
        config, state = _read_hf(path)
        model = cls(config)
        _load_hf_encoder(model.encoder, state, path)
        head = {name: "cls.predictions." + hf_name(name, _HF_HEAD) for name in model.head.state_dict()}
        if config.tie_embeddings and head["decoder.weight"] not in state:  # transformers 4 saves a tied matrix once
            del head["decoder.weight"]
        if any(hf in state for hf in head.values()):  # a head, then all of it: _copy_tensors names what is missing
            _copy_tensors(model.head, state, head, path)  # (tied: into the input embedding too, checked next)
            if config.tie_embeddings and not torch.equal(model.head.decoder.weight,
                                                         state["embeddings.word_embeddings.weight"]):
                raise DataError(f"{path}: tie_word_embeddings, but its output embedding (cls.predictions.decoder) "
                                f"differs from its input embedding")
        else:
            warnings.warn(f"{path} has no masked-LM head (cls.predictions.*): the head is freshly initialised")
        return model


# ----------------------------------------------------------------------------------------------
# Task heads for fine-tuning (XTREME): each returns a tuple whose last element is the loss or None

class SequenceClassifier(nn.Module):
    """Sentence(-pair) classification (XNLI, PAWS-X): the pooled [CLS] state, then a linear layer."""

    def __init__(self, encoder, num_labels, dropout=0.1):
        super().__init__()
        if num_labels < 2:  # one class has cross-entropy 0 (transformers reads num_labels 1 as regression)
            raise ValueError(f"a classifier needs at least 2 labels, got {num_labels}")
        self.encoder = encoder
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(encoder.config.hidden_size, num_labels)
        init_weights(self.classifier)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None):
        pooled = self.encoder.pool(self.encoder(input_ids, token_type_ids, attention_mask))
        logits = self.classifier(self.dropout(pooled))  # (B, C)
        return logits, None if labels is None else F.cross_entropy(logits.float(), labels.view(-1))  # (B,) or (B, 1)


class TokenClassifier(SequenceClassifier):
    """Tagging (NER, POS): the same layers at every piece, not the pooled [CLS]. The loss is the mean over the
    labelled pieces (labels -100: non-first pieces, specials, padding), 0 when there are none."""

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None):
        logits = self.classifier(self.dropout(self.encoder(input_ids, token_type_ids, attention_mask)))
        if labels is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        return logits, loss / (labels != -100).sum().clamp(min=1)


class SpanExtractor(nn.Module):
    """Extractive QA (XQuAD, MLQA, TyDiQA-GoldP): start and end logits over the pieces."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder
        self.qa_outputs = nn.Linear(encoder.config.hidden_size, 2)
        init_weights(self.qa_outputs)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None,
                start_positions=None, end_positions=None):
        logits = self.qa_outputs(self.encoder(input_ids, token_type_ids, attention_mask)).float()
        start_logits, end_logits = logits.unbind(-1)  # (B, T) each
        if start_positions is None or end_positions is None:
            return start_logits, end_logits, None
        T = start_logits.size(1)  # as transformers: positions (B,) or (B, 1), clamped to [0, T]; T is ignored
        start, end = (positions.reshape(-1).clamp(0, T) for positions in (start_positions, end_positions))
        loss = F.cross_entropy(start_logits, start, ignore_index=T) + F.cross_entropy(end_logits, end, ignore_index=T)
        return start_logits, end_logits, loss / 2


# ----------------------------------------------------------------------------------------------
# Initialisation, the paper's parameter accounting, checkpoints

def init_weights(module):
    """BERT's initialisation: N(0, 0.02) weights, zero biases (LayerNorm starts as torch makes it: gain 1, bias 0)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def count_parameters(model):
    """The paper's two counts (Tables 2-6): "finetuning" is what fine-tuning keeps (embeddings,
    projection, kept layers, pooler; no task head); "pretraining" adds the pre-training-only layers
    and the MLM head (whose output embedding is free when tied). Takes a MaskedLM or an Encoder."""
    encoder = model.encoder if isinstance(model, MaskedLM) else model
    if not isinstance(encoder, Encoder):
        raise TypeError(f"count_parameters takes a MaskedLM or an Encoder, got {type(model).__name__}")
    return {"pretraining": sum(p.numel() for p in model.parameters()),  # (a tied matrix is one parameter)
            "finetuning": sum(p.numel() for p in encoder.parameters())}


def load_checkpoint(path):
    """torch.load, after checking the CRC-32 of every record (torch.load does not: a damaged file would give wrong
    weights): a pytorch_model.bin, or finetune.py's training state."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        if damaged:
            raise DataError(f"{path}: damaged: its record {damaged} fails its CRC check")
        return torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, DataError):
        raise
    except Exception as e:  # whatever a damaged zip or pickle raises (BadZipFile, zlib.error, UnpicklingError...)
        raise DataError(f"{path}: damaged or not a checkpoint (torch.save's zip) ({type(e).__name__}: {e})") from None


CHECKPOINT_INFO = "checkpoint.json"  # pretrain.py writes it last: a directory without it is an interrupted save
CHECKPOINT_NAME = re.compile(r"ckpt-(\d{8})")  # a pre-training run's own folders: ckpt-STEP, 8 digits
_INFO_TYPES = {"step": int, "config": dict, "train_config": dict, "processes": int, "tokenizer": dict, "sha256": dict}


def read_checkpoint_info(path, verify=True):
    """checkpoint.json of a pretrain.py checkpoint directory, checked, not trusted: each field of the type written,
    the step the folder's number, the digest list naming exactly the folder's regular files (no link, nothing missing
    or extra) and (verify) each file with its SHA-256, the metadata of torch.distributed.checkpoint free of code."""
    info_path = os.path.join(path, CHECKPOINT_INFO)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such checkpoint")
    try:
        if not stat.S_ISREG(os.lstat(info_path).st_mode):  # (a FIFO or a device would hang the reader)
            raise DataError(f"{info_path}: damaged (not a regular file)")
        with open(info_path) as f:
            info = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        raise DataError(f"{path}: no {CHECKPOINT_INFO}: an interrupted save, or not a pretrain.py checkpoint "
                        f"directory") from None
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(f"{info_path}: damaged or not pretrain.py's ({type(e).__name__}: {e})") from None
    if problem := _info_problem(path, info):
        raise DataError(f"{info_path}: damaged or not pretrain.py's ({problem})")
    for name, digest in sorted(info["sha256"].items()):
        if not os.path.lexists(os.path.join(path, name)):
            raise DataError(f"{os.path.join(path, name)}: missing or unreadable (listed in {CHECKPOINT_INFO})")
        if not stat.S_ISREG(os.lstat(os.path.join(path, name)).st_mode):  # (a link, a FIFO: never opened)
            raise DataError(f"{os.path.join(path, name)}: damaged (not a regular file)")
    for name, digest in sorted(info["sha256"].items()) if verify else []:
        try:
            found = sha256(os.path.join(path, name))
        except OSError as e:
            raise DataError(f"{os.path.join(path, name)}: missing or unreadable ({e.strerror})") from None
        if found != digest:
            raise DataError(f"{os.path.join(path, name)}: damaged (its SHA-256 is not the one saved with it)")
    if verify:
        read_metadata(path)
    return info


def _info_problem(path, info):
    """What is wrong with checkpoint.json's `info` for the directory `path`, or None."""
    if not isinstance(info, dict):
        return "not a JSON object"
    if wrong := [k for k, kind in _INFO_TYPES.items() if type(info.get(k)) is not kind]:  # (True is no step)
        return f"{wrong[0]}: {info.get(wrong[0])!r} is not a {_INFO_TYPES[wrong[0]].__name__}"
    number = CHECKPOINT_NAME.fullmatch(os.path.basename(os.path.normpath(path)))
    if number and info["step"] != int(number[1]):
        return f"step {info['step']} in the folder of step {int(number[1])}"
    if problem := typed_fields(ModelConfig, info["config"]):
        return f"config: {problem}"
    if not all(type(info["tokenizer"].get(k)) is str for k in ("path", "sha256")):
        return "tokenizer: no path and sha256 strings"
    if not all(type(v) is str for v in info["sha256"].values()) or ".metadata" not in info["sha256"]:
        return "its digest list: no .metadata, or a digest that is no string"
    if extra := sorted({n for n in os.listdir(path) if n != CHECKPOINT_INFO} - info["sha256"].keys()):
        return f"{extra[0]} is in the folder but not in its digest list"
    if odd := [n for n in info["sha256"] if n in ("", ".", "..", CHECKPOINT_INFO) or os.path.basename(n) != n]:
        return f"its digest list names {odd[0]!r}, not a file of the folder"  # ('../x', '/dev/zero')
    return None


def typed_fields(cls, values):
    """What keeps the dict `values` from being exactly the fields of the dataclass `cls`, each of its type (JSON's
    integer is a float too), or None."""
    names = [f.name for f in fields(cls)]
    if not isinstance(values, dict) or sorted(values) != sorted(names):
        return f"not the fields of {cls.__name__}"
    for f in fields(cls):
        value = values[f.name]
        if not (type(value) is f.type or f.type is float and type(value) is int):
            return f"{f.name}: {value!r} is not a {f.type.__name__}"
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint keeps its metadata as a pickle, which pickle.load would let name any function to
    call: this admits the checkpoint library's metadata classes and what they hold, and nothing else."""
    ALLOWED = {"torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                                         "ChunkStorageMetadata", "BytesStorageMetadata",
                                                         "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
               "torch.distributed.checkpoint.filesystem": {"_StorageInfo"}, "torch.serialization": {"_get_layout"},
               "torch": {"Size"}, "pathlib": {"PosixPath", "PurePosixPath"}, "collections": {"OrderedDict"}}

    def find_class(self, module, name):
        if name in self.ALLOWED.get(module, ()) or module == "torch" and isinstance(getattr(torch, name, 0),
                                                                                  torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never holds")


def read_metadata(path):
    """The checkpoint's torch.distributed.checkpoint Metadata, read without running anything, its items tensors
    in the folder's own files (the checkpoint library reads any other item with torch.load(weights_only=False))."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
    where = os.path.join(path, ".metadata")
    try:
        with open(where, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # (whatever a damaged or crafted pickle raises)
        raise DataError(f"{where}: refused, not a checkpoint's metadata ({type(e).__name__}: {e})") from None
    items = getattr(metadata, "state_dict_metadata", None)
    if not (isinstance(metadata, Metadata) and isinstance(items, dict) and isinstance(metadata.storage_data, dict)):
        raise DataError(f"{where}: refused, not a checkpoint's metadata")
    # The checkpoint library reads any item that is no tensor with torch.load(weights_only=False): none is read.
    metadata.state_dict_metadata = {k: v for k, v in items.items() if isinstance(v, TensorStorageMetadata)}
    files = set(os.listdir(path))
    if any(getattr(s, "relative_path", None) not in files for s in metadata.storage_data.values()):
        raise DataError(f"{where}: refused: it points outside the checkpoint's folder")
    return metadata


def checkpoint_reader(path):
    """torch.distributed.checkpoint's reader of the folder, its metadata read by `read_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(path)
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata
    return Reader(path)


def one_line(error):
    """What failed, in one line: the checkpoint library wraps each process's error, traceback included, in its own."""
    import torch.distributed.checkpoint as dcp
    while isinstance(error, dcp.CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]  # (its failures: rank -> (exception, traceback))
    if getattr(error, "errno", None) == 28:  # ENOSPC
        return f"no space left on device: {error}"
    if isinstance(error, OSError):
        return str(error)
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ----------------------------------------------------------------------------------------------
# The Hugging Face layout (transformers' RemBERT), both ways. Our names -> theirs, per module:

_HF_ENCODER = {"embeddings.norm": "embeddings.LayerNorm", "embedding_projection": "encoder.embedding_hidden_mapping_in",
               "pooler": "pooler.dense"}  # the embedding tables have the same names
_HF_LAYER = {"attention.query": "attention.self.query", "attention.key": "attention.self.key",
             "attention.value": "attention.self.value", "attention.out": "attention.output.dense",
             "attention_norm": "attention.output.LayerNorm", "intermediate": "intermediate.dense",
             "output": "output.dense", "output_norm": "output.LayerNorm"}
_HF_HEAD = {"dense": "dense", "norm": "LayerNorm", "decoder": "decoder"}
_HF_CONFIG = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
              "num_heads": "num_attention_heads", "intermediate_size": "intermediate_size",
              "input_embedding_size": "input_embedding_size", "output_embedding_size": "output_embedding_size",
              "max_position_embeddings": "max_position_embeddings", "type_vocab_size": "type_vocab_size",
              "layer_norm_eps": "layer_norm_eps", "dropout": "hidden_dropout_prob"}
# Where a directory keeps its weights, in the order from_pretrained looks (an index names the shards of one).
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def hf_name(name, table=_HF_ENCODER):
    """transformers' name of one of our parameters ("layers.3.attention.query.weight" ->
    "encoder.layer.3.attention.self.query.weight"), without the "rembert." of the task models."""
    module, parameter = name.rsplit(".", 1)
    if module.startswith("layers."):
        _, i, rest = module.split(".", 2)
        return f"encoder.layer.{i}.{_HF_LAYER[rest]}.{parameter}"
    return f"{table.get(module, module)}.{parameter}"


def _read_hf(path):
    """(ModelConfig, {name: tensor}) of a Hugging Face RemBERT directory, "rembert." cut from the names."""
    import safetensors.torch
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = {"hidden_dropout_prob": 0.0, **json.load(f)}  # a missing key: transformers' default
        config = ModelConfig(**{ours: hf[theirs] for ours, theirs in _HF_CONFIG.items() if theirs in hf},
                             tie_embeddings=hf.get("tie_word_embeddings", False))
    except (KeyError, TypeError, ValueError, RecursionError) as e:  # (json.JSONDecodeError is a ValueError)
        raise DataError(f"{path}/config.json: not a RemBERT config ({type(e).__name__}: {e})") from None
    if (hf.get("model_type", "rembert") != "rembert" or hf.get("hidden_act", "gelu") not in ("gelu", "gelu_python")
            or hf.get("is_decoder")):  # another architecture, another non-linearity, causal attention
        raise DataError(f"{path}/config.json: supported are RemBERT encoders (model_type rembert, is_decoder false) "
                        f"with hidden_act 'gelu'")
    if hf.get("attention_probs_dropout_prob", 0.0) != config.dropout:
        warnings.warn(f"{path}/config.json: attention_probs_dropout_prob is not hidden_dropout_prob, used for both")
    found = next((os.path.join(path, name) for name in _HF_WEIGHTS if os.path.exists(os.path.join(path, name))), None)
    if found is None:
        raise DataError(f"{path}: neither model.safetensors nor pytorch_model.bin")
    if found.endswith(".index.json"):  # (what lies beside it may be an earlier save's: not read instead)
        raise DataError(f"{found}: a checkpoint in shards, not read here; save it as one file (max_shard_size)")
    try:
        state = safetensors.torch.load_file(found) if found.endswith(".safetensors") else load_checkpoint(found)
    except safetensors.SafetensorError as e:
        raise DataError(f"{found}: not a readable safetensors file ({e})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise DataError(f"{found}: its weights are not a dict of named tensors")
    return config, {k.removeprefix("rembert."): v for k, v in state.items()}


def _copy_tensors(module, state, names, path):
    """Copy state[names[ours]] into each of `module`'s tensors, checking every name, shape and value."""
    own = module.state_dict()
    with torch.no_grad():
        for ours, theirs in names.items():
            if theirs not in state:
                raise DataError(f"{path}: the checkpoint has no {theirs}")
            if state[theirs].shape != own[ours].shape:
                raise DataError(f"{path}: {theirs} has shape {tuple(state[theirs].shape)}, "
                                f"{ours} needs {tuple(own[ours].shape)}")
            if not state[theirs].isfinite().all():  # a damaged or diverged model: no use to train or measure
                raise DataError(f"{path}: {theirs} holds NaN or infinite values")
            own[ours].copy_(state[theirs])


def _load_hf_encoder(encoder, state, path):
    """Copy the encoder's tensors; the pooler (RemBertForMaskedLM saves none) may be absent: returns whether."""
    names = {name: hf_name(name) for name in encoder.state_dict()}
    if unused := sorted(k for k in state if k.startswith("encoder.layer.") and k not in names.values()):
        raise DataError(f"{path}: config.json says {encoder.config.num_layers} layers, but it also holds {unused[0]}")
    pooler = "pooler.dense.weight" in state
    if not pooler:  # as transformers does: the pooler keeps its initialisation
        names = {ours: theirs for ours, theirs in names.items() if not ours.startswith("pooler.")}
    if encoder.config.input_embedding_size == encoder.config.hidden_size:
        # transformers always projects E_in to H, this model not when E_in == H: the same only for the identity.
        H = encoder.config.hidden_size
        weight, bias = (state.get(hf_name(f"embedding_projection.{p}"), torch.empty(0)) for p in ("weight", "bias"))
        if not (torch.equal(weight, torch.eye(H).to(weight)) and torch.equal(bias, torch.zeros(H).to(bias))):
            raise DataError(f"{path}: input_embedding_size == hidden_size, but its E_in -> H projection is not "
                            f"the identity; this implementation has no projection when E_in == H")
    _copy_tensors(encoder, state, names, path)
    return pooler


def save_hf(model, path):
    """Write `model` as transformers' RemBERT (config.json, model.safetensors): a MaskedLM as RemBertForMaskedLM (its
    pre-training-only layers have no place there: refused), an Encoder as RemBertModel, a task model as RemBertFor..."""
    from safetensors.torch import save_file
    if isinstance(model, MaskedLM):
        if model.config.pretraining_only_layers:
            raise ValueError("RemBERT's Hugging Face layout has no pre-training-only layers; export model.encoder")
        architecture, encoder, prefix = "RemBertForMaskedLM", model.encoder, "rembert."
        extra = {"cls.predictions." + hf_name(name, _HF_HEAD): t for name, t in model.head.state_dict().items()}
    elif isinstance(model, Encoder):
        architecture, encoder, prefix, extra = "RemBertModel", model, "", {}
    elif isinstance(model, (SequenceClassifier, TokenClassifier, SpanExtractor)):
        task = {SequenceClassifier: "SequenceClassification", TokenClassifier: "TokenClassification",
                SpanExtractor: "QuestionAnswering"}[type(model)]
        architecture, encoder, prefix = f"RemBertFor{task}", model.encoder, "rembert."
        extra = {name: t for name, t in model.state_dict().items() if not name.startswith("encoder.")}  # the head
    else:
        raise TypeError(f"save_hf cannot export a {type(model).__name__}")
    config = encoder.config
    state = {prefix + hf_name(name): t for name, t in encoder.state_dict().items()} | extra
    if config.input_embedding_size == config.hidden_size:  # transformers always projects: the identity
        state[prefix + hf_name("embedding_projection.weight")] = torch.eye(config.hidden_size)
        state[prefix + hf_name("embedding_projection.bias")] = torch.zeros(config.hidden_size)
    hf_config = {theirs: getattr(config, ours) for ours, theirs in _HF_CONFIG.items()}
    hf_config.update(architectures=[architecture], model_type="rembert", hidden_act="gelu", pad_token_id=0,
                     tie_word_embeddings=config.tie_embeddings, attention_probs_dropout_prob=config.dropout)
    if isinstance(model, (SequenceClassifier, TokenClassifier)):
        hf_config["num_labels"] = model.classifier.out_features
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    # Clones: a tied output embedding is its own tensor in the file (safetensors refuses shared memory).
    try:
        save_file({name: t.detach().cpu().clone() for name, t in state.items()},
                  os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    except Exception as e:  # a full disk: safetensors raises its own error, which names no file
        raise OSError(f"{path}/model.safetensors: saving failed ({e})") from e
