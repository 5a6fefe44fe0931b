"""The dedup job's passes that read and write files in their own tasks, and its counts, tallied by the same tasks.

* The *signature pass* (first): each task reads its pieces of the docs (row groups,
  ``pipelines.data.spark.plan_pieces``) with pyarrow, computes every doc's signature row (``idx, id, len, keys, sh``) and writes them to
  ``_work/sig/part-NNNNN.parquet``. The text never passes through the JVM; Spark reads them for the shuffles that
  find the duplicates.
* The *side table* (``_work/side``): a row per doc that is a member of a candidate component (its component, cluster,
  their sizes, the keeper's id, the Jaccard to it) or was removed against an older corpus (``against``: the reason),
  sorted by ``idx``. Up to ``BROADCAST_ROWS`` rows the driver writes it as one file; more, Spark writes it
  range-partitioned by ``idx``. A task reads only the row groups of its own span of ``idx``.
* The *output pass* (last): each task reads the same pieces of the docs again, its own signature file and the side rows
  of its own docs (only the row groups of its span of idx are read) → ``clusters/`` (every doc), ``signatures/``
  (the kept docs', what a later run dedups against),
  ``kept/``, ``removed/``, and the counts: docs, docs with shingles, removals by reason, the size histograms of
  duplicate clusters and components, edge counts, side rows matched.

A task writes its files into an attempt directory (``pipelines.data.spark.attempt_dir``); the driver moves the files
of the attempts the job returned (``publish_attempts``), so a retried or killed task leaves no torn or doubled file.
A task holds one batch of ``BATCH`` docs at a time (and its pieces' row groups as pyarrow reads them); each part file
keeps the order of the docs (sorted by ``idx``, as ingest writes them). A folder that no task wrote to gets one empty
file with its schema, so readers of an empty result still find it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.data.spark import (attempt_dir, finalize_parquet_dir, maybe_fail, piece_batches, prepare_attempts,
                                  publish_attempts, read_piece)

SIG = pa.schema([("idx", pa.int64()), ("id", pa.string()), ("len", pa.int32()), ("keys", pa.list_(pa.int64())),
                 ("sh", pa.binary())])
CLUSTERS = pa.schema([("idx", pa.int64()), ("id", pa.string()), ("cluster", pa.int64()),
                      ("cluster_size", pa.int64()), ("component", pa.int64()), ("component_size", pa.int64())])
SIGNATURES = pa.schema([("id", pa.string()), ("keys", pa.list_(pa.int64())), ("sh", pa.binary())])
REMOVAL = pa.schema([("dup_of", pa.int64()), ("dup_of_id", pa.string()), ("reason", pa.string()),
                     ("jaccard", pa.float64())])
SIDE_DDL = ("idx long, component long, component_size long, cluster long, cluster_size long, dup_of_id string, "
            "jaccard double, exact_dup boolean, n_cand long, n_verified long, n_exact long, against string")
EXACT, NEAR = "exact_duplicate", "near_duplicate"  # removed/'s reason, by the assignment's exact_dup
ROW_GROUP = 2048  # rows: as ingest writes docs, so a reader can split the outputs as finely as the input
BATCH = ROW_GROUP  # docs a task holds at once
SIDE_GROUP = 65536  # rows per row group of the side table: what a task reads beyond its span is at most one group
WORK = "_work"  # under the job's directory: the signature files and the side table, removed at the end
BROADCAST_ROWS = 1_000_000  # up to this many rows (about 100 MB), the side table is collected and written by the
#                             driver, and the members are broadcast to the signatures' tasks


def arrow_schema(ddl: str) -> pa.Schema:
    """A flat Spark DDL schema (long, int, string, double, boolean) as an Arrow schema."""
    types = {"long": pa.int64(), "int": pa.int32(), "string": pa.string(), "double": pa.float64(),
             "boolean": pa.bool_()}
    return pa.schema([(n, types[t]) for n, t in (f.split() for f in ddl.split(", "))])


SIDE = arrow_schema(SIDE_DDL)


def removed_schema(kept: pa.Schema) -> pa.Schema:
    """``removed/``: the doc's idx, id, text and source, then why it went."""
    return pa.schema([kept.field(n) for n in ("idx", "id", "text", "source")] + list(REMOVAL))


