"""Operations and security: timeouts and kills stop the whole process group; inputs built from data stay under
their roots; --output never replaces a user's folder; credentials stay out of artifacts, tags and logs; stop
commands signal only their own processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import ROOT, c4_docs, serving, write_jsonl

SLEEPY = '''
import json, os, subprocess, sys, time
# a child that starts a grandchild, then both sleep: what torchrun and its ranks look like to the operator (torchrun
# starts each rank in a session of its own: a signal to the stage's group does not reach it)
child = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
    "start_new_session=True); "
    "open(sys.argv[1], 'w').write(str(g.pid)); time.sleep(600)", os.environ["PIDS"] + ".grandchild"])
open(os.environ["PIDS"], "w").write(json.dumps({"stage": os.getpid(), "child": child.pid}))
time.sleep(600)
'''


def _pids(path: Path, timeout: float = 60) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        g = Path(str(path) + ".grandchild")
        if path.is_file() and g.is_file() and g.read_text():
            return [*json.loads(path.read_text()).values(), int(g.read_text())]
        time.sleep(0.1)
    raise AssertionError("the stage did not start its children")


def _alive(pid: int) -> bool:
    from pipelines.procs import _stat

    st = _stat(pid)
    return st is not None and st[2] != "Z"


@pytest.fixture
def sleepy(home, monkeypatch):
    (home / "sleepy_stage.py").write_text(SLEEPY)
    monkeypatch.setenv("PIDS", str(home / "pids.json"))
    from llm_operators import StageOperator

    return StageOperator(task_id="sleepy", module="sleepy_stage", execution_timeout=timedelta(seconds=2),
                         kill_grace_s=3.0)


def test_a_stage_past_its_execution_timeout_fails_within_the_grace_period_and_leaves_no_process(sleepy, home):
    """As Airflow's task runner runs a task: execute under its timeout, on_kill when it fires."""
    from airflow.sdk.exceptions import AirflowTaskTimeout
    from airflow.sdk.execution_time import task_runner

    t0 = time.monotonic()
    with pytest.raises(AirflowTaskTimeout):
        task_runner._run_execute_callable(context={}, execute=sleepy.execute, task=sleepy)
    took = time.monotonic() - t0
    pids = _pids(home / "pids.json", timeout=1)
    assert took < 15, took
    assert not [p for p in pids if _alive(p)], "a process of the stage's group survived"


def test_on_kill_stops_the_stage_child_and_grandchild(sleepy, home):
    from pipelines.procs import group_members

    sleepy.execution_timeout = None
    err: list[BaseException] = []

    def run():
        try:
            sleepy.execute(context={})
        except BaseException as e:  # noqa: BLE001
            err.append(e)

    th = threading.Thread(target=run)
    th.start()
    pids = _pids(home / "pids.json")
    t0 = time.monotonic()
    sleepy.on_kill()
    th.join(15)
    assert not th.is_alive() and err and "exited with -15" in str(err[0]), err
    assert time.monotonic() - t0 < 15
    assert not [p for p in pids if _alive(p)] and not group_members(pids[0])


def test_hostile_s3_keys_are_refused_and_nothing_is_written_outside_the_cache(home, any_key_s3):
    import boto3

    s3_server = any_key_s3  # AWS stores such keys: our endpoint refuses them, so they come from a server that does not
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    s3.create_bucket(Bucket="hostile")  # moto's store is process-wide: a bucket no other test writes to
    body = "".join(json.dumps({"text": d["text"]}) + "\n" for d in c4_docs(20)).encode()
    hostile = ("crawl/a/../../x.jsonl", "a/../../x.jsonl", "/abs.jsonl", "crawl/../../../../../../tmp/y.jsonl")
    for key in ("crawl/good.jsonl", *hostile):
        s3.put_object(Bucket="hostile", Key=key, Body=body)
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="hostile")["Contents"]}
    assert set(hostile) <= keys  # the store keeps them as they are
    before = {p for p in Path("/tmp").glob("y.jsonl")} | {p for p in home.rglob("*")}
    for n, prefix in enumerate(("s3://hostile/crawl/", "s3://hostile/")):  # hostile keys under the prefix, at the root
        out = home / f"ingested-{n}"
        r = subprocess.run([sys.executable, "-m", "pipelines.data.ingest", "--input", prefix, "--output",
                            str(out), "--set", "services.spark_master=local[1]", "--set",
                            f"services.s3_endpoint_url={s3_server}", "--set", "data.ingest.s3_read=copy"],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "LLMP_HOME": str(home)})
        assert r.returncode == 0, r.stderr[-3000:]
        m = json.loads((out / "manifest.json").read_text())
        refused = {x["uri"] for x in m["extra"]["refused_inputs"]}
        assert m["counts"]["docs"] == 20 and m["counts"]["refused_inputs"] == len(refused)
        assert "refused s3://hostile/crawl/a/../../x.jsonl" in r.stdout and "s3://hostile/crawl/a/../../x.jsonl" in refused
    assert refused == {f"s3://hostile/{k}" for k in hostile}
    new = [p for p in {p for p in Path("/tmp").glob("y.jsonl")} | {p for p in home.rglob("*")} - before if p.is_file()]
    assert not [p for p in new if p.name in ("x.jsonl", "abs.jsonl", "y.jsonl")], new
    assert sorted(p.name for p in (home / "var" / "runs" / "cache" / "s3").rglob("*.jsonl")) == ["good.jsonl"]


