# Every provider here is configured from what exists before this root's plan: the AWS layer's state and the
# cluster it made, read by name (aws_eks_cluster). None depends on a resource of this root's own apply, so
# the first apply and a cluster replacement (re-apply ../aws, then this) plan with known values.
provider "aws" {
  region = local.aws.region
  default_tags {
    tags = var.tags
  }
}

data "aws_eks_cluster" "this" {
  name = local.aws.cluster_name
}

locals {
  cluster = {
    host                   = data.aws_eks_cluster.this.endpoint
    cluster_ca_certificate = base64decode(data.aws_eks_cluster.this.certificate_authority[0].data)
    # a fresh token per call (aws eks get-token): long Helm installs outlive a single 15-minute token
    token_args = ["eks", "get-token", "--cluster-name", data.aws_eks_cluster.this.name, "--region", local.aws.region]
  }
}

provider "kubernetes" {
  host                   = local.cluster.host
  cluster_ca_certificate = local.cluster.cluster_ca_certificate
  exec {
    api_version = "client.authentication.k8s.io/v1beta1"
    command     = "aws"
    args        = local.cluster.token_args
  }
}

provider "helm" {
  kubernetes {
    host                   = local.cluster.host
    cluster_ca_certificate = local.cluster.cluster_ca_certificate
    exec {
      api_version = "client.authentication.k8s.io/v1beta1"
      command     = "aws"
      args        = local.cluster.token_args
    }
  }
}
