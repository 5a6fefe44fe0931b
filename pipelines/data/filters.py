"""Quality filters (Gopher quality + repetition rules) with a reason for every removed doc.

Rules follow Rae et al. 2021 ("Scaling Language Models: Methods, Analysis & Insights from Training
Gopher", appendix A.1.1) with their published thresholds as defaults (``FilterCfg``). Each rule is a
pure function ``doc stats → reason | None``; the first rule that fires names the removal reason,
written as ``filter_reason`` on the removed doc and counted in the manifest.

Stage: dedup's ``kept/`` → ``kept.parquet`` + ``removed.parquet`` (+ ``filter_reason``).
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from pipelines.cli import run_and_log, stage_parser
from pipelines.manifest import Manifest, StageDir, input_ref, load_manifest, write_report
from pipelines.progress import progress
from pipelines.spec import FilterCfg, JobSpec, resolve_path, spec_from_args

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
BULLETS = ("•", "*", "-", "–", "—", "‣", "◦", "●", "·")
_WORD_RE = re.compile(r"\S+")
_ALPHA_RE = re.compile(r"[^\W\d_]")


@dataclass
class DocStats:
    words: list[str]
    lines: list[str]

    @classmethod
    def of(cls, text: str) -> "DocStats":
        return cls(words=_WORD_RE.findall(text), lines=[ln for ln in text.split("\n") if ln.strip()])


Rule = Callable[[DocStats, FilterCfg], Optional[str]]


def word_count(s: DocStats, c: FilterCfg) -> Optional[str]:
    n = len(s.words)
    return None if c.min_words <= n <= c.max_words else "gopher_word_count"


def mean_word_length(s: DocStats, c: FilterCfg) -> Optional[str]:
    if not s.words:
        return "gopher_mean_word_len"
    m = sum(len(w) for w in s.words) / len(s.words)
    return None if c.min_mean_word_len <= m <= c.max_mean_word_len else "gopher_mean_word_len"


def symbol_ratio(s: DocStats, c: FilterCfg) -> Optional[str]:
    if not s.words:
        return None
    n = sum(w.count("#") + w.count("...") + w.count("…") for w in s.words)
    return "gopher_symbol_ratio" if n / len(s.words) > c.max_symbol_word_ratio else None


def bullet_lines(s: DocStats, c: FilterCfg) -> Optional[str]:
    if not s.lines:
        return None
    n = sum(ln.lstrip().startswith(BULLETS) for ln in s.lines)
    return "gopher_bullet_lines" if n / len(s.lines) > c.max_bullet_lines_ratio else None


def ellipsis_lines(s: DocStats, c: FilterCfg) -> Optional[str]:
    if not s.lines:
        return None
    n = sum(ln.rstrip().endswith(("...", "…")) for ln in s.lines)
    return "gopher_ellipsis_lines" if n / len(s.lines) > c.max_ellipsis_lines_ratio else None


def alpha_words(s: DocStats, c: FilterCfg) -> Optional[str]:
    if not s.words:
        return None
    n = sum(bool(_ALPHA_RE.search(w)) for w in s.words)
    return "gopher_alpha_words" if n / len(s.words) < c.min_alpha_words_ratio else None


def stop_words(s: DocStats, c: FilterCfg) -> Optional[str]:
    n = sum(w.lower().strip(".,;:!?\"'()") in STOP_WORDS for w in s.words)
    return None if n >= c.stop_words_min else "gopher_stop_words"


def duplicate_lines(s: DocStats, c: FilterCfg) -> Optional[str]:
    if not s.lines:
        return None
    seen: set[str] = set()
    dup_lines = dup_chars = 0
    for ln in s.lines:
        if ln in seen:
            dup_lines += 1
            dup_chars += len(ln)
        seen.add(ln)
    if dup_lines / len(s.lines) > c.max_dup_line_ratio:
        return "gopher_dup_lines"
    total = sum(len(ln) for ln in s.lines)
    if total and dup_chars / total > c.max_dup_line_char_ratio:
        return "gopher_dup_line_chars"
    return None


RULES: list[Rule] = [word_count, mean_word_length, symbol_ratio, bullet_lines, ellipsis_lines,
                     alpha_words, stop_words, duplicate_lines]


def filter_reason(text: str, cfg: FilterCfg, rules: list[Rule] = RULES) -> Optional[str]:
    """The first rule that rejects ``text``, or None when the doc is kept."""
    st = DocStats.of(text)
    for r in rules:
        reason = r(st, cfg)
        if reason:
            return reason
    return None


def filter_docs(src: Path, out: Path, cfg: FilterCfg) -> dict:
    dataset = ds.dataset(str(src), format="parquet")
    schema = dataset.schema
    rm_schema = schema.append(pa.field("filter_reason", pa.string()))
    kept_w = pq.ParquetWriter(out / "kept.parquet", schema, compression="zstd")
    rm_w = pq.ParquetWriter(out / "removed.parquet", rm_schema, compression="zstd")
    reasons: Counter = Counter()
    n_in = n_kept = 0
    with progress(desc="filter", unit="doc", total=dataset.count_rows()) as bar:
        for batch in dataset.to_batches(batch_size=2048):
            tbl = pa.Table.from_batches([batch], schema=schema)
            why = [filter_reason(t, cfg) for t in tbl.column("text").to_pylist()]
            keep = pa.array([w is None for w in why])
            kept = tbl.filter(keep)
            rm = tbl.filter(pc.invert(keep))
            rm = rm.append_column("filter_reason", pa.array([w for w in why if w is not None], pa.string()))
            if kept.num_rows:
                kept_w.write_table(kept)
            if rm.num_rows:
                rm_w.write_table(rm)
            reasons.update(w for w in why if w)
            n_in += tbl.num_rows
            n_kept += kept.num_rows
            bar.update(tbl.num_rows)
    kept_w.close()
    rm_w.close()
    return {"docs_in": n_in, "kept": n_kept, "removed": n_in - n_kept,
            "removed_by_reason": dict(sorted(reasons.items()))}


def run(spec: JobSpec, dedup: Manifest, out_dir: str | None = None) -> Manifest:
    sd = StageDir(resolve_path(spec.run.root), "filter", spec.stage_hash("filter"), [input_ref(dedup)],
                  force=spec.run.force, out_dir=out_dir)

    def body(tmp: Path) -> Manifest:
        counts = filter_docs(dedup.output("kept"), tmp, spec.data.filters)
        return sd.commit({"kept": "kept.parquet", "removed": "removed.parquet"}, counts=counts)

    return run_and_log(spec, sd, body)


def main(argv: list[str] | None = None) -> int:
    ap = stage_parser("pipelines.data.filters", "Gopher quality/repetition filters; removed docs keep a filter_reason.",
                      {"--input-manifest": "Manifest of the dedup stage."})
    args = ap.parse_args(argv)
    m = run(spec_from_args(args), load_manifest(args.input_manifest), args.output)
    write_report(args.report, m)
    c = m.counts
    print(f"filter: {c['docs_in']} docs → {c['kept']} kept, {c['removed']} removed {c['removed_by_reason']}; "
          f"manifest {m.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
