# the same bucket and region as ../backend.hcl: where the AWS layer's state is read from
state_bucket = "my-org-terraform-state"
state_region = "us-east-1"
# PLACEHOLDERS: `make image` (and `make image-save` + `skopeo copy` to ECR), then put the digest the push wrote (`skopeo copy --digestfile`) here,
# REPOSITORY@sha256:<digest>; a tag (REPOSITORY:TAG) is accepted but may move. Airflow and Spark use the CPU flavour.
airflow_image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline:dev-cpu"
spark_image   = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline:dev-cpu"
trainer_image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline:dev"
tags          = { Project = "llm-pipeline", Environment = "dev", ManagedBy = "terraform" }
# PLACEHOLDER digest: build infra/docker/mlflow.Dockerfile, push it, and put the digest `docker push` printed here
mlflow_image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-mlflow@sha256:0000000000000000000000000000000000000000000000000000000000000000"
