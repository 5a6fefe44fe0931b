"""Airflow connections as the pipeline reads them: each service's address and credentials from the connection the
job spec names (``services.spark_conn_id``, ``aws_conn_id``, ``mlflow_conn_id``, ``kube_conn_id``), turned into the
environment a stage reads (``pipelines.spec.ENV_OVERRIDES`` and the clients' own variables). A connection that
exists, in any backend (the UI's metastore, ``AIRFLOW_CONN_*``, a secrets backend), wins over the worker's
environment, which wins over the spec's ``--set`` overrides and its file; an absent one changes nothing.

One lookup for every task: :func:`resolve` gives the spec as a stage sees it and the environment that makes it so.
The stage operators pass that environment to their subprocesses (spark-submit inherits it for the submit only);
setup_services, teardown_services and the extra links talk to the services from the task's own process inside
:func:`services`, which sets it for the block and puts the process environment back after (:func:`scoped_env`):
``airflow dags test`` and LocalExecutor run several tasks in one process. The trigger reads the Kubernetes connection
with :func:`aconnection` (the triggerer).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence


def find_connection(conn_id: str):
    """The Airflow connection ``conn_id`` from any backend (the UI's metastore, ``AIRFLOW_CONN_*``, a secrets
    backend), or None when none defines it."""
    from airflow.sdk import BaseHook

    try:
        return BaseHook.get_connection(conn_id)
    except Exception as e:
        if _not_found(e):
            return None
        raise


def _not_found(e: Exception) -> bool:
    """Whether a connection lookup failed only because no backend defines the connection."""
    from airflow.sdk.exceptions import AirflowNotFoundException, AirflowRuntimeError

    return isinstance(e, AirflowNotFoundException) or (
        isinstance(e, AirflowRuntimeError) and "CONNECTION_NOT_FOUND" in str(getattr(e.error, "error", "")))


def _uri(conn, default_scheme: str) -> str:
    host = conn.host or ""
    if "://" not in host:
        host = f"{conn.schema or default_scheme}://{host}"
    return host + (f":{conn.port}" if conn.port else "")


def aws_env(conn) -> dict[str, str]:
    x = conn.extra_dejson
    pairs = {"AWS_ACCESS_KEY_ID": conn.login, "AWS_SECRET_ACCESS_KEY": conn.password,
             "AWS_SESSION_TOKEN": x.get("aws_session_token"), "S3_ENDPOINT_URL": x.get("endpoint_url"),
             "S3_REGION": x.get("region_name"), "AWS_DEFAULT_REGION": x.get("region_name")}
    return {k: str(v) for k, v in pairs.items() if v}


def mlflow_env(conn) -> dict[str, str]:
    """The tracking URI and its basic-auth login; the UI the extra links point at is extra ``ui_url``, else (when the
    worker sets no ``MLFLOW_UI_URL`` of its own: a guess never overrides a setting) the tracking server itself (an
    ``http(s)`` URI: MLflow's server serves its UI there)."""
    uri = _uri(conn, "http") if conn.host else None
    guess = uri if uri and uri.startswith(("http://", "https://")) and not os.environ.get("MLFLOW_UI_URL") else None
    ui = conn.extra_dejson.get("ui_url") or guess
    pairs = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_UI_URL": ui,
             "MLFLOW_TRACKING_USERNAME": conn.login, "MLFLOW_TRACKING_PASSWORD": conn.password}
    return {k: str(v) for k, v in pairs.items() if v}


