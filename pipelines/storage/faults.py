"""Fault injection for storage and the checkpoint protocol: tests and ``make faults`` switch it on, and with
``LLMP_FAULTS`` unset every hook is one check of a module global.

``LLMP_FAULTS`` is a JSON list of rules::

    {"at": POINT, "do": KIND, "nth": 1, "times": 1, "node": K, "rank": R, "path": "/l1/", "op": "PutObject",
     "seconds": 2.0}

* ``at``: a protocol phase (:data:`PHASES`), ``read`` / ``write`` (:func:`file_op` on a file of a tier: ``path`` is a substring of
  the file's path that picks the tier or the node's disk), ``rename`` (the rename that puts a finished copy in
  place on L0 or L1, its data and COMMIT written: a failure there is a rename that fails after the data is
  written), ``renamed`` (right after that rename: a failure there is an NFS rename that the server made while the
  client got an error), or ``s3`` (every S3 request; ``op`` picks one operation
  such as ``UploadPart``, ``path`` a substring of the request's URL path: the key, percent-encoded, after the
  bucket with path-style addressing).
* ``do``: ``die`` (the process ends at once, exit 137, as a lost pod), ``lose`` (the node is lost here: on a
  simulated node the process stops at once, whole, and leaves ``lose-<LLMP_SIM_NODE>`` in ``LLMP_FAULTS_STATE``
  for the harness, which kills every process of that node and starts a replacement over an empty disk; elsewhere
  it dies as ``die`` does),
  ``eio`` / ``enospc`` (``OSError``; ``eio`` with ``"errno": "EROFS"`` raises that error instead: a read-only
  remount),
  ``s3_down`` (the endpoint refuses connections), ``s3_503`` (503 SlowDown), ``s3_reset`` (the connection is
  reset in the middle of the request), ``s3_hang`` (``at: s3`` only: the endpoint accepts the connection and never
  answers: the request is sent to a listener in this process, :func:`blackhole`, that accepts, reads and discards
  what comes and never writes a byte, so botocore's own read timeout ends it, each attempt as it would on a hung
  endpoint), ``slow`` (``seconds`` of delay), ``preempt`` (a preemption notice: SIGTERM to this rank's parent,
  its torchrun, as Kubernetes sends a pod it evicts; the process goes on and torchrun passes the notice to every
  rank), ``stop`` (the process stops here, every thread, SIGSTOP: a hung rank, which the heartbeat finds),
  ``skew`` (``at: clock`` only: this process's wall clock, :func:`now`, runs ``seconds`` ahead, or behind when
  negative, as a node whose clock NTP has not corrected; every read of it, not counted).
* ``at`` may also be ``step`` (:data:`STEP`): a rank's training step done; or ``act`` (:data:`ACT`): right before
  a copy is put in place or removed on L0/L1, or a COMMIT, MANIFEST or part marker is written or deleted on L2,
  after the fence was checked (a ``slow`` or ``stop`` there is a writer that pauses between its check and its act).
* ``node`` / ``rank``: only there (torchrun's ``GROUP_RANK`` / ``RANK``); ``world``: only in a job of that many ranks
  (``WORLD_SIZE``: an elastic job's phase on fewer nodes); ``nth``: fire from the rule's nth hit;
  ``times``: how many times it fires (0: every hit from then on).

With ``LLMP_FAULTS_STATE=DIR`` a rule's firings are counted in files under DIR, across processes: a ``die`` fires
once per scenario, not again in the process that torchrun starts in its place. A seed picks the rules
(``pipelines.storage.faultmatrix``), so the same seed replays the same run.
"""
from __future__ import annotations

import errno
import json
import os
import selectors
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit, urlunsplit


# the checkpoint protocol's named phases, in the order a step goes through them
PHASES = ("part_committed",  # a node committed its part on its own L0
          "l1_staged",  # a node's part is staged on L1
          "merge",  # rank 0 is merging the parts on L1 (files linked, no COMMIT yet)
          "l1_committed",  # the step's global COMMIT is on L1, L2 not yet
          "retention",  # between two deletions of retention
          "restage")  # a restore is staging a part on L1 again
KINDS = ("die", "lose", "eio", "enospc", "s3_down", "s3_503", "s3_reset", "s3_hang", "slow", "preempt", "stop",
         "skew")
STEP = "step"  # not a phase of the protocol: a rank's training step done (``nth``: the nth step of this process)
ACT = "act"  # between a fence check and its act: a COMMIT, MANIFEST or part marker written or deleted, any tier
CLOCK = "clock"  # the wall clock that leases are written with (:func:`now`)
AT = (*PHASES, STEP, ACT, CLOCK, "read", "write", "rename", "renamed", "s3")

_rules: Optional[list[dict]] = None
_hits: dict[int, int] = {}
_skewed: set[int] = set()  # skew rules recorded as fired in this process (now)
_lock = threading.Lock()


