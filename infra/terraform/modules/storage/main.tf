# The pipeline's object storage (the L2 tier and the data plane): one bucket per purpose, all with
# SSE-KMS under one customer-managed key (rotated), versioning, public access blocked, a TLS-only
# bucket policy, access logs to a log bucket, and lifecycle rules; checkpoints move to Standard-IA
# and then Glacier. Incomplete multipart uploads are aborted everywhere.

data "aws_caller_identity" "current" {}
data "aws_region" "current" {}
data "aws_partition" "current" {}

locals {
  account = data.aws_caller_identity.current.account_id
  # EC2 Auto Scaling's service-linked role. A key policy may name only principals that exist, and the node groups
  # (which would create the role) come after this key: an account that has never used Auto Scaling sets
  # create_autoscaling_service_role = true; otherwise the role is looked up, and a missing one fails the plan
  # saying so.
  autoscaling_role = var.create_autoscaling_service_role ? aws_iam_service_linked_role.autoscaling[0].arn : data.aws_iam_role.autoscaling[0].arn
}

resource "aws_iam_service_linked_role" "autoscaling" {
  count            = var.create_autoscaling_service_role ? 1 : 0
  aws_service_name = "autoscaling.amazonaws.com"
  tags             = var.tags
}

data "aws_iam_role" "autoscaling" {
  count = var.create_autoscaling_service_role ? 0 : 1
  name  = "AWSServiceRoleForAutoScaling"
}

# The key policy is built with jsonencode (not aws_iam_policy_document) so that it is a known value at plan time
# and `terraform test` can assert on its statements.
locals {
  partition = data.aws_partition.current.partition
  region    = data.aws_region.current.name
  key_statements = [
    { # the account root administers its own key (AWS's default key policy); IAM policies then scope access
      Sid       = "AccountAdmin"
      Effect    = "Allow"
      Principal = { AWS = "arn:${local.partition}:iam::${local.account}:root" }
      Action    = "kms:*"
      Resource  = "*" # "*" in a key policy is this key
    },
    { # node volumes encrypted with this key are created by EC2 Auto Scaling (the node groups' launch templates):
      # its service-linked role must use the key and grant it to EC2 for the attached volumes, or nodes never launch
      Sid       = "AutoScalingVolumes"
      Effect    = "Allow"
      Principal = { AWS = local.autoscaling_role }
      Action    = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey"]
      Resource  = "*"
    },
    {
      Sid       = "AutoScalingVolumeGrants"
      Effect    = "Allow"
      Principal = { AWS = local.autoscaling_role }
      Action    = "kms:CreateGrant"
      Resource  = "*"
      Condition = { Bool = { "kms:GrantIsForAWSResource" = "true" } }
    },
    {
      Sid       = "CloudWatchLogs"
      Effect    = "Allow"
      Principal = { Service = "logs.${local.region}.amazonaws.com" }
      Action    = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
      Resource  = "*"
      Condition = { ArnLike = { "kms:EncryptionContext:aws:logs:arn" = "arn:${local.partition}:logs:${local.region}:${local.account}:*" } }
    },
  ]
  # FSx for Lustre reads and writes the SSE-KMS checkpoint bucket (the data repository association's import and
  # export) as its per-file-system service-linked role, AWSServiceRoleForFSxS3Access_<fs-id>, which the key policy
  # must name (FSx for Lustre guide, "Working with server-side encrypted Amazon S3 buckets"), scoped as that guide
  # scopes it: through S3 in this region, from this account, on the checkpoint bucket only (S3 Bucket Keys are on,
  # so the encryption context is the bucket's ARN; its objects' ARNs without them).
  bucket_names    = { for purpose in ["raw", "curated", "checkpoints", "mlflow"] : purpose => "${var.name}-${purpose}-${local.account}" }
  checkpoints_arn = "arn:${local.partition}:s3:::${local.bucket_names["checkpoints"]}"
  fsx_statements = length(var.fsx_s3_access_role_arns) == 0 ? [] : [{
    Sid       = "FSxDataRepositoryS3Access"
    Effect    = "Allow"
    Principal = { AWS = var.fsx_s3_access_role_arns }
    Action    = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey", "kms:DescribeKey"]
    Resource  = "*"
    Condition = {
      StringEquals = { "kms:CallerAccount" = local.account, "kms:ViaService" = "s3.${local.region}.amazonaws.com" }
      StringLike   = { "kms:EncryptionContext:aws:s3:arn" = [local.checkpoints_arn, "${local.checkpoints_arn}/*"] }
    }
  }]
}

