"""The filter stage: the quality filters of :mod:`pipelines.data.quality` over the dedup stage's kept docs, on
Spark; kept docs and removed docs (each with its ``filter_reason``) as parquet.

    python -m pipelines.data.filter --dedup-manifest M [--spec S] [--set data.filters.steps=[language,c4]]
"""
from __future__ import annotations

import sys
from pathlib import Path

from pipelines.cli import run_and_log, stage_dir, stage_main
from pipelines.data.quality import filter_docs
from pipelines.manifest import Manifest, input_ref
from pipelines.spec import JobSpec


def run(spec: JobSpec, dedup: Manifest, out_dir: str | None = None, spark=None) -> Manifest:
    sd = stage_dir(spec, "filter", [input_ref(dedup)], out_dir)

    def body(tmp: Path) -> Manifest:
        from pipelines.data.spark import dir_bytes, size_shuffles, spec_session, task_count

        s = spark or spec_session(spec, "llm-pipeline-filter")
        kept = dedup.output("kept")
        tasks = task_count(s, dir_bytes(kept), spec.data.task_mb, spec.data.filters.partitions)
        size_shuffles(s, tasks)
        counts = filter_docs(s, kept, tmp, spec.data.filters, tasks)
        return sd.commit({"kept": "kept", "removed": "removed"}, counts=counts, extra={"tasks": tasks})

    return run_and_log(spec, sd, body)


def summary(m: Manifest) -> str:
    c = m.counts
    return (f"filter: {c['docs_in']} docs → {c['kept']} kept, {c['removed']} removed {c['removed_by_reason']}; "
            f"languages {c['languages']}; manifest {m.path}")


def main(argv: list[str] | None = None) -> int:
    return stage_main("filter", run, summary, argv)


if __name__ == "__main__":
    sys.exit(main())
