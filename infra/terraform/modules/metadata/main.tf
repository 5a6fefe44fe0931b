# Metadata plane: one RDS PostgreSQL instance (encrypted, private, Multi-AZ in prod, master password
# generated and kept by RDS in Secrets Manager under our KMS key) holding two databases, `airflow` and
# `mlflow`; the MLflow tracking server as a Deployment on the system nodes (artifacts proxied to S3 through
# its IRSA role); Airflow from the official apache-airflow Helm chart.
#
# Why Airflow on EKS (Helm) and not MWAA: the stages run in the workers next to the jobs they launch (the
# same image carries pyspark, torch and this package), the workers' service account gets IRSA and
# namespace RBAC to submit PyTorchJobs and Spark executors directly, and dev/prod differ only in values;
# MWAA would need its own VPC plumbing, a requirements/plugins upload for torch-sized dependencies, and
# an EKS access entry for its execution role, for the same DAG.

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
  security_group_id = aws_security_group.db.id
  description       = "PostgreSQL from inside the VPC"
  cidr_ipv4         = var.vpc_cidr
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
  engine_version                      = "16.4"
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

# The RDS-managed secret; its password goes into Kubernetes secrets for the two servers. (RDS rotates it
# every 7 days: re-run `terraform apply` afterwards, or sync it with the Secrets Store CSI driver.)
data "aws_secretsmanager_secret_version" "master" {
  secret_id = aws_db_instance.this.master_user_secret[0].secret_arn
}

locals {
  master = jsondecode(data.aws_secretsmanager_secret_version.master.secret_string)
  dsn    = "postgresql://${local.master.username}:${urlencode(local.master.password)}@${aws_db_instance.this.address}:${local.db_port}"
}

resource "kubernetes_namespace_v1" "mlflow" {
  metadata {
    name = "mlflow"
  }
}

locals {
  namespaces = { airflow = var.airflow_namespace, mlflow = kubernetes_namespace_v1.mlflow.metadata[0].name }
}

resource "kubernetes_secret_v1" "db" {
  for_each = local.namespaces
  metadata {
    name      = "${each.key}-metadata-db"
    namespace = each.value
  }
  data = {
    connection = "${local.dsn}/${each.key}?sslmode=require"
  }
}

# `airflow` exists (db_name); create `mlflow` once, idempotently.
resource "kubernetes_job_v1" "create_mlflow_db" {
  metadata {
    name      = "create-mlflow-db"
    namespace = kubernetes_namespace_v1.mlflow.metadata[0].name
  }
  spec {
    backoff_limit = 4
    template {
      metadata {}
      spec {
        restart_policy                  = "OnFailure"
        automount_service_account_token = false
        container {
          name              = "createdb"
          image             = "public.ecr.aws/docker/library/postgres:16-alpine"
          image_pull_policy = "Always"
          command           = ["sh", "-c", "psql \"$ADMIN_DSN\" -tc \"SELECT 1 FROM pg_database WHERE datname='mlflow'\" | grep -q 1 || psql \"$ADMIN_DSN\" -c 'CREATE DATABASE mlflow'"]
          env {
            name = "ADMIN_DSN"
            value_from {
              secret_key_ref {
                name = kubernetes_secret_v1.db["airflow"].metadata[0].name
                key  = "connection"
              }
            }
          }
          resources {
            limits   = { cpu = "250m", memory = "128Mi" }
            requests = { cpu = "50m", memory = "64Mi" }
          }
          security_context {
            run_as_non_root            = true
            run_as_user                = 70
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            capabilities {
              drop = ["ALL"]
            }
          }
        }
      }
    }
  }
  wait_for_completion = true
}

# ---------------------------------------------------------------- MLflow tracking server
resource "kubernetes_service_account_v1" "mlflow" {
  metadata {
    name        = "mlflow"
    namespace   = kubernetes_namespace_v1.mlflow.metadata[0].name
    annotations = { "eks.amazonaws.com/role-arn" = var.irsa_role_arns["mlflow"] }
  }
}

