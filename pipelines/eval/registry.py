"""Register: log the evaluated model to MLflow, register a version with lineage, gate the alias.

* ``mlflow.pytorch.log_model`` (MLflow's default ``pt2`` serialisation, with an input example of
  token ids, so the signature is ``int64[batch, seq] → float32[batch, seq, vocab]``), into the
  pipeline's MLflow run;
* a new version of ``registry.model_name`` tagged with its lineage: ``data_manifest_hash`` (the
  token shards' manifest digest), ``tokenizer_hash`` (sha256 of ``tokenizer.model``),
  ``config_hash`` (the job spec minus run/services), ``checkpoint_uri`` (its L2 copy), and its
  eval metrics;
* the alias ``registry.alias`` (``champion``) moves to the new version only if its
  ``registry.gate_metric`` is no worse (≤) than the current champion's.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pipelines.cli import stage_parser
from pipelines.manifest import Manifest, StageDir, input_ref, load_manifest, run_stage, write_report
from pipelines.spec import JobSpec, resolve_path, sha256_json, spec_from_args


def lineage_config_hash(spec: JobSpec) -> str:
    d = spec.model_dump(mode="json")
    d.pop("run", None)
    d.pop("services", None)
    return sha256_json(d)


def gate(client, name: str, alias: str, metric: str, value: float) -> tuple[bool, str | None, float | None]:
    """Should the new version take ``alias``? Returns (yes, current version, current value)."""
    from mlflow.exceptions import MlflowException

    try:
        cur = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return True, None, None
    cur_val = cur.tags.get(metric)
    if cur_val is None:
        return True, cur.version, None
    return value <= float(cur_val), cur.version, float(cur_val)


def register(spec: JobSpec, ckpt_dir: Path, run_id: str, lineage: dict, metrics: dict) -> dict:
    import mlflow
    import torch

    from pipelines import tracking
    from pipelines.train.checkpoint import load_plain_model

    client = tracking.client(spec)
    model = load_plain_model(ckpt_dir)
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    # -1 dims are exported as dynamic: any batch, any length up to seq_len
    sig = ModelSignature(inputs=Schema([TensorSpec(np.dtype("int64"), (-1, -1), "tokens")]),
                         outputs=Schema([TensorSpec(np.dtype("float32"), (-1, -1, model.args.vocab_size))]))
    example = torch.randint(0, model.args.vocab_size, (2, max(2, min(16, model.args.seq_len // 2)))).numpy()
    with tracking.fluent(spec), mlflow.start_run(run_id=run_id):
        info = mlflow.pytorch.log_model(
            model, name="model", input_example=example, signature=sig, pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
            extra_files=[str(ckpt_dir / "tokenizer.model"), str(ckpt_dir / "model_args.json")],
        )
    name, alias, gm = spec.registry.model_name, spec.registry.alias, spec.registry.gate_metric
    tags = {**lineage, **{k: f"{v:.6f}" for k, v in metrics.items()}}
    try:
        client.create_registered_model(name, description="LLM pipeline models (see tags for lineage)")
    except Exception:  # already exists
        pass
    mv = client.create_model_version(name, info.model_uri, run_id=run_id, tags=tags)
    take, cur_v, cur_val = gate(client, name, alias, gm, metrics[gm])
    if take:
        client.set_registered_model_alias(name, alias, mv.version)
    return {"model_name": name, "version": int(mv.version), "model_uri": info.model_uri, "alias": alias,
            "alias_moved": take, "previous_champion": cur_v, "previous_value": cur_val,
            "gate_metric": gm, "value": metrics[gm], "tags": tags, "mlflow_run_id": run_id,
            "tracking_uri": tracking.tracking_uri(spec)}


def run(spec: JobSpec, ev: Manifest, train: Manifest, tok: Manifest, out_dir: str | None = None) -> Manifest:
    sd = StageDir(resolve_path(spec.run.root), "register", spec.stage_hash("register"),
                  [input_ref(ev), input_ref(train), input_ref(tok)], force=spec.run.force, out_dir=out_dir)

    def body(tmp: Path) -> Manifest:
        import shutil

        from pipelines.train.checkpoint import fetch

        tier, ckpt = fetch(spec, ev.extra["checkpoint"], cache=tmp / "checkpoint")
        lineage = {"data_manifest_hash": tok.digest, "tokenizer_hash": tok.extra["tokenizer_sha256"],
                   "config_hash": lineage_config_hash(spec), "checkpoint_uri": ev.extra["checkpoint_uri"],
                   "train_manifest_hash": train.digest}
        run_id = spec.run.mlflow_run_id or train.extra["mlflow_run_id"]
        res = register(spec, ckpt, run_id, lineage, dict(ev.metrics))
        shutil.rmtree(tmp / "checkpoint", ignore_errors=True)
        (tmp / "registration.json").write_text(json.dumps(res, indent=2))
        return sd.commit({"registration": "registration.json"}, counts={"versions_created": 1},
                         metrics={"alias_moved": int(res["alias_moved"])}, extra=res)

    return run_stage(sd, body)


def main(argv: list[str] | None = None) -> int:
    ap = stage_parser("pipelines.eval.registry",
                      "Log the evaluated model to MLflow, register a version with lineage tags, and move the "
                      "champion alias only if it is no worse.",
                      {"--eval-manifest": "Manifest of the evaluate stage.", "--train-manifest": "Manifest of the train stage.",
                       "--tokenize-manifest": "Manifest of the tokenize stage."})
    args = ap.parse_args(argv)
    spec = spec_from_args(args)
    m = run(spec, load_manifest(args.eval_manifest), load_manifest(args.train_manifest),
            load_manifest(args.tokenize_manifest), args.output)
    write_report(args.report, m)
    e = m.extra
    moved = f"alias '{e['alias']}' → v{e['version']}" if e["alias_moved"] else \
        f"alias '{e['alias']}' stays on v{e['previous_champion']} ({e['gate_metric']} {e['previous_value']:.6f} < {e['value']:.6f})"
    print(f"register: {e['model_name']} v{e['version']} ({e['gate_metric']}={e['value']:.4f}); {moved}; "
          f"tracking {e['tracking_uri']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
