output "bucket_names" {
  description = "Bucket name by purpose: raw, curated, checkpoints, mlflow."
  value       = { for k, b in local.buckets : k => b.name }
}

output "bucket_arns" {
  description = "Bucket ARN by purpose."
  value       = { for k, b in local.buckets : k => b.arn }
}

output "kms_key_arn" {
  description = "The customer-managed KMS key (buckets, log groups, EKS secrets, RDS, FSx)."
  value       = aws_kms_key.this.arn
}

output "access_log_bucket" {
  description = "Bucket receiving S3 server access logs."
  value       = aws_s3_bucket.logs.bucket
}

output "kms_key_policy" {
  description = "The key's policy (JSON) as aws_kms_key_policy sets it: the account root, Auto Scaling's and FSx's service-linked roles, CloudWatch Logs."
  value       = aws_kms_key_policy.this.policy
}

output "bucket_encryption" {
  description = "Default encryption of each pipeline bucket by purpose: sse_algorithm and kms_master_key_id."
  value       = { for k, b in local.buckets : k => b.encryption }
}

output "bucket_security" {
  description = "Each pipeline bucket's public access block, versioning and TLS-only statement, by purpose."
  value       = { for k, b in local.buckets : k => b.security }
}

output "bucket_lifecycle" {
  description = "Each pipeline bucket's lifecycle rules (purpose → rules)."
  value       = { for k, b in local.buckets : k => b.lifecycle }
}
