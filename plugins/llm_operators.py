"""Airflow operators that run pipeline stages: the control plane decides, the stages compute.

* ``StageOperator`` runs a stage's ``python -m`` CLI in a subprocess (same interpreter), streams
  its output into the task log, and returns the stage manifest's path (XCom) read from the
  ``--report`` file the CLI writes.
* ``SparkStageOperator`` submits a Spark stage with ``spark-submit`` through the Spark provider's
  ``SparkSubmitOperator``; the master is the Spark connection's (``services.spark_conn_id``) when it exists,
  else the job spec's (``services.spark_master``, env ``SPARK_MASTER``), exposed to the hook under that
  connection id for the submit only. For a non-local master the ``pipelines`` package is shipped with
  ``--py-files``.

Both take the spec path and ``--set`` overrides (templated, so DAG Params flow in), and resolve the services
through the connections (``llm_connections.resolve``); the extra links do too (``push_links``).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

from airflow.plugins_manager import AirflowPlugin
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.providers.common.compat.sdk import BaseOperatorLink, XCom

try:
    from airflow.sdk import BaseOperator
    from airflow.sdk.exceptions import AirflowException, AirflowFailException
except ImportError:  # pragma: no cover - Airflow 2 layout
    from airflow.exceptions import AirflowException, AirflowFailException
    from airflow.models import BaseOperator

KILL_GRACE_S = 10.0  # SIGTERM to a stage's processes, then SIGKILL after this long


def _code_root() -> Path:
    """The checkout holding ``pipelines/`` (this file lives in its ``plugins/``)."""
    return Path(__file__).resolve().parents[1]


if str(_code_root()) not in sys.path:  # ``pipelines`` without an install (the Spark provider's workers, say)
    sys.path.insert(0, str(_code_root()))

# a stage CLI's exit status: 2 = the input or the spec must be fixed (retrying cannot help); 75 = an infrastructure
# failure or a preemption (a retry resumes); any other non-zero status is treated as possibly transient too
from pipelines.exit_codes import RETRY, USER_ERROR  # noqa: E402 - needs the checkout on sys.path
from pipelines.procs import free_port  # noqa: E402


def project_root() -> Path:
    """Where relative spec paths resolve and state lives (``LLMP_HOME``, default the checkout)."""
    return Path(os.environ.get("LLMP_HOME") or _code_root())


def spec_cli_args(spec: str | None, overrides: Sequence[str]) -> list[str]:
    out = ["--spec", spec] if spec else []
    for o in overrides:
        value = o.partition("=")[2].strip()
        if o and value not in ("", "None", "null"):  # an empty Param keeps the spec's value
            out += ["--set", o]
    return out


def spec_sets(overrides: Sequence[str]) -> list[str]:
    """The ``--set`` overrides a stage gets (an empty Param keeps the spec's value)."""
    cli = spec_cli_args(None, overrides)
    return [v for k, v in zip(cli[::2], cli[1::2]) if k == "--set"]


def read_report(path: str, who: str = "the stage", says: tuple[str, ...] = ("manifest", "pending")) -> dict:
    """The report a stage that exited 0 wrote (``--report``): a JSON object naming its ``manifest``, or what it
    waits for (``pending``), or, from a run with ``--no-spark``, the engine it stopped for want of (``needs``):
    one of ``says``."""
    try:
        rep = json.loads(Path(path).read_text())
        if not isinstance(rep, dict) or not (set(says) & set(rep)):
            raise ValueError(f"not a stage report (none of {', '.join(says)}): {str(rep)[:200]}")
        return rep
    except (OSError, ValueError) as e:
        raise AirflowException(f"{who} exited 0 but wrote no report at {path}: {e}") from e


class _StageLink(BaseOperatorLink):
    """A URL the stage's task pushed (XCom ``links``) once its manifest was committed."""

    name = ""
    key = ""

    def get_link(self, operator, *, ti_key) -> str:
        return (XCom.get_value(key="links", ti_key=ti_key) or {}).get(self.key, "")


class MlflowRunLink(_StageLink):
    name, key = "MLflow run", "mlflow_run"


class ModelVersionLink(_StageLink):
    name, key = "Registered model version", "model_version"


class CheckpointLink(_StageLink):
    name, key = "Checkpoint", "checkpoint"


class SparkUiLink(_StageLink):
    name, key = "Spark UI", "spark_ui"


STAGE_LINKS = (MlflowRunLink(), ModelVersionLink(), CheckpointLink())


def push_links(op: BaseOperator, context, manifest_path: str, more: dict | None = None) -> None:
    """After a stage: its extra links' URLs into XCom (``pipelines.tracking.stage_links``)."""
    ti = context.get("ti") if context else None
    if ti is None:
        return
    try:
        from llm_connections import services

        from pipelines import tracking

        with services(op.spec, spec_sets(op.overrides)) as spec:  # the MLflow server and S3 the stage used
            run_id = spec.run.mlflow_run_id
            exp = tracking.client(spec).get_run(run_id).info.experiment_id if run_id else None
            links = tracking.stage_links(spec, json.loads(Path(manifest_path).read_text()), exp)
        ti.xcom_push(key="links", value={**(more or {}), **links})
    except Exception as e:  # noqa: BLE001 - links are a convenience; never fail a finished stage over them
        op.log.warning("no extra links for this task: %s", e)


def _run_cli(op: BaseOperator, module: str, args: list[str], env: dict[str, str] | None = None,
             says: tuple[str, ...] = ("manifest", "pending")) -> dict:
    """``python -m module args --report R`` with its output streamed into the task log; returns the report
    (``{stage, manifest}``, or ``{stage, pending}`` for a job it submitted and did not wait for; with ``--no-spark``
    ``{stage, needs}`` where the stage needs a Spark session: :func:`read_report`'s ``says``).

    The stage runs in a session of its own: when the task is stopped (``execution_timeout``, ``on_kill``, any
    exception here) its whole process group (torchrun and its ranks, a Spark driver and its workers) gets SIGTERM,
    then SIGKILL after ``kill_grace_s``, and the task fails within that grace period."""
    from pipelines.procs import stop_group

    with tempfile.TemporaryDirectory(prefix="llmp-") as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", module, *args, "--report", report]
        op.log.info("running %s", redacted_cmd(cmd))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMP_HOME": str(project_root()), **(env or {})}
        tail: deque[str] = deque(maxlen=30)
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             cwd=str(project_root()), start_new_session=True)
        op._proc = p
        try:
            for line in p.stdout:  # type: ignore[union-attr]
                line = line.rstrip("\n")
                tail.append(line)
                op.log.info("%s", line)
            p.wait()
        except BaseException:  # a timeout, a kill, an error here: the stage's processes go too, not only the child
            stop_group(p.pid, getattr(op, "kill_grace_s", KILL_GRACE_S))
            p.wait()
            raise
        finally:
            p.stdout.close()  # type: ignore[union-attr]
        failure = exit_failure(module, p.returncode, tail)
        if failure is not None:
            raise failure
        return read_report(report, module, says)


