"""Processes the pipeline starts and stops: whole process groups and trees, and who a pid file's pid really is.

* A stage runs in a session of its own (``start_new_session``), so one signal reaches torchrun, or spark-submit,
  its JVM and its Python workers: :func:`stop_group` sends SIGTERM to the group, waits up to a grace period for
  every member and every descendant of theirs to exit, then SIGKILLs what is left, descendants included: torchrun
  starts its ranks in sessions of their own, which a signal to the group never reaches, and a torchrun killed
  before its own shutdown is over would leave them running.
* :func:`stop_tree` does the same for a process and its descendants when they share our group (spark-submit started
  by the Spark provider).
* A process ending itself (a rank, a scorer) waits for its own threads a bounded time (:func:`main_bounded`): the
  interpreter's shutdown joins every non-daemon thread and executor worker, and one stuck in I/O on a stalled disk
  would keep the process (and the task waiting for it) alive for ever.
* A pid file records :func:`identity` (pid, start time, command line); :func:`still_running` is true only for that
  same process (same start time), so a stop command never signals a process that reused the pid.

Linux: members and start times come from ``/proc``.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Collection, NoReturn


CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" or "max <period>" (a container's CPU limit)


def usable_cores(cpu_max: str = CPU_MAX) -> int:
    """The cores this process may use: its affinity mask where the OS has one (taskset, cpusets), else the machine's
    count (macOS has no ``sched_getaffinity``), capped by the cgroup's CPU limit rounded up (a pod limited to 2 CPUs
    on a 64-core node: 2)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpus(cpu_max)
    return max(1, min(n, limit)) if limit else n


def cgroup_cpus(cpu_max: str = CPU_MAX) -> int | None:
    """The cgroup v2 CPU limit in whole CPUs (rounded up), or None: no limit, no such file, or not readable."""
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        return -(-int(quota) // int(period)) if quota != "max" and int(period) > 0 else None
    except (OSError, ValueError):
        return None


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp …": comm may hold spaces and parentheses, so split after its last ")"
    return [raw[:raw.index(" ")]] + [raw[raw.index("(") + 1:raw.rindex(")")]] + raw[raw.rindex(")") + 2:].split()


def start_time(pid: int) -> int | None:
    """Clock ticks after boot at which ``pid`` started (field 22 of /proc/PID/stat); None if there is no such pid."""
    st = _stat(pid)
    return int(st[21]) if st else None


def state(pid: int) -> str | None:
    """The state letter of ``pid`` (R, S, Z, …); None if there is no such pid."""
    st = _stat(pid)
    return st[2] if st else None


def started_at(pid: int) -> float | None:
    """When ``pid`` started, in seconds since the epoch (boot time + its start ticks); None if there is no such
    pid."""
    ticks = start_time(pid)
    if ticks is None:
        return None
    boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def cmdline(pid: int) -> list[str]:
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return []


def identity(pid: int) -> dict:
    """What a pid file records: the pid, when it started and its command line."""
    return {"pid": pid, "start": start_time(pid), "cmdline": cmdline(pid)}


def still_running(ident: dict) -> bool:
    """Whether the process ``ident`` recorded is alive and is the same process, not one that reused its pid: the
    same start time (a pid is reused only after its process ended, so a new one starts later). The command line is
    recorded for people, not compared: it is read before the child's exec, and servers rewrite their titles."""
    st = _stat(int(ident["pid"]))
    if st is None or st[2] == "Z":
        return False
    return int(st[21]) == ident.get("start")


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st and st[2] != "Z" and int(st[4]) == pgid:
                out.append(int(d.name))
    return out


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _wait(alive, deadline: float, reap: int | None) -> bool:
    while time.monotonic() < deadline:
        if reap is not None:
            _reap(reap)
        if not alive():
            return True
        time.sleep(0.05)
    return not alive()


