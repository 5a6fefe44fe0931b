"""Terraform (infra/terraform): `make tf-check`'s script (fmt; init, validate and `terraform test` of each root whose
providers install here; checkov), and HCL-level assertions of the security properties and the wiring (python-hcl2
parses every file here; checkov runs from its own venv, .venv-checkov, because it ships a fork of the same `hcl2`
module)."""
import importlib.util
import functools
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT

hcl2 = pytest.importorskip("hcl2")

TF = ROOT / "infra" / "terraform"
FILES = sorted(TF.rglob("*.tf"))


def _unq(x):
    """python-hcl2 keeps HCL's quotes on strings and block labels; drop them (recursively)."""
    if isinstance(x, str):
        return x[1:-1] if len(x) >= 2 and x[0] == x[-1] == '"' else x
    if isinstance(x, list):
        return [_unq(v) for v in x]
    if isinstance(x, dict):
        return {_unq(k): _unq(v) for k, v in x.items() if k not in ("__is_block__", "__comments__", "__inline_comments__")}
    return x


@functools.lru_cache(maxsize=None)
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


AWS_MODULES = ["network", "storage", "fsx", "eks", "iam", "database", "stack_aws"]
PLATFORM_MODULES = ["namespaces", "cluster_addons", "metadata", "netpol", "stack_platform"]
MODULES = AWS_MODULES + PLATFORM_MODULES
ENVS = ("dev", "prod")
IMAGE_EXAMPLES = {
    "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline:dev": True,
    "localhost/llm-pipeline:latest": True,
    "localhost:5000/llm-pipeline@sha256:" + "0" * 64: True,
    "repo:1.0@sha256:" + "a" * 64: True,
    "repo": False,  # neither tag nor digest
    "repo@sha256:abc": False,
    "Repo:tag": False,
    "repo:tag@sha256:" + "A" * 64: False,
}


def calls(path: Path) -> dict:
    """{module name: its arguments} of the module blocks in one file."""
    return {k: v for item in parse(path).get("module", []) for k, v in item.items()}


def variables(path: Path) -> dict:
    return {k: v for item in parse(path).get("variable", []) for k, v in item.items()}


def local(path: Path, name: str):
    return [loc for loc in parse(path)["locals"] if name in loc][0][name]


