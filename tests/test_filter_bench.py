"""The filter benchmark's corpus and its agreement count (benchmarks/filter_bench.py), on cases with known answers."""
import importlib.util
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT
from pipelines.data.urlfilter import load_rules
from pipelines.spec import load_spec


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("filter_bench", ROOT / "benchmarks" / "filter_bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["filter_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_generated_urls_meet_our_rules_as_made(bench, tmp_path):
    """One doc in 61 on a listed domain (itself, www., a deeper host), one in 89 with a banned word: our URL step
    removes exactly those, with the reason each was made for; the rest keep their own URL."""
    blocked = bench.generated_blocklist(tmp_path / "list.txt", n=500)
    assert len(set(blocked)) == 500 and (tmp_path / "list.txt").read_text().count("\n") == 500
    cfg = load_spec(None, [f"data.filters.url_blocklist={tmp_path / 'list.txt'}"], env={}).data.filters
    rules = load_rules(cfg)
    make = bench.url_maker(blocked, sorted(bench._banned()))
    for n in range(1, 2000):
        url = make(n, n % 3, "https://news.example.com/a?b=1")
        reason, _ = rules.check(url)
        want = "url:blocklist" if n % 61 == 0 else "url:banned_word" if n % 89 == 0 else None
        assert reason == want, (n, url)
        if want is None:
            assert url.startswith("https://news.example.com/a?b=1") and (n % 3 == 0) == url.endswith("b=1")


def test_agreement_counts_each_step_and_the_kept_sets(bench, tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "dt"
    for d in (ours / "kept", ours / "removed", theirs / "kept", theirs / "removed" / "url",
              theirs / "removed" / "c4"):
        d.mkdir(parents=True)
    pq.write_table(pa.table({"id": ["k1", "k2", "k3"]}), ours / "kept" / "p.parquet")
    pq.write_table(pa.table({"id": ["u1", "u2", "c1", "g1"],
                             "filter_reason": ["url:blocklist", "url:banned_word", "c4.curly_bracket",
                                               "gopher_quality.word_count"]}), ours / "removed" / "p.parquet")
    pq.write_table(pa.table({"id": ["k1", "k2", "g1"]}), theirs / "kept" / "0.parquet")
    pq.write_table(pa.table({"id": ["u1"]}), theirs / "removed" / "url" / "0.parquet")
    pq.write_table(pa.table({"id": ["c1", "k3", "u2"]}), theirs / "removed" / "c4" / "0.parquet")
    a = bench.agreement(ours, theirs)
    assert a["url"] == {"ours": 2, "datatrove": 1, "both": 1, "either": 2}
    assert a["c4"] == {"ours": 1, "datatrove": 3, "both": 1, "either": 3}
    assert a["gopher_quality"] == {"ours": 1, "datatrove": 0, "both": 0, "either": 1}  # no folder: removed nothing
    assert a["fineweb"] == {"ours": 0, "datatrove": 0, "both": 0, "either": 0}
    assert a["kept"] == {"ours": 3, "datatrove": 3, "both": 2, "either": 4}
