"""The PII step (``pipelines.data.pii``) beside DataTrove's ``PIIFormatter`` and ``phonenumbers`` alone, in one run.

* **Quality** on the labelled set ``data/pii/labelled.jsonl`` (its construction: ``data/pii/make_labelled.py``):
  precision and recall per kind (e-mail, IPv4, IPv6, phone), on the ``dev`` half (the rules were written looking
  at it), the ``held`` half, and both; and per category, how many of the values that must survive (versions,
  section numbers, ISBNs, …) a method altered. Methods: ours with the doc's language and URL (as the filter stage
  calls it), ours with the text alone (``find(text)``: the default regions), DataTrove 0.10.1's ``PIIFormatter``
  (its e-mail and IPv4 patterns; ``only_remove_public_ips=False``, since every address in the set is in a reserved
  range that its default would leave alone; it has no IPv6 and no phone rule), and libphonenumber's
  ``PhoneNumberMatcher`` alone (leniency ``VALID``, the same regions ours reads the doc in; phones only).
* **Speed**: docs/s of each over the bundled samples (``data/sample``, 1,414 web docs; the language is py3langid's,
  found before the clock starts), the best of ``--repeats`` passes taken in turn, one process; ours is ``scrub``
  (find and replace), DataTrove's ``PIIFormatter.format``.

    python benchmarks/pii_bench.py [--repeats 3]    → var/bench/pii.json (needs datatrove: `make bench` installs it)
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "data" / "pii"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import phonenumbers  # noqa: E402

import make_labelled  # noqa: E402
from pipelines.data import pii  # noqa: E402
from pipelines.manifest import atomic_write_text  # noqa: E402

KINDS = make_labelled.KINDS


def datatrove_formatter():
    from datatrove.pipeline.formatters import PIIFormatter

    return PIIFormatter(only_remove_public_ips=False)


def datatrove_spans(formatter, text: str) -> list[tuple[int, int, str]]:
    """The spans ``PIIFormatter.format`` replaces: its e-mail pattern, then its IP pattern and validator."""
    spans = [(m.start(), m.end(), "email") for m in formatter.emails_replacer.regex.finditer(text)]
    ok = formatter.ip_replacer.validator
    for m in formatter.ip_replacer.regex.finditer(text):
        if ok(m.group(0)) and not any(a < m.end() and m.start() < b for a, b, _ in spans):
            spans.append((m.start(), m.end(), "ipv4"))
    return spans


def phonenumbers_spans(text: str, regions: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """``PhoneNumberMatcher`` in each region (leniency VALID), the first region's number kept where they overlap."""
    spans: list[tuple[int, int, str]] = []
    for region in regions:
        for m in phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.VALID):
            if not any(a < m.end and m.start < b for a, b, _ in spans):
                spans.append((m.start, m.end, "phone"))
    return spans


def methods(formatter) -> dict:
    """name → find(doc) for a labelled record."""
    out = {"ours": lambda d: pii.find(d["text"], d["lang"], d["url"]),
           "ours, text only": lambda d: pii.find(d["text"]),
           "phonenumbers alone": lambda d: phonenumbers_spans(d["text"], pii.regions(d["lang"], d["url"]))}
    if formatter is not None:
        out["DataTrove PIIFormatter"] = lambda d: datatrove_spans(formatter, d["text"])
    return out


def quality(finders: dict, docs: list[dict]) -> dict:
    """Per half (dev, held, all) and method: the score per kind and the keep values altered per category."""
    res: dict = {"counts": make_labelled.counts(docs)}
    for half in ("dev", "held", "all"):
        part = [d for d in docs if half in ("all", d["split"])]
        res[half] = {name: {"score": make_labelled.score(f, part), "altered": dict(make_labelled.altered(f, part))}
                     for name, f in finders.items()}
    return res


def sample_docs() -> list[tuple[str, str | None, str | None]]:
    import py3langid

    docs = [json.loads(x) for f in ("c4_en_train_1k.jsonl.gz", "cc_wet_2019_30_sample.jsonl.gz")
            for x in gzip.open(ROOT / "data" / "sample" / f, "rt", encoding="utf-8") if x.strip()]
    texts = [d.get("text") if isinstance(d.get("text"), str) else "" for d in docs]
    return [(t, py3langid.classify(t)[0] if t.strip() else None, d.get("url")) for t, d in zip(texts, docs)]


def speed(formatter, docs: list, repeats: int) -> dict:
    """docs/s of each over ``docs`` (text, lang, url), the best of ``repeats`` passes."""
    runs = {"ours": lambda t, l, u: pii.scrub(t, l, u),
            "phonenumbers alone": lambda t, l, u: phonenumbers_spans(t, pii.regions(l, u))}
    if formatter is not None:
        runs["DataTrove PIIFormatter"] = lambda t, l, u: formatter.format(t)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):  # in turn, so that a busy moment of the machine weighs on each alike
        for name, f in runs.items():
            t0 = time.perf_counter()
            for t, lang, url in docs:
                f(t, lang, url)
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: round(len(docs) / s, 1) for name, s in best.items()}


def _pr(s: dict) -> str:
    if s["tp"] + s["fp"] + s["fn"] == 0:
        return "—"
    p = f"{s['precision']:.3f}" if s["tp"] + s["fp"] else "—"
    return f"{p} / {s['recall']:.3f}"


def table(res: dict) -> str:
    names = [n for n in ("ours", "ours, text only", "DataTrove PIIFormatter", "phonenumbers alone") if n in res["all"]]
    lines = ["| half | kind | spans | " + " | ".join(f"{n} P / R" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for half in ("dev", "held", "all"):
        for k in (*KINDS, "all"):
            n = res[half]["ours"]["score"][k]
            lines.append(f"| {half} | {k} | {n['tp'] + n['fn']} | "
                         + " | ".join(_pr(res[half][m]["score"][k]) for m in names) + " |")
    counts = res["counts"]["all"]
    cats = sorted(c.split(":", 1)[1] for c in counts if c.startswith("keep:"))
    lines += ["", "| values that must survive (both halves) | values | " + " | ".join(f"{n}: altered" for n in names)
              + " |", "|---|---|" + "---|" * len(names)]
    for c in (*cats, "docs"):
        total = counts["docs" if c == "docs" else f"keep:{c}"]
        lines.append(f"| {c} | {total} | " + " | ".join(str(res["all"][m]["altered"].get(c, 0)) for m in names) + " |")
    sp = res["speed"]
    lines += ["", f"| docs/s on data/sample ({res['sample_docs']} docs, one process) | "
              + " | ".join(sp) + " |", "|---|" + "---|" * len(sp), "| | " + " | ".join(f"{v:,.0f}" for v in sp.values())
              + " |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the samples; the best counts")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "pii.json"))
    args = ap.parse_args(argv)
    try:
        formatter = datatrove_formatter()
    except ImportError:
        formatter = None
        print("datatrove is not installed (`make bench` installs it): its column is left out", file=sys.stderr)
    res = quality(methods(formatter), make_labelled.load())
    docs = sample_docs()
    res["sample_docs"], res["speed"] = len(docs), speed(formatter, docs, args.repeats)
    print(table(res))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(res, indent=2))
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