def _module_from(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen_readmes = _module_from(TF / "gen_readmes.py")


def test_every_file_parses_and_every_module_has_its_files_and_readme():
    assert len(FILES) > 50
    for f in FILES:
        parse(f)  # raises on a syntax error
    assert {p.name for p in (TF / "modules").iterdir() if p.is_dir()} == set(MODULES)
    for m in MODULES:
        d = TF / "modules" / m
        assert {p.name for p in d.glob("*.tf")} >= {"main.tf", "variables.tf", "outputs.tf", "versions.tf"}, m
        readme = (d / "README.md").read_text()
        assert readme == gen_readmes.render(m), f"modules/{m}/README.md: run infra/terraform/gen_readmes.py"
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
    "aws_s3_bucket_lifecycle_configuration", "aws_s3_bucket_policy", "aws_s3_bucket_notification", "aws_kms_key_policy",
    "aws_eks_access_policy_association", "aws_autoscaling_group_tag",  # a tag itself
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
    assert call["for_each"] == "${local.bucket_names}" and call["bucket"] == "${each.value}"
    names = [loc for loc in storage["locals"] if "bucket_names" in loc][0]["bucket_names"]
    assert set(re.findall(r'"(\w+)"', names)) == {"raw", "curated", "checkpoints", "mlflow"}
    cold = [loc for loc in storage["locals"] if "cold_tiers" in loc][0]["cold_tiers"]
    assert set(cold) == {"checkpoints"} and set(cold["checkpoints"]) == {"ia_days", "glacier_days"}
    assert one("aws_kms_key", "storage")["enable_key_rotation"] is True


def _as_list(v):
    return v if isinstance(v, list) else [v]


def test_no_wildcard_actions_on_wildcard_resources_and_irsa_trusts_one_account():
    n = 0
    for f, t, name, body in blocks("data"):
        if t != "aws_iam_policy_document":
            continue
        for st in body.get("statement", []):
            n += 1
            actions = _as_list(st.get("actions", []))
            res = _as_list(st.get("resources", []))
            assert "*" not in actions, f"{f.relative_to(TF)}: {name} allows action '*'"
            if st.get("effect", "Allow") == "Allow" and "*" in res:
                wild = [a for a in actions if a.endswith(":*")]
                assert not wild, f"{f.relative_to(TF)}: {name} allows {wild} on '*'"
    assert n > 8
    # the IRSA roles trust one service account each, through the cluster's OIDC provider (terraform test checks the
    # rendered policies; here: the document the roles use)
    trust = json.dumps(local(TF / "modules/iam/main.tf", "assume_role_policies"))
    assert "${var.oidc_issuer}:sub" in trust and "${var.oidc_issuer}:aud" in trust
    assert "system:serviceaccount:${var.service_accounts[k]}" in trust and "sts:AssumeRoleWithWebIdentity" in trust
    role = one("aws_iam_role", "iam")
    assert role["assume_role_policy"] == "${local.assume_role_policies[each.key]}"


def test_databases_clusters_filesystems_logs_and_nodes_are_encrypted_and_private():
    db = one("aws_db_instance", "database")
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
    assert variables(TF / "modules/eks/variables.tf")["gpu_local_nvme_raid0"]["default"] is True
    assert one("aws_placement_group", "eks")["strategy"] == "cluster"


def _aws_module_dirs(root: Path) -> set[Path]:
    """Every module directory a root uses, following local sources."""
    seen, todo = set(), [root]
    while todo:
        d = todo.pop()
        if d in seen:
            continue
        seen.add(d)
        for f in d.glob("*.tf"):
            for call in calls(f).values():
                todo.append((d / call["source"]).resolve())
    return seen


def test_two_roots_per_env_aws_then_platform_with_no_provider_from_its_own_apply():
    """The AWS layer needs only the aws provider (so it validates and plans wherever that one installs); the platform
    layer reads the AWS layer's state and configures kubernetes/helm from the existing cluster, found by name."""
    for env in ENVS:
        aws, platform = TF / "envs" / env / "aws", TF / "envs" / env / "platform"
        keys = {}
        for layer, d in (("aws", aws), ("platform", platform)):
            backend = parse(d / "backend.tf")["terraform"][0]["backend"][0]["s3"]
            assert backend["encrypt"] is True and backend["use_lockfile"] is True
            keys[layer] = backend["key"]
            assert keys[layer] == f"llm-pipeline/{env}/{layer}.tfstate"
        assert (TF / "envs" / env / "backend.hcl.example").exists()  # one backend.hcl for both roots
        # the AWS layer: the aws provider only, in every module it uses
        for d in _aws_module_dirs(aws):
            required = parse(d / "versions.tf")["terraform"][0].get("required_providers", [{}])[0]
            assert set(required) <= {"aws"}, f"{d.relative_to(TF)} needs {set(required) - {'aws'}} in the AWS layer"
        assert {p for item in parse(aws / "providers.tf")["provider"] for p in item} == {"aws"}
        assert calls(aws / "main.tf")["stack_aws"]["source"] == "../../../modules/stack_aws"
        # the platform layer: the AWS layer's state, and providers from the cluster found by name
        main = parse(platform / "main.tf")
        state = main["data"][0]["terraform_remote_state"]["aws"]
        assert state["backend"] == "s3" and state["config"]["key"] == keys["aws"]
        assert local(platform / "main.tf", "aws") == "${data.terraform_remote_state.aws.outputs.stack}"
        stack = calls(platform / "main.tf")["stack_platform"]
        assert stack["source"] == "../../../modules/stack_platform" and stack["aws"] == "${local.aws}"
        providers = parse(platform / "providers.tf")
        eks = providers["data"][0]["aws_eks_cluster"]["this"]
        assert eks["name"] == "${local.aws.cluster_name}"
        cluster = local(platform / "providers.tf", "cluster")
        assert cluster["host"] == "${data.aws_eks_cluster.this.endpoint}"
        assert "data.aws_eks_cluster.this.certificate_authority" in cluster["cluster_ca_certificate"]
        conf = {p: body for item in providers["provider"] for p, body in item.items()}
        assert conf["kubernetes"]["host"] == "${local.cluster.host}"
        assert conf["helm"]["kubernetes"][0]["host"] == "${local.cluster.host}"
        text = (platform / "providers.tf").read_text()
        assert "module." not in text  # nothing of its own apply
    # dev and prod differ only in sizes: the same arguments, and the platform layers alike but for the state they read
    dev, prod = (calls(TF / "envs" / e / "aws" / "main.tf")["stack_aws"] for e in ENVS)
    assert set(dev) == set(prod)
    sizes = {k for k in dev if dev[k] != prod[k]}
    assert sizes <= {"name", "single_nat_gateway", "force_destroy_buckets", "fsx_capacity_gib", "fsx_throughput_per_tib",
                     "system_nodes", "gpu_instance_type", "gpu_efa_interfaces", "gpu_nodes", "db_instance_class",
                     "db_multi_az", "db_deletion_protection"}, sizes
    assert dev["single_nat_gateway"] is True and prod["single_nat_gateway"] is False
    assert dev["db_multi_az"] is False and prod["db_multi_az"] is True and prod["db_deletion_protection"] is True
    assert dev["force_destroy_buckets"] is True and prod["force_destroy_buckets"] is False
    # prod asks for EFA only when told (its variable, default 0: the image has no aws-ofi-nccl for NCCL to use it)
    assert prod["gpu_instance_type"] == "p5.48xlarge" and prod["gpu_efa_interfaces"] == "${var.gpu_efa_interfaces}"
    assert dev["gpu_nodes"]["max"] == 1 and dev["gpu_efa_interfaces"] == "${var.gpu_efa_interfaces}"
    plat = [(TF / "envs" / e / "platform" / "main.tf").read_text().replace(e, "ENV") for e in ENVS]
    assert plat[0] == plat[1]
    for name in ("variables.tf", "providers.tf", "outputs.tf", "versions.tf"):
        for layer in ("aws", "platform"):
            assert (TF / "envs/dev" / layer / name).read_text() == (TF / "envs/prod" / layer / name).read_text(), \
                (layer, name)


def test_the_pipeline_accounts_are_created_in_the_namespace_resource():
    """First-apply race: the spark and trainer service accounts name the pipeline namespace resource itself, so they
    are created after it; the IRSA subject they must match is checked before the apply."""
    sa = [b for f, t, n, b in resources("kubernetes_service_account_v1") if n == "pipeline"][0]
    assert sa["metadata"][0]["namespace"] == "${kubernetes_namespace_v1.pipeline.metadata[0].name}"
    assert sa["metadata"][0]["annotations"] == {"eks.amazonaws.com/role-arn": "${var.irsa_role_arns[each.key]}"}
    assert "local.sa[each.key].namespace == var.namespaces.pipeline" in sa["lifecycle"][0]["precondition"][0]["condition"]
    for f, t, n, b in resources(files=sorted((TF / "modules/namespaces").glob("*.tf"))):
        ns = b.get("metadata", [{}])[0].get("namespace")
        assert ns is None or ns.startswith("${kubernetes_namespace_v1.") or ns == "${each.value}", (t, n, ns)
    # the namespace names the AWS layer's IRSA roles trust are the ones the platform creates
    assert calls(TF / "modules/stack_platform/main.tf")["namespaces"]["namespaces"] == "${var.aws.namespaces}"
    sas = local(TF / "modules/stack_aws/main.tf", "service_accounts")
    assert sas["spark"] == "${var.namespaces.pipeline}:spark" and sas["trainer"] == "${var.namespaces.pipeline}:trainer"


def test_airflow_workers_get_the_pipeline_env_the_shared_fs_and_their_pod_ip():
    airflow = one("helm_release", "metadata")
    values = airflow["values"][0]
    for needle in ("var.pipeline_env", "status.podIP", "var.shared_fs_mount", "var.shared_fs_claim",
                   'var.irsa_role_arns["airflow"]', "KubernetesExecutor", "defaultAirflowDigest"):
        assert needle in values, needle
    env = local(TF / "modules/stack_platform/main.tf", "pipeline_env")
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


def test_each_aws_root_has_terraform_tests_of_what_matters():
    """`terraform test` files plan each AWS layer with a mocked provider; what they assert (tf-check runs them)."""
    for env in ENVS:
        tests = sorted((TF / "envs" / env / "aws").glob("*.tftest.hcl"))
        assert tests, f"envs/{env}/aws has no *.tftest.hcl"
        text = "\n".join(t.read_text() for t in tests)
        assert 'mock_provider "aws"' in text and "command = plan" in text and "command = apply" not in text
        for needle in ("aws:kms", "output.stack.encryption.fsx", "eks_secrets", "output.stack.encryption.rds",
                       "AWSServiceRoleForAutoScaling", "AWSServiceRoleForFSxS3Access_", "node_groups.system",
                       "node_groups.gpu", "data_repository_path", "/llm-pipeline/var/tiers/shared",
                       "system:serviceaccount:llm-pipeline:spark", "system:serviceaccount:llm-pipeline:trainer",
                       "expect_failures = [var.kubernetes_version]", 'r.prefix == "airflow-logs/"',
                       'labels["nvidia.com/gpu.present"]'):
            assert needle in text, f"envs/{env}/aws tests do not check {needle}"
        assert text.count("assert {") >= 12


def _tf_check(tmp_path, checkov: str):
    env = {**os.environ, "TF_CHECK_WORK": str(tmp_path / "work"), "CHECKOV": checkov}
    return subprocess.run(["bash", str(ROOT / "scripts/tf_check.sh")], capture_output=True, text=True, env=env,
                          timeout=900, cwd=ROOT)


@pytest.mark.skipif(shutil.which("terraform") is None, reason="the terraform binary is not installed")
def test_tf_check_formats_validates_and_tests_every_root_and_checkov_passes(tmp_path):
    """`make tf-check`'s script: fmt, init + validate (+ test) per root, checkov. The AWS roots must validate and pass
    their tests wherever the aws provider installs (a mirror here); a root that cannot install its providers is
    skipped naming them, never silently; checkov reports no failed check."""
    checkov = ROOT / ".venv-checkov" / "bin" / "checkov"
    r = _tf_check(tmp_path, str(checkov) if checkov.exists() else "skip")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    summary = out.split("== tf-check summary")[1]
    assert "ok       terraform fmt" in summary
    roots = {f"infra/terraform/envs/{e}/{layer}" for e in ENVS for layer in ("aws", "platform")}
    for root in roots:  # every root is reported
        assert re.search(rf"^(ok|skipped) +{re.escape(root)} \(", summary, re.M), (root, summary)
    for line in summary.splitlines():
        if line.startswith("skipped  infra/"):
            assert re.search(r"providers not installable here: \S+", line), line
    mirror = "providers from the mirror" in out
    if mirror:  # the aws provider is there: the AWS layers are validated and tested, not skipped
        for e in ENVS:
            assert f"ok       infra/terraform/envs/{e}/aws (init validate test)" in summary, summary
        for e in ENVS:  # every run block of the root's tests passed (none skipped or failed)
            runs = sum(f.read_text().count('\nrun "') for f in (TF / "envs" / e / "aws").glob("*.tftest.hcl"))
            assert runs >= 2 and f"Success! {runs} passed, 0 failed" in out, (e, runs)
    if checkov.exists():
        found = re.findall(r"Passed checks: (\d+), Failed checks: (\d+), Skipped checks: (\d+)", out)
        assert found and sum(int(s[1]) for s in found) == 0, out[-5000:]
        assert sum(int(s[0]) for s in found) > 300
        assert not re.search(r"Parsing errors: [1-9]", out), "checkov left a file unparsed"
        assert "ok       checkov" in summary
    else:
        pytest.skip("checkov is not installed in .venv-checkov (`make test` installs it); the rest passed")


def test_tf_check_fails_on_a_terraform_test_that_fails(tmp_path):
    """The script's exit code follows terraform: a copy of the tree whose AWS layer breaks an asserted property (the FSx
    role left out of the key policy) fails `make tf-check`."""
    if shutil.which("terraform") is None or not Path("/opt/tf-plugins/registry.terraform.io").is_dir():
        pytest.skip("needs terraform and the aws provider mirror at /opt/tf-plugins")
    tree = tmp_path / "repo"
    shutil.copytree(TF, tree / "infra/terraform", ignore=shutil.ignore_patterns(".terraform*"))
    shutil.copytree(ROOT / "scripts", tree / "scripts")
    for p in sorted((tree / "infra/terraform/envs").glob("*/platform")) + [tree / "infra/terraform/envs/prod/aws"]:
        shutil.rmtree(p)  # one root is enough
    storage = tree / "infra/terraform/modules/storage/main.tf"
    text = storage.read_text()
    assert "concat(local.key_statements, local.fsx_statements)" in text
    storage.write_text(text.replace("concat(local.key_statements, local.fsx_statements)", "local.key_statements"))
    env = {**os.environ, "TF_CHECK_WORK": str(tmp_path / "work"), "CHECKOV": "skip"}
    r = subprocess.run(["bash", str(tree / "scripts/tf_check.sh")], capture_output=True, text=True, env=env,
                       timeout=600, cwd=tree)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "FAILED (test) infra/terraform/envs/dev/aws" in r.stdout
    assert "FSx service-linked role" in r.stdout + r.stderr  # the assertion that failed, named


def test_terraform_outputs_wire_the_dag_to_the_cluster_by_config_only(tmp_path, capsys):
    from pipelines import cluster_config as cc
    from pipelines.spec import load_spec
    from pipelines.launch import k8s
    from pipelines.launch import ranks

    # what `terraform output -json` prints in envs/prod/aws and envs/prod/platform: one object each, the stack's outputs
    for layer in ("aws", "platform"):
        assert [name for _, name, _ in blocks("output", [TF / f"envs/prod/{layer}/outputs.tf"])] == ["stack"]
    aws_names = [name for _, name, _ in blocks("output", [TF / "modules/stack_aws/outputs.tf"])]
    platform_names = [name for _, name, _ in blocks("output", [TF / "modules/stack_platform/outputs.tf"])]
    endpoint = "https://ABC.gr7.us-east-1.eks.amazonaws.com"
    aws = {
        "name": "llmp-prod", "region": "us-east-1", "cluster_name": "llmp-prod", "cluster_endpoint": endpoint,
        "cluster_ca": "LS0tLS1CRUdJTi...", "kubernetes_version": "1.35", "spark_master": f"k8s://{endpoint}",
        "buckets": {"raw": "llmp-prod-raw-1", "curated": "llmp-prod-curated-1", "checkpoints": "llmp-prod-checkpoints-1",
                    "mlflow": "llmp-prod-mlflow-1"},
        "kms_key_arn": "arn:aws:kms:us-east-1:1:key/k", "kms_key_policy": "{}", "encryption": {},
        "namespaces": {"airflow": "airflow", "pipeline": "llm-pipeline", "mlflow": "mlflow"},
        "pipeline_namespace": "llm-pipeline",
        "service_accounts": {"airflow": "airflow:airflow-worker", "spark": "llm-pipeline:spark",
                             "trainer": "llm-pipeline:trainer", "mlflow": "mlflow:mlflow"},
        "irsa_role_arns": {"trainer": "arn:aws:iam::1:role/llmp-prod-trainer"}, "irsa_trust_policies": {},
        "node_groups": {"gpu": {"instance_types": ["p5.48xlarge"], "labels": {"llm-pipeline/pool": "gpu"},
                                "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}]}},
        "gpu_efa_interfaces": 32, "fsx": {}, "network": {}, "database": {}, "security": {}, "lifecycle": {},
        "autoscaling": {"cluster_name": "llmp-prod", "region": "us-east-1", "role_arn": "arn:aws:iam::1:role/ca",
                        "service_account": "kube-system:cluster-autoscaler", "policy": "{}",
                        "gpu_node_template_tags": {}},
    }
    digest = "1.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline@sha256:" + "a" * 64
    platform = {
        "mlflow_tracking_uri": "http://mlflow.mlflow.svc.cluster.local:5000", "pipeline_namespace": "llm-pipeline",
        "airflow_namespace": "airflow", "mlflow_namespace": "mlflow", "shared_fs_claim": "fsx-checkpoints",
        "mlflow_client_secret": "mlflow-client", "roles": {}, "spark_image": "1.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline:1.0.0-cpu",
        "trainer_image": digest, "airflow_image": "x:1", "trainer_chart_version": "2.3.0", "pytorchjob_operator": None,
    }
    assert set(aws) == set(aws_names), "the test's AWS outputs drifted from modules/stack_aws/outputs.tf"
    assert set(platform) == set(platform_names), "the test's platform outputs drifted from modules/stack_platform/outputs.tf"
    files = []
    for layer, values in (("aws", aws), ("platform", platform)):
        files.append(tmp_path / f"{layer}.json")
        files[-1].write_text(json.dumps({"stack": {"value": values, "type": ["object", {}], "sensitive": False}}))
    spec_path, conn_file = tmp_path / "aws-prod.yaml", tmp_path / "connections.json"
    assert cc.main(["--outputs", str(files[0]), "--outputs", str(files[1]), "--out", str(spec_path),
                    "--connections", str(conn_file)]) == 0
    spec = load_spec(spec_path, env={})
    assert spec.launcher.kind == "trainjob" and spec.launcher.efa_per_node == 32 and spec.launcher.nproc_per_node == 8
    assert spec.launcher.node_selector == {"node.kubernetes.io/instance-type": "p5.48xlarge", "llm-pipeline/pool": "gpu"}
    assert spec.launcher.image == digest  # an image by digest goes through as it is
    assert spec.launcher.service_account == "trainer" and spec.launcher.shared_fs_claim == "fsx-checkpoints"
    assert spec.services.spark_master.startswith("k8s://https://") and spec.services.s3_endpoint_url == "aws"
    assert spec.services.s3_bucket == "llmp-prod-checkpoints-1" and spec.services.spark_service_account == "spark"
    from llm_operators import kubernetes_conf

    conf = kubernetes_conf(spec)  # what the SparkStageOperator adds to spark-submit for the k8s:// master
    assert conf["spark.kubernetes.container.image"] == platform["spark_image"]
    assert conf["spark.kubernetes.namespace"] == "llm-pipeline" and conf["spark.pyspark.python"] == "python3"
    ranks.check_supported(spec)  # run.root and checkpoint.l0 lie on the shared filesystem
    job = k8s.render_pytorchjob(spec, "r1", [])
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["serviceAccountName"] == "trainer"
    assert {"name": "shared-fs", "mountPath": "/fsx"} in pod["containers"][0]["volumeMounts"]
    conns = json.loads(conn_file.read_text())  # what `airflow connections import` reads
    spark = conns["spark_pipeline"]
    assert spark["host"] == aws["spark_master"]
    assert conns["kubernetes_default"]["extra"]["in_cluster"] is True
    assert conns["mlflow_default"]["host"] == platform["mlflow_tracking_uri"]
    # the issue's form: --env names the environment, --outputs the saved outputs (no terraform run); the spec goes to
    # configs/aws-ENV.yaml unless --out says otherwise
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"stack": {"value": {**aws, **platform}}}))
    assert cc.main(["--env", "prod", "--outputs", str(both), "--out", str(tmp_path / "env.yaml")]) == 0
    assert load_spec(tmp_path / "env.yaml", env={}).launcher.nproc_per_node == 8
    with pytest.raises(SystemExit) as e:
        cc.main(["--env", "../x", "--outputs", str(both)])
    assert e.value.code == 2
    # the AWS layer alone (platform not applied yet) lacks outputs: exit 2 naming them
    assert cc.main(["--outputs", str(files[0]), "--out", str(tmp_path / "x.yaml")]) == 2
    merged = cc.read_outputs([str(f) for f in files], None)
    assert merged["trainer_image"] == digest and merged["region"] == "us-east-1"
    with pytest.raises(cc.WiringError, match="mlflow_tracking_uri"):
        cc.read_outputs(str(files[0]), None)
    # a spec these outputs make that does not validate never replaces the working one, and outputs of another shape
    # or that cannot be read are one line and exit 2 (were: the good file overwritten; tracebacks)
    good = (tmp_path / "env.yaml").read_text()
    bad_base = tmp_path / "bad-base.yaml"
    bad_base.write_text("parallel: {tp: 3}\n")
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"stack": {"value": {**aws, **platform, "service_accounts": {
        **aws["service_accounts"], "trainer": "no-namespace"}}}}))
    for argv, said in ((["--base", str(bad_base)], "does not validate (nothing written)"),
                       (["--outputs", str(tmp_path / "missing.json")], "cannot read the outputs"),
                       (["--outputs", str(odd)], "do not have the shape expected")):
        argv = argv if "--outputs" in argv else ["--outputs", str(both), *argv]
        capsys.readouterr()
        assert cc.main([*argv, "--out", str(tmp_path / "env.yaml")]) == 2, argv
        err = capsys.readouterr().err
        assert said in err.splitlines()[0] and "Traceback" not in err and "cluster-config-" not in err, err
        assert (tmp_path / "env.yaml").read_text() == good


