"""``make airflow``: Airflow's UI and its components on 127.0.0.1, with the project's DAGs and plugins.

    python -m pipelines.airflow_ui start [--port 8080] [--detach]    # make airflow
    python -m pipelines.airflow_ui stop                               # make airflow-stop

Starts ``api-server`` (bound to 127.0.0.1 only), ``scheduler``, ``dag-processor`` and ``triggerer`` with
``AIRFLOW_HOME`` (``var/airflow``), the DAGs folder and the plugins folder that the Makefile exports; their
logs go to ``var/airflow/ui-logs/``. The login is user ``admin`` with a password generated once into
``var/airflow/passwords.json`` (mode 0600): Airflow's SimpleAuthManager then has nothing to generate, so the
password appears in no log; this command shows it on the terminal. In the foreground, Ctrl-C stops every
component; ``stop`` (from another terminal, or after ``--detach``) does the same from the pid file.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pipelines.procs import identity, still_running, stop_group

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
USER = "admin"
HOST = "127.0.0.1"


def home() -> Path:
    return Path(os.environ.get("AIRFLOW_HOME", "var/airflow")).resolve()


def password_file() -> Path:
    """{"admin": "<password>"}, created once with mode 0600; an existing file readable by others (or not ours) is
    refused until it is fixed."""
    p = home() / "passwords.json"
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({USER: secrets.token_urlsafe(12)}, f)
    st = p.stat()
    if st.st_mode & 0o077 or st.st_uid != os.getuid():
        raise PermissionError(f"{p} has mode {oct(st.st_mode & 0o777)} and owner uid {st.st_uid}: it holds the UI "
                              f"login, so it must be yours with mode 0600 (chmod 600 {p}, or delete it to get a new one)")
    return p


def component_env(port: int) -> dict[str, str]:
    url = f"http://{HOST}:{port}"
    return {**os.environ,
            "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(password_file()),
            "AIRFLOW__API__BASE_URL": url,
            "AIRFLOW__API__HOST": HOST,
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/"}


def pid_file() -> Path:
    return home() / "ui.pids.json"


def start(port: int) -> list[subprocess.Popen]:
    """Start the components (each in a session of its own, so ``stop`` can end its whole tree)."""
    if running_components():
        raise RuntimeError(f"Airflow is already running (pids in {pid_file()}); `make airflow-stop` first")
    logs = home() / "ui-logs"
    logs.mkdir(parents=True, exist_ok=True)
    airflow = str(Path(sys.executable).parent / "airflow")
    env = component_env(port)
    procs = {}
    for c in COMPONENTS:
        cmd = [airflow, c] + (["--host", HOST, "--port", str(port)] if c == "api-server" else [])
        out = open(logs / f"{c}.log", "ab")
        procs[c] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    pid_file().write_text(json.dumps({c: identity(p.pid) for c, p in procs.items()}))
    return list(procs.values())


def wait_healthy(port: int, timeout: float = 180.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/api/v2/monitor/health", timeout=5) as r:
                h = json.loads(r.read())
            if all(h.get(k, {}).get("status") == "healthy" for k in ("metadatabase", "scheduler")):
                return True
        except OSError:
            pass
        time.sleep(2)
    return False


def running_components() -> dict[str, int]:
    """{component: pid} of the pid file's processes that still run and are the ones it recorded (same start time and
    command line: a pid reused by another process is not ours to signal)."""
    if not pid_file().exists():
        return {}
    recorded = json.loads(pid_file().read_text())
    return {c: int(i["pid"]) for c, i in recorded.items() if isinstance(i, dict) and still_running(i)}


def stop() -> int:
    """Terminate every component's process group (SIGTERM, SIGKILL after 20 s); returns how many were running."""
    running = running_components()
    for pid in running.values():
        stop_group(pid, 20.0)
    pid_file().unlink(missing_ok=True)
    return len(running)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.airflow_ui", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="Start the UI and the components; Ctrl-C stops them.")
    s.add_argument("--port", type=int, default=int(os.environ.get("AIRFLOW_UI_PORT", 8080)))
    s.add_argument("--detach", action="store_true", help="Return once healthy; stop with `make airflow-stop`.")
    sub.add_parser("stop", help="Stop what `start` started.")
    args = ap.parse_args(argv)
    if args.cmd == "stop":
        print(f"airflow: stopped {stop()} component(s)")
        return 0
    try:
        procs = start(args.port)
    except (RuntimeError, PermissionError) as e:
        print(f"airflow: {e}", file=sys.stderr)
        return 1
    if not wait_healthy(args.port):
        stop()
        print(f"airflow: not healthy in time; see {home() / 'ui-logs'}", file=sys.stderr)
        return 1
    pw = json.loads(password_file().read_text())[USER]
    print(f"Airflow UI: http://{HOST}:{args.port}  (user: {USER}, password: {pw}; kept in {password_file()})")
    print(f"components: {', '.join(COMPONENTS)}; logs in {home() / 'ui-logs'}; stop with "
          + ("`make airflow-stop`" if args.detach else "Ctrl-C (or `make airflow-stop`)"))
    if args.detach:
        return 0
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(1)
        print("airflow: a component exited; stopping the others", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
