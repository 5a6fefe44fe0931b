# FSx for Lustre PERSISTENT_2 (the L1 tier, /fsx in the training pods): KMS-encrypted, in the GPU nodes'
# AZ, linked to the checkpoint bucket by a data repository association that imports new/changed/deleted
# objects and exports new/changed/deleted files, so a checkpoint written to /fsx/checkpoints reaches S3
# without a copy step. Pods mount it through the FSx CSI driver (the eks module's add-on) with a static
# PersistentVolume + claim (`fsx-checkpoints`, the job spec's launcher.shared_fs_claim; modules/namespaces).

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

resource "aws_security_group" "lustre" {
  name        = "${var.name}-fsx-lustre"
  description = "Lustre traffic from inside the VPC"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${var.name}-fsx-lustre" })
}

resource "aws_vpc_security_group_ingress_rule" "lustre_988" {
  security_group_id = aws_security_group.lustre.id
  description       = "Lustre (LNet) from the VPC"
  cidr_ipv4         = var.vpc_cidr
  ip_protocol       = "tcp"
  from_port         = 988
  to_port           = 988
  tags              = var.tags
}

resource "aws_vpc_security_group_ingress_rule" "lustre_1018" {
  security_group_id = aws_security_group.lustre.id
  description       = "Lustre (LNet) from the VPC"
  cidr_ipv4         = var.vpc_cidr
  ip_protocol       = "tcp"
  from_port         = 1018
  to_port           = 1023
  tags              = var.tags
}

resource "aws_vpc_security_group_egress_rule" "lustre_vpc" {
  security_group_id = aws_security_group.lustre.id
  description       = "Lustre servers answer clients inside the VPC"
  cidr_ipv4         = var.vpc_cidr
  ip_protocol       = "tcp"
  from_port         = 988
  to_port           = 1023
  tags              = var.tags
}

resource "aws_fsx_lustre_file_system" "this" {
  deployment_type                   = "PERSISTENT_2"
  storage_type                      = "SSD"
  storage_capacity                  = var.storage_capacity_gib
  per_unit_storage_throughput       = var.throughput_per_tib
  subnet_ids                        = [var.subnet_id]
  security_group_ids                = [aws_security_group.lustre.id]
  kms_key_id                        = var.kms_key_arn
  data_compression_type             = "LZ4"
  file_system_type_version          = "2.15"
  automatic_backup_retention_days   = 7
  copy_tags_to_backups              = true
  daily_automatic_backup_start_time = "03:00"
  tags                              = merge(var.tags, { Name = "${var.name}-l1" })
}

resource "aws_fsx_data_repository_association" "checkpoints" {
  file_system_id                   = aws_fsx_lustre_file_system.this.id
  data_repository_path             = "s3://${var.checkpoint_bucket}/${var.repository_prefix}"
  file_system_path                 = var.repository_path
  batch_import_meta_data_on_create = true
  s3 {
    auto_import_policy {
      events = ["NEW", "CHANGED", "DELETED"]
    }
    auto_export_policy {
      events = ["NEW", "CHANGED", "DELETED"]
    }
  }
  tags = var.tags
}
