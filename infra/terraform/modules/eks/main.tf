# EKS from plain resources rather than terraform-aws-modules/eks: every resource the cluster needs is
# visible here (and to checkov) in ~300 lines, with no transitive module versions to track; the GPU node
# group's EFA launch template and placement group are what the community module would need custom
# settings for anyway.
#
# Control plane: private endpoint (public only from var.endpoint_public_cidrs), secrets envelope-encrypted
# with the KMS key, all control-plane log types to an encrypted log group, API access entries.
# Nodes: a system group (Airflow, MLflow, Spark, add-ons) and a GPU group in one AZ, in a cluster placement
# group, with EFA interfaces, IMDSv2 only, encrypted volumes, tainted nvidia.com/gpu so only GPU pods land.
# In the cluster: VPC CNI / CoreDNS / kube-proxy / Pod Identity / FSx CSI add-ons, the NVIDIA and EFA
# device plugins (Helm), the Kubeflow training operator (PyTorchJob v1), FSx as PV + claim, and the
# pipeline namespace with the RBAC Spark on Kubernetes needs (driver creates executor pods).

data "aws_partition" "current" {}

locals {
  gpu_subnet = var.private_subnet_ids[0]
  log_types  = ["api", "audit", "authenticator", "controllerManager", "scheduler"]
  # The L0 checkpoint tier is each GPU node's own NVMe. nodeadm (AL2023) assembles the instance-store volumes
  # into RAID0, mounts it at /mnt/k8s-disks/0 and moves the kubelet and containerd there, so a training pod's
  # emptyDir (launcher.node_local_path unset) or a hostPath below /mnt/k8s-disks/0 is on local NVMe. EKS merges
  # this NodeConfig with the one it generates for the managed node group.
  gpu_user_data = <<-EOT
    MIME-Version: 1.0
    Content-Type: multipart/mixed; boundary="LLMP"

    --LLMP
    Content-Type: application/node.eks.aws

    apiVersion: node.eks.aws/v1alpha1
    kind: NodeConfig
    spec:
      instance:
        localStorage:
          strategy: RAID0

    --LLMP--
  EOT
}

# ---------------------------------------------------------------- control plane
data "aws_iam_policy_document" "cluster_assume" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]
    principals {
      type        = "Service"
      identifiers = ["eks.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "cluster" {
  name               = "${var.name}-cluster"
  assume_role_policy = data.aws_iam_policy_document.cluster_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "cluster" {
  role       = aws_iam_role.cluster.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonEKSClusterPolicy"
}

resource "aws_cloudwatch_log_group" "cluster" {
  name              = "/aws/eks/${var.name}/cluster"
  retention_in_days = var.log_retention_days
  kms_key_id        = var.kms_key_arn
  tags              = var.tags
}

resource "aws_security_group" "cluster" {
  name        = "${var.name}-cluster"
  description = "EKS control plane: HTTPS from inside the VPC"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${var.name}-cluster" })
}

resource "aws_vpc_security_group_ingress_rule" "cluster_https" {
  security_group_id = aws_security_group.cluster.id
  description       = "Kubernetes API from nodes and Airflow workers in the VPC"
  cidr_ipv4         = var.vpc_cidr
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  tags              = var.tags
}

resource "aws_eks_cluster" "this" {
  name     = var.name
  version  = var.kubernetes_version
  role_arn = aws_iam_role.cluster.arn

  vpc_config {
    subnet_ids              = var.private_subnet_ids
    security_group_ids      = [aws_security_group.cluster.id]
    endpoint_private_access = true
    endpoint_public_access  = length(var.endpoint_public_cidrs) > 0
    public_access_cidrs     = length(var.endpoint_public_cidrs) > 0 ? var.endpoint_public_cidrs : null
  }

  encryption_config {
    resources = ["secrets"]
    provider {
      key_arn = var.kms_key_arn
    }
  }

  access_config {
    authentication_mode                         = "API"
    bootstrap_cluster_creator_admin_permissions = true
  }

  enabled_cluster_log_types = local.log_types
  tags                      = var.tags

  depends_on = [aws_iam_role_policy_attachment.cluster, aws_cloudwatch_log_group.cluster]
}

data "tls_certificate" "oidc" {
  url = aws_eks_cluster.this.identity[0].oidc[0].issuer
}

resource "aws_iam_openid_connect_provider" "this" {
  url             = aws_eks_cluster.this.identity[0].oidc[0].issuer
  client_id_list  = ["sts.amazonaws.com"]
  thumbprint_list = [data.tls_certificate.oidc.certificates[0].sha1_fingerprint]
  tags            = var.tags
}

# ---------------------------------------------------------------- nodes
data "aws_iam_policy_document" "node_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name               = "${var.name}-node"
  assume_role_policy = data.aws_iam_policy_document.node_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset(["AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryReadOnly",
  "AmazonSSMManagedInstanceCore"])
  role       = aws_iam_role.node.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/${each.value}"
}

resource "aws_security_group" "efa" {
  name        = "${var.name}-gpu-efa"
  description = "EFA requires all traffic to and from the same security group"
  vpc_id      = var.vpc_id
  tags        = merge(var.tags, { Name = "${var.name}-gpu-efa" })
}

resource "aws_vpc_security_group_ingress_rule" "efa_self" {
  security_group_id            = aws_security_group.efa.id
  description                  = "EFA / NCCL between GPU nodes"
  referenced_security_group_id = aws_security_group.efa.id
  ip_protocol                  = "-1"
  tags                         = var.tags
}

resource "aws_vpc_security_group_egress_rule" "efa_self" {
  security_group_id            = aws_security_group.efa.id
  description                  = "EFA / NCCL between GPU nodes"
  referenced_security_group_id = aws_security_group.efa.id
  ip_protocol                  = "-1"
  tags                         = var.tags
}

resource "aws_placement_group" "gpu" {
  name     = "${var.name}-gpu"
  strategy = "cluster"
  tags     = var.tags
}

resource "aws_launch_template" "system" {
  name_prefix = "${var.name}-system-"
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }
  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size = 100
      volume_type = "gp3"
      encrypted   = true
      kms_key_id  = var.kms_key_arn
    }
  }
  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "${var.name}-system" })
  }
  tags = var.tags
}

