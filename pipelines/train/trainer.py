"""The training loop, run once per rank by ``torchrun`` (see ``pipelines.train.launch``).

DDP or FSDP2 (``pipelines.train.parallel``, from the spec's ``parallel`` degrees resolved against the world
torchrun really gives) over gloo (CPU) or NCCL (GPU), AdamW (no decay on norms), linear warmup + cosine (or
WSD) decay, gradient accumulation without gradient sync on all but the last micro step, gradient clipping.
Rank 0 logs loss, lr, grad norm and tokens/s to stdout (progress bar) and to MLflow.

Surviving failure (``pipelines.train.ckpt.checkpointer``, ``pipelines.train.resilience``):

* **resume**: at start every rank restores the newest step that verifies on the nearest tier (L0 → L1 → L2;
  ``train.resume``) — model, optimizer, step, loader position, skipped batches, RNG states, loss history — so a
  ``torchrun`` restart, an Airflow retry or a rescheduled pod continues where the last checkpoint left off;
  on another world size DCP reshards and grad accumulation changes to keep the global batch;
* **sharded async checkpoints** every ``train.ckpt_every`` steps (or the Young/Daly interval with ``auto``) and
  at the end, promoted L0 → L1 → L2 during the run;
* **loss spikes**: a non-finite loss / grad norm, or a loss above mean + k·σ of the trailing window, is not
  applied; the run rolls back to the last checkpoint, skips that global batch (recorded in the checkpoint) and
  goes on; after ``train.max_rollbacks`` it fails naming the step;
* **preemption**: on SIGTERM / SIGUSR1 every rank stops after the same step (agreed in the per-step all-reduce),
  commits it to L0 and L1 within ``train.preempt_grace_s`` and exits 0 with an outcome file; the launcher then
  exits ``exit_codes.RETRY`` (75);
* **hangs**: the main thread beats its progress (phase and step) and every rank watches its node's ranks
  (``pipelines.train.heartbeat``): a rank silent past ``train.hang_timeout_s`` is named with its stack and killed,
  and torchrun restarts the ranks from the newest verified step.

    torchrun --nproc-per-node 2 -m pipelines.train.trainer --tokenize-manifest M --out DIR --ckpt-root L0/RUN [--spec S]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Optional, TypeVar

import torch
import torch.distributed as dist

from pipelines import tracking
from pipelines.exit_codes import RETRY
from pipelines.launch import outcomes as xc
from pipelines.launch.outcomes import PREEMPT_SIGNALS
from pipelines.manifest import load_manifest
from pipelines.procs import main_bounded, usable_cores
from pipelines.progress import progress
from pipelines.spec import JobSpec, add_spec_args, resolve_path, spec_from_args
from pipelines.storage import faults as storage_faults
from pipelines.storage import oserrors
from pipelines.train import heartbeat
from pipelines.train.ckpt import history
from pipelines.train.ckpt.protocol import (CheckpointError, CopyRefused, L2Refused, TierUnavailable,
                                           UnsafeCheckpoint, step_name)
from pipelines.train.ckpt.tiers import clear_run, read_lineage, write_lineage
from pipelines.train.loader import (Prefetcher, TokenOutOfVocab, mixture_keys, mixture_metrics, sampler_for,
                                   train_samples)
from pipelines.train.plan import flops_per_token, mfu, model_shape, param_count as shape_params
from pipelines.train.resilience import Faults, SpikeGuard, young_daly_steps


FWD_BWD, AGREE = "forward/backward", "all-reduce (agree on a spike or a notice)"  # heartbeat phases in a step
MLFLOW = "MLflow logging (rank 0; the others wait for its word)"  # its client retries for minutes
# the final close's waits in a row, each bounded by the collective timeout: the save in flight, the promotions'
# drain, the final step promoted again when L1 lacks it, L2 for half of it (Checkpointer.close)
CLOSE_WAITS = 3.5
WARM_STEPS = 5  # the first steps of a start (compile, first collectives) are left out of the steady rates
T = TypeVar("T")


class TrainingDiverged(RuntimeError):
    pass


class Preempted(RuntimeError):
    """Every rank stopped on a preemption notice after ``step``, which is committed on L1."""

    def __init__(self, step: int, signame: str):
        super().__init__(f"preempted ({signame}) after step {step}")
        self.step, self.signame = step, signame


class MlflowUnavailable(RuntimeError):
    """MLflow did not answer rank 0 past its client's retries (the server down, throttling, 5xx): every rank stops
    with it (exit_codes.RETRY) and a retry resumes from the last checkpoint."""


class Notice:
    """A preemption notice (SIGTERM, SIGUSR1) seen by this rank: the handler only records it; the training loop
    acts on it between steps, once every rank agrees (``Trainer._agree``)."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.at: Optional[float] = None  # time.monotonic() of the first notice: the grace counts from it
        self.progress: Optional[Progress] = None  # the trainer's, once it has one
        self.step: Optional[int] = None  # the steps done when the notice came

    def install(self) -> None:
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()
            self.step = self.progress.step if self.progress is not None else 0

    def describe(self) -> str:
        return f"{signal.Signals(self.signum).name} at step {self.step}" if self.signum else "another rank's notice"


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


def optimizer(model: torch.nn.Module, spec: JobSpec) -> torch.optim.AdamW:
    """AdamW with no decay on norms; the fused kernel (one pass over every parameter, on GPU and CPU: on 2 CPU cores
    a 7.4 M-parameter step took 3-4 ms against the multi-tensor kernel's 15-19) unless the parameters mix DTensors
    and plain tensors (tensor parallel alone leaves the norms plain), which the fused kernel cannot take together."""
    from torch.distributed.tensor import DTensor

    t = spec.train
    kinds = {isinstance(p, DTensor) for p in model.parameters()}
    return torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=t.betas, fused=len(kinds) == 1)


