"""Lineage and takedown: what a registered model saw, which corpus versions and models hold a doc or a source, and the
takedown list that no new corpus version may hold a source of. ``python -m pipelines.lineage`` is the CLI.

Everything is read from what the stages already record: a registered version's ``data_manifest_hash`` tag is the
digest of the tokenize manifest it was trained on (a *corpus version*); a corpus version names the one it extends
(``extra.corpus.previous``), its stages' manifests (``lineage``) name the ingested inputs (key, size, sha256), the docs
each version added are the decontaminate (or filter) stage's kept docs (with ``source`` and ``url``), and every
shard has its doc ids beside it (``<shard>.ids.parquet``). The corpus versions are those under ``run.root``.

**Keys.** A source is an input's key as ingest records it (a doc's ``source``: its path under the project root, its
absolute path elsewhere, its ``s3://`` URI) or a URL prefix. Both sides are compared normalised (:func:`input_key`,
:func:`url_key`, :func:`source_key`): Unicode NFC; a local path given by the user resolved as ingest resolves it
(``./x.jsonl``, the absolute path and ``x.jsonl`` are one key); a URL as the WHATWG URL parser reads it, the parser
the URL filter and browsers use (:func:`whatwg_key`: the host a browser would connect to, the path with dot segments
resolved and unreserved characters' %-escapes decoded). A URL prefix takes the URLs (and ``s3://`` keys) at or under
it, at a host or path boundary: ``https://a.example`` takes ``https://a.example/x``, never
``https://a.example.evil.org/``; ``https://a.example/take`` takes ``…/take`` and ``…/take/x``, never
``…/takeover``; a local directory's key takes the files under it. A table's keys are normalised once per distinct
value and compared vectorised (:meth:`Matcher.masks`).

**The takedown list** (``data.exclusions``, one JSON object a line: ``source``, ``reason``, ``added_at``; a missing
file is an empty list): a stage reads it once (:func:`read_list`: the exclusions and the sha256 of exactly the bytes
read) and records that digest; the tokenize stage publishes a corpus version only while the list is the one it
applied (:func:`list_held`: a shared lock beside the list, taken for the final rename only, that :func:`add` waits
for). Every wait for the lock is bounded (:data:`LOCK_WAIT_S`), and a lock that cannot be taken fails the command
(:class:`ListUnavailable`, exit 75), never skips it: the list's directory must support ``flock``.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import string
import sys
import time
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

from ada_url import parse_url

from pipelines.data.sources import file_key
from pipelines.manifest import Manifest, StageError, lineage, load_manifest, now_iso
from pipelines.spec import JobSpec, resolve_path
from pipelines.exit_codes import RETRY

TAG = "takedown.pending"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_PARTS = ("protocol", "hostname", "port", "pathname", "search", "hash")
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
_UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")  # RFC 3986: %-escaped or not, the same
# a URL that whatwg_key gives back as it is (most URLs in data): a lower-case special scheme, a host of lower-case
# ASCII labels whose last starts with a letter (no IPv4 number), no port, no user info, a path with no %-escape and
# no character the parser escapes, a plain query and fragment, neither empty; unless _SLOW finds a punycode label
# or a dot segment
_AS_IS = re.compile(r"(?:https?|wss?|ftp)://(?:[a-z0-9_-]+\.)*[a-z][a-z0-9_-]*/[A-Za-z0-9._~!$&'()*+,;=:@/-]*"
                    r"(?:\?[A-Za-z0-9._~!$&()*+,;=:@/?%-]+)?(?:#[A-Za-z0-9._~!$&()*+,;=:@/?%-]+)?")
_SLOW = re.compile(r"xn--|/\.\.?(?:[/?#]|$)")
LOCK_WAIT_S = 120.0  # the longest a stage or an --exclude-source waits for the list's lock (each holds it briefly)
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class NothingMatched(StageError):
    """A ``--strict`` query or takedown that no corpus version holds anything of (exit 1)."""

    exit_code = 1


class ListUnavailable(StageError):
    """The takedown list or its lock cannot be used now (the lock held past its deadline, a file system without
    ``flock``, a lock file or list that cannot be opened or written): nothing was done, never anything unlocked;
    exit 75 (``RETRY``: orchestrators retry it)."""

    exit_code = RETRY


# an OSError reading a manifest that no retry mends (a missing or forged path, permissions); any other is storage's
_NOT_STORAGE = {None, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG,
                errno.ELOOP, errno.EINVAL}


def storage_error(e: Exception) -> bool:
    """Whether ``e`` is storage's (a retry may read it), not a missing, forged or damaged file's."""
    return isinstance(e, VersionUnreadable) or (isinstance(e, OSError) and e.errno not in _NOT_STORAGE)


class VersionUnreadable(StageError):
    """A corpus version's manifest that storage did not return (an I/O error, not a missing or damaged file):
    exit 75 (``RETRY``: orchestrators retry it)."""

    exit_code = RETRY


# -- keys -------------------------------------------------------------------------------------------------------------

def is_url(key: str) -> bool:
    return bool(_SCHEME.match(key))


def _unescape(m: re.Match) -> str:
    c = chr(int(m.group(1), 16))
    return c if c in _UNRESERVED else f"%{m.group(1).upper()}"


def whatwg_key(url: str) -> Optional[str]:
    """``url`` as lineage compares it, read by the WHATWG URL parser (``ada-url``, as the URL filter and browsers
    read it): scheme and host lower-cased, the host by UTS #46 and in punycode (``faß.de`` is ``xn--fa-hia.de``), an
    IPv4 address in any form dotted (``0x7f.1`` is ``127.0.0.1``), an IPv6 address compressed, a trailing dot, user
    info and a default port dropped, ``\\`` read as ``/``, dot segments resolved, the path's %-escapes of unreserved
    characters decoded (``%7Eu`` is ``~u``) and the others upper-cased, an empty path written ``/``. None when the
    parser refuses it (a bad host or port: no browser opens it) or it has no host."""
    try:
        p = parse_url(url, attributes=_PARTS)
    except ValueError:
        return None
    host = p["hostname"].lower().rstrip(".")
    if not host:
        return None
    path = _ESCAPE.sub(_unescape, p["pathname"]) if "%" in p["pathname"] else p["pathname"]
    port = f":{p['port']}" if p["port"] else ""
    return f"{p['protocol'].lower()}//{host}{port}{path or '/'}{p['search']}{p['hash']}"


def as_is(url: str) -> bool:
    """:func:`url_key` gives ``url`` back as it is (``_AS_IS``, the parser not called: :func:`_url_keys` finds these
    vectorised)."""
    return _AS_IS.fullmatch(url) is not None and _SLOW.search(url) is None


def url_key(url: str) -> str:
    """A URL from the data (a doc's ``url``, a ``source`` that is a URL) as lineage compares it (NFC, then
    :func:`whatwg_key`); one the parser refuses (or without a host) is compared as written, NFC: it takes no valid
    prefix's URLs unless it starts with one's exact text at a boundary. Never raises."""
    if as_is(url):
        return url
    url = unicodedata.normalize("NFC", url)
    return whatwg_key(url) or url


@functools.lru_cache(maxsize=4096)
def input_key(key: str) -> str:
    """A recorded key (a doc's ``source``, a list entry) as lineage compares it: NFC, and a URL (``scheme://…``) as
    :func:`url_key` writes it. Never raises: keys come from data."""
    return url_key(key) if is_url(key) else unicodedata.normalize("NFC", key)


def check_text(text: str, what: str) -> str:
    """``text`` stripped, or ValueError: empty, or holding a control character (a newline would forge a line of the
    list or of a tag)."""
    t = (text or "").strip() if isinstance(text, str) else ""
    if not t:
        raise ValueError(f"an empty {what}")
    if any(ord(c) < 32 or ord(c) == 127 for c in t):
        raise ValueError(f"the {what} {t[:80]!r} holds a control character (a newline, a tab …)")
    return t


def source_key(text: str) -> str:
    """What a user (``--source``, ``--exclude-source``) or a list line names, as lineage compares it: a URL prefix
    (:func:`whatwg_key`; one the parser refuses, or without a host, is refused), a local path resolved as ingest
    resolves its inputs; ValueError otherwise."""
    s = unicodedata.normalize("NFC", check_text(text, "source (an input's key or a URL prefix)"))
    if is_url(s):
        key = whatwg_key(s)
        if key is None:
            raise ValueError(f"{s[:200]!r}: not a URL with a host (the WHATWG URL parser, the URL filter's and "
                             "browsers', refuses it or finds no host: a bad host or port?); a URL prefix needs a "
                             "host (https://example.com/…)")
        return key
    if "://" in s:
        raise ValueError(f"{s[:200]!r}: not a URL (scheme://host/…) and not a path")
    try:
        return input_key(file_key(resolve_path(s).resolve()))
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{s[:200]!r}: not a path ({e})") from None


def _prefix(key: str) -> str:
    return key[:-1] if key.endswith("/") and "?" not in key and "#" not in key else key


def _bounds(prefix: str) -> tuple[str, ...]:
    """What may follow a prefix in a key under it: a URL's path, query or fragment (after a query: another
    parameter or the fragment); a local directory's ``/``."""
    return ("&", "#") if "?" in prefix else ("/", "?", "#") if is_url(prefix) else ("/",)


