"""How fast is this RemBERT, against transformers' and against the machine? (issue 6)

`model` times the three steps a user pays for, each against transformers' RemBERT built from the
same config and the SAME weights (exported with `model.save_hf`, loaded with `from_pretrained`):
  pretrain  masked-LM step (forward, backward, AdamW): ours runs the last layer's queries and
            feed-forward, and the output layer (Section 5's E_out -> vocab matrix, the largest of the
            model), at the masked positions only; HF's RemBertForMaskedLM computes both at every
            position and ignores the unmasked ones (labels = -100);
  finetune  sentence-classification step: SequenceClassifier (last layer at [CLS] only, the one
            position the pooler reads) vs RemBertForSequenceClassification;
  infer     encoder forward without gradients: Encoder vs RemBertModel (the same work).
Steps alternate ours/HF (A B A B ...), so the per-pair ratio survives a noisy machine; the table shows
the median ratio and its spread. Before timing, both sides compute the loss of one batch with
dropout off and must agree. MFU is model FLOP/s (`step_flops_per_token`: 6 N + 12 L T H per token,
with the work ours skips left out) over the machine's peak: on CPU the best of float32 2048x2048
matmuls timed before and after each phase, on CUDA the device's dense bf16 peak. On CPU, glibc is
told to keep freed memory (`keep_freed_memory`), for both sides. transformers' RemBERT has only
eager attention (no SDPA), so that is what it runs.

Commands (each prints a table and one JSON line per figure):
  python benchmark.py model --config small --batch-size 16 --seq-len 128            # CPU
  python benchmark.py model --config ein128-eout768 --batch-size 8 --seq-len 128     # base-like
  python benchmark.py model --config tiny --set num_layers=4 dropout=0.0 --phases pretrain
  python benchmark.py model --config ein128-eout768 --device cuda --batch-size 256 --steps 20 --warmup 5
                                                            # one GPU, bf16; add --compile for torch.compile
  python benchmark.py model --config small --batch-size 16 --phases finetune --profile 25   # where the time goes
(No torchrun or TPU variant: this measures one device.)

`loader` streams data.MLMLoader (one DataLoader worker, the tiny config's 8000-piece tokenizer trained on
sample_data/) over a generated multilingual corpus of --size-gb (default 1 GB, written once under
--corpus-dir in /tmp, never in the repository): tokens per second (non-padding pieces of the batches) and
the resident memory of the main process and the worker, sampled while streaming (it must stay flat);
then the ratio of that rate to what our pre-training step consumes, for the tiny and small configs.
  python benchmark.py loader --seconds 120
"""

import argparse
import ctypes
import json
import math
import multiprocessing
import platform
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import fields, replace

import torch
import torch.nn.functional as F

from configs import CONFIGS
from model import Encoder, MaskedLM, ModelConfig, SequenceClassifier, save_hf

PHASES = ("pretrain", "finetune", "infer")
NUM_LABELS = 3  # XNLI's
# Dense (no sparsity) bf16 tensor-core peak from the vendors' data sheets, by device-name substring.
GPU_BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


# ----------------------------------------------------------------------------------------------
# FLOPs, written out: a multiply-add is 2 FLOPs; backward costs twice the forward.

def forward_flops_per_token(config, seq_len, outputs_per_seq, phase):
    """Forward matmul FLOPs per input token, when the outputs are read at `outputs_per_seq` of the
    `seq_len` positions. Embeddings are lookups (no FLOPs). Every token passes the E_in -> H
    projection and the layers (pre-training-only ones included when pre-training); a layer is
    4 H x H matrices (q, k, v, out) + 2 H x I (feed-forward), and attention adds q.k^T and
    probs.v, 2 T H multiply-adds per query. The last layer computes keys and values everywhere but
    the rest only at the outputs (model.run_layers), where the head runs too: the MLM head
    (H -> E_out -> vocab) when pre-training, the pooler and classifier when fine-tuning."""
    H, I, T = config.hidden_size, config.intermediate_size, seq_len
    at_outputs = outputs_per_seq / T
    projection = 2 * config.input_embedding_size * H if config.input_embedding_size != H else 0
    keys_values = 2 * 2 * H * H
    rest_of_layer = 2 * (2 * H * H + 2 * H * I) + 2 * (2 * T * H)
    layers = config.num_layers + (config.pretraining_only_layers if phase == "pretrain" else 0)
    flops = projection + layers * keys_values + (layers - 1 + at_outputs) * rest_of_layer
    if phase == "pretrain":
        flops += at_outputs * 2 * (H * config.output_embedding_size + config.output_embedding_size * config.vocab_size)
    elif phase == "finetune":
        flops += at_outputs * 2 * (H * H + H * NUM_LABELS)
    return flops


