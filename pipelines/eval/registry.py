"""Register: log the evaluated model as a servable pyfunc, register a version with lineage, gate the alias.

* the model is logged the MLflow 3 way: a **LoggedModel** (``model_id``) made in the **training run** (its
  ``source_run_id``: one click from the version reaches the loss curves), a pyfunc (text in → generated text out;
  ``pipelines.eval.serving``) with the plain weights, model args and tokenizer as artifacts;
* the eval metrics are logged on the LoggedModel (``reference_bpb``, ``harness.*``, ``heldout_*``), each with the
  dataset it was measured on (``reference`` / the task's name, digest = the files' sha256, first 12 hex digits); the
  datasets are inputs of the evaluation run, which is linked to the training run (``mlflow.parentRunId`` when the two
  differ, as in the split DAGs);
* a version of ``registry.model_name`` is created with that ``model_id``, tagged with its lineage
  (``data_manifest_hash``, ``tokenizer_hash``, ``config_hash``, ``checkpoint_uri``, ``train_manifest_hash``,
  ``lineage_key``), the reference set (``reference_sha256``), the eval metrics (as tags too, for the registry UI) and
  the contamination of each eval set (``contamination.<task>``: its items that overlap the training data);
* the gate, **fail-closed**: the alias ``registry.alias`` (``champion``) moves to the new version only if its
  ``registry.gate_metric`` (``reference_bpb`` by default) is no worse (≤) than the champion's **on the same
  reference set** (a champion scored on another set is re-scored on this one first; its number is kept as a tag
  ``reference_bpb.<sha[:12]>`` on its version). ``heldout_*`` are compared only between versions trained on the same
  data. An error while reading or re-scoring the champion fails the stage (retried; no alias moves); a champion that
  cannot be compared is refused (exit 2). A version that does not take the alias gets ``challenger``;
* **idempotent**: the gate runs before anything is created, and a re-run with the same inputs finds the version it
  created (tag ``lineage_key``) instead of making another.

The decision, with both numbers, is logged, tagged on the version and on the MLflow run, and heads the eval report
(Markdown + PNG, next to the outputs and in MLflow).
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipelines import tracking
from pipelines.eval import report
from pipelines.eval.evaluate import reference_files, score_model_dir
from pipelines.eval.scorer import Job
from pipelines.exit_codes import RETRY, USER_ERROR
from pipelines.lineage.queries import pending_takedowns
from pipelines.lineage.takedowns import TAG, tag_versions
from pipelines.manifest import Manifest, StageError, key_lock
from pipelines.spec import JobSpec, redact, resolve_path, sha256_json
from pipelines.storage import oserrors
from pipelines.tracking import airflow_ids

CHALLENGER = "challenger"
REFERENCE_DATASET = "reference"


def model_id_of(source: str | None) -> str | None:
    """The LoggedModel id ``m-…`` of a version's ``models:/m-…`` source, else None (``models:/NAME/V``, ``runs:/…``,
    a path). MLflow's SQL registry (3.17) accepts ``model_id`` when a version is created but has no column for it,
    so a version read back says ``model_id=None`` whatever the server; its source is where the id lives."""
    rest = (source or "").removeprefix("models:/")
    return rest if rest != source and rest.startswith("m-") and "/" not in rest else None


class GateError(StageError):
    """The champion could not be read or scored: the stage fails and no alias moves; exit 75 when the tracking
    server, the artifact store or the ranks' infrastructure did not answer, else 1 (retried: what broke is not
    known to be the user's)."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class NotComparable(StageError):
    """The new version and the champion cannot be compared on the gate metric (exit 2: a spec to change)."""


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


