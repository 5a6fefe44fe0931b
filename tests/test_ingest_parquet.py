"""Parquet input for ingest: row groups as Spark tasks, the data.input_fields mapping (FineWeb's names by default),
the other columns kept as each doc's meta, rows and files that do not read quarantined with their reasons."""
import base64
import datetime
import errno
import hashlib
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.data import formats, ingest
from pipelines.data.sources import Source
from pipelines.spec import IngestCfg, InputFieldsCfg, SpecError, load_spec

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


class FailingFile(io.RawIOBase):
    """``data`` as a file whose reads from byte ``at`` on raise ``error`` (a connection dropped mid-file)."""

    def __init__(self, data: bytes, at: int, error: BaseException):
        super().__init__()
        self.f, self.at, self.error = io.BytesIO(data), at, error

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        return self.f.seek(off, whence)

    def tell(self) -> int:
        return self.f.tell()

    def readinto(self, b) -> int:
        if self.f.tell() >= self.at:
            raise self.error
        return self.f.readinto(b)


def read_errors():
    from botocore.exceptions import ReadTimeoutError

    from pipelines.storage.s3 import S3Timeout

    return [ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), TimeoutError("timed out"),
            ReadTimeoutError(endpoint_url="http://s3/raw/x.parquet"), S3Timeout("GetObject: no answer"),
            OSError(errno.EIO, "Input/output error")]


@pytest.mark.parametrize("error", read_errors(), ids=lambda e: type(e).__name__)
def test_a_parquet_read_that_fails_is_raised_for_a_retry_never_quarantined(tmp_path, monkeypatch, error):
    """Only bytes that are not Parquet are bad data: a read that fails (a reset, a timeout, botocore's, a disk's
    EIO) fails the task and its retry reads the rows, on the driver's plan as in a task."""
    fw = fineweb_file(tmp_path / "fw.parquet", n=30)
    data, second = fw.read_bytes(), formats.row_group_cuts(Source.of_file(fw))[1][0]
    assert len(data) < 64 << 10  # pyarrow reads the footer as the file's last 64 KiB: from byte 0 here
    source, cfg, fields = Source.of_file(fw), IngestCfg(), InputFieldsCfg()
    monkeypatch.setattr(formats, "open_raw", lambda chunk: FailingFile(data, 0, error))
    with pytest.raises(type(error)):  # the driver: no whole-file fallback (another input_sha256 scheme)
        formats.row_group_cuts(source)
    monkeypatch.setattr(formats, "open_raw", lambda chunk: FailingFile(data, second, error))
    chunk = formats.Chunk(0, "fw.parquet", str(fw), "parquet", size=len(data))  # every row group
    got = []
    with pytest.raises(type(error)):
        for r in formats.parquet_rows(chunk, cfg, fields):
            got.append(r)
    assert [r.id for r in got] == [f"<urn:uuid:{i:08d}>" for i in range(10)] and not any(r.reason for r in got)
    with pytest.raises(type(error)):
        list(formats.row_group_rows(pq.ParquetFile(FailingFile(data, second, error)), 1, 10, 10, chunk, cfg, fields))


def test_a_parquet_page_that_does_not_decode_is_still_bad_data(tmp_path):
    fw = fineweb_file(tmp_path / "fw.parquet", n=20)
    first = pq.read_metadata(fw).row_group(1).column(0)
    at = first.dictionary_page_offset if first.has_dictionary_page else first.data_page_offset
    raw = bytearray(fw.read_bytes())
    raw[at:at + 64] = bytes(64)  # row group 1's first page header: pyarrow's plain OSError, no errno
    fw.write_bytes(bytes(raw))
    got = list(formats.parquet_rows(formats.Chunk(0, "fw.parquet", str(fw), "parquet", size=len(raw)), IngestCfg(),
                                    InputFieldsCfg()))
    assert len(got) == 11 and [r.reason for r in got[:10]] == [None] * 10 and got[10].reason == "bad_parquet"
    assert (got[10].q["row_group"], got[10].q["row"], got[10].q["rows_unread"]) == (1, 11, 10)


def not_utf8(values: list[bytes]) -> pa.Array:
    """A string array holding ``values`` as they are: Arrow checks UTF-8 on a cast, not on these buffers, and
    Parquet writes them and reads them back unchecked (as another writer's file would hold them)."""
    return pa.Array.from_buffers(pa.string(), len(values), pa.array(values, pa.binary()).buffers())


def test_parquet_strings_that_are_not_utf8_quarantine_their_rows_and_the_rest_is_read(tmp_path):
    texts = [b"A good first document.", b"Broken \xff\xfe bytes here.", b"A good third document.",
             b"A good fourth document."]
    table = pa.table({"text": not_utf8(texts), "id": ["a", "b", "c", "d"],
                      "title": not_utf8([b"t1", b"t2", b"t\xc3", b"t4"]),
                      "tags": pa.ListArray.from_arrays(pa.array([0, 1, 2, 3, 4], pa.int32()),
                                                       not_utf8([b"x", b"y", b"z", b"w"])),
                      "score": [0.5, float("nan"), float("inf"), -float("inf")]})
    pq.write_table(table, tmp_path / "mixed.parquet", row_group_size=2)
    chunk = formats.Chunk(0, "mixed.parquet", str(tmp_path / "mixed.parquet"), "parquet", size=0)
    got = list(formats.parquet_rows(chunk, IngestCfg(), InputFieldsCfg()))
    assert [r.reason for r in got] == [None, "invalid_utf8", "invalid_utf8", None]  # nothing lost
    assert [r.loc for r in got] == [1, 2, 3, 4] and got[0].text == texts[0].decode() and got[3].id == "d"
    bad = got[1].q
    assert (bad["row"], bad["row_group"], bad["column"]) == (2, 0, "text") and "'text' is not UTF-8" in bad["detail"]
    assert base64.b64decode(bad["raw_b64"]) == texts[1]
    row = json.loads(bad["raw"])  # the whole row, the bytes that do not decode in base64; NaN as null
    assert base64.b64decode(row["text"]) == texts[1] and row["title"] == "t2" and row["score"] is None
    meta_bad = got[2].q  # a string other than the text: the row is quarantined all the same, its text kept
    assert meta_bad["column"] == "title" and base64.b64decode(meta_bad["raw_b64"]) == b"t\xc3"
    assert json.loads(meta_bad["raw"])["text"] == texts[2].decode() and json.loads(meta_bad["raw"])["tags"] == ["z"]
    assert json.loads(got[0].meta) == {"title": "t1", "tags": ["x"], "score": 0.5}
    assert json.loads(got[3].meta) == {"title": "t4", "tags": ["w"], "score": None}  # -inf: valid JSON, null


def test_meta_json_is_valid_json_with_no_nan_or_infinity():
    assert formats.to_json({"a": float("nan"), "b": [float("inf"), {"c": -float("inf")}], "d": 1.5}) == \
        '{"a": null, "b": [null, {"c": null}], "d": 1.5}'
    assert formats.to_json({"when": datetime.date(2024, 1, 2), "raw": b"\x00"}) == \
        '{"when": "2024-01-02", "raw": "AA=="}'
