"""The job spec: one typed config that every stage reads.

A YAML file (see ``configs/``) is validated into :class:`JobSpec`. Every section has embedded
defaults, so ``JobSpec()`` alone describes a laptop run: all state under ``./var``, Spark
``local[*]``, ``torchrun`` with 2 gloo processes, MLflow on ``sqlite:///var/mlflow.db`` and an
embedded S3-compatible endpoint on 127.0.0.1 for the L2 tier.

Overrides come in three layers, later wins: the YAML file, ``--set section.key=value`` pairs
(what Airflow Params turn into), and environment variables for the ``services`` section
(``SPARK_MASTER``, ``S3_ENDPOINT_URL``, ``S3_BUCKET``, ``S3_REGION``, ``MLFLOW_TRACKING_URI``,
``MLFLOW_UI_URL``). An Airflow task sets these for its stages from the connections the spec names
(``plugins/llm_connections.py``).

Each stage hashes only the sections it reads (:meth:`JobSpec.stage_hash`), so changing the
number of training steps does not invalidate the dedup output.

The spec lives at ``pipelines/spec.py`` rather than ``pipelines/train/`` because the data and
eval planes read it as much as training does.
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipelines.exit_codes import USER_ERROR
from pipelines.stages import stage as stage_entry


def project_home() -> Path:
    """Root that relative paths in the spec resolve against.

    ``LLMP_HOME`` if set, else the checkout this package lives in (editable install), so a
    stage resolves ``var/...`` to the same place whatever the working directory of the Airflow
    task that launched it.
    """
    env = os.environ.get("LLMP_HOME")
    if env:
        return Path(env).resolve()
    return Path(__file__).resolve().parent.parent


def resolve_path(p: str | os.PathLike) -> Path:
    path = Path(os.path.expanduser(str(p)))
    return path if path.is_absolute() else (project_home() / path)


def resolve_bundled(p: str | os.PathLike) -> Path:
    """Like :func:`resolve_path`, but a relative path that is not there falls back to the checkout's own copy:
    the data this repository ships (``data/…``) is found wherever ``LLMP_HOME`` points."""
    path = resolve_path(p)
    if path.exists() or Path(os.path.expanduser(str(p))).is_absolute():
        return path
    return Path(__file__).resolve().parent.parent / p


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    # fields that say how a stage reads or where it writes, not what it computes: left out of the stage hash
    unhashed: ClassVar[frozenset[str]] = frozenset()

    def hashed(self) -> dict:
        """The section as plain JSON, without its ``unhashed`` fields (at any depth)."""
        d = self.model_dump(mode="json")
        for k in type(self).model_fields:
            v = getattr(self, k)
            if k in self.unhashed:
                d.pop(k)
            elif isinstance(v, _Section):
                d[k] = v.hashed()
        return d


def name_like(v: str, pattern: str, says: str) -> str:
    """``v`` when the whole of it matches ``pattern``; else ``ValueError('<v> <says>')``, the field's one line."""
    if not re.fullmatch(pattern, v):
        raise ValueError(f"{v!r} {says}")
    return v


class RunCfg(_Section):
    name: str = Field("llm-pipeline", description="Run / MLflow experiment name: letters, digits, '_', '-' and '.' "
                      "(a path component of every checkpoint tier and of L2's keys).")
    seed: int = 1234
    root: str = Field("var/runs", description="Where stage outputs are written.")
    force: bool = Field(False, description="Re-run stages even when a verified manifest exists.")
    lock_stale_min: float = Field(10.0, ge=1, description="A stage waits for another run of the same stage key (it "
                                  "holds the key's lock) as long as that run beats on the lock file; silent this "
                                  "long, it is taken for hung or lost and the stage exits 75 for a retry.")
    mlflow_run_id: Optional[str] = Field(None, description="MLflow run the stages log into (set by the DAG).")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        # one path component of every tier (checkpoints, lineage and fence records, L2 keys, the experiment's
        # artifact location): a '/', '..' or a leading '/' would put them outside their roots
        return name_like(v, r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}", "is not a run name: letters, digits, '_', '-' and "
                         "'.' (no '/', spaces or other characters; not starting with '.' or '-'), 1 to 200 characters")


class InputFieldsCfg(_Section):
    """Which field (JSONL) or column (Parquet) of an input record holds what; FineWeb's names by default."""
    text: str = Field("text", min_length=1, description="The document's text (null, missing or not a string: "
                                                        "quarantined).")
    id: str = Field("id", min_length=1, description="Its id (none: <source>:<line or row>).")
    url: str = Field("url", min_length=1, description="Its URL (kept when a string).")
    date: str = Field("date", min_length=1, description="Its date (kept when a string or a timestamp).")


class IngestCfg(_Section):
    unhashed: ClassVar[frozenset[str]] = frozenset({"s3_read"})  # the same files however the objects are read
    max_docs: Optional[int] = Field(None, ge=1, description="Stop after this many good docs.")
    min_chars: int = Field(1, ge=1, description="Docs shorter than this (after strip) are quarantined.")
    extractor: Literal["resiliparse", "trafilatura"] = Field(
        "resiliparse", description="HTML → text for WARC responses: resiliparse's main-content extractor, or "
                                   "trafilatura (slower, often cleaner).")
    chunk_mb: int = Field(64, ge=1, description="Plain JSONL and .warc.gz files larger than this are read by "
                                                "several Spark tasks, one per chunk_mb byte range (cut at line / "
                                                "gzip-member boundaries).")
    s3_read: Literal["auto", "copy", "direct"] = Field(
        "auto", description="s3:// inputs: 'direct' = the Spark tasks read their byte ranges from S3 themselves, "
        "nothing goes through the driver; 'copy' = the driver first copies each object into run.root/cache; "
        "'auto' = direct on a cluster master, copy on local[…]. Either way an object's identity is its key, size "
        "and ETag.")

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, v: Any) -> Any:
        moved = [k for k in ("text_field", "id_field") if isinstance(v, dict) and k in v]
        if moved:
            raise ValueError(f"{', '.join(moved)} moved to data.input_fields: set "
                             + ", ".join(f"data.input_fields.{k.removesuffix('_field')}" for k in moved) + " instead")
        return v


class DedupCfg(_Section):
    ngram: int = Field(5, ge=1, description="Word n-gram shingle size.")
    num_perm: int = Field(128, ge=8, le=1024)
    threshold: float = Field(0.8, gt=0.0, lt=1.0, description="Target Jaccard similarity.")
    bands: Optional[int] = Field(None, ge=1, description="LSH bands; None = chosen from threshold.")
    rows: Optional[int] = Field(None, ge=1, description="Rows per band; None = chosen from threshold.")
    seed: int = 42
    verify: bool = Field(True, description="Check each LSH candidate pair's exact Jaccard ≥ threshold before union.")
    lsh_threshold: Optional[float] = Field(
        None, gt=0.0, lt=1.0, description="Similarity the LSH bands × rows are tuned for; None = threshold − 0.2 "
        "when verify is on (permissive LSH for recall, verification for precision), else threshold.")
    partitions: int = Field(0, ge=0, description="Spark tasks for the signature and keeper passes; 0 = one per "
                                                 "data.task_mb of input, at least one per executor core.")
    keeper: Literal["cover", "min_idx", "longest"] = Field(
        "cover", description="Which docs a cluster keeps: 'cover' = a small dominating set of the verified "
        "similarity graph (every removed doc has a kept doc with J ≥ threshold), 'min_idx' = the earliest doc, "
        "'longest' = the longest text (ties: earliest).")
    cover_max_cluster: int = Field(
        256, ge=2, description="Connected components of candidate edges up to this size are verified and "
        "resolved whole in one Python pass (all-pairs exact Jaccard, greedy cover); larger ones are verified "
        "in Spark joins and keep every verified star centre (distributed, still a cover).")
    cc_single_task_max_edges: int = Field(
        5_000_000, ge=0, description="Up to this many bucket entries (docs × (bands + 1)), the candidate edges and "
        "their connected components are found in one executor task (numpy sort + scipy, ≈ 100 B per entry); above "
        "it, the edges come from a shuffle by bucket and are counted, graphs up to this many edges get their "
        "connected components in one task (≈ 50 B per edge), larger ones run large-star/small-star rounds across "
        "the cluster. 0 = always distributed.")

    @model_validator(mode="after")
    def _bands_rows(self) -> "DedupCfg":
        if (self.bands is None) != (self.rows is None):
            raise ValueError("set both dedup.bands and dedup.rows, or neither (then threshold picks them)")
        if self.bands is not None and self.bands * self.rows > self.num_perm:
            raise ValueError(
                f"dedup.bands × dedup.rows = {self.bands}×{self.rows} = {self.bands * self.rows} "
                f"exceeds dedup.num_perm = {self.num_perm}; lower bands or rows, or raise num_perm"
            )
        return self