def test_cluster_config_reads_both_roots_of_an_env_aws_then_platform(tmp_path, monkeypatch):
    from pipelines import cluster_config as cc

    ran = []

    def fake(d):
        ran.append(Path(d).name)
        return {"stack": {"value": {"region": "r1", "trainer_image": "aws-side"}}} if Path(d).name == "aws" else \
            {"stack": {"value": {"trainer_image": "t@sha256:" + "b" * 64}}}

    monkeypatch.setattr(cc, "_terraform_output", fake)
    monkeypatch.setattr(cc, "REQUIRED", ("region", "trainer_image"))
    out = cc.read_outputs(None, "dev")
    assert ran == ["aws", "platform"] and out == {"region": "r1", "trainer_image": "t@sha256:" + "b" * 64}
    with pytest.raises(cc.WiringError, match="no Terraform environment"):
        cc.read_outputs(None, "nope")


def test_a_terraform_output_that_never_ends_is_a_retry_not_a_wait_without_end(tmp_path, monkeypatch, capsys):
    """``terraform output -json`` ran with no bound: a remote state backend that does not answer kept the wiring
    command (and whoever waits for it) for ever. Now it ends after ``OUTPUT_TIMEOUT_S`` with one line, exit 75."""
    from pipelines import cluster_config as cc

    fake = tmp_path / "bin" / "terraform"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(cc, "OUTPUT_TIMEOUT_S", 1.0)
    started = time.monotonic()
    assert cc.main(["--env", "dev", "--out", str(tmp_path / "aws-dev.yaml")]) == 75
    assert time.monotonic() - started < 30 and not (tmp_path / "aws-dev.yaml").exists()
    assert "did not end in" in capsys.readouterr().err


