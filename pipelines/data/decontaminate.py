"""The decontaminate stage: training docs that share a word n-gram with an evaluation item are removed (or cut).

Between ``filter`` and ``tokenize``. The items are those of every task ``eval.tasks`` stands for (all of each task's
documents, not only the ``eval.limit`` scored: a later run may score more) and the reference set (``eval.reference``,
one item per paragraph or JSONL record). A task's items come from lm-eval's own task objects
(:func:`pipelines.eval_sets.eval_tasks`: its ``eval_docs``, ``doc_to_text``, ``doc_to_choice``,
``doc_to_target``), so any task lm-eval can build is checked with no code of ours for it; :func:`item_texts` says what
of an item is looked for (the prompt with each correct answer, as the evaluation shows it and without its labels; the
parts that give it away alone).

* Words: NFKC, lower case, ``\\w+`` runs (punctuation and spacing do not hide a copy). An item gives its
  ``data.decontaminate.ngram``-grams of words (13 by default, as GPT-3 and the Pile did); an item shorter than that
  is one n-gram of its own length when it has at least ``min_item_words`` words, else it is not checked
  (``items_too_short``: a six-word question matches too much ordinary text to mean anything).
* The n-grams of every item, as a table n-gram → items, are broadcast to the Spark tasks (the eval sets are small:
  ≈ 10⁵ n-grams); each task looks up every n-gram of its docs.
* An item is also looked for as the task's prompt shows it (``Question: … Answer: …``; :class:`Layout`), whatever its
  length (down to ``LAYOUT_MIN_WORDS``). Of a text that ends with the answer (:class:`Answered`, a Layout) only the
  n-grams that hold ``ANSWER_MIN_WORDS`` words of the answer are looked for; the question's own n-grams come from
  the question alone (:class:`Question`).
* A short question alone is not evidence (``question_alone = report``): a :class:`Question` with fewer than
  ``ngram`` words of its own (its labels apart) matches only with one of the item's answers starting within
  ``answer_window`` words after it; alone, it is reported (``extra.question_only``, per task ``items_question_only``,
  ``docs_question_only``) and removes nothing ("Which best describes the structure of an atom?" is ordinary prose).
* Common text is not evidence: an eval n-gram found in more than ``common_share`` of the docs (and more than
  ``common_min_docs``), or a whole item shorter than ``ngram`` words (a reference line, no prompt and answer) found in
  more than ``common_min_docs_short`` docs, matches nothing; the manifest reports it (``extra.common_ngrams``:
  n-gram, docs, items; per task ``items_common``). The docs are scanned twice for this (once to count, once to
  decide). :func:`decontaminate_texts` runs the same rules on texts in memory (the benchmark's, the tests').
* ``mode``: ``remove`` (default) drops a doc with any match, with ``filter_reason = contamination:<task>`` (the task
  with the most matching n-grams); ``cut`` drops each match with ``cut_window_chars`` on each side (GPT-3: 200); the
  doc goes when fewer than ``cut_min_chars`` characters remain or more than ``cut_max_pieces`` pieces (GPT-3: 10);
  ``report`` removes nothing and counts.
* Nothing is lost: docs in = kept + removed. The manifest records per task (``extra.contamination.<task>``, and
  ``reference``): items, items with any overlap, docs removed and cut, the n-gram size, the file digest, and which
  items overlap a doc the stage kept (what reaches the model: the registered version's contamination count). A task
  is recorded under its lm-eval name (a group's tasks each under its own) with the digest of its rendered items
  (:func:`pipelines.eval_sets.task_digest`), which is also the stage's input for it.

    python -m pipelines.data.decontaminate --input-manifest FILTER_MANIFEST --output DIR [--set K=V …]
"""
from __future__ import annotations

import json
import re
import sys
import unicodedata
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa

from pipelines.cli import run_and_log, stage_dir, stage_main
from pipelines.manifest import Manifest, file_ref, input_ref
from pipelines.spec import DecontaminateCfg, JobSpec
from pipelines.eval_sets import (eval_tasks, reference_files, reference_items, rendered, set_sha256, task_digest,
                                 task_ref)

WORD = re.compile(r"\w+")
REFERENCE = "reference"
REASON = "contamination:"


# -- the kernel (pure Python; the Spark tasks run it) -----------------------------------------------------------------

