"""Where a checkpoint lives on each tier and what moves it between them: the tier layout, retention, generations,
promote, and :func:`fetch` (one committed step read from its nearest verified tier, for evaluation and
registration; a training run restores through :mod:`pipelines.train.ckpt.restore`, the only restore path). The
checkpoint format: :mod:`pipelines.train.ckpt.protocol`.

Tiers: L0 node-local (``checkpoint.l0``) → L1 shared FS (``checkpoint.l1``) → L2 S3
(``s3://services.s3_bucket/checkpoint.l2_prefix/…``). ``promote`` copies L0 → L1 → L2 through the part protocol
(:mod:`pipelines.train.ckpt.parts`), checking every file at every tier, COMMIT last; a tier that already holds a
verified copy is skipped.
:func:`prune` applies the
per-tier retention and never deletes a tier's newest copy that verifies there.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

from pipelines import tracking
from pipelines.manifest import atomic_write_text, plain_rel, read_small_text
from pipelines.spec import JobSpec, resolve_path
from pipelines.storage import faults, oserrors
from pipelines.storage.s3 import (STATE_DIR, EmbeddedDown, S3ConfigError, client, embedded_configured, embedded_holds,
                                  endpoint_url, ensure_bucket, missing, outage, split_uri, unreachable)
from pipelines.train.ckpt import fence, history
from pipelines.train.ckpt.protocol import (COMMIT, TIERS, CheckpointError, L2Unavailable,
                                           TierUnavailable, is_valid_local, parse_step, read_local_manifest, step_name,
                                           verify_local)
from pipelines.train.ckpt.local import remove_local
from pipelines.train.ckpt.parts import merge_parts, part_of, stage_part, upload_step
from pipelines.train.ckpt.s3_markers import put as put_marker, remove_step, supported
from pipelines.train.ckpt.s3_tier import (answered, commit_at, download_checkpoint, multipart_uploads,
                                          object_etag, read_s3_manifest, unusable, verify_s3)


# ----------------------------------------------------------------------------- tier layout
def tier_locations(spec: JobSpec, rel: str) -> dict[str, str]:
    """Where checkpoint ``rel`` (e.g. ``<run>/<key>/step-000200``) lives at each tier."""
    return {
        "L0": str(resolve_path(spec.checkpoint.l0) / rel),
        "L1": str(resolve_path(spec.checkpoint.l1) / rel),
        "L2": f"s3://{spec.services.s3_bucket}/{spec.checkpoint.l2_prefix.strip('/')}/{rel}",
    }


def l2_available(spec: JobSpec) -> Optional[str]:
    """None when an S3 endpoint is configured or running, else the reason L2 cannot be used now."""
    try:
        endpoint_url(spec)
        return None
    except S3ConfigError as e:
        return str(e)


def list_steps(spec: JobSpec, rel_root: str, tiers: tuple[str, ...] = TIERS) -> dict[str, list[int]]:
    """Steps that have a COMMIT marker at each tier (not yet verified), oldest first; on L0/L1 a step entry that is
    a symlink is none of this run's (anyone who writes the tier may plant one: restored from, it would resume another
    run's weights; counted, retention would drop a real step for it). An L2 that does not answer (an endpoint down,
    or the embedded one started here once and down now) raises :class:`L2Unavailable`; only a setup without any L2
    lists none there."""
    out: dict[str, list[int]] = {}
    for tier in tiers:
        loc = tier_locations(spec, rel_root)[tier]
        if tier != "L2":
            root = Path(loc)
            names = [p.name for p in root.iterdir() if not p.is_symlink() and (p / COMMIT).is_file()] \
                if root.is_dir() else []
        elif l2_in_use(spec, rel_root):
            names = _s3_step_names(spec, loc)
        else:
            names = []
        out[tier] = sorted(s for s in map(parse_step, names) if s is not None)
    return out


def _s3_step_names(spec: JobSpec, uri: str, committed: bool = True) -> list[str]:
    """The names under ``uri`` of the steps with a COMMIT (``committed``), or of every step with an object."""
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    names = []
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
            for o in page.get("Contents", []):
                parts = o["Key"][len(prefix) + 1:].split("/")
                if len(parts) == 2 and parts[1] == COMMIT or not committed and len(parts) >= 2:
                    names.append(parts[0])
    except Exception as e:  # noqa: BLE001 - no bucket yet (nothing promoted), or the endpoint did not answer
        if missing(e):
            return []
        if unreachable(e):
            raise unusable(uri, e) from None
        raise
    return sorted(set(names))


def verify_copy(spec: JobSpec, tier: str, loc: str) -> None:
    """Raise CheckpointError unless the copy at ``loc`` verifies (L2: checksums held by S3; see check_objects)."""
    try:
        verify_s3(spec, loc) if tier == "L2" else verify_local(Path(loc))
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{loc}: {e}") from None


def fetch(spec: JobSpec, rel: str, cache: Optional[Path] = None, prefer: tuple[str, ...] = TIERS) -> tuple[str, Path]:
    """Restore from the nearest tier whose copy verifies; returns (tier, local dir). ``rel`` comes from a manifest:
    one that is not a plain relative path (absolute, ``..``) is refused (exit 2), never read outside the tiers.
    When no tier gives a verified copy and one of them did not answer (an object store down, a disk failing),
    :class:`TierUnavailable` (exit 75: a retry may read it); when every tier answered, :class:`CheckpointError`
    (exit 2: the copy is not there or does not verify)."""
    if not plain_rel(rel):
        raise CheckpointError(f"checkpoint {rel!r} is not a plain relative path below the tiers (a manifest that "
                              "names it was not written by this pipeline)")
    locs = tier_locations(spec, rel)
    errors, unknown = [], False
    for tier in prefer:
        loc = locs[tier]
        try:
            if tier == "L2":
                return tier, download_checkpoint(spec, loc, cache or resolve_path("var/tiers/cache") / rel)
            verify_local(Path(loc))
            return tier, Path(loc)
        except Exception as e:  # noqa: BLE001 - report every tier's reason
            errors.append(f"{tier} {loc}: {type(e).__name__}: {e}")
            unknown = unknown or isinstance(e, TierUnavailable) or oserrors.storage_failing(e) or outage(e)
    said = "\n  ".join(errors)
    if unknown:
        raise TierUnavailable(f"no tier gave a verified copy of the checkpoint and one did not answer; a retry may "
                              f"read it:\n  {said}")
    raise CheckpointError(f"no tier holds a verified copy of the checkpoint:\n  {said}")


# ----------------------------------------------------------------------------- retention
def l2_keeps(l2_every: int, step: int) -> bool:
    """Does L2 retention keep ``step`` for good (``checkpoint.l2_keep_every``: its multiples; 0 = every step)?"""
    return not l2_every or step % l2_every == 0


def retention_plan(by_tier: dict[str, list[int]], keep: dict[str, int], l2_every: int) -> dict[str, list[int]]:
    """Steps to delete per tier: L0/L1 keep their last ``keep[tier]`` steps; L2 keeps the last ``keep['L2']``
    plus every step that is a multiple of ``l2_every`` (0 = keeps every L2 step)."""
    out = {}
    for tier, steps in by_tier.items():
        steps = sorted(steps)
        kept = set(steps[-keep[tier]:]) if keep[tier] > 0 else set(steps)
        if tier == "L2":
            kept |= {s for s in steps if l2_keeps(l2_every, s)}
        out[tier] = [s for s in steps if s not in kept]
    return out


def newest_verified(spec: JobSpec, rel_root: str, by_tier: dict[str, list[int]]) -> Optional[int]:
    """The newest step with a copy that verifies at some tier (L2 checked through S3's checksums)."""
    for s in sorted({s for v in by_tier.values() for s in v}, reverse=True):
        locs = tier_locations(spec, f"{rel_root}/{step_name(s)}")
        for tier in TIERS:
            if s in by_tier.get(tier, []):
                try:
                    verify_copy(spec, tier, locs[tier])
                    return s
                except TierUnavailable:  # unknown, not "does not verify": no older step is taken for the newest
                    raise
                except CheckpointError:
                    continue
    return None


def accepted_steps(spec: JobSpec, rel_root: str, by_tier: dict[str, list[int]],
                   rec: Optional[dict], strict: bool = False) -> dict[str, list[int]]:
    """``by_tier`` less the steps another line of training wrote, or an older term landed above a takeover's cutoff
    (:mod:`pipelines.train.ckpt.history`); every step counts when there is no lineage record. A step whose manifest
    did not answer (L2 down, L1's EIO …) is left out (retention then neither removes nor counts it), or with
    ``strict`` raises (for a caller that must put every step somewhere: unknown is not "not this line's")."""
    if rec is None:
        return by_tier
    out = {}
    for tier, steps in by_tier.items():
        keep = []
        for st in steps:
            loc = tier_locations(spec, f"{rel_root}/{step_name(st)}")[tier]
            try:
                man = read_s3_manifest(spec, loc) if tier == "L2" else read_local_manifest(Path(loc))
            except (CheckpointError, OSError, json.JSONDecodeError) as e:
                # (an OSError without errno too: not an answer about the copy, so not "another line's step")
                if strict and (isinstance(e, TierUnavailable) or isinstance(e, OSError) and e.errno not in oserrors.ANSWERS):
                    raise
                man = None
            if man is not None and history.accepts(rec, st, history.of(man), history.term_of(man)):
                keep.append(st)
        out[tier] = keep
    return out


def prune(spec: JobSpec, rel_root: str, upto: Optional[int] = None, tiers: tuple[str, ...] = TIERS,
          protect: set[int] = frozenset(), rec: Optional[dict] = None,
          log: Callable[[str], None] = print, hold_l1: set[int] = frozenset()) -> dict[str, list[int]]:
    """Apply ``checkpoint.keep_l0/keep_l1/keep_l2`` and ``l2_keep_every`` to this run's checkpoints. Only steps
    ≤ ``upto`` are touched (newer ones may still be waiting for promotion), neither ``protect`` (nor ``hold_l1`` on
    L1: steps L2 still needs) nor a tier's newest step whose copy there verifies is ever deleted; only the steps of
    this line of training (``rec``) count. With L2 not answering, the other tiers are pruned all the same. Returns
    the steps deleted per tier."""
    c = spec.checkpoint
    try:
        by_tier = list_steps(spec, rel_root, tiers)
    except L2Unavailable as e:
        log(f"[ckpt] retention: L2 skipped ({e})")
        tiers = tuple(t for t in tiers if t != "L2")
        by_tier = list_steps(spec, rel_root, tiers)
    by_tier = accepted_steps(spec, rel_root, by_tier, rec)
    plan = retention_plan(by_tier, {"L0": c.keep_l0, "L1": c.keep_l1, "L2": c.keep_l2}, c.l2_keep_every)
    plan = {t: [s for s in v if (upto is None or s <= upto) and s not in protect and not (t == "L1" and s in hold_l1)]
            for t, v in plan.items()}
    if not any(plan.values()):
        return plan
    # each tier keeps its own newest copy that verifies: a good copy of that step on another tier (a node's L0,
    # gone with the node) is no reason to delete the last good copy here
    guards = {t: newest_verified(spec, rel_root, {t: by_tier[t]}) for t, v in plan.items() if v}
    plan = {t: [s for s in v if s != guards.get(t)] for t, v in plan.items()}
    _remove_steps(spec, rel_root, plan)
    return plan


def _remove_steps(spec: JobSpec, rel_root: str, steps_by_tier: dict[str, list[int]]) -> None:
    for tier, steps in steps_by_tier.items():
        for s in steps:
            loc = tier_locations(spec, f"{rel_root}/{step_name(s)}")[tier]
            faults.point("retention")
            remove_step(spec, loc) if tier == "L2" else remove_local(Path(loc))


def drop_stale_staging(spec: JobSpec, rel_root: str, rec: Optional[dict] = None,
                       keep: frozenset = frozenset()) -> list[int]:
    """Rank 0: L1 staging, L2 marks and merge temp dirs of steps older than the newest globally committed one of
    this line of training (not those of ``keep``: steps still waiting for L2), left by attempts that are gone
    (:func:`pipelines.train.ckpt.fence.removable`: a live attempt's, e.g. a concurrent launch's, stay)."""
    root = Path(tier_locations(spec, rel_root)["L1"])
    newest = max(accepted_steps(spec, rel_root, list_steps(spec, rel_root, ("L1",)), rec)["L1"], default=None)
    dropped = []
    left = [*root.glob(".step-*.parts"), *root.glob(".step-*.l2"), *root.glob(".step-*.tmp-*")]
    leases = fence.read_leases(fence.fence_dir(spec, rel_root)) if left and newest is not None else {}
    for d in left if newest is not None else []:
        step = parse_step(d.name[1:].rsplit(".", 1)[0])
        if step is not None and step < newest and step not in keep and \
                fence.removable(d, leases, spec.checkpoint.lease_s):
            fence.check(f"removing {d.name}", d)
            shutil.rmtree(d, ignore_errors=True)
            dropped.append(step)
    return dropped


def clear_run(spec: JobSpec, rel_root: str) -> dict[str, list[int]]:
    """Remove the committed steps of this run from every tier (a run that starts over, ``train.resume=never``,
    must not leave older steps of the same key to be mixed with its own by retention or a later resume), except
    a step that a registered model version points to."""
    keep = registered_steps(spec, rel_root)
    by_tier = {t: [s for s in v if s not in keep] for t, v in list_steps(spec, rel_root).items()}
    _remove_steps(spec, rel_root, by_tier)
    return by_tier


def registered_steps(spec: JobSpec, rel_root: str) -> set[int]:
    """Steps of this run that a registered model version points to (its ``checkpoint_uri`` tag), under any name: a
    version registered under another name (a spec whose ``registry.model_name`` changed, a version copied to another
    model) shares the steps of the same training. Raises CheckpointError when the registry cannot be read: then
    nothing may be deleted."""
    prefix = tier_locations(spec, rel_root)["L2"] + "/"
    # the registry's own search narrows it to this run's steps (LIKE's '_' may match more: the prefix test below
    # keeps only this run's); a prefix with a quote, a backslash or '[' (a class in some SQL dialects) cannot be put
    # in a filter as it is: every version is read
    narrowed = None if any(c in prefix for c in "'\\[") else f"tags.checkpoint_uri LIKE '{prefix}%'"
    try:
        versions = list(tracking.model_versions(tracking.client(spec), narrowed))
    except Exception as e:  # noqa: BLE001 - unknown = everything may be needed
        raise CheckpointError(f"cannot read the model registry ({type(e).__name__}: {e}); deleting no checkpoint")
    steps = set()
    for v in versions:
        uri = (v.tags or {}).get("checkpoint_uri", "")
        if uri.startswith(prefix) and parse_step(uri[len(prefix):].strip("/")) is not None:
            steps.add(parse_step(uri[len(prefix):].strip("/")))
    return steps


# ----------------------------------------------------------------------------- generations
# ``run.force`` starts a run's training over *beside* the steps it replaces: a new generation, its own rel root
# ``<run>/<key>.gen-<utc>``. The old generation stays on every tier until the new one's train stage commits; then
# it is retired, except the steps a registered model version points to. A retried forced run adopts the pending
# generation (and resumes it) instead of starting yet another. The record lives on L1, beside the key: the current
# generation, the pending one, and those being retired (``retiring``). Retirement is the train stage's
# housekeeping, run under the key's lock each time the stage runs or finds its output done
# (:func:`retire_generations`): a retirement that storage or the registry cut short is taken up again then, and
# never fails a stage.
def _generations_file(spec: JobSpec, base_rel: str) -> Path:
    return Path(tier_locations(spec, base_rel)["L1"] + ".generations.json")


def _is_generation(base_rel: str, name) -> bool:
    return name == base_rel or isinstance(name, str) and \
        re.fullmatch(re.escape(base_rel) + r"\.gen-\d{8}T\d{6,12}", name) is not None


def read_generations(spec: JobSpec, base_rel: str) -> dict:
    """The key's record: {"current", "pending", "retiring"}. Every name in it must be a generation of this key
    (``base_rel`` or ``base_rel.gen-<utc>``) and ``retiring`` a list: a record that says anything else is refused
    with one line (:class:`CheckpointError`), so no deletion follows a forged or torn record out of the key's
    directories; a name being retired that is also current or pending is not retired."""
    text = _generations_text(spec, base_rel)
    return _parse_generations(text or "{}", str(_generations_file(spec, base_rel)), base_rel)


def _generations_text(spec: JobSpec, base_rel: str, on_l1: Optional[bool] = None) -> Optional[str]:
    """The key's record as it stands: L1's; where L1 has none, L2's copy on an L1 that holds nothing of the key
    (replaced, lost, or its first run: ``on_l1``, :func:`key_on_l1` asked now unless given), else None (no record:
    an L1 with the key's steps and no record has none). :class:`TierUnavailable` when L1 does not answer,
    :class:`L2Unavailable` when L2 does not."""
    path = _generations_file(spec, base_rel)
    try:
        return path.read_text()
    except FileNotFoundError:
        on_l1 = key_on_l1(spec, base_rel) if on_l1 is None else on_l1
        return None if on_l1 else l2_record(spec, base_rel, GENERATIONS_SUFFIX)
    except OSError as e:  # L1 did not answer (EIO, ESTALE): later
        raise TierUnavailable(f"checkpoint.l1: {path}: the record of this key's generations cannot be read "
                              f"({e})") from None


def generation_key(rel_root: str) -> str:
    """The key whose generation ``rel_root`` is (``<key>.gen-<utc>`` → ``<key>``; a key is its own first)."""
    m = re.fullmatch(r"(.+)\.gen-\d{8}T\d{6,12}", rel_root)
    return m.group(1) if m else rel_root


def key_on_l1(spec: JobSpec, rel_root: str) -> bool:
    """Whether L1 holds anything of ``rel_root``'s key (its directory or its generations record): where it holds
    nothing, the key's record is read from L2 (:func:`read_generations`, :func:`retired`)."""
    base_rel = generation_key(rel_root)
    return Path(tier_locations(spec, base_rel)["L1"]).exists() or _generations_file(spec, base_rel).exists()


def retired(spec: JobSpec, rel_root: str, on_l1: bool) -> Optional[str]:
    """Why no attempt may train in ``rel_root`` any more, or None: it is a generation (``<key>.gen-<utc>``, or the
    key itself) whose key's record names another generation current and not it pending — being retired or retired
    already (a generation once replaced is never current again). Where the key has no record (its first run, a
    ``--ckpt-root`` made by hand) nothing is retired. The record is read as the launcher read it
    (:func:`read_generations`): L1's, else L2's copy where L1 held nothing of the key (``on_l1``: :func:`key_on_l1`,
    asked before this attempt made its directories). Raises :class:`TierUnavailable` / :class:`L2Unavailable` when the
    record's tier does not answer, :class:`CheckpointError` for a record that is not one."""
    base_rel = generation_key(rel_root)
    text = _generations_text(spec, base_rel, on_l1)
    if text is None:
        return None
    state = _parse_generations(text, str(_generations_file(spec, base_rel)), base_rel)
    if rel_root in (state["current"], state["pending"]):
        return None
    return (f"{rel_root} is a retired generation of {base_rel} (current: {state['current']}): an attempt left from "
            "before it was replaced stops before writing there")


def _parse_generations(text: str, where: str, base_rel: str) -> dict:
    """A generations record's text (read at ``where``) checked as :func:`read_generations` says
    (:class:`CheckpointError` else)."""
    path = where
    try:
        state = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{path}: the record of this key's generations is not JSON ({e}) — fix or remove "
                              "the record") from None
    if not isinstance(state, dict) or not isinstance(state.get("retiring", []), list):
        raise CheckpointError(f"{path}: not a record of generations (an object with a list 'retiring') — fix or "
                              "remove the record")
    out = {"current": state.get("current", base_rel), "pending": state.get("pending"),
           "retiring": state.get("retiring", [])}
    bad = [n for n in [out["current"], *out["retiring"]] + ([out["pending"]] if out["pending"] is not None else [])
           if not _is_generation(base_rel, n)]
    if bad:
        raise CheckpointError(f"{path}: names {bad[0]!r}, not a generation of {base_rel} — fix or remove the record")
    out["retiring"] = [n for n in dict.fromkeys(out["retiring"]) if n not in (out["current"], out["pending"])]
    return out


