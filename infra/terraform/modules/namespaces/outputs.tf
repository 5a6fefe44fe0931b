output "namespaces" {
  description = "The created namespaces by role (airflow, pipeline, mlflow): read from the resources, so users of these names wait for them."
  value = {
    airflow  = kubernetes_namespace_v1.airflow.metadata[0].name
    pipeline = kubernetes_namespace_v1.pipeline.metadata[0].name
    mlflow   = kubernetes_namespace_v1.mlflow.metadata[0].name
  }
}

output "shared_fs_claim" {
  description = "PersistentVolumeClaim of FSx in the airflow and pipeline namespaces (launcher.shared_fs_claim)."
  value       = one(distinct([for c in kubernetes_persistent_volume_claim_v1.fsx : c.metadata[0].name]))
}

output "roles" {
  description = "Roles in the pipeline namespace by purpose: launcher (Airflow workers), spark_driver (Airflow workers: Spark's client-mode driver), job_watcher (the triggerer)."
  value = {
    launcher     = kubernetes_role_v1.launcher.metadata[0].name
    spark_driver = kubernetes_role_v1.spark_driver.metadata[0].name
    job_watcher  = kubernetes_role_v1.job_watcher.metadata[0].name
  }
}

output "triggerer_service_account" {
  description = "The triggerer's service account name (the Airflow chart's triggerer.serviceAccount.name)."
  value       = var.triggerer_service_account
}
