r"""Fine-tuning RemBERT on the XTREME tasks of the paper with zero-shot cross-lingual transfer
(Section 3, "Tasks"; Tables 2-7): fine-tune on English training data only, then evaluate every
target language with the same model, and report each language and the average.

Tasks: sentence-pair classification (xnli, pawsx: `model.SequenceClassifier`), tagging (panx NER,
udpos POS: `model.TokenClassifier`), extractive QA (xquad, mlqa, tydiqa: `model.SpanExtractor`).
The encoder comes from a pre-training checkpoint of pretrain.py (its pre-training-only layers and
MLM head are dropped, as in the paper), a Hugging Face RemBERT directory (e.g. google/rembert, with
its sentencepiece.model), or random weights (--config NAME). `--keep-layers K` keeps only the
encoder's first K layers (Figure 1).

Defaults follow Appendix A.3: batch 32, 3 epochs, and a sweep over Table 10's learning rates (one
run per rate and seed; the rate with the best average of the task's first metric is reported, as
the paper reports its dev sets); for an encoder of RemBERT's shape, Table 15's rate and batch. The
per-language table (mean over --seeds; the paper averages 3) goes to stdout and, with every rate's
and seed's figures, to --out-dir/results.json. Each run's model is saved in transformers' layout
under --out-dir/lr-RATE/seed-N/, where `python finetune.py predict` finds it. A run's training
state is saved atomically every --checkpoint-every steps; after a crash, the same command with
--resume keeps the finished runs and continues the interrupted one to the same weights.

With the shared demo data (../shared/data): XQuAD has no training split, so train on the first
half of the English articles and evaluate all 12 languages on the held-out articles' questions
(--train-fraction; the files are parallel, the ids shared). XNLI and PAWS-X likewise on their
line-parallel dev files. PAN-X trains on train-en.tsv and evaluates the other languages' dev files.

  CPU:      python finetune.py --task panx --init out/pretrain/ckpt-00000800.pt --lr 1e-3 --epochs 10 \
                --train ../shared/data/ner/panx/train-en.tsv --eval ../shared/data/ner/panx/dev-*.tsv
  one GPU:  python finetune.py --task xnli --init rembert/ --device cuda --seeds 1 2 3 \
                --train multinli.train.en.tsv --eval XNLI-1.0/xnli.dev.tsv
  torchrun: torchrun --standalone --nproc_per_node=8 finetune.py --task xquad --init rembert/ \
                --device cuda --train train-v1.1.json --eval xquad/xquad.*.json
  TPU VM:   PJRT_DEVICE=TPU python finetune.py --task xnli --init rembert/ --device xla \
                --train multinli.train.en.tsv --eval xnli/dev-*.tsv
  predict:  python finetune.py predict --model out/finetune/lr-0.001/seed-0 --task panx \
                --input ../shared/data/ner/panx/test-de.tsv --output pred-de.tsv
(--batch-size is the global batch: torchrun's 8 processes each take an eighth of it.)
"""

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

import data
import evaluate
from configs import CONFIGS, parse_command_line, run_script
from model import (DataError, Encoder, MaskedLM, SequenceClassifier, SpanExtractor, TokenClassifier, load_checkpoint,
                   save_hf)
from pretrain import (build_optimizer, lr_at, remove_partial_saves, resolve_device, restore_training_state,
                      setup_runtime, weights_are_sound)


@dataclass(frozen=True)
class Task:
    kind: str  # "classification" | "tagging" | "qa"
    labels: tuple  # label names (classification, tagging); () for QA
    lrs: tuple  # Table 10: the peak learning rates swept (batch 32, 3 epochs)
    rembert: tuple  # Table 15: (learning rate, batch size) for RemBERT
    seq_len: int
    metrics: tuple  # the figures of evaluate.py that the table shows (percent); the first picks the lr


