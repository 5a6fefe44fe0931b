"""Source keys and matching: how an input, a document's ``source`` or a URL is known (:func:`input_key`,
:func:`url_key`, :func:`source_key`: Unicode NFC, WHATWG URLs, a local path resolved as ingest resolves it) and
:class:`Matcher`, which finds the rows of a table whose source an :class:`Exclusion` names (a key, or a URL prefix)."""

from __future__ import annotations

import functools
import re
import string
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import pyarrow as pa
import pyarrow.compute as pc
from ada_url import parse_url

from pipelines.spec import resolve_path

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_PARTS = ("protocol", "hostname", "port", "pathname", "search", "hash")
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
_UNRESERVED = frozenset(string.ascii_letters + string.digits + "-._~")  # RFC 3986: %-escaped or not, the same
# a URL that whatwg_key gives back as it is (most URLs in data): a lower-case special scheme, a host of lower-case
# ASCII labels whose last starts with a letter (no IPv4 number), no port, no user info, a path with no %-escape and
# no character the parser escapes, a plain query and fragment, neither empty; unless _SLOW finds a punycode label
# or a dot segment
_AS_IS = re.compile(r"(?:https?|wss?|ftp)://(?:[a-z0-9_-]+\.)*[a-z][a-z0-9_-]*/[A-Za-z0-9._~!$&'()*+,;=:@/-]*"
                    r"(?:\?[A-Za-z0-9._~!$&()*+,;=:@/?%-]+)?(?:#[A-Za-z0-9._~!$&()*+,;=:@/?%-]+)?")
_SLOW = re.compile(r"xn--|/\.\.?(?:[/?#]|$)")


def file_key(path: Path) -> str:
    """A local input's key: its path relative to the project root, else its absolute path."""
    root = resolve_path(".").resolve()
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()


def is_url(key: str) -> bool:
    return bool(_SCHEME.match(key))


def _unescape(m: re.Match) -> str:
    c = chr(int(m.group(1), 16))
    return c if c in _UNRESERVED else f"%{m.group(1).upper()}"


def whatwg_key(url: str) -> Optional[str]:
    """``url`` as lineage compares it, read by the WHATWG URL parser (``ada-url``, as the URL filter and browsers
    read it): scheme and host lower-cased, the host by UTS #46 and in punycode (``faß.de`` is ``xn--fa-hia.de``), an
    IPv4 address in any form dotted (``0x7f.1`` is ``127.0.0.1``), an IPv6 address compressed, a trailing dot, user
    info and a default port dropped, ``\\`` read as ``/``, dot segments resolved, the path's %-escapes of unreserved
    characters decoded (``%7Eu`` is ``~u``) and the others upper-cased, an empty path written ``/``. None when the
    parser refuses it (a bad host or port: no browser opens it) or it has no host."""
    try:
        p = parse_url(url, attributes=_PARTS)
    except ValueError:
        return None
    host = p["hostname"].lower().rstrip(".")
    if not host:
        return None
    path = _ESCAPE.sub(_unescape, p["pathname"]) if "%" in p["pathname"] else p["pathname"]
    port = f":{p['port']}" if p["port"] else ""
    return f"{p['protocol'].lower()}//{host}{port}{path or '/'}{p['search']}{p['hash']}"


def as_is(url: str) -> bool:
    """:func:`url_key` gives ``url`` back as it is (``_AS_IS``, the parser not called: :func:`_url_keys` finds these
    vectorised)."""
    return _AS_IS.fullmatch(url) is not None and _SLOW.search(url) is None


def url_key(url: str) -> str:
    """A URL from the data (a doc's ``url``, a ``source`` that is a URL) as lineage compares it (NFC, then
    :func:`whatwg_key`); one the parser refuses (or without a host) is compared as written, NFC: it takes no valid
    prefix's URLs unless it starts with one's exact text at a boundary. Never raises."""
    if as_is(url):
        return url
    url = unicodedata.normalize("NFC", url)
    return whatwg_key(url) or url


@functools.lru_cache(maxsize=4096)
def input_key(key: str) -> str:
    """A recorded key (a doc's ``source``, a list entry) as lineage compares it: NFC, and a URL (``scheme://…``) as
    :func:`url_key` writes it. Never raises: keys come from data."""
    return url_key(key) if is_url(key) else unicodedata.normalize("NFC", key)


def check_text(text: str, what: str) -> str:
    """``text`` stripped, or ValueError: empty, or holding a control character (a newline would forge a line of the
    list or of a tag)."""
    t = (text or "").strip() if isinstance(text, str) else ""
    if not t:
        raise ValueError(f"an empty {what}")
    if any(ord(c) < 32 or ord(c) == 127 for c in t):
        raise ValueError(f"the {what} {t[:80]!r} holds a control character (a newline, a tab …)")
    return t


