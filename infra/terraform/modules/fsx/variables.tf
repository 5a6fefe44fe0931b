variable "name" {
  type        = string
  description = "Name prefix."
}

variable "vpc_id" {
  type        = string
  description = "VPC of the cluster."
}

variable "vpc_cidr" {
  type        = string
  description = "CIDR allowed to mount the filesystem (Lustre ports 988, 1018-1023)."
}

variable "subnet_id" {
  type        = string
  description = "Private subnet for the filesystem: the GPU nodes' AZ."
}

variable "storage_capacity_gib" {
  type        = number
  description = "Capacity in GiB: 1200, 2400, or a multiple of 2400."
  default     = 1200
}

variable "throughput_per_tib" {
  type        = number
  description = "PERSISTENT_2 throughput, MB/s per TiB: 125, 250, 500 or 1000."
  default     = 250
  validation {
    condition     = contains([125, 250, 500, 1000], var.throughput_per_tib)
    error_message = "throughput_per_tib must be 125, 250, 500 or 1000 for PERSISTENT_2."
  }
}

variable "checkpoint_bucket" {
  type        = string
  description = "S3 bucket linked by the data repository association (auto import and export)."
}

variable "repository_path" {
  type        = string
  description = "Filesystem path linked to the checkpoint bucket: the trainer's L1 tier (checkpoint.l1 is <mount><path>, /fsx/llm-pipeline/var/tiers/shared by pipelines.cluster_config)."
  default     = "/llm-pipeline/var/tiers/shared"
  validation {
    condition     = startswith(var.repository_path, "/") && !strcontains(var.repository_path, "..")
    error_message = "repository_path is an absolute path on the file system."
  }
}

variable "repository_prefix" {
  type        = string
  description = "Prefix of the checkpoint bucket the L1 tier is exported to (apart from the trainer's own L2 uploads under checkpoints/)."
  default     = "fsx-l1"
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key encrypting the filesystem at rest."
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}
