# What the cluster runs for the pipeline besides its own workloads, as Helm releases in state, each at an exact
# version: the NVIDIA and EFA device plugins on the GPU nodes, Kubeflow Trainer v2 (TrainJob, the launcher's
# default kind) with its torch-distributed runtime, and, with install_pytorchjob_operator, the v1
# training-operator (PyTorchJob, launcher.kind=pytorchjob). Upgraded by changing a version, removed by destroy.

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
