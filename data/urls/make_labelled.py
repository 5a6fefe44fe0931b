"""Builds the labelled set of hard URL cases for the URL step (pipelines/data/urlfilter.py): the block lists in
``data/urls/lists/`` and ``data/urls/labelled.jsonl``, one case a line:
``{"url", "host", "block", "form"}``.

How it is built: every case below is written by hand, with the host a browser reaches for it (``host``: what
``new URL(url).hostname`` gives, ``http://`` put in front of a URL without a scheme, as a browser's address bar
does; null when a browser refuses the URL) and whether a URL filter should remove it under the lists (``block``):
a URL whose host is a listed domain or under one, under a ``*.`` line's domain (not the domain itself), a name of
a hosts-file line, or an IP address listed in any of its forms; or whose host (without a leading ``www.``) and path
start with a UT1 ``urls`` line at a ``/``. Names are made up, under real public suffixes (com, de, co.uk, …) so
that a filter that looks domains up by their registered domain (DataTrove's, through tldextract) is measured on
parsing, not on suffixes it does not know. Twenty ordinary URLs from the bundled C4 sample (none on the lists) are
the ordinary traffic. IDN hosts are written in punycode here with the ``idna`` package (IDNA 2008 / UTS #46,
not the parser under test).

    python data/urls/make_labelled.py             # writes the lists and labelled.jsonl (deterministic)
    python data/urls/make_labelled.py --chromium  # also checks every case's host with Chromium's own URL parser

``--chromium`` (Playwright and a Chromium binary) parses each URL with ``new URL()`` in Chromium (its URL parser is
not ada) and fails on any case whose host differs from the one written here.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

import idna

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def puny(host: str) -> str:
    return idna.encode(host, uts46=True).decode()


BUCHER, MUNCHEN, STRASSE = puny("bücher-sperre.de"), puny("münchen-sperre.de"), puny("straße-sperre.de")

LISTS = {
    "domains": f"""# UT1 "domains" style: a domain blocks itself and every host under it
blocked-site.com
bücher-sperre.de
{MUNCHEN}
straße-sperre.de
Casino-Example.NET.
.leading-dot.info
sub.partial-block.co.uk
10.66.0.1
*.wild-card.org
""",
    "urls": """# UT1 "urls" style: host/path, no scheme
free-hosting.com/baduser
www.pages-host.net/bad/section
forum-site.org/viewtopic.php?t=666
""",
    "hosts": """# a hosts file
