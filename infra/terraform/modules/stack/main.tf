# The whole stack, composed once; envs/dev and envs/prod differ only in the sizes they pass.

module "storage" {
  source                          = "../storage"
  name                            = var.name
  force_destroy                   = var.force_destroy_buckets
  tags                            = var.tags
  create_autoscaling_service_role = var.create_autoscaling_service_role
}

module "network" {
  source             = "../network"
  name               = var.name
  azs                = var.azs
  single_nat_gateway = var.single_nat_gateway
  kms_key_arn        = module.storage.kms_key_arn
  tags               = var.tags
}

module "fsx" {
  source               = "../fsx"
  name                 = var.name
  vpc_id               = module.network.vpc_id
  vpc_cidr             = module.network.vpc_cidr
  subnet_id            = module.network.private_subnet_ids[0]
  storage_capacity_gib = var.fsx_capacity_gib
  throughput_per_tib   = var.fsx_throughput_per_tib
  checkpoint_bucket    = module.storage.bucket_names["checkpoints"]
  kms_key_arn          = module.storage.kms_key_arn
  tags                 = var.tags
}

module "eks" {
  source                      = "../eks"
  name                        = var.name
  vpc_id                      = module.network.vpc_id
  vpc_cidr                    = module.network.vpc_cidr
  private_subnet_ids          = module.network.private_subnet_ids
  endpoint_public_cidrs       = var.endpoint_public_cidrs
  kms_key_arn                 = module.storage.kms_key_arn
  system_nodes                = var.system_nodes
  gpu_instance_type           = var.gpu_instance_type
  gpu_efa_interfaces          = var.gpu_efa_interfaces
  gpu_local_nvme_raid0        = var.gpu_local_nvme_raid0
  gpu_nodes                   = var.gpu_nodes
  gpu_capacity_type           = var.gpu_capacity_type
  gpu_capacity_reservation_id = var.gpu_capacity_reservation_id
  pipeline_pod_security       = var.pipeline_pod_security
  fsx = {
    file_system_id = module.fsx.file_system_id
    dns_name       = module.fsx.dns_name
    mount_name     = module.fsx.mount_name
    capacity_gib   = var.fsx_capacity_gib
  }
  tags = var.tags
}

module "iam" {
  source             = "../iam"
  name               = var.name
  oidc_provider_arn  = module.eks.oidc_provider_arn
  oidc_issuer        = module.eks.oidc_issuer
  bucket_arns        = module.storage.bucket_arns
  kms_key_arn        = module.storage.kms_key_arn
  launcher_role_name = module.eks.launcher_role_name
  spark_role_name    = module.eks.spark_role_name
  tags               = var.tags
}

module "metadata" {
  source                 = "../metadata"
  name                   = var.name
  vpc_id                 = module.network.vpc_id
  private_subnet_ids     = module.network.private_subnet_ids
  private_subnet_cidrs   = module.network.private_subnet_cidrs
  mlflow_image           = var.mlflow_image
  credentials_generation = var.credentials_generation
  pipeline_namespace     = module.eks.pipeline_namespace
  kms_key_arn            = module.storage.kms_key_arn
  instance_class         = var.db_instance_class
  multi_az               = var.db_multi_az
  deletion_protection    = var.db_deletion_protection
  mlflow_bucket          = module.storage.bucket_names["mlflow"]
  irsa_role_arns         = module.iam.role_arns
  airflow_image          = var.airflow_image
  airflow_namespace      = module.eks.airflow_namespace
  shared_fs_claim        = module.eks.shared_fs_claim
  pipeline_env           = local.pipeline_env
  tags                   = var.tags
}

# What the job spec reads from the environment on the Airflow workers (pipelines/spec.py ENV_OVERRIDES):
# the same DAG and configs/*.yaml, pointed at this stack.
locals {
  pipeline_env = {
    SPARK_MASTER        = "k8s://${module.eks.cluster_endpoint}"
    S3_ENDPOINT_URL     = "aws"
    S3_BUCKET           = module.storage.bucket_names["checkpoints"]
    MLFLOW_TRACKING_URI = "http://mlflow.mlflow.svc.cluster.local:5000" # login: MLFLOW_TRACKING_USERNAME/PASSWORD from the mlflow-client Secret
    LLMP_HOME           = "/fsx/llm-pipeline"
  }
}

module "netpol" {
  source = "../netpol"
  namespaces = {
    airflow  = module.eks.airflow_namespace
    pipeline = module.eks.pipeline_namespace
    mlflow   = module.metadata.mlflow_namespace
  }
  vpc_cidr             = module.network.vpc_cidr
  private_subnet_cidrs = module.network.private_subnet_cidrs
}
