"""The whole DAG via `airflow dags test`, on real Spark, torchrun, the embedded S3 endpoint and MLflow, with Airflow's
metadata in PostgreSQL as on the cluster (modules/metadata's DSN shape: its own login and database, sslmode=require,
the async engine through psycopg_async)."""
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, c4_docs, tiny_spec, write_jsonl
from pg_server import Postgres

pytestmark = pytest.mark.e2e

@pytest.fixture
def metadata_db():
    with Postgres() as pg:
        pg.app("airflow_app", ["airflow"])
        yield pg


def test_dag_runs_end_to_end_and_registers_a_model_with_lineage(tmp_path, metadata_db):
    docs = c4_docs(160)
    recs = [{"id": f"c4-{i}", "text": d["text"]} for i, d in enumerate(docs)]
    recs.append({"id": "dup-of-c4-3", "text": docs[3]["text"]})
    good = write_jsonl(tmp_path / "good.jsonl", recs)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "broken\n{"id": 1}\n' + json.dumps({"text": docs[5]["text"]}).encode() + b"\n")
    spec = tmp_path / "tiny.yaml"
    spec.write_text(tiny_spec(f"{good}, {bad}", name="e2e", model_name="e2e-model"))
    env = {**os.environ, "LLMP_HOME": str(tmp_path), "AIRFLOW_HOME": str(tmp_path / "airflow"),
           "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"), "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": metadata_db.dsn("airflow_app", "airflow"),
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": metadata_db.dsn("airflow_app", "airflow").replace(
               "postgresql://", "postgresql+psycopg_async://"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    airflow = str(Path(sys.executable).parent / "airflow")
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    r = subprocess.run([airflow, "dags", "test", "llm_pipeline", "-c", json.dumps({"spec": str(spec)})],
                       env=env, capture_output=True, text=True, timeout=1200)
    log = r.stdout + r.stderr
    (tmp_path / "dag.log").write_text(log)
    assert r.returncode == 0 and "state=success" in log, log[-5000:]

    # a registered version with lineage tags, champion alias on it
    db = sqlite3.connect(tmp_path / "var" / "mlflow.db")
    tags = dict(db.execute("select key, value from model_version_tags where name='e2e-model' and version=1"))
    for k in ("data_manifest_hash", "tokenizer_hash", "config_hash", "checkpoint_uri", "heldout_loss", "reference_bpb",
              "reference_sha256", "harness.llmp_arc_easy.acc", "harness.llmp_hellaswag.acc_norm", "harness.llmp_lambada_openai.acc"):
        assert k in tags, tags
    assert tags["checkpoint_uri"].startswith("s3://")
    alias = db.execute("select version from registered_model_aliases where name='e2e-model' and alias='champion'")
    assert alias.fetchone() == (1,)

    # the tasks pushed their extra links' URLs: the MLflow run, the model version, the checkpoint
    rows = metadata_db.psql("select task_id || chr(9) || value::text from xcom where key='links'", db="airflow")
    links = {t: json.loads(v) for t, v in (row.split("\t", 1) for row in rows.splitlines())}
    assert links["register"]["model_version"].endswith("/#/models/e2e-model/versions/1")
    assert "/runs/" in links["ingest"]["mlflow_run"] and links["promote"]["checkpoint"].startswith("file://")
    assert links["dedup"]["spark_ui"].startswith("http://127.0.0.1:")  # the driver's UI while the stage ran

    # every manifest's counts add up: docs in = kept + removed + quarantined
    runs = tmp_path / "var" / "runs"
    man = {d.name: json.loads(next(d.glob("*/manifest.json")).read_text()) for d in runs.iterdir()}
    ing, dd, fl, dc, tk = (man[s]["counts"] for s in ("ingest", "dedup", "filter", "decontaminate", "tokenize"))
    assert ing["lines"] == len(recs) + 3 and ing["quarantined"] == 2
    assert ing["lines"] == ing["docs"] + ing["quarantined"]
    assert dd["docs_in"] == ing["docs"] and dd["kept"] + dd["removed"] == dd["docs_in"]
    assert dd["removed_exact"] >= 2  # dup-of-c4-3 and the copy of c4-5 in bad.jsonl
    assert fl["docs_in"] == dd["kept"] and fl["kept"] + fl["removed"] == fl["docs_in"]
    assert dc["docs_in"] == fl["kept"] and dc["kept"] + dc["removed"] == dc["docs_in"] and tk["docs"] == dc["kept"]
    assert ing["lines"] == tk["docs"] + dc["removed"] + fl["removed"] + dd["removed"] + ing["quarantined"]
    con = man["decontaminate"]["extra"]["contamination"]
    assert set(con) == {"llmp_arc_easy", "llmp_hellaswag", "llmp_lambada_openai", "reference"}
    assert all(isinstance(r["docs_removed"], int) and r["ngram"] == 13 for r in con.values())
    for task in con:  # the version carries, per eval set, how many of its items overlap the data the model saw
        assert tags[f"contamination.{task}"] == f"{len(con[task]['overlapping_kept'])}/{con[task]['items']}"
    assert tk["tokens"] == sum(s["tokens"] for s in man["tokenize"]["extra"]["shards"])
    assert man["preflight"]["counts"] == {"world_size": 2, "stragglers": 0}
    assert man["preflight"]["metrics"]["smoke_loss_last"] < man["preflight"]["metrics"]["smoke_loss_first"]
    assert man["evaluate"]["extra"]["loaded_from"] == "L2"
    assert tags["reference_sha256"] == man["evaluate"]["extra"]["reference_sha256"]
    assert 0 < man["evaluate"]["metrics"]["reference_bpb"] < 20 and man["evaluate"]["extra"]["sample"]["text"]
    assert "no 'champion' yet" in tags["gate"]
    # MLflow 3 lineage: the version is a LoggedModel of the training run, its eval metrics on their datasets
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'var' / 'mlflow.db'}")
    mv = client.get_model_version_by_alias("e2e-model", "champion")
    assert mv.source.startswith("models:/m-")
    lm = client.get_logged_model(mv.source.removeprefix("models:/"))
    metrics = {m.key: m for m in lm.metrics}
    assert metrics["reference_bpb"].dataset_digest == tags["reference_sha256"][:12]
    assert lm.source_run_id == mv.run_id == man["train"]["extra"]["mlflow_run_id"]
    assert len(client.get_metric_history(mv.run_id, "train/loss")) >= 4
    reg_dir = Path(man["register"]["outputs"][0]["uri"].removeprefix("file://")).parent
    assert (reg_dir / "report.png").stat().st_size > 10_000 and "| reference_bpb |" in (reg_dir / "report.md").read_text()
    # the train stage's promoter took every checkpoint to L1 and L2 during the run (ckpt_every 8 of 16 steps);
    # the promote task finds the final one there and verified
    assert man["train"]["extra"]["promoted_during_run"] == {"8": {"L1": "copied", "L2": "committed"},
                                                           "16": {"L1": "copied", "L2": "committed"}}
    assert man["promote"]["extra"]["actions"] == {"L1": "already-verified", "L2": "already-verified"}
    assert man["train"]["extra"]["resumed_from"] is None
    # the embedded S3 endpoint was stopped; its objects were written to disk as they arrived
    assert not (tmp_path / "var/s3/endpoint.json").exists()
    assert list((tmp_path / "var/s3/store").rglob("COMMIT"))
    # lineage: the champion's corpus version and inputs; a doc and a source lead back to the champion
    def lineage(*args):
        r = subprocess.run([sys.executable, "-m", "pipelines.lineage", *args, "--json"], capture_output=True,
                           text=True, timeout=300, env=env, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    got = lineage("--model", "e2e-model@champion")
    assert got["corpus"]["digest"] == tags["data_manifest_hash"] and got["model"]["version"] == str(mv.version)
    keys = {Path(i["key"]).name: i["key"] for i in got["inputs"]}
    assert set(keys) == {"good.jsonl", "bad.jsonl"} and set(got["docs_per_source"]) <= set(keys.values())
    for i in got["inputs"]:  # the digest of the bytes read (one task each here: the file's), not the listing identity
        assert i["sha256"] == hashlib.sha256((tmp_path / Path(i["key"]).name).read_bytes()).hexdigest() != i["identity"]
    assert got["docs_per_source"][keys["good.jsonl"]] >= 100
    champion = {"name": "e2e-model", "version": str(mv.version)}
    import pyarrow.parquet as pq

    corpus = Path(got["corpus"]["manifest"])
    first_shard = json.loads(corpus.read_text())["extra"]["shards"][0]["prefix"]
    doc_id = pq.read_table(corpus.parent / f"{first_shard}.ids.parquet").column("id")[0].as_py()
    doc = lineage("--doc", doc_id)
    assert first_shard in doc["corpus_versions"][0]["shards"]
    assert doc["corpus_versions"] and {k: doc["models"][0][k] for k in champion} == champion
    src = lineage("--source", keys["good.jsonl"])
    assert src["corpus_versions"][0]["source_docs"] >= 100 and {k: src["models"][0][k] for k in champion} == champion
    assert lineage("--doc", "no-such-doc") == {"doc": "no-such-doc", "corpus_versions": [], "models": [], "unreadable": []}

    # the version carries its Hugging Face copy with a model card; the CLI writes GGUF from the registry
    import mlflow.artifacts

    hf = Path(mlflow.artifacts.download_artifacts(artifact_uri=tags["export.hf"], dst_path=str(tmp_path / "hf")))
    card = (hf / "README.md").read_text()
    assert "good.jsonl" in card and "llmp_arc_easy:" in card and "| reference_bpb |" in card and tags["config_hash"] in card
    r = subprocess.run([sys.executable, "-m", "pipelines.eval.export", "--model", "e2e-model@champion", "--format",
                        "gguf", "--out", str(tmp_path / "gguf")], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    from gguf import GGUFReader

    assert len(GGUFReader(str(tmp_path / "gguf" / "model.gguf")).tensors) == 2 + 9 * json.loads(
        (hf / "config.json").read_text())["num_hidden_layers"]
