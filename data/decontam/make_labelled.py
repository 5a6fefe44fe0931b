"""The labelled set for the decontaminate stage (``pipelines.data.decontaminate``): ``data/decontam/labelled.jsonl``,
written by this script (deterministic: the same file byte for byte on every run), and its scorer.

    python data/decontam/make_labelled.py            # writes data/decontam/labelled.jsonl, prints its counts
    python data/decontam/make_labelled.py --check    # exits 1 if the file on disk is not what this script writes

**Records** (one JSON object a line): ``id``, ``kind``, ``contaminated`` (true: the stage must remove the doc),
``item`` (``task:index`` of the eval item planted, index in the task's ``eval_docs`` order = the line of the
``data/eval`` file, or the paragraph of the reference set; null for a stock phrase) and ``text``: a web-like page,
prose from the bundled C4 sample (``data/sample``) before and after what was planted.

**What is contaminated**: a doc that holds an item's question or context together with its correct answer (in
lm-eval's prompt layout, as a "Q: … A: …" copy in other case and punctuation, as a numbered quiz with the choices
listed and the key, or as the context followed by its ending), or a run of 13 words or more of an item's own text
(a long HellaSwag context without its ending, a LAMBADA passage, a reference paragraph, a reference line with its
speaker: what GPT-3's 13-gram rule calls an overlap). **What is clean**: a short question (8–12 words) or a short
HellaSwag context with no answer after it (the two cases of issue 46: "Which best describes the structure of an
atom?", "A man is sitting on a roof. He"), the question followed by a wrong choice, a correct answer or ending alone
(without its question: ordinary text, under 13 words), and stock phrases that are reference items ("And they lived
happily ever after. The End!") closing several pages. Items shorter than 8 words are planted only in lm-eval's
layout, the one place the stage looks for them (``min_item_words``).

**Scoring** (:func:`score`): recall = contaminated docs removed / contaminated docs; false-removal rate = clean docs
removed / clean docs; precision = contaminated docs removed / docs removed; removals per kind too.
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.eval_sets import read_rows, reference_items  # noqa: E402

OUT = HERE / "labelled.jsonl"
EVAL = ROOT / "data" / "eval"
C4 = ROOT / "data" / "sample" / "c4_en_train_1k.jsonl.gz"
REFERENCE = [ROOT / "data" / "reference" / "tinystories_val_tail.txt",
             ROOT / "data" / "reference" / "tinyshakespeare_tail.txt"]  # eval.reference's default, in its order
SEED = 4605
STOCK = {"And they lived happily ever after. The End!": 10, 'The tutor said, "Let\'s pretend to be animals."': 5}
ATOM = "Which best describes the structure of an atom?"  # issue 46's cases: this ARC question, HellaSwag's item 0
ROOF = 0  # "A man is sitting on a roof. he"
FAR = 60  # words between a question and its answer in arc_answer_far (more than answer_window, 40)


def nwords(text: str) -> int:
    return len(re.findall(r"\w+", text))


class Prose:
    """Filler: sentences cut from the bundled C4 docs, drawn in a fixed order."""

    def __init__(self, rng: random.Random):
        with gzip.open(C4, "rt", encoding="utf-8") as f:
            self.docs = [json.loads(line)["text"] for line in f]
        self.rng = rng

    def __call__(self, chars: int = 300) -> str:
        text = " ".join(self.rng.choice(self.docs).split())
        cut = text[:chars].rfind(". ")
        return text[:cut + 1] if cut > 40 else text[:chars]


def arc() -> list[dict]:
    out = []
    for i, r in enumerate(read_rows(EVAL / "arc_easy_test.jsonl")):
        q = r["question"]
        choices = [(c["label"], c["text"]) for c in q["choices"]]
        answer = next(t for lab, t in choices if lab == r["answerKey"])
        out.append({"i": i, "stem": q["stem"], "answer": answer, "key": r["answerKey"], "choices": choices,
                    "wrong": [t for lab, t in choices if lab != r["answerKey"]], "n": nwords(q["stem"])})
    return out


def hellaswag() -> list[dict]:
    return [{"i": i, "label": r["activity_label"], "ctx": r["ctx"], "ending": r["endings"][int(r["label"])],
             "n": nwords(r["ctx"])} for i, r in enumerate(read_rows(EVAL / "hellaswag_val.jsonl"))]


def page(prose: Prose, planted: str, style: int) -> str:
    """``planted`` inside web-like prose, in one of four frames."""
    a, b = prose(), prose()
    return [f"{a}\n\n{planted}\n\n{b}", f"{a} {planted} {b}",
            f"Posted by guest_{style * 7 % 97}: {a} -- {planted} ... {b}", f"{planted}\n{b}\n\n{a}"][style % 4]


def contaminated_arc(prose: Prose, rng: random.Random, items: list[dict]) -> list[dict]:
    """ARC items with their answers: lm-eval's layout (short, 8–12-word and long stems), Q/A copies and quizzes."""
    short = [r for r in items if r["n"] < 8]
    mid = [r for r in items if 8 <= r["n"] <= 12 and r["stem"] != ATOM]
    long = [r for r in items if r["n"] >= 13]
    out = []
    for k, r in enumerate(rng.sample(short, 15) + rng.sample(mid, 20) + rng.sample(long, 10)):
        out.append(("arc_prompt", r, f"Question: {r['stem']}\nAnswer: {r['answer']}"))
    for k, r in enumerate(rng.sample(mid, 30) + rng.sample(long, 10)):
        stem = [r["stem"].upper(), r["stem"], r["stem"].lower()][k % 3]
        sep = ["Q:  {s}\nA: {a}.", "Q. {s} -- A. {a}", "{s}\nCorrect answer: {a}!"][k % 3]
        out.append(("arc_qa", r, sep.format(s=stem, a=r["answer"])))
    for k, r in enumerate(rng.sample(mid, 25) + rng.sample(long, 5)):
        listed = "\n".join(f"  {lab}. {t}" for lab, t in r["choices"])
        out.append(("arc_quiz", r, f"{k + 1}. {r['stem']}\n{listed}\nAnswer: {r['key']}"))
    for r in rng.sample(mid, 10):
        between = prose()
        while nwords(between) <= FAR:
            between += " " + prose()
        out.append(("arc_answer_far", r, f"{r['stem']} {between} So the answer is: {r['answer']}."))
    return [{"kind": kind, "item": f"llmp_arc_easy:{r['i']}", "text": page(prose, text, k)}
            for k, (kind, r, text) in enumerate(out)]


