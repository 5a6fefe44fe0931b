"""The register stage: the evaluated checkpoint as a servable pyfunc in MLflow, a model version with lineage tags,
the champion/challenger gate and the eval report (:mod:`pipelines.eval.registry`), and the version as a Hugging Face
directory with its model card, logged as the ``hf/`` artifact of its model (:mod:`pipelines.eval.export`).

    python -m pipelines.eval.register --evaluate-manifest E --train-manifest T --tokenize-manifest K [--spec S]
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from pipelines import tracking
from pipelines.cli import stage_dir, stage_main
from pipelines.eval.export import register_hf
from pipelines.eval.registry import eval_report, lineage_config_hash, register
from pipelines.manifest import Manifest, input_ref, run_stage
from pipelines.spec import JobSpec
from pipelines.train.ckpt.tiers import fetch


def run(spec: JobSpec, ev: Manifest, train: Manifest, tok: Manifest, out_dir: str | None = None) -> Manifest:
    sd = stage_dir(spec, "register", [input_ref(ev), input_ref(train), input_ref(tok)], out_dir)

    def body(tmp: Path) -> Manifest:
        tier, ckpt = fetch(spec, ev.extra["checkpoint"], cache=tmp / "checkpoint")
        lineage = {"data_manifest_hash": tok.digest, "tokenizer_hash": tok.extra["tokenizer_sha256"],
                   "config_hash": lineage_config_hash(spec), "checkpoint_uri": ev.extra["checkpoint_uri"],
                   "train_manifest_hash": train.digest}
        train_run = train.extra.get("mlflow_run_id") or spec.run.mlflow_run_id  # the LoggedModel's source run
        eval_run = spec.run.mlflow_run_id or train_run
        work = tmp / "work"
        res = register(spec, ckpt, train_run, lineage, dict(ev.metrics), ev.extra, work, eval_run_id=eval_run,
                       corpus=tok)
        client = tracking.client(spec)
        res["export_hf"] = register_hf(spec, client, ckpt, res, work)
        for p in eval_report(spec, res, ev, train, tmp, client):
            client.log_artifact(eval_run, str(p), artifact_path="eval_report")
        shutil.rmtree(tmp / "checkpoint", ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        (tmp / "registration.json").write_text(json.dumps(res, indent=2))
        return sd.commit({"registration": "registration.json", "report": "report.md", "report_png": "report.png"},
                         counts={"versions_created": int(not res["reused_version"])},
                         metrics={"alias_moved": int(res["alias_moved"]), "champion_rescored": int(res["champion_rescored"])},
                         extra=res)

    return run_stage(sd, body)


def summary(m: Manifest) -> str:
    e = m.extra
    con = ", ".join(f"{k.removeprefix('contamination.')} {v}" for k, v in e["tags"].items() if k.startswith("contamination."))
    return (f"register: {e['model_name']} v{e['version']} ({e['gate_metric']}={e['value']:.4f}, model_id "
            f"{e['model_id']}); {e['reason']}; eval items overlapping the training data: {con or 'not recorded'}; "
            f"report {m.output('report')}; tracking {e['tracking_uri']}; Hugging Face copy "
            f"{e.get('export_hf') or 'not logged'} (or: python -m pipelines.eval.export --model "
            f"{e['model_name']}/{e['version']} --format hf|gguf --out DIR)")


def main(argv: list[str] | None = None) -> int:
    return stage_main("register", run, summary, argv)


if __name__ == "__main__":
    sys.exit(main())
