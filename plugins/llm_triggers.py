"""Triggers: what a deferred task waits on in the triggerer, without holding a worker slot.

``TrainingJobTrigger`` polls a Kubeflow training job, a TrainJob or a PyTorchJob (submitted by the train or
preflight stage with ``LLMP_DETACH=1``), every ``poll_seconds``, logs its state changes and every replica's new log
lines, each with its pod (they reach the task log), and fires once the job has Succeeded or Failed. A job that
outlives ``timeout_s`` is deleted and reported as timed out, one none of whose pods started for ``pending_s``
(``launcher.pending_minutes``) as not started, with the pods' reasons; a deferred task that a user marks failed or
succeeded, or clears, deletes its job (``on_kill``, which Airflow calls only on such a user action, not when a
triggerer restarts). The trigger builds its own Kubernetes clients from the task's kubeconfig / context (or the
triggerer pod's in-cluster identity, which Terraform grants its own read-and-delete Role: infra/terraform/modules/namespaces) and changes no
process-global configuration: the triggerer is shared. The Kubernetes client is synchronous; its calls run in a
thread so the triggerer's event loop never blocks.
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator

try:
    from airflow.triggers.base import BaseTrigger, TriggerEvent
except ImportError:  # pragma: no cover - newer layouts
    from airflow.sdk.bases.trigger import BaseTrigger, TriggerEvent  # type: ignore[no-redef]

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


RECONNECT_S = 60.0  # reading the Kubernetes connection again after a 401/403 (the secrets backend answers)


class TrainingJobTrigger(BaseTrigger):
    def __init__(self, namespace: str, name: str, kind: str = "pytorchjob", poll_seconds: float = 30.0,
                 timeout_s: float | None = None, kubeconfig: str | None = None, kube_context: str | None = None,
                 started: float | None = None, kube_conn_id: str | None = None, pending_s: float | None = None):
        super().__init__()
        self.kube_conn_id = kube_conn_id  # a connection that exists wins over kubeconfig / kube_context
        self.kind, self.namespace, self.name = kind, namespace, name  # kind's default: tasks deferred before TrainJobs
        self.poll_seconds, self.timeout_s = poll_seconds, timeout_s
        self.pending_s = pending_s  # launcher.pending_minutes: none of its pods started for this long → deleted
        self.kubeconfig, self.kube_context = kubeconfig, kube_context
        self.started = started if started is not None else time.time()  # survives a triggerer restart

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("llm_triggers.TrainingJobTrigger",
                {"kind": self.kind, "namespace": self.namespace, "name": self.name, "poll_seconds": self.poll_seconds,
                 "timeout_s": self.timeout_s, "kubeconfig": self.kubeconfig, "kube_context": self.kube_context,
                 "started": self.started, "kube_conn_id": self.kube_conn_id, "pending_s": self.pending_s})

    def _job(self):
        from pipelines.launch import k8s

        return k8s, k8s.KINDS[self.kind]

    async def _target(self, scratch: str) -> tuple[str | None, str | None]:
        """(kubeconfig, context) as the Kubernetes connection says (read here, in the triggerer: the worker's files
        are not here), else the task's kubeconfig / context; a kubeconfig of None: the triggerer's own in-cluster
        identity."""
        from llm_connections import aconnection, kube_env

        kubeconfig, context = self.kubeconfig, self.kube_context
        conn = await aconnection(self.kube_conn_id) if self.kube_conn_id else None
        if conn is not None:  # what the connection names wins; what it leaves out stays the task's
            env = kube_env(conn, Path(scratch))
            if "LLMP_KUBECONFIG" in env:
                kubeconfig = env["LLMP_KUBECONFIG"] or None  # empty: in-cluster, the triggerer's own identity
            context = env.get("LLMP_KUBE_CONTEXT", context)
        return kubeconfig, context

    async def _clients(self, k8s, scratch: str):
        return await asyncio.to_thread(k8s.api_clients_for, *(await self._target(scratch)))

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Follow the job to its end. A 401/403 while following it (a token that expired: EKS's last 15 minutes)
        reads the credentials again (``pipelines.launch.k8s.Session``): the Kubernetes connection first (a user or a
        rotation may have put a new kubeconfig there), then the kubeconfig and its exec plugin, the pod's
        service-account token; a bounded number of times, before the event says Failed (the task's retry starts
        with credentials resolved anew)."""
        k8s, k = self._job()
        loop = asyncio.get_running_loop()
        try:
            with tempfile.TemporaryDirectory(prefix="llmp-trigger-") as scratch:
                target = await self._target(scratch)
                custom, core = await asyncio.to_thread(k8s.api_clients_for, *target)

                def reconnect():  # in the session's thread: the connection is read on the event loop, bounded
                    read = asyncio.run_coroutine_threadsafe(self._target(scratch), loop)
                    try:
                        fresh = read.result(RECONNECT_S)
                    except BaseException:
                        read.cancel()  # not left running on the loop (it writes into the scratch dir)
                        raise
                    return k8s.api_clients_for(*fresh)

                session = k8s.Session(custom, core, reconnect=reconnect, log=self.log.info)
                async for event in self._poll(k8s, k, session):
                    yield event
                    return
        except k8s.JobFailed as e:  # gone, refused (401/403), or the API did not answer: one line, the task fails
            yield TriggerEvent({"state": "Failed", "namespace": self.namespace, "name": self.name, "message": str(e)})

    async def _poll(self, k8s, k, session) -> AsyncIterator[TriggerEvent]:
        ns, name = self.namespace, self.name
        logs = k8s.ReplicaLogs(session.core, k, ns, name, window_s=int(self.poll_seconds * 3) + 30)
        session.on_renew.append(logs.use)
        start = k8s.StartBound(self.pending_s)  # (from the pods' creation: a triggerer restart goes on counting)
        last = None
        while True:
            obj = await asyncio.to_thread(session.get, k, ns, name)
            state, msg = k8s.job_state(obj)
            line = k8s.state_line(obj)
            if line != last:
                self.log.info("%s %s/%s: %s", k.name, ns, name, line)
                last = line
            for out in await asyncio.to_thread(logs.poll):
                self.log.info("%s", out)
            for why in start.update(state, logs.listed):
                self.log.info("%s %s/%s: waiting to start: %s", k.name, ns, name, why)
            if state in ("Succeeded", "Failed"):
                errors = "; ".join(logs.errors())
                yield TriggerEvent({"state": state, "namespace": ns, "name": name,
                                    "message": f"{k.kind} {ns}/{name} {state.lower()}: {msg or 'no message'}"
                                               + (f"; errors in the pods' logs: {errors}" if errors else "")})
                return
            if self.timeout_s is not None and time.time() - self.started > self.timeout_s:
                await asyncio.to_thread(k8s.delete, session.custom, k, ns, name)
                yield TriggerEvent({"state": "TimedOut", "namespace": ns, "name": name,
                                    "message": f"{k.kind} {ns}/{name} did not finish within {self.timeout_s:g} s; "
                                               "it was deleted"})
                return
            if start.expired():
                await asyncio.to_thread(k8s.delete, session.custom, k, ns, name)
                yield TriggerEvent({"state": "NotStarted", "namespace": ns, "name": name,
                                    "message": start.message(k, ns, name)})
                return
            await asyncio.sleep(self.poll_seconds)

    async def on_kill(self) -> None:
        """The user marked the deferred task failed or succeeded, or cleared it: its job must not run on."""
        k8s, k = self._job()
        with tempfile.TemporaryDirectory(prefix="llmp-trigger-") as scratch:
            custom, _ = await self._clients(k8s, scratch)
        self.log.info("%s %s/%s: the task was stopped by a user: deleting the job", k.name, self.namespace, self.name)
        await asyncio.to_thread(k8s.delete, custom, k, self.namespace, self.name)


PyTorchJobTrigger = TrainingJobTrigger  # the classpath tasks deferred by an earlier version stored
