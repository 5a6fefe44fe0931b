# The pipeline's namespaces and what runs in them may do: the airflow, pipeline (training jobs, Spark executors)
# and mlflow namespaces with Pod Security labels; FSx for Lustre as a static PersistentVolume + claim in airflow
# and pipeline; the spark and trainer service accounts (IRSA-annotated); the Roles and bindings of the Airflow
# worker (launcher, Spark driver) and triggerer (watcher). The accounts are created inside the namespace resource
# they reference, so a first apply never creates them before their namespace.

# Pod Security admission. pipeline: baseline, not restricted: the training image (NCCL, EFA) and Spark's
# executors run as their images' users without a seccomp profile of our setting; baseline still refuses
# privileged pods, host namespaces and hostPath. `privileged` (var.pipeline_pod_security) is needed only for
# hostPath scratch (launcher.node_local_path, services.spark_local_dir); the default emptyDir on the instance
# store's RAID0 is not a hostPath. airflow: baseline, because the chart's pods set no seccomp profile. mlflow:
# restricted (the MLflow pods run as non-root with RuntimeDefault seccomp, no capabilities, a read-only root).
locals {
  pod_security = {
    pipeline = var.pipeline_pod_security
    airflow  = "baseline"
    mlflow   = "restricted"
  }
  namespace_labels = { for ns, level in local.pod_security : ns => {
    "app.kubernetes.io/part-of"          = "llm-pipeline"
    "pod-security.kubernetes.io/enforce" = level
    "pod-security.kubernetes.io/warn"    = "restricted"
    "pod-security.kubernetes.io/audit"   = "restricted"
  } }
}

resource "kubernetes_namespace_v1" "pipeline" {
  metadata {
    name   = var.namespaces.pipeline
    labels = local.namespace_labels.pipeline
  }
}

resource "kubernetes_namespace_v1" "airflow" {
  metadata {
    name   = var.namespaces.airflow
    labels = local.namespace_labels.airflow
  }
}

resource "kubernetes_namespace_v1" "mlflow" {
  metadata {
    name   = var.namespaces.mlflow
    labels = local.namespace_labels.mlflow
  }
}

# ---------------------------------------------------------------- FSx for Lustre
# The same filesystem in both namespaces (a claim binds one volume, so one PV per namespace): the training
# pods and the Airflow workers see run.root and the checkpoints at the same path (launcher.shared_fs_mount).
locals {
  fsx_namespaces = {
    pipeline = kubernetes_namespace_v1.pipeline.metadata[0].name
    airflow  = kubernetes_namespace_v1.airflow.metadata[0].name
  }
}

resource "kubernetes_persistent_volume_v1" "fsx" {
  for_each = local.fsx_namespaces
  metadata {
    name = "${var.name}-fsx-${each.key}"
  }
  spec {
    capacity                         = { storage = "${var.fsx.capacity_gib}Gi" }
    access_modes                     = ["ReadWriteMany"]
    persistent_volume_reclaim_policy = "Retain"
    storage_class_name               = ""
    mount_options                    = ["flock"]
    persistent_volume_source {
      csi {
        driver        = "fsx.csi.aws.com"
        volume_handle = var.fsx.file_system_id
        volume_attributes = {
          dnsname   = var.fsx.dns_name
          mountname = var.fsx.mount_name
        }
      }
    }
  }
}

resource "kubernetes_persistent_volume_claim_v1" "fsx" {
  for_each = local.fsx_namespaces
  metadata {
    name      = var.shared_fs_claim
    namespace = each.value
  }
  spec {
    access_modes       = ["ReadWriteMany"]
    storage_class_name = ""
    volume_name        = kubernetes_persistent_volume_v1.fsx[each.key].metadata[0].name
    resources {
      requests = { storage = "${var.fsx.capacity_gib}Gi" }
    }
  }
}

# The run root on FSx, made and owned before the first task: a new Lustre file system's root is root's, 0755, and
# every pipeline pod runs as uid 50000 group 0 (the image's user, the Airflow chart's uid/gid). The job makes
# <mount>/llm-pipeline (run.root, L1 and the job specs' LLMP_HOME live under it) owned 50000:0, group-writable with
# setgid so whatever a pod of another uid in group 0 writes stays shared. Idempotent (install -d), re-run when the
# mount or the owner changes.
locals {
  run_root_owner = { uid = 50000, gid = 0 }
  run_root       = "${var.shared_fs_mount}/llm-pipeline"
  run_root_dirs = [local.run_root, "${local.run_root}/var", "${local.run_root}/var/tiers",
  "${local.run_root}/var/tiers/shared"]
}

