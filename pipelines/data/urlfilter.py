"""URL filtering, the first step of the filter stage (reason ``url:<rule>``), as FineWeb, RefinedWeb and DataTrove do:

* ``blocklist``: the doc's URL is on a block list: the bundled one (``pipelines/data/lists/url_blocklist.txt``) and
  every file ``data.filters.url_blocklist`` names. A list's lines, each in one of these forms (``#`` comments):

  - ``example.com``: a domain, as in UT1's ``domains`` files: blocks it and every host under it (``.example.com`` and
    ``example.com.`` are the same line);
  - ``*.example.com``: every host under the domain, not the domain itself;
  - ``0.0.0.0 example.com [more.example …]``: a hosts-file line (any IP address first): each name as a domain line;
  - ``example.com/some/path``: as in UT1's ``urls`` files (squidGuard's urllist): URLs of that host, or of it after a
    leading ``www.`` / ``web.`` / ``ftp.`` label (a digit may follow: ``www2.``), whose path is that path or under it
    (``/some/path/page``, not ``/some/pathology``), compared %-decoded and lower-cased; with ``?query``: that query;

  any other line (adblock's ``||example.com^``, ``host:port``, a URL with a scheme, a wildcard elsewhere, a name no
  host has) is refused: ``<file>:<line>: <why>``, the spec's error.
* ``banned_word``: a word of the URL (host, path and query, %-escapes decoded, split at every non-letter) is on
  ``data.filters.url.banned_words`` (by default the bundled ``url_banned_words.txt``);
* ``data.filters.url.allow``: domains that win over both (counted as ``allowed``).

Hosts, of URLs and of list lines alike, are read as a browser reads them: the WHATWG URL standard's host parser
(``ada-url``, the parser Node.js uses): %-escapes decoded, UTS #46 mapping (fullwidth letters, ``。`` and the other
dots, case), IDN to punycode (``bücher.test`` is ``xn--bcher-kva.test``), IPv4 in any form (``0x7f.1`` is
``127.0.0.1``), then the trailing dot dropped. A URL without a scheme (``www.example.com/page``) is read with
``http://`` in front; one the parser refuses (no browser would open it) is read as :mod:`urllib.parse` reads it.
Docs without a URL (JSONL without ``url``) pass. The lists are read once, on the driver, and shipped to the tasks.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import unquote_plus, urlsplit

from ada_url import normalize_url, parse_url

from pipelines.spec import SpecError, resolve_path

LISTS = Path(__file__).resolve().parent / "lists"
_WORD = re.compile(r"[a-z]+")
_SCHEME = re.compile(r"[a-zA-Z][a-zA-Z0-9+-]*:(?!\d)")  # no dot and no port: `example.com:8080/a` has no scheme
# a host the WHATWG parser returns unchanged (its ASCII fast path: lower-case letters, digits, '-', '_'; no punycode
# label; the last label not a number, which would make it an IPv4 address)
_AS_IS = re.compile(r"(?:[a-z0-9_-]+\.)*[a-z][a-z0-9_-]*\.?")
_HOST = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")  # what a list's host is once parsed: DNS labels, or IPv4
# a URL as the standard writes it out (its serializer): scheme, then "//" and the authority iff it has a host;
# user info is %-encoded there (no '@', '/', '?', '#' in it), a host has no ':' but in an IPv6 literal's brackets
_HREF = re.compile(r"[^:]*://([^/?#]*)([^?#]*)(?:\?([^#]*))?")
_SITE = re.compile(r"(?:www|web|ftp)\d*\.(?=[^.]+\.)")  # the label squidGuard drops before a urllist lookup
_REFUSED = (("||", "adblock filter syntax"), ("^", "adblock filter syntax"), ("$", "adblock filter options"),
            (":", "a port or an IPv6 address (a list takes host names)"), ("@", "user info"),
            ("*", "a wildcard other than a leading '*.'"))


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


def _as_is(text: str) -> bool:
    return _AS_IS.fullmatch(text) is not None and "xn--" not in text


def host_name(text: str) -> Optional[str]:
    """``text`` (a host as a list or a spec writes it) as a browser reads it: lower-case ASCII (punycode for an IDN,
    IPv4 in dotted decimal), without its trailing dot; None when it is not a host name (see ``_REFUSED``)."""
    if _as_is(text):
        return text.rstrip(".")
    if any(c in text for c in ":/?#@\\[] \t"):
        return None
    try:
        host = parse_url(f"http://{text}/", attributes=("hostname",))["hostname"]
    except ValueError:
        return None
    host = host[:-1] if host.endswith(".") else host
    return host if _HOST.fullmatch(host) else None


def _urllib_parts(url: str) -> Optional[tuple[str, str, str]]:
    """(host, path, query) of a URL the WHATWG parser refuses, as urllib reads it (its host %-decoded)."""
    try:
        split = urlsplit(url)
        host = split.hostname
    except ValueError:
        return None
    if not host:
        return None
    plain = decoded(host).strip().rstrip(".").lower()
    return (host_name(plain) or plain or host.rstrip(".")), split.path, split.query


def url_parts(url: Optional[str]) -> Optional[tuple[str, str, str]]:
    """(host, path, query) of ``url`` as a browser reads it (WHATWG URL parsing; ``http://`` in front of a URL
    without a scheme): the host as the standard gives it (lower case, punycode, IPv4 in dotted decimal) without its
    trailing dot, the path and query %-encoded as the standard leaves them. None when there is no URL or it has no
    host (``mailto:``, ``javascript:``)."""
    if not isinstance(url, str) or not url.strip():
        return None
    url = url.strip()
    if not _SCHEME.match(url):
        url = f"http://{url}"
    try:
        href = normalize_url(url)
    except ValueError:
        return _urllib_parts(url)
    m = _HREF.match(href)
    if m is None:
        return None
    authority, path, query = m.groups()
    host = authority.rpartition("@")[2]
    host = host[:host.index("]") + 1] if host.startswith("[") else host.partition(":")[0]
    return (host.rstrip(".") or host, path, query or "") if host else None


def host_of(url: Optional[str]) -> Optional[str]:
    parts = url_parts(url)
    return parts[0] if parts else None


def _under(host: str, domains: frozenset[str], most_labels: int, start: int = 0) -> bool:
    """``host``, or a domain it is under, is in ``domains``, whose entries have at most ``most_labels`` labels
    (``start=1``: only the domains it is under). Only the host's last ``most_labels`` labels are looked up, found
    from the right: the WHATWG parser takes a host of any length (``'a.' * 50_000``), and a domain of k labels is
    only ever the host's last k."""
    cut = len(host)
    for _ in range(most_labels):
        cut = host.rfind(".", 0, cut)
        if cut < 0:  # no more dots: the host itself is left
            return not start and host in domains
        if host[cut + 1:] in domains:
            return True
    return False


