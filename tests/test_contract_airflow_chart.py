"""The Airflow chart's runtime contract, executed: every command, arg list and probe that the official Helm chart
(the version modules/metadata pins; tests/contracts/airflow-chart-<version>.yaml) renders for its jobs, init
containers, components and sidecars, run in the pipeline image the way the kubelet runs them — the image's
ENTRYPOINT with the pod's args, the probes' exec commands inside the running container — as the chart's uid and gid,
against a real PostgreSQL reached with the DSN shape modules/metadata writes (``sslmode=require``, TLS on), with the
values Terraform passes (airflowHome, the async engine's URI, the admin-login args), the executor the cluster uses
(KubernetesExecutor: in-cluster credentials, a Kubernetes API answering on 127.0.0.1) and its auth manager (FAB).

What no machine here can do is left to the cluster (docs/cluster.md: "contracts"): helm itself rendering the chart
(no helm binary; airflow.cfg below carries the keys our values set), pods on nodes, the worker pods' own run."""
from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, free_port, log_server_ports, wait_for
from image_build import Containers, built_image, podman
from pg_server import Postgres
from tf_locals import module_locals

METADATA = ROOT / "infra/terraform/modules/metadata"
VERSION = re.search(r'variable "airflow_chart_version" \{[^}]*?default\s*=\s*"([^"]+)"',
                    (METADATA / "variables.tf").read_text()).group(1)
CHART = yaml.safe_load((ROOT / f"tests/contracts/airflow-chart-{VERSION}.yaml").read_text())
TF = module_locals(METADATA / "main.tf", {})
WORKER_SA = "airflow-worker"  # modules/metadata var.worker_service_account's default
PROBE_BOUND_S = 600           # the scheduler's startupProbe allows 6 x 10 s; a loaded 2-core machine needs more


class InClusterAPI(ThreadingHTTPServer):
    """The Kubernetes API as the KubernetesExecutor meets it from a pod: HTTPS on KUBERNETES_SERVICE_HOST:PORT with
    the service account's CA and token. Pod lists are empty, watches stay open, created pods are recorded."""

    daemon_threads = True

    def __init__(self, tls_dir: Path):
        super().__init__(("127.0.0.1", free_port()), _APIHandler)
        self.pods: list[dict] = []
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls_dir / "tls.crt", tls_dir / "tls.key")
        self.socket = ctx.wrap_socket(self.socket, server_side=True)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _APIHandler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    DISCOVERY = {  # what the client's DynamicClient reads before it lists pods
        "/version": {"major": "1", "minor": "33", "gitVersion": "v1.33.0"},
        "/api": {"kind": "APIVersions", "versions": ["v1"]},
        "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
        "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
            {"name": "pods", "singularName": "pod", "namespaced": True, "kind": "Pod",
             "verbs": ["create", "delete", "get", "list", "patch", "watch"]}]},
    }

    def do_GET(self):
        if self.path.split("?")[0] in self.DISCOVERY:
            self._json(200, self.DISCOVERY[self.path.split("?")[0]])
        elif "watch=true" in self.path or "watch=1" in self.path:
            time.sleep(20)  # a watch with no events, then the stream ends as the API server's timeout ends it
            self._json(200, {})
        elif "/pods" in self.path:
            self._json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": []})
        else:
            self._json(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path.endswith("/pods"):
            self.server.pods.append(body)
            self._json(201, {**body, "status": {"phase": "Pending"}})
        else:
            self._json(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})


