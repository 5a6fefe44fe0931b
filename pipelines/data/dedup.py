"""Near-duplicate removal on Spark: MinHash → LSH bands → star edges → connected components.

Pipeline (all on executors; the driver only plans and counts):

1. ``mapInArrow`` over the docs: normalise, word n-gram shingles, 64-bit-safe MinHash signature,
   one 64-bit key per band (``pipelines.data.minhash``), plus one exact key (hash of the whole
   normalised text). Docs too short to shingle get only the exact key: they can be exact
   duplicates but are never near-duplicate candidates.
2. ``groupBy(band, key)``: every bucket with ≥ 2 docs becomes a *star*: each member → the
   bucket's smallest ``idx``. Edges are deduplicated; no all-pairs expansion.
   With ``dedup.verify`` (default on) each LSH candidate edge is kept only if the exact Jaccard
   of the two shingle sets is ≥ ``threshold`` (``array_intersect``/``array_union`` in Spark, no
   Python UDF); the manifest counts ``candidate_edges``, ``verified_edges``, ``rejected_edges``.
3. Connected components on Spark (large-star / small-star, ``pipelines.data.spark``).
4. Keeper policy ``min_idx``: each cluster keeps its smallest ``idx`` (the earliest doc in input
   order); every other member is removed with ``dup_of`` = the keeper.

Outputs under the stage directory (parquet dirs, part files renamed ``part-NNNNN.parquet``):

* ``clusters/``: ``idx``, ``id``, ``cluster`` (keeper's idx; a singleton's own idx), ``cluster_size``
* ``kept/``: the docs kept (``idx, id, text, source``)
* ``removed/``: the docs removed, plus ``dup_of`` (idx), ``dup_of_id``, ``reason``
* ``stats.json`` and ``cluster_sizes.png`` (histogram of cluster sizes > 1)

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
SIG_SCHEMA = "idx long, exact long, keys array<long>, sh array<long>"


def _signature_fn(ngram: int, num_perm: int, seed: int, bands: int, rows: int):
    """mapInArrow body: (idx, text) batches → one row per doc: (idx, exact, keys, sh).

    ``exact``: a 64-bit hash of the whole normalised text (exact duplicates meet on it, even docs
    too short to shingle); ``keys``: the b LSH band keys (null when the doc has no shingles);
    ``sh``: the sorted distinct 32-bit shingle hashes, for exact-Jaccard verification.
    Docs whose normalised text is empty emit nothing.
    """
    def fn(batches):
        import hashlib

        import numpy as np
        import pyarrow as pa

        from pipelines.data.minhash import band_keys, hash_shingles, normalize, permutations, shingles, signature

        a, b = permutations(num_perm, seed)
        for rb in batches:
            idxs = rb.column(0).to_pylist()
            texts = rb.column(1).to_pylist()
            oi, oe, ok, osh = [], [], [], []
            for i, t in zip(idxs, texts):
                norm = normalize(t or "")
                if not norm:
                    continue
                oi.append(i)
                oe.append(int.from_bytes(hashlib.sha1(norm.encode()).digest()[:8], "little", signed=True))
                sh = shingles(norm, ngram)
                if sh:
                    hv = np.unique(hash_shingles(sh))
                    ok.append(band_keys(signature(hv, a, b), bands, rows))
                    osh.append(hv.astype(np.int64))
                else:
                    ok.append(None)
                    osh.append(None)
            if oi:
                yield pa.RecordBatch.from_arrays(
                    [pa.array(oi, pa.int64()), pa.array(oe, pa.int64()),
                     pa.array(ok, pa.list_(pa.int64())), pa.array(osh, pa.list_(pa.int64()))],
                    names=["idx", "exact", "keys", "sh"])
    return fn


def _star_edges(bk):
    """Each bucket (band, key) with ≥ 2 members → edges member → bucket minimum."""
    from pyspark.sql import functions as F

    roots = (bk.groupBy("band", "key").agg(F.min("idx").alias("root"), F.count("*").alias("n"))
             .where(F.col("n") > 1).select("band", "key", "root"))
    return (bk.join(roots, ["band", "key"]).where(F.col("idx") != F.col("root"))
            .select(F.col("idx").alias("src"), F.col("root").alias("dst")).distinct())


def _finalize_parquet_dir(d: Path) -> None:
    """Drop Spark's _SUCCESS/.crc files and give part files stable names."""
    for f in list(d.iterdir()):
        if f.name == "_SUCCESS" or f.name.endswith(".crc"):
            f.unlink()
    parts = sorted(f for f in d.iterdir() if f.name.startswith("part-"))
    for n, f in enumerate(parts):
        f.rename(d / f"part-{n:05d}.parquet")


