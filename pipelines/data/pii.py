"""Personal data in kept docs: e-mail addresses, IPv4 and IPv6 addresses and phone numbers, found by patterns and
replaced by fixed placeholders (FineWeb's PII formatter does the same for e-mails and IPs).

Placeholders are addresses reserved for documentation, so no real person or host is named: ``email@example.com``
(RFC 2606), ``192.0.2.1`` (RFC 5737), ``2001:db8::1`` (RFC 3849), ``+1-555-0100`` (the 555-01xx block is fictional).

What is *not* personal data and must stay: dates (``2024-01-15``, ``15.01.2024``), version numbers (``v1.2.3.4``,
``version 10.0.19041.1``), prices (``$1,299.99``, ``1 299 €``), room and street numbers, times (``12:30:45``), ISBNs
with their prefix. The phone pattern therefore asks for 10 to 15 digits in groups a phone uses (or 7 digits
``555-0123`` after a word such as "call" or "tel"), and skips a match that reads as a date, a version or an
identifier. Precision and recall on a labelled sample: ``tests/test_pii.py`` (the method is in docs/data.md).
"""
from __future__ import annotations

import bisect
import re
from collections import Counter

PLACEHOLDERS = {"email": "email@example.com", "ipv4": "192.0.2.1", "ipv6": "2001:db8::1", "phone": "+1-555-0100"}
KINDS = tuple(PLACEHOLDERS)

EMAIL = re.compile(r"(?<![\w.%+-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+"
                   r"[A-Za-z]{2,24}(?![\w-])")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
IPV4 = re.compile(rf"(?<![\w.])(?<!\bv)(?<!version )(?<!ver\. ){_OCTET}(?:\.{_OCTET}){{3}}(?![\w]|\.\d)", re.I)
_H = r"[0-9A-Fa-f]{1,4}"
_V4TAIL = rf"(?::{_OCTET}(?:\.{_OCTET}){{3}})?"  # an IPv4-mapped tail (::ffff:192.0.2.128) is part of the address
IPV6 = re.compile(
    rf"(?<![\w:])(?:(?:{_H}:){{7}}{_H}"  # full
    rf"|(?:{_H}:){{1,7}}:(?:{_H}(?::{_H}){{0,6}})?{_V4TAIL}"  # with :: after at least one group
    rf"|::(?:{_H}(?::{_H}){{0,6}}){_V4TAIL})"  # leading ::
    rf"(?![\w:]|\.\d)")
_SEP = r"[ .\-\u00a0]"
PHONE = re.compile(
    rf"(?<![\w+\-./:,$€£])"
    rf"(?:\+\d{{1,3}}{_SEP}?(?:\(0\){_SEP}?)?)?"  # +CC and the (0) some countries write after it
    rf"(?:\(\d{{1,5}}\){_SEP}?)?"  # (area)
    rf"\d{{1,8}}(?:{_SEP}\d{{1,8}}){{0,5}}"
    rf"(?![\w\-/]|[.,]\d)")
_CUE = re.compile(r"(?:call|phone|tel|telephone|fax|mobile|cell|whatsapp|contact|sms|text us)\b\W{0,6}$", re.I)
_DATE = re.compile(r"^(?:\d{4}[-./ ]\d{1,2}[-./ ]\d{1,2}|\d{1,2}[-./ ]\d{1,2}[-./ ]\d{2,4})$")
_HAS_DATE = re.compile(r"\d{4}[-./]\d{1,2}[-./]\d{1,2}|\d{1,2}[-./]\d{1,2}[-./]\d{4}")
_IBAN_BEFORE = re.compile(r"\b[A-Z]{2}\d{2}\s$")
_IP_VERSION_BEFORE = re.compile(r"(?:[A-Za-z]/|\b(?:v|version|ver|release|build|driver|firmware|firefox|chrome|"
                                r"section|chapter|rule|figure|table|§)\.?\s*)$", re.I)
_VERSION_BEFORE = re.compile(r"(?:\bv|version|ver\.?|release|build|isbn(?:-1[03])?:?|issn:?|doi:?|id:?|no\.?|#)\s*$", re.I)


def _digits(s: str) -> int:
    return sum(c.isdigit() for c in s)


