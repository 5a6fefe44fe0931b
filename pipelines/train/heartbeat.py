"""Hang detection (issue 44): every rank beats its progress; every rank watches its node's ranks.

**Beats.** The trainer's main thread calls :func:`beat` at its progress points (start, restore, each step's
forward/backward, the all-reduce that agrees on a spike or a notice, the report, evaluation, checkpoint save,
rollback, preemption checkpoint, final close). A beat replaces one small JSON file per rank (``rank<R>.json``:
rank, pid, phase, step, time, the silence allowed in that phase) in a per-node directory on a memory-backed disk
(``/dev/shm``, a pod's memory ``emptyDir`` on Kubernetes; ``LLMP_HEARTBEAT_DIR`` overrides the base), named by
torchrun's run id and agent pid, so that each node (and each torchrun on this machine) has its own. Never from a
timer thread: a rank whose main thread hangs stops beating.

**Allowances.** A phase may be silent ``train.hang_timeout_s``; the phases whose own waits are bounded by
``checkpoint.collective_timeout_minutes`` (start-up, restore and rollback, the first step, evaluation and save after
a start — compilation, communicators —, the preemption checkpoint, the final close and finish) are allowed that
bound on top, so a slow healthy one is never killed and a stuck one is still ended.

**Watchers.** Every rank runs a watcher thread that reads its node's beat files every second (at most): a rank of
this torchrun generation whose process is alive and whose beat is older than its allowance is hung. The first
watcher to claim it (an ``O_EXCL`` file) logs one line naming the rank, its pid, phase, step and silence, dumps its
stack (``faulthandler`` on SIGUSR2 into a per-rank file, its own process's directly; ``py-spy dump`` when installed;
a stopped or uninterruptibly blocked process cannot answer, and the log says so), then SIGKILLs it: torchrun
restarts the ranks (``launcher.max_restarts``), which resume from the newest verified step; with the restarts used
up the stage exits 75. Every rank watching every rank of its node means a hung watcher's own rank is covered by the
others (every rank silent — all blocked in storage — is named and killed, its own rank last). A node with one rank
whose process is stopped has no live watcher: the ranks of other nodes, waiting for it in a collective, go silent
and are killed by theirs, and torchrun's rendezvous restarts that node's group too. A rank that finished says so,
then removes its file: it is never killed; a rank that exited is torchrun's to handle. The last rank of a node
removes the directory; local rank 0 removes those of torchrun agents that are gone (:func:`sweep`).
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ENV_DIR = "LLMP_HEARTBEAT_DIR"
STACK_SIGNAL = signal.SIGUSR2  # SIGTERM / SIGUSR1 are the preemption notice (exit_codes.PREEMPT_SIGNALS)
STACK_WAIT_S = 2.0  # how long a watcher waits for a rank's stack dump
PY_SPY_TIMEOUT_S = 10.0
PROC_STATES = {"T": "stopped (SIGSTOP): it cannot answer", "t": "stopped by a debugger: it cannot answer",
               "D": "in uninterruptible I/O (storage): it cannot answer until the call returns"}


@dataclass
class Beat:
    """One rank's last beat, as its file holds it."""
    rank: int
    local_rank: int
    pid: int
    gen: int  # torchrun's restart count: a beat of an earlier generation is not this group's
    phase: str
    step: Optional[int]
    at: float  # time.monotonic() (one clock for every process of the node)
    allow_s: float  # the silence allowed in this phase
    done: bool = False

    def where(self) -> str:
        return f"'{self.phase}'" + (f" at step {self.step}" if self.step is not None else "")


def hung(beats: list[Beat], now: float, alive: Callable[[int], bool]) -> list[tuple[Beat, float]]:
    """The watcher's decision: (beat, seconds silent) of each rank silent past its allowance whose process is
    still alive (an exited rank is torchrun's; a finished one is never killed), the longest silent first."""
    found = [(b, now - b.at) for b in beats if not b.done and now - b.at > b.allow_s and alive(b.pid)]
    return sorted(found, key=lambda x: -x[1])


