"""Spark session helper and Spark-side graph algorithms (connected components).

The same job code runs three ways:

* ``python -m pipelines.data.dedup`` — builds its own session on ``services.spark_master``
  (``local[*]`` by default);
* ``spark-submit --master … pipelines/data/dedup.py`` — the session takes the master and conf
  that spark-submit set (Airflow's ``SparkSubmitOperator`` does this);
* tests — one shared session per module.
"""
from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, SparkSession


def _under_spark_submit() -> bool:
    """spark-submit starts the JVM first and hands the Python driver its gateway through these
    variables; the master and conf it was given live in that JVM and must not be overridden."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def get_spark(master: str = "local[*]", app: str = "llm-pipeline", driver_memory: str = "2g",
              shuffle_partitions: int = 8) -> "SparkSession":
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # laptop default: stay on loopback
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    b = SparkSession.builder.appName(app)
    if not _under_spark_submit():
        b = b.master(master).config("spark.driver.memory", driver_memory)
    b = (b.config("spark.ui.enabled", "false")
          .config("spark.ui.showConsoleProgress", "false")
          .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
          .config("spark.sql.adaptive.enabled", "true")
          .config("spark.sql.adaptive.skewJoin.enabled", "true")
          .config("spark.pyspark.python", os.environ["PYSPARK_PYTHON"]))
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def package_zip(dest: Path) -> Path:
    """Zip the ``pipelines`` package for ``spark-submit --py-files`` (cluster executors import it)."""
    root = Path(__file__).resolve().parents[1]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(root.rglob("*.py")):
            z.write(f, f.relative_to(root.parent).as_posix())
    return dest


def components_single_task(edges: "DataFrame") -> "DataFrame":
    """Connected components of a graph small enough for one executor task (``scipy.sparse.csgraph``).

    The edges are coalesced into one partition and labelled in one ``mapInArrow`` call on an
    executor, never on the driver: one stage instead of a few shuffles per round. Memory is about
    50 bytes per edge, so callers bound the edge count (``dedup.cc_single_task_max_edges``) and use
    :func:`connected_components` above it. Returns (``node``, ``root``) like it.
    """
    def fn(batches):
        import numpy as np
        import pyarrow as pa
        from scipy.sparse import coo_matrix
        from scipy.sparse.csgraph import connected_components as scc

        src, dst = [], []
        for rb in batches:
            src.append(rb.column(0).to_numpy(zero_copy_only=False))
            dst.append(rb.column(1).to_numpy(zero_copy_only=False))
        if not src or not sum(a.size for a in src):
            return
        u, v = np.concatenate(src).astype(np.int64), np.concatenate(dst).astype(np.int64)
        nodes, inv = np.unique(np.concatenate((u, v)), return_inverse=True)
        k = u.size
        g = coo_matrix((np.ones(k, dtype=np.int8), (inv[:k], inv[k:])), shape=(nodes.size, nodes.size))
        _, lab = scc(g, directed=False)
        root = np.full(lab.max() + 1, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(root, lab, nodes)  # nodes are sorted, so this is each component's smallest node
        yield pa.RecordBatch.from_arrays([pa.array(nodes), pa.array(root[lab])], names=["node", "root"])

    return edges.select("src", "dst").coalesce(1).mapInArrow(fn, "node long, root long")


def connected_components(edges: "DataFrame", max_iter: int = 64) -> tuple["DataFrame", int]:
    """Connected components of an undirected graph by alternating large-star / small-star.

    Kiveris et al., "Connected Components in MapReduce and Beyond" (SoCC 2014): O(log² n)
    rounds, every round a few shuffles, nothing collected on the driver. ``edges`` has long
    columns ``src``, ``dst``. Returns (``node``, ``root``) for every node that has an edge,
    ``root`` the smallest node of its component, and the number of rounds taken.
    """
    from pyspark.sql import functions as F

    e = (edges.select(F.greatest("src", "dst").alias("u"), F.least("src", "dst").alias("v"))
         .where(F.col("u") != F.col("v")).distinct())
    for it in range(1, max_iter + 1):
        # Large-star: every node u links each larger neighbour to min(N(u) ∪ {u}).
        both = e.select(F.col("u").alias("a"), F.col("v").alias("b")).unionByName(
            e.select(F.col("v").alias("a"), F.col("u").alias("b")))
        mins = both.groupBy("a").agg(F.min("b").alias("m")).withColumn("m", F.least("a", "m"))
        large = (both.join(mins, "a").where(F.col("b") > F.col("a"))
                 .select(F.col("b").alias("u"), F.col("m").alias("v"))
                 .where(F.col("u") != F.col("v")).distinct())
        # Small-star: every node u links itself and its smaller neighbours to the smallest of them.
        mins2 = large.groupBy("u").agg(F.min("v").alias("m"))
        small = (large.join(mins2, "u").select(F.col("v").alias("x"), "m")
                 .unionByName(mins2.select(F.col("u").alias("x"), "m"))
                 .where(F.col("x") != F.col("m"))
                 .select(F.greatest("x", "m").alias("u"), F.least("x", "m").alias("v")).distinct()
                 .localCheckpoint())
        # Done when the graph is a star forest: every child u has one parent and no parent has a parent.
        # One job: per node, how many parents it has and whether it is somebody's parent.
        chk = (small.select(F.col("u").alias("n"), F.lit(1).alias("c"), F.lit(0).alias("p"))
               .unionByName(small.select(F.col("v").alias("n"), F.lit(0).alias("c"), F.lit(1).alias("p")))
               .groupBy("n").agg(F.sum("c").alias("c"), F.max("p").alias("p"))
               .agg(F.max("c").alias("max_parents"),
                    F.count(F.when((F.col("c") > 0) & (F.col("p") > 0), 1)).alias("chained")).first())
        e = small
        if (chk["max_parents"] or 0) <= 1 and chk["chained"] == 0:
            return e.select(F.col("u").alias("node"), F.col("v").alias("root")).unionByName(
                e.select(F.col("v").alias("node"), F.col("v").alias("root"))).distinct(), it
    raise RuntimeError(f"connected components did not converge in {max_iter} rounds")
