"""Personal data in kept docs: e-mail addresses, IPv4 and IPv6 addresses and phone numbers, found and replaced by
fixed placeholders (FineWeb's PII formatter does the same for e-mails and IPs).

Placeholders are addresses reserved for documentation, so no real person or host is named: ``email@example.com``
(RFC 2606), ``192.0.2.1`` (RFC 5737), ``2001:db8::1`` (RFC 3849), ``+1-555-0100`` (the 555-01xx block is fictional).

**Phones** are Google's libphonenumber's (``phonenumbers``, what Presidio uses): a cheap pattern picks runs of 8 to
30 digits in the shapes numbers are written in, and ``PhoneNumberMatcher`` (leniency ``VALID``: a number that exists
in the numbering plan, with its trunk prefix where the plan needs one) reads each run in the doc's regions
(:func:`regions`: its URL's country TLD's, then its language's, :data:`LANG_REGIONS`; else :data:`DEFAULT_REGIONS`);
a number written with ``+`` is read in any of them. A valid number is still not a phone when it reads as something
else (:func:`_phone_ok`): a service number (UAN), an ID label before it (ISBN, SKU, order, …), a last group of one
digit (an ISBN's check digit), a run of digits with no separator and no cue word ("tel", "call", "fax", …) before
it, an area code split or run into the rest ("016 854 401"), figures (:func:`_figure`: decimals and coordinates,
versions, thousands-grouped figures, years, counting runs), or a run of figures that the numbers found do not cover
(a table row).

**Cost per doc, bounded**: a run of digits alone (no separator, no ``+``) with no cue word before it never reaches
the matcher (:func:`_bare`: those rules would refuse every number in it); the matcher's answer for a run is cached
per (run, regions) (:func:`_numbers`); and a doc gets at most :data:`MATCHER_READS` matcher reads (a run in one
region). Past them a run is read by :func:`_national_number` alone: the whole run one number by libphonenumber's
metadata (a calling code after ``+``, else a region's national prefix where it writes one, the lengths and the
pattern of its national numbers), then the rules on the text (ID labels, cue, figures); no number types (a
service number is taken), no area-code rule, no number found inside a longer run. Which path reads a run depends on
the doc alone, not on the cache or the docs before it.

**E-mail addresses** skip what shares their shape (:func:`_email_ok`): a file name (``logo@2x.png``: a file
extension as the TLD, an ``@2x`` scale), code (``A@B.transpose()``: a call or attribute after it), an ssh/scp target
or a git remote (``git@github.com:org/repo``, ``ssh -p 22 deploy@host``) and shell prompts
(``deploy@web-1.internal:~$``, ``[root@host ~]#``). **IPv4** skips version strings and section numbers
(:func:`_ipv4_ok`: after ``v``, ``version``, ``build``, ``§``, ``section``…, after ``Product/``, after a product name
that is not an address cue such as ``Server``, ``x.y.z.0`` without a ``/prefix``, before ``.zip``, ``-beta``);
**IPv6** skips C++ scopes (:func:`_ipv6_ok`: ``cafe::ba5e``: an ``a::b`` form of up to three groups must start like
an address).

Precision and recall on the labelled set ``data/pii/labelled.jsonl`` (its construction: ``data/pii/make_labelled.py``):
``tests/test_pii.py`` and ``benchmarks/pii_bench.py``; the table is in docs/data.md.
"""
from __future__ import annotations

import bisect
import functools
import re
from collections import Counter
from typing import NamedTuple
from urllib.parse import urlsplit

import phonenumbers
from tld import is_tld

PLACEHOLDERS = {"email": "email@example.com", "ipv4": "192.0.2.1", "ipv6": "2001:db8::1", "phone": "+1-555-0100"}
KINDS = tuple(PLACEHOLDERS)

