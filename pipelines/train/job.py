"""The train stage's job for given inputs (:func:`train_job`): its stage dir, the checkpoints' generation, where
the ranks write, and their arguments; the same for torchrun here and for the TrainJob or PyTorchJob that
:mod:`pipelines.launch.k8s` renders (its CLI prints the job without launching anything)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipelines.cli import stage_dir
from pipelines.manifest import Manifest, StageDir, input_ref
from pipelines.spec import JobSpec, resolve_path
from pipelines.train.ckpt.tiers import generation


def rank_workdir(spec: JobSpec, sd: StageDir, tmp: Optional[Path]) -> Path:
    """Where the ranks write: the stage's temp dir locally; on Kubernetes (or with no temp dir yet) a directory
    named by the stage key, so a retried task's job has the same command as the one it adopts."""
    if not spec.launcher.on_kubernetes and tmp is not None:
        return tmp
    return sd.final.with_name(f".{sd.final.name}.work")


@dataclass
class TrainJob:
    """What the ranks of one train stage run: the same for torchrun here and for the TrainJob or PyTorchJob (whose
    name and command are fixed by the stage key, so a retried task adopts the job it submitted)."""
    sd: StageDir
    rel_root: str  # the run's checkpoints below each tier's root
    work: Path  # where the ranks write result.json, losses.json and read spec.yaml
    run_id: str
    args: list[str]
    token: str  # the launch's lineage token (LLMP_RUN_TOKEN, pipelines.train.ckpt.history)


def train_job(spec: JobSpec, tok: Manifest, out_dir: str | None = None, tmp: Optional[Path] = None,
              sd: Optional[StageDir] = None) -> TrainJob:
    """The train stage's job for these inputs (``sd``: the stage dir, when the caller has it). The ranks write in
    the stage's temp dir locally; on Kubernetes in a directory named by the stage key."""
    sd = sd or stage_dir(spec, "train", [input_ref(tok)], out_dir)
    rel_root = generation(spec, f"{spec.run.name}/{sd.final.name}", spec.run.force)
    work = rank_workdir(spec, sd, tmp)
    ckpt_root = resolve_path(spec.checkpoint.l0) / rel_root
    args = ["--spec", str(work / "spec.yaml"), "--tokenize-manifest", tok.path, "--out", str(work),
            "--ckpt-root", str(ckpt_root)]
    run_id = f"train-{sd.final.name[:8]}"
    return TrainJob(sd, rel_root, work, run_id, args, launch_token(run_id, rel_root))


def launch_token(run_id: str, rel_root: str) -> str:
    """One token per job name, stage key (``train.resume`` is part of it) and generation: torchrun's restarts, the
    task's retries and a job re-created on Kubernetes are this launch again (``train.resume=never`` starts over
    once, ``=N`` forks once: :mod:`pipelines.train.ckpt.history`)."""
    return f"{run_id}:{rel_root}"
