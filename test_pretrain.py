"""Tests for pretrain.py: the schedule, the optimizer groups, the command line, the NaN stop,
crash-safe checkpoints, exact resume after SIGKILL, DDP on 2 CPU processes and the XLA path."""

import os
import random
import signal
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import pretrain
from configs import CONFIGS
from data import MLMLoader, Tokenizer, train_tokenizer
from model import MaskedLM

REPO = Path(__file__).parent
XLA_VENV = Path(os.environ.get("REMBERT_XLA_VENV", Path.home() / ".cache" / "rembert-xla-venv"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("tokenizer") / "spm"
    return train_tokenizer(sorted(str(p) for p in (REPO / "sample_data").glob("*.txt")), 500, str(prefix))


def tiny_args(tokenizer, out_dir, *extra):
    """The tiny config with a small vocabulary and short sequences: a step takes milliseconds."""
    return [f"--data={REPO / 'sample_data'}", f"--tokenizer={tokenizer}", f"--out_dir={out_dir}",
            f"--vocab_size={Tokenizer(tokenizer).vocab_size}", "--seq_len=32", "--max_predictions=5",
            "--batch_size=4", "--warmup=1", "--log_every=1", "--device=cpu", *extra]


def run(tokenizer, out_dir, *extra):
    _, model_config, train_config = pretrain.parse_args(tiny_args(tokenizer, out_dir, *extra))
    return pretrain.train(model_config, train_config)


def run_script(tokenizer, out_dir, *extra, python=sys.executable, env=None):
    return subprocess.run([python, "pretrain.py", *tiny_args(tokenizer, out_dir, *extra)], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True).stdout


def final_state(out_dir):
    return torch.load(pretrain.checkpoint_paths(out_dir)[-1], map_location="cpu", weights_only=True)


# ----------------------------------------------------------------------------------------------

def test_lr_schedule_warms_up_then_decays_linearly():
    lrs = [pretrain.lr_at(step, warmup=4, total=12, peak=1.0) for step in range(12)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4:] == pytest.approx([(12 - s) / 8 for s in range(4, 12)])
    assert min(lrs) > 0  # no update of the run is wasted at lr 0
    assert pretrain.lr_at(0, warmup=0, total=10, peak=2.0) == 2.0


def test_weight_decay_on_matrices_only_and_frozen_pooler_left_out():
    model = MaskedLM(CONFIGS["tiny"])
    model.encoder.pooler.requires_grad_(False)
    optimizer = pretrain.build_optimizer(model, lr=1e-3, weight_decay=0.01)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    not_decayed = {names[id(p)] for p in no_decay["params"]}
    assert "encoder.layers.0.attention.qkv.weight" in decayed
    assert "head.decoder.weight" in decayed and "encoder.embeddings.word_embeddings.weight" in decayed
    assert "encoder.layers.0.attention_norm.weight" in not_decayed and "head.decoder.bias" in not_decayed
    assert all(n.endswith("bias") or "norm" in n for n in not_decayed)
    assert not any(n.startswith("encoder.pooler") for n in decayed | not_decayed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(decay["params"]) + len(no_decay["params"]) == len(trainable)
    assert optimizer.defaults["betas"] == (0.9, 0.999) and optimizer.defaults["eps"] == 1e-6


def test_tied_embedding_is_optimised_once():
    config = CONFIGS["coupled-e128"]
    with torch.device("meta"):
        model = MaskedLM(config)
    params = [p for g in pretrain.build_optimizer(model, 1e-3, 0.01).param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))


def test_overrides_are_typed_and_checked(capsys):
    name, model_config, train_config = pretrain.parse_args(
        ["--config", "small", "--dropout=0", "--tie-embeddings=false", "--num_layers=3", "--lr=2e-4",
         "--resume"])
    assert name == "small" and model_config.num_layers == 3 and model_config.hidden_size == 256
    assert model_config.dropout == 0.0 and model_config.tie_embeddings is False
    assert train_config.lr == 2e-4 and train_config.resume is True
    for argv, message in [
        (["--hiden_size=64"], "unknown option --hiden_size; did you mean --hidden_size?"),
        (["--hidden_size=big"], "argument --hidden_size/--hidden-size: invalid int value: 'big'"),
        (["--tie_embeddings=maybe"], "expected true or false"),
        (["--config=huge"], "invalid choice: 'huge'"),
        (["--hidden_size=100", "--num_heads=3"], "hidden_size 100 is not divisible by num_heads 3"),
        (["--steps=10", "--warmup=10"], "--warmup (10) must be below --steps (10)"),
        (["--seq_len=1024"], "--seq_len 1024 exceeds max_position_embeddings 512"),
    ]:
        with pytest.raises(SystemExit):
            pretrain.parse_args(argv)
        assert message in capsys.readouterr().err


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit):
        pretrain.parse_args(["--help"])
    text = capsys.readouterr().out
    for name in [f.name for f in fields(pretrain.ModelConfig) + fields(pretrain.TrainConfig)]:
        assert f"--{name}" in text
    assert "torchrun" in text and "PJRT_DEVICE=TPU" in text


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tokenizer, tmp_path, monkeypatch):
    calls = []
    cross_entropy = pretrain.F.cross_entropy

    def poisoned(*args, **kwargs):  # from the 3rd step on, the loss is NaN
        calls.append(1)
        return cross_entropy(*args, **kwargs) * (float("nan") if len(calls) >= 3 else 1.0)

    monkeypatch.setattr(pretrain.F, "cross_entropy", poisoned)
    with pytest.raises(FloatingPointError, match=r"loss became nan between steps 3 and 4; stopping. "
                                                 r"Last good checkpoint: .*ckpt-00000002.pt"):
        run(tokenizer, tmp_path, "--steps=6", "--log_every=2", "--checkpoint_every=2")
    assert [Path(p).name for p in pretrain.checkpoint_paths(tmp_path)] == ["ckpt-00000002.pt"]
    assert all(torch.isfinite(t).all() for t in final_state(tmp_path)["model"].values())


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    runtime = pretrain.setup_runtime("cpu")
    path = str(tmp_path / "ckpt-00000001.pt")
    runtime.save({"step": 1}, path)

    def crash(obj, f):
        Path(f).write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(pretrain.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        runtime.save({"step": 2}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}


def test_resume_ignores_a_truncated_temporary_file(tokenizer, tmp_path, capsys):
    run(tokenizer, tmp_path, "--steps=4", "--checkpoint_every=2")
    newest = Path(pretrain.checkpoint_paths(tmp_path)[-1])
    (tmp_path / "ckpt-00000006.pt.tmp").write_bytes(newest.read_bytes()[:1000])  # a crash mid-save
    run(tokenizer, tmp_path, "--steps=8", "--checkpoint_every=2", "--resume")
    assert f"resumed from {newest} at step 4" in capsys.readouterr().out
    assert final_state(tmp_path)["step"] == 8
    assert [Path(p).name for p in pretrain.checkpoint_paths(tmp_path)] == [
        "ckpt-00000004.pt", "ckpt-00000006.pt", "ckpt-00000008.pt"]  # keep=3


def test_checkpoint_from_another_config_is_refused(tokenizer, tmp_path):
    run(tokenizer, tmp_path, "--steps=2", "--checkpoint_every=2")
    with pytest.raises(ValueError, match=r"another model config \(hidden_size: checkpoint 128, now 64\)"):
        run(tokenizer, tmp_path, "--steps=4", "--hidden_size=64", "--resume")
    with pytest.raises(FileExistsError, match="pass --resume"):
        run(tokenizer, tmp_path, "--steps=4")


def test_checkpoint_holds_everything_and_loads_as_encoder(tokenizer, tmp_path):
    model = run(tokenizer, tmp_path, "--steps=2", "--checkpoint_every=2")
    checkpoint = final_state(tmp_path)
    assert set(checkpoint) == {"model", "config", "train_config", "optimizer", "step", "loader", "rng"}
    assert checkpoint["train_config"]["steps"] == 2 and checkpoint["config"]["hidden_size"] == 128
    encoder = pretrain.load_pretrained_encoder(pretrain.checkpoint_paths(tmp_path)[-1])
    for name, tensor in encoder.state_dict().items():
        assert torch.equal(tensor, model.encoder.state_dict()[name])


def test_compiled_run_matches_eager_and_saves_plain_weights(tokenizer, tmp_path):
    """--compile (torch.compile, ~30 s of compiling here) trains the same model as eager mode, and
    its checkpoints hold the plain module's names, so they load and resume without it."""
    eager = run(tokenizer, tmp_path / "eager", "--steps=3", "--num_layers=1")
    compiled = run(tokenizer, tmp_path / "compiled", "--steps=3", "--num_layers=1", "--compile")
    for (name, a), (_, b) in zip(eager.state_dict().items(), compiled.state_dict().items()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=name)
    assert final_state(tmp_path / "compiled")["model"].keys() == eager.state_dict().keys()
    with pytest.raises(SystemExit):
        pretrain.parse_args(tiny_args(tokenizer, tmp_path, "--compile", "--device=xla"))


def test_resume_after_sigkill_is_bitwise_exact(tokenizer, tmp_path):
    steps = ["--steps=20", "--checkpoint_every=1", "--keep=2", "--grad_accum=2"]
    run_script(tokenizer, tmp_path / "straight", *steps)
    kill_at = random.randint(2, 10)
    args = [sys.executable, "pretrain.py", *tiny_args(tokenizer, tmp_path / "killed", *steps)]
    with subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            if line.startswith(f"step {kill_at:>6}/"):
                proc.send_signal(signal.SIGKILL)
                break
    assert proc.wait() == -signal.SIGKILL
    interrupted_at = final_state(tmp_path / "killed")["step"]
    assert interrupted_at < 20, f"killed at step {kill_at}, but the run had finished"
    run_script(tokenizer, tmp_path / "killed", *steps, "--resume")
    straight, resumed = final_state(tmp_path / "straight"), final_state(tmp_path / "killed")
    assert resumed["step"] == straight["step"] == 20
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), f"{name} differs (killed at step {interrupted_at})"
    for a, b in zip(straight["optimizer"]["state"].values(), resumed["optimizer"]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


DRIVER = """
import os, sys, torch
sys.path.insert(0, {repo!r})
import pretrain
_, model_config, train_config = pretrain.parse_args(sys.argv[1:])
model = pretrain.train(model_config, train_config)
torch.save(model.state_dict(), os.path.join(train_config.out_dir, "rank%s.pt" % os.environ.get("RANK", "0")))
"""


def test_torchrun_two_processes_match_one_process_with_the_global_batch(tokenizer, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO)))
    # Dropout off: the processes draw different masks than one process would.
    common = ["--steps=3", "--checkpoint_every=3", "--dropout=0", "--grad_accum=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    str(driver), *tiny_args(tokenizer, tmp_path / "ddp", *common, "--batch_size=2")],
                   cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    subprocess.run([sys.executable, str(driver), *tiny_args(tokenizer, tmp_path / "one", *common, "--batch_size=4")],
                   cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    rank0, rank1 = (torch.load(tmp_path / "ddp" / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    one = torch.load(tmp_path / "one" / "rank0.pt", weights_only=True)
    for name in one:
        assert torch.equal(rank0[name], rank1[name]), name
        torch.testing.assert_close(rank0[name], one[name], rtol=1e-4, atol=1e-5, msg=name)
    # The two processes read disjoint shards.
    tok = Tokenizer(tokenizer)
    shards = [MLMLoader(str(REPO / "sample_data"), tok, batch_size=2, seq_len=32, max_predictions=5, rank=r,
                        world_size=2, seed=0) for r in (0, 1)]
    rows = [{tuple(row.tolist()) for batch in shard for row in batch["input_ids"] if row[0] == tok.cls_id}  # not padding
            for shard in shards]
    assert rows[0] and rows[1] and not rows[0] & rows[1]


def xla_python():
    """The torch 2.9 + torch-xla 2.9 environment; built here when missing (several minutes)."""
    python = XLA_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(XLA_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.9.0", "torch-xla==2.9.0", "numpy",
                        "sentencepiece"], check=True)
    return str(python)


def logged(stdout, field):
    return [float(line.split(f"{field} ")[1].split()[0].replace(",", "")) for line in stdout.splitlines()
            if line.startswith("step ")]


def test_xla_matches_eager_cpu_and_stops_compiling(tokenizer, tmp_path):
    common = ["--steps=8", "--checkpoint_every=4", "--dropout=0", "--grad_accum=2"]
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    xla = run_script(tokenizer, tmp_path / "xla", *common, "--device=xla", python=xla_python(), env=env)
    cpu = run_script(tokenizer, tmp_path / "cpu", *common)
    assert logged(xla, "loss") == pytest.approx(logged(cpu, "loss"), abs=2e-3)
    compiles = logged(xla, "xla compiles")
    assert len(compiles) == 8 and compiles[2:] == [compiles[2]] * 6, compiles  # steady after the first steps
