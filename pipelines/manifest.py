"""The manifest contract every stage follows, and the atomic, idempotent stage directory.

A stage writes its outputs into a staging directory, writes ``manifest.json`` last, then renames
the staging directory to its final, content-addressed place::

    <run.root>/<stage>/<key>/           key = sha256(stage, config_hash, input sha256s)[:16]
        ...outputs...
        manifest.json                   {stage, version, config_hash, inputs, outputs, counts, ...}

A stage is done iff its manifest exists and every output checksum verifies; then a re-run with
the same config and inputs returns the existing manifest instead of recomputing.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional
from urllib.parse import urlparse
from urllib.request import url2pathname

from pipelines.exit_codes import RETRY, USER_ERROR
from pipelines.listing import walk_files

MANIFEST_NAME = "manifest.json"
_CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_path(path: str | os.PathLike) -> str:
    """sha256 of a file, or of a directory as the hash of its sorted (relative path, file hash) list."""
    p = Path(path)
    if p.is_file():
        return sha256_file(p)
    if not p.is_dir():
        raise FileNotFoundError(f"{p} does not exist")
    h = hashlib.sha256()
    for f in sorted(x for x in walk_files(p) if x.is_file() and not _ignorable(x)):  # a failing folder raises
        h.update(f.relative_to(p).as_posix().encode())
        h.update(b"\0")
        h.update(sha256_file(f).encode())
        h.update(b"\n")
    return h.hexdigest()


def _ignorable(p: Path) -> bool:
    # Spark's per-file CRCs and the _SUCCESS marker carry no data of their own.
    return p.name.startswith(".") and p.name.endswith(".crc") or p.name == "_SUCCESS"


def path_bytes(path: str | os.PathLike) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(x.stat().st_size for x in walk_files(p) if x.is_file() and not _ignorable(x))


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def code_version() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
            capture_output=True, text=True, timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except Exception:  # pragma: no cover - git missing
        return "unknown"


@dataclass
class Manifest:
    stage: str
    config_hash: str
    inputs: list[dict] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)
    counts: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    version: int = 1
    started: str = ""
    finished: str = ""
    code_version: str = ""
    path: Optional[str] = None  # where it was read from / written to (not serialised)

    def to_json(self) -> str:
        d = asdict(self)
        d.pop("path")
        return json.dumps(d, indent=2, sort_keys=False)

    @property
    def dir(self) -> Path:
        assert self.path, "manifest has no location yet"
        return Path(self.path).parent

    def output(self, name: str) -> Path:
        """Absolute path of the output called ``name``; a path the manifest names outside its own directory (``..``,
        absolute, a symlink leading out: a manifest from storage is data) is refused (:class:`ManifestInvalid`: exit 2,
        a ``ValueError`` too)."""
        for o in self.outputs:
            if o["name"] == name:
                try:
                    return under(self.dir, o["path"])
                except ValueError as e:
                    raise ManifestInvalid(f"manifest {self.path}: output {name!r}: {e}; refusing it") from None
        raise KeyError(f"{self.stage} manifest has no output {name!r}; it has {[o['name'] for o in self.outputs]}")

    def output_sha(self, name: str) -> str:
        for o in self.outputs:
            if o["name"] == name:
                return o["sha256"]
        raise KeyError(name)

    @property
    def digest(self) -> str:
        """Identity of this stage's result: hash over its output checksums and config hash."""
        h = hashlib.sha256(self.config_hash.encode())
        for o in sorted(self.outputs, key=lambda o: o["name"]):
            h.update(f"{o['name']}={o['sha256']}".encode())
        return h.hexdigest()


def plain_rel(rel: str) -> bool:
    """Whether ``rel`` (a name from data: a manifest entry, an S3 key) is a plain relative path that stays below
    whatever directory it is joined to: not absolute, no ``..``, ``.`` or empty component, no backslash or NUL."""
    return (isinstance(rel, str) and bool(rel) and not rel.startswith("/") and "\\" not in rel and "\x00" not in rel
            and all(p not in ("", ".", "..") for p in rel.split("/")))


