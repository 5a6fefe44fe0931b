"""Hang detection (issue 44): every rank beats its progress; every rank watches its node's ranks.

**Beats.** The trainer's main thread calls :func:`beat` at its progress points (start, restore, each step's
forward/backward, the all-reduce that agrees on a spike or a notice, the report, evaluation, checkpoint save,
rollback, preemption checkpoint, final close). A beat replaces one small JSON file per rank (``rank<R>.json``:
rank, pid, torchrun restart, host, phase, step, time, the silence allowed in that phase) in a per-node directory on
a memory-backed disk (``/dev/shm``, a pod's memory ``emptyDir`` on Kubernetes; ``LLMP_HEARTBEAT_DIR`` overrides the
base), named by the host, torchrun's run id and agent pid, so that each node (and each torchrun on this machine) has
its own even where the base is shared. Never from a timer thread: a rank whose main thread hangs stops beating.

**Allowances.** A phase may be silent ``train.hang_timeout_s``; a phase that makes waits bounded by
``checkpoint.collective_timeout_minutes`` (start-up, restore and rollback, the first step, evaluation and save after
a start — compilation, communicators —, every save — the previous save first —, the steps around rank 0's MLflow
calls, the preemption checkpoint, the final close and finish) is allowed that bound on top once per wait in a row
(:func:`beat`'s ``waits``), so a slow healthy one is never killed and a stuck one is still ended.

**Trust.** The directory is created ``0o700`` and used only when it is a real directory (not a link) of this user
that no one else may write, else the rank runs without hang detection and says so once: nothing is ever killed on
the word of files another user could write. A beat file is used only when every field has its type (one warning for
the first that does not); a beat of another host is ignored (its clock and its pids are not this node's); files are
named from integers and opened without following links (``O_NOFOLLOW``, ``O_EXCL`` where created).

**Watchers.** Every rank runs a watcher thread that reads its node's beat files every second (at most): a rank of
this host and torchrun restart whose process is a live child of this node's torchrun agent and whose beat is older
than its allowance is hung. The first watcher to claim it (an ``O_EXCL`` file) logs one line naming the rank, its
pid, phase, step and silence, dumps its stack (``faulthandler`` on SIGUSR2 into a per-rank file, its own process's
directly; ``py-spy dump`` when installed; a stopped or uninterruptibly blocked process cannot answer, and the log
says so), then SIGKILLs it: torchrun restarts the ranks (``launcher.max_restarts``), which resume from the newest
verified step; with the restarts used up the stage exits 75. Every rank watching every rank of its node means a hung
watcher's own rank is covered by the others (every rank silent — all blocked in storage — is named and killed, its
own rank last). A node with one rank whose process is stopped has no live watcher: the ranks of other nodes, waiting
for it in a collective, go silent and are killed by theirs, and torchrun's rendezvous restarts that node's group too.
A rank that finished says so, then removes its file: it is never killed; a rank that exited is torchrun's to handle.
An error in one look is logged once and the watcher goes on. The last rank of a node removes the directory; local
rank 0 removes this host's directories of torchrun agents that are gone (:func:`sweep`).
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import os
import shutil
import signal
import socket
import stat
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
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass
class Beat:
    """One rank's last beat, as its file holds it."""
    rank: int
    local_rank: int
    pid: int
    restart: int  # torchrun's restart count: a beat of an earlier restart is not this group's
    host: str  # the node that wrote it: another host's clock and pids are not this node's
    phase: str
    step: Optional[int]
    at: float  # time.monotonic() (one clock for every process of the node)
    allow_s: float  # the silence allowed in this phase
    done: bool = False

    def where(self) -> str:
        return f"'{self.phase}'" + (f" at step {self.step}" if self.step is not None else "")


KINDS = {"rank": "int", "local_rank": "int", "pid": "int", "restart": "int", "host": "str", "phase": "str",
         "step": "int?", "at": "float", "allow_s": "float", "done": "bool"}  # a beat file's fields


def _typed(v, kind: str) -> bool:
    """``v`` is of ``kind``: a bool only where a bool is meant, a number finite."""
    if kind == "bool":
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    if kind in ("int", "int?"):
        return isinstance(v, int) or (v is None and kind == "int?")
    if kind == "float":
        return isinstance(v, (int, float)) and math.isfinite(v)
    return isinstance(v, str)