127.0.0.1 localhost
0.0.0.0 tracker-ads.com
127.0.0.1 malware-cdn.net another-bad.org   # two names on a line
::1 ipv6-listed.net
""",
}

B = "blocked-site.com"
# (url, host a browser reaches, block, form)
CASES: list[tuple[str, str | None, bool, str]] = [
    # a listed domain, written in every way a browser reads as that host
    (f"https://{B}/", B, True, "plain"),
    (f"http://www.{B}/page", f"www.{B}", True, "subdomain"),
    (f"https://a.b.c.{B}/x", f"a.b.c.{B}", True, "deep subdomain"),
    ("HTTPS://BLOCKED-SITE.COM/A", B, True, "upper case"),
    (f"http://{B}./", f"{B}.", True, "trailing dot"),
    (f"http://{B}.:443/x", f"{B}.", True, "trailing dot and port"),
    (f"http://{B}:8080/", B, True, "port"),
    (f"http://{B}:80/", B, True, "default port"),
    (f"http://user:pass@{B}/", B, True, "user info"),
    (f"http://evil.example.org@{B}/", B, True, "user info that looks like a host"),
    (f"http://{B}\\page", B, True, "backslash after the host"),
    (f"http:\\\\{B}\\dir\\page", B, True, "backslashes for slashes"),
    (f"http://{B}\\@evil.example.org/", B, True, "backslash, then what urllib reads as user info"),
    ("http://blocked-site\u3002com/", B, True, "ideographic full stop U+3002"),
    ("http://blocked-site\uff0ecom/", B, True, "fullwidth full stop U+FF0E"),
    ("http://blocked-site\uff61com/", B, True, "halfwidth ideographic full stop U+FF61"),
    ("http://\uff42\uff4c\uff4f\uff43\uff4b\uff45\uff44-\uff53\uff49\uff54\uff45.com/", B, True, "fullwidth letters"),
    ("http://\uff22\uff2c\uff2f\uff23\uff2b\uff25\uff24\uff0d\uff33\uff29\uff34\uff25\uff0e\uff23\uff2f\uff2d/", B,
     True, "fullwidth capitals, hyphen and dot"),
    ("http://\U0001d41b\U0001d425\U0001d428\U0001d41c\U0001d424\U0001d41e\U0001d41d-site.com/", B, True,
     "mathematical bold letters"),
    ("http://\u24d1locked-site.com/", B, True, "circled letter"),
    ("http://blocked\u00ad-site.com/", B, True, "soft hyphen (mapped to nothing)"),
    ("http://blocked-site%2Ecom/", B, True, "%-escaped dot"),
    ("http://%62locked-site.com/", B, True, "%-escaped letter"),
    ("http://%62%6c%6f%63%6b%65%64-site.com/", B, True, "%-escaped word"),
    (f" https://{B}/ ", B, True, "spaces around"),
    ("https://blocked-\tsite.com/", B, True, "tab inside (removed)"),
    (f"//{B}/x", B, True, "protocol-relative"),
    (f"http:{B}/x", B, True, "no slashes after the scheme"),
    (f"http:/{B}/x", B, True, "one slash after the scheme"),
    (f"http:///{B}/x", B, True, "three slashes after the scheme"),
    (f"http://{B}?q=1", B, True, "query, no path"),
    (f"http://{B}#top", B, True, "fragment, no path"),
    (f"http://{B}#@evil.example.org", B, True, "fragment that looks like user info"),
    (f"http://{B}?@evil.example.org", B, True, "query that looks like user info"),
    (f"ftp://{B}/file.txt", B, True, "ftp"),
    (f"wss://{B}/socket", B, True, "wss"),
    # without a scheme (a browser's address bar puts http:// in front)
    (B, B, True, "no scheme"),
    (f"{B}/page", B, True, "no scheme, path"),
    (f"www.{B}/page?x=1", f"www.{B}", True, "no scheme, subdomain"),
    ("BLOCKED-SITE.COM:8080/x", B, True, "no scheme, port"),
    (f"{B}?q=1", B, True, "no scheme, query"),
    ("bücher-sperre.de/katalog", BUCHER, True, "no scheme, IDN"),
    # IDN: listed in Unicode, met in punycode, and the other way round
    ("http://bücher-sperre.de/", BUCHER, True, "IDN"),
    (f"http://{BUCHER}/", BUCHER, True, "IDN listed in Unicode, URL in punycode"),
    ("http://BÜCHER-SPERRE.DE/", BUCHER, True, "IDN upper case"),
    ("http://www.bücher-sperre.de/", f"www.{BUCHER}", True, "IDN subdomain"),
    ("http://bu\u0308cher-sperre.de/", BUCHER, True, "IDN decomposed (u + combining diaeresis)"),
    ("http://b%C3%BCcher-sperre.de/", BUCHER, True, "IDN %-escaped UTF-8"),
    ("http://\uff42\u00fc\uff43\uff48\uff45\uff52-sperre.de/", BUCHER, True, "IDN with fullwidth letters"),
    ("http://münchen-sperre.de/", MUNCHEN, True, "IDN listed in punycode, URL in Unicode"),
    ("http://MÜNCHEN-SPERRE.DE/x", MUNCHEN, True, "IDN listed in punycode, URL upper case"),
    (f"http://{MUNCHEN}/", MUNCHEN, True, "punycode both"),
    ("http://straße-sperre.de/", STRASSE, True, "sharp s (kept: UTS #46 non-transitional)"),
    (f"http://{STRASSE}/", STRASSE, True, "sharp s in punycode"),
    ("http://strasse-sperre.de/", "strasse-sperre.de", False, "ss is another host than ß (IDNA 2003 mapped it)"),
    ("http://bucher-sperre.de/", "bucher-sperre.de", False, "IDN without its diacritic is another host"),
    # case and trailing dot in the list line
    ("http://casino-example.net/", "casino-example.net", True, "listed with capitals and a trailing dot"),
    ("http://www.casino-example.net./", "www.casino-example.net.", True, "listed with a trailing dot, URL too"),
    ("http://casino-example.network/", "casino-example.network", False, "listed name is a prefix of the TLD"),
    ("http://casino-example.net.evil.example.org/", "casino-example.net.evil.example.org", False,
     "listed name as a subdomain of another"),
    # a leading dot (Squid's form) and a listed subdomain
    ("http://leading-dot.info/", "leading-dot.info", True, "listed with a leading dot"),
    ("http://x.leading-dot.info/", "x.leading-dot.info", True, "under a line with a leading dot"),
    ("http://sub.partial-block.co.uk/", "sub.partial-block.co.uk", True, "listed subdomain"),
    ("http://x.sub.partial-block.co.uk/", "x.sub.partial-block.co.uk", True, "under a listed subdomain"),
    ("http://partial-block.co.uk/", "partial-block.co.uk", False, "parent of a listed subdomain"),
    ("http://other.partial-block.co.uk/", "other.partial-block.co.uk", False, "sibling of a listed subdomain"),
    # *.domain: hosts under it, not the domain
    ("http://www.wild-card.org/", "www.wild-card.org", True, "*. line, subdomain"),
    ("http://a.b.wild-card.org/", "a.b.wild-card.org", True, "*. line, deep subdomain"),
    ("http://WWW.WILD-CARD.ORG./", "www.wild-card.org.", True, "*. line, upper case, trailing dot"),
    ("http://wild-card.org/", "wild-card.org", False, "*. line does not take the domain itself"),
    ("http://notwild-card.org/", "notwild-card.org", False, "*. line, look-alike"),
    # an IPv4 address, in the forms a browser reads as it
    ("http://10.66.0.1/", "10.66.0.1", True, "IPv4"),
    ("http://0x0a.0x42.0.1/", "10.66.0.1", True, "IPv4 in hex"),
    ("http://012.0102.0.01/", "10.66.0.1", True, "IPv4 in octal"),
    ("http://172097537/", "10.66.0.1", True, "IPv4 as one number"),
    ("http://10.66.1/", "10.66.0.1", True, "IPv4 with three parts"),
    ("http://10.66.0.1.:8080/x", "10.66.0.1", True, "IPv4 with a trailing dot and port"),
    ("10.66.0.1/page", "10.66.0.1", True, "IPv4, no scheme"),
    ("http://10.66.0.10/", "10.66.0.10", False, "another IPv4"),
    ("http://110.66.0.1/", "110.66.0.1", False, "IPv4 that ends with the listed one"),
    ("http://10.66.0.1.evil.example.org/", "10.66.0.1.evil.example.org", False, "listed IPv4 as labels of a name"),
    ("http://[2001:db8::1]/", "[2001:db8::1]", False, "IPv6 literal"),
    # hosts-file lines
    ("http://tracker-ads.com/pixel.gif", "tracker-ads.com", True, "hosts line"),
    ("tracker-ads.com/x", "tracker-ads.com", True, "hosts line, no scheme"),
    ("https://malware-cdn.net/", "malware-cdn.net", True, "hosts line, first of two names"),
    ("https://another-bad.org/", "another-bad.org", True, "hosts line, second of two names"),
    ("https://ipv6-listed.net/", "ipv6-listed.net", True, "hosts line with an IPv6 address"),
    ("http://TRACKER-ADS.COM./", "tracker-ads.com.", True, "hosts line, upper case, trailing dot"),
    ("http://not-tracker-ads.com/", "not-tracker-ads.com", False, "hosts line, look-alike"),
    ("http://0.0.0.0.example.org/", "0.0.0.0.example.org", False, "a hosts line's address is not a name"),
    # UT1 urls lines (host/path)
    ("http://free-hosting.com/baduser", "free-hosting.com", True, "urls line"),
    ("http://free-hosting.com/baduser/", "free-hosting.com", True, "urls line, trailing slash"),
    ("https://free-hosting.com/baduser/page.html", "free-hosting.com", True, "urls line, page under it"),
    ("http://www.free-hosting.com/baduser/x", "www.free-hosting.com", True, "urls line, www."),
    ("http://free-hosting.com/BadUser/", "free-hosting.com", True, "urls line, case (squidGuard lower-cases)"),
    ("http://free-hosting.com/%62aduser", "free-hosting.com", True, "urls line, %-escaped path"),
    ("http://free-hosting.com/x/../baduser", "free-hosting.com", True, "urls line, dot segments"),
    ("http://free-hosting.com\\baduser\\x", "free-hosting.com", True, "urls line, backslashes"),
    ("free-hosting.com/baduser?x=1", "free-hosting.com", True, "urls line, no scheme, query"),
    ("http://FREE-HOSTING.COM./baduser", "free-hosting.com.", True, "urls line, host upper case, trailing dot"),
    ("http://pages-host.net/bad/section/a", "pages-host.net", True, "urls line with www., URL without"),
    ("http://www2.pages-host.net/bad/section", "www2.pages-host.net", True, "urls line with www., URL with www2."),
    ("http://forum-site.org/viewtopic.php?t=666", "forum-site.org", True, "urls line with a query"),
    ("http://free-hosting.com/baduser2", "free-hosting.com", False, "urls line, not at a /"),
    ("http://free-hosting.com/gooduser", "free-hosting.com", False, "urls line, another path"),
    ("http://free-hosting.com/", "free-hosting.com", False, "urls line, the host's root"),
    ("http://free-hosting.com/page?u=/baduser", "free-hosting.com", False, "urls line's path in the query"),
    ("http://other.example.org/free-hosting.com/baduser", "other.example.org", False, "urls line as a path"),
    ("http://sub.free-hosting.com/baduser", "sub.free-hosting.com", False, "urls line, another subdomain"),
    ("http://pages-host.net/bad/sections", "pages-host.net", False, "urls line, longer last segment"),
    ("http://forum-site.org/viewtopic.php?t=6661", "forum-site.org", False, "urls line, another query"),
    # look-alikes of a listed domain: another host
    (f"http://not{B}/", f"not{B}", False, "prefix added"),
    ("http://blocked-site.co/", "blocked-site.co", False, "shorter TLD"),
    (f"http://{B}.evil.example.org/", f"{B}.evil.example.org", False, "listed name as a subdomain"),
    (f"http://{B}-evil.net/", f"{B}-evil.net", False, "suffix added"),
    (f"http://evil.example.org/{B}", "evil.example.org", False, "listed name in the path"),
    (f"http://evil.example.org/?u=http://{B}/", "evil.example.org", False, "listed URL in the query"),
    (f"http://evil.example.org#{B}", "evil.example.org", False, "listed name in the fragment"),
    (f"http://evil.example.org\\@{B}/", "evil.example.org", False, "backslash: the host is before it"),
    (f"http://{B}%2F@evil.example.org/", "evil.example.org", False, "%-escaped slash in the user info"),
    (f"http://{B}:x@evil.example.org/", "evil.example.org", False, "listed name as a user name"),
    ("http://blocked-site\u2024com/", None, False, "one dot leader U+2024: no host a browser opens"),
    (f"{B}.evil.example.org/page", f"{B}.evil.example.org", False, "no scheme, listed name as a subdomain"),
    (f"example.org/{B}", "example.org", False, "no scheme, listed name in the path"),
    (f"mailto:someone@{B}", None, False, "mailto: has no host"),
]


def ordinary(n: int = 20) -> list[tuple[str, str | None, bool, str]]:
    """Every 50th URL of the bundled C4 sample (real pages, none on the lists)."""
    out = []
    with gzip.open(ROOT / "data/sample/c4_en_train_1k.jsonl.gz", "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i % 50 == 0 and len(out) < n:
                url = json.loads(line)["url"]
                out.append((url, re.match(r"https?://([^/:?#]+)", url).group(1).lower(), False, "ordinary (C4 sample)"))
    return out


def chromium_hosts(urls: list[str]) -> list[str | None]:
    """``new URL(u).hostname`` in Chromium (``http://`` in front of a URL without a scheme); None where it throws."""
    import shutil

    from playwright.sync_api import sync_playwright

    js = """us => us.map(u => { try { return new URL(u).hostname } catch (e) { return null } })"""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                                    args=["--no-sandbox"])
        try:
            return browser.new_page().evaluate(js, urls)
        finally:
            browser.close()


