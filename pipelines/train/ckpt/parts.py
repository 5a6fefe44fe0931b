"""Node parts of a checkpoint (see :mod:`pipelines.train.ckpt.protocol`): with node-local L0 each node commits its
*part* of a step on its own disk; the parts meet on L1 and L2, where rank 0 writes the step's global COMMIT (see
below and :mod:`pipelines.train.ckpt.restore`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from pipelines.listing import strict_glob
from pipelines.manifest import atomic_write_text
from pipelines.spec import JobSpec
from pipelines.storage import faults
from pipelines.train.ckpt import fence, s3_markers as ckpt_s3_cond
from pipelines.train.ckpt.protocol import (CKPT_MANIFEST, COMMIT, MAX_PARTS, PARTS, CheckpointError, is_valid_local,
                                        manifest_files, parse_step, part_name, read_local_manifest, verify_local)
from pipelines.train.ckpt.local import copy_local, install_dir, make_durable, missing_shards
from pipelines.train.ckpt.s3_tier import (abort_multipart, all_match, check_objects, object_etag, part_manifest,
                                          read_s3_manifest, s3_body, s3_commit_body, upload_files)
from pipelines.storage.s3 import client, ensure_bucket, split_uri


# With node-local L0, node K's local leader commits *its part* of a step on its own disk: its ranks' shards (node 0
# also the DCP .metadata and the small files) with a MANIFEST whose meta says {"part": K, "parts": N, "attempt"}.
# Each node promotes its own part: to L1 it is staged in ``.step-N.parts/part-K`` (a committed copy), to L2 its
# files go under the step's prefix and ``PARTS/part-K.json`` (the part's manifest) last. Global rank 0 then merges:
# when every part of the same attempt is there, the step gets MANIFEST (all files, ``part_of``) and COMMIT, last.
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
    keys = ("step", "format", "world_size", "attempt", "lineage", "term")  # term: the attempt's that saved the step
    meta = {key: mans[0][key] for key in keys if key in mans[0]}
    return json.dumps({"files": files, "part_of": owner, "parts": len(mans), **meta}, indent=2, sort_keys=True)


def local_parts(root: Path, failed: Optional[dict[int, str]] = None) -> dict[int, dict]:
    """This node's committed parts under ``root`` (a run's L0 directory): {step: manifest}, not yet hashed. A step
    whose manifest fails to be read (an OSError but a missing file) raises, or with ``failed`` is put there
    (step → why) and left out. A step entry that is a symlink is none of this run's (as in ``tiers.list_steps``)."""
    out = {}
    for d in strict_glob("step-*", root):  # a folder refused to this user raises (Path.glob says "none")
        if d.is_symlink():
            continue
        step = parse_step(d.name)
        try:
            if step is not None:
                out[step] = read_local_manifest(d)
        except (CheckpointError, FileNotFoundError, json.JSONDecodeError):
            continue
        except OSError as e:
            if failed is None:
                raise
            failed[step] = f"{type(e).__name__}: {str(e)[:240]}"
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
        if part_of(man) != (k, parts, attempt):  # of another attempt, or not the part its place says
            return False
        mans.append(man)
    body = merged_manifest(mans)
    tmp = l1_step.with_name(f".{l1_step.name}.tmp-{fence.tmp_tag()}")
    try:
        for m in mans:
            src = staged / part_name(part_of(m)[0])
            for rel, info in m["files"].items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                _link_or_copy(src / rel, tmp / rel)
                if (tmp / rel).stat().st_size != info["bytes"]:
                    raise CheckpointError(f"{src / rel}: size differs from its part manifest")
        missing = missing_shards(tmp) if mans[0].get("format") == "dcp" else []  # (a plain checkpoint: model.pt)
        if missing:
            raise CheckpointError(f"{l1_step}: the parts hold no {missing}; a node's ranks wrote elsewhere")
        faults.point("merge")
        atomic_write_text(tmp / CKPT_MANIFEST, body)
        make_durable(tmp)  # the parts' files and their links here on the disk before COMMIT
        fence.check(f"committing {l1_step.name} on L1", l1_step)
        atomic_write_text(tmp / COMMIT, hashlib.sha256(body.encode()).hexdigest())  # last
        install_dir(tmp, l1_step)
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
    """Node K's committed part (a one-part step: the whole step) from its L0 to the step's L2 prefix: its files
    (each checked), then ``PARTS/part-K.json`` last (see :func:`put_part`)."""
    man = verify_local(l0_part) if digests is None else read_local_manifest(l0_part)
    return put_part(spec, uri, l0_part, (l0_part / CKPT_MANIFEST).read_bytes(), man, digests or {})


