"""A stand-in for a Kubernetes API server with the Kubeflow training operator, for tests on a machine where
no cluster can run (no container engine here: `docker run` has no daemon, so kind/k3d cannot start).

It speaks the real REST paths the ``kubernetes`` Python client uses, so the launcher's client code runs
unchanged over HTTP on 127.0.0.1:

* ``POST/GET/DELETE /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs[/{name}]``: a create is validated
  against the CRD's openAPIV3Schema when a CRD file is given (422 with the errors, as the API server
  does), a second create of the same name is 409;
* ``GET /api/v1/namespaces/{ns}/pods/{name}-master-0/log`` (``timestamps``, ``sinceSeconds``).

Its "operator" runs the Master replica's container command as a local process, with the container's
env plus the ``PET_*`` rendezvous variables the training operator injects (torchrun reads them), and
moves the job's conditions Created → Running → Succeeded/Failed with replica counts. Only
single-node jobs (no Worker replicas) run.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

JOBS = re.compile(r"^/apis/kubeflow\.org/v1/namespaces/([^/]+)/pytorchjobs(?:/([^/]+))?$")
LOG = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Job:
    def __init__(self, obj: dict):
        self.obj = obj
        self.proc: subprocess.Popen | None = None
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
        self.obj.setdefault("status", {})["replicaStatuses"] = {"Master": counts}


class FakeKube:
    def __init__(self, crd: Path | None = None, start_delay_s: float = 0.3):
        self.crd, self.delay = crd, start_delay_s
        self.jobs: dict[tuple[str, str], _Job] = {}
        self.requests: list[tuple[str, str]] = []
        handler = self._handler()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, path: Path, namespace: str = "llm-pipeline") -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "fake-token"}}],
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
        spec = job.obj["spec"]
        if "Worker" in spec["pytorchReplicaSpecs"]:
            job.condition("Failed", "Unsupported", "the fake operator runs single-node jobs only")
            return
        c = spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
        env = {**os.environ, **{e["name"]: e["value"] for e in c.get("env", [])},
               "PET_NPROC_PER_NODE": str(spec.get("nprocPerNode", "1")), "PET_NNODES": "1", "PET_NODE_RANK": "0",
               "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(_free_port())}
        with job.lock:
            if job.obj.get("metadata", {}).get("deletionTimestamp"):
                return
            job.proc = subprocess.Popen(c["command"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
            job.condition("Running", "PyTorchJobRunning", "PyTorchJob is running.")
            job.replicas(active=1)
        for line in job.proc.stdout:  # type: ignore[union-attr]
            job.log.append((_now(), line.rstrip("\n")))
        code = job.proc.wait()
        with job.lock:
            if code == 0:
                job.condition("Succeeded", "PyTorchJobSucceeded", "PyTorchJob successfully completed.", ("Running",))
                job.replicas(succeeded=1)
            else:
                job.condition("Failed", "PyTorchJobFailed",
                              f"PyTorchJob has failed because 1 Master replica(s) failed (exit code {code}).",
                              ("Running",))
                job.replicas(failed=1)

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

            def do_POST(self):
                u = urlparse(self.path)
                fake.requests.append(("POST", u.path))
                m = JOBS.match(u.path)
                if not m or m.group(2):
                    return self._status(404, "NotFound", u.path)
                obj = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                ns, name = m.group(1), obj.get("metadata", {}).get("name")
                if fake.crd is not None:
                    from pipelines.train.k8s import validate_pytorchjob

                    errs = validate_pytorchjob(obj, fake.crd)
                    if errs:
                        return self._status(422, "Invalid", f'PyTorchJob.kubeflow.org "{name}" is invalid: '
                                            + "; ".join(errs))
                if (ns, name) in fake.jobs:
                    return self._status(409, "AlreadyExists", f'pytorchjobs.kubeflow.org "{name}" already exists')
                obj["metadata"].update(namespace=ns, uid=f"uid-{len(fake.requests)}", creationTimestamp=_now())
                job = fake.jobs[(ns, name)] = _Job(obj)
                job.condition("Created", "PyTorchJobCreated", f"PyTorchJob {name} is created.")
                threading.Thread(target=fake._run, args=(job,), daemon=True).start()
                self._send(201, obj)

            def do_GET(self):
                u = urlparse(self.path)
                fake.requests.append(("GET", u.path))
                if (m := JOBS.match(u.path)) and m.group(2):
                    job = fake.jobs.get((m.group(1), m.group(2)))
                    if job is None:
                        return self._status(404, "NotFound", f'pytorchjobs.kubeflow.org "{m.group(2)}" not found')
                    with job.lock:
                        return self._send(200, job.obj)
                if m := LOG.match(u.path):
                    name = m.group(2).removesuffix("-master-0")
                    job = fake.jobs.get((m.group(1), name))
                    if job is None or job.proc is None:
                        return self._status(400, "BadRequest", f'container "pytorch" in pod "{m.group(2)}" is '
                                            "waiting to start")
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
                m = JOBS.match(u.path)
                job = fake.jobs.pop((m.group(1), m.group(2)), None) if m and m.group(2) else None
                if job is None:
                    return self._status(404, "NotFound", u.path)
                fake._kill(job)
                self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

        return H
