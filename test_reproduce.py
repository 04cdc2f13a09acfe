"""Tests of reproduce.py: the baselines and the collapse marker against hand-computed values, the whole pipeline
on its quick preset, a rerun that reuses what is done, and its bad inputs."""

import json
import math
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import data
import reproduce
from checkpoints import DataError
from configs import run_script

REPO = Path(__file__).parent
SHARED = REPO.parent / "shared" / "data"
TASKS = ["--panx", str(SHARED / "ner" / "panx"), "--xquad", str(SHARED / "xquad")]


def test_the_unigram_model_predicts_piece_frequencies(tmp_path, monkeypatch):
    """The stream's masked targets (10 x 3 of piece 7, 10 x 1 of piece 9) against held-out targets 7, 9, 9."""
    train = [{"masked_ids": torch.tensor([[7, 7, 9], [7, 0, 0]]),
              "masked_weights": torch.tensor([[1., 1, 1], [1, 0, 0]])}]
    heldout = [{"masked_ids": torch.tensor([[7, 9, 9, 3]]), "masked_weights": torch.tensor([[1., 1, 1, 0]])}]
    monkeypatch.setattr(data, "MLMLoader", lambda *a, **k: iter(train * 100))
    p = SimpleNamespace(batch_size=2, seq_len=20, eval_batches=1)
    tokenizer = SimpleNamespace(vocab_size=10)
    baseline = reproduce.unigram_baseline(p, ("train", "heldout"), tokenizer, heldout)
    total = 10 * 3 + 10 * 1 + 0.5 * 10  # add-0.5 smoothing over the 10 pieces
    p7, p9 = (10 * 3 + 0.5) / total, (10 * 1 + 0.5) / total
    assert baseline["loss"] == pytest.approx(-(math.log(p7) + 2 * math.log(p9)) / 3)
    assert baseline["accuracy"] == pytest.approx(100 / 3)  # piece 7 is the most frequent: right once in three


def test_the_corpus_is_split_as_the_loader_reads_it_folders_included(tmp_path):
    """Each file's last tenth of non-blank lines is held out, in place below train/ and heldout/, so that two
    folders' en.txt (one language, as data.corpus_files reads them) stay two files."""
    for folder, n in (("a", 20), ("b", 10)):
        (tmp_path / "corpus" / folder).mkdir(parents=True)
        (tmp_path / "corpus" / folder / "en.txt").write_text("".join(f"{folder} {i}\n\n" for i in range(n)))
    train, heldout = reproduce.split_corpus(str(tmp_path / "corpus"), str(tmp_path / "split"))
    assert {lang: len(paths) for lang, paths in data.corpus_files(train).items()} == {"en": 2}
    assert (Path(heldout) / "a" / "en.txt").read_text() == "a 18\n\na 19\n\n"
    assert (Path(heldout) / "b" / "en.txt").read_text() == "b 9\n\n"
    assert (Path(train) / "b" / "en.txt").read_text().split() == [w for i in range(9) for w in ("b", str(i))]


def test_the_majority_tagger_and_the_collapse_marker(tmp_path):
    panx = tmp_path / "panx"
    panx.mkdir()
    (panx / "train-en.tsv").write_text("Paris\tB-LOC\nis\tO\n\nParis\tB-PER\n\nParis\tB-LOC\n")
    for lang in reproduce.PANX_LANGS:  # Paris is a place twice in three: tagged B-LOC; "Rome", unseen, O
        (panx / f"dev-{lang}.tsv").write_text("Paris\tB-LOC\n\nRome\tB-LOC\n")
    scores = reproduce.majority_tagger(SimpleNamespace(max_train=0, max_eval=0), str(panx))
    assert scores["en"] == scores["zero_shot"] == pytest.approx(100 * 2 * 1 * 0.5 / 1.5)  # precision 1, recall 1/2
    p = SimpleNamespace(small=16, hidden=64, extra_layers=4)
    unigram = {"loss": 7.0, "accuracy": 4.5}

    def run(loss, accuracy, f1):
        run = {"curve": [[0, 9.0, 0.0], [1, loss, accuracy]], "panx": {"zero_shot": f1}}
        return {**run, "collapsed": reproduce.collapsed(run, unigram)}
    results = {"E_out 16": {"0": run(6.95, 5.0, 10), "1": run(6.8, 5.2, 11)},  # 6.95 > 7.0 - 0.1: collapsed
               "E_out 64": {"0": run(6.5, 7.0, 12), "1": run(6.4, 7.1, 12)},
               "E_out 256": {"0": run(6.0, 9.0, 12), "1": run(6.1, 9.1, 13)}}
    assert results["E_out 16"]["0"]["collapsed"] and not results["E_out 16"]["1"]["collapsed"]
    assert run(6.0, 4.5, 10)["collapsed"] and not run(6.89, 4.6, 10)["collapsed"]  # the most frequent piece's 4.5%
    claims = {claim: verdict for claim, _, verdict in reproduce.claims(results, p)}
    # One sound run of E_out 16 is no spread to compare against: not measured, not a verdict on one seed.
    assert claims["E_out H/4 -> H -> 4H: held-out MLM loss falls (Tables 4, 8)"].startswith("not measured")
    results["E_out 16"]["0"] = run(6.85, 5.1, 10)
    claims = {claim: verdict for claim, _, verdict in reproduce.claims(results, p)}
    assert claims["E_out H/4 -> H -> 4H: held-out MLM loss falls (Tables 4, 8)"] == "visible at both steps (n=2 seeds)"