resource "aws_launch_template" "gpu" {
  name_prefix = "${var.name}-gpu-"
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }
  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size = var.gpu_volume_gib
      volume_type = "gp3"
      encrypted   = true
      kms_key_id  = var.kms_key_arn
    }
  }
  placement {
    group_name = aws_placement_group.gpu.name
  }
  # gpu_capacity_type = CAPACITY_BLOCK: the nodes launch into the EC2 Capacity Block reservation
  dynamic "instance_market_options" {
    for_each = var.gpu_capacity_type == "CAPACITY_BLOCK" ? [1] : []
    content {
      market_type = "capacity-block"
    }
  }
  dynamic "capacity_reservation_specification" {
    for_each = var.gpu_capacity_type == "CAPACITY_BLOCK" ? [1] : []
    content {
      capacity_reservation_target {
        capacity_reservation_id = var.gpu_capacity_reservation_id
      }
    }
  }
  user_data = var.gpu_local_nvme_raid0 ? base64encode(local.gpu_user_data) : null
  # p5.48xlarge: 32 EFA interfaces over the network cards; the first is also the primary ENI. No subnet here:
  # a managed node group takes its subnets from the node group, and fails when the launch template names one.
  dynamic "network_interfaces" {
    for_each = range(var.gpu_efa_interfaces)
    content {
      device_index          = network_interfaces.value == 0 ? 0 : 1
      network_card_index    = network_interfaces.value
      interface_type        = "efa"
      security_groups       = [aws_security_group.efa.id, aws_eks_cluster.this.vpc_config[0].cluster_security_group_id]
      delete_on_termination = true
    }
  }
  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "${var.name}-gpu" })
  }
  tags = var.tags
}

resource "aws_eks_node_group" "system" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "system"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.private_subnet_ids
  instance_types  = var.system_instance_types
  ami_type        = "AL2023_x86_64_STANDARD"
  scaling_config {
    min_size     = var.system_nodes.min
    desired_size = var.system_nodes.desired
    max_size     = var.system_nodes.max
  }
  launch_template {
    id      = aws_launch_template.system.id
    version = aws_launch_template.system.latest_version
  }
  labels     = { "llm-pipeline/pool" = "system" }
  tags       = var.tags
  depends_on = [aws_iam_role_policy_attachment.node]
}

