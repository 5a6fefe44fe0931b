"""Checkpoints that are valid only when complete, their promotion across storage tiers, restore, retention.

A checkpoint is a directory (or S3 prefix) ``step-NNNNNN`` of files plus::

    MANIFEST.json   {"files": {name: {"sha256", "bytes"}}, "step": …}
    COMMIT          sha256 of MANIFEST.json, written last

A reader trusts a copy only if COMMIT exists, matches MANIFEST.json, and every file matches its
sha256, so a half-written or half-copied checkpoint is never taken for a good one. The training
checkpoints (``pipelines.train.ckpt.checkpointer``) are ``torch.distributed.checkpoint`` (DCP) directories:
``.metadata`` + one ``__<rank>_0.distcp`` shard file per writing rank, plus ``trainer_state.json``,
``rng.json`` (per-rank RNG states), ``model_args.json`` and ``tokenizer.model``.

Where each concern lives (each module imports only the ones above it):

- this module: the errors (:class:`CheckpointError`, :class:`TierUnavailable`, :class:`L2Unavailable`,
  :class:`UnsafeCheckpoint`), the names (``step-NNNNNN``, ``part-K``, MANIFEST, COMMIT, PARTS), :func:`hash_files`;
- :mod:`pipelines.train.ckpt.dcp_read`: a DCP checkpoint's content read without running code from storage (its
  metadata, its non-tensor values), and :func:`~pipelines.train.ckpt.dcp_read.load_plain_model` (evaluation,
  serving, export, the plain export's command line: :mod:`pipelines.train.checkpoint`);
- :mod:`pipelines.train.ckpt.fence`: fencing between attempts (terms and leases on L1), checked by the modules below
  before every COMMIT and every deletion of committed data;
- :mod:`pipelines.train.ckpt.local`: the filesystem tiers (L0, L1): commit, read, verify, copy and remove a local
  copy; the file names a manifest may hold (``safe_rel``);
- :mod:`pipelines.train.ckpt.s3_tier`: the S3 tier (L2): uploads, downloads, multipart, checks by S3's own checksums;
- :mod:`pipelines.train.ckpt.s3_markers`: L2's conditional writes (If-None-Match / If-Match): the fence enforced by S3;
- :mod:`pipelines.train.ckpt.fence_l2`: the run's terms recorded on L2, so a new L1 never reuses an older term;
- :mod:`pipelines.train.ckpt.parts`: the part protocol, the one promotion path: each node's part (one machine's
  step is part 0 of 1) staged and merged on L1, uploaded and merged on L2 (a step from its L1 copy too);
- :mod:`pipelines.train.ckpt.tiers`: the tier layout, a step's read for evaluation (``fetch``), retention (``prune``),
  generations and ``promote`` (the promote stage's entry into the part protocol).

    python -m pipelines.train.checkpoint export SRC OUT.pt   # plain {name: tensor} weights
    (the promote stage, :mod:`pipelines.train.promote`, runs :func:`pipelines.train.ckpt.tiers.promote` on a train
    stage's checkpoint)
"""
from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from pipelines.exit_codes import RETRY, USER_ERROR
from pipelines.manifest import StageError, plain_rel, sha256_file
from pipelines.storage import faults

CKPT_MANIFEST = "MANIFEST.json"
COMMIT = "COMMIT"
PARTS = "PARTS"  # on L2: PARTS/part-K.json, node K's part manifest, put after the part's files
PARTS_META = "sha256-parts"  # a multipart object's metadata: the composite of its verified parts' sha256, "-N"
TIERS = ("L0", "L1", "L2")
MAX_PARTS = 1 << 16  # more parts than any job has nodes: a manifest that says so is not ours




class CheckpointError(StageError):
    pass


class TierUnavailable(CheckpointError):
    """A tier did not answer (an object store down, refusing or throttling past the retries; a shared filesystem
    that fails to list): what it holds is *unknown*, never "nothing". Infrastructure: exit 75, a retry may find it
    back (``exit_codes.RETRY``)."""

    exit_code = RETRY  # not a user error


class CopyRefused(CheckpointError):
    """Copies of a checkpoint that the file system refuses to this user (EACCES, EPERM) while it holds them: no retry
    reads them, and they are not absent either (an older step is not taken over them). The user's to fix (exit 2):
    read access, or ``checkpoint.restore_past_unanswered``."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file that names something a DCP checkpoint does not hold (a function to call, a class of
    another module): not read, whatever wrote it (exit 2: that copy must be replaced)."""


class L2Unavailable(TierUnavailable):
    """The object store does not answer (down, refusing, throttling past the retries): L2 is skipped for now where
    another tier serves, and never read as "no COMMIT"."""


class L2Refused(L2Unavailable):
    """The object store refused these credentials or this configuration (401/403, a bad key or signature; not an
    expired session token, which a retry refreshes): L2 is unusable as when it is down, skipped where another tier
    serves; where only L2 could answer (a stage's read or put, the term floor of a new L1, a restore whose steps are
    only there) no retry mends it: the user's to fix (exit 2)."""

    exit_code = USER_ERROR


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def parse_step(name: str) -> Optional[int]:
    """``step-000120`` → 120; anything else (temp dirs, other files) → None."""
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def part_name(k: int) -> str:
    return f"part-{k}"


def hash_files(root: Path, rels: list[str]) -> dict[str, str]:
    """sha256 of many files in parallel (hashlib releases the GIL on large buffers)."""
    def one(rel: str) -> str:
        faults.file_op("read", root / rel)
        return sha256_file(root / rel)

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(rels)))) as ex:
        return dict(zip(rels, ex.map(one, rels)))


# ----------------------------------------------------------------------------- consumers
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