# Regions a phone number is read in: the doc's language's (ISO 639-1 → ISO 3166 regions whose national numbers
# a page in that language most often carries), plus its URL's country TLD; DEFAULT_REGIONS when neither gives one.
# Numbers written with + (E.164) are found whatever the regions.
DEFAULT_REGIONS = ("US", "GB")
LANG_REGIONS = {"en": ("US", "GB"), "de": ("DE", "AT", "CH"), "fr": ("FR", "BE", "CH"), "es": ("ES", "MX"),
                "it": ("IT",), "nl": ("NL", "BE"), "pt": ("PT", "BR"), "pl": ("PL",), "sv": ("SE",), "da": ("DK",),
                "nb": ("NO",), "no": ("NO",), "fi": ("FI",), "cs": ("CZ",), "hu": ("HU",), "ro": ("RO",),
                "el": ("GR",), "tr": ("TR",), "ru": ("RU",), "uk": ("UA",), "ja": ("JP",), "ko": ("KR",),
                "zh": ("CN", "TW"), "hi": ("IN",), "ta": ("IN",), "id": ("ID",), "ms": ("MY",), "vi": ("VN",),
                "th": ("TH",), "ar": ("EG", "SA"), "he": ("IL",)}
_TLD_REGION = {"uk": "GB"}
# PhoneNumberMatcher reads (a candidate run in one region) per doc; past them a run is read by the metadata's lengths
# and patterns alone (_national_number): a doc dense in numbers costs a bounded matcher time
MATCHER_READS = 1000

EMAIL = re.compile(r"(?<![\w.%+-])[A-Za-z0-9_][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+"
                   r"[A-Za-z]{2,24}(?![\w-])")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\w]|\.\d)")
_H = r"[0-9A-Fa-f]{1,4}"
_V4TAIL = rf"(?::{_OCTET}(?:\.{_OCTET}){{3}})?"  # an IPv4-mapped tail (::ffff:192.0.2.128) is part of the address
IPV6 = re.compile(
    rf"(?<![\w:])(?:(?:{_H}:){{7}}{_H}"  # full
    rf"|(?:{_H}:){{1,7}}:(?:{_H}(?::{_H}){{0,6}})?{_V4TAIL}"  # with :: after at least one group
    rf"|::(?:{_H}(?::{_H}){{0,6}}){_V4TAIL})"  # leading ::
    rf"(?![\w:]|\.\d)")
# A phone candidate: digits with the separators numbers are written with (space, no-break space, . - / and
# brackets, at most 3 in a row: "030 / 231", "+49 (0)30"), not glued to a word, a number or a URL parameter.
PHONE_CANDIDATE = re.compile(r"(?<![\w@#$€£%&=/.,+-])\+?\(?\+?\d(?:[ \u00a0.\-/()]{0,3}+\d)*\)?(?!\w)")  # {0,3}+:
# possessive, so a run of separators is read one way only (no backtracking through its splits)

# Cheap scans that say whether a doc can hold a match at all (most docs cannot): the full patterns run only then.
_MAY_HOLD = {"email": re.compile("@"), "ipv4": re.compile(r"\d\.\d{1,3}\.\d{1,3}\.\d"),
             "ipv6": re.compile(r"::|[0-9A-Fa-f]:[0-9A-Fa-f]{1,4}:"),
             "phone": re.compile(r"\d(?:[ \u00a0().\-/]{0,3}\d){7}")}  # 8 digits or more

_FILE_EXT = ("png|jpe?g|gif|svg|webp|bmp|ico|tiff?|avif|heic|pdf|docx?|xlsx?|pptx?|txt|csv|json|ya?ml|xml|html?|"
             "css|s[ac]ss|js|mjs|tsx?|jsx|php|rb|java|kt|cpp|hpp|zip|gz|tgz|tar|7z|rar|exe|msi|dmg|apk|deb|rpm|mp[34]|"
             "mov|webm|wav|ogg|flac|woff2?|ttf|otf|eot|log|ini|cfg|toml|lock|sql|bak|iso|img")
_FILE_TLD = re.compile(rf"@(?:\d+(?:\.\d+)?x\b|[^@\s]*\.(?:{_FILE_EXT})$)", re.I)  # logo@2x.png, a@b.webp
_CODE_AFTER = re.compile(r"[(\[]|\.[A-Za-z_(]")  # A@B.transpose(), x@self.weight.T
_HOST_AFTER = re.compile(r":[^\s\"'<>)\]]|\s+[~/][^\s\]]*\][$#]")  # git@github.com:org/x, u@h:~$, [u@h ~]$
_SSH_BEFORE = re.compile(r"\b(?:ssh|scp|sftp|rsync|mosh|ssh-copy-id|telnet)"  # then options, numbers, paths
                         r"(?:\s++(?:-\S++|\d++|[^\s/.~]*+[/.~]\S*+))*\s+$")

