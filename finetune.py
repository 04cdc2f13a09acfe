r"""Fine-tuning RemBERT on the paper's XTREME tasks with zero-shot cross-lingual transfer (Section 3, "Tasks";
Tables 2-7): train on English data only, evaluate every target language with the same model, report each and the mean.

Tasks: sentence pairs (xnli, pawsx), tagging (panx, udpos) and extractive QA (xquad, mlqa, tydiqa, with
google-research/bert's run_squad.py features and n-best decoding). A pretrain.py checkpoint loses its
pre-training-only layers and MLM head, as in the paper.

Defaults follow Appendix A.3 (Tables 10 and 15). The table reported (stdout, --out-dir/results.json) is the mean
over --seeds of the rate with the best average of the task's first metric, as the paper reports its dev sets.

  CPU:      python finetune.py --task panx --init out/pretrain/ckpt-00000800 --lr 3e-3 --epochs 3 \
                --batch-size 16 --train data/panx/train-en.tsv --eval data/panx/dev-*.tsv
  one GPU:  python finetune.py --task xnli --init rembert/ --device cuda --seeds 1 2 3 \
                --train data/xnli/train-en.tsv --eval data/xnli/dev-*.tsv
  torchrun: torchrun --standalone --nproc_per_node=8 finetune.py --task xquad --init rembert/ \
                --device cuda --train data/squad/train-v1.1.json --eval data/xquad/xquad.*.json
  TPU VM:   PJRT_DEVICE=TPU python finetune.py --task xnli --init rembert/ --device xla \
                --train data/xnli/train-en.tsv --eval data/xnli/dev-*.tsv
  predict:  python finetune.py predict --model out/finetune/lr-0.003/seed-0 --task panx \
                --input data/panx/test-de.tsv --output pred-de.tsv
"""

import copy
import hashlib
import itertools
import json
import math
import os
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace

import torch

import data
import evaluate
from configs import (CONFIGS, DEVICE, FRACTION, GIVEN, POSITIVE, SEED, at_least, check_flags, flag, one_of,
                     parse_command_line, run_script)
from checkpoints import (CHECKPOINT_INFO, DataError, RunFolder, check_finite, from_checkpoint, from_hf,
                         read_json, save_hf, sha256, write_file, write_json)
from model import Encoder, SequenceClassifier, SpanExtractor, TokenClassifier
from pretrain import build_optimizer, lr_at, weights_are_sound
from runtime import launch, setup_runtime


@dataclass(frozen=True)
class Task:
    kind: str  # "classification" | "tagging" | "qa"
    labels: tuple  # label names (classification, tagging); () for QA
    lrs: tuple  # Table 10: the peak learning rates swept (batch 32, 3 epochs)
    rembert: tuple  # Table 15: (learning rate, batch size) for RemBERT
    seq_len: int
    metrics: tuple  # the figures of evaluate.py that the table shows (percent); the first picks the lr


# Table 10 has one "SQuAD" row (all three QA tasks train on English SQuAD data) and no POS row: POS sweeps NER's.
SQUAD_LRS = (2e-5, 3e-5, 4e-5)
NER_LRS = (1e-5, 2e-5, 3e-5, 4e-5, 5e-5)
TASKS = {
    "xnli": Task("classification", evaluate.CLASSIFICATION_LABELS["xnli"], (1e-5, 2e-5, 3e-5), (1e-5, 128), 128,
                 ("accuracy",)),
    "pawsx": Task("classification", evaluate.CLASSIFICATION_LABELS["pawsx"], (3e-5, 4e-5, 5e-5), (8e-6, 128), 128,
                  ("accuracy",)),
    "panx": Task("tagging", evaluate.TAGGING_LABELS["panx"], NER_LRS, (8e-6, 64), 128, ("f1", "precision", "recall")),
    "udpos": Task("tagging", evaluate.TAGGING_LABELS["udpos"], NER_LRS, (3e-5, 128), 128, ("f1", "accuracy")),
    **dict.fromkeys(("xquad", "mlqa", "tydiqa"), Task("qa", (), SQUAD_LRS, (9e-6, 128), 384, ("f1", "exact_match"))),
}


