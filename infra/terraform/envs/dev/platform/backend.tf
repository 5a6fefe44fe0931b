# Remote state in S3 with native S3 locking, in the same bucket as the AWS layer's (`terraform init
# -backend-config=../backend.hcl`), under its own key.
terraform {
  backend "s3" {
    key          = "llm-pipeline/dev/platform.tfstate"
    encrypt      = true
    use_lockfile = true
  }
}
