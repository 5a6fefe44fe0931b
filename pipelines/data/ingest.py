"""Ingest on Spark: JSONL (plain, .gz, .zst), Parquet, WARC and WET, plain text (local, globs, ``s3://``) →
``docs/`` + ``quarantine/``.

Every input is cut into chunks (:mod:`pipelines.data.formats`: large plain JSONL and .warc.gz files by byte range,
Parquet files by row group, anything else whole), one Spark task each. JSONL fields and Parquet columns are mapped
by ``data.input_fields`` (``text``, ``id``, ``url``, ``date``; FineWeb's names by default). Two passes keep
``idx`` dense and deterministic whatever the number of executors:

1. each task reads its chunk and writes its documents (numbered from 0 within the chunk) and its quarantined
   records to part files, hashes the chunk's bytes, and returns its counts;
2. the driver turns the counts into offsets (docs before the chunk; lines before it in the same input), and each
   task writes ``docs/part-NNNNN.parquet`` with ``idx`` = offset + its number, and ``quarantine/part-NNNNN.jsonl``
   with file-global line numbers.

Every task writes into an attempt directory of its own; the driver publishes only the attempts the job returned
(:func:`pipelines.data.spark.publish_attempts`), so a retried or speculative task leaves no torn or doubled file.
The driver's work is O(inputs + tasks): it lists the inputs (no byte read but Parquet footers), plans the chunks,
adds up counts.

Outputs:

* ``docs/``: ``idx`` (int64, dense, input order), ``id``, ``text``, ``source`` (the input's key: its path under
  the project root, its absolute path, or its ``s3://`` URI), ``url``, ``warc_record_id``, ``date``, ``meta``
  (null where the format has none; ``meta``: a Parquet row's other columns, a JSON object). ``id`` is the record's
  id field (a WARC record's ``WARC-Record-ID``), else ``<source>:<line>`` (a WARC record: ``<source>:<offset>``, a
  Parquet row: ``<source>:<row>``, its number in the file from 1). Ids are checked unique at the end: an id given
  by the data that repeats (across inputs or within one) becomes ``<source>:<line>#<id>`` for every copy.
* ``quarantine/``: ``{source, line | offset, reason, detail, raw | raw_b64, …}`` per line. JSONL reasons:
  ``invalid_utf8``, ``invalid_json``, ``not_an_object``, ``missing_text``, ``text_not_string``, ``empty_text``,
  ``bad_compression`` (a .gz/.zst input that breaks off, a zstd frame cut short included: the records before it
  are kept; ``offset`` is the compressed offset reached, ``uri`` the file). WARC reasons: ``bad_compression`` (a
  gzip member that does not decompress, or the file ends inside one; its bytes are kept), ``bad_record`` (a member
  that does not parse as WARC; its bytes are kept), ``bad_http``, ``http_status`` (not 200), ``not_html``, ``extract_failed``,
  ``empty_text`` (nothing left after extraction). Parquet reasons (with ``row`` and ``row_group``, the row as
  JSON in ``raw``): ``missing_text`` (no such column, or null), ``text_not_string``, ``empty_text``, ``invalid_utf8``,
  and ``bad_parquet`` (``uri``, ``detail``): a file whose footer does not read (truncated, not Parquet) as one
  entry; a row group that breaks off after the rows read before the damage (kept), with ``rows_unread``; the other
  row groups and inputs go on. ``quarantine_sample.jsonl``: a bounded sample (without the raw bytes) for MLflow.

``counts``: ``records`` = ``docs`` + ``quarantined`` + ``over_max_docs``; ``records`` = ``lines`` (JSONL records)
+ ``warc_records`` (WARC response/resource/conversion records) + ``text_files`` + ``parquet_rows`` (rows, and each
``bad_parquet`` entry). ``blank_lines`` and ``skipped_records`` (WARC requests, warcinfo, metadata …, by type)
hold no document. ``extra.input_sha256``: each input's digest, computed by the tasks that read it (one chunk: the
file's sha256; several: the sha256 of their ranges' digests in order, the ranges covering the file).
``extra.cut_inputs`` (``counts.cut_inputs``): the inputs that ``data.ingest.max_docs`` cut; a corpus version never
holds them, so the next curation reads them again.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import ValidationError

from pipelines.cli import add_corpus_arg, corpus_arg, run_and_log, stage_dir, stage_main
from pipelines.data.formats import Chunk, plan_chunks, range_sha256, rows
from pipelines.data.sources import IngestError, InputUnavailable, resolve
from pipelines.data.spark import (attempt_dir, last_attempt, maybe_fail, prepare_attempts, publish_attempts,
                                  task_attempts)
from pipelines.manifest import Manifest, input_ref
from pipelines.spec import IngestCfg, InputFieldsCfg, JobSpec, SpecError
from pipelines.storage.s3 import ObjectChanged, missing, outage

META = ("url", "warc_record_id", "date", "meta")
DOCS_SCHEMA = pa.schema([("idx", pa.int64()), ("id", pa.string()), ("text", pa.string()), ("source", pa.string()),
                         *((m, pa.string()) for m in META)])
PART_SCHEMA = pa.schema([("seq", pa.int64()), ("line", pa.int64()), *(f for f in DOCS_SCHEMA if f.name != "idx")])
_BATCH = 2048


SAMPLE_PER_TASK = 20  # quarantine entries each task returns for the bounded sample the driver keeps


def read_chunk(chunk: Chunk, cfg: IngestCfg, parts: str, fields: InputFieldsCfg | None = None,
               attempts: int = 1) -> dict:
    """Pass 1, on an executor: one chunk → ``docs-NNNNN.parquet`` + ``quarantine-NNNNN.jsonl`` in an attempt
    directory under ``parts``; returns that directory, its counts, a few quarantine entries and the sha256 of the
    chunk's bytes; or, for an S3 object replaced or deleted since it was listed, ``{"no", "changed": why}``, and for
    an endpoint that did not answer (past its bounded retries) on the task's last attempt (``attempts``: Spark's,
    :func:`~pipelines.data.spark.task_attempts`; an earlier one raises, and Spark runs the chunk again)
    ``{"no", "unavailable": why}``: the driver stops the stage 75 (a retry lists the inputs again), where a raised
    error would fail it through Spark as any bug does."""
    try:
        return read_chunk_parts(chunk, cfg, parts, fields)
    except ObjectChanged as e:
        return {"no": chunk.no, "changed": str(e)}
    except Exception as e:  # noqa: BLE001 - only an S3 object's answers are read here; anything else is raised
        if chunk.settings is not None and missing(e):
            return {"no": chunk.no, "changed": f"{chunk.path} is gone since it was listed"}
        if chunk.settings is None or not outage(e) or not last_attempt(attempts):
            raise
        return {"no": chunk.no, "unavailable": f"{chunk.path}: the endpoint did not answer ({type(e).__name__}: {e})"}


def read_chunk_parts(chunk: Chunk, cfg: IngestCfg, parts: str, fields: InputFieldsCfg | None = None) -> dict:
    """:func:`read_chunk`'s work."""
    part_dir = attempt_dir(parts)
    c: Counter = Counter()
    reasons: Counter = Counter()
    skipped: Counter = Counter()
    sample: list[dict] = []
    batch: dict[str, list] = {k: [] for k in PART_SCHEMA.names}
    record_kind = {"jsonl": "lines", "warc": "warc_records", "txt": "text_files", "parquet": "parquet_rows"}[chunk.fmt]
    with pq.ParquetWriter(part_dir / f"docs-{chunk.no:05d}.parquet", PART_SCHEMA, compression="zstd") as w, \
            open(part_dir / f"quarantine-{chunk.no:05d}.jsonl", "w", encoding="utf-8") as qf:
        for r in rows(chunk, cfg, fields):
            c["physical_lines"] += 1
            if r is None or isinstance(r, str):  # a blank JSONL line; a WARC record that is not a document
                c["blank_lines"] += r is None
                skipped[r] += r is not None
                continue
            c[record_kind] += 1
            if r.reason:
                where = {"line": r.loc} if chunk.fmt in ("jsonl", "txt") else {}  # WARC, Parquet: in r.q
                entry = {"source": chunk.name, **where, "reason": r.reason, **r.q}
                qf.write(json.dumps(entry, ensure_ascii=False) + "\n")
                if len(sample) < SAMPLE_PER_TASK:
                    sample.append({k: v for k, v in entry.items() if k not in ("raw", "raw_b64")})
                c["quarantined"] += 1
                reasons[r.reason] += 1
                continue
            for k, v in (("seq", c["docs"]), ("line", r.loc), ("id", r.id), ("text", r.text), ("source", chunk.name),
                         ("url", r.url), ("warc_record_id", r.warc_record_id), ("date", r.date), ("meta", r.meta)):
                batch[k].append(v)
            c["docs"] += 1
            if len(batch["seq"]) >= _BATCH:
                flush(w, batch)
        flush(w, batch)
    maybe_fail("ingest-read")
    return {"no": chunk.no, "name": chunk.name, "fmt": chunk.fmt, "counts": dict(c), "reasons": dict(reasons),
            "skipped": {k: v for k, v in skipped.items() if k}, "sample": sample, "sha256": range_sha256(chunk),
            "dir": str(part_dir)}