def dist_backend(spec: JobSpec) -> str:
    if spec.launcher.backend != "auto":
        return spec.launcher.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(spec: JobSpec) -> tuple[int, int, torch.device]:
    """Join the torchrun process group (NCCL on GPUs, gloo on CPU) with a collective timeout that covers a
    checkpoint stall (``checkpoint.collective_timeout_minutes``); returns (rank, world size, device)."""
    timeout = datetime.timedelta(minutes=spec.checkpoint.collective_timeout_minutes)
    dist.init_process_group(dist_backend(spec), timeout=timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if dist_backend(spec) == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(spec.launcher.threads_per_proc)
    return dist.get_rank(), dist.get_world_size(), device


def idle_cores_note(threads: int, local_ranks: int, cores: int) -> str | None:
    """On CPU, when this node's ranks leave cores idle (``launcher.threads_per_proc`` is 1 by default, torchrun's
    choice): the line that says so and what would use them (one rank of 1 thread on 2 cores trains at half the
    speed: measured with ``benchmarks/trainer_gpu.py --device cpu``, docs/training.md)."""
    best = cores // max(1, local_ranks)
    if best <= threads:
        return None
    return (f"[train] CPU: {local_ranks} rank(s) × launcher.threads_per_proc={threads} use {threads * local_ranks} of "
            f"the {cores} cores this node gives us; launcher.threads_per_proc={best} would use {best * local_ranks}")


def runtime_batch(spec: JobSpec, dp: int, saved_global: Optional[int]) -> tuple[int, int]:
    """(global batch, grad accumulation) for this world's DP size. The global batch is the checkpoint's when
    resuming, else ``train.global_batch``, else micro × accum × DP; accumulation makes up the difference, so an
    elastic resume on another world size keeps the batch (and the sample order)."""
    t = spec.train
    G = saved_global or t.global_batch or t.micro_batch * t.grad_accum * dp
    if G % (t.micro_batch * dp):
        raise ValueError(f"global batch {G} is not divisible by train.micro_batch × DP = {t.micro_batch} × {dp} "
                         "on this world size; pick a train.micro_batch that divides the global batch / DP")
    return G, G // (t.micro_batch * dp)


class Steady(NamedTuple):
    """Where the steady window of a start begins (after ``WARM_STEPS`` steps): its time, step, the validation
    seconds and the saves so far."""
    t0: float
    step: int
    val_s: float
    saves: int


@dataclass
class Progress:
    """What a checkpoint's ``trainer_state.json`` holds besides the loader position."""
    step: int = 0
    losses: list = field(default_factory=list)  # [(step, loss)]
    rollbacks: int = 0
    resumed_from: Optional[dict] = None
    mlflow_run_id: Optional[str] = None
    val: list = field(default_factory=list)  # [{step, loss, bpb}]: validation during training


def run_identity(spec: JobSpec, margs) -> dict:
    return {"spec_hash": spec.stage_hash("train"), "model_args": margs.to_dict()}


class Tracker:
    """Rank 0's MLflow logging: params once, step metrics batched, background events (checkpoint stalls,
    promotions) flushed with them."""

    def __init__(self, spec: JobSpec, run_id: Optional[str]):
        self.client = tracking.client(spec)
        self.run_id = run_id or tracking.start_run(spec, run_name=f"{spec.run.name}-train")
        self.pending: list[tuple[str, float, int]] = []

    def params(self, params: dict) -> None:
        from mlflow.entities import Param

        try:
            self.client.log_batch(self.run_id, params=[Param(f"train.{k}", str(v)) for k, v in params.items()])
        except Exception as e:  # params are immutable: a resumed run (another world size) keeps the first ones
            if getattr(e, "error_code", None) != "INVALID_PARAMETER_VALUE" or not tracking.mlflow_error(e):
                raise  # the server failing (75), or any other answer: not "logged already"

    def add(self, step: int, metrics: dict) -> None:
        self.pending.extend((k, float(v), step) for k, v in metrics.items())

    def flush(self, events: list[tuple[str, float, int]] = ()) -> None:
        from mlflow.entities import Metric

        self.pending.extend(events)
        ts = int(time.time() * 1000)
        for i in range(0, len(self.pending), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, s) for k, v, s in self.pending[i:i + 1000]])
        self.pending.clear()

    def text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)


class ResumeError(RuntimeError):
    """A resume the spec asks for that cannot be: ``final`` when every try would fail the same way (a checkpoint of
    another model, a --ckpt-root outside checkpoint.l0), not when storage may be why (no tier gave a verified copy
    of the step asked for: a tier that did not answer or could not stage it looks the same)."""

    def __init__(self, message: str, final: bool = True):
        super().__init__(message)
        self.final = final


