"""Kubernetes launch: the job spec as a Kubeflow training job, checked as the cluster will check it, submitted and
watched.

``launcher.kind`` is ``local`` by default (torchrun here, not this module). On Kubernetes it picks one of two job
APIs: ``trainjob`` (the default Kubernetes kind; ``kubernetes`` means it), a Kubeflow Trainer v2 ``TrainJob``
(trainer.kubeflow.org/v1alpha1) on the ``torch-distributed`` ClusterTrainingRuntime; or ``pytorchjob``, a
training-operator v1 ``PyTorchJob`` (kubeflow.org/v1, in maintenance; it keeps the elastic range). Both come from
one :class:`PodParts` (:func:`pod_parts`): ``nnodes`` nodes that each run ``torchrun -m <module>`` (the trainer or
the preflight; the operator passes the rendezvous to torchrun through ``PET_*`` variables), with GPU and EFA
limits, the shared-FS claim mounted at ``launcher.shared_fs_mount`` (the L1 checkpoint tier, and where run.root
lives), a memory-backed ``/dev/shm`` for NCCL, and NCCL/EFA environment. :func:`job_name` is a DNS-1035 label.
:func:`validate_job` / :func:`check_job` say what the cluster would refuse (:mod:`pipelines.launch.admission`: the
CRD's schema and CEL rules, the operator's admission webhook) and what this launcher needs; :func:`run_job` checks
the job so, then submits it with the kubernetes client (a job of the same name left by an earlier try is adopted
while it runs; a finished one is collected once, then replaced: :func:`submit`, :class:`JobRecord`), polls it every
``launcher.poll_seconds`` to a terminal condition, printing each state change (conditions and replica counts) and
every replica's new log lines, each with its pod (so they reach the Airflow task log), and deletes the job on
timeout, SIGTERM (Airflow's kill) or Ctrl-C. API clients are built per call from the kubeconfig / context /
in-cluster identity (nothing global), and built again when the API refuses them during a watch (:class:`Session`).

With node-local L0 (``checkpoint.l0`` an absolute path outside the shared mount) every pod also mounts its
host's own disk there (``launcher.node_local_path``, or an ``emptyDir`` on the instance-store NVMe).

    python -m pipelines.train.k8s SPEC.yaml --tokenize-manifest M [--run-id ID] [--set launcher.kind=pytorchjob]
    # prints the TrainJob (or PyTorchJob) the train stage would submit for these inputs (YAML); exit 2 with one
    # line per rule (field, message, rule) when the cluster would refuse it
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from urllib3.exceptions import HTTPError


from pipelines.launch import outcomes as exit_codes, outcomes as xc
from pipelines.launch.admission import refusals
from pipelines.manifest import Pending, atomic_write_text, read_small_text
from pipelines.spec import JobSpec, project_home

NCCL_ENV = {
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
}
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_PROTO": "simple"}


NAME_LIMIT = 50  # a TrainJob's JobSet names pods and hostnames <name>-node-<i>-<j>, a PyTorchJob's operator its
# Services <name>-worker-<i>: each must stay a DNS-1035 label of ≤ 63 characters


def job_name(spec: JobSpec, run_id: str) -> str:
    """A DNS-1035 label from the run name and id, as the TrainJob CRD's CEL rule and training-operator's webhook
    require: lowercase, ``[a-z0-9-]`` only, starting with a letter (``r-`` put before a name that does not), at
    most :data:`NAME_LIMIT` characters; a longer one is cut and ends with a digest of the whole, so two runs whose
    names differ only past the cut keep different jobs."""
    base = re.sub(r"[^a-z0-9-]+", "-", f"{spec.run.name}-{run_id}".lower()).strip("-")
    if not base[:1].isalpha():
        base = f"r-{base}".rstrip("-")
    if len(base) <= NAME_LIMIT:
        return base
    return f"{base[:NAME_LIMIT - 9].rstrip('-')}-{hashlib.sha256(base.encode()).hexdigest()[:8]}"


def node_local_l0(spec: JobSpec) -> bool:
    """checkpoint.l0 is each host's own disk: an absolute path outside the shared filesystem's mount."""
    l0, mount = Path(spec.checkpoint.l0), Path(spec.launcher.shared_fs_mount)
    return l0.is_absolute() and l0 != mount and mount not in l0.parents


MLFLOW_CLIENT_SECRET = "mlflow-client"  # infra/terraform/modules/metadata: kubernetes_secret_v1.mlflow_client
MLFLOW_CLIENT_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
PATCH_MANAGER = "llm-pipeline/launcher"  # Trainer's webhook: a runtime patch's manager is a domain-prefixed path


@dataclass(frozen=True)
class JobKind:
    """A Kubernetes training job API: where it lives, what its trainer container is called, how its pods are found."""
    name: str  # launcher.job_kind, and the word the launcher's log lines start with
    kind: str
    group: str
    version: str
    plural: str
    container: str
    pod_label: str  # the label whose value is the job's name on every pod of the job

    def selector(self, job: str) -> str:
        return f"{self.pod_label}={job}"


TRAINJOB = JobKind("trainjob", "TrainJob", "trainer.kubeflow.org", "v1alpha1", "trainjobs", "node",
                   "jobset.sigs.k8s.io/jobset-name")
PYTORCHJOB = JobKind("pytorchjob", "PyTorchJob", "kubeflow.org", "v1", "pytorchjobs", "pytorch",
                     "training.kubeflow.org/job-name")
KINDS = {k.name: k for k in (TRAINJOB, PYTORCHJOB)}


def kind_of(job: dict) -> JobKind:
    for k in KINDS.values():
        if job.get("kind") == k.kind:
            return k
    raise ValueError(f"not a training job this launcher knows: kind {job.get('kind')!r}")


@dataclass
class PodParts:
    """What every node's pod gets, whatever the job API: environment, GPU/EFA resources, volumes, placement."""
    env: dict[str, str]
    limits: dict[str, int]
    mounts: list[dict]
    volumes: list[dict]
    labels: dict[str, str]
    command: list[str]
    pod_env: list[dict] = field(default_factory=list)  # values the pod learns about itself (downward API)

    def env_list(self) -> list[dict]:
        return [{"name": k, "value": v} for k, v in self.env.items()] + self.pod_env


