r"""Masked-LM pre-training of RemBERT: the paper's recipe for every model it compares (Sections 4-5),
with the optimisation of Table 14 (AdamW β1 0.9, β2 0.999, ε 1e-6, weight decay 0.01, gradient
clipping at norm 1, linear warm-up then linear decay), on CPU, CUDA GPUs or TPUs (torch-xla).

`python pretrain.py` with no arguments is a complete small run: it trains a SentencePiece tokenizer
on the bundled multilingual sample corpus (sample_data/) if there is none yet, then pre-trains the
`tiny` config on it for 800 steps (2-4 minutes on 2 CPU cores), logging loss, masked-LM
accuracy, learning rate, tokens/s and time left, and writes checkpoints to out/pretrain/.

Any config of configs.py by name, any ModelConfig field and any training option (TrainConfig below)
as a flag; `python pretrain.py --help` lists them all. Commands:

  CPU:        python pretrain.py
  one GPU:    python pretrain.py --config ein128-eout768 --device cuda --data corpus/ --tokenizer spm.model \
                  --seq-len 512 --max-predictions 80 --batch-size 64 --grad-accum 32 --num-workers 4
  8 GPUs:     torchrun --standalone --nproc_per_node=8 pretrain.py --config rembert --device cuda --fsdp \
                  --data corpus/ --tokenizer spm.model --seq-len 512 --max-predictions 80 \
                  --batch-size 16 --grad-accum 16 --num-workers 4
  TPU:        PJRT_DEVICE=TPU python pretrain.py --config rembert --device xla --fsdp --data corpus/ \
                  --tokenizer spm.model --seq-len 512 --max-predictions 80 --batch-size 64 --grad-accum 32
                  (one process per host, SPMD over its chips: a v4-8 as shown; on a pod slice, the same
                  command on every host, with --grad-accum divided by the hosts and --out-dir on a shared disk)
  continue:   the same command with --resume (from the newest intact checkpoint in --out-dir; any number of
              processes whose batch x accumulation x processes is the same)

The global batch is batch_size x grad_accum x processes sequences (2048 in each command above; on XLA
with --fsdp a process is a host); add --lr, --warmup and --steps for the run you reproduce (the defaults
suit the tiny CPU run). Without --fsdp every process holds the whole model: RemBERT's weights, gradients
and AdamW's moments take 14.8 GiB in float32 before any activation, which --fsdp divides by the devices.
Processes read disjoint shares of the corpus. A NaN/inf loss stops the run; it is checked at each log
line, and the weights themselves before each checkpoint, so no checkpoint holds a bad step.
"""

import contextlib
import glob
import itertools
import json
import math
import os
import pickle
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from configs import (CONFIGS, DEVICE, GIVEN, POSITIVE, SEED, ArgumentParser, add_flags, build, at_least, check_flags,
                     flag, one_of, parse_flags, resolve_device, run_script)
from data import MLMLoader, Tokenizer, corpus_files, line_counts, train_tokenizer, write_json
from model import (CHECKPOINT_INFO, DataError, MaskedLM, ModelConfig, checkpoint_reader, count_parameters,
                   one_line, read_checkpoint_info, sha256, typed_fields)


@dataclass
class TrainConfig:
    config: str = flag("tiny", f"model from configs.py: {', '.join(CONFIGS)}", one_of(CONFIGS))
    data: str = flag("sample_data", "a text file or a directory of *.txt files (its folders' too), one sentence per "
                                    "line, a blank line between documents", GIVEN)
    tokenizer: str = flag("out/tokenizer/spm.model", "SentencePiece model; trained on --data with the config's "
                          "vocab_size if missing", (lambda v: v.endswith(".model"), "a file name ending in .model"))
    out_dir: str = flag("out/pretrain", "where checkpoints go", GIVEN)
    device: str = flag("auto", "auto | cpu | cuda | xla", DEVICE)
    fsdp: bool = flag(False, "shard weights, gradients and AdamW's state over the processes (FSDP2 under torchrun; "
                             "on xla, SPMD over the host's devices, one process per host)")
    seq_len: int = flag(128, "tokens per sequence", at_least(3))
    max_predictions: int = flag(20, "masked positions per sequence (15% of seq_len)", POSITIVE)
    batch_size: int = flag(32, "sequences per micro-batch per process", POSITIVE)
    grad_accum: int = flag(1, "micro-batches per optimizer step", POSITIVE)
    num_workers: int = flag(0, "DataLoader processes making batches (0: in this one)", at_least(0))
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
        if self.max_predictions > self.seq_len - 2:  # the positions between [CLS] and [SEP]; more are padding
            raise ValueError(f"--max-predictions must be at most --seq-len - 2 ({self.seq_len - 2})")
        if self.compile and (self.device == "xla" or self.fsdp):
            raise ValueError("--compile is for cpu and cuda without --fsdp (torch-xla compiles every step already)")


