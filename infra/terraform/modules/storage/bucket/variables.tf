variable "bucket" {
  type        = string
  description = "Bucket name."
}

variable "purpose" {
  type        = string
  description = "raw, curated, checkpoints or mlflow (tag, and the access-log prefix)."
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key for SSE-KMS."
}

variable "log_bucket" {
  type        = string
  description = "Bucket receiving this bucket's server access logs."
}

variable "noncurrent_days" {
  type        = number
  description = "Days after which noncurrent object versions expire."
}

variable "abort_multipart_days" {
  type        = number
  description = "Days after which incomplete multipart uploads are aborted."
}

variable "ia_days" {
  type        = number
  description = "Days to Standard-IA (null = no transition)."
  default     = null
}

variable "glacier_days" {
  type        = number
  description = "Days to Glacier Flexible Retrieval (null = no transition)."
  default     = null
}

variable "expire_prefixes" {
  type        = map(number)
  description = "Key prefix (ending in /) → days after which its objects expire."
  default     = {}
}

variable "force_destroy" {
  type        = bool
  description = "Let terraform destroy delete a non-empty bucket."
  default     = false
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of the bucket."
  default     = {}
}
