"""Ingest on Spark: JSONL (plain, .gz, .zst), WARC and WET (local, globs, ``s3://``) → ``docs/`` +
``quarantine.jsonl``.

Every input is cut into splits (:mod:`pipelines.data.formats`: large plain JSONL files by byte range, anything else
whole), one Spark task each. Two passes keep ``idx`` dense and deterministic whatever the number of executors:

1. each task reads its split and writes its documents (numbered from 0 within the split) and its quarantined
   records to a part file, and returns its counts;
2. the driver turns the counts into offsets (docs before the split; lines before it in the same file), and each
   task writes ``docs/part-NNNNN.parquet`` with ``idx`` = offset + its number. The quarantine parts are joined
   in input order.

Outputs:

* ``docs/``: ``idx`` (int64, dense, input order), ``id`` (the record's id field as a string; a WARC record's
  ``WARC-Record-ID``; else ``<file>:<line>``), ``text``, ``source`` (input file name), ``url``,
  ``warc_record_id``, ``date`` (null where the format has none).
* ``quarantine.jsonl``: ``{source, line | offset, reason, detail, raw | raw_b64, …}``. JSONL reasons:
  ``invalid_utf8``, ``invalid_json``, ``not_an_object``, ``missing_text``, ``text_not_string``, ``empty_text``.
  WARC reasons: ``bad_record`` (a member that does not decompress or parse; its bytes are kept), ``bad_http``,
  ``http_status`` (not 200), ``not_html``, ``extract_failed``, ``empty_text`` (nothing left after extraction).

``counts``: ``records`` = ``docs`` + ``quarantined`` + ``over_max_docs``; ``records`` = ``lines`` (JSONL records)
+ ``warc_records`` (WARC response/resource/conversion records). ``blank_lines`` and ``skipped_records`` (WARC
requests, warcinfo, metadata …, by type) hold no document.
"""
from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.cli import run_and_log, stage_dir, stage_main
from pipelines.data.formats import Split, plan, rows
from pipelines.data.sources import resolve
from pipelines.manifest import Manifest
from pipelines.spec import IngestCfg, JobSpec, SpecError

META = ("url", "warc_record_id", "date")
DOCS_SCHEMA = pa.schema([("idx", pa.int64()), ("id", pa.string()), ("text", pa.string()), ("source", pa.string()),
                         *((m, pa.string()) for m in META)])
PART_SCHEMA = pa.schema([("seq", pa.int64()), ("line", pa.int64()), *(f for f in DOCS_SCHEMA if f.name != "idx")])
_BATCH = 2048


def read_split(split: Split, cfg: IngestCfg, parts: str) -> dict:
    """Pass 1, on an executor: one split → ``parts/docs-NNNNN.parquet`` + ``parts/quarantine-NNNNN.jsonl``."""
    c: Counter = Counter()
    reasons: Counter = Counter()
    skipped: Counter = Counter()
    batch: dict[str, list] = {k: [] for k in PART_SCHEMA.names}
    record_kind = "lines" if split.fmt == "jsonl" else "warc_records"
    with pq.ParquetWriter(f"{parts}/docs-{split.no:05d}.parquet", PART_SCHEMA, compression="zstd") as w, \
            open(f"{parts}/quarantine-{split.no:05d}.jsonl", "w", encoding="utf-8") as qf:
        for r in rows(split, cfg):
            c["physical_lines"] += 1
            if r is None or isinstance(r, str):  # a blank JSONL line; a WARC record that is not a document
                c["blank_lines"] += r is None
                skipped[r] += r is not None
                continue
            c[record_kind] += 1
            if r.reason:
                where = {"line": r.loc} if split.fmt == "jsonl" else {}
                qf.write(json.dumps({"source": split.name, **where, "reason": r.reason, **r.q}, ensure_ascii=False)
                         + "\n")
                c["quarantined"] += 1
                reasons[r.reason] += 1
                continue
            for k, v in (("seq", c["docs"]), ("line", r.loc), ("id", r.id), ("text", r.text), ("source", split.name),
                         ("url", r.url), ("warc_record_id", r.warc_record_id), ("date", r.date)):
                batch[k].append(v)
            c["docs"] += 1
            if len(batch["seq"]) >= _BATCH:
                flush(w, batch)
        flush(w, batch)
    return {"no": split.no, "name": split.name, "fmt": split.fmt, "counts": dict(c), "reasons": dict(reasons),
            "skipped": {k: v for k, v in skipped.items() if k}}


def flush(w: pq.ParquetWriter, batch: dict[str, list]) -> None:
    if batch["seq"]:
        w.write_table(pa.table(batch, schema=PART_SCHEMA))
        for v in batch.values():
            v.clear()


def write_docs(job: tuple[int, int, int], max_docs: int | None, parts: str, out: str) -> int:
    """Pass 2, on an executor: split ``no``'s docs get ``idx`` = doc offset + seq and, without an id,
    ``<file>:<line>`` (line offset + line); returns how many were written (``max_docs`` may cut the last ones)."""
    no, doc_off, line_off = job
    t = pq.read_table(f"{parts}/docs-{no:05d}.parquet")
    idx = pc.add(t.column("seq"), doc_off)
    if max_docs is not None:
        keep = pc.less(idx, max_docs)
        t, idx = t.filter(keep), idx.filter(keep)
    if t.num_rows == 0:
        return 0
    named = pc.binary_join_element_wise(t.column("source"), pc.cast(pc.add(t.column("line"), line_off), pa.string()),
                                        ":")
    t = t.set_column(t.schema.get_field_index("id"), "id", pc.coalesce(t.column("id"), named))
    t = t.drop_columns(["seq", "line"]).add_column(0, "idx", idx)
    pq.write_table(t.select(DOCS_SCHEMA.names).cast(DOCS_SCHEMA), f"{out}/part-{no:05d}.parquet",
                   compression="zstd")
    return t.num_rows