def stop_group(pgid: int, grace_s: float = 10.0, reap: int | None = None) -> bool:
    """SIGTERM to group ``pgid``; after ``grace_s`` SIGKILL to whatever is left of it and of its members'
    descendants (seen before the SIGTERM or after the grace: a rank in a session of its own); ``reap`` our child,
    its leader. Returns whether anything had to be killed."""
    known = tree_of(group_members(pgid))
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    for p in _alive(known):  # those in sessions of their own get the notice too (torchrun forwards it as well)
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if _wait(lambda: group_members(pgid) or _alive(known), time.monotonic() + grace_s, reap):
        return False
    known.update(tree_of(group_members(pgid) + _alive(known)))
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    kill_known(known, 0.0, reap)
    _wait(lambda: group_members(pgid), time.monotonic() + 5.0, reap)
    return True


def tree_of(pids: list[int]) -> dict[int, int]:
    """``pids`` and all their descendants, each with its start ticks (:func:`start_time`): whom to stop later, and
    the proof that a pid still names the same process then."""
    out: dict[int, int] = {}
    kids = _children() if pids else {}
    for p in [*pids, *(d for p in pids for d in descendants(p, kids))]:
        t = start_time(p)
        if t is not None:
            out[p] = t
    return out


def _alive(known: dict[int, int]) -> list[int]:
    """Those of ``known`` (pid → start ticks) still running as the same process, zombies left out."""
    out = []
    for p, t in known.items():
        st = _stat(p)
        if st and st[2] != "Z" and int(st[21]) == t:
            out.append(p)
    return out


def kill_known(known: dict[int, int], grace_s: float = 10.0, reap: int | None = None) -> int:
    """SIGTERM those of ``known`` (pid → start ticks, :func:`tree_of`) still running as the same process, SIGKILL
    the survivors after ``grace_s`` (at once with 0); returns how many were still running."""
    running = len(_alive(known))
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)) if grace_s > 0 else ((signal.SIGKILL, 5.0),):
        for p in _alive(known):
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        if _wait(lambda: _alive(known), time.monotonic() + wait, reap):
            break
    return running


def stop_group_but(pgid: int, keep: Callable[[int], bool], grace_s: float = 10.0) -> list[dict]:
    """Stop the members of group ``pgid`` for which ``keep`` is false; return the others (:func:`identity`)."""
    members = group_members(pgid)
    kept = [p for p in members if keep(p)]
    kill_all([p for p in members if p not in kept], grace_s)
    return [identity(p) for p in kept]


def stop_unless(kept: list[dict], keep: Callable[[int], bool], grace_s: float = 10.0) -> list[dict]:
    """Stop those of ``kept`` for which ``keep`` has become false; return the others still running."""
    alive = [i for i in kept if still_running(i)]
    done = [i for i in alive if not keep(i["pid"])]
    kill_all([i["pid"] for i in done], grace_s)
    return [i for i in alive if i not in done]


