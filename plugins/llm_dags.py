"""The pipeline's DAGs, built from the stage table (``pipelines/stages.py``): a file in ``dags/`` is one call.

* ``data_curation`` (ingest → dedup → filter → tokenize) runs on ``data.schedule`` (cron, default weekly,
  no catch-up) and grows the corpus: ``previous_corpus`` finds the last corpus version (the newest
  ``curated_shards`` event), ingest reads only the inputs it does not hold, dedup removes duplicates of its docs,
  tokenize adds new shards to its shards. Its last task, ``publish`` (after the teardown, so the services are closed
  before the next DAG starts), emits the Asset ``curated_shards`` with the new version's manifest path, digest and
  lineage, or, when nothing new arrived, is skipped: no event, and training does not run again.
* ``training`` (preflight → train → promote) is scheduled on ``curated_shards`` and emits ``checkpoint``.
* ``evaluation`` (evaluate → register) is scheduled on ``checkpoint`` and emits ``champion`` when the registered
  version took the champion alias (a deploy DAG can be scheduled on it).
* ``llm_pipeline`` runs every stage in one DAG (the one-click demo); it emits no Asset.

A DAG whose stages read manifests of another DAG's stages starts with ``upstream_assets``: the manifests come
from the Params (``<stage>_manifest``) when given, else from the Asset event that triggered the run, else from
the newest event of that Asset, so a manual run of ``training`` or ``evaluation`` works alone.
Every DAG opens the pipeline's services first (``setup_services``: the embedded S3 endpoint when none is
configured, an MLflow run tagged with the DAG and run ids) and closes them last (a teardown). Every task, these two,
the stages and the extra links, finds the services through the same lookup (``llm_connections.resolve``: the
Airflow connections the spec names win over its ``services``).
"""
from __future__ import annotations

import os
from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Asset, Param, task

from llm_operators import SparkStageOperator, StageOperator, failure_summary, project_root
from pipelines.stages import DAGS, STAGES, Stage, of_dag, stage

# Transient failures (S3, spark-submit, MLflow) are retried with exponential backoff; a stage that rejects its
# input or spec exits 2 and fails at once (StageOperator). Every task has a time limit.
DEFAULTS = {"retries": 2, "retry_delay": timedelta(seconds=30), "retry_exponential_backoff": True,
            "max_retry_delay": timedelta(minutes=10), "execution_timeout": timedelta(hours=1),
            "on_failure_callback": failure_summary, "on_retry_callback": failure_summary}
DEFAULT_SPEC = "configs/demo.yaml"
UPSTREAM_TASK = "upstream_assets"
PUBLISH_TASK = "publish"
PREVIOUS_TASK = "previous_corpus"

# Trigger-form fields that override one spec key each (empty = the spec's value), on the forms of the DAGs that
# run the stage named: name → (key, stage, form section, JSON schema).
OVERRIDES: dict[str, tuple[str, str, str, dict]] = {
    "corpus": ("data.inputs", "ingest", "Data", {"type": ["null", "array"], "items": {"type": "string"},
                                       "description": "Input JSONL files (plain, .gz or .zst) with a `text` field, "
                                                      "one per line; paths relative to the project root."}),
    "steps": ("train.steps", "train", "Training", {"type": ["null", "integer"], "minimum": 1, "maximum": 10_000_000,
                                          "description": "Optimizer steps."}),
    "nproc": ("launcher.nproc_per_node", "train", "Training", {"type": ["null", "integer"], "minimum": 1, "maximum": 64,
                                                      "description": "Ranks per node (torchrun processes or GPUs)."}),
    "n_layers": ("model.n_layers", "train", "Model", {"type": ["null", "integer"], "minimum": 1, "maximum": 512,
                                             "description": "Transformer layers."}),
    "d_model": ("model.d_model", "train", "Model", {"type": ["null", "integer"], "minimum": 16, "maximum": 65_536,
                                           "description": "Model width (a multiple of n_heads)."}),
    "n_heads": ("model.n_heads", "train", "Model", {"type": ["null", "integer"], "minimum": 1, "maximum": 1024,
                                           "description": "Attention heads."}),
    "eval_limit": ("eval.limit", "evaluate", "Evaluation", {"type": ["null", "integer"], "minimum": 1, "maximum": 100_000,
                                                "description": "lm-evaluation-harness items per task."}),
}

# SIGTERM to the train task's processes (a user marking it failed, its timeout, the worker pod evicted) is a
# preemption notice: the ranks checkpoint to L1 within train.preempt_grace_s (default 25 s) before SIGKILL after this
# (or after torchrun's shutdown timeout of the spec the task runs + 5 s, when longer: StageOperator.grace_from_spec)
TRAIN_KILL_GRACE_S = 35.0