# The word before an address that says it is one: whole words, or parts of a name ("ServerName", "VirtualHost")
_IP_CUE = re.compile(r"(?:ip|ipv4|inet|from|to|at|via|src|dst|source|destination|ping|node|origin|target|network|"
                     r"mask|subnet|broadcast|local|forwarded|interface|\w*(?:host|server|addr|address|client|gateway|"
                     r"router|proxy|dns|resolver|peer|remote|listen|bind|upstream|backend|endpoint)\w*)", re.I)
_VERSION_WORDS = (r"v|ver|version|release|build|rev|revision|patch|update|driver|firmware|bios|kernel|"
                  r"§|sec|section|chapter|chap|clause|article|art|paragraph|para|annex|appendix|part|rule|"
                  r"requirement|req|item|step|figure|fig|table|tab|abschnitt|kapitel|absatz|anhang|no|nr")
_IP_VERSION_BEFORE = re.compile(rf"(?:[A-Za-z]/|version=|(?<![\w.])(?:{_VERSION_WORDS})\.?[\s-]*|"
                                r"\b(?:upgrad|downgrad)(?:e|es|ed|ing)\s+(?:\w+\s+){0,3}to\s+|\bbump(?:s|ed|ing)?\s+"
                                r"(?:\w+\s+){0,3}to\s+)$", re.I)  # "upgrade the cluster to 4.2.0.1" (not "update
# the record to": an address as often as a version)
_VERSION_AFTER = re.compile(r"(?:-(?:alpha|beta|rc|dev|pre|preview|snapshot|final)|\+|\.(?:exe|zip|msi|dmg|tar|gz|"
                            r"deb|rpm|pkg|apk|jar|whl|so|dll)|\s+(?:above|below)\b)", re.I)  # "see 2.1.3.4 above"
_PRODUCT_BEFORE = re.compile(r"(?:^|[^\w.+-])([.A-Z][\w.+-]*[\w+]|[A-Za-z]+\d\w*)[ \t]$")
_IPV6_START = re.compile(r"^(?:2[0-9a-f]{3}|3ffe|fe[89ab][0-9a-f]|f[cd][0-9a-f]{2}|ff0[0-9a-f]|64)$", re.I)

_CUE = re.compile(r"(?:\b(?:call|phone|tel|telephone|telefon|t[ée]l[ée]phone|t[ée]l|fax|mobile?|cell|handy|"
                  r"portable|whatsapp|sms|text|hotline|contact|ruf|appel(?:ez)?|anrufen|kontakt)\b|tel:|\btel\.)"
                  r"[^\n\d]{0,14}$", re.I)
_ID_BEFORE = re.compile(r"\b(?:isbn(?:-1[03])?|issn|sku|ean|upc|gtin|art\.?-?nr|artikel(?:nummer)?|part|p/n|item|"
                        r"order|invoice|rechnung(?:snr)?|bestell(?:nr|nummer)?|kunden(?:nr|nummer)|ticket|tracking|"
                        r"ref(?:erence)?|serial|s/n|model|id|iban|bic|account|konto|lat|lon|lng|seed|"
                        r"v|version|build|release|doi)[.:#\s]*(?:no\.?|nr\.?|#)?[.:#\s]*$", re.I)
_YEARS = re.compile(r"(?:19|20)\d\d")
_NOT_PERSONAL = {phonenumbers.PhoneNumberType.UAN, phonenumbers.PhoneNumberType.VOICEMAIL,
                 phonenumbers.PhoneNumberType.UNKNOWN}


def regions(lang: str | None = None, url: str | None = None) -> tuple[str, ...]:
    """The regions a doc's national phone numbers are read in: its URL's country TLD's, then its language's;
    :data:`DEFAULT_REGIONS` when neither names one."""
    tld = ""
    if url:
        try:
            tld = (urlsplit(url).hostname or "").rsplit(".", 1)[-1]
        except ValueError:
            tld = ""
    return _regions((lang or "").split("-")[0].split("_")[0].lower(), tld.lower())


