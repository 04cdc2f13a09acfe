"""Tests of benchmark.py: its FLOP formula against what the model executes, and a run of each command."""

import json
import os
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import benchmark
from configs import CONFIGS, run_script

REPO = Path(__file__).parent


@pytest.mark.parametrize("phase", benchmark.PHASES)
def test_flop_formula_counts_what_the_model_executes(phase):
    """step_flops x tokens == the FLOPs torch counts in a real step, forward and backward, with a
    pre-training-only layer (counted for pre-training only) and E_in != H."""
    config = replace(CONFIGS["tiny"], num_layers=2, pretraining_only_layers=1)
    B, T, P = 2, 16, 3
    batch = benchmark.make_batch(config, B, T, P, torch.Generator().manual_seed(0))
    model = benchmark.build(phase, "ours", config, None)
    # torch's counter knows the GPU attention kernels, not these CPU ones; model FLOPs count attention's
    # backward as its two products per forward one (not the kernel's recomputation of q.k^T).
    aten = torch.ops.aten
    cpu_attention = {aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, **__: sdpa_flop_count(q, k, v),
                     aten._scaled_dot_product_flash_attention_for_cpu_backward:
                         lambda grad, q, k, v, *_, **__: 2 * sdpa_flop_count(q, k, v)}
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter:
        if phase == "infer":
            with torch.no_grad():
                benchmark.loss(phase, "ours", model, batch)
        else:
            benchmark.loss(phase, "ours", model, batch).backward()
    assert counter.get_total_flops() == benchmark.step_flops(config, T, P, phase) * B * T