def contaminated_other(prose: Prose, rng: random.Random, hs: list[dict]) -> list[dict]:
    """HellaSwag contexts with their endings (lm-eval's layout, plain) and long contexts alone; LAMBADA passages;
    reference paragraphs and speaker lines."""
    short, long = [r for r in hs if 8 <= r["n"] <= 12 and r["i"] != ROOF], [r for r in hs if r["n"] >= 16]
    out = [("hs_prompt", f"llmp_hellaswag:{r['i']}", f"{r['label']}: {r['ctx']} {r['ending']}")
           for r in rng.sample(short, 20) + rng.sample(long, 10)]
    out += [("hs_ctx_ending", f"llmp_hellaswag:{r['i']}", f"{r['ctx']} {r['ending']}")
            for r in rng.sample(short, 20) + rng.sample(long, 10)]
    out += [("hs_long_ctx", f"llmp_hellaswag:{r['i']}", r["ctx"]) for r in rng.sample(long, 15)]
    lambada = read_rows(EVAL / "lambada_openai_test.jsonl")
    out += [("lambada", f"llmp_lambada_openai:{i}", lambada[i]["text"]) for i in rng.sample(range(len(lambada)), 15)]
    ref = [p[0] for p in reference_items(REFERENCE)]
    paragraphs = [i for i, t in enumerate(ref) if nwords(t) >= 13]
    lines = [i for i, t in enumerate(ref) if 8 <= nwords(t) <= 12 and ":\n" in t]
    out += [("reference", f"reference:{i}", ref[i]) for i in rng.sample(paragraphs, 10)]
    out += [("reference_line", f"reference:{i}", ref[i]) for i in rng.sample(lines, 10)]
    return [{"kind": kind, "item": item, "text": page(prose, text, k)} for k, (kind, item, text) in enumerate(out)]


