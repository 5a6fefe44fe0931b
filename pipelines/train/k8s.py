"""Kubernetes launch: the job spec as a Kubeflow ``PyTorchJob`` (kubeflow.org/v1), submitted and watched.

:func:`render_pytorchjob` turns the spec's ``launcher`` (nodes, processes per node, image, EFA, shared
filesystem, node selector, elastic range) into one manifest: a Master and ``nnodes − 1`` Workers that
each run ``torchrun -m <module>`` (the trainer or the preflight; the training operator passes the
rendezvous to torchrun through ``PET_*`` variables), with GPU and EFA limits, the shared-FS claim
mounted at ``launcher.shared_fs_mount`` (the L1 checkpoint tier, and where run.root lives), a
memory-backed ``/dev/shm`` for NCCL, and NCCL/EFA environment.
:func:`validate_pytorchjob` checks a manifest against the ``openAPIV3Schema`` of the operator's CRD
(``kubeflow.org_pytorchjobs.yaml``), plus what the schema cannot say (the container must be named
``pytorch``; replicas must add up to the spec's nodes).
:func:`run_pytorchjob` submits it with the kubernetes client (a job of the same name left by an
earlier try is adopted while it runs or has succeeded, replaced when it failed), polls it every
``launcher.poll_seconds`` to a terminal condition, printing each state change (conditions and
replica counts) and the master pod's new log lines (so they reach the Airflow task log), and deletes
the job on timeout, SIGTERM (Airflow's kill) or Ctrl-C.

With node-local L0 (``checkpoint.l0`` an absolute path outside the shared mount) every pod also mounts its
host's own disk there (``launcher.node_local_path``, or an ``emptyDir`` on the instance-store NVMe).

    python -m pipelines.train.k8s SPEC.yaml --tokenize-manifest M [--run-id ID] [--crd CRD.yaml]
    # prints the PyTorchJob the train stage would submit for these inputs (YAML)
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from pipelines.spec import JobSpec, SpecError, load_spec

NCCL_ENV = {
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
}
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_PROTO": "simple"}


def job_name(spec: JobSpec, run_id: str) -> str:
    """A DNS-1123 name (≤ 63 chars) from the run name and id."""
    base = re.sub(r"[^a-z0-9-]+", "-", f"{spec.run.name}-{run_id}".lower()).strip("-")
    return base[:63].rstrip("-")


def node_local_l0(spec: JobSpec) -> bool:
    """checkpoint.l0 is each host's own disk: an absolute path outside the shared filesystem's mount."""
    l0, mount = Path(spec.checkpoint.l0), Path(spec.launcher.shared_fs_mount)
    return l0.is_absolute() and l0 != mount and mount not in l0.parents


MLFLOW_CLIENT_SECRET = "mlflow-client"  # infra/terraform/modules/metadata: kubernetes_secret_v1.mlflow_client


def render_pytorchjob(spec: JobSpec, run_id: str, trainer_args: list[str],
                      module: str = "pipelines.train.trainer", extra_env: dict[str, str] | None = None) -> dict:
    L = spec.launcher
    gpus = L.nproc_per_node
    env = {**NCCL_ENV, **(EFA_ENV if L.efa_per_node else {}), "OMP_NUM_THREADS": str(L.threads_per_proc),
           "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    limits = {"nvidia.com/gpu": gpus}
    if L.efa_per_node:
        limits["vpc.amazonaws.com/efa"] = L.efa_per_node
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if L.shared_fs_claim:
        mounts.append({"name": "shared-fs", "mountPath": L.shared_fs_mount})
        volumes.append({"name": "shared-fs", "persistentVolumeClaim": {"claimName": L.shared_fs_claim}})
    if node_local_l0(spec):
        mounts.append({"name": "node-local", "mountPath": spec.checkpoint.l0})
        volumes.append({"name": "node-local", **({"hostPath": {"path": L.node_local_path, "type": "DirectoryOrCreate"}}
                                                 if L.node_local_path else {"emptyDir": {}})})
    container = {
        "name": "pytorch",  # the training operator finds the container by this name
        "image": L.image,
        "command": ["torchrun", "--max-restarts", str(L.max_restarts), "-m", module, *trainer_args],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        # the MLflow login (MLFLOW_TRACKING_USERNAME / _PASSWORD) the cluster's Terraform puts in the namespace;
        # optional, so a cluster without MLflow authentication runs the same job
        "envFrom": [{"secretRef": {"name": MLFLOW_CLIENT_SECRET, "optional": True}}],
        "resources": {"limits": limits, "requests": dict(limits)},
        "volumeMounts": mounts,
    }
    template = {"metadata": {"labels": {"app.kubernetes.io/name": "llm-pipeline-trainer",
                                        "llm-pipeline/run": job_name(spec, run_id)}},
                "spec": {"containers": [container], "volumes": volumes, "nodeSelector": dict(L.node_selector),
                         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}
    if L.service_account:
        template["spec"]["serviceAccountName"] = L.service_account
    specs = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if L.nnodes > 1:
        specs["Worker"] = {"replicas": L.nnodes - 1, "restartPolicy": "OnFailure", "template": copy.deepcopy(template)}
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job_name(spec, run_id), "namespace": L.namespace,
                     "labels": {"app.kubernetes.io/part-of": "llm-pipeline"}},
        "spec": {
            "nprocPerNode": str(gpus),
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": L.max_restarts},
            "pytorchReplicaSpecs": specs,
        },
    }
    if L.min_nodes is not None and L.min_nodes < L.nnodes:
        job["spec"]["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": L.min_nodes, "maxReplicas": L.nnodes,
                                        "maxRestarts": L.max_restarts, "nProcPerNode": gpus}
    return job


def stage_job(spec: JobSpec, run_id: str, module: str, args: list[str]) -> dict:
    """The job a stage submits: the pods resolve relative spec paths against this project's home, as here."""
    from pipelines.spec import project_home

    return render_pytorchjob(spec, run_id, args, module, extra_env={"LLMP_HOME": str(project_home())})