def test_each_step_of_a_comparison_has_its_verdict():
    """Made-up runs: E_out 16 -> 64 within the spread of 4 seeds and 64 -> 256 beyond it; decoupling beyond it the
    other way on 2 seeds; a collapsed run leaves 2 of 3 seeds."""
    p = SimpleNamespace(small=16, hidden=64, extra_layers=4)

    def runs(losses, accuracies, collapsed=()):
        return {str(seed): {"curve": [[1, loss, accuracy]], "panx": {"zero_shot": 20.0},
                            "collapsed": seed in collapsed}
                for seed, (loss, accuracy) in enumerate(zip(losses, accuracies))}
    results = {"E_out 16": runs([7.0, 7.02, 7.0, 7.02], [7.0, 7.2, 7.0, 7.2]),  # accuracy 7.1, sd 0.115
               "E_out 64": runs([6.6, 6.62, 6.6, 6.62], [7.1, 7.3, 7.1, 7.3]),  # +0.1 against 2 sd 0.23
               "E_out 256": runs([6.2, 6.22, 6.2, 6.22], [10.0, 10.2, 10.0, 10.2]),  # +2.9
               "E_out 16 + 4 layers": runs([6.9, 6.92, 9.0], [7.0, 7.2, 5.0], collapsed=[2]),
               "coupled": runs([6.4, 6.4], [8.3, 8.2]), "decoupled": runs([6.5, 6.5], [7.5, 7.6])}
    claims = {claim: (measured, verdict) for claim, measured, verdict in reproduce.claims(results, p)}
    assert claims["E_out H/4 -> H -> 4H: held-out MLM accuracy rises (Table 8)"] == (
        "E_out 16 -> E_out 64: +0.10 points (2 sd 0.23); E_out 64 -> E_out 256: +2.90 points (2 sd 0.23)",
        "visible at E_out 64 -> E_out 256; within the spread at E_out 16 -> E_out 64 (n=4 seeds)")
    assert claims["E_out H/4 -> H -> 4H: held-out MLM loss falls (Tables 4, 8)"][1] == (
        "visible at both steps (n=4 seeds)")
    assert claims["E_out H/4 -> H -> 4H: PAN-X zero-shot F1 rises (Table 4)"][1] == (
        "within the spread at both steps (n=4 seeds)")
    assert claims["coupled -> decoupled: held-out MLM accuracy rises (Table 8)"] == (
        "-0.70 points (2 sd 0.14)", "opposite (n=2 seeds)")
    assert claims["+4 pre-training-only layers: held-out MLM loss falls"][1] == "visible (n=2 to 4 seeds)"
    # Table 2's transfer row: the paper's way is a fall (-0.3); a fall beyond the spread was said to be "opposite".
    for seed, (coupled, decoupled) in enumerate(((24.0, 22.0), (24.2, 22.2))):
        results["coupled"][str(seed)]["panx"] = {"zero_shot": coupled}
        results["decoupled"][str(seed)]["panx"] = {"zero_shot": decoupled}
    claims = {claim: (measured, verdict) for claim, measured, verdict in reproduce.claims(results, p)}
    assert claims["coupled -> decoupled: PAN-X zero-shot F1 falls (Table 2: -0.3)"] == (
        "+2.00 F1 lower (2 sd 0.28)", "visible (n=2 seeds)")
    del results["decoupled"]["1"]  # seeds added to coupled alone: the verdict names the model that has too few
    claims = {claim: verdict for claim, _, verdict in reproduce.claims(results, p)}
    assert claims["coupled -> decoupled: held-out MLM accuracy rises (Table 8)"] == (
        "not measured: a spread needs 2 sound runs of each model (decoupled 1 of 1; --seeds 2 or more, and collapsed "
        "runs are left out)")


