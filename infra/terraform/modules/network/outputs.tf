output "vpc_id" {
  description = "Id of the VPC."
  value       = aws_vpc.this.id
}

output "vpc_cidr" {
  description = "VPC CIDR block (security groups allow intra-VPC traffic from it)."
  value       = aws_vpc.this.cidr_block
}

output "private_subnet_ids" {
  description = "Private subnets, one per AZ in var.azs order (nodes, FSx, RDS)."
  value       = aws_subnet.private[*].id
}

output "public_subnet_ids" {
  description = "Public subnets (NAT gateways, internet-facing load balancers)."
  value       = aws_subnet.public[*].id
}

output "s3_endpoint_id" {
  description = "S3 gateway endpoint id (bucket policies may pin access to it)."
  value       = aws_vpc_endpoint.s3.id
}

output "private_subnet_cidrs" {
  description = "CIDR blocks of the private subnets (where the nodes and their pods live): RDS admits only these."
  value       = aws_subnet.private[*].cidr_block
}
