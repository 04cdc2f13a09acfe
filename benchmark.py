"""How fast is this RemBERT, against transformers' and against the machine?

`model` times the three steps a user pays for, each against transformers' RemBERT built from the same
config and the same weights (exported with `checkpoints.save_hf`, loaded with `from_pretrained`):
  pretrain  masked-LM step (forward, backward, AdamW): ours runs the MLM head (Section 5's E_out ->
            vocabulary matrix, the largest of the model) at the masked positions only, transformers' at
            every position, ignoring the unmasked ones (labels -100);
  finetune  sentence-classification step: SequenceClassifier vs RemBertForSequenceClassification;
  infer     the encoder's forward without gradients: Encoder vs RemBertModel.
Before timing, both sides compute the loss of one batch and must agree. Steps alternate (ours, theirs,
ours, ...), so that a noisy machine slows both alike; the table shows the median ratio and its spread.
MFU is the model's FLOPs per second (`step_flops`: 6 N + 12 L T H per token, the head at the masked
positions) over the machine's peak: on CPU the best float32 2048x2048 matmul of this run, on CUDA the
device's dense bf16 peak. transformers' RemBERT has only eager attention, so that is what it runs.

`fit` runs pretrain.py's own step (its model, optimizer, train_step and, with --fsdp, FSDP2) at the first
batch that fits the device; `gpu` runs docs/performance.md's GPU measurements of the pre-training step, of `fit`
and of reproduce.py's gpu preset in one process tree (fine-tuning and inference: `model --phases`) and writes them
to one JSON file (test_benchmark.py tries it on CPU, with tiny --config and batch flags).

  python benchmark.py model --config ein128-eout768 --batch-size 8 --phases pretrain  # base-like, CPU
  python benchmark.py model --config ein128-eout768 --device cuda --batch-size 256 --steps 20 --compile
  python benchmark.py loader --data data/corpus --seconds 120 --num-workers 1
  torchrun --standalone --nproc-per-node 1 benchmark.py fit --config rembert --device cuda --fsdp
  python benchmark.py gpu --out gpu.json
"""

import contextlib
import copy
import gc
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from configs import (CONFIGS, GIVEN, POSITIVE, at_least, check_flags, flag, one_of, parse_command_line, resolve_device,
                     run_script)
from checkpoints import DataError, read_json, save_hf, write_json
from model import Encoder, MaskedLM, SequenceClassifier

REPO = Path(__file__).resolve().parent
PHASES = ("pretrain", "finetune", "infer")
NUM_LABELS = 3  # XNLI's
CPU_OR_CUDA = (lambda v: v in ("cpu", "cuda") and resolve_device(v), "cpu or cuda")  # resolve_device says why not
# Dense (no sparsity) bf16 tensor-core peak from the vendors' data sheets, by the first word(s) of this order
# in the device's name ("NVIDIA H100 PCIe" is not an SXM H100, "NVIDIA L40S" not an L4, "A10G" not an A10).
GPU_BF16_PEAK = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200 NVL": 835e12, "H200": 989e12,
                 "A100": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10": 125e12}


def gpu_peak(device_name):
    """The data-sheet peak of a GPU of this name, or None for one not in GPU_BF16_PEAK (then no MFU)."""
    return next((v for k, v in GPU_BF16_PEAK.items() if re.search(rf"\b{k}\b", device_name)), None)


def step_flops(config, seq_len, predictions, phase):
    """Matmul FLOPs of one step per input token (a multiply-add is 2; backward is twice the forward).
    Every token passes the E_in -> H projection and every layer (the pre-training-only ones when
    pre-training): 4 H x H matrices (q, k, v, out), 2 H x I (feed-forward), and attention's q.k^T and
    probs.v, 2 T H multiply-adds per token. The MLM head (H -> E_out -> vocabulary) runs at the
    `predictions` masked positions of the `seq_len`, the classifier's pooler and output layer at [CLS].
    Embedding lookups are free."""
    H, I, T = config.hidden_size, config.intermediate_size, seq_len
    layers = config.num_layers + (config.pretraining_only_layers if phase == "pretrain" else 0)
    forward = 2 * config.input_embedding_size * H * (config.input_embedding_size != H)
    forward += layers * (2 * (4 * H * H + 2 * H * I) + 2 * 2 * T * H)
    if phase == "pretrain":
        E = config.output_embedding_size
        forward += predictions / T * 2 * (H * E + E * config.vocab_size)
    elif phase == "finetune":
        forward += 2 * (H * H + H * NUM_LABELS) / T
    return forward * (1 if phase == "infer" else 3)