def _tls(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                        "/CN=kubernetes", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(d / "tls.key"),
                        "-out", str(d / "tls.crt")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Image, PostgreSQL with the airflow login and database, the in-cluster API, and what every Airflow container of
    the chart gets: env (the chart's standard env from our Secrets and values), airflow.cfg, service account files."""
    image = built_image()
    tmp = tmp_path_factory.mktemp("chart")
    os.chmod(tmp, 0o755)
    with Postgres() as pg:
        pg.app("airflow_app", ["airflow"])
        api = InClusterAPI(_tls(tmp / "kube-tls"))
        boxes = Containers(image)
        try:
            api_port = free_port()
            yield {"image": image, "pg": pg, "api": api, "pod": _chart_pod(tmp, pg, api, api_port), "boxes": boxes,
                   "api_port": api_port, "tmp": tmp}
        finally:
            boxes.close()
            api.shutdown()


def _chart_pod(tmp: Path, pg: Postgres, api: InClusterAPI, api_port: int) -> list[str]:
    """podman arguments that give a container what the chart's Airflow pods get."""
    sa = tmp / "serviceaccount"
    sa.mkdir()
    shutil.copy(tmp / "kube-tls" / "tls.crt", sa / "ca.crt")
    (sa / "token").write_text("test-token")
    (sa / "namespace").write_text("airflow")
    home = TF["airflow_home"]
    cfg = tmp / "airflow.cfg"
    # the keys our values (modules/metadata's helm_release) and the chart's KubernetesExecutor settings give
    cfg.write_text("\n".join([
        "[core]", "executor = KubernetesExecutor",
        "auth_manager = airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager",
        f"execution_api_server_url = http://127.0.0.1:{api_port}/execution/",
        "[fab]", "auth_rate_limited = True",
        "[api]", f"port = {api_port}", "host = 127.0.0.1",
        "[kubernetes_executor]", "namespace = airflow",
        f"pod_template_file = {home}/pod_templates/pod_template_file.yaml",
        "worker_container_repository = localhost/llm-pipeline", "worker_container_tag = latest",
        "delete_worker_pods = False", ""]))
    template = tmp / "pod_template_file.yaml"
    template.write_text(yaml.safe_dump(_pod_template(home)))
    dsn = pg.dsn("airflow_app", "airflow")
    env = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": dsn, "AIRFLOW_CONN_AIRFLOW_DB": dsn,
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": dsn.replace("postgresql://", "postgresql+psycopg_async://"),
           "AIRFLOW__CORE__FERNET_KEY": "ZmDfcTF7_60GrrY167zsiPd67pEvs0aGOv2oasOM1Pg=",
           "AIRFLOW__API__SECRET_KEY": "test-api-secret", "AIRFLOW__API_AUTH__JWT_SECRET": "test-jwt-secret",
           "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.server_address[1]),
           **log_server_ports()}
    mounts = [f"{cfg}:{home}/airflow.cfg:ro", f"{template}:{home}/pod_templates/pod_template_file.yaml:ro",
              f"{sa}:/var/run/secrets/kubernetes.io/serviceaccount:ro"]
    pod = ["--network", "host", "--user", f"{CHART['uid']}:{CHART['gid']}", "--tmpfs", f"{home}/logs:mode=1777"]
    for k, v in env.items():
        pod += ["-e", f"{k}={v}"]
    for m in mounts:
        pod += ["-v", m]
    return pod


@pytest.fixture(scope="module")
def jobs(stack) -> dict:
    """The migrate job, the wait-for-airflow-migrations init container and our create-user job (password from the
    mounted Secret), in that order, each a container of the image with the chart's args: their results."""
    boxes, pod, tmp = stack["boxes"], stack["pod"], stack["tmp"]
    out = {"migrate": boxes.run(*pod, "-e", "PYTHONUNBUFFERED=1", args=CHART["jobs"]["migrate-database"]["args"])}
    out["wait"] = boxes.run(*pod, args=CHART["init_containers"]["wait-for-airflow-migrations"]["args"])
    login = tmp / "admin-login"
    login.mkdir()
    (login / "password").write_text("s3cret pass\n")
    os.chmod(login / "password", 0o644)
    out["create-user"] = boxes.run(*pod, "-v", f"{login}:{TF['admin_login_mount']}:ro", args=TF["create_admin_args"])
    return out


@pytest.fixture(scope="module")
def components(stack, jobs) -> dict:
    """scheduler, dag-processor, triggerer and api-server started with the chart's args through the entrypoint."""
    if any(r.returncode for r in jobs.values()):
        pytest.fail("the chart's jobs failed (test_jobs_and_init_container_... says how)")
    boxes = stack["boxes"]
    return {c: boxes.start(*stack["pod"], args=spec["args"]) for c, spec in CHART["components"].items()}


def _pod_template(home: str) -> dict:
    """The chart's pod template (files/pod-template-file.kubernetes-helm-yaml) as it renders with modules/metadata's
    values: container ``base``, the worker service account, FSx (workers.extraVolumes/Mounts), logs in an emptyDir,
    airflow.cfg from the ConfigMap."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "placeholder-name",
                                                            "labels": {"tier": "airflow", "component": "worker"}},
            "spec": {"containers": [{"name": "base", "image": "localhost/llm-pipeline:latest",
                                     "imagePullPolicy": "IfNotPresent",
                                     "env": [{"name": "AIRFLOW__CORE__EXECUTOR", "value": "KubernetesExecutor"}],
                                     "volumeMounts": [{"name": "logs", "mountPath": f"{home}/logs"},
                                                      {"name": "config", "mountPath": f"{home}/airflow.cfg",
                                                       "subPath": "airflow.cfg", "readOnly": True},
                                                      {"name": "shared-fs", "mountPath": "/fsx"}]}],
                     "restartPolicy": "Never", "securityContext": {"runAsUser": 50000, "fsGroup": 0},
                     "serviceAccountName": WORKER_SA,
                     "volumes": [{"name": "logs", "emptyDir": {}},
                                 {"name": "config", "configMap": {"name": "airflow-config"}},
                                 {"name": "shared-fs", "persistentVolumeClaim": {"claimName": "fsx-llm-pipeline"}}]}}


def test_the_image_home_is_where_the_chart_mounts_airflow_cfg(stack):
    env = podman("image", "inspect", "--format", "{{json .Config.Env}}", stack["image"]).stdout
    assert f"AIRFLOW_HOME={TF['airflow_home']}" in json.loads(env)
    assert "airflowHome = local.airflow_home" in (METADATA / "main.tf").read_text()


def test_jobs_and_init_container_run_against_postgres_as_the_chart_runs_them(stack, jobs):
    """migrate job → wait-for-airflow-migrations → our create-user job, each exit 0; the database then holds the
    schema and the admin."""
    for job, r in jobs.items():
        assert r.returncode == 0, (job, (r.stdout + r.stderr)[-3000:])
    pg = stack["pg"]
    assert pg.psql("SELECT username FROM ab_user", db="airflow") == "admin"
    assert int(pg.psql("SELECT count(*) FROM alembic_version", db="airflow")) == 1


def _probe_passes(boxes: Containers, name: str, argv: list[str]):
    return boxes.alive(name, lambda: boxes.exec(name, argv).returncode == 0)


def test_components_start_with_the_charts_args_and_pass_their_probes(stack, components):
    """scheduler (KubernetesExecutor, in-cluster), dag-processor, triggerer and api-server: each container started
    with the chart's args through the image's entrypoint; each exec probe run inside it as the kubelet does passes
    within the bound; the api-server's HTTP probe answers 200; the log groomer sidecar keeps running."""
    boxes, pod, names = stack["boxes"], stack["pod"], components
    groomer = CHART["sidecars"]["log-groomer"]
    sidecar = boxes.start(*pod, *[x for k, v in groomer["env"].items() for x in ("-e", f"{k}={v}")],
                          args=groomer["args"])
    url = f"http://127.0.0.1:{stack['api_port']}{CHART['components']['api-server']['http_probes']['path']}"
    deadline = time.monotonic() + PROBE_BOUND_S
    for component, spec in CHART["components"].items():
        for probe, argv in spec.get("probes", {}).items():
            left = max(1.0, deadline - time.monotonic())
            try:
                wait_for(lambda: _probe_passes(boxes, names[component], argv), left, f"{component}'s {probe} probe",
                         every=5)
            except AssertionError:
                pytest.fail(f"{component}'s {probe} probe never passed; its log:\n{boxes.logs(names[component])}")

    def healthy():
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status == 200
        except OSError:
            return None
    wait_for(healthy, max(1.0, deadline - time.monotonic()), "the api-server's HTTP probe", every=3)
    running = podman("inspect", "--format", "{{.State.Running}}", sidecar).stdout.strip()
    assert running == "true", boxes.logs(sidecar)
    for component, name in names.items():
        assert podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip() == "true", \
            f"{component} exited: {boxes.logs(name)}"


def test_the_kubernetes_executor_makes_a_worker_pod_for_a_task_of_llm_pipeline(stack, components):
    """A run of llm_pipeline, triggered through the image's CLI: the scheduler's KubernetesExecutor (the provider's
    own code, merging the chart's pod template) creates the first task's pod in the API: the image, the worker
    service account, FSx mounted, the task's command (the Task SDK's execute_workload) in container ``base``."""
    boxes, pod, api = stack["boxes"], stack["pod"], stack["api"]
    for args in (["airflow", "dags", "unpause", "llm_pipeline"],
                 ["airflow", "dags", "trigger", "llm_pipeline", "-c", json.dumps({"spec": "configs/demo.yaml"})]):
        wait_for(lambda: (lambda r: r if r.returncode == 0 else None)(boxes.run(*pod, args=args)), 300,
                     f"`{' '.join(args[:3])}` (the dag-processor serialises the DAG first)", every=10)
    try:
        made = wait_for(lambda: api.pods, PROBE_BOUND_S, "the executor to create a worker pod", every=2)
    except AssertionError:
        pytest.fail("no worker pod; the scheduler's log:\n" + boxes.logs(components["scheduler"]))
    spec = made[0]["spec"]
    assert spec["serviceAccountName"] == WORKER_SA
    base = next(c for c in spec["containers"] if c["name"] == "base")
    assert base["image"] == "localhost/llm-pipeline:latest"
    argv = (base.get("command") or []) + (base.get("args") or [])
    assert "airflow.sdk.execution_time.execute_workload" in argv, argv
    assert {"mountPath": "/fsx", "name": "shared-fs"} in base["volumeMounts"]
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "fsx-llm-pipeline" for v in spec["volumes"])


