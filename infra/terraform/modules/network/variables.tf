variable "name" {
  type        = string
  description = "Name prefix for every resource (e.g. llmp-dev)."
}

variable "cidr" {
  type        = string
  description = "VPC CIDR block."
  default     = "10.40.0.0/16"
}

variable "azs" {
  type        = list(string)
  description = "Availability zones for the private and public subnets (two or more; GPU nodes use the first)."
  validation {
    condition     = length(var.azs) >= 2
    error_message = "Give at least two availability zones (EKS needs subnets in two)."
  }
}

variable "single_nat_gateway" {
  type        = bool
  description = "One NAT gateway for all AZs (cheaper, dev) instead of one per AZ (prod)."
  default     = false
}

variable "flow_log_retention_days" {
  type        = number
  description = "Days to keep VPC flow logs in CloudWatch."
  default     = 365
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key that encrypts the flow-log group."
}

variable "interface_endpoints" {
  type        = list(string)
  description = "AWS services reached through interface VPC endpoints (private DNS) instead of the NAT."
  default     = ["ecr.api", "ecr.dkr", "sts", "logs", "secretsmanager"]
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}
