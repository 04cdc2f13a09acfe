r"""Masked-LM pre-training of RemBERT: the paper's recipe for every model it compares (Sections 4-5),
with the optimisation of Table 14 (AdamW β1 0.9, β2 0.999, ε 1e-6, weight decay 0.01, gradient
clipping at norm 1, linear warm-up then linear decay), on CPU, CUDA GPUs or TPUs (torch-xla).

`python pretrain.py` with no arguments is a complete small run: it trains a SentencePiece tokenizer on the
bundled sample corpus (sample_data/) if there is none yet, then pre-trains the `tiny` config for 800 steps
(2-4 minutes on 2 CPU cores), logging loss, masked-LM accuracy, learning rate, tokens/s and time left, and
writes checkpoints to out/pretrain/. Any config of configs.py, ModelConfig field or TrainConfig option is a
flag (`--help` lists them). The global batch is batch_size x grad_accum x processes (2048 below):

  CPU:       python pretrain.py
  one GPU:   python pretrain.py --config ein128-eout768 --device cuda --data corpus/ --tokenizer spm.model \
                 --seq-len 512 --max-predictions 80 --batch-size 64 --grad-accum 32 --num-workers 4
  8 GPUs:    torchrun --standalone --nproc_per_node=8 pretrain.py --config rembert --device cuda --fsdp \
                 --data corpus/ --tokenizer spm.model --seq-len 512 --max-predictions 80 --batch-size 16 \
                 --grad-accum 16 --num-workers 4
  TPU v4-8:  PJRT_DEVICE=TPU python pretrain.py --config rembert --device xla --fsdp --data corpus/ \
                 --tokenizer spm.model --seq-len 512 --max-predictions 80 --batch-size 64 --grad-accum 32
  continue:  the same command with --resume (any number of processes at the same global batch)

docs/scaling.md has pod slices, the memory per device and the checkpoints. A NaN/inf loss stops the run: it is
checked at each log line, and the weights before each checkpoint, so no checkpoint holds a bad step.
"""

import contextlib
import hashlib
import itertools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace

import torch
from torch.distributed.tensor import DTensor

from checkpoints import DataError, RunFolder
from configs import (CONFIGS, DEVICE, GIVEN, POSITIVE, SEED, ArgumentParser, add_flags, build, at_least, check_flags,
                     flag, one_of, parse_flags, run_script)
from data import MLMLoader, Tokenizer, corpus_files, line_counts, tokenizer_for, train_tokenizer
from model import MaskedLM, ModelConfig, count_parameters
from runtime import launch, setup_runtime


@dataclass
class TrainConfig:
    config: str = flag("tiny", f"model from configs.py: {', '.join(CONFIGS)}", one_of(CONFIGS))
    data: str = flag("sample_data", "a text file or a directory of *.txt files (its folders' too), one sentence per "
                                    "line, a blank line between documents", GIVEN)
    tokenizer: str = flag("", "SentencePiece model, trained on --data with the config's vocab_size if missing "
                              "(default: out/tokenizer/spm-VOCAB-DIGEST.model, one for each corpus and vocab_size)",
                          (lambda v: v == "" or v.endswith(".model"), "a file name ending in .model"))
    out_dir: str = flag("out/pretrain", "where checkpoints go", GIVEN)
    device: str = flag("auto", "auto | cpu | cuda | xla", DEVICE)
    fsdp: bool = flag(False, "shard weights, gradients and AdamW's state over the processes (FSDP2 under torchrun; "
                             "on xla, SPMD over the host's devices, one process per host)")
    seq_len: int = flag(128, "tokens per sequence", at_least(3))
    max_predictions: int = flag(20, "masked positions per sequence (15% of seq_len)", POSITIVE)
    batch_size: int = flag(32, "sequences per micro-batch per process", POSITIVE)
    grad_accum: int = flag(1, "micro-batches per optimizer step", POSITIVE)
    num_workers: int = flag(0, "DataLoader workers (0: none; 2 or more make other batches than 0 or 1)", at_least(0))
    steps: int = flag(800, "optimizer steps in total", POSITIVE)
    warmup: int = flag(80, "linear warm-up steps", at_least(0))
    lr: float = flag(1e-3, "peak learning rate", POSITIVE)
    weight_decay: float = flag(0.01, "AdamW weight decay (not on biases, LayerNorm)", at_least(0))
    max_grad_norm: float = flag(1.0, "clip the global gradient norm to this", POSITIVE)
    log_every: int = flag(10, "steps between log lines (and loss checks)", POSITIVE)
    checkpoint_every: int = flag(100, "steps between checkpoints", POSITIVE)
    keep: int = flag(3, "checkpoints kept (the newest)", POSITIVE)
    seed: int = flag(0, "seed for initialisation, masking and dropout", SEED)
    compile: bool = flag(False, "torch.compile the model (CPU or CUDA): fused elementwise kernels, after "
                                "compiling (20-40 s for tiny)")
    resume: bool = flag(False, "continue from the newest intact checkpoint in --out-dir")

    def __post_init__(self):
        check_flags(self)
        if self.warmup >= self.steps:
            raise ValueError(f"--warmup ({self.warmup}) must be below --steps ({self.steps})")
        if self.lr * self.weight_decay >= 1:
            raise ValueError(f"--weight-decay {self.weight_decay} x --lr {self.lr} must be below 1: AdamW scales the "
                             f"weights by 1 - their product at every step")
        if self.max_predictions > self.seq_len - 2:  # the positions between [CLS] and [SEP]; more are padding
            raise ValueError(f"--max-predictions must be at most --seq-len - 2 ({self.seq_len - 2})")
        if self.compile and (self.device == "xla" or self.fsdp):
            raise ValueError("--compile is for cpu and cuda without --fsdp (torch-xla compiles every step already)")


