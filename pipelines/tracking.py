"""MLflow plumbing shared by the stages.

One MLflow run per pipeline run: the DAG's first task creates it and passes its id to every
stage as ``run.mlflow_run_id``; each stage logs its counts as metrics ``<stage>.<count>`` and its
plots as artifacts under ``<stage>/``; training logs its curves into the same run; ``register``
logs the model there. Stages run on their own (no run id) log nothing except training, which
then opens a run of its own.
"""
from __future__ import annotations

import contextlib
import numbers
import os
import re
import time
from pathlib import Path
from typing import Iterable

from pipelines.spec import JobSpec, load_spec, project_home, resolve_path


# the tracking server failing (a retry may find it back: exit 75): these codes, and an INTERNAL_ERROR whose message
# is MLflow's client saying the request got no answer (a connection refused or reset, a timeout) or a 5xx/429 one;
# every other error is an answer about what was asked (no such model, a bad name or URI, refused credentials): exit 2
MLFLOW_OUTAGE = frozenset({"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "RESOURCE_EXHAUSTED",
                           "DEADLINE_EXCEEDED"})
_NO_ANSWER = re.compile(r"API request to (endpoint )?\S+ failed with (exception|error code (5\d\d|429)\b)")
# MLflow's own wrapper of files that failed to come from the artifact store (EIO, S3 down, a reset): the store, not an
# answer, unless a file was refused (a permission, S3's AccessDenied: the user's to grant)
_NOT_FETCHED = "The following failures occurred while downloading"
_REFUSED = re.compile(r"PermissionError|Permission denied|AccessDenied|Forbidden")


def mlflow_error(e: BaseException) -> bool:
    """Whether ``e`` is an ``MlflowException`` (or a subclass: ``RestException`` …), without importing MLflow."""
    return "MlflowException" in {t.__name__ for t in type(e).__mro__}


def mlflow_answered(e: BaseException) -> bool:
    """Whether ``e`` (an ``MlflowException``) is the registry's answer about the request, not the server failing."""
    code, text = getattr(e, "error_code", None), str(getattr(e, "message", e))
    if code in MLFLOW_OUTAGE:
        return False
    if code == "INTERNAL_ERROR" and _NOT_FETCHED in text:
        return bool(_REFUSED.search(text))
    return not (code == "INTERNAL_ERROR" and _NO_ANSWER.search(text))


def mlflow_outage(e: BaseException) -> bool:
    """Whether ``e`` is MLflow's server failing (unavailable, throttling, 5xx, unreachable): a retry may pass."""
    return mlflow_error(e) and not mlflow_answered(e)


def tracking_uri(spec: JobSpec) -> str:
    """``sqlite:///var/mlflow.db`` is relative to the project root, whatever the cwd."""
    uri = spec.services.mlflow_tracking_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        rel = uri[len(prefix):]
        path = project_home() / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return prefix + str(path)
    return uri


def client(spec: JobSpec):
    """An MlflowClient bound to the spec's store. It does not touch MLflow's process-global URI:
    ``mlflow.set_tracking_uri`` also exports ``MLFLOW_TRACKING_URI``, which every later
    subprocess (and so every later spec load) would inherit."""
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(spec)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def model_versions(client, filter_string: str | None = None, page: int = 1000):
    """Every model version the registry holds (matching ``filter_string``), a page at a time: one call returns at
    most a page, and a caller that decides what may be deleted must see them all."""
    token = None
    while True:
        got = client.search_model_versions(filter_string, max_results=page, page_token=token)
        yield from got
        token = got.token
        if not token:
            return


@contextlib.contextmanager
def using(uri: str):
    """Point MLflow's fluent API (``mlflow.start_run``, ``log_model``, ``models:/`` downloads) at ``uri`` for a
    block, then put the process-global URIs and the exported environment variables back as they were."""
    import mlflow

    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI",
                                            "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")}
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"  # its "View run at <tracking URI>" has any password
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:  # None = unset: MLflow resolves its default again (and creates no mlflow.db in the cwd)
        mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"])
        mlflow.set_registry_uri(saved["MLFLOW_REGISTRY_URI"])
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fluent(spec: JobSpec):
    """:func:`using` the spec's store."""
    return using(tracking_uri(spec))


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI``, else the spec's default store (``var/mlflow.db`` under the project home)."""
    return tracking_uri(load_spec(None))


