"""DAG integrity: the four DAGs parse (fast), come from the stage table, are linked by Assets, have typed forms;
params render into spec overrides; links, retries, the Asset hand-off."""

import copy
from pathlib import Path

import pytest

from conftest import ROOT

ORDER = ["setup_services", "ingest", "dedup", "filter", "decontaminate", "tokenize", "preflight", "train", "promote", "evaluate", "register",
         "teardown_services"]


@pytest.fixture(scope="module")
def bag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert bag.import_errors == {}
    assert set(bag.dags) == {"data_curation", "training", "evaluation", "llm_pipeline"}
    return bag


@pytest.fixture(scope="module")
def dag(bag):
    return bag.dags["llm_pipeline"]


def test_task_order_is_as_designed(dag):
    assert set(dag.task_ids) == set(ORDER)
    for up, down in zip(ORDER, ORDER[1:]):
        assert dag.get_task(down).upstream_task_ids >= {up}, (up, down)
    assert dag.get_task("teardown_services").is_teardown and dag.get_task("setup_services").is_setup
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    for t in ("dedup", "filter", "decontaminate"):
        assert isinstance(dag.get_task(t), SparkSubmitOperator)


def test_a_stopped_train_task_gives_the_ranks_their_preemption_grace_before_sigkill(bag):
    """SIGTERM to the train task's processes is a preemption notice; SIGKILL must not come before the ranks' grace."""
    from pipelines.spec import TrainCfg

    grace = TrainCfg.model_fields["preempt_grace_s"].default
    for dag_id in ("llm_pipeline", "training"):
        d = bag.dags[dag_id]
        assert d.get_task("train").kill_grace_s >= grace + 5, dag_id
        assert d.get_task("promote").kill_grace_s < grace  # other stages keep the short default
    # the UI's stop (pipelines.airflow_ui, a lower layer that may not import the DAGs) gives a running train task
    # its kill grace before it SIGKILLs the component's group
    from pipelines.airflow_ui import STOP_GRACE_S

    assert STOP_GRACE_S >= max(bag.dags[d].get_task("train").kill_grace_s for d in ("llm_pipeline", "training")) + 5


def test_the_split_dags_run_the_table_s_stages_and_are_linked_by_assets(bag):
    from pipelines.stages import DAGS, STAGES, of_dag

    for dag_id in DAGS:
        d = bag.dags[dag_id]
        names = [s.name for s in of_dag(dag_id)]
        assert [t for t in d.task_ids if t in STAGES] == names  # task id = stage name
        for n in names:
            assert d.get_task(n).module == STAGES[n].module
    cur, tr, ev = (bag.dags[k] for k in ("data_curation", "training", "evaluation"))
    assert type(cur.timetable).__name__ == "CronTriggerTimetable" and cur.timetable.expression == "0 0 * * 0"
    assert cur.catchup is False
    # the Asset each downstream DAG is scheduled on is an outlet of the upstream DAG's last task, `publish`, which
    # runs after the last stage and the teardown
    for up, down, last in ((cur, tr, "tokenize"), (tr, ev, "promote")):
        scheduled_on = {a.name for a in down.timetable.asset_condition.objects}
        leaves = [t.task_id for t in up.tasks if not t.downstream_list]
        assert leaves == ["publish"], leaves
        grows = {"previous_corpus"} if up is cur else set()  # publish compares with the version it started from
        assert up.get_task("publish").upstream_task_ids == {last, "teardown_services"} | grows
        assert not any(up.get_task(t).outlets for t in up.task_ids if t != "publish")
        emitted = {a.name for a in up.get_task("publish").outlets}
        assert scheduled_on and scheduled_on == emitted, (down.dag_id, scheduled_on, emitted)
        assert {a.name for a in down.get_task("upstream_assets").inlets} == emitted


