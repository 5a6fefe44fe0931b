# Remote state in S3 with native S3 locking (Terraform >= 1.10: use_lockfile; no DynamoDB table).
# The state bucket is created once, outside this stack (see infra/terraform/README.md, "Bootstrap"), and
# `terraform init -backend-config=backend.hcl` fills in bucket and region.
terraform {
  backend "s3" {
    key          = "llm-pipeline/dev/terraform.tfstate"
    encrypt      = true
    use_lockfile = true
  }
}
