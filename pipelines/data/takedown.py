"""Takedown: sources that no new corpus version may hold.

``python -m pipelines.lineage --exclude-source KEY|URL-PREFIX --reason TEXT`` adds an exclusion to the takedown list
(``data.exclusions``, one JSON object a line: ``source``, ``reason``, ``added_at``) and tags every registered model
version trained on a corpus version that holds the source (``takedown.pending``). From then on:

* the filter stage removes new docs of an excluded source (reason ``takedown``);
* the tokenize stage makes the next corpus version without the excluded docs of the versions before it, even when no
  new doc arrived: only the shards that held one are rewritten, the others are linked as they are; its manifest
  records each exclusion with its reason and the docs it removed (``extra.takedown``);
* the register stage tags a version whose corpus holds an excluded doc (a training that was running meanwhile).

A source is an input's key as ingest records it (a doc's ``source``), or a URL prefix (``https://host/…``): the docs
whose ``url`` starts with it (a plain prefix: end it with ``/`` to mean one host).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

from pipelines.data.urlfilter import host_of
from pipelines.manifest import StageError

TAG = "takedown.pending"


@dataclass(frozen=True)
class Exclusion:
    source: str
    reason: str
    added_at: str = ""


def check_text(text: str, what: str) -> str:
    """``text`` stripped, or ValueError: empty, or holding a control character (a newline would forge a line of the
    list or of a tag)."""
    t = (text or "").strip() if isinstance(text, str) else ""
    if not t:
        raise ValueError(f"an empty {what}")
    if any(ord(c) < 32 or ord(c) == 127 for c in t):
        raise ValueError(f"the {what} {t[:80]!r} holds a control character (a newline, a tab …)")
    return t


def check_source(source: str) -> str:
    """The source as it is kept, or ValueError: empty, a control character, or a URL prefix without a host (it would
    match every URL)."""
    s = check_text(source, "source (an input's key or a URL prefix)")
    if "://" in s and not host_of(s):
        raise ValueError(f"{source!r}: a URL prefix needs a host (https://example.com/…)")
    return s


def load(path: Path) -> list[Exclusion]:
    """The takedown list at ``path`` (none when the file is missing); a line that is not an exclusion is an error
    that names the file and line."""
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.append(Exclusion(check_source(rec["source"]), check_text(rec["reason"], "reason"),
                                 str(rec.get("added_at", ""))))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StageError(f"{path}:{n}: not an exclusion ({e}); each line is {{\"source\": KEY or URL prefix, "
                             "\"reason\": text}} (data.exclusions)") from None
    return out


def add(path: Path, source: str, reason: str) -> tuple[Exclusion, bool]:
    """Add an exclusion to the list, under an exclusive lock beside it (two takedowns at once both land), written
    whole to a temporary file and renamed; (the exclusion, False) when the source is excluded already."""
    import fcntl

    source, reason = check_source(source), check_text(reason, "reason (--reason)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        held = load(path)
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


def list_sha256(path: Path) -> str | None:
    """The list's sha256 (None when there is none): what the filter stage saw, for tokenize to compare."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


class Matcher:
    """Which docs a set of exclusions takes out: ``source`` equal to an excluded source, or ``url`` under an
    excluded URL prefix."""

    def __init__(self, exclusions: Iterable[Exclusion | str]):
        sources = sorted({e.source if isinstance(e, Exclusion) else e for e in exclusions})
        self.sources = frozenset(sources)
        self.prefixes = tuple(s for s in sources if "://" in s)

    def __bool__(self) -> bool:
        return bool(self.sources)

    def hit(self, source: Optional[str], url: Optional[str]) -> bool:
        return source in self.sources or (bool(self.prefixes) and isinstance(url, str) and url.startswith(self.prefixes))

    def mask(self, table):
        """A boolean array over an Arrow table's rows (``source``, and ``url`` when it has one)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        hit = pc.is_in(table.column("source"), value_set=pa.array(sorted(self.sources), pa.string()))
        if "url" in table.column_names:
            for p in self.prefixes:
                hit = pc.or_kleene(hit, pc.starts_with(table.column("url"), p))
        return pc.fill_null(hit, False)


def tag_versions(client, versions: list[dict], exclusion: Exclusion) -> list[dict]:
    """Tag each registered version (``name``, ``version``) ``takedown.pending``: the excluded sources it saw and why
    (a version tagged before keeps its earlier sources)."""
    note = f"{exclusion.source}: {exclusion.reason}"[:1000]  # one line: neither holds a control character
    for v in versions:
        have = (client.get_model_version(v["name"], v["version"]).tags or {}).get(TAG, "")
        if note not in have.split("\n"):
            client.set_model_version_tag(v["name"], v["version"], TAG, f"{have}\n{note}".strip()[-5000:])
    return versions


# -- the next corpus version without them (the tokenize stage) --------------------------------------------------------

def excluded_docs(corpus, exclusions: list[Exclusion]) -> dict[str, int]:
    """The shard entries of a corpus version (its chain) that the takedown list takes out: doc id (and the
    ``<id>#tail`` part of a one-doc input held out by tail) → the index of the first exclusion that takes it."""
    from pipelines.lineage import matching_ids

    out: dict[str, int] = {}
    for k, e in enumerate(exclusions):
        for i in matching_ids(corpus, Matcher([e])):
            out.setdefault(i, k)
    return out


def strip_shard(src: Path, row: dict, drop: dict[str, int], dest: Path, prefix: str, dtype: str, removed: list[int],
                sp) -> dict | None:
    """Shard ``row`` of the directory ``src`` written again as ``dest/prefix`` without the entries in ``drop`` (ids
    beside it; ``removed[k]`` counts exclusion k's; the text bytes of each are its tokens decoded by ``sp``, the
    corpus's tokenizer); its new row, or None when no entry is left."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.data.shards import Shard, ShardWriter
    from pipelines.manifest import under

    shard = Shard.open(under(src, row["prefix"]))
    ids = pq.read_table(under(src, row["prefix"] + ".ids.parquet"), columns=["id"]).column("id").to_pylist()
    kept, gone_bytes = [], 0
    for k, i in enumerate(ids):
        if i in drop:
            removed[drop[i]] += 1
            gone_bytes += len(sp.decode(shard.doc(k)[:-1].tolist()).encode("utf-8"))  # EOS last
        else:
            kept.append(k)
    if not kept:
        return None
    (dest / prefix).parent.mkdir(parents=True, exist_ok=True)
    w = ShardWriter(dest / prefix, np.dtype(dtype))
    for k in kept:
        w.add(shard.doc(k))
    w.close()
    pq.write_table(pa.table({"id": pa.array([ids[k] for k in kept], pa.string())}), dest / (prefix + ".ids.parquet"))
    return {**row, "prefix": prefix, "docs": len(kept), "tokens": w.tokens,
            "text_bytes": max(0, row["text_bytes"] - gone_bytes)}
