"""URL filtering, the first step of the filter stage (reason ``url:<rule>``), as FineWeb, RefinedWeb and DataTrove do:

* ``blocklist``: the doc's host, or a domain it is under, is on a block list: the bundled one
  (``pipelines/data/lists/url_blocklist.txt``) and every file ``data.filters.url_blocklist`` names, in UT1's format
  (one domain per line; ``#`` comments; a line ``example.com`` blocks ``example.com`` and ``*.example.com``);
* ``banned_word``: a word of the URL (host, path and query, %-escapes decoded, split at every non-letter) is on
  ``data.filters.url.banned_words`` (by default the bundled ``url_banned_words.txt``);
* ``data.filters.url.allow``: domains that win over both (counted as ``allowed``).

Docs without a URL (JSONL without ``url``) pass. The lists are read once, on the driver, and shipped to the tasks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from urllib.parse import unquote_plus, urlsplit

LISTS = Path(__file__).resolve().parent / "lists"
_WORD = re.compile(r"[a-z]+")


def read_list(path: Path) -> set[str]:
    """A list file: one entry per line, lower-cased; blank lines and ``#`` comments skipped."""
    out = set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            entry = line.split("#", 1)[0].strip().lower().lstrip(".")
            if entry:
                out.add(entry)
    return out


def decoded(text: str) -> str:
    """``text`` with its %-escapes (and ``+``) decoded, again while that changes it (``%2570`` is ``%70`` is
    ``p``), at most three times: a banned word or a blocked host hidden under escapes is still found."""
    for _ in range(3):
        new = unquote_plus(text)
        if new == text:
            break
        text = new
    return text


def host_of(url: Optional[str]) -> Optional[str]:
    try:
        host = urlsplit(url.strip()).hostname if url else None
    except ValueError:
        return None
    if not host:
        return None
    plain = decoded(host).strip().rstrip(".").lower()
    return plain or host.rstrip(".")  # a host that decodes to nothing is checked as written


def _under(host: str, domains: frozenset[str]) -> bool:
    parts = host.split(".")
    return any(".".join(parts[i:]) in domains for i in range(len(parts)))


@dataclass(frozen=True)
class UrlRules:
    enabled: bool
    blocked: frozenset[str]
    banned_words: frozenset[str]
    allowed: frozenset[str]

    def check(self, url: Optional[str]) -> tuple[Optional[str], bool]:
        """(``url:<rule>`` or None, whether the allow list kept a URL a rule would remove)."""
        host = host_of(url)
        if not self.enabled or host is None:
            return None, False
        rule = None
        if _under(host, self.blocked):
            rule = "url:blocklist"
        else:
            split = urlsplit(url.strip())
            words = _WORD.findall(decoded(f"{host} {split.path} {split.query}").lower())
            if any(w in self.banned_words for w in words):
                rule = "url:banned_word"
        if rule and _under(host, self.allowed):
            return None, True
        return rule, False


def block_lists(cfg) -> list[Path]:
    """The block list files the URL step reads (the bundled one unless turned off, then ``url_blocklist``'s); a named
    file that is missing is the spec's error, with its key."""
    from pipelines.spec import SpecError, resolve_path

    files = [LISTS / "url_blocklist.txt"] if cfg.url.bundled_blocklist else []
    for f in cfg.url_blocklist:
        p = resolve_path(f)
        if not p.is_file():
            raise SpecError(f"data.filters.url_blocklist: {p} is not a file (one domain per line, UT1's format)")
        files.append(p)
    return files


def list_files(cfg) -> list[Path]:
    """Every list file the URL step reads (inputs of the filter stage: a changed list is a changed input)."""
    if "url" not in cfg.steps or not cfg.url.enabled:
        return []
    return block_lists(cfg) + ([LISTS / "url_banned_words.txt"] if cfg.url.banned_words is None else [])


def load_rules(cfg) -> UrlRules:
    """The rules of ``data.filters`` (``cfg``): block lists, banned words, allow list (none read when the step is
    off)."""
    ucfg = cfg.url
    if "url" not in cfg.steps or not ucfg.enabled:
        return UrlRules(False, frozenset(), frozenset(), frozenset())
    blocked: set[str] = set()
    for p in block_lists(cfg):
        blocked |= read_list(p)
    words = set(ucfg.banned_words) if ucfg.banned_words is not None else read_list(LISTS / "url_banned_words.txt")
    return UrlRules(True, frozenset(blocked), frozenset(w.lower() for w in words),
                    frozenset(d.lower().lstrip(".") for d in ucfg.allow))