def test_the_curation_dag_grows_the_last_corpus_version_and_skips_its_event_when_nothing_is_new(bag, tmp_path):
    from llm_operators import unchanged

    cur, whole = bag.dags["data_curation"], bag.dags["llm_pipeline"]
    prev = cur.get_task("previous_corpus")
    assert {a.name for a in prev.inlets} == {"curated_shards"} and prev.downstream_task_ids == {"ingest", "publish"}
    for t in ("ingest", "dedup", "tokenize"):  # the stages that take the version they add to
        args = cur.get_task(t).stage_args
        assert args[args.index("--corpus-manifest") + 1] == "{{ ti.xcom_pull(task_ids='previous_corpus') }}"
        assert "--corpus-manifest" not in whole.get_task(t).stage_args  # the demo curates all of it
    assert "--corpus-manifest" not in cur.get_task("filter").stage_args
    m = tmp_path / "manifest.json"
    m.write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path)
    assert unchanged(str(m), str(tmp_path / "link" / "manifest.json"))
    assert not unchanged(str(m), "") and not unchanged(str(m), str(tmp_path / "other.json"))


def test_the_curation_schedule_comes_from_the_spec(monkeypatch, tmp_path):
    import llm_dags

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "nightly.yaml").write_text("data:\n  schedule: '30 2 * * *'\n")
    monkeypatch.setenv("LLMP_HOME", str(tmp_path))
    monkeypatch.setenv("LLMP_SPEC", "configs/nightly.yaml")
    d = llm_dags.build("data_curation")
    assert d.timetable.expression == "30 2 * * *" and d.params["spec"] == "configs/nightly.yaml"


def test_params_give_a_typed_sectioned_trigger_form(bag, dag):
    from airflow.sdk.definitions.param import ParamValidationError

    spec = dag.params.get_param("spec")
    assert dag.params["spec"] == "configs/demo.yaml" and (ROOT / dag.params["spec"]).is_file()
    assert sorted(spec.schema["examples"]) == sorted(f"configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml"))
    assert "enum" not in spec.schema  # proposals, and any other path may be typed
    assert {"corpus", "steps", "n_layers", "d_model", "n_heads", "nproc", "eval_limit", "force"} <= set(dag.params)
    assert {dag.params.get_param(k).schema["section"] for k in dag.params} >= {"Run", "Data", "Model", "Training"}
    for k in dag.params:
        assert dag.params.get_param(k).description, k
    def form(values: dict):
        p = copy.deepcopy(dag.params)
        p.update(values)  # what a submitted trigger form does
        return p.validate()

    assert form({"steps": 5, "spec": "/elsewhere/my.yaml"})["steps"] == 5
    for bad in ({"steps": 0}, {"steps": "many"}, {"d_model": 8}, {"force": "yes"}, {"eval_limit": 10**9}):
        with pytest.raises(ParamValidationError):
            form(bad)
    assert "tokenize_manifest" in bag.dags["training"].params and "promote_manifest" in bag.dags["evaluation"].params
    assert "corpus" not in bag.dags["training"].params and "steps" not in bag.dags["data_curation"].params


def test_empty_params_keep_the_spec_values():
    from llm_operators import spec_cli_args

    args = spec_cli_args("s.yaml", ["train.steps=None", "train.steps=", "model.d_model=64", "run.force=false"])
    assert args == ["--spec", "s.yaml", "--set", "model.d_model=64", "--set", "run.force=false"]


def test_dag_files_only_wire_and_import_nothing_heavy_at_top_level():
    for f in list((ROOT / "dags").glob("*.py")) + [ROOT / "plugins" / "llm_dags.py"]:
        top = [l for l in f.read_text().splitlines() if l.startswith(("import ", "from "))]
        assert not [l for l in top if any(h in l for h in ("torch", "pyspark", "mlflow", "lm_eval"))], (f, top)
    for f in (ROOT / "dags").glob("*.py"):
        assert len(f.read_text().splitlines()) < 12, f  # one call into the table-driven builder


