"""``make airflow``: Airflow's UI and its components on 127.0.0.1, with the project's DAGs and plugins.

    python -m pipelines.airflow_ui start [--port 8080] [--detach]    # make airflow
    python -m pipelines.airflow_ui stop                               # make airflow-stop

A supervisor starts ``api-server`` (bound to 127.0.0.1 only) and, once it answers, ``scheduler``, ``dag-processor``
and ``triggerer`` with ``AIRFLOW_HOME`` (``var/airflow``), the DAGs folder and the plugins folder that the Makefile
exports; their logs go to ``var/airflow/ui-logs/``. Each component runs in a process group of its own. A component
that dies is restarted alone (the others, and the tasks they run, keep running): what is left of its group (a
scheduler's log server and idle LocalExecutor workers) is stopped first, and a scheduler, dag-processor or triggerer
starts again only once the api-server answers. A dead scheduler's worker that still supervises a task runs on until
the task ends, and the new scheduler adopts the task (``pipelines.airflow_executor``): no try is spent. A task
rides out an api-server restart (its heartbeats may fail for 2 minutes). More than 5 restarts of one component in 10 minutes stop the stack
with a line in ``ui-logs/supervisor.log``. LocalExecutor runs ``AIRFLOW__CORE__PARALLELISM`` tasks at once, by
default as many as the machine has cores. The login is user ``admin`` with a password generated once into
``var/airflow/passwords.json`` (mode 0600): Airflow's SimpleAuthManager then has nothing to generate, so the
password appears in no log; this command shows it on the terminal. In the foreground, Ctrl-C stops every
component; ``stop`` (from another terminal, or after ``--detach``) stops the supervisor, every component's group
and any process left of this stack (``LLMP_AIRFLOW_STACK`` in its environment: orphans of a component killed
earlier, and the tasks they ran).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

from pipelines.exit_codes import RETRY, USER_ERROR
from pipelines.procs import (boot_id, cmdline, descendants, identity, in_sessions, kill_all, listens_on, still_running,
                            stop_group, stop_group_but, stop_unless, usable_cores, with_env)

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
STACK_ENV = "LLMP_AIRFLOW_STACK"
EXECUTOR = "pipelines.airflow_executor.StackExecutor"
WORKER_TITLE = "airflow worker -- LocalExecutor"  # the title a LocalExecutor worker gives itself
USER = "admin"
HOST = "127.0.0.1"

# SIGTERM to a component's group (a scheduler, its workers and the tasks they run), SIGKILL after this: a train
# task's ranks checkpoint on the notice (llm_dags.TRAIN_KILL_GRACE_S, 35 s by default)
# (tests/test_dag.py holds it at least 5 s above the train task's kill grace)
STOP_GRACE_S = 40.0


def home() -> Path:
    return Path(os.environ.get("AIRFLOW_HOME", "var/airflow")).resolve()


class PasswordFileError(Exception):
    """The UI's password file cannot be used as it is: the user fixes or deletes it (exit 2)."""


def password_file() -> Path:
    """{"admin": "<password>"}, created once with mode 0600, whole (written aside, then linked into place: a crash
    leaves no empty file, which Airflow would fill with a password it prints to its log); an existing file readable
    by others, not ours, or not such a record is refused until it is fixed."""
    p = home() / "passwords.json"
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({USER: secrets.token_urlsafe(12)}, f)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, p)  # never over a file another start wrote meanwhile
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    st = p.stat()
    if st.st_mode & 0o077 or st.st_uid != os.getuid():
        raise PasswordFileError(f"{p} has mode {oct(st.st_mode & 0o777)} and owner uid {st.st_uid}: it holds the UI "
                                f"login, so it must be yours with mode 0600 (chmod 600 {p}, or delete it to get a new "
                                "one)")
    try:
        pw = json.loads(p.read_text(encoding="utf-8")).get(USER)
    except (ValueError, AttributeError):
        pw = None
    if not isinstance(pw, str) or not pw:
        raise PasswordFileError(f"{p} is not {{\"{USER}\": \"<password>\"}}: delete it to get a new one")
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
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/",
            STACK_ENV: str(home()),  # every process of the stack inherits it: `stop` finds orphans by it
            # LocalExecutor, whose running tasks a restarted scheduler adopts (pipelines.airflow_executor)
            "AIRFLOW__CORE__EXECUTOR": EXECUTOR,
            # a task's heartbeats may fail for 2 min (an api-server restarting) before its worker gives it up; the
            # scheduler declares it dead after 5 min without one
            "AIRFLOW__WORKERS__MAX_FAILED_HEARTBEATS": "24",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "300",
            # LocalExecutor's worker processes: as many as the cores, not Airflow's default 32
            "AIRFLOW__CORE__PARALLELISM": os.environ.get("AIRFLOW__CORE__PARALLELISM",
                                                         str(max(2, usable_cores())))}


