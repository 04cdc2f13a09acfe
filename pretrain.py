"""Masked-LM pre-training of RemBERT (the paper's Sections 3-7; optimisation as Table 14).

Work in progress: this commit provides the pieces finetune.py shares (the device block, the
optimizer, the learning-rate schedule, loading a pre-trained encoder); the training loop follows.
"""

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import Encoder, MaskedLM, ModelConfig


# ----------------------------------------------------------------------------------------------
# The device block: cpu, cuda (bf16 autocast) or xla, each optionally data-parallel

@dataclass
class Runtime:
    kind: str  # "cpu" | "cuda" | "xla"
    device: torch.device
    rank: int = 0  # global rank: which shard of the data this process reads
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self):
        return self.rank == 0

    def autocast(self):
        if self.kind == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def wrap_model(self, model):
        """Move to the device; DDP across torchrun processes. On XLA the replicas stay plain
        modules: optimizer_step all-reduces their gradients."""
        model = model.to(self.device)
        if self.world_size > 1 and self.kind != "xla":
            return torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[self.local_rank] if self.kind == "cuda" else None)
        return model

    def loader(self, batches):
        """Batches (dicts of tensors) on the device. On XLA, MpDeviceLoader uploads them in a
        background thread and cuts the lazy graph at each batch (one compiled step)."""
        if self.kind == "xla":
            from torch_xla.distributed.parallel_loader import MpDeviceLoader
            return iter(MpDeviceLoader(batches, self.device))
        return ({k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in batches)

    def optimizer_step(self, optimizer, max_grad_norm=None):
        """All-reduce gradients (XLA; DDP did it in backward), clip their global norm, step.
        xm.optimizer_step is reduce_gradients + step; clipping must sit between the two, so
        on XLA its two halves are called here."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self.kind == "xla":
            import torch_xla.core.xla_model as xm
            xm.reduce_gradients(optimizer)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()

    def all_reduce_sum(self, tensor):
        """Sum over processes (a device op: no host sync)."""
        if self.world_size == 1:
            return tensor
        if self.kind == "xla":
            import torch_xla.core.xla_model as xm
            return xm.all_reduce(xm.REDUCE_SUM, tensor)
        dist.all_reduce(tensor)
        return tensor

    def save(self, obj, path):
        """Write atomically from the main process: a temporary file, flushed, then renamed, so a
        crash mid-write never leaves a broken `path` (readers ignore *.tmp files)."""
        tmp = path + ".tmp"
        if self.kind == "xla":
            import torch_xla.core.xla_model as xm
            xm.save(obj, tmp, master_only=True, global_master=True)  # moves to CPU; all call it
        elif self.is_main:
            torch.save(obj, tmp)
        if self.is_main:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)


def setup_runtime(device="auto"):
    """The one device block. `device`: auto | cpu | cuda | xla. Data parallelism comes from the
    launcher: torchrun's RANK / WORLD_SIZE / LOCAL_RANK (nccl on GPUs, gloo on CPU), or on XLA
    torch_xla.launch's processes (PJRT), one per core or chip."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "xla" if os.environ.get("PJRT_DEVICE") else "cpu"
    if device not in ("cpu", "cuda", "xla"):
        raise ValueError(f"device must be auto, cpu, cuda or xla, got {device!r}")
    if device == "xla":
        import torch_xla
        import torch_xla.runtime as xr
        return Runtime("xla", torch_xla.device(), xr.global_ordinal(), xr.world_size())
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but torch sees no CUDA GPU")
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        torch_device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return Runtime(device, torch_device, rank, world_size, local_rank)


# ----------------------------------------------------------------------------------------------
# Optimisation (Table 14): AdamW, β 0.9/0.999, ε 1e-6, weight decay 0.01 on matrices only,
# linear warm-up then linear decay

def build_optimizer(model, lr, weight_decay):
    """AdamW over the trainable parameters. Biases and LayerNorm gains (the 1-D tensors) get no
    weight decay, as in BERT; frozen parameters (the pooler in pre-training) are left out."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()  # tied: once
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-6)


def lr_at(step, warmup, total, peak):
    """Learning rate of update `step` (0-based): linear warm-up over `warmup` updates to `peak`,
    then linear decay that would reach 0 at update `total` (so no update of the run has lr 0)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * max(0.0, (total - step) / max(1, total - warmup))


# ----------------------------------------------------------------------------------------------
# What fine-tuning keeps

def load_pretrained_encoder(path):
    """The Encoder of a pre-training checkpoint, without the pre-training-only layers and the
    masked-LM head (the paper drops both for fine-tuning)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model = MaskedLM(ModelConfig(**checkpoint["config"]))
    model.load_state_dict(checkpoint["model"])
    kept = sum(p.numel() for p in model.encoder.parameters())
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    print(f"{path}: kept the encoder ({kept:,} parameters); dropped {total - kept:,} "
          f"({model.config.pretraining_only_layers} pre-training-only layers + the MLM head)")
    return model.encoder
