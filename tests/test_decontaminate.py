"""Decontamination: training docs that carry an evaluation item are removed with the task that names it."""
from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from conftest import ROOT, c4_docs
from pipelines.data import decontaminate as dc
from pipelines.eval_sets import read_rows
from pipelines.spec import DecontaminateCfg
from test_tokenize import _filter_manifest

ARC, HS = ROOT / "data/eval/arc_easy_test.jsonl", ROOT / "data/eval/hellaswag_val.jsonl"
ATOM = "Which best describes the structure of an atom?"  # ARC-Easy item 4 (8 words); HellaSwag item 0 below
ROOF = "a man is sitting on a roof. He"
BEFORE = DecontaminateCfg(question_alone="evidence", common_min_docs_short=10)  # the rules before issue 46 item 5


def _contaminated_corpus() -> tuple[list[dict], dict[str, str]]:
    """1,000 clean C4 docs; 20 with an ARC-Easy question and its answer text, 20 with a HellaSwag context, each
    inside ordinary text (another case, other punctuation and spacing than the item's)."""
    rng = random.Random(3)
    clean = c4_docs(1000)
    docs = [{"id": f"clean-{i}", "text": d["text"]} for i, d in enumerate(clean)]
    truth = {}
    arc = [r for r in read_rows(ARC) if len(r["question"]["stem"].split()) >= 10][:20]
    for k, r in enumerate(arc):
        answer = next(c["text"] for c in r["question"]["choices"] if c["label"] == r["answerKey"])
        text = f"{clean[k]['text'][:300]}\n\nQ:  {r['question']['stem'].upper()}\nA: {answer}.\n\n{clean[k + 1]['text'][:300]}"
        docs.insert(rng.randrange(len(docs)), {"id": f"arc-{k}", "text": text})
        truth[f"arc-{k}"] = "contamination:llmp_arc_easy"
    hs = [r for r in read_rows(HS) if len(r["ctx"].split()) >= 16][:20]
    for k, r in enumerate(hs):
        text = f"Forum post #{k}. {clean[40 + k]['text'][:200]} -- {r['ctx']} ... {clean[60 + k]['text'][:200]}"
        docs.insert(rng.randrange(len(docs)), {"id": f"hs-{k}", "text": text})
        truth[f"hs-{k}"] = "contamination:llmp_hellaswag"
    return docs, truth


