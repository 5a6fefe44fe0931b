"""Dedup and filter stages on a real Spark (local[2]); one session for the module."""
import json
import random
import re

import pyarrow.dataset as ds
import pytest

from pipelines.data import dedup, ingest
from pipelines.data import filter as filter_stage
from pipelines.data.minhash import jaccard, shingles
from pipelines.data.spark import components_single_task, connected_components
from pipelines.spec import load_spec

from conftest import BUNDLED, SHARED, c4_docs, write_jsonl

pytestmark = pytest.mark.spark


def _mutate(text: str, frac: float, seed: int) -> str:
    rng = random.Random(seed)
    words = text.split()
    for i in rng.sample(range(len(words)), int(len(words) * frac)):
        words[i] = f"zz{rng.randrange(10**6)}"
    return " ".join(words)


@pytest.fixture(scope="module")
def corpus():
    docs = [d for d in c4_docs(400) if len(d["text"].split()) > 300][:40]
    base, other = docs[0]["text"], docs[1]["text"]
    near = _mutate(base, 0.01, 1)
    recs = [{"id": f"c4-{i}", "text": d["text"]} for i, d in enumerate(docs)]
    recs += [
        {"id": "near-of-c4-0", "text": near},
        {"id": "exact-of-c4-1", "text": other},
        {"id": "short-a", "text": "Log in with OpenID"},
        {"id": "short-b", "text": "Log in with OpenID"},
        {"id": "short-unique", "text": "Processing Feedback ..."},
    ]
    return recs, jaccard(shingles(base, 5), shingles(near, 5))


def _table(path):
    return {r["id"]: r for r in ds.dataset(str(path), format="parquet").to_table().to_pylist()}


def test_near_and_exact_duplicates_cluster_distinct_docs_stay_apart(home, spark, corpus):
    recs, j_near = corpus
    assert j_near >= 0.85  # the injected variant really is a near-duplicate
    src = write_jsonl(home / "in.jsonl", recs)
    spec = load_spec(None, [f"data.inputs=[{src}]"], env={})
    m = dedup.run(spec, ingest.run(spec, spark=spark), spark=spark)
    cl = _table(m.output("clusters"))
    assert cl["near-of-c4-0"]["cluster"] == cl["c4-0"]["cluster"] == cl["c4-0"]["idx"]
    assert cl["exact-of-c4-1"]["cluster"] == cl["c4-1"]["cluster"]
    assert cl["short-a"]["cluster"] == cl["short-b"]["cluster"]  # exact dups, though too short to shingle
    assert cl["short-unique"]["cluster_size"] == 1
    distinct = {cl[f"c4-{i}"]["cluster"] for i in range(40)}
    assert len(distinct) == 40  # no two originals merged
    removed = _table(m.output("removed"))
    assert set(removed) == {"near-of-c4-0", "exact-of-c4-1", "short-b"}
    assert removed["near-of-c4-0"]["reason"] == "near_duplicate" and removed["near-of-c4-0"]["dup_of_id"] == "c4-0"
    assert removed["exact-of-c4-1"]["reason"] == "exact_duplicate"
    c = m.counts
    assert c["docs_in"] == len(recs) and c["kept"] + c["removed"] == c["docs_in"] and c["removed"] == 3
    assert len(_table(m.output("kept"))) == c["kept"]
    assert m.output("cluster_sizes_plot").stat().st_size > 1000


def test_a_side_table_too_big_to_collect_gives_the_same_outputs(home, spark, corpus, monkeypatch):
    """Above ``BROADCAST_ROWS`` the members are joined to the signatures by a shuffle and Spark writes the side table
    range-partitioned (the output tasks read only their span): the same outputs as the collected side table."""
    from pipelines.data import dedup_outputs

    recs, _ = corpus
    src = write_jsonl(home / "in.jsonl", recs)
    spec = load_spec(None, [f"data.inputs=[{src}]", "data.dedup.partitions=3"], env={})
    ing = ingest.run(spec, spark=spark)
    outs = []
    for rows in (dedup_outputs.BROADCAST_ROWS, 0):
        monkeypatch.setattr(dedup_outputs, "BROADCAST_ROWS", rows)
        m = dedup.run(spec, ing, out_dir=str(home / f"out-{rows}"), spark=spark)
        outs.append([_table(m.output(k)) for k in ("clusters", "kept", "removed", "signatures")] + [m.counts])
    assert outs[0] == outs[1] and set(outs[0][2]) == {"near-of-c4-0", "exact-of-c4-1", "short-b"}


