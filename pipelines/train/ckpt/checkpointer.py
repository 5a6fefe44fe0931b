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
directory into place on its own L0 (:func:`pipelines.train.ckpt.local.commit_local`), in its background thread.
Each leader's :class:`Promoter` then copies its part L0 → L1 (rank 0 merges the parts into the step's global
commit) and, in a thread of its own that L1 never waits for, to L2; each tier's retention follows its copy. Restore is
collective: :mod:`pipelines.train.ckpt.restore`.
"""
from __future__ import annotations

import base64
import contextlib
import datetime
import json
import os
import random
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from pipelines.spec import JobSpec, resolve_path
from pipelines.storage import faults
from pipelines.train.ckpt import dcp_read, fence, fence_l2, history, local as ckpt_local, protocol as ck
from pipelines.train.ckpt import tiers as ckpt_tiers
from pipelines.train.ckpt.promoter import Events, Promoter, Topology, lower_priority

KERNEL_KEYS = ("fused", "foreach")  # optimizer options a restore keeps as this run built them


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


@contextlib.contextmanager
def dcp_errors(what: str, where: Path):
    """DCP wraps a rank's failure in ``CheckpointException``, a ``BaseException`` that every ``except Exception``
    lets through (a traceback, exit 1): here it becomes one line naming the tier's path and the first rank's error,
    a :class:`~pipelines.train.ckpt.protocol.TierUnavailable` for an ``OSError`` (ENOSPC, EIO, EROFS: the disk, exit
    75), else a :class:`~pipelines.train.ckpt.protocol.CheckpointError`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = sorted(e.failures.items(), key=lambda kv: kv[0])
        rank, (exc, _) = failures[0] if failures else (None, (e, None))
        line = f"{what} {where}: rank {rank}: {type(exc).__name__}: {exc}".replace("\n", " ")
        free = free_bytes(where)
        full = free is not None and free < DISK_FULL_BYTES  # torch's writer reports ENOSPC as "unexpected pos"
        if full:
            line += f" (no space left on the device: {free:,} bytes free)"
        raise (ck.TierUnavailable if isinstance(exc, OSError) or full else ck.CheckpointError)(line) from None


PROMOTE_HUNG = 2  # × train.hang_timeout_s beyond the collective timeout: an L1 promotion busy longer is hung
DISK_FULL_BYTES = 16 << 20  # less free space than this after a failed write: the disk is full


def free_bytes(where: Path) -> Optional[int]:
    """Free bytes on the filesystem of ``where`` (its nearest existing ancestor); None when that cannot be read."""
    p = Path(where)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def keeping_kernels(opt: torch.optim.Optimizer, osd: dict) -> dict:
    """``osd``, an optimizer state dict about to be loaded into ``opt``, with each group's ``fused``/``foreach`` set to
    how ``opt`` steps as this run built it: the saver's may not fit this run (the fused kernel cannot take the
    DTensors and plain tensors that a resharded world may mix), an older checkpoint would slow this one down, and
    torch places each parameter's ``step`` (on its device or the CPU) by the loaded group's ``fused``."""
    for mine, saved in zip(opt.param_groups, osd.get("param_groups", [])):
        saved.update({k: mine.get(k) for k in KERNEL_KEYS})
    return osd