class UrlFilterCfg(_Section):
    """The URL step (:mod:`pipelines.data.urlfilter`): block lists, banned words in the URL, an allow list that wins."""

    enabled: bool = True
    bundled_blocklist: bool = Field(True, description="Use the bundled block list "
                                    "(pipelines/data/lists/url_blocklist.txt) besides data.filters.url_blocklist.")
    banned_words: Optional[list[str]] = Field(None, description="Words that remove a doc when a word of its URL is one "
                                              "of them; None = the bundled list (lists/url_banned_words.txt).")
    allow: list[str] = Field(default_factory=list, description="Domains (and the hosts under them) never removed by "
                                                               "the URL step; read as hosts, as the block lists are "
                                                               "(IDN or punycode alike).")


class LanguageCfg(_Section):
    """Language ID with py3langid (its model ships inside the PyPI package)."""

    enabled: bool = True
    languages: list[str] = Field(default_factory=lambda: ["en"], description="ISO 639-1 codes to keep.")
    min_score: float = Field(0.65, ge=0.0, le=1.0, description="Minimum normalised probability.")


class GopherQualityCfg(_Section):
    """Rae et al. 2021 ("Gopher"), appendix A.1.1, published thresholds."""

    enabled: bool = True
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_len: float = 3.0
    max_mean_word_len: float = 10.0
    max_symbol_word_ratio: float = Field(0.1, description="'#' and '...' per word.")
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    min_alpha_words_ratio: float = Field(0.8, description="Share of words with an alphabetic char.")
    stop_words_min: int = Field(2, description="At least this many English stop words.")


class GopherRepetitionCfg(_Section):
    """Gopher repetition rules (Rae et al. 2021, table A1)."""

    enabled: bool = True
    max_dup_line_ratio: float = 0.3
    max_dup_para_ratio: float = 0.3
    max_dup_line_char_ratio: float = 0.2
    max_dup_para_char_ratio: float = 0.2
    top_ngram_max_share: dict[int, float] = Field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    dup_ngram_max_share: dict[int, float] = Field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10})

    @field_validator("top_ngram_max_share", "dup_ngram_max_share")
    @classmethod
    def _n_at_least_one(cls, v: dict[int, float]) -> dict[int, float]:
        if any(n < 1 for n in v):
            raise ValueError(f"n-gram sizes must be 1 or more, got {sorted(v)}")
        return v


class C4Cfg(_Section):
    """C4 rules (Raffel et al. 2020), as DataTrove's C4QualityFilter applies them: bad lines are
    dropped from the doc, then the doc is dropped if it trips a doc-level rule."""

    enabled: bool = True
    drop_no_terminal_punct_lines: bool = True
    min_words_per_line: int = 3
    max_word_length: int = 1000
    drop_javascript_lines: bool = True
    drop_policy_lines: bool = True
    filter_lorem_ipsum: bool = True
    filter_curly_bracket: bool = True
    min_sentences: int = 5


class FineWebCfg(_Section):
    """FineWeb's own rules (Penedo et al. 2024), DataTrove's FineWebQualityFilter defaults."""

    enabled: bool = True
    min_line_punct_ratio: float = Field(0.12, description="Lines ending in punctuation / lines.")
    max_short_line_ratio: float = Field(0.67, description="Lines ≤ short_line_chars / lines.")
    short_line_chars: int = 30
    max_dup_line_char_ratio: float = Field(0.01, description="Chars in duplicated lines / chars.")
    max_newline_per_word: float = 0.3


class FilterCfg(_Section):
    """Quality filters, applied in ``steps`` order; the first step that rejects a doc names its reason."""

    steps: list[Literal["url", "language", "gopher_repetition", "gopher_quality", "c4", "fineweb"]] = Field(
        default_factory=lambda: ["url", "language", "gopher_repetition", "gopher_quality", "c4", "fineweb"])
    url: UrlFilterCfg = Field(default_factory=UrlFilterCfg)
    url_blocklist: list[str] = Field(default_factory=list, description="Block lists to add, relative paths against the "
                                     "project root: lines of domains (UT1's domains), host/path (UT1's urls), "
                                     "hosts-file lines or *.domain; any other line is refused with its file and line.")
    pii: Literal["replace", "report", "off"] = Field(
        "replace", description="After the quality filters: e-mail, IPv4/IPv6 addresses and phone numbers in kept docs "
        "replaced by fixed placeholders (replace), only counted (report), or not looked for (off).")
    language: LanguageCfg = Field(default_factory=LanguageCfg)
    gopher_repetition: GopherRepetitionCfg = Field(default_factory=GopherRepetitionCfg)
    gopher_quality: GopherQualityCfg = Field(default_factory=GopherQualityCfg)
    c4: C4Cfg = Field(default_factory=C4Cfg)
    fineweb: FineWebCfg = Field(default_factory=FineWebCfg)
    partitions: int = Field(0, ge=0, description="Spark tasks for the filter pass; 0 = one per data.task_mb of "
                                                 "input, at least one per executor core.")

    @field_validator("url_blocklist", mode="before")
    @classmethod
    def _one_or_more(cls, v):
        return [v] if isinstance(v, str) else v


