"""Data mixtures (issue 45, item 4): ``train.mixture: {SOURCE: weight}`` over the train split's sources.

Synthetic corpora: three sources whose docs interleave in the token stream, each source's tokens in a range of its
own, so a sample's tokens say which source it came from. Checked: achieved shares within 1 % of the target over a run,
epochs of an upsampled source counted, windows deterministic from the seed, the same windows after a resume and on
another DP size, glob keys and the '*' default, refusals that name the key, no mixture = the samples of before; and
one tiny training run through the train stage (manifest ``extra.mixture``, MLflow metrics).
"""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.data.shards import ShardWriter
from pipelines.manifest import StageDir, input_ref
from pipelines.spec import load_spec
from pipelines.train.loader import (DPSampler, MixtureError, MixtureSampler, MixtureSamples, Prefetcher,
                                    TokenOutOfVocab, TokenSamples, batch_tensors, mixture_metrics, mixture_weights, sampler_for, train_doc_sources,
                                    train_samples)

from conftest import shard_layout

EOS, L = 2, 16
BASE = {"data/web/cc.jsonl": 10, "data/web/c4.jsonl": 60, "data/books/pg.txt": 110}  # each source's token range
SIZES = {"data/web/cc.jsonl": 700, "data/web/c4.jsonl": 250, "data/books/pg.txt": 40}  # docs of each


def corpus_docs(seed: int = 0) -> tuple[list[np.ndarray], list[str]]:
    """Docs of the three sources in a shuffled order (runs of one source are short), each ending with EOS."""
    rng = np.random.default_rng(seed)
    sources = rng.permutation([s for s, n in SIZES.items() for _ in range(n)]).tolist()
    docs = [np.append(BASE[s] + rng.integers(0, 40, rng.integers(3, 30)), EOS) for s in sources]
    return docs, sources


