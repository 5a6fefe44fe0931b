"""Register: log the evaluated model as a servable pyfunc, register a version with lineage, gate the alias.

* the model goes into the pipeline's MLflow run as a **pyfunc** (text in → generated text out;
  ``pipelines.eval.serving``), with the plain weights, model args and tokenizer as artifacts;
* a new version of ``registry.model_name`` is tagged with its lineage (``data_manifest_hash``,
  ``tokenizer_hash``, ``config_hash``, ``checkpoint_uri``, ``train_manifest_hash``), the reference set
  (``reference_sha256``) and every eval metric (``reference_bpb``, ``harness.*``, ``heldout_*``);
* the gate: the alias ``registry.alias`` (``champion``) moves to the new version only if its
  ``registry.gate_metric`` (``reference_bpb`` by default) is no worse (≤) than the champion's **on the same
  reference set**. When the champion was scored on another set, it is re-scored on this one first (its
  number is kept as a tag ``reference_bpb.<sha[:12]>`` on its version). A version that does not take the
  alias gets ``challenger``. The decision, with both numbers, is logged, tagged on the version and on the
  MLflow run, and heads the eval report (Markdown + PNG, next to the outputs and in MLflow).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipelines.manifest import Manifest
from pipelines.spec import JobSpec, sha256_json
from pipelines.tracking import airflow_ids

CHALLENGER = "challenger"


def lineage_config_hash(spec: JobSpec) -> str:
    d = spec.model_dump(mode="json")
    d.pop("run", None)
    d.pop("services", None)
    return sha256_json(d)


@dataclass
class Decision:
    take: bool
    reason: str
    champion: Optional[str] = None  # its version
    champion_value: Optional[float] = None
    rescored: bool = False


def champion_value(spec: JobSpec, client, cur, metric: str, sha: str, work: Path) -> tuple[Optional[float], bool, str]:
    """(the champion's ``metric`` on reference set ``sha``, whether it was re-scored now, why None)."""
    tags = cur.tags
    if metric != "reference_bpb":
        return (float(tags[metric]), False, "") if metric in tags else (None, False, f"it has no {metric} tag")
    if tags.get("reference_sha256") == sha and "reference_bpb" in tags:
        return float(tags["reference_bpb"]), False, ""
    key = f"reference_bpb.{sha[:12]}"
    if key in tags:
        return float(tags[key]), False, ""
    return rescore(spec, client, cur, sha, work)


def rescore(spec: JobSpec, client, cur, sha: str, work: Path) -> tuple[Optional[float], bool, str]:
    """Score the champion on this reference set (in this process or on the launcher's ranks)."""
    from pipelines import tracking
    from pipelines.eval.evaluate import reference_files, score_model_dir
    from pipelines.eval.scorer import Job
    from pipelines.eval.serving import download, model_dir_of

    try:
        d = model_dir_of(download(f"models:/{cur.name}/{cur.version}", tracking.tracking_uri(spec), work / "champion"))
    except LookupError as e:
        return None, False, f"it cannot be re-scored on the new reference set ({e})"
    res = score_model_dir(spec, Job(model_dir=str(d), reference=reference_files(spec), parts=["reference"]),
                          work / "champion-ranks", run_id=f"rescore-{cur.name}-{cur.version}"[:40])
    value = res["reference"]["bits_per_byte"]
    client.set_model_version_tag(cur.name, cur.version, f"reference_bpb.{sha[:12]}", f"{value:.6f}")
    return value, True, ""


def gate(spec: JobSpec, client, value: float, sha: str, work: Path) -> Decision:
    """Should the new version (``value`` of the gate metric, on reference set ``sha``) take the alias?"""
    from mlflow.exceptions import MlflowException

    name, alias, metric = spec.registry.model_name, spec.registry.alias, spec.registry.gate_metric
    try:
        cur = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return Decision(True, f"no '{alias}' yet: the new version takes it")
    cv, rescored, why = champion_value(spec, client, cur, metric, sha, work)
    if cv is None:
        return Decision(True, f"'{alias}' v{cur.version} is not comparable ({why}): the new version takes it", cur.version)
    on = f" on reference set {sha[:12]}" + (" (champion re-scored on it)" if rescored else "") \
        if metric == "reference_bpb" else ""
    if value <= cv:
        return Decision(True, f"{metric} {value:.4f} ≤ '{alias}' v{cur.version}'s {cv:.4f}{on}: the new version "
                        f"takes '{alias}'", cur.version, cv, rescored)
    return Decision(False, f"{metric} {value:.4f} > '{alias}' v{cur.version}'s {cv:.4f}{on}: '{alias}' stays, the new "
                    f"version is '{CHALLENGER}'", cur.version, cv, rescored)


def version_tags(lineage: dict, metrics: dict, ev_extra: dict) -> dict[str, str]:
    return {**lineage, **{k: f"{v:.6f}" for k, v in metrics.items()},
            "reference_sha256": ev_extra["reference_sha256"],
            "reference_files": ",".join(ev_extra["reference"]["files"]),
            "eval_tasks": ",".join(ev_extra["tasks"]), "eval_limit": str(ev_extra["limit"]),
            **airflow_ids()}  # the DAG run and task that registered it (under Airflow)


def register(spec: JobSpec, ckpt_dir: Path, run_id: str, lineage: dict, metrics: dict, ev_extra: dict,
             work: Path) -> dict:
    from pipelines import tracking

    name, alias, gm = spec.registry.model_name, spec.registry.alias, spec.registry.gate_metric
    if gm not in metrics:
        raise ValueError(f"registry.gate_metric={gm} was not measured by the evaluate stage")
    with tracking.fluent(spec):  # the client resolves the logged model's models:/ source through the global URI
        mv, model_uri = log_and_register(spec, ckpt_dir, run_id, version_tags(lineage, metrics, ev_extra), work)
        client = tracking.client(spec)
        d = gate(spec, client, metrics[gm], ev_extra["reference_sha256"], work)
        client.set_registered_model_alias(name, alias if d.take else CHALLENGER, mv.version)
        client.set_model_version_tag(name, mv.version, "gate", d.reason)
        client.set_tag(run_id, "register.gate", d.reason)
    return {"model_name": name, "version": int(mv.version), "model_uri": model_uri, "alias": alias,
            "alias_moved": d.take, "previous_champion": d.champion, "previous_value": d.champion_value,
            "champion_rescored": d.rescored, "reason": d.reason, "gate_metric": gm, "value": metrics[gm],
            "tags": mv.tags, "mlflow_run_id": run_id, "tracking_uri": tracking.tracking_uri(spec)}


def log_and_register(spec: JobSpec, ckpt_dir: Path, run_id: str, tags: dict, work: Path):
    """Log the pyfunc into the pipeline's run and create a model version of it; returns (version, model URI)."""
    import mlflow

    from pipelines import tracking
    from pipelines.eval.serving import log_text_model, write_model_dir
    from pipelines.train.checkpoint import load_plain_model

    model_dir = write_model_dir(load_plain_model(ckpt_dir), ckpt_dir, work / "model_dir")
    with mlflow.start_run(run_id=run_id):
        info = log_text_model(model_dir)
    client = tracking.client(spec)
    try:
        client.create_registered_model(spec.registry.model_name, description="LLM pipeline models (see tags for lineage)")
    except Exception:  # already exists
        pass
    return client.create_model_version(spec.registry.model_name, info.model_uri, run_id=run_id, tags=tags), info.model_uri


def eval_report(spec: JobSpec, res: dict, ev: Manifest, train: Manifest, out: Path, client) -> list[Path]:
    """report.md + report.png: this version beside the champion it was gated against (same sets only)."""
    from pipelines.eval import report

    champ: dict = {}
    comparable: set[str] = set()
    if res["previous_champion"] is not None:
        t = client.get_model_version(res["model_name"], res["previous_champion"]).tags
        champ = {k: float(v) for k, v in t.items() if k in ev.metrics}
        if res["previous_value"] is not None:  # the gate's own comparison (a re-scored champion included)
            champ[res["gate_metric"]] = res["previous_value"]
            comparable.add(res["gate_metric"])
        same_tasks = t.get("eval_tasks") == res["tags"]["eval_tasks"] and t.get("eval_limit") == res["tags"]["eval_limit"]
        comparable |= {k for k in ev.metrics if k.startswith("harness.") and same_tasks}
        if t.get("data_manifest_hash") == res["tags"]["data_manifest_hash"]:
            comparable |= {k for k in ev.metrics if k.startswith("heldout_")}
    notes = [f"reference set {ev.extra['reference_sha256'][:12]}: " + ", ".join(ev.extra["reference"]["files"]),
             f"harness: {', '.join(ev.extra['tasks'])}, first {ev.extra['limit']} items each, offline files",
             "heldout_* score the run's own held-out shards: comparable only between runs of the same data"]
    losses = json.loads(train.output("losses").read_text()) if "losses" in {o["name"] for o in train.outputs} else []
    r = report.Report(res["model_name"], res["version"], res["reason"], report.rows(dict(ev.metrics), champ, comparable),
                      ev.extra.get("sample"), losses, notes)
    return list(report.write(r, out))