class _Parts:
    """A task's part files, one per output folder of its attempt directory (made at the first row), each written
    batch by batch: the task never holds more than one batch."""

    def __init__(self, base: str, schemas: dict[str, pa.Schema]):
        self.base, self.schemas, self.mine, self.open = base, schemas, None, {}

    def write(self, folder: str, t: pa.Table) -> None:
        if t.num_rows == 0:
            return
        if self.mine is None:
            self.mine = attempt_dir(self.base)
        if folder not in self.open:
            (self.mine / folder).mkdir()
            self.open[folder] = pq.ParquetWriter(self.mine / folder / f"part-{_task_of(self.mine):05d}.parquet",
                                                 self.schemas[folder], compression="zstd")
        schema = self.schemas[folder]
        self.open[folder].write_table(t.select(schema.names).cast(schema), row_group_size=ROW_GROUP)

    def close(self) -> None:
        for w in self.open.values():
            w.close()


def _done_row(parts: _Parts, counts: dict) -> list[tuple[str, str]]:
    return [] if parts.mine is None else [(str(parts.mine), json.dumps(counts))]


def signature_task(base: str, sig_fn):
    """mapPartitions body over one task's pieces: ``sig_fn`` (a mapInArrow-style body: batches of idx, id, text →
    batches of signature rows) over its docs → its signature file, and one row: (attempt directory, counts JSON: docs,
    bucket entries, the smallest and largest idx)."""
    def fn(it):
        pieces = [p for ps in it for p in ps]
        parts, n = _Parts(base, {"sig": SIG}), {"docs": 0, "entries": 0, "lo": None, "hi": None}
        try:
            for t in piece_batches(pieces, ["idx", "id", "text"], BATCH):
                s = pa.Table.from_batches(list(sig_fn(t.to_batches())), SIG)
                parts.write("sig", s)
                lo, hi = pc.min_max(s.column("idx")).values()
                n["lo"] = lo.as_py() if n["lo"] is None else min(n["lo"], lo.as_py())
                n["hi"] = hi.as_py() if n["hi"] is None else max(n["hi"], hi.as_py())
                n["docs"] += s.num_rows
                n["entries"] += int(pc.sum(pc.list_value_length(s.column("keys"))).as_py() or 0)
        finally:
            parts.close()
        maybe_fail("dedup-signatures")
        yield from _done_row(parts, n)
    return fn


def signature_pass(spark, pieces: list, out: Path, sig_fn) -> dict:
    """Run the signature pass: ``_work/sig/`` under ``out`` (an empty file when there are no docs). Returns its
    ``dir``, ``spans`` (the (smallest, largest) idx of each task, in task order), ``docs`` and ``entries`` (bucket
    entries: every doc's exact key and band keys)."""
    rows = _run(spark, pieces, lambda base: signature_task(base, sig_fn), out, "signature_pass", out / WORK,
                {"sig": SIG}, finalize=False)
    counts = [json.loads(c) for _, c in sorted(rows, key=lambda r: _task_of(r[0]))]
    return {"dir": out / WORK / "sig", "spans": [(c["lo"], c["hi"]) for c in counts],
            "docs": sum(c["docs"] for c in counts), "entries": sum(c["entries"] for c in counts)}


def _task_of(attempt: str | Path) -> int:
    """The task (partition) of an attempt directory: its name begins with it."""
    return int(Path(attempt).name.split("-")[0])


def _run(spark, jobs: list, task_of_base, out: Path, name: str, dest: Path, folders: dict[str, pa.Schema],
         finalize: bool = True) -> list:
    """One pass, a Spark task per job (``task_of_base(base)``: its mapPartitions body), every job's task returning one
    row; publish the committed attempts' files into ``folders`` under ``dest`` (with ``finalize``, renumbered
    ``part-00000…``; else each keeps its task's number)."""
    base = prepare_attempts(out / f"_{name}")
    rows = (spark.sparkContext.parallelize(jobs, len(jobs)).mapPartitions(task_of_base(base)).collect()
            if jobs else [])
    if len(rows) != len(jobs) or len({_task_of(d) for d, _ in rows}) != len(jobs):
        raise RuntimeError(f"dedup {name}: {len(rows)} of {len(jobs)} tasks returned their files")
    publish_attempts(base, [d for d, _ in rows], {f: dest / f for f in folders})
    shutil.rmtree(base, ignore_errors=True)  # a stopped speculative twin may still be writing into _attempts
    for f, schema in folders.items():
        d = dest / f
        d.mkdir(parents=True, exist_ok=True)
        if not any(d.glob("part-*.parquet")):
            pq.write_table(schema.empty_table(), d / "part-00000.parquet", compression="zstd")
        if finalize:
            finalize_parquet_dir(d)
    return rows


