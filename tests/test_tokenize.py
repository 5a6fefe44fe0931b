import os

import numpy as np
import pytest
import pyarrow as pa
import pyarrow.parquet as pq
import sentencepiece as spm

from pipelines.data import tokenize
from pipelines.data.shards import Shard, ShardWriter, token_dtype
from pipelines.data.spark import plan_pieces
from pipelines.manifest import Manifest, StageDir, load_manifest
from pipelines.spec import load_spec

from conftest import c4_docs


def _filter_manifest(home, docs, files: int = 1) -> Manifest:
    """A filter-stage manifest over ``docs`` (what tokenize reads) in ``files`` parquet files, written through the
    real StageDir."""
    sd = StageDir(home / "var/runs", "filter", "test", [{"uri": "x", "sha256": "0"}])
    with sd:
        tbl = pa.table({"idx": list(range(len(docs))), "id": [d["id"] for d in docs],
                        "text": [d["text"] for d in docs], "source": [d.get("source", "t") for d in docs]})
        (sd.tmp / "kept").mkdir()
        step = -(-len(docs) // files)
        for k in range(files):
            pq.write_table(tbl.slice(k * step, step), sd.tmp / "kept" / f"part-{k:05d}.parquet")
        pq.write_table(tbl.slice(0, 0), sd.tmp / "removed.parquet")
        return sd.commit({"kept": "kept", "removed": "removed.parquet"})


def test_shards_round_trip_and_counts_match_the_manifest(home, spark):
    docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(c4_docs(250))]
    docs.append({"id": "crlf", "text": "Windows line\r\nendings and  double  spaces\tand tabs, ünïcödé ＦＵＬＬ"})
    spec = load_spec(None, ["tokenizer.vocab_size=600", "tokenizer.shard_tokens=20000",
                            "tokenizer.heldout_fraction=0.1"], env={})
    m = tokenize.run(spec, _filter_manifest(home, docs), spark=spark)
    assert m.extra["spark_master"] == "local[2]" and m.extra["partitions"] >= 1
    sp = spm.SentencePieceProcessor(model_file=str(m.output("tokenizer")))
    eos = m.extra["eos_id"]
    by_split = {s: [d for d in docs if tokenize.split_of(d["id"], spec.run.seed, 0.1) == s] for s in tokenize.SPLITS}
    assert by_split["heldout"] and len(by_split["train"]) > 200
    for split, expected in by_split.items():
        got = tokenize.read_back(m, split)  # doc id → token ids, through the shards' .ids.parquet
        assert sorted(got) == sorted(d["id"] for d in expected)
        for d in expected:
            ids = got[d["id"]]
            assert ids[-1] == eos and eos not in ids[:-1]
            assert sp.decode(ids[:-1]) == tokenize.canonical_text(d["text"])  # exact round trip
        assert sum(len(v) for v in got.values()) == m.counts[f"{split}_tokens"]
    assert len([s for s in m.extra["shards"] if s["split"] == "train"]) > 1  # sharding happened
    for s in m.extra["shards"]:
        sh = Shard.open(m.dir / s["prefix"])
        assert sh.num_tokens == s["tokens"] and sh.num_docs == s["docs"]
        assert (m.dir / (s["prefix"] + ".bin")).stat().st_size == s["tokens"] * 2  # uint16 for a small vocab
    assert m.counts["tokens"] == m.counts["train_tokens"] + m.counts["heldout_tokens"]
    assert m.counts["docs"] == len(docs)
    assert load_manifest(m.path).extra["tokenizer_sha256"] == m.output_sha("tokenizer")


