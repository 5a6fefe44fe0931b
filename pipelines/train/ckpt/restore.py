"""Collective restore across nodes whose L0 disks are private.

Every rank calls :func:`restore` at the same point. The step is chosen once, by global rank 0, from what the nodes
report and what L1 holds: the newest step that is globally committed on L1 or whose parts are all committed on the
nodes' own L0 disks or in L1's staging (``train.resume`` may name one); rank 0 broadcasts its choice, so no rank
waits alone in a collective. L2 is listed only when none of those can be restored (every S3 call bounded: an L2 that
does not answer is a warning, and no step from it): a hung L2 never holds up a restore that L0 or L1 can serve.
Then, for that step:

1. each node's local rank 0 verifies the parts its own L0 holds (sha256 of every file);
2. when every node holds every part (one node, or one shared L0), each rank reads its L0 copy and nothing moves;
3. otherwise L1 is where the nodes meet: a globally committed L1 copy is verified in parallel (node ``g``
   hashes the files of parts ``k ≡ g mod nodes``); when it is absent or fails, every part is staged on L1 again,
   by a node that holds it verified on its L0, else downloaded from L2 by node ``k mod nodes`` (every node its own
   part, in parallel), and rank 0 merges the parts into the step's global COMMIT;
4. each rank reads through a *view* on its node's L0: links to its node's verified part files, and to L1 for
   the rest. No node reads another node's disk.

A step whose copies answered but do not verify is skipped for the next older one; a step that a tier did not answer
for, or whose copy failed to be read (EIO, ESTALE …), stops the restore (exit 75) instead: resuming an older step would
give the newer ones up for good (unless ``checkpoint.restore_past_unanswered``).

Each node logs which tier every part came from; ``tier`` is the farthest any part came from.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from pipelines.listing import strict_glob
from pipelines.storage import faults, oserrors
from pipelines.storage.s3 import credentials_refused, unreachable
from pipelines.train.ckpt import protocol as ck
from pipelines.train.ckpt import parts as ckpt_parts
from pipelines.train.ckpt import s3_tier as ckpt_s3
from pipelines.train.ckpt import tiers as ckpt_tiers
from pipelines.train.ckpt import history
from pipelines.train.ckpt.local import naming

NEAR = {"L0": 0, "L1": 1, "L2": 2}


@dataclass
class Restored:
    step: int
    tier: str  # the farthest tier any part came from
    path: Path  # what DCP reads on this rank: the L0 step directory, or a view of links
    parts: dict[int, str]  # part → the tier it came from
    state: dict  # the checkpoint's trainer_state.json

    def resumed_from(self) -> dict:
        out = {"step": self.step, "tier": self.tier}
        if len(self.parts) > 1:
            out["parts"] = {str(k): t for k, t in sorted(self.parts.items())}
        return out


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _bcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class Unanswered:
    """What did not answer while a restore looked, in the order met: tiers (L2 down or throttling, L1's file system
    failing, a node's L0 that cannot be listed) and copies whose read failed (EIO, ESTALE …: not an answer about the
    copy). The steps they hold are unknown, not gone: no older step is taken over them, nor step 0."""
    said: list[tuple[str, str]] = field(default_factory=list)  # ("tier" | "copy", why)

    def tier(self, why: str) -> None:
        self._add("tier", why)

    def copy(self, why: str) -> None:
        self._add("copy", why)

    def _add(self, kind: str, why: str) -> None:
        if (kind, why) not in self.said:
            self.said.append((kind, why))

    @staticmethod
    def stop(msg: str, why: list[str]) -> ck.CheckpointError:
        """The restore's stop over ``why``: the user's to fix (exit 2) when every reason is a copy refused to this
        user (``PermissionError``, or L2 refusing these credentials, :data:`L2_REFUSED`: no retry reads it), else
        exit 75."""
        return ck.CopyRefused(msg) if _refused(why) else ck.TierUnavailable(msg)

    def of(self, kind: str) -> list[str]:
        return [why for k, why in self.said if k == kind]

    def since(self, n: int) -> list[str]:
        return [why for _, why in self.said[n:]]


def restore(ckpt, step: Optional[int] = None) -> Optional[Restored]:
    """The newest restorable step (or exactly ``step``) made readable on every rank; None when there is none, which
    only every tier's answer can say: a tier that did not answer (L2 down, a node's L0 unreadable; or L2 that listed a
    step and then did not answer while its parts were fetched) or a copy that failed to be read, while no other tier
    serves a step, raises :class:`~pipelines.train.ckpt.protocol.TierUnavailable` on every rank (exit 75: a retry
    looks again), never "start from step 0" over steps that may be there. A step whose copies answered but do not
    verify is skipped; one that did not answer is not skipped for an older step (:func:`_not_older`: exit 75; exit 2,
    :class:`~pipelines.train.ckpt.protocol.CopyRefused`, when every such copy is refused to this user)."""
    missed = Unanswered()
    per_node, blocked = _nodes(ckpt, missed, step)  # blocked: the newest step that did not answer (None: any), why
    tried: set[int] = set()
    for far in (False, True):  # L1 and the nodes' disks; then, only when none of theirs could be restored, L2
        try:
            cands = _choose(ckpt, per_node, step, tried if far else None)
        except ck.TierUnavailable as e:  # (the same on every rank) name the newer step that did not answer too
            if blocked is None:
                raise
            raise ck.TierUnavailable(f"{e}; and {_not_older(*blocked)}") from None  # (L2 too: 75, as the other may
            # answer a retry)
        for c in cands:
            if blocked is not None and (blocked[0] is None or c["step"] < blocked[0]):
                raise Unanswered.stop(_not_older(*blocked, c["step"]), blocked[1])
            tried.add(c["step"])
            before = len(missed.said)
            got = _settle(ckpt, c, missed)
            if got is not None:
                return got
            if missed.since(before) and blocked is None and not ckpt.spec.checkpoint.restore_past_unanswered:
                blocked = (c["step"], missed.since(before))
    want = "a step to restore: not starting over from step 0" if step is None else f"step {step} to restore"
    if tiers := missed.of("tier"):
        raise Unanswered.stop(f"restore: {_listed(tiers)} did not answer and no other tier holds {want} "
                              f"({_again(tiers)})", tiers)
    if copies := missed.of("copy"):  # copies a disk failed to return are not copies that are gone
        raise Unanswered.stop(f"restore: {_listed(copies)} could not be read and no other copy "
                              + ("restores: not starting over from step 0" if step is None else
                                 f"of step {step} restores") + f" ({_again(copies)})", copies)
    return None


def _nodes(ckpt, missed: Unanswered, step: Optional[int]) -> tuple[dict[int, dict], Optional[tuple]]:
    """Collective: every node's committed L0 parts ({node: {step: part info}}), and what the nodes' disks did not
    answer for, put in ``missed``: a step whose manifest failed to be read there blocks the older steps (``(step,
    why)``), a disk that cannot be listed every step (``(None, why)``: it may hold any), unless ``step`` is asked for
    or ``checkpoint.restore_past_unanswered``."""
    mine = _inventory(ckpt.root, ckpt.node_log) if ckpt.topo.local_rank == 0 else None
    per_node: dict[int, dict] = {}
    newest: list[Optional[int]] = []
    for node, inv in _gather((ckpt.topo.node, mine)):
        if isinstance(inv, str):
            missed.tier(f"node {node}'s L0 ({inv})")
            newest.append(None)
        elif inv is not None:
            per_node[node], failed = inv
            for s, why in sorted(failed.items()):
                missed.copy(f"node {node}'s L0 {ck.step_name(s)} ({why})")
            newest += [max(failed)] if failed else []
    if not newest or step is not None or ckpt.spec.checkpoint.restore_past_unanswered:
        return per_node, None
    return per_node, (None if None in newest else max(newest), missed.since(0))


def _listed(why: list[str]) -> str:
    return ", ".join(why[:3]) + (f" and {len(why) - 3} more" if len(why) > 3 else "")


def _not_older(newer: Optional[int], why: list[str], older: Optional[int] = None) -> str:
    """Why a restore stops rather than take an older step: ``newer``'s copy is in a tier that did not answer, or
    failed to be read, so it is unknown, not lost; resuming at ``older`` would give it up for good (the run's new
    steps replace it). Only the user can choose that: ``checkpoint.restore_past_unanswered``."""
    said, again = "; ".join(why), _again(why)
    if newer is None and older is None:  # a node's disk that cannot be listed, and no other step either
        return (f"{said} did not answer: that disk may hold this run's steps ({again}; "
                "checkpoint.restore_past_unanswered=true resumes from an older step and gives up what it may hold)")
    if newer is None:  # a node's disk that cannot be listed: any step may be there
        return (f"restore: {said} did not answer: that disk may hold a step newer than step {older}: not resuming "
                f"from step {older} over it ({again}; checkpoint.restore_past_unanswered=true resumes from step "
                f"{older} and gives up what that disk may hold)")
    if older is None:  # the older steps could not be listed either
        return (f"{said} did not answer for step {newer} ({again}; checkpoint.restore_past_unanswered=true resumes "
                "from an older step and gives up the steps after it)")
    return (f"restore: {said} did not answer for step {newer}: not resuming from the older step {older} over it "
            f"({again}; checkpoint.restore_past_unanswered=true resumes from step {older} and gives up the steps "
            "after it)")


def _again(why: list[str]) -> str:
    """What brings the copies back: a retry, or for copies refused to this user (no retry reads them) access."""
    if not _refused(why):
        return "a retry looks again"
    l2 = any(L2_REFUSED in w for w in why)
    return "this user may not read them: give it read access" + (
        " (L2: check services.s3_endpoint_url, services.s3_bucket and the AWS credentials this process gets)"
        if l2 else "")


def _refused(why: list[str]) -> bool:
    """Is every reason a copy refused to this user: a file it may not read, or L2 refusing its credentials?"""
    return bool(why) and all(REFUSED in w or L2_REFUSED in w for w in why)


def _choose(ckpt, per_node: dict[int, dict], want: Optional[int], l2_skip: Optional[set[int]]) -> list[dict]:
    """Collective: rank 0's candidates, broadcast (every rank fails with rank 0's reason when it cannot list them):
    :func:`candidates`, or with ``l2_skip`` the steps only L2 holds (:func:`l2_candidates`)."""
    cands = None
    if ckpt.rank == 0:
        try:
            cands = candidates(ckpt, per_node, want) if l2_skip is None else l2_candidates(ckpt, want, l2_skip)
        except Exception as e:  # noqa: BLE001 - every rank fails with rank 0's reason, none waits for it
            cands = {"error": f"{type(e).__name__}: {e}", "refused": isinstance(e, ck.L2Refused)}
    cands = _bcast(cands)
    if isinstance(cands, dict):  # storage that did not answer (exit 75); L2 refusing these credentials (2)
        raise (ck.L2Refused if cands["refused"] else ck.TierUnavailable)(
            f"restore: cannot list this run's checkpoints: {cands['error']}")
    return cands


def _inventory(root: Path, log) -> tuple[dict, dict[int, str]] | str:
    """This node's committed parts on its L0, {step: (part, parts, attempt, lineage, term)}, and the steps whose
    manifest failed to be read there ({step: why}: unknown, not absent); an L0 that cannot be listed is the reason, a string
    (a failing disk must not leave the other ranks waiting in the gather, nor read as "no parts here")."""
    failed: dict[int, str] = {}
    try:
        found = ckpt_parts.local_parts(root, failed)
    except OSError as e:  # unknown, not empty: no step is resumed over what it may hold
        log(f"[ckpt] restore: this node's L0 cannot be read ({e})")
        return f"{type(e).__name__}: {str(e)[:240]}"
    for s, why in failed.items():
        log(f"[ckpt] restore: this node's L0 {ck.step_name(s)} cannot be read ({why})")
    return {s: info for s, m in found.items() if (info := _part_info(m)) is not None}, failed


def _part_info(man: dict) -> Optional[tuple]:
    """(part, parts, attempt, lineage, term) of a manifest whose part numbers make sense, else None."""
    try:
        part, parts, attempt = ckpt_parts.part_of(man)
    except (TypeError, ValueError):
        return None
    return (part, parts, attempt, history.of(man), history.term_of(man)) if 0 <= part < parts <= ck.MAX_PARTS \
        else None


def candidates(ckpt, per_node: dict[int, dict], want: Optional[int]) -> list[dict]:
    """Rank 0: steps of this line of training that could be restored without asking L2, newest first, each with
    its attempt, its part count and whether L1 holds its global commit: committed on L1, or every part of one
    attempt committed somewhere (the nodes' L0 disks, L1's staging)."""
    spec, rel_root, rec = ckpt.spec, ckpt.rel_root, ckpt.rec
    found: dict[int, dict] = {}
    l1 = Path(ckpt_tiers.tier_locations(spec, rel_root)["L1"])
    for s, man in ckpt_parts.local_parts(l1).items():
        info = _part_info({**man, "part": 0})
        if info is not None and history.accepts(rec, s, *info[3:]):
            found[s] = {"step": s, "attempt": info[2], "parts": info[1], "l1": True}
    spread: dict[tuple, set] = {}  # (step, attempt, parts) → the parts committed on some node's L0 or L1 staging
    for inv in [*per_node.values(), staged_parts(l1)]:
        for s, (part, parts, attempt, lin, term) in inv.items() if isinstance(inv, dict) else inv:
            if history.accepts(rec, s, lin, term):
                spread.setdefault((s, attempt, parts), set()).add(part)
    for (s, attempt, parts), have in spread.items():
        if s not in found and have == set(range(parts)):
            found[s] = {"step": s, "attempt": attempt, "parts": parts, "l1": False}
    out = [c for c in sorted(found.values(), key=lambda c: -c["step"]) if want is None or c["step"] == want]
    if out and not out[0]["l1"] and want is None:  # L2 could hold a newer step (L1 lost, a new L1): say so
        ckpt.log(f"[ckpt] restore: L2 not consulted: step {out[0]['step']} can be restored from the nodes' disks or "
                 "L1's staging and L1 holds no newer global commit (L2 is listed only when no such step restores)")
    return out


def l2_candidates(ckpt, want: Optional[int], skip: set[int]) -> list[dict]:
    """Rank 0, when no step of :func:`candidates` could be restored: the steps of this line that L2 holds (less
    ``skip``, tried already), newest first. Every S3 call is bounded (``checkpoint.s3_*``: its retries are the
    wait); an L2 that still does not answer raises :class:`~pipelines.train.ckpt.protocol.L2Unavailable`: it may hold
    this run's newest steps, so "no answer" is never "no candidate" (a fresh start would write over them)."""
    spec, rel_root, rec = ckpt.spec, ckpt.rel_root, ckpt.rec
    found = []
    try:
        for s in reversed(ckpt_tiers.list_steps(spec, rel_root, ("L2",))["L2"]):
            if s in skip or (want is not None and s != want):
                continue
            uri = ckpt_tiers.tier_locations(spec, f"{rel_root}/{ck.step_name(s)}")["L2"]
            man = ckpt_s3.read_s3_manifest(spec, uri)
            info = _part_info({**man, "part": 0}) if man is not None else None
            if info is not None and history.accepts(rec, s, *info[3:]):
                found.append({"step": s, "attempt": info[2], "parts": info[1], "l1": False})
    except ck.L2Refused as e:  # no retry mends it: the user's (2)
        ckpt.log(f"[ckpt] restore: L2 refused the request ({e}) and L1 and the nodes' disks hold no step to "
                 "restore: not starting over")
        raise
    except ck.L2Unavailable as e:
        ckpt.log(f"[ckpt] restore: L2 does not answer ({e}) and L1 and the nodes' disks hold no step to restore: "
                 "not starting over (a retry looks again)")
        raise ck.L2Unavailable(f"L2 did not answer: {e}") from None
    return found


