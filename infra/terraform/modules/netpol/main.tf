# Default deny, then the flows the pipeline needs. In every namespace: no ingress and no egress unless listed;
# DNS to kube-system. The flows:
#   airflow  → mlflow:5000             (register, tracking), airflow → RDS:5432 (its metadata database)
#   airflow ↔ pipeline                 (the Spark driver in the worker ↔ its executors; PyTorchJob submission
#                                       goes through the API server, below)
#   pipeline ↔ pipeline                (torchrun rendezvous, NCCL over TCP, Spark executors)
#   pipeline → mlflow:5000             (training and evaluation ranks log metrics)
#   mlflow   → RDS:5432                (backend and auth databases)
#   all three → TCP 443 anywhere        (S3, STS, ECR, the Kubernetes API: AWS endpoints have no fixed addresses)
#   airflow, pipeline → FSx for Lustre (TCP 988, 1018-1023 inside the VPC)
# NCCL over EFA bypasses the IP stack and these policies. Enforced by the VPC CNI (enableNetworkPolicy).

locals {
  all = var.namespaces
}

resource "kubernetes_network_policy_v1" "default_deny" {
  for_each = local.all
  metadata {
    name      = "default-deny"
    namespace = each.value
  }
  spec {
    pod_selector {}
    policy_types = ["Ingress", "Egress"]
  }
}

resource "kubernetes_network_policy_v1" "dns_and_aws" {
  for_each = local.all
  metadata {
    name      = "egress-dns-and-https"
    namespace = each.value
  }
  spec {
    pod_selector {}
    policy_types = ["Egress"]
    egress {
      to {
        namespace_selector {
          match_labels = { "kubernetes.io/metadata.name" = "kube-system" }
        }
      }
      ports {
        port     = "53"
        protocol = "UDP"
      }
      ports {
        port     = "53"
        protocol = "TCP"
      }
    }
    egress {
      to {
        ip_block {
          cidr = "0.0.0.0/0"
        }
      }
      ports {
        port     = "443"
        protocol = "TCP"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "mlflow_ingress" {
  metadata {
    name      = "mlflow-from-the-pipeline"
    namespace = local.all.mlflow
  }
  spec {
    pod_selector {
      match_labels = { app = "mlflow" }
    }
    policy_types = ["Ingress"]
    ingress {
      dynamic "from" {
        for_each = [local.all.airflow, local.all.pipeline]
        content {
          namespace_selector {
            match_labels = { "kubernetes.io/metadata.name" = from.value }
          }
        }
      }
      ports {
        port     = "5000"
        protocol = "TCP"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "to_mlflow" {
  for_each = { airflow = local.all.airflow, pipeline = local.all.pipeline }
  metadata {
    name      = "egress-mlflow"
    namespace = each.value
  }
  spec {
    pod_selector {}
    policy_types = ["Egress"]
    egress {
      to {
        namespace_selector {
          match_labels = { "kubernetes.io/metadata.name" = local.all.mlflow }
        }
        pod_selector {
          match_labels = { app = "mlflow" }
        }
      }
      ports {
        port     = "5000"
        protocol = "TCP"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "to_rds" {
  for_each = { airflow = local.all.airflow, mlflow = local.all.mlflow }
  metadata {
    name      = "egress-metadata-db"
    namespace = each.value
  }
  spec {
    pod_selector {}
    policy_types = ["Egress"]
    egress {
      dynamic "to" {
        for_each = var.private_subnet_cidrs
        content {
          ip_block {
            cidr = to.value
          }
        }
      }
      ports {
        port     = "5432"
        protocol = "TCP"
      }
    }
  }
}

# Inside each namespace (Airflow's components; the ranks and executors), and between airflow and pipeline
# (the Spark driver in an Airflow worker and its executors call each other on ports Spark picks).
resource "kubernetes_network_policy_v1" "peers" {
  for_each = { airflow = [local.all.airflow, local.all.pipeline], pipeline = [local.all.pipeline, local.all.airflow] }
  metadata {
    name      = "peers"
    namespace = local.all[each.key]
  }
  spec {
    pod_selector {}
    policy_types = ["Ingress", "Egress"]
    ingress {
      dynamic "from" {
        for_each = each.value
        content {
          namespace_selector {
            match_labels = { "kubernetes.io/metadata.name" = from.value }
          }
        }
      }
    }
    egress {
      dynamic "to" {
        for_each = each.value
        content {
          namespace_selector {
            match_labels = { "kubernetes.io/metadata.name" = to.value }
          }
        }
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "to_fsx" {
  for_each = { airflow = local.all.airflow, pipeline = local.all.pipeline }
  metadata {
    name      = "egress-fsx-lustre"
    namespace = each.value
  }
  spec {
    pod_selector {}
    policy_types = ["Egress"]
    egress {
      to {
        ip_block {
          cidr = var.vpc_cidr
        }
      }
      ports {
        port     = "988"
        protocol = "TCP"
      }
      ports {
        port     = "1018"
        end_port = 1023
        protocol = "TCP"
      }
    }
  }
}
