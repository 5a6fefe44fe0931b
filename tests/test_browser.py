"""The Airflow product as a user meets it: `make airflow`'s launcher (api-server, scheduler, dag-processor,
triggerer on 127.0.0.1, LocalExecutor), the Asset chain data_curation → training → evaluation run by the real
scheduler, then headless Chromium (Debian's, driven by Playwright): log in, find the DAGs, fill llm_pipeline's
trigger form, wait for the run to succeed, follow an extra link to MLflow; screenshots of the grid and graph views
land in var/test-artifacts/browser/."""
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, c4_docs, free_port, log_server_ports, tiny_spec

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = ROOT / "var" / "test-artifacts" / "browser"
class Api:
    def __init__(self, port: int, password: str):
        self.base = f"http://127.0.0.1:{port}"
        self.token = self.call("/auth/token", {"username": "admin", "password": password})["access_token"]

    def call(self, path: str, data=None, method=None, raw=False):
        req = urllib.request.Request(self.base + path, data=json.dumps(data).encode() if data is not None else None,
                                     method=method, headers={"Content-Type": "application/json", **(
                                         {"Authorization": f"Bearer {self.token}"} if hasattr(self, "token") else {})})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return body.decode() if raw else json.loads(body)

    def runs(self, dag_id: str) -> list[dict]:
        return self.call(f"/api/v2/dags/{dag_id}/dagRuns?order_by=-run_after")["dag_runs"]

    def wait_run(self, dag_id: str, run_id: str | None = None, timeout: float = 900, run_type: str | None = None,
                 states: tuple[str, ...] = ("success", "failed")):
        deadline = time.time() + timeout
        while time.time() < deadline:
            runs = [r for r in self.runs(dag_id) if (run_id is None or r["dag_run_id"] == run_id)
                    and (run_type is None or r["run_type"] == run_type)]
            if runs and runs[0]["state"] in states:
                return runs[0]
            time.sleep(3)
        raise AssertionError(f"{dag_id} run {run_id or run_type} did not finish in {timeout} s: {self.runs(dag_id)}")

    def log(self, dag_id: str, run_id: str, task_id: str) -> str:
        quoted = urllib.request.quote(run_id, safe="")
        return self.call(f"/api/v2/dags/{dag_id}/dagRuns/{quoted}/taskInstances/{task_id}/logs/1?full_content=true",
                         raw=True)


