"""Near-duplicate removal on Spark: MinHash → LSH bands → star edges → connected components.

Pipeline (all on executors; the driver only plans and counts):

1. ``mapInArrow`` over the docs: normalise, word n-gram shingles, 64-bit-safe MinHash signature,
   one 64-bit key per band (``pipelines.data.minhash``), plus one exact key (hash of the whole
   normalised text). Docs too short to shingle get only the exact key: they can be exact
   duplicates but are never near-duplicate candidates.
2. ``groupBy(band, key)``: every bucket with ≥ 2 docs becomes a *star*: each member → the
   bucket's smallest ``idx``. Edges are deduplicated; no all-pairs expansion.
   With ``dedup.verify`` (default on) each LSH-only candidate edge is kept only if the exact
   Jaccard of the two shingle-hash sets is ≥ ``threshold`` (``array_intersect`` in Spark, no Python
   UDF); the manifest counts ``candidate_edges``, ``verified_edges``, ``rejected_edges``.
3. Connected components on Spark (large-star / small-star, ``pipelines.data.spark``).
4. Keeper policy (``dedup.keeper``), per connected component:
   ``cover`` (default): a greedy dominating set of the component's similarity graph (all pairs
   compared on exact Jaccard — whatever ``verify`` says — for components up to
   ``cover_max_cluster`` docs, one Python pass per partition; above that every star centre is kept), so every removed doc has a kept doc with J ≥ threshold, which is
   its ``dup_of``; ``min_idx``: the earliest doc; ``longest``: the longest text (ties: earliest).

Outputs under the stage directory (parquet dirs, part files renamed ``part-NNNNN.parquet``):

* ``clusters/``: ``idx``, ``id``, ``cluster`` (the idx of the kept doc this doc belongs to; a kept
  doc's own idx), ``cluster_size``, ``component`` (smallest idx of its connected component of
  duplicate edges), ``component_size``
* ``kept/``: the docs kept (``idx, id, text, source``)
* ``removed/``: the docs removed, plus ``dup_of`` (idx), ``dup_of_id``, ``reason``
  (``exact_duplicate`` / ``near_duplicate``) and ``jaccard`` (to ``dup_of``)
* ``stats.json`` and ``cluster_sizes.png`` (histogram of cluster sizes > 1)

Skew: a bucket with millions of members costs an aggregation (its minimum, combined map-side) and a
join against one row per bucket, so it streams through one task without buffering its members;
adaptive query execution splits skewed join partitions. Only components up to
``cover_max_cluster`` docs are ever gathered in one place.

Run standalone: ``python -m pipelines.data.dedup --input IN.jsonl --output DIR`` (ingests the JSONL
first under ``run.root``, so malformed lines are quarantined, not lost), or under spark-submit:
``spark-submit --master M pipelines/spark_entry.py pipelines.data.dedup …``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from pipelines.cli import run_and_log, stage_parser
from pipelines.manifest import Manifest, StageDir, input_ref, load_manifest, write_report
from pipelines.spec import DedupCfg, JobSpec, resolve_path, spec_from_args


def lsh_threshold(cfg: DedupCfg) -> float:
    if cfg.lsh_threshold is not None:
        return cfg.lsh_threshold
    return max(0.05, cfg.threshold - 0.2) if cfg.verify else cfg.threshold


def effective_bands_rows(cfg: DedupCfg) -> tuple[int, int]:
    """Explicit bands × rows, else the pair that minimises FP+FN area at the LSH threshold."""
    if cfg.bands is not None:
        return cfg.bands, cfg.rows
    from pipelines.data.minhash import optimal_bands_rows

    b, r, _, _ = optimal_bands_rows(round(lsh_threshold(cfg), 4), cfg.num_perm)
    return b, r


EXACT_BAND = -1
SIG_SCHEMA = "idx long, id string, len int, exact long, keys array<long>, sh array<int>"


def _signature_fn(ngram: int, num_perm: int, seed: int, bands: int, rows: int):
    """mapInArrow body: (idx, id, text) batches → one row per doc: (idx, id, len, exact, keys, sh).

    ``exact``: a 64-bit hash of the whole normalised text (exact duplicates meet on it, even docs
    too short to shingle); ``keys``: the b LSH band keys (null when the doc has no shingles);
    ``sh``: the distinct 32-bit shingle hashes (as int32), for exact-Jaccard verification;
    ``len``: the raw text's length (the ``longest`` keeper policy).
    Docs whose normalised text is empty emit nothing.
    """
    def fn(batches):
        import hashlib

        import numpy as np
        import pyarrow as pa

        from pipelines.data.minhash import band_keys_batch, normalize, permutations, shingle_hash_batch, signatures_flat

        a, b = permutations(num_perm, seed)
        for rb in batches:
            idxs = rb.column(0).to_numpy(zero_copy_only=False)
            raw = rb.column(2).to_pylist()
            norms = [normalize(t or "") for t in raw]
            live = np.flatnonzero([bool(t) for t in norms])
            if not live.size:
                continue
            norms = [norms[k] for k in live]
            exact = [int.from_bytes(hashlib.sha1(t.encode()).digest()[:8], "little", signed=True) for t in norms]
            x, s_off = shingle_hash_batch(norms, ngram)
            sizes = np.diff(s_off)
            has = sizes > 0
            sig = signatures_flat(x, np.concatenate((s_off[:-1][has], s_off[-1:])), a, b)
            keys = band_keys_batch(sig, bands, rows)
            null = pa.array(~has)
            k_off = np.zeros(len(norms) + 1, dtype=np.int32)
            np.cumsum(np.where(has, bands, 0), out=k_off[1:])
            yield pa.RecordBatch.from_arrays(
                [pa.array(idxs[live], pa.int64()), rb.column(1).take(pa.array(live)),
                 pa.array([len(raw[k] or "") for k in live], pa.int32()), pa.array(exact, pa.int64()),
                 pa.ListArray.from_arrays(pa.array(k_off), pa.array(keys.reshape(-1)), mask=null),
                 pa.ListArray.from_arrays(pa.array(s_off.astype(np.int32)),
                                          pa.array(x.astype(np.uint32).view(np.int32)), mask=null)],
                names=["idx", "id", "len", "exact", "keys", "sh"])
    return fn


def _star_edges(bk):
    """Each bucket (band, key) with ≥ 2 members → edges member → bucket minimum (repeats across
    bands are left in: the caller deduplicates all stars in one aggregation)."""
    from pyspark.sql import functions as F

    roots = (bk.groupBy("band", "key").agg(F.min("idx").alias("root"), F.count("*").alias("n"))
             .where(F.col("n") > 1).select("band", "key", "root"))
    return (bk.join(roots, ["band", "key"]).where(F.col("idx") != F.col("root"))
            .select(F.col("idx").alias("src"), F.col("root").alias("dst")))


def jaccard_matrix(exact, shs):
    """All-pairs exact Jaccard of one component's members (identical normalised text: 1.0)."""
    import numpy as np

    n = len(exact)
    jm = np.eye(n)
    for i in range(n):
        for j in range(i + 1, n):
            if exact[i] == exact[j]:
                jac = 1.0
            elif shs[i] is None or shs[j] is None:
                jac = 0.0
            else:
                inter = np.intersect1d(shs[i], shs[j], assume_unique=True).size
                jac = inter / (shs[i].size + shs[j].size - inter)
            jm[i, j] = jm[j, i] = jac
    return jm