def test_forty_contaminated_docs_are_removed_with_their_task_and_no_clean_doc_is(home):
    docs, truth = _contaminated_corpus()
    filt = _filter_manifest(home, docs, files=3)
    out = home / "decon"
    r = subprocess.run([sys.executable, "-m", "pipelines.data.decontaminate", "--input-manifest", str(filt.path),
                        "--output", str(out), "--set", "services.spark_master=local[2]"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "decontaminate: 1040 docs → 1000 kept, 40 removed" in r.stdout
    m = json.loads((out / "manifest.json").read_text())
    removed = pq.read_table(out / "removed").to_pylist()
    kept = pq.read_table(out / "kept").to_pylist()
    assert {d["id"]: d["filter_reason"] for d in removed} == truth
    assert {d["id"] for d in kept} == {f"clean-{i}" for i in range(1000)}
    assert {d["text"] for d in kept} == {d["text"] for d in docs if d["id"].startswith("clean-")}  # untouched
    assert set(pq.read_table(out / "kept").column_names) == {"idx", "id", "text", "source"}  # what tokenize reads
    c, con = m["counts"], m["extra"]["contamination"]
    assert c["docs_in"] == c["kept"] + c["removed"] == 1040
    assert set(con) == {"llmp_arc_easy", "llmp_hellaswag", "llmp_lambada_openai", "reference"}
    for task, n in (("llmp_arc_easy", 20), ("llmp_hellaswag", 20), ("llmp_lambada_openai", 0), ("reference", 0)):
        assert con[task]["docs_removed"] == n and isinstance(con[task]["docs_removed"], int)
        assert con[task]["items_overlapping"] >= n and con[task]["ngram"] == 13
        assert con[task]["overlapping_kept"] == []  # nothing that overlaps reaches tokenize
    assert con["llmp_arc_easy"]["items"] == 500 and con["reference"]["items"] > 100
    # the same inputs: the stage is reused; the eval files are inputs of its key
    again = subprocess.run([sys.executable, "-m", "pipelines.data.decontaminate", "--input-manifest", str(filt.path),
                            "--output", str(out), "--set", "services.spark_master=local[2]"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and json.loads((out / "manifest.json").read_text())["finished"] == m["finished"]
    assert {i["uri"].rsplit("/", 1)[-1] for i in m["inputs"]} >= {"lm-eval:llmp_arc_easy", "tinystories_val_tail.txt"}


def test_the_kernel_matches_across_case_punctuation_and_short_items_and_cuts_spans():
    item = "The quick brown fox jumps over the lazy dog near the old river bank today"
    table, lengths, stats = dc.build_table({"t": [[item], ["too short to check"],
                                                   ["Eight words are enough for an item here"]]}, 13, 8)
    assert stats["t"] == {"items": 3, "items_too_short": 1} and lengths == [8, 13]
    cfg = DecontaminateCfg()
    order = ["t"]
    doc = "Intro text.  THE QUICK, brown fox -- jumps over the lazy dog near the old river bank! And more words after."
    assert dc.decide(doc, table, lengths, cfg, order)[:3] == ("contamination:t", doc, ["t:0"])
    assert dc.decide("eight WORDS are enough for an item, here.", table, lengths, cfg, order)[2] == ["t:2"]
    # twelve words of the item are not an overlap
    assert dc.decide("quick brown fox jumps over the lazy dog near the old river", table, lengths, cfg, order)[0] is None
    assert dc.decide("too short to check", table, lengths, cfg, order)[2] == []
    long_doc = "A " * 250 + doc + " Z" * 250
    reason, text, items, cut, _ = dc.decide(long_doc, table, lengths, DecontaminateCfg(mode="cut"), order)
    assert reason is None and cut and items == ["t:0"] and "quick" not in text.lower()
    # GPT-3's window: 200 characters on each side of the match go too (the text around it, 'Intro text.' included)
    assert "Intro text." not in text and "And more words after." not in text and len(text.split("\n")) == 2
    start, end = long_doc.index("THE QUICK"), long_doc.index("bank!") + len("bank")
    assert text.split("\n") == [long_doc[:start - 200].strip(), long_doc[end + 200:].strip()]
    assert dc.decide(doc, table, lengths, DecontaminateCfg(mode="cut"), order)[0] == "contamination:t"  # too little left
    # a doc the cuts leave in more than cut_max_pieces pieces is removed
    pieces = ("B " * 120).join([""] + [item + " filler" for _ in range(11)] + [""])
    assert dc.decide(pieces, table, lengths, DecontaminateCfg(mode="cut", cut_window_chars=0), order)[0] == \
        "contamination:t"
    assert dc.decide(pieces, table, lengths, DecontaminateCfg(mode="cut", cut_window_chars=0, cut_max_pieces=12),
                     order)[3] is True
    assert dc.decide(doc, table, lengths, DecontaminateCfg(mode="report"), order) == (None, doc, ["t:0"], False, [])


@pytest.mark.parametrize("mode", ["report"])
def test_report_mode_keeps_every_doc_and_says_which_items_reach_the_model(home, spark, mode):
    docs, truth = _contaminated_corpus()
    from pipelines.spec import load_spec

    spec = load_spec(None, [f"data.decontaminate.mode={mode}"], env={})
    m = dc.run(spec, _filter_manifest(home, docs[:300] + [d for d in docs if d["id"] in truth]), spark=spark)
    con = m.extra["contamination"]
    assert m.counts["removed"] == 0 and m.counts["kept"] == m.counts["docs_in"]
    assert con["llmp_arc_easy"]["overlapping_kept"] == con["llmp_arc_easy"]["overlapping"]
    assert len(con["llmp_arc_easy"]["overlapping_kept"]) >= 20 and con["llmp_arc_easy"]["docs_removed"] == 0


def test_short_arc_items_are_found_in_the_layout_the_evaluation_shows_them_in():
    """An ARC-Easy item whose stem is shorter than min_item_words is found as lm-eval renders it (Question: … Answer:
    …); before, only the run 'stem answer' was looked for, and this layout was missed."""
    from pipelines.spec import load_spec

    rows = read_rows(ARC)
    short = [r for r in rows if len(dc.words(r["question"]["stem"])) < 8]
    assert len(short) >= 20
    items = {"llmp_arc_easy": dc.eval_items(load_spec(None, ["eval.tasks=[llmp_arc_easy]"], env={}))[0]["llmp_arc_easy"]}
    table, lengths, stats = dc.build_table(items, 13, 8)
    cfg, order = DecontaminateCfg(), ["llmp_arc_easy"]
    for r in short:
        q = r["question"]
        answer = next(c["text"] for c in q["choices"] if c["label"] == r["answerKey"])
        doc = f"Practice quiz for grade 4.\n\nQuestion: {q['stem']}\nAnswer: {answer}\n\nMore questions below."
        reason, _, found, _, _ = dc.decide(doc, table, lengths, cfg, order)
        assert reason == "contamination:llmp_arc_easy" and f"llmp_arc_easy:{rows.index(r)}" in found, q["stem"]
    assert stats["llmp_arc_easy"]["items_too_short"] == 0


def test_an_ngram_common_in_the_corpus_is_not_evidence_and_is_reported(home, spark):
    """'And they lived happily ever after. The End!' is a reference item of its own (8 words): a corpus where many
    stories end that way loses none of them; a page that asks a short ARC question without its answer stays and is
    reported; a real copy of an item is still removed."""
    from pipelines.spec import load_spec

    clean = [{"id": f"clean-{i}", "text": d["text"]} for i, d in enumerate(c4_docs(300))]
    tales = [{"id": f"tale-{i}", "text": f"{clean[i]['text'][:400]} And they lived happily ever after. The End!"}
             for i in range(15)]
    asks = {"id": "asks", "text": f"{clean[16]['text'][:300]} Students often ask: {ATOM} {clean[17]['text'][:300]}"}
    arc = [r for r in read_rows(ARC) if len(r["question"]["stem"].split()) >= 10][0]
    answer = next(c["text"] for c in arc["question"]["choices"] if c["label"] == arc["answerKey"])
    leak = {"id": "leak", "text": f"{clean[20]['text'][:300]} Question: {arc['question']['stem']} Answer: {answer}"}
    spec = load_spec(None, [], env={})
    m = dc.run(spec, _filter_manifest(home, clean[15:] + tales + [asks, leak]), spark=spark)
    removed = pq.read_table(m.output("removed"))
    assert removed.column("id").to_pylist() == ["leak"] and "question_only" not in removed.column_names
    common = m.extra["common_ngrams"]
    assert (common["limit"], common["limit_short"]) == (10, 2)  # a whole short item in 3+ docs is a stock phrase
    happy = [c for c in common["ngrams"] if c["ngram"] == "and they lived happily ever after the end"]
    assert happy and happy[0]["docs"] == 15 and happy[0]["items"][0].startswith("reference:")
    con = m.extra["contamination"]
    assert con["reference"]["items_overlapping"] == 0 and con["reference"]["items_common"] == 1
    arc_rec = con["llmp_arc_easy"]
    assert (arc_rec["items_question_only"], arc_rec["docs_question_only"], arc_rec["question_only"]) == (1, 1, [4])
    assert arc_rec["docs_removed"] == 1 and arc_rec["overlapping_kept"] == []  # the question alone is no overlap
    assert m.extra["question_only"] == {"docs": 1, "examples": [
        {"id": "asks", "item": "llmp_arc_easy:4", "words": "which best describes the structure of an atom"}]}


@pytest.fixture(scope="module")
def default_items():
    """The items of the default eval.tasks and eval.reference, as the stage reads them (lm-eval's task objects)."""
    from pipelines.spec import load_spec

    return dc.eval_items(load_spec(None, [], env={}))[0]


def test_issue_46s_short_questions_alone_are_reported_and_with_their_answers_removed(default_items):
    """Ten clean pages that ask "Which best describes the structure of an atom?" and ten that say "a man is sitting
    on a roof. He" (8-word items, matched whole) were all removed as contamination; now they stay and are reported,
    while the question with its answer after it (a Q/A copy, the HellaSwag context with its ending) is removed."""
    clean = [d["text"] for d in c4_docs(40)]
    atom = [f"{clean[i][:300]}\n\nStudents often ask: {ATOM} {clean[20 + i][:300]}" for i in range(10)]
    roof = [f"{clean[10 + i][:300]} {ROOF} {clean[30 + i][:300]}" for i in range(10)]
    leaks = [f"Q: {ATOM.upper()}\nA: a massive core surrounded by negatively-charged particles.",
             f"{clean[0][:200]} {ROOF} starts pulling up roofing on a roof. {clean[1][:200]}"]
    decided, _ = dc.decontaminate_texts(atom + roof + leaks, default_items, DecontaminateCfg())
    assert [d.reason for d in decided] == [None] * 20 + ["contamination:llmp_arc_easy", "contamination:llmp_hellaswag"]
    assert {str(d.question_only) for d in decided[:10]} == \
        {"[['llmp_arc_easy:4', 'which best describes the structure of an atom']]"}
    assert all(d.question_only[0][0] == "llmp_hellaswag:0" and not d.items for d in decided[10:20])
    assert all(d.reason for d in dc.decontaminate_texts(atom + roof, default_items, BEFORE)[0])  # 20 of 20 before


def test_the_labelled_set_recall_and_false_removals(default_items):
    """data/decontam/labelled.jsonl (what make_labelled.py writes): contaminated pages removed (recall ≥ .95; the
    misses are questions whose answer comes more than answer_window words later), clean benchmark-like pages kept
    (≤ 5 % removed); the rules before removed most of the clean ones."""
    spec = importlib.util.spec_from_file_location("decontam_make_labelled", ROOT / "data/decontam/make_labelled.py")
    ml = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ml)
    assert ml.dumps(ml.build()) == ml.OUT.read_text(encoding="utf-8")  # the file is what the script writes
    records = ml.load()
    texts = [r["text"] for r in records]
    after = ml.score(records, [d.reason is not None for d in dc.decontaminate_texts(texts, default_items,
                                                                                  DecontaminateCfg())[0]])
    before = ml.score(records, [d.reason is not None for d in dc.decontaminate_texts(texts, default_items, BEFORE)[0]])
    assert after["recall"] >= 0.95 and after["false_removal"] <= 0.05, (after["recall"], after["false_removal"])
    assert before["recall"] == 1.0 and before["false_removal"] > 0.5
    assert after["kinds"]["arc_answer_far"][0] == 0 and after["recall"] == 1 - 10 / after["contaminated"]


def test_a_short_question_counts_only_with_its_answer_after_it():
    """The kernel on items written here: a short Question is evidence only with its answer within answer_window words;
    an Answered text's n-grams hold four words of the answer; a whole short item in a few docs is a stock phrase,
    a short Layout is not."""
    q, a = "Which gas do green plants take in from the air?", "carbon dioxide"  # 10 words
    items = {"t": [[dc.Layout(f"Question: {q}\nAnswer: {a}", a), dc.Answered(f"{q} {a}", a), dc.Question(q, [a])]]}
    table, lengths, stats = dc.build_table(items, 13, 8)
    cfg, order = DecontaminateCfg(), ["t"]
    asked = [["t:0", "which gas do green plants take in from the air"]]
    assert dc.decide(f"Quiz time! {q} Think about it.", table, lengths, cfg, order) == \
        (None, f"Quiz time! {q} Think about it.", [], False, asked)
    assert dc.decide(f"{q} (A) oxygen (B) {a.upper()} (C) nitrogen", table, lengths, cfg, order)[:3] == \
        ("contamination:t", f"{q} (A) oxygen (B) {a.upper()} (C) nitrogen", ["t:0"])
    near, far = f"{q} {'word ' * 40}{a}", f"{q} {'word ' * 41}{a}"
    assert dc.decide(near, table, lengths, cfg, order).reason == "contamination:t"
    assert dc.decide(far, table, lengths, cfg, order).question_only == asked
    old = dc.build_table(items, 13, 8, guard=False)
    assert dc.decide(far, *old[:2], BEFORE, order).reason == "contamination:t"  # the rule before
    # cut mode cuts the question through the end of its answer
    doc = f"{'A ' * 150}{q} Answer: {a}.{' Z' * 150}"
    rest = dc.decide(doc, table, lengths, DecontaminateCfg(mode="cut", cut_window_chars=0), order)
    assert rest.cut and "carbon" not in rest.text and "plants" not in rest.text
    long_q = "Which of these gases do green plants take in from the air on a sunny day?"  # 16 words
    items = {"t": [[dc.Answered(f"{long_q} the gas {a}", f"the gas {a}"), dc.Question(long_q, [f"the gas {a}"])]]}
    table, lengths, _ = dc.build_table(items, 13, 8)
    assert dc.decide(f"{long_q}", table, lengths, cfg, order).reason == "contamination:t"  # 13 words of its own
    tail = " ".join(dc.words(long_q)[-11:])
    assert dc.decide(f"{tail} the gas", table, lengths, cfg, order).reason is None  # two answer words: chance
    items = {"reference": [["And they lived happily ever after. The End!"]],
             "t": [[dc.Layout("Question: Which is a solid? Answer: ice", "ice")]]}
    texts = ["And they lived happily ever after. The End!"] * 3 + ["Question: Which is a solid? Answer: ice"] * 3
    decided, common = dc.decontaminate_texts(texts, items, cfg)
    assert common == {"and they lived happily ever after the end": 3}
    assert [d.reason for d in decided] == [None] * 3 + ["contamination:t"] * 3
