"""Tests for finetune.py: Hugging Face RemBERT directories load into every task type and export back
to transformers with the same outputs; tiny zero-shot runs on the shared data produce the
per-language table and results.json (one row per language, also from XNLI 1.0's own files);
--keep-layers; --train-fraction holds out what it trains on; files without labels and damaged saves
are refused by name; the saved model predicts with `finetune.py predict`, and `evaluate.py score`
reproduces the table."""

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoints
import data
import evaluate
import finetune
from configs import parse_command_line, run_script
from evaluate import CLASSIFICATION_LABELS, MLQA_LANGUAGES, TAGGING_LABELS
from checkpoints import DataError
from model import Encoder

REPO = Path(__file__).parent
SHARED = REPO.parent / "shared" / "data"
VOCAB = 600  # SentencePiece pieces, and the HF model's vocab_size
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is absent")

# A few lines in each task's format, for the tests that must not depend on ../shared/data.
PAIRS = ["The cat sat on the mat.\tA cat is sitting.\tentailment",
         "The dog barked loudly.\tThe dog was silent.\tcontradiction",
         "She went to the market.\tShe bought apples.\tneutral",
         "It rained all day.\tThe ground was wet.\tentailment"] * 2
TAGGED = "Angela\tB-PER\nMerkel\tI-PER\nvisited\tO\nParis\tB-LOC\n\nThe\tO\nUnited\tB-ORG\nNations\tI-ORG\nmet\tO\n"
SQUAD = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{
    "context": "The Eiffel Tower is in Paris. It was built in 1889 by Gustave Eiffel.",
    "qas": [{"id": f"q{i}", "question": q, "answers": [{"answer_start": start, "text": text}]}
            for i, (q, start, text) in enumerate([("Where is the Eiffel Tower?", 23, "Paris"),
                                                   ("When was it built?", 46, "1889"),
                                                   ("Who built it?", 54, "Gustave Eiffel"),
                                                   ("What is in Paris?", 0, "The Eiffel Tower")])]}]}]}
