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
