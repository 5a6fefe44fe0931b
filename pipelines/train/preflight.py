"""Preflight before a training run, on the same ranks and backend the run will use (torchrun).

1. **All-reduce bandwidth**: ``iters`` all-reduces of a ``size_mb`` fp32 tensor; reports algorithm
   bandwidth (bytes / time) and bus bandwidth (× 2(n−1)/n, nccl-tests' convention), gloo on CPU,
   NCCL on GPU.
2. **Straggler screen**: every rank times the same forward + backward steps of the spec's model on
   its own, in lockstep (a barrier before each step, outside the timed region, so step k of every
   rank runs at the same time, under the same machine load); the per-step times of every rank are
   gathered. A rank's *excess* is the median over the steps of its time minus the lower median of all
   ranks' times in that same step; its *noise* is the larger of the other ranks' spread (the median
   over the steps of how far each strays from that lower median) and the spread of its own per-step
   excess (its median absolute deviation). A rank is named when its excess is
   over ``STRAGGLER_FLOOR_S`` (50 ms: below that it is timing noise) and over ``straggler_factor`` × its
   noise. Load that slows every rank alike cancels in the per-step differences, and one slow step for
   everyone does not move a median over the steps, so a busy machine names no straggler, and a rank
   consistently slower than its peers is named however slow every step is.
3. **Smoke steps**: ``smoke_steps`` optimizer steps on one fixed batch through the parallel wrapping
   the run will use (DDP / FSDP2 / TP); the loss must drop, or the preflight fails.

Rank 0 writes ``preflight.json``; a rank exits non-zero when a check fails, naming it.

As a stage (the DAG's ``preflight`` task, before ``train``), it launches the ranks through the
train stage's launcher (torchrun here, a PyTorchJob on Kubernetes) with the model shape and vocab
of the tokenize stage's output, and commits a manifest with the measurements; a failed check fails
the stage with the checks' messages. A health check of the machines of *now*, it is never skipped
as already done.

    python -m pipelines.train.preflight --tokenize-manifest M [--spec S] [--set …] [--report R]
    torchrun --nproc-per-node 2 -m pipelines.train.preflight --rank-out DIR --vocab-size V   # one rank
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from pipelines.cli import run_and_log, stage_dir, stage_main
from pipelines.exit_codes import RETRY
from pipelines.launch import outcomes as xc
from pipelines.launch.ranks import TrainError, TrainRetry, check_supported, collect, run_ranks
from pipelines.manifest import StageError, atomic_write_text, input_ref, read_small_text
from pipelines.spec import JobSpec, add_spec_args, spec_from_args
from pipelines.tracking import airflow_ids
from pipelines.train.job import rank_workdir


class PreflightFailed(StageError):
    """The ranks are unhealthy (slow all-reduce, a straggler, no progress): the nodes, not the spec, so exit 75
    (``RETRY``): a retry may land elsewhere (on Kubernetes a new job: this one's verdict is read once,
    ``job_verdict``)."""

    exit_code = RETRY
    job_verdict = True

    def __init__(self, message: str, result: dict | None = None):
        super().__init__(message)
        self.result = result


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
    # fault injection (tests): LLMP_PREFLIGHT_DELAY_S more on rank LLMP_PREFLIGHT_SLOW_RANK, and
    # LLMP_PREFLIGHT_LOAD_S more on every rank (a machine whose every step is slow)
    slow = float(os.environ.get("LLMP_PREFLIGHT_DELAY_S", "0")) if \
        os.environ.get("LLMP_PREFLIGHT_SLOW_RANK") == str(dist.get_rank()) else 0.0
    slow += float(os.environ.get("LLMP_PREFLIGHT_LOAD_S", "0"))
    for _ in range(steps):
        dist.barrier()  # lockstep: step k of every rank under the same load (not timed)
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


STRAGGLER_FLOOR_S = 0.05  # slower by less than this is timing noise (a loaded machine, a 5 ms step), not a straggler
STRAGGLER_REL = 0.1  # nor is a rank slower by under a tenth of the step (a 3 % slower GPU is not worth a failed run)


def _mad(xs: list[float]) -> float:
    m = statistics.median(xs)
    return statistics.median(abs(x - m) for x in xs)


def per_rank_steps(times: list[list[float]] | list[float]) -> list[list[float]]:
    """``times[r]`` as rank r's list of step times (a plain number is one step)."""
    return [[float(x)] if isinstance(x, (int, float)) else [float(v) for v in x] for x in times]


