# IRSA roles, least privilege: each role may be assumed only by its one Kubernetes service account, and
# may touch only the buckets (and prefixes) its plane needs, through the one KMS key.
#
#   role     reads                          writes
#   airflow  raw, curated, checkpoints,     curated, checkpoints, (stages run in the workers: ingest, tokenize, promote, eval,
#            mlflow                         mlflow                 register)
#   spark    raw, curated                   curated               (dedup and filter executors)
#   trainer  curated, checkpoints           checkpoints           (training pods: shards in, checkpoints out)
#   mlflow   mlflow (artifacts/)            mlflow (artifacts/)   (the tracking server's artifact store)
#   airflow_logs  mlflow (airflow-logs/)    —                     (the Airflow API server: task logs in S3, read only)
#   cluster_autoscaler  no bucket: resizes the Auto Scaling groups of this cluster's node groups, nothing else

locals {
  access = {
    airflow      = { read = ["raw", "curated", "checkpoints", "mlflow"], write = ["curated", "checkpoints", "mlflow"] }
    spark        = { read = ["raw", "curated"], write = ["curated"] }
    trainer      = { read = ["curated", "checkpoints"], write = ["checkpoints"] }
    mlflow       = { read = ["mlflow"], write = ["mlflow"] }
    airflow_logs = { read = ["mlflow"], write = [] }
  }
  # the objects a role may read and write in a bucket it shares with another plane: only its own prefix (the
  # tracking server's --artifacts-destination, Airflow's remote_base_log_folder; modules/metadata). Listing stays
  # bucket-wide: the names, not the bytes.
  object_prefixes = {
    mlflow       = { mlflow = "artifacts/" }
    airflow_logs = { mlflow = "airflow-logs/" }
  }
}

# The trust policies are built with jsonencode (not aws_iam_policy_document) so that they are known at plan time
# and `terraform test` can assert on them: web identity through the cluster's OIDC provider, for exactly one
# service account (sub) and STS as the audience (aud).
locals {
  assume_role_policies = { for k in concat(keys(local.access), ["cluster_autoscaler"]) : k => jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Action    = "sts:AssumeRoleWithWebIdentity"
      Principal = { Federated = var.oidc_provider_arn }
      Condition = {
        StringEquals = {
          "${var.oidc_issuer}:sub" = "system:serviceaccount:${var.service_accounts[k]}"
          "${var.oidc_issuer}:aud" = "sts.amazonaws.com"
        }
      }
    }]
  }) }
}

resource "aws_iam_role" "this" {
  for_each             = local.access
  name                 = "${var.name}-${each.key}"
  assume_role_policy   = local.assume_role_policies[each.key]
  max_session_duration = 43200
  tags                 = merge(var.tags, { Plane = each.key })
}

data "aws_iam_policy_document" "access" {
  for_each = local.access
  statement {
    sid       = "ListBuckets"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketMultipartUploads"]
    resources = [for b in each.value.read : var.bucket_arns[b]]
  }
  statement {
    sid       = "ReadObjects"
    actions   = ["s3:GetObject", "s3:GetObjectVersion", "s3:GetObjectAttributes"]
    resources = [for b in each.value.read : "${var.bucket_arns[b]}/${try(local.object_prefixes[each.key][b], "")}*"]
  }
  dynamic "statement" {
    for_each = length(each.value.write) > 0 ? [each.value.write] : []
    content {
      sid = "WriteObjects"
      actions = ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts",
      "s3:PutObjectTagging"]
      resources = [for b in statement.value : "${var.bucket_arns[b]}/${try(local.object_prefixes[each.key][b], "")}*"]
    }
  }
  statement {
    sid       = "BucketKey"
    actions   = length(each.value.write) > 0 ? ["kms:Decrypt", "kms:GenerateDataKey", "kms:DescribeKey"] : ["kms:Decrypt", "kms:DescribeKey"]
    resources = [var.kms_key_arn]
    # the key only through S3 (SSE-KMS of the pipeline buckets), not directly or through another service
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${data.aws_region.current.name}.amazonaws.com"]
    }
  }
}

data "aws_region" "current" {}

resource "aws_iam_policy" "access" {
  for_each    = local.access
  name        = "${var.name}-${each.key}-buckets"
  description = "${each.key}: the pipeline buckets its plane reads and writes"
  policy      = data.aws_iam_policy_document.access[each.key].json
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "access" {
  for_each   = local.access
  role       = aws_iam_role.this[each.key].name
  policy_arn = aws_iam_policy.access[each.key].arn
}

# ---------------------------------------------------------------- the cluster autoscaler
# What cluster-autoscaler's AWS provider calls (its README's minimal policy with scale-from-zero): describe the
# groups, launch templates and instance types (to build a template node for a group at zero), the managed node
# group (its labels and taints), and change the size of, or terminate an instance in, only the Auto Scaling groups
# tagged as this cluster's (EKS tags its managed node groups' ASGs k8s.io/cluster-autoscaler/<cluster> = owned).
# jsonencode, not aws_iam_policy_document: known at plan time, so `terraform test` asserts on it.
locals {
  cluster_autoscaler_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid    = "Describe"
        Effect = "Allow"
        Action = ["autoscaling:DescribeAutoScalingGroups", "autoscaling:DescribeAutoScalingInstances",
          "autoscaling:DescribeLaunchConfigurations", "autoscaling:DescribeScalingActivities",
          "autoscaling:DescribeTags", "ec2:DescribeImages", "ec2:DescribeInstanceTypes",
        "ec2:DescribeLaunchTemplateVersions", "ec2:GetInstanceTypesFromInstanceRequirements", "eks:DescribeNodegroup"]
        Resource = "*"
      },
      {
        Sid       = "ResizeThisClustersGroups"
        Effect    = "Allow"
        Action    = ["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"]
        Resource  = "*"
        Condition = { StringEquals = { "aws:ResourceTag/k8s.io/cluster-autoscaler/${var.cluster_name}" = "owned" } }
      },
    ]
  })
}

resource "aws_iam_role" "cluster_autoscaler" {
  name                 = "${var.name}-cluster-autoscaler"
  assume_role_policy   = local.assume_role_policies["cluster_autoscaler"]
  max_session_duration = 3600
  tags                 = merge(var.tags, { Plane = "cluster_autoscaler" })
}

resource "aws_iam_role_policy" "cluster_autoscaler" {
  name   = "resize-node-groups"
  role   = aws_iam_role.cluster_autoscaler.id
  policy = local.cluster_autoscaler_policy
}
