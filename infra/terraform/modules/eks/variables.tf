variable "name" {
  type        = string
  description = "Cluster name."
}

variable "kubernetes_version" {
  type        = string
  description = "EKS Kubernetes version."
  default     = "1.31"
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

variable "trainer_chart_version" {
  type        = string
  description = "Kubeflow Trainer v2 Helm chart version (oci://ghcr.io/kubeflow/charts/kubeflow-trainer): TrainJobs. infra/k8s/crds holds its TrainJob CRD."
  default     = "2.3.0"
  validation {
    condition     = can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+$", var.trainer_chart_version))
    error_message = "trainer_chart_version is an exact chart version (x.y.z), not a range."
  }
}

variable "install_pytorchjob_operator" {
  type        = bool
  description = "Also apply the v1 training operator (PyTorchJob, for launcher.kind=pytorchjob and elastic min_nodes), at training_operator_commit."
  default     = false
}

variable "training_operator_commit" {
  type        = string
  description = "Commit of kubeflow/training-operator whose standalone manifests are applied (PyTorchJob v1): an immutable ref, not a tag or branch. 0f8735fa… is the commit of tag v1.8.1."
  default     = "0f8735faade3651dfe44e45c6fbc30fa9152641d"
  validation {
    condition     = can(regex("^[0-9a-f]{40}$", var.training_operator_commit))
    error_message = "training_operator_commit is a full 40-hex-digit commit id."
  }
}

variable "pipeline_pod_security" {
  type        = string
  description = "Pod Security level enforced in the pipeline namespace: baseline, or privileged only when launcher.node_local_path / services.spark_local_dir use hostPath."
  default     = "baseline"
  validation {
    condition     = contains(["baseline", "privileged"], var.pipeline_pod_security)
    error_message = "pipeline_pod_security is baseline or privileged."
  }
}

variable "fsx" {
  type = object({
    file_system_id = string
    dns_name       = string
    mount_name     = string
    capacity_gib   = number
  })
  description = "The FSx for Lustre filesystem exposed as the PersistentVolume + claim the training pods mount."
}

variable "pipeline_namespace" {
  type        = string
  description = "Namespace of the training and Spark pods (the job spec's launcher.namespace)."
  default     = "llm-pipeline"
}

variable "airflow_namespace" {
  type        = string
  description = "Namespace of the Airflow release (its workers mount FSx too)."
  default     = "airflow"
}

variable "shared_fs_claim" {
  type        = string
  description = "Name of the PersistentVolumeClaim for FSx (the job spec's launcher.shared_fs_claim)."
  default     = "fsx-checkpoints"
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}