def test_the_entrypoints_database_wait_bounds_each_try_and_every_airflow_word_is_airflows(tmp_path):
    """Run on this host with a stand-in `airflow` (no image needed): a metadata database that accepts and never
    answers held `airflow db check`, and so the pod's start, for ever (each try had no bound): each try now ends
    after CONNECTION_CHECK_TIMEOUT s and the wait exits 75 after its tries. And the words at the ends of the Airflow
    word list's lines (`partitions`, `kerberos`) were not recognised, so a program of that name on PATH ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "airflow").write_text('#!/bin/sh\n[ "$1 $2" = "db check" ] && exec sleep 600\necho "airflow $*"\n')
    (bin_dir / "partitions").write_text("#!/bin/sh\necho not-airflow\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CONNECTION_CHECK_MAX_COUNT": "2",
           "CONNECTION_CHECK_SLEEP_TIME": "0", "CONNECTION_CHECK_TIMEOUT": "1"}
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "infra/image/entrypoint"), "airflow", "version"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 75 and "did not answer after 2 tries" in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    env["CONNECTION_CHECK_MAX_COUNT"] = "0"
    for word in ("partitions", "kerberos", "celery", "assets"):
        r = subprocess.run(["bash", str(ROOT / "infra/image/entrypoint"), word, "list"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == f"airflow {word} list", (word, r.stdout, r.stderr)