def spec_choices() -> list[str]:
    """The specs in ``configs/`` (the form's proposals; any other path can be typed)."""
    return sorted(f"configs/{p.name}" for p in (project_root() / "configs").glob("*.yaml")) or [DEFAULT_SPEC]


def default_spec() -> str:
    return os.environ.get("LLMP_SPEC") or DEFAULT_SPEC


def spec_value(key: str):
    """A value of the default spec (read at parse time), e.g. ``data.schedule``."""
    from pipelines.spec import load_spec

    return load_spec(str(project_root() / default_spec())).value(key)


def params(stages: list[Stage], source: str | None) -> dict:
    out = {
        "spec": Param(default_spec(), type="string", title="Job spec", section="Run", examples=spec_choices(),
                      description="A spec in configs/ (pick one) or the path of another YAML file (type it)."),
        "force": Param(False, type="boolean", title="Force", section="Run",
                       description="Recompute the stages even when their manifests verify (default: reuse)."),
    }
    names = {s.name for s in stages}
    for name, (key, for_stage, section, schema) in OVERRIDES.items():
        if for_stage in names:
            out[name] = Param(None, section=section, title=f"{name} ({key})", **schema)
    if source:
        out[f"{source}_manifest"] = Param(None, type=["null", "string"], section="Inputs", title=f"{source} manifest",
                                          description=f"Path of a {source} manifest.json (its upstream manifests are "
                                                      f"found from it); empty: the '{asset_of(source)}' Asset event "
                                                      "that triggered the run, else the newest one.")
    return out


def overrides(stages: list[Stage]) -> list[str]:
    names = {s.name for s in stages}
    out = [f"{key}={{{{ params.{name} | tojson }}}}" for name, (key, st, _, _) in OVERRIDES.items() if st in names]
    return out + ["run.force={{ params.force | lower }}",
                  "run.mlflow_run_id={{ ti.xcom_pull(task_ids='setup_services')['mlflow_run_id'] }}"]


def asset_of(stage_name: str) -> str:
    return DAGS[stage(stage_name).dag]["asset"]


def manifest_of(name: str, inside: set[str]) -> str:
    if name in inside:
        return "{{ ti.xcom_pull(task_ids='%s') }}" % name
    return "{{ ti.xcom_pull(task_ids='%s')['%s'] }}" % (UPSTREAM_TASK, name)


def open_services(spec_path: str, dag_id: str, run_id: str) -> dict:
    """What ``setup_services`` does, for the services the stages will use (``llm_connections.services``: the
    connections that exist win over the spec): the embedded S3 endpoint, only when no endpoint is configured (a
    lease shared by overlapping runs); the MLflow run, tagged with the DAG and run ids."""
    from llm_connections import services

    from pipelines import tracking
    from pipelines.storage import s3

    owner = f"{dag_id}/{run_id}"
    with services(spec_path) as spec:
        need_s3 = not spec.services.s3_endpoint_url
    # started outside services(): the shared endpoint outlives this task and must not inherit its connections' secrets
    started = s3.acquire(owner) if need_s3 else None
    try:
        with services(spec_path) as spec:
            mlflow_run = tracking.start_run(spec, run_name=f"{spec.run.name}-{dag_id}-{run_id}",
                                            tags={"airflow.dag_id": dag_id, "airflow.run_id": run_id})
    except BaseException:  # no teardown info to release it with: release it here
        if started:
            s3.release(owner)
        raise
    return {"mlflow_run_id": mlflow_run, "embedded_s3": started, "s3_lease": owner}


def close_services(spec_path: str, info: dict | None) -> None:
    """What ``teardown_services`` does with ``open_services``' result: close the MLflow run on the server it was
    opened on, and release the embedded S3 endpoint only when this run started it (stopped by the last run that
    holds it; its objects are saved to var/s3/store)."""
    from llm_connections import services

    from pipelines import tracking
    from pipelines.storage import s3

    info = info or {}
    try:
        if info.get("mlflow_run_id"):
            with services(spec_path) as spec:
                tracking.client(spec).set_terminated(info["mlflow_run_id"])
    finally:  # an MLflow server that fails to answer does not keep the endpoint running
        if info.get("embedded_s3"):
            s3.release(info["s3_lease"])


@task
def setup_services(params=None) -> dict:
    """The embedded S3 endpoint when no external one is configured, and the MLflow run (``open_services``)."""
    from airflow.sdk import get_current_context

    ctx = get_current_context()
    return open_services(params["spec"], ctx["dag"].dag_id, ctx["run_id"])


@task
def teardown_services(info: dict, params=None) -> None:
    """Close the MLflow run and release the embedded S3 endpoint if this run started it (``close_services``)."""
    close_services(params["spec"], info)