# Training settings a resumed run must share with its checkpoint (the model's too); --steps may grow, and the
# global batch may be split otherwise over processes and accumulation (the loader checks it).
SAME_ON_RESUME = ("seq_len", "max_predictions", "warmup", "lr", "weight_decay", "max_grad_norm", "seed")


def parse_args(argv=None):
    """-> (ModelConfig, TrainConfig): the --config preset with any ModelConfig field overridden."""
    parser = ArgumentParser(description=__doc__)
    add_flags(parser.add_argument_group("training"), TrainConfig)
    add_flags(parser.add_argument_group("model: ModelConfig fields (default: the --config's)"), ModelConfig,
              default_none=True)
    args = parse_flags(parser, argv)
    cfg = build(parser, TrainConfig, args)
    changes = {name: value for name, value in args.items() if value is not None}  # the model's: None if not given
    model_config = build(parser, ModelConfig, asdict(CONFIGS[cfg.config]) | changes)
    if cfg.seq_len > model_config.max_position_embeddings:
        parser.error(f"--seq-len {cfg.seq_len} exceeds max_position_embeddings {model_config.max_position_embeddings}")
    return model_config, cfg


# Optimisation (Table 14): AdamW, β 0.9/0.999, ε 1e-6, weight decay 0.01 on matrices; linear warm-up and decay

def build_optimizer(model, lr, weight_decay):
    """AdamW over the trainable parameters. Biases and LayerNorm gains (the 1-D tensors) get no
    weight decay, as in BERT; frozen parameters (the pooler in pre-training) are left out."""
    params = [p for p in model.parameters() if p.requires_grad]  # (a tied matrix is one parameter: listed once)
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-6)


