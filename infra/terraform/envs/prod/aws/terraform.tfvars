region = "us-east-1"
azs    = ["us-east-1a", "us-east-1b", "us-east-1c"]
tags   = { Project = "llm-pipeline", Environment = "prod", ManagedBy = "terraform" }