def _write_generations(spec: JobSpec, base_rel: str, state: dict, log: Callable[[str], None] = print) -> None:
    text = json.dumps(state, indent=2)
    path = _generations_file(spec, base_rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    try:  # its copy on L2: where an outage leaves it behind, the next write of the record puts it
        put_l2_record(spec, base_rel, GENERATIONS_SUFFIX, text)
    except (L2Unavailable, fence.FencedOut) as e:  # (FencedOut: another writer's copy landed between our look and put)
        log(f"[ckpt] the generations record of {base_rel} is on L1 only for now (L2: {e})")


# The run's records where they survive losing L1 (a retry on a new cluster, a new FSx): the lineage record
# (``history``) and the key's generations record are mirrored on L2 beside the run's prefix, as on L1
# (``<prefix>/<rel>.lineage.json``, ``<prefix>/<base_rel>.generations.json``), after L1 (a lineage record that L2 did
# not take then goes there before the line's first step: the promoter's ``record_term``). Read from L2 only
# when L1 has none: without them a retry whose L1 was lost took itself for a new line of training (``resume=never``
# then cleared its own L2 steps; ``run.force`` started another generation and orphaned the one in progress). An L2
# that does not answer then is :class:`L2Unavailable` (75): unknown, not "no record".
LINEAGE_SUFFIX, GENERATIONS_SUFFIX = ".lineage.json", ".generations.json"


def _l2_record_at(spec: JobSpec, rel: str, suffix: str) -> tuple[str, str]:
    bucket, key = split_uri(tier_locations(spec, rel)["L2"].rstrip("/"))
    return bucket, key + suffix


_READ_AT_PUT = object()  # put_l2_record's ``seen`` when its caller decided nothing on what it read


def put_l2_record(spec: JobSpec, rel: str, suffix: str, text: str, seen: object = _READ_AT_PUT) -> None:
    """Put a small record at ``<L2 of rel><suffix>`` (a copy of an L1 record, an attempt's term: ``fence_l2``;
    nothing without an L2); raises :class:`L2Unavailable` when L2 does not answer. As a step's markers are
    (:func:`pipelines.train.ckpt.s3_markers.put`): on the condition read before the fence check, so a writer paused
    between its check and its put cannot land over a newer term's copy (FencedOut), where the endpoint honours it.
    A caller that read the copy to decide whether to replace it (:func:`l2_record_read`) passes the ETag it read
    as ``seen`` (None: there was none): a copy put after that read is never replaced (FencedOut)."""
    if not l2_in_use(spec, rel):
        return
    s3, (bucket, key) = client(spec), _l2_record_at(spec, rel, suffix)
    where = f"s3://{bucket}/{key}"

    def put() -> dict:
        ensure_bucket(s3, bucket, spec.services.s3_region)
        expected = object_etag(s3, bucket, key) if seen is _READ_AT_PUT else seen
        fence.check(f"putting {where}", tier_locations(spec, rel)["L2"])
        return put_marker(s3, bucket, key, text.encode(), expected, supported(s3, bucket), f"putting {where}")

    answered(where, put)


def l2_record(spec: JobSpec, rel: str, suffix: str) -> Optional[str]:
    """The record at ``<L2 of rel><suffix>``; None when there is none (or no L2); :class:`L2Unavailable` when L2
    does not answer, :class:`CheckpointError` for an object larger than a record may be."""
    return l2_record_read(spec, rel, suffix)[0]


def l2_record_read(spec: JobSpec, rel: str, suffix: str) -> tuple[Optional[str], Optional[str]]:
    """The record at ``<L2 of rel><suffix>`` and its ETag, from one GET: (None, None) when there is none (or no
    L2). :class:`L2Unavailable` when L2 does not answer; an object over :data:`history.RECORD_LIMIT` bytes is not
    read (:class:`CheckpointError`: one line, the key to look at)."""
    if not l2_in_use(spec, rel):
        return None, None
    s3, (bucket, key) = client(spec), _l2_record_at(spec, rel, suffix)
    where = f"s3://{bucket}/{key}"

    def get() -> tuple[str, Optional[str]]:
        got = s3.get_object(Bucket=bucket, Key=key)
        size = got.get("ContentLength") or 0
        if size > history.RECORD_LIMIT:
            got["Body"].close()
            raise CheckpointError(f"{where}: {size} bytes, more than the {history.RECORD_LIMIT} a record may have "
                                  "— not read; look at what wrote it")
        return got["Body"].read(history.RECORD_LIMIT + 1).decode(errors="replace"), got.get("ETag")

    return answered(where, get) or (None, None)


def l1_newer_than_l2(spec: JobSpec, rel_root: str) -> bool:
    """Whether this run's L1 is new while L2 holds its history: the record of L2's terms that a new L1 fence
    directory wrote when it first read them (``fence_l2.floor``, before this attempt's term) names one. An
    unreadable record: True (L2 is read then; a needless read is safe, a skipped one is not)."""
    try:
        return int(json.loads(read_small_text(fence.fence_dir(spec, rel_root) / fence.FLOOR_FILE))["l2_top"]) > 0
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError):
        return True


