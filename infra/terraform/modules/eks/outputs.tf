output "cluster_name" {
  description = "EKS cluster name (the platform root finds the cluster by it: aws_eks_cluster, aws eks get-token)."
  value       = aws_eks_cluster.this.name
}

output "cluster_endpoint" {
  description = "Kubernetes API server URL (Spark master k8s://<this>)."
  value       = aws_eks_cluster.this.endpoint
}

output "cluster_ca" {
  description = "Base64 cluster CA certificate."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "kubernetes_version" {
  description = "Kubernetes minor version of the control plane."
  value       = aws_eks_cluster.this.version
}

output "secrets_kms_key_arn" {
  description = "KMS key that envelope-encrypts the cluster's Kubernetes Secrets."
  value       = one([for c in aws_eks_cluster.this.encryption_config : one(c.provider).key_arn if contains(c.resources, "secrets")])
}

output "oidc_provider_arn" {
  description = "IAM OIDC provider of the cluster (IRSA)."
  value       = aws_iam_openid_connect_provider.this.arn
}

output "oidc_issuer" {
  description = "OIDC issuer without https:// (IRSA condition keys)."
  value       = replace(aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://", "")
}

output "node_groups" {
  description = "The managed node groups by name (system, gpu): instance types, AMI, capacity type, scaling sizes, taints, labels (pipelines.cluster_config reads the GPU group's)."
  value = { for k, g in { system = aws_eks_node_group.system, gpu = aws_eks_node_group.gpu } : k => {
    instance_types = g.instance_types
    ami_type       = g.ami_type
    capacity_type  = g.capacity_type
    subnet_ids     = g.subnet_ids
    scaling        = one(g.scaling_config)
    taints         = [for t in g.taint : { key = t.key, value = t.value, effect = t.effect }]
    labels         = g.labels
  } }
}

output "security" {
  description = "The API endpoint's exposure and the nodes' instance metadata and root volumes (IMDSv2 only, encrypted), by node group."
  value = {
    endpoint_private_access = one(aws_eks_cluster.this.vpc_config).endpoint_private_access
    endpoint_public_access  = one(aws_eks_cluster.this.vpc_config).endpoint_public_access
    public_access_cidrs     = length(var.endpoint_public_cidrs) > 0 ? var.endpoint_public_cidrs : []
    nodes = { for k, lt in { system = aws_launch_template.system, gpu = aws_launch_template.gpu } : k => {
      http_tokens = one(lt.metadata_options).http_tokens
      hop_limit   = one(lt.metadata_options).http_put_response_hop_limit
      ebs         = [for m in lt.block_device_mappings : { encrypted = one(m.ebs).encrypted, kms_key_id = one(m.ebs).kms_key_id }]
    } }
  }
}

output "gpu_node_template_tags" {
  description = "The cluster autoscaler's node-template tags on the GPU group's Auto Scaling group (labels, taint, EFA): what it builds a node from while the group has none."
  value       = local.gpu_node_template_tags
}
