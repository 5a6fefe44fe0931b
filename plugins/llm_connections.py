"""Airflow connections as the pipeline reads them: each service's address and credentials from the connection the
job spec names (``services.spark_conn_id``, ``aws_conn_id``, ``mlflow_conn_id``, ``kube_conn_id``), turned into the
environment a stage reads (``pipelines.spec.ENV_OVERRIDES`` and the clients' own variables). A connection that
exists, in any backend (the UI's metastore, ``AIRFLOW_CONN_*``, a secrets backend), wins over the spec's values;
an absent one changes nothing. Used by the operators (workers) and the trigger (triggerer).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path


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
    pairs = {"MLFLOW_TRACKING_URI": _uri(conn, "http") if conn.host else None,
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


async def aconnection(conn_id: str):
    """``find_connection`` for the triggerer's event loop."""
    from airflow.sdk import BaseHook

    try:
        return await BaseHook.aget_connection(conn_id)
    except Exception as e:
        if _not_found(e):
            return None
        raise
