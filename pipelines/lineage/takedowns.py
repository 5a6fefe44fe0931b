"""The takedown list: the sources no new corpus version may hold (read, locked, added to, applied by the filter
stage), and the registered versions tagged as trained on one (:data:`TAG`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

import pyarrow.compute as pc


from pipelines.exit_codes import RETRY
from pipelines.lineage.keys import Exclusion, Matcher, check_text, source_key
from pipelines.manifest import StageError, now_iso
from pipelines.storage import oserrors
from pipelines.storage.flock import flock_within

TAG = "takedown.pending"
LOCK_WAIT_S = 120.0  # the longest a stage or an --exclude-source waits for the list's lock (each holds it briefly)
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class ListUnavailable(StageError):
    """The takedown list or its lock cannot be used now (the lock held past its deadline, a file system without
    ``flock``, a lock file or list that cannot be opened or written): nothing was done, never anything unlocked;
    exit 75 (``RETRY``: orchestrators retry it)."""

    exit_code = RETRY


@dataclass(frozen=True)
class TakedownList:
    """The list as one read found it: its exclusions and the sha256 of exactly the bytes read (None when it held no
    exclusion: a missing or blank file applies nothing)."""
    path: Path
    exclusions: tuple[Exclusion, ...]
    sha256: Optional[str]

    def ref(self) -> dict:
        """The list as a stage's input (what ``file_ref`` gives for these bytes)."""
        return {"uri": self.path.resolve().as_uri(), "sha256": self.sha256}


def _parse(data: bytes, path: Path) -> list[Exclusion]:
    out = []
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.append(Exclusion(source_key(rec["source"]), check_text(rec["reason"], "reason"),
                                 str(rec.get("added_at", ""))))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StageError(f"{path}:{n}: not an exclusion ({e}); each line is {{\"source\": KEY or URL prefix, "
                             "\"reason\": text}} (data.exclusions)") from None
    return out


def read_list(path: Path) -> TakedownList:
    """The takedown list at ``path``, read once; a line that is not an exclusion is an error that names the file and
    line."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # no list: nothing is excluded (a list that was moved away takes nothing down)
        return TakedownList(path, (), None)
    except OSError as e:
        raise _cannot(f"cannot read the takedown list {path}", e, "") from None
    found = tuple(_parse(data, path))
    return TakedownList(path, found, hashlib.sha256(data).hexdigest() if found else None)


def _cannot(what: str, e: OSError, then: str) -> StageError:
    """The list or its lock that could not be used: :class:`ListUnavailable` (75); a refusal to this user (EACCES,
    EPERM) is the user's to fix (2: no retry is let in)."""
    if oserrors.refused(e):
        return StageError(f"{what} ({e.strerror or e}): this user may not; give it access (nothing was done)")
    return ListUnavailable(f"{what} ({e.strerror or e}){then}")


def recorded_sha256(record: dict) -> Optional[str]:
    """The list digest a stage's ``extra.takedown`` records as applied; None for a list of no exclusion, as
    :func:`read_list` gives it (a filter stage before this version recorded a blank list's bytes' digest)."""
    sha = record.get("list_sha256")
    return None if record.get("exclusions") == 0 or sha == EMPTY_SHA256 else sha


def _lock_file(path: Path) -> tuple[int, Path]:
    """The lock file beside the list, opened read-write when it may be, else read-only (``flock`` needs no write
    access: a lock file another user made ``0644`` still locks)."""
    lock = path.with_name(f".{path.name}.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return os.open(lock, os.O_RDWR | os.O_CREAT, 0o666), lock
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            return os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666), lock
    except OSError as e:
        raise _cannot(f"cannot open the takedown list's lock {lock}", e, "; nothing was done: this user must be able "
                      "to create or read that file beside data.exclusions") from None


def _holder(fd: int) -> str:
    try:
        line = os.pread(fd, 300, 0).decode("utf-8", "replace").strip()
    except OSError:
        line = ""
    return (f"the lock file says: {line}" if line else
            "holder unknown: a tokenize stage publishing a corpus version holds it shared, or its holder could not "
            "write its name")


def _claim(fd: int, line: str) -> None:
    """The exclusive holder's name in the lock file (emptied when it lets go), for whoever waits."""
    with contextlib.suppress(OSError):  # a lock file opened read-only: the waiters read "holder unknown"
        os.ftruncate(fd, 0)
        if line:
            os.pwrite(fd, line.encode(), 0)