def word_spans(text: str) -> tuple[str, list[re.Match]]:
    norm = unicodedata.normalize("NFKC", text)
    return norm, list(WORD.finditer(norm))


def words(text: str) -> list[str]:
    return [m.group().lower() for m in word_spans(text)[1]]


LAYOUT_MIN_WORDS = 4  # a Layout ("Question: … Answer: …") is looked for whatever its length, down to this


class Answered(str):
    """An item's text that ends with its answer (``tail``: the answer's number of words), such as "q a": of its
    n-grams, only those that hold the answer are looked for (:func:`starts`; the question's own n-grams are its
    :class:`Question`'s)."""

    tail: int = 0

    def __new__(cls, text: str, answer: str = ""):
        t = super().__new__(cls, text)
        t.tail = len(words(answer))
        return t


class Layout(Answered):
    """An item's text as the evaluation shows it to the model (the task's prompt with the correct answer): looked for
    whatever its length, since its labels ("Question: … Answer: …") make even a short item a distinctive run."""


class Question(str):
    """An item's question or context without its answer (a field the prompt shows, the prompt alone), with the item's
    correct ``answers`` and ``own``: its longest run of words that is one field or holds none (its length without the
    labels around its fields: :func:`own_words`). Under ``ngram`` own words it is a short question: its n-grams (the
    whole of it when shorter than ``ngram`` words) are evidence only with an answer after them (:func:`weigh`):
    "Which best describes the structure of an atom?" alone is ordinary prose."""

    answers: tuple[str, ...] = ()
    own: int = 0

    def __new__(cls, text: str, answers=(), own: int | None = None):
        q = super().__new__(cls, text)
        q.answers = tuple(answers)
        q.own = len(words(text)) if own is None else own
        return q


def entry(key: str, part: str, n: int, guard: bool) -> str | tuple:
    """What a text's n-gram points to: the item's key, or for a short question (fewer than ``n`` own words) that has
    answers to look for, the pair (key, the answers' word tuples): evidence only with an answer after it (when
    ``guard``; else the key: the rule before). Plain tuples, as the table is broadcast with pickle and the stage's
    own module may be ``__main__``."""
    if not (guard and isinstance(part, Question) and part.own < n):
        return key
    answers = tuple(a for a in (tuple(words(t)) for t in part.answers) if a)
    return (key, answers) if answers else key


ANSWER_MIN_WORDS = 4  # an n-gram of an Answered text holds this many words of the answer (all of a shorter one)


def starts(part: str, n_words: int, k: int, guard: bool) -> range:
    """The first words of the ``k``-grams of a text of ``n_words`` words that are looked for: all, or of an
    :class:`Answered` text (when ``guard``) those that hold ``ANSWER_MIN_WORDS`` words of its answer (all of a shorter
    answer): an n-gram that only touches the answer is the question's, and a word such as "the" after a question is
    chance."""
    tail = getattr(part, "tail", 0) if guard else 0
    first = n_words - k - tail + min(tail, ANSWER_MIN_WORDS) if tail else 0
    return range(max(0, first), n_words - k + 1)


def build_table(items: dict[str, list[list[str]]], n: int, min_words: int, guard: bool = True
                ) -> tuple[dict[str, list], list[int], dict]:
    """(n-gram → entries [the item's key "task:item", or (key, answers): :func:`entry`], the n-gram lengths to look
    up, per task {items, items_too_short}). An item is a list of texts (the whole item; parts that give it away
    alone; the item as the task's prompt shows it: a :class:`Layout`; its question alone: a :class:`Question`); each
    text gives its n-grams (:func:`starts`), or is one n-gram of its own length when shorter than ``n`` words but not
    than ``min_words`` (a Layout: than ``LAYOUT_MIN_WORDS``). ``guard`` off: every text is evidence whole (the rule
    before)."""
    table: dict[str, list] = {}
    lengths: set[int] = set()
    stats = {}
    for task, texts in items.items():
        short = 0
        for i, parts in enumerate(texts):
            key, checked = f"{task}:{i}", False
            for part in parts:
                ws = words(part)
                k = min(n, len(ws))
                if k < (LAYOUT_MIN_WORDS if isinstance(part, Layout) else min_words):
                    continue
                checked = True
                lengths.add(k)
                e = entry(key, part, n, guard)
                for j in starts(part, len(ws), k, guard):
                    keys = table.setdefault(" ".join(ws[j:j + k]), [])
                    if e not in keys:
                        keys.append(e)
            short += not checked
        stats[task] = {"items": len(texts), "items_too_short": short}
    return table, sorted(lengths), stats


