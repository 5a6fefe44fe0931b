"""Checkpoints that are valid only when complete, their promotion across storage tiers, restore, retention.

A checkpoint is a directory (or S3 prefix) ``step-NNNNNN`` of files plus::

    MANIFEST.json   {"files": {name: {"sha256", "bytes"}}, "step": …}
    COMMIT          sha256 of MANIFEST.json, written last

A reader trusts a copy only if COMMIT exists, matches MANIFEST.json, and every file matches its
sha256, so a half-written or half-copied checkpoint is never taken for a good one. The training
checkpoints (``pipelines.train.checkpointer``) are ``torch.distributed.checkpoint`` (DCP) directories:
``.metadata`` + one ``__<rank>_0.distcp`` shard file per writing rank, plus ``trainer_state.json``,
``rng.json`` (per-rank RNG states), ``model_args.json`` and ``tokenizer.model``. With node-local L0 each node
commits its *part* of a step on its own disk; the parts meet on L1 and L2, where rank 0 writes the step's global
COMMIT (see *node parts* below and :mod:`pipelines.train.restore`). Every file name read from a manifest must stay
below its directory (:func:`safe_rel`).

Tiers: L0 node-local (``checkpoint.l0``) → L1 shared FS (``checkpoint.l1``) → L2 S3
(``s3://services.s3_bucket/checkpoint.l2_prefix/…``). ``promote`` copies L0 → L1 → L2, checking
every file at every tier, COMMIT last; a tier that already holds a verified copy is skipped.
:func:`find_restore` picks the newest step whose copy verifies on the nearest tier, falling back
tier by tier, then step by step, and says why it skipped each copy. :func:`prune` applies the
per-tier retention and never deletes a copy of the newest verified step.

S3 verification uses S3's own SHA-256 checksums (``ChecksumAlgorithm=SHA256``): for a single-part
upload the object checksum is the file's sha256; for multipart it is the composite
sha256(part digests)-N, which we recompute locally with the part size the transfer really used
(s3transfer raises the configured chunk size for files that would need more than 10,000 parts). If
an endpoint returns no checksum, the object is downloaded and hashed. Multipart uploads left by an
interrupted promotion are aborted before the next upload to the same prefix.

    python -m pipelines.train.checkpoint export SRC OUT.pt   # plain {name: tensor} weights
    (the promote stage, :mod:`pipelines.train.promote`, runs :func:`promote` on a train stage's checkpoint)
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from pipelines.manifest import StageError, atomic_write_text, plain_rel, sha256_file
from pipelines.spec import JobSpec, resolve_path
from pipelines.storage import faults
from pipelines.storage.s3 import (b64, checksums_verified, composite_sha256, object_matches, part_digests,
                                  part_size_used, unreachable, upload_checked)
from pipelines.train import lineage

CKPT_MANIFEST = "MANIFEST.json"
COMMIT = "COMMIT"
PARTS = "PARTS"  # on L2: PARTS/part-K.json, node K's part manifest, put after the part's files
PARTS_META = "sha256-parts"  # a multipart object's metadata: the composite of its verified parts' sha256, "-N"
TIERS = ("L0", "L1", "L2")


class CheckpointError(StageError):
    pass


class L2Unavailable(CheckpointError):
    """The object store does not answer (down, refusing, throttling past the retries): L2 is skipped for now."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def parse_step(name: str) -> Optional[int]:
    """``step-000120`` → 120; anything else (temp dirs, other files) → None."""
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def hash_files(root: Path, rels: list[str]) -> dict[str, str]:
    """sha256 of many files in parallel (hashlib releases the GIL on large buffers)."""
    def one(rel: str) -> str:
        faults.file_op("read", root / rel)
        return sha256_file(root / rel)

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(rels)))) as ex:
        return dict(zip(rels, ex.map(one, rels)))


# ----------------------------------------------------------------------------- local tiers
def commit_local(tmp_dir: Path, final_dir: Path, meta: dict | None = None) -> Path:
    """Hash every file in ``tmp_dir``, write MANIFEST + COMMIT, then rename to ``final_dir``."""
    rels = [f.relative_to(tmp_dir).as_posix() for f in sorted(p for p in tmp_dir.rglob("*") if p.is_file())]
    rels = [r for r in rels if r not in (CKPT_MANIFEST, COMMIT)]
    faults.file_op("write", final_dir)
    sums = hash_files(tmp_dir, rels)
    files = {r: {"sha256": sums[r], "bytes": (tmp_dir / r).stat().st_size} for r in rels}
    body = json.dumps({"files": files, **(meta or {})}, indent=2, sort_keys=True)
    atomic_write_text(tmp_dir / CKPT_MANIFEST, body)
    atomic_write_text(tmp_dir / COMMIT, hashlib.sha256(body.encode()).hexdigest())
    if final_dir.exists():
        remove_local(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp_dir, final_dir)
    return final_dir


def missing_shards(d: Path) -> list[str]:
    """Shard files that the DCP metadata in ``d`` names but ``d`` lacks (e.g. written on another node's disk)."""
    from torch.distributed.checkpoint import FileSystemReader

    named = {info.relative_path for info in FileSystemReader(str(d)).read_metadata().storage_data.values()}
    return sorted(n for n in named if not (d / n).is_file())


def remove_local(d: Path) -> None:
    """COMMIT first, so a half-removed copy is never read as a checkpoint."""
    (d / COMMIT).unlink(missing_ok=True)
    shutil.rmtree(d, ignore_errors=True)


def read_local_manifest(d: Path) -> dict:
    if not (d / COMMIT).is_file():
        raise CheckpointError(f"{d}: no COMMIT marker — the checkpoint is incomplete")
    body = (d / CKPT_MANIFEST).read_text()
    if hashlib.sha256(body.encode()).hexdigest() != (d / COMMIT).read_text().strip():
        raise CheckpointError(f"{d}: MANIFEST.json does not match its COMMIT marker")
    return json.loads(body)


