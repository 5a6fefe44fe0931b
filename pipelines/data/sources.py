"""Where ingest reads from: local files, directories and globs, or ``s3://bucket/prefix`` through the project's S3
client (the checkpoint tiers' settings: the embedded endpoint, another S3 store, or AWS).

An input resolves to a sorted list of :class:`Source` s. With ``data.ingest.s3_read: copy`` (the default) an S3
object is copied into ``run.root/cache/s3/…`` (atomically; a copy whose size and ETag still match is reused), so the
ingest stage hashes and reads the same bytes wherever they came from: the same objects in S3 and on disk give the
same stage key and the same manifest digest. With ``direct`` nothing is copied: each Spark task reads its byte
range of the object with ranged GETs (:class:`pipelines.storage.s3.ObjectReader`), and the input's identity is the
object's ETag and size; the outputs, and so the digest, are still those of the same files on disk.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipelines.manifest import StageError, file_ref
from pipelines.spec import JobSpec, resolve_path

DATA_SUFFIXES = (".jsonl", ".json", ".gz", ".zst", ".zstd", ".warc")  # .jsonl.gz, .warc.gz, .warc.wet.gz …


class IngestError(StageError):
    """An input that does not exist or cannot be read: the message names it and what to fix."""


@dataclass(frozen=True)
class Source:
    name: str                      # the file name, recorded as each doc's ``source``
    uri: str                       # where it came from (file:// or s3://)
    path: Path | None              # a local copy to read; None: the tasks read the S3 object itself
    size: int = 0
    etag: str | None = None        # an S3 object's
    settings: dict | None = None   # the S3 client's, for tasks that read the object

    @classmethod
    def of_file(cls, path: Path) -> "Source":
        return cls(path.name, path.resolve().as_uri(), path, path.stat().st_size)

    @property
    def location(self) -> str:
        """What a task opens: the local path, or the s3:// URI."""
        return str(self.path) if self.path is not None else self.uri

    def ref(self) -> dict:
        """The input's identity in the manifest: its bytes' sha256 when they are here, else the object's ETag and
        size (S3 gives a new ETag to new content)."""
        if self.path is not None:
            return {**file_ref(self.path), "uri": self.uri}
        ident = hashlib.sha256(f"{self.uri}\0{self.size}\0{self.etag}".encode()).hexdigest()
        return {"uri": self.uri, "sha256": ident, "etag": self.etag, "bytes": self.size}


def is_data_file(name: str) -> bool:
    return name.lower().endswith(DATA_SUFFIXES)


def local_sources(pattern: str) -> list[Source]:
    p = resolve_path(pattern)
    if any(c in pattern for c in "*?["):
        paths = [Path(x) for x in sorted(glob.glob(str(p), recursive=True)) if Path(x).is_file()]
    elif p.is_dir():
        paths = sorted(x for x in p.rglob("*") if x.is_file() and is_data_file(x.name))
    else:
        paths = [p] if p.is_file() else []
    if not paths:
        raise IngestError(f"input {pattern!r}: no such file, or nothing matches (relative paths resolve against "
                          f"the project root {resolve_path('.')}); fix data.inputs or --input")
    return [Source.of_file(x) for x in paths]


def s3_sources(spec: JobSpec, uri: str) -> list[Source]:
    from pipelines.storage.s3 import S3ConfigError, client_from, client_settings, split_uri

    bucket, prefix = split_uri(uri)
    try:
        settings = client_settings(spec)
        s3 = client_from(settings)
        objects = [o for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                   for o in page.get("Contents", [])]
    except S3ConfigError as e:
        raise IngestError(f"input {uri}: {e}") from None
    except Exception as e:  # noqa: BLE001 - botocore's errors: no bucket, no access, no endpoint
        raise IngestError(f"input {uri}: cannot list it ({type(e).__name__}: {e})") from None
    objects = sorted((o for o in objects if o["Key"] == prefix or is_data_file(o["Key"])), key=lambda o: o["Key"])
    if not objects:
        raise IngestError(f"input {uri}: no JSONL or WARC objects under it; fix data.inputs or --input")
    direct = spec.data.ingest.s3_read == "direct"
    return [Source(o["Key"].rsplit("/", 1)[-1], f"s3://{bucket}/{o['Key']}",
                   None if direct else cached_copy(s3, bucket, o, spec), o["Size"], o["ETag"],
                   settings if direct else None) for o in objects]


def cached_copy(s3, bucket: str, obj: dict, spec: JobSpec) -> Path:
    """A local copy of one listed object under run.root/cache/s3, downloaded unless size and ETag still match."""
    dest = resolve_path(spec.run.root) / "cache" / "s3" / bucket / obj["Key"]
    meta = dest.with_name(dest.name + ".s3.json")
    want = {"size": obj["Size"], "etag": obj["ETag"]}
    if dest.is_file() and meta.is_file() and json.loads(meta.read_text()) == want:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    s3.download_file(bucket, obj["Key"], str(tmp))
    got = tmp.stat().st_size
    if got != obj["Size"]:
        tmp.unlink()
        raise IngestError(f"s3://{bucket}/{obj['Key']}: downloaded {got} bytes, listed {obj['Size']}")
    os.replace(tmp, dest)
    meta.write_text(json.dumps(want))
    return dest


def resolve(spec: JobSpec, inputs: list[str]) -> list[Source]:
    """Every input file, in the order given (each pattern's matches sorted)."""
    if not inputs:
        raise IngestError("data.inputs is empty: list at least one JSONL file, glob or s3:// prefix in the spec")
    return [s for x in inputs for s in (s3_sources(spec, x) if x.startswith("s3://") else local_sources(x))]