def parse_beat(raw) -> Optional[Beat]:
    """A beat file's content as a :class:`Beat`; None unless it has every field, each of its type (a rank and a
    pid not negative, an allowance above 0)."""
    if not isinstance(raw, dict) or set(raw) != set(KINDS) or not all(_typed(raw[k], t) for k, t in KINDS.items()):
        return None
    if raw["rank"] < 0 or raw["local_rank"] < 0 or raw["pid"] <= 0 or raw["restart"] < 0 or raw["allow_s"] <= 0:
        return None
    return Beat(**{**raw, "at": float(raw["at"]), "allow_s": float(raw["allow_s"])})


def hung(beats: list[Beat], now: float, alive: Callable[[int], bool]) -> list[tuple[Beat, float]]:
    """The watcher's decision: (beat, seconds silent) of each rank silent past its allowance whose process is
    still alive (an exited rank is torchrun's; a finished one is never killed), the longest silent first."""
    found = [(b, now - b.at) for b in beats if not b.done and now - b.at > b.allow_s and alive(b.pid)]
    return sorted(found, key=lambda x: -x[1])


def proc_state(pid: int) -> Optional[tuple[str, int]]:
    """(state letter, parent pid) from ``/proc``; None when the process is gone or there is no ``/proc``."""
    try:
        stat_text = Path(f"/proc/{int(pid)}/stat").read_text()
    except OSError:
        return None
    parts = stat_text.rsplit(")", 1)[1].split()
    return parts[0], int(parts[1])


PREFIX = "llmp-heartbeat-"


def _safe(name: str) -> str:
    """``name`` for a file name: letters, digits, ``-`` and ``_`` (a ``.`` never: it ends the host's part)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "none"


def host() -> str:
    return socket.gethostname()


def node_dir(base: Optional[Path] = None) -> Path:
    """This node's beat directory: one per host, torchrun agent (the ranks' parent) and run id."""
    if base is None:
        env = os.environ.get(ENV_DIR)
        shm = Path("/dev/shm")
        base = Path(env) if env else shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / dir_name(os.environ.get("TORCHELASTIC_RUN_ID", "none"), os.getppid())


def dir_name(run_id: str, agent: int) -> str:
    """A beat directory's name: this host's (no ``.`` in it), then the run id and the agent's pid."""
    return f"{PREFIX}{_safe(host())}.{_safe(run_id)}-{agent:d}"


class UnsafeDir(OSError):
    """The beat directory is not this user's own (another user's, a link, writable by others)."""


def own_dir(d: Path) -> None:
    """``d`` made (``0o700``) unless there; :class:`UnsafeDir` unless it is a directory of this user, not a link,
    that no one else may write (its name is predictable: another user may have made it first)."""
    d.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, 0o700)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise UnsafeDir(f"{d} is not a directory of this user that only it may write (a link, uid {st.st_uid}, "
                        f"mode {stat.S_IMODE(st.st_mode):o}): refused")


def sweep(base: Path) -> None:
    """Remove this host's beat directories of torchrun agents that are gone (ranks killed or crashed leave theirs);
    never another host's (its agents are not this machine's processes) nor another user's."""
    if not Path("/proc/self").is_dir():  # no way to tell a gone agent
        return
    for d in base.glob(f"{PREFIX}{_safe(host())}.*"):
        agent = d.name.rsplit("-", 1)[-1]
        if not agent.isdigit() or proc_state(int(agent)) is not None:
            continue
        with contextlib.suppress(OSError):
            st = os.lstat(d)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                shutil.rmtree(d, ignore_errors=True)