def cpu_matmul_peak(size=2048, repeats=10):
    """The best FLOP/s of a float32 size x size matmul on this process's threads: the roof for MFU."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = math.inf
    for _ in range(repeats + 3):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def make_batch(config, batch_size, seq_len, predictions, generator):
    """A masked-LM batch as data.MLMLoader makes it (round(15%) of the positions, never [CLS]/[SEP], padded
    to `predictions` slots with weight 0), transformers' form of the same targets (-100 elsewhere), and
    class labels."""
    B, T, P = batch_size, seq_len, predictions
    masked = min(P, max(1, round(0.15 * T)))
    input_ids = torch.randint(5, config.vocab_size, (B, T), generator=generator)
    positions = torch.zeros(B, P, dtype=torch.long)
    weights = (torch.arange(P) < masked).float().repeat(B, 1)
    for b in range(B):
        positions[b, :masked] = (torch.randperm(T - 2, generator=generator)[:masked] + 1).sort().values
    masked_ids = torch.gather(input_ids, 1, positions) * weights.long()
    input_ids.scatter_(1, positions[:, :masked], 4)  # 4: a [MASK] id
    labels = torch.full((B, T), -100).scatter(1, positions[:, :masked], masked_ids[:, :masked])
    return {"input_ids": input_ids, "token_type_ids": torch.zeros(B, T, dtype=torch.long),
            "attention_mask": torch.ones(B, T, dtype=torch.long), "masked_positions": positions,
            "masked_ids": masked_ids, "masked_weights": weights, "mlm_labels": labels,
            "class_labels": torch.randint(0, NUM_LABELS, (B,), generator=generator)}


def build(phase, side, config, weights_dir):
    """Our model of the phase (saved to weights_dir), or transformers' loaded from there."""
    if side == "ours":
        model = {"pretrain": MaskedLM, "finetune": lambda c: SequenceClassifier(Encoder(c), NUM_LABELS),
                 "infer": Encoder}[phase](config)
        if phase == "pretrain":
            model.encoder.pooler.requires_grad_(False)  # no NSP: as pretrain.py
        if weights_dir:
            save_hf(model, weights_dir)
        return model
    import transformers
    transformers.logging.set_verbosity_error()  # no report on the pooler RemBertForMaskedLM lacks
    transformers.logging.disable_progress_bar()
    cls = {"pretrain": transformers.RemBertForMaskedLM, "finetune": transformers.RemBertForSequenceClassification,
           "infer": transformers.RemBertModel}[phase]
    return cls.from_pretrained(weights_dir, attn_implementation="eager", dtype=torch.float32)


