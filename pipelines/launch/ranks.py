"""Running a module on every rank a job spec asks for: :func:`run_ranks`, the one launcher interface (the train stage,
evaluation, serving and preflight use it), chosen by ``launcher.kind``: ``local`` (the default) runs ``torchrun``
as a subprocess (``--standalone`` on one node, or c10d rendezvous on 127.0.0.1 for ``nnodes > 1`` on this machine)
and streams its output; on Kubernetes ``trainjob`` (the default kind there, which ``kubernetes`` means) submits a
Kubeflow Trainer v2 TrainJob and ``pytorchjob`` a training-operator v1 PyTorchJob, each checked first as the
cluster's admission checks it (a job it would refuse is not sent: exit 2), then watched (:mod:`pipelines.launch.k8s`).
What the ranks say when they stop early: :mod:`pipelines.launch.outcomes`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Optional

from pipelines.launch import outcomes as xc
from pipelines.launch.k8s import JobFailed, JobRecord, node_local_l0, run_job
from pipelines.manifest import StageError
from pipelines.procs import free_port, kill_known, tree_of
from pipelines.spec import JobSpec, resolve_path


class TrainError(StageError):
    """The ranks failed. As such: the spec or the input must change (a rank said so: divergence, a resume it
    cannot do), or the spec asks for what this launcher cannot do (exit 2: not retried)."""


class TrainRetry(TrainError):
    """The ranks failed for the infrastructure or a preemption (exit 75, ``exit_codes.RETRY``): the same command
    run again (an Airflow task retry) resumes from the newest committed checkpoint."""

    exit_code = xc.RETRY


def torchrun_flags(spec: JobSpec) -> list[str]:
    """torchrun's own handling of a preemption notice: SIGUSR1 forwarded to the ranks like SIGTERM, and the ranks
    given ``train.preempt_grace_s`` (+ 5 s) to checkpoint before torchrun kills them (its default is 30 s)."""
    return ["--shutdown-timeout", str(spec.train.shutdown_grace_s()),
            "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]


def torchrun_cmds(spec: JobSpec, trainer_args: list[str], module: str = "pipelines.train.trainer",
                  restarts: bool = True, rdzv_port: Optional[int] = None) -> list[list[str]]:
    """One torchrun command per node (all on this machine for a local multi-node run). With ``restarts``
    torchrun restarts the ranks up to ``launcher.max_restarts`` times when one dies (they resume from the
    newest checkpoint); a health check (preflight) runs once. ``rdzv_port``: the rendezvous store this process
    hosts (:func:`rendezvous_store`), which every node's torchrun joins (none hosts it: no port chosen here can
    be taken by another process before a torchrun binds it)."""
    L = spec.launcher
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(L.nproc_per_node),
            "--max-restarts", str(L.max_restarts if restarts else 0), *torchrun_flags(spec)]
    if L.nnodes == 1:
        return [base + ["--standalone", "-m", module, *trainer_args]]
    port = rdzv_port or free_port()
    hosted = ["--rdzv-conf", "is_host=false"] if rdzv_port else []
    return [base + ["--nnodes", str(L.nnodes), "--node-rank", str(n), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"llmp-{port}", *hosted,
                    "-m", module, *trainer_args] for n in range(L.nnodes)]


def rendezvous_store():
    """A c10d store on a loopback port the kernel gives it (bound at once, no window for another process) for a
    local multi-node launch's rendezvous; it serves while the object lives."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def run_torchrun(spec: JobSpec, trainer_args: list[str], module: str = "pipelines.train.trainer",
                 restarts: bool = True, env_extra: Optional[dict] = None, work: Optional[Path] = None) -> None:
    """Run torchrun (one per node) to the end, streaming node 0's output. A preemption notice to this process
    (SIGTERM, SIGUSR1) goes on to torchrun as SIGTERM, which passes it to the ranks and waits for their checkpoint.
    A failure is :class:`TrainRetry` unless a rank's outcome file in ``work`` says the input must change. However it
    ends (a failure here, ``launcher.timeout_minutes``), nothing it started is left running: torchrun gets its
    shutdown grace, then it and every rank seen (in sessions of their own) are killed."""
    env = {**os.environ, **(env_extra or {})}
    env.setdefault("OMP_NUM_THREADS", str(spec.launcher.threads_per_proc))
    env["PYTHONUNBUFFERED"] = "1"
    # each restarted worker group gets a store of its own (a shared one hung a restart now and then on gloo)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if work is not None:
        # an earlier attempt's (no attempt id here, unlike on Kubernetes: the work dir is this run's own staging
        # dir, published with the result, and every rank is a child this process waits for)
        xc.clear_outcomes(work)
    store = rendezvous_store() if spec.launcher.nnodes > 1 else None  # held until every torchrun ended
    procs: list[subprocess.Popen] = []
    seen: dict[int, int] = {}  # torchrun's processes and their descendants (pid → start ticks), stopped if left
    noticed: list[int] = []
    previous = _forward_notices(procs, noticed)  # before the start: a notice meanwhile is not lost
    try:
        for cmd in torchrun_cmds(spec, trainer_args, module, restarts, store.port if store else None):
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          errors="replace"))  # bytes that are not UTF-8 never stop a reader
        if noticed:  # a notice came while they started
            for p in procs:
                p.send_signal(signal.SIGTERM)
        t = spec.launcher.timeout_minutes
        codes, tail, errors = _stream(procs, seen, None if t is None else time.monotonic() + 60 * t)
    finally:
        try:  # the notices still forwarded while what is left stops
            _stop_left(procs, seen, spec.train.shutdown_grace_s() + 5)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    outcomes = xc.read_outcomes(work) if work is not None else []
    why = "".join(errors) + f"torchrun exited with {codes}; last output:\n" + "".join(tail) if any(codes) else ""
    preempted(outcomes, noticed, bool(why), why)
    if any(codes):
        raise (TrainError if xc.failed_ranks_code(outcomes) == xc.USER_ERROR else TrainRetry)(why)


