"""Lineage and takedown: what a registered model saw, which corpus versions and models hold a doc or a source, and the
takedown list that no new corpus version may hold a source of. ``python -m pipelines.lineage`` is the CLI.

Everything is read from what the stages already record: a registered version's ``data_manifest_hash`` tag is the
digest of the tokenize manifest it was trained on (a *corpus version*); a corpus version names the one it extends
(``extra.corpus.previous``), its stages' manifests (``lineage``) name the ingested inputs (key, size, sha256), the docs
each version added are the decontaminate (or filter) stage's kept docs (with ``source`` and ``url``), and every
shard has its doc ids beside it (``<shard>.ids.parquet``). The corpus versions are those under ``run.root``.

**Keys.** A source is an input's key as ingest records it (a doc's ``source``: its path under the project root, its
absolute path elsewhere, its ``s3://`` URI) or a URL prefix. Both sides are compared normalised (:func:`input_key`,
:func:`source_key`): Unicode NFC; a local path given by the user resolved as ingest resolves it (``./x.jsonl``, the
absolute path and ``x.jsonl`` are one key); a URL's scheme and host lower-cased, the host in IDNA, a default port
dropped, an empty path written ``/``. A URL prefix takes the URLs (and ``s3://`` keys) at or under it, at a host or
path boundary: ``https://a.example`` takes ``https://a.example/x``, never ``https://a.example.evil.org/``;
``https://a.example/take`` takes ``…/take`` and ``…/take/x``, never ``…/takeover``.

**The takedown list** (``data.exclusions``, one JSON object a line: ``source``, ``reason``, ``added_at``): a stage
reads it once (:func:`read_list`: the exclusions and the sha256 of exactly the bytes read) and records that digest;
the tokenize stage publishes a corpus version only while the list is the one it applied (:func:`list_held`: a shared
lock that :func:`add` waits for).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import time
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional
from urllib.parse import urlsplit, urlunsplit

from pipelines.data.sources import file_key
from pipelines.manifest import Manifest, StageError, lineage, load_manifest
from pipelines.spec import JobSpec, resolve_path

TAG = "takedown.pending"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443, "ftp": 21}


class NothingMatched(StageError):
    """A ``--strict`` query or takedown that no corpus version holds anything of (exit 1)."""


# -- keys -------------------------------------------------------------------------------------------------------------

def is_url(key: str) -> bool:
    return bool(_SCHEME.match(key))


def _host(host: str) -> str:
    host = host.rstrip(".")
    if host.isascii():
        return host.lower()
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:  # not a valid IDNA name: compared as written, lower-cased
        return host.lower()


def url_key(url: str) -> str:
    """A URL as lineage compares it: scheme and host lower-cased, the host in IDNA, no user info, a default port
    dropped, an empty path written ``/``; one that does not parse is left as it is (never raises)."""
    try:
        p = urlsplit(url)
        host, port = p.hostname, p.port
    except ValueError:
        return url
    if not host:
        return url
    scheme, host = p.scheme.lower(), _host(host)
    netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port and port != DEFAULT_PORTS.get(scheme) else "")
    return urlunsplit((scheme, netloc, p.path or "/", p.query, p.fragment))


@functools.lru_cache(maxsize=4096)
def input_key(key: str) -> str:
    """A recorded key (a doc's ``source``, a doc's ``url``, a list entry) as lineage compares it: NFC, and a URL as
    :func:`url_key` writes it. Never raises: keys come from data."""
    key = unicodedata.normalize("NFC", key)
    return url_key(key) if is_url(key) else key


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
    normalised (it needs a host), a local path resolved as ingest resolves its inputs; ValueError otherwise."""
    s = unicodedata.normalize("NFC", check_text(text, "source (an input's key or a URL prefix)"))
    if is_url(s):
        key = url_key(s)
        try:
            host = urlsplit(key).hostname
        except ValueError as e:  # a bracketed host that is not an IPv6 address, a port that is not a number
            raise ValueError(f"{s[:200]!r}: not a URL ({e})") from None
        if not host:
            raise ValueError(f"{s[:200]!r}: a URL prefix needs a host (https://example.com/…)")
        return key
    if "://" in s:
        raise ValueError(f"{s[:200]!r}: not a URL (scheme://host/…) and not a path")
    try:
        return input_key(file_key(resolve_path(s).resolve()))
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{s[:200]!r}: not a path ({e})") from None


def _prefix(key: str) -> str:
    return key[:-1] if key.endswith("/") and "?" not in key and "#" not in key else key


def under_prefix(key: str, prefix: str) -> bool:
    """``key`` (an :func:`input_key`) is ``prefix`` (as :class:`Matcher` keeps it) or lies under it, at a host or
    path boundary."""
    if not key.startswith(prefix):
        return False
    rest = key[len(prefix):]
    return not rest or rest[0] in ("&#" if "?" in prefix else "/?#")


