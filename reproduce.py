r"""The paper's findings at laptop scale, in one command: small models that differ only in their
embeddings, pre-trained on the same multilingual text for the same number of tokens, then compared as
"Rethinking Embedding Coupling in Pre-trained Language Models" compares them (Chung et al., ICLR 2021):

  coupling (Table 2)        coupled vs decoupled input and output embeddings, E_in = E_out = H;
  output size (Table 4)     E_in small and fixed, E_out = H/4, H and 4H;
  extra layers (Table 5)    E_out = H/4 plus pre-training-only layers;

each with --seeds seeds, measured by held-out masked-LM loss and accuracy along pre-training (Table 8's
measure, as learning curves), zero-shot cross-lingual transfer from English on PAN-X (Tables 2, 4, 5)
and per-layer en->de nearest-neighbour translation accuracy on XQuAD's parallel questions (Figure 2).

Every run is checked before it counts: a model whose held-out loss stays within 0.1 nats of a unigram
model's (it predicts piece frequencies, nothing more), or whose accuracy is no better than that model's, is marked
collapsed and left out of every mean.
Beside the models: the unigram model, a randomly initialised encoder fine-tuned alike, and a tagger
that gives each word its most frequent English tag. The settings of a preset were fixed for every model
of the comparison at once, chosen so that the largest E_out and the deepest output side train soundly.

It writes to --out-dir (a new or empty folder, or one of its own: its results.json): results.json (every number
of every run, the curves, saved after each run, so that an interrupted reproduction resumes), results.md (the
tables and the claims, each step of the comparison set against the spread over seeds), curves.png and figure2.png.
The data (docs/data.md): --data, plain-text corpus files (a tenth of each held out); --panx and --xquad as XTREME's
download script leaves them.

  python reproduce.py                            # the cpu preset: under an hour on 2 CPU cores
  python reproduce.py --quick --out-dir /tmp/r   # the whole pipeline on tiny settings, about 2 minutes
  python reproduce.py --device cuda              # the gpu preset: larger models, 7.5 times the tokens

A run already in --out-dir's results.json is not run again, so seeds can be added to some models later:
--seeds 4 --models "E_out 16" asks for seeds 0 to 3 of E_out 16 and runs those not yet there. results/
holds the cpu preset's 2 seeds of every model and 4 of the E_out trio (on 2 seeds its 16 -> 64 step in
accuracy was beyond the spread with some seeds, within it with others), seeds 2 and 3 added by 6 runs:

  mkdir -p out/reproduce && cp results/results.json out/reproduce/
  python reproduce.py --seeds 4 --models "E_out 16" "E_out 64" "E_out 256"
  cp out/reproduce/results.json out/reproduce/results.md out/reproduce/*.png results/
"""

import contextlib
import ctypes
import importlib.util
import itertools
import math
import multiprocessing
import os
import shutil
import signal
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

import data
import evaluate
import finetune
import pretrain
from configs import GIVEN, MBERT, at_least, check_flags, flag, parse_command_line, resolve_device, run_script
from checkpoints import (DataError, checkpoint_paths, claim as lock_out_dir, from_checkpoint, remove, save_hf,
                         write_file, write_json)
from model import Encoder, count_parameters

REPO = Path(__file__).resolve().parent
PANX_LANGS = ("de", "en", "es", "nl", "pl", "ru")
MARGIN = 0.1  # nats: a run whose held-out loss is not this far below the unigram model's has collapsed

PRESETS = {
    # About 2 minutes on 2 cores (1 min 58 s and 2 min 21 s measured). A 500-piece vocabulary and 0.72M tokens:
    # every model passes the collapse check (at 250 steps, 0.26M tokens, E_out 64 and E_out 16 + 2 layers did not).
    "quick": dict(hidden=64, layers=2, heads=2, small=16, extra_layers=2, vocab=500, seq_len=64, batch_size=16,
                  steps=700, warmup=70, lr=2e-3, eval_every=100, eval_batches=10, finetune_lr=3e-3, epochs=2,
                  finetune_batch=16, finetune_seq_len=64, max_train=1000, max_eval=100, probe_pairs=200, seeds=1,
                  loader_workers=0),
    # Chosen so that E_out 4H and the 4 pre-training-only layers train soundly (with 45 warm-up steps at 2e-3
    # both collapsed), and so that the whole preset fits an hour on 2 cores: 3.3M tokens per model.
    "cpu": dict(hidden=64, layers=4, heads=2, small=16, extra_layers=4, vocab=8000, seq_len=128, batch_size=32,
                steps=800, warmup=200, lr=1e-3, eval_every=100, eval_batches=20, finetune_lr=3e-3, epochs=3,
                finetune_batch=16, finetune_seq_len=96, max_train=0, max_eval=0, probe_pairs=0, seeds=2,
                loader_workers=0),
    # 24.6M tokens per model (7.5 times the cpu preset's), the loader in 4 worker processes to keep up with the
    # GPU. On one H200, a model's run took 2.5 minutes (137 s of it pre-training) after a set-up of 47 s: the
    # whole preset about 31 minutes, estimated from it (docs/performance.md).
    "gpu": dict(hidden=256, layers=6, heads=4, small=64, extra_layers=6, vocab=16000, seq_len=128, batch_size=128,
                steps=1500, warmup=300, lr=5e-4, eval_every=250, eval_batches=20, finetune_lr=1e-3, epochs=3,
                finetune_batch=32, finetune_seq_len=96, max_train=0, max_eval=0, probe_pairs=0, seeds=2,
                loader_workers=4),
}