# Training settings a resumed run must share with its checkpoint (the model's too); --steps may grow, and the
# global batch may be split otherwise over processes and accumulation (the loader checks it).
TRAIN_STATE = "train_state.safetensors"  # in a checkpoint: every process's loader and random state
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


# ----------------------------------------------------------------------------------------------
# The device block: cpu, cuda (bf16 autocast) or xla, each optionally data-parallel or sharded

@dataclass
class Runtime:
    kind: str  # "cpu" | "cuda" | "xla"
    device: torch.device
    rank: int = 0  # global rank: which share of the data this process reads
    world_size: int = 1
    fsdp: bool = False  # weights sharded: FSDP2, or on XLA SPMD over `mesh`
    mesh: object = None  # XLA SPMD: every device of the job on one axis, "fsdp"

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def xm(self):  # torch_xla's xla_model, imported on XLA only
        import torch_xla.core.xla_model as xm
        return xm

    def autocast(self):  # bf16 on CUDA; a no-op elsewhere
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.kind == "cuda")

    def wrap_model(self, model):
        """On XLA the replicas stay plain modules: optimizer_step all-reduces their gradients."""
        model = model.to(self.device)
        if self.world_size > 1 and self.kind != "xla":
            return torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device] if self.kind == "cuda" else None)
        return model

    def loader(self, batches):
        """Batches (dicts of tensors) on the device. On XLA, MpDeviceLoader uploads them in a background thread and
        cuts the lazy graph at each batch (one compiled step); under SPMD it splits each over the devices."""
        if self.kind == "xla":
            import torch_xla.distributed.spmd as xs
            from torch_xla.distributed.parallel_loader import MpDeviceLoader
            sharding = self.mesh and xs.ShardingSpec(self.mesh, ("fsdp", None), minibatch=True)  # (B, T), (B, P)
            return iter(MpDeviceLoader(batches, self.device, input_sharding=sharding))
        return ({k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in batches)

    def optimizer_step(self, optimizer, max_grad_norm):
        """xm.optimizer_step is reduce_gradients + step; clipping must sit between the two, so on XLA its two
        halves are called here (DDP and FSDP reduced the gradients in backward, SPMD's compiler in the step)."""
        if self.kind == "xla" and not self.mesh:
            self.xm.reduce_gradients(optimizer)
        torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], max_grad_norm)
        optimizer.step()
        if self.kind == "xla":
            import torch_xla
            torch_xla.sync()  # cut the lazy graph here, so every step compiles to the same graph

    def all_reduce_sum(self, tensor):
        """Sum over processes (a device op: no host sync). Under SPMD a tensor is already the whole job's."""
        if self.world_size == 1 or self.mesh:
            return tensor
        if self.kind == "xla":
            return self.xm.all_reduce(self.xm.REDUCE_SUM, tensor)
        dist.all_reduce(tensor)
        return tensor

    def on_main(self, work):
        """work() on the main process alone, its result on every process. Its refusal (DataError, OSError) stops
        every process with the same one line, not the others with a broken connection when the main one is gone."""
        result = failure = None
        if self.is_main:
            try:
                result = work()
            except (DataError, OSError) as e:
                failure = isinstance(e, OSError), str(e)
        result, failure = self.gather_object((result, failure))[0]
        if failure:
            raise (OSError if failure[0] else DataError)(failure[1])
        return result

    def gather_object(self, obj):
        """[obj of rank 0, obj of rank 1, ...] on every process (for per-rank resume state)."""
        if self.world_size == 1:
            return [obj]
        if self.kind == "xla" and not self.mesh:  # rendezvous exchanges bytes, in the order of the processes
            return [pickle.loads(payload) for payload in self.xm.rendezvous("gather_object", pickle.dumps(obj))]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def rng_state(self):
        """Every generator the step draws from (dropout), for exact resume."""
        state = {"torch": torch.get_rng_state()}
        if self.kind != "cpu":
            state[self.kind] = (self.xm if self.kind == "xla" else torch.cuda).get_rng_state(self.device)
        return state

    def set_rng_state(self, state):
        torch.set_rng_state(state["torch"])
        if self.kind in state:
            (self.xm if self.kind == "xla" else torch.cuda).set_rng_state(state[self.kind], self.device)
        elif self.kind != "cpu":  # saved on another kind of device
            warnings.warn(f"the saved state has no {self.kind} random state: dropout draws differ from the saved run's")

    def save(self, obj, path):
        """One file (finetune.py's training state), written whole or not at all: a temporary file, flushed, renamed."""
        tmp = path + ".tmp"
        try:
            if self.kind == "xla":
                self.xm.save(obj, tmp, master_only=True, global_master=True)  # moves to CPU; all call it
            elif self.is_main:
                torch.save(obj, tmp)
            if self.is_main:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, path)
        except (OSError, RuntimeError) as e:
            raise OSError(f"{path}: saving failed ({e}); the checkpoints saved before are intact") from e
        finally:
            if self.is_main:  # a save that failed (a full disk, Ctrl-C) leaves no partial file behind
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)

    def distributed_checkpoint(self, state, path, load=False):
        """Write `state` to, or (load=True) read it in place from, a torch.distributed.checkpoint directory, which
        any number of processes reads. Sharded, each process writes and reads its own shards (under SPMD through
        torch-xla's planners); replicated, the main process writes all, and each process reads all."""
        planner = None
        if self.mesh:
            from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner
            planner = SPMDLoadPlanner() if load else SPMDSavePlanner()
        collective = self.fsdp and dist.is_initialized()
        with warnings.catch_warnings():  # (that one process works alone, which DCP warns of, is what is meant)
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            if load:  # (its metadata read by model.read_metadata, which runs nothing)
                dcp.load(state, storage_reader=checkpoint_reader(path), planner=planner, no_dist=not collective)
            elif self.fsdp or self.is_main:
                dcp.save(state, checkpoint_id=path, planner=planner, no_dist=not collective)