resource "aws_eks_node_group" "gpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "gpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = [local.gpu_subnet]
  instance_types  = [var.gpu_instance_type]
  ami_type        = "AL2023_x86_64_NVIDIA"
  capacity_type   = var.gpu_capacity_type
  scaling_config {
    min_size     = var.gpu_nodes.min
    desired_size = var.gpu_nodes.desired
    max_size     = var.gpu_nodes.max
  }
  launch_template {
    id      = aws_launch_template.gpu.id
    version = aws_launch_template.gpu.latest_version
  }
  taint {
    key    = "nvidia.com/gpu"
    value  = "true"
    effect = "NO_SCHEDULE"
  }
  labels     = { "llm-pipeline/pool" = "gpu", "vpc.amazonaws.com/efa.present" = tostring(var.gpu_efa_interfaces > 0) }
  tags       = var.tags
  depends_on = [aws_iam_role_policy_attachment.node]
}

# ---------------------------------------------------------------- add-ons
resource "aws_eks_addon" "this" {
  for_each                    = toset(["vpc-cni", "coredns", "kube-proxy", "eks-pod-identity-agent", "aws-fsx-csi-driver"])
  cluster_name                = aws_eks_cluster.this.name
  addon_name                  = each.value
  resolve_conflicts_on_update = "OVERWRITE"
  # the VPC CNI enforces NetworkPolicies (the default-deny policies of the pipeline's namespaces)
  configuration_values = each.value == "vpc-cni" ? jsonencode({ enableNetworkPolicy = "true" }) : null
  tags                 = var.tags
  depends_on           = [aws_eks_node_group.system]
}

resource "helm_release" "nvidia_device_plugin" {
  name       = "nvidia-device-plugin"
  repository = "https://nvidia.github.io/k8s-device-plugin"
  chart      = "nvidia-device-plugin"
  version    = "0.17.0"
  namespace  = "kube-system"
  values = [yamlencode({
    nodeSelector = { "llm-pipeline/pool" = "gpu" }
    tolerations  = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
  })]
  depends_on = [aws_eks_node_group.system]
}

resource "helm_release" "efa_device_plugin" {
  count      = var.gpu_efa_interfaces > 0 ? 1 : 0
  name       = "aws-efa-k8s-device-plugin"
  repository = "https://aws.github.io/eks-charts"
  chart      = "aws-efa-k8s-device-plugin"
  version    = "v0.5.6"
  namespace  = "kube-system"
  values = [yamlencode({
    nodeSelector = { "llm-pipeline/pool" = "gpu" }
    tolerations  = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
  })]
  depends_on = [aws_eks_node_group.system]
}

# Kubeflow Trainer v2 (TrainJob, trainer.kubeflow.org/v1alpha1; with JobSet, its dependency) from its pinned Helm
# chart, with the torch-distributed ClusterTrainingRuntime the launcher's TrainJobs reference (launcher.runtime).
# In state: upgraded by changing trainer_chart_version, removed by destroy. infra/k8s/crds holds the TrainJob CRD
# of this version, which the tests validate rendered jobs against.
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
  depends_on = [aws_eks_node_group.system]
}

# Optional (install_pytorchjob_operator): the v1 training operator for launcher.kind=pytorchjob (elastic jobs). It
# ships kustomize manifests, not a Helm chart: its standalone overlay (CRDs incl. kubeflow.org/v1 PyTorchJob +
# controller) is applied at a commit once the cluster exists. Not in state (destroy does not remove it); needs
# kubectl, the AWS CLI and GitHub where terraform runs.
resource "terraform_data" "training_operator" {
  count            = var.install_pytorchjob_operator ? 1 : 0
  triggers_replace = [aws_eks_cluster.this.arn, var.training_operator_commit]
  provisioner "local-exec" {
    command = <<-EOT
      aws eks update-kubeconfig --name ${aws_eks_cluster.this.name} --kubeconfig "$KCFG" >/dev/null
      kubectl --kubeconfig "$KCFG" apply --server-side -k \
        "github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=${var.training_operator_commit}"
    EOT
    environment = {
      KCFG = "${path.root}/.kubeconfig-${var.name}"
    }
  }
  depends_on = [aws_eks_node_group.system]
}