def exit_failure(module: str, code: int, tail: Sequence[str] = ()) -> AirflowException | None:
    """What a stage's exit status fails the task with: ``AirflowFailException`` (no retries) for 2, a retryable
    ``AirflowException`` for 75 (preempted or an infrastructure failure: the retry resumes) and any other
    non-zero status (possibly transient: S3, a submit, MLflow); None for 0."""
    text = "\n".join(tail)
    if code == USER_ERROR:
        return AirflowFailException(f"{module} rejected its input (exit {USER_ERROR}):\n{text}")
    if code == RETRY:
        resumes = "from the newest committed checkpoint" if module.startswith("pipelines.train") else \
            "where this attempt left off (done work is reused)"
        return AirflowException(f"{module} exited {RETRY}: preempted or an infrastructure failure; the task's "
                                f"retry resumes {resumes}:\n{text}")
    if code != 0:
        return AirflowException(f"{module} exited with {code}:\n{text}")
    return None


def asset_extra(manifest_path: str) -> dict:
    """An Asset event's ``extra``: which result it is — the manifest's stage, path and digest, and the manifests it
    was made from (``{stage: path}``)."""
    from pipelines.manifest import lineage, load_manifest

    m = load_manifest(manifest_path)
    return {"stage": m.stage, "manifest": m.path, "digest": m.digest, "lineage": lineage(m.path)}


def unchanged(manifest: str, previous: str | None) -> bool:
    """Whether a DAG's result is the one it started from (an incremental run that found nothing new)."""
    return bool(previous) and os.path.realpath(manifest) == os.path.realpath(previous)


