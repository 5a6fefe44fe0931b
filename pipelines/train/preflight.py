"""Preflight before a training run, on the same ranks and backend the run will use (torchrun).

1. **All-reduce bandwidth**: ``iters`` all-reduces of a ``size_mb`` fp32 tensor; reports algorithm
   bandwidth (bytes / time) and bus bandwidth (× 2(n−1)/n, nccl-tests' convention), gloo on CPU,
   NCCL on GPU.
2. **Straggler screen**: every rank times the same forward + backward steps of the spec's model on
   its own (no communication inside the timed region); the median step time of each rank is
   gathered and a rank slower than ``straggler_factor`` × the lower median of all ranks is named.
3. **Smoke steps**: ``smoke_steps`` optimizer steps on one fixed batch through the parallel wrapping
   the run will use (DDP / FSDP2 / TP); the loss must drop, or the preflight fails.

Rank 0 writes ``preflight.json``; the process exits non-zero when a check fails, naming it.

    torchrun --nproc-per-node 2 -m pipelines.train.preflight --out DIR [--spec S] [--set …]
    python -m pipelines.train.preflight --launch --out DIR [--spec S]   # starts torchrun itself
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipelines.spec import JobSpec, add_spec_args, spec_from_args


class PreflightFailed(RuntimeError):
    pass


def allreduce_bandwidth(size_mb: float, iters: int, device: torch.device) -> dict:
    n = dist.get_world_size()
    x = torch.ones(int(size_mb * (1 << 20) / 4), dtype=torch.float32, device=device)
    dist.all_reduce(x)  # warm up the connections
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = (time.perf_counter() - t0) / iters
    nbytes = x.numel() * 4
    alg = nbytes / dt
    return {"size_bytes": nbytes, "seconds_per_op": dt, "algbw_GBps": alg / 1e9,
            "busbw_GBps": alg * 2 * (n - 1) / n / 1e9}


def local_step_times(spec: JobSpec, vocab: int, steps: int, device: torch.device) -> list[float]:
    from pipelines.train.model import ModelArgs, Transformer

    torch.manual_seed(spec.run.seed)
    model = Transformer(ModelArgs.from_spec(spec.model, vocab)).to(device)
    x = torch.randint(0, vocab, (spec.train.micro_batch, spec.model.seq_len), device=device)
    times = []
    slow = float(os.environ.get("LLMP_PREFLIGHT_DELAY_S", "0")) if \
        os.environ.get("LLMP_PREFLIGHT_SLOW_RANK") == str(dist.get_rank()) else 0.0  # fault injection (tests)
    for _ in range(steps):
        t0 = time.perf_counter()
        model(x, x).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        time.sleep(slow)
        times.append(time.perf_counter() - t0)
    return times


def smoke_steps(spec: JobSpec, vocab: int, steps: int, device: torch.device) -> list[float]:
    from pipelines.train.model import ModelArgs, Transformer
    from pipelines.train.parallel import apply_parallelism, clip_grad_norm

    torch.manual_seed(spec.run.seed)
    model, _ = apply_parallelism(Transformer(ModelArgs.from_spec(spec.model, vocab)).to(device), spec, device)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.train.lr)
    g = torch.Generator().manual_seed(spec.run.seed)  # the same batch on every rank and step
    x = torch.randint(0, vocab, (spec.train.micro_batch, spec.model.seq_len + 1), generator=g).to(device)
    losses = []
    for _ in range(steps):
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        clip_grad_norm(model, spec.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def preflight(spec: JobSpec, out: Path, size_mb: float = 16.0, iters: int = 10, timing_steps: int = 5,
              n_smoke: int = 8, straggler_factor: float = 1.5) -> dict:
    from pipelines.train.trainer import _backend, init_distributed

    rank, world, device = init_distributed(spec)
    vocab = spec.model.vocab_size or spec.tokenizer.vocab_size
    bw = allreduce_bandwidth(size_mb, iters, device)
    mine = statistics.median(local_step_times(spec, vocab, timing_steps, device))
    all_times = [None] * world
    dist.all_gather_object(all_times, mine)
    med = statistics.median_low(all_times)  # the lower median: with 2 ranks, the faster one
    stragglers = [r for r, t in enumerate(all_times) if t > straggler_factor * med]
    losses = smoke_steps(spec, vocab, n_smoke, device)
    result = {"world_size": world, "backend": _backend(spec), "allreduce": bw,
              "step_seconds_by_rank": all_times, "median_step_seconds": med, "straggler_factor": straggler_factor,
              "stragglers": stragglers, "smoke_losses": losses,
              "loss_dropped": losses[-1] < losses[0]}
    failures = []
    if stragglers:
        failures.append(f"straggler rank(s) {stragglers}: step time > {straggler_factor}× the median {med:.3f} s "
                        f"({', '.join(f'{t:.3f}' for t in all_times)})")
    if not result["loss_dropped"]:
        failures.append(f"smoke steps: loss did not drop ({losses[0]:.4f} → {losses[-1]:.4f})")
    result["failures"] = failures
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "preflight.json").write_text(json.dumps(result, indent=2))
        print(f"preflight: {world} ranks ({result['backend']}): all-reduce {bw['busbw_GBps']:.2f} GB/s bus bandwidth "
              f"({bw['size_bytes'] >> 20} MiB); step {med * 1e3:.1f} ms median; smoke loss {losses[0]:.3f} → "
              f"{losses[-1]:.3f}" + ("; FAILED: " + "; ".join(failures) if failures else "; ok"), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.train.preflight",
                                 description="All-reduce bandwidth, straggler screen and smoke steps on the run's ranks.")
    add_spec_args(ap)
    ap.add_argument("--out", required=True, help="Directory for preflight.json.")
    ap.add_argument("--launch", action="store_true", help="Start torchrun with the spec's launcher settings.")
    ap.add_argument("--size-mb", type=float, default=16.0)
    ap.add_argument("--straggler-factor", type=float, default=1.5)
    args = ap.parse_args(argv)
    spec = spec_from_args(args)
    if args.launch:
        from pipelines.train.launch import TrainError, run_torchrun

        fwd = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--launch"]
        try:
            run_torchrun(spec, fwd, module="pipelines.train.preflight")
        except TrainError as e:
            print(f"preflight: error: {e}", file=sys.stderr)
            return 1
        return 0
    res = preflight(spec, Path(args.out), size_mb=args.size_mb, straggler_factor=args.straggler_factor)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
