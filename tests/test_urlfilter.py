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