def greedy_cover(jm, threshold: float):
    """Positions of the keeper of each member: a greedy dominating set of the graph J ≥ threshold.

    Greedy: keep the member whose closed neighbourhood covers the most still-uncovered members (ties:
    the earliest position); at the end every removed member goes to the kept neighbour it is most
    similar to. Every removed doc thus has a kept doc with J ≥ threshold.
    """
    import numpy as np

    adj = jm >= threshold
    np.fill_diagonal(adj, True)
    n = adj.shape[0]
    kept = np.zeros(n, dtype=bool)
    uncovered = np.ones(n, dtype=bool)
    while uncovered.any():
        k = int(np.argmax((adj & uncovered[None, :]).sum(axis=1)))  # first maximum = earliest
        kept[k] = True
        uncovered &= ~adj[k]
    keeper = np.arange(n)
    for m in np.flatnonzero(~kept):
        cands = np.flatnonzero(kept & adj[m])
        keeper[m] = cands[np.argmax(jm[m, cands])]
    return keeper


def choose_keepers(policy: str, threshold: float, idx, lens, exact, shs):
    """One component (members sorted by idx) → (keeper position, Jaccard to it) for each member."""
    import numpy as np

    jm = jaccard_matrix(exact, shs)
    if policy == "cover":
        keeper = greedy_cover(jm, threshold)
    elif policy == "longest":
        keeper = np.full(len(idx), int(np.lexsort((idx, -np.asarray(lens)))[0]))
    else:  # min_idx
        keeper = np.zeros(len(idx), dtype=np.int64)
    return keeper, jm[np.arange(len(idx)), keeper]