def staged_parts(l1_root: Path) -> list[tuple[int, tuple]]:
    """Parts committed in L1's staging (``.step-N.parts/part-K``), e.g. staged by every node before rank 0's node
    was lost, so never merged: [(step, (part, parts, attempt, lineage, term))]."""
    out = []
    for d in strict_glob(".step-*.parts", l1_root):  # a folder that cannot be listed raises (exit 75)
        step = ck.parse_step(d.name[1:-len(".parts")])
        for p in strict_glob("part-*", d) if step is not None else []:
            try:
                with naming(p):  # a read() error names the part
                    info = _part_info(ck.read_local_manifest(p))
            except (ck.CheckpointError, ValueError):  # a manifest that answered but is not whole
                continue
            except OSError as e:  # L1 failing (exit 75: it is not "no such step"); gone or not a part: skipped
                if l1_failed(e, l1_root) is not None:
                    raise
                continue
            if info is not None:
                out.append((step, info))
    return out


def _settle(ckpt, c: dict, missed: Unanswered) -> Optional[Restored]:
    """Make step ``c`` readable on every rank, or return None on every rank (then an older step is tried); a tier
    that did not answer while it was read, and a copy whose read failed, are added to ``missed`` (the same on every
    rank)."""
    topo, spec = ckpt.topo, ckpt.spec
    rel = f"{ckpt.rel_root}/{ck.step_name(c['step'])}"
    locs = ckpt_tiers.tier_locations(spec, rel)
    l0, l1 = Path(locs["L0"]), Path(locs["L1"])
    log = ckpt.node_log
    held, why = _verify_own_part(l0, c, log) if topo.local_rank == 0 else (None, None)
    got = _gather((topo.node, held, why))  # the same on every rank
    have = {node: h for node, h, _ in got if h is not None}
    for node, _, why in got:
        if why:
            missed.copy(f"node {node}'s {why}")
    every = set(range(c["parts"]))
    if all(have.get(g, set()) >= every for g in range(topo.nodes)):
        sources = {k: "L0" for k in every}
        view = l0
    else:
        sources = _meet_on_l1(ckpt, c, have, locs, log, missed)
        if sources is None:
            return None
        view = _view(ckpt, c, have.get(topo.node, set()), l0, l1)
    state = json.loads((view / "trainer_state.json").read_text())
    if topo.local_rank == 0:
        reads = "its L0 copy" if view == l0 else f"its L0 part(s) {sorted(have.get(topo.node, set()))}, L1 for the rest"
        log(f"[ckpt] restore: node {topo.node}: {ck.step_name(c['step'])}: "
            + ", ".join(f"part-{k} from {t}" for k, t in sorted(sources.items())) + f"; reads {reads}")
    return Restored(c["step"], max(sources.values(), key=NEAR.get), view, sources, state)


