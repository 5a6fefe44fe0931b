"""The decontaminate stage: training docs that share a word n-gram with an evaluation item are removed (or cut).

Between ``filter`` and ``tokenize``. The items are those of every task ``eval.tasks`` stands for (all of each task's
documents, not only the ``eval.limit`` scored: a later run may score more) and the reference set (``eval.reference``,
one item per paragraph or JSONL record). A task's items come from lm-eval's own task objects
(:func:`pipelines.eval.task_files.eval_tasks`: its ``eval_docs``, ``doc_to_text``, ``doc_to_choice``,
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
  length (down to ``LAYOUT_MIN_WORDS``).
* Common text is not evidence: an eval n-gram found in more than ``common_share`` of the docs (and more than
  ``common_min_docs``) matches nothing; the manifest reports it (``extra.common_ngrams``: n-gram, docs, items). The
  docs are scanned twice for this (once to count, once to decide).
* ``mode``: ``remove`` (default) drops a doc with any match, with ``filter_reason = contamination:<task>`` (the task
  with the most matching n-grams); ``cut`` drops each match with ``cut_window_chars`` on each side (GPT-3: 200); the
  doc goes when fewer than ``cut_min_chars`` characters remain or more than ``cut_max_pieces`` pieces (GPT-3: 10);
  ``report`` removes nothing and counts.
* Nothing is lost: docs in = kept + removed. The manifest records per task (``extra.contamination.<task>``, and
  ``reference``): items, items with any overlap, docs removed and cut, the n-gram size, the file digest, and which
  items overlap a doc the stage kept (what reaches the model: the registered version's contamination count). A task
  is recorded under its lm-eval name (a group's tasks each under its own) with the digest of its rendered items
  (:func:`pipelines.eval.task_files.task_digest`), which is also the stage's input for it.

    python -m pipelines.data.decontaminate --input-manifest FILTER_MANIFEST --output DIR [--set K=V …]
"""
from __future__ import annotations

import json
import re
import sys
import unicodedata
from collections import Counter
from pathlib import Path

from pipelines.cli import run_and_log, stage_dir, stage_main
from pipelines.manifest import Manifest, file_ref, input_ref
from pipelines.spec import DecontaminateCfg, JobSpec

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


class Layout(str):
    """An item's text as the evaluation shows it to the model (the task's prompt with the correct answer): looked for
    whatever its length, since its labels ("Question: … Answer: …") make even a short item a distinctive run."""


def build_table(items: dict[str, list[list[str]]], n: int, min_words: int
                ) -> tuple[dict[str, list[str]], list[int], dict]:
    """(n-gram → ["task:item", …], the n-gram lengths to look up, per task {items, items_too_short}). An item is
    a list of texts (the whole item, parts that give it away alone, the item as the task's prompt shows it: a
    :class:`Layout`); each text gives its n-grams, or is one n-gram of its own length when shorter than ``n`` words
    but not than ``min_words`` (a Layout: than ``LAYOUT_MIN_WORDS``)."""
    table: dict[str, list[str]] = {}
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
                for j in range(len(ws) - k + 1):
                    keys = table.setdefault(" ".join(ws[j:j + k]), [])
                    if key not in keys:
                        keys.append(key)
            short += not checked
        stats[task] = {"items": len(texts), "items_too_short": short}
    return table, sorted(lengths), stats


def scan(text: str, table: dict, lengths: list[int]) -> tuple[str, list[re.Match], list[tuple[int, int, list[str]]]]:
    """(NFKC text, its word matches, [(first word, n-gram length, items)] for every n-gram of the doc in the table)."""
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
    """The distinct n-grams of the table that ``text`` holds (what the common-n-gram count tallies per doc)."""
    norm, ms, hits = scan(text or "", table, lengths)
    return sorted({" ".join(m.group().lower() for m in ms[j:j + k]) for j, k, _ in hits})


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


def decide(text: str, table: dict, lengths: list[int], cfg: DecontaminateCfg, order: list[str]
           ) -> tuple[str | None, str, list[str], bool]:
    """(filter_reason or None, the text to keep, the items it overlaps, whether spans were cut)."""
    norm, ms, hits = scan(text or "", table, lengths)
    if not hits:
        return None, text, [], False
    items = sorted({key for _, _, keys in hits for key in keys})
    per_task = Counter(key.split(":", 1)[0] for _, _, keys in hits for key in set(keys))
    task = max(per_task, key=lambda t: (per_task[t], -order.index(t)))
    if cfg.mode == "report":
        return None, text, items, False
    if cfg.mode == "cut":
        rest, pieces = cut_spans(norm, ms, hits, cfg.cut_window_chars)
        if len(rest) >= cfg.cut_min_chars and pieces <= cfg.cut_max_pieces:
            return None, rest, items, True
    return REASON + task, text, items, False