def no_event(manifest: str, previous: str | None = None) -> str:
    """Why a DAG's last task emits no Asset event ('' when it does): the result is the one the run started from, or
    a registration whose version did not take the champion alias."""
    if unchanged(manifest, previous):
        return f"nothing new: {manifest} is the version this run started from; no event"
    from pipelines.manifest import load_manifest

    m = load_manifest(manifest)
    if m.stage == "register" and not m.extra.get("alias_moved"):
        return (f"{m.extra['model_name']} v{m.extra['version']} did not take '{m.extra['alias']}' "
                f"({m.extra['reason']}); no event")
    return ""


def finish(op: BaseOperator, context, manifest: str, links: dict | None = None) -> str:
    op.log.info("manifest: %s", manifest)
    push_links(op, context, manifest, links)
    return manifest


DEFER_MARGIN_S = 300.0  # past the trigger's own bound, Airflow ends the deferral (a triggerer that does not run it)


def deferral(pending: dict, execution_timeout, context, now: float | None = None) -> tuple[dict, Any]:
    """The trigger's arguments and the deferral's timeout for a job the stage submitted: Airflow does not bound a
    deferred task by its ``execution_timeout`` (the task SDK passes only ``defer``'s own timeout to the triggerer),
    so the trigger deletes the job and reports it timed out when the task's ``execution_timeout`` (counted from the
    task's start) is spent, or ``launcher.timeout_minutes`` if that comes first; Airflow's own deferral timeout,
    :data:`DEFER_MARGIN_S` later, ends a deferral whose trigger does not run at all."""
    from datetime import datetime, timedelta

    if execution_timeout is None:
        return pending, None
    now = time.time() if now is None else now
    ti = context.get("ti") if context else None
    start = getattr(ti, "start_date", None)
    began = start.timestamp() if isinstance(start, datetime) else now
    left = max(60.0, execution_timeout.total_seconds() - (now - began))
    started = pending.get("started") or now  # the trigger counts its timeout from the job's submit
    bound = now - started + left
    timeout_s = min(bound, pending["timeout_s"]) if pending.get("timeout_s") else bound
    return {**pending, "started": started, "timeout_s": timeout_s}, timedelta(seconds=left + DEFER_MARGIN_S)


class StageOperator(BaseOperator):
    """Run ``python -m <module> --spec … --set … <stage_args> --report FILE``; return the manifest path.

    A stage that submits a job to Kubernetes (``launcher.kind: trainjob`` or ``pytorchjob``) is run with
    ``LLMP_DETACH=1``: it submits the job and reports it pending, and the task defers to
    :class:`llm_triggers.TrainingJobTrigger`
    (the worker slot is freed; the triggerer polls the job). When the job ends the task resumes and runs the stage
    again, which adopts the finished job, collects its outputs and commits the manifest."""

    template_fields: Sequence[str] = ("spec", "overrides", "stage_args")
    ui_color = "#e8f1fb"
    operator_extra_links = STAGE_LINKS

    def __init__(self, *, module: str, spec: str | None = None, overrides: Sequence[str] = (),
                 stage_args: Sequence[str] = (), deferrable: bool = True, kill_grace_s: float = KILL_GRACE_S,
                 grace_from_spec: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.module = module
        self.spec = spec
        self.overrides = list(overrides)
        self.stage_args = list(stage_args)
        self.deferrable = deferrable
        self.kill_grace_s = kill_grace_s
        # the ranks' preemption checkpoint: at least torchrun's shutdown timeout of the spec the task runs (+ 5 s)
        self.grace_from_spec = grace_from_spec

    def _args(self) -> list[str]:
        return [*spec_cli_args(self.spec, self.overrides), *self.stage_args]

    def _env(self, scratch: str, detach: bool) -> dict[str, str]:
        """The stage's environment on top of this process's: the connections' (their secrets never reach its
        command line) and ``LLMP_DETACH``."""
        from llm_connections import resolve

        from pipelines.spec import SpecError

        try:
            resolved = resolve(self.spec, spec_sets(self.overrides), Path(scratch))
        except SpecError:  # the stage itself rejects the spec, with the key to fix (exit 2: no retries)
            return {"LLMP_DETACH": "1" if detach else "0"}
        if self.grace_from_spec:  # SIGKILL never before torchrun's own shutdown of the ranks is over
            self.kill_grace_s = max(self.kill_grace_s, resolved.spec.train.shutdown_grace_s() + 5.0)
        env = resolved.env
        return {**env, "LLMP_DETACH": "1" if detach else "0"}

    def execute(self, context) -> str:
        with tempfile.TemporaryDirectory(prefix="llmp-conn-") as scratch:
            rep = _run_cli(self, self.module, self._args(), self._env(scratch, self.deferrable))
        if "pending" in rep:
            from llm_triggers import TrainingJobTrigger

            pending, timeout = deferral(rep["pending"], self.execution_timeout, context)
            self.log.info("deferring: the triggerer polls %s", pending)
            self.defer(trigger=TrainingJobTrigger(**pending), method_name="execute_complete", timeout=timeout)
        return finish(self, context, rep["manifest"])

    def execute_complete(self, context, event: dict) -> str:
        """Back from the trigger: a finished job is collected by running the stage again (it adopts the job)."""
        if event.get("state") != "Succeeded":
            raise AirflowException(event.get("message") or f"the job ended {event.get('state')}")
        with tempfile.TemporaryDirectory(prefix="llmp-conn-") as scratch:
            rep = _run_cli(self, self.module, self._args(), self._env(scratch, False))
        return finish(self, context, rep["manifest"])

    def on_kill(self) -> None:
        """The stage's whole process group: SIGTERM, then SIGKILL after ``kill_grace_s``."""
        from pipelines.procs import stop_group

        p = getattr(self, "_proc", None)
        if p is not None:
            stop_group(p.pid, self.kill_grace_s)  # execute() reaps it and reports the signal


def kubernetes_conf(spec) -> dict[str, str]:
    """spark-submit conf for a ``k8s://`` master (:func:`pipelines.data.spark.kubernetes_conf`); a spec that cannot
    run there fails the task with the key to fix."""
    from pipelines.data.spark import kubernetes_conf as conf_of
    from pipelines.spec import SpecError

    try:
        return conf_of(spec)
    except SpecError as e:
        raise AirflowException(str(e)) from None


# what _submit_settings puts in env_vars over a task's own: neither the driver nor the run without Spark sees the
# task's values of these
OPERATOR_ENV = ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "LLMP_HOME", "PATH", "PYTHONWARNINGS", "SPARK_MASTER")


