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

from airflow.executors.local_executor import LocalExecutor
from airflow.utils.state import TaskInstanceState

from pipelines.procs import start_time, started_at, state


def _running_here(ti) -> bool:
    """Is ``ti``'s task process alive on this host (its worker outlived the scheduler that started it)? The process
    must have started before the task did (a task process reports its start once it runs): a later process holds a
    pid the task's process left behind, and is not adopted."""
    from airflow.utils.net import get_hostname

    if ti.state != TaskInstanceState.RUNNING or not ti.pid or ti.hostname != get_hostname() or ti.start_date is None:
        return False
    began = started_at(ti.pid)  # wall clock here, to compare with the API's record of the start
    return began is not None and began <= ti.start_date.timestamp() + START_SLACK_S and \
        _alive(ti.pid, start_time(ti.pid))


START_SLACK_S = 30.0  # clocks and the task's start report: the process starts first, the API records it after


def _alive(pid: int, ticks: int | None) -> bool:
    """``pid`` is alive (not a zombie) and is still the process that started ``ticks`` after boot (its start ticks:
    a wall-clock start time moves when the clock is stepped, an NTP correction, and the task would lose its slot)."""
    return ticks is not None and state(pid) not in (None, "Z") and start_time(pid) == ticks


class StackExecutor(LocalExecutor):
    """Adopted tasks hold executor slots (``running``) until their process ends, so the executor never runs more
    than ``parallelism`` tasks at once, adopted ones included."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.adopted: dict = {}  # task instance key → (the pid of its task process, its start ticks)

    def try_adopt_task_instances(self, tis):
        """Adopt the running ones whose task process is alive here; return the rest (reset and queued again: a task
        whose worker died with the scheduler is not left to the heartbeat timeout)."""
        rest = []
        for ti in tis:
            if _running_here(ti):
                self.adopted[ti.key] = (ti.pid, start_time(ti.pid))
                self.running.add(ti.key)
            else:
                rest.append(ti)
        return rest

    def release_adopted(self) -> None:
        """Free the slot of each adopted task whose process has ended (its worker reported the end to the API)."""
        for key, (pid, ticks) in list(self.adopted.items()):
            if not _alive(pid, ticks):
                del self.adopted[key]
                self.running.discard(key)

    def sync(self) -> None:
        super().sync()
        self.release_adopted()
