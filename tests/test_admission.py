"""Admission as the cluster decides a create (pipelines.launch.admission): metadata, the CRD's schema and CEL rules,
training-operator v1.8.1's PyTorchJob webhook and Trainer v2.3.0's TrainJob webhook. Every rule has a job that
breaks it and the line naming it; the launcher's own jobs pass; the CLI exits 2 with the rule's line."""
import copy
import re

import pytest
import yaml

from pipelines.manifest import StageDir
from pipelines.spec import load_spec
from pipelines.launch import admission
from pipelines.launch import k8s
from pipelines.train import k8s as k8s_cli

from conftest import ROOT, SHARED

TRAINJOB_CRD = k8s.DEFAULT_CRDS["trainjob"]
PYTORCHJOB_CRD = k8s.DEFAULT_CRDS["pytorchjob"]  # the v1.8.1 CRD shipped in infra/k8s/crds (what Terraform installs)
NAME_RULE = "CEL rule: self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')"


def pytorchjob_crd():
    return PYTORCHJOB_CRD


def trainjob(run_name="llm-pipeline"):
    return k8s.render_trainjob(load_spec(None, ["launcher.kind=trainjob", f"run.name={run_name}"], env={}), "r", [])


def pytorchjob(*sets):
    return k8s.render_pytorchjob(load_spec(None, ["launcher.kind=pytorchjob", *sets], env={}), "r", [])


def errors(job, crd=None):
    return [str(r) for r in admission.refusals(job, crd)]


def one(errs, *parts):
    """The single error line holding every part (a field path, a message, a rule)."""
    hits = [e for e in errs if all(p in e for p in parts)]
    assert len(hits) == 1, (parts, errs)
    return hits[0]


# ---- the launcher's own jobs pass, and job names are DNS-1035 labels

@pytest.mark.parametrize("cfg, sets", [
    (None, ["launcher.kind=trainjob"]),
    (None, ["launcher.kind=pytorchjob"]),
    (None, ["launcher.kind=pytorchjob", "launcher.nnodes=4", "launcher.min_nodes=2"]),  # elastic
    ("configs/llama3_8b.yaml", ["launcher.kind=trainjob", "launcher.min_nodes=null"]),
    ("configs/llama3_70b.yaml", []),  # elastic, 8 nodes
])
def test_the_rendered_jobs_pass_schema_cel_and_webhook(cfg, sets):
    spec = load_spec(cfg, sets, env={})
    job = k8s.RENDER[spec.launcher.job_kind](spec, "Run_42", ["--spec", "/fsx/s.yaml"])
    crd = TRAINJOB_CRD if job["kind"] == "TrainJob" else pytorchjob_crd()
    assert k8s.validate_job(job, crd, spec) == []
    assert k8s.validate_job(job, None, spec) == []  # webhook and metadata rules alone
    k8s.check_job(job, spec)  # the launcher's gate: no raise


def test_the_elastic_pytorchjob_sets_nprocpernode_once_as_v181s_webhook_requires():
    spec = load_spec("configs/llama3_70b.yaml", env={})
    job = k8s.render_pytorchjob(spec, "r", [])
    assert job["spec"]["nprocPerNode"] == "8" and job["spec"]["elasticPolicy"] == {
        "rdzvBackend": "c10d", "minReplicas": 6, "maxReplicas": 8, "maxRestarts": spec.launcher.max_restarts}
    job["spec"]["elasticPolicy"]["nProcPerNode"] = 8  # what the launcher rendered before
    one(errors(job), "spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode",
        "training-operator v1.8.1 webhook: elasticPolicy.nProcPerNode xor nprocPerNode")
    del job["spec"]["nprocPerNode"]  # the deprecated field alone is allowed (a warning)
    assert errors(job) == []