def write_side(side, n_rows: int, d: Path, tasks: int) -> int:
    """The side table (a DataFrame with the columns of ``SIDE_DDL``, about ``n_rows`` rows) sorted by idx into ``d``;
    returns how many rows it holds (from the files' footers)."""
    import pyarrow.dataset as pds
    from pyspark import StorageLevel

    side = side.select(*SIDE.names)
    if n_rows > BROADCAST_ROWS:
        side = side.persist(StorageLevel.MEMORY_AND_DISK)  # the range partitioner samples it first: computed once
        try:
            (side.repartitionByRange(tasks, "idx").sortWithinPartitions("idx")
             .write.option("parquet.block.size", 8 << 20).mode("overwrite").parquet(str(d)))
        finally:
            side.unpersist()
    else:
        t = side.toArrow() if n_rows else SIDE.empty_table()
        d.mkdir(parents=True, exist_ok=True)
        pq.write_table(t.cast(SIDE).sort_by("idx"), d / "part-00000.parquet", row_group_size=SIDE_GROUP,
                       compression="zstd")
    return pds.dataset(str(d), format="parquet").count_rows()


def _side_rows(d: str, pieces: list, lo: int, hi: int) -> tuple[pa.Table, np.ndarray]:
    """The side rows of the docs of ``pieces`` (their idx between ``lo`` and ``hi``: only the row groups whose
    statistics overlap are read; the rows kept are the pieces' own, so docs out of idx order cost reading, not
    memory), sorted by idx."""
    import pyarrow.dataset as pds

    mine = pa.concat_arrays([read_piece(p, ["idx"]).column(0).combine_chunks() for p in pieces])
    f = (pc.field("idx") >= lo) & (pc.field("idx") <= hi) & pc.field("idx").isin(mine)
    t = pds.dataset(d, format="parquet").to_table(filter=f).cast(SIDE).sort_by("idx").combine_chunks()
    return t, t.column("idx").to_numpy()


def _aligned(side: pa.Table, sidx: np.ndarray, idx: np.ndarray) -> tuple[pa.Table, int]:
    """The side rows of the docs ``idx`` in their order, null where a doc has none; and how many have one."""
    if not sidx.size:
        return pa.table({f.name: pa.nulls(idx.size, f.type) for f in SIDE}), 0
    pos = np.minimum(np.searchsorted(sidx, idx), sidx.size - 1)
    hit = sidx[pos] == idx
    return side.take(pa.array(pos, mask=~hit)), int(hit.sum())


def output_task(base: str, kept: pa.Schema, sig_dir: str, side_dir: str):
    """mapPartitions body over one job (task number, pieces, smallest and largest idx) → this task's clusters/,
    signatures/, kept/ and removed/ files, and one row: (attempt directory, counts JSON)."""
    folders = {"clusters": CLUSTERS, "signatures": SIGNATURES, "kept": kept, "removed": removed_schema(kept)}

    def fn(it):
        parts, counts = _Parts(base, folders), []
        try:
            for task, pieces, lo, hi in it:
                side, sidx = _side_rows(side_dir, pieces, lo, hi)
                sig = _Follow(Path(sig_dir) / f"part-{task:05d}.parquet", ["idx", "id", "keys", "sh"])
                for t in piece_batches(pieces, kept.names, BATCH):
                    s = sig.take(t.num_rows)
                    if s is None or not s.column("idx").equals(t.column("idx")):
                        raise RuntimeError(f"dedup: signature part {task} does not follow its docs")
                    a, hits = _aligned(side, sidx, t.column("idx").to_numpy())
                    counts.append(_write_batch(parts, t, s, a) | {"side": hits})
                if sig.take(1) is not None:
                    raise RuntimeError(f"dedup: signature part {task} has more rows than its docs")
        finally:
            parts.close()
        maybe_fail("dedup-docs")
        yield from _done_row(parts, merge_counts(counts))
    return fn


class _Follow:
    """A parquet file's rows in order, so many at a time: the signature rows that go with the next batch of docs."""

    def __init__(self, path: Path, columns: list[str]):
        self.it, self.rest = pq.ParquetFile(path).iter_batches(batch_size=BATCH, columns=columns), None

    def take(self, n: int) -> pa.Table | None:
        """The next ``n`` rows; None when the file has fewer left."""
        got = [self.rest] if self.rest is not None else []
        have = sum(b.num_rows for b in got)
        while have < n:
            b = next(self.it, None)
            if b is None:
                return None
            got.append(pa.Table.from_batches([b]))
            have += b.num_rows
        t = pa.concat_tables(got).combine_chunks()
        self.rest = t.slice(n)
        return t.slice(0, n)


