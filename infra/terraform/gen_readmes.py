"""Regenerate each module's README.md: its purpose (below) and tables of its variables and outputs, read
from the HCL with python-hcl2 (tests/test_terraform.py checks every variable and output is listed).

    .venv/bin/python infra/terraform/gen_readmes.py
"""
from pathlib import Path

import hcl2

HERE = Path(__file__).resolve().parent

PURPOSE = {
    "network": """VPC for the stack: private subnets across the given AZs (nodes, FSx, RDS) and public subnets (NAT
gateways, load balancers only), one NAT gateway per AZ (or one for dev), an S3 **gateway** endpoint on the
private route tables so shard and checkpoint traffic never crosses the NAT, interface endpoints (ECR, STS,
CloudWatch Logs, Secrets Manager) with private DNS, a default security group with no rules, and VPC flow
logs to a KMS-encrypted log group. AWS layer.""",
    "storage": """The pipeline's object storage (L2 tier and data plane) and the stack's KMS key. Four buckets, `raw`,
`curated`, `checkpoints`, `mlflow` (the `bucket/` submodule, once per purpose): SSE-KMS with a bucket key
under one customer-managed key (rotation on), versioning, all four public-access blocks, owner-enforced
objects, a TLS-only bucket policy (deny when `aws:SecureTransport` is false), server access logs to a log
bucket, EventBridge notifications, and a lifecycle rule that aborts incomplete multipart uploads and expires
noncurrent versions; `checkpoints` also moves to Standard-IA after `checkpoint_ia_days` and Glacier after
`checkpoint_glacier_days`; in `mlflow`, Airflow's task logs (`airflow-logs/`) expire after `task_log_days` (their bytes
`noncurrent_expiry_days` later: the bucket is versioned), and delete markers left alone are removed.

The key policy (built with `jsonencode`, so `terraform test` sees it at plan) names the account root, EC2 Auto
Scaling's service-linked role (the node volumes), CloudWatch Logs (the stack's log groups) and the FSx file system's
service-linked role for S3, `AWSServiceRoleForFSxS3Access_<fs-id>` (the data repository association's import and
export of SSE-KMS objects). That last role names the file system the key encrypts, so it cannot be in the key's own
policy at creation (key → file system → key): the key is created with the other statements, and
`aws_kms_key_policy`, applied after the association has created the role, sets the full policy, with that exact
role and no wildcard principal. AWS layer.""",
    "fsx": """FSx for Lustre **PERSISTENT_2** (the L1 tier, mounted at `/fsx` in the training pods and Airflow
workers): KMS-encrypted, LZ4-compressed, in the GPU nodes' AZ, with a **data repository association** to the
checkpoint bucket at the trainer's L1 path (`/llm-pipeline/var/tiers/shared`, what `pipelines.cluster_config`
sets `checkpoint.l1` to) that auto-imports and auto-exports new, changed and deleted objects into its own prefix
(`fsx-l1/`, apart from the trainer's L2 uploads). Lustre ports are open to the VPC only. It outputs the file
system's S3 service-linked role, which the storage module's key policy names. The platform layer's `namespaces`
module exposes it through the FSx CSI driver as a static PersistentVolume + claim. AWS layer.""",
    "netpol": """NetworkPolicies of the pipeline's three namespaces (airflow, pipeline, mlflow): a default deny of all
ingress and egress in each, then the flows the pipeline needs: DNS to kube-system; TCP 443 out (S3, STS, ECR and
the Kubernetes API have no fixed addresses); Airflow and the training/Spark pods to MLflow on 5000 (MLflow admits
nothing else); Airflow and MLflow to RDS on 5432 (the private subnets only); Airflow ↔ pipeline and within each (the
Spark driver in a worker and its executors, torchrun rendezvous and NCCL over TCP); Airflow and pipeline to FSx for
Lustre (988, 1018–1023) in the VPC. The VPC CNI enforces them (`enableNetworkPolicy` on its add-on). Platform
layer.""",
    "eks": """EKS from plain resources (not terraform-aws-modules/eks): every resource is visible here and to
checkov, with no transitive module versions to track, and the GPU group's EFA launch template and placement
group would need custom settings in the community module anyway. Control plane: a Kubernetes version in EKS
standard support (`kubernetes_version`, validated against the supported set, dates beside it), private endpoint
(public only from `endpoint_public_cidrs`), secrets envelope-encrypted with KMS, all five control-plane log types
to an encrypted log group, API-mode access entries, an IAM OIDC provider for IRSA (no thumbprint: IAM validates the
EKS issuer against its own CAs, so no `tls` provider). Nodes: a system group (Airflow, MLflow, Spark
driver/executors, add-ons) and a GPU group (p5/p4d/g6e) in one AZ, in a **cluster placement group**, with
`gpu_efa_interfaces` **EFA** interfaces, IMDSv2 only with hop limit 1 (pods use IRSA, never the node role),
encrypted gp3 volumes, tainted `nvidia.com/gpu`. EKS add-ons: the VPC CNI (NetworkPolicy enforcement on),
CoreDNS, kube-proxy, Pod Identity and **FSx CSI**. AWS API only: what runs inside the cluster is the platform
layer's.

Spark runs **on Kubernetes** (`spark-submit --master k8s://…`, executors as pods on the system nodes) rather
than on EMR: one cluster, one IAM model (IRSA), one autoscaler, and the DAG's SparkStageOperator only needs
a different master URL.""",
    "iam": """IRSA roles with least privilege, each assumable only by its one service account through the cluster's
OIDC provider (`sub` and `aud` conditions; trust policies built with `jsonencode`, so `terraform test` checks them
at plan), with bucket access scoped per plane and KMS use limited to Decrypt/GenerateDataKey/DescribeKey on the
stack's key, through S3 only:

| role | reads | writes |
|---|---|---|
| airflow | raw, curated, checkpoints, mlflow | curated, checkpoints, mlflow |
| spark | raw, curated | curated |
| trainer | curated, checkpoints | checkpoints |
| mlflow | mlflow: `artifacts/` only | mlflow: `artifacts/` only |
| airflow_logs | mlflow: `airflow-logs/` only | — |

In the MLflow bucket, shared by the tracking server's artifacts and Airflow's task logs, the `mlflow` and
`airflow_logs` roles read (and the server writes) only their own prefix (`object_prefixes`, the paths
`modules/metadata` configures); listing stays bucket-wide (names, not bytes).

The service accounts themselves are the platform layer's (`namespaces`, the Airflow chart, `metadata`). AWS
layer.""",
    "database": """The metadata database: RDS PostgreSQL 16, encrypted with the stack's KMS key, private, `rds.force_ssl`,
Multi-AZ in prod, deletion protection, Performance Insights, enhanced monitoring, logs exported; it admits
PostgreSQL from the private subnets only. The master password is generated and kept by RDS in Secrets Manager under
the same key (`manage_master_user_password`), never in the configuration; the platform layer's `metadata` module
reads that secret once, in the job that creates each application's own login and databases. AWS layer.""",
    "stack_aws": """The AWS layer of an environment, composed once: `storage` (first: its KMS key encrypts the flow
logs), `network`, `fsx`, `eks`, `iam`, `database`. `envs/dev/aws` and `envs/prod/aws` call it with their sizes and
export its outputs as one object, `stack`, which the platform layer reads from their state and
`python -m pipelines.cluster_config --env ENV` merges with the platform layer's. The IRSA roles trust
`namespace:account` names built from `namespaces`, which the platform layer creates. Only the `aws` provider: this
layer validates and plans (`terraform test` with a mocked provider) wherever that provider installs.""",
    "namespaces": """The pipeline's namespaces and what their workloads may do in the Kubernetes API: `airflow`,
`llm-pipeline` and `mlflow` with Pod Security labels (`mlflow` restricted; `airflow` baseline; the pipeline
namespace `pipeline_pod_security`, baseline unless hostPath scratch is used), FSx for Lustre as a static
PersistentVolume + claim in `airflow` and `llm-pipeline`, and the `spark` and `trainer` service accounts (annotated
with their IRSA roles), created in the namespace resource itself so that a first apply orders them after it (a
precondition checks the name the IRSA role trusts). RBAC in the pipeline namespace:

| Role | bound to | may |
|---|---|---|
| `pipeline-launcher` | Airflow workers | create, get, list, watch, delete TrainJobs and PyTorchJobs; read pods and their logs |
| `spark-driver` | Airflow workers (Spark's client-mode driver runs there) | create, watch, delete executor pods, their config maps, services and claims |
| `pipeline-job-watcher` | Airflow triggerer | get, list, watch, delete TrainJobs and PyTorchJobs; read pods and their logs |

The executors' (`spark`) and training pods' (`trainer`) accounts hold no Role. Platform layer.""",
    "cluster_addons": """What the cluster runs for the pipeline beyond its own workloads, each a Helm release in state at
an exact version: the NVIDIA device plugin and (with EFA) the EFA device plugin on the GPU nodes; **Kubeflow Trainer
v2** (`kubeflow-trainer` chart, TrainJob with JobSet, and the `torch-distributed` runtime the launcher's TrainJobs
use); and with `install_pytorchjob_operator` (default false) the **v1 training-operator v1.8.1** for
`launcher.kind: pytorchjob`. Upstream ships kustomize manifests, not a chart, for v1: `charts/training-operator` is
v1.8.1's manifests (tag and commit in its `Chart.yaml`, provenance in its `SOURCES.md`), reduced to PyTorchJob, and
installed from this repository: no `local-exec`, no kubectl, no download at apply, removed by destroy. Platform
layer.""",
    "metadata": """The metadata plane inside the cluster: the databases `airflow`, `mlflow` and `mlflow_auth` on the AWS
layer's RDS instance, each owned by its application's **own login** (`airflow_app`, `mlflow_app`; the RDS-managed
master login is used only by the job that creates them); the **MLflow tracking server** behind MLflow's
**basic-auth** app (admin login generated, in a Secret; the pipeline's clients get
`MLFLOW_TRACKING_USERNAME`/`_PASSWORD` from the `mlflow-client` Secret in the airflow and pipeline namespaces; image
by digest, `mlflow_image`: the pipeline image, running `python -m pipelines.eval.tracking_server`, which allows the
Service's DNS names as Host headers), a Deployment on the system nodes in the `restricted` mlflow namespace, artifacts proxied to the mlflow
bucket through its IRSA role; and **Airflow** from the official `apache-airflow` Helm chart (KubernetesExecutor, the
**FAB auth manager** with RBAC roles and a generated admin, secret keys of our own, the chart's Kubernetes RBAC, the
workers' service account with its IRSA role, the triggerer's account, FSx mounted at `/fsx`, `pipeline_env`
pointing the job spec at the stack, and `airflow_image` by tag or digest).

Credentials rotate with their consumers: bump `credentials_generation` and apply; the passwords are generated
again, the job sets them on the roles, the Kubernetes Secrets change and the Deployments roll. RDS's own
rotation of the master password reaches no application.

Airflow on EKS rather than MWAA: the stages run in the workers next to the jobs they launch (one image carries
pyspark, torch and this package), the workers get IRSA and namespace RBAC to submit training jobs and Spark
executors directly, and dev/prod differ only in values; MWAA would need its own VPC plumbing, a
requirements/plugins upload of torch-sized dependencies, and an EKS access entry for its execution role. Platform
layer.""",
    "stack_platform": """The platform layer of an environment, composed once: `namespaces`, `cluster_addons`, `metadata`,
`netpol`, and the environment the Airflow workers get so the job spec points at this stack
(`SPARK_MASTER=k8s://…`, `S3_ENDPOINT_URL=aws`, `S3_BUCKET`, `MLFLOW_TRACKING_URI`, `LLMP_HOME` on FSx).
`envs/dev/platform` and `envs/prod/platform` call it with the AWS layer's outputs (`aws`, read from that root's
state; attributes not in its type are ignored) and the images, which it validates (`NAME:TAG` or
`NAME@sha256:<64 hex>`, the digest the registry gives on push: `make image-save`, `skopeo copy --digestfile`), and export its outputs as one object, `stack`. Their
kubernetes and helm providers are configured from the cluster the AWS layer made (found by name), never from a
resource of this layer's own apply.""",
}