@pytest.mark.parametrize("run_name, run_id, want", [
    ("7b-run", "train-0a1b2c3d", "r-7b-run-train-0a1b2c3d"),
    ("My_Run.v2", "R", "my-run-v2-r"),
    ("llm-pipeline", "Run_42", "llm-pipeline-run-42"),
    ("_._", "", "r"),
])
def test_job_names_are_dns_1035_labels(run_name, run_id, want):
    for kind in ("trainjob", "pytorchjob"):
        assert k8s.job_name(load_spec(None, [f"launcher.kind={kind}", f"run.name={run_name}"], env={}), run_id) == want


def test_a_long_name_is_cut_to_the_limit_with_a_digest_that_keeps_runs_apart():
    spec = load_spec(None, ["launcher.kind=pytorchjob", "run.name=9b" + "x" * 70], env={})
    a, b = k8s.job_name(spec, "train-aaaa"), k8s.job_name(spec, "train-bbbb")
    assert a != b and len(a) == len(b) == k8s.NAME_LIMIT <= 63
    assert all(admission.DNS1035_LABEL.fullmatch(n) for n in (a, b)) and a.startswith("r-9bxxx")
    assert errors(pytorchjob("run.name=9b" + "x" * 70)) == []


# ---- what the API server checks on every object

def test_metadata_rules_of_the_api_server():
    job = trainjob()
    job["metadata"].update(name="Bad_Name", namespace="LLM", labels={"bad key!": "x", "ok": "not ok!"})
    errs = errors(job)
    one(errs, "metadata.name: 'Bad_Name': must be a lowercase RFC 1123 subdomain", "[API server: object name]")
    one(errs, "metadata.namespace: 'LLM'", "[API server: namespace]")
    one(errs, "metadata.labels[bad key!]: not a valid label key", "[API server: label key]")
    one(errs, "metadata.labels[ok]: 'not ok!' is not a valid label value", "[API server: label value]")


# ---- the CRD: schema, CEL rules

def test_the_trainjob_crds_cel_rules_refuse_what_the_api_server_refuses():
    job = trainjob()
    job["metadata"]["name"] = "7b-run-train-0a1b2c3d"  # what job_name gave before
    one(errors(job, TRAINJOB_CRD), "<root>: metadata.name must match RFC 1035 DNS label format", NAME_RULE)
    job["metadata"]["name"] = "a" * 64
    one(errors(job, TRAINJOB_CRD), "<root>: metadata.name must be no more than 63 characters",
        "CEL rule: size(self.metadata.name) <= 63")
    job = trainjob()
    job["spec"]["managedBy"] = "someone.example/controller"
    one(errors(job, TRAINJOB_CRD), "spec.managedBy: ManagedBy must be trainer.kubeflow.org/trainjob-controller",
        "CEL rule: self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']")
    job = trainjob()
    job["spec"]["initializer"] = {"dataset": {"storageUri": "not a uri"}}
    one(errors(job, TRAINJOB_CRD), "spec.initializer.dataset.storageUri: storageUri may be empty, or it must be a "
        "valid URI", "CEL rule: self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')")


def test_transition_rules_are_skipped_on_create_and_every_shipped_rule_evaluates():
    """runtimeRef, managedBy and the runtime patches carry `self == oldSelf` (updates only): a create passes them.
    Every rule of the shipped CRDs compiles with cel-python."""
    job = trainjob()
    assert "oldSelf" in TRAINJOB_CRD.read_text() and errors(job, TRAINJOB_CRD) == []
    for path in [TRAINJOB_CRD, *sorted((SHARED / "k8s").glob("*.yaml"))]:
        for rule in re.findall(r"^\s*rule: (.+)$", path.read_text(), re.M):
            admission._program(rule)  # CELParseError if cel-python could not read it


def test_the_crd_schema_refuses_a_wrong_type_and_names_the_field():
    job = trainjob()
    job["spec"]["trainer"]["numNodes"] = "three"
    one(errors(job, TRAINJOB_CRD), "spec.trainer.numNodes: 'three' is not of type 'integer'", "[CRD schema]")