@functools.lru_cache(maxsize=1024)
def _regions(lang: str, tld: str) -> tuple[str, ...]:
    out = list(LANG_REGIONS.get(lang, ()))
    region = _TLD_REGION.get(tld, tld.upper())
    if len(tld) == 2 and region in phonenumbers.SUPPORTED_REGIONS:
        out.insert(0, region)
    return tuple(dict.fromkeys(out)) or DEFAULT_REGIONS


def _email_ok(text: str, m: re.Match) -> bool:
    after = text[m.end():m.end() + 40]
    if _FILE_TLD.search(m.group(0)) or _CODE_AFTER.match(after) or _HOST_AFTER.match(after):
        return False
    if not is_tld(m.group(0).rsplit(".", 1)[1].lower()):
        return False  # x@W.weight: code, not an address (the TLD is no top-level domain of the Public Suffix List)
    return not _SSH_BEFORE.search(text[max(0, m.start() - 80):m.start()])


def _ipv4_ok(text: str, m: re.Match) -> bool:
    before, after = text[max(0, m.start() - 40):m.start()], text[m.end():m.end() + 12]
    if _IP_VERSION_BEFORE.search(before) or _VERSION_AFTER.match(after):
        return False
    cue = re.search(r"(\w+)\W*$", before)
    if cue and _IP_CUE.fullmatch(cue.group(1)):
        return True
    if m.group(0).endswith(".0") and not after.startswith("/"):
        return False  # 120.0.0.0, 4.0.0.0: a version (a host is not x.y.z.0; a network has its /prefix)
    product = _PRODUCT_BEFORE.search(before)  # "Edge 120.1.2.3", "WebView2 83.0.1.2"; "Blocked 192.0.2.7" is a verb
    return not product or product.group(1).endswith(("ed", "ing"))


def _ipv6_ok(text: str, m: re.Match) -> bool:
    s = m.group(0)
    groups = [g for g in re.split(r":+", s) if g]
    if s.count(":") < 2 or not any(c.isdigit() for c in s) or all(g.isalpha() for g in groups):
        return False  # "a::b", "Face::Add", "1:2"
    return len(groups) > 3 or s.startswith("::") or _IPV6_START.match(groups[0]) is not None


def _area_code_split(num: str, number: phonenumbers.PhoneNumber) -> bool:
    """Whether ``num``, written with separators, runs its area code into the rest or splits it ("016 854 401" for
    0168 54401): how figures in a table read, not how a number is written."""
    digits = [i for i, c in enumerate(num.replace("(0)", "   ")) if c.isdigit()]
    ndc = phonenumbers.length_of_national_destination_code(number)
    at = len(digits) - len(phonenumbers.national_significant_number(number)) + ndc
    return ndc == 0 or not 0 < at < len(digits) or digits[at] == digits[at - 1] + 1


def _figure(num: str) -> bool:
    """Whether digits written as ``num`` read as figures: decimals and coordinates, versions, a figure grouped in
    thousands, years, a counting run."""
    runs = re.findall(r"\d+", num)
    seps = set(re.sub(r"[\d+]", "", num.strip("()").replace("(0)", "")))
    if "." in seps and (len(seps) > 1 or any(len(r) < 2 or len(r) > 4 for r in runs)):
        return True  # 51.5074 -0.1278, 120.0.6099.109
    if "+" not in num and "(" not in num and len(runs) >= 3 and not runs[0].startswith("0") and len(runs[0]) <= 3 \
            and all(len(r) == 3 for r in runs[1:]):
        return True  # 261 261 302 824
    if len(runs) >= 2 and all(_YEARS.fullmatch(r) for r in runs):
        return True  # 2010 2015 2020
    groups = [int(r) for r in runs]
    return len(groups) >= 3 and all(b == a + 1 for a, b in zip(groups, groups[1:]))  # pages 1256 1257 1258