def step_flops_per_token(config, seq_len, outputs_per_seq, phase):
    """Training: 6 N + 12 L T H per token (forward + 2x backward); inference: 2 N + 4 L T H."""
    return forward_flops_per_token(config, seq_len, outputs_per_seq, phase) * (1 if phase == "infer" else 3)


def cpu_matmul_peak(threads, size=2048, repeats=10):
    """The best FLOP/s of a float32 size x size matmul on `threads` threads: the roof for MFU."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    for _ in range(3):
        torch.mm(a, b, out=out)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def device_peak(device, threads):
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in GPU_BF16_PEAK.items() if k in name), None)
        if peak is None:
            raise ValueError(f"no bf16 peak known for {name!r}; add it to GPU_BF16_PEAK")
        return peak, f"{name} bf16 dense (data sheet)"
    return cpu_matmul_peak(threads), f"fp32 2048x2048 matmul, {threads} threads (measured)"


def keep_freed_memory():
    """Make glibc keep freed memory in the heap. By default it serves big blocks with mmap and
    unmaps them when freed, so every step page-faults its activations and gradients back in:
    a third of a base-sized CPU step on this machine (jemalloc/tcmalloc avoid it too)."""
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's malloc.h
    libc = ctypes.CDLL("libc.so.6")
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)):
        raise RuntimeError("glibc mallopt refused the settings")


# ----------------------------------------------------------------------------------------------
# One batch and one step per (phase, implementation)

def make_batch(config, batch_size, seq_len, predictions_per_seq, generator):
    """BERT-style masked-LM batch: round(15%) of the non-special positions masked, padded to
    `predictions_per_seq` slots with weight 0; plus HF's form of the same targets (-100 elsewhere)."""
    B, T, P = batch_size, seq_len, predictions_per_seq
    num_masked = min(P, max(1, round(0.15 * (T - 2))))
    input_ids = torch.randint(5, config.vocab_size, (B, T), generator=generator)
    positions = torch.zeros(B, P, dtype=torch.long)
    weights = torch.zeros(B, P)
    for b in range(B):  # positions 1 .. T-2: [CLS] and [SEP] are never masked
        positions[b, :num_masked] = (torch.randperm(T - 2, generator=generator)[:num_masked] + 1).sort().values
        weights[b, :num_masked] = 1.0
    masked_ids = torch.gather(input_ids, 1, positions) * weights.long()
    input_ids.scatter_(1, positions[:, :num_masked], 4)  # 4: a [MASK] id
    labels = torch.full((B, T), -100)
    labels.scatter_(1, positions[:, :num_masked], masked_ids[:, :num_masked])
    return {
        "input_ids": input_ids, "token_type_ids": torch.zeros(B, T, dtype=torch.long),
        "attention_mask": torch.ones(B, T, dtype=torch.long), "masked_positions": positions,
        "masked_ids": masked_ids, "masked_weights": weights, "mlm_labels": labels,
        "class_labels": torch.randint(0, NUM_LABELS, (B,), generator=generator),
    }


