"""Terraform outputs → the job spec and Airflow connections that point the same DAG at the AWS stack.

Reads ``terraform output -json`` of the environment's two Terraform roots, ``infra/terraform/envs/<env>/aws`` then
``infra/terraform/envs/<env>/platform``, merged (the platform layer's outputs win where both have one), either by
running terraform there or from saved files (``--outputs`` once per root, in that order), and writes:

* a job spec (YAML) that layers the cluster onto a base spec (default ``configs/demo.yaml``):
  ``launcher.kind: trainjob`` (a Kubeflow Trainer v2 TrainJob) with the trainer image, namespace, FSx claim and mount,
  service account, EFA count, and from the GPU node group its node selector (pool label, instance type) and
  ``nproc_per_node`` (its GPUs per node); ``run.root`` and L1 on FSx, L0 on each GPU node's NVMe (node-local); ``services``: Spark master ``k8s://…``, S3 on
  AWS with the checkpoint bucket, the in-cluster MLflow URI. Trigger the DAG with
  ``{"spec": "<that file>"}``: no code change, only config.
* a file of Airflow connections for ``airflow connections import FILE``: ``kubernetes_default``
  (in-cluster), ``spark_pipeline`` (the Spark master the SparkStageOperator uses), ``aws_default``
  (region; credentials come from the worker's IRSA role), ``mlflow_default`` (the tracking URI; the login comes
  from the Secret ``mlflow-client``). Imported into the metastore, not set as ``AIRFLOW_CONN_*`` variables (which
  would win over the UI): the import skips connections that exist, so one a user set in the UI wins, and an edit
  in the UI sticks. The tasks read them (``plugins/llm_connections.py``).

    python -m pipelines.cluster_config --env dev --out configs/aws-dev.yaml --connections var/aws-dev-connections.json
    airflow connections import var/aws-dev-connections.json
    python -m pipelines.cluster_config --outputs aws.json --outputs platform.json --out configs/aws-dev.yaml
    python -m pipelines.cluster_config --env dev --outputs stack.json    # saved outputs → configs/aws-dev.yaml
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from pipelines.exit_codes import RETRY, USER_ERROR
from pipelines.manifest import atomic_write_text
from pipelines.spec import GPUS_PER_INSTANCE_TYPE, INSTANCE_TYPE_LABEL, SpecError, load_spec, redact

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("region", "spark_master", "spark_image", "buckets", "mlflow_tracking_uri", "pipeline_namespace", "shared_fs_claim",
            "service_accounts", "trainer_image", "gpu_efa_interfaces", "node_groups")
# checkpoint.l0 on each GPU node's own NVMe: an absolute path outside the shared FS is a node-local L0, an emptyDir
# in the pods, which the GPU launch template puts on the instance-store RAID0 (the kubelet's disk)
NODE_LOCAL_L0 = "/local/llm-pipeline/l0"


class WiringError(ValueError):
    pass


class StateUnanswered(RuntimeError):
    """``terraform output`` did not end within :data:`OUTPUT_TIMEOUT_S` (a remote state backend that does not answer):
    a retry's (75), not the user's to fix."""


OUTPUT_TIMEOUT_S = 300.0  # one root's `terraform output -json`: reading a remote state takes seconds


LAYERS = ("aws", "platform")  # the roots of an environment, in apply order


def _values(raw: dict) -> dict:
    """``{name: value}`` of one root's ``terraform output -json``; the envs export their stack as one object."""
    out = {k: (v["value"] if isinstance(v, dict) and "value" in v else v) for k, v in raw.items()}
    return out["stack"] if isinstance(out.get("stack"), dict) else out


def _terraform_output(d: Path) -> dict:
    try:
        return json.loads(subprocess.run(["terraform", f"-chdir={d}", "output", "-json"], check=True,
                                         capture_output=True, text=True, timeout=OUTPUT_TIMEOUT_S).stdout)
    except subprocess.TimeoutExpired:
        raise StateUnanswered(f"`terraform output -json` in {d} did not end in {OUTPUT_TIMEOUT_S / 60:g} min (its "
                              "state backend did not answer): run it again") from None
    except (OSError, subprocess.CalledProcessError) as e:
        raise WiringError(f"`terraform output -json` failed in {d} (run `terraform init` and `terraform apply` "
                          f"there first): {e}") from None