# The FSx role names the file system, and the file system is encrypted with this key: naming it in the key's own
# policy would be a cycle (key -> file system -> key). So the key is created with the other statements, and
# aws_kms_key_policy, applied after the file system's data repository association has created the role (a key
# policy may name only principals that exist), sets the full policy: that exact role, no wildcard principal. A
# replaced file system gets its new role in the policy on the same apply.
resource "aws_kms_key" "this" {
  description             = "${var.name}: pipeline buckets, logs, EKS secrets, RDS, FSx"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = jsonencode({ Version = "2012-10-17", Statement = local.key_statements })
  tags                    = var.tags
  lifecycle {
    ignore_changes = [policy] # owned by aws_kms_key_policy.this after creation
  }
}

resource "aws_kms_key_policy" "this" {
  key_id = aws_kms_key.this.id
  policy = jsonencode({ Version = "2012-10-17", Statement = concat(local.key_statements, local.fsx_statements) })
}

resource "aws_kms_alias" "this" {
  name          = "alias/${var.name}"
  target_key_id = aws_kms_key.this.key_id
}

# ---- access-log bucket (SSE-S3: S3 server access logging cannot write to SSE-KMS buckets)
resource "aws_s3_bucket" "logs" {
  # checkov:skip=CKV_AWS_145:S3 server access logging can only deliver to a bucket with SSE-S3, not SSE-KMS.
  # checkov:skip=CKV_AWS_144:Access logs stay in-region; replicating them is a per-deployment audit choice.
  # checkov:skip=CKV_AWS_18:This is the access-log bucket; logging it to itself would loop.
  # checkov:skip=CKV2_AWS_62:Nothing consumes events of the access-log bucket.
  bucket        = "${var.name}-access-logs-${local.account}"
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_public_access_block" "logs" {
  bucket                  = aws_s3_bucket.logs.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "logs" {
  bucket = aws_s3_bucket.logs.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "logs" {
  bucket = aws_s3_bucket.logs.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "AES256"
    }
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "logs" {
  bucket = aws_s3_bucket.logs.id
  rule {
    id     = "expire-access-logs"
    status = "Enabled"
    filter {}
    expiration {
      days = 365
    }
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_expiry_days
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_multipart_days
    }
  }
}

data "aws_iam_policy_document" "logs" {
  statement {
    sid       = "S3ServerAccessLogs"
    actions   = ["s3:PutObject"]
    resources = ["${aws_s3_bucket.logs.arn}/*"]
    principals {
      type        = "Service"
      identifiers = ["logging.s3.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account]
    }
  }
  statement {
    sid       = "TLSOnly"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.logs.arn, "${aws_s3_bucket.logs.arn}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "logs" {
  bucket = aws_s3_bucket.logs.id
  policy = data.aws_iam_policy_document.logs.json
}

# ---- the pipeline buckets: the bucket/ submodule once per purpose; checkpoints also get cold-tier transitions
# (Standard-IA, read at once like Standard; Glacier only when checkpoint_glacier_days is set: L2 restore reads old steps)
locals {
  cold_tiers = {
    checkpoints = { ia_days = var.checkpoint_ia_days, glacier_days = var.checkpoint_glacier_days }
  }
  # the platform layer's remote task logs (modules/metadata: remote_base_log_folder) expire; nothing else does
  expiring = {
    mlflow = { "airflow-logs/" = var.task_log_days }
  }
}

module "bucket" {
  source               = "./bucket"
  for_each             = local.bucket_names
  bucket               = each.value
  purpose              = each.key
  kms_key_arn          = aws_kms_key.this.arn
  log_bucket           = aws_s3_bucket.logs.id
  noncurrent_days      = var.noncurrent_expiry_days
  abort_multipart_days = var.abort_multipart_days
  ia_days              = try(local.cold_tiers[each.key].ia_days, null)
  glacier_days         = try(local.cold_tiers[each.key].glacier_days, null)
  expire_prefixes      = try(local.expiring[each.key], {})
  force_destroy        = var.force_destroy
  tags                 = var.tags
}

locals {
  buckets = module.bucket
}