def item_of(e) -> str:
    return e if isinstance(e, str) else e[0]


def scan(text: str, table: dict, lengths: list[int]) -> tuple[str, list[re.Match], list[tuple[int, int, list]]]:
    """(NFKC text, its word matches, [(first word, n-gram length, entries)] for every n-gram of the doc in the
    table)."""
    norm, ms = word_spans(text)
    ws = [m.group().lower() for m in ms]
    hits = []
    for k in lengths:
        for j in range(len(ws) - k + 1):
            keys = table.get(" ".join(ws[j:j + k]))
            if keys:
                hits.append((j, k, keys))
    return norm, ms, hits


def matched_ngrams(text: str, table: dict, lengths: list[int]) -> list[str]:
    """The distinct n-grams of the table that ``text`` holds and that are evidence by themselves (what the
    common-n-gram count tallies per doc; a short question alone is no evidence, frequent or not)."""
    norm, ms, hits = scan(text or "", table, lengths)
    return sorted({" ".join(m.group().lower() for m in ms[j:j + k]) for j, k, keys in hits
                   if any(isinstance(e, str) for e in keys)})


def answer_end(ws: list[str], start: int, answers: tuple[tuple[str, ...], ...], window: int) -> int | None:
    """The end (a word index) of the first of ``answers`` found starting within ``window`` words after ``start``."""
    for s in range(start, min(len(ws), start + window + 1)):
        for a in answers:
            if tuple(ws[s:s + len(a)]) == a:
                return s + len(a)
    return None


def weigh(ws: list[str], hits: list[tuple[int, int, list]], window: int
          ) -> tuple[list[tuple[int, int, list[str]]], dict[str, str]]:
    """(the hits that are evidence, as (first word, length, items), {item: the words matched} for the items found only
    as a short question with no answer after it). A short question's entry, (key, answers), is evidence, from the
    question to the end of the answer, when one of its answers starts within ``window`` words after the question."""
    found, asked = [], {}
    for j, k, keys in hits:
        plain = [e for e in keys if isinstance(e, str)]
        if plain:
            found.append((j, k, plain))
        for e in keys:
            if not isinstance(e, str):
                end = answer_end(ws, j + k, e[1], window)
                if end is None:
                    asked.setdefault(e[0], " ".join(ws[j:j + k]))
                else:
                    found.append((j, end - j, [e[0]]))
    evidence = {key for _, _, keys in found for key in keys}
    return found, {i: t for i, t in asked.items() if i not in evidence}


def cut_spans(norm: str, ms: list[re.Match], hits: list[tuple[int, int, list[str]]], window: int = 0
              ) -> tuple[str, int]:
    """(the text without each hit and ``window`` characters on each side of it, the number of pieces left; the
    pieces are joined by line breaks)."""
    spans = sorted((max(0, ms[j].start() - window), min(len(norm), ms[j + k - 1].end() + window)) for j, k, _ in hits)
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    pieces, pos = [], 0
    for a, b in merged:
        pieces.append(norm[pos:a])
        pos = b
    pieces.append(norm[pos:])
    kept = [part.strip(" ") for part in pieces if part.strip()]
    return "\n".join(kept), len(kept)


class Decision(NamedTuple):
    reason: str | None        # filter_reason, or None: the doc stays
    text: str                 # the text to keep
    items: list[str]          # the items it overlaps ("task:item")
    cut: bool                 # whether spans were cut
    question_only: list[list[str]]  # [[item, the words matched], …]: short questions found alone (reported only)