def read_lineage(spec: JobSpec, rel_root: str) -> Optional[dict]:
    """This run's lineage record (:mod:`~pipelines.train.ckpt.history`): L1's; when L1 has none and is newer than
    the run's steps on L2 (:func:`l1_newer_than_l2`), L2's copy; else None."""
    rec = history.read(spec, rel_root)
    if rec is not None or not l1_newer_than_l2(spec, rel_root):
        return rec
    text = l2_record(spec, rel_root, LINEAGE_SUFFIX)
    return None if text is None else history.parse(text, f"{tier_locations(spec, rel_root)['L2']}{LINEAGE_SUFFIX}")


def write_lineage(spec: JobSpec, rel_root: str, rec: dict, log: Callable[[str], None] = print) -> None:
    """The lineage record on L1 under the fence (:func:`history.write`), then its copy on L2; an L2 that does not
    answer now leaves the copy to the promoter, which puts it before the line's first COMMIT there
    (:func:`mirror_lineage`): a run starts while L2 is down, as before."""
    history.write(spec, rel_root, rec)
    try:
        mirror_lineage(spec, rel_root)
    except L2Unavailable as e:
        log(f"[ckpt] the lineage record is on L1 only for now (L2: {e}); it goes to L2 with the first step there")


def mirror_lineage(spec: JobSpec, rel_root: str, over_newer: bool = True) -> bool:
    """L1's lineage record copied on L2 (none on L1: nothing to copy). A writer that holds no term (the ``promote``
    stage) passes ``over_newer=False``: an L2 copy whose cutoffs name a newer term than L1's record stays (an L1
    replaced since, then come back, is not the newer one). Returns whether it was put; :class:`L2Unavailable` when L2
    does not answer, ValueError for a torn record on L1."""
    rec = history.read(spec, rel_root)
    if rec is None:
        return False
    seen = _READ_AT_PUT
    if not over_newer:  # decided on the copy read, and put only while it is still that copy
        text, seen = l2_record_read(spec, rel_root, LINEAGE_SUFFIX)
        try:
            on_l2 = None if text is None else history.parse(text, LINEAGE_SUFFIX)
        except ValueError:  # a torn copy on L2: L1's replaces it
            on_l2 = None
        if on_l2 is not None and history.top_term(on_l2) > history.top_term(rec):
            return False
    put_l2_record(spec, rel_root, LINEAGE_SUFFIX, json.dumps(rec, indent=2), seen)
    return True


