"""The promote stage: the train stage's final checkpoint L0 → L1 → L2 (S3), verified at every tier, COMMIT last
(:func:`pipelines.train.ckpt.tiers.promote`, the part protocol of training: a step of one part promoted from L0,
a step already on L1 put on L2), with the steps L1 held for L2 while training's L2 lagged
(:func:`pipelines.train.ckpt.tiers.promote_held`); before the first step on L2, the run's term, its lineage
record and its key's generations record (:func:`pipelines.train.ckpt.fence_l2.carry`). Done only while L2 still
holds the committed copy.

    python -m pipelines.train.promote --train-manifest M [--spec S]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pipelines.cli import stage_dir, stage_main
from pipelines.manifest import Manifest, StageError, input_ref, plain_rel, run_stage
from pipelines.spec import JobSpec
from pipelines.storage import oserrors
from pipelines.train.ckpt import fence_l2, history
from pipelines.train.ckpt.s3_tier import commit_at
from pipelines.train.ckpt.protocol import CheckpointError, parse_step, read_local_manifest
from pipelines.train.ckpt.tiers import promote, promote_held, tier_locations


def run(spec: JobSpec, train: Manifest, out_dir: str | None = None) -> Manifest:
    rel = train.extra.get("checkpoint")
    if not plain_rel(rel):  # a path from data: never a copy, write or upload outside the tiers
        raise StageError(f"train manifest {train.path}: extra.checkpoint {rel!r} is not a plain relative path below "
                         "the tiers; it was not written by the train stage")
    sd = stage_dir(spec, "promote", [input_ref(train)], out_dir)

    root, _, name = rel.rpartition("/")

    def carry(man: dict) -> None:
        """The run's term and records on L2 before its step: training's L2 may have been down to its end."""
        if root:
            fence_l2.carry(spec, root, history.term_of(man))

    def body(tmp: Path) -> Manifest:
        rep = promote(spec, rel, before_l2=carry)
        final = parse_step(name)
        held = promote_held(spec, root, final) if root and final is not None else {"done": [], "failed": {}}
        rep["held_to_l2"], rep["held_failed"] = held["done"], held["failed"]
        if held["done"]:
            print(f"[promote] steps L1 held while L2 lagged, now on L2: {held['done']}")
        (tmp / "tiers.json").write_text(json.dumps(rep, indent=2))
        return sd.commit({"tiers": "tiers.json"}, counts={"tiers": 3},
                         extra={"checkpoint": rel, "l2_uri": rep["tiers"]["L2"], "commit": rep["l2_commit"],
                                "actions": rep["actions"]})

    done = sd.existing()
    if done is not None:  # the manifest says promoted; make sure L2 still verifies
        said = done.extra.get("commit")  # (None: a manifest of before 2026-12-03 that recorded no COMMIT: redone)
        if said is not None and commit_at(spec, done.extra["l2_uri"]) == said:
            carry(_l1_manifest(spec, rel))  # a step promoted before the stage put the run's records there too
            print(f"[promote] up to date: {done.path}")
            return done
        sd.force = True
    return run_stage(sd, body)


def _l1_manifest(spec: JobSpec, rel: str) -> dict:
    """The step's manifest on L1; {} when L1 holds none that reads (no COMMIT, gone by retention: the step's term is
    then L1's highest). L1 failing to answer (EIO, ESTALE …: 75) or refusing this user (2) raises: the step's term,
    which its file on L1 may have lost, is unknown, not none."""
    try:
        return read_local_manifest(Path(tier_locations(spec, rel)["L1"]))
    except (CheckpointError, ValueError):
        return {}
    except OSError as e:
        if e.errno in oserrors.ANSWERS:
            return {}
        raise fence_l2.l1_unreadable(f"L1: the manifest of {rel} cannot be read", e) from None


def summary(m: Manifest) -> str:
    return f"promote: {m.extra['checkpoint']} → {m.extra['l2_uri']} ({m.extra['actions']}); manifest {m.path}"


def main(argv: list[str] | None = None) -> int:
    return stage_main("promote", run, summary, argv)


if __name__ == "__main__":
    sys.exit(main())