def pod_grace_s(spec: JobSpec) -> int:
    """The pod's terminationGracePeriodSeconds: the ranks' preemption checkpoint (``train.preempt_grace_s``) and
    5 s for torchrun and the container to exit."""
    return spec.train.shutdown_grace_s()


RDZV_PREFIX = "llmp-"  # PET_RDZV_ID = llmp-<the job's uid>; "llmp-" alone when the pod could not learn it


def rendezvous_env(spec: JobSpec) -> list[dict]:
    """torchrun's rendezvous id (``PET_RDZV_ID``; ``TORCHELASTIC_RUN_ID`` in the ranks), distinct for every job
    object, so that the fence (:func:`pipelines.train.ckpt.fence.launch_id`) tells a job from one re-created under its
    name (torchrun's default, ``none``, is every job's). From the downward API: a TrainJob's pods, the uid of
    their batch Job (one per TrainJob, holding every node); a PyTorchJob without an elastic range (static
    rendezvous: the id need not agree across pods, and rank 0 is on the Master), the pod's own uid. An elastic
    PyTorchJob (c10d: one id for every pod, and no per-job value reaches them) keeps torchrun's default."""
    L = spec.launcher
    if L.job_kind == "trainjob":
        path = "metadata.labels['batch.kubernetes.io/controller-uid']"
    elif L.min_nodes is None or L.min_nodes >= L.nnodes:
        path = "metadata.uid"
    else:
        return []
    return [{"name": "LLMP_JOB_UID", "valueFrom": {"fieldRef": {"fieldPath": path}}},
            {"name": "PET_RDZV_ID", "value": f"{RDZV_PREFIX}$(LLMP_JOB_UID)"}]  # never empty: torchrun refuses ""


def pod_parts(spec: JobSpec, run_id: str, trainer_args: list[str], module: str,
              extra_env: dict[str, str] | None) -> PodParts:
    L = spec.launcher
    env = {**NCCL_ENV, **(EFA_ENV if L.efa_per_node else {}), "OMP_NUM_THREADS": str(L.threads_per_proc),
           "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    limits = {"nvidia.com/gpu": L.nproc_per_node}
    if L.efa_per_node:
        limits["vpc.amazonaws.com/efa"] = L.efa_per_node
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if L.shared_fs_claim:
        mounts.append({"name": "shared-fs", "mountPath": L.shared_fs_mount})
        volumes.append({"name": "shared-fs", "persistentVolumeClaim": {"claimName": L.shared_fs_claim}})
    pod_env = rendezvous_env(spec)
    if node_local_l0(spec):
        mount = {"name": "node-local", "mountPath": spec.checkpoint.l0}
        if L.node_local_path:  # a host's disk: two pods of the job on one host each get a directory of their own
            mount["subPathExpr"] = "$(LLMP_POD_NAME)"
            pod_env.append({"name": "LLMP_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
        mounts.append(mount)
        volumes.append({"name": "node-local", **({"hostPath": {"path": L.node_local_path, "type": "DirectoryOrCreate"}}
                                                 if L.node_local_path else {"emptyDir": {}})})
    labels = {"app.kubernetes.io/name": "llm-pipeline-trainer", "llm-pipeline/run": job_name(spec, run_id)}
    # torchrun forwards SIGUSR1 too and waits train.preempt_grace_s + 5 s for the ranks' checkpoint
    command = ["torchrun", "--max-restarts", str(L.max_restarts), "--shutdown-timeout", str(pod_grace_s(spec)),
               "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "-m", module, *trainer_args]
    return PodParts(env, limits, mounts, volumes, labels, command, pod_env)


def render_pytorchjob(spec: JobSpec, run_id: str, trainer_args: list[str],
                      module: str = "pipelines.train.trainer", extra_env: dict[str, str] | None = None) -> dict:
    L, p = spec.launcher, pod_parts(spec, run_id, trainer_args, module, extra_env)
    gpus = L.nproc_per_node
    container = {
        "name": PYTORCHJOB.container,  # the training operator finds the container by this name
        "image": L.image,
        "command": p.command,
        "env": p.env_list(),
        # the MLflow login (MLFLOW_TRACKING_USERNAME / _PASSWORD) the cluster's Terraform puts in the namespace;
        # optional, so a cluster without MLflow authentication runs the same job
        "envFrom": [{"secretRef": {"name": MLFLOW_CLIENT_SECRET, "optional": True}}],
        "resources": {"limits": p.limits, "requests": dict(p.limits)},
        "volumeMounts": p.mounts,
    }
    template = {"metadata": {"labels": p.labels},
                "spec": {"containers": [container], "volumes": p.volumes, "nodeSelector": dict(L.node_selector),
                         "tolerations": [dict(GPU_TOLERATION)], "terminationGracePeriodSeconds": pod_grace_s(spec)}}
    if L.service_account:
        template["spec"]["serviceAccountName"] = L.service_account
    specs = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if L.nnodes > 1:
        specs["Worker"] = {"replicas": L.nnodes - 1, "restartPolicy": "OnFailure", "template": copy.deepcopy(template)}
    job = {
        "apiVersion": f"{PYTORCHJOB.group}/{PYTORCHJOB.version}",
        "kind": PYTORCHJOB.kind,
        "metadata": {"name": job_name(spec, run_id), "namespace": L.namespace,
                     "labels": {"app.kubernetes.io/part-of": "llm-pipeline"}},
        "spec": {
            "nprocPerNode": str(gpus),
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": L.max_restarts},
            "pytorchReplicaSpecs": specs,
        },
    }
    if L.min_nodes is not None and L.min_nodes < L.nnodes:
        # spec.nprocPerNode only: v1.8.1's webhook forbids elasticPolicy.nProcPerNode (deprecated) beside it. The
        # operator then sets PET_NPROC_PER_NODE from spec.nprocPerNode, PET_NNODES=min:max, PET_RDZV_BACKEND,
        # PET_RDZV_ENDPOINT=<job>-worker-0:23456 and PET_MAX_RESTARTS for torchrun.
        job["spec"]["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": L.min_nodes, "maxReplicas": L.nnodes,
                                        "maxRestarts": L.max_restarts}
    return job


def render_trainjob(spec: JobSpec, run_id: str, trainer_args: list[str],
                    module: str = "pipelines.train.trainer", extra_env: dict[str, str] | None = None) -> dict:
    """A Kubeflow Trainer v2 TrainJob on the ``launcher.runtime`` ClusterTrainingRuntime (torch-distributed: its
    torch plugin gives torchrun the rendezvous as ``PET_*`` variables, as the v1 operator does). What the TrainJob's
    ``trainer`` cannot say (volumes, node selector, tolerations, service account, pod labels) is a runtime patch of
    the ``node`` replicated job, the one the torch runtimes run."""
    L, p = spec.launcher, pod_parts(spec, run_id, trainer_args, module, extra_env)
    secret_env = [{"name": k, "valueFrom": {"secretKeyRef": {"name": MLFLOW_CLIENT_SECRET, "key": k, "optional": True}}}
                  for k in MLFLOW_CLIENT_KEYS]
    pod_spec = {"containers": [{"name": TRAINJOB.container, "volumeMounts": p.mounts}], "volumes": p.volumes,
                "nodeSelector": dict(L.node_selector), "tolerations": [dict(GPU_TOLERATION)],
                "terminationGracePeriodSeconds": pod_grace_s(spec)}
    if L.service_account:
        pod_spec["serviceAccountName"] = L.service_account
    node_patch = {"name": "node", "template": {"spec": {"template": {"metadata": {"labels": p.labels},
                                                                     "spec": pod_spec}}}}
    return {
        "apiVersion": f"{TRAINJOB.group}/{TRAINJOB.version}",
        "kind": TRAINJOB.kind,
        "metadata": {"name": job_name(spec, run_id), "namespace": L.namespace,
                     "labels": {"app.kubernetes.io/part-of": "llm-pipeline"}},
        "spec": {
            "runtimeRef": {"name": L.runtime, "apiGroup": TRAINJOB.group, "kind": "ClusterTrainingRuntime"},
            "trainer": {"image": L.image, "command": p.command, "numNodes": L.nnodes,
                        "numProcPerNode": L.nproc_per_node,
                        "env": p.env_list() + secret_env,
                        "resourcesPerNode": {"limits": p.limits, "requests": dict(p.limits)}},
            "runtimePatches": [{"manager": PATCH_MANAGER,
                                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node_patch]}}}}],
        },
    }