def offsets(results: list[dict]) -> list[tuple[int, int, int]]:
    """(split no, docs before it, lines before it in the same file) for every split, in input order (a WARC
    record's location is its byte offset in the file already: no line offset)."""
    jobs, docs, lines, prev = [], 0, 0, None
    for r in sorted(results, key=lambda r: r["no"]):
        if (r["name"], r["fmt"]) != prev:
            lines, prev = 0, (r["name"], r["fmt"])
        jobs.append((r["no"], docs, lines))
        docs += r["counts"].get("docs", 0)
        lines += r["counts"].get("physical_lines", 0) if r["fmt"] == "jsonl" else 0
    return jobs


def join_quarantine(jobs: list[tuple[int, int, int]], parts: Path, dest: Path) -> None:
    """The splits' quarantine parts, in input order, their line numbers made file-global."""
    with open(dest, "w", encoding="utf-8") as out:
        for no, _, line_off in jobs:
            with open(parts / f"quarantine-{no:05d}.jsonl", encoding="utf-8") as f:
                for line in f:
                    if line_off:
                        q = json.loads(line)
                        q["line"] += line_off
                        line = json.dumps(q, ensure_ascii=False) + "\n"
                    out.write(line)


def ingest(spark, sources: list, out_dir: Path, cfg: IngestCfg) -> dict:
    """Write docs/ and quarantine.jsonl under out_dir on Spark; return counts."""
    splits = plan(sources, cfg.split_mb)
    parts, docs_dir = out_dir / "_parts", out_dir / "docs"
    parts.mkdir()
    docs_dir.mkdir()
    sc = spark.sparkContext
    results = sc.parallelize(splits, len(splits)).map(partial(read_split, cfg=cfg, parts=str(parts))).collect()
    jobs = offsets(results)
    written = sc.parallelize(jobs, len(jobs)).map(
        partial(write_docs, max_docs=cfg.max_docs, parts=str(parts), out=str(docs_dir))).collect()
    if not sum(written):  # readers of an empty corpus still find the schema
        pq.write_table(DOCS_SCHEMA.empty_table(), docs_dir / "part-00000.parquet")
    join_quarantine(jobs, parts, out_dir / "quarantine.jsonl")
    shutil.rmtree(parts)
    return totals(results, sum(written), len(splits))


def totals(results: list[dict], written: int, splits: int) -> dict:
    c, reasons, skipped = Counter(), Counter(), Counter()
    for r in results:
        c.update(r["counts"])
        reasons.update(r["reasons"])
        skipped.update(r["skipped"])
    out = {k: c.get(k, 0) for k in ("lines", "warc_records", "quarantined", "blank_lines")}
    out["records"] = out["lines"] + out["warc_records"]
    out["docs"], out["over_max_docs"] = written, c.get("docs", 0) - written
    out.update(quarantine_reasons=dict(sorted(reasons.items())), skipped_records=dict(sorted(skipped.items())),
               splits=splits)
    assert out["records"] == out["docs"] + out["quarantined"] + out["over_max_docs"], out
    return out


def run(spec: JobSpec, out_dir: str | None = None, spark=None) -> Manifest:
    inputs = resolve(spec, spec.data.inputs)  # local files, globs, s3:// prefixes (copied, or read by the tasks)
    cfg = spec.data.ingest
    # the inputs' identity is their bytes (and order), not where they live: the same files from S3 or disk give
    # the same stage key and digest; the manifest records where each came from
    sd = stage_dir(spec, "ingest", [s.ref() for s in inputs], out_dir)

    def body(tmp: Path) -> Manifest:
        from pipelines.data.spark import get_spark

        s = spark or get_spark(spec.services.spark_master, "llm-pipeline-ingest", spec.services.spark_driver_memory)
        counts = ingest(s, inputs, tmp, cfg)
        return sd.commit({"docs": "docs", "quarantine": "quarantine.jsonl"}, counts=counts,
                         extra={"spark_master": s.sparkContext.master})

    return run_and_log(spec, sd, body, artifacts=["quarantine"])


def summary(m: Manifest) -> str:
    c = m.counts
    return (f"ingest: {c['records']} records in {c['splits']} splits → {c['docs']} docs, {c['quarantined']} "
            f"quarantined {c['quarantine_reasons']}; manifest {m.path}")


def _inputs(ap) -> None:
    ap.add_argument("--input", action="append", default=None,
                    help="Input file (JSONL, .warc.gz, .warc.wet.gz …), directory, glob or s3://bucket/prefix "
                         "(repeatable); overrides data.inputs.")


def _call(spec: JobSpec, args, ups) -> Manifest:
    if args.input:
        from pydantic import ValidationError

        try:
            spec.data.inputs = args.input  # validated like data.inputs
        except ValidationError as e:
            raise SpecError("--input: " + "; ".join(x["msg"].removeprefix("Value error, ") for x in e.errors())) \
                from None
    return run(spec, args.output)


def main(argv: list[str] | None = None) -> int:
    return stage_main("ingest", run, summary, argv, add_args=_inputs, call=_call)


if __name__ == "__main__":
    sys.exit(main())
