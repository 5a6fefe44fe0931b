terraform {
  required_version = ">= 1.10" # S3 native state locking (use_lockfile) needs 1.10
  required_providers {
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = ">= 2.27"
    }
  }
}
