"""Ingest's input edge cases (ids across inputs, broken compression, plain text, formats it refuses) and the task
commit protocol (a task killed after writing, speculation on: every record once)."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import ROOT
from pipelines.data import ingest
from pipelines.data.sources import IngestError
from pipelines.manifest import load_manifest
from pipelines.spec import load_spec


def _lines(recs) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in recs).encode()


def test_same_name_inputs_in_two_directories_get_distinct_ids_and_sources(home, spark):
    for d in ("week1", "week2"):
        (home / d).mkdir()
        (home / d / "part.jsonl").write_bytes(_lines({"text": f"{d} doc {i}"} for i in range(3)))
    m = ingest.run(load_spec(None, [f"data.inputs=[{home / 'week1'}, {home / 'week2'}]"], env={}), spark=spark)
    docs = pq.read_table(m.output("docs")).to_pylist()
    assert len(docs) == 6 and len({d["id"] for d in docs}) == 6
    assert [d["id"] for d in docs[:2]] == ["week1/part.jsonl:1", "week1/part.jsonl:2"]
    assert {d["source"] for d in docs} == {"week1/part.jsonl", "week2/part.jsonl"}
    assert set(m.extra["input_sha256"]) == {"week1/part.jsonl", "week2/part.jsonl"}


def test_ids_given_by_the_data_that_repeat_are_qualified_by_where_they_were_read(home, spark):
    (home / "a.jsonl").write_bytes(_lines([{"id": "x", "text": "first"}, {"id": "y", "text": "unique"}]))
    (home / "b.jsonl").write_bytes(_lines([{"id": "x", "text": "second"}, {"id": "x", "text": "third"}]))
    m = ingest.run(load_spec(None, [f"data.inputs=[{home / 'a.jsonl'}, {home / 'b.jsonl'}]"], env={}), spark=spark)
    ids = [d["id"] for d in pq.read_table(m.output("docs")).to_pylist()]
    assert ids == ["a.jsonl:1#x", "y", "b.jsonl:1#x", "b.jsonl:2#x"] and m.counts["qualified_ids"] == 1


def test_corrupt_and_truncated_gzip_and_zstd_inputs_are_quarantined_and_the_rest_is_read(home, capsys):
    import zstandard

    good = _lines({"text": f"good doc {i} " * 20} for i in range(2000))
    whole = gzip.compress(good)
    (home / "truncated.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    corrupt = bytearray(whole)
    corrupt[len(whole) // 2: len(whole) // 2 + 64] = b"\x00" * 64
    (home / "corrupt.jsonl.gz").write_bytes(bytes(corrupt))
    zst = zstandard.ZstdCompressor().compress(good)
    (home / "truncated.jsonl.zst").write_bytes(zst[: len(zst) // 2])  # zstandard's own reader stops here quietly
    third = len(good) // 3 + good[len(good) // 3:].index(b"\n") + 1
    (home / "frames.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(good[:third])
                                            + zstandard.ZstdCompressor().compress(good[third:]))  # two frames, whole
    (home / "fine.jsonl").write_bytes(_lines([{"text": "after the broken ones"}]))
    out = home / "out"
    names = ["truncated.jsonl.gz", "corrupt.jsonl.gz", "truncated.jsonl.zst", "frames.jsonl.zst", "fine.jsonl"]
    code = ingest.main([a for n in names for a in ("--input", str(home / n))]
                       + ["--output", str(out), "--set", "services.spark_master=local[2]"])
    assert code == 0, capsys.readouterr()
    m = load_manifest(out)
    c = m.counts
    assert c["quarantine_reasons"] == {"bad_compression": 3} and c["records"] == c["docs"] + c["quarantined"]
    q = {e["source"]: e for e in ingest.read_quarantine(m)}
    assert set(q) == {"truncated.jsonl.gz", "corrupt.jsonl.gz", "truncated.jsonl.zst"}
    for e in q.values():
        assert e["reason"] == "bad_compression" and 0 < e["offset"] <= len(whole) and ".jsonl." in e["uri"]
    assert "zstd frame" in q["truncated.jsonl.zst"]["detail"]
    docs = pq.read_table(m.output("docs")).to_pylist()
    by = {s: sum(d["source"] == s for d in docs) for s in names}
    assert all(0 < by[s] < 2000 for s in q)  # what came before the damage is kept
    assert by["frames.jsonl.zst"] == 2000  # every frame is read, not the first one only
    assert docs[-1]["text"] == "after the broken ones" and len({d["id"] for d in docs}) == len(docs)


def test_max_docs_never_marks_an_input_it_cut_as_held_by_the_corpus(home, spark):
    from pipelines.data.tokenize import corpus_record

    (home / "a.jsonl").write_bytes(_lines({"text": f"first input doc {i}"} for i in range(3)))
    (home / "b.jsonl").write_bytes(_lines({"text": f"second input doc {i}"} for i in range(3)))
    spec = load_spec(None, [f"data.inputs=[{home / 'a.jsonl'}, {home / 'b.jsonl'}]", "data.ingest.max_docs=4"],
                     env={})
    m = ingest.run(spec, spark=spark)
    assert m.counts["docs"] == 4 and m.counts["over_max_docs"] == 2 and m.counts["cut_inputs"] == 1
    sha = {Path(i["key"]).name: i["sha256"] for i in m.inputs}
    assert m.extra["cut_inputs"] == [sha["b.jsonl"]]
    assert corpus_record(m, None)["inputs"] == [sha["a.jsonl"]]  # b is read again by the next curation


def test_plain_text_files_are_one_document_each_and_other_formats_are_refused(home, spark):
    (home / "texts").mkdir()
    (home / "texts" / "essay.txt").write_text("An essay.\n\nIts second paragraph.\n")
    (home / "texts" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    m = ingest.run(load_spec(None, [f"data.inputs=[{home / 'texts'}]"], env={}), spark=spark)
    assert m.counts["text_files"] == 2 and m.counts["docs"] == 1
    assert m.counts["quarantine_reasons"] == {"invalid_utf8": 1}
    doc = pq.read_table(m.output("docs")).to_pylist()[0]
    assert doc["text"] == "An essay.\n\nIts second paragraph.\n" and doc["id"] == "texts/essay.txt:1"
    (home / "table.csv").write_text("a,b\n1,2\n")
    with pytest.raises(IngestError, match=r"table.csv.*not a supported format.*JSONL.*WARC.*plain text"):
        ingest.run(load_spec(None, [f"data.inputs=[{home / 'table.csv'}]"], env={}), spark=spark)


def _ingest_cli(home, out, fail: str, extra=()):
    env = {**os.environ, "LLMP_HOME": str(home), "LLMP_FAIL_TASK": fail}
    return subprocess.run([sys.executable, "-m", "pipelines.data.ingest", "--output", str(out),
                           "--set", "services.spark_master=local[2,4]",
                           "--set", "services.spark_conf={spark.speculation: 'true', spark.speculation.quantile: "
                                    "'0.1', spark.speculation.multiplier: '1.1', spark.speculation.minTaskRuntime: "
                                    "'10ms'}", *extra],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("point", ["ingest-read:1", "ingest-write:2"])
def test_a_task_killed_after_writing_leaves_every_record_once(home, point):
    """Four inputs, four tasks; one task's first attempt writes its files, then its worker dies (os._exit): the
    retry's files are published, the dead attempt's never are; speculation is on throughout."""
    names = []
    for k in range(4):
        (home / f"in{k}.jsonl").write_bytes(_lines({"text": f"input {k} record {i}"} for i in range(500)))
        names.append(str(home / f"in{k}.jsonl"))
    out = home / "out"
    r = _ingest_cli(home, out, point, [a for n in names for a in ("--input", n)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Lost task" in r.stderr and "Python worker exited unexpectedly" in r.stderr  # the kill happened
    m = load_manifest(out)
    docs = pq.read_table(m.output("docs")).to_pylist()
    assert [d["idx"] for d in docs] == list(range(2000))
    assert sorted(d["text"] for d in docs) == sorted(f"input {k} record {i}" for k in range(4) for i in range(500))
    assert sorted(p.name for p in m.output("docs").iterdir()) == [f"part-{k:05d}.parquet" for k in range(4)]
    assert not any(p.name.startswith("_") for p in m.dir.iterdir())  # no attempt directory left behind


def test_a_session_under_spark_submit_keeps_spark_submit_s_conf_and_one_built_here_gets_ours(tmp_path):
    """spark-submit's --conf (shuffle partitions, the UI) stand: get_spark sets nothing over them, and a stage's
    shuffle sizing leaves a number the user gave alone; a session built here has the UI only off a laptop."""
    from pipelines.data.spark import session_conf

    probe = tmp_path / "probe.py"
    probe.write_text("import json, sys\nsys.path.insert(0, %r)\n" % str(ROOT) +
                     "from pipelines.data.spark import get_spark, size_shuffles\n"
                     "s = get_spark('local[2]', 'probe', shuffle_partitions=8, conf={'spark.ui.enabled': 'false'})\n"
                     "size_shuffles(s, 5)\n"
                     "c = s.sparkContext.getConf()\n"
                     "print('CONF', json.dumps({k: c.get(k, None) for k in ('spark.master', 'spark.ui.enabled',"
                     " 'spark.sql.shuffle.partitions')}), s.conf.get('spark.sql.shuffle.partitions'))\n"
                     "s.stop()\n")
    r = subprocess.run([str(Path(sys.executable).parent / "spark-submit"), "--master", "local[1]", "--conf",
                        "spark.ui.enabled=true", "--conf", "spark.sql.shuffle.partitions=3", str(probe)],
                       env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("CONF "))
    got, runtime = line[5:].rsplit(" ", 1)
    assert json.loads(got) == {"spark.master": "local[1]", "spark.ui.enabled": "true",
                               "spark.sql.shuffle.partitions": "3"} and runtime == "3"
    laptop, cluster = session_conf("local[2]"), session_conf("spark://h:7077", conf={"spark.speculation": "true"})
    assert laptop["spark.ui.enabled"] == "false" and "spark.sql.shuffle.partitions" not in laptop
    assert cluster["spark.ui.enabled"] == "true" and cluster["spark.shuffle.readHostLocalDisk"] == "false"
    assert cluster["spark.speculation"] == "true"


def test_a_folder_that_cannot_be_listed_is_never_passed_over(tmp_path, monkeypatch):
    """``glob.glob`` drops every directory it fails to scan and ``Path.rglob`` the ones it may not read: an input
    folder whose server answered EIO (or ESTALE) lost its files from the corpus, exit 0. Now the listing matches as
    glob does and a failing folder ends the stage: exit 75 for storage's error, 2 for a refusal, the folder named;
    and a stage's hash of a directory (done work) raises rather than hash a part of it."""
    import errno
    import glob

    from pipelines.data import sources
    from pipelines.listing import strict_glob
    from pipelines.manifest import sha256_path

    root = tmp_path / "raw"
    for rel in ("a.jsonl", "x/b.jsonl", "x/y/c.jsonl.gz", "x/.hidden.jsonl", "z/d.jsonl", "z/e.txt", "zz/f.jsonl"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("{}\n")
    (root / "latest").symlink_to("z")  # glob's ** goes through a symlinked directory
    (root / "z" / "loop").symlink_to("..")  # … and round a loop until the path is too long (here: not again)
    assert [p.relative_to(root).as_posix() for p in strict_glob(str(root / "**/*.jsonl"))] == [
        "a.jsonl", "latest/d.jsonl", "x/b.jsonl", "z/d.jsonl", "zz/f.jsonl"]  # sorted as strings, as glob's
    (root / "z" / "loop").unlink()
    for pat in ("**/*.jsonl", "*/*.jsonl", "x/**", "[xz]/*", "*.jsonl", "nope/*.jsonl", "a.jsonl/*", "**"):
        assert strict_glob(str(root / pat)) == sorted(Path(os.path.normpath(p))
                                                      for p in glob.glob(str(root / pat), recursive=True)), pat
    assert [s.name.rsplit("/", 1)[-1] for s in sources.local_sources(str(root / "**/*.jsonl"))] == \
        ["a.jsonl", "d.jsonl", "b.jsonl", "d.jsonl", "f.jsonl"]
    before = sha256_path(root)

    real = os.scandir

    def failing(path=".", code=errno.EIO):
        if str(path).rstrip("/").endswith("/x"):
            raise OSError(code, os.strerror(code), str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", failing)
    said = glob.glob(str(root / "**/*.jsonl"), recursive=True)  # what glob says: b.jsonl and c are gone, exit 0
    assert len(said) == 4 and not any("/x/" in p for p in said), said
    for pattern in (str(root / "**/*.jsonl"), str(root)):
        with pytest.raises(sources.IngestError, match=r"raw/x could not be listed now \(OSError: Input/output "
                                                      r"error\); run it again") as e:
            sources.local_sources(pattern)
        assert e.value.exit_code == 75
    with pytest.raises(OSError):
        sha256_path(root)
    monkeypatch.setattr(os, "scandir", lambda path=".": failing(path, errno.EACCES))
    with pytest.raises(sources.IngestError, match="raw/x cannot be read .*give this user read access") as e:
        sources.local_sources(str(root / "*/*.jsonl"))
    assert e.value.exit_code == 2
    monkeypatch.undo()
    assert sha256_path(root) == before


def test_a_folder_whose_kind_cannot_be_read_is_never_passed_over(tmp_path, monkeypatch):
    """Under a pattern of two components or more, whether an entry is a folder may take a stat (a symlink, a file
    system that gives no entry types); that stat answering EIO read as "not a folder" dropped every file under it
    from the corpus, exit 0. Now only an answer (a loop, a dangling link) is "not a folder"; EIO stops the stage
    with 75, EACCES with 2, the entry named; an entry the pattern would not enter (hidden, another name) is never
    asked, as glob does not."""
    import contextlib
    import errno

    from pipelines.data import sources
    from pipelines.listing import strict_glob

    root = tmp_path / "raw"
    for rel in ("a/x.jsonl", "b/y.jsonl", ".cache/z.jsonl", "zz/w.jsonl"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("{}\n")
    (root / "loop").symlink_to("loop")  # its stat answers ELOOP: no folder, as glob says
    (root / "gone").symlink_to("nowhere")
    real, code, failing = os.scandir, [errno.EIO], {"b"}

    class Entry:  # an entry of the real listing whose stat of b fails as the file system says
        def __init__(self, e):
            self.e, self.name, self.path = e, e.name, e.path

        def is_dir(self, follow_symlinks=True):
            if self.name in failing:
                raise OSError(code[0], os.strerror(code[0]), self.path)
            return self.e.is_dir(follow_symlinks=follow_symlinks)

    @contextlib.contextmanager
    def scandir(path="."):
        with real(path) as it:
            yield (Entry(e) for e in it)

    monkeypatch.setattr(os, "scandir", scandir)
    pattern = str(root / "*/*.jsonl")
    with pytest.raises(OSError) as e:
        strict_glob(pattern)
    assert e.value.errno == errno.EIO and e.value.filename.endswith("raw/b")
    for pat in (pattern, str(root / "**/*.jsonl")):
        with pytest.raises(sources.IngestError, match=r"raw/b could not be listed now \(OSError: Input/output "
                                                      r"error\); run it again") as e:
            sources.local_sources(pat)
        assert e.value.exit_code == 75
    code[0] = errno.EACCES
    with pytest.raises(sources.IngestError, match="raw/b cannot be read .*give this user read access") as e:
        sources.local_sources(pattern)
    assert e.value.exit_code == 2
    code[0] = errno.ELOOP  # an answer: b is no folder to list, the rest is the whole answer
    assert [p.relative_to(root).as_posix() for p in strict_glob(pattern)] == ["a/x.jsonl", "zz/w.jsonl"]
    code[0], failing = errno.EACCES, {".cache", "zz"}  # entries these patterns do not enter: not asked
    assert [p.relative_to(root).as_posix() for p in strict_glob(str(root / "[ab]/*.jsonl"))] == ["a/x.jsonl",
                                                                                               "b/y.jsonl"]
    assert len(strict_glob(str(root / "[!z]*/*.jsonl"))) == 2
    monkeypatch.undo()
    assert [p.relative_to(root).as_posix() for p in strict_glob(pattern)] == ["a/x.jsonl", "b/y.jsonl", "zz/w.jsonl"]


def test_an_s3_listing_whose_credentials_lapsed_is_a_retry_and_a_refused_one_the_users(home, monkeypatch):
    """Listing an S3 input, anything but the endpoint not answering ended ingest with 2, "fix it": an expired session
    token or a credentials provider that did not answer (the instance metadata service, a container role) too, which
    a retry mends (75); a refusal (403) or no bucket stays the user's (2)."""
    from botocore.exceptions import ClientError, CredentialRetrievalError, MetadataRetrievalError

    from pipelines.data import sources
    from pipelines.spec import load_spec

    def answer(code, status):
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "ListObjectsV2")

    class Store:  # a client whose listing raises what the endpoint or botocore said
        def __init__(self, error):
            self.error = error

        def get_paginator(self, name):
            return self

        def paginate(self, **kw):
            raise self.error

    spec = load_spec(None, ["services.s3_endpoint_url=http://s3.example:9000"], env={})
    cases = [(answer("ExpiredToken", 400), 75, "the credentials lapsed"),
             (CredentialRetrievalError(provider="container-role", error_msg="timed out"), 75, "the credentials lapsed"),
             (MetadataRetrievalError(error_msg="timed out"), 75, "the credentials lapsed"),
             (answer("RequestTimeTooSkewed", 403), 75, "the credentials lapsed"),  # this node's clock
             (answer("SlowDown", 503), 75, "the endpoint did not answer the listing"),
             (answer("AccessDenied", 403), 2, "cannot list it"), (answer("NoSuchBucket", 404), 2, "cannot list it")]
    for error, code, said in cases:
        monkeypatch.setattr(sources, "client_from", lambda settings, e=error: Store(e))
        with pytest.raises(sources.IngestError, match=f"input s3://b/raw/: {said}") as e:
            sources.s3_sources(spec, "s3://b/raw/")
        assert e.value.exit_code == code, (error, e.value)


def test_an_s3_input_replaced_after_its_listing_is_never_read_as_the_listed_one(s3_server, home):
    """An input is identified by its listing (key, size, ETag), then read: an object replaced in between was read
    as the new bytes under the old identity (or two versions mixed in one input, chunk by chunk). Its reads ask for
    the listed ETag and check the one they get (the embedded store ignores If-Match: the check is what holds
    here); the copy path checks it after the download; both stop the stage 75 for a retry to list it again. A
    cache record torn by a crash is a copy to download again, not a traceback."""
    import boto3
    from botocore.config import Config

    from pipelines.data.sources import InputUnavailable, cached_copy
    from pipelines.storage.s3 import ObjectChanged, open_object

    settings = {"endpoint_url": s3_server, "region_name": "us-east-1", "aws_access_key_id": "k",
                "aws_secret_access_key": "s"}
    s3 = boto3.client("s3", config=Config(response_checksum_validation="when_required"), **settings)
    s3.create_bucket(Bucket="inputs")
    s3.put_object(Bucket="inputs", Key="week.jsonl", Body=b'{"text": "the listed version"}\n')
    listed = s3.list_objects_v2(Bucket="inputs")["Contents"][0]
    with open_object(settings, "s3://inputs/week.jsonl", listed["Size"], etag=listed["ETag"]) as f:
        assert f.read() == b'{"text": "the listed version"}\n'
    s3.put_object(Bucket="inputs", Key="week.jsonl", Body=b'{"text": "a replacement, same size"}\n'[:listed["Size"]])
    with pytest.raises(ObjectChanged, match="changed since it was listed"):
        with open_object(settings, "s3://inputs/week.jsonl", listed["Size"], etag=listed["ETag"]) as f:
            f.read()
    spec = load_spec(None, [f"services.s3_endpoint_url={s3_server}"], env={})
    with pytest.raises(InputUnavailable, match="changed since it was listed") as e:
        cached_copy(s3, "inputs", listed, spec)
    assert e.value.exit_code == 75
    now = s3.list_objects_v2(Bucket="inputs")["Contents"][0]
    dest = cached_copy(s3, "inputs", now, spec)
    record = dest.with_name(dest.name + ".s3.json")
    record.write_text('{"size": 3')  # torn by a crash, or read while another ingest wrote it
    assert cached_copy(s3, "inputs", now, spec) == dest and json.loads(record.read_text())["etag"] == now["ETag"]


def test_an_s3_endpoint_that_stops_answering_the_tasks_reads_is_one_line_and_exit_75(home, s3_server):
    """The inputs are listed, then every ranged GET the Spark tasks send gets 503 SlowDown past botocore's retries.
    The tasks said so only by raising, and Spark failed the stage as it fails a bug: a traceback and exit 1, which
    Airflow cannot tell from a broken stage. Spark still runs each chunk again (here 2 attempts: an earlier
    attempt raises), and the last attempt's outage is one line and exit 75, no corpus is written, and the same
    command on an endpoint that answers again reads every record."""
    from pipelines.storage.s3 import client, ensure_bucket

    sets = [f"services.s3_endpoint_url={s3_server}", "services.s3_bucket=raw"]
    s3 = client(load_spec(None, sets, env={}))
    ensure_bucket(s3, "raw")
    for k in range(2):
        s3.put_object(Bucket="raw", Key=f"week/in{k}.jsonl",
                      Body=_lines({"text": f"input {k} record {i}"} for i in range(300)))
    out = home / "out"
    cmd = [sys.executable, "-m", "pipelines.data.ingest", "--output", str(out), "--set", "services.spark_master=local[2,2]",
           "--set", "data.inputs=[s3://raw/week/]", "--set", "data.ingest.s3_read=direct",
           *(a for x in sets for a in ("--set", x))]
    env = {**os.environ, "LLMP_HOME": str(home),
           "LLMP_FAULTS": json.dumps([{"at": "s3", "do": "s3_503", "op": "GetObject", "times": 0}])}
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 75, r.stdout[-2000:] + r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if "could not be read" in line]
    assert len(said) == 1 and "s3://raw/week/in" in said[0] and "run it again" in said[0], r.stderr[-3000:]
    assert "Lost task" in r.stderr and "(TID" in r.stderr, r.stderr[-3000:]  # the first attempts raised: retried
    assert "in stage_main" not in r.stderr and not (out / "COMMIT").exists()  # no traceback of the driver's
    env.pop("LLMP_FAULTS")
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert load_manifest(out).counts["docs"] == 600


def test_a_corpus_manifest_that_is_not_a_corpus_version_is_one_line_and_exit_2(home, tmp_path):
    from pipelines.manifest import StageDir

    write = home / "in.jsonl"
    write.write_text('{"text": "one doc"}\n')
    sd = StageDir(home / "runs", "filter", "k", [{"uri": "x", "sha256": "0"}])
    with sd:
        (sd.tmp / "kept").mkdir()
        filt = sd.commit({"kept": "kept"})
    spec = load_spec(None, [f"data.inputs=[{write}]"], env={})
    with pytest.raises(IngestError, match="is a filter result, not a corpus version"):
        ingest.run(spec, corpus=filt)
