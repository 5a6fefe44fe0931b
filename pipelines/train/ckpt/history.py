"""Which steps of a run's checkpoints belong to the training being continued: steps are known by number *and*
lineage.

A run's record on L1, one per term (the attempt that wrote it, :mod:`~pipelines.train.ckpt.fence`):
``<l1>/<rel_root>.lineage.d/<term>.json``, the highest term's the one read. A record is never replaced by another
term's: an older attempt paused between its fence check and its write lands under its own term, below the newer
one, and drops nothing the newer wrote (a cutoff, a fork), enforced by the names on the storage, not by a check
before the write. ``<l1>/<rel_root>.lineage.json`` holds a copy of the last one written (what a version before
2026-12-01's tenth session reads) and is read where no term has written one (a run of that version, a write with
no fence), or over the records when a cutoff in it names a term above theirs (that version, rolled back to, ran
after this one)::

    {"token": T, "lineage": L, "accept": [[lineage or null, last step or null], ...]}

* ``token``: who wrote it: the launch (``LLMP_RUN_TOKEN``: the train stage sets it, so an Airflow retry or a
  rescheduled pod is the same launch) or torchrun's run id (the same across torchrun's restarts). A start whose
  token equals the record's is a *restart* of that training: it resumes, whatever ``train.resume`` says.
* ``lineage``: written into every step's manifest meta from now on.
* ``accept``: the steps a restore, retention or staging may count: a step of lineage ``a`` up to step ``m``
  (``null``: any; lineage ``"*"``: any lineage, the record a run that had none takes at its first resume). Steps
  that another line of training wrote are not restorable, not kept by retention and do not shadow the live ones.
* ``cutoffs``: ``[[term, step or null], ...]``, one per attempt that took over (:func:`resumed`): the attempt of
  ``term`` resumed from ``step`` (``null``: from nothing). A step an *older* term committed above it is a stale
  writer's, landed after the takeover (an attempt paused between its fence check and its COMMIT, when the storage
  could not refuse it: a new step's key holds nothing to compare), or a step of the line the takeover left: it
  counts nowhere, as a fork's abandoned steps. Written before this attempt's first save; so a stale step never
  becomes the step a later restore, retention or promotion takes (docs/training.md, "Fencing between attempts").

``train.resume=never`` starts a lineage of its own once (its earlier steps are cleared, best effort; those that
stay, e.g. a step a registered model needs, are outside ``accept``); ``train.resume=N`` forks at step N (steps of
the old line after N are abandoned). Without a record every step counts; since 2026-12-01 a run's first resume
writes one (its cutoff), which counts every lineage.
"""
from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Optional

from pipelines.manifest import atomic_write_text, read_small_text
from pipelines.spec import JobSpec, resolve_path
from pipelines.train.ckpt import fence
from pipelines.train.ckpt.protocol import CheckpointError

ANY = "*"  # an ``accept`` lineage that matches every lineage (a token is never "*")


TERM_RECORD = re.compile(r"(0|[1-9][0-9]{0,17})\.json")  # a term's record in the run's ``.lineage.d``
RECORD_LIMIT = 16 << 20  # bytes a record may have (one cutoff per attempt: about 40 bytes each)


def record_path(spec: JobSpec, rel_root: str) -> Path:
    """The copy of the last record written (the only one a version before the per-term records reads)."""
    return resolve_path(spec.checkpoint.l1) / f"{rel_root}.lineage.json"


def terms_dir(spec: JobSpec, rel_root: str) -> Path:
    return resolve_path(spec.checkpoint.l1) / f"{rel_root}.lineage.d"


def _not_a_link(d: Path) -> None:
    if d.is_symlink():  # its records, and their removal below a new one, would be another directory's
        raise OSError(f"{d}: a link, not this run's directory of lineage records")


