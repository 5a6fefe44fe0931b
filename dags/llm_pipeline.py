"""llm_pipeline: raw web text → deduplicated, filtered, tokenized → trained → promoted → evaluated → registered.

Wiring only: every task runs a stage of ``pipelines/`` (a ``python -m`` CLI, or spark-submit for
dedup and filter) and passes the stage manifest's path to the next task through XCom. Params (a form in the
UI's "Trigger DAG") feed the job spec as ``--set`` overrides; a Param left empty keeps the spec's value.

    setup_services ─► ingest ─► dedup ─► filter ─► tokenize ─► preflight ─► train ─► promote ─► evaluate ─► register
         (setup)                (spark-submit ×2)             (torchrun, or a PyTorchJob on Kubernetes) │
         teardown_services ◄─────────────────────────────────────────────────────────────────────────────┘

``evaluate`` scores the checkpoint (loaded from L2) on the fixed reference set (bits per byte) and the
lm-evaluation-harness tasks read offline; ``register`` logs it as a servable pyfunc and moves ``champion`` only
when it is no worse on the same reference set (else the version is ``challenger``), with an eval report.

``preflight`` and ``train`` run on the ranks the spec's ``launcher`` names: ``torchrun`` here, or a Kubeflow
PyTorchJob that the stage submits and polls (``launcher.kind: kubernetes``), its state changes and the master
pod's log streamed into the task log; clearing or killing the task deletes the job.
"""
from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Param, task

from llm_operators import SparkStageOperator, StageOperator, failure_summary

# Transient failures (S3, spark-submit, MLflow) are retried with exponential backoff; a stage that rejects its
# input or spec exits 2 and fails at once (StageOperator). Every task has a time limit.
DEFAULTS = {"retries": 2, "retry_delay": timedelta(seconds=30), "retry_exponential_backoff": True,
            "max_retry_delay": timedelta(minutes=10), "execution_timeout": timedelta(hours=6),
            "on_failure_callback": failure_summary}

SPEC = "{{ params.spec }}"
OVERRIDES = [
    "data.inputs={{ params.corpus | tojson }}",
    "train.steps={{ params.steps }}",
    "model.n_layers={{ params.n_layers }}",
    "model.d_model={{ params.d_model }}",
    "model.n_heads={{ params.n_heads }}",
    "launcher.nproc_per_node={{ params.nproc }}",
    "run.force={{ params.force | lower }}",
    "run.mlflow_run_id={{ ti.xcom_pull(task_ids='setup_services')['mlflow_run_id'] }}",
]


def manifest_of(task_id: str) -> str:
    return "{{ ti.xcom_pull(task_ids='%s') }}" % task_id


with DAG(
    dag_id="llm_pipeline",
    description="Raw web text to an evaluated, registered model on real Spark, torchrun, S3 and MLflow.",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=DEFAULTS,
    tags=["llm", "spark", "torch", "mlflow"],
    doc_md=__doc__,
    params={
        "spec": Param("configs/demo.yaml", type="string", description="Job spec YAML (relative to the project root)."),
        # Empty = take the value from the spec file.
        "corpus": Param(None, type=["null", "array"],
                        description="Input JSONL files (plain, .gz or .zst) with a `text` field."),
        "steps": Param(None, type=["null", "integer"], minimum=1, description="Training steps."),
        "n_layers": Param(None, type=["null", "integer"], minimum=1, description="Transformer layers."),
        "d_model": Param(None, type=["null", "integer"], minimum=16, description="Model width."),
        "n_heads": Param(None, type=["null", "integer"], minimum=1, description="Attention heads."),
        "nproc": Param(None, type=["null", "integer"], minimum=1, description="torchrun processes per node."),
        "force": Param(False, type="boolean", description="Recompute stages even if their manifests verify."),
    },
) as dag:

    @task
    def setup_services(params=None) -> dict:
        """Start the embedded S3 endpoint when no external one is configured; open the MLflow run."""
        from pipelines import tracking
        from pipelines.spec import load_spec
        from pipelines.storage import s3

        spec = load_spec(params["spec"])
        started = None
        if not spec.services.s3_endpoint_url:
            started = s3.start()
        from airflow.sdk import get_current_context

        ctx = get_current_context()
        run_id = tracking.start_run(spec, run_name=f"{spec.run.name}-{ctx['run_id']}",
                                    tags={"airflow.dag_id": ctx["dag"].dag_id, "airflow.run_id": ctx["run_id"]})
        return {"mlflow_run_id": run_id, "embedded_s3": started}

    @task
    def teardown_services(info: dict, params=None) -> None:
        """Close the MLflow run and stop the embedded S3 endpoint (its objects are saved to var/s3/store)."""
        from pipelines import tracking
        from pipelines.spec import load_spec
        from pipelines.storage import s3

        spec = load_spec(params["spec"])
        if info and info.get("mlflow_run_id"):
            tracking.client(spec).set_terminated(info["mlflow_run_id"])
        if info and info.get("embedded_s3"):
            s3.stop()

    setup = setup_services()

    ingest = StageOperator(task_id="ingest", module="pipelines.data.ingest", spec=SPEC, overrides=OVERRIDES)
    dedup = SparkStageOperator(task_id="dedup", module="pipelines.data.dedup", name="llm-pipeline-dedup",
                               spec=SPEC, overrides=OVERRIDES, stage_args=["--input-manifest", manifest_of("ingest")])
    filt = SparkStageOperator(task_id="filter", module="pipelines.data.filters", name="llm-pipeline-filter",
                              spec=SPEC, overrides=OVERRIDES, stage_args=["--input-manifest", manifest_of("dedup")])
    tokenize = StageOperator(task_id="tokenize", module="pipelines.data.tokenize", spec=SPEC, overrides=OVERRIDES,
                             stage_args=["--input-manifest", manifest_of("filter")])
    preflight = StageOperator(task_id="preflight", module="pipelines.train.preflight", spec=SPEC, overrides=OVERRIDES,
                              stage_args=["--tokenize-manifest", manifest_of("tokenize")])
    train = StageOperator(task_id="train", module="pipelines.train.launch", spec=SPEC, overrides=OVERRIDES,
                          stage_args=["--tokenize-manifest", manifest_of("tokenize")],
                          execution_timeout=timedelta(days=7))  # resumes from its checkpoints when retried
    promote = StageOperator(task_id="promote", module="pipelines.train.checkpoint", spec=SPEC, overrides=OVERRIDES,
                            stage_args=["--input-manifest", manifest_of("train")])
    evaluate = StageOperator(task_id="evaluate", module="pipelines.eval.evaluate", spec=SPEC, overrides=OVERRIDES,
                             stage_args=["--promote-manifest", manifest_of("promote"),
                                         "--tokenize-manifest", manifest_of("tokenize")])
    register = StageOperator(task_id="register", module="pipelines.eval.registry", spec=SPEC, overrides=OVERRIDES,
                             stage_args=["--eval-manifest", manifest_of("evaluate"),
                                         "--train-manifest", manifest_of("train"),
                                         "--tokenize-manifest", manifest_of("tokenize")])
    teardown = teardown_services(setup).as_teardown(setups=setup)

    setup >> ingest >> dedup >> filt >> tokenize >> preflight >> train >> promote >> evaluate >> register >> teardown