resource "kubernetes_deployment_v1" "mlflow" {
  # checkov:skip=CKV_K8S_43:The image is a variable (var.mlflow_image); pin it by digest (image@sha256:...) in the env's tfvars.
  metadata {
    name      = "mlflow"
    namespace = kubernetes_namespace_v1.mlflow.metadata[0].name
    labels    = { app = "mlflow" }
  }
  spec {
    replicas = 2
    selector {
      match_labels = { app = "mlflow" }
    }
    template {
      metadata {
        labels = { app = "mlflow" }
      }
      spec {
        service_account_name = kubernetes_service_account_v1.mlflow.metadata[0].name
        node_selector        = { "llm-pipeline/pool" = "system" }
        security_context {
          run_as_non_root = true
          run_as_user     = 1000
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }
        container {
          name              = "mlflow"
          image             = var.mlflow_image
          image_pull_policy = "Always"
          command = ["sh", "-c", join(" ", [
            "exec mlflow server --host 0.0.0.0 --port 5000",
            "--backend-store-uri \"$(cat /var/run/secrets/metadata-db/connection)\"",
            "--artifacts-destination s3://${var.mlflow_bucket}/artifacts --serve-artifacts",
          ])]
          port {
            container_port = 5000
          }
          liveness_probe {
            http_get {
              path = "/health"
              port = 5000
            }
            initial_delay_seconds = 30
          }
          readiness_probe {
            http_get {
              path = "/health"
              port = 5000
            }
          }
          resources {
            limits   = { cpu = "2", memory = "4Gi" }
            requests = { cpu = "500m", memory = "1Gi" }
          }
          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            capabilities {
              drop = ["ALL"]
            }
          }
          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
          volume_mount {
            name       = "metadata-db"
            mount_path = "/var/run/secrets/metadata-db"
            read_only  = true
          }
        }
        volume {
          name = "tmp"
          empty_dir {}
        }
        volume {
          name = "metadata-db"
          secret {
            secret_name = kubernetes_secret_v1.db["mlflow"].metadata[0].name
          }
        }
      }
    }
  }
  depends_on = [kubernetes_job_v1.create_mlflow_db]
}

resource "kubernetes_service_v1" "mlflow" {
  metadata {
    name      = "mlflow"
    namespace = kubernetes_namespace_v1.mlflow.metadata[0].name
  }
  spec {
    selector = { app = "mlflow" }
    port {
      port        = 5000
      target_port = 5000
    }
    type = "ClusterIP"
  }
}

# ---------------------------------------------------------------- Airflow
resource "helm_release" "airflow" {
  name       = "airflow"
  repository = "https://airflow.apache.org"
  chart      = "airflow"
  version    = var.airflow_chart_version
  namespace  = var.airflow_namespace
  timeout    = 900
  values = [yamlencode({
    executor                 = "KubernetesExecutor"
    defaultAirflowRepository = var.airflow_image.repository
    defaultAirflowTag        = var.airflow_image.tag
    postgresql               = { enabled = false }
    data                     = { metadataSecretName = kubernetes_secret_v1.db["airflow"].metadata[0].name }
    nodeSelector             = { "llm-pipeline/pool" = "system" }
    # the job spec's environment overrides (SPARK_MASTER, S3_*, MLFLOW_TRACKING_URI, LLMP_HOME) for every pod
    env = [for k, v in var.pipeline_env : { name = k, value = v }]
    # the pod's IP for Spark's client-mode driver (the executors call back to it)
    extraEnv = yamlencode([{ name = "POD_IP", valueFrom = { fieldRef = { fieldPath = "status.podIP" } } }])
    workers = {
      serviceAccount = {
        name        = "airflow-worker"
        annotations = { "eks.amazonaws.com/role-arn" = var.irsa_role_arns["airflow"] }
      }
      # FSx at the same path as in the training pods: run.root and checkpoint.l0 live under it
      extraVolumes      = [{ name = "shared-fs", persistentVolumeClaim = { claimName = var.shared_fs_claim } }]
      extraVolumeMounts = [{ name = "shared-fs", mountPath = var.shared_fs_mount }]
    }
  })]
}
