"""Parallelism applied to a plain model, in one place and one fixed order.

1. activation checkpointing (``parallel.activation_checkpointing``: none / selective = every other
   block / full = every block), wrapping each block with ``checkpoint_wrapper``;
2. ``torch.compile`` per block (``parallel.compile``);
3. data parallelism from the spec's resolved degrees: ``dp_shard`` > 1 → FSDP2 ``fully_shard`` on each
   block and then on the root, over a (dp_replicate, dp_shard) device mesh (HSDP when both > 1), with
   a ``MixedPrecisionPolicy`` (bf16 parameters for compute under ``train.dtype = bf16``, fp32
   gradient reduction, fp32 sharded master weights); else DDP when the world has > 1 rank.

Tensor parallelism (``parallel.tp`` > 1) is not built yet; the launcher refuses such a spec first.
The helpers below hide the DDP/FSDP2 differences from the training loop: gradient sync on/off for
accumulation, the gradient norm as a plain float, and a full (unsharded) state dict on CPU for the
checkpoint.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from pipelines.spec import JobSpec


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, blk in enumerate(model.layers):
        if mode == "full" or i % 2 == 0:  # selective: every other block, torchtitan's layer mode (freq 2)
            model.layers[i] = checkpoint_wrapper(blk, preserve_rng_state=False)


def apply_parallelism(model: nn.Module, spec: JobSpec, device: torch.device) -> tuple[nn.Module, str]:
    """Wrap ``model`` (already on ``device``) as the spec says; returns (model, mode) with mode one of
    ``single``, ``ddp``, ``fsdp2``, ``hsdp``."""
    deg = spec.degrees
    if deg["tp"] > 1:
        raise NotImplementedError("parallel.tp > 1: tensor parallel is not built yet; set parallel.tp=1")
    apply_activation_checkpointing(model, spec.parallel.activation_checkpointing)
    if spec.parallel.compile:
        for i, blk in enumerate(model.layers):
            model.layers[i] = torch.compile(blk)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if deg["dp_shard"] > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (deg["dp_replicate"], deg["dp_shard"]),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
        dp_mesh = mesh if deg["dp_replicate"] > 1 else mesh["dp_shard"]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if spec.train.dtype == "bf16" else torch.float32,
                                  reduce_dtype=torch.float32)
        for blk in model.layers:
            fully_shard(blk, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        return model, "hsdp" if deg["dp_replicate"] > 1 else "fsdp2"
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids), "ddp"
    return model, "single"


def grad_sync(model: nn.Module, mode: str, sync: bool):
    """Context for one micro step: gradients are reduced only when ``sync`` (the last micro step)."""
    if mode == "ddp" and not sync:
        return model.no_sync()
    if mode in ("fsdp2", "hsdp"):
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip and return the total gradient norm over all ranks' shards as a float."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    return float(norm)


def full_state_dicts(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts, unsharded, on CPU, with the plain model's parameter names (no
    DDP ``module.`` or checkpoint-wrapper prefixes), whatever the wrapping: a checkpoint loads into a
    plain ``Transformer``. Collective: every rank calls it; rank 0 gets the tensors."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, opt, options=opts)