def flush(w: pq.ParquetWriter, batch: dict[str, list]) -> None:
    if batch["seq"]:
        w.write_table(pa.table(batch, schema=PART_SCHEMA))
        for v in batch.values():
            v.clear()


def write_docs(job: tuple[int, int, int, str], max_docs: int | None, out: str,
               qualify: frozenset[str] = frozenset()) -> tuple[int, str]:
    """Pass 2, on an executor: chunk ``no``'s docs (pass 1's files in ``parts``) get ``idx`` = doc offset + seq
    and, without an id, ``<source>:<line>`` (line offset + line); an id in ``qualify`` (one that repeats) becomes
    ``<source>:<line>#<id>``. Writes ``docs/part-NNNNN.parquet`` and ``quarantine/part-NNNNN.jsonl`` (line numbers
    made file-global) in an attempt directory under ``out``; returns how many docs it wrote (``max_docs`` may cut
    the last ones) and that directory."""
    no, doc_off, line_off, parts = job
    mine = attempt_dir(out)
    (mine / "docs").mkdir()
    (mine / "quarantine").mkdir()
    write_quarantine(no, line_off, Path(parts), mine / "quarantine")
    n = write_part(pq.read_table(f"{parts}/docs-{no:05d}.parquet"), no, doc_off, line_off, max_docs, qualify,
                   mine / "docs")
    maybe_fail("ingest-write")
    return n, str(mine)


