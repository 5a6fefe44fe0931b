"""In-run checkpointing: sharded DCP saves that block training only while the state is staged, a commit per
node's part, promotion L0 → L1 → L2 while training runs, and restore into a live (wrapped) model.

Every rank writes its own shards with ``torch.distributed.checkpoint`` (DCP) into a temp directory beside
the step's L0 place, over a gloo group of its own (so the background writer's collectives never meet the
training loop's). With ``checkpoint.async_mode=thread`` the state dict is copied into reused host buffers
(DCP's ``DefaultStager``; pinned on CUDA) and the write runs in a background thread; the next save waits for
the previous one. When DCP's save returns on any rank, every rank's shards are written (its finish step gathers
their results). Rank 0 has added ``trainer_state.json``, ``rng.json`` (every rank's RNG states, gathered, as
JSON), ``model_args.json`` and ``tokenizer.model``. Then each part leader (:class:`Topology`: every node's local
rank 0 with node-local L0, else rank 0 alone) hashes its node's files, writes MANIFEST + COMMIT and renames the
directory into place on its own L0 (:func:`pipelines.train.checkpoint.commit_local`), in its background thread.
Each leader's :class:`Promoter` then copies its part L0 → L1 → L2 and applies retention; rank 0 merges the
parts into the step's global commit. Restore is collective: :mod:`pipelines.train.restore`.
"""
from __future__ import annotations