@dataclass
class FinetuneConfig:
    task: str = flag("", f"one of {', '.join(TASKS)}", one_of(TASKS))
    init: str = flag("", "the encoder: a pretrain.py checkpoint or a Hugging Face dir")
    config: str = flag("", f"instead of --init, random weights: {', '.join(CONFIGS)}")
    tokenizer: str = flag("", "SentencePiece model (default: the --init's)")
    train: str = flag("", "the English training file", GIVEN)
    train_fraction: float = flag(1.0, "train on this first part of --train, evaluate --eval on the rest (QA: whole "
                                 "articles)", (lambda v: 0 < v <= 1, "in (0, 1]"))
    max_train: int = flag(0, "use only the first N training examples (0: all)", at_least(0))
    eval: list[str] = flag([], "FILE or LANG=FILE (without LANG=: the file's language column, name or folder)", GIVEN)
    max_eval: int = flag(0, "evaluate only the first N examples per language (0: all)", at_least(0))
    out_dir: str = flag("out/finetune", "fine-tuned models and results.json", GIVEN)
    device: str = flag("auto", "auto | cpu | cuda | xla", DEVICE)
    seq_len: int = flag(0, "pieces per sequence (0: 128, or 384 for QA)", (lambda v: v == 0 or v >= 8, "0 or >= 8"))
    doc_stride: int = flag(128, "QA: pieces between the starts of a context's windows", POSITIVE)
    max_query_length: int = flag(64, "QA: question pieces kept", POSITIVE)
    max_answer_length: int = flag(30, "QA: longest answer span decoded, in pieces", POSITIVE)
    n_best: int = flag(20, "QA: start and end candidates per window", POSITIVE)
    batch_size: int = flag(0, "training sequences per step, all processes (0: 32; RemBERT: Table 15's)", at_least(0))
    eval_batch_size: int = flag(64, "evaluation sequences per process and step", POSITIVE)
    epochs: int = flag(3, "passes over the training data (Table 10: 3)", POSITIVE)
    lr: list[float] = flag([], "peak learning rates, a run each, the best reported (default: Table 10/15)", POSITIVE)
    warmup_fraction: float = flag(0.1, "fraction of the steps spent warming up", FRACTION)
    weight_decay: float = flag(0.01, "AdamW weight decay (not on biases, LayerNorm)", at_least(0))
    max_grad_norm: float = flag(1.0, "clip the global gradient norm to this", POSITIVE)
    dropout: float = flag(0.1, "dropout before the output layer (classification, tagging; QA has none)", FRACTION)
    seeds: list[int] = flag([0], "one run per seed, averaged (paper: 3)", SEED)
    keep_layers: int = flag(0, "keep only the encoder's first K layers (Figure 1; 0: all)", at_least(0))
    log_every: int = flag(20, "steps between log lines", POSITIVE)
    checkpoint_every: int = flag(500, "steps between saves of the training state", POSITIVE)
    resume: bool = flag(False, "continue the runs in --out-dir: finished ones keep their scores, the rest their state")

    def __post_init__(self):
        check_flags(self)
        if bool(self.init) == bool(self.config) or (self.config and self.config not in CONFIGS):
            raise ValueError(f"pass exactly one of --init (a checkpoint or Hugging Face directory) and --config "
                             f"({', '.join(CONFIGS)})")
        if self.config and not self.tokenizer:
            raise ValueError("--config (random weights) needs --tokenizer")
        seq_len = self.seq_len or TASKS[self.task].seq_len
        if TASKS[self.task].kind == "qa" and seq_len <= self.max_query_length + 3:  # run_squad.py's check
            raise ValueError(f"--seq-len {seq_len} leaves no room for the context after --max-query-length "
                             f"{self.max_query_length} and [CLS] [SEP] [SEP]; it must be more than their sum")
        lr = max(self.lr or TASKS[self.task].lrs)  # (the default rates are at most Table 10's)
        if lr * self.weight_decay >= 1:
            raise ValueError(f"--weight-decay {self.weight_decay} x the learning rate {lr} must be below 1: AdamW "
                             f"scales the weights by 1 - their product at every step")


# What features and decoding read, saved with each model for `predict`, and the files its digests cover.
SETTINGS = ("seq_len", "doc_stride", "max_query_length", "max_answer_length", "n_best")
SAVED = ("model.safetensors", "sentencepiece.model", "config.json", "finetune.json")
# What a fine-tuned model does not depend on: an out-dir may be resumed when everything else is the same.
NOT_TRAINING = {"out_dir", "device", "eval_batch_size", "log_every", "checkpoint_every", "resume", "lr", "seeds"}


@dataclass
class PredictConfig:
    """predict with a model that finetune.py saved, in the format `evaluate.py score` reads"""
    model: str = flag("", "a run directory finetune.py saved (out/finetune/lr-R/seed-N)", GIVEN)
    task: str = flag("", "the task of --input (a QA model answers any QA task)", one_of(TASKS))
    input: str = flag("", "a file in the task's format, labelled or not", GIVEN)
    output: str = flag("", "labels, token<TAB>label lines, or JSON {id: answer}", GIVEN)
    device: str = flag("auto", "auto | cpu | cuda | xla", DEVICE)
    batch_size: int = flag(64, "sequences per batch", POSITIVE)

    def __post_init__(self):
        check_flags(self)
        if os.path.lexists(self.output):  # (the input, a results file, a link: nothing is lost to a mistyped name)
            raise ValueError(f"--output {self.output} exists: predictions replace no file; remove it or choose another")
        if not os.path.isdir(os.path.dirname(os.path.abspath(self.output))):
            raise ValueError(f"--output {self.output}: no such directory")
        if os.path.dirname(os.path.realpath(self.output)) == os.path.realpath(self.model):
            raise ValueError("--output is in --model's directory, which holds the model's files alone")


def to_tensors(features, seq_len, pad_id):
    """Features (dicts of per-position lists, per-sequence ints) -> (N, seq_len) / (N,) tensors and "attention_mask"."""
    pads = {"input_ids": pad_id, "token_type_ids": 0, "attention_mask": 0}  # the rest (labels): -100, no loss
    columns = {}
    for f in features:
        for key, value in {**f, "attention_mask": [1] * len(f["input_ids"])}.items():
            if isinstance(value, list):  # one per position, padded to seq_len (a copy: the features stay as made)
                value = value + [pads.get(key, -100)] * (seq_len - len(value))
            columns.setdefault(key, []).append(value)
    return {key: torch.tensor(values) for key, values in columns.items()}


