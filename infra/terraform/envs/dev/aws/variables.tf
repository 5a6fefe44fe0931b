variable "region" {
  type        = string
  description = "AWS region."
}

variable "azs" {
  type        = list(string)
  description = "Availability zones (the first hosts the GPU nodes and FSx)."
}

variable "endpoint_public_cidrs" {
  type        = list(string)
  description = "CIDRs allowed to reach the EKS API's public endpoint (your office/VPN); empty = private only."
  default     = []
}

variable "tags" {
  type        = map(string)
  description = "Tags on every resource (also the AWS provider's default tags)."
}

variable "gpu_capacity_type" {
  type        = string
  description = "ON_DEMAND or CAPACITY_BLOCK (an EC2 Capacity Block reservation) for the GPU nodes."
  default     = "ON_DEMAND"
}

variable "gpu_capacity_reservation_id" {
  type        = string
  description = "The Capacity Block reservation (cr-…) for gpu_capacity_type = CAPACITY_BLOCK."
  default     = null
}

variable "create_autoscaling_service_role" {
  type        = bool
  description = "Create EC2 Auto Scaling's service-linked role, which the KMS key policy names: true only in an account that has never used Auto Scaling."
  default     = false
}

variable "kubernetes_version" {
  type        = string
  description = "EKS Kubernetes minor version (null: modules/eks's default, in standard support; its validation names the allowed set)."
  default     = null
}

variable "gpu_efa_interfaces" {
  type        = number
  description = "EFA interfaces per GPU node (32 on p5.48xlarge). 0 (the default): none requested, since the pipeline image carries no libfabric and no aws-ofi-nccl plugin, without which NCCL ignores EFA and falls back to TCP sockets; set 32 with a trainer image that has both (docs/cluster.md)."
  default     = 0
  validation {
    condition     = var.gpu_efa_interfaces >= 0
    error_message = "gpu_efa_interfaces is a count: 0 or more."
  }
}

variable "admin_role_arns" {
  type        = list(string)
  description = "IAM roles given cluster-admin through EKS access entries (e.g. your administrators' SSO role), so that not only the identity that ran terraform apply can administer the cluster."
  default     = []
}

variable "retention" {
  type = object({
    checkpoint_ia_days      = optional(number, 30)
    checkpoint_glacier_days = optional(number)
    noncurrent_expiry_days  = optional(number, 30)
    task_log_days           = optional(number, 30)
  })
  description = "How long the buckets keep what: checkpoints move to Standard-IA after checkpoint_ia_days and to Glacier after checkpoint_glacier_days (null: never; a Glacier object cannot be read back without a restore); noncurrent versions expire after noncurrent_expiry_days; Airflow's task logs (airflow-logs/ in the MLflow bucket) after task_log_days."
  default     = {}
}
