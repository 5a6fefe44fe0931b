# prod, AWS layer: three AZs with a NAT gateway each, a 9.6 TiB FSx at 500 MB/s/TiB, Multi-AZ RDS with deletion
# protection, and a p5.48xlarge fleet (8 × H100, 32 EFA each) in one cluster placement group.
module "stack_aws" {
  source                          = "../../../modules/stack_aws"
  name                            = "llmp-prod"
  region                          = var.region
  azs                             = var.azs
  kubernetes_version              = var.kubernetes_version
  endpoint_public_cidrs           = var.endpoint_public_cidrs
  single_nat_gateway              = false
  force_destroy_buckets           = false
  fsx_capacity_gib                = 9600
  fsx_throughput_per_tib          = 500
  system_nodes                    = { min = 3, desired = 3, max = 8 }
  gpu_instance_type               = "p5.48xlarge"
  gpu_efa_interfaces              = var.gpu_efa_interfaces
  gpu_capacity_type               = var.gpu_capacity_type
  create_autoscaling_service_role = var.create_autoscaling_service_role
  gpu_capacity_reservation_id     = var.gpu_capacity_reservation_id
  gpu_nodes                       = { min = 0, desired = 8, max = 16 }
  db_instance_class               = "db.r7g.large"
  db_multi_az                     = true
  db_deletion_protection          = true
  admin_role_arns                 = var.admin_role_arns
  retention                       = var.retention
  tags                            = var.tags
}
