"""Spark session, task sizing, the task commit protocol, Kubernetes conf, and Spark-side graph algorithms
(connected components).

The same job code runs three ways:

* ``python -m pipelines.data.dedup`` — builds its own session on ``services.spark_master``
  (``local[*]`` by default) with ``services.spark_conf`` on top;
* ``spark-submit --master … pipelines/spark_entry.py pipelines.data.dedup …`` — the session is the one
  spark-submit made: its master and every conf it was given stand, nothing is set over them (Airflow's
  ``SparkSubmitOperator`` does this; the Spark UI is on, and the task's link points at it);
* tests — one shared session per module.

Task sizes come from the data: a stage runs ``max(executor cores, bytes / data.task_mb)`` tasks
(:func:`task_count`), so 100 nodes get 100 nodes' worth of tasks.

Commit protocol for files the tasks write themselves (ingest's parts, dedup's outputs, tokenize's shards): a task
writes into an attempt directory of its own (:func:`attempt_dir`), and the driver publishes only the attempts whose
results the job returned (:func:`publish_attempts`); a speculative twin, or a task killed halfway, leaves files in an
attempt directory that is dropped. DataFrame writes (filter, decontaminate) go through Spark's own output committer,
which works the same way.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import sys
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines import engines
from pipelines.exit_codes import RETRY
from pipelines.manifest import StageError
from pipelines.spec import SpecError, resolve_path

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, SparkSession


def _under_spark_submit() -> bool:
    """spark-submit starts the JVM first and hands the Python driver its gateway through these
    variables; the master and conf it was given live in that JVM and must not be overridden."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def session_conf(master: str, driver_memory: str = "2g", shuffle_partitions: int | None = None,
                 conf: dict[str, str] | None = None) -> dict[str, str]:
    """What :func:`get_spark` sets on a session it builds itself: the UI only off a laptop (``local[…]``); on a
    cluster, shuffle blocks of another executor are fetched from it, never read from a disk path thought to be on
    the same host (``spark.shuffle.readHostLocalDisk=false``: executors behind one address may be separate
    machines)."""
    out = {"spark.master": master, "spark.driver.memory": driver_memory,
           "spark.ui.enabled": str(not master.startswith("local")).lower(), "spark.ui.showConsoleProgress": "false",
           "spark.sql.adaptive.enabled": "true", "spark.sql.adaptive.skewJoin.enabled": "true",
           "spark.pyspark.python": os.environ.get("PYSPARK_PYTHON", sys.executable)}
    if shuffle_partitions:
        out["spark.sql.shuffle.partitions"] = str(shuffle_partitions)
    if not master.startswith("local"):  # executors that share an address need not share a disk
        out["spark.shuffle.readHostLocalDisk"] = "false"
    return {**out, **(conf or {})}


class ExecutorsMissing(StageError):
    """No executor of a cluster master ran a task within the bound: pods Pending for want of a node, an image that
    cannot be pulled, a standalone master without workers. Not the user's input: a retry's (75)."""
    exit_code = RETRY


def get_spark(master: str = "local[*]", app: str = "llm-pipeline", driver_memory: str = "2g",
              shuffle_partitions: int | None = None, conf: dict[str, str] | None = None,
              executor_wait_s: float | None = None) -> "SparkSession":
    """The session: spark-submit's as it is when one made it, else one built on ``master`` (:func:`session_conf`);
    :class:`pipelines.engines.EngineRefused` in a run that refuses Spark (``--no-spark``). With ``executor_wait_s``
    on a cluster master, an executor must run a task within that many seconds (:func:`await_executors`)."""
    engines.check("spark", app)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # laptop default: stay on loopback
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    b = SparkSession.builder.appName(app)
    if not _under_spark_submit():
        for k, v in session_conf(master, driver_memory, shuffle_partitions, conf).items():
            b = b.config(k, v)
    had = SparkSession.getActiveSession()
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    if executor_wait_s is not None and had is None:  # a session this call made (one in use is another's to stop)
        await_executors(spark, executor_wait_s)
    return spark


