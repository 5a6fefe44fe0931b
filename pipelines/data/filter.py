"""The filter stage: the URL step and the quality filters of :mod:`pipelines.data.quality` over the dedup stage's
kept docs, then the PII step on the kept ones, on Spark; kept docs and removed docs (each with its ``filter_reason``)
as parquet. The manifest's ``extra.url_filter`` counts removals per URL rule (and ``allowed``), ``extra.pii`` the
e-mail, IPv4, IPv6 and phone spans found in kept docs (replaced unless ``data.filters.pii`` is ``report``). A doc of
a source on the takedown list (``data.exclusions``) is removed first (reason ``takedown``; ``extra.takedown``).

    python -m pipelines.data.filter --dedup-manifest M [--spec S] [--set data.filters.steps=[language,c4]]
"""
from __future__ import annotations

import sys
from pathlib import Path

from pipelines.cli import run_and_log, stage_dir, stage_main
from pipelines.lineage import keys, takedowns
from pipelines.data.quality import filter_docs
from pipelines.data.urlfilter import list_files, load_rules
from pipelines.manifest import Manifest, file_ref, input_ref
from pipelines.spec import JobSpec, resolve_path


def run(spec: JobSpec, dedup: Manifest, out_dir: str | None = None, spark=None) -> Manifest:
    applied = takedowns.read_list(resolve_path(spec.data.exclusions))  # read once: what it applies and records
    lists = [*(file_ref(p) for p in list_files(spec.data.filters)), *([applied.ref()] if applied.exclusions else [])]
    sd = stage_dir(spec, "filter", [input_ref(dedup), *lists], out_dir)  # a changed list is a changed input

    def body(tmp: Path) -> Manifest:
        from pipelines.data.spark import dir_bytes, size_shuffles, spec_session, task_count

        rules = load_rules(spec.data.filters)  # a block list line in no accepted form: the spec's error, before Spark
        s = spark or spec_session(spec, "llm-pipeline-filter")
        kept = dedup.output("kept")
        tasks = task_count(s, dir_bytes(kept), spec.data.task_mb, spec.data.filters.partitions)
        size_shuffles(s, tasks)
        counts = filter_docs(s, kept, tmp, spec.data.filters, tasks, keys.Matcher(applied.exclusions), rules)
        url_filter, found = counts.pop("url_filter"), counts.pop("pii")
        return sd.commit({"kept": "kept", "removed": "removed"}, counts=counts,
                         metrics={"url_filter": url_filter, "pii": {k: v for k, v in found.items() if k != "mode"}},
                         extra={"tasks": tasks, "url_filter": url_filter, "pii": found,
                                "takedown": takedowns.filter_record(applied, tmp / "removed",
                                                                  counts["removed_by_reason"].get("takedown", 0))})

    return run_and_log(spec, sd, body)


def summary(m: Manifest) -> str:
    c, x = m.counts, m.extra
    pii = {k: v for k, v in x.get("pii", {}).items() if k not in ("mode", "docs") and v}
    return (f"filter: {c['docs_in']} docs → {c['kept']} kept, {c['removed']} removed {c['removed_by_reason']}; "
            f"languages {c['languages']}; url {x.get('url_filter', {})}; personal data "
            f"({x.get('pii', {}).get('mode', 'off')}) {pii or 'none found'}; manifest {m.path}")


def main(argv: list[str] | None = None) -> int:
    return stage_main("filter", run, summary, argv)


if __name__ == "__main__":
    sys.exit(main())