def proc_state(pid: int) -> Optional[tuple[str, int]]:
    """(state letter, parent pid) from ``/proc``; None when the process is gone or there is no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


PREFIX = "llmp-heartbeat-"


def node_dir(base: Optional[Path] = None) -> Path:
    """This node's beat directory: one per torchrun agent (the ranks' parent) and run id."""
    if base is None:
        env = os.environ.get(ENV_DIR)
        shm = Path("/dev/shm")
        base = Path(env) if env else shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    run_id = "".join(c if c.isalnum() or c in "-_" else "_" for c in os.environ.get("TORCHELASTIC_RUN_ID", "none"))
    return base / f"{PREFIX}{run_id}-{os.getppid()}"


def sweep(base: Path) -> None:
    """Remove the beat directories of torchrun agents that are gone (ranks killed or crashed leave theirs)."""
    if not Path("/proc/self").is_dir():  # no way to tell a gone agent
        return
    for d in base.glob(f"{PREFIX}*"):
        agent = d.name.rsplit("-", 1)[-1]
        if agent.isdigit() and proc_state(int(agent)) is None:
            shutil.rmtree(d, ignore_errors=True)


def read_beats(d: Path, gen: int) -> list[Beat]:
    """The beats of generation ``gen`` in ``d`` (a file being replaced or unreadable is skipped this time)."""
    beats = []
    for f in d.glob("rank*.json"):
        try:
            b = Beat(**json.loads(f.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if b.gen == gen:
            beats.append(b)
    return beats


def own_stack() -> str:
    """This process's threads, dumped by the calling thread with the interpreter's lock held (a signal handler
    walking the threads while this one runs Python could crash the process)."""
    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read().decode(errors="replace").rstrip()


def stack_of(pid: int, stack_file: Path, wait_s: float = STACK_WAIT_S) -> str:
    """What ``pid`` is doing: its own ``faulthandler`` dump (all threads) into ``stack_file`` on SIGUSR2, else
    ``py-spy dump`` when installed; or why neither answered. This process's own stack is dumped directly."""
    if pid == os.getpid():
        return own_stack()
    st = proc_state(pid)
    if st is None:
        return "(gone)"
    why = PROC_STATES.get(st[0])
    if why is None:
        dumped = _faulthandler_dump(pid, stack_file, wait_s)
        if dumped:
            return dumped
        why = f"no stack dump within {wait_s:g} s"
    spy = _py_spy(pid)
    return spy if spy else f"(no stack: {why}{'' if shutil.which('py-spy') else '; py-spy is not installed'})"


def _faulthandler_dump(pid: int, stack_file: Path, wait_s: float) -> str:
    """Signal ``pid`` to dump its stacks; the new text in ``stack_file`` once it stops growing, "" on no answer."""
    try:
        before = stack_file.stat().st_size
        os.kill(pid, STACK_SIGNAL)
    except OSError:
        return ""
    deadline, size = time.monotonic() + wait_s, before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = stack_file.stat().st_size if stack_file.exists() else before
        if now > before and now == size:  # grown, and the same size as 50 ms ago: the dump is written
            with stack_file.open("rb") as f:
                f.seek(before)
                return f.read().decode(errors="replace").rstrip()
        size = now
    return ""


def _py_spy(pid: int) -> str:
    exe = shutil.which("py-spy")
    if exe is None:
        return ""
    try:
        r = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                           timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout.rstrip() if r.returncode == 0 else ""


