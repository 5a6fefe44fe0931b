variable "name" {
  type        = string
  description = "Name prefix."
}

variable "vpc_id" {
  type        = string
  description = "VPC of the cluster."
}

variable "private_subnet_ids" {
  type        = list(string)
  description = "Private subnets for the DB subnet group (two AZs or more)."
}

variable "private_subnet_cidrs" {
  type        = list(string)
  description = "CIDR blocks of the private subnets: the only sources RDS admits."
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key for storage, Performance Insights and the master-password secret."
}

variable "instance_class" {
  type        = string
  description = "RDS instance class."
  default     = "db.t4g.medium"
}

variable "allocated_storage_gib" {
  type        = number
  description = "Initial storage (autoscaling up to 5×)."
  default     = 50
}

variable "multi_az" {
  type        = bool
  description = "Standby in a second AZ (prod)."
  default     = true
}

variable "deletion_protection" {
  type        = bool
  description = "Refuse to delete the database (turn off only to tear down dev)."
  default     = true
}

variable "backup_retention_days" {
  type        = number
  description = "Automated backup retention."
  default     = 14
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}