def pair_features(tokenizer, examples, labels, seq_len):
    """[CLS] sentence1 [SEP] sentence2 [SEP], the longer sentence cut first (BERT's _truncate_seq_pair)."""
    features = []
    for e in examples:
        a, b = tokenizer.encode(e.sentence1), tokenizer.encode(e.sentence2)
        while len(a) + len(b) > seq_len - 3:
            (a if len(a) > len(b) else b).pop()
        features.append({"input_ids": [tokenizer.cls_id, *a, tokenizer.sep_id, *b, tokenizer.sep_id],
                         "token_type_ids": [0] * (len(a) + 2) + [1] * (len(b) + 1),
                         "labels": -100 if e.label is None else labels.index(e.label)})  # read_pairs checked it
    return to_tensors(features, seq_len, tokenizer.pad_id)


def tagging_features(tokenizer, examples, labels, seq_len, training=True):
    """One row per sentence: [CLS] each word's pieces ([UNK] for none) [SEP], its label on the first piece (-100
    elsewhere; 0 without gold labels, marking the words for tagging_predictions). Words past seq_len are cut."""
    features, cut = [], 0
    for e in examples:
        ids, row_labels = [tokenizer.cls_id], [-100]
        for k, word in enumerate(e.tokens):
            pieces = tokenizer.encode(word) or [tokenizer.unk_id]
            if len(ids) + len(pieces) > seq_len - 1:
                cut += len(e.tokens) - k
                break
            ids += pieces
            row_labels += [0 if e.labels is None else labels.index(e.labels[k])]  # read_tagging checked it
            row_labels += [-100] * (len(pieces) - 1)
        features.append({"input_ids": ids + [tokenizer.sep_id], "token_type_ids": [0] * (len(ids) + 1),
                         "labels": row_labels + [-100]})
    if cut:
        warnings.warn(f"{cut} words did not fit in {seq_len} pieces (--seq-len): the model does not see them; "
                      + ("training learns nothing from them" if training else f"they are tagged {labels[0]!r}"))
    return to_tensors(features, seq_len, tokenizer.pad_id)


def tagging_predictions(examples, tensors, predictions, labels):
    """(N, T) predicted label indices -> per example, a label per word: the one at its first piece (labels != -100)."""
    words = [[labels[i] for i in predicted[gold != -100].tolist()]
             for gold, predicted in zip(tensors["labels"], predictions)]
    return [w + [labels[0]] * (len(e.tokens) - len(w)) for e, w in zip(examples, words)]


def squad_features(tokenizer, examples, seq_len, doc_stride, max_query_length, training=False):
    """run_squad.py's convert_examples_to_features: [CLS] question [SEP] context window [SEP], the question cut to
    max_query_length pieces. training=True adds start_positions / end_positions (the first answer's pieces; 0, the
    [CLS], when the window does not hold it). Returns (tensors, meta); meta[i] = {"example": index into examples,
    "offsets": the context's (start, end) characters at each position (None elsewhere), "max_context": [bool]}."""
    features, meta = [], []
    for index, e in enumerate(examples):
        question = tokenizer.encode(e.question)[:max_query_length]
        context_ids, offsets = tokenizer.encode_with_offsets(e.context)
        room = seq_len - len(question) - 3
        if room < 1:  # (FinetuneConfig refuses such flags; a model's finetune.json is read as it is)
            raise DataError(f"{e.source}: seq_len {seq_len} leaves no room for the context")
        if training:  # (read_examples saw to an answer)
            start_char = e.answers[0]["answer_start"]
            end_char = start_char + len(e.answers[0]["text"])
            # The answer's pieces: from the first piece ending after its start to the last starting before its
            # end, among those that show a character (not a lone "▁", not the leading bytes of a character).
            shown = [k for k, (start, end) in enumerate(offsets) if start < end]
            first = next((k for k in shown if offsets[k][1] > start_char), len(offsets))
            last = max((k for k in shown if offsets[k][0] < end_char), default=-1)
            if first > last:  # an answer of blanks alone (" ", U+200B) shows in no piece: nothing to point at
                raise DataError(f"{e.source}: the answer {e.answers[0]['text']!r} covers no piece of the context")
        # run_squad.py's doc spans: a window every doc_stride pieces, until one reaches the context's end.
        windows, start = [], 0
        while True:
            windows.append((start, min(room, len(context_ids) - start)))
            if start + room >= len(context_ids):
                break
            start += min(room, doc_stride)
        for w_start, w_len in windows:
            window = context_ids[w_start:w_start + w_len]
            ids = [tokenizer.cls_id, *question, tokenizer.sep_id, *window, tokenizer.sep_id]
            shift = len(question) + 2  # position of the window's first piece
            feature = {"input_ids": ids, "token_type_ids": [0] * shift + [1] * (w_len + 1)}
            if training:
                inside = w_start <= first and last < w_start + w_len
                feature["start_positions"] = first - w_start + shift if inside else 0
                feature["end_positions"] = last - w_start + shift if inside else 0
            features.append(feature)
            max_context = [_is_max_context(windows, (w_start, w_len), w_start + k) for k in range(w_len)]
            meta.append({"example": index, "offsets": [None] * shift + offsets[w_start:w_start + w_len] + [None],
                         "max_context": [False] * shift + max_context + [False]})
    return to_tensors(features, seq_len, tokenizer.pad_id), meta


def _is_max_context(windows, window, position):
    """run_squad.py's _check_is_max_context: a piece in several windows counts in the one where it has most context."""
    scores = {(start, length): min(position - start, start + length - 1 - position) + 0.01 * length
              for start, length in windows if start <= position < start + length}
    return max(scores, key=scores.get) == window  # (the first of equals, as there)