def source_of(sample: np.ndarray) -> str:
    """The source of a sample: every token but EOS lies in its source's range."""
    hit = {s for s in BASE for t in sample if t != EOS and BASE[s] <= t < BASE[s] + 40}
    assert len(hit) == 1, f"a sample mixes sources {hit}"
    return hit.pop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The docs as shards cut at two places, and the per-shard doc sources."""
    docs, sources = corpus_docs()
    cuts = [300, 650]
    prefixes = shard_layout(tmp_path_factory.mktemp("mix") / "shards", docs, cuts)
    per_shard = [sources[a:b] for a, b in zip([0] + cuts, cuts + [len(docs)])]
    return prefixes, per_shard


MIX = {"data/web/cc.jsonl": 2, "data/web/c4.jsonl": 1, "data/books/pg.txt": 1.5}


def mixed(corpus, mixture=MIX) -> MixtureSamples:
    prefixes, per_shard = corpus
    return MixtureSamples(prefixes, L, per_shard, mixture)


def test_achieved_shares_track_the_target_and_epochs_of_an_upsampled_source_are_counted(corpus, capsys):
    samples = mixed(corpus)
    sampler = MixtureSampler(samples, 32, 0, 1, seed=3)
    steps = 60
    drawn = np.concatenate([sampler.next_local() for _ in range(steps)])
    got = {s: 0 for s in samples.names}
    for i in drawn:
        got[source_of(samples[int(i)])] += 1
    rep = sampler.report(sampler.consumed_samples)
    assert rep["samples"] == got and sum(got.values()) == steps * 32
    rows = []
    for s in samples.names:
        assert abs(rep["achieved"][s] - rep["target"][s]) < 0.01, s
        rows.append(f"| {s} | {samples.sizes[samples.names.index(s)]} | {rep['target'][s]:.4f} | "
                    f"{rep['achieved'][s]:.4f} | {rep['samples'][s]} | {rep['epochs'][s]:.2f} |")
    assert rep["target"]["data/books/pg.txt"] == pytest.approx(1 / 3)
    # the small source is upsampled: every pass over its samples draws each exactly once, in a new order
    k = samples.names.index("data/books/pg.txt")
    size = int(samples.sizes[k])
    assert rep["epochs"]["data/books/pg.txt"] == pytest.approx(got["data/books/pg.txt"] / size) and \
        rep["epochs"]["data/books/pg.txt"] > 5
    own = [int(i) - int(samples.offsets[k]) for i in drawn if samples.offsets[k] <= i < samples.offsets[k + 1]]
    passes = [own[e * size:(e + 1) * size] for e in range(len(own) // size)]
    assert all(sorted(p) == list(range(size)) for p in passes) and passes[0] != passes[1]
    with capsys.disabled():
        print("\n| source | samples | target | achieved | drawn | epochs |\n|---|---|---|---|---|---|\n"
              + "\n".join(rows))
    assert set(mixture_metrics(rep)) >= {"mixture/achieved/data_web_cc.jsonl", "mixture/epochs/data_books_pg.txt"}


def test_windows_are_deterministic_from_the_seed_resume_and_another_dp_size_draw_the_same(corpus):
    samples = mixed(corpus)
    run = MixtureSampler(samples, 24, 0, 1, seed=5)
    batches = [run.global_batch(24 * k) for k in range(42)]
    assert all((a == b).all() for a, b in zip(batches, [MixtureSampler(samples, 24, 0, 1, 5).global_batch(24 * k)
                                                        for k in range(40)]))
    assert any((a != b).any() for a, b in zip(batches, [MixtureSampler(samples, 24, 0, 1, 6).global_batch(24 * k)
                                                        for k in range(40)]))
    for _ in range(17):
        run.next_local()
    state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint keeps it
    ranks = [MixtureSampler(samples, 24, r, 4, seed=5) for r in range(4)]  # resumed on DP 4
    for r in ranks:
        r.load_state_dict(state)
    for k in range(17, 40):
        assert (np.concatenate([r.next_local() for r in ranks]) == batches[k]).all()
    ahead = Prefetcher(samples, ranks[1], grad_accum=2, depth=2)  # the loader thread reads what the sampler gives
    try:
        for k in range(2):
            want = batch_tensors(samples, batches[40 + k][6:12])[0]
            assert all((x == w).all() for (x, _), w in zip(ahead.next_step(), want.split(3)))
    finally:
        ahead.close()
    with pytest.raises(ValueError, match="train.mixture shares"):  # a checkpoint of another mixture
        MixtureSampler(mixed(corpus, {**MIX, "data/books/pg.txt": 1}), 24, 0, 1, 5).load_state_dict(state)
    with pytest.raises(ValueError, match="train.mixture shares"):
        DPSampler(len(samples), 24, 0, 1, 5).load_state_dict(state)


def test_skipped_batches_are_left_out_of_the_achieved_shares(corpus):
    sampler = MixtureSampler(mixed(corpus), 8, 0, 1, seed=1)
    sampler.skip = {16}
    seen = [sampler.next_local() for _ in range(5)]  # positions 0, 8, 24, 32, 40
    assert sampler.consumed_samples == 48
    rep = sampler.report(48)
    assert sum(rep["samples"].values()) == 40
    by = {s: 0 for s in rep["samples"]}
    for i in np.concatenate(seen):
        by[source_of(sampler.samples[int(i)])] += 1
    assert by == rep["samples"]


def test_keys_globs_and_the_weight_of_unnamed_sources():
    src = ["data/books/pg.txt", "data/web/c4.jsonl", "data/web/cc.jsonl"]
    assert mixture_weights({"data/web/*": 1, "data/books/pg.txt": 3}, src) == \
        {"data/books/pg.txt": 3, "data/web/c4.jsonl": 1, "data/web/cc.jsonl": 1}
    assert mixture_weights({"data/web/c4.jsonl": 5, "data/web/*": 1, "*": 0}, src) == \
        {"data/books/pg.txt": 0, "data/web/c4.jsonl": 5, "data/web/cc.jsonl": 1}  # its own key beats the glob
    assert mixture_weights({"*": 1}, src) == dict.fromkeys(src, 1.0)
    refusals = [({"data/web/*": 1}, "source 'data/books/pg.txt' has no weight: name it, match it with a glob, or "
                 "add '*': 1 (or 0, to leave it out)"),
                ({"data/news/*": 1, "*": 1}, "key 'data/news/*' matches no source of the corpus's train split"),
                ({"data/wbe/c4.jsonl": 1, "*": 1}, "key 'data/wbe/c4.jsonl' matches no source"),
                ({"data/web/*": 1, "*.jsonl": 2, "*": 1}, "source 'data/web/c4.jsonl' matches both 'data/web/*' and "
                 "'*.jsonl'"),
                ({"*": 0}, "every source has weight 0")]
    for mixture, message in refusals:
        with pytest.raises(MixtureError) as e:
            mixture_weights(mixture, src)
        assert str(e.value).startswith("train.mixture: ") and message in str(e.value) and "\n" not in str(e.value)


def test_weight_zero_leaves_a_source_out_and_a_source_too_small_for_a_sample_is_refused(tmp_path):
    docs = [np.array([10, 11, EOS]), np.array([60] * 40 + [EOS]), np.array([61] * 30 + [EOS])]
    prefixes = shard_layout(tmp_path / "s", docs, [])
    srcs = [["tiny", "big", "big"]]
    samples = MixtureSamples(prefixes, L, srcs, {"big": 1, "tiny": 0})
    assert samples.sizes.tolist() == [4, 0] and samples.names == ["big", "tiny"]
    ids = MixtureSampler(samples, 8, 0, 1, 0).global_batch(0)
    assert all(samples[int(i)][0] in (60, 61) for i in ids)
    with pytest.raises(MixtureError, match="source 'tiny' has 3 train tokens, no sample of 17: give it weight 0"):
        MixtureSamples(prefixes, L, srcs, {"*": 1})


def test_no_mixture_gives_exactly_the_samples_of_before(corpus):
    prefixes, _ = corpus
    samples = TokenSamples(prefixes, L)
    sampler = sampler_for(samples, 16, 1, 2, seed=9)
    assert type(sampler) is DPSampler and "mixture" not in sampler.state_dict()
    n = len(samples)
    for consumed in (0, 16 * 7, n - 5, 3 * n + 11):  # across epoch boundaries
        pos = np.arange(consumed, consumed + 16)
        old = np.array([np.random.default_rng([9, p // n]).permutation(n)[p % n] for p in pos])
        assert (sampler.global_batch(consumed) == old).all() and (sampler.local_at(consumed) == old[8:]).all()


# ------------------------------------------------------------------------------ through the train stage
def _tokenized(home, docs, sources) -> object:
    """A filter result (the docs with their sources) and a tokenize result over it (byte tokenizer, two train
    shards with their ids beside), as the stages record them: what lineage reads a doc's source from."""
    from pipelines.data.tokenize import byte_model

    ids = [f"doc{i}" for i in range(len(docs))]
    fsd = StageDir(home / "var/runs", "filter", "test", [{"uri": "x", "sha256": "0"}])
    with fsd:
        (fsd.tmp / "kept").mkdir()
        pq.write_table(pa.table({"idx": list(range(len(docs))), "id": ids, "text": ["x"] * len(docs),
                                 "source": sources}), fsd.tmp / "kept" / "part-00000.parquet")
        filt = fsd.commit({"kept": "kept"})
    tsd = StageDir(home / "var/runs", "tokenize", "test", [input_ref(filt)])
    with tsd:
        byte_model(tsd.tmp / "tokenizer.model")
        rows, cut = [], len(docs) // 2
        (tsd.tmp / "shards").mkdir()
        for k, (a, b) in enumerate([(0, cut), (cut, len(docs))]):
            w = ShardWriter(tsd.tmp / f"shards/train-{k:05d}-0000", np.uint16)
            for d in docs[a:b]:
                w.add(d)
            w.close()
            pq.write_table(pa.table({"id": ids[a:b]}), tsd.tmp / f"shards/train-{k:05d}-0000.ids.parquet")
            rows.append({"split": "train", "prefix": f"shards/train-{k:05d}-0000", "partition": k, "docs": b - a,
                         "tokens": w.tokens, "text_bytes": w.tokens})
        return tsd.commit({"tokenizer": "tokenizer.model", "shards": "shards"}, extra={
            "shards": rows, "vocab_size": 259, "eos_id": EOS, "dtype": "uint16"})


