"""Which steps of a run's checkpoints belong to the training being continued: steps are known by number *and*
lineage.

A run's record on L1, ``<l1>/<rel_root>.lineage.json``::

    {"token": T, "lineage": L, "accept": [[lineage or null, last step or null], ...]}

* ``token``: who wrote it: the launch (``LLMP_RUN_TOKEN``: the train stage sets it, so an Airflow retry or a
  rescheduled pod is the same launch) or torchrun's run id (the same across torchrun's restarts). A start whose
  token equals the record's is a *restart* of that training: it resumes, whatever ``train.resume`` says.
* ``lineage``: written into every step's manifest meta from now on.
* ``accept``: the steps a restore, retention or staging may count: a step of lineage ``a`` up to step ``m``
  (``null``: any). Steps that another line of training wrote are not restorable, not kept by retention and do not
  shadow the live ones.

``train.resume=never`` starts a lineage of its own once (its earlier steps are cleared, best effort; those that
stay, e.g. a step a registered model needs, are outside ``accept``); ``train.resume=N`` forks at step N (steps of
the old line after N are abandoned). Without a record (``auto`` from the start) every step counts.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Optional

from pipelines.manifest import atomic_write_text
from pipelines.spec import JobSpec, resolve_path
from pipelines.train.ckpt import fence


def record_path(spec: JobSpec, rel_root: str) -> Path:
    return resolve_path(spec.checkpoint.l1) / f"{rel_root}.lineage.json"


def run_token() -> str:
    """This launch's token: the train stage's (``LLMP_RUN_TOKEN``), else torchrun's run id, else a new one."""
    return os.environ.get("LLMP_RUN_TOKEN") or os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex


def read(spec: JobSpec, rel_root: str) -> Optional[dict]:
    """The record on L1; None when there is none there (:func:`pipelines.train.ckpt.tiers.read_lineage` then reads
    L2's copy). An L1 that does not answer raises (OSError), a torn record too (ValueError)."""
    p = record_path(spec, rel_root)
    try:
        text = p.read_text()
    except FileNotFoundError:
        return None
    return parse(text, str(p))


def parse(text: str, where: str) -> dict:
    """A lineage record from its text; ValueError for one that is not (torn, forged)."""
    rec = json.loads(text)
    ok = isinstance(rec, dict) and isinstance(rec.get("token"), str) and isinstance(rec.get("lineage"), str) \
        and isinstance(rec.get("accept"), list) and all(
            isinstance(a, list) and len(a) == 2 and (a[0] is None or isinstance(a[0], str))
            and (a[1] is None or type(a[1]) is int) for a in rec["accept"])
    if not ok:
        raise ValueError(f"{where}: not a lineage record (token and lineage strings, 'accept' a list of [lineage or "
                         "null, step or null])")
    return rec


def write(spec: JobSpec, rel_root: str, rec: dict) -> None:
    """Under a fence (:mod:`pipelines.train.ckpt.fence`), only while this attempt's term is current."""
    fence.check("writing the lineage record", resolve_path(spec.checkpoint.l1) / rel_root)
    p = record_path(spec, rel_root)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps(rec, indent=2))


def accepts(rec: Optional[dict], step: int, lineage: Optional[str]) -> bool:
    """Does the line of training ``rec`` describes count step ``step`` of ``lineage``?"""
    if rec is None:
        return True
    return any(a == lineage and (m is None or step <= m) for a, m in rec["accept"])


def is_restart(rec: Optional[dict], token: str) -> bool:
    return rec is not None and rec.get("token") == token


def fresh(token: str) -> dict:
    """A new line of training with nothing before it (``train.resume=never``)."""
    return {"token": token, "lineage": token, "accept": [[token, None]]}


def fork(rec: Optional[dict], token: str, at: int) -> dict:
    """A new line that continues the current one's step ``at`` (``train.resume=N``): what the old line wrote after
    ``at`` is abandoned."""
    old = rec["accept"] if rec is not None else [[None, None]]
    return {"token": token, "lineage": token,
            "accept": [[token, None]] + [[a, at if m is None else min(m, at)] for a, m in old if a != token]}


def of(man: dict) -> Optional[str]:
    """The lineage a step's (or part's) manifest records."""
    return man.get("lineage")
