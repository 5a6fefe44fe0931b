"""The run's terms where they survive losing L1 (issue 52): a retry on a new cluster (a new FSx, so a new, empty
``.fence`` on L1) must not take a term that an older attempt already held, or the fence could not tell the two
apart on L2.

* Each attempt records its term in L2 beside the checkpoints, ``<L2 run prefix>/.fence/term-NNNNNNNNN`` (JSON: the
  attempt, its launch), before its first COMMIT there (:func:`record`, called by the promoter), so every step on L2
  was committed by a term that L2 records.
* The promote stage, which holds no term, puts L1's highest term and the run's records there before a step
  (:func:`carry`): a training run whose L2 did not answer to its end recorded none of them.
* An L1 fence directory that has never read L2's terms and holds none (a new L1) takes its first term above the
  highest one L2 records (:func:`floor`). While L2 does not answer, that floor is unknown: the attempt does not
  start (:class:`~pipelines.train.ckpt.protocol.L2Unavailable`, exit 75), since "no answer" is never "no term". Once
  read, ``l2-floor`` records it on L1 (before the term is taken), and the terms on L1 stay above it from then on.

With no S3 endpoint configured (and no embedded one ever started here) there is no L2 and the floor is 0.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from pipelines.manifest import atomic_write_text, read_small_text
from pipelines.spec import JobSpec
from pipelines.storage import oserrors
from pipelines.storage.s3 import client, split_uri
from pipelines.train.ckpt.fence import (FENCE_DIR, FLOOR_FILE, TERM_PREFIX, FencedOut, current_term, fence_dir,
                                       read_terms)
from pipelines.train.ckpt.protocol import CheckpointError, TierUnavailable
from pipelines.train.ckpt.s3_tier import answered
from pipelines.train.ckpt.tiers import l2_in_use, mirror_generations, mirror_lineage, put_l2_record, tier_locations


def _prefix(spec: JobSpec, rel_root: str) -> tuple[str, str]:
    """(bucket, key prefix) of the run's terms on L2."""
    bucket, prefix = split_uri(tier_locations(spec, rel_root)["L2"].rstrip("/"))
    return bucket, f"{prefix}/{FENCE_DIR}/"


def recorded_top(spec: JobSpec, rel_root: str) -> int:
    """The highest term L2 records for this run (0: none, or no L2); raises :class:`L2Unavailable` (also for an
    embedded endpoint started here once and down now: unknown, not none)."""
    if not l2_in_use(spec, rel_root):
        return 0
    s3, (bucket, prefix) = client(spec), _prefix(spec, rel_root)

    def listed() -> list[str]:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o["Key"][len(prefix):] for page in pages for o in page.get("Contents", [])]

    top = 0
    for name in answered(f"s3://{bucket}/{prefix}", listed) or []:
        if name.startswith(TERM_PREFIX) and name[len(TERM_PREFIX):].isdigit():
            top = max(top, int(name[len(TERM_PREFIX):]))
    return top


def floor(spec: JobSpec, fence_dir: Path, rel_root: str, log=print) -> int:
    """The term a new attempt must exceed besides L1's own: L2's highest, read when this L1 fence directory has
    neither a record of it (``l2-floor``) nor any term (a new L1; a directory of an older version, with terms, is
    above every term L2 can record, since L2 recorded none before it). Recorded before the term is taken, and
    returned from the record ever after (``take`` takes the highest of it and L1's terms, so an attempt that died
    between the two cannot lower it). Raises :class:`L2Unavailable` while L2 does not answer; with no L2
    configured (no endpoint yet, the demo before it starts one) it is 0 and nothing is recorded."""
    marker = fence_dir / FLOOR_FILE
    try:
        return int(json.loads(read_small_text(marker))["l2_top"])
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: read L2 (a higher floor is safe)
        pass
    if current_term(fence_dir) > 0 or not l2_in_use(spec, rel_root):
        return 0
    top = recorded_top(spec, rel_root)
    fence_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(marker, json.dumps({"l2_top": top, "at": time.time()}))
    if top:
        log(f"[fence] L1 holds no record of this run's terms: L2 records term {top}, so this attempt takes a newer one")
    return top