def loss_fn(phase, impl, model, batch):
    """The phase's loss (or, for inference, the encoder output) from one implementation."""
    inputs = {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
    if phase == "pretrain" and impl == "ours":
        return model(**inputs, masked_positions=batch["masked_positions"], masked_ids=batch["masked_ids"],
                     masked_weights=batch["masked_weights"])[1]
    if phase == "pretrain":
        return model(**inputs, labels=batch["mlm_labels"]).loss
    if phase == "finetune" and impl == "ours":
        return model(**inputs, labels=batch["class_labels"])[1]
    if phase == "finetune":
        return model(**inputs, labels=batch["class_labels"]).loss
    return model(**inputs) if impl == "ours" else model(**inputs).last_hidden_state


def hf_class(phase):
    from transformers import RemBertForMaskedLM, RemBertForSequenceClassification, RemBertModel
    return {"pretrain": RemBertForMaskedLM, "finetune": RemBertForSequenceClassification,
            "infer": RemBertModel}[phase]


def build_ours(phase, config):
    if phase == "pretrain":
        model = MaskedLM(config)
        model.encoder.pooler.requires_grad_(False)  # no NSP: the pooler gets no gradient (as in pretrain.py)
        return model
    if phase == "finetune":
        return SequenceClassifier(Encoder(config), NUM_LABELS)
    return Encoder(config)


def load_hf(phase, weights_dir):
    return hf_class(phase).from_pretrained(weights_dir, attn_implementation="eager", dtype=torch.float32)


class Runner:
    """A model with its step (forward, backward, AdamW) or, for inference, its no-grad forward."""

    def __init__(self, phase, impl, model, batch, device, adamw, compile=False):
        self.phase, self.impl, self.device = phase, impl, device
        self.model = model.to(device)
        # The step runs the compiled module; the plain one stays for save_hf and the output check.
        self.step_model = torch.compile(self.model) if compile else self.model
        self.batch = {k: v.to(device) for k, v in batch.items()}
        self.optimizer = None
        if phase != "infer":
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01,
                                               fused=adamw == "fused", foreach=adamw == "foreach")

    def autocast(self):
        return torch.autocast("cuda", torch.bfloat16, enabled=self.device.type == "cuda")

    def step(self):
        if self.phase == "infer":
            self.model.eval()
            with torch.inference_mode(), self.autocast():
                loss_fn(self.phase, self.impl, self.step_model, self.batch)
        else:
            self.model.train()
            with self.autocast():
                loss = loss_fn(self.phase, self.impl, self.step_model, self.batch)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed_step(self):
        start = time.perf_counter()
        self.step()
        return time.perf_counter() - start

    def check_output(self):
        self.model.eval()
        with torch.no_grad():
            return loss_fn(self.phase, self.impl, self.model, self.batch).float().cpu()


def profile(runner, rows, steps=3):
    """Where a step's time goes: torch.profiler's operators, most self time first."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            runner.step()
    key = "self_cuda_time_total" if runner.device.type == "cuda" else "self_cpu_time_total"
    print(f"\n# profile: {runner.phase} step, {runner.impl}, {steps} steps")
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def peak_rss_in_fresh_process(phase, impl, config, batch_size, seq_len, predictions_per_seq,
                              weights_dir, adamw, threads, keep_memory, compile, steps=2):
    """CPU peak memory of one side alone: a spawned process builds it, runs `steps` steps and
    returns its peak RSS and that of its start (Python + torch + transformers). VmHWM, not
    ru_maxrss: Linux carries ru_maxrss over from the parent across fork + exec."""
    torch.set_num_threads(threads)
    if keep_memory:
        keep_freed_memory()
    quiet_transformers()
    baseline = _peak_rss()
    batch = make_batch(config, batch_size, seq_len, predictions_per_seq, torch.Generator().manual_seed(0))
    model = build_ours(phase, config) if impl == "ours" else load_hf(phase, weights_dir)
    runner = Runner(phase, impl, model, batch, torch.device("cpu"), adamw, compile)
    for _ in range(steps):
        runner.step()
    return _peak_rss(), baseline


def _peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def quiet_transformers():
    import transformers
    transformers.logging.set_verbosity_error()  # no load report for the pooler MLM leaves out
    transformers.logging.disable_progress_bar()


# ----------------------------------------------------------------------------------------------
# `model`: ours vs transformers, interleaved

def parse_overrides(pairs):
    """["hidden_size=768", ...] -> {"hidden_size": 768}, checked against ModelConfig's fields."""
    types = {f.name: f.type for f in fields(ModelConfig)}
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in types:
            raise SystemExit(f"--set {pair!r}: expected key=value with key one of {sorted(types)}")
        kind = types[key]
        if kind is bool:
            if value not in ("true", "false"):
                raise SystemExit(f"--set {pair!r}: {key} takes true or false")
            overrides[key] = value == "true"
        else:
            try:
                overrides[key] = kind(value)
            except ValueError:
                raise SystemExit(f"--set {pair!r}: {key} takes a {kind.__name__}") from None
    return overrides