def _grouped(num: str) -> bool:
    return re.search(r"\d\D+\d", num) is not None  # a separator between digits


def _intl(num: str) -> bool:
    return num.lstrip("(").startswith("+")


def _cued(text: str, s: int) -> bool:
    """Whether a cue word ("Tel.", "call", …) stands just before ``s`` (no digit, no line break after it)."""
    end = s - 1 if s and text[s - 1] == "\n" else s  # ($ matches before a last line break too)
    if end and text[end - 1] in "\n0123456789":
        return False  # no cue word ends in a digit or a line break: the pattern cannot match (a table's rows)
    return _CUE.search(text[max(0, s - 30):s]) is not None


def _phone_ok(text: str, s: int, e: int, number: phonenumbers.PhoneNumber | None) -> bool:
    """Whether the ``number`` at ``text[s:e]`` reads as a phone number, not an ID or a figure (``number`` None: a
    number past the doc's matcher budget, :func:`_national_number`: the rules on the text alone)."""
    num = text[s:e]
    last = re.search(r"\d+$", num).group(0)
    grouped, intl = _grouped(num), _intl(num)
    if _ID_BEFORE.search(text[max(0, s - 30):s]) or (len(last) == 1 and not intl):
        return False  # "SKU 030-2312-5123", an ISBN "0-306-40615-2"
    if not grouped and not intl and not _cued(text, s):
        return False  # 0306406152: an ISBN, an order or tracking number, unless "Tel." stands before it
    if _figure(num):
        return False
    if number is None:
        return True
    if phonenumbers.number_type(number) in _NOT_PERSONAL:
        return False  # "13 10 17 40" as a US 310-xxxx service number
    return intl or not grouped or not _area_code_split(num, number)


def _bare(text: str, cand: re.Match) -> bool:
    """Whether the candidate is digits alone (no separator, no ``+``) with no cue before it: :func:`_phone_ok`
    refuses every number libphonenumber could find in it (one starting inside the run has a digit before it)."""
    raw = cand.group(0)
    if _grouped(raw) or "+" in raw:
        return False
    return not _cued(text, cand.start()) and not (raw.startswith("(") and _cued(text, cand.start() + 1))


@functools.lru_cache(maxsize=4096)
def _numbers(raw: str, regs: tuple[str, ...]) -> tuple[int, tuple]:
    """(regions read, the numbers ``PhoneNumberMatcher`` finds in ``raw`` in the first region whose numbers leave no
    group of 3 or more digits of the run uncovered: a valid number inside a longer run of figures is a table's;
    "(844-509-7233) 24 hours" is a number). Cached: a footer's number recurs across a site's docs."""
    for i, region in enumerate(regs, 1):
        found = tuple((m.start, m.end, m.number) for m in
                      phonenumbers.PhoneNumberMatcher(raw, region, leniency=phonenumbers.Leniency.VALID))
        if found and not any(len(r.group(0)) > 2 and not any(a <= r.start() < b for a, b, _ in found)
                             for r in re.finditer(r"\d+", raw)):
            return i, found
    return len(regs), ()


class _Plan(NamedTuple):
    """A region's (or a calling code's) numbering plan as libphonenumber's metadata has it: its national prefix,
    whether its numbers are written with it (a format writes it and does not call it optional: GB's and DE's 0, not
    US's 1), the lengths of its national numbers and their pattern (the union of every number type's)."""
    prefix: str
    prefix_written: bool
    lengths: frozenset
    pattern: re.Pattern

    def fits(self, nsn: str) -> bool:
        return (not self.lengths or len(nsn) in self.lengths) and self.pattern.fullmatch(nsn) is not None


@functools.lru_cache(maxsize=None)
def _plan(region: str, code: int = 0) -> _Plan:
    md = phonenumbers.PhoneMetadata.metadata_for_region_or_calling_code(code, region)
    written = any(f.national_prefix_formatting_rule and not f.national_prefix_optional_when_formatting
                  for f in md.number_format)
    desc = md.general_desc
    return _Plan(md.national_prefix or "", written, frozenset(desc.possible_length),
                 re.compile(desc.national_number_pattern or "(?!)"))


