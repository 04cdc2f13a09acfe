"""Tests for pretrain.py: the schedule, the optimizer groups, the command line, what the loader feeds the
model, the NaN guards, crash-safe and verified checkpoints, exact resume after SIGKILL, DDP on 2 CPU
processes and the XLA path."""

import fcntl
import importlib
import json
import os
import pickle
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import checkpoints
import pretrain
import runtime as runtimes
from configs import CONFIGS
from data import MLMLoader, Tokenizer, train_tokenizer
from checkpoints import DataError, read_metadata, sha256
from model import MaskedLM, ModelConfig

REPO = Path(__file__).parent
XLA_VENV = Path(os.environ.get("REMBERT_XLA_VENV", Path.home() / ".cache" / "rembert-xla-venv"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("tokenizer") / "spm"
    return train_tokenizer(str(REPO / "sample_data"), 500, str(prefix))


def tiny_args(tokenizer, out_dir, *extra):
    """The tiny config with a small vocabulary and short sequences: a step takes milliseconds. A flag in
    `extra` replaces the default's (the scripts refuse a flag given twice)."""
    defaults = ["--data", str(REPO / "sample_data"), "--tokenizer", tokenizer, "--out-dir", str(out_dir),
                "--vocab-size", str(Tokenizer(tokenizer).vocab_size), "--seq-len", "32", "--max-predictions", "5",
                "--batch-size", "4", "--warmup", "1", "--log-every", "1", "--device", "cpu"]
    return [a for i in range(0, len(defaults), 2) if defaults[i] not in extra for a in defaults[i:i + 2]] + [*extra]


def run(tokenizer, out_dir, *extra):
    return pretrain.train(*pretrain.parse_args(tiny_args(tokenizer, out_dir, *extra)))


def run_script(tokenizer, out_dir, *extra, python=sys.executable, env=None):
    return subprocess.run([python, "pretrain.py", *tiny_args(tokenizer, out_dir, *extra)], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True).stdout


def final_state(out_dir):
    """The newest checkpoint whole: checkpoint.json, and what its shards hold as torch's own dcp_to_torch_save reads
    them (the weights, AdamW's state by parameter name), with every process's loader and random states."""
    path = checkpoints.checkpoint_paths(out_dir)[-1]
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "whole.pt"))
        state = torch.load(os.path.join(tmp, "whole.pt"), weights_only=False)
    extra = checkpoints.read_train_state(os.path.join(path, checkpoints.TRAIN_STATE))
    return {**json.loads(Path(path, "checkpoint.json").read_text()), **state, **extra}


# ----------------------------------------------------------------------------------------------

def test_lr_schedule_warms_up_then_decays_linearly():
    lrs = [pretrain.lr_at(step, warmup=4, total=12, peak=1.0) for step in range(12)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4:] == pytest.approx([(12 - s) / 8 for s in range(4, 12)])
    assert min(lrs) > 0  # no update of the run is wasted at lr 0
    assert pretrain.lr_at(0, warmup=0, total=10, peak=2.0) == 2.0
    # transformers' linear schedule (XTREME's fine-tuning scripts), the lr of each update: ours one update ahead in
    # the warm-up (its first update has lr 0), the same after it.
    from transformers import get_linear_schedule_with_warmup
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule, theirs = get_linear_schedule_with_warmup(optimizer, 4, 12), []
    for _ in range(13):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[:4] == pytest.approx(theirs[1:5]) and lrs[4:] == pytest.approx(theirs[4:12])


def test_weight_decay_on_matrices_only_and_frozen_pooler_left_out():
    model = MaskedLM(CONFIGS["tiny"])
    model.encoder.pooler.requires_grad_(False)
    optimizer = pretrain.build_optimizer(model, lr=1e-3, weight_decay=0.01)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    not_decayed = {names[id(p)] for p in no_decay["params"]}
    assert "encoder.layers.0.attention.query.weight" in decayed
    assert "head.decoder.weight" in decayed and "encoder.embeddings.word_embeddings.weight" in decayed
    assert "encoder.layers.0.attention_norm.weight" in not_decayed and "head.decoder.bias" in not_decayed
    assert all(n.endswith("bias") or "norm" in n for n in not_decayed)
    assert not any(n.startswith("encoder.pooler") for n in decayed | not_decayed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(decay["params"]) + len(no_decay["params"]) == len(trainable)
    assert optimizer.defaults["betas"] == (0.9, 0.999) and optimizer.defaults["eps"] == 1e-6


def test_tied_embedding_is_optimised_once():
    with torch.device("meta"):
        model = MaskedLM(CONFIGS["coupled-e128"])
    params = [p for g in pretrain.build_optimizer(model, 1e-3, 0.01).param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))


def test_overrides_are_typed_and_checked(capsys):
    model_config, train_config = pretrain.parse_args(
        ["--config", "small", "--dropout", "0", "--no-tie-embeddings", "--num-layers", "3", "--lr", "2e-4",
         "--resume"])
    assert train_config.config == "small" and model_config.num_layers == 3 and model_config.hidden_size == 256
    assert model_config.dropout == 0.0 and model_config.tie_embeddings is False
    assert train_config.lr == 2e-4 and train_config.resume is True
    for argv, message in [
        (["--hiden-size", "64"], "unrecognized arguments: --hiden-size 64"),
        (["--hidden-size", "big"], "argument --hidden-size: invalid int value: 'big'"),
        (["--config", "huge"], "--config must be one of"),
        (["--hidden-size", "100", "--num-heads", "3"], "hidden_size 100 is not divisible by num_heads 3"),
        (["--steps", "10", "--warmup", "10"], "--warmup (10) must be below --steps (10)"),
        (["--seq-len", "1024"], "--seq-len 1024 exceeds max_position_embeddings 512"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda or xla"),
        # Values the optimiser would take without a word: a negative clip norm is gradient ascent.
        (["--max-grad-norm", "-1"], "--max-grad-norm must be a positive number, got -1.0"),
        (["--max-grad-norm", "0"], "--max-grad-norm must be a positive number, got 0.0"),
        (["--lr", "nan"], "--lr must be a positive number, got nan"),
        (["--lr", "-1"], "--lr must be a positive number, got -1.0"),
        (["--weight-decay", "-1"], "--weight-decay must be a number >= 0, got -1.0"),
        (["--weight-decay", "inf"], "--weight-decay must be a number >= 0, got inf"),
        # AdamW's decay multiplies the weights by 1 - lr x weight_decay: at 1 or more, they vanish or flip sign.
        (["--weight-decay", "1e300"], "--weight-decay 1e+300 x --lr 0.001 must be below 1"),
        (["--weight-decay", "0.5", "--lr", "2"], "--weight-decay 0.5 x --lr 2.0 must be below 1"),
        (["--seed", "-1"], "--seed must be an integer in [0, 2^32), got -1"),
        (["--seed", str(2 ** 64)], "--seed must be an integer in [0, 2^32), got 18446744073709551616"),
        (["--seq-len", "2"], "--seq-len must be a number >= 3, got 2"),
        (["--seq-len", "6"], "--max-predictions must be at most --seq-len - 2 (4)"),  # 5 predictions: one is padding
        # Training writes PATH.model: out/spm would overwrite an existing out/spm.model.
        (["--tokenizer", "out/spm"], "--tokenizer must be a file name ending in .model, got 'out/spm'"),  # [CLS] and [SEP] leave no piece
        (["--layer-norm-eps", "-1"], "ModelConfig.layer_norm_eps must be a positive number, got -1.0"),
        (["--layer-norm-eps", "nan"], "ModelConfig.layer_norm_eps must be a positive number, got nan"),
        (["--out-dir", ""], "--out-dir must be given"),
        (["--data", ""], "--data must be given"),
    ]:
        with pytest.raises(SystemExit):
            pretrain.parse_args(argv)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["pretrain", "finetune", "finetune predict", "evaluate score",
                                     "evaluate mlm-accuracy", "evaluate translation-probe", "benchmark model",
                                     "benchmark loader", "reproduce", "configs"])