def test_after_a_failed_run_no_other_starts_and_the_running_ones_are_recorded(tmp_path):
    """Two workers, five runs: the second fails while the first still runs. The first is recorded, the failure
    raised, and no third run starts (handed to the pool in advance, up to three ran before the failure was said)."""
    started, first_may_end = [], threading.Event()

    def run(name, seed):
        if name == "b":
            first_may_end.set()
            raise FloatingPointError("b diverged")
        assert first_may_end.wait(10)
        return {"panx": {"en": 50.0}}
    results = {"setup": {}, "baselines": {}, "results": {}}
    with ThreadPoolExecutor(2) as pool:
        def start(name, seed):
            started.append(name)
            return pool.submit(run, name, seed)
        with pytest.raises(FloatingPointError, match="b diverged"):
            reproduce.record(start, [(name, 0) for name in "abcde"], 2, results, tmp_path / "results.json", 0)
    assert started == ["a", "b"]
    assert results["results"] == {"a": {"0": {"panx": {"en": 50.0}}}}
    assert json.loads((tmp_path / "results.json").read_text())["results"] == results["results"]


def test_a_run_process_that_ended_abruptly_is_one_line(tmp_path):
    """A worker killed (the kernel's out-of-memory killer, say) breaks the pool: the runs that finished are recorded,
    and its BrokenProcessPool, raised by a run or by handing the next run over, is said in one line."""
    def run(name, seed):
        if name == "broken run":
            raise BrokenProcessPool("A child process terminated abruptly")
        return {"panx": {"en": 50.0}}
    for broken in ("broken run", "broken hand-over"):
        results = {"setup": {}, "baselines": {}, "results": {}}
        with ThreadPoolExecutor(1) as pool:
            def start(name, seed):
                if name == "broken hand-over":
                    raise BrokenProcessPool("A child process terminated abruptly")
                return pool.submit(run, name, seed)
            with pytest.raises(OSError, match=r"^a run's process ended abruptly .*; 1 run\(s\) finished before"):
                reproduce.record(start, [("a", 0), (broken, 0), ("c", 0)], 1, results, tmp_path / "results.json", 0)
        assert list(results["results"]) == ["a"]


@pytest.mark.subprocess
@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")
def test_quick_run_writes_the_tables_and_both_figures(tmp_path, monkeypatch, capsys):
    """The quick preset's pipeline on 40 steps and a fifth of its PAN-X sentences: what it writes, not what it
    learns."""
    monkeypatch.setitem(reproduce.PRESETS, "quick", {**reproduce.PRESETS["quick"], "steps": 40, "warmup": 10,
                                                     "eval_every": 20, "eval_batches": 4, "epochs": 1, "max_train": 200,
                                                     "max_eval": 50})
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    command = ["--quick", "--out-dir", str(out), "--data", str(SHARED / "corpus"), *TASKS]
    reproduce.main(command)
    stdout = capsys.readouterr().out
    assert "[7/7]" in stdout and "left about" in stdout  # progress with an estimate of the time left
    stored = json.loads((out / "results.json").read_text())
    assert stored["setup"]["panx"] == os.path.abspath(SHARED / "ner" / "panx")  # outside the repository: absolute
    results = stored["results"]
    assert len(results) == 7 and set(stored["baselines"]) == {"unigram", "majority"}
    for name, seeds in results.items():
        measures = seeds["0"]
        assert 0 <= measures["panx"]["en"] <= 100 and set(measures["panx"]["languages"]) == set(reproduce.PANX_LANGS)
        expected = {"finetune"} if name == reproduce.RANDOM else {"pretrain", "score", "finetune"}
        assert set(measures["seconds"]) == expected and all(s > 0 for s in measures["seconds"].values())
        if name != reproduce.RANDOM:
            assert [point[0] for point in measures["curve"]] == [20 * 16 * 64, 40 * 16 * 64]  # tokens seen
            assert len(measures["figure2"]) == 3 and isinstance(measures["collapsed"], bool)  # embeddings, 2 layers
    table = (out / "results.md").read_text()
    assert all(f"| {name} |" in table for name in results if name != reproduce.RANDOM)
    assert "unigram model" in table and "most frequent tag" in table and "Table 4, E_out 3072" in table
    for figure in ("curves.png", "figure2.png"):
        assert (out / figure).read_bytes()[:4] == b"\x89PNG"
    reproduce.main(command)
    assert "[1/" not in capsys.readouterr().out  # every run was done: nothing runs again


