"""The dedup job's outputs, written by its tasks in two passes, and its counts, tallied by the same tasks.

* The *signature pass*: every doc's signature row (``idx, id, keys, sh``) beside its assignment (its component,
  cluster and their sizes; null for a doc that shares no bucket) and ``gone`` (removed against the corpus) →
  ``clusters/`` (every doc) and ``signatures/`` (the kept docs'), and the counts: docs, docs with shingles,
  removals by reason, the size histograms of duplicate clusters and components, edge counts.
* The *doc pass*: every doc beside its removal (``dup_of, dup_of_id, reason, jaccard``; null when kept) →
  ``kept/`` and ``removed/``.

One Spark job a pass, not one per output and one more per count. A task writes its files into an attempt directory
(``pipelines.data.spark.attempt_dir``); the driver moves the files of the attempts the job returned
(``publish_attempts``), so a retried or killed task leaves no torn or doubled file. Spark sorts each task's rows by
``idx`` (spilling as it needs), and the task writes them batch by batch, so it holds one Arrow batch, never its
partition; each part file is sorted by ``idx``. A folder that no task wrote to gets one empty file with its schema,
so readers of an empty result still find it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.data.spark import attempt_dir, finalize_parquet_dir, maybe_fail, prepare_attempts, publish_attempts

CLUSTERS = pa.schema([("idx", pa.int64()), ("id", pa.string()), ("cluster", pa.int64()),
                      ("cluster_size", pa.int64()), ("component", pa.int64()), ("component_size", pa.int64())])
SIGNATURES = pa.schema([("id", pa.string()), ("keys", pa.list_(pa.int64())), ("sh", pa.binary())])
REMOVAL = pa.schema([("dup_of", pa.int64()), ("dup_of_id", pa.string()), ("reason", pa.string()),
                     ("jaccard", pa.float64())])
EXACT, NEAR = "exact_duplicate", "near_duplicate"  # removed/'s reason, by the assignment's exact_dup
ROW_GROUP = 2048  # rows: as ingest writes docs, so a reader can split the outputs as finely as the input
DONE_SCHEMA = "dir string, counts string"


def removed_schema(kept: pa.Schema) -> pa.Schema:
    """``removed/``: the doc's idx, id, text and source, then why it went."""
    return pa.schema([kept.field(n) for n in ("idx", "id", "text", "source")] + list(REMOVAL))


class _Parts:
    """A task's part files, one per output folder of its attempt directory (made at the first row), each written
    batch by batch: the task never holds more than one Arrow batch."""

    def __init__(self, base: str, schemas: dict[str, pa.Schema]):
        self.base, self.schemas, self.mine, self.open = base, schemas, None, {}

    def write(self, folder: str, t: pa.Table) -> None:
        if t.num_rows == 0:
            return
        if self.mine is None:
            self.mine = attempt_dir(self.base)
        if folder not in self.open:
            (self.mine / folder).mkdir()
            part = self.mine.name.split("-")[0]  # the attempt directory's name begins with the task's partition
            self.open[folder] = pq.ParquetWriter(self.mine / folder / f"part-{part}.parquet", self.schemas[folder],
                                                 compression="zstd")
        schema = self.schemas[folder]
        self.open[folder].write_table(t.select(schema.names).cast(schema), row_group_size=ROW_GROUP)

    def close(self) -> None:
        for w in self.open.values():
            w.close()


def _filled(t: pa.Table, col: str, dup, default):
    return pc.if_else(dup, t.column(col), default)


def signature_pass_fn(base: str):
    """mapInArrow body over rows sorted by idx: (idx, id, keys, sh, component, component_size, cluster, cluster_size,
    exact_dup, n_cand, n_verified, n_exact, gone) → this task's clusters/ and signatures/ files, and one row: its
    attempt directory and its counts (JSON)."""
    def fn(batches):
        parts, counts = _Parts(base, {"clusters": CLUSTERS, "signatures": SIGNATURES}), []
        try:
            for rb in batches:
                t = pa.Table.from_batches([rb])
                idx = t.column("idx")
                member = t.column("cluster").is_valid()
                dup = pc.fill_null(pc.greater(t.column("component_size"), 1), False)
                one = pa.scalar(1, pa.int64())
                parts.write("clusters", pa.table({
                    "idx": idx, "id": t.column("id"), "cluster": _filled(t, "cluster", dup, idx),
                    "cluster_size": _filled(t, "cluster_size", dup, one), "component": _filled(t, "component", dup, idx),
                    "component_size": _filled(t, "component_size", dup, one)}))
                removed = pc.fill_null(pc.not_equal(t.column("cluster"), idx), False)
                gone = pc.fill_null(t.column("gone"), False)
                parts.write("signatures", t.filter(pc.invert(pc.or_(removed, gone))))
                counts.append(_counts(t, member, removed))
        finally:
            parts.close()
        if parts.mine is None:
            return
        maybe_fail("dedup-signatures")
        yield pa.RecordBatch.from_arrays([pa.array([str(parts.mine)]), pa.array([json.dumps(merge_counts(counts))])],
                                         names=["dir", "counts"])
    return fn