def decide(text: str, table: dict, lengths: list[int], cfg: DecontaminateCfg, order: list[str]) -> Decision:
    """What becomes of one doc (:class:`Decision`)."""
    norm, ms, hits = scan(text or "", table, lengths)
    if not hits:
        return Decision(None, text, [], False, [])
    hits, asked = weigh([m.group().lower() for m in ms], hits, cfg.answer_window)
    alone = sorted([i, t] for i, t in asked.items())
    if not hits:
        return Decision(None, text, [], False, alone)
    items = sorted({key for _, _, keys in hits for key in keys})
    per_task = Counter(key.split(":", 1)[0] for _, _, keys in hits for key in set(keys))
    task = max(per_task, key=lambda t: (per_task[t], -order.index(t)))
    if cfg.mode == "report":
        return Decision(None, text, items, False, alone)
    if cfg.mode == "cut":
        rest, pieces = cut_spans(norm, ms, hits, cfg.cut_window_chars)
        if len(rest) >= cfg.cut_min_chars and pieces <= cfg.cut_max_pieces:
            return Decision(None, rest, items, True, alone)
    return Decision(REASON + task, text, items, False, alone)


def without(table: dict, common: set[str]) -> tuple[dict, list[int]]:
    """The table less the ``common`` n-grams' items (a short question's entry stays: a short question is weighed by
    its answer, not by how often it is asked), and the lengths left to look up."""
    kept = {}
    for g, keys in table.items():
        rest = [e for e in keys if not isinstance(e, str)] if g in common else keys
        if rest:
            kept[g] = rest
    return kept, sorted({len(g.split(" ")) for g in kept})


def whole_items(items: dict[str, list[list[str]]]) -> set[str]:
    """The items with no :class:`Layout` (no prompt and answer: a reference paragraph): their text is all there is,
    and a short one may be a stock phrase."""
    return {f"{t}:{i}" for t, texts in items.items() for i, parts in enumerate(texts)
            if not any(isinstance(p, Layout) for p in parts)}


def common_limits(cfg: DecontaminateCfg, n_docs: int) -> tuple[int, int]:
    """(the docs above which an n-gram is common text, the same for a whole item shorter than ``ngram`` words)."""
    return max(cfg.common_min_docs, int(cfg.common_share * n_docs)), cfg.common_min_docs_short


def common_of(counts: dict[str, int], table: dict, whole: set[str], cfg: DecontaminateCfg, n_docs: int
              ) -> dict[str, int]:
    """{n-gram: docs} for the counted n-grams (n-gram → docs that hold it) that are common text: above the limit
    (:func:`common_limits`), the short one for an n-gram shorter than ``ngram`` words all of whose items are
    :func:`whole_items`."""
    full, short = common_limits(cfg, n_docs)

    def limit(g: str) -> int:
        keys = [e for e in table[g] if isinstance(e, str)]
        return short if len(g.split(" ")) < cfg.ngram and all(k in whole for k in keys) else full

    return {g: c for g, c in counts.items() if c > limit(g)}


def decontaminate_texts(texts: list[str], items: dict[str, list[list[str]]], cfg: DecontaminateCfg
                        ) -> tuple[list[Decision], dict[str, int]]:
    """The stage's rules on texts in memory, without Spark (the benchmark's and the kernel tests'): the n-grams
    counted over ``texts``, the common ones set aside, each text decided; ({n-gram: docs} of the common ones)."""
    table, lengths, _ = build_table(items, cfg.ngram, cfg.min_item_words, cfg.question_alone == "report")
    counts = Counter(g for t in texts for g in matched_ngrams(t, table, lengths))
    common = common_of(counts, table, whole_items(items), cfg, len(texts))
    table, lengths = without(table, set(common))
    return [decide(t, table, lengths, cfg, list(items)) for t in texts], common


# -- the eval items ---------------------------------------------------------------------------------------------------

def _shown(field: str, prompt_words: str) -> bool:
    ws = words(field)
    return len(ws) >= LAYOUT_MIN_WORDS and f" {' '.join(ws)} " in prompt_words


def own_words(text: str, fields: list[str]) -> int:
    """The longest run of ``text``'s words that is one of ``fields`` or holds none of them: a prompt's question apart
    from its labels ("Question: … Answer:", HellaSwag's activity label), a passage that is no field whole."""
    rest, longest = f" {' '.join(words(text))} ", 0
    for f in sorted(fields, key=lambda f: len(words(f)), reverse=True):
        run = f" {' '.join(words(f))} "
        if run in rest:
            longest = max(longest, len(run.split()))
            rest = rest.replace(run, " | ")
    return max([longest] + [len(part.split()) for part in rest.split("|")])


