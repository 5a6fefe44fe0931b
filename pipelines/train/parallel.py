"""Parallelism applied to a plain model, in one place and one fixed order.

0. tensor parallel (DTensor ``parallelize_module``) when ``parallel.tp`` > 1;
1. activation checkpointing (``parallel.activation_checkpointing``: none / selective = every other
   block / full = every block), wrapping each block with ``checkpoint_wrapper``;
2. ``torch.compile`` (``parallel.compile``): of the trunk (embedding, blocks, final norm) as one graph on one
   process, of each block on its own on several (``parallel.compile_scope``, :func:`compile_scope`); and the LM
   head's loss a chunk of tokens at a time (``train.loss_chunk_tokens``, :mod:`pipelines.train.loss`, its kernel
   compiled when the model is, on a GPU);
3. data parallelism from the spec's resolved degrees: ``dp_shard`` > 1 → FSDP2 ``fully_shard`` on each
   block and then on the root, over a (dp_replicate, dp_shard) device mesh (HSDP when both > 1), with
   a ``MixedPrecisionPolicy`` (bf16 parameters for compute under ``train.dtype = bf16``, fp32
   gradient reduction, fp32 sharded master weights); else DDP when the world has > 1 rank.

Tensor parallelism (``parallel.tp`` > 1) comes first, on the innermost mesh dimension
(:func:`apply_tensor_parallel`), so FSDP2 then shards the TP-sharded DTensors along the DP axis (2-D).
The helpers below hide the DDP/FSDP2 differences from the training loop: gradient sync on/off for
accumulation and the gradient norm as a plain float. (Checkpoints are sharded DCP state dicts:
``pipelines.train.ckpt.checkpointer``.)
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from pipelines.spec import JobSpec
from pipelines.train import loss


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, blk in enumerate(model.layers):
        if mode == "full" or i % 2 == 0:  # selective: every other block, torchtitan's layer mode (freq 2)
            model.layers[i] = checkpoint_wrapper(blk, preserve_rng_state=False)


TP_PLAN = {"attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise", "attn.wo": "rowwise",
           "ffn.w1": "colwise", "ffn.w3": "colwise", "ffn.w2": "rowwise"}


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Megatron-style TP per block with DTensor: Q/K/V and the SwiGLU's w1/w3 split by output features
    (each rank computes heads / tp attention heads and f / tp hidden units), ``wo``/``w2`` by input
    features with one all-reduce each. Embeddings, norms and the head stay replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for blk in model.layers:
        parallelize_module(blk, tp_mesh, {name: styles[s]() for name, s in TP_PLAN.items()})


def runtime_degrees(spec: JobSpec) -> dict[str, int]:
    """The parallel degrees for the world torchrun really gave (an elastic job may run on fewer nodes than the
    launcher section names); the spec's own world size outside a process group."""
    return spec.parallel.resolve(dist.get_world_size() if dist.is_initialized() else spec.world_size)


def dp_coords(spec: JobSpec, rank: int) -> tuple[int, int]:
    """(DP rank, DP size) of a global rank: ranks are laid out (dp_replicate, dp_shard, tp), TP fastest,
    so the ranks of one TP group read the same samples."""
    deg = runtime_degrees(spec)
    return rank // deg["tp"], deg["dp"]


def compile_scope(spec: JobSpec, sharded: bool, world: int) -> str | None:
    """What ``parallel.compile`` compiles: None (nothing), ``block`` (each block on its own: FSDP2's and TP's
    per-block wrapping needs it; 'auto' on several processes, where DDP's gradient buckets overlap the backward
    block by block) or ``model`` (the trunk as one graph: 'auto' on one process)."""
    p = spec.parallel
    if not p.compile:
        return None
    if p.compile_scope == "auto":
        return "model" if world == 1 and not sharded else "block"
    return p.compile_scope


def apply_parallelism(model: nn.Module, spec: JobSpec, device: torch.device) -> tuple[nn.Module, str]:
    """Wrap ``model`` (already on ``device``) as the spec says; returns (model, mode) with mode one of
    ``single``, ``ddp``, ``fsdp2``, ``hsdp``, ``tp``, ``fsdp2+tp``, ``hsdp+tp``."""
    deg = runtime_degrees(spec)
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = None
    if deg["tp"] > 1 or deg["dp_shard"] > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (deg["dp_replicate"], deg["dp_shard"], deg["tp"]),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    if deg["tp"] > 1:  # (TP with DDP is refused by the spec validator)
        apply_tensor_parallel(model, mesh["tp"])
    apply_activation_checkpointing(model, spec.parallel.activation_checkpointing)
    scope = compile_scope(spec, sharded=mesh is not None, world=world)
    if scope == "block":
        for i, blk in enumerate(model.layers):
            model.layers[i] = torch.compile(blk)
    elif scope == "model":  # one graph from the tokens to the final norm: what the blocks' elementwise work fuses into
        model.trunk = torch.compile(model.trunk)
    # the head and its loss a chunk of tokens at a time, compiled as the blocks are
    model.loss_fn = loss.for_spec(spec, model.args.vocab_size, device)
    tp = "+tp" if deg["tp"] > 1 else ""
    if deg["dp_shard"] > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dp_mesh = mesh["dp_replicate", "dp_shard"] if deg["dp_replicate"] > 1 else mesh["dp_shard"]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if spec.train.dtype == "bf16" else torch.float32,
                                  reduce_dtype=torch.float32)
        for blk in model.layers:
            fully_shard(blk, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        return model, ("hsdp" if deg["dp_replicate"] > 1 else "fsdp2") + tp
    if deg["tp"] > 1:
        return model, "tp"
    if world > 1:
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids), "ddp"
    return model, "single"


def grad_sync(model: nn.Module, mode: str, sync: bool):
    """Context for one micro step: gradients are reduced only when ``sync`` (the last micro step)."""
    if mode == "ddp" and not sync:
        return model.no_sync()
    if mode.startswith(("fsdp2", "hsdp")):
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip gradients to a total norm of ``max_norm``; return the norm before clipping as a float.

    Plain tensors (one rank, DDP) go through ``torch.nn.utils.clip_grad_norm_``. DTensor gradients
    (FSDP2 shards, TP shards, or both, next to replicated plain ones) are summed as squares of their
    local shards, all-reduced over exactly the mesh dimensions they are sharded on."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not any(isinstance(g, DTensor) for g in grads):
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    total_sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for g in grads:
        if isinstance(g, DTensor):
            local = g.to_local().float().pow(2).sum()
            for dim, placement in enumerate(g.placements):
                if placement.is_shard():
                    dist.all_reduce(local, group=g.device_mesh.get_group(dim))
            total_sq += local
        else:
            total_sq += g.float().pow(2).sum()
    norm = float(total_sq.sqrt())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm
