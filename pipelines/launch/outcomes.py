"""The train stage's ranks and their exit status (the statuses themselves, ``OK``, ``USER_ERROR`` and ``RETRY``,
are every stage's: :mod:`pipelines.exit_codes`; a retry of the train stage resumes from the newest committed
checkpoint).

A rank (``pipelines.train.trainer``) that stops early writes an outcome file (:func:`write_outcome`) in its
``--out`` directory, since torchrun's own status does not carry the ranks': ``RETRY`` with the step after it
checkpointed on a preemption notice (its status is then 0, so that torchrun does not restart the ranks) or when
storage failed, ``USER_ERROR`` when the run diverged or the spec cannot run; ``final`` when every try would stop
the same way (the ranks torchrun or the pod restarts then stop at their start: ``pipelines.train.trainer``). The
launcher reads them.

Each file names the attempt that wrote it (``attempt``): the id the launcher put in the directory
(:data:`ATTEMPT_FILE`, :func:`new_attempt`) before it created the ranks' Kubernetes job, as the rank found it at its
start. :func:`read_outcomes` leaves out the files of other attempts: a rank that no longer exists (an elastic job
back with fewer nodes) never clears its own, and a rank of an earlier job that outlived it may still write one. The
local launcher names no attempt (its ranks are its own children, writing in the run's own staging dir): it clears
the directory, and every file there counts.
"""
from __future__ import annotations

import json
import re
import signal
import uuid
from pathlib import Path
from typing import Optional

from pipelines.exit_codes import OK, RETRY, USER_ERROR  # noqa: F401 - the ranks read the three here (xc.OK)
from pipelines.manifest import StageError, atomic_write_text, read_small_text

# the notices a scheduler sends before it kills a job (Kubernetes, Slurm's --signal, spot reclaim agents)
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# a rank writes this into its --out directory once its preemption checkpoint is on L1 (or it gave up on it)
PREEMPTED_FILE = "preempted.json"
OUTCOME_GLOB = "exit-rank*.json"  # what each rank that stopped early says, in the ranks' --out directory
ATTEMPT_FILE = ".attempt"  # in the ranks' --out directory: the attempt whose outcome files count (new_attempt)
_ATTEMPT_AT_START: dict[str, Optional[str]] = {}  # the attempt each --out directory named when this process first
# looked: a rank's, at its start (clear_outcome)


class OutcomesUnreadable(StageError):
    """The ranks' ``--out`` directory did not answer (its attempt file exists and cannot be read): no verdict on the
    ranks can be taken from it, and every outcome file there counting is not one either (exit 75)."""

    exit_code = RETRY


def new_attempt(out: Path) -> str:
    """An attempt starts in ``out`` (the Kubernetes launcher, before it creates the ranks' job; not when it
    follows a job that runs or collects one that finished): a new id in :data:`ATTEMPT_FILE`, which the ranks started
    from now on write into their outcome files, and no outcome file of an earlier attempt left."""
    attempt = uuid.uuid4().hex[:16]
    atomic_write_text(out / ATTEMPT_FILE, attempt)  # a temp name of its own, fsync'd: no planted link followed
    _ATTEMPT_AT_START[str(out)] = attempt
    clear_outcomes(out)
    return attempt


def current_attempt(out: Path) -> Optional[str]:
    """The attempt ``out`` names now; None when no launcher named one (an older launcher, a directory of a test).
    :class:`OutcomesUnreadable` when its file is there and does not answer (EIO, a stale handle, not a file): that
    is no "none named", under which every outcome file, stale ones too, would count."""
    try:
        attempt = read_small_text(out / ATTEMPT_FILE).strip() or None
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise OutcomesUnreadable(f"{out / ATTEMPT_FILE} cannot be read ({e}): the ranks' outcomes are not known; "
                                 "a retry reads them again") from None
    if attempt is not None and not re.fullmatch(r"[0-9a-f]{16}", attempt):  # it names files: only what we write
        raise OutcomesUnreadable(f"{out / ATTEMPT_FILE} holds {attempt[:40]!r}, not an attempt id of this launcher")
    return attempt


