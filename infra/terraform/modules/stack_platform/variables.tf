variable "aws" {
  type = object({
    name               = string
    cluster_endpoint   = string
    buckets            = map(string)
    kms_key_arn        = string
    namespaces         = object({ airflow = string, pipeline = string, mlflow = string })
    service_accounts   = object({ airflow = string, spark = string, trainer = string, mlflow = string })
    irsa_role_arns     = map(string)
    gpu_efa_interfaces = number
    kubernetes_version = string
    autoscaling        = object({ cluster_name = string, region = string, role_arn = string, service_account = string })
    fsx                = object({ file_system_id = string, dns_name = string, mount_name = string, capacity_gib = number })
    network            = object({ vpc_cidr = string, private_subnet_cidrs = list(string) })
    database           = object({ address = string, port = number, master_secret_arn = string })
  })
  description = "The AWS layer's outputs (envs/<env>/aws, output `stack`) that this layer reads; other attributes are ignored."
}

# An image reference with a tag or a digest: NAME:TAG, NAME@sha256:<64 hex>, or NAME:TAG@sha256:<64 hex>. `make image`
# builds it, `skopeo copy --digestfile` gives the pushed digest; a digest pins exactly what was built and tested.
variable "airflow_image" {
  type        = string
  description = "Image of the Airflow pods with this project installed (`make image`, CPU flavour), NAME:TAG or NAME@sha256:DIGEST (recommended)."
  validation {
    condition     = can(regex("^[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?@sha256:[0-9a-f]{64})$", var.airflow_image))
    error_message = "airflow_image must be NAME:TAG or NAME@sha256:<64 hex digits> (`make image`, then the digest `skopeo copy --digestfile` writes)."
  }
}

variable "spark_image" {
  type        = string
  description = "Spark executor image (`make image`, CPU flavour: Java 17 + pyspark + this package), NAME:TAG or NAME@sha256:DIGEST (recommended): the job spec's services.spark_image."
  validation {
    condition     = can(regex("^[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?@sha256:[0-9a-f]{64})$", var.spark_image))
    error_message = "spark_image must be NAME:TAG or NAME@sha256:<64 hex digits> (`make image`, then the digest `skopeo copy --digestfile` writes)."
  }
}

variable "trainer_image" {
  type        = string
  description = "Training image (`make image`, CUDA torch), NAME:TAG or NAME@sha256:DIGEST (recommended): the job spec's launcher.image."
  validation {
    condition     = can(regex("^[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?@sha256:[0-9a-f]{64})$", var.trainer_image))
    error_message = "trainer_image must be NAME:TAG or NAME@sha256:<64 hex digits> (`make image`, then the digest `skopeo copy --digestfile` writes)."
  }
}

variable "mlflow_image" {
  type        = string
  description = "MLflow server image by digest (REPOSITORY@sha256:…): the pipeline image (make image), which serves MLflow too."
}

variable "credentials_generation" {
  type        = number
  description = "Bump to rotate the applications' database passwords and the MLflow and Airflow admin passwords."
  default     = 1
}

variable "pipeline_pod_security" {
  type        = string
  description = "Pod Security level enforced in the pipeline namespace: baseline, or privileged only when launcher.node_local_path / services.spark_local_dir use hostPath."
  default     = "baseline"
}

variable "install_pytorchjob_operator" {
  type        = bool
  description = "Also install the v1 training-operator v1.8.1 (PyTorchJob) for launcher.kind=pytorchjob; TrainJob (Trainer v2) is always installed."
  default     = false
}

variable "tags" {
  type        = map(string)
  description = "Tags on the AWS resources of this layer (the applications' login secrets)."
  default     = {}
}