def under(root: Path, rel: str) -> Path:
    """``root / rel``, refused (``ValueError``) unless ``rel`` is a plain relative path and the result, symlinks
    resolved, stays below ``root``."""
    if not plain_rel(rel):
        raise ValueError(f"{rel!r} is not a plain relative path")
    out = root / rel
    if not out.resolve().is_relative_to(root.resolve()):
        raise ValueError(f"{rel!r} leads outside {root}")
    return out


def load_manifest(path: str | os.PathLike) -> Manifest:
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    if not p.is_file():
        raise FileNotFoundError(f"no manifest at {p}: run the upstream stage first")
    try:
        d = json.loads(p.read_text())
        m = Manifest(**d) if isinstance(d, dict) else None
    except (TypeError, ValueError, RecursionError) as e:  # not JSON (or nested past the parser), other fields
        raise ManifestInvalid(f"manifest {p} is not a manifest ({e})") from None
    if m is None or not all(isinstance(getattr(m, f), t) for f, t in _FIELD_TYPES) \
            or not all(isinstance(o, dict) for o in m.inputs + m.outputs) \
            or not all(isinstance(o.get(k), str) for o in m.outputs for k in ("name", "sha256")) \
            or not all(isinstance(i.get(k), str) for i in m.inputs if "stage" in i for k in ("uri", "sha256", "stage")):
        raise ManifestInvalid(f"manifest {p} is not a manifest (its fields are not of a manifest's types)")
    m.path = str(p.resolve())
    bad = [o.get("path") for o in m.outputs if not plain_rel(o.get("path"))]
    shards = m.extra.get("shards")  # a corpus version's shards (tokenize): read, linked and copied by their prefix
    if isinstance(shards, list):
        bad += [sh.get("prefix") if isinstance(sh, dict) else sh for sh in shards
                if not (isinstance(sh, dict) and plain_rel(sh.get("prefix")))]
    if bad:  # a forged or damaged manifest must not make a stage read, verify, link or remove files elsewhere
        raise ManifestInvalid(f"manifest {p}: output path(s) {bad} do not stay below its directory; refusing it")
    return m


def newest_manifest(runs: str | os.PathLike, stage: str) -> Optional[Path]:
    """The most recently written manifest of ``stage`` under ``runs`` (``runs/<stage>/<key>/manifest.json``: what a
    benchmark takes when not told which run), or None when there is none."""
    found = sorted((Path(runs) / stage).glob(f"*/{MANIFEST_NAME}"), key=os.path.getmtime)
    return found[-1] if found else None


_FIELD_TYPES = (("stage", str), ("config_hash", str), ("inputs", list), ("outputs", list), ("counts", dict),
                ("metrics", dict), ("extra", dict))


def verify_manifest(m: Manifest) -> list[str]:
    """Return a list of problems (empty = every output exists and its checksum matches)."""
    problems = []
    for o in m.outputs:
        p = m.dir / o["path"]
        if not p.exists():
            problems.append(f"{o['name']}: {p} is missing")
            continue
        got = sha256_path(p)
        if got != o["sha256"]:
            problems.append(f"{o['name']}: sha256 {got[:12]}… != manifest {o['sha256'][:12]}…")
    return problems


def input_ref(m: Manifest) -> dict:
    """How a downstream manifest records an upstream stage as its input."""
    return {"uri": Path(m.path).resolve().as_uri(), "stage": m.stage, "sha256": m.digest}


