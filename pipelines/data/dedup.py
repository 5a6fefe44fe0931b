"""Near-duplicate removal on Spark: MinHash → LSH bands → star edges → connected components → keepers.

Pipeline (on executors; the driver plans, counts, and writes the side table when it is small enough to collect):

1. The *signature pass* (``pipelines.data.dedup_outputs``): each task reads its row groups of the docs with pyarrow
   (the text never passes through the JVM) and writes every doc's signature row: normalize, word n-gram shingles,
   64-bit-safe MinHash signature, one 64-bit key per band (``pipelines.data.minhash``), plus the *exact band*: a
   hash of the whole normalized text. Docs too short to shingle get only the exact key: they can be exact
   duplicates but are never near-duplicate candidates.
2. Candidate edges: every bucket (band, key) with ≥ 2 docs becomes a *star*: each member → the bucket's smallest
   ``idx``; no all-pairs expansion. Up to ``cc_single_task_max_edges`` bucket entries (docs × (bands + 1)), one
   executor task gets every doc's keys, sorts the entries in numpy and finds the stars and their connected
   components (scipy) at once. Above that: one shuffle by bucket, sorted, one streaming Python pass, repeats merged
   in one aggregation, counted.
3. Connected components of a counted candidate graph: in one executor task (scipy) while it has at most
   ``cc_single_task_max_edges`` edges, else large-star / small-star rounds (``pipelines.data.spark``).
4. Per component of up to ``cover_max_cluster`` docs, one Python pass per partition
   (``pipelines.data.keepers``): the star edges are rebuilt from the members' keys, every pair's
   exact Jaccard is computed on the shingle-hash sets, and with ``dedup.verify`` (default on) an
   LSH-only edge stays only if its J ≥ ``threshold``; the manifest counts ``candidate_edges``,
   ``verified_edges``, ``rejected_edges``. The verified edges give the *duplicate components*, and
   the keeper policy (``dedup.keeper``) runs on each:
   ``cover`` (default): a greedy dominating set of the component's similarity graph (all pairs on
   exact J), so every removed doc has a kept doc with J ≥ threshold, which is its ``dup_of``;
   ``min_idx``: the earliest doc; ``longest``: the longest text (ties: earliest).
   Larger components stay distributed: their edges are verified in Spark (batched in Arrow, no
   per-row UDF), components run again on the verified edges, and ``cover`` keeps every star centre.
   The assignments (and the docs removed against an older corpus) become the *side table*, sorted by idx.
5. The *output pass*: each task of the signature pass's plan reads its docs again, its signature file and the side
   rows of its own docs (row groups outside its span of idx are not read), and writes ``clusters/``,
   ``signatures/``, ``kept/`` and ``removed/`` through the task
   commit protocol, and counts. The job fails when a task's output is missing: the output pass read fewer docs than
   the signature pass, a side row written found no doc, or the removals do not add up.

Outputs under the stage directory (parquet dirs of ``part-NNNNN.parquet``, each sorted by ``idx``, zstd):

* ``clusters/``: ``idx``, ``id``, ``cluster`` (the idx of the kept doc this doc belongs to; a kept
  doc's own idx), ``cluster_size``, ``component`` (smallest idx of its connected component of
  duplicate edges), ``component_size``
* ``kept/``: the docs kept (every column of the input docs)
* ``removed/``: the docs removed, plus ``dup_of`` (idx), ``dup_of_id``, ``reason``
  (``exact_duplicate`` / ``near_duplicate``) and ``jaccard`` (to ``dup_of``)
* ``signatures/``: ``id, keys, sh`` of the kept docs (what a later run dedups against)
* ``stats.json`` and ``cluster_sizes.png`` (histogram of cluster sizes > 1)

Skew: above ``cc_single_task_max_edges`` bucket entries, a bucket with millions of members streams through one task
(Spark's sort spills; the star pass holds one Arrow batch), so its members are never gathered; adaptive query
execution splits skewed join partitions. Only components up to ``cover_max_cluster`` docs, and up to
``cc_single_task_max_edges`` bucket entries or candidate edges (ids and keys only), are ever gathered in one task.

Run standalone: ``python -m pipelines.data.dedup --input IN.jsonl --output DIR`` (ingests the JSONL
first under ``run.root``, so malformed lines are quarantined, not lost), or under spark-submit:
``spark-submit --master M pipelines/spark_entry.py pipelines.data.dedup …``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.cli import (add_corpus_arg, corpus_arg, manifest_arg, run_and_log, stage_dir, stage_main,
                           upstream_manifests)
from pipelines.data import dedup_outputs as o
from pipelines.data.keepers import hash_set_column, list_flat, pair_jaccard, resolve_partition
from pipelines.data.spark import dir_bytes, plan_pieces, read_piece, row_groups, size_shuffles, task_count
from pipelines.manifest import Manifest, StageError, input_ref
from pipelines.spec import DedupCfg, JobSpec
from pipelines.stages import stage
from pipelines.data.minhash import (band_keys_batch, candidate_probability, integrate, optimal_bands_rows, permutations,
                                    shingle_hash_texts, signatures_flat, threshold_point)

STAGE = stage("dedup")


def lsh_threshold(cfg: DedupCfg) -> float:
    if cfg.lsh_threshold is not None:
        return cfg.lsh_threshold
    return max(0.05, cfg.threshold - 0.2) if cfg.verify else cfg.threshold


def effective_bands_rows(cfg: DedupCfg) -> tuple[int, int]:
    """Explicit bands × rows, else the pair that minimises FP+FN area at the LSH threshold."""
    if cfg.bands is not None:
        return cfg.bands, cfg.rows

    b, r, _, _ = optimal_bands_rows(round(lsh_threshold(cfg), 4), cfg.num_perm)
    return b, r


SIG_SCHEMA = "idx long, id string, len int, keys array<long>, sh binary"


def _signature_fn(ngram: int, num_perm: int, seed: int, bands: int, rows: int):
    """mapInArrow body: (idx, id, text) batches → one row per doc: (idx, id, len, keys, sh).

    ``keys[0]``: a 64-bit hash of the whole normalized text (the *exact band*: exact duplicates meet
    on it, even docs too short to shingle); ``keys[1:]``: the b LSH band keys (absent when the doc
    has no shingles); ``sh``: the distinct 32-bit shingle hashes (``keepers.hash_set_column``, null
    without shingles) for exact Jaccard; ``len``: the raw text's length (the ``longest`` keeper policy). A doc whose
    normalized text is empty gets null ``keys``: it is never a duplicate of anything.
    """
    def fn(batches):
        a, b = permutations(num_perm, seed)
        for rb in batches:
            raw = [t or "" for t in rb.column(2).to_pylist()]
            nd = len(raw)
            x, s_off, n_words, exact = shingle_hash_texts(raw, ngram)
            empty = n_words == 0
            has = np.diff(s_off) > 0
            sig = signatures_flat(x, np.concatenate((s_off[:-1][has], s_off[-1:])), a, b)
            bk = band_keys_batch(sig, bands, rows)
            width = np.where(has, bands + 1, 1)
            width[empty] = 0
            k_off = np.zeros(nd + 1, dtype=np.int32)
            np.cumsum(width, out=k_off[1:])
            flat = np.empty(int(k_off[-1]), dtype=np.int64)
            flat[k_off[:-1][~empty]] = exact[~empty]
            rows_with = np.flatnonzero(has)
            if rows_with.size:  # band keys right after each shingled doc's exact key
                pos = (k_off[rows_with] + 1)[:, None] + np.arange(bands)[None, :]
                flat[pos.reshape(-1)] = bk.reshape(-1)
            yield pa.RecordBatch.from_arrays(
                [rb.column(0), rb.column(1), pa.array([len(t) for t in raw], pa.int32()),
                 pa.ListArray.from_arrays(pa.array(k_off), pa.array(flat), mask=pa.array(empty)),
                 hash_set_column(x, s_off, has)],
                names=["idx", "id", "len", "keys", "sh"])
    return fn


def bucket_edges(sig):
    """Star edges of every bucket (band, key) with ≥ 2 members: each member → the bucket's smallest idx; band 0 is
    the exact-text band, and an edge found there has ``x`` = 1. A pair that shares several bands comes once per band;
    at most one edge per bucket entry. One shuffle brings each bucket's entries together, sorted, and one streaming
    Python pass (:func:`bucket_stars`) emits the stars. A bucket with millions of members streams through its task
    (Spark's sort spills, the pass holds one Arrow batch): its members are never gathered."""
    from pyspark.sql import functions as F

    bk = sig.where(F.col("keys").isNotNull()).select(F.posexplode("keys").alias("band", "key"), "idx")
    return (bk.repartition("band", "key").sortWithinPartitions("band", "key", "idx")
            .mapInArrow(bucket_stars, "src long, dst long, x int"))


def star_edges(sig):
    """The candidate edges (src, dst, x): :func:`bucket_edges` with the repeats across bands merged (``x``: 1 when
    any was found on the exact band)."""
    from pyspark.sql import functions as F

    return bucket_edges(sig).groupBy("src", "dst").agg(F.max("x").alias("x"))


def bucket_stars(batches):
    """mapInArrow body over bucket entries (band, key, idx) sorted by (band, key, idx): each entry but a bucket's
    first → (idx, the first's idx, band = 0). A bucket that goes on in the next batch carries its first over."""
    last = None  # (band, key, root) of the batch's last bucket
    for rb in batches:
        if rb.num_rows == 0:
            continue
        band, key, idx = (rb.column(i).to_numpy() for i in range(3))
        new = np.ones(band.size, dtype=bool)
        new[1:] = (band[1:] != band[:-1]) | (key[1:] != key[:-1])
        if last is not None and band[0] == last[0] and key[0] == last[1]:
            new[0] = False
        group = np.cumsum(new) - 1  # −1: the rows that go on the carried bucket
        on = group >= 0
        root = np.empty_like(idx)
        root[on] = idx[new][group[on]]
        root[~on] = last[2] if last is not None else 0  # (none without a carried bucket: new[0] is then set)
        last = (band[-1], key[-1], root[-1])
        out = ~new
        yield pa.RecordBatch.from_arrays([pa.array(idx[out]), pa.array(root[out]),
                                          pa.array((band[out] == 0).astype(np.int32))], names=["src", "dst", "x"])


def one_task_components(batches):
    """mapInArrow body, one task over every doc's (idx, keys): the entries sorted by (band, key, idx) in numpy, the
    stars of their buckets (:func:`bucket_stars`) and the connected components of those edges
    (``pipelines.data.spark.label_components``) → (idx, cc, n): every doc that shares a bucket, the smallest idx of
    its component and the component's size. About 100 B per bucket entry at the peak, so callers bound the entries
    (``dedup.cc_single_task_max_edges``)."""
    from pipelines.data.spark import label_components

    got = [rb for rb in batches if rb.num_rows]
    if not got:
        return
    t = pa.Table.from_batches(got)
    band, key, row = bucket_entries(t.column("keys").combine_chunks())
    idx = t.column("idx").to_numpy()[row]
    del t, got, row
    order = np.lexsort((idx, key, band))
    entries = pa.RecordBatch.from_arrays([pa.array(band[order]), pa.array(key[order]), pa.array(idx[order])],
                                         names=["band", "key", "idx"])
    del band, key, idx, order
    stars = list(bucket_stars([entries]))
    del entries
    src, dst = (np.concatenate([rb.column(i).to_numpy() for rb in stars] or [np.zeros(0, np.int64)]) for i in (0, 1))
    if src.size:
        nodes, roots = label_components(src, dst)
        _, at, n = np.unique(roots, return_inverse=True, return_counts=True)
        yield pa.RecordBatch.from_arrays([pa.array(nodes), pa.array(roots), pa.array(n[at])],
                                         names=["idx", "cc", "n"])


ASSIGN_SCHEMA = ("idx long, component long, component_size long, cluster long, cluster_size long, "
                 "dup_of_id string, jaccard double, exact_dup boolean, n_cand long, n_verified long, n_exact long")


def _assign_fn(policy: str, threshold: float, verify: bool):
    """mapInArrow body over members (cc, idx, id, len, keys, sh) partitioned and sorted by (cc, idx):
    ``keepers.resolve_partition`` over the connected components of candidate edges, plus cluster sizes and
    the keeper's id. One Python call per partition, not per component; a component that straddles
    two Arrow batches is carried over to the next."""
    def fn(batches):
        schema = o.arrow_schema(ASSIGN_SCHEMA)

        def emit(t):
            cc = t.column("cc").to_numpy()
            idx = t.column("idx").to_numpy()
            lens = t.column("len").to_numpy()
            keys_col = t.column("keys").combine_chunks()
            comp, csize, keep, jac, nc, nv, nx = resolve_partition(
                cc, idx, lens, keys_col, t.column("sh").combine_chunks(), policy, threshold, verify)
            clsize = np.bincount(keep, minlength=len(cc))[keep]
            k_off, k_val, _ = list_flat(keys_col, np.int64)
            exact = k_val[k_off[:-1]]
            return pa.RecordBatch.from_arrays(
                [pa.array(idx), pa.array(idx[comp]), pa.array(csize), pa.array(idx[keep]), pa.array(clsize),
                 t.column("id").combine_chunks().take(pa.array(keep)), pa.array(jac), pa.array(exact == exact[keep]),
                 pa.array(nc), pa.array(nv), pa.array(nx)], schema=schema)

        carry = None
        for rb in batches:
            t = pa.Table.from_batches([rb])
            if carry is not None:
                t = pa.concat_tables([carry, t])
            if t.num_rows == 0:
                continue
            cc = t.column("cc").to_numpy()
            last = int(np.flatnonzero(cc == cc[-1])[0])  # the last component may go on in the next batch
            carry = t.slice(last)
            if last:
                yield emit(t.slice(0, last))
        if carry is not None and carry.num_rows:
            yield emit(carry)
    return fn


def _small_assign(members, n_members: int, sig, cfg: DedupCfg, tasks: int):
    """Components up to ``cover_max_cluster`` docs: each goes whole through one compiled pass per
    partition (``pipelines.data.keepers.resolve_partition``). Up to ``BROADCAST_ROWS`` members are sent to every task
    of the signatures, so only the members' rows are shuffled."""
    return (sig.select("idx", "id", "len", "keys", "sh").join(_side(members, n_members), "idx")
            .repartition(tasks, "cc").sortWithinPartitions("cc", "idx")
            .select("cc", "idx", "id", "len", "keys", "sh")
            .mapInArrow(_assign_fn(cfg.keeper, cfg.threshold, cfg.verify), ASSIGN_SCHEMA))


def _pair_jaccard_fn(batches):
    """mapInArrow body: (u, v, x, a, b) → (u, v, x, j), j the exact Jaccard of sets a and b (u, v, x keep their
    names)."""
    for rb in batches:
        yield pa.RecordBatch.from_arrays([rb.column(0), rb.column(1), rb.column(2),
                                          pa.array(pair_jaccard(rb.column(3), rb.column(4)))],
                                         names=[*rb.schema.names[:3], "j"])


def _components(spark, edges, n_edges: int, cfg: DedupCfg):
    """Connected components (node, root) of ``edges`` (src, dst): in one executor task when the graph
    has at most ``cc_single_task_max_edges`` edges, else large-star/small-star rounds across the
    cluster. Returns (components, rounds, mode)."""
    from pipelines.data.spark import components_single_task, connected_components

    if n_edges == 0:
        return spark.createDataFrame([], "node long, root long"), 0, "none"
    if n_edges <= cfg.cc_single_task_max_edges:
        return components_single_task(edges), 1, "single_task"
    comps, rounds = connected_components(edges.select("src", "dst"))
    return comps, rounds, "large_star_small_star"


def _candidates(spark, sig, n_entries: int, cfg: DedupCfg) -> dict:
    """The connected components of the candidate graph of ``sig`` (``n_entries``: its bucket entries, which bound its
    star edges). Up to ``cc_single_task_max_edges`` entries, every doc's keys go to one executor task, which finds the
    buckets, their stars and the components (:func:`one_task_components`): no shuffle by bucket, no count; else the
    candidate edges come from a shuffle by bucket, merged, persisted and counted first. Returns ``rounds``,
    ``cc_mode``, ``members`` (idx, cc: the component's smallest idx, n: its size), ``cand`` (the merged candidate
    edges, persisted; None when not counted: the distributed keeper path then makes them) and ``persisted`` (what to
    unpersist at the end)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    if 0 < n_entries <= cfg.cc_single_task_max_edges:
        members = (sig.where(F.col("keys").isNotNull()).select("idx", "keys").repartition(1)
                   .mapInArrow(one_task_components, "idx long, cc long, n long"))
        return {"members": members, "rounds": 1, "cc_mode": "single_task", "cand": None, "persisted": []}
    cand = star_edges(sig).persist(StorageLevel.MEMORY_AND_DISK)
    comps, rounds, mode = _components(spark, cand, cand.count(), cfg)
    m = comps.select(F.col("node").alias("idx"), F.col("root").alias("cc")).persist(StorageLevel.MEMORY_AND_DISK)
    sizes = m.groupBy("cc").agg(F.count("*").alias("n"))  # partial counts, a join AQE can split: no giant task
    return {"members": m.join(sizes, "cc"), "rounds": rounds, "cc_mode": mode, "cand": cand, "persisted": [cand, m]}


def _big_assign(members, sig, cand, cfg: DedupCfg):
    """Components above ``cover_max_cluster`` docs stay in joins and aggregations, so no giant
    component ever sits on one task: their candidate edges are verified in Spark (the shingle-hash
    sets of both ends joined to each edge, ``keepers.pair_jaccard`` per Arrow batch), connected components run again on the verified edges, and ``cover``
    keeps every verified star centre and removes each other member next to its most similar centre,
    ``min_idx`` keeps the component's root, ``longest`` its longest text. ``jaccard`` comes from
    the verified edge to the keeper (null when the keeper is not a direct neighbour, possible only
    with min_idx/longest). Returns (assignments, edge counts)."""
    from pyspark import StorageLevel
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    nodes = members.select(F.col("idx").alias("src"))
    e = cand.join(nodes, "src")  # both ends of an edge lie in the same component
    if cfg.verify:
        shs = sig.where(F.col("sh").isNotNull()).select("idx", "sh")
        near = (e.where(F.col("x") == 0)
                .join(shs.select(F.col("idx").alias("src"), F.col("sh").alias("a")), "src")
                .join(shs.select(F.col("idx").alias("dst"), F.col("sh").alias("b")), "dst")
                .select("src", "dst", "x", "a", "b")
                .mapInArrow(_pair_jaccard_fn, "src long, dst long, x int, j double"))
        e = e.where(F.col("x") == 1).withColumn("j", F.lit(1.0)).unionByName(near)
    else:
        e = e.withColumn("j", F.when(F.col("x") == 1, F.lit(1.0)))
    e = e.persist(StorageLevel.MEMORY_AND_DISK)
    c = e.agg(F.count(F.when(F.col("x") == 0, 1)).alias("cand"),
              F.count(F.when((F.col("x") == 0) & (F.col("j") >= cfg.threshold), 1)).alias("ok"),
              F.count(F.when(F.col("x") == 1, 1)).alias("x")).first()
    counts = {"cand": int(c["cand"]), "ver": int(c["ok"]) if cfg.verify else int(c["cand"]), "exact": int(c["x"])}
    edges = e.where((F.col("x") == 1) | (F.col("j") >= cfg.threshold)) if cfg.verify else e
    comps = _components(sig.sparkSession, edges, counts["exact"] + counts["ver"], cfg)[0]
    big = (comps.select(F.col("node").alias("idx"), F.col("root").alias("component"))
           .join(sig.select("idx", "len"), "idx")
           .withColumn("component_size", F.count("*").over(Window.partitionBy("component"))))
    if cfg.keeper == "cover":
        centres = edges.select(F.col("dst").alias("idx")).distinct()
        leaves = (edges.join(centres.select(F.col("idx").alias("src")), "src", "left_anti")
                  .groupBy("src").agg(F.max(F.struct(F.coalesce("j", F.lit(0.0)).alias("j"),
                                                     (-F.col("dst")).alias("nd"))).alias("b"))
                  .select(F.col("src").alias("idx"), (-F.col("b.nd")).alias("cluster")))
        pick = centres.select("idx", F.col("idx").alias("cluster")).unionByName(leaves)
    elif cfg.keeper == "longest":
        best = big.groupBy("component").agg(F.max(F.struct("len", (-F.col("idx")).alias("nidx"))).alias("b"))
        pick = big.join(best, "component").select("idx", (-F.col("b.nidx")).alias("cluster"))
    else:
        pick = big.select("idx", F.col("component").alias("cluster"))
    ex = sig.select("idx", F.col("keys")[0].alias("exact"))
    el = edges.select(F.col("src").alias("hi"), F.col("dst").alias("lo"), "j")
    out = (big.join(pick, "idx")
           .withColumn("cluster_size", F.count("*").over(Window.partitionBy("cluster")))
           .join(sig.select(F.col("idx").alias("cluster"), F.col("id").alias("dup_of_id"),
                            F.col("keys")[0].alias("k_exact")), "cluster")
           .join(ex, "idx")
           .join(el, (F.greatest("idx", "cluster") == F.col("hi")) & (F.least("idx", "cluster") == F.col("lo")), "left")
           .select("idx", "component", "component_size", "cluster", "cluster_size", "dup_of_id",
                   F.when(F.col("idx") == F.col("cluster"), F.lit(1.0)).otherwise(F.col("j")).alias("jaccard"),
                   (F.col("exact") == F.col("k_exact")).alias("exact_dup"),
                   *(F.lit(0).cast("long").alias(k) for k in ("n_cand", "n_verified", "n_exact"))))
    return out, counts, e


BUCKET_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: a bucket's hash is key XOR band × this (mod 2⁶⁴)


def bucket_entries(keys):
    """The bucket entries of a ``keys`` column (a pyarrow ListArray, one list per doc: the exact key, then the band
    keys) as numpy arrays, one entry per key: (band, key, row)."""
    lens = pc.list_value_length(keys).fill_null(0).to_numpy().astype(np.int64)
    key = keys.flatten().to_numpy().astype(np.int64)
    row = np.repeat(np.arange(len(lens)), lens)
    return np.arange(key.size) - np.repeat(np.cumsum(lens) - lens, lens), key, row


def bucket_hashes(keys):
    """:func:`bucket_entries` and each entry's 64-bit bucket hash: (hash, band, key, row). The hash only narrows the
    search: a match is a bucket whose band and key are both equal."""
    band, key, row = bucket_entries(keys)
    with np.errstate(over="ignore"):
        h = key.view(np.uint64) ^ (band.astype(np.uint64) * np.uint64(BUCKET_MIX))
    return h, band, key, row


def _new_buckets(sig) -> tuple[bytes, bytes, bytes, bytes]:
    """The buckets of ``sig``'s docs, collected on the driver and sorted by hash, as raw bytes (hash, band, key,
    idx): what each task of the corpus scan holds."""
    t = sig.select("idx", "keys").toArrow()
    h, band, key, row = bucket_hashes(t.column("keys").combine_chunks())
    idx = t.column("idx").to_numpy()[row]
    o = np.argsort(h, kind="stable")
    return h[o].tobytes(), band[o].tobytes(), key[o].tobytes(), idx[o].astype(np.int64).tobytes()


def _corpus_scan_fn(new, verify: bool):
    """mapPartitions body: pieces of the old corpus's signatures → (idx, old_id, x, b) rows, one per (new doc, old
    doc) pair sharing a bucket: ``x`` 1 when they share the exact band, ``b`` the old doc's shingle hashes (with
    ``verify``, for near pairs). The task reads the old keys itself (pyarrow) and reads the ids of its matching rows
    only, and their shingle sets only for a row group with a near pair."""
    def fn(pieces):
        nh, nband, nkey, nidx = (np.frombuffer(b, dt) for b, dt in
                                 zip(new.value, (np.uint64, np.int64, np.int64, np.int64)))
        for p in pieces:
            h, band, key, row = bucket_hashes(read_piece(p, ["keys"]).column(0).combine_chunks())
            o = np.argsort(h)  # sorted needles: each search starts where the last one ended
            lo, hi, hs = np.empty_like(o), np.empty_like(o), h[o]
            lo[o], hi[o] = np.searchsorted(nh, hs, "left"), np.searchsorted(nh, hs, "right")
            hit = np.flatnonzero(hi > lo)
            if not hit.size:
                continue
            lo, hi = lo[hit], hi[hit]
            n = hi - lo
            at = np.repeat(hit, n)
            pos = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n) + np.repeat(lo, n)
            ok = (nband[pos] == band[at]) & (nkey[pos] == key[at])
            if not ok.any():
                continue  # equal hashes of different buckets
            pairs = np.unique(np.stack([nidx[pos[ok]], row[at[ok]], (band[at[ok]] == 0)], 1), axis=0)
            pairs = pairs[np.r_[pairs[1:, :2] != pairs[:-1, :2], [[True, True]]].any(1)]  # max x per pair
            near = verify and bool((pairs[:, 2] == 0).any())  # only near pairs need the shingle sets
            got = read_piece(p, ["id", "sh"] if near else ["id"]).take(pa.array(pairs[:, 1]))
            ids, shs = got.column("id").to_pylist(), got.column("sh").to_pylist() if near else None
            for k, (i, _, x) in enumerate(pairs.tolist()):
                yield i, ids[k], x, None if x or not near else shs[k]
    return fn


def against_corpus(spark, sig, against: list[Path], cfg: DedupCfg, tasks: int, n_entries: int):
    """New docs that are duplicates of docs kept earlier (``against``: their persisted signatures ``id, keys, sh``):
    a new doc and an old one that share a bucket (band, key) are a candidate pair; the exact band (0) makes an exact
    duplicate, an LSH band a near one when its exact Jaccard ≥ ``threshold`` (with ``verify``; without it every
    candidate counts). Returns (idx, dup_of_id, reason, jaccard), one row per removed new doc: its most similar old
    doc (exact first, ties: the smallest id). Nothing of the old corpus is shingled again, shuffled or passed
    through the JVM: the new docs' buckets (``n_entries`` of them, sorted by hash) go to every task (in rounds of at
    most ``BROADCAST_KEYS``), each task reads its row groups of the old band keys with pyarrow and looks them up
    (binary search, the old hashes sorted first), and only the matching rows' ids, and the shingle sets of a row
    group with a near pair, are read."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    pieces = plan_pieces([g for p in against for g in row_groups(p, "keys")], tasks)
    if not pieces:
        return spark.createDataFrame([], "idx long, dup_of_id string, reason string, jaccard double")
    new = sig.where(F.col("keys").isNotNull())
    rounds = max(1, -(-n_entries // BROADCAST_KEYS))
    parts = []
    for r in range(rounds):
        b = spark.sparkContext.broadcast(_new_buckets(new.where(F.col("idx") % rounds == r)))
        rows = spark.sparkContext.parallelize(pieces, len(pieces)).mapPartitions(
            lambda it, fn=_corpus_scan_fn(b, cfg.verify): fn(p for ps in it for p in ps))
        parts.append(spark.createDataFrame(rows, "idx long, old_id string, x int, b binary"))
    pairs = parts[0]
    for more in parts[1:]:
        pairs = pairs.unionByName(more)
    pairs = pairs.localCheckpoint()  # few rows, read twice below: the old corpus is scanned once
    if cfg.verify:
        near = pairs.where(F.col("x") == 0)
        shs = sig.select("idx", F.col("sh").alias("a")).join(F.broadcast(near.select("idx").distinct()), "idx",
                                                              "left_semi")  # the new side unshuffled, filtered
        near = (near.join(shs, "idx")
                .where(F.col("a").isNotNull() & F.col("b").isNotNull())
                .select("idx", "old_id", "x", "a", "b")
                .mapInArrow(_pair_jaccard_fn, "idx long, old_id string, x int, j double")
                .where(F.col("j") >= cfg.threshold))
        pairs = pairs.where(F.col("x") == 1).select("idx", "old_id", "x", F.lit(1.0).alias("j")).unionByName(near)
    else:
        pairs = pairs.withColumn("j", F.when(F.col("x") == 1, F.lit(1.0)))
    order = Window.partitionBy("idx").orderBy(F.col("x").desc(), F.col("j").desc_nulls_last(), "old_id")
    best = pairs.withColumn("r", F.row_number().over(order)).where(F.col("r") == 1)
    return best.select("idx", F.col("old_id").alias("dup_of_id"),
                       F.when(F.col("x") == 1, F.lit("exact_duplicate_of_corpus"))
                       .otherwise(F.lit("near_duplicate_of_corpus")).alias("reason"), F.col("j").alias("jaccard"))


BROADCAST_KEYS = 8_000_000  # new buckets (hash, band, key, idx: 32 B each) sent to the corpus scan in one round


class _Phases:
    """Seconds per phase of a lazy Spark job (a phase is timed at its first action)."""

    def __init__(self):
        self.clock, self.marks = time.perf_counter, {}
        self.last = self.clock()

    def mark(self, label: str) -> None:
        now = self.clock()
        self.marks[label] = round(now - self.last, 3)
        self.last = now


def _assign(spark, sig, c: dict, cfg: DedupCfg, tasks: int) -> dict:
    """The keeper of every member of a candidate component (``c``: :func:`_candidates`; verification comes after, per
    component): small components whole in one Python pass, big ones in Spark joins."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    members = c["members"].persist(StorageLevel.MEMORY_AND_DISK)
    got = members.agg(F.max("n").alias("largest"), F.count("*").alias("members")).first()
    largest_cc, n_members = int(got["largest"] or 0), int(got["members"] or 0)
    big_e, counts = None, {"cand": 0, "ver": 0, "exact": 0}
    if largest_cc > cfg.cover_max_cluster:
        small = members.where(F.col("n") <= cfg.cover_max_cluster).drop("n")
        assign = _small_assign(small, n_members, sig, cfg, tasks)
        cand = c["cand"] if c["cand"] is not None else star_edges(sig)
        big, counts, big_e = _big_assign(members.where(F.col("n") > cfg.cover_max_cluster).drop("n"), sig, cand, cfg)
        assign = assign.unionByName(big)
    else:
        assign = _small_assign(members.drop("n"), n_members, sig, cfg, tasks)
    return {"assign": assign, "members": members, "big_edges": big_e, "n_members": n_members, "big_counts": counts,
            "largest_cc": largest_cc}


def _side(df, rows: int):
    from pyspark.sql import functions as F

    return F.broadcast(df) if rows <= o.BROADCAST_ROWS else df


def _side_table(assign, old_rem):
    """Every member's assignment and every doc removed against the corpus, in the columns of ``o.SIDE_DDL``."""
    from pyspark.sql import functions as F

    side = assign.withColumn("against", F.lit(None).cast("string"))
    if old_rem is None:
        return side
    return side.unionByName(old_rem.select(*(F.col(f.name) if f.name in ("idx", "dup_of_id", "jaccard") else
                                             F.col("reason").alias(f.name) if f.name == "against" else
                                             F.lit(None).cast(side.schema[f.name].dataType).alias(f.name)
                                             for f in o.SIDE)))


def dedup_docs(spark, docs_path: Path, out: Path, cfg: DedupCfg, against: list[Path] = (), tasks: int = 0) -> dict:
    """Run the dedup job on ``docs_path`` (parquet with idx, id, text, source); write under ``out``. ``against``:
    the persisted signatures of docs kept earlier; a doc that duplicates one of them is removed first
    (:func:`against_corpus`), and the rest are deduplicated among themselves. ``tasks``: Spark tasks for the
    signature, keeper and output passes (0: the executors' parallelism).

    The docs are read twice, by the tasks of the signature pass and of the output pass
    (``pipelines.data.dedup_outputs``), never through the JVM. Only the docs that share a bucket with another (the
    *members*) go through components, keepers and Jaccard scoring. ``stats["seconds"]`` times each phase:
    ``signatures``, ``against_corpus`` (with ``against``), ``components`` (candidate edges and their components),
    ``keepers`` (verification, keepers, the side table) and ``write`` (the four outputs and the counts).
    """
    import pyarrow.dataset as pds
    from pyspark import StorageLevel

    clock, persisted = _Phases(), []
    bands, rows = effective_bands_rows(cfg)
    tasks = tasks or spark.sparkContext.defaultParallelism
    pieces = plan_pieces(row_groups(docs_path, "text"), tasks)
    try:
        s = o.signature_pass(spark, pieces, out, _signature_fn(cfg.ngram, cfg.num_perm, cfg.seed, bands, rows))
        sig_all = spark.read.schema(SIG_SCHEMA).parquet(str(s["dir"]))
        clock.mark("signatures")
        sig, old_rem, n_against = sig_all, None, 0
        if against:
            old_rem = against_corpus(spark, sig_all, against, cfg, tasks, s["entries"]).persist(
                StorageLevel.MEMORY_AND_DISK)
            persisted.append(old_rem)
            n_against = old_rem.count()
            sig = sig_all.join(old_rem.select("idx"), "idx", "left_anti")
            clock.mark("against_corpus")
        c = _candidates(spark, sig, s["entries"], cfg)
        persisted += c["persisted"]
        a = _assign(spark, sig, c, cfg, tasks)
        persisted += [a["members"], a["big_edges"]]
        clock.mark("components")
        n_side = o.write_side(_side_table(a["assign"], old_rem), a["n_members"] + n_against, out / o.WORK / "side",
                              tasks)
        clock.mark("keepers")
        kept = pds.dataset(str(docs_path), format="parquet").schema.remove_metadata()
        t = o.output_pass(spark, pieces, s["spans"], out, kept, out / o.WORK / "side")
        clock.mark("write")
    finally:
        for df in persisted:
            if df is not None:
                df.unpersist()
        shutil.rmtree(out / o.WORK, ignore_errors=True)
    if ((t["docs"], t["side"], t["removed"]) != (s["docs"], n_side, sum(t["reason"].values()) + n_against)
            or not n_against <= n_side <= a["n_members"] + n_against):
        raise StageError(f"dedup's output pass read {t['docs']} of {s['docs']} docs and matched {t['side']} of "
                         f"{n_side} assignments, removing {t['removed']}: a task's output is missing")
    stats = _stats(t, a, c, cfg, n_against) | {"seconds": clock.marks}
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    plot_cluster_sizes({int(k): v for k, v in stats["cluster_size_hist"].items()}, out / "cluster_sizes.png",
                       stats["bands"], stats["rows"])
    return stats


def _stats(t: dict, a: dict, c: dict, cfg: DedupCfg, n_against: int) -> dict:
    """``stats.json`` of a dedup job from the output pass's counts ``t``, the assignment ``a`` and the candidates
    ``c``."""
    bands, rows = effective_bands_rows(cfg)
    n_in, n_removed, bc = t["docs"], t["removed"], a["big_counts"]
    e = {k: t[f"n_{n}"] + bc[k] for k, n in (("cand", "cand"), ("ver", "verified"), ("exact", "exact"))}
    hist = {int(k): v for k, v in t["cluster_hist"].items()}
    comp_hist = {int(k): v for k, v in t["component_hist"].items()}
    return {
        "docs_in": n_in, "kept": n_in - n_removed, "removed": n_removed, "no_shingles": n_in - t["shingled"],
        "removed_against": n_against, "removed_exact": t["reason"].get(o.EXACT, 0),
        "removed_near": t["reason"].get(o.NEAR, 0), "candidate_edges": e["cand"],
        "verified_edges": e["ver"], "rejected_edges": e["cand"] - e["ver"],
        "exact_edges": e["exact"], "edges": e["exact"] + e["ver"],
        "clusters_multi": sum(hist.values()), "largest_cluster": max(hist) if hist else 1, "cc_rounds": c["rounds"],
        "cc_mode": c["cc_mode"], "largest_candidate_component": a["largest_cc"], "keeper": cfg.keeper,
        "components_multi": sum(comp_hist.values()), "largest_component": max(comp_hist) if comp_hist else 1,
        "bands": bands, "rows": rows, "num_perm": cfg.num_perm, "ngram": cfg.ngram, "threshold": cfg.threshold,
        "lsh_threshold": lsh_threshold(cfg), "s_curve": s_curve_report(lsh_threshold(cfg), bands, rows),
        "cluster_size_hist": {str(k): v for k, v in sorted(hist.items())},
    }


def s_curve_report(threshold: float, bands: int, rows: int) -> dict:
    """Why these bands × rows: the S-curve's error areas around the threshold and a few points on it."""
    fp = integrate(lambda s: candidate_probability(s, bands, rows), 0.0, threshold)
    fn = integrate(lambda s: 1 - candidate_probability(s, bands, rows), threshold, 1.0)
    return {"false_positive_area": round(fp, 5), "false_negative_area": round(fn, 5),
            "steepest_point": round(threshold_point(bands, rows), 4),
            "p_candidate": {str(j): round(float(candidate_probability(j, bands, rows)), 4)
                            for j in (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)},
            "why": f"bands×rows={bands}×{rows} minimises 0.5·FP + 0.5·FN area of P(candidate|J) = "
                   f"1-(1-J^{rows})^{bands} around J={threshold} with {bands * rows} of the permutations; "
                   "with verification on, the LSH is tuned below the dedup threshold for recall and each "
                   "candidate pair's exact Jaccard decides"}


def plot_cluster_sizes(hist: dict[int, int], path: Path, bands: int, rows: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if hist:
        xs = sorted(hist)
        ax.bar([str(x) for x in xs], [hist[x] for x in xs], color="#3a7ebf")
    else:
        ax.text(0.5, 0.5, "no duplicate clusters", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("cluster size (docs)")
    ax.set_ylabel("clusters")
    ax.set_title(f"Near-duplicate clusters (MinHash LSH {bands}×{rows})")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def minhash_settings(cfg: DedupCfg) -> dict:
    """What a doc's band keys and shingle hashes depend on: two results can be compared only when these agree."""
    bands, rows = effective_bands_rows(cfg)
    return {"ngram": cfg.ngram, "num_perm": cfg.num_perm, "seed": cfg.seed, "bands": bands, "rows": rows}


def check_same_minhash(cfg: DedupCfg, against: list[Manifest]) -> None:
    """Refuse earlier results whose signatures were built with other MinHash settings: their band keys would be
    compared position by position with keys of another meaning, and only exact copies would be caught."""
    ours = minhash_settings(cfg)
    for m in against:
        theirs = m.extra.get("minhash")
        if theirs is None and (m.extra.get("bands"), m.extra.get("rows")) == (ours["bands"], ours["rows"]):
            print(f"dedup: warning: --against-manifest {m.path} records only bands×rows (an older version); "
                  "assuming its ngram, num_perm and seed are these", flush=True)
            continue
        if theirs != ours:
            what = ("records no MinHash settings (made by an older version)" if theirs is None else
                    "was built with " + ", ".join(f"{k}={theirs.get(k)}" for k in ours))
            raise StageError(f"--against-manifest {m.path} {what}; this dedup uses "
                             + ", ".join(f"{k}={v}" for k, v in ours.items())
                             + ": set data.dedup to the same settings, or re-run that dedup with these")


def run(spec: JobSpec, ingest: Manifest, out_dir: str | None = None, spark=None,
        against: list[Manifest] = ()) -> Manifest:
    """Dedup the ingest's docs; ``against``: earlier dedup results whose kept docs the new ones are checked against
    (through the signatures they persisted)."""
    cfg = spec.data.dedup
    for m in against:
        if m.stage != "dedup" or "signatures" not in {o["name"] for o in m.outputs}:
            raise StageError(f"--against-manifest {m.path}: not a dedup result with persisted signatures "
                             "(re-run that dedup with this version)")
    check_same_minhash(cfg, against)
    sd = stage_dir(spec, "dedup", [input_ref(ingest), *(input_ref(m) for m in against)], out_dir)

    def body(tmp: Path) -> Manifest:
        from pipelines.data.spark import spec_session

        s = spark or spec_session(spec, "llm-pipeline-dedup")
        docs = ingest.output("docs")
        tasks = task_count(s, dir_bytes(docs), spec.data.task_mb, cfg.partitions)
        size_shuffles(s, tasks)
        stats = dedup_docs(s, docs, tmp, cfg, [m.output("signatures") for m in against], tasks)
        counts = {k: stats[k] for k in ("docs_in", "kept", "removed", "removed_exact", "removed_near",
                                        "removed_against", "no_shingles", "candidate_edges", "verified_edges",
                                        "rejected_edges", "clusters_multi", "largest_cluster")}
        return sd.commit(
            {"clusters": "clusters", "kept": "kept", "removed": "removed", "signatures": "signatures",
             "stats": "stats.json", "cluster_sizes_plot": "cluster_sizes.png"},
            counts=counts, metrics={"cc_rounds": stats["cc_rounds"]},
            extra={"bands": stats["bands"], "rows": stats["rows"], "cluster_size_hist": stats["cluster_size_hist"],
                   "removed_against": stats["removed_against"], "tasks": tasks,
                   "against": [m.path for m in against], "minhash": minhash_settings(cfg)},
        )

    return run_and_log(spec, sd, body, artifacts=["cluster_sizes_plot", "stats"])


def summary(m: Manifest) -> str:
    c = m.counts
    against = (f", {c['removed_against']} of them duplicates of the {len(m.extra['against'])} earlier result(s)"
               if m.extra.get("against") else "")
    return (f"dedup: {c['docs_in']} docs → {c['kept']} kept, {c['removed']} removed as duplicates "
            f"({c['removed_exact']} exact, {c['removed_near']} near{against}) "
            f"({c['clusters_multi']} clusters, largest {c['largest_cluster']}, {c['no_shingles']} too short to "
            f"shingle); clusters at {m.output('clusters')}; manifest {m.path}")


def _options(ap) -> None:
    ap.add_argument("--input", help="JSONL (plain/.gz/.zst) with a text field; an 'id' field is preserved. "
                                    "Instead of --ingest-manifest: ingested first under run.root, bad lines quarantined.")
    ap.add_argument("--threshold", type=float, default=None,
                    help="Jaccard threshold: picks bands × rows minimising FP+FN area of the S-curve.")
    ap.add_argument("--num-perm", type=int, default=None, help="Number of MinHash permutations (default 128).")
    ap.add_argument("--ngram", type=int, default=None, help="Word n-gram size (default 5).")
    add_corpus_arg(ap)
    ap.add_argument("--against-manifest", action="append", default=[], metavar="MANIFEST",
                    help="A dedup manifest of docs already in the corpus (repeatable): new docs that are near-"
                         "duplicates of its kept docs are removed (through its persisted signatures); its docs are "
                         "not emitted again.")


def _call(spec: JobSpec, args, ups) -> Manifest:
    for key in ("threshold", "num_perm", "ngram"):
        if getattr(args, key) is not None:
            setattr(spec.data.dedup, key, getattr(args, key))
    if bool(args.input) == bool(args.ingest_manifest):
        raise StageError("give exactly one of --ingest-manifest (an ingest manifest) and --input (a JSONL file)")
    against = [manifest_arg("--against-manifest", p) for p in args.against_manifest]
    corpus = corpus_arg(args)
    if corpus is not None:  # the dedup results of every earlier version
        against += [manifest_arg(f"--corpus-manifest {corpus.path}: its dedup", p)
                    for p in corpus.extra.get("corpus", {}).get("dedup", [])]
    if args.ingest_manifest:
        return run(spec, *upstream_manifests(STAGE, args), out_dir=args.output, against=against)
    from pipelines.data import ingest as ingest_mod

    spec.data.inputs = [args.input if args.input.startswith("s3://") else os.path.abspath(args.input)]
    ing = ingest_mod.run(spec)  # content-addressed under run.root
    print(f"dedup: ingested {ing.counts['docs']} docs, {ing.counts['quarantined']} quarantined "
          f"({ing.output('quarantine')})")
    return run(spec, ing, out_dir=args.output, against=against)


def main(argv: list[str] | None = None) -> int:
    return stage_main("dedup", run, summary, argv, add_args=_options, call=_call, inputs_required=False)


if __name__ == "__main__":
    sys.exit(main())