SMALL_ARGS = ["--epochs", "1", "--batch-size", "2", "--eval-batch-size", "3", "--seq-len", "48",
              "--doc-stride", "16", "--max-query-length", "16", "--lr", "1e-3", "--device", "cpu", "--log-every", "1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    (root / "pairs-en.tsv").write_text("\n".join(PAIRS) + "\n")
    (root / "tags-en.tsv").write_text(TAGGED)
    (root / "squad-en.json").write_text(json.dumps(SQUAD))
    # To evaluate on: the same examples in another order (an --eval file with --train's bytes is refused).
    (root / "dev-pairs-en.tsv").write_text("\n".join(reversed(PAIRS)) + "\n")
    (root / "dev-tags-en.tsv").write_text("\n\n".join(reversed(TAGGED.strip("\n").split("\n\n"))) + "\n")
    (root / "dev-squad-en.json").write_text(json.dumps(SQUAD, indent=1))
    text = [line.replace("\t", " ") for line in PAIRS] + [SQUAD["data"][0]["paragraphs"][0]["context"]]
    text += [qa["question"] for qa in SQUAD["data"][0]["paragraphs"][0]["qas"]]
    text += [" ".join(line.split("\t")[0] for line in TAGGED.split("\n") if line)]
    if SHARED.is_dir():  # the shared data's scripts, so that the end-to-end runs see few unknown pieces
        for path in ["xnli/dev-en.tsv", "xnli/dev-de.tsv", "pawsx/dev-en.tsv", "ner/panx/train-en.tsv",
                     "ner/panx/dev-de.tsv"]:
            text += (SHARED / path).read_text().split("\n")[:300]
        for lang in ("en", "de"):
            squad = json.loads((SHARED / "xquad" / f"xquad.{lang}.json").read_text())
            text += [p["context"] for a in squad["data"][:3] for p in a["paragraphs"]]
    (root / "corpus.txt").write_text("\n".join(text) + "\n")
    spm = data.train_tokenizer([str(root / "corpus.txt")], VOCAB, str(root / "spm"))
    return root, spm


@pytest.fixture(scope="module")
def hf_dir(files, tmp_path_factory):
    """transformers' RemBertModel with random weights and a small config, as save_pretrained writes it,
    with the test's SentencePiece model beside it (as google/rembert ships one)."""
    transformers = pytest.importorskip("transformers")
    _, spm = files
    config = transformers.RemBertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, input_embedding_size=16, output_embedding_size=48,
                                        max_position_embeddings=128, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf")
    transformers.RemBertModel(config).save_pretrained(path)
    (path / "sentencepiece.model").write_bytes(Path(spm).read_bytes())
    return path


def parse(*args):
    """finetune.py's command line; a flag given again replaces the earlier one (the script refuses that)."""
    args = [str(a) for a in args]
    starts = [i for i, a in enumerate(args) if a.startswith("--")] + [len(args)]
    flags = {args[i]: args[i:j] for i, j in zip(starts, starts[1:])}  # the last of each flag, in first order
    return parse_command_line(finetune.__doc__, finetune.FinetuneConfig, [a for f in flags.values() for a in f])[1]


def run(*args):
    return finetune.run(parse(*args))


@pytest.mark.parametrize("task,train_file,head", [
    ("xnli", "pairs-en.tsv", "RemBertForSequenceClassification"),
    ("panx", "tags-en.tsv", "RemBertForTokenClassification"),
    ("xquad", "squad-en.json", "RemBertForQuestionAnswering"),
])
def test_hf_directory_finetunes_and_exports_to_transformers(task, train_file, head, files, hf_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    root, _ = files
    table = run("--task", task, "--init", hf_dir, "--train", root / train_file, "--eval", root / f"dev-{train_file}",
                "--out-dir", tmp_path, *SMALL_ARGS)
    assert list(table) == ["en", "average"]
    ids = torch.randint(5, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    # The encoder fine-tuning starts from is the HF model...
    encoder = finetune.build_encoder(parse("--task", task, "--init", hf_dir, "--train", "x", "--eval", "y"), print).eval()
    reference = transformers.RemBertModel.from_pretrained(hf_dir).eval()
    torch.testing.assert_close(encoder(ids, attention_mask=mask), reference(ids, attention_mask=mask).last_hidden_state,
                               atol=1e-5, rtol=1e-5)
    # ...and the saved fine-tuned model is transformers' task model, with the same outputs.
    model, tokenizer, info = finetune.load_finetuned(tmp_path / "lr-0.001" / "seed-0")
    assert info["task"] == task and tokenizer.vocab_size <= VOCAB
    hf_model = getattr(transformers, head).from_pretrained(tmp_path / "lr-0.001" / "seed-0").eval()
    ours = model.eval()(ids, torch.zeros_like(ids), mask)
    theirs = hf_model(input_ids=ids, attention_mask=mask)
    expected = (theirs.logits,) if task != "xquad" else (theirs.start_logits, theirs.end_logits)
    for a, b in zip(ours[:-1], expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_keep_layers_drops_the_last_layers(files, hf_dir, tmp_path):
    root, _ = files
    run("--task", "xnli", "--init", hf_dir, "--train", root / "pairs-en.tsv", "--eval", root / "dev-pairs-en.tsv",
        "--keep-layers", "1", "--out-dir", tmp_path, *SMALL_ARGS)
    model, _, _ = finetune.load_finetuned(tmp_path / "lr-0.001" / "seed-0")
    assert len(model.encoder.layers) == 1
    assert json.loads((tmp_path / "lr-0.001" / "seed-0" / "config.json").read_text())["num_hidden_layers"] == 1
    with pytest.raises(DataError, match="--keep-layers 3: the encoder has 2 layers"):
        run("--task", "xnli", "--init", hf_dir, "--train", root / "pairs-en.tsv", "--eval", root / "dev-pairs-en.tsv",
            "--keep-layers", "3", "--out-dir", tmp_path / "three", *SMALL_ARGS)


def test_command_line_errors_are_clear(files, capsys):
    root, spm = files
    with pytest.raises(SystemExit):
        parse("--task", "xnli", "--train", "x.tsv", "--eval", "y.tsv")  # neither --init nor --config
    assert "pass exactly one of --init" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--task", "xnli", "--config", "tiny", "--train", "x.tsv", "--eval", "y.tsv")  # no tokenizer to read with
    assert "--config (random weights) needs --tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--task", "xnli", "--config", "tiny", "--train", "x", "--eval", "y", "--keep-layer", "1")
    assert "unrecognized arguments: --keep-layer 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse would keep the last: de.tsv would not be evaluated
        parse_command_line(finetune.__doc__, finetune.FinetuneConfig, ["--eval", "de.tsv", "--eval=es.tsv"])
    assert "--eval is given twice; give each flag once" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_command_line(finetune.__doc__, finetune.FinetuneConfig, ["--resume", "--no-resume"])
    assert "--resume is given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--task", "xnli", "--config", "tiny", "--train", "x", "--eval", "y", "--out-dir", "")
    assert "--out-dir must be given" in capsys.readouterr().err
    unnamed = root / "pairs.tsv"
    unnamed.write_text((root / "dev-pairs-en.tsv").read_text())
    with pytest.raises(DataError, match="--eval .*pairs.tsv: cannot tell the language"):
        run("--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv",
            "--eval", unnamed, *SMALL_ARGS)


def test_settings_the_optimiser_would_take_silently_are_refused(capsys, tmp_path):
    for flags, message in ((["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
                           (["--warmup-fraction", "nan"], "--warmup-fraction must be in [0, 1), got nan"),
                           (["--max-grad-norm", "-1"], "--max-grad-norm must be a positive number, got -1.0"),
                           (["--weight-decay", "-3"], "--weight-decay must be a number >= 0, got -3.0"),
                           (["--lr", "0"], "--lr must be a positive number, got [0.0]"),
                           (["--lr", "-0.001"], "--lr must be a positive number, got [-0.001]"),
                           (["--lr", "-1e-3"], "argument --lr: expected at least one argument")):
        with pytest.raises(SystemExit):
            parse("--task", "panx", "--config", "tiny", "--train", "x", "--eval", "y", *flags)
        assert message in capsys.readouterr().err
    # Built in Python: a list field's values are checked one by one, whatever the sequence.
    settings = dict(task="xnli", config="tiny", tokenizer="t.model", train="x", eval=["y"])
    assert finetune.FinetuneConfig(**settings, seeds=(0, 1), lr=(1e-5,)).seeds == (0, 1)
    with pytest.raises(ValueError, match=r"--seeds must be an integer in \[0, 2\^32\), got \(0, -1\)"):
        finetune.FinetuneConfig(**settings, seeds=(0, -1))
    # Two runs of one directory (lr-0.001/seed-0): the second would reuse the first's scores.
    with pytest.raises(ValueError, match=r"--lr repeats a value \(0.001 0.001\)"):
        finetune.FinetuneConfig(**settings, lr=[0.001, 0.001])
    with pytest.raises(ValueError, match=r"--seeds repeats a value \(0 0\)"):
        finetune.FinetuneConfig(**settings, seeds=[0, 0])
    # AdamW's decay multiplies the weights by 1 - lr x weight_decay: at 1 or more, they vanish or flip sign.
    with pytest.raises(ValueError, match=r"--weight-decay 1e\+300 x the learning rate 3e-05 must be below 1"):
        finetune.FinetuneConfig(**settings, weight_decay=1e300)  # (xnli's default rates, Table 10's: 3e-5 at most)
    with pytest.raises(ValueError, match=r"--weight-decay 2 x the learning rate 0.5 must be below 1"):
        finetune.FinetuneConfig(**settings, lr=[1e-5, 0.5], weight_decay=2)
    # run_squad.py's check, at the start rather than when the first long question is met after training.
    with pytest.raises(ValueError, match="--seq-len 67 leaves no room for the context after --max-query-length 64"):
        finetune.FinetuneConfig(**{**settings, "task": "xquad"}, seq_len=67)
    assert finetune.FinetuneConfig(**{**settings, "task": "xquad"}, seq_len=68).seq_len == 68
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")  # a link is the user's too, even to nothing
    with pytest.raises(ValueError, match="--output .*dangling exists: predictions replace no file"):
        finetune.PredictConfig(model=str(tmp_path / "m"), task="panx", input="x.tsv", output=str(tmp_path / "dangling"))
    with pytest.raises(ValueError, match="--output is in --model's directory"):
        finetune.PredictConfig(model=str(tmp_path), task="panx", input="x.tsv", output=str(tmp_path / "pred.tsv"))


def test_a_run_that_never_started_training_does_not_claim_its_out_dir(files, tmp_path):
    root, spm = files
    args = ["--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv",
            "--eval", f"en={root / 'dev-pairs-en.tsv'}", "--out-dir", tmp_path, *SMALL_ARGS]
    with pytest.raises(DataError, match="fewer than one batch"):
        run(*args, "--batch-size", "64")
    run(*args)  # the same --out-dir, other settings, no --resume: nothing was trained there
    with pytest.raises(DataError, match="already holds fine-tuning runs; pass --resume"):
        run(*args, "--batch-size", "3")
    with pytest.raises(DataError, match="holds fine-tuning runs of xnli, not panx; choose another --out-dir$"):
        run("--task", "panx", *args[2:-len(SMALL_ARGS) - 6], "--train", root / "tags-en.tsv", "--eval",
            f"en={root / 'dev-tags-en.tsv'}", "--out-dir", tmp_path, *SMALL_ARGS)  # (--resume would not do)
    with pytest.raises(DataError, match="--out-dir .*finetune-config.json is a file, not a folder; choose another"):
        run(*args[:-len(SMALL_ARGS) - 2], "--out-dir", tmp_path / "finetune-config.json", *SMALL_ARGS)
    (tmp_path / "finetune-config.json").unlink()
    with pytest.raises(DataError, match="holds runs but no finetune-config.json"):
        run(*args, "--resume")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "results.json").write_text("{}")  # not finetune.py's: never overwritten
    with pytest.raises(DataError, match="already holds fine-tuning runs; pass --resume"):
        run(*args[:-len(SMALL_ARGS) - 2], "--out-dir", tmp_path / "results", *SMALL_ARGS)
    named = tmp_path / "runs[1]"  # "[1]" is part of a name, not a pattern: the run finished there is found
    run(*args[:-len(SMALL_ARGS) - 2], "--out-dir", named, *SMALL_ARGS)
    with pytest.raises(DataError, match="already holds fine-tuning runs; pass --resume"):
        run(*args[:-len(SMALL_ARGS) - 2], "--out-dir", named, *SMALL_ARGS, "--batch-size", "3")


def test_an_out_dir_in_use_by_another_run_is_refused(files, tmp_path):
    from test_pretrain import hold_out_dir
    root, spm = files
    holder = hold_out_dir(tmp_path)
    args = ["--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv",
            "--eval", root / "dev-pairs-en.tsv", "--out-dir", tmp_path, *SMALL_ARGS]
    with pytest.raises(DataError, match="is in use by another run"):
        finetune.main([str(a) for a in args])
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # nothing of a run
    holder.kill()
    holder.wait()
    finetune.main([str(a) for a in args])  # free again, and freed when the run ends
    finetune.main([str(a) for a in args] + ["--resume"])


def test_a_tokenizer_other_than_the_encoders_is_refused(files, hf_dir, tmp_path):
    root, _ = files
    other = data.train_tokenizer([str(root / "corpus.txt")], VOCAB - 100, str(tmp_path / "other"))
    with pytest.raises(DataError, match=r"other.model is not the tokenizer .* was trained with"):
        run("--task", "xnli", "--init", hf_dir, "--tokenizer", other, "--train", root / "pairs-en.tsv",
            "--eval", root / "dev-pairs-en.tsv", "--out-dir", tmp_path / "run", *SMALL_ARGS)


def test_a_tokenizer_replaced_while_the_run_trained_is_not_saved_with_the_model(files, tmp_path, monkeypatch):
    """The tokenizer is copied beside the model as the run ends: a file replaced meanwhile was saved with the model
    under its own digest, and predict read the model with it."""
    root, spm = files
    mine, other = tmp_path / "spm.model", data.train_tokenizer([str(root / "corpus.txt")], VOCAB - 100,
                                                                 str(tmp_path / "other"))
    shutil.copy(spm, mine)
    trained = finetune.train

    def train_then_replace(*args, **kwargs):
        trained(*args, **kwargs)
        shutil.copy(other, mine)
    monkeypatch.setattr(finetune, "train", train_then_replace)
    with pytest.raises(DataError, match="spm.model is not the tokenizer this run read at its start: not saved"):
        run("--task", "xnli", "--config", "tiny", "--tokenizer", mine, "--train", root / "pairs-en.tsv", "--eval",
            root / "dev-pairs-en.tsv", "--out-dir", tmp_path / "run", *SMALL_ARGS)
    assert not list((tmp_path / "run").glob("lr-*/seed-*/*.*"))  # no model, and no tokenizer a model could be read with


def test_an_encoder_of_one_segment_type_is_refused_for_a_task_of_pairs(files, hf_dir, tmp_path):
    """A premise and its hypothesis, or a question and its context, are segments 0 and 1: an encoder of
    type_vocab_size 1 stopped in torch.embedding with IndexError's traceback."""
    root, _ = files
    one = shutil.copytree(hf_dir, tmp_path / "one")
    weights = load_file(one / "model.safetensors")
    weights["embeddings.token_type_embeddings.weight"] = weights["embeddings.token_type_embeddings.weight"][:1]
    save_file(weights, one / "model.safetensors")
    config = json.loads((one / "config.json").read_text())
    (one / "config.json").write_text(json.dumps({**config, "type_vocab_size": 1}))
    for task, train in (("xnli", "pairs-en.tsv"), ("xquad", "squad-en.json")):
        with pytest.raises(DataError, match=f"one: type_vocab_size 1, but {task}'s pairs take 2 segment types"):
            run("--task", task, "--init", one, "--train", root / train, "--eval", root / f"dev-{train}",
                "--out-dir", tmp_path / task, *SMALL_ARGS)


def test_files_without_labels_are_refused_by_file_and_line(files, tmp_path):
    root, spm = files
    (tmp_path / "pairs-de.tsv").write_text("Die Katze sitzt.\tEine Katze.\n")  # a prediction input, no labels
    (tmp_path / "tags-de.tsv").write_text("Berlin\nist\n")
    for task, train, evaluation, message in (
            ("xnli", root / "pairs-en.tsv", tmp_path / "pairs-de.tsv", r"pairs-de.tsv:1: 2 tab-separated fields"),
            ("xnli", tmp_path / "pairs-de.tsv", root / "pairs-en.tsv", r"pairs-de.tsv:1: 2 tab-separated fields"),
            ("panx", root / "tags-en.tsv", tmp_path / "tags-de.tsv", r"tags-de.tsv:1: 1 tab-separated fields")):
        with pytest.raises(DataError, match=message):
            run("--task", task, "--config", "tiny", "--tokenizer", spm, "--train", train, "--eval", evaluation,
                "--out-dir", tmp_path / task, *SMALL_ARGS)


def test_a_bad_label_in_an_evaluation_file_fails_before_training(files, tmp_path):
    root, spm = files
    bad = tmp_path / "tags-de.tsv"
    bad.write_text("Berlin\tB-LOC\nist\tO\n\nParis\tB-CITY\n")
    with pytest.raises(data.DataError, match=r"tags-de.tsv:4: unknown label 'B-CITY'"):
        run("--task", "panx", "--config", "tiny", "--tokenizer", spm, "--train", root / "tags-en.tsv",
            "--eval", bad, "--out-dir", tmp_path, *SMALL_ARGS)
    assert not (tmp_path / "lr-0.001").exists()


def test_a_crashed_run_resumes_to_the_same_weights(files, tmp_path, monkeypatch, capsys):
    root, spm = files
    args = ["--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv",
            "--eval", f"en={root / 'dev-pairs-en.tsv'}", *SMALL_ARGS, "--epochs", "2", "--checkpoint-every", "2"]
    run(*args, "--out-dir", tmp_path / "whole")

    def crash_at_step_3(step, *rest):  # after the state of step 2 was saved
        if step == 3:
            raise KeyboardInterrupt
        return lr_at(step, *rest)
    lr_at = finetune.lr_at
    monkeypatch.setattr(finetune, "lr_at", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run(*args, "--out-dir", tmp_path / "crashed")
    monkeypatch.setattr(finetune, "lr_at", lr_at)
    state = tmp_path / "crashed" / "lr-0.001" / "seed-0" / "ckpt-00000002"
    assert (state / "checkpoint.json").exists()
    refused_states(args, tmp_path)
    with pytest.raises(DataError, match="pass --resume"):
        run(*args, "--out-dir", tmp_path / "crashed")
    with pytest.raises(DataError, match="--epochs 2 then, 3 now"):
        run(*args, "--out-dir", tmp_path / "crashed", "--resume", "--epochs", "3")
    capsys.readouterr()
    monkeypatch.chdir(root)  # the same files, spelled as relative paths: the same settings
    relative = [a if a != root / "pairs-en.tsv" else "pairs-en.tsv" for a in args]
    run(*relative, "--out-dir", tmp_path / "crashed", "--resume")
    assert "at step 2" in capsys.readouterr().out
    whole, resumed = (load_file(tmp_path / d / "lr-0.001" / "seed-0" / "model.safetensors") for d in ("whole", "crashed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert not state.exists()
    # A finished run is not trained again: its scores are reused.
    run(*args, "--out-dir", tmp_path / "crashed", "--resume")
    assert "finished before" in capsys.readouterr().out
    results = [json.loads((tmp_path / d / "results.json").read_text())["results"] for d in ("whole", "crashed")]
    assert results[0] == results[1]
    scores = tmp_path / "crashed" / "lr-0.001" / "seed-0" / "scores.json"
    saved = json.loads(scores.read_text())  # its figures edited: not reused, nor averaged into a table
    for edit in ({"en": {"accuracy": "abc"}}, {"en": {"accuracy": float("nan")}}, {"average": {"accuracy": 99.5}}):
        scores.write_text(json.dumps({**saved, **edit}))
        with pytest.raises(DataError, match=r"seed-0/scores.json: not the scores of these languages and metrics"):
            run(*args, "--out-dir", tmp_path / "crashed", "--resume")


def test_a_full_disk_stops_fine_tuning_with_one_line_and_the_state_before_resumes(files, tmp_path, monkeypatch, capsys):
    from test_pretrain import full_disk
    root, spm = files
    args = ["--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv",
            "--eval", f"en={root / 'dev-pairs-en.tsv'}", "--out-dir", tmp_path, *SMALL_ARGS, "--checkpoint-every", "2"]

    def disk_full_at_step_3(step, *rest):  # after the state of step 2 was saved
        if step == 2:
            full_disk(monkeypatch, room=5000)
        return lr_at(step, *rest)
    lr_at = finetune.lr_at
    monkeypatch.setattr(finetune, "lr_at", disk_full_at_step_3)
    with pytest.raises(OSError) as failed:
        run(*args)
    assert "seed-0/ckpt-00000004: saving failed (no space left on device" in str(failed.value)
    assert "\n" not in str(failed.value)
    monkeypatch.undo()
    capsys.readouterr()
    run(*args, "--resume")
    out = capsys.readouterr().out
    assert "ckpt-00000004, left by an interrupted save" in out and "at step 2" in out


def refused_states(args, tmp_path):
    """The state of the crashed run in tmp_path/crashed (step 2 of 8), copied, edited or damaged: each refused with
    one line, or passed over and set aside."""
    from test_pretrain import rewrite_info
    def copy(name):
        shutil.copytree(tmp_path / "crashed", tmp_path / name)
        return tmp_path / name, tmp_path / name / "lr-0.001" / "seed-0"
    out, part = copy("other-rate")  # lr 0.001's state in lr 0.002's folder: not that run's
    (out / "lr-0.002").mkdir()
    part.rename(out / "lr-0.002" / "seed-0")
    with pytest.raises(DataError, match=r"ckpt-00000002 was written for another model or training \(lr \[0.001\] "
                                        r"then, \[0.002\] now\)"):
        run(*[a if a != "1e-3" else "2e-3" for a in args], "--out-dir", out, "--resume")
    out, part = copy("past-the-run")  # a step the run never reaches (its folder and digests to match)
    (part / "ckpt-00000002").rename(part / "ckpt-00001000")
    rewrite_info(part / "ckpt-00001000", step=1000)
    with pytest.raises(DataError, match=r"ckpt-00001000 is at step 1000, past its 8 steps"):
        run(*args, "--out-dir", out, "--resume")
    out, part = copy("rolled-back")  # the state of step 2 as step 1's (its folder and digests to match)
    (part / "ckpt-00000002").rename(part / "ckpt-00000001")
    rewrite_info(part / "ckpt-00000001", step=1)
    with pytest.raises(DataError, match=r"ckpt-00000001: damaged: AdamW's state has taken 2 steps, its "
                                        r"checkpoint.json says 1$"):
        run(*args, "--out-dir", out, "--resume")
    out, part = copy("no-random-state")  # the random states of no process (its digests to match)
    state = checkpoints.read_train_state(part / "ckpt-00000002" / checkpoints.TRAIN_STATE)
    checkpoints.write_train_state({**state, "rng": []}, part / "ckpt-00000002" / checkpoints.TRAIN_STATE)
    rewrite_info(part / "ckpt-00000002")
    with pytest.raises(DataError, match=r"ckpt-00000002: damaged: it holds the random states of 0 processes, its "
                                        r"checkpoint.json says 1$"):
        run(*args, "--out-dir", out, "--resume")
    out, part = copy("old-format")
    (part / "train-state.pt").write_bytes(b"PK\x03\x04 torch.save's")
    with pytest.raises(DataError, match=r"seed-0/train-state.pt: a training state of an older finetune.py"):
        run(*args, "--out-dir", out, "--resume")
    out, part = copy("damaged")
    (part / "ckpt-00000002" / "__0_0.distcp").write_bytes(b"half")
    with pytest.raises(DataError, match=r"seed-0: no intact checkpoint to resume from \(damaged: ckpt-00000002\)"):
        run(*args, "--out-dir", out, "--resume")


def test_resume_refuses_files_changed_at_the_same_path(files, hf_dir, tmp_path):
    root, _ = files
    train, evaluation = tmp_path / "train-en.tsv", tmp_path / "dev-de.tsv"
    train.write_text("\n".join(PAIRS) + "\n")
    evaluation.write_text("\n".join(reversed(PAIRS)) + "\n")
    init = tmp_path / "init"
    init.mkdir()
    for name in ("config.json", "model.safetensors", "sentencepiece.model"):
        (init / name).write_bytes((hf_dir / name).read_bytes())
    args = ["--task", "xnli", "--init", init, "--train", train, "--eval", evaluation, "--out-dir", tmp_path / "run",
            *SMALL_ARGS]
    run(*args)
    run(*args, "--resume")  # nothing changed: the finished run's scores are reused
    for changed in (evaluation, train, init / "model.safetensors"):
        original = changed.read_bytes()
        changed.write_bytes(original.replace(b"cat", b"cow") if changed.suffix == ".tsv" else original[:-1] + b"!")
        with pytest.raises(DataError, match=f"{re.escape(str(changed))}: changed since then"):
            run(*args, "--resume")
        changed.write_bytes(original)


def test_rates_that_print_alike_are_runs_of_their_own(files, tmp_path, capsys):
    root, spm = files
    args = ["--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv",
            "--eval", f"en={root / 'dev-pairs-en.tsv'}", "--out-dir", tmp_path, *SMALL_ARGS]
    run(*args)
    run(*[a if a != "1e-3" else "0.0010000001" for a in args], "--resume")  # not 1e-3's scores, reused
    assert "finished before" not in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.glob("lr-*")) == ["lr-0.001", "lr-0.0010000001"]


def test_defaults_are_table_10_and_table_15_for_rembert():
    lines = []

    def defaults(*args, encoder="tiny"):
        return finetune.with_defaults(parse("--config", "tiny", "--tokenizer", "t.model", "--train", "x", "--eval", "y", *args),
                                      finetune.CONFIGS[encoder], lines.append)

    args = defaults("--task", "xnli")
    assert (args.lr, args.batch_size, args.epochs) == ([1e-5, 2e-5, 3e-5], 32, 3) and "Table 10's" in lines[-1]
    assert defaults("--task", "panx").lr == [1e-5, 2e-5, 3e-5, 4e-5, 5e-5]
    for task, lr, batch in (("pawsx", 8e-6, 128), ("xquad", 9e-6, 128), ("panx", 8e-6, 64)):
        args = defaults("--task", task, encoder="rembert")  # an encoder of RemBERT's shape: Table 15, said so
        assert (args.lr, args.batch_size) == ([lr], batch) and "Table 15's, for an encoder of RemBERT's shape" in lines[-1]
    args = defaults("--task", "panx", "--lr", "1e-5", "2e-5", "--batch-size", "8", encoder="rembert")
    assert (args.lr, args.batch_size) == ([1e-5, 2e-5], 8) and "overridden" in lines[-1]
    args = defaults("--task", "panx", "--lr", "3e-3")  # the batch used is the default's, and the log says so
    assert lines[-1].endswith("; overridden by --lr: learning rates 0.003, batch 32") and args.batch_size == 32


def test_learning_rate_sweep_reports_the_best_rate(files, tmp_path):
    root, spm = files
    run("--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv",
        "--eval", f"en={root / 'dev-pairs-en.tsv'}", "--out-dir", tmp_path, *SMALL_ARGS, "--lr", "1e-6", "3e-3")
    results = json.loads((tmp_path / "results.json").read_text())
    per_lr = {float(lr): table["average"]["accuracy"] for lr, table in results["per_lr"].items()}
    assert set(per_lr) == {1e-6, 3e-3} and results["lr"] == max(per_lr, key=per_lr.get)
    assert results["results"] == results["per_lr"][repr(results["lr"])]
    assert (tmp_path / "lr-1e-06" / "seed-0").is_dir() and (tmp_path / "lr-0.003" / "seed-0").is_dir()


# ----------------------------------------------------------------------------------------------
# Tiny zero-shot runs on the shared data: English training data, every other language evaluated

@needs_shared
def test_xnli_zero_shot_holds_out_the_training_lines(files, tmp_path):
    _, spm = files
    xnli = SHARED / "xnli"
    run("--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", xnli / "dev-en.tsv",
        "--train-fraction", "0.99", "--max-train", "8", "--eval", *(xnli / f"dev-{lang}.tsv" for lang in ("en", "de", "zh")),
        "--out-dir", tmp_path, "--seeds", "1", "2", *SMALL_ARGS)
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["results"]) == ["en", "de", "zh", "average"]
    assert set(results["per_seed"]) == {"1", "2"}
    # The held-out tail: of 1002 lines, ceil(0.99 * 1002) = 992 trained on and one more, the last of the premise
    # on lines 990-992 (0-based: a premise has three lines); 9 evaluated.
    for lang in ("en", "de", "zh"):
        per_seed = [results["per_seed"][s][lang]["accuracy"] for s in ("1", "2")]
        assert results["results"][lang]["accuracy"] == pytest.approx(sum(per_seed) / 2)
        assert all(a * 9 / 100 == pytest.approx(round(a * 9 / 100)) for a in per_seed)  # k of 9 correct
    assert results["results"]["average"]["accuracy"] == pytest.approx(
        sum(results["results"][lang]["accuracy"] for lang in ("en", "de", "zh")) / 3)


@needs_shared
def test_panx_zero_shot_predict_score_round_trip(files, tmp_path, capsys):
    _, spm = files
    panx = SHARED / "ner" / "panx"
    gold = tmp_path / "gold-de.tsv"  # the first 20 German sentences, to score the prediction file against
    gold.write_text("\n\n".join((panx / "dev-de.tsv").read_text().split("\n\n")[:20]) + "\n")
    table = run("--task", "panx", "--config", "tiny", "--tokenizer", spm, "--train", panx / "train-en.tsv",
                "--max-train", "16", "--eval", panx / "dev-en.tsv", f"de={gold}", "--max-eval", "20",
                "--out-dir", tmp_path / "run", *SMALL_ARGS)
    assert list(table) == ["en", "de", "average"] and set(table["de"]) == {"f1", "precision", "recall"}
    out = capsys.readouterr().out
    assert "average" in out and "precision" in out
    prediction = tmp_path / "pred-de.tsv"
    finetune.main(["predict", "--model", str(tmp_path / "run" / "lr-0.001" / "seed-0"), "--task", "panx",
                   "--input", str(gold), "--output", str(prediction)])
    assert capsys.readouterr().out == f"wrote {prediction}: panx predictions for the 20 examples of {gold}\n"
    evaluate.main(["score", "--task", "panx", "--gold", str(gold), "--predictions", str(prediction)])
    scored = json.loads(capsys.readouterr().out)
    assert scored["f1"] == pytest.approx(table["de"]["f1"])


@needs_shared
def test_xquad_zero_shot_on_held_out_articles_and_round_trip(files, tmp_path, capsys):
    _, spm = files
    xquad = SHARED / "xquad"
    langs = ("en", "de", "zh")
    table = run("--task", "xquad", "--config", "tiny", "--tokenizer", spm, "--train", xquad / "xquad.en.json",
                "--train-fraction", "0.5", "--max-train", "4", "--max-eval", "6",
                "--eval", *(xquad / f"xquad.{lang}.json" for lang in langs), "--out-dir", tmp_path / "run",
                *SMALL_ARGS)
    assert list(table) == [*langs, "average"] and set(table["de"]) == {"f1", "exact_match"}
    # predict -> score on the German file, restricted to the held-out questions that the table scored
    squad = json.loads((xquad / "xquad.de.json").read_text())
    held_out = {"version": "1.1", "data": squad["data"][24:]}
    paragraphs = [p for a in held_out["data"] for p in a["paragraphs"]]
    kept, n = [], 0
    for p in paragraphs:
        qas = p["qas"][:max(0, 6 - n)]
        n += len(qas)
        if qas:
            kept.append({**p, "qas": qas})
    gold = tmp_path / "gold-de.json"
    gold.write_text(json.dumps({"version": "1.1", "data": [{"title": "held out", "paragraphs": kept}]}))
    prediction = tmp_path / "pred-de.json"
    finetune.main(["predict", "--model", str(tmp_path / "run" / "lr-0.001" / "seed-0"), "--task", "xquad",
                   "--input", str(gold), "--output", str(prediction)])
    assert set(json.loads(prediction.read_text())) == {qa["id"] for p in kept for qa in p["qas"]}
    capsys.readouterr()
    evaluate.main(["score", "--task", "xquad", "--gold", str(gold), "--predictions", str(prediction)])
    scored = json.loads(capsys.readouterr().out)
    assert scored["f1"] == pytest.approx(table["de"]["f1"]) and scored["exact_match"] == pytest.approx(table["de"]["exact_match"])


@needs_shared
def test_original_release_files_give_one_row_per_language(files, tmp_path):
    """XNLI 1.0's own dev file holds 15 languages in a column; PAWS-X's x-final/{lang}/ names the language
    by its folder."""
    _, spm = files
    xnli = SHARED / "xnli" / "original_format_samples" / "XNLI-1.0" / "xnli.dev.tsv"
    table = run("--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", SHARED / "xnli" / "dev-en.tsv",
                "--max-train", "8", "--eval", xnli, "--out-dir", tmp_path / "xnli", *SMALL_ARGS)
    assert len(table) == 16 and {"ar", "de", "zh", "average"} <= set(table)
    pawsx = SHARED / "pawsx" / "original_format_samples" / "x-final"
    table = run("--task", "pawsx", "--config", "tiny", "--tokenizer", spm, "--train", pawsx / "en" / "train.tsv",
                "--eval", pawsx / "de" / "dev_2k.tsv", pawsx / "fr" / "dev_2k.tsv", "--out-dir", tmp_path / "pawsx",
                *SMALL_ARGS)
    assert list(table) == ["de", "fr", "average"]


def test_damaged_saves_are_refused_by_name(files, tmp_path, monkeypatch):
    root, spm = files
    args = ["--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv",
            "--eval", f"en={root / 'dev-pairs-en.tsv'}", "--out-dir", tmp_path, *SMALL_ARGS, "--checkpoint-every", "2"]
    run(*args)
    saved = tmp_path / "lr-0.001" / "seed-0"
    raw = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(raw[:-8] + bytes(8))  # the last weights: still a readable file
    with pytest.raises(DataError, match=r"seed-0/model.safetensors: damaged"):
        finetune.load_finetuned(saved)
    with pytest.raises(DataError, match=r"seed-0/model.safetensors: damaged"):  # as --init, translation-probe read it
        checkpoints.from_hf(saved, Encoder)
    info = json.loads((saved / "finetune.json").read_text())
    (saved / "finetune.json").write_text(json.dumps({**info, "sha256": {}}))  # (no digest, then none checked)
    with pytest.raises(DataError, match=r"seed-0/finetune.json: damaged \(not the digests of config.json, model"):
        checkpoints.from_hf(saved, Encoder)
    (saved / "finetune.json").write_text(json.dumps(info))
    (saved / "model.safetensors").write_bytes(raw)
    config = (saved / "config.json").read_text()  # another head count: the same shapes, other outputs
    (saved / "config.json").write_text(config.replace('"num_attention_heads": 2', '"num_attention_heads": 4'))
    with pytest.raises(DataError, match=r"seed-0/config.json: damaged"):
        finetune.load_finetuned(saved)
    (saved / "config.json").write_text(config)
    tokenizer, elsewhere = saved / "sentencepiece.model", tmp_path / "elsewhere.model"  # a link: never opened
    shutil.move(tokenizer, elsewhere)
    tokenizer.symlink_to(elsewhere)
    with pytest.raises(DataError, match=r"seed-0/sentencepiece.model: damaged \(not a regular file\)"):
        finetune.load_finetuned(saved)
    tokenizer.unlink()
    shutil.move(elsewhere, tokenizer)
    # An edited finetune.json: its settings have a digest of their own (seq_len 64 -> 8 was predicted with).
    info = json.loads((saved / "finetune.json").read_text())
    edited = "seed-0/finetune.json: damaged or edited"
    for edit, message in (({"seq_len": None}, "must be positive integers"), ({"seq_len": 8}, edited),
                          ({"task": "panx"}, edited), ({"n_best": 0}, "positive integers")):
        (saved / "finetune.json").write_text(json.dumps({**info, **edit}))
        with pytest.raises(DataError, match=message):
            finetune.load_finetuned(saved)
    for names in (["finetune.json", "config.json", "sentencepiece.model"], [*info["sha256"], "../elsewhere"]):
        # A file left out of the digest list would go unchecked; a name outside the folder is never opened.
        digests = {name: info["sha256"].get(name, "0" * 64) for name in names}
        (saved / "finetune.json").write_text(json.dumps({**info, "sha256": digests}))
        with pytest.raises(DataError, match=r"finetune.json: .*not the digests of model.safetensors, "):
            finetune.load_finetuned(saved)
    raw = {n: (saved / n).read_bytes() for n in ("config.json", "model.safetensors")}
    model_config, weights = json.loads(raw["config.json"]), load_file(saved / "model.safetensors")
    for seq_len, vocab_size in ((1000, None), (2, None), (64, 100)):  # settings or a tokenizer that do not fit
        if vocab_size:  # (the weights cut to match)
            embedding = "rembert.embeddings.word_embeddings.weight"
            save_file({**weights, embedding: weights[embedding][:vocab_size]}, saved / "model.safetensors")
            (saved / "config.json").write_text(json.dumps({**model_config, "vocab_size": vocab_size}))
        crafted = {**info, "seq_len": seq_len}
        digests = {n: hashlib.sha256((saved / n).read_bytes()).hexdigest() for n in finetune.SAVED[:-1]}
        (saved / "finetune.json").write_text(json.dumps(
            {**crafted, "sha256": {**digests, "finetune.json": finetune.settings_digest(crafted)}}))
        with pytest.raises(DataError, match=fr"seed-0: its seq_len {seq_len} \(finetune.json\) or \d+ pieces .* not fit"):
            finetune.load_finetuned(saved)
    (saved / "config.json").write_bytes(raw["config.json"])
    head = {**weights, "classifier.weight": torch.full_like(weights["classifier.weight"], float("nan"))}
    save_file(head, saved / "model.safetensors")  # NaN in the head alone (from_hf checks the encoder)
    digests = {n: hashlib.sha256((saved / n).read_bytes()).hexdigest() for n in finetune.SAVED[:-1]}
    (saved / "finetune.json").write_text(json.dumps({**info, "sha256": {**digests, "finetune.json": info["sha256"][
        "finetune.json"]}}))
    with pytest.raises(DataError, match=r"seed-0/model.safetensors: classifier.weight holds NaN or infinite values"):
        finetune.load_finetuned(saved)  # (it predicted one label for every example)
    for name, content in raw.items():
        (saved / name).write_bytes(content)
    (saved / "finetune.json").write_text(json.dumps(info))
    for task in ("panx", "xquad"):  # a crafted finetune.json (its digest made anew): the weights hold no such head
        crafted = {**info, "task": task}
        (saved / "finetune.json").write_text(json.dumps(
            {**crafted, "sha256": {**info["sha256"], "finetune.json": finetune.settings_digest(crafted)}}))
        with pytest.raises(DataError, match=fr"seed-0: no {task} head in model.safetensors \([^\n]*\)$"):  # one line
            finetune.load_finetuned(saved)
    (saved / "scores.json").unlink()  # an interrupted run: --resume reads its settings
    settings = json.loads((tmp_path / "finetune-config.json").read_text())
    for damaged in ([1, 2], {**settings, "sha256": ["x"]}):
        (tmp_path / "finetune-config.json").write_text(json.dumps(damaged))
        with pytest.raises(DataError, match=r"finetune-config.json: damaged \(not a JSON object"):
            run(*args, "--resume")


def as_script(capsys, monkeypatch, argv):
    """`python finetune.py argv` as its `if __name__ == "__main__"` runs it (run_script around main), in this
    process: the exit code and what it wrote to stderr."""
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # (run_script sets it for the process)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        run_script(lambda: finetune.main(argv))
    return exit.value.code, capsys.readouterr().err


def test_predict_on_a_bad_input_is_one_line_and_exit_code_2(files, tmp_path, capsys, monkeypatch):
    root, spm = files
    run("--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv",
        "--eval", f"en={root / 'dev-pairs-en.tsv'}", "--out-dir", tmp_path / "run", *SMALL_ARGS)
    (tmp_path / "in.tsv").write_text("a\tb\tentailment\nc\n")
    code, err = as_script(capsys, monkeypatch, ["predict", "--model", str(tmp_path / "run" / "lr-0.001" / "seed-0"),
                                                "--task", "xnli", "--input", str(tmp_path / "in.tsv"), "--output",
                                                str(tmp_path / "out.txt")])
    assert code == 2 and err.count("\n") == 1 and "in.tsv:2: 1 tab-separated fields" in err
    with pytest.raises(DataError, match="fine-tuned for xnli; it cannot predict pawsx's labels"):
        finetune.main(["predict", "--model", str(tmp_path / "run" / "lr-0.001" / "seed-0"), "--task", "pawsx",
                       "--input", str(root / "pairs-en.tsv"), "--output", str(tmp_path / "out.txt")])
    (tmp_path / "ckpt").mkdir()  # a pre-training checkpoint's folder (its checkpoint.json) is not a fine-tuned model
    (tmp_path / "ckpt" / "checkpoint.json").write_text("{}")
    with pytest.raises(DataError, match="ckpt: a pre-training checkpoint, not a model finetune.py saved; fine-tune"):
        finetune.main(["predict", "--model", str(tmp_path / "ckpt"), "--task", "xnli", "--input",
                       str(root / "pairs-en.tsv"), "--output", str(tmp_path / "out.txt")])
    (tmp_path / "results.json").write_text("{}")  # predictions replace no file: not the input, not a results file
    os.link(tmp_path / "in.tsv", tmp_path / "linked.tsv")  # (the input by another name)
    for flags, message in ((["--output", str(tmp_path / "." / "in.tsv")], "in.tsv exists: predictions replace no file"),
                           (["--output", str(tmp_path / "linked.tsv")], "linked.tsv exists"),
                           (["--output", str(tmp_path / "results.json")], "results.json exists"),
                           (["--output", str(tmp_path / "none" / "out.txt")], "out.txt: no such directory"),
                           (["--output", str(tmp_path / "out.txt"), "--batch-size", "0"], "--batch-size must be")):
        code, err = as_script(capsys, monkeypatch, ["predict", "--model", str(tmp_path / "run" / "lr-0.001" / "seed-0"),
                                                    "--task", "xnli", "--input", str(tmp_path / "in.tsv"), *flags])
        assert code == 2 and err.count("\n") == 1 and message in err, err
    assert (tmp_path / "in.tsv").read_text() == "a\tb\tentailment\nc\n"  # the input is never overwritten
    assert (tmp_path / "results.json").read_text() == "{}"


def test_evaluation_sets_that_would_mislead_are_refused(files, tmp_path):
    root, spm = files
    args = ["--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv",
            "--out-dir", tmp_path, *SMALL_ARGS]
    with pytest.raises(DataError, match="is the --train file; hold part of it out with --train-fraction"):
        run(*args, "--eval", root / "." / "pairs-en.tsv")  # scores of what it trained on
    shutil.copyfile(root / "pairs-en.tsv", tmp_path / "copy-en.tsv")
    with pytest.raises(DataError, match="is the --train file"):  # the same examples under another name
        run(*args, "--eval", tmp_path / "copy-en.tsv")
    with pytest.raises(DataError, match="two sets for 'average'"):  # the name of the table's last row
        run(*args, "--eval", f"average={root / 'dev-pairs-en.tsv'}")
    mlqa = tmp_path / "dev-context-zh-question-en.json"  # MLQA scores in its contexts' language (zh), not en
    shutil.copyfile(root / "dev-squad-en.json", mlqa)
    with pytest.raises(DataError, match="the language of --eval en=.* is en, but .* holds MLQA's zh contexts"):
        run("--task", "mlqa", "--config", "tiny", "--tokenizer", spm, "--train", root / "squad-en.json",
            "--out-dir", tmp_path, *SMALL_ARGS, "--eval", f"en={mlqa}")
    tydi = tmp_path / "tydi-ids.json"  # question ids of TyDiQA's form ("english-..."): they name their language
    squad = json.loads((root / "dev-squad-en.json").read_text())
    for k, qa in enumerate(qa for article in squad["data"] for p in article["paragraphs"] for qa in p["qas"]):
        qa["id"] = f"english-{k}"
    tydi.write_text(json.dumps(squad))
    with pytest.raises(DataError, match=r"--eval de=.*tydi-ids.json: its language column or question ids give en, "
                                         r"which de= neither renames nor picks from; drop de=$"):
        run("--task", "mlqa", "--config", "tiny", "--tokenizer", spm, "--train", root / "squad-en.json",
            "--out-dir", tmp_path, *SMALL_ARGS, "--eval", f"de={tydi}")  # (scored as en, before, without a word)


def test_languages_of_an_evaluation_file():
    pair = data.PairExample("a", "b", "neutral", "x:1", "de")
    assert finetune.by_language([pair], "x.tsv") == {"de": [pair]}  # XNLI 1.0's language column
    questions = [data.SquadExample(f"{name}-{i}", "?", "c", [], 0, "x") for i, name in enumerate(("arabic", "thai"))]
    assert finetune.by_language(questions, "tydiqa-goldp-v1.1-dev.json") == {"ar": questions[:1], "th": questions[1:]}
    assert list(finetune.by_language([data.PairExample("a", "b", "0", "x")], "x-final/ko/dev_2k.tsv")) == ["ko"]
    mlqa = [data.SquadExample("5a1b", "?", "c", [], 0, "x")]
    assert list(finetune.by_language(mlqa, "mlqa/dev-context-de-question-en.json")) == ["de"]  # the contexts'
    assert finetune.eval_spec("de=dev.tsv") == ("de", "dev.tsv")


def test_an_eval_file_whose_path_holds_an_equals_sign_is_that_file(files, tmp_path, monkeypatch):
    root, spm = files
    monkeypatch.chdir(tmp_path)
    odd = Path("a=b")  # not the language "a" of a file "b/dev-es.tsv", which may exist too
    odd.mkdir()
    shutil.copyfile(root / "dev-pairs-en.tsv", odd / "dev-es.tsv")
    assert finetune.eval_spec("a=b/dev-es.tsv") == (None, "a=b/dev-es.tsv")
    args = ["--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv",
            "--out-dir", tmp_path / "run", *SMALL_ARGS]
    assert list(run(*args, "--eval", "a=b/dev-es.tsv")) == ["es", "average"]
    monkeypatch.chdir(odd)  # the same file by another relative path: the run it finished is reused
    run(*args, "--eval", "dev-es.tsv", "--resume")
    with pytest.raises(DataError, match="--eval de=missing.tsv: no such file"):
        run(*args, "--eval", "de=missing.tsv", "--resume")


def test_a_missing_or_irregular_input_is_named_by_its_flag(files, tmp_path):
    """--train, --eval and predict's --input: a missing file, or one that is no regular file (a FIFO would block the
    reader), is one line naming the flag and the file, as --eval always was, before the model trains."""
    root, spm = files
    fifo = tmp_path / "fifo.tsv"
    os.mkfifo(fifo)
    args = ["--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv", "--eval",
            root / "dev-pairs-en.tsv", "--out-dir", tmp_path / "run", *SMALL_ARGS]
    for flag, path, said in (("--train", tmp_path / "missing.tsv", "no such file"), ("--train", fifo, "not a regular"),
                             ("--eval", fifo, "not a regular file")):
        with pytest.raises(DataError, match=f"^{flag} {re.escape(str(path))}: {said}"):
            run(*args, flag, path)
    with pytest.raises(DataError, match=f"^--input {re.escape(str(fifo))}: not a regular file"):
        finetune.read_examples(finetune.TASKS["xnli"], str(fifo), labelled=False, named=f"--input {fifo}")


class FakeRuntime:
    """One process of `world_size` on CPU; gather_object returns every rank's object, the others'
    taken from `peers` (what those ranks produced), so a multi-process evaluation runs in one."""

    def __init__(self, rank, world_size, peers):
        self.rank, self.world_size, self.peers, self.device = rank, world_size, peers, torch.device("cpu")

    def loader(self, batches):
        return iter(batches)

    def autocast(self):
        return torch.autocast("cpu", enabled=False)

    def gather_object(self, obj):
        self.peers[self.rank] = obj
        return [self.peers.get(r, obj) for r in range(self.world_size)]  # a missing peer: a stand-in


def test_predict_pads_to_full_batches_and_reassembles_the_processes_rows_in_order():
    calls = []

    class Model(torch.nn.Module):  # output = first input id of each row; records the batch shapes
        def forward(self, input_ids, token_type_ids, attention_mask):
            calls.append(tuple(input_ids.shape))
            return input_ids[:, 0].float(), None

    n = 11
    tensors = {"input_ids": torch.arange(1, n + 1)[:, None].repeat(1, 4), "token_type_ids": torch.zeros(n, 4),
               "attention_mask": torch.ones(n, 4), "labels": torch.zeros(n)}
    single = finetune.predict(Model(), tensors, 3, FakeRuntime(0, 1, {}))[0]
    assert single.tolist() == list(range(1, n + 1)) and set(calls) == {(3, 4)}
    peers = {}
    rank1 = FakeRuntime(1, 2, peers)
    finetune.predict(Model(), tensors, 3, rank1)  # rank 1 first: its rows are what rank 0 gathers
    assert len(peers[1]) == 2  # 11 rows -> 2 steps of 2 processes x 3 rows (1 padding row)
    both = finetune.predict(Model(), tensors, 3, FakeRuntime(0, 2, peers))[0]
    assert both.tolist() == single.tolist()
    assert set(calls) == {(3, 4)}  # static shapes: every batch full


def test_train_fraction_holds_out_whole_articles_or_the_tail():
    task = finetune.TASKS["xquad"]

    class Q:
        def __init__(self, id, article):
            self.id, self.article = id, article

    examples = [Q(f"q{i}", i // 3) for i in range(12)]  # 4 articles of 3 questions
    train, held_out = finetune.split_train(task, examples, 0.5)
    assert [e.id for e in train] == [f"q{i}" for i in range(6)]
    assert [held_out(i, e) for i, e in enumerate(examples)] == [False] * 6 + [True] * 6
    pairs = [data.PairExample(f"p{i}", "h", "neutral", "") for i in range(10)]
    train, held_out = finetune.split_train(finetune.TASKS["pawsx"], pairs, 0.25)
    assert train == pairs[:3] and [held_out(i, e) for i, e in enumerate(pairs)] == [False] * 3 + [True] * 7
    # XNLI's premises come three times (a hypothesis each): never on both sides of the cut.
    premises = [data.PairExample(f"p{i // 3}", f"h{i}", "neutral", "") for i in range(12)]
    train, held_out = finetune.split_train(finetune.TASKS["xnli"], premises, 0.4)
    assert len(train) == 6 and [held_out(i, e) for i, e in enumerate(premises)] == [False] * 6 + [True] * 6


# ----------------------------------------------------------------------------------------------
# Features and their decoding

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A 1000-piece model of the bundled sample corpus (10 languages)."""
    return data.Tokenizer(data.train_tokenizer(str(REPO / "sample_data"), 1000, str(tmp_path_factory.mktemp("spm") / "s")))


def letters(i):
    """A number written with the letters a-j."""
    return "".join("abcdefghij"[int(d)] for d in f"{i:05d}")


def test_squad_features_refuse_a_seq_len_without_room_for_the_context(tokenizer):
    """finetune.json's settings are input too (predict reads them): a window with no room is one line, no traceback."""
    example = data.SquadExample("q", "what is this question about?", "a context", [], 0, "dev.json: 'q'")
    with pytest.raises(DataError, match="dev.json: 'q': seq_len 8 leaves no room for the context"):
        finetune.squad_features(tokenizer, [example], seq_len=8, doc_stride=128, max_query_length=64)


def test_pair_and_tagging_features(tokenizer, tmp_path):
    path = tmp_path / "dev-en.tsv"
    path.write_text('The harbour town wakes up.\t"The ""town"" sleeps."\tcontradiction\nA\tB\tneutral\n')
    examples = data.read_pairs(str(path), CLASSIFICATION_LABELS["xnli"])
    assert examples[0].sentence2 == 'The "town" sleeps.'
    t = finetune.pair_features(tokenizer, examples, CLASSIFICATION_LABELS["xnli"], seq_len=12)
    assert t["labels"].tolist() == [0, 2] and t["input_ids"].shape == (2, 12)
    first = t["input_ids"][0].tolist()
    assert first[0] == tokenizer.cls_id and first.count(tokenizer.sep_id) == 2 and first[-1] == tokenizer.sep_id
    assert t["token_type_ids"][0].tolist() == [0] * (first.index(tokenizer.sep_id) + 1) + [1] * (11 - first.index(tokenizer.sep_id))
    tags = tmp_path / "en-dev"
    tags.write_text("en:Marta\tB-PER\nen:visited\tO\nen:Köln\tB-LOC\nen:today\tO\n\nen:Die\tO\n")
    examples = data.read_tagging(str(tags), TAGGING_LABELS["panx"])
    assert examples[0].tokens == ["Marta", "visited", "Köln", "today"]
    t = finetune.tagging_features(tokenizer, examples, TAGGING_LABELS["panx"], seq_len=40)
    gold = t["labels"].clone()
    assert (gold[:, 0] == -100).all() and sorted(gold[0][gold[0] != -100].tolist()) == [0, 0, 1, 5]
    assert finetune.tagging_predictions(examples, t, gold.clamp(min=0), TAGGING_LABELS["panx"]) == [e.labels for e in examples]
    with pytest.warns(UserWarning, match=r"\d words did not fit in 12 pieces .*; they are tagged 'O'$"):
        finetune.tagging_features(tokenizer, examples[:1], TAGGING_LABELS["panx"], seq_len=12, training=False)
    with pytest.warns(UserWarning, match=r"\d words did not fit in 12 pieces .*; training learns nothing from them$"):
        t = finetune.tagging_features(tokenizer, examples[:1], TAGGING_LABELS["panx"], seq_len=12)
    predicted = finetune.tagging_predictions(examples[:1], t, t["labels"].clamp(min=0), TAGGING_LABELS["panx"])
    kept = int((t["labels"][0] != -100).sum())
    assert 0 < kept < 4 and predicted[0] == examples[0].labels[:kept] + ["O"] * (4 - kept)  # cut words: labels[0]


@needs_shared
def test_panx_word_labels_survive_features_and_predictions(tokenizer):
    examples = data.read_tagging(str(SHARED / "ner" / "panx" / "dev-ru.tsv"), TAGGING_LABELS["panx"])
    t = finetune.tagging_features(tokenizer, examples, TAGGING_LABELS["panx"], seq_len=256)
    assert finetune.tagging_predictions(examples, t, t["labels"].clamp(min=0), TAGGING_LABELS["panx"]) == [e.labels for e in examples]


def test_a_blank_gold_answer_is_refused_before_training(tmp_path):
    qa = {"id": "q", "question": "what?", "answers": [{"text": "  ", "answer_start": 8}]}  # found at its offset
    (tmp_path / "dev.json").write_text(json.dumps({"data": [{"paragraphs": [
        {"context": "Paris is  the capital.", "qas": [qa]}]}]}))
    with pytest.raises(DataError, match="question 'q': no answer to train or evaluate on, or a blank one"):
        finetune.read_examples(finetune.TASKS["xquad"], str(tmp_path / "dev.json"))


def test_a_training_answer_without_a_piece_is_refused(tokenizer):
    for text in (" ", "\u200b"):  # blanks alone: every window would teach [CLS] as the answer
        context = f"Paris is{text}the capital."
        example = data.SquadExample("q", "what?", context, [{"text": text, "answer_start": 8}], 0, "dev.json: 'q'")
        with pytest.raises(DataError, match=re.escape(f"dev.json: 'q': the answer {text!r} covers no piece")):
            finetune.squad_features(tokenizer, [example], seq_len=40, doc_stride=10, max_query_length=8, training=True)


def test_span_decoding_follows_max_context_n_best_and_max_answer_length(tokenizer):
    context = " ".join(f"w{letters(i)[-2:]}" for i in range(60))  # wda is word 30
    example = data.SquadExample("q", "which word?", context, [{"text": "wda", "answer_start": context.index("wda")}],
                                0, "test")
    t, meta = finetune.squad_features(tokenizer, [example], seq_len=40, doc_stride=10, max_query_length=8, training=True)
    assert len(meta) > 2 and t["input_ids"].shape[1] == 40
    answer_start = context.index("wda")
    windows = [m for m in meta if any(o and o[0] == answer_start for o in m["offsets"])]
    assert len(windows) >= 2  # the answer is in several windows; it counts in one only
    n = len(meta)

    def answer(cells, max_answer_length=30):
        start, end = torch.full((n, 40), -10.0), torch.full((n, 40), -10.0)
        for (f, s, e), value in cells:
            start[f, s], end[f, e] = value, value
        return finetune.decode_spans([example], meta, start, end, n_best=5, max_answer_length=max_answer_length)["q"]

    def last_piece(f, word):
        return next(k for k, o in enumerate(meta[f]["offsets"]) if o and o[1] == context.index(word) + len(word))

    # The gold positions decode to the gold text.
    gold = [f for f in range(n) if t["start_positions"][f] > 0]
    best = [f for f in gold if meta[f]["max_context"][t["start_positions"][f]]]
    assert len(best) == 1
    f = best[0]
    assert answer([((f, int(t["start_positions"][f]), int(t["end_positions"][f])), 5.0)]) == "wda"
    other = next(g for g in gold if g != f)
    # The same span where it has less context is passed over (for the best of the low-scored rest).
    assert answer([((other, int(t["start_positions"][other]), int(t["end_positions"][other])), 5.0)]) != "wda"
    # Longer than max_answer_length: not an answer.
    s, e = int(t["start_positions"][f]), last_piece(f, "wdc")
    assert answer([((f, s, e), 5.0)]) == "wda wdb wdc"
    assert answer([((f, s, e), 5.0)], max_answer_length=e - s) != "wda wdb wdc"
    # [CLS] and the question are never answers: the best context span wins.
    assert answer([((f, 0, 0), 9.0), ((f, 1, 2), 8.0), ((f, s, int(t["end_positions"][f])), 1.0)]) == "wda"


def test_no_span_starts_or_ends_with_a_blank(tokenizer):
    """Whatever the logits, an answer never begins or ends with what SentencePiece reads as blank: a lone "▁"
    piece, a zero-width space, a left-to-right mark, or the leading bytes of a character (their spans are empty)."""
    context = "Mark Ruffalo \u200b港口 \u200eplays 牛顿阐述"
    example = data.SquadExample("q", "who?", context, [{"text": "Mark", "answer_start": 0}], 0, "test")
    t, meta = finetune.squad_features(tokenizer, [example], seq_len=64, doc_stride=32, max_query_length=8)
    positions = [k for k, o in enumerate(meta[0]["offsets"]) if o is not None]
    answers = set()
    for s in positions:
        for e in positions[positions.index(s):]:
            start, end = torch.full((1, 64), -10.0), torch.full((1, 64), -10.0)
            start[0, s], end[0, e] = 10.0, 10.0
            answers.add(finetune.decode_spans([example], meta, start, end, n_best=1)["q"])
    answers.discard("")
    assert answers and all(not tokenizer.is_blank(a[0]) and not tokenizer.is_blank(a[-1]) for a in answers), answers
    assert "港口" in answers and "Ruffalo" in answers


@pytest.fixture(scope="session")
def tatoeba_tokenizer(tmp_path_factory):
    """8000 pieces trained by the project on 30,000 lines α-sampled from the shared Tatoeba corpus (113 languages):
    once a run, by the first of pytest-xdist's workers to ask while the others wait (their temporary folders share a
    parent)."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    with open(root / "tatoeba.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "tatoeba" / "spm.model").exists():
            data.train_tokenizer(str(SHARED / "corpus" / "tatoeba"), 8000, str(root / "tatoeba" / "spm"),
                                 max_sentences=30_000)
    return data.Tokenizer(str(root / "tatoeba" / "spm.model"))


def gold_round_trip(tokenizer, path, lang=None):
    """Features of every question with the logits peaked at the labelled answer positions, decoded and scored
    by the official scorer: (scores, {id: predicted answer})."""
    examples = data.read_squad(str(path))
    t, meta = finetune.squad_features(tokenizer, examples, 384, 128, 64, training=True)
    start, end = torch.full((len(meta), 384), -10.0), torch.full((len(meta), 384), -10.0)
    rows = torch.nonzero(t["start_positions"] > 0).flatten()
    start[rows, t["start_positions"][rows]] = 10.0
    end[rows, t["end_positions"][rows]] = 10.0
    predicted = finetune.decode_spans(examples, meta, start, end, n_best=20, max_answer_length=1000)
    return evaluate.task_scores("mlqa" if lang else "xquad", examples, predicted, lang), predicted


@needs_shared
@pytest.mark.parametrize("path", sorted(str(p.relative_to(SHARED)) for p in (SHARED / "mlqa").glob("*.json"))
                         + sorted(str(p.relative_to(SHARED)) for p in (SHARED / "tydiqa_goldp").glob("*.json")))
def test_gold_answers_survive_features_and_decoding(tatoeba_tokenizer, path):
    """MLQA (its scorer) and TyDiQA-GoldP (SQuAD's): at least 96.5 exact match in every language (answers
    that begin or end inside a word are out of reach of any subword model), Chinese 98; no answer begins or
    ends with a character SentencePiece reads as blank (MLQA es has a U+200B beside an answer)."""
    lang = re.search(r"question-(\w+)\.json", path)
    lang = lang.group(1) if lang else None
    assert lang is None or lang in MLQA_LANGUAGES
    scores, predicted = gold_round_trip(tatoeba_tokenizer, SHARED / path, lang)
    assert scores["exact_match"] >= (98.0 if lang == "zh" else 96.5), scores
    assert not [p for p in predicted.values() if p and (tatoeba_tokenizer.is_blank(p[0]) or tatoeba_tokenizer.is_blank(p[-1]))]


@needs_shared
@pytest.mark.parametrize("lang", ["en", "zh"])
def test_xquad_gold_answers_survive_features_and_decoding(tatoeba_tokenizer, lang):
    scores, _ = gold_round_trip(tatoeba_tokenizer, SHARED / "xquad" / f"xquad.{lang}.json")
    assert scores["exact_match"] >= 98.0, scores


@pytest.mark.subprocess
def test_tagging_with_two_processes_trains_as_one(files, tmp_path):
    """--batch-size is the global batch: with sentences of unequal length, two processes (gloo) must weigh
    every labelled token as one process does, not average the processes' means."""
    root, spm = files
    tags = tmp_path / "tags-en.tsv"
    tags.write_text("Paris\tB-LOC\n\n" + TAGGED + "\nBerlin\tB-LOC\nand\tO\nRome\tB-LOC\n")
    (tmp_path / "dev-en.tsv").write_text(TAGGED)
    args = ["--task", "panx", "--config", "tiny", "--tokenizer", spm, "--train", tags,
            "--eval", tmp_path / "dev-en.tsv", "--epochs", "2", "--batch-size", "4", "--seq-len", "32", "--lr", "1e-2", "--dropout", "0",
            "--device", "cpu"]
    finetune.main([*map(str, args), "--out-dir", str(tmp_path / "one")])  # one process (this one), as finetune.py's
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "finetune.py",
                    *map(str, args), "--out-dir", str(tmp_path / "two")], cwd=REPO, check=True, capture_output=True)
    weights = [load_file(tmp_path / out / "lr-0.01" / "seed-0" / "model.safetensors") for out in ("one", "two")]
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]) < 1e-5


KILLED_AT = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import finetune
lr_at = finetune.lr_at
def killed(step, *rest):  # SIGKILL mid-epoch, after the state of step 2 was saved
    if step == 3 and os.environ.get("KILL_AT_STEP_3"):
        os.kill(os.getpid(), signal.SIGKILL)
    return lr_at(step, *rest)
finetune.lr_at = killed
finetune.main(sys.argv[1:])
"""


@pytest.mark.subprocess
def test_fine_tuning_killed_on_two_processes_resumes_on_two_bitwise_and_on_one(files, tmp_path, capsys):
    root, spm = files
    driver = tmp_path / "driver.py"
    driver.write_text(KILLED_AT.format(repo=str(REPO)))
    args = ["--task", "xnli", "--config", "tiny", "--tokenizer", spm, "--train", root / "pairs-en.tsv", "--eval",
            f"en={root / 'dev-pairs-en.tsv'}", *SMALL_ARGS[2:], "--epochs", "2", "--checkpoint-every", "2",
            "--dropout", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def finetune_py(out, *extra, kill=False):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(driver),
                   *map(str, args), "--out-dir", str(out), *extra]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                              env={**env, **({"KILL_AT_STEP_3": "1"} if kill else {})})
        return done.stdout + done.stderr[-3000:]  # (gloo may abort at exit after finishing: judged by the files)
    straight = finetune_py(tmp_path / "straight")
    assert "2 process(es)" in straight, straight
    finetune_py(tmp_path / "killed", kill=True)
    part = Path("lr-0.001", "seed-0")
    assert (tmp_path / "killed" / part / "ckpt-00000002" / "checkpoint.json").exists()
    assert not (tmp_path / "killed" / part / "model.safetensors").exists()
    shutil.copytree(tmp_path / "killed", tmp_path / "on-one")
    again = finetune_py(tmp_path / "killed", "--resume")  # 2 -> 2: the uninterrupted run's weights, bit for bit
    assert "at step 2" in again
    whole, resumed = (load_file(tmp_path / d / part / "model.safetensors") for d in ("straight", "killed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    capsys.readouterr()
    run(*args, "--out-dir", tmp_path / "on-one", "--resume")  # 2 -> 1: from the saved step, to the end
    one = capsys.readouterr().out
    assert "1 process(es)" in one and "written by 2 process(es)" in one and "at step 2" in one
    losses = [[float(line.split("| loss ")[1].split()[0]) for line in log.splitlines() if line.startswith("step ")]
              for log in (straight, one)]
    assert len(losses[1]) == 6 and losses[1] == pytest.approx(losses[0][2:], abs=1e-4)
    on_one = load_file(tmp_path / "on-one" / part / "model.safetensors")
    assert all(torch.allclose(whole[k], on_one[k], atol=1e-4) for k in whole)