def lineage(path: str | os.PathLike, _below: frozenset[str] = frozenset()) -> dict[str, str]:
    """{stage: manifest path} of a manifest and of every upstream manifest it was made from (its ``inputs``, and
    theirs), each checked against the digest its downstream recorded: a result rewritten since is refused, and so is
    an upstream result that is gone (re-run it) or a chain that leads back to itself (a forged manifest)."""
    m = load_manifest(path)
    if m.path in _below:
        raise ManifestInvalid(f"manifest {m.path} is its own upstream (a loop in its inputs); refusing it")
    out = {m.stage: str(m.path)}
    for ref in m.inputs:
        if "stage" not in ref:
            continue
        try:
            up = load_manifest(uri_path(ref["uri"]))
        except FileNotFoundError:
            raise StageError(f"{m.stage} manifest {m.path} was made from the {ref['stage']} result at {ref['uri']}, "
                             f"which is gone: re-run from {ref['stage']}") from None
        if up.digest != ref["sha256"]:
            raise StageError(f"{m.stage} manifest {m.path} was made from another {up.stage} result than the one now "
                             f"at {up.path} (digest {ref['sha256'][:12]} ≠ {up.digest[:12]}): re-run from {up.stage}")
        out.update({k: v for k, v in lineage(up.path, _below | {m.path}).items() if k not in out})
    return out


def uri_path(uri: str) -> Path:
    """The path of a ``file://`` URI as :func:`input_ref` and :func:`file_ref` write them (``Path.as_uri``
    percent-encodes a space, ``%``, non-ASCII: ``/runs/LLM runs/é`` is ``file:///runs/LLM%20runs/%C3%A9``)."""
    return Path(url2pathname(urlparse(uri).path))


def file_ref(path: str | os.PathLike) -> dict:
    p = Path(path).resolve()
    return {"uri": p.as_uri(), "sha256": sha256_path(p)}