def decode_spans(examples, meta, start_logits, end_logits, n_best=20, max_answer_length=30):
    """run_squad.py's n-best decoding of predict's (float, CPU) logits: over an example's windows, the n_best highest
    start and end logits; of the pairs that qualify (below), the best start + end logit wins, cut from the ORIGINAL
    context by character offsets (no detokenization). Returns {question id: answer text} ("" when none qualifies)."""
    best = {}  # example index -> (score, text)
    for i, m in enumerate(meta):
        offsets, example = m["offsets"], m["example"]
        # The positions that may bound an answer: context pieces with a character of their own.
        shows = [o is not None and o[0] < o[1] for o in offsets] + [False] * (start_logits.shape[1] - len(offsets))
        starts = torch.topk(start_logits[i], min(n_best, start_logits.shape[1])).indices.tolist()
        ends = torch.topk(end_logits[i], min(n_best, end_logits.shape[1])).indices.tolist()
        for s, t in itertools.product(starts, ends):
            if shows[s] and m["max_context"][s] and shows[t] and s <= t < s + max_answer_length:
                score = float(start_logits[i, s] + end_logits[i, t])
                if example not in best or score > best[example][0]:
                    best[example] = (score, examples[example].context[offsets[s][0]:offsets[t][1]])
    return {e.id: best[k][1] if k in best else "" for k, e in enumerate(examples)}


def features(task, tokenizer, examples, settings, training):
    if task.kind == "qa":
        return squad_features(tokenizer, examples, settings["seq_len"], settings["doc_stride"],
                              settings["max_query_length"], training=training)
    if task.kind == "classification":
        return pair_features(tokenizer, examples, task.labels, settings["seq_len"]), None
    return tagging_features(tokenizer, examples, task.labels, settings["seq_len"], training), None


def build_encoder(cfg, log):
    if cfg.config:
        encoder = Encoder(CONFIGS[cfg.config])
        log(f"random {cfg.config} encoder")
    elif os.path.isfile(os.path.join(cfg.init, "config.json")):
        encoder = from_hf(cfg.init, Encoder)
        log(f"{cfg.init}: Hugging Face RemBERT encoder")
    else:
        model = from_checkpoint(cfg.init)
        encoder = model.encoder
        kept, total = (sum(p.numel() for p in m.parameters()) for m in (encoder, model))
        log(f"{cfg.init}: kept the encoder ({kept:,} parameters); dropped {total - kept:,} "
            f"({model.config.pretraining_only_layers} pre-training-only layers + the MLM head)")
    if cfg.keep_layers:
        if cfg.keep_layers > encoder.config.num_layers:
            raise DataError(f"--keep-layers {cfg.keep_layers}: the encoder has {encoder.config.num_layers} layers")
        encoder.layers = encoder.layers[:cfg.keep_layers]
        encoder.config = replace(encoder.config, num_layers=cfg.keep_layers)
        log(f"kept the first {cfg.keep_layers} layers (Figure 1)")
    return encoder


def encoder_and_tokenizer(cfg, log):
    """(the encoder, its tokenizer, cfg with the paper's defaults for that encoder filled in)."""
    base = build_encoder(cfg, log)
    cfg = with_defaults(cfg, base.config, log)
    if cfg.seq_len > base.config.max_position_embeddings:
        raise DataError(f"--seq-len {cfg.seq_len}: the encoder has {base.config.max_position_embeddings} positions")
    if TASKS[cfg.task].kind != "tagging" and base.config.type_vocab_size < 2:  # (a pair's second text: segment 1)
        raise DataError(f"{cfg.init or 'the encoder'}: type_vocab_size 1, but {cfg.task}'s pairs take 2 segment types")
    log(f"finetune config: {asdict(cfg)}")
    tokenizer = data.tokenizer_for(cfg.init, cfg.tokenizer) if cfg.init else data.Tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > base.config.vocab_size:
        raise DataError(f"{tokenizer.model_file} has {tokenizer.vocab_size} pieces, more than the model's vocab_size "
                        f"{base.config.vocab_size}: not the model's tokenizer")
    return base, tokenizer, cfg


def build_model(task, encoder, dropout):
    if task.kind == "classification":
        return SequenceClassifier(encoder, len(task.labels), dropout)
    # Only the sentence classifier reads the pooler: frozen here, DDP sees no unused parameters.
    encoder.pooler.requires_grad_(False)
    if task.kind == "tagging":
        return TokenClassifier(encoder, len(task.labels), dropout)
    return SpanExtractor(encoder)


def save_finetuned(model, cfg, tokenizer, path):
    """transformers' RemBertFor... layout, the tokenizer, then finetune.json: a directory with it is complete."""
    with data.open_input(tokenizer.model_file) as f:
        spm_model = f.read()
    if hashlib.sha256(spm_model).hexdigest() != tokenizer.sha256:  # (replaced while the run trained)
        raise DataError(f"{tokenizer.model_file} is not the tokenizer this run read at its start: not saved with the "
                        f"model; put that one back and pass --resume")
    save_hf(model, path)
    write_file(os.path.join(path, "sentencepiece.model"), lambda f: f.write(spm_model), "wb")  # (the bytes checked)
    info = {k: getattr(cfg, k) for k in ("task", *SETTINGS)}
    info["sha256"] = {n: sha256(os.path.join(path, n)) for n in SAVED[:-1]}
    info["sha256"]["finetune.json"] = settings_digest(info)  # its own settings
    write_json(os.path.join(path, "finetune.json"), info)


def settings_digest(info):
    return hashlib.sha256(json.dumps([info[k] for k in ("task", *SETTINGS)]).encode()).hexdigest()