def _said(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def _rel_root(spec: JobSpec, ckpt_root: Path) -> str:
    l0 = resolve_path(spec.checkpoint.l0).resolve()
    try:
        return ckpt_root.resolve().relative_to(l0).as_posix()
    except ValueError:
        raise ResumeError(f"--ckpt-root {ckpt_root} is not under checkpoint.l0={l0}; the tiers mirror the path "
                          "below checkpoint.l0, so pass a directory under it") from None


class Trainer:
    """One rank's run: set up (restoring when a checkpoint verifies), :meth:`fit`, then :meth:`finish`."""

    def __init__(self, spec: JobSpec, tok_manifest_path: str, out: Path, ckpt_root: Path,
                 notice: Optional[Notice] = None):
        from pipelines.train.ckpt.checkpointer import Checkpointer

        self.spec, self.out, t = spec, out, spec.train
        self.notice = notice or Notice()
        self.rank, self.world, self.device = init_distributed(spec)
        self.log = (lambda m: print(m, flush=True)) if self.rank == 0 else (lambda m: None)
        if self.device.type == "cpu":
            note = idle_cores_note(spec.launcher.threads_per_proc, int(os.environ.get("LOCAL_WORLD_SIZE", self.world)),
                                   usable_cores())
            if note:
                self.log(note)
        torch.manual_seed(spec.run.seed)
        self._data(tok_manifest_path)
        self.rel_root = _rel_root(spec, ckpt_root)
        self.ckpt = Checkpointer(spec, self.rel_root, self.rank, self.world, self.log, files={
            "model_args.json": json.dumps(self.margs.to_dict(), indent=2).encode(),
            "tokenizer.model": self.tok.output("tokenizer").read_bytes()})
        t0 = time.perf_counter()
        heartbeat.beat("restore", waits=1)
        restored = self._find_restore()
        self.restore_s = time.perf_counter() - t0  # choosing the step and making its parts readable, not the load
        self._model(restored.state if restored else None)
        self.prog = Progress()
        if restored is not None:
            self._restore(restored)
        self.notice.progress = self.prog
        self.guard = SpikeGuard(t.spike_window, t.spike_sigma, t.spike_min_history)
        self.guard.reset([loss for _, loss in self.prog.losses])
        self.faults = Faults.from_env()
        self.cold = {FWD_BWD, AGREE, "evaluation"}  # the first of a start compiles, sets up communicators
        self.tracker = self._mlflow(lambda: Tracker(spec, spec.run.mlflow_run_id or self.prog.mlflow_run_id))
        self.step_times: list[float] = []
        self.validator = self._validator()
        self.next_save = self.prog.step + spec.checkpoint.probe_step
        self.loader = self._loader()

    def _beat(self, phase: str, waits: float = 0) -> None:
        """This rank's progress (``pipelines.train.heartbeat``) with the step it is at: the step in flight in
        ``FWD_BWD`` and ``AGREE``, else the steps done; ``waits``: how many waits bounded by the collective timeout
        the phase may make one after the other. The first step and evaluation of a start are allowed one."""
        heartbeat.beat(phase, self.prog.step + (phase in (FWD_BWD, AGREE)), max(waits, int(phase in self.cold)))
        self.cold.discard(phase)

    def _mlflow(self, call: Callable[[], T]) -> Optional[T]:
        """Rank 0 talks to MLflow (``call``'s result; None on the other ranks) while the others wait for its word:
        one phase allowed one wait on every rank (MLflow's client retries for minutes), over when rank 0 is done.
        MLflow that did not answer stops every rank at once with :class:`MlflowUnavailable` (the others no longer
        wait at a barrier until torchrun stops them); anything else rank 0 raises stops the others as a peer's
        failure."""
        self._beat(MLFLOW, waits=1)
        got, word, error = None, [None], None
        if self.rank == 0:
            try:
                got = call()
            except Exception as e:
                error, word = e, [("outage" if tracking.mlflow_outage(e) else "failed", _said(e))]
        if self.world > 1:
            dist.broadcast_object_list(word, src=0)
        if word[0] is None:
            return got
        kind, line = word[0]
        if kind == "outage":
            raise MlflowUnavailable(line) from error
        if error is not None:
            raise error
        raise RuntimeError(f"rank 0 failed while logging to MLflow ({line}); see rank 0's log")

    def _data(self, tok_manifest_path: str) -> None:
        from pipelines.train.model import ModelArgs

        self.tok = load_manifest(tok_manifest_path)
        self.margs = ModelArgs.from_spec(self.spec.model, self.tok.extra["vocab_size"])
        if self.margs.vocab_size < self.tok.extra["vocab_size"]:
            raise ValueError(f"model.vocab_size={self.margs.vocab_size} is smaller than the tokenizer's "
                             f"{self.tok.extra['vocab_size']}")
        self.samples = train_samples(self.tok, self.margs.seq_len, self.spec.train.mixture)

    def _find_restore(self):
        """Every rank together: the newest step of this line of training that verifies on the nearest tier, each
        node its own parts (``pipelines.train.ckpt.restore``); None to start at step 0. A restart of this launch
        (``pipelines.train.ckpt.history``) resumes whatever ``train.resume`` says: ``never`` starts over once."""
        box = [None]
        if self.rank == 0:
            try:
                box = [self._lineage_start(self.spec.train.resume)]
            except (OSError, ValueError, CheckpointError) as e:  # L1 or L2 cannot be read or written, or handed
                # back a torn record: every rank stops with the reason (JSON that does not decode is storage that
                # lied, not the spec), none waits for rank 0 in the broadcast below
                box = [("refused" if isinstance(e, L2Refused) else "error",
                        f"the lineage record cannot be read or written: {type(e).__name__}: {e}")]
        dist.broadcast_object_list(box, src=0)
        rec, mode = box[0]
        if rec in ("error", "refused"):  # storage, not the spec: exit_codes.RETRY; L2 refusing these credentials: 2
            raise (L2Refused if rec == "refused" else TierUnavailable)(mode)
        self.ckpt.set_lineage(rec)
        if mode == "never":
            self._take_over(rec, mode, None)
            return None
        restored = self.ckpt.restore(None if mode == "auto" else mode)
        if restored is None:
            if mode != "auto":
                raise ResumeError(f"train.resume={mode}: no tier holds a verified copy of step {mode} (see the "
                                  "log above)", final=False)
            self.log("[ckpt] restore: no checkpoint of this run on any tier; starting at step 0")
        if restored is not None and restored.state["model_args"] != self.margs.to_dict():
            raise ResumeError(f"the checkpoint at {restored.path} was written for another model "
                              f"({restored.state['model_args']}); set train.resume=never or use another checkpoint.l0")
        self._take_over(rec, mode, restored.step if restored is not None else None)
        return restored

    def _take_over(self, rec: Optional[dict], mode, step: Optional[int]) -> None:
        """Every rank, before this attempt's first save: the line of training from here on. A fork at step N
        (``train.resume=N``): what the old line wrote after N no longer counts. And this attempt's cutoff
        (:func:`history.resumed`): a step an older term lands above ``step`` from now on (a writer paused between
        its fence check and its COMMIT) counts nowhere. Written by rank 0 under the fence on L1; the promoter copies
        it to L2 right after this attempt's term, before its next COMMIT there (an L2 that hangs holds up no start
        but a fork's, whose record also goes there at once, as before)."""
        term = self.ckpt.fence_info()["term"]  # every attempt holds one: the Checkpointer took it at its start
        forks = mode not in ("auto", "never")
        box = [None]
        if self.rank == 0:
            token = history.run_token()
            new = history.fork(rec, token, mode) if forks else rec
            box = [history.resumed(new, token, term, step)]
            try:
                if forks:  # a fork's record goes to L2 at once too, as it always did (an L2 down costs a line)
                    write_lineage(self.spec, self.rel_root, box[0], self.log)
                else:
                    history.write(self.spec, self.rel_root, box[0])
            except Exception as e:  # noqa: BLE001 - L1 did not take it (a fenced-out attempt too): every rank's
                box = [f"the lineage record cannot be written: {type(e).__name__}: {e}"]  # reason, none waits
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise CheckpointError(box[0])
        self.ckpt.set_lineage(box[0])

    def _lineage_start(self, resume):
        """Rank 0: (this line of training's record, how to start: auto / never / a step)."""
        token, rec = history.run_token(), read_lineage(self.spec, self.rel_root)  # L1's, else L2's copy
        if history.is_restart(rec, token):
            if resume != "auto":
                self.log(f"[ckpt] a restart of this launch: resuming its own steps (train.resume={resume} applied "
                         "once, at its first start)")
            return rec, "auto"
        if resume != "never":
            return rec, resume
        try:
            gone = {t: v for t, v in clear_run(self.spec, self.rel_root).items() if v}
        except CheckpointError as e:  # the registry or a tier cannot be read: the steps stay, outside the new line
            gone = {}
            self.log(f"[ckpt] train.resume=never: earlier checkpoints kept: {e}")
        if gone:
            self.log(f"[ckpt] train.resume=never: removed this run's earlier checkpoints {gone}")
        rec = history.fresh(token, rec)
        write_lineage(self.spec, self.rel_root, rec, self.log)
        return rec, "never"

    def _model(self, state: Optional[dict]) -> None:
        from pipelines.train.model import Transformer, param_count
        from pipelines.train.parallel import apply_parallelism, dp_coords

        spec, t = self.spec, self.spec.train
        self.dp_rank, self.dp = dp_rank, dp = dp_coords(spec, self.rank)  # a TP group reads the same samples
        self.G, self.accum = runtime_batch(spec, dp, state["loader"]["global_batch"] if state else None)
        if self.accum != t.grad_accum:
            self.log(f"[train] world size {self.world}: grad_accum {self.accum} keeps the global batch of {self.G}")
        self.sampler = sampler_for(self.samples, self.G, dp_rank, dp, spec.run.seed)
        self.n_params = param_count(self.margs)
        self.model, self.mode = apply_parallelism(Transformer(self.margs).to(self.device), spec, self.device)
        self.opt = optimizer(self.model, spec)
        # FSDP2 casts parameters itself (MixedPrecisionPolicy); DDP and one rank use autocast
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16,
                                       enabled=t.dtype == "bf16" and not self.mode.startswith(("fsdp2", "hsdp")))

    def _restore(self, restored) -> None:
        st = self.ckpt.load(restored.path, self.model, self.opt)
        self.sampler.load_state_dict(st["loader"])
        self.prog = Progress(step=st["step"], losses=[tuple(x) for x in st["losses"]], rollbacks=st["rollbacks"],
                             resumed_from=restored.resumed_from(), mlflow_run_id=st.get("mlflow_run_id"),
                             val=list(st.get("val", [])))
        self.log(f"[train] resumed at step {st['step']} from {restored.tier} (sample position "
                 f"{st['loader']['consumed_samples']}, saved by {st['world_size']} ranks, now {self.world})")

    def _loader(self):
        return Prefetcher(self.samples, self.sampler, self.accum, depth=self.spec.train.prefetch,
                          pin_memory=self.device.type == "cuda", vocab=self.tok.extra["vocab_size"])

    def _state(self) -> dict:
        return {"step": self.prog.step, "tokens_seen": self.prog.step * self.G * self.margs.seq_len,
                "loader": self.sampler.state_dict(), "losses": self.prog.losses, "rollbacks": self.prog.rollbacks,
                "val": self.prog.val,
                "mlflow_run_id": self.tracker.run_id if self.tracker else None, "world_size": self.world,
                "parallel": {"mode": self.mode, "grad_accum": self.accum}, **run_identity(self.spec, self.margs)}

    # ------------------------------------------------------------------ the loop
    def fit(self) -> None:
        t = self.spec.train
        self._log_params()
        bar = progress(desc=f"train ({self.world} ranks)", total=t.steps, initial=self.prog.step, unit="step") \
            if self.rank == 0 else None
        start, first = time.perf_counter(), self.prog.step
        self.val_s, self.steady_from = 0.0, None
        while self.prog.step < t.steps:
            if self.steady_from is None and self.prog.step - first >= WARM_STEPS:
                self.steady_from = Steady(time.perf_counter(), self.prog.step, self.val_s, len(self.ckpt.stalls))
            t0 = time.perf_counter()
            lr = lr_at(self.prog.step, self.spec)
            for g in self.opt.param_groups:
                g["lr"] = lr
            self._beat(FWD_BWD)
            batches = self.loader.next_step()
            loss, gnorm = self._forward_backward(batches, self.loader.position)
            why = self.guard.check(loss, gnorm)
            self._beat(AGREE)
            spike, stop = self._agree(why is not None, self.notice.signum is not None)
            if spike:  # every rank rolls back together, or none does
                self._rollback(why or "another rank saw a spike or a non-finite value", self.loader.position)
                continue
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.guard.accept(loss)
            self.prog.step += 1
            self.prog.losses.append((self.prog.step, loss))
            time.sleep(self.faults.step_delay_s)
            storage_faults.point(storage_faults.STEP)  # LLMP_FAULTS: a notice or a stop after a step
            self.step_times.append(time.perf_counter() - t0)
            if self.validator.due(self.prog.step):  # before the report: the bar shows this step's val loss
                self._validate()
            self._beat("report")
            self._report(bar, loss, gnorm, lr)
            if self._to_mlflow():
                self._mlflow(lambda: self.tracker.flush(self.ckpt.events.take()))
            if self._due():
                self._save()
            if stop and self.prog.step < t.steps:  # at the last step finish() commits it as usual
                self._preempt(bar)
        self.fit_end = time.perf_counter()
        self.fit_s, self.fit_steps = self.fit_end - start, self.prog.step - first  # wall, stalls included
        self.loader.close()
        if bar is not None:
            bar.close()

    def _forward_backward(self, batches: list, position: int) -> tuple[float, float]:
        from pipelines.train.parallel import clip_grad_norm, grad_sync

        loss_sum = torch.zeros((), device=self.device)
        for m, (x, y) in enumerate(batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with grad_sync(self.model, self.mode, m == self.accum - 1):
                with self.autocast:
                    loss = self.faults.scale_loss(position, self.model(x, y) / self.accum)
                loss.backward()
            loss_sum += loss.detach()
        gnorm = clip_grad_norm(self.model, self.spec.train.grad_clip)
        if self.world > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)  # gloo has no AVG
            loss_sum /= self.world
        return float(loss_sum), gnorm

    def _validator(self):
        from pipelines.train.validate import Validator

        t = self.spec.train
        v = Validator(self.tok, self.margs.seq_len, t.eval_every, t.eval_tokens, t.micro_batch, t.steps, self.dp_rank,
                      self.dp, self.device, vocab=self.tok.extra["vocab_size"])
        if v.off_reason and t.eval_every:
            self.log(f"[val] no validation during training: {v.off_reason}")
        elif not v.off_reason:
            self.log(f"[val] every {t.eval_every} steps and at step {t.steps}: {v.windows} held-out windows of "
                     f"{self.margs.seq_len} tokens")
        return v

    def _validate(self) -> None:
        """Every rank: the loss on the held-out slice; rank 0 logs it (MLflow ``val/loss``, ``val/bpb``)."""
        self._beat("evaluation")
        t0 = time.perf_counter()
        r = self.validator.run(self.model, self.autocast)
        self.val_s += time.perf_counter() - t0
        self.prog.val.append({"step": self.prog.step, "loss": r["loss"], "bpb": r["bpb"]})
        if self.rank == 0:
            self.tracker.add(self.prog.step, {"val/loss": r["loss"], "val/bpb": r["bpb"]})
            self.log(f"[val] step {self.prog.step}: loss {r['loss']:.4f} nats/token, {r['bpb']:.4f} bits/byte "
                     f"({r['tokens']:,} held-out tokens)")

    def _agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag set on any rank (one all-reduce per step carries them all): every rank rolls back, or stops
        on a preemption notice, at the same step, whenever the signal reached it."""
        if self.world == 1:
            return tuple(flags)
        t = torch.tensor([int(f) for f in flags], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(bool(x) for x in t.tolist())

    def _preempt(self, bar) -> None:
        """Every rank, on an agreed notice: this step checkpointed to L0 and globally committed on L1 within
        ``train.preempt_grace_s`` of the signal (L2 is left to the next attempt), then :class:`Preempted`."""
        step, grace = self.prog.step, self.spec.train.preempt_grace_s
        at = self.notice.at if self.notice.at is not None else time.monotonic()  # another rank's notice
        why = self.notice.describe()
        self._beat("preemption checkpoint", waits=1)
        self.log(f"[preempt] {why}: stopping after step {step}; checkpointing it to L0 and L1 "
                 f"(train.preempt_grace_s={grace:g})")
        self.loader.close()
        if self.ckpt.last_saved != step:
            self.ckpt.save(step, self.model, self.opt, self._state())
        self.ckpt.commit_now(step, max(1.0, grace - (time.monotonic() - at)))
        self.log(f"[preempt] step {step} committed on L1 {time.monotonic() - at:.2f} s after the notice")
        if bar is not None:
            bar.close()
        dist.barrier()
        dist.destroy_process_group()
        raise Preempted(step, why)

    def _due(self) -> bool:
        every, step = self.spec.train.ckpt_every, self.prog.step
        if step == self.spec.train.steps:
            return True
        return step == self.next_save if every == "auto" else step % every == 0

    def _save(self) -> None:
        self._beat("checkpoint save", waits=1)  # it waits for the save in flight first (the collective timeout)
        self.ckpt.save(self.prog.step, self.model, self.opt, self._state())
        if self.spec.train.ckpt_every == "auto" and self.prog.step < self.spec.train.steps:
            self.next_save = self.prog.step + self._young_daly()
        if self.faults.exit_at_step == self.prog.step:  # fault injection: the job dies right after a commit
            self.ckpt.wait()
            dist.barrier()
            self.log(f"[fault] exiting every rank after step {self.prog.step} (LLMP_FAULT_EXIT_AT_STEP)")
            os._exit(17)

    def _young_daly(self) -> int:
        """Rank 0's Young/Daly interval from the measured stalls and its median step time, broadcast: every rank
        must save at the same steps."""
        box = [None]
        if self.rank == 0:
            recent = sorted(self.step_times[-50:])
            step_s, stall = recent[len(recent) // 2], sum(self.ckpt.stalls) / len(self.ckpt.stalls)
            nodes = max(1, self.world // int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
            box = [young_daly_steps(stall, self.spec.checkpoint.mtbf_hours, nodes, step_s, self.spec.train.steps)]
            self.log(f"[ckpt] Young/Daly interval: {box[0]} steps (stall {stall * 1000:.0f} ms, MTBF "
                     f"{self.spec.checkpoint.mtbf_hours:g} h / {nodes} node(s), step {step_s:.3f} s)")
            self.tracker.add(self.prog.step, {"ckpt/interval_steps": box[0]})
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _rollback(self, why: str, position: int) -> None:
        """Do not apply this step; go back to the last checkpoint and never train on this global batch again."""
        t, step = self.spec.train, self.prog.step + 1
        self.opt.zero_grad(set_to_none=True)
        self.prog.rollbacks += 1
        if self.tracker:
            self.tracker.add(step, {"train/rollbacks": self.prog.rollbacks, "train/nonfinite": int("non-finite" in why)})
        if self.prog.rollbacks > t.max_rollbacks:
            raise TrainingDiverged(f"step {step}: {why}; {t.max_rollbacks} rollback(s) already (train.max_rollbacks) "
                                   f"— lower train.lr, check the data near sample position {position}, or raise "
                                   "train.max_rollbacks")
        self.sampler.skip.add(position)
        self._beat("rollback", waits=2)  # the save in flight, then the promotions, each bounded
        self.loader.close()
        self.ckpt.wait()
        dist.barrier()
        last = self.ckpt.last_saved
        if last is None:
            self.log(f"[train] step {step}: {why}; no checkpoint yet: update not applied, global batch at sample "
                     f"position {position} skipped")
        else:
            skip = set(self.sampler.skip)
            try:
                restored = self.ckpt.restore(last)
            except L2Refused as e:  # L2 refused this run all along (skipped, as when down): it holds no step of
                # this attempt's; a retry resumes from the newest step L1 verifies (75), as with L2 down
                raise CheckpointError(f"step {step}: {why}; the checkpoint of step {last} to roll back to verifies "
                                      f"on neither L0 nor L1, and L2 refused: {e}") from None
            if restored is None:  # the step this attempt saved is on no tier: storage lost it (exit 75, a retry
                # resumes from the newest step that verifies), not a run the user must change

                raise CheckpointError(f"step {step}: {why}; the checkpoint of step {last} to roll back to does not "
                                      "verify on any tier")
            st = self.ckpt.load(restored.path, self.model, self.opt)
            self.sampler.load_state_dict(st["loader"])
            self.sampler.skip |= skip
            self.prog.step, self.prog.losses = st["step"], [tuple(x) for x in st["losses"]]
            self.prog.val = list(st.get("val", []))
            self.guard.reset([loss for _, loss in self.prog.losses])
            self.log(f"[train] step {step}: {why}; rolled back to step {last}, global batch at sample position "
                     f"{position} skipped ({self.prog.rollbacks}/{t.max_rollbacks} rollbacks)")
        self.loader = self._loader()

    # ------------------------------------------------------------------ logging and the end
    def _log_params(self) -> None:
        m = self.margs
        params = {"params": self.n_params, "world_size": self.world, "global_batch": self.G, "seq_len": m.seq_len,
                  "n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads, "vocab_size": m.vocab_size,
                  "steps": self.spec.train.steps, "lr": self.spec.train.lr, "backend": dist_backend(self.spec),
                  "parallel": self.mode, **({"mixture": json.dumps(self.spec.train.mixture)[:6000]}  # MLflow's limit
                                            if self.spec.train.mixture else {})}
        self._mlflow(lambda: self.tracker.params(params))
        if self.spec.train.mixture:
            self._log_mixture_plan()
        if self.tracker is not None and self.prog.resumed_from:
            self.tracker.add(self.prog.step, {"ckpt/resumed_step": self.prog.resumed_from["step"]})

    def _log_mixture_plan(self) -> None:
        """Rank 0: each source's target share, samples and epochs over train.steps (``train.mixture``)."""
        plan = self.sampler.report(self.spec.train.steps * self.G)
        for s, size in zip(self.samples.names, self.samples.sizes):
            self.log(f"[data] mixture: {s}: target share {plan['target'][s]:.4f}; over train.steps="
                     f"{self.spec.train.steps}: {plan['samples'][s]:,} draws of its {size:,} samples, "
                     f"{plan['epochs'][s]:.2f} epochs")

    def _report(self, bar, loss: float, gnorm: float, lr: float) -> None:
        if self.rank != 0:
            return

        tps = self.G * self.margs.seq_len / self.step_times[-1]
        bar.update(1)
        last_val = {"val": f"{self.prog.val[-1]['loss']:.3f}"} if self.prog.val else {}
        bar.set_postfix(loss=f"{loss:.3f}", **last_val, tok_s=f"{tps:,.0f}", lr=f"{lr:.2e}")
        metrics = {"train/loss": loss, "train/lr": lr, "train/grad_norm": gnorm, "train/tokens_per_s": tps}
        if self.device.type == "cuda":
            u = mfu(tps, self._flops_per_token(), self.world, torch.cuda.get_device_name(self.device),
                    self.spec.train.dtype)
            if u is not None:
                metrics["train/mfu"] = u
        self.tracker.add(self.prog.step, metrics)

    def _to_mlflow(self) -> bool:
        """Every rank knows when rank 0 sends the reports to MLflow: every ``train.log_every`` steps, the last."""
        return self.prog.step % self.spec.train.log_every == 0 or self.prog.step == self.spec.train.steps

    def _flops_per_token(self) -> float:
        # 6N + 12·L·H·d_head·T FLOPs per token (pipelines.train.plan)

        shape = {**model_shape(self.spec), "vocab": self.margs.vocab_size}
        return flops_per_token(shape, shape_params(shape))

    def _slowest(self, seconds: float) -> float:
        """The largest of every rank's value (a restore is done when the last rank is ready)."""
        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def log_last(self, result: dict) -> None:
        """Rank 0: the last metrics and checkpoint events to MLflow, and with ``train.mixture`` its report (metrics
        under :func:`~pipelines.train.loader.mixture_keys`, and all of it, full source names included, as the
        artifact ``train/mixture.json``). The run is over: MLflow failing here is said, never the run's end."""
        mix = result.get("mixture")
        try:
            if mix:
                self.tracker.add(self.spec.train.steps, mixture_metrics(mix))
            self.tracker.flush(self.ckpt.events.take())
            if mix:
                full = {**mix, "metric_keys": mixture_keys(list(mix["target"]))}
                self.tracker.text(json.dumps(full, indent=2), "train/mixture.json")
        except Exception as e:  # noqa: BLE001 - the checkpoint and result.json are what the run is; MLflow is a view
            self.tracker.pending.clear()
            self.log(f"[train] MLflow: the last metrics were not logged ({type(e).__name__}: {e}); the run's result "
                     "is written all the same")

    def _steady(self) -> Optional[Steady]:
        """The steady window's start, or None when the run had no step after it."""
        s = self.steady_from
        return s if s is not None and self.prog.step > s.step else None

    def _steady_stall_s(self) -> Optional[float]:
        """The seconds checkpoint saves blocked training in the steady window (None without one)."""
        s = self._steady()
        return None if s is None else sum(self.ckpt.stalls[s.saves:])

    def _steady_wall(self, less_stalls: bool = False) -> Optional[float]:
        """Tokens/s over the wall time after the first ``WARM_STEPS`` steps of this start (compile, first
        collectives), everything but validation counted: loader waits, logging, MLflow, checkpoint stalls (less
        those with ``less_stalls``: what runs beside training without its saves' pauses, whose share of the wall
        the cadence sets). None when the run had no step after them."""
        s = self._steady()
        if s is None:
            return None
        seconds = self.fit_end - s.t0 - (self.val_s - s.val_s) - (self._steady_stall_s() if less_stalls else 0.0)
        return (self.prog.step - s.step) * self.G * self.margs.seq_len / seconds

    def finish(self) -> dict:
        """Wait for the last save and the promotions, write ``losses.json``/``result.json`` (rank 0)."""
        t = self.spec.train
        self._beat("close (final save and promotions)", CLOSE_WAITS)  # rank 0 may still upload after the others
        self.ckpt.close(t.steps)
        dist.barrier()
        self._beat("finish", waits=1)  # the others wait at the last barrier while rank 0 writes and logs
        steady = self.step_times[min(len(self.step_times) - 1, WARM_STEPS):] if self.step_times else []
        stalls = self.ckpt.stalls
        result = {
            "steps": t.steps, "final_loss": self.prog.losses[-1][1] if self.prog.losses else None,
            "params": self.n_params, "tokens_per_s": self.G * self.margs.seq_len * len(steady) / sum(steady) if steady else None,
            "tokens_seen": self.prog.step * self.G * self.margs.seq_len, "flops_per_token": self._flops_per_token(),
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "world_size": self.world, "backend": dist_backend(self.spec), "checkpoint": step_name(t.steps),
            "mlflow_run_id": self.tracker.run_id if self.tracker else None, "parallel": self.mode,
            "global_batch": self.G, "grad_accum": self.accum, "resumed_from": self.prog.resumed_from,
            "rollbacks": self.prog.rollbacks, "skipped_batches": sorted(self.sampler.skip),
            "restore_s": self._slowest(self.restore_s) if self.prog.resumed_from else None,
            "consumed_samples": self.sampler.consumed_samples, "fence": self.ckpt.fence_info(),
            "goodput_tokens_per_s": self.fit_steps * self.G * self.margs.seq_len / self.fit_s if self.fit_steps else None,
            "steady_wall_tokens_per_s": self._steady_wall(),
            "steady_wall_less_stalls_tokens_per_s": self._steady_wall(less_stalls=True),
            "steady_stall_s": self._steady_stall_s(),
            "val": self.prog.val, "best_val_step": min(self.prog.val, key=lambda v: v["loss"])["step"]
            if self.prog.val else None,
            "ckpt": {"saves": len(stalls), "stall_s_mean": sum(stalls) / len(stalls) if stalls else None,
                     "stall_s_max": max(stalls, default=None),
                     "promoted": {str(k): v for k, v in (self.ckpt.promoter.done if self.ckpt.promoter else {}).items()},
                     "promote_s": {str(k): round(v, 4) for k, v in
                                   (self.ckpt.promoter.seconds if self.ckpt.promoter else {}).items()}},
        }
        if self.spec.train.mixture:  # train.mixture: shares over the samples trained on, resumes included
            result["mixture"] = self.sampler.report(self.sampler.consumed_samples)
        if self.rank == 0:
            self.log_last(result)
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "losses.json").write_text(json.dumps(self.prog.losses))
            (self.out / "result.json").write_text(json.dumps(result, indent=2))
        dist.barrier()
        dist.destroy_process_group()
        return result


