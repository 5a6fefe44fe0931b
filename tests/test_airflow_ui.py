"""`make airflow`'s launcher on a fresh AIRFLOW_HOME: the real api-server, scheduler, dag-processor and triggerer,
bound to 127.0.0.1, a login whose password is in no log, the project's DAGs listed, a scheduler killed with -9
restarted alone, and a stop that leaves no process of the stack."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, free_port

pytestmark = pytest.mark.e2e


def _get(url, token=None, data=None):
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=20) as r:
        return json.loads(r.read())


def _stack_processes(home: Path) -> list[int]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("LLMP_AIRFLOW_STACK") == str(home):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def test_make_airflow_serves_the_ui_on_loopback_with_a_private_password_and_stops(tmp_path):
    home = tmp_path / "airflow"
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
           "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__EXECUTOR": "LocalExecutor", "LLMP_HOME": str(tmp_path),
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
        deadline, dags = time.time() + 120, set()
        while time.time() < deadline and "llm_pipeline" not in dags:  # the dag-processor parses the folder
            dags = {d["dag_id"] for d in _get(f"http://127.0.0.1:{port}/api/v2/dags", token)["dags"]}
            time.sleep(2)
        assert "llm_pipeline" in dags
        with pytest.raises(urllib.error.HTTPError):
            _get(f"http://127.0.0.1:{port}/auth/token", data={"username": "admin", "password": "wrong"})
        logs = "".join(p.read_text(errors="replace") for p in (home / "ui-logs").glob("*.log"))
        assert password not in logs

        # kill -9 the scheduler: restarted alone (the api-server keeps its pid), its orphans stopped first
        before = json.loads((home / "ui.pids.json").read_text())
        os.kill(before["scheduler"]["pid"], signal.SIGKILL)
        deadline, now = time.time() + 180, before
        while time.time() < deadline and now["scheduler"]["pid"] == before["scheduler"]["pid"]:
            time.sleep(1)
            now = json.loads((home / "ui.pids.json").read_text())
        assert now["scheduler"]["pid"] != before["scheduler"]["pid"], (home / "ui-logs/supervisor.log").read_text()
        assert now["api-server"] == before["api-server"] and now["triggerer"] == before["triggerer"]
        assert "scheduler exited (-9)" in (home / "ui-logs/supervisor.log").read_text()
        deadline, health = time.time() + 180, {}
        while time.time() < deadline and health.get("scheduler", {}).get("status") != "healthy":
            time.sleep(2)
            health = _get(f"http://127.0.0.1:{port}/api/v2/monitor/health")
        assert health["scheduler"]["status"] == "healthy"
        pids = [i["pid"] for i in json.loads((home / "ui.pids.json").read_text()).values()]
    finally:
        s = subprocess.run([*ui, "stop"], env=env, capture_output=True, text=True, timeout=120)
    assert "stopped 4 component(s)" in s.stdout
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert not _stack_processes(home)  # nothing of the stack is left, the killed scheduler's workers included
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/monitor/health", timeout=3)