def crd_schema(crd_path: Path, version: str = "v1") -> dict:
    crd = yaml.safe_load(Path(crd_path).read_text())
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise ValueError(f"{crd_path} has no version {version}")


def validate_pytorchjob(job: dict, crd_path: Path, spec: JobSpec | None = None) -> list[str]:
    """Errors (empty when valid): the CRD's schema, then the operator's own expectations."""
    import jsonschema

    v = jsonschema.Draft7Validator(crd_schema(crd_path))
    errors = [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
              for e in sorted(v.iter_errors(job), key=lambda e: list(e.absolute_path))]
    for role, rs in job.get("spec", {}).get("pytorchReplicaSpecs", {}).items():
        names = [c.get("name") for c in rs.get("template", {}).get("spec", {}).get("containers", [])]
        if "pytorch" not in names:
            errors.append(f"spec.pytorchReplicaSpecs.{role}: no container named 'pytorch' (the operator needs it)")
    if spec is not None:
        total = sum(r for r in (rs.get("replicas", 0) for rs in job["spec"]["pytorchReplicaSpecs"].values())
                    if isinstance(r, int))
        if total != spec.launcher.nnodes:
            errors.append(f"replicas add up to {total} nodes, the spec asks for launcher.nnodes={spec.launcher.nnodes}")
    return errors


GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"


class JobFailed(RuntimeError):
    """The PyTorchJob was rejected, failed, or did not finish in time; the message says which and why."""


def api_clients(spec: JobSpec):
    """(CustomObjectsApi, CoreV1Api) from ``launcher.kubeconfig``/``kube_context``, or in-cluster credentials."""
    return api_clients_for(spec.launcher.kubeconfig, spec.launcher.kube_context)


def api_clients_for(kubeconfig: str | None, kube_context: str | None):
    from kubernetes import client, config

    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        try:
            config.load_kube_config(config_file=os.path.expanduser(kubeconfig) if kubeconfig else None,
                                    context=kube_context)
        except (config.ConfigException, OSError) as e:
            raise JobFailed(f"cannot load Kubernetes credentials ({e}); set launcher.kubeconfig (and "
                            "launcher.kube_context), or run inside the cluster") from None
    return client.CustomObjectsApi(), client.CoreV1Api()


