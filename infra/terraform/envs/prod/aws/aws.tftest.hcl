# `terraform test` for the prod AWS layer: plans the whole root with a mocked AWS provider (no credentials, no API
# call) and asserts what matters. The mocks give data sources and computed attributes fixed values at plan time
# (override_during = plan) so that the assertions see real policy documents and ARNs.
mock_provider "aws" {
  override_during = plan

  mock_data "aws_caller_identity" {
    defaults = { account_id = "123456789012", arn = "arn:aws:sts::123456789012:assumed-role/admin/terraform" }
  }
  mock_data "aws_iam_session_context" { # who runs apply: EKS makes that role's access entry itself
    defaults = { issuer_arn = "arn:aws:iam::123456789012:role/admin" }
  }
  mock_data "aws_partition" {
    defaults = { partition = "aws" }
  }
  mock_data "aws_region" {
    defaults = { name = "us-east-1" }
  }
  mock_data "aws_iam_role" { # AWSServiceRoleForAutoScaling, looked up by name
    defaults = { arn = "arn:aws:iam::123456789012:role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling" }
  }
  mock_data "aws_iam_policy_document" {
    defaults = { json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}" }
  }
  mock_resource "aws_kms_key" {
    defaults = {
      arn    = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
      key_id = "11111111-2222-3333-4444-555555555555"
    }
  }
  mock_resource "aws_fsx_lustre_file_system" {
    defaults = { id = "fs-0123456789abcdef0" }
  }
  mock_resource "aws_eks_cluster" {
    defaults = {
      endpoint              = "https://EXAMPLE.gr7.us-east-1.eks.amazonaws.com"
      certificate_authority = [{ data = "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0t" }]
      identity              = [{ oidc = [{ issuer = "https://oidc.eks.us-east-1.amazonaws.com/id/EXAMPLE" }] }]
    }
  }
  mock_resource "aws_iam_openid_connect_provider" {
    defaults = { arn = "arn:aws:iam::123456789012:oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/EXAMPLE" }
  }
}

variables {
  account = "123456789012"
  issuer  = "oidc.eks.us-east-1.amazonaws.com/id/EXAMPLE"
}