def test_docs_without_shingles_and_an_empty_corpus(tmp_path, spark):
    """Docs too short to shingle (exact key only), empty or null texts (no keys), and a corpus of no docs at all: every
    doc is kept or removed once, each output folder exists, the counts add up."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipelines.spec import DedupCfg

    texts = ["", "   ", None, "Log in", "log in!", "Log in", "!!!", "two words"]
    for name, rows in (("some", texts), ("none", [])):
        src = tmp_path / name
        src.mkdir()
        pq.write_table(pa.table({"idx": pa.array(range(len(rows)), pa.int64()),
                                 "id": pa.array([f"d{i}" for i in range(len(rows))], pa.string()),
                                 "text": pa.array(rows, pa.string()),
                                 "source": pa.array(["t"] * len(rows), pa.string())}),
                       src / "part-00000.parquet")
        st = dedup.dedup_docs(spark, src, tmp_path / f"{name}-out", DedupCfg(), tasks=2)
        kept, removed = (_table(tmp_path / f"{name}-out" / k) for k in ("kept", "removed"))
        assert st["docs_in"] == len(rows) == len(kept) + len(removed) and st["no_shingles"] == len(rows)
        assert set(removed) == ({"d4", "d5"} if rows else set())  # "log in!" and "Log in" normalize as "log in"
        assert all(r["reason"] == "exact_duplicate" and r["dup_of_id"] == "d3" for r in removed.values())
        assert len(_table(tmp_path / f"{name}-out" / "clusters")) == len(rows)
        assert not (tmp_path / f"{name}-out" / "_work").exists()


def test_connected_components_on_a_long_chain_is_one_component(spark):
    rng = random.Random(3)
    chain = [(i, i + 1) for i in range(200)]          # 0-1-2-…-200
    chain += [(1000 + i, 1001 + i) for i in range(5)]  # a second component
    rng.shuffle(chain)
    edges = spark.createDataFrame([(max(a, b), min(a, b)) if rng.random() < .5 else (a, b) for a, b in chain],
                                  "src long, dst long")
    comps, rounds = connected_components(edges)
    got = {r["node"]: r["root"] for r in comps.collect()}
    assert {got[i] for i in range(201)} == {0}
    assert {got[i] for i in range(1000, 1006)} == {1000}
    assert len(got) == 207 and rounds < 30
    # the one-task path (small graphs) labels every node the same way
    one = {r["node"]: r["root"] for r in components_single_task(edges.repartition(3)).collect()}
    assert one == got


def test_cli_interface_preserves_ids(home, spark, corpus, capsys):
    recs, _ = corpus
    src = write_jsonl(home / "cli.jsonl", recs + [{"id": "bad", "text": ""}])
    out = home / "out"
    assert dedup.main(["--input", str(src), "--output", str(out), "--threshold", "0.7", "--num-perm", "64"]) == 0
    cl = _table(out / "clusters")
    assert set(cl) == {r["id"] for r in recs}  # the empty doc was quarantined, every other id is there
    kept = _table(out / "kept")
    assert "c4-0" in kept and "near-of-c4-0" not in kept
    assert "1 quarantined" in capsys.readouterr().out


def test_verification_rejects_lsh_candidates_below_the_threshold(home, spark, corpus):
    recs, _ = corpus
    base = recs[5]["text"]
    mid = _mutate(base, 0.08, 2)  # 5-gram Jaccard ≈ 0.5: a likely candidate for a permissive 32×4 LSH
    j = jaccard(shingles(base, 5), shingles(mid, 5))
    assert 0.3 < j < 0.75, j
    src = write_jsonl(home / "v.jsonl", [recs[5], {"id": "mid", "text": mid}] + recs[10:20])
    common = [f"data.inputs=[{src}]", "data.dedup.bands=32", "data.dedup.rows=4", "data.dedup.threshold=0.8",
              "data.dedup.keeper=min_idx"]  # (cover compares members exactly itself, whatever verify says)
    loose = load_spec(None, common + ["data.dedup.verify=false"], env={})
    strict = load_spec(None, common + ["data.dedup.verify=true"], env={})
    ing = ingest.run(loose, spark=spark)
    m_loose = dedup.run(loose, ing, out_dir=str(home / "loose"), spark=spark)
    m_strict = dedup.run(strict, ing, out_dir=str(home / "strict"), spark=spark)
    assert m_loose.counts["removed"] == 1  # LSH alone merges the J≈0.5 pair
    assert m_strict.counts["removed"] == 0 and m_strict.counts["rejected_edges"] >= 1
    assert m_strict.counts["verified_edges"] + m_strict.counts["rejected_edges"] == m_strict.counts["candidate_edges"]


def _idx(path) -> list[int]:
    return ds.dataset(str(path), format="parquet").to_table(columns=["idx"]).column("idx").to_pylist()


def test_nothing_lost_on_the_raw_common_crawl_sample(home, spark):
    """docs in = kept + removed (each with a reason) + quarantined, on raw multilingual WET text."""
    src = SHARED / "corpus" / "cc_wet_2019_30_sample.jsonl.gz"
    src = src if src.exists() else BUNDLED / "cc_wet_2019_30_sample.jsonl.gz"
    spec = load_spec(None, [f"data.inputs=[{src}]"], env={})
    ing = ingest.run(spec, spark=spark)
    dd = dedup.run(spec, ing, spark=spark)
    fl = filter_stage.run(spec, dd, spark=spark)
    lines = ing.counts["lines"]
    assert lines == 414 and ing.counts["quarantined"] > 0
    assert lines == fl.counts["kept"] + fl.counts["removed"] + dd.counts["removed"] + ing.counts["quarantined"]
    kept, f_rm, d_rm = _idx(fl.output("kept")), _idx(fl.output("removed")), _idx(dd.output("removed"))
    assert sorted(kept + f_rm + d_rm) == list(range(ing.counts["docs"]))  # each doc exactly once
    f_removed = ds.dataset(str(fl.output("removed")), format="parquet").to_table().to_pylist()
    assert all(r["filter_reason"] for r in f_removed)
    assert all(r["reason"] for r in ds.dataset(str(dd.output("removed")), format="parquet").to_table().to_pylist())
    assert sum(fl.counts["removed_by_reason"].values()) == fl.counts["removed"]
    assert fl.counts["removed_by_reason"]["language"] > 100 and len(fl.counts["languages"]) >= 10
    kept_rows = ds.dataset(str(fl.output("kept")), format="parquet").to_table().to_pylist()
    assert all(r["language"] == "en" and r["language_score"] >= 0.65 for r in kept_rows)


@pytest.fixture(scope="module")
def chain(corpus):
    """a ← b ← c: J(a,b) and J(b,c) above 0.8, J(a,c) below it; d: an LSH candidate of a (J 0.70) that verification
    rejects, so it is in the chain's candidate component but in no duplicate component; plus unrelated docs."""
    recs, _ = corpus
    a = recs[7]["text"]
    b = _mutate(a, 0.016, 11)  # J(a,b) 0.855, J(b,c) 0.856, J(a,c) 0.736
    c = _mutate(b, 0.016, 12)
    d = _mutate(a, 0.04, 13)
    sa, sb, sc, sd = (shingles(t, 5) for t in (a, b, c, d))
    assert jaccard(sa, sb) >= 0.82 and jaccard(sb, sc) >= 0.82 and jaccard(sa, sc) < 0.8
    assert 0.65 < jaccard(sa, sd) < 0.75 and max(jaccard(sb, sd), jaccard(sc, sd)) < 0.75
    docs = [{"id": k, "text": t} for k, t in zip("abcd", (a, b, c, d))] + recs[20:30]
    return docs, {"a": sa, "b": sb, "c": sc}