def loss(phase, side, model, batch):
    """The phase's loss (for inference: the last hidden states) from one side."""
    inputs = {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
    if side == "ours":
        if phase == "pretrain":
            return model(**inputs, masked_positions=batch["masked_positions"], masked_ids=batch["masked_ids"],
                         masked_weights=batch["masked_weights"])[1]
        return model(**inputs, labels=batch["class_labels"])[1] if phase == "finetune" else model(**inputs)
    if phase == "infer":
        return model(**inputs).last_hidden_state
    return model(**inputs, labels=batch["mlm_labels" if phase == "pretrain" else "class_labels"]).loss


@contextlib.contextmanager
def marked(side):
    """An out-of-memory error inside says which side ran out (in its notes)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        e.add_note(side)
        raise


class Runner:
    """One side's model and its step: forward, backward and fused AdamW, or for inference a no-grad forward."""

    def __init__(self, phase, side, model, batch, device, compile):
        self.phase, self.side, self.device = phase, side, device
        with marked(side):
            self.model = model.to(device)
        self.step_model = torch.compile(self.model) if compile else self.model
        self.batch = {k: v.to(device) for k, v in batch.items()}
        if phase != "infer":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    def step(self):
        start = time.perf_counter()
        self.model.train(self.phase != "infer")
        with (marked(self.side), torch.autocast("cuda", torch.bfloat16, enabled=self.device.type == "cuda"),
              torch.inference_mode(self.phase == "infer")):
            result = loss(self.phase, self.side, self.step_model, self.batch)
        if self.phase != "infer":  # backward and the optimizer outside autocast, as a training loop has them
            with marked(self.side):
                result.backward()
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def check(self):
        self.model.eval()
        with marked(self.side), torch.no_grad():
            return loss(self.phase, self.side, self.model, self.batch).float().cpu()


@dataclass
class ModelBenchmark:
    """a training or inference step of ours against transformers' RemBERT, and MFU"""
    config: str = flag("small", f"a configs.py model: {', '.join(CONFIGS)}", one_of(CONFIGS))
    phases: list[str] = flag(list(PHASES), "steps to time", one_of(PHASES))
    batch_size: int = flag(16, "sequences per step", POSITIVE)
    seq_len: int = flag(128, "tokens per sequence", at_least(3))
    predictions: int = flag(20, "masked-LM slots per sequence (round(15%) of them real)", POSITIVE)
    steps: int = flag(7, "timed steps per side (interleaved)", POSITIVE)
    warmup: int = flag(2, "untimed steps per side first (optimizer state, compiling)", POSITIVE)
    device: str = flag("cpu", "cpu | cuda (bf16 autocast)", CPU_OR_CUDA)
    threads: int = flag(min(2, os.cpu_count()), "torch.set_num_threads on CPU",
                        (lambda v: 0 < v <= os.cpu_count(), f"in [1, {os.cpu_count()}], this machine's cores"))
    compile: bool = flag(False, "torch.compile both sides")

    def __post_init__(self):
        check_flags(self)
        if CONFIGS[self.config].pretraining_only_layers:
            raise ValueError(f"--config {self.config}: transformers' RemBERT has no pre-training-only layers")
        check_lengths(self.config, self.seq_len, self.predictions)


def compare(cfg, phase, config, batch, device, our_model, their_model):
    """One phase of ours against transformers (the same weights) on `batch`, interleaved: its row of the table and
    our Runner (for a profile)."""
    tokens = cfg.batch_size * cfg.seq_len
    predicted = batch["masked_weights"][0].sum().item()  # per sequence: MFU counts no padding slot as work
    ours = Runner(phase, "ours", our_model, batch, device, cfg.compile)
    theirs = Runner(phase, "hf", their_model, batch, device, cfg.compile)
    difference = (ours.check() - theirs.check()).abs().max().item()
    if difference > (1e-4 if device.type == "cpu" else 5e-2):
        raise SystemExit(f"{phase}: ours and transformers disagree on the same batch (max |diff| {difference:.2e})")
    memory = {}  # on a GPU: the memory each side adds while it warms up
    for runner in (ours, theirs):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        for _ in range(cfg.warmup):
            runner.step()
        if device.type == "cuda":
            memory[runner.side] = torch.cuda.max_memory_allocated(device) - before
    times = [(ours.step(), theirs.step()) for _ in range(cfg.steps)]  # interleaved
    del theirs
    ratios = sorted(t / o for o, t in times)
    speeds = {side: tokens / statistics.median(t[i] for t in times) for i, side in enumerate(("ours", "hf"))}
    row = {"phase": phase, "config": cfg.config, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
           "compiled": cfg.compile, "ratio": statistics.median(ratios), "spread": [ratios[0], ratios[-1]],
           "model_flops_per_s": step_flops(config, cfg.seq_len, predicted, phase) * speeds["ours"],
           "tokens_per_s": speeds,
           "output_check_max_diff": difference, "gpu_memory_bytes": memory}
    return row, ours


def peak_flops(device, cpu_peaks=()):
    """(FLOP/s, where it comes from) for MFU: the best CPU matmul measured, or a GPU's data sheet (None if unknown)."""
    if device.type == "cpu":
        return max(cpu_peaks), f"best fp32 2048^3 matmul of {[round(p / 1e9) for p in cpu_peaks]} GFLOP/s"
    return gpu_peak(torch.cuda.get_device_name()), f"{torch.cuda.get_device_name()}'s bf16 data sheet"


def add_mfu(figures, peak):
    """MFU: the model's FLOP/s over the peak (None without one)."""
    figures["mfu"] = figures["model_flops_per_s"] / peak if peak else None


def print_rows(rows, peak, source):
    """The table of `compare` rows (with their MFU), then each row as JSON."""
    print(f"peak: {peak / 1e9:.0f} GFLOP/s ({source})" if peak else f"peak: {source} has no entry, so no MFU")
    print(f"{'phase':<9} {'batch':>9} {'mode':>8} {'ours tok/s':>10} {'HF tok/s':>9} {'ours/HF':>8} "
          f"{'[min, max]':>13} {'ours MFU':>8} {'GPU GiB ours/HF':>15}")
    for r in rows:
        shown = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        gpu = "/".join(f"{b / 2**30:.1f}" for b in r["gpu_memory_bytes"].values()) or "-"
        print(f"{r['phase']:<9} {r['batch_size']:>4}x{r['seq_len']:<4} {'compiled' if r['compiled'] else 'eager':>8} "
              f"{r['tokens_per_s']['ours']:>10.0f} {r['tokens_per_s']['hf']:>9.0f} {r['ratio']:>7.2f}x "
              f"[{r['spread'][0]:.2f}, {r['spread'][1]:.2f}] {shown:>8} {gpu:>15}")
        print(json.dumps(r))


def bench_model(cfg):
    config, device = CONFIGS[cfg.config], torch.device(cfg.device)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    batch = make_batch(config, cfg.batch_size, cfg.seq_len, cfg.predictions, torch.Generator().manual_seed(0))
    peaks = [cpu_matmul_peak()] if device.type == "cpu" else []
    print(f"# {json.dumps(vars(cfg))}, torch {torch.__version__}")
    rows = []
    for phase in cfg.phases:
        with tempfile.TemporaryDirectory() as weights:
            models = build(phase, "ours", config, weights), build(phase, "hf", config, weights)
        rows.append(compare(cfg, phase, config, batch, device, *models)[0])
        del models
        if device.type == "cpu":
            peaks.append(cpu_matmul_peak())  # a busy machine lowers the peak: keep the best
    peak, source = peak_flops(device, peaks)
    for row in rows:
        add_mfu(row, peak)
    print_rows(rows, peak, source)


@dataclass
class LoaderBenchmark:
    """data.MLMLoader's tokens/s and memory, streaming a corpus as pre-training does"""
    data: str = flag("sample_data", "a text file or a directory of *.txt files, as pretrain.py's --data", GIVEN)
    tokenizer: str = flag("", "SentencePiece model (default: trained on --data, as pretrain.py's default config)")
    num_workers: int = flag(1, "DataLoader workers", at_least(0))
    batch_size: int = flag(32, "sequences per batch", POSITIVE)
    seq_len: int = flag(128, "tokens per sequence", at_least(3))
    seconds: float = flag(60.0, "how long to stream, after 5 batches", POSITIVE)

    __post_init__ = check_flags


def _rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def bench_loader(cfg):
    from data import MLMLoader, Tokenizer, train_tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Tokenizer(cfg.tokenizer or train_tokenizer(cfg.data, CONFIGS["tiny"].vocab_size, f"{tmp}/spm"))
    started = time.time()
    loader = MLMLoader(cfg.data, tokenizer, batch_size=cfg.batch_size, seq_len=cfg.seq_len, num_workers=cfg.num_workers)
    print(f"{cfg.data}: {len(loader.probabilities)} languages; line counts ready in {time.time() - started:.1f} s")
    children = lambda: [int(c) for p in glob.glob(f"/proc/{os.getpid()}/task/*/children")
                        for c in open(p).read().split()]
    last = 0.0
    for batches, _ in enumerate(loader, 1):
        if batches == 5:  # the workers' start is not throughput
            started = time.time()
        elapsed = time.time() - started
        if batches > 5 and (elapsed - last >= 10 or elapsed >= cfg.seconds):
            last = elapsed
            rate = (batches - 5) * cfg.batch_size * cfg.seq_len / elapsed
            print(f"{elapsed:6.0f} s | {rate:9,.0f} tokens/s | RSS main {_rss_mb(os.getpid()):5.0f} MB, "
                  f"workers {sum(_rss_mb(c) for c in children()):5.0f} MB", flush=True)
            if elapsed >= cfg.seconds:
                break


@dataclass
class FitBenchmark:
    """which batch of a config's pre-training step fits one device (pretrain.py's step): peak memory, time, losses"""
    config: str = flag("rembert", f"a configs.py model: {', '.join(CONFIGS)}", one_of(CONFIGS))
    device: str = flag("cuda", "cpu | cuda (bf16 autocast)", CPU_OR_CUDA)
    fsdp: bool = flag(False, "FSDP2 as pretrain.py --fsdp shards it (under torchrun --nproc-per-node 1)")
    seq_len: int = flag(512, "tokens per sequence", at_least(3))
    predictions: int = flag(80, "masked-LM slots per sequence (round(15%) of them real)", POSITIVE)
    batch_sizes: list[int] = flag([16, 8, 4], "sequences per step, tried in this order: the first that fits is run",
                                  POSITIVE)
    steps: int = flag(4, "optimizer steps on one batch (the first is not timed)", at_least(2))

    def __post_init__(self):
        check_flags(self)
        check_lengths(self.config, self.seq_len, self.predictions)


def check_lengths(config, seq_len, predictions):
    """The flags' refusal of masked-LM slots that do not fit a sequence, or a sequence longer than the config's."""
    if predictions > seq_len - 2:  # as many as the positions between [CLS] and [SEP]
        raise ValueError(f"--predictions must be at most --seq-len - 2 ({seq_len - 2})")
    if seq_len > CONFIGS[config].max_position_embeddings:
        raise ValueError(f"--seq-len must be at most {CONFIGS[config].max_position_embeddings} for {config}")


def fit_steps(cfg, runtime, batch_size):
    """pretrain.py's model, optimizer and train_step on one batch, `cfg.steps` times: the losses, the median time of
    the steps after the first, and the peak memory since the model was built."""
    from pretrain import build_optimizer, train_step
    config, device = CONFIGS[cfg.config], runtime.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    with device:  # (initialised where it runs: RemBERT's 995M parameters take a minute on 2 CPU cores)
        raw_model = MaskedLM(config)
    raw_model.tie_weights()  # then as pretrain.train builds it
    raw_model.encoder.pooler.requires_grad_(False)
    model = runtime.wrap_model(raw_model)
    optimizer = build_optimizer(raw_model, lr=1e-4, weight_decay=0.01)
    batch = make_batch(config, batch_size, cfg.seq_len, cfg.predictions, torch.Generator().manual_seed(0))
    batch = {k: batch[k].to(device) for k in ("input_ids", "token_type_ids", "attention_mask", "masked_positions",
                                              "masked_ids", "masked_weights")}
    stats, losses, times = torch.zeros(3, device=device), [], []
    model.train()
    for _ in range(cfg.steps):
        start = time.perf_counter()
        train_step(model, optimizer, runtime, [batch], 1.0, stats)
        loss_sum, _, count = stats.tolist()  # (waits for the step)
        times.append(time.perf_counter() - start)
        losses.append(loss_sum / count)
        stats.zero_()
    seconds = statistics.median(times[1:])
    flops = step_flops(config, cfg.seq_len, batch["masked_weights"][0].sum().item(), "pretrain")
    return {"batch_size": batch_size, "losses": losses, "step_seconds": seconds,
            "tokens_per_s": batch_size * cfg.seq_len / seconds,
            "model_flops_per_s": flops * batch_size * cfg.seq_len / seconds,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def bench_fit(cfg):
    from runtime import setup_runtime
    runtime = setup_runtime(cfg.device, cfg.fsdp)
    result = {"config": cfg.config, "fsdp": cfg.fsdp, "seq_len": cfg.seq_len, "out_of_memory": [],
              "rank": runtime.rank, "processes": runtime.world_size}  # (under torchrun: a line per process, device)
    for batch_size in cfg.batch_sizes:
        try:
            result |= fit_steps(cfg, runtime, batch_size)
            break
        except torch.OutOfMemoryError:
            result["out_of_memory"].append(batch_size)
        free_memory()  # (what the failed try held is garbage once its traceback is gone)
    print(json.dumps(result))


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


GPU_PARTS = ("step", "fit", "preset")


@dataclass
class GPUBenchmark:
    """docs/performance.md's GPU figures but fine-tuning's and inference's, in one run, into one JSON file: the
    base-size pre-training step against transformers' (eager and compiled, with a profile), RemBERT's step with and
    without FSDP2, and one model of reproduce.py's gpu preset, pre-trained and fine-tuned"""
    device: str = flag("cuda", "cuda; cpu to try the command (with a tiny --config and small batches)", CPU_OR_CUDA)
    parts: list[str] = flag(list(GPU_PARTS), "what to measure", one_of(GPU_PARTS))
    config: str = flag("ein128-eout768", "the step's model (base size)", one_of(CONFIGS))
    batch_sizes: list[int] = flag([128, 64, 32], "the step's batches, tried in this order: the first at which both "
                                                 "sides fit is timed", POSITIVE)
    steps: int = flag(10, "timed steps per side", POSITIVE)
    compile: bool = flag(True, "the step compiled too (torch.compile, both sides)")
    seq_len: int = flag(512, "tokens per sequence (step and fit)", at_least(3))
    predictions: int = flag(80, "masked-LM slots per sequence (round(15%) of them real)", POSITIVE)
    fit_config: str = flag("rembert", "the model of `fit`", one_of(CONFIGS))
    fit_batch_sizes: list[int] = flag([16, 8, 4], "fit's batches, tried in this order", POSITIVE)
    quick: bool = flag(False, "the preset part runs reproduce.py's quick preset (to try the command)")
    data: str = flag("data/corpus", "reproduce.py's --data", GIVEN)
    panx: str = flag("data/panx", "reproduce.py's --panx", GIVEN)
    xquad: str = flag("data/xquad", "reproduce.py's --xquad", GIVEN)
    out: str = flag("gpu.json", "the JSON file of every figure, written after each part; an earlier report of this "
                                "device and these settings keeps the parts not measured anew", GIVEN)

    def __post_init__(self):
        check_flags(self)
        for config in (self.config, self.fit_config):
            check_lengths(config, self.seq_len, self.predictions)
        if "step" in self.parts and CONFIGS[self.config].pretraining_only_layers:  # (model's own check, up front)
            raise ValueError(f"--config {self.config}: transformers' RemBERT has no pre-training-only layers")
        if not os.path.isdir(os.path.dirname(os.path.abspath(self.out))):  # (found after a part: its figures lost)
            raise ValueError(f"--out {self.out}: no such directory")
        if os.path.lexists(self.out) and not is_report(self.out):  # (a report of an earlier run is written over)
            raise ValueError(f"--out {self.out} exists and is no report of this command: not written over; remove it "
                             f"or choose another")
        if "preset" in self.parts:  # reproduce.py's own checks of its files, before the GPU minutes are spent
            import reproduce
            reproduce.ReproduceConfig(data=self.data, panx=self.panx, xquad=self.xquad, device=self.device,
                                      quick=self.quick)


def setting(settings):
    """What makes two `gpu` runs comparable: their settings but the parts measured and the file written."""
    return {k: v for k, v in settings.items() if k not in ("parts", "out")}


def is_report(path):
    """Whether `path` is a JSON report that `benchmark.py gpu` wrote."""
    try:
        report = read_json(path) if os.path.getsize(path) < 1 << 24 else None  # (a report is kilobytes: not read)
    except (DataError, OSError):  # (not JSON, not UTF-8, a FIFO, a folder, a dangling link...)
        return False
    return isinstance(report, dict) and {"date", "device", "settings"} <= report.keys()


def gpu_step(cfg):
    """The step against transformers at the first batch both fit, eager then compiled, and a profile of ours."""
    config, device, figures = CONFIGS[cfg.config], torch.device(cfg.device), {"out_of_memory": [], "rows": []}
    run = ModelBenchmark(config=cfg.config, phases=["pretrain"], seq_len=cfg.seq_len, predictions=cfg.predictions,
                         steps=cfg.steps, device=cfg.device)
    with tempfile.TemporaryDirectory() as weights:
        our_model = build("pretrain", "ours", config, weights)  # every try starts from these weights, on both sides

        def try_step(run, batch):  # -> our Runner, the row added; or None (out of memory: which side, noted)
            try:
                row, ours = compare(run, "pretrain", config, batch, device, copy.deepcopy(our_model),
                                    build("pretrain", "hf", config, weights))
                figures["rows"].append(row)
                return ours
            except torch.OutOfMemoryError as e:
                figures["out_of_memory"].append({"batch_size": run.batch_size, "compiled": run.compile,
                                                 "side": (getattr(e, "__notes__", None) or ["?"])[0]})
            free_memory()  # (what the failed try held is garbage once its traceback is gone)

        for batch_size in cfg.batch_sizes:
            run = replace(run, batch_size=batch_size)
            batch = make_batch(config, batch_size, cfg.seq_len, cfg.predictions, torch.Generator().manual_seed(0))
            if ours := try_step(run, batch):
                break
        else:
            return figures
        if cfg.compile:
            ours = None
            free_memory()
            try:
                ours = try_step(replace(run, compile=True), batch)
            except Exception as e:  # (the eager figures stand)
                figures["compile_error"] = f"{type(e).__name__}: {e}"
    if ours:
        try:  # (the compiled step, if it ran; the rows stand if the profiler fails)
            figures["profile"] = profile(ours, device)
        except Exception as e:
            figures["profile_error"] = f"{type(e).__name__}: {e}"
    return figures


def profile(runner, device, steps=3):
    """The five kernels (CPU: operators) that take most of `steps` steps' time, with their share of it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    cuda = device.type == "cuda"
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.step()
    kernels = [(e.key, e.self_device_time_total if cuda else e.self_cpu_time_total) for e in prof.key_averages()
               if e.device_type == (DeviceType.CUDA if cuda else DeviceType.CPU)]
    total = sum(t for _, t in kernels)
    top = sorted(kernels, key=lambda k: -k[1])[:5]
    return {"ms_per_step": total / steps / 1e3,
            "top": [{"kernel": name, "share": t / total, "ms_per_step": t / steps / 1e3} for name, t in top]}


def run_json(command):
    """The last JSON line a command prints (gloo may abort a process after it has finished: its output counts)."""
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{' '.join(command)} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def gpu_fit(cfg):
    """fit's figures without and with FSDP2 (torchrun, one process), and how far apart their losses are."""
    command = ["benchmark.py", "fit", "--config", cfg.fit_config, "--device", cfg.device, "--seq-len",
               str(cfg.seq_len), "--predictions", str(cfg.predictions), "--batch-sizes", *map(str, cfg.fit_batch_sizes)]
    plain = run_json([sys.executable, *command])
    try:  # (the plain figures stand if FSDP2 fails)
        fsdp = run_json([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                         *command, "--fsdp"])
    except SystemExit as e:
        fsdp = {"error": str(e)}
    figures = {"plain": plain, "fsdp": fsdp}
    if plain.get("batch_size") is not None and plain.get("batch_size") == fsdp.get("batch_size"):
        losses = [*plain["losses"], *fsdp["losses"]]
        figures["losses_finite"] = all(map(math.isfinite, losses))
        if figures["losses_finite"]:  # FSDP2 computes with bf16 weights, the plain step with fp32 ones under autocast
            difference = max(abs(a - b) / abs(a) for a, b in zip(plain["losses"], fsdp["losses"]))
            figures["loss_relative_difference"] = difference
            figures["equal_to_bf16_rounding"] = difference <= 2 ** -7  # two of bf16's 8-bit-mantissa steps
    return figures


def gpu_preset(cfg):
    """reproduce.py run on one model of its preset (the largest E_out, seed 0), timed, and the whole preset's time
    estimated from it: the set-up and baselines once, then every pre-trained model's run as long as this one's (the
    one with pre-training-only layers is deeper: an estimate), and the random encoder's fine-tuning."""
    import reproduce
    preset = reproduce.ReproduceConfig(data=cfg.data, panx=cfg.panx, xquad=cfg.xquad, device=cfg.device,
                                       quick=cfg.quick).preset()
    p = reproduce.PRESETS[preset]
    name = f"E_out {4 * p['hidden']}"
    with tempfile.TemporaryDirectory() as out:
        started = time.time()
        data, panx, xquad = (os.path.abspath(p) for p in (cfg.data, cfg.panx, cfg.xquad))  # (it runs in REPO)
        done = subprocess.run([sys.executable, "reproduce.py", "--device", cfg.device, "--models", name, "--seeds", "1",
                               "--out-dir", out, "--data", data, "--panx", panx, "--xquad", xquad,
                               *["--quick"] * cfg.quick], cwd=REPO, capture_output=True, text=True)
        seconds = time.time() - started
        if done.returncode:
            raise SystemExit(f"reproduce.py failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        with open(os.path.join(out, "results.json")) as f:
            run = json.load(f)["results"][name]["0"]
    job = sum(run["seconds"].values())
    pretrained = len(reproduce.models(SimpleNamespace(**p))) * p["seeds"]
    estimate = seconds - job + pretrained * job + p["seeds"] * run["seconds"]["finetune"]
    return {"preset": preset, "model": name, "seconds": seconds, "run_seconds": run["seconds"],
            "whole_preset_seconds_estimated": estimate, "heldout_accuracy": run["curve"][-1][2],
            "panx_zero_shot_f1": run["panx"]["zero_shot"]}


def bench_gpu(cfg):
    device = torch.device(cfg.device)
    import torch._dynamo as dynamo
    import transformers
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device.type == "cuda" else
              "cpu", "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
              "settings": vars(cfg)}
    peak, source = peak_flops(device, [cpu_matmul_peak()] if device.type == "cpu" else [])
    report["peak_flops"], report["peak_source"] = peak, source
    print(f"# {report['device']}, torch {report['torch']} (CUDA {report['cuda']}), transformers "
          f"{report['transformers']}", flush=True)
    # An earlier report of this device and these settings keeps the parts this run does not measure anew (nor
    # measures, failing): a run of one part, or one cut short, loses no figure. Another one is replaced, as said.
    earlier = read_json(cfg.out) if os.path.lexists(cfg.out) else {}
    settings = earlier.get("settings")
    if earlier and earlier["device"] == report["device"] and isinstance(settings, dict) and (
            setting(settings) == setting(vars(cfg))):
        report |= {part: earlier[part] for part in GPU_PARTS  # (an older report kept a failure in its part)
                   if isinstance(earlier.get(part), dict) and "error" not in earlier[part]}
    elif earlier:
        print(f"# {cfg.out}: a report of {earlier['device']} of {earlier['date']} with other settings, replaced")
    report["errors"] = {}  # this run's parts that failed (their earlier figures, where there are some, are kept)
    for part in cfg.parts:
        started = time.time()
        try:  # (a part that fails is reported, and the next one runs: the GPU may be lent for minutes only)
            report[part] = {"step": gpu_step, "fit": gpu_fit, "preset": gpu_preset}[part](cfg)
            report[part] |= {"date": report["date"], "part_seconds": time.time() - started}
            for figures in [*report[part].get("rows", []), *(report[part].get(k, {}) for k in ("plain", "fsdp"))]:
                if "model_flops_per_s" in figures:
                    add_mfu(figures, peak)
        except (Exception, SystemExit) as e:
            report["errors"][part] = f"{type(e).__name__}: {e}"
            print(f"# {part} failed: {report['errors'][part]}", flush=True)
        dynamo.reset()  # the next part's processes get the GPU's memory, not this one's cache
        free_memory()
        write_json(cfg.out, report)
        print(f"# {part}: {time.time() - started:.0f} s", flush=True)
    failed = list(report["errors"])
    if "step" in report and "step" not in failed:
        print_rows(report["step"]["rows"], peak, source)
        for oom in report["step"]["out_of_memory"]:
            print(f"out of memory: {oom}")
        for k in report["step"].get("profile", {}).get("top", []):
            print(f"  {k['share']:6.1%} of the kernels' time, {k['ms_per_step']:8.2f} ms/step  {k['kernel'][:100]}")
    if "fit" in report and "fit" not in failed:
        for mode, r in report["fit"].items():
            if isinstance(r, dict) and ("error" in r or r.get("batch_size") is None):
                print(f"{cfg.fit_config} {mode}: " + (f"failed ({r['error']})" if "error" in r else
                                                      f"out of memory at every batch ({r.get('out_of_memory')})"))
            elif isinstance(r, dict):
                memory = f"{r['peak_memory_bytes'] / 2**30:.1f} GiB" if r.get("peak_memory_bytes") else "-"
                mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
                print(f"{cfg.fit_config} {mode}: batch {r.get('batch_size')} x {cfg.seq_len} (out of memory at "
                      f"{r['out_of_memory']}): {r.get('step_seconds', 0):.3f} s/step, {r.get('tokens_per_s', 0):,.0f} "
                      f"tok/s, MFU {mfu}, peak {memory}, losses "
                      f"{[round(x, 4) for x in r.get('losses', [])]}")
        print(f"losses finite: {report['fit'].get('losses_finite')}, relative difference "
              f"{report['fit'].get('loss_relative_difference')}")
    if "preset" in report and "preset" not in failed:
        r = report["preset"]
        print(f"reproduce.py {r['preset']} preset, {r['model']}: {r['seconds']:.0f} s in all, the run "
              f"{ {k: round(v) for k, v in r['run_seconds'].items()} } s; whole preset about "
              f"{r['whole_preset_seconds_estimated'] / 60:.1f} min")
    print(f"wrote {cfg.out}" + f" (failed: {', '.join(failed)})" * bool(failed))


def main(argv=None):
    commands = {"model": ModelBenchmark, "loader": LoaderBenchmark, "fit": FitBenchmark, "gpu": GPUBenchmark}
    command, cfg = parse_command_line(__doc__, commands, argv)
    {"model": bench_model, "loader": bench_loader, "fit": bench_fit, "gpu": bench_gpu}[command](cfg)


if __name__ == "__main__":
    run_script(main)