def stage_key(stage: str, config_hash: str, inputs: Iterable[dict]) -> str:
    h = hashlib.sha256(f"{stage}:{config_hash}".encode())
    for i in inputs:
        h.update(i["sha256"].encode())
    return h.hexdigest()[:16]


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def read_small_text(path: str | os.PathLike, limit: int = 1 << 16) -> str:
    """A small control file written by another process (a shared directory others can write): read only when it
    is a regular file, not through a link, not blocking on a FIFO, at most ``limit`` bytes; else ``OSError``
    (``ValueError`` when it is larger)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{path}: {st.st_size} bytes, more than the {limit} a control file may have")
        return os.read(fd, limit + 1).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def read_json_record(path: str | os.PathLike) -> dict | None:
    """A JSON object this pipeline wrote at ``path`` (a cache's or an export's record); None when there is none,
    or it is not one (torn by a crash, another writer's half): the caller treats it as absent. A read that fails
    (EIO, a refusal) is raised: storage that did not answer is not "no record"."""
    try:
        got = json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def is_temp_name(name: str) -> bool:
    """A temp file of :func:`atomic_write_bytes` (``.<name>.tmp-<id>``)."""
    return name.startswith(".") and ".tmp-" in name


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file beside ``path``, fsync, rename: a reader sees the old file or the whole new one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


class StageError(RuntimeError):
    """An input or a spec the user must fix: the stage CLI prints it as ``<stage>: error: …`` and exits with
    ``exit_code`` (2: orchestrators do not retry it)."""

    exit_code = USER_ERROR


class KeyBusy(StageError):
    """Another run of the same stage key holds its lock and has not shown it is alive (its heartbeat on the lock
    file) for ``run.lock_stale_min``: exit 75, for the orchestrator's retry to look again (a hung or lost holder is
    thus seen, not waited on for ever; a live one, however long it runs, is waited for)."""

    exit_code = RETRY


class ManifestInvalid(StageError, ValueError):
    """A file in a manifest's place that is not one (not JSON, other fields or types than a manifest's, outputs that
    leave its directory): exit 2; a ``ValueError`` too, for the callers that pass over a damaged or foreign file."""


class Pending(Exception):
    """The stage's work runs elsewhere (a submitted job): its CLI reports ``wait`` (what to poll) and exits 0,
    for an orchestrator that waits without holding a worker, then runs the stage again to collect."""

    def __init__(self, wait: dict):
        super().__init__(f"pending: {wait}")
        self.wait = wait


class StageDir:
    """Staging area for one stage run; :meth:`commit` publishes it atomically.

    Usage::

        sd = StageDir(root, "ingest", config_hash, inputs)
        if (done := sd.existing()) is not None: return done
        ... write files under sd.tmp ...
        return sd.commit(outputs={"docs": "docs.parquet"}, counts=..., metrics=...)
    """

    def __init__(self, root: str | os.PathLike, stage: str, config_hash: str, inputs: list[dict],
                 force: bool = False, out_dir: str | os.PathLike | None = None, lock_stale_s: float = 600.0):
        self.stage = stage
        self.lock_stale_s = lock_stale_s  # run_stage waits for another run of this key while it beats, no longer
        self.config_hash = config_hash
        self.inputs = inputs
        self.force = force
        self.final = Path(out_dir).resolve() if out_dir else (
            Path(root).resolve() / stage / stage_key(stage, config_hash, inputs))
        if out_dir:
            check_output_dir(self.final, stage)
        self.tmp = self.final.with_name(f".{self.final.name}.tmp-{uuid.uuid4().hex[:8]}")
        self.started = now_iso()

    def existing(self) -> Optional[Manifest]:
        """The committed manifest if it exists, has this config hash and these inputs, verifies, and ``force`` is
        off."""
        if self.force or not (self.final / MANIFEST_NAME).is_file():
            return None
        try:
            m = load_manifest(self.final)
        except (ValueError, TypeError):
            return None
        if m.config_hash != self.config_hash or verify_manifest(m):
            return None
        if [i["sha256"] for i in m.inputs] != [i["sha256"] for i in self.inputs]:
            return None  # an explicit --output keeps its path when the inputs change: compare them too
        return m

    def __enter__(self) -> "StageDir":
        self.tmp.mkdir(parents=True, exist_ok=False)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp.exists():  # failure, or commit already moved it
            shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, outputs: dict[str, str], counts: dict | None = None, metrics: dict | None = None,
               extra: dict | None = None) -> Manifest:
        return self.publish(self.prepare(outputs, counts, metrics, extra))

    def prepare(self, outputs: dict[str, str], counts: dict | None = None, metrics: dict | None = None,
                extra: dict | None = None) -> Manifest:
        """The first half of :meth:`commit`: every output hashed and ``manifest.json`` written into the staging
        directory; nothing is published until :meth:`publish`."""
        outs = []
        for name, rel in outputs.items():
            p = self.tmp / rel
            if not p.exists():
                raise FileNotFoundError(f"{self.stage}: declared output {name!r} was not written ({p})")
            outs.append({
                "name": name, "path": rel, "uri": (self.final / rel).as_uri(),
                "sha256": sha256_path(p), "bytes": path_bytes(p),
            })
        m = Manifest(
            stage=self.stage, config_hash=self.config_hash, inputs=self.inputs, outputs=outs,
            counts=counts or {}, metrics=metrics or {}, extra=extra or {},
            started=self.started, finished=now_iso(), code_version=code_version(),
        )
        atomic_write_text(self.tmp / MANIFEST_NAME, m.to_json())  # written last
        return m

    def publish(self, m: Manifest) -> Manifest:
        """The second half of :meth:`commit`: the staging directory :meth:`prepare` wrote renamed to its final place
        (a result there before is moved aside first, removed after)."""
        trash = None
        if self.final.exists():
            trash = self.final.with_name(f".{self.final.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(self.final, trash)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.tmp, self.final)
        m.path = str(self.final / MANIFEST_NAME)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        return m


def check_output_dir(d: Path, stage: str) -> None:
    """An ``--output`` directory must be new, empty, or a result of the same stage (which a commit replaces): a
    folder holding anything else is the user's, and is refused before anything is written."""
    if d.exists() and not d.is_dir():
        raise StageError(f"--output {d} is a file, not a directory; choose a new or empty directory")
    if not d.is_dir() or not any(d.iterdir()):
        return
    try:
        other = load_manifest(d).stage
    except (FileNotFoundError, ValueError, TypeError, KeyError, StageError):
        other = None
    if other != stage:
        what = f"a {other} result" if other else "files that are not a stage result"
        raise StageError(f"--output {d} holds {what}; a {stage} result would replace them: choose a new or empty "
                         "directory (nothing was written)")