RENDER = {"trainjob": render_trainjob, "pytorchjob": render_pytorchjob}


def stage_job(spec: JobSpec, run_id: str, module: str, args: list[str], env: dict[str, str] | None = None) -> dict:
    """The job a stage submits: the pods resolve relative spec paths against this project's home, as here; ``env``
    for the ranks besides (the train stage's launch token)."""
    return RENDER[spec.launcher.job_kind](spec, run_id, args, module,
                                          extra_env={"LLMP_HOME": str(project_home()), **(env or {})})


# the CRD a kind is checked against by default (schema and CEL rules), shipped in infra/k8s/crds: Trainer v2.3.0's
# TrainJob CRD and training-operator v1.8.1's PyTorchJob CRD (the versions infra/terraform installs); --crd overrides
_CRDS = Path(__file__).resolve().parents[2] / "infra/k8s/crds"
DEFAULT_CRDS = {"trainjob": _CRDS / "trainer.kubeflow.org_trainjobs.yaml",
                "pytorchjob": _CRDS / "kubeflow.org_pytorchjobs.yaml"}


def validate_job(job: dict, crd_path: Path | None, spec: JobSpec | None = None) -> list[str]:
    """Errors (empty when the cluster would take it): every refusal of :func:`pipelines.launch.admission.refusals`
    (metadata, the CRD's schema and CEL rules when ``crd_path`` is given, the operator's webhook), each naming its
    field and rule, then what the launcher itself needs (the trainer container's name, the nodes adding up to the
    spec's)."""
    return [str(r) for r in refusals(job, crd_path)] + launcher_errors(job, spec)


def launcher_errors(job: dict, spec: JobSpec | None) -> list[str]:
    """What the schema and the webhooks allow but this launcher cannot follow or did not ask for."""
    k, js, errors = kind_of(job), job.get("spec", {}), []
    if k is PYTORCHJOB:
        for role, rs in js.get("pytorchReplicaSpecs", {}).items():
            names = [c.get("name") for c in rs.get("template", {}).get("spec", {}).get("containers", [])]
            if k.container not in names:
                errors.append(f"spec.pytorchReplicaSpecs.{role}: no container named 'pytorch' (the operator needs it)")
        nodes = sum(r for r in (rs.get("replicas", 0) for rs in js.get("pytorchReplicaSpecs", {}).values())
                    if isinstance(r, int))
    else:
        for patch in js.get("runtimePatches", []):
            for rj in patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", []):
                names = [c.get("name") for c in rj.get("template", {}).get("spec", {}).get("template", {})
                         .get("spec", {}).get("containers", [])]
                if rj.get("name") != "node" or any(n != k.container for n in names):
                    errors.append(f"spec.runtimePatches: patch the 'node' job's 'node' container (the torch "
                                  f"runtime's trainer), not {rj.get('name')}/{names}")
        nodes = js.get("trainer", {}).get("numNodes", 1)
    if spec is not None and nodes != spec.launcher.nnodes:
        errors.append(f"the job has {nodes} nodes, the spec asks for launcher.nnodes={spec.launcher.nnodes}")
    return errors


