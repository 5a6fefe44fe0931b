variable "name" {
  type        = string
  description = "Cluster name."
}

variable "kubernetes_version" {
  type        = string
  description = "EKS Kubernetes minor version: one in EKS standard support (14 months from its EKS release)."
  default     = "1.35"
  nullable    = false
  # EKS release -> end of standard support: 1.34 2025-10-02 -> 2026-12-02, 1.35 2026-01-27 -> 2027-03-27,
  # 1.36 2026-06-02 -> 2027-08-02 (standard support is 14 months from the EKS release; older versions are in
  # paid extended support).
  validation {
    condition     = contains(["1.34", "1.35", "1.36"], var.kubernetes_version)
    error_message = "kubernetes_version must be an EKS version in standard support: 1.34 (until 2026-12-02), 1.35 (until 2027-03-27) or 1.36 (until 2027-08-02)."
  }
}

variable "vpc_id" {
  type        = string
  description = "VPC of the cluster."
}

variable "vpc_cidr" {
  type        = string
  description = "VPC CIDR (the API endpoint and node-to-node traffic are allowed from it)."
}

variable "private_subnet_ids" {
  type        = list(string)
  description = "Private subnets for the control plane ENIs and the system nodes; GPU nodes use the first."
}

variable "endpoint_public_cidrs" {
  type        = list(string)
  description = "CIDRs that may reach the API server's public endpoint; empty = private endpoint only."
  default     = []
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key for envelope encryption of Kubernetes secrets and the control-plane log group."
}

variable "log_retention_days" {
  type        = number
  description = "Days to keep control-plane logs."
  default     = 365
}

variable "system_instance_types" {
  type        = list(string)
  description = "Instance types of the system node group (Airflow, MLflow, Spark driver/executors, add-ons)."
  default     = ["m6i.2xlarge"]
}

variable "system_nodes" {
  type        = object({ min = number, desired = number, max = number })
  description = "System node group size."
  default     = { min = 2, desired = 2, max = 6 }
}

variable "gpu_instance_type" {
  type        = string
  description = "GPU node instance type (p5.48xlarge: 8 × H100, 32 EFA; p4d.24xlarge: 8 × A100, 4 EFA)."
  default     = "p5.48xlarge"
}

variable "gpu_efa_interfaces" {
  type        = number
  description = "EFA network interfaces per GPU node (32 on p5.48xlarge, 4 on p4d.24xlarge, 0 = none)."
  default     = 32
}

variable "gpu_nodes" {
  type        = object({ min = number, desired = number, max = number })
  description = "GPU node group size (min 0 lets it scale to zero between runs)."
  default     = { min = 0, desired = 0, max = 8 }
}

variable "gpu_capacity_type" {
  type        = string
  description = "ON_DEMAND or CAPACITY_BLOCK (an EC2 Capacity Block reservation, gpu_capacity_reservation_id) for the GPU nodes."
  default     = "ON_DEMAND"
  validation {
    condition     = contains(["ON_DEMAND", "CAPACITY_BLOCK"], var.gpu_capacity_type)
    error_message = "gpu_capacity_type is ON_DEMAND or CAPACITY_BLOCK."
  }
}

variable "gpu_capacity_reservation_id" {
  type        = string
  description = "The Capacity Block reservation (cr-…) the GPU nodes launch into when gpu_capacity_type = CAPACITY_BLOCK."
  default     = null
  validation {
    condition     = var.gpu_capacity_type != "CAPACITY_BLOCK" || can(regex("^cr-[0-9a-f]+$", var.gpu_capacity_reservation_id))
    error_message = "gpu_capacity_type = CAPACITY_BLOCK needs gpu_capacity_reservation_id = \"cr-…\" (the Capacity Block's reservation)."
  }
}

variable "gpu_local_nvme_raid0" {
  type        = bool
  description = "Put the GPU nodes' instance-store NVMe in RAID0 under the kubelet (nodeadm localStorage), where the training pods' node-local L0 checkpoint tier lives. Off for instance types without instance store."
  default     = true
}

variable "gpu_volume_gib" {
  type        = number
  description = "Root volume of a GPU node (images, local NVMe is separate and holds the L0 tier)."
  default     = 500
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}

variable "admin_role_arns" {
  type        = list(string)
  description = "IAM roles (e.g. an SSO administrators' role) given cluster-admin through EKS access entries, so that the cluster is not administered by its creator alone."
  default     = []
  validation {
    condition     = alltrue([for a in var.admin_role_arns : can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:role/.+$", a))])
    error_message = "admin_role_arns takes IAM role ARNs (arn:aws:iam::<account>:role/<name>)."
  }
}
