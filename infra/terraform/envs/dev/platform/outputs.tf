output "stack" {
  description = "Every output of the platform layer (modules/stack_platform/outputs.tf); `python -m pipelines.cluster_config --env ENV` merges them over the AWS layer's."
  value       = module.stack_platform
}