SYNTHETIC_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "spec": {"names": {"kind": "Widget"}, "versions": [{"name": "v1alpha1", "subresources": {"status": {}}, "schema": {
        "openAPIV3Schema": {"type": "object", "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
            "status": {"type": "object", "x-kubernetes-validations": [{"rule": "false", "message": "never runs"}]},
            "spec": {"type": "object", "x-kubernetes-validations": [
                {"rule": "self.retries <= 3", "messageExpression": "'retries is ' + string(self.retries)"},
                {"rule": "self.__dash__name == self.__dash__name.lowerAscii()", "fieldPath": ".-name",
                 "message": "lowercase only"},
                {"rule": "self.start < timestamp('2030-01-01T00:00:00Z')"}],
                "properties": {
                    "retries": {"type": "integer", "default": 5}, "-name": {"type": "string"},
                    "start": {"type": "string", "format": "date-time"},
                    "tags": {"type": "array", "items": {"type": "string", "x-kubernetes-validations": [
                        {"rule": "self.startsWith('t-')", "message": "a tag starts with t-"}]}},
                    "limits": {"type": "object", "additionalProperties": {"type": "integer",
                               "x-kubernetes-validations": [{"rule": "self > 0", "message": "positive"}]}},
                    "bad": {"type": "string", "x-kubernetes-validations": [{"rule": "self.noSuchFunction()"}]}}}}}}}]}}


def test_cel_rules_at_every_level_with_kubernetes_semantics(tmp_path):
    """`self` bound at each level (object, property, array item, map value); defaults applied before the rules;
    messageExpression and fieldPath; property names escaped (`-name` is `__dash__name`); date-time strings are
    timestamps; the k8s string library (lowerAscii); status dropped on create; an unevaluable rule refuses."""
    crd = tmp_path / "crd.yaml"
    crd.write_text(yaml.safe_dump(SYNTHETIC_CRD))
    job = {"apiVersion": "example.com/v1alpha1", "kind": "Widget", "metadata": {"name": "ok"},
           "status": {}, "spec": {"-name": "Mixed", "start": "2031-05-01T00:00:00Z", "tags": ["t-a", "b"],
                                  "limits": {"gpu": 0, "cpu": 2}, "bad": "x"}}
    errs = [e for e in errors(job, crd) if "[CEL rule" in e]
    one(errs, "spec: retries is 5", "[CEL rule: self.retries <= 3]")  # the default, 5, was applied
    one(errs, "spec.-name: lowercase only", "lowerAscii")
    one(errs, "spec: failed rule: self.start < timestamp('2030-01-01T00:00:00Z')")
    one(errs, "spec.tags[1]: a tag starts with t-")
    one(errs, "spec.limits.gpu: positive")
    one(errs, "spec.bad: rule could not be evaluated", "self.noSuchFunction()")
    assert len(errs) == 6, errs  # tags[0], limits.cpu and the status rule pass or do not run
    job["spec"].update({"-name": "lower", "start": "2029-01-01T00:00:00Z", "tags": ["t-a"], "limits": {"cpu": 1},
                        "retries": 3})
    del job["spec"]["bad"]
    assert errors(job, crd) == []


# ---- training-operator v1.8.1's PyTorchJob CRD, shipped (infra/k8s/crds) and checked by default

VENDORED_PYTORCHJOB_CRD = ROOT / "infra/k8s/crds/kubeflow.org_pytorchjobs.yaml"


def test_the_shipped_pytorchjob_crd_is_v181s_as_recorded_and_as_terraform_installs():
    """The default PyTorchJob CRD is the vendored file, byte for byte the one SOURCES.md records (sha256, commit) and
    the one the training-operator chart installs (charts/training-operator/crds, the commit in its Chart.yaml)."""
    import hashlib

    assert k8s.DEFAULT_CRDS["pytorchjob"] == VENDORED_PYTORCHJOB_CRD and VENDORED_PYTORCHJOB_CRD.is_file()
    data = VENDORED_PYTORCHJOB_CRD.read_bytes()
    sources = (ROOT / "infra/k8s/crds/SOURCES.md").read_text()
    (row,) = [line for line in sources.splitlines() if line.startswith("| `kubeflow.org_pytorchjobs.yaml`")]
    assert f"sha256 `{hashlib.sha256(data).hexdigest()}`" in row
    chart = ROOT / "infra/terraform/modules/cluster_addons/charts/training-operator"
    commit = yaml.safe_load((chart / "Chart.yaml").read_text())["annotations"]["upstream-commit"]
    assert commit in row and "v1.8.1" in row
    assert (chart / "crds/kubeflow.org_pytorchjobs.yaml").read_bytes() == data
    crd = yaml.safe_load(data)
    assert crd["spec"]["names"]["kind"] == "PyTorchJob" and [v["name"] for v in crd["spec"]["versions"]] == ["v1"]