# ---------------------------------------------------------------- pipeline namespace, FSx volume, RBAC
# Pod Security admission. pipeline: baseline, not restricted: the training image (NCCL, EFA) and Spark's
# executors run as their images' users without a seccomp profile of our setting; baseline still refuses
# privileged pods, host namespaces and hostPath. `privileged` (var.pipeline_pod_security) is needed only for
# hostPath scratch (launcher.node_local_path, services.spark_local_dir); the default emptyDir on the instance
# store's RAID0 is not a hostPath. airflow: baseline, because the chart's pods set no seccomp profile.
locals {
  pod_security = {
    pipeline = var.pipeline_pod_security
    airflow  = "baseline"
  }
  namespace_labels = { for ns, level in local.pod_security : ns => {
    "app.kubernetes.io/part-of"          = "llm-pipeline"
    "pod-security.kubernetes.io/enforce" = level
    "pod-security.kubernetes.io/warn"    = "restricted"
    "pod-security.kubernetes.io/audit"   = "restricted"
  } }
}

resource "kubernetes_namespace_v1" "pipeline" {
  metadata {
    name   = var.pipeline_namespace
    labels = local.namespace_labels.pipeline
  }
  depends_on = [aws_eks_node_group.system]
}

resource "kubernetes_namespace_v1" "airflow" {
  metadata {
    name   = var.airflow_namespace
    labels = local.namespace_labels.airflow
  }
  depends_on = [aws_eks_node_group.system]
}

# The same filesystem in both namespaces (a claim binds one volume, so one PV per namespace): the training
# pods and the Airflow workers see run.root and the checkpoints at the same path (launcher.shared_fs_mount).
locals {
  fsx_namespaces = {
    pipeline = kubernetes_namespace_v1.pipeline.metadata[0].name
    airflow  = kubernetes_namespace_v1.airflow.metadata[0].name
  }
}

resource "kubernetes_persistent_volume_v1" "fsx" {
  for_each = local.fsx_namespaces
  metadata {
    name = "${var.name}-fsx-${each.key}"
  }
  spec {
    capacity                         = { storage = "${var.fsx.capacity_gib}Gi" }
    access_modes                     = ["ReadWriteMany"]
    persistent_volume_reclaim_policy = "Retain"
    storage_class_name               = ""
    mount_options                    = ["flock"]
    persistent_volume_source {
      csi {
        driver        = "fsx.csi.aws.com"
        volume_handle = var.fsx.file_system_id
        volume_attributes = {
          dnsname   = var.fsx.dns_name
          mountname = var.fsx.mount_name
        }
      }
    }
  }
  depends_on = [aws_eks_addon.this]
}

resource "kubernetes_persistent_volume_claim_v1" "fsx" {
  for_each = local.fsx_namespaces
  metadata {
    name      = var.shared_fs_claim
    namespace = each.value
  }
  spec {
    access_modes       = ["ReadWriteMany"]
    storage_class_name = ""
    volume_name        = kubernetes_persistent_volume_v1.fsx[each.key].metadata[0].name
    resources {
      requests = { storage = "${var.fsx.capacity_gib}Gi" }
    }
  }
}

# Spark on Kubernetes: the driver (service account "spark") creates and watches its executor pods.
resource "kubernetes_role_v1" "spark_driver" {
  metadata {
    name      = "spark-driver"
    namespace = kubernetes_namespace_v1.pipeline.metadata[0].name
  }
  rule {
    api_groups = [""]
    resources  = ["pods", "services", "configmaps", "persistentvolumeclaims"]
    verbs      = ["create", "get", "list", "watch", "delete", "deletecollection", "patch"]
  }
}

# Airflow's workers submit training jobs (TrainJobs, or v1 PyTorchJobs) and Spark drivers into the pipeline
# namespace and read pod logs; the triggerer watches deferred jobs, reads their pods' logs and deletes a job whose
# task a user stopped (bound to both in modules/iam).
resource "kubernetes_role_v1" "launcher" {
  metadata {
    name      = "pipeline-launcher"
    namespace = kubernetes_namespace_v1.pipeline.metadata[0].name
  }
  rule {
    api_groups = ["trainer.kubeflow.org"]
    resources  = ["trainjobs"]
    verbs      = ["create", "get", "list", "watch", "delete"]
  }
  rule {
    api_groups = ["kubeflow.org"]
    resources  = ["pytorchjobs"]
    verbs      = ["create", "get", "list", "watch", "delete"]
  }
  rule {
    api_groups = [""]
    resources  = ["pods", "pods/log", "services", "configmaps"]
    verbs      = ["create", "get", "list", "watch", "delete", "deletecollection"]
  }
}