class DecontaminateCfg(_Section):
    """Training docs that share an n-gram with an evaluation item (eval.tasks' items, read through lm-eval's task
    objects; eval.reference) are removed (reason ``contamination:<task>``), cut, or only counted."""

    ngram: int = Field(13, ge=4, description="n of the word n-grams compared (lower-cased words, punctuation "
                                             "dropped); 13 as in GPT-3's and the Pile's decontamination.")
    min_item_words: int = Field(8, ge=1, description="An item shorter than ngram words is one n-gram of its own "
                                "length, if it has at least this many words; shorter items are not checked (counted "
                                "as too_short).")
    question_alone: Literal["report", "evidence"] = Field(
        "report", description="An item's question or context without its answer, with fewer than ngram words of its "
        "own (labels apart): report: a match is evidence only with the answer within answer_window words after it, "
        "else it is reported (extra.question_only) and removes nothing; evidence: a match alone is evidence (the rule "
        "before, which removes prose that asks a generic question).")
    answer_window: int = Field(40, ge=0, description="question_alone=report: words between a short question's end and "
                               "the start of its answer (room for a label, or a list of the choices).")
    mode: Literal["remove", "cut", "report"] = Field(
        "remove", description="remove: drop a matching doc; cut: drop each match with cut_window_chars on each side "
        "(the doc is removed when less than cut_min_chars remain or it is left in more than cut_max_pieces pieces); "
        "report: count only, keep every doc.")
    cut_min_chars: int = Field(200, ge=0)
    cut_window_chars: int = Field(200, ge=0, description="cut: characters removed on each side of a match too (GPT-3 "
                                  "removed a 200-character window around each).")
    cut_max_pieces: int = Field(10, ge=1, description="cut: a doc left in more pieces than this is removed (GPT-3: 10).")
    common_share: float = Field(0.001, ge=0.0, le=1.0, description="An eval n-gram found in more than this share of "
                                "the corpus's docs (and more than common_min_docs) is common text, not evidence of "
                                "contamination: it is reported (extra.common_ngrams) and matches nothing.")
    common_min_docs: int = Field(10, ge=1, description="The floor of common_share: an n-gram in at most this many "
                                 "docs is evidence (GPT-3 ignored 13-grams in more than 10 docs), but for a short "
                                 "whole item (common_min_docs_short).")
    common_min_docs_short: int = Field(2, ge=1, description="A whole item (no prompt and answer: a reference "
                                       "paragraph) shorter than ngram words found in more than this many docs is a "
                                       "stock phrase, common text whatever the corpus's size.")
    partitions: int = Field(0, ge=0, description="Spark tasks; 0 = one per data.task_mb of input, at least one per "
                                                 "executor core.")


class DataCfg(_Section):
    inputs: list[str] = Field(
        default_factory=lambda: [
            "data/sample/c4_en_train_1k.jsonl.gz",
            "data/sample/cc_wet_2019_30_sample.jsonl.gz",
        ],
        description="What ingest reads: files (JSONL plain/.gz/.zst with a text field, .warc.gz, .warc.wet.gz, "
                    "Parquet: a Spark task per row group), directories, globs or s3://bucket/prefix; relative paths "
                    "resolve against the project root.",
    )
    input_fields: InputFieldsCfg = Field(default_factory=InputFieldsCfg, description="The JSONL fields / Parquet "
                                         "columns that hold text, id, url and date; a Parquet file's other columns "
                                         "are kept in each doc's meta.")
    task_mb: int = Field(128, ge=1, description="Input bytes per Spark task in dedup, filter and tokenize (their "
                                                "partitions: 0); ingest cuts its inputs by data.ingest.chunk_mb.")
    ingest: IngestCfg = Field(default_factory=IngestCfg)
    dedup: DedupCfg = Field(default_factory=DedupCfg)
    filters: FilterCfg = Field(default_factory=FilterCfg)
    decontaminate: DecontaminateCfg = Field(default_factory=DecontaminateCfg)
    exclusions: str = Field("var/exclusions.jsonl", description="The takedown list: sources (input keys or URL "
                            "prefixes) that no new corpus version holds, each with its reason; written by python -m "
                            "pipelines.lineage --exclude-source, read by the filter and tokenize stages.")
    schedule: str = Field("@weekly", description="When the data_curation DAG runs: a cron expression or an Airflow "
                          "preset (@daily, @weekly, …); read when the DAG file is parsed (spec: LLMP_SPEC or "
                          "configs/demo.yaml).")

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, v: list[str]) -> list[str]:
        if not v or any(not x.strip() for x in v):  # "" would resolve to the project root and read all of it
            raise ValueError("needs at least one input, and no empty one")
        return v

    @field_validator("schedule")
    @classmethod
    def _cron(cls, v: str) -> str:
        presets = {"@once", "@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly", "@continuous"}
        if v in presets:
            return v

        from croniter import croniter  # lazy: the served model reads the spec, and its requirements have no croniter

        if not croniter.is_valid(v):
            raise ValueError(f"{v!r} is neither a cron expression (5 fields) nor one of {sorted(presets)}")
        return v


BYTE_VOCAB = 259  # a byte tokenizer: <unk>, <s>, </s> and the 256 bytes


class TokenizerCfg(_Section):
    model_path: Optional[str] = Field(None, description="Use this SentencePiece model instead of training one (the "
                                      "settings below that shape a model are then not used, nor checked).")
    model_type: Literal["bpe", "unigram", "char", "byte"] = Field(
        "bpe", description="bpe / unigram: SentencePiece subwords (vocab_size of them, byte fallback); char: one "
        "piece per character of the sample (vocabulary = its characters plus specials; a character it lacks is "
        "<unk>); byte: the 256 bytes plus specials (no training).")
    vocab_size: Optional[int] = Field(None, description="bpe / unigram: the vocabulary's size (default 4096, at "
                                      "least 64); not used by char and byte.")
    sample_docs: int = Field(20_000, ge=1, description="Docs sampled to train the tokenizer.")
    character_coverage: float = 0.9995
    shard_tokens: int = Field(1 << 24, ge=1024, description="Max tokens per .bin shard.")
    heldout_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    heldout: Literal["hash", "tail"] = Field(
        "hash", description="Which docs are held out: hash = a doc whose sha256(seed:id) falls under "
        "heldout_fraction (stable as the corpus grows); tail = the last heldout_fraction of each input's docs, or "
        "of its text when the input is one document (the honest split for one long text or time-ordered data).")
    partitions: int = Field(0, ge=0, description="Spark partitions that encode (each writes its own shards); "
                                                 "0 = the executors' parallelism, more when the corpus is large.")

    @model_validator(mode="after")
    def _vocab(self) -> "TokenizerCfg":
        if self.model_path is None and self.model_type in ("bpe", "unigram"):
            if self.vocab_size is None:
                self.vocab_size = 4096
            if self.vocab_size < 64:
                raise ValueError(f"tokenizer.vocab_size={self.vocab_size}: a {self.model_type} tokenizer needs at "
                                 "least 64 pieces")
        return self

    def hashed(self) -> dict:
        d = super().hashed()
        if d.get("heldout") == "hash":  # the split as it always was: the stage keys of earlier corpora stand
            d.pop("heldout")
        return d

    @property
    def planned_vocab(self) -> int:
        """The vocabulary a plan assumes before the tokenizer exists (char: vocab_size, else 256 characters)."""
        if self.model_type == "byte":
            return BYTE_VOCAB
        return self.vocab_size or 256 + 3


class ModelCfg(_Section):
    n_layers: int = Field(4, ge=1)
    d_model: int = Field(128, ge=8)
    n_heads: int = Field(4, ge=1)
    n_kv_heads: Optional[int] = Field(None, description="Grouped-query attention; defaults to n_heads.")
    ffn_mult: float = Field(8 / 3, description="SwiGLU hidden = ffn_mult × d_model, rounded up to 32.")
    seq_len: int = Field(128, ge=8)
    vocab_size: Optional[int] = Field(None, description="Defaults to the tokenizer's vocab.")
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    @model_validator(mode="after")
    def _heads(self) -> "ModelCfg":
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={kv}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("model.d_model / model.n_heads must be even for RoPE")
        return self