def test_every_command_prints_its_help(command, capsys):
    script, *words = command.split()
    with pytest.raises(SystemExit) as exit:
        importlib.import_module(script).main([*words, "--help"])
    out = capsys.readouterr()
    assert exit.value.code == 0 and out.out.startswith("usage:") and not out.err


@pytest.mark.subprocess
def test_ctrl_c_is_one_line():
    code = "from configs import run_script\ndef main():\n    raise KeyboardInterrupt\nrun_script(main)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 130 and out.stderr == "-c: interrupted\n", out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_a_device_that_is_not_there_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """Each refused as `python script.py ...` refuses it (run_script around main), in this process."""
    from configs import run_script as as_script
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # (run_script sets it for the process)
    xla = "--device xla needs torch-xla (auto is xla where PJRT_DEVICE is set): pip install torch==2.9.0"
    for script, device, env, message in (("pretrain.py", "cuda", {}, "--device cuda, but torch sees no CUDA GPU"),
                                         ("pretrain.py", "xla", {}, xla), ("finetune.py", "xla", {}, xla),
                                         # auto on a machine set up for TPUs (PJRT_DEVICE) without torch-xla
                                         ("pretrain.py", "auto", {"PJRT_DEVICE": "TPU"}, xla),
                                         ("finetune.py", "auto", {"PJRT_DEVICE": "TPU"}, xla)):
        flags = ["--task", "xnli", "--config", "tiny", "--tokenizer", "t.model", "--train", "x", "--eval", "y"]
        argv = ["--device", device, "--out-dir", str(tmp_path / "out"), *flags * (script == "finetune.py")]
        with monkeypatch.context() as environ, pytest.raises(SystemExit) as exit:
            for name, value in env.items():
                environ.setenv(name, value)
            as_script(lambda: importlib.import_module(script.removesuffix(".py")).main(argv))
        err = capsys.readouterr().err
        assert exit.value.code == 2 and message in err and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists()  # refused before the run claimed its --out-dir


@pytest.mark.subprocess
def test_a_model_too_large_for_memory_is_one_line_and_exit_2(tokenizer, tmp_path):
    # 10^12 x 64 float32 input embeddings: 256 TB, more than any address space holds, so every allocator refuses
    args = tiny_args(tokenizer, tmp_path, "--vocab-size", str(10 ** 12))
    out = subprocess.run([sys.executable, "pretrain.py", *args], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "out of memory" in out.stderr, out.stderr
    # A batch of 10^12 streams: refused at once, by the allocator, for what it asks (not after filling the memory,
    # when the kernel would end the run without a word: the 8 GB limit is this test's guard against that).
    args = tiny_args(tokenizer, tmp_path / "batch", "--batch-size", str(10 ** 12))
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
    out = subprocess.run([sys.executable, "pretrain.py", *args], cwd=REPO, capture_output=True, text=True,
                         preexec_fn=limit)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "out of memory (Unable to allocate 7.28 TiB" in out.stderr, out.stderr


def test_sizes_past_what_numpy_and_torch_count_are_one_line_and_exit_2(tokenizer, tmp_path, capsys, monkeypatch):
    """--batch-size 2^62: numpy's "array is too big" (a ValueError) and torch's "size calculation overflowed" (a
    RuntimeError, as finetune.py's predict met it) are out of memory, in one line, not a traceback."""
    from configs import run_script as as_script
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # (run_script sets it for the process)
    for main in (lambda: pretrain.main(tiny_args(tokenizer, tmp_path, "--batch-size", str(2 ** 62))),
                 lambda: torch.zeros(2 ** 62, 128)):
        with pytest.raises(SystemExit) as exit:
            as_script(main)
        err = capsys.readouterr().err
        assert exit.value.code == 2 and err.count("\n") == 1 and "out of memory (" in err, err


def test_pretraining_batches_hold_no_padding_rows(tokenizer, tmp_path, monkeypatch):
    """Every row pretrain.py trains on is a full sequence with its share of masked positions."""
    seen = []
    step = pretrain.train_step

    def recording(model, optimizer, runtime, micro_batches, *rest):
        seen.extend(micro_batches)
        return step(model, optimizer, runtime, micro_batches, *rest)

    monkeypatch.setattr(pretrain, "train_step", recording)
    run(tokenizer, tmp_path, "--steps", "30", "--grad-accum", "2")
    assert len(seen) == 60
    for batch in seen:
        assert batch["attention_mask"].all() and (batch["input_ids"] != 0).all()  # 0: [PAD]
        assert (batch["masked_weights"].sum(1) == round(32 * 0.15)).all()


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tokenizer, tmp_path, monkeypatch):
    step, calls = pretrain.train_step, []

    def poisoned(model, optimizer, runtime, micro_batches, max_grad_norm, stats):  # step 3's loss is NaN
        step(model, optimizer, runtime, micro_batches, max_grad_norm, stats)
        calls.append(1)
        if len(calls) == 3:
            stats[0] = float("nan")

    monkeypatch.setattr(pretrain, "train_step", poisoned)
    with pytest.raises(FloatingPointError, match=r"loss became nan between steps 3 and 4; "
                                                 r"last good checkpoint: .*ckpt-00000002 \(try"):
        run(tokenizer, tmp_path, "--steps", "6", "--log-every", "2", "--checkpoint-every", "2")
    assert [Path(p).name for p in checkpoints.checkpoint_paths(tmp_path)] == ["ckpt-00000002"]


@pytest.mark.parametrize("breakage", ["inf", "huge"])
def test_an_update_that_breaks_the_weights_is_never_saved(tokenizer, tmp_path, monkeypatch, breakage):
    """The loss logged at a step was computed before that step's update: the weights themselves are
    checked before a save. Broken here right after the update of step 4: an inf, or finite weights so
    large that the loss overflows."""
    step = runtimes.Runtime.optimizer_step
    calls = []

    def exploding(self, optimizer, max_grad_norm=None):
        step(self, optimizer, max_grad_norm)
        calls.append(1)
        if len(calls) == 4:
            weight = optimizer.param_groups[0]["params"][-1]  # the output embedding
            with torch.no_grad():
                weight.fill_(float("inf")) if breakage == "inf" else weight.mul_(1e37)

    monkeypatch.setattr(runtimes.Runtime, "optimizer_step", exploding)
    with pytest.raises(FloatingPointError, match=r"the update of step 4 broke the weights .* "
                                                 r"last good checkpoint: .*ckpt-00000002 \(try"):
        run(tokenizer, tmp_path, "--steps", "6", "--checkpoint-every", "2")
    assert [Path(p).name for p in checkpoints.checkpoint_paths(tmp_path)] == ["ckpt-00000002"]