ASSIGN_SCHEMA = ("idx long, component long, component_size long, cluster long, cluster_size long, "
                 "dup_of_id string, jaccard double, exact_dup boolean")


def _assign_fn(policy: str, threshold: float):
    """mapInArrow body over members (component, component_size, idx, id, len, exact, sh) partitioned
    and sorted by (component, idx): :func:`choose_keepers` per component, plus cluster sizes and the
    keeper's id. One Python call per partition, not per component; a component that straddles two
    Arrow batches is carried over to the next."""
    def fn(batches):
        import numpy as np
        import pyarrow as pa

        def emit(t):
            comp = t.column("component").to_numpy()
            idx = t.column("idx").to_numpy()
            ids = t.column("id").to_pylist()
            lens = t.column("len").to_numpy()
            exact = t.column("exact").to_numpy()
            sh = t.column("sh").to_pylist()
            starts = np.flatnonzero(np.r_[True, comp[1:] != comp[:-1]])
            ends = np.r_[starts[1:], len(comp)]
            keep = np.empty(len(comp), dtype=np.int64)
            jac = np.empty(len(comp))
            csize = np.empty(len(comp), dtype=np.int64)
            for a, e in zip(starts, ends):
                shs = [None if x is None else np.asarray(x, dtype=np.int32) for x in sh[a:e]]
                k, j = choose_keepers(policy, threshold, idx[a:e], lens[a:e], exact[a:e], shs)
                keep[a:e] = k + a
                jac[a:e] = j
                csize[a:e] = np.bincount(k, minlength=e - a)[k]
            return pa.RecordBatch.from_arrays(
                [pa.array(idx), pa.array(comp), t.column("component_size").combine_chunks(),
                 pa.array(idx[keep]), pa.array(csize), pa.array([ids[k] for k in keep], pa.string()),
                 pa.array(jac), pa.array(exact == exact[keep])], schema=pa.schema([
                    ("idx", pa.int64()), ("component", pa.int64()), ("component_size", pa.int64()),
                    ("cluster", pa.int64()), ("cluster_size", pa.int64()), ("dup_of_id", pa.string()),
                    ("jaccard", pa.float64()), ("exact_dup", pa.bool_())]))

        carry = None
        for rb in batches:
            t = pa.Table.from_batches([rb])
            if carry is not None:
                t = pa.concat_tables([carry, t])
            if t.num_rows == 0:
                continue
            comp = t.column("component").to_numpy()
            last = int(np.flatnonzero(comp == comp[-1])[0])  # the last component may go on in the next batch
            carry = t.slice(last)
            if last:
                yield emit(t.slice(0, last))
        if carry is not None and carry.num_rows:
            yield emit(carry)
    return fn