def experiment_id(spec: JobSpec) -> str:
    c = client(spec)
    exp = c.get_experiment_by_name(spec.run.name)
    if exp is not None:
        return exp.experiment_id
    art = resolve_path(spec.services.mlflow_artifact_root)
    location = (art / spec.run.name).resolve().as_uri() if "://" not in spec.services.mlflow_artifact_root \
        else f"{spec.services.mlflow_artifact_root.rstrip('/')}/{spec.run.name}"
    try:
        return c.create_experiment(spec.run.name, artifact_location=location)
    except Exception:  # created concurrently; else (a refusal, an outage) its own error, as the stage classifies it
        exp = c.get_experiment_by_name(spec.run.name)
        if exp is None:
            raise
        return exp.experiment_id


def start_run(spec: JobSpec, run_name: str | None = None, tags: dict | None = None) -> str:
    c = client(spec)
    r = c.create_run(experiment_id(spec), run_name=run_name, tags=tags or {})
    c.log_text(r.info.run_id, spec.to_yaml(), "spec.yaml")
    return r.info.run_id


def _numeric_items(d: dict, prefix: str) -> Iterable[tuple[str, float]]:
    for k, v in d.items():
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, numbers.Number):
            yield f"{prefix}.{k}", float(v)
        elif isinstance(v, dict):
            yield from _numeric_items(v, f"{prefix}.{k}")


def airflow_ids() -> dict[str, str]:
    """``airflow.dag_id``/``airflow.run_id``/``airflow.task_id`` of the Airflow task this process runs under
    (the task runner exports them as ``AIRFLOW_CTX_*``); empty outside Airflow."""
    env = {"airflow.dag_id": "AIRFLOW_CTX_DAG_ID", "airflow.run_id": "AIRFLOW_CTX_DAG_RUN_ID",
           "airflow.task_id": "AIRFLOW_CTX_TASK_ID"}
    return {k: os.environ[v] for k, v in env.items() if os.environ.get(v)}


def log_stage(spec: JobSpec, manifest, artifacts: Iterable[str] = ()) -> None:
    """Log a stage's counts/metrics and named output files to the pipeline's MLflow run, if any."""
    run_id = spec.run.mlflow_run_id
    if not run_id:
        return

    from mlflow.entities import Metric

    c = client(spec)
    ts = int(time.time() * 1000)
    items = list(_numeric_items(manifest.counts, manifest.stage)) + \
        list(_numeric_items(manifest.metrics, manifest.stage))
    c.log_batch(run_id, metrics=[Metric(k, v, ts, 0) for k, v in items])
    c.set_tag(run_id, f"{manifest.stage}.manifest", manifest.path)
    for key, value in airflow_ids().items():  # which DAG run and task produced it
        c.set_tag(run_id, f"{manifest.stage}.{key}", value)
    for name in artifacts:
        p = manifest.output(name)
        if Path(p).is_file():
            c.log_artifact(run_id, str(p), artifact_path=manifest.stage)


def stage_links(spec: JobSpec, manifest: dict, experiment: str | None) -> dict[str, str]:
    """URLs for a stage's Airflow extra links: its MLflow run, the registered model version (register), the
    checkpoint (promote: the S3 console on AWS, the endpoint URL of another S3 store, the L1 path locally)."""
    ui, run_id, extra = spec.services.mlflow_ui_url.rstrip("/"), spec.run.mlflow_run_id, manifest.get("extra", {})
    links = {}
    if run_id and experiment:
        links["mlflow_run"] = f"{ui}/#/experiments/{experiment}/runs/{run_id}"
    if "model_name" in extra and "version" in extra:
        links["model_version"] = f"{ui}/#/models/{extra['model_name']}/versions/{extra['version']}"
    if str(extra.get("l2_uri", "")).startswith("s3://"):
        bucket, _, key = extra["l2_uri"][5:].partition("/")
        endpoint = spec.services.s3_endpoint_url
        if endpoint == "aws":
            links["checkpoint"] = (f"https://s3.console.aws.amazon.com/s3/buckets/{bucket}?region="
                                   f"{spec.services.s3_region}&prefix={key}/")
        elif endpoint:
            links["checkpoint"] = f"{endpoint.rstrip('/')}/{bucket}?prefix={key}/"
        else:  # the embedded endpoint lives only while a run does: point at the verified L1 copy
            links["checkpoint"] = (resolve_path(spec.checkpoint.l1) / extra["checkpoint"]).as_uri()
    return links
