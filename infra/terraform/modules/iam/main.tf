# IRSA roles, least privilege: each role may be assumed only by its one Kubernetes service account, and
# may touch only the buckets (and prefixes) its plane needs, through the one KMS key.
#
#   role     reads                          writes
#   airflow  raw, curated, checkpoints      curated, checkpoints  (stages run in the workers: ingest, tokenize, promote, eval)
#   spark    raw, curated                   curated               (dedup and filter executors)
#   trainer  curated                        checkpoints           (PyTorchJob pods: shards in, checkpoints out)
#   mlflow   mlflow                         mlflow                (the tracking server's artifact store)

locals {
  access = {
    airflow = { read = ["raw", "curated", "checkpoints", "mlflow"], write = ["curated", "checkpoints", "mlflow"] }
    spark   = { read = ["raw", "curated"], write = ["curated"] }
    trainer = { read = ["curated", "checkpoints"], write = ["checkpoints"] }
    mlflow  = { read = ["mlflow"], write = ["mlflow"] }
  }
}

data "aws_iam_policy_document" "assume" {
  for_each = local.access
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]
    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:sub"
      values   = ["system:serviceaccount:${var.service_accounts[each.key]}"]
    }
    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "this" {
  for_each             = local.access
  name                 = "${var.name}-${each.key}"
  assume_role_policy   = data.aws_iam_policy_document.assume[each.key].json
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
    resources = [for b in each.value.read : "${var.bucket_arns[b]}/*"]
  }
  statement {
    sid = "WriteObjects"
    actions = ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts",
    "s3:PutObjectTagging"]
    resources = [for b in each.value.write : "${var.bucket_arns[b]}/*"]
  }
  statement {
    sid       = "BucketKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey", "kms:DescribeKey"]
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

# The service accounts the roles trust, annotated for IRSA, and their RBAC bindings. Airflow's and MLflow's
# service accounts are created by their Helm releases (metadata module) with the annotation set there.
locals {
  sa = { for k, v in var.service_accounts : k => { namespace = split(":", v)[0], name = split(":", v)[1] } }
}

resource "kubernetes_service_account_v1" "pipeline" {
  for_each = toset(["spark", "trainer"])
  metadata {
    name        = local.sa[each.key].name
    namespace   = local.sa[each.key].namespace
    annotations = { "eks.amazonaws.com/role-arn" = aws_iam_role.this[each.key].arn }
  }
}

resource "kubernetes_role_binding_v1" "spark" {
  metadata {
    name      = "spark-driver"
    namespace = local.sa.spark.namespace
  }
  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = var.spark_role_name
  }
  subject {
    kind      = "ServiceAccount"
    name      = local.sa.spark.name
    namespace = local.sa.spark.namespace
  }
}

# The workers submit and collect the training jobs; the triggerer (a deferred task's wait) watches them, reads their
# pods' logs and deletes a job whose task a user stopped: both run as their own service accounts, bound here.
resource "kubernetes_role_binding_v1" "airflow_launcher" {
  metadata {
    name      = "airflow-launcher"
    namespace = local.sa.spark.namespace
  }
  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = var.launcher_role_name
  }
  subject {
    kind      = "ServiceAccount"
    name      = local.sa.airflow.name
    namespace = local.sa.airflow.namespace
  }
  subject {
    kind      = "ServiceAccount"
    name      = split(":", var.triggerer_service_account)[1]
    namespace = split(":", var.triggerer_service_account)[0]
  }
}
