output "db_endpoint" {
  description = "PostgreSQL host:port (private)."
  value       = aws_db_instance.this.endpoint
}

output "db_secret_arn" {
  description = "Secrets Manager secret with the master credentials (managed and rotated by RDS)."
  value       = aws_db_instance.this.master_user_secret[0].secret_arn
}

output "mlflow_tracking_uri" {
  description = "In-cluster MLflow tracking URI (the job spec's services.mlflow_tracking_uri)."
  value       = "http://mlflow.${kubernetes_namespace_v1.mlflow.metadata[0].name}.svc.cluster.local:5000"
}

output "airflow_namespace" {
  description = "Namespace of the Airflow release."
  value       = var.airflow_namespace
}

output "mlflow_namespace" {
  description = "Namespace of the MLflow server."
  value       = kubernetes_namespace_v1.mlflow.metadata[0].name
}

output "mlflow_client_secret" {
  description = "Name of the Secret (in the airflow and pipeline namespaces) with MLFLOW_TRACKING_USERNAME / _PASSWORD."
  value       = "mlflow-client"
}