def mirror_generations(spec: JobSpec, rel_root: str) -> bool:
    """The generations record of ``rel_root``'s key (the key itself, or the key of a generation ``<key>.gen-<utc>``)
    copied from L1 to L2 as L1 holds it, when it names ``rel_root`` the key's current generation (the ``promote``
    stage's: the run it promotes committed it; a record that names another, an L1 of another cluster come back,
    is not copied), and only over an L2 copy that it supersedes (:func:`_supersedes`), put while that copy is still
    the one read. Returns whether it was put; :class:`CheckpointError` for a record refused by
    :func:`read_generations` or an L2 copy that names a newer generation, :class:`TierUnavailable` /
    :class:`L2Unavailable` when L1 / L2 does not answer."""
    base_rel = generation_key(rel_root)
    path = _generations_file(spec, base_rel)
    if not path.is_file():
        return False
    state = read_generations(spec, base_rel)
    if state["current"] != rel_root:
        return False
    try:
        text = path.read_text()
    except OSError as e:
        raise TierUnavailable(f"checkpoint.l1: {path}: {e}") from None
    on_l2, seen = l2_record_read(spec, base_rel, GENERATIONS_SUFFIX)
    if on_l2 is not None and not _supersedes(state, on_l2, base_rel):
        raise CheckpointError(f"L2's copy names a newer generation of {base_rel} current than this L1's "
                              f"{rel_root}: it stays (an L1 of another cluster, come back?)")
    put_l2_record(spec, base_rel, GENERATIONS_SUFFIX, text, seen)
    return True


