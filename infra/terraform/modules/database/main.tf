# The metadata database: one RDS PostgreSQL 16 instance, encrypted with the stack's KMS key, private (admits
# PostgreSQL from the private subnets only), rds.force_ssl, Multi-AZ in prod, deletion protection, Performance
# Insights, enhanced monitoring, logs exported. Its master password is generated and kept by RDS in Secrets
# Manager under the same key (manage_master_user_password), never in the configuration. The databases and the
# applications' own logins (airflow_app, mlflow_app) are created inside the cluster by the platform root's
# metadata module, which reads the master secret.

locals {
  db_port = 5432
}

resource "aws_db_subnet_group" "this" {
  name       = "${var.name}-metadata"
  subnet_ids = var.private_subnet_ids
  tags       = var.tags
}

resource "aws_security_group" "db" {
  name        = "${var.name}-metadata-db"
  description = "PostgreSQL from the cluster's pods"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${var.name}-metadata-db" })
}

resource "aws_vpc_security_group_ingress_rule" "db" {
  for_each          = toset(var.private_subnet_cidrs)
  security_group_id = aws_security_group.db.id
  description       = "PostgreSQL from the private subnets (the nodes and their pods), not the whole VPC"
  cidr_ipv4         = each.value
  ip_protocol       = "tcp"
  from_port         = local.db_port
  to_port           = local.db_port
  tags              = var.tags
}

resource "aws_db_parameter_group" "this" {
  name   = "${var.name}-metadata-pg16"
  family = "postgres16"
  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }
  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }
  parameter {
    name  = "log_statement"
    value = "ddl"
  }
  tags = var.tags
}

data "aws_iam_policy_document" "monitoring_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["monitoring.rds.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "monitoring" {
  name               = "${var.name}-rds-monitoring"
  assume_role_policy = data.aws_iam_policy_document.monitoring_assume.json
  tags               = var.tags
}

data "aws_partition" "current" {}

resource "aws_iam_role_policy_attachment" "monitoring" {
  role       = aws_iam_role.monitoring.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/service-role/AmazonRDSEnhancedMonitoringRole"
}

resource "aws_db_instance" "this" {
  identifier                          = "${var.name}-metadata"
  engine                              = "postgres"
  engine_version                      = "16" # the major only: with auto_minor_version_upgrade a pinned minor drifts
  instance_class                      = var.instance_class
  allocated_storage                   = var.allocated_storage_gib
  max_allocated_storage               = var.allocated_storage_gib * 5
  storage_type                        = "gp3"
  storage_encrypted                   = true
  kms_key_id                          = var.kms_key_arn
  db_name                             = "airflow"
  username                            = "pipeline_admin"
  manage_master_user_password         = true
  master_user_secret_kms_key_id       = var.kms_key_arn
  iam_database_authentication_enabled = true
  db_subnet_group_name                = aws_db_subnet_group.this.name
  vpc_security_group_ids              = [aws_security_group.db.id]
  parameter_group_name                = aws_db_parameter_group.this.name
  publicly_accessible                 = false
  multi_az                            = var.multi_az
  backup_retention_period             = var.backup_retention_days
  copy_tags_to_snapshot               = true
  deletion_protection                 = var.deletion_protection
  skip_final_snapshot                 = false
  final_snapshot_identifier           = "${var.name}-metadata-final"
  auto_minor_version_upgrade          = true
  performance_insights_enabled        = true
  performance_insights_kms_key_id     = var.kms_key_arn
  monitoring_interval                 = 30
  monitoring_role_arn                 = aws_iam_role.monitoring.arn
  enabled_cloudwatch_logs_exports     = ["postgresql", "upgrade"]
  tags                                = var.tags
}