class SparkStageOperator(SparkSubmitOperator):
    """spark-submit a stage module (through ``pipelines/spark_entry.py``) with the Spark connection's master, else
    the job spec's; return its manifest path."""

    template_fields: Sequence[str] = (*SparkSubmitOperator.template_fields, "spec", "overrides", "stage_args")
    ui_color = "#fdf1e6"
    operator_extra_links = (*SparkSubmitOperator.operator_extra_links, SparkUiLink(), MlflowRunLink())

    def __init__(self, *, module: str, spec: str | None = None, overrides: Sequence[str] = (),
                 stage_args: Sequence[str] = (), conn_id: str = "spark_pipeline", **kwargs: Any):
        super().__init__(application=str(_code_root() / "pipelines" / "spark_entry.py"), conn_id=conn_id, **kwargs)
        self.module = module
        self.spec = spec
        self.overrides = list(overrides)
        self.stage_args = list(stage_args)

    def _submit_settings(self, r, tmp: str) -> str:
        """conf, env_vars and --py-files for spark-submit from the resolved spec ``r.spec`` (its master is the Spark
        connection's when that exists); returns the Spark UI's URL (the driver runs here)."""
        from pipelines.data.spark import package_zip

        spec = r.spec
        master = spec.services.spark_master
        self._conn_id = spec.services.spark_conn_id
        if self._conn_id in r.found:
            self.log.info("Spark master from connection %s: %s", self._conn_id, master)
        ui_port = free_port()
        self.conf = {**spec.services.spark_conf, **(self.conf or {}), "spark.pyspark.python": sys.executable,
                     "spark.pyspark.driver.python": sys.executable, "spark.ui.port": str(ui_port),
                     "spark.driver.memory": spec.services.spark_driver_memory}
        if not master.startswith("local"):
            self.py_files = str(package_zip(Path(tmp) / "pipelines.zip"))
        self.conf.update(kubernetes_conf(spec))
        bin_dir = os.path.dirname(sys.executable)
        self.env_vars = {**(self.env_vars or {}), "PYSPARK_PYTHON": sys.executable,
                         "PYSPARK_DRIVER_PYTHON": sys.executable, "LLMP_HOME": str(project_root()),
                         "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                         "PYTHONWARNINGS": "ignore::FutureWarning", "SPARK_MASTER": master}
        if master.startswith("local"):
            self.env_vars.setdefault("SPARK_LOCAL_IP", os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
        host = self.conf.get("spark.driver.host") or self.env_vars.get("SPARK_LOCAL_IP") or "127.0.0.1"
        return f"http://{host}:{ui_port}"

    def submit_env(self, r) -> dict[str, str]:
        """What this task's process environment holds while spark-submit runs, and only then: the connections'
        settings and secrets, which spark-submit and the driver inherit (the provider puts ``env_vars`` on
        spark-submit's command line for Kubernetes masters), and, when no Spark connection exists, the spec's master
        under the connection id the provider's hook reads. A user's own connection is never overwritten."""
        env = dict(r.env)
        if self._conn_id not in r.found:
            env[f"AIRFLOW_CONN_{self._conn_id.upper()}"] = json.dumps({"conn_type": "spark",
                                                                       "host": r.spec.services.spark_master})
        return env

    def execute(self, context) -> str:
        from llm_connections import resolve, scoped_env

        with tempfile.TemporaryDirectory(prefix="llmp-spark-") as tmp:
            r = resolve(self.spec, spec_sets(self.overrides), Path(tmp))
            self._hook = None
            rep = self._without_spark(r)
            if "manifest" in rep:  # committed already, or one that needed no Spark (an empty delta)
                return finish(self, context, rep["manifest"])
            if rep.get("needs") != "spark":
                raise AirflowException(f"{self.module} --no-spark reported {str(rep)[:200]}, neither a manifest nor "
                                       "that it needs Spark")
            report = os.path.join(tmp, "report.json")
            self.application_args = [self.module, *spec_cli_args(self.spec, self.overrides), *self.stage_args,
                                     "--report", report]
            spark_ui = {"spark_ui": self._submit_settings(r, tmp)}
            if context.get("ti") is not None:  # the link works while the stage runs (the driver serves it)
                context["ti"].xcom_push(key="links", value=spark_ui)
            self.log.info("spark-submit to master %s; Spark UI while it runs: %s", r.spec.services.spark_master,
                          spark_ui["spark_ui"])
            # `airflow dags test` and LocalExecutor run later tasks in this process: the environment is put back
            with scoped_env(self.submit_env(r)):
                try:
                    super().execute(context)
                except BaseException as e:  # a timeout or a kill: spark-submit's JVM and its Python workers go too
                    self.on_kill()
                    failure = self._stage_failure(e)
                    if failure is not None:
                        raise failure from None
                    raise
            return finish(self, context, read_report(report)["manifest"], spark_ui)

    def _without_spark(self, r) -> dict:
        """The stage run first with Spark refused (``--no-spark``, :mod:`pipelines.engines`; ~1 s, decontaminate's
        6 s: its key holds the evaluation items): its report names the manifest where the result was committed already
        or needed no Spark, else ``{"needs": "spark"}`` (nothing committed). Its exit status fails the task as a
        stage's does; its environment is the driver's (:meth:`_probe_env`)."""
        if "--no-spark" in self.stage_args:
            raise AirflowFailException(f"{self.module}: --no-spark is the operator's own first run; take it out of "
                                       "stage_args")
        args = [*spec_cli_args(self.spec, self.overrides), *self.stage_args, "--no-spark"]
        return _run_cli(self, self.module, args, self._probe_env(r), says=("manifest", "needs"))

    def _probe_env(self, r) -> dict[str, str]:
        """What the driver here inherits: the connections' environment (``r.env``) and, over it, the task's own
        ``env_vars`` where the provider gives them to spark-submit's process (not on Kubernetes, whose driver
        conf holds them), less the keys the operator sets itself (:data:`OPERATOR_ENV`). A value that is not a
        string fails the task, as it would fail spark-submit's start."""
        if r.spec.services.spark_master.startswith("k8s://"):
            return dict(r.env)
        task = {k: v for k, v in (self.env_vars or {}).items() if k not in OPERATOR_ENV}
        bad = next((k for k, v in task.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise AirflowFailException(f"{self.module}: env_vars[{bad!r}] is a {type(task[bad]).__name__}, not a "
                                       "string: a process environment holds strings only")
        return {**r.env, **task}

    def _stage_failure(self, e: BaseException) -> AirflowException | None:
        """The stage's own exit status through spark-submit (the driver runs here, and spark-submit exits with the
        Python application's status): 2 fails the task at once, 75 is a retry that says so (:func:`exit_failure`),
        as for a stage run by :class:`StageOperator`; None for anything else (the provider's error stands)."""
        sp = getattr(self._hook, "_submit_sp", None) if self._hook is not None else None
        code = sp.poll() if sp is not None else None
        if not isinstance(e, AirflowException) or code not in (USER_ERROR, RETRY):
            return None
        return exit_failure(self.module, code, [str(e)])

    def on_kill(self) -> None:
        """spark-submit and every process under it (the driver JVM, its Python workers): SIGTERM, then SIGKILL after
        the grace period (the provider's own ``on_kill`` also cancels the application on YARN or Kubernetes)."""
        from pipelines.procs import stop_group, stop_tree

        p = getattr(self, "_proc", None)  # the run without Spark, while it runs
        if p is not None and p.poll() is None:
            stop_group(p.pid, KILL_GRACE_S)
        hook = getattr(self, "_hook", None)
        sp = getattr(hook, "_submit_sp", None) if hook is not None else None
        if sp is not None and sp.poll() is None:
            stop_tree(sp.pid, KILL_GRACE_S)
        super().on_kill()


def upstream_manifests(asset: str, source: str, needed: list[str], given: str | None, triggering: list,
                       newest) -> dict[str, str]:
    """{stage: manifest path} for ``needed``, found from one ``source`` manifest: ``given`` (a Param), else the
    ``extra["manifest"]`` of the event that triggered the run, else of the newest event of ``asset``; the
    others by following its inputs (each checked against the digest recorded downstream)."""
    from pipelines.manifest import StageError, lineage

    if given:
        path, how = given, "the param"
    elif triggering:
        path, how = triggering[-1].extra.get("manifest"), "the triggering Asset event"
    else:
        try:
            path, how = newest[-1].extra.get("manifest"), f"the newest '{asset}' Asset event"
        except (IndexError, KeyError):
            raise AirflowFailException(f"no '{asset}' Asset event yet and no {source}_manifest param: run the DAG "
                                       f"that produces '{asset}' first, or trigger with {source}_manifest") from None
    try:
        found = lineage(path)
    except (StageError, FileNotFoundError, TypeError) as e:
        raise AirflowFailException(f"{source} manifest {path!r} from {how}: {e}") from None
    except OSError as e:  # storage failing under a manifest (EIO, ESTALE …) is a retry; a refusal the user's
        from pipelines.storage import oserrors

        if oserrors.storage_failing(e):
            raise AirflowException(f"{source} manifest {path!r} from {how} could not be read now ({e}); the task's "
                                   "retry reads it again") from None
        raise AirflowFailException(f"{source} manifest {path!r} from {how}: {e}") from None
    missing = [s for s in needed if s not in found]
    if missing:
        raise AirflowFailException(f"{path} (from {how}) does not lead to a {', '.join(missing)} manifest")
    print(f"upstream manifests from {how} ({source} {path}): " + ", ".join(f"{s} {found[s]}" for s in needed))
    return {s: found[s] for s in needed}


def redacted_cmd(cmd: Sequence[str]) -> str:
    from pipelines.spec import redact

    return " ".join(redact(a) for a in cmd)


def failure_summary(context) -> None:
    """``on_failure_callback`` and ``on_retry_callback`` (Airflow 3 calls the first only on the final failure): one
    paragraph in the task log that says what failed, whether it will be retried, and where to look."""
    ti, exc = context["ti"], context.get("exception")
    first = str(exc).strip().splitlines()[0] if exc else "unknown error"
    final = getattr(ti, "try_number", 1) > getattr(ti, "max_tries", 0)
    log = context["task"].log if context.get("task") is not None else getattr(ti, "log", None)
    log = log or logging.getLogger("airflow.task")  # (Airflow 3's RuntimeTaskInstance has no .log)
    log.error(
        "STAGE FAILED: task %s of DAG %s (run %s), try %s%s: %s. Stage outputs and manifests live under "
        "%s/var/runs/<stage>/ (nothing partial is published: a stage commits by rename, manifest last); the full "
        "error and the stage's own output are above in this log%s.",
        ti.task_id, ti.dag_id, ti.run_id, getattr(ti, "try_number", "?"), "" if final else " (it will be retried)",
        first, project_root(),
        "; fix the spec or the input and clear the task" if isinstance(exc, AirflowFailException) else "")


class LlmPipelinePlugin(AirflowPlugin):
    """Registers the stage tasks' extra links with the API server (it renders them without the DAG's code)."""

    name = "llm_pipeline"
    operator_extra_links = [*STAGE_LINKS, SparkUiLink()]