def _verify_own_part(l0: Path, c: dict, log) -> tuple[set[int], Optional[str]]:
    """The parts of this step (this attempt) that this node's L0 holds and that verify, and what failed to be read
    there (an errno other than an answer about an entry: :func:`_unread`), else None."""
    try:
        if not (l0 / ck.COMMIT).is_file():
            return set(), None
        part, parts, attempt = ckpt_parts.part_of(ck.read_local_manifest(l0))
        if attempt != c["attempt"] or parts != c["parts"]:  # before its files are read: it never serves this step
            log(f"[ckpt] restore: skipped {l0.name} L0: another attempt's part ({attempt}, not {c['attempt']})")
            return set(), None
        ck.verify_local(l0)
    except Exception as e:  # noqa: BLE001 - a corrupt or partial copy is a reason to use another tier
        log(f"[ckpt] restore: skipped {l0.name} L0: {e}")
        return set(), _unread(e, l0, "L0")
    return {part}, None


def _meet_on_l1(ckpt, c: dict, have: dict[int, set], locs: dict, log, missed: Unanswered) -> Optional[dict[int, str]]:
    """Make the step globally committed and verified on L1; returns part → source tier, or None (a part whose tier
    did not answer, or an L1 copy that failed to be read: named in ``missed``)."""
    topo = ckpt.topo
    l1 = Path(locs["L1"])
    every = range(c["parts"])
    local = {k for h in have.values() for k in h}
    if c["l1"]:
        got = _verify_l1_parts(l1, topo, log) if topo.local_rank == 0 else ([], None)
        got = _gather(got)  # the same on every rank
        bad = sorted({k for b, _ in got for k in b})
        for _, why in got:
            if why:
                missed.copy(why)
        if not bad:
            return {k: "L0" if k in local else "L1" for k in every}
        # the parts are staged again; the copy that failed keeps its COMMIT until a whole one replaces it (a failed
        # read is not proof that it is gone, and without L2 it may be the only copy)
    jobs = {k: (min(g for g in have if k in have[g]), "L0") if k in local else (k % topo.nodes, "L2") for k in every}
    done = {}
    if topo.local_rank == 0:
        for k, (node, how) in jobs.items():
            if node == topo.node:
                done[k] = _stage(ckpt, c, k, how, locs, log)
    results = {k: t for d in _gather(done) if d for k, t in d.items()}
    for t in results.values():  # the same on every rank: each tier and error that did not answer, once
        if t and t.startswith(UNANSWERED):
            missed.tier(t[1:])
    ok = len(results) == c["parts"] and all(t in NEAR for t in results.values())
    merged = _bcast(_merge(l1, c, again=c["l1"]) if ok and ckpt.rank == 0 else None)
    if isinstance(merged, str):  # L1 failed under the merge: the same on every rank
        missed.tier(merged[1:])
        merged = False
    if not merged:
        if ckpt.rank == 0:
            log(f"[ckpt] restore: skipped {l1.name}: no tier holds every part ({results})")
        return None
    return results


