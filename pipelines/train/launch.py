"""Launch training: the ``train`` stage.

:func:`run_ranks` is the one launcher interface (the preflight stage uses it too), chosen by
``launcher.kind``: ``local`` (the default) runs ``torchrun`` as a subprocess (``--standalone`` on one node, or
c10d rendezvous on 127.0.0.1 for ``nnodes > 1`` on this machine) and streams its output; on Kubernetes
``trainjob`` (the default kind there, which ``kubernetes`` means) submits a Kubeflow Trainer v2 TrainJob and
``pytorchjob`` a training-operator v1 PyTorchJob, each checked first as the cluster's admission checks it (a job
it would refuse is not sent: the stage fails with the rule, exit 2), then watched (``pipelines.train.k8s``). On
success the stage writes its manifest: the L0 location of the final checkpoint, the loss curve (JSON
and PNG, the PNG also logged to MLflow) and throughput.

    python -m pipelines.train.launch --tokenize-manifest M [--spec S] [--set train.steps=50]
"""
from __future__ import annotations

import json
import math
import os
import signal
import threading
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Callable, Optional

from pipelines.cli import run_and_log, stage_dir, stage_main
from pipelines.manifest import Manifest, StageError, input_ref
from pipelines.spec import JobSpec, resolve_path
from pipelines.train import exit_codes as xc
from pipelines.train import fence
from pipelines.train.job import TrainJob, train_job  # noqa: F401 - TrainJob: the launcher's callers read it here


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
    return ["--shutdown-timeout", str(math.ceil(spec.train.preempt_grace_s) + 5),
            "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmds(spec: JobSpec, trainer_args: list[str], module: str = "pipelines.train.trainer",
                  restarts: bool = True) -> list[list[str]]:
    """One torchrun command per node (all on this machine for a local multi-node run). With ``restarts``
    torchrun restarts the ranks up to ``launcher.max_restarts`` times when one dies (they resume from the
    newest checkpoint); a health check (preflight) runs once."""
    L = spec.launcher
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(L.nproc_per_node),
            "--max-restarts", str(L.max_restarts if restarts else 0), *torchrun_flags(spec)]
    if L.nnodes == 1:
        return [base + ["--standalone", "-m", module, *trainer_args]]
    port = _free_port()
    return [base + ["--nnodes", str(L.nnodes), "--node-rank", str(n), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"llmp-{port}",
                    "-m", module, *trainer_args] for n in range(L.nnodes)]


def run_torchrun(spec: JobSpec, trainer_args: list[str], module: str = "pipelines.train.trainer",
                 restarts: bool = True, env_extra: Optional[dict] = None, work: Optional[Path] = None) -> None:
    """Run torchrun (one per node) to the end, streaming node 0's output. A preemption notice to this process
    (SIGTERM, SIGUSR1) goes on to torchrun as SIGTERM, which passes it to the ranks and waits for their checkpoint.
    A failure is :class:`TrainRetry` unless a rank's outcome file in ``work`` says the input must change."""
    env = {**os.environ, **(env_extra or {})}
    env.setdefault("OMP_NUM_THREADS", str(spec.launcher.threads_per_proc))
    env["PYTHONUNBUFFERED"] = "1"
    # each restarted worker group gets a store of its own (a shared one hung a restart now and then on gloo)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if work is not None:
        # an earlier attempt's (no attempt id here, unlike on Kubernetes: the work dir is this run's own staging
        # dir, published with the result, and every rank is a child this process waits for)
        xc.clear_outcomes(work)
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in torchrun_cmds(spec, trainer_args, module, restarts)]
    noticed: list[int] = []
    previous = _forward_notices(procs, noticed)
    try:
        codes, tail, errors = _stream(procs)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    outcomes = xc.read_outcomes(work) if work is not None else []
    why = "".join(errors) + f"torchrun exited with {codes}; last output:\n" + "".join(tail) if any(codes) else ""
    preempted(outcomes, noticed, bool(why), why)
    if any(codes):
        raise (TrainError if xc.failed_ranks_code(outcomes) == xc.USER_ERROR else TrainRetry)(why)


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


