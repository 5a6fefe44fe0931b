variable "namespaces" {
  type        = object({ airflow = string, pipeline = string, mlflow = string })
  description = "The pipeline's namespaces: Airflow, the training and Spark pods, the MLflow server."
}

variable "vpc_cidr" {
  type        = string
  description = "VPC CIDR block: FSx for Lustre and the VPC's interface endpoints live in it."
}

variable "private_subnet_cidrs" {
  type        = list(string)
  description = "CIDR blocks of the private subnets: where RDS is."
}
