"""Where ingest reads from: local files, directories and globs, or ``s3://bucket/prefix`` through the project's S3
client (the checkpoint tiers' settings: the embedded endpoint, another S3 store, or AWS).

An input resolves to a sorted list of :class:`Source` s, each named by its *key*: a local file's path relative to
the project root (its absolute path when it lies elsewhere), an object's ``s3://bucket/key``. The key is every
doc's ``source`` and the stem of its id, so two inputs with the same file name in different directories never
share ids.

The driver reads no input's bytes but a Parquet file's footer (where its row groups lie: one Spark task each): an
input's identity (its part of the stage key) is its key, size and mtime (a file) or ETag (an object); the Spark
tasks that read the bytes hash them, and the manifest records those digests (``extra.input_sha256``). With
``data.ingest.s3_read: direct`` (the default on a cluster master: ``auto``) each task reads its byte range of an
object with ranged GETs (:class:`pipelines.storage.s3.ObjectReader`); with ``copy`` (``auto`` on ``local[…]``) the
driver first copies each object into ``run.root/cache/s3/…`` (atomically; a copy whose size and ETag still match is
reused).
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from botocore.exceptions import ClientError

from pipelines.exit_codes import RETRY
from pipelines.lineage.keys import file_key
from pipelines.listing import ABSENT, glob_magic, strict_glob, walk_files
from pipelines.manifest import StageError, atomic_write_text, plain_rel, read_json_record, under
from pipelines.spec import JobSpec, resolve_path
from pipelines.storage import oserrors
from pipelines.storage.s3 import (EmbeddedDown, S3ConfigError, client_from, client_settings, credentials_lapsed,
                                  missing, outage, same_etag, split_uri)

DATA_SUFFIXES = (".jsonl", ".json", ".gz", ".zst", ".zstd", ".warc", ".txt", ".parquet")  # .jsonl.gz, .warc.gz …
FORMATS = ("JSONL (.jsonl/.json, plain, .gz or .zst)", "Parquet (.parquet: a Spark task per row group)",
           "WARC/WET (.warc, .warc.gz, .warc.wet.gz)", "plain text (.txt: one document per file)")


class IngestError(StageError):
    """An input that does not exist or cannot be read: the message names it and what to fix."""


class InputUnavailable(IngestError):
    """Storage that did not answer while an input was listed (a file system's EIO or ESTALE, an S3 endpoint down or
    throttling): exit 75, a retry lists it again."""

    exit_code = RETRY


@dataclass(frozen=True)
class Source:
    name: str                      # the input's key, recorded as each doc's ``source``
    uri: str                       # where it came from (file:// or s3://)
    path: Path | None              # a local copy to read; None: the tasks read the S3 object itself
    size: int = 0
    etag: str | None = None        # an S3 object's
    settings: dict | None = None   # the S3 client's, for tasks that read the object
    mtime_ns: int = 0              # a local file's

    @classmethod
    def of_file(cls, path: Path) -> "Source":
        p = path.resolve()
        st = p.stat()
        return cls(file_key(p), p.as_uri(), p, st.st_size, mtime_ns=st.st_mtime_ns)

    @property
    def location(self) -> str:
        """What a task opens: the local path, or the s3:// URI."""
        return str(self.path) if self.path is not None else self.uri

    def ref(self) -> dict:
        """The input's identity, from what a listing tells (no byte is read): key, size and mtime of a file, key,
        size and ETag of an object (S3 gives new content a new ETag)."""
        version = self.etag if self.etag is not None else self.mtime_ns
        ident = hashlib.sha256(f"{self.name}\0{self.size}\0{version}".encode()).hexdigest()
        out = {"uri": self.uri, "key": self.name, "sha256": ident, "bytes": self.size}
        return {**out, "etag": self.etag} if self.etag is not None else {**out, "mtime_ns": self.mtime_ns}


def is_data_file(name: str) -> bool:
    return name.lower().endswith(DATA_SUFFIXES)


def local_sources(pattern: str) -> list[Source]:
    """The files of a local input: a file, a directory's data files, or a glob's matches. A folder that cannot be
    listed is never passed over (its files would be missing from the corpus): exit 75 for storage's error (EIO,
    ESTALE …), 2 for one this user may not read."""
    try:
        return _local_sources(pattern)
    except OSError as e:
        where = e.filename or pattern
        if oserrors.refused(e):
            raise IngestError(f"input {pattern!r}: {where} cannot be read ({e.strerror}): give this user read access "
                              "to it (or narrow data.inputs)") from None
        if e.errno in oserrors.ANSWERS and e.errno not in ABSENT:  # the tree's shape (a loop, a name too long)
            raise IngestError(f"input {pattern!r}: {where} cannot be listed ({e.strerror}); fix the tree or narrow "
                              "data.inputs") from None
        raise InputUnavailable(f"input {pattern!r}: {where} could not be listed now ({type(e).__name__}: "
                               f"{e.strerror or e}); run it again") from None


