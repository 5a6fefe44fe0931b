"""The GPU nodes' contract with what runs on them, checked where a cluster would decide it: NVIDIA's device plugin
(its chart's default node affinity, tests/contracts/nvidia-device-plugin-<version>.yaml, plus our nodeSelector and
tolerations) lands on the GPU node group Terraform makes, so ``nvidia.com/gpu`` is advertised; the training pods
that ``pipelines.cluster_config`` configures from that node group's outputs select it, tolerate its taint and ask
for no more GPUs than its instance type has; and a spec asking a node for more is refused by the launcher, exit 2.

Scheduling itself needs a cluster (no kube-scheduler here): the matching below is the scheduler's rule for node
selectors, required node affinity terms (OR of terms, AND within one) and taints/tolerations."""
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


def gpu_group() -> dict:
    g = [b for f, t, n, b in tf.resources("aws_eks_node_group") if n == "gpu"][0]
    labels = {k: v for k, v in g["labels"].items() if not v.startswith("${")}  # computed ones are not selectable
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
    from pipelines.train import k8s

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
