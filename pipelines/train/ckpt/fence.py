"""Fencing between attempts of one run (issue 44, item 5): an attempt that was thought dead and kept running (a
pod on a partitioned node) stops before it commits or deletes anything, and a starting attempt removes only the
temp files of attempts that are gone.

Each attempt (the :class:`~pipelines.train.ckpt.checkpointer.Checkpointer`'s attempt id, agreed by all ranks) takes a
*term* on L1, under the run's root, ``<l1>/<rel_root>/.fence/``:

* ``term-NNNNNNNNN``: the previous highest term + 1, created exclusively (``O_CREAT | O_EXCL``, atomic on a POSIX
  filesystem, NFS and Lustre included), holding the attempt id and its launch (torchrun's run id). The highest
  term is the current one: a newer attempt supersedes every older one by taking its term.
* ``lease-<attempt>``: the attempt's expiry (the renewing node's wall clock), renewed by global rank 0 every third
  of ``checkpoint.lease_s``, written atomically into the existing directory (never made again: a lost fence
  directory fences the attempts whose term file it held). A rank judges its own attempt's lease by how long it has
  seen it unchanged on its own monotonic clock, never by comparing the expiry with its own wall clock: a node whose
  clock is off by more than ``lease_s`` is not fenced by that (the fault matrix's clock-skew seeds). Start-up
  cleanup compares expiries with its own wall clock: a node whose clock runs ahead may remove a superseded
  attempt's temp files early (that attempt cannot commit anyway), one that runs behind leaves them longer.

Every rank installs its attempt's :class:`Fence` for the process (:func:`install`). The storage functions call
:func:`check` right before each COMMIT (a write or a rename into place) and each deletion of committed data on
L0, L1 and L2, and :func:`guard` before replacing or deleting a committed copy. Both raise :class:`FencedOut`
when this attempt's term is no longer the highest, its own term file is gone or names another attempt, its lease
expired (the renewing rank: not renewed within ``lease_s``, e.g. cut off from L1; a read that keeps failing, ESTALE
or EIO, only once no read succeeded for ``lease_s``), or a copy was committed by a newer term. An S3 write also
waits for one of this process at the same place that was given up on and still runs (:func:`settle_s3`). At close
the fence is released (:meth:`Fence.release`: fenced for good) and, while a thread of the attempt still runs (an L2
upload close gave up waiting for), left installed: every later check of the process raises, so that thread writes
nothing more. Manifests record the term that wrote a step (``term``). L2 has no fence of its
own: every COMMIT put or deleted there, and every file uploaded, is preceded by the L1 check (see
docs/training.md, "Fencing"). A process with no fence installed (the promote stage, tools, tests that call the
storage functions) is not fenced; nor is a path outside the installed fence's run.

A superseded launch cannot come back: torchrun restarting the ranks of a fenced-out attempt starts an attempt
of the same launch, which refuses to take a term while a newer term of another launch exists (:meth:`Fence.take`).
Start-up cleanup removes a temp file only when :func:`removable`: its attempt's lease has expired, or no lease
names it and it is older than ``lease_s``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, TypeVar

from pipelines.exit_codes import RETRY
from pipelines.listing import strict_glob
from pipelines.spec import JobSpec, resolve_path
from pipelines.storage import faults, oserrors
from pipelines.storage.s3 import abandoned_writes
from pipelines.train.ckpt.protocol import CKPT_MANIFEST, CheckpointError

FENCE_DIR = ".fence"
TERM_PREFIX = "term-"
FLOOR_FILE = "l2-floor"  # in the L1 fence directory: L2's highest term when this L1 first read it (fence_l2.floor)
LEASE_PREFIX = "lease-"
TAKE_TRIES = 1000  # terms taken by others between our listing and our exclusive create, at most
READ_TRIES = 3  # a lease or term file read that fails (ESTALE, EIO) is tried again this many times in all
READ_RETRY_S = 0.05
# torchrun's default rendezvous id, and the rendered Kubernetes jobs' when a pod could not learn its job's uid
# (pipelines.launch.k8s.rendezvous_env): every job has it, so it names no launch
SHARED_RUN_IDS = ("none", "llmp-")
SETTLE_S3_S = 10.0  # how long an S3 write waits for an earlier one given up on at the same place (settle_s3)

T = TypeVar("T")


def _clock() -> float:
    """The clock a lease is judged by: monotonic, and (Linux's ``CLOCK_BOOTTIME``) counting the time a suspended
    machine slept, so a VM frozen and resumed finds its lease as old as it is."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


class FencedOut(CheckpointError):
    """This attempt is superseded (or its lease lapsed): it stops before committing; a retry is the way on."""

    exit_code = RETRY  # not a user error


def fence_dir(spec: JobSpec, rel_root: str) -> Path:
    """Where a run's terms and leases live: ``<checkpoint.l1>/<rel_root>/.fence``."""
    return resolve_path(spec.checkpoint.l1) / rel_root / FENCE_DIR


def launch_id() -> Optional[str]:
    """The launch this process belongs to, the same across torchrun's restarts of the ranks: torchrun's run id (a
    uuid of each ``--standalone`` torchrun, the job's id on Kubernetes, one id for every node of an elastic job, so
    a job that shrinks to one node and grows back stays one launch). A run id that every job shares
    (:data:`SHARED_RUN_IDS`, torchrun's default) names no launch across nodes (None: no launch is refused); on one
    node its agent's host and pid tell two launches apart."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run:
        return None
    if run not in SHARED_RUN_IDS:
        return run
    one_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    return f"{run}@{socket.gethostname()}/{os.getppid()}" if one_node else None


def _numbered(d: Path) -> dict[int, Path]:
    """{term: its file}: the names only, no file read (a name that is not ``term-<number>`` is left out)."""
    out = {}
    for p in strict_glob(f"{TERM_PREFIX}*", d):  # a folder that cannot be listed raises: no term is read as none
        try:
            out[int(p.name[len(TERM_PREFIX):])] = p
        except ValueError:
            continue
    return out


def _term_body(p: Path) -> dict:
    """A term file's record; one being written (empty, half a JSON object) or not a JSON object reads as ``{}``.
    A file that L1 fails to return after :func:`_retried`'s tries raises (OSError): whose launch holds that term is
    unknown, so no term is taken over it (a superseded launch must not read its own older term as nobody's and take a newer one)."""
    try:
        text = _retried(p.read_text)  # a transient error (ESTALE, EIO) is read again first
    except FileNotFoundError:
        return {}
    try:
        body = json.loads(text or "{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def read_terms(d: Path) -> dict[int, dict]:
    """{term: {"attempt", "launch"}}: every term taken; one being written reads as ``{}``; raises OSError when L1
    fails to return one."""
    return {n: _term_body(p) for n, p in _numbered(d).items()}


def current_term(d: Path) -> int:
    """The highest term taken (0: none): the names only, no file read."""
    return max(_numbered(d), default=0)


def _expiry(p: Path) -> float:
    """A lease file's expiry; raises ``OSError`` (``FileNotFoundError`` when absent) or ``ValueError`` (not a lease)."""
    try:
        expires = float(json.loads(p.read_text())["expires"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{p.name} is not a lease ({type(e).__name__}: {e})") from None
    if not math.isfinite(expires):
        raise ValueError(f"{p.name} is not a lease (expires {expires})")
    return expires


def read_leases(d: Path) -> dict[str, float]:
    """{attempt: expiry (time.time())}. A lease path that answers but holds no lease (not one's JSON, a directory, a
    symlink loop: :data:`~pipelines.storage.oserrors.ANSWERS`) counts as expired; one whose read still fails after
    :func:`_retried` without an answer (EIO, ESTALE, a refusal: :func:`~pipelines.storage.oserrors.unanswered`) as
    live (``inf``): its attempt may be running, so nothing of it is removed on that read; one gone since the listing
    is left out."""
    out = {}
    for p in strict_glob(f"{LEASE_PREFIX}*", d):
        try:
            out[p.name[len(LEASE_PREFIX):]] = _retried(lambda: _expiry(p))  # noqa: B023 - called at once
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:  # (an OSError without an errno is no answer either)
            answered = not isinstance(e, OSError) or e.errno in oserrors.ANSWERS
            out[p.name[len(LEASE_PREFIX):]] = 0.0 if answered else math.inf
    return out


def _retried(read: Callable[[], T]) -> T:
    """``read()``, tried again on an error other than file-not-found (ESTALE, EIO, a torn read), ``READ_TRIES``
    times in all; the last error is raised (``FileNotFoundError`` at once)."""
    for i in range(READ_TRIES - 1):
        try:
            return read()
        except FileNotFoundError:
            raise
        except (OSError, ValueError):
            time.sleep(READ_RETRY_S * (i + 1))
    return read()


def read_lease(d: Path, attempt: str) -> Optional[float]:
    """``attempt``'s expiry; None when it holds no lease. Another error (ESTALE, EIO, not a lease) is tried again
    (:func:`_retried`) and then raised (``OSError`` or ``ValueError``): the caller decides how long it may last."""
    try:
        return _retried(lambda: _expiry(d / f"{LEASE_PREFIX}{attempt}"))
    except FileNotFoundError:
        return None


def term_owner(d: Path, n: int) -> Optional[str]:
    """The attempt that term ``n``'s file names (``""`` when it names none); None when the file is gone. Other read
    errors are tried again, then raised (:func:`_retried`)."""
    try:
        body = _retried(lambda: json.loads((d / f"{TERM_PREFIX}{n:09d}").read_text() or "{}"))
    except FileNotFoundError:
        return None
    return str(body.get("attempt") or "") if isinstance(body, dict) else ""


def write_lease(d: Path, attempt: str, term: int, expires: float) -> None:
    """Write the lease atomically into the existing fence directory ``d`` (never created here: a lost fence
    directory must not come back as an empty one that fences nothing)."""
    p = d / f"{LEASE_PREFIX}{attempt}"
    tmp = d / f".{p.name}.tmp-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # FileNotFoundError when d is gone
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"attempt": attempt, "term": term, "expires": expires}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _create_term(d: Path, n: int, attempt: str, launch: Optional[str]) -> bool:
    """Create ``term-n`` exclusively; False when another attempt took it first."""
    try:
        fd = os.open(d / f"{TERM_PREFIX}{n:09d}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"attempt": attempt, "launch": launch, "at": time.time()}))
        f.flush()
        os.fsync(f.fileno())
    return True


def supersede(d: Path, by: str) -> Optional[int]:
    """Take the next term in the fence directory ``d`` for ``by`` (housekeeping about to delete the run's steps), with
    no lease: every attempt holding a term there is fenced out at its next check, before its next commit. None
    when ``d`` is not a directory (no attempt ever took a term there); a link in its place is not followed."""
    if d.is_symlink() or not d.is_dir():
        return None
    for _ in range(TAKE_TRIES):
        n = current_term(d) + 1
        if _create_term(d, n, by, None):
            return n
    raise CheckpointError(f"{d}: no term could be taken in {TAKE_TRIES} tries")


def superseded_launch(terms: dict[int, dict], launch: Optional[str]) -> Optional[int]:
    """The newer term of another launch that supersedes ``launch`` (a fenced-out launch's restart), else None."""
    if launch is None or not terms:
        return None
    mine = [n for n, t in terms.items() if t.get("launch") == launch]
    top = max(terms)
    if mine and top > max(mine) and terms[top].get("launch") != launch:
        return top
    return None


class Fence:
    """This attempt's term in its run's fence directory; global rank 0 renews the lease (:meth:`start_renewing`).
    ``roots``: the run's directories (L0, L1) and L2 prefix that this fence guards."""

    def __init__(self, d: Path, attempt: str, term: int, lease_s: float, roots: tuple[str, ...],
                 log: Callable[[str], None] = print):
        self.dir, self.attempt, self.term, self.lease_s, self.log = d, attempt, term, lease_s, log
        self.roots = tuple(r.rstrip("/") for r in roots)
        self.renewed: Optional[float] = None  # _clock() of the last renewal (the renewing rank)
        self.fenced: Optional[str] = None  # why, once fenced out: sticky
        self.read_ok = _clock()  # the last time its term file and lease on L1 could be read
        self.lease_seen: tuple[Optional[float], float] = (None, 0.0)  # (expiry read, since when: monotonic)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None  # the renewing rank's
        self._watcher: Optional[threading.Thread] = None  # every other rank's (start_watching)

    @classmethod
    def take(cls, d: Path, attempt: str, lease_s: float, roots: tuple[str, ...],
             log: Callable[[str], None] = print, launch: Optional[str] = None, floor: int = 0) -> "Fence":
        """Global rank 0: take the next term above every one on L1 and above ``floor`` (the highest an older L1
        held, :mod:`pipelines.train.ckpt.fence_l2`) (exclusive create, bounded retries) and write the lease. Raises
        :class:`FencedOut` when ``launch`` was superseded by another launch (torchrun restarting fenced-out ranks)."""
        d.mkdir(parents=True, exist_ok=True)
        for _ in range(TAKE_TRIES):
            terms = read_terms(d)
            top = superseded_launch(terms, launch)
            if top is not None:
                raise FencedOut(f"[fence] launch {launch} is superseded by term {top} (attempt "
                                f"{terms[top].get('attempt')}): this restart stops before touching the checkpoints")
            n = max(max(terms, default=0), floor) + 1
            if _create_term(d, n, attempt, launch):
                break
        else:
            raise CheckpointError(f"{d}: no term could be taken in {TAKE_TRIES} tries")
        now = faults.now()
        for other, exp in read_leases(d).items():
            if exp == math.inf and other != attempt:
                log(f"[fence] attempt {other}'s lease cannot be read: attempt {attempt} takes over with term {n}; "
                    "the other, if it runs, stops before its next commit")
            elif exp > now and other != attempt:
                log(f"[fence] attempt {other} still holds a lease ({exp - now:.0f} s left): attempt {attempt} "
                    f"takes over with term {n}; the other stops before its next commit")
            elif exp < now - lease_s:  # long gone: its temp files are older than lease_s (removable without it)
                with contextlib.suppress(IsADirectoryError, PermissionError):  # a directory in a lease's place
                    (d / f"{LEASE_PREFIX}{other}").unlink(missing_ok=True)  # (EISDIR; EPERM on macOS): left there
        f = cls(d, attempt, n, lease_s, roots, log)
        write_lease(d, attempt, n, now + lease_s)
        f.renewed = _clock()
        f.lease_seen = (now + lease_s, f.renewed)
        return f

    def start_renewing(self) -> None:
        """Renew the lease every third of ``lease_s`` in a daemon thread, until :meth:`release`."""
        self._thread = threading.Thread(target=self._renew_loop, daemon=True, name="llmp-fence")
        self._thread.start()

    def start_watching(self) -> None:
        """A rank that does not renew: read the lease every third of ``lease_s`` in a daemon thread, until
        :meth:`release`, so that how long it has stood unchanged is known whenever this rank checks, however
        rarely (:meth:`_unchanged_for`)."""
        self._watcher = threading.Thread(target=self._watch_loop, daemon=True, name="llmp-fence-watch")
        self._watcher.start()

    def _watch_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                expires = read_lease(self.dir, self.attempt)
            except (OSError, ValueError):  # check() says what a read that keeps failing means
                continue
            if expires is not None:
                self._unchanged_for(expires)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if self.fenced or current_term(self.dir) > self.term:  # superseded: its lease is left to expire
                    return
                write_lease(self.dir, self.attempt, self.term, faults.now() + self.lease_s)
                self.renewed = _clock()
            except OSError as e:  # L1 unreachable: check() fences this attempt once lease_s has passed
                self.log(f"[fence] warning: attempt {self.attempt} could not renew its lease: {e}")

    def covers(self, where) -> bool:
        s = str(where).rstrip("/")
        return any(s == r or s.startswith(r + "/") for r in self.roots)

    def check(self, what: str) -> None:
        """Raise :class:`FencedOut` unless this attempt may still commit or delete (``what``: for the message)."""
        if self.fenced is None:
            self.fenced = self._why_fenced()
            if self.fenced is not None:
                self._stop.set()  # no more renewals: the lease expires, and later attempts may clean up after us
        if self.fenced is not None:
            raise FencedOut(f"{self.fenced}: stopping before {what}")

    def _why_fenced(self) -> Optional[str]:
        me = f"[fence] attempt {self.attempt} (term {self.term})"
        top = current_term(self.dir)
        if top > self.term:
            return f"{me} is superseded by term {top}"
        if self.renewed is not None and self._thread is not None and _clock() - self.renewed > self.lease_s:
            return f"{me}: its lease was not renewed for {_clock() - self.renewed:.0f} s (checkpoint.lease_s=" \
                   f"{self.lease_s:g})"
        try:
            why = self._own_records(me)
        except (OSError, ValueError) as e:
            return self._unreadable(me, e)
        self.read_ok = _clock()
        return why

    def _own_records(self, me: str) -> Optional[str]:
        """Why this attempt's own term file or lease on L1 fences it, else None; raises when one cannot be read."""
        owner = term_owner(self.dir, self.term)
        if owner is None:  # a lost fence directory: another attempt could take term 1 in a new one, unfenced
            return f"{me}: its term file is gone ({self.dir}/{TERM_PREFIX}{self.term:09d})"
        if owner != self.attempt:
            return f"{me}: its term file names attempt {owner or 'none'}"
        expires = read_lease(self.dir, self.attempt)
        if expires is None:
            return f"{me} holds no lease on L1"
        if expires <= 0.0:
            return f"{me}: its lease on L1 expired (given back)"
        quiet = self._unchanged_for(expires)
        if quiet > self.lease_s:
            return f"{me}: its lease on L1 expired (not renewed for {quiet:.0f} s by this node's clock, " \
                   f"checkpoint.lease_s={self.lease_s:g})"
        return None

    def _unchanged_for(self, expires: float) -> float:
        """Seconds this process has seen the lease hold ``expires`` (its monotonic clock: the renewing node's wall
        clock is never compared with this one's). A rank that did not take the term counts from its first read."""
        seen, since = self.lease_seen
        if expires != seen:
            since = _clock()
        self.lease_seen = (expires, since)
        return _clock() - since

    def _unreadable(self, me: str, e: Exception) -> Optional[str]:
        """A term or lease read that keeps failing (ESTALE, EIO): fenced only once no read succeeded for ``lease_s``."""
        since = _clock() - self.read_ok
        if since > self.lease_s:
            return (f"{me}: its term and lease on L1 could not be read for {since:.0f} s (checkpoint.lease_s="
                    f"{self.lease_s:g}): {type(e).__name__}: {e}")
        self.log(f"[fence] warning: attempt {self.attempt} could not read its term or lease on L1 "
                 f"({type(e).__name__}: {e}); fenced if this lasts checkpoint.lease_s={self.lease_s:g} s")
        return None

    def guard(self, what: str, recorded: Optional[int]) -> None:
        """:meth:`check`, and refuse to replace or delete a copy committed by a newer term (``recorded``), one that
        this run's fence knows (a term above the highest taken belongs to a fence directory that was lost)."""
        self.check(what)
        if isinstance(recorded, int) and self.term < recorded <= current_term(self.dir):
            self.fenced = f"[fence] attempt {self.attempt} (term {self.term}) is superseded by term {recorded}"
            self._stop.set()
            raise FencedOut(f"{self.fenced}: stopping before {what} (committed by term {recorded})")

    def release(self, give_back: bool = True) -> None:
        """This attempt has ended: stop renewing and fence it for good, so that while it stays installed a write that
        a thread of it left running makes later (an L2 upload) raises :class:`FencedOut` instead of going unchecked.
        The renewing rank marks its lease expired (its temp files may go) when ``give_back``, else leaves it to
        expire within ``lease_s`` (a thread of the attempt may still use them)."""
        if self.fenced is None:
            self.fenced = f"[fence] attempt {self.attempt} (term {self.term}) is released: this attempt has ended"
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.lease_s)
            if give_back:
                try:
                    write_lease(self.dir, self.attempt, self.term, 0.0)
                except OSError:
                    pass


_active: Optional[Fence] = None
_lock = threading.Lock()


def install(f: Optional[Fence]) -> None:
    """This process's fence (one attempt per process at a time); None removes it."""
    global _active
    with _lock:
        _active = f


def active() -> Optional[Fence]:
    return _active


def uninstall(f: Fence) -> None:
    global _active
    with _lock:
        if _active is f:
            _active = None


def check(what: str, where) -> None:
    """Before a COMMIT or a deletion at ``where`` (a path or an s3:// URI): :meth:`Fence.check` when this process
    has a fence covering it, and on S3 :func:`settle_s3`; nothing otherwise."""
    f = _active
    if f is not None and f.covers(where):
        f.check(what)
        if str(where).startswith("s3://"):
            settle_s3(what, str(where))


def settle_s3(what: str, where: str) -> None:
    """An earlier S3 write or delete of this process at ``where`` that was given up on after its bound and still
    runs could land after this one (a stale object over a new one, a COMMIT deleted): waited for at most
    :data:`SETTLE_S3_S`, then refused with :class:`CheckpointError` (L2 leaves the step for a later try)."""
    deadline = time.monotonic() + SETTLE_S3_S
    while left := abandoned_writes(where):
        if time.monotonic() > deadline:
            raise CheckpointError(f"{left[0]} was given up on and still runs: stopping before {what} (it could land "
                                  "after it)")
        time.sleep(0.1)


def guard(what: str, where, manifest: Callable[[], Optional[dict]]) -> None:
    """Before replacing or deleting the committed copy at ``where``: :meth:`Fence.guard` with the term its
    ``manifest()`` records (read only when a fence covers ``where``; an unreadable one records none)."""
    f = _active
    if f is None or not f.covers(where):
        return
    try:
        man = manifest()
    except (CheckpointError, OSError, ValueError):
        man = None
    f.guard(what, man.get("term") if isinstance(man, dict) else None)


def local_manifest(d: Path) -> Optional[dict]:
    """A local copy's MANIFEST.json, as it is (for :func:`guard`; COMMIT not checked), or None."""
    p = Path(d) / CKPT_MANIFEST
    return json.loads(p.read_text()) if p.is_file() else None


def term() -> Optional[int]:
    """The installed fence's term (manifests record it), or None."""
    f = _active
    return f.term if f is not None else None


def tmp_tag() -> str:
    """A temp name's suffix: ``<attempt>-<random>`` under a fence (start-up cleanup knows whose it is), else random."""
    f = _active
    return f"{f.attempt}-{uuid.uuid4().hex[:6]}" if f is not None else uuid.uuid4().hex[:8]


def owners(path: Path) -> set[str]:
    """The attempts a temp entry belongs to: named in it (``.x.tmp-<attempt>[-…]``, ``.view-<attempt>-…``), and for
    a staging or marks directory in its entries (their names, part manifests' ``attempt``, marks' first word)."""
    found = set(filter(None, [_named_owner(path.name)]))
    if path.is_dir() and path.suffix in (".parts", ".l2"):
        for child in path.iterdir():
            found |= set(filter(None, [_named_owner(child.name)]))
            try:
                if child.is_dir():
                    found.add(json.loads((child / CKPT_MANIFEST).read_text())["attempt"])
                else:
                    found.add(child.read_text().split()[0])
            except (OSError, ValueError, KeyError, IndexError, TypeError):
                continue
    return {o for o in found if isinstance(o, str) and o}


def _named_owner(name: str) -> Optional[str]:
    for mark in (".tmp-", ".view-"):
        if mark in name:
            return name.split(mark, 1)[1].split("-", 1)[0] or None
    return None


def _newest_mtime(path: Path, now: float) -> float:
    try:
        times = [path.stat().st_mtime] + ([c.stat().st_mtime for c in path.iterdir()] if path.is_dir() else [])
    except OSError:
        return now  # being changed under us: someone is alive
    return max(times)


def removable(path: Path, leases: dict[str, float], lease_s: float, now: Optional[float] = None) -> bool:
    """May start-up cleanup remove the temp entry ``path``? Not while an attempt it belongs to holds a live lease;
    yes when every attempt it belongs to has a lease that expired; otherwise (no lease names it: a fence-less
    writer, an older version) only once nothing in it changed for ``lease_s``."""
    now = faults.now() if now is None else now
    who = owners(path)
    if any(leases.get(o, 0.0) > now for o in who):
        return False
    if who and all(o in leases for o in who):
        return True
    return now - _newest_mtime(path, now) > lease_s


def superseded(spec: JobSpec, rel_root: str, info: Optional[dict]) -> Optional[str]:
    """For the launcher, once the ranks are done: why the attempt that wrote the result (``info``: its attempt and
    term) is superseded or cannot be shown not to be (the fence directory missing or empty, its term file gone,
    naming another attempt or unreadable: fail closed), else None (also when the result names no term)."""
    if not info or not isinstance(info.get("term"), int):
        return None
    d, n = fence_dir(spec, rel_root), info["term"]
    me = f"[fence] attempt {info.get('attempt')} (term {n})"
    not_mine = "its result is not committed as the stage's"
    top = current_term(d)
    if top == 0:
        return f"{me}: the fence directory {d} is missing or holds no term: {not_mine}"
    if top > n:
        return f"{me} is superseded by term {top}: {not_mine}"
    try:
        owner = term_owner(d, n)
    except (OSError, ValueError) as e:
        return f"{me}: its term file cannot be read ({type(e).__name__}: {e}): {not_mine}"
    if owner != info.get("attempt"):
        return f"{me}: its term file is {'gone' if owner is None else f'of attempt {owner or None}'}: {not_mine}"
    return None


def confirm(spec: JobSpec, rel_root: str, info: Optional[dict]) -> None:
    """The launcher, before it commits the stage: :class:`FencedOut` (exit 75) when the attempt that wrote the
    result is superseded (:func:`superseded`): a zombie's result never becomes the stage's."""
    why = superseded(spec, rel_root, info)
    if why is not None:
        raise FencedOut(why)