def _merge(l1: Path, c: dict, again: bool) -> bool | str:
    """Rank 0: the staged parts merged into the step's global commit (replacing a copy that failed to verify);
    ``UNANSWERED`` + why when L1's file system failed under it (:func:`l1_failed`)."""
    try:
        return ckpt_parts.merge_parts(l1, c["parts"], c["attempt"], again=again)
    except Exception as e:  # noqa: BLE001 - reported by the caller as the step skipped
        tier = l1_failed(e, l1.parent)
        return f"{UNANSWERED}{tier}" if tier else False


def _verify_l1_parts(l1: Path, topo, log) -> tuple[list[int], Optional[str]]:
    """This node's share of verifying the L1 copy: the files of parts ``k ≡ node (mod nodes)``; (the bad parts, what
    failed to be read: an OSError other than a missing file, None when every file read answered)."""
    try:
        man = ck.read_local_manifest(l1)
        files = ck.manifest_files(man, str(l1))
    except Exception as e:  # noqa: BLE001 - any reason makes the L1 copy unusable: its parts are staged again
        log(f"[ckpt] restore: skipped {l1.name} L1: {e}")
        return [0], _unread(e, l1)
    owner = man.get("part_of", {})
    mine = [rel for rel in files if int(owner.get(rel, 0)) % topo.nodes == topo.node]
    bad = set()
    try:
        sums = ck.hash_files(l1, [r for r in mine if (l1 / r).is_file()])
    except OSError as e:  # a failed read: these parts are staged again (the copy keeps its COMMIT meanwhile)
        log(f"[ckpt] restore: skipped {l1.name} L1: {e}")
        return sorted({int(owner.get(rel, 0)) for rel in mine}) or [0], _unread(e, l1)
    for rel in mine:
        if sums.get(rel) != files[rel]["sha256"]:
            bad.add(int(owner.get(rel, 0)))
            log(f"[ckpt] restore: skipped {l1.name} L1: {rel} is missing or does not match its sha256")
    return sorted(bad), None