def kube_env(conn, scratch: Path) -> dict[str, str]:
    """The launcher's kubeconfig and context from a Kubernetes connection; an inline ``kube_config`` is written to a
    file of the task's own (mode 0600) for the stage's lifetime; ``in_cluster`` leaves the pod's own identity."""
    x = {k.removeprefix("extra__kubernetes__"): v for k, v in conn.extra_dejson.items()}  # the provider's old keys
    env = {"LLMP_KUBE_CONTEXT": str(x["cluster_context"])} if x.get("cluster_context") else {}
    if str(x.get("in_cluster", "")).strip().lower() in ("true", "1", "yes"):
        return {**env, "LLMP_KUBECONFIG": ""}
    if x.get("kube_config"):
        path = scratch / ("kubeconfig-" + re.sub(r"[^A-Za-z0-9_-]", "_", str(conn.conn_id)))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # also when the file was there already
        with os.fdopen(fd, "w") as f:
            f.write(x["kube_config"] if isinstance(x["kube_config"], str) else json.dumps(x["kube_config"]))
        return {**env, "LLMP_KUBECONFIG": str(path)}
    if x.get("kube_config_path"):
        return {**env, "LLMP_KUBECONFIG": str(x["kube_config_path"])}
    return env


def spark_master(conn) -> str:
    """The master URL of a Spark connection (host, with the port when it names one), as the provider's hook builds
    it: ``spark://h:7077``, ``k8s://https://…``, ``local[*]``, ``yarn``."""
    return (conn.host or "") + (f":{conn.port}" if conn.port else "")


def spark_env(conn) -> dict[str, str]:
    master = spark_master(conn)
    return {"SPARK_MASTER": master} if master else {}


def services_env(services, scratch: Path) -> tuple[dict[str, str], frozenset[str]]:
    """The environment from the connections a spec's ``services`` section names, and the ids of those that exist
    (absent ones add nothing). ``scratch``: where an inline kubeconfig is written, for the caller to remove."""
    readers = ((services.spark_conn_id, spark_env), (services.aws_conn_id, aws_env),
               (services.mlflow_conn_id, mlflow_env), (services.kube_conn_id, lambda c: kube_env(c, scratch)))
    env: dict[str, str] = {}
    found = set()
    for conn_id, to_env in readers:
        conn = find_connection(conn_id) if conn_id else None
        if conn is not None:
            env.update(to_env(conn))
            found.add(conn_id)
    return env, frozenset(found)


@dataclass(frozen=True)
class Resolved:
    spec: Any  # the JobSpec as the task's stage reads it: the connections applied
    env: dict[str, str]  # what the connections add to a stage's environment (secrets included)
    found: frozenset[str]  # the ids of the connections that exist


def resolve(spec_path: str | None, sets: Sequence[str], scratch: Path) -> Resolved:
    """The spec ``spec_path`` with its ``--set`` overrides ``sets`` as a stage started by this task reads it: the
    connections it names win over this process's environment (``ENV_OVERRIDES``), which wins over ``sets`` and the
    file. Raises ``SpecError`` for a spec that cannot be used. ``scratch`` must outlive the use of ``env`` (an inline
    kubeconfig is written there)."""
    from pipelines.spec import load_spec

    env, found = services_env(load_spec(spec_path, list(sets)).services, scratch)
    return Resolved(load_spec(spec_path, list(sets), env={**os.environ, **env}), env, found)


@contextlib.contextmanager
def scoped_env(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in this process's environment for the block; then every variable it names is back to its value
    before, or absent when it was, also when the block raises."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def services(spec_path: str | None, sets: Sequence[str] = ()) -> Iterator[Any]:
    """:func:`resolve` for code that talks to the services from this process (setup_services, teardown_services,
    the extra links): yields the resolved spec, with the connections' environment set for the block only (MLflow's
    and boto3's clients read their credentials from it)."""
    with tempfile.TemporaryDirectory(prefix="llmp-conn-") as scratch:
        r = resolve(spec_path, sets, Path(scratch))
        with scoped_env(r.env):
            yield r.spec


async def aconnection(conn_id: str):
    """``find_connection`` for the triggerer's event loop."""
    from airflow.sdk import BaseHook

    try:
        return await BaseHook.aget_connection(conn_id)
    except Exception as e:
        if _not_found(e):
            return None
        raise