def await_executors(spark, wait_s: float) -> None:
    """On a cluster master, a one-task job, waited for at most ``wait_s``: it runs as soon as one executor has
    registered. Executors that never come (Spark only logs "Initial job has not accepted any resources" and waits)
    are :class:`ExecutorsMissing` (75), the job cancelled, never a stage waiting out its task's timeout (hours).
    Nothing on ``local[…]``."""
    sc = spark.sparkContext
    if sc.master.startswith("local"):
        return
    done, failed, group = threading.Event(), [], f"llmp-executors-{os.getpid()}"

    def probe() -> None:
        try:
            sc.setJobGroup(group, "an executor runs a task", interruptOnCancel=True)  # this thread's jobs
            sc.parallelize([0], 1).count()
        except Exception as e:  # noqa: BLE001 - raised below, or the cancel's own
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=probe, name="llmp-spark-executors", daemon=True).start()
    if not done.wait(wait_s):
        try:
            sc.cancelJobGroup(group)
            spark.stop()  # its executors asked for no longer (on Kubernetes: the Pending pods deleted)
        finally:
            raise ExecutorsMissing(f"no executor of {sc.master} ran a task in {wait_s / 60:g} min "
                                   "(services.spark_executor_wait_minutes): pods Pending (no node fits, an image that "
                                   "cannot be pulled) or a master without workers; see the cluster's events, then "
                                   "retry")
    if failed:
        raise failed[0]


def spec_session(spec, app: str) -> "SparkSession":
    """The session a stage of ``spec`` runs in; on a cluster master, one whose executors answer within
    ``services.spark_executor_wait_minutes``."""
    svc = spec.services
    return get_spark(svc.spark_master, app, svc.spark_driver_memory, conf=svc.spark_conf,
                     executor_wait_s=svc.spark_executor_wait_minutes * 60)


def task_count(spark, nbytes: int, task_mb: int, fixed: int = 0, at_least: int = 0) -> int:
    """``fixed`` when set, else one task per ``task_mb`` of input (and ``at_least``), rounded up to whole waves of
    the executor cores (no last wave that leaves cores idle)."""
    if fixed:
        return fixed
    cores = spark.sparkContext.defaultParallelism
    return whole_waves(max(math.ceil(nbytes / (task_mb << 20)), at_least), cores)


def whole_waves(tasks: int, cores: int) -> int:
    """``tasks`` rounded up to a multiple of ``cores`` (at least one wave)."""
    return max(1, math.ceil(tasks / cores)) * cores


def size_shuffles(spark, tasks: int) -> None:
    """Shuffles of this stage in ``tasks`` partitions, unless the session's conf names a number itself (spark-submit
    ``--conf``, ``services.spark_conf``): the data decides, the user's word stands."""
    if not spark.sparkContext.getConf().contains("spark.sql.shuffle.partitions"):
        spark.conf.set("spark.sql.shuffle.partitions", str(tasks))


def dir_bytes(path: str | Path) -> int:
    """Bytes of the files under ``path`` (a parquet directory: its footers are not read)."""
    p = Path(path)
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def finalize_parquet_dir(d: Path) -> None:
    """An output directory of part files (committed by Spark's writer or published from task attempts): drop any
    _SUCCESS/.crc files and give the part files stable names."""
    for f in list(d.iterdir()):
        if f.name == "_SUCCESS" or f.name.endswith(".crc"):
            f.unlink()
    parts = sorted(f for f in d.iterdir() if f.name.startswith("part-"))
    for n, f in enumerate(parts):
        f.rename(d / f"part-{n:05d}.parquet")