def item_texts(task, doc, r: dict) -> list[str]:
    """What of one item of an lm-eval task is looked for (``r``: the item as lm-eval renders it,
    :func:`pipelines.eval_sets.rendered`): the prompt with each correct answer as the evaluation shows it (a
    :class:`Layout`); the doc's own text fields that the prompt shows (its question, its context: the prompt without
    its labels), each with each answer (:class:`Answered`) and alone; the prompt alone; and lm-eval's decontamination
    query when the task has one (the texts without the answer: a :class:`Question` each). ARC: ``Question: q Answer:
    a``, ``q a``, ``q``; HellaSwag: ``label: ctx ending``, ``ctx ending``, ``ctx``; LAMBADA: the passage."""
    prompt, answers = r["prompt"], r["answers"]
    texts = [Layout(f"{prompt}{task.config.target_delimiter}{a}", a) for a in answers]
    pw = f" {' '.join(words(prompt))} "
    fields = [v for v in doc.values() if isinstance(v, str) and _shown(v, pw) and words(v) != words(prompt)] \
        if isinstance(doc, dict) else []  # a field that is the whole prompt (HellaSwag's query) is the prompt
    asked = [*fields, prompt] + ([str(task.doc_to_decontamination_query(doc))] if task.should_decontaminate() else [])
    texts += [Answered(f"{f} {a}", a) for f in fields for a in answers]
    texts += [Question(t, answers, own_words(t, fields)) for t in asked]
    return [t for t in dict.fromkeys(texts) if t.strip()]  # one of each (the first kept: a Layout stays one)


def eval_items(spec: JobSpec) -> tuple[dict[str, list[list[str]]], dict[str, dict]]:
    """({task: item texts}, {task: its identity}) for the tasks of eval.tasks (lm-eval's task objects, items in
    ``eval_docs`` order) and the reference set."""
    items, ident = {}, {}
    for name, task in eval_tasks(spec).items():
        shown = [(doc, rendered(task, doc)) for doc in task.eval_docs]
        items[name] = [item_texts(task, doc, r) for doc, r in shown]
        ident[name] = {"sha256": task_digest(task, [r for _, r in shown])}
    refs = [Path(p) for p in reference_files(spec)]
    items[REFERENCE] = reference_items(refs)
    ident[REFERENCE] = {"files": [p.name for p in refs], "sha256": set_sha256(refs)}
    return items, ident


def eval_refs(spec: JobSpec, ident: dict[str, dict]) -> list[dict]:
    """The stage's inputs beside the filter result: each task's items (their digest) and the reference files."""
    return [task_ref(t, i["sha256"]) for t, i in ident.items() if t != REFERENCE] + \
        [file_ref(p) for p in reference_files(spec)]


# -- on Spark ---------------------------------------------------------------------------------------------------------

def _decontaminate_fn(table_bc, lengths: list[int], cfg_dict: dict, order: list[str]):
    def fn(batches):
        cfg = DecontaminateCfg.model_validate(cfg_dict)
        table = table_bc.value
        for rb in batches:
            ds = [decide(t, table, lengths, cfg, order) for t in rb.column("text").to_pylist()]
            cols = {n: rb.column(n) for n in rb.schema.names}
            cols["text"] = pa.array([d.text for d in ds], pa.string())
            cols.update(filter_reason=pa.array([d.reason for d in ds], pa.string()),
                        contamination=pa.array([json.dumps(d.items) if d.items else None for d in ds], pa.string()),
                        question_only=pa.array([json.dumps(d.question_only) if d.question_only else None
                                                for d in ds], pa.string()),
                        cut=pa.array([d.cut for d in ds], pa.bool_()))
            yield pa.RecordBatch.from_pydict(cols)

    return fn


def _matched_fn(table_bc, lengths: list[int]):
    def fn(batches):
        table = table_bc.value
        for rb in batches:
            found = [matched_ngrams(t, table, lengths) for t in rb.column("text").to_pylist()]
            yield pa.RecordBatch.from_arrays([pa.array(found, pa.list_(pa.string()))], names=["ngrams"])

    return fn


def ngram_counts(docs, table_bc, lengths: list[int], above: int) -> dict[str, int]:
    """{n-gram: docs} for the eval n-grams (evidence by themselves) found in more than ``above`` docs: the first pass
    over the docs, which finds common text such as "and they lived happily ever after. The end." (:func:`common_of`
    says which of them are common)."""
    from pyspark.sql import functions as F

    rows = (docs.select("text").mapInArrow(_matched_fn(table_bc, lengths), "ngrams array<string>")
            .select(F.explode("ngrams").alias("g")).groupBy("g").count().where(F.col("count") > above).collect())
    return {r["g"]: int(r["count"]) for r in rows}