def setup_runtime(device="auto", fsdp=False):
    """Data parallelism comes from the launcher: torchrun's RANK / WORLD_SIZE / LOCAL_RANK (nccl on GPUs, gloo on
    CPU), or on XLA torch_xla.launch's processes (PJRT), one per core or chip; with fsdp on XLA, one process per
    host, SPMD over all of the job's devices (FSDPv2's setting)."""
    device = resolve_device(device)
    if device == "xla":
        import torch_xla
        import torch_xla.runtime as xr
        if not fsdp:
            return Runtime("xla", torch_xla.device(), xr.global_ordinal(), xr.world_size())
        import torch_xla.distributed.spmd as xs
        xr.use_spmd()
        devices = xr.global_runtime_device_count()
        if xr.process_count() > 1 and not dist.is_initialized():  # hosts agree on checkpoints over gloo
            dist.init_process_group("gloo", init_method="xla://")
        return Runtime("xla", torch_xla.device(), xr.process_index(), xr.process_count(), fsdp=True,
                       mesh=xs.Mesh(list(range(devices)), (devices,), ("fsdp",)))
    try:
        rank, world_size, local_rank = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1),
                                                                                ("LOCAL_RANK", 0)))
    except ValueError:
        raise DataError("RANK, WORLD_SIZE and LOCAL_RANK are torchrun's (whole numbers): start the processes with "
                        "torchrun --nproc-per-node N") from None
    if world_size > 1 and not ("MASTER_ADDR" in os.environ and 0 <= rank < world_size):
        raise DataError(f"WORLD_SIZE={world_size} without torchrun's MASTER_ADDR, or RANK outside it: start the "
                        f"processes with torchrun --nproc-per-node N")
    torch_device = torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(torch_device)
    if (world_size > 1 or fsdp) and not dist.is_initialized():  # (FSDP's device mesh needs a group, even of one)
        alone = {} if "RANK" in os.environ else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        dist.init_process_group("nccl" if device == "cuda" else "gloo", **alone)
    return Runtime(device, torch_device, rank, world_size, fsdp=fsdp)