run "plan" {
  command = plan

  # lifecycle: Airflow's task logs (airflow-logs/ in the MLflow bucket) expire; no bucket is archived to Glacier by
  # default (L2 restore, FSx's lazy load and evaluation read old objects back)
  assert {
    condition     = [for r in output.stack.lifecycle.mlflow : r.expiration_days if r.prefix == "airflow-logs/"] == [30]
    error_message = "Airflow's task logs in the MLflow bucket must expire (30 days by default)"
  }
  assert {
    condition = alltrue(flatten([for rules in values(output.stack.lifecycle) : [for r in rules :
    !contains(keys(r.transitions), "GLACIER") && (r.prefix != "" || r.expiration_days == null)]]))
    error_message = "no pipeline bucket may be archived to Glacier by default, and nothing but a prefix may expire"
  }
  assert {
    condition     = alltrue([for rules in values(output.stack.lifecycle) : anytrue([for r in rules : r.delete_markers])])
    error_message = "every pipeline bucket must remove the delete markers an expiry leaves"
  }

  # KMS: every store is encrypted with the stack's customer-managed key
  assert {
    condition = alltrue([for b in values(output.stack.encryption.buckets) :
    b.sse_algorithm == "aws:kms" && b.kms_master_key_id == output.stack.kms_key_arn])
    error_message = "every pipeline bucket must default to SSE-KMS with the stack's key"
  }
  assert {
    condition     = length(output.stack.encryption.buckets) == 4
    error_message = "raw, curated, checkpoints and mlflow buckets expected"
  }
  assert {
    condition     = output.stack.encryption.fsx == output.stack.kms_key_arn && output.stack.encryption.eks_secrets == output.stack.kms_key_arn
    error_message = "FSx and the EKS secrets must be encrypted with the stack's key"
  }
  assert {
    condition     = output.stack.encryption.rds.storage_encrypted && output.stack.encryption.rds.kms_key_id == output.stack.kms_key_arn && !output.stack.encryption.rds.publicly_accessible
    error_message = "RDS must be encrypted with the stack's key and private"
  }

  # the key policy names Auto Scaling's service-linked role (node volumes) and this file system's FSx role (S3 link)
  assert {
    condition = contains(flatten([for s in jsondecode(output.stack.kms_key_policy).Statement : s.Principal.AWS if s.Sid == "AutoScalingVolumes"]),
    "arn:aws:iam::${var.account}:role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling")
    error_message = "the KMS key policy must let EC2 Auto Scaling's service-linked role use the key"
  }
  assert {
    condition = [for s in jsondecode(output.stack.kms_key_policy).Statement : s.Condition if s.Sid == "FSxDataRepositoryS3Access"] == [{
      StringEquals = { "kms:CallerAccount" = var.account, "kms:ViaService" = "s3.us-east-1.amazonaws.com" }
      StringLike = { "kms:EncryptionContext:aws:s3:arn" = [
        "arn:aws:s3:::${output.stack.buckets.checkpoints}", "arn:aws:s3:::${output.stack.buckets.checkpoints}/*"
      ] }
    }]
    error_message = "the FSx role may use the key only through S3, from this account, on the checkpoint bucket"
  }
  assert {
    condition     = contains(flatten([for s in jsondecode(output.stack.kms_key_policy).Statement : s.Condition.Bool["kms:GrantIsForAWSResource"] if s.Sid == "AutoScalingVolumeGrants"]), "true")
    error_message = "the Auto Scaling role may create grants for AWS resources only"
  }
  assert {
    condition = contains(flatten([for s in jsondecode(output.stack.kms_key_policy).Statement : s.Principal.AWS if s.Sid == "FSxDataRepositoryS3Access"]),
    "arn:aws:iam::${var.account}:role/aws-service-role/s3.data-source.lustre.fsx.amazonaws.com/AWSServiceRoleForFSxS3Access_${output.stack.fsx.file_system_id}")
    error_message = "the KMS key policy must name the file system's FSx service-linked role for S3"
  }
  assert {
    condition = alltrue(flatten([for s in jsondecode(output.stack.kms_key_policy).Statement :
    [for p in flatten([try(s.Principal.AWS, [])]) : p != "*"]]))
    error_message = "no wildcard principal in the key policy"
  }

  # node groups: the env's sizes
  assert {
    condition     = output.stack.node_groups.system.scaling == { min_size = 3, desired_size = 3, max_size = 8 }
    error_message = "prod: 3 system nodes (max 8)"
  }
  assert {
    condition     = one(output.stack.node_groups.gpu.instance_types) == "p5.48xlarge" && output.stack.node_groups.gpu.scaling == { min_size = 0, desired_size = 8, max_size = 16 }
    error_message = "prod: a p5.48xlarge GPU group of 8 (0..16)"
  }
  assert {
    condition     = output.stack.node_groups.gpu.ami_type == "AL2023_x86_64_NVIDIA" && one(output.stack.node_groups.gpu.taints) == { key = "nvidia.com/gpu", value = "true", effect = "NO_SCHEDULE" }
    error_message = "GPU nodes run the NVIDIA AMI and are tainted nvidia.com/gpu"
  }
  assert {
    condition     = output.stack.gpu_efa_interfaces == 0 && length(output.stack.node_groups.gpu.subnet_ids) == 1
    error_message = "prod: no EFA requested by default (the image has no aws-ofi-nccl); GPU nodes in one subnet (one AZ, with FSx, in a placement group)"
  }

  # FSx: the L1 path linked to its own prefix of the checkpoint bucket
  assert {
    condition = output.stack.fsx.data_repository == {
      file_system_path     = "/llm-pipeline/var/tiers/shared"
      data_repository_path = "s3://${output.stack.buckets.checkpoints}/fsx-l1"
    }
    error_message = "FSx must link /llm-pipeline/var/tiers/shared to s3://<checkpoint bucket>/fsx-l1"
  }
  assert {
    condition     = output.stack.buckets.checkpoints == "llmp-prod-checkpoints-${var.account}"
    error_message = "the checkpoint bucket is named <name>-checkpoints-<account>"
  }

  # IRSA: each role trusts exactly its one service account through the cluster's OIDC provider
  assert {
    condition = { for k, p in output.stack.irsa_trust_policies : k => jsondecode(p).Statement[0].Condition.StringEquals["${var.issuer}:sub"] } == {
      airflow            = "system:serviceaccount:airflow:airflow-worker"
      spark              = "system:serviceaccount:llm-pipeline:spark"
      trainer            = "system:serviceaccount:llm-pipeline:trainer"
      mlflow             = "system:serviceaccount:mlflow:mlflow"
      airflow_logs       = "system:serviceaccount:airflow:airflow-api-server"
      cluster_autoscaler = "system:serviceaccount:kube-system:cluster-autoscaler"
    }
    error_message = "each IRSA role must trust system:serviceaccount:<namespace>:<account> of its plane only"
  }
  assert {
    condition = alltrue([for p in values(output.stack.irsa_trust_policies) :
      length(jsondecode(p).Statement) == 1 &&
      jsondecode(p).Statement[0].Action == "sts:AssumeRoleWithWebIdentity" &&
      jsondecode(p).Statement[0].Principal.Federated == "arn:aws:iam::${var.account}:oidc-provider/${var.issuer}" &&
    jsondecode(p).Statement[0].Condition.StringEquals["${var.issuer}:aud"] == "sts.amazonaws.com"])
    error_message = "IRSA trust: web identity from the cluster's OIDC provider, audience sts.amazonaws.com"
  }
  assert {
    condition     = output.stack.node_groups.gpu.labels["nvidia.com/gpu.present"] == "true"
    error_message = "GPU nodes carry nvidia.com/gpu.present=true, the label NVIDIA's device-plugin chart's default affinity selects"
  }
  # scale from zero: the cluster autoscaler resizes only this cluster's groups, and finds in the GPU group's ASG
  # tags the labels and taint a training pod selects and tolerates while the group has no node
  assert {
    condition = [for st in jsondecode(output.stack.autoscaling.policy).Statement : st.Condition if st.Sid == "ResizeThisClustersGroups"] == [{
      StringEquals = { "aws:ResourceTag/k8s.io/cluster-autoscaler/${output.stack.cluster_name}" = "owned" }
    }] && contains(flatten([for st in jsondecode(output.stack.autoscaling.policy).Statement : st.Action]), "eks:DescribeNodegroup")
    error_message = "the cluster autoscaler may resize only groups tagged k8s.io/cluster-autoscaler/<cluster> = owned, and reads managed node groups"
  }
  assert {
    condition     = output.stack.autoscaling.gpu_node_template_tags["k8s.io/cluster-autoscaler/node-template/label/llm-pipeline/pool"] == "gpu" && output.stack.autoscaling.gpu_node_template_tags["k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu"] == "true:NoSchedule" && output.stack.node_groups.gpu.scaling.min_size == 0
    error_message = "the GPU group scales from zero: its ASG carries the pool label and the nvidia.com/gpu taint as node-template tags"
  }
  assert {
    # the template node the autoscaler builds from the ASG's label tags has exactly the labels the group's nodes get
    # (tests/test_contract_gpu_nodes.py: a training pod schedules on a node with those labels and the group's taints)
    condition = tomap({ for k, v in output.stack.autoscaling.gpu_node_template_tags : trimprefix(k, "k8s.io/cluster-autoscaler/node-template/label/") => v
    if startswith(k, "k8s.io/cluster-autoscaler/node-template/label/") }) == tomap(output.stack.node_groups.gpu.labels)
    error_message = "the GPU group's node-template label tags must equal its node labels"
  }
  assert {
    condition     = output.stack.autoscaling.service_account == "kube-system:cluster-autoscaler" && output.stack.autoscaling.role_arn == output.stack.irsa_role_arns["cluster_autoscaler"]
    error_message = "the cluster autoscaler runs as kube-system:cluster-autoscaler with its own IRSA role"
  }
  # buckets: no public access, versioned, TLS only
  assert {
    condition = length(output.stack.security.buckets) == 4 && alltrue([for b in values(output.stack.security.buckets) :
    alltrue(values(b.public_access_block)) && b.versioning == "Enabled"])
    error_message = "every pipeline bucket blocks public access (all four settings) and is versioned"
  }
  assert {
    condition = alltrue([for b in values(output.stack.security.buckets) : length([for st in b.tls_only : st
      if st.effect == "Deny" && join(",", st.actions) == "s3:*" && length([for c in st.condition : c
    if c.test == "Bool" && c.variable == "aws:SecureTransport" && join(",", c.values) == "false"]) == 1]) == 1])
    error_message = "every pipeline bucket's policy denies any request not made over TLS"
  }
  # EKS: a private endpoint, public only from the given CIDRs; nodes IMDSv2 only (hop limit 1), root volumes encrypted
  assert {
    condition     = output.stack.security.eks.endpoint_private_access && !output.stack.security.eks.endpoint_public_access && length(output.stack.security.eks.public_access_cidrs) == 0
    error_message = "with no endpoint_public_cidrs the API endpoint is private only"
  }
  assert {
    condition = alltrue([for n in values(output.stack.security.eks.nodes) : n.http_tokens == "required" && n.hop_limit == 1 &&
    length(n.ebs) > 0 && alltrue([for e in n.ebs : e.encrypted && e.kms_key_id == output.stack.kms_key_arn])])
    error_message = "every node group: IMDSv2 required (hop limit 1), root volumes encrypted with the stack's key"
  }
  # RDS: deletion protection, a week or more of backups, Multi-AZ, a final snapshot
  assert {
    condition     = output.stack.security.database.deletion_protection && output.stack.security.database.backup_retention_days >= 7 && output.stack.security.database.multi_az && !output.stack.security.database.skip_final_snapshot
    error_message = "prod's metadata database: deletion protection, a week or more of backups, Multi-AZ, a final snapshot"
  }
  assert {
    condition     = contains(["1.34", "1.35", "1.36"], output.stack.kubernetes_version)
    error_message = "the default EKS version must be in standard support"
  }
}