def test_char_and_byte_tokenizers_and_a_held_out_tail_per_input(home, spark):
    """tokenizer.model_type=char: every piece but the specials is one character of the corpus, and every character
    of it has a piece (vocab_size is not used, so not checked); byte: the 256 bytes (id = byte + 3), no training.
    tokenizer.heldout=tail: the last 10 % of each input's docs, and of the text of an input that is one doc."""
    many = [{"id": f"a{i}", "text": d["text"], "source": "a.jsonl"} for i, d in enumerate(c4_docs(60))]
    book = {"id": "book", "text": "\n".join(d["text"] for d in c4_docs(80)[60:]), "source": "book.txt"}
    docs = many + [book]
    sets = ["tokenizer.heldout=tail", "tokenizer.heldout_fraction=0.1", "tokenizer.vocab_size=10"]
    m = tokenize.run(load_spec(None, sets + ["tokenizer.model_type=char"], env={}), _filter_manifest(home, docs),
                     spark=spark)
    sp = spm.SentencePieceProcessor(model_file=str(m.output("tokenizer")))
    pieces = {sp.id_to_piece(i) for i in range(sp.get_piece_size())
              if not (sp.is_control(i) or sp.is_unknown(i))}
    text = tokenize.canonical_text(book["text"])
    cut = int(len(text) * 0.9)
    trained_on = [tokenize.canonical_text(d["text"]) for d in many[:54]] + [text[:cut]]  # the held-out tail is not
    chars = {c for t in trained_on for c in t}
    assert all(len(p) == 1 for p in pieces) and {c.replace(" ", "\u2581") for c in chars} == pieces
    assert m.extra["heldout"] == {"mode": "tail", "fraction": 0.1}
    held = tokenize.read_back(m, "heldout")
    assert sorted(held) == sorted([f"a{i}" for i in range(54, 60)] + ["book#tail"])  # ceil(60 × 0.9) = 54
    train = tokenize.read_back(m, "train")
    assert sp.decode(train["book"][:-1]) == text[:cut]
    if set(text[cut:]) <= chars:  # a character only the tail has is <unk> in a char model
        assert sp.decode(held["book#tail"][:-1]) == text[cut:]

    m = tokenize.run(load_spec(None, sets + ["tokenizer.model_type=byte"], env={}), _filter_manifest(home, docs),
                     spark=spark)
    sp = spm.SentencePieceProcessor(model_file=str(m.output("tokenizer")))
    assert sp.get_piece_size() == m.extra["vocab_size"] == 259
    got = tokenize.read_back(m, "train")
    for d in many[:5]:
        assert got[d["id"]][:-1] == [b + 3 for b in tokenize.canonical_text(d["text"]).encode()]
        assert sp.decode(got[d["id"]][:-1]) == tokenize.canonical_text(d["text"])
    with pytest.raises(ValueError, match="at least 64"):
        load_spec(None, ["tokenizer.vocab_size=10"], env={})  # bpe: vocab_size means something, so it is checked