def _take(fd: int, lock: Path, exclusive: bool, wait_s: float) -> None:
    """``flock`` without blocking, tried again until ``wait_s`` has passed (one line on stderr while it waits);
    :class:`ListUnavailable` then, or at once when the file system refuses ``flock``."""
    def waiting() -> None:
        print(f"takedown list: waiting up to {wait_s:g} s for {lock} ({_holder(fd)})", file=sys.stderr, flush=True)

    try:
        taken = flock_within(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, wait_s, waiting)
    except OSError as e:  # ENOLCK, EOPNOTSUPP, EINVAL: not a lock this file system keeps
        raise ListUnavailable(f"cannot lock {lock} ({e.strerror or e}): the directory of data.exclusions must "
                              "support flock (a local disk, NFSv4, Lustre mounted with -o flock); nothing was "
                              "done") from None
    if not taken:
        raise ListUnavailable(f"the takedown list's lock {lock} is still held after {wait_s:g} s "
                              f"({_holder(fd)}); nothing was done; run it again once its holder is done")


@contextlib.contextmanager
def locked(path: Path, exclusive: bool = False, wait_s: float = LOCK_WAIT_S):
    """The lock beside the takedown list at ``path`` (``.<name>.lock``), shared or exclusive, waited for at most
    ``wait_s`` seconds (:class:`ListUnavailable`: never the list unlocked); the exclusive holder names itself in
    it."""
    fd, lock = _lock_file(path)
    try:
        _take(fd, lock, exclusive, wait_s)
        if exclusive:
            _claim(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now_iso()}\n")
        try:
            yield
        finally:
            if exclusive:
                _claim(fd, "")
    finally:
        os.close(fd)  # lets go of the lock


@contextlib.contextmanager
def list_held(path: Path, wait_s: float = LOCK_WAIT_S):
    """The list held still (a shared lock: :func:`add` waits) while a corpus version is published: take it once
    everything is computed and hashed, for the final rename only; yields the sha256 the list has now (as
    :attr:`TakedownList.sha256`)."""
    with locked(path, wait_s=wait_s):
        yield read_list(path).sha256


def _write_list(path: Path, exclusions: list[Exclusion]) -> None:
    """The list written whole to a temporary file beside it, synced and renamed (the rename synced too)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(asdict(e)) + "\n" for e in exclusions)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def add(path: Path, source: str, reason: str, wait_s: float = LOCK_WAIT_S) -> tuple[Exclusion, bool]:
    """Add an exclusion to the list (``source`` normalised, :func:`source_key`), under an exclusive lock beside it
    (two takedowns at once both land; a corpus version is not published meanwhile), waited for at most ``wait_s``
    seconds; (the exclusion, False) when the source is excluded already."""
    source, reason = source_key(source), check_text(reason, "reason (--reason)")
    with locked(path, exclusive=True, wait_s=wait_s):
        held = read_list(path).exclusions
        for e in held:
            if e.source == source:
                return e, False
        new = Exclusion(source, reason, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        try:
            _write_list(path, [*held, new])
        except OSError as e:
            raise _cannot(f"cannot write the takedown list {path}", e, "; run the same command again (an exclusion "
                          "already there is kept once)") from None
    return new, True


def tag_versions(client, versions: list[dict], exclusion: Exclusion) -> list[dict]:
    """Tag each registered version (``name``, ``version``) ``takedown.pending``: the excluded sources it saw and why
    (a version tagged before keeps its earlier sources)."""
    note = f"{exclusion.source}: {exclusion.reason}"[:1000]  # one line: neither holds a control character
    for v in versions:
        have = (client.get_model_version(v["name"], v["version"]).tags or {}).get(TAG, "")
        if note not in have.split("\n"):
            client.set_model_version_tag(v["name"], v["version"], TAG, f"{have}\n{note}".strip()[-5000:])
    return versions


def split_by_exclusion(table, exclusions: Iterable[Exclusion]):
    """(k, the rows of an Arrow table (``source``, ``url``) that exclusion k takes and no earlier one took); the
    table's keys normalised once for all of them (:meth:`Matcher.masks`)."""
    taken = None
    for k, hit in enumerate(Matcher(exclusions).masks(table)):
        yield k, table.filter(hit if taken is None else pc.and_(hit, pc.invert(taken)))
        taken = hit if taken is None else pc.or_(taken, hit)


def filter_record(applied: TakedownList, removed: Path, n_removed: int) -> dict:
    """The filter stage's ``extra.takedown``: the list it applied (``list_sha256``: of the bytes it read, null when
    the list held no exclusion), the docs it removed (reason ``takedown``; ``removed``, the stage's output, holds
    them) and how many of them each exclusion took (``by_exclusion``)."""
    import pyarrow.dataset as ds

    data = ds.dataset(str(removed), format="parquet")
    per = [0] * len(applied.exclusions)
    if n_removed and "filter_reason" in data.schema.names:
        t = data.to_table(columns=[c for c in ("source", "url") if c in data.schema.names],
                          filter=ds.field("filter_reason") == "takedown")
        per = [part.num_rows for _, part in split_by_exclusion(t, applied.exclusions)]
    return {"exclusions": len(applied.exclusions), "list_sha256": applied.sha256, "removed": n_removed,
            "by_exclusion": [{"source": e.source, "docs_removed": n} for e, n in zip(applied.exclusions, per)]}