def _browser_available() -> str | None:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed (make test installs it from requirements.lock)"
    if not Path(CHROMIUM).exists():
        return "no chromium binary (make test installs Debian's chromium with apt when it may: root or sudo -n)"
    return None


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A project home with a tiny spec, MLflow's UI, and Airflow started as `make airflow` starts it."""
    if (why := _browser_available()) is not None:
        pytest.skip(why)
    home = tmp_path_factory.mktemp("browser")
    (home / "data" / "sample").mkdir(parents=True)
    with gzip.open(home / "data" / "sample" / "c4_300.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d["text"]}) + "\n" for d in c4_docs(300))  # read whole: held by the corpus
    (home / "configs").mkdir()
    mlflow_port = free_port()
    (home / "configs" / "tiny.yaml").write_text(tiny_spec(
        "data/sample/c4_300.jsonl.gz", name="browser", model_name="browser-model",
        more=f"  schedule: '@once'\n"  # data_curation runs once, when unpaused
             f"services: {{mlflow_ui_url: 'http://127.0.0.1:{mlflow_port}'}}\n"))
    (home / "var").mkdir()
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "LLMP_HOME": str(home), "LLMP_SPEC": "configs/tiny.yaml", "AIRFLOW_HOME": str(home / "airflow"),
           "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"), "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
           "AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL": "5", **log_server_ports(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    mlflow = subprocess.Popen([str(bin_dir / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{home}/var/mlflow.db",
                               "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"],
                              env={**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, cwd=home,
                              stdout=open(home / "mlflow.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    subprocess.run([str(bin_dir / "airflow"), "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    ui = [sys.executable, "-m", "pipelines.airflow_ui"]
    for _ in range(2):  # a port found free before the migration can be taken by then (the other test worker): once more
        port = free_port()
        r = subprocess.run([*ui, "start", "--detach", "--port", str(port)], env=env, capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
        api_log = home / "airflow" / "ui-logs" / "api-server.log"
        taken = api_log.exists() and f"('127.0.0.1', {port}): address already in use" in api_log.read_text(errors="replace")
        if r.returncode == 0 or not taken:
            break
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        password = json.loads((home / "airflow" / "passwords.json").read_text())["admin"]
        api = Api(port, password)
        deadline = time.time() + 180
        while time.time() < deadline and len(api.call("/api/v2/dags")["dags"]) < 4:
            time.sleep(2)
        yield {"home": home, "port": port, "password": password, "api": api, "mlflow_port": mlflow_port}
    finally:
        subprocess.run([*ui, "stop"], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
        os.killpg(mlflow.pid, 15)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for log in (home / "airflow" / "ui-logs").glob("*.log"):
            shutil.copy(log, ARTIFACTS / log.name)


def test_scheduled_curation_emits_the_asset_event_and_training_then_evaluation_run_from_it(stack):
    api = stack["api"]
    for dag_id in ("training", "evaluation"):
        api.call(f"/api/v2/dags/{dag_id}", {"is_paused": False}, method="PATCH")
    api.call("/api/v2/dags/data_curation", {"is_paused": False}, method="PATCH")  # its schedule (from the spec) fires
    cur = api.wait_run("data_curation", run_type="scheduled")
    assert cur["state"] == "success", cur
    # Airflow 3.3.2 answers GET /assets/events with 500 while a run that an event created is still queued (its
    # start_date is NULL; apache/airflow#71360, fixed on main by #71379, not released): read the events once the
    # training run that this event created has started.
    api.wait_run("training", run_type="asset_triggered", timeout=300, states=("running", "success", "failed"))
    events = api.call("/api/v2/assets/events?order_by=-timestamp")["asset_events"]
    ev = next(e for e in events if e["name"] == "curated_shards")
    assert ev["source_dag_id"] == "data_curation" and ev["source_task_id"] == "publish"
    extra = ev["extra"]
    assert extra["stage"] == "tokenize" and Path(extra["manifest"]).is_file() and len(extra["digest"]) == 64
    assert set(extra["lineage"]) == {"ingest", "dedup", "filter", "decontaminate", "tokenize"}
    stack["curated"] = extra

    tr = api.wait_run("training", run_type="asset_triggered")  # the scheduler made this run from the event
    assert tr["state"] == "success", tr
    log = api.log("training", tr["dag_run_id"], "upstream_assets")
    assert extra["manifest"] in log
    ev_run = api.wait_run("evaluation", run_type="asset_triggered")
    assert ev_run["state"] == "success", ev_run
    # the first version takes the alias: evaluation emits `champion` (what a deploy DAG would be scheduled on)
    events = api.call("/api/v2/assets/events?order_by=-timestamp")["asset_events"]
    champ = next(e for e in events if e["name"] == "champion")
    assert champ["source_dag_id"] == "evaluation" and champ["extra"]["stage"] == "register"


def test_a_curation_run_with_nothing_new_emits_no_event_and_training_does_not_run_again(stack):
    """The scheduled run above made corpus version 1; a second data_curation run finds no input it does not hold:
    the stages end on the same version, publish is skipped, no curated_shards event, no new training run."""
    api = stack["api"]
    assert "curated" in stack, "runs after the scheduled curation test"
    before = [e for e in api.call("/api/v2/assets/events?order_by=-timestamp")["asset_events"]
              if e["name"] == "curated_shards"]
    trainings = len(api.runs("training"))
    run = api.call("/api/v2/dags/data_curation/dagRuns", {"logical_date": None}, method="POST")
    done = api.wait_run("data_curation", run["dag_run_id"])
    assert done["state"] == "success", done
    quoted = urllib.request.quote(run["dag_run_id"], safe="")
    tis = {t["task_id"]: t["state"] for t in
           api.call(f"/api/v2/dags/data_curation/dagRuns/{quoted}/taskInstances")["task_instances"]}
    assert tis["publish"] == "skipped" and tis["tokenize"] == "success", tis
    assert stack["curated"]["manifest"] in api.log("data_curation", run["dag_run_id"], "previous_corpus")
    assert "1 of 1 inputs are in corpus version 1 already; reading 0" in api.log("data_curation", run["dag_run_id"],
                                                                             "ingest")
    for task in ("ingest", "tokenize"):  # nothing to read: done by the run without Spark, no spark-submit
        log = api.log("data_curation", run["dag_run_id"], task)
        assert "--no-spark" in log and "spark-submit to master" not in log, (task, log[-3000:])
    time.sleep(10)  # a training run would be queued by now
    after = [e for e in api.call("/api/v2/assets/events?order_by=-timestamp")["asset_events"]
             if e["name"] == "curated_shards"]
    assert len(after) == len(before) and len(api.runs("training")) == trainings


def _login(page, stack):
    page.goto(f"http://127.0.0.1:{stack['port']}/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", stack["password"])
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(re.compile(r".*:%d/(?!auth).*" % stack["port"]))


def _trigger_from_the_form(page, stack) -> str:
    page.goto(f"http://127.0.0.1:{stack['port']}/dags/llm_pipeline")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    for section in ("Run", "Data", "Training", "Model", "Evaluation"):  # the form's sections
        assert dialog.get_by_role("button", name=section).is_visible()
    dialog.get_by_role("button", name="Run").click()
    dialog.locator("#element_spec").fill("configs/tiny.yaml")  # one of the proposals from configs/
    page.keyboard.press("Enter")
    dialog.get_by_role("button", name="Training").click()
    dialog.locator("input[name=element_steps]").fill("16")
    page.screenshot(path=str(ARTIFACTS / "trigger_form.png"))
    dialog.get_by_role("button", name="Trigger").last.click()
    page.wait_for_url(re.compile(r".*/dags/llm_pipeline/runs/.+"), timeout=30000)
    return urllib.request.unquote(page.url.rsplit("/runs/", 1)[1].split("/")[0].split("?")[0])


def test_a_user_triggers_llm_pipeline_from_the_form_and_follows_a_link_to_mlflow(stack):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    api = stack["api"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        _login(page, stack)
        page.goto(f"http://127.0.0.1:{stack['port']}/dags")
        for dag_id in ("data_curation", "training", "evaluation", "llm_pipeline"):
            page.get_by_text(dag_id, exact=True).first.wait_for(timeout=30000)
        page.screenshot(path=str(ARTIFACTS / "dags.png"))
        run_id = _trigger_from_the_form(page, stack)
        run = api.wait_run("llm_pipeline", run_id)
        assert run["state"] == "success", run
        assert run["conf"]["steps"] == 16 and run["conf"]["spec"] == "configs/tiny.yaml"
        if "curated" in stack:  # the same inputs as the curation run: its data stages were reused
            for task in ("ingest", "dedup", "filter", "decontaminate", "tokenize"):
                assert "up to date" in api.log("llm_pipeline", run_id, task), task

        run_url = f"http://127.0.0.1:{stack['port']}/dags/llm_pipeline/runs/{urllib.request.quote(run_id, safe='')}"
        page.goto(run_url)
        page.get_by_text("register", exact=True).first.wait_for()
        page.screenshot(path=str(ARTIFACTS / "grid.png"), full_page=True)
        page.get_by_role("button", name=re.compile("Show Graph")).first.click()
        page.wait_for_timeout(2000)
        page.screenshot(path=str(ARTIFACTS / "graph.png"), full_page=True)

        links = api.call(f"/api/v2/dags/llm_pipeline/dagRuns/{urllib.request.quote(run_id, safe='')}"
                         f"/taskInstances/register/links")["extra_links"]
        expected = links["Registered model version"]
        assert expected == f"http://127.0.0.1:{stack['mlflow_port']}/#/models/browser-model/versions/1"
        page.goto(f"{run_url}/tasks/register/details")  # the task's "Extra Links" buttons
        link = page.get_by_role("link", name="Registered model version")
        assert link.get_attribute("href") == expected
        if link.get_attribute("target") == "_blank":
            with page.context.expect_page() as opened:
                link.click()
            mlflow_page = opened.value
        else:
            link.click()
            mlflow_page = page
        mlflow_page.wait_for_load_state()
        assert mlflow_page.url == expected
        mlflow_page.get_by_text("browser-model").first.wait_for(timeout=30000)  # MLflow rendered the version
        mlflow_page.screenshot(path=str(ARTIFACTS / "mlflow_model_version.png"))
        browser.close()
