output "name" {
  description = "Name prefix of the environment (e.g. llmp-dev)."
  value       = var.name
}

output "region" {
  description = "AWS region."
  value       = var.region
}

output "cluster_name" {
  description = "EKS cluster name: the platform root reads the endpoint, CA and a token by it (aws eks update-kubeconfig --name ...)."
  value       = module.eks.cluster_name
}

output "cluster_endpoint" {
  description = "Kubernetes API server URL."
  value       = module.eks.cluster_endpoint
}

output "cluster_ca" {
  description = "Base64 cluster CA certificate."
  value       = module.eks.cluster_ca
}

output "kubernetes_version" {
  description = "Kubernetes minor version of the cluster."
  value       = module.eks.kubernetes_version
}

output "spark_master" {
  description = "Spark master URL for spark-submit (services.spark_master)."
  value       = "k8s://${module.eks.cluster_endpoint}"
}

output "buckets" {
  description = "Pipeline buckets by purpose."
  value       = module.storage.bucket_names
}

output "kms_key_arn" {
  description = "The stack's customer-managed KMS key (the platform root's Secrets Manager secrets use it too)."
  value       = module.storage.kms_key_arn
}

output "kms_key_policy" {
  description = "The KMS key's policy (JSON)."
  value       = module.storage.kms_key_policy
}

output "encryption" {
  description = "What each store is encrypted with: bucket default encryption by purpose, FSx, EKS secrets, RDS."
  value = {
    buckets     = module.storage.bucket_encryption
    fsx         = module.fsx.kms_key_id
    eks_secrets = module.eks.secrets_kms_key_arn
    rds         = module.database.encryption
  }
}

output "namespaces" {
  description = "Namespaces by role (airflow, pipeline, mlflow) that the platform root creates; the IRSA trust names accounts in them."
  value       = var.namespaces
}

output "pipeline_namespace" {
  description = "Namespace of the training jobs and Spark executors (launcher.namespace)."
  value       = var.namespaces.pipeline
}

output "service_accounts" {
  description = "namespace:serviceaccount by plane, as the IRSA roles trust them."
  value       = module.iam.service_accounts
}

output "irsa_role_arns" {
  description = "IRSA role ARN by plane."
  value       = module.iam.role_arns
}

output "irsa_trust_policies" {
  description = "Trust policy (JSON) of each IRSA role by plane."
  value       = module.iam.assume_role_policies
}

output "node_groups" {
  description = "The EKS managed node groups (system, gpu) with their instance types and sizes."
  value       = module.eks.node_groups
}

output "autoscaling" {
  description = "What the cluster autoscaler (modules/cluster_addons) needs and is given: the cluster it discovers groups of, its IRSA role and service account, that role's permissions, and the GPU group's node-template tags (scale from zero)."
  value = {
    cluster_name           = module.eks.cluster_name
    region                 = var.region
    role_arn               = module.iam.role_arns["cluster_autoscaler"]
    service_account        = module.iam.service_accounts["cluster_autoscaler"]
    policy                 = module.iam.cluster_autoscaler_policy
    gpu_node_template_tags = module.eks.gpu_node_template_tags
  }
}

output "gpu_efa_interfaces" {
  description = "EFA interfaces per GPU node (launcher.efa_per_node)."
  value       = var.gpu_efa_interfaces
}

output "fsx" {
  description = "The FSx for Lustre file system (the CSI PersistentVolume's handle and attributes) and its data repository link."
  value = {
    file_system_id     = module.fsx.file_system_id
    dns_name           = module.fsx.dns_name
    mount_name         = module.fsx.mount_name
    capacity_gib       = module.fsx.storage_capacity_gib
    data_repository    = module.fsx.data_repository
    s3_access_role_arn = module.fsx.s3_access_role_arn
  }
}

output "network" {
  description = "VPC CIDR and the private subnets' CIDRs (NetworkPolicies to FSx and RDS)."
  value = {
    vpc_cidr             = module.network.vpc_cidr
    private_subnet_cidrs = module.network.private_subnet_cidrs
  }
}

output "database" {
  description = "The metadata database: host, port, and the RDS-managed master secret."
  value = {
    address           = module.database.address
    port              = module.database.port
    master_secret_arn = module.database.master_secret_arn
  }
}

output "security" {
  description = "What terraform test asserts of the AWS layer: buckets (public access block, versioning, TLS only), EKS (endpoint, IMDSv2, encrypted node volumes), RDS (deletion protection, backups, Multi-AZ)."
  value = {
    buckets  = module.storage.bucket_security
    eks      = module.eks.security
    database = module.database.protection
  }
}

output "lifecycle" {
  description = "Each pipeline bucket's lifecycle rules (purpose → id, prefix, transitions, expiry days)."
  value       = module.storage.bucket_lifecycle
}
