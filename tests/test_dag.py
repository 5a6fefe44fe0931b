"""DAG integrity: it parses, tasks are wired in the designed order, params render into spec overrides."""

from pathlib import Path

import pytest

from conftest import ROOT

ORDER = ["setup_services", "ingest", "dedup", "filter", "tokenize", "preflight", "train", "promote", "evaluate", "register",
         "teardown_services"]


@pytest.fixture(scope="module")
def dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert bag.import_errors == {}
    return bag.dags["llm_pipeline"]


def test_task_order_is_as_designed(dag):
    assert set(dag.task_ids) == set(ORDER)
    for up, down in zip(ORDER, ORDER[1:]):
        assert dag.get_task(down).upstream_task_ids >= {up}, (up, down)
    assert dag.get_task("teardown_services").is_teardown and dag.get_task("setup_services").is_setup
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    for t in ("dedup", "filter"):
        assert isinstance(dag.get_task(t), SparkSubmitOperator)


def test_params_give_a_trigger_form_with_spec_defaults(dag):
    assert dag.params["spec"] == "configs/demo.yaml"
    assert {"corpus", "steps", "n_layers", "d_model", "n_heads", "nproc", "force"} <= set(dag.params.keys())
    assert (ROOT / dag.params["spec"]).is_file()


def test_empty_params_keep_the_spec_values():
    from llm_operators import spec_cli_args

    args = spec_cli_args("s.yaml", ["train.steps=None", "train.steps=", "model.d_model=64", "run.force=false"])
    assert args == ["--spec", "s.yaml", "--set", "model.d_model=64", "--set", "run.force=false"]


def test_dag_file_has_no_heavy_imports_at_top_level():
    src = (ROOT / "dags" / "llm_pipeline.py").read_text()
    top = [l for l in src.splitlines() if l.startswith(("import ", "from "))]
    assert not [l for l in top if any(h in l for h in ("torch", "pyspark", "mlflow", "pipelines"))], top


def test_a_kubernetes_spark_master_gets_executor_settings_or_a_clear_error(monkeypatch):
    from llm_operators import AirflowException, kubernetes_conf
    from pipelines.spec import load_spec

    assert kubernetes_conf(load_spec(None, [], env={})) == {}  # local[*]: nothing to add
    k8s = ["services.spark_master=k8s://https://api.example:443"]
    with pytest.raises(AirflowException, match=r"needs services\.spark_image"):
        kubernetes_conf(load_spec(None, k8s, env={}))
    monkeypatch.setenv("POD_IP", "10.0.3.7")
    conf = kubernetes_conf(load_spec(None, k8s + ["services.spark_image=repo/spark:1"], env={}))
    assert conf["spark.kubernetes.container.image"] == "repo/spark:1"
    assert conf["spark.kubernetes.authenticate.serviceAccountName"] == "spark"
    assert conf["spark.driver.host"] == "10.0.3.7"


def test_every_dag_file_parses_fast_and_without_errors(capsys):
    """DagBag over the folder; each file's parse time is measured (Airflow's own stats) and reported."""
    from airflow.dag_processing.dagbag import DagBag

    DagBag(dag_folder=str(ROOT / "dags"))  # warm: the first parse pays for importing Airflow itself
    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert bag.import_errors == {}
    stats = {Path(s.file).name: s.duration.total_seconds() for s in bag.dagbag_stats}
    with capsys.disabled():
        print("\nDAG file parse times: " + ", ".join(f"{f} {t * 1000:.0f} ms" for f, t in sorted(stats.items())))
    assert stats and all(t < 0.5 for t in stats.values()), stats


def test_tasks_retry_transient_failures_with_backoff_have_time_limits_and_a_failure_summary(dag):
    from llm_operators import failure_summary

    for t in dag.tasks:
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
    assert {l.name for l in StageOperator.operator_extra_links} == {l.name for l in LlmPipelinePlugin.operator_extra_links}