def _unread(e: BaseException, copy: Path, tier: str = "L1") -> Optional[str]:
    """``'L1 <step> (…)'`` for a read of the step's copy on ``tier`` that failed (EIO, ESTALE, EACCES …: not an
    answer about an entry, not a copy that answered and is bad); None otherwise. The reason names the exception's
    class: ``PermissionError`` (EACCES, EPERM) is :data:`REFUSED`."""
    if oserrors.unanswered(e):
        return f"{tier} {copy.name} ({type(e).__name__}: {str(e)[:240]})"
    return None


REFUSED = "(PermissionError: "  # in a reason: a copy this user may not read (EACCES, EPERM)
L2_REFUSED = "(refused these credentials: "  # in a reason: L2 refusing this process's credentials (401/403)
UNANSWERED = "?"  # what _stage returns before the tier and the error when that tier did not answer


def _stage(ckpt, c: dict, k: int, how: str, locs: dict, log) -> Optional[str]:
    """Put part ``k`` on L1's staging: from this node's L0, else a staged copy already there, else from L2. Returns
    the tier it came from; None when its copy answered but is missing or does not verify; ``UNANSWERED`` + the tier
    and what happened when it did not answer (:func:`unanswered_tier`)."""
    spec = ckpt.spec
    l0, l1 = Path(locs["L0"]), Path(locs["L1"])
    try:
        faults.point("restage")
        if how == "L0":
            ckpt_parts.stage_part(l0, l1, spec.checkpoint.multipart_chunk_mb << 20, again=True)
            return "L0"
        staged = ckpt_parts.staging_dir(l1) / ck.part_name(k)
        if ck.is_valid_local(staged) and \
                ckpt_parts.part_of(ck.read_local_manifest(staged)) == (k, c["parts"], c["attempt"]):
            return "L1"
        if not ckpt_tiers.l2_in_use(spec, ckpt.rel_root):  # raises L2Unavailable for one that does not answer
            raise ck.CheckpointError("no S3 endpoint for L2")
        ckpt_s3.download_checkpoint(spec, locs["L2"], staged, part=k if c["parts"] > 1 else None)
        return "L2"
    except Exception as e:  # noqa: BLE001 - reported; the step is skipped on every rank
        log(f"[ckpt] restore: part-{k} of {l1.name}: {e}")
        tier = l1_failed(e, l1.parent) or (unanswered_tier(e) if how != "L0" else None)
        return f"{UNANSWERED}{tier}" if tier else None


