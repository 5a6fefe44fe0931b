"""What the train stage's exit status means, in one place (the table is in docs/training.md).

* ``OK`` (0): the stage is done.
* ``USER_ERROR`` (2): the spec or an input must be fixed; a retry cannot help (orchestrators do not retry it).
* ``RETRY`` (75, ``EX_TEMPFAIL``): an infrastructure failure or a preemption: a retry of the same command resumes
  from the newest committed checkpoint (Airflow's task retries run for it).

A rank (``pipelines.train.trainer``) that stops early writes an outcome file (:func:`write_outcome`) in its
``--out`` directory, since torchrun's own status does not carry the ranks': ``RETRY`` with the step after it
checkpointed on a preemption notice (its status is then 0, so that torchrun does not restart the ranks) or when
storage failed, ``USER_ERROR`` when the run diverged or the spec cannot run. The launcher reads them.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

OK = 0
USER_ERROR = 2
RETRY = 75  # sysexits.h EX_TEMPFAIL: "temporary failure, the user is invited to retry"

# the notices a scheduler sends before it kills a job (Kubernetes, Slurm's --signal, spot reclaim agents)
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# a rank writes this into its --out directory once its preemption checkpoint is on L1 (or it gave up on it)
PREEMPTED_FILE = "preempted.json"
OUTCOME_GLOB = "exit-rank*.json"  # what each rank that stopped early says, in the ranks' --out directory


def write_outcome(out: Path, rank: int, code: int, reason: str, **extra) -> None:
    """A rank's outcome file (``exit-rank<R>.json``): its exit code and why, for the launcher to classify."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".exit-rank{rank}.json.tmp"
        tmp.write_text(json.dumps({"rank": rank, "code": code, "reason": reason, **extra}))
        os.replace(tmp, out / f"exit-rank{rank}.json")
    except OSError:  # the status still says it; the launcher then counts the failure as infrastructure
        pass


def read_outcomes(out: Path) -> list[dict]:
    found = []
    for f in sorted(out.glob(OUTCOME_GLOB)):
        try:
            found.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return found


def clear_outcomes(out: Path) -> None:
    for f in out.glob(OUTCOME_GLOB):
        f.unlink(missing_ok=True)


def clear_outcome(out: Path, rank: int) -> None:
    try:
        (out / f"exit-rank{rank}.json").unlink(missing_ok=True)
    except OSError:
        pass


def failed_ranks_code(outcomes: list[dict]) -> int:
    """The stage's status when the ranks did not all finish: ``USER_ERROR`` when a rank said the spec or the data
    must change, else ``RETRY`` (a preemption, storage, a rank killed or lost, torchrun's restarts used up)."""
    return USER_ERROR if any(o.get("code") == USER_ERROR for o in outcomes) else RETRY
