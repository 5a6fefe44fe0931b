output "address" {
  description = "PostgreSQL host name (private)."
  value       = aws_db_instance.this.address
}

output "port" {
  description = "PostgreSQL port."
  value       = local.db_port
}

output "master_secret_arn" {
  description = "Secrets Manager secret with the master credentials (managed and rotated by RDS); only the platform root's login job reads it."
  value       = aws_db_instance.this.master_user_secret[0].secret_arn
}

output "encryption" {
  description = "storage_encrypted and kms_key_id of the instance (storage, Performance Insights and the master secret use the same key)."
  value = {
    storage_encrypted   = aws_db_instance.this.storage_encrypted
    kms_key_id          = aws_db_instance.this.kms_key_id
    publicly_accessible = aws_db_instance.this.publicly_accessible
  }
}

output "protection" {
  description = "What keeps the metadata database from being lost: deletion protection, automated backups, Multi-AZ."
  value = {
    deletion_protection   = aws_db_instance.this.deletion_protection
    backup_retention_days = aws_db_instance.this.backup_retention_period
    multi_az              = aws_db_instance.this.multi_az
    skip_final_snapshot   = aws_db_instance.this.skip_final_snapshot
  }
}