def source_key(text: str) -> str:
    """What a user (``--source``, ``--exclude-source``) or a list line names, as lineage compares it: a URL prefix
    (:func:`whatwg_key`; one the parser refuses, or without a host, is refused), a local path resolved as ingest
    resolves its inputs; ValueError otherwise."""
    s = unicodedata.normalize("NFC", check_text(text, "source (an input's key or a URL prefix)"))
    if is_url(s):
        key = whatwg_key(s)
        if key is None:
            raise ValueError(f"{s[:200]!r}: not a URL with a host (the WHATWG URL parser, the URL filter's and "
                             "browsers', refuses it or finds no host: a bad host or port?); a URL prefix needs a "
                             "host (https://example.com/…)")
        return key
    if "://" in s:
        raise ValueError(f"{s[:200]!r}: not a URL (scheme://host/…) and not a path")
    try:
        return input_key(file_key(resolve_path(s).resolve()))
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{s[:200]!r}: not a path ({e})") from None


def _prefix(key: str) -> str:
    return key[:-1] if key.endswith("/") and "?" not in key and "#" not in key else key


def _bounds(prefix: str) -> tuple[str, ...]:
    """What may follow a prefix in a key under it: a URL's path, query or fragment (after a query: another
    parameter or the fragment); a local directory's ``/``."""
    return ("&", "#") if "?" in prefix else ("/", "?", "#") if is_url(prefix) else ("/",)


def under_prefix(key: str, prefix: str) -> bool:
    """``key`` (an :func:`input_key` or :func:`url_key`) is ``prefix`` (as :class:`Matcher` keeps it) or lies under
    it, at a host or path boundary."""
    if not key.startswith(prefix):
        return False
    rest = key[len(prefix):]
    return not rest or rest[0] in _bounds(prefix)


def _under_mask(keys, prefix: str):
    """:func:`under_prefix` over an Arrow string array (null where ``keys`` is null)."""
    after = pc.utf8_slice_codeunits(keys, start=len(prefix), stop=len(prefix) + 1)  # code points, as len()
    return pc.and_kleene(pc.starts_with(keys, pattern=prefix),
                         pc.is_in(after, value_set=pa.array(["", *_bounds(prefix)], pa.string())))


def _url_keys(values):
    """:func:`url_key` of an Arrow string array: the URLs it gives back as they are found vectorised (the same
    patterns as :func:`as_is`), only the others parsed one by one."""
    fast = pc.and_kleene(pc.match_substring_regex(values, f"^(?:{_AS_IS.pattern})$"),
                         pc.invert(pc.match_substring_regex(values, _SLOW.pattern)))
    slow = pc.invert(pc.fill_null(fast, True))  # a null stays null
    keys = [url_key(v) for v in values.filter(slow).to_pylist()]
    return pc.replace_with_mask(values, slow, pa.array(keys, values.type)) if keys else values


def _distinct_keys(column, key):
    """(the distinct values of an Arrow column as ``key`` writes them, each row's index among them, None when every
    row's value is distinct: the values are the rows then): each value is normalised once, however many rows hold
    it."""
    values = pc.unique(column)  # in the order they first appear
    keys = (_url_keys(values) if key is url_key else
            pa.array([None if v is None else key(v) for v in values.to_pylist()], values.type))
    return keys, (None if len(values) == len(column) else pc.index_in(column, value_set=values))


def _per_row(mask, rows):
    return mask if rows is None else pc.take(mask, rows)


@dataclass(frozen=True)
class Exclusion:
    source: str
    reason: str
    added_at: str = ""


class Matcher:
    """Which docs a set of sources takes: ``source`` at or under one of them (a local directory's key takes the
    files under it, as ``s3://bucket/dir`` does), or ``url`` at or under one that is a URL prefix. Sources as
    :func:`source_key` gives them (an :class:`Exclusion`'s is), kept in their order."""

    def __init__(self, sources: Iterable[Exclusion | str]):
        self.keys = tuple(input_key(e.source if isinstance(e, Exclusion) else e) for e in sources)
        self.prefixes = tuple(_prefix(k) for k in self.keys)
        self.url_prefixes = tuple(p for p in self.prefixes if is_url(p))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def hit(self, source: Optional[str], url: Optional[str]) -> bool:
        """One doc (the filter stage's Spark tasks ask per row; :meth:`masks` is the same over a table)."""
        src = input_key(source) if isinstance(source, str) else None
        if src is not None and any(under_prefix(src, p) for p in self.prefixes):
            return True
        if not isinstance(url, str) or not self.url_prefixes:
            return False
        key = url_key(url)
        return any(under_prefix(key, p) for p in self.url_prefixes)

    def masks(self, table) -> list:
        """Per source, in order, a boolean array over an Arrow table's rows (``source``, and ``url`` when it has
        one): the rows it takes. Each distinct ``source`` and ``url`` is normalised once; each prefix is compared
        over them vectorised."""
        if not self.keys:
            return []
        src, src_rows = _distinct_keys(table.column("source"), input_key)
        urls = (_distinct_keys(table.column("url"), url_key)
                if "url" in table.column_names and self.url_prefixes else None)
        out = []
        for p in self.prefixes:
            hit = _per_row(_under_mask(src, p), src_rows)
            if urls is not None and is_url(p):
                hit = pc.or_kleene(hit, _per_row(_under_mask(urls[0], p), urls[1]))
            out.append(pc.fill_null(hit, False))
        return out

    def mask(self, table):
        """A boolean array over an Arrow table's rows: the rows any of the sources takes."""
        return functools.reduce(pc.or_, self.masks(table), pa.repeat(False, table.num_rows))
