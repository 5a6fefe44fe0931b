"""The same dedup job, spark-submitted to a real Spark standalone cluster (master + worker on 127.0.0.1)."""
import math
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
    port, ui = free_port(), free_port()
    logs = tmp_path_factory.mktemp("logs")
    master = subprocess.Popen([str(BIN / "spark-class"), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(ui)], env=env,
                              stdout=open(logs / "master.log", "w"), stderr=subprocess.STDOUT)
    workers = [subprocess.Popen([str(BIN / "spark-class"), "org.apache.spark.deploy.worker.Worker",
                                 f"spark://127.0.0.1:{port}", "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
                                 "--webui-port", str(free_port()), "--work-dir", str(tmp_path_factory.mktemp("w"))],
                                env=env, stdout=open(logs / f"worker{i}.log", "w"), stderr=subprocess.STDOUT)
               for i in range(2)]  # two workers of one core each
    try:
        _wait_http(f"http://127.0.0.1:{ui}/json/")
        deadline = time.time() + 90
        while b'"aliveworkers" : 2' not in urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/").read():
            assert time.time() < deadline, (logs / "worker0.log").read_text()[-3000:]
            time.sleep(1)
        yield f"spark://127.0.0.1:{port}", env, f"http://127.0.0.1:{ui}/json/"
    finally:
        for p in (*workers, master):
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
    assert [a["name"] for a in apps] == ["llm-pipeline-ingest"], state  # ingest + dedup, one session
    cl = {x["id"]: x for x in ds.dataset(str(out / "clusters"), format="parquet").to_table().to_pylist()}
    assert set(cl) == {x["id"] for x in recs}
    assert cl["copy-of-c4-7"]["cluster"] == cl["c4-7"]["idx"]
    assert "1 removed" in r.stdout


def test_tokenization_is_the_same_on_local_1_local_2_and_the_standalone_cluster(cluster, tmp_path):
    """The contract CLI on three masters: the same tokenizer, the same split and the same token ids per doc, though
    the shard layout follows the partitions."""
    import json

    from test_tokenize import _filter_manifest

    from pipelines.data import tokenize
    from pipelines.data.shards import Shard
    from pipelines.data.spark import row_groups
    from pipelines.manifest import load_manifest

    master, env, api = cluster
    docs = [{"id": f"c4-{i}", "text": d["text"]} for i, d in enumerate(c4_docs(400))]
    filt = _filter_manifest(tmp_path, docs, files=4)
    outs = {}
    # one task writing many shards; the default (parallelism raised to ~shard_tokens a task); 3 tasks cutting
    # across the 4 files' row groups
    for m, parts in (("local[1]", 1), ("local[2]", 0), (master, 3)):
        out = tmp_path / m.replace("/", "_").replace(":", "_")
        r = subprocess.run([str(BIN / "python"), "-m", "pipelines.data.tokenize", "--input-manifest", filt.path,
                            "--output", str(out), "--set", f"services.spark_master={m}", "--set",
                            "tokenizer.vocab_size=800", "--set", "tokenizer.shard_tokens=30000",
                            "--set", f"tokenizer.partitions={parts}"],
                           env={**env, "LLMP_HOME": str(tmp_path)}, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        outs[m] = load_manifest(out)
    assert [outs[m].extra["spark_master"] for m in outs] == list(outs)
    parts = [outs[m].extra["partitions"] for m in outs]
    text = sum(g[3] for g in row_groups(filt.output("kept"), "text"))  # the default: ~shard_tokens a task (the
    assert parts == [1, -(-math.ceil(text / 4 / 30000) // 2) * 2, 3] and parts[1] > 2  # 4 bytes a token, whole waves)
    assert len({tuple(s["prefix"] for s in o.extra["shards"]) for o in outs.values()}) == 3  # three layouts
    assert "llm-pipeline-tokenize" in [a["name"] for a in json.loads(urllib.request.urlopen(api).read())
                                       ["completedapps"]]
    assert len({o.extra["tokenizer_sha256"] for o in outs.values()}) == 1
    for split in tokenize.SPLITS:
        got = [tokenize.read_back(o, split) for o in outs.values()]
        assert got[0] and got[0] == got[1] == got[2], split
    for o in outs.values():  # every shard reads back; its counts are the manifest's
        assert sum(o.counts[f"{s}_docs"] for s in tokenize.SPLITS) == 400
        for s in o.extra["shards"]:
            sh = Shard.open(o.dir / s["prefix"])
            assert (sh.num_docs, sh.num_tokens) == (s["docs"], s["tokens"]) and s["tokens"] <= 30000


def test_a_cluster_master_whose_executors_never_come_is_a_retry_within_the_bound(tmp_path):
    """A stage on a cluster master whose executors never start (Pending pods: no node fits, an image that cannot be
    pulled; here a standalone master without workers) waited with Spark's "Initial job has not accepted any
    resources" until its task's timeout (hours). Now a one-task probe is waited for at most
    ``services.spark_executor_wait_minutes``: ExecutorsMissing, exit 75, the session stopped."""
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    port, ui = free_port(), free_port()
    master = subprocess.Popen([str(BIN / "spark-class"), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(ui)], env=env,
                              stdout=open(tmp_path / "master.log", "w"), stderr=subprocess.STDOUT)
    probe = ("import sys, time\n"
             "from pipelines.spec import load_spec\n"
             "from pipelines.data.spark import ExecutorsMissing, spec_session\n"
             "spec = load_spec(None, [f'services.spark_master={sys.argv[1]}', "
             "'services.spark_executor_wait_minutes=0.1'], env={})\n"
             "t0 = time.monotonic()\n"
             "try:\n"
             "    spec_session(spec, 'llmp-no-executors')\n"
             "except ExecutorsMissing as e:\n"
             "    print(e.exit_code, round(time.monotonic() - t0), e, flush=True)\n")
    try:
        _wait_http(f"http://127.0.0.1:{ui}/json/")
        r = subprocess.run([sys.executable, "-c", probe, f"spark://127.0.0.1:{port}"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
        code, secs, said = r.stdout.split(" ", 2) if r.stdout else ("", "0", "")
        assert code == "75" and "no executor of spark://" in said, (r.stdout, r.stderr[-3000:])
        assert int(secs) < 240  # the bound (6 s), the JVM's start on a loaded machine and the stop: not hours
    finally:
        master.terminate()
        master.wait(timeout=30)
