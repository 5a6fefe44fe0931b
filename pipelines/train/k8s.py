"""The train stage's Kubernetes job, printed without launching anything (:mod:`pipelines.launch.k8s` renders and checks
it as the cluster's admission would):

    python -m pipelines.train.k8s SPEC.yaml --tokenize-manifest M [--run-id ID] [--set launcher.kind=pytorchjob]
    # prints the TrainJob (or PyTorchJob) the train stage would submit for these inputs (YAML); exit 2 with one
    # line per rule (field, message, rule) when the cluster would refuse it
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from pipelines.exit_codes import USER_ERROR
from pipelines.launch.k8s import JobFailed, check_job, stage_job
from pipelines.manifest import StageError, load_manifest
from pipelines.spec import SpecError, load_spec
from pipelines.train.job import launch_token, train_job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.train.k8s",
                                 description="Print the Kubernetes training job (a Kubeflow Trainer v2 TrainJob, or a "
                                 "v1 PyTorchJob with --set launcher.kind=pytorchjob) that the train stage would submit "
                                 "for a job spec and a tokenize manifest (same trainer arguments, same name), "
                                 "checked as the cluster's admission checks it: exit 2 naming each rule it breaks.")
    ap.add_argument("spec", help="Job spec YAML (launcher.* as for a Kubernetes launcher.kind).")
    ap.add_argument("--tokenize-manifest", required=True, help="The tokenize stage's manifest.json (the train input).")
    ap.add_argument("--run-id", default=None, help="Run id in the job's name (default: the train stage's, "
                                                   "train-<stage key>).")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="Override a spec value (repeatable), e.g. --set launcher.kind=pytorchjob.")
    ap.add_argument("--crd", default=None, help="CRD YAML whose schema and CEL rules to check against (default: the "
                    "CRD shipped in infra/k8s/crds, Trainer v2.3.0's for a TrainJob, training-operator v1.8.1's for a "
                    "PyTorchJob). The operator's webhook rules always apply.")
    args = ap.parse_args(argv)
    try:
        spec = load_spec(args.spec, args.overrides)
        if not spec.launcher.on_kubernetes:  # a local spec: its TrainJob (validated as such)
            spec = load_spec(args.spec, [*args.overrides, "launcher.kind=trainjob"])
        try:
            manifest = load_manifest(args.tokenize_manifest)
        except (OSError, ValueError) as e:  # a wrong path, or a file that is not a manifest (JSON)
            raise SpecError(f"--tokenize-manifest {args.tokenize_manifest}: not a readable manifest "
                            f"({type(e).__name__}: {' '.join(str(e).split())})") from None
        job = train_job(spec, manifest)
    except (SpecError, StageError, FileNotFoundError) as e:  # a stage error: e.g. the generations record
        print(f"k8s: error: {e}", file=sys.stderr)
        return USER_ERROR
    run_id = args.run_id or job.run_id
    rendered = stage_job(spec, run_id, "pipelines.train.trainer", job.args,
                         {"LLMP_RUN_TOKEN": launch_token(run_id, job.rel_root)})
    if args.crd and not Path(args.crd).is_file():
        print(f"k8s: error: --crd {args.crd}: no such file", file=sys.stderr)
        return USER_ERROR
    try:
        check_job(rendered, spec, Path(args.crd) if args.crd else None)
    except JobFailed as e:
        print(f"k8s: {e}".replace("\n", "\nk8s: "), file=sys.stderr)
        return USER_ERROR
    except ValueError as e:  # a --crd that is not this kind's CRD, or not one at all
        print(f"k8s: error: --crd: {e}", file=sys.stderr)
        return USER_ERROR
    print(yaml.safe_dump(rendered, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