def _assign(members, sig, edges, cfg: DedupCfg):
    """Keeper of every member: (idx, component, component_size, cluster, cluster_size, dup_of_id,
    jaccard, exact_dup). Components up to ``cover_max_cluster`` docs go, whole, through one Python
    pass per partition (:func:`choose_keepers`); larger ones stay in joins and aggregations, so no
    giant component ever sits on one task: ``cover`` keeps every verified star centre and removes
    each other member next to its most similar centre, ``min_idx`` keeps the component's root,
    ``longest`` its longest text. There ``jaccard`` comes from the verified edge to the keeper (null
    when the keeper is not a direct neighbour, possible only with min_idx/longest)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    w = Window.partitionBy("component")
    m = (members.join(sig.select("idx", "id", "len", "exact", "sh"), "idx")
         .withColumn("component_size", F.count("*").over(w)))
    small = (m.where(F.col("component_size") <= cfg.cover_max_cluster)
             .repartition("component").sortWithinPartitions("component", "idx")
             .select("component", "component_size", "idx", "id", "len", "exact", "sh")
             .mapInArrow(_assign_fn(cfg.keeper, cfg.threshold), ASSIGN_SCHEMA))
    big = m.where(F.col("component_size") > cfg.cover_max_cluster).select("idx", "component", "component_size",
                                                                          "len")
    if cfg.keeper == "cover":
        centres = edges.select(F.col("dst").alias("idx")).distinct().join(big.select("idx"), "idx")
        leaves = (edges.join(big.select(F.col("idx").alias("src")), "src")
                  .join(centres.select(F.col("idx").alias("src")), "src", "left_anti")
                  .groupBy("src").agg(F.max(F.struct(F.coalesce("j", F.lit(0.0)).alias("j"),
                                                     (-F.col("dst")).alias("nd"))).alias("b"))
                  .select(F.col("src").alias("idx"), (-F.col("b.nd")).alias("cluster")))
        pick = centres.select("idx", F.col("idx").alias("cluster")).unionByName(leaves)
    elif cfg.keeper == "longest":
        best = big.groupBy("component").agg(F.max(F.struct("len", (-F.col("idx")).alias("nidx"))).alias("b"))
        pick = big.join(best, "component").select("idx", (-F.col("b.nidx")).alias("cluster"))
    else:
        pick = big.select("idx", F.col("component").alias("cluster"))
    e = edges.select(F.col("src").alias("hi"), F.col("dst").alias("lo"), "j")
    big_assign = (big.join(pick, "idx")
                  .withColumn("cluster_size", F.count("*").over(Window.partitionBy("cluster")))
                  .join(sig.select(F.col("idx").alias("cluster"), F.col("id").alias("dup_of_id"),
                                   F.col("exact").alias("k_exact")), "cluster")
                  .join(sig.select("idx", "exact"), "idx")
                  .join(e, (F.greatest("idx", "cluster") == F.col("hi")) & (F.least("idx", "cluster") == F.col("lo")),
                        "left")
                  .select("idx", "component", "component_size", "cluster", "cluster_size", "dup_of_id",
                          F.when(F.col("idx") == F.col("cluster"), F.lit(1.0)).otherwise(F.col("j")).alias("jaccard"),
                          (F.col("exact") == F.col("k_exact")).alias("exact_dup")))
    return small.unionByName(big_assign)


def _finalize_parquet_dir(d: Path) -> None:
    """Drop Spark's _SUCCESS/.crc files and give part files stable names."""
    for f in list(d.iterdir()):
        if f.name == "_SUCCESS" or f.name.endswith(".crc"):
            f.unlink()
    parts = sorted(f for f in d.iterdir() if f.name.startswith("part-"))
    for n, f in enumerate(parts):
        f.rename(d / f"part-{n:05d}.parquet")