def train(spec: JobSpec, tok_manifest_path: str, out: Path, ckpt_root: Path, notice: Optional[Notice] = None) -> dict:
    trainer = Trainer(spec, tok_manifest_path, out, ckpt_root, notice)
    trainer.fit()
    return trainer.finish()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="torchrun … -m pipelines.train.trainer",
                                 description="One rank of a training run (launch it with pipelines.train.launch).")
    add_spec_args(ap)
    ap.add_argument("--tokenize-manifest", required=True)
    ap.add_argument("--out", required=True, help="Directory for losses.json / result.json (rank 0).")
    ap.add_argument("--ckpt-root", required=True, help="This run's checkpoint directory under checkpoint.l0.")
    args = ap.parse_args(argv)
    spec = spec_from_args(args)
    notice = Notice()
    notice.install()  # before the process group: a notice during start-up stops at the first step
    return run_rank(spec, args, notice)


def run_rank(spec: JobSpec, args, notice: Notice) -> int:
    """This rank's exit status (``pipelines.launch.outcomes``), its heartbeat and its watcher of the node's ranks
    running meanwhile (``pipelines.train.heartbeat``: a rank silent past ``train.hang_timeout_s`` is killed)."""
    heartbeat.start(spec.train.hang_timeout_s, spec.checkpoint.collective_timeout_minutes * 60)  # start-up counts
    try:
        return _run_rank(spec, args, notice)
    finally:
        heartbeat.stop()


