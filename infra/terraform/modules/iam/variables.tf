variable "name" {
  type        = string
  description = "Name prefix for the roles."
}

variable "oidc_provider_arn" {
  type        = string
  description = "ARN of the EKS cluster's IAM OIDC provider (IRSA)."
}

variable "oidc_issuer" {
  type        = string
  description = "The cluster's OIDC issuer URL without https:// (condition key prefix)."
}

variable "bucket_arns" {
  type        = map(string)
  description = "Bucket ARN by purpose (raw, curated, checkpoints, mlflow) from the storage module."
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key of the buckets (roles get Decrypt/GenerateDataKey on it, nothing else)."
}

variable "service_accounts" {
  type = object({
    airflow = string
    spark   = string
    trainer = string
    mlflow  = string
  })
  description = "namespace:serviceaccount each role may be assumed from."
  default = {
    airflow = "airflow:airflow-worker"
    spark   = "llm-pipeline:spark"
    trainer = "llm-pipeline:trainer"
    mlflow  = "mlflow:mlflow"
  }
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}

variable "launcher_role_name" {
  type        = string
  description = "Role in the pipeline namespace that lets Airflow submit PyTorchJobs and Spark drivers (eks module)."
}

variable "spark_role_name" {
  type        = string
  description = "Role in the pipeline namespace the Spark driver needs (eks module)."
}

variable "triggerer_service_account" {
  type        = string
  description = "namespace:serviceaccount of Airflow's triggerer (the chart's triggerer.serviceAccount), bound to the launcher Role: deferred training jobs are watched from there."
  default     = "airflow:airflow-triggerer"
}