def _supersedes(state: dict, l2_text: str, base_rel: str) -> bool:
    """Whether L1's generations record ``state`` may replace L2's copy: that copy is torn or refused, names the same
    current generation, one L1's record retires, or one created before it (its ``gen-<utc>`` stamp; the key itself
    is the first). A generation once replaced is never current again, so an older current on L2 is an outdated copy
    and a newer one is another cluster's later run."""
    try:
        current = _parse_generations(l2_text, GENERATIONS_SUFFIX, base_rel)["current"]
    except CheckpointError:
        return True
    return current == state["current"] or current in state["retiring"] or \
        _created(current, base_rel) < _created(state["current"], base_rel)


def _created(generation: str, base_rel: str) -> str:
    """A generation's stamp, comparable as text (its sub-second digits padded); "" for the key itself."""
    return "" if generation == base_rel else generation.rsplit(".gen-", 1)[1].ljust(8 + 1 + 12, "0")


def generation(spec: JobSpec, base_rel: str, force: bool) -> str:
    """The rel root this run trains in: the current generation, or with ``force`` a pending new one."""
    state = read_generations(spec, base_rel)
    if not force:
        return state["current"]
    if state["pending"] is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        state["pending"] = f"{base_rel}.gen-{stamp}"
        _write_generations(spec, base_rel, state)
    return state["pending"]