class ParallelCfg(_Section):
    """How the world (launcher nodes × processes per node) is split, torchtitan-style.

    ``dp_replicate × dp_shard × tp × pp × cp`` must equal the world size; one of the two DP axes may
    be -1 (= whatever the others leave). dp_shard > 1 is FSDP2 (``fully_shard``), dp_replicate > 1
    alone is DDP, both is HSDP. Pipeline and context parallelism are not implemented: pp and cp must
    be 1."""

    dp_replicate: int = Field(-1, description="Replicated data-parallel degree (DDP); -1 = the rest.")
    dp_shard: int = Field(1, description="Sharded data-parallel degree (FSDP2); -1 = the rest.")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (DTensor, attention heads and MLP).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel degree (not implemented: 1).")
    cp: int = Field(1, ge=1, description="Context-parallel degree (not implemented: 1).")
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    compile: bool = Field(False, description="torch.compile the model (parallel.compile_scope says how much).")
    compile_scope: Literal["auto", "block", "model"] = Field(
        "auto", description="With compile: 'model' compiles the embedding, every block and the final norm as one "
        "graph (the LM head's chunked loss stays outside), 'block' each transformer block on its own (what FSDP2 "
        "and TP need: their hooks are per block); 'auto' = model on one process, block on several. The same "
        "numbers to float rounding, so not part of the stage's key.")
    unhashed: ClassVar[frozenset[str]] = frozenset({"compile_scope"})  # how much one graph holds, not what it computes

    @model_validator(mode="after")
    def _axes(self) -> "ParallelCfg":
        if self.dp_shard == -1 and "dp_replicate" not in self.model_fields_set:
            self.__dict__["dp_replicate"] = 1  # "shard over the rest": FSDP, not HSDP
        for name in ("dp_replicate", "dp_shard"):
            v = getattr(self, name)
            if v == 0 or v < -1:
                raise ValueError(f"parallel.{name}={v}: use a positive degree or -1 (the rest of the world)")
        if self.dp_replicate == -1 and self.dp_shard == -1:
            raise ValueError("parallel.dp_replicate and parallel.dp_shard are both -1: at most one may take the rest")
        if self.pp != 1:
            raise ValueError(f"parallel.pp={self.pp}: pipeline parallelism is not implemented; set parallel.pp=1 "
                             "(shard with parallel.dp_shard / parallel.tp instead)")
        if self.cp != 1:
            raise ValueError(f"parallel.cp={self.cp}: context parallelism is not implemented; set parallel.cp=1")
        if self.compile and self.compile_scope == "model" and (self.tp > 1 or self.dp_shard != 1):
            raise ValueError("parallel.compile_scope=model compiles the whole model as one graph, but FSDP2 "
                             "(parallel.dp_shard) and TP (parallel.tp) wrap each block on its own; use "
                             "parallel.compile_scope=block or auto")
        return self

    def resolve(self, world: int) -> dict[str, int]:
        """Concrete degrees for a world size; raises ValueError saying what does not add up."""
        fixed = self.tp * self.pp * self.cp
        rep, shard = self.dp_replicate, self.dp_shard
        if rep == -1 or shard == -1:
            known = shard if rep == -1 else rep
            if world % (fixed * known):
                raise ValueError(f"world size {world} is not divisible by tp×pp×cp×{'dp_shard' if rep == -1 else 'dp_replicate'}"
                                 f" = {fixed * known}")
            rest = world // (fixed * known)
            rep, shard = (rest, shard) if rep == -1 else (rep, rest)
        if rep * shard * fixed != world:
            raise ValueError(f"parallel degrees dp_replicate×dp_shard×tp×pp×cp = {rep}×{shard}×{self.tp}×{self.pp}×"
                             f"{self.cp} = {rep * shard * fixed} but the launcher gives world size {world} "
                             "(nnodes × nproc_per_node); make them equal")
        return {"dp_replicate": rep, "dp_shard": shard, "tp": self.tp, "pp": self.pp, "cp": self.cp,
                "dp": rep * shard}


class TrainCfg(_Section):
    # validation during training reads the weights and changes none (no dropout, no RNG): not part of the stage's key,
    # so turning it on or off does not start a running week-long training over
    unhashed: ClassVar[frozenset[str]] = frozenset({"eval_every", "eval_tokens", "preempt_grace_s", "hang_timeout_s",
                                                    "loss_chunk_tokens"})

    steps: int = Field(200, ge=1)
    micro_batch: int = Field(8, ge=1, description="Sequences per rank per micro step.")
    grad_accum: int = Field(1, ge=1)
    global_batch: Optional[int] = Field(
        None, ge=1, description="Sequences per optimizer step; when set it must equal micro_batch × grad_accum × "
        "DP degree (checked), else it is derived from them.")
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = Field(20, ge=0)
    schedule: Literal["cosine", "wsd"] = Field(
        "cosine", description="After linear warmup: 'cosine' decays to min_lr_ratio·lr over the remaining steps; "
        "'wsd' (warmup-stable-decay) holds lr, then decays linearly to min_lr_ratio·lr over the last "
        "decay_fraction of the steps.")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: share of train.steps spent decaying.")
    prefetch: int = Field(2, ge=0, description="Steps of batches a loader thread prepares ahead (0 = inline).")
    loss_chunk_tokens: int | Literal["auto"] = Field(
        "auto", description="The LM head and cross-entropy run on this many tokens at a time, their gradients "
        "computed in the forward, so no full-vocabulary fp32 logits exist (pipelines/train/loss.py); 'auto' = the "
        "largest power of two whose logits hold at most 2^27 values (2,048 tokens at a 50,304 vocabulary); 0 = the "
        "whole micro batch's logits at once (nanoGPT's way). The same loss and gradients to float rounding, so not "
        "part of the stage's key (a run can change it and resume).")
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    ckpt_every: int | Literal["auto"] = Field(
        100, description="Save a checkpoint to L0 every N steps (and at the end); 'auto' = the Young/Daly interval "
        "√(2·C·MTBF) from the measured save stall C and checkpoint.mtbf_hours / nodes, re-computed after each save.")
    resume: int | Literal["auto", "never"] = Field(
        "auto", description="'auto': restore the newest step that verifies on the nearest tier (L0 → L1 → L2); "
        "'never': start at step 0; a number: restore exactly that step (fail if no tier holds a verified copy).")
    max_rollbacks: int = Field(3, ge=0, description="Loss spikes / non-finite steps rolled back before the run fails.")
    spike_window: int = Field(50, ge=2, description="Trailing losses the spike test compares with.")
    spike_sigma: float = Field(6.0, gt=0, description="A loss above mean + spike_sigma·σ of the window is a spike.")
    spike_min_history: int = Field(20, ge=2, description="Losses needed in the window before spikes are tested.")
    preempt_grace_s: float = Field(
        25.0, gt=0, description="On SIGTERM / SIGUSR1 (a preemption notice) the ranks finish the step, checkpoint it to "
        "L0 and commit it to L1 within this many seconds, then exit with the retry code (75). The default fits "
        "Kubernetes' 30 s terminationGracePeriodSeconds; the rendered jobs set the pod's grace to this + 5 s.")
    hang_timeout_s: float = Field(
        300.0, gt=0, description="A rank whose heartbeat (its step progress) is silent this long is hung: the log names "
        "it and what it was doing (its stack when it can answer), it is killed and torchrun restarts the ranks from the "
        "newest verified step. Far below checkpoint.collective_timeout_minutes; above the longest step or "
        "evaluation. A phase with waits bounded by the collective timeout (start-up, restore, rollback, the first "
        "step and evaluation of a start, every save, rank 0's MLflow calls, the preemption checkpoint, the final "
        "close) is allowed checkpoint.collective_timeout_minutes more per wait (the final close 3.5 times).")

    def shutdown_grace_s(self) -> int:
        """Seconds torchrun (``--shutdown-timeout``) and a pod (terminationGracePeriodSeconds) give the ranks after a
        preemption notice: their checkpoint (``preempt_grace_s``) and 5 s to exit."""
        return math.ceil(self.preempt_grace_s) + 5

    @model_validator(mode="after")
    def _numbers(self) -> "TrainCfg":
        if isinstance(self.ckpt_every, int) and self.ckpt_every < 1:
            raise ValueError(f"train.ckpt_every={self.ckpt_every}: use a number of steps ≥ 1 or 'auto'")
        if isinstance(self.resume, int) and self.resume < 1:
            raise ValueError(f"train.resume={self.resume}: use 'auto', 'never' or a saved step ≥ 1")
        chunk = self.loss_chunk_tokens
        if chunk != "auto" and (chunk < 0 or 0 < chunk < 64):
            raise ValueError(f"train.loss_chunk_tokens={chunk!r}: use 'auto', 0 (the full logits) or a number of "
                             "tokens ≥ 64 (each chunk adds a pass over the head's gradient)")
        return self
    log_every: int = Field(10, ge=1)
    dtype: Literal["fp32", "bf16"] = "fp32"
    eval_every: int = Field(50, ge=0, description="Validation every N steps (and at the last step): the loss on a "
                            "fixed slice of the held-out shards, every rank taking part; 0 = off.")
    eval_tokens: int = Field(8192, ge=1, description="The validation slice: the first eval_tokens tokens of the "
                             "held-out split (whole windows of model.seq_len), the same at every evaluation and on "
                             "every rank layout.")
    mixture: dict[str, float] = Field(
        default_factory=dict, description="Data mixture of the train split, {SOURCE: weight}: a SOURCE is an input's "
        "key as lineage names it (a doc's `source`) or an fnmatch glob over the keys; '*' weighs every source no other "
        "key matches (without it every source must be matched: say '*': 1 or '*': 0). Weights normalise to shares of "
        "the trained samples (= tokens); 0 leaves a source out; a small source is upsampled (its epochs are "
        "counted), a large one capped. A key that matches no source, or a source two globs match, fails the train "
        "stage at start (exit 2). {} (default): every train token in corpus order, as without mixtures. Held-out "
        "data is never mixed.")

    @field_validator("mixture")
    @classmethod
    def _mixture(cls, v: dict[str, float]) -> dict[str, float]:
        for k, w in v.items():
            if not k.strip():
                raise ValueError("an empty key; use an input key or a glob ('*': every source not named)")
            if not 0 <= w < float("inf"):
                raise ValueError(f"{k!r}: weight {w} must be a finite number ≥ 0")
        return v

    def hashed(self) -> dict:
        d = super().hashed()
        if not self.mixture:  # no mixture: the same stage key (and checkpoints) as before train.mixture existed
            d.pop("mixture")
        return d