def write_part(t: pa.Table, no: int, doc_off: int, line_off: int, max_docs: int | None, qualify: frozenset[str],
               out: Path) -> int:
    """One chunk's docs with their final ``idx`` and ``id``, as ``out/part-NNNNN.parquet``; returns how many."""
    idx = pc.add(t.column("seq"), doc_off)
    if max_docs is not None:
        keep = pc.less(idx, max_docs)
        t, idx = t.filter(keep), idx.filter(keep)
    if t.num_rows == 0:
        return 0
    at = pc.binary_join_element_wise(t.column("source"), pc.cast(pc.add(t.column("line"), line_off), pa.string()), ":")
    ids = t.column("id")
    if qualify:
        repeated = pc.is_in(ids, value_set=pa.array(sorted(qualify), pa.string()))
        ids = pc.if_else(pc.fill_null(repeated, False), pc.binary_join_element_wise(at, ids, "#"), ids)
    t = t.set_column(t.schema.get_field_index("id"), "id", pc.coalesce(ids, at))
    t = t.drop_columns(["seq", "line"]).add_column(0, "idx", idx)
    pq.write_table(t.select(DOCS_SCHEMA.names).cast(DOCS_SCHEMA), f"{out}/part-{no:05d}.parquet",
                   compression="zstd")
    return t.num_rows


def write_quarantine(no: int, line_off: int, parts: Path, dest: Path) -> None:
    """Chunk ``no``'s quarantine part, its line numbers made file-global (nothing written when it is empty)."""
    src = parts / f"quarantine-{no:05d}.jsonl"
    if not src.stat().st_size:
        return
    with open(src, encoding="utf-8") as f, open(dest / f"part-{no:05d}.jsonl", "w", encoding="utf-8") as out:
        for line in f:
            if line_off:
                q = json.loads(line)
                q["line"] += line_off
                line = json.dumps(q, ensure_ascii=False) + "\n"
            out.write(line)


def offsets(results: list[dict]) -> list[tuple[int, int, int, str]]:
    """(chunk no, docs before it, lines before it in the same input, its pass-1 directory) for every chunk, in input
    order (a WARC record's location is its byte offset in the file already: no line offset)."""
    jobs, docs, lines, prev = [], 0, 0, None
    for r in sorted(results, key=lambda r: r["no"]):
        if r["name"] != prev:
            lines, prev = 0, r["name"]
        jobs.append((r["no"], docs, lines, r["dir"]))
        docs += r["counts"].get("docs", 0)
        lines += r["counts"].get("physical_lines", 0) if r["fmt"] == "jsonl" else 0
    return jobs


def repeated_ids(spark, docs_dir: Path, limit: int = 100_000) -> list[str]:
    """Ids that more than one doc has (found by the executors; at most ``limit`` come back)."""
    from pyspark.sql import functions as F

    return [r["id"] for r in spark.read.parquet(str(docs_dir)).groupBy("id").count()
            .where(F.col("count") > 1).select("id").limit(limit).collect()]


