"""The training loop, run once per rank by ``torchrun`` (see ``pipelines.train.launch``).

DDP or FSDP2 (``pipelines.train.parallel``, from the spec's ``parallel`` degrees) over gloo (CPU)
or NCCL (GPU), AdamW (no decay on norms), linear warmup + cosine decay to ``min_lr_ratio·lr``,
gradient accumulation without gradient sync on all but the last micro step,
gradient clipping. Rank 0 logs loss, lr, grad norm and tokens/s to stdout (progress bar) and to
MLflow, and writes checkpoints to the L0 tier every ``train.ckpt_every`` steps and at the end.
A NaN/inf loss or grad norm stops the run with an error naming the step.

    torchrun --nproc-per-node 2 -m pipelines.train.trainer --tokenize-manifest M --out DIR [--spec S]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipelines.manifest import load_manifest
from pipelines.spec import JobSpec, add_spec_args, spec_from_args


class TrainingDiverged(RuntimeError):
    pass


def lr_at(step: int, spec: JobSpec) -> float:
    """Linear warmup, then cosine to ``min_lr_ratio·lr`` or WSD (hold, then linear decay over the last
    ``decay_fraction`` of the steps); step is 0-based."""
    t = spec.train
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    floor = t.lr * t.min_lr_ratio
    if t.schedule == "wsd":
        decay_steps = max(1, round(t.decay_fraction * t.steps))
        decay_start = max(t.warmup_steps, t.steps - decay_steps)
        if step < decay_start:
            return t.lr
        progress = min(1.0, (step + 1 - decay_start) / max(1, t.steps - decay_start))
        return t.lr - (t.lr - floor) * progress
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return floor + 0.5 * (t.lr - floor) * (1 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float):
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _backend(spec: JobSpec) -> str:
    if spec.launcher.backend != "auto":
        return spec.launcher.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(spec: JobSpec) -> tuple[int, int, torch.device]:
    """Join the torchrun process group (NCCL on GPUs, gloo on CPU); returns (rank, world size, device)."""
    dist.init_process_group(_backend(spec))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if _backend(spec) == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(spec.launcher.threads_per_proc)
    return dist.get_rank(), dist.get_world_size(), device


def save_checkpoint(ckpt_dir: Path, model_sd: dict, optim_sd: dict, sampler, step: int, args_dict: dict,
                    tokenizer: Path, losses: list) -> Path:
    from pipelines.train.checkpoint import commit_local

    tmp = ckpt_dir.with_name(f".{ckpt_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save(model_sd, tmp / "model.pt")
    torch.save(optim_sd, tmp / "optim.pt")
    (tmp / "model_args.json").write_text(json.dumps(args_dict, indent=2))
    (tmp / "trainer_state.json").write_text(json.dumps(
        {"step": step, "loader": sampler.state_dict(), "losses": losses[-1000:]}, indent=2))
    (tmp / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    return commit_local(tmp, ckpt_dir, meta={"step": step})


def train(spec: JobSpec, tok_manifest_path: str, out: Path, ckpt_root: Path) -> dict:
    from pipelines.progress import progress
    from pipelines.train.loader import DPSampler, Prefetcher, TokenSamples
    from pipelines.train.model import ModelArgs, Transformer, param_count
    from pipelines.train.parallel import apply_parallelism, clip_grad_norm, dp_coords, full_state_dicts, grad_sync

    rank, world, device = init_distributed(spec)
    torch.manual_seed(spec.run.seed)

    tok = load_manifest(tok_manifest_path)
    shards = [tok.dir / s["prefix"] for s in tok.extra["shards"] if s["split"] == "train"]
    margs = ModelArgs.from_spec(spec.model, tok.extra["vocab_size"])
    if margs.vocab_size < tok.extra["vocab_size"]:
        raise ValueError(f"model.vocab_size={margs.vocab_size} is smaller than the tokenizer's "
                         f"{tok.extra['vocab_size']}")
    samples = TokenSamples(shards, margs.seq_len)
    t = spec.train
    dp_rank, dp_size = dp_coords(spec, rank)  # the ranks of one TP group read the same samples
    sampler = DPSampler(len(samples), spec.global_batch, dp_rank, dp_size, spec.run.seed)

    model = Transformer(margs).to(device)
    n_params = param_count(margs)
    model, mode = apply_parallelism(model, spec, device)
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=t.betas,
                            fused=device.type == "cuda")
    # FSDP2 casts parameters itself (MixedPrecisionPolicy); DDP and one rank use autocast
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=t.dtype == "bf16" and not mode.startswith(("fsdp2", "hsdp")))

    mlflow_client, run_id = None, spec.run.mlflow_run_id
    if rank == 0:
        from pipelines import tracking

        mlflow_client = tracking.client(spec)
        if run_id is None:
            run_id = tracking.start_run(spec, run_name=f"{spec.run.name}-train")
        from mlflow.entities import Param

        params = {"params": n_params, "world_size": world, "global_batch": spec.global_batch,
                  "seq_len": margs.seq_len, "n_layers": margs.n_layers, "d_model": margs.d_model,
                  "n_heads": margs.n_heads, "vocab_size": margs.vocab_size, "steps": t.steps, "lr": t.lr,
                  "backend": _backend(spec), "parallel": mode}
        try:
            mlflow_client.log_batch(run_id, params=[Param(f"train.{k}", str(v)) for k, v in params.items()])
        except Exception:  # params are immutable: a resumed/re-run stage logs them again
            pass

    tokens_per_step = spec.global_batch * margs.seq_len
    # MFU on GPUs only: 6N + 12·L·H·d_head·T FLOPs per token over the device's peak (pipelines.train.plan)
    from pipelines.train.plan import flops_per_token, mfu, model_shape
    from pipelines.train.plan import param_count as shape_params

    shape = {**model_shape(spec), "vocab": margs.vocab_size}
    fpt = flops_per_token(shape, shape_params(shape))
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    losses: list[tuple[int, float]] = []
    pending = []
    ckpt_name = None
    bar = progress(desc=f"train ({world} ranks)", total=t.steps, unit="step") if rank == 0 else None
    t_last, step_times = time.perf_counter(), []
    loader = Prefetcher(samples, sampler, t.grad_accum, depth=t.prefetch, pin_memory=device.type == "cuda")
    for step in range(t.steps):
        lr = lr_at(step, spec)
        for g in opt.param_groups:
            g["lr"] = lr
        batches = loader.next_step()
        loss_sum = torch.zeros((), device=device)
        for m, (x, y) in enumerate(batches):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with grad_sync(model, mode, m == t.grad_accum - 1):
                with autocast:
                    loss = model(x, y) / t.grad_accum
                loss.backward()
            loss_sum += loss.detach()
        gnorm = clip_grad_norm(model, t.grad_clip)
        if world > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)  # gloo has no AVG
            loss_sum /= world
        lval, gval = float(loss_sum), gnorm
        if not (math.isfinite(lval) and math.isfinite(gval)):
            opt.zero_grad(set_to_none=True)
            raise TrainingDiverged(f"step {step}: loss={lval} grad_norm={gval} is not finite — lower train.lr, "
                                   "check the data, or restart from the last checkpoint")
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        step_times.append(dt)
        if rank == 0:
            losses.append((step + 1, lval))
            tps = tokens_per_step / dt
            bar.update(1)
            bar.set_postfix(loss=f"{lval:.3f}", tok_s=f"{tps:,.0f}", lr=f"{lr:.2e}")
            metrics = {"train/loss": lval, "train/lr": lr, "train/grad_norm": gval, "train/tokens_per_s": tps}
            u = mfu(tps, fpt, world, dev_name, t.dtype) if dev_name else None
            if u is not None:
                metrics["train/mfu"] = u
            pending.append((step + 1, metrics))
            if (step + 1) % t.log_every == 0 or step + 1 == t.steps:
                _flush(mlflow_client, run_id, pending)
        if (step + 1) % t.ckpt_every == 0 or step + 1 == t.steps:
            ckpt_name = f"step-{step + 1:06d}"
            model_sd, optim_sd = full_state_dicts(model, opt)  # collective
            if rank == 0:
                save_checkpoint(ckpt_root / ckpt_name, model_sd, optim_sd, sampler, step + 1, margs.to_dict(),
                                tok.output("tokenizer"), losses)
            dist.barrier()
    loader.close()
    if bar is not None:
        bar.close()
    steady = step_times[min(len(step_times) - 1, 5):] or step_times
    result = {
        "steps": t.steps, "final_loss": losses[-1][1] if losses else None, "params": n_params,
        "tokens_per_s": tokens_per_step * len(steady) / sum(steady), "tokens_seen": tokens_per_step * t.steps,
        "flops_per_token": fpt, "device": dev_name or "cpu",
        "world_size": world, "backend": _backend(spec), "checkpoint": ckpt_name, "mlflow_run_id": run_id,
        "parallel": mode,
    }
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
        (out / "result.json").write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return result


def _flush(client, run_id, pending) -> None:
    if client is None or not pending:
        pending.clear()
        return
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, ts, s) for s, d in pending for k, v in d.items()])
    pending.clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="torchrun … -m pipelines.train.trainer",
                                 description="One rank of a training run (launch it with pipelines.train.launch).")
    add_spec_args(ap)
    ap.add_argument("--tokenize-manifest", required=True)
    ap.add_argument("--out", required=True, help="Directory for losses.json / result.json (rank 0).")
    ap.add_argument("--ckpt-root", required=True, help="L0 directory for this run's checkpoints.")
    args = ap.parse_args(argv)
    spec = spec_from_args(args)
    try:
        train(spec, args.tokenize_manifest, Path(args.out), Path(args.ckpt_root))
    except TrainingDiverged as e:
        print(f"train: error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