# GPUs per node of the EC2 instance types a GPU node group may use (AWS's instance type pages): the launcher refuses a
# job that asks a node for more (its pods would stay Pending), and pipelines.cluster_config sets nproc_per_node from it
GPUS_PER_INSTANCE_TYPE: dict[str, int] = {
    "p5.48xlarge": 8, "p5e.48xlarge": 8, "p5en.48xlarge": 8, "p5.4xlarge": 1, "p4d.24xlarge": 8, "p4de.24xlarge": 8,
    "p6-b200.48xlarge": 8, "g6e.xlarge": 1, "g6e.2xlarge": 1, "g6e.4xlarge": 1, "g6e.8xlarge": 1, "g6e.16xlarge": 1,
    "g6e.12xlarge": 4, "g6e.24xlarge": 4, "g6e.48xlarge": 8, "g6.xlarge": 1, "g6.2xlarge": 1, "g6.4xlarge": 1,
    "g6.8xlarge": 1, "g6.16xlarge": 1, "g6.12xlarge": 4, "g6.24xlarge": 4, "g6.48xlarge": 8, "g5.xlarge": 1,
    "g5.2xlarge": 1, "g5.4xlarge": 1, "g5.8xlarge": 1, "g5.16xlarge": 1, "g5.12xlarge": 4, "g5.24xlarge": 4,
    "g5.48xlarge": 8}
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


class LauncherCfg(_Section):
    # which ClusterTrainingRuntime a TrainJob references does not change what the ranks compute, and a field new to
    # the key would re-key every train stage (a running week-long run would start over): not part of the key. (The
    # API credentials a connection gives never enter the spec: pipelines.launch.k8s.kube_target.)
    unhashed: ClassVar[frozenset[str]] = frozenset({"runtime", "pending_minutes"})
    kind: Literal["local", "trainjob", "pytorchjob", "kubernetes"] = Field(
        "local", description="'local': torchrun subprocesses here; 'trainjob': a Kubeflow Trainer v2 TrainJob "
        "(trainer.kubeflow.org/v1alpha1, the current API); 'pytorchjob': a training-operator v1 PyTorchJob "
        "(kubeflow.org/v1, in maintenance; the one with elastic min_nodes); 'kubernetes': the default Kubernetes "
        "kind, trainjob.")
    runtime: str = Field("torch-distributed", description="TrainJob: the ClusterTrainingRuntime it references "
                         "(Trainer's torch-distributed; infra/terraform installs it).")
    nproc_per_node: int = Field(2, ge=1)
    nnodes: int = Field(1, ge=1)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    threads_per_proc: int = Field(1, ge=1, description="OMP/torch threads per rank on CPU.")
    # a Kubernetes kind: the job (TrainJob or PyTorchJob) the launcher renders (pipelines.launch.k8s)
    image: str = Field("ghcr.io/llm-pipeline/trainer:latest", description="Container image with this package.")
    namespace: str = "llm-pipeline"
    efa_per_node: int = Field(0, ge=0, description="EFA interfaces per node (vpc.amazonaws.com/efa); 32 on p5.48xlarge.")
    shared_fs_claim: Optional[str] = Field(
        "fsx-checkpoints", description="PersistentVolumeClaim of the shared filesystem (L1 tier), mounted at "
        "launcher.shared_fs_mount in the pods.")
    shared_fs_mount: str = Field(
        "/fsx", description="Where the shared filesystem is mounted, in the pods and on the Airflow workers alike: "
        "run.root and checkpoint.l1 must be under it so the stage and the pods see the same paths; checkpoint.l0 "
        "is either under it too (one shared L0) or an absolute path outside it (node-local L0, see "
        "launcher.node_local_path).")
    node_local_path: Optional[str] = Field(
        None, description="Node-local L0: when checkpoint.l0 is an absolute path outside launcher.shared_fs_mount, "
        "the training pods mount each host's own disk there: this host path (e.g. /mnt/k8s-disks/0/llm-pipeline), "
        "or None = an emptyDir, which is on the instance-store NVMe where the GPU node group's launch template "
        "puts the kubelet on it (RAID0, infra/terraform).")
    service_account: Optional[str] = Field(
        None, description="Service account of the training pods (IRSA: checkpoints read/write); None = the "
        "namespace's default.")
    kubeconfig: Optional[str] = Field(
        None, description="kubeconfig file; None = in-cluster credentials when running in a pod, else $KUBECONFIG "
        "or ~/.kube/config.")
    kube_context: Optional[str] = Field(None, description="kubeconfig context (None = its current context).")
    poll_seconds: float = Field(
        10.0, gt=0, description="How often the launcher polls the job's (TrainJob or PyTorchJob) status.")
    timeout_minutes: Optional[float] = Field(
        None, gt=0, description="Delete the job (TrainJob or PyTorchJob), or stop the local torchrun and its ranks, "
        "and fail (exit 75) when it has not finished by then (None = no limit).")
    pending_minutes: Optional[float] = Field(
        60.0, gt=0, description="Delete the job and fail (exit 75, the pods' reasons in the message) when none of its "
        "pods has started for this long: all Pending (no node with the GPUs it asks for, an image that cannot be "
        "pulled) or none created. A suspended job (held by a queue such as Kueue) does not count; None = no limit.")
    node_selector: dict[str, str] = Field(
        default_factory=lambda: {"node.kubernetes.io/instance-type": "p5.48xlarge"},
        description="Pod node selector (the GPU node group).")
    min_nodes: Optional[int] = Field(None, ge=1, description="Elastic: fewest nodes the job may shrink to (None = nnodes).")
    max_restarts: int = Field(3, ge=0, description="Elastic restarts torchrun may take before the job fails.")

    @property
    def on_kubernetes(self) -> bool:
        return self.kind != "local"

    @property
    def job_kind(self) -> Literal["trainjob", "pytorchjob"]:
        """The Kubernetes job the launcher renders: 'kubernetes' means the current API, a TrainJob."""
        return "pytorchjob" if self.kind == "pytorchjob" else "trainjob"

    @model_validator(mode="after")
    def _elastic(self) -> "LauncherCfg":
        if self.kind in ("trainjob", "kubernetes") and self.min_nodes is not None and self.min_nodes < self.nnodes:
            raise ValueError(f"launcher.min_nodes={self.min_nodes} < nnodes={self.nnodes}: a TrainJob has no elastic "
                             "range (Trainer v2 removed it); use launcher.kind=pytorchjob or drop min_nodes")
        return self

    @model_validator(mode="after")
    def _fits_the_node(self) -> "LauncherCfg":
        """A job asking a node for more GPUs than its instance type has would wait Pending forever."""
        itype = self.node_selector.get(INSTANCE_TYPE_LABEL)
        gpus = GPUS_PER_INSTANCE_TYPE.get(itype or "")
        if self.on_kubernetes and gpus is not None and self.nproc_per_node > gpus:
            raise ValueError(f"launcher.nproc_per_node={self.nproc_per_node} but launcher.node_selector's {itype} "
                             f"has {gpus} GPU{'s' if gpus > 1 else ''} per node: set nproc_per_node ≤ {gpus}, or "
                             "select a larger instance type")
        return self