# ---- what a task reads: row groups of parquet files, read by the task itself -------------------------------------


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of one row group of one parquet file, about ``nbytes`` of the column that sized it."""

    file: str
    group: int
    start: int
    stop: int
    nbytes: int


def row_groups(path: str | Path, column: str) -> list[tuple[str, int, int, int]]:
    """(file, row group, rows, uncompressed bytes of ``column``) of every non-empty row group of a parquet directory,
    in file order, from the footers (nothing else is read)."""
    import pyarrow.dataset as ds

    out = []
    for f in sorted(ds.dataset(str(path), format="parquet").files):
        md = pq.ParquetFile(f).metadata
        cols = [i for i in range(md.num_columns) if md.schema.column(i).path.split(".")[0] == column]  # its leaves
        out += [(f, g, md.row_group(g).num_rows, sum(md.row_group(g).column(i).total_uncompressed_size for i in cols))
                for g in range(md.num_row_groups) if md.row_group(g).num_rows]
    return out


def plan_pieces(groups: list[tuple[str, int, int, int]], n: int) -> list[list[Piece]]:
    """The row groups cut into at most ``n`` tasks of about equal bytes, in order; a row group bigger than a task's
    share is cut by rows. Every row is in exactly one piece."""
    target = max(1, sum(g[3] for g in groups)) / n
    tasks: list[list[Piece]] = [[] for _ in range(n)]
    done = 0
    for f, g, rows, nbytes in groups:
        k = max(1, min(rows, math.ceil(nbytes / target)))
        for j in range(k):
            a, b = rows * j // k, rows * (j + 1) // k
            piece = Piece(f, g, a, b, nbytes * (b - a) // rows)
            tasks[min(n - 1, int((done + piece.nbytes / 2) // target))].append(piece)
            done += piece.nbytes
    return [t for t in tasks if t]


PIECE_READ_ROWS = 8192  # rows decoded at a time while a piece is read


def read_piece(p: Piece, columns: list[str]):
    """A piece's rows (a pyarrow Table of ``columns``), read by the task itself: no JVM in the data's path. The row
    group is streamed and decoding stops at the piece's end: a task holds its piece, not the whole group (a large
    group is cut into many pieces, one task each)."""
    f = pq.ParquetFile(p.file)
    parts, at = [], 0
    for b in f.iter_batches(batch_size=PIECE_READ_ROWS, row_groups=[p.group], columns=columns):
        lo, hi = max(p.start - at, 0), min(p.stop - at, b.num_rows)
        if hi > lo:
            parts.append(b.slice(lo, hi - lo))
        at += b.num_rows
        if at >= p.stop:
            break
    if not parts:
        return f.schema_arrow.empty_table().select(columns)
    return pa.Table.from_batches(parts).select(columns)


def piece_batches(pieces: list[Piece], columns: list[str], rows: int = 2048):
    """A task's rows of ``columns`` (in that order), ``rows`` at a time, in the pieces' order: each batch one
    contiguous pyarrow Table, the same batches whenever the same pieces are read."""
    for p in pieces:
        t = read_piece(p, columns).select(columns)
        for off in range(0, t.num_rows, rows):
            yield t.slice(off, rows).combine_chunks()


# ---- Spark on Kubernetes ----------------------------------------------------------------------------------------

SPARK_SCRATCH = "/spark-local"  # executors' spark.local.dir (shuffle, spills) in the pods


def kubernetes_conf(spec) -> dict[str, str]:
    """spark-submit conf for a ``k8s://`` master (client mode from the Airflow worker pod; cluster mode alike): the
    executor image, namespace and service account, the driver's pod address for the executors to call back, the
    shared file system's claim (``launcher.shared_fs_claim``) mounted at ``launcher.shared_fs_mount`` on driver and
    executors (``run.root`` lives there: every task reads and writes the same paths as the driver), and node-local
    scratch for ``spark.local.dir`` (a volume named ``spark-local-dir-1``: ``services.spark_local_dir`` on the host,
    else an emptyDir on the node's instance store)."""
    svc, la = spec.services, spec.launcher
    if not svc.spark_master.startswith("k8s://"):
        return {}
    if not svc.spark_image:
        raise SpecError(f"services.spark_master={svc.spark_master} needs services.spark_image (an image with "
                        "Java 17, pyspark and this package for the executor pods)")
    if not la.shared_fs_claim:
        raise SpecError("services.spark_master=k8s://… needs launcher.shared_fs_claim: the executors read and write "
                        "run.root on the shared file system")
    root = resolve_path(spec.run.root)
    if not root.is_relative_to(la.shared_fs_mount):
        raise SpecError(f"run.root={root} is not under launcher.shared_fs_mount={la.shared_fs_mount}: the Spark "
                        "executors would not see the stage outputs; put run.root on the shared file system")
    conf = {"spark.kubernetes.container.image": svc.spark_image,
            "spark.kubernetes.namespace": svc.spark_namespace,
            "spark.kubernetes.authenticate.serviceAccountName": svc.spark_service_account,
            "spark.kubernetes.executor.podNamePrefix": f"{spec.run.name}-spark"[:40],
            "spark.pyspark.python": "python3"}  # the executor image's interpreter, not this worker's
    for role in ("driver", "executor"):
        vol = f"spark.kubernetes.{role}.volumes.persistentVolumeClaim.shared-fs"
        conf.update({f"{vol}.options.claimName": la.shared_fs_claim, f"{vol}.mount.path": la.shared_fs_mount,
                     f"{vol}.mount.readOnly": "false"})
    if svc.spark_local_dir:
        scratch = "spark.kubernetes.executor.volumes.hostPath.spark-local-dir-1"
        conf[f"{scratch}.options.path"] = svc.spark_local_dir
    else:
        scratch = "spark.kubernetes.executor.volumes.emptyDir.spark-local-dir-1"
    conf[f"{scratch}.mount.path"] = SPARK_SCRATCH
    pod_ip = os.environ.get("POD_IP") or os.environ.get("MY_POD_IP")
    if pod_ip:
        conf.update({"spark.driver.host": pod_ip, "spark.driver.bindAddress": "0.0.0.0"})
    return conf


# ---- task commit protocol ----------------------------------------------------------------------------------------


def prepare_attempts(base: str | Path) -> str:
    """Make ``base/_attempts`` on the driver, before the job; returns ``base`` for the tasks."""
    (Path(base) / "_attempts").mkdir(parents=True, exist_ok=True)
    return str(base)


def attempt_dir(base: str) -> Path:
    """A new directory for this task attempt's files: ``base/_attempts/<partition>-<attempt id>``. Made without
    parents, so a late twin whose job has already been published fails instead of writing anywhere."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    name = f"{ctx.partitionId():05d}-{ctx.taskAttemptId()}" if ctx is not None else f"driver-{os.getpid()}"
    d = Path(base) / "_attempts" / name
    d.mkdir()
    return d


def task_attempts(spark) -> int:
    """How many times Spark runs a failing task: ``local[N,F]``'s F, plain ``local[…]``'s 1, else
    ``spark.task.maxFailures`` (default 4)."""
    master = spark.sparkContext.master
    m = re.fullmatch(r"local\[[^,\]]+,\s*(\d+)\]", master)
    if m:
        return max(1, int(m.group(1)))
    if master.startswith("local"):
        return 1
    return max(1, int(spark.sparkContext.getConf().get("spark.task.maxFailures", "4")))


def last_attempt(attempts: int) -> bool:
    """Is this task's attempt the last Spark will make (``attempts``: :func:`task_attempts`)? True outside a task."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return ctx is None or ctx.attemptNumber() + 1 >= attempts


def maybe_fail(point: str) -> None:
    """Fault injection for the commit-protocol tests: ``LLMP_FAIL_TASK=<point>:<partition>[,…]`` kills the first
    attempt of that partition's task at ``point`` (after it has written its files, before it returns)."""
    want = os.environ.get("LLMP_FAIL_TASK", "")
    if not want:
        return
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is not None and f"{point}:{ctx.partitionId()}" in want.split(",") and ctx.attemptNumber() == 0:
        os._exit(17)


def publish_attempts(base: str | Path, attempts: list[str | Path], routes: dict[str, str | Path]) -> int:
    """Move the files of the committed attempts (the ones the job returned) to their places: ``routes`` maps a
    folder inside an attempt (``"."``: the attempt's own files) to its destination. Then drop every attempt directory
    (a speculative twin's, a killed task's). Two committed attempts writing one name is a bug: refused."""
    moved = 0
    for a in attempts:
        for sub, dest in routes.items():
            src, dest = Path(a) / sub, Path(dest)
            dest.mkdir(parents=True, exist_ok=True)
            for f in sorted(x for x in src.iterdir() if x.is_file()) if src.is_dir() else []:
                target = dest / f.name
                if target.exists():
                    raise RuntimeError(f"two committed task attempts wrote {target}")
                os.replace(f, target)
                moved += 1
    shutil.rmtree(Path(base) / "_attempts", ignore_errors=True)
    return moved


def package_zip(dest: Path) -> Path:
    """Zip the ``pipelines`` package for ``spark-submit --py-files`` (cluster executors import it)."""
    root = Path(__file__).resolve().parents[1]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(root.rglob("*.py")):
            z.write(f, f.relative_to(root.parent).as_posix())
    return dest


def label_components(u, v):
    """Connected components of the undirected graph of edges ``u[i]``–``v[i]`` (int64 numpy arrays, repeats allowed):
    (nodes, roots), every node that has an edge, sorted, and the smallest node of its component (scipy)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components as scc

    nodes, inv = np.unique(np.concatenate((u, v)), return_inverse=True)
    k = u.size
    g = coo_matrix((np.ones(k, dtype=np.int8), (inv[:k], inv[k:])), shape=(nodes.size, nodes.size))
    _, lab = scc(g, directed=False)
    root = np.full(lab.max() + 1, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(root, lab, nodes)  # nodes are sorted, so this is each component's smallest node
    return nodes, root[lab]


def components_single_task(edges: "DataFrame") -> "DataFrame":
    """Connected components of a graph small enough for one executor task (:func:`label_components`).

    The edges are shuffled into one partition (a shuffle, not a coalesce, so whatever makes them still runs in
    parallel) and labelled in one ``mapInArrow`` call on an executor, never on the driver: one stage instead of a few
    shuffles per round. Memory is about 50 bytes per edge, so callers bound the edge count
    (``dedup.cc_single_task_max_edges``) and use :func:`connected_components` above it. Returns (``node``, ``root``)
    like it.
    """
    def fn(batches):
        src, dst = [], []
        for rb in batches:
            src.append(rb.column(0).to_numpy(zero_copy_only=False))
            dst.append(rb.column(1).to_numpy(zero_copy_only=False))
        if not src or not sum(a.size for a in src):
            return
        nodes, roots = label_components(np.concatenate(src).astype(np.int64), np.concatenate(dst).astype(np.int64))
        yield pa.RecordBatch.from_arrays([pa.array(nodes), pa.array(roots)], names=["node", "root"])

    return edges.select("src", "dst").repartition(1).mapInArrow(fn, "node long, root long")


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
