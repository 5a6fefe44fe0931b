# EKS from plain resources rather than terraform-aws-modules/eks: every resource the cluster needs is
# visible here (and to checkov), with no transitive module versions to track; the GPU node group's EFA launch
# template and placement group are what the community module would need custom settings for anyway.
#
# Control plane: private endpoint (public only from var.endpoint_public_cidrs), secrets envelope-encrypted
# with the KMS key, all control-plane log types to an encrypted log group, API access entries, the IAM OIDC
# provider for IRSA. Nodes: a system group (Airflow, MLflow, Spark, add-ons) and a GPU group in one AZ, in a
# cluster placement group, with EFA interfaces, IMDSv2 only, encrypted volumes, tainted nvidia.com/gpu so only
# GPU pods land. EKS add-ons: VPC CNI (with NetworkPolicy enforcement), CoreDNS, kube-proxy, Pod Identity,
# FSx CSI. AWS API only: everything inside the cluster (namespaces, RBAC, Helm releases) is the platform
# root's (modules/stack_platform), applied once this cluster exists.

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

# No thumbprint_list (optional since AWS provider 5.81): IAM validates the EKS issuer's certificate against its
# own trusted CAs, so no tls provider and no thumbprint to rotate.
resource "aws_iam_openid_connect_provider" "this" {
  url            = aws_eks_cluster.this.identity[0].oidc[0].issuer
  client_id_list = ["sts.amazonaws.com"]
  tags           = var.tags
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
  labels     = local.gpu_labels
  tags       = var.tags
  depends_on = [aws_iam_role_policy_attachment.node]
  # the cluster autoscaler owns the group's size once it exists: an apply must not reset it to gpu_nodes.desired
  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }
}

# ---------------------------------------------------------------- scale from zero
# The GPU group sits at 0 nodes between runs; the cluster autoscaler (the platform root's helm_release, IRSA role
# cluster_autoscaler) adds nodes when a training pod is pending. It finds the group by the tags EKS puts on a managed
# node group's Auto Scaling group (k8s.io/cluster-autoscaler/enabled and k8s.io/cluster-autoscaler/<cluster>), and
# at zero nodes it has no node to copy: it builds a template node from the instance type (CPU, memory,
# nvidia.com/gpu) and from the group's labels and taints, which it reads with eks:DescribeNodegroup and, for
# what that does not carry, from these node-template tags on the ASG (EKS does not copy node-group labels or
# taints to the ASG). Without them a pending pod that selects llm-pipeline/pool=gpu and requests EFA is "never
# schedulable" on a group with no nodes, and the group never leaves zero.
locals {
  # nvidia.com/gpu.present: the label NVIDIA's device-plugin chart's default node affinity accepts (no NFD here);
  # without it the plugin never runs on these nodes and no nvidia.com/gpu is advertised.
  # k8s.amazonaws.com/accelerator: the cluster autoscaler's GPU label on AWS; a new node carrying it counts as
  # not ready until its device plugin advertises the GPUs, so one pending pod does not add a node per loop.
  gpu_labels = { "llm-pipeline/pool" = "gpu", "nvidia.com/gpu.present" = "true",
    "k8s.amazonaws.com/accelerator" = "nvidia",
  "vpc.amazonaws.com/efa.present" = tostring(var.gpu_efa_interfaces > 0) }
  gpu_node_template_tags = merge(
    { for k, v in local.gpu_labels : "k8s.io/cluster-autoscaler/node-template/label/${k}" => v },
    { "k8s.io/cluster-autoscaler/node-template/taint/nvidia.com/gpu" = "true:NoSchedule" },
    var.gpu_efa_interfaces > 0 ? {
      "k8s.io/cluster-autoscaler/node-template/resources/vpc.amazonaws.com/efa" = tostring(var.gpu_efa_interfaces)
    } : {},
  )
}

resource "aws_autoscaling_group_tag" "gpu_node_template" {
  for_each               = local.gpu_node_template_tags
  autoscaling_group_name = aws_eks_node_group.gpu.resources[0].autoscaling_groups[0].name
  tag {
    key                 = each.key
    value               = each.value
    propagate_at_launch = false
  }
}

# ---------------------------------------------------------------- who administers the cluster
# Access entries (authentication_mode API): each role in admin_role_arns is cluster-admin, besides the creator, whose
# entry EKS makes itself (bootstrap_cluster_creator_admin_permissions): a second one for the same role would fail.
data "aws_caller_identity" "current" {}

data "aws_iam_session_context" "current" {
  arn = data.aws_caller_identity.current.arn
}

locals {
  admin_role_arns = setsubtract(toset(var.admin_role_arns), [data.aws_iam_session_context.current.issuer_arn])
}

resource "aws_eks_access_entry" "admin" {
  for_each      = local.admin_role_arns
  cluster_name  = aws_eks_cluster.this.name
  principal_arn = each.value
  type          = "STANDARD"
  tags          = var.tags
}

resource "aws_eks_access_policy_association" "admin" {
  for_each      = local.admin_role_arns
  cluster_name  = aws_eks_cluster.this.name
  principal_arn = aws_eks_access_entry.admin[each.value].principal_arn
  policy_arn    = "arn:${data.aws_partition.current.partition}:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"
  access_scope {
    type = "cluster"
  }
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
