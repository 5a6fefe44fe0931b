"""Ingest: JSONL (plain, .gz, .zst) → ``docs.parquet`` + ``quarantine.jsonl``.

Every non-blank input line ends up in exactly one of the two outputs:

* ``docs.parquet``: ``idx`` (int64, dense, input order), ``id`` (the record's id field as a
  string, or ``<file>:<line>`` when it has none), ``text``, ``source`` (input file name).
* ``quarantine.jsonl``: ``{source, line, reason, detail, raw | raw_b64}`` with reason one of
  ``invalid_utf8``, ``invalid_json``, ``not_an_object``, ``missing_text``, ``text_not_string``,
  ``empty_text``. The raw line is kept (base64 when it is not UTF-8), so nothing is lost.

``counts``: ``lines`` = ``docs`` + ``quarantined`` (+ ``blank_lines`` that hold no record).
"""
from __future__ import annotations

import base64
import gzip
import io
import json
import sys
from collections import Counter
from pathlib import Path
from typing import BinaryIO, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.cli import run_and_log, stage_dir, stage_main
from pipelines.data.sources import resolve
from pipelines.manifest import Manifest, file_ref
from pipelines.spec import JobSpec
from pipelines.progress import progress

DOCS_SCHEMA = pa.schema([
    ("idx", pa.int64()), ("id", pa.string()), ("text", pa.string()), ("source", pa.string()),
])
_BATCH = 2048




def open_binary(path: Path) -> BinaryIO:
    """Open plain, gzip or zstd files by extension, as a binary line stream."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst") or name.endswith(".zstd"):
        import zstandard

        raw = open(path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")


def classify(line: bytes, text_field: str, min_chars: int) -> tuple[str | None, dict | str]:
    """Return (None, record) for a good line, else (reason, detail)."""
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return "invalid_utf8", f"{e.reason} at byte {e.start}"
    try:
        rec = json.loads(s)
    except json.JSONDecodeError as e:
        return "invalid_json", f"{e.msg} at char {e.pos}"
    if not isinstance(rec, dict):
        return "not_an_object", f"got {type(rec).__name__}"
    if text_field not in rec:
        return "missing_text", f"no {text_field!r} field (fields: {sorted(rec)[:8]})"
    text = rec[text_field]
    if not isinstance(text, str):
        return "text_not_string", f"{text_field!r} is {type(text).__name__}"
    if len(text.strip()) < min_chars:
        return "empty_text", f"{len(text.strip())} chars after strip"
    # Lone surrogates (valid JSON escapes, invalid Unicode) cannot be written as UTF-8 later.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return "invalid_utf8", f"lone surrogate in text: {e.reason}"
    return None, rec


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with open_binary(path) as f:
        for n, line in enumerate(f, start=1):
            yield n, line.rstrip(b"\r\n")


def ingest(inputs: list, out_dir: Path, text_field: str = "text", id_field: str = "id",
           max_docs: int | None = None, min_chars: int = 1) -> dict:
    """Write docs.parquet and quarantine.jsonl under out_dir; return counts."""
    counts: Counter = Counter()
    reasons: Counter = Counter()
    idx = 0
    writer = pq.ParquetWriter(out_dir / "docs.parquet", DOCS_SCHEMA, compression="zstd")
    batch: dict[str, list] = {k: [] for k in DOCS_SCHEMA.names}

    def flush() -> None:
        if batch["idx"]:
            writer.write_table(pa.table(batch, schema=DOCS_SCHEMA))
            for v in batch.values():
                v.clear()

    with open(out_dir / "quarantine.jsonl", "w", encoding="utf-8") as qf, \
            progress(desc="ingest", unit="doc") as bar:
        for source in inputs:  # pipelines.data.sources.Source: its name is each doc's `source`
            src = source.name
            for line_no, line in iter_lines(source.path):
                if max_docs is not None and counts["docs"] >= max_docs:
                    break
                if not line.strip():
                    counts["blank_lines"] += 1
                    continue
                counts["lines"] += 1
                reason, rec = classify(line, text_field, min_chars)
                if reason is not None:
                    q = {"source": src, "line": line_no, "reason": reason, "detail": rec}
                    try:
                        q["raw"] = line.decode("utf-8")
                    except UnicodeDecodeError:
                        q["raw_b64"] = base64.b64encode(line).decode("ascii")
                    qf.write(json.dumps(q, ensure_ascii=False) + "\n")
                    counts["quarantined"] += 1
                    reasons[reason] += 1
                    continue
                rid = rec.get(id_field)
                batch["idx"].append(idx)
                batch["id"].append(str(rid) if rid is not None else f"{src}:{line_no}")
                batch["text"].append(rec[text_field])
                batch["source"].append(src)
                idx += 1
                counts["docs"] += 1
                bar.update(1)
                if len(batch["idx"]) >= _BATCH:
                    flush()
    flush()
    writer.close()
    out = dict(counts)
    for k in ("lines", "docs", "quarantined", "blank_lines"):
        out.setdefault(k, 0)
    out["quarantine_reasons"] = dict(sorted(reasons.items()))
    assert out["lines"] == out["docs"] + out["quarantined"], out
    return out


def run(spec: JobSpec, out_dir: str | None = None) -> Manifest:
    inputs = resolve(spec, spec.data.inputs)  # local files, globs, s3:// prefixes (copied into run.root/cache)
    cfg = spec.data.ingest
    # the inputs' identity is their bytes (and order), not where they live: the same files from S3 or disk give
    # the same stage key and digest; the manifest records where each came from
    sd = stage_dir(spec, "ingest", [{**file_ref(s.path), "uri": s.uri} for s in inputs], out_dir)

    def body(tmp: Path) -> Manifest:
        counts = ingest(inputs, tmp, cfg.text_field, cfg.id_field, cfg.max_docs, cfg.min_chars)
        return sd.commit({"docs": "docs.parquet", "quarantine": "quarantine.jsonl"}, counts=counts)

    return run_and_log(spec, sd, body, artifacts=["quarantine"])


def summary(m: Manifest) -> str:
    c = m.counts
    return (f"ingest: {c['lines']} records → {c['docs']} docs, {c['quarantined']} quarantined "
            f"{c['quarantine_reasons']}; manifest {m.path}")


def _inputs(ap) -> None:
    ap.add_argument("--input", action="append", default=None,
                    help="Input file, directory, glob or s3://bucket/prefix (repeatable); overrides data.inputs.")


def _call(spec: JobSpec, args, ups) -> Manifest:
    if args.input:
        spec.data.inputs = args.input
    return run(spec, args.output)


def main(argv: list[str] | None = None) -> int:
    return stage_main("ingest", run, summary, argv, add_args=_inputs, call=_call)


if __name__ == "__main__":
    sys.exit(main())
