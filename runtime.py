"""Where the training runs: the device block of pretrain.py and finetune.py. CPU, CUDA GPUs (bf16 autocast) or
TPUs (torch-xla), with data parallelism from the launcher (torchrun: DDP, or FSDP2 with --fsdp; torch_xla.launch)
and on XLA with --fsdp, SPMD over the host's devices (FSDPv2's layout). None of it is the paper's method: a
training loop calls the same few methods whatever runs it."""

import ctypes
import os
import pickle
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpoints import DataError
from configs import resolve_device


@dataclass
class Runtime:
    """One process's device, its place among the processes, and how the model is spread over them."""
    kind: str  # "cpu" | "cuda" | "xla"
    device: torch.device
    rank: int = 0  # global rank: which share of the data this process reads
    world_size: int = 1
    fsdp: bool = False  # weights, gradients and AdamW's state sharded over the processes (FSDP2)
    sharding = "FSDP2"  # (how, for `describe`)

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def replicas(self):
        """Over how many copies of the model the gradient reduction averages (DDP, FSDP2, xm.reduce_gradients)."""
        return self.world_size

    def describe(self):
        sharded = f", weights sharded ({self.sharding})" * self.fsdp
        return f"{self.kind} ({self.device}), {self.world_size} process(es){sharded}"

    @property
    def xm(self):  # torch_xla's xla_model, imported on XLA only
        import torch_xla.core.xla_model as xm
        return xm

    def autocast(self):  # bf16 on CUDA; a no-op elsewhere
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.kind == "cuda")

    def wrap_model(self, model):
        """The model on the device, spread over the processes. FSDP2 as torchtitan applies it: a unit per Transformer
        layer, the embeddings and the MLM head (one unit when tied: a parameter belongs to one), then the rest. On XLA
        the replicas stay plain modules: optimizer_step all-reduces their gradients."""
        model = model.to(self.device)
        if self.fsdp:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if self.kind == "cuda" else MixedPrecisionPolicy()
            outer = [model.encoder.embeddings, model.head]
            outer = [outer] if model.config.tie_embeddings else outer
            for unit in [*model.encoder.layers, *model.pretraining_layers, *outer]:
                fully_shard(unit, mp_policy=policy)
            return fully_shard(model, mp_policy=policy)
        if self.world_size > 1 and self.kind != "xla":
            return torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device] if self.kind == "cuda" else None)
        return model

    def lay_out(self, optimizer):
        """AdamW's state, just made for a resume, laid out as its parameters are (only SPMD needs to be told)."""

    def loader(self, batches):
        """Batches (dicts of tensors) on the device. On XLA, MpDeviceLoader uploads them in a background thread and
        cuts the lazy graph at each batch (one compiled step)."""
        if self.kind == "xla":
            from torch_xla.distributed.parallel_loader import MpDeviceLoader
            return iter(MpDeviceLoader(batches, self.device))
        return ({k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in batches)

    def optimizer_step(self, optimizer, max_grad_norm):
        """xm.optimizer_step is reduce_gradients + step; clipping must sit between the two, so on XLA its two
        halves are called here (DDP and FSDP2 reduced the gradients in backward, SPMD's compiler in the step)."""
        if self.kind == "xla" and self.replicas > 1:
            self.xm.reduce_gradients(optimizer)
        torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], max_grad_norm)
        optimizer.step()
        if self.kind == "xla":
            import torch_xla
            torch_xla.sync()  # cut the lazy graph here, so every step compiles to the same graph

    def all_reduce_sum(self, tensor):
        """Sum over processes (a device op: no host sync). Under SPMD a tensor is already the whole job's."""
        if self.replicas == 1:
            return tensor
        if self.kind == "xla":
            return self.xm.all_reduce(self.xm.REDUCE_SUM, tensor)
        dist.all_reduce(tensor)
        return tensor

    def gather_object(self, obj):
        """[obj of rank 0, obj of rank 1, ...] on every process (for per-rank resume state)."""
        if self.world_size == 1:
            return [obj]
        if self.kind == "xla" and self.replicas > 1:  # rendezvous exchanges bytes, in the order of the processes
            return [pickle.loads(payload) for payload in self.xm.rendezvous("gather_object", pickle.dumps(obj))]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

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

    def compiles(self):
        """For the log line: how often XLA has compiled (once per new graph: it should stop growing)."""
        if self.kind != "xla":
            return ""
        import torch_xla.debug.metrics as met
        return f" | xla compiles {(met.metric_data('CompileTime') or [0])[0]}"

    def planner(self, load):
        """How torch.distributed.checkpoint lays a state out (only SPMD has its own planners)."""
        return None


