import base64
import gzip
import json

import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import ROOT
from pipelines.data import ingest
from pipelines.manifest import load_manifest
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


def test_quarantines_bad_records_with_reasons_and_loses_nothing(home, spark):
    src = _bad_file(home / "bad.jsonl")
    spec = load_spec(None, [f"data.inputs=[{src}]"], env={})
    m = ingest.run(spec, spark=spark)
    c = m.counts
    assert c["lines"] == 9 and c["blank_lines"] == 1
    assert c["docs"] == 2 and c["quarantined"] == 7
    assert c["lines"] == c["records"] == c["docs"] + c["quarantined"]
    assert c["quarantine_reasons"] == {"empty_text": 1, "invalid_json": 1, "invalid_utf8": 2, "missing_text": 1,
                                       "not_an_object": 1, "text_not_string": 1}
    q = ingest.read_quarantine(m)
    latin = next(r for r in q if r["line"] == 3)
    assert latin["reason"] == "invalid_utf8"
    assert base64.b64decode(latin["raw_b64"]) == b'{"id": "latin1", "text": "caf\xe9"}'  # raw bytes kept
    assert all(("raw" in r) or ("raw_b64" in r) for r in q)
    docs = pq.read_table(m.output("docs")).to_pylist()
    assert [d["id"] for d in docs] == ["good-1", "bad.jsonl:10"]  # ids preserved, else file:line
    assert [d["idx"] for d in docs] == [0, 1]


