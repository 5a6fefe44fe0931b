"""Data-plane ends on Spark: ingest (JSONL, WARC) and tokenize on local[1] and local[2], beside their anchors.

One run, one machine:

* **Corpora** (built here, deterministic): the bundled JSONL samples (C4 + CC WET) repeated ``--copies`` times with
  per-copy changes (a copy tag in every doc and its id), in 8 plain files; the bundled WARC's 38 pages repeated
  ``--warc-copies`` times (new URL and record id, a copy tag in the title), as one ``.warc.gz`` per copy.
* **Ingest** docs/s on local[1] and local[2] (the stage's Spark job, session start excluded and reported).
* **Tokenize** tokens/s on local[1] and local[2] with a given SentencePiece model (the encode + shard-writing
  job; training the tokenizer is not in it), against raw ``sp.encode`` (one thread) over the same texts in one
  process: the overhead per core is ``raw / ours(local[1]) - 1``. The job runs twice: the first run (reported as
  ``tokenize_cold_s``) also starts the Python workers and warms the JVM's JIT; the second is the figure.
* **WARC extraction** docs/s against DataTrove's ``WarcReader`` + ``Trafilatura`` extractor on the same files, one
  process (if datatrove is installed: ``make bench`` installs it); ours runs with trafilatura (same extractor) and
  with resiliparse (our default).

Each master runs in a child process pinned to its cores (``os.sched_setaffinity``: local[1] on 1 core, local[2] on
2), so the JVM that feeds the Python workers cannot borrow an idle core; the one-thread anchors run on that one
core too. ``--no-pin`` measures unpinned.

* **Cluster scale** (``--only scale``): a Spark standalone cluster of simulated nodes (``pipelines.sim_nodes``: each
  worker in a mount namespace of its own, pinned to a core of its own) with one node, then two, runs ingest JSONL,
  dedup and tokenize (job seconds, after a warm-up job); the driver's CPU seconds (its Python process and its JVM;
  the executors are elsewhere) at 1× and 8× the input, in 8 files either way.
* **Incremental dedup** (``--only incremental``): a new 10 % deduped against the persisted signatures of the corpus
  before it, against deduping corpus + new again, on local[2].
* **Cost growth** (``--only growth``): the whole data plane, each stage's CLI as the DAG runs it (ingest → dedup →
  filter → decontaminate → tokenize, ``local[2]``), on 1×, 4× and 16× of one corpus (``--growth-copies`` copies of
  the bundled samples, each copy's words shuffled per doc: distinct docs): seconds per GB of input per stage, and
  peak RSS per stage of the driver (the stage's Python process) and of the executors (the JVM, which in local mode
  holds the executor threads, and the Python workers, summed), sampled every 0.2 s. The fixed start of a stage (JVM,
  imports) weighs on 1×; the table also gives each stage's marginal cost per GB (the slope from 4× to 16×).
* **Filters beside DataTrove** (``--only filters``): the filter stage and DataTrove's pipeline of the same rules on
  the 16× corpus with URLs, docs/s, s/GB and agreement per rule (``benchmarks/filter_bench.py`` says how).

    python benchmarks/data_bench.py [--copies 30] [--warc-copies 8] [--no-pin] [--only ends|scale|incremental|growth|filters]
        → var/bench/data.json
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.manifest import atomic_write_text  # noqa: E402


def jsonl_corpus(dest: Path, copies: int, files: int = 8, unique: bool = False,
                 urls: Optional[Callable[[int, int, str], str]] = None) -> int:
    """The bundled samples ``copies`` times, a copy tag in every doc (near-duplicates of each other), or with
    ``unique`` each copy after the first with its words shuffled per doc (as many distinct docs, of the same lengths
    and words). ``urls(n, copy, original url)`` gives each doc a ``url``."""
    import random

    docs = [json.loads(x) for f in ("c4_en_train_1k.jsonl.gz", "cc_wet_2019_30_sample.jsonl.gz")
            for x in gzip.open(ROOT / "data" / "sample" / f, "rt", encoding="utf-8") if x.strip()]
    outs = [open(dest / f"part-{k}.jsonl", "w", encoding="utf-8") for k in range(files)]
    n = 0
    for c in range(copies):
        for i, d in enumerate(docs):
            text = d.get("text") if isinstance(d.get("text"), str) else ""
            if unique and c:
                words = text.split(" ")
                random.Random(c * 1_000_003 + i).shuffle(words)
                text = " ".join(words)
            row = {"id": f"c{c}-{i}", "text": f"[copy {c}] {text}"}
            if urls:
                row["url"] = urls(n, c, d.get("url") or (d.get("metadata") or {}).get("warc_url") or "")
            outs[n % files].write(json.dumps(row) + "\n")
            n += 1
    for f in outs:
        f.close()
    return n


def warc_corpus(dest: Path, copies: int) -> int:
    from fastwarc.warc import ArchiveIterator
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    pages = [(r.headers.get("WARC-Target-URI"), r.reader.read())
             for r in ArchiveIterator(str(ROOT / "data" / "warc" / "python_docs_sample.warc.gz"), parse_http=True,
                                      fsspec_args=False) if str(r.record_type) == "response" and
             r.http_headers.status_code == 200 and r.http_content_type == "text/html"]
    for c in range(copies):
        with open(dest / f"copy-{c:03d}.warc.gz", "wb") as f:
            w = WARCWriter(f, gzip=True)
            for url, html in pages:
                body = html.replace(b"<title>", f"<title>[copy {c}] ".encode(), 1)
                http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
                w.write_record(w.create_warc_record(f"{url}?copy={c}", "response", payload=io.BytesIO(body),
                                                    http_headers=http))
    return copies * len(pages)


def spark_session(master: str):
    from pipelines.data.spark import get_spark

    t = time.perf_counter()
    s = get_spark(master, f"data-bench-{master}", "4g", shuffle_partitions=4)
    s.range(1).count()
    return s, time.perf_counter() - t


def timed_ingest(spark, files: list[Path], work: Path, extractor: str = "resiliparse") -> tuple[float, dict]:
    from pipelines.data.ingest import ingest
    from pipelines.data.sources import Source
    from pipelines.spec import IngestCfg

    out = Path(tempfile.mkdtemp(dir=work))
    t = time.perf_counter()
    counts, _, _, _ = ingest(spark, [Source.of_file(f) for f in files], out, IngestCfg(extractor=extractor))
    return time.perf_counter() - t, {**counts, "out": str(out)}


def timed_tokenize(spark, docs: Path, model: Path, work: Path) -> tuple[float, dict]:
    from pipelines.data.tokenize import tokenize_docs
    from pipelines.spec import TokenizerCfg

    out = Path(tempfile.mkdtemp(dir=work))
    t = time.perf_counter()
    r = tokenize_docs(spark, docs, out, TokenizerCfg(model_path=str(model)), seed=1234)
    dt = time.perf_counter() - t
    shutil.rmtree(out)
    return dt, r


def raw_encode(docs: Path, model: Path) -> tuple[float, int]:
    import pyarrow.dataset as ds
    import sentencepiece as spm

    texts = ds.dataset(str(docs), format="parquet").to_table(columns=["text"]).column("text").to_pylist()
    sp = spm.SentencePieceProcessor(model_file=str(model))
    t = time.perf_counter()
    n = sum(len(x) + 1 for x in sp.encode(texts, num_threads=1))
    return time.perf_counter() - t, n


def datatrove_warc(files: list[Path]) -> tuple[float, int] | None:
    try:
        from datatrove.pipeline.extractors import Trafilatura
        from datatrove.pipeline.readers import WarcReader
        reader = WarcReader(str(files[0].parent), glob_pattern="*.warc.gz")
    except ImportError as e:
        print(f"DataTrove not run: {e}", flush=True)
        return None
    t = time.perf_counter()
    n = sum(1 for d in Trafilatura(timeout=10).run(reader.run()) if d.text)
    return time.perf_counter() - t, n


# ---- cluster scale: simulated nodes, driver CPU, incremental dedup ----------------------------------------------


def driver_cpu_s(spark) -> float:
    """CPU seconds of the driver so far: this Python process and its JVM (the executors live elsewhere)."""
    jvm = spark.sparkContext._gateway.proc.pid
    with open(f"/proc/{jvm}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return time.process_time() + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stage_times(spark, files: list[Path], work: Path, model: Path) -> dict:
    """Ingest JSONL, dedup and tokenize (given model) job seconds and the driver's CPU seconds, one session."""
    from pipelines.data.dedup import dedup_docs
    from pipelines.spec import DedupCfg

    from pipelines.data.spark import size_shuffles

    size_shuffles(spark, spark.sparkContext.defaultParallelism)  # as the stages size them on this little data
    r, cpu0 = {}, driver_cpu_s(spark)
    r["ingest_s"], c = timed_ingest(spark, files, work)
    docs = Path(c["out"]) / "docs"
    out = Path(tempfile.mkdtemp(dir=work))
    t = time.perf_counter()
    stats = dedup_docs(spark, docs, out, DedupCfg(), tasks=spark.sparkContext.defaultParallelism)
    r["dedup_s"] = time.perf_counter() - t
    r["tokenize_s"], tok = timed_tokenize(spark, docs, model, work)
    r.update(docs=c["docs"], kept=stats["kept"], tokens=tok["counts"]["tokens"],
             driver_cpu_s=round(driver_cpu_s(spark) - cpu0, 2), dedup_phases_s=stats["seconds"])
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}