@pytest.mark.parametrize("keeper,cover_max,cc_one_task", [
    ("min_idx", 256, 10**6), ("cover", 256, 10**6), ("cover", 256, 0), ("cover", 2, 10**6), ("cover", 2, 0),
    ("longest", 256, 10**6), ("cover", 256, 50), ("cover", 2, 50)])
def test_keeper_policies_on_a_transitive_chain(home, spark, chain, keeper, cover_max, cc_one_task):
    """cover_max 2: the chain's component takes the distributed path (Spark verification, joins);
    cc_one_task 0: connected components by large-star/small-star rounds instead of one task; 50: more bucket entries
    than that (13 docs × 17 keys), so the edges come from the shuffle by bucket and are counted, then few enough for
    one task."""
    docs, sh = chain
    src = write_jsonl(home / "chain.jsonl", docs)
    spec = load_spec(None, [f"data.inputs=[{src}]", f"data.dedup.keeper={keeper}",
                            f"data.dedup.cover_max_cluster={cover_max}",
                            f"data.dedup.cc_single_task_max_edges={cc_one_task}"], env={})
    m = dedup.run(spec, ingest.run(spec, spark=spark), spark=spark)
    st = json.loads(m.output("stats").read_text())
    assert st["cc_mode"] == ("single_task" if cc_one_task else "large_star_small_star")
    assert st["largest_candidate_component"] == 4 and st["rejected_edges"] >= 2  # a–c and a–d
    cl, removed = _table(m.output("clusters")), _table(m.output("removed"))
    assert {cl[k]["component"] for k in "abc"} == {cl["a"]["idx"]} and cl["a"]["component_size"] == 3
    assert m.counts["kept"] + m.counts["removed"] == len(docs)
    assert "d" not in removed and cl["d"]["component_size"] == 1 and cl["d"]["cluster"] == cl["d"]["idx"]
    for r in removed.values():  # the reported Jaccard is the real one, to the doc named as dup_of
        assert r["jaccard"] == pytest.approx(jaccard(sh[r["id"]], sh[r["dup_of_id"]]), abs=0.01)
    if keeper == "min_idx":  # keeps a, removes c as a duplicate of a doc it is not similar to
        assert set(removed) == {"b", "c"} and removed["c"]["dup_of_id"] == "a" and removed["c"]["jaccard"] < 0.8
    elif keeper == "longest":
        longest = max("abc", key=lambda k: (len(docs["abc".index(k)]["text"]), -"abc".index(k)))
        assert longest not in removed and len(removed) == 2
        assert {r["dup_of_id"] for r in removed.values()} == {longest}
    elif cover_max > 3:  # all-pairs greedy cover: b covers a and c
        assert set(removed) == {"a", "c"} and all(r["dup_of_id"] == "b" for r in removed.values())
    else:  # component larger than cover_max: star centres kept; still every removal is covered
        assert 1 <= len(removed) <= 2 and all(r["jaccard"] >= 0.8 for r in removed.values())
    assert all(cl[r["id"]]["cluster"] == cl[r["dup_of_id"]]["idx"] for r in removed.values())