def put_part(spec: JobSpec, uri: str, src: Path, body: bytes, man: dict, digests: dict) -> str:
    """One part to L2: the files ``man`` names from ``src`` (each object checked against its sha256), then its
    manifest ``body`` as ``PARTS/part-K.json``, last. A step of another attempt committed there loses its COMMIT
    first (it is no longer whole). Aborts only this part's unfinished multipart uploads (another node may be
    uploading its part there now)."""
    k, _, attempt = part_of(man)
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    ensure_bucket(s3, bucket, spec.services.s3_region)
    cond = ckpt_s3_cond.supported(s3, bucket)
    marker = f"{prefix}/{PARTS}/{part_name(k)}.json"
    # what is there, read before the fence check: a writer paused after its check then holds tags older than a newer
    # term's writes, and its conditional deletes below fail instead of removing them
    marker_tag, commit_tag = (object_etag(s3, bucket, key) for key in (marker, f"{prefix}/{COMMIT}"))
    fence.check(f"uploading part {k} to {uri}", uri)  # a superseded attempt sends nothing
    if s3_body(s3, bucket, marker) == body and all_match(spec, s3, bucket, prefix, src, man["files"], digests):
        return "already-verified"
    committed = read_s3_manifest(spec, uri)
    if committed is not None and committed.get("attempt") != attempt:  # another attempt's step: no longer whole
        fence.guard(f"deleting the COMMIT of {uri}", uri, lambda: committed)
        ckpt_s3_cond.delete(s3, bucket, f"{prefix}/{COMMIT}", commit_tag, cond, f"deleting the COMMIT of {uri}")
    ckpt_s3_cond.delete(s3, bucket, marker, marker_tag, cond, f"replacing part {k} of {uri}")
    abort_multipart(s3, bucket, prefix, {f"{prefix}/{rel}" for rel in man["files"]})
    upload_files(spec, s3, bucket, prefix, src, man["files"], digests, cond)
    fence.check(f"committing part {k} of {uri}", uri)
    ckpt_s3_cond.put(s3, bucket, marker, body, None, cond, f"committing part {k} of {uri}")  # last
    return "uploaded"


def step_parts(man: dict, step_dir: Path) -> list[bytes]:
    """The part manifests a globally committed step was merged from, as their nodes committed them (a step that
    an older version committed whole, with no ``part_of``: its own manifest, part 0 of 1)."""
    if "part_of" not in man:
        return [(step_dir / CKPT_MANIFEST).read_bytes()]
    parts = int(man.get("parts", 1))
    if not 0 < parts <= MAX_PARTS:
        raise CheckpointError(f"{step_dir}: a manifest of {parts} parts is not one of ours")
    return [part_manifest(man, k) for k in range(parts)]


