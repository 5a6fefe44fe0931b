"""The S3 tier (L2) of a checkpoint (see :mod:`pipelines.train.ckpt.protocol`): uploads, downloads, checks, removal.

S3 verification uses S3's own SHA-256 checksums (``ChecksumAlgorithm=SHA256``): for a single-part
upload the object checksum is the file's sha256; for multipart it is the composite
sha256(part digests)-N, which we recompute locally with the part size the transfer really used
(s3transfer raises the configured chunk size for files that would need more than 10,000 parts). If
an endpoint returns no checksum, the object is downloaded and hashed. Multipart uploads left by an
interrupted promotion are aborted before the next upload of the same part's files.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

from botocore.exceptions import ClientError

from pipelines.spec import JobSpec
from pipelines.storage import faults
from pipelines.storage.s3 import (b64, checksums_verified, client, composite_sha256, conditional_conflict, conditions,
                                  credentials_refused, missing, object_matches, part_digests, part_size_used,
                                  precondition_failed, probed, split_uri, unreachable)
from pipelines.train.ckpt import fence
from pipelines.train.ckpt.protocol import (CKPT_MANIFEST, COMMIT, PARTS, PARTS_META, CheckpointError, L2Refused,
                                        L2Unavailable, manifest_files, part_name, verify_local)
from pipelines.train.ckpt.local import install_dir, make_durable, naming


def transfer_config(spec: JobSpec):
    from boto3.s3.transfer import TransferConfig

    mb = 1024 * 1024
    return TransferConfig(multipart_threshold=spec.checkpoint.multipart_threshold_mb * mb,
                          multipart_chunksize=spec.checkpoint.multipart_chunk_mb * mb, max_concurrency=4)


def answered(where: str, call):
    """``call()``; None only when what it asks for is not there (no key, no bucket); an endpoint that does not
    answer raises :class:`L2Unavailable` (an outage must never read as "absent"), one that refuses these credentials
    :class:`L2Refused`; any other error propagates."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - sorted into absent / unreachable / other
        if missing(e):
            return None
        if unreachable(e):
            raise unusable(where, e) from None
        raise


def unusable(where: str, e: BaseException) -> L2Unavailable:
    """What ``e``, an error for which :func:`~pipelines.storage.s3.unreachable` holds, says of L2 at ``where``: refused
    credentials or configuration (:class:`L2Refused`, exit 2 where only L2 could answer), else not answering (75)."""
    if credentials_refused(e):
        return L2Refused(f"{where}: the object store refused the request ({type(e).__name__}: {e}); check "
                         "services.s3_endpoint_url, services.s3_bucket and the AWS credentials this process gets")
    return L2Unavailable(f"{where}: {type(e).__name__}: {e}")


def s3_body(s3, bucket: str, key: str) -> Optional[bytes]:
    """The object's bytes; None only when it is not there (:func:`answered`)."""
    return answered(f"s3://{bucket}/{key}", lambda: s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def s3_commit_body(s3, bucket: str, prefix: str) -> Optional[str]:
    body = s3_body(s3, bucket, f"{prefix}/{COMMIT}")
    return None if body is None else body.decode().strip()


def commit_at(spec: JobSpec, uri: str) -> Optional[str]:
    """The COMMIT marker's body of the S3 copy at ``uri``; None when there is none."""
    bucket, prefix = split_uri(uri.rstrip("/"))
    return s3_commit_body(client(spec), bucket, prefix)


def multipart_uploads(s3, bucket: str, prefix: str = "") -> list[dict]:
    """The multipart uploads in progress under ``prefix`` (an endpoint that answers NoSuchUpload when there are
    none, as rclone's does, has none)."""
    try:
        return [up for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix)
                for up in page.get("Uploads", [])]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "NoSuchUpload":
            return []
        raise


def abort_multipart(s3, bucket: str, prefix: str, keys: set[str]) -> int:
    """Abort the multipart uploads an interrupted promotion left under ``prefix`` to ``keys`` (only those: another
    node may be uploading its own part there right now); returns how many."""
    n = 0
    for up in multipart_uploads(s3, bucket, f"{prefix}/"):
        if up["Key"] in keys:
            s3.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
            n += 1
    return n


