# Metadata plane inside the cluster: the databases `airflow`, `mlflow` and `mlflow_auth` on the AWS layer's RDS
# instance, each owned by its application's own login (the master login, which RDS generates and keeps in Secrets
# Manager, is used only by the job that creates them); the MLflow tracking server behind MLflow's basic-auth app
# as a Deployment on the system nodes (artifacts proxied to S3 through its IRSA role); Airflow from the official
# apache-airflow Helm chart with the FAB auth manager (RBAC roles) and a generated admin login.
#
# Credentials: each application's database password and the MLflow and Airflow admin passwords are
# generated here (random_password, kept in the encrypted state and in Secrets Manager under our KMS key)
# and reach the pods only as Kubernetes Secrets. Rotation updates the consumers: bump
# var.credentials_generation and apply; the passwords are regenerated, the job sets them on the database
# roles, the Secrets change and the Deployments roll (their pod templates carry the Secrets' hashes).
# RDS's own rotation of the master password (every 7 days) touches no application.
#
# Why Airflow on EKS (Helm) and not MWAA: the stages run in the workers next to the jobs they launch (the
# same image carries pyspark, torch and this package), the workers' service account gets IRSA and
# namespace RBAC to submit training jobs and Spark executors directly, and dev/prod differ only in values;
# MWAA would need its own VPC plumbing, a requirements/plugins upload for torch-sized dependencies, and
# an EKS access entry for its execution role, for the same DAG.

# The RDS-managed master secret: only the job below uses it (to create the applications' roles and databases).
data "aws_secretsmanager_secret_version" "master" {
  secret_id = var.db.master_secret_arn
}

locals {
  master    = jsondecode(data.aws_secretsmanager_secret_version.master.secret_string)
  host      = "${var.db.address}:${var.db.port}"
  admin_dsn = "postgresql://${local.master.username}:${urlencode(local.master.password)}@${local.host}/postgres?sslmode=require"
  # one login per application, each owning its databases
  apps = {
    airflow = { role = "airflow_app", databases = ["airflow"] }
    mlflow  = { role = "mlflow_app", databases = ["mlflow", "mlflow_auth"] }
  }
  app_dsn = { for k, a in local.apps : k => "postgresql://${a.role}:${urlencode(random_password.db[k].result)}@${local.host}/${a.databases[0]}?sslmode=require" }
}

resource "random_password" "db" {
  for_each = local.apps
  length   = 32
  special  = false
  keepers  = { generation = var.credentials_generation }
}

resource "aws_secretsmanager_secret" "db" {
  for_each                = local.apps
  name                    = "${var.name}/metadata/${each.key}"
  description             = "Database login of ${each.key} (role ${each.value.role}); rotated by bumping credentials_generation"
  kms_key_id              = var.kms_key_arn
  recovery_window_in_days = 7
  tags                    = var.tags
  # checkov:skip=CKV2_AWS_57:Rotation is terraform's (credentials_generation), which also updates the Kubernetes Secrets the pods read; a Secrets Manager rotation Lambda would leave them stale.
}

resource "aws_secretsmanager_secret_version" "db" {
  for_each      = local.apps
  secret_id     = aws_secretsmanager_secret.db[each.key].id
  secret_string = jsonencode({ username = each.value.role, password = random_password.db[each.key].result, dsn = local.app_dsn[each.key] })
}

locals {
  namespaces = { airflow = var.namespaces.airflow, mlflow = var.namespaces.mlflow }
}

resource "kubernetes_secret_v1" "db" {
  for_each = local.namespaces
  metadata {
    name      = "${each.key}-metadata-db"
    namespace = each.value
  }
  # Airflow 3 also opens an async engine, whose driver its URI names: SQLAlchemy 2.1's postgresql:// is psycopg 3,
  # and its async form (psycopg_async) keeps libpq's sslmode (asyncpg, Airflow's default guess, does not)
  data = merge({ connection = local.app_dsn[each.key] },
  each.key == "airflow" ? { async_connection = replace(local.app_dsn[each.key], "postgresql://", "postgresql+psycopg_async://") } : {})
}

