"""Fences enforced by L2 itself (issue 52): the step's COMMIT marker, its MANIFEST and each part's
``PARTS/part-K.json`` are written and deleted with S3 conditional requests, so a writer that paused between its
fence check and its write (a frozen pod, a stalled process) cannot land over what a newer term wrote meanwhile.

A writer reads the object's ETag when it decides (:func:`etag`); its write then says what it expects there:
``If-None-Match: *`` to create (the object must still be absent), ``If-Match: <etag>`` to replace or delete (it
must still be the copy that was read). When another writer changed it in between, S3 answers 412 and the writer
stops with :class:`~pipelines.train.ckpt.fence.FencedOut` (exit 75): the newer copy stays. AWS S3 honours both on
PutObject and If-Match on DeleteObject; so does moto (5.2). Endpoints that ignore them answer 200 to a write whose
condition is false: ``rclone serve s3`` (the embedded endpoint) does. Each (endpoint, bucket) is probed once per
process (:func:`supported`: a conditional put of each kind and a conditional delete, each with a false condition),
and one line says so where the conditions are not honoured; there the fence checks before each write
(:func:`pipelines.train.ckpt.fence.check` / ``guard``) stay the only protection, as before. The data objects of a part
are written the same way (:func:`pipelines.train.ckpt.s3_tier.upload_files`: the object read when the writer decided,
or its absence, is the condition of the put or of the multipart upload's completion), so a paused writer's upload
cannot spoil a newer copy's files either.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from pipelines.spec import JobSpec
from pipelines.storage import faults
from pipelines.storage.s3 import (client, conditional_conflict, conditions, missing, precondition_failed, probed,
                                  split_uri, unreachable)
from pipelines.train.ckpt import fence
from pipelines.train.ckpt.fence import FencedOut
from pipelines.train.ckpt.protocol import COMMIT, L2Unavailable
from pipelines.train.ckpt.s3_tier import object_etag, read_s3_manifest, s3_body

_said: set[tuple[str, str]] = set()  # the endpoints and buckets whose probe was told (one line each)
_lock = threading.Lock()


def _refused(s3_or_call, **kw) -> bool:
    """Did the endpoint refuse this put (or this call), whose condition is false, with 412?"""
    call = s3_or_call if callable(s3_or_call) else s3_or_call.put_object
    try:
        call(**kw)
    except Exception as e:  # noqa: BLE001 - only a 412 counts as honoured; an outage propagates
        if precondition_failed(e):
            return True
        if unreachable(e):
            raise
        return False  # e.g. 501 NotImplemented: an endpoint that does not know the header
    return False


def supported(s3, bucket: str, log: Callable[[str], None] = print) -> bool:
    """Whether the endpoint honours ``If-None-Match: *`` and ``If-Match`` on PutObject for ``bucket``: probed once
    per process with a small object of its own (then removed); an endpoint that does not is named in one line."""
    def check(key: str, tag: str) -> bool:
        wrong = '"0"' if tag != '"0"' else '"1"'
        return _refused(s3, Bucket=bucket, Key=key, Body=b"2", IfNoneMatch="*") and \
            _refused(s3, Bucket=bucket, Key=key, Body=b"3", IfMatch=wrong) and \
            _refused(s3.delete_object, Bucket=bucket, Key=key, IfMatch=wrong)

    ok = probed("PutObject", s3, bucket, check)
    with _lock:
        first = (s3.meta.endpoint_url, bucket) not in _said
        _said.add((s3.meta.endpoint_url, bucket))
    if not ok and first:
        log(f"[ckpt] L2 {s3.meta.endpoint_url} (bucket {bucket}) ignores conditional writes (If-None-Match, If-Match): "
            "fences on L2 are checked by this client before each write, and a writer paused between its check and "
            "its write could land after a newer term (AWS S3 and moto honour them; rclone serve s3 does not)")
    return ok


def _holds(s3, bucket: str, key: str, body: bytes) -> bool:
    """Does the object hold exactly ``body`` now?"""
    return s3_body(s3, bucket, key) == body


# AWS answers 409 (ConditionalRequestConflict) to a conditional write while another one to the same key is in
# flight, and asks for the request again; botocore does not retry it. Every node's leader puts the same term record
# (``fence_l2.record``) at its first promotion, at about the same moment: the request is sent again after each of
# these waits, whose end decides (our bytes there: done; another writer's: its 412), and only then is it "later".
CONFLICT_WAITS_S = (0.2, 1.0, 3.0)


def _sent(call: Callable[[], object], cond: bool, where: str, what: str):
    """``call()``, a conditional request (``cond``) sent again after each of :data:`CONFLICT_WAITS_S` while it
    meets a 409 (its condition is evaluated anew each time); then :class:`L2Unavailable`. Any other error is raised
    as it is; an unconditional request is not sent again (no condition would stop it landing late)."""
    for wait in (*(CONFLICT_WAITS_S if cond else ()), None):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - only a 409 is sent again
            if not conditional_conflict(e):
                raise
            if wait is None:
                tries = f"each of {len(CONFLICT_WAITS_S) + 1} times" if cond else "(not sent again: unconditional)"
                raise L2Unavailable(f"{what}: {where}: a concurrent conditional write (409) {tries}: later") from None
            time.sleep(wait)


def put(s3, bucket: str, key: str, body: bytes, expected: Optional[str], cond: bool, what: str) -> dict:
    """Put ``body`` where ``expected`` (an ETag, or None: absent) still is, else :class:`FencedOut`. A ``pause``
    between a fence check and this write is the fault point ``act`` (``LLMP_FAULTS``)."""
    faults.point(faults.ACT)
    try:
        return _sent(lambda: s3.put_object(Bucket=bucket, Key=key, Body=body, **conditions(cond, expected)),
                     cond, f"s3://{bucket}/{key}", what)
    except Exception as e:  # noqa: BLE001 - a 412 is another writer's newer copy; the rest propagates
        if precondition_failed(e):
            if _holds(s3, bucket, key, body):  # our own put, retried by botocore after its answer was lost
                return {}
            raise FencedOut(f"{what}: s3://{bucket}/{key} changed since this attempt read it (a newer term wrote "
                            "it): stopping before replacing it") from None
        raise


def delete(s3, bucket: str, key: str, expected: Optional[str], cond: bool, what: str) -> None:
    """Delete the object only while it is still the copy read (``expected``); absent: nothing to do."""
    if expected is None:
        return

    faults.point(faults.ACT)
    try:
        _sent(lambda: s3.delete_object(Bucket=bucket, Key=key, **({"IfMatch": expected} if cond else {})),
              cond, f"s3://{bucket}/{key}", what)
    except Exception as e:  # noqa: BLE001 - as in put
        if missing(e) or (precondition_failed(e) and object_etag(s3, bucket, key) is None):
            return  # gone: our own delete, retried after its answer was lost
        if precondition_failed(e):
            raise FencedOut(f"{what}: s3://{bucket}/{key} changed since this attempt read it (a newer term wrote "
                            "it): stopping before deleting it") from None
        raise


def remove_step(spec: JobSpec, uri: str) -> None:
    """A step's copy on L2 removed: its objects listed first (each with its ETag), then the fence's guard (never by
    a superseded attempt, nor a copy a newer term committed: :func:`pipelines.train.ckpt.fence.guard`), then its
    COMMIT, then each object listed, every delete on the condition that the object is still the one listed (where
    the endpoint honours it): what another writer put after the listing, a newer term's copy of the same step, stays
    (:class:`FencedOut`)."""
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    listed = {o["Key"]: o.get("ETag") for page in pages for o in page.get("Contents", [])}
    fence.guard(f"removing {uri}", uri, lambda: read_s3_manifest(spec, uri))
    cond = supported(s3, bucket)
    delete(s3, bucket, f"{prefix}/{COMMIT}", listed.pop(f"{prefix}/{COMMIT}", None), cond, f"removing {uri}")
    for key, tag in listed.items():
        delete(s3, bucket, key, tag, cond, f"removing {uri}")
