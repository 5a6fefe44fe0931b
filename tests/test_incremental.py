"""Incremental curation: corpus A, then A + B. B's near-duplicates of A are removed through A's persisted
signatures, B's unique docs are kept, A's shards are reused byte for byte, and the corpus version lists both; a
third run with nothing new gives back the same version."""
import json
import os
import subprocess
import sys
from urllib.parse import urlparse

import pyarrow.parquet as pq
import pytest

from conftest import ROOT, c4_docs, write_jsonl
from pipelines.data import dedup, filter as filter_stage, ingest, tokenize
from pipelines.manifest import load_manifest, sha256_file
from pipelines.spec import load_spec

pytestmark = pytest.mark.spark

SETS = ["tokenizer.vocab_size=600", "tokenizer.shard_tokens=40000", "data.filters.steps=[language]"]


def _near(text: str) -> str:
    words = text.split(" ")
    words[-3] = "changed"
    return " ".join(words)


def _curate(spec, spark, corpus=None, dedup_cli=None):
    ing = ingest.run(spec, spark=spark, corpus=corpus)
    if dedup_cli is not None:
        dd = dedup_cli(ing)
    else:
        against = [load_manifest(p) for p in corpus.extra["corpus"]["dedup"]] if corpus is not None else []
        dd = dedup.run(spec, ing, spark=spark, against=against)
    filt = filter_stage.run(spec, dd, spark=spark)
    return ing, dd, tokenize.run(spec, filt, spark=spark, corpus=corpus)


