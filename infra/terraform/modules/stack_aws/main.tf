# The AWS layer of an environment, composed once: storage (first: its KMS key encrypts the flow logs), network,
# fsx, eks, iam, database. envs/<env>/aws calls it with the env's sizes; the platform root (modules/stack_platform)
# reads its outputs from this root's state and configures the kubernetes and helm providers from them.

module "storage" {
  source                          = "../storage"
  name                            = var.name
  force_destroy                   = var.force_destroy_buckets
  tags                            = var.tags
  create_autoscaling_service_role = var.create_autoscaling_service_role
  fsx_s3_access_role_arns         = [module.fsx.s3_access_role_arn]
  checkpoint_ia_days              = var.retention.checkpoint_ia_days
  checkpoint_glacier_days         = var.retention.checkpoint_glacier_days
  noncurrent_expiry_days          = var.retention.noncurrent_expiry_days
  task_log_days                   = var.retention.task_log_days
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
  kubernetes_version          = var.kubernetes_version
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
  admin_role_arns             = var.admin_role_arns
  tags                        = var.tags
}

# The service accounts the IRSA roles trust, namespace:name. The platform root creates the namespaces and the
# spark and trainer accounts under these names; the Airflow chart creates airflow-worker, MLflow's module mlflow.
locals {
  service_accounts = {
    airflow = "${var.namespaces.airflow}:airflow-worker"
    spark   = "${var.namespaces.pipeline}:spark"
    trainer = "${var.namespaces.pipeline}:trainer"
    mlflow  = "${var.namespaces.mlflow}:mlflow"
    # the Airflow chart's API server: it reads finished tasks' logs from S3 (modules/metadata's remote logging)
    airflow_logs = "${var.namespaces.airflow}:airflow-api-server"
    # cluster-autoscaler's chart (modules/cluster_addons), in kube-system like the device plugins
    cluster_autoscaler = "kube-system:cluster-autoscaler"
  }
}

module "iam" {
  source            = "../iam"
  name              = var.name
  cluster_name      = module.eks.cluster_name
  oidc_provider_arn = module.eks.oidc_provider_arn
  oidc_issuer       = module.eks.oidc_issuer
  bucket_arns       = module.storage.bucket_arns
  kms_key_arn       = module.storage.kms_key_arn
  service_accounts  = local.service_accounts
  tags              = var.tags
}

module "database" {
  source               = "../database"
  name                 = var.name
  vpc_id               = module.network.vpc_id
  private_subnet_ids   = module.network.private_subnet_ids
  private_subnet_cidrs = module.network.private_subnet_cidrs
  kms_key_arn          = module.storage.kms_key_arn
  instance_class       = var.db_instance_class
  multi_az             = var.db_multi_az
  deletion_protection  = var.db_deletion_protection
  tags                 = var.tags
}