def _read(f: Path) -> str:
    """The text of ``f``, not through a link."""
    fd = os.open(f, os.O_RDONLY | NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        return fh.read().decode()


def read_beats(d: Path, restart: int, host_: str, bad: Callable[[Path], None] = lambda f: None) -> list[Beat]:
    """The beats of torchrun restart ``restart`` on host ``host_`` in ``d``; a file gone meanwhile is skipped, a
    malformed one (not a beat, or not the file of its rank) is passed to ``bad`` and skipped."""
    beats = []
    for f in d.glob("rank*.json"):
        try:
            b = parse_beat(json.loads(_read(f)))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, RecursionError):  # a link (ELOOP), not JSON, not UTF-8, nested too deep
            b = None
        if b is None or f.name != f"rank{b.rank:d}.json":
            bad(f)
        elif b.restart == restart and b.host == host_:
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
    """Signal ``pid`` to dump its stacks; the new text in ``stack_file`` (never through a link) once it stops
    growing, "" on no answer."""
    try:
        fd = os.open(stack_file, os.O_RDONLY | NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        try:
            before = os.fstat(fd).st_size
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            return ""
        deadline, size = time.monotonic() + wait_s, before
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = os.fstat(fd).st_size
            if now > before and now == size:  # grown, and the same size as 50 ms ago: the dump is written
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


def _create(path: Path, mode: str = "w"):
    """``path`` created for writing (``0o600``), never through a link nor over a file already there."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600), mode)


class Heart:
    """This rank's beats and its watcher of the node's ranks (see the module's docstring). ``wait_s``: the bound of
    one wait (``checkpoint.collective_timeout_minutes``), allowed on top of ``timeout_s`` per wait of a phase."""

    def __init__(self, d: Path, rank: int, local_rank: int, restart: int, timeout_s: float, wait_s: float,
                 log: Callable[[str], None] = lambda m: print(m, flush=True)):
        self.dir, self.rank, self.local_rank, self.restart = d, int(rank), int(local_rank), int(restart)
        self.timeout_s, self.wait_s, self.log, self.host = timeout_s, wait_s, log, host()
        self.poll_s = max(0.05, min(1.0, timeout_s / 4))
        self.file, self.stack_file = d / f"rank{self.rank:d}.json", d / f"stack-rank{self.rank:d}.txt"
        self.agent = os.getppid()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stack_f = None
        self._said: set[str] = set()
        self.broken = False

    def start(self, watch: bool = True) -> "Heart":
        """This user's own directory (else :class:`UnsafeDir`), the stack dump on SIGUSR2, the first beat
        (start-up: one wait) and, with ``watch``, the watcher thread."""
        own_dir(self.dir)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.stack_file)  # an earlier restart's
        self._stack_f = _create(self.stack_file)
        faulthandler.register(STACK_SIGNAL, file=self._stack_f, all_threads=True)
        self.beat("start", waits=1)
        if watch:
            self._thread = threading.Thread(target=self._watch, name="llmp-heartbeat-watcher", daemon=True)
            self._thread.start()
        return self

    def beat(self, phase: str, step: Optional[int] = None, waits: float = 0, done: bool = False) -> None:
        """Record progress (main thread only). ``waits``: how many waits bounded by the collective timeout the
        phase may make one after the other (each allowed ``wait_s`` more silence)."""
        if self.broken:
            return
        rec = {"rank": self.rank, "local_rank": self.local_rank, "pid": os.getpid(), "restart": self.restart,
               "host": self.host, "phase": phase, "step": step, "at": time.monotonic(),
               "allow_s": self.timeout_s + waits * self.wait_s, "done": done}
        tmp = self.dir / f".rank{self.rank:d}.json.tmp"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # left by a rank killed while writing
            with _create(tmp) as f:
                f.write(json.dumps(rec))
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

    def _once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self.log(message)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the watcher must neither take the rank down nor stop
                self._once("watch", f"[hang] warning: rank {self.rank}: a look at the heartbeats failed "
                                    f"({type(e).__name__}: {e}); the watcher goes on (said once)")

    def _bad(self, f: Path) -> None:
        self._once("bad", f"[hang] warning: rank {self.rank}: {f} is not a heartbeat file; ignored (said once for "
                          "every such file)")

    def alive(self, pid: int) -> bool:
        """A live rank of this node: running (not a zombie) with this node's torchrun agent as its parent."""
        st = proc_state(pid)
        if st is None:
            return pid == os.getpid()  # no /proc: only this process is known to be a live rank
        return st[0] not in "ZX" and st[1] == self.agent

    def check(self) -> list[int]:
        """One look at the node's beats: report and kill each hung rank this watcher claims (its own rank last);
        returns their ranks. Only a live child of this node's agent is ever killed (checked again before)."""
        found = hung(read_beats(self.dir, self.restart, self.host, self._bad), time.monotonic(), self.alive)
        mine = sorted(((b, s) for b, s in found if self._claim(b)), key=lambda x: x[0].pid == os.getpid())
        for b, silent_s in mine:
            self._report(b, silent_s, found[0])
            if self.alive(b.pid):
                with contextlib.suppress(OSError):
                    os.kill(b.pid, signal.SIGKILL)
        return [b.rank for b, _ in mine]

    def _claim(self, b: Beat) -> bool:
        """True for the one watcher of the node that handles this hang (the claim file names the torchrun
        restart, rank and pid)."""
        claim = self.dir / f"kill-restart{b.restart:d}-rank{b.rank:d}-pid{b.pid:d}"
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY | NOFOLLOW, 0o600))
            return True
        except FileExistsError:
            return False

    def _report(self, b: Beat, silent_s: float, first: tuple[Beat, float]) -> None:
        """One line naming the rank, what it was doing and for how long (after the longest silent rank: since how
        long after it, as a rank waiting for it in a collective is silent too), then its stack."""
        waits = (b.allow_s - self.timeout_s) / self.wait_s if self.wait_s > 0 else 0.0
        allowed = "train.hang_timeout_s" + (f" + {round(waits, 2):g} x checkpoint.collective_timeout_minutes"
                                            if waits > 0.005 else "")
        too = "" if b is first[0] else f" too, since {b.at - first[0].at:.1f} s after rank {first[0].rank} (waiting " \
            "for it in a collective, or hung as well),"
        self.log(f"[hang] rank {b.rank} (pid {b.pid}, local rank {b.local_rank} on {b.host}) silent"
                 f"{too} for {silent_s:.1f} s in {b.where()} (allowed {b.allow_s:g} s: {allowed}); killing it: "
                 f"{self._next()}. Its stack:")  # first: the line stays even if the dump goes wrong
        # only a live rank of this node is signalled for its stack: another rank's report may have taken seconds,
        # time enough for this pid to have ended and been reused by a process SIGUSR2 would kill
        stack = stack_of(b.pid, self.dir / f"stack-rank{b.rank:d}.txt") if self.alive(b.pid) else "(gone)"
        self.log("\n".join(f"[hang]   {line}" for line in stack.splitlines()))

    def _next(self) -> str:
        """What follows the kill: torchrun's restart while ``launcher.max_restarts`` allows, else exit 75."""
        left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - self.restart
        if left > 0:
            return f"torchrun restarts the ranks from the newest verified step ({left} restart(s) left)"
        return ("torchrun's restarts are used up (launcher.max_restarts): the stage exits 75 and a retry resumes "
                "from the newest verified step")