def test_a_kubernetes_spark_master_gets_executor_settings_or_a_clear_error(monkeypatch):
    from llm_operators import AirflowException, kubernetes_conf
    from pipelines.spec import load_spec

    assert kubernetes_conf(load_spec(None, [], env={})) == {}  # local[*]: nothing to add
    k8s = ["services.spark_master=k8s://https://api.example:443"]
    with pytest.raises(AirflowException, match=r"needs services\.spark_image"):
        kubernetes_conf(load_spec(None, k8s, env={}))
    k8s.append("services.spark_image=repo/spark:1")
    with pytest.raises(AirflowException, match=r"run.root=.* is not under launcher.shared_fs_mount=/fsx"):
        kubernetes_conf(load_spec(None, k8s, env={}))
    monkeypatch.setenv("POD_IP", "10.0.3.7")
    conf = kubernetes_conf(load_spec(None, k8s + ["run.root=/fsx/runs"], env={}))
    assert conf["spark.kubernetes.container.image"] == "repo/spark:1"
    assert conf["spark.kubernetes.authenticate.serviceAccountName"] == "spark"
    assert conf["spark.driver.host"] == "10.0.3.7"
    for role in ("driver", "executor"):  # the shared FS claim (run.root) on both sides
        pvc = f"spark.kubernetes.{role}.volumes.persistentVolumeClaim.shared-fs"
        assert conf[f"{pvc}.options.claimName"] == "fsx-checkpoints" and conf[f"{pvc}.mount.path"] == "/fsx"
    assert conf["spark.kubernetes.executor.volumes.emptyDir.spark-local-dir-1.mount.path"] == "/spark-local"
    nvme = kubernetes_conf(load_spec(None, k8s + ["run.root=/fsx/runs", "services.spark_local_dir=/mnt/nvme/spark",
                                                  "launcher.shared_fs_claim=lustre"], env={}))
    assert nvme["spark.kubernetes.executor.volumes.hostPath.spark-local-dir-1.options.path"] == "/mnt/nvme/spark"
    assert nvme["spark.kubernetes.executor.volumes.persistentVolumeClaim.shared-fs.options.claimName"] == "lustre"
    assert not any("emptyDir" in k for k in nvme)


def test_every_dag_file_parses_fast_and_without_errors(capsys):
    """DagBag over the folder; each file's parse time is measured (Airflow's own stats) and reported: the best of three
    parses, so that a stall of a loaded machine (another test file's processes on the same 2 cores) is not taken
    for the file's own cost."""
    from airflow.dag_processing.dagbag import DagBag

    DagBag(dag_folder=str(ROOT / "dags"))  # warm: the first parse pays for importing Airflow itself
    stats: dict[str, float] = {}
    for _ in range(3):
        bag = DagBag(dag_folder=str(ROOT / "dags"))
        assert bag.import_errors == {}
        for s in bag.dagbag_stats:
            name = Path(s.file).name
            stats[name] = min(stats.get(name, float("inf")), s.duration.total_seconds())
    with capsys.disabled():
        print("\nDAG file parse times: " + ", ".join(f"{f} {t * 1000:.0f} ms" for f, t in sorted(stats.items())))
    assert stats and all(t < 0.5 for t in stats.values()), stats


def test_tasks_retry_transient_failures_with_backoff_have_time_limits_and_a_failure_summary(bag):
    from llm_operators import failure_summary

    for t in (t for d in bag.dags.values() for t in d.tasks):
        assert t.execution_timeout is not None, t.task_id
        assert t.retries >= 1 and t.retry_exponential_backoff, t.task_id
        assert failure_summary in (t.on_failure_callback if isinstance(t.on_failure_callback, list)
                                   else [t.on_failure_callback]), t.task_id


def test_a_stage_that_rejects_its_spec_fails_without_retries():
    from llm_operators import AirflowFailException, StageOperator

    bad = StageOperator(task_id="t", module="pipelines.eval.evaluate", spec=str(ROOT / "configs/demo.yaml"),
                        overrides=["train.steps=-1"], stage_args=["--promote-manifest", "x", "--tokenize-manifest", "y"])
    with pytest.raises(AirflowFailException, match=r"train\.steps"):
        bad.execute({})