def dedup_docs(spark, docs_path: Path, out: Path, cfg: DedupCfg) -> dict:
    """Run the dedup job on ``docs_path`` (parquet with idx, id, text, source); write under ``out``."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    from pipelines.data.spark import connected_components

    bands, rows = effective_bands_rows(cfg)
    docs = spark.read.parquet(str(docs_path))
    n_in = docs.count()
    sig = (docs.select("idx", "text").repartition(cfg.partitions)
           .mapInArrow(_signature_fn(cfg.ngram, cfg.num_perm, cfg.seed, bands, rows), SIG_SCHEMA)
           .persist(StorageLevel.MEMORY_AND_DISK))
    n_shingled = sig.where(F.col("keys").isNotNull()).count()
    exact_edges = _star_edges(sig.select("idx", F.lit(EXACT_BAND).alias("band"), F.col("exact").alias("key")))
    lsh = sig.where(F.col("keys").isNotNull()).select("idx", F.posexplode("keys").alias("band", "key"))
    cand = _star_edges(lsh).persist()
    n_cand = cand.count()
    if cfg.verify:
        # Exact Jaccard of each candidate pair on the shingle-hash sets, natively in Spark.
        shs = sig.where(F.col("sh").isNotNull()).select("idx", "sh")
        scored = (cand.join(shs.select(F.col("idx").alias("src"), F.col("sh").alias("a")), "src")
                  .join(shs.select(F.col("idx").alias("dst"), F.col("sh").alias("b")), "dst")
                  .withColumn("j", F.size(F.array_intersect("a", "b")) / F.size(F.array_union("a", "b"))))
        near = scored.where(F.col("j") >= cfg.threshold).select("src", "dst")
    else:
        near = cand
    edges = exact_edges.unionByName(near).distinct().persist()
    n_edges = edges.count()
    n_exact_edges = exact_edges.count()
    n_verified = near.count() if cfg.verify else n_cand
    if n_edges:
        comps, rounds = connected_components(edges)
    else:
        comps, rounds = spark.createDataFrame([], "node long, root long"), 0
    assign = (docs.select("idx", "id")
              .join(comps.select(F.col("node").alias("idx"), F.col("root").alias("cluster")), "idx", "left")
              .withColumn("cluster", F.coalesce("cluster", "idx")))
    sizes = assign.groupBy("cluster").agg(F.count("*").alias("cluster_size"))
    assign = assign.join(sizes, "cluster").select("idx", "id", "cluster", "cluster_size").persist()

    assign.orderBy("idx").write.parquet(str(out / "clusters"))
    keepers = assign.where(F.col("idx") == F.col("cluster")).select("idx")
    docs.join(keepers, "idx").orderBy("idx").write.parquet(str(out / "kept"))
    removed = (docs.join(assign.where(F.col("idx") != F.col("cluster")).select("idx", "cluster"), "idx")
               .join(docs.select(F.col("idx").alias("cluster"), F.col("id").alias("dup_of_id")), "cluster")
               .withColumnRenamed("cluster", "dup_of"))
    exact = sig.select("idx", F.col("exact").alias("key"))
    removed = (removed.join(exact, "idx", "left")
               .join(exact.select(F.col("idx").alias("dup_of"), F.col("key").alias("dup_key")), "dup_of", "left")
               .withColumn("reason", F.when(F.col("key") == F.col("dup_key"), F.lit("exact_duplicate"))
                           .otherwise(F.lit("near_duplicate")))
               .select("idx", "id", "text", "source", "dup_of", "dup_of_id", "reason"))
    removed.orderBy("idx").write.parquet(str(out / "removed"))
    by_reason = {r["reason"]: int(r["count"]) for r in
                 spark.read.parquet(str(out / "removed")).groupBy("reason").count().collect()}
    for d in ("clusters", "kept", "removed"):
        _finalize_parquet_dir(out / d)

    hist = {int(r["cluster_size"]): int(r["count"]) for r in
            sizes.where(F.col("cluster_size") > 1).groupBy("cluster_size").count().collect()}
    n_removed = sum((s - 1) * c for s, c in hist.items())
    n_kept = n_in - n_removed
    sig.unpersist(), cand.unpersist(), edges.unpersist(), assign.unpersist()
    stats = {
        "docs_in": n_in, "kept": n_kept, "removed": n_removed, "no_shingles": n_in - n_shingled,
        "removed_exact": by_reason.get("exact_duplicate", 0), "removed_near": by_reason.get("near_duplicate", 0),
        "candidate_edges": n_cand, "verified_edges": n_verified, "rejected_edges": n_cand - n_verified,
        "exact_edges": n_exact_edges, "edges": n_edges, "clusters_multi": sum(hist.values()),
        "largest_cluster": max(hist) if hist else 1, "cc_rounds": rounds,
        "bands": bands, "rows": rows, "num_perm": cfg.num_perm, "ngram": cfg.ngram, "threshold": cfg.threshold,
        "lsh_threshold": lsh_threshold(cfg), "s_curve": s_curve_report(lsh_threshold(cfg), bands, rows),
        "cluster_size_hist": {str(k): v for k, v in sorted(hist.items())},
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
