terraform {
  required_version = ">= 1.10" # S3 native state locking (use_lockfile) needs 1.10
  required_providers {
    helm = {
      source  = "hashicorp/helm"
      version = ">= 2.12, < 3.0"
    }
  }
}