def straggler_stats(times: list[list[float]] | list[float]) -> tuple[list[float], list[float]]:
    """Each rank's excess (the median over the steps of its step time minus the lower median of all ranks' times in
    the same step) and noise (the larger of the other ranks' spread, the median over the steps of how far each
    strays from that lower median, and the spread of its own per-step excess, its median absolute deviation).
    ``times[r][k]`` is rank r's k-th step (steps run in lockstep); a plain number per rank is one step. Load common
    to all ranks in a step cancels in the differences."""
    t = per_rank_steps(times)
    steps = min(len(x) for x in t)
    ref = [statistics.median_low([x[k] for x in t]) for k in range(steps)]
    diffs = [[x[k] - ref[k] for k in range(steps)] for x in t]
    excess = [statistics.median(d) for d in diffs]
    spread = [statistics.median(abs(v) for v in d) for d in diffs]  # how far a rank strays from the others
    noise = [max([_mad(d)] + [spread[q] for q in range(len(t)) if q != r]) for r, d in enumerate(diffs)]
    return excess, noise


def stragglers(times: list[list[float]] | list[float], factor: float) -> list[int]:
    """The ranks whose excess over the other ranks in the same steps is over ``STRAGGLER_FLOOR_S``, over
    ``STRAGGLER_REL`` × the step time (the median over the steps of all ranks' lower median) and over ``factor`` ×
    their noise (see :func:`straggler_stats`)."""
    excess, noise = straggler_stats(times)
    t = per_rank_steps(times)
    step = statistics.median(statistics.median_low([x[k] for x in t]) for k in range(min(len(x) for x in t)))
    floor = max(STRAGGLER_FLOOR_S, STRAGGLER_REL * step)
    return [r for r, (e, n) in enumerate(zip(excess, noise)) if e > floor and e > factor * n]