def commit_generation(spec: JobSpec, base_rel: str, rel_root: str, log: Callable[[str], None] = print) -> None:
    """``rel_root``'s run committed: make it current; the generation it replaced (and a pending one it did not
    adopt) are to be retired (:func:`retire_generations`)."""
    state = read_generations(spec, base_rel)
    if rel_root == state["current"] and state["pending"] is None:
        return
    gone = [g for g in (state["current"], state["pending"]) if g is not None and g != rel_root]
    retiring = [g for g in dict.fromkeys(state["retiring"] + gone) if g != rel_root]
    _write_generations(spec, base_rel, {"current": rel_root, "pending": None, "retiring": retiring})
    log(f"[ckpt] generation {rel_root} committed" + (f"; retiring {', '.join(gone)}" if gone else ""))


RETIRE_BUDGET_S = 600.0  # one run of the train stage's housekeeping; past it, what is left waits for the next run
# the registry read while retiring: 30 s a request, 2 retries (MLflow's own defaults allow minutes per request)
REGISTRY_BOUNDS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}


def retire_generations(spec: JobSpec, base_rel: str, log: Callable[[str], None] = print,
                       budget_s: float = RETIRE_BUDGET_S) -> dict:
    """Remove every step of the generations being retired from every tier, committed or not (a removal cut short
    leaves steps without COMMIT), but those a registered model version points to, the retired generation's
    staging and temp entries on L0 and L1, and the multipart uploads left in progress under its L2 prefix; then,
    when no step was kept, its records on L2 and L1 and its emptied directories.
    Housekeeping: whatever stops it (an unreadable record, a registry or tier that does not answer, ``budget_s``
    spent) is one line, and the generation stays in the record for the next run of the stage; L0 and L1 are cleared
    even while L2 is unknown. Returns {retired rel root: {tier: steps removed, "uploads_aborted": n}}."""
    done, deadline = {}, time.monotonic() + budget_s
    try:
        retiring = read_generations(spec, base_rel)["retiring"]
    except CheckpointError as e:
        log(f"[ckpt] no generation retired: {e}")
        return done
    for old in retiring:
        try:
            gone = _retire(spec, old, lambda what: _within(deadline, budget_s, what))
            state = read_generations(spec, base_rel)
            _write_generations(spec, base_rel, {**state, "retiring": [r for r in state["retiring"] if r != old]})
        except Exception as e:  # noqa: BLE001 - housekeeping: the generation waits for the next run
            log(f"[ckpt] generation {old} not retired yet ({type(e).__name__}: {e}); the next run of this train "
                "stage retires it")
            if isinstance(e, TimeoutError):  # the budget is spent: the others wait too, without a line each
                break
            continue
        done[old] = gone
        log(f"[ckpt] retired generation {old}: removed {gone}")
    return done


