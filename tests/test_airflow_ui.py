"""`make airflow`'s launcher on a fresh AIRFLOW_HOME: the real api-server, scheduler, dag-processor and triggerer,
bound to 127.0.0.1, a login whose password is in no log, the project's DAGs listed; during a DAG run each component
killed with -9 and restarted alone, the run completing without a try spent; a stop that leaves no process of the
stack."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, free_port, log_server_ports, wait_for
from pipelines.airflow_ui import wait_for as wait_healthy

pytestmark = pytest.mark.e2e


def _get(url, token=None, data=None, method=None):
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None, method=method,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=20) as r:
        return json.loads(r.read())


HOLD_DAG = "stack_faults_hold"
# a DAG run that lasts while the test kills components: its task holds until the test writes LLMP_HOME/release
_HOLD_DAG_FILE = f"""
import os, time
from pathlib import Path
from airflow.sdk import dag, task

@dag(dag_id="{HOLD_DAG}", schedule=None, catchup=False)
def hold_dag():
    @task(retries=2)
    def hold():
        home = Path(os.environ["LLMP_HOME"])
        (home / "holding").write_text(str(os.getpid()))
        deadline = time.monotonic() + 1200
        while not (home / "release").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("never released")
            time.sleep(0.5)
        return "released"

    @task
    def after(x):
        return x

    after(hold())

hold_dag()
"""


def _pids(home: Path) -> dict:
    return json.loads((home / "ui.pids.json").read_text())


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _stack_processes(home: Path) -> list[int]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("LLMP_AIRFLOW_STACK") == str(home):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def test_make_airflow_serves_the_ui_on_loopback_rides_out_each_component_killed_mid_run_and_stops(tmp_path):
    home = tmp_path / "airflow"
    dags = tmp_path / "dags"  # the project's DAGs and one that holds a run open
    dags.mkdir()
    for f in (ROOT / "dags").glob("*.py"):
        shutil.copy(f, dags / f.name)
    (dags / "stack_faults_hold.py").write_text(_HOLD_DAG_FILE)
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
           "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__EXECUTOR": "LocalExecutor", "LLMP_HOME": str(tmp_path),
           # a scheduler is dead after 10 s without a heartbeat, and its orphans are looked for every 5 s (not 300)
           "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "10",
           "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "5", **log_server_ports(),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], env=env, check=True,
                   capture_output=True, timeout=300)
    port = free_port()
    ui = [sys.executable, "-m", "pipelines.airflow_ui"]
    r = subprocess.run([*ui, "start", "--detach", "--port", str(port)], env=env, capture_output=True, text=True,
                       timeout=300)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        password = json.loads((home / "passwords.json").read_text())["admin"]
        assert f"http://127.0.0.1:{port}" in r.stdout and password in r.stdout  # shown once, on the terminal
        assert oct((home / "passwords.json").stat().st_mode & 0o777) == "0o600"
        listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
        assert listening == {"127.0.0.1"}
        token = _get(f"http://127.0.0.1:{port}/auth/token", data={"username": "admin", "password": password})["access_token"]
        deadline, listed = time.time() + 120, set()
        while time.time() < deadline and not {"llm_pipeline", HOLD_DAG} <= listed:  # the dag-processor parses
            listed = {d["dag_id"] for d in _get(f"http://127.0.0.1:{port}/api/v2/dags", token)["dags"]}
            time.sleep(2)
        assert {"llm_pipeline", HOLD_DAG} <= listed
        with pytest.raises(urllib.error.HTTPError):
            _get(f"http://127.0.0.1:{port}/auth/token", data={"username": "admin", "password": "wrong"})
        logs = "".join(p.read_text(errors="replace") for p in (home / "ui-logs").glob("*.log"))
        assert password not in logs

        # a DAG run whose task holds until released; meanwhile each component is killed with -9, one at a time
        base = f"http://127.0.0.1:{port}/api/v2/dags/{HOLD_DAG}"
        _get(base, token, method="PATCH", data={"is_paused": False})
        run_id = _get(f"{base}/dagRuns", token, data={"logical_date": None})["dag_run_id"]
        task_pid = int(wait_for(lambda: _text(tmp_path / "holding"), 300, "the task to hold", 0.5))
        for c in ("scheduler", "dag-processor", "triggerer", "api-server"):
            before = json.loads((home / "ui.pids.json").read_text())
            os.kill(before[c]["pid"], signal.SIGKILL)
            now = wait_for(lambda: _pids(home)[c]["pid"] != before[c]["pid"] and _pids(home), 240,
                           f"the {c} restarted (see {home / 'ui-logs/supervisor.log'})", 1.0)
            assert {k: v for k, v in now.items() if k != c} == {k: v for k, v in before.items() if k != c}, c
            assert f"{c} exited (-9)" in (home / "ui-logs/supervisor.log").read_text()
            assert wait_healthy(port, ("scheduler" if c == "scheduler" else "metadatabase",), 240), c
            if c == "scheduler":  # the new scheduler finds the dead one's running task and adopts it (not reset)
                wait_for(lambda: "Marked 1 SchedulerJob instances as failed" in _text(home / "ui-logs/scheduler.log"),
                         240, "the dead scheduler's task adopted", 1.0)
            assert psutil.pid_exists(task_pid), f"the task died with the {c}"
        assert "kept 1 worker(s) of the dead scheduler that still run a task" in \
            (home / "ui-logs/supervisor.log").read_text()
        token = _get(f"http://127.0.0.1:{port}/auth/token", data={"username": "admin", "password": password})["access_token"]
        (tmp_path / "release").write_text("go")
        deadline, state = time.time() + 300, None
        while time.time() < deadline and state not in ("success", "failed"):
            time.sleep(2)
            state = _get(f"{base}/dagRuns/{run_id}", token)["state"]
        tis = _get(f"{base}/dagRuns/{run_id}/taskInstances", token)["task_instances"]
        assert state == "success", tis
        assert {t["task_id"]: t["try_number"] for t in tis} == {"hold": 1, "after": 1}  # no try spent
        pids = [i["pid"] for i in json.loads((home / "ui.pids.json").read_text()).values()]
        sessions = json.loads((home / "ui.sessions.json").read_text())  # every component started, 8 in all
        assert len(sessions) == 8
    finally:
        s = subprocess.run([*ui, "stop"], env=env, capture_output=True, text=True, timeout=120)
    assert "stopped 4 component(s)" in s.stdout
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert not _stack_processes(home)  # nothing of the stack is left, the killed scheduler's workers included
    from pipelines.procs import in_sessions

    assert not in_sessions(sessions)  # nor a process whose new title wiped its environment (workers, tasks)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/monitor/health", timeout=3)