def _namespaces() -> dict[str, dict]:
    """{namespace resource name: its labels} of every kubernetes_namespace_v1."""
    return {n: b["metadata"][0].get("labels", {}) for f, t, n, b in resources("kubernetes_namespace_v1")}


def test_every_namespace_has_pod_security_labels_and_a_default_deny_network_policy():
    labels = _namespaces()
    assert set(labels) == {"pipeline", "airflow", "mlflow"}
    assert all(v == f"${{local.namespace_labels.{k}}}" for k, v in labels.items())
    pod_security = local(TF / "modules/namespaces/main.tf", "pod_security")
    assert pod_security == {"pipeline": "${var.pipeline_pod_security}", "airflow": "baseline", "mlflow": "restricted"}
    assert "pod-security.kubernetes.io/enforce" in json.dumps(local(TF / "modules/namespaces/main.tf", "namespace_labels"))
    assert variables(TF / "modules/namespaces/variables.tf")["pipeline_pod_security"]["default"] == "baseline"
    # the reason for each level that is not restricted is written beside it
    src = (TF / "modules/namespaces/main.tf").read_text()
    assert "baseline, not restricted" in src and "airflow: baseline, because" in src
    # the VPC CNI enforces NetworkPolicies; every namespace denies by default and opens named flows
    addon = one("aws_eks_addon", "eks")
    assert "enableNetworkPolicy" in addon["configuration_values"]
    pols = {n: b for f, t, n, b in resources("kubernetes_network_policy_v1")}
    deny = pols["default_deny"]
    assert deny["for_each"] == "${local.all}" and deny["spec"][0]["policy_types"] == ["Ingress", "Egress"]
    assert deny["spec"][0]["pod_selector"] == [{}] and "ingress" not in deny["spec"][0]
    netpol = calls(TF / "modules/stack_platform/main.tf")["netpol"]
    assert netpol["namespaces"] == "${module.namespaces.namespaces}"  # all three, from the namespace resources
    outputs = {n: b for _, n, b in blocks("output", [TF / "modules/namespaces/outputs.tf"])}
    assert set(outputs["namespaces"]["value"]) == {"airflow", "pipeline", "mlflow"}
    mlflow_in = pols["mlflow_ingress"]["spec"][0]["ingress"][0]
    assert mlflow_in["ports"][0]["port"] == "5000"
    assert "5432" in json.dumps(pols["to_rds"]) and "var.private_subnet_cidrs" in json.dumps(pols["to_rds"])