def rank_attempt(out: Path) -> Optional[str]:
    """The attempt this process belongs to: the one ``out`` named when the process first looked (a rank at its
    start, :func:`clear_outcome`), so that a rank of an earlier job still running after the launcher started the next
    attempt does not write the new id."""
    key = str(out)
    if key not in _ATTEMPT_AT_START:
        _ATTEMPT_AT_START[key] = current_attempt(out)
    return _ATTEMPT_AT_START[key]


def outcome_name(rank: int, attempt: Optional[str]) -> str:
    """A rank's outcome file's name: ``exit-rank<R>.json``, or ``exit-rank<R>-<attempt>.json`` in an attempt (a
    rank of an earlier attempt that outlived its job then never replaces the current attempt's file)."""
    return f"exit-rank{rank}.json" if attempt is None else f"exit-rank{rank}-{attempt}.json"


def write_outcome(out: Path, rank: int, code: int, reason: str, **extra) -> bool:
    """A rank's outcome file (:func:`outcome_name`): its exit code and why, for the launcher to classify, and the
    attempt that wrote it (:func:`rank_attempt`). Whether it was written: a rank that exits 0 on a preemption must
    exit 75 instead when nobody will read that it was one."""
    try:
        attempt = rank_attempt(out)
        body = {"rank": rank, "code": code, "reason": reason, "attempt": attempt, **extra}
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / outcome_name(rank, attempt), json.dumps(body))  # a temp name of its own
        return True
    except (OSError, OutcomesUnreadable):  # the status still says it; the launcher counts it as infrastructure
        return False


def read_outcomes(out: Path) -> list[dict]:
    """The outcome files of the attempt ``out`` names (:func:`current_attempt`); those of another attempt are stale
    and left out. A file without an attempt (or with none: its rank found no id) counts: ranks of an image older
    than the field write such files (the job's image can lag the launcher), and it cannot be an earlier attempt's
    of this launcher, which removed every outcome file when it started the current one (:func:`new_attempt`)."""
    current, found = current_attempt(out), []
    for f in sorted(out.glob(OUTCOME_GLOB)):
        try:
            o = json.loads(read_small_text(f))
        except (OSError, ValueError):
            continue
        if not isinstance(o, dict):
            continue
        if current is None or o.get("attempt") in (None, current):
            found.append(o)
    return found


def final_stop(out: Path) -> Optional[dict]:
    """The outcome of a rank of this launch (this attempt) that stopped with a ``final`` ``USER_ERROR``, else None.
    Only a stop that would repeat is final (a diverged run rolls back to the same checkpoint, a damaged shard stays
    damaged, a checkpoint of another model stays one), so a restart of the ranks (``pipelines.train.trainer``) ends at
    once instead of loading the model again; any other exit 2 (a ``ValueError``, which a torn read can raise too)
    leaves the restart to train. The launcher clears the outcomes when it starts a new attempt; an attempt file that
    cannot be read now gives no verdict."""
    try:
        current = current_attempt(out)
        if current is None and (out / ATTEMPT_FILE).exists():
            return None
    except (OSError, OutcomesUnreadable):  # the directory itself does not answer: no verdict
        return None
    return next((o for o in read_outcomes(out) if o.get("code") == USER_ERROR and o.get("final") is True
                 and (current is None or o.get("attempt") == current)), None)


def clear_outcomes(out: Path) -> None:
    for f in out.glob(OUTCOME_GLOB):
        try:
            f.unlink(missing_ok=True)
        except OSError:
            pass


def clear_outcome(out: Path, rank: int) -> None:
    """At a rank's start: its file of an earlier attempt goes; the attempt it belongs to is noted
    (:func:`rank_attempt`)."""
    try:
        (out / outcome_name(rank, rank_attempt(out))).unlink(missing_ok=True)
    except (OSError, OutcomesUnreadable):
        pass


def failed_ranks_code(outcomes: list[dict]) -> int:
    """The stage's status when the ranks did not all finish: ``USER_ERROR`` when a rank said the spec or the data
    must change, else ``RETRY`` (a preemption, storage, a rank killed or lost, torchrun's restarts used up)."""
    return USER_ERROR if any(o.get("code") == USER_ERROR for o in outcomes) else RETRY
