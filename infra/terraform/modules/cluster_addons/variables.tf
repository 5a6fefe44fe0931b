variable "autoscaling" {
  type = object({
    cluster_name    = string
    region          = string
    role_arn        = string
    service_account = string
  })
  description = "The AWS layer's `autoscaling` output: the cluster whose node groups the cluster autoscaler discovers, its region, and the IRSA role and namespace:serviceaccount it runs as."
}

variable "kubernetes_version" {
  type        = string
  description = "The cluster's Kubernetes minor version (the AWS layer's output): the cluster autoscaler's image follows it."
}

variable "gpu_efa_interfaces" {
  type        = number
  description = "EFA interfaces per GPU node: the EFA device plugin is installed when there are any."
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
  description = "Also install the v1 training-operator v1.8.1 (PyTorchJob, for launcher.kind=pytorchjob and elastic min_nodes) from charts/training-operator."
  default     = false
}

variable "training_operator_image" {
  type        = string
  description = "Image of the v1 training-operator: v1.8.1's own (its standalone overlay's tag), or a mirror of it, by tag or digest."
  default     = "kubeflow/training-operator:v1-04f9f13"
}
