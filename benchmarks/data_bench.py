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

    python benchmarks/data_bench.py [--copies 30] [--warc-copies 8] [--no-pin]   → var/bench/data.json
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.manifest import atomic_write_text  # noqa: E402


def jsonl_corpus(dest: Path, copies: int, files: int = 8) -> int:
    docs = [json.loads(x) for f in ("c4_en_train_1k.jsonl.gz", "cc_wet_2019_30_sample.jsonl.gz")
            for x in gzip.open(ROOT / "data" / "sample" / f, "rt", encoding="utf-8") if x.strip()]
    outs = [open(dest / f"part-{k}.jsonl", "w", encoding="utf-8") for k in range(files)]
    n = 0
    for c in range(copies):
        for i, d in enumerate(docs):
            text = d.get("text") if isinstance(d.get("text"), str) else ""
            outs[n % files].write(json.dumps({"id": f"c{c}-{i}", "text": f"[copy {c}] {text}"}) + "\n")
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
    counts = ingest(spark, [Source.of_file(f) for f in files], out, IngestCfg(extractor=extractor))
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=30, help="copies of the bundled JSONL samples (default 30)")
    ap.add_argument("--warc-copies", type=int, default=8, help="copies of the bundled WARC's pages (default 8)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin local[N] to N cores")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "data.json"))
    ap.add_argument("--child", nargs=2, metavar=("MASTER", "WORK"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(*args.child, pin=not args.no_pin)
    work = Path(tempfile.mkdtemp(prefix="data-bench-"))
    try:
        result = run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(result))
    atomic_write_text(args.out, json.dumps(result, indent=2))
    print(f"\nwritten {args.out}")
    return 0


def run(args, work: Path) -> dict:
    """Build the corpora and the tokenizer here; measure each master in a child process pinned to its cores."""
    import subprocess

    from pipelines.data.tokenize import normalise, train_sentencepiece
    from pipelines.spec import TokenizerCfg

    (work / "jsonl").mkdir()
    (work / "warc").mkdir()
    res: dict = {"corpus": {"jsonl_docs": jsonl_corpus(work / "jsonl", args.copies),
                            "warc_pages": warc_corpus(work / "warc", args.warc_copies)},
                 "cores": os.cpu_count(), "pinned": not args.no_pin}
    res["corpus"]["jsonl_mb"] = round(sum(f.stat().st_size for f in (work / "jsonl").iterdir()) / 2**20, 1)
    texts = [json.loads(x)["text"] for x in open(work / "jsonl" / "part-0.jsonl", encoding="utf-8")][:4000]
    train_sentencepiece([normalise(t) for t in texts], work / "tok", TokenizerCfg(), 1234)
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
