# The platform layer of an environment, composed once: what runs inside the cluster the AWS layer made
# (namespaces, service accounts and RBAC, the FSx volume, device plugins, Kubeflow Trainer v2 and the optional
# v1 operator, the cluster autoscaler, MLflow, Airflow, NetworkPolicies). envs/<env>/platform calls it with the
# AWS layer's outputs (var.aws, read from that root's state) and the images.

module "namespaces" {
  source                    = "../namespaces"
  name                      = var.aws.name
  namespaces                = var.aws.namespaces
  pipeline_pod_security     = var.pipeline_pod_security
  fsx                       = var.aws.fsx
  service_accounts          = var.aws.service_accounts
  irsa_role_arns            = var.aws.irsa_role_arns
  triggerer_service_account = local.triggerer_service_account
}

module "cluster_addons" {
  source                      = "../cluster_addons"
  gpu_efa_interfaces          = var.aws.gpu_efa_interfaces
  autoscaling                 = var.aws.autoscaling
  kubernetes_version          = var.aws.kubernetes_version
  install_pytorchjob_operator = var.install_pytorchjob_operator
}

locals {
  triggerer_service_account = "airflow-triggerer"
  # What the job spec reads from the environment on the Airflow workers (pipelines/spec.py ENV_OVERRIDES): the same
  # DAG and configs/*.yaml, pointed at this stack.
  pipeline_env = {
    SPARK_MASTER        = "k8s://${var.aws.cluster_endpoint}"
    S3_ENDPOINT_URL     = "aws"
    S3_BUCKET           = var.aws.buckets["checkpoints"]
    MLFLOW_TRACKING_URI = "http://mlflow.${module.namespaces.namespaces.mlflow}.svc.cluster.local:5000" # login: MLFLOW_TRACKING_USERNAME/PASSWORD from the mlflow-client Secret
    LLMP_HOME           = "/fsx/llm-pipeline"
  }
}

module "metadata" {
  source                    = "../metadata"
  name                      = var.aws.name
  db                        = var.aws.database
  namespaces                = module.namespaces.namespaces
  kms_key_arn               = var.aws.kms_key_arn
  mlflow_bucket             = var.aws.buckets["mlflow"]
  irsa_role_arns            = var.aws.irsa_role_arns
  mlflow_image              = var.mlflow_image
  credentials_generation    = var.credentials_generation
  airflow_image             = var.airflow_image
  worker_service_account    = split(":", var.aws.service_accounts.airflow)[1]
  triggerer_service_account = module.namespaces.triggerer_service_account
  shared_fs_claim           = module.namespaces.shared_fs_claim
  pipeline_env              = local.pipeline_env
  tags                      = var.tags
}

module "netpol" {
  source               = "../netpol"
  namespaces           = module.namespaces.namespaces
  vpc_cidr             = var.aws.network.vpc_cidr
  private_subnet_cidrs = var.aws.network.private_subnet_cidrs
}