def verify_local(d: Path) -> dict:
    """Raise CheckpointError unless every file matches; return the manifest."""
    man = read_local_manifest(d)
    missing = [rel for rel in manifest_files(man, str(d)) if not (d / rel).is_file()]
    if missing:
        raise CheckpointError(f"{d}: {missing[0]} is missing")
    sums = hash_files(d, list(man["files"]))
    for rel, info in man["files"].items():
        if sums[rel] != info["sha256"]:
            raise CheckpointError(f"{d}: {rel} sha256 {sums[rel][:12]}… does not match the manifest's "
                                  f"{info['sha256'][:12]}… — refusing this checkpoint")
    return man


def is_valid_local(d: Path) -> bool:
    try:
        verify_local(d)
        return True
    except (CheckpointError, FileNotFoundError, json.JSONDecodeError):
        return False


def _copy_hashing(src: Path, dst: Path, part_size: int) -> tuple[str, list[bytes]]:
    """Copy in one read pass, hashing what was read: (sha256 hex of the file, sha256 digest of each
    ``part_size`` part, the parts S3 will checksum when this file is uploaded)."""
    whole, parts = hashlib.sha256(), []
    faults.file_op("read", src)
    faults.file_op("write", dst)
    with open(src, "rb") as f, open(dst, "wb") as g, ThreadPoolExecutor(1) as part_hasher:
        while chunk := f.read(part_size):  # the part's digest is computed beside the whole-file hash and the write
            part = part_hasher.submit(lambda c: hashlib.sha256(c).digest(), chunk)
            whole.update(chunk)
            g.write(chunk)
            parts.append(part.result())
    return whole.hexdigest(), parts


def copy_local(src: Path, dst: Path, chunk: int = 8 << 20) -> dict[str, list[bytes]]:
    """Copy a checkpoint to another filesystem tier, checking every file against the manifest as it is read
    (a corrupt source is refused); COMMIT last. Returns each file's part digests for the S3 upload that follows
    (parts of ``chunk`` bytes, as s3transfer will cut them)."""
    man = read_local_manifest(src)
    tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        for rel in manifest_files(man, str(src)):
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        rels = list(man["files"])
        if any(not (src / rel).is_file() for rel in rels):
            raise CheckpointError(f"{src}: {next(r for r in rels if not (src / r).is_file())} is missing")
        with ThreadPoolExecutor(max_workers=min(8, max(1, len(rels)))) as ex:
            got = dict(zip(rels, ex.map(lambda r: _copy_hashing(
                src / r, tmp / r, part_size_used(man["files"][r]["bytes"], chunk)), rels)))
        for rel, info in man["files"].items():
            if got[rel][0] != info["sha256"]:
                raise CheckpointError(f"{src}: {rel} sha256 {got[rel][0][:12]}… does not match the manifest's "
                                      f"{info['sha256'][:12]}… — refusing this checkpoint")
        shutil.copyfile(src / CKPT_MANIFEST, tmp / CKPT_MANIFEST)
        shutil.copyfile(src / COMMIT, tmp / COMMIT)  # last
        if dst.exists():
            remove_local(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {rel: parts for rel, (_, parts) in got.items()}


# ----------------------------------------------------------------------------- S3 tier
def _transfer_config(spec: JobSpec):
    from boto3.s3.transfer import TransferConfig

    mb = 1024 * 1024
    return TransferConfig(multipart_threshold=spec.checkpoint.multipart_threshold_mb * mb,
                          multipart_chunksize=spec.checkpoint.multipart_chunk_mb * mb, max_concurrency=4)


def _missing(e: Exception) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(e, ClientError) and str(e.response.get("Error", {}).get("Code")) in (
        "404", "NoSuchKey", "NoSuchBucket", "NotFound")


def _s3_body(s3, bucket: str, key: str) -> Optional[bytes]:
    """The object's bytes; None only when it is not there (an endpoint that does not answer raises
    :class:`L2Unavailable`: an outage must never read as "no COMMIT")."""
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as e:  # noqa: BLE001 - sorted into absent / unreachable / other
        if _missing(e):
            return None
        if unreachable(e):
            raise L2Unavailable(f"s3://{bucket}/{key}: {type(e).__name__}: {e}") from None
        raise


def s3_commit_body(s3, bucket: str, prefix: str) -> Optional[str]:
    body = _s3_body(s3, bucket, f"{prefix}/{COMMIT}")
    return None if body is None else body.decode().strip()


def multipart_uploads(s3, bucket: str, prefix: str = "") -> list[dict]:
    """The multipart uploads in progress under ``prefix`` (an endpoint that answers NoSuchUpload when there are
    none, as rclone's does, has none)."""
    from botocore.exceptions import ClientError

    try:
        return [up for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix)
                for up in page.get("Uploads", [])]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "NoSuchUpload":
            return []
        raise


def abort_multipart(s3, bucket: str, prefix: str, keys: Optional[set[str]] = None) -> int:
    """Abort the multipart uploads an interrupted promotion left under ``prefix`` (only those of ``keys`` when
    given: another node may be uploading its own part there right now); returns how many."""
    n = 0
    for up in multipart_uploads(s3, bucket, f"{prefix}/"):
        if keys is None or up["Key"] in keys:
            s3.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
            n += 1
    return n


def _upload_parts(s3, bucket: str, key: str, path: Path, part: int, digests: list[bytes], sha_hex: str) -> None:
    """Multipart upload that sends the part digests computed while the file was copied (no second hashing
    pass): S3 refuses a part whose bytes do not match its ``x-amz-checksum-sha256``."""
    # the metadata names the whole file's sha256 and the composite S3 will compute from the verified parts: a later
    # check compares S3's own composite checksum with it (content, not size; see _check_objects)
    meta = {"sha256": sha_hex, PARTS_META: f"{composite_sha256(digests)}-{len(digests)}"}
    up = s3.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256", Metadata=meta)

    def put(i: int) -> dict:
        with open(path, "rb") as f:
            f.seek(i * part)
            body = f.read(part)
        r = s3.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=i + 1, Body=body,
                           ChecksumAlgorithm="SHA256", ChecksumSHA256=b64(digests[i]))
        return {"ETag": r["ETag"], "PartNumber": i + 1, "ChecksumSHA256": b64(digests[i])}

    try:
        with ThreadPoolExecutor(max_workers=4) as ex:
            parts = list(ex.map(put, range(len(digests))))
        s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts})
    except Exception:
        s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"])
        raise