resource "kubernetes_secret_v1" "db_admin" {
  metadata {
    name      = "metadata-db-admin"
    namespace = var.namespaces.mlflow
  }
  data = {
    connection = local.admin_dsn
    # psql variables: the roles, their passwords, their databases
    roles = join("\n", flatten([for k, a in local.apps : [for d in a.databases : "${a.role} ${random_password.db[k].result} ${d}"]]))
  }
}

# Each application's role (created, or its password set again on rotation) and its databases, owned by it.
resource "kubernetes_job_v1" "app_logins" {
  metadata {
    name      = "metadata-logins-${substr(sha256(join(",", [for k in keys(local.apps) : random_password.db[k].result])), 0, 8)}"
    namespace = var.namespaces.mlflow
  }
  spec {
    backoff_limit = 4
    template {
      metadata {}
      spec {
        restart_policy                  = "OnFailure"
        automount_service_account_token = false
        security_context {
          run_as_non_root = true
          run_as_user     = 70
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }
        container {
          name              = "logins"
          image             = "public.ecr.aws/docker/library/postgres:16-alpine"
          image_pull_policy = "Always"
          command = ["sh", "-ec", join("\n", [
            "while read -r role pw db; do",
            "  psql \"$ADMIN_DSN\" -v ON_ERROR_STOP=1 -v role=\"$role\" -v pw=\"$pw\" <<'SQL'",
            "SELECT format('CREATE ROLE %I LOGIN', :'role') WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'role')\\gexec",
            "ALTER ROLE :\"role\" WITH LOGIN PASSWORD :'pw';",
            "GRANT :\"role\" TO CURRENT_USER;",
            "SQL",
            "  psql \"$ADMIN_DSN\" -tc \"SELECT 1 FROM pg_database WHERE datname='$db'\" | grep -q 1 || psql \"$ADMIN_DSN\" -c \"CREATE DATABASE \\\"$db\\\" OWNER \\\"$role\\\"\"",
            "  psql \"$ADMIN_DSN\" -v ON_ERROR_STOP=1 -c \"ALTER DATABASE \\\"$db\\\" OWNER TO \\\"$role\\\"; REVOKE ALL ON DATABASE \\\"$db\\\" FROM PUBLIC\"",
            "done < /var/run/secrets/admin/roles",
          ])]
          env {
            name = "ADMIN_DSN"
            value_from {
              secret_key_ref {
                name = kubernetes_secret_v1.db_admin.metadata[0].name
                key  = "connection"
              }
            }
          }
          volume_mount {
            name       = "admin"
            mount_path = "/var/run/secrets/admin"
            read_only  = true
          }
          resources {
            limits   = { cpu = "250m", memory = "128Mi" }
            requests = { cpu = "50m", memory = "64Mi" }
          }
          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            capabilities {
              drop = ["ALL"]
            }
          }
        }
        volume {
          name = "admin"
          secret {
            secret_name = kubernetes_secret_v1.db_admin.metadata[0].name
          }
        }
      }
    }
  }
  wait_for_completion = true
}

# ---------------------------------------------------------------- MLflow authentication (basic-auth app)
resource "random_password" "mlflow_admin" {
  length  = 32
  special = false
  keepers = { generation = var.credentials_generation }
}

# MLflow's basic-auth app refuses to start without a static CSRF key shared by its replicas
resource "random_password" "mlflow_flask" {
  length  = 48
  special = false
  keepers = { generation = var.credentials_generation }
}

