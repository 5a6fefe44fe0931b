variable "name" {
  type        = string
  description = "Name prefix for the roles."
}

variable "cluster_name" {
  type        = string
  description = "EKS cluster name: the cluster autoscaler may resize only Auto Scaling groups tagged k8s.io/cluster-autoscaler/<this> = owned."
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
    airflow            = string
    spark              = string
    trainer            = string
    mlflow             = string
    airflow_logs       = string
    cluster_autoscaler = string
  })
  description = "namespace:serviceaccount each role may be assumed from (the platform root creates these accounts, or the Airflow chart does)."
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}