def _term_records(d: Path) -> dict[int, Path]:
    """The records in ``d`` by the term that wrote each (none: an empty dict); an L1 that does not answer raises,
    and so does a link in the directory's place (OSError)."""
    _not_a_link(d)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return {}
    return {int(m.group(1)): d / n for n in names if (m := TERM_RECORD.fullmatch(n))}


def top_record_term(spec: JobSpec, rel_root: str) -> int:
    """The highest term that wrote a record of this run (0: none): a new attempt's term must be above it, or its
    own record would not be the one read."""
    return max(_term_records(terms_dir(spec, rel_root)), default=0)


def run_token() -> str:
    """This launch's token: the train stage's (``LLMP_RUN_TOKEN``), else torchrun's run id, else a new one."""
    return os.environ.get("LLMP_RUN_TOKEN") or os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex


def read(spec: JobSpec, rel_root: str) -> Optional[dict]:
    """The record on L1: the highest term's, else the unnumbered copy; None when there is none there
    (:func:`pipelines.train.ckpt.tiers.read_lineage` then reads L2's copy). An L1 that does not answer raises
    (OSError; a link or a FIFO in a record's place too), a torn record too (ValueError). The copy is read over the
    records when a cutoff of it names a term above theirs: a version before them (a rolled-back image) ran after
    this one and wrote the copy alone. A copy that is torn is passed over; one that does not answer raises."""
    by_term = _term_records(terms_dir(spec, rel_root))
    if not by_term:
        return _copy(spec, rel_root)
    top = max(by_term)
    rec = parse(read_small_text(by_term[top], RECORD_LIMIT), str(by_term[top]))
    try:
        copy = _copy(spec, rel_root)
    except ValueError:  # a torn copy: the records per term are the record
        return rec
    return copy if copy is not None and top_term(copy) > top else rec


def _copy(spec: JobSpec, rel_root: str) -> Optional[dict]:
    p = record_path(spec, rel_root)
    try:
        text = read_small_text(p, RECORD_LIMIT)
    except FileNotFoundError:
        return None
    return parse(text, str(p))


def _pairs(v, first) -> bool:
    """A list of ``[first, step or null]`` pairs (``first`` says what the first may be)."""
    return isinstance(v, list) and all(isinstance(a, list) and len(a) == 2 and first(a[0])
                                       and (a[1] is None or type(a[1]) is int) for a in v)


def parse(text: str, where: str) -> dict:
    """A lineage record from its text; ValueError for one that is not (torn, forged)."""
    rec = json.loads(text)
    ok = isinstance(rec, dict) and isinstance(rec.get("token"), str) and isinstance(rec.get("lineage"), str) \
        and _pairs(rec.get("accept"), lambda a: a is None or isinstance(a, str)) \
        and _pairs(rec.get("cutoffs", []), lambda t: type(t) is int)
    if not ok:
        raise ValueError(f"{where}: not a lineage record (token and lineage strings, 'accept' a list of [lineage or "
                         "null, step or null], 'cutoffs' one of [term, step or null])")
    return rec


def write(spec: JobSpec, rel_root: str, rec: dict) -> None:
    """Under a fence (:mod:`pipelines.train.ckpt.fence`), only while this attempt's term is current, as the record
    of its term (a record of an older term, written by a writer paused after its check, is never read over it);
    then the unnumbered copy, and the older terms' records go (best effort). Without a fence: the copy alone, while
    no term has written a record (it would not be read over theirs: CheckpointError)."""
    run = resolve_path(spec.checkpoint.l1) / rel_root
    fence.check("writing the lineage record", run)
    f = fence.active()
    term = f.term if f is not None and f.covers(run) else None
    p, d, text = record_path(spec, rel_root), terms_dir(spec, rel_root), json.dumps(rec, indent=2)
    p.parent.mkdir(parents=True, exist_ok=True)
    if term is None:
        if _term_records(d):
            raise CheckpointError(f"{d}: this run's lineage records are kept per term; one written without a "
                                  "fence (no term) would not be read")
        atomic_write_text(p, text)
        return
    _not_a_link(d)
    d.mkdir(exist_ok=True)
    atomic_write_text(d / f"{term}.json", text)
    if not _newer_copy(spec, rel_root, term):
        atomic_write_text(p, text)
    _drop_below(d, term)