def test_a_forged_manifest_output_path_is_refused(home):
    from pipelines.manifest import StageDir, StageError, load_manifest

    sd = StageDir(home / "runs", "filter", "k", [{"uri": "x", "sha256": "0"}])
    with sd:
        (sd.tmp / "kept").mkdir()
        m = sd.commit({"kept": "kept"})
    data = json.loads(Path(m.path).read_text())
    for forged in ("../../../etc", "/etc/passwd", "kept/../../x"):
        data["outputs"][0]["path"] = forged
        Path(m.path).write_text(json.dumps(data))
        with pytest.raises(StageError, match="do not stay below its directory"):
            load_manifest(m.path)
    # a corpus version's shards are read, linked and copied by their prefix: one that leaves the directory is refused
    data["outputs"][0]["path"] = "kept"
    for forged in ("../../../home/u/data", "/etc/x", "shards/../../y", None):
        data["extra"] = {"shards": [{"prefix": "shards/train-00000-0000", "split": "train"},
                                    {"prefix": forged, "split": "train"}]}
        Path(m.path).write_text(json.dumps(data))
        with pytest.raises(StageError, match="do not stay below its directory"):
            load_manifest(m.path)
    data["extra"] = {"shards": [{"prefix": "shards/train-00000-0000", "split": "train"}]}
    Path(m.path).write_text(json.dumps(data))
    assert load_manifest(m.path).extra["shards"][0]["prefix"] == "shards/train-00000-0000"


