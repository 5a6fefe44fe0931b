# One pipeline bucket: SSE-KMS with a bucket key, versioning, public access blocked, owner-enforced
# objects, access logs, EventBridge notifications, a TLS-only policy, and lifecycle rules.

resource "aws_s3_bucket" "this" {
  # checkov:skip=CKV_AWS_144:Cross-region replication is a per-deployment DR choice (doubles storage cost); versioned, and shards/checkpoints are rebuildable from raw data.
  bucket        = var.bucket
  force_destroy = var.force_destroy
  tags          = merge(var.tags, { Purpose = var.purpose })
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket                  = aws_s3_bucket.this.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = var.kms_key_arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_logging" "this" {
  bucket        = aws_s3_bucket.this.id
  target_bucket = var.log_bucket
  target_prefix = "${var.purpose}/"
}

# Object events to EventBridge (e.g. start a DAG run when new raw data lands).
resource "aws_s3_bucket_notification" "this" {
  bucket      = aws_s3_bucket.this.id
  eventbridge = true
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "lifecycle"
    status = "Enabled"
    filter {}
    dynamic "transition" {
      for_each = var.ia_days != null ? [var.ia_days] : []
      content {
        days          = transition.value
        storage_class = "STANDARD_IA"
      }
    }
    dynamic "transition" {
      for_each = var.glacier_days != null ? [var.glacier_days] : []
      content {
        days          = transition.value
        storage_class = "GLACIER"
      }
    }
    # an object that expired (a prefix rule below) leaves a delete marker; once its versions are gone, so does that
    expiration {
      expired_object_delete_marker = true
    }
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_days
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_multipart_days
    }
  }

  # objects under a prefix that expire (e.g. Airflow's task logs in the MLflow bucket): after `days` the current
  # version becomes noncurrent (the bucket is versioned) and is removed noncurrent_days later by the rule above
  dynamic "rule" {
    for_each = var.expire_prefixes
    content {
      id     = "expire-${trimsuffix(rule.key, "/")}"
      status = "Enabled"
      filter {
        prefix = rule.key
      }
      expiration {
        days = rule.value
      }
    }
  }
}

data "aws_iam_policy_document" "tls_only" {
  statement {
    sid       = "TLSOnly"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]
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

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.tls_only.json
}
