variable "name" {
  type        = string
  description = "Name prefix of every resource in the environment (e.g. llmp-dev)."
}

variable "region" {
  type        = string
  description = "AWS region (the pipeline's S3 settings and the Airflow connection use it)."
}

variable "azs" {
  type        = list(string)
  description = "Availability zones; the first hosts the GPU nodes and FSx."
}

variable "endpoint_public_cidrs" {
  type        = list(string)
  description = "CIDRs allowed to reach the EKS API's public endpoint (office/VPN); empty = private only."
  default     = []
}

variable "single_nat_gateway" {
  type        = bool
  description = "One NAT gateway for all AZs (dev) instead of one per AZ (prod)."
}

variable "force_destroy_buckets" {
  type        = bool
  description = "Let terraform destroy delete non-empty buckets (dev only)."
  default     = false
}

variable "fsx_capacity_gib" {
  type        = number
  description = "FSx for Lustre capacity (1200, 2400, or a multiple of 2400)."
}

variable "fsx_throughput_per_tib" {
  type        = number
  description = "FSx PERSISTENT_2 throughput, MB/s per TiB."
}

variable "system_nodes" {
  type        = object({ min = number, desired = number, max = number })
  description = "System node group size."
}

variable "gpu_instance_type" {
  type        = string
  description = "GPU node instance type."
}

variable "gpu_efa_interfaces" {
  type        = number
  description = "EFA interfaces per GPU node (32 on p5.48xlarge, 0 without EFA)."
}

variable "gpu_local_nvme_raid0" {
  type        = bool
  description = "RAID0 over the GPU nodes' instance-store NVMe under the kubelet: the node-local L0 checkpoint tier (p5, p4d and g6e have instance store)."
  default     = true
}

variable "gpu_capacity_type" {
  type        = string
  description = "ON_DEMAND or CAPACITY_BLOCK (an EC2 Capacity Block reservation) for the GPU nodes."
  default     = "ON_DEMAND"
}

variable "gpu_capacity_reservation_id" {
  type        = string
  description = "The Capacity Block reservation (cr-…) for gpu_capacity_type = CAPACITY_BLOCK."
  default     = null
}

variable "pipeline_pod_security" {
  type        = string
  description = "Pod Security level enforced in the pipeline namespace: baseline, or privileged only when launcher.node_local_path / services.spark_local_dir use hostPath."
  default     = "baseline"
}

variable "gpu_nodes" {
  type        = object({ min = number, desired = number, max = number })
  description = "GPU node group size."
}

variable "db_instance_class" {
  type        = string
  description = "RDS instance class of the metadata database."
}

variable "db_multi_az" {
  type        = bool
  description = "Multi-AZ standby for the metadata database."
}

variable "db_deletion_protection" {
  type        = bool
  description = "Refuse to delete the metadata database."
}

variable "airflow_image" {
  type        = object({ repository = string, tag = string })
  description = "Airflow image with this project installed (built from the repository, pushed to ECR)."
}

variable "spark_image" {
  type        = string
  description = "Spark executor image (Java 17 + pyspark + this package): the job spec's services.spark_image."
}

variable "trainer_image" {
  type        = string
  description = "Training image (this package + CUDA torch): the job spec's launcher.image."
}

variable "tags" {
  type        = map(string)
  description = "Tags on every resource."
  default     = {}
}

variable "mlflow_image" {
  type        = string
  description = "MLflow server image by digest (REPOSITORY@sha256:…): MLflow 3.17.2 with psycopg2 and boto3, built from infra/docker/mlflow.Dockerfile."
}

variable "credentials_generation" {
  type        = number
  description = "Bump to rotate the applications' database passwords and the MLflow and Airflow admin passwords."
  default     = 1
}

variable "create_autoscaling_service_role" {
  type        = bool
  description = "Create EC2 Auto Scaling's service-linked role, which the KMS key policy names: true only in an account that has never used Auto Scaling."
  default     = false
}