def _write_batch(parts: _Parts, t: pa.Table, s: pa.Table, a: pa.Table) -> dict:
    """One batch of docs ``t``, their signature rows ``s`` and side rows ``a`` → the four outputs; returns its
    counts."""
    idx = t.column("idx")
    member = a.column("cluster").is_valid()
    dup = pc.fill_null(pc.greater(a.column("component_size"), 1), False)
    one = pa.scalar(1, pa.int64())
    parts.write("clusters", pa.table({
        "idx": idx, "id": t.column("id"), "cluster": pc.if_else(dup, a.column("cluster"), idx),
        "cluster_size": pc.if_else(dup, a.column("cluster_size"), one),
        "component": pc.if_else(dup, a.column("component"), idx),
        "component_size": pc.if_else(dup, a.column("component_size"), one)}))
    dropped = pc.fill_null(pc.not_equal(a.column("cluster"), idx), False)  # removed as a duplicate in this corpus
    gone = pc.or_(dropped, a.column("against").is_valid())
    parts.write("signatures", s.filter(pc.invert(gone)))
    exact = pc.fill_null(a.column("exact_dup"), False)
    reason = pc.if_else(dropped, pc.if_else(exact, EXACT, NEAR), a.column("against"))
    dup_of = pc.if_else(dropped, a.column("cluster"), pa.scalar(None, pa.int64()))
    parts.write("kept", t.filter(pc.invert(gone)))
    parts.write("removed", t.filter(gone).append_column("dup_of", dup_of.filter(gone))
                .append_column("dup_of_id", a.column("dup_of_id").filter(gone))
                .append_column("reason", reason.filter(gone))
                .append_column("jaccard", a.column("jaccard").filter(gone)))
    n_gone = int(pc.sum(gone.cast(pa.int64())).as_py() or 0)
    return _counts(t, s, a, member, dropped) | {"kept": t.num_rows - n_gone, "removed": n_gone}


def _counts(t: pa.Table, s: pa.Table, a: pa.Table, member, dropped) -> dict:
    def col(name, mask):
        return a.column(name).filter(mask).to_numpy(zero_copy_only=False)

    idx = t.column("idx")
    exact = pc.fill_null(a.column("exact_dup"), False).filter(dropped).to_numpy(zero_copy_only=False)
    keeper = pc.and_(member, pc.equal(a.column("cluster"), idx))
    root = pc.and_(member, pc.equal(a.column("component"), idx))
    sizes = {k: np.unique(col(f"{k}_size", mask), return_counts=True) for k, mask in (("cluster", keeper),
                                                                                       ("component", root))}
    return {"docs": t.num_rows,
            "shingled": int(pc.sum(pc.greater(pc.fill_null(pc.list_value_length(s.column("keys")), 0), 1)).as_py()
                            or 0),
            "reason": {EXACT: int(exact.sum()), NEAR: int((~exact).sum())},
            **{f"{k}_hist": {str(int(z)): int(n) for z, n in zip(*v) if z > 1} for k, v in sizes.items()},
            **{k: int(col(k, member).sum()) for k in ("n_cand", "n_verified", "n_exact")}}


def output_pass(spark, pieces: list, spans: list, out: Path, kept: pa.Schema, side_dir: Path) -> dict:
    """Run the output pass over the signature pass's tasks (``spans``: theirs); returns every task's counts, summed."""
    jobs = [(i, ps, lo, hi) for i, (ps, (lo, hi)) in enumerate(zip(pieces, spans))]
    rows = _run(spark, jobs, lambda base: output_task(base, kept, str(out / WORK / "sig"), str(side_dir)), out,
                "output_pass", out, {"clusters": CLUSTERS, "signatures": SIGNATURES, "kept": kept,
                                "removed": removed_schema(kept)})
    return merge_counts([json.loads(c) for _, c in rows])


def merge_counts(parts: list[dict]) -> dict:
    """Counts of batches or tasks, summed (dicts key by key)."""
    tot: dict = {"docs": 0, "shingled": 0, "reason": {}, "cluster_hist": {}, "component_hist": {},
                 "n_cand": 0, "n_verified": 0, "n_exact": 0, "kept": 0, "removed": 0, "side": 0}
    for p in parts:
        for k, v in p.items():
            if isinstance(v, dict):
                for kk, n in v.items():
                    tot[k][kk] = tot[k].get(kk, 0) + n
            else:
                tot[k] += v
    return tot
