output "mlflow_tracking_uri" {
  description = "In-cluster MLflow tracking URI (the job spec's services.mlflow_tracking_uri)."
  value       = "http://${kubernetes_service_v1.mlflow.metadata[0].name}.${kubernetes_service_v1.mlflow.metadata[0].namespace}.svc.cluster.local:5000"
}

output "airflow_namespace" {
  description = "Namespace of the Airflow release."
  value       = helm_release.airflow.namespace
}

output "mlflow_namespace" {
  description = "Namespace of the MLflow server."
  value       = kubernetes_service_v1.mlflow.metadata[0].namespace
}

output "mlflow_client_secret" {
  description = "Name of the Secret (in the airflow and pipeline namespaces) with MLFLOW_TRACKING_USERNAME / _PASSWORD."
  value       = one(distinct([for s in kubernetes_secret_v1.mlflow_client : s.metadata[0].name]))
}
