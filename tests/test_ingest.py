import base64
import gzip
import json

import pyarrow.parquet as pq
import pytest
import zstandard

from pipelines.data import ingest
from pipelines.data.sources import IngestError
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
    with pytest.raises(IngestError, match="missing.jsonl.*fix data.inputs"):
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


def test_s3_prefix_globs_and_directories_give_the_same_result_as_the_local_files(home, s3_server):
    """The same bytes from S3 (through the project's client) and from disk: same stage key, same digest."""
    from pipelines.storage.s3 import client, ensure_bucket

    recs = [{"id": f"r{i}", "text": f"document number {i} " * 3} for i in range(30)]
    half = ["".join(json.dumps(r) + "\n" for r in part).encode() for part in (recs[:15], recs[15:])]
    (home / "in").mkdir()
    (home / "in" / "a.jsonl.gz").write_bytes(gzip.compress(half[0]))
    (home / "in" / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(half[1]))
    (home / "in" / "README.txt").write_text("not data")
    sets = [f"services.s3_endpoint_url={s3_server}", "services.s3_bucket=raw"]
    s3 = client(load_spec(None, sets, env={}))
    ensure_bucket(s3, "raw")
    for f in ("a.jsonl.gz", "b.jsonl.zst"):
        s3.upload_file(str(home / "in" / f), "raw", f"crawl/2026/{f}")
    s3.put_object(Bucket="raw", Key="crawl/2026/_SUCCESS", Body=b"")

    local = ingest.run(load_spec(None, sets + [f"data.inputs=[{home / 'in' / 'a.jsonl.gz'}, "
                                               f"{home / 'in' / 'b.jsonl.zst'}]"], env={}))
    from_s3 = ingest.run(load_spec(None, sets + ["data.inputs=[s3://raw/crawl/2026/]", "run.force=true"], env={}))
    assert from_s3.counts["docs"] == 30 and from_s3.digest == local.digest and from_s3.path == local.path
    assert [i["uri"] for i in from_s3.inputs] == ["s3://raw/crawl/2026/a.jsonl.gz", "s3://raw/crawl/2026/b.jsonl.zst"]
    for pattern in (f"{home}/in/*.jsonl.*", f"{home}/in"):  # a glob, a directory (README.txt is not data)
        m = ingest.run(load_spec(None, sets + [f"data.inputs=['{pattern}']"], env={}))
        assert m.digest == local.digest, pattern
    with pytest.raises(IngestError, match="s3://raw/nothing/here.*no JSONL objects"):
        ingest.run(load_spec(None, sets + ["data.inputs=[s3://raw/nothing/here]"], env={}))
