output "role_arns" {
  description = "IRSA role ARN by plane (airflow, spark, trainer, mlflow): the eks.amazonaws.com/role-arn annotation of each service account."
  value       = { for k, r in aws_iam_role.this : k => r.arn }
}

output "service_accounts" {
  description = "namespace:serviceaccount by plane, as each role's trust policy names it."
  value       = var.service_accounts
}

output "assume_role_policies" {
  description = "Trust policy (JSON) of each role by plane: web identity from the cluster's OIDC provider for one service account."
  value       = { for k, r in aws_iam_role.this : k => r.assume_role_policy }
}