def clean(prose: Prose, rng: random.Random, items: list[dict], hs: list[dict]) -> list[dict]:
    """Benchmark-like prose that does not hold an item: short questions and contexts alone (the named cases ten
    times each), questions with a wrong choice, answers alone, stock phrases."""
    mid = [r for r in items if 8 <= r["n"] <= 12 and r["stem"] != ATOM]
    named = [r for r in items if r["stem"] == ATOM] * 10
    ask = ["My kid's homework asked: {q} We looked it up together.", "{q} That is where this week's lesson starts.",
           "A reader wrote in with a question. {q}", "Quick question for the forum: {q} Thanks in advance."]
    out = [("arc_question_alone", r, ask[k % 4].format(q=r["stem"])) for k, r in enumerate(named + rng.sample(mid, 30))]
    out += [("arc_question_wrong", r, f"{r['stem']} My first guess was {rng.choice(r['wrong']).lower()}, "
                                      "and I still think so.") for r in rng.sample(mid, 20)]
    out += [("arc_answer_alone", r, f"Fun fact: {r['answer']}.")
            for r in rng.sample([r for r in items if nwords(r["answer"]) < 13], 15)]
    docs = [{"kind": kind, "item": f"llmp_arc_easy:{r['i']}", "text": page(prose, text, k)}
            for k, (kind, r, text) in enumerate(out)]
    short = [r for r in hs if 8 <= r["n"] <= 12]
    frag = [hs[ROOF]] * 10 + rng.sample(short, 30)
    out = [("hs_fragment", f"llmp_hellaswag:{r['i']}", f"{r['ctx']} {prose(200)}") for r in frag]
    out += [("hs_prompt_alone", f"llmp_hellaswag:{r['i']}", f"{r['label']}: {r['ctx']}")
            for r in rng.sample([r for r in short if nwords(f"{r['label']} {r['ctx']}") < 13], 20)]
    out += [("hs_ending_alone", f"llmp_hellaswag:{r['i']}", r["ending"])
            for r in rng.sample([r for r in hs if nwords(r["ending"]) < 13], 15)]
    out += [("stock_phrase", None, f"{prose(400)} {phrase}") for phrase, n in STOCK.items() for _ in range(n)]
    docs += [{"kind": kind, "item": item, "text": page(prose, text, k) if kind != "stock_phrase" else text}
             for k, (kind, item, text) in enumerate(out)]
    return docs


def build() -> list[dict]:
    rng = random.Random(SEED)
    prose = Prose(rng)
    items, hs = arc(), hellaswag()
    bad = contaminated_arc(prose, rng, items) + contaminated_other(prose, rng, hs)
    good = clean(prose, rng, items, hs)
    n = Counter()
    out = []
    for label, docs in ((True, bad), (False, good)):
        for d in docs:
            n[d["kind"]] += 1
            out.append({"id": f"{d['kind']}-{n[d['kind']]}", "kind": d["kind"], "contaminated": label,
                        "item": d["item"], "text": d["text"]})
    return out


def dumps(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def load() -> list[dict]:
    return read_rows(OUT)


def score(records: list[dict], removed: list[bool]) -> dict:
    """{"recall", "false_removal", "precision" (contaminated docs of those removed), "contaminated", "clean", "kinds":
    {kind: [removed, docs, contaminated]}}."""
    kinds: dict[str, list] = {}
    for r, gone in zip(records, removed):
        k = kinds.setdefault(r["kind"], [0, 0, r["contaminated"]])
        k[0] += gone
        k[1] += 1
    bad = [g for r, g in zip(records, removed) if r["contaminated"]]
    good = [g for r, g in zip(records, removed) if not r["contaminated"]]
    return {"recall": sum(bad) / len(bad), "false_removal": sum(good) / len(good),
            "precision": sum(bad) / max(1, sum(bad) + sum(good)), "contaminated": len(bad), "clean": len(good),
            "kinds": kinds}


def counts(records: list[dict]) -> dict:
    return {"docs": len(records), "contaminated": sum(r["contaminated"] for r in records),
            "kinds": dict(Counter(r["kind"] for r in records))}


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