def shard(model, runtime):
    """Shard the MaskedLM's weights, their gradients and AdamW's state over the processes (or XLA's devices).
    FSDP2 as torchtitan applies it: a unit per Transformer layer, the embeddings and the MLM head (one unit when
    tied: a parameter belongs to one), then the rest; bf16 compute with float32 gradient reduction on CUDA.
    SPMD: spmd_shard's layout, which the compiler follows for the gradients and AdamW's state."""
    if runtime.mesh:
        spmd_shard(model.parameters(), runtime.mesh)
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if runtime.kind == "cuda" else MixedPrecisionPolicy()
    outer = [model.encoder.embeddings, model.head]
    outer = [outer] if model.config.tie_embeddings else outer
    for unit in [*model.encoder.layers, *model.pretraining_layers, *outer]:
        fully_shard(unit, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def spmd_shard(tensors, mesh):
    """FSDPv2's layout (with shard_maximal): each tensor's largest dimension split over the mesh's fsdp axis (a
    smaller one, as the 2 segment types, would leave it whole, which torch-xla's checkpoint reader cannot read),
    marked on the tensors themselves (torch-xla's wrapper would rename the parameters)."""
    import torch_xla.distributed.spmd as xs
    for t in tensors:
        largest = t.shape.index(max(t.shape))
        xs.mark_sharding(t, mesh, tuple("fsdp" if d == largest else None for d in range(t.dim())))


# ----------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------
# Checkpoints: a directory per save, complete once its checkpoint.json is written, the newest `keep` kept

def checkpoint_paths(out_dir):
    """Complete checkpoints, oldest first: ckpt-STEP directories with their checkpoint.json."""
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(out_dir, "ckpt-" + "[0-9]" * 8, CHECKPOINT_INFO)))


def newest_intact_checkpoint(out_dir, log):
    """(path, checkpoint.json) of the newest checkpoint whose every file has its SHA-256; a damaged one is skipped."""
    damaged = []
    for path in reversed(checkpoint_paths(out_dir)):
        try:
            info = read_checkpoint_info(path)
            if problem := typed_fields(TrainConfig, info["train_config"]):
                raise DataError(f"{path}/{CHECKPOINT_INFO}: damaged or not pretrain.py's (train_config: {problem})")
            return path, info
        except DataError as e:
            log(f"warning: {e}; trying the checkpoint before it")
            damaged.append(os.path.basename(path))
    raise DataError(f"{out_dir}: no intact checkpoint to resume from (damaged: {', '.join(damaged)})")


def set_aside(path, log):
    """Move a checkpoint that resuming passed over out of the way (of --keep's count, of the next --resume), kept
    under the first free name of path.damaged, path.damaged-2, ..."""
    target, n = path + ".damaged", 1
    while os.path.lexists(target):
        n += 1
        target = f"{path}.damaged-{n}"
    try:
        os.replace(path, target)
    except OSError as e:
        raise OSError(f"{path}: cannot set it aside as {target} ({e.strerror}); move it yourself") from None
    log(f"moved {path}, passed over above, to {target}")


