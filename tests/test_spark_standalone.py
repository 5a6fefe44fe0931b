"""The same dedup job, spark-submitted to a real Spark standalone cluster (master + worker on 127.0.0.1)."""
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from conftest import ROOT, c4_docs, free_port, write_jsonl

pytestmark = pytest.mark.spark
BIN = Path(sys.executable).parent


def _wait_http(url, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback
                if r.status == 200 and b"ALIVE" in r.read():
                    return
        except Exception:
            pass
        time.sleep(1)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_WORKER_DIR": str(tmp_path_factory.mktemp("work")),
           "PYSPARK_PYTHON": sys.executable}
    port, ui, wui = free_port(), free_port(), free_port()
    logs = tmp_path_factory.mktemp("logs")
    master = subprocess.Popen([str(BIN / "spark-class"), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(ui)], env=env,
                              stdout=open(logs / "master.log", "w"), stderr=subprocess.STDOUT)
    worker = subprocess.Popen([str(BIN / "spark-class"), "org.apache.spark.deploy.worker.Worker",
                               f"spark://127.0.0.1:{port}", "--host", "127.0.0.1", "--cores", "2", "--memory", "2g",
                               "--webui-port", str(wui)], env=env,
                              stdout=open(logs / "worker.log", "w"), stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{ui}/json/")
        deadline = time.time() + 90
        while b'"aliveworkers" : 1' not in urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/").read():
            assert time.time() < deadline, (logs / "worker.log").read_text()[-3000:]
            time.sleep(1)
        yield f"spark://127.0.0.1:{port}", env, f"http://127.0.0.1:{ui}/json/"
    finally:
        for p in (worker, master):
            p.terminate()
            p.wait(timeout=30)


def test_dedup_runs_on_a_standalone_cluster_via_spark_submit(cluster, tmp_path):
    from pipelines.data.spark import package_zip

    import json

    master, env, api = cluster
    docs = c4_docs(60)
    recs = [{"id": f"c4-{i}", "text": d["text"]} for i, d in enumerate(docs)] + \
        [{"id": "copy-of-c4-7", "text": docs[7]["text"]}]
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out"
    zip_path = package_zip(tmp_path / "pipelines.zip")
    cmd = [str(BIN / "spark-submit"), "--master", master, "--py-files", str(zip_path),
           "--conf", f"spark.pyspark.python={sys.executable}", "--conf", "spark.executor.memory=1g",
           str(ROOT / "pipelines" / "spark_entry.py"), "pipelines.data.dedup", "--input", str(src), "--output", str(out)]
    r = subprocess.run(cmd, env={**env, "LLMP_HOME": str(tmp_path)}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    state = json.loads(urllib.request.urlopen(api).read())
    apps = state["completedapps"] + state["activeapps"]  # it really ran on the cluster
    assert [a["name"] for a in apps] == ["llm-pipeline-dedup"], state
    cl = {x["id"]: x for x in ds.dataset(str(out / "clusters"), format="parquet").to_table().to_pylist()}
    assert set(cl) == {x["id"] for x in recs}
    assert cl["copy-of-c4-7"]["cluster"] == cl["c4-7"]["idx"]
    assert "1 removed" in r.stdout
