output "file_system_id" {
  description = "FSx for Lustre filesystem id (the CSI PersistentVolume's volumeHandle)."
  value       = aws_fsx_lustre_file_system.this.id
}

output "dns_name" {
  description = "Filesystem DNS name (the CSI volume attribute dnsname)."
  value       = aws_fsx_lustre_file_system.this.dns_name
}

output "mount_name" {
  description = "Lustre mount name (the CSI volume attribute mountname)."
  value       = aws_fsx_lustre_file_system.this.mount_name
}

output "security_group_id" {
  description = "Security group of the filesystem."
  value       = aws_security_group.lustre.id
}

output "kms_key_id" {
  description = "KMS key encrypting the file system at rest."
  value       = aws_fsx_lustre_file_system.this.kms_key_id
}

output "data_repository" {
  description = "The data repository association: file_system_path (the L1 tier) linked to data_repository_path (s3://<checkpoint bucket>/<prefix>)."
  value = {
    file_system_path     = aws_fsx_data_repository_association.checkpoints.file_system_path
    data_repository_path = aws_fsx_data_repository_association.checkpoints.data_repository_path
  }
}

output "s3_access_role_arn" {
  description = "The file system's service-linked role for S3 (AWSServiceRoleForFSxS3Access_<fs-id>), which the KMS key policy names; known once the data repository association (which creates the role) exists."
  value       = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:role/aws-service-role/s3.data-source.lustre.fsx.amazonaws.com/AWSServiceRoleForFSxS3Access_${aws_fsx_lustre_file_system.this.id}"
  depends_on  = [aws_fsx_data_repository_association.checkpoints]
}

output "storage_capacity_gib" {
  description = "Capacity of the file system in GiB (the size of its PersistentVolumes)."
  value       = aws_fsx_lustre_file_system.this.storage_capacity
}
