"""Terraform (infra/terraform) without the registry: fmt, checkov, and HCL-level assertions of the security
properties (python-hcl2 parses every file here; checkov runs from its own venv, .venv-checkov, because it
ships a fork of the same `hcl2` module)."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

hcl2 = pytest.importorskip("hcl2")

TF = ROOT / "infra" / "terraform"
MODULES = ["network", "storage", "fsx", "eks", "iam", "metadata", "netpol", "stack"]
FILES = sorted(TF.rglob("*.tf"))


def _unq(x):
    """python-hcl2 keeps HCL's quotes on strings and block labels; drop them (recursively)."""
    if isinstance(x, str):
        return x[1:-1] if len(x) >= 2 and x[0] == x[-1] == '"' else x
    if isinstance(x, list):
        return [_unq(v) for v in x]
    if isinstance(x, dict):
        return {_unq(k): _unq(v) for k, v in x.items() if k not in ("__is_block__", "__comments__")}
    return x


def parse(path: Path) -> dict:
    with open(path) as f:
        return _unq(hcl2.load(f))


def blocks(kind: str, files=FILES):
    """(file, type, name, body) for every resource/data block, or (file, name, body) for variable/output."""
    for f in files:
        for item in parse(f).get(kind, []):
            for label, body in item.items():
                if kind in ("resource", "data"):
                    for name, b in body.items():
                        yield f, label, name, b
                else:
                    yield f, label, body


def resources(rtype: str | None = None, files=FILES):
    return [(f, t, n, b) for f, t, n, b in blocks("resource", files) if rtype is None or t == rtype]


def one(rtype: str, module: str):
    found = resources(rtype, sorted((TF / "modules" / module).rglob("*.tf")))
    assert found, f"no {rtype} in modules/{module}"
    return found[0][3]


def test_every_file_parses_and_every_module_has_its_files_and_readme():
    assert len(FILES) > 30
    for f in FILES:
        parse(f)  # raises on a syntax error
    for m in MODULES:
        d = TF / "modules" / m
        assert {p.name for p in d.glob("*.tf")} >= {"main.tf", "variables.tf", "outputs.tf", "versions.tf"}, m
        readme = (d / "README.md").read_text()
        for f, name, _ in blocks("variable", [d / "variables.tf"]):
            assert f"`{name}`" in readme, f"modules/{m}/README.md does not list variable {name}"
        for f, name, _ in blocks("output", [d / "outputs.tf"]):
            assert f"`{name}`" in readme, f"modules/{m}/README.md does not list output {name}"


def test_every_variable_is_typed_and_described_and_every_output_described():
    n = 0
    for f, name, body in blocks("variable"):
        assert "type" in body, f"{f.relative_to(TF)}: variable {name} has no type"
        assert len(body.get("description", "")) >= 8, f"{f.relative_to(TF)}: variable {name} has no description"
        n += 1
    for f, name, body in blocks("output"):
        assert len(body.get("description", "")) >= 8, f"{f.relative_to(TF)}: output {name} has no description"
    assert n > 60


def test_every_variable_is_used():
    dirs = {f.parent for f in FILES}
    for d in dirs:
        text = "\n".join(p.read_text() for p in d.glob("*.tf") if p.name != "variables.tf")
        for _, name, _ in blocks("variable", [d / "variables.tf"] if (d / "variables.tf").exists() else []):
            assert f"var.{name}" in text, f"{d.relative_to(TF)}: variable {name} is declared but never used"


# aws_* resource types that take no tags (companion/association resources); every other aws_* resource must
# carry `tags` (the envs add provider default_tags on top).
UNTAGGABLE = {
    "aws_route", "aws_secretsmanager_secret_version", "aws_route_table_association", "aws_kms_alias", "aws_iam_role_policy",
    "aws_iam_role_policy_attachment", "aws_s3_bucket_public_access_block", "aws_s3_bucket_ownership_controls",
    "aws_s3_bucket_versioning", "aws_s3_bucket_server_side_encryption_configuration", "aws_s3_bucket_logging",
    "aws_s3_bucket_lifecycle_configuration", "aws_s3_bucket_policy", "aws_s3_bucket_notification",
}


