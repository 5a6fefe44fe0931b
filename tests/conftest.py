"""Shared fixtures. Tests run against real components: Spark local[2], torchrun/gloo, the embedded S3 endpoint's
server on 127.0.0.1, MLflow on SQLite, Airflow's `dags test`."""
from __future__ import annotations

import faulthandler
import gzip
import time
import json
import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from pipelines.procs import free_port

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
BUNDLED = ROOT / "data" / "sample"

# Airflow reads its config at import: give the test session its own home before anything imports it.
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="llmp-airflow-"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(ROOT / "dags"))
os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", str(ROOT / "plugins"))
os.environ.setdefault("LLMP_PROGRESS", "0")
# this test run's id, the same in pytest-xdist's workers (they inherit it): marks that last for one run only
os.environ.setdefault("LLMP_TEST_RUN", uuid.uuid4().hex)
logging.getLogger("py4j").setLevel(logging.WARNING)  # no "closing down" chatter at interpreter exit
# Hermetic: a developer's shell pointing at real services must not leak into the tests.
for _var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_UI_URL", "S3_ENDPOINT_URL", "S3_BUCKET", "S3_REGION",
             "SPARK_MASTER", "LLMP_HOME"):
    os.environ.pop(_var, None)
if str(ROOT / "plugins") not in sys.path:
    sys.path.insert(0, str(ROOT / "plugins"))


def shared_file(rel: str) -> Path:
    """A file of ../shared/data, or skip with the reason (a user's clone has no shared/)."""
    p = SHARED / rel
    if not p.exists():
        pytest.skip(f"needs ../shared/data/{rel}, which is absent beside this checkout")
    return p


def c4_docs(n: int | None = None) -> list[dict]:
    """C4 sample docs: from ../shared/data when present, else the identical copy bundled in data/sample."""
    p = SHARED / "corpus" / "c4_en_train_1k.jsonl"
    opener = open if p.exists() else gzip.open
    p = p if p.exists() else BUNDLED / "c4_en_train_1k.jsonl.gz"
    out = []
    with opener(p, "rt", encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line))
            if n and len(out) >= n:
                break
    return out


def write_jsonl(path: Path, records: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def shard_layout(root: Path, docs: list, cuts: list[int]) -> list[str]:
    """The same documents (token id arrays) written as uint16 shards cut before the given doc indices, as
    tokenization's partitions cut them; the shard prefixes in order."""
    from pipelines.data.shards import ShardWriter

    root.mkdir(parents=True)
    prefixes = []
    for k, (a, b) in enumerate(zip([0] + cuts, cuts + [len(docs)])):
        w = ShardWriter(root / f"train-{k:05d}-0000", "uint16")
        for d in docs[a:b]:
            w.add(d)
        w.close()
        prefixes.append(str(root / f"train-{k:05d}-0000"))
    return prefixes


def serving(start, log, path: str = "/health", tries: int = 3, up_s: float = 180) -> tuple:
    """A server started by ``start(port)`` (a Popen in a session of its own) answering ``path`` on a port its own
    process tree listens on: (its process, its port). A port that another process took between free_port() and the
    server's bind (``make test`` runs two files at once, some with servers of their own) is replaced by another, up
    to ``tries`` times (``log()``: the server's output, which must say "address already in use" for that); a server
    that does not come up within ``up_s`` is stopped and fails the test with its output."""
    import urllib.request

    from pipelines import procs

    said = ""
    for _ in range(tries):
        port = free_port()
        server = start(port)
        try:
            deadline = time.monotonic() + up_s
            while server.poll() is None:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).close()
                    if procs.listens_on(server.pid, port):
                        return server, port
                except OSError:
                    pass
                assert time.monotonic() < deadline, log()
                time.sleep(0.5)
        except BaseException:
            procs.stop_group(server.pid, grace_s=10, reap=server.pid)
            raise
        said = log()
        assert "address already in use" in said.lower(), said
    raise AssertionError(f"no free port for the server in {tries} tries:\n{said}")