def cluster_child(master: str, work_dir: str, which: str) -> int:
    """The driver of one measurement on a standalone cluster: stage times and driver CPU, written as JSON."""
    work = Path(work_dir)
    spark, start = spark_session(master)
    files = sorted((work / which).iterdir())
    stage_times(spark, files[:1], work, work / "tok.model")  # warm: Python workers, JIT
    r = {**stage_times(spark, files, work, work / "tok.model"), "session_start_s": round(start, 1)}
    spark.stop()
    (work / f"{which}-{master.rsplit(':', 1)[-1]}.json").write_text(json.dumps(r))
    return 0


def on_cluster(work: Path, workers: int, which: str) -> dict:
    import subprocess

    from pipelines.sim_nodes import SparkCluster

    with SparkCluster(work / f"nodes-{workers}-{which}", workers=workers, cores=1, memory="3g",
                      private_dirs=(ROOT / "var",), pin=True) as cl:
        subprocess.run([sys.executable, __file__, "--cluster-child", cl.master_url, str(work), which], check=True)
        return json.loads((work / f"{which}-{cl.master_url.rsplit(':', 1)[-1]}.json").read_text())


def run_scale(args, work: Path) -> dict:
    """Two simulated nodes (1 core each) against one; the driver's CPU at 1× and 8× the input (8 files each)."""
    from pipelines.data.tokenize import canonical_text, train_sentencepiece
    from pipelines.sim_nodes import namespaces_permitted
    from pipelines.spec import TokenizerCfg

    why = namespaces_permitted()
    if why:
        return {"skipped": why}
    for name, copies in (("x1", args.copies), ("x8", 8 * args.copies)):
        (work / name).mkdir()
        jsonl_corpus(work / name, copies)
    texts = [json.loads(x)["text"] for x in open(work / "x1" / "part-0.jsonl", encoding="utf-8")][:4000]
    train_sentencepiece([canonical_text(t) for t in texts], work / "tok", TokenizerCfg(), 1234)
    res = {"corpus_mb": {n: round(sum(f.stat().st_size for f in (work / n).iterdir()) / 2**20, 1)
                         for n in ("x1", "x8")}}
    res["one_node"] = on_cluster(work, 1, "x1")
    res["one_node_x8"] = on_cluster(work, 1, "x8")
    res["two_nodes_x8"] = on_cluster(work, 2, "x8")
    print(f"scale: {res}", flush=True)
    return res


