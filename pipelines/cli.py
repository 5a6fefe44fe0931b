"""Every stage's CLI, from its entry in the stage table (:mod:`pipelines.stages`).

``python -m <module> [--spec S] [--set K=V …] --<upstream>-manifest M … [--output DIR] [--report FILE]``:
the spec flags, one flag per upstream stage's manifest, the output directory (default: content-addressed
under ``run.root``) and the report an orchestrator reads the manifest's path (or a pending job) back from.
Exit status 2 means the input or the spec must be fixed (the message names it; no traceback, no retry).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Iterable, Optional

from pipelines import engines
from pipelines.exit_codes import RETRY, USER_ERROR
from pipelines.manifest import Manifest, Pending, StageDir, StageError, atomic_write_text, load_manifest, run_stage
from pipelines.spec import JobSpec, SpecError, add_spec_args, resolve_path, spec_from_args
from pipelines.stages import Stage, stage
from pipelines.storage import oserrors
from pipelines.storage.s3 import credentials_lapsed, credentials_refused, outage
from pipelines.tracking import log_stage, mlflow_outage


def stage_parser(name: str, inputs_required: bool = True) -> argparse.ArgumentParser:
    """``python -m <module>`` parser: --spec/--set, a ``--<upstream>-manifest`` per upstream stage, --output,
    --report."""
    st = stage(name)
    ap = argparse.ArgumentParser(prog=f"python -m {st.module}", description=st.summary)
    add_spec_args(ap)
    for up in st.upstream:
        single = len(st.upstream) == 1
        flags = [stage(up).flag] + (["--input-manifest", *(stage(a).flag for a in st.also_from)] if single else [])
        also = f" (or of {', '.join(st.also_from)}: its result taken as it is)" if single and st.also_from else ""
        ap.add_argument(*flags, dest=f"{up}_manifest", required=inputs_required, metavar="MANIFEST",
                        help=f"Manifest of the {up} stage ({stage(up).module}){also}.")
    ap.add_argument("--output", default=None, help="Output directory (default: content-addressed under run.root).")
    ap.add_argument("--report", default=None, help="Write {stage, manifest} JSON here (for orchestrators).")
    if st.engine == "spark":
        ap.add_argument("--no-spark", action="store_true",
                        help="Start no Spark session: reuse the result committed for these inputs, or compute one that "
                             "needs no Spark (an empty delta); else commit nothing and report {\"needs\": \"spark\"} "
                             "(exit 0; --report required). The Airflow operator runs this before it spark-submits "
                             "the stage.")
    return ap


def stage_dir(spec: JobSpec, name: str, inputs: list[dict], out_dir: Optional[str] = None,
              force: Optional[bool] = None) -> StageDir:
    """The staging directory of stage ``name`` for these inputs (its done-check compares config and inputs)."""
    return StageDir(resolve_path(spec.run.root), name, spec.stage_hash(name), inputs,
                    force=spec.run.force if force is None else force, out_dir=out_dir,
                    lock_stale_s=60 * spec.run.lock_stale_min)


def run_and_log(spec: JobSpec, sd: StageDir, body: Callable, artifacts: Iterable[str] = (),
                housekeeping: Optional[Callable[[], None]] = None) -> Manifest:
    """Run the stage unless done, then log its counts (and named outputs) to the pipeline's MLflow run
    (``housekeeping``: :func:`pipelines.manifest.run_stage`)."""
    m = run_stage(sd, body, housekeeping=housekeeping)

    log_stage(spec, m, artifacts=artifacts)
    return m


def manifest_arg(flag: str, path: str) -> Manifest:
    """The manifest a flag names; a missing one is the user's to fix (exit 2)."""
    try:
        return load_manifest(path)
    except FileNotFoundError as e:
        raise StageError(f"{flag} {path}: {e}") from None


def add_corpus_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--corpus-manifest", default="", metavar="MANIFEST",
                    help="The corpus version this run adds to (a tokenize manifest; empty: none): ingest skips the "
                         "inputs it holds, dedup removes duplicates of its docs, tokenize encodes only the new docs.")