class TiersCfg(_Section):
    # how storage calls are bounded and fenced changes no byte of a checkpoint: not part of the stage's key
    unhashed: ClassVar[frozenset[str]] = frozenset({"s3_connect_timeout_s", "s3_read_timeout_s", "s3_max_attempts",
                                                    "s3_min_mb_per_s", "lease_s", "l1_hold_for_l2",
                                                    "restore_past_unanswered"})
    l0: str = "var/tiers/nvme"
    l1: str = "var/tiers/shared"
    l2_prefix: str = Field("checkpoints", description="Key prefix in services.s3_bucket.")
    multipart_threshold_mb: int = Field(8, ge=5, le=4096)  # a PutObject holds at most 5 GiB
    multipart_chunk_mb: int = Field(8, ge=5)
    async_mode: Literal["thread", "sync"] = Field(
        "thread", description="'thread': training blocks only while the state is staged to host memory, DCP writes "
        "the shards in a background thread (one save in flight); 'sync': every rank waits for the write.")
    promote_during_run: bool = Field(
        True, description="A background promoter on rank 0 copies each committed step L0 → L1 → L2 while training "
        "runs (L2 only when an S3 endpoint is reachable) and applies the retention below.")
    keep_l0: int = Field(2, ge=1, description="Committed steps kept on L0 (the newest ones).")
    keep_l1: int = Field(5, ge=1, description="Committed steps kept on L1.")
    keep_l2: int = Field(1, ge=1, description="Newest steps kept on L2, besides those kept by l2_keep_every.")
    l2_keep_every: int = Field(0, ge=0, description="Also keep L2 steps that are multiples of this (0 = keep all).")
    restore_past_unanswered: bool = Field(
        False, description="A restore that finds a newer step in a tier that does not answer, or whose copy fails to "
        "be read (EIO …; a node's L0 that cannot be listed may hold any), stops (exit 75: a retry looks again; exit 2 "
        "for copies refused to this user) rather than resume from an older step, whose line of training would give "
        "the newer ones up for good; true resumes from the newest step that restores now (logged).")
    l1_hold_for_l2: int = Field(
        5, ge=0, description="While L2 lags (an outage), L1 retention also keeps up to this many of the newest steps "
        "that L2 would keep (l2_keep_every) and has not got yet, so they reach it when it answers; past that the "
        "oldest of them leave L1 with a warning and a ckpt/l2_dropped metric (L1 stays bounded whatever L2 does).")
    mtbf_hours: float = Field(
        5000.0, gt=0, description="Mean time between failures of one node, for train.ckpt_every=auto (the job's MTBF "
        "is this / nodes). Llama 3's 405B run saw 466 interruptions in 54 days on 2,048 nodes: ≈ 5,700 h per node.")
    probe_step: int = Field(10, ge=1, description="train.ckpt_every=auto: first save (measures the stall) at this step.")
    collective_timeout_minutes: float = Field(
        30.0, gt=0, description="init_process_group timeout: how long a rank waits in a collective (a save "
        "stall must fit in it).")
    s3_connect_timeout_s: float = Field(5.0, gt=0, description="L2: seconds to open a connection to the endpoint.")
    s3_read_timeout_s: float = Field(
        20.0, gt=0, description="L2: seconds a request may wait for the endpoint's next bytes (a hung endpoint costs "
        "this × s3_max_attempts per call, not minutes).")
    s3_max_attempts: int = Field(3, ge=1, description="L2: attempts per request (botocore's standard retry mode).")
    s3_min_mb_per_s: float = Field(
        5.0, gt=0, description="L2: the slowest transfer accepted: a call on N MiB gives up after "
        "connect + read timeouts + N / this seconds (its total bound).")
    lease_s: float = Field(
        60.0, gt=0, description="Fencing: an attempt's lease on L1 expires this long after its last renewal (renewed "
        "every third of it while the attempt runs); an attempt superseded by a newer term, or whose lease expired, "
        "never commits, and start-up cleanup removes only the temp files of attempts whose lease has expired "
        "(pipelines.train.ckpt.fence).")