def test_a_failed_save_names_its_directory_and_the_next_run_removes_it(tokenizer, tmp_path, monkeypatch, capsys):
    run(tokenizer, tmp_path, "--steps", "4", "--checkpoint-every", "2")
    newest = checkpoints.checkpoint_paths(tmp_path)[-1]

    def disk_full(state, checkpoint_id, **kwargs):  # half the shards written, then the disk is full
        os.makedirs(checkpoint_id)
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.distributed.checkpoint, "save", disk_full)
    with pytest.raises(OSError, match=r"ckpt-00000006: saving failed .*No space left on device"):
        run(tokenizer, tmp_path, "--steps", "8", "--checkpoint-every", "2", "--resume")
    assert checkpoints.checkpoint_paths(tmp_path)[-1] == newest  # no checkpoint.json: never read
    monkeypatch.undo()
    capsys.readouterr()
    run(tokenizer, tmp_path, "--steps", "8", "--checkpoint-every", "2", "--resume")
    out = capsys.readouterr().out
    assert "ckpt-00000006, left by an interrupted save" in out and f"resumed from {newest} at step 4" in out
    assert "--steps 8: the learning rate decays to 0 at step 8 now, no longer at step 4" in out  # said, not silent
    assert final_state(tmp_path)["step"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "ckpt-00000004", "ckpt-00000006", "ckpt-00000008"]


def test_ctrl_c_while_the_shards_are_written_is_an_interruption_not_a_failed_save(tokenizer, tmp_path, monkeypatch):
    """The checkpoint library wraps whatever stops a write, Ctrl-C too, as a failure: still a Ctrl-C (run_script: the
    line "interrupted" and exit code 130, not "saving failed (KeyboardInterrupt: )" and 2)."""
    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.distributed.checkpoint.FileSystemWriter, "write_data", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run(tokenizer, tmp_path, "--steps", "2", "--checkpoint-every", "2")
    assert checkpoints.checkpoint_paths(tmp_path) == []  # (what it left has no checkpoint.json: never read)