class Matcher:
    """Which docs a set of sources takes: ``source`` equal to one of them, or ``source`` / ``url`` at or under one
    that is a URL prefix. Sources as :func:`source_key` gives them (an :class:`Exclusion`'s is)."""

    def __init__(self, sources: Iterable[Exclusion | str]):
        keys = sorted({input_key(e.source if isinstance(e, Exclusion) else e) for e in sources})
        self.keys = frozenset(keys)
        self.prefixes = tuple(_prefix(k) for k in keys if is_url(k))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def under(self, key: str) -> bool:
        return any(under_prefix(key, p) for p in self.prefixes)

    def hit(self, source: Optional[str], url: Optional[str]) -> bool:
        if isinstance(source, str) and ((k := input_key(source)) in self.keys or self.under(k)):
            return True
        return bool(self.prefixes) and isinstance(url, str) and self.under(url_key(unicodedata.normalize("NFC", url)))

    def mask(self, table):
        """A boolean array over an Arrow table's rows (``source``, and ``url`` when it has one)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        sources = table.column("source")
        taken = [s for s in pc.unique(sources).to_pylist() if self.hit(s, None)]  # few distinct keys
        hit = pc.is_in(sources, value_set=pa.array(taken, pa.string()))
        if self.prefixes and "url" in table.column_names:
            urls = pa.array([self.hit(None, u) for u in table.column("url").to_pylist()], pa.bool_())
            hit = pc.or_kleene(hit, urls)
        return pc.fill_null(hit, False)


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
    except FileNotFoundError:
        return TakedownList(path, (), None)
    found = tuple(_parse(data, path))
    return TakedownList(path, found, hashlib.sha256(data).hexdigest() if found else None)


def _lock(path: Path, mode: int):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path.with_name(f".{path.name}.lock"), "a")
    fcntl.flock(f, mode)
    return f


@contextlib.contextmanager
def list_held(path: Path):
    """The list held still (a shared lock: :func:`add` waits) while a corpus version is published; yields the
    sha256 it has now (as :attr:`TakedownList.sha256`)."""
    import fcntl

    try:
        held = _lock(path, fcntl.LOCK_SH)
    except OSError:  # no lock file can be made beside the list (a read-only mount): compared without one
        held = contextlib.nullcontext()
    with held:
        yield read_list(path).sha256


def add(path: Path, source: str, reason: str) -> tuple[Exclusion, bool]:
    """Add an exclusion to the list (``source`` normalised, :func:`source_key`), under an exclusive lock beside it
    (two takedowns at once both land; a corpus version is not published meanwhile), written whole to a temporary
    file and renamed; (the exclusion, False) when the source is excluded already."""
    import fcntl

    source, reason = source_key(source), check_text(reason, "reason (--reason)")
    with _lock(path, fcntl.LOCK_EX):
        held = read_list(path).exclusions
        for e in held:
            if e.source == source:
                return e, False
        new = Exclusion(source, reason, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(asdict(e)) + "\n" for e in [*held, new])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)
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
    """(k, the rows of an Arrow table (``source``, ``url``) that exclusion k takes and no earlier one took)."""
    import pyarrow.compute as pc

    for k, e in enumerate(exclusions):
        hit = Matcher([e]).mask(table)
        yield k, table.filter(hit)
        table = table.filter(pc.invert(hit))


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
        except (OSError, ValueError):
            continue  # a half-written or foreign file: not a corpus version
    return sorted(found, key=lambda m: (m.extra.get("corpus", {}).get("version", 0), str(m.path)))


def chain(tok: Manifest) -> list[Manifest]:
    """``tok`` and the versions it extends, newest first."""
    out, seen = [tok], {str(tok.path)}
    while (prev := out[-1].extra.get("corpus", {}).get("previous")) and prev not in seen:
        seen.add(prev)
        try:
            out.append(load_manifest(prev))
        except (OSError, ValueError) as e:
            raise StageError(f"{out[-1].path}: the corpus version it extends, {prev}, cannot be read ({e})") from None
    return out


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


def shards_holding(tok: Manifest, ids: set[str]) -> dict[str, int]:
    """{shard prefix: how many of ``ids`` it holds} over the version's shards (the ones it links from earlier
    versions included)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    wanted = pa.array(sorted(ids), pa.string())
    out = {}
    for sh in tok.extra.get("shards", []):
        col = pq.read_table(tok.dir / (sh["prefix"] + ".ids.parquet"), columns=["id"]).column("id")
        n = int(pc.sum(pc.is_in(col, value_set=wanted)).as_py() or 0)
        if n:
            out[sh["prefix"]] = n
    return out


def with_tails(ids: Iterable[str]) -> set[str]:
    """``ids`` and the ``<id>#tail`` entry each may have in the shards (a one-doc input held out by tail)."""
    ids = set(ids)
    return ids | {f"{i}#tail" for i in ids}


def matching_ids(tok: Manifest, matcher: Matcher) -> set[str]:
    """Shard entries of ``tok`` (its chain) that ``matcher`` takes (with their ``#tail`` entries)."""
    ids: set[str] = set()
    for v in chain(tok):
        t = added_docs(v, ["id", "source", "url"])
        ids.update(t.filter(matcher.mask(t)).column("id").to_pylist())
    return with_tails(ids)


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
        raise StageError(f"{ref}: its corpus version cannot be read ({e})") from None


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
            unreadable.append({"manifest": str(tok.path), "error": str(e).splitlines()[0] if str(e) else repr(e)})
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
        shards = shards_holding(tok, matching_ids(tok, matcher))  # a version it was taken out of: none
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
    return [e for e in exclusions if shards_holding(tok, matching_ids(tok, Matcher([e])))]


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