@pytest.mark.parametrize("sets", [
    ["launcher.nnodes=2"],
    ["launcher.nnodes=4", "launcher.min_nodes=2"],  # elastic
    ["launcher.nnodes=1", "checkpoint.l0=/local/ckpt"],  # node-local L0: a hostPath/emptyDir volume
])
def test_the_default_rendered_pytorchjob_passes_the_v181_crd(sets):
    spec = load_spec(None, ["launcher.kind=pytorchjob", *sets], env={})
    job = k8s.stage_job(spec, "Run_42", "pipelines.train.trainer", ["--spec", "/fsx/s.yaml"])
    assert ("elasticPolicy" in job["spec"]) == (spec.launcher.min_nodes is not None)
    assert errors(job, VENDORED_PYTORCHJOB_CRD) == []
    k8s.check_job(job, spec)  # the default gate (the shipped CRD): no raise


def test_the_pytorchjob_crd_schema_refuses_a_wrong_type_the_webhook_lets_through():
    job = pytorchjob("launcher.nnodes=2")
    job["spec"]["nprocPerNode"] = 8  # a string in v1.8.1's schema ("auto", "gpu", "8")
    job["spec"]["runPolicy"] = {"backoffLimit": "three"}
    assert errors(job) == []  # the webhook alone does not look at types
    errs = errors(job, VENDORED_PYTORCHJOB_CRD)
    one(errs, "spec.nprocPerNode: 8 is not of type 'string'", "[CRD schema]")
    one(errs, "spec.runPolicy.backoffLimit: 'three' is not of type 'integer'", "[CRD schema]")
    assert len(errs) == 2, errs