def test_every_taggable_resource_is_tagged():
    checked = 0
    for f, t, n, b in resources():
        if not t.startswith("aws_") or t in UNTAGGABLE:
            continue
        assert "tags" in b, f"{f.relative_to(TF)}: {t}.{n} has no tags"
        checked += 1
    assert checked > 40


def test_buckets_are_kms_encrypted_versioned_private_tls_only_with_lifecycle():
    bucket_mod = TF / "modules" / "storage" / "bucket"
    sse = one("aws_s3_bucket_server_side_encryption_configuration", "storage/bucket")
    rule = sse["rule"][0]["apply_server_side_encryption_by_default"][0]
    assert rule["sse_algorithm"] == "aws:kms" and rule["kms_master_key_id"] == "${var.kms_key_arn}"
    pab = one("aws_s3_bucket_public_access_block", "storage/bucket")
    assert all(pab[k] is True for k in ("block_public_acls", "block_public_policy", "ignore_public_acls",
                                        "restrict_public_buckets"))
    assert one("aws_s3_bucket_versioning", "storage/bucket")["versioning_configuration"][0]["status"] == "Enabled"
    lc = one("aws_s3_bucket_lifecycle_configuration", "storage/bucket")["rule"][0]
    assert lc["abort_incomplete_multipart_upload"][0]["days_after_initiation"] == "${var.abort_multipart_days}"
    text = (bucket_mod / "main.tf").read_text()
    assert '"STANDARD_IA"' in text and '"GLACIER"' in text
    pol = [b for f, t, n, b in blocks("data", [bucket_mod / "main.tf"]) if t == "aws_iam_policy_document"][0]
    st = pol["statement"][0]
    assert st["effect"] == "Deny" and st["actions"] == ["s3:*"]
    assert st["condition"][0]["variable"] == "aws:SecureTransport" and st["condition"][0]["values"] == ["false"]
    # the storage module instantiates it once per purpose; checkpoints get the cold-tier transitions
    storage = parse(TF / "modules" / "storage" / "main.tf")
    call = storage["module"][0]["bucket"]
    assert call["source"] == "./bucket"
    assert set(re.findall(r'"(\w+)"', call["for_each"])) == {"raw", "curated", "checkpoints", "mlflow"}
    cold = [loc for loc in storage["locals"] if "cold_tiers" in loc][0]["cold_tiers"]
    assert set(cold) == {"checkpoints"} and set(cold["checkpoints"]) == {"ia_days", "glacier_days"}
    assert one("aws_kms_key", "storage")["enable_key_rotation"] is True


def _as_list(v):
    return v if isinstance(v, list) else [v]


def test_no_wildcard_actions_on_wildcard_resources():
    key_policies = {("storage", "kms")}  # a key policy's "*" resource is the key itself
    n = 0
    for f, t, name, body in blocks("data"):
        if t != "aws_iam_policy_document":
            continue
        module = f.parent.name
        for st in body.get("statement", []):
            n += 1
            actions = _as_list(st.get("actions", []))
            res = _as_list(st.get("resources", []))
            assert "*" not in actions, f"{f.relative_to(TF)}: {name} allows action '*'"
            if st.get("effect", "Allow") == "Allow" and "*" in res and (module, name) not in key_policies:
                wild = [a for a in actions if a.endswith(":*")]
                assert not wild, f"{f.relative_to(TF)}: {name} allows {wild} on '*'"
    assert n > 10
    # the IRSA roles trust one service account each, through the cluster's OIDC provider
    iam = [b for f, t, n, b in blocks("data", [TF / "modules/iam/main.tf"]) if n == "assume"][0]
    conds = {c["variable"]: c for c in iam["statement"][0]["condition"]}
    assert set(conds) == {"${var.oidc_issuer}:sub", "${var.oidc_issuer}:aud"}