def dedup_docs(spark, docs_path: Path, out: Path, cfg: DedupCfg) -> dict:
    """Run the dedup job on ``docs_path`` (parquet with idx, id, text, source); write under ``out``.

    Only the docs that have a duplicate edge (the *members*) go through components, keepers and
    Jaccard scoring; the full corpus is touched by the signature pass and the three output joins.
    ``stats["seconds"]`` times each phase (Spark is lazy: a phase is timed at its first action).
    """
    import time

    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    from pipelines.data.spark import connected_components

    marks: dict[str, float] = {}
    t_last = [time.perf_counter()]

    def mark(label: str) -> None:
        now = time.perf_counter()
        marks[label] = round(now - t_last[0], 3)
        t_last[0] = now

    bands, rows = effective_bands_rows(cfg)
    docs = spark.read.parquet(str(docs_path))
    sig = (docs.select("idx", "id", "text").repartition(cfg.partitions)
           .mapInArrow(_signature_fn(cfg.ngram, cfg.num_perm, cfg.seed, bands, rows), SIG_SCHEMA)
           .persist(StorageLevel.MEMORY_AND_DISK))
    n_shingled = sig.where(F.col("keys").isNotNull()).count()
    n_in = docs.count()
    mark("signatures")

    # Candidate edges: stars of the exact-text buckets (x = 1, J = 1 by definition) and of the LSH band
    # buckets, deduplicated in one aggregation; only LSH-only edges need verifying.
    exact_star = _star_edges(sig.select("idx", F.lit(EXACT_BAND).alias("band"), F.col("exact").alias("key")))
    lsh_star = _star_edges(sig.where(F.col("keys").isNotNull())
                           .select("idx", F.posexplode("keys").alias("band", "key")))
    cand = (exact_star.withColumn("x", F.lit(1)).unionByName(lsh_star.withColumn("x", F.lit(0)))
            .groupBy("src", "dst").agg(F.max("x").alias("x")))
    if cfg.verify:
        # Exact Jaccard of each LSH-only pair on the shingle-hash sets, natively in Spark.
        shs = sig.where(F.col("sh").isNotNull()).select("idx", "sh")
        near = (cand.where(F.col("x") == 0)
                .join(shs.select(F.col("idx").alias("src"), F.col("sh").alias("a")), "src")
                .join(shs.select(F.col("idx").alias("dst"), F.col("sh").alias("b")), "dst")
                .withColumn("i", F.size(F.array_intersect("a", "b")))
                .select("src", "dst", "x", (F.col("i") / (F.size("a") + F.size("b") - F.col("i"))).alias("j")))
        scored = cand.where(F.col("x") == 1).withColumn("j", F.lit(1.0)).unionByName(near)
    else:
        scored = cand.withColumn("j", F.when(F.col("x") == 1, F.lit(1.0)))
    scored = scored.persist(StorageLevel.MEMORY_AND_DISK)
    c = scored.agg(F.count(F.when(F.col("x") == 0, 1)).alias("cand"),
                   F.count(F.when((F.col("x") == 0) & (F.col("j") >= cfg.threshold), 1)).alias("ok"),
                   F.sum("x").alias("x")).first()
    n_cand, n_exact_edges = int(c["cand"]), int(c["x"] or 0)
    n_verified = int(c["ok"]) if cfg.verify else n_cand
    edges = (scored.where((F.col("x") == 1) | (F.col("j") >= cfg.threshold)) if cfg.verify else scored)
    n_edges = n_exact_edges + n_verified
    mark("candidates_verify")

    if n_edges:
        comps, rounds = connected_components(edges.select("src", "dst"))
    else:
        comps, rounds = spark.createDataFrame([], "node long, root long"), 0
    members = comps.select(F.col("node").alias("idx"), F.col("root").alias("component"))
    mark("components")

    assign = _assign(members, sig, edges, cfg).persist(StorageLevel.MEMORY_AND_DISK)
    # every small aggregate in one job: removals by reason, cluster-size and component-size histograms
    rem_reason = F.when(F.col("exact_dup"), F.lit("exact_duplicate")).otherwise(F.lit("near_duplicate"))
    agg = (assign.where(F.col("idx") != F.col("cluster"))
           .groupBy(F.lit("reason").alias("what"), rem_reason.alias("k")).count()
           .unionByName(assign.where(F.col("idx") == F.col("cluster"))
                        .groupBy(F.lit("cluster").alias("what"), F.col("cluster_size").cast("string").alias("k")).count())
           .unionByName(assign.where(F.col("idx") == F.col("component"))
                        .groupBy(F.lit("component").alias("what"),
                                 F.col("component_size").cast("string").alias("k")).count())
           .collect())
    by_reason = {r["k"]: int(r["count"]) for r in agg if r["what"] == "reason"}
    hist = {int(r["k"]): int(r["count"]) for r in agg if r["what"] == "cluster" and int(r["k"]) > 1}
    comp_hist = {int(r["k"]): int(r["count"]) for r in agg if r["what"] == "component"}
    mark("keepers")

    # Outputs keep the input's partitioning (no global sort): each part file sorted by idx.
    one = F.lit(1).cast("long")
    (docs.select("idx", "id").join(assign.drop("dup_of_id", "jaccard", "exact_dup"), "idx", "left")
     .select("idx", "id", F.coalesce("cluster", "idx").alias("cluster"),
             F.coalesce("cluster_size", one).alias("cluster_size"),
             F.coalesce("component", "idx").alias("component"),
             F.coalesce("component_size", one).alias("component_size"))
     .sortWithinPartitions("idx").write.parquet(str(out / "clusters")))
    rem = assign.where(F.col("idx") != F.col("cluster")).select(
        "idx", F.col("cluster").alias("dup_of"), "dup_of_id", rem_reason.alias("reason"), "jaccard")
    docs.join(rem.select("idx"), "idx", "left_anti").sortWithinPartitions("idx").write.parquet(str(out / "kept"))
    (docs.join(rem, "idx").select("idx", "id", "text", "source", "dup_of", "dup_of_id", "reason", "jaccard")
     .sortWithinPartitions("idx").write.parquet(str(out / "removed")))
    for d in ("clusters", "kept", "removed"):
        _finalize_parquet_dir(out / d)
    mark("write")

    n_removed = sum(by_reason.values())
    for df in (sig, scored, assign):
        df.unpersist()
    stats = {
        "docs_in": n_in, "kept": n_in - n_removed, "removed": n_removed, "no_shingles": n_in - n_shingled,
        "removed_exact": by_reason.get("exact_duplicate", 0), "removed_near": by_reason.get("near_duplicate", 0),
        "candidate_edges": n_cand, "verified_edges": n_verified, "rejected_edges": n_cand - n_verified,
        "exact_edges": n_exact_edges, "edges": n_edges, "clusters_multi": sum(hist.values()),
        "largest_cluster": max(hist) if hist else 1, "cc_rounds": rounds, "keeper": cfg.keeper,
        "components_multi": sum(comp_hist.values()), "largest_component": max(comp_hist) if comp_hist else 1,
        "bands": bands, "rows": rows, "num_perm": cfg.num_perm, "ngram": cfg.ngram, "threshold": cfg.threshold,
        "lsh_threshold": lsh_threshold(cfg), "s_curve": s_curve_report(lsh_threshold(cfg), bands, rows),
        "cluster_size_hist": {str(k): v for k, v in sorted(hist.items())},
        "seconds": marks,
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    plot_cluster_sizes(hist, out / "cluster_sizes.png", bands, rows)
    return stats


def s_curve_report(threshold: float, bands: int, rows: int) -> dict:
    """Why these bands × rows: the S-curve's error areas around the threshold and a few points on it."""
    from pipelines.data.minhash import _integrate, candidate_probability, threshold_point

    fp = _integrate(lambda s: candidate_probability(s, bands, rows), 0.0, threshold)
    fn = _integrate(lambda s: 1 - candidate_probability(s, bands, rows), threshold, 1.0)
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


def run(spec: JobSpec, ingest: Manifest, out_dir: str | None = None, spark=None) -> Manifest:
    cfg = spec.data.dedup
    sd = StageDir(resolve_path(spec.run.root), "dedup", spec.stage_hash("dedup"), [input_ref(ingest)],
                  force=spec.run.force, out_dir=out_dir)

    def body(tmp: Path) -> Manifest:
        from pipelines.data.spark import get_spark

        s = spark or get_spark(spec.services.spark_master, "llm-pipeline-dedup",
                               spec.services.spark_driver_memory, shuffle_partitions=cfg.partitions)
        stats = dedup_docs(s, ingest.output("docs"), tmp, cfg)
        counts = {k: stats[k] for k in ("docs_in", "kept", "removed", "removed_exact", "removed_near",
                                        "no_shingles", "candidate_edges", "verified_edges", "rejected_edges",
                                        "clusters_multi", "largest_cluster")}
        return sd.commit(
            {"clusters": "clusters", "kept": "kept", "removed": "removed", "stats": "stats.json",
             "cluster_sizes_plot": "cluster_sizes.png"},
            counts=counts, metrics={"cc_rounds": stats["cc_rounds"]},
            extra={"bands": stats["bands"], "rows": stats["rows"], "cluster_size_hist": stats["cluster_size_hist"]},
        )

    return run_and_log(spec, sd, body, artifacts=["cluster_sizes_plot", "stats"])


def main(argv: list[str] | None = None) -> int:
    ap = stage_parser("pipelines.data.dedup",
                      "MinHash-LSH near-duplicate removal on Spark. Give either --input-manifest (an ingest manifest, "
                      "as the DAG does) or --input JSONL (ingested first under run.root, bad lines quarantined).")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input-manifest", help="Manifest of the ingest stage.")
    src.add_argument("--input", help="JSONL (plain/.gz/.zst) with a text field; an 'id' field is preserved.")
    ap.add_argument("--threshold", type=float, default=None,
                    help="Jaccard threshold: picks bands × rows minimising FP+FN area of the S-curve.")
    ap.add_argument("--num-perm", type=int, default=None, help="Number of MinHash permutations (default 128).")
    ap.add_argument("--ngram", type=int, default=None, help="Word n-gram size (default 5).")
    args = ap.parse_args(argv)
    spec = spec_from_args(args)
    if args.threshold is not None:
        spec.data.dedup.threshold = args.threshold
    if args.num_perm is not None:
        spec.data.dedup.num_perm = args.num_perm
    if args.ngram is not None:
        spec.data.dedup.ngram = args.ngram
    if args.input:
        from pipelines.data import ingest as ingest_mod

        spec.data.inputs = [os.path.abspath(args.input)]
        try:
            ing = ingest_mod.run(spec)  # content-addressed under run.root
        except ingest_mod.IngestError as e:
            print(f"dedup: error: {e}", file=sys.stderr)
            return 2
        print(f"dedup: ingested {ing.counts['docs']} docs, {ing.counts['quarantined']} quarantined "
              f"({ing.output('quarantine')})")
        m = run(spec, ing, out_dir=args.output)
    else:
        m = run(spec, load_manifest(args.input_manifest), out_dir=args.output)
    write_report(args.report, m)
    c = m.counts
    print(f"dedup: {c['docs_in']} docs → {c['kept']} kept, {c['removed']} removed as duplicates "
          f"({c['removed_exact']} exact, {c['removed_near']} near) "
          f"({c['clusters_multi']} clusters, largest {c['largest_cluster']}, {c['no_shingles']} too short to "
          f"shingle); clusters at {m.output('clusters')}; manifest {m.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