def emit(**figure):
    print(json.dumps(figure), flush=True)


def bench_phase(phase, config, args, device, weights_root):
    P = args.predictions_per_seq
    batch = make_batch(config, args.batch_size, args.seq_len, P, torch.Generator().manual_seed(0))
    weights_dir = f"{weights_root}/{phase}"
    ours = Runner(phase, "ours", build_ours(phase, config), batch, device, args.adamw, args.compile)
    save_hf(ours.model, weights_dir)  # the same weights on both sides
    hf = Runner(phase, "hf", load_hf(phase, weights_dir), batch, device, args.adamw, args.compile)

    # Equal work check: the same weights give the same loss (hidden states for inference).
    a, b = ours.check_output(), hf.check_output()
    max_diff = (a - b).abs().max().item()
    tolerance = 1e-4 * max(1.0, a.abs().max().item()) if device.type == "cpu" else 5e-2
    if max_diff > tolerance:
        raise SystemExit(f"{phase}: ours and transformers disagree on the same batch (max |diff| {max_diff:.2e})")

    gpu_memory = {}
    for impl, runner in (("ours", ours), ("hf", hf)):
        if device.type == "cuda":
            # The other side's weights and optimizer state stay put while this side warms up: the
            # peak above them, plus this side's weights, is what this side needs alone.
            torch.cuda.reset_peak_memory_stats(device)
            own = {t.data_ptr(): t.nbytes for t in runner.model.state_dict().values()}  # tied weights once
            others = torch.cuda.memory_allocated(device) - sum(own.values())
        for _ in range(max(args.warmup, 2)):  # optimizer state and compiled graphs exist from step 2
            runner.step()
        if device.type == "cuda":
            gpu_memory[impl] = torch.cuda.max_memory_allocated(device) - others
    times = {"ours": [], "hf": []}
    for _ in range(args.steps):  # A B A B: each pair sees the same machine load
        times["ours"].append(ours.timed_step())
        times["hf"].append(hf.timed_step())
    ratios = sorted(h / o for o, h in zip(times["ours"], times["hf"]))
    if args.profile:
        for runner in (ours, hf):
            profile(runner, args.profile)
    del ours, hf

    tokens = args.batch_size * args.seq_len
    # Where each side reads the last layer's output: ours at the masked slots (pre-training) or
    # [CLS] (fine-tuning), transformers' at every position.
    outputs = {"pretrain": P, "finetune": 1, "infer": args.seq_len}[phase]
    flops = {"ours": step_flops_per_token(config, args.seq_len, outputs, phase),
             "hf": step_flops_per_token(config, args.seq_len, args.seq_len, phase)}
    result = {"phase": phase, "output_check_max_diff": max_diff}
    for impl in ("ours", "hf"):
        seconds = statistics.median(times[impl])
        result[impl] = {
            "tokens_per_s": tokens / seconds, "step_s": seconds,
            # MFU counts the model's FLOPs (ours), whoever runs them: HF's extra head work is waste.
            "model_flops_per_s": flops["ours"] * tokens / seconds,
            "executed_flops_per_token": flops[impl],
        }
    result["ratio_median"] = statistics.median(ratios)
    result["ratio_min"], result["ratio_max"] = ratios[0], ratios[-1]

    for impl in ("ours", "hf"):
        if device.type == "cuda":
            result[impl]["peak_memory_bytes"] = gpu_memory[impl]
        else:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                rss, baseline = pool.submit(peak_rss_in_fresh_process, phase, impl, config, args.batch_size,
                                            args.seq_len, P, weights_dir, args.adamw, args.threads,
                                            args.keep_freed_memory, args.compile).result()
            result[impl]["peak_memory_bytes"] = rss
            result[impl]["process_baseline_bytes"] = baseline
    return result