def upload_step(spec: JobSpec, l1_step: Path, uri: str, digests: Optional[dict] = None) -> str:
    """A globally committed step from its L1 copy to L2 (L2 catching up, the ``promote`` stage): every part as its
    node would have put it (a part already there is not sent again), then the merged MANIFEST and COMMIT
    (:func:`merge_parts_s3`). The one path to L2, with :func:`upload_part`. ``digests``: the files' part digests
    from a copy that just verified ``l1_step`` (else it is verified here). An L2 copy with L1's COMMIT whose
    objects check is kept as it is."""
    man = verify_local(l1_step) if digests is None else read_local_manifest(l1_step)
    bucket, prefix = split_uri(uri.rstrip("/"))
    s3 = client(spec)
    commit_tag = object_etag(s3, bucket, f"{prefix}/{COMMIT}")  # read before anything is decided on it
    if commit_tag is not None and s3_commit_body(s3, bucket, prefix) == (l1_step / COMMIT).read_text().strip():
        try:
            check_objects(s3, bucket, prefix, manifest_files(man, str(l1_step)), uri)
            return "already-verified"
        except CheckpointError:  # no longer whole: its COMMIT goes before its objects are put again, only while
            # it is still the one read (a writer paused here must not delete a newer term's COMMIT)
            fence.guard(f"deleting the COMMIT of {uri}", uri, lambda: man)
            ckpt_s3_cond.delete(s3, bucket, f"{prefix}/{COMMIT}", commit_tag, ckpt_s3_cond.supported(s3, bucket),
                                f"deleting the COMMIT of {uri}")
    bodies = step_parts(man, l1_step)
    acts = [put_part(spec, uri, l1_step, b, json.loads(b), digests or {}) for b in bodies]
    if not merge_parts_s3(spec, uri, len(bodies), man.get("attempt"), checked=frozenset(range(len(bodies)))):
        raise CheckpointError(f"{uri}: a part of step {man.get('step')} changed while it was uploaded from L1; "
                              "not committed there")
    return "already-verified" if all(a == "already-verified" for a in acts) else "uploaded"


def s3_part_manifests(spec: JobSpec, uri: str, parts: int) -> Optional[list[dict]]:
    """The parts' manifests on L2, or None while one is missing."""
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    mans = []
    for k in range(parts):
        body = s3_body(s3, bucket, f"{prefix}/{PARTS}/{part_name(k)}.json")
        if body is None:
            return None
        try:
            man = json.loads(body)
            says = part_of(man)[:2]
        except (ValueError, TypeError, AttributeError) as e:  # not a manifest of ours: the step is put again
            raise CheckpointError(f"{uri}: {PARTS}/{part_name(k)}.json is not a part manifest ({e})") from None
        if says != (k, parts):  # not the part its key says: not trusted as one
            raise CheckpointError(f"{uri}: {PARTS}/{part_name(k)}.json describes part {says[0]} of {says[1]}, not "
                                  f"part {k} of {parts}")
        mans.append(man)
    return mans


def merge_parts_s3(spec: JobSpec, uri: str, parts: int, attempt: Optional[str], checked: frozenset = frozenset()) -> bool:
    """Rank 0, on L2: when every part of ``attempt`` is there and each object matches its part's manifest (S3's
    checksums; see check_objects), put the merged MANIFEST and COMMIT last. False while a part is missing.
    ``checked``: the parts whose objects the caller has just put or checked itself (not read twice)."""
    mans = s3_part_manifests(spec, uri, parts)
    if mans is None or any(part_of(m)[2] != attempt for m in mans):
        return False
    s3 = client(spec)
    bucket, prefix = split_uri(uri.rstrip("/"))
    body = merged_manifest(mans)
    commit = hashlib.sha256(body.encode()).hexdigest()
    tags = {name: object_etag(s3, bucket, f"{prefix}/{name}") for name in (COMMIT, CKPT_MANIFEST)}  # as read
    current = s3_commit_body(s3, bucket, prefix)
    if current == commit:
        return True
    merged = json.loads(body)
    others = {rel: info for rel, info in merged["files"].items() if merged["part_of"][rel] not in checked}
    check_objects(s3, bucket, prefix, others, uri)
    cond = ckpt_s3_cond.supported(s3, bucket)
    if current is not None:  # another copy's COMMIT goes before its MANIFEST is replaced
        fence.guard(f"replacing the COMMIT of {uri}", uri, lambda: read_s3_manifest(spec, uri))
        ckpt_s3_cond.delete(s3, bucket, f"{prefix}/{COMMIT}", tags[COMMIT], cond, f"replacing the COMMIT of {uri}")
    fence.check(f"committing {uri}", uri)
    ckpt_s3_cond.put(s3, bucket, f"{prefix}/{CKPT_MANIFEST}", body.encode(), tags[CKPT_MANIFEST], cond,
                     f"committing {uri}")
    ckpt_s3_cond.put(s3, bucket, f"{prefix}/{COMMIT}", commit.encode(), None, cond, f"committing {uri}")  # last
    return True