def _national_number(raw: str, regs: tuple[str, ...]) -> bool:
    """The cheap read past the matcher budget: whether the whole run is one number by the metadata's lengths and
    patterns: with ``+``, a calling code and a national number of its country; else a national number of one of
    ``regs``, with its national prefix where the region writes one. No number types, no area code, no number inside
    a run."""
    digits = re.sub(r"\D", "", raw.replace("(0)", ""))
    if _intl(raw):
        for n in (1, 2, 3):  # calling codes are prefix-free: at most one fits
            region = phonenumbers.region_code_for_country_code(int(digits[:n]))
            if region != phonenumbers.UNKNOWN_REGION:
                return _plan(region, int(digits[:n])).fits(digits[n:])
        return False
    for plan in map(_plan, regs):
        if plan.prefix and digits.startswith(plan.prefix) and plan.fits(digits[len(plan.prefix):]):
            return True
        if not (plan.prefix and plan.prefix_written) and plan.fits(digits):
            return True
    return False


def _phones(text: str, cand: re.Match, regs: tuple[str, ...], reads_left: int) -> tuple[list, int]:
    """(the phone numbers in one candidate run, the matcher reads spent): :func:`_numbers`'s while ``reads_left``
    covers a read in every region, else :func:`_national_number`'s."""
    raw = cand.group(0)
    if not 8 <= sum(c.isdigit() for c in raw) <= 30 or _bare(text, cand) or _figure(raw):
        return [], 0  # too short for a number, too long for two, figures, an ID: not worth libphonenumber's time
    if reads_left < len(regs):
        whole = _balanced(text, cand.start(), cand.start() + len(raw.rstrip(")")))
        spans = [(*whole, None)] if _national_number(raw, regs) else []
        reads = 0
    else:
        reads, found = _numbers(raw, regs)
        spans = [(*_balanced(text, cand.start() + a, cand.start() + b), n) for a, b, n in found]
    return [(a, b) for a, b, n in spans if _phone_ok(text, a, b, n)], reads


def _balanced(text: str, a: int, b: int) -> tuple[int, int]:
    """The span without an unpaired bracket at its ends: "01440 783281" of "(01440 783281)"."""
    if text[a] == "(" and text.count("(", a, b) > text.count(")", a, b):
        a += 1
    if text[b - 1] == ")" and text.count(")", a, b) > text.count("(", a, b):
        b -= 1
    return a, b


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


def find(text: str, lang: str | None = None, url: str | None = None) -> list[tuple[int, int, str]]:
    """The spans (start, end, kind) of personal data in ``text``, not overlapping, in order. ``lang`` (the doc's
    language code) and ``url`` choose the regions phone numbers are read in (:func:`regions`)."""
    spans: list[tuple[int, int, str]] = []
    taken = _Taken()

    def put(a: int, b: int, kind: str) -> None:
        if taken.free(a, b):
            taken.add(a, b)
            spans.append((a, b, kind))

    for kind, rx, ok in (("email", EMAIL, _email_ok), ("ipv6", IPV6, _ipv6_ok), ("ipv4", IPV4, _ipv4_ok)):
        for m in rx.finditer(text) if _MAY_HOLD[kind].search(text) else ():
            if ok(text, m):
                put(m.start(), m.end(), kind)
    regs, reads_left = None, MATCHER_READS
    for cand in PHONE_CANDIDATE.finditer(text) if _MAY_HOLD["phone"].search(text) else ():
        if taken.free(cand.start(), cand.end()):
            regs = regs or regions(lang, url)
            found, reads = _phones(text, cand, regs, reads_left)
            reads_left -= reads
            for a, b in found:
                put(a, b, "phone")
    return sorted(spans)


def scrub(text: str, lang: str | None = None, url: str | None = None) -> tuple[str, Counter]:
    """``text`` with every span of :func:`find` replaced by its kind's placeholder, and the count per kind."""
    spans = find(text, lang, url)
    if not spans:
        return text, Counter()
    out, at = [], 0
    for s, e, kind in spans:
        out += [text[at:s], PLACEHOLDERS[kind]]
        at = e
    out.append(text[at:])
    return "".join(out), Counter(kind for _, _, kind in spans)
