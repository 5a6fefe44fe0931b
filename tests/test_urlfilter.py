"""The URL step's rules (pipelines.data.urlfilter): hosts read as a browser reads them (WHATWG, ada-url), the block
list formats it accepts and the lines it refuses, and its precision and recall on the labelled hard cases
(data/urls/labelled.jsonl; benchmarks/url_bench.py prints them beside the anchors)."""
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.data import urlfilter
from pipelines.data.urlfilter import host_name, host_of, load_rules, url_parts
from pipelines.spec import FilterCfg, SpecError

ROOT = Path(__file__).resolve().parents[1]


def rules_from(tmp_path: Path, text: str, **url):
    f = tmp_path / "list.txt"
    f.write_text(text, encoding="utf-8")
    return load_rules(FilterCfg.model_validate({"url_blocklist": [str(f)], "url": {
        "bundled_blocklist": False, "banned_words": [], **url}}))


LIST = """# every accepted form
blocked.test.
*.wild.test
0.0.0.0 hosts.test other.test  # a hosts-file line
bücher.test
xn--mnchen-3ya.test
site.test/path
"""
BLOCKED = ["www.blocked.test/page", "blocked.test", "http://blocked.test./", "HTTP://BLOCKED.TEST:80/x",
           "http:\\\\blocked.test\\x", "http://blocked.test\\@evil.test/", "http://blocked\u3002test/",
           "http://\uff42\uff4c\uff4f\uff43\uff4b\uff45\uff44.test/", "http://blocked%2Etest/", "//blocked.test/",
           "http://xn--bcher-kva.test/", "http://BÜCHER.test/", "bücher.test/x", "http://münchen.test/",
           "http://a.wild.test/", "http://hosts.test/", "https://www.other.test/", "http://site.test/path",
           "http://www.site.test/path/page", "http://site.test/%70ath?x=1", "http://site.test\\path"]
PASSED = ["http://notblocked.test/", "http://blocked.test.evil.test/", "http://evil.test/blocked.test",
          "http://evil.test\\@blocked.test/", "http://blocked.test%2F@evil.test/", "http://wild.test/",
          "http://site.test/pathology", "http://site.test/", "http://sub.site.test/path", "http://0.0.0.0/",
          "mailto:a@blocked.test", None, "", "not a url"]


@pytest.mark.parametrize("url", BLOCKED)
def test_every_list_form_blocks_the_urls_a_browser_reads_as_its_hosts(tmp_path, url):
    assert rules_from(tmp_path, LIST).check(url) == ("url:blocklist", False), url


@pytest.mark.parametrize("url", PASSED)
def test_look_alikes_and_hostless_urls_pass(tmp_path, url):
    assert rules_from(tmp_path, LIST).check(url) == (None, False), url


REFUSED = [("||ads.test^", "adblock"), ("ads.test:8080", "port"), ("http://ads.test/x", "URL with a scheme"),
           ("ads.test extra", "not a hosts-file line"), ("a*.test", "wildcard"), ("*.a*.test", "wildcard"),
           ("ads.test$third-party", "adblock filter options"), ("a..test", "not a host name"),
           ("[::1]", "port or an IPv6"), ("0.0.0.0 bad^name", "adblock"), ("user@ads.test", "user info"),
           ("bad\ufffdname.test", "not a host name"), ("@@||ok.test^", "adblock")]


@pytest.mark.parametrize("line,why", REFUSED)
def test_a_line_in_no_accepted_form_is_refused_with_its_file_and_line(tmp_path, line, why):
    with pytest.raises(SpecError) as e:
        rules_from(tmp_path, f"# a list\nok.test\n{line}\n")
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'list.txt'}:3: ") and why in msg and "\n" not in msg, msg


def test_a_refused_line_stops_the_filter_stage_with_exit_2_and_one_line(tmp_path):
    dedup = tmp_path / "dedup"
    dedup.mkdir()
    (dedup / "manifest.json").write_text(json.dumps({"stage": "dedup", "config_hash": "x", "outputs": [
        {"name": "kept", "path": "kept", "sha256": "0" * 64}]}))
    (tmp_path / "bad.txt").write_text("ok.test\n||ads.test^\n")
    r = subprocess.run([sys.executable, "-m", "pipelines.data.filter", "--dedup-manifest", str(dedup / "manifest.json"),
                        "--set", f"data.filters.url_blocklist={tmp_path / 'bad.txt'}"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "LLMP_HOME": str(tmp_path)})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"filter: error: {tmp_path / 'bad.txt'}:2: adblock filter syntax: '||ads.test^'"], r.stderr


def test_hosts_are_read_as_a_browser_reads_them():
    assert url_parts("www.example.test/a/../b?q=1#f") == ("www.example.test", "/b", "q=1")
    assert url_parts("http://user:pw@[2001:db8::1]:8080/x") == ("[2001:db8::1]", "/x", "")
    assert url_parts("https://0x7f.1/") == ("127.0.0.1", "/", "")
    assert url_parts("example.test:8080/x") == ("example.test", "/x", "")  # host:port, not a scheme
    assert url_parts("mailto:a@example.test") is None and url_parts("javascript:alert(1)") is None
    assert host_of("https://") is None and host_of("http://[::1") is None and host_of(None) is None
    assert host_of("http://a.test:99999/") == "a.test"  # refused by the standard: read as urllib reads it
    assert host_name("Bücher.Test.") == host_name("xn--bcher-kva.test") == "xn--bcher-kva.test"
    assert host_name("straße.test") == "xn--strae-oqa.test"  # UTS #46 non-transitional: ß is kept, not ss