def load_finetuned(path):
    from safetensors import SafetensorError, safe_open
    if not os.path.isfile(os.path.join(path, "finetune.json")):  # (the folder of a run that finished has one)
        pretrained = os.path.isfile(os.path.join(path, CHECKPOINT_INFO))
        raise DataError(f"{path}: {'a pre-training checkpoint' if pretrained else 'no finetune.json'}, not a model "
                        f"finetune.py saved; fine-tune first, then predict with its run's folder (OUT/lr-RATE/seed-N)")
    try:
        info = read_json(os.path.join(path, "finetune.json"))
        task, digests = TASKS[info["task"]], dict(info["sha256"])
        if not all(type(info[k]) is int and info[k] > 0 for k in SETTINGS):
            raise ValueError(f"{', '.join(SETTINGS)} must be positive integers")
        if sorted(digests) != sorted(SAVED):  # (a file left out of the list would go unchecked)
            raise ValueError(f"its sha256 are not the digests of {', '.join(SAVED)}")
    except (OSError, ValueError, KeyError, TypeError) as e:  # (a DataError of read_json's is a ValueError)
        said = e if isinstance(e, DataError) else repr(e)  # (a DataError names the file: said once)
        raise DataError(f"{path}: not a model saved by finetune.py (finetune.json: {said})") from None
    if digests.pop("finetune.json") != settings_digest(info):
        raise DataError(f"{os.path.join(path, 'finetune.json')}: damaged or edited (its settings' SHA-256 is not the "
                        f"one saved with them)")
    model = build_model(task, from_hf(path, Encoder), dropout=0.0)  # (its files checked with their digests first)
    try:  # the head's weights alone (from_hf read the rest)
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            head = {n: f.get_tensor(n) for n in model.state_dict() if not n.startswith("encoder.")}
        model.load_state_dict(head, strict=False)
    except (SafetensorError, RuntimeError) as e:  # finetune.json names another task than the weights were trained for
        raise DataError(f"{path}: no {info['task']} head in model.safetensors ({' '.join(str(e).split())})") from None
    check_finite(os.path.join(path, "model.safetensors"), head)
    tokenizer, config = data.Tokenizer(os.path.join(path, "sentencepiece.model")), model.encoder.config
    if not 8 <= info["seq_len"] <= config.max_position_embeddings or tokenizer.vocab_size > config.vocab_size:
        raise DataError(f"{path}: its seq_len {info['seq_len']} (finetune.json) or {tokenizer.vocab_size} pieces "
                        f"(sentencepiece.model) do not fit the model's 8 to {config.max_position_embeddings} positions "
                        f"and vocab_size {config.vocab_size}")
    return model, tokenizer, info


def read_examples(task, path, labelled=True, named=None):
    data.open_input(path, named or f"--train {path}").close()  # (missing, or a FIFO: named by its flag, not read)
    if task.kind == "qa":
        examples = data.read_squad(path)
        if labelled and (unanswered := [e.source for e in examples if not e.answered]):
            raise DataError(f"{unanswered[0]}: no answer to train or evaluate on, or a blank one")
        return examples
    if task.kind == "classification":
        return data.read_pairs(path, task.labels, labelled)
    return data.read_tagging(path, task.labels, labelled, spaces=task is not TASKS["panx"])


def eval_spec(spec):
    """--eval's LANG=FILE as (LANG, FILE); a FILE, also one whose path holds "=", as (None, FILE)."""
    lang, _, path = spec.partition("=")
    return (lang, path) if path and os.sep not in lang and not os.path.exists(spec) else (None, spec)


def by_language(examples, spec):
    """{language: examples} of an --eval file: by its language column (XNLI 1.0) or question ids (TyDiQA-GoldP),
    else one language from LANG=FILE or the file's name or folder (dev-de.tsv, xquad.de.json, x-final/de/dev_2k.tsv;
    MLQA's dev-context-de-question-en.json: de, the language its answers are normalized in)."""
    languages = [getattr(e, "language", None) or evaluate.TYDI_LANGUAGES.get(getattr(e, "id", "").split("-")[0])
                 for e in examples]
    if all(languages):  # in the order they first appear
        return {lang: [e for e, its in zip(examples, languages) if its == lang] for lang in dict.fromkeys(languages)}
    name, path = eval_spec(spec)
    if not name and (mlqa := re.search(r"context-([a-z]{2})-question", os.path.basename(path))):
        return {mlqa[1]: examples}
    for part in (os.path.basename(path), os.path.basename(os.path.dirname(path))):
        codes = {t for t in re.split(r"[-._]", part) if re.fullmatch(r"[a-z]{2}", t)}
        if name or len(codes) == 1:
            return {name or codes.pop(): examples}
    raise DataError(f"--eval {spec}: cannot tell the language from the file's name; write it as LANG=FILE")


def split_train(task, examples, fraction):
    """The first `fraction` of the training file: whole articles for QA (a context never lands on both sides),
    else sentences or lines, a premise's lines together. Returns (train examples, held_out(index, example) -> bool)."""
    if fraction == 1.0:
        return examples, lambda i, e: True
    if task.kind == "qa":
        articles = list(dict.fromkeys(e.article for e in examples))
        keep = set(articles[:math.ceil(fraction * len(articles))])
        train = [e for e in examples if e.article in keep]
        train_ids = {e.id for e in train}
        return train, lambda i, e: e.id not in train_ids
    n = math.ceil(fraction * len(examples))
    if task.kind == "classification":  # XNLI gives three hypotheses a premise, on consecutive lines
        while n < len(examples) and examples[n].sentence1 == examples[n - 1].sentence1:
            n += 1
    return examples[:n], lambda i, e: i >= n