class Heart:
    """This rank's beats and its watcher of the node's ranks (see the module's docstring)."""

    def __init__(self, d: Path, rank: int, local_rank: int, gen: int, timeout_s: float, slow_s: float,
                 log: Callable[[str], None] = lambda m: print(m, flush=True)):
        self.dir, self.rank, self.local_rank, self.gen = d, rank, local_rank, gen
        self.timeout_s, self.slow_s, self.log = timeout_s, slow_s, log
        self.poll_s = max(0.05, min(1.0, timeout_s / 4))
        self.file, self.stack_file = d / f"rank{rank}.json", d / f"stack-rank{rank}.txt"
        self.agent = os.getppid()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stack_f = None
        self.broken = False

    def start(self, watch: bool = True) -> "Heart":
        """The stack dump on SIGUSR2, the first beat (start-up: slow) and, with ``watch``, the watcher thread."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._stack_f = self.stack_file.open("w")
        faulthandler.register(STACK_SIGNAL, file=self._stack_f, all_threads=True)
        self.beat("start", slow=True)
        if watch:
            self._thread = threading.Thread(target=self._watch, name="llmp-heartbeat-watcher", daemon=True)
            self._thread.start()
        return self

    def beat(self, phase: str, step: Optional[int] = None, slow: bool = False, done: bool = False) -> None:
        """Record progress (main thread only). ``slow``: a phase bounded by the collective timeout."""
        if self.broken:
            return
        rec = {"rank": self.rank, "local_rank": self.local_rank, "pid": os.getpid(), "gen": self.gen,
               "phase": phase, "step": step, "at": time.monotonic(),
               "allow_s": self.slow_s if slow else self.timeout_s, "done": done}
        tmp = self.dir / f".rank{self.rank}.json.tmp"
        try:
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, self.file)
        except OSError as e:  # an old beat left behind would get this rank killed: leave no beat at all
            self.broken = True
            with contextlib.suppress(OSError):
                self.file.unlink(missing_ok=True)
            self.log(f"[hang] warning: rank {self.rank}: heartbeat not written ({e}); this rank is not watched")

    def close(self) -> None:
        """This rank is done: its beat says so, then goes; the watcher stops."""
        self.beat("done", done=True)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=STACK_WAIT_S + PY_SPY_TIMEOUT_S + 1)
        faulthandler.unregister(STACK_SIGNAL)
        if self._stack_f is not None:
            self._stack_f.close()
        for f in (self.file, self.stack_file):
            with contextlib.suppress(OSError):
                f.unlink(missing_ok=True)
        self._tidy()

    def _tidy(self) -> None:
        """The last rank of the node to close removes the claims of earlier hangs and the directory."""
        with contextlib.suppress(OSError):
            if not any(self.dir.glob("rank*.json")):
                for claim in self.dir.glob("kill-*"):
                    claim.unlink(missing_ok=True)
                self.dir.rmdir()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the watcher must not take the rank down; say it once
                self.log(f"[hang] warning: rank {self.rank}: the heartbeat watcher stopped: {type(e).__name__}: {e}")
                return

    def alive(self, pid: int) -> bool:
        """A live rank of this node: running (not a zombie) with this node's torchrun agent as its parent."""
        st = proc_state(pid)
        if st is None:
            return pid == os.getpid()  # no /proc: only this process is known to be a live rank
        return st[0] not in "ZX" and st[1] == self.agent

    def check(self) -> list[int]:
        """One look at the node's beats: report and kill each hung rank this watcher claims (its own rank last);
        returns their ranks."""
        found = hung(read_beats(self.dir, self.gen), time.monotonic(), self.alive)
        mine = sorted(((b, s) for b, s in found if self._claim(b)), key=lambda x: x[0].pid == os.getpid())
        for b, silent_s in mine:
            self._report(b, silent_s, found[0])
            try:
                os.kill(b.pid, signal.SIGKILL)
            except OSError:
                pass
        return [b.rank for b, _ in mine]

    def _claim(self, b: Beat) -> bool:
        """True for the one watcher of the node that handles this hang (the claim file names rank, pid and
        generation)."""
        try:
            claim = self.dir / f"kill-gen{b.gen}-rank{b.rank}-pid{b.pid}"
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def _report(self, b: Beat, silent_s: float, first: tuple[Beat, float]) -> None:
        """One line naming the rank, what it was doing and for how long (after the longest silent rank: since how
        long after it, as a rank waiting for it in a collective is silent too), then its stack."""
        allowed = "train.hang_timeout_s" if b.allow_s == self.timeout_s else \
            "train.hang_timeout_s + checkpoint.collective_timeout_minutes"
        too = "" if b is first[0] else f" too, since {b.at - first[0].at:.1f} s after rank {first[0].rank} (waiting " \
            "for it in a collective, or hung as well),"
        self.log(f"[hang] rank {b.rank} (pid {b.pid}, local rank {b.local_rank} on {socket.gethostname()}) silent"
                 f"{too} for {silent_s:.1f} s in {b.where()} (allowed {b.allow_s:g} s: {allowed}); killing it: "
                 f"{self._next()}. Its stack:")  # first: the line stays even if the dump goes wrong
        stack = stack_of(b.pid, self.dir / f"stack-rank{b.rank}.txt")
        self.log("\n".join(f"[hang]   {line}" for line in stack.splitlines()))

    def _next(self) -> str:
        """What follows the kill: torchrun's restart while ``launcher.max_restarts`` allows, else exit 75."""
        left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - self.gen
        if left > 0:
            return f"torchrun restarts the ranks from the newest verified step ({left} restart(s) left)"
        return ("torchrun's restarts are used up (launcher.max_restarts): the stage exits 75 and a retry resumes "
                "from the newest verified step")


_heart: Optional[Heart] = None


def start(timeout_s: float, slow_s: float) -> Optional[Heart]:
    """This rank's heart and watcher, under torchrun (its environment names the rank); None otherwise."""
    global _heart
    if "TORCHELASTIC_RUN_ID" not in os.environ or _heart is not None:
        return _heart
    e, d = os.environ, node_dir()
    if e.get("LOCAL_RANK", "0") == "0":
        sweep(d.parent)
    try:
        _heart = Heart(d, int(e.get("RANK", 0)), int(e.get("LOCAL_RANK", 0)),
                       int(e.get("TORCHELASTIC_RESTART_COUNT", 0)), timeout_s, slow_s).start()
    except OSError as err:  # no beat directory: training goes on, unwatched
        print(f"[hang] warning: rank {e.get('RANK', 0)}: no heartbeat ({d}: {err}); hangs are not detected",
              flush=True)
    return _heart


def beat(phase: str, step: Optional[int] = None, slow: bool = False) -> None:
    """This rank's progress (a no-op outside torchrun)."""
    if _heart is not None:
        _heart.beat(phase, step, slow)


def stop() -> None:
    global _heart
    if _heart is not None:
        _heart.close()
        _heart = None