def _counts(t: pa.Table, member, removed) -> dict:
    def col(name, mask):
        return t.column(name).filter(mask).to_numpy(zero_copy_only=False)

    idx = t.column("idx")
    exact = col("exact_dup", removed).astype(bool)
    keeper = pc.and_(member, pc.equal(t.column("cluster"), idx))
    root = pc.and_(member, pc.equal(t.column("component"), idx))
    sizes = {k: np.unique(col(f"{k}_size", mask), return_counts=True) for k, mask in (("cluster", keeper),
                                                                                       ("component", root))}
    return {"docs": t.num_rows,
            "shingled": int(pc.sum(pc.greater(pc.fill_null(pc.list_value_length(t.column("keys")), 0), 1)).as_py()
                            or 0),
            "reason": {EXACT: int(exact.sum()), NEAR: int((~exact).sum())},
            **{f"{k}_hist": {str(int(s)): int(n) for s, n in zip(*v) if s > 1} for k, v in sizes.items()},
            **{k: int(col(k, member).sum()) for k in ("n_cand", "n_verified", "n_exact")}}


def doc_pass_fn(base: str, kept: pa.Schema):
    """mapInArrow body over rows sorted by idx: the docs' columns, then dup_of, dup_of_id, reason, jaccard (null for a
    kept doc) → this task's kept/ and removed/ files, and one row: its attempt directory and how many docs each
    holds."""
    def fn(batches):
        parts, n = _Parts(base, {"kept": kept, "removed": removed_schema(kept)}), {"kept": 0, "removed": 0}
        try:
            for rb in batches:
                t = pa.Table.from_batches([rb])
                out = pc.is_valid(t.column("reason"))
                for folder, rows in (("kept", t.filter(pc.invert(out))), ("removed", t.filter(out))):
                    parts.write(folder, rows)
                    n[folder] += rows.num_rows
        finally:
            parts.close()
        if parts.mine is None:
            return
        maybe_fail("dedup-docs")
        yield pa.RecordBatch.from_arrays([pa.array([str(parts.mine)]), pa.array([json.dumps(n)])],
                                         names=["dir", "counts"])
    return fn


def run_pass(df, fn_of_base, out: Path, name: str, folders: dict[str, pa.Schema]) -> list[dict]:
    """Run one pass (``df.mapInArrow(fn_of_base(base), …)``), publish its committed attempts' files into ``folders``
    under ``out`` and return each task's counts."""
    base = prepare_attempts(out / f"_{name}")
    rows = df.sortWithinPartitions("idx").mapInArrow(fn_of_base(base), DONE_SCHEMA).collect()
    publish_attempts(base, [r["dir"] for r in rows], {f: out / f for f in folders})
    shutil.rmtree(base, ignore_errors=True)  # a stopped speculative twin may still be writing into _attempts
    for f, schema in folders.items():
        d = out / f
        d.mkdir(exist_ok=True)
        if not any(d.glob("part-*.parquet")):
            pq.write_table(schema.empty_table(), d / "part-00000.parquet", compression="zstd")
        finalize_parquet_dir(d)
    return [json.loads(r["counts"]) for r in rows]


def merge_counts(parts: list[dict]) -> dict:
    """The signature pass's counts of every task, summed."""
    tot: dict = {"docs": 0, "shingled": 0, "reason": {}, "cluster_hist": {}, "component_hist": {},
                 "n_cand": 0, "n_verified": 0, "n_exact": 0}
    for p in parts:
        for k, v in p.items():
            if isinstance(v, dict):
                for kk, n in v.items():
                    tot[k][kk] = tot[k].get(kk, 0) + n
            else:
                tot[k] += v
    return tot
