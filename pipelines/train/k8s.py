"""Kubernetes launch: the job spec rendered as a Kubeflow ``PyTorchJob`` (kubeflow.org/v1) and validated.

:func:`render_pytorchjob` turns the spec's ``launcher`` (nodes, processes per node, image, EFA, shared
filesystem, node selector, elastic range) into one manifest: a Master and ``nnodes − 1`` Workers that
each run ``torchrun -m pipelines.train.trainer`` (the training operator passes the rendezvous to
torchrun through ``PET_*`` variables), with GPU and EFA limits, the FSx claim mounted at ``/fsx``
(the L1 checkpoint tier), a memory-backed ``/dev/shm`` for NCCL, and NCCL/EFA environment.
:func:`validate_pytorchjob` checks a manifest against the ``openAPIV3Schema`` of the operator's CRD
(``kubeflow.org_pytorchjobs.yaml``), plus what the schema cannot say (the container must be named
``pytorch``; replicas must add up to the spec's nodes).

    python -m pipelines.train.k8s SPEC.yaml [--crd CRD.yaml] [--run-id ID]   # prints the manifest (YAML)
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

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


def render_pytorchjob(spec: JobSpec, run_id: str, trainer_args: list[str]) -> dict:
    L = spec.launcher
    gpus = L.nproc_per_node
    env = {**NCCL_ENV, **(EFA_ENV if L.efa_per_node else {}), "OMP_NUM_THREADS": str(L.threads_per_proc),
           "PYTHONUNBUFFERED": "1"}
    limits = {"nvidia.com/gpu": gpus}
    if L.efa_per_node:
        limits["vpc.amazonaws.com/efa"] = L.efa_per_node
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if L.shared_fs_claim:
        mounts.append({"name": "shared-fs", "mountPath": "/fsx"})
        volumes.append({"name": "shared-fs", "persistentVolumeClaim": {"claimName": L.shared_fs_claim}})
    container = {
        "name": "pytorch",  # the training operator finds the container by this name
        "image": L.image,
        "command": ["torchrun", "--max-restarts", str(L.max_restarts), "-m", "pipelines.train.trainer",
                    *trainer_args],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "resources": {"limits": limits, "requests": dict(limits)},
        "volumeMounts": mounts,
    }
    template = {"metadata": {"labels": {"app.kubernetes.io/name": "llm-pipeline-trainer",
                                        "llm-pipeline/run": job_name(spec, run_id)}},
                "spec": {"containers": [container], "volumes": volumes, "nodeSelector": dict(L.node_selector),
                         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.train.k8s",
                                 description="Render a job spec as a Kubeflow PyTorchJob; validate it against the CRD.")
    ap.add_argument("spec", help="Job spec YAML (launcher.kind kubernetes).")
    ap.add_argument("--run-id", default="run", help="Run id in the job's name.")
    ap.add_argument("--crd", default=None, help="PyTorchJob CRD YAML to validate against (e.g. the training "
                                                 "operator's manifests/base/crds/kubeflow.org_pytorchjobs.yaml).")
    args = ap.parse_args(argv)
    try:
        spec = load_spec(args.spec)
    except SpecError as e:
        print(f"k8s: error: {e}", file=sys.stderr)
        return 2
    job = render_pytorchjob(spec, args.run_id, ["--spec", "/fsx/specs/spec.yaml", "--tokenize-manifest",
                                                "/fsx/runs/tokenize/manifest.json", "--out", "/fsx/runs/train",
                                                "--ckpt-root", "/fsx/checkpoints"])
    if args.crd:
        errs = validate_pytorchjob(job, Path(args.crd), spec)
        if errs:
            print("k8s: invalid PyTorchJob:\n  " + "\n  ".join(errs), file=sys.stderr)
            return 1
    print(yaml.safe_dump(job, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