def test_mlflow_is_authenticated_with_its_credentials_in_secrets_and_its_image_pinned_by_digest():
    dep = [b for f, t, n, b in resources("kubernetes_deployment_v1") if n == "mlflow"][0]
    container = dep["spec"][0]["template"][0]["spec"][0]["container"][0]
    assert container["args"] == "${local.mlflow_args}" and "command" not in container  # through /entrypoint
    args = local(TF / "modules/metadata/main.tf", "mlflow_args")
    assert "--app-name" in args and args[args.index("--app-name") + 1] == "basic-auth"  # none on 0.0.0.0 unauthenticated
    assert {e["name"] for e in container["env"]} == {"MLFLOW_AUTH_CONFIG_PATH", "MLFLOW_FLASK_SERVER_SECRET_KEY",
                                                     "CONNECTION_CHECK_MAX_COUNT"}
    auth = [b for f, t, n, b in resources("kubernetes_secret_v1") if n == "mlflow_auth"][0]
    ini = auth["data"]["basic_auth.ini"]
    assert "admin_password = ${random_password.mlflow_admin.result}" in ini and "default_permission = NO_PERMISSIONS" in ini
    client = [b for f, t, n, b in resources("kubernetes_secret_v1") if n == "mlflow_client"][0]
    assert set(client["data"]) == {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
    from pipelines.launch.k8s import MLFLOW_CLIENT_SECRET

    assert client["metadata"][0]["name"] == MLFLOW_CLIENT_SECRET  # the training pods read this one
    # mlflow_image: a variable validated as a digest, wired from the platform envs through the stack to the Deployment
    assert container["image"] == "${var.mlflow_image}"
    for where in ("modules/metadata/variables.tf", "modules/stack_platform/variables.tf", "envs/dev/platform/variables.tf",
                  "envs/prod/platform/variables.tf"):
        assert "default" not in variables(TF / where)["mlflow_image"], where
    validation = variables(TF / "modules/metadata/variables.tf")["mlflow_image"]["validation"][0]["condition"]
    assert "@sha256:[0-9a-f]{64}$" in validation
    assert calls(TF / "modules/stack_platform/main.tf")["metadata"]["mlflow_image"] == "${var.mlflow_image}"
    for env in ENVS:
        assert calls(TF / "envs" / env / "platform/main.tf")["stack_platform"]["mlflow_image"] == "${var.mlflow_image}"
        tfvars = parse(TF / "envs" / env / "platform/terraform.tfvars")
        assert re.search(r"@sha256:[0-9a-f]{64}$", tfvars["mlflow_image"])
    # the pipeline image serves MLflow: the client's own MLflow and the PostgreSQL driver (tests/test_contract_mlflow.py)
    lock = (ROOT / "requirements.lock").read_text()
    assert re.search(r"^mlflow==3\.17\.2", lock, re.M) and re.search(r"^psycopg==", lock, re.M)


def test_pipeline_images_take_a_tag_or_a_digest_and_reach_the_outputs():
    """airflow/spark/trainer images: NAME:TAG or NAME@sha256:<64 hex> (the digest the registry gives on push), checked by a
    variable validation at plan; the spark and trainer images come out as outputs for pipelines.cluster_config."""
    stack_vars = variables(TF / "modules/stack_platform/variables.tf")
    patterns = set()
    for name in ("airflow_image", "spark_image", "trainer_image"):
        cond = stack_vars[name]["validation"][0]["condition"]
        m = re.fullmatch(r'\$\{can\(regex\("(.*)", var\.' + name + r'\)\)\}', cond)
        assert m, cond
        patterns.add(m.group(1).replace("\\\\", "\\"))
        assert "make image" in stack_vars[name]["validation"][0]["error_message"]
    assert len(patterns) == 1
    pattern = re.compile(patterns.pop())
    for ref, ok in IMAGE_EXAMPLES.items():
        assert bool(pattern.match(ref)) is ok, ref
    for env in ENVS:
        tfvars = parse(TF / "envs" / env / "platform/terraform.tfvars")
        call = calls(TF / "envs" / env / "platform/main.tf")["stack_platform"]
        for name in ("airflow_image", "spark_image", "trainer_image"):
            assert pattern.match(tfvars[name]) and call[name] == f"${{var.{name}}}", (env, name)
    outs = {n: b for _, n, b in blocks("output", [TF / "modules/stack_platform/outputs.tf"])}
    assert outs["spark_image"]["value"] == "${var.spark_image}" and outs["trainer_image"]["value"] == "${var.trainer_image}"
    # the Airflow chart gets a digest as its digest, a tag as its tag
    image = local(TF / "modules/metadata/main.tf", "airflow_image")
    m = re.search(r'regex\("(.*)", var\.airflow_image\)', image)
    parts = re.compile(m.group(1).replace("\\\\", "\\").replace("(?P<", "(?P<"))
    assert parts.match("r/a:1").groupdict() == {"repository": "r/a", "tag": "1", "digest": None}
    assert parts.match("h:5000/a@sha256:" + "c" * 64).groupdict() == {"repository": "h:5000/a", "tag": None,
                                                                      "digest": "sha256:" + "c" * 64}
    # the workers' pod template pins the digest too (its tag is TAG@DIGEST: the chart renders REPOSITORY:TAG there)
    main = (TF / "modules/metadata/main.tf").read_text()
    assert "images                   = { pod_template = { tag = local.pod_template_tag } }" in main
    assert re.search(r'pod_template_tag = \(local\.airflow_image\.digest == null \? local\.airflow_image\.tag :\s*'
                     r'"\$\{coalesce\(local\.airflow_image\.tag, "pinned"\)\}@\$\{local\.airflow_image\.digest\}"\)', main)


def test_each_application_has_its_own_database_login_and_rds_admits_only_the_private_subnets():
    secrets = {n: b for f, t, n, b in resources("kubernetes_secret_v1")}
    data = secrets["db"]["data"]  # not the master login; Airflow's async engine the same DSN by psycopg's async driver
    assert "{connection = local.app_dsn[each.key]}" in data
    assert 'async_connection = replace(local.app_dsn[each.key], "postgresql://", "postgresql+psycopg_async://")' in data
    apps = local(TF / "modules/metadata/main.tf", "apps")
    assert {a["role"] for a in apps.values()} == {"airflow_app", "mlflow_app"}
    # the master login goes only to the job that creates the roles, in the mlflow namespace's admin secret
    master_users = [n for n, b in secrets.items() if "local.admin_dsn" in json.dumps(b)]
    assert master_users == ["db_admin"]
    master = [b for f, t, n, b in blocks("data", [TF / "modules/metadata/main.tf"]) if n == "master"][0]
    assert master["secret_id"] == "${var.db.master_secret_arn}"  # the AWS layer's RDS-managed secret
    pw = {n: b for f, t, n, b in resources("random_password")}
    assert pw["db"]["keepers"] == {"generation": "${var.credentials_generation}"}  # rotation: bump and apply
    rule = one("aws_vpc_security_group_ingress_rule", "database")
    assert rule["for_each"] == "${toset(var.private_subnet_cidrs)}" and rule["cidr_ipv4"] == "${each.value}"
    airflow = one("helm_release", "metadata")["values"][0]
    assert "FabAuthManager" in airflow and "rbac" in airflow and "extraEnvFrom" in airflow
    # Airflow 3 values (chart 1.22): the admin is createUserJob's, its password read from a Secret (not in the values
    # Helm keeps in the cluster), the API and JWT keys ours; no Airflow 2 webserver settings
    assert "createUserJob" in airflow and "webserver" not in airflow and "random_password" not in airflow
    assert "args = local.create_admin_args" in airflow and "kubernetes_secret_v1.airflow_admin" in airflow
    assert "admin-login/password" in local(TF / "modules/metadata/main.tf", "create_admin_args")[2]
    assert "apiSecretKeySecretName" in airflow and "jwtSecretName" in airflow and "airflowVersion" in airflow
    assert variables(TF / "modules/metadata/variables.tf")["airflow_chart_version"]["default"] == "1.22.0"
    assert secrets["airflow_admin"]["data"] == {"password": "${random_password.airflow_admin.result}"}


def _render_chart(chart: Path) -> list[dict]:
    """The chart's documents with the few template expressions it uses filled in (no helm binary here)."""
    import yaml

    docs = []
    for f in sorted((chart / "templates").glob("*.yaml")) + sorted((chart / "crds").glob("*.yaml")):
        text = f.read_text().replace("{{ .Release.Namespace }}", "kubeflow").replace("{{ .Values.image }}", "img:1")
        text = re.sub(r"^\s*\{\{-? (with|end|toYaml)[^}]*\}\}\s*$\n?", "", text, flags=re.M)
        text = re.sub(r"^\s*(nodeSelector|tolerations):\s*$\n", "", text, flags=re.M)
        assert "{{" not in text, f"{f.name}: template expressions this test does not fill in"
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def test_operators_are_pinned_helm_releases_in_state_never_local_exec():
    """Trainer v2 and the optional v1 training-operator (PyTorchJob) are Helm releases at exact versions; no
    provisioner anywhere (no kubectl or AWS CLI at apply, nothing outside the state)."""
    for f in FILES:
        text = f.read_text()
        assert "local-exec" not in text and "provisioner" not in text, f.relative_to(TF)
    releases = {n: b for f, t, n, b in resources("helm_release")}
    trainer = releases["kubeflow_trainer"]
    assert trainer["chart"] == "kubeflow-trainer" and trainer["version"] == "${var.trainer_chart_version}"
    assert "torchDistributed" in trainer["values"][0]
    version = variables(TF / "modules/cluster_addons/variables.tf")["trainer_chart_version"]["default"]
    crd = (ROOT / "infra/k8s/crds/trainer.kubeflow.org_trainjobs.yaml").read_text()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version) and f"v{version}" in (ROOT / "infra/k8s/crds/SOURCES.md").read_text()
    assert "kind: TrainJob" in crd
    # the v1 operator: off by default, wired from each env through the stack, a chart in this repository
    op = releases["training_operator"]
    assert op["count"] == "${var.install_pytorchjob_operator ? 1 : 0}"
    assert op["chart"] == "${path.module}/charts/training-operator" and op["version"] == "1.8.1"
    assert variables(TF / "modules/cluster_addons/variables.tf")["install_pytorchjob_operator"]["default"] is False
    stack = calls(TF / "modules/stack_platform/main.tf")["cluster_addons"]
    assert stack["install_pytorchjob_operator"] == "${var.install_pytorchjob_operator}"
    for env in ENVS:
        assert variables(TF / "envs" / env / "platform/variables.tf")["install_pytorchjob_operator"]["default"] is False
        call = calls(TF / "envs" / env / "platform/main.tf")["stack_platform"]
        assert call["install_pytorchjob_operator"] == "${var.install_pytorchjob_operator}"
    import yaml

    chart = TF / "modules/cluster_addons/charts/training-operator"
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    assert meta["version"] == "1.8.1" and meta["appVersion"] == "v1.8.1"
    assert meta["annotations"]["upstream-commit"] == "0f8735faade3651dfe44e45c6fbc30fa9152641d"  # tag v1.8.1
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _render_chart(chart)}
    assert ("CustomResourceDefinition", "pytorchjobs.kubeflow.org") in docs
    assert [k for k in docs if k[0] == "CustomResourceDefinition"] == [("CustomResourceDefinition", "pytorchjobs.kubeflow.org")]
    dep = docs[("Deployment", "training-operator")]["spec"]["template"]["spec"]["containers"][0]
    assert dep["args"] == ["--enable-scheme=pytorchjob"] and dep["image"] == "img:1"
    hook = docs[("ValidatingWebhookConfiguration", "validator.training-operator.kubeflow.org")]["webhooks"]
    assert [w["rules"][0]["resources"] for w in hook] == [["pytorchjobs"]]
    assert hook[0]["clientConfig"]["service"] == {"name": "training-operator", "namespace": "kubeflow",
                                                  "path": "/validate-kubeflow-org-v1-pytorchjob"}
    assert ("Secret", "training-operator-webhook-cert") in docs and ("Service", "training-operator") in docs
    # the CRD the admission checks validate PyTorchJobs against is the one this chart installs
    checked = ROOT / "infra/k8s/crds/kubeflow.org_pytorchjobs.yaml"
    if checked.exists():
        assert checked.read_bytes() == (chart / "crds/kubeflow.org_pytorchjobs.yaml").read_bytes()


