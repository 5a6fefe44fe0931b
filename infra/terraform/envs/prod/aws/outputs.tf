output "stack" {
  description = "Every output of the AWS layer (modules/stack_aws/outputs.tf): the platform root reads them from this state, and `python -m pipelines.cluster_config --env ENV` merges them with the platform root's."
  value       = module.stack_aws
}