# Table 10 has one "SQuAD" row: all three QA tasks train on English SQuAD-format data. It has no POS
# row; POS sweeps NER's rates.
SQUAD_LRS = (2e-5, 3e-5, 4e-5)
NER_LRS = (1e-5, 2e-5, 3e-5, 4e-5, 5e-5)
TASKS = {
    "xnli": Task("classification", evaluate.CLASSIFICATION_LABELS["xnli"], (1e-5, 2e-5, 3e-5), (1e-5, 128), 128,
                 ("accuracy",)),
    "pawsx": Task("classification", evaluate.CLASSIFICATION_LABELS["pawsx"], (3e-5, 4e-5, 5e-5), (8e-6, 128), 128,
                  ("accuracy",)),
    "panx": Task("tagging", evaluate.TAGGING_LABELS["panx"], NER_LRS, (8e-6, 64), 128, ("f1", "precision", "recall")),
    "udpos": Task("tagging", evaluate.TAGGING_LABELS["udpos"], NER_LRS, (3e-5, 128), 128, ("accuracy",)),
    "xquad": Task("qa", (), SQUAD_LRS, (9e-6, 128), 384, ("f1", "exact_match")),
    "mlqa": Task("qa", (), SQUAD_LRS, (9e-6, 128), 384, ("f1", "exact_match")),
    "tydiqa": Task("qa", (), SQUAD_LRS, (9e-6, 128), 384, ("f1", "exact_match")),
}


