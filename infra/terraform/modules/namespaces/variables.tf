variable "name" {
  type        = string
  description = "Name prefix of the environment (the FSx PersistentVolumes are <name>-fsx-<namespace>)."
}

variable "namespaces" {
  type        = object({ airflow = string, pipeline = string, mlflow = string })
  description = "Names of the namespaces to create (the AWS layer's output: its IRSA roles trust accounts in them)."
}

variable "pipeline_pod_security" {
  type        = string
  description = "Pod Security level enforced in the pipeline namespace: baseline, or privileged only when launcher.node_local_path / services.spark_local_dir use hostPath."
  default     = "baseline"
  validation {
    condition     = contains(["baseline", "privileged"], var.pipeline_pod_security)
    error_message = "pipeline_pod_security is baseline or privileged."
  }
}

variable "fsx" {
  type = object({
    file_system_id = string
    dns_name       = string
    mount_name     = string
    capacity_gib   = number
  })
  description = "The FSx for Lustre filesystem exposed as the PersistentVolume + claim the training pods and Airflow workers mount."
}

variable "shared_fs_claim" {
  type        = string
  description = "Name of the PersistentVolumeClaim for FSx in the airflow and pipeline namespaces (the job spec's launcher.shared_fs_claim)."
  default     = "fsx-checkpoints"
}

variable "shared_fs_mount" {
  type        = string
  description = "Where the pods mount the FSx claim (the job spec's launcher.shared_fs_mount); the run root <mount>/llm-pipeline is made there for uid 50000."
  default     = "/fsx"
  validation {
    condition     = can(regex("^/[A-Za-z0-9._/-]+$", var.shared_fs_mount)) && !strcontains(var.shared_fs_mount, "..")
    error_message = "shared_fs_mount is an absolute path of letters, digits, '.', '_', '-' and '/' (it reaches a shell command)."
  }
}

variable "service_accounts" {
  type        = object({ airflow = string, spark = string, trainer = string, mlflow = string })
  description = "namespace:serviceaccount by plane, as the AWS layer's IRSA roles trust them."
}

variable "irsa_role_arns" {
  type        = map(string)
  description = "IRSA role ARN by plane (the spark and trainer accounts' eks.amazonaws.com/role-arn annotation)."
}

variable "triggerer_service_account" {
  type        = string
  description = "Service account of Airflow's triggerer in the airflow namespace (the chart's triggerer.serviceAccount.name), bound to the read-and-delete job-watcher Role."
  default     = "airflow-triggerer"
}