@dataclass
class SPMDRuntime(Runtime):
    """XLA with --fsdp (docs/scaling.md): one process per host, SPMD over all of the job's devices on one mesh axis,
    "fsdp"; the compiler follows the weights' layout, and a step computes the global batch as one."""
    mesh: object = None
    sharding = "SPMD"

    @property
    def replicas(self):
        return 1

    def wrap_model(self, model):
        self.shard(model.to(self.device).parameters())
        return model

    def shard(self, tensors):
        """FSDPv2's layout (with shard_maximal): each tensor's largest dimension split over the mesh's fsdp axis (a
        smaller one, as the 2 segment types, would leave it whole, which torch-xla's checkpoint reader cannot read),
        marked on the tensors themselves (torch-xla's wrapper would rename the parameters)."""
        import torch_xla.distributed.spmd as xs
        for t in tensors:
            largest = t.shape.index(max(t.shape))
            xs.mark_sharding(t, self.mesh, tuple("fsdp" if d == largest else None for d in range(t.dim())))

    def lay_out(self, optimizer):  # (torch-xla's checkpoint reader needs a layout)
        self.shard([t for s in optimizer.state.values() for t in s.values() if t.device.type == "xla"])

    def loader(self, batches):  # each batch split over the devices: (B, T) and (B, P) along B
        import torch_xla.distributed.spmd as xs
        from torch_xla.distributed.parallel_loader import MpDeviceLoader
        sharding = xs.ShardingSpec(self.mesh, ("fsdp", None), minibatch=True)
        return iter(MpDeviceLoader(batches, self.device, input_sharding=sharding))

    def planner(self, load):
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner
        return SPMDLoadPlanner() if load else SPMDSavePlanner()


def setup_runtime(device="auto", fsdp=False, batch_size=None):
    """Data parallelism comes from the launcher: torchrun's RANK / WORLD_SIZE / LOCAL_RANK (nccl on GPUs, gloo on
    CPU), or on XLA torch_xla.launch's processes (PJRT), one per core or chip; with fsdp on XLA, one process per
    host, SPMD over all of the job's devices, each host's `batch_size` split over its own."""
    device = resolve_device(device)
    if device == "xla":
        import torch_xla
        import torch_xla.runtime as xr
        if not fsdp:
            return Runtime("xla", torch_xla.device(), xr.global_ordinal(), xr.world_size())
        import torch_xla.distributed.spmd as xs
        xr.use_spmd()
        if batch_size and batch_size % xr.addressable_runtime_device_count():
            raise DataError(f"--batch-size {batch_size} does not split over this host's "
                            f"{xr.addressable_runtime_device_count()} devices")
        devices = xr.global_runtime_device_count()
        if xr.process_count() > 1 and not dist.is_initialized():  # hosts agree on checkpoints over gloo
            dist.init_process_group("gloo", init_method="xla://")
        return SPMDRuntime("xla", torch_xla.device(), xr.process_index(), xr.process_count(), fsdp=True,
                           mesh=xs.Mesh(list(range(devices)), (devices,), ("fsdp",)))
    try:
        rank, world_size, local_rank = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1),
                                                                                ("LOCAL_RANK", 0)))
    except ValueError:
        raise DataError("RANK, WORLD_SIZE and LOCAL_RANK are torchrun's (whole numbers): start the processes with "
                        "torchrun --nproc-per-node N") from None
    launched = "RANK" in os.environ  # (by torchrun)
    if not 0 <= rank < world_size or launched and (world_size > 1 or fsdp) and "MASTER_ADDR" not in os.environ:
        raise DataError(f"RANK={rank} and WORLD_SIZE={world_size} without torchrun's MASTER_ADDR, or RANK outside "
                        f"WORLD_SIZE: start the processes with torchrun --nproc-per-node N")
    torch_device = torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(torch_device)
    else:
        keep_freed_memory()
    if (world_size > 1 or fsdp) and not dist.is_initialized():  # (FSDP's device mesh needs a group, even of one)
        alone = {} if launched else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        try:
            dist.init_process_group("nccl" if device == "cuda" else "gloo", **alone)
        except RuntimeError as e:  # (torchrun restarted this process, say, and its peers are gone: gloo's 27 lines)
            raise OSError(f"process {rank} could not connect to the others: {str(e).splitlines()[0]}") from None
    return Runtime(device, torch_device, rank, world_size, fsdp=fsdp)


def keep_freed_memory():
    """glibc gives the memory a CPU step frees back to the kernel, and the next step faults it in again, page by page
    (docs/performance.md): the heap keeps up to 1 GB free here. The user's MALLOC_*/GLIBC_TUNABLES win."""
    libc = ctypes.CDLL(None) if os.name == "posix" else None
    if hasattr(libc, "gnu_get_libc_version") and not any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"
                                                         for k in os.environ):
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (fixed: no longer raised as blocks are freed)


def launch(function, device, *args, processes=True):
    """XLA: torch_xla.launch starts a process per device (processes=False: this one, for SPMD)."""
    if not processes or resolve_device(device) != "xla":
        return function(*args)
    import torch_xla
    torch_xla.launch(_without_index, args=(function, *args))


def _without_index(index, function, *args):  # torch_xla.launch passes the process index first
    function(*args)