@dataclass
class FinetuneConfig:
    task: str = field(default="", metadata={"help": f"one of {', '.join(TASKS)}"})
    init: str = field(default="", metadata={
        "help": "the encoder: a pretrain.py checkpoint (.pt) or a Hugging Face RemBERT directory"})
    config: str = field(default="", metadata={
        "help": f"instead of --init: random weights of a configs.py model ({', '.join(CONFIGS)})"})
    tokenizer: str = field(default="", metadata={
        "help": "SentencePiece model (default: INIT/sentencepiece.model, or the one the checkpoint was trained with)"})
    train: str = field(default="", metadata={"help": "the English training file"})
    train_fraction: float = field(default=1.0, metadata={
        "help": "train on this first fraction of --train (articles for QA, lines or sentences otherwise) and "
                "evaluate only the rest of every --eval file (they must be parallel to --train)"})
    max_train: int = field(default=0, metadata={"help": "use only the first N training examples (0: all)"})
    eval: list[str] = field(default_factory=list, metadata={
        "help": "evaluation files, FILE or LANG=FILE (LANG defaults to the language code in the file's name or "
                "folder; a file with a language column gives one set per language)"})
    max_eval: int = field(default=0, metadata={"help": "evaluate only the first N examples of each language (0: all)"})
    out_dir: str = field(default="out/finetune", metadata={"help": "fine-tuned models and results.json"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | xla"})
    seq_len: int = field(default=0, metadata={"help": "pieces per sequence (0: 128, or 384 for QA)"})
    doc_stride: int = field(default=128, metadata={"help": "QA: pieces between the starts of a context's windows"})
    max_query_length: int = field(default=64, metadata={"help": "QA: question pieces kept"})
    max_answer_length: int = field(default=30, metadata={"help": "QA: longest answer span decoded, in pieces"})
    n_best: int = field(default=20, metadata={"help": "QA: start and end candidates per window"})
    batch_size: int = field(default=0, metadata={
        "help": "training sequences per step, over all processes (0: Table 10's 32, or Table 15's for RemBERT)"})
    eval_batch_size: int = field(default=64, metadata={"help": "evaluation sequences per process and step"})
    epochs: int = field(default=3, metadata={"help": "passes over the training data (Table 10: 3)"})
    lr: list[float] = field(default_factory=list, metadata={
        "help": "peak learning rates, one run per rate and seed; the best (by the first metric's average) is "
                "reported (default: the task's Table 10 sweep, or Table 15's rate for RemBERT)"})
    warmup_fraction: float = field(default=0.1, metadata={"help": "fraction of the steps spent warming up"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay (not on biases, LayerNorm)"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this"})
    dropout: float = field(default=0.1, metadata={"help": "dropout before the task's output layer"})
    seeds: list[int] = field(default_factory=lambda: [0], metadata={
        "help": "one fine-tuning run per seed; the table averages them (the paper: 3)"})
    keep_layers: int = field(default=0, metadata={"help": "keep only the encoder's first K layers (Figure 1; 0: all)"})
    log_every: int = field(default=20, metadata={"help": "steps between log lines"})
    checkpoint_every: int = field(default=500, metadata={
        "help": "steps between saves of the training state (also saved when training ends)"})
    resume: bool = field(default=False, metadata={
        "help": "continue the runs in --out-dir: finished ones keep their scores, an interrupted one "
                "continues from its last saved step"})

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if bool(self.init) == bool(self.config):
            raise ValueError("pass exactly one of --init (a checkpoint or Hugging Face directory) and --config")
        if self.config and self.config not in CONFIGS:
            raise ValueError(f"--config must be one of {', '.join(CONFIGS)}, got {self.config!r}")
        if not self.train or not self.eval:
            raise ValueError("--train and --eval are required")
        if not 0.0 < self.train_fraction <= 1.0:
            raise ValueError(f"--train-fraction must be in (0, 1], got {self.train_fraction}")
        for name in ("eval_batch_size", "epochs", "log_every", "checkpoint_every", "doc_stride", "max_query_length",
                     "max_answer_length", "n_best", "seeds"):
            if (min(self.seeds) < 0 if name == "seeds" else getattr(self, name) < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if min([self.batch_size, self.seq_len, self.max_train, self.max_eval, self.keep_layers, *self.lr]) < 0:
            raise ValueError("--batch-size, --seq-len, --max-train, --max-eval, --keep-layers and --lr must be >= 0")
        resolve_device(self.device)


# What a fine-tuned model does not depend on: an out-dir may be resumed when everything else is the same.
NOT_TRAINING = {"out_dir", "device", "eval_batch_size", "log_every", "checkpoint_every", "resume", "lr", "seeds"}


@dataclass
class PredictConfig:
    """predict with a model that finetune.py saved, in the format `evaluate.py score` reads"""
    model: str = field(default="", metadata={"help": "a run directory finetune.py saved (out/finetune/lr-R/seed-N)"})
    task: str = field(default="", metadata={"help": "the task of --input (a QA model answers any QA task)"})
    input: str = field(default="", metadata={"help": "a file in the task's format, labelled or not"})
    output: str = field(default="", metadata={"help": "xnli/pawsx: one label per line; panx/udpos: token<TAB>label, "
                                                      "a blank line between sentences; QA: JSON {question id: answer}"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | xla"})
    batch_size: int = field(default=64, metadata={"help": "sequences per batch"})

    def __post_init__(self):
        if not (self.model and self.input and self.output) or self.task not in TASKS:
            raise ValueError(f"--model, --input, --output and --task ({', '.join(TASKS)}) are required")
        resolve_device(self.device)


# ----------------------------------------------------------------------------------------------
# The model: an encoder from a checkpoint, a HF directory or random weights, plus the task's head

def encoder_shape(cfg):
    """(layers, hidden size) of the encoder that --init or --config names."""
    if cfg.config:
        return CONFIGS[cfg.config].num_layers, CONFIGS[cfg.config].hidden_size
    if os.path.isdir(cfg.init):
        try:
            with open(os.path.join(cfg.init, "config.json")) as f:
                hf = json.load(f)
        except ValueError as e:
            raise DataError(f"{cfg.init}/config.json: {e}") from None
        return hf.get("num_hidden_layers"), hf.get("hidden_size")
    config = load_checkpoint(cfg.init)["config"]
    return config["num_layers"], config["hidden_size"]


def tokenizer_path(cfg):
    if cfg.tokenizer:
        return cfg.tokenizer
    if cfg.init and os.path.isdir(cfg.init):
        return os.path.join(cfg.init, "sentencepiece.model")
    if cfg.init:  # the checkpoint records the tokenizer it was pre-trained with
        return load_checkpoint(cfg.init)["train_config"]["tokenizer"]
    raise DataError("--config (random weights) needs --tokenizer")


def build_encoder(cfg, log):
    if cfg.config:
        encoder = Encoder(CONFIGS[cfg.config])
        log(f"random {cfg.config} encoder")
    elif os.path.isdir(cfg.init):
        encoder = Encoder.from_hf(cfg.init)
        log(f"{cfg.init}: Hugging Face RemBERT encoder")
    else:
        model = MaskedLM.from_checkpoint(cfg.init)
        encoder = model.encoder
        dropped = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in encoder.parameters())
        log(f"{cfg.init}: kept the encoder ({sum(p.numel() for p in encoder.parameters()):,} parameters); dropped "
            f"{dropped:,} ({model.config.pretraining_only_layers} pre-training-only layers + the MLM head)")
    if cfg.keep_layers:
        if cfg.keep_layers > encoder.config.num_layers:
            raise DataError(f"--keep-layers {cfg.keep_layers}: the encoder has {encoder.config.num_layers} layers")
        encoder.layers = encoder.layers[:cfg.keep_layers]
        encoder.config = dataclasses.replace(encoder.config, num_layers=cfg.keep_layers)
        log(f"kept the first {cfg.keep_layers} layers (Figure 1)")
    return encoder


def build_model(task, encoder, dropout):
    if task.kind == "classification":
        return SequenceClassifier(encoder, len(task.labels), dropout)
    # Only the sentence classifier reads the pooler: frozen here, DDP sees no unused parameters.
    encoder.pooler.requires_grad_(False)
    if task.kind == "tagging":
        return TokenClassifier(encoder, len(task.labels), dropout)
    return SpanExtractor(encoder)


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def save_finetuned(model, cfg, tokenizer_file, path):
    """transformers' RemBertFor... layout, the tokenizer, and finetune.json (the task, its settings and the
    files' digests, written last: a directory with it is complete)."""
    save_hf(model, path)
    shutil.copyfile(tokenizer_file, os.path.join(path, "sentencepiece.model"))
    info = {"task": cfg.task, "seq_len": cfg.seq_len, "doc_stride": cfg.doc_stride,
            "max_query_length": cfg.max_query_length, "max_answer_length": cfg.max_answer_length,
            "n_best": cfg.n_best, "sha256": {name: sha256(os.path.join(path, name))
                                             for name in ("model.safetensors", "sentencepiece.model")}}
    with open(os.path.join(path, "finetune.json.tmp"), "w") as f:
        json.dump(info, f, indent=2)
    os.replace(os.path.join(path, "finetune.json.tmp"), os.path.join(path, "finetune.json"))


def load_finetuned(path):
    """-> (model, tokenizer, info) of a directory written by `save_finetuned`, its files checked first."""
    from safetensors.torch import load_file
    try:
        with open(os.path.join(path, "finetune.json")) as f:
            info = json.load(f)
        task = TASKS[info["task"]]
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{path}: not a model saved by finetune.py (finetune.json: {e})") from None
    for name, digest in info["sha256"].items():
        if sha256(os.path.join(path, name)) != digest:
            raise DataError(f"{os.path.join(path, name)}: damaged (its SHA-256 differs from the one saved with it)")
    model = build_model(task, Encoder.from_hf(path), dropout=0.0)
    head = "qa_outputs" if task.kind == "qa" else "classifier"
    state = load_file(os.path.join(path, "model.safetensors"))
    getattr(model, head).load_state_dict({p: state[f"{head}.{p}"] for p in ("weight", "bias")})
    return model, data.Tokenizer(os.path.join(path, "sentencepiece.model")), info


# ----------------------------------------------------------------------------------------------
# Task data (data.py does the reading, the features and the span decoding)

def read_examples(task, path, labelled=True):
    """The file's examples; labelled=True (training and evaluation) refuses one without labels or answers."""
    if task.kind == "qa":
        examples = data.read_squad(path)
        unanswered = [e.source for e in examples if not e.answers]
        if labelled and unanswered:
            raise DataError(f"{unanswered[0]}: no answer to train or evaluate on")
        return examples
    read = data.read_pairs if task.kind == "classification" else data.read_tagging
    return read(path, task.labels, labelled)


def by_language(examples, spec):
    """{language: examples} of an --eval file: from its language column (XNLI 1.0's own files), else one
    language, from LANG=FILE or the file's name or folder (dev-de.tsv, xquad.de.json, x-final/de/dev_2k.tsv)."""
    if getattr(examples[0], "language", None):
        groups = {}
        for e in examples:
            groups.setdefault(e.language, []).append(e)
        return groups
    name, path = spec.split("=", 1) if "=" in spec else (None, spec)
    for part in (os.path.basename(path), os.path.basename(os.path.dirname(path))):
        codes = {t for t in re.split(r"[-._]", part) if re.fullmatch(r"[a-z]{2}", t)}
        if name or len(codes) == 1:
            return {name or codes.pop(): examples}
    raise DataError(f"--eval {spec}: cannot tell the language from the file's name; write it as LANG=FILE")


def features(task, tokenizer, examples, settings, training):
    """-> (tensors: dict of (N, ...) tensors, each row one sequence; meta for `decode`)."""
    if task.kind == "classification":
        return data.pair_features(tokenizer, examples, task.labels, settings["seq_len"]), None
    if task.kind == "tagging":
        return data.tagging_features(tokenizer, examples, task.labels, settings["seq_len"]), None
    return data.squad_features(tokenizer, examples, settings["seq_len"], settings["doc_stride"],
                               settings["max_query_length"], training=training)


def decode(task, examples, tensors, meta, outputs, settings):
    """Model outputs (one row per sequence) -> one prediction per example: a label, a list of tags, or
    (QA) the answer text; returned as a list aligned with `examples`."""
    if task.kind == "classification":
        return [task.labels[i] for i in outputs[0].argmax(-1).tolist()]
    if task.kind == "tagging":
        return data.tagging_predictions(examples, tensors, outputs[0].argmax(-1), task.labels)
    answers = data.decode_spans(examples, meta, outputs[0], outputs[1], settings["n_best"],
                                settings["max_answer_length"])
    return [answers[e.id] for e in examples]


def score(task_name, lang, examples, predictions):
    """The official figures (percent) of evaluate.py for one language's examples."""
    kind = TASKS[task_name].kind
    if kind == "classification":
        result = evaluate.accuracy([e.label for e in examples], predictions)
    elif task_name == "panx":
        result = evaluate.ner_scores([e.labels for e in examples], predictions)
    elif kind == "tagging":
        result = evaluate.pos_scores([e.labels for e in examples], predictions)
    else:
        dataset = [{"paragraphs": [{"qas": [{"id": e.id, "answers": e.answers} for e in examples]}]}]
        result = evaluate.qa_scores(dataset, {e.id: p for e, p in zip(examples, predictions)},
                                    lang if task_name == "mlqa" else None)
    return {m: result[m] for m in TASKS[task_name].metrics}


def split_train(task, examples, fraction):
    """The first `fraction` of the training file: whole articles for QA (a context never lands on
    both sides), else lines/sentences. Returns (train examples, held_out(index, example) -> bool)."""
    if fraction == 1.0:
        return examples, lambda i, e: True
    if task.kind == "qa":
        articles = list(dict.fromkeys(e.article for e in examples))
        keep = set(articles[:math.ceil(fraction * len(articles))])
        train = [e for e in examples if e.article in keep]
        train_ids = {e.id for e in train}
        return train, lambda i, e: e.id not in train_ids
    n = math.ceil(fraction * len(examples))
    return examples[:n], lambda i, e: i >= n


def eval_sets(cfg, task, held_out):
    """{language: examples} of the --eval files, without what --train-fraction trained on."""
    sets = {}
    for spec in cfg.eval:
        path = spec.split("=", 1)[-1]
        for lang, examples in by_language(read_examples(task, path), spec).items():
            if lang in sets:
                raise DataError(f"--eval: two sets for {lang!r}; name them LANG=FILE")
            sets[lang] = [e for i, e in enumerate(examples) if held_out(i, e)][:cfg.max_eval or None]
            if not sets[lang]:
                raise DataError(f"--eval {spec}: no {lang} examples left to evaluate (all used for training?)")
            if cfg.task == "mlqa" and lang not in evaluate.MLQA_LANGUAGES:
                raise DataError(f"--eval {spec}: MLQA scores {', '.join(evaluate.MLQA_LANGUAGES)}, not {lang!r}")
    return sets


# ----------------------------------------------------------------------------------------------
# Training and prediction, with static shapes: whole training batches only (the last partial one
# of each epoch is dropped), evaluation batches padded to full size (padding rows are cut after)

def train(model, tensors, cfg, lr, runtime, seed, log, state_path):
    """Fine-tune `model` in place. Every --checkpoint-every steps and at the end, the training state
    (weights, optimizer, step, each process's RNG) goes to `state_path`, written atomically; when that
    file exists, training continues from it and ends with the weights an uninterrupted run has."""
    n = tensors["input_ids"].shape[0]
    per_step = cfg.batch_size
    if per_step % runtime.world_size:
        raise DataError(f"--batch-size {per_step} does not split over {runtime.world_size} processes")
    per_process = per_step // runtime.world_size
    steps_per_epoch = n // per_step
    if steps_per_epoch == 0:
        raise DataError(f"{n} training sequences are fewer than one batch ({per_step}); lower --batch-size")
    total = steps_per_epoch * cfg.epochs
    warmup = int(cfg.warmup_fraction * total)
    ddp_model = runtime.wrap_model(model)
    optimizer = build_optimizer(model, lr, cfg.weight_decay)
    first = 0
    if os.path.exists(state_path):
        state = load_checkpoint(state_path)
        restore_training_state(runtime, state, state_path, model, optimizer)
        first = state["step"]
        log(f"resumed from {state_path} at step {first}")

    def batches():
        generator = torch.Generator().manual_seed(seed)  # the same order in every process
        for epoch in range(cfg.epochs):
            order = torch.randperm(n, generator=generator)
            for step in range(max(0, first - epoch * steps_per_epoch), steps_per_epoch):
                start = step * per_step + runtime.rank * per_process
                rows = order[start:start + per_process]
                yield {k: v[rows] for k, v in tensors.items()}

    log(f"training: {n} sequences, {total} steps of {per_step} ({steps_per_epoch} per epoch), "
        f"lr {lr:g}, warm-up {warmup}")
    ddp_model.train()
    stats = torch.zeros(2, device=runtime.device)  # [sum of losses, steps]: read only when logging
    last_log, last_step = time.time(), first
    for step, batch in enumerate(runtime.loader(batches()), first):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, warmup, total, lr)
        with runtime.autocast():
            loss = ddp_model(**batch)[-1]
        loss.backward()
        runtime.optimizer_step(optimizer, cfg.max_grad_norm)
        optimizer.zero_grad(set_to_none=True)
        stats += torch.stack([loss.detach().float(), torch.ones((), device=runtime.device)])
        checkpoint = (step + 1) % cfg.checkpoint_every == 0 or step + 1 == total
        logging = (step + 1) % cfg.log_every == 0 or step + 1 == total
        if not (checkpoint or logging):
            continue
        # The host sync: the loss is checked before every save, so no saved state holds a bad step.
        loss_sum, count = runtime.all_reduce_sum(stats.clone()).tolist()
        stats.zero_()
        if not math.isfinite(loss_sum):
            raise FloatingPointError(f"the loss became {loss_sum / count} by step {step + 1}; try a lower --lr")
        if checkpoint:
            if not weights_are_sound(model, batch, runtime):
                raise FloatingPointError(f"the update of step {step + 1} broke the weights; try a lower --lr")
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1,
                     "rng": runtime.gather_object(runtime.rng_state())}
            runtime.save(state, state_path)
        if logging:
            now = time.time()
            speed = (step + 1 - last_step) * per_step / (now - last_log)
            log(f"step {step + 1:>5}/{total} | loss {loss_sum / count:.4f} "
                f"| lr {lr_at(step, warmup, total, lr):.2e} | {speed:.1f} seq/s "
                f"| left {(total - step - 1) * per_step / speed / 60:.1f} min")
            last_log, last_step = now, step + 1
    return model


@torch.no_grad()
def predict(model, tensors, batch_size, runtime):
    """Model outputs for every row of `tensors` (the model's inputs only), in order, as CPU tensors.
    Every process runs the same number of full batches; rows past the end are padding (attention
    mask 0) and are dropped after the outputs are gathered."""
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
    model.train()
    per_rank = runtime.gather_object(outputs)  # [rank][batch][output]
    ordered = [per_rank[r][b] for b in range(len(outputs)) for r in range(runtime.world_size)]
    return [torch.cat(column)[:n] for column in zip(*ordered)]


def predict_examples(model, tokenizer, task, examples, settings, batch_size, runtime):
    tensors, meta = features(task, tokenizer, examples, settings, training=False)
    return decode(task, examples, tensors, meta, predict(model, tensors, batch_size, runtime), settings)


def predict_file(cfg):
    """`python finetune.py predict`: predict on any file of the task's format with a model saved by
    `save_finetuned`, and write the official prediction format: one label per line (xnli, pawsx),
    token<TAB>label with a blank line between sentences (panx, udpos), {question id: answer} (QA)."""
    model, tokenizer, info = load_finetuned(cfg.model)
    task = TASKS[cfg.task]
    if task.kind != TASKS[info["task"]].kind:  # a QA model may answer any QA task (SQuAD -> MLQA)
        raise DataError(f"{cfg.model} was fine-tuned for {info['task']}, which cannot predict {cfg.task}")
    runtime = setup_runtime(cfg.device)
    examples = read_examples(task, cfg.input, labelled=False)
    predictions = predict_examples(model.to(runtime.device), tokenizer, task, examples, info, cfg.batch_size, runtime)
    with open(cfg.output, "w", encoding="utf-8") as f:
        if task.kind == "qa":
            json.dump({e.id: p for e, p in zip(examples, predictions)}, f, ensure_ascii=False)
        elif task.kind == "tagging":
            f.write("\n".join("".join(f"{token}\t{tag}\n" for token, tag in zip(e.tokens, tags))
                              for e, tags in zip(examples, predictions)))
        else:
            f.write("".join(label + "\n" for label in predictions))


# ----------------------------------------------------------------------------------------------
# The zero-shot table

def check_out_dir(cfg, runtime, log):
    """A fresh --out-dir records the training settings; one that holds runs needs --resume and the same
    settings, so that resumed and reused runs are runs of this command."""
    path = os.path.join(cfg.out_dir, "finetune-config.json")
    ours = {k: v for k, v in asdict(cfg).items() if k not in NOT_TRAINING}
    if not os.path.exists(path):
        if runtime.is_main:
            os.makedirs(cfg.out_dir, exist_ok=True)
            with open(path, "w") as f:
                json.dump(ours, f, indent=2)
        return
    if not cfg.resume:
        raise DataError(f"{cfg.out_dir} already holds fine-tuning runs; pass --resume to continue them, "
                        f"or choose another --out-dir")
    with open(path) as f:
        theirs = json.load(f)
    differ = [f"--{k.replace('_', '-')} {theirs.get(k)!r} then, {v!r} now" for k, v in ours.items() if theirs.get(k) != v]
    if differ:
        raise DataError(f"{cfg.out_dir} holds runs made with other settings ({'; '.join(differ)}); "
                        f"resume with the same ones, or choose another --out-dir")
    if runtime.is_main:
        remove_partial_saves(os.path.join(cfg.out_dir, "lr-*", "seed-*", "*.tmp"), log)


def print_table(title, table, log):
    """table: {language: {metric: value}}; the last row is the average over languages."""
    metrics = list(next(iter(table.values())))
    log(title)
    log(f"{'lang':<10}" + "".join(f"{m:>14}" for m in metrics))
    for lang, row in table.items():
        log(f"{lang:<10}" + "".join(f"{row[m]:>14.2f}" for m in metrics))


def average(rows):
    """Mean of each metric over a list of {metric: value}."""
    return {m: sum(r[m] for r in rows) / len(rows) for m in rows[0]}


def with_defaults(cfg, log):
    """Appendix A.3's defaults for what --lr, --batch-size and --seq-len leave open: Table 10's learning-rate
    sweep at batch 32, or for an encoder of RemBERT's shape Table 15's rate and batch; said, not silent."""
    task, rembert = TASKS[cfg.task], CONFIGS["rembert"]
    if encoder_shape(cfg) == (rembert.num_layers, rembert.hidden_size):
        lrs, batch_size, source = [task.rembert[0]], task.rembert[1], "Table 15's, for an encoder of RemBERT's shape"
    else:
        lrs, batch_size, source = list(task.lrs), 32, "Table 10's"
    log(f"defaults: {source}: learning rates {', '.join(f'{lr:g}' for lr in lrs)}, batch {batch_size}"
        + (f" (overridden: --lr {cfg.lr} --batch-size {cfg.batch_size})" if cfg.lr or cfg.batch_size else ""))
    return dataclasses.replace(cfg, lr=cfg.lr or lrs, batch_size=cfg.batch_size or batch_size,
                               seq_len=cfg.seq_len or task.seq_len)


def run(cfg):
    runtime = setup_runtime(cfg.device)
    log = (lambda *a: print(*a, flush=True)) if runtime.is_main else (lambda *a: None)
    log(f"runtime: {runtime.kind} ({runtime.device}), {runtime.world_size} process(es)")
    task = TASKS[cfg.task]
    cfg = with_defaults(cfg, log)
    log(f"finetune config: {asdict(cfg)}")
    settings = {k: getattr(cfg, k) for k in ("seq_len", "doc_stride", "max_query_length", "max_answer_length", "n_best")}
    tokenizer_file = tokenizer_path(cfg)
    tokenizer = data.Tokenizer(tokenizer_file)

    examples = read_examples(task, cfg.train)
    if len({getattr(e, "language", None) for e in examples}) > 1:
        raise DataError(f"{cfg.train}: holds several languages; zero-shot transfer trains on one (English)")
    train_examples, held_out = split_train(task, examples, cfg.train_fraction)
    train_examples = train_examples[:cfg.max_train or None]
    train_tensors, _ = features(task, tokenizer, train_examples, settings, training=True)
    evals = eval_sets(cfg, task, held_out)
    log(f"{cfg.train}: {len(train_examples)} training examples; evaluating "
        + ", ".join(f"{lang} ({len(examples)})" for lang, examples in evals.items()))
    check_out_dir(cfg, runtime, log)

    sweep = {}  # lr -> seed -> {language: {metric: value}}
    for lr in cfg.lr:
        sweep[lr] = {}
        for seed in cfg.seeds:
            run_dir = os.path.join(cfg.out_dir, f"lr-{lr:g}", f"seed-{seed}")
            scores_path = os.path.join(run_dir, "scores.json")
            if os.path.exists(scores_path):  # only with --resume: check_out_dir saw to that
                with open(scores_path) as f:
                    sweep[lr][seed] = json.load(f)
                log(f"{run_dir} was finished before; its scores are reused")
                continue
            torch.manual_seed(seed)  # the head's initialisation and dropout
            encoder = build_encoder(cfg, log)
            if tokenizer.vocab_size > encoder.config.vocab_size:
                raise DataError(f"{tokenizer_file} has {tokenizer.vocab_size} pieces, more than the model's "
                                f"vocab_size {encoder.config.vocab_size}: not the model's tokenizer")
            model = build_model(task, encoder, cfg.dropout)
            if runtime.is_main:
                os.makedirs(run_dir, exist_ok=True)
            train(model, train_tensors, cfg, lr, runtime, seed, log, os.path.join(run_dir, "train-state.pt"))
            scores = {lang: score(cfg.task, lang, examples,
                                  predict_examples(model, tokenizer, task, examples, settings,
                                                   cfg.eval_batch_size, runtime))
                      for lang, examples in evals.items()}
            scores["average"] = average(list(scores.values()))
            sweep[lr][seed] = scores
            print_table(f"{cfg.task}, lr {lr:g}, seed {seed}", scores, log)
            if runtime.is_main:  # the model, then scores.json (written last: the run is done), then no state
                save_finetuned(model.cpu(), cfg, tokenizer_file, run_dir)
                with open(scores_path + ".tmp", "w") as f:
                    json.dump(scores, f, indent=2)
                os.replace(scores_path + ".tmp", scores_path)
                os.remove(os.path.join(run_dir, "train-state.pt"))
                log(f"saved the fine-tuned model to {run_dir}")

    # The mean over seeds for each rate; the rate with the best average of the task's first metric.
    tables = {lr: {lang: average([runs[s][lang] for s in cfg.seeds]) for lang in runs[cfg.seeds[0]]}
              for lr, runs in sweep.items()}
    metric = task.metrics[0]
    best = max(cfg.lr, key=lambda lr: tables[lr]["average"][metric])
    if len(cfg.lr) > 1:
        log("learning rates: " + ", ".join(f"{lr:g}: {tables[lr]['average'][metric]:.2f}" for lr in cfg.lr)
            + f" (average {metric}); best {best:g}")
    print_table(f"{cfg.task}: fine-tuned on {os.path.basename(cfg.train)}, zero-shot, lr {best:g}, "
                f"mean over {len(cfg.seeds)} seed(s)", tables[best], log)
    if runtime.is_main:
        path = os.path.join(cfg.out_dir, "results.json")
        with open(path, "w") as f:
            json.dump({"config": asdict(cfg), "lr": best, "results": tables[best], "per_seed": sweep[best],
                       "per_lr": {f"{lr:g}": table for lr, table in tables.items()}}, f, indent=2)
        log(f"wrote {path}")
    return tables[best]


def _launched(index, cfg):  # torch_xla.launch passes the process index first
    run(cfg)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["predict"]:
        _, cfg = parse_command_line(__doc__, {"predict": PredictConfig}, argv)
        return predict_file(cfg)
    _, cfg = parse_command_line(__doc__, FinetuneConfig, argv)
    if resolve_device(cfg.device) == "xla":
        import torch_xla
        torch_xla.launch(_launched, args=(cfg,))  # one process per core/chip
    else:
        return run(cfg)


if __name__ == "__main__":
    run_script(main)