def corpus_arg(args: argparse.Namespace) -> Optional[Manifest]:
    return manifest_arg("--corpus-manifest", args.corpus_manifest) if args.corpus_manifest else None


def upstream_manifests(st: Stage, args: argparse.Namespace) -> list[Manifest]:
    return [manifest_arg(stage(up).flag, getattr(args, f"{up}_manifest")) for up in st.upstream]


def write_report(path: Optional[str], payload: dict) -> None:
    if path:
        atomic_write_text(path, json.dumps(payload))


Call = Callable[[JobSpec, argparse.Namespace, list[Manifest]], Manifest]


def stage_main(name: str, run: Callable[..., Manifest], summary: Callable[[Manifest], str],
               argv: list[str] | None = None, add_args: Callable[[argparse.ArgumentParser], None] | None = None,
               call: Call | None = None, inputs_required: bool = True) -> int:
    """Parse, run the stage (``run(spec, *upstream_manifests, out_dir=…)`` unless ``call`` is given), write the
    report, print the one-line summary. A :class:`StageError` or :class:`SpecError` prints ``<stage>: error: …``
    and exits with its status (an outage's, e.g. L2 not answering, is 75); any other failure that is not a bug is one
    line and :func:`failure`'s status (the report's write included: the stage has committed, a retry reuses
    it); :class:`Pending` (a job submitted elsewhere) reports what to wait for; ``--no-spark`` (a Spark stage) runs
    it with Spark refused (:mod:`pipelines.engines`) and reports ``needs`` where it stopped for want of a session."""
    ap = stage_parser(name, inputs_required)
    if add_args:
        add_args(ap)
    args = ap.parse_args(argv)
    no_spark = getattr(args, "no_spark", False)  # a Spark stage's flag
    if no_spark and not args.report:
        ap.error("--no-spark needs --report: the report says whether the stage still needs Spark")
    try:
        spec = spec_from_args(args)
        ups = upstream_manifests(stage(name), args) if inputs_required else []
        try:
            with engines.refused(*(["spark"] if no_spark else [])):
                m = call(spec, args, ups) if call else run(spec, *ups, out_dir=args.output)
        except Pending as p:
            write_report(args.report, {"stage": name, "pending": p.wait})
            print(f"{name}: submitted; waiting for {p.wait}")
            return 0
        except engines.EngineRefused as e:
            write_report(args.report, {"stage": name, "needs": e.engine})
            print(f"{name}: {e}: nothing committed (--no-spark); the stage runs on {e.engine}")
            return 0
        write_report(args.report, {"stage": m.stage, "manifest": m.path})  # after the commit: a retry reuses it
    except (StageError, SpecError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except Exception as e:  # noqa: BLE001 - classified below; anything else is a bug's traceback
        said = failure(e)
        if said is None:
            raise
        print(f"{name}: error: {said[1]}", file=sys.stderr)
        return said[0]
    print(summary(m))
    return 0


def failure(e: BaseException) -> Optional[tuple[int, str]]:
    """A stage's exit status and one line for ``e`` where it is not a bug: a path refused to this user, or an object
    store that refused these credentials or this configuration (2: no retry mends it); an object store, a tracking
    server or a disk that did not answer (75: retry). None for anything else."""
    what = f"{type(e).__name__}: {str(e)[:300]}"
    if oserrors.refused(e):  # a path this user may not read or write
        return USER_ERROR, f"{e}: this user may not; give it access"
    if credentials_refused(e):
        return USER_ERROR, (f"the object store refused the request: {what}; check services.s3_endpoint_url, "
                            "services.s3_bucket and the AWS credentials this process gets")
    if outage(e):
        return RETRY, f"the object store did not answer: {what}; run it again"
    if credentials_lapsed(e):
        return RETRY, f"the credentials lapsed (an expired session token, or their provider did not answer): {what}; " \
                      "run it again"
    if mlflow_outage(e):
        return RETRY, f"the tracking server did not answer: {what}; run it again"
    if oserrors.storage_failing(e):  # EIO, ESTALE, ENOSPC … under run.root or an input
        return RETRY, f"storage: {e}; a retry reuses the work done"
    return None
