"""Parquet input for ingest: row groups as Spark tasks, the data.input_fields mapping (FineWeb's names by default),
the other columns kept as each doc's meta, rows and files that do not read quarantined with their reasons."""
import datetime
import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.data import formats, ingest
from pipelines.data.sources import Source
from pipelines.spec import SpecError, load_spec

FINEWEB = pa.schema([("text", pa.string()), ("id", pa.string()), ("dump", pa.string()), ("url", pa.string()),
                     ("date", pa.string()), ("file_path", pa.string()), ("language", pa.string()),
                     ("language_score", pa.float64()), ("token_count", pa.int64())])


def fineweb_file(path, start: int = 0, n: int = 30, group: int = 10, **change):
    """``n`` FineWeb-shaped rows in row groups of ``group``; ``change``: {column: {row: value}}."""
    rows = [{"text": f"FineWeb-shaped document number {i}. " * 6, "id": f"<urn:uuid:{i:08d}>",
             "dump": "CC-MAIN-2024-10", "url": f"https://example.org/{i}", "date": f"2024-02-2{i % 10}T12:00:00Z",
             "file_path": f"s3://commoncrawl/crawl-data/CC-MAIN-2024-10/{i}.warc.gz", "language": "en",
             "language_score": 0.5 + i / 1000, "token_count": 60 + i} for i in range(start, start + n)]
    for col, at in change.items():
        for k, v in at.items():
            rows[k][col] = v
    pq.write_table(pa.Table.from_pylist(rows, FINEWEB), path, row_group_size=group)
    return path


def chunk_digest(path) -> str:
    """What ingest records for a Parquet file: its row-group chunks' byte ranges tile the file, and the digest is
    the sha256 of their digests in order (one chunk: the file's own sha256)."""
    chunks = formats.plan_chunks([Source.of_file(path)], 64)
    raw = path.read_bytes()
    assert chunks[0].start == 0 and all(a.end == b.start for a, b in zip(chunks, chunks[1:])) \
        and chunks[-1].end is None  # no gap, no overlap
    parts = [hashlib.sha256(raw[c.start:c.end]).hexdigest() for c in chunks]
    return parts[0] if len(parts) == 1 else hashlib.sha256("".join(parts).encode()).hexdigest()


