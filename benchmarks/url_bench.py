"""The URL step (pipelines/data/urlfilter.py) against its anchors, in one run:

* **Precision / recall** on the labelled hard cases (``data/urls/labelled.jsonl``, built and documented by
  ``data/urls/make_labelled.py``): should-block vs should-pass under the lists in ``data/urls/lists/`` (UT1
  ``domains`` and ``urls`` lines, a hosts file), no banned words, for
  - ``ours``: :func:`pipelines.data.urlfilter.load_rules` (WHATWG host parsing with ada-url, the list formats);
  - ``urllib``: the step as it was before (``urllib.parse`` host, %-decoded and lower-cased; a list line is one
    lower-cased domain, so hosts-file, ``*.`` and ``host/path`` lines are kept as they are and never match);
  - ``datatrove``: DataTrove's ``URLFilter`` (if installed: ``make bench`` installs it; it also needs tldextract,
    pyahocorasick and fasteners) given the domain and hosts lines as its domains and the urls lines as its URLs,
    with its own lists and words off and tldextract's bundled suffix list (no download).
* **checks/s** on the bundled samples' URLs, C4's (with a scheme) and the Common Crawl WET sample's (without: the
  urllib code finds no host in them and checks nothing), with the default rules (the bundled block list and banned
  words), best of ``--repeat`` passes (the filters taking turns), one core.

    python benchmarks/url_bench.py [--repeat 20] [--show]   → var/bench/url.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.data.urlfilter import LISTS, decoded, load_rules, read_list  # noqa: E402
from pipelines.spec import FilterCfg  # noqa: E402

DATA = ROOT / "data" / "urls"
LIST_FILES = [DATA / "lists" / f"{n}.txt" for n in ("domains", "urls", "hosts")]
_WORD = re.compile(r"[a-z]+")
Check = Callable[[str], Optional[str]]


def cases() -> list[dict]:
    with open(DATA / "labelled.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def score(check: Check, labelled: list[dict]) -> dict:
    """tp/fp/fn/tn, precision and recall of ``check`` (a reason or None per URL) on the labelled cases; ``wrong``:
    the cases it gets wrong."""
    got = [check(c["url"]) is not None for c in labelled]
    tp = sum(g and c["block"] for g, c in zip(got, labelled))
    fp = sum(g and not c["block"] for g, c in zip(got, labelled))
    fn = sum(c["block"] and not g for g, c in zip(got, labelled))
    return {"tp": tp, "fp": fp, "fn": fn, "tn": len(labelled) - tp - fp - fn,
            "precision": tp / (tp + fp) if tp + fp else 1.0, "recall": tp / (tp + fn) if tp + fn else 1.0,
            "wrong": [c for g, c in zip(got, labelled) if g != c["block"]]}


def ours(files: list[Path], banned_words: Optional[list[str]] = None, bundled: bool = False) -> Check:
    cfg = FilterCfg.model_validate({"url_blocklist": [str(p) for p in files],
                                    "url": {"bundled_blocklist": bundled, "banned_words": banned_words}})
    rules = load_rules(cfg)
    return lambda url: rules.check(url)[0]


def urllib_baseline(files: list[Path], banned_words: frozenset[str]) -> Check:
    """The URL step before WHATWG parsing (this repository before issue 46): urllib's host, lists of domains."""
    blocked = frozenset().union(*(read_list(p) for p in files))

    def host_of(url: str) -> Optional[str]:
        try:
            host = urlsplit(url.strip()).hostname if url else None
        except ValueError:
            return None
        if not host:
            return None
        return decoded(host).strip().rstrip(".").lower() or host.rstrip(".")

    def check(url: str) -> Optional[str]:
        host = host_of(url)
        if host is None:
            return None
        parts = host.split(".")
        if any(".".join(parts[i:]) in blocked for i in range(len(parts))):
            return "url:blocklist"
        split = urlsplit(url.strip())
        words = _WORD.findall(decoded(f"{host} {split.path} {split.query}").lower())
        return "url:banned_word" if any(w in banned_words for w in words) else None
    return check


