"""A stand-in for a Kubernetes API server with the Kubeflow training operator, for tests on a machine where
no cluster can run (no container engine here: `docker run` has no daemon, so kind/k3d cannot start).

It speaks the real REST paths the ``kubernetes`` Python client uses, so the launcher's client code runs
unchanged over HTTP on 127.0.0.1:

* ``POST/GET/DELETE /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs[/{name}]`` and
  ``/apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs[/{name}]``: a create is validated against the
  CRD's openAPIV3Schema when a CRD file is given for its kind (422 with the errors, as the API server does), a
  second create of the same name is 409;
* ``GET /api/v1/namespaces/{ns}/pods?labelSelector=K=V`` (the job's pods, by the operator's label) and
  ``GET /api/v1/namespaces/{ns}/pods/{pod}/log`` (``timestamps``, ``sinceSeconds``).

With ``tokens`` set it authenticates as the API server does a bearer token: a request whose
``Authorization: Bearer <t>`` names none of them is refused with 401 (counted in ``refused``); a test changes the
set to expire a token, and rewrites the kubeconfig (:meth:`FakeKube.kubeconfig`) to hand out a fresh one, e.g. from
``on_log``, called with each line a job's process prints (so at a point of the job's run, not of the clock).

Its "operator" runs the job's trainer command (a PyTorchJob's Master container, a TrainJob's ``trainer``) as a
local process, with the job's env plus the ``PET_*`` rendezvous variables the operators inject (torchrun reads
them), under the pod name the real operator gives it (``<job>-master-0``; ``<job>-node-0-0-<suffix>`` for a
TrainJob's JobSet), and moves the job's status as the real one does: a PyTorchJob's conditions Created → Running →
Succeeded/Failed with replica counts, a TrainJob's ``jobsStatus`` and its Complete/Failed condition; its pods are
listed with their phase. Only single-node jobs run. With ``unschedulable`` set, a new job's pod stays Pending with
the scheduler's ``PodScheduled=False`` / ``Unschedulable`` condition and that message (no node has the GPUs).
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from pipelines.procs import free_port

JOBS = re.compile(r"^/apis/(?:kubeflow\.org/v1|trainer\.kubeflow\.org/v1alpha1)/namespaces/([^/]+)/"
                  r"(pytorchjobs|trainjobs)(?:/([^/]+))?$")
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
LOG = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$")
KIND = {"pytorchjobs": "PyTorchJob", "trainjobs": "TrainJob"}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _Job:
    def __init__(self, obj: dict):
        self.obj = obj
        name = obj["metadata"]["name"]
        self.trainjob = obj["kind"] == "TrainJob"
        self.pod = f"{name}-node-0-0-x7k2p" if self.trainjob else f"{name}-master-0"
        self.labels = ({"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": "node"}
                       if self.trainjob else {"training.kubeflow.org/job-name": name,
                                              "training.kubeflow.org/replica-type": "master"})
        self.proc: subprocess.Popen | None = None
        self.unscheduled: str | None = None  # the scheduler's message while its pod stays Pending (no node fits)
        self.log: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def condition(self, type_: str, reason: str, message: str, unset: tuple[str, ...] = ()) -> None:
        conds = self.obj.setdefault("status", {}).setdefault("conditions", [])
        for c in conds:
            if c["type"] in unset:
                c["status"] = "False"
        conds.append({"type": type_, "status": "True", "reason": reason, "message": message,
                      "lastTransitionTime": _now()})

    def replicas(self, **counts) -> None:
        if self.trainjob:
            self.obj.setdefault("status", {})["jobsStatus"] = [{"name": "node", **counts}]
        else:
            self.obj.setdefault("status", {})["replicaStatuses"] = {"Master": counts}

    def command_and_env(self) -> tuple[list[str], dict[str, str], str]:
        spec = self.obj["spec"]
        if self.trainjob:
            t = spec["trainer"]
            return t["command"] + t.get("args", []), _values(t.get("env", [])), str(t.get("numProcPerNode", 1))
        c = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
        return c["command"], _values(c.get("env", [])), str(spec.get("nprocPerNode", "1"))

    def pod_obj(self, ns: str) -> dict:
        """The job's pod as the API lists it: Pending with the scheduler's PodScheduled=False condition, else Running
        and then Succeeded/Failed with its process."""
        if self.proc is None:
            status = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                          "reason": "Unschedulable", "message": self.unscheduled}]}
        else:
            code = self.proc.poll()
            status = {"phase": "Running" if code is None else "Succeeded" if code == 0 else "Failed"}
        return {"metadata": {"name": self.pod, "namespace": ns, "labels": self.labels}, "status": status}

    def single_node(self) -> bool:
        spec = self.obj["spec"]
        return spec["trainer"].get("numNodes", 1) == 1 if self.trainjob else "Worker" not in spec["pytorchReplicaSpecs"]

    def end(self, code: int) -> None:
        if self.trainjob:
            self.condition(*(("Complete", "JobSetCompleted", "jobset completed successfully") if code == 0 else
                             ("Failed", "JobSetFailed", f"jobset failed: node exited with code {code}")))
        elif code == 0:
            self.condition("Succeeded", "PyTorchJobSucceeded", "PyTorchJob successfully completed.", ("Running",))
        else:
            self.condition("Failed", "PyTorchJobFailed",
                           f"PyTorchJob has failed because 1 Master replica(s) failed (exit code {code}).", ("Running",))
        self.replicas(**({"succeeded": 1} if code == 0 else {"failed": 1}))


def _values(env: list[dict]) -> dict[str, str]:
    """Plain values; a ``valueFrom`` (an optional secret the cluster would hold) is left out."""
    return {e["name"]: e["value"] for e in env if "value" in e}


class FakeKube:
    def __init__(self, crds: dict[str, Path] | None = None, start_delay_s: float = 0.3):
        self.crds, self.delay = crds or {}, start_delay_s
        self.jobs: dict[tuple[str, str], _Job] = {}
        self.requests: list[tuple[str, str]] = []
        self.tokens: set[str] | None = None  # None: every request is let in
        self.refused = 0
        self.on_log = None  # called with each line a job's process prints
        self.unschedulable: str | None = None  # set: new jobs' pods stay Pending with this scheduler message
        self.pods_forbidden = False  # set: listing pods is refused (403), as for a Role without `list` on pods
        handler = self._handler()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, path: Path, namespace: str = "llm-pipeline", token: str = "fake-token") -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": namespace}}],
        }))
        return path

    def close(self) -> None:
        for job in list(self.jobs.values()):
            self._kill(job)
        self.server.shutdown()

    # the "training operator"
    def _run(self, job: _Job) -> None:
        import time

        time.sleep(self.delay)  # scheduling
        if self.unschedulable is not None:  # no node fits: the pod stays Pending (the job's state says nothing)
            job.unscheduled = self.unschedulable
            return
        if not job.single_node():
            job.condition("Failed", "Unsupported", "the fake operator runs single-node jobs only")
            return
        command, job_env, nproc = job.command_and_env()
        env = {**os.environ, **job_env, "PET_NPROC_PER_NODE": nproc, "PET_NNODES": "1", "PET_NODE_RANK": "0",
               "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_port())}
        with job.lock:
            if job.obj.get("metadata", {}).get("deletionTimestamp"):
                return
            try:
                job.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True, start_new_session=True)
            except OSError as e:  # the image has no such command: the pod fails, as a kubelet reports it
                job.condition("Failed", "StartError", f"container could not start: {e}")
                return
            if not job.trainjob:
                job.condition("Running", "PyTorchJobRunning", "PyTorchJob is running.")
            job.replicas(active=1)
        for line in job.proc.stdout:  # type: ignore[union-attr]
            job.log.append((_now(), line.rstrip("\n")))
            if self.on_log is not None:
                self.on_log(line.rstrip("\n"))
        code = job.proc.wait()
        with job.lock:
            job.end(code)

    def _kill(self, job: _Job) -> None:
        with job.lock:
            job.obj.setdefault("metadata", {})["deletionTimestamp"] = _now()
            if job.proc is not None and job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGTERM)

    def _handler(self):
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, body, ctype: str = "application/json") -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                                  "reason": reason, "message": message})

            def _refused(self) -> bool:
                """401 unless the bearer token is one of ``tokens`` (when set)."""
                auth, tokens = self.headers.get("Authorization", ""), fake.tokens
                if tokens is None or (auth.startswith("Bearer ") and auth[len("Bearer "):] in tokens):
                    return False
                fake.refused += 1
                self._status(401, "Unauthorized", "Unauthorized")
                return True

            def do_POST(self):
                u = urlparse(self.path)
                fake.requests.append(("POST", u.path))
                m = JOBS.match(u.path)
                if not m or m.group(3):
                    return self._status(404, "NotFound", u.path)
                obj = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if self._refused():
                    return None
                ns, name, kind = m.group(1), obj.get("metadata", {}).get("name"), KIND[m.group(2)]
                if obj.get("kind") != kind:
                    return self._status(400, "BadRequest", f"a {obj.get('kind')} posted to {m.group(2)}")
                if fake.crds.get(kind) is not None:
                    from pipelines.launch.k8s import validate_job

                    errs = validate_job(obj, fake.crds[kind])
                    if errs:
                        return self._status(422, "Invalid", f'{kind} "{name}" is invalid: ' + "; ".join(errs))
                if (ns, name) in fake.jobs:
                    return self._status(409, "AlreadyExists", f'{m.group(2)} "{name}" already exists')
                obj["metadata"].update(namespace=ns, uid=f"uid-{len(fake.requests)}", creationTimestamp=_now())
                job = fake.jobs[(ns, name)] = _Job(obj)
                if not job.trainjob:
                    job.condition("Created", "PyTorchJobCreated", f"PyTorchJob {name} is created.")
                threading.Thread(target=fake._run, args=(job,), daemon=True).start()
                self._send(201, obj)

            def do_GET(self):
                u = urlparse(self.path)
                fake.requests.append(("GET", u.path))
                if self._refused():
                    return None
                if (m := JOBS.match(u.path)) and m.group(3):
                    job = fake.jobs.get((m.group(1), m.group(3)))
                    if job is None or KIND[m.group(2)] != job.obj["kind"]:
                        return self._status(404, "NotFound", f'{m.group(2)} "{m.group(3)}" not found')
                    with job.lock:
                        return self._send(200, job.obj)
                if (m := PODS.match(u.path)) and fake.pods_forbidden:
                    return self._status(403, "Forbidden", f'pods is forbidden: cannot list resource "pods" in API '
                                                          f'group "" in the namespace "{m.group(1)}"')
                if m := PODS.match(u.path):
                    key, _, value = parse_qs(u.query).get("labelSelector", ["="])[0].partition("=")
                    pods = [j.pod_obj(ns) for (ns, _), j in list(fake.jobs.items()) if ns == m.group(1)
                            and (j.proc is not None or j.unscheduled is not None) and j.labels.get(key) == value]
                    return self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": pods})
                if m := LOG.match(u.path):
                    job = next((j for (ns, _), j in list(fake.jobs.items()) if ns == m.group(1) and j.pod == m.group(2)),
                               None)
                    if job is None or job.proc is None:
                        return self._status(400, "BadRequest", f'pod "{m.group(2)}" is waiting to start')
                    q = parse_qs(u.query)
                    since = q.get("sinceSeconds", [None])[0]
                    cutoff = "" if since is None else (dt.datetime.now(dt.timezone.utc) - dt.timedelta(
                        seconds=int(since))).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                    stamps = q.get("timestamps", ["false"])[0].lower() in ("true", "1", "t")  # Go's ParseBool
                    lines = [f"{ts} {text}" if stamps else text for ts, text in list(job.log) if ts >= cutoff]
                    return self._send(200, "".join(line + "\n" for line in lines), "text/plain")
                self._status(404, "NotFound", u.path)

            def do_DELETE(self):
                u = urlparse(self.path)
                fake.requests.append(("DELETE", u.path))
                if self._refused():
                    return None
                m = JOBS.match(u.path)
                job = fake.jobs.pop((m.group(1), m.group(3)), None) if m and m.group(3) else None
                if job is None:
                    return self._status(404, "NotFound", u.path)
                fake._kill(job)
                self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

        return H
