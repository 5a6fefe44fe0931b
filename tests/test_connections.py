"""Every task finds the services through one lookup (plugins/llm_connections.py): with the Airflow connections
``mlflow_default`` and ``aws_default`` set, setup_services opens the MLflow run on the connection's server and starts
no embedded S3, teardown closes that run and stops nothing, the extra links and the stages use the same addresses;
no environment variable a task sets outlives it (``airflow dags test`` and LocalExecutor run tasks in one process)."""
from __future__ import annotations

import ast
import base64
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from conftest import ROOT

CONN_VARS = ("AIRFLOW_CONN_MLFLOW_DEFAULT", "AIRFLOW_CONN_AWS_DEFAULT", "AIRFLOW_CONN_KUBERNETES_DEFAULT",
             "AIRFLOW_CONN_SPARK_PIPELINE")
SECRET_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "S3_ENDPOINT_URL", "S3_REGION", "MLFLOW_TRACKING_URI",
               "MLFLOW_UI_URL", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "SPARK_MASTER")
S3_URL = "http://127.0.0.1:9"  # never contacted: no test here moves an object


class FakeMlflow:
    """The MLflow tracking server's REST calls that opening, reading and closing a run make, in memory; each request
    recorded as (method, path, basic-auth user, body)."""

    def __init__(self):
        self.requests: list[tuple[str, str, str, dict]] = []
        self.experiments: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, method: str, path: str, query: dict, body: dict) -> tuple[int, dict]:
        api = path.removeprefix("/api/2.0/mlflow/")
        if api == "experiments/get-by-name":
            exp = next((e for e in self.experiments.values() if e["name"] == query["experiment_name"][0]), None)
            return (200, {"experiment": exp}) if exp else (404, {"error_code": "RESOURCE_DOES_NOT_EXIST"})
        if api == "experiments/create":
            eid = str(len(self.experiments) + 7)
            self.experiments[eid] = {"experiment_id": eid, "name": body["name"], "lifecycle_stage": "active",
                                     "artifact_location": body["artifact_location"]}
            return 200, {"experiment_id": eid}
        if api == "runs/create":
            rid = f"run{len(self.runs) + 1}"
            base = self.experiments[body["experiment_id"]]["artifact_location"]
            self.runs[rid] = {"info": {"run_id": rid, "run_uuid": rid, "experiment_id": body["experiment_id"],
                                       "status": "RUNNING", "lifecycle_stage": "active",
                                       "artifact_uri": f"{base}/{rid}/artifacts"},
                              "data": {"tags": body.get("tags", [])}}
            return 200, {"run": self.runs[rid]}
        if api == "runs/get" and query.get("run_id", [""])[0] in self.runs:
            return 200, {"run": self.runs[query["run_id"][0]]}
        if api == "runs/update":
            self.runs[body["run_id"]]["info"]["status"] = body["status"]
            return 200, {"run_info": self.runs[body["run_id"]]["info"]}
        return 404, {"error_code": "ENDPOINT_NOT_FOUND", "message": f"{method} {path} is not faked"}

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self):
                u = urlsplit(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                auth = self.headers.get("Authorization", "")
                user = base64.b64decode(auth[6:]).decode() if auth.startswith("Basic ") else ""
                fake.requests.append((self.command, u.path, user, body))
                code, out = fake.answer(self.command, u.path, parse_qs(u.query), body)
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = _serve

            def log_message(self, *args):
                pass

        return Handler

    def calls(self, api: str) -> list[tuple[str, str, str, dict]]:
        return [r for r in self.requests if r[1] == "/api/2.0/mlflow/" + api]


@pytest.fixture
def mlflow_server():
    fake = FakeMlflow()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


@pytest.fixture
def clean_env(monkeypatch):
    """No connection and none of the variables the connections set, whatever the developer's shell holds."""
    for var in CONN_VARS + SECRET_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def connections(clean_env, mlflow_server):
    """mlflow_default at the fake server (with a login) and aws_default at another S3 endpoint, as env variables
    (any backend reads the same: the lookup is Airflow's own)."""
    host, port = mlflow_server.url.removeprefix("http://").split(":")
    clean_env.setenv("AIRFLOW_CONN_MLFLOW_DEFAULT", json.dumps({"conn_type": "http", "host": host, "port": int(port),
                                                                "login": "pipeline", "password": "mlflow-pass"}))
    clean_env.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps({
        "conn_type": "aws", "login": "AKIAEXAMPLE", "password": "s3cr3t-key",
        "extra": {"endpoint_url": S3_URL, "region_name": "eu-west-1"}}))
    return mlflow_server