def models(p):
    """The compared models by name: a small mBERT (no dropout), one shape differing in its embeddings only."""
    base = replace(MBERT, vocab_size=p.vocab, hidden_size=p.hidden, num_layers=p.layers, num_heads=p.heads,
                   intermediate_size=4 * p.hidden, input_embedding_size=p.hidden, output_embedding_size=p.hidden)
    small = replace(base, input_embedding_size=p.small)
    return {"coupled": replace(base, tie_embeddings=True), "decoupled": base,
            f"E_out {p.small}": replace(small, output_embedding_size=p.small),
            f"E_out {p.hidden}": small,
            f"E_out {4 * p.hidden}": replace(small, output_embedding_size=4 * p.hidden),
            f"E_out {p.small} + {p.extra_layers} layers": replace(small, output_embedding_size=p.small,
                                                                  pretraining_only_layers=p.extra_layers)}


RANDOM = "random init"  # the E_in-small encoder, fine-tuned from its initialisation
# The paper's rows (mBERT-sized, 26B tokens) in the order of models(): (row, NER F1, Table 8's MLM acc.).
PAPER = [("Table 2, coupled", 69.2, 61.1), ("Table 2, decoupled", 68.9, 61.6), ("Table 4, E_out 128", 65.2, 59.0),
         ("Table 4, E_out 768", 67.6, 60.7), ("Table 4, E_out 3072", 68.1, 62.3),
         ("Table 5, E_out 128 + 11 layers", 67.3, "-")]


@dataclass
class ReproduceConfig:
    data: str = flag("data/corpus", "pre-training text: a directory of *.txt files, searched recursively", GIVEN)
    panx: str = flag("data/panx", "PAN-X: train-en.tsv and dev-{de,en,es,nl,pl,ru}.tsv", GIVEN)
    xquad: str = flag("data/xquad", "XQuAD: xquad.en.json and xquad.de.json", GIVEN)
    out_dir: str = flag("out/reproduce", "results, figures and every model", GIVEN)
    device: str = flag("cpu", "cpu | cuda | auto (cuda runs the gpu preset; auto: cuda where torch sees a GPU)",
                       (lambda v: v in ("auto", "cpu", "cuda") and resolve_device(v), "auto, cpu or cuda"))
    quick: bool = flag(False, "the tiny preset: the whole pipeline in about 2 minutes on 2 cores")
    seeds: int = flag(0, "seeds 0 to N-1 of each model (0: the preset's); a seed already run is kept", at_least(0))
    models: list[str] = flag([], "only these models, named as in results.md (\"E_out 16\", \"random init\"); "
                                 "all when not given")

    def __post_init__(self):
        check_flags(self)
        names = [*models(SimpleNamespace(**PRESETS[self.preset()])), RANDOM]
        if unknown := [name for name in self.models if name not in names]:
            raise ValueError(f"--models must be models of the {self.preset()} preset ({', '.join(names)}), "
                             f"got {unknown[0]!r}")
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("reproduce.py draws its figures with matplotlib: pip install matplotlib")
        if (os.path.realpath(self.out_dir) + os.sep).startswith(os.path.realpath(self.data) + os.sep):
            raise ValueError("--out-dir is inside --data: its copies of the corpus would be read as more corpus")
        copies = [os.path.realpath(os.path.join(self.out_dir, folder)) + os.sep for folder in ("corpus", "panx")]
        if inside := [name for name in ("data", "panx")
                      if (os.path.realpath(getattr(self, name)) + os.sep).startswith(tuple(copies))]:
            raise ValueError(f"--{inside[0]} is inside --out-dir's corpus/ or panx/, where reproduce.py writes its own "
                             f"copies over what is there; pass the original files")
        needed = {"data": [], "panx": ["train-en.tsv", *(f"dev-{lang}.tsv" for lang in PANX_LANGS)],
                  "xquad": ["xquad.en.json", "xquad.de.json"]}
        for flag_name, files in needed.items():
            folder = getattr(self, flag_name)
            if os.path.isfile(folder):
                raise ValueError(f"--{flag_name} {folder} is a file; it takes a directory (docs/data.md)")
            if missing := [f for f in ["", *files] if not os.path.exists(os.path.join(folder, f))]:
                raise ValueError(f"--{flag_name} {folder} has no {missing[0] or 'such directory'}; docs/data.md "
                                 f"says where to get it")

    def preset(self):
        return "quick" if self.quick else "gpu" if resolve_device(self.device) == "cuda" else "cpu"