def job_state(obj: dict) -> tuple[str, str]:
    """(state, message) from the job's conditions: Succeeded/Failed win, else the newest true condition,
    else Pending."""
    true = [c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    for terminal in ("Failed", "Succeeded"):
        for c in true:
            if c.get("type") == terminal:
                return terminal, c.get("message", "")
    if not true:
        return "Pending", ""
    return true[-1].get("type", "Unknown"), true[-1].get("message", "")


def _replicas(obj: dict) -> str:
    rs = (obj.get("status") or {}).get("replicaStatuses") or {}
    parts = []
    for role, st in sorted(rs.items()):
        counts = ", ".join(f"{k} {st[k]}" for k in ("active", "succeeded", "failed") if st.get(k))
        parts.append(f"{role}: {counts or '-'}")
    return "; ".join(parts)


def state_line(obj: dict) -> str:
    """The job's state, replica counts and message, as logged on each change."""
    state, msg = job_state(obj)
    return f"{state}" + (f" [{_replicas(obj)}]" if _replicas(obj) else "") + (f": {msg}" if msg else "")


def _api_error(e) -> str:
    import json

    try:
        return json.loads(e.body).get("message") or str(e.body)
    except (TypeError, ValueError, AttributeError):
        return str(getattr(e, "body", "") or e)


def submit(custom, job: dict, log: Callable[[str], None] = print) -> str:
    """Create the job; returns 'created', 'adopted' (same name, still running or succeeded) or 'replaced'."""
    from kubernetes.client.exceptions import ApiException

    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    try:
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job)
        log(f"pytorchjob {ns}/{name}: submitted")
        return "created"
    except ApiException as e:
        if e.status != 409:
            raise JobFailed(f"the API server refused PyTorchJob {ns}/{name} ({e.status} {e.reason}): "
                            f"{_api_error(e)}") from None
    existing = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    state, _ = job_state(existing)
    same = _commands(existing) == _commands(job)
    if same and state != "Failed":
        log(f"pytorchjob {ns}/{name}: already exists ({state}) with the same command, following it")
        return "adopted"
    if state not in ("Failed", "Succeeded"):
        raise JobFailed(f"PyTorchJob {ns}/{name} from an earlier try is still {state} with another command; wait "
                        f"for it or delete it (kubectl delete pytorchjob -n {ns} {name})")
    log(f"pytorchjob {ns}/{name}: replacing the earlier {state} job")
    delete(custom, ns, name, wait_s=120)
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job)
    return "replaced"


def _commands(job: dict) -> list:
    specs = (job.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    return [c.get("command") for _, rs in sorted(specs.items())
            for c in rs.get("template", {}).get("spec", {}).get("containers", [])]


def delete(custom, ns: str, name: str, wait_s: float = 0) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name,
                                               body={"propagationPolicy": "Foreground"})
    except ApiException as e:
        if e.status != 404:
            raise
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return
            raise
        time.sleep(1)


_EXC = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception|Diverged)\b: .*$")


class LogFollower:
    """New lines of the master pod's ``pytorch`` container since the last poll. Lines carry the kubelet's
    timestamps; those at or before the newest one already shown are skipped (counting equal stamps)."""

    def __init__(self, core, ns: str, pod: str, window_s: int):
        self.core, self.ns, self.pod, self.window = core, ns, pod, window_s
        self.last_ts, self.n_at_last = "", 0
        self.tail: list[str] = []

    def poll(self) -> list[str]:
        from kubernetes.client.exceptions import ApiException

        try:  # raw bytes: with content preloading the client hands back str(bytes) for a non-JSON body
            resp = self.core.read_namespaced_pod_log(self.pod, self.ns, container="pytorch", timestamps=True,
                                                     since_seconds=self.window, _preload_content=False)
            text = resp.data.decode("utf-8", "replace")
        except ApiException:  # not started yet, or gone
            return []
        new, k, prev = [], 0, None
        for line in (text or "").splitlines():
            ts, _, rest = line.partition(" ")
            k = k + 1 if ts == prev else 0
            prev = ts
            if ts < self.last_ts or (ts == self.last_ts and k < self.n_at_last):
                continue
            if ts == self.last_ts:
                self.n_at_last += 1
            else:
                self.last_ts, self.n_at_last = ts, 1
            new.append(rest)
        self.tail = (self.tail + new)[-400:]
        return new

    def errors(self) -> list[str]:
        """Distinct exception lines the ranks printed (torchrun's own ChildFailedError left out)."""
        seen: list[str] = []
        for line in self.tail:
            m = _EXC.search(line)
            if m and "ChildFailedError" not in line and m.group(0) not in seen:
                seen.append(m.group(0))
        return seen[-5:]