def _stop_left(procs: list[subprocess.Popen], seen: dict[int, int], grace_s: float) -> None:
    """Whatever of a launch still runs: every torchrun SIGTERM (it stops its ranks within its shutdown timeout),
    SIGKILL after ``grace_s``; then every process seen under them that still runs (a rank torchrun could not stop,
    or one left holding the output open)."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # stuck in the kernel (D state): the error that brought us here stays
                pass
    kill_known(seen, 5.0)


def preempted(outcomes: list[dict], noticed: list[int], failed: bool = False, why: str = "") -> None:
    """:class:`TrainRetry` when the ranks stopped on a preemption notice (their outcome files name the step they
    committed on L1), or when this process got one (``noticed``) and the ranks ``failed``."""
    step = next((o["step"] for o in outcomes if "step" in o), None)
    if step is None and not (noticed and failed):
        return
    sigs = ", ".join(signal.Signals(n).name for n in noticed) or "notice to the ranks"
    raise TrainRetry(f"preempted ({sigs}); " + (f"step {step} is committed on L1: a retry resumes there"
                                                if step is not None else "no step was committed on the notice: a "
                                                "retry resumes from the newest checkpoint") + (f"\n{why}" if why else ""))


def _forward_notices(procs: list[subprocess.Popen], noticed: list[int]) -> dict:
    """While torchrun runs: SIGTERM / SIGUSR1 to this process is sent on to every torchrun as SIGTERM (recorded in
    ``noticed``). Returns the handlers to put back (none off the main thread, where signals cannot be caught)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum, frame):
        noticed.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    return {sig: signal.signal(sig, forward) for sig in xc.PREEMPT_SIGNALS}


PIPE_GRACE_S = 30.0  # after the torchruns exited: how long their output may stay open before what holds it is killed


def _stream(procs: list[subprocess.Popen], seen: Optional[dict[int, int]] = None,
            deadline: Optional[float] = None) -> tuple[list[int], deque, list[str]]:
    """Every node's output read all along, by a thread each (a pipe left unread fills at 64 KiB and stops that node's
    ranks, and with them node 0's collectives); node 0's goes on to stdout (while stdout takes it: a reader that went
    away never stops the draining). Waits for the torchruns themselves, not for their pipes to close: a rank left
    behind that holds the output open is killed after ``PIPE_GRACE_S``. ``seen`` collects the processes under them (pid → start
    ticks) as they run; past ``deadline`` (monotonic) :class:`TrainRetry`. Returns (exit codes, the last lines, the
    ranks' own "train: error: …" lines and the hung ranks' "[hang] rank …" lines, ``pipelines.train.heartbeat``)."""
    seen = {} if seen is None else seen
    errors: list[str] = []
    lock = threading.Lock()
    keeps: list[deque[str]] = [deque(maxlen=40)] + [deque(maxlen=10) for _ in procs[1:]]
    echo = [True]

    def drain(n: int, p: subprocess.Popen, keep: deque) -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            keep.append(line)
            if ": error: " in line or line.startswith("[hang] rank "):
                with lock:
                    if line not in errors:
                        errors.append(line)
            if n == 0 and echo[0]:
                try:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                except UnicodeEncodeError:  # a stdout that cannot show a character: the line with a stand-in
                    enc = sys.stdout.encoding or "ascii"
                    sys.stdout.write(line.encode(enc, "replace").decode(enc))
                except (OSError, ValueError):  # our reader is gone: keep draining, or the ranks stop on a full pipe
                    echo[0] = False

    readers = [threading.Thread(target=drain, args=(n, p, keep), daemon=True, name=f"llmp-node{n}-output")
               for n, (p, keep) in enumerate(zip(procs, keeps))]
    for t in readers:
        t.start()
    while any(p.poll() is None for p in procs):
        seen.update(tree_of([p.pid for p in procs if p.poll() is None]))
        if deadline is not None and time.monotonic() > deadline:
            raise TrainRetry("torchrun did not finish within launcher.timeout_minutes; it is stopped")
        time.sleep(0.5)
    for t in readers:
        t.join(timeout=PIPE_GRACE_S)  # the pipe closes with the last process holding it
    if any(t.is_alive() for t in readers):  # a rank left behind holds it open: it goes, and its pipe with it
        kill_known(seen, 5.0)
        for t in readers:
            t.join(timeout=5)
    tail = keeps[0]
    for keep in keeps[1:]:
        tail.extend(list(keep))
    return [p.returncode for p in procs], tail, errors