def current_champion(client, name: str, alias: str):
    """The version the alias points at, or None when the model or the alias does not exist yet; any other error
    (the registry unreachable, a permission) propagates."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(name)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        if tracking.mlflow_answered(e):  # refused, a bad name: the same on every retry
            raise NotComparable(f"cannot read registered model {name!r}: {e.message}") from None
        raise GateError(f"cannot read registered model {name!r}: the tracking server did not answer: {e.message}",
                        RETRY) from None
    if alias not in model.aliases:
        return None
    return client.get_model_version(name, model.aliases[alias])


def champion_value(spec: JobSpec, client, cur, metric: str, sha: str, data_hash: str, work: Path
                   ) -> tuple[float, bool]:
    """(the champion's ``metric`` comparable with the new version's, whether it was re-scored now)."""
    tags = cur.tags
    if metric != "reference_bpb":
        if metric not in tags:
            raise NotComparable(f"registry.gate_metric={metric}: '{spec.registry.alias}' v{cur.version} has no "
                                f"{metric}; gate on reference_bpb")
        if tags.get("data_manifest_hash") != data_hash:
            raise NotComparable(f"registry.gate_metric={metric} is measured on each corpus's own held-out split, and "
                                f"'{spec.registry.alias}' v{cur.version} was trained on other data "
                                f"({str(tags.get('data_manifest_hash'))[:12]} ≠ {data_hash[:12]}); gate on "
                                "reference_bpb (registry.gate_metric=reference_bpb), which is comparable across corpora")
        return float(tags[metric]), False
    if tags.get("reference_sha256") == sha and "reference_bpb" in tags:
        return float(tags["reference_bpb"]), False
    key = f"reference_bpb.{sha[:12]}"
    if key in tags:
        return float(tags[key]), False
    return rescore(spec, client, cur, sha, work), True


def rescore(spec: JobSpec, client, cur, sha: str, work: Path) -> float:
    """Score the champion on this reference set (in this process or on the launcher's ranks)."""
    from pipelines.eval.model_dir import download_model_dir

    try:
        d = download_model_dir(f"models:/{cur.name}/{cur.version}", tracking.tracking_uri(spec), work / "champion")
        res = score_model_dir(spec, Job(model_dir=str(d), reference=reference_files(spec), parts=["reference"]),
                              work / "champion-ranks", run_id=f"rescore-{cur.name}-{cur.version}"[:40])
    except Exception as e:  # noqa: BLE001 - whatever broke, the gate must not fail open
        raise unscored(f"'{spec.registry.alias}' v{cur.version} could not be re-scored on reference set {sha[:12]} "
                       f"({type(e).__name__}: {e}); the alias stays where it is", e) from e
    value = res["reference"]["bits_per_byte"]
    client.set_model_version_tag(cur.name, cur.version, f"reference_bpb.{sha[:12]}", f"{value:.6f}")
    return value


def unscored(message: str, e: BaseException) -> StageError:
    """Why the champion could not be re-scored, with its exit status: 75 when what failed did not answer (the
    tracking server, the artifact store, a disk, the ranks' infrastructure); 2 when every retry would fail the same
    way (the champion is not an llm-pipeline text model, its ranks rejected it, a file this user may not read):
    give access, or set the alias by hand after checking; else 1 (retried)."""
    code = getattr(e, "exit_code", None)
    if code == RETRY or tracking.mlflow_outage(e) or oserrors.storage_failing(e):
        return GateError(message, RETRY)
    if code == USER_ERROR or type(e) is LookupError or oserrors.refused(e):
        return NotComparable(f"{message}: no retry re-scores it; set registry.alias by hand after checking")
    return GateError(message)


def gate(spec: JobSpec, client, value: float, sha: str, data_hash: str, work: Path) -> Decision:
    """Should the new version (``value`` of the gate metric, on reference set ``sha``, trained on ``data_hash``)
    take the alias? Raises :class:`GateError` / :class:`NotComparable` instead of guessing."""
    name, alias, metric = spec.registry.model_name, spec.registry.alias, spec.registry.gate_metric
    cur = current_champion(client, name, alias)
    if cur is None:
        return Decision(True, f"no '{alias}' yet: the new version takes it")
    cv, rescored = champion_value(spec, client, cur, metric, sha, data_hash, work)
    on = f" on reference set {sha[:12]}" + (" (champion re-scored on it)" if rescored else "") \
        if metric == "reference_bpb" else " on the same data"
    if value <= cv:
        return Decision(True, f"{metric} {value:.4f} ≤ '{alias}' v{cur.version}'s {cv:.4f}{on}: the new version "
                        f"takes '{alias}'", cur.version, cv, rescored)
    return Decision(False, f"{metric} {value:.4f} > '{alias}' v{cur.version}'s {cv:.4f}{on}: '{alias}' stays, the new "
                    f"version is '{CHALLENGER}'", cur.version, cv, rescored)


def contamination_tags(ev_extra: dict) -> dict[str, str]:
    """``contamination.<task>``: items of the task that overlap the training data (``unchecked`` when unknown)."""
    out = {}
    for task, r in ev_extra.get("contamination", {}).items():
        out[f"contamination.{task}"] = (f"{r['items_overlapping']}/{r['items']}" + ("" if r["checked"] else " partly unchecked")
                                        if "items" in r else "unchecked")
    return out


def version_tags(lineage: dict, metrics: dict, ev_extra: dict) -> dict[str, str]:
    return {**lineage, **{k: f"{v:.6f}" for k, v in metrics.items()},
            "reference_sha256": ev_extra["reference_sha256"],
            "reference_files": ",".join(ev_extra["reference"]["files"]),
            "eval_tasks": ",".join(ev_extra["tasks"]), "eval_limit": str(ev_extra["limit"]),
            **contamination_tags(ev_extra),
            **airflow_ids()}  # the DAG run and task that registered it (under Airflow)


def lineage_key(name: str, lineage: dict, metrics: dict, ev_extra: dict) -> str:
    """What makes two registrations the same: the model name, the lineage, the reference set and the numbers."""
    return sha256_json({"name": name, "lineage": lineage, "reference": ev_extra["reference_sha256"],
                        "metrics": {k: round(v, 9) for k, v in metrics.items()}})[:32]


def existing_version(client, name: str, key: str):
    """The version a registration with this ``lineage_key`` created earlier, or None."""
    from mlflow.exceptions import MlflowException

    try:
        found = list(tracking.model_versions(client, f"name = '{name}' and tags.lineage_key = '{key}'"))
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return min(found, key=lambda v: int(v.version)) if found else None


def register(spec: JobSpec, ckpt_dir: Path, run_id: str, lineage: dict, metrics: dict, ev_extra: dict,
             work: Path, eval_run_id: str | None = None, corpus: Optional[Manifest] = None) -> dict:
    """Gate, then find or create the version (``run_id``: the training run, the LoggedModel's source; ``eval_run_id``:
    the run the eval metrics are logged from, by default the same), then set the alias. ``corpus``: the tokenize
    manifest the model was trained on (the register stage's input), which the takedown check reads wherever it is."""
    name, alias, gm = spec.registry.model_name, spec.registry.alias, spec.registry.gate_metric
    if gm not in metrics:
        raise ValueError(f"registry.gate_metric={gm} was not measured by the evaluate stage")
    tags = {**version_tags(lineage, metrics, ev_extra), "lineage_key": lineage_key(name, lineage, metrics, ev_extra)}
    client = tracking.client(spec)
    # the gate reads the champion and the alias moves on what it found: one registration of this model at a time
    with model_lock(spec, name), tracking.fluent(spec):  # the fluent URI: the logged model's models:/ source
        d = gate(spec, client, metrics[gm], ev_extra["reference_sha256"], lineage.get("data_manifest_hash", ""), work)
        mv = existing_version(client, name, tags["lineage_key"])
        reused = mv is not None
        if mv is None:
            mv, model_id = log_and_register(spec, ckpt_dir, run_id, tags, work)
            log_eval_metrics(client, model_id, eval_run_id or run_id, metrics, ev_extra)
        else:  # a retry: the try that created the version may have died before the metrics were logged
            model_id = model_id_of(mv.source)
            logged = {m.key for m in client.get_logged_model(model_id).metrics or []} if model_id else set(metrics)
            if not set(metrics) <= logged:
                log_eval_metrics(client, model_id, eval_run_id or run_id, metrics, ev_extra)
        link_runs(client, run_id, eval_run_id)
        tag_takedowns(spec, client, mv, lineage.get("data_manifest_hash"), corpus)  # before the alias can move
        client.set_registered_model_alias(name, alias if d.take else CHALLENGER, mv.version)
        client.set_model_version_tag(name, mv.version, "gate", d.reason)
        client.set_tag(eval_run_id or run_id, "register.gate", d.reason)
        mv = client.get_model_version(name, mv.version)  # its tags as they are now
    return {"model_name": name, "version": int(mv.version), "model_uri": mv.source, "model_id": model_id,
            "alias": alias, "alias_moved": d.take, "previous_champion": d.champion, "previous_value": d.champion_value,
            "champion_rescored": d.rescored, "reason": d.reason, "gate_metric": gm, "value": metrics[gm],
            "reused_version": reused, "tags": dict(mv.tags), "mlflow_run_id": run_id,
            "eval_run_id": eval_run_id or run_id, "tracking_uri": redact(tracking.tracking_uri(spec))}


def model_lock(spec: JobSpec, name: str):
    """The registered model's lock (``run.root/register/.model-<name>-<hash>.lock``, beside the register stage's
    key locks: :func:`pipelines.manifest.key_lock`):
    two registrations at once (the evaluation DAG's and llm_pipeline's, a CLI run) each read the champion, and the
    one that set the alias last won, however it compared. Held from the gate to the alias; a holder that stops
    beating for ``run.lock_stale_min`` is given up on (exit 75). Per ``run.root``: registrations of the model from
    runs under another root are not held off (MLflow has no compare-and-set on an alias)."""
    slug = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:80] + "-" + hashlib.sha256(name.encode()).hexdigest()[:12]
    return key_lock(resolve_path(spec.run.root) / "register" / f"model-{slug}",
                    lambda holder: print(f"register: another registration of {name} holds {holder}; waiting for it "
                                         "while it shows it is alive", flush=True), 60 * spec.run.lock_stale_min)


