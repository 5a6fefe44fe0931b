output "mlflow_tracking_uri" {
  description = "MLflow tracking URI inside the cluster (services.mlflow_tracking_uri)."
  value       = module.metadata.mlflow_tracking_uri
}

output "pipeline_namespace" {
  description = "Namespace of the training jobs and Spark executors (launcher.namespace)."
  value       = module.namespaces.namespaces.pipeline
}

output "airflow_namespace" {
  description = "Namespace of the Airflow release."
  value       = module.metadata.airflow_namespace
}

output "mlflow_namespace" {
  description = "Namespace of the MLflow server."
  value       = module.metadata.mlflow_namespace
}

output "shared_fs_claim" {
  description = "FSx claim in the airflow and pipeline namespaces (launcher.shared_fs_claim)."
  value       = module.namespaces.shared_fs_claim
}

output "mlflow_client_secret" {
  description = "Secret with MLflow's client login in the airflow and pipeline namespaces."
  value       = module.metadata.mlflow_client_secret
}

output "roles" {
  description = "Roles in the pipeline namespace: launcher and spark_driver (the Airflow workers), job_watcher (the triggerer)."
  value       = module.namespaces.roles
}

output "spark_image" {
  description = "Spark executor image (services.spark_image)."
  value       = var.spark_image
}

output "trainer_image" {
  description = "Training image (launcher.image)."
  value       = var.trainer_image
}

output "airflow_image" {
  description = "Image of the Airflow pods."
  value       = var.airflow_image
}

output "trainer_chart_version" {
  description = "Kubeflow Trainer v2 chart version (TrainJob)."
  value       = module.cluster_addons.trainer_chart_version
}

output "pytorchjob_operator" {
  description = "The v1 training-operator's chart version (PyTorchJob), or null when not installed."
  value       = module.cluster_addons.pytorchjob_operator
}
