"""The ``train`` stage: its ranks run ``pipelines.train.trainer`` through :func:`pipelines.launch.ranks.run_ranks`
(torchrun here, a Kubeflow training job on Kubernetes), resumed from the newest committed checkpoint when retried. On
success the stage writes its manifest: the L0 location of the final checkpoint, the loss curve (JSON
and PNG, the PNG also logged to MLflow) and throughput.

    python -m pipelines.train.launch --tokenize-manifest M [--spec S] [--set train.steps=50]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pipelines.cli import run_and_log, stage_dir, stage_main
from pipelines.launch import outcomes as xc
from pipelines.launch.ranks import TrainError, check_supported, collect, preempted, run_ranks
from pipelines.manifest import Manifest, StageError, input_ref
from pipelines.spec import JobSpec
from pipelines.train.ckpt import fence
from pipelines.train.ckpt.tiers import commit_generation, retire_generations
from pipelines.train.job import train_job
from pipelines.train.loader import MixtureError, train_samples


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


def check_mixture(spec: JobSpec, tok: Manifest) -> None:
    """``train.mixture`` against the corpus's train sources before any rank starts: a key that matches no source, a
    source nothing weighs … fail the stage with the line that names it (exit 2)."""
    if not spec.train.mixture:
        return

    try:
        train_samples(tok, spec.model.seq_len, spec.train.mixture)
    except MixtureError as e:
        raise TrainError(str(e)) from None


def judge_result(spec: JobSpec, rel_root: str, work: Path, tmp: Path) -> None:
    """The ranks are done: their result is the stage's (copied into ``tmp``), or :class:`TrainRetry` / a
    :class:`StageError` says why not."""
    outcomes = xc.read_outcomes(work)  # unreadable: no verdict on the job (75, and it is collected again)
    try:
        preempted(outcomes, [])  # on Kubernetes: the pods' ranks stopped on a notice
    except StageError as e:
        e.job_verdict = True  # the job's own outcome: the next try replaces it (run_kubernetes)
        raise
    collect(work, tmp, ["result.json", "losses.json"])
    result = json.loads((tmp / "result.json").read_text())
    fence.confirm(spec, rel_root, result.get("fence"))  # a superseded attempt's result is not the stage's (75)


def run(spec: JobSpec, tok: Manifest, out_dir: str | None = None) -> Manifest:
    check_supported(spec)
    sd = stage_dir(spec, "train", [input_ref(tok)], out_dir)

    def body(tmp: Path) -> Manifest:
        check_mixture(spec, tok)
        # run.force: a new generation of this key's checkpoints, resumed by a retry, the old one kept until commit
        job = train_job(spec, tok, out_dir, tmp, sd)
        rel_root, work = job.rel_root, job.work
        work.mkdir(parents=True, exist_ok=True)
        spec.write_work_file(work / "spec.yaml")
        run_ranks(spec, "pipelines.train.trainer", job.args, run_id=job.run_id, detachable=True,
                  token=job.token, work=work, judge=lambda: judge_result(spec, rel_root, work, tmp))
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
