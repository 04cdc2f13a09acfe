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

The computation and the weight names follow Hugging Face's `modeling_rembert.py`, so the released
RemBERT checkpoint loads with `MaskedLM.from_hf` and matches it numerically. Unlike that
implementation, the masked-LM head gathers the masked positions before it projects to E_out and the
vocabulary (google-research/bert's `gather_indexes`): with 15% of positions masked it skips about
85% of the output layer, the largest matrix of the model. The last Transformer layer is computed
at those positions too (`run_layers`), and for sentence classification at [CLS] alone: its other
outputs feed nothing.

This file imports only torch and the standard library, so it can be copied alone.
"""

import json
import os
import struct
import sys
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    vocab_size: int = 250300
    hidden_size: int = 1152  # H
    num_layers: int = 32  # the layers kept for fine-tuning
    num_heads: int = 18
    intermediate_size: int = 4608
    input_embedding_size: int = 256  # E_in
    output_embedding_size: int = 1664  # E_out
    tie_embeddings: bool = False  # coupled input/output embedding: needs E_in == E_out
    pretraining_only_layers: int = 0  # extra layers on top, dropped for fine-tuning
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    dropout: float = 0.1  # hidden and attention dropout

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type is int and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"ModelConfig.{f.name} must be an int, got {value!r}")
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                    "input_embedding_size", "output_embedding_size", "max_position_embeddings",
                    "type_vocab_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.pretraining_only_layers < 0:
            raise ValueError(f"ModelConfig.pretraining_only_layers must be >= 0, got {self.pretraining_only_layers}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.tie_embeddings and self.input_embedding_size != self.output_embedding_size:
            raise ValueError(
                f"tie_embeddings=True shares one matrix between input and output, so it needs "
                f"input_embedding_size == output_embedding_size (got {self.input_embedding_size} and "
                f"{self.output_embedding_size}); set tie_embeddings=False to decouple them")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")


# ----------------------------------------------------------------------------------------------
# Transformer layer (post-LayerNorm, as BERT and RemBERT)

class Dropout(nn.Dropout):
    """nn.Dropout, with a cheaper mask on CPU, where drawing it is the largest cost after the
    matmuls (F.dropout's bernoulli_ costs ~12% of a small training step; benchmark.py). One int32
    draw makes two 16-bit uniforms: random_() draws int32s in [0, 2^31), so (little-endian) the low
    half is uniform on [-2^15, 2^15) and the high half on [0, 2^15), each with its own threshold.
    Drops with probability p to within 2^-15. Elsewhere F.dropout is fused and used as is."""

    def forward(self, x):
        if not self.training or self.p == 0.0 or x.device.type != "cpu" or x.numel() % 2:
            return super().forward(x)
        halves = torch.empty(x.numel() // 2, dtype=torch.int32).random_().view(torch.int16).view(-1, 2)
        thresholds = torch.tensor([round(self.p * 2**16) - 2**15, round(self.p * 2**15)], dtype=torch.int16)
        keep = (halves >= thresholds).view(x.shape)
        return x * (keep * (1.0 / (1.0 - self.p)))


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = Dropout(config.dropout)  # of the attention probabilities
        # One matmul for queries, keys and values; from_hf/save_hf split it into HF's three.
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, mask, queries=None):
        """Self-attention over x (B, T, H); with `queries` (B, P, H), hidden states gathered from x,
        the output (B, P, H) at those positions only: they attend to all of x."""
        B, T, H = x.shape
        heads, head_dim = self.num_heads, H // self.num_heads
        if queries is None:
            q, k, v = self.qkv(x).view(B, T, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        else:
            weight, bias = self.qkv.weight, self.qkv.bias
            q = F.linear(queries, weight[:H], bias[:H]).view(B, -1, heads, head_dim).transpose(1, 2)
            k, v = F.linear(x, weight[H:], bias[H:]).view(B, T, 2, heads, head_dim).permute(2, 0, 3, 1, 4)
        # q: (B, heads, P, head_dim); k, v: (B, heads, T, head_dim)
        if self.training and self.dropout.p > 0 and x.device.type == "cpu":
            # On CPU, SDPA drops attention probabilities only in its unfused path and with the slow
            # bernoulli_ draw; spelled out with `Dropout`, a training step is ~8% faster.
            scores = q @ k.transpose(-1, -2) * head_dim ** -0.5  # (B, heads, P, T)
            y = self.dropout((scores if mask is None else scores + mask).softmax(-1)) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask.to(q.dtype),
                                               dropout_p=self.dropout.p if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, -1, H))


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.dropout)

    def forward(self, x, mask, queries=None):
        """x (B, T, H) -> (B, T, H); or, given `queries` (B, P, H) gathered from x, (B, P, H) at those
        positions: attention reads all of x, the rest of the layer runs at P positions only."""
        h = x if queries is None else queries
        h = self.attention_norm(h + self.dropout(self.attention(x, mask, queries)))
        return self.output_norm(h + self.dropout(self.output(F.gelu(self.intermediate(h)))))


def run_layers(layers, x, mask, positions=None):
    """Apply `layers` in turn. With `positions` (B, P), return (B, P, H) at those positions only, and
    compute the last layer there alone: nothing reads its other outputs. A masked-LM step needs
    its 15% masked positions, a sentence classifier only [CLS]: the last layer shrinks by that much
    (as the flash-attention BERT's `subset_mask`; google-research/bert gathers after the encoder)."""
    *first, last = layers
    for layer in first:
        x = layer(x, mask)
    return last(x, mask, None if positions is None else gather(x, positions))


def gather(x, positions):
    """x (B, T, H) at positions (B, P) -> (B, P, H)."""
    return torch.gather(x, 1, positions[:, :, None].expand(-1, -1, x.shape[-1]))


def attention_bias(attention_mask):
    """(B, T) 1/0 padding mask -> additive bias (B, 1, 1, T). A large negative number rather than
    -inf keeps an all-padding row (a padded evaluation batch) finite instead of NaN."""
    if attention_mask is None:
        return None
    return (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min


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
        self.dropout = Dropout(config.dropout)

    def forward(self, input_ids, token_type_ids):
        T = input_ids.shape[1]
        if T > self.position_embeddings.num_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings "
                             f"{self.position_embeddings.num_embeddings}")
        # Slicing the table (not an arange) creates no tensor on the host: XLA-safe.
        x = self.word_embeddings(input_ids) + self.position_embeddings.weight[:T]
        x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.norm(x))  # (B, T, E_in)


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

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, output_hidden_states=False,
                positions=None):
        """Hidden states (B, T, H), or (B, P, H) at `positions` (B, P) only (see `run_layers`). With
        `output_hidden_states`, also every layer's input and the last output, each (B, T, H)."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        mask = attention_bias(attention_mask)
        x = self.embedding_projection(self.embeddings(input_ids, token_type_ids))  # (B, T, H)
        if not output_hidden_states:
            return run_layers(self.layers, x, mask, positions)
        if positions is not None:
            raise ValueError("output_hidden_states needs every position: pass positions=None")
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
        _load_mapped(encoder, state, _hf_encoder_names(config, "rembert."), path)
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
        if config.tie_embeddings:
            self.head.decoder.weight = self.encoder.embeddings.word_embeddings.weight  # (V, E) both ways

    def forward(self, input_ids, token_type_ids=None, attention_mask=None,
                masked_positions=None, masked_ids=None, masked_weights=None):
        """Logits (B, P, V) at `masked_positions` (B, P), or (B, T, V) at every position when None.
        The loss, when `masked_ids` (B, P) are given, is the `masked_weights`-weighted mean
        cross-entropy over the predictions (weight 0 marks padding)."""
        if self.pretraining_layers:
            x = self.encoder(input_ids, token_type_ids, attention_mask)
            x = run_layers(self.pretraining_layers, x, attention_bias(attention_mask), masked_positions)
        else:
            x = self.encoder(input_ids, token_type_ids, attention_mask, positions=masked_positions)
        logits = self.head(x)  # like the last layer, only at the masked positions when given
        if masked_ids is None:
            return logits, None
        if masked_weights is None:
            masked_weights = torch.ones_like(masked_ids, dtype=torch.float32)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), masked_ids.flatten(), reduction="none")
        weights = masked_weights.flatten().float()
        return logits, (loss * weights).sum() / weights.sum().clamp(min=1.0)

    @classmethod
    def from_hf(cls, path):
        """Load a RemBERT checkpoint in the Hugging Face layout: a directory with config.json and
        model.safetensors or pytorch_model.bin, as `save_pretrained` writes it (e.g. google/rembert).
        The released checkpoint has no MLM head; then the head keeps its fresh initialisation."""
        config, state = _read_hf(path)
        model = cls(config)
        names = {f"encoder.{ours}": hf for ours, hf in _hf_encoder_names(config, "rembert.").items()}
        head = {f"head.{ours}.{p}": f"cls.predictions.{hf}.{p}"
                for ours, hf in _HF_HEAD_NAMES.items() for p in ("weight", "bias")}
        if all(hf in state for hf in head.values()):
            names.update(head)
        else:
            warnings.warn(f"{path} has no masked-LM head (cls.predictions.*): the head is freshly initialised")
        _load_mapped(model, state, names, path, ignore=set(head))
        return model


# ----------------------------------------------------------------------------------------------
# Task heads for fine-tuning (XTREME): each returns a tuple whose last element is the loss or None

class SequenceClassifier(nn.Module):
    """Sentence(-pair) classification (XNLI, PAWS-X): the pooled [CLS] state, then a linear layer."""

    def __init__(self, encoder, num_labels, dropout=0.1):
        super().__init__()
        self.encoder = encoder
        self.dropout = Dropout(dropout)
        self.classifier = nn.Linear(encoder.config.hidden_size, num_labels)
        init_weights(self.classifier)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None):
        cls = torch.zeros_like(input_ids[:, :1])  # (B, 1): the last layer runs at [CLS] only
        pooled = self.encoder.pool(self.encoder(input_ids, token_type_ids, attention_mask, positions=cls))
        logits = self.classifier(self.dropout(pooled))  # (B, C)
        return logits, None if labels is None else F.cross_entropy(logits.float(), labels)


class TokenClassifier(nn.Module):
    """Tagging (NER, POS): a label per piece; labels -100 (non-first pieces, specials, padding) are ignored."""

    def __init__(self, encoder, num_labels, dropout=0.1):
        super().__init__()
        self.encoder = encoder
        self.dropout = Dropout(dropout)
        self.classifier = nn.Linear(encoder.config.hidden_size, num_labels)
        init_weights(self.classifier)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None):
        logits = self.classifier(self.dropout(self.encoder(input_ids, token_type_ids, attention_mask)))
        if labels is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


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
        loss = (F.cross_entropy(start_logits, start_positions) + F.cross_entropy(end_logits, end_positions)) / 2
        return start_logits, end_logits, loss


# ----------------------------------------------------------------------------------------------
# Initialisation and the paper's parameter accounting

def init_weights(module):
    """BERT's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def count_parameters(model):
    """The paper's two counts (Tables 2-6): "finetuning" is what fine-tuning keeps (embeddings,
    projection, kept layers, pooler; no task head); "pretraining" adds the pre-training-only layers
    and the MLM head (whose output embedding is free when tied). Takes a MaskedLM or an Encoder."""
    def unique(module):
        return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    encoder = model.encoder if isinstance(model, MaskedLM) else model
    if not isinstance(encoder, Encoder):
        raise TypeError(f"count_parameters takes a MaskedLM or an Encoder, got {type(model).__name__}")
    return {"pretraining": unique(model), "finetuning": unique(encoder)}


# ----------------------------------------------------------------------------------------------
# The Hugging Face layout (transformers' RemBERT), both ways

# The safetensors format, read and written here so that this file needs no package beyond torch: an
# unsigned 64-bit little-endian header length, a JSON header {name: {"dtype", "shape",
# "data_offsets": [begin, end)}} (offsets into the data after it), then the tensors' bytes.
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def load_safetensors(path):
    """{name: tensor} of a .safetensors file (the tensors share one buffer of the file's data)."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian data; this machine is big-endian")
    with open(path, "rb") as f:
        raw = f.read(8)
        try:
            if len(raw) != 8:
                raise ValueError("shorter than its 8-byte header length")
            header = json.loads(f.read(struct.unpack("<Q", raw)[0]))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
        data = bytearray(f.read())
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    state = {}
    for name, info in header.items():
        try:
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            (begin, end), shape = info["data_offsets"], torch.Size(info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a bad header entry {info!r}") from None
        if end - begin != dtype.itemsize * shape.numel() or not 0 <= begin <= end <= len(data):
            raise ValueError(f"{path}: tensor {name!r}: data_offsets {[begin, end]} do not hold a {list(shape)} "
                             f"{info['dtype']} tensor within the file's {len(data)} data bytes")
        state[name] = (torch.frombuffer(data, dtype=dtype, offset=begin, count=shape.numel()).view(shape)
                       if end > begin else torch.empty(shape, dtype=dtype))
    return state


def save_safetensors(tensors, path, metadata=None):
    """Write {name: tensor} as a .safetensors file, which the safetensors package and transformers read."""
    names = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
    tensors = {name: t.detach().cpu() for name, t in tensors.items()}
    header, offset = {}, 0
    for name, t in tensors.items():
        if t.dtype not in names:
            raise ValueError(f"safetensors has no dtype for {name} ({t.dtype})")
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors.values():
            # A contiguous clone owns exactly the tensor's bytes, even for a slice of a larger one (split qkv).
            own = t.clone(memory_format=torch.contiguous_format)
            f.write(bytes(own.view(-1).view(torch.uint8).untyped_storage()))


_HF_LAYER_NAMES = {  # ours -> HF, inside encoder.layer.{i}; qkv is split into three
    "attention.out": "attention.output.dense",
    "attention_norm": "attention.output.LayerNorm",
    "intermediate": "intermediate.dense",
    "output": "output.dense",
    "output_norm": "output.LayerNorm",
}
_HF_HEAD_NAMES = {"dense": "dense", "norm": "LayerNorm", "decoder": "decoder"}
_HF_TASK_HEADS = {  # our head class -> (HF class, our output layer, HF output layer)
    "SequenceClassifier": ("RemBertForSequenceClassification", "classifier", "classifier"),
    "TokenClassifier": ("RemBertForTokenClassification", "classifier", "classifier"),
    "SpanExtractor": ("RemBertForQuestionAnswering", "qa_outputs", "qa_outputs"),
}


def _hf_encoder_names(config, prefix):
    """{our name: HF name, or a tuple of HF names concatenated along dim 0} for an Encoder."""
    names = {
        "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
        "embeddings.norm.weight": "embeddings.LayerNorm.weight",
        "embeddings.norm.bias": "embeddings.LayerNorm.bias",
        "pooler.weight": "pooler.dense.weight",
        "pooler.bias": "pooler.dense.bias",
        "embedding_projection.weight": "encoder.embedding_hidden_mapping_in.weight",
        "embedding_projection.bias": "encoder.embedding_hidden_mapping_in.bias",
    }
    for i in range(config.num_layers):
        hf = f"encoder.layer.{i}."
        for p in ("weight", "bias"):
            names[f"layers.{i}.attention.qkv.{p}"] = tuple(
                f"{hf}attention.self.{n}.{p}" for n in ("query", "key", "value"))
            for ours, theirs in _HF_LAYER_NAMES.items():
                names[f"layers.{i}.{ours}.{p}"] = f"{hf}{theirs}.{p}"
    return {ours: (tuple(prefix + n for n in hf) if isinstance(hf, tuple) else prefix + hf)
            for ours, hf in names.items()}


def _read_hf(path):
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    activation = hf.get("hidden_act", "gelu")
    if activation != "gelu":
        raise ValueError(f"{path}/config.json: hidden_act {activation!r} is not supported (only 'gelu')")
    if hf.get("tie_word_embeddings", False):
        raise ValueError(f"{path}/config.json: tie_word_embeddings=true is not RemBERT's layout")
    if hf.get("hidden_dropout_prob", 0.0) != hf.get("attention_probs_dropout_prob", 0.0):
        warnings.warn(f"{path}/config.json: hidden and attention dropout differ; using hidden_dropout_prob")
    config = ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
        input_embedding_size=hf["input_embedding_size"], output_embedding_size=hf["output_embedding_size"],
        tie_embeddings=False, pretraining_only_layers=0,
        max_position_embeddings=hf["max_position_embeddings"], type_vocab_size=hf["type_vocab_size"],
        layer_norm_eps=hf["layer_norm_eps"], dropout=hf.get("hidden_dropout_prob", 0.0))
    if config.input_embedding_size == config.hidden_size:
        # transformers always builds `embedding_hidden_mapping_in`; here E_in == H means no projection.
        raise ValueError(f"{path}/config.json: input_embedding_size == hidden_size "
                         f"({config.hidden_size}); only factorized checkpoints (E_in != H) are supported")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        state = load_safetensors(os.path.join(path, "model.safetensors"))
    elif os.path.exists(os.path.join(path, "pytorch_model.bin")):
        state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{path}: neither model.safetensors nor pytorch_model.bin")
    # RemBertModel saves without the "rembert." prefix that the task and MLM models use.
    if not any(k.startswith("rembert.") for k in state):
        state = {"rembert." + k: v for k, v in state.items()}
    return config, state


def _load_mapped(model, state, names, path, ignore=()):
    """Copy HF tensors into `model` by name, checking every name and shape; the pooler alone may be
    absent (RemBertForMaskedLM saves none), and then keeps its initialisation."""
    own = model.state_dict()
    missing = [n for n in own if n not in names and n not in ignore]
    if missing:
        raise KeyError(f"no Hugging Face name for {missing[:5]}")
    loaded = set()
    with torch.no_grad():
        for ours, theirs in names.items():
            parts = theirs if isinstance(theirs, tuple) else (theirs,)
            if not all(p in state for p in parts):
                if ours.startswith(("pooler.", "encoder.pooler.")):
                    continue
                raise KeyError(f"{path}: checkpoint lacks {[p for p in parts if p not in state]}")
            tensor = torch.cat([state[p] for p in parts]) if len(parts) > 1 else state[parts[0]]
            if tensor.shape != own[ours].shape:
                raise ValueError(f"{path}: {parts[0]} has shape {tuple(tensor.shape)}, "
                                 f"{ours} expects {tuple(own[ours].shape)}")
            own[ours].copy_(tensor)
            loaded.update(parts)
    unused = [k for k in state if k not in loaded and not k.endswith("position_ids")]
    if unused:
        warnings.warn(f"{path}: {len(unused)} tensors not used, e.g. {unused[:3]}")


def save_hf(model, path):
    """Write `model` as transformers' RemBERT (config.json + model.safetensors): a MaskedLM as
    RemBertForMaskedLM (its pre-training-only layers have no place there and are refused), an
    Encoder as RemBertModel, a task head as the matching RemBertFor... class."""
    kind = type(model).__name__
    if isinstance(model, MaskedLM):
        if model.config.pretraining_only_layers:
            raise ValueError("RemBERT's Hugging Face layout has no pre-training-only layers; "
                             "export model.encoder instead")
        architecture, encoder, prefix = "RemBertForMaskedLM", model.encoder, "rembert."
        extra = {f"cls.predictions.{hf}.{p}": getattr(getattr(model.head, ours), p)
                 for ours, hf in _HF_HEAD_NAMES.items() for p in ("weight", "bias")}
    elif isinstance(model, Encoder):
        architecture, encoder, prefix, extra = "RemBertModel", model, "", {}
    elif kind in _HF_TASK_HEADS:
        architecture, ours, theirs = _HF_TASK_HEADS[kind]
        encoder, prefix = model.encoder, "rembert."
        layer = getattr(model, ours)
        extra = {f"{theirs}.weight": layer.weight, f"{theirs}.bias": layer.bias}
    else:
        raise TypeError(f"save_hf cannot export a {kind}")
    config = encoder.config
    if config.input_embedding_size == config.hidden_size:
        raise ValueError("transformers' RemBERT always projects E_in to H; a model with "
                         "input_embedding_size == hidden_size has no projection to export")
    state = {}
    own = encoder.state_dict()
    for ours, theirs in _hf_encoder_names(config, prefix).items():
        if isinstance(theirs, tuple):
            for name, chunk in zip(theirs, own[ours].chunk(3)):
                state[name] = chunk
        else:
            state[theirs] = own[ours]
    state.update(extra)
    hf_config = {
        "architectures": [architecture], "model_type": "rembert",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "intermediate_size": config.intermediate_size, "input_embedding_size": config.input_embedding_size,
        "output_embedding_size": config.output_embedding_size, "hidden_act": "gelu",
        "hidden_dropout_prob": config.dropout, "attention_probs_dropout_prob": config.dropout,
        "max_position_embeddings": config.max_position_embeddings, "type_vocab_size": config.type_vocab_size,
        "layer_norm_eps": config.layer_norm_eps, "initializer_range": 0.02, "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    if kind in ("SequenceClassifier", "TokenClassifier"):
        hf_config["num_labels"] = model.classifier.out_features
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    save_safetensors(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