def run_incremental(args, work: Path) -> dict:
    """Dedup of a new 10 % against the corpus's persisted signatures, against dedup of corpus + new, on local[2]."""
    import pyarrow.parquet as pq

    from pipelines.data.dedup import dedup_docs
    from pipelines.data.spark import get_spark
    from pipelines.spec import DedupCfg

    (work / "inc").mkdir()
    jsonl_corpus(work / "inc", args.inc_copies, unique=True)
    spark = get_spark("local[2]", "data-bench-incremental", "4g")
    _, c = timed_ingest(spark, sorted((work / "inc").iterdir()), work)
    docs = pq.read_table(Path(c["out"]) / "docs")
    n_old = docs.num_rows * 10 // 11
    for name, t in (("old", docs.slice(0, n_old)), ("new", docs.slice(n_old)), ("all", docs)):
        (work / name).mkdir()
        pq.write_table(t, work / name / "part-00000.parquet")
    from pipelines.data.spark import size_shuffles

    cfg, tasks = DedupCfg(), spark.sparkContext.defaultParallelism
    size_shuffles(spark, tasks)  # as the dedup stage sizes them on this little data
    t = time.perf_counter()
    dedup_docs(spark, work / "old", work / "old_out", cfg, tasks=tasks)
    old_s = time.perf_counter() - t
    dedup_docs(spark, work / "new", work / "warm", cfg, [work / "old_out" / "signatures"], tasks)  # warm: both paths
    t = time.perf_counter()
    full = dedup_docs(spark, work / "all", work / "all_out", cfg, tasks=tasks)
    full_s = time.perf_counter() - t
    t = time.perf_counter()
    inc = dedup_docs(spark, work / "new", work / "new_out", cfg, [work / "old_out" / "signatures"], tasks)
    inc_s = time.perf_counter() - t
    spark.stop()
    res = {"docs_old": n_old, "docs_new": docs.num_rows - n_old, "old_dedup_s": round(old_s, 1),
           "full_dedup_s": round(full_s, 1), "incremental_dedup_s": round(inc_s, 1),
           "full_removed": full["removed"], "incremental_removed": inc["removed"],
           "incremental_removed_against": inc["removed_against"]}
    print(f"incremental: {res}", flush=True)
    return res


