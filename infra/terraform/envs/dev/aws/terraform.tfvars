region = "us-east-1"
azs    = ["us-east-1a", "us-east-1b"]
tags   = { Project = "llm-pipeline", Environment = "dev", ManagedBy = "terraform" }