def load(text: Optional[str] = None) -> Optional[list[dict]]:
    """Read the rules (``LLMP_FAULTS`` unless given); None when there are none."""
    global _rules
    text = os.environ.get("LLMP_FAULTS", "") if text is None else text
    _rules = None
    _skewed.clear()
    if text.strip():
        rules = json.loads(text)
        for r in rules:
            if r.get("do") not in KINDS or r.get("at") not in AT:
                raise ValueError(f"LLMP_FAULTS: rule {r} needs at in {AT} and do in {KINDS}")
            if r["do"] == "s3_hang" and r["at"] != "s3":
                raise ValueError(f"LLMP_FAULTS: rule {r}: s3_hang is a fault of an S3 request (at: s3)")
            if (r["do"] == "skew") != (r["at"] == CLOCK):
                raise ValueError(f"LLMP_FAULTS: rule {r}: a clock is skewed (do: skew) and only skewed (at: clock)")
            if "errno" in r and (r["do"] != "eio" or not isinstance(getattr(errno, str(r["errno"]), None), int)):
                raise ValueError(f"LLMP_FAULTS: rule {r}: errno names an error of errno (e.g. EROFS), with do: eio")
        _rules = rules
    _hits.clear()
    return _rules


def active() -> bool:
    return _rules is not None


def _here(rule: dict) -> bool:
    return all(str(rule[k]) == os.environ.get(env, "0")
               for k, env in (("node", "GROUP_RANK"), ("rank", "RANK"), ("world", "WORLD_SIZE")) if k in rule)


def _claim(i: int, rule: dict) -> bool:
    """Count a hit of rule ``i``; True when it fires now."""
    with _lock:
        _hits[i] = _hits.get(i, 0) + 1
        if _hits[i] < int(rule.get("nth", 1)):
            return False
    times = int(rule.get("times", 1))
    state = os.environ.get("LLMP_FAULTS_STATE")
    if not state:
        return times == 0 or _hits[i] < int(rule.get("nth", 1)) + times
    return _record_firing(state, i, times if times else 1 << 30)