def eval_sets(cfg, task, held_out):
    """{language: examples} of the --eval files, without what --train-fraction trained on."""
    sets = {}
    for spec in cfg.eval:
        named, path = eval_spec(spec)
        found = read_examples(task, path, named=f"--eval {spec}")
        if cfg.train_fraction == 1 and os.path.getsize(path) == os.path.getsize(cfg.train) and (
                sha256(path) == sha256(cfg.train)):  # the same file, or a copy of it
            raise DataError(f"--eval {spec} is the --train file; hold part of it out with --train-fraction")
        languages = by_language(found, spec)
        if named and list(languages) != [named]:  # (a language column or TyDiQA's ids, which by_language reads first)
            raise DataError(f"--eval {spec}: its language column or question ids give {', '.join(languages)}, which "
                            f"{named}= neither renames nor picks from; drop {named}=")
        for lang, examples in languages.items():
            if lang in sets or lang == "average":
                raise DataError(f"--eval {spec}: two sets for {lang!r} (or the table's average row); give each "
                                f"language one file (LANG=FILE names it where no column, question ids or file name do)")
            sets[lang] = [e for i, e in enumerate(examples) if held_out(i, e)][:cfg.max_eval or None]
            if not sets[lang]:
                raise DataError(f"--eval {spec}: no {lang} examples left to evaluate (all used for training?)")
            if cfg.task == "mlqa":
                evaluate.check_mlqa_language(lang, path, f"the language of --eval {spec}")
    return sets


def schedule(n, cfg, runtime):
    """(sequences per process and step, steps per epoch, steps, warm-up steps) for `n` training sequences."""
    if cfg.batch_size % runtime.world_size:
        raise DataError(f"--batch-size {cfg.batch_size} does not split over {runtime.world_size} processes")
    if n < cfg.batch_size:
        raise DataError(f"{n} training sequences are fewer than one batch ({cfg.batch_size}); lower --batch-size")
    total = n // cfg.batch_size * cfg.epochs  # an epoch's last partial batch is dropped: static shapes
    return cfg.batch_size // runtime.world_size, n // cfg.batch_size, total, int(cfg.warmup_fraction * total)


def train(model, tensors, cfg, lr, seed, runtime, folder, tokenizer, log):
    """Fine-tune `model` in place, from its run's newest state in `folder` if there is one (its data is a function
    of the step; docs/scaling.md says what a resumed run gives on as many processes and on another number)."""
    n, per_step = tensors["input_ids"].shape[0], cfg.batch_size
    per_process, steps_per_epoch, total, warmup = schedule(n, cfg, runtime)
    ddp_model = runtime.wrap_model(model)
    optimizer = build_optimizer(model, lr, cfg.weight_decay)
    part, run_config = folder.part(lr, seed), {**asdict(cfg), "lr": [lr], "seeds": [seed]}
    same = {**asdict(model.encoder.config), "lr": [lr], "seeds": [seed],  # (the files: by what they hold, run_settings)
            **{k: v for k, v in run_config.items() if k not in NOT_TRAINING | {"init", "tokenizer", "train", "eval"}}}
    first = folder.restore(model, optimizer, same, (total, f"its {total} steps"), seed, part=part)

    def batches():
        generator = torch.Generator().manual_seed(seed)  # the same order in every process
        for epoch in range(cfg.epochs):
            order = torch.randperm(n, generator=generator)
            for step in range(max(0, first - epoch * steps_per_epoch), steps_per_epoch):
                start = step * per_step + runtime.rank * per_process
                yield {k: v[order[start:start + per_process]] for k, v in tensors.items()}

    log(f"training: {n} sequences, {total} steps of {per_step} ({steps_per_epoch} per epoch), "
        f"lr {lr!r}, warm-up {warmup}")
    ddp_model.train()
    stats = torch.zeros(2, device=runtime.device)  # [sum of losses, steps]: read only when logging
    last_log, last_step = time.time(), first
    for step, batch in enumerate(runtime.loader(batches()), first):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, warmup, total, lr)
        with runtime.autocast():
            loss = ddp_model(**batch)[-1]
        # Tagging: the loss is the mean over the global batch's labelled tokens, whatever each process holds
        # (DDP averages the processes' gradients, hence x world_size).
        if "labels" in batch and batch["labels"].ndim == 2 and runtime.world_size > 1:
            tokens = (batch["labels"] != -100).sum().float()
            loss = loss * tokens * runtime.world_size / runtime.all_reduce_sum(tokens.clone()).clamp(min=1)
        loss.backward()
        runtime.optimizer_step(optimizer, cfg.max_grad_norm)
        optimizer.zero_grad(set_to_none=True)
        stats += torch.stack([loss.detach().float(), torch.ones((), device=runtime.device)])
        checkpoint = (step + 1) % cfg.checkpoint_every == 0 or step + 1 == total
        if not (checkpoint or (step + 1) % cfg.log_every == 0):
            continue
        # The host sync: the loss is checked at every log line, the weights too before every save.
        loss_sum, count = runtime.all_reduce_sum(stats.clone()).tolist()
        stats.zero_()
        if not math.isfinite(loss_sum):
            raise FloatingPointError(f"the loss became {loss_sum / count} by step {step + 1}; try a lower --lr")
        if checkpoint and not weights_are_sound(model, batch, runtime):
            raise FloatingPointError(f"the update of step {step + 1} broke the weights; try a lower --lr")
        if checkpoint:
            folder.save(step + 1, model, optimizer, model.encoder.config, run_config, tokenizer, part=part)
        now = time.time()
        speed = (step + 1 - last_step) * per_step / (now - last_log)
        log(f"step {step + 1:>5}/{total} | loss {loss_sum / count:.4f} | lr {lr_at(step, warmup, total, lr):.2e} "
            f"| {speed:.1f} seq/s | left {(total - step - 1) * per_step / speed / 60:.1f} min")
        last_log, last_step = now, step + 1