def _most_parts(entries: frozenset[str], sep: str) -> int:
    """The most parts (split at ``sep``) of any of ``entries``, 0 when there are none: a domain's labels, a path
    line's segments."""
    return max((e.count(sep) + 1 for e in entries), default=0)


def _site_path(host: str, path: str) -> tuple[str, str]:
    """The host without a leading ``www.`` label (as squidGuard drops it) and the path %-decoded, lower-cased,
    without trailing slashes."""
    m = _SITE.match(host)
    return (host[m.end():] if m else host), decoded(path).lower().rstrip("/")


def _with_query(key: str, query: str) -> str:
    return f"{key}?{decoded(query).lower()}"


def path_key(host: str, path: str, query: str) -> str:
    """A UT1 ``urls`` line's key (of the line read as a URL): its host without a leading ``www.`` label, then its
    path and query, %-decoded, lower-cased."""
    site, p = _site_path(host, path)
    return _with_query(site + p, query) if query else site + p


def path_keys(host: str, path: str, query: str, most_segments: int) -> list[str]:
    """The UT1 ``urls`` lines (:func:`path_key`) of at most ``most_segments`` path segments (a key's slashes + 1)
    that a URL matches: its host without a leading ``www.`` label with each prefix of its path that ends at a ``/``
    (and the whole path), then with its path and query. Built prefix by prefix and no further than
    ``most_segments``: a path can have any number of segments (``'/a' * 20_000``), no line has more."""
    site, p = _site_path(host, path)
    keys: list[str] = []
    at = -1
    while len(keys) < most_segments:
        at = p.find("/", at + 1)
        if at < 0:  # the whole path: it has no more segments than a line
            keys.append(site + p)
            return keys + [_with_query(keys[-1], query)] if query else keys
        keys.append(site + p[:at])
    return keys


@dataclass(frozen=True)
class UrlRules:
    enabled: bool
    blocked: frozenset[str]  # domains: each blocks itself and every host under it
    banned_words: frozenset[str]
    allowed: frozenset[str]
    under: frozenset[str] = frozenset()  # `*.domain` lines: every host under the domain, not the domain
    paths: frozenset[str] = frozenset()  # UT1 `urls` lines, as path_key gives them
    # (most labels of blocked, under, allowed; most segments of paths): how far into a host or a path to look
    depth: tuple[int, int, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "depth", (_most_parts(self.blocked, "."), _most_parts(self.under, "."),
                                           _most_parts(self.allowed, "."), _most_parts(self.paths, "/")))

    def check(self, url: Optional[str]) -> tuple[Optional[str], bool]:
        """(``url:<rule>`` or None, whether the allow list kept a URL a rule would remove)."""
        parts = url_parts(url) if self.enabled else None
        if parts is None:
            return None, False
        host, path, query = parts
        rule = None
        blocked, under, allowed, segments = self.depth
        if _under(host, self.blocked, blocked) or _under(host, self.under, under, 1) or \
                (self.paths and not self.paths.isdisjoint(path_keys(host, path, query, segments))):
            rule = "url:blocklist"
        elif not self.banned_words.isdisjoint(_WORD.findall(decoded(f"{host} {path} {query}").lower())):
            rule = "url:banned_word"
        if rule and _under(host, self.allowed, allowed):
            return None, True
        return rule, False