def lr_at(step, warmup, total, peak):
    """Learning rate of update `step` (0-based): linear warm-up over `warmup` updates to `peak`,
    then linear decay that would reach 0 at update `total` (so no update of the run has lr 0)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * max(0.0, (total - step) / max(1, total - warmup))


def train_step(model, optimizer, runtime, micro_batches, max_grad_norm, stats):
    """One optimizer step over `micro_batches` (grad_accum of them). Adds [sum of weighted CE,
    correct predictions, masked tokens] to the device tensor `stats`, for logging; no host sync.

    The loss is normalised by the masked tokens of the whole global batch (all micro-batches of all processes), not
    per micro-batch: every prediction then weighs the same however the batch is split, so N processes x M
    micro-batches compute the gradient of one process with the global batch. (DDP, FSDP and xm.reduce_gradients
    average over the replicas, hence x replicas; SPMD computes the global batch as one.)"""
    count = runtime.all_reduce_sum(sum(b["masked_weights"].sum() for b in micro_batches)).clamp(min=1.0)
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce the gradients once, after the last
            model.set_requires_gradient_sync(last)
        with model.no_sync() if hasattr(model, "no_sync") and not last else contextlib.nullcontext():  # DDP
            with runtime.autocast():
                logits, loss = model(**batch)  # (B*P, V); the mean cross-entropy of this micro-batch's predictions
            weights = batch["masked_weights"]
            loss_sum = loss * weights.sum()
            (loss_sum * runtime.replicas / count).backward()
        right = logits.detach().argmax(-1) == batch["masked_ids"].flatten()
        correct = (right.float() * weights.flatten()).sum()
        stats += torch.stack([loss_sum.detach(), correct, weights.sum()])
    runtime.optimizer_step(optimizer, max_grad_norm)
    optimizer.zero_grad(set_to_none=True)


def train(model_config, cfg):
    runtime = setup_runtime(cfg.device, cfg.fsdp, cfg.batch_size)
    log = (lambda *a: print(*a, flush=True)) if runtime.is_main else (lambda *a: None)
    folder = RunFolder(cfg.out_dir, runtime, log, cfg.resume, TrainConfig, "checkpoints")
    log(f"runtime: {runtime.describe()}")
    cfg, tokenizer, raw_model, model, optimizer, loader = build_training(model_config, cfg, runtime, folder, log)
    same = {**asdict(model_config), **{k: getattr(cfg, k) for k in SAME_ON_RESUME}}
    step = folder.restore(raw_model, optimizer, same, (cfg.steps, f"--steps {cfg.steps}"), cfg.seed, loader)

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * runtime.world_size
    stats = torch.zeros(3, device=runtime.device)
    data = iter(loader)
    model.train()
    started = time.time()
    while step < cfg.steps:
        # Feed the device exactly the batches up to the next checkpoint: prefetching (MpDeviceLoader)
        # then never runs ahead of the step, and the loader state saved below matches it.
        segment = min(cfg.checkpoint_every - step % cfg.checkpoint_every, cfg.steps - step)
        batches = runtime.loader(itertools.islice(data, segment * cfg.grad_accum))
        last_log, last_step = time.time(), step
        for _ in range(segment):
            micro_batches = [next(batches) for _ in range(cfg.grad_accum)]
            lr = lr_at(step, cfg.warmup, cfg.steps, cfg.lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            train_step(model, optimizer, runtime, micro_batches, cfg.max_grad_norm, stats)
            step += 1
            if step % cfg.log_every and step != cfg.steps and step % cfg.checkpoint_every:
                continue
            # The one host sync, every log_every steps (and before each checkpoint). The loss
            # summed since the last check is NaN/inf if any step's was, so none slips through.
            loss_sum, correct, count = runtime.all_reduce_sum(stats.clone()).tolist()
            stats.zero_()
            loss = loss_sum / max(count, 1.0)
            if not math.isfinite(loss):
                raise FloatingPointError(f"the loss became {loss} between steps {last_step + 1} and {step}; "
                                         f"{folder.last_good()} (try a lower --lr)")
            seconds_per_step = (time.time() - last_log) / (step - last_step)
            log(f"step {step:>6}/{cfg.steps} | loss {loss:.6f} | mlm acc {correct / max(count, 1.0):.3f} "
                f"| lr {lr:.2e} | {tokens_per_step / seconds_per_step:,.0f} tok/s "
                f"| left {(cfg.steps - step) * seconds_per_step / 60:.1f} min{runtime.compiles()}")
            last_log, last_step = time.time(), step
        if not weights_are_sound(raw_model, micro_batches[-1], runtime):
            raise FloatingPointError(f"the update of step {step} broke the weights (not finite, or a non-finite "
                                     f"loss); not saved. {folder.last_good()} (try a lower --lr)")
        path = folder.save(step, raw_model, optimizer, model_config, asdict(cfg), tokenizer, loader, cfg.keep)
        log(f"saved {path}")
    log(f"done: {cfg.steps} steps in {(time.time() - started) / 60:.1f} min")
    return raw_model


# Around the loop: what it trains, the tokenizer, the weights' check

def build_training(model_config, cfg, runtime, folder, log):
    """(cfg, tokenizer, the model, the model on the processes, AdamW, the loader): a new run's, or with the
    tokenizer of the checkpoint it resumes."""
    resumed = folder.newest()  # (path, checkpoint.json) with --resume, or None
    files = [p for paths in corpus_files(cfg.data).values() for p in paths]
    lines = runtime.on_main(lambda: line_counts(files))  # the corpus read once
    tokenizer = ensure_tokenizer(cfg, model_config, runtime, log, lines, resumed and resumed[0])
    cfg = replace(cfg, tokenizer=tokenizer.model_file)
    log(f"model config: {asdict(model_config)}\ntrain config: {asdict(cfg)}")
    if resumed and cfg.steps != resumed[1]["train_config"]["steps"]:  # --steps may grow
        log(f"--steps {cfg.steps}: the learning rate decays to 0 at step {cfg.steps} now, no longer at step "
            f"{resumed[1]['train_config']['steps']}")
    if cfg.max_predictions < round(0.15 * cfg.seq_len):  # create_pretraining_data.py's cap, the same
        log(f"note: --max-predictions {cfg.max_predictions} masks {cfg.max_predictions / cfg.seq_len:.1%} of "
            f"--seq-len {cfg.seq_len}, not BERT's 15% ({round(0.15 * cfg.seq_len)} pieces)")

    torch.manual_seed(cfg.seed)  # the same initial weights in every process
    raw_model = MaskedLM(model_config).to(runtime.device)
    raw_model.tie_weights()  # (moved to an XLA device, a coupled model has two matrices)
    raw_model.encoder.pooler.requires_grad_(False)  # no NSP: the pooler gets no gradient
    model = runtime.wrap_model(raw_model)
    model = torch.compile(model) if cfg.compile else model
    optimizer = build_optimizer(raw_model, cfg.lr, cfg.weight_decay)
    loader = MLMLoader(cfg.data, tokenizer, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                       max_predictions=cfg.max_predictions, rank=runtime.rank, world_size=runtime.world_size,
                       grad_accum=cfg.grad_accum, num_workers=cfg.num_workers, seed=cfg.seed, counts=lines)
    counts = count_parameters(raw_model)
    log(f"parameters: {counts['pretraining']:,} in pre-training, {counts['finetuning']:,} kept for fine-tuning")
    torch.manual_seed(cfg.seed + 1 + runtime.rank)  # dropout: different draws in each process (resume sets its own)
    return cfg, tokenizer, raw_model, model, optimizer, loader


def ensure_tokenizer(cfg, model_config, runtime, log, lines, resumed=None):
    """The tokenizer of the checkpoint `resumed` (--tokenizer, if it names a file, must be that one), or else the
    --tokenizer, trained on --data by the main process if it is not there yet; checked against the model. By default,
    one for each corpus (its files' languages and line_counts digests) and vocab_size: another --data never reuses
    the tokenizer of the last."""
    if resumed:
        named = os.path.exists(cfg.tokenizer)
        tokenizer = tokenizer_for(resumed, cfg.tokenizer if named else "")
        if not named:  # (none given, or one named relative to another directory): the checkpoint's, never a new one
            log(f"--resume: {resumed}'s tokenizer, {tokenizer.model_file}")
    else:
        path = cfg.tokenizer
        if not path:  # (the default: the corpus's, by its files' languages and digests, and the vocab_size's)
            corpus = sorted((lang, lines[p][1]) for lang, paths in corpus_files(cfg.data).items() for p in paths)
            key = hashlib.sha256(json.dumps([model_config.vocab_size, corpus]).encode()).hexdigest()[:12]
            path = f"out/tokenizer/spm-{model_config.vocab_size}-{key}.model"
        if not runtime.gather_object(os.path.exists(path))[0]:  # rank 0 decides: every process waits alike
            log(f"training a {model_config.vocab_size}-piece SentencePiece tokenizer on {cfg.data} -> {path}")
            runtime.on_main(lambda: train_tokenizer(cfg.data, model_config.vocab_size, path.removesuffix(".model"),
                                                    counts=lines))
        tokenizer = Tokenizer(path)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise DataError(f"{tokenizer.model_file} has {tokenizer.vocab_size} pieces but the model's vocab_size is "
                        f"{model_config.vocab_size}; pass --vocab-size {tokenizer.vocab_size}")
    if tokenizer.vocab_size < model_config.vocab_size:
        log(f"note: {tokenizer.model_file} has {tokenizer.vocab_size} pieces, fewer than vocab_size "
            f"{model_config.vocab_size}; the extra embedding rows stay unused")
    return tokenizer


def weights_are_sound(model, batch, runtime):
    """Checked before every save, since the loss checked so far was computed before the last update:
    the weights are finite and give a finite loss on `batch` (in every process; each checks its shards)."""
    model.eval()
    with torch.no_grad(), runtime.autocast():
        loss = model(**batch)[-1]
    model.train()
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    finite = torch.stack([torch.isfinite(loss)] + [torch.isfinite(p).all() for p in local]).all()
    return runtime.all_reduce_sum((~finite).float()).item() == 0


def main(argv=None):
    model_config, train_config = parse_args(argv)
    launch(train, train_config.device, model_config, train_config, processes=not train_config.fsdp)


if __name__ == "__main__":
    run_script(main)