def l1_failed(e: BaseException, l1_root: Path) -> Optional[str]:
    """``'L1 (…)'`` when ``e`` is L1's file system failing (:func:`pipelines.storage.oserrors.unanswered`) on a
    path under the run's L1 root ``l1_root`` while a part was staged, merged or listed there (a write or close
    refused, a rename, an open or a read that failed; the copies name the file of each, ``local.naming``): L1 did not
    serve, which says nothing of the copy, so the step is unknown, not bad (if no step restores, the run does not
    start over)."""
    if not oserrors.unanswered(e):
        return None
    for name in (e.filename, e.filename2):
        if isinstance(name, (str, bytes, os.PathLike)) and Path(os.fsdecode(name)).is_relative_to(l1_root):
            return f"L1 ({type(e).__name__}: {str(e)[:240]})"
    return None


def unanswered_tier(e: BaseException) -> Optional[str]:
    """``'L2 (…)'`` or ``'L1 (…)'`` when ``e``, raised while a part was fetched from L2 onto L1, is a tier that did
    not answer (an S3 endpoint down, throttling, timing out past its retries; L1's file system timing out or dropping
    the connection); None when a tier answered with a copy that is missing or does not verify. L2 refusing these
    credentials (a policy that lets them list but not get) says :data:`L2_REFUSED`: no retry reads the parts."""
    if not (isinstance(e, ck.TierUnavailable) or unreachable(e)):
        return None
    if isinstance(e, OSError) and e.filename:  # a file of L1's staging, not an S3 request
        return f"L1 ({type(e).__name__}: {str(e)[:240]})"
    said = L2_REFUSED if isinstance(e, ck.L2Refused) or credentials_refused(e) else "("
    return f"L2 {said}{type(e).__name__}: {str(e)[:240]})"


def _view(ckpt, c: dict, mine: set[int], l0: Path, l1: Path) -> Path:
    """A directory on this node's L0 whose entries link to this node's verified part files and to L1 for the
    rest; DCP reads it as one checkpoint."""
    view = ckpt.root / f".view-{ckpt.attempt}-node{ckpt.topo.node}-{ck.step_name(c['step'])}"  # L0 may be shared
    why = None
    if ckpt.topo.local_rank == 0:
        try:
            man = ck.read_local_manifest(l1)
            owner = man.get("part_of", {})
            shutil.rmtree(view, ignore_errors=True)
            for rel in ck.manifest_files(man, str(l1)):
                src = (l0 if int(owner.get(rel, 0)) in mine else l1) / rel
                (view / rel).parent.mkdir(parents=True, exist_ok=True)
                os.symlink(src, view / rel)
        except (ck.CheckpointError, OSError, ValueError) as e:
            why = f"node {ckpt.topo.node}: cannot build the restore view: {e}"
    errors = [e for e in _gather(why) if e]  # every rank learns it, none waits alone
    if errors:
        raise ck.CheckpointError(f"restore: {errors[0]}")
    return view