def record(spec: JobSpec, rel_root: str, term: int, attempt: str, launch: Optional[str]) -> None:
    """Put this attempt's term on L2 (before its first COMMIT there); raises :class:`L2Unavailable` (a down
    embedded endpoint too: returning would let a step reach L2 once it is back without its term recorded). The
    same bytes on every node (each node's leader puts it before its first COMMIT there, on the condition that it is
    absent: a node that loses that race finds its own bytes, not another writer's)."""
    body = json.dumps({"attempt": attempt, "launch": launch})
    put_l2_record(spec, rel_root, f"/{FENCE_DIR}/{TERM_PREFIX}{term:09d}", body)


def carry(spec: JobSpec, rel_root: str, step_term: Optional[int] = None, log=print) -> Optional[int]:
    """The promote stage's :meth:`~pipelines.train.ckpt.promoter.Promoter.record_term`, before it puts a step on
    L2: the run's term put on L2, then L1's lineage record and its key's generations record copied there. A training
    run whose L2 did not answer to its end put none of them, and a step the stage then put there would have no term
    on L2 above it: once L1 is lost, a new L1 would take that term again, read no lineage from L2, and take the key's
    older generation for its current one.

    The term: the highest one whose file on L1 is whole (one being written is a live start's, which has committed
    nothing; its attempt puts it with the same bytes as here), or ``step_term`` (the step's manifest's) when higher:
    its file was lost. The lineage record does not replace an L2 copy that names a newer term, nor the generations
    record one whose L1 record names another generation current (an L1 of another cluster, come back); a torn or
    refused record on L1 is a warning, and L2's copy stays. Returns the term put (None: none, or no L2). Raises
    :class:`L2Unavailable`, :class:`TierUnavailable` when L1 does not answer, and ``FencedOut`` (75) when another
    writer's copy of a record lands between this one's look and its put (the retry reads it)."""
    if not l2_in_use(spec, rel_root):
        return None
    try:
        terms = read_terms(fence_dir(spec, rel_root))
    except OSError as e:  # unknown is not "no term": the step waits for the next run of the stage
        raise l1_unreadable(f"L1: the terms of {rel_root} cannot be read", e) from None
    top = max((t for t, body in terms.items() if isinstance(body.get("attempt"), str)), default=None)
    body = terms[top] if top is not None else {}
    if step_term is not None and (top is None or step_term > top):
        top, body = step_term, {}
    if top is not None:
        record(spec, rel_root, top, str(body.get("attempt", "")), body.get("launch"))
    for what, mirror in (("lineage", lambda: mirror_lineage(spec, rel_root, over_newer=False)),
                         ("generations", lambda: mirror_generations(spec, rel_root))):
        try:
            mirror()
        except (TierUnavailable, FencedOut):  # later: the stage's retry
            raise
        except (CheckpointError, ValueError) as e:  # torn or refused: copying it would spread it
            log(f"[promote] warning: the {what} record of {rel_root} on L1 is not copied to L2: {e}")
        except OSError as e:  # L1 failing: the stage's retry reads it again
            raise l1_unreadable(f"L1: the {what} record of {rel_root} cannot be read", e) from None
    return top


def l1_unreadable(what: str, e: OSError) -> CheckpointError:
    """An L1 read that failed, as the one OSError rule says: storage failing is :class:`TierUnavailable` (75, the
    stage's retry reads it again); a refusal, or a link where a record belongs, is the user's to fix (2)."""
    line = f"{what}: {type(e).__name__}: {e}"
    if oserrors.storage_failing(e):
        return TierUnavailable(line)
    return CheckpointError(f"{line} — give this user access to it, or move what is in its place")
