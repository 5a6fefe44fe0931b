"""The filesystem tiers of a checkpoint (see :mod:`pipelines.train.ckpt.protocol`): L0 node-local and L1 shared FS.

A copy is committed by hashing every file into MANIFEST.json and writing COMMIT last, read back only when COMMIT
matches the manifest, verified file by file, copied to another tier verified while it is read (COMMIT last), and
removed COMMIT first. Every file name read from a manifest must stay below its directory
(:func:`pipelines.train.ckpt.protocol.safe_rel`; a copy's validity, :func:`~pipelines.train.ckpt.protocol.verify_local`,
is the protocol's own, in :mod:`pipelines.train.ckpt.protocol`).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipelines.listing import walk_files
from pipelines.manifest import atomic_write_text
from pipelines.storage import faults
from pipelines.storage.s3 import part_size_used
from pipelines.train.ckpt import fence
from pipelines.train.ckpt.protocol import (CKPT_MANIFEST, COMMIT, CheckpointError, hash_files, manifest_files,
                                        read_local_manifest)


def commit_local(tmp_dir: Path, final_dir: Path, meta: dict | None = None) -> Path:
    """Hash every file in ``tmp_dir``, write MANIFEST + COMMIT, then rename to ``final_dir`` (:func:`install_dir`);
    under a fence (:mod:`pipelines.train.ckpt.fence`) only while this attempt's term is current."""
    rels = [f.relative_to(tmp_dir).as_posix() for f in sorted(p for p in walk_files(tmp_dir) if p.is_file())]
    rels = [r for r in rels if r not in (CKPT_MANIFEST, COMMIT)]
    faults.file_op("write", final_dir)
    sums = hash_files(tmp_dir, rels)
    files = {r: {"sha256": sums[r], "bytes": (tmp_dir / r).stat().st_size} for r in rels}
    body = json.dumps({"files": files, **(meta or {})}, indent=2, sort_keys=True)
    atomic_write_text(tmp_dir / CKPT_MANIFEST, body)
    make_durable(tmp_dir)  # what COMMIT vouches for is on the disk before it
    fence.check(f"committing {final_dir.name}", final_dir)  # a superseded attempt writes no COMMIT
    atomic_write_text(tmp_dir / COMMIT, hashlib.sha256(body.encode()).hexdigest())
    install_dir(tmp_dir, final_dir)
    return final_dir