def upstream_assets_task(asset: Asset, source: str, needed: list[str]):
    """{stage: manifest path} of the upstream stages this DAG reads: from the ``<source>_manifest`` Param, else the
    Asset event that triggered the run, else the newest event of the Asset; the others by following the source
    manifest's inputs."""

    @task(task_id=UPSTREAM_TASK, inlets=[asset])  # the DAG's retries: only storage failing raises a retryable error
    def upstream_assets(params=None) -> dict:
        from airflow.sdk import get_current_context

        from llm_operators import upstream_manifests

        ctx = get_current_context()
        triggering = list((ctx.get("triggering_asset_events") or {}).get(asset, []))
        return upstream_manifests(asset.name, source, needed, params.get(f"{source}_manifest"), triggering,
                                  ctx["inlet_events"][asset])

    return upstream_assets()


def previous_corpus_task(asset: Asset):
    """The manifest of the newest ``asset`` event (the corpus version this run adds to), or "" when there is none."""

    @task(task_id=PREVIOUS_TASK, inlets=[asset])
    def previous_corpus() -> str:
        from airflow.sdk import get_current_context

        events = list(get_current_context()["inlet_events"][asset])
        path = events[-1].extra.get("manifest", "") if events else ""
        print(f"corpus version to add to: {path or 'none (a first, full curation)'}")
        return path

    return previous_corpus()


def publish_task(asset: Asset, manifest, previous=None):
    """The DAG's last task: the Asset event, whose ``extra`` says which result it is (the last stage's manifest path
    and digest, and the manifests it was made from). Skipped, so no event, when the result is ``previous`` (the
    corpus version the run started from: nothing new arrived), or a registration that did not move the champion
    alias."""

    @task(task_id=PUBLISH_TASK, outlets=[asset])
    def publish(manifest: str, previous: str | None = None) -> dict:
        from airflow.sdk import get_current_context

        from llm_operators import asset_extra, no_event

        why = no_event(manifest, previous)
        if why:
            from airflow.exceptions import AirflowSkipException

            raise AirflowSkipException(why)
        extra = asset_extra(manifest)
        get_current_context()["outlet_events"][asset].extra = extra
        return extra

    return publish(manifest, previous)


def stage_task(s: Stage, inside: set[str], ovr: list[str], incremental: bool = False):
    args = [a for up in s.upstream for a in (stage(up).flag, manifest_of(up, inside))]
    if incremental and s.incremental:
        args += ["--corpus-manifest", "{{ ti.xcom_pull(task_ids='%s') }}" % PREVIOUS_TASK]
    kw = dict(task_id=s.name, module=s.module, spec="{{ params.spec }}", overrides=ovr, stage_args=args,
              execution_timeout=timedelta(hours=s.timeout_hours))
    if s.engine == "spark":
        return SparkStageOperator(name=f"llm-pipeline-{s.name}", **kw)
    if s.name == "train":  # a stopped task gives the ranks their preemption grace before SIGKILL
        kw.update(kill_grace_s=TRAIN_KILL_GRACE_S, grace_from_spec=True)
    return StageOperator(**kw)


def build(dag_id: str) -> DAG:
    """One DAG of the pipeline: ``llm_pipeline`` (every stage) or a key of ``pipelines.stages.DAGS``."""
    stages = list(STAGES.values()) if dag_id == "llm_pipeline" else of_dag(dag_id)
    inside = {s.name for s in stages}
    external = list(dict.fromkeys(u for s in stages for u in s.upstream if u not in inside))
    source = of_dag(stage(external[0]).dag)[-1].name if external else None  # the stage that emits our Asset
    upstream = Asset(asset_of(source)) if source else None
    own = DAGS.get(dag_id, {}).get("asset")
    cron_key = DAGS.get(dag_id, {}).get("schedule")  # a time schedule from the spec, else the upstream Asset
    schedule = spec_value(cron_key) if cron_key else ([upstream] if upstream else None)
    with DAG(dag_id=dag_id, description=DAGS.get(dag_id, {}).get("doc", "Every stage, raw web text to a registered "
                                                                       "model, in one DAG (the demo)."),
             schedule=schedule, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False, max_active_runs=1,
             default_args=DEFAULTS, tags=["llm", *sorted({s.engine for s in stages})], params=params(stages, source),
             doc_md=__doc__) as dag:
        setup = setup_services()
        prev = setup
        if external:
            up = upstream_assets_task(upstream, source, external)
            setup >> up
            prev = up
        incremental = bool(DAGS.get(dag_id, {}).get("incremental"))
        previous = previous_corpus_task(Asset(own)) if incremental else None
        if previous is not None:
            prev >> previous
            prev = previous
        ovr = overrides(stages)
        for s in stages:
            t = stage_task(s, inside, ovr, incremental)
            prev >> t
            prev = t
        teardown = teardown_services(setup).as_teardown(setups=setup)
        prev >> teardown
        if own:
            [prev, teardown] >> publish_task(Asset(own), prev.output, previous)
    return dag
