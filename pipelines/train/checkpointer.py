"""In-run checkpointing: sharded DCP saves that block training only while the state is staged, a commit on
rank 0, promotion L0 → L1 → L2 while training runs, and restore into a live (wrapped) model.

Every rank writes its own shards with ``torch.distributed.checkpoint`` (DCP) into a temp directory beside
the step's L0 place, over a gloo group of its own (so the background writer's collectives never meet the
training loop's). With ``checkpoint.async_mode=thread`` the state dict is copied into reused host buffers
(DCP's ``DefaultStager``; pinned on CUDA) and the write runs in a background thread; the next save waits for
the previous one. When rank 0's write returns, every rank's shards are written (DCP's finish step gathers
their results), so rank 0 adds ``trainer_state.json``, ``rng.pt`` (every rank's RNG states, gathered),
``model_args.json`` and ``tokenizer.model``, then hashes all files, writes MANIFEST + COMMIT and renames the
directory into place (:func:`pipelines.train.checkpoint.commit_local`), in its background thread. The
:class:`Promoter` (rank 0, one thread) then copies each committed step L0 → L1 → L2 and applies retention.
"""
from __future__ import annotations

import json
import os
import queue
import random
import shutil
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from pipelines.spec import JobSpec, resolve_path
from pipelines.train import checkpoint as ck


def rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


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
    """Rank 0's background thread: each committed step L0 → L1 (→ L2 when an S3 endpoint answers), each copy
    verified, COMMIT last; then retention (``checkpoint.prune``). When it falls behind, a step that L2
    retention would not keep is passed over for the newer one."""

    def __init__(self, spec: JobSpec, rel_root: str, log: Callable[[str], None], events: Events):
        self.spec, self.rel_root, self.log, self.events = spec, rel_root, log, events
        self.no_l2 = ck.l2_available(spec)
        if self.no_l2:
            log(f"[ckpt] promotion during the run goes to L1 only: {self.no_l2.splitlines()[0]}")
        self.tiers = ("L1",) if self.no_l2 else ("L1", "L2")
        self.done: dict[int, dict] = {}
        self.submitted: set[int] = set()
        self.q: "queue.Queue[Optional[int]]" = queue.Queue()
        self.thread = threading.Thread(target=self._work, daemon=True, name="llmp-promoter")
        self.thread.start()

    def submit(self, step: int) -> None:
        self.submitted.add(step)
        self.q.put(step)

    def drain(self) -> None:
        self.q.put(None)
        self.thread.join()

    def _work(self) -> None:
        lower_priority()
        every = self.spec.checkpoint.l2_keep_every
        while (step := self.q.get()) is not None:
            if not self.q.empty() and every and step % every:
                self.log(f"[ckpt] promote: step {step} passed over for a newer one (not kept at L2)")
                continue
            try:
                self._promote(step)
            except Exception as e:  # noqa: BLE001 - training goes on; the promote stage retries the final step
                self.events.add("ckpt/promote_errors", 1, step)
                self.log(f"[ckpt] promote: step {step} failed: {e}")

    def _promote(self, step: int) -> None:
        rel = f"{self.rel_root}/{ck.step_name(step)}"
        t0 = time.perf_counter()
        rep = ck.promote(self.spec, rel, self.tiers)
        dt = time.perf_counter() - t0
        self.done[step] = rep["actions"]
        self.events.add("ckpt/promote_s", dt, step)
        deleted = ck.prune(self.spec, self.rel_root, upto=step, tiers=("L0",) + self.tiers)
        gone = ", ".join(f"{t} {v}" for t, v in deleted.items() if v)
        self.log(f"[ckpt] promote: step {step} {rep['actions']} in {dt:.2f} s" + (f"; retention removed {gone}" if gone else ""))


class Checkpointer:
    """Saves and restores this run's checkpoints under ``checkpoint.l0/<rel_root>``. Every rank calls
    :meth:`save`, :meth:`wait` and :meth:`load` at the same steps."""

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
        self.bg = ThreadPoolExecutor(1, thread_name_prefix="llmp-commit", initializer=lower_priority) \
            if rank == 0 else None
        self.promoter = Promoter(spec, rel_root, log, self.events) \
            if rank == 0 and spec.checkpoint.promote_during_run else None
        self._pending: Optional[Future] = None
        self.last_saved: Optional[int] = None
        self.stalls: list[float] = []
        self.attempt = self._new_attempt()

    def _new_attempt(self) -> str:
        """A name every rank agrees on for this attempt's temp dirs; rank 0 clears those of dead attempts."""
        box = [uuid.uuid4().hex[:8] if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if self.rank == 0 and self.root.is_dir():
            for stale in self.root.glob(".step-*.tmp-*"):
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
        self._pending = self.bg.submit(self._commit, step, tmp, written, t0) if self.rank == 0 else written
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
        torch.save(rngs, tmp / "rng.pt")
        for name, data in self.files.items():
            (tmp / name).write_bytes(data)

    def _commit(self, step: int, tmp: Path, written: Future, t0: float) -> None:
        written.result()
        missing = ck.missing_shards(tmp)
        if missing:
            raise ck.CheckpointError(f"step {step}: shard(s) {missing} are not in {tmp}; every rank must write where rank 0 "
                                     "commits (put checkpoint.l0 on a filesystem that all ranks of the job share)")
        ck.commit_local(tmp, self.path(step), meta={"step": step, "format": "dcp", "world_size": self.world})
        save_s = time.perf_counter() - t0
        self.events.add("ckpt/save_s", save_s, step)
        self.log(f"[ckpt] step {step}: committed to L0 {save_s:.2f} s after the save began")
        if self.promoter is not None:
            self.promoter.submit(step)

    def wait(self) -> None:
        """Block until the save in flight is written (rank 0: and committed)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

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
        rngs = torch.load(path / "rng.pt", weights_only=False)
        if len(rngs) == self.world:
            set_rng_state(rngs[self.rank])
        elif self.rank == 0:
            self.log(f"[ckpt] saved by {len(rngs)} ranks, restored on {self.world}: RNG states start fresh")
        return json.loads((path / "trainer_state.json").read_text())

    def close(self, final_step: Optional[int]) -> None:
        """Finish the save in flight, make sure the final step is promoted, wait for the promoter."""
        self.wait()
        if self.promoter is not None:
            if final_step is not None and final_step not in self.promoter.submitted:
                self.promoter.submit(final_step)
            self.promoter.drain()
        if self.bg is not None:
            self.bg.shutdown()
        self.stager.close()