def test_the_cli_refuses_a_pytorchjob_the_v181_schema_refuses_by_default(home, capsys, monkeypatch):
    """No --crd: the shipped PyTorchJob CRD applies; the CLI exits 2 with the schema's line. The same job with a CRD
    that leaves nprocPerNode untyped is printed (so the shipped CRD is what refused it)."""
    tok = _tokenize_manifest(home)
    render = k8s.RENDER["pytorchjob"]

    def wrong_type(*a, **kw):
        job = render(*a, **kw)
        job["spec"]["nprocPerNode"] = int(job["spec"]["nprocPerNode"])
        return job

    monkeypatch.setitem(k8s.RENDER, "pytorchjob", wrong_type)
    base = [str(ROOT / "configs/llama3_8b.yaml"), "--tokenize-manifest", tok.path, "--set", "launcher.kind=pytorchjob",
            "--set", "launcher.min_nodes=null"]
    assert k8s_cli.main(base) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("k8s: the cluster would refuse PyTorchJob llm-pipeline/"), line
    one([line], "spec.nprocPerNode: 8 is not of type 'string'", "[CRD schema]")
    loose = yaml.safe_load(VENDORED_PYTORCHJOB_CRD.read_text())
    spec_props = loose["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    spec_props["nprocPerNode"].pop("type")
    (home / "loose.yaml").write_text(yaml.safe_dump(loose))
    rc, out = k8s_cli.main([*base, "--crd", str(home / "loose.yaml")]), capsys.readouterr()
    assert rc == 0, out.err
    assert yaml.safe_load(out.out)["spec"]["nprocPerNode"] == 8


# ---- training-operator v1.8.1's PyTorchJob webhook

def test_the_pytorchjob_webhook_refuses_a_name_that_is_no_dns_1035_label():
    job = pytorchjob()
    job["metadata"]["name"] = "7b-run-train-0a1b2c3d"
    one(errors(job), "metadata.name: '7b-run-train-0a1b2c3d' should match: a DNS-1035 label must consist of",
        "[training-operator v1.8.1 webhook: NameIsDNS1035Label]")
    job["metadata"]["name"] = "a" * 64
    one(errors(job), "must be no more than 63 characters", "NameIsDNS1035Label")


@pytest.mark.parametrize("breaks, line", [
    (lambda s: s.pop("pytorchReplicaSpecs"), "spec.pytorchReplicaSpecs: Required value: must be required"),
    (lambda s: s["pytorchReplicaSpecs"].update(Chief=copy.deepcopy(s["pytorchReplicaSpecs"]["Worker"])),
     'spec.pytorchReplicaSpecs[Chief]: Unsupported value: "Chief": supported values: "Master", "Worker"'),
    (lambda s: _pod(s, "Worker").update(containers=[]),
     "spec.pytorchReplicaSpecs[Worker].template.spec.containers: Required value: must be specified"),
    (lambda s: _pod(s, "Master")["containers"][0].update(image=""),
     "spec.pytorchReplicaSpecs[Master].template.spec.containers[0].image: Required value: must be required"),
    (lambda s: _pod(s, "Worker")["containers"][0].update(name="main"),
     "spec.pytorchReplicaSpecs[Worker].template.spec.containers: Required value: must have at least one container "
     "with name pytorch"),
    (lambda s: s["pytorchReplicaSpecs"]["Master"].update(replicas=2),
     "spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1"),
])
def test_the_pytorchjob_webhooks_replica_rules(breaks, line):
    job = pytorchjob("launcher.nnodes=2")
    breaks(job["spec"])
    one(errors(job), line, "[training-operator v1.8.1 webhook: validatePyTorchReplicaSpecs]")


def _pod(spec, role):
    return spec["pytorchReplicaSpecs"][role]["template"]["spec"]


# ---- Trainer v2.3.0's TrainJob webhook

def _patch(job):
    return job["spec"]["runtimePatches"][0]


def _node(job):
    (node,) = _patch(job)["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    return node


@pytest.mark.parametrize("breaks, line, rule", [
    (lambda j: j["spec"]["runtimeRef"].update(kind="MyRuntime"),
     "spec.runtimeRef: unsupported runtime: MyRuntime.trainer.kubeflow.org", "runtime registry"),
    (lambda j: j["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "9"}),
     "spec.trainer.env: must not have reserved envs, invalid envs configured: ['PET_NNODES']", "torch plugin"),
    (lambda j: _patch(j).update(manager="llm-pipeline"),
     "spec.runtimePatches[0].manager: 'llm-pipeline': must be a domain-prefixed path",
     "jobset plugin IsDomainPrefixedPath"),
    (lambda j: _node(j).update(name="launcher"), "spec.runtimePatches[0]: must not have replicated job that doesn't "
     "exist in the runtime job template ('launcher')", "jobset plugin"),
    (lambda j: _node(j)["template"]["spec"]["template"]["spec"]["containers"].append({"name": "sidecar"}),
     "spec.runtimePatches[0]: must not have container that doesn't exist in the runtime job node ('sidecar')",
     "jobset plugin"),
    (lambda j: _node(j)["template"]["spec"]["template"]["spec"]["containers"][0].update(env=[{"name": "A"}]),
     "spec.runtimePatches[0]: must not have envs for the dataset-initializer, model-initializer, node containers",
     "jobset plugin"),
    (lambda j: j["spec"].update(initializer={"model": {"storageUri": "hf://x"}}),
     "spec.runtimeRef: must have model-initializer job when trainJob is configured with input modelConfig",
     "jobset plugin"),
])
def test_the_trainjob_webhooks_rules(breaks, line, rule):
    job = trainjob()
    breaks(job)
    one(errors(job, TRAINJOB_CRD), line, f"[Trainer v2.3.0 webhook: {rule}")


# ---- the launcher: the CLI and the submit path

def _tokenize_manifest(home):
    sd = StageDir(home / "var/runs", "tokenize", "test", [{"uri": "x", "sha256": "0"}])
    with sd:
        (sd.tmp / "shards").mkdir()
        return sd.commit({"shards": "shards"})


def test_the_cli_prints_an_accepted_job_for_a_run_name_starting_with_a_digit(home, capsys):
    tok = _tokenize_manifest(home)
    for kind in ("trainjob", "pytorchjob"):
        rc = k8s_cli.main([str(ROOT / "configs/llama3_8b.yaml"), "--tokenize-manifest",
                       tok.path, "--set", "run.name=7b-run", "--set", f"launcher.kind={kind}",
                       "--set", "launcher.min_nodes=null"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        name = yaml.safe_load(out.out)["metadata"]["name"]
        assert re.fullmatch(r"r-7b-run-train-[0-9a-f]{8}", name), name


def test_the_cli_exits_2_with_one_line_per_rule_the_job_breaks(home, capsys):
    tok = _tokenize_manifest(home)
    base = [str(ROOT / "configs/llama3_70b.yaml"), "--tokenize-manifest", tok.path]
    assert k8s_cli.main([*base, "--set", "launcher.image="]) == 2  # a PyTorchJob without an image
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert all(line.startswith("k8s: the cluster would refuse PyTorchJob llm-pipeline/") for line in err)
    one(err, "spec.pytorchReplicaSpecs[Master].template.spec.containers[0].image: Required value",
        "[training-operator v1.8.1 webhook: validatePyTorchReplicaSpecs]")
    one(err, "spec.pytorchReplicaSpecs[Worker].template.spec.containers[0].image")
    assert k8s_cli.main([*base, "--set", "launcher.kind=trainjob", "--set", "launcher.min_nodes=null",
                     "--set", "launcher.namespace=Team_A"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("k8s: the cluster would refuse TrainJob Team_A/") and "[API server: namespace]" in line
    assert k8s_cli.main([*base, "--crd", str(home / "missing.yaml")]) == 2
    assert "--crd" in capsys.readouterr().err
    # a CRD of the other kind, or a file that is no CRD: the user's to fix (exit 2, one line), never a traceback
    assert k8s_cli.main([*base, "--crd", str(k8s.DEFAULT_CRDS["trainjob"])]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("k8s: error: --crd: ") and "defines TrainJob, not PyTorchJob" in line, line
    (home / "not-a-manifest.json").write_text("root:x:0:0:root:/root:/bin/bash\n")
    assert k8s_cli.main([base[0], "--tokenize-manifest", str(home / "not-a-manifest.json")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("k8s: error: "), line
    (home / "junk.yaml").write_text("a: [unclosed\n")
    assert k8s_cli.main([*base, "--crd", str(home / "junk.yaml")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "is not a readable CustomResourceDefinition" in line, line


def test_the_submit_path_refuses_before_it_reaches_the_api_server(home):
    """run_job checks the job first: a refused one raises with the rule (the train stage's TrainError, exit 2)
    before any credentials are loaded (this kubeconfig does not exist)."""
    from pipelines.launch import ranks

    spec = load_spec(None, ["launcher.kind=trainjob", f"launcher.kubeconfig={home / 'no-kubeconfig'}",
                            "launcher.namespace=Team_A"], env={})
    with pytest.raises(k8s.JobFailed, match=r"^the cluster would refuse TrainJob Team_A/\S+: metadata\.namespace: "
                       r".*\[API server: namespace\]$"):
        k8s.run_job(spec, "unit", "pipelines.train.trainer", [])
    with pytest.raises(ranks.TrainError, match=r"would refuse TrainJob .*\[API server: namespace\]"):
        ranks.run_ranks(spec, "pipelines.train.trainer", [], run_id="unit")
