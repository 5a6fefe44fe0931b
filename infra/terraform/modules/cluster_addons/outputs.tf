output "trainer_chart_version" {
  description = "Kubeflow Trainer v2 chart version installed (TrainJob)."
  value       = helm_release.kubeflow_trainer.version
}

output "pytorchjob_operator" {
  description = "The v1 training-operator release (PyTorchJob): its chart version, or null when install_pytorchjob_operator is false."
  value       = one(helm_release.training_operator[*].version)
}
