output "cluster_name" {
  description = "EKS cluster name."
  value       = aws_eks_cluster.this.name
}

output "cluster_endpoint" {
  description = "Kubernetes API server URL (Spark master k8s://<this>, kubernetes_default host)."
  value       = aws_eks_cluster.this.endpoint
}

output "cluster_ca" {
  description = "Base64 cluster CA certificate."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "oidc_provider_arn" {
  description = "IAM OIDC provider of the cluster (IRSA)."
  value       = aws_iam_openid_connect_provider.this.arn
}

output "oidc_issuer" {
  description = "OIDC issuer without https:// (IRSA condition keys)."
  value       = replace(aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://", "")
}

output "pipeline_namespace" {
  description = "Namespace of the training and Spark pods."
  value       = kubernetes_namespace_v1.pipeline.metadata[0].name
}

output "launcher_role_name" {
  description = "Role (in the pipeline namespace) to bind to Airflow's worker service account."
  value       = kubernetes_role_v1.launcher.metadata[0].name
}

output "spark_role_name" {
  description = "Role (in the pipeline namespace) to bind to the Spark driver service account."
  value       = kubernetes_role_v1.spark_driver.metadata[0].name
}

output "airflow_namespace" {
  description = "Namespace for the Airflow release, with the FSx claim in it."
  value       = kubernetes_namespace_v1.airflow.metadata[0].name
}

output "shared_fs_claim" {
  description = "PersistentVolumeClaim of FSx in both namespaces (launcher.shared_fs_claim)."
  value       = var.shared_fs_claim
}