def check_job(job: dict, spec: JobSpec | None = None, crd_path: Path | None = None) -> None:
    """:class:`JobFailed` naming each rule the job breaks (one line each) when the cluster would refuse it;
    ``crd_path`` defaults to the CRD shipped for its kind (:data:`DEFAULT_CRDS`)."""
    if crd_path is None:  # the shipped CRD; an install without this repository's infra/ has the webhook rules only
        crd_path = DEFAULT_CRDS.get(kind_of(job).name)
        crd_path = crd_path if crd_path is not None and crd_path.is_file() else None
    errs = validate_job(job, crd_path, spec)
    if errs:
        meta = job.get("metadata") or {}
        where = f"{job.get('kind')} {meta.get('namespace')}/{meta.get('name')}"
        raise JobFailed("\n".join(f"the cluster would refuse {where}: {e}" for e in errs))


class JobFailed(RuntimeError):
    """The training job was rejected, failed, or did not finish in time; the message says which and why.
    ``retryable``: the cluster failed it (its nodes, the API, a timeout), not the spec: the launcher exits 75.
    ``job``: the job object when the job itself ended Failed (its outcome was read: :class:`JobRecord`)."""

    def __init__(self, message: str, retryable: bool = False, job: dict | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.job = job


class Refused(JobFailed):
    """The API server refused this identity (401 Unauthorized, 403 Forbidden). Raised as is where the credentials
    were just read (submit: exit 2, see :func:`call`); a watch reads them again first (:class:`Session`)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def kube_target(spec: JobSpec) -> tuple[str | None, str | None]:
    """(kubeconfig, context): the Airflow Kubernetes connection's when the task passed them (``LLMP_KUBECONFIG``,
    ``LLMP_KUBE_CONTEXT``; an empty kubeconfig = the pod's in-cluster identity), else ``launcher.kubeconfig`` /
    ``kube_context``. Not spec values: where the credentials live is no part of a stage's key."""
    cfg = os.environ.get("LLMP_KUBECONFIG", spec.launcher.kubeconfig)
    return cfg or None, os.environ.get("LLMP_KUBE_CONTEXT") or spec.launcher.kube_context


def api_clients(spec: JobSpec):
    """(CustomObjectsApi, CoreV1Api) from :func:`kube_target`, or in-cluster credentials."""
    return api_clients_for(*kube_target(spec))


REQUEST_TIMEOUT = (10, 60)  # connect, read (s): no API call waits for ever
TRANSIENT = (429, 500, 502, 503, 504)


STOP_REQUEST_TIMEOUT = (3, 5)  # the delete of a stopped launch: inside the 10 s Airflow gives a task before SIGKILL


def call(fn, *args, tries: int = 5, request_timeout=REQUEST_TIMEOUT, **kwargs):
    """One API call with a bounded wait: transient answers (429, 5xx, a dropped connection) are retried with backoff
    (1, 2, 4, 8 s), then :class:`JobFailed` (retryable); 401/403 become :class:`Refused`, one line naming the
    identity problem; other errors (404, 409, 422) go to the caller.

    A refusal raised as is (not retryable: exit 2) is the identity's to fix: where it reaches the launcher, the
    credentials were read moments before (:func:`run_job` builds its clients right before the submit, from the
    kubeconfig, the Airflow connection's file or the pod's service account; an exec plugin's token is fresh), so a
    401 means the configured credentials themselves are wrong or a static token in them has expired, and a 403 that
    the identity's Role lacks a verb: the same command fails the same way until someone fixes it. An expired token
    *during* a watch (EKS tokens last 15 minutes) is not that: the watch reads the credentials again and goes on
    (:class:`Session`), and exits 75 if they keep being refused."""
    from kubernetes.client.exceptions import ApiException

    for attempt in range(tries):
        try:
            return fn(*args, _request_timeout=request_timeout, **kwargs)
        except ApiException as e:
            if e.status in (401, 403):
                raise Refused(f"the Kubernetes API refused {getattr(fn, '__name__', 'a call')} ({e.status} "
                              f"{e.reason}): {_api_error(e)}; check the identity this runs as (launcher.kubeconfig, "
                              "the kubernetes connection, or the pod's service account and its Role)",
                              e.status) from None
            if e.status not in TRANSIENT:
                raise
            if attempt == tries - 1:
                raise JobFailed(f"the Kubernetes API kept answering {getattr(fn, '__name__', 'a call')} with "
                                f"{e.status} {e.reason} for {tries} tries: {_api_error(e)}", retryable=True) from None
        except (HTTPError, OSError) as e:
            if attempt == tries - 1:
                raise JobFailed(f"the Kubernetes API did not answer {getattr(fn, '__name__', 'a call')} after "
                                f"{tries} tries: {e}", retryable=True) from None
        time.sleep(2 ** attempt)


def api_clients_for(kubeconfig: str | None, kube_context: str | None):
    """Clients with a configuration of their own: nothing process-global changes, so one process (the triggerer)
    can watch jobs of several clusters and identities at once."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        try:
            config.load_kube_config(config_file=os.path.expanduser(kubeconfig) if kubeconfig else None,
                                    context=kube_context, client_configuration=cfg)
        except (config.ConfigException, OSError) as e:
            raise JobFailed(f"cannot load Kubernetes credentials ({e}); set launcher.kubeconfig (and "
                            "launcher.kube_context), or run inside the cluster") from None
    api = client.ApiClient(cfg)
    return client.CustomObjectsApi(api), client.CoreV1Api(api)


SUCCEEDED = ("Succeeded", "Complete")  # PyTorchJob's word, TrainJob's word


def job_state(obj: dict) -> tuple[str, str]:
    """(state, message) from the job's conditions: Succeeded (a TrainJob's Complete) or Failed win, else the
    newest true condition, else Pending."""
    true = [c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    for terminal in ("Failed", *SUCCEEDED):
        for c in true:
            if c.get("type") == terminal:
                return ("Succeeded" if terminal in SUCCEEDED else terminal), c.get("message", "")
    if not true:
        return "Pending", ""
    return true[-1].get("type", "Unknown"), true[-1].get("message", "")


def _replicas(obj: dict) -> str:
    status = obj.get("status") or {}
    rs = status.get("replicaStatuses") or {j.get("name", "?"): j for j in status.get("jobsStatus") or []}
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
    try:
        return json.loads(e.body).get("message") or str(e.body)
    except (TypeError, ValueError, AttributeError):
        return str(getattr(e, "body", "") or e)


def get(custom, k: JobKind, ns: str, name: str) -> dict:
    return call(custom.get_namespaced_custom_object, k.group, k.version, ns, k.plural, name)


def get_or_gone(custom, k: JobKind, ns: str, name: str) -> dict:
    """The job, or :class:`JobFailed` when it is gone (deleted outside this task)."""
    from kubernetes.client.exceptions import ApiException

    try:
        return get(custom, k, ns, name)
    except ApiException as e:
        if e.status == 404:
            raise JobFailed(f"{k.kind} {ns}/{name} is gone: it was deleted outside this task") from None
        raise


FINISHED = ("Succeeded", "Failed")


def submit(custom, job: dict, log: Callable[[str], None] = print, record: JobRecord | None = None) -> str:
    """Create the job; returns 'created', 'adopted' or 'replaced'. A job of the same name and command left by an
    earlier try is adopted while it runs; once finished, it is adopted only to be collected, while no try has read
    its outcome yet (``record``, the ranks' work dir: :meth:`JobRecord.spent`), and replaced after that (without a
    record, as before: a Succeeded one adopted, a Failed one replaced). One of another command is replaced once
    finished; running, it is a clash. ``record`` starts a new attempt of the ranks right before each create."""
    k = kind_of(job)
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    existing = find(custom, k, ns, name)
    if existing is None:
        return _create_new(custom, k, job, log, record, "created")
    if (existing.get("metadata") or {}).get("deletionTimestamp"):  # a user's stop is deleting it: not to adopt
        log(f"{k.name} {ns}/{name}: an earlier job of this name is being deleted; waiting for it to go")
        delete(custom, k, ns, name, wait_s=DELETE_WAIT_S)
        return _create_new(custom, k, job, log, record, "created")
    state, _ = job_state(existing)
    if _commands(existing) == _commands(job) and not _spent(existing, state, record):
        log(f"{k.name} {ns}/{name}: already exists ({state}) with the same command, "
            + ("collecting its outcome" if state in FINISHED else "following it"))
        return "adopted"
    if state not in FINISHED:
        raise JobFailed(f"{k.kind} {ns}/{name} from an earlier try is still {state} with another command; wait "
                        f"for it or delete it (kubectl delete {k.name} -n {ns} {name})")
    log(f"{k.name} {ns}/{name}: replacing the earlier {state} job")
    delete(custom, k, ns, name, wait_s=DELETE_WAIT_S)
    return _create_new(custom, k, job, log, record, "replaced")


def find(custom, k: JobKind, ns: str, name: str) -> dict | None:
    """The job of that name, or None."""
    from kubernetes.client.exceptions import ApiException

    try:
        return get(custom, k, ns, name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise JobFailed(f"could not read {k.kind} {ns}/{name} ({e.status} {e.reason}): {_api_error(e)}") from None


def _create_new(custom, k: JobKind, job: dict, log: Callable[[str], None], record: JobRecord | None,
                how: str) -> str:
    """A new attempt (``record``: its id in the work dir, no outcome file of an earlier one left), then the job.
    The name is free here (looked up or deleted just before; the stage's key lock keeps other tries of it out)."""
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    if record is not None:
        record.new_attempt()
    if not create(custom, k, job):
        raise JobFailed(f"{k.kind} {ns}/{name} exists again; delete it (kubectl delete {k.name} -n {ns} {name})")
    log(f"{k.name} {ns}/{name}: submitted")
    return how


def _spent(existing: dict, state: str, record: JobRecord | None) -> bool:
    """Whether a finished job of the same command gives way to a new one rather than being collected."""
    if state not in FINISHED:
        return False
    return record.spent(existing, state) if record is not None else state == "Failed"


OUTCOME_READ_FILE = ".job-outcome-read.json"  # in the ranks' work dir: the finished job a try collected


class JobRecord:
    """What the launcher keeps about its Kubernetes job in the ranks' work dir (their ``--out``): the attempt the
    ranks write into their outcome files (:func:`pipelines.launch.outcomes.new_attempt`, before each create), and
    the uid of the finished job whose outcome a try has collected without taking it as done
    (:data:`OUTCOME_READ_FILE`): a preempted job that ended Succeeded, a failed one, a result the fence refused.
    Such a job is read once; the next try replaces it (:func:`submit`) instead of reading the same outcome again.

    A file there rather than an annotation on the job: the launcher's Role (infra/terraform/modules/namespaces)
    may create, get, list, watch and delete training jobs, not patch them. The work dir is on the shared
    filesystem, named by the stage key as the job is, at the same path on every Airflow worker (checked before
    submitting), so the record outlives the process, the worker and a deferral to the triggerer (the resumed task
    collects the job once, and only its failure is recorded). It names the job's uid: a job re-created under the
    name (by hand, or by a try whose record write was lost) is never taken for the one that was read."""

    def __init__(self, work: Path):
        self.work = work

    def new_attempt(self) -> str:
        return exit_codes.new_attempt(self.work)

    def collected(self, job: dict) -> bool:
        uid = (job.get("metadata") or {}).get("uid")
        try:
            read = json.loads(read_small_text(self.work / OUTCOME_READ_FILE))
        except (OSError, ValueError):  # none yet, or unreadable: read the job (again), as before this record
            return False
        return bool(uid) and isinstance(read, dict) and read.get("uid") == uid

    def mark_collected(self, job: dict, log: Callable[[str], None] = print) -> None:
        """``job`` finished and a try read its outcome, which did not finish the stage: the next try replaces it."""
        meta = job.get("metadata") or {}
        body = {"uid": meta.get("uid"), "job": f"{job.get('kind')} {meta.get('namespace')}/{meta.get('name')}",
                "state": job_state(job)[0], "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            atomic_write_text(self.work / OUTCOME_READ_FILE, json.dumps(body))
        except OSError as e:  # the next try then reads this job once more
            log(f"{body['job']}: could not record that its outcome was read ({e})")

    def spent(self, job: dict, state: str) -> bool:
        """A finished job gives way: a try already collected it; or it Failed and its ranks did not say the input
        must change, so collecting it would only say "retry", which a new job does (a Failed job whose ranks said
        so is collected once: exit 2)."""
        if self.collected(job):
            return True
        if state != "Failed":
            return False

        return xc.failed_ranks_code(xc.read_outcomes(self.work)) != xc.USER_ERROR


DELETE_WAIT_S = 600.0  # a foreground delete of a JobSet with GPU pods can take minutes


def create(custom, k: JobKind, job: dict) -> bool:
    """Create the job: True, or False when one of that name exists (409); a refusal is :class:`JobFailed`."""
    from kubernetes.client.exceptions import ApiException

    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    try:
        call(custom.create_namespaced_custom_object, k.group, k.version, ns, k.plural, job)
        return True
    except ApiException as e:
        if e.status == 409:
            return False
        raise JobFailed(f"the API server refused {k.kind} {ns}/{name} ({e.status} {e.reason}): "
                        f"{_api_error(e)}") from None


def _commands(job: dict) -> list:
    js = job.get("spec") or {}
    if "trainer" in js:
        return [js["trainer"].get("command"), js["trainer"].get("args")]
    return [c.get("command") for _, rs in sorted((js.get("pytorchReplicaSpecs") or {}).items())
            for c in rs.get("template", {}).get("spec", {}).get("containers", [])]


def delete(custom, k: JobKind, ns: str, name: str, wait_s: float = 0, stopping: bool = False) -> None:
    """Delete the job (``wait_s``: until it is gone). ``stopping``: this process was told to stop, and is killed
    moments later: one short try (:data:`STOP_REQUEST_TIMEOUT`), not the retries a watch allows itself."""
    from kubernetes.client.exceptions import ApiException

    try:
        call(custom.delete_namespaced_custom_object, k.group, k.version, ns, k.plural, name,
             body={"propagationPolicy": "Foreground"}, tries=1 if stopping else 5,
             request_timeout=STOP_REQUEST_TIMEOUT if stopping else REQUEST_TIMEOUT)
    except ApiException as e:
        if e.status != 404:
            raise JobFailed(f"could not delete {k.kind} {ns}/{name} ({e.status} {e.reason}): {_api_error(e)}; "
                            f"delete it by hand (kubectl delete {k.name} -n {ns} {name})") from None
        return
    if wait_s <= 0:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            get(custom, k, ns, name)
        except ApiException as e:
            if e.status == 404:
                return
            raise
        time.sleep(1)
    raise JobFailed(f"{k.kind} {ns}/{name} was still being deleted after {wait_s:g} s")


_EXC = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception|Diverged)\b: .*$")


class LogFollower:
    """New lines of one pod's trainer container since the last poll. Lines carry the kubelet's timestamps; those
    at or before the newest one already shown are skipped (counting equal stamps)."""

    def __init__(self, core, ns: str, pod: str, container: str, window_s: int):
        self.core, self.ns, self.pod, self.container, self.window = core, ns, pod, container, window_s
        self.last_ts, self.n_at_last = "", 0

    def poll(self) -> list[str]:
        from kubernetes.client.exceptions import ApiException

        try:  # raw bytes: with content preloading the client hands back str(bytes) for a non-JSON body
            resp = self.core.read_namespaced_pod_log(self.pod, self.ns, container=self.container, timestamps=True,
                                                     since_seconds=self.window, _preload_content=False,
                                                     _request_timeout=REQUEST_TIMEOUT)
            text = resp.data.decode("utf-8", "replace")
        except (ApiException, HTTPError, OSError):  # not started yet, gone, or the API did not answer: next poll
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
        return new


class ReplicaLogs:
    """New log lines of every pod of a job (every node's replica), each as ``[pod] line``; the pods are listed by
    the job's label on each poll, so replicas that start late or are replaced are followed too."""

    def __init__(self, core, k: JobKind, ns: str, name: str, window_s: int):
        self.core, self.k, self.ns, self.name, self.window = core, k, ns, name, window_s
        self.followers: dict[str, LogFollower] = {}
        self.tail: list[str] = []
        self.listed: list | None = None  # the pods of the last poll (V1Pod), None when their listing did not answer
        self.refused: str | None = None  # the API's 403 to that listing, said once

    def use(self, core) -> None:
        """Go on with new clients (credentials read again: :class:`Session`)."""
        self.core = core
        for f in self.followers.values():
            f.core = core

    def pods(self) -> list[str]:
        """The job's pods' names (the ones followed already when the API did not answer); :attr:`listed` keeps the
        pods themselves, None when the listing did not answer."""
        from kubernetes.client.exceptions import ApiException

        try:
            found = self.core.list_namespaced_pod(self.ns, label_selector=self.k.selector(self.name),
                                                  _request_timeout=REQUEST_TIMEOUT)
        except (ApiException, HTTPError, OSError) as e:
            self.listed = None
            if isinstance(e, ApiException) and e.status == 403:
                self.refused = self.refused or f"403 {e.reason}"
            return sorted(self.followers)
        self.listed = list(found.items)
        return sorted(p.metadata.name for p in found.items)

    def poll(self) -> list[str]:
        said = self.refused
        new = []
        names = self.pods()
        if self.refused is not None and said is None:  # a Role without the verb: no retry grants it, so say it once
            new.append(f"[k8s] the API refused to list the job's pods ({self.refused}): their logs are not followed "
                       "and launcher.pending_minutes cannot apply; this identity needs `list` on pods and `get` on "
                       "pods/log in the job's namespace (docs/cluster.md)")
        for pod in names:
            f = self.followers.setdefault(pod, LogFollower(self.core, self.ns, pod, self.k.container, self.window))
            new += [f"[{pod}] {line}" for line in f.poll()]
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


# a pod past scheduling, image pulls and container creation, running now (one that ended, e.g. an initializer's or a
# crashed one kept for its job's back-off, does not say the job's pods run: its replacement may wait for a node)
STARTED = ("Running",)


def pod_waits(pods: list) -> list[str] | None:
    """Why none of the job's pods has started: each pod's phase and what it waits for (the scheduler's
    ``PodScheduled=False`` reason and message, a container's waiting reason such as ``ImagePullBackOff``), pods that
    wait alike in one line (``3 pods (a, b, …): Pending (…)``: a job of many nodes says it once); None while one of
    them runs; ``[]`` when there is no pod yet."""
    alike: dict[str, list[str]] = {}
    for pod in pods:
        st = pod.status
        phase = (st.phase if st is not None else None) or "Pending"
        if phase in STARTED:
            return None
        why = [f"{c.reason}: {c.message}" if c.message else str(c.reason) for c in (st.conditions or [])
               if c.type == "PodScheduled" and c.status == "False"] if st is not None else []
        for cs in [*(st.init_container_statuses or []), *(st.container_statuses or [])] if st is not None else []:
            w = cs.state.waiting if cs.state is not None else None
            if w is not None and w.reason not in (None, "ContainerCreating", "PodInitializing"):
                why.append(f"{cs.name}: {w.reason}" + (f": {w.message}" if w.message else ""))
        alike.setdefault(phase + (f" ({'; '.join(why)})" if why else ""), []).append(pod.metadata.name)
    return [f"{names[0]}: {what}" if len(names) == 1 else
            f"{len(names)} pods ({', '.join(names[:2])}{', …' if len(names) > 2 else ''}): {what}"
            for what, names in alike.items()]


class StartBound:
    """``launcher.pending_minutes``: how long a job may go with none of its pods running (all Pending, or none
    created), counted from the oldest Pending pod's creation (the API server's timestamp: a watch or a triggerer that
    starts again goes on counting), else from the first poll that found none; reset when one runs. A suspended job
    (a queue holds it) does not count, and a poll whose pod listing did not answer decides nothing (never "still
    pending"). :meth:`update` returns the pods' reasons when they change (to log)."""

    def __init__(self, bound_s: float | None):
        self.bound_s, self.since, self.reasons, self.seen = bound_s, None, None, False

    def update(self, state: str, pods: list | None) -> list[str]:
        self.seen = pods is not None
        if pods is None:  # the listing did not answer: nothing learned (no expiry on what it said before)
            return []
        reasons = None if state in ("Suspended", *FINISHED) else pod_waits(pods)
        if reasons is None:
            self.since = self.reasons = None
            return []
        created = [p.metadata.creation_timestamp.timestamp() for p in pods  # waiting pods only: not one that ended
                   if p.metadata is not None and p.metadata.creation_timestamp is not None
                   and (p.status is None or p.status.phase in (None, "Pending"))]
        self.since = min([*created, *([] if self.since is None else [self.since])], default=time.time())
        changed, self.reasons = reasons != self.reasons, reasons
        return (reasons or ["no pod created yet"]) if changed else []

    def expired(self) -> bool:
        """Past the bound, by a listing that answered just now."""
        return self.bound_s is not None and self.since is not None and self.seen and \
            time.time() - self.since > self.bound_s

    def message(self, k: JobKind, ns: str, name: str) -> str:
        return (f"no pod of {k.kind} {ns}/{name} started within launcher.pending_minutes={self.bound_s / 60:g} ("
                + ("; ".join(self.reasons or []) or "no pod was created") + "); it was deleted")


AUTH_TRIES = 3  # a watch refused (401/403) reads the credentials again this many times before it gives up (75)
AUTH_BACKOFF_S = 1.0  # before the n-th new try: AUTH_BACKOFF_S * 2**(n-1) seconds (1, 2, 4)


class Session:
    """The API clients of one watch, built again from their credentials' source (``reconnect``: the kubeconfig,
    the connection's file, the pod's service-account token, all read anew) when the API server refuses them: a
    token that expired while the job ran. A refusal that outlasts :data:`AUTH_TRIES` fresh reads is
    :class:`JobFailed` (retryable: the task's retry starts with freshly resolved credentials), one line."""

    def __init__(self, custom, core, reconnect: Callable[[], tuple] | None = None,
                 log: Callable[[str], None] = print):
        self.custom, self.core, self.reconnect, self.log = custom, core, reconnect, log
        self.on_renew: list[Callable[[object], None]] = []  # told of the new core client

    def get(self, k: JobKind, ns: str, name: str) -> dict:
        """The job (:func:`get_or_gone`), the credentials read again on a refusal."""
        n = 0
        while True:
            try:
                return get_or_gone(self.custom, k, ns, name)
            except Refused as e:
                if self.reconnect is None or n == AUTH_TRIES:
                    raise JobFailed(f"{k.kind} {ns}/{name}: {e}"
                                    + (f" (still so after reading the credentials again {n} times)" if n else "")
                                    + "; a retry starts with the credentials read anew", retryable=True) from None
                self.log(f"{k.name} {ns}/{name}: the API refused the credentials ({e.status}); reading them again")
                time.sleep(AUTH_BACKOFF_S * 2 ** n)
                n += 1
                self.renew()

    def renew(self) -> None:
        """New clients; a source that cannot be read now counts as one more refusal (the next get raises)."""
        try:
            self.custom, self.core = self.reconnect()  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - a kubeconfig or service-account token unreadable now (ConfigException)
            self.log(f"could not read the Kubernetes credentials again: {type(e).__name__}: {e}")
            return
        for tell in self.on_renew:
            tell(self.core)


def watch(custom, core, k: JobKind, ns: str, name: str, poll_s: float, timeout_s: float | None,
          log: Callable[[str], None] = print, session: Session | None = None, pending_s: float | None = None) -> dict:
    """Poll to Succeeded (returns the job) or Failed/timeout (raises :class:`JobFailed`); a job none of whose pods
    starts within ``pending_s`` (:class:`StartBound`) is deleted and fails (retryable). With a ``session`` its
    clients are used (``custom`` and ``core`` are ignored) and built again when the API refuses them."""
    session = session or Session(custom, core, log=log)
    logs = ReplicaLogs(session.core, k, ns, name, window_s=int(poll_s * 3) + 30)
    session.on_renew.append(logs.use)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    start = StartBound(pending_s)
    last = None
    while True:
        obj = session.get(k, ns, name)
        state, msg = job_state(obj)
        line = state_line(obj)
        if line != last:
            log(f"{k.name} {ns}/{name}: {line}")
            last = line
        for out in logs.poll():
            log(out)
        for why in start.update(state, logs.listed):
            log(f"{k.name} {ns}/{name}: waiting to start: {why}")
        if state == "Succeeded":
            return obj
        if state == "Failed":
            errs = logs.errors()
            raise JobFailed(f"{k.kind} {ns}/{name} failed: {msg or 'no message'}"
                            + ("\nerrors in the pods' logs:\n  " + "\n  ".join(errs) if errs else "")
                            + "\nlast log lines:\n" + "\n".join(logs.tail[-15:]), retryable=True, job=obj)
        if deadline is not None and time.monotonic() > deadline:
            delete(session.custom, k, ns, name)
            raise JobFailed(f"{k.kind} {ns}/{name} did not finish within launcher.timeout_minutes="
                            f"{timeout_s / 60:g}; it was deleted", retryable=True)
        if start.expired():
            delete(session.custom, k, ns, name)
            raise JobFailed(start.message(k, ns, name), retryable=True)
        time.sleep(poll_s)


def run_job(spec: JobSpec, run_id: str, module: str, args: list[str], log: Callable[[str], None] = print,
            detach: bool = False, record: JobRecord | None = None, env: dict[str, str] | None = None) -> dict:
    """Render, submit and watch one training job (``launcher.job_kind``) running ``torchrun -m module args``;
    returns it once Succeeded. The job is deleted when this process is told to stop (SIGTERM from Airflow, Ctrl-C)
    or times out. With ``detach`` a job that has not finished yet raises :class:`pipelines.manifest.Pending` with
    what a poller needs (a deferrable Airflow task waits in the triggerer, then calls this again, which adopts the
    finished job to collect it). ``record``: the ranks' work dir, which tells a finished job already collected
    from one to collect (:func:`submit`); the caller marks it (:meth:`JobRecord.mark_collected`)."""
    job = stage_job(spec, run_id, module, args, env)
    k = kind_of(job)
    check_job(job, spec)  # a job the cluster would refuse is never sent
    target = kube_target(spec)
    session = Session(*api_clients_for(*target), reconnect=lambda: api_clients_for(*target), log=log)
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]

    def _term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    # from the submit on (a stop during it may follow the create): a stop deletes the job, in one short try
    previous = signal.signal(signal.SIGTERM, _term) if _in_main_thread() else None
    try:
        submit(session.custom, job, log, record)
        if detach and job_state(session.get(k, ns, name))[0] not in FINISHED:
            L, t = spec.launcher, spec.launcher.timeout_minutes
            raise Pending({"kind": k.name, "namespace": ns, "name": name, "poll_seconds": L.poll_seconds,
                           "timeout_s": None if t is None else t * 60, "pending_s": _pending_s(spec),
                           "kubeconfig": target[0],
                           "kube_context": target[1], "kube_conn_id": spec.services.kube_conn_id})
        t = spec.launcher.timeout_minutes
        return watch(None, None, k, ns, name, spec.launcher.poll_seconds, None if t is None else t * 60, log,
                     session=session, pending_s=_pending_s(spec))
    except KeyboardInterrupt as e:
        log(f"{k.name} {ns}/{name}: stopping ({e}): deleting the job")
        try:
            delete(session.custom, k, ns, name, stopping=True)
            left = "it was deleted"
        except Exception as d:  # noqa: BLE001 - stopping anyway: say what is left behind
            left = (f"it was NOT deleted ({type(d).__name__}: {d}); delete it by hand (kubectl delete {k.name} -n "
                    f"{ns} {name})")
        raise JobFailed(f"stopped ({e}) while the {k.kind} {ns}/{name} ran; {left}", retryable=True) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _pending_s(spec: JobSpec) -> float | None:
    m = spec.launcher.pending_minutes
    return None if m is None else m * 60


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
