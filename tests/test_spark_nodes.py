"""The data plane on simulated nodes: a Spark standalone master and two workers, each worker in a Linux mount
namespace of its own (a private /tmp for its work and shuffle files, a private empty project var/), sharing only
run.root on a shared directory and loopback. ingest → dedup → filter → tokenize through the stage CLIs give the
tokenization local[2] gives (doc id → token ids)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT, c4_docs, write_jsonl
from pipelines.manifest import load_manifest
from pipelines.sim_nodes import SparkCluster, namespaces_permitted

pytestmark = pytest.mark.spark

SETS = ["tokenizer.vocab_size=600", "tokenizer.shard_tokens=30000", "tokenizer.heldout_fraction=0.1",
        "data.filters.steps=[language,gopher_repetition]", "data.ingest.chunk_mb=1"]


def _curate(home, master: str, root, inputs) -> dict:
    env = {**os.environ, "LLMP_HOME": str(home)}
    sets = [a for s in SETS + [f"services.spark_master={master}", f"run.root={root}"] for a in ("--set", s)]
    out, prev = {}, []
    for name, module, up in (("ingest", "pipelines.data.ingest", None), ("dedup", "pipelines.data.dedup", "ingest"),
                             ("filter", "pipelines.data.filter", "dedup"),
                             ("tokenize", "pipelines.data.tokenize", "filter")):
        report = home / f"{name}-{abs(hash(master))}.json"
        args = [a for i in inputs for a in ("--input", str(i))] if up is None else [f"--{up}-manifest", out[up].path]
        r = subprocess.run([sys.executable, "-m", module, *args, *sets, "--report", str(report)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{name} on {master}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        out[name] = load_manifest(json.loads(report.read_text())["manifest"])
        prev.append(r.stdout)
    return out


@pytest.fixture
def outside_tmp():
    """A directory outside /tmp (each node has a /tmp of its own): the shared FS and the nodes' disks."""
    d = Path(tempfile.mkdtemp(prefix="llmp-nodes-", dir="/var/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(namespaces_permitted() is not None, reason=str(namespaces_permitted()))
def test_two_workers_in_their_own_mount_namespaces_curate_what_local_2_curates(home, outside_tmp):
    from pipelines.data import tokenize

    docs = c4_docs(500)
    recs = [{"text": d["text"]} for d in docs] + [{"text": docs[i]["text"]} for i in range(0, 60, 3)]
    shared, nodes = outside_tmp / "shared", outside_tmp / "nodes"
    shared.mkdir()
    inputs = [write_jsonl(shared / "a.jsonl", recs[::2]), write_jsonl(shared / "b.jsonl", recs[1::2])]
    with SparkCluster(nodes, workers=2, cores=1, memory="1536m", private_dirs=(ROOT / "var",)) as cluster:
        on_nodes = _curate(home, cluster.master_url, shared / "runs", inputs)
        apps = cluster.state()["completedapps"]
    local = _curate(home, "local[2]", home / "runs", inputs)

    assert {a["name"] for a in apps} == {f"llm-pipeline-{s}" for s in ("ingest", "dedup", "filter", "tokenize")}
    for i in range(2):  # each worker ran executors, in its own /tmp
        assert any((nodes / f"node{i}" / "tmp" / "spark-work").iterdir()), i
    assert not (ROOT / "var" / "spark-work").exists()
    for name, m in on_nodes.items():
        assert str(m.path).startswith(str(shared / "runs")), name
        assert m.counts == local[name].counts or name == "tokenize", name
    assert on_nodes["ingest"].counts["chunks"] >= 2 and on_nodes["dedup"].counts["removed"] >= 20
    for split in tokenize.SPLITS:
        got, want = (tokenize.read_back(m["tokenize"], split) for m in (on_nodes, local))
        assert got and got == want, split
    assert on_nodes["tokenize"].extra["tokenizer_sha256"] == local["tokenize"].extra["tokenizer_sha256"]
