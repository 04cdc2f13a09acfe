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
RemBERT checkpoint loads with `checkpoints.from_hf` and matches it numerically. Unlike there, the masked-LM
head gathers the masked positions first (google-research/bert's `gather_indexes`), skipping about 85%
of the output layer, the largest matrix of the model. This file is the method alone and imports only torch
and the standard library: copied alone, it builds, trains and counts every model of the paper.
"""

from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


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
        if masked_positions is not None:  # google-research/bert's gather_indexes: the masked positions' rows alone
            x = torch.gather(x, 1, masked_positions[:, :, None].expand(-1, -1, x.shape[-1])).flatten(0, 1)  # (B*P, H)
        logits = self.head(x)  # (B*P, V), or (B, T, V) at every position as transformers' RemBertForMaskedLM
        if masked_ids is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, -2).float(), masked_ids.flatten(), reduction="none")
        weights = (masked_ids != -100 if masked_weights is None else masked_weights).flatten().float()
        return logits, (loss * weights).sum() / weights.sum().clamp(min=1.0)


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
