# Remote state in S3 with native S3 locking (Terraform >= 1.10: use_lockfile; no DynamoDB table). The state bucket
# is created once, outside this stack (infra/terraform/README.md, "Apply"); `terraform init
# -backend-config=../backend.hcl` fills in bucket and region. The platform root (../platform) reads this state.
terraform {
  backend "s3" {
    key          = "llm-pipeline/prod/aws.tfstate"
    encrypt      = true
    use_lockfile = true
  }
}