def _within(deadline: float, budget_s: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"housekeeping past its budget of {budget_s / 60:g} min before {what}")


def _retire(spec: JobSpec, old: str, check: Callable[[str], None]) -> dict:
    """One retired generation off every tier (``check(what)`` before each part: raises when the budget is spent)."""
    # first, whatever answers next (deletes nothing): an attempt of it still running stops before its next commit
    if not Path(tier_locations(spec, old)["L1"]).is_symlink():  # (a linked generation is left as it is)
        fence.supersede(fence.fence_dir(spec, old), "retirement")
    check("reading the registry")
    with _bounded_registry():
        keep = registered_steps(spec, old)
    check("L0 and L1")
    gone = _retire_local(spec, old, keep, check)
    check("L2")
    gone["L2"] = []
    if l2_in_use(spec, old):  # every step with an object there, committed or not
        names = _s3_step_names(spec, tier_locations(spec, old)["L2"], committed=False)
        gone["L2"] = sorted(s for s in map(parse_step, names) if s is not None and s not in keep)
        for s in gone["L2"]:
            check(f"L2 step {s}")
            _remove_steps(spec, old, {"L2": [s]})
        check("the L2 uploads in progress")
        gone["uploads_aborted"] = _abort_l2_uploads(spec, old, keep, check)
    if keep:
        gone["kept_registered"] = sorted(keep)
    else:
        check("the records")
        gone["records"] = _retire_records(spec, old)
    return gone


def _retire_records(spec: JobSpec, old: str) -> int:
    """A retired generation that keeps no step: its records, L2's first (the lineage copy, the terms), then L1's
    (the lineage record and its per-term files, the fence's terms and leases: an attempt of it still running is
    fenced out, its directory is never made again), then its emptied directories on L0 and L1. A link in a record's
    place goes, never what it points to. Returns how many entries were removed (on L2: asked to be; a DELETE of
    an absent key answers the same)."""
    n = 0
    if l2_in_use(spec, old):
        s3 = client(spec)
        bucket, prefix = split_uri(tier_locations(spec, old)["L2"].rstrip("/"))
        listed = answered(f"s3://{bucket}/{prefix}/{fence.FENCE_DIR}/", lambda: [
            o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=f"{prefix}/{fence.FENCE_DIR}/") for o in page.get("Contents", [])]) or []
        for key in [prefix + LINEAGE_SUFFIX, *listed]:
            answered(f"s3://{bucket}/{key}", lambda key=key: s3.delete_object(Bucket=bucket, Key=key))
            n += 1
    for p in (history.record_path(spec, old), history.terms_dir(spec, old), fence.fence_dir(spec, old)):
        if p.parent.is_symlink():  # the generation's directory is a link (_retire_local leaves it too)
            continue
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
        else:
            continue
        n += 1
    for tier in ("L0", "L1"):
        with contextlib.suppress(OSError):  # not empty (another key below it), or gone: it stays as it is
            Path(tier_locations(spec, old)[tier]).rmdir()
    return n


@contextlib.contextmanager
def _bounded_registry():
    """MLflow's HTTP client bounded (:data:`REGISTRY_BOUNDS`) for a block, unless the user set those bounds."""
    set_here = {k: v for k, v in REGISTRY_BOUNDS.items() if k not in os.environ}
    os.environ.update(set_here)
    try:
        yield
    finally:
        for k in set_here:
            os.environ.pop(k, None)


def _abort_l2_uploads(spec: JobSpec, rel_root: str, keep: set[int], check: Callable[[str], None]) -> int:
    """Abort the multipart uploads in progress under a retired generation's L2 prefix (a promotion cut short there
    leaves one; no object listing shows it, and its parts are stored, and billed, until aborted), but those into a
    kept step. Returns how many."""
    bucket, prefix = split_uri(tier_locations(spec, rel_root)["L2"].rstrip("/"))
    kept = tuple(f"{prefix}/{step_name(s)}/" for s in keep)
    s3, n = client(spec), 0
    for up in multipart_uploads(s3, bucket, f"{prefix}/"):
        if not up["Key"].startswith(kept):
            check(f"aborting the upload to {up['Key']}")
            s3.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
            n += 1
    return n