import base64
import json
import os
import queue
import random
import shutil
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from pipelines.spec import JobSpec, resolve_path
from pipelines.train import checkpoint as ck


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict:
    """This rank's RNG states as plain JSON (``rng.json``): nothing of ours is ever unpickled from storage."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    st = {"python": [version, list(mt), gauss], "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
          "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        st["cuda"] = _b64(torch.cuda.get_rng_state())
    return st


def set_rng_state(st: dict) -> None:
    version, mt, gauss = st["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_tensor(st["torch"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(_tensor(st["cuda"]))


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


class Promoter:
    """A part leader's background thread: its part of each committed step L0 → L1 (→ L2 when an S3 endpoint
    answers), each copy verified, COMMIT last; global rank 0 also merges the parts into the step's global commit
    on L1 and L2. Then retention (``checkpoint.prune``): each node on its own L0, rank 0 on L1 and L2. With one part,
    a step that L2 retention would not keep is passed over for a newer one when the promoter falls behind."""

    def __init__(self, spec: JobSpec, rel_root: str, log: Callable[[str], None], events: Events, topo: Topology):
        self.spec, self.rel_root, self.log, self.events, self.topo = spec, rel_root, log, events, topo
        self.no_l2 = ck.l2_available(spec)
        if self.no_l2:
            log(f"[ckpt] promotion during the run goes to L1 only: {self.no_l2.splitlines()[0]}")
        self.tiers = ("L1",) if self.no_l2 else ("L1", "L2")
        self.done: dict[int, dict] = {}
        self.seconds: dict[int, float] = {}  # step → seconds to promote it (rank 0: until its global commit)
        self.submitted: set[int] = set()
        self.q: "queue.Queue[Optional[int]]" = queue.Queue()
        self.thread = threading.Thread(target=self._work, daemon=True, name="llmp-promoter")
        self.thread.start()

    def submit(self, step: int) -> None:
        self.submitted.add(step)
        self.q.put(step)

    def idle(self) -> None:
        """Block until every submitted step is handled (a rollback restores with no promotion in flight)."""
        self.q.join()

    def drain(self) -> None:
        self.q.put(None)
        self.thread.join()

    def _work(self) -> None:
        lower_priority()
        every = self.spec.checkpoint.l2_keep_every
        while (step := self.q.get()) is not None:
            try:
                if self.topo.parts == 1 and not self.q.empty() and every and step % every:
                    self.log(f"[ckpt] promote: step {step} passed over for a newer one (not kept at L2)")
                    continue
                self._promote(step)
            except Exception as e:  # noqa: BLE001 - training goes on; the promote stage retries the final step
                self.events.add("ckpt/promote_errors", 1, step)
                self.log(f"[ckpt] promote: step {step} failed: {e}")
            finally:
                self.q.task_done()
        self.q.task_done()

    def _promote(self, step: int) -> None:
        rel = f"{self.rel_root}/{ck.step_name(step)}"
        t0 = time.perf_counter()
        if self.topo.parts == 1:
            rep = ck.promote(self.spec, rel, self.tiers)
        else:
            rep = ck.promote_part(self.spec, rel, self.tiers)
            if self.topo.rank == 0:
                self._merge(rel, step)
                rep["actions"]["merged"] = list(self.tiers)
        dt = time.perf_counter() - t0
        self.done[step] = rep["actions"]
        self.seconds[step] = dt
        self.events.add("ckpt/promote_s", dt, step)
        deleted = self.retain(step)
        gone = ", ".join(f"{t} {v}" for t, v in deleted.items() if v)
        self.log(f"[ckpt] promote: step {step} {rep['actions']} in {dt:.2f} s" + (f"; retention removed {gone}" if gone else ""))

    def _merge(self, rel: str, step: int) -> None:
        """Rank 0: wait for every node's part on L1 (and L2), then write the step's global COMMIT there."""
        locs = ck.tier_locations(self.spec, rel)
        _, parts, attempt = ck.part_of(ck.read_local_manifest(Path(locs["L0"])))
        pending = {"L1": lambda: ck.merge_parts(Path(locs["L1"]), parts, attempt),
                   "L2": lambda: ck.merge_parts_s3(self.spec, locs["L2"], parts, attempt)}
        pending = {t: f for t, f in pending.items() if t in self.tiers}
        deadline = time.monotonic() + self.spec.checkpoint.collective_timeout_minutes * 60
        while pending:
            pending = {t: f for t, f in pending.items() if not f()}
            if pending and time.monotonic() > deadline:
                raise ck.CheckpointError(f"step {step}: parts missing on {sorted(pending)} after "
                                         f"checkpoint.collective_timeout_minutes; not committed there")
            time.sleep(0.05 if pending else 0)

    def retain(self, step: int) -> dict[str, list[int]]:
        """Retention after ``step``: a node's L0 keeps every step newer than the newest global commit (it may
        still be needed to promote), and that one."""
        if self.topo.parts == 1:
            return ck.prune(self.spec, self.rel_root, upto=step, tiers=("L0",) + self.tiers)
        committed = ck.list_steps(self.spec, self.rel_root, ("L1",))["L1"]
        protect = set(committed[-1:])  # the newest globally committed step keeps its part on every L0
        deleted = ck.prune(self.spec, self.rel_root, upto=min(step, max(committed, default=-1)), tiers=("L0",),
                           protect=protect)
        if self.topo.rank == 0:
            deleted.update(ck.prune(self.spec, self.rel_root, upto=step, tiers=self.tiers))
            ck.drop_stale_staging(self.spec, self.rel_root)
        return deleted


class Checkpointer:
    """Saves and restores this run's checkpoints under ``checkpoint.l0/<rel_root>`` (each node's own disk, or one
    shared filesystem). Every rank calls :meth:`save`, :meth:`wait`, :meth:`restore` and :meth:`load` at the
    same steps."""

    def __init__(self, spec: JobSpec, rel_root: str, rank: int, world: int, log: Callable[[str], None],
                 files: dict[str, bytes]):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.spec, self.rel_root, self.rank, self.world, self.log, self.files = spec, rel_root, rank, world, log, files
        self.root = resolve_path(spec.checkpoint.l0) / rel_root
        self.pg = dist.new_group(backend="gloo")  # the background writer's collectives, apart from training's
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))
        self.events = Events()
        self.attempt = self._new_attempt()
        self.topo = Topology.detect(rank, world, self.root, self.attempt)
        if self.topo.parts > 1:
            log(f"[ckpt] L0 is node-local: {self.topo.parts} nodes each commit and promote their own part")
        lead = self.topo.leader
        self.bg = ThreadPoolExecutor(1, thread_name_prefix="llmp-commit", initializer=lower_priority) if lead else None
        # every leader has one: the final step always reaches L1 (a pod's node-local disk may not outlive the job);
        # checkpoint.promote_during_run decides whether the steps before it go too
        self.node_log = log if rank == 0 else _node_log(self.topo)  # other nodes' leaders log too, naming the node
        self.promoter = Promoter(spec, rel_root, self.node_log, self.events, self.topo) if lead else None
        self._pending: Optional[Future] = None
        self.last_saved: Optional[int] = None
        self.stalls: list[float] = []

    def _new_attempt(self) -> str:
        """A name every rank agrees on for this attempt's temp dirs; each node's local rank 0 clears those of dead
        attempts on its own L0."""
        box = [uuid.uuid4().hex[:8] if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if int(os.environ.get("LOCAL_RANK", self.rank)) == 0 and self.root.is_dir():
            for stale in [*self.root.glob(".step-*.tmp-*"), *self.root.glob(".view-*")]:
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        return box[0]

    def path(self, step: int) -> Path:
        return self.root / ck.step_name(step)

    def save(self, step: int, model, opt, state: dict) -> float:
        """Checkpoint ``step``; returns the seconds training was blocked (the stall)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        self.wait()
        tmp = self.root / f".{ck.step_name(step)}.tmp-{self.attempt}"
        rngs = [None] * self.world if self.rank == 0 else None
        dist.gather_object(rng_state(), rngs, dst=0)
        if self.rank == 0:
            self._write_small_files(tmp, state, rngs)
        msd, osd = get_state_dict(model, opt)
        if self.spec.checkpoint.async_mode == "sync":
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp), process_group=self.pg)
            written: Future = Future()
            written.set_result(None)
        else:
            written = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(tmp), process_group=self.pg,
                                     async_stager=self.stager)
        self.last_saved = step
        self._pending = self.bg.submit(self._commit, step, tmp, written, t0) if self.topo.leader else written
        if self.spec.checkpoint.async_mode == "sync":
            self.wait()  # the write, the hashing and the COMMIT all block training
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.events.add("ckpt/stall_s", stall, step)
        self.log(f"[ckpt] step {step}: training blocked {stall * 1000:.0f} ms ({self.spec.checkpoint.async_mode} save)")
        return stall

    def _write_small_files(self, tmp: Path, state: dict, rngs: list) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        (tmp / "rng.json").write_text(json.dumps(rngs))
        for name, data in self.files.items():
            (tmp / name).write_bytes(data)

    def _commit(self, step: int, tmp: Path, written: Future, t0: float) -> None:
        """This node's part (every part's writes are done once DCP's save returns on any rank): hash, MANIFEST,
        COMMIT, rename into place on this node's L0."""
        written.result()
        tmp.mkdir(parents=True, exist_ok=True)  # a node whose ranks had nothing to write
        if self.topo.parts == 1:
            missing = ck.missing_shards(tmp)
            if missing:
                raise ck.CheckpointError(f"step {step}: shard(s) {missing} are not in {tmp}, yet every rank sees "
                                         "this L0 (probed at start); a rank wrote elsewhere")
        ck.commit_local(tmp, self.path(step), meta={"step": step, "format": "dcp", "world_size": self.world,
                                                    "part": self.topo.part, "parts": self.topo.parts,
                                                    "attempt": self.attempt})
        save_s = time.perf_counter() - t0
        self.events.add("ckpt/save_s", save_s, step)
        self.log(f"[ckpt] step {step}: committed to L0 {save_s:.2f} s after the save began")
        if self.promoter is not None and self.spec.checkpoint.promote_during_run:
            self.promoter.submit(step)

    def wait(self) -> None:
        """Block until the save in flight is written (a part leader: and committed on its L0)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def restore(self, step: Optional[int] = None):
        """Collective: the newest restorable step (or exactly ``step``), each node's parts from its nearest
        verified tier; see :mod:`pipelines.train.restore`."""
        from pipelines.train.restore import restore

        self.wait()
        if self.promoter is not None:
            self.promoter.idle()
        return restore(self, step)

    def load(self, path: str | Path, model, opt) -> dict:
        """Restore model + optimizer (DCP reshards to this world's layout) and, when the world size is the one
        that saved, this rank's RNG states; returns the trainer state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        self.wait()
        path = Path(path)
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path), process_group=self.pg)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        rngs = json.loads((path / "rng.json").read_text())
        if len(rngs) == self.world:
            set_rng_state(rngs[self.rank])
        elif self.rank == 0:
            self.log(f"[ckpt] saved by {len(rngs)} ranks, restored on {self.world}: RNG states start fresh")
        state = json.loads((path / "trainer_state.json").read_text())
        dist.barrier(group=self.pg)
        if path.name.startswith(".view-") and self.topo.local_rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # the links of a restore view: read by every rank now
        return state

    def close(self, final_step: Optional[int]) -> None:
        """Finish the save in flight, make sure the final step is promoted (with node-local L0: globally committed
        on L1, since a node's disk may not outlive the job), wait for the promoter."""
        self.wait()
        if self.promoter is not None:
            if final_step is not None and final_step not in self.promoter.submitted:
                self.promoter.submit(final_step)
            self.promoter.drain()
        if self.topo.parts > 1 and final_step is not None:
            dist.barrier(group=self.pg)  # rank 0 has merged the final step: every node's L0 window can move on
            if self.promoter is not None:
                self.promoter.retain(final_step)
        if self.bg is not None:
            self.bg.shutdown()
        self.stager.close()


def _node_log(topo: Topology) -> Callable[[str], None]:
    """Other nodes' leaders log too (their promotion and restore), each line naming its node."""
    return lambda m: print(f"[node {topo.node}] {m}", flush=True)
