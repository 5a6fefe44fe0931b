# dev, AWS layer: small and cheap. Two AZs with one NAT gateway, a 1.2 TiB FSx at 125 MB/s/TiB, a single-AZ
# db.t4g.medium that can be destroyed, two system nodes, and a GPU group that scales 0..1 (g6e, no EFA);
# buckets may be force-destroyed.
module "stack_aws" {
  source                          = "../../../modules/stack_aws"
  name                            = "llmp-dev"
  region                          = var.region
  azs                             = var.azs
  kubernetes_version              = var.kubernetes_version
  endpoint_public_cidrs           = var.endpoint_public_cidrs
  single_nat_gateway              = true
  force_destroy_buckets           = true
  fsx_capacity_gib                = 1200
  fsx_throughput_per_tib          = 125
  system_nodes                    = { min = 2, desired = 2, max = 3 }
  gpu_instance_type               = "g6e.xlarge"
  gpu_efa_interfaces              = var.gpu_efa_interfaces
  gpu_capacity_type               = var.gpu_capacity_type
  create_autoscaling_service_role = var.create_autoscaling_service_role
  gpu_capacity_reservation_id     = var.gpu_capacity_reservation_id
  gpu_nodes                       = { min = 0, desired = 0, max = 1 }
  db_instance_class               = "db.t4g.medium"
  db_multi_az                     = false
  db_deletion_protection          = false
  admin_role_arns                 = var.admin_role_arns
  retention                       = var.retention
  tags                            = var.tags
}