resource "kubernetes_secret_v1" "mlflow_auth" {
  metadata {
    name      = "mlflow-auth"
    namespace = var.namespaces.mlflow
  }
  data = {
    "basic_auth.ini" = <<-EOT
      [mlflow]
      default_permission = NO_PERMISSIONS
      database_uri = postgresql://mlflow_app:${urlencode(random_password.db["mlflow"].result)}@${local.host}/mlflow_auth?sslmode=require
      admin_username = pipeline
      admin_password = ${random_password.mlflow_admin.result}
      authorization_function = mlflow.server.auth:authenticate_request_basic_auth
    EOT
    flask-secret-key = random_password.mlflow_flask.result
  }
}

# The pipeline's clients (Airflow's pods, the training and evaluation pods) log in with these.
resource "kubernetes_secret_v1" "mlflow_client" {
  for_each = { airflow = var.namespaces.airflow, pipeline = var.namespaces.pipeline }
  metadata {
    name      = "mlflow-client"
    namespace = each.value
  }
  data = {
    MLFLOW_TRACKING_USERNAME = "pipeline"
    MLFLOW_TRACKING_PASSWORD = random_password.mlflow_admin.result
  }
}

# ---------------------------------------------------------------- MLflow tracking server
locals {
  mlflow_service = "mlflow"
  mlflow_args = ["python", "-m", "pipelines.eval.tracking_server", "--service", local.mlflow_service,
    "--namespace", var.namespaces.mlflow, "--port", "5000", "--app-name", "basic-auth",
    "--backend-store-uri-file", "/var/run/secrets/metadata-db/connection",
  "--artifacts-destination", "s3://${var.mlflow_bucket}/artifacts"]
}

resource "kubernetes_service_account_v1" "mlflow" {
  metadata {
    name        = "mlflow"
    namespace   = var.namespaces.mlflow
    annotations = { "eks.amazonaws.com/role-arn" = var.irsa_role_arns["mlflow"] }
  }
}