def remove(path):
    """A checkpoint folder, or the link to it (a folder moved to another disk): what was written elsewhere stays."""
    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def write_train_state(state, path):
    """Nested dicts and lists of tensors and JSON values (the loader's and the random state of every process) as
    one safetensors file, the tensors by number and the rest as JSON in its header: read back, it runs nothing."""
    from safetensors.torch import save_file
    tensors = {}

    def skeleton(x):
        if torch.is_tensor(x):
            tensors[str(len(tensors))] = x.detach().cpu().contiguous()
            return {"tensor": str(len(tensors) - 1)}
        if isinstance(x, dict):
            return {"dict": {k: skeleton(v) for k, v in x.items()}}
        return [skeleton(v) for v in x] if isinstance(x, (list, tuple)) else x
    save_file(tensors, path, metadata={"state": json.dumps(skeleton(state))})


def read_train_state(path):
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        tensors, skeleton = {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["state"])

    def filled(x):
        if isinstance(x, dict):
            return tensors[x["tensor"]] if "tensor" in x else {k: filled(v) for k, v in x["dict"].items()}
        return [filled(v) for v in x] if isinstance(x, list) else x
    return filled(skeleton)


def save_error(path, error):
    return OSError(f"{path}: saving failed ({one_line(error)}); the checkpoints saved before are intact")


def save_checkpoint(runtime, cfg, model, optimizer, loader, step, model_config, tokenizer, log):
    """ckpt-STEP/: the weights and AdamW's state in torch.distributed.checkpoint's format (by parameter name, so
    that any number of processes reshards them), every process's data position and random state (tensors and JSON),
    and last, checkpoint.json: both configs, the step, the tokenizer (by path and digest) and every file's SHA-256.
    Then the oldest beyond --keep go."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    path = os.path.join(cfg.out_dir, f"ckpt-{step:08d}")
    if runtime.on_main(lambda: os.path.lexists(path)):  # (resuming set every later checkpoint aside)
        raise DataError(f"{path} exists already: not written over; move it away, or choose another --out-dir")
    model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(
        cpu_offload=not runtime.fsdp))  # replicated: what the main process writes, on the CPU
    train_state = {"loader": runtime.gather_object(loader.state_dict()),
                   "rng": runtime.gather_object(runtime.rng_state())}

    def write_shards():  # (AdamW's settings are this run's: its state alone is saved, all of it tensors)
        try:
            runtime.distributed_checkpoint({"model": model_state, "optimizer": {"state": optimizer_state["state"]}},
                                           path)
        except (OSError, RuntimeError, dcp.CheckpointException) as e:  # (DCP's is a BaseException)
            raise save_error(path, e) from None
    write_shards() if runtime.fsdp else runtime.on_main(write_shards)  # (sharded, DCP tells every process)

    def complete():
        try:
            write_train_state(train_state, os.path.join(path, TRAIN_STATE))
            write_json(os.path.join(path, CHECKPOINT_INFO), {
                "step": step, "config": asdict(model_config), "train_config": asdict(cfg), "processes":
                runtime.world_size, "tokenizer": {"path": os.path.abspath(tokenizer.model_file),
                                                  "sha256": tokenizer.sha256},
                "sha256": {name: sha256(os.path.join(path, name)) for name in sorted(os.listdir(path))}})
        except Exception as e:  # (safetensors' own errors name no file)
            raise save_error(path, e) from None
        for old in checkpoint_paths(cfg.out_dir)[:-cfg.keep]:  # (the new one is saved, whatever happens here)
            try:
                remove(old)
            except OSError as e:
                log(f"warning: {old}: not removed ({e.strerror}); --keep counts it no more")
    runtime.on_main(complete)
    return path


def resume(runtime, cfg, model_config, model, optimizer, loader, tokenizer, path, info, log):
    """Continue the run of checkpoint `path` (its checkpoint.json: `info`), returning its step: another model,
    training or tokenizer is refused by name; the loader goes on where it was (any split of the same global
    batch); the weights and AdamW's state are resharded onto this run's processes; with as many processes,
    each draws its own random numbers on (bitwise the uninterrupted run), with another number, new ones."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    saved = {**info["config"], **{k: info["train_config"].get(k) for k in SAME_ON_RESUME}}
    now = {**asdict(model_config), **{k: getattr(cfg, k) for k in SAME_ON_RESUME}}
    if differ := [f"{k} {saved.get(k)!r} then, {v!r} now" for k, v in now.items() if saved.get(k) != v]:
        raise DataError(f"{path} was written for another model or training ({'; '.join(differ)}); pass "
                        f"the same --config, overrides and training flags, or another --out-dir")
    if info["tokenizer"]["sha256"] != tokenizer.sha256:
        raise DataError(f"{path} was trained with the tokenizer {info['tokenizer']['path']}; "
                        f"{cfg.tokenizer} is another one (or has changed since)")
    if info["step"] > cfg.steps:
        raise DataError(f"{path} is at step {info['step']}, past --steps {cfg.steps}")
    if not os.path.exists(os.path.join(path, TRAIN_STATE)):
        raise DataError(f"{path}: no {TRAIN_STATE} (written by an earlier pretrain.py, which pickled it): "
                        f"fine-tune from it, or start a new run")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    if runtime.mesh:  # AdamW's moments, just made: laid out as their parameters (torch-xla's reader needs a layout)
        spmd_shard([t for s in optimizer.state.values() for t in s.values() if t.device.type == "xla"], runtime.mesh)
    try:
        extra = read_train_state(os.path.join(path, TRAIN_STATE))
        loader.load_state_dict(extra["loader"])  # (before the weights: a refusal costs nothing)
        state = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
        runtime.distributed_checkpoint(state, path, load=True)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict={**optimizer_state, "state": state["optimizer"]["state"]})
    except DataError:
        raise
    except (Exception, dcp.CheckpointException) as e:  # (a BaseException): what the directory does not hold
        raise DataError(f"{path}: not a training state of this model ({one_line(e)})") from None
    if len(extra["rng"]) == runtime.world_size:
        runtime.set_rng_state(extra["rng"][runtime.rank])
    else:
        log(f"note: {path} was written by {len(extra['rng'])} process(es); dropout draws anew in these")
        torch.manual_seed(cfg.seed + 1 + runtime.rank + info["step"] * runtime.world_size)
    log(f"resumed from {path} at step {info['step']}")
    if cfg.steps != info["train_config"]["steps"]:  # --steps may grow
        log(f"--steps {cfg.steps}: the learning rate decays to 0 at step {cfg.steps} now, no longer at step "
            f"{info['train_config']['steps']}")
    return info["step"]


