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