def datatrove_filter(files: list[Path], banned_words: list[str]) -> Optional[Check]:
    try:
        from datatrove.data import Document
        from datatrove.pipeline.filters import URLFilter
        from tldextract import TLDExtract
    except ImportError:
        return None
    domains = [ln for p in files if p.name != "urls.txt" for ln in p.read_text(encoding="utf-8").splitlines()]
    urls = [ln for p in files if p.name == "urls.txt" for ln in p.read_text(encoding="utf-8").splitlines()]
    f = URLFilter(extra_domains=[d for d in domains if d.strip()] or None, extra_urls=[u for u in urls if u.strip()]
                  or None, banned_words=banned_words or None, use_integrated_lists=False)
    f.tldextractor = TLDExtract(suffix_list_urls=())  # the suffix list bundled with tldextract: no download

    def check(url: str) -> Optional[str]:
        res = f.filter(Document(text="", id="x", metadata={"url": url}))
        return None if res is True else f"datatrove:{res[1]}"
    return check


def sample_urls() -> dict[str, list[str]]:
    """The bundled samples' URLs: C4's (each with a scheme) and the Common Crawl WET sample's (none has one)."""
    out = {}
    for key, name in (("c4", "c4_en_train_1k.jsonl.gz"), ("wet", "cc_wet_2019_30_sample.jsonl.gz")):
        with gzip.open(ROOT / "data" / "sample" / name, "rt", encoding="utf-8") as f:
            docs = [json.loads(line) for line in f]
        out[key] = [u for u in (d.get("url") or d.get("metadata", {}).get("url") for d in docs) if u]
    return out


def checks_per_s(checks: dict[str, Check], urls: list[str], repeat: int) -> dict[str, float]:
    """Each check's best pass over ``urls`` of ``repeat``, the checks taking turns (a load that comes and goes
    weighs on each alike)."""
    best = dict.fromkeys(checks, float("inf"))
    for _ in range(repeat):
        for name, check in checks.items():
            t = time.perf_counter()
            for u in urls:
                check(u)
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: len(urls) / s for name, s in best.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--show", action="store_true", help="print each filter's wrong cases")
    args = ap.parse_args(argv)
    labelled = cases()
    bundled_lists, words = [LISTS / "url_blocklist.txt"], read_list(LISTS / "url_banned_words.txt")
    filters = {"ours": (ours(LIST_FILES, []), ours([], None, bundled=True)),
               "urllib": (urllib_baseline(LIST_FILES, frozenset()), urllib_baseline(bundled_lists, frozenset(words))),
               "datatrove": (datatrove_filter(LIST_FILES, []), datatrove_filter(bundled_lists, sorted(words)))}
    samples = sample_urls()
    checks = {n: d for n, (_, d) in filters.items() if d is not None}
    speed = {k: checks_per_s(checks, urls, args.repeat) for k, urls in samples.items()}
    res = {"cases": len(labelled), "to_block": sum(c["block"] for c in labelled),
           "sample_urls": {k: len(v) for k, v in samples.items()}}
    print(f"{len(labelled)} labelled cases ({res['to_block']} to block); checks/s over the sample URLs: "
          f"{len(samples['c4'])} of C4 (with a scheme), {len(samples['wet'])} of CC WET (without)\n")
    print("| filter | precision | recall | tp | fp | fn | tn | checks/s C4 | checks/s WET |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for name, (labelled_check, _) in filters.items():
        if labelled_check is None:
            print(f"| {name} | not installed | | | | | | | |")
            continue
        res[name] = s = {**score(labelled_check, labelled), "checks_per_s": {k: v[name] for k, v in speed.items()}}
        print(f"| {name} | {s['precision']:.3f} | {s['recall']:.3f} | {s['tp']} | {s['fp']} | {s['fn']} | {s['tn']} "
              f"| {speed['c4'][name]:,.0f} | {speed['wet'][name]:,.0f} |")
    if args.show:
        for name in filters:
            for c in res.get(name, {}).get("wrong", []):
                print(f"{name}: {'missed' if c['block'] else 'blocked'} {c['url']!r} ({c['form']})")
    out = ROOT / "var" / "bench" / "url.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