def busy_worker(pid: int) -> bool:
    """Is ``pid`` a LocalExecutor worker that is running a task, or still reporting one's end (its title says
    ``<idle>`` only once the result is posted)?"""
    title = " ".join(cmdline(pid))
    return title.startswith(WORKER_TITLE) and (not title.rstrip().endswith("<idle>") or bool(descendants(pid)))


def sessions_file() -> Path:
    return home() / "ui.sessions.json"


def sessions() -> list[dict]:
    """Every component process started since the last stop (each began a session of its own)."""
    try:
        return json.loads(sessions_file().read_text())
    except (OSError, ValueError):
        return []


def record_session(ident: dict) -> None:
    tmp = sessions_file().with_suffix(".tmp")
    tmp.write_text(json.dumps(sessions() + [{**ident, "boot": boot_id()}]))
    os.replace(tmp, sessions_file())


def pid_file() -> Path:
    return home() / "ui.pids.json"


class Supervisor:
    """Starts the components, restarts one that dies (alone), stops them all on SIGTERM/SIGINT."""

    MAX_RESTARTS, WINDOW_S = 5, 600.0

    def __init__(self, port: int):
        self.port, self.env = port, component_env(port)
        self.logs = home() / "ui-logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}  # the components running now
        self.ids: dict[str, dict] = {"supervisor": identity(os.getpid())}  # as recorded when each started
        self.pending: set[str] = set()  # died; restarted once the api-server answers
        self.busy_orphans: list[dict] = []  # a dead scheduler's workers that still supervise a task
        self.restarts: dict[str, list[float]] = {c: [] for c in COMPONENTS}
        self.stopping = False

    def log(self, msg: str) -> None:
        with open(self.logs / "supervisor.log", "a") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {msg}\n")

    def launch(self, c: str) -> None:
        if self.stopping:
            return
        airflow = str(Path(sys.executable).parent / "airflow")
        cmd = [airflow, c] + (["--host", HOST, "--port", str(self.port)] if c == "api-server" else [])
        with open(self.logs / f"{c}.log", "ab") as out:
            self.procs[c] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        self.ids[c] = identity(self.procs[c].pid)
        record_session(self.ids[c])
        self.pending.discard(c)
        atomic = pid_file().with_suffix(".tmp")
        atomic.write_text(json.dumps(self.ids))
        os.replace(atomic, pid_file())

    def start(self) -> None:
        # the sessions of an earlier stack: what is left of them goes first (an unclean end: no `stop` ran)
        kill_all(sorted(in_sessions(sessions())), 10.0)
        sessions_file().unlink(missing_ok=True)
        self.launch("api-server")
        api = self.procs["api-server"]
        if not wait_answering(self.port, 270.0, lambda: self.stopping or api.poll() is not None, api.pid):
            if api.poll() is not None:  # e.g. its port taken: said at once, not after the whole wait
                raise RuntimeError(f"the api-server exited ({api.returncode}) before answering on port {self.port}; "
                                   f"see {self.logs / 'api-server.log'}")
            if not self.stopping:
                raise RuntimeError("the api-server did not answer within 270 s")
            return
        for c in COMPONENTS[1:]:
            self.launch(c)

    def reap(self) -> Optional[str]:
        """Components that exited: what is left of their group stopped (a scheduler's log server and idle
        workers; a worker that still supervises a task is kept until the task ends, and the new scheduler adopts the
        task: :mod:`pipelines.airflow_executor`), marked pending; why to give up, if so."""
        for c, p in list(self.procs.items()):
            if p.poll() is None:
                continue
            del self.procs[c]
            now = time.monotonic()
            self.restarts[c] = [t for t in self.restarts[c] if now - t < self.WINDOW_S] + [now]
            if len(self.restarts[c]) > self.MAX_RESTARTS:
                stop_group(p.pid, 10.0)  # what is left of its group (its log server, its workers): stop_all never sees it
                return f"{c} exited {self.MAX_RESTARTS + 1} times in {self.WINDOW_S:.0f} s; stopping the stack"
            self.log(f"{c} exited ({p.returncode}); stopping what is left of its group and starting it again")
            # the group outlives its leader; its pgid is not reused while it has members
            kept = stop_group_but(p.pid, busy_worker, 10.0)
            if kept:
                self.log(f"kept {len(kept)} worker(s) of the dead {c} that still run a task, until it ends")
            self.busy_orphans += kept
            self.pending.add(c)
        return None

    def watch(self) -> int:
        """Until stopped: restart any component that exited (the api-server at once, the others once it answers);
        returns the supervisor's exit code."""
        while not self.stopping:
            self.busy_orphans = stop_unless(self.busy_orphans, busy_worker)
            why = self.reap()
            if why is not None:
                self.log(why)
                return RETRY
            if "api-server" in self.pending:
                self.launch("api-server")
            api = self.procs.get("api-server")
            if self.pending and api is not None and wait_answering(self.port, 1.0, lambda: self.stopping, api.pid):
                for c in [c for c in COMPONENTS if c in self.pending]:
                    self.launch(c)
            time.sleep(1)
        return 0

    def stop_all(self) -> None:
        self.stopping = True
        kill_all([i["pid"] for i in self.busy_orphans if still_running(i)], 15.0)
        for c in reversed(COMPONENTS):
            p = self.procs.get(c)
            if p is not None and p.poll() is None:  # a train stage under it gets its preemption checkpoint's time
                stop_group(p.pid, STOP_GRACE_S, reap=p.pid)