def open_out_dir(cfg, lock, log):
    """The main process's start in --out-dir: lock it (into `lock`), remove what interrupted saves left, and with
    --resume, find the newest intact checkpoint (returned) and set aside the newer ones it passed over. Only this
    run's own folders are touched: ckpt- and 8 digits (not an export named ckpt-00000010-hf, say)."""
    lock.append(claim(cfg.out_dir))
    own = glob.glob(os.path.join(cfg.out_dir, "ckpt-" + "[0-9]" * 8))
    remove_partial_saves([p for p in own if os.path.isdir(p) and not os.path.lexists(os.path.join(p, CHECKPOINT_INFO))],
                         log)
    if not (cfg.resume and checkpoint_paths(cfg.out_dir)):
        return None
    resumed = newest_intact_checkpoint(cfg.out_dir, log)
    for damaged in (p for p in checkpoint_paths(cfg.out_dir) if p > resumed[0]):
        set_aside(damaged, log)
    return resumed


def claim(out_dir):
    """Lock out_dir/.lock while this run (its main process) writes there: a second run started on it meanwhile would
    delete this one's checkpoints, so that one stops at once instead. A POSIX lock: the process's own (its forked
    workers do not hold it), held while the returned file is open, gone when the process ends however it ends."""
    import fcntl  # (POSIX only, as is this lock)
    os.makedirs(out_dir, exist_ok=True)
    lock = open(os.path.join(out_dir, ".lock"), "a")
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # (held elsewhere: EAGAIN or EACCES, by the system)
        lock.close()
        raise DataError(f"{out_dir} is in use by another run: wait for it, or choose another --out-dir") from None
    except OSError as e:  # a file system without locks
        warnings.warn(f"{out_dir}: cannot lock it against a second run writing there at once ({e})")
    return lock


