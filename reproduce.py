r"""The paper's findings at laptop scale, in one command: small models that differ only in their
embeddings, pre-trained on the same multilingual text for the same number of tokens, then compared as
"Rethinking Embedding Coupling in Pre-trained Language Models" compares them (Chung et al., ICLR 2021):

  coupling (Table 2)        coupled vs decoupled input and output embeddings, E_in = E_out = H;
  output size (Table 4)     E_in small and fixed, E_out = H/4, H and 4H;
  extra layers (Table 5)    E_out = H/4 plus pre-training-only layers of about E_out = H's parameters;

each with --seeds seeds, measured by held-out masked-LM accuracy (Table 8), zero-shot cross-lingual
transfer from English on PAN-X and XNLI (Tables 2, 4, 5), PAN-X transfer with the last layers removed
before fine-tuning (Figure 1), and per-layer en->de nearest-neighbour translation accuracy on XQuAD's
parallel questions (Figure 2). The grid (PRESETS) was fixed beforehand, not chosen by looking at results.

It writes to --out-dir: results.json (every number of every seed, saved after each model, so an
interrupted run resumes), results.md (mean ± standard deviation over seeds, beside the paper's
figures), figure1.png and figure2.png. --data: Tatoeba's 113 languages and two novels, a tenth of
every file held out for Table 8; --tasks: PAN-X, XNLI, XQuAD.

  python reproduce.py                            # the cpu preset: about an hour on 2 CPU cores
  python reproduce.py --quick --out-dir /tmp/r   # the whole pipeline on tiny settings, a few minutes
  python reproduce.py --device cuda              # the gpu preset: larger models, longer pre-training
"""

import contextlib
import glob
import importlib.util
import itertools
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import data
import evaluate
import finetune
import pretrain
from configs import GIVEN, MBERT, at_least, check_flags, flag, parse_command_line, resolve_device, run_script
from model import DataError, count_parameters

SHARED = Path(__file__).resolve().parent.parent / "shared" / "data"
PANX_LANGS = ("de", "en", "es", "nl", "pl", "ru")
XNLI_LANGS = ("ar", "bg", "de", "el", "en", "es", "fr", "hi", "ru", "sw", "th", "tr", "ur", "vi", "zh")