def without(table: dict, common: set[str]) -> tuple[dict, list[int]]:
    """The table less the ``common`` n-grams, and the lengths left to look up."""
    kept = {g: keys for g, keys in table.items() if g not in common}
    return kept, sorted({len(g.split(" ")) for g in kept})


# -- the eval items ---------------------------------------------------------------------------------------------------

def _shown(field: str, prompt_words: str) -> bool:
    ws = words(field)
    return len(ws) >= LAYOUT_MIN_WORDS and f" {' '.join(ws)} " in prompt_words


def item_texts(task, doc, r: dict) -> list[str]:
    """What of one item of an lm-eval task is looked for (``r``: the item as lm-eval renders it,
    :func:`pipelines.eval.task_files.rendered`): the prompt with each correct answer as the evaluation shows it (a
    :class:`Layout`); the doc's own text fields that the prompt shows (its question, its context: the prompt without
    its labels), each with each answer and alone; the prompt alone; and lm-eval's decontamination query when the task
    has one. ARC: ``Question: q Answer: a``, ``q a``, ``q``; HellaSwag: ``label: ctx ending``, ``ctx ending``,
    ``ctx``; LAMBADA: the passage."""
    prompt, answers = r["prompt"], r["answers"]
    texts = [Layout(f"{prompt}{task.config.target_delimiter}{a}") for a in answers]
    pw = f" {' '.join(words(prompt))} "
    fields = [v for v in doc.values() if isinstance(v, str) and _shown(v, pw)] if isinstance(doc, dict) else []
    texts += [f"{f} {a}" for f in fields for a in answers] + fields + [prompt]
    if task.should_decontaminate():
        texts.append(str(task.doc_to_decontamination_query(doc)))
    return [t for t in dict.fromkeys(texts) if t.strip()]  # one of each (a Layout comes first and stays one)


def eval_items(spec: JobSpec) -> tuple[dict[str, list[list[str]]], dict[str, dict]]:
    """({task: item texts}, {task: its identity}) for the tasks of eval.tasks (lm-eval's task objects, items in
    ``eval_docs`` order) and the reference set."""
    from pipelines.eval.bpb import set_sha256
    from pipelines.eval.task_files import eval_tasks, reference_files, reference_items, rendered, task_digest

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
    from pipelines.eval.task_files import reference_files, task_ref

    return [task_ref(t, i["sha256"]) for t, i in ident.items() if t != REFERENCE] + \
        [file_ref(p) for p in reference_files(spec)]


# -- on Spark ---------------------------------------------------------------------------------------------------------

def _decontaminate_fn(table_bc, lengths: list[int], cfg_dict: dict, order: list[str]):
    def fn(batches):
        import pyarrow as pa

        cfg = DecontaminateCfg.model_validate(cfg_dict)
        table = table_bc.value
        for rb in batches:
            texts, reasons, found, cut = [], [], [], []
            for t in rb.column("text").to_pylist():
                reason, kept_text, items, was_cut = decide(t, table, lengths, cfg, order)
                texts.append(kept_text)
                reasons.append(reason)
                found.append(json.dumps(items) if items else None)
                cut.append(was_cut)
            cols = {n: rb.column(n) for n in rb.schema.names}
            cols["text"] = pa.array(texts, pa.string())
            cols.update(filter_reason=pa.array(reasons, pa.string()), contamination=pa.array(found, pa.string()),
                        cut=pa.array(cut, pa.bool_()))
            yield pa.RecordBatch.from_pydict(cols)

    return fn


def _matched_fn(table_bc, lengths: list[int]):
    def fn(batches):
        import pyarrow as pa

        table = table_bc.value
        for rb in batches:
            found = [matched_ngrams(t, table, lengths) for t in rb.column("text").to_pylist()]
            yield pa.RecordBatch.from_arrays([pa.array(found, pa.list_(pa.string()))], names=["ngrams"])

    return fn


def common_ngrams(docs, table_bc, lengths: list[int], cfg: DecontaminateCfg, n_docs: int) -> dict:
    """{"limit": docs, "ngrams": {n-gram: docs}}: the eval n-grams found in more docs than the limit (common text such
    as "and they lived happily ever after. The end.", which says nothing about contamination)."""
    from pyspark.sql import functions as F

    limit = max(cfg.common_min_docs, int(cfg.common_share * n_docs))
    rows = (docs.select("text").mapInArrow(_matched_fn(table_bc, lengths), "ngrams array<string>")
            .select(F.explode("ngrams").alias("g")).groupBy("g").count().where(F.col("count") > limit).collect())
    return {"limit": limit, "ngrams": {r["g"]: int(r["count"]) for r in rows}}