def test_output_on_a_folder_of_the_user_exits_2_and_touches_nothing(home):
    user = home / "my-notes"
    user.mkdir()
    (user / "thesis.txt").write_text("four years of work")
    src = write_jsonl(home / "in.jsonl", [{"text": d["text"]} for d in c4_docs(5)])
    r = subprocess.run([sys.executable, "-m", "pipelines.data.ingest", "--input", str(src), "--output", str(user),
                        "--set", "services.spark_master=local[1]"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"--output {user} holds files that are not a stage result" in r.stderr
    assert sorted(p.name for p in user.iterdir()) == ["thesis.txt"]
    assert (user / "thesis.txt").read_text() == "four years of work"
    assert not list(home.glob(".my-notes*"))  # no staging or lock file beside it either


def test_a_tracking_uri_with_credentials_reaches_no_artifact_tag_manifest_or_log(models_for_ops, home):
    """MLflow behind a URL with a password (a plain `mlflow server` here, which ignores it): the spec artifact, the
    run's tags and params, the version's tags, the registration and the printed lines never carry the password."""
    from pipelines import tracking
    from pipelines.eval import registry
    from pipelines.spec import load_spec

    store, log = home / "mlflow-server", home / "mlflow-server.log"

    def start(port: int) -> subprocess.Popen:
        return subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                                 "--port", str(port), "--backend-store-uri", f"sqlite:///{store}.db",
                                 "--artifacts-destination", str(store / "artifacts"), "--workers", "1"],
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    srv, port = serving(start, log.read_text)
    try:
        uri = f"http://user:s3cretPW@127.0.0.1:{port}"
        spec = load_spec(None, [f"services.mlflow_tracking_uri={uri}", "registry.model_name=secret-test",
                                f"eval.reference={json.dumps([str(ROOT / 'data/reference/tinystories_val_tail.txt')])}"],
                         env={})
        run_id = tracking.start_run(spec, run_name="t")
        ev = {"reference_sha256": "r" * 64, "reference": {"files": {"a.txt": {}}}, "tasks": [], "limit": 5}
        res = registry.register(spec, models_for_ops, run_id, {"data_manifest_hash": "d" * 64},
                                {"reference_bpb": 3.0}, ev, home / "w")
        assert res["tracking_uri"] == f"http://user:***@127.0.0.1:{port}"
        c = tracking.client(spec)
        run = c.get_run(run_id)
        version = c.get_model_version("secret-test", str(res["version"]))
        texts = [json.dumps(res), json.dumps(run.data.tags), json.dumps(run.data.params), json.dumps(version.tags),
                 spec.to_yaml()]
        files = [p for p in home.rglob("*") if p.is_file()]  # the artifacts, the server's database, the work dirs
        assert any(p.name == "spec.yaml" for p in files) and any(p.name == "MLmodel" for p in files)
        texts += [p.read_bytes().decode(errors="replace") for p in files]
        summary = subprocess.run([sys.executable, "-m", "pipelines.summary", "--set",
                                  f"services.mlflow_tracking_uri={uri}", "--set", "registry.model_name=secret-test"],
                                 capture_output=True, text=True, timeout=300)
        assert summary.returncode == 0, summary.stderr[-2000:]
        texts += [summary.stdout, summary.stderr]
        leaks = [t[:200] for t in texts if "s3cretPW" in t]
        assert not leaks, leaks
        assert "s3cretPW" in spec.to_yaml(secrets=True)  # the work file of the ranks still has what they need
    finally:
        os.killpg(srv.pid, 15)
        srv.wait(30)


@pytest.fixture
def models_for_ops(tmp_path):
    from pipelines.data import tokenize
    from pipelines.spec import TokenizerCfg
    from test_eval import _model_dir

    sp = tokenize.train_sentencepiece([tokenize.canonical_text(d["text"]) for d in c4_docs(200)], tmp_path / "sp",
                                      TokenizerCfg(vocab_size=400), seed=1)
    return _model_dir(tmp_path / "m", 1, sp)


def test_the_password_file_must_be_private_and_stop_signals_only_its_own_processes(tmp_path, monkeypatch):
    from pipelines import airflow_ui, procs

    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    p = airflow_ui.password_file()
    assert p.stat().st_mode & 0o777 == 0o600
    p.chmod(0o644)
    with pytest.raises(airflow_ui.PasswordFileError, match="mode 0600"):
        airflow_ui.password_file()
    p.chmod(0o600)
    # a pid file whose pid now belongs to another process (same pid, other start time): not signalled
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        forged = {**procs.identity(other.pid), "start": procs.start_time(other.pid) - 1}
        airflow_ui.pid_file().write_text(json.dumps({"scheduler": forged}))
        assert airflow_ui.running_components() == {} and airflow_ui.stop() == 0
        time.sleep(0.3)
        assert other.poll() is None  # untouched
        airflow_ui.pid_file().write_text(json.dumps({"scheduler": procs.identity(other.pid)}))
        assert airflow_ui.stop() == 1
        assert other.wait(15) is not None
    finally:
        if other.poll() is None:
            other.kill()


def test_the_ui_start_refuses_what_it_cannot_use_in_one_line_and_trusts_only_its_own_server(tmp_path, monkeypatch,
                                                                                             capsys):
    """An empty or torn password file (a crash between its create and its write) was accepted, and Airflow then
    generated a password and printed it to its log; a foreign server on the port passed for our api-server; a bad
    AIRFLOW_UI_PORT was a traceback even for `stop`; a stack that died ended `make airflow` with 0."""
    import http.server

    from pipelines import airflow_ui

    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    p = airflow_ui.password_file()
    assert json.loads(p.read_text())["admin"] and not list(tmp_path.glob(".passwords.json.*"))
    for torn in ("", '{"admin": ', "[1]", '{"admin": ""}'):
        p.write_text(torn)
        with pytest.raises(airflow_ui.PasswordFileError, match="delete it to get a new one"):
            airflow_ui.password_file()
    p.unlink()

    class Foreign(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"metadatabase": {"status": "healthy"}, "scheduler": {"status": "healthy"}}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert airflow_ui.health(port)["scheduler"]["status"] == "healthy"  # anyone's answer
        assert airflow_ui.health(port, os.getpid()) != {}  # this process serves it
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert airflow_ui.health(port, child.pid) == {}  # not that process's server: not ours
        finally:
            child.kill()
            child.wait()
        assert airflow_ui.main(["start", "--port", str(port)]) == 2
        assert f"port {port} is taken by another process" in capsys.readouterr().err
    finally:
        srv.shutdown()
        srv.server_close()
    monkeypatch.setenv("AIRFLOW_UI_PORT", "abc")
    assert airflow_ui.main(["start"]) == 2 and "AIRFLOW_UI_PORT='abc' is not a port" in capsys.readouterr().err
    assert airflow_ui.main(["stop"]) == 0  # stop never reads it
    for bad in ("0", "70000"):
        with pytest.raises(SystemExit) as e:
            airflow_ui.main(["start", "--port", bad])
        assert e.value.code == 2


def test_the_stack_executor_adopts_only_a_live_task_process_and_counts_it_against_parallelism():
    """A killed scheduler's running task is adopted only when its process started before the task did (a process
    that started later holds a reused pid); an adopted task holds a slot until its process ends."""
    import datetime
    from types import SimpleNamespace

    from airflow.utils.net import get_hostname
    from airflow.utils.state import TaskInstanceState

    from pipelines.airflow_executor import StackExecutor

    task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        now = datetime.datetime.now(datetime.timezone.utc)

        def ti(key, started):
            return SimpleNamespace(key=key, state=TaskInstanceState.RUNNING, pid=task.pid, hostname=get_hostname(),
                                   start_date=started)

        ex = StackExecutor(parallelism=2)
        ours, reused = ti("ours", now), ti("reused", now - datetime.timedelta(minutes=10))  # began 10 min before
        assert ex.try_adopt_task_instances([ours, reused]) == [reused]
        assert ex.running == {"ours"} and ex.slots_available == 1
        ex.release_adopted()
        assert ex.running == {"ours"}  # still running: the slot stays taken
        import pipelines.airflow_executor as ae
        import pipelines.procs as procs

        stepped = procs.started_at(task.pid) + 90  # the wall clock stepped (NTP): boot time, so each start, moves
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ae, "started_at", lambda pid: stepped)
            mp.setattr(procs, "started_at", lambda pid: stepped)
            ex.release_adopted()
        assert ex.running == {"ours"}  # the same process still: its start ticks say so, whatever the clock does
        task.kill()
        task.wait(15)
        ex.release_adopted()
        assert ex.running == set() and ex.adopted == {} and ex.slots_available == 2
    finally:
        if task.poll() is None:
            task.kill()


