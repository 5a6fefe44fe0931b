"""Near-duplicate removal on Spark: MinHash → LSH bands → star edges → connected components.

Pipeline (all on executors; the driver only plans and counts):

1. ``mapInArrow`` over the docs: normalise, word n-gram shingles, 64-bit-safe MinHash signature,
   one 64-bit key per band (``pipelines.data.minhash``), plus one exact key (hash of the whole
   normalised text). Docs too short to shingle get only the exact key: they can be exact
   duplicates but are never near-duplicate candidates.
2. ``groupBy(band, key)``: every bucket with ≥ 2 docs becomes a *star*: each member → the
   bucket's smallest ``idx``. Edges are deduplicated; no all-pairs expansion.
3. Connected components on Spark (large-star / small-star, ``pipelines.data.spark``).
4. Keeper policy ``min_idx``: each cluster keeps its smallest ``idx`` (the earliest doc in input
   order); every other member is removed with ``dup_of`` = the keeper.

Outputs under the stage directory (parquet dirs, part files renamed ``part-NNNNN.parquet``):

* ``clusters/``: ``idx``, ``id``, ``cluster`` (keeper's idx; a singleton's own idx), ``cluster_size``
* ``kept/``: the docs kept (``idx, id, text, source``)
* ``removed/``: the docs removed, plus ``dup_of`` (idx), ``dup_of_id``, ``reason``
* ``stats.json`` and ``cluster_sizes.png`` (histogram of cluster sizes > 1)

Run standalone: ``python -m pipelines.data.dedup --input IN.jsonl --output DIR`` (ingests the JSONL
first under ``run.root``, so malformed lines are quarantined, not lost), or under spark-submit.
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    # spark-submit runs this file as a script, which puts pipelines/data/ first on sys.path, where
    # our tokenize.py would shadow the stdlib's. Drop that entry; put the project root instead.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from pipelines.cli import run_and_log, stage_parser  # noqa: E402
from pipelines.manifest import Manifest, StageDir, input_ref, load_manifest, write_report  # noqa: E402
from pipelines.spec import DedupCfg, JobSpec, resolve_path, spec_from_args  # noqa: E402


def effective_bands_rows(cfg: DedupCfg) -> tuple[int, int]:
    """Explicit bands × rows, else the pair that minimises FP+FN area at ``cfg.threshold``."""
    if cfg.bands is not None:
        return cfg.bands, cfg.rows
    from pipelines.data.minhash import optimal_bands_rows

    b, r, _, _ = optimal_bands_rows(cfg.threshold, cfg.num_perm)
    return b, r


EXACT_BAND = -1


def _band_fn(ngram: int, num_perm: int, seed: int, bands: int, rows: int):
    """mapInArrow body: (idx, text) batches → (idx, band, key) rows.

    Band ``-1`` holds a 64-bit hash of the whole normalised text, so exact duplicates (even docs
    too short to shingle) meet in one bucket; bands 0..b-1 are the MinHash LSH bands.
    """
    def fn(batches):
        import hashlib

        import numpy as np
        import pyarrow as pa

        from pipelines.data.minhash import band_keys, hash_shingles, normalize, permutations, shingles, signature

        a, b = permutations(num_perm, seed)
        band_ids = np.arange(bands, dtype=np.int32)
        for rb in batches:
            idxs = rb.column(0).to_pylist()
            texts = rb.column(1).to_pylist()
            oi, ob, ok = [], [], []
            for i, t in zip(idxs, texts):
                norm = normalize(t or "")
                if not norm:
                    continue
                oi.append(np.array([i], dtype=np.int64))
                ob.append(np.array([EXACT_BAND], dtype=np.int32))
                ok.append(np.frombuffer(hashlib.sha1(norm.encode()).digest()[:8], dtype="<i8"))
                sh = shingles(norm, ngram)
                if not sh:
                    continue
                oi.append(np.full(bands, i, dtype=np.int64))
                ob.append(band_ids)
                ok.append(band_keys(signature(hash_shingles(sh), a, b), bands, rows))
            if oi:
                yield pa.RecordBatch.from_arrays(
                    [pa.array(np.concatenate(oi)), pa.array(np.concatenate(ob)), pa.array(np.concatenate(ok))],
                    names=["idx", "band", "key"])
    return fn


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
    from pyspark.sql import functions as F

    from pipelines.data.spark import connected_components

    bands, rows = effective_bands_rows(cfg)
    docs = spark.read.parquet(str(docs_path))
    n_in = docs.count()
    bk = (docs.select("idx", "text").repartition(cfg.partitions)
          .mapInArrow(_band_fn(cfg.ngram, cfg.num_perm, cfg.seed, bands, rows),
                      "idx long, band int, key long")
          .persist())
    n_shingled = bk.where(F.col("band") != EXACT_BAND).select("idx").distinct().count()
    buckets = (bk.groupBy("band", "key").agg(F.min("idx").alias("root"), F.count("*").alias("n"))
               .where(F.col("n") > 1))
    edges = (bk.join(buckets.select("band", "key", "root"), ["band", "key"])
             .where(F.col("idx") != F.col("root"))
             .select(F.col("idx").alias("src"), F.col("root").alias("dst")).distinct().persist())
    n_edges = edges.count()
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
    exact = bk.where(F.col("band") == EXACT_BAND).select("idx", "key")
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
    bk.unpersist(), edges.unpersist(), assign.unpersist()
    stats = {
        "docs_in": n_in, "kept": n_kept, "removed": n_removed, "no_shingles": n_in - n_shingled,
        "removed_exact": by_reason.get("exact_duplicate", 0), "removed_near": by_reason.get("near_duplicate", 0),
        "candidate_edges": n_edges, "clusters_multi": sum(hist.values()),
        "largest_cluster": max(hist) if hist else 1, "cc_rounds": rounds,
        "bands": bands, "rows": rows, "num_perm": cfg.num_perm, "ngram": cfg.ngram,
        "cluster_size_hist": {str(k): v for k, v in sorted(hist.items())},
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    plot_cluster_sizes(hist, out / "cluster_sizes.png", bands, rows)
    return stats


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
                                        "no_shingles", "candidate_edges",
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