GROWTH_STAGES = ("ingest", "dedup", "filter", "decontaminate", "tokenize")


def measured_run(cmd: list[str], env: dict) -> dict:
    """Run a stage's CLI; wall seconds and peak RSS (MB) of its Python process (the driver), of its JVM and of
    its Python workers (summed at each sample)."""
    import subprocess

    import psutil

    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a child that writes much never blocks on a full pipe
    t = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    peak = {"driver_mb": 0.0, "jvm_mb": 0.0, "workers_mb": 0.0}
    root = psutil.Process(p.pid)
    while p.poll() is None:
        try:
            kids = root.children(recursive=True)
            peak["driver_mb"] = max(peak["driver_mb"], root.memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            break
        jvm, workers = 0.0, 0.0
        for k in kids:
            try:
                rss = k.memory_info().rss / 2**20
                if "java" in k.name():
                    jvm += rss
                else:
                    workers += rss
            except psutil.NoSuchProcess:
                continue
        peak["jvm_mb"], peak["workers_mb"] = max(peak["jvm_mb"], jvm), max(peak["workers_mb"], workers)
        time.sleep(0.2)
    p.wait()
    log.seek(0)
    out = log.read()
    log.close()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({p.returncode}):\n{out[-3000:]}")
    return {"s": round(time.perf_counter() - t, 2), **{k: round(v) for k, v in peak.items()}}


def run_growth(args, work: Path) -> dict:
    """The data plane at 1×, 4× and 16× of one corpus, every stage through its CLI on local[2]."""
    res = {}
    for k in (1, 4, 16):
        data, home = work / f"x{k}", work / f"home{k}"
        data.mkdir()
        home.mkdir()
        jsonl_corpus(data, args.growth_copies * k, unique=True)
        gb = sum(f.stat().st_size for f in data.iterdir()) / 1e9
        env = {**os.environ, "LLMP_HOME": str(home), "LLMP_PROGRESS": "0"}
        sets = ["--set", "services.spark_master=local[2]", "--set", "tokenizer.vocab_size=2000"]
        res[f"x{k}"] = {"gb": round(gb, 4), **run_stages(GROWTH_STAGES, data, home, sets, env, f"growth {k}×")}
    return res


def run_stages(stages, data: Path, home: Path, sets: list[str], env: dict, label: str) -> dict:
    """Each stage through its CLI, in order, measured: the first reads the files in ``data``, each next one its
    predecessor's manifest; their outputs under ``home/out/<stage>``."""
    row, prev = {}, None
    for stage in stages:
        out = home / "out" / stage
        cmd = [sys.executable, "-m", f"pipelines.data.{stage}", "--output", str(out), *sets]
        cmd += [a for f in sorted(data.iterdir()) for a in ("--input", str(f))] if prev is None \
            else ["--input-manifest", str(prev / "manifest.json")]
        row[stage] = measured_run(cmd, env)
        print(f"{label}: {stage} {row[stage]}", flush=True)
        prev = out
    return row


def growth_table(r: dict) -> str:
    g = r["growth"]
    one, four, top = g["x1"], g["x4"], g["x16"]
    lines = [f"| stage | s/GB at 1× ({one['gb'] * 1000:.0f} MB) | 4× | 16× ({top['gb'] * 1000:.0f} MB) | 16× ÷ 1× | "
             "marginal s/GB (4× → 16×) | driver peak MB 1× / 4× / 16× | executors peak MB (JVM + Python workers) "
             "1× / 4× / 16× |", "|---|---|---|---|---|---|---|---|"]
    for st in GROWTH_STAGES:
        per = [row[st]["s"] / row["gb"] for row in (one, four, top)]
        slope = (top[st]["s"] - four[st]["s"]) / (top["gb"] - four["gb"])
        drv = " / ".join(str(row[st]["driver_mb"]) for row in (one, four, top))
        exe = " / ".join(f"{row[st]['jvm_mb']} + {row[st]['workers_mb']}" for row in (one, four, top))
        lines.append(f"| {st} | {per[0]:,.0f} | {per[1]:,.0f} | {per[2]:,.0f} | {per[2] / per[0]:.2f} | {slope:,.0f} | "
                     f"{drv} | {exe} |")
    tot = [sum(row[st]["s"] for st in GROWTH_STAGES) / row["gb"] for row in (one, four, top)]
    lines.append(f"| **ingest → tokenize** | {tot[0]:,.0f} | {tot[1]:,.0f} | {tot[2]:,.0f} | {tot[2] / tot[0]:.2f} | | "
                 "| |")
    return "\n".join(lines)


def scale_table(r: dict) -> str:
    lines = ["| measure | one node (1 core) | two nodes (1 core each) | two / one | target |", "|---|---|---|---|---|"]
    sc = r.get("scale", {})
    if "skipped" in sc:
        lines.append(f"| simulated nodes | skipped: {sc['skipped']} | | | |")
    elif sc:
        one, x8, two = sc["one_node"], sc["one_node_x8"], sc["two_nodes_x8"]
        for k, label in (("ingest_s", "ingest JSONL"), ("dedup_s", "dedup"), ("tokenize_s", "tokenize")):
            lines.append(f"| {label} ({sc['corpus_mb']['x8']} MB, {x8['docs']:,} docs), job s | {x8[k]} | {two[k]} | "
                         f"{x8[k] / two[k]:.2f}× | ≥ 1.7× |")
        lines.append(f"| driver CPU s (one node), 1× input ({sc['corpus_mb']['x1']} MB) → 8× | {one['driver_cpu_s']} | "
                     f"{x8['driver_cpu_s']} (8×) | {x8['driver_cpu_s'] / one['driver_cpu_s']:.2f}× | ≤ 2× |")
    inc = r.get("incremental")
    if inc:
        lines.append(f"| dedup of a new 10 % ({inc['docs_new']:,} docs on {inc['docs_old']:,}, local[2]): the whole "
                     f"corpus again (1st column) vs against its signatures (2nd), s "
                     f"| {inc['full_dedup_s']} | {inc['incremental_dedup_s']} | "
                     f"{inc['full_dedup_s'] / inc['incremental_dedup_s']:.2f}× faster | ≥ 5× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=30, help="copies of the bundled JSONL samples (default 30)")
    ap.add_argument("--warc-copies", type=int, default=8, help="copies of the bundled WARC's pages (default 8)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin local[N] to N cores")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "data.json"))
    ap.add_argument("--inc-copies", type=int, default=40,
                    help="copies of the samples, each its words shuffled, for the incremental dedup (default 40)")
    ap.add_argument("--growth-copies", type=int, default=2,
                    help="copies of the samples at 1× for the cost-growth table (default 2; 16× is 32 copies)")
    ap.add_argument("--filter-copies", type=int, default=0,
                    help="copies of the samples for --only filters (default 0: 16 × --growth-copies, the 16× corpus)")
    ap.add_argument("--only", choices=["ends", "scale", "incremental", "growth", "filters"], action="append",
                    help="run only these parts (repeatable; default: all)")
    ap.add_argument("--child", nargs=2, metavar=("MASTER", "WORK"), help=argparse.SUPPRESS)
    ap.add_argument("--cluster-child", nargs=3, metavar=("MASTER", "WORK", "WHICH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(*args.child, pin=not args.no_pin)
    if args.cluster_child:
        return cluster_child(*args.cluster_child)
    parts = args.only or ["ends", "scale", "incremental", "growth", "filters"]
    work = Path(tempfile.mkdtemp(prefix="data-bench-", dir="/var/tmp"))  # not under /tmp: the nodes have their own
    result: dict = {}
    try:
        if "ends" in parts:
            result.update(run(args, work / "ends"))
        if "scale" in parts:
            (work / "scale").mkdir()
            result["scale"] = run_scale(args, work / "scale")
        if "incremental" in parts:
            (work / "inc-work").mkdir()
            result["incremental"] = run_incremental(args, work / "inc-work")
        if "growth" in parts:
            (work / "growth").mkdir()
            result["growth"] = run_growth(args, work / "growth")
        if "filters" in parts:
            import filter_bench

            result["filters"] = filter_bench.run(args, work / "filters", jsonl_corpus, measured_run, run_stages)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "ends" in parts:
        print(table(result))
    if "scale" in parts or "incremental" in parts:
        print(scale_table(result))
    if "growth" in parts:
        print(growth_table(result))
    if "filters" in parts:
        print(filter_bench.table(result["filters"]))
    atomic_write_text(args.out, json.dumps(result, indent=2))
    print(f"\nwritten {args.out}")
    return 0


def run(args, work: Path) -> dict:
    """Build the corpora and the tokenizer here; measure each master in a child process pinned to its cores."""
    import subprocess

    from pipelines.data.tokenize import canonical_text, train_sentencepiece
    from pipelines.spec import TokenizerCfg

    work.mkdir()
    (work / "jsonl").mkdir()
    (work / "warc").mkdir()
    res: dict = {"corpus": {"jsonl_docs": jsonl_corpus(work / "jsonl", args.copies),
                            "warc_pages": warc_corpus(work / "warc", args.warc_copies)},
                 "cores": os.cpu_count(), "pinned": not args.no_pin}
    res["corpus"]["jsonl_mb"] = round(sum(f.stat().st_size for f in (work / "jsonl").iterdir()) / 2**20, 1)
    texts = [json.loads(x)["text"] for x in open(work / "jsonl" / "part-0.jsonl", encoding="utf-8")][:4000]
    train_sentencepiece([canonical_text(t) for t in texts], work / "tok", TokenizerCfg(), 1234)
    print(f"corpus: {res['corpus']}", flush=True)
    for master in ("local[1]", "local[2]"):
        cmd = [sys.executable, __file__, "--child", master, str(work)] + (["--no-pin"] if args.no_pin else [])
        subprocess.run(cmd, check=True)
        res[master] = json.loads((work / f"{master}.json").read_text())
        print(f"{master}: {res[master]}", flush=True)
    res["raw_sp_encode_tokens_s"] = res["local[1]"].pop("raw_sp_encode_tokens_s")
    res["ours_trafilatura_warc_docs_s"] = res["local[1]"].pop("ours_trafilatura_warc_docs_s")
    if not args.no_pin:  # the anchor on one core too (last step: the parent needs no more cores)
        os.sched_setaffinity(0, {0})
    dt_ = datatrove_warc(sorted((work / "warc").iterdir()))
    res["datatrove_warc_docs_s"] = round(dt_[1] / dt_[0], 1) if dt_ else None
    return res


def child(master: str, work_dir: str, pin: bool) -> int:
    """One master's measurements, in a process (and so a JVM and Python workers) pinned to N cores for local[N];
    local[1] also runs the one-core anchors (raw sp.encode, our trafilatura path)."""
    work = Path(work_dir)
    n = int(master[len("local["):-1])
    if pin:
        os.sched_setaffinity(0, set(range(n)))
    jsonl, warcs, model = sorted((work / "jsonl").iterdir()), sorted((work / "warc").iterdir()), work / "tok.model"
    spark, start = spark_session(master)
    dt, c = timed_ingest(spark, jsonl, work)
    wt, w = timed_ingest(spark, warcs, work)
    docs = Path(c["out"]) / "docs"
    cold, _ = timed_tokenize(spark, docs, model, work)  # the first job also starts the workers, warms the JIT
    tt, t = timed_tokenize(spark, docs, model, work)
    r = {"tokenize_cold_s": round(cold, 1), "session_start_s": round(start, 1), "ingest_jsonl_docs_s": round(c["docs"] / dt),
         "ingest_jsonl_s": round(dt, 1), "ingest_warc_docs_s": round(w["docs"] / wt, 1), "ingest_warc_s": round(wt, 1),
         "tokenize_tokens_s": round(t["counts"]["tokens"] / tt), "tokenize_s": round(tt, 1),
         "tokens": t["counts"]["tokens"], "partitions": t["partitions"]}
    if n == 1:
        traf_t, traf = timed_ingest(spark, warcs, work, "trafilatura")
        r["ours_trafilatura_warc_docs_s"] = round(traf["docs"] / traf_t, 1)
        raw_t, raw_n = raw_encode(docs, model)
        r["raw_sp_encode_tokens_s"] = round(raw_n / raw_t)
    spark.stop()
    (work / f"{master}.json").write_text(json.dumps(r))
    return 0


def table(r: dict) -> str:
    one, two = r["local[1]"], r["local[2]"]
    dt_ = r["datatrove_warc_docs_s"]
    rows = [
        ("ingest JSONL, docs/s", one["ingest_jsonl_docs_s"], two["ingest_jsonl_docs_s"], "—", "—"),
        ("ingest WARC (resiliparse), docs/s", one["ingest_warc_docs_s"], two["ingest_warc_docs_s"],
         f"DataTrove WarcReader+Trafilatura {dt_}" if dt_ else "datatrove not installed",
         f"{one['ingest_warc_docs_s'] / dt_:.2f}× (local[1])" if dt_ else "—"),
        ("ingest WARC (trafilatura), docs/s", r["ours_trafilatura_warc_docs_s"], "", f"same anchor {dt_}",
         f"{r['ours_trafilatura_warc_docs_s'] / dt_:.2f}× (local[1])" if dt_ else "—"),
        ("tokenize, tokens/s", f"{one['tokenize_tokens_s']:,}", f"{two['tokenize_tokens_s']:,}",
         f"raw sp.encode, 1 thread {r['raw_sp_encode_tokens_s']:,}",
         f"{one['tokenize_tokens_s'] / r['raw_sp_encode_tokens_s']:.2f}× (local[1]; overhead "
         f"{r['raw_sp_encode_tokens_s'] / one['tokenize_tokens_s'] - 1:+.1%})"),
    ]
    lines = ["| measure | local[1] | local[2] | anchor (same run) | ours / anchor |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(str(x) for x in row)} |" for row in rows]
    ratio = {k: two[k] / one[k] for k in ("ingest_jsonl_docs_s", "ingest_warc_docs_s", "tokenize_tokens_s")}
    lines.append(f"| scaling local[2] / local[1] | ingest JSONL {ratio['ingest_jsonl_docs_s']:.2f}× · WARC "
                 f"{ratio['ingest_warc_docs_s']:.2f}× | tokenize {ratio['tokenize_tokens_s']:.2f}× | target ≥ 1.7× | "
                 f"tokenize job {one['tokenize_s']} s / {two['tokenize_s']} s (cold {one['tokenize_cold_s']} s / "
                 f"{two['tokenize_cold_s']} s); session start "
                 f"{one['session_start_s']} s |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