@pytest.fixture
def spec_file(home):
    """The laptop spec (SQLite MLflow, no S3 endpoint: the embedded one), local[2] Spark."""
    p = home / "spec.yaml"
    p.write_text(yaml.safe_dump({"run": {"name": "conn-test"}, "services": {"spark_master": "local[2]"}}))
    return p


@pytest.fixture
def no_embedded_s3(monkeypatch):
    """Starting or stopping the embedded S3 endpoint fails the test (and starts nothing)."""
    from pipelines.storage import s3

    def refuse(*a, **k):
        raise AssertionError("the embedded S3 endpoint was started or stopped")

    monkeypatch.setattr(s3, "start", refuse)
    monkeypatch.setattr(s3, "stop", refuse)
    monkeypatch.setattr(s3, "release", refuse)


def test_setup_and_teardown_use_the_connections_not_the_spec(home, connections, spec_file, no_embedded_s3,
                                                           monkeypatch):
    from llm_dags import close_services, open_services

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "the-worker's-own")  # a user's value: back after the task
    info = open_services(str(spec_file), "llm_pipeline", "manual__1")
    assert info["embedded_s3"] is None and not (home / "var" / "s3" / "endpoint.json").exists()
    (method, _, user, body), = connections.calls("runs/create")
    assert user == "pipeline:mlflow-pass" and info["mlflow_run_id"] == "run1"
    assert {"key": "airflow.dag_id", "value": "llm_pipeline"} in body["tags"]
    assert not (home / "var" / "mlflow.db").exists()  # the spec's SQLite store was not touched
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "the-worker's-own"
    assert not any(v in os.environ for v in ("MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY", "S3_ENDPOINT_URL"))

    close_services(str(spec_file), info)
    (_, _, user, body), = connections.calls("runs/update")
    assert user == "pipeline:mlflow-pass" and body["run_id"] == "run1" and body["status"] == "FINISHED"
    assert connections.runs["run1"]["info"]["status"] == "FINISHED"


def test_without_connections_setup_starts_the_embedded_s3_and_teardown_releases_it(home, clean_env, spec_file,
                                                                                    monkeypatch):
    """The laptop path is unchanged: no connection, no endpoint in the spec, the embedded S3 is leased and released."""
    from llm_dags import close_services, open_services
    from pipelines.storage import s3

    calls = []
    monkeypatch.setattr(s3, "acquire", lambda owner: calls.append(("acquire", owner)) or "http://127.0.0.1:1")
    monkeypatch.setattr(s3, "release", lambda owner: calls.append(("release", owner)) or True)
    monkeypatch.setattr("pipelines.tracking.start_run", lambda spec, **k: spec.services.mlflow_tracking_uri)
    info = open_services(str(spec_file), "llm_pipeline", "manual__2")
    assert info["mlflow_run_id"] == "sqlite:///var/mlflow.db" and info["embedded_s3"] == "http://127.0.0.1:1"
    close_services(str(spec_file), {**info, "mlflow_run_id": None})
    assert calls == [("acquire", "llm_pipeline/manual__2"), ("release", "llm_pipeline/manual__2")]


def test_a_failed_setup_releases_the_endpoint_it_leased(home, clean_env, spec_file, monkeypatch):
    from llm_dags import open_services
    from pipelines.storage import s3

    calls = []
    monkeypatch.setattr(s3, "acquire", lambda owner: calls.append("acquire") or "http://127.0.0.1:1")
    monkeypatch.setattr(s3, "release", lambda owner: calls.append("release") or True)

    def down(spec, **k):
        raise ConnectionError("MLflow is down")

    monkeypatch.setattr("pipelines.tracking.start_run", down)
    with pytest.raises(ConnectionError):
        open_services(str(spec_file), "llm_pipeline", "manual__3")
    assert calls == ["acquire", "release"]


class FakeTI:
    def __init__(self):
        self.pushed: dict[str, object] = {}

    def xcom_push(self, key, value):
        self.pushed[key] = value


def _links(spec_file: Path, run_id: str, manifest: dict, tmp_path: Path) -> dict:
    from llm_operators import StageOperator, push_links

    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    op = StageOperator(task_id="register", module="pipelines.eval.register", spec=str(spec_file),
                       overrides=[f"run.mlflow_run_id={run_id}", "train.steps=None"])
    ti = FakeTI()
    push_links(op, {"ti": ti}, str(path))
    return ti.pushed["links"]


