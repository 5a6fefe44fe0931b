region        = "us-east-1"
azs           = ["us-east-1a", "us-east-1b"]
airflow_image = { repository = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-airflow", tag = "dev" }
spark_image   = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-spark:dev"
trainer_image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-trainer:dev"
tags          = { Project = "llm-pipeline", Environment = "dev", ManagedBy = "terraform" }
# PLACEHOLDER digest: build infra/docker/mlflow.Dockerfile, push it, and put the digest `docker push` printed here
mlflow_image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-mlflow@sha256:0000000000000000000000000000000000000000000000000000000000000000"