class EvalCfg(_Section):
    reference: list[str] = Field(
        default_factory=lambda: ["data/reference/tinystories_val_tail.txt", "data/reference/tinyshakespeare_tail.txt"],
        min_length=1, description="The fixed reference set (plain text or JSONL with `text`): its bits-per-byte is the "
        "gate metric, comparable across corpora and tokenizers; its sha256 is checked before two numbers are compared.")
    tasks: list[str] = Field(
        default_factory=lambda: ["llmp_arc_easy", "llmp_hellaswag", "llmp_lambada_openai"],
        description="lm-evaluation-harness tasks, groups or tags ([] = none): any name lm-eval's TaskManager knows "
                    "(its own tasks, ours in pipelines/eval/tasks, the YAMLs in eval.include_path). Built offline: a "
                    "task whose data is neither local nor in the Hugging Face cache fails the stages' spec check with "
                    "its name and why. Default: ours (llmp_*: upstream's prompts and metrics on local slices, read "
                    "from eval.data_dir). Decontamination reads every task's items through lm-eval's task objects.")
    include_path: list[str] = Field(
        default_factory=list, description="Folders of lm-eval task YAMLs, as lm-eval's --include_path (relative "
        "paths resolve against the project root; a later folder overrides a task name of an earlier one). A YAML's "
        "!function code runs when its task is built: list only folders you trust.")
    limit: Optional[int] = Field(100, ge=1, description="Items per task, in file order (None = every item).")
    data_dir: str = Field("data/eval", description="Our llmp_* tasks' files (the repo ships 500-item slices; "
                          "../shared/data/eval has the full sets).")
    single_process_max_params: int = Field(
        500_000_000, ge=0, description="Bigger models are scored on the launcher's ranks (torchrun here, a PyTorchJob "
        "on Kubernetes), each rank a share of the windows and harness requests, not in the Airflow worker.")
    sample_prompt: str = Field("Once upon a time", description="Prompt of the sample generation in the report.")
    sample_max_new_tokens: int = Field(40, ge=1)
    max_new_tokens: int = Field(256, ge=1, description="The most tokens one request may generate: the served model "
                                "refuses more with HTTP 400, the harness's generate_until is capped at it.")
    max_tokens: Optional[int] = Field(None, description="Cap on held-out tokens scored (diagnostic).")
    batch_size: int = 16

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, v: list[str]) -> list[str]:
        """Names non-empty and none twice; whether lm-eval knows a name and can build its task offline is the
        stages' check (``pipelines.eval_sets.eval_tasks``: seconds, lm-eval's index)."""
        bad = [n for n in v if not isinstance(n, str) or not n.strip()]
        if bad:
            raise ValueError(f"task names must be non-empty strings, got {bad}")
        twice = sorted({n for n in v if list(v).count(n) > 1})
        if twice:
            raise ValueError(f"task(s) {twice} listed more than once")
        return v


class RegistryCfg(_Section):
    model_name: str = Field("llm-pipeline-gpt", description="The registered model's name: letters, digits, '_', "
                            "'-', '.' and spaces (it is quoted in the registry's search filters and in models:/ URIs).")
    alias: str = Field("champion", description="The alias the gate moves: letters, digits, '_' and '-'.")
    gate_metric: Literal["reference_bpb", "heldout_loss", "heldout_bpb"] = Field(
        "reference_bpb", description="Lower is better. reference_bpb is compared only on the same reference set "
        "(sha256); heldout_* are on each run's own corpus, so only comparable between runs of the same data.")

    @field_validator("model_name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        return name_like(v, r"[A-Za-z0-9_][A-Za-z0-9_.\- ]{0,199}", "is not a model name this pipeline can search for "
                         "and load: use letters, digits, '_', '-', '.' and spaces (no quotes, '/', ':' or '@'), 1 to 200 "
                         "characters")

    @field_validator("alias")
    @classmethod
    def _plain_alias(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_\-]{1,200}", v) or re.fullmatch(r"latest|v\d+", v, re.IGNORECASE):
            raise ValueError(f"{v!r} is not an alias the registry takes: letters, digits, '_' and '-', not 'latest' "
                             "nor v<number>")
        return v


class ServicesCfg(_Section):
    spark_master: str = "local[*]"
    spark_driver_memory: str = "2g"
    spark_executor_wait_minutes: float = Field(
        10.0, gt=0, le=1440, allow_inf_nan=False, description="A stage on a cluster master (k8s://, spark://) waits this long for an executor to "
        "run its first task (pods Pending for want of a node, an image that cannot be pulled) before it exits 75.")
    spark_conf: dict[str, str] = Field(
        default_factory=dict, description="Extra Spark conf for the sessions the stages build themselves and for "
        "spark-submit (e.g. spark.speculation: 'true'); under spark-submit its own --conf stand.")
    spark_image: Optional[str] = Field(
        None, description="k8s:// master: executor image (Java 17 + pyspark + this package); required there.")
    spark_namespace: str = Field("llm-pipeline", description="k8s:// master: namespace of the executor pods.")
    spark_service_account: str = Field("spark", description="k8s:// master: service account of the executors (IRSA).")
    spark_local_dir: Optional[str] = Field(
        None, description="k8s:// master: host path for the executors' spark.local.dir (shuffle, spills), e.g. the "
        "node's instance-store NVMe; None = an emptyDir (on the instance store where the node group puts the "
        "kubelet there). The shared file system (launcher.shared_fs_claim) is mounted on driver and executors.")
    s3_endpoint_url: Optional[str] = Field(
        None, description="None = the embedded S3-compatible endpoint on 127.0.0.1; 'aws' = AWS's own "
        "endpoint; a URL = that S3-compatible endpoint."
    )
    s3_bucket: str = "llm-pipeline"
    s3_region: str = "us-east-1"
    shards_uri: Optional[str] = Field(
        None, description="s3://bucket/prefix: tokenize also publishes its result to <shards_uri>/<stage dir>/ "
        "(each Spark task uploads the shards it wrote, checked with S3's SHA-256 checksums; the driver checks every "
        "object and uploads manifest.json last). None = the stage directory only. A location, not in the hash.")

    @field_validator("s3_endpoint_url")
    @classmethod
    def _endpoint(cls, v: Optional[str]) -> Optional[str]:
        if v is None or v == "aws":
            return v
        scheme, _, rest = v.partition("://")
        if scheme not in ("http", "https") or not rest.split("/")[0]:
            raise ValueError("must be 'aws' or an http(s)://host[:port] URL (S3_ENDPOINT_URL sets it too)")
        return v

    @field_validator("shards_uri")
    @classmethod
    def _s3_uri(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (not v.startswith("s3://") or not v[5:].split("/")[0]):
            raise ValueError("must be s3://bucket[/prefix]")
        return v.rstrip("/") if v else v
    mlflow_tracking_uri: str = "sqlite:///var/mlflow.db"
    mlflow_ui_url: str = Field("http://127.0.0.1:5000", description="Where the MLflow UI is served (`mlflow ui` "
                               "default): the Airflow tasks' extra links point there.")
    mlflow_artifact_root: str = "var/mlartifacts"
    # Airflow connections: when the named connection exists (set in the UI, by `airflow connections`, an env var or a
    # secrets backend), the DAG's tasks take the service's address and credentials from it instead of the values
    # above (plugins/llm_connections.py: resolve); absent, these values are used.
    spark_conn_id: str = Field("spark_pipeline", description="Spark connection (host = the master).")
    aws_conn_id: str = Field("aws_default", description="AWS connection: login/password = the access key, "
                             "extra endpoint_url = the S3 endpoint, extra region_name = the region.")
    mlflow_conn_id: str = Field("mlflow_default", description="MLflow tracking connection (http): host[:port] = "
                                "the tracking URI, login/password = its basic-auth login, extra ui_url = the UI "
                                "the extra links point at (default: the tracking server's http(s) address).")
    kube_conn_id: str = Field("kubernetes_default", description="Kubernetes connection: extra kube_config_path, "
                              "kube_config (the file's content), in_cluster, cluster_context.")


ENV_OVERRIDES = {
    "SPARK_MASTER": ("services", "spark_master"),
    "S3_ENDPOINT_URL": ("services", "s3_endpoint_url"),
    "S3_BUCKET": ("services", "s3_bucket"),
    "S3_REGION": ("services", "s3_region"),
    "MLFLOW_TRACKING_URI": ("services", "mlflow_tracking_uri"),
    "MLFLOW_UI_URL": ("services", "mlflow_ui_url"),
}

class JobSpec(_Section):
    run: RunCfg = Field(default_factory=RunCfg)
    data: DataCfg = Field(default_factory=DataCfg)
    tokenizer: TokenizerCfg = Field(default_factory=TokenizerCfg)
    model: ModelCfg = Field(default_factory=ModelCfg)
    train: TrainCfg = Field(default_factory=TrainCfg)
    parallel: ParallelCfg = Field(default_factory=ParallelCfg)
    launcher: LauncherCfg = Field(default_factory=LauncherCfg)
    checkpoint: TiersCfg = Field(default_factory=TiersCfg)
    eval: EvalCfg = Field(default_factory=EvalCfg)
    registry: RegistryCfg = Field(default_factory=RegistryCfg)
    services: ServicesCfg = Field(default_factory=ServicesCfg)

    @model_validator(mode="after")
    def _world(self) -> "JobSpec":
        try:
            deg = self.parallel.resolve(self.world_size)
        except ValueError as e:
            raise ValueError(str(e)) from None
        m, tp = self.model, deg["tp"]
        kv = m.n_kv_heads or m.n_heads
        if tp > 1 and (m.n_heads % tp or kv % tp):
            raise ValueError(f"parallel.tp={tp} must divide model.n_heads={m.n_heads} and the KV heads ({kv}): "
                             "each TP rank computes whole heads")
        if tp > 1 and deg["dp_replicate"] > 1 and deg["dp_shard"] == 1:
            raise ValueError(f"parallel.tp={tp} with DDP (parallel.dp_replicate={deg['dp_replicate']}): tensor "
                             "parallel combines with FSDP2, not DDP; set parallel.dp_shard to the data-parallel "
                             "degree and parallel.dp_replicate=1")
        t = self.train
        if t.global_batch is not None and t.micro_batch * t.grad_accum * deg["dp"] != t.global_batch:
            raise ValueError(
                f"train.global_batch={t.global_batch} but train.micro_batch × train.grad_accum × DP = "
                f"{t.micro_batch} × {t.grad_accum} × {deg['dp']} = {t.micro_batch * t.grad_accum * deg['dp']}; "
                "change one of them (DP = parallel.dp_replicate × parallel.dp_shard)")
        return self

    @property
    def world_size(self) -> int:
        return self.launcher.nproc_per_node * self.launcher.nnodes

    @property
    def degrees(self) -> dict[str, int]:
        """Resolved parallel degrees (dp_replicate, dp_shard, tp, pp, cp, dp)."""
        return self.parallel.resolve(self.world_size)

    @property
    def global_batch(self) -> int:
        return self.train.micro_batch * self.train.grad_accum * self.degrees["dp"]

    def value(self, dotted: str, hashed: bool = False) -> Any:
        """The value at a dotted key (``data.schedule``); a section as plain JSON (``hashed``: as the stage hash
        sees it)."""
        obj: Any = self
        for part in dotted.split("."):
            obj = getattr(obj, part)
        if hashed and isinstance(obj, _Section):
            return obj.hashed()
        return obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj

    def stage_hash(self, stage: str) -> str:
        """sha256 over the sections ``stage`` reads (canonical JSON)."""
        sections = stage_entry(stage).sections
        payload = {s: self.value(s, hashed=True) for s in sections}
        return sha256_json(payload)

    def to_yaml(self, secrets: bool = False) -> str:
        """The spec as YAML; URL passwords redacted unless ``secrets`` (only for the work file of the processes that
        use them, written with mode 0600: an artifact, a log or a manifest never carries them)."""
        text = yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
        return text if secrets else redact(text)

    def write_work_file(self, path) -> Path:
        """The spec with its secrets, for the stage's own processes (ranks, scorers): mode 0600."""
        p = Path(path)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_yaml(secrets=True))
        os.chmod(p, 0o600)
        return p


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (``https://user:secret@host`` →
    ``https://user:***@host``): for whatever goes into a log, an artifact, a tag or a manifest."""
    return re.sub(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/\s:@]*):(?P<pw>[^/\s@]*)@",
                  lambda m: f"{m['scheme']}{m['user']}:***@", str(text))


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class SpecError(ValueError):
    """A spec that cannot be used; the message says what to fix."""


