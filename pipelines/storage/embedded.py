"""The embedded S3 endpoint's persistence: moto's S3 server behind a write-through WSGI layer.

moto keeps objects in memory. :class:`WriteThrough` puts every object write and delete that the server
acknowledges on disk *before* the response leaves (object PUT, copy, multipart completion; DELETE, multi-object
delete, bucket create and delete), so a killed endpoint loses nothing it said was stored and a deleted object
never comes back. On start, :func:`load` puts the store back into the server.

Layout: ``<store>/<bucket>/<key>`` for a key whose parts are plain path names; any other key (``..``, a leading
or doubled ``/``, a NUL) goes to ``<store>/.keys/<bucket>/<sha256(key)>`` with the key beside it in ``….key``:
a key, which comes from whoever writes to the bucket, never names a path outside the store.
"""
from __future__ import annotations

import hashlib
import io
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import parse_qs, quote

from pipelines.manifest import atomic_write_bytes, is_temp_name

KEYS = ".keys"


def object_path(store: Path, bucket: str, key: str) -> Path:
    """Where object ``bucket/key`` is kept on disk: always under ``store``."""
    parts = key.split("/")
    plain = key and not key.startswith("/") and "\x00" not in key and all(p not in ("", ".", "..") for p in parts) \
        and not any(is_temp_name(p) or p == KEYS for p in parts)
    if plain and bucket not in ("", ".", "..", KEYS) and "/" not in bucket:
        return store / bucket / key
    return store / KEYS / hashlib.sha256(bucket.encode()).hexdigest()[:16] / hashlib.sha256(key.encode()).hexdigest()


class WriteThrough:
    """WSGI middleware: persist what moto acknowledges before acknowledging it."""

    def __init__(self, app: Callable, store: Path):
        self.app, self.store = app, store
        self.loading = False  # while the store is put back: nothing to persist, and not ready for anyone else

    def __call__(self, environ, start_response):
        method = environ["REQUEST_METHOD"]
        if self.loading and environ.get("PATH_INFO", "").startswith("/moto-api"):  # the readiness probe
            start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"loading the store"]
        if self.loading or method not in ("PUT", "POST", "DELETE"):
            return self.app(environ, start_response)
        bucket, _, key = environ.get("PATH_INFO", "/").lstrip("/").partition("/")
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        body_in = None
        if method == "POST" and "delete" in query:  # multi-object delete: the keys are in the request body
            body_in = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            environ["wsgi.input"] = io.BytesIO(body_in)
        got: dict = {}

        def capture(status, headers, exc_info=None):
            got.update(status=status, headers=headers, exc_info=exc_info)
            return lambda _data: None

        result = self.app(environ, capture)
        try:
            body = b"".join(result)
        finally:
            getattr(result, "close", lambda: None)()
        if got["status"].startswith("2"):
            self._persist(environ, method, bucket, key, query, body_in)
        start_response(got["status"], got["headers"], got["exc_info"])
        return [body]

    def _persist(self, environ, method: str, bucket: str, key: str, query: dict, body_in: Optional[bytes]) -> None:
        if not key:
            plain = object_path(self.store, bucket, "x").parent == self.store / bucket
            if method == "PUT" and not query and plain:
                (self.store / bucket).mkdir(parents=True, exist_ok=True)
            elif method == "DELETE" and not query and plain:
                shutil.rmtree(self.store / bucket, ignore_errors=True)
            elif method == "POST" and "delete" in query and body_in:
                for el in ET.fromstring(body_in).iter():
                    if el.tag.endswith("Key") and el.text is not None:
                        self._forget(bucket, el.text)
            return
        if method == "DELETE" and "uploadId" not in query:
            self._forget(bucket, key)
        elif (method == "PUT" and "partNumber" not in query and not _sub_resource(query)) or \
                (method == "POST" and "uploadId" in query):  # an object written, copied, or a multipart completed
            self._save(environ, bucket, key)

    def _save(self, environ, bucket: str, key: str) -> None:
        got: dict = {}
        env = {k: v for k, v in environ.items() if k.startswith(("HTTP_", "SERVER_", "wsgi.")) or k in
               ("SCRIPT_NAME", "REMOTE_ADDR")}
        env.update(REQUEST_METHOD="GET", PATH_INFO=f"/{bucket}/{key}", QUERY_STRING="", CONTENT_LENGTH="0",
                   RAW_URI=quote(f"/{bucket}/{key}"), REQUEST_URI=quote(f"/{bucket}/{key}"))
        env["wsgi.input"] = io.BytesIO(b"")
        for h in ("HTTP_CONTENT_MD5", "HTTP_X_AMZ_COPY_SOURCE", "HTTP_X_AMZ_CONTENT_SHA256", "HTTP_RANGE"):
            env.pop(h, None)
        result = self.app(env, lambda status, headers, exc_info=None: got.update(status=status) or (lambda _d: None))
        try:
            data = b"".join(result)
        finally:
            getattr(result, "close", lambda: None)()
        if not got.get("status", "").startswith("2"):
            raise IOError(f"embedded S3: cannot read back {bucket}/{key} to persist it ({got.get('status')})")
        path = object_path(self.store, bucket, key)
        atomic_write_bytes(path, data)
        if path.relative_to(self.store).parts[0] == KEYS:
            atomic_write_bytes(path.with_name(path.name + ".key"), f"{bucket}\n{key}".encode())

    def _forget(self, bucket: str, key: str) -> None:
        path = object_path(self.store, bucket, key)
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".key").unlink(missing_ok=True)


def _sub_resource(query: dict) -> bool:
    """A PUT on an object's sub-resource (tagging, acl, retention, …) changes no bytes."""
    return any(k in query for k in ("tagging", "acl", "retention", "legal-hold"))


def stored(store: Path):
    """(bucket, key, file) for every object kept in ``store``."""
    if not store.is_dir():
        return
    for bdir in sorted(p for p in store.iterdir() if p.is_dir() and p.name != KEYS):
        for f in sorted(p for p in bdir.rglob("*") if p.is_file() and not is_temp_name(p.name)):
            yield bdir.name, f.relative_to(bdir).as_posix(), f
    for side in sorted((store / KEYS).rglob("*.key")) if (store / KEYS).is_dir() else []:
        bucket, _, key = side.read_text().partition("\n")
        data = side.with_name(side.name[:-len(".key")])
        if data.is_file():
            yield bucket, key, data
