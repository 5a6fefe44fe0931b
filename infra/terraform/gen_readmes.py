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
logs to a KMS-encrypted log group.""",
    "storage": """The pipeline's object storage (L2 tier and data plane) and the stack's KMS key. Four buckets, `raw`,
`curated`, `checkpoints`, `mlflow` (the `bucket/` submodule, once per purpose): SSE-KMS with a bucket key
under one customer-managed key (rotation on), versioning, all four public-access blocks, owner-enforced
objects, a TLS-only bucket policy (deny when `aws:SecureTransport` is false), server access logs to a log
bucket, EventBridge notifications, and a lifecycle rule that aborts incomplete multipart uploads and expires
noncurrent versions; `checkpoints` also moves to Standard-IA after `checkpoint_ia_days` and Glacier after
`checkpoint_glacier_days`. The key policy lets CloudWatch Logs use the key for the stack's log groups.""",
    "fsx": """FSx for Lustre **PERSISTENT_2** (the L1 tier, mounted at `/fsx` in the training pods and Airflow
workers): KMS-encrypted, LZ4-compressed, in the GPU nodes' AZ, with a **data repository association** to the
checkpoint bucket at the trainer's L1 path (`/llm-pipeline/var/tiers/shared`, what `pipelines.cluster_config`
sets `checkpoint.l1` to) that auto-imports and auto-exports new, changed and deleted objects into its own prefix
(`fsx-l1/`, apart from the trainer's L2 uploads). Lustre ports are open to the VPC only.
The eks module exposes it through the FSx CSI driver as a static PersistentVolume + claim.""",
    "netpol": """NetworkPolicies of the pipeline's three namespaces (airflow, pipeline, mlflow): a default deny of all
ingress and egress in each, then the flows the pipeline needs: DNS to kube-system; TCP 443 out (S3, STS, ECR and
the Kubernetes API have no fixed addresses); Airflow and the training/Spark pods to MLflow on 5000 (MLflow admits
nothing else); Airflow and MLflow to RDS on 5432 (the private subnets only); Airflow ↔ pipeline and within each (the
Spark driver in a worker and its executors, torchrun rendezvous and NCCL over TCP); Airflow and pipeline to FSx for
Lustre (988, 1018–1023) in the VPC. The VPC CNI enforces them (`enableNetworkPolicy` on its add-on).""",
    "eks": """EKS from plain resources (not terraform-aws-modules/eks): every resource is visible here and to
checkov, with no transitive module versions to track, and the GPU group's EFA launch template and placement
group would need custom settings in the community module anyway. Control plane: private endpoint (public
only from `endpoint_public_cidrs`), secrets envelope-encrypted with KMS, all five control-plane log types to
an encrypted log group, API-mode access entries, an IAM OIDC provider for IRSA. Nodes: a system group
(Airflow, MLflow, Spark driver/executors, add-ons) and a GPU group (p5/p4d) in one AZ, in a **cluster
placement group**, with `gpu_efa_interfaces` **EFA** interfaces, IMDSv2 only with hop limit 1 (pods use
IRSA, never the node role), encrypted gp3 volumes, tainted `nvidia.com/gpu`. In the cluster: the VPC CNI,
CoreDNS, kube-proxy, Pod Identity and **FSx CSI** add-ons; the **NVIDIA** and **EFA device plugins** (Helm);
the **Kubeflow training operator** (`PyTorchJob` v1, its standalone kustomize overlay applied with kubectl);
the pipeline and Airflow namespaces with the FSx claim in each; RBAC for Spark on Kubernetes (the driver
creates executor pods) and for Airflow's workers to submit PyTorchJobs and read pod logs.

Spark runs **on Kubernetes** (`spark-submit --master k8s://…`, executors as pods on the system nodes) rather
than on EMR: one cluster, one IAM model (IRSA), one autoscaler, and the DAG's SparkStageOperator only needs
a different master URL.""",
    "iam": """IRSA roles with least privilege, each assumable only by its one service account through the cluster's
OIDC provider (`sub` and `aud` conditions), with bucket access scoped per plane and KMS use limited to
Decrypt/GenerateDataKey/DescribeKey on the stack's key:

| role | reads | writes |
|---|---|---|
| airflow | raw, curated, checkpoints, mlflow | curated, checkpoints, mlflow |
| spark | raw, curated | curated |
| trainer | curated, checkpoints | checkpoints |
| mlflow | mlflow | mlflow |

It also creates the `spark` and `trainer` service accounts (annotated with their role) and binds the eks
module's Spark-driver and launcher roles.""",
    "stack": """The whole stack composed once: `storage` (first: its KMS key encrypts the flow logs), `network`, `fsx`,
`eks`, `iam`, `metadata`, and the environment the Airflow workers get so the job spec points at this stack
(`SPARK_MASTER=k8s://…`, `S3_ENDPOINT_URL=aws`, `S3_BUCKET`, `MLFLOW_TRACKING_URI`, `LLMP_HOME` on FSx).
`envs/dev` and `envs/prod` call it with their sizes and export its outputs as one object, `stack`, which
`python -m pipelines.cluster_config --env ENV` reads.""",
    "metadata": """The metadata plane: RDS PostgreSQL 16 (encrypted with KMS, private, `rds.force_ssl`, Multi-AZ in
prod, deletion protection, Performance Insights, enhanced monitoring, logs exported; admits PostgreSQL from the
private subnets only; the master password generated and kept by RDS in Secrets Manager, never in the
configuration) with databases `airflow`, `mlflow` and `mlflow_auth`, each owned by its application's **own login**
(`airflow_app`, `mlflow_app`; the master login is used only by the job that creates them); the **MLflow tracking
server** behind MLflow's **basic-auth** app (admin login generated, in a Secret; the pipeline's clients get
`MLFLOW_TRACKING_USERNAME`/`_PASSWORD` from the `mlflow-client` Secret in the airflow and pipeline namespaces; image
by digest, `mlflow_image`, built from `infra/docker/mlflow.Dockerfile`: MLflow 3.17.2 as the client, psycopg2,
boto3), a Deployment on the system nodes in a `restricted` Pod Security namespace, artifacts proxied to the mlflow
bucket through its IRSA role; and **Airflow** from the official `apache-airflow` Helm chart (KubernetesExecutor, the
**FAB auth manager** with RBAC roles and a generated admin, secret keys of our own, the chart's Kubernetes RBAC, the
workers' service account with its IRSA role, FSx mounted at `/fsx`, and `pipeline_env` pointing the job spec at the
stack).

Credentials rotate with their consumers: bump `credentials_generation` and apply; the passwords are generated
again, the job sets them on the roles, the Kubernetes Secrets change and the Deployments roll. RDS's own
rotation of the master password reaches no application.

Airflow on EKS rather than MWAA: the stages run in the workers next to the jobs they launch (one image carries
pyspark, torch and this package), the workers get IRSA and namespace RBAC to submit PyTorchJobs and Spark
executors directly, and dev/prod differ only in values; MWAA would need its own VPC plumbing, a
requirements/plugins upload of torch-sized dependencies, and an EKS access entry for its execution role.""",
}


def _unq(s):
    return s[1:-1] if isinstance(s, str) and len(s) >= 2 and s[0] == s[-1] == '"' else s


def _fmt(v):
    if v is None:
        return "required"
    v = _unq(v) if isinstance(v, str) else v
    text = str(v).replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if len(text) < 60 else f"`{text[:57]}…`"


def main() -> None:
    for module, purpose in PURPOSE.items():
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
        text = (f"# Module `{module}`\n\n{purpose}\n\n## Variables\n\n| name | type | default | description |\n"
                "|---|---|---|---|\n" + "\n".join(var_rows) + "\n\n## Outputs\n\n| name | description |\n|---|---|\n"
                + "\n".join(out_rows) + "\n")
        (d / "README.md").write_text(text)
        print(f"wrote {d / 'README.md'}: {len(var_rows)} variables, {len(out_rows)} outputs")


if __name__ == "__main__":
    main()
