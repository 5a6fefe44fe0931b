variable "name" {
  type        = string
  description = "Name prefix."
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key of the applications' login secrets in Secrets Manager (the stack's key)."
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
  description = "MLflow server image, by digest: the pipeline image (make image; the CPU flavour will do), which runs `python -m pipelines.eval.tracking_server` with the same MLflow as the client, psycopg and boto3."
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

variable "shared_fs_claim" {
  type        = string
  description = "FSx PersistentVolumeClaim in the Airflow namespace (modules/namespaces)."
}

variable "shared_fs_mount" {
  type        = string
  description = "Where the workers mount FSx: the job spec's launcher.shared_fs_mount."
  default     = "/fsx"
}

variable "db" {
  type        = object({ address = string, port = number, master_secret_arn = string })
  description = "The AWS layer's RDS instance: host, port, and the Secrets Manager secret of its RDS-managed master login."
}

variable "namespaces" {
  type        = object({ airflow = string, pipeline = string, mlflow = string })
  description = "The namespaces (modules/namespaces): the Airflow release, the training pods (they get the MLflow client login), the MLflow server."
}

variable "airflow_image" {
  type        = string
  description = "Airflow image with this project installed (`make image`), REPOSITORY:TAG or REPOSITORY@sha256:DIGEST: the DAG and stages run from it."
}

variable "worker_service_account" {
  type        = string
  description = "Service account of the Airflow workers (the name the airflow IRSA role trusts)."
  default     = "airflow-worker"
}

variable "triggerer_service_account" {
  type        = string
  description = "Service account of the Airflow triggerer (bound to the job-watcher Role in modules/namespaces)."
  default     = "airflow-triggerer"
}