def common_report(common: dict[str, int], table: dict, rest: dict, cfg: DecontaminateCfg, n_docs: int) -> dict:
    """The manifest's ``extra.common_ngrams``: the limits, each common n-gram with its docs and items, and the items
    none of whose n-grams is looked for any more (``rest``: the table without the common ones; a real copy on many
    pages as well as a generic line), named so that a reader can tell."""
    full, short = common_limits(cfg, n_docs)
    ngrams = [{"ngram": g, "docs": n, "items": sorted({e for e in table[g] if isinstance(e, str)})}
              for g, n in sorted(common.items(), key=lambda kv: (-kv[1], kv[0]))]
    still = {item_of(e) for keys in rest.values() for e in keys}
    return {"limit": full, "limit_short": short, "ngrams": ngrams,
            "items_not_checked": sorted({k for c in ngrams for k in c["items"]} - still)}


EXAMPLES = 20  # question-only matches named in the manifest (extra.question_only.examples)


def tally(res, tasks: list[str]) -> dict:
    """What the decided docs say per task: docs removed (``reasons``) and cut, the items overlapping docs (``all``,
    and ``kept``: of the docs kept), the items found only as a short question with no answer (``asked``; the docs
    holding one: ``asked_docs`` per task, ``asked_in`` in all), and the first ``EXAMPLES`` such matches."""
    from pyspark.sql import functions as F

    reasons = {r["filter_reason"]: int(r["count"]) for r in
               res.where(F.col("filter_reason").isNotNull()).groupBy("filter_reason").count().collect()}
    seen = {k: {t: set() for t in tasks} for k in ("all", "kept", "asked")}
    cuts, asked_docs, examples, asked_in = Counter(), Counter(), [], 0
    rows = res.where(F.col("contamination").isNotNull() | F.col("question_only").isNotNull()) \
        .select("idx", "id", "contamination", "question_only", "filter_reason", "cut").orderBy("idx").collect()
    for r in rows:
        keys = [key.split(":", 1) for key in json.loads(r["contamination"] or "[]")]
        for task, i in keys:
            seen["all"][task].add(int(i))
            if r["filter_reason"] is None:
                seen["kept"][task].add(int(i))
        if r["cut"]:
            cuts.update({task for task, _ in keys})
        asked = json.loads(r["question_only"] or "[]")
        asked_in += bool(asked)
        asked_docs.update({key.split(":", 1)[0] for key, _ in asked})
        for key, text in asked:
            task, i = key.split(":", 1)
            seen["asked"][task].add(int(i))
            if len(examples) < EXAMPLES:
                examples.append({"id": r["id"], "item": key, "words": text})
    return {"reasons": reasons, "cuts": cuts, **seen, "asked_docs": asked_docs, "asked_in": asked_in,
            "examples": examples}


def task_record(t: str, stats: dict, tl: dict, common: dict, ngram: int) -> dict:
    """A task's ``extra.contamination.<task>`` (without its identity)."""
    common_items = {k for c in common["ngrams"] for k in c["items"] if k.split(":", 1)[0] == t}
    return {**stats, "items_overlapping": len(tl["all"][t]), "docs_removed": tl["reasons"].get(REASON + t, 0),
            "docs_cut": tl["cuts"].get(t, 0), "ngram": ngram, "overlapping": sorted(tl["all"][t]),
            "overlapping_kept": sorted(tl["kept"][t]), "items_question_only": len(tl["asked"][t]),
            "docs_question_only": tl["asked_docs"].get(t, 0), "question_only": sorted(tl["asked"][t]),
            "items_common": len(common_items)}