resource "kubernetes_job_v1" "shared_fs_init" {
  metadata {
    name      = "shared-fs-init-${substr(sha256("${local.run_root}:${local.run_root_owner.uid}:${local.run_root_owner.gid}"), 0, 8)}"
    namespace = kubernetes_namespace_v1.pipeline.metadata[0].name
  }
  spec {
    backoff_limit = 4
    template {
      metadata {}
      spec {
        restart_policy                  = "OnFailure"
        automount_service_account_token = false
        container {
          name              = "init"
          image             = "public.ecr.aws/docker/library/busybox:1.37"
          image_pull_policy = "IfNotPresent"
          # the run root, var/ and the L1 path the FSx data repository association may already have made (root's):
          # each made if missing, then owned and group-writable; nothing below them is touched (no -R)
          command = ["sh", "-ec", join(" ", [
            "for d in ${join(" ", local.run_root_dirs)}; do",
            "install -d -o ${local.run_root_owner.uid} -g ${local.run_root_owner.gid} -m 2775 \"$d\";",
            "chown ${local.run_root_owner.uid}:${local.run_root_owner.gid} \"$d\"; chmod 2775 \"$d\";",
            "ls -ld \"$d\"; done",
          ])]
          # root only to chown the new directories (baseline Pod Security allows it in this namespace)
          security_context {
            run_as_user                = 0
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            capabilities {
              drop = ["ALL"]
              add  = ["CHOWN", "FOWNER"]
            }
          }
          resources {
            limits   = { cpu = "100m", memory = "64Mi" }
            requests = { cpu = "10m", memory = "16Mi" }
          }
          volume_mount {
            name       = "shared-fs"
            mount_path = var.shared_fs_mount
          }
        }
        volume {
          name = "shared-fs"
          persistent_volume_claim {
            claim_name = kubernetes_persistent_volume_claim_v1.fsx["pipeline"].metadata[0].name
          }
        }
      }
    }
  }
  wait_for_completion = true
  timeouts {
    create = "10m"
  }
}

# ---------------------------------------------------------------- service accounts
# namespace:name of each plane's account, as the AWS layer's IRSA roles trust them.
locals {
  sa = { for k, v in var.service_accounts : k => { namespace = split(":", v)[0], name = split(":", v)[1] } }
}

# The training pods' (trainer) and the Spark executors' (spark) accounts: IRSA for S3, nothing in the Kubernetes
# API. Created in the pipeline namespace resource, which orders them after it.
resource "kubernetes_service_account_v1" "pipeline" {
  for_each = toset(["spark", "trainer"])
  metadata {
    name        = local.sa[each.key].name
    namespace   = kubernetes_namespace_v1.pipeline.metadata[0].name
    annotations = { "eks.amazonaws.com/role-arn" = var.irsa_role_arns[each.key] }
  }
  lifecycle {
    precondition {
      condition     = local.sa[each.key].namespace == var.namespaces.pipeline
      error_message = "The ${each.key} IRSA role trusts ${var.service_accounts[each.key]}, not an account in the pipeline namespace ${var.namespaces.pipeline}: apply the AWS layer with the same namespaces."
    }
  }
}

# ---------------------------------------------------------------- RBAC in the pipeline namespace
# Spark runs in client mode: the driver is the Airflow worker's process, so the worker's account creates,
# watches and deletes the executor pods (and their config maps); the executors' own account (spark) gets no Role.
resource "kubernetes_role_v1" "spark_driver" {
  metadata {
    name      = "spark-driver"
    namespace = kubernetes_namespace_v1.pipeline.metadata[0].name
  }
  rule {
    api_groups = [""]
    resources  = ["pods", "services", "configmaps", "persistentvolumeclaims"]
    verbs      = ["create", "get", "list", "watch", "delete", "deletecollection", "patch"]
  }
}

# The Airflow workers submit training jobs (TrainJobs, or v1 PyTorchJobs), watch them, read their pods' logs and
# delete them (timeout, kill, a stopped task).
resource "kubernetes_role_v1" "launcher" {
  metadata {
    name      = "pipeline-launcher"
    namespace = kubernetes_namespace_v1.pipeline.metadata[0].name
  }
  rule {
    api_groups = ["trainer.kubeflow.org"]
    resources  = ["trainjobs"]
    verbs      = ["create", "get", "list", "watch", "delete"]
  }
  rule {
    api_groups = ["kubeflow.org"]
    resources  = ["pytorchjobs"]
    verbs      = ["create", "get", "list", "watch", "delete"]
  }
  rule {
    api_groups = [""]
    resources  = ["pods", "pods/log"]
    verbs      = ["get", "list", "watch"]
  }
}

# The triggerer runs the deferred waits: it reads a job and its pods' logs and deletes a job whose task a user
# stopped. Read and delete only: it creates nothing.
resource "kubernetes_role_v1" "job_watcher" {
  metadata {
    name      = "pipeline-job-watcher"
    namespace = kubernetes_namespace_v1.pipeline.metadata[0].name
  }
  rule {
    api_groups = ["trainer.kubeflow.org"]
    resources  = ["trainjobs"]
    verbs      = ["get", "list", "watch", "delete"]
  }
  rule {
    api_groups = ["kubeflow.org"]
    resources  = ["pytorchjobs"]
    verbs      = ["get", "list", "watch", "delete"]
  }
  rule {
    api_groups = [""]
    resources  = ["pods", "pods/log"]
    verbs      = ["get", "list", "watch"]
  }
}

# role -> the Airflow account bound to it (the chart creates both accounts in the airflow namespace)
locals {
  bindings = {
    airflow-launcher     = { role = kubernetes_role_v1.launcher.metadata[0].name, account = local.sa.airflow.name }
    airflow-spark-driver = { role = kubernetes_role_v1.spark_driver.metadata[0].name, account = local.sa.airflow.name }
    airflow-triggerer    = { role = kubernetes_role_v1.job_watcher.metadata[0].name, account = var.triggerer_service_account }
  }
}

resource "kubernetes_role_binding_v1" "airflow" {
  for_each = local.bindings
  metadata {
    name      = each.key
    namespace = kubernetes_namespace_v1.pipeline.metadata[0].name
  }
  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = each.value.role
  }
  subject {
    kind      = "ServiceAccount"
    name      = each.value.account
    namespace = kubernetes_namespace_v1.airflow.metadata[0].name
  }
}