def test_the_filter_stage_drops_urls_by_rule_and_replaces_personal_data_in_kept_docs(home, spark):
    """The URL step (bundled list, a list named with --set, banned words, the allow list) and the PII step through
    the stage's CLI; the manifest's extra.url_filter and extra.pii, removed docs' reasons, kept docs' text."""
    import subprocess
    import sys

    from conftest import ROOT

    prose = [d["text"] for d in c4_docs(300) if len(d["text"].split()) > 200][:6]
    contact = (" Write to jane.doe@example.org or call +1 (415) 555-2671 from host 203.0.113.45; the office in "
               "Room 1204 opened on 2024-01-15 with version 1.2.3 at $1,299.99.")
    recs = [{"id": "bundled", "url": "https://www.pornhub.com/view/1", "text": prose[0]},
            {"id": "named-list", "url": "https://news.spam-farm.test/a", "text": prose[1]},
            {"id": "banned-word", "url": "https://videos.example.com/free-porn/2", "text": prose[2]},
            {"id": "allowed", "url": "https://xxx-archive.example.org/porn-laws", "text": prose[3]},
            {"id": "pii", "url": "https://example.com/contact", "text": prose[4] + contact},
            {"id": "no-url", "text": prose[5]}]
    src = write_jsonl(home / "urls.jsonl", recs)
    (home / "extra-list.txt").write_text("# a team's own list\nspam-farm.test\n")
    sets = [f"data.inputs=[{src}]", "data.filters.steps=[url,language]", "data.filters.url.allow=[xxx-archive.example.org]"]
    spec = load_spec(None, sets, env={})
    dd = dedup.run(spec, ingest.run(spec, spark=spark), spark=spark)
    env = {**__import__("os").environ, "LLMP_HOME": str(home)}
    r = subprocess.run([sys.executable, "-m", "pipelines.data.filter", "--dedup-manifest", dd.path,
                        "--set", "services.spark_master=local[1]", *sum((["--set", s] for s in sets[1:]), []),
                        "--set", f"data.filters.url_blocklist={home / 'extra-list.txt'}"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    from pipelines.manifest import load_manifest

    m = load_manifest(re.search(r"manifest (\S+)", r.stdout).group(1))
    assert m.extra["url_filter"] == {"banned_word": 1, "blocklist": 2, "allowed": 1}
    removed = _table(m.output("removed"))
    assert {i: r["filter_reason"] for i, r in removed.items()} == \
        {"bundled": "url:blocklist", "named-list": "url:blocklist", "banned-word": "url:banned_word"}
    kept = _table(m.output("kept"))
    assert set(kept) == {"allowed", "pii", "no-url"} and kept["pii"]["url"] == "https://example.com/contact"
    text = kept["pii"]["text"]
    assert "jane.doe" not in text and "555-2671" not in text and "203.0.113.45" not in text
    assert "email@example.com" in text and "Room 1204 opened on 2024-01-15 with version 1.2.3 at $1,299.99." in text
    assert m.extra["pii"] == {"mode": "replace", "email": 1, "ipv4": 1, "ipv6": 0, "phone": 1, "docs": 1}
    assert m.metrics["pii"]["email"] == 1


def test_dedup_tasks_killed_after_writing_leave_every_doc_once(home, corpus):
    """The first attempt of a task of each output pass writes its files, then its worker dies (os._exit): the
    retries' files are published and the dead attempts' never are. Every doc is in kept/ or removed/ once, clusters/
    has every doc, and each part file is sorted by idx."""
    import os
    import subprocess
    import sys

    import pyarrow.parquet as pq

    from conftest import ROOT
    from pipelines.manifest import load_manifest

    recs, _ = corpus
    src = write_jsonl(home / "kill.jsonl", recs)
    out = home / "out"
    env = {**os.environ, "LLMP_HOME": str(home), "LLMP_FAIL_TASK": "dedup-signatures:0,dedup-docs:0"}
    r = subprocess.run([sys.executable, "-m", "pipelines.data.dedup", "--input", str(src), "--output", str(out),
                        "--set", "services.spark_master=local[2,4]"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lost = set(re.findall(r"Lost task 0\.0 in stage (\d+)\.", r.stderr))
    assert len(lost) == 2, r.stderr[-3000:]  # each pass's first attempt was killed
    m = load_manifest(out)
    kept, removed, cl = (_table(m.output(k)) for k in ("kept", "removed", "clusters"))
    assert sorted([*kept, *removed]) == sorted(x["id"] for x in recs) and set(cl) == set(kept) | set(removed)
    assert set(removed) == {"near-of-c4-0", "exact-of-c4-1", "short-b"}
    for k in ("kept", "removed", "clusters"):
        for f in m.output(k).iterdir():
            i = pq.read_table(f, columns=["idx"]).column(0).to_pylist()
            assert i == sorted(i), f
    assert not any(p.name.startswith("_") for p in m.dir.iterdir())  # no attempt directory left behind
