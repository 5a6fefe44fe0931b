terraform {
  required_version = ">= 1.10" # S3 native state locking (use_lockfile) needs 1.10
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.81, < 7.0"
    }
  }
}