def test_reads_gzip_and_zstd(home, spark):
    recs = [{"id": str(i), "text": f"document number {i}"} for i in range(5)]
    raw = "".join(json.dumps(r) + "\n" for r in recs).encode()
    (home / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (home / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    spec = load_spec(None, [f"data.inputs=[{home / 'a.jsonl.gz'}, {home / 'b.jsonl.zst'}]"], env={})
    m = ingest.run(spec, spark=spark)
    assert m.counts["docs"] == 10 and m.counts["quarantined"] == 0


def test_missing_input_fails_fast_with_the_fix(home):
    spec = load_spec(None, ["data.inputs=[nope/missing.jsonl]"], env={})
    with pytest.raises(IngestError, match="missing.jsonl.*fix data.inputs"):
        ingest.run(spec)


def test_an_empty_input_is_refused_not_read_as_the_project_root(home, capsys):
    assert ingest.main(["--input", "", "--input", "data/warc/python_docs_sample.warc.gz", "--output",
                        str(home / "x")]) == 2
    assert "--input: needs at least one input, and no empty one" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        ingest.main(["--set", "data.inputs=[]", "--output", str(home / "x")])
    assert e.value.code == 2 and "data.inputs: needs at least one input" in capsys.readouterr().err
    assert not (home / "x").exists()


def test_rerun_is_idempotent_and_skips_done_work(home, spark):
    src = _bad_file(home / "bad.jsonl")
    spec = load_spec(None, [f"data.inputs=[{src}]"], env={})
    m1 = ingest.run(spec, spark=spark)
    mtime = m1.output("docs").stat().st_mtime_ns
    m2 = ingest.run(spec, spark=spark)
    assert m2.path == m1.path and m2.output("docs").stat().st_mtime_ns == mtime  # not rewritten
    next(m1.output("docs").glob("*.parquet")).write_bytes(b"corrupted")  # a damaged output is recomputed
    m3 = ingest.run(spec, spark=spark)
    assert pq.read_table(m3.output("docs")).num_rows == 2


def test_s3_prefix_globs_and_directories_give_the_same_result_as_the_local_files(home, s3_server, spark):
    """The same bytes from S3 (through the project's client, copied or read by the tasks) and from disk: the same
    docs, each named by where it was read; a glob and a directory give the files' own result."""
    from pipelines.storage.s3 import client, ensure_bucket

    recs = [{"id": f"r{i}", "text": f"document number {i} " * 3} for i in range(30)]
    half = ["".join(json.dumps(r) + "\n" for r in part).encode() for part in (recs[:15], recs[15:])]
    (home / "in").mkdir()
    (home / "in" / "a.jsonl.gz").write_bytes(gzip.compress(half[0]))
    (home / "in" / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(half[1]))
    (home / "in" / "README.md").write_text("not data")
    sets = [f"services.s3_endpoint_url={s3_server}", "services.s3_bucket=raw"]
    s3 = client(load_spec(None, sets, env={}))
    ensure_bucket(s3, "raw")
    for f in ("a.jsonl.gz", "b.jsonl.zst"):
        s3.upload_file(str(home / "in" / f), "raw", f"crawl/2026/{f}")
    s3.put_object(Bucket="raw", Key="crawl/2026/_SUCCESS", Body=b"")

    local = ingest.run(load_spec(None, sets + [f"data.inputs=[{home / 'in' / 'a.jsonl.gz'}, "
                                               f"{home / 'in' / 'b.jsonl.zst'}]"], env={}), spark=spark)
    texts = pq.read_table(local.output("docs")).column("text").to_pylist()
    for mode in ("copy", "direct"):
        from_s3 = ingest.run(load_spec(None, sets + ["data.inputs=[s3://raw/crawl/2026/]",
                                                     f"data.ingest.s3_read={mode}"], env={}), spark=spark)
        assert from_s3.counts["docs"] == 30 and from_s3.digest != local.digest
        assert pq.read_table(from_s3.output("docs")).column("text").to_pylist() == texts
        assert [i["uri"] for i in from_s3.inputs] == ["s3://raw/crawl/2026/a.jsonl.gz",
                                                      "s3://raw/crawl/2026/b.jsonl.zst"]
        assert list(from_s3.extra["input_sha256"].values()) == list(local.extra["input_sha256"].values())
    for pattern in (f"{home}/in/*.jsonl.*", f"{home}/in"):  # a glob, a directory (README.md is not data)
        m = ingest.run(load_spec(None, sets + [f"data.inputs=['{pattern}']"], env={}), spark=spark)
        assert m.digest == local.digest, pattern
    with pytest.raises(IngestError, match="s3://raw/nothing/here.*no JSONL or WARC objects"):
        ingest.run(load_spec(None, sets + ["data.inputs=[s3://raw/nothing/here]"], env={}), spark=spark)


SAMPLE_WARC = ROOT / "data" / "warc" / "python_docs_sample.warc.gz"


def _warc_with_defects(path):
    """The bundled sample's first 3 records, then: a member that is not gzip, a gzip member that is not WARC, an
    image response, an HTML page with no text, a WET-style conversion record, then the rest of the sample."""
    import io

    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    buf = io.BytesIO()
    w = WARCWriter(buf, gzip=True)
    for url, ctype, body in (("https://example.org/logo.png", "image/png", b"\x89PNG\r\n\x1a\n...."),
                             ("https://example.org/blank.html", "text/html",
                              b"<html><head><script>var x = 1;</script></head><body>  </body></html>")):
        http = StatusAndHeaders("200 OK", [("Content-Type", ctype)], protocol="HTTP/1.1")
        w.write_record(w.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=http))
    w.write_record(w.create_warc_record("https://example.org/page", "conversion", warc_content_type="text/plain",
                                        payload=io.BytesIO("Already extracted text, as in a WET file.".encode())))
    raw = SAMPLE_WARC.read_bytes()
    cut = 5552  # the sample's 4th gzip member starts here
    path.write_bytes(raw[:cut] + b"NOT GZIP AT ALL" + gzip.compress(b"WARC/1.1\r\nthis is no header\r\n\r\n")
                     + buf.getvalue() + raw[cut:])
    return path


def test_warc_records_are_extracted_and_defects_quarantined_with_nothing_lost(home, spark, capsys):
    src = _warc_with_defects(home / "crawl.warc.gz")
    assert ingest.main(["--input", str(src), "--output", str(home / "out")]) == 0  # the CLI contract
    m = load_manifest(home / "out")
    c = m.counts
    assert c["warc_records"] == 41 + 3 + 2 and c["records"] == c["docs"] + c["quarantined"] == 46
    assert c["docs"] == 38 + 1  # the sample's 38 pages + the conversion record
    assert c["quarantine_reasons"] == {"bad_compression": 1, "bad_record": 1, "empty_text": 1, "http_status": 2,
                                       "not_html": 2}  # not gzip; gzip but not WARC
    assert c["skipped_records"] == {"request": 41, "warcinfo": 1}
    q = ingest.read_quarantine(m)
    bad = [r for r in q if r["reason"] in ("bad_compression", "bad_record")]
    assert [r["offset"] for r in bad] == [5552, 5552 + 15]
    assert base64.b64decode(bad[0]["raw_b64"]) == b"NOT GZIP AT ALL"  # the bytes are kept
    assert next(r for r in q if r["reason"] == "empty_text")["url"] == "https://example.org/blank.html"
    assert {r["detail"] for r in q if r["reason"] == "http_status"} == {"HTTP 404", "HTTP 301"}
    docs = pq.read_table(m.output("docs")).to_pylist()
    assert [d["idx"] for d in docs] == list(range(39))
    tut = next(d for d in docs if d["url"] == "https://docs.python.org/3.11/tutorial/classes.html")
    assert tut["id"] == tut["warc_record_id"].strip() and tut["id"].startswith("<urn:uuid:")
    assert tut["date"] == "2026-11-20T12:00:00Z" and tut["source"] == "crawl.warc.gz"
    assert "Classes provide a means of bundling data and functionality together" in tut["text"]
    assert "<div" not in tut["text"] and "Navigation" not in tut["text"][:200]  # main content, not the page chrome
    assert next(d for d in docs if d["url"] == "https://example.org/page")["text"].startswith("Already extracted")
    assert "39 docs" in capsys.readouterr().out


def test_wet_files_and_trafilatura(home, spark):
    """A .warc.wet.gz of conversion records is read as text; trafilatura extracts the same pages' main text."""
    import io

    from warcio.warcwriter import WARCWriter

    with open(home / "sample.warc.wet.gz", "wb") as f:
        w = WARCWriter(f, gzip=True)
        for i in range(5):
            w.write_record(w.create_warc_record(f"https://example.org/{i}", "conversion",
                                                warc_content_type="text/plain",
                                                payload=io.BytesIO(f"Page {i} of plain text.".encode())))
    m = ingest.run(load_spec(None, [f"data.inputs=[{home / 'sample.warc.wet.gz'}]"], env={}), spark=spark)
    assert m.counts["docs"] == 5 and [d["url"] for d in pq.read_table(m.output("docs")).to_pylist()] == \
        [f"https://example.org/{i}" for i in range(5)]
    t = ingest.run(load_spec(None, [f"data.inputs=[{SAMPLE_WARC}]", "data.ingest.extractor=trafilatura"], env={}),
                   spark=spark)
    assert t.counts["docs"] == 38
    text = pq.read_table(t.output("docs")).column("text").to_pylist()
    assert any("Classes provide a means of bundling data" in x for x in text)


def test_large_files_are_split_by_record_and_ids_do_not_depend_on_the_split(home, spark):
    """A 3 MB plain JSONL read as 1 split and as 3 (1 MB ranges): the same idx, ids, lines and quarantine."""
    recs = []
    for i in range(9000):
        recs.append(json.dumps({"text": f"record {i} " + "x" * 300}) if i % 1000 else "{broken json")
        if i % 777 == 0:
            recs.append("")
    (home / "big.jsonl").write_text("\n".join(recs) + "\n")
    one = ingest.run(load_spec(None, [f"data.inputs=[{home / 'big.jsonl'}]"], env={}), spark=spark)
    three = ingest.run(load_spec(None, [f"data.inputs=[{home / 'big.jsonl'}]", "data.ingest.chunk_mb=1"], env={}),
                       spark=spark)
    assert one.counts["chunks"] == 1 and three.counts["chunks"] == 3
    for k in ("docs", "quarantined", "blank_lines", "lines"):
        assert one.counts[k] == three.counts[k], k
    a, b = (pq.read_table(m.output("docs")).select(["idx", "id", "text"]).to_pylist() for m in (one, three))
    assert a == b and [d["idx"] for d in a] == list(range(8991))
    assert a[1000]["id"] == "big.jsonl:1005"  # <file>:<line> (record 1002, after 2 blank lines)
    assert ingest.read_quarantine(one) == ingest.read_quarantine(three)
    assert [q["line"] for q in ingest.read_quarantine(one)][:2] == [1, 1003]


def test_a_rerun_gives_the_same_ids_and_digest(home, spark):
    src = f"data.inputs=[{SAMPLE_WARC}, {ROOT / 'data' / 'sample' / 'cc_wet_2019_30_sample.jsonl.gz'}]"
    two = ingest.run(load_spec(None, [src], env={}), spark=spark)
    assert two.extra["spark_master"] == "local[2]" and two.counts["chunks"] == 2
    again = ingest.run(load_spec(None, [src, "run.force=true"], env={}), spark=spark)
    assert again.digest == two.digest


def _big_warc(path, pages: int = 400):
    """A ~2.6 MB .warc.gz of random-word pages, one gzip member each, with defects between members: junk bytes, a
    member cut short, and a stored (level 0) member whose page holds a gzip member's bytes, so a gzip magic sits
    inside compressed data."""
    import io
    import random
    import zlib

    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    rnd = random.Random(7)
    out = bytearray()
    for i in range(pages):
        words = " ".join("".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randint(2, 9))) for _ in range(1500))
        body = f"<html><body><h1>Page {i}</h1><p>{words}.</p></body></html>".encode()
        if i == 150:
            body = body.replace(b"</p>", b"</p><!--" + gzip.compress(b"not a WARC record " * 50) + b"-->")
        buf = io.BytesIO()
        w = WARCWriter(buf, gzip=False)
        http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
        w.write_record(w.create_warc_record(f"https://example.org/{i}", "response", payload=io.BytesIO(body),
                                            http_headers=http))
        z = zlib.compressobj(0 if i == 150 else 6, wbits=31)
        member = z.compress(buf.getvalue()) + z.flush()
        if i == 60:
            out += b"JUNK BETWEEN MEMBERS" * 40
        if i == 220:
            member = member[: len(member) // 2]  # cut short: the next member follows its first half
        out += member
    path.write_bytes(bytes(out))
    return path


def test_a_large_warc_gz_is_split_by_gzip_member_and_reads_as_the_whole_file(home, spark):
    """Any cut of a .warc.gz into byte ranges reads exactly the records (and defects) of the whole file, each once;
    through ingest, 1 split and 3 give the same docs, ids and quarantine."""
    from pathlib import Path

    from pipelines.data import formats
    from pipelines.data.sources import Source

    path = _big_warc(home / "big.warc.gz")
    src = [Source.of_file(path)]
    cfg = load_spec(None, [], env={}).data.ingest

    def read(step):
        splits = formats.plan_chunks(src, 64, step=step)
        return len(splits), [(r.loc, r.text, r.reason) if isinstance(r, formats.Row) else r
                             for s in splits for r in formats.rows(s, cfg)]

    n, whole = read(None)
    assert n == 1 and Path(path).stat().st_size > 2 << 20
    reasons = [r[2] for r in whole if isinstance(r, tuple) and r[2]]
    assert reasons.count("bad_compression") == 2 and sum(1 for r in whole if isinstance(r, tuple) and r[1]) == 399
    for step in (40_000, 123_457, 1 << 20):
        k, got = read(step)
        assert k > 2 and got == whole, step

    one = ingest.run(load_spec(None, [f"data.inputs=[{path}]"], env={}), spark=spark)
    three = ingest.run(load_spec(None, [f"data.inputs=[{path}]", "data.ingest.chunk_mb=1"], env={}), spark=spark)
    assert one.counts["chunks"] == 1 and three.counts["chunks"] == 3
    a, b = (pq.read_table(m.output("docs")).select(["idx", "id", "text", "url"]).to_pylist() for m in (one, three))
    assert a == b and len(a) == 399  # every page but the one cut short
    assert ingest.read_quarantine(one) == ingest.read_quarantine(three)


def test_s3_direct_tasks_read_byte_ranges_themselves_and_give_the_local_digest(home, s3_server, spark):
    """data.ingest.s3_read=direct: nothing is copied to the driver (no cache), the Spark tasks read their ranges of
    the objects (a .warc.gz with defects and a plain JSONL, each cut into 3 splits; a .jsonl.zst whole), and the
    result is that of the same files on disk but for the docs' source (same docs and quarantine, the same input
    digests computed by the tasks). The inputs are known by ETag and size."""
    from pipelines.storage.s3 import client, ensure_bucket

    (home / "in").mkdir()
    _big_warc(home / "in" / "big.warc.gz")
    (home / "in" / "lines.jsonl").write_text("".join(json.dumps({"id": f"l{i}", "text": f"line {i} " + "y" * 400})
                                                     + "\n" for i in range(6000)))
    (home / "in" / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "zstd doc"}\n{bad\n'))
    names = ["big.warc.gz", "c.jsonl.zst", "lines.jsonl"]
    sets = [f"services.s3_endpoint_url={s3_server}", "services.s3_bucket=raw", "data.ingest.chunk_mb=1"]
    s3 = client(load_spec(None, sets, env={}))
    ensure_bucket(s3, "raw")
    for f in names:
        s3.upload_file(str(home / "in" / f), "raw", f"direct/{f}")

    local = ingest.run(load_spec(None, sets + [f"data.inputs=[{', '.join(str(home / 'in' / f) for f in names)}]"],
                                 env={}), spark=spark)
    direct = ingest.run(load_spec(None, sets + ["data.inputs=[s3://raw/direct/]", "data.ingest.s3_read=direct"],
                                  env={}), spark=spark)
    assert direct.counts["chunks"] == local.counts["chunks"] == 3 + 1 + 3
    assert direct.path != local.path and direct.extra["input_sha256"] == {
        f"s3://raw/direct/{k.removeprefix('in/')}": v for k, v in local.extra["input_sha256"].items()}

    def unsourced(rows):
        return [{k: v for k, v in r.items() if k != "source" and k != "uri"} for r in rows]

    assert unsourced(ingest.read_quarantine(direct)) == unsourced(ingest.read_quarantine(local))
    cols = ["idx", "text", "url", "warc_record_id"]
    assert pq.read_table(direct.output("docs")).select(cols) == pq.read_table(local.output("docs")).select(cols)
    assert direct.counts["docs"] == 399 + 1 + 6000 and direct.counts["quarantine_reasons"] == {"bad_compression": 2,
                                                                                               "invalid_json": 1}
    assert [(i["uri"], i["bytes"]) for i in direct.inputs] == [
        (f"s3://raw/direct/{f}", (home / "in" / f).stat().st_size) for f in names]
    assert all(i["etag"] for i in direct.inputs) and not (home / "var" / "runs" / "cache").exists()
