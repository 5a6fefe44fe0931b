"""The labelled set for the PII step (``pipelines.data.pii``): ``data/pii/labelled.jsonl``, written by this script
(deterministic: the same file byte for byte on every run), and the scorer that the test and the benchmark use.

    python data/pii/make_labelled.py            # writes data/pii/labelled.jsonl, prints its counts
    python data/pii/make_labelled.py --check    # exits 1 if the file on disk is not what this script writes

**Records** (one JSON object a line): ``id``, ``split`` (``dev`` or ``held``), ``lang`` (what language ID gives the
filter stage), ``url`` (or null), ``text``, ``pii``: every span of personal data as ``[start, end, kind]`` (kind
``email``, ``ipv4``, ``ipv6``, ``phone``), and ``keep``: ``[start, end, category]`` for the hard negatives, values
that share a shape with personal data and must survive (categories: version, section, isbn, table, coordinate, id,
code, markup, prompt, filename, misc). Every character outside ``pii`` must survive, labelled in ``keep`` or not.

**Construction.** A doc is a short page in one of six locales (US, UK and Australian English, German, French, and
English with numbers from anywhere): a line of filler prose, then 3–5 sentences or lines, each drawn from a
template of one category (e-mail, IPv4, IPv6, phone, or one of the keep categories), its slots filled by generators,
filler prose between. Templates are written in the styles these values take on the web: prose, contact blocks,
``mailto:``/``tel:`` links, server logs, firewall lines, ``ip addr`` output, HTTP headers, code, HTML/CSS, shell
sessions, bibliographies, tables, maps. Half of the docs have a URL on the locale's TLD (the other half none, so the
regions come from the language alone).

**Two halves.** Every template list and every list of names, products and hosts is split by position: even
entries build the ``dev`` half (seed 1046), odd entries the ``held`` half (seed 2046). ``held`` has the same kinds
of value in contexts and with names that ``dev`` lacks, so a rule fitted to ``dev`` shows as a gap between the
halves. The rules were written looking at ``dev``; ``held`` was scored after that, once, and the general fixes its
misses called for were made then (docs/data.md gives both scores): it is no longer unseen.

**Synthetic values, reserved ranges.** Nothing here is a real person's: e-mail domains are ``example.com``,
``example.org``, ``example.net`` (RFC 2606) and hosts under them; IPv4 addresses are in the documentation ranges
192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24 (RFC 5737) or the private ranges 10/8, 172.16/12, 192.168/16
(RFC 1918); IPv6 addresses in 2001:db8::/32 (RFC 3849) or link-local fe80::/10. Phone numbers: US 555-0100 to
555-0199 under real area codes (set aside for fiction), UK Ofcom's drama ranges (020 7946 0xxx, 01xx 496 0xxx,
028 9649 6xxx), Australia ACMA's fictitious ranges (02 5550 xxxx, 03 7010 xxxx, 0491 570 006-156), France the
blocks 01 99 00, 02 61 91, 03 53 01, 04 65 71, 05 36 49 xx xx and Germany 030 23125, 040 66969, 069 90009,
089 99998, 0221 4710 xxx (the blocks ARCEP and the Bundesnetzagentur list, as we read them, for film and TV);
the last digits random; every one is a number libphonenumber calls valid. Names, product names, hosts, ISBNs (with valid
check digits), SKUs, coordinates and table figures are made up here.

**Scoring** (:func:`score`): a found span is a true positive only if it is exactly a labelled span of the same kind;
any other found span is a false positive (on a ``keep`` value or anywhere else); a labelled span not found is a
false negative. :func:`altered` counts the ``keep`` values that a found span overlaps, per category.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import random
import re
import sys
import uuid
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "labelled.jsonl"
SEEDS = {"dev": 1046, "held": 2046}
DOCS_PER_SPLIT = 170
KINDS = ("email", "ipv4", "ipv6", "phone")

FIRST = ["jane", "omar", "li", "sofia", "max", "amelie", "noah", "chloé", "ravi", "ines", "tom", "yuki", "lena",
         "pierre", "grace", "jonas", "aisha", "lucas", "emma", "kofi"]
LAST = ["doe", "schmidt", "martin", "okafor", "nguyen", "müller", "dupont", "garcia", "smith", "rossi", "kowalski",
        "bernard", "weber", "silva", "brown", "lefevre", "tanaka", "fischer"]
DEPTS = ["sales", "mail", "lists", "support", "hr", "press", "dev", "kontakt", "info", "billing", "research", "shop"]
HOSTS = ["web-1", "db-2", "build-7", "bastion", "cache-3", "api-4", "ci-runner", "backup", "edge-5", "worker-9",
         "staging", "mail-1"]
PRODUCTS = ["Microsoft Edge", "Google Chrome", "Firefox", "Opera", "Vivaldi", "Brave", "Thunderbird", "Visual Studio",
            ".NET Framework", "Acrobat Reader", "Zoom", "Teams", "Skype", "Office", "WebView2", "Outlook"]
CITIES = ["Berlin", "Hamburg", "Lyon", "Leeds", "Denver", "Perth", "Graz", "Nantes", "Bristol", "Austin", "Porto",
          "Malmö"]

# --------------------------------------------------------------------------- phone numbers, per locale
US_AREAS = ["201", "202", "212", "213", "305", "312", "415", "503", "617", "646", "702", "713", "718", "805", "917",
            "303"]
UK_BLOCKS = [("20", "7946 0"), ("161", "496 0"), ("113", "496 0"), ("121", "496 0"), ("117", "496 0"),
             ("131", "496 0"), ("141", "496 0"), ("151", "496 0"), ("118", "496 0"), ("28", "9649 6")]
DE_BLOCKS = [("30", "23125"), ("40", "66969"), ("69", "90009"), ("89", "99998"), ("221", "4710")]
FR_BLOCKS = ["1 99 00", "2 61 91", "3 53 01", "4 65 71", "5 36 49"]
AU_BLOCKS = [("2", "5550"), ("3", "7010")]


def _us(rnd) -> tuple[str, str, str]:
    a, x = rnd.choice(US_AREAS), f"01{rnd.randint(0, 99):02d}"
    return a, "555", x


def phone(rnd, locale: str, cued: bool) -> str:
    """A phone number as people write it in ``locale`` (``any``: international form of any of them); with
    ``cued`` (a cue word such as "Tel." stands before it) also the forms written without separators."""
    if locale == "any":
        locale = rnd.choice(["us", "uk", "de", "fr", "au"])
        return rnd.choice(_PHONE_FORMS[locale](rnd)[:3])
    forms = _PHONE_FORMS[locale](rnd)
    return rnd.choice(forms if cued else forms[:-1])  # the last form is the bare one


def _us_forms(rnd) -> list[str]:
    a, b, c = _us(rnd)
    return [f"+1 {a} {b} {c}", f"+1-{a}-{b}-{c}", f"+1{a}{b}{c}", f"({a}) {b}-{c}", f"{a}-{b}-{c}", f"{a}.{b}.{c}",
            f"{a} {b} {c}", f"1-{a}-{b}-{c}", f"+1 ({a}) {b}-{c}", f"{a}{b}{c}"]


def _uk_forms(rnd) -> list[str]:
    area, blk = rnd.choice(UK_BLOCKS)
    sub = blk + f"{rnd.randint(0, 999):03d}"
    a, b = sub.split(" ")
    return [f"+44 {area} {sub}", f"+44 (0){area} {sub}", f"+44{area}{a}{b}", f"0{area} {sub}", f"(0{area}) {sub}",
            f"0{area} {a}{b}" if len(area) == 2 else f"0{area} {sub}", f"0{area}-{a}-{b}", f"0{area}{a}{b}"]


def _de_forms(rnd) -> list[str]:
    area, blk = rnd.choice(DE_BLOCKS)
    sub = blk + f"{rnd.randint(0, 999):03d}"
    return [f"+49 {area} {sub}", f"+49 (0){area} {sub}", f"+49{area}{sub}", f"0{area}/{sub}", f"0{area} {sub}",
            f"(0{area}) {sub}", f"0{area}-{sub}", f"0{area} / {sub[:3]} {sub[3:5]} {sub[5:]}", f"0049 {area} {sub}",
            f"0{area}{sub}"]


def _fr_forms(rnd) -> list[str]:
    blk = rnd.choice(FR_BLOCKS)
    g = blk.split(" ") + [f"{rnd.randint(0, 99):02d}", f"{rnd.randint(0, 99):02d}"]
    return [f"+33 {' '.join(g)}", f"+33 (0){' '.join(g)}", f"+33{''.join(g)}", f"0{' '.join(g)}", f"0{'.'.join(g)}",
            f"0{'-'.join(g)}", "0" + "\u00a0".join(g), f"0{''.join(g)}"]


def _au_forms(rnd) -> list[str]:
    if rnd.random() < 0.3:
        sub = f"{rnd.randint(6, 156):03d}"  # 0491 570 006 to 156
        return [f"+61 491 570 {sub}", f"+61491570{sub}", f"+61 491 570 {sub}", f"0491 570 {sub}", f"0491 570 {sub}",
                f"0491570{sub}"]
    area, blk = rnd.choice(AU_BLOCKS)
    sub = f"{rnd.randint(0, 9999):04d}"
    return [f"+61 {area} {blk} {sub}", f"+61 {area} {blk}{sub}", f"+61{area}{blk}{sub}", f"(0{area}) {blk} {sub}",
            f"0{area} {blk} {sub}", f"0{area}{blk}{sub}"]


_PHONE_FORMS = {"us": _us_forms, "uk": _uk_forms, "de": _de_forms, "fr": _fr_forms, "au": _au_forms}

# --------------------------------------------------------------------------- e-mail and IP addresses


def email(rnd) -> str:
    f, l = rnd.choice(FIRST).replace("é", "e"), rnd.choice(LAST).replace("ü", "ue")
    local = rnd.choice([f"{f}.{l}", f"{f[0]}.{l}", f"{f}_{l}{rnd.randint(1, 99)}", f"{f}+{rnd.choice(DEPTS)}",
                        rnd.choice(DEPTS), f"{f}{l[0]}", f"{f}-{l}", f"{f[0].upper()}.{l.capitalize()}",
                        f"{l}.{f}{rnd.randint(70, 99)}"])
    dom = rnd.choice(["example.com", "example.org", "example.net", f"{rnd.choice(DEPTS)}.example.com",
                      f"{rnd.choice(DEPTS)}.example.org", "mail.example.net"])
    out = f"{local}@{dom}"
    return out.upper() if rnd.random() < 0.05 else out


def ipv4(rnd) -> str:
    r = rnd.randint
    return rnd.choice([f"192.0.2.{r(1, 254)}", f"198.51.100.{r(1, 254)}", f"203.0.113.{r(1, 254)}",
                       f"10.{r(0, 255)}.{r(0, 255)}.{r(1, 254)}", f"192.168.{r(0, 255)}.{r(1, 254)}",
                       f"172.{r(16, 31)}.{r(0, 255)}.{r(1, 254)}", f"198.51.100.{r(1, 254)}"])


def ipv6(rnd) -> str:
    groups = [rnd.randint(0, 0xFFFF) if rnd.random() < 0.6 else 0 for _ in range(6)]
    net = 0x20010DB8 if rnd.random() < 0.8 else 0xFE800000
    if net == 0xFE800000:
        groups[:2] = [0, 0]
    addr = ipaddress.IPv6Address((net << 96) | int("".join(f"{g:04x}" for g in groups), 16))
    form = rnd.random()
    if form < 0.15:
        return addr.exploded
    if form < 0.25:
        return addr.compressed.upper()
    if form < 0.32:
        return f"::ffff:{ipv4(rnd)}"
    return addr.compressed


# --------------------------------------------------------------------------- values that must survive


def _isbn13(rnd) -> str:
    d = [9, 7, 8] + [rnd.randint(0, 9) for _ in range(9)]
    d.append((10 - sum(x * (3 if i % 2 else 1) for i, x in enumerate(d)) % 10) % 10)
    s = "".join(map(str, d))
    return rnd.choice([s, f"{s[:3]}-{s[3]}-{s[4:7]}-{s[7:12]}-{s[12]}", f"{s[:3]}-{s[3:5]}-{s[5:9]}-{s[9:12]}-{s[12]}"])


def _isbn10(rnd) -> str:
    d = [rnd.randint(0, 9) for _ in range(9)]
    c = (11 - sum((10 - i) * x for i, x in enumerate(d)) % 11) % 11
    s = "".join(map(str, d)) + ("X" if c == 10 else str(c))
    return rnd.choice([s, f"{s[0]}-{s[1:4]}-{s[4:9]}-{s[9]}", f"{s[0]}-{s[1:3]}-{s[3:9]}-{s[9]}"])


def _table_row(rnd) -> str:
    def n(lo, hi, sep):
        return f"{rnd.randint(lo, hi):,}".replace(",", sep)
    sep = rnd.choice([" ", ",", ".", "\u00a0"])
    y = rnd.randint(1990, 2024)
    return rnd.choice([
        f"| {rnd.choice(CITIES)} | {n(100_000, 9_999_999, sep)} | {n(1_000, 99_999, sep)} | {rnd.randint(1, 99)} |",
        f"{y}   {n(1_000_000, 99_999_999, sep)}   {n(1_000_000, 99_999_999, sep)}",
        f"{y} {y + 1} {y + 2} {y + 3} {y + 4}",
        " ".join(str(rnd.randint(100, 999)) for _ in range(4)),
        " ".join(str(p) for p in range(y * 3 - 5000, y * 3 - 4994)),  # a counting run: page numbers
        f"{rnd.choice(CITIES)}\t0{rnd.randint(10, 99)} {rnd.randint(100, 999)} {rnd.randint(100, 999)}\t"
        f"{n(10_000, 999_999, sep)}",
        f"Total {n(1_000_000_000, 9_999_999_999, ' ')}"])


def _coordinate(rnd) -> str:
    lat, lon = rnd.uniform(-60, 70), rnd.uniform(-170, 170)
    d = rnd.choice([4, 5, 6])
    return rnd.choice([f"{lat:.{d}f}, {lon:.{d}f}", f"{lat:.{d}f} {lon:.{d}f}", f"({lat:.{d}f}, {lon:.{d}f})",
                       f"lat={lat:.{d}f}&lon={lon:.{d}f}", f"N {abs(lat):.{d}f} E {abs(lon):.{d}f}",
                       f"{abs(int(lat))}°{rnd.randint(0, 59)}′{rnd.randint(0, 59)}″N {abs(int(lon))}°"
                       f"{rnd.randint(0, 59)}′{rnd.randint(0, 59)}″W", f"{lat:.{d}f},{lon:.{d}f}"])


def _ident(rnd) -> str:
    r = rnd.randint
    return rnd.choice([f"SKU {r(100, 9999)}-{r(100, 9999)}-{r(1000, 9999)}", f"Art.-Nr. {r(10**12, 10**13 - 1)}",
                       f"EAN {r(10**12, 10**13 - 1)}", f"Order #{r(10**9, 10**10 - 1)}",
                       f"Part no. 0{r(10, 99)}-{r(100, 999)}-{r(1000, 9999)}", str(uuid.UUID(int=rnd.getrandbits(128))),
                       ":".join(f"{r(0, 255):02X}" for _ in range(6)),
                       f"DE{r(10, 99)} {r(1000, 9999)} {r(1000, 9999)} {r(1000, 9999)} {r(1000, 9999)} {r(10, 99)}",
                       f"INV-{r(2015, 2024)}-{r(0, 999999):06d}", f"Ticket #{r(10**6, 10**7 - 1)}",
                       f"{r(10000, 99999)}-{r(1000, 9999)}", f"Item # {r(100, 999)} {r(100, 999)} {r(1000, 9999)}",
                       f"1Z{r(100, 999)}AA1{r(10**9, 10**10 - 1)}", f"Kundennr. {r(10**9, 10**10 - 1)}"])


def _code(rnd) -> str:
    a, b = rnd.choice("ABCDWXQKV"), rnd.choice("ABCDWXQKV")
    words = ["cafe", "face", "dead", "beef", "bad", "ace", "fade", "c0de", "ba5e", "f00d", "b0a7", "d1ce"]

    def h():
        return rnd.choice(words)
    return rnd.choice([f"{a}@{b}.transpose()", f"{a.lower()}@{b}.t()", f"{a}@{b}.sum(axis=1)", f"{h()}::{h()}",
                       f"{h()}::{h()}()", f"{h().capitalize()}::{h().capitalize()}", f"std::vector<{h()}::{h()}>",
                       f"x@self.{rnd.choice(['weight', 'proj', 'bias'])}.T()",
                       f"seed = {rnd.randint(10**9, 10**10 - 1)}", f"0x{rnd.getrandbits(40):010x}",
                       f"{a}@{b}.reshape(-1, 1)", f"{h()}::{h()}::{h()}", f"timeout_ms={rnd.randint(10**8, 10**9)}"])


def _markup(rnd) -> str:
    name = rnd.choice(["logo", "hero", "icon-home", "avatar", "banner", "sprite", "badge", "cart"])
    ext = rnd.choice(["png", "jpg", "webp", "svg", "gif", "jpeg"])
    k, r = rnd.choice([2, 3]), rnd.randint
    return rnd.choice([f'<img src="/img/{name}@{k}x.{ext}" alt="">', f"background-image: url({name}@{k}x.{ext});",
                       f'srcset="{name}.{ext} 1x, {name}@{k}x.{ext} {k}x"', f'<div data-id="{r(10**9, 10**10 - 1)}">',
                       f'<meta name="generator" content="WordPress {r(4, 6)}.{r(0, 9)}.{r(0, 9)}.{r(1, 9)}">',
                       f'<a href="#sec-{r(1, 20)}.{r(1, 9)}.{r(1, 9)}.{r(1, 9)}">',
                       f'<td class="num">{r(100, 999)} {r(100, 999)} {r(100, 999)}</td>'])


def _prompt(rnd) -> str:
    u = rnd.choice(["deploy", "root", "admin", "ubuntu", "ops", "www", "git", "pi", "builder"])
    h = f"{rnd.choice(HOSTS)}.{rnd.choice(['internal', 'example.com', 'example.net', 'lan', 'corp.example.org'])}"
    return rnd.choice([f"{u}@{h}:~$", f"{u}@{h}:/var/log#", f"[{u}@{h} ~]$", f"[{u}@{h} /srv/app]#",
                       f"git clone git@{rnd.choice(['github.com', 'gitlab.com', 'bitbucket.org'])}:example/"
                       f"{rnd.choice(HOSTS)}.git",
                       f"ssh -p {rnd.randint(2000, 2999)} {u}@{h}", f"scp dump.sql {u}@{h}:/srv/backup/",
                       f"rsync -av ./site/ {u}@{h}:/var/www/", f"ssh -i ~/.ssh/id_ed25519 {u}@{h}",
                       f"{u}@{h}:~/app$", f"git remote add origin git@github.com:example/{rnd.choice(HOSTS)}.git"])


def _filename(rnd) -> str:
    name = rnd.choice(["logo", "photo", "icon", "avatar", "scan", "thumb", "screenshot"])
    r = rnd.randint
    y, mo, d = r(2015, 2024), r(1, 12), r(1, 28)
    return rnd.choice([f"{name}@2x.png", f"{name}@3x.jpg", f"{name}_{y}-{mo:02d}-{d:02d}_12-{r(10, 59)}-07.jpg",
                       f"IMG_{y}{mo:02d}{d:02d}_{r(100000, 235959)}.jpg", f"invoice-{r(10**9, 10**10 - 1)}.pdf",
                       f"setup-{r(1, 130)}.0.{r(0, 9)}.{r(0, 99)}.exe", f"release-{r(1, 130)}.0.0.0.zip",
                       f"{name}@2x.webp", f"{name}-{r(100, 999)}-{r(100, 999)}-{r(1000, 9999)}.pdf"])


def _version(rnd, product: str) -> str:
    r = rnd.randint
    m = r(4, 130)
    return rnd.choice([f"{product} {m}.0.0.0", f"{product} {m}.0.{r(1, 250)}.{r(1, 200)}",
                       f"{product} version {m}.{r(0, 9)}.{r(0, 99)}.{r(0, 250)}",
                       f"{product.replace(' ', '')}/{m}.0.0.0", f"v{r(1, 9)}.{r(0, 9)}.{r(0, 9)}.{r(0, 99)}",
                       f"Version={r(1, 9)}.0.0.0", f"build {r(1, 20)}.{r(0, 9)}.{r(0, 99)}.{r(1, 250)}",
                       f"{product} {r(1, 30)}.{r(1, 9)}.{r(0, 9)}.{r(1, 99)}"])


def _section(rnd) -> str:
    n = ".".join(str(rnd.randint(1, 25)) for _ in range(4))
    return rnd.choice([f"§ {n}", f"§{n}", f"Section {n}", f"section {n}", f"clause {n}", f"Abschnitt {n}",
                       f"Art. {n}", f"paragraph {n}", f"Requirement {n}", f"Tab. {n}", f"chapter {n}", f"Annex {n}"])


def _misc(rnd) -> str:
    r = rnd.randint
    y, mo, d = r(1990, 2024), r(1, 12), r(1, 28)
    return rnd.choice([f"{y}-{mo:02d}-{d:02d}", f"{d:02d}.{mo:02d}.{y}", f"{mo}/{d}/{y}",
                       f"{r(0, 23):02d}:{r(0, 59):02d}:{r(0, 59):02d}", f"${r(1, 9)},{r(100, 999)}.99",
                       f"{r(1, 9)} {r(100, 999)} €", f"{r(1, 9)}.{r(100, 999)}.{r(100, 999)},{r(10, 99)} €",
                       f"{y}-{y + r(1, 5)}", f"{d}.{mo}.{y} {r(0, 23)}:{r(10, 59)}"])


# --------------------------------------------------------------------------- templates
# A slot: {email} {ipv4} {ipv6} {phone} (a cue stands before it: {phone_cued}) {k:CATEGORY}; fillers {name} {host}
# {city} are plain text. Even entries of every list build the dev half, odd entries the held-out half.
POSITIVE = {
    "email": ["Questions? Write to {email}.", "Contact: {email}", "Send your CV to {email} by Friday.",
              '<a href="mailto:{email}">{name}</a>', "For press enquiries email {name} at {email}.",
              "Reply-To: {email}",
              "From: {name} <{email}>", "Please cc {email} and {email} on the thread.", "({email})",
              "{email} wrote:", "My address is {email} if you need it.", "E-Mail: {email}", "Courriel : {email}",
              "Mail {email} – we answer within a day.", "Sign-ups go to {email}; refunds to {email}.",
              "Maintainer: {name} <{email}>"],
    "ipv4": ['{ipv4} - - [12/Mar/2024:10:01:22 +0000] "GET /index.html HTTP/1.1" 200 5120',
             "Mar 12 10:01:22 {host} sshd[2314]: Failed password for root from {ipv4} port 52413 ssh2",
             "client {ipv4} connected", "IN=eth0 OUT= SRC={ipv4} DST={ipv4} PROTO=TCP SPT=443",
             "X-Forwarded-For: {ipv4}, {ipv4}", "My IP address is {ipv4}, is that blocked?", "ping {ipv4}",
             "Server {ipv4} is down again.", "Open http://{ipv4}:8080/admin in a browser.", "nameserver {ipv4}",
             "    inet {ipv4}/24 brd {ipv4} scope global eth0", "The router sits at {ipv4}.",
             "Blocked {ipv4} after 5 failed logins.", "[error] 1234#0: *5 connect() failed, client: {ipv4}",
             "Host {ipv4} answered in 12 ms.", "Set the gateway to {ipv4} and reboot."],
    "ipv6": ["    inet6 {ipv6}/64 scope global", "Connect to [{ipv6}]:443 over TLS.", "AAAA record: {ipv6}",
             "Accepted publickey for git from {ipv6} port 50122", "ping6 {ipv6}", "client: [{ipv6}]",
             "IPv6: {ipv6}", "Our resolver is {ipv6}.", "listen [{ipv6}]:80;", "The address {ipv6} was flagged.",
             "from {ipv6} (unknown)", "src={ipv6} dst={ipv6}"],
}
PHONE = {  # by the doc's language
    "en": ["Call us on {phone}.", "Phone: {phone}", "Tel. {phone_cued} (Mon–Fri)", "Questions? {phone}",
           "Reach {name} at {phone} or {email}.", "Fax {phone}", '<a href="tel:{phone_cued}">Call</a>',
           "Call {phone_cued} today.", "Or text {phone}.", "Hotline: {phone_cued}", "{name}: {phone}",
           "Book a table: {phone}, {city}", "Emergencies: {phone}; office {phone}.", "WhatsApp {phone_cued}",
           "{city} office\n{phone}", "Mobile {phone_cued}"],
    "de": ["Telefon: {phone_cued}", "Rufen Sie uns an: {phone}", "Tel.: {phone}, Fax: {phone}",
           "Sie erreichen uns unter {phone}.", "Tel. {phone_cued}", "Hotline {phone} (kostenlos)",
           "{name}, {city}, {phone}", "Mobil: {phone_cued}"],
    "fr": ["Tél. : {phone_cued}", "Appelez-nous au {phone}.", "Contact : {phone} ou {email}",
           "Téléphone {phone_cued}", "Fax : {phone}", "Standard : {phone} (9h–18h)", "{name} – {phone}",
           "Portable : {phone_cued}"],
}
KEEP = {
    "version": ["We tested on {k:version} without issues.", "User agent: Mozilla/5.0 (Windows NT 10.0; Win64; x64) "
                "AppleWebKit/537.36 (KHTML, like Gecko) {k:version} Safari/537.36", "Update to {k:version} now.",
                "Fixed in {k:version}.", "Requires {k:version} or later.", "{k:version} was released today.",
                "Installed: {k:version}", "System.Data, {k:version}, Culture=neutral"],
    "section": ["As required by {k:section} of the code.", "See {k:section} for the exceptions.",
                "{k:section} applies.",
                "Under {k:section}, the fee is waived.", "(cf. {k:section})", "Gemäß {k:section} gilt:"],
    "isbn": ["ISBN {k:isbn}", "{name}. A History. London: Penguin, 2003. {k:isbn}.", "Paperback, 320 pages, {k:isbn}",
             "ISBN-13: {k:isbn}", "Print {k:isbn} / e-book {k:isbn}", "{k:isbn} (hardcover)"],
    "table": ["{k:table}", "{k:table}\n{k:table}", "Population:\n{k:table}", "{k:table}\n"],
    "coordinate": ["The trailhead is at {k:coordinate}.", "GPS: {k:coordinate}", "Coordinates {k:coordinate} (WGS84)",
                   "https://maps.example.com/?{k:coordinate}", "Meet at {k:coordinate}, near the gate.",
                   "Position: {k:coordinate}"],
    "id": ["{k:id} is in stock.", "Your reference: {k:id}", "Please quote {k:id} in any reply.", "{k:id}",
           "Shipped ({k:id}).", "Tracking: {k:id}"],
    "code": ["    y = {k:code}", "return {k:code};", "`{k:code}`", ">>> {k:code}", "auto v = {k:code};",
             "out = torch.relu({k:code})"],
    "markup": ["{k:markup}", "<p>{k:markup}</p>", "  {k:markup}", "<li>{k:markup}</li>"],
    "prompt": ["{k:prompt} sudo systemctl restart nginx", "$ {k:prompt}", "{k:prompt} ls -la",
               "Run `{k:prompt}` first.", "{k:prompt} tail -f syslog", "{k:prompt}"],
    "filename": ["Download {k:filename}", "Attached: {k:filename} (2 MB)", "![photo]({k:filename})",
                 "Rename it to {k:filename}.", "{k:filename}", "saved as {k:filename}"],
    "misc": ["It happened on {k:misc}.", "Price: {k:misc} only", "Open {k:misc}.", "Updated {k:misc}",
             "Season {k:misc}"],
}
FILLER = {
    "en": ["Thanks for visiting our site.", "We have served the community since 1998.", "Opening hours are 9 to 5.",
           "Read the full story below.", "This page was last updated in 2023.", "Shipping takes 3 to 5 days.",
           "Parking is free for 2 hours.", "Our team of 12 is here to help."],
    "de": ["Willkommen auf unserer Seite.", "Seit 1998 für Sie da.", "Öffnungszeiten: Mo–Fr 9 bis 17 Uhr.",
           "Lesen Sie mehr dazu unten.", "Versand in 2 bis 3 Tagen.", "Impressum und Datenschutz."],
    "fr": ["Bienvenue sur notre site.", "Depuis 1998 à votre service.", "Ouvert du lundi au vendredi.",
           "Lisez la suite ci-dessous.", "Livraison sous 3 jours.", "Mentions légales."],
}
LOCALES = {  # lang, URL TLDs (None: no URL), phone locale
    "us": ("en", [".com", None]), "uk": ("en", [".co.uk", None]), "au": ("en", [".com.au", ".com.au"]),
    "de": ("de", [".de", None]), "fr": ("fr", [".fr", None]), "any": ("en", [".com", ".org", None]),
}
KEEP_GEN = {"isbn": lambda r: _isbn13(r) if r.random() < 0.5 else _isbn10(r), "table": _table_row,
            "coordinate": _coordinate, "id": _ident, "code": _code, "markup": _markup, "prompt": _prompt,
            "filename": _filename, "section": _section, "misc": _misc}


def half(items: list, split: str) -> list:
    """Even entries for ``dev``, odd for ``held``."""
    return items[split == "held"::2]


SLOT = re.compile(r"\{(email|ipv4|ipv6|phone|phone_cued|name|host|city|k:\w+)\}")
LINES = {"ipv4", "ipv6", "table", "code", "markup", "prompt"}  # categories that stand on lines of their own
WEIGHTS = {"email": 12, "ipv4": 10, "ipv6": 8, "phone": 26, "version": 5, "section": 4, "isbn": 4, "table": 4,
           "coordinate": 4, "id": 5, "code": 4, "markup": 3, "prompt": 4, "filename": 3, "misc": 4}


class Page:
    """A doc being written: its text so far and the labelled spans in it."""

    def __init__(self):
        self.text, self.pii, self.keep = "", [], []

    def add(self, s: str, label: tuple[str, str] | None = None) -> None:
        if label:
            (self.pii if label[0] == "pii" else self.keep).append([len(self.text), len(self.text) + len(s), label[1]])
        self.text += s


def fill(page: Page, template: str, rnd, split: str, locale: str) -> None:
    """Writes ``template`` onto ``page``, each slot filled (names, hosts, products from ``split``'s half)."""
    at = 0
    for m in SLOT.finditer(template):
        page.add(template[at:m.start()])
        slot = m.group(1)
        if slot in ("phone", "phone_cued"):
            page.add(phone(rnd, locale, slot == "phone_cued"), ("pii", "phone"))
        elif slot in ("email", "ipv4", "ipv6"):
            page.add({"email": email, "ipv4": ipv4, "ipv6": ipv6}[slot](rnd), ("pii", slot))
        elif slot.startswith("k:"):
            cat = slot[2:]
            value = _version(rnd, rnd.choice(half(PRODUCTS, split))) if cat == "version" else KEEP_GEN[cat](rnd)
            page.add(value, ("keep", cat))
        else:
            page.add(rnd.choice(half({"name": [f"{f.capitalize()} {l.capitalize()}" for f in FIRST for l in LAST[:3]],
                                      "host": HOSTS, "city": CITIES}[slot], split)))
        at = m.end()
    page.add(template[at:])


def make_doc(rnd, split: str, n: int) -> dict:
    locale = rnd.choice(sorted(LOCALES))
    lang, tlds = LOCALES[locale]
    tld = rnd.choice(tlds)
    url = f"https://www.example{tld}/{rnd.choice(['contact', 'about', 'blog/2023/notes', 'impressum', 'docs'])}" \
        if tld else None
    page, prev = Page(), None
    page.add(rnd.choice(half(FILLER[lang], split)))
    cats = list(WEIGHTS)
    for _ in range(rnd.randint(3, 5)):
        cat = rnd.choices(cats, [WEIGHTS[c] for c in cats])[0]
        page.add("\n" if cat in LINES or prev in LINES else " ")
        pool = PHONE[lang] if cat == "phone" else POSITIVE.get(cat) or KEEP[cat]
        fill(page, rnd.choice(half(pool, split)), rnd, split, locale)
        if rnd.random() < 0.3 and cat not in LINES:
            page.add(" " + rnd.choice(half(FILLER[lang], split)))
        prev = cat
    return {"id": f"{split}-{n:04d}", "split": split, "lang": lang, "url": url, "text": page.text,
            "pii": page.pii, "keep": page.keep}


# Cases a review found (issue 54: an address that starts with "_", code that has an address's shape, a version
# after "upgrade to", a section number before "above"), written as they were met, one page a half, after the drawn
# pages (which they leave as they were): (text, label or None)
REVIEWED = {
    "dev": [("Write to ", None), ("_admin@example.com", ("pii", "email")), (" for an account. In the notebook, ", None),
            ("x@W.weight", ("keep", "code")), (" is the projection.\nPlease upgrade to ", None),
            ("4.2.0.1", ("keep", "version")), (" before Friday; the steps are in ", None),
            ("2.1.3.4", ("keep", "section")), (" above.", None)],
    "held": [("Questions: ", None), ("_billing@example.org", ("pii", "email")), (". The layer computes ", None),
             ("h@V.bias", ("keep", "code")), (" once.\nWe will upgrade the cluster to ", None),
             ("3.1.0.2", ("keep", "version")), (" next week (see ", None), ("4.2.1.3", ("keep", "section")),
             (" below).", None)],
}


def reviewed_doc(split: str, n: int) -> dict:
    page = Page()
    for text, label in REVIEWED[split]:
        page.add(text, label)
    return {"id": f"{split}-{n:04d}", "split": split, "lang": "en", "url": None, "text": page.text,
            "pii": page.pii, "keep": page.keep}


def build() -> list[dict]:
    docs = []
    for split, seed in SEEDS.items():
        rnd = random.Random(seed)
        docs += [make_doc(rnd, split, n) for n in range(DOCS_PER_SPLIT)] + [reviewed_doc(split, DOCS_PER_SPLIT)]
    return docs


def dumps(docs: list[dict]) -> str:
    return "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs)


def load(split: str | None = None, path: Path = OUT) -> list[dict]:
    """The records of ``path`` (``split``: only ``dev`` or ``held``)."""
    docs = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    return [d for d in docs if split in (None, d["split"])]


def score(find, docs: list[dict]) -> dict:
    """Precision and recall per kind and ``all`` of ``find(doc) -> [(start, end, kind)]``: ``{kind: {precision,
    recall, tp, fp, fn}}``."""
    tp, fp, fn = Counter(), Counter(), Counter()
    for d in docs:
        gold = {tuple(s) for s in d["pii"]}
        got = set(map(tuple, find(d)))
        for s in got:
            (tp if s in gold else fp)[s[2]] += 1
        for s in gold - got:
            fn[s[2]] += 1
    res = {}
    for k in (*KINDS, "all"):
        t, p, n = ((sum(c.values()) for c in (tp, fp, fn)) if k == "all" else (tp[k], fp[k], fn[k]))
        res[k] = {"precision": t / (t + p) if t + p else 1.0, "recall": t / (t + n) if t + n else 1.0,
                  "tp": t, "fp": p, "fn": n}
    return res


def altered(find, docs: list[dict]) -> Counter:
    """Per keep category, the values that a span of ``find`` overlaps (and ``docs``: the docs with any)."""
    out = Counter()
    for d in docs:
        spans = find(d)
        hit = [c for s, e, c in d["keep"] if any(a < e and s < b for a, b, _ in spans)]
        out.update(hit)
        out["docs"] += bool(hit)
    return out


def counts(docs: list[dict]) -> dict:
    """Docs and labelled spans per kind and keep category, per split and ``all``."""
    out: dict = {"all": Counter()}
    for d in docs:
        for c in (out.setdefault(d["split"], Counter()), out["all"]):
            c["docs"] += 1
            c.update(k for _, _, k in d["pii"])
            c.update(f"keep:{k}" for _, _, k in d["keep"])
    return {s: dict(sorted(c.items())) for s, c in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs from what this script writes")
    args = ap.parse_args(argv)
    text = dumps(build())
    if args.check:
        same = OUT.exists() and OUT.read_text(encoding="utf-8") == text
        print(f"{OUT}: {'up to date' if same else 'differs from make_labelled.py'}")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(json.dumps(counts(load()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