def decontaminate_docs(spark, src: Path, out: Path, items: dict[str, list[list[str]]], cfg: DecontaminateCfg,
                       tasks: int) -> dict:
    """Writes ``out/kept`` and ``out/removed``; returns the counts and the per-task record (without identities)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F
    from pyspark.sql.types import BooleanType, StringType, StructType

    from pipelines.data.spark import finalize_parquet_dir

    table, lengths, stats = build_table(items, cfg.ngram, cfg.min_item_words)
    docs = spark.read.parquet(str(src)).repartition(tasks).persist(StorageLevel.MEMORY_AND_DISK)
    n_docs = docs.count()
    common = common_ngrams(docs, spark.sparkContext.broadcast(table), lengths, cfg, n_docs)
    ngram_items = {g: table[g] for g in common["ngrams"]}
    table, lengths = without(table, set(common["ngrams"]))
    # a new StructType: .add on docs.schema would change the (cached) schema of docs itself
    schema = StructType(list(docs.schema.fields)).add("filter_reason", StringType()).add("contamination", StringType()) \
        .add("cut", BooleanType())
    fn = _decontaminate_fn(spark.sparkContext.broadcast(table), lengths, cfg.model_dump(), list(items))
    res = docs.mapInArrow(fn, schema).persist(StorageLevel.MEMORY_AND_DISK)
    res.where(F.col("filter_reason").isNull()).drop("filter_reason", "contamination", "cut").orderBy("idx") \
        .write.parquet(str(out / "kept"))
    res.where(F.col("filter_reason").isNotNull()).drop("cut").orderBy("idx").write.parquet(str(out / "removed"))
    reasons = {r["filter_reason"]: int(r["count"]) for r in
               res.where(F.col("filter_reason").isNotNull()).groupBy("filter_reason").count().collect()}
    cuts = Counter()
    overlaps = {t: {"all": set(), "kept": set()} for t in items}
    for r in res.where(F.col("contamination").isNotNull()).select("contamination", "filter_reason", "cut").collect():
        for key in json.loads(r["contamination"]):
            task, i = key.split(":", 1)
            overlaps[task]["all"].add(int(i))
            if r["filter_reason"] is None:
                overlaps[task]["kept"].add(int(i))
        if r["cut"]:
            cuts.update({key.split(":", 1)[0] for key in json.loads(r["contamination"])})
    n_in = res.count()
    res.unpersist()
    docs.unpersist()
    for d in ("kept", "removed"):
        finalize_parquet_dir(out / d)
    record = {t: {**stats[t], "items_overlapping": len(overlaps[t]["all"]),
                  "docs_removed": reasons.get(REASON + t, 0), "docs_cut": cuts.get(t, 0), "ngram": cfg.ngram,
                  "overlapping": sorted(overlaps[t]["all"]), "overlapping_kept": sorted(overlaps[t]["kept"])}
              for t in items}
    removed = sum(reasons.values())
    common["ngrams"] = [{"ngram": g, "docs": n, "items": sorted(set(ngram_items[g]))}
                        for g, n in sorted(common["ngrams"].items(), key=lambda kv: -kv[1])]
    # items whose every n-gram is common: nothing of them is looked for any more (a real copy on many pages as well
    # as a generic line): named, so that a reader can tell
    still = {key for keys in table.values() for key in keys}
    common["items_not_checked"] = sorted({k for c in common["ngrams"] for k in c["items"]} - still)
    return {"counts": {"docs_in": n_in, "kept": n_in - removed, "removed": removed, "cut": sum(cuts.values()),
                       "removed_by_reason": dict(sorted(reasons.items()))},
            "record": record, "ngrams": len(table), "common": common}


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
                                "contamination": contamination, "common_ngrams": r["common"]})

    return run_and_log(spec, sd, body)


def summary(m: Manifest) -> str:
    c, con = m.counts, m.extra["contamination"]
    per = ", ".join(f"{t} {r['items_overlapping']}/{r['items']} items, {r['docs_removed']} docs" for t, r in con.items())
    common = m.extra.get("common_ngrams", {}).get("ngrams", [])
    return (f"decontaminate: {c['docs_in']} docs → {c['kept']} kept, {c['removed']} removed, {c['cut']} cut "
            f"({m.extra['mode']}, {next(iter(con.values()))['ngram'] if con else '-'}-grams); {per}; "
            f"{len(common)} common n-gram(s) not counted as evidence; manifest {m.path}")


def main(argv: list[str] | None = None) -> int:
    return stage_main("decontaminate", run, summary, argv)


if __name__ == "__main__":
    sys.exit(main())
