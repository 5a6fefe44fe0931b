output "role_arns" {
  description = "IRSA role ARN by plane (airflow, spark, trainer, mlflow, airflow_logs, cluster_autoscaler): the eks.amazonaws.com/role-arn annotation of each service account."
  value       = merge({ for k, r in aws_iam_role.this : k => r.arn }, { cluster_autoscaler = aws_iam_role.cluster_autoscaler.arn })
}

output "service_accounts" {
  description = "namespace:serviceaccount by plane, as each role's trust policy names it."
  value       = var.service_accounts
}

output "assume_role_policies" {
  description = "Trust policy (JSON) of each role by plane: web identity from the cluster's OIDC provider for one service account."
  value       = merge({ for k, r in aws_iam_role.this : k => r.assume_role_policy }, { cluster_autoscaler = aws_iam_role.cluster_autoscaler.assume_role_policy })
}

output "cluster_autoscaler_policy" {
  description = "The cluster autoscaler role's permissions (JSON): describe calls, and resizing only this cluster's node groups."
  value       = aws_iam_role_policy.cluster_autoscaler.policy
}
