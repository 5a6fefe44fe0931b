import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import sentencepiece as spm

from pipelines.data import tokenize
from pipelines.data.shards import Shard, ShardWriter, token_dtype
from pipelines.manifest import Manifest, StageDir, load_manifest
from pipelines.spec import load_spec

from conftest import c4_docs


def _filter_manifest(home, docs, files: int = 1) -> Manifest:
    """A filter-stage manifest over ``docs`` (what tokenize reads) in ``files`` parquet files, written through the
    real StageDir."""
    sd = StageDir(home / "var/runs", "filter", "test", [{"uri": "x", "sha256": "0"}])
    with sd:
        tbl = pa.table({"idx": list(range(len(docs))), "id": [d["id"] for d in docs],
                        "text": [d["text"] for d in docs], "source": ["t"] * len(docs)})
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
            assert sp.decode(ids[:-1]) == tokenize.normalise(d["text"])  # exact round trip
        assert sum(len(v) for v in got.values()) == m.counts[f"{split}_tokens"]
    assert len([s for s in m.extra["shards"] if s["split"] == "train"]) > 1  # sharding happened
    for s in m.extra["shards"]:
        sh = Shard.open(m.dir / s["prefix"])
        assert sh.num_tokens == s["tokens"] and sh.num_docs == s["docs"]
        assert (m.dir / (s["prefix"] + ".bin")).stat().st_size == s["tokens"] * 2  # uint16 for a small vocab
    assert m.counts["tokens"] == m.counts["train_tokens"] + m.counts["heldout_tokens"]
    assert m.counts["docs"] == len(docs)
    assert load_manifest(m.path).extra["tokenizer_sha256"] == m.output_sha("tokenizer")


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