resource "kubernetes_deployment_v1" "mlflow" {
  # checkov:skip=CKV_K8S_43:The image is var.mlflow_image, whose validation accepts only a digest reference (image@sha256:...); checkov cannot see the variable's value.
  # checkov:skip=CKV_K8S_14:Same variable: a digest reference is fixed (stricter than a tag), and checkov cannot see its value.
  metadata {
    name      = "mlflow"
    namespace = var.namespaces.mlflow
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
        # a rotated password rolls the pods
        annotations = { "llm-pipeline/credentials" = sha256(join(",", [random_password.db["mlflow"].result, random_password.mlflow_admin.result, random_password.mlflow_flask.result])) }
      }
      spec {
        service_account_name = kubernetes_service_account_v1.mlflow.metadata[0].name
        node_selector        = { "llm-pipeline/pool" = "system" }
        security_context {
          run_as_non_root = true
          run_as_user     = 50000
          run_as_group    = 0
          seccomp_profile {
            type = "RuntimeDefault"
          }
        }
        container {
          name              = "mlflow"
          image             = var.mlflow_image
          image_pull_policy = "Always"
          # the pipeline image's /entrypoint runs these args (tests/test_contract_mlflow.py runs them in the image):
          # every request authenticated (MLflow's basic-auth app; users and permissions in mlflow_auth); 0.0.0.0 so
          # the Service reaches the pod, which the namespace's NetworkPolicy opens to the pipeline only; the Host
          # headers of the Service's DNS names allowed (MLflow answers 403 to any other name); the database URI read
          # from the Secret's file, never on a command line
          args = local.mlflow_args
          env {
            name  = "MLFLOW_AUTH_CONFIG_PATH"
            value = "/var/run/secrets/mlflow-auth/basic_auth.ini"
          }
          env {
            name = "MLFLOW_FLASK_SERVER_SECRET_KEY"
            value_from {
              secret_key_ref {
                name = kubernetes_secret_v1.mlflow_auth.metadata[0].name
                key  = "flask-secret-key"
              }
            }
          }
          # the entrypoint's wait for Airflow's database is for Airflow's containers, not this one
          env {
            name  = "CONNECTION_CHECK_MAX_COUNT"
            value = "0"
          }
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
          volume_mount {
            name       = "mlflow-auth"
            mount_path = "/var/run/secrets/mlflow-auth"
            read_only  = true
          }
        }
        volume {
          name = "mlflow-auth"
          secret {
            secret_name = kubernetes_secret_v1.mlflow_auth.metadata[0].name
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
  depends_on = [kubernetes_job_v1.app_logins]
}

resource "kubernetes_service_v1" "mlflow" {
  metadata {
    name      = local.mlflow_service
    namespace = var.namespaces.mlflow
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
# airflow_image is REPOSITORY:TAG or REPOSITORY[:TAG]@sha256:DIGEST; the chart takes a digest over a tag.
# The KubernetesExecutor's worker pods take their image from the chart's pod template, which (before apache/airflow
# #69776) renders REPOSITORY:TAG and ignores defaultAirflowDigest: its tag is given as TAG@DIGEST ("pinned" when the
# image has no tag), a reference that resolves by the digest, so the workers run exactly the scheduler's image.
locals {
  airflow_image = regex("^(?P<repository>[^@]+?)(?::(?P<tag>[^:/@]+))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$", var.airflow_image)
  pod_template_tag = (local.airflow_image.digest == null ? local.airflow_image.tag :
  "${coalesce(local.airflow_image.tag, "pinned")}@${local.airflow_image.digest}")
}

# Read by tests/test_contract_airflow_chart.py, which runs them in the image against a real PostgreSQL.
locals {
  # the image's AIRFLOW_HOME (infra/image/Containerfile): the chart mounts airflow.cfg at <airflowHome>/airflow.cfg
  airflow_home      = "/opt/llm-pipeline/var/airflow"
  admin_login_mount = "/opt/airflow/admin-login"
  create_admin_args = ["bash", "-c", "exec airflow users create -r Admin -u admin -e admin@example.invalid -f Pipeline -l Admin -p \"$(cat /opt/airflow/admin-login/password)\""]
}

resource "helm_release" "airflow" {
  name       = "airflow"
  repository = "https://airflow.apache.org"
  chart      = "airflow"
  version    = var.airflow_chart_version
  namespace  = var.namespaces.airflow
  timeout    = 900
  values = [yamlencode({
    executor                 = "KubernetesExecutor"
    defaultAirflowRepository = local.airflow_image.repository
    defaultAirflowTag        = local.airflow_image.tag
    defaultAirflowDigest     = local.airflow_image.digest
    images                   = { pod_template = { tag = local.pod_template_tag } }
    postgresql               = { enabled = false }
    data                     = { metadataSecretName = kubernetes_secret_v1.db["airflow"].metadata[0].name }
    # the image's AIRFLOW_HOME: the chart mounts airflow.cfg (executor, auth manager, ...) at <airflowHome>/airflow.cfg
    airflowHome = local.airflow_home
    # the async engine's URI (the chart passes the sync one; see kubernetes_secret_v1.db)
    secret = [{ envName = "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC", secretName = kubernetes_secret_v1.db["airflow"].metadata[0].name, secretKey = "async_connection" }]
    # logins and roles: the FAB auth manager (RBAC: Admin, Op, User, Viewer), one admin created by the chart's job;
    # the chart's Kubernetes RBAC for its own service accounts; secret keys of our own, not the chart's defaults
    config = {
      core = { auth_manager = "airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager" }
      fab  = { auth_rate_limited = "True" }
      # task logs outlive their pods (a KubernetesExecutor worker's emptyDir goes with it, and with it the training
      # replicas' output the launcher copies into the task log): written to S3 through the workers' IRSA role
      # (the amazon provider; aws_default carries the region, or the default credential chain answers)
      logging = {
        remote_logging         = "True"
        remote_base_log_folder = "s3://${var.mlflow_bucket}/airflow-logs"
        remote_log_conn_id     = "aws_default"
        delete_local_logs      = "True"
      }
    }
    rbac = { create = true }
    # Airflow 3 in chart 1.22 (its upgrading-to-airflow-3 guide): the admin user is createUserJob's (webserver.*
    # configures Airflow 2's webserver), the API server's secret key and the JWT secret come from our Secret. The
    # admin password is not in these values (Helm keeps values in the cluster): the job reads it from the Secret
    # airflow-admin. Applied by Terraform, the jobs run without Helm hooks, as the chart's docs require.
    airflowVersion = var.airflow_version
    createUserJob = {
      useHelmHooks   = false
      applyCustomEnv = false
      defaultUser = {
        enabled   = true, role = "Admin", username = "admin", email = "admin@example.invalid",
        firstName = "Pipeline", lastName = "Admin"
      }
      extraVolumes      = [{ name = "admin-login", secret = { secretName = kubernetes_secret_v1.airflow_admin.metadata[0].name } }]
      extraVolumeMounts = [{ name = "admin-login", mountPath = local.admin_login_mount, readOnly = true }]
      args              = local.create_admin_args
    }
    migrateDatabaseJob     = { useHelmHooks = false, applyCustomEnv = false }
    apiSecretKeySecretName = kubernetes_secret_v1.airflow_keys.metadata[0].name
    jwtSecretName          = kubernetes_secret_v1.airflow_keys.metadata[0].name
    # MLflow logins for the tasks (MLFLOW_TRACKING_USERNAME / _PASSWORD)
    extraEnvFrom = yamlencode([{ secretRef = { name = kubernetes_secret_v1.mlflow_client["airflow"].metadata[0].name } }])
    nodeSelector = { "llm-pipeline/pool" = "system" }
    # the job spec's environment overrides (SPARK_MASTER, S3_*, MLFLOW_TRACKING_URI, LLMP_HOME) for every pod
    env = [for k, v in var.pipeline_env : { name = k, value = v }]
    # the pod's IP for Spark's client-mode driver (the executors call back to it)
    extraEnv = yamlencode([{ name = "POD_IP", valueFrom = { fieldRef = { fieldPath = "status.podIP" } } }])
    # the deferred training-job waits run here, as this service account (bound to the read-and-delete job-watcher
    # Role in modules/namespaces; no AWS role: it only talks to the Kubernetes API)
    triggerer = { serviceAccount = { name = var.triggerer_service_account } }
    # the API server shows finished tasks' logs from S3: a read-only IRSA role (modules/iam airflow_logs)
    apiServer = { serviceAccount = {
      name        = "airflow-api-server"
      annotations = { "eks.amazonaws.com/role-arn" = var.irsa_role_arns["airflow_logs"] }
    } }
    workers = {
      serviceAccount = {
        name        = var.worker_service_account
        annotations = { "eks.amazonaws.com/role-arn" = var.irsa_role_arns["airflow"] }
      }
      # FSx at the same path as in the training pods: run.root and checkpoint.l0 live under it
      extraVolumes      = [{ name = "shared-fs", persistentVolumeClaim = { claimName = var.shared_fs_claim } }]
      extraVolumeMounts = [{ name = "shared-fs", mountPath = var.shared_fs_mount }]
    }
  })]
}

resource "kubernetes_secret_v1" "airflow_admin" {
  metadata {
    name      = "airflow-admin"
    namespace = var.namespaces.airflow
  }
  data = { password = random_password.airflow_admin.result }
}

resource "random_password" "airflow_admin" {
  length  = 32
  special = false
  keepers = { generation = var.credentials_generation }
}

resource "random_password" "airflow_keys" {
  for_each = toset(["api-secret-key", "jwt-secret"])
  length   = 48
  special  = false
}

resource "kubernetes_secret_v1" "airflow_keys" {
  metadata {
    name      = "airflow-keys"
    namespace = var.namespaces.airflow
  }
  data = {
    "api-secret-key" = random_password.airflow_keys["api-secret-key"].result
    "jwt-secret"     = random_password.airflow_keys["jwt-secret"].result
  }
}