def test_databases_clusters_filesystems_logs_and_nodes_are_encrypted_and_private():
    db = one("aws_db_instance", "metadata")
    assert db["storage_encrypted"] is True and db["publicly_accessible"] is False
    assert db["manage_master_user_password"] is True and db["kms_key_id"] == "${var.kms_key_arn}"
    assert "password" not in db  # the password never appears in the configuration
    eks = one("aws_eks_cluster", "eks")
    assert eks["encryption_config"][0]["resources"] == ["secrets"]
    assert eks["vpc_config"][0]["endpoint_private_access"] is True
    assert eks["enabled_cluster_log_types"] == "${local.log_types}"
    log_types = parse(TF / "modules/eks/main.tf")["locals"][0]["log_types"]
    assert set(log_types) == {"api", "audit", "authenticator", "controllerManager", "scheduler"}
    fsx = one("aws_fsx_lustre_file_system", "fsx")
    assert fsx["deployment_type"] == "PERSISTENT_2" and fsx["kms_key_id"] == "${var.kms_key_arn}"
    dra = one("aws_fsx_data_repository_association", "fsx")
    s3 = dra["s3"][0]
    assert s3["auto_import_policy"][0]["events"] == s3["auto_export_policy"][0]["events"] == ["NEW", "CHANGED",
                                                                                             "DELETED"]
    for f, t, n, b in resources("aws_cloudwatch_log_group"):
        assert b.get("kms_key_id"), f"{t}.{n} is not KMS-encrypted"
    for f, t, n, b in resources("aws_launch_template"):
        assert b["metadata_options"][0]["http_tokens"] == "required", n  # IMDSv2 only
        assert b["block_device_mappings"][0]["ebs"][0]["encrypted"] is True, n
    gpu = [b for f, t, n, b in resources("aws_launch_template") if n == "gpu"][0]
    assert gpu["placement"][0]["group_name"] == "${aws_placement_group.gpu.name}"
    assert "efa" in json.dumps(gpu["dynamic"])
    assert "subnet_id" not in json.dumps(gpu["dynamic"])  # a managed node group refuses a subnet in its template
    # node-local L0: the instance-store NVMe in RAID0 under the kubelet (nodeadm NodeConfig), on by default
    assert gpu["user_data"] == "${var.gpu_local_nvme_raid0 ? base64encode(local.gpu_user_data) : null}"
    node_config = parse(TF / "modules/eks/main.tf")["locals"][0]["gpu_user_data"]
    assert "application/node.eks.aws" in node_config and re.search(r"localStorage:\s+strategy: RAID0", node_config)
    assert parse(TF / "modules/eks/variables.tf")["variable"][0] and any(
        "gpu_local_nvme_raid0" in v and v["gpu_local_nvme_raid0"]["default"] is True
        for v in parse(TF / "modules/eks/variables.tf")["variable"])
    assert one("aws_placement_group", "eks")["strategy"] == "cluster"


def test_envs_use_a_locked_encrypted_s3_backend_and_the_stack_of_all_modules():
    stack = {k: v for item in parse(TF / "modules/stack/main.tf")["module"] for k, v in item.items()}
    assert set(stack) == set(MODULES) - {"stack"}
    envs = {}
    for env in ("dev", "prod"):
        d = TF / "envs" / env
        backend = parse(d / "backend.tf")["terraform"][0]["backend"][0]["s3"]
        assert backend["encrypt"] is True and backend["use_lockfile"] is True and env in backend["key"]
        (call,) = parse(d / "main.tf")["module"]
        envs[env] = call["stack"]
        assert envs[env]["source"] == "../../modules/stack"
        assert set(parse(d / "terraform.tfvars")) >= {"region", "azs", "airflow_image", "spark_image", "trainer_image",
                                                      "tags"}
    dev, prod = envs["dev"], envs["prod"]
    assert dev["single_nat_gateway"] is True and prod["single_nat_gateway"] is False
    assert dev["db_multi_az"] is False and prod["db_multi_az"] is True and prod["db_deletion_protection"] is True
    assert dev["force_destroy_buckets"] is True and prod["force_destroy_buckets"] is False
    assert prod["gpu_instance_type"] == "p5.48xlarge" and prod["gpu_efa_interfaces"] == 32
    assert dev["gpu_nodes"]["max"] == 1 and dev["gpu_efa_interfaces"] == 0