def check_supported(spec: JobSpec) -> None:
    """Fail before anything starts when the ranks could not see the stage's files: on Kubernetes the pods
    read and write run.root and checkpoint.l1 through the shared filesystem, at the same paths; checkpoint.l0 is
    either there too or an absolute path where each pod mounts its own host's disk."""
    if not spec.launcher.on_kubernetes:
        return

    mount = Path(spec.launcher.shared_fs_mount)
    keys = [("run.root", spec.run.root), ("checkpoint.l1", spec.checkpoint.l1)]
    if not node_local_l0(spec):
        keys.append(("checkpoint.l0", spec.checkpoint.l0))
    for key, value in keys:
        p = resolve_path(value).resolve()
        if p != mount and mount not in p.parents:
            raise TrainError(f"launcher.kind={spec.launcher.kind}: {key} resolves to {p}, outside launcher.shared_fs_mount="
                             f"{mount}; the pods would not see it. Put {key} under {mount} (mount the shared "
                             "filesystem on the Airflow workers at the same path)"
                             + ("; or make checkpoint.l0 an absolute path outside it for a node-local L0"
                                if key == "checkpoint.l0" else ""))


def collect(work: Path, tmp: Path, names: list[str]) -> None:
    if work == tmp:
        return
    for n in names:
        if not (work / n).is_file():  # not visible yet on the shared filesystem, or lost with it: not the spec's
            raise TrainRetry(f"the ranks finished but no {n} is in {work}; a retry resumes from the newest checkpoint")
        (tmp / n).write_bytes((work / n).read_bytes())


def run_ranks(spec: JobSpec, module: str, args: list[str], run_id: str, restarts: bool = True,
              detachable: bool = False, token: Optional[str] = None, work: Optional[Path] = None,
              judge: Optional[Callable[[], None]] = None) -> None:
    """Run ``module`` on every rank the spec asks for: torchrun here, or a TrainJob / PyTorchJob on Kubernetes (with
    ``LLMP_DETACH=1``, as a deferrable Airflow task sets it, a ``detachable`` caller, one whose job command and
    work dir are the same when it runs again, gets ``Pending`` after the submit instead of waiting). ``work``: the
    ranks' ``--out``, where a rank that stops early says why (``exit_codes``); a failure is :class:`TrainRetry`
    (exit 75) unless the spec or the input must change (:class:`TrainError`, exit 2). ``judge``, once the ranks
    are done: whether their result is the stage's (a :class:`StageError` says why not, e.g. they were preempted)."""
    env = {"LLMP_RUN_TOKEN": token} if token else None  # the launch, for the ranks' lineage (history.run_token)
    if spec.launcher.on_kubernetes:
        run_kubernetes(spec, module, args, run_id, detachable, work, judge, env)
        return
    run_torchrun(spec, args, module, restarts, env, work)
    if judge is not None:
        judge()


def run_kubernetes(spec: JobSpec, module: str, args: list[str], run_id: str, detachable: bool,
                   work: Optional[Path], judge: Optional[Callable[[], None]],
                   env: Optional[dict[str, str]] = None) -> None:
    """The ranks as a Kubernetes job (:func:`pipelines.launch.k8s.run_job`). With a ``work`` dir, a finished job
    whose outcome this try read and did not take as done (it failed, or ``judge`` refused its result) is recorded
    there, so that the next try replaces it instead of reading the same outcome again (``k8s.JobRecord``)."""
    record = JobRecord(work) if work is not None else None
    log = lambda m: print(m, flush=True)  # noqa: E731
    try:
        done = run_job(spec, run_id, module, args, log=log,
                       detach=detachable and os.environ.get("LLMP_DETACH") == "1", record=record, env=env)
    except JobFailed as e:  # refused (the spec must change) or failed by its nodes / the API (retry)
        if record is not None and e.job is not None:
            record.mark_collected(e.job, log)
        user = work is not None and xc.failed_ranks_code(xc.read_outcomes(work)) == xc.USER_ERROR
        raise (TrainRetry if e.retryable and not user else TrainError)(str(e)) from None
    if judge is None:
        return
    try:
        judge()
    except StageError as e:  # preempted: read once, a new job next time. A result not visible yet, a fence that
        # could not be read: not a verdict on the job (a finished training must not be replaced and run again)
        if record is not None and getattr(e, "job_verdict", False):
            record.mark_collected(done, log)
        raise
