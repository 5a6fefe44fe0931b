"""The local stack's executor: Airflow's LocalExecutor that adopts the running tasks of a scheduler that died.

A LocalExecutor task is supervised by one of the scheduler's worker processes, which heartbeats it to the api-server
and reports its end there; the scheduler only hands work out. When a scheduler is killed, the stack's supervisor
(:mod:`pipelines.airflow_ui`) keeps the workers that still supervise a task and stops the idle ones, and the new
scheduler adopts those tasks instead of resetting them: the task runs on, and its try is not spent. A task whose
supervisor died as well stops heartbeating and is failed by the scheduler's heartbeat timeout, as on any executor;
a task that was only queued is reset and queued again.

Used by ``make airflow`` (``AIRFLOW__CORE__EXECUTOR=pipelines.airflow_executor.StackExecutor``); on a cluster the
KubernetesExecutor or CeleryExecutor adopt in their own way.
"""
from __future__ import annotations

import os

from airflow.executors.local_executor import LocalExecutor
from airflow.utils.state import TaskInstanceState


def _running_here(ti) -> bool:
    """Is ``ti``'s task process alive on this host (its worker outlived the scheduler that started it)?"""
    from airflow.utils.net import get_hostname

    if ti.state != TaskInstanceState.RUNNING or not ti.pid or ti.hostname != get_hostname():
        return False
    try:
        os.kill(ti.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StackExecutor(LocalExecutor):
    def try_adopt_task_instances(self, tis):
        """Adopt the running ones whose task process is alive here; return the rest (reset and queued again: a task
        whose worker died with the scheduler is not left to the heartbeat timeout)."""
        return [ti for ti in tis if not _running_here(ti)]