def test_airflow_workers_get_the_pipeline_env_the_shared_fs_and_their_pod_ip():
    airflow = one("helm_release", "metadata")
    values = airflow["values"][0]
    for needle in ("var.pipeline_env", "status.podIP", "var.shared_fs_mount", "var.shared_fs_claim",
                   'var.irsa_role_arns["airflow"]', "KubernetesExecutor"):
        assert needle in values, needle
    stack = parse(TF / "modules/stack/main.tf")
    env = [loc for loc in stack["locals"] if "pipeline_env" in loc][0]["pipeline_env"]
    from pipelines.spec import ENV_OVERRIDES

    assert set(env) - {"LLMP_HOME"} <= set(ENV_OVERRIDES)  # only names the job spec reads
    assert env["S3_ENDPOINT_URL"] == "aws" and env["SPARK_MASTER"].startswith("k8s://")


def test_every_checkov_skip_is_justified():
    n = 0
    for f in FILES:
        for line in f.read_text().splitlines():
            if "checkov:skip=" in line:
                m = re.search(r"checkov:skip=(CKV2?_[A-Z0-9_]+):(.*)$", line)
                assert m and len(m.group(2).strip()) >= 30, f"{f.relative_to(TF)}: unjustified skip: {line.strip()}"
                n += 1
    assert n >= 1


@pytest.mark.skipif(shutil.which("terraform") is None, reason="the terraform binary is not installed")
def test_terraform_fmt_check():
    r = subprocess.run(["terraform", "fmt", "-check", "-recursive", str(TF)], capture_output=True, text=True)
    assert r.returncode == 0, f"terraform fmt would change: {r.stdout}"


def test_checkov_reports_no_failed_checks():
    checkov = ROOT / ".venv-checkov" / "bin" / "checkov"
    if not checkov.exists():
        pytest.skip("checkov is not installed in .venv-checkov (`make test` installs it)")
    r = subprocess.run([str(checkov), "-d", str(TF), "--compact", "--quiet"], capture_output=True, text=True,
                       timeout=900)
    summary = re.findall(r"Passed checks: (\d+), Failed checks: (\d+), Skipped checks: (\d+)", r.stdout)
    assert summary, r.stdout[-3000:] + r.stderr[-2000:]
    failed = sum(int(s[1]) for s in summary)
    assert failed == 0, r.stdout[-5000:]
    assert sum(int(s[0]) for s in summary) > 300


def test_terraform_outputs_wire_the_dag_to_the_cluster_by_config_only(tmp_path):
    from pipelines import cluster_config as cc
    from pipelines.spec import load_spec
    from pipelines.train import k8s, launch

    # what `terraform output -json` of envs/prod prints: one object, the stack module's outputs
    assert [name for _, name, _ in blocks("output", [TF / "envs/prod/outputs.tf"])] == ["stack"]
    names = [name for _, name, _ in blocks("output", [TF / "modules/stack/outputs.tf"])]
    values = {
        "region": "us-east-1", "cluster_name": "llmp-prod", "cluster_endpoint": "https://ABC.gr7.us-east-1.eks.amazonaws.com",
        "spark_master": "k8s://https://ABC.gr7.us-east-1.eks.amazonaws.com",
        "buckets": {"raw": "llmp-prod-raw-1", "curated": "llmp-prod-curated-1", "checkpoints": "llmp-prod-checkpoints-1",
                    "mlflow": "llmp-prod-mlflow-1"},
        "mlflow_tracking_uri": "http://mlflow.mlflow.svc.cluster.local:5000", "pipeline_namespace": "llm-pipeline",
        "shared_fs_claim": "fsx-checkpoints", "irsa_role_arns": {"trainer": "arn:aws:iam::1:role/llmp-prod-trainer"},
        "service_accounts": {"airflow": "airflow:airflow-worker", "spark": "llm-pipeline:spark",
                             "trainer": "llm-pipeline:trainer", "mlflow": "mlflow:mlflow"},
        "trainer_image": "1.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-trainer:1.0.0", "gpu_efa_interfaces": 32,
        "cluster_ca": "LS0tLS1CRUdJTi...", "spark_image": "1.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-spark:1.0.0",
    }
    assert set(values) == set(names), "the test's outputs drifted from envs/prod/outputs.tf"
    outputs = tmp_path / "tf.json"
    outputs.write_text(json.dumps({"stack": {"value": values, "type": ["object", {}], "sensitive": False}}))
    spec_path, conn_file = tmp_path / "aws-prod.yaml", tmp_path / "connections.json"
    assert cc.main(["--outputs", str(outputs), "--out", str(spec_path), "--connections", str(conn_file)]) == 0
    spec = load_spec(spec_path, env={})
    assert spec.launcher.kind == "trainjob" and spec.launcher.efa_per_node == 32
    assert spec.launcher.service_account == "trainer" and spec.launcher.shared_fs_claim == "fsx-checkpoints"
    assert spec.services.spark_master.startswith("k8s://https://") and spec.services.s3_endpoint_url == "aws"
    assert spec.services.s3_bucket == "llmp-prod-checkpoints-1" and spec.services.spark_service_account == "spark"
    from llm_operators import kubernetes_conf

    conf = kubernetes_conf(spec)  # what the SparkStageOperator adds to spark-submit for the k8s:// master
    assert conf["spark.kubernetes.container.image"] == values["spark_image"]
    assert conf["spark.kubernetes.namespace"] == "llm-pipeline" and conf["spark.pyspark.python"] == "python3"
    launch.check_supported(spec)  # run.root and checkpoint.l0 lie on the shared filesystem
    job = k8s.render_pytorchjob(spec, "r1", [])
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["serviceAccountName"] == "trainer"
    assert {"name": "shared-fs", "mountPath": "/fsx"} in pod["containers"][0]["volumeMounts"]
    conns = json.loads(conn_file.read_text())  # what `airflow connections import` reads
    spark = conns["spark_pipeline"]
    assert spark["host"] == values["spark_master"]
    assert conns["kubernetes_default"]["extra"]["in_cluster"] is True
    assert conns["mlflow_default"]["host"] == values["mlflow_tracking_uri"]
    # missing outputs fail with a message naming them
    outputs.write_text(json.dumps({"region": {"value": "us-east-1"}}))
    assert cc.main(["--outputs", str(outputs), "--out", str(tmp_path / "x.yaml")]) == 2