def _upload_parts(s3, bucket: str, key: str, path: Path, part: int, digests: list[bytes], sha_hex: str,
                  when: dict) -> None:
    """Multipart upload that sends the part digests computed while the file was copied (no second hashing
    pass): S3 refuses a part whose bytes do not match its ``x-amz-checksum-sha256``. ``when``: the completion's
    conditions (:func:`pipelines.storage.s3.conditions`)."""
    # the metadata names the whole file's sha256 and the composite S3 will compute from the verified parts: a later
    # check compares S3's own composite checksum with it (content, not size; see check_objects)
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
        fence.check(f"completing the upload of s3://{bucket}/{key}", f"s3://{bucket}/{key}")  # parts take minutes
        faults.point(faults.ACT)
        s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts},
                                     **when)
    except Exception:
        try:  # the first error is the one to tell (a refused completion may have ended the upload already)
            s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"])
        except Exception:  # noqa: BLE001 - an upload left open is aborted by the next put of the part
            pass
        raise


def put_file(s3, bucket: str, key: str, path: Path, sha_hex: str, when: dict) -> None:
    """A file under the multipart threshold in one PutObject, with S3's SHA-256 checksum and its sha256 in the
    metadata; ``when``: the put's conditions."""
    faults.point(faults.ACT)
    with open(path, "rb") as f:  # streamed (multipart_threshold_mb is at most 4 GiB)
        s3.put_object(Bucket=bucket, Key=key, Body=f, ChecksumAlgorithm="SHA256", Metadata={"sha256": sha_hex},
                      **when)


def completion_conditions(s3, bucket: str, expected: Optional[str]) -> dict:
    """The conditions a multipart completion carries at this endpoint: ``If-None-Match: *`` (the object still
    absent) or ``If-Match: <expected>``, each only where the endpoint honours it on CompleteMultipartUpload (probed
    once per endpoint and bucket, :func:`completion_honoured`: AWS S3 honours both, moto 5.2 only the first, rclone
    neither); one it would ignore is not sent, and the fence check right before the completion is then the only
    protection."""
    none_match, match = completion_honoured(s3, bucket)
    if expected is None:
        return {"IfNoneMatch": "*"} if none_match else {}
    return {"IfMatch": expected} if match else {}


def completion_honoured(s3, bucket: str) -> tuple[bool, bool]:
    """(If-None-Match honoured, If-Match honoured) on CompleteMultipartUpload: a one-part upload over a small object
    of its own, completed once with each condition false (a 412 is honoured; a success or another refusal, such as
    501, is not); the probe object is removed."""
    def check(key: str, tag: str) -> tuple[bool, bool]:
        wrong = '"0"' if tag != '"0"' else '"1"'
        return (_completion_refused(s3, bucket, key, {"IfNoneMatch": "*"}),
                _completion_refused(s3, bucket, key, {"IfMatch": wrong}))

    return probed("CompleteMultipartUpload", s3, bucket, check)


def _completion_refused(s3, bucket: str, key: str, when: dict) -> bool:
    up = s3.create_multipart_upload(Bucket=bucket, Key=key)
    try:
        part = s3.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"2")
        s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"],
                                     MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]}, **when)
    except Exception as e:  # noqa: BLE001 - only a 412 counts as honoured; an outage propagates
        status = getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if unreachable(e) and not precondition_failed(e) and status != 501:  # 501: the header is not known
            raise
        return precondition_failed(e)
    finally:
        try:
            s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"])
        except Exception:  # noqa: BLE001 - completed (the condition ignored), or already ended by the refusal
            pass
    return False


def object_etag(s3, bucket: str, key: str) -> Optional[str]:
    """The object's ETag now; None when it is absent (an outage raises, :func:`answered`)."""
    return answered(f"s3://{bucket}/{key}", lambda: s3.head_object(Bucket=bucket, Key=key)["ETag"])