def _unq(s):
    return s[1:-1] if isinstance(s, str) and len(s) >= 2 and s[0] == s[-1] == '"' else s


def _fmt(v):
    if v is None:
        return "required"
    v = _unq(v) if isinstance(v, str) else v
    text = str(v).replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if len(text) < 60 else f"`{text[:57]}…`"


def render(module: str) -> str:
    """Module ``module``'s README: its purpose, then its variables and outputs as its .tf files declare them."""
    d = HERE / "modules" / module
    var_rows, out_rows = [], []
    for item in hcl2.load(open(d / "variables.tf")).get("variable", []):
        for name, b in item.items():
            typ = _unq(str(b.get("type", "")))
            typ = typ[2:-1] if typ.startswith("${") and typ.endswith("}") else typ
            var_rows.append(f"| `{_unq(name)}` | `{typ}` | "
                            f"{_fmt(b.get('default'))} | {_unq(b.get('description', ''))} |")
    for item in hcl2.load(open(d / "outputs.tf")).get("output", []):
        for name, b in item.items():
            out_rows.append(f"| `{_unq(name)}` | {_unq(b.get('description', ''))} |")
    return (f"# Module `{module}`\n\n{PURPOSE[module]}\n\n## Variables\n\n| name | type | default | description |\n"
            "|---|---|---|---|\n" + "\n".join(var_rows) + "\n\n## Outputs\n\n| name | description |\n|---|---|\n"
            + "\n".join(out_rows) + "\n")


def main() -> None:
    for module in PURPOSE:
        path = HERE / "modules" / module / "README.md"
        path.write_text(render(module))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