def test_kms_key_policy_names_the_autoscaling_and_fsx_service_linked_roles_without_a_cycle():
    """The key policy lets Auto Scaling's service-linked role use the key (node volumes) and the file system's FSx role
    (S3 import and export of the SSE-KMS checkpoint bucket). The FSx role names the file system, which the key
    encrypts: aws_kms_key_policy sets the full policy after the data repository association, the key is created
    with the rest (terraform test checks the rendered policy)."""
    storage = TF / "modules/storage/main.tf"
    statements = {s["Sid"]: s for s in local(storage, "key_statements")}
    assert statements["AutoScalingVolumes"]["Principal"] == {"AWS": "${local.autoscaling_role}"}
    assert {"kms:Decrypt", "kms:GenerateDataKey*", "kms:ReEncrypt*"} <= set(statements["AutoScalingVolumes"]["Action"])
    grant = statements["AutoScalingVolumeGrants"]
    assert grant["Action"] == "kms:CreateGrant" and grant["Condition"] == {"Bool": {"kms:GrantIsForAWSResource": "true"}}
    fsx = local(storage, "fsx_statements")
    assert "var.fsx_s3_access_role_arns" in fsx and "kms:GenerateDataKey" in fsx
    key = one("aws_kms_key", "storage")
    assert key["lifecycle"][0]["ignore_changes"] == ["${policy}"] or "policy" in json.dumps(key["lifecycle"])
    policy = one("aws_kms_key_policy", "storage")
    assert policy["key_id"] == "${aws_kms_key.this.id}" and "local.fsx_statements" in policy["policy"]
    out = {n: b for _, n, b in blocks("output", [TF / "modules/fsx/outputs.tf"])}["s3_access_role_arn"]
    assert "AWSServiceRoleForFSxS3Access_${aws_fsx_lustre_file_system.this.id}" in out["value"]
    assert out["depends_on"] == ["${aws_fsx_data_repository_association.checkpoints}"]
    stack = calls(TF / "modules/stack_aws/main.tf")
    assert stack["storage"]["fsx_s3_access_role_arns"] == ["${module.fsx.s3_access_role_arn}"]
    assert stack["fsx"]["kms_key_arn"] == "${module.storage.kms_key_arn}"
    role = local(storage, "autoscaling_role")  # created (a fresh account) or looked up (a clear plan error)
    assert "aws_iam_service_linked_role.autoscaling[0].arn" in role and "data.aws_iam_role.autoscaling[0].arn" in role
    assert stack["storage"]["create_autoscaling_service_role"] == "${var.create_autoscaling_service_role}"