def remove_partial_saves(paths, log):
    """Delete what saves that a crash interrupted left, files or directories (never read: every reader skips them)."""
    for path in paths:
        remove(path)
        log(f"removed {path}, left by an interrupted save")


# ----------------------------------------------------------------------------------------------
# Training

def train_step(model, optimizer, runtime, micro_batches, max_grad_norm, stats):
    """One optimizer step over `micro_batches` (grad_accum of them). Adds [sum of weighted CE,
    correct predictions, masked tokens] to the device tensor `stats`, for logging; no host sync.

    The loss is normalised by the masked tokens of the whole global batch (all micro-batches of all processes), not
    per micro-batch: every prediction then weighs the same however the batch is split, so N processes x M
    micro-batches compute the gradient of one process with the global batch. (DDP, FSDP and xm.reduce_gradients
    average over processes, hence x processes; SPMD computes the global batch as one.)"""
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
            (loss_sum * (1 if runtime.mesh else runtime.world_size) / count).backward()
        right = logits.detach().argmax(-1) == batch["masked_ids"].flatten()
        correct = (right.float() * weights.flatten()).sum()
        stats += torch.stack([loss_sum.detach(), correct, weights.sum()])
    runtime.optimizer_step(optimizer, max_grad_norm)
    optimizer.zero_grad(set_to_none=True)


def ensure_tokenizer(cfg, model_config, runtime, log):
    if not runtime.gather_object(os.path.exists(cfg.tokenizer))[0]:  # rank 0 decides: every process waits alike
        log(f"training a {model_config.vocab_size}-piece SentencePiece tokenizer on {cfg.data} -> {cfg.tokenizer}")
        prefix = cfg.tokenizer.removesuffix(".model")
        runtime.on_main(lambda: train_tokenizer(cfg.data, model_config.vocab_size, prefix))
    tokenizer = Tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise DataError(f"{cfg.tokenizer} has {tokenizer.vocab_size} pieces but the model's vocab_size is "
                        f"{model_config.vocab_size}; pass --vocab-size {tokenizer.vocab_size}")
    if tokenizer.vocab_size < model_config.vocab_size:
        log(f"note: {cfg.tokenizer} has {tokenizer.vocab_size} pieces, fewer than vocab_size "
            f"{model_config.vocab_size}; the extra embedding rows stay unused")
    return tokenizer


