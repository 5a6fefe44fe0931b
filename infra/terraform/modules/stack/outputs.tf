output "region" {
  description = "AWS region."
  value       = var.region
}

output "cluster_name" {
  description = "EKS cluster name (aws eks update-kubeconfig --name ...)."
  value       = module.eks.cluster_name
}

output "cluster_endpoint" {
  description = "Kubernetes API server URL."
  value       = module.eks.cluster_endpoint
}

output "spark_master" {
  description = "Spark master URL for spark-submit (services.spark_master)."
  value       = "k8s://${module.eks.cluster_endpoint}"
}

output "buckets" {
  description = "Pipeline buckets by purpose."
  value       = module.storage.bucket_names
}

output "mlflow_tracking_uri" {
  description = "MLflow tracking URI inside the cluster."
  value       = module.metadata.mlflow_tracking_uri
}

output "pipeline_namespace" {
  description = "Namespace of PyTorchJobs and Spark executors (launcher.namespace)."
  value       = module.eks.pipeline_namespace
}

output "shared_fs_claim" {
  description = "FSx claim (launcher.shared_fs_claim)."
  value       = module.eks.shared_fs_claim
}

output "irsa_role_arns" {
  description = "IRSA role ARN by plane."
  value       = module.iam.role_arns
}

output "service_accounts" {
  description = "namespace:serviceaccount by plane."
  value       = module.iam.service_accounts
}

output "spark_image" {
  description = "Spark executor image (services.spark_image)."
  value       = var.spark_image
}

output "trainer_image" {
  description = "Training image (launcher.image)."
  value       = var.trainer_image
}

output "gpu_efa_interfaces" {
  description = "EFA interfaces per GPU node (launcher.efa_per_node)."
  value       = var.gpu_efa_interfaces
}

output "cluster_ca" {
  description = "Base64 cluster CA certificate (the envs' kubernetes and helm providers use it)."
  value       = module.eks.cluster_ca
}
