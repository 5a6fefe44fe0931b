"""A labelled sample for the PII step (pipelines.data.pii), built from templates with a fixed seed.

Method: sentences in the style of web text, each with one value drawn from a list: positives (e-mail addresses,
IPv4 and IPv6 addresses, phone numbers in the formats of the US, the UK, Germany, France, India and in
international form) whose span and kind are known, and hard negatives that share their shape with phone numbers
or IPs (dates, version numbers, prices, room and street numbers, times, ISBNs, order numbers, coordinates,
years, ratios). A found span counts as a true positive only if it is exactly a labelled span of the same kind.

    python tests/pii_sample.py        # prints precision and recall per kind
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

EMAILS = ["jane.doe@example.org", "J.Smith+news@mail.co.uk", "info@shop-42.de", "a_b-c@sub.domain.io",
          "contact@my-company.travel", "x9@y.fr", "first.last@uni.edu", "SALES@EXAMPLE.COM"]
IPV4 = ["10.0.0.12", "203.0.113.45", "192.168.1.254", "8.8.8.8", "172.16.254.1", "100.64.0.7"]
IPV6 = ["2001:db8:85a3::8a2e:370:7334", "fe80::1ff:fe23:4567:890a", "2001:0db8:0000:0000:0000:ff00:0042:8329",
        "2a00:1450:4001:81c::200e", "::ffff:c000:280", "::ffff:192.0.2.128"]
PHONES = ["+1 (415) 555-2671", "(212) 555-0147", "415-555-2671", "415.555.2671", "+44 20 7946 0958",
          "+49 (0) 30 12345678", "020 7946 0958", "+33 1 23 45 67 89", "+91 98765 43210", "+1-202-555-0191",
          "0171 1234567", "+61 2 9876 5432"]
CUED_PHONES = ["555-0123", "867-5309"]  # 7 digits: a phone only after a cue word
NEGATIVES = ["2024-01-15", "15.01.2024", "01/15/2024", "2019-2020", "v1.2.3.4", "version 10.0.19041.1",
             "Python 3.11.4", "$1,299.99", "€ 1.299,00", "1 299 €", "Room 1204", "Suite 300", "Apt. 4B",
             "12:30:45", "ISBN 978-3-16-148410-0", "ZIP 90210", "Order #1234567890", "in 1999 and 2005",
             "40.7128, -74.0060", "3.14159265", "16:9", "Chrome 120.0.6099.109", "1,000,000 people",
             "page 12-14", "1080p at 60 fps", "5 x 10 x 20 cm", "10.5.2", "3 - 2", "No. 5551234567",
             "a::b in C++", "Highway 101", "the 2020-21 season", "0.25 mg", "COVID-19", "A4 paper",
             # shapes met in the bundled web samples (c4_en_train_1k, cc_wet_2019_30): page runs, a date range
             "pages 1 2 3 4 5 6 7 8 9 10 11 12", "1256 1257 1258 1259 1260", "2007.05.04-2007", "CA 93241-2410",
             "1260 1261 1262 25232 results", "total 261 261 302 824", "population (2009) 2 920 000",
             "IBAN BE04 7360 1914 4531",
             # shapes a review found replaced: thousands, years, browser versions, code
             "1 500 000 000 people", "€ 2 500 000 000", "Year 1999 2004 2010", "2010-2015-2020",
             "Chrome/120.0.0.0", "Firefox 115.0.2.1", "section 1.2.3.4", "Face::Add"]

POS_TEMPLATES = ["Contact us at {v} for details.", "You can reach Jane on {v}.", "Reply to {v} before Friday",
                 "({v})", "Our office: {v}. Open 9 to 5.", "Details: {v}\nThanks."]
CUE_TEMPLATES = ["Call {v} now!", "Tel: {v}", "phone {v} or write."]
NEG_TEMPLATES = ["It happened on {v}.", "We used {v} in the test.", "Price: {v} only", "See {v} for more.",
                 "{v} was the answer."]


def sample(seed: int = 31, n: int = 600) -> list[tuple[str, list[tuple[int, int, str]]]]:
    """``n`` (text, labelled spans) pairs."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        r = rnd.random()
        if r < 0.45:
            kind, values, temps = rnd.choice([("email", EMAILS, POS_TEMPLATES), ("ipv4", IPV4, POS_TEMPLATES),
                                              ("ipv6", IPV6, POS_TEMPLATES), ("phone", PHONES, POS_TEMPLATES),
                                              ("phone", CUED_PHONES, CUE_TEMPLATES)])
            v, t = rnd.choice(values), rnd.choice(temps)
            at = t.index("{v}")
            out.append((t.format(v=v), [(at, at + len(v), kind)]))
        elif r < 0.55:  # two values in one text, one a negative
            v, kind = rnd.choice([(x, "email") for x in EMAILS] + [(x, "phone") for x in PHONES])
            neg = rnd.choice(NEGATIVES)
            text = f"On {neg} we wrote to {v}."
            at = text.index(v)
            out.append((text, [(at, at + len(v), kind)]))
        else:
            out.append((rnd.choice(NEG_TEMPLATES).format(v=rnd.choice(NEGATIVES)), []))
    return out


def score(find, data=None) -> dict:
    """Precision and recall per kind and overall of ``find(text) -> [(start, end, kind)]``."""
    from collections import Counter

    tp, fp, fn = Counter(), Counter(), Counter()
    for text, gold in data or sample():
        got = set(find(text))
        for s in got:
            (tp if s in gold else fp)[s[2]] += 1
        for s in gold:
            if s not in got:
                fn[s[2]] += 1
    kinds = sorted(set(tp) | set(fp) | set(fn))
    res = {}
    for k in kinds + ["all"]:
        t = sum(tp.values()) if k == "all" else tp[k]
        p = sum(fp.values()) if k == "all" else fp[k]
        n = sum(fn.values()) if k == "all" else fn[k]
        res[k] = {"precision": t / (t + p) if t + p else 1.0, "recall": t / (t + n) if t + n else 1.0,
                  "tp": t, "fp": p, "fn": n}
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pipelines.data.pii import find

    for k, v in score(find).items():
        print(f"{k:6} precision {v['precision']:.3f}  recall {v['recall']:.3f}  (tp {v['tp']}, fp {v['fp']}, fn {v['fn']})")