class Stopped(Exception):  # (a Ctrl-C where a start trains its tokenizer; a KeyboardInterrupt would stop pytest)
    pass


def stop(*args, **kwargs):
    raise Stopped


# A run of the quick preset as results.json stores it: a point at each of its 7 checkpoints, the probe's figure at the
# embeddings and its 2 layers.
QUICK_RUN = {"panx": {"en": 50.0, "zero_shot": 40.0, "languages": dict.fromkeys(reproduce.PANX_LANGS, 45.0)},
             "seconds": {"pretrain": 1.0}, "curve": [[step * 16 * 64, 6.0, 10.0] for step in range(100, 800, 100)],
             "parameters": {"pretraining": 2, "finetuning": 1}, "figure2": [10.0, 20.0, 30.0], "collapsed": False}


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")
def test_a_start_stopped_before_its_first_run_is_resumed_by_its_own_preset_alone(tmp_path, monkeypatch):
    """Ctrl-C while the tokenizer trains: the setup is recorded first, so that another preset started in that
    --out-dir is refused (it ran, with the first preset's tokenizer of another size, without a word)."""
    monkeypatch.setattr(reproduce.data, "train_tokenizer", stop)
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    with pytest.raises(Stopped):
        reproduce.main(["--quick", "--out-dir", str(out), "--data", str(SHARED / "corpus"), *TASKS])
    with pytest.raises(DataError, match="results.json holds results of another preset or other data"):
        reproduce.main(["--device", "cpu", "--out-dir", str(out), "--data", str(SHARED / "corpus"), *TASKS])


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")
def test_the_documented_commands_run_the_cpu_preset_where_torch_sees_a_gpu(monkeypatch):
    """`python reproduce.py` is the cpu preset, as the docs say (and results/'s seeds are added without --device):
    --device auto took a GPU, and with it the gpu preset."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    folders = ["--data", str(SHARED / "corpus"), *TASKS]
    assert reproduce.parse_command_line(reproduce.__doc__, reproduce.ReproduceConfig, folders)[1].preset() == "cpu"
    assert reproduce.parse_command_line(reproduce.__doc__, reproduce.ReproduceConfig, [*folders, "--device", "auto"]
                                        )[1].preset() == "gpu"


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")
def test_runs_go_on_from_a_clone_elsewhere_with_the_same_data(tmp_path, monkeypatch):
    """Data outside the repository are recorded by their absolute path: recorded from the repository, as they were,
    they seemed other data from a clone at another depth, and its runs were refused. A setup recorded so before is
    read as it was meant."""
    monkeypatch.setattr(reproduce.data, "train_tokenizer", stop)
    out, command = tmp_path / "out", ["--quick", "--out-dir", str(tmp_path / "out"), "--data", str(SHARED / "corpus"),
                                      *TASKS]
    with pytest.raises(Stopped):
        reproduce.main(command)
    stored = json.loads((out / "results.json").read_text())
    (out / "results.json").write_text(json.dumps({**stored, "results": {"coupled": {"0": QUICK_RUN}}}))
    repo = reproduce.REPO
    monkeypatch.setattr(reproduce, "REPO", tmp_path / "deeper" / "clone")
    with pytest.raises(Stopped):  # (its tokenizer is trained next: the setup was taken for this one's)
        reproduce.main(command)
    # A folder begun by the reproduce.py before, which recorded them from the repository too: goes on in its clone.
    monkeypatch.setattr(reproduce, "REPO", repo)
    stored = json.loads((out / "results.json").read_text())
    stored["setup"] |= {k: os.path.relpath(stored["setup"][k], repo) for k in ("data", "panx", "xquad")}
    (out / "results.json").write_text(json.dumps(stored))
    with pytest.raises(Stopped):
        reproduce.main(command)


@pytest.mark.subprocess
@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")
def test_an_out_dir_of_other_files_or_in_use_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """reproduce.py writes results.md, the figures, corpus/ and panx/ over what is in --out-dir: a folder with a user's
    files and no results.json of its own is refused, untouched (a user's results.md and panx/train-en.tsv were
    overwritten, their corpus/train/en.txt read as training text); so is one another run is using, at once."""
    monkeypatch.setattr(reproduce.data, "train_tokenizer", stop)
    monkeypatch.chdir(REPO)
    theirs = tmp_path / "theirs"
    (theirs / "panx").mkdir(parents=True)
    for name in ("results.md", "panx/train-en.tsv"):
        (theirs / name).write_text("my own notes\n")
    command = ["--quick", "--data", str(SHARED / "corpus"), *TASKS]
    with pytest.raises(DataError, match="theirs holds files but no results.json of reproduce.py"):
        reproduce.main([*command, "--out-dir", str(theirs)])
    assert sorted(p.name for p in theirs.rglob("*")) == ["panx", "results.md", "train-en.tsv"]
    assert (theirs / "results.md").read_text() == "my own notes\n"
    busy = tmp_path / "busy"  # (a lock is a process's: another process holds it)
    hold = f"import checkpoints, time; held = checkpoints.claim({str(busy)!r}); print('locked', flush=True); " \
        "time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(DataError, match="busy is in use by another run"):
            reproduce.main([*command, "--out-dir", str(busy)])
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")
def test_damaged_inputs_and_results_are_refused_before_any_run(tmp_path, monkeypatch):
    """A damaged XQuAD file is refused before the runs (it was read after them all: an hour of the cpu preset, then
    nothing recorded), and results.json's runs edited into another shape are refused by name (tracebacks: an empty
    curve, a run that is a number, "collapsed": "false" read as collapsed)."""
    monkeypatch.setattr(reproduce.data, "train_tokenizer", stop)
    monkeypatch.chdir(REPO)
    xquad = tmp_path / "xquad"
    xquad.mkdir()
    for lang in ("en", "de"):
        raw = (SHARED / "xquad" / f"xquad.{lang}.json").read_bytes()
        (xquad / f"xquad.{lang}.json").write_bytes(raw[:20000] if lang == "de" else raw)
    command = ["--quick", "--data", str(SHARED / "corpus"), "--panx", str(SHARED / "ner" / "panx")]
    out = tmp_path / "out"
    with pytest.raises(DataError, match="xquad.de.json: not SQuAD-format JSON"):
        reproduce.main([*command, "--xquad", str(xquad), "--out-dir", str(out)])
    with pytest.raises(Stopped):  # nothing made yet: started again on sound files, its setup now that one
        reproduce.main([*command, "--xquad", str(SHARED / "xquad"), "--out-dir", str(out)])
    stored = json.loads((out / "results.json").read_text())
    run, curve = QUICK_RUN, QUICK_RUN["curve"]
    huge = [*curve[:-1], [700 * 16 * 64, 10 ** 400, 10.0]]  # (a loss of 400 digits: no float)
    for seed, edit in (("0", {"curve": []}), ("0", {"collapsed": "false"}), ("0", {"parameters": {}}),
                       ("0", {"panx": {"en": 50.0}}), ("0", 5), ("0", {"curve": huge}), ("0", {"curve": curve[:-1]}),
                       ("0", {"figure2": [10.0, 20.0]}), ("00", {}), ("²", {})):
        # (a curve or probe a point short read as whole; "00", a seed counted twice, spreads of copies)
        edited = {"coupled": {"0": run, seed: {**run, **edit} if isinstance(edit, dict) else edit}}
        (out / "results.json").write_text(json.dumps({**stored, "results": edited}))
        with pytest.raises(DataError, match="results.json: the runs of 'coupled' are not as reproduce.py stores them"):
            reproduce.main([*command, "--xquad", str(SHARED / "xquad"), "--out-dir", str(out)])
    (out / "results.json").write_text(json.dumps({**stored, "results": {"coupled": {"0": run}}}))
    with pytest.raises(Stopped):  # as stored: taken as it is
        reproduce.main([*command, "--xquad", str(SHARED / "xquad"), "--out-dir", str(out)])
    shipped = json.loads((REPO / "results" / "results.json").read_text())  # (its runs predate "seconds")
    reproduce.check_results(shipped["results"], SimpleNamespace(**reproduce.PRESETS["cpu"]), "results.json")


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")
def test_runs_made_on_other_data_are_not_mixed_with_new_ones(tmp_path, monkeypatch):
    """The baselines are functions of the corpus, the tokenizer and PAN-X: stored ones that differ from this start's
    mean other data at the same paths (runs of both were put in one table), and other paths are named."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    command = ["--quick", "--data", str(SHARED / "corpus"), *TASKS, "--out-dir", str(out)]
    monkeypatch.setattr(reproduce.data, "train_tokenizer", stop)
    with pytest.raises(Stopped):  # the setup recorded; then a tokenizer, and the baselines of other data
        reproduce.main(command)
    monkeypatch.undo()
    monkeypatch.chdir(REPO)
    trained = data.train_tokenizer(str(SHARED / "corpus" / "literature"), 500, str(tmp_path / "spm"))

    def train_tokenizer(files, vocab_size, prefix, **kwargs):  # (that one again: what is tested is reproduce.py)
        for ext in ("model", "vocab"):
            if os.path.lexists(f"{prefix}.{ext}"):  # (as data.train_tokenizer refuses to)
                raise DataError(f"{prefix}.{ext} exists")
            shutil.copy(trained.removesuffix("model") + ext, f"{prefix}.{ext}")
    monkeypatch.setattr(reproduce.data, "train_tokenizer", train_tokenizer)
    train_tokenizer(None, 500, str(out / "spm"))
    stored = json.loads((out / "results.json").read_text())
    baselines = {"unigram": {"loss": 5.0, "accuracy": 8.0},
                 "majority": {"en": 17.4, "zero_shot": 9.28, "languages": {}}}
    monkeypatch.setattr(reproduce, "ProcessPoolExecutor", stop)  # (where the runs would start)
    for stored_baselines, said in ((baselines, r"baselines.unigram.loss 5.0 then, [0-9.]+ now"),
                                   (None, "baselines of other keys"), (5, "baselines of other keys")):
        (out / "results.json").write_text(json.dumps({**stored, "baselines": stored_baselines,
                                                      "results": {"coupled": {"0": QUICK_RUN}}}))
        with pytest.raises(DataError, match=r"results.json: its runs were made on other data, or with another "
                                            fr"tokenizer \({said}\)"):
            reproduce.main(command)
    (tmp_path / "xquad").mkdir()  # the same files elsewhere: another path, named
    for lang in ("en", "de"):
        (tmp_path / "xquad" / f"xquad.{lang}.json").symlink_to(SHARED / "xquad" / f"xquad.{lang}.json")
    with pytest.raises(DataError, match=r"holds results of another preset or other data \(--xquad '[^']*' then, '"):
        reproduce.main([*command[:-4], "--xquad", str(tmp_path / "xquad"), "--out-dir", str(out)])
    for name in ("spm.model", "spm.vocab"):  # a tokenizer this start trains on other data is not left behind,
        (out / name).unlink()  # where it would be taken for the runs' own once the data are restored
    with pytest.raises(DataError, match="its runs were made on other data"):
        reproduce.main(command)
    assert not list(out.glob("spm.*"))
    (out / "results.json").write_text(json.dumps(stored))  # no runs yet, and a tokenizer's vocabulary without its
    (out / "spm.vocab").write_text("[PAD]\t0\n")  # model: trained anew (it was refused, "choose another name")
    with pytest.raises(Stopped):
        reproduce.main(command)
    assert (out / "spm.model").exists()