def test_extra_links_point_at_the_mlflow_run_the_model_version_and_the_checkpoint():
    from llm_operators import LlmPipelinePlugin, StageOperator
    from pipelines.spec import load_spec
    from pipelines.tracking import stage_links

    spec = load_spec(None, ["run.mlflow_run_id=abc123", "services.mlflow_ui_url=http://127.0.0.1:5000/"], env={})
    reg = {"extra": {"model_name": "m", "version": 3}}
    assert stage_links(spec, reg, "7") == {"mlflow_run": "http://127.0.0.1:5000/#/experiments/7/runs/abc123",
                                           "model_version": "http://127.0.0.1:5000/#/models/m/versions/3"}
    promote = {"extra": {"l2_uri": "s3://bkt/checkpoints/r/k/step-000300", "checkpoint": "r/k/step-000300"}}
    local = stage_links(spec, promote, None)["checkpoint"]
    assert local.startswith("file://") and local.endswith("/var/tiers/shared/r/k/step-000300")
    aws = load_spec(None, ["services.s3_endpoint_url=aws", "services.s3_region=eu-west-1"], env={})
    assert stage_links(aws, promote, None)["checkpoint"] == \
        "https://s3.console.aws.amazon.com/s3/buckets/bkt?region=eu-west-1&prefix=checkpoints/r/k/step-000300/"
    minio = load_spec(None, ["services.s3_endpoint_url=http://minio:9000"], env={})
    assert stage_links(minio, promote, None)["checkpoint"] == "http://minio:9000/bkt?prefix=checkpoints/r/k/step-000300/"
    assert {l.name for l in StageOperator.operator_extra_links} < {l.name for l in LlmPipelinePlugin.operator_extra_links}
    assert "Spark UI" in {l.name for l in LlmPipelinePlugin.operator_extra_links}


def test_the_failure_summary_names_the_stage_the_error_and_where_to_look(capsys, caplog):
    from types import SimpleNamespace

    from llm_operators import AirflowFailException, StageOperator, failure_summary

    op = StageOperator(task_id="dedup", module="pipelines.data.dedup")
    ti = SimpleNamespace(task_id="dedup", dag_id="data_curation", run_id="r1", try_number=3, max_tries=2)  # no .log
    err = AirflowFailException("pipelines.data.dedup rejected its input (exit 2):\ndedup: error: …")
    with caplog.at_level("ERROR"):
        failure_summary({"ti": ti, "task": op, "exception": err})
    out = capsys.readouterr()
    text = out.out + out.err + caplog.text
    assert "STAGE FAILED: task dedup of DAG data_curation (run r1), try 3: pipelines.data.dedup rejected its input" \
        in text, text
    assert "/var/runs/<stage>/" in text and "fix the spec or the input and clear the task" in text


def test_evaluation_emits_champion_only_when_the_alias_moves(bag, tmp_path):
    from llm_operators import no_event

    from pipelines.manifest import StageDir

    ev = bag.dags["evaluation"]
    leaves = [t.task_id for t in ev.tasks if not t.downstream_list]
    assert leaves == ["publish"] and {a.name for a in ev.get_task("publish").outlets} == {"champion"}
    assert ev.get_task("publish").upstream_task_ids == {"register", "teardown_services"}
    made = {}
    for moved in (True, False):
        sd = StageDir(tmp_path / "runs", "register", f"k{moved}", [{"uri": "x", "sha256": str(moved)}])
        with sd:
            (sd.tmp / "r.json").write_text("{}")
            made[moved] = sd.commit({"registration": "r.json"}, extra={
                "alias_moved": moved, "model_name": "m", "version": 3, "alias": "champion", "reason": "why"}).path
    assert no_event(made[True]) == ""
    assert no_event(made[False]) == "m v3 did not take 'champion' (why); no event"
