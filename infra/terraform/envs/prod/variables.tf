variable "region" {
  type        = string
  description = "AWS region."
}

variable "azs" {
  type        = list(string)
  description = "Availability zones (the first hosts the GPU nodes and FSx)."
}

variable "endpoint_public_cidrs" {
  type        = list(string)
  description = "CIDRs allowed to reach the EKS API's public endpoint (your office/VPN); empty = private only."
  default     = []
}

variable "airflow_image" {
  type        = object({ repository = string, tag = string })
  description = "Airflow image with this project installed (built from the repository, pushed to ECR)."
}

variable "spark_image" {
  type        = string
  description = "Spark executor image (Java 17 + pyspark + this package)."
}

variable "trainer_image" {
  type        = string
  description = "Training image (this package + CUDA torch): the job spec's launcher.image."
}

variable "tags" {
  type        = map(string)
  description = "Tags on every resource (also the AWS provider's default tags)."
}

variable "mlflow_image" {
  type        = string
  description = "MLflow server image by digest (REPOSITORY@sha256:…), built from infra/docker/mlflow.Dockerfile."
}

variable "credentials_generation" {
  type        = number
  description = "Bump and apply to rotate the database and admin passwords (the Kubernetes Secrets and pods follow)."
  default     = 1
}

variable "gpu_capacity_type" {
  type        = string
  description = "ON_DEMAND or CAPACITY_BLOCK (an EC2 Capacity Block reservation) for the GPU nodes."
  default     = "ON_DEMAND"
}

variable "pipeline_pod_security" {
  type        = string
  description = "Pod Security level of the pipeline namespace: baseline, or privileged for hostPath scratch."
  default     = "baseline"
}

variable "gpu_capacity_reservation_id" {
  type        = string
  description = "The Capacity Block reservation (cr-…) for gpu_capacity_type = CAPACITY_BLOCK."
  default     = null
}

variable "create_autoscaling_service_role" {
  type        = bool
  description = "Create EC2 Auto Scaling's service-linked role, which the KMS key policy names: true only in an account that has never used Auto Scaling."
  default     = false
}
