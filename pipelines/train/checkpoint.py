"""Checkpoints that are valid only when complete, and their promotion across storage tiers.

A checkpoint is a directory (or S3 prefix) of files plus::

    MANIFEST.json   {"files": {name: {"sha256", "bytes"}}, "step": …}
    COMMIT          sha256 of MANIFEST.json, written last

A reader trusts a copy only if COMMIT exists, matches MANIFEST.json, and every file matches its
sha256, so a half-written or half-copied checkpoint is never taken for a good one.

Tiers: L0 node-local (``checkpoint.l0``) → L1 shared FS (``checkpoint.l1``) → L2 S3
(``s3://services.s3_bucket/checkpoint.l2_prefix/…``). ``promote`` copies L0 → L1 → L2, checking
every file at every tier, COMMIT last; a tier that already holds a verified copy is skipped.
``fetch`` restores from the nearest tier whose copy verifies.

S3 verification uses S3's own SHA-256 checksums (``ChecksumAlgorithm=SHA256``): for a single-part
upload the object checksum is the file's sha256; for multipart it is the composite
sha256(part digests)-N, which we recompute locally from the same part size. If an endpoint returns
no checksum, the object is downloaded and hashed.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Optional

from pipelines.cli import stage_parser
from pipelines.manifest import Manifest, StageDir, atomic_write_text, input_ref, load_manifest, run_stage, sha256_file, write_report
from pipelines.spec import JobSpec, resolve_path, spec_from_args

CKPT_MANIFEST = "MANIFEST.json"
COMMIT = "COMMIT"


class CheckpointError(RuntimeError):
    pass


# ----------------------------------------------------------------------------- local tiers
def commit_local(tmp_dir: Path, final_dir: Path, meta: dict | None = None) -> Path:
    """Hash every file in ``tmp_dir``, write MANIFEST + COMMIT, then rename to ``final_dir``."""
    files = {}
    for f in sorted(p for p in tmp_dir.rglob("*") if p.is_file()):
        rel = f.relative_to(tmp_dir).as_posix()
        if rel in (CKPT_MANIFEST, COMMIT):
            continue
        files[rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    body = json.dumps({"files": files, **(meta or {})}, indent=2, sort_keys=True)
    atomic_write_text(tmp_dir / CKPT_MANIFEST, body)
    atomic_write_text(tmp_dir / COMMIT, hashlib.sha256(body.encode()).hexdigest())
    if final_dir.exists():
        shutil.rmtree(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp_dir, final_dir)
    return final_dir


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
    for rel, info in man["files"].items():
        p = d / rel
        if not p.is_file():
            raise CheckpointError(f"{d}: {rel} is missing")
        got = sha256_file(p)
        if got != info["sha256"]:
            raise CheckpointError(f"{d}: {rel} sha256 {got[:12]}… does not match the manifest's "
                                  f"{info['sha256'][:12]}… — refusing this checkpoint")
    return man


def is_valid_local(d: Path) -> bool:
    try:
        verify_local(d)
        return True
    except (CheckpointError, FileNotFoundError, json.JSONDecodeError):
        return False


def copy_local(src: Path, dst: Path) -> Path:
    """Copy a verified checkpoint to another filesystem tier; verify the copy; COMMIT last."""
    man = verify_local(src)
    tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        for rel, info in man["files"].items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, tmp / rel)
            if sha256_file(tmp / rel) != info["sha256"]:
                raise CheckpointError(f"copy of {rel} to {dst} does not match its checksum")
        shutil.copyfile(src / CKPT_MANIFEST, tmp / CKPT_MANIFEST)
        shutil.copyfile(src / COMMIT, tmp / COMMIT)  # last
        if dst.exists():
            shutil.rmtree(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    verify_local(dst)
    return dst


# ----------------------------------------------------------------------------- S3 tier
def _composite_sha256(path: Path, part_size: int) -> str:
    digests = []
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(part_size), b""):
            digests.append(hashlib.sha256(chunk).digest())
    return base64.b64encode(hashlib.sha256(b"".join(digests)).digest()).decode() + f"-{len(digests)}"


def _s3_object_matches(s3, bucket: str, key: str, path: Path, sha_hex: str, part_size: int) -> bool:
    from botocore.exceptions import ClientError

    try:
        head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    except ClientError:
        return False
    if head["ContentLength"] != path.stat().st_size:
        return False
    remote = head.get("ChecksumSHA256")
    if remote:
        if remote == base64.b64encode(bytes.fromhex(sha_hex)).decode():
            return True  # single-part (or full-object) checksum
        etag = head.get("ETag", "").strip('"')
        n_parts = int(etag.rsplit("-", 1)[1]) if "-" in etag else None
        size = path.stat().st_size
        if n_parts and -(-size // part_size) == n_parts:
            # composite: base64(sha256(concat(part sha256s))), with or without the "-N" suffix
            return remote.split("-")[0] == _composite_sha256(path, part_size).split("-")[0]
    h = hashlib.sha256()
    for chunk in s3.get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(1 << 20):
        h.update(chunk)
    return h.hexdigest() == sha_hex


def _transfer_config(spec: JobSpec):
    from boto3.s3.transfer import TransferConfig

    mb = 1024 * 1024
    return TransferConfig(multipart_threshold=spec.checkpoint.multipart_threshold_mb * mb,
                          multipart_chunksize=spec.checkpoint.multipart_chunk_mb * mb, max_concurrency=4)


def s3_commit_body(s3, bucket: str, prefix: str) -> Optional[str]:
    from botocore.exceptions import ClientError

    try:
        return s3.get_object(Bucket=bucket, Key=f"{prefix}/{COMMIT}")["Body"].read().decode().strip()
    except ClientError:
        return None


def upload_checkpoint(spec: JobSpec, src: Path, uri: str) -> str:
    """Upload a verified local checkpoint to ``uri`` (s3://bucket/prefix); COMMIT last. Idempotent."""
    from pipelines.storage.s3 import client, ensure_bucket, split_uri

    man = verify_local(src)
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    ensure_bucket(s3, bucket, spec.services.s3_region)
    commit = (src / COMMIT).read_text().strip()
    part = spec.checkpoint.multipart_chunk_mb * 1024 * 1024
    if s3_commit_body(s3, bucket, prefix) == commit and all(
            _s3_object_matches(s3, bucket, f"{prefix}/{rel}", src / rel, info["sha256"], part)
            for rel, info in man["files"].items()):
        return "already-verified"
    s3.delete_object(Bucket=bucket, Key=f"{prefix}/{COMMIT}")  # invalidate any older copy first
    cfg = _transfer_config(spec)
    for rel, info in man["files"].items():
        key = f"{prefix}/{rel}"
        s3.upload_file(str(src / rel), bucket, key, Config=cfg,
                       ExtraArgs={"ChecksumAlgorithm": "SHA256", "Metadata": {"sha256": info["sha256"]}})
        if not _s3_object_matches(s3, bucket, key, src / rel, info["sha256"], part):
            raise CheckpointError(f"s3://{bucket}/{key} does not match {rel}'s sha256 after upload")
    s3.upload_file(str(src / CKPT_MANIFEST), bucket, f"{prefix}/{CKPT_MANIFEST}")
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{COMMIT}", Body=commit.encode())  # last
    return "uploaded"


def download_checkpoint(spec: JobSpec, uri: str, dest: Path) -> Path:
    """Fetch ``uri`` into ``dest`` and verify every file; raise if the copy is incomplete or corrupt."""
    from pipelines.storage.s3 import client, split_uri

    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    commit = s3_commit_body(s3, bucket, prefix)
    if commit is None:
        raise CheckpointError(f"{uri}: no COMMIT marker — the checkpoint is incomplete or absent")
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{CKPT_MANIFEST}")["Body"].read()
        if hashlib.sha256(body).hexdigest() != commit:
            raise CheckpointError(f"{uri}: MANIFEST.json does not match its COMMIT marker")
        (tmp / CKPT_MANIFEST).write_bytes(body)
        for rel in json.loads(body)["files"]:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, f"{prefix}/{rel}", str(tmp / rel))
        (tmp / COMMIT).write_text(commit)
        verify_local(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# ----------------------------------------------------------------------------- tier layout
def tier_locations(spec: JobSpec, rel: str) -> dict[str, str]:
    """Where checkpoint ``rel`` (e.g. ``<run>/<key>/step-000200``) lives at each tier."""
    return {
        "L0": str(resolve_path(spec.checkpoint.l0) / rel),
        "L1": str(resolve_path(spec.checkpoint.l1) / rel),
        "L2": f"s3://{spec.services.s3_bucket}/{spec.checkpoint.l2_prefix.strip('/')}/{rel}",
    }


def fetch(spec: JobSpec, rel: str, cache: Optional[Path] = None, prefer: tuple[str, ...] = ("L0", "L1", "L2")) -> tuple[str, Path]:
    """Restore from the nearest tier whose copy verifies; returns (tier, local dir)."""
    locs = tier_locations(spec, rel)
    errors = []
    for tier in prefer:
        loc = locs[tier]
        if tier == "L2":
            dest = cache or resolve_path("var/tiers/cache") / rel
            try:
                return tier, download_checkpoint(spec, loc, dest)
            except Exception as e:  # noqa: BLE001 - report every tier's reason
                errors.append(f"{tier} {loc}: {e}")
        else:
            try:
                verify_local(Path(loc))
                return tier, Path(loc)
            except (CheckpointError, FileNotFoundError) as e:
                errors.append(f"{tier} {loc}: {e}")
    raise CheckpointError("no tier holds a verified copy of the checkpoint:\n  " + "\n  ".join(errors))


# ----------------------------------------------------------------------------- promote stage
def promote(spec: JobSpec, rel: str) -> dict:
    locs = tier_locations(spec, rel)
    l0, l1 = Path(locs["L0"]), Path(locs["L1"])
    report = {"checkpoint": rel, "tiers": locs, "actions": {}}
    if is_valid_local(l1):
        report["actions"]["L1"] = "already-verified"
    else:
        if not l0.exists():
            raise CheckpointError(f"L0 copy {l0} is gone and L1 holds no verified copy: nothing to promote")
        copy_local(l0, l1)  # verify_local(l0) inside: refuses a corrupt L0
        report["actions"]["L1"] = "copied"
    report["actions"]["L2"] = upload_checkpoint(spec, l1, locs["L2"])
    report["commit"] = (l1 / COMMIT).read_text().strip()
    return report


def run(spec: JobSpec, train: Manifest, out_dir: str | None = None) -> Manifest:
    rel = train.extra["checkpoint"]
    sd = StageDir(resolve_path(spec.run.root), "promote", spec.stage_hash("promote"), [input_ref(train)],
                  force=spec.run.force, out_dir=out_dir)

    def body(tmp: Path) -> Manifest:
        rep = promote(spec, rel)
        (tmp / "tiers.json").write_text(json.dumps(rep, indent=2))
        return sd.commit({"tiers": "tiers.json"}, counts={"tiers": 3},
                         extra={"checkpoint": rel, "l2_uri": rep["tiers"]["L2"], "commit": rep["commit"],
                                "actions": rep["actions"]})

    done = sd.existing()
    if done is not None:  # the manifest says promoted; make sure L2 still verifies
        from pipelines.storage.s3 import client, split_uri

        b, p = split_uri(done.extra["l2_uri"])
        if s3_commit_body(client(spec), b, p) == done.extra["commit"]:
            print(f"[promote] up to date: {done.path}")
            return done
        sd.force = True
    return run_stage(sd, body)


def main(argv: list[str] | None = None) -> int:
    ap = stage_parser("pipelines.train.checkpoint",
                      "Promote the final checkpoint of a train stage L0 → L1 → L2 (S3), verifying checksums at every "
                      "tier, COMMIT marker last.", {"--input-manifest": "Manifest of the train stage."})
    args = ap.parse_args(argv)
    spec = spec_from_args(args)
    try:
        m = run(spec, load_manifest(args.input_manifest), args.output)
    except CheckpointError as e:
        print(f"promote: error: {e}", file=sys.stderr)
        return 2
    write_report(args.report, m)
    print(f"promote: {m.extra['checkpoint']} → {m.extra['l2_uri']} ({m.extra['actions']}); manifest {m.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