def test_the_extra_links_use_the_connections(home, connections, spec_file, no_embedded_s3, tmp_path, clean_env):
    from llm_dags import open_services

    run_id = open_services(str(spec_file), "llm_pipeline", "manual__1")["mlflow_run_id"]
    exp = connections.runs[run_id]["info"]["experiment_id"]
    manifest = {"extra": {"model_name": "m", "version": 3, "l2_uri": "s3://bkt/checkpoints/r/step-000300",
                          "checkpoint": "r/step-000300"}}
    links = _links(spec_file, run_id, manifest, tmp_path)
    assert links == {"mlflow_run": f"{connections.url}/#/experiments/{exp}/runs/{run_id}",
                     "model_version": f"{connections.url}/#/models/m/versions/3",
                     "checkpoint": f"{S3_URL}/bkt?prefix=checkpoints/r/step-000300/"}
    assert connections.calls("runs/get")[-1][2] == "pipeline:mlflow-pass"
    # a UI served elsewhere than the tracking API (an ingress): the connection's extra ui_url
    conn = json.loads(os.environ["AIRFLOW_CONN_MLFLOW_DEFAULT"])
    clean_env.setenv("AIRFLOW_CONN_MLFLOW_DEFAULT", json.dumps({**conn, "extra": {"ui_url": "https://mlflow.example"}}))
    links = _links(spec_file, run_id, manifest, tmp_path)
    assert links["mlflow_run"] == f"https://mlflow.example/#/experiments/{exp}/runs/{run_id}"
    assert not any(v in os.environ for v in ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_UI_URL", "S3_ENDPOINT_URL"))
    # no ui_url: the worker's own MLFLOW_UI_URL wins over the guess from the tracking address
    clean_env.setenv("AIRFLOW_CONN_MLFLOW_DEFAULT", json.dumps(conn))
    clean_env.setenv("MLFLOW_UI_URL", "https://ui.worker.example")
    links = _links(spec_file, run_id, manifest, tmp_path)
    assert links["mlflow_run"] == f"https://ui.worker.example/#/experiments/{exp}/runs/{run_id}"


def test_a_stage_gets_the_same_services_in_its_environment_only(home, connections, spec_file, no_embedded_s3):
    """The stage's subprocess sees the addresses setup_services used; the task's own environment is left alone."""
    from llm_operators import StageOperator

    (home / "envdump.py").write_text(
        "import json, os, sys\n"
        "report = sys.argv[sys.argv.index('--report') + 1]\n"
        "keys = ('MLFLOW_TRACKING_URI', 'MLFLOW_TRACKING_PASSWORD', 'S3_ENDPOINT_URL', 'AWS_SECRET_ACCESS_KEY')\n"
        "json.dump({'manifest': json.dumps({k: os.environ.get(k) for k in keys})}, open(report, 'w'))\n")
    before = dict(os.environ)
    op = StageOperator(task_id="ingest", module="envdump", spec=str(spec_file), deferrable=False)
    seen = json.loads(op.execute({}))
    assert seen == {"MLFLOW_TRACKING_URI": connections.url, "MLFLOW_TRACKING_PASSWORD": "mlflow-pass",
                    "S3_ENDPOINT_URL": S3_URL, "AWS_SECRET_ACCESS_KEY": "s3cr3t-key"}
    assert dict(os.environ) == before


def _spark_op(spec_file: Path, monkeypatch, fail: bool) -> tuple:
    """A SparkStageOperator whose spark-submit is replaced by a probe of what it would get: the master the provider's
    hook resolves and this process's environment while it runs."""
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
    from llm_operators import SparkStageOperator

    seen = {}

    def submit(self, context):
        self._hook = self._get_hook()
        seen.update(master=self._hook._connection["master"], deploy_mode=self._hook._connection["deploy_mode"],
                    conn=os.environ.get("AIRFLOW_CONN_SPARK_PIPELINE"),
                    secret=os.environ.get("AWS_SECRET_ACCESS_KEY"))
        if fail:
            raise RuntimeError("spark-submit failed")
        report = self.application_args[self.application_args.index("--report") + 1]
        Path(report).write_text(json.dumps({"manifest": "/done/manifest.json"}))

    monkeypatch.setattr(SparkSubmitOperator, "execute", submit)
    monkeypatch.setattr(SparkStageOperator, "_without_spark", lambda self, r: {"stage": "dedup", "needs": "spark"})
    return SparkStageOperator(task_id="dedup", module="pipelines.data.dedup", spec=str(spec_file)), seen


@pytest.mark.parametrize("fail", [False, True], ids=["succeeds", "raises"])
def test_a_spark_task_leaves_no_connection_behind(home, connections, spec_file, monkeypatch, fail):
    """No spark_pipeline connection: the spec's master is exposed under that id for the submit only, then the
    variable is absent again, also when the submit raises (a later task of this process must not take it as a
    user's connection); the connections' secrets likewise."""
    op, seen = _spark_op(spec_file, monkeypatch, fail)
    if fail:
        with pytest.raises(RuntimeError, match="spark-submit failed"):
            op.execute({})
    else:
        assert op.execute({}) == "/done/manifest.json"
    assert seen["master"] == "local[2]" and json.loads(seen["conn"])["host"] == "local[2]"
    assert seen["secret"] == "s3cr3t-key"
    assert "AIRFLOW_CONN_SPARK_PIPELINE" not in os.environ and "AWS_SECRET_ACCESS_KEY" not in os.environ


@pytest.mark.parametrize("fail", [False, True], ids=["succeeds", "raises"])
def test_a_users_spark_connection_is_the_master_and_stays_as_it_was(home, connections, spec_file, monkeypatch,
                                                                     fail):
    user = json.dumps({"conn_type": "spark", "host": "local[1]", "extra": {"deploy-mode": "client"}})
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_PIPELINE", user)
    op, seen = _spark_op(spec_file, monkeypatch, fail)
    if fail:
        with pytest.raises(RuntimeError):
            op.execute({})
    else:
        op.execute({})
    assert seen["master"] == "local[1]" and seen["deploy_mode"] == "client"  # the user's whole connection
    assert seen["conn"] == user and op.env_vars["SPARK_MASTER"] == "local[1]"
    assert os.environ["AIRFLOW_CONN_SPARK_PIPELINE"] == user and "SPARK_MASTER" not in os.environ


def test_a_spark_stage_that_rejects_its_input_fails_the_task_at_once(home, clean_env, spec_file, no_embedded_s3,
                                                                   monkeypatch):
    """A real spark-submit (client mode: the driver runs here, and spark-submit exits with the stage's status) of a
    stage that rejects its input (exit 2): the task fails with AirflowFailException (no retries) naming the stage,
    as a StageOperator's does; it was the provider's retryable AirflowException ("Error code is: 2"), retried
    twice with backoff. (The run without Spark is taken as having asked for Spark: the next test has it reject.)"""
    from airflow.sdk.exceptions import AirflowFailException
    from llm_operators import SparkStageOperator

    monkeypatch.setattr(SparkStageOperator, "_without_spark", lambda self, r: {"stage": "dedup", "needs": "spark"})
    op = SparkStageOperator(task_id="dedup", module="pipelines.data.dedup", spec=str(spec_file),
                            stage_args=["--ingest-manifest", str(home / "no-such/manifest.json")])
    with pytest.raises(AirflowFailException, match=r"pipelines\.data\.dedup rejected its input \(exit 2\)") as e:
        op.execute({})
    assert "Error code is: 2" in str(e.value)


def test_a_spark_stage_runs_without_spark_first_and_is_submitted_only_where_it_needs_it(home, clean_env, spec_file,
                                                                                        no_embedded_s3, monkeypatch):
    """The run without Spark (``--no-spark``) comes first: an input it rejects fails the task at once with no
    spark-submit; a stage whose input needs Spark leaves nothing and is submitted, the same command without
    ``--no-spark`` (what it does without Spark: tests/test_incremental.py)."""
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
    from airflow.sdk.exceptions import AirflowFailException
    from llm_operators import SparkStageOperator

    submitted = []

    def submit(self, context):
        submitted.append(list(self.application_args))
        raise RuntimeError("spark-submit is not wanted here")

    monkeypatch.setattr(SparkSubmitOperator, "execute", submit)
    op = SparkStageOperator(task_id="dedup", module="pipelines.data.dedup", spec=str(spec_file),
                            stage_args=["--ingest-manifest", str(home / "no-such/manifest.json")])
    with pytest.raises(AirflowFailException, match=r"pipelines\.data\.dedup rejected its input \(exit 2\)") as e:
        op.execute({})
    assert "Error code" not in str(e.value) and submitted == []

    (home / "in.jsonl").write_text("")  # one input: listed, not read without Spark
    sets = [f"data.inputs=[{home / 'in.jsonl'}]"]
    op = SparkStageOperator(task_id="ingest", module="pipelines.data.ingest", spec=str(spec_file), overrides=sets)
    with pytest.raises(RuntimeError, match="not wanted"):
        op.execute({})
    assert submitted[0][:2] == ["pipelines.data.ingest", "--spec"] and "--no-spark" not in submitted[0]
    runs = home / "var/runs/ingest"  # its key's lock, nothing committed, no staging left
    assert runs.is_dir() and [p.name for p in runs.iterdir() if not p.name.endswith(".lock")] == []

    op = SparkStageOperator(task_id="ingest", module="pipelines.data.ingest", spec=str(spec_file), overrides=sets,
                            stage_args=["--no-spark"])
    with pytest.raises(AirflowFailException, match="--no-spark is the operator's own first run"):
        op.execute({})
    assert len(submitted) == 1

    # the run without Spark is given the task's env_vars (what its environment holds: the next test), less what the
    # operator sets over them for spark-submit
    from llm_operators import OPERATOR_ENV
    seen = {}

    def probe(op, module, args, env, says):
        seen.update(env)
        return {"stage": "ingest", "needs": "spark"}
    monkeypatch.setattr("llm_operators._run_cli", probe)
    op = SparkStageOperator(task_id="ingest", module="pipelines.data.ingest", spec=str(spec_file), overrides=sets,
                            env_vars={"LLMP_TASK_SETTING": "3", "LLMP_HOME": "/elsewhere"})
    with pytest.raises(RuntimeError, match="not wanted"):
        op.execute({})
    assert seen["LLMP_TASK_SETTING"] == "3" and "LLMP_HOME" not in seen and len(submitted) == 2
    assert set(OPERATOR_ENV) <= set(op.env_vars) and op.env_vars["LLMP_HOME"] != "/elsewhere"


def test_the_run_without_spark_has_the_environment_the_driver_inherits():
    """The driver runs in the task's process: it inherits the connections' environment and, where the provider puts
    them on spark-submit's process (a local or YARN master), the task's env_vars over it, but never the task's
    values of what the operator sets itself; on Kubernetes the provider gives env_vars to a driver pod's conf only."""
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowFailException
    from llm_operators import OPERATOR_ENV, SparkStageOperator

    def resolved(master):
        return SimpleNamespace(env={"AWS_DEFAULT_REGION": "from-the-connection", "AWS_ACCESS_KEY_ID": "conn"},
                               spec=SimpleNamespace(services=SimpleNamespace(spark_master=master)))
    task = {"AWS_DEFAULT_REGION": "eu-west-1", "LLMP_HOME": "/elsewhere", "PATH": "/nothing", "X": "1"}
    op = SparkStageOperator(task_id="t", module="pipelines.data.ingest", env_vars=task)
    assert op._probe_env(resolved("local[1]")) == {"AWS_DEFAULT_REGION": "eu-west-1", "AWS_ACCESS_KEY_ID": "conn",
                                                   "X": "1"}
    assert op._probe_env(resolved("k8s://https://kube:443")) == resolved("").env
    assert {"LLMP_HOME", "PATH"} <= set(OPERATOR_ENV)
    op = SparkStageOperator(task_id="t", module="pipelines.data.ingest", env_vars={"N": 3})
    with pytest.raises(AirflowFailException, match=r"env_vars\['N'\] is a int, not a string"):
        op._probe_env(resolved("local[1]"))


def test_scoped_env_puts_back_values_and_absence_on_error(clean_env):
    from llm_connections import scoped_env

    clean_env.setenv("S3_REGION", "users-own")
    with pytest.raises(KeyError):
        with scoped_env({"S3_REGION": "eu-west-1", "S3_ENDPOINT_URL": S3_URL}):
            assert os.environ["S3_REGION"] == "eu-west-1" and os.environ["S3_ENDPOINT_URL"] == S3_URL
            raise KeyError("in the block")
    assert os.environ["S3_REGION"] == "users-own" and "S3_ENDPOINT_URL" not in os.environ


def _environ_writes(tree) -> list[str]:
    """Names of the functions of a module that write os.environ (item assignment or deletion, update, setdefault,
    pop, putenv); "<module>" for a write outside any function."""
    def writes(node) -> bool:
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            return any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ" for t in targets)
        return isinstance(node, ast.Call) and ast.unparse(node.func) in (
            "os.environ.update", "os.environ.setdefault", "os.environ.pop", "os.putenv", "os.environ.clear")

    out = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        out += [fn.name for n in ast.walk(fn) if writes(n)]
    top = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return out + ["<module>" for t in top for n in ast.walk(t) if writes(n)]


def test_the_plugins_write_the_process_environment_only_through_scoped_env():
    """Every write to os.environ in plugins/ is llm_connections.scoped_env's, which puts it back on exit."""
    found = {p.name: _environ_writes(ast.parse(p.read_text())) for p in sorted((ROOT / "plugins").glob("*.py"))}
    assert {k: set(v) for k, v in found.items() if v} == {"llm_connections.py": {"scoped_env"}}