def log_server_ports() -> dict[str, str]:
    """Airflow settings that put an Airflow stack's log servers (scheduler, triggerer) on free ports, not 8793 and
    8794, so that two test files may each run a stack at once (make test runs two files at a time)."""
    return {"AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port())}


def wait_for(pred, timeout: float, what: str, every: float = 0.05):
    """``pred()``'s first truthy value within ``timeout`` seconds; else fail naming ``what``."""
    end = time.time() + timeout
    while time.time() < end:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """LLMP_HOME = a fresh directory: relative spec paths and all state resolve under it."""
    monkeypatch.setenv("LLMP_HOME", str(tmp_path))
    return tmp_path


# Credentials for the test S3 servers (they take any), set before a test starts a Spark JVM: its Python workers
# inherit the JVM's environment, and a task that uploads builds its own client.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """The embedded endpoint's server (``rclone serve s3``) on 127.0.0.1 over a fresh folder, taking any
    credentials."""
    from pipelines.storage.s3 import serving

    with serving(tmp_path_factory.mktemp("s3-store")) as url:
        yield url


@pytest.fixture(scope="module")
def any_key_s3():
    """An S3 server that stores any key as AWS does, ``..`` and a leading ``/`` included (moto's, threaded, in this
    process): what hostile-key tests read from. The embedded endpoint refuses such keys."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    port = free_port()
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    yield f"http://127.0.0.1:{port}"
    srv.stop()


@pytest.fixture(scope="module")
def spark():
    from pipelines.data.spark import get_spark

    s = get_spark("local[2]", "llmp-tests", "1g", shuffle_partitions=4)
    if s.sparkContext.master != "local[2]":  # a session an earlier test file left (getOrCreate gives it back)
        s.stop()
        s = get_spark("local[2]", "llmp-tests", "1g", shuffle_partitions=4)
    yield s
    s.stop()


def tiny_spec(inputs: str, name: str, model_name: str, more: str = "") -> str:
    """A job spec YAML small enough for a whole DAG run in a test (``more``: extra lines; a line indented by two
    spaces lands in ``data``)."""
    return (f"run: {{name: {name}, seed: 7}}\ndata:\n  inputs: [{inputs}]\n"
            + "".join(l + "\n" for l in more.splitlines() if l.startswith("  "))
            + "tokenizer: {vocab_size: 512, heldout_fraction: 0.1}\n"
            "model: {n_layers: 2, d_model: 32, n_heads: 4, seq_len: 64}\n"
            "train: {steps: 16, micro_batch: 4, warmup_steps: 2, ckpt_every: 8, lr: 0.01, log_every: 4}\n"
            "launcher: {nproc_per_node: 2}\neval: {limit: 8}\n"
            f"registry: {{model_name: {model_name}}}\n"
            + "".join(l + "\n" for l in more.splitlines() if not l.startswith("  ")))


# `make test` runs two test files at a time (pytest-xdist, --dist loadfile --no-loadscope-reorder: xdist would
# otherwise order the files by their number of tests): the longest files start first (as measured two at a time,
# 2026-11-26), so that neither worker is left with a long file at the end; the rest keep their order
LONGEST_FIRST = ("test_browser.py", "test_spark_nodes.py", "test_e2e.py", "test_faults.py", "test_resilience.py",
                 "test_nodes.py", "test_spark_standalone.py", "test_contract_airflow_chart.py", "test_incremental.py", "test_train.py", "test_stages.py",
                 "test_airflow_ui.py", "test_ckpt_safety.py", "test_preemption.py", "test_fence.py", "test_hang.py",
                 "test_operations.py", "test_kube.py", "test_contract_mlflow.py", "test_contract_spark_executor.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file is kept


# A hung test does not hang the suite (CI once ran out of its 90 min stuck at 42 %, with no word of where): past
# TEST_LIMIT_S (the longest test takes about 7 min on a loaded machine) every thread's stack goes to the terminal and
# the test's process exits, which pytest-xdist reports as that test failing ("worker crashed"). The Makefile's
# --max-worker-restart 0 keeps xdist from starting the hung test again on a new worker: the run ends there, failed.
TEST_LIMIT_S = float(os.environ.get("TEST_LIMIT_S", "1200"))
_TERMINAL: dict = {}  # the terminal's stderr, kept before any test captures it


def pytest_configure(config):
    _TERMINAL.setdefault("fd", os.dup(2))  # capture is suspended while plugins are configured


def bound_test(seconds: float) -> None:
    """From now the running test may take ``seconds`` more (a test that waits on a long build says so first)."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=_TERMINAL.get("fd", 2))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    bound_test(TEST_LIMIT_S)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# Nothing exits 0 with tests missing: a worker that died (a hang above, a kill for memory) while another finished
# makes xdist end the run early, and a run that ends before every collected test reported is failed here.
_REPORTED: set = set()


def pytest_runtest_logreport(report):
    _REPORTED.add(report.nodeid)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or session.config.option.collectonly:
        return
    missing = session.testscollected - len(_REPORTED)
    if missing > 0:
        tw = session.config.get_terminal_writer()
        tw.line()
        tw.line(f"{missing} of {session.testscollected} collected tests never ran: the run is failed", red=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
