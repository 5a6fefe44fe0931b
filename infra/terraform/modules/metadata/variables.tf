variable "name" {
  type        = string
  description = "Name prefix."
}

variable "vpc_id" {
  type        = string
  description = "VPC of the cluster."
}

variable "private_subnet_ids" {
  type        = list(string)
  description = "Private subnets for the DB subnet group (two AZs or more)."
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key for storage, Performance Insights and the master-password secret."
}

variable "instance_class" {
  type        = string
  description = "RDS instance class."
  default     = "db.t4g.medium"
}

variable "allocated_storage_gib" {
  type        = number
  description = "Initial storage (autoscaling up to 5×)."
  default     = 50
}

variable "multi_az" {
  type        = bool
  description = "Standby in a second AZ (prod)."
  default     = true
}

variable "deletion_protection" {
  type        = bool
  description = "Refuse to delete the database (turn off only to tear down dev)."
  default     = true
}

variable "backup_retention_days" {
  type        = number
  description = "Automated backup retention."
  default     = 14
}

variable "mlflow_bucket" {
  type        = string
  description = "Bucket of MLflow's artifact store."
}

variable "irsa_role_arns" {
  type        = map(string)
  description = "IRSA role by plane (airflow, mlflow) from the iam module."
}

variable "mlflow_image" {
  type        = string
  description = "MLflow server image, by digest: the client's MLflow (3.17.2) with psycopg2 and boto3 (infra/docker/mlflow.Dockerfile; push it and take the digest docker prints)."
  validation {
    condition     = can(regex("^[^@\\s]+@sha256:[0-9a-f]{64}$", var.mlflow_image))
    error_message = "mlflow_image must be pinned by digest: REPOSITORY@sha256:<64 hex digits>."
  }
}

variable "credentials_generation" {
  type        = number
  description = "Bump to rotate the applications' database passwords and the MLflow and Airflow admin passwords (the Secrets and the pods that read them follow)."
  default     = 1
}

variable "private_subnet_cidrs" {
  type        = list(string)
  description = "CIDR blocks of the private subnets: the only sources RDS admits."
}

variable "pipeline_namespace" {
  type        = string
  description = "Namespace of the training and Spark pods (they get the MLflow client login)."
}

variable "airflow_chart_version" {
  type        = string
  description = "apache-airflow Helm chart version: 1.22.0, the newest release, whose values fit Airflow 3 (apiServer, createUserJob.defaultUser, apiSecretKey/jwtSecret)."
  default     = "1.22.0"
}

variable "airflow_version" {
  type        = string
  description = "The Airflow version in airflow_image (the chart's airflowVersion: it picks the components and config for it)."
  default     = "3.3.2"
  validation {
    condition     = can(regex("^3\\.[0-9]+\\.[0-9]+$", var.airflow_version))
    error_message = "airflow_version is the image's Airflow 3 release, x.y.z."
  }
}

variable "airflow_image" {
  type = object({
    repository = string
    tag        = string
  })
  description = "Airflow image with this project installed (pip install . plus its providers): the DAG and stages run from it."
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}

variable "pipeline_env" {
  type        = map(string)
  description = "Environment of the Airflow pods that points the job spec at this stack (SPARK_MASTER, S3_ENDPOINT_URL, S3_BUCKET, MLFLOW_TRACKING_URI, LLMP_HOME): config only, no code change."
  default     = {}
}

variable "airflow_namespace" {
  type        = string
  description = "Namespace for the Airflow release (created by the eks module, with the FSx claim)."
}

variable "shared_fs_claim" {
  type        = string
  description = "FSx PersistentVolumeClaim in the Airflow namespace."
}

variable "shared_fs_mount" {
  type        = string
  description = "Where the workers mount FSx: the job spec's launcher.shared_fs_mount."
  default     = "/fsx"
}