def _phone_ok(text: str, m: re.Match) -> bool:
    s = m.group(0)
    n = _digits(s)
    before = text[max(0, m.start() - 24):m.start()]
    if _VERSION_BEFORE.search(before) or _DATE.match(s.strip()) or _HAS_DATE.search(s):
        return False
    runs = re.findall(r"\d+", s)
    groups = [int(g) for g in runs]
    if len(groups) >= 3 and all(b == a + 1 for a, b in zip(groups, groups[1:])):
        return False  # a counting run: page numbers, a list's numbering
    if not s.startswith("+") and len(runs) >= 3 and len(runs[0]) <= 3 and all(len(g) == 3 for g in runs[1:]):
        return False  # 1 500 000 000: a number grouped in thousands
    if len(groups) >= 2 and all(1900 <= g <= 2099 for g in groups):
        return False  # 2010-2015-2020: years
    if len(groups) > 5 and not s.startswith("+"):
        return False
    prev = re.search(r"(\d+)\s+$", before)
    if prev and groups and int(prev.group(1)) + 1 == groups[0]:
        return False  # the rest of a counting run
    if re.match(r"\((?:19|20)\d\d\)", s) or _IBAN_BEFORE.search(before):
        return False  # "(2009) 2 920 000": a year then a number; "BE04 7360 1914 4531": an account number
    if not s.startswith("+") and len(groups) >= 4 and all(len(g) == 3 for g in re.findall(r"\d+", s)):
        return False  # 261 261 302 824: a table's or a thousands-grouped number
    if 10 <= n <= 15:
        # a phone has separators or a + (a bare run of 10+ digits is as often an order or tracking number),
        # and no run of dot-separated groups (those are versions and decimals)
        if s.startswith("+") or "(" in s:
            return True
        seps = re.findall(_SEP, s)
        if seps and all(c == "." for c in seps):  # dotted groups are versions and decimals, but 415.555.2671
            return re.fullmatch(r"\d{3}\.\d{3}\.\d{4}", s) is not None
        return bool(seps) or bool(_CUE.search(before))
    return n == 7 and re.fullmatch(r"\d{3}[ .\-]\d{4}", s) is not None and bool(_CUE.search(before))


def _ip_ok(text: str, kind: str, m: re.Match) -> bool:
    s = m.group(0)
    if kind == "ipv6":  # "Face::Add", "a::b" in code, "1:2" ratios: not addresses
        return s.count(":") >= 2 and any(c.isdigit() for c in s) and re.search(r"[0-9A-Fa-f]{2}", s) is not None
    return kind != "ipv4" or not _IP_VERSION_BEFORE.search(text[max(0, m.start() - 24):m.start()])


class _Taken:
    """Spans already found, sorted: whether a new one overlaps any, in O(log n)."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []

    def free(self, a: int, b: int) -> bool:
        i = bisect.bisect_right(self.starts, a)
        return (i == 0 or self.ends[i - 1] <= a) and (i == len(self.starts) or self.starts[i] >= b)

    def add(self, a: int, b: int) -> None:
        i = bisect.bisect_right(self.starts, a)
        self.starts.insert(i, a)
        self.ends.insert(i, b)


def find(text: str) -> list[tuple[int, int, str]]:
    """The spans (start, end, kind) of personal data in ``text``, not overlapping, in order."""
    spans: list[tuple[int, int, str]] = []
    taken = _Taken()
    for kind, rx in (("email", EMAIL), ("ipv6", IPV6), ("ipv4", IPV4), ("phone", PHONE)):
        for m in rx.finditer(text):
            ok = _phone_ok(text, m) if kind == "phone" else _ip_ok(text, kind, m)
            if ok and taken.free(m.start(), m.end()):
                taken.add(m.start(), m.end())
                spans.append((m.start(), m.end(), kind))
    return sorted(spans)


def scrub(text: str) -> tuple[str, Counter]:
    """``text`` with every span of :func:`find` replaced by its kind's placeholder, and the count per kind."""
    spans = find(text)
    if not spans:
        return text, Counter()
    out, at = [], 0
    for s, e, kind in spans:
        out += [text[at:s], PLACEHOLDERS[kind]]
        at = e
    out.append(text[at:])
    return "".join(out), Counter(kind for _, _, kind in spans)