def under_prefix(key: str, prefix: str) -> bool:
    """``key`` (an :func:`input_key` or :func:`url_key`) is ``prefix`` (as :class:`Matcher` keeps it) or lies under
    it, at a host or path boundary."""
    if not key.startswith(prefix):
        return False
    rest = key[len(prefix):]
    return not rest or rest[0] in _bounds(prefix)


def _under_mask(keys, prefix: str):
    """:func:`under_prefix` over an Arrow string array (null where ``keys`` is null)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    after = pc.utf8_slice_codeunits(keys, start=len(prefix), stop=len(prefix) + 1)  # code points, as len()
    return pc.and_kleene(pc.starts_with(keys, pattern=prefix),
                         pc.is_in(after, value_set=pa.array(["", *_bounds(prefix)], pa.string())))


def _url_keys(values):
    """:func:`url_key` of an Arrow string array: the URLs it gives back as they are found vectorised (the same
    patterns as :func:`as_is`), only the others parsed one by one."""
    import pyarrow as pa
    import pyarrow.compute as pc

    fast = pc.and_kleene(pc.match_substring_regex(values, f"^(?:{_AS_IS.pattern})$"),
                         pc.invert(pc.match_substring_regex(values, _SLOW.pattern)))
    slow = pc.invert(pc.fill_null(fast, True))  # a null stays null
    keys = [url_key(v) for v in values.filter(slow).to_pylist()]
    return pc.replace_with_mask(values, slow, pa.array(keys, values.type)) if keys else values


def _distinct_keys(column, key):
    """(the distinct values of an Arrow column as ``key`` writes them, each row's index among them, None when every
    row's value is distinct: the values are the rows then): each value is normalised once, however many rows hold
    it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    values = pc.unique(column)  # in the order they first appear
    keys = (_url_keys(values) if key is url_key else
            pa.array([None if v is None else key(v) for v in values.to_pylist()], values.type))
    return keys, (None if len(values) == len(column) else pc.index_in(column, value_set=values))


def _per_row(mask, rows):
    import pyarrow.compute as pc

    return mask if rows is None else pc.take(mask, rows)


class Matcher:
    """Which docs a set of sources takes: ``source`` at or under one of them (a local directory's key takes the
    files under it, as ``s3://bucket/dir`` does), or ``url`` at or under one that is a URL prefix. Sources as
    :func:`source_key` gives them (an :class:`Exclusion`'s is), kept in their order."""

    def __init__(self, sources: Iterable[Exclusion | str]):
        self.keys = tuple(input_key(e.source if isinstance(e, Exclusion) else e) for e in sources)
        self.prefixes = tuple(_prefix(k) for k in self.keys)
        self.url_prefixes = tuple(p for p in self.prefixes if is_url(p))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def hit(self, source: Optional[str], url: Optional[str]) -> bool:
        """One doc (the filter stage's Spark tasks ask per row; :meth:`masks` is the same over a table)."""
        src = input_key(source) if isinstance(source, str) else None
        if src is not None and any(under_prefix(src, p) for p in self.prefixes):
            return True
        if not isinstance(url, str) or not self.url_prefixes:
            return False
        key = url_key(url)
        return any(under_prefix(key, p) for p in self.url_prefixes)

    def masks(self, table) -> list:
        """Per source, in order, a boolean array over an Arrow table's rows (``source``, and ``url`` when it has
        one): the rows it takes. Each distinct ``source`` and ``url`` is normalised once; each prefix is compared
        over them vectorised."""
        import pyarrow.compute as pc

        if not self.keys:
            return []
        src, src_rows = _distinct_keys(table.column("source"), input_key)
        urls = (_distinct_keys(table.column("url"), url_key)
                if "url" in table.column_names and self.url_prefixes else None)
        out = []
        for p in self.prefixes:
            hit = _per_row(_under_mask(src, p), src_rows)
            if urls is not None and is_url(p):
                hit = pc.or_kleene(hit, _per_row(_under_mask(urls[0], p), urls[1]))
            out.append(pc.fill_null(hit, False))
        return out

    def mask(self, table):
        """A boolean array over an Arrow table's rows: the rows any of the sources takes."""
        import pyarrow as pa
        import pyarrow.compute as pc

        return functools.reduce(pc.or_, self.masks(table), pa.repeat(False, table.num_rows))


# -- the takedown list ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Exclusion:
    source: str
    reason: str
    added_at: str = ""


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
        raise ListUnavailable(f"cannot read the takedown list {path} ({e.strerror or e})") from None
    found = tuple(_parse(data, path))
    return TakedownList(path, found, hashlib.sha256(data).hexdigest() if found else None)


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
        raise ListUnavailable(f"cannot open the takedown list's lock {lock} ({e.strerror or e}); nothing was done: "
                              "this user must be able to create or read that file beside data.exclusions") from None


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
    import fcntl

    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    deadline, pause, told = time.monotonic() + wait_s, 0.01, False
    while True:
        try:
            fcntl.flock(fd, mode)
            return
        except BlockingIOError:
            pass
        except OSError as e:  # ENOLCK, EOPNOTSUPP, EINVAL: not a lock this file system keeps
            raise ListUnavailable(f"cannot lock {lock} ({e.strerror or e}): the directory of data.exclusions must "
                                  "support flock (a local disk, NFSv4, Lustre mounted with -o flock); nothing was "
                                  "done") from None
        if time.monotonic() >= deadline:
            raise ListUnavailable(f"the takedown list's lock {lock} is still held after {wait_s:g} s "
                                  f"({_holder(fd)}); nothing was done; run it again once its holder is done")
        if not told:
            print(f"takedown list: waiting up to {wait_s:g} s for {lock} ({_holder(fd)})", file=sys.stderr,
                  flush=True)
            told = True
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(2 * pause, 1.0)


@contextlib.contextmanager
def locked(path: Path, exclusive: bool = False, wait_s: float = LOCK_WAIT_S):
    """The lock beside the takedown list at ``path`` (``.<name>.lock``), shared or exclusive, waited for at most
    ``wait_s`` seconds (:class:`ListUnavailable`: never the list unlocked); the exclusive holder names itself in
    it."""
    import socket

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
            raise ListUnavailable(f"cannot write the takedown list {path} ({e.strerror or e}); run the same "
                                  "command again (an exclusion already there is kept once)") from None
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
    import pyarrow.compute as pc

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


# -- corpus versions --------------------------------------------------------------------------------------------------

def corpus_versions(spec: JobSpec) -> list[Manifest]:
    """Every committed tokenize manifest under ``run.root``, oldest version first."""
    found = []
    for p in sorted((resolve_path(spec.run.root) / "tokenize").glob("*/manifest.json")):
        try:
            found.append(load_manifest(p))
        except OSError as e:
            if storage_error(e):  # not a missing file: a version that may hold what is asked
                raise VersionUnreadable(f"{p} could not be read now ({e}); run it again") from None
        except ValueError:
            continue  # a half-written or foreign file: not a corpus version
    return sorted(found, key=lambda m: (m.extra.get("corpus", {}).get("version", 0), str(m.path)))


def chain(tok: Manifest) -> list[Manifest]:
    """``tok`` and the versions it extends, newest first."""
    out, seen = [tok], {str(tok.path)}
    while prev := previous_version(out[-1]):
        if prev in seen:
            break
        seen.add(prev)
        try:
            out.append(load_manifest(prev))
        except (ValueError, OSError) as e:
            if storage_error(e):  # storage, not the corpus
                raise VersionUnreadable(f"{out[-1].path}: the corpus version it extends, {prev}, could not be read "
                                        f"now ({e}); the task's retry reads it again") from None
            raise StageError(f"{out[-1].path}: the corpus version it extends, {prev}, cannot be read ({e})") from None
    return out


def previous_version(tok: Manifest) -> Optional[str]:
    """The manifest path of the version ``tok`` extends (None for a first version)."""
    corpus = tok.extra.get("corpus")
    prev = corpus.get("previous") if isinstance(corpus, dict) else None
    if prev is not None and not isinstance(prev, str):
        raise StageError(f"{tok.path}: extra.corpus.previous is {prev!r}, not the path of a manifest")
    return prev


def _stage(tok: Manifest, stage: str) -> Optional[Manifest]:
    path = lineage(tok.path).get(stage)
    return load_manifest(path) if path else None


def added_docs(tok: Manifest, columns: list[str], where=None):
    """The docs this version added (the decontaminate stage's kept docs, else the filter stage's), as an Arrow table
    of ``columns`` that exist (the rows ``where``, a pyarrow expression, holds for)."""
    import pyarrow.dataset as ds

    up = _stage(tok, "decontaminate") or _stage(tok, "filter")
    if up is None:
        raise StageError(f"{tok.path}: no filter or decontaminate stage in its lineage")
    data = ds.dataset(str(up.output("kept")), format="parquet")
    return data.to_table(columns=[c for c in columns if c in data.schema.names], filter=where)


def inputs_of(tok: Manifest) -> list[dict]:
    """The inputs of the corpus version: each ingested file (key, bytes, sha256) with the version that added it."""
    out, seen = [], set()
    for v in reversed(chain(tok)):
        ing = _stage(v, "ingest")
        for i in ing.inputs if ing else []:
            held = v.extra.get("corpus", {}).get("inputs", [])
            if "stage" in i or i["sha256"] in seen or i["sha256"] not in held:
                continue
            seen.add(i["sha256"])
            out.append({"key": i.get("key") or i["uri"], "bytes": i.get("bytes"), "sha256": i["sha256"],
                        "corpus_version": v.extra["corpus"].get("version")})
    return out


def docs_per_source(tok: Manifest) -> dict[str, int]:
    from collections import Counter

    counts = Counter()
    for v in chain(tok):
        counts.update(added_docs(v, ["source"]).column("source").to_pylist())
    return dict(sorted(counts.items()))


def held_in_shards(tok: Manifest, ids: set[str]):
    """(shard prefix, the entries of ``ids`` it holds) for each of the version's shards (the ones it links from
    earlier versions included) that holds any."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    wanted = pa.array(sorted(ids), pa.string())
    for sh in tok.extra.get("shards", []):
        col = pq.read_table(tok.dir / (sh["prefix"] + ".ids.parquet"), columns=["id"]).column("id")
        got = col.filter(pc.is_in(col, value_set=wanted))
        if len(got):
            yield sh["prefix"], got


def shards_holding(tok: Manifest, ids: set[str]) -> dict[str, int]:
    """{shard prefix: how many of ``ids`` it holds} over the version's shards."""
    return {prefix: len(got) for prefix, got in held_in_shards(tok, ids)}


def with_tails(ids: Iterable[str]) -> set[str]:
    """``ids`` and the ``<id>#tail`` entry each may have in the shards (a one-doc input held out by tail)."""
    ids = set(ids)
    return ids | {f"{i}#tail" for i in ids}


def matching_ids(tok: Manifest, matcher: Matcher) -> list[set[str]]:
    """Per source of ``matcher``, the shard entries of ``tok`` (its chain) it takes (with their ``#tail`` entries):
    each version's added docs read and their keys normalised once for all the sources."""
    out: list[set[str]] = [set() for _ in matcher.keys]
    for v in chain(tok):
        t = added_docs(v, ["id", "source", "url"])
        for ids, hit in zip(out, matcher.masks(t)):
            ids.update(t.filter(hit).column("id").to_pylist())
    return [with_tails(ids) for ids in out]


def excluded_docs(corpus: Manifest, exclusions: tuple[Exclusion, ...]) -> dict[str, int]:
    """The shard entries of a corpus version (its chain) that the takedown list takes out: doc id (and the
    ``<id>#tail`` part of a one-doc input held out by tail) → the index of the first exclusion that takes it."""
    out: dict[str, int] = {}
    for v in chain(corpus):
        for k, part in split_by_exclusion(added_docs(v, ["id", "source", "url"]), exclusions):
            for i in with_tails(part.column("id").to_pylist()):
                out.setdefault(i, k)
    return out


# -- registered versions ----------------------------------------------------------------------------------------------

def _version_info(mv) -> dict:
    return {"name": mv.name, "version": str(mv.version), "aliases": list(getattr(mv, "aliases", []) or []),
            "run_id": mv.run_id, "corpus_digest": (mv.tags or {}).get("data_manifest_hash")}


def resolve_model(client, ref: str):
    """``NAME@ALIAS`` or ``NAME/VERSION`` → the model version."""
    if "@" in ref:
        name, alias = ref.rsplit("@", 1)
        return client.get_model_version_by_alias(name, alias)
    if "/" in ref:
        name, version = ref.rsplit("/", 1)
        return client.get_model_version(name, version)
    raise StageError(f"--model {ref!r}: write NAME@ALIAS (e.g. llm-pipeline-demo@champion) or NAME/VERSION")


def models_trained_on(client, digests: set[str]) -> list[dict]:
    """Every registered version whose corpus version is one of ``digests``."""
    out, token = [], None
    while digests:  # every version of every model, a page at a time (no filter string: names are data)
        page = client.search_model_versions(max_results=1000, page_token=token)
        for mv in page:
            if (mv.tags or {}).get("data_manifest_hash") in digests:
                out.append(_version_info(client.get_model_version(mv.name, mv.version)))
        token = page.token
        if not token:
            break
    return sorted(out, key=lambda m: (m["name"], int(m["version"])))


# -- the questions ----------------------------------------------------------------------------------------------------

def model_query(spec: JobSpec, client, ref: str) -> dict:
    mv = resolve_model(client, ref)
    info = _version_info(mv)
    tok = next((v for v in corpus_versions(spec) if v.digest == info["corpus_digest"]), None)
    try:
        return _model_answer(info, tok, spec, ref)
    except (OSError, KeyError, ValueError) as e:
        raise (VersionUnreadable if storage_error(e) else StageError)(
            f"{ref}: its corpus version cannot be read ({e})") from None


def _model_answer(info: dict, tok: Optional[Manifest], spec: JobSpec, ref: str) -> dict:
    if tok is None:
        raise StageError(f"{ref}: its corpus version (tokenize manifest digest {str(info['corpus_digest'])[:12]}) is not "
                         f"under run.root={spec.run.root}; point --set run.root=… at the runs that trained it")
    return {"model": info, "corpus": _corpus_info(tok), "inputs": inputs_of(tok), "docs_per_source": docs_per_source(tok)}


def _corpus_info(tok: Manifest) -> dict:
    return {"manifest": str(tok.path), "version": tok.extra.get("corpus", {}).get("version"),
            "digest": tok.digest, "docs": tok.counts.get("docs"), "tokens": tok.counts.get("tokens")}


def _each_version(spec: JobSpec, fn) -> tuple[list[dict], list[dict]]:
    """``fn(tok)`` (a dict, or None when the version does not hold what is asked) for every corpus version; a version
    that cannot be read is listed as unreadable instead of ending the query."""
    found, unreadable = [], []
    for tok in corpus_versions(spec):
        try:
            r = fn(tok)
        except (StageError, OSError, KeyError, ValueError) as e:
            unreadable.append({"manifest": str(tok.path), "error": str(e).splitlines()[0] if str(e) else repr(e),
                               "storage": storage_error(e)})
            continue
        if r is not None:
            found.append({**_corpus_info(tok), **r})
    return found, unreadable


def _digests(versions: list[dict]) -> set[str]:
    return {v["digest"] for v in versions}


def doc_query(spec: JobSpec, client, doc_id: str) -> dict:
    def holds(tok):
        shards = shards_holding(tok, with_tails({doc_id}))
        return {"shards": sorted(shards)} if shards else None

    versions, unreadable = _each_version(spec, holds)
    return {"doc": doc_id, "corpus_versions": versions, "models": models_trained_on(client, _digests(versions)),
            "unreadable": unreadable}


def _source_key(source: str, flag: str) -> str:
    try:
        return source_key(source)
    except ValueError as e:
        raise StageError(f"{flag}: {e}") from None


def source_holders(spec: JobSpec, key: str) -> tuple[list[dict], list[dict]]:
    """The corpus versions that hold docs of ``key`` (a :func:`source_key`), and those that cannot be read."""
    matcher = Matcher([key])

    def holds(tok):
        shards = shards_holding(tok, matching_ids(tok, matcher)[0])  # a version it was taken out of: none
        return {"source_docs": sum(shards.values()), "shards": shards} if shards else None

    return _each_version(spec, holds)


def source_query(spec: JobSpec, client, source: str) -> dict:
    """``source`` (a key or URL prefix as given) normalised; the answer names the key it compared (``source``)."""
    key = _source_key(source, "--source")
    versions, unreadable = source_holders(spec, key)
    return {"source": key, "corpus_versions": versions, "models": models_trained_on(client, _digests(versions)),
            "unreadable": unreadable}


def pending_takedowns(spec: JobSpec, digest: str | None) -> Optional[list[Exclusion]]:
    """The exclusions of the takedown list whose docs the corpus version ``digest`` still holds; None when there are
    exclusions but that version is not under run.root (nothing can be said)."""
    exclusions = read_list(resolve_path(spec.data.exclusions)).exclusions
    if not exclusions:
        return []
    tok = next((v for v in corpus_versions(spec) if v.digest == digest), None) if digest else None
    if tok is None:
        return None
    per = matching_ids(tok, Matcher(exclusions))
    held = set().union(*(got.to_pylist() for _, got in held_in_shards(tok, set().union(*per))))
    return [e for e, ids in zip(exclusions, per) if not held.isdisjoint(ids)]


def exclude_source(spec: JobSpec, client, source: str, reason: str, strict: bool = False) -> dict:
    """Add ``source`` to the takedown list (``data.exclusions``) and tag every registered version trained on a corpus
    version that holds it; the next curation run publishes a version without its docs. ``strict``: a source that no
    corpus version holds is not recorded (:class:`NothingMatched`)."""
    path = resolve_path(spec.data.exclusions)
    key = _source_key(source, "--exclude-source")
    held = source_holders(spec, key) if strict else None
    if held is not None and not held[0]:
        raise NothingMatched(f"--exclude-source {key!r}: no corpus version under run.root={spec.run.root} holds docs "
                             f"of it{_unread_note(held[1])}; nothing recorded (--strict)")
    try:
        rec, added = add(path, key, reason)
    except ValueError as e:
        raise StageError(f"--exclude-source {key!r}: {e}") from None
    try:
        versions, unreadable = held if held is not None else source_holders(spec, rec.source)
        tagged = tag_versions(client, models_trained_on(client, _digests(versions)), rec)
    except Exception as e:  # noqa: BLE001 - MLflow or a corpus version: the exclusion itself is recorded
        raise StageError(f"the exclusion of {rec.source!r} is recorded in {path}, but tagging the registered versions "
                         f"that saw it failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); run "
                         "the same command again to tag them") from None
    if unread := [u for u in unreadable if u["storage"]]:  # the models trained on them are not tagged yet
        raise VersionUnreadable(f"the exclusion of {rec.source!r} is recorded in {path}, but {len(unread)} corpus "
                                f"version(s) could not be read now ({unread[0]['error']}); run the same command again "
                                "to tag the registered versions trained on them")
    return {"exclusion": {**rec.__dict__, "list": str(path), "added": added}, "corpus_versions": versions,
            "models_tagged": [{k: m[k] for k in ("name", "version")} for m in tagged], "unreadable": unreadable}


def _unread_note(unreadable: list[dict]) -> str:
    return f" ({len(unreadable)} corpus version(s) could not be read)" if unreadable else ""


def nothing_matched(res: dict, root: str) -> Optional[str]:
    """The warning for an answer (of :func:`doc_query`, :func:`source_query`, :func:`exclude_source`) that no corpus
    version holds anything of; None when one does."""
    if "model" in res or res["corpus_versions"]:
        return None
    what = f"doc {res['doc']!r}" if "doc" in res else f"docs of {(res.get('exclusion') or res)['source']!r}"
    note = ("; the exclusion is recorded all the same (docs of it ingested later are removed)" if "exclusion" in res
            else "")
    return f"no corpus version under run.root={root} holds {what}{_unread_note(res['unreadable'])}{note}"
