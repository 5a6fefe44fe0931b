output "role_arns" {
  description = "IRSA role ARN by plane (airflow, spark, trainer, mlflow): the eks.amazonaws.com/role-arn annotation of each service account."
  value       = { for k, r in aws_iam_role.this : k => r.arn }
}

output "service_accounts" {
  description = "namespace:serviceaccount by plane (the Spark driver's and the training pods' accounts)."
  value       = var.service_accounts
}