def cmd_model(args):
    config = replace(CONFIGS[args.config], **parse_overrides(args.set))
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    if args.keep_freed_memory and device.type == "cpu":
        keep_freed_memory()
    torch.manual_seed(0)
    import transformers
    quiet_transformers()
    peak, peak_source = device_peak(device, args.threads)
    peaks = [peak]
    header = {"config": args.config, "overrides": args.set, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "predictions_per_seq": args.predictions_per_seq,
              "device": str(device), "threads": args.threads, "adamw": args.adamw,
              "keep_freed_memory": args.keep_freed_memory, "compile": args.compile,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "machine": platform.processor() or platform.machine()}
    print(f"# {json.dumps(header)}")
    print(f"# load average before: {_load()}")
    results = []
    with tempfile.TemporaryDirectory() as weights_root:
        for phase in args.phases:
            results.append(bench_phase(phase, config, args, device, weights_root))
            if device.type == "cpu":  # a busy machine lowers the peak: keep the best of several
                peaks.append(cpu_matmul_peak(args.threads))
    peak = max(peaks)
    print(f"# peak {peak / 1e9:.1f} GFLOP/s ({peak_source}; best of {[round(p / 1e9) for p in peaks]}); "
          f"load average after: {_load()}")
    emit(figure="peak_flops", value=peak, source=peak_source, **header)
    for r in results:
        for impl in ("ours", "hf"):
            r[impl]["mfu"] = r[impl]["model_flops_per_s"] / peak
            for key in ("tokens_per_s", "mfu", "peak_memory_bytes"):
                emit(figure=key, phase=r["phase"], impl=impl, value=r[impl][key], **header)
        emit(figure="ratio_tokens_per_s", phase=r["phase"], value=r["ratio_median"],
             min=r["ratio_min"], max=r["ratio_max"], steps=args.steps, **header)
        emit(figure="output_check_max_diff", phase=r["phase"], value=r["output_check_max_diff"], **header)

    print(f"\n{'phase':<9} {'impl':<5} {'tokens/s':>9} {'step s':>7} {'MFU':>6} {'peak mem':>9} "
          f"{'GFLOP/tok':>9}  ratio ours/HF (median [min, max])")
    for r in results:
        for impl in ("ours", "hf"):
            x = r[impl]
            ratio = (f"{r['ratio_median']:.2f}x [{r['ratio_min']:.2f}, {r['ratio_max']:.2f}]"
                     if impl == "ours" else "")
            print(f"{r['phase']:<9} {impl:<5} {x['tokens_per_s']:>9.0f} {x['step_s']:>7.3f} {x['mfu']:>6.1%} "
                  f"{x['peak_memory_bytes'] / 2**20:>7.0f}Mi {x['executed_flops_per_token'] / 1e9:>9.3f}  {ratio}")
    if "pretrain" in args.phases:
        extra = (step_flops_per_token(config, args.seq_len, args.seq_len, "pretrain")
                 / step_flops_per_token(config, args.seq_len, args.predictions_per_seq, "pretrain"))
        print(f"\nHF's last layer and MLM head run at all {args.seq_len} positions, ours at the "
              f"{args.predictions_per_seq} masked slots: HF executes {extra:.2f}x the FLOPs per pre-training step. "
              f"MFU counts only the model's FLOPs (ours) for both.")
    if device.type == "cpu":
        print("peak mem: peak RSS of a fresh process running that side alone (includes ~"
              f"{results[0]['ours']['process_baseline_bytes'] / 2**20:.0f}Mi of Python + torch).")


def _load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ----------------------------------------------------------------------------------------------
# loader: data.MLMLoader throughput and memory on a generated corpus

LOADER_SHARES = {"en": 0.4, "de": 0.15, "fr": 0.1, "es": 0.1, "ru": 0.1, "ar": 0.05, "hi": 0.05, "zh": 0.05}


