"""Promotion while training runs: each part leader's :class:`Promoter` copies its node's part of every committed
step L0 → L1 (global rank 0 merges the parts into the step's global commit on L1) and, in a thread of its own that
L1 never waits for, L1 → L2, each tier's retention following its copy. :class:`Topology` says which ranks lead a
part (every node's local rank 0 with node-local L0, else rank 0 alone); :class:`Events` carries the promotions'
metrics to the training loop. The saves themselves: :mod:`pipelines.train.ckpt.checkpointer`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from pipelines.manifest import atomic_write_text
from pipelines.spec import JobSpec
from pipelines.storage import faults
from pipelines.train.ckpt import protocol as ck
from pipelines.train.ckpt import parts as ckpt_parts
from pipelines.train.ckpt import tiers as ckpt_tiers
from pipelines.train.ckpt import fence
from pipelines.train.ckpt import fence_l2
from pipelines.train.ckpt import history



@dataclass(frozen=True)
class Topology:
    """Where this rank runs: its node (torchrun's GROUP_RANK), the nodes, and how the checkpoint is cut into parts.
    With node-local L0 every node commits its own part (``parts == nodes``) and its local rank 0 leads it; when L0
    is one filesystem that every rank sees (probed at start) the checkpoint is one part led by global rank 0."""
    rank: int
    local_rank: int
    node: int
    nodes: int
    part: int
    parts: int
    leader: bool  # commits and promotes this node's part

    @staticmethod
    def detect(rank: int, world: int, root: Path, attempt: str) -> "Topology":
        node = int(os.environ.get("GROUP_RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        nodes = max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        shared = nodes == 1 or _l0_is_shared(rank, root, attempt)
        if shared:
            return Topology(rank, local_rank, node, nodes, 0, 1, rank == 0)
        return Topology(rank, local_rank, node, nodes, node, nodes, local_rank == 0)


def _l0_is_shared(rank: int, root: Path, attempt: str) -> bool:
    """Rank 0 writes a probe under L0; L0 is shared when every rank sees it."""
    probe = root / f".probe-{attempt}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_text(attempt)
    dist.barrier()
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, probe.is_file())
    dist.barrier()
    if rank == 0:
        probe.unlink(missing_ok=True)
    return all(seen)


def lower_priority() -> None:
    """Renice the calling thread (Linux threads are tasks): hashing, copies and uploads yield the CPU to training."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):  # not Linux, or not permitted: run at normal priority
        pass


class Events:
    """Metrics that background threads record for rank 0's MLflow flush: (name, value, step)."""

    def __init__(self):
        self._lock, self._items = threading.Lock(), []

    def add(self, name: str, value: float, step: int) -> None:
        with self._lock:
            self._items.append((name, float(value), int(step)))

    def take(self) -> list[tuple[str, float, int]]:
        with self._lock:
            items, self._items = self._items, []
        return items



def no_l2(spec, rel_root: str, log: Callable[[str], None]) -> Optional[str]:
    """Why this run has no L2 (no endpoint set and none started here), else None. An L2 that does not answer now
    (an endpoint down, the embedded one started here once and down, or slow to answer its health check) is still
    this run's L2: its steps wait on L1 (``l2_behind``) and catch up when it answers, instead of the run going to
    L1 only, where L1 retention would remove the steps L2 keeps (``l2_keep_every``) before they ever reach it."""
    try:
        return None if ckpt_tiers.l2_in_use(spec, rel_root) else ckpt_tiers.l2_available(spec)
    except ck.L2Unavailable as e:
        log(f"[ckpt] L2 does not answer now ({str(e).splitlines()[0]}): its steps wait on L1 and catch up when it does")
        return None

class Promoter:
    """A part leader's two background threads. The L1 thread: its part of each committed step L0 → L1, verified,
    COMMIT last; global rank 0 merges the parts into the step's global commit on L1; then L0/L1 retention
    (``ckpt_tiers.prune``: each node on its own L0, the committing rank on L1, counted from the L1 commits, so L0
    and L1 stay bounded whatever L2 does; L1 holds back at most ``checkpoint.l1_hold_for_l2`` steps L2 still needs).
    L1 is required: a step that does not reach it is recorded (:attr:`failed`) and the final step's is checked at
    :meth:`Checkpointer.close`. The L2 thread, when an S3 endpoint is configured, takes each step the L1 thread
    committed: each node uploads its part, the committing rank writes the step's global COMMIT there, catches up the
    steps L2 missed and applies L2 retention. The two never wait for each other: a hung or failing L2 (every S3 call
    answers within its bound, ``checkpoint.s3_*``) is a warning and a ``ckpt/l2_errors`` metric, never a late or
    lost L1 commit; the step waits in :attr:`l2_behind` (``ckpt/l2_behind``: steps waiting for L2) and L2 catches up
    from L1 at the next step that finds it answering (the ``promote`` stage finishes the final step). L0/L1
    retention never removes a step the L2 thread reads (:attr:`reading`); a step it removed before the L2 thread got
    to it is skipped there. With one part, a step that L2 retention would not keep is passed over, by either thread,
    for a newer one when that thread is behind."""

    def __init__(self, spec: JobSpec, rel_root: str, log: Callable[[str], None], events: Events, topo: Topology,
                 attempt: str, rec: Optional[dict] = None):
        self.spec, self.rel_root, self.log, self.events, self.topo, self.rec = spec, rel_root, log, events, topo, rec
        self.attempt = attempt  # this attempt's name: its nodes' L2 marks carry it
        self.term_on_l2 = False  # this attempt's term recorded on L2 (fence_l2), before its first COMMIT there
        self.lineage_on_l2 = False  # L1's lineage record copied there since it last changed (set_lineage)
        self.no_l2 = no_l2(spec, rel_root, log)
        if self.no_l2:
            log(f"[ckpt] promotion during the run goes to L1 only: {self.no_l2.splitlines()[0]}")
        self.tiers = ("L1",) if self.no_l2 else ("L1", "L2")
        self.commits = topo.rank == 0  # writes the steps' global COMMITs and runs L1/L2 retention
        self.done: dict[int, dict] = {}
        self.failed: dict[int, str] = {}  # step → why it did not reach L1
        self.l2_behind: set[int] = set()  # globally committed on L1, not yet on L2 (the L2 thread's)
        self.l2_pending: set[int] = set()  # handed to the L2 thread, not done there yet
        self.l2_known = False  # L2 answered what it lacks of L1's steps (missing_on_l2) in this run
        self.reading: list[int] = []  # the steps the L2 thread reads from L0/L1 now (nested: a step twice): kept
        self.pin = threading.Lock()  # held by L0/L1 retention, and by the L2 thread while it picks its step
        self.seconds: dict[int, float] = {}  # step → seconds to promote it (rank 0: until its global commit on L1)
        self.submitted: set[int] = set()
        self.busy_since: Optional[float] = None  # time.monotonic() when the L1 thread took its current step
        self.q: "queue.Queue[Optional[int]]" = queue.Queue()
        self.l2q: "queue.Queue[Optional[tuple]]" = queue.Queue()  # ("step", step, digests), ("missing",), ("final", s)
        self.thread = threading.Thread(target=self._work, daemon=True, name="llmp-promoter")
        self.l2_thread = threading.Thread(target=self._work_l2, daemon=True, name="llmp-promoter-l2") \
            if "L2" in self.tiers else None
        self.thread.start()
        if self.l2_thread is not None:
            self.l2_thread.start()

    def submit(self, step: int) -> None:
        self.submitted.add(step)
        self.q.put(step)

    def idle(self, timeout_s: float) -> None:
        """Wait until every submitted step is handled on L1 (a rollback restores with no L1 promotion in flight; L2
        is never waited for), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.q.unfinished_tasks:
            if time.monotonic() > deadline:
                raise ck.CheckpointError(f"promotion still busy after {timeout_s:.0f} s "
                                         "(checkpoint.collective_timeout_minutes)")
            time.sleep(0.05)

    def drain(self, timeout_s: float) -> None:
        """Stop the L1 thread once it has handled every submitted step, waiting at most ``timeout_s``."""
        self.q.put(None)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise ck.CheckpointError(f"promotion did not finish within {timeout_s:.0f} s "
                                     "(checkpoint.collective_timeout_minutes)")

    def check_l2(self) -> None:
        """Have the L2 thread find the steps of this line that L2 still lacks (a restart forgets nothing L2 missed
        before it): listed there, never at start, so a hung L2 holds nothing up."""
        if self.l2_thread is not None and self.commits:
            self.l2q.put(("missing",))

    def finish_l2(self, final: Optional[int], timeout_s: float) -> bool:
        """Close: the L2 thread finishes what it has, then (the committing rank) puts the final step on L2 with any
        step L2 missed; waited for at most ``timeout_s``. Never raises: what L2 lacks then is a warning and a
        ``ckpt/l2_errors`` metric (the ``promote`` stage puts the final step on L2). True when the thread stopped
        (or there is none), False when it still runs (its later writes meet the released fence)."""
        if self.l2_thread is None:
            return True
        if final is not None and self.commits:
            self.l2q.put(("final", final))
        self.l2q.put(None)
        self.l2_thread.join(timeout_s)
        if self.l2_thread.is_alive():
            self.events.add("ckpt/l2_errors", 1, final or 0)
            self.log(f"[ckpt] warning: L2 still busy after {timeout_s:.0f} s at close ({self.l2_waiting()} step(s) "
                     "waiting for it); L1 holds every step, the promote stage puts the final step on L2")
            return False
        return True

    def l2_waiting(self) -> int:
        """Steps waiting for L2: handed to the L2 thread and not done there, or left behind by an outage."""
        return len(self.l2_pending | self.l2_behind)

    def busy_for(self) -> float:
        """Seconds the L1 thread has spent on the step in its hands (0 when idle): the trainer's heartbeat of it."""
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _work(self) -> None:
        lower_priority()
        while (step := self.q.get()) is not None:
            self.busy_since = time.monotonic()
            try:
                newer = bool(self.q.queue) and self.q.queue[0] is not None  # never the final step (then None)
                if self._passed_over(step, newer, ""):
                    continue
                self.promote(step)
            except Exception as e:  # noqa: BLE001 - training goes on; close() checks that the final step got there
                self.failed[step] = f"{type(e).__name__}: {e}"
                self.events.add("ckpt/promote_errors", 1, step)
                self.log(f"[ckpt] promote: step {step} did not reach L1: {self.failed[step]}")
            finally:
                self.busy_since = None
                self.q.task_done()
        self.q.task_done()

    def _passed_over(self, step: int, newer: bool, where: str) -> bool:
        """With one part, a step that L2 retention would not keep is passed over when a newer one waits (logged)."""
        if self.topo.parts == 1 and newer and not self._l2_keeps(step):
            self.log(f"[ckpt] promote: step {step} passed over{where} for a newer one (not kept at L2)")
            return True
        return False

    def promote(self, step: int) -> None:
        """This node's part of ``step`` to L1 (rank 0: and the global commit), handed to the L2 thread, then L0/L1
        retention."""
        rel = f"{self.rel_root}/{ck.step_name(step)}"
        t0 = time.perf_counter()
        actions, digests = self.to_l1(rel, step)
        if self.commits:
            faults.point("l1_committed")
        self.failed.pop(step, None)
        dt = time.perf_counter() - t0
        self.done[step] = actions
        self.seconds[step] = dt
        self.events.add("ckpt/promote_s", dt, step)
        if self.l2_thread is not None:
            self.l2_pending.add(step)
            self.l2q.put(("step", step, digests))
            self.events.add("ckpt/l2_behind", self.l2_waiting(), step)
        deleted = self.retain(step)
        gone = ", ".join(f"{t} {v}" for t, v in deleted.items() if v)
        self.log(f"[ckpt] promote: step {step} {actions} in {dt:.2f} s" + (f"; retention removed {gone}" if gone else ""))

    def to_l1(self, rel: str, step: int) -> tuple[dict, Optional[dict]]:
        """This node's part (with one part, the whole step) staged on L1; rank 0 merges the parts into the step's
        global commit there. Returns (actions, the files' part digests for the S3 upload)."""
        locs = ckpt_tiers.tier_locations(self.spec, rel)
        l0 = Path(locs["L0"])
        if not (l0 / ck.COMMIT).is_file():
            if ck.is_valid_local(Path(locs["L1"])):  # e.g. restored at the final step on a fresh node
                return {"L1": "already-verified"}, None
            raise ck.CheckpointError(f"L0 part {l0} is not committed on this node: nothing to promote")
        action, digests = ckpt_parts.stage_part(l0, Path(locs["L1"]), self.spec.checkpoint.multipart_chunk_mb << 20)
        faults.point("l1_staged")
        if self.commits:
            self._merge_l1(Path(locs["L1"]), l0, step)
        return {"L1": action}, digests

    def _merge_l1(self, l1: Path, l0: Path, step: int) -> None:
        """Rank 0: wait for every node's part on L1 (bounded), then write the step's global COMMIT there."""
        _, parts, attempt = ckpt_parts.part_of(ck.read_local_manifest(l0))
        deadline = time.monotonic() + self.spec.checkpoint.collective_timeout_minutes * 60
        while not ckpt_parts.merge_parts(l1, parts, attempt):
            if time.monotonic() > deadline:
                raise ck.CheckpointError(f"step {step}: parts missing on L1 after checkpoint.collective_timeout_minutes;"
                                         " not committed there")
            time.sleep(0.05)

    def _work_l2(self) -> None:
        lower_priority()
        while (item := self.l2q.get()) is not None:
            try:
                if item[0] == "step":
                    self.promote_l2(item[1], item[2])
                elif item[0] == "missing":
                    self.learn_missing()
                else:
                    self._final_to_l2(item[1])
            except Exception as e:  # noqa: BLE001 - L2 is a copy of L1: its faults cost a warning, never the thread
                self._l2_warning(item[1] if len(item) > 1 else 0, e)
            finally:
                if item[0] == "step":
                    self.l2_pending.discard(item[1])
                self.l2q.task_done()
        self.l2q.task_done()

    def promote_l2(self, step: int, digests: Optional[dict]) -> None:
        """The L2 thread: ``step`` (handed over once on L1) to L2, read from L0 (else L1) while pinned against
        L0/L1 retention, then L2 retention. With one part, passed over for a newer step L2 would keep instead."""
        if self._passed_over(step, any(i is not None and i[0] == "step" and i[1] > step for i in list(self.l2q.queue)),
                             " on L2"):
            return
        t0 = time.perf_counter()
        with self._reading(step):
            result = self._to_l2(f"{self.rel_root}/{ck.step_name(step)}", step, digests)
        dt = time.perf_counter() - t0
        self.done.setdefault(step, {})["L2"] = result
        if result == "committed" and self.commits and not self.l2_known:  # L2 answers again: what does it lack?
            self.learn_missing()
        self.events.add("ckpt/l2_s", dt, step)
        deleted = self.retain_l2(step)
        self.events.add("ckpt/l2_behind", len((self.l2_pending - {step}) | self.l2_behind), step)
        gone = ", ".join(f"{t} {v}" for t, v in deleted.items() if v)
        self.log(f"[ckpt] promote: step {step} L2 {result} in {dt:.2f} s"
                 + (f"; retention removed {gone}" if gone else ""))

    @contextlib.contextmanager
    def _reading(self, step: int):
        """Pin ``step`` while the L2 thread reads its L0/L1 copies: L0/L1 retention keeps it meanwhile."""
        with self.pin:
            self.reading.append(step)
        try:
            yield
        finally:
            self.reading.remove(step)

    def _to_l2(self, rel: str, step: int, digests: Optional[dict]) -> str:
        """This node's part to L2; the committing rank, once every part is there, commits the step there and catches
        up the steps L2 missed. Never raises: an outage leaves the step behind, with a warning."""
        locs = ckpt_tiers.tier_locations(self.spec, rel)
        l1 = Path(locs["L1"])
        if not (Path(locs["L0"]) / ck.COMMIT).is_file():  # restored at this step from L1, or L0 retention removed it
            if self.commits:  # before the L2 thread got to it: L2 gets it from L1
                return self._from_l1(step)
            self._mark(step, "failed: not on L0")  # rank 0 waits for no mark that cannot come
            return "from-l1"
        try:  # every node, before its first L2 write: a part put may remove another attempt's COMMIT
            self.record_term()
        except Exception as e:  # noqa: BLE001 - L2 is a copy of L1: its faults cost a warning, not the step
            self._l2_warning(step, e)
            if not self.commits:  # rank 0 waits for this node's mark (bounded)
                self._mark(step, f"failed: {type(e).__name__}")
            else:
                self.l2_behind.add(step)
            return "behind"
        own = self._upload_part(Path(locs["L0"]), locs["L2"], step, digests)
        if not self.commits:
            return own
        self.l2_behind.add(step)
        try:
            if own != "behind" and self._parts_on_l2(l1, step):
                man = ck.read_local_manifest(l1)
                if ckpt_parts.merge_parts_s3(self.spec, locs["L2"], int(man.get("parts", 1)), man.get("attempt"),
                                             checked=frozenset({self.topo.part})):  # its own part, checked as put
                    self.l2_behind.discard(step)
            if own == "behind":  # warned once; L2 catches up at a later promotion
                return own
            self.catch_up()
            return "behind" if step in self.l2_behind else "committed"
        except Exception as e:  # noqa: BLE001 - L2 is a copy of L1: its faults cost a warning, not the step
            self._l2_warning(step, e)
            return "behind"
        finally:
            shutil.rmtree(ckpt_parts.l2_marks_dir(l1), ignore_errors=True)

    def _from_l1(self, step: int) -> str:
        """Rank 0: a step this attempt did not save (it restored there) goes to L2 from its L1 copy."""
        self.l2_behind.add(step)
        try:
            self.catch_up(final=True)
        except Exception as e:  # noqa: BLE001 - as above
            self._l2_warning(step, e)
        if step in self.l2_behind:
            return "behind"
        l1 = Path(ckpt_tiers.tier_locations(self.spec, f"{self.rel_root}/{ck.step_name(step)}")["L1"])
        return "committed" if (l1 / ck.COMMIT).is_file() else "skipped (it left L1 first)"

    def _l2_warning(self, step: int, e: Exception) -> None:
        self.events.add("ckpt/l2_errors", 1, step)
        self.log(f"[ckpt] warning: L2 did not take step {step} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                 "it stays on L1 and L2 catches up when it answers (the promote stage finishes the final step)")

    def _upload_part(self, l0: Path, uri: str, step: int, digests: Optional[dict]) -> str:
        """This node's part to L2; another node's leader then marks on L1 (``.step-N.l2/part-K``: this attempt's
        name and ok or failed) whether it got there, for rank 0. Never raises."""
        try:
            ckpt_parts.upload_part(self.spec, l0, uri, digests)
            mark = "ok"
        except Exception as e:  # noqa: BLE001 - reported; rank 0 leaves the step behind
            self._l2_warning(step, e)
            mark = f"failed: {type(e).__name__}"
        if not self.commits:
            self._mark(step, mark)
        return "part-uploaded" if mark == "ok" else "behind"

    def _mark(self, step: int, mark: str) -> None:
        """Another node's leader: mark on L1 for rank 0 whether its part of ``step`` reached L2 (ok / failed: …)."""
        l1 = Path(ckpt_tiers.tier_locations(self.spec, f"{self.rel_root}/{ck.step_name(step)}")["L1"])
        marks = ckpt_parts.l2_marks_dir(l1)
        try:
            marks.mkdir(parents=True, exist_ok=True)
            atomic_write_text(marks / ck.part_name(self.topo.part), f"{self.attempt} {mark}")
        except OSError as e:  # rank 0 waits for it (bounded), then leaves the step behind
            self.log(f"[ckpt] warning: cannot mark step {step}'s part on L1 ({e})")

    def _parts_on_l2(self, l1: Path, step: int) -> bool:
        """Rank 0: wait (bounded) for the other nodes' marks of this attempt; True when every part reached L2."""
        marks = ckpt_parts.l2_marks_dir(l1)
        deadline = time.monotonic() + self.spec.checkpoint.collective_timeout_minutes * 60
        paths = [marks / ck.part_name(k) for k in range(self.topo.parts) if k != self.topo.part]

        def said() -> list[Optional[str]]:  # each mark of this attempt: "ok" / "failed: …"; None while absent
            out = []
            for path in paths:
                try:
                    got = path.read_text()
                except OSError:
                    got = ""
                out.append(got[len(self.attempt) + 1:] if got.startswith(f"{self.attempt} ") else None)
            return out

        while None in said() and time.monotonic() < deadline:
            time.sleep(0.05)
        return all(m == "ok" for m in said())

    def catch_up(self, final: bool = False) -> None:
        """The committing rank: put on L2 the steps globally committed on L1 that L2 lacks, oldest first: the parts'
        manifests merged when every node's part is there, else the step put from its L1 copy, part by part. A step L1
        retention removed meanwhile is dropped from the list. Raises when L2 does not answer."""
        if self.l2_behind:
            self.record_term()
        for st in sorted(self.l2_behind):
            try:
                self._catch_up_step(st, final)
            except ck.L2Unavailable:
                raise
            except Exception as e:  # noqa: BLE001 - this step only; the others still catch up
                self.log(f"[ckpt] L2 catch-up: step {st}: {type(e).__name__}: {e}")

    def record_term(self) -> None:
        """This attempt's term on L2 (:mod:`pipelines.train.ckpt.fence_l2`), and L1's lineage record copied there
        (:func:`pipelines.train.ckpt.tiers.mirror_lineage`), once, before its first COMMIT there: every step on L2 is
        then committed by a term L2 records, of a line of training whose record L2 holds. Raises when L2 does not
        answer (the step stays behind)."""
        f = fence.active()
        if self.term_on_l2 and self.lineage_on_l2 or f is None:
            return
        fence.check("recording this attempt's term on L2", ckpt_tiers.tier_locations(self.spec, self.rel_root)["L2"])
        if not self.term_on_l2:  # the term first: a cutoff on L2 never names a term L2 does not record
            fence_l2.record(self.spec, self.rel_root, f.term, f.attempt, fence.launch_id())
            self.term_on_l2 = True
        ckpt_tiers.mirror_lineage(self.spec, self.rel_root)
        self.lineage_on_l2 = True

    def _catch_up_step(self, st: int, final: bool) -> None:
        """One step L2 lacks: its parts' manifests merged when every node's part is there, else the step put from
        its L1 copy (not the newest step, whose parts may still be on their way, unless ``final``)."""
        locs = ckpt_tiers.tier_locations(self.spec, f"{self.rel_root}/{ck.step_name(st)}")
        with self._reading(st):
            self._catch_up_pinned(st, final, locs)

    def _catch_up_pinned(self, st: int, final: bool, locs: dict) -> None:
        """:meth:`_catch_up_step` with ``st`` pinned against L0/L1 retention."""
        l1 = Path(locs["L1"])
        if not (l1 / ck.COMMIT).is_file():
            self.log(f"[ckpt] L2 catch-up: step {st} left L1 before L2 answered; skipped")
            self.l2_behind.discard(st)
            return
        man = ck.read_local_manifest(l1)
        if not history.accepts(self.rec, st, history.of(man), history.term_of(man)):  # queued under an older record
            self.log(f"[ckpt] L2 catch-up: step {st} is no longer a step of this line of training; skipped")
            self.l2_behind.discard(st)
            return
        try:
            merged = ckpt_parts.merge_parts_s3(self.spec, locs["L2"], int(man.get("parts", 1)), man.get("attempt"))
        except ck.L2Unavailable:
            raise
        except ck.CheckpointError as e:  # the parts on L2 do not match: the whole step from L1 instead
            self.log(f"[ckpt] L2 catch-up: step {st}: {e}; putting it from its L1 copy")
            merged = False
        if not merged and (self.topo.parts == 1 or final or st != max(self.l2_behind)):
            ckpt_parts.upload_step(self.spec, l1, locs["L2"])
            merged = True
        if merged:
            self.l2_behind.discard(st)

    def missing_on_l2(self) -> Optional[set[int]]:
        """Steps of this line globally committed on L1 that L2 would keep but does not hold; None when L2 does not
        answer (they are looked for again when it does, or at the next start)."""
        try:
            by_tier = ckpt_tiers.accepted_steps(self.spec, self.rel_root,
                                                ckpt_tiers.list_steps(self.spec, self.rel_root, ("L1", "L2")), self.rec,
                                                strict=True)
        except (ck.CheckpointError, OSError) as e:  # L2 or L1 did not answer: unknown, looked for again
            self.log(f"[ckpt] L2 catch-up: cannot compare L1 with L2 now ({e})")
            return None
        wanted = {s for s in by_tier["L1"] if self._l2_keeps(s)} | set(by_tier["L1"][-1:])
        return wanted - set(by_tier["L2"])

    def learn_missing(self) -> None:
        """The L2 thread: the steps L2 lacks join :attr:`l2_behind`, and only then L1 retention holds back just the
        steps waiting for L2 (:meth:`held_for_l2`; before, every step L2 would keep): under the retention's lock."""
        missing = self.missing_on_l2()
        if missing is not None:
            with self.pin:
                self.l2_behind |= missing
                self.l2_known = True

    def _l2_keeps(self, step: int) -> bool:
        return ckpt_tiers.l2_keeps(self.spec.checkpoint.l2_keep_every, step)

    def held_for_l2(self, l1_steps: Optional[list[int]] = None) -> set[int]:
        """The steps L1 retention keeps for L2 (``checkpoint.l1_hold_for_l2`` at most, the newest): those L2 would
        keep and has not got yet — waiting in the L2 thread or behind it; before L2 first said what it lacks in this
        run (a restart while it is down), every such step on L1 (``l1_steps``, listed when not given)."""
        if self.l2_thread is None or not self.commits:
            return set()
        if self.l2_known:
            waiting = self.l2_pending | self.l2_behind
        else:
            waiting = set(l1_steps if l1_steps is not None else ckpt_tiers.accepted_steps(
                self.spec, self.rel_root, ckpt_tiers.list_steps(self.spec, self.rel_root, ("L1",)), self.rec)["L1"])
        hold = self.spec.checkpoint.l1_hold_for_l2
        return set(sorted(s for s in waiting if self._l2_keeps(s))[-hold:]) if hold else set()

    def _dropped_for_l2(self, deleted: dict[str, list[int]]) -> None:
        """A warning and ``ckpt/l2_dropped`` for steps L2 would keep that L1 retention removed before L2 got them."""
        lost = sorted(s for s in deleted.get("L1", []) if self._l2_keeps(s) and s in self.l2_pending | self.l2_behind)
        if lost:
            self.events.add("ckpt/l2_dropped", len(lost), lost[-1])
            self.log(f"[ckpt] warning: L1 retention removed step(s) {lost} before L2 got them (L2 is "
                     f"{self.l2_waiting()} step(s) behind; checkpoint.l1_hold_for_l2="
                     f"{self.spec.checkpoint.l1_hold_for_l2} are kept for it)")

    def retain(self, step: int) -> dict[str, list[int]]:
        """L0/L1 retention after ``step`` (the L1 thread; L2's is :meth:`retain_l2`), never a step the L2 thread
        reads now, nor the L1 staging and L2 marks of a step still waiting for it: a node's L0 keeps every step
        newer than the newest global commit (it may still be needed to promote), and that one; L1 also keeps the
        steps L2 still needs (:meth:`held_for_l2`, bounded)."""
        c = ckpt_tiers
        with self.pin:
            reading, waiting = frozenset(self.reading), frozenset(self.l2_pending)
            if self.topo.parts == 1:
                deleted = c.prune(self.spec, self.rel_root, upto=step, tiers=("L0", "L1"), protect=reading,
                                  rec=self.rec, log=self.log, hold_l1=self.held_for_l2())
                c.drop_stale_staging(self.spec, self.rel_root, self.rec, keep=waiting)
                self._dropped_for_l2(deleted)
                return deleted
            committed = c.accepted_steps(self.spec, self.rel_root, c.list_steps(self.spec, self.rel_root, ("L1",)),
                                         self.rec)["L1"]
            protect = set(committed[-1:]) | reading  # the newest globally committed step keeps its part on every L0
            deleted = c.prune(self.spec, self.rel_root, upto=min(step, max(committed, default=-1)), tiers=("L0",),
                              protect=protect, rec=self.rec, log=self.log)
            if self.commits:
                deleted.update(c.prune(self.spec, self.rel_root, upto=step, tiers=("L1",), protect=reading,
                                       rec=self.rec, log=self.log, hold_l1=self.held_for_l2(committed)))
                c.drop_stale_staging(self.spec, self.rel_root, self.rec, keep=waiting)
                self._dropped_for_l2(deleted)
            return deleted

    def retain_at_close(self, step: int) -> None:
        """:meth:`retain` once the final step is committed: its failure (storage, a fence lost meanwhile) is a
        warning, never the run's (the next run's retention catches up; a superseded attempt is told at its release)."""
        try:
            deleted = self.retain(step)
        except Exception as e:  # noqa: BLE001 - housekeeping; the other ranks are already waiting in the release
            self.log(f"[ckpt] warning: retention at close did not finish ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}); the next run's retention catches up")
            return
        gone = ", ".join(f"{t} {v}" for t, v in deleted.items() if v)
        if gone:
            self.log(f"[ckpt] close: retention removed {gone}")

    def retain_l2(self, step: int) -> dict[str, list[int]]:
        """The committing rank's L2 retention after ``step`` (the L2 thread): skipped, with a line, when L2 does
        not answer."""
        if not self.commits:
            return {}
        return ckpt_tiers.prune(self.spec, self.rel_root, upto=step, tiers=("L2",), rec=self.rec, log=self.log)

    def _final_to_l2(self, step: int) -> None:
        """The committing rank's L2 thread at close, every step before handled: the final step on L2 (and any step
        L2 missed), or a warning (the ``promote`` stage puts it there when L2 answers)."""
        try:
            if self.done.get(step, {}).get("L2") != "committed":
                self.l2_behind.add(step)
            self.catch_up(final=True)
        except Exception as e:  # noqa: BLE001 - L1 holds it; the promote stage puts it on L2
            self.events.add("ckpt/l2_errors", 1, step)
            self.log(f"[ckpt] warning: the final step {step} is on L1 but not on L2 ({type(e).__name__}: "
                     f"{str(e).splitlines()[0]}); the promote stage uploads it when L2 answers")