def _local_sources(pattern: str) -> list[Source]:
    p = resolve_path(pattern)
    if glob_magic(pattern):  # a relative pattern under the project root, whose own name is no pattern
        paths = [x for x in strict_glob(pattern, resolve_path(".")) if x.is_file()]
    elif p.is_dir():
        paths = sorted(x for x in walk_files(p) if x.is_file() and is_data_file(x.name))
    else:
        paths = [p] if p.is_file() else []
        if paths and not is_data_file(p.name):
            raise IngestError(f"input {pattern!r}: not a supported format; ingest reads {'; '.join(FORMATS)}")
    if not paths:
        raise IngestError(f"input {pattern!r}: no such file, or nothing matches (relative paths resolve against "
                          f"the project root {resolve_path('.')}); fix data.inputs or --input")
    return [Source.of_file(x) for x in paths]


def s3_sources(spec: JobSpec, uri: str, refused: list[dict] | None = None) -> list[Source]:
    """The data objects under ``uri``. A key that is not a plain relative path (``a/../../x.jsonl``, ``/abs.jsonl``,
    empty components) is refused, never copied or read: it goes into ``refused`` with the reason."""
    bucket, prefix = split_uri(uri)
    try:
        settings = client_settings(spec)
        s3 = client_from(settings)
        objects = [o for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                   for o in page.get("Contents", [])]
    except EmbeddedDown as e:  # down, not a configuration to fix
        raise InputUnavailable(f"input {uri}: {e}") from None
    except S3ConfigError as e:
        raise IngestError(f"input {uri}: {e}") from None
    except Exception as e:  # noqa: BLE001 - botocore's errors: no bucket, no access (2); no answer, lapsed (75)
        if outage(e) or credentials_lapsed(e):
            what = "the endpoint did not answer the listing" if outage(e) else "the credentials lapsed"
            raise InputUnavailable(f"input {uri}: {what} ({type(e).__name__}: {e}); run it again") from None
        raise IngestError(f"input {uri}: cannot list it ({type(e).__name__}: {e})") from None
    objects = sorted((o for o in objects if o["Key"] == prefix or is_data_file(o["Key"])), key=lambda o: o["Key"])
    bad = [o for o in objects if not plain_rel(o["Key"])]
    for o in bad:
        print(f"ingest: refused s3://{bucket}/{o['Key']}: the key is not a plain relative path (absolute, '..' or an "
              "empty component), so it could lead outside the cache; the object is not read", flush=True)
    if refused is not None:
        refused += [{"uri": f"s3://{bucket}/{o['Key']}", "reason": "unsafe_key"} for o in bad]
    objects = [o for o in objects if plain_rel(o["Key"])]
    if not objects:
        raise IngestError(f"input {uri}: no JSONL or WARC objects under it; fix data.inputs or --input")
    direct = s3_direct(spec)
    return [Source(f"s3://{bucket}/{o['Key']}", f"s3://{bucket}/{o['Key']}",
                   None if direct else cached_copy(s3, bucket, o, spec), o["Size"], o["ETag"],
                   settings if direct else None) for o in objects]


def s3_direct(spec: JobSpec) -> bool:
    """Whether the Spark tasks read S3 objects themselves (``direct``; ``auto``: on any master but ``local[…]``)."""
    mode = spec.data.ingest.s3_read
    return mode == "direct" or mode == "auto" and not spec.services.spark_master.startswith("local")


def cached_copy(s3, bucket: str, obj: dict, spec: JobSpec) -> Path:
    """A local copy of one listed object under run.root/cache/s3, downloaded unless size and ETag still match."""
    try:
        dest = under(resolve_path(spec.run.root) / "cache" / "s3", f"{bucket}/{obj['Key']}")
    except ValueError as e:
        raise IngestError(f"s3://{bucket}/{obj['Key']}: {e}; refusing it") from None
    meta = dest.with_name(dest.name + ".s3.json")
    want = {"size": obj["Size"], "etag": obj["ETag"]}
    if dest.is_file() and read_json_record(meta) == want:  # a torn record: downloaded again
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        s3.download_file(bucket, obj["Key"], str(tmp))
        got = tmp.stat().st_size
        now = s3.head_object(Bucket=bucket, Key=obj["Key"]).get("ETag")  # the version downloaded is the listed one
        if got != obj["Size"] or not same_etag(now, obj["ETag"]):
            raise InputUnavailable(f"s3://{bucket}/{obj['Key']}: changed since it was listed ({got} bytes, ETag {now}; "
                                   f"listed {obj['Size']} bytes, ETag {obj['ETag']}); a retry lists it again")
        os.replace(tmp, dest)
    except ClientError as e:  # gone since it was listed (deleted, or replaced under a lifecycle rule): list again
        if missing(e):
            raise InputUnavailable(f"s3://{bucket}/{obj['Key']}: gone since it was listed; a retry lists it "
                                   "again") from None
        raise
    finally:
        tmp.unlink(missing_ok=True)  # nothing half-downloaded is left in the cache
    atomic_write_text(meta, json.dumps(want))  # another ingest may read it at any moment
    return dest


def resolve(spec: JobSpec, inputs: list[str], refused: list[dict] | None = None) -> list[Source]:
    """Every input file, in the order given (each pattern's matches sorted); a file two patterns match is read
    once. Objects whose keys are refused are listed in ``refused``."""
    if not inputs:
        raise IngestError("data.inputs is empty: list at least one JSONL file, glob or s3:// prefix in the spec")
    found = [s for x in inputs for s in (s3_sources(spec, x, refused) if x.startswith("s3://") else local_sources(x))]
    seen: set[str] = set()
    return [s for s in found if not (s.name in seen or seen.add(s.name))]