@pytest.mark.parametrize("vocab, says", [
    (300, r"tokenizer.vocab_size=300 is smaller than the \d+ pieces it must hold .*: raise tokenizer.vocab_size or "
          r"lower tokenizer.character_coverage$"),
    (60000, r"tokenizer.vocab_size=60000 is more pieces than the tokenizer's sample yields \(at most \d+\): lower "
            r"tokenizer.vocab_size"),
])
def test_a_vocabulary_sentencepiece_cannot_train_is_the_specs_to_fix_in_one_line(home, spark, vocab, says):
    """SentencePiece refuses in the Spark task that trains it: the driver says which key to change (exit 2), no
    executor traceback, no task retried."""
    docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(c4_docs(60))]
    spec = load_spec(None, [f"tokenizer.vocab_size={vocab}"], env={})
    with pytest.raises(tokenize.TokenizerRefused, match=says) as e:
        tokenize.run(spec, _filter_manifest(home, docs), spark=spark)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_idx_is_megatron_mmidx_and_uint32_for_large_vocabs(tmp_path):
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32
    w = ShardWriter(tmp_path / "big", token_dtype(128_000))
    docs = [np.array([5, 100_000, 2]), np.array([127_999, 2]), np.array([2])]
    for d in docs:
        w.add(d)
    w.close()
    raw = (tmp_path / "big.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    sh = Shard.open(tmp_path / "big")
    assert sh.tokens.dtype == np.uint32 and sh.num_docs == 3
    assert [sh.doc(i).tolist() for i in range(3)] == [d.tolist() for d in docs]
    assert sh.pointers.tolist() == [0, 12, 20]  # byte offsets


def test_the_plan_covers_every_row_once_in_order_with_balanced_tasks():
    """Row groups (file, group, rows, text bytes) cut into tasks: a big group is cut by rows, small ones are
    packed, every row lands in one piece, in file order, and no task is far off its share."""
    groups = [("a", 0, 1000, 800_000), ("a", 1, 10, 8_000), ("b", 0, 30, 24_000), ("c", 0, 1, 50_000),
              ("c", 1, 500, 400_000)]
    for n in (1, 2, 3, 7, 40):
        tasks = plan_pieces(groups, n)
        assert 1 <= len(tasks) <= n
        pieces = [p for t in tasks for p in t]
        rows = [(p.file, p.group, r) for p in pieces for r in range(p.start, p.stop)]
        assert rows == [(f, g, r) for f, g, k, _ in groups for r in range(k)]  # each row once, in order
        share = sum(g[3] for g in groups) / n
        biggest_piece = max(p.nbytes for p in pieces)
        assert all(abs(sum(p.nbytes for p in t) - share) <= max(biggest_piece, 0.02 * share) for t in tasks), n
    assert len(plan_pieces(groups, 40)) > 30  # the 1000-row group alone is cut into ~25 pieces


def test_a_piece_is_read_as_its_rows_of_the_group_streaming_across_batches(tmp_path, monkeypatch):
    """read_piece gives exactly the rows start..stop of its group (the columns asked, in that order), whether the
    piece lies inside one decoded batch, across several or at the group's end."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.data import spark as sp

    monkeypatch.setattr(sp, "PIECE_READ_ROWS", 7)  # small batches: pieces cross their edges
    path = tmp_path / "g.parquet"
    t = pa.table({"id": [f"d{i}" for i in range(100)], "text": [f"t{i}" for i in range(100)], "n": list(range(100))})
    pq.write_table(t, path, row_group_size=40)  # groups of 40, 40, 20
    for g, rows in ((0, 40), (1, 40), (2, 20)):
        group = pq.ParquetFile(path).read_row_group(g)
        for a, b in ((0, rows), (0, 1), (3, 5), (6, 15), (13, 14), (rows - 1, rows), (5, 5)):
            got = sp.read_piece(sp.Piece(str(path), g, a, b, 0), ["n", "id"])
            assert got.column_names == ["n", "id"] and got.to_pylist() == group.select(["n", "id"]).slice(a, b - a).to_pylist()


def test_shards_published_to_s3_match_the_manifest_and_a_rerun_repairs_the_copy(home, spark, s3_server, capsys):
    """services.shards_uri: the tasks upload their shards, the driver checks every object and uploads the
    manifest last; the S3 copy equals the stage directory byte for byte. A re-run (the stage is reused) finds a
    missing and a rewritten object and uploads just those."""
    import hashlib

    from pipelines.storage.s3 import client, split_uri

    docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(c4_docs(120))]
    sets = ["tokenizer.vocab_size=400", "tokenizer.shard_tokens=8000", f"services.s3_endpoint_url={s3_server}",
            "services.shards_uri=s3://curated/shards/v1/"]
    spec = load_spec(None, sets, env={})
    filt = _filter_manifest(home, docs, files=2)
    m = tokenize.run(spec, filt, spark=spark)
    s3 = client(spec)
    prefix = f"shards/v1/{m.dir.name}"

    def remote() -> dict[str, str]:
        objs = [o["Key"] for p in s3.get_paginator("list_objects_v2").paginate(Bucket="curated", Prefix=prefix)
                for o in p.get("Contents", [])]
        return {k[len(prefix) + 1:]: hashlib.sha256(s3.get_object(Bucket="curated", Key=k)["Body"].read()).hexdigest()
                for k in objs}

    out = capsys.readouterr().out
    got = remote()
    assert got == {**{o["path"]: o["sha256"] for o in m.outputs}, "manifest.json": sha256_of(m.path)}
    assert len(m.extra["shards"]) > 2 and "1 uploaded by the driver" in out  # the tokenizer: the tasks did the shards
    assert split_uri(spec.services.shards_uri) == ("curated", "shards/v1")

    first = m.extra["shards"][0]["prefix"]
    s3.delete_object(Bucket="curated", Key=f"{prefix}/{first}.bin")
    s3.put_object(Bucket="curated", Key=f"{prefix}/{first}.idx", Body=b"not the index")
    again = tokenize.run(spec, filt, spark=spark)
    assert again.path == m.path and "2 uploaded by the driver" in capsys.readouterr().out
    assert remote() == got


def test_an_endpoint_refusing_the_shards_uploads_is_one_line_and_75_and_the_retry_publishes(home, s3_server):
    """Every PutObject answered 503 past botocore's retries: a Spark task's upload raised S3UploadFailedError, which
    failed the stage through Spark (a traceback, exit 1). The tasks now leave their uploads to the driver, whose
    publish (after the commit) says in one line that the store did not answer (75); the same command once the
    store answers reuses the committed result and publishes every object."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT
    from pipelines.storage.s3 import S3UploadFailedError, client, outage, unreachable
    from botocore.exceptions import ClientError

    slow = ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
    try:
        try:
            raise slow
        except ClientError as e:  # as boto3's upload_file wraps it
            raise S3UploadFailedError(f"Failed to upload: {e}")
    except S3UploadFailedError as e:
        assert outage(e) and unreachable(e)
    docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(c4_docs(80))]
    filt = _filter_manifest(home, docs, files=2)
    sets = ["tokenizer.vocab_size=400", "tokenizer.shard_tokens=4000", f"services.s3_endpoint_url={s3_server}",
            "services.shards_uri=s3://curated/down/", "services.spark_master=local[2]"]
    cmd = [sys.executable, "-m", "pipelines.data.tokenize", "--input-manifest", filt.path,
           *(a for x in sets for a in ("--set", x))]
    env = {**os.environ, "LLMP_HOME": str(home), "LLMP_FAULTS": json.dumps(
        [{"at": "s3", "do": "s3_503", "op": op, "times": 0} for op in ("PutObject", "UploadPart")])}
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 75, r.stdout[-2000:] + r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if line.startswith("tokenize: error: ")]
    assert len(said) == 1 and "the object store did not answer: S3UploadFailedError" in said[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "the shards' upload left to the driver" in r.stderr, r.stderr[-3000:]
    env.pop("LLMP_FAULTS")
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "published to s3://curated/down/" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    m = load_manifest(next((home / "var" / "runs" / "tokenize").glob("*/manifest.json")))
    s3 = client(load_spec(None, sets, env={}))
    keys = {o["Key"].split("/", 2)[2] for o in s3.list_objects_v2(Bucket="curated", Prefix="down/")["Contents"]}
    assert keys == {o["path"] for o in m.outputs} | {"manifest.json"}


def sha256_of(path) -> str:
    import hashlib
    from pathlib import Path

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_a_previous_corpus_version_naming_files_outside_its_directory_is_refused(tmp_path, monkeypatch):
    """A new corpus version links the previous version's shards and reads its tokenizer by the names its manifest
    gives (a manifest is data: its directory may be written by anyone who can write the shared FS). ``load_manifest``
    refused names with ``..`` or absolute ones, but a shard or tokenizer that is a symlink leading out was linked (or
    copied, or read) from outside into the new version, then hashed and published; now the names are checked where
    they are used too, and a shard or tokenizer that is not a plain file (a symlink, a FIFO that would block its
    reader) is refused in one line, every shard before any is linked, and a file swapped between the check and the
    link is never linked."""
    prev_dir, outside = tmp_path / "v1", tmp_path / "secret"
    (prev_dir / "shards").mkdir(parents=True)
    outside.write_bytes(b"not a shard")
    for ext in tokenize.SHARD_FILES:
        (prev_dir / "shards" / f"train-00000{ext}").write_bytes(b"x")

    def prev(prefix, tok="tokenizer.model"):
        return Manifest(stage="tokenize", config_hash="c", outputs=[{"name": "tokenizer", "path": tok}],
                        extra={"shards": [{"prefix": prefix}]}, path=str(prev_dir / "manifest.json"))

    out = tmp_path / "v2"
    assert [r["prefix"] for r in tokenize.link_shards(prev("shards/train-00000"), out)] == ["shards/train-00000"]
    assert (out / "shards/train-00000.bin").read_bytes() == b"x"  # a plain shard links as before
    for bad in ("../secret", "/etc/passwd", "shards/../../secret"):
        with pytest.raises(ValueError, match="not a plain relative path"):
            tokenize.link_shards(prev(bad), tmp_path / "v3")
    (prev_dir / "shards" / "evil.bin").symlink_to(outside)
    with pytest.raises(ValueError, match="leads outside"):
        tokenize.link_shards(prev("shards/evil"), tmp_path / "v4")
    (prev_dir / "shards" / "inner.bin").symlink_to(prev_dir / "shards" / "train-00000.bin")
    with pytest.raises(ValueError, match="not a plain file"):  # even a link that stays inside: not linked through
        tokenize.link_shards(prev("shards/inner"), tmp_path / "v5")
    assert not (tmp_path / "v3").exists() and not (tmp_path / "v4").exists() and not (tmp_path / "v5").exists()
    with pytest.raises(ValueError, match="not a plain relative path"):
        prev("x", tok="../secret").output("tokenizer")
    (prev_dir / "tokenizer.model").symlink_to(outside)
    with pytest.raises(ValueError, match="leads outside") as e:
        prev("x").output("tokenizer")
    assert e.value.exit_code == 2  # a StageError: one line, the user's to fix
    os.mkfifo(prev_dir / "fifo.model")  # a FIFO would block its reader (SentencePiece, a copy) for ever
    with pytest.raises(ValueError, match="is not a plain file"):
        tokenize.plain_file(prev("x", tok="fifo.model").output("tokenizer"), "m")
    with pytest.raises(ValueError, match="is not a plain file"):  # opened, never waited on
        tokenize.plain_bytes(prev_dir / "fifo.model", "m")
    (prev_dir / "inner.model").symlink_to(prev_dir / "shards" / "train-00000.bin")
    with pytest.raises(ValueError, match="is a symlink, not a plain file") as e:  # read without following it
        tokenize.plain_bytes(prev_dir / "inner.model", "m")
    assert e.value.exit_code == 2 and tokenize.plain_bytes(prev_dir / "shards" / "train-00000.bin", "m") == b"x"
    two = prev("shards/train-00000")  # every row checked before any is linked
    two.extra["shards"].append({"prefix": "shards/evil"})
    with pytest.raises(ValueError, match="leads outside"):
        tokenize.link_shards(two, tmp_path / "v6")
    assert not (tmp_path / "v6").exists()
    real, swapped = os.link, []

    def swap(src, dst, **kw):  # the checked file replaced by a link leading out between the check and the link
        if not swapped:
            swapped.append(src)
            os.unlink(src)
            os.symlink(outside, src)
        return real(src, dst, **kw)

    monkeypatch.setattr(os, "link", swap)
    with pytest.raises(ValueError, match="changed while it was linked"):
        tokenize.link_shards(prev("shards/train-00000"), tmp_path / "v7")
    monkeypatch.setattr(os, "link", real)
    assert swapped and not any(p.is_symlink() or p.read_bytes() == b"not a shard"
                               for p in (tmp_path / "v7").rglob("*") if p.is_file() or p.is_symlink())
