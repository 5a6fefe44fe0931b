output "stack" {
  description = "Every output of the stack (modules/stack/outputs.tf); `python -m pipelines.cluster_config --env ENV` reads them."
  value       = module.stack
}