def watch(custom, core, ns: str, name: str, poll_s: float, timeout_s: float | None,
          log: Callable[[str], None] = print) -> dict:
    """Poll to Succeeded (returns the job) or Failed/timeout (raises :class:`JobFailed`)."""
    follower = LogFollower(core, ns, f"{name}-master-0", window_s=int(poll_s * 3) + 30)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last = None
    while True:
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        state, msg = job_state(obj)
        line = state_line(obj)
        if line != last:
            log(f"pytorchjob {ns}/{name}: {line}")
            last = line
        for out in follower.poll():
            log(f"[{name}-master-0] {out}")
        if state == "Succeeded":
            return obj
        if state == "Failed":
            errs = follower.errors()
            raise JobFailed(f"PyTorchJob {ns}/{name} failed: {msg or 'no message'}"
                            + (f"\nerrors in the master pod's log:\n  " + "\n  ".join(errs) if errs else "")
                            + "\nlast master log lines:\n" + "\n".join(follower.tail[-15:]))
        if deadline is not None and time.monotonic() > deadline:
            delete(custom, ns, name)
            raise JobFailed(f"PyTorchJob {ns}/{name} did not finish within launcher.timeout_minutes="
                            f"{timeout_s / 60:g}; it was deleted")
        time.sleep(poll_s)


def run_pytorchjob(spec: JobSpec, run_id: str, module: str, args: list[str],
                   log: Callable[[str], None] = print, detach: bool = False) -> dict:
    """Render, submit and watch one PyTorchJob running ``torchrun -m module args``; the job is deleted
    when this process is told to stop (SIGTERM from Airflow, Ctrl-C) or times out. With ``detach`` a job that
    has not finished yet raises :class:`pipelines.manifest.Pending` with what a poller needs (a deferrable
    Airflow task waits in the triggerer, then calls this again, which adopts the finished job)."""
    job = stage_job(spec, run_id, module, args)
    custom, core = api_clients(spec)
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    submit(custom, job, log)
    if detach and job_state(custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name))[0] not in (
            "Succeeded", "Failed"):
        from pipelines.manifest import Pending

        L, t = spec.launcher, spec.launcher.timeout_minutes
        raise Pending({"namespace": ns, "name": name, "poll_seconds": L.poll_seconds,
                       "timeout_s": None if t is None else t * 60, "kubeconfig": L.kubeconfig,
                       "kube_context": L.kube_context})

    def _term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, _term) if _in_main_thread() else None
    try:
        t = spec.launcher.timeout_minutes
        return watch(custom, core, ns, name, spec.launcher.poll_seconds, None if t is None else t * 60, log)
    except KeyboardInterrupt:
        log(f"pytorchjob {ns}/{name}: stopping: deleting the job")
        delete(custom, ns, name)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.train.k8s",
                                 description="Print the Kubeflow PyTorchJob that the train stage would submit for a "
                                 "job spec and a tokenize manifest (same trainer arguments, same name); validate it "
                                 "against the CRD.")
    ap.add_argument("spec", help="Job spec YAML (launcher.* as for launcher.kind kubernetes).")
    ap.add_argument("--tokenize-manifest", required=True, help="The tokenize stage's manifest.json (the train input).")
    ap.add_argument("--run-id", default=None, help="Run id in the job's name (default: the train stage's, "
                                                   "train-<stage key>).")
    ap.add_argument("--crd", default=None, help="PyTorchJob CRD YAML to validate against (e.g. the training "
                                                 "operator's manifests/base/crds/kubeflow.org_pytorchjobs.yaml).")
    args = ap.parse_args(argv)
    from pipelines.manifest import load_manifest
    from pipelines.train.launch import TrainError, train_job

    try:
        spec = load_spec(args.spec)
        spec.launcher.kind = "kubernetes"
        job = train_job(spec, load_manifest(args.tokenize_manifest))
    except (SpecError, TrainError, FileNotFoundError) as e:
        print(f"k8s: error: {e}", file=sys.stderr)
        return 2
    rendered = stage_job(spec, args.run_id or job.run_id, "pipelines.train.trainer", job.args)
    if args.crd:
        errs = validate_pytorchjob(rendered, Path(args.crd), spec)
        if errs:
            print("k8s: invalid PyTorchJob:\n  " + "\n  ".join(errs), file=sys.stderr)
            return 1
    print(yaml.safe_dump(rendered, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
