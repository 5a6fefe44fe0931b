# What the cluster runs for the pipeline besides its own workloads, as Helm releases in state, each at an exact
# version: the NVIDIA and EFA device plugins on the GPU nodes, Kubeflow Trainer v2 (TrainJob, the launcher's
# default kind) with its torch-distributed runtime, and, with install_pytorchjob_operator, the v1
# training-operator (PyTorchJob, launcher.kind=pytorchjob), and the cluster autoscaler that takes the GPU node
# group from zero nodes to what a pending training job asks for and back. Upgraded by changing a version, removed
# by destroy.

locals {
  gpu_nodes = {
    nodeSelector = { "llm-pipeline/pool" = "gpu" }
    tolerations  = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
  }
}

resource "helm_release" "nvidia_device_plugin" {
  name       = "nvidia-device-plugin"
  repository = "https://nvidia.github.io/k8s-device-plugin"
  chart      = "nvidia-device-plugin"
  version    = "0.17.0"
  namespace  = "kube-system"
  values     = [yamlencode(local.gpu_nodes)]
}

resource "helm_release" "efa_device_plugin" {
  count      = var.gpu_efa_interfaces > 0 ? 1 : 0
  name       = "aws-efa-k8s-device-plugin"
  repository = "https://aws.github.io/eks-charts"
  chart      = "aws-efa-k8s-device-plugin"
  version    = "v0.5.6"
  namespace  = "kube-system"
  values     = [yamlencode(local.gpu_nodes)]
}

# Kubeflow Trainer v2 (TrainJob, trainer.kubeflow.org/v1alpha1; with JobSet, its dependency) from its pinned Helm
# chart, with the torch-distributed ClusterTrainingRuntime the launcher's TrainJobs reference (launcher.runtime).
# infra/k8s/crds holds the TrainJob CRD of this version, which the tests validate rendered jobs against.
resource "helm_release" "kubeflow_trainer" {
  name             = "kubeflow-trainer"
  repository       = "oci://ghcr.io/kubeflow/charts"
  chart            = "kubeflow-trainer"
  version          = var.trainer_chart_version
  namespace        = "kubeflow-system"
  create_namespace = true
  timeout          = 900
  values = [yamlencode({
    runtimes = { torchDistributed = { enabled = true } }
  })]
}

# Optional: the v1 training-operator for launcher.kind=pytorchjob (elastic min_nodes). Upstream ships kustomize
# manifests, not a chart, for v1: charts/training-operator is v1.8.1's (tag and commit in its Chart.yaml,
# provenance in its SOURCES.md), PyTorchJob only, installed as a Helm release from this repository: no kubectl,
# no download at apply, removed by destroy (its CRD stays, by Helm's rule for crds/).
resource "helm_release" "training_operator" {
  count            = var.install_pytorchjob_operator ? 1 : 0
  name             = "training-operator"
  chart            = "${path.module}/charts/training-operator"
  version          = "1.8.1"
  namespace        = "kubeflow"
  create_namespace = true
  timeout          = 600
  values = [yamlencode({
    image        = var.training_operator_image
    nodeSelector = { "llm-pipeline/pool" = "system" }
  })]
}

# ---------------------------------------------------------------- the cluster autoscaler
# cluster-autoscaler (kubernetes/autoscaler's chart), chosen over Karpenter: the node groups are EKS managed node
# groups with a placement group, EFA interfaces and Capacity Blocks in their launch template, which the autoscaler
# resizes as they are, where Karpenter would replace them with its own NodePools. It discovers the groups tagged
# k8s.io/cluster-autoscaler/<cluster> (EKS tags managed node groups' ASGs so), builds a node for a group at zero
# from the instance type and the node-template tags modules/eks puts on the GPU group's ASG, and runs as the IRSA
# role cluster_autoscaler (modules/iam: resize only this cluster's groups). Its minor version must be the
# cluster's (the autoscaler's rule): the image tag follows kubernetes_version.
locals {
  cluster_autoscaler_images = { "1.34" = "v1.34.5", "1.35" = "v1.35.2", "1.36" = "v1.36.1" }
  cluster_autoscaler_values = {
    cloudProvider = "aws"
    awsRegion     = var.autoscaling.region
    autoDiscovery = { clusterName = var.autoscaling.cluster_name }
    image         = { tag = local.cluster_autoscaler_images[var.kubernetes_version] }
    rbac = { serviceAccount = {
      create      = true
      name        = split(":", var.autoscaling.service_account)[1]
      annotations = { "eks.amazonaws.com/role-arn" = var.autoscaling.role_arn }
    } }
    nodeSelector = { "llm-pipeline/pool" = "system" }
    extraArgs = {
      # the group that wastes least of a new node; among GPU groups of one type, the balance flag spreads them
      expander                    = "least-waste"
      balance-similar-node-groups = true
      # an idle GPU node goes after 10 minutes; a node running a training pod (its emptyDir is the L0 tier) is
      # never drained to scale down while that pod runs (skip-nodes-with-local-storage stays true)
      scale-down-unneeded-time      = "10m"
      skip-nodes-with-local-storage = true
      # a p5 node with EFA and the NVIDIA driver takes minutes to register and to advertise its GPUs
      max-node-provision-time = "25m"
    }
  }
}

resource "helm_release" "cluster_autoscaler" {
  name       = "cluster-autoscaler"
  repository = "https://kubernetes.github.io/autoscaler"
  chart      = "cluster-autoscaler"
  version    = "9.59.0"
  namespace  = split(":", var.autoscaling.service_account)[0]
  values     = [yamlencode(local.cluster_autoscaler_values)]
  lifecycle {
    precondition {
      condition     = contains(keys(local.cluster_autoscaler_images), var.kubernetes_version)
      error_message = "No cluster-autoscaler image is pinned for Kubernetes ${var.kubernetes_version} (its minor must be the cluster's): add it to local.cluster_autoscaler_images."
    }
  }
}
