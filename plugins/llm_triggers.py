"""Triggers: what a deferred task waits on in the triggerer, without holding a worker slot.

``PyTorchJobTrigger`` polls a Kubeflow PyTorchJob (submitted by the train or preflight stage with
``LLMP_DETACH=1``) every ``poll_seconds``, logs its state changes and the master pod's new log lines (they reach
the task log), and fires once the job has Succeeded or Failed. A job that outlives ``timeout_s`` is deleted and
reported as timed out. The Kubernetes client is synchronous; its calls run in a thread so the triggerer's event
loop never blocks.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator

try:
    from airflow.triggers.base import BaseTrigger, TriggerEvent
except ImportError:  # pragma: no cover - newer layouts
    from airflow.sdk.bases.trigger import BaseTrigger, TriggerEvent  # type: ignore[no-redef]

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class PyTorchJobTrigger(BaseTrigger):
    def __init__(self, namespace: str, name: str, poll_seconds: float = 30.0, timeout_s: float | None = None,
                 kubeconfig: str | None = None, kube_context: str | None = None, started: float | None = None):
        super().__init__()
        self.namespace, self.name = namespace, name
        self.poll_seconds, self.timeout_s = poll_seconds, timeout_s
        self.kubeconfig, self.kube_context = kubeconfig, kube_context
        self.started = started if started is not None else time.time()  # survives a triggerer restart

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("llm_triggers.PyTorchJobTrigger",
                {"namespace": self.namespace, "name": self.name, "poll_seconds": self.poll_seconds,
                 "timeout_s": self.timeout_s, "kubeconfig": self.kubeconfig, "kube_context": self.kube_context,
                 "started": self.started})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from pipelines.train import k8s

        custom, core = await asyncio.to_thread(k8s.api_clients_for, self.kubeconfig, self.kube_context)
        ns, name = self.namespace, self.name
        follower = k8s.LogFollower(core, ns, f"{name}-master-0", window_s=int(self.poll_seconds * 3) + 30)
        last = None
        while True:
            obj = await asyncio.to_thread(custom.get_namespaced_custom_object, k8s.GROUP, k8s.VERSION, ns,
                                          k8s.PLURAL, name)
            state, msg = k8s.job_state(obj)
            line = k8s.state_line(obj)
            if line != last:
                self.log.info("pytorchjob %s/%s: %s", ns, name, line)
                last = line
            for out in await asyncio.to_thread(follower.poll):
                self.log.info("[%s-master-0] %s", name, out)
            if state in ("Succeeded", "Failed"):
                errors = "; ".join(follower.errors())
                yield TriggerEvent({"state": state, "namespace": ns, "name": name,
                                    "message": f"PyTorchJob {ns}/{name} {state.lower()}: {msg or 'no message'}"
                                               + (f"; errors in the master pod's log: {errors}" if errors else "")})
                return
            if self.timeout_s is not None and time.time() - self.started > self.timeout_s:
                await asyncio.to_thread(k8s.delete, custom, ns, name)
                yield TriggerEvent({"state": "TimedOut", "namespace": ns, "name": name,
                                    "message": f"PyTorchJob {ns}/{name} did not finish within {self.timeout_s:g} s; "
                                               "it was deleted"})
                return
            await asyncio.sleep(self.poll_seconds)