def make_durable(d: Path) -> None:
    """Every file under ``d``, then every directory of it, flushed to stable storage (fsync), before the COMMIT
    that vouches for them: a node that crashes right after the commit must not leave a COMMIT over data still in its
    page cache (a globally committed step that no longer verifies). A write error the filesystem kept until now
    (NFS reports ENOSPC and EIO late) is raised here, naming the file; a directory whose filesystem cannot fsync one
    (EINVAL) is passed over."""
    dirs = {d}
    for f in walk_files(d):
        dirs.add(f.parent)
        with naming(f):
            fd = os.open(f, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for p in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(p)


def fsync_dir(d: Path) -> None:
    """The directory's entries (a rename into it, a file made there) flushed; EINVAL (a filesystem that cannot fsync
    a directory) passed over."""
    with naming(d):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        finally:
            os.close(fd)


def missing_shards(d: Path) -> list[str]:
    """Shard files that the DCP metadata in ``d`` names but ``d`` lacks (e.g. written on another node's disk)."""
    from pipelines.train.ckpt.dcp_read import read_metadata

    named = {info.relative_path for info in read_metadata(d).storage_data.values()}
    return sorted(n for n in named if not (d / n).is_file())


def remove_local(d: Path) -> None:
    """Never a copy a newer term committed, even one committed after this writer's check (it paused in between):
    the copy is moved aside in one rename (atomic on POSIX filesystems, NFS and Lustre included), its recorded term
    is read where it now lies, and a newer term's copy is put back (:class:`~pipelines.train.ckpt.fence.FencedOut`);
    else COMMIT first, so a half-removed copy is never read as a checkpoint, then the rest. Under a fence, never by
    a superseded attempt either (:func:`pipelines.train.ckpt.fence.guard`). An entry that is a symlink (not a copy
    this run made: anyone who writes the tier may plant one) loses only the link, never what it leads to."""
    if d.is_symlink():
        fence.check(f"removing {d}", d)
        d.unlink(missing_ok=True)
        return
    fence.guard(f"removing {d}", d, lambda: fence.local_manifest(d))
    faults.point(faults.ACT)
    aside = d.with_name(f".{d.name}.tmp-{fence.tmp_tag()}")  # a temp name: start-up cleanup knows whose it is
    try:
        os.rename(d, aside)
    except FileNotFoundError:
        return
    if aside.is_symlink():  # a link put in its place since the check: the link goes, what it leads to stays
        aside.unlink(missing_ok=True)
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


def _copy_hashing(src: Path, dst: Path, part_size: int) -> tuple[str, list[bytes]]:
    """Copy in one read pass, hashing what was read: (sha256 hex of the file, sha256 digest of each
    ``part_size`` part, the parts S3 will checksum when this file is uploaded). A failure names its file: ``src``
    for a read, ``dst`` for a write or the close (where NFS reports ENOSPC and EIO) (:func:`naming`)."""
    whole, parts = hashlib.sha256(), []
    faults.file_op("read", src)
    faults.file_op("write", dst)
    with naming(dst), open(dst, "wb") as g:
        with open(src, "rb") as f, ThreadPoolExecutor(1) as part_hasher:
            while chunk := _read(f, part_size, src):  # each part's digest beside the whole-file hash and the write
                part = part_hasher.submit(lambda c: hashlib.sha256(c).digest(), chunk)
                whole.update(chunk)
                g.write(chunk)
                parts.append(part.result())
    return whole.hexdigest(), parts


def _read(f, size: int, src: Path) -> bytes:
    with naming(src):
        return f.read(size)


def _copy_small(src: Path, dst: Path) -> None:
    """A small file copied whole and synced, a failure naming its file (:func:`naming`)."""
    with naming(src):
        data = src.read_bytes()
    with naming(dst), open(dst, "wb") as g:
        g.write(data)
        g.flush()
        os.fsync(g.fileno())


@contextlib.contextmanager
def naming(path: Path, keep: tuple = ()):
    """An OSError raised in the block without a file name (Python's read(), write() and close() say none) is raised
    again naming ``path``, so that a caller can tell the tier that failed (a write refused on the destination is
    not the source copy being bad: :func:`pipelines.train.ckpt.restore.l1_failed`). ``keep``: error types passed as
    they are (a download's connection errors, the endpoint's)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None or isinstance(e, keep):
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


def install_dir(tmp: Path, dst: Path) -> None:
    """Put the finished directory ``tmp`` at ``dst``, an older copy there removed first (:func:`remove_local`);
    under a fence only while this attempt's term is current. The last act is a rename that cannot replace a copy
    put there after the check (a directory is never renamed over a non-empty one): a writer that paused in between
    stops with :class:`~pipelines.train.ckpt.fence.FencedOut` and the other copy stays."""
    fence.check(f"putting {dst.name} in place", dst)
    if dst.exists():
        remove_local(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    faults.point(faults.ACT)
    try:
        faults.file_op("rename", dst)
        os.rename(tmp, dst)
        faults.file_op("renamed", dst)
        fsync_dir(dst.parent)  # the rename itself durable: the copy is where it was said to be after a crash
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
        _copy_small(src / CKPT_MANIFEST, tmp / CKPT_MANIFEST)
        make_durable(tmp)  # what COMMIT vouches for is on the disk before it
        _copy_small(src / COMMIT, tmp / COMMIT)  # last
        install_dir(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {rel: parts for rel, (_, parts) in got.items()}
