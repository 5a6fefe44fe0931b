"""Quality filters as composable steps, run on Spark executors, a reason for every removed doc.

Steps (``data.filters.steps``, in order; defaults follow FineWeb's pipeline order):

* ``language``: py3langid (model inside the PyPI package, nothing downloaded); keeps docs whose
  language is in ``languages`` with normalised probability ≥ ``min_score``; every doc gets
  ``language`` and ``language_score`` columns.
* ``gopher_repetition``: duplicate lines / paragraphs (share and chars), top 2–4-gram char share,
  duplicated 5–10-gram char share (Rae et al. 2021, table A1 thresholds).
* ``gopher_quality``: word count, mean word length, symbol/word ratio, bullet and ellipsis lines,
  alphabetic words, stop words (Rae et al. 2021, A.1.1).
* ``c4``: C4's rules as DataTrove's ``C4QualityFilter`` applies them: lines that have no terminal
  punctuation, < 3 words, a 1,000-char word, "javascript" or cookie/privacy-policy text are
  *dropped from the doc*; a doc with "lorem ipsum", a ``{``, or < 5 sentences left is removed.
* ``fineweb``: share of lines ending in punctuation < 0.12, share of short lines > 0.67,
  duplicated-line chars > 1 %, newlines per word > 0.3 (Penedo et al. 2024).

* ``url`` (first by default): block lists, banned words in the URL, an allow list (:mod:`pipelines.data.urlfilter`;
  reasons ``url:blocklist``, ``url:banned_word``).

The first step that rejects a doc sets ``filter_reason = "<step>.<rule>"`` (e.g.
``gopher_quality.word_count``, ``language``, ``url:blocklist``); kept docs carry the text as the steps left it, then
``data.filters.pii`` replaces (or only counts) e-mail, IP addresses and phone numbers in them (:mod:`pipelines.data.pii`).
Stage: dedup's ``kept/`` → ``kept/`` + ``removed/`` (parquet), counts per reason and per language.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import pyarrow as pa

from pipelines.data import pii
from pipelines.data.pii import KINDS as PII_KINDS
from pipelines.data.urlfilter import UrlRules, load_rules
from pipelines.lineage.keys import Matcher
from pipelines.spec import FilterCfg

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
BULLETS = ("•", "*", "-", "–", "—", "‣", "◦", "●", "·")
END_PUNCT = (".", "?", "!", '"', "'")
POLICY_SUBSTRINGS = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies",
                     "use cookies")
_CITATION_RE = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
_SENTENCE_RE = re.compile(r"[^.!?]+[.!?]+")
_NO_LETTER_RE = re.compile(r"^(?:[^\w\n]|[\d_])++$", re.M)  # a line with no letter ([^\W\d_]: a word char, not a digit or _)
STOP_STRIP = ".,;:!?\"'()"


@dataclass
class Doc:
    """A doc as the steps see it; ``text`` may be rewritten by a step (C4 drops lines). Its words, lines and word
    counts are computed once per text and shared by the steps."""

    text: str
    info: dict = field(default_factory=dict)
    _views: dict = field(default_factory=dict, repr=False)  # views of ``_views["text"]``; a new text drops them
    # (the views are shared by the steps: read them, never change them in place)

    def _view(self, name: str, make: Callable[[str], object]):
        if self._views.get("text") is not self.text:
            self._views = {"text": self.text}
        if name not in self._views:
            self._views[name] = make(self.text)
        return self._views[name]

    @property
    def words(self) -> list[str]:
        """Runs of non-whitespace (``str.split``: the same whitespace as ``\\s``)."""
        return self._view("words", str.split)

    @property
    def lower_words(self) -> list[str]:
        """Each word lower-cased (lower-casing makes and removes no whitespace)."""
        return self._view("lower_words", lambda t: t.lower().split())

    @property
    def word_counts(self) -> Counter:
        """The lower-cased words and how often each occurs, in order of first occurrence."""
        return self._view("word_counts", lambda t: Counter(self.lower_words))

    @property
    def lines(self) -> list[str]:
        return self._view("lines", lambda t: [ln for ln in t.split("\n") if ln.strip()])


Step = Callable[[Doc, object], Optional[str]]


# ----------------------------------------------------------------------------- language
_LID = None


def _identifier():
    global _LID
    if _LID is None:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier  # lazy: its model loads on first use

        _LID = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    return _LID


def language(doc: Doc, c) -> Optional[str]:
    lang, score = _identifier().classify(doc.text[:20_000].replace("\n", " "))
    doc.info["language"], doc.info["language_score"] = lang, float(score)
    return None if lang in c.languages and score >= c.min_score else "language"


# ----------------------------------------------------------------------------- gopher repetition
def _dup_stats(items: list[str]) -> tuple[int, int]:
    seen: set[str] = set()
    n = chars = 0
    for x in items:
        if x in seen:
            n += 1
            chars += len(x)
        seen.add(x)
    return n, chars


class NGrams:
    """The n-grams of a word list, numbered exactly: at level n, equal n-grams have equal ids. Level 1 numbers the
    words; level n numbers the pairs (level n-1's id at i, word id at i+n-1) by ``np.unique``: no hashing, so no
    collision, and one C pass per level instead of a tuple per n-gram. Only the newest level is kept (the steps ask
    for n in rising order; a smaller n starts again from the words). The shares equal the per-n-gram Python
    definitions (tests/test_filters.py holds them as the reference)."""

    def __init__(self, words: list[str], distinct: Iterable[str] | None = None):
        index = {w: i for i, w in enumerate(dict.fromkeys(words) if distinct is None else distinct)}
        self.words = np.fromiter(map(index.__getitem__, words), np.int64, len(words))
        self.chars = np.concatenate(([0], np.cumsum(np.fromiter(map(len, words), np.int64, len(words)))))
        self._n, self._at = 0, ()  # the newest level: n, (ids per position, first position of each id, its count)

    def _level(self, n: int) -> tuple:
        if n < self._n:
            self._n, self._at = 0, ()
        while self._n < n:
            key = self.words if not self._n else self._at[0][:-1] * (len(self.words) + 1) + self.words[self._n:]
            _, first, ids, counts = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
            self._n, self._at = self._n + 1, (ids.reshape(-1), first, counts)
        return self._at

    def top_share(self, n: int) -> float:
        """Chars of the most frequent n-gram (the first seen among equals) × its count, over all word chars."""
        if not 1 <= n <= len(self.words):
            return 0.0
        _, first, counts = self._level(n)
        top = counts.max()
        i = first[counts == top].min()
        return float((self.chars[i + n] - self.chars[i]) * top) / max(1, int(self.chars[-1]))

    def dup_share(self, n: int) -> float:
        """Share of word chars inside an n-gram seen earlier in the doc."""
        words = len(self.words)
        if not 1 <= n <= words:
            return 0.0
        ids, first, _ = self._level(n)
        repeat = (first[ids] != np.arange(len(ids))).astype(np.int64)
        edge = np.zeros(words + 1, np.int64)
        edge[:len(ids)] += repeat
        edge[n:n + len(ids)] -= repeat
        covered = np.cumsum(edge[:words]) > 0
        return float(np.diff(self.chars)[covered].sum()) / max(1, int(self.chars[-1]))


def gopher_repetition(doc: Doc, c) -> Optional[str]:
    text = doc.text
    lines = doc.lines
    paras = [p for p in re.split(r"\n{2,}", text.strip()) if p.strip()]
    if lines:
        n, chars = _dup_stats(lines)
        if n / len(lines) > c.max_dup_line_ratio:
            return "gopher_repetition.dup_line_ratio"
        if chars / max(1, len(text)) > c.max_dup_line_char_ratio:
            return "gopher_repetition.dup_line_char_ratio"
    if paras:
        n, chars = _dup_stats(paras)
        if n / len(paras) > c.max_dup_para_ratio:
            return "gopher_repetition.dup_para_ratio"
        if chars / max(1, len(text)) > c.max_dup_para_char_ratio:
            return "gopher_repetition.dup_para_char_ratio"
    grams = NGrams(doc.lower_words, doc.word_counts)
    for n, thr in sorted(c.top_ngram_max_share.items()):
        if grams.top_share(int(n)) > thr:
            return f"gopher_repetition.top_{n}gram"
    bound = float("inf")  # the share at a smaller n: a repeated n-gram's (n-1)-grams are repeated, so no larger
    for n, thr in sorted(c.dup_ngram_max_share.items()):
        if bound <= thr:
            continue
        share = grams.dup_share(int(n))
        if share > thr:
            return f"gopher_repetition.dup_{n}gram"
        bound = min(bound, share)
    return None


# ----------------------------------------------------------------------------- gopher quality
def gopher_quality(doc: Doc, c) -> Optional[str]:
    words, lines, text = doc.words, doc.lines, doc.text
    if not words or not c.min_words <= len(words) <= c.max_words:  # no word: no ratio to take (min_words 0)
        return "gopher_quality.word_count"
    mean = sum(map(len, words)) / len(words)
    if not c.min_mean_word_len <= mean <= c.max_mean_word_len:
        return "gopher_quality.mean_word_len"
    sym = text.count("#") + text.count("...") + text.count("…")  # = per word: none of them spans whitespace
    if sym / len(words) > c.max_symbol_word_ratio:
        return "gopher_quality.symbol_ratio"
    if lines and sum(ln.lstrip().startswith(BULLETS) for ln in lines) / len(lines) > c.max_bullet_lines_ratio:
        return "gopher_quality.bullet_lines"
    if lines and sum(ln.rstrip().endswith(("...", "…")) for ln in lines) / len(lines) > c.max_ellipsis_lines_ratio:
        return "gopher_quality.ellipsis_lines"
    counts = doc.word_counts  # each distinct word once (lower-casing keeps a letter a letter, a non-letter not)
    no_letter = sum(counts[w] for w in _NO_LETTER_RE.findall("\n".join(counts)))  # one pass, no word has a \n
    if (len(words) - no_letter) / len(words) < c.min_alpha_words_ratio:
        return "gopher_quality.alpha_words"
    if sum(n for w, n in counts.items() if w.strip(STOP_STRIP) in STOP_WORDS) < c.stop_words_min:
        return "gopher_quality.stop_words"
    return None


# ----------------------------------------------------------------------------- C4
def c4(doc: Doc, c) -> Optional[str]:
    kept, sentences, dropped = [], 0, 0
    for raw in doc.text.split("\n"):
        line = raw.strip()
        line = _CITATION_RE.sub("", line) if "[" in line else line
        if not line:
            continue
        words = line.split()
        low = line.lower()
        if len(line) > c.max_word_length and max(map(len, words), default=0) > c.max_word_length:
            dropped += 1
            continue
        if c.drop_no_terminal_punct_lines and (not line.endswith(END_PUNCT) or line.endswith("...")):
            dropped += 1
            continue
        if len(words) < c.min_words_per_line:
            dropped += 1
            continue
        if c.filter_lorem_ipsum and "lorem ipsum" in low:
            return "c4.lorem_ipsum"
        if c.drop_javascript_lines and "javascript" in low:
            dropped += 1
            continue
        if c.filter_curly_bracket and "{" in line:
            return "c4.curly_bracket"
        if c.drop_policy_lines and any(p in low for p in POLICY_SUBSTRINGS):
            dropped += 1
            continue
        sentences += max(1, len(_SENTENCE_RE.findall(line)))
        kept.append(line)
    doc.info["c4_lines_dropped"] = dropped
    if sentences < c.min_sentences:
        return "c4.too_few_sentences"
    doc.text = "\n".join(kept)
    return None


# ----------------------------------------------------------------------------- FineWeb
def fineweb(doc: Doc, c) -> Optional[str]:
    lines = doc.lines
    if not lines:
        return "fineweb.empty"
    if sum(ln.rstrip().endswith(END_PUNCT) for ln in lines) / len(lines) < c.min_line_punct_ratio:
        return "fineweb.line_punct_ratio"
    if sum(len(ln) <= c.short_line_chars for ln in lines) / len(lines) > c.max_short_line_ratio:
        return "fineweb.short_line_ratio"
    _, dup_chars = _dup_stats(lines)
    if dup_chars / max(1, len(doc.text.replace("\n", ""))) > c.max_dup_line_char_ratio:
        return "fineweb.char_dup_ratio"
    words = doc.words
    if doc.text.count("\n") / max(1, len(words)) > c.max_newline_per_word:
        return "fineweb.newline_ratio"
    return None


STEPS: dict[str, Step] = {"language": language, "gopher_repetition": gopher_repetition,
                          "gopher_quality": gopher_quality, "c4": c4, "fineweb": fineweb}


def apply_filters(text: str, cfg: FilterCfg, url: Optional[str] = None,
                  url_rules: Optional[UrlRules] = None) -> tuple[Optional[str], Doc]:
    """Run the enabled steps in order; return (first reason or None, the doc as the steps left it). The ``url`` step
    needs ``url_rules`` (:func:`pipelines.data.urlfilter.load_rules`); ``doc.info["url_allowed"]`` says the allow
    list kept a URL that a rule would have removed."""
    doc = Doc(text)
    for name in cfg.steps:
        if name == "url":
            if url_rules is None:
                continue
            reason, doc.info["url_allowed"] = url_rules.check(url)
        elif getattr(cfg, name).enabled:
            reason = STEPS[name](doc, getattr(cfg, name))
        else:
            continue
        if reason:
            return reason, doc
    return None, doc


def filter_reason(text: str, cfg: FilterCfg) -> Optional[str]:
    return apply_filters(text, cfg)[0]


# ----------------------------------------------------------------------------- Spark stage
ADDED = (("filter_reason", "string"), ("language", "string"), ("language_score", "double"))
TALLIES = ("url_allowed", *(f"pii_{k}" for k in PII_KINDS))  # per-doc counts summed on the driver, then dropped


def _filter_fn(cfg_dict: dict, url_rules: UrlRules, names: list[str], excluded: Matcher):
    """Each batch: every input column (text rewritten for kept docs: C4's line drops, then PII placeholders), the
    reason (``takedown`` first: a doc of an excluded source), the language, and the tallies."""
    def fn(batches):
        cfg = FilterCfg.model_validate(cfg_dict)
        for rb in batches:
            texts = rb.column("text").to_pylist()  # the other columns pass through as they are
            urls = rb.column("url").to_pylist() if "url" in names else [None] * rb.num_rows
            sources = rb.column("source").to_pylist() if "source" in names else [None] * rb.num_rows
            out: dict[str, list] = {k: [] for k in ("text", *(n for n, _ in ADDED), *TALLIES)}
            for t, u, src in zip(texts, urls, sources):
                reason, doc = ("takedown", Doc(t or "")) if excluded.hit(src, u) else \
                    apply_filters(t or "", cfg, u, url_rules)
                text, found = doc.text, {}
                if reason is None and cfg.pii != "off":
                    scrubbed, found = pii.scrub(text, doc.info.get("language"), u)  # phone regions: language, URL
                    text = scrubbed if cfg.pii == "replace" else text
                out["text"].append(text if reason is None else t)  # removed docs keep their original text
                out["filter_reason"].append(reason)
                out["language"].append(doc.info.get("language"))
                out["language_score"].append(doc.info.get("language_score"))
                out["url_allowed"].append(int(bool(doc.info.get("url_allowed"))))
                for k in PII_KINDS:
                    out[f"pii_{k}"].append(found.get(k, 0))
            arrays = [pa.array(out["text"], pa.string()) if n == "text" else rb.column(n) for n in names]
            arrays += [pa.array(out[n], pa.string() if t == "string" else pa.float64()) for n, t in ADDED]
            arrays += [pa.array(out[n], pa.int64()) for n in TALLIES]
            yield pa.RecordBatch.from_arrays(arrays, names=[*names, *(n for n, _ in ADDED), *TALLIES])
    return fn


def filter_docs(spark, src: Path, out: Path, cfg: FilterCfg, tasks: int = 0, excluded: Matcher | None = None,
                url_rules: UrlRules | None = None) -> dict:
    """Writes ``out/kept`` and ``out/removed`` (every input column, plus ``filter_reason`` for removed docs and the
    language columns); returns the counts, ``url_filter`` (removed per rule, and ``allowed``) and ``pii`` (found per
    kind in kept docs, and the docs that had any). ``excluded``: the takedown list's sources (reason ``takedown``);
    ``url_rules``: the URL step's rules when the caller has read them (else read here)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    from pipelines.data.spark import finalize_parquet_dir

    from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

    rules = load_rules(cfg) if url_rules is None else url_rules
    docs = spark.read.parquet(str(src))
    names = [n for n in docs.columns if n not in (*(a for a, _ in ADDED), *TALLIES)]
    types = {"string": StringType(), "double": DoubleType()}
    schema = StructType([f for f in docs.schema if f.name in names] + [StructField(n, types[t]) for n, t in ADDED]
                        + [StructField(n, LongType()) for n in TALLIES])
    res = (docs.repartition(tasks or spark.sparkContext.defaultParallelism)
           .mapInArrow(_filter_fn(cfg.model_dump(), rules, names, excluded or Matcher([])), schema).persist(StorageLevel.MEMORY_AND_DISK))
    res.where(F.col("filter_reason").isNull()).drop("filter_reason", *TALLIES).orderBy("idx") \
        .write.parquet(str(out / "kept"))
    res.where(F.col("filter_reason").isNotNull()).drop(*TALLIES).orderBy("idx").write.parquet(str(out / "removed"))
    reasons = {r["filter_reason"]: int(r["count"]) for r in
               res.where(F.col("filter_reason").isNotNull()).groupBy("filter_reason").count().collect()}
    langs = {r["language"] or "none": int(r["count"]) for r in res.groupBy("language").count().collect()}
    kept = res.where(F.col("filter_reason").isNull())
    sums = res.agg(F.count(F.lit(1)).alias("n"), F.sum("url_allowed").alias("allowed")).first()
    pii_sums = kept.agg(*[F.sum(f"pii_{k}").alias(k) for k in PII_KINDS],
                        F.sum(sum((F.col(f"pii_{k}") for k in PII_KINDS), F.lit(0)).cast("boolean").cast("int"))
                        .alias("docs")).first()
    res.unpersist()
    for d in ("kept", "removed"):
        finalize_parquet_dir(out / d)
    n_in, n_removed = int(sums["n"]), sum(reasons.values())
    url_counts = {r.split(":", 1)[1]: n for r, n in sorted(reasons.items()) if r.startswith("url:")}
    return {"docs_in": n_in, "kept": n_in - n_removed, "removed": n_removed,
            "removed_by_reason": dict(sorted(reasons.items())),
            "languages": dict(sorted(langs.items(), key=lambda kv: -kv[1])[:15]),
            "url_filter": {**url_counts, "allowed": int(sums["allowed"] or 0)},
            "pii": {"mode": cfg.pii, **{k: int(pii_sums[k] or 0) for k in PII_KINDS},
                    "docs": int(pii_sums["docs"] or 0)}}