def test_a_folder_of_parquet_files_row_groups_as_tasks_meta_kept_and_broken_files_quarantined(home, spark):
    d = home / "in"
    d.mkdir()
    fw = fineweb_file(d / "fineweb.parquet", text={4: None, 7: "   "}, id={12: None})
    broken = fineweb_file(d / "corrupt.parquet", start=100, n=20)
    first = pq.read_metadata(broken).row_group(0).column(0)
    at = first.dictionary_page_offset if first.has_dictionary_page else first.data_page_offset
    raw = bytearray(broken.read_bytes())
    raw[at:at + 64] = bytes(64)  # row group 0's first page header: zeros
    broken.write_bytes(bytes(raw))
    (d / "truncated.parquet").write_bytes(fw.read_bytes()[: fw.stat().st_size // 2])
    (d / "not_parquet.parquet").write_bytes(b"id,text\n1,a csv file named .parquet\n")

    m = ingest.run(load_spec(None, [f"data.inputs=[{d}]"], env={}), spark=spark)
    c = m.counts
    assert c["chunks"] == 3 + 2 + 1 + 1  # a task per row group; a file whose footer does not read: one
    assert c["parquet_rows"] == c["records"] == 30 + 10 + 1 + 1 + 1 and c["docs"] == 28 + 10
    assert c["quarantine_reasons"] == {"bad_parquet": 3, "empty_text": 1, "missing_text": 1}
    q = {(e["source"], e["reason"]): e for e in ingest.read_quarantine(m)}
    assert q[("in/fineweb.parquet", "missing_text")]["row"] == 5 and "'text' is null" in \
        q[("in/fineweb.parquet", "missing_text")]["detail"]
    assert json.loads(q[("in/fineweb.parquet", "empty_text")]["raw"])["id"] == "<urn:uuid:00000007>"
    cut = q[("in/corrupt.parquet", "bad_parquet")]
    assert (cut["row_group"], cut["row"], cut["rows_unread"]) == (0, 1, 10) and cut["uri"].endswith("corrupt.parquet")
    for name in ("truncated", "not_parquet"):
        e = q[(f"in/{name}.parquet", "bad_parquet")]
        assert "no readable Parquet footer" in e["detail"] and e["bytes"] == (d / f"{name}.parquet").stat().st_size

    docs = pq.read_table(m.output("docs")).to_pylist()
    assert [x["idx"] for x in docs] == list(range(38)) and len({x["id"] for x in docs}) == 38
    kept = [x for x in docs if x["source"] == "in/corrupt.parquet"]  # the row group after the damage is read
    assert [x["id"] for x in kept] == [f"<urn:uuid:{i:08d}>" for i in range(110, 120)]
    fine = [x for x in docs if x["source"] == "in/fineweb.parquet"]
    assert [x["url"] for x in fine] == [f"https://example.org/{i}" for i in range(30) if i not in (4, 7)]
    assert fine[0]["date"] == "2024-02-20T12:00:00Z" and fine[0]["warc_record_id"] is None
    assert json.loads(fine[0]["meta"]) == {"dump": "CC-MAIN-2024-10", "language": "en", "language_score": 0.5,
                                           "file_path": "s3://commoncrawl/crawl-data/CC-MAIN-2024-10/0.warc.gz",
                                           "token_count": 60}
    assert fine[10]["id"] == "in/fineweb.parquet:13"  # no id: <source>:<row>, the row's number in the file
    digests = m.extra["input_sha256"]
    assert digests["in/fineweb.parquet"] == chunk_digest(fw)
    assert digests["in/truncated.parquet"] == hashlib.sha256((d / "truncated.parquet").read_bytes()).hexdigest()


def test_one_input_fields_mapping_serves_parquet_and_jsonl(home, spark):
    when = datetime.datetime(2024, 3, 1, 8, 30, tzinfo=datetime.timezone.utc)
    pq.write_table(pa.table({"content": ["Ein Dokument auf Deutsch.", None], "doc_id": [7, 8],
                             "link": ["https://example.de/a", "https://example.de/b"],
                             "crawl_date": pa.array([when, when], pa.timestamp("us", tz="UTC")),
                             "text": ["not the text", "x"], "lang": ["de", "de"]}), home / "custom.parquet")
    pq.write_table(pa.table({"content": [1, 2]}), home / "int_text.parquet")  # not a string: every row
    (home / "custom.jsonl").write_text(json.dumps({"content": "A JSONL record.", "doc_id": "j1", "link": "https://j",
                                                   "crawl_date": "2024-03-02", "other": 1}) + "\n")
    sets = ["data.input_fields.text=content", "data.input_fields.id=doc_id", "data.input_fields.url=link",
            "data.input_fields.date=crawl_date"]
    spec = load_spec(None, [f"data.inputs=[{home / 'custom.parquet'}, {home / 'int_text.parquet'}, "
                            f"{home / 'custom.jsonl'}]", *sets], env={})
    assert spec.stage_hash("ingest") != load_spec(None, [], env={}).stage_hash("ingest")  # the mapping is hashed
    m = ingest.run(spec, spark=spark)
    assert m.counts["quarantine_reasons"] == {"missing_text": 1, "text_not_string": 2}
    assert {e["detail"] for e in ingest.read_quarantine(m)} == {"'content' is null", "'content' is int"}
    docs = pq.read_table(m.output("docs")).to_pylist()
    assert [(x["id"], x["url"], x["date"]) for x in docs] == [("7", "https://example.de/a", when.isoformat()),
                                                               ("j1", "https://j", "2024-03-02")]
    assert json.loads(docs[0]["meta"]) == {"text": "not the text", "lang": "de"} and docs[1]["meta"] is None
    with pytest.raises(SpecError, match=r"data.ingest: text_field moved to data.input_fields: set "
                                        r"data.input_fields.text instead"):
        load_spec(None, ["data.ingest.text_field=content"], env={})


def test_parquet_objects_on_s3_are_read_by_row_group_with_ranged_reads(home, s3_server, spark):
    from pipelines.storage.s3 import client, ensure_bucket

    fw = fineweb_file(home / "fineweb.parquet", n=25)
    sets = [f"services.s3_endpoint_url={s3_server}", "services.s3_bucket=raw"]
    s3 = client(load_spec(None, sets, env={}))
    ensure_bucket(s3, "raw")
    s3.upload_file(str(fw), "raw", "fineweb/000.parquet")
    m = ingest.run(load_spec(None, sets + ["data.inputs=[s3://raw/fineweb/]", "data.ingest.s3_read=direct"],
                             env={}), spark=spark)
    assert m.counts["chunks"] == 3 and m.counts["docs"] == 25
    assert m.extra["input_sha256"] == {"s3://raw/fineweb/000.parquet": chunk_digest(fw)}
    assert pq.read_table(m.output("docs")).column("id").to_pylist() == [f"<urn:uuid:{i:08d}>" for i in range(25)]