PRESETS = {
    "quick": dict(hidden=64, layers=2, heads=2, small=16, extra_layers=2, vocab=2000, seq_len=64, batch_size=16,
                  steps=40, lr=2e-3, finetune_lr=5e-4, epochs=1, max_train=160, max_eval=40, figure1_layers=[1],
                  probe_pairs=200, seeds=1),
    # Its rate and length were set on the decoupled model alone, before any comparison ran, so that its
    # masked-LM loss falls below the corpus's unigram entropy (7.3 nats) within the time budget.
    "cpu": dict(hidden=64, layers=4, heads=2, small=16, extra_layers=4, vocab=8000, seq_len=128, batch_size=32,
                steps=450, lr=2e-3, finetune_lr=5e-4, epochs=3, max_train=0, max_eval=0, figure1_layers=[1, 2, 3],
                probe_pairs=0, seeds=3),
    "gpu": dict(hidden=256, layers=6, heads=4, small=64, extra_layers=6, vocab=16000, seq_len=128, batch_size=128,
                steps=6000, lr=1e-3, finetune_lr=2e-4, epochs=3, max_train=0, max_eval=0,
                figure1_layers=[1, 2, 3, 4, 5], probe_pairs=0, seeds=3),
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


# The paper's rows (mBERT-sized, 26B tokens) in the order of models(): (row, XNLI acc., NER F1, Table 8's MLM acc.).
PAPER = [("Table 2, coupled (E 768)", 70.7, 69.2, 61.1), ("Table 2, decoupled (E 768)", 71.3, 68.9, 61.6),
         ("Table 4, E_out 128", 68.1, 65.2, 59.0), ("Table 4, E_out 768", 70.4, 67.6, 60.7),
         ("Table 4, E_out 3072", 71.1, 68.1, 62.3), ("Table 5, E_out 128 + 11 layers", 71.2, 67.3, "-")]


@dataclass
class ReproduceConfig:
    data: str = flag(str(SHARED / "corpus"), "pre-training text: a directory of *.txt files, searched recursively",
                     GIVEN)
    tasks: str = flag(str(SHARED), "task data: ner/panx, xnli, xquad as in ../shared/data", GIVEN)
    out_dir: str = flag("out/reproduce", "results, plots and every model", GIVEN)
    device: str = flag("auto", "auto | cpu | cuda (cuda runs the gpu preset)",
                       (lambda v: v in ("auto", "cpu", "cuda") and resolve_device(v), "auto, cpu or cuda"))
    quick: bool = flag(False, "the tiny preset: the whole pipeline in a few minutes")
    seeds: int = flag(0, "seeds per model (0: the preset's)", at_least(0))

    def __post_init__(self):
        check_flags(self)
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("reproduce.py draws its figures with matplotlib: pip install matplotlib")
        if (os.path.realpath(self.out_dir) + os.sep).startswith(os.path.realpath(self.data) + os.sep):
            raise ValueError("--out-dir is inside --data: its copies of the corpus would be read as more corpus")
        files = ["ner/panx/train-en.tsv", "xquad/xquad.en.json", "xquad/xquad.de.json",
                 *(f"ner/panx/dev-{lang}.tsv" for lang in PANX_LANGS), *(f"xnli/dev-{lang}.tsv" for lang in XNLI_LANGS)]
        if missing := [f for f in files if not os.path.isfile(os.path.join(self.tasks, f))]:
            raise ValueError(f"--tasks {self.tasks} has no {missing[0]} (it needs ner/panx, xnli, xquad as "
                             f"../shared/data has them)")


def split_corpus(source, out):
    """Each corpus file split into out/train and out/heldout: its last tenth of non-blank lines (at least one)."""
    files = sorted(glob.glob(os.path.join(source, "**", "*.txt"), recursive=True))
    if not files:
        raise DataError(f"{source}: no *.txt files in it or below it")
    names = [os.path.basename(f) for f in files]
    if len(set(names)) < len(names):
        raise DataError(f"{source}: two files have the same name; the language is read from the name")
    for path, name in zip(files, names):
        lines = data.read_text(path).removesuffix("\n").split("\n")
        text = [i for i, line in enumerate(lines) if line.strip()]
        if len(text) < 2:
            raise DataError(f"{path}: fewer than 2 lines, nothing to hold out")
        cut = text[len(text) - max(1, len(text) // 10)]
        for part, chunk in (("train", lines[:cut]), ("heldout", lines[cut:])):
            os.makedirs(os.path.join(out, part), exist_ok=True)
            Path(out, part, name).write_text("\n".join(chunk) + "\n", encoding="utf-8")
    return os.path.join(out, "train"), os.path.join(out, "heldout")


def run_seed(name, seed, p, cfg, corpus, tokenizer_file):
    """Pre-train one model with one seed, then measure it: {measure: value}."""
    run_dir = os.path.join(cfg.out_dir, "runs", name.replace(" ", "-"), f"seed-{seed}")
    os.makedirs(run_dir, exist_ok=True)
    train_config = pretrain.TrainConfig(
        data=corpus[0], tokenizer=tokenizer_file, out_dir=os.path.join(run_dir, "pretrain"), device=cfg.device,
        seq_len=p.seq_len, max_predictions=round(0.15 * p.seq_len), batch_size=p.batch_size, steps=p.steps,
        warmup=p.steps // 10, lr=p.lr, log_every=max(1, p.steps // 20), checkpoint_every=p.steps, seed=seed,
        resume=True)
    with open(os.path.join(run_dir, "pretrain.log"), "w") as log, contextlib.redirect_stdout(log):  # not on screen
        model = pretrain.train(models(p)[name], train_config)
    checkpoint = pretrain.checkpoint_paths(train_config.out_dir)[-1]

    def transfer(task, keep=0):
        """Fine-tuned on English (PAN-X's train file; XNLI's first 80% of dev-en): the other languages' mean, en's."""
        folder, train, fraction, langs = {"panx": ("ner/panx", "train-en.tsv", 1.0, PANX_LANGS),
                                          "xnli": ("xnli", "dev-en.tsv", 0.8, XNLI_LANGS)}[task]
        ft = finetune.FinetuneConfig(
            task=task, init=checkpoint, tokenizer=tokenizer_file, train=os.path.join(cfg.tasks, folder, train),
            eval=[os.path.join(cfg.tasks, folder, f"dev-{lang}.tsv") for lang in langs], train_fraction=fraction,
            max_train=p.max_train, max_eval=p.max_eval, out_dir=os.path.join(run_dir, f"{task}-{keep}"),
            device=cfg.device, lr=[p.finetune_lr], epochs=p.epochs, seeds=[seed], keep_layers=keep, resume=True)
        with open(os.path.join(run_dir, f"{task}-{keep}.log"), "w") as log, contextlib.redirect_stdout(log):
            table = finetune.run(ft)
        metric = finetune.TASKS[task].metrics[0]
        others = [row[metric] for lang, row in table.items() if lang not in ("en", "average")]
        return {"transfer": sum(others) / len(others), "en": table["en"][metric]}

    tokenizer = data.Tokenizer(tokenizer_file)
    heldout = data.MLMLoader(corpus[1], tokenizer, batch_size=p.batch_size, seq_len=p.seq_len,
                             max_predictions=train_config.max_predictions, seed=10_000)
    accuracy = evaluate.mlm_accuracy(model.to(cfg.device), itertools.islice(heldout, 20), cfg.device)["accuracy"]
    result = {"parameters": count_parameters(model), "mlm_accuracy": accuracy, "panx": transfer("panx"),
              "xnli": transfer("xnli")}
    if name.startswith("E_out") and "layers" not in name:  # Figure 1: one curve per E_out
        result["figure1"] = {str(keep): transfer("panx", keep)["transfer"] for keep in p.figure1_layers}
        result["figure1"][str(p.layers)] = result["panx"]["transfer"]
    pairs = evaluate.read_parallel(*(Path(cfg.tasks) / f"xquad/xquad.{lang}.json" for lang in ("en", "de")))
    source, target = ([tokenizer.encode(t) for t in side[:p.probe_pairs or None]] for side in pairs)
    result["figure2"] = evaluate.translation_probe(model.encoder.to(cfg.device), source, target, tokenizer.cls_id,
                                                   tokenizer.sep_id, tokenizer.pad_id, device=cfg.device)
    return result


def mean_std(values):
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(results, p, out_dir):
    """results.md (the table) and figure1.png, figure2.png (one curve per E_out)."""
    import matplotlib.pyplot as plt
    plt.switch_backend("Agg")
    lines = [f"Mean ± standard deviation over {p.seeds} seed(s); H {p.hidden}, "
             f"{p.layers} layers, {p.steps} pre-training steps of {p.batch_size} x {p.seq_len} tokens. Zero-shot: "
             "the average over the languages other than English. The paper: XTREME's averages, mBERT-sized.", "",
             "| model | PT / FT params | MLM acc. | PAN-X F1 zero-shot | PAN-X F1 en | XNLI acc. zero-shot "
             "| XNLI acc. en | paper: row | XNLI | NER F1 | MLM acc. |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for name, paper in zip(models(p), PAPER):
        counts = results[name]["0"]["parameters"]
        runs = [[r["mlm_accuracy"], r["panx"]["transfer"], r["panx"]["en"], r["xnli"]["transfer"], r["xnli"]["en"]]
                for r in results[name].values()]
        cells = ["{:.1f} ± {:.1f}".format(*mean_std(column)) for column in zip(*runs)]
        lines.append(f"| {name} | {counts['pretraining'] / 1e6:.2f}M / {counts['finetuning'] / 1e6:.2f}M | "
                     f"{' | '.join(cells)} | {' | '.join(map(str, paper))} |")
    Path(out_dir, "results.md").write_text("\n".join(lines) + "\n")
    for figure, xlabel, ylabel in (("figure1", "layers kept for fine-tuning", "PAN-X F1, zero-shot average (%)"),
                                   ("figure2", "layer (0: embeddings)", "en->de nearest-neighbour accuracy (%)")):
        fig, ax = plt.subplots(figsize=(5, 3.4), layout="tight")
        for name in (n for n in models(p) if "figure1" in results[n]["0"]):  # the E_out models
            runs = [r[figure] for r in results[name].values()]  # figure1: {layers kept: F1}, figure2: [accuracy]
            xs = sorted(map(int, runs[0])) if figure == "figure1" else range(len(runs[0]))
            stats = [mean_std([run[str(x)] if figure == "figure1" else run[x] for run in runs]) for x in xs]
            ax.errorbar(xs, [m for m, _ in stats], yerr=[s for _, s in stats], marker="o", capsize=3, label=name)
        ax.set(xticks=xs, xlabel=xlabel, ylabel=ylabel)
        ax.legend()
        fig.savefig(os.path.join(out_dir, f"{figure}.png"), dpi=100)
        plt.close(fig)
    return "\n".join(lines)


def main(argv=None):
    _, cfg = parse_command_line(__doc__, ReproduceConfig, argv)
    cfg = replace(cfg, device=resolve_device(cfg.device))
    preset = "quick" if cfg.quick else "gpu" if cfg.device == "cuda" else "cpu"
    p = SimpleNamespace(**PRESETS[preset])
    p.seeds = cfg.seeds or p.seeds
    started = time.time()
    print(f"preset {preset}: {vars(p)}", flush=True)
    setup = {"preset": vars(p), "data": os.path.realpath(cfg.data), "tasks": os.path.realpath(cfg.tasks)}
    setup_path = os.path.join(cfg.out_dir, "setup.json")
    if os.path.exists(setup_path) and evaluate.read_json(setup_path) != setup:
        raise DataError(f"{cfg.out_dir} holds a run of another preset or other data; choose another --out-dir")
    results_path = os.path.join(cfg.out_dir, "results.json")
    stored = evaluate.read_json(results_path) if os.path.exists(results_path) else {"setup": setup, "results": {}}
    if not isinstance(stored, dict) or stored.get("setup") != setup or not isinstance(stored.get("results"), dict):
        raise DataError(f"{results_path} holds results of another preset or other data; choose another --out-dir")
    results = stored["results"]
    corpus = split_corpus(cfg.data, os.path.join(cfg.out_dir, "corpus"))
    data.write_json(setup_path, setup)  # after split_corpus checked --data
    tokenizer_file = os.path.join(cfg.out_dir, "spm.model")  # trained by the first pre-training
    jobs = [(name, seed) for name in models(p) for seed in range(p.seeds) if str(seed) not in results.get(name, {})]
    for done, (name, seed) in enumerate(jobs, 1):
        job_started = time.time()
        results.setdefault(name, {})[str(seed)] = run_seed(name, seed, p, cfg, corpus, tokenizer_file)
        elapsed = time.time() - started
        data.write_json(results_path, {"setup": setup, "results": results, "seconds": elapsed})
        print(f"[{done}/{len(jobs)}] {name}, seed {seed}: {time.time() - job_started:.0f} s | elapsed "
              f"{elapsed / 60:.1f} min | left about {elapsed / done * (len(jobs) - done) / 60:.1f} min", flush=True)
    print(summarize(results, p, cfg.out_dir))
    print(f"wrote {results_path}, results.md, figure1.png and figure2.png in {cfg.out_dir} "
          f"({(time.time() - started) / 60:.1f} min)")


if __name__ == "__main__":
    run_script(main)
