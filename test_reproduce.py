"""Tests of reproduce.py: the whole pipeline on its quick preset, and a rerun that reuses what is done."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import reproduce

REPO = Path(__file__).parent
SHARED = REPO.parent / "shared" / "data"


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")
def test_quick_run_writes_the_table_and_both_figures(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "reproduce.py", "--quick", "--out-dir", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "[6/6]" in run.stdout and "left about" in run.stdout  # progress with an estimate of the time left
    results = json.loads((out / "results.json").read_text())["results"]
    assert len(results) == 6
    for name, seeds in results.items():
        measures = seeds["0"]
        assert {"parameters", "mlm_accuracy", "panx", "xnli", "figure2"} <= set(measures), name
        assert 0 <= measures["mlm_accuracy"] <= 100 and 0 <= measures["xnli"]["transfer"] <= 100
        assert len(measures["figure2"]) == 3  # the embeddings and 2 layers
    assert sorted(results["E_out 64"]["0"]["figure1"]) == ["1", "2"]  # layers kept: 1, and all 2
    table = (out / "results.md").read_text()
    assert all(f"| {name} |" in table for name in results) and "Table 4, E_out 3072" in table
    for figure in ("figure1.png", "figure2.png"):
        assert (out / figure).read_bytes()[:4] == b"\x89PNG"
    again = subprocess.run([sys.executable, "reproduce.py", "--quick", "--out-dir", str(out)], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "[1/6]" not in again.stdout  # every model was done: nothing runs again


def test_a_damaged_setup_and_a_bad_flag_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "setup.json").write_text("")
    (tmp_path / "other").mkdir()  # results of another preset, with no setup.json beside them
    (tmp_path / "other" / "results.json").write_text(json.dumps({"setup": {"preset": {}}, "results": {}}))
    tasks = tmp_path / "tasks"  # the task files' names: checked at the start, read after pre-training
    for name in ["ner/panx/train-en.tsv", "xquad/xquad.en.json", "xquad/xquad.de.json",
                 *(f"ner/panx/dev-{lang}.tsv" for lang in reproduce.PANX_LANGS),
                 *(f"xnli/dev-{lang}.tsv" for lang in reproduce.XNLI_LANGS)]:
        (tasks / name).parent.mkdir(parents=True, exist_ok=True)
        (tasks / name).write_text("")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "en.txt").write_text("A sentence.\nAnother one.\n")
    for flags, message in ((["--out-dir", str(tmp_path)], "setup.json: empty file"), (["--seeds", "-1"], "--seeds"),
                           (["--out-dir", str(tmp_path / "other")], "results.json holds results of another preset"),
                           (["--out-dir", str(tmp_path / "new"), "--data", str(tmp_path / "none")], "no *.txt files"),
                           (["--out-dir", str(tmp_path / "new"), "--tasks", str(tmp_path / "other")],
                            "has no ner/panx/train-en.tsv"),
                           (["--out-dir", str(corpus / "out"), "--data", str(corpus)], "--out-dir is inside --data"),
                           (["--out-dir", ""], "--out-dir must be given")):
        extra = [] if "--tasks" in flags else ["--tasks", str(tasks)]
        out = subprocess.run([sys.executable, "reproduce.py", "--quick", *flags, *extra], cwd=REPO,
                             capture_output=True, text=True)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert not (tmp_path / "new" / "setup.json").exists()  # the wrong --data did not claim the directory
