"""Tests of benchmark.py: its FLOP formula against what the model executes, and a smoke run."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import benchmark
from configs import CONFIGS

REPO = Path(__file__).parent


@pytest.mark.parametrize("phase", benchmark.PHASES)
def test_flop_formula_counts_what_the_model_executes(phase):
    """step_flops_per_token x tokens == the matmul FLOPs of a real step, forward and backward, with
    a pre-training-only layer (counted for pre-training only) and the last layer at the outputs."""
    config = replace(CONFIGS["tiny"], num_layers=2, pretraining_only_layers=1, dropout=0.1)
    B, T, P = 2, 16, 3
    batch = benchmark.make_batch(config, B, T, P, torch.Generator().manual_seed(0))
    model = benchmark.build_ours(phase, config)
    # In training mode with dropout, CPU attention is spelled out as matmuls, which the counter sees.
    model.train()
    with FlopCounterMode(display=False) as counter:
        if phase == "infer":
            with torch.no_grad():
                benchmark.loss_fn(phase, "ours", model, batch)
        else:
            benchmark.loss_fn(phase, "ours", model, batch).backward()
    outputs = {"pretrain": P, "finetune": 1, "infer": T}[phase]
    assert counter.get_total_flops() == benchmark.step_flops_per_token(config, T, outputs, phase) * B * T


def test_model_command_prints_every_figure():
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "benchmark.py", "model", "--config", "tiny", "--set", "num_layers=1",
                          "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--warmup", "1",
                          "--phases", "pretrain", "infer"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    figures = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    ratios = {f["phase"]: f for f in figures if f["figure"] == "ratio_tokens_per_s"}
    assert set(ratios) == {"pretrain", "infer"} and all(r["min"] <= r["value"] <= r["max"] for r in ratios.values())
    checks = [f["value"] for f in figures if f["figure"] == "output_check_max_diff"]
    assert len(checks) == 2 and max(checks) < 1e-4  # the same loss / hidden states on both sides
    assert {(f["phase"], f["impl"]) for f in figures if f["figure"] == "mfu"} == {
        (p, i) for p in ("pretrain", "infer") for i in ("ours", "hf")}