def _record_firing(state: str | Path, i: int, limit: int) -> bool:
    """Record one more firing of rule ``i`` under ``state`` unless it has fired ``limit`` times; whether it did."""
    Path(state).mkdir(parents=True, exist_ok=True)
    for k in range(limit):
        try:  # one file per firing, created exclusively: every process agrees how often the rule has fired
            os.close(os.open(Path(state) / f"rule-{i}-fired-{k}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            continue
    return False


def spend(state: str | Path, rule: int) -> None:
    """Count rule number ``rule`` fired once more under ``LLMP_FAULTS_STATE`` ``state``: a harness that acted before
    the rule's hit (a test that killed the process the rule was to hold) keeps it from firing in a restart."""
    _record_firing(state, rule, 1 << 30)


def fired(state: str | Path) -> list[str]:
    """The firings recorded under ``LLMP_FAULTS_STATE`` (for a scenario's report)."""
    p = Path(state)
    return sorted(f.name for f in p.iterdir()) if p.is_dir() else []


def _matching(at: str, **where) -> list[dict]:
    out = []
    for i, rule in enumerate(_rules or []):
        if rule["at"] != at or not _here(rule):
            continue
        if "path" in rule and rule["path"] not in str(where.get("path", "")):
            continue
        if "op" in rule and rule["op"] != where.get("op"):
            continue
        if _claim(i, rule):
            out.append(rule)
    return out


def _act(rule: dict, what: str, filename: Optional[str] = None) -> None:
    """Do what ``rule`` says at ``what``; an injected OSError names ``filename`` as the real one would (a write,
    rename or open names its file; a failing read() of an open file names none)."""
    kind = rule["do"]
    if kind == "die":
        print(f"[faults] {what}: process dies here (LLMP_FAULTS)", flush=True)
        os._exit(137)
    if kind == "lose":
        _lose(what)
    if kind == "slow":
        time.sleep(float(rule.get("seconds", 1.0)))
        return
    if kind in ("preempt", "stop"):
        _signal(kind, what)
        return
    if kind in ("eio", "enospc"):
        code = getattr(errno, rule.get("errno", "EIO")) if kind == "eio" else errno.ENOSPC
        raise OSError(code, f"{os.strerror(code)} (injected at {what})", *([filename] if filename else []))
    raise _s3_error(kind, what)


def _lose(what: str) -> None:
    """The node is lost here. On a simulated node (``LLMP_SIM_NODE``, set by ``tests/fault_matrix.py``'s harness)
    this process stops, every thread of it, and leaves ``lose-<LLMP_SIM_NODE>`` in ``LLMP_FAULTS_STATE``: the
    harness kills the node's processes (this one included) within its own bound and starts a replacement.
    Anywhere else nothing would ever end a stopped process: it dies instead."""
    print(f"[faults] {what}: the node is lost here (LLMP_FAULTS)", flush=True)
    state, node = os.environ.get("LLMP_FAULTS_STATE"), os.environ.get("LLMP_SIM_NODE")
    if state and node:
        Path(state, f"lose-{node}").touch()
        os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(137)


def _signal(kind: str, what: str) -> None:
    """``preempt``: SIGTERM to this rank's torchrun (its parent), which sends it on to every rank; ``stop``: this
    process stops, whole, until something kills it."""
    if kind == "preempt":
        print(f"[faults] {what}: a preemption notice, SIGTERM to torchrun (pid {os.getppid()}) (LLMP_FAULTS)", flush=True)
        os.kill(os.getppid(), signal.SIGTERM)
        return
    print(f"[faults] {what}: this rank stops here, SIGSTOP (pid {os.getpid()}) (LLMP_FAULTS)", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def now() -> float:
    """The wall clock (``time.time()``), skewed by the ``skew`` rules that apply to this process."""
    t = time.time()
    if _rules is None:
        return t
    skews = [(i, r) for i, r in enumerate(_rules) if r["at"] == CLOCK and _here(r)]
    for i, _ in skews:
        _mark_skewed(i)
    return t + sum(float(r.get("seconds", 0.0)) for _, r in skews)



def _mark_skewed(i: int) -> None:
    """A skew rule counts as fired (once a scenario, :func:`fired`) when a skewed clock is first read."""
    state = os.environ.get("LLMP_FAULTS_STATE")
    if i in _skewed or not state:
        return
    _skewed.add(i)
    Path(state).mkdir(parents=True, exist_ok=True)
    Path(state, f"rule-{i}-fired-0").touch()


def point(phase: str, **where) -> None:
    """A named phase of the protocol: a rule for it may end the process, fail or delay it here."""
    if _rules is None:
        return
    for rule in _matching(phase, **where):
        _act(rule, phase)


def file_op(op: str, path) -> None:
    """A file read, write or rename into place on a tier (``op``: read / write / rename / renamed)."""
    if _rules is None:
        return
    for rule in _matching(op, path=path):
        _act(rule, f"{op} {path}", None if op == "read" else str(path))


def _s3_error(kind: str, what: str) -> Exception:
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError  # lazy: the served model loads
    # this module (through the checkpoint protocol) and its requirements have no botocore

    if kind == "s3_reset":
        return ConnectionClosedError(endpoint_url=f"(injected at {what})")
    return EndpointConnectionError(endpoint_url=f"(injected at {what})")


_hole: Optional[tuple[str, int]] = None


def blackhole() -> tuple[str, int]:
    """(host, port) of this process's hung endpoint: a loopback listener that accepts every connection, reads and
    discards what the client sends, and never answers (started once, in a daemon thread)."""
    global _hole
    with _lock:
        if _hole is None:
            srv = socket.create_server(("127.0.0.1", 0), backlog=128)
            threading.Thread(target=_swallow, args=(srv,), daemon=True, name="llmp-s3-blackhole").start()
            _hole = srv.getsockname()[:2]
    return _hole


def _swallow(srv) -> None:
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is srv:
                conn, _addr = srv.accept()
                sel.register(conn, selectors.EVENT_READ)
                continue
            try:
                data = key.fileobj.recv(1 << 16)
            except OSError:
                data = b""
            if not data:  # the client gave up (its read timeout): the connection ends
                sel.unregister(key.fileobj)
                key.fileobj.close()


def _hang(request) -> None:
    """Send ``request`` to :func:`blackhole` instead of the endpoint (the same path and query)."""
    host, port = blackhole()
    u = urlsplit(request.url)
    request.url = urlunsplit(("http", f"{host}:{port}", u.path, u.query, u.fragment))


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_):
        yield self.data


def install_s3(client) -> None:
    """Hook a boto3 S3 client's requests (only when rules for ``s3`` exist): a rule answers instead of the endpoint."""
    if not any(r["at"] == "s3" for r in _rules or []):
        return

    def before_send(request, **_kw):
        op = _kw.get("event_name", "").rsplit(".", 1)[-1]
        for rule in _matching("s3", op=op, path=urlsplit(request.url).path):
            if rule["do"] == "s3_hang":
                print(f"[faults] S3 {op}: the endpoint hangs (LLMP_FAULTS)", flush=True)
                _hang(request)
                return None
            if rule["do"] == "s3_503":
                body = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                from botocore.awsrequest import AWSResponse  # lazy: as in _s3_error

                return AWSResponse(request.url, 503, {"Content-Type": "application/xml"}, _Body(body))
            _act(rule, f"S3 {op}")
        return None

    client.meta.events.register("before-send.s3", before_send)


load()