def decontaminate_docs(spark, src: Path, out: Path, items: dict[str, list[list[str]]], cfg: DecontaminateCfg,
                       tasks: int) -> dict:
    """Writes ``out/kept`` and ``out/removed``; returns the counts and the per-task record (without identities)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F
    from pyspark.sql.types import BooleanType, StringType, StructType

    from pipelines.data.spark import finalize_parquet_dir

    table, lengths, stats = build_table(items, cfg.ngram, cfg.min_item_words, cfg.question_alone == "report")
    docs = spark.read.parquet(str(src)).repartition(tasks).persist(StorageLevel.MEMORY_AND_DISK)
    n_docs = docs.count()
    counts = ngram_counts(docs, spark.sparkContext.broadcast(table), lengths, min(common_limits(cfg, n_docs)))
    common = common_of(counts, table, whole_items(items), cfg, n_docs)
    rest, lengths = without(table, set(common))
    common = common_report(common, table, rest, cfg, n_docs)
    # a new StructType: .add on docs.schema would change the (cached) schema of docs itself
    schema = StructType(list(docs.schema.fields))
    for name, kind in (("filter_reason", StringType()), ("contamination", StringType()),
                       ("question_only", StringType()), ("cut", BooleanType())):
        schema = schema.add(name, kind)
    fn = _decontaminate_fn(spark.sparkContext.broadcast(rest), lengths, cfg.model_dump(), list(items))
    res = docs.mapInArrow(fn, schema).persist(StorageLevel.MEMORY_AND_DISK)
    res.where(F.col("filter_reason").isNull()).drop("filter_reason", "contamination", "question_only", "cut") \
        .orderBy("idx").write.parquet(str(out / "kept"))
    res.where(F.col("filter_reason").isNotNull()).drop("question_only", "cut").orderBy("idx") \
        .write.parquet(str(out / "removed"))
    tl = tally(res, list(items))
    n_in = res.count()
    res.unpersist()
    docs.unpersist()
    for d in ("kept", "removed"):
        finalize_parquet_dir(out / d)
    removed = sum(tl["reasons"].values())
    return {"counts": {"docs_in": n_in, "kept": n_in - removed, "removed": removed, "cut": sum(tl["cuts"].values()),
                       "removed_by_reason": dict(sorted(tl["reasons"].items()))},
            "record": {t: task_record(t, stats[t], tl, common, cfg.ngram) for t in items}, "ngrams": len(rest),
            "common": common, "question_only": {"docs": tl["asked_in"], "examples": tl["examples"]}}


def run(spec: JobSpec, filt: Manifest, out_dir: str | None = None, spark=None) -> Manifest:
    cfg = spec.data.decontaminate
    items, ident = eval_items(spec)  # lm-eval builds eval.tasks here: a task it cannot build fails the spec (exit 2)
    sd = stage_dir(spec, "decontaminate", [input_ref(filt), *eval_refs(spec, ident)], out_dir)

    def body(tmp: Path) -> Manifest:
        from pipelines.data.spark import dir_bytes, size_shuffles, spec_session, task_count

        s = spark or spec_session(spec, "llm-pipeline-decontaminate")
        kept = filt.output("kept")
        tasks = task_count(s, dir_bytes(kept), spec.data.task_mb, cfg.partitions)
        size_shuffles(s, tasks)
        r = decontaminate_docs(s, kept, tmp, items, cfg, tasks)
        contamination = {t: {**rec, **ident[t]} for t, rec in r["record"].items()}
        return sd.commit({"kept": "kept", "removed": "removed"}, counts=r["counts"],
                         extra={"tasks": tasks, "mode": cfg.mode, "eval_ngrams": r["ngrams"],
                                "contamination": contamination, "common_ngrams": r["common"],
                                "question_only": r["question_only"]})

    return run_and_log(spec, sd, body)


def summary(m: Manifest) -> str:
    c, con = m.counts, m.extra["contamination"]
    per = ", ".join(f"{t} {r['items_overlapping']}/{r['items']} items, {r['docs_removed']} docs" for t, r in con.items())
    common = m.extra.get("common_ngrams", {}).get("ngrams", [])
    asked = m.extra.get("question_only", {}).get("docs", 0)
    return (f"decontaminate: {c['docs_in']} docs → {c['kept']} kept, {c['removed']} removed, {c['cut']} cut "
            f"({m.extra['mode']}, {next(iter(con.values()))['ngram'] if con else '-'}-grams); {per}; "
            f"{len(common)} common n-gram(s) not counted as evidence; {asked} doc(s) with a short question alone "
            f"(reported, not evidence); manifest {m.path}")


def main(argv: list[str] | None = None) -> int:
    return stage_main("decontaminate", run, summary, argv)


if __name__ == "__main__":
    sys.exit(main())
