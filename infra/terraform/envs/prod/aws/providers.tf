# The AWS layer needs the aws provider only: nothing here talks to the Kubernetes API.
provider "aws" {
  region = var.region
  default_tags {
    tags = var.tags
  }
}