def test_the_summary_hints_name_this_pythons_commands_in_a_checkout_and_in_the_image(tmp_path, monkeypatch):
    """`python -m pipelines.summary`'s commands point at the interpreter's own bin: the checkout's .venv under
    make demo, the image's own directory where there is no .venv."""
    from pipelines import summary

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    assert summary.bin_dir() == "$PWD/.venv/bin"
    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python3")
    assert summary.bin_dir() == "/opt/venv/bin"


BOUNDED_EXIT = r"""
import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pipelines import procs

procs.EXIT_GRACE_S = 1.0
stuck = threading.Event()


def main():
    ThreadPoolExecutor(1).submit(stuck.wait)  # a worker stuck in I/O: the interpreter's shutdown joins it
    print("worked", flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("gloo timed out")
    return int(sys.argv[1])


procs.main_bounded(main, at_once=(75,))
"""


@pytest.mark.parametrize("how, code", [("0", 0), ("2", 2), ("75", 75), ("raise", 1)])
def test_a_process_whose_thread_hangs_at_its_end_still_exits_with_its_status(how, code):
    """A rank (and the scorer, the export) ended through the interpreter's shutdown, which joins every executor
    worker: one stuck in a read on a stalled disk (a hashing worker, an upload given up on) kept a rank that had
    finished (0), stopped for the user (2) or raised alive for ever, and its task waited for its timeout (days).
    Now every end waits at most ``procs.EXIT_GRACE_S`` and keeps its status; 75 leaves at once."""
    r = subprocess.run([sys.executable, "-c", BOUNDED_EXIT, how], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == code and r.stdout == "worked\n", (r.returncode, r.stdout, r.stderr[-2000:])
    if how != "75":
        assert f"still runs 1 s after its work ended: leaving without it (exit {code})" in r.stderr
    if how == "raise":
        assert "RuntimeError: gloo timed out" in r.stderr  # the traceback, as Python prints it
