"""The filesystem tiers of a checkpoint (see :mod:`pipelines.train.checkpoint`): L0 node-local and L1 shared FS.

A copy is committed by hashing every file into MANIFEST.json and writing COMMIT last, read back only when COMMIT
matches the manifest, verified file by file, copied to another tier verified while it is read (COMMIT last), and
removed COMMIT first. Every file name read from a manifest must stay below its directory (:func:`safe_rel`).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipelines.manifest import atomic_write_text, plain_rel
from pipelines.storage import faults
from pipelines.storage.s3 import part_size_used
from pipelines.train import fence
from pipelines.train.checkpoint import CKPT_MANIFEST, COMMIT, CheckpointError, hash_files


def commit_local(tmp_dir: Path, final_dir: Path, meta: dict | None = None) -> Path:
    """Hash every file in ``tmp_dir``, write MANIFEST + COMMIT, then rename to ``final_dir`` (:func:`install_dir`);
    under a fence (:mod:`pipelines.train.fence`) only while this attempt's term is current."""
    rels = [f.relative_to(tmp_dir).as_posix() for f in sorted(p for p in tmp_dir.rglob("*") if p.is_file())]
    rels = [r for r in rels if r not in (CKPT_MANIFEST, COMMIT)]
    faults.file_op("write", final_dir)
    sums = hash_files(tmp_dir, rels)
    files = {r: {"sha256": sums[r], "bytes": (tmp_dir / r).stat().st_size} for r in rels}
    body = json.dumps({"files": files, **(meta or {})}, indent=2, sort_keys=True)
    atomic_write_text(tmp_dir / CKPT_MANIFEST, body)
    fence.check(f"committing {final_dir.name}", final_dir)  # a superseded attempt writes no COMMIT
    atomic_write_text(tmp_dir / COMMIT, hashlib.sha256(body.encode()).hexdigest())
    install_dir(tmp_dir, final_dir)
    return final_dir


def missing_shards(d: Path) -> list[str]:
    """Shard files that the DCP metadata in ``d`` names but ``d`` lacks (e.g. written on another node's disk)."""
    from torch.distributed.checkpoint import FileSystemReader

    named = {info.relative_path for info in FileSystemReader(str(d)).read_metadata().storage_data.values()}
    return sorted(n for n in named if not (d / n).is_file())


def remove_local(d: Path) -> None:
    """Never a copy a newer term committed, even one committed after this writer's check (it paused in between):
    the copy is moved aside in one rename (atomic on POSIX filesystems, NFS and Lustre included), its recorded term
    is read where it now lies, and a newer term's copy is put back (:class:`~pipelines.train.fence.FencedOut`);
    else COMMIT first, so a half-removed copy is never read as a checkpoint, then the rest. Under a fence, never by
    a superseded attempt either (:func:`pipelines.train.fence.guard`)."""
    fence.guard(f"removing {d}", d, lambda: fence.local_manifest(d))
    faults.point(faults.ACT)
    aside = d.with_name(f".{d.name}.tmp-{fence.tmp_tag()}")  # a temp name: start-up cleanup knows whose it is
    try:
        os.rename(d, aside)
    except FileNotFoundError:
        return
    try:
        fence.guard(f"removing {d}", aside, lambda: fence.local_manifest(aside))
    except fence.FencedOut:
        _put_back(aside, d)
        raise
    (aside / COMMIT).unlink(missing_ok=True)
    shutil.rmtree(aside, ignore_errors=True)


def _put_back(aside: Path, d: Path) -> None:
    """A newer term's copy moved aside by a stale writer goes back where it was (unless another copy is there now:
    then it stays aside, a temp entry of this attempt's that start-up cleanup removes once its lease is gone)."""
    try:
        os.rename(aside, d)
    except OSError:
        pass


def read_local_manifest(d: Path) -> dict:
    if not (d / COMMIT).is_file():
        raise CheckpointError(f"{d}: no COMMIT marker — the checkpoint is incomplete")
    body = (d / CKPT_MANIFEST).read_text()
    if hashlib.sha256(body.encode()).hexdigest() != (d / COMMIT).read_text().strip():
        raise CheckpointError(f"{d}: MANIFEST.json does not match its COMMIT marker")
    return json.loads(body)


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


def install_dir(tmp: Path, dst: Path) -> None:
    """Put the finished directory ``tmp`` at ``dst``, an older copy there removed first (:func:`remove_local`);
    under a fence only while this attempt's term is current. The last act is a rename that cannot replace a copy
    put there after the check (a directory is never renamed over a non-empty one): a writer that paused in between
    stops with :class:`~pipelines.train.fence.FencedOut` and the other copy stays."""
    fence.check(f"putting {dst.name} in place", dst)
    if dst.exists():
        remove_local(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    faults.point(faults.ACT)
    try:
        faults.file_op("rename", dst)
        os.rename(tmp, dst)
        faults.file_op("renamed", dst)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise fence.FencedOut(f"{dst}: another copy was put in place after this writer's check: it stays, and "
                                  "this one is not put over it") from None
        raise


def copy_local(src: Path, dst: Path, chunk: int = 8 << 20) -> dict[str, list[bytes]]:
    """Copy a checkpoint to another filesystem tier, checking every file against the manifest as it is read
    (a corrupt source is refused); COMMIT last. Returns each file's part digests for the S3 upload that follows
    (parts of ``chunk`` bytes, as s3transfer will cut them)."""
    man = read_local_manifest(src)
    tmp = dst.with_name(f".{dst.name}.tmp-{fence.tmp_tag()}")
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
        install_dir(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {rel: parts for rel, (_, parts) in got.items()}