def test_eks_version_is_in_standard_support_with_a_validation_naming_the_set():
    var = variables(TF / "modules/eks/variables.tf")["kubernetes_version"]
    cond, msg = var["validation"][0]["condition"], var["validation"][0]["error_message"]
    allowed = re.findall(r'"(1\.\d+)"', cond)
    assert allowed == ["1.34", "1.35", "1.36"] and var["default"] in allowed
    assert all(v in msg for v in allowed)
    assert calls(TF / "modules/stack_aws/main.tf")["eks"]["kubernetes_version"] == "${var.kubernetes_version}"
    for env in ENVS:
        assert calls(TF / "envs" / env / "aws/main.tf")["stack_aws"]["kubernetes_version"] == "${var.kubernetes_version}"


def test_apply_needs_no_drift_and_documented_knobs_reach_the_resources():
    """use_lockfile needs Terraform 1.10; RDS pins only the major while minors upgrade themselves; gpu_capacity_type
    goes from each AWS env through the stack to the eks module, pipeline_pod_security from each platform env to the
    namespaces module; the OIDC provider needs no tls provider."""
    for f in sorted(TF.rglob("versions.tf")):
        required = parse(f)["terraform"][0]["required_version"]
        m = re.fullmatch(r">= 1\.(\d+)", required)
        assert m and int(m.group(1)) >= 10, (f, required)
    db = one("aws_db_instance", "database")
    assert db["auto_minor_version_upgrade"] is True and re.fullmatch(r"\d+", db["engine_version"])
    assert "thumbprint_list" not in one("aws_iam_openid_connect_provider", "eks")
    tmpl = {n: b for f, t, n, b in resources("aws_launch_template")}["gpu"]
    assert "capacity-block" in json.dumps(tmpl["dynamic"]) and "gpu_capacity_reservation_id" in json.dumps(tmpl["dynamic"])
    assert "CAPACITY_BLOCK" in variables(TF / "modules/eks/variables.tf")["gpu_capacity_type"]["validation"][0]["condition"]
    stack = calls(TF / "modules/stack_aws/main.tf")
    for knob in ("gpu_capacity_type", "gpu_capacity_reservation_id"):
        assert stack["eks"][knob] == f"${{var.{knob}}}"
        for env in ENVS:
            assert calls(TF / "envs" / env / "aws/main.tf")["stack_aws"][knob] == f"${{var.{knob}}}", (env, knob)
    assert calls(TF / "modules/stack_platform/main.tf")["namespaces"]["pipeline_pod_security"] == \
        "${var.pipeline_pod_security}"
    for env in ENVS:
        call = calls(TF / "envs" / env / "platform/main.tf")["stack_platform"]
        assert call["pipeline_pod_security"] == "${var.pipeline_pod_security}"


def _rules(role: dict) -> dict[tuple, set]:
    return {(g, r): set(rule["verbs"]) for rule in role["rule"] for g in rule["api_groups"] for r in rule["resources"]}


def test_identities_get_only_what_they_do():
    """The workers (the launcher and Spark's client-mode driver) submit jobs and executor pods; the triggerer only
    reads and deletes jobs and reads pods; the executors' and training pods' accounts hold no Role."""
    roles = {n: b for f, t, n, b in resources("kubernetes_role_v1")}
    assert set(roles) == {"spark_driver", "launcher", "job_watcher"}
    watcher = _rules(roles["job_watcher"])
    assert watcher == {("trainer.kubeflow.org", "trainjobs"): {"get", "list", "watch", "delete"},
                       ("kubeflow.org", "pytorchjobs"): {"get", "list", "watch", "delete"},
                       ("", "pods"): {"get", "list", "watch"}, ("", "pods/log"): {"get", "list", "watch"}}
    launcher = _rules(roles["launcher"])
    assert "create" in launcher[("trainer.kubeflow.org", "trainjobs")] and "create" in launcher[("kubeflow.org", "pytorchjobs")]
    assert launcher[("", "pods/log")] == {"get", "list", "watch"}
    driver = _rules(roles["spark_driver"])
    assert "create" in driver[("", "pods")] and "create" in driver[("", "configmaps")]
    ns = TF / "modules/namespaces/main.tf"
    bindings = local(ns, "bindings")
    by_role = {b["role"].split(".")[1]: b["account"] for b in bindings.values()}
    assert by_role == {"launcher": "${local.sa.airflow.name}", "spark_driver": "${local.sa.airflow.name}",
                       "job_watcher": "${var.triggerer_service_account}"}
    binding = one("kubernetes_role_binding_v1", "namespaces")
    assert binding["for_each"] == "${local.bindings}" and len(binding["subject"]) == 1
    assert binding["subject"][0]["namespace"] == "${kubernetes_namespace_v1.airflow.metadata[0].name}"
    assert variables(TF / "modules/namespaces/variables.tf")["triggerer_service_account"]["default"] == "airflow-triggerer"
    # the chart's triggerer and workers run as exactly those accounts
    values = one("helm_release", "metadata")["values"][0]
    assert "var.triggerer_service_account" in values and "var.worker_service_account" in values
    stack = calls(TF / "modules/stack_platform/main.tf")
    assert stack["metadata"]["triggerer_service_account"] == "${module.namespaces.triggerer_service_account}"
    assert stack["metadata"]["worker_service_account"] == '${split(":", var.aws.service_accounts.airflow)[1]}'


def test_the_mlflow_bucket_is_shared_by_prefix_and_each_role_touches_only_its_own():
    """The MLflow bucket holds the tracking server's artifacts and Airflow's task logs: the IRSA role of each may
    read (and the server write) only its own prefix, the one modules/metadata configures, and only the logs expire."""
    prefixes = local(TF / "modules/iam/main.tf", "object_prefixes")
    assert prefixes == {"mlflow": {"mlflow": "artifacts/"}, "airflow_logs": {"mlflow": "airflow-logs/"}}
    meta = (TF / "modules/metadata/main.tf").read_text()
    assert '"s3://${var.mlflow_bucket}/artifacts"' in meta  # the server's --artifacts-destination
    assert 'remote_base_log_folder = "s3://${var.mlflow_bucket}/airflow-logs"' in meta
    assert local(TF / "modules/storage/main.tf", "expiring") == {"mlflow": {"airflow-logs/": "${var.task_log_days}"}}
    doc = [b for f, t, n, b in blocks("data", sorted((TF / "modules/iam").rglob("*.tf")))
           if t == "aws_iam_policy_document" and n == "access"][0]
    scoped = '${var.bucket_arns[b]}/${try(local.object_prefixes[each.key][b], "")}*'
    read = [s for s in doc["statement"] if s.get("sid") == "ReadObjects"][0]
    assert scoped in read["resources"]
    write = doc["dynamic"][0]["statement"]["content"][0]
    assert write["sid"] == "WriteObjects" and scoped in write["resources"]