def _run_rank(spec: JobSpec, args, notice: Notice) -> int:
    """This rank's exit status; a failure or a preemption also leaves an outcome file in ``--out`` that tells the
    launcher which it was (torchrun's own status does not)."""
    out, rank = Path(args.out), int(os.environ.get("RANK", 0))
    stopped = xc.final_stop(out)
    if stopped is not None:  # torchrun (or the pod's restart policy) restarted ranks that would stop the same way
        print(f"train: error: rank {stopped.get('rank')} of this launch stopped for the spec, the data or access "
              f"({out}/{xc.outcome_name(stopped.get('rank'), stopped.get('attempt'))}): {stopped.get('reason')}; "
              "not training again",
              file=sys.stderr)
        return xc.USER_ERROR
    xc.clear_outcome(out, rank)  # an earlier attempt's
    try:
        train(spec, args.tokenize_manifest, out, Path(args.ckpt_root), notice)
    except Preempted as e:  # status 0: torchrun neither restarts the ranks nor calls it a failure; the outcome
        # file tells the launcher, which exits RETRY
        print(f"train: {e}; committed on L1: a retry resumes there", flush=True)
        if not xc.write_outcome(out, rank, xc.RETRY, str(e), step=e.step):  # status 0 would then read "done"
            print(f"train: error: the outcome file could not be written in {out}: exiting 75 instead", file=sys.stderr)
            return xc.RETRY
        return xc.OK
    except (TrainingDiverged, ResumeError, TokenOutOfVocab, CopyRefused, UnsafeCheckpoint, L2Refused) as e:
        print(f"train: error: {e}", file=sys.stderr)  # the spec, data, access, credentials or a forged copy must
        # change: every try would stop the same way
        xc.write_outcome(out, rank, xc.USER_ERROR, str(e), final=getattr(e, "final", True))
        return xc.USER_ERROR
    except ValueError as e:  # a spec this world cannot run (batch sizes, vocabulary): the traceback stays
        xc.write_outcome(out, rank, xc.USER_ERROR, f"{type(e).__name__}: {e}")
        raise
    except CheckpointError as e:  # a tier's storage: an L1 that never commits, a part that does not verify …
        print(f"train: error: {e}", file=sys.stderr)
        xc.write_outcome(out, rank, xc.RETRY, str(e))
        return xc.RETRY
    except OSError as e:  # a tier's disk (ENOSPC, EIO …): one line with the path, and torchrun may try again;
        if oserrors.refused(e):  # a path this user may not write: no try would
            print(f"train: error: {e}: this user may not; give it access", file=sys.stderr)
            xc.write_outcome(out, rank, xc.USER_ERROR, f"refused: {e}", final=True)
            return xc.USER_ERROR
        print(f"train: error: storage: {e}", file=sys.stderr)
        xc.write_outcome(out, rank, xc.RETRY, f"storage: {e}")
        return xc.RETRY
    except Exception as e:  # MLflow that did not answer past its client's retries (minutes): resume from L1 later
        if not isinstance(e, MlflowUnavailable) and not tracking.mlflow_outage(e):
            raise
        line = f"MLflow did not answer ({e if isinstance(e, MlflowUnavailable) else _said(e)})"
        print(f"train: error: {line}; a retry resumes from the last checkpoint", file=sys.stderr)
        xc.write_outcome(out, rank, xc.RETRY, line)
        return xc.RETRY
    return xc.OK


if __name__ == "__main__":
    # a rank that stops for storage (75) may leave a thread stuck in I/O that never returns (a save's commit on a
    # stalled disk): it leaves at once, its outcome file and output already written; any other end (0, 2, an
    # exception) waits for its threads at most procs.EXIT_GRACE_S (a promotion to L2 still running at the end, a
    # hashing worker stuck in a read)
    main_bounded(main, at_once=(RETRY,))
