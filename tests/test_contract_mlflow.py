"""MLflow's runtime contract, executed: the tracking server started in the pipeline image with exactly the args
modules/metadata's Deployment gives it (local.mlflow_args, through the image's entrypoint, read-only root file
system, the Deployment's uid), its backend store and its basic-auth database on a real PostgreSQL (the DSN shape of
the Secret, ``sslmode=require``), answers clients that call it by the Service's DNS names — the Host header a pod
sends for ``http://mlflow.mlflow.svc.cluster.local:5000``, the URI Terraform hands the pipeline — and still refuses
a foreign name (DNS rebinding). Without --allowed-hosts the same server answers those clients 403.

The port is a free one here (the cluster's 5000 may be taken on this machine); the names and the rest of the args are
Terraform's."""
from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.request

import pytest

from conftest import ROOT, free_port, wait_for
from image_build import Containers, built_image
from pipelines.eval.tracking_server import allowed_hosts
from pg_server import Postgres
from tf_locals import module_locals

METADATA = ROOT / "infra/terraform/modules/metadata"
NAMESPACE = "mlflow"  # var.namespaces.mlflow on the cluster


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    image = built_image()
    tmp = tmp_path_factory.mktemp("mlflow")
    os.chmod(tmp, 0o755)
    with Postgres() as pg:
        boxes = Containers(image)
        try:
            yield _serve(pg, boxes, tmp)
        finally:
            boxes.close()


def _serve(pg: Postgres, boxes: Containers, tmp) -> dict:
    """The Deployment's container, started; its port, name and args."""
    pg.app("mlflow_app", ["mlflow", "mlflow_auth"])
    port = free_port()
    tf = module_locals(METADATA / "main.tf", {"var.namespaces.mlflow": NAMESPACE, "var.mlflow_bucket": "bucket"})
    args = [str(port) if a == "5000" else a for a in tf["mlflow_args"]]
    # no S3 here: the artifacts go to a folder; every other arg is the Deployment's
    i = args.index("--artifacts-destination")
    args[i + 1] = "/tmp/artifacts"
    secrets = tmp / "secrets"
    (secrets / "metadata-db").mkdir(parents=True)
    (secrets / "mlflow-auth").mkdir()
    (secrets / "metadata-db" / "connection").write_text(pg.dsn("mlflow_app", "mlflow"))
    (secrets / "mlflow-auth" / "basic_auth.ini").write_text(
        "[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
        f"database_uri = {pg.dsn('mlflow_app', 'mlflow_auth')}\n"
        "admin_username = pipeline\nadmin_password = contract-admin-pw\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    for f in secrets.rglob("*"):
        os.chmod(f, 0o755 if f.is_dir() else 0o644)
    pod = ["--network", "host", "--user", "50000:0", "--read-only", "--tmpfs", "/tmp:mode=1777",
           "-e", "MLFLOW_AUTH_CONFIG_PATH=/var/run/secrets/mlflow-auth/basic_auth.ini",
           "-e", "CONNECTION_CHECK_MAX_COUNT=0", "-e", "MLFLOW_FLASK_SERVER_SECRET_KEY=contract-flask-key",
           "-v", f"{secrets / 'metadata-db'}:/var/run/secrets/metadata-db:ro",
           "-v", f"{secrets / 'mlflow-auth'}:/var/run/secrets/mlflow-auth:ro"]
    name = boxes.start(*pod, args=args)

    def up():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return None
    try:
        wait_for(lambda: boxes.alive(name, up), 300, "the MLflow server in the image", every=2)
    except AssertionError:
        pytest.fail(f"MLflow never answered /health; its log:\n{boxes.logs(name)}")
    return {"port": port, "boxes": boxes, "name": name, "pod": pod, "args": args, "password": pg.passwords["mlflow_app"]}


def call(port: int, host: str, path: str, body: dict | None = None) -> tuple[int, str]:
    auth = base64.b64encode(b"pipeline:contract-admin-pw").decode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body else "GET",
                                 data=json.dumps(body).encode() if body else None,
                                 headers={"Host": host, "Authorization": f"Basic {auth}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:  # not listening yet
        return 0, str(e)


def test_clients_calling_the_service_by_its_dns_names_are_answered(server):
    port = server["port"]
    name = f"contract-{int(time.time())}"
    for host in (f"mlflow.{NAMESPACE}.svc.cluster.local:{port}", f"mlflow.{NAMESPACE}:{port}", f"mlflow:{port}",
                 f"127.0.0.1:{port}"):
        status, text = call(port, host, "/api/2.0/mlflow/experiments/search?max_results=5")
        assert status == 200, (host, status, text[:300])
    status, text = call(port, f"mlflow.{NAMESPACE}.svc.cluster.local:{port}", "/api/2.0/mlflow/experiments/create",
                        {"name": name})
    assert status == 200, text[:300]
    status, text = call(port, f"mlflow.{NAMESPACE}.svc:{port}",
                        f"/api/2.0/mlflow/experiments/get-by-name?experiment_name={name}")
    assert status == 200 and name in text  # stored in PostgreSQL, read back through another of the names


def test_the_database_password_is_on_no_command_line(server):
    """The backend store's URI reaches mlflow through its environment: no process of the server shows the password
    in its command line (ps, /proc/<pid>/cmdline)."""
    r = server["boxes"].exec(server["name"], ["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
    assert r.returncode == 0 and "mlflow" in r.stdout, r.stderr
    assert server["password"] not in r.stdout


def test_a_foreign_host_and_a_missing_login_are_refused(server):
    port = server["port"]
    status, _ = call(port, f"attacker.example:{port}", "/api/2.0/mlflow/experiments/search?max_results=5")
    assert status == 403
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=5",
                                 headers={"Host": f"mlflow.{NAMESPACE}.svc.cluster.local:{port}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401


def test_without_allowed_hosts_the_service_name_is_refused(server):
    """The check that makes the flags necessary: the same server without --allowed-hosts (MLflow's defaults)
    answers a pod that calls the Service by name 403, while its /health stays 200 (so pods looked Ready)."""
    port = free_port()
    args = server["args"]
    plain = ["mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--backend-store-uri",
             "sqlite:////tmp/plain.db", "--workers", "1"]
    name = server["boxes"].start(*server["pod"], args=plain)
    boxes = server["boxes"]
    wait_for(lambda: boxes.alive(name, lambda: call(port, f"127.0.0.1:{port}", "/health")[0] == 200), 300,
             "the plain server", every=2)
    status, _ = call(port, f"mlflow.{NAMESPACE}.svc.cluster.local:{port}",
                     "/api/2.0/mlflow/experiments/search?max_results=5")
    assert status == 403, name
    # the hosts the Deployment's args allow (what tracking_server adds to mlflow server): the Service's names
    opt = {k: args[args.index(k) + 1] for k in ("--service", "--namespace", "--port")}
    hosts = allowed_hosts(opt["--service"], opt["--namespace"], int(opt["--port"]))
    assert f"mlflow.{NAMESPACE}.svc.cluster.local:{server['port']}" in hosts  # the served port