def _host_or_refuse(text: str) -> str:
    host = host_name(text)
    if host is None:
        why = next((w for s, w in _REFUSED if s in text), "not a host name (the WHATWG URL host parser refuses it, "
                   "or it has a character no DNS name has)")
        raise ValueError(why)
    return host


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.split("%", 1)[0])  # fe80::1%lo0: a zone
    except ValueError:
        return False
    return True


def parse_line(text: str) -> tuple[str, list[str]]:
    """One block list line (comment and blanks stripped) as (``blocked`` | ``under`` | ``paths``, its entries);
    ValueError (why) for a line in no accepted form."""
    fields = text.split()
    if len(fields) > 1:
        if not _is_ip(fields[0]):
            raise ValueError("spaces in a line that is not a hosts-file line (an IP address, then host names)")
        return "blocked", [_host_or_refuse(f) for f in fields[1:]]
    if text.startswith("*."):
        return "under", [_host_or_refuse(text[2:])]
    if "://" in text:
        raise ValueError("a URL with a scheme (write host/path, as UT1's urls files do)")
    if "/" in text:
        host, _, path = text.partition("/")
        host = _host_or_refuse(host)
        try:
            p = parse_url(f"http://{host}/{path}", attributes=("pathname", "search"))
        except ValueError:
            raise ValueError("not a host/path line") from None
        return "paths", [path_key(host, p["pathname"], p["search"][1:])]
    return "blocked", [_host_or_refuse(text[1:] if text.startswith(".") else text)]


def read_blocklist(path: Path) -> dict[str, set[str]]:
    """A block list file's entries by kind (see :func:`parse_line`); a line in no accepted form is the spec's error,
    ``<file>:<line>: <why>: <line>``."""
    out: dict[str, set[str]] = {"blocked": set(), "under": set(), "paths": set()}
    with open(path, encoding="utf-8", errors="replace") as f:  # bytes that are not UTF-8: a line refused, named
        for n, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if _as_is(text):  # most lines of a big list: a domain the parser returns as it is
                out["blocked"].add(text.rstrip("."))
                continue
            if not text:
                continue
            try:
                kind, entries = parse_line(text)
            except ValueError as e:
                raise SpecError(f"{path}:{n}: {e}: {text[:100]!r}") from None
            out[kind].update(entries)
    return out


def block_lists(cfg) -> list[Path]:
    """The block list files the URL step reads (the bundled one unless turned off, then ``url_blocklist``'s); a named
    file that is missing is the spec's error, with its key."""
    files = [LISTS / "url_blocklist.txt"] if cfg.url.bundled_blocklist else []
    for f in cfg.url_blocklist:
        p = resolve_path(f)
        if not p.is_file():
            raise SpecError(f"data.filters.url_blocklist: {p} is not a file (a block list: domains, UT1's urls "
                            "lines, hosts-file lines, *.domain)")
        files.append(p)
    return files


def list_files(cfg) -> list[Path]:
    """Every list file the URL step reads (inputs of the filter stage: a changed list is a changed input)."""
    if "url" not in cfg.steps or not cfg.url.enabled:
        return []
    return block_lists(cfg) + ([LISTS / "url_banned_words.txt"] if cfg.url.banned_words is None else [])


def _allowed(entries: list[str]) -> frozenset[str]:
    hosts = {e: host_name(e.strip().lstrip(".")) for e in entries}
    bad = [e for e, h in hosts.items() if h is None]
    if bad:
        raise SpecError(f"data.filters.url.allow: {bad[0]!r} is not a host name")
    return frozenset(hosts.values())


def load_rules(cfg) -> UrlRules:
    """The rules of ``data.filters`` (``cfg``): block lists, banned words, allow list (none read when the step is
    off)."""
    ucfg = cfg.url
    if "url" not in cfg.steps or not ucfg.enabled:
        return UrlRules(False, frozenset(), frozenset(), frozenset())
    entries: dict[str, set[str]] = {"blocked": set(), "under": set(), "paths": set()}
    for p in block_lists(cfg):
        for kind, got in read_blocklist(p).items():
            entries[kind] |= got
    words = set(ucfg.banned_words) if ucfg.banned_words is not None else read_list(LISTS / "url_banned_words.txt")
    return UrlRules(True, frozenset(entries["blocked"]), frozenset(w.lower() for w in words),
                    _allowed(ucfg.allow), frozenset(entries["under"]), frozenset(entries["paths"]))