def wait_for_lock(f, path: Path, holder: str, stale_s: float) -> None:
    """Take the lock on ``f`` once its holder lets go, polling without blocking (a blocking ``flock`` could not be
    bounded). The holder touches the lock file every :data:`LOCK_BEAT_S`; a file unchanged for ``stale_s`` of this
    process's clock (no other host's clock is compared) is a holder that hangs or is lost: :class:`KeyBusy`."""
    seen, since = beat_of(path), time.monotonic()
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now, beat = time.monotonic(), beat_of(path)
            if beat != seen:
                seen, since = beat, now
            elif now - since >= stale_s:
                raise KeyBusy(f"another run of this stage key holds {holder} and has not shown it is alive for "
                              f"{stale_s / 60:g} min (run.lock_stale_min): retry later, or stop that run") from None
            time.sleep(LOCK_POLL_S)


def beat_of(path: Path) -> int | None:
    """The lock file's modification time (ns): what the holder's heartbeat changes."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


@contextlib.contextmanager
def heartbeat(path: Path):
    """Touch ``path`` every :data:`LOCK_BEAT_S` while the block runs (a thread of this process)."""
    stop = threading.Event()

    def beat():
        while not stop.wait(LOCK_BEAT_S):
            try:
                os.utime(path)
            except OSError:  # a waiter then sees no beat and gives up (75): nothing is lost
                pass

    t = threading.Thread(target=beat, name="llmp-key-lock-beat", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=5)


def run_stage(sd: StageDir, body: Callable[[Path], Manifest], log: Callable[[str], None] = print,
              housekeeping: Optional[Callable[[], None]] = None) -> Manifest:
    """Skip if done, else run ``body(tmp_dir)`` inside the staging dir (which calls sd.commit). One run of a
    stage key at a time: the split DAGs and ``llm_pipeline`` share keys, and a second run waits for the first,
    then reuses what it committed. ``housekeeping()`` runs once the output is there (committed now or found done),
    still under the key's lock; it must not raise."""
    with key_lock(sd.final, lambda holder: log(f"[{sd.stage}] another run of this stage key holds {holder}; "
                                                f"waiting for it while it shows it is alive"), sd.lock_stale_s):
        done = sd.existing()
        if done is not None:
            log(f"[{sd.stage}] up to date: {done.path} (use run.force=true to recompute)")
        else:
            with sd:
                done = body(sd.tmp)
        if housekeeping is not None:
            housekeeping()
        return done


LOCK_POLL_S = 1.0  # how often a waiter tries the lock again
LOCK_BEAT_S = 30.0  # how often the holder touches the lock file (run.lock_stale_min is at least 1 min)


@contextlib.contextmanager
def key_lock(final: Path, on_wait: Callable[[str], None], stale_s: float = 600.0):
    """An exclusive ``flock`` on ``.<key>.lock`` beside the stage's output (FSx for Lustre is mounted with
    ``flock``), held while the stage runs; the lock file names its holder and carries its heartbeat for whoever
    waits (:func:`wait_for_lock`: as long as the holder beats, then :class:`KeyBusy`, exit 75)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    path = final.with_name(f".{final.name}.lock")
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f"{path} ({f.read().strip() or 'holder unknown'})"
            on_wait(holder)
            wait_for_lock(f, path, holder, stale_s)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {now_iso()}\n")
        f.flush()
        try:
            with heartbeat(path):
                yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