def read_outputs(path: str | list[str] | None, env: str | None) -> dict:
    """``{name: value}``: the outputs of each saved ``terraform output -json`` (``path``: one file or several, merged
    in order), or of the roots of infra/terraform/envs/<env> (aws, then platform), later ones winning."""
    if path:
        raws = [json.loads(Path(p).read_text()) for p in ([path] if isinstance(path, str) else path)]
    else:
        d = ROOT / "infra" / "terraform" / "envs" / str(env)
        roots = [d / layer for layer in LAYERS]
        if not all(r.is_dir() for r in roots):
            raise WiringError(f"no Terraform environment at {d} (with aws/ and platform/); use --env dev|prod or "
                              "--outputs FILE")
        raws = [_terraform_output(r) for r in roots]
    out: dict = {}
    for raw in raws:
        out.update(_values(raw))
    missing = [k for k in REQUIRED if k not in out]
    if missing:
        raise WiringError(f"Terraform outputs lack {', '.join(missing)}: are these the outputs of "
                          "infra/terraform/envs/<env>/aws and .../platform, both applied?")
    return out


def gpu_nodes(out: dict) -> dict:
    """What the training pods need of the GPU node group Terraform made: its node selector (the pool label and the
    instance type) and its GPUs per node (every rank of a node gets one); its taints must be the one the pods
    tolerate (``nvidia.com/gpu``, NoSchedule: pipelines.launch.k8s.GPU_TOLERATION)."""
    groups = out.get("node_groups")
    group = groups.get("gpu") if isinstance(groups, dict) else None
    if not isinstance(group, dict):
        raise WiringError("Terraform outputs name no GPU node group (node_groups.gpu): are these the AWS layer's?")
    types, taints, labels = group.get("instance_types"), group.get("taints") or [], group.get("labels") or {}
    if not isinstance(types, list) or len(types) != 1 or not isinstance(types[0], str):
        raise WiringError(f"the GPU node group has instance types {types!r}: give it exactly one (every node must "
                          "have the same GPUs for nproc_per_node)")
    gpus = GPUS_PER_INSTANCE_TYPE.get(types[0])
    if gpus is None:
        raise WiringError(f"no GPU count known for {types[0]}: add it to pipelines.spec.GPUS_PER_INSTANCE_TYPE")
    if not isinstance(taints, list) or not isinstance(labels, dict):
        raise WiringError("the GPU node group's taints must be a list and its labels a map")
    for t in taints:
        if not isinstance(t, dict) or t.get("key") != "nvidia.com/gpu" or t.get("effect") != "NO_SCHEDULE":
            raise WiringError(f"the GPU node group's taint {t!r} is not the one the training pods tolerate "
                              "(nvidia.com/gpu, NoSchedule)")
    pool = labels.get("llm-pipeline/pool")
    if pool is not None and not isinstance(pool, str):
        raise WiringError(f"the GPU node group's label llm-pipeline/pool is {pool!r}, not a string")
    selector = {INSTANCE_TYPE_LABEL: types[0], **({"llm-pipeline/pool": pool} if pool else {})}
    return {"node_selector": selector, "nproc_per_node": gpus}


def cluster_spec(out: dict, base: dict, shared_mount: str = "/fsx") -> dict:
    spec = json.loads(json.dumps(base))  # deep copy
    home = f"{shared_mount}/llm-pipeline"
    sa = out["service_accounts"]["trainer"].split(":")
    spec.setdefault("run", {})["root"] = f"{home}/var/runs"
    spec.setdefault("checkpoint", {}).update({"l0": NODE_LOCAL_L0, "l1": f"{home}/var/tiers/shared"})
    launcher = spec.setdefault("launcher", {})
    launcher.update({
        "kind": "trainjob", "image": out["trainer_image"], "namespace": out["pipeline_namespace"],
        "shared_fs_claim": out["shared_fs_claim"], "shared_fs_mount": shared_mount, "service_account": sa[1],
        "efa_per_node": int(out["gpu_efa_interfaces"]), **gpu_nodes(out),
    })
    spec["services"] = {**spec.get("services", {}), "spark_master": out["spark_master"], "s3_endpoint_url": "aws",
                        "spark_image": out["spark_image"], "spark_namespace": out["pipeline_namespace"],
                        "spark_service_account": out["service_accounts"]["spark"].split(":")[1],
                        "s3_bucket": out["buckets"]["checkpoints"], "s3_region": out["region"],
                        "mlflow_tracking_uri": out["mlflow_tracking_uri"],
                        "mlflow_artifact_root": f"s3://{out['buckets']['mlflow']}/artifacts"}
    return spec