@torch.no_grad()
def predict(model, tensors, batch_size, runtime):
    """Model outputs for every row of `tensors`, in order, on the CPU; every process runs as many full batches."""
    inputs = {k: tensors[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
    n = inputs["input_ids"].shape[0]
    per_step = batch_size * runtime.world_size
    padded = math.ceil(n / per_step) * per_step
    inputs = {k: torch.cat([v, v.new_zeros((padded - n, *v.shape[1:]))]) for k, v in inputs.items()}
    batches = ({k: v[start:start + batch_size] for k, v in inputs.items()}
               for start in range(runtime.rank * batch_size, padded, per_step))
    model.eval()
    outputs = []
    for batch in runtime.loader(batches):
        with runtime.autocast():
            out = model(**batch)[:-1]  # drop the (None) loss
        outputs.append([o.float().cpu() for o in out])
    per_rank = runtime.gather_object(outputs)  # [rank][batch][output]
    ordered = [per_rank[r][b] for b in range(len(outputs)) for r in range(runtime.world_size)]
    return [torch.cat(column)[:n] for column in zip(*ordered)]


def predict_examples(model, tokenizer, task, examples, settings, batch_size, runtime):
    tensors, meta = features(task, tokenizer, examples, settings, training=False)
    outputs = predict(model, tensors, batch_size, runtime)
    if task.kind == "classification":
        return [task.labels[i] for i in outputs[0].argmax(-1).tolist()]
    if task.kind == "tagging":
        return tagging_predictions(examples, tensors, outputs[0].argmax(-1), task.labels)
    return decode_spans(examples, meta, *outputs, settings["n_best"], settings["max_answer_length"])


def predict_file(cfg):
    model, tokenizer, info = load_finetuned(cfg.model)
    task = TASKS[cfg.task]
    if cfg.task != info["task"] and not task.kind == TASKS[info["task"]].kind == "qa":  # SQuAD -> MLQA is fine
        raise DataError(f"{cfg.model} was fine-tuned for {info['task']}; it cannot predict {cfg.task}'s labels")
    runtime = setup_runtime(cfg.device)
    examples = read_examples(task, cfg.input, labelled=False, named=f"--input {cfg.input}")
    predictions = predict_examples(model.to(runtime.device), tokenizer, task, examples, info, cfg.batch_size, runtime)
    if task.kind == "qa":
        text = json.dumps(predictions, ensure_ascii=False)
    elif task.kind == "tagging":
        text = "\n".join("".join(f"{token}\t{tag}\n" for token, tag in zip(e.tokens, tags))
                         for e, tags in zip(examples, predictions))
    else:
        text = "".join(label + "\n" for label in predictions)
    write_file(cfg.output, lambda f: f.write(text))  # written whole: a crash leaves no half file
    print(f"wrote {cfg.output}: {cfg.task} predictions for the {len(examples)} examples of {cfg.input}")


def with_defaults(cfg, encoder_config, log):
    task, rembert = TASKS[cfg.task], CONFIGS["rembert"]
    if all(getattr(encoder_config, k) == getattr(rembert, k) for k in ("hidden_size", "intermediate_size")):
        lrs, batch_size, source = [task.rembert[0]], task.rembert[1], "Table 15's, for an encoder of RemBERT's shape"
    else:
        lrs, batch_size, source = list(task.lrs), 32, "Table 10's"
    given = " and ".join(name for name, value in (("--lr", cfg.lr), ("--batch-size", cfg.batch_size)) if value)
    cfg = replace(cfg, lr=cfg.lr or lrs, batch_size=cfg.batch_size or batch_size, seq_len=cfg.seq_len or task.seq_len)
    log(f"defaults: {source}: learning rates {', '.join(f'{lr:g}' for lr in lrs)}, batch {batch_size}" + (
        f"; overridden by {given}: learning rates {', '.join(f'{lr:g}' for lr in cfg.lr)}, batch {cfg.batch_size}"
        if given else ""))
    return cfg


def run_settings(cfg, runtime):
    """What makes an --out-dir's runs runs of this command: its training settings and the files read, by real path
    and SHA-256 (a file changed in place makes another run; of an --init folder, those read from it: its
    CHECKPOINT_INFO holds the rest's digests)."""
    ours = {k: v for k, v in asdict(cfg).items() if k not in NOT_TRAINING}
    for key in ("init", "tokenizer", "train"):
        ours[key] = ours[key] and os.path.realpath(ours[key])
    evals = [(lang, os.path.realpath(file)) for lang, file in map(eval_spec, cfg.eval)]
    ours["eval"] = [f"{lang}={file}" if lang else file for lang, file in evals]
    read = ("config.json", "model.safetensors", "pytorch_model.bin", "sentencepiece.model", CHECKPOINT_INFO)
    paths = [ours["init"], ours["tokenizer"], ours["train"], *(file for _, file in evals)]
    files = [f for p in paths for f in ([os.path.join(p, n) for n in read] if os.path.isdir(p) else [p])]
    digests = {f: sha256(f) for f in files if os.path.isfile(f)} if runtime.is_main else None
    ours["sha256"] = runtime.gather_object(digests)[0]  # read once, by rank 0 (an --init may be gigabytes)
    return ours


def average(rows):  # of each metric, over a list of {metric: value}
    return {m: sum(r[m] for r in rows) / len(rows) for m in rows[0]}


def run(cfg):
    """The paper's zero-shot protocol (Section 3): fine-tune on English alone, evaluate every language with that one
    model, and report the learning rate whose average over the languages is best (the mean over --seeds)."""
    runtime = setup_runtime(cfg.device)
    log = (lambda *a: print(*a, flush=True)) if runtime.is_main else (lambda *a: None)
    log(f"runtime: {runtime.describe()}")
    task = TASKS[cfg.task]
    base, tokenizer, cfg = encoder_and_tokenizer(cfg, log)  # read once; every run starts from a copy
    english, evals = read_sets(cfg, task, tokenizer, log)
    folder = RunFolder(cfg.out_dir, runtime, log, cfg.resume, FinetuneConfig, "fine-tuning runs",
                       run_settings(cfg, runtime))
    sweep = {lr: {seed: fine_tune_and_evaluate(cfg, task, base, tokenizer, english, evals, lr, seed, folder, runtime,
                                               log) for seed in cfg.seeds} for lr in cfg.lr}

    tables = {lr: {lang: average([runs[s][lang] for s in cfg.seeds]) for lang in runs[cfg.seeds[0]]}
              for lr, runs in sweep.items()}
    metric = task.metrics[0]
    best = max(cfg.lr, key=lambda lr: tables[lr]["average"][metric])
    if len(cfg.lr) > 1:
        log("learning rates: " + ", ".join(f"{lr!r}: {tables[lr]['average'][metric]:.2f}" for lr in cfg.lr)
            + f" (average {metric}); best {best!r}")
    evaluate.print_table(f"{cfg.task}: fine-tuned on {os.path.basename(cfg.train)}, zero-shot, lr {best!r}, "
                         f"mean over {len(cfg.seeds)} seed(s)", tables[best], log)
    if runtime.is_main:
        path = os.path.join(cfg.out_dir, "results.json")
        write_json(path, {"config": asdict(cfg), "lr": best, "results": tables[best], "per_seed": sweep[best],
                          "per_lr": {repr(lr): table for lr, table in tables.items()}})
        log(f"wrote {path}")
    return tables[best]


def read_sets(cfg, task, tokenizer, log):
    """(the English training tensors, {language: evaluation examples}): one language to train on, and
    --train-fraction's held-out part of it evaluated with the --eval files."""
    examples = read_examples(task, cfg.train)
    if len(by_language(examples, "en=" + cfg.train)) > 1:
        raise DataError(f"{cfg.train}: holds several languages; zero-shot transfer trains on one (English)")
    train_examples, held_out = split_train(task, examples, cfg.train_fraction)
    train_examples = train_examples[:cfg.max_train or None]
    english, _ = features(task, tokenizer, train_examples, asdict(cfg), training=True)
    evals = eval_sets(cfg, task, held_out)
    log(f"{cfg.train}: {len(train_examples)} training examples; evaluating "
        + ", ".join(f"{lang} ({len(examples)})" for lang, examples in evals.items()))
    return english, evals


def fine_tune_and_evaluate(cfg, task, base, tokenizer, english, evals, lr, seed, folder, runtime, log):
    """One run of the sweep: its scores per language and their average (a finished run's, recorded before)."""
    part = folder.part(lr, seed)
    where = os.path.join(folder.path, part)
    if (scores := folder.finished(part)) is not None:  # (only with --resume: the folder saw to that)
        if not (isinstance(scores, dict) and scores.keys() == {*evals, "average"}
                and all(isinstance(row, dict) and row.keys() == set(task.metrics) for row in scores.values())
                and all(type(v) in (int, float) and 0 <= v <= 100 for row in scores.values() for v in row.values())
                and all(math.isclose(v, scores["average"][m]) for m, v in average([scores[k] for k in evals]).items())):
            raise DataError(f"{where}/scores.json: not the scores of these languages and metrics, percentages "
                            f"averaged (damaged?)")
        log(f"{where} was finished before; its scores are reused")
        return scores
    torch.manual_seed(seed)  # the head's initialisation (the encoder's with --config) and dropout
    model = build_model(task, Encoder(base.config) if cfg.config else copy.deepcopy(base), cfg.dropout)
    train(model, english, cfg, lr, seed, runtime, folder, tokenizer, log)
    scores = {}
    for lang, examples in evals.items():
        predicted = predict_examples(model, tokenizer, task, examples, asdict(cfg), cfg.eval_batch_size, runtime)
        result = evaluate.task_scores(cfg.task, examples, predicted, lang)
        scores[lang] = {m: result[m] for m in task.metrics}
    scores["average"] = average(list(scores.values()))
    evaluate.print_table(f"{cfg.task}, lr {lr!r}, seed {seed}", scores, log)
    # The model (a refusal stops every process), then scores.json (written last: the run is done), then no state.
    runtime.on_main(lambda: save_finetuned(model.cpu(), cfg, tokenizer, where))
    folder.record(part, scores)
    log(f"saved the fine-tuned model to {where}")
    return scores


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["predict"]:
        return predict_file(parse_command_line(__doc__, {"predict": PredictConfig}, argv)[1])
    _, cfg = parse_command_line(__doc__, FinetuneConfig, argv)
    return launch(run, cfg.device, cfg)


if __name__ == "__main__":
    run_script(main)