def _namespaces() -> dict[str, dict]:
    """{namespace resource name: its labels} of every kubernetes_namespace_v1."""
    return {n: b["metadata"][0].get("labels", {}) for f, t, n, b in resources("kubernetes_namespace_v1")}


def test_every_namespace_has_pod_security_labels_and_a_default_deny_network_policy():
    labels = _namespaces()
    assert set(labels) == {"pipeline", "airflow", "mlflow"}
    assert labels["mlflow"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert labels["airflow"] == "${local.namespace_labels.airflow}"
    assert labels["pipeline"] == "${local.namespace_labels.pipeline}"
    eks_locals = [loc for loc in parse(TF / "modules/eks/main.tf")["locals"] if "pod_security" in loc][0]
    assert eks_locals["pod_security"]["airflow"] == "baseline"
    assert "pod-security.kubernetes.io/enforce" in json.dumps(eks_locals["namespace_labels"])
    pss_var = [v for v in parse(TF / "modules/eks/variables.tf")["variable"] if "pipeline_pod_security" in v][0]
    assert pss_var["pipeline_pod_security"]["default"] == "baseline"
    # the reason for each level that is not restricted is written beside it
    eks_src = (TF / "modules/eks/main.tf").read_text()
    assert "baseline, not restricted" in eks_src and "airflow: baseline, because" in eks_src
    # the VPC CNI enforces NetworkPolicies; every namespace denies by default and opens named flows
    addon = one("aws_eks_addon", "eks")
    assert "enableNetworkPolicy" in addon["configuration_values"]
    pols = {n: b for f, t, n, b in resources("kubernetes_network_policy_v1")}
    deny = pols["default_deny"]
    assert deny["for_each"] == "${local.all}" and deny["spec"][0]["policy_types"] == ["Ingress", "Egress"]
    assert deny["spec"][0]["pod_selector"] == [{}] and "ingress" not in deny["spec"][0]
    netpol = {k: v for item in parse(TF / "modules/stack/main.tf")["module"] for k, v in item.items()}["netpol"]
    assert set(netpol["namespaces"]) == {"airflow", "pipeline", "mlflow"}  # one per namespace
    mlflow_in = pols["mlflow_ingress"]["spec"][0]["ingress"][0]
    assert mlflow_in["ports"][0]["port"] == "5000"
    assert "5432" in json.dumps(pols["to_rds"]) and "var.private_subnet_cidrs" in json.dumps(pols["to_rds"])


def test_mlflow_is_authenticated_with_its_credentials_in_secrets_and_its_image_pinned_by_digest():
    dep = [b for f, t, n, b in resources("kubernetes_deployment_v1") if n == "mlflow"][0]
    container = dep["spec"][0]["template"][0]["spec"][0]["container"][0]
    cmd = json.dumps(container["command"])
    assert "--app-name basic-auth" in cmd  # no MLflow on 0.0.0.0 without authentication
    assert not ("0.0.0.0" in cmd and "basic-auth" not in cmd)
    assert {e["name"] for e in container["env"]} == {"MLFLOW_AUTH_CONFIG_PATH"}
    auth = [b for f, t, n, b in resources("kubernetes_secret_v1") if n == "mlflow_auth"][0]
    ini = auth["data"]["basic_auth.ini"]
    assert "admin_password = ${random_password.mlflow_admin.result}" in ini and "default_permission = NO_PERMISSIONS" in ini
    client = [b for f, t, n, b in resources("kubernetes_secret_v1") if n == "mlflow_client"][0]
    assert set(client["data"]) == {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
    from pipelines.train.k8s import MLFLOW_CLIENT_SECRET

    assert client["metadata"][0]["name"] == MLFLOW_CLIENT_SECRET  # the PyTorchJob pods read this one
    # mlflow_image: a variable validated as a digest, wired from the envs through the stack to the Deployment
    assert container["image"] == "${var.mlflow_image}"
    for where in ("modules/metadata/variables.tf", "modules/stack/variables.tf", "envs/dev/variables.tf",
                  "envs/prod/variables.tf"):
        var = [v for v in parse(TF / where)["variable"] if "mlflow_image" in v]
        assert var and "default" not in var[0]["mlflow_image"], where
    validation = [v for v in parse(TF / "modules/metadata/variables.tf")["variable"]
                  if "mlflow_image" in v][0]["mlflow_image"]["validation"][0]["condition"]
    assert "@sha256:[0-9a-f]{64}$" in validation
    stack = {k: v for item in parse(TF / "modules/stack/main.tf")["module"] for k, v in item.items()}
    assert stack["metadata"]["mlflow_image"] == "${var.mlflow_image}"
    for env in ("dev", "prod"):
        (call,) = parse(TF / "envs" / env / "main.tf")["module"]
        assert call["stack"]["mlflow_image"] == "${var.mlflow_image}"
        assert re.search(r"@sha256:[0-9a-f]{64}$", parse(TF / "envs" / env / "terraform.tfvars")["mlflow_image"])
    docker = (ROOT / "infra/docker/mlflow.Dockerfile").read_text()
    lock = (ROOT / "requirements.lock").read_text()
    assert re.search(r"^mlflow==3\.17\.2", lock, re.M) and "mlflow==3.17.2" in docker and "psycopg2" in docker


def test_each_application_has_its_own_database_login_and_rds_admits_only_the_private_subnets():
    secrets = {n: b for f, t, n, b in resources("kubernetes_secret_v1")}
    assert secrets["db"]["data"]["connection"] == "${local.app_dsn[each.key]}"  # not the master login
    meta = [loc for loc in parse(TF / "modules/metadata/main.tf")["locals"] if "apps" in loc][0]
    assert {a["role"] for a in meta["apps"].values()} == {"airflow_app", "mlflow_app"}
    # the master login goes only to the job that creates the roles, in the mlflow namespace's admin secret
    master_users = [n for n, b in secrets.items() if "local.admin_dsn" in json.dumps(b)]
    assert master_users == ["db_admin"]
    pw = {n: b for f, t, n, b in resources("random_password")}
    assert pw["db"]["keepers"] == {"generation": "${var.credentials_generation}"}  # rotation: bump and apply
    rule = one("aws_vpc_security_group_ingress_rule", "metadata")
    assert rule["for_each"] == "${toset(var.private_subnet_cidrs)}" and rule["cidr_ipv4"] == "${each.value}"
    airflow = one("helm_release", "metadata")["values"][0]
    assert "FabAuthManager" in airflow and "rbac" in airflow and "extraEnvFrom" in airflow
    # Airflow 3 values (chart 1.22): the admin is createUserJob's, its password read from a Secret (not in the values
    # Helm keeps in the cluster), the API and JWT keys ours; no Airflow 2 webserver settings
    assert "createUserJob" in airflow and "webserver" not in airflow and "random_password" not in airflow
    assert "admin-login/password" in airflow and "kubernetes_secret_v1.airflow_admin" in airflow
    assert "apiSecretKeySecretName" in airflow and "jwtSecretName" in airflow and "airflowVersion" in airflow
    chart = {k: v for item in parse(TF / "modules/metadata/variables.tf")["variable"] for k, v in item.items()}
    assert chart["airflow_chart_version"]["default"] == "1.22.0"
    secrets_ = {n: b for f, t, n, b in resources("kubernetes_secret_v1")}
    assert secrets_["airflow_admin"]["data"] == {"password": "${random_password.airflow_admin.result}"}


def test_kms_only_via_s3_operator_pinned_to_a_commit_and_fsx_linked_at_the_l1_path():
    doc = [b for f, t, n, b in blocks("data", sorted((TF / "modules/iam").rglob("*.tf")))
           if t == "aws_iam_policy_document" and n == "access"][0]
    kms = [s for s in doc["statement"] if s.get("sid") == "BucketKey"][0]
    assert kms["condition"][0]["variable"] == "kms:ViaService"
    assert kms["condition"][0]["values"] == ["s3.${data.aws_region.current.name}.amazonaws.com"]
    op = [b for f, t, n, b in resources("terraform_data") if n == "training_operator"][0]
    assert "?ref=${var.training_operator_commit}" in op["provisioner"][0]["local-exec"]["command"]
    assert op["count"] == "${var.install_pytorchjob_operator ? 1 : 0}"  # v1 only when asked for
    trainer = {n: b for f, t, n, b in resources("helm_release")}["kubeflow_trainer"]  # v2 in state, pinned
    assert trainer["chart"] == "kubeflow-trainer" and trainer["version"] == "${var.trainer_chart_version}"
    assert "torchDistributed" in trainer["values"][0]
    chart = [v for v in parse(TF / "modules/eks/variables.tf")["variable"] if "trainer_chart_version" in v][0]
    version = chart["trainer_chart_version"]["default"]
    crd = (ROOT / "infra/k8s/crds/trainer.kubeflow.org_trainjobs.yaml").read_text()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version) and f"v{version}" in (ROOT / "infra/k8s/crds/SOURCES.md").read_text()
    assert "kind: TrainJob" in crd
    commit = [v for v in parse(TF / "modules/eks/variables.tf")["variable"] if "training_operator_commit" in v][0]
    assert re.fullmatch(r"[0-9a-f]{40}", commit["training_operator_commit"]["default"])
    from pipelines.cluster_config import cluster_spec

    fsx_vars = {k: v for item in parse(TF / "modules/fsx/variables.tf")["variable"] for k, v in item.items()}
    spec = cluster_spec({"service_accounts": {"trainer": "ns:t", "spark": "ns:s"}, "trainer_image": "i",
                         "pipeline_namespace": "ns", "shared_fs_claim": "c", "gpu_efa_interfaces": 0,
                         "spark_master": "k8s://x", "spark_image": "s", "buckets": {"checkpoints": "b", "mlflow": "m"},
                         "region": "r", "mlflow_tracking_uri": "u"}, {})
    assert spec["checkpoint"]["l1"] == "/fsx" + fsx_vars["repository_path"]["default"]  # the DRA links L1


def test_apply_needs_no_drift_or_missing_grant_and_documented_knobs_reach_the_resources():
    """use_lockfile needs Terraform 1.10; RDS pins only the major while minors upgrade themselves; the node volumes'
    key lets Auto Scaling's service-linked role use and grant it; gpu_capacity_type and pipeline_pod_security go
    from each env through the stack to the eks module."""
    for f in sorted(TF.rglob("versions.tf")):
        required = parse(f)["terraform"][0]["required_version"]
        m = re.fullmatch(r">= 1\.(\d+)", required)
        assert m and int(m.group(1)) >= 10, (f, required)
    db = one("aws_db_instance", "metadata")
    assert db["auto_minor_version_upgrade"] is True and re.fullmatch(r"\d+", db["engine_version"])
    kms = [b for f, t, n, b in blocks("data", [TF / "modules/storage/main.tf"]) if t == "aws_iam_policy_document"
           and n == "kms"][0]
    by_sid = {s["sid"]: s for s in kms["statement"]}
    stack = {k: v for item in parse(TF / "modules/stack/main.tf")["module"] for k, v in item.items()}
    # the role must exist before the key names it: created (a fresh account) or looked up (a clear plan error)
    role = [loc for loc in parse(TF / "modules/storage/main.tf")["locals"] if "autoscaling_role" in loc][0]
    assert "aws_iam_service_linked_role.autoscaling[0].arn" in role["autoscaling_role"]
    assert "data.aws_iam_role.autoscaling[0].arn" in role["autoscaling_role"]
    slr = one("aws_iam_service_linked_role", "storage")
    assert slr["aws_service_name"] == "autoscaling.amazonaws.com"
    assert slr["count"] == "${var.create_autoscaling_service_role ? 1 : 0}"
    assert stack["storage"]["create_autoscaling_service_role"] == "${var.create_autoscaling_service_role}"
    # CAPACITY_BLOCK launches into its reservation; any other value is refused at plan
    tmpl = {n: b for f, t, n, b in resources("aws_launch_template")}["gpu"]
    assert "capacity-block" in json.dumps(tmpl["dynamic"]) and "gpu_capacity_reservation_id" in json.dumps(tmpl["dynamic"])
    eks_vars = {k: v for item in parse(TF / "modules/eks/variables.tf")["variable"] for k, v in item.items()}
    assert "CAPACITY_BLOCK" in eks_vars["gpu_capacity_type"]["validation"][0]["condition"]
    asg = by_sid["AutoScalingVolumes"]
    assert asg["principals"][0]["identifiers"] == ["${local.autoscaling_role}"] and "kms:Decrypt" in asg["actions"]
    assert "kms:GenerateDataKey*" in asg["actions"] and "kms:ReEncrypt*" in asg["actions"]
    grant = by_sid["AutoScalingVolumeGrants"]
    assert grant["principals"] == asg["principals"]
    assert grant["actions"] == ["kms:CreateGrant"] and grant["condition"][0]["variable"] == "kms:GrantIsForAWSResource"
    stack = {k: v for item in parse(TF / "modules/stack/main.tf")["module"] for k, v in item.items()}
    for knob in ("gpu_capacity_type", "pipeline_pod_security", "gpu_capacity_reservation_id"):
        assert stack["eks"][knob] == f"${{var.{knob}}}"
        for env in ("dev", "prod"):
            (call,) = parse(TF / "envs" / env / "main.tf")["module"]
            assert call["stack"][knob] == f"${{var.{knob}}}", (env, knob)


def test_the_launcher_role_covers_trainjobs_and_binds_the_workers_and_the_triggerer():
    """A deferred wait runs in the triggerer: it must read the job and its pods' logs and delete a job whose task a
    user stopped, as an identity Terraform grants (the chart's triggerer service account, bound here)."""
    role = {n: b for f, t, n, b in resources("kubernetes_role_v1")}["launcher"]
    rules = {g: r for r in role["rule"] for g in r["api_groups"]}
    assert rules["trainer.kubeflow.org"]["resources"] == ["trainjobs"] and "delete" in rules["trainer.kubeflow.org"]["verbs"]
    assert "pytorchjobs" in rules["kubeflow.org"]["resources"] and "pods/log" in rules[""]["resources"]
    binding = {n: b for f, t, n, b in resources("kubernetes_role_binding_v1")}["airflow_launcher"]
    names = [s["name"] for s in binding["subject"]]
    assert len(names) == 2 and "${split(\":\", var.triggerer_service_account)[1]}" in names
    default = [v for v in parse(TF / "modules/iam/variables.tf")["variable"] if "triggerer_service_account" in v]
    assert default[0]["triggerer_service_account"]["default"] == "airflow:airflow-triggerer"
    airflow = one("helm_release", "metadata")["values"][0]
    assert "airflow-triggerer" in airflow  # the chart's triggerer runs as exactly that account