def test_a_corpus_split_anew_holds_no_file_since_removed(tmp_path):
    (tmp_path / "corpus").mkdir()
    for lang in ("en", "de"):
        (tmp_path / "corpus" / f"{lang}.txt").write_text("".join(f"{lang} {i}\n" for i in range(10)))
    reproduce.split_corpus(str(tmp_path / "corpus"), str(tmp_path / "split"))
    (tmp_path / "corpus" / "de.txt").unlink()
    train, _ = reproduce.split_corpus(str(tmp_path / "corpus"), str(tmp_path / "split"))
    assert list(data.corpus_files(train)) == ["en"]


def test_the_report_replaces_its_files_whole(tmp_path, monkeypatch):
    """results/'s report made again from its results.json; a stop while a figure is written (Ctrl-C) leaves the one
    before whole (savefig wrote straight onto it: 124 bytes were left of curves.png)."""
    import matplotlib.figure
    stored = json.loads((REPO / "results" / "results.json").read_text())
    p = SimpleNamespace(**{**reproduce.PRESETS["cpu"], "seeds": 2})
    report = reproduce.summarize(stored["results"], stored["baselines"], p, tmp_path, "cpu", chance=100 / 595)
    assert report == (REPO / "results" / "results.md").read_text().removesuffix("\n")
    before = (tmp_path / "curves.png").read_bytes()

    def stopped(self, file, **kwargs):
        (file if hasattr(file, "write") else open(file, "wb")).write(b"\x89PNG half")
        raise Stopped
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", stopped)
    with pytest.raises(Stopped):
        reproduce.summarize(stored["results"], stored["baselines"], p, tmp_path, "cpu", chance=100 / 595)
    assert (tmp_path / "curves.png").read_bytes() == before and not list(tmp_path.glob("*.tmp"))
    monkeypatch.undo()
    run = {"panx": {"en": 50.0, "zero_shot": 40.0}}
    for seeds in (1, 2):  # the quick preset's note says one seed gives no spread where the runs stored have one seed
        p = SimpleNamespace(**reproduce.PRESETS["quick"])
        results = {reproduce.RANDOM: {str(seed): run for seed in range(seeds)}}
        report = reproduce.summarize(results, stored["baselines"], p, tmp_path, "quick", chance=1.0)
        assert report.startswith("Preset quick") and ("one seed a model gives no spread" in report) == (seeds == 1)


