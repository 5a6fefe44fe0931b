"""The GPU nodes' contract with what runs on them, checked where a cluster would decide it: NVIDIA's device plugin
(its chart's default node affinity, tests/contracts/nvidia-device-plugin-<version>.yaml, plus our nodeSelector and
tolerations) lands on the GPU node group Terraform makes, so ``nvidia.com/gpu`` is advertised; the training pods
that ``pipelines.cluster_config`` configures from that node group's outputs select it, tolerate its taint and ask
for no more GPUs than its instance type has; and a spec asking a node for more is refused by the launcher, exit 2.

Scheduling itself needs a cluster (no kube-scheduler here): the matching below is the scheduler's rule for node
selectors, required node affinity terms (OR of terms, AND within one) and taints/tolerations.

The GPU group sits at zero nodes between runs: cluster-autoscaler builds a template node from the group's
node-template tags (the AWS layer's ``terraform test`` asserts they equal the group's labels and taint) and the
instance type, and must be of the cluster's Kubernetes minor version and run as the account its IRSA role trusts."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import yaml

from conftest import ROOT

import test_terraform as tf

ADDONS = tf.TF / "modules/cluster_addons/main.tf"
PLUGIN_VERSION = re.search(r'resource "helm_release" "nvidia_device_plugin" \{[^}]*?version\s*=\s*"([^"]+)"',
                           ADDONS.read_text()).group(1)
PLUGIN = yaml.safe_load((ROOT / f"tests/contracts/nvidia-device-plugin-{PLUGIN_VERSION}.yaml").read_text())


EKS = tf.TF / "modules/eks/main.tf"


def gpu_group() -> dict:
    g = [b for f, t, n, b in tf.resources("aws_eks_node_group") if n == "gpu"][0]
    assert g["labels"] == "${local.gpu_labels}"  # the same labels are the autoscaler's node-template tags
    labels = {k: v for k, v in tf.local(EKS, "gpu_labels").items()
              if not v.startswith("${")}  # computed ones are not selectable
    taints = [{"key": t["key"], "value": t["value"], "effect": {"NO_SCHEDULE": "NoSchedule"}.get(t["effect"],
                                                                                                t["effect"])}
              for t in g["taint"]]
    return {"labels": labels, "taints": taints}


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    return any(t.get("key") == taint["key"] and t.get("effect", taint["effect"]) == taint["effect"]
               and (t.get("operator") == "Exists" or t.get("value") == taint["value"]) for t in tolerations)


def schedulable(labels: dict, taints: list[dict], selector: dict, tolerations: list[dict],
                affinity_terms: list[dict] | None = None) -> list[str]:
    """Why a pod would not be scheduled on such a node (empty: it would)."""
    why = [f"nodeSelector {k}={v}" for k, v in selector.items() if labels.get(k) != v]
    if affinity_terms and not any(all(labels.get(k) == v for k, v in term.items()) for term in affinity_terms):
        why.append(f"no required node affinity term matches (terms {affinity_terms})")
    why += [f"taint {t['key']}={t['value']}:{t['effect']} not tolerated" for t in taints if not tolerates(tolerations, t)]
    return why


def test_the_device_plugin_runs_on_the_gpu_node_group():
    node = gpu_group()
    values = tf.local(ADDONS, "gpu_nodes")  # what our helm_release gives the chart
    assert "affinity" not in values  # the chart's default affinity stays: our nodes must match it
    why = schedulable(node["labels"], node["taints"], values["nodeSelector"],
                      values["tolerations"] + PLUGIN["default_tolerations"], PLUGIN["affinity_terms"])
    assert not why, why
    # without the label NVIDIA's chart looks for (no node-feature-discovery here), the plugin would never run
    bare = {k: v for k, v in node["labels"].items() if k != "nvidia.com/gpu.present"}
    assert schedulable(bare, node["taints"], values["nodeSelector"], values["tolerations"], PLUGIN["affinity_terms"])


def _outputs(instance_type: str) -> dict:
    node = gpu_group()
    return {"node_groups": {"gpu": {"instance_types": [instance_type], "labels": node["labels"],
                                    "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}]}}}


def test_cluster_config_sizes_and_places_the_training_pods_for_the_node_group(tmp_path):
    from pipelines import cluster_config as cc
    from pipelines.spec import load_spec
    from pipelines.launch import k8s

    node = gpu_group()
    for itype, gpus in (("g6e.xlarge", 1), ("p5.48xlarge", 8)):
        out = {**_outputs(itype), "trainer_image": "x@sha256:" + "a" * 64, "pipeline_namespace": "llm-pipeline",
               "shared_fs_claim": "fsx", "gpu_efa_interfaces": 0, "region": "us-east-1",
               "service_accounts": {"trainer": "llm-pipeline:trainer", "spark": "llm-pipeline:spark"},
               "spark_master": "k8s://https://x", "spark_image": "x:1", "buckets": {"checkpoints": "c", "mlflow": "m"},
               "mlflow_tracking_uri": "http://mlflow.mlflow.svc.cluster.local:5000"}
        spec_file = tmp_path / f"{itype}.yaml"
        spec_file.write_text(yaml.safe_dump(cc.cluster_spec(out, yaml.safe_load(
            (ROOT / "configs/demo.yaml").read_text()))))
        spec = load_spec(spec_file, env={})
        assert spec.launcher.nproc_per_node == gpus and spec.launcher.service_account == "trainer"
        assert not spec.checkpoint.l0.startswith("/fsx") and k8s.node_local_l0(spec)  # L0 on the node's NVMe
        job = k8s.render_trainjob(spec, "r1", [])
        pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
            "template"]["spec"]["template"]["spec"]
        labels = {**node["labels"], "node.kubernetes.io/instance-type": itype}  # the kubelet's own label
        assert not schedulable(labels, node["taints"], pod["nodeSelector"], pod["tolerations"])
        assert job["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == gpus
    # outputs that are not the AWS layer's, or not of its shapes: one line each (exit 2 from the CLI), no traceback
    bad = [_outputs("x9.huge"), {"node_groups": ["gpu"]}, {"node_groups": {"gpu": "x"}},
           {"node_groups": {"gpu": {"instance_types": [["p5.48xlarge"]]}}},
           {"node_groups": {"gpu": {"instance_types": "p5.48xlarge"}}},
           {"node_groups": {"gpu": {"instance_types": ["p5.48xlarge"], "taints": ["x"]}}},
           {"node_groups": {"gpu": {"instance_types": ["p5.48xlarge"], "labels": ["x"]}}}]
    for outputs in bad:
        try:
            cc.gpu_nodes(outputs)
        except cc.WiringError as e:
            assert "\n" not in str(e)
        else:
            raise AssertionError(f"accepted {outputs}")


def test_the_launcher_refuses_more_gpus_per_node_than_the_instance_type_has(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "run": {"name": "gpus", "root": "/fsx/llm-pipeline/var/runs"}, "data": {"inputs": ["/fsx/in.jsonl"]},
        "launcher": {"kind": "trainjob", "nproc_per_node": 2,
                     "node_selector": {"node.kubernetes.io/instance-type": "g6e.xlarge"}}}))
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({}))
    r = subprocess.run([sys.executable, "-m", "pipelines.train.launch", "--spec", str(spec), "--tokenize-manifest",
                        str(manifest)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "g6e.xlarge has 1 GPU per node" in r.stderr and "Traceback" not in r.stderr


def test_the_cluster_autoscaler_matches_the_cluster_and_its_role():
    values = tf.local(ADDONS, "cluster_autoscaler_values")
    images = tf.local(ADDONS, "cluster_autoscaler_images")
    allowed = re.search(r'contains\((\[[^]]+\]), var\.kubernetes_version\)', (tf.TF / "modules/eks/variables.tf").read_text())
    # every Kubernetes version the cluster may run has an autoscaler image of the same minor version
    assert sorted(images) == sorted(json.loads(allowed.group(1)))
    assert all(tag.startswith(f"v{minor}.") for minor, tag in images.items()), images
    assert values["image"]["tag"] == "${local.cluster_autoscaler_images[var.kubernetes_version]}"
    # it runs as the service account the IRSA role trusts (modules/stack_aws), in the namespace the release is in
    trusted = tf.local(tf.TF / "modules/stack_aws/main.tf", "service_accounts")["cluster_autoscaler"]
    assert trusted == "kube-system:cluster-autoscaler"
    sa = values["rbac"]["serviceAccount"]
    assert sa["name"] == '${split(":", var.autoscaling.service_account)[1]}' and sa["create"] is True
    assert sa["annotations"] == {"eks.amazonaws.com/role-arn": "${var.autoscaling.role_arn}"}
    release = [b for f, t, n, b in tf.resources("helm_release") if n == "cluster_autoscaler"][0]
    assert release["namespace"] == '${split(":", var.autoscaling.service_account)[0]}'
    # auto-discovery by the cluster's name: the chart turns it into asg:tag=k8s.io/cluster-autoscaler/enabled,
    # k8s.io/cluster-autoscaler/<name>, the tags EKS puts on a managed node group's Auto Scaling group
    assert values["autoDiscovery"] == {"clusterName": "${var.autoscaling.cluster_name}"}
    assert values["cloudProvider"] == "aws" and values["nodeSelector"] == {"llm-pipeline/pool": "system"}
    # a node whose training pod keeps its L0 tier in an emptyDir is not drained to scale down
    assert values["extraArgs"]["skip-nodes-with-local-storage"] is True
