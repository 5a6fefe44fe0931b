"""What every stage CLI shares: the spec flags, ``--output``/``--report``, and run-then-log."""
from __future__ import annotations

import argparse
from typing import Callable, Iterable

from pipelines.manifest import Manifest, StageDir, run_stage
from pipelines.spec import JobSpec, add_spec_args


def stage_parser(module: str, description: str, inputs: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """``python -m <module>`` parser with --spec/--set, required upstream-manifest flags, --output, --report."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    add_spec_args(ap)
    for flag, text in (inputs or {}).items():
        ap.add_argument(flag, required=True, help=text)
    ap.add_argument("--output", default=None, help="Output directory (default: content-addressed under run.root).")
    ap.add_argument("--report", default=None, help="Write {stage, manifest} JSON here (for orchestrators).")
    return ap


def run_and_log(spec: JobSpec, sd: StageDir, body: Callable, artifacts: Iterable[str] = ()) -> Manifest:
    """Run the stage unless done, then log its counts (and named outputs) to the pipeline's MLflow run."""
    m = run_stage(sd, body)
    from pipelines.tracking import log_stage

    log_stage(spec, m, artifacts=artifacts)
    return m
