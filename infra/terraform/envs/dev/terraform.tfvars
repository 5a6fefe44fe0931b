region        = "us-east-1"
azs           = ["us-east-1a", "us-east-1b"]
airflow_image = { repository = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-airflow", tag = "dev" }
spark_image   = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-spark:dev"
trainer_image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm-pipeline-trainer:dev"
tags          = { Project = "llm-pipeline", Environment = "dev", ManagedBy = "terraform" }