def generate_corpus(root, size_bytes, seed=0):
    """Files {lang}.txt (LOADER_SHARES of size_bytes) of sample_data/ sentences with their words shuffled,
    a blank line after every 5 lines. Skipped when a previous run left a complete corpus."""
    import os
    import random
    from pathlib import Path
    root = Path(root)
    done = root / "COMPLETE"
    if done.exists() and int(done.read_text()) == size_bytes:
        return sorted(str(p) for p in root.glob("*.txt"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sample = Path(__file__).parent / "sample_data"
    for lang, share in LOADER_SHARES.items():
        lines = [line for line in (sample / f"{lang}.txt").read_text(encoding="utf-8").split("\n") if line]
        separator = "" if lang == "zh" else " "
        pool = []
        for _ in range(20000):
            words = list(rng.choice(lines)) if lang == "zh" else rng.choice(lines).split()
            rng.shuffle(words)
            pool.append(separator.join(words) + "\n")
        target, written = int(size_bytes * share), 0
        with open(root / f"{lang}.txt", "w", encoding="utf-8") as f:
            while written < target:
                block = "".join(line + ("\n" if k % 5 == 4 else "") for k, line in enumerate(rng.choices(pool, k=50000)))
                f.write(block)
                written += len(block.encode("utf-8"))
        print(f"  wrote {root / f'{lang}.txt'}: {os.path.getsize(root / f'{lang}.txt') / 1e6:.0f} MB", flush=True)
    done.write_text(str(size_bytes))
    return sorted(str(p) for p in root.glob("*.txt"))


def _rss_mb(pid, field="VmRSS"):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _children(pid):
    import glob
    return [int(c) for path in glob.glob(f"/proc/{pid}/task/*/children") for c in open(path).read().split()]


def cmd_loader(args):
    import os
    import tempfile
    from pathlib import Path
    from data import MLMLoader, Tokenizer, train_tokenizer
    print(f"machine: {os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    files = generate_corpus(args.corpus_dir, int(args.size_gb * 1e9))
    total = sum(os.path.getsize(p) for p in files)
    print(f"corpus: {len(files)} files, {total / 1e9:.2f} GB in {args.corpus_dir}")
    tokenizer_file = args.tokenizer or train_tokenizer(str(Path(__file__).parent / "sample_data"), 8000,
                                                       os.path.join(tempfile.mkdtemp(), "tiny"))
    tokenizer = Tokenizer(tokenizer_file)
    started = time.time()
    loader = MLMLoader(files, tokenizer, batch_size=args.batch_size, seq_len=args.seq_len,
                       max_predictions=args.max_predictions, num_workers=1, seed=0)
    scan = time.time() - started
    print(f"tokenizer: {tokenizer.vocab_size} pieces; checking and counting the lines of {total / 1e9:.2f} GB took "
          f"{scan:.1f} s ({total / 1e6 / scan:.0f} MB/s); main process peak RSS {_rss_mb(os.getpid(), 'VmHWM'):.0f} MB")
    print(f"language probabilities: " + ", ".join(f"{k} {v:.3f}" for k, v in loader.probabilities.items()))
    tokens, batches, samples = 0, 0, []
    worker_peak = 0.0
    started = last = time.time()
    for batch in loader:
        now = time.time()
        batches += 1
        if batches == args.warmup_batches:  # the worker's start is not throughput
            started, tokens = now, 0
        tokens += int(batch["attention_mask"].sum())
        workers = _children(os.getpid())
        worker_rss = sum(_rss_mb(p) for p in workers)
        worker_peak = max(worker_peak, worker_rss)
        if now - last >= args.report_every or batches == 1:
            samples.append((now - started, _rss_mb(os.getpid()), worker_rss))
            print(f"  {now - started:6.1f} s | {batches:6d} batches | main RSS {samples[-1][1]:6.0f} MB | "
                  f"worker RSS {worker_rss:6.0f} MB", flush=True)
            last = now
        if now - started >= args.seconds and batches > args.warmup_batches:
            break
    elapsed = time.time() - started
    print(f"loader: {tokens / elapsed:,.0f} tokens/s ({(batches - args.warmup_batches) / elapsed:.1f} batches/s "
          f"of {args.batch_size}x{args.seq_len}), one worker, over {elapsed:.0f} s")
    print(f"peak RSS: main {_rss_mb(os.getpid(), 'VmHWM'):.0f} MB, worker {worker_peak:.0f} MB; "
          f"worker RSS first/last sample {samples[0][2]:.0f}/{samples[-1][2]:.0f} MB, "
          f"main {samples[0][1]:.0f}/{samples[-1][1]:.0f} MB")
    emit(benchmark="loader", tokens_per_s=round(tokens / elapsed), corpus_gb=round(total / 1e9, 2),
         scan_s=round(scan, 1), peak_rss_main_mb=round(_rss_mb(os.getpid(), "VmHWM")),
         peak_rss_worker_mb=round(worker_peak), load_average=os.getloadavg()[0])
    del loader  # stop the worker before timing the models
    # What the model eats: tokens/s of our pre-training step on the same batch shape, in this process.
    for name in ("tiny", "small"):
        config = CONFIGS[name]
        batch = make_batch(config, args.batch_size, args.seq_len, args.max_predictions, torch.Generator().manual_seed(0))
        runner = Runner("pretrain", "ours", build_ours("pretrain", config), batch, torch.device("cpu"), "fused")
        for _ in range(2):
            runner.step()
        seconds = statistics.median(runner.timed_step() for _ in range(5))
        consumed = args.batch_size * args.seq_len / seconds
        print(f"{name}: the pre-training step consumes {consumed:,.0f} tokens/s; the loader's one worker makes "
              f"{tokens / elapsed / consumed:.1f}x that")
        emit(benchmark="loader_vs_model", config=name, model_tokens_per_s=round(consumed),
             ratio=round(tokens / elapsed / consumed, 2))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="training/inference step of ours vs transformers' RemBERT, and MFU")
    m.add_argument("--config", default="small", choices=sorted(CONFIGS), help="a configs.CONFIGS name")
    m.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="ModelConfig overrides, e.g. --set vocab_size=120000 dropout=0.0")
    m.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES, help="which steps to time")
    m.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    m.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    m.add_argument("--predictions-per-seq", type=int, default=None,
                   help="masked-LM slots per sequence (default ceil(0.15 * seq_len): BERT's 20 for 128)")
    m.add_argument("--steps", type=int, default=7, help="timed steps per side (interleaved)")
    m.add_argument("--warmup", type=int, default=2, help="untimed steps per side first (at least 2)")
    m.add_argument("--adamw", default="fused", choices=("fused", "foreach", "for-loop"),
                   help="AdamW implementation, the same for both sides")
    m.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    m.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU: glibc keeps freed memory instead of unmapping it (see keep_freed_memory)")
    m.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda runs bf16 autocast")
    m.add_argument("--compile", action="store_true", help="torch.compile both sides' models")
    m.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="after timing, print torch.profiler's top ROWS operators of each side's step")
    m.set_defaults(run=cmd_model)
    d = sub.add_parser("loader", help="data.MLMLoader tokens/s and memory on a generated corpus of >= 1 GB")
    d.add_argument("--corpus-dir", default="/tmp/rembert-loader-corpus", help="where the corpus is generated (once)")
    d.add_argument("--size-gb", type=float, default=1.0, help="corpus size in GB (10^9 bytes)")
    d.add_argument("--tokenizer", default="", help="SentencePiece model (default: train the tiny 8000-piece one)")
    d.add_argument("--batch-size", type=int, default=32, help="sequences per batch")
    d.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    d.add_argument("--max-predictions", type=int, default=20, help="masked positions per sequence")
    d.add_argument("--seconds", type=float, default=60.0, help="how long to stream after the warm-up")
    d.add_argument("--warmup-batches", type=int, default=5, help="batches before timing starts")
    d.add_argument("--report-every", type=float, default=10.0, help="seconds between memory samples")
    d.set_defaults(run=cmd_loader)
    args = parser.parse_args()
    if args.command == "model" and args.predictions_per_seq is None:
        args.predictions_per_seq = math.ceil(0.15 * args.seq_len)
    args.run(args)


if __name__ == "__main__":
    main()