def train(model_config, cfg):
    runtime = setup_runtime(cfg.device, cfg.fsdp)
    log = (lambda *a: print(*a, flush=True)) if runtime.is_main else (lambda *a: None)
    lock = []  # (the main process's lock on --out-dir, held until the run returns)
    resumed = runtime.on_main(lambda: open_out_dir(cfg, lock, log))
    log(f"runtime: {runtime.kind} ({runtime.device}), {runtime.world_size} process(es)"
        + (f", weights sharded ({'SPMD' if runtime.mesh else 'FSDP2'})" if runtime.fsdp else ""))
    if runtime.mesh:  # each batch is split over the host's devices
        import torch_xla.runtime as xr
        if cfg.batch_size % xr.addressable_runtime_device_count():
            raise DataError(f"--batch-size {cfg.batch_size} does not split over this host's "
                            f"{xr.addressable_runtime_device_count()} devices")
    if resumed and not os.path.exists(cfg.tokenizer):  # never a new tokenizer for a run that has one
        saved = resumed[1]["tokenizer"]["path"]
        if not os.path.exists(saved):
            raise DataError(f"--tokenizer {cfg.tokenizer} is not there, nor the one {resumed[0]} was trained with "
                            f"({saved}); pass --tokenizer with that file")
        cfg = replace(cfg, tokenizer=saved)
        log(f"--resume: {resumed[0]}'s tokenizer, {cfg.tokenizer}")
    log(f"model config: {asdict(model_config)}")
    log(f"train config: {asdict(cfg)}")
    if cfg.max_predictions < round(0.15 * cfg.seq_len):  # create_pretraining_data.py's cap, the same
        log(f"note: --max-predictions {cfg.max_predictions} masks {cfg.max_predictions / cfg.seq_len:.1%} of "
            f"--seq-len {cfg.seq_len}, not BERT's 15% ({round(0.15 * cfg.seq_len)} pieces)")
    tokenizer = ensure_tokenizer(cfg, model_config, runtime, log)
    files = [p for paths in corpus_files(cfg.data).values() for p in paths]
    lines = runtime.on_main(lambda: line_counts(files))  # the corpus read once

    torch.manual_seed(cfg.seed)  # the same initial weights in every process
    raw_model = MaskedLM(model_config).to(runtime.device)
    raw_model.tie_weights()  # (moved to an XLA device, a coupled model has two matrices)
    raw_model.encoder.pooler.requires_grad_(False)  # no NSP: the pooler gets no gradient
    model = shard(raw_model, runtime) if runtime.fsdp else runtime.wrap_model(raw_model)
    if cfg.compile:
        model = torch.compile(model)
    optimizer = build_optimizer(raw_model, cfg.lr, cfg.weight_decay)
    loader = MLMLoader(cfg.data, tokenizer, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                       max_predictions=cfg.max_predictions, rank=runtime.rank, world_size=runtime.world_size,
                       grad_accum=cfg.grad_accum, num_workers=cfg.num_workers, seed=cfg.seed, counts=lines)
    counts = count_parameters(raw_model)
    log(f"parameters: {counts['pretraining']:,} in pre-training, {counts['finetuning']:,} kept for fine-tuning")

    step = 0
    if resumed:
        step = resume(runtime, cfg, model_config, raw_model, optimizer, loader, tokenizer, *resumed, log)
    elif checkpoint_paths(cfg.out_dir):
        raise DataError(f"{cfg.out_dir} already holds checkpoints; pass --resume to continue that run, "
                        f"or choose another --out-dir")
    else:
        if cfg.resume:
            log(f"--resume: no checkpoint in {cfg.out_dir} yet; starting at step 0")
        torch.manual_seed(cfg.seed + 1 + runtime.rank)  # dropout: different draws in each process
    os.makedirs(cfg.out_dir, exist_ok=True)

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
                                         f"{last_good(cfg.out_dir)} (try a lower --lr)")
            seconds_per_step = (time.time() - last_log) / (step - last_step)
            compiles = ""
            if runtime.kind == "xla":
                import torch_xla.debug.metrics as met
                compiles = f" | xla compiles {(met.metric_data('CompileTime') or [0])[0]}"
            log(f"step {step:>6}/{cfg.steps} | loss {loss:.6f} | mlm acc {correct / max(count, 1.0):.3f} "
                f"| lr {lr:.2e} | {tokens_per_step / seconds_per_step:,.0f} tok/s "
                f"| left {(cfg.steps - step) * seconds_per_step / 60:.1f} min{compiles}")
            last_log, last_step = time.time(), step
        if not weights_are_sound(raw_model, micro_batches[-1], runtime):
            raise FloatingPointError(f"the update of step {step} broke the weights (not finite, or a non-finite "
                                     f"loss); not saved. {last_good(cfg.out_dir)} (try a lower --lr)")
        path = save_checkpoint(runtime, cfg, raw_model, optimizer, loader, step, model_config, tokenizer, log)
        log(f"saved {path}")
    log(f"done: {cfg.steps} steps in {(time.time() - started) / 60:.1f} min")
    return raw_model


def last_good(out_dir):
    good = checkpoint_paths(out_dir)
    return f"last good checkpoint: {good[-1]}" if good else "no checkpoint was saved"


def launch(function, device, *args, processes=True):
    """XLA: torch_xla.launch starts a process per device (processes=False: this one, for SPMD)."""
    if not processes or resolve_device(device) != "xla":
        return function(*args)
    import torch_xla
    torch_xla.launch(_without_index, args=(function, *args))


def _without_index(index, function, *args):  # torch_xla.launch passes the process index first
    function(*args)


def main(argv=None):
    model_config, train_config = parse_args(argv)
    launch(train, train_config.device, model_config, train_config, processes=not train_config.fsdp)


if __name__ == "__main__":
    run_script(main)
