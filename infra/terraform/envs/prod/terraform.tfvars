region        = "us-east-1"
azs           = ["us-east-1a", "us-east-1b", "us-east-1c"]
airflow_image = { repository = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-airflow", tag = "1.0.0" }
spark_image   = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-spark:1.0.0"
trainer_image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-trainer:1.0.0"
tags          = { Project = "llm-pipeline", Environment = "prod", ManagedBy = "terraform" }
# PLACEHOLDER digest: build infra/docker/mlflow.Dockerfile, push it, and put the digest `docker push` printed here
mlflow_image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-mlflow@sha256:0000000000000000000000000000000000000000000000000000000000000000"