@pytest.mark.parametrize("damage", ["overwritten tensor bytes", "truncated", "a shard missing"])
def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_is_used(tokenizer, tmp_path, capsys, damage):
    run(tokenizer, tmp_path / "straight", "--steps", "6", "--checkpoint-every", "2")
    run(tokenizer, tmp_path / "run", "--steps", "4", "--checkpoint-every", "2")
    newest = Path(checkpoints.checkpoint_paths(tmp_path / "run")[-1])
    shard = newest / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    if damage == "truncated":
        shard.write_bytes(raw[:len(raw) // 2])
    elif damage == "a shard missing":
        shard.unlink()
    else:  # 16 bytes in the middle: torch.distributed.checkpoint alone reads it, with wrong weights
        raw[len(raw) // 2:len(raw) // 2 + 16] = bytes(16)
        shard.write_bytes(raw)
        final_state(tmp_path / "run")
    message = "missing or unreadable" if damage == "a shard missing" else "damaged"
    with pytest.raises(DataError, match=f"ckpt-00000004/__0_0.distcp: {message}"):
        checkpoints.from_checkpoint(str(newest))
    run(tokenizer, tmp_path / "run", "--steps", "6", "--checkpoint-every", "2", "--resume")
    out = capsys.readouterr().out
    assert f"warning: {shard}: {message}" in out and "at step 2" in out
    straight, resumed = final_state(tmp_path / "straight"), final_state(tmp_path / "run")
    assert all(torch.equal(straight["model"][k], resumed["model"][k]) for k in straight["model"])
    for path in checkpoints.checkpoint_paths(tmp_path / "run"):
        Path(path, "checkpoint.json").write_text("not a checkpoint")
    with pytest.raises(DataError, match="no intact checkpoint to resume from"):
        run(tokenizer, tmp_path / "run", "--steps", "8", "--checkpoint-every", "2", "--resume")


def test_checkpoints_resuming_passed_over_are_set_aside_not_kept_instead_of_good_ones(tokenizer, tmp_path, capsys):
    """A newer checkpoint that is damaged, or that holds something else, is passed over, then moved aside:
    --keep then keeps the checkpoints this run writes, not it."""
    run(tokenizer, tmp_path, "--steps", "4", "--checkpoint-every", "2")
    newest = tmp_path / "ckpt-00000004"
    (newest / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "ckpt-00000009").mkdir()
    (tmp_path / "ckpt-00000009" / "checkpoint.json").write_text('{"step": 9}')  # intact, but not pretrain.py's
    run(tokenizer, tmp_path, "--steps", "3", "--checkpoint-every", "1", "--keep", "1", "--resume")
    out = capsys.readouterr().out
    assert "ckpt-00000009/checkpoint.json: damaged or not pretrain.py's" in out and "at step 2" in out
    assert f"moved {newest}, passed over above, to {newest}.damaged" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock", "ckpt-00000003", "ckpt-00000004.damaged", "ckpt-00000009.damaged"]


def test_fewer_predictions_than_bert_masks_are_said(tokenizer, tmp_path, capsys):
    run(tokenizer, tmp_path, "--seq-len", "64", "--steps", "2")  # 5 predictions: 7.8%, not 15% of 64 (10)
    assert "note: --max-predictions 5 masks 7.8% of --seq-len 64, not BERT's 15% (10 pieces)" in capsys.readouterr().out


@pytest.mark.subprocess
def test_a_terminal_that_cannot_show_a_path_gets_it_escaped(tokenizer, tmp_path):
    out = run_script(tokenizer, tmp_path / "données", "--steps", "2", env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert "donn\\xe9es" in out and "done: 2 steps" in out


def test_a_run_resumed_on_another_kind_of_device_goes_on_and_says_so():
    runtime = runtimes.Runtime("cuda", torch.device("cpu"))  # a CPU run's state, resumed on a GPU
    with pytest.warns(UserWarning, match="the saved state has no cuda random state"):
        runtime.set_rng_state({"torch": torch.get_rng_state()})


def hold_out_dir(out_dir):
    """Another process holding out_dir as a running pretrain.py or finetune.py does (checkpoints.claim)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, checkpoints\nlock = checkpoints.claim(sys.argv[1])\n"
                               "print('held', flush=True)\ntime.sleep(600)", str(out_dir)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


@pytest.mark.subprocess
def test_a_second_run_on_an_out_dir_in_use_stops_at_once(tokenizer, tmp_path):
    holder = hold_out_dir(tmp_path)
    with pytest.raises(DataError, match="is in use by another run"):
        pretrain.main(tiny_args(tokenizer, tmp_path, "--steps", "2"))
    assert not checkpoints.checkpoint_paths(tmp_path)
    holder.kill()  # as a run ends, however it ends
    holder.wait()
    pretrain.main(tiny_args(tokenizer, tmp_path, "--steps", "2"))  # free again, and freed when the run ends
    pretrain.main(tiny_args(tokenizer, tmp_path, "--steps", "4", "--resume"))


def test_every_process_waits_for_the_tokenizer_rank_0_trains(tokenizer):
    class Rank1:  # rank 0 found no tokenizer and trained it; rank 1 only looks once it is there
        is_main, barriers = False, 0

        def gather_object(self, exists):
            return [False, exists]

        def on_main(self, work):  # (rank 0's work done: every process goes on together)
            self.barriers += 1
    runtime = Rank1()
    model_config, cfg = pretrain.parse_args(tiny_args(tokenizer, "unused"))
    pretrain.ensure_tokenizer(cfg, model_config, runtime, print, lines=None)  # (lines: for the default's name)
    assert runtime.barriers == 1  # else rank 0's barrier would meet rank 1's next collective


def test_the_default_tokenizer_is_one_for_each_corpus_and_vocabulary(tmp_path, monkeypatch, capsys):
    """Without --tokenizer, a run trains the tokenizer of its corpus and vocab_size once: another --data never reuses
    the last run's (it did, with one note: a Korean corpus was read with the sample corpus's pieces)."""
    monkeypatch.chdir(tmp_path)
    for data, out in (("en.txt", "a"), ("de.txt", "b"), ("en.txt", "c")):
        pretrain.main(["--data", str(REPO / "sample_data" / data), "--out-dir", out, "--vocab-size", "400",
                       "--seq-len", "32", "--max-predictions", "5", "--batch-size", "4", "--steps", "2", "--warmup",
                       "1", "--device", "cpu"])
    assert capsys.readouterr().out.count("training a 400-piece SentencePiece tokenizer") == 2
    used = {out: json.loads((tmp_path / out / "ckpt-00000002" / "checkpoint.json").read_text())["tokenizer"]["path"]
            for out in "abc"}
    assert used["a"] == used["c"] != used["b"] and len(list((tmp_path / "out" / "tokenizer").glob("*.model"))) == 2


def test_a_first_run_counts_its_corpus_once(tmp_path, monkeypatch):
    """The loader's weights and the tokenizer's sample come from one pass over the corpus's lines (train_tokenizer
    counted them again: a second pass over a corpus of gigabytes before the first step)."""
    import data
    counted, count_lines = [], data.count_lines
    monkeypatch.setattr(data, "count_lines", lambda path: counted.append(path) or count_lines(path))
    monkeypatch.chdir(tmp_path)
    corpus = str(REPO / "sample_data" / "de.txt")
    pretrain.main(["--data", corpus, "--out-dir", "out", "--vocab-size", "400", "--seq-len", "32", "--max-predictions",
                   "5", "--batch-size", "4", "--steps", "2", "--warmup", "1", "--device", "cpu"])
    assert counted == [corpus] and len(list((tmp_path / "out" / "tokenizer").glob("*.model"))) == 1


def test_checkpoint_from_another_config_is_refused(tokenizer, tmp_path):
    run(tokenizer, tmp_path, "--steps", "2", "--checkpoint-every", "2")
    with pytest.raises(DataError, match=r"another model or training \(hidden_size 128 then, 64 now\)"):
        run(tokenizer, tmp_path, "--steps", "4", "--hidden-size", "64", "--resume")
    with pytest.raises(DataError, match=r"\(lr 0.001 then, 0.002 now\)"):
        run(tokenizer, tmp_path, "--steps", "4", "--lr", "2e-3", "--resume")
    with pytest.raises(DataError, match="pass --resume"):
        run(tokenizer, tmp_path, "--steps", "4")


def test_resume_refuses_another_tokenizer_or_fewer_steps_and_says_when_nothing_is_there(tokenizer, tmp_path, capsys):
    run(tokenizer, tmp_path / "run", "--steps", "4", "--checkpoint-every", "2", "--resume")
    assert f"--resume: no checkpoint in {tmp_path / 'run'} yet; starting at step 0" in capsys.readouterr().out
    with pytest.raises(DataError, match=r"ckpt-00000004 is at step 4, past --steps 3"):
        run(tokenizer, tmp_path / "run", "--steps", "3", "--resume")
    # --tokenizer naming no file (the default, from another directory): the checkpoint's, not a new one.
    missing = tmp_path / "missing.model"
    run(tokenizer, tmp_path / "run", "--tokenizer", str(missing), "--steps", "6", "--resume")  # the last flag wins
    assert f"ckpt-00000004's tokenizer, {os.path.abspath(tokenizer)}" in capsys.readouterr().out
    assert not missing.exists() and final_state(tmp_path / "run")["step"] == 6
    moved = tmp_path / "moved" / "spm.model"  # the checkpoint's tokenizer gone: named, no new one trained there
    moved.parent.mkdir()
    moved.write_bytes(Path(tokenizer).read_bytes())
    run(str(moved), tmp_path / "moved-run", "--steps", "2", "--checkpoint-every", "2")
    moved.unlink()
    with pytest.raises(DataError, match=f"was trained with the tokenizer {moved}, which is not there \\(moved\\?\\); "
                                        f"pass --tokenizer"):
        run(tokenizer, tmp_path / "moved-run", "--tokenizer", str(missing), "--steps", "4", "--resume")
    assert not moved.exists() and not missing.exists()
    with pytest.raises(DataError, match=r"ckpt-00000006/train_state.safetensors: the saved data-loader state was "
                                        r"made with other data or settings: .*the corpus files"):  # its file named
        run(tokenizer, tmp_path / "run", "--data", str(REPO / "sample_data" / "en.txt"), "--steps", "8", "--resume")
    other = train_tokenizer(str(REPO / "sample_data"), 400, str(tmp_path / "other"))
    with pytest.raises(DataError, match=f"{other} is not the tokenizer .* was trained with "
                                        f"\\({os.path.abspath(tokenizer)}"):
        run(other, tmp_path / "run", "--steps", "4", "--vocab-size", str(Tokenizer(tokenizer).vocab_size), "--resume")


def test_checkpoint_holds_everything_and_loads_as_encoder(tokenizer, tmp_path):
    model = run(tokenizer, tmp_path, "--steps", "2", "--checkpoint-every", "2")
    checkpoint = final_state(tmp_path)
    assert set(checkpoint) == {"model", "config", "train_config", "optimizer", "step", "loader", "rng", "tokenizer",
                               "processes", "sha256"}
    assert checkpoint["step"] == 2 and checkpoint["processes"] == 1 and len(checkpoint["loader"]) == 1
    assert checkpoint["optimizer"]["state"]["head.decoder.weight"]["step"] == 2  # AdamW's state by parameter name
    assert checkpoint["train_config"]["steps"] == 2 and checkpoint["config"]["hidden_size"] == 128
    assert checkpoint["tokenizer"] == {"path": os.path.abspath(tokenizer), "sha256": Tokenizer(tokenizer).sha256}
    encoder = checkpoints.from_checkpoint(checkpoints.checkpoint_paths(tmp_path)[-1]).encoder
    for name, tensor in encoder.state_dict().items():
        assert torch.equal(tensor, model.encoder.state_dict()[name])
    path, weights = checkpoints.checkpoint_paths(tmp_path)[-1], model.state_dict()
    weights["encoder.embeddings.norm.bias"][0] = float("nan")  # crafted or damaged, its digests made anew: named
    with warnings.catch_warnings():  # (that the shards are written over, which DCP warns of)
        warnings.simplefilter("ignore")
        checkpoints.shards({"model": weights}, path, save=True)
    rewrite_info(path)
    with pytest.raises(DataError, match=r"ckpt-00000002: encoder.embeddings.norm.bias holds NaN or infinite values"):
        checkpoints.from_checkpoint(path)  # (fine-tuning from it said 'the loss became nan; try a lower --lr')


@pytest.mark.subprocess  # inductor compiles in worker processes
def test_compiled_run_matches_eager_and_saves_plain_weights(tokenizer, tmp_path):
    """--compile (torch.compile, ~30 s of compiling here) trains the same model as eager mode, and
    its checkpoints hold the plain module's names, so they load and resume without it."""
    coupled = ["--tie-embeddings", "--input-embedding-size", "64", "--output-embedding-size", "64"]
    eager = run(tokenizer, tmp_path / "eager", "--steps", "3", "--num-layers", "1", *coupled)
    compiled = run(tokenizer, tmp_path / "compiled", "--steps", "3", "--num-layers", "1", "--compile", *coupled)
    for (name, a), (_, b) in zip(eager.state_dict().items(), compiled.state_dict().items()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=name)
    saved = final_state(tmp_path / "compiled")["model"]
    assert saved.keys() == eager.state_dict().keys()
    assert torch.equal(saved["head.decoder.weight"], saved["encoder.embeddings.word_embeddings.weight"])  # coupled


@pytest.mark.subprocess
def test_resume_after_sigkill_is_bitwise_exact(tokenizer, tmp_path):
    # With a DataLoader worker: killed with the run's main process, it may outlive it a moment (no lock held).
    steps = ["--steps", "12", "--checkpoint-every", "1", "--keep", "2", "--grad-accum", "2", "--num-workers", "1"]
    run_script(tokenizer, tmp_path / "straight", *steps)
    kill_at = random.randint(2, 6)
    args = [sys.executable, "pretrain.py", *tiny_args(tokenizer, tmp_path / "killed", *steps)]
    with subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            if line.startswith(f"step {kill_at:>6}/"):
                proc.send_signal(signal.SIGKILL)
                break
    assert proc.wait() == -signal.SIGKILL
    interrupted_at = final_state(tmp_path / "killed")["step"]
    assert interrupted_at < 12, f"killed at step {kill_at}, but the run had finished"
    run_script(tokenizer, tmp_path / "killed", *steps, "--resume")
    straight, resumed = final_state(tmp_path / "straight"), final_state(tmp_path / "killed")
    assert resumed["step"] == straight["step"] == 12
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), f"{name} differs (killed at step {interrupted_at})"
    for name, state in straight["optimizer"]["state"].items():
        assert all(torch.equal(state[k], resumed["optimizer"]["state"][name][k]) for k in state), name


DRIVER = """
import os, sys, torch
sys.path.insert(0, {repo!r})
import pretrain
model_config, train_config = pretrain.parse_args(sys.argv[1:])
model = pretrain.train(model_config, train_config)
torch.save(model.state_dict(), os.path.join(train_config.out_dir, "rank%s.pt" % os.environ.get("RANK", "0")))
"""


@pytest.mark.subprocess
def test_torchrun_two_processes_match_one_process_with_the_global_batch(tokenizer, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO)))
    common = ["--steps", "3", "--checkpoint-every", "3", "--grad-accum", "2", "--tie-embeddings",  # (coupled)
              "--input-embedding-size", "64", "--output-embedding-size", "64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    str(driver), *tiny_args(tokenizer, tmp_path / "ddp", *common, "--batch-size", "2")],
                   cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    subprocess.run([sys.executable, str(driver), *tiny_args(tokenizer, tmp_path / "one", *common, "--batch-size", "4")],
                   cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    rank0, rank1 = (torch.load(tmp_path / "ddp" / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    one = torch.load(tmp_path / "one" / "rank0.pt", weights_only=True)
    for name in one:
        assert torch.equal(rank0[name], rank1[name]), name
        torch.testing.assert_close(rank0[name], one[name], rtol=1e-4, atol=1e-5, msg=name)
    saved = final_state(tmp_path / "ddp")["model"]
    assert torch.equal(saved["head.decoder.weight"], saved["encoder.embeddings.word_embeddings.weight"])  # coupled
    # The two processes read disjoint shards.
    tok = Tokenizer(tokenizer)
    shards = [MLMLoader(str(REPO / "sample_data"), tok, batch_size=2, seq_len=32, max_predictions=5, rank=r,
                        world_size=2, seed=0) for r in (0, 1)]
    rows = [{tuple(row.tolist()) for batch in zip(range(10), shard) for row in batch[1]["input_ids"]} for shard in shards]
    assert rows[0] and rows[1] and not rows[0] & rows[1]


def torchrun(tokenizer, out_dir, *extra, processes=2):
    """pretrain.py under torchrun on CPU (gloo): its log. gloo may abort at exit after the run has finished, so the
    run is judged by its output, not its exit code."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={processes}", "pretrain.py", *tiny_args(tokenizer, out_dir, *extra)],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "done:" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout


def resumed_from(source, step, out_dir):
    """out_dir holding the checkpoint of `source` at `step` alone, as a run interrupted after it leaves it."""
    shutil.copytree(Path(source) / f"ckpt-{step:08d}", Path(out_dir) / f"ckpt-{step:08d}")
    return out_dir


@pytest.mark.subprocess
@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_on_two_processes_is_one_process_and_resumes_on_any_number(tokenizer, tmp_path, tied, capsys):
    """--fsdp (FSDP2 on gloo) computes the one-process run at the same global batch (4 x 2 x 1 = 2 x 2 x 2); its
    checkpoint, sharded in two, resumes on two processes bitwise and on one, sharded or not (and a one-process
    checkpoint on two), within float32's rounding. (The one-process runs without --fsdp: in this process.)"""
    common = ["--steps", "6", "--checkpoint-every", "3", "--keep", "2", "--grad-accum", "2", "--warmup", "2",
              "--num-layers", "1"]
    if tied:
        common += ["--tie-embeddings", "--input-embedding-size", "64", "--output-embedding-size", "64"]
    single = lambda *a: run_script(tokenizer, *a, env={**os.environ, "OMP_NUM_THREADS": "1"})  # noqa: E731
    here = lambda *a: (run(tokenizer, *a), capsys.readouterr().out)[1]  # noqa: E731
    one = here(tmp_path / "one", *common, "--batch-size", "4")
    fsdp = torchrun(tokenizer, tmp_path / "fsdp", *common, "--batch-size", "2", "--fsdp")
    assert "2 process(es), weights sharded (FSDP2)" in fsdp
    assert logged(fsdp, "loss") == pytest.approx(logged(one, "loss"), rel=1e-5)
    shards = sorted(p.name for p in (tmp_path / "fsdp" / "ckpt-00000006").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "checkpoint.json", "train_state.safetensors"]
    straight = final_state(tmp_path / "fsdp")
    # 2 -> 1, sharded over the one process (tied) or not; and 1 -> 2
    for out, runner, source, reference, flags in (
            ("two-to-one", single if tied else here, "fsdp", fsdp, ["--batch-size", "4", "--fsdp"] if tied else
             ["--batch-size", "4"]),
            ("one-to-two", lambda *a: torchrun(tokenizer, *a), "one", one, ["--batch-size", "2", "--fsdp"])):
        log = runner(resumed_from(tmp_path / source, 3, tmp_path / out), *common, *flags, "--resume")
        assert "was written by" in log and "resumed from" in log and "at step 3" in log
        assert logged(log, "loss") == pytest.approx(logged(reference, "loss")[3:], rel=1e-5)
    if tied:  # one matrix, in and out, whatever the sharding
        for weights in (straight["model"], final_state(tmp_path / "two-to-one")["model"]):
            assert torch.equal(weights["head.decoder.weight"], weights["encoder.embeddings.word_embeddings.weight"])
        model = checkpoints.from_checkpoint(str(tmp_path / "fsdp" / "ckpt-00000006"))
        assert model.head.decoder.weight is model.encoder.embeddings.word_embeddings.weight
        return
    # The same number of processes: bitwise the uninterrupted run.
    again = torchrun(tokenizer, resumed_from(tmp_path / "fsdp", 3, tmp_path / "again"), *common, "--batch-size", "2",
                     "--fsdp", "--resume")
    resumed = final_state(tmp_path / "again")
    assert all(torch.equal(straight["model"][k], resumed["model"][k]) for k in straight["model"])
    assert logged(again, "loss") == logged(fsdp, "loss")[3:]
    with pytest.raises(DataError, match="global_batch 8 then, 4 now"):  # another global batch: refused by name
        here(resumed_from(tmp_path / "fsdp", 3, tmp_path / "other"), *common, "--batch-size", "2", "--resume")


def xla_python():
    """The torch 2.9 + torch-xla 2.9 environment; built here when missing (several minutes), by one process while
    the others wait (pytest-xdist's workers may ask at once)."""
    python = XLA_VENV / "bin" / "python"
    XLA_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{XLA_VENV}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(XLA_VENV)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.9.0", "torch-xla==2.9.0", "numpy",
                            "sentencepiece>=0.2.2", "safetensors"], check=True)
    return str(python)


def xla_env(**extra):
    """XLA on the CPU with its backend unoptimised: a third of the compile time, and the project's graph is the same
    (the tests compare it with eager CPU or with itself sharded, at tolerances far above the rounding this moves)."""
    return {**os.environ, "PJRT_DEVICE": "CPU", "XLA_FLAGS": "--xla_backend_optimization_level=0", **extra}


@pytest.mark.subprocess
def test_running_out_of_xla_memory_is_said_first():
    # torch-xla's error is a plain RuntimeError ("Out of memory allocating ...", on a TPU "RESOURCE_EXHAUSTED");
    # its exit hook then reports the failed computation again and exits 1, which is torch-xla's to decide.
    code = ("import torch, torch_xla; from configs import run_script; "
            "run_script(lambda: torch.ones(10 ** 12, 64, device=torch_xla.device()).cpu())")
    out = subprocess.run([xla_python(), "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert out.returncode != 0 and out.stderr.startswith("-c: error: out of memory (Out of memory"), out.stderr


@pytest.mark.subprocess
def test_a_coupled_model_stays_coupled_on_xla_and_spmd_fsdp_is_the_one_device_run(tokenizer, tmp_path):
    """Moved to an XLA device, a coupled model's one matrix became two (trained apart); SPMD with FSDPv2's
    sharding over 4 CPU devices computes what one device does, and resumes from its shards."""
    common = ["--steps", "4", "--checkpoint-every", "2", "--log-every", "1", "--tie-embeddings", "--num-layers", "1",
              "--input-embedding-size", "64", "--output-embedding-size", "64", "--device", "xla"]
    one = run_script(tokenizer, tmp_path / "one", *common, python=xla_python(), env=xla_env())
    spmd = run_script(tokenizer, tmp_path / "spmd", *common, "--fsdp", python=xla_python(),
                      env=xla_env(CPU_NUM_DEVICES="4"))
    assert "weights sharded (SPMD)" in spmd
    assert logged(spmd, "loss") == pytest.approx(logged(one, "loss"), rel=1e-5)
    resumed = run_script(tokenizer, resumed_from(tmp_path / "spmd", 2, tmp_path / "resumed"), *common, "--fsdp",
                         "--resume", python=xla_python(), env=xla_env(CPU_NUM_DEVICES="4"))  # its shards read back
    assert "at step 2" in resumed and logged(resumed, "loss") == pytest.approx(logged(spmd, "loss")[2:], rel=1e-6)
    for run in ("one", "spmd", "resumed"):
        weights = final_state(tmp_path / run)["model"]
        assert torch.equal(weights["head.decoder.weight"], weights["encoder.embeddings.word_embeddings.weight"]), run


def logged(stdout, field):
    return [float(line.split(f"{field} ")[1].split()[0].replace(",", "")) for line in stdout.splitlines()
            if line.startswith("step ")]


@pytest.mark.subprocess
def test_xla_matches_eager_cpu_and_stops_compiling(tokenizer, tmp_path, capsys):
    common = ["--steps", "8", "--checkpoint-every", "4", "--grad-accum", "2", "--num-layers", "1"]
    xla = run_script(tokenizer, tmp_path / "xla", *common, "--device", "xla", python=xla_python(), env=xla_env())
    run(tokenizer, tmp_path / "cpu", *common)  # eager CPU: in this process
    cpu = capsys.readouterr().out
    assert logged(xla, "loss") == pytest.approx(logged(cpu, "loss"), abs=2e-3)
    # Compiled: the step (step 1), the optimizer's state (step 2), the weight check before the first save.
    compiles = logged(xla, "xla compiles")
    assert len(compiles) == 8 and compiles[4:] == [compiles[4]] * 4, compiles
    assert compiles[2:4] == [compiles[2]] * 2 and compiles[4] - compiles[2] <= 2, compiles


# ----------------------------------------------------------------------------------------------
# A checkpoint directory is data: nothing in it runs, nothing of the user's is touched, checkpoint.json is checked

def rewrite_info(path, **changes):
    """Edit checkpoint.json as a hostile or careless hand would, its digests recomputed: they say a file is
    unchanged, not who wrote it."""
    info = json.loads(Path(path, "checkpoint.json").read_text())
    info.update(changes)
    if "sha256" not in changes:
        info["sha256"] = {p.name: sha256(str(p)) for p in Path(path).iterdir() if p.name != "checkpoint.json"}
    Path(path, "checkpoint.json").write_text(json.dumps(info))


class Payload:  # what a crafted pickle runs when loaded: here, it makes a directory
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_run_touches_only_its_own_checkpoint_folders_and_rotates_a_moved_one_by_its_link(tokenizer, tmp_path,
                                                                                            capsys):
    out = tmp_path / "run"
    for name in ("ckpt-00000010-hf", "ckpt-7", "ckpt-000000010"):  # a save_hf export, and others not of 8 digits
        (out / name).mkdir(parents=True)
        (out / name / "model.safetensors").write_bytes(b"the user's")
    run(tokenizer, out, "--steps", "2", "--checkpoint-every", "1", "--keep", "1")
    assert all((out / name / "model.safetensors").read_bytes() == b"the user's"
               for name in ("ckpt-00000010-hf", "ckpt-7", "ckpt-000000010"))
    moved = tmp_path / "other-disk" / "ckpt-00000002"  # moved to another disk, a link left in its place
    shutil.move(out / "ckpt-00000002", moved)
    (out / "ckpt-00000002").symlink_to(moved)
    capsys.readouterr()
    run(tokenizer, out, "--steps", "4", "--checkpoint-every", "1", "--keep", "1", "--resume")
    log = capsys.readouterr().out
    assert "at step 2" in log and "done: 4 steps" in log and "saving failed" not in log
    assert not (out / "ckpt-00000002").exists() and (moved / "checkpoint.json").exists()  # the link alone went
    assert [Path(p).name for p in checkpoints.checkpoint_paths(out)] == ["ckpt-00000004"]


def test_an_out_dir_whose_name_holds_glob_characters_is_that_folder_alone(tokenizer, tmp_path):
    """o[1] is a name, not a pattern: its run neither finds o1's checkpoints (nor resumes from them) nor removes them."""
    run(tokenizer, tmp_path / "o1", "--steps", "2", "--checkpoint-every", "1")
    theirs = sorted(os.listdir(tmp_path / "o1"))
    run(tokenizer, tmp_path / "o[1]", "--steps", "2", "--checkpoint-every", "1", "--keep", "1")
    assert sorted(os.listdir(tmp_path / "o1")) == theirs
    assert [Path(p).name for p in checkpoints.checkpoint_paths(tmp_path / "o[1]")] == ["ckpt-00000002"]


@pytest.mark.subprocess
def test_a_crafted_checkpoint_runs_nothing_and_is_refused_by_name(tokenizer, tmp_path, capsys):
    run(tokenizer, tmp_path / "run", "--steps", "4", "--checkpoint-every", "2")
    newest, marker = tmp_path / "run" / "ckpt-00000004", tmp_path / "ran"
    (newest / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    rewrite_info(newest)
    with pytest.raises(DataError, match=r"ckpt-00000004/.metadata: refused.* it names posix.mkdir"):
        checkpoints.from_checkpoint(str(newest))
    evaluated = subprocess.run([sys.executable, "evaluate.py", "mlm-accuracy", "--checkpoint", str(newest), "--data",
                                str(REPO / "sample_data" / "en.txt"), "--tokenizer", tokenizer, "--device", "cpu"],
                               cwd=REPO, capture_output=True, text=True)
    assert evaluated.returncode == 2 and evaluated.stderr.count("\n") == 1 and ".metadata: refused" in evaluated.stderr
    run(tokenizer, tmp_path / "run", "--steps", "6", "--checkpoint-every", "2", "--resume")
    assert "at step 2" in capsys.readouterr().out and (tmp_path / "run" / "ckpt-00000004.damaged").exists()
    assert not marker.exists()
    # An item that the checkpoint library would unpickle with torch.load(weights_only=False), a payload in a file of
    # its own: never read, so the weight it stands for is missing.
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    other, item = tmp_path / "run" / "ckpt-00000006", "model.head.decoder.bias"
    (other / "payload.bin").write_bytes(pickle.dumps(Payload(str(marker))))
    metadata = read_metadata(str(other))
    metadata.state_dict_metadata[item] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(item)] = _StorageInfo("payload.bin", 0, (other / "payload.bin").stat().st_size)
    (other / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_info(other)
    with pytest.raises(DataError, match=r"ckpt-00000006: the weights do not fit the saved config: .*decoder.bias"):
        checkpoints.from_checkpoint(str(other))
    assert not marker.exists()


def test_a_config_that_does_not_describe_the_shards_is_refused_before_its_model_is_built(tokenizer, tmp_path):
    """checkpoint.json's config against the shards' shapes, before the model is built: fewer layers than the shards
    hold (read before as a shorter model, silently), a million (an hour to build, and its memory), an embedding of
    10^13 rows (more than any address space)."""
    run(tokenizer, tmp_path / "run", "--steps", "2", "--checkpoint-every", "2", "--pretraining-only-layers", "1")
    path = tmp_path / "run" / "ckpt-00000002"
    config = json.loads((path / "checkpoint.json").read_text())["config"]
    for crafted, message in (({"num_layers": 1}, "it names 1 layers, the shards hold 2"),
                             ({"pretraining_only_layers": 0}, "it names 0 pre-training-only layers, the shards hold 1"),
                             ({"num_layers": 10 ** 6}, "it names 1000000 layers, the shards hold 2"),
                             ({"vocab_size": 10 ** 13}, r"encoder.embeddings.word_embeddings.weight is "
                                                        r"\(10000000000000, 64\) in it, \(500, 64\) in the shards")):
        rewrite_info(path, config={**config, **crafted})
        with pytest.raises(DataError, match=f"ckpt-00000002: the weights do not fit the saved config: {message}"):
            checkpoints.from_checkpoint(str(path))
    rewrite_info(path, config=config)
    assert checkpoints.from_checkpoint(str(path)).config == ModelConfig(**config)
    lone = tmp_path / "lone" / "ckpt-00000002"  # shards that hold a weight of the config's last layer alone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (one process, no process group)
        dcp.save({"model": {"encoder.layers.999999.output.weight": torch.zeros(1)}}, checkpoint_id=str(lone),
                 no_dist=True)
    for name in ("train_state.safetensors", "checkpoint.json"):
        shutil.copy(path / name, lone)
    rewrite_info(lone, config={**config, "num_layers": 10 ** 6, "pretraining_only_layers": 0})
    with pytest.raises(DataError, match="it names 1000000 layers, the shards hold 1$"):
        checkpoints.from_checkpoint(str(lone))


def test_checkpoint_json_is_checked_and_a_damaged_checkpoint_is_set_aside_under_a_free_name(tokenizer, tmp_path,
                                                                                             capsys):
    run(tokenizer, tmp_path / "made", "--steps", "4", "--checkpoint-every", "2")
    shard = "__0_0.distcp"
    damages = {  # what is done to ckpt-00000004 -> what the warning says
        "a step not the folder's": (lambda p: rewrite_info(p, step=2), "step 2 in the folder of step 4"),
        "a step of another type": (lambda p: rewrite_info(p, step="4"), "step: '4' is not of type int"),
        "a config of other types": (lambda p: rewrite_info(p, config={**json.loads(
            (p / "checkpoint.json").read_text())["config"], "tie_embeddings": "no"}), "tie_embeddings: 'no'"),
        "a train config of other types": (lambda p: rewrite_info(p, train_config={**json.loads(
            (p / "checkpoint.json").read_text())["train_config"], "lr": "0.001"}), "lr: '0.001' is not of type float"),
        "a tokenizer that is no record": (lambda p: rewrite_info(p, tokenizer="spm.model"), "tokenizer: 'spm.model'"),
        "a digest list naming a file outside": (lambda p: rewrite_info(p, sha256={**json.loads(
            (p / "checkpoint.json").read_text())["sha256"], "../made.txt": "0"}), "names '../made.txt'"),
        "a digest list naming /dev/zero": (lambda p: rewrite_info(p, sha256={**json.loads(
            (p / "checkpoint.json").read_text())["sha256"], "/dev/zero": "0"}), "names '/dev/zero'"),
        "a digest list naming a NUL byte": (lambda p: rewrite_info(p, sha256={**json.loads(
            (p / "checkpoint.json").read_text())["sha256"], "a\0b": "0"}), "names 'a\\x00b'"),
        "a digest list naming a line break": (lambda p: rewrite_info(p, sha256={**json.loads(
            (p / "checkpoint.json").read_text())["sha256"], "a\nb": "0"}), "names 'a\\nb'"),
        "a file named with a line break": (lambda p: (p / "notes\nx.txt").write_bytes(b"x"),
                                           "'notes\\nx.txt' is in the folder"),
        "a tokenizer that is no .model": (lambda p: rewrite_info(p, tokenizer={"path": "/etc/hostname",
                                                                              "sha256": "0"}), "a .model file"),
        "an empty digest list": (lambda p: rewrite_info(p, sha256={}), "no .metadata"),
        "a file not in the list": (lambda p: (p / "extra.bin").write_bytes(b"x"),
                                   "'extra.bin' is in the folder but not"),
        "a shard linked to /dev/zero": (lambda p: ((p / shard).unlink(), (p / shard).symlink_to("/dev/zero")),
                                        f"{shard}: damaged (not a regular file)"),
        "a shard that is a FIFO": (lambda p: ((p / shard).unlink(), os.mkfifo(p / shard)),
                                   f"{shard}: damaged (not a regular file)"),
        "checkpoint.json a FIFO": (lambda p: ((p / "checkpoint.json").unlink(), os.mkfifo(p / "checkpoint.json")),
                                   "checkpoint.json: damaged (not a regular file)"),
        "checkpoint.json a link": (lambda p: (shutil.move(p / "checkpoint.json", p.parent / "info.json"),
                                              (p / "checkpoint.json").symlink_to(p.parent / "info.json")),
                                   "checkpoint.json: damaged (not a regular file)"),
        "checkpoint.json a link to itself": (lambda p: ((p / "checkpoint.json").unlink(),
                                                        (p / "checkpoint.json").symlink_to(p / "checkpoint.json")),
                                             "checkpoint.json: damaged (not a regular file)"),
        "a key given twice": (lambda p: (p / "checkpoint.json").write_text(
            (p / "checkpoint.json").read_text().replace('"step": 4,', '"step": 4, "step": 4,', 1)),
            "checkpoint.json: duplicate key 'step'"),
    }
    for case, (damage, said) in damages.items():
        out = tmp_path / case.replace(" ", "-").replace("/", "")
        shutil.copytree(tmp_path / "made", out, symlinks=True)
        damage(out / "ckpt-00000004")
        capsys.readouterr()
        run(tokenizer, out, "--steps", "4", "--checkpoint-every", "2", "--resume")
        log = capsys.readouterr().out
        assert "warning:" in log and said in log and "at step 2" in log, case
        assert (out / "ckpt-00000004.damaged").exists() and final_state(out)["step"] == 4, case
    # The same step damaged twice: set aside again, under the next free name.
    out = tmp_path / "a-step-not-the-folder's"
    rewrite_info(out / "ckpt-00000004", step=2)
    run(tokenizer, out, "--steps", "4", "--checkpoint-every", "2", "--resume")
    assert "to " + str(out / "ckpt-00000004.damaged-2") in capsys.readouterr().out


def test_a_full_disk_is_one_line_and_the_checkpoint_before_stays(tokenizer, tmp_path, monkeypatch):
    run(tokenizer, tmp_path, "--steps", "2", "--checkpoint-every", "2")

    def disk_full(*args, **kwargs):  # inside the checkpoint library, which wraps it with every process's traceback
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.distributed.checkpoint.filesystem, "_write_item", disk_full)
    with pytest.raises(OSError) as failed:
        run(tokenizer, tmp_path, "--steps", "4", "--checkpoint-every", "2", "--resume")
    message = str(failed.value)
    assert "ckpt-00000004: saving failed (no space left on device" in message
    assert "\n" not in message and "Traceback" not in message
    monkeypatch.undo()
    assert [Path(p).name for p in checkpoints.checkpoint_paths(tmp_path)] == ["ckpt-00000002"]
    run(tokenizer, tmp_path, "--steps", "4", "--checkpoint-every", "2", "--resume")
    assert final_state(tmp_path)["step"] == 4


def full_disk(monkeypatch, room=5000):
    """The disk of torch.distributed.checkpoint's files full after `room` bytes, as the system says it: a write that
    finds no room fails with ENOSPC (which torch's own writer reports as "unexpected pos")."""
    import contextlib
    import errno
    import io
    left = [room]

    class Full(io.FileIO):
        def write(self, b):
            if not left[0]:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = super().write(memoryview(b).cast("B")[:left[0]])
            left[0] -= n
            return n

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with io.BufferedWriter(Full(path, "w")) if "w" in mode else open(path, mode) as stream:
            yield stream
    monkeypatch.setattr(torch.distributed.checkpoint.filesystem.FileSystem, "create_stream", create_stream)


def test_a_really_full_disk_says_so_in_one_line(tokenizer, tmp_path, monkeypatch):
    run(tokenizer, tmp_path, "--steps", "2", "--checkpoint-every", "2")
    full_disk(monkeypatch, room=5000)
    with pytest.raises(OSError) as failed:
        run(tokenizer, tmp_path, "--steps", "4", "--checkpoint-every", "2", "--resume")
    assert "ckpt-00000004: saving failed (no space left on device" in str(failed.value)
    assert "\n" not in str(failed.value)
    assert [Path(p).name for p in checkpoints.checkpoint_paths(tmp_path)] == ["ckpt-00000002"]


def test_rank_and_world_size_without_torchrun_are_one_line(tokenizer, tmp_path, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for env, flags in (({"RANK": "0", "WORLD_SIZE": "2"}, []), ({"RANK": "0", "WORLD_SIZE": "two"}, []),
                       ({"RANK": "1"}, []), ({"RANK": "0", "WORLD_SIZE": "1"}, ["--fsdp"])):
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(DataError, match="start the processes with torchrun"):
            run(tokenizer, tmp_path, "--steps", "2", *flags)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    os.mkfifo(tmp_path / ".lock")  # an --out-dir's lock that would hang the run: named instead
    with pytest.raises(DataError, match=r"\.lock: not a regular file"):
        run(tokenizer, tmp_path, "--steps", "2")
    (tmp_path / "a-file").write_text("the user's")  # an --out-dir that names a file: named, the file kept
    with pytest.raises(DataError, match=r"--out-dir .*a-file is a file, not a folder; choose another --out-dir"):
        run(tokenizer, tmp_path / "a-file", "--steps", "2")
    assert (tmp_path / "a-file").read_text() == "the user's"


def test_a_process_whose_peers_are_gone_says_so_in_one_line(monkeypatch, capsys):
    """torchrun --max-restarts starts a process again, and its peers may be gone: gloo's error from
    init_process_group (27 lines, C++ frames included) is one line, as every other stop of a process."""
    import torch.distributed as dist
    from configs import run_script
    said = "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error"

    def peers_gone(*args, **kwargs):
        raise dist.DistNetworkError(said + "".join(f"\nframe #{i}: c10d::ProcessGroupGloo (libtorch_cpu.so)"
                                                   for i in range(26)))
    monkeypatch.setattr(dist, "init_process_group", peers_gone)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["pretrain.py"])
    with pytest.raises(SystemExit) as stop:
        run_script(lambda: runtimes.setup_runtime("cpu"))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err == f"pretrain.py: error: process 1 could not connect to the others: {said}\n"


def two_processes(tokenizer, out_dir, *extra):
    """pretrain.py as torchrun starts 2 processes, each with its own output."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "pretrain.py", *tiny_args(tokenizer, out_dir, *extra)], cwd=REPO,
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for r in (0, 1)]


@pytest.mark.subprocess
def test_one_process_stopping_stops_every_process_with_one_line(tokenizer, tmp_path):
    holder = hold_out_dir(tmp_path / "held")
    try:
        outputs = [p.communicate(timeout=300) for p in two_processes(tokenizer, tmp_path / "held", "--steps", "2")]
    finally:
        holder.kill()
    # (gloo's threads may abort the process after it has said its line: C++'s "terminate called ...", not ours)
    lines = [[line for line in err.strip().splitlines() if not line.startswith("terminate called")]
             for _, err in outputs]
    assert all(len(said) == 1 and "is in use by another run" in said[0] for said in lines), lines
    assert lines[0] == lines[1]
    # A process killed mid-run: the other says so in one line.
    rank0, rank1 = two_processes(tokenizer, tmp_path / "killed", "--steps", "2000", "--log-every", "1")
    for line in rank0.stdout:
        if line.startswith("step      2/"):
            rank1.kill()
            break
    _, err = rank0.communicate(timeout=300)
    rank1.wait()
    assert rank0.returncode == 2 and err.strip() == "pretrain.py: error: another process stopped: see its message", err


def test_fsdp_prints_no_warning_of_a_dropped_hook(tokenizer, tmp_path):
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(tokenizer, tmp_path, "--steps", "2", "--fsdp")
    finally:  # (the group of one that FSDP2 needs: the next test in this process starts without one, as a script)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert not [w for w in caught if "view tensor" in str(w.message)]
