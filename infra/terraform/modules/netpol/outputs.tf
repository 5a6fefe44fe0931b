output "policies" {
  description = "The NetworkPolicies by namespace."
  value = {
    for ns in distinct(values(var.namespaces)) : ns => sort(concat(
      [for p in kubernetes_network_policy_v1.default_deny : p.metadata[0].name if p.metadata[0].namespace == ns],
      [for p in kubernetes_network_policy_v1.dns_and_aws : p.metadata[0].name if p.metadata[0].namespace == ns],
    ))
  }
}
