variable "state_bucket" {
  type        = string
  description = "S3 bucket of the Terraform state (the `bucket` of ../backend.hcl): the AWS layer's outputs are read from it."
}

variable "state_region" {
  type        = string
  description = "Region of the state bucket (the `region` of ../backend.hcl)."
}

variable "airflow_image" {
  type        = string
  description = "Airflow image with this project installed (`make image`, CPU flavour, pushed to ECR): NAME@sha256:DIGEST (recommended) or NAME:TAG."
}

variable "spark_image" {
  type        = string
  description = "Spark executor image (`make image`, CPU flavour): NAME@sha256:DIGEST (recommended) or NAME:TAG."
}

variable "trainer_image" {
  type        = string
  description = "Training image (`make image`, CUDA torch): NAME@sha256:DIGEST (recommended) or NAME:TAG; the job spec's launcher.image."
}

variable "mlflow_image" {
  type        = string
  description = "MLflow server image by digest (REPOSITORY@sha256:…): the pipeline image (make image), which serves MLflow too."
}

variable "credentials_generation" {
  type        = number
  description = "Bump and apply to rotate the database and admin passwords (the Kubernetes Secrets and pods follow)."
  default     = 1
}

variable "pipeline_pod_security" {
  type        = string
  description = "Pod Security level of the pipeline namespace: baseline, or privileged for hostPath scratch."
  default     = "baseline"
}

variable "install_pytorchjob_operator" {
  type        = bool
  description = "Also install the v1 training-operator v1.8.1 (PyTorchJob) for launcher.kind=pytorchjob; TrainJob is always installed."
  default     = false
}

variable "tags" {
  type        = map(string)
  description = "Tags on this layer's AWS resources (also the AWS provider's default tags)."
}