_heart: Optional[Heart] = None


def start(timeout_s: float, wait_s: float) -> Optional[Heart]:
    """This rank's heart and watcher, under torchrun (its environment names the rank); None otherwise, or when
    the beat directory cannot be made or is not this user's own (one warning: hangs are not detected)."""
    global _heart
    if "TORCHELASTIC_RUN_ID" not in os.environ or _heart is not None:
        return _heart
    e, d = os.environ, node_dir()
    if e.get("LOCAL_RANK", "0") == "0":
        sweep(d.parent)
    try:
        _heart = Heart(d, int(e.get("RANK", 0)), int(e.get("LOCAL_RANK", 0)),
                       int(e.get("TORCHELASTIC_RESTART_COUNT", 0)), timeout_s, wait_s).start()
    except OSError as err:  # no beat directory of our own: training goes on, unwatched
        why = str(err) if isinstance(err, UnsafeDir) else f"{d}: {err}"
        print(f"[hang] warning: rank {e.get('RANK', 0)}: no heartbeat ({why}); hangs are not detected", flush=True)
    return _heart


def beat(phase: str, step: Optional[int] = None, waits: float = 0) -> None:
    """This rank's progress (a no-op outside torchrun); ``waits``: see :meth:`Heart.beat`."""
    if _heart is not None:
        _heart.beat(phase, step, waits)


def stop() -> None:
    global _heart
    if _heart is not None:
        _heart.close()
        _heart = None