def preflight(spec: JobSpec, out: Path, vocab: int, size_mb: float = 16.0, iters: int = 10, timing_steps: int = 7,
              n_smoke: int = 8, straggler_factor: float = 1.5) -> dict:
    """One rank's part (under torchrun)."""
    from pipelines.train.trainer import dist_backend, init_distributed

    rank, world, device = init_distributed(spec)
    vocab = spec.model.vocab_size or vocab
    bw = allreduce_bandwidth(size_mb, iters, device)
    per_step = [None] * world
    dist.all_gather_object(per_step, local_step_times(spec, vocab, timing_steps, device))
    all_times = [statistics.median(x) for x in per_step]
    med = statistics.median_low(all_times)  # the lower median: with 2 ranks, the faster one
    excess, noise = straggler_stats(per_step)
    slow = stragglers(per_step, straggler_factor)
    losses = smoke_steps(spec, vocab, n_smoke, device)
    result = {"world_size": world, "backend": dist_backend(spec), "allreduce": bw,
              "step_seconds_by_rank": all_times, "median_step_seconds": med, "straggler_factor": straggler_factor,
              "step_seconds_by_rank_and_step": per_step, "straggler_excess_seconds": excess,
              "straggler_noise_seconds": noise,
              "stragglers": slow, "smoke_losses": losses,
              "loss_dropped": losses[-1] < losses[0]}
    failures = []
    if slow:
        failures.append(f"straggler rank(s) {slow}: slower than the other ranks in the same steps by "
                        f"{', '.join(f'{excess[r]:.3f}' for r in slow)} s, over {STRAGGLER_FLOOR_S * 1e3:.0f} ms and "
                        f"{straggler_factor}× the noise ({', '.join(f'{noise[r]:.3f}' for r in slow)} s); median step "
                        f"times {', '.join(f'{t:.3f}' for t in all_times)} s")
    if not result["loss_dropped"]:
        failures.append(f"smoke steps: loss did not drop ({losses[0]:.4f} → {losses[-1]:.4f})")
    result["failures"] = failures
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        # whole or absent (temp + rename), and named for the attempt the launcher started these ranks in
        atomic_write_text(out / "preflight.json", json.dumps({**result, "attempt": xc.rank_attempt(out)}, indent=2))
        print(f"preflight: {world} ranks ({result['backend']}): all-reduce {bw['busbw_GBps']:.2f} GB/s bus bandwidth "
              f"({bw['size_bytes'] >> 20} MiB); step {med * 1e3:.1f} ms median; smoke loss {losses[0]:.3f} → "
              f"{losses[-1]:.3f}" + ("; FAILED: " + "; ".join(failures) if failures else "; ok"), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return result


LAUNCH_KEEP_S = 7 * 86400  # an earlier launch's work dir (its report, the ranks' spec) is kept this long


def sweep_launches(base: Path, keep: str) -> None:
    """Remove the work dirs of earlier launches (``base/<launch>``) older than :data:`LAUNCH_KEEP_S`, never
    ``keep``'s: each DAG run leaves one; a deferred run's own is far younger."""
    try:
        old = [d for d in base.iterdir() if d.is_dir() and d.name != keep
               and time.time() - d.stat().st_mtime > LAUNCH_KEEP_S]
    except OSError:  # none yet; a listing that fails leaves them for the next run
        return
    for d in old:
        shutil.rmtree(d, ignore_errors=True)


def launch_id() -> str:
    """Which launch of the preflight this is: one per Airflow DAG run (a deferred task's resume, a retry, collect
    the job they submitted), a new one for each run outside Airflow. The job and its work dir are named by it, so
    a later run never adopts an earlier run's finished job and its report (preflight always measures again)."""
    ids = airflow_ids()
    key = f"{ids.get('airflow.dag_id')}/{ids.get('airflow.run_id')}" if "airflow.run_id" in ids else uuid.uuid4().hex
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def run(spec: JobSpec, tok, out_dir: str | None = None, size_mb: float = 16.0,
        straggler_factor: float = 1.5):
    """The stage: launch the ranks, commit the measurements, or raise :class:`PreflightFailed`."""
    check_supported(spec)
    sd = stage_dir(spec, "preflight", [input_ref(tok)], out_dir, force=True)

    def body(tmp: Path):
        launch = launch_id()
        work = rank_workdir(spec, sd, tmp)
        if spec.launcher.on_kubernetes:  # the job's own dir, kept for a deferred task's resume: this launch's only
            sweep_launches(work, launch)
            work = work / launch
        work.mkdir(parents=True, exist_ok=True)
        spec_file = work / "spec.yaml"
        spec.write_work_file(spec_file)
        report = work / "preflight.json"  # a fresh temp dir's, or on Kubernetes this launch's own (kept for a resume)

        def reported() -> dict | None:
            """The report of this attempt's ranks; None when there is none (yet), or only an earlier attempt's (on
            Kubernetes a retry's job writes into the same dir: the try before's report is not its verdict)."""
            try:
                res = json.loads(read_small_text(report))
            except FileNotFoundError:
                return None
            except (OSError, ValueError) as e:
                raise TrainRetry(f"{report} cannot be read ({e}); a retry measures again") from None
            return res if isinstance(res, dict) and res.get("attempt") == xc.current_attempt(work) else None

        def verdict() -> dict:  # a failed check is this job's verdict: read once, a retry launches a new job
            res = reported()
            if res is None:
                raise TrainRetry(f"the preflight ranks finished but no report of theirs is in {work}; a retry "
                                 "measures again")
            if res["failures"]:
                raise PreflightFailed("preflight failed: " + "; ".join(res["failures"]), res)
            return res

        try:
            run_ranks(spec, "pipelines.train.preflight",
                      ["--spec", str(spec_file), "--rank-out", str(work), "--vocab-size", str(tok.extra["vocab_size"]),
                       "--size-mb", str(size_mb), "--straggler-factor", str(straggler_factor)],
                      run_id=f"preflight-{sd.final.name[:8]}-{launch}", restarts=False, detachable=True, work=work,
                      judge=lambda: reported() is not None and verdict())
        except TrainError:  # its own status (2: refused, 75: the nodes or the API), unless the ranks reported
            if reported() is None:
                raise
        res = verdict()
        collect(work, tmp, ["preflight.json"])
        (tmp / "spec.yaml").write_text(spec.to_yaml())  # the kept copy: no secrets
        bw = res["allreduce"]
        return sd.commit({"report": "preflight.json"},
                         counts={"world_size": res["world_size"], "stragglers": len(res["stragglers"])},
                         metrics={"allreduce_busbw_GBps": bw["busbw_GBps"], "allreduce_algbw_GBps": bw["algbw_GBps"],
                                  "median_step_seconds": res["median_step_seconds"],
                                  "smoke_loss_first": res["smoke_losses"][0],
                                  "smoke_loss_last": res["smoke_losses"][-1]},
                         extra={"backend": res["backend"]})

    return run_and_log(spec, sd, body)


def _options(ap) -> None:
    ap.add_argument("--size-mb", type=float, default=16.0, help="All-reduce message size (MiB).")
    ap.add_argument("--straggler-factor", type=float, default=1.5,
                    help="A rank slower than the other ranks in the same steps (median over the steps) by more than "
                    "50 ms and by more than this × the step-to-step noise is a straggler.")


def rank_main(argv: list[str]) -> int:
    """One rank under torchrun (what the stage launches): measure, and rank 0 writes preflight.json."""
    ap = argparse.ArgumentParser(prog="python -m pipelines.train.preflight --rank-out DIR",
                                 description="One preflight rank (launched by the preflight stage under torchrun).")
    add_spec_args(ap)
    ap.add_argument("--rank-out", required=True, help="Write preflight.json here (rank 0).")
    ap.add_argument("--vocab-size", type=int, help="The tokenizer's vocab (when model.vocab_size is unset).")
    _options(ap)
    args = ap.parse_args(argv)
    spec = spec_from_args(args)
    xc.rank_attempt(Path(args.rank_out))  # the attempt these ranks belong to, read now: a rank that outlives its job
    # does not take the next attempt's id for its report
    vocab = args.vocab_size or spec.model.vocab_size or spec.tokenizer.vocab_size
    res = preflight(spec, Path(args.rank_out), vocab, size_mb=args.size_mb, straggler_factor=args.straggler_factor)
    return 1 if res["failures"] else 0


def summary(m) -> str:
    return (f"preflight: ok: {m.counts['world_size']} ranks, all-reduce {m.metrics['allreduce_busbw_GBps']:.2f} GB/s, "
            f"step {m.metrics['median_step_seconds'] * 1e3:.1f} ms, smoke loss {m.metrics['smoke_loss_first']:.3f} → "
            f"{m.metrics['smoke_loss_last']:.3f}; manifest {m.path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--rank-out" or a.startswith("--rank-out=") for a in argv):
        return rank_main(argv)

    return stage_main("preflight", run, summary, argv, add_args=_options,
                      call=lambda spec, args, ups: run(spec, *ups, args.output, args.size_mb, args.straggler_factor))


if __name__ == "__main__":
    sys.exit(main())