def upload_files(spec: JobSpec, s3, bucket: str, prefix: str, src: Path, files: dict,
                 parts: dict[str, list[bytes]], honoured: bool = False) -> None:
    """Upload ``files`` of ``src`` under ``prefix``, each object checked against the manifest's sha256. Under a fence,
    checked before each file (:func:`pipelines.train.ckpt.fence.check`): a part of many files stops sending as soon as its
    attempt is superseded, not only at its COMMIT. Where the endpoint ``honoured`` conditional writes, each object is
    written only while it is still what this writer read when it decided (absent, or a copy that does not match):
    a newer term's object written meanwhile stops this writer (:class:`~pipelines.train.ckpt.fence.FencedOut`)."""
    part = spec.checkpoint.multipart_chunk_mb * 1024 * 1024
    threshold = transfer_config(spec).multipart_threshold
    for rel, info in files.items():
        key, size = f"{prefix}/{rel}", info["bytes"]
        digests = parts.get(rel)
        seen = object_etag(s3, bucket, key) if honoured else None  # what this writer decides against
        if object_matches(s3, bucket, key, src / rel, info["sha256"], part, digests) and \
                _object_ok(s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED"), info,
                           checksums_verified(s3)) in (None, UNCHECKED):
            continue  # uploaded already (a node's part, an interrupted upload): not sent twice
        fence.check(f"uploading {rel} to s3://{bucket}/{prefix}", f"s3://{bucket}/{key}")
        if size >= threshold and not (digests and len(digests) == -(-size // part_size_used(size, part))):
            digests = part_digests(src / rel, part_size_used(size, part))  # multipart: always with our part digests
        try:
            if size >= threshold:
                _upload_parts(s3, bucket, key, src / rel, part_size_used(size, part), digests, info["sha256"],
                              completion_conditions(s3, bucket, seen) if honoured else {})
            else:
                put_file(s3, bucket, key, src / rel, info["sha256"], conditions(honoured, seen))
        except Exception as e:  # noqa: BLE001 - a 412 is a newer term's object; a 409 is retried later
            _refused_upload(e, rel, f"s3://{bucket}/{key}",
                            lambda: object_matches(s3, bucket, key, src / rel, info["sha256"], part, digests))
        if not object_matches(s3, bucket, key, src / rel, info["sha256"], part, digests):
            raise CheckpointError(f"s3://{bucket}/{key} does not match {rel}'s sha256 after upload")


def _refused_upload(e: Exception, rel: str, where: str, ours: Callable[[], bool]) -> None:
    """After an upload raised ``e``. A refusal of its condition (412), or of a multipart completion whose upload is
    gone (``NoSuchUpload``: another writer of the key aborted it): nothing to do when the object holds our bytes
    (our own write, retried after its answer was lost); :class:`FencedOut` when this attempt is superseded (a newer
    term's object); else another, older writer's object appeared meanwhile: :class:`L2Unavailable` (retried: the
    next upload replaces it, under its condition). A 409 (a conditional write in flight) is retried too; anything
    else is raised as it is."""
    what = f"uploading {rel}: {where}"
    gone = isinstance(e, ClientError) and str(e.response.get("Error", {}).get("Code")) == "NoSuchUpload"
    if conditional_conflict(e):
        raise L2Unavailable(f"{what}: a concurrent conditional write (409): later") from None
    if not (precondition_failed(e) or gone):
        raise e
    try:
        if ours():
            return
    except Exception as read:  # noqa: BLE001 - not answered: an outage, not another writer
        raise L2Unavailable(f"{what}: refused ({type(e).__name__}), and the object could not be read: {read}") from None
    fence.check(what, where)  # superseded: FencedOut, the newer term's object stays
    raise L2Unavailable(f"{what}: another writer's object is there (not this attempt's, nor a newer term's): "
                        "the next upload replaces it") from None


def all_match(spec: JobSpec, s3, bucket: str, prefix: str, src: Path, files: dict, parts: dict) -> bool:
    part = spec.checkpoint.multipart_chunk_mb * 1024 * 1024
    return all(object_matches(s3, bucket, f"{prefix}/{rel}", src / rel, info["sha256"], part, parts.get(rel))
               for rel, info in files.items())


def download_checkpoint(spec: JobSpec, uri: str, dest: Path, part: Optional[int] = None) -> Path:
    """Fetch ``uri`` into ``dest`` and verify every file; raise if the copy is incomplete or corrupt. With
    ``part``, only that node's part (its files and its manifest, ``PARTS/part-K.json``), as a committed part dir."""
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    if part is None:
        commit, key = s3_commit_body(s3, bucket, prefix), f"{prefix}/{CKPT_MANIFEST}"
        body = s3_body(s3, bucket, key) if commit else None
    else:
        key = f"{prefix}/{PARTS}/{part_name(part)}.json"
        body = s3_body(s3, bucket, key)
        if body is None:  # a step an older version uploaded whole: its part cut out of the manifest
            body = part_manifest(read_s3_manifest(spec, uri), part)
        commit = body and hashlib.sha256(body).hexdigest()
    if commit is None:
        raise CheckpointError(f"{uri}: no COMMIT marker — the checkpoint is incomplete or absent")
    tmp = dest.with_name(f".{dest.name}.tmp-{fence.tmp_tag()}")
    tmp.mkdir(parents=True)
    try:
        if body is None or hashlib.sha256(body).hexdigest() != commit:
            raise CheckpointError(f"{uri}: MANIFEST.json does not match its COMMIT marker")
        with naming(tmp, keep=(ConnectionError, TimeoutError)):  # a local write's error names the L1 dir
            (tmp / CKPT_MANIFEST).write_bytes(body)
            for rel in manifest_files(json.loads(body), uri):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                faults.file_op("write", tmp / rel)
                s3.download_file(bucket, f"{prefix}/{rel}", str(tmp / rel))
        make_durable(tmp)  # the files on the disk before the COMMIT that vouches for them
        with naming(tmp):
            (tmp / COMMIT).write_text(commit)
        verify_local(tmp)
        install_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def part_manifest(man: Optional[dict], k: int) -> Optional[bytes]:
    """Part ``k``'s manifest cut out of a step's merged one (its files, the step's meta), or None."""
    if man is None or "part_of" not in man:
        return None
    files = {rel: info for rel, info in manifest_files(man, f"part {k}").items() if int(man["part_of"].get(rel, 0)) == k}
    meta = {key: man[key] for key in ("step", "format", "world_size", "attempt", "lineage", "term") if key in man}
    body = {"files": files, "part": k, "parts": int(man.get("parts", 1)), **meta}
    return json.dumps(body, indent=2, sort_keys=True).encode()


def read_s3_manifest(spec: JobSpec, uri: str) -> Optional[dict]:
    """The manifest of a committed S3 copy (COMMIT matches MANIFEST.json), objects not checked; None if absent."""
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    commit = s3_commit_body(s3, bucket, prefix)
    body = s3_body(s3, bucket, f"{prefix}/{CKPT_MANIFEST}") if commit else None
    if body is None or hashlib.sha256(body).hexdigest() != commit:
        return None
    return json.loads(body)


def verify_s3(spec: JobSpec, uri: str) -> dict:
    """Check an S3 copy by content (COMMIT, manifest, each object against the manifest's sha256 through S3's own
    checksums, see :func:`check_objects`); returns the manifest or raises CheckpointError."""
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    commit = s3_commit_body(s3, bucket, prefix)
    if commit is None:
        raise CheckpointError(f"{uri}: no COMMIT marker")
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{CKPT_MANIFEST}")["Body"].read()
    if hashlib.sha256(body).hexdigest() != commit:
        raise CheckpointError(f"{uri}: MANIFEST.json does not match its COMMIT marker")
    man = json.loads(body)
    check_objects(s3, bucket, prefix, manifest_files(man, uri), uri)
    return man


def check_objects(s3, bucket: str, prefix: str, files: dict, uri: str) -> None:
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
