# prod, platform layer: what runs inside the prod cluster, from the AWS layer's outputs (../aws, applied first) read
# from its state. Nothing here differs from the other environment but the state it reads: sizes live in ../aws.
data "terraform_remote_state" "aws" {
  backend = "s3"
  config = {
    bucket = var.state_bucket
    region = var.state_region
    key    = "llm-pipeline/prod/aws.tfstate"
  }
}

locals {
  aws = data.terraform_remote_state.aws.outputs.stack
}

module "stack_platform" {
  source                      = "../../../modules/stack_platform"
  aws                         = local.aws
  airflow_image               = var.airflow_image
  spark_image                 = var.spark_image
  trainer_image               = var.trainer_image
  mlflow_image                = var.mlflow_image
  credentials_generation      = var.credentials_generation
  pipeline_pod_security       = var.pipeline_pod_security
  install_pytorchjob_operator = var.install_pytorchjob_operator
  tags                        = var.tags
}
