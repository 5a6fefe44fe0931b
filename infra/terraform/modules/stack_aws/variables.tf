variable "name" {
  type        = string
  description = "Name prefix of every resource in the environment (e.g. llmp-dev)."
}

variable "region" {
  type        = string
  description = "AWS region of the stack (an output: the platform root configures its providers with it)."
}

variable "azs" {
  type        = list(string)
  description = "Availability zones; the first hosts the GPU nodes and FSx."
}

variable "endpoint_public_cidrs" {
  type        = list(string)
  description = "CIDRs allowed to reach the EKS API's public endpoint (office/VPN); empty = private only."
  default     = []
}

variable "single_nat_gateway" {
  type        = bool
  description = "One NAT gateway for all AZs (dev) instead of one per AZ (prod)."
}

variable "force_destroy_buckets" {
  type        = bool
  description = "Let terraform destroy delete non-empty buckets (dev only)."
  default     = false
}

variable "fsx_capacity_gib" {
  type        = number
  description = "FSx for Lustre capacity (1200, 2400, or a multiple of 2400)."
}

variable "fsx_throughput_per_tib" {
  type        = number
  description = "FSx PERSISTENT_2 throughput, MB/s per TiB."
}

variable "system_nodes" {
  type        = object({ min = number, desired = number, max = number })
  description = "System node group size."
}

variable "gpu_instance_type" {
  type        = string
  description = "GPU node instance type."
}

variable "gpu_efa_interfaces" {
  type        = number
  description = "EFA interfaces per GPU node (32 on p5.48xlarge, 0 without EFA)."
}

variable "gpu_local_nvme_raid0" {
  type        = bool
  description = "RAID0 over the GPU nodes' instance-store NVMe under the kubelet: the node-local L0 checkpoint tier (p5, p4d and g6e have instance store)."
  default     = true
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

variable "gpu_nodes" {
  type        = object({ min = number, desired = number, max = number })
  description = "GPU node group size."
}

variable "db_instance_class" {
  type        = string
  description = "RDS instance class of the metadata database."
}

variable "db_multi_az" {
  type        = bool
  description = "Multi-AZ standby for the metadata database."
}

variable "db_deletion_protection" {
  type        = bool
  description = "Refuse to delete the metadata database."
}

variable "tags" {
  type        = map(string)
  description = "Tags on every resource."
  default     = {}
}

variable "create_autoscaling_service_role" {
  type        = bool
  description = "Create EC2 Auto Scaling's service-linked role, which the KMS key policy names: true only in an account that has never used Auto Scaling."
  default     = false
}

variable "kubernetes_version" {
  type        = string
  description = "EKS Kubernetes minor version (null: the eks module's default; its validation names the versions in standard support)."
  default     = null
}

variable "namespaces" {
  type        = object({ airflow = string, pipeline = string, mlflow = string })
  description = "Namespaces the platform root creates: Airflow, the training and Spark pods, the MLflow server. The IRSA roles trust service accounts in them."
  default     = { airflow = "airflow", pipeline = "llm-pipeline", mlflow = "mlflow" }
}

variable "admin_role_arns" {
  type        = list(string)
  description = "IAM roles given cluster-admin through EKS access entries (besides the cluster's creator)."
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
