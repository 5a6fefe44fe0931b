variable "name" {
  type        = string
  description = "Name prefix; buckets are named <name>-<purpose>-<account id>."
}

variable "checkpoint_ia_days" {
  type        = number
  description = "Days after which checkpoint objects move to S3 Standard-IA."
  default     = 30
}

variable "checkpoint_glacier_days" {
  type        = number
  description = "Days after which checkpoint objects move to Glacier Flexible Retrieval; null (the default): never. A Glacier object cannot be read without a restore, so L2 restore, FSx's lazy load from the bucket and evaluation of an older step would fail on it: set a number only for a bucket no run reads back."
  default     = null
}

variable "noncurrent_expiry_days" {
  type        = number
  description = "Days after which noncurrent (overwritten or deleted) object versions expire."
  default     = 30
}

variable "abort_multipart_days" {
  type        = number
  description = "Days after which incomplete multipart uploads are aborted (checkpoint uploads are multipart)."
  default     = 3
}

variable "task_log_days" {
  type        = number
  description = "Days after which Airflow's task logs (airflow-logs/ in the MLflow bucket, written by the platform layer's remote logging) expire; the bucket is versioned, so their bytes go noncurrent_expiry_days later."
  default     = 30
}

variable "force_destroy" {
  type        = bool
  description = "Let terraform destroy delete non-empty buckets (dev only)."
  default     = false
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}

variable "create_autoscaling_service_role" {
  type        = bool
  description = "Create EC2 Auto Scaling's service-linked role (AWSServiceRoleForAutoScaling), which the KMS key policy names for the node volumes: true only in an account that has never used Auto Scaling (it exists otherwise, and creating it fails)."
  default     = false
}

variable "fsx_s3_access_role_arns" {
  type        = list(string)
  description = "Service-linked roles of the FSx for Lustre file systems linked to these buckets (AWSServiceRoleForFSxS3Access_<fs-id>): the key policy lets them use the key for the SSE-KMS objects they import and export."
  default     = []
}