def new_stager():
    """DCP's stager: the state copied into host buffers (pinned, copied without blocking, on a GPU)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=cuda))


class Checkpointer:
    """Saves and restores this run's checkpoints under ``checkpoint.l0/<rel_root>`` (each node's own disk, or one
    shared filesystem). Every rank calls :meth:`save`, :meth:`wait`, :meth:`restore` and :meth:`load` at the
    same steps."""

    def __init__(self, spec: JobSpec, rel_root: str, rank: int, world: int, log: Callable[[str], None],
                 files: dict[str, bytes]):
        self.spec, self.rel_root, self.rank, self.world, self.log, self.files = spec, rel_root, rank, world, log, files
        self.root = resolve_path(spec.checkpoint.l0) / rel_root
        self.wait_s = spec.checkpoint.collective_timeout_minutes * 60  # the bound of every wait below
        # the background writer's collectives, apart from training's, bounded like them
        self.pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.wait_s))
        self.rec: Optional[dict] = None  # this line of training (pipelines.train.ckpt.history), set by the trainer
        self.stager = new_stager()
        self.stager_per_save = False  # set when the stager cannot reuse its buffers (torch 2.11)
        self.stager_used = False
        self.events = Events()
        self.fence: Optional[fence.Fence] = None  # this attempt's term on L1 (pipelines.train.ckpt.fence)
        self.attempt = self._new_attempt()
        self.topo = Topology.detect(rank, world, self.root, self.attempt)
        if self.topo.parts > 1:
            log(f"[ckpt] L0 is node-local: {self.topo.parts} nodes each commit and promote their own part")
        lead = self.topo.leader
        self.bg = ThreadPoolExecutor(1, thread_name_prefix="llmp-commit", initializer=lower_priority) if lead else None
        # every leader has one: the final step always reaches L1 (a pod's node-local disk may not outlive the job);
        # checkpoint.promote_during_run decides whether the steps before it go too
        self.node_log = log if rank == 0 else _node_log(self.topo)  # other nodes' leaders log too, naming the node
        self.promoter: Optional[Promoter] = None
        if lead:
            self.promoter = Promoter(spec, rel_root, self.node_log, self.events, self.topo, self.attempt)
        self._pending: Optional[Future] = None
        self.last_saved: Optional[int] = None
        self.stalls: list[float] = []

    def _async_save(self, sd: dict, tmp: Path) -> Future:
        """DCP's async save through the stager (host buffers reused from save to save). torch 2.11's stager fails
        on its second ``stage`` (``KeyError: <class 'type'>``, seen on an H100): then a new stager for every save,
        with a warning, rather than a run that fails at every second checkpoint."""
        import torch.distributed.checkpoint as dcp

        if self.stager_per_save:
            self.stager.close()
            self.stager = new_stager()
        try:
            written = dcp.async_save(sd, checkpoint_id=str(tmp), process_group=self.pg, async_stager=self.stager)
            self.stager_used = True
            return written
        except KeyError as e:
            if self.stager_per_save or not self.stager_used:  # the bug's signature: a stager that staged before
                raise
            self.log(f"[ckpt] warning: DCP's stager cannot reuse its buffers ({type(e).__name__}: {e}; torch "
                     f"{torch.__version__}); a new stager for each save from now on")
            self.events.add("ckpt/stager_rebuilt", 1, self.last_saved or 0)
            self.stager_per_save = True
            return self._async_save(sd, tmp)

    def _new_attempt(self) -> str:
        """A name every rank agrees on for this attempt's temp dirs, and its term on L1 (:mod:`pipelines.train.ckpt.fence`:
        global rank 0 takes it, every rank installs it for its process); then each node's local rank 0 clears the
        temp dirs on its own L0 of attempts that are gone (their lease expired: a live attempt's stay)."""
        box = [self._take_term() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        attempt, term, why, stop = box[0]
        if why is not None:  # every rank stops with rank 0's reason: storage that failed or did not answer (75),
            raise stop(why)  # a superseded launch (FencedOut), L2 refusing these credentials (L2Refused: 2)
        lease_s = self.spec.checkpoint.lease_s
        d = fence.fence_dir(self.spec, self.rel_root)
        if self.fence is None:
            self.fence = fence.Fence(d, attempt, term, lease_s, self._fenced_roots(), self.log)
            self.fence.start_watching()  # the lease's age is known at this rank's next check, however late
        fence.install(self.fence)
        if int(os.environ.get("LOCAL_RANK", self.rank)) == 0 and self.root.is_dir():
            leases = fence.read_leases(d)
            for stale in [*self.root.glob(".step-*.tmp-*"), *self.root.glob(".view-*")]:
                if fence.removable(stale, leases, lease_s):
                    shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        return attempt

    def _fenced_roots(self) -> tuple[str, ...]:
        """This run's directory on each tier (L0, L1, the L2 prefix): what its fence guards."""
        return tuple(ckpt_tiers.tier_locations(self.spec, self.rel_root).values())

    def _take_term(self) -> tuple[str, Optional[int], Optional[str], Optional[type]]:
        """Global rank 0: (a new attempt id, the term it took and renews, None, None), or (…, None, why not, the error
        every rank stops with: ``FencedOut`` for a superseded launch, ``L2Refused`` where L2 refuses these credentials,
        else ``TierUnavailable``)."""
        attempt = uuid.uuid4().hex[:8]
        d = fence.fence_dir(self.spec, self.rel_root)
        try:
            return self._take_term_in(d, attempt)
        except Exception as e:  # noqa: BLE001 - any failure is every rank's reason (none waits in the broadcast)
            return attempt, None, f"cannot take this attempt's term: {type(e).__name__}: {e}", ck.TierUnavailable

    def _take_term_in(self, d: Path, attempt: str) -> tuple[str, Optional[int], Optional[str], Optional[type]]:
        try:
            # above L2's terms (a new L1), every term a cutoff of the line names and every term that wrote a record
            # (a lost .fence: a term taken again below a cutoff would make this attempt's own steps an older term's,
            # counted nowhere; below a record, its own record would not be the one read)
            on_l1 = ckpt_tiers.key_on_l1(self.spec, self.rel_root)  # before the take makes the run's directory
            floor = max(fence_l2.floor(self.spec, d, self.rel_root, self.log),
                        history.top_term(ckpt_tiers.read_lineage(self.spec, self.rel_root)),
                        history.top_record_term(self.spec, self.rel_root))
            self.fence = fence.Fence.take(d, attempt, self.spec.checkpoint.lease_s, self._fenced_roots(), self.log,
                                          fence.launch_id(), floor)
        except fence.FencedOut as e:
            return attempt, None, str(e), fence.FencedOut
        except ck.L2Refused as e:  # no retry mends it
            return attempt, None, f"L1 holds no record of this run's terms and L2, which does, refused: {e}", \
                ck.L2Refused
        except ck.L2Unavailable as e:
            return attempt, None, f"L1 holds no record of this run's terms and L2, which does, did not answer: {e}", \
                ck.TierUnavailable
        except (OSError, ck.CheckpointError) as e:
            return attempt, None, f"checkpoint.l1: cannot take this attempt's term: {e}", ck.TierUnavailable
        # after the take: a retirement deletes the fence only once the record says so, so a term taken in a fence it
        # had removed is seen here (a zombie restart of a replaced generation would start at term 1 there again)
        try:
            gone = ckpt_tiers.retired(self.spec, self.rel_root, on_l1)
        except Exception as e:  # noqa: BLE001 - L1 or L2 did not answer, a record that is not one: later (75)
            self._withdraw(d)
            return attempt, None, f"the record of this key's generations cannot be read: {type(e).__name__}: {e}", \
                ck.L2Refused if isinstance(e, ck.L2Refused) else ck.TierUnavailable
        if gone is not None:
            self._withdraw(d)
            return attempt, None, f"[fence] {gone}", fence.FencedOut
        self.fence.start_renewing()
        self.log(f"[fence] attempt {attempt} holds term {self.fence.term} (lease checkpoint.lease_s="
                 f"{self.spec.checkpoint.lease_s:g} s)")
        return attempt, self.fence.term, None, None

    def _withdraw(self, d: Path) -> None:
        """Rank 0, refused after taking its term: its lease goes; its term stays, leaseless, where an older term is
        there (it supersedes an attempt that may still run: taking it back would let that one commit again), else it
        goes too, with the fence directory and the run's L1 directory it made where nothing else is in them."""
        f, self.fence = self.fence, None
        f.release(give_back=False)
        with contextlib.suppress(OSError):  # L1 failing: what stays is a term whose lease nobody renews
            (d / f"{fence.LEASE_PREFIX}{f.attempt}").unlink(missing_ok=True)
            if set(fence.read_terms(d)) == {f.term}:
                (d / f"{fence.TERM_PREFIX}{f.term:09d}").unlink()
                (d / fence.FLOOR_FILE).unlink(missing_ok=True)
                d.rmdir()
                d.parent.rmdir()

    def fence_info(self) -> dict:
        """This attempt and its term (the train stage checks at the end that no newer term superseded it)."""
        return {"attempt": self.attempt, "term": self.fence.term if self.fence is not None else None}

    def path(self, step: int) -> Path:
        return self.root / ck.step_name(step)

    def set_lineage(self, rec: Optional[dict]) -> None:
        """Every rank: the line of training the steps belong to (their manifests record it; restore and retention
        count only its steps). The committing rank's L2 thread also looks for the steps L2 still lacks (a restart
        forgets nothing L2 missed before it), in the background: a hung L2 holds up no start."""
        self.rec = rec
        if self.promoter is not None:
            self.promoter.rec = rec
            self.promoter.lineage_on_l2 = False  # L1's record copied on L2 again before the next COMMIT there
            self.promoter.check_l2()

    def save(self, step: int, model, opt, state: dict) -> float:
        """Checkpoint ``step``; returns the seconds training was blocked (the stall)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        self.wait()
        self.check_promotion()
        fence.check(f"saving step {step}", self.root)  # every rank: a superseded attempt saves nothing more
        tmp = self.root / f".{ck.step_name(step)}.tmp-{self.attempt}"
        rngs = [None] * self.world if self.rank == 0 else None
        dist.gather_object(rng_state(), rngs, dst=0)
        if self.rank == 0:
            self._write_small_files(tmp, state, rngs)
        msd, osd = get_state_dict(model, opt)
        with dcp_errors(f"saving step {step} to L0", tmp):
            if self.spec.checkpoint.async_mode == "sync":
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp), process_group=self.pg)
                written: Future = Future()
                written.set_result(None)
            else:
                written = self._async_save({"model": msd, "optim": osd}, tmp)
        self.last_saved = step
        self._pending = self.bg.submit(self._commit, step, tmp, written, t0) if self.topo.leader else written
        if self.spec.checkpoint.async_mode == "sync":
            self.wait()  # the write, the hashing and the COMMIT all block training
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.events.add("ckpt/stall_s", stall, step)
        self.log(f"[ckpt] step {step}: training blocked {stall * 1000:.0f} ms ({self.spec.checkpoint.async_mode} save)")
        return stall

    def check_promotion(self) -> None:
        """A hung L1 promotion thread (a stalled L1 call: nothing would reach L1 again while L0 fills, its retention
        running there) is found at the next save: busy on one step past its bound, :meth:`promote_bound_s` (the
        longest wait it makes, for another node's part, plus :data:`PROMOTE_HUNG` × ``train.hang_timeout_s`` for its
        own copy and retention), :class:`~pipelines.train.ckpt.protocol.TierUnavailable` on every rank (exit 75; the
        restart resumes from the newest step that verifies, L0's own included)."""
        t = torch.tensor([self.promoter.busy_for() if self.promoter is not None else 0.0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)  # every rank stops together, none waits alone
        busy, bound = float(t.item()), self.promote_bound_s()
        if busy > bound:
            raise ck.TierUnavailable(f"L1 promotion has been busy with one step for {busy:.0f} s (more than its "
                                     f"bound, {bound:g} s: checkpoint.collective_timeout_minutes + {PROMOTE_HUNG} × "
                                     f"train.hang_timeout_s): L1 {self.spec.checkpoint.l1} stalls")

    def promote_bound_s(self) -> float:
        return self.wait_s + PROMOTE_HUNG * self.spec.train.hang_timeout_s

    def _write_small_files(self, tmp: Path, state: dict, rngs: list) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        (tmp / "rng.json").write_text(json.dumps(rngs))
        for name, data in self.files.items():
            (tmp / name).write_bytes(data)

    def _commit(self, step: int, tmp: Path, written: Future, t0: float) -> None:
        """This node's part (every part's writes are done once DCP's save returns on any rank): hash, MANIFEST,
        COMMIT, rename into place on this node's L0."""
        with dcp_errors(f"saving step {step} to L0", tmp):
            written.result()
        tmp.mkdir(parents=True, exist_ok=True)  # a node whose ranks had nothing to write
        if self.topo.parts == 1:
            missing = ckpt_local.missing_shards(tmp)
            if missing:
                raise ck.CheckpointError(f"step {step}: shard(s) {missing} are not in {tmp}, yet every rank sees "
                                         "this L0 (probed at start); a rank wrote elsewhere")
        meta = {"step": step, "format": "dcp", "world_size": self.world, "part": self.topo.part,
                "parts": self.topo.parts, "attempt": self.attempt, "term": self.fence.term}
        if self.rec is not None:
            meta["lineage"] = self.rec["lineage"]
        ckpt_local.commit_local(tmp, self.path(step), meta=meta)
        faults.point("part_committed")
        save_s = time.perf_counter() - t0
        self.events.add("ckpt/save_s", save_s, step)
        self.log(f"[ckpt] step {step}: committed to L0 {save_s:.2f} s after the save began")
        if self.promoter is not None and self.spec.checkpoint.promote_during_run:
            self.promoter.submit(step)

    def wait(self) -> None:
        """Block until the save in flight is written (a part leader: and committed on its L0), for at most
        ``checkpoint.collective_timeout_minutes`` (the bound of every wait here): a save still not done by then is a
        disk that stalls, :class:`~pipelines.train.ckpt.protocol.TierUnavailable` (exit 75), not a wait forever."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            with dcp_errors(f"saving step {self.last_saved} to L0", self.root):
                try:
                    pending.result(timeout=self.wait_s)
                except FutureTimeout:
                    raise ck.TierUnavailable(f"saving step {self.last_saved} to L0 {self.root} did not finish within "
                                             f"checkpoint.collective_timeout_minutes ({self.wait_s / 60:g} min)"
                                             ) from None

    def restore(self, step: Optional[int] = None):
        """Collective: the newest restorable step (or exactly ``step``), each node's parts from its nearest
        verified tier; see :mod:`pipelines.train.ckpt.restore`."""
        from pipelines.train.ckpt.restore import restore

        self.wait()
        if self.promoter is not None:
            self.promoter.idle(self.wait_s)
        return restore(self, step)

    def load(self, path: str | Path, model, opt) -> dict:
        """Restore model + optimizer (DCP reshards to this world's layout) and, when the world size is the one
        that saved, this rank's RNG states; returns the trainer state."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        self.wait()
        path = Path(path)
        msd, osd = get_state_dict(model, opt)
        with dcp_errors("loading", path):  # nothing in the copy runs code (dcp_read)
            dcp_read.load({"model": msd, "optim": osd}, path, process_group=self.pg)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=keeping_kernels(opt, osd))
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
        """Finish the save in flight and the promotions; the final step must be globally committed on L1 (a node's
        disk may not outlive the job): one more try when it is not, then :class:`CheckpointError` on every rank
        with the reason, never an exit 0 without it. L2 gets it too when it answers, waited for at most half of
        ``checkpoint.collective_timeout_minutes`` (else a warning: never a failure for L2). A superseded
        attempt (:mod:`pipelines.train.ckpt.fence`) raises :class:`~pipelines.train.ckpt.fence.FencedOut` instead. Done, it
        releases its fence (:meth:`_release`)."""
        local = None  # this rank's own failure (type, message), shared below: no rank waits alone in a collective
        try:
            fence.check("closing the run's checkpoints", self.root)
            self.wait()
            if self.promoter is not None:
                if final_step is not None and final_step not in self.promoter.submitted:
                    self.promoter.submit(final_step)
                self.promoter.drain(self.wait_s)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            local = (type(e).__name__, str(e))
        self._raise_if_any_rank_failed(local, "saving the final checkpoint failed")
        if final_step is not None:
            why = self._final_on_l1(final_step)
            if why is not None:
                self.log(f"[ckpt] final step {final_step} is not on L1 ({why}); promoting it again")
                self._promote_again(final_step)
                why = self._final_on_l1(final_step)
            if why is not None:
                fence.check(f"committing the final step {final_step}", self.root)  # superseded: says so, not this
                raise ck.CheckpointError(f"the final step {final_step} is not globally committed on L1 "
                                         f"({self.spec.checkpoint.l1}): {why}; the run is not done (its parts stay on "
                                         "the nodes' L0 for the next attempt)")
            if self.topo.parts > 1:
                dist.barrier(group=self.pg)  # every node's L1 thread is drained: its parts are on L1
            if self.topo.parts > 1 and self.promoter is not None:
                self.promoter.retain_at_close(final_step)
        stopped = True  # rank 0's L2 thread puts the final step there after every node's part
        if self.promoter is not None:
            stopped = self.promoter.finish_l2(final_step, self.wait_s / 2)
            if stopped and final_step is not None:  # a step the L2 thread was reading was kept for it: not now
                self.promoter.retain_at_close(final_step)
        if self.bg is not None:
            self.bg.shutdown()
        self.stager.close()
        self._release(stopped)

    def _release(self, stopped: bool) -> None:
        """Collective, at the end of :meth:`close`: the fence is released (fenced for good). While this process's L2
        thread still runs (``stopped`` False) it stays installed: every later check raises
        :class:`~pipelines.train.ckpt.fence.FencedOut`, so a write of that thread goes no further; with no thread of the
        attempt left it is uninstalled (the process may go on using the storage functions, unfenced, as before).
        Rank 0 gives the lease back only when every node's L2 thread stopped, else it expires within
        ``checkpoint.lease_s`` and the next attempt's cleanup keeps this one's temp files until then."""
        every = [None] * self.world
        dist.all_gather_object(every, stopped, group=self.pg)
        self.fence.release(give_back=all(every))
        if stopped:
            fence.uninstall(self.fence)

    def _raise_if_any_rank_failed(self, local: Optional[tuple[str, str]], what: str) -> None:
        """Collective: ``CheckpointError`` on every rank when any rank's ``local`` failure (its exception's type name
        and message) is set, naming the first; :class:`~pipelines.train.ckpt.fence.FencedOut` when a rank was fenced."""
        errors = [None] * self.world
        dist.all_gather_object(errors, local, group=self.pg)
        failed = [(rank, e) for rank, e in enumerate(errors) if e]
        fenced = next((msg for _, (kind, msg) in failed if kind == fence.FencedOut.__name__), None)
        if fenced is not None:  # one line, as every fenced rank says it
            raise fence.FencedOut(fenced)
        if failed:
            rank, (kind, msg) = failed[0]
            raise ck.CheckpointError(f"{what} on rank {rank}: {kind}: {msg}")

    def _final_on_l1(self, step: int) -> Optional[str]:
        """Collective: None when ``step`` is globally committed on L1 (MANIFEST matches COMMIT), else why not."""
        box = [self._l1_why(step) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def _l1_why(self, step: int) -> Optional[str]:
        """Rank 0: None when ``step`` is globally committed on L1, else why not."""
        l1 = Path(ckpt_tiers.tier_locations(self.spec, f"{self.rel_root}/{ck.step_name(step)}")["L1"])
        try:
            ck.read_local_manifest(l1)
            return None
        except (ck.CheckpointError, OSError, ValueError) as e:
            failed = self.promoter.failed.get(step) if self.promoter is not None else None
            return failed or str(e)

    def commit_now(self, step: int, timeout_s: float) -> None:
        """Collective, on a preemption: the save of ``step`` written and committed on L0, and the step globally
        committed on L1 by the promoters within ``timeout_s``; L2 is left to the next attempt (it catches up from
        L1). :class:`CheckpointError` on every rank when it does not get there in time."""
        deadline = time.monotonic() + timeout_s
        local = None
        try:
            self.wait()
            if self.promoter is not None and step not in self.promoter.submitted:
                self.promoter.submit(step)  # checkpoint.promote_during_run=false: this step goes now
        except Exception as e:  # noqa: BLE001 - reported on every rank
            local = (type(e).__name__, str(e))
        self._raise_if_any_rank_failed(local, f"preemption: saving step {step} failed")
        box = [self._wait_l1(step, deadline) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        if box[0] is not None:
            raise ck.CheckpointError(f"preemption: step {step} is not globally committed on L1 within "
                                     f"{timeout_s:.1f} s (train.preempt_grace_s): {box[0]}")

    def _wait_l1(self, step: int, deadline: float) -> Optional[str]:
        """Rank 0: poll until ``step`` is globally committed on L1, its promotion failed, or ``deadline``."""
        while True:
            why = self._l1_why(step)
            if why is None or (self.promoter is not None and step in self.promoter.failed):
                return why
            if time.monotonic() > deadline:
                return why
            time.sleep(0.05)

    def _promote_again(self, step: int) -> None:
        """Collective: every part leader promotes its part of ``step`` to L1 once more (rank 0 merges)."""
        dist.barrier(group=self.pg)
        if self.promoter is not None:
            try:
                self.promoter.to_l1(f"{self.rel_root}/{ck.step_name(step)}", step)
                self.promoter.failed.pop(step, None)
            except Exception as e:  # noqa: BLE001 - _final_on_l1 reports it
                self.promoter.failed[step] = f"{type(e).__name__}: {e}"
                self.node_log(f"[ckpt] promote: step {step} did not reach L1 again: {self.promoter.failed[step]}")
        dist.barrier(group=self.pg)


def _node_log(topo: Topology) -> Callable[[str], None]:
    """Other nodes' leaders log too (their promotion and restore), each line naming its node."""
    return lambda m: print(f"[node {topo.node}] {m}", flush=True)