def _stream(procs: list[subprocess.Popen]) -> tuple[list[int], deque, list[str]]:
    """Node 0's output to stdout until every rank closed it; other nodes' output kept for the error message.
    Returns (exit codes, the last lines, the ranks' own "train: error: …" lines and the hung ranks' "[hang] rank …"
    lines, ``pipelines.train.heartbeat``)."""
    tail: deque[str] = deque(maxlen=40)
    errors: list[str] = []
    for line in procs[0].stdout:  # type: ignore[union-attr]
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line)
        if (": error: " in line or line.startswith("[hang] rank ")) and line not in errors:
            errors.append(line)
    codes = [p.wait() for p in procs]
    for p in procs[1:]:
        tail.extend((p.stdout.read() or "").splitlines(keepends=True)[-10:])  # type: ignore[union-attr]
    return codes, tail, errors


def plot_losses(losses: list, path: Path, val: list | None = None) -> None:
    """The training loss per step, and the validation loss (``val``: [{step, loss, bpb}]) on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if losses:
        xs, ys = zip(*losses)
        ax.plot(xs, ys, lw=1.2, color="#c0392b", label="train")
    if val:
        ax.plot([v["step"] for v in val], [v["loss"] for v in val], "o-", lw=1.5, ms=4, color="#2c3e50",
                label="validation (held-out)")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Training and validation loss" if val else "Training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def check_supported(spec: JobSpec) -> None:
    """Fail before anything starts when the ranks could not see the stage's files: on Kubernetes the pods
    read and write run.root and checkpoint.l1 through the shared filesystem, at the same paths; checkpoint.l0 is
    either there too or an absolute path where each pod mounts its own host's disk."""
    if not spec.launcher.on_kubernetes:
        return
    from pipelines.train.k8s import node_local_l0

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


def check_mixture(spec: JobSpec, tok: Manifest) -> None:
    """``train.mixture`` against the corpus's train sources before any rank starts: a key that matches no source, a
    source nothing weighs … fail the stage with the line that names it (exit 2)."""
    if not spec.train.mixture:
        return
    from pipelines.train.loader import MixtureError, train_samples

    try:
        train_samples(tok, spec.model.seq_len, spec.train.mixture)
    except MixtureError as e:
        raise TrainError(str(e)) from None


def collect(work: Path, tmp: Path, names: list[str]) -> None:
    if work == tmp:
        return
    for n in names:
        if not (work / n).is_file():
            raise TrainError(f"the ranks finished but wrote no {n} in {work}")
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
    if spec.launcher.on_kubernetes:
        run_kubernetes(spec, module, args, run_id, detachable, work, judge)
        return
    run_torchrun(spec, args, module, restarts, {"LLMP_RUN_TOKEN": token} if token else None, work)
    if judge is not None:
        judge()


def run_kubernetes(spec: JobSpec, module: str, args: list[str], run_id: str, detachable: bool,
                   work: Optional[Path], judge: Optional[Callable[[], None]]) -> None:
    """The ranks as a Kubernetes job (:func:`pipelines.train.k8s.run_job`). With a ``work`` dir, a finished job
    whose outcome this try read and did not take as done (it failed, or ``judge`` refused its result) is recorded
    there, so that the next try replaces it instead of reading the same outcome again (``k8s.JobRecord``)."""
    from pipelines.train.k8s import JobFailed, JobRecord, run_job

    record = JobRecord(work) if work is not None else None
    log = lambda m: print(m, flush=True)  # noqa: E731
    try:
        done = run_job(spec, run_id, module, args, log=log,
                       detach=detachable and os.environ.get("LLMP_DETACH") == "1", record=record)
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