@pytest.mark.subprocess
def test_model_command_prints_every_figure():
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "benchmark.py", "model", "--config", "tiny",
                          "--batch-size", "2", "--seq-len", "16", "--predictions", "3", "--steps", "2", "--warmup", "1",
                          "--phases", "pretrain", "infer"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    figures = {f["phase"]: f for f in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    assert set(figures) == {"pretrain", "infer"}
    for f in figures.values():
        assert f["output_check_max_diff"] < 1e-4  # the same loss / hidden states on both sides


@pytest.mark.subprocess
def test_gpu_command_writes_every_figure_of_its_parts(tmp_path):
    """The GPU measurements tried on CPU at tiny sizes: the step (the first batch that fits) against transformers
    with its profile, and pretrain.py's step without and with FSDP2 (torchrun, one process), the same losses."""
    pytest.importorskip("transformers")
    out = tmp_path / "gpu.json"
    printed = subprocess.run([sys.executable, "benchmark.py", "gpu", "--device", "cpu", "--parts", "step", "fit",
                              "--config", "tiny", "--batch-sizes", "2", "--steps", "1", "--no-compile", "--seq-len",
                              "16", "--predictions", "3", "--fit-config", "tiny", "--fit-batch-sizes", "2", "--out",
                              str(out)], cwd=REPO, capture_output=True, text=True, check=True).stdout
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["torch"] == torch.__version__
    (row,) = report["step"]["rows"]
    assert (row["batch_size"], row["seq_len"], row["compiled"]) == (2, 16, False) and 0 < row["mfu"] < 1
    top = report["step"]["profile"]["top"]
    assert len(top) == 5 and sum(k["share"] for k in top) <= 1 and top[0]["share"] >= top[-1]["share"]
    plain, fsdp = report["fit"]["plain"], report["fit"]["fsdp"]
    assert (plain["fsdp"], fsdp["fsdp"], plain["batch_size"], fsdp["batch_size"]) == (False, True, 2, 2)
    assert len(plain["losses"]) == 4 and plain["losses"][-1] < plain["losses"][0]  # it learns the batch
    assert report["fit"]["losses_finite"] and report["fit"]["equal_to_bf16_rounding"]
    assert report["fit"]["loss_relative_difference"] < 1e-5  # float32 on CPU: FSDP2 computes the same step
    assert f"wrote {out}" in printed


def test_a_gpu_report_says_what_did_not_run(tmp_path, capsys, monkeypatch):
    """A fit that ran out of memory at every batch printed figures of 0 s/step and 0 tok/s; an FSDP2 run that failed
    stopped the report with a KeyError; a part that fails, or is not measured, keeps the earlier report's figures of
    it (a later run replaced the report whole)."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(benchmark, "gpu_fit", lambda cfg: {"plain": {"fsdp": False, "out_of_memory": [16, 8]},
                                                           "fsdp": {"error": "torchrun failed"}})
    out = tmp_path / "gpu.json"
    benchmark.main(["gpu", "--device", "cpu", "--parts", "fit", "--fit-config", "tiny", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "tiny plain: out of memory at every batch ([16, 8])" in printed and "0 tok/s" not in printed
    assert "tiny fsdp: failed (torchrun failed)" in printed
    fit = json.loads(out.read_text())["fit"]

    def fails(cfg):
        raise SystemExit("the GPU was taken back")
    monkeypatch.setattr(benchmark, "gpu_fit", fails)
    benchmark.main(["gpu", "--device", "cpu", "--parts", "fit", "--fit-config", "tiny", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["fit"] == fit and report["errors"] == {"fit": "SystemExit: the GPU was taken back"}
    assert "(failed: fit)" in capsys.readouterr().out
    monkeypatch.setattr(benchmark, "gpu_step", lambda cfg: {"rows": [], "out_of_memory": [2]})
    benchmark.main(["gpu", "--device", "cpu", "--parts", "step", "--fit-config", "tiny", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["fit"] == fit and report["step"]["out_of_memory"] == [2] and report["errors"] == {}


@pytest.mark.subprocess
def test_loader_command_streams_the_corpus_it_is_given():
    out = subprocess.run([sys.executable, "benchmark.py", "loader", "--seconds", "2", "--batch-size", "4"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout  # --data sample_data
    assert f"sample_data: {len(list((REPO / 'sample_data').glob('*.txt')))} languages" in out
    assert "tokens/s" in out and "workers" in out


def test_bad_settings_are_refused(tmp_path, capsys, monkeypatch):
    """Each refused as `python benchmark.py ...` refuses it (run_script around main), in this process: one line,
    exit code 2."""
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # (run_script sets it for the process)
    notes = tmp_path / "mine" / "notes.txt"  # a user's file, which the report would have replaced
    notes.parent.mkdir()
    notes.write_text("my notes\n")
    (tmp_path / "empty").mkdir()
    for command, message in ((["loader", "--data", str(tmp_path / "empty")], "no *.txt files in this directory"),
                             (["loader", "--data", ""], "--data must be given"),
                             (["loader", "--batch-size", "0"], "--batch-size must be a positive number, got 0"),
                             (["loader", "--seconds", "inf"], "--seconds must be a positive number, got inf"),
                             (["model", "--config", "tiny", "--threads", "0"], "--threads must be in [1, "),
                             (["model", "--config", "tiny", "--threads", str(os.cpu_count() + 1)],
                              f"--threads must be in [1, {os.cpu_count()}], this machine's cores"),
                             (["model", "--config", "tiny", "--seq-len", "16", "--predictions", "15"],
                              "--predictions must be at most --seq-len - 2 (14)"),
                             (["model", "--config", "tiny", "--seq-len", "1000"], "--seq-len must be at most 512 for tiny"),
                             (["fit", "--device", "cpu", "--config", "tiny", "--batch-sizes", "2", "0"],
                              "--batch-sizes must be a positive number, got [2, 0]"),
                             (["gpu", "--device", "cpu", "--fit-config", "tiny", "--seq-len", "600"],
                              "--seq-len must be at most 512 for ein128-eout768"),
                             (["gpu", "--device", "cpu", "--parts", "step", "preset", "--data", str(tmp_path / "no")],
                              f"--data {tmp_path / 'no'} has no such directory"),  # (before the step is timed)
                             (["gpu", "--device", "cpu", "--parts", "fit", "--out", str(notes)],
                              f"--out {notes} exists and is no report of this command: not written over"),
                             (["gpu", "--device", "cpu", "--parts", "fit", "--out", str(tmp_path / "no" / "r.json")],
                              "no such directory"),  # (found after the first part: its figures were lost)
                             (["gpu", "--device", "cpu", "--parts", "step", "--config", "extra-layers-11"],
                              "transformers' RemBERT has no pre-training-only layers")):  # (was a failed part, exit 0)
        with pytest.raises(SystemExit) as exit:
            run_script(lambda: benchmark.main(command))
        err = capsys.readouterr().err
        assert exit.value.code == 2 and err.count("\n") == 1 and message in err, err
    assert notes.read_text() == "my notes\n"
    earlier = tmp_path / "mine" / "gpu.json"  # a report of an earlier run: replaced by the new one
    earlier.write_text(json.dumps({"date": "2026-01-01", "device": "cpu", "settings": {}}))
    assert benchmark.GPUBenchmark(device="cpu", parts=["fit"], out=str(earlier)).out == str(earlier)
    with pytest.raises(ValueError, match="--phases must be one of pretrain, finetune, infer, got 'pretrain'"):
        benchmark.ModelBenchmark(config="tiny", phases="pretrain")  # a str, not a list of phases


def test_a_gpu_gets_its_own_data_sheet_peak_or_none():
    """By name, the most specific entry first: no L40S read as an L4, no H100 PCIe as an SXM H100."""
    names = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12,
             "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA L40S": 362e12, "NVIDIA L4": 121e12, "NVIDIA A10": 125e12,
             "NVIDIA A10G": None, "NVIDIA GeForce RTX 4090": None, "Tesla V100-SXM2-16GB": None}
    assert {name: benchmark.gpu_peak(name) for name in names} == names