def test_kms_only_via_s3_and_fsx_linked_at_the_l1_path():
    doc = [b for f, t, n, b in blocks("data", sorted((TF / "modules/iam").rglob("*.tf")))
           if t == "aws_iam_policy_document" and n == "access"][0]
    kms = [s for s in doc["statement"] if s.get("sid") == "BucketKey"][0]
    assert kms["condition"][0]["variable"] == "kms:ViaService"
    assert kms["condition"][0]["values"] == ["s3.${data.aws_region.current.name}.amazonaws.com"]
    from pipelines.cluster_config import cluster_spec

    fsx_vars = variables(TF / "modules/fsx/variables.tf")
    spec = cluster_spec({"service_accounts": {"trainer": "ns:t", "spark": "ns:s"}, "trainer_image": "i",
                         "pipeline_namespace": "ns", "shared_fs_claim": "c", "gpu_efa_interfaces": 0,
                         "spark_master": "k8s://x", "spark_image": "s", "buckets": {"checkpoints": "b", "mlflow": "m"},
                         "region": "r", "mlflow_tracking_uri": "u",
                         "node_groups": {"gpu": {"instance_types": ["g6e.xlarge"]}}}, {})
    assert spec["checkpoint"]["l1"] == "/fsx" + fsx_vars["repository_path"]["default"]  # the DRA links L1


def test_module_calls_match_their_modules_and_the_platform_reads_only_what_the_aws_layer_outputs():
    """What `terraform validate` would check of the wiring, for the roots whose providers do not install here too:
    every module call gives known and all required variables, every module.X.Y is an output of X, and every
    attribute of the AWS layer that the platform layer reads (var.aws.*) is an output of modules/stack_aws."""
    problems = []
    for d in sorted({f.parent for f in FILES}):
        mods = {k: v for f in d.glob("*.tf") for k, v in calls(f).items()}
        text = "\n".join(f.read_text() for f in d.glob("*.tf"))
        for name, args in mods.items():
            src = (d / args["source"]).resolve()
            declared = variables(src / "variables.tf")
            outputs = {n for _, n, _ in blocks("output", [src / "outputs.tf"])}
            given = set(args) - {"source", "count", "for_each", "depends_on", "providers"}
            if given - set(declared) or {k for k, v in declared.items() if "default" not in v} - given:
                problems.append(f"{d.relative_to(TF)}: module {name}: unknown {given - set(declared)}, missing "
                                f"{ {k for k, v in declared.items() if 'default' not in v} - given}")
            problems += [f"{d.relative_to(TF)}: module.{name}.{ref} is not an output"
                         for ref in set(re.findall(rf"module\.{name}\.(\w+)", text)) if ref not in outputs]
    assert not problems, "\n".join(problems)
    aws_outputs = {n for _, n, _ in blocks("output", [TF / "modules/stack_aws/outputs.tf"])}
    wanted = variables(TF / "modules/stack_platform/variables.tf")["aws"]["type"]
    read = set(re.findall(r"var\.aws\.(\w+)", (TF / "modules/stack_platform/main.tf").read_text()))
    read |= set(re.findall(r"local\.aws\.(\w+)", (TF / "envs/dev/platform/providers.tf").read_text()))
    assert read and read <= aws_outputs, read - aws_outputs
    assert all(re.search(rf"\b{k}\b", wanted) for k in read - {"region", "cluster_name"}), wanted


def test_tf_check_skips_only_a_root_whose_providers_are_absent_never_a_broken_constraint(tmp_path):
    """A root that requires a provider version no release meets is a failure, not a skip (terraform words both as
    "Could not retrieve the list of available versions"); with no root checked at all the script fails too; and a
    mirror path that is not a mirror is the user's to fix (exit 2)."""
    if shutil.which("terraform") is None or not Path("/opt/tf-plugins/registry.terraform.io").is_dir():
        pytest.skip("needs terraform and the aws provider mirror at /opt/tf-plugins")
    tree = tmp_path / "repo"
    shutil.copytree(TF, tree / "infra/terraform", ignore=shutil.ignore_patterns(".terraform*"))
    shutil.copytree(ROOT / "scripts", tree / "scripts")
    for p in [tree / "infra/terraform/envs/prod"]:
        shutil.rmtree(p)
    versions = tree / "infra/terraform/envs/dev/aws/versions.tf"
    text = versions.read_text()
    pin = re.search(r'version\s*=\s*"(>= 5[^"]*)"', text).group(1)
    versions.write_text(text.replace(pin, ">= 6.0"))
    env = {**os.environ, "TF_CHECK_WORK": str(tmp_path / "work"), "CHECKOV": "skip"}
    r = subprocess.run(["bash", str(tree / "scripts/tf_check.sh")], capture_output=True, text=True, env=env,
                       timeout=600, cwd=tree)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "FAILED   infra/terraform/envs/dev/aws (init)" in r.stdout
    assert "skipped  infra/terraform/envs/dev/platform (providers not installable here:" in r.stdout
    assert "FAILED   no Terraform root was initialised, validated and tested" in r.stdout
    assert not (tree / "infra/terraform/envs/dev/aws/.terraform.lock.hcl").exists()
    bad = subprocess.run(["bash", str(tree / "scripts/tf_check.sh")], capture_output=True, text=True,
                         env={**env, "TF_PLUGIN_DIR": str(tmp_path / "no-mirror")}, timeout=600, cwd=tree)
    assert bad.returncode == 2 and "holds no registry.terraform.io folder" in bad.stdout


def test_run_root_owned_for_the_pods_task_logs_in_s3_no_glacier_admins_and_efa_only_when_asked():
    """Issue 51's storage and operations: what a cluster would trip on at start, read where it is configured."""
    job = one("kubernetes_job_v1", "namespaces")
    container = job["spec"][0]["template"][0]["spec"][0]["container"][0]
    cmd = " ".join(container["command"]) if isinstance(container["command"], list) else container["command"]
    assert "install -d -o ${local.run_root_owner.uid} -g ${local.run_root_owner.gid} -m 2775" in cmd
    dirs = local(TF / "modules/namespaces/main.tf", "run_root_dirs")
    assert "${local.run_root}/var/tiers/shared" in dirs  # the L1 path the FSx association makes as root
    owner = local(TF / "modules/namespaces/main.tf", "run_root_owner")
    assert owner == {"uid": 50000, "gid": 0}  # the image's user and the Airflow chart's uid/gid
    assert local(TF / "modules/namespaces/main.tf", "run_root") == "${var.shared_fs_mount}/llm-pipeline"
    assert job["wait_for_completion"] is True
    airflow = one("helm_release", "metadata")["values"][0]
    assert 'remote_logging = "True"' in airflow and "s3://${var.mlflow_bucket}/airflow-logs" in airflow
    # and those logs expire: the MLflow bucket's rule for the same prefix (terraform test asserts the planned rule)
    assert local(TF / "modules/storage/main.tf", "expiring") == {"mlflow": {"airflow-logs/": "${var.task_log_days}"}}
    assert variables(TF / "modules/storage/variables.tf")["checkpoint_glacier_days"]["default"] is None
    entries = [b for f, t, n, b in resources("aws_eks_access_entry") if n == "admin"]
    assert entries and entries[0]["for_each"] == "${local.admin_role_arns}"  # less the creator's own entry
    assert "data.aws_iam_session_context.current.issuer_arn" in local(TF / "modules/eks/main.tf", "admin_role_arns")
    assoc = [b for f, t, n, b in resources("aws_eks_access_policy_association") if n == "admin"][0]
    assert assoc["policy_arn"].endswith("cluster-access-policy/AmazonEKSClusterAdminPolicy")
    for env in ENVS:
        assert calls(TF / "envs" / env / "aws/main.tf")["stack_aws"]["admin_role_arns"] == "${var.admin_role_arns}"
    prod = calls(TF / "envs/prod/aws/main.tf")["stack_aws"]
    assert prod["gpu_efa_interfaces"] == "${var.gpu_efa_interfaces}"
    assert variables(TF / "envs/prod/aws/variables.tf")["gpu_efa_interfaces"]["default"] == 0