def ingest(spark, sources: list, out_dir: Path, cfg: IngestCfg, fields: InputFieldsCfg | None = None) -> dict:
    """Write docs/ and quarantine/ under out_dir on Spark; return counts. Ids are checked for uniqueness at the
    end: an id given by the data that repeats (across inputs or within one) is qualified by where each copy was
    read, ``<source>:<line>#<id>``, and the docs are written again."""
    try:
        chunks = plan_chunks(sources, cfg.chunk_mb)
    except ObjectChanged as e:  # a Parquet footer read from another version than the one listed
        raise InputUnavailable(str(e)) from None
    parts, docs_dir, q_dir = out_dir / "_parts", out_dir / "docs", out_dir / "quarantine"
    if not chunks:  # nothing new to read
        for d in (docs_dir, q_dir):
            d.mkdir()
        pq.write_table(DOCS_SCHEMA.empty_table(), docs_dir / "part-00000.parquet")
        return totals([], 0, 0) | {"qualified_ids": 0, "cut_inputs": 0}, {}, [], []
    sc = spark.sparkContext
    results = sc.parallelize(chunks, len(chunks)).map(
        partial(read_chunk, cfg=cfg, parts=prepare_attempts(parts), fields=fields,
                attempts=task_attempts(spark))).collect()
    changed = [r["changed"] for r in results if "changed" in r]
    if changed:
        raise InputUnavailable(f"{len(changed)} chunk(s) read an input that changed since it was listed: "
                               f"{changed[0]}")
    unanswered = [r["unavailable"] for r in results if "unavailable" in r]
    if unanswered:
        raise InputUnavailable(f"{len(unanswered)} of {len(results)} chunk(s) could not be read: {unanswered[0]}; "
                               "run it again")
    jobs = offsets(results)
    qualify: frozenset[str] = frozenset()
    for attempt in range(2):
        for d in (docs_dir, q_dir):
            shutil.rmtree(d, ignore_errors=True)
        got = sc.parallelize(jobs, len(jobs)).map(
            partial(write_docs, max_docs=cfg.max_docs, out=prepare_attempts(out_dir / "_out"), qualify=qualify)
        ).collect()
        publish_attempts(out_dir / "_out", [d for _, d in got], {"docs": docs_dir, "quarantine": q_dir})
        written = [n for n, _ in got]
        if not sum(written):  # readers of an empty corpus still find the schema
            pq.write_table(DOCS_SCHEMA.empty_table(), docs_dir / "part-00000.parquet")
        again = repeated_ids(spark, docs_dir)
        if not again:
            break
        if attempt:
            raise IngestError(f"doc ids still repeat after qualifying them by input and line: {again[:5]}")
        qualify = frozenset(again)
    shutil.rmtree(parts)
    shutil.rmtree(out_dir / "_out")
    cut = cut_inputs(results, written)
    return {**totals(results, sum(written), len(chunks)), "qualified_ids": len(qualify), "cut_inputs": len(cut)}, \
        input_digests(results), [q for r in sorted(results, key=lambda r: r["no"]) for q in r["sample"]][:200], cut


def cut_inputs(results: list[dict], written: list[int]) -> list[str]:
    """The inputs (keys) that ``max_docs`` cut: a chunk of theirs wrote fewer docs than it read. They are not read
    whole, so no corpus version may hold them (the next curation reads them again)."""
    ordered = sorted(results, key=lambda r: r["no"])
    return sorted({r["name"] for r, n in zip(ordered, written) if n < r["counts"].get("docs", 0)})


def input_digests(results: list[dict]) -> dict[str, str]:
    """{input key: sha256 over its chunks' digests, in order}: what the tasks read, for the manifest."""
    by: dict[str, list[str]] = {}
    for r in sorted(results, key=lambda r: r["no"]):
        by.setdefault(r["name"], []).append(r["sha256"])
    return {k: v[0] if len(v) == 1 else hashlib.sha256("".join(v).encode()).hexdigest() for k, v in by.items()}


def totals(results: list[dict], written: int, chunks: int) -> dict:
    c, reasons, skipped = Counter(), Counter(), Counter()
    for r in results:
        c.update(r["counts"])
        reasons.update(r["reasons"])
        skipped.update(r["skipped"])
    out = {k: c.get(k, 0) for k in ("lines", "warc_records", "text_files", "parquet_rows", "quarantined",
                                    "blank_lines")}
    out["records"] = out["lines"] + out["warc_records"] + out["text_files"] + out["parquet_rows"]
    out["docs"], out["over_max_docs"] = written, c.get("docs", 0) - written
    out.update(quarantine_reasons=dict(sorted(reasons.items())), skipped_records=dict(sorted(skipped.items())),
               chunks=chunks)
    assert out["records"] == out["docs"] + out["quarantined"] + out["over_max_docs"], out
    return out