def tag_takedowns(spec: JobSpec, client, mv, digest: str | None, corpus: Optional[Manifest] = None) -> None:
    """A version trained on a corpus that holds docs of the takedown list (added while it trained) is tagged
    ``takedown.pending``, as ``--exclude-source`` tags the versions registered before."""
    pending = pending_takedowns(spec, digest, corpus)
    if pending is None:
        print(f"register: warning: the takedown list has exclusions, but corpus version {str(digest)[:12]} is not "
              f"under run.root={spec.run.root}: whether {mv.name} v{mv.version} saw an excluded source is not known",
              flush=True)
    for e in pending or []:
        tag_versions(client, [{"name": mv.name, "version": mv.version}], e)
        print(f"register: {mv.name} v{mv.version} tagged {TAG}: its corpus holds {e.source} ({e.reason})",
              flush=True)


def log_and_register(spec: JobSpec, ckpt_dir: Path, run_id: str, tags: dict, work: Path):
    """Log the pyfunc as a LoggedModel of the training run ``run_id`` and create a version of it; returns the version
    and the LoggedModel's id (``log_model``'s; the version's source ``models:/<model_id>`` carries it back)."""
    import mlflow

    from pipelines.eval.model_dir import loads_here
    from pipelines.eval.serving import log_text_model, model_dir_for

    model_dir = model_dir_for(spec, ckpt_dir, work / "model_dir")
    with mlflow.start_run(run_id=run_id):  # MLflow checks an input example by loading the model: small ones only
        info = log_text_model(model_dir, max_new_tokens=spec.eval.max_new_tokens, example=loads_here(spec, ckpt_dir))
    client = tracking.client(spec)
    try:
        client.create_registered_model(spec.registry.model_name, description="LLM pipeline models (see tags for lineage)")
    except Exception as e:  # noqa: BLE001 - MLflow's answer that it exists already; anything else is raised
        if getattr(e, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
            raise
    mv = client.create_model_version(spec.registry.model_name, info.model_uri, run_id=run_id, tags=tags,
                                     model_id=info.model_id)
    # the LoggedModel → version link, as mlflow.register_model records it (the logged model's page lists the version)
    client.set_logged_model_tags(info.model_id, {"mlflow.modelVersions": json.dumps(
        [{"name": mv.name, "version": mv.version}])})
    return mv, info.model_id


def datasets(ev_extra: dict) -> dict[str, tuple[str, str]]:
    """{metric prefix: (dataset name, digest)}: the reference set, and each task lm-eval scored (its items' digest,
    ``pipelines.eval_sets.task_digest``)."""
    out = {"reference_bpb": (REFERENCE_DATASET, ev_extra["reference_sha256"][:12])}
    for task, sha in ev_extra.get("task_sha256", {}).items():
        out[f"harness.{task}."] = (task, sha[:12])
    return out


def log_eval_metrics(client, model_id: str, run_id: str, metrics: dict, ev_extra: dict) -> None:
    """The eval numbers on the LoggedModel, each with the dataset it was measured on; the datasets as inputs of the
    evaluation run."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    sets = datasets(ev_extra)
    ts = int(time.time() * 1000)
    used = set()
    for k, v in metrics.items():
        ds = next((d for prefix, d in sets.items() if k == prefix or k.startswith(prefix)), (None, None))
        client.log_metric(run_id, k, float(v), timestamp=ts, step=0, dataset_name=ds[0], dataset_digest=ds[1],
                          model_id=model_id)
        used.add(ds)
    inputs = [DatasetInput(Dataset(name=n, digest=dg, source_type="local", source=json.dumps({"digest": dg})),
                           [InputTag("mlflow.data.context", "eval")]) for n, dg in sorted(used - {(None, None)})]
    client.log_inputs(run_id, datasets=inputs)


def link_runs(client, train_run: str, eval_run: str | None) -> None:
    """The evaluation run as a child of the training run (the split DAGs have one run each)."""
    if eval_run and eval_run != train_run:
        client.set_tag(eval_run, "mlflow.parentRunId", train_run)
        client.set_tag(eval_run, "llmp.training_run_id", train_run)


def eval_report(spec: JobSpec, res: dict, ev: Manifest, train: Manifest, out: Path, client) -> list[Path]:
    """report.md + report.png: this version beside the champion it was gated against (same sets only)."""
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
    con = {k.removeprefix("contamination."): v for k, v in contamination_tags(ev.extra).items()}
    if con:
        notes.append(f"{report.OVERLAP}: items of the set that share a {spec.data.decontaminate.ngram}-gram with the "
                     "docs the model was trained on (the decontaminate stage's record of the corpus version)")
    r = report.Report(res["model_name"], res["version"], res["reason"],
                      report.rows(dict(ev.metrics), champ, comparable, con), ev.extra.get("sample"), losses, notes)
    return list(report.write(r, out))