def _children() -> dict[int, list[int]]:
    """Every process's children (from /proc's parent links), read once."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st:
                kids.setdefault(int(st[3]), []).append(int(d.name))
    return kids


def descendants(pid: int, kids: dict[int, list[int]] | None = None) -> list[int]:
    """``pid``'s children, theirs, and so on (from /proc's parent links; ``kids``: :func:`_children` read once)."""
    kids = _children() if kids is None else kids
    out, todo = [], [pid]
    while todo:
        found = kids.get(todo.pop(), [])
        out += found
        todo += found
    return out


def free_port() -> int:
    """A loopback TCP port free now. Another process may take it before ours binds: whoever starts a server on it
    checks that its own process listens there (:func:`listens_on`) or binds at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listens_on(pid: int, port: int) -> bool:
    """Whether ``pid`` or one of its descendants holds a TCP socket listening on ``port`` (IPv4 or IPv6): the
    server this process started answers there, not another process that took the port first."""
    inodes = set()
    for tcp in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(tcp).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:  # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    for p in [pid, *descendants(pid)] if inodes else []:
        try:
            fds = list(Path(f"/proc/{p}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    return True
            except OSError:
                continue
    return False


def stop_tree(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM ``pid`` and its descendants (found now), SIGKILL the survivors after ``grace_s``."""
    kill_all([pid, *descendants(pid)], grace_s, reap=pid)


def environ(pid: int) -> dict[str, str]:
    """``pid``'s environment (our own processes only; empty when unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _mine() -> set[int]:
    """This process and its ancestors (never signalled by a sweep)."""
    mine, p = {os.getpid()}, os.getpid()
    while (st := _stat(p)) and int(st[3]) > 1:
        p = int(st[3])
        mine.add(p)
    return mine


def in_sessions(leaders: list[dict]) -> list[int]:
    """Live processes of the sessions that ``leaders`` (:func:`identity` of processes started with a session of their
    own, since this boot) began, started no earlier than their leader, this process and its ancestors left out. A
    session whose leader's pid is now another process's is skipped (a pid is not reused as a session id while the
    session has members, so a session id whose leader is gone is still the one recorded). Finds what no environment
    shows: a process that rewrote its title (setproctitle) has overwritten its environment too."""
    start = {}
    for i in leaders:
        pid, t = int(i["pid"]), i.get("start")
        now = start_time(pid)
        if t and i.get("boot", boot_id()) == boot_id() and (now is None or now == t):
            start[pid] = t
    mine, out = _mine(), []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) not in mine:
            st = _stat(int(d.name))
            if st and st[2] != "Z" and int(st[5]) in start and int(st[21]) >= start[int(st[5])]:
                out.append(int(d.name))
    return out


def with_env(key: str, value: str) -> list[int]:
    """Live processes whose environment has ``key=value`` (e.g. every process of one Airflow home, orphans of a
    killed component included), this process and its ancestors left out."""
    mine, out = _mine(), []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) not in mine:
            st = _stat(int(d.name))
            if st and st[2] != "Z" and environ(int(d.name)).get(key) == value:
                out.append(int(d.name))
    return out


def kill_all(pids: list[int], grace_s: float = 10.0, reap: int | None = None) -> int:
    """SIGTERM ``pids``, SIGKILL the survivors after ``grace_s``; returns how many there were."""
    known = {p: t for p in pids if (t := start_time(p)) is not None}
    kill_known(known, grace_s, reap)
    return len(pids)


EXIT_GRACE_S = 120.0  # how long a process that has ended its work waits for its threads before it leaves without them


def end_process(code: int, at_once: bool = False) -> NoReturn:
    """Exit with ``code``: at once (``os._exit``, the output flushed: a stop for storage may leave a thread stuck in
    I/O), else through the interpreter's shutdown, bounded by :data:`EXIT_GRACE_S` (:func:`bound_shutdown`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if at_once:
        os._exit(code)
    bound_shutdown(code)
    sys.exit(code)


def bound_shutdown(code: int) -> None:
    """Arm a daemon timer that ends the process with ``code`` if it is still alive :data:`EXIT_GRACE_S` from now: the
    interpreter's shutdown joins non-daemon threads and executor workers (a commit worker on a stalled disk, an
    upload given up on) and runs the exit handlers, and daemon threads keep running meanwhile. Not covered: a
    destructor that blocks in the interpreter's last teardown, when no thread runs any more."""
    grace = EXIT_GRACE_S

    def expire() -> None:
        print(f"[exit] a thread of this process still runs {grace:.0f} s after its work ended: leaving without it "
              f"(exit {code})", file=sys.stderr, flush=True)
        os._exit(code)

    t = threading.Timer(grace, expire)
    t.daemon = True
    t.start()


def main_bounded(main: Callable[[], int], at_once: Collection[int] = ()) -> NoReturn:
    """``sys.exit(main())`` for an entry point whose threads may hang in I/O: its status through :func:`end_process`
    (``at_once`` for the statuses that leave without waiting), and an exception that escapes ``main`` (its traceback
    printed as usual) ends the process within the same bound."""
    try:
        code = main()
    except SystemExit as e:
        bound_shutdown(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
        raise
    except BaseException:
        bound_shutdown(1)
        raise
    end_process(code, at_once=code in at_once)