# An EKS version out of standard support is refused at plan (the eks module's validation names the supported set).
run "eks_version_out_of_support_is_refused" {
  command = plan
  module {
    source = "../../../modules/eks"
  }
  variables {
    name               = "llmp-prod"
    kubernetes_version = "1.31"
    vpc_id             = "vpc-0123456789abcdef0"
    vpc_cidr           = "10.40.0.0/16"
    private_subnet_ids = ["subnet-0123456789abcdef0", "subnet-0123456789abcdef1"]
    kms_key_arn        = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
  }
  expect_failures = [var.kubernetes_version]
}

# EFA is requested only when asked for (an image with libfabric and aws-ofi-nccl), and then on every GPU node.
run "efa_when_asked_for" {
  command = plan
  variables {
    gpu_efa_interfaces = 32
  }
  assert {
    condition     = output.stack.gpu_efa_interfaces == 32 && output.stack.node_groups.gpu.labels["vpc.amazonaws.com/efa.present"] == "true" && output.stack.autoscaling.gpu_node_template_tags["k8s.io/cluster-autoscaler/node-template/resources/vpc.amazonaws.com/efa"] == "32"
    error_message = "gpu_efa_interfaces = 32 reaches the GPU nodes, and the autoscaler's template node (EFA devices of a group at zero)"
  }
}

# Retention is the root's to set: the lifecycle rules follow var.retention (here: logs kept a week, checkpoints
# archived after a year).
run "retention_follows_the_roots_variable" {
  command = plan
  variables {
    retention = { task_log_days = 7, checkpoint_glacier_days = 365 }
  }
  assert {
    condition     = [for r in output.stack.lifecycle.mlflow : r.expiration_days if r.prefix == "airflow-logs/"] == [7]
    error_message = "retention.task_log_days must set the expiry of Airflow's task logs"
  }
  assert {
    condition     = [for r in output.stack.lifecycle.checkpoints : r.transitions["GLACIER"] if contains(keys(r.transitions), "GLACIER")] == [365]
    error_message = "retention.checkpoint_glacier_days must set the checkpoints' Glacier transition"
  }
}