def with_scheme(url: str) -> str:
    u = url.strip()
    return u if re.match(r"[a-zA-Z][a-zA-Z0-9+-]*:(?!\d)", u) else f"http://{u}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chromium", action="store_true", help="check every case's host with Chromium's URL parser")
    args = ap.parse_args(argv)
    cases = CASES + ordinary()
    if args.chromium:
        got = chromium_hosts([with_scheme(u) for u, *_ in cases])
        bad = [(u, h, g) for (u, h, *_), g in zip(cases, got) if (g or None) != h]
        for u, h, g in bad:
            print(f"host differs: {u!r}: written {h!r}, Chromium {g!r}", file=sys.stderr)
        if bad:
            return 1
        print(f"Chromium reads the host of all {len(cases)} cases as written")
    (HERE / "lists").mkdir(exist_ok=True)
    for name, text in LISTS.items():
        (HERE / "lists" / f"{name}.txt").write_text(text, encoding="utf-8")
    with open(HERE / "labelled.jsonl", "w", encoding="utf-8") as f:
        for url, host, block, form in cases:
            f.write(json.dumps({"url": url, "host": host, "block": block, "form": form}, ensure_ascii=False) + "\n")
    print(f"{len(cases)} cases ({sum(c[2] for c in cases)} to block) → {HERE / 'labelled.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