def test_a_new_week_is_deduped_against_the_corpus_and_added_as_new_shards(home, spark):
    docs = [d for d in c4_docs(400) if len(d["text"].split()) > 80]
    a, fresh = docs[:150], docs[150:200]
    write_jsonl(home / "week1.jsonl", [{"text": d["text"]} for d in a])
    copies = [{"text": a[i]["text"]} for i in (3, 4)]             # exact copies of A docs
    nears = [{"text": _near(a[i]["text"])} for i in (10, 11, 12)]  # one word changed
    write_jsonl(home / "week2.jsonl", [{"text": d["text"]} for d in fresh] + copies + nears
                + [{"text": fresh[0]["text"]}])                     # and a duplicate within B
    spec = load_spec(None, SETS + [f"data.inputs=[{home / 'week1.jsonl'}]"], env={})
    _, d1, v1 = _curate(spec, spark)
    assert v1.extra["corpus"]["version"] == 1 and v1.counts["new_docs"] == v1.counts["docs"]
    assert "signatures" in {o["name"] for o in d1.outputs}

    spec = load_spec(None, SETS + [f"data.inputs=[{home / 'week1.jsonl'}, {home / 'week2.jsonl'}]"], env={})

    def dedup_cli(ing):  # the contract CLI
        out = home / "dedup2"
        r = subprocess.run([sys.executable, "-m", "pipelines.data.dedup", "--input-manifest", ing.path,
                            "--against-manifest", d1.path, "--output", str(out), *(a for s in SETS for a in
                                                                                    ("--set", s)),
                            "--set", "services.spark_master=local[2]"],
                           env={**os.environ, "LLMP_HOME": str(home)}, cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return load_manifest(out)

    ing2, d2, v2 = _curate(spec, spark, corpus=v1, dedup_cli=dedup_cli)
    assert ing2.counts["docs"] == 50 + 2 + 3 + 1  # week1 is in the corpus already: not read again
    assert {i.get("key") for i in ing2.inputs if "stage" not in i} == {"week2.jsonl"}
    c = d2.counts
    assert c["removed_against"] == 5 and c["removed"] == 6 and c["kept"] == 50 and c["docs_in"] == 56
    assert c["kept"] + c["removed"] == c["docs_in"]
    removed = pq.read_table(d2.output("removed")).to_pylist()
    against = [r for r in removed if r["reason"].endswith("_of_corpus")]
    a_ids = set(pq.read_table(d1.output("kept")).column("id").to_pylist())
    assert len(against) == 5 and all(r["dup_of_id"] in a_ids for r in against)
    assert sorted(r["reason"] for r in against) == ["exact_duplicate_of_corpus"] * 2 + ["near_duplicate_of_corpus"] * 3
    kept_texts = set(pq.read_table(d2.output("kept")).column("text").to_pylist())
    assert kept_texts == {d["text"] for d in fresh}  # B's unique docs, A's never emitted again

    corpus = v2.extra["corpus"]
    assert corpus["version"] == 2 and corpus["previous"] == v1.path and corpus["dedup"] == [d1.path, d2.path]
    assert len(corpus["inputs"]) == 2 and corpus["inputs"][0] == v1.extra["corpus"]["inputs"][0]
    old = v1.extra["shards"]
    assert v2.extra["shards"][:len(old)] == old and all(s["prefix"].startswith("shards/v0002/")
                                                       for s in v2.extra["shards"][len(old):])
    for s in old:  # A's shards, byte for byte (hard links of the same files)
        for ext in tokenize.SHARD_FILES:
            assert sha256_file(v2.dir / (s["prefix"] + ext)) == sha256_file(v1.dir / (s["prefix"] + ext))
            assert (v2.dir / (s["prefix"] + ext)).stat().st_ino == (v1.dir / (s["prefix"] + ext)).stat().st_ino
    assert v2.output_sha("tokenizer") == v1.output_sha("tokenizer")
    assert v2.counts["docs"] == v1.counts["docs"] + v2.counts["new_docs"] and v2.counts["new_docs"] > 40
    got = {**tokenize.read_back(v2, "train"), **tokenize.read_back(v2, "heldout")}
    assert len(got) == v2.counts["docs"]

    _, _, v3 = _curate(spec, spark, corpus=v2)  # nothing new: the same version
    assert v3.path == v2.path

    # against a corpus built with other MinHash settings: refused with both named (exit 2), nothing written
    r = subprocess.run([sys.executable, "-m", "pipelines.data.dedup", "--input-manifest", ing2.path,
                        "--against-manifest", d1.path, "--ngram", "4", "--output", str(home / "dedup3")],
                       env={**os.environ, "LLMP_HOME": str(home)}, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2 and "ngram=5" in r.stderr and "ngram=4" in r.stderr and "Traceback" not in r.stderr
    assert not (home / "dedup3").exists()


def _without_spark(home, module: str, *args: str) -> tuple[dict, str]:
    """``python -m module args --no-spark`` as the Airflow operator runs it first: its report and its output."""
    rep = home / "report.json"
    r = subprocess.run([sys.executable, "-m", module, *args, "--no-spark", "--report", str(rep),
                        *(a for s in SETS for a in ("--set", s))], env={**os.environ, "LLMP_HOME": str(home)}, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(rep.read_text()), r.stdout


def test_a_run_without_spark_reuses_done_work_commits_an_empty_delta_and_stops_where_spark_is_needed(home, spark):
    """``--no-spark`` (what SparkStageOperator runs before it spark-submits): a result committed for these inputs is
    reused; a nothing-new ingest is committed (0 docs) and a tokenize with no new docs gives back the corpus
    version, with no session; a stage that has docs (even none) to read on Spark stops and leaves nothing."""
    docs = [d for d in c4_docs(200) if len(d["text"].split()) > 80][:60]
    write_jsonl(home / "week1.jsonl", [{"text": d["text"]} for d in docs])
    inputs = ["--set", f"data.inputs=[{home / 'week1.jsonl'}]"]
    spec = load_spec(None, SETS + inputs[1:], env={})
    ing, dd, v1 = _curate(spec, spark)

    assert _without_spark(home, "pipelines.data.dedup", "--ingest-manifest", ing.path, *inputs)[0] == \
        {"stage": "dedup", "manifest": dd.path}
    rep, _ = _without_spark(home, "pipelines.data.ingest", "--corpus-manifest", v1.path, *inputs)
    empty = load_manifest(rep["manifest"])
    assert empty.counts["docs"] == 0 and empty.extra["spark_master"] == "none (no new input)"
    assert pq.read_table(empty.output("docs")).num_rows == 0

    before = sorted(p.name for p in dd.dir.parent.iterdir() if not p.name.endswith(".lock"))
    rep, out = _without_spark(home, "pipelines.data.dedup", "--ingest-manifest", empty.path, *inputs)
    assert rep == {"stage": "dedup", "needs": "spark"} and "llm-pipeline-dedup needs a spark session" in out
    assert sorted(p.name for p in dd.dir.parent.iterdir() if not p.name.endswith(".lock")) == before

    filt = filter_stage.run(spec, dedup.run(spec, empty, spark=spark, against=[dd]), spark=spark)
    rep, out = _without_spark(home, "pipelines.data.tokenize", "--filter-manifest", filt.path,
                              "--corpus-manifest", v1.path, *inputs)
    assert rep == {"stage": "tokenize", "manifest": v1.path} and "no new docs; corpus version 1 stands" in out

    first = urlparse(next(i["uri"] for i in v1.inputs if i.get("stage") == "filter")).path  # docs v1 holds, as new
    before = sorted(p.name for p in v1.dir.parent.iterdir() if not p.name.endswith(".lock"))
    rep, out = _without_spark(home, "pipelines.data.tokenize", "--filter-manifest", first, "--corpus-manifest", v1.path,
                              *inputs)
    assert rep == {"stage": "tokenize", "needs": "spark"} and "llm-pipeline-tokenize needs a spark session" in out
    assert sorted(p.name for p in v1.dir.parent.iterdir() if not p.name.endswith(".lock")) == before  # no staging

    r = subprocess.run([sys.executable, "-m", "pipelines.data.dedup", "--ingest-manifest", ing.path, "--no-spark"],
                       env={**os.environ, "LLMP_HOME": str(home)}, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--no-spark needs --report" in r.stderr


def _docs_parquet(path, texts, first_idx):
    import pyarrow as pa

    path.mkdir()
    pq.write_table(pa.table({"idx": pa.array(range(first_idx, first_idx + len(texts)), pa.int64()),
                             "id": [f"d{first_idx + i}" for i in range(len(texts))], "text": texts,
                             "source": ["t"] * len(texts)}), path / "part-00000.parquet")
    return path


def _reference_against(new_sig, old_sig, threshold):
    """Every (new, old) pair by brute force: the old doc each new doc duplicates (exact key first, then the
    highest Jaccard among those sharing a band, ties: the smallest id), as id → (dup_of_id, reason, jaccard)."""
    from pipelines.data.keepers import pair_jaccard

    out = {}
    for n in new_sig:
        best = None
        for o in old_sig:
            if n["keys"] is None or o["keys"] is None:
                continue
            exact = n["keys"][0] == o["keys"][0]
            band = any(a == b for a, b in zip(n["keys"][1:], o["keys"][1:]))
            j = (float(pair_jaccard(pa_binary([n["sh"]]), pa_binary([o["sh"]]))[0])
                 if band and n["sh"] is not None and o["sh"] is not None else 0.0)
            if exact or (band and j >= threshold):
                cand = (0 if exact else 1, -(1.0 if exact else j), o["id"])
                best = min(best, cand) if best else cand
        if best:
            out[n["id"]] = (best[2], "exact_duplicate_of_corpus" if best[0] == 0 else "near_duplicate_of_corpus",
                            -best[1])
    return out


def pa_binary(values):
    import pyarrow as pa

    return pa.array(values, pa.binary())


def test_the_corpus_scan_equals_a_brute_force_reference_in_any_number_of_rounds_and_tasks(tmp_path, spark,
                                                                                           monkeypatch):
    """New docs against old signatures: the removed docs, each with its old doc, reason and Jaccard, are those a
    pair-by-pair reference finds; the same when the new buckets go out in many rounds and the old corpus is cut
    into many pieces."""
    from pipelines.spec import DedupCfg

    docs = [d["text"] for d in c4_docs(300) if len(d["text"].split()) > 60][:110]
    old, fresh = docs[:80], docs[80:]
    new = fresh + [old[3], old[4]] + [_near(old[i]) for i in (10, 11, 12)]
    new += [" ".join(old[20].split()[: len(old[20].split()) * 2 // 3])]  # a third cut: shares bands, J < 0.8
    cfg = DedupCfg()
    old_out, new_alone = tmp_path / "old_out", tmp_path / "new_alone"
    dedup.dedup_docs(spark, _docs_parquet(tmp_path / "old", old, 0), old_out, cfg, tasks=2)
    new_docs = _docs_parquet(tmp_path / "new", new, 1000)
    assert dedup.dedup_docs(spark, new_docs, new_alone, cfg, tasks=2)["removed"] == 0  # distinct among themselves
    old_sig = pq.read_table(old_out / "signatures").to_pylist()
    new_sig = pq.read_table(new_alone / "signatures").to_pylist()
    want = _reference_against(new_sig, old_sig, cfg.threshold)
    assert {v[1] for v in want.values()} == {"exact_duplicate_of_corpus", "near_duplicate_of_corpus"}
    assert len(want) == 5  # the third cut shares no band at J ≥ 0.8 (or none at all)

    def removed_against(out, tasks):
        stats = dedup.dedup_docs(spark, new_docs, out, cfg, [old_out / "signatures"], tasks)
        rows = pq.read_table(out / "removed").to_pylist()
        got = {r["id"]: (r["dup_of_id"], r["reason"], r["jaccard"]) for r in rows
               if r["reason"].endswith("_of_corpus")}
        assert stats["removed_against"] == len(got)
        return {k: (a, b, round(j, 9)) for k, (a, b, j) in got.items()}

    want = {k: (a, b, round(j, 9)) for k, (a, b, j) in want.items()}
    assert removed_against(tmp_path / "one_round", 2) == want
    monkeypatch.setattr(dedup, "BROADCAST_KEYS", 40)  # ≈ 3 docs' buckets a round: 10 rounds
    assert removed_against(tmp_path / "many_rounds", 5) == want


def _lineage_run(home, *args):
    return subprocess.run([sys.executable, "-m", "pipelines.lineage", *args, "--json"], env={**os.environ,
                          "LLMP_HOME": str(home)}, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _lineage(home, *args):
    r = _lineage_run(home, *args)
    return r.returncode, (json.loads(r.stdout) if r.returncode == 0 else r.stderr)


def test_a_source_taken_down_leaves_the_next_version_and_only_its_shards_are_rewritten(home, spark):
    """--exclude-source: the registered version that saw the source is tagged at once; the next curation run, with
    nothing new, publishes a version without its docs (no Spark; untouched shards stay the same files); a later run
    removes new docs of it in the filter stage (reason takedown); once applied, nothing new means the same version."""
    from mlflow import MlflowClient

    from pipelines.lineage import queries, takedowns
    from pipelines.lineage.takedowns import TAG
    from pipelines.manifest import lineage as upstream

    docs = [d for d in c4_docs(400) if len(d["text"].split()) > 60]
    write_jsonl(home / "a.jsonl", [{"text": d["text"], "url": f"https://ok.example/{i}"} for i, d in enumerate(docs[:90])]
                + [{"text": d["text"], "url": f"https://ok.example/take/{i}"} for i, d in enumerate(docs[90:94])])
    write_jsonl(home / "b.jsonl", [{"text": d["text"], "url": f"https://b.example/{i}"} for i, d in enumerate(docs[94:130])])
    sets = ["tokenizer.vocab_size=600", "tokenizer.shard_tokens=6000", "data.filters.steps=[language]"]
    spec = load_spec(None, sets + [f"data.inputs=[{home / 'a.jsonl'}, {home / 'b.jsonl'}]"], env={})
    _, _, v1 = _curate(spec, spark)
    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'var' / 'mlflow.db'}")
    client.create_registered_model("td-model")
    client.create_model_version("td-model", str(home), tags={"data_manifest_hash": v1.digest})
    held_b = queries.source_query(spec, client, "b.jsonl")
    assert held_b["corpus_versions"] and held_b["models"][0]["name"] == "td-model"
    for same in ("./b.jsonl", str(home / "b.jsonl"), str(home / "sub" / ".." / "b.jsonl")):  # one key, however spelt
        assert queries.source_query(spec, client, same)["corpus_versions"] == held_b["corpus_versions"]
    n_b = held_b["corpus_versions"][0]["source_docs"]
    assert n_b > 20

    assert _lineage(home, "--exclude-source", "b.jsonl")[0] == 2  # --reason is required
    rc, err = _lineage(home, "--exclude-source", "https://", "--reason", "x")
    assert rc == 2 and "needs a host" in err and "Traceback" not in err
    rc, err = _lineage(home, "--exclude-source", "b.jsonl", "--reason", "ok\nx.jsonl: forged")  # a forged tag line
    assert rc == 2 and "control character" in err
    rc, out = _lineage(home, "--exclude-source", "b.jsonl", "--reason", "owner request 2026-11")
    assert rc == 0 and out["exclusion"]["added"] and out["models_tagged"] == [{"name": "td-model", "version": "1"}]
    assert client.get_model_version("td-model", "1").tags[TAG] == "b.jsonl: owner request 2026-11"
    rc, out = _lineage(home, "--exclude-source", "https://ok.example/take/", "--reason", "dmca")
    assert rc == 0 and out["corpus_versions"][0]["source_docs"] == 4
    assert _lineage(home, "--exclude-source", "b.jsonl", "--reason", "again")[1]["exclusion"]["added"] is False
    rc, out = _lineage(home, "--exclude-source", "HTTPS://OK.Example:443/take/", "--reason", "again")  # the same key
    assert rc == 0 and out["exclusion"]["added"] is False and out["exclusion"]["source"] == "https://ok.example/take/"
    n_a = queries.source_query(spec, client, "a.jsonl")["corpus_versions"][0]["source_docs"]
    host = queries.source_query(spec, client, "HTTPS://OK.EXAMPLE")  # a URL prefix: the host's docs, all of a's
    assert host["source"] == "https://ok.example/" and host["corpus_versions"][0]["source_docs"] == n_a
    r = _lineage_run(home, "--source", "https://ok.ex")  # not a host boundary: nothing, and it says so
    assert r.returncode == 0 and json.loads(r.stdout)["corpus_versions"] == [] and "lineage: warning: no corpus " \
        "version" in r.stderr
    assert _lineage_run(home, "--source", "https://ok.ex", "--strict").returncode == 1
    r = _lineage_run(home, "--exclude-source", "never.jsonl", "--reason", "x", "--strict")  # not recorded
    assert r.returncode == 1 and "nothing recorded (--strict)" in r.stderr and "never.jsonl" not in \
        (home / "var" / "exclusions.jsonl").read_text()
    assert client.get_model_version("td-model", "1").tags[TAG] == "b.jsonl: owner request 2026-11\n" \
                                                                  "https://ok.example/take/: dmca"

    _, _, v2 = _curate(spec, spark, corpus=v1)  # nothing new, but a takedown: a new version
    assert v2.path != v1.path and v2.extra["corpus"]["version"] == 2 and v2.counts["new_docs"] == 0
    td = v2.extra["takedown"]
    assert [(e["source"], e["reason"], e["docs_removed"]) for e in td["exclusions"]] == [
        ("b.jsonl", "owner request 2026-11", n_b), ("https://ok.example/take/", "dmca", 4)]
    assert v2.counts["docs"] == v1.counts["docs"] - n_b - 4 and v2.extra["partitions"] == 0  # no Spark job
    rewritten = td["shards_rewritten"]
    untouched = [s for s in v1.extra["shards"] if s["prefix"] not in rewritten]
    assert rewritten and untouched  # only the shards that held them
    assert all(new is None or new.startswith("shards/v0002/takedown-") for new in rewritten.values())
    for s in untouched:
        for ext in tokenize.SHARD_FILES:
            assert (v2.dir / (s["prefix"] + ext)).stat().st_ino == (v1.dir / (s["prefix"] + ext)).stat().st_ino
    before = {**tokenize.read_back(v1, "train"), **tokenize.read_back(v1, "heldout")}
    after = {**tokenize.read_back(v2, "train"), **tokenize.read_back(v2, "heldout")}
    gone = set(before) - set(after)
    assert len(gone) == n_b + 4 and all(after[i] == before[i] for i in after)  # the rest, token for token
    # every shard, rewritten or not, keeps each doc's source beside its id, as the lineage records it
    from pipelines.train.loader import lineage_sources, train_doc_sources

    ids, sources = lineage_sources(v2)
    known = dict(zip(ids.to_pylist(), sources.to_pylist()))
    for s in (s for s in v2.extra["shards"] if s["prefix"] in rewritten.values()):
        beside = pq.read_table(v2.dir / (s["prefix"] + ".ids.parquet")).to_pydict()
        assert beside["source"] == [known[i] for i in beside["id"]]
    train_ids = [i for s in v2.extra["shards"] if s["split"] == "train"
                 for i in pq.read_table(v2.dir / (s["prefix"] + ".ids.parquet")).column("id").to_pylist()]
    assert [x for part in train_doc_sources(v2) for x in part.to_pylist()] == [known[i] for i in train_ids]
    assert sum(s["text_bytes"] for s in v2.extra["shards"]) < sum(s["text_bytes"] for s in v1.extra["shards"])
    assert [v["version"] for v in queries.source_query(spec, client, "b.jsonl")["corpus_versions"]] == [1]
    assert [e.source for e in queries.pending_takedowns(spec, v1.digest)] == ["b.jsonl", "https://ok.example/take/"]
    assert queries.pending_takedowns(spec, v2.digest) == []
    # a corpus not under this spec's run.root (tokenize run with --output, another run.root): by digest nothing can
    # be said; the register stage passes the manifest it holds, which is read wherever it lives
    away = load_spec(None, sets + [f"run.root={home / 'another-root'}"], env={})
    assert queries.pending_takedowns(away, v1.digest) is None
    assert [e.source for e in queries.pending_takedowns(away, v1.digest, v1)] == ["b.jsonl", "https://ok.example/take/"]

    write_jsonl(home / "c.jsonl", [{"text": d["text"], "url": f"https://ok.example/{'take/' * (i < 2)}c{i}"}
                                   for i, d in enumerate(docs[130:140])])
    spec = load_spec(None, sets + [f"data.inputs=[{home / 'a.jsonl'}, {home / 'b.jsonl'}, {home / 'c.jsonl'}]"],
                     env={})
    _, _, v3 = _curate(spec, spark, corpus=v2)
    filt = load_manifest(upstream(v3.path)["filter"])
    assert filt.counts["removed_by_reason"].get("takedown") == 2 and filt.extra["takedown"]["removed"] == 2
    assert v3.counts["new_docs"] == 8 and v3.extra["takedown"]["docs_removed"] == 0
    _, _, v4 = _curate(spec, spark, corpus=v3)  # applied: nothing new is the same version again
    assert v4.path == v3.path
    # an exclusion added after a run's filter stage: its tokenize stage applies it to the new docs itself (all of
    # c's here: with nothing else to take out, the version before stands)
    takedowns.add(home / "var" / "exclusions.jsonl", "c.jsonl", "late")
    assert tokenize.run(spec, filt, spark=spark, corpus=v2).path == v2.path


class _NoModels:  # an MLflow client with no registered version
    def search_model_versions(self, max_results, page_token):
        return type("Page", (list,), {"token": None})()


def test_a_takedown_during_a_curation_run_is_never_published_as_applied(home, spark, monkeypatch):
    """Issue 46: an exclusion added while the filter stage runs (after it read the list) must not reach a corpus
    version recorded as applied. The filter stage records the digest of the list it read, so tokenize applies the
    newer list to the new docs itself; one added while tokenize runs is refused when the version would be published
    (exit 75: a retry applies it); the next run applies the list, and the version's record (digest, docs removed
    from earlier versions and by the filter stage) is what happened."""
    from pipelines.lineage import queries, takedowns
    from pipelines.manifest import lineage as upstream

    docs = [d for d in c4_docs(300) if len(d["text"].split()) > 60]
    write_jsonl(home / "a.jsonl", [{"text": d["text"], "url": f"https://a.example/{i}"}
                                   for i, d in enumerate(docs[:40])])
    write_jsonl(home / "b.jsonl", [{"text": d["text"], "url": f"https://B.Example/{'x' if i < 10 else 'y'}/{i}"}
                                   for i, d in enumerate(docs[40:70])])
    sets = ["tokenizer.vocab_size=600", "tokenizer.shard_tokens=6000", "data.filters.steps=[language]"]
    _, _, v1 = _curate(load_spec(None, sets + [f"data.inputs=[{home / 'a.jsonl'}]"], env={}), spark)
    spec = load_spec(None, sets + [f"data.inputs=[{home / 'a.jsonl'}, {home / 'b.jsonl'}]"], env={})
    listed = home / "var" / "exclusions.jsonl"

    def takedown_inside(module, name, source):  # fires inside the stage, after it read the list
        real = getattr(module, name)

        def hooked(*a, **kw):
            takedowns.add(listed, source, "owner request")
            return real(*a, **kw)
        monkeypatch.setattr(module, name, hooked)
        return real

    real = takedown_inside(filter_stage, "filter_docs", "https://b.example/x")
    ing = ingest.run(spec, spark=spark, corpus=v1)
    dd = dedup.run(spec, ing, spark=spark, against=[load_manifest(p) for p in v1.extra["corpus"]["dedup"]])
    filt = filter_stage.run(spec, dd, spark=spark)
    monkeypatch.setattr(filter_stage, "filter_docs", real)
    assert filt.extra["takedown"] == {"exclusions": 0, "list_sha256": None, "removed": 0, "by_exclusion": []}
    assert takedowns.read_list(listed).sha256 is not None  # the list it did not apply is not recorded as applied
    v2a = tokenize.run(spec, filt, spark=spark, corpus=v1)  # tokenize applies the current list to the new docs
    td = v2a.extra["takedown"]
    assert td["list_sha256"] == takedowns.read_list(listed).sha256
    assert [(x["source"], x["docs_removed"], x["new_docs_removed"]) for x in td["exclusions"]] == [
        ("https://b.example/x", 0, 10)] and td["new_docs_removed_by_tokenize"] == td["new_docs_removed"] == 10
    ids = {**tokenize.read_back(v2a, "train"), **tokenize.read_back(v2a, "heldout")}
    assert len({i for i in ids if i.startswith("b.jsonl:")}) == 20 and v2a.counts["new_docs"] == 20  # the y docs
    assert queries.pending_takedowns(spec, v2a.digest) == []
    print(f"filter raced: corpus v2 published with {td['new_docs_removed_by_tokenize']} new docs left out by tokenize")

    real = takedown_inside(tokenize, "encode_new", "https://a.example/1")  # while tokenize runs: refused at publish
    with pytest.raises(tokenize.ListChanged, match="changed while the tokenize stage ran") as e:
        _curate(spec, spark, corpus=v1)
    assert e.value.exit_code == 75  # retried: a retry of the stage applies the current list
    print(f"tokenize raced: {e.value}")
    monkeypatch.setattr(tokenize, "encode_new", real)
    assert [v.path for v in queries.corpus_versions(spec)] == [v1.path, v2a.path]

    _, _, v2 = _curate(spec, spark, corpus=v1)  # the next run applies the current list
    filt = load_manifest(upstream(v2.path)["filter"])
    current = takedowns.read_list(listed).sha256
    td = v2.extra["takedown"]
    assert td["list_sha256"] == filt.extra["takedown"]["list_sha256"] == current
    a1 = [r["id"] for r in pq.read_table(load_manifest(upstream(v1.path)["filter"]).output("kept")).to_pylist()
          if r["url"] == "https://a.example/1"]
    assert [(x["source"], x["docs_removed"], x["new_docs_removed"]) for x in td["exclusions"]] == [
        ("https://b.example/x", 0, 10), ("https://a.example/1", len(a1), 0)]
    assert filt.extra["takedown"]["removed"] == td["new_docs_removed"] == 10
    ids = {**tokenize.read_back(v2, "train"), **tokenize.read_back(v2, "heldout")}
    before = {**tokenize.read_back(v1, "train"), **tokenize.read_back(v1, "heldout")}
    assert set(before) - set(ids) == set(a1) and len(a1) == 1  # /1 only: not /10 … /19 (a path boundary)
    kept_b = {r["id"] for r in pq.read_table(filt.output("kept")).to_pylist() if r["source"] == "b.jsonl"}
    assert len(kept_b) == 20 and {i for i in ids if i.startswith("b.jsonl:")} == kept_b  # the y docs, no x doc
    assert queries.source_query(spec, _NoModels(), "https://b.example/x/")["corpus_versions"] == []
    print(f"published: corpus v{v2.extra['corpus']['version']}, list {current[:12]} applied; "
          + ", ".join(f"{x['source']}: {x['docs_removed']} from earlier versions, {x['new_docs_removed']} new"
                      for x in td["exclusions"]))


def test_keys_are_compared_as_sources_not_strings(home):
    """Input keys and URL prefixes, from users and from data, are compared normalised; a prefix takes at a host or
    path boundary only; hostile keys are refused with a reason (from a user) or compared as written (from data)."""
    import unicodedata

    import pyarrow as pa

    from pipelines.lineage.keys import Matcher, source_key

    nfd = unicodedata.normalize("NFD", "café.jsonl")
    assert {source_key(k) for k in ("café.jsonl", "./café.jsonl", nfd, str(home / "café.jsonl"))} == {"café.jsonl"}
    assert {source_key(k) for k in ("HTTPS://A.EXAMPLE", "https://a.example:443/", "https://a.example./")} == {
        "https://a.example/"}
    assert source_key("http://Bücher.Example:8080/X") == "http://xn--bcher-kva.example:8080/X"  # the path as given
    m = Matcher([source_key("https://a.example")])
    assert [m.hit(None, u) for u in ("https://a.example/x", "HTTPS://A.EXAMPLE", "https://user@a.example/p",
                                     "https://a.example.evil.org/", "https://a.example:8443/",
                                     "https://a.example@evil.org/", "http://[bad/", "ht!tp://a.example/")] == \
        [True] * 3 + [False] * 5
    m = Matcher([source_key("https://a.example/take/"), source_key("s3://bucket/dir"), source_key(nfd)])
    assert [m.hit(None, u) for u in ("https://a.example/take", "https://a.example/take?x=1",
                                     "https://a.example/takeover")] == [True, True, False]
    assert [m.hit(s, None) for s in ("café.jsonl", "s3://bucket/dir/x.jsonl", "s3://bucket/dirx.jsonl")] == \
        [True, True, False]
    t = pa.table({"source": ["café.jsonl", "o", None, "o"], "url": [None, "https://A.example/take/1", "x", None]})
    assert m.mask(t).to_pylist() == [True, True, False, False]
    for bad, why in (("https://", "needs a host"), ("http://[bad/", "not a URL"), ("://x", "not a URL"),
                     ("a\nb", "control character"), ("  ", "empty"), ("https://a.example:99999/", "bad host or port")):
        with pytest.raises(ValueError, match=why):
            source_key(bad)
    # both sides read as the URL filter and a browser read them (WHATWG): the host it would connect to, the path
    # with dot segments resolved and unreserved characters' escapes decoded
    for prefix, url in (("https://a.example", "https://a.example\\@evil.org/x"),
                        ("https://a.example", "https://%61.example/x"),
                        ("https://a.example/take", "https://a.example/x/../take/y"),
                        ("https://a.example/~u", "https://a.example/%7Eu/page"),
                        ("https://faß.de", "https://xn--fa-hia.de/"), ("http://0x7f.1", "http://127.0.0.1/x"), ("http://[0:0::1]", "http://[::1]/x"),
                        ("https://a.example/%7eu", "HTTPS://A.EXAMPLE.:443/~u/")):
        assert Matcher([source_key(prefix)]).hit(None, url), (prefix, url)
    m = Matcher([source_key("dir"), source_key("https://a.example")])  # a local directory: the files under it
    assert [m.hit(s, None) for s in ("dir/x.jsonl", "dir", "dirx.jsonl", "https://a.example/x.jsonl")] == \
        [True, True, False, True]


def test_the_vectorised_mask_is_the_per_row_rule(home):
    """Matcher.masks (each distinct key normalised once, prefixes compared vectorised, URLs already in the parser's
    form not parsed) takes exactly the rows Matcher.hit takes one by one, boundaries and hostile keys included."""
    import random
    import string
    import unicodedata

    import pyarrow as pa

    from pipelines.lineage.keys import Exclusion, Matcher, as_is, source_key, whatwg_key
    from pipelines.lineage.takedowns import split_by_exclusion

    prefixes = ["https://a.example", "https://a.example/take/", "https://b.example/p?x=1", "s3://bucket/dir", "dir",
                "café.jsonl", "http://[::1]", "https://xn--fa-hia.de/~u"]
    urls = [None, "", "not a url", "https://a.example", "https://a.example.evil.org/", "https://a.example/take",
            "https://a.example/takeover", "https://a.example/take?x", "https://a.example/x/../take/1",
            "https://b.example/p?x=1&y", "https://b.example/p?x=10", "https://b.example/p?x=1#f", "HTTPS://A.EXAMPLE/x",
            "https://a.example:8443/", "https://user@a.example/", "https://a.example@evil.org/", "http://[bad/",
            "https://a.example\\@evil.org/", "https://faß.de/%7Eu/p", "https://xn--fa-hia.de/~ux", "http://[0::1]/",
            "https://a.example/é", "https://a.example./t", "ht!tp://a.example/", "https://%61.example/take/x"]
    sources = [None, "dir/x.jsonl", "dirx.jsonl", "dir", "café.jsonl", unicodedata.normalize("NFD", "café.jsonl"),
               "s3://bucket/dir/x", "s3://Bucket/dir", "s3://bucket/dirx", "https://a.example/f.jsonl", "other.jsonl"]
    rows = [(s, u) for s in sources for u in urls]
    t = pa.table({"source": [s for s, _ in rows], "url": [u for _, u in rows]})
    keys = [source_key(p) for p in prefixes]
    m = Matcher(keys)
    assert m.mask(t).to_pylist() == [m.hit(s, u) for s, u in rows]
    for k, got in zip(keys, m.masks(t)):
        assert got.to_pylist() == [Matcher([k]).hit(s, u) for s, u in rows], k
    parts = list(split_by_exclusion(t, [Exclusion(k, "r") for k in keys]))  # each row with the first that takes it
    want = [next((i for i, k in enumerate(keys) if Matcher([k]).hit(s, u)), None) for s, u in rows]
    assert [p.num_rows for _, p in parts] == [want.count(i) for i in range(len(keys))]
    rnd, chars = random.Random(0), string.ascii_letters + string.digits + "._~!$&'()*+,;=:@/-?#%"
    for _ in range(3000):  # a URL taken as it is must be what the parser gives
        u = f"https://{rnd.choice(['a', 'b1', 'x_y.c-d'])}.example/" + "".join(rnd.choices(chars, k=rnd.randint(0, 12)))
        assert not as_is(u) or whatwg_key(u) == u, u


def test_the_takedown_list_lock_is_waited_for_boundedly_and_never_skipped(tmp_path, monkeypatch):
    """Issue 46 review: a held lock is waited for up to a deadline, then one line naming its holder (exit 75, a
    retry); a lock file this user may only read still locks; a file system without flock fails, never unlocked."""
    import errno
    import fcntl

    from pipelines.lineage import takedowns
    from pipelines.lineage.takedowns import ListUnavailable

    listed = tmp_path / "exclusions.jsonl"
    with takedowns.locked(listed, exclusive=True):  # an --exclude-source writing the list
        with pytest.raises(ListUnavailable, match=r"still held after 0.05 s \(the lock file says: pid \d+ on .+ since"):
            with takedowns.list_held(listed, wait_s=0.05):
                pass
    with takedowns.list_held(listed) as now:  # a corpus version being published
        assert now is None
        with pytest.raises(ListUnavailable, match="still held after 0.05 s .*holder unknown") as e:
            takedowns.add(listed, "x.jsonl", "r", wait_s=0.05)
    assert e.value.exit_code == 75 and not listed.exists()
    assert takedowns.add(listed, "x.jsonl", "r")[1]

    real_open = os.open

    def read_only(path, flags, *a, **kw):  # the lock file made 0644 by another user
        if str(path).endswith(".lock") and flags & os.O_RDWR:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)
    monkeypatch.setattr(os, "open", read_only)
    assert takedowns.add(listed, "y.jsonl", "r")[1]
    monkeypatch.setattr(os, "open", real_open)

    def no_flock(fd, mode):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "flock", no_flock)
    for attempt in (lambda: takedowns.add(listed, "z.jsonl", "r"), lambda: takedowns.list_held(listed).__enter__()):
        with pytest.raises(ListUnavailable, match="No locks available.*must support flock"):
            attempt()
    monkeypatch.undo()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / ".exclusions.jsonl.lock").mkdir()  # a lock file that cannot be opened
    with pytest.raises(ListUnavailable, match="cannot open the takedown list's lock"):
        takedowns.add(tmp_path / "other" / "exclusions.jsonl", "x.jsonl", "r")
    assert [e.source for e in takedowns.read_list(listed).exclusions] == ["x.jsonl", "y.jsonl"]


def test_a_query_that_could_not_look_into_a_corpus_version_never_exits_0(tmp_path, monkeypatch, capsys):
    """``--source``/``--doc``/``--exclude-source`` print their answer with the version they could not look into, and
    end 2 for a damaged version (it ended 0, the version only in the JSON, a takedown's text not naming it) and 75 for
    one storage did not return."""
    from pipelines.lineage import __main__ as cli

    damaged = {"manifest": f"{tmp_path}/tokenize/k1/manifest.json", "error": "no shard shard-00000.bin",
               "storage": False}
    answer = {"source": "data/a.jsonl", "corpus_versions": [], "models": [], "unreadable": [damaged]}
    monkeypatch.setattr(cli, "client", lambda spec: None)
    monkeypatch.setattr(cli, "source_query", lambda spec, c, source: answer)
    assert cli.main(["--source", "data/a.jsonl", "--set", f"run.root={tmp_path}"]) == 2
    out, err = capsys.readouterr()
    assert f"unreadable: {damaged['manifest']}: no shard" in out, out
    assert "lineage: error: 1 corpus version(s) cannot be looked into" in err and "Traceback" not in err, err
    damaged["storage"] = True
    assert cli.main(["--source", "data/a.jsonl", "--set", f"run.root={tmp_path}"]) == 75
    assert "could not be read now" in capsys.readouterr().err
    answer["unreadable"] = []
    assert cli.main(["--source", "data/a.jsonl", "--set", f"run.root={tmp_path}"]) == 0


def test_a_previous_version_that_storage_cannot_return_is_retried_and_a_missing_one_is_the_users_to_fix(tmp_path,
                                                                                                       monkeypatch):
    """The chain of corpus versions: an I/O error reading the version a corpus extends is the infrastructure's
    (exit 75, the task's retry reads it again); a version removed or damaged is not (exit 2, named)."""
    import errno

    from pipelines.lineage import queries, takedowns
    from pipelines.manifest import Manifest

    prev = tmp_path / "v1" / "manifest.json"
    prev.parent.mkdir()
    prev.write_text(Manifest(stage="tokenize", config_hash="a").to_json())
    tok = Manifest(stage="tokenize", config_hash="b", extra={"corpus": {"previous": str(prev)}},
                   path=str(tmp_path / "v2" / "manifest.json"))
    assert [m.config_hash for m in queries.chain(tok)] == ["b", "a"]

    def eio(path):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(queries, "load_manifest", eio)
    with pytest.raises(queries.VersionUnreadable, match="could not be read now .*Input/output error") as e:
        queries.chain(tok)
    assert e.value.exit_code == 75
    monkeypatch.undo()
    # damaged or forged: not a manifest, or a path no retry mends; each one line, exit 2
    for text in ('{"stage": "tokenize", "config_hash": "a", "forged": 1}', '["stage"]', '{"stage": "t", "config_hash":'
                 ' "a", "outputs": [1]}', '{"stage": "t", "config_hash": "a", "extra": "s"}'):
        prev.write_text(text)
        with pytest.raises(queries.StageError, match="v1/manifest.json, cannot be read .*is not a manifest") as e:
            queries.chain(tok)
        assert e.value.exit_code == 2
    for forged in ("x" * 5000, ["x"]):  # a name too long for the file system, a list
        bad = Manifest(stage="tokenize", config_hash="c", extra={"corpus": {"previous": forged}}, path=tok.path)
        with pytest.raises(queries.StageError) as e:
            queries.chain(bad)
        assert e.value.exit_code == 2 and not isinstance(e.value, queries.VersionUnreadable)
    prev.write_text("[" * 200_000)  # nested past the parser
    with pytest.raises(queries.StageError, match="is not a manifest") as e:
        queries.chain(tok)
    assert e.value.exit_code == 2
    prev.unlink()
    with pytest.raises(queries.StageError, match="cannot be read .*no manifest at") as e:
        queries.chain(tok)
    assert e.value.exit_code == 2

    # the versions under run.root: a foreign file is none, storage's error is retried, never a version passed over
    from pipelines.spec import load_spec

    spec = load_spec(None, [f"run.root={tmp_path}/root"], env={})
    (tmp_path / "root" / "tokenize" / "k1").mkdir(parents=True)
    (tmp_path / "root" / "tokenize" / "k1" / "manifest.json").write_text("not json")
    assert queries.corpus_versions(spec) == []
    monkeypatch.setattr(queries, "load_manifest", eio)
    with pytest.raises(queries.VersionUnreadable, match="k1/manifest.json could not be read now") as e:
        queries.corpus_versions(spec)
    assert e.value.exit_code == 75
    assert queries.storage_error(e.value) and not queries.storage_error(ValueError())
    monkeypatch.undo()
    def refused(p):
        raise PermissionError(errno.EACCES, "Permission denied", str(p))

    monkeypatch.setattr(queries, "load_manifest", refused)  # (root here reads a file whatever its mode)
    with pytest.raises(queries.StageError, match="k1/manifest.json cannot be read .*give this user read") as e:
        queries.corpus_versions(spec)  # was: passed over, as if it held nothing
    assert e.value.exit_code == 2
    monkeypatch.undo()
    # a version's folder that cannot be listed: Path.glob dropped it (a refusal) and the version with it
    real = os.scandir

    def folder(code):
        def scandir(path="."):
            if str(path).endswith("/tokenize"):
                raise OSError(code, os.strerror(code), str(path))
            return real(path)
        return scandir

    for code, exit_code in ((errno.EACCES, 2), (errno.EIO, 75)):
        monkeypatch.setattr(os, "scandir", folder(code))
        with pytest.raises(queries.StageError, match="tokenize (could not be listed now|cannot be listed)") as e:
            queries.corpus_versions(spec)
        assert e.value.exit_code == exit_code
        monkeypatch.undo()

    # a takedown that could not read a version for storage's reason: recorded, then exit 75 (its retry tags the rest)
    spec = load_spec(None, [f"run.root={tmp_path}/root", f"data.exclusions={tmp_path}/takedowns.jsonl"], env={})
    unread = [{"manifest": "m", "error": "Input/output error", "storage": True}]
    monkeypatch.setattr(queries, "source_holders", lambda spec, key: ([], unread))
    monkeypatch.setattr(queries, "models_trained_on", lambda client, digests: [])
    with pytest.raises(queries.VersionUnreadable, match="is recorded in .*1 corpus version.*run the same command"):
        queries.exclude_source(spec, None, "data/a.jsonl", "request 1")
    assert [e.source for e in takedowns.read_list(tmp_path / "takedowns.jsonl").exclusions] == ["data/a.jsonl"]
    unread[0]["storage"] = False  # a damaged version: listed, nothing to retry, and never an exit 0 (it was one)
    res = queries.exclude_source(spec, None, "data/a.jsonl", "request 1")
    assert res["unreadable"] == unread
    code, line = queries.incomplete(res)
    assert code == 2 and "1 corpus version(s) cannot be looked into (m: Input/output error)" in line \
        and "not tagged" in line, line
    code, line = queries.incomplete({"doc": "d", "corpus_versions": [], "unreadable": [*unread, {**unread[0],
                                                                                          "storage": True}]})
    assert code == 75 and "2 corpus version(s) could not be read now (m: Input/output error and 1 more)" in line \
        and "leaves it out" in line, line
    assert queries.incomplete({"doc": "d", "corpus_versions": [], "unreadable": []}) is None
    # --strict records nothing when no version holds it; a version it could not look into may: not "nothing" (exit 1)
    for storage, code in ((False, 2), (True, 75)):
        unread[0]["storage"] = storage
        with pytest.raises(queries.StageError, match="--strict: nothing recorded: no corpus version it could look "
                                                     "into holds docs of it, and 1 corpus version") as e:
            queries.exclude_source(spec, None, "data/b.jsonl", "request 2", strict=True)
        assert e.value.exit_code == code and not isinstance(e.value, queries.NothingMatched)
    assert [e.source for e in takedowns.read_list(tmp_path / "takedowns.jsonl").exclusions] == ["data/a.jsonl"]