def _newer_copy(spec: JobSpec, rel_root: str, term: int) -> bool:
    """Does the copy already name a term above ``term`` (a rolled-back image's, written after this writer's check;
    replacing it would drop that image's cutoff and fork)? An unreadable copy: no (it is replaced)."""
    try:
        return top_term(_copy(spec, rel_root)) > term
    except (OSError, ValueError):
        return False


def _drop_below(d: Path, term: int) -> None:
    """The records of terms below ``term`` removed, each as it can be (they are never read over it anyway; the next
    write tries again). Never a newer term's: a writer paused here removes only what is below it."""
    try:
        records = _term_records(d)
    except OSError:
        return
    for t, old in records.items():
        if t < term:
            try:
                old.unlink(missing_ok=True)
            except OSError:
                pass


def accepts(rec: Optional[dict], step: int, lineage: Optional[str], term: Optional[int] = None) -> bool:
    """Does the line of training ``rec`` describes count step ``step`` of ``lineage``, committed by ``term`` (the
    manifest's: :func:`term_of`; None, a step saved before terms, passes every cutoff)?"""
    if rec is None:
        return True
    if term is not None and any(term < t and (m is None or step > m) for t, m in _cutoffs(rec)):
        return False  # an older term's step above where a newer term resumed: landed after the takeover
    return any((a == lineage or a == ANY) and (m is None or step <= m) for a, m in rec["accept"])


def term_of(man: dict) -> Optional[int]:
    """The term a step's (or part's) manifest records; None when it records none (or not a number)."""
    t = man.get("term")
    return t if type(t) is int else None


def resumed(rec: Optional[dict], token: str, term: int, step: Optional[int]) -> dict:
    """``rec`` with the cutoff of the attempt of ``term``, which resumed from ``step`` (None: from nothing). A run
    without a record takes one that counts every lineage, as before (:data:`ANY`), so the cutoff has a home."""
    # beside ANY, what a version before it reads: its own steps and those saved before any record (no lineage),
    # so a rolled-back image still resumes
    base = rec if rec is not None else {"token": token, "lineage": token,
                                        "accept": [[ANY, None], [token, None], [None, None]]}
    return {**base, "cutoffs": [*_cutoffs(base), [term, step]]}


def _cutoffs(rec: Optional[dict]) -> list:
    """The cutoffs of ``rec`` (none without a record, or in a record of a version before them)."""
    return rec.get("cutoffs", []) if rec is not None else []


def top_term(rec: Optional[dict]) -> int:
    """The highest term a cutoff of ``rec`` names (0: none): a new attempt's term must be above it."""
    return max((t for t, _ in _cutoffs(rec)), default=0)


def is_restart(rec: Optional[dict], token: str) -> bool:
    return rec is not None and rec.get("token") == token


def fresh(token: str, rec: Optional[dict] = None) -> dict:
    """A new line of training with nothing before it (``train.resume=never``); the cutoffs of ``rec`` stay (the
    terms they name stay taken: :func:`top_term`)."""
    return {"token": token, "lineage": token, "accept": [[token, None]],
            "cutoffs": _cutoffs(rec)}


def fork(rec: Optional[dict], token: str, at: int) -> dict:
    """A new line that continues the current one's step ``at`` (``train.resume=N``): what the old line wrote after
    ``at`` is abandoned."""
    old = rec["accept"] if rec is not None else [[None, None]]
    return {"token": token, "lineage": token, "cutoffs": _cutoffs(rec),
            "accept": [[token, None]] + [[a, at if m is None else min(m, at)] for a, m in old if a != token]}


def of(man: dict) -> Optional[str]:
    """The lineage a step's (or part's) manifest records."""
    return man.get("lineage")