def test_the_fast_path_gives_what_the_parser_gives(monkeypatch):
    rng = random.Random(0)
    texts = ["".join(rng.choice("ab0-_.") for _ in range(rng.randint(1, 10))) for _ in range(3000)]
    texts += ["a.b.", "a.0x1", "a.1", "xn--bcher-kva.test", "xn--a.test", "0.0.0.0", "a-.test", "_x.test"]
    fast = [host_name(t) for t in texts]
    monkeypatch.setattr(urlfilter, "_AS_IS", re.compile(r"(?!)"))  # every host through ada-url
    assert fast == [host_name(t) for t in texts]


def test_the_allow_list_is_read_as_hosts_too(tmp_path):
    rules = rules_from(tmp_path, "blocked.test\n", allow=["Bücher.blocked.test."])
    assert rules.check("http://xn--bcher-kva.blocked.test/") == (None, True)
    assert rules.check("http://blocked.test/") == ("url:blocklist", False)
    with pytest.raises(SpecError, match="data.filters.url.allow: '||x' is not a host name"):
        rules_from(tmp_path, "blocked.test\n", allow=["||x"])


def test_the_bundled_list_is_in_an_accepted_form():
    assert load_rules(FilterCfg()).blocked >= {"pornhub.com", "xvideos.com"}


def test_precision_and_recall_on_the_labelled_hard_cases():
    spec = importlib.util.spec_from_file_location("url_bench", ROOT / "benchmarks" / "url_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cases = bench.cases()
    assert len(cases) >= 100 and sum(c["block"] for c in cases) >= 50
    s = bench.score(bench.ours(bench.LIST_FILES, []), cases)
    assert s["precision"] >= 0.97 and s["recall"] >= 0.95, s["wrong"]


class CountingSet(frozenset):
    """A frozenset that counts the lookups made in it."""
    lookups = 0

    def __contains__(self, item):
        CountingSet.lookups += 1
        return super().__contains__(item)


def test_a_host_of_any_length_costs_as_many_lookups_as_the_longest_domain_has_labels(monkeypatch):
    monkeypatch.setattr(CountingSet, "lookups", 0)
    rules = urlfilter.UrlRules(True, CountingSet({"blocked.test", "a.b.c.test"}), frozenset(),
                               CountingSet({"ok.blocked.test"}), CountingSet({"wild.test"}))
    assert rules.depth == (4, 2, 3, 0)
    many = "a." * 50_000
    for host, want in ((many + "test", (None, False)), (many + "blocked.test", ("url:blocklist", False)),
                       (many + "ok.blocked.test", (None, True)), ("a" * 100_000 + ".wild.test", ("url:blocklist", False))):
        CountingSet.lookups = 0
        assert rules.check(f"http://{host}/") == want, host[-30:]
        assert CountingSet.lookups <= 4 + 2 + 3, (host[-30:], CountingSet.lookups)


def test_a_path_of_any_length_gives_no_more_keys_than_the_longest_line_has_segments(tmp_path, monkeypatch):
    rules = rules_from(tmp_path, "site.test/a/b\nsite.test/x?q=1\n")
    assert rules.depth[3] == 3  # "site.test/a/b": "", "a", "b"
    sizes = []
    real = urlfilter.path_keys
    monkeypatch.setattr(urlfilter, "path_keys", lambda *a: sizes.append(len(real(*a))) or real(*a))
    assert rules.check("http://site.test" + "/a" * 20_000) == (None, False)
    assert rules.check("http://site.test/a/b" + "/c" * 20_000) == ("url:blocklist", False)
    assert rules.check("http://site.test/x?q=1") == ("url:blocklist", False)
    assert sizes == [3, 3, 3]  # "site.test", "site.test/x", then with the query


def test_lookups_bounded_by_the_lists_find_what_every_suffix_and_prefix_would():
    """Against the rules' plain meaning, on random hosts, lists and paths: a domain line blocks a host equal to it or
    ending in '.' + it; a `*.` line only the latter; a path line, a path that is it or under it."""
    rng = random.Random(46)
    labels = ["a", "b", "ab", "test"]
    for _ in range(300):
        doms = {".".join(rng.choices(labels, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 6))}
        wild = {".".join(rng.choices(labels, k=rng.randint(1, 3))) for _ in range(2)}
        host = ".".join(rng.choices(labels, k=rng.randint(1, 9)))
        rules = urlfilter.UrlRules(True, frozenset(doms), frozenset(), frozenset(), frozenset(wild))
        want = any(host == d or host.endswith("." + d) for d in doms) or any(host.endswith("." + w) for w in wild)
        assert rules.check(f"http://{host}/")[0] == ("url:blocklist" if want else None), (host, doms, wild)
        path = "".join("/" + "".join(rng.choices("ab", k=rng.randint(0, 2))) for _ in range(rng.randint(0, 8)))
        lines = {"s.test" + "".join("/" + rng.choice("ab") for _ in range(rng.randint(0, 4))) for _ in range(3)}
        rules = urlfilter.UrlRules(True, frozenset(), frozenset(), frozenset(), paths=frozenset(lines))
        p = path.rstrip("/")
        want = any(p == k[6:] or p.startswith(k[6:] + "/") for k in lines)
        assert rules.check(f"http://s.test{path}")[0] == ("url:blocklist" if want else None), (path, lines)