def _retire_local(spec: JobSpec, rel_root: str, keep: set[int], check: Callable[[str], None]) -> dict[str, list[int]]:
    """L0 and L1 of a retired generation: every step directory but ``keep``'s, committed or not, then its staging
    and temp entries (``.step-N.parts``, ``.step-N.l2``, ``.step-N.tmp-…``); a tier whose directory of the
    generation is a link is left as it is. Returns {tier: steps removed}."""
    gone = {}
    for tier in ("L0", "L1"):
        root = Path(tier_locations(spec, rel_root)[tier])
        if root.is_symlink():  # not a directory this run made: what it leads to is not ours to delete
            gone[tier] = []
            continue
        names = [p.name for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
        gone[tier] = sorted(s for s in map(parse_step, names) if s is not None and s not in keep)
        for s in gone[tier]:
            check(f"{tier} step {s}")
            _remove_steps(spec, rel_root, {tier: [s]})
        for entry in root.glob(".step-*") if root.is_dir() else []:
            shutil.rmtree(entry, ignore_errors=True)
    return gone


def l2_in_use(spec: JobSpec, rel_root: str) -> bool:
    """Whether this setup has an L2 (an endpoint set, an embedded one started here once, or an embedded one's store
    holding objects of this run: stopped by a DAG's teardown). Raises :class:`L2Unavailable` when it has one that does
    not answer: unknown, not none."""
    try:
        endpoint_url(spec)
    except EmbeddedDown as e:
        where = tier_locations(spec, rel_root)["L2"]
        if embedded_configured():
            raise L2Unavailable(f"{where}: {e}") from None
        if embedded_holds(where):  # its steps are on this disk, only not served: not "no L2"
            raise L2Unavailable(f"{where}: the embedded endpoint is stopped and its store ({STATE_DIR}/store) holds "
                                "this run's objects: start it, `python -m pipelines.storage.s3 start`") from None
        return False
    return True


# ----------------------------------------------------------------------------- promote
def promote_l1(spec: JobSpec, rel: str) -> tuple[str, Optional[dict]]:
    """Step ``rel`` L0 → L1 as training promotes it (:mod:`pipelines.train.ckpt.parts`, a step of one part): staged
    on L1 (verified while copied, COMMIT last), then merged into the step's global commit. Returns (action, the
    files' part digests for the S3 upload that follows, None when nothing was copied). A verified L1 copy is kept
    (training's close committed the final step there; an L0 copy of another attempt left on this host is older).
    A step cut into parts is committed on L1 by its training run (each node stages its own part), so from one L0
    only a one-part step can be promoted here."""
    locs = tier_locations(spec, rel)
    l0, l1 = Path(locs["L0"]), Path(locs["L1"])
    if is_valid_local(l1):
        return "already-verified", None
    if not (l0 / COMMIT).is_file():
        raise CheckpointError(f"L0 copy {l0} is gone and L1 holds no verified copy: nothing to promote")
    k, parts, attempt = part_of(read_local_manifest(l0))
    if parts != 1:
        raise CheckpointError(f"{l1} holds no verified copy and {l0} is only part {k} of {parts}: a step cut into parts "
                              "is committed on L1 by its training run (every node stages its own part)")
    action, digests = stage_part(l0, l1, spec.checkpoint.multipart_chunk_mb << 20, again=True)  # refuses a corrupt L0
    if not merge_parts(l1, 1, attempt, again=True):
        raise CheckpointError(f"{l1}: the part staged from {l0} is gone before its merge")
    return action, digests


def promote_held(spec: JobSpec, rel_root: str, final: int, log: Callable[[str], None] = print) -> dict:
    """The steps before ``final`` of this line of training that L1 holds and L2 would keep but lacks (training's L2
    lagged: ``checkpoint.l1_hold_for_l2`` kept them on L1 for it) put on L2 from L1, verified, COMMIT last, oldest
    first. Returns ``{"done": [steps], "failed": {step: why}}``: a step whose L1 copy answered but does not verify is
    a warning (its copy was lost; the final step is the stage's). L1 that cannot be listed or L2 that does not
    answer raise :class:`TierUnavailable` (exit 75): unknown, never "nothing held"."""
    try:
        rec = read_lineage(spec, rel_root)
        by_tier = accepted_steps(spec, rel_root, list_steps(spec, rel_root, ("L1", "L2")), rec, strict=True)
    except (OSError, ValueError) as e:  # L1 failing, a torn lineage record
        raise TierUnavailable(f"L1: the steps held for L2 under {rel_root} cannot be read: {type(e).__name__}: {e}") \
            from None
    out: dict = {"done": [], "failed": {}}
    for s in by_tier["L1"]:
        if s >= final or not l2_keeps(spec.checkpoint.l2_keep_every, s) or s in by_tier["L2"]:
            continue
        locs = tier_locations(spec, f"{rel_root}/{step_name(s)}")
        try:
            upload_step(spec, Path(locs["L1"]), locs["L2"])
        except (CheckpointError, OSError) as e:  # only a copy that answered bad is this step's alone
            if isinstance(e, TierUnavailable) or unreachable(e):
                raise
            if oserrors.unanswered(e):
                raise TierUnavailable(f"L1 step {s}: {type(e).__name__}: {e}") from None  # L1 failing: unknown
            out["failed"][s] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log(f"[promote] warning: step {s}, held on L1 for L2, did not reach it: {out['failed'][s]}")
            continue
        out["done"].append(s)
    return out


def promote(spec: JobSpec, rel: str, tiers: tuple[str, ...] = ("L1", "L2"),
            before_l2: Optional[Callable[[dict], None]] = None) -> dict:
    """Step ``rel`` L0 → L1 (→ L2) through the part protocol, each copy verified, COMMIT last; a verified copy is
    kept; ``before_l2`` is called with the L1 copy's manifest before the L2 upload. Returns what was done at each
    tier and each tier's COMMIT."""
    locs = tier_locations(spec, rel)
    action, digests = promote_l1(spec, rel)
    report = {"checkpoint": rel, "tiers": locs, "actions": {"L1": action}}
    report["commit"] = (Path(locs["L1"]) / COMMIT).read_text().strip()
    if "L2" in tiers:
        if before_l2 is not None:
            before_l2(read_local_manifest(Path(locs["L1"])))
        report["actions"]["L2"] = upload_step(spec, Path(locs["L1"]), locs["L2"], digests)
        report["l2_commit"] = commit_at(spec, locs["L2"])
        if report["l2_commit"] is None:  # put and verified, then gone: never a promotion that records no COMMIT
            raise L2Unavailable(f"{locs['L2']}: its COMMIT is gone right after the upload verified it (removed "
                                "meanwhile); a retry looks again")
    return report