def test_missing_data_and_bad_flags_are_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "other").mkdir()  # results of another preset
    (tmp_path / "other" / "results.json").write_text(json.dumps({"setup": {"preset": {}}, "results": {}}))
    panx, xquad = tmp_path / "panx", tmp_path / "xquad"  # the files' names: checked at the start
    for folder, names in ((panx, ["train-en.tsv", *(f"dev-{lang}.tsv" for lang in reproduce.PANX_LANGS)]),
                          (xquad, ["xquad.en.json", "xquad.de.json"])):
        folder.mkdir()
        for name in names:
            (folder / name).write_text("")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "en.txt").write_text("A sentence.\nAnother one.\n")
    for flags, message in ((["--seeds", "-1"], "--seeds"),
                           (["--models", "E_out 99"], "--models must be models of the quick preset ("),
                           (["--out-dir", str(tmp_path / "other")], "results.json holds results of another preset"),
                           (["--data", str(tmp_path / "none")], "has no such directory; docs/data.md says where"),
                           (["--data", str(corpus / "en.txt")], "en.txt is a file; it takes a directory"),
                           (["--panx", str(tmp_path)], "--panx " + str(tmp_path) + " has no train-en.tsv"),
                           (["--out-dir", str(corpus / "out")], "--out-dir is inside --data"),
                           (["--out-dir", str(tmp_path)], "--data is inside --out-dir's corpus/ or panx/"),
                           (["--out-dir", str(tmp_path), "--data", str(tmp_path / "xquad")],
                            "--panx is inside --out-dir's corpus/ or panx/"),
                           (["--out-dir", ""], "--out-dir must be given")):
        given = dict(zip(flags[::2], flags[1::2]))
        defaults = {"--out-dir": str(tmp_path / "new"), "--data": str(corpus), "--panx": str(panx),
                    "--xquad": str(xquad)}
        argv = [a for k, v in {**defaults, **given}.items() for a in (k, v)]
        with pytest.raises(SystemExit) as exit:  # as `python reproduce.py --quick ...` ends, in this process
            run_script(lambda: reproduce.main(["--quick", *argv]))
        err = capsys.readouterr().err
        assert exit.value.code == 2 and err.count("\n") == 1 and message in err, err
    with pytest.raises(SystemExit) as exit:  # (both jobs of one model started at once: 'in use by another run')
        run_script(lambda: reproduce.main(["--quick", "--out-dir", str(tmp_path / "new"), "--data", str(corpus),
                                           "--panx", str(panx), "--xquad", str(xquad),
                                           "--models", "random init", "random init"]))
    assert exit.value.code == 2 and "--models repeats a value (random init random init)" in capsys.readouterr().err