def split_corpus(source, out):
    """Each corpus file (as data.corpus_files finds them) split into out/train and out/heldout, at the same place
    below each: its last tenth of non-blank lines (at least one) held out. Made anew at every start: a file since
    removed from `source` is not read."""
    if os.path.lexists(out):
        remove(out)
    for path in (p for paths in data.corpus_files(source).values() for p in paths):
        lines = data.read_text(path).removesuffix("\n").split("\n")
        text = [i for i, line in enumerate(lines) if line.strip()]
        if len(text) < 2:
            raise DataError(f"{path}: fewer than 2 lines, nothing to hold out")
        cut = text[len(text) - max(1, len(text) // 10)]
        name = os.path.relpath(path, source) if os.path.isdir(source) else os.path.basename(path)
        for part, chunk in (("train", lines[:cut]), ("heldout", lines[cut:])):
            os.makedirs(os.path.dirname(os.path.join(out, part, name)), exist_ok=True)
            Path(out, part, name).write_text("\n".join(chunk) + "\n", encoding="utf-8")
    return os.path.join(out, "train"), os.path.join(out, "heldout")


def first_sentences(p, panx, out):
    """PAN-X's files cut to the sentences a preset with max_train and max_eval reads, saved in out: finetune.py
    reads its files whole, once a run."""
    os.makedirs(out, exist_ok=True)
    for name, n in [("train-en.tsv", p.max_train), *((f"dev-{lang}.tsv", p.max_eval) for lang in PANX_LANGS)]:
        examples = data.read_tagging(os.path.join(panx, name))[:n]
        Path(out, name).write_text("\n".join("".join(f"{token}\t{label}\n" for token, label in zip(e.tokens, e.labels))
                                             for e in examples), encoding="utf-8")
    return out


# ----------------------------------------------------------------------------------------------
# The baselines: what a model learns from frequencies alone

def heldout_batches(p, corpus, tokenizer):
    """The held-out masked-LM batches every model is scored on (drawn as pre-training draws them)."""
    loader = data.MLMLoader(corpus[1], tokenizer, batch_size=p.batch_size, seq_len=p.seq_len,
                            max_predictions=round(0.15 * p.seq_len), seed=10_000)
    return list(itertools.islice(loader, p.eval_batches))


def unigram_baseline(p, corpus, tokenizer, heldout):
    """Held-out loss and accuracy of the unigram model of the pre-training stream (piece frequencies among its
    masked targets, add-0.5 smoothed): where a model that learned no context stays."""
    loader = data.MLMLoader(corpus[0], tokenizer, batch_size=p.batch_size, seq_len=p.seq_len,
                            max_predictions=round(0.15 * p.seq_len), seed=20_000)
    counts = torch.full((tokenizer.vocab_size,), 0.5, dtype=torch.float64)
    for batch in itertools.islice(loader, 10 * p.eval_batches):
        counts.index_add_(0, batch["masked_ids"].flatten(), batch["masked_weights"].flatten().double())
    log_p = (counts / counts.sum()).log()
    ids = torch.cat([b["masked_ids"][b["masked_weights"] > 0] for b in heldout])
    return {"loss": -log_p[ids].mean().item(), "accuracy": 100.0 * (ids == counts.argmax()).double().mean().item()}


def majority_tagger(p, panx):
    """PAN-X F1 of tagging each word with its most frequent tag in the English training file ("O" if unseen)."""
    train = data.read_tagging(os.path.join(panx, "train-en.tsv"))[:p.max_train or None]
    tags = {}
    for word, tag in ((w, t) for e in train for w, t in zip(e.tokens, e.labels)):
        tags.setdefault(word, Counter())[tag] += 1
    scores = {}
    for lang in PANX_LANGS:
        dev = data.read_tagging(os.path.join(panx, f"dev-{lang}.tsv"))[:p.max_eval or None]
        predicted = [[tags[w].most_common(1)[0][0] if w in tags else "O" for w in e.tokens] for e in dev]
        scores[lang] = evaluate.ner_scores([e.labels for e in dev], predicted)["f1"]
    return panx_summary(scores)


def panx_summary(f1):
    """{language: F1} -> the English F1, the zero-shot mean over the other languages, and every language's."""
    others = [v for lang, v in f1.items() if lang != "en"]
    return {"en": f1["en"], "zero_shot": sum(others) / len(others), "languages": f1}


# ----------------------------------------------------------------------------------------------
# One run: pre-training with held-out scores along the way, fine-tuning, the probe

def run_job(name, seed, p, cfg, corpus, tokenizer_file, heldout, threads):
    """Pre-train model `name` with `seed` (or, for RANDOM, initialise it), then measure it: {measure: value}."""
    torch.set_num_threads(threads)
    run_dir = os.path.join(cfg.out_dir, "runs", name.replace(" ", "-"), f"seed-{seed}")
    os.makedirs(run_dir, exist_ok=True)
    log = open(os.path.join(run_dir, "log.txt"), "a")
    result, started = {"seconds": {}}, time.time()  # seconds: pre-training, scoring and fine-tuning, each
    with log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        if name == RANDOM:
            torch.manual_seed(seed)
            init = os.path.join(run_dir, "init")
            save_hf(Encoder(models(p)[f"E_out {p.hidden}"]), init)
            shutil.copyfile(tokenizer_file, os.path.join(init, "sentencepiece.model"))
        else:
            train_config = pretrain.TrainConfig(
                data=corpus[0], tokenizer=tokenizer_file, out_dir=os.path.join(run_dir, "pretrain"), device=cfg.device,
                seq_len=p.seq_len, max_predictions=round(0.15 * p.seq_len), batch_size=p.batch_size, steps=p.steps,
                warmup=p.warmup, lr=p.lr, log_every=max(1, p.eval_every // 5), checkpoint_every=p.eval_every,
                keep=p.steps // p.eval_every + 1, num_workers=p.loader_workers, seed=seed, resume=True)
            model = pretrain.train(models(p)[name], train_config)
            result["seconds"]["pretrain"], started = time.time() - started, time.time()
            result["parameters"] = count_parameters(model)
            checkpoints, curve = checkpoint_paths(train_config.out_dir), os.path.join(run_dir, "curve.json")
            if not os.path.exists(curve):  # [tokens seen, held-out loss, held-out accuracy] at every checkpoint
                scores = [evaluate.mlm_accuracy(from_checkpoint(path).to(cfg.device), heldout, cfg.device)
                          for path in checkpoints]
                write_json(curve, [[int(os.path.basename(path)[5:]) * p.batch_size * p.seq_len, s["loss"],
                                    s["accuracy"]] for path, s in zip(checkpoints, scores)])
            result["curve"] = evaluate.read_json(curve)
            for path in checkpoints[:-1]:  # (scored: only the last is fine-tuned)
                remove(path)  # (a folder, or the link to one moved to another disk)
            init, tokenizer = checkpoints[-1], data.Tokenizer(tokenizer_file)
            pairs = evaluate.read_parallel(*(os.path.join(cfg.xquad, f"xquad.{lang}.json") for lang in ("en", "de")))
            source, target = ([tokenizer.encode(t) for t in side[:p.probe_pairs or None]] for side in pairs)
            result["figure2"] = evaluate.translation_probe(model.encoder.to(cfg.device), source, target,
                                                           tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id,
                                                           device=cfg.device)
            result["seconds"]["score"], started = time.time() - started, time.time()
        table = finetune.run(finetune.FinetuneConfig(
            task="panx", init=init, tokenizer=tokenizer_file, train=os.path.join(cfg.panx, "train-en.tsv"),
            eval=[os.path.join(cfg.panx, f"dev-{lang}.tsv") for lang in PANX_LANGS], max_train=p.max_train,
            max_eval=p.max_eval, out_dir=os.path.join(run_dir, "panx"), device=cfg.device, lr=[p.finetune_lr],
            epochs=p.epochs, batch_size=p.finetune_batch, seq_len=p.finetune_seq_len, seeds=[seed], resume=True))
        result["seconds"]["finetune"] = time.time() - started
    result["panx"] = panx_summary({lang: table[lang]["f1"] for lang in PANX_LANGS})
    return result


# ----------------------------------------------------------------------------------------------
# The report: the tables, the claims against the spread, the figures

def mean_std(values):
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def final(run, key):  # the held-out loss (1) or accuracy (2) at the end of pre-training
    return run["curve"][-1][{"loss": 1, "accuracy": 2}[key]]


def collapsed(run, unigram):
    """Whether a run learned no more than piece frequencies: its final held-out loss is within MARGIN of the unigram
    model's, or its accuracy no better than always predicting the most frequent piece."""
    return final(run, "loss") > unigram["loss"] - MARGIN or final(run, "accuracy") <= unigram["accuracy"]


def sound(results, name):
    return [run for run in results.get(name, {}).values() if not run.get("collapsed")]


def drawn(results, name):
    """What a figure draws of a model, and its label: its sound runs; where every run collapsed, those, so marked."""
    runs = sound(results, name)
    return (runs, name) if runs else (list(results.get(name, {}).values()), f"{name} (collapsed)")


def compare(results, a_name, b_name, value):
    """(mean of b - mean of a, twice the larger standard deviation) of value(run) over the sound runs; None with
    fewer than two sound runs of either."""
    a, b = ([value(run) for run in sound(results, name)] for name in (a_name, b_name))
    if len(a) < 2 or len(b) < 2:
        return None
    (mean_a, sd_a), (mean_b, sd_b) = mean_std(a), mean_std(b)
    return mean_b - mean_a, 2 * max(sd_a, sd_b)


def verdict(difference, spread):
    """One step of a comparison: its difference (the paper's way positive) against twice the larger sd."""
    return "visible" if difference > spread else "opposite" if -difference > spread else "within the spread"


def claims(results, p):
    """The paper's comparisons as measured here: (claim, each step's difference against twice the larger standard
    deviation, verdict). A series of models (E_out H/4 -> H -> 4H) is judged a step at a time, since one step can
    show where the next does not; the verdict names the steps of each kind and the seeds it rests on."""
    sizes = [f"E_out {p.small}", f"E_out {p.hidden}", f"E_out {4 * p.hidden}"]
    extra = f"E_out {p.small} + {p.extra_layers} layers"
    lower_loss, accuracy = (lambda run: -final(run, "loss")), (lambda run: final(run, "accuracy"))
    transfer = lambda run: run["panx"]["zero_shot"]  # noqa: E731
    transfer_lost = lambda run: -transfer(run)  # noqa: E731  (Table 2: decoupling alone costs transfer 0.3 F1)
    rows = []
    for claim, series, value, unit in (
            ("E_out H/4 -> H -> 4H: held-out MLM loss falls (Tables 4, 8)", sizes, lower_loss, "nats lower"),
            ("E_out H/4 -> H -> 4H: held-out MLM accuracy rises (Table 8)", sizes, accuracy, "points"),
            ("E_out H/4 -> H -> 4H: PAN-X zero-shot F1 rises (Table 4)", sizes, transfer, "F1"),
            ("coupled -> decoupled: held-out MLM accuracy rises (Table 8)", ["coupled", "decoupled"], accuracy,
             "points"),
            ("coupled -> decoupled: PAN-X zero-shot F1 falls (Table 2: -0.3)", ["coupled", "decoupled"],
             transfer_lost, "F1 lower"),
            (f"+{p.extra_layers} pre-training-only layers: held-out MLM loss falls", [sizes[0], extra], lower_loss,
             "nats lower"),
            (f"+{p.extra_layers} pre-training-only layers: PAN-X zero-shot F1 rises (Table 5)", [sizes[0], extra],
             transfer, "F1")):
        steps = {f"{a} -> {b}": compare(results, a, b, value) for a, b in zip(series, series[1:])}
        measured = "; ".join(f"{step}: " * (len(steps) > 1) + ("n/a" if s is None else
                                                                  f"{s[0]:+.2f} {unit} (2 sd {s[1]:.2f})")
                             for step, s in steps.items())
        if None in steps.values():  # a spread needs 2 sound runs (seeds) of each model: which have fewer
            few = [f"{name} {len(sound(results, name))} of {len(results.get(name, {}))}" for name in series
                   if len(sound(results, name)) < 2]
            rows.append((claim, measured, f"not measured: a spread needs 2 sound runs of each model ({', '.join(few)}"
                         f"; --seeds 2 or more, and collapsed runs are left out)"))
            continue
        kinds = {step: verdict(*s) for step, s in steps.items()}
        if len(set(kinds.values())) == 1:
            said = next(iter(kinds.values())) + {1: "", 2: " at both steps"}.get(len(kinds), " at every step")
        else:
            said = "; ".join(f"{kind} at {', '.join(step for step in kinds if kinds[step] == kind)}"
                             for kind in ("visible", "opposite", "within the spread") if kind in kinds.values())
        n = sorted({len(sound(results, name)) for name in series})  # sound runs: one a seed, the collapsed left out
        rows.append((claim, measured, f"{said} (n={n[0]}{f' to {n[-1]}' * (len(n) > 1)} seeds)"))
    return rows


def cell(values):  # mean ± standard deviation; one run's value alone; "-" for none
    if len(values) < 2:
        return f"{values[0]:.2f}" if values else "-"
    return "{:.2f} ± {:.2f}".format(*mean_std(values))


def summarize(results, baselines, p, out_dir, preset, chance):
    """results.md: the baselines, one row per model (mean ± standard deviation over its sound runs), the claims;
    curves.png (held-out loss and accuracy against tokens seen, the band spanning the seeds) and figure2.png
    (`chance`: the probe's accuracy by chance, in percent)."""
    import matplotlib.pyplot as plt
    plt.switch_backend("Agg")
    tokens = p.steps * p.batch_size * p.seq_len
    lines = [f"Preset {preset}: H {p.hidden}, {p.layers} layers, E_in {p.small} (or H), a {p.vocab}-piece vocabulary; "
             f"{p.steps} pre-training steps of {p.batch_size} x {p.seq_len} pieces ({tokens / 1e6:.2g}M tokens, lr "
             f"{p.lr:g}, {p.warmup} warm-up steps); PAN-X fine-tuned on English ({p.epochs} epochs, lr "
             f"{p.finetune_lr:g}, batch {p.finetune_batch}, {p.finetune_seq_len} pieces), zero-shot: the mean over "
             f"{', '.join(lang for lang in PANX_LANGS if lang != 'en')}. Mean ± standard deviation over each model's "
             f"sound runs, one a seed (collapsed: how many of its seeds' runs were left out; a model whose every run "
             f"collapsed shows those runs' values in parentheses, and enters no claim).", "",
             *(["The quick preset shows the pipeline at work, not the paper's effects: "
                + ("one seed a model gives no spread to judge a difference against, and "
                   if all(len(runs) < 2 for runs in results.values()) else "")
                + f"in {tokens / 1e6:.2g}M tokens (the cpu preset's: 3.3M) "
                f"a model may not yet pass the collapse check (held-out loss {MARGIN} nats below the unigram model's "
                f"and accuracy above its most frequent piece's); `python reproduce.py` measures the claims.", ""]
               if preset == "quick" else []),
             "| baseline | held-out MLM loss | MLM acc. | PAN-X F1 en | PAN-X F1 zero-shot |",
             "| --- | ---: | ---: | ---: | ---: |",
             f"| unigram model (piece frequencies) | {baselines['unigram']['loss']:.2f} | "
             f"{baselines['unigram']['accuracy']:.2f} | | |",
             f"| most frequent tag of each word | | | {baselines['majority']['en']:.2f} | "
             f"{baselines['majority']['zero_shot']:.2f} |",
             f"| {RANDOM} (E_in {p.small}), fine-tuned | | | "
             f"{cell([r['panx']['en'] for r in sound(results, RANDOM)])} | "
             f"{cell([r['panx']['zero_shot'] for r in sound(results, RANDOM)])} |", "",
             "| model | PT / FT params | held-out MLM loss | MLM acc. | PAN-X F1 en | PAN-X F1 zero-shot | collapsed "
             "| paper: row | NER F1 | MLM acc. |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for name, paper in zip(models(p), PAPER):
        if name not in results:  # (not run: --models named others)
            continue
        (runs, label), counts = drawn(results, name), next(iter(results[name].values()))["parameters"]
        shown = cell if label == name else lambda values: f"({cell(values)})"  # every run collapsed: in parentheses
        lines.append(f"| {name} | {counts['pretraining'] / 1e6:.2f}M / {counts['finetuning'] / 1e6:.2f}M | "
                     f"{shown([final(r, 'loss') for r in runs])} | {shown([final(r, 'accuracy') for r in runs])} | "
                     f"{shown([r['panx']['en'] for r in runs])} | {shown([r['panx']['zero_shot'] for r in runs])} | "
                     f"{len(results[name]) - len(sound(results, name))} of {len(results[name])} | "
                     f"{' | '.join(map(str, paper))} |")
    lines += ["", "| the paper's claim | measured here, per step (against twice the larger sd) | verdict |",
              "| --- | --- | --- |", *(f"| {claim} | {measured} | {verdict} |" for claim, measured, verdict in
                                      claims(results, p))]
    write_file(os.path.join(out_dir, "results.md"), lambda f: f.write("\n".join(lines) + "\n"))

    # One style a model (a dashed line for the extra layers, which would hide E_out H/4's), one legend for both panels.
    styles = {name: dict(marker=marker, linestyle="--" if "layers" in name else "-")
              for name, marker in zip(models(p), "os^vDx")}
    seeds = sorted({len(drawn(results, name)[0]) for name in models(p) if name in results})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for name in models(p):
        runs, label = drawn(results, name)
        curves = [run["curve"] for run in runs]
        if not curves:
            continue
        x = [point[0] / 1e6 for point in curves[0]]
        for ax, column in zip(axes, (1, 2)):
            values = [[point[column] for point in curve] for curve in curves]
            line, = ax.plot(x, [statistics.mean(v) for v in zip(*values)], label=label, **styles[name])
            ax.fill_between(x, [min(v) for v in zip(*values)], [max(v) for v in zip(*values)],
                            color=line.get_color(), alpha=0.2)
    for ax, column, label in zip(axes, ("loss", "accuracy"), ("held-out MLM loss (nats)", "held-out MLM accuracy (%)")):
        ax.axhline(baselines["unigram"][column], color="grey", linestyle=":", label="unigram model (piece frequencies)")
        ax.set(xlabel="tokens seen in pre-training (millions)", ylabel=label)
    spread = f"band: lowest to highest of {'-'.join(map(str, seeds))} seeds" if seeds[-1:] > [1] else "one seed a model"
    fig.suptitle(f"Masked-LM on held-out text while pre-training ({preset} preset; line: mean over seeds, {spread})")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    write_file(os.path.join(out_dir, "curves.png"), lambda f: fig.savefig(f, format="png", dpi=100), "wb")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4.2), layout="tight")
    for name in models(p):
        runs, label = drawn(results, name)
        if runs and name.startswith("E_out") and "layers" not in name:  # Figure 2: one curve per E_out
            stats = [mean_std(layer) for layer in zip(*(run["figure2"] for run in runs))]
            ax.errorbar(range(len(stats)), [m for m, _ in stats], yerr=[s for _, s in stats], marker="o", capsize=3,
                        label=f"{label}, {len(runs)} seed{'s' * (len(runs) > 1)}")
    ax.axhline(chance, color="grey", linestyle=":", label=f"chance ({chance:.2f}%)")
    ax.set_xticks(range(p.layers + 1))
    ax.set(xlabel="layer (0: the embeddings)", ylabel="en→de nearest-neighbour accuracy (%)", ylim=(0, None),
           title="Figure 2: en→de retrieval by layer, XQuAD questions\n(mean over seeds; error bars: ±1 sd)")
    ax.legend(fontsize=8)
    write_file(os.path.join(out_dir, "figure2.png"), lambda f: fig.savefig(f, format="png", dpi=100), "wb")
    plt.close(fig)
    return "\n".join(lines)


def main(argv=None):
    _, cfg = parse_command_line(__doc__, ReproduceConfig, argv)
    cfg = replace(cfg, device=resolve_device(cfg.device))
    preset = cfg.preset()
    p = SimpleNamespace(**PRESETS[preset])
    p.seeds = cfg.seeds or p.seeds
    print(f"preset {preset}: {vars(p)}", flush=True)
    where = {k: data_path(getattr(cfg, k)) for k in ("data", "panx", "xquad")}
    # The number of seeds is no part of the setup: more of them can be added to the runs stored.
    setup = {"preset": {k: v for k, v in vars(p).items() if k != "seeds"}, **where}
    results_path = os.path.join(cfg.out_dir, "results.json")
    if os.path.lexists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
        raise DataError(f"--out-dir {cfg.out_dir} is no folder (a file, or a link to none); choose another --out-dir")
    # reproduce.py writes its own files over what is there (results.md, the figures, corpus/, panx/): only into a
    # folder of its own (its results.json) or a new or empty one.
    if os.path.isdir(cfg.out_dir) and not os.path.lexists(results_path) and set(os.listdir(cfg.out_dir)) - {".lock"}:
        raise DataError(f"--out-dir {cfg.out_dir} holds files but no results.json of reproduce.py, which would write "
                        f"over its own files there; choose a new or empty folder")
    with lock_out_dir(cfg.out_dir):  # a second reproduce.py on this folder stops at once, not after hours of runs
        stored = evaluate.read_json(results_path) if os.path.exists(results_path) else {"setup": setup, "results": {}}
        if not (isinstance(stored, dict) and isinstance(stored.get("setup"), dict)
                and isinstance(stored.get("results"), dict)):
            raise DataError(f"{results_path}: not reproduce.py's (edited or damaged?); choose another --out-dir")
        # (reproduce.py before 8782749 recorded data outside the repository from it too: the same path, read so)
        stored["setup"] |= {k: data_path(os.path.join(REPO, v)) for k, v in stored["setup"].items()
                            if k in where and isinstance(v, str)}
        # Where nothing is made yet (no run, no tokenizer), a start of the same preset may name other data: one
        # stopped by a damaged file is started again with a sound one.
        made = stored["results"] or os.path.lexists(os.path.join(cfg.out_dir, "spm.model"))
        if stored["setup"] != setup and (made or stored["setup"].get("preset") != setup["preset"]):
            raise DataError(f"{results_path} holds results of another preset or other data "
                            f"({setup_difference(stored['setup'], setup)}); pass the same, or choose another --out-dir")
        check_results(stored["results"], p, results_path)
        if stored["setup"] != setup or not os.path.exists(results_path):  # the setup first: a start stopped
            write_json(results_path, {"setup": setup, "results": {}})  # anywhere after it resumes as itself alone
        reproduce(cfg, p, preset, setup, stored["results"], stored.get("baselines"), results_path)


def data_path(path):
    """A data path as the setup records it: inside the repository, from it (results/'s data/, in any clone);
    elsewhere, absolute (from a clone, it would change with the clone's place)."""
    path = os.path.abspath(path)  # (a link's own path: data/ may be a link to the download)
    return os.path.relpath(path, REPO) if Path(path).is_relative_to(REPO) else path


def setup_difference(then, now):
    """What differs between a stored setup and this start's: the preset's settings by name, the data by path."""
    preset = then.get("preset") if isinstance(then.get("preset"), dict) else {}
    settings = sorted(k for k in {*preset, *now["preset"]} if preset.get(k) != now["preset"].get(k))
    return "; ".join(f"another preset ({', '.join(settings)})" if k == "preset" else
                     f"--{k} {then.get(k)!r} then, {now.get(k)!r} now"
                     for k in sorted({*then, *now}) if then.get(k) != now.get(k))


def reproduce(cfg, p, preset, setup, results, stored_baselines, results_path):
    """The runs not yet in `results` (results.json's), each recorded as it ends, then the report."""
    started = time.time()
    # The XQuAD questions every run is probed on, read before any run (a damaged file: refused in seconds).
    pairs = len(evaluate.read_parallel(*(os.path.join(cfg.xquad, f"xquad.{lang}.json") for lang in ("en", "de")))[0]
                [:p.probe_pairs or None])
    corpus = split_corpus(cfg.data, os.path.join(cfg.out_dir, "corpus"))
    if p.max_train and p.max_eval:
        cfg.panx = first_sentences(p, cfg.panx, os.path.join(cfg.out_dir, "panx"))  # (our copy: not checked as --panx)
    spm = os.path.join(cfg.out_dir, "spm")  # (spm.model and spm.vocab)
    tokenizer_file, trained = f"{spm}.model", not os.path.exists(f"{spm}.model")
    if trained:  # (the quick preset's from fewer lines: its time is mostly this)
        if os.path.lexists(f"{spm}.vocab"):  # (ours, its model removed)
            os.remove(f"{spm}.vocab")
        data.train_tokenizer(corpus[0], p.vocab, spm, max_sentences=20_000 if preset == "quick" else 1_000_000)
    tokenizer = data.Tokenizer(tokenizer_file)
    heldout = heldout_batches(p, corpus, tokenizer)
    baselines = {"unigram": unigram_baseline(p, corpus, tokenizer, heldout), "majority": majority_tagger(p, cfg.panx)}
    # The baselines are functions of the corpus, the tokenizer and PAN-X: other values, other data than the stored
    # runs were made with (a file edited, or another copy at the same path), which a table must not mix.
    if results and (differ := difference(stored_baselines, baselines)):
        if trained:  # (made from these data just now: not left to be taken for the runs' own)
            for ext in ("model", "vocab"):
                os.remove(f"{spm}.{ext}")
        raise DataError(f"{results_path}: its runs were made on other data, or with another tokenizer ({differ}); pass "
                        f"the data they were made with, or choose another --out-dir")
    print(f"baselines: unigram model {baselines['unigram']}, most frequent tag {baselines['majority']['en']:.2f} "
          f"F1 (en)", flush=True)
    jobs = [(name, seed) for name in cfg.models or [*models(p), RANDOM] for seed in range(p.seeds)
            if str(seed) not in results.get(name, {})]
    workers = 1 if cfg.device == "cuda" else max(1, min(len(jobs), os.cpu_count() or 1, 2))
    threads = max(1, (os.cpu_count() or 1) // workers)  # two runs side by side use two cores best (small models)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=spawn, initializer=start_worker) as pool:
        def start(name, seed):
            return pool.submit(run_job, name, seed, p, cfg, corpus, tokenizer_file, heldout, threads)
        try:
            record(start, jobs, workers, {"setup": setup, "baselines": baselines, "results": results}, results_path,
                   started)
        except BaseException:  # an interruption of this process alone (kill -INT): its running runs stop now too
            for worker in multiprocessing.active_children():  # (each goes on from its last checkpoint next time)
                worker.terminate()
            raise
    print(summarize(results, baselines, p, cfg.out_dir, preset, chance=100 / (pairs - pairs // 2)))
    print(f"wrote {results_path}, results.md, curves.png and figure2.png in {cfg.out_dir} "
          f"({(time.time() - started) / 60:.1f} min)")


def record(start, jobs, workers, stored, results_path, started):
    """Run `jobs` ((name, seed) pairs), `workers` at a time (start(name, seed): a run's future), each recorded into
    `stored` and results.json as it ends. After the first failure no run starts; those running end and are recorded;
    then the failure is raised. (The pool is handed a run only when a worker is free: it would take the next ones in
    advance, and run them after a failure.)"""
    queued, running, failed, done = list(jobs), {}, None, 0
    while running or queued and not failed:
        while queued and not failed and len(running) < workers:
            job = queued.pop(0)
            try:
                running[start(*job)] = job
            except BrokenProcessPool as e:  # (a worker killed since the last run ended)
                failed = e
        for future in wait(running, return_when=FIRST_COMPLETED).done:
            name, seed = running.pop(future)
            if future.exception() is not None:
                failed = failed or future.exception()
                continue
            run, done = future.result(), done + 1
            if "curve" in run:  # no better than piece frequencies: kept, marked, left out of every claim
                run["collapsed"] = collapsed(run, stored["baselines"]["unigram"])
            stored["results"].setdefault(name, {})[str(seed)] = run
            elapsed = time.time() - started
            write_json(results_path, {**stored, "seconds": elapsed})
            print(f"[{done}/{len(jobs)}] {name}, seed {seed}" + " (collapsed)" * run.get("collapsed", False) +
                  f" | elapsed {elapsed / 60:.1f} min | left about {elapsed / done * (len(jobs) - done) / 60:.1f} min",
                  flush=True)
    if isinstance(failed, BrokenProcessPool):
        raise OSError(f"a run's process ended abruptly (killed, or out of memory?); {done} run(s) finished before, "
                      f"recorded in {results_path}: start again to go on") from None
    if failed:
        raise failed


def difference(then, now, where="baselines"):
    """Where the stored `then` first differs from `now` (dicts of numbers), beyond a float's rounding; or None."""
    if isinstance(now, dict):
        if not isinstance(then, dict) or then.keys() != now.keys():
            return f"{where} of other keys"
        return next((said for k in now if (said := difference(then[k], now[k], f"{where}.{k}"))), None)
    if type(then) in (int, float) and abs(then) < 1e300 and math.isclose(then, now, rel_tol=1e-9, abs_tol=1e-12):
        return None
    return f"{where} {then!r} then, {now!r} now"


def start_worker():
    """A run's process: Ctrl-C (the whole terminal's) ends it at once, without a traceback of its own: the main process
    says "interrupted", and a run goes on from its last checkpoint next time. On Linux it also ends with the main
    process, however that ends (a worker left running would hold its run's folder)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # (ignored in the main process too: left so)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def check_results(results, p, path):
    """results.json's runs as reproduce.py stores them; an edited or damaged one is refused by name, where it would
    stop the report with a traceback or count a run wrongly."""
    def number(v):  # finite, and a float's size (an integer of 400 digits is none: the report formats it as one)
        return type(v) in (int, float) and abs(v) < 1e300

    def stored(name, run):
        if not isinstance(run, dict):
            return False
        panx, seconds = run.get("panx"), run.get("seconds", {})  # (seconds: since 9d7fd5d; results/'s runs have none)
        ok = (isinstance(panx, dict) and number(panx.get("en")) and number(panx.get("zero_shot"))
              and isinstance(panx.get("languages"), dict) and sorted(panx["languages"]) == sorted(PANX_LANGS)
              and all(map(number, panx["languages"].values()))
              and isinstance(seconds, dict) and all(map(number, seconds.values())))
        if name == RANDOM:
            return ok
        curve, counts, figure2 = run.get("curve"), run.get("parameters"), run.get("figure2")
        return (ok and isinstance(curve, list)  # a point at every checkpoint (tokens seen, loss, accuracy)
                and [point[0] if isinstance(point, list) and point else None for point in curve] == tokens
                and all(len(point) == 3 and all(map(number, point)) for point in curve)
                and isinstance(counts, dict) and all(type(counts.get(k)) is int for k in ("pretraining", "finetuning"))
                and isinstance(figure2, list) and len(figure2) == p.layers + 1 and all(map(number, figure2))
                and type(run.get("collapsed")) is bool)
    steps = sorted({min(k * p.eval_every, p.steps) for k in range(1, -(-p.steps // p.eval_every) + 1)})
    tokens = [step * p.batch_size * p.seq_len for step in steps]
    for name, runs in results.items():
        if name not in [*models(p), RANDOM] or not isinstance(runs, dict) or not all(
                seed.isascii() and seed.isdigit() and len(seed) < 10 and seed == str(int(seed)) and stored(name, run)
                for seed, run in runs.items()):
            raise DataError(f"{path}: the runs of {name!r} are not as reproduce.py stores them (edited or damaged?); "
                            f"restore the file, or choose another --out-dir")


if __name__ == "__main__":
    run_script(main)