def judge_result(spec: JobSpec, rel_root: str, work: Path, tmp: Path) -> None:
    """The ranks are done: their result is the stage's (copied into ``tmp``), or :class:`TrainRetry` / a
    :class:`StageError` says why not."""
    try:
        preempted(xc.read_outcomes(work), [])  # on Kubernetes: the pods' ranks stopped on a notice
    except StageError as e:
        e.job_verdict = True  # the job's own outcome: the next try replaces it (run_kubernetes)
        raise
    collect(work, tmp, ["result.json", "losses.json"])
    result = json.loads((tmp / "result.json").read_text())
    fence.confirm(spec, rel_root, result.get("fence"))  # a superseded attempt's result is not the stage's (75)


def run(spec: JobSpec, tok: Manifest, out_dir: str | None = None) -> Manifest:
    from pipelines.train.ckpt_tiers import commit_generation, retire_generations

    check_supported(spec)
    sd = stage_dir(spec, "train", [input_ref(tok)], out_dir)

    def body(tmp: Path) -> Manifest:
        check_mixture(spec, tok)
        # run.force: a new generation of this key's checkpoints, resumed by a retry, the old one kept until commit
        job = train_job(spec, tok, out_dir, tmp, sd)
        rel_root, work = job.rel_root, job.work
        work.mkdir(parents=True, exist_ok=True)
        spec.write_work_file(work / "spec.yaml")
        # one token per stage key and generation: torchrun's restarts and the task's retries are this launch again
        # (train.resume=never starts over once; pipelines.train.lineage); on Kubernetes the job's name does this
        run_ranks(spec, "pipelines.train.trainer", job.args, run_id=job.run_id, detachable=True,
                  token=f"{job.run_id}:{rel_root}", work=work, judge=lambda: judge_result(spec, rel_root, work, tmp))
        (tmp / "spec.yaml").write_text(spec.to_yaml())  # the output copy: no secrets
        result = json.loads((tmp / "result.json").read_text())
        plot_losses(json.loads((tmp / "losses.json").read_text()), tmp / "loss_curve.png", result.get("val"))
        m = sd.commit(
            {"losses": "losses.json", "result": "result.json", "loss_curve": "loss_curve.png", "spec": "spec.yaml"},
            counts={"steps": result["steps"], "tokens_seen": result["tokens_seen"]},
            metrics={"final_loss": result["final_loss"], "tokens_per_s": result["tokens_per_s"],
                     "params": result["params"], "rollbacks": result["rollbacks"],
                     "ckpt_stall_s_mean": result["ckpt"]["stall_s_mean"],
                     **({"val_loss": result["val"][-1]["loss"], "val_bpb": result["val"][-1]["bpb"]}
                        if result.get("val") else {})},
            extra={"checkpoint": f"{rel_root}/{result['checkpoint']}", "mlflow_run_id": result["mlflow_run_id"],
                   "world_size": result["world_size"], "backend": result["backend"],
                   "resumed_from": result["resumed_from"], "promoted_during_run": result["ckpt"]["promoted"],
                   "val": result.get("val", []), "best_val_step": result.get("best_val_step"),
                   **({"mixture": result["mixture"]} if "mixture" in result else {})},
        )
        commit_generation(spec, base_rel, rel_root)
        return m

    base_rel = f"{spec.run.name}/{sd.final.name}"
    return run_and_log(spec, sd, body, artifacts=["loss_curve"],
                       housekeeping=lambda: retire_generations(spec, base_rel))


def summary(m: Manifest) -> str:
    tps = m.metrics["tokens_per_s"]
    resumed = m.extra.get("resumed_from")
    val = m.extra.get("val") or []
    return (f"train: {m.counts['steps']} steps, final loss {m.metrics['final_loss']:.3f}, "
            + (f"validation loss {val[-1]['loss']:.3f} ({val[-1]['bpb']:.3f} bits/byte; best at step "
               f"{m.extra['best_val_step']}), " if val else "")
            + (f"{tps:,.0f} tokens/s, " if tps else "") + f"checkpoint {m.extra['checkpoint']}"
            + (f" (resumed from step {resumed['step']} on {resumed['tier']})" if resumed else "")
            + f"; manifest {m.path}")


def main(argv: list[str] | None = None) -> int:
    return stage_main("train", run, summary, argv)


if __name__ == "__main__":
    sys.exit(main())