def safe_rel(rel: str, where: str) -> str:
    """A file name from a manifest, refused unless it stays below its checkpoint directory (no absolute path, no
    ``..``, no empty or odd component): a forged manifest must not make a download or a copy write elsewhere."""
    if not plain_rel(rel):
        raise CheckpointError(f"{where}: manifest entry {rel!r} is not a relative path below the checkpoint "
                              "directory — refusing this checkpoint")
    return rel


def manifest_files(man: dict, where: str) -> dict:
    """The manifest's ``files``, every name checked with :func:`safe_rel`."""
    files = man.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{where}: manifest has no files table")
    for rel in files:
        safe_rel(rel, where)
    return files


def _upload_files(spec: JobSpec, s3, bucket: str, prefix: str, src: Path, files: dict,
                  parts: dict[str, list[bytes]]) -> None:
    """Upload ``files`` of ``src`` under ``prefix``, each object checked against the manifest's sha256."""
    cfg = _transfer_config(spec)
    part = spec.checkpoint.multipart_chunk_mb * 1024 * 1024
    for rel, info in files.items():
        key, size = f"{prefix}/{rel}", info["bytes"]
        digests = parts.get(rel)
        if object_matches(s3, bucket, key, src / rel, info["sha256"], part, digests) and \
                _object_ok(s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED"), info,
                           checksums_verified(s3)) in (None, UNCHECKED):
            continue  # uploaded already (a node's part, an interrupted upload): not sent twice
        if size >= cfg.multipart_threshold and not (digests and len(digests) == -(-size // part_size_used(size, part))):
            digests = part_digests(src / rel, part_size_used(size, part))  # multipart: always with our part digests
        if size >= cfg.multipart_threshold:
            _upload_parts(s3, bucket, key, src / rel, part_size_used(size, part), digests, info["sha256"])
            if not object_matches(s3, bucket, key, src / rel, info["sha256"], part, digests):
                raise CheckpointError(f"s3://{bucket}/{key} does not match {rel}'s sha256 after upload")
        else:
            try:
                upload_checked(s3, bucket, key, src / rel, info["sha256"], cfg, part)
            except IOError as e:
                raise CheckpointError(str(e)) from None


def _all_match(spec: JobSpec, s3, bucket: str, prefix: str, src: Path, files: dict, parts: dict) -> bool:
    part = spec.checkpoint.multipart_chunk_mb * 1024 * 1024
    return all(object_matches(s3, bucket, f"{prefix}/{rel}", src / rel, info["sha256"], part, parts.get(rel))
               for rel, info in files.items())


def upload_checkpoint(spec: JobSpec, src: Path, uri: str, parts: Optional[dict[str, list[bytes]]] = None) -> str:
    """Upload a local checkpoint to ``uri`` (s3://bucket/prefix), each object checked against the file, COMMIT
    last. Idempotent. ``parts``: the files' part digests from a copy that just verified ``src`` (else ``src`` is
    verified here)."""
    from pipelines.storage.s3 import client, ensure_bucket, split_uri

    man = verify_local(src) if parts is None else read_local_manifest(src)
    parts = parts or {}
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    ensure_bucket(s3, bucket, spec.services.s3_region)
    commit = (src / COMMIT).read_text().strip()
    if s3_commit_body(s3, bucket, prefix) == commit and _all_match(spec, s3, bucket, prefix, src, man["files"], parts):
        return "already-verified"
    s3.delete_object(Bucket=bucket, Key=f"{prefix}/{COMMIT}")  # invalidate any older copy first
    aborted = abort_multipart(s3, bucket, prefix)
    if aborted:
        print(f"[ckpt] aborted {aborted} unfinished multipart upload(s) under {uri}", flush=True)
    _upload_files(spec, s3, bucket, prefix, src, man["files"], parts)
    s3.upload_file(str(src / CKPT_MANIFEST), bucket, f"{prefix}/{CKPT_MANIFEST}")
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{COMMIT}", Body=commit.encode())  # last
    return "uploaded"


def download_checkpoint(spec: JobSpec, uri: str, dest: Path, part: Optional[int] = None) -> Path:
    """Fetch ``uri`` into ``dest`` and verify every file; raise if the copy is incomplete or corrupt. With
    ``part``, only that node's part (its files and its manifest, ``PARTS/part-K.json``), as a committed part dir."""
    from pipelines.storage.s3 import client, split_uri

    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    if part is None:
        commit, key = s3_commit_body(s3, bucket, prefix), f"{prefix}/{CKPT_MANIFEST}"
        body = _s3_body(s3, bucket, key) if commit else None
    else:
        key = f"{prefix}/{PARTS}/{part_name(part)}.json"
        body = _s3_body(s3, bucket, key)
        if body is None:  # a step uploaded whole (the promote stage, L2 catching up): its part from the manifest
            body = part_manifest(read_s3_manifest(spec, uri), part)
        commit = body and hashlib.sha256(body).hexdigest()
    if commit is None:
        raise CheckpointError(f"{uri}: no COMMIT marker — the checkpoint is incomplete or absent")
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        if body is None or hashlib.sha256(body).hexdigest() != commit:
            raise CheckpointError(f"{uri}: MANIFEST.json does not match its COMMIT marker")
        (tmp / CKPT_MANIFEST).write_bytes(body)
        for rel in manifest_files(json.loads(body), uri):
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, f"{prefix}/{rel}", str(tmp / rel))
        (tmp / COMMIT).write_text(commit)
        verify_local(tmp)
        if dest.exists():
            remove_local(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def part_manifest(man: Optional[dict], k: int) -> Optional[bytes]:
    """Part ``k``'s manifest cut out of a step's merged one (its files, the step's meta), or None."""
    if man is None or "part_of" not in man:
        return None
    files = {rel: info for rel, info in manifest_files(man, f"part {k}").items() if int(man["part_of"].get(rel, 0)) == k}
    meta = {key: man[key] for key in ("step", "format", "world_size", "attempt", "lineage") if key in man}
    body = {"files": files, "part": k, "parts": int(man.get("parts", 1)), **meta}
    return json.dumps(body, indent=2, sort_keys=True).encode()


def read_s3_manifest(spec: JobSpec, uri: str) -> Optional[dict]:
    """The manifest of a committed S3 copy (COMMIT matches MANIFEST.json), objects not checked; None if absent."""
    from pipelines.storage.s3 import client, split_uri

    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    commit = s3_commit_body(s3, bucket, prefix)
    body = _s3_body(s3, bucket, f"{prefix}/{CKPT_MANIFEST}") if commit else None
    if body is None or hashlib.sha256(body).hexdigest() != commit:
        return None
    return json.loads(body)


def verify_s3(spec: JobSpec, uri: str) -> dict:
    """Check an S3 copy by content (COMMIT, manifest, each object against the manifest's sha256 through S3's own
    checksums, see :func:`_check_objects`); returns the manifest or raises CheckpointError."""
    from pipelines.storage.s3 import client, split_uri

    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    commit = s3_commit_body(s3, bucket, prefix)
    if commit is None:
        raise CheckpointError(f"{uri}: no COMMIT marker")
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{CKPT_MANIFEST}")["Body"].read()
    if hashlib.sha256(body).hexdigest() != commit:
        raise CheckpointError(f"{uri}: MANIFEST.json does not match its COMMIT marker")
    man = json.loads(body)
    _check_objects(s3, bucket, prefix, manifest_files(man, uri), uri)
    return man


def _check_objects(s3, bucket: str, prefix: str, files: dict, uri: str) -> None:
    """Each object's size and S3 checksum against the manifest's; an object whose endpoint keeps no SHA-256 for it, or
    does not verify the checksums clients send (:func:`~pipelines.storage.s3.checksums_verified`), is downloaded and
    hashed."""
    trusted = checksums_verified(s3)
    for rel, info in files.items():
        key = f"{prefix}/{rel}"
        why = _object_ok(s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED"), info, trusted)
        if why == UNCHECKED:  # no checksum to trust: the bytes themselves
            h = hashlib.sha256()
            for chunk in s3.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(1 << 20):
                h.update(chunk)
            why = None if h.hexdigest() == info["sha256"] else "its bytes' sha256 differs"
        if why is not None:
            raise CheckpointError(f"{uri}: {rel} does not match the manifest ({why})")


UNCHECKED = "no checksum to compare"


def _object_ok(head: dict, info: dict, trusted: bool) -> Optional[str]:
    """None when an object's HEAD shows the manifest entry's content, else why not (UNCHECKED: no checksum, or one
    the endpoint did not verify, ``trusted`` False). A single-part object: S3's SHA-256 of it is the file's. A multipart one: S3's composite of the part checksums it verified on upload equals
    the composite recorded beside the file's sha256 when we uploaded it (an object written by anything else, e.g.
    another attempt's part of the same size, has another or none)."""
    if head["ContentLength"] != info["bytes"]:
        return f"{head['ContentLength']} bytes, not {info['bytes']}"
    remote = head.get("ChecksumSHA256")
    if not remote or not trusted:
        return UNCHECKED
    if "-" not in head.get("ETag", "") and "-" not in remote:
        return None if remote == b64(bytes.fromhex(info["sha256"])) else "its SHA-256 differs"
    meta = {k.lower(): v for k, v in head.get("Metadata", {}).items()}  # some endpoints change the case
    want = meta.get(PARTS_META, "")
    if meta.get("sha256") != info["sha256"] or not want or not remote or remote.split("-")[0] != want.split("-")[0]:
        return "a multipart object whose part checksums are not those of this file"
    return None


def remove_s3(spec: JobSpec, uri: str) -> None:
    """COMMIT first, then the rest of the prefix."""
    from pipelines.storage.s3 import client, split_uri

    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    s3.delete_object(Bucket=bucket, Key=f"{prefix}/{COMMIT}")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for o in page.get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=o["Key"])


# ----------------------------------------------------------------------------- tier layout
def tier_locations(spec: JobSpec, rel: str) -> dict[str, str]:
    """Where checkpoint ``rel`` (e.g. ``<run>/<key>/step-000200``) lives at each tier."""
    return {
        "L0": str(resolve_path(spec.checkpoint.l0) / rel),
        "L1": str(resolve_path(spec.checkpoint.l1) / rel),
        "L2": f"s3://{spec.services.s3_bucket}/{spec.checkpoint.l2_prefix.strip('/')}/{rel}",
    }


def l2_available(spec: JobSpec) -> Optional[str]:
    """None when an S3 endpoint is configured or running, else the reason L2 cannot be used now."""
    from pipelines.storage.s3 import S3ConfigError, endpoint_url

    try:
        endpoint_url(spec)
        return None
    except S3ConfigError as e:
        return str(e)


def list_steps(spec: JobSpec, rel_root: str, tiers: tuple[str, ...] = TIERS) -> dict[str, list[int]]:
    """Steps that have a COMMIT marker at each tier (not yet verified), oldest first."""
    out: dict[str, list[int]] = {}
    for tier in tiers:
        loc = tier_locations(spec, rel_root)[tier]
        if tier != "L2":
            root = Path(loc)
            names = [p.name for p in root.iterdir() if (p / COMMIT).is_file()] if root.is_dir() else []
        elif l2_available(spec) is None:
            names = _s3_committed_names(spec, loc)
        else:
            names = []
        out[tier] = sorted(s for s in map(parse_step, names) if s is not None)
    return out


def _s3_committed_names(spec: JobSpec, uri: str) -> list[str]:
    from botocore.exceptions import ClientError

    from pipelines.storage.s3 import client, split_uri

    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    names = []
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
            for o in page.get("Contents", []):
                parts = o["Key"][len(prefix) + 1:].split("/")
                if len(parts) == 2 and parts[1] == COMMIT:
                    names.append(parts[0])
    except ClientError as e:
        if _missing(e):  # no bucket yet: nothing promoted
            return []
        if unreachable(e):
            raise L2Unavailable(f"{uri}: {e}") from None
        raise
    except Exception as e:  # noqa: BLE001 - the endpoint did not answer
        if unreachable(e):
            raise L2Unavailable(f"{uri}: {type(e).__name__}: {e}") from None
        raise
    return names


def verify_copy(spec: JobSpec, tier: str, loc: str) -> None:
    """Raise CheckpointError unless the copy at ``loc`` verifies (L2: checksums held by S3; see _check_objects)."""
    try:
        verify_s3(spec, loc) if tier == "L2" else verify_local(Path(loc))
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{loc}: {e}") from None


def fetch(spec: JobSpec, rel: str, cache: Optional[Path] = None, prefer: tuple[str, ...] = TIERS) -> tuple[str, Path]:
    """Restore from the nearest tier whose copy verifies; returns (tier, local dir)."""
    locs = tier_locations(spec, rel)
    errors = []
    for tier in prefer:
        loc = locs[tier]
        try:
            if tier == "L2":
                return tier, download_checkpoint(spec, loc, cache or resolve_path("var/tiers/cache") / rel)
            verify_local(Path(loc))
            return tier, Path(loc)
        except Exception as e:  # noqa: BLE001 - report every tier's reason
            errors.append(f"{tier} {loc}: {e}")
    raise CheckpointError("no tier holds a verified copy of the checkpoint:\n  " + "\n  ".join(errors))


@dataclass
class RestorePoint:
    step: int
    tier: str
    path: str  # local directory holding the verified copy (an L2 copy is downloaded into L0 first)
    skipped: list[str] = field(default_factory=list)  # why newer steps / nearer tiers were not used


def find_restore(spec: JobSpec, rel_root: str, step: Optional[int] = None,
                 log: Callable[[str], None] = print) -> Optional[RestorePoint]:
    """The newest step (or exactly ``step``) whose copy verifies, L0 → L1 → L2, falling back tier by tier and
    then to older steps. An L2 copy is downloaded into the L0 location first. None when nothing is there."""
    by_tier = list_steps(spec, rel_root)
    steps = sorted({s for v in by_tier.values() for s in v}, reverse=True)
    if step is not None:
        steps = [step]
    skipped: list[str] = []
    for s in steps:
        locs = tier_locations(spec, f"{rel_root}/{step_name(s)}")
        for tier in TIERS:
            if s not in by_tier[tier]:
                skipped.append(f"{step_name(s)} {tier}: no committed copy")
                continue
            try:
                path = Path(locs[tier])
                if tier == "L2":
                    path = download_checkpoint(spec, locs["L2"], Path(locs["L0"]))
                else:
                    verify_local(path)
            except Exception as e:  # noqa: BLE001 - every reason is reported
                skipped.append(f"{step_name(s)} {tier}: {e}")
                continue
            for why in skipped:
                log(f"[ckpt] restore: skipped {why}")
            log(f"[ckpt] restore: using {step_name(s)} from {tier} ({path})")
            return RestorePoint(s, tier, str(path), skipped)
    for why in skipped:
        log(f"[ckpt] restore: skipped {why}")
    return None


# ----------------------------------------------------------------------------- retention
def retention_plan(by_tier: dict[str, list[int]], keep: dict[str, int], l2_every: int) -> dict[str, list[int]]:
    """Steps to delete per tier: L0/L1 keep their last ``keep[tier]`` steps; L2 keeps the last ``keep['L2']``
    plus every step that is a multiple of ``l2_every`` (0 = keeps every L2 step)."""
    out = {}
    for tier, steps in by_tier.items():
        steps = sorted(steps)
        kept = set(steps[-keep[tier]:]) if keep[tier] > 0 else set(steps)
        if tier == "L2":
            kept |= {s for s in steps if not l2_every or s % l2_every == 0}
        out[tier] = [s for s in steps if s not in kept]
    return out


def newest_verified(spec: JobSpec, rel_root: str, by_tier: dict[str, list[int]]) -> Optional[int]:
    """The newest step with a copy that verifies at some tier (L2 checked through S3's checksums)."""
    for s in sorted({s for v in by_tier.values() for s in v}, reverse=True):
        locs = tier_locations(spec, f"{rel_root}/{step_name(s)}")
        for tier in TIERS:
            if s in by_tier.get(tier, []):
                try:
                    verify_copy(spec, tier, locs[tier])
                    return s
                except CheckpointError:
                    continue
    return None


def accepted_steps(spec: JobSpec, rel_root: str, by_tier: dict[str, list[int]],
                   rec: Optional[dict]) -> dict[str, list[int]]:
    """``by_tier`` less the steps another line of training wrote (:mod:`pipelines.train.lineage`); every step
    counts when there is no lineage record."""
    if rec is None:
        return by_tier
    out = {}
    for tier, steps in by_tier.items():
        keep = []
        for st in steps:
            loc = tier_locations(spec, f"{rel_root}/{step_name(st)}")[tier]
            try:
                man = read_s3_manifest(spec, loc) if tier == "L2" else read_local_manifest(Path(loc))
            except (CheckpointError, OSError, json.JSONDecodeError):
                man = None
            if man is not None and lineage.accepts(rec, st, lineage.of(man)):
                keep.append(st)
        out[tier] = keep
    return out


def prune(spec: JobSpec, rel_root: str, upto: Optional[int] = None, tiers: tuple[str, ...] = TIERS,
          protect: set[int] = frozenset(), rec: Optional[dict] = None,
          log: Callable[[str], None] = print) -> dict[str, list[int]]:
    """Apply ``checkpoint.keep_l0/keep_l1/keep_l2`` and ``l2_keep_every`` to this run's checkpoints. Only steps
    ≤ ``upto`` are touched (newer ones may still be waiting for promotion), neither ``protect`` nor the newest step
    that verifies on these tiers is ever deleted; only the steps of this line of training (``rec``) count. With L2
    not answering, the other tiers are pruned all the same. Returns the steps deleted per tier."""
    c = spec.checkpoint
    try:
        by_tier = list_steps(spec, rel_root, tiers)
    except L2Unavailable as e:
        log(f"[ckpt] retention: L2 skipped ({e})")
        tiers = tuple(t for t in tiers if t != "L2")
        by_tier = list_steps(spec, rel_root, tiers)
    by_tier = accepted_steps(spec, rel_root, by_tier, rec)
    plan = retention_plan(by_tier, {"L0": c.keep_l0, "L1": c.keep_l1, "L2": c.keep_l2}, c.l2_keep_every)
    plan = {t: [s for s in v if (upto is None or s <= upto) and s not in protect] for t, v in plan.items()}
    if not any(plan.values()):
        return plan
    guard = newest_verified(spec, rel_root, by_tier)
    plan = {t: [s for s in v if s != guard] for t, v in plan.items()}
    _remove_steps(spec, rel_root, plan)
    return plan


def _remove_steps(spec: JobSpec, rel_root: str, steps_by_tier: dict[str, list[int]]) -> None:
    for tier, steps in steps_by_tier.items():
        for s in steps:
            loc = tier_locations(spec, f"{rel_root}/{step_name(s)}")[tier]
            faults.point("retention")
            remove_s3(spec, loc) if tier == "L2" else remove_local(Path(loc))


def drop_stale_staging(spec: JobSpec, rel_root: str, rec: Optional[dict] = None) -> list[int]:
    """Rank 0: L1 staging of steps older than the newest globally committed one of this line of training (parts of
    a dead attempt)."""
    root = Path(tier_locations(spec, rel_root)["L1"])
    newest = max(accepted_steps(spec, rel_root, list_steps(spec, rel_root, ("L1",)), rec)["L1"], default=None)
    dropped = []
    for d in [*root.glob(".step-*.parts"), *root.glob(".step-*.l2")] if newest is not None else []:
        step = parse_step(d.name[1:].rsplit(".", 1)[0])
        if step is not None and step < newest:
            shutil.rmtree(d, ignore_errors=True)
            dropped.append(step)
    return dropped


def clear_run(spec: JobSpec, rel_root: str) -> dict[str, list[int]]:
    """Remove the committed steps of this run from every tier (a run that starts over, ``train.resume=never``,
    must not leave older steps of the same key to be mixed with its own by retention or a later resume), except
    a step that a registered model version points to."""
    keep = registered_steps(spec, rel_root)
    by_tier = {t: [s for s in v if s not in keep] for t, v in list_steps(spec, rel_root).items()}
    _remove_steps(spec, rel_root, by_tier)
    return by_tier


def registered_steps(spec: JobSpec, rel_root: str) -> set[int]:
    """Steps of this run that a registered model version points to (its ``checkpoint_uri`` tag). Raises
    CheckpointError when the registry cannot be read: then nothing may be deleted."""
    prefix = tier_locations(spec, rel_root)["L2"] + "/"
    try:
        from pipelines import tracking

        versions = tracking.client(spec).search_model_versions(f"name='{spec.registry.model_name}'")
    except Exception as e:  # noqa: BLE001 - unknown = everything may be needed
        raise CheckpointError(f"cannot read the model registry ({type(e).__name__}: {e}); deleting no checkpoint")
    steps = set()
    for v in versions:
        uri = (v.tags or {}).get("checkpoint_uri", "")
        if uri.startswith(prefix) and parse_step(uri[len(prefix):].strip("/")) is not None:
            steps.add(parse_step(uri[len(prefix):].strip("/")))
    return steps


# ----------------------------------------------------------------------------- generations
# ``run.force`` starts a run's training over *beside* the steps it replaces: a new generation, its own rel root
# ``<run>/<key>.gen-<utc>``. The old generation stays on every tier until the new one's train stage commits; then
# it is retired, except the steps a registered model version points to. A retried forced run adopts the pending
# generation (and resumes it) instead of starting yet another. The record lives on L1, beside the key.
def _generations_file(spec: JobSpec, base_rel: str) -> Path:
    return Path(tier_locations(spec, base_rel)["L1"] + ".generations.json")


def _generations(spec: JobSpec, base_rel: str) -> dict:
    path = _generations_file(spec, base_rel)
    state = json.loads(path.read_text()) if path.is_file() else {}
    return {"current": state.get("current", base_rel), "pending": state.get("pending")}


def generation(spec: JobSpec, base_rel: str, force: bool) -> str:
    """The rel root this run trains in: the current generation, or with ``force`` a pending new one."""
    import datetime

    state = _generations(spec, base_rel)
    if not force:
        return state["current"]
    if state["pending"] is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        state["pending"] = f"{base_rel}.gen-{stamp}"
        path = _generations_file(spec, base_rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(state, indent=2))
    return state["pending"]


def commit_generation(spec: JobSpec, base_rel: str, rel_root: str, log: Callable[[str], None] = print) -> dict:
    """``rel_root``'s run committed: make it current and retire the generation it replaced (every tier), keeping
    the steps a registered model points to. Returns {retired rel root: {tier: steps removed}}."""
    state = _generations(spec, base_rel)
    old = state["current"]
    if rel_root == old and state["pending"] is None:
        return {}
    atomic_write_text(_generations_file(spec, base_rel), json.dumps({"current": rel_root, "pending": None}, indent=2))
    if old == rel_root:
        return {}
    try:
        keep = registered_steps(spec, old)
    except CheckpointError as e:
        log(f"[ckpt] generation {old} not retired: {e}")
        return {}
    gone = {t: [s for s in v if s not in keep] for t, v in list_steps(spec, old).items()}
    _remove_steps(spec, old, gone)
    log(f"[ckpt] generation {rel_root} committed; retired {old}: removed {gone}"
        + (f", kept registered step(s) {sorted(keep)}" if keep else ""))
    return {old: gone}


# ----------------------------------------------------------------------------- promote
def promote_l1(spec: JobSpec, rel: str) -> tuple[str, Optional[dict]]:
    """Checkpoint ``rel`` L0 → L1 (verified while copied, COMMIT last; a verified L1 copy is kept): (action, the
    files' part digests for the S3 upload that follows, None when nothing was copied)."""
    locs = tier_locations(spec, rel)
    l0, l1 = Path(locs["L0"]), Path(locs["L1"])
    if is_valid_local(l1) and (not (l0 / COMMIT).is_file() or _same_line(l0, l1)):
        return "already-verified", None
    if not l0.exists():
        raise CheckpointError(f"L0 copy {l0} is gone and L1 holds no verified copy: nothing to promote")
    return "copied", copy_local(l0, l1, spec.checkpoint.multipart_chunk_mb << 20)  # refuses a corrupt L0


def _same_line(a: Path, b: Path) -> bool:
    """Do two committed copies of a step come from the same attempt and line of training?"""
    ma, mb = read_local_manifest(a), read_local_manifest(b)
    return (ma.get("attempt"), ma.get("lineage")) == (mb.get("attempt"), mb.get("lineage"))


def promote(spec: JobSpec, rel: str, tiers: tuple[str, ...] = ("L1", "L2")) -> dict:
    """Copy checkpoint ``rel`` L0 → L1 (→ L2), each copy verified, COMMIT last; a verified copy is kept."""
    locs = tier_locations(spec, rel)
    report = {"checkpoint": rel, "tiers": locs, "actions": {}}
    report["actions"]["L1"], parts = promote_l1(spec, rel)
    if "L2" in tiers:
        report["actions"]["L2"] = upload_checkpoint(spec, Path(locs["L1"]), locs["L2"], parts)
    report["commit"] = (Path(locs["L1"]) / COMMIT).read_text().strip()
    return report


# ----------------------------------------------------------------------------- node parts
# With node-local L0, node K's local leader commits *its part* of a step on its own disk: its ranks' shards (node 0
# also the DCP .metadata and the small files) with a MANIFEST whose meta says {"part": K, "parts": N, "attempt"}.
# Each node promotes its own part: to L1 it is staged in ``.step-N.parts/part-K`` (a committed copy), to L2 its
# files go under the step's prefix and ``PARTS/part-K.json`` (the part's manifest) last. Global rank 0 then merges:
# when every part of the same attempt is there, the step gets MANIFEST (all files, ``part_of``) and COMMIT, last.
def part_name(k: int) -> str:
    return f"part-{k}"


def staging_dir(step_dir: Path) -> Path:
    """L1: where the nodes stage their parts of ``step_dir`` before rank 0 merges them."""
    return step_dir.with_name(f".{step_dir.name}.parts")


def l2_marks_dir(step_dir: Path) -> Path:
    """L1: where each node marks whether its part of ``step_dir`` reached L2 (``part-K``: ok / failed)."""
    return step_dir.with_name(f".{step_dir.name}.l2")


def part_of(man: dict) -> tuple[int, int, Optional[str]]:
    """(part, parts, attempt) of a committed part's manifest; a whole checkpoint is part 0 of 1."""
    return int(man.get("part", 0)), int(man.get("parts", 1)), man.get("attempt")


def merged_manifest(mans: list[dict]) -> str:
    """The step's manifest from its parts' (in part order): every file, which part holds it, the parts' meta."""
    files, owner = {}, {}
    for m in mans:
        k = part_of(m)[0]
        for rel, info in manifest_files(m, f"part {k}").items():
            files[rel], owner[rel] = info, k
    meta = {key: mans[0][key] for key in ("step", "format", "world_size", "attempt", "lineage") if key in mans[0]}
    return json.dumps({"files": files, "part_of": owner, "parts": len(mans), **meta}, indent=2, sort_keys=True)


def local_parts(root: Path) -> dict[int, dict]:
    """This node's committed parts under ``root`` (a run's L0 directory): {step: manifest}, not yet hashed."""
    out = {}
    for d in sorted(root.glob("step-*")) if root.is_dir() else []:
        step = parse_step(d.name)
        try:
            if step is not None:
                out[step] = read_local_manifest(d)
        except (CheckpointError, FileNotFoundError, json.JSONDecodeError):
            continue
    return out


def stage_part(l0_part: Path, l1_step: Path, chunk: int, again: bool = False) -> tuple[str, Optional[dict]]:
    """Copy a committed L0 part into L1's staging (verified while copied, COMMIT last); returns (action, the
    files' part digests for an S3 upload). Nothing is copied when L1 holds this attempt's step (unless ``again``:
    a restore found that copy bad) or part already."""
    man = read_local_manifest(l0_part)
    k, _, attempt = part_of(man)
    if committed_attempt(l1_step) == attempt and not again:
        return "already-verified", None
    dst = staging_dir(l1_step) / part_name(k)
    if (dst / COMMIT).is_file() and (dst / COMMIT).read_text() == (l0_part / COMMIT).read_text() and is_valid_local(dst):
        return "already-verified", None
    return "copied", copy_local(l0_part, dst, chunk)


def committed_attempt(step_dir: Path) -> Optional[str]:
    try:
        return read_local_manifest(step_dir).get("attempt")
    except (CheckpointError, FileNotFoundError, json.JSONDecodeError):
        return None


def merge_parts(l1_step: Path, parts: int, attempt: Optional[str], again: bool = False) -> bool:
    """Rank 0: when every part of ``attempt`` is staged on L1, link their files into the step directory, write
    the merged MANIFEST and COMMIT last, drop the staging. False while a part is missing (or of another attempt).
    ``again``: merge even over a committed copy of this attempt (a restore found it bad; it is replaced only once
    the new one is whole)."""
    if committed_attempt(l1_step) == attempt and not again:
        return True
    staged = staging_dir(l1_step)
    mans = []
    for k in range(parts):
        try:
            man = read_local_manifest(staged / part_name(k))
        except (CheckpointError, FileNotFoundError, json.JSONDecodeError):
            return False
        if part_of(man)[2] != attempt:
            return False
        mans.append(man)
    body = merged_manifest(mans)
    tmp = l1_step.with_name(f".{l1_step.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        for m in mans:
            src = staged / part_name(part_of(m)[0])
            for rel, info in m["files"].items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                _link_or_copy(src / rel, tmp / rel)
                if (tmp / rel).stat().st_size != info["bytes"]:
                    raise CheckpointError(f"{src / rel}: size differs from its part manifest")
        missing = missing_shards(tmp)
        if missing:
            raise CheckpointError(f"{l1_step}: the parts hold no {missing}; a node's ranks wrote elsewhere")
        faults.point("merge")
        atomic_write_text(tmp / CKPT_MANIFEST, body)
        atomic_write_text(tmp / COMMIT, hashlib.sha256(body.encode()).hexdigest())  # last
        if l1_step.exists():
            remove_local(l1_step)
        os.replace(tmp, l1_step)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(staged, ignore_errors=True)
    return True


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(src, dst)


def upload_part(spec: JobSpec, l0_part: Path, uri: str, digests: Optional[dict] = None) -> str:
    """Node K's part to the step's L2 prefix: its files (each checked), then ``PARTS/part-K.json`` last. Aborts
    only this part's unfinished multipart uploads (another node may be uploading its part there now)."""
    from pipelines.storage.s3 import client, ensure_bucket, split_uri

    man = verify_local(l0_part) if digests is None else read_local_manifest(l0_part)
    k, _, attempt = part_of(man)
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    ensure_bucket(s3, bucket, spec.services.s3_region)
    marker, body = f"{prefix}/{PARTS}/{part_name(k)}.json", (l0_part / CKPT_MANIFEST).read_bytes()
    if _s3_body(s3, bucket, marker) == body and _all_match(spec, s3, bucket, prefix, l0_part, man["files"], digests or {}):
        return "already-verified"
    committed = read_s3_manifest(spec, uri)
    if committed is not None and committed.get("attempt") != attempt:  # another attempt's step: no longer whole
        s3.delete_object(Bucket=bucket, Key=f"{prefix}/{COMMIT}")
    s3.delete_object(Bucket=bucket, Key=marker)
    abort_multipart(s3, bucket, prefix, {f"{prefix}/{rel}" for rel in man["files"]})
    _upload_files(spec, s3, bucket, prefix, l0_part, man["files"], digests or {})
    s3.put_object(Bucket=bucket, Key=marker, Body=body)  # last
    return "uploaded"


def s3_part_manifests(spec: JobSpec, uri: str, parts: int) -> Optional[list[dict]]:
    """The parts' manifests on L2, or None while one is missing."""
    from pipelines.storage.s3 import client, split_uri

    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    mans = []
    for k in range(parts):
        body = _s3_body(s3, bucket, f"{prefix}/{PARTS}/{part_name(k)}.json")
        if body is None:
            return None
        mans.append(json.loads(body))
    return mans


def merge_parts_s3(spec: JobSpec, uri: str, parts: int, attempt: Optional[str]) -> bool:
    """Rank 0, on L2: when every part of ``attempt`` is there and each object matches its part's manifest (S3's
    checksums; see _check_objects), put the merged MANIFEST and COMMIT last. False while a part is missing."""
    from pipelines.storage.s3 import client, split_uri

    mans = s3_part_manifests(spec, uri, parts)
    if mans is None or any(part_of(m)[2] != attempt for m in mans):
        return False
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    body = merged_manifest(mans)
    commit = hashlib.sha256(body.encode()).hexdigest()
    if s3_commit_body(s3, bucket, prefix) == commit:
        return True
    _check_objects(s3, bucket, prefix, json.loads(body)["files"], uri)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{CKPT_MANIFEST}", Body=body.encode())
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{COMMIT}", Body=commit.encode())  # last
    return True


# ----------------------------------------------------------------------------- consumers
def load_plain_model(ckpt_dir: Path):
    """A plain ``Transformer`` (eval mode, CPU) from a committed checkpoint directory: a DCP checkpoint
    (resharded from whatever layout wrote it; no process group needed) or a legacy ``model.pt``."""
    import torch

    from pipelines.train.model import ModelArgs, Transformer

    model = Transformer(ModelArgs(**json.loads((ckpt_dir / "model_args.json").read_text())))
    if (ckpt_dir / ".metadata").is_file():
        import torch.distributed.checkpoint as dcp

        import warnings

        sd = model.state_dict()
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": sd}, checkpoint_id=str(ckpt_dir), no_dist=True)
        model.load_state_dict(sd)  # strict: every name and shape matched
    else:
        model.load_state_dict(torch.load(ckpt_dir / "model.pt", map_location="cpu", weights_only=True))
    return model.eval()


def export(src: Path, out: Path) -> int:
    """Write ``{name: tensor}`` (what ``Transformer.load_state_dict`` takes, strictly) from a committed local
    checkpoint; returns the number of tensors."""
    import torch

    verify_local(src)
    sd = load_plain_model(src).state_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    torch.save(sd, tmp)
    os.replace(tmp, out)
    return len(sd)


def export_main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pipelines.train.checkpoint export",
                                 description="Write a consolidated plain state dict ({name: tensor}, loadable strictly "
                                 "by Transformer.load_state_dict) from a committed local checkpoint directory.")
    ap.add_argument("src", help="A committed checkpoint directory (step-NNNNNN with MANIFEST.json and COMMIT).")
    ap.add_argument("out", help="Output .pt file.")
    a = ap.parse_args(argv)
    if os.environ.get("RANK", "0") != "0":  # on the launcher's ranks (register of a big model): the first one writes
        return 0
    try:
        n = export(Path(a.src), Path(a.out))
    except (CheckpointError, FileNotFoundError) as e:
        print(f"export: error: {e}", file=sys.stderr)
        return 2
    print(f"export: {n} tensors → {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["export"]:
        print("usage: python -m pipelines.train.checkpoint export SRC OUT.pt\n(the promote stage is "
              "python -m pipelines.train.promote)", file=sys.stderr)
        return 2
    return export_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