def run(spec: JobSpec, out_dir: str | None = None, spark=None, corpus: Manifest | None = None) -> Manifest:
    """Ingest ``data.inputs``; with ``corpus`` (a corpus version), only the inputs it does not hold yet (by
    identity)."""
    refused: list[dict] = []  # S3 objects whose keys could lead outside the cache: never read
    inputs = resolve(spec, spec.data.inputs, refused)  # local files, globs, s3:// prefixes (copied, or read by tasks)
    cfg = spec.data.ingest
    if corpus is not None and not isinstance(corpus.extra.get("corpus"), dict):
        raise IngestError(f"--corpus-manifest {corpus.path} is a {corpus.stage} result, not a corpus version (the "
                          "tokenize manifest of a curation run); pass one, or leave it out for a first version")
    held = set(corpus.extra["corpus"].get("inputs", [])) if corpus is not None else set()
    new = [s for s in inputs if s.ref()["sha256"] not in held]
    if corpus is not None:
        print(f"ingest: {len(inputs) - len(new)} of {len(inputs)} inputs are in corpus version "
              f"{corpus.extra['corpus']['version']} already; reading {len(new)}", flush=True)
    # the inputs' identity comes from their listing (key, size, mtime or ETag): the driver reads no input byte;
    # the tasks hash what they read, and the manifest keeps those digests
    sd = stage_dir(spec, "ingest", [s.ref() for s in new] + ([input_ref(corpus)] if corpus is not None else []),
                   out_dir)
    inputs = new

    def body(tmp: Path) -> Manifest:
        from pipelines.data.spark import spec_session

        s = spark or (spec_session(spec, "llm-pipeline-ingest") if inputs else None)  # no new input: no Spark
        counts, digests, sample, cut = ingest(s, inputs, tmp, cfg, spec.data.input_fields)
        (tmp / "quarantine_sample.jsonl").write_text("".join(json.dumps(q, ensure_ascii=False) + "\n"
                                                             for q in sample), encoding="utf-8")
        return sd.commit({"docs": "docs", "quarantine": "quarantine", "quarantine_sample": "quarantine_sample.jsonl"},
                         counts={**counts, "refused_inputs": len(refused)},
                         extra={"spark_master": s.sparkContext.master if s is not None else "none (no new input)",
                                "input_sha256": digests,
                                "refused_inputs": refused,
                                "cut_inputs": [i.ref()["sha256"] for i in inputs if i.name in cut]})

    return run_and_log(spec, sd, body, artifacts=["quarantine_sample"])


def read_quarantine(m: Manifest) -> list[dict]:
    """Every quarantine entry of an ingest result, in input order."""
    return [json.loads(line) for f in sorted(m.output("quarantine").glob("part-*.jsonl"))
            for line in f.read_text(encoding="utf-8").splitlines()]


def summary(m: Manifest) -> str:
    c = m.counts
    refused = f"; refused {c['refused_inputs']} input(s): " + ", ".join(r["uri"] for r in m.extra["refused_inputs"]) \
        if c.get("refused_inputs") else ""
    return (f"ingest: {c['records']} records in {c['chunks']} chunks → {c['docs']} docs, {c['quarantined']} "
            f"quarantined {c['quarantine_reasons']}{refused}; manifest {m.path}")


def _inputs(ap) -> None:
    ap.add_argument("--input", action="append", default=None,
                    help="Input file (JSONL, .parquet, .warc.gz, .warc.wet.gz …), directory, glob or "
                         "s3://bucket/prefix (repeatable); overrides data.inputs.")


def _options(ap) -> None:
    _inputs(ap)
    add_corpus_arg(ap)


def _call(spec: JobSpec, args, ups) -> Manifest:
    if args.input:
        try:
            spec.data.inputs = args.input  # validated like data.inputs
        except ValidationError as e:
            raise SpecError("--input: " + "; ".join(x["msg"].removeprefix("Value error, ") for x in e.errors())) \
                from None
    return run(spec, args.output, corpus=corpus_arg(args))


def main(argv: list[str] | None = None) -> int:
    return stage_main("ingest", run, summary, argv, add_args=_options, call=_call)


if __name__ == "__main__":
    sys.exit(main())