def _parse_scalar(text: str) -> Any:
    """``--set`` values are parsed as YAML scalars/lists (``10`` → int, ``[a, b]`` → list)."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as e:
        raise SpecError(f"value {text!r} is not YAML ({_yaml_problem(e)}); quote it or close its brackets") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line: what and where (line and column), without the excerpt it quotes."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{getattr(e, 'problem', None) or type(e).__name__}{where}"


def apply_overrides(raw: dict, overrides: dict[str, Any] | list[str] | None) -> dict:
    if not overrides:
        return raw
    items = overrides.items() if isinstance(overrides, dict) else (_split_kv(o) for o in overrides)
    for key, value in items:
        node = raw
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise SpecError(f"override {key!r}: {p!r} is not a section")
        node[parts[-1]] = value
    return raw


def _split_kv(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise SpecError(f"override {item!r} must look like section.key=value")
    k, v = item.split("=", 1)
    return k.strip(), _parse_scalar(v)


def load_spec(
    path: str | os.PathLike | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    env: Optional[dict[str, str]] = None,
) -> JobSpec:
    """Read a YAML spec (or defaults when ``path`` is None), apply overrides and env, validate."""
    raw: dict = {}
    if path is not None:
        p = resolve_path(path)
        if not p.is_file():
            raise SpecError(f"spec file {p} does not exist; pass an existing YAML file (see configs/)")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise SpecError(f"spec file {p} is not UTF-8 text (byte {e.start}); pass a YAML file") from None
        except yaml.YAMLError as e:
            raise SpecError(f"spec file {p} is not valid YAML: {_yaml_problem(e)}") from None
        except OSError as e:  # refused (2), or a disk that failed under it: the caller's exit rule for OSError
            if e.errno in (errno.EACCES, errno.EPERM):
                raise SpecError(f"spec file {p} cannot be read ({e.strerror}): give this user read access") from None
            raise
        if not isinstance(loaded, dict):
            raise SpecError(f"spec file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        raw = loaded
    raw = apply_overrides(raw, overrides)
    env = os.environ if env is None else env
    for var, (section, key) in ENV_OVERRIDES.items():
        if env.get(var):
            if raw.get(section) is None:  # absent, or "services:" left empty
                raw[section] = {}
            if not isinstance(raw[section], dict):
                raise SpecError(f"{section}: must be a mapping of settings, got {type(raw[section]).__name__} "
                                f"(and {var} sets {section}.{key})")
            raw[section][key] = env[var]
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "spec"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {loc}: {msg}" + (f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""))
        where = f" in {path}" if path else ""
        raise SpecError(f"invalid job spec{where}:\n" + "\n".join(lines)) from None


def add_spec_args(parser) -> None:
    """The spec flags every stage CLI takes."""
    parser.add_argument("--spec", default=None, help="Job spec YAML (default: embedded defaults).")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="Override a spec value, e.g. --set train.steps=50 (repeatable).",
    )


def spec_from_args(args) -> JobSpec:
    """The spec of a stage CLI; a spec the user must fix ends the process with exit status 2 and the message
    (which names the key), no traceback. Orchestrators do not retry status 2."""
    try:
        return load_spec(args.spec, args.overrides)
    except SpecError as e:
        print(f"spec: error: {e}", file=sys.stderr)
        raise SystemExit(USER_ERROR) from None


if __name__ == "__main__":  # pragma: no cover - convenience: print the effective spec
    import argparse

    ap = argparse.ArgumentParser(description="Validate a job spec and print it with defaults filled in.")
    add_spec_args(ap)
    a = ap.parse_args()
    print(spec_from_args(a).to_yaml())