def airflow_connections(out: dict) -> dict[str, dict]:
    """{conn_id: connection} in the form ``airflow connections import`` reads."""
    return {
        "kubernetes_default": {"conn_type": "kubernetes",
                               "extra": {"in_cluster": True, "namespace": out["pipeline_namespace"]}},
        "spark_pipeline": {"conn_type": "spark", "host": out["spark_master"],
                           "extra": {"deploy-mode": "client", "namespace": out["pipeline_namespace"]}},
        "aws_default": {"conn_type": "aws", "extra": {"region_name": out["region"]}},
        "mlflow_default": {"conn_type": "http", "host": out["mlflow_tracking_uri"]},
    }


def wire(outputs, env: str | None, base_path: str) -> tuple[dict, str]:
    """The Terraform outputs and the spec's text, validated as a spec; outputs or a base spec that cannot be read or
    do not have the shape expected are :class:`WiringError` (one line, exit 2)."""
    try:
        out = read_outputs(outputs, env)
        base = yaml.safe_load(Path(base_path).read_text(encoding="utf-8")) or {}
        if not isinstance(base, dict):
            raise WiringError(f"--base {base_path}: not a spec (a mapping of sections)")
        spec = cluster_spec(out, base)
        text = f"# Written by pipelines.cluster_config from Terraform outputs (region {out['region']}).\n" + \
            yaml.safe_dump(spec, sort_keys=False)
    except WiringError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise WiringError(f"cannot read the outputs or the base spec: {type(e).__name__}: {e}") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise WiringError(f"the Terraform outputs do not have the shape expected ({type(e).__name__}: {e}): are "
                          "these the outputs of infra/terraform/envs/<env>/aws and .../platform?") from None
    with tempfile.TemporaryDirectory(prefix="cluster-config-") as d:
        (Path(d) / "spec.yaml").write_text(text, encoding="utf-8")
        try:
            load_spec(Path(d) / "spec.yaml", env={})
        except SpecError as e:
            said = str(e).replace(f" in {Path(d) / 'spec.yaml'}", "")  # not a temporary file's name
            raise WiringError(f"the spec these outputs make does not validate (nothing written): {said}") from None
    return out, text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.cluster_config", description=__doc__.splitlines()[0])
    ap.add_argument("--env", help="The environment (dev, prod): without --outputs, run `terraform output -json` in "
                    "infra/terraform/envs/ENV/aws and .../platform; its spec goes to configs/aws-ENV.yaml by default.")
    ap.add_argument("--outputs", action="append", help="A saved `terraform output -json` (read instead of running "
                    "terraform); once per root (aws, then platform), or one file with both roots' outputs.")
    ap.add_argument("--base", default=str(ROOT / "configs" / "demo.yaml"), help="Spec the cluster settings layer onto.")
    ap.add_argument("--out", help="Job spec YAML to write (default with --env: configs/aws-ENV.yaml).")
    ap.add_argument("--connections", help="Write the Airflow connections here (JSON for `airflow connections "
                    "import`, which keeps connections that exist: one set in the UI wins).")
    args = ap.parse_args(argv)
    if not args.env and not args.outputs:
        ap.error("give --env ENV (terraform output of its roots), --outputs FILE (saved outputs), or both")
    if args.env and not all(c.isalnum() or c in "-_" for c in args.env):
        ap.error(f"--env {args.env!r}: an environment's name (letters, digits, '-', '_')")
    args.out = args.out or (str(ROOT / "configs" / f"aws-{args.env}.yaml") if args.env else None)
    if not args.out:
        ap.error("--out is required without --env")
    out_path = Path(args.out).resolve()  # as the user's shell means it (load_spec reads relative paths elsewhere)
    try:
        out, text = wire(args.outputs, args.env, args.base)
    except WiringError as e:
        print(f"cluster_config: error: {e}", file=sys.stderr)
        return USER_ERROR
    except StateUnanswered as e:
        print(f"cluster_config: error: {e}", file=sys.stderr)
        return RETRY
    atomic_write_text(out_path, text)  # only once it validates: a working spec there is never replaced by a bad one
    print(f"cluster_config: wrote {out_path} (launcher.kind=trainjob, Spark {out['spark_master']}, "
          f"MLflow {redact(out['mlflow_tracking_uri'])})")
    if args.connections:
        conns = airflow_connections(out)
        atomic_write_text(args.connections, json.dumps(conns, indent=2) + "\n")
        print(f"cluster_config: wrote {len(conns)} Airflow connections to {args.connections}; load them with "
              f"`airflow connections import {args.connections}` (existing ones are kept)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