def supervise(port: int) -> int:
    """The supervisor's own process (``start`` runs it in the background)."""
    sup = Supervisor(port)

    def on_signal(signum, _frame):
        sup.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        sup.start()
        code = sup.watch()
    except RuntimeError as e:
        sup.log(str(e))
        code = RETRY
    finally:
        sup.stop_all()
        pid_file().unlink(missing_ok=True)
    return code


def health(port: int, pid: Optional[int] = None) -> dict:
    """The api-server's health answer: {} when it does not answer, when the answer is not a health record, or, with
    ``pid``, when the server on the port is not that process's (another stack's server took the port)."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/api/v2/monitor/health", timeout=5) as r:
            got = json.loads(r.read())
    except (OSError, ValueError):
        return {}
    if pid is not None and not listens_on(pid, port):
        return {}
    return {k: v for k, v in got.items() if isinstance(v, dict)} if isinstance(got, dict) else {}


def wait_for(port: int, parts: tuple[str, ...], timeout: float, go_on=lambda: True, pid: Optional[int] = None) -> bool:
    """Until ``parts`` of the health answer (of ``pid``'s server, when given) are healthy (True), ``timeout`` passes
    or ``go_on`` says stop (False)."""
    deadline = time.time() + timeout
    while go_on():
        h = health(port, pid)
        if all(h.get(k, {}).get("status") == "healthy" for k in parts):
            return True
        if time.time() >= deadline:
            return False
        time.sleep(min(1.0, max(0.0, deadline - time.time())))
    return False


def wait_answering(port: int, timeout: float, give_up=lambda: False, pid: Optional[int] = None) -> bool:
    """The api-server (``pid``'s, when given) answers (whatever the scheduler's state)."""
    return wait_for(port, ("metadatabase",), timeout, lambda: not give_up(), pid)


def wait_healthy(port: int, timeout: float = 280.0, alive=lambda: True, pid: Optional[int] = None) -> bool:
    """The api-server (under ``pid``, when given) answers and the scheduler is healthy (False at once when ``alive``
    says the supervisor died)."""
    return wait_for(port, ("metadatabase", "scheduler"), timeout, alive, pid)


def port_taken(port: int) -> bool:
    """Does another process listen on ``port`` already (our api-server could not bind it)?"""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


def recorded() -> dict[str, dict]:
    return json.loads(pid_file().read_text()) if pid_file().exists() else {}


def running_components(with_supervisor: bool = False) -> dict[str, int]:
    """{component: pid} of the pid file's processes that still run and are the ones it recorded (same start time and
    command line: a pid reused by another process is not ours to signal)."""
    return {c: int(i["pid"]) for c, i in recorded().items()
            if (with_supervisor or c != "supervisor") and isinstance(i, dict) and still_running(i)}


def stop() -> int:
    """Stop the supervisor (it stops the components; SIGKILL after 30 s), then every recorded component still
    running (its group), then any process left of this stack (``LLMP_AIRFLOW_STACK`` in its environment: what a
    component killed earlier left); returns how many components were running. A pid that another process reuses is
    never signalled."""
    rec = recorded()
    running = running_components()
    sup = rec.get("supervisor")
    if isinstance(sup, dict) and still_running(sup):
        os.kill(int(sup["pid"]), signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S + 20  # its own stop of the components (a train task's grace)
        while still_running(sup) and time.monotonic() < deadline:
            time.sleep(0.2)
        if still_running(sup):
            os.kill(int(sup["pid"]), signal.SIGKILL)
    for c, pid in running_components().items():  # the recorded leaders that are still the processes recorded
        stop_group(pid, 10.0)
    # what a leader killed earlier left (its workers, its log server, the tasks they ran): by environment, and by
    # session for the processes whose title rewrite wiped their environment (LocalExecutor workers, tasks)
    left = set(with_env(STACK_ENV, str(home()))) | set(in_sessions(sessions()))
    if left:
        kill_all(sorted(left), 10.0)
    pid_file().unlink(missing_ok=True)
    sessions_file().unlink(missing_ok=True)
    return len(running)


def port_number(text: str) -> int:
    """A TCP port, 1-65535 (argparse's type: anything else is its one-line usage error, exit 2)."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.airflow_ui", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="Start the UI and the components; Ctrl-C stops them.")
    s.add_argument("--port", type=port_number, default=None, help="default: $AIRFLOW_UI_PORT, else 8080")
    s.add_argument("--detach", action="store_true", help="Return once healthy; stop with `make airflow-stop`.")
    sub.add_parser("stop", help="Stop what `start` started.")
    sv = sub.add_parser("supervise", help="(internal) the supervisor that `start` runs in the background.")
    sv.add_argument("--port", type=port_number, default=8080)
    args = ap.parse_args(argv)
    if args.cmd == "stop":
        print(f"airflow: stopped {stop()} component(s)")
        return 0
    if args.cmd == "supervise":
        return supervise(args.port)
    if running_components(with_supervisor=True):
        print(f"airflow: Airflow is already running (pids in {pid_file()}); `make airflow-stop` first", file=sys.stderr)
        return USER_ERROR
    if args.port is None:
        given = os.environ.get("AIRFLOW_UI_PORT", "8080")
        try:
            args.port = port_number(given)
        except argparse.ArgumentTypeError:
            print(f"airflow: AIRFLOW_UI_PORT={given!r} is not a port number", file=sys.stderr)
            return USER_ERROR
    if port_taken(args.port):
        print(f"airflow: port {args.port} is taken by another process (another Airflow?): give AIRFLOW_UI_PORT or "
              "--port another one", file=sys.stderr)
        return USER_ERROR
    try:
        password_file()
    except PasswordFileError as e:
        print(f"airflow: {e}", file=sys.stderr)
        return USER_ERROR
    (home() / "ui-logs").mkdir(parents=True, exist_ok=True)
    try:
        with open(home() / "ui-logs" / "supervisor.log", "ab") as out:
            sup = subprocess.Popen([sys.executable, "-m", "pipelines.airflow_ui", "supervise", "--port", str(args.port)],
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if not wait_healthy(args.port, alive=lambda: sup.poll() is None, pid=sup.pid):
            stop()
            print(f"airflow: not healthy in time; see {home() / 'ui-logs'}", file=sys.stderr)
            return RETRY
        pw = json.loads(password_file().read_text())[USER]
        print(f"Airflow UI: http://{HOST}:{args.port}  (user: {USER}, password: {pw}; kept in {password_file()})")
        print(f"components: {', '.join(COMPONENTS)} (a component that dies is restarted alone); logs in "
              f"{home() / 'ui-logs'}; stop with "
              + ("`make airflow-stop`" if args.detach else "Ctrl-C (or `make airflow-stop`)"), flush=True)
        if args.detach:
            return 0
        code = sup.wait()
        print(f"airflow: the supervisor stopped ({code}; see ui-logs/supervisor.log)", file=sys.stderr)
    except KeyboardInterrupt:  # the user's stop
        code = 0
    stop()
    return RETRY if code else 0


if __name__ == "__main__":
    sys.exit(main())
