import base64
import gzip
import json

import pyarrow.parquet as pq
import pytest
import zstandard

from pipelines.data import ingest
from pipelines.spec import load_spec


def _bad_file(path):
    lines = [
        json.dumps({"id": "good-1", "text": "A perfectly fine document."}).encode(),
        b'{"id": "broken", "text": "unterminated',                       # invalid JSON
        b'{"id": "latin1", "text": "caf\xe9"}',                             # invalid UTF-8
        json.dumps({"id": "empty", "text": "   "}).encode(),               # empty text
        json.dumps({"id": "nofield", "body": "text lives elsewhere"}).encode(),  # missing field
        json.dumps(["not", "an", "object"]).encode(),                      # not an object
        json.dumps({"id": "num", "text": 42}).encode(),                    # text not a string
        b'{"id": "surrogate", "text": "bad \\ud800 half"}',                # lone surrogate
        b"",                                                               # blank line: no record
        json.dumps({"text": "Another good one, without an id."}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_quarantines_bad_records_with_reasons_and_loses_nothing(home):
    src = _bad_file(home / "bad.jsonl")
    spec = load_spec(None, [f"data.inputs=[{src}]"], env={})
    m = ingest.run(spec)
    c = m.counts
    assert c["lines"] == 9 and c["blank_lines"] == 1
    assert c["docs"] == 2 and c["quarantined"] == 7
    assert c["lines"] == c["docs"] + c["quarantined"]
    assert c["quarantine_reasons"] == {"empty_text": 1, "invalid_json": 1, "invalid_utf8": 2, "missing_text": 1,
                                       "not_an_object": 1, "text_not_string": 1}
    q = [json.loads(x) for x in m.output("quarantine").read_text().splitlines()]
    latin = next(r for r in q if r["line"] == 3)
    assert latin["reason"] == "invalid_utf8"
    assert base64.b64decode(latin["raw_b64"]) == b'{"id": "latin1", "text": "caf\xe9"}'  # raw bytes kept
    assert all(("raw" in r) or ("raw_b64" in r) for r in q)
    docs = pq.read_table(m.output("docs")).to_pylist()
    assert [d["id"] for d in docs] == ["good-1", "bad.jsonl:10"]  # ids preserved, else file:line
    assert [d["idx"] for d in docs] == [0, 1]


def test_reads_gzip_and_zstd(home):
    recs = [{"id": str(i), "text": f"document number {i}"} for i in range(5)]
    raw = "".join(json.dumps(r) + "\n" for r in recs).encode()
    (home / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (home / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    spec = load_spec(None, [f"data.inputs=[{home / 'a.jsonl.gz'}, {home / 'b.jsonl.zst'}]"], env={})
    m = ingest.run(spec)
    assert m.counts["docs"] == 10 and m.counts["quarantined"] == 0


def test_missing_input_fails_fast_with_the_fix(home):
    spec = load_spec(None, ["data.inputs=[nope/missing.jsonl]"], env={})
    with pytest.raises(ingest.IngestError, match="missing.jsonl.*fix data.inputs"):
        ingest.run(spec)


def test_rerun_is_idempotent_and_skips_done_work(home):
    src = _bad_file(home / "bad.jsonl")
    spec = load_spec(None, [f"data.inputs=[{src}]"], env={})
    m1 = ingest.run(spec)
    mtime = m1.output("docs").stat().st_mtime_ns
    m2 = ingest.run(spec)
    assert m2.path == m1.path and m2.output("docs").stat().st_mtime_ns == mtime  # not rewritten
    m1.output("docs").write_bytes(b"corrupted")  # a damaged output is recomputed, not trusted
    m3 = ingest.run(spec)
    assert pq.read_table(m3.output("docs")).num_rows == 2
