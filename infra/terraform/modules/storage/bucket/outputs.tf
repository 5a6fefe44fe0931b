output "name" {
  description = "Bucket name."
  value       = aws_s3_bucket.this.bucket
}

output "arn" {
  description = "Bucket ARN."
  value       = aws_s3_bucket.this.arn
}

output "encryption" {
  description = "The bucket's default encryption: sse_algorithm and kms_master_key_id."
  value       = one(one(aws_s3_bucket_server_side_encryption_configuration.this.rule).apply_server_side_encryption_by_default)
}

output "security" {
  description = "What keeps the bucket private and its objects recoverable: the public access block, versioning, the TLS-only statement (terraform test asserts them)."
  value = {
    public_access_block = {
      block_public_acls       = aws_s3_bucket_public_access_block.this.block_public_acls
      block_public_policy     = aws_s3_bucket_public_access_block.this.block_public_policy
      ignore_public_acls      = aws_s3_bucket_public_access_block.this.ignore_public_acls
      restrict_public_buckets = aws_s3_bucket_public_access_block.this.restrict_public_buckets
    }
    versioning = one(aws_s3_bucket_versioning.this.versioning_configuration).status
    tls_only = [for s in data.aws_iam_policy_document.tls_only.statement : {
      effect    = s.effect
      actions   = s.actions
      condition = [for c in s.condition : { test = c.test, variable = c.variable, values = c.values }]
    }]
    policy = aws_s3_bucket_policy.this.policy
  }
}

output "lifecycle" {
  description = "The bucket's lifecycle rules: id, prefix (\"\" for the whole bucket), transitions and expiry days (terraform test asserts them)."
  value = [for r in aws_s3_bucket_lifecycle_configuration.this.rule : {
    id              = r.id
    prefix          = try(one(r.filter).prefix, null) == null ? "" : one(r.filter).prefix
    transitions     = { for t in r.transition : t.storage_class => t.days }
    expiration_days = try(one(r.expiration).days, null)
    delete_markers  = try(one(r.expiration).expired_object_delete_marker, false) == true
  }]
}