def test_a_key_that_matches_no_source_fails_the_train_stage_at_start_with_one_line(home, capsys):
    from pipelines.train import launch

    docs, sources = corpus_docs()
    tok = _tokenized(home, docs, sources)
    got = train_doc_sources(tok)  # each doc's source, from the shards' ids and the lineage's docs
    assert [s for part in got for s in part.to_pylist()] == sources
    assert type(train_samples(tok, 16, {})) is TokenSamples  # no mixture: the trainer's samples of before
    code = launch.main(["--tokenize-manifest", tok.path, "--set", 'train.mixture={"data/web/*": 1, "data/news/*": 2, '
                        '"*": 1}', "--set", "model.seq_len=16"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("train: error: train.mixture: key 'data/news/*' matches no source of the corpus's "
                                 "train split (data/books/pg.txt, data/web/c4.jsonl, data/web/cc.jsonl): fix the key "
                                 "or remove it")


def test_a_mixture_trains_and_the_manifest_and_mlflow_record_the_shares(home):
    from pipelines import tracking
    from pipelines.train import launch

    docs, sources = corpus_docs()
    tok = _tokenized(home, docs, sources)
    spec = load_spec(None, ['train.mixture={"data/web/*": 1, "data/books/pg.txt": 2}', "model.seq_len=16",
                            "model.n_layers=1", "model.d_model=16", "model.n_heads=2", "train.steps=6",
                            "train.micro_batch=8", "train.warmup_steps=1", "train.ckpt_every=6",
                            "launcher.nproc_per_node=1", "train.eval_every=0", "train.log_every=6"], env={})
    m = launch.run(spec, tok)
    mix = m.extra["mixture"]
    assert set(mix) >= {"target", "achieved", "samples", "epochs"} and sum(mix["samples"].values()) == 48
    assert mix["target"] == {"data/books/pg.txt": 0.5, "data/web/c4.jsonl": 0.25, "data/web/cc.jsonl": 0.25}
    assert all(abs(mix["achieved"][s] - mix["target"][s]) < 0.01 for s in mix["target"])
    samples = train_samples(tok, 16, spec.train.mixture)
    expect = MixtureSampler(samples, 8, 0, 1, spec.run.seed)
    for _ in range(6):
        expect.next_local()
    assert mix == expect.report(48)  # what the ranks drew is what the sampler draws here
    c = tracking.client(spec)
    run = c.get_run(m.extra["mlflow_run_id"])
    assert json.loads(run.data.params["train.mixture"]) == spec.train.mixture
    assert run.data.metrics["mixture/target/data_books_pg.txt"] == 0.5
    assert run.data.metrics["mixture/epochs/data_books_pg.txt"] == mix["epochs"]["data/books/pg.txt"]
    logged = json.loads(open(c.download_artifacts(run.info.run_id, "train/mixture.json", str(home))).read())
    assert {k: logged[k] for k in mix} == mix and logged["metric_keys"]["data/books/pg.txt"] == "data_books_pg.txt"


def test_mixture_metric_names_are_unique_and_fit_mlflow_whatever_the_source_names():
    from mlflow.utils.validation import path_not_unique, validate_param_and_metric_name

    from pipelines.train.loader import mixture_keys

    long_a, long_b = "s3://bucket/" + "x" * 300 + "/a.jsonl", "s3://bucket/" + "x" * 300 + "/b.jsonl"
    sources = ["a/b_c", "a_b/c", long_a, long_b, "..", "data/books/pg.txt", "plain-name.jsonl"]
    keys = mixture_keys(sources)
    sources.append(keys["a/b_c"])  # a source named like another's hashed key: every key hashed, still unique
    report = {kind: {s: 0.125 for s in sources} for kind in ("target", "achieved", "samples", "epochs")}
    names = mixture_metrics(report)
    assert len(names) == 3 * len(sources)  # no two sources share a name
    assert all(len(n) <= 250 and validate_param_and_metric_name(n) and not path_not_unique(n) for n in names)
    assert keys["data/books/pg.txt"] == "data_books_pg.txt" and keys["plain-name.jsonl"] == "plain-name.jsonl"
    assert keys["a/b_c"] != keys["a_b/c"] and keys["a/b_c"].startswith("a_b_c-")
    assert keys[long_a] != keys[long_b] and keys[long_a].startswith("s3_bucket_xxx")
    assert mixture_keys(["data/books/pg.txt"]) == {"data/books/pg.txt": "data_books_pg.txt"}  # the names of before


class _Client:
    """An MlflowClient that records log_batch and log_text, or raises ``error`` on log_batch."""

    def __init__(self, error=None):
        self.error, self.batches, self.texts = error, [], {}

    def log_batch(self, run_id, metrics=()):
        if self.error:
            raise self.error
        self.batches.append(list(metrics))

    def log_text(self, run_id, text, artifact_file):
        self.texts[artifact_file] = text


def _finishing(client, said: list):
    """What Trainer.log_last reads of a trainer: rank 0's tracker, the checkpoint events, train.steps, the log."""
    from types import SimpleNamespace

    from pipelines.train.trainer import Tracker

    tracker = Tracker.__new__(Tracker)
    tracker.client, tracker.run_id, tracker.pending = client, "run", [("train/loss", 1.0, 6)]
    return SimpleNamespace(tracker=tracker, spec=SimpleNamespace(train=SimpleNamespace(steps=6)), log=said.append,
                           ckpt=SimpleNamespace(events=SimpleNamespace(take=lambda: [("ckpt/stall_s", 0.1, 6)])))


def test_the_last_mlflow_logging_sends_every_source_and_cannot_fail_a_finished_run():
    from mlflow.exceptions import MlflowException

    from pipelines.train.trainer import Trainer

    sources = [f"data/src-{i:03d}.jsonl" for i in range(400)]  # 1,200 metrics: more than one batch
    mix = {kind: {s: 0.0025 for s in sources} for kind in ("target", "achieved", "samples", "epochs")}
    said: list = []
    ok = _finishing(_Client(), said)
    Trainer.log_last(ok, {"mixture": mix})
    sent = [m.key for batch in ok.tracker.client.batches for m in batch]
    assert max(map(len, ok.tracker.client.batches)) <= 1000 and len(sent) == 1200 + 2 and not said
    assert json.loads(ok.tracker.client.texts["train/mixture.json"])["target"] == mix["target"]
    down = _finishing(_Client(MlflowException("INVALID_PARAMETER_VALUE")), said)
    Trainer.log_last(down, {"mixture": mix})  # said, not raised: result.json is still written
    assert len(said) == 1 and said[0].startswith("[train] MLflow: the last metrics were not logged (MlflowException")
    assert down.tracker.pending == []


def test_tokenize_writes_each_docs_source_beside_its_id_and_the_loader_reads_no_lineage_for_it(home, spark,
                                                                                               monkeypatch):
    """Every rank would otherwise read every doc the lineage added (ids and sources of the whole corpus) to learn
    which source each train doc is; the shards' own ``source`` column says it, in shard order."""
    from conftest import c4_docs
    from test_tokenize import _filter_manifest

    from pipelines.data import tokenize
    from pipelines.train import loader

    docs = [{"id": f"d{i}", "text": d["text"], "source": f"data/src-{i % 3}.jsonl"} for i, d in enumerate(c4_docs(90))]
    spec = load_spec(None, ["tokenizer.vocab_size=500", "tokenizer.heldout_fraction=0.2"], env={})
    tok = tokenize.run(spec, _filter_manifest(home, docs), spark=spark)
    by_id = {d["id"]: d["source"] for d in docs}
    want = []
    for sh in tok.extra["shards"]:
        beside = pq.read_table(tok.dir / (sh["prefix"] + ".ids.parquet")).to_pydict()
        assert beside["source"] == [by_id[i] for i in beside["id"]]  # the held-out shards too
        want += [by_id[i] for i in beside["id"]] if sh["split"] == "train" else []
    ids, sources = loader.lineage_sources(tok)  # what the lineage says of each doc
    known = dict(zip(ids.to_pylist(), sources.to_pylist()))
    lineage = [known[i] for sh in tok.extra["shards"] if sh["split"] == "train"
               for i in pq.read_table(tok.dir / (sh["prefix"] + ".ids.parquet")).column("id").to_pylist()]

    def unread(*a, **k):
        raise AssertionError("the lineage was read")

    monkeypatch.setattr(loader, "added_docs", unread)
    assert [x for part in train_doc_sources(tok) for x in part.to_pylist()] == want == lineage
    samples = train_samples(tok, 16, {"data/src-0.jsonl": 1, "*": 1})
    assert samples.names == ["data/src-0.jsonl", "data/src-1.jsonl", "data/src-2.jsonl"]


def test_a_storage_error_reading_the_sources_is_raised_for_a_retry_a_broken_lineage_is_the_users(monkeypatch,
                                                                                                 tmp_path):
    import errno
    from types import SimpleNamespace

    from pipelines.manifest import StageError
    from pipelines.train import loader

    (tmp_path / "s.ids.parquet").parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": ["d0"]}), tmp_path / "s.ids.parquet")  # no sources beside the ids: the lineage
    tok = SimpleNamespace(path="/runs/tokenize/m.json", dir=tmp_path, extra={"shards": [{"split": "train",
                                                                                         "prefix": "s"}]})
    monkeypatch.setattr(loader, "chain", lambda t: [t])
    for error, raised in [(OSError(errno.EIO, "Input/output error"), OSError), (TimeoutError("NFS"), TimeoutError),
                          (StageError("no filter or decontaminate stage in its lineage"), MixtureError),
                          (FileNotFoundError(2, "No such file", "kept"), MixtureError)]:
        def fail(*a, _e=error, **k):
            raise _e

        monkeypatch.setattr(loader, "added_docs", fail)
        with pytest.raises(raised) as e:
            train_doc_sources(tok)
        assert (raised is MixtureError) == str(e.value).startswith("train.mixture: the sources of /runs/tokenize")


def test_shards_with_and_without_their_sources_beside_read_the_lineage_once_and_agree(home, monkeypatch):
    from pipelines.train import loader

    docs, sources = corpus_docs()
    tok = _tokenized(home, docs, sources)  # two shards whose .ids.parquet hold the ids only
    first = tok.dir / (tok.extra["shards"][0]["prefix"] + ".ids.parquet")
    ids = pq.read_table(first).column("id").to_pylist()
    cut = tok.extra["shards"][0]["docs"]
    first.chmod(0o644)
    beside = [f"beside/{s}" for s in sources[:cut]]  # not the lineage's names: which one was read shows
    pq.write_table(pa.table({"id": ids, "source": beside}), first)  # the first as tokenize writes it now
    reads, tables = [], []
    real, read_table = loader.added_docs, pq.read_table
    monkeypatch.setattr(loader, "added_docs", lambda *a, **k: reads.append(1) or real(*a, **k))
    monkeypatch.setattr(pq, "read_table", lambda path, *a, **k: tables.append((str(path), k.get("columns")))
                        or read_table(path, *a, **k))
    assert [s for part in train_doc_sources(tok) for s in part.to_pylist()] == beside + sources[cut:]
    assert len(reads) == len(loader.chain(tok))  # each version's docs once, for the second shard alone
    assert [c for p, c in tables if p == str(first)] == [["source"]]  # its sources alone, not its ids
    monkeypatch.setattr(pq, "read_table", read_table)
    pq.write_table(pa.table({"id": ids, "source": [None] + sources[1:cut]}), first)
    with pytest.raises(MixtureError, match=f"doc 'doc0' of shard {tok.extra['shards'][0]['prefix']} has no source"):
        train_doc_sources(tok)


def test_a_samples_token_is_found_where_the_stream_holds_it(corpus, tmp_path):
    """``position``: where the loader says a bad token id lies (the shard named to the user), against the stream
    positions each source's runs cover, for every token of every sample."""
    samples = mixed(corpus)
    at = [np.concatenate([np.arange(s, s + n) for s, n in spans]) for spans in samples.spans]
    for i in range(len(samples)):
        k = int(np.searchsorted(samples.offsets, i, side="right")) - 1
        j = i - int(samples.offsets[k])
        assert [samples.position(i, c) for c in range(L + 1)] == at[k][j * L:(j + 1) * L + 1].tolist(), i
    plain = TokenSamples(corpus[0], L)
    assert [plain.position(7, c) for c in (0, L)] == [7 * L, 8 * L]
    # a sample across an empty shard: the id is in the third shard, and that is the one named
    docs = [np.arange(10) % 5, np.arange(7) % 5, np.array([9, 1, 2])]
    across = TokenSamples(shard_layout(tmp_path / "s", docs, [2, 2]), seq_len=3)
    with pytest.raises(TokenOutOfVocab, match=r"train-00002-0000.bin holds token id 9 \(sample 5\)"):
        batch_tensors(across, np.array([1, 5]), vocab=5)  # sample 5: tokens 15..18, 17 the third shard's first

