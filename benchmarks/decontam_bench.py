"""The decontaminate stage's rules (``pipelines.data.decontaminate``) before and after issue 46, on the labelled set,
in one run.

* **Corpus**: the labelled docs (``data/decontam/labelled.jsonl``, built and documented by
  ``data/decontam/make_labelled.py``: contaminated docs, each holding an eval item with its answer or a 13-word run
  of it, and clean docs holding benchmark-like prose) plus, unless ``--no-web``, the 1,414 bundled web docs
  (``data/sample``, clean) as the rest of the corpus the common n-grams are counted over.
* **Items**: the default ``eval.tasks`` (the ``llmp_*`` slices in ``data/eval``) and ``eval.reference``, read
  through lm-eval's task objects as the stage reads them.
* **Rules**: ``before``: a short question alone is evidence (``question_alone=evidence``) and a short stock phrase is
  common only above ``common_min_docs`` docs (``common_min_docs_short=10``): the rules as they were;
  ``after``: the defaults (a short question needs its answer after it; a whole short item in more than 2 docs is a
  stock phrase). Both through :func:`~pipelines.data.decontaminate.decontaminate_texts`, the stage's kernel without
  Spark (the stage counts and decides with the same functions on Spark).
* **Printed**: recall (contaminated docs removed), false-removal rate (clean docs removed) and precision
  (contaminated docs of those removed) for each, removals per kind, the web docs removed, the docs with a short
  question alone (reported), and the seconds each pass took (both passes: counting, deciding; one process).

    python benchmarks/decontam_bench.py [--no-web] [--show]   → var/bench/decontam.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "data" / "decontam"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import make_labelled  # noqa: E402
from pipelines.data import decontaminate as dc  # noqa: E402
from pipelines.manifest import atomic_write_text  # noqa: E402
from pipelines.spec import DecontaminateCfg, load_spec  # noqa: E402

WEB = [ROOT / "data" / "sample" / n for n in ("c4_en_train_1k.jsonl.gz", "cc_wet_2019_30_sample.jsonl.gz")]
RULES = {"before": DecontaminateCfg(question_alone="evidence", common_min_docs_short=10), "after": DecontaminateCfg()}


def web_docs() -> list[str]:
    out = []
    for path in WEB:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            out += [json.loads(line).get("text") or "" for line in f]
    return out


def measure(records: list[dict], web: list[str], items: dict, cfg: DecontaminateCfg) -> dict:
    """The labelled set's score under ``cfg``, with ``web`` as the rest of the corpus."""
    t = time.perf_counter()
    decisions, common = dc.decontaminate_texts([r["text"] for r in records] + web, items, cfg)
    seconds = time.perf_counter() - t
    removed = [d.reason is not None for d in decisions]
    out = make_labelled.score(records, removed[:len(records)])
    out.update(web_removed=sum(removed[len(records):]), web=len(web), seconds=round(seconds, 2),
               question_only_docs=sum(bool(d.question_only) for d in decisions), common_ngrams=len(common),
               missed=[r["id"] for r, g in zip(records, removed) if r["contaminated"] and not g],
               false=[r["id"] for r, g in zip(records, removed) if not r["contaminated"] and g])
    return out


def table(res: dict) -> str:
    """The Markdown table docs/data.md carries."""
    b, a = res["before"], res["after"]
    lines = ["| docs | kind | n | removed before | removed after |", "|---|---|---|---|---|"]
    for kind, (_, n, bad) in a["kinds"].items():
        lines.append(f"| {'contaminated' if bad else 'clean'} | `{kind}` | {n} | {b['kinds'][kind][0]} | "
                     f"{a['kinds'][kind][0]} |")
    if a["web"]:
        lines.append(f"| clean | bundled web docs | {a['web']} | {b['web_removed']} | {a['web_removed']} |")
    lines.append(f"| **recall** | contaminated removed | {a['contaminated']} | **{b['recall']:.3f}** | "
                 f"**{a['recall']:.3f}** |")
    lines.append(f"| **false removals** | clean removed | {a['clean']} | **{b['false_removal']:.3f}** | "
                 f"**{a['false_removal']:.3f}** |")
    lines.append(f"| **precision** | contaminated of removed | | **{b['precision']:.3f}** | **{a['precision']:.3f}** |")
    lines.append(f"| reported | docs with a short question alone | | {b['question_only_docs']} | "
                 f"{a['question_only_docs']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-web", action="store_true", help="the labelled docs alone as the corpus")
    ap.add_argument("--show", action="store_true", help="list the docs each rule set gets wrong")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "decontam.json"))
    args = ap.parse_args(argv)
    records = make_labelled.load()
    web = [] if args.no_web else web_docs()
    items = dc.eval_items(load_spec(None, [], env={}))[0]
    res = {name: measure(records, web, items, cfg) for name, cfg in RULES.items()}
    print(table(res))
    for name, r in res.items():
        print(f"{name}: {r['seconds']} s for {len(records) + len(web)} docs; {r['common_ngrams']} common n-gram(s)")
        if args.show:
            print(f"  missed: {r['missed']}\n  removed clean: {r['false']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
