"""The Kubernetes launcher: the real kubernetes client against an API server stand-in on loopback
(``fake_kube``; no cluster can run here), whose "operator" runs the job's real torchrun command."""
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipelines.data import tokenize
from pipelines.spec import load_spec
from pipelines.launch import k8s
from pipelines.train import k8s as k8s_cli
from pipelines.launch import ranks
from pipelines.train import launch

from conftest import ROOT, SHARED, c4_docs
from fake_kube import FakeKube
from test_tokenize import _filter_manifest

CRD = SHARED / "k8s" / "kubeflow.org_pytorchjobs.yaml"
TINY = ["tokenizer.vocab_size=500", "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=32",
        "train.steps=6", "train.micro_batch=4", "train.warmup_steps=2", "train.ckpt_every=6", "train.lr=0.01",
        "train.log_every=3", "launcher.nproc_per_node=2"]


@pytest.fixture
def kube(home):
    fake = FakeKube(crds={"PyTorchJob": CRD if CRD.exists() else None, "TrainJob": k8s.DEFAULT_CRDS["trainjob"]})
    yield fake, fake.kubeconfig(home / "kubeconfig")
    fake.close()


def kube_sets(home, kubeconfig, *more, kind="trainjob"):
    return [*TINY, f"launcher.kind={kind}", f"launcher.kubeconfig={kubeconfig}", f"launcher.shared_fs_mount={home}",
            "launcher.poll_seconds=0.3", "launcher.timeout_minutes=15", *more]


COLLECTION = {"trainjob": "/apis/trainer.kubeflow.org/v1alpha1/namespaces/llm-pipeline/trainjobs",
              "pytorchjob": "/apis/kubeflow.org/v1/namespaces/llm-pipeline/pytorchjobs"}
STATES = {"trainjob": ("submitted", "Pending [node: active 1]", "Succeeded [node: succeeded 1]"),
          "pytorchjob": ("submitted", "Created", "Running [Master: active 1]", "Succeeded [Master: succeeded 1]")}


def test_preflight_measures_again_on_each_dag_run_and_a_retry_collects_its_own_job(home, kube, monkeypatch):
    """Preflight's job and its report were named by the stage key alone: a later DAG run with the same spec found
    the earlier run's Succeeded job (jobs have no TTL), adopted it and committed its old measurements as today's.
    Now each DAG run launches its own job (a retry or a deferred task's resume of the same run collects it), in a
    work dir of its own."""
    from pipelines.train import preflight

    fake, cfg = kube
    docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(c4_docs(120))]
    spec = load_spec(None, kube_sets(home, cfg), env={})
    tok = tokenize.run(spec, _filter_manifest(home, docs))
    monkeypatch.setenv("AIRFLOW_CTX_DAG_ID", "llm_pipeline")
    monkeypatch.setenv("AIRFLOW_CTX_DAG_RUN_ID", "scheduled__2026-11-30")
    first = preflight.run(spec, tok, straggler_factor=1e9)  # measured, whatever the shared machine's pace
    assert len(fake.jobs) == 1
    again = preflight.run(spec, tok, straggler_factor=1e9)  # the same DAG run's retry: its job, collected again
    assert len(fake.jobs) == 1 and again.metrics == first.metrics
    monkeypatch.setenv("AIRFLOW_CTX_DAG_RUN_ID", "scheduled__2026-12-01")
    preflight.run(spec, tok, straggler_factor=1e9)
    assert len(fake.jobs) == 2  # a job of its own, which ran the checks again
    work = {n: (c := k8s._commands(j.obj)[0])[c.index("--rank-out") + 1] for (_, n), j in fake.jobs.items()}
    assert len(set(work.values())) == 2, work  # each in its own work dir


def test_train_stage_submits_a_training_job_watches_it_and_matches_the_local_run(home, kube, capsys, kind="trainjob"):
    fake, cfg = kube
    docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(c4_docs(120))]
    spec_k = load_spec(None, kube_sets(home, cfg, kind=kind), env={})
    tok = tokenize.run(spec_k, _filter_manifest(home, docs))
    m = launch.run(spec_k, tok)
    out = capsys.readouterr().out
    assert m.stage == "train" and m.extra["world_size"] == 2 and m.counts["steps"] == 6
    # the job went through the API server: created once, polled, never deleted
    posts = [p for verb, p in fake.requests if verb == "POST"]
    assert posts == [COLLECTION[kind]]
    (ns, name), = fake.jobs
    job = fake.jobs[(ns, name)].obj
    cmd = k8s._commands(job)[0]
    assert cmd[:2] == ["torchrun", "--max-restarts"] and "pipelines.train.trainer" in cmd
    assert k8s.job_state(job)[0] == "Succeeded"
    # state changes and every replica's log, with its pod, reached stdout (the Airflow task log)
    for s in STATES[kind]:
        assert f"{kind} llm-pipeline/{name}: {s}" in out, out[-3000:]
    assert f"[{fake.jobs[(ns, name)].pod}] " in out
    # the ranks' lineage token is the stage's launch, not the job object: a job re-created for a retry is the same
    # launch (train.resume=never starts over once, not at every new job), one with another train.resume a new one
    from pipelines.train.job import train_job

    token = fake.jobs[(ns, name)].command_and_env()[1]["LLMP_RUN_TOKEN"]
    launched = train_job(spec_k, tok)
    assert token == launched.token == f"{launched.run_id}:{m.extra['checkpoint'].rsplit('/', 1)[0]}"
    # `python -m pipelines.train.k8s SPEC --tokenize-manifest M` prints exactly the job the stage submitted
    spec_file = home / "spec-k.yaml"
    spec_file.write_text(spec_k.to_yaml())
    assert k8s_cli.main([str(spec_file), "--tokenize-manifest", tok.path]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["metadata"]["name"] == name and printed["spec"] == job["spec"]
    assert k8s_cli.main([str(spec_file), "--tokenize-manifest", tok.path, "--run-id", "R"]) == 0
    text = capsys.readouterr().out
    assert yaml.safe_load(text)["metadata"]["name"].endswith("-r")
    assert f"R:{launched.rel_root}" in text and token not in text  # its own launch: another job's token
    other = {"trainjob": "pytorchjob", "pytorchjob": "trainjob"}[kind]
    assert k8s_cli.main([str(spec_file), "--tokenize-manifest", tok.path, "--set", f"launcher.kind={other}"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == {"trainjob": "TrainJob", "pytorchjob": "PyTorchJob"}[other]
    # the same job spec on the local launcher gives the same loss curve
    local = launch.run(load_spec(None, TINY, env={}), tok)
    curve = lambda mm: [loss for _, loss in json.loads(mm.output("losses").read_text())]  # noqa: E731
    np.testing.assert_allclose(curve(m), curve(local), rtol=0, atol=1e-6)


def test_a_pytorchjob_goes_the_same_way_with_its_own_states_pods_and_path(home, kube):
    """The v1 job through the same submit / watch: its collection, its conditions and replica counts, its master
    pod's log (the full train stage runs as a TrainJob above; the launcher's path is one for both kinds)."""
    fake, cfg = kube
    spec = load_spec(None, kube_sets(home, cfg, kind="pytorchjob"), env={})
    custom, core = k8s.api_clients(spec)
    lines, seen = [], home / "running-seen"

    def log(line: str) -> None:  # the rank ends once the watch has said Running: seen however slow the machine
        lines.append(line)
        if ": Running" in line:
            seen.touch()

    rank0 = [sys.executable, "-c", "import os, time\nfor _ in range(1200):\n    if os.path.exists("
             f"{str(seen)!r}):\n        break\n    time.sleep(0.1)\nprint('hello from rank 0')"]
    assert k8s.submit(custom, _job(spec, rank0), log) == "created"
    done = k8s.watch(custom, core, k8s.PYTORCHJOB, "llm-pipeline", "llm-pipeline-unit", 0.2, 300, log)
    assert k8s.job_state(done)[0] == "Succeeded"
    assert ("POST", COLLECTION["pytorchjob"]) in fake.requests
    for s in STATES["pytorchjob"][1:]:
        assert any(line.endswith(f"llm-pipeline-unit: {s}") or f"llm-pipeline-unit: {s}:" in line for line in lines), lines
    assert "[llm-pipeline-unit-master-0] hello from rank 0" in lines


def test_a_failed_job_fails_the_stage_with_the_masters_last_log_lines(home, kube):
    fake, cfg = kube
    docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(c4_docs(120))]
    # launcher.max_restarts=0: torchrun would otherwise start the failing ranks again (and on CPU with gloo and
    # the static rendezvous the restarted ranks hang in init_process_group: seen here with torch 2.13)
    spec = load_spec(None, kube_sets(home, cfg, "model.vocab_size=100", "launcher.max_restarts=0"), env={})
    tok = tokenize.run(spec, _filter_manifest(home, docs))
    with pytest.raises(ranks.TrainError, match=r"(?s)TrainJob llm-pipeline/\S+ failed: jobset failed: node exited "
                       r"with code 1.*errors in the pods' logs:\n  ValueError: "
                       r"model\.vocab_size=100 is smaller than the tokenizer's 500\n"):
        launch.run(spec, tok)


def _job(spec, command, run_id="unit"):
    job = k8s.RENDER[spec.launcher.job_kind](spec, run_id, [])
    if job["kind"] == "TrainJob":
        job["spec"]["trainer"]["command"] = command
    else:
        job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"] = command
    return job


def test_timeout_deletes_the_job_and_stops_its_processes(home, kube):
    fake, cfg = kube
    spec = load_spec(None, kube_sets(home, cfg), env={})
    custom, core = k8s.api_clients(spec)
    job = _job(spec, [sys.executable, "-c", "import time; print('working', flush=True); time.sleep(120)"])
    lines = []
    assert k8s.submit(custom, job, lines.append) == "created"
    with pytest.raises(k8s.JobFailed, match=r"did not finish within launcher\.timeout_minutes=0\.03.*deleted"):
        k8s.watch(custom, core, k8s.TRAINJOB, "llm-pipeline", "llm-pipeline-unit", poll_s=0.2, timeout_s=1.8,
                  log=lines.append)
    assert ("DELETE", COLLECTION["trainjob"] + "/llm-pipeline-unit") in fake.requests
    assert fake.jobs == {}
    assert "[llm-pipeline-unit-node-0-0-x7k2p] working" in lines  # the pod's log was streamed while it ran


NO_GPU = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 3 No " \
    "preemption victims found for incoming pod."


def test_a_job_whose_pods_never_start_is_deleted_after_launcher_pending_minutes_with_the_schedulers_reason(home, kube):
    """No node has the GPUs the pod asks for: the scheduler leaves it Pending (PodScheduled=False, Unschedulable) and
    the job's own state says nothing. The watch waited for it until launcher.timeout_minutes (None by default: for
    ever); now it logs why the pod waits, and after launcher.pending_minutes deletes the job and fails (retryable)
    with the scheduler's message."""
    fake, cfg = kube
    fake.unschedulable = NO_GPU
    spec = load_spec(None, kube_sets(home, cfg, "launcher.pending_minutes=0.03"), env={})
    assert spec.launcher.pending_minutes == 0.03 and load_spec(None, [], env={}).launcher.pending_minutes == 60
    custom, core = k8s.api_clients(spec)
    job = _job(spec, [sys.executable, "-c", "print('never runs')"])
    lines = []
    assert k8s.submit(custom, job, lines.append) == "created"
    with pytest.raises(k8s.JobFailed) as e:
        k8s.watch(custom, core, k8s.TRAINJOB, "llm-pipeline", "llm-pipeline-unit", poll_s=0.2, timeout_s=None,
                  log=lines.append, pending_s=spec.launcher.pending_minutes * 60)
    assert e.value.retryable
    assert str(e.value) == ("no pod of TrainJob llm-pipeline/llm-pipeline-unit started within "
                            f"launcher.pending_minutes=0.03 (llm-pipeline-unit-node-0-0-x7k2p: Pending (Unschedulable: "
                            f"{NO_GPU})); it was deleted")
    waiting = [ln for ln in lines if "waiting to start" in ln]
    assert waiting[-1] == ("trainjob llm-pipeline/llm-pipeline-unit: waiting to start: "
                           f"llm-pipeline-unit-node-0-0-x7k2p: Pending (Unschedulable: {NO_GPU})"), lines
    assert len(set(waiting)) == len(waiting), lines
    assert ("DELETE", COLLECTION["trainjob"] + "/llm-pipeline-unit") in fake.requests and fake.jobs == {}


def test_a_watch_that_may_not_list_the_pods_says_so_once(home, kube):
    """A Role without `list` on pods: the watch polled the job to its end with no pod log and no start bound, and not
    a line saying why; now it says so once (no retry grants a verb), and the job is still watched to its end."""
    fake, cfg = kube
    fake.pods_forbidden = True
    spec = load_spec(None, kube_sets(home, cfg, "launcher.pending_minutes=0.01"), env={})
    custom, core = k8s.api_clients(spec)
    lines = []
    assert k8s.submit(custom, _job(spec, [sys.executable, "-c", "import time; time.sleep(2); print('done')"]),
                      lines.append) == "created"
    k8s.watch(custom, core, k8s.TRAINJOB, "llm-pipeline", "llm-pipeline-unit", poll_s=0.2, timeout_s=120,
              log=lines.append, pending_s=spec.launcher.pending_minutes * 60)  # not deleted at 0.6 s: nothing known
    said = [ln for ln in lines if "refused to list the job's pods" in ln]
    assert len(said) == 1 and "(403 Forbidden)" in said[0] and "launcher.pending_minutes cannot apply" in said[0] \
        and "`list` on pods" in said[0], lines
    assert ("DELETE", COLLECTION["trainjob"] + "/llm-pipeline-unit") not in fake.requests


def test_pods_that_started_or_a_suspended_job_are_not_held_to_the_start_bound():
    from kubernetes.client import (V1ContainerState, V1ContainerStateWaiting, V1ContainerStatus, V1ObjectMeta, V1Pod,
                                   V1PodStatus)

    def pod(name, phase, waiting=None):
        state = V1ContainerState(waiting=V1ContainerStateWaiting(**waiting)) if waiting else None
        cs = [V1ContainerStatus(name="trainer", image="i", image_id="", ready=False, restart_count=0,
                                state=state)] if waiting else None
        return V1Pod(metadata=V1ObjectMeta(name=name), status=V1PodStatus(phase=phase, container_statuses=cs))

    pulling = pod("a", "Pending", {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x:1"'})
    assert k8s.pod_waits([pulling]) == ['a: Pending (trainer: ImagePullBackOff: Back-off pulling image "x:1")']
    assert k8s.pod_waits([pulling, pod("b", "Running")]) is None and k8s.pod_waits([]) == []
    assert k8s.pod_waits([pod("init", "Succeeded"), pulling])[0] == "init: Succeeded"  # an initializer that ended
    nodes = [pod(f"n{i}", "Pending", {"reason": "ErrImagePull"}) for i in range(3)]  # alike: one line
    assert k8s.pod_waits(nodes) == ["3 pods (n0, n1, …): Pending (trainer: ErrImagePull)"]
    bound = k8s.StartBound(0.0)
    assert bound.update("Created", [pulling]) and not bound.update("Created", [pulling])  # logged once per change
    time.sleep(0.01)
    assert bound.expired()
    assert bound.update("Created", None) == [] and not bound.expired()  # a listing that did not answer: no news
    bound.update("Created", [pulling])
    assert bound.expired()
    bound.update("Suspended", [pulling])  # held by a queue: not waiting to start
    assert not bound.expired()
    bound.update("Created", [])
    time.sleep(0.01)
    assert bound.expired() and "(no pod was created)" in bound.message(k8s.TRAINJOB, "ns", "j")
    bound.update("Running", [pod("a", "Running")])
    assert not bound.expired() and not k8s.StartBound(None).expired()
    # counted from the waiting pod's creation (the API server's clock), so a watch or a triggerer that starts again
    # goes on counting: a pod Pending for 2 h is past an hour's bound at the first poll of a new StartBound
    import datetime

    old = pulling
    old.metadata.creation_timestamp = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=2)
    again = k8s.StartBound(3600.0)
    again.update("Created", [old])
    assert again.expired()
    old.metadata.creation_timestamp = datetime.datetime.now(datetime.timezone.utc)
    fresh = k8s.StartBound(3600.0)
    fresh.update("Created", [old])
    assert not fresh.expired()
    ended = pod("evicted", "Failed")  # days old, its replacement just created: the wait counts from the replacement
    ended.metadata.creation_timestamp = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=3)
    replaced = k8s.StartBound(3600.0)
    replaced.update("Created", [ended, old])
    assert not replaced.expired()


def test_a_retried_task_adopts_its_running_job_and_refuses_a_clash(home, kube):
    fake, cfg = kube
    spec = load_spec(None, kube_sets(home, cfg), env={})
    custom, core = k8s.api_clients(spec)
    sleeper = _job(spec, [sys.executable, "-c", "import time; time.sleep(6)"])
    assert k8s.submit(custom, sleeper, print) == "created"
    assert k8s.submit(custom, sleeper, print) == "adopted"  # same name, same command: follow it
    other = _job(spec, [sys.executable, "-c", "print('other')"])
    with pytest.raises(k8s.JobFailed, match=r"TrainJob llm-pipeline/llm-pipeline-unit from an earlier try is still "
                       r"\w+ with another command.*kubectl delete trainjob -n llm-pipeline llm-pipeline-unit"):
        k8s.submit(custom, other, print)
    k8s.watch(custom, core, k8s.TRAINJOB, "llm-pipeline", "llm-pipeline-unit", poll_s=0.2, timeout_s=60, log=print)
    assert k8s.submit(custom, other, print) == "replaced"  # a finished job of the same name gives way
    done = k8s.watch(custom, core, k8s.TRAINJOB, "llm-pipeline", "llm-pipeline-unit", 0.2, 60, print)
    assert k8s.job_state(done)[0] == "Succeeded"


def test_the_api_servers_schema_rejection_is_reported(home, kube):
    fake, cfg = kube
    if fake.crds["PyTorchJob"] is None:
        pytest.skip("../shared/data/k8s (the PyTorchJob CRD the stand-in validates with) is absent")
    spec = load_spec(None, kube_sets(home, cfg, kind="pytorchjob"), env={})
    custom, _ = k8s.api_clients(spec)
    job = _job(spec, ["true"])
    job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    with pytest.raises(k8s.JobFailed, match=r"refused PyTorchJob llm-pipeline/llm-pipeline-unit \(422 "
                       r"Unprocessable.*Master\.replicas: 'one' is not of type 'integer'"):
        k8s.submit(custom, job, print)


def test_the_api_servers_cel_and_webhook_refusals_are_reported(home, kube):
    """The stand-in admits as the cluster does (pipelines.launch.admission): the TrainJob CRD's CEL name rule and
    the webhook's rules come back as a 422 naming the rule, and the launcher's one line says it."""
    fake, cfg = kube
    spec = load_spec(None, kube_sets(home, cfg), env={})
    custom, _ = k8s.api_clients(spec)
    job = _job(spec, ["true"])
    job["metadata"]["name"] = "7b-run-train-unit"  # a name job_name no longer gives
    job["spec"]["runtimePatches"][0]["manager"] = "llm-pipeline"
    with pytest.raises(k8s.JobFailed, match=r"refused TrainJob llm-pipeline/7b-run-train-unit \(422 Unprocessable"
                       r".*<root>: metadata\.name must match RFC 1035 DNS label format \[CEL rule: "
                       r".*spec\.runtimePatches\[0\]\.manager: 'llm-pipeline': must be a domain-prefixed path"):
        k8s.submit(custom, job, print)
    assert fake.jobs == {}


def test_kubernetes_needs_the_stage_paths_on_the_shared_filesystem(home, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("not-shared")
    spec = load_spec(None, [*TINY, "launcher.kind=kubernetes", "launcher.shared_fs_mount=/fsx",
                            f"run.root={elsewhere}"], env={})
    with pytest.raises(ranks.TrainError, match=rf"run\.root resolves to {elsewhere}, outside "
                       r"launcher\.shared_fs_mount=/fsx; the pods would not see it"):
        ranks.check_supported(spec)
    # node-local L0: an absolute path outside the shared mount is each pod's own disk, mounted there
    node_local = load_spec(None, [*TINY, "launcher.kind=kubernetes", "launcher.shared_fs_mount=/fsx",
                                  "run.root=/fsx/runs", "checkpoint.l1=/fsx/l1", "checkpoint.l0=/nvme/llmp"], env={})
    ranks.check_supported(node_local)
    spec_ = k8s.render_pytorchjob(node_local, "r", [])["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {"name": "node-local", "mountPath": "/nvme/llmp"} in spec_["containers"][0]["volumeMounts"]
    assert {"name": "node-local", "emptyDir": {}} in spec_["volumes"]
    node_local.launcher.node_local_path = "/mnt/k8s-disks/0/llmp"
    vols = k8s.render_pytorchjob(node_local, "r", [])["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {"name": "node-local", "hostPath": {"path": "/mnt/k8s-disks/0/llmp", "type": "DirectoryOrCreate"}} \
        in vols["volumes"]
    # two pods of the job on one host: each its own directory of the host's disk, not one shared step-N.tmp
    assert {"name": "node-local", "mountPath": "/nvme/llmp", "subPathExpr": "$(LLMP_POD_NAME)"} \
        in vols["containers"][0]["volumeMounts"]
    assert {"name": "LLMP_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} \
        in vols["containers"][0]["env"]
    shared_l0 = k8s.render_pytorchjob(load_spec(None, [*TINY, "checkpoint.l0=/fsx/l0"], env={}), "r", [])
    assert "node-local" not in str(shared_l0)
    bad_cfg = load_spec(None, kube_sets(home, home / "no-such-kubeconfig"), env={})
    with pytest.raises(k8s.JobFailed, match="cannot load Kubernetes credentials.*set launcher.kubeconfig"):
        k8s.api_clients(bad_cfg)


def test_each_rendered_job_gives_its_pods_a_rendezvous_id_of_its_own():
    """torchrun's default rendezvous id (``none``) is every job's, so the fence could not tell a job from one
    re-created under its name: a TrainJob's pods get their batch Job's uid, a static PyTorchJob's each its own pod
    uid (rank 0 is on the Master), through the downward API; an elastic PyTorchJob (c10d: one id for every pod)
    keeps the default, which the fence reads as no launch."""
    uid = {"name": "LLMP_JOB_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels["
                                                                           "'batch.kubernetes.io/controller-uid']"}}}
    rdzv = {"name": "PET_RDZV_ID", "value": "llmp-$(LLMP_JOB_UID)"}
    base = [*TINY, "launcher.nnodes=2", "launcher.shared_fs_mount=/fsx", "run.root=/fsx/runs"]
    env = k8s.render_trainjob(load_spec(None, [*base, "launcher.kind=trainjob"], env={}), "r", [])["spec"][
        "trainer"]["env"]
    assert env.index(uid) + 1 == env.index(rdzv)  # defined before the value that refers to it
    job = k8s.render_pytorchjob(load_spec(None, [*base, "launcher.kind=pytorchjob"], env={}), "r", [])
    for rs in job["spec"]["pytorchReplicaSpecs"].values():
        env = rs["template"]["spec"]["containers"][0]["env"]
        assert {"name": "LLMP_JOB_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}} in env
        assert rdzv in env
    elastic = k8s.render_pytorchjob(load_spec(None, [*base, "launcher.kind=pytorchjob", "launcher.min_nodes=1"],
                                              env={}), "r", [])
    assert "PET_RDZV_ID" not in str(elastic) and "LLMP_JOB_UID" not in str(elastic)


def test_a_deferral_is_bounded_by_what_is_left_of_the_tasks_execution_timeout():
    """Airflow's task SDK passes only ``defer``'s timeout to the triggerer (execution_timeout does not bound a
    deferred task): the trigger's timeout is what is left of it since the task started, or launcher.timeout_minutes
    when that is shorter; without an execution_timeout nothing changes."""
    from datetime import datetime, timezone
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "plugins"))
    from llm_operators import DEFER_MARGIN_S, deferral

    now = 1_000_000.0
    ti = SimpleNamespace(start_date=datetime.fromtimestamp(now - 600, tz=timezone.utc))  # started 10 min ago
    pending = {"namespace": "n", "name": "j", "timeout_s": None}
    got, timeout = deferral(pending, timedelta(hours=1), {"ti": ti}, now=now)
    assert got["timeout_s"] == 3000 and got["started"] == now and timeout == timedelta(seconds=3000 + DEFER_MARGIN_S)
    got, _ = deferral({**pending, "timeout_s": 1200.0}, timedelta(hours=1), {"ti": ti}, now=now)
    assert got["timeout_s"] == 1200  # launcher.timeout_minutes, shorter, stays
    got, _ = deferral({**pending, "started": now - 100}, timedelta(hours=1), {"ti": ti}, now=now)
    assert got["timeout_s"] == 3100  # counted from the job's submit, as the trigger counts it
    assert deferral(pending, None, {"ti": ti}, now=now) == (pending, None)
    got, timeout = deferral(pending, timedelta(minutes=5), {"ti": ti}, now=now)  # spent already: a minute to act
    assert got["timeout_s"] == 60 and timeout == timedelta(seconds=60 + DEFER_MARGIN_S)


def test_the_train_task_defers_while_the_job_runs_and_resumes_to_collect_it(home, kube):
    """Deferrable wait: the task submits the PyTorchJob and defers (its worker slot is freed); the trigger polls
    the job to Succeeded; the resumed task adopts the finished job (no second submit) and commits the manifest."""
    import asyncio

    sys.path.insert(0, str(ROOT / "plugins"))
    from airflow.sdk.exceptions import TaskDeferred
    from llm_operators import StageOperator
    from llm_triggers import TrainingJobTrigger

    from pipelines.manifest import load_manifest

    fake, cfg = kube
    docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(c4_docs(120))]
    sets = kube_sets(home, cfg)
    tok = tokenize.run(load_spec(None, sets, env={}), _filter_manifest(home, docs))
    op = StageOperator(task_id="train", module="pipelines.train.launch", overrides=sets,
                       stage_args=["--tokenize-manifest", tok.path], execution_timeout=timedelta(hours=2))
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({})
    trigger, (ns, name) = deferred.value.trigger, next(iter(fake.jobs))
    assert isinstance(trigger, TrainingJobTrigger) and deferred.value.method_name == "execute_complete"
    # the deferral is bounded by the task's execution_timeout (Airflow does not do it for a deferred task): the
    # trigger deletes the job when it is spent, Airflow's own timeout comes DEFER_MARGIN_S later
    assert trigger.timeout_s == 900  # launcher.timeout_minutes=15 (kube_sets), shorter than the 2 h left
    assert deferred.value.timeout == timedelta(seconds=7200 + 300)
    assert (trigger.kind, trigger.namespace, trigger.name) == ("trainjob", ns, name)
    assert k8s.job_state(fake.jobs[(ns, name)].obj)[0] != "Succeeded"  # the task returned while the job runs

    classpath, kwargs = trigger.serialize()  # what the triggerer stores and rebuilds
    assert classpath == "llm_triggers.TrainingJobTrigger"

    async def first_event():
        async for event in TrainingJobTrigger(**kwargs).run():
            return event

    event = asyncio.run(asyncio.wait_for(first_event(), timeout=300))
    assert event.payload["state"] == "Succeeded", event.payload
    m = load_manifest(op.execute_complete({}, event.payload))
    assert m.stage == "train" and m.counts["steps"] == 6 and m.extra["world_size"] == 2
    assert len(fake.jobs) == 1 and "DELETE" not in {verb for verb, _ in fake.requests}  # adopted (409), not re-run

    failed = {"state": "Failed", "message": "PyTorchJob llm-pipeline/x failed: OOMKilled"}
    with pytest.raises(Exception, match="OOMKilled"):
        op.execute_complete({}, failed)


def test_a_user_stopping_the_deferred_task_deletes_its_job(home, kube):
    """Mark failed / mark succeeded / clear of a deferred task: Airflow calls the trigger's on_kill (and only then,
    not on a triggerer restart); the job is deleted and its processes stopped. The trigger builds its clients from
    its own kubeconfig and leaves the kubernetes client's process-global configuration alone."""
    import asyncio

    from kubernetes import client

    sys.path.insert(0, str(ROOT / "plugins"))
    from airflow.triggers.base import BaseTrigger
    from llm_triggers import TrainingJobTrigger

    fake, cfg = kube
    before = client.Configuration.get_default_copy().host
    spec = load_spec(None, kube_sets(home, cfg), env={})
    custom, _ = k8s.api_clients(spec)
    assert k8s.submit(custom, _job(spec, [sys.executable, "-c", "import time; time.sleep(120)"]), print) == "created"
    trigger = TrainingJobTrigger(kind="trainjob", namespace="llm-pipeline", name="llm-pipeline-unit",
                                 kubeconfig=str(cfg))
    assert type(trigger).on_kill is not BaseTrigger.on_kill  # Airflow's hook for a user's action on the task
    asyncio.run(asyncio.wait_for(trigger.on_kill(), timeout=60))
    assert ("DELETE", COLLECTION["trainjob"] + "/llm-pipeline-unit") in fake.requests and fake.jobs == {}
    assert client.Configuration.get_default_copy().host == before != fake.url


def test_the_deferred_wait_deletes_a_job_whose_pods_never_start_and_says_why(home, kube):
    """The triggerer's wait (a deferred train task) holds the same bound as the watch: launcher.pending_minutes
    reaches the trigger (serialized), which deletes the job and fires NotStarted with the scheduler's reason; the
    task then fails with it (a retry submits anew)."""
    import asyncio

    sys.path.insert(0, str(ROOT / "plugins"))
    from llm_triggers import TrainingJobTrigger

    fake, cfg = kube
    fake.unschedulable = NO_GPU
    spec = load_spec(None, kube_sets(home, cfg, "launcher.pending_minutes=0.02"), env={})
    custom, _ = k8s.api_clients(spec)
    assert k8s.submit(custom, _job(spec, [sys.executable, "-c", "print('never runs')"]), print) == "created"
    trigger = TrainingJobTrigger(kind="trainjob", namespace="llm-pipeline", name="llm-pipeline-unit",
                                 kubeconfig=str(cfg), poll_seconds=0.2, pending_s=spec.launcher.pending_minutes * 60)
    _, kwargs = trigger.serialize()
    assert kwargs["pending_s"] == 1.2

    async def first_event():
        async for event in TrainingJobTrigger(**kwargs).run():
            return event

    event = asyncio.run(asyncio.wait_for(first_event(), timeout=120))
    assert event.payload["state"] == "NotStarted" and f"(Unschedulable: {NO_GPU})" in event.payload["message"]
    assert ("DELETE", COLLECTION["trainjob"] + "/llm-pipeline-unit") in fake.requests and fake.jobs == {}


def test_airflow_connections_set_the_services_and_win_over_the_spec(home, kube, monkeypatch, tmp_path):
    """A connection that exists (any backend; here AIRFLOW_CONN_*) is where a task takes the service's address and
    credentials: the S3 endpoint and keys (aws_default), MLflow's URI and login (mlflow_default), the kubeconfig
    (kubernetes_default, inline: written 0600 for the stage); secrets go to the environment, not the command line.
    The trigger reads the same Kubernetes connection in the triggerer. Absent connections change nothing."""
    import asyncio
    import json as _json
    import stat

    sys.path.insert(0, str(ROOT / "plugins"))
    from llm_connections import resolve
    from llm_triggers import TrainingJobTrigger

    fake, cfg = kube
    spec_file = home / "conn-spec.yaml"
    spec_file.write_text(yaml.safe_dump({"services": {"s3_endpoint_url": "http://127.0.0.1:1", "spark_master": "local[1]",
                                                      "mlflow_tracking_uri": "sqlite:///x.db"},
                                         "launcher": {"kind": "trainjob", "kubeconfig": "/nonexistent"}}))
    for var in ("AIRFLOW_CONN_AWS_DEFAULT", "AIRFLOW_CONN_MLFLOW_DEFAULT", "AIRFLOW_CONN_KUBERNETES_DEFAULT",
                "AIRFLOW_CONN_SPARK_PIPELINE"):
        monkeypatch.delenv(var, raising=False)
    assert resolve(str(spec_file), [], tmp_path).env == {}  # none set: the spec's values stand
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", _json.dumps({"conn_type": "aws", "login": "AKIAEXAMPLE",
                       "password": "s3cr3t-key", "extra": {"endpoint_url": "http://127.0.0.1:9000",
                                                           "region_name": "eu-west-1"}}))
    monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_DEFAULT", _json.dumps({"conn_type": "http", "host": "mlflow.internal",
                       "port": 5000, "login": "pipeline", "password": "mlflow-pass"}))
    monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_DEFAULT", _json.dumps({"conn_type": "kubernetes", "extra": {
        "kube_config": cfg.read_text(), "cluster_context": "fake"}}))
    r = resolve(str(spec_file), [], tmp_path)
    env = r.env
    assert env["S3_ENDPOINT_URL"] == "http://127.0.0.1:9000" and env["AWS_SECRET_ACCESS_KEY"] == "s3cr3t-key"
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.internal:5000" and env["MLFLOW_TRACKING_PASSWORD"] == "mlflow-pass"
    kubeconfig = Path(env["LLMP_KUBECONFIG"])
    assert stat.S_IMODE(kubeconfig.stat().st_mode) == 0o600 and env["LLMP_KUBE_CONTEXT"] == "fake"
    spec = load_spec(str(spec_file), env=env)  # what the stage sees: the connections win over the spec file
    assert spec == r.spec  # and what the task itself resolved
    assert spec.services.s3_endpoint_url == "http://127.0.0.1:9000" and spec.services.s3_region == "eu-west-1"
    assert spec.services.mlflow_tracking_uri == "http://mlflow.internal:5000"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert k8s.kube_target(spec) == (str(kubeconfig), "fake")  # the API credentials: not spec values (no re-key)
    assert spec.stage_hash("train") == load_spec(str(spec_file), env={}).stage_hash("train")
    # the trigger, given only the connection id (the task's kubeconfig path is not on the triggerer), reaches the job
    custom, _ = k8s.api_clients(spec)
    assert k8s.submit(custom, _job(spec, [sys.executable, "-c", "import time; time.sleep(120)"]), print) == "created"
    trigger = TrainingJobTrigger(kind="trainjob", namespace="llm-pipeline", name="llm-pipeline-unit",
                                 kubeconfig="/not/on/the/triggerer", kube_conn_id="kubernetes_default")
    asyncio.run(asyncio.wait_for(trigger.on_kill(), timeout=60))
    assert fake.jobs == {}


def test_a_spark_connection_that_exists_is_the_master_and_is_not_overwritten(home, monkeypatch, tmp_path):
    """spark_pipeline set by a user (UI, CLI, env) is the master spark-submit gets; absent, the spec's master is
    exposed under that id, for the submit only (tests/test_connections.py: the variable is put back after)."""
    import json as _json
    import os

    sys.path.insert(0, str(ROOT / "plugins"))
    from llm_connections import resolve
    from llm_operators import SparkStageOperator

    spec_file = home / "spark-spec.yaml"
    spec_file.write_text(yaml.safe_dump({"services": {"spark_master": "local[2]"}}))
    op = SparkStageOperator(task_id="dedup", module="pipelines.data.dedup")
    user = _json.dumps({"conn_type": "spark", "host": "local[1]"})
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_PIPELINE", user)
    r = resolve(str(spec_file), [], tmp_path)
    op._submit_settings(r, str(tmp_path))
    assert op.env_vars["SPARK_MASTER"] == "local[1]" and "AIRFLOW_CONN_SPARK_PIPELINE" not in op.submit_env(r)
    monkeypatch.delenv("AIRFLOW_CONN_SPARK_PIPELINE")
    r = resolve(str(spec_file), [], tmp_path)
    op._submit_settings(r, str(tmp_path))
    assert op.env_vars["SPARK_MASTER"] == "local[2]"
    assert _json.loads(op.submit_env(r)["AIRFLOW_CONN_SPARK_PIPELINE"])["host"] == "local[2]"
    assert "AIRFLOW_CONN_SPARK_PIPELINE" not in os.environ  # building the settings writes no environment


def test_a_job_deleted_behind_the_watch_fails_it_with_one_line(home, kube):
    fake, cfg = kube
    spec = load_spec(None, kube_sets(home, cfg), env={})
    custom, core = k8s.api_clients(spec)
    assert k8s.submit(custom, _job(spec, [sys.executable, "-c", "import time; time.sleep(120)"]), print) == "created"
    fake._kill(fake.jobs.pop(("llm-pipeline", "llm-pipeline-unit")))  # someone else deleted it
    with pytest.raises(k8s.JobFailed, match=r"TrainJob llm-pipeline/llm-pipeline-unit is gone: it was deleted "
                       r"outside this task"):
        k8s.watch(custom, core, k8s.TRAINJOB, "llm-pipeline", "llm-pipeline-unit", 0.2, 60, print)


# What the ranks of the fake train job do (the stage's job, its command replaced: tests/fake_kube.py runs it). Every
# try submits this same command, so only the launcher's record can tell one job from the next: the first job waits
# for the test's gate, then is preempted after step 4 (status 0: the job ends Succeeded with an outcome file saying
# 75); the next one trains to the end, and meanwhile a rank of an earlier, larger shape of the job writes its file
# late (a stale attempt's: it must not count).
RANKS = """
import json, pathlib, sys, time
sys.path.insert(0, ROOT)
from pipelines.launch import outcomes as xc
out = pathlib.Path(sys.argv[1])
xc.clear_outcome(out, 0)  # as a rank does at its start
while not (out / "gate").exists():
    time.sleep(0.05)
runs = out / "runs"
n = len(runs.read_text().split()) if runs.exists() else 0
runs.write_text("x " * (n + 1))
if n == 0:
    xc.write_outcome(out, 0, xc.RETRY, "preempted (SIGTERM at step 3) after step 4", step=4)
    print("train: preempted; committed on L1: a retry resumes there", flush=True)
else:
    (out / "exit-rank3.json").write_text(json.dumps({"rank": 3, "code": 75, "reason": "preempted", "step": 2,
                                                     "attempt": "an-earlier-launch"}))
    (out / "losses.json").write_text(json.dumps([[1, 2.5], [6, 1.5]]))
    (out / "result.json").write_text(RESULT)
""".replace("ROOT", repr(str(ROOT))).replace("RESULT", repr(json.dumps({
    "steps": 6, "tokens_seen": 768, "final_loss": 1.5, "tokens_per_s": 100.0, "params": 1000, "rollbacks": 0,
    "ckpt": {"stall_s_mean": 0.0, "promoted": 0}, "checkpoint": "step-6", "mlflow_run_id": None, "world_size": 2,
    "backend": "gloo", "resumed_from": {"step": 4, "tier": "l1"}})))


def _tok_manifest(home):
    """A tokenize manifest for the train stage's key and arguments (the fake ranks read nothing of it)."""
    from pipelines.manifest import StageDir

    sd = StageDir(home / "var/runs", "tokenize", "test", [{"uri": "x", "sha256": "0"}])
    with sd:
        (sd.tmp / "shards.txt").write_text("none")
        return sd.commit({"shards": "shards.txt"}, extra={"vocab_size": 500})


def _until_finished(fake, within_s=120.0):
    import time

    (key,) = fake.jobs
    deadline = time.monotonic() + within_s  # a bound for a hung run only: nothing here depends on how fast it is
    while k8s.job_state(fake.jobs[key].obj)[0] not in ("Succeeded", "Failed"):
        assert time.monotonic() < deadline, "the fake job did not finish"
        time.sleep(0.05)


def test_a_finished_preempted_job_is_collected_once_and_the_next_retry_makes_a_new_one(home, kube, monkeypatch,
                                                                                    capsys):
    """Issue 52 (3): the deferred train task submits its job; the job is preempted and ends Succeeded. The resumed
    task collects it once (75); the retry does not adopt it again (exit 75 in no time, for ever) but replaces it,
    and the new job's result is the stage's, although a stale rank of an earlier attempt left a preempted file."""
    fake, cfg = kube
    sets = kube_sets(home, cfg)
    monkeypatch.setattr(k8s, "stage_job", lambda spec, run_id, module, args, env=None: _job(
        spec, [sys.executable, "-c", RANKS, args[args.index("--out") + 1]], run_id))
    tok = _tok_manifest(home)
    argv = ["--tokenize-manifest", tok.path, "--report", str(home / "report.json"),
            *(a for x in sets for a in ("--set", x))]
    deletes = lambda: sum(v == "DELETE" for v, _ in fake.requests)  # noqa: E731

    monkeypatch.setenv("LLMP_DETACH", "1")  # the deferrable task: submit, defer
    assert launch.main(argv) == 0 and "pending" in json.loads((home / "report.json").read_text())
    (key,) = fake.jobs
    first_uid = fake.jobs[key].obj["metadata"]["uid"]
    work = Path(fake.jobs[key].obj["spec"]["trainer"]["command"][-1])  # the ranks' --out
    (work / "gate").touch()
    _until_finished(fake)
    assert k8s.job_state(fake.jobs[key].obj)[0] == "Succeeded"

    monkeypatch.setenv("LLMP_DETACH", "0")  # the task resumed from the trigger: it collects the finished job once
    assert launch.main(argv) == 75
    assert "preempted (notice to the ranks); step 4 is committed" in capsys.readouterr().err
    assert fake.jobs[key].obj["metadata"]["uid"] == first_uid and deletes() == 0

    assert launch.main(argv) == 0  # the retry: a new job (not the old outcome again), whose result commits
    assert fake.jobs[key].obj["metadata"]["uid"] != first_uid and deletes() == 1
    assert (work / "runs").read_text().split() == ["x", "x"] and (work / "exit-rank3.json").is_file()
    m = json.loads((home / "report.json").read_text())
    assert json.loads(Path(m["manifest"]).read_text())["counts"]["steps"] == 6

    asked = len(fake.requests)
    assert launch.main(argv) == 0  # done: the stage is up to date, the cluster is not asked
    assert len(fake.requests) == asked


def test_outcome_files_of_another_attempt_are_ignored(tmp_path):
    """Outcome files carry the attempt that wrote them (the id the launcher put in the work dir before it started
    the ranks, as each rank read it at its start); the launcher leaves out other attempts' files: a rank of an
    earlier job still running when the next one started, a rank that no longer exists (an elastic job back with
    fewer nodes). A file without the field (ranks of an older image) still counts."""
    import subprocess

    from pipelines.launch import outcomes as xc

    work = tmp_path / "work"
    first = xc.new_attempt(work)
    rank = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                             "from pathlib import Path\nfrom pipelines.launch import outcomes as xc\n"
                             "out = Path(sys.argv[1]); xc.clear_outcome(out, 3); print('started', flush=True)\n"
                             "sys.stdin.readline(); xc.write_outcome(out, 3, xc.RETRY, 'preempted (SIGTERM)', step=7)",
                             str(work)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert rank.stdout.readline().strip() == "started"  # it read its attempt
    second = xc.new_attempt(work)
    rank.communicate("go\n", timeout=120)
    # the stale rank's file is named for its attempt: it cannot replace the current attempt's rank 3 file
    assert second != first and json.loads((work / f"exit-rank3-{first}.json").read_text())["attempt"] == first
    (work / "exit-rank2.json").write_text(json.dumps({"rank": 2, "code": 2, "reason": "diverged", "attempt": first}))
    (work / "exit-rank1.json").write_text(json.dumps({"rank": 1, "code": 75, "reason": "storage: EIO"}))  # no field
    xc.write_outcome(work, 0, xc.RETRY, "storage: ENOSPC")
    outcomes = xc.read_outcomes(work)
    assert [(o["rank"], o.get("attempt")) for o in outcomes] == [(0, second), (1, None)]
    ranks.preempted(outcomes, [])  # the stale preempted file of rank 3 says nothing about this attempt
    assert xc.failed_ranks_code(outcomes) == xc.RETRY  # nor does rank 2's stale "diverged" (it would say 2)
    xc.new_attempt(work)
    assert xc.read_outcomes(work) == [] and not list(work.glob("exit-rank*.json"))
    # an attempt file that does not answer is no verdict (every file counting): 75, not "none named"
    (work / xc.ATTEMPT_FILE).unlink()
    (work / xc.ATTEMPT_FILE).mkdir()  # read as a file: IsADirectoryError, as EIO would be
    with pytest.raises(xc.OutcomesUnreadable) as e:
        xc.read_outcomes(work)
    assert e.value.exit_code == 75 and xc.final_stop(work) is None
    (work / "a-file").write_text("x")  # an --out that cannot be written: the rank learns it (it then exits 75)
    assert xc.write_outcome(work / "a-file" / "out", 0, xc.RETRY, "preempted", step=3) is False
    assert xc.write_outcome(tmp_path / "fine", 0, xc.RETRY, "preempted", step=3) is True


def _gated_job(monkeypatch, spec, gate):
    """run_job's job: prints 'working', then waits for ``gate``."""
    script = (f"import pathlib, time\nprint('working', flush=True)\n"
              f"while not pathlib.Path({str(gate)!r}).exists():\n    time.sleep(0.05)\nprint('done', flush=True)")
    monkeypatch.setattr(k8s, "stage_job",
                        lambda spec, run_id, module, args, env=None: _job(spec, [sys.executable, "-c", script]))


def _watched_with_a_token(home, kube, monkeypatch):
    """A job that runs until ``gate`` exists, watched with the token ``fake-token`` (no waits between the reads of
    the credentials): (fake API, kubeconfig, spec, gate)."""
    fake, cfg = kube
    fake.tokens = {"fake-token"}
    monkeypatch.setattr(k8s, "AUTH_BACKOFF_S", 0.0, raising=False)  # no waits
    spec = load_spec(None, kube_sets(home, cfg), env={})
    gate = home / "gate"
    _gated_job(monkeypatch, spec, gate)
    return fake, cfg, spec, gate


def test_a_token_that_expires_during_the_watch_is_read_again_and_the_watch_goes_on(home, kube, monkeypatch):
    """A 401 in the middle of a watch (an EKS token lasts 15 minutes) is not the user's error: the launcher reads
    the credentials again (a new client from the kubeconfig, which now holds a fresh token) and follows the job to
    its end."""
    fake, cfg, spec, gate = _watched_with_a_token(home, kube, monkeypatch)
    lines = []

    def expire(line):  # the job runs (submitted and watched): the token expires, the kubeconfig gets a new one
        if line == "working":
            fake.tokens = {"token-2"}
            fake.kubeconfig(cfg, token="token-2")
            gate.touch()

    fake.on_log = expire
    done = k8s.run_job(spec, "unit", "m", [], log=lines.append)
    assert k8s.job_state(done)[0] == "Succeeded"
    assert fake.refused >= 1 and any("the API refused the credentials (401); reading them again" in x for x in lines)
    assert any(x.endswith("] done") for x in lines)  # the pod's log followed with the new client too


def test_the_trigger_reads_the_credentials_again_when_the_token_expires_while_it_follows_the_job(home, kube,
                                                                                                 monkeypatch):
    """The deferred task's trigger follows the job in the triggerer: a 401 in the middle (the token expired) reads
    the kubeconfig again, which holds a fresh token, and the trigger goes on to the job's end; a refusal that
    persists ends in a Failed event after a bounded number of reads (the task's retry)."""
    import asyncio

    sys.path.insert(0, str(ROOT / "plugins"))
    from llm_triggers import TrainingJobTrigger

    fake, cfg, spec, gate = _watched_with_a_token(home, kube, monkeypatch)
    script = (f"import pathlib, time\nprint('working', flush=True)\n"
              f"while not pathlib.Path({str(gate)!r}).exists():\n    time.sleep(0.05)\nprint('done', flush=True)")
    custom, _ = k8s.api_clients(spec)

    def follow(name: str) -> dict:
        job = _job(spec, [sys.executable, "-c", script])
        job["metadata"]["name"] = name
        assert k8s.submit(custom, job, print) == "created"
        trigger = TrainingJobTrigger(kind="trainjob", namespace="llm-pipeline", name=name, poll_seconds=0.2,
                                     kubeconfig=str(cfg))

        async def first():
            async for event in trigger.run():
                return event.payload

        return asyncio.run(asyncio.wait_for(first(), timeout=120))

    def expire(line):  # the job runs and is followed: the token expires, the kubeconfig gets a new one
        if line == "working":
            fake.tokens = {"token-2"}
            fake.kubeconfig(cfg, token="token-2")
            gate.touch()

    fake.on_log = expire
    assert follow("llm-pipeline-renewed")["state"] == "Succeeded" and fake.refused >= 1
    gate.unlink()
    fake.on_log = lambda line: fake.tokens.clear() if line == "working" else None  # expired; no new one anywhere
    custom, _ = k8s.api_clients(spec)  # token-2, still good for the submit
    event = follow("llm-pipeline-refused")
    gate.touch()
    assert event["state"] == "Failed" and "still so after reading the credentials again 3 times" in event["message"]


def test_the_trigger_reads_the_kubernetes_connection_again_when_the_token_expires(home, kube, monkeypatch):
    """On the triggerer the credentials come from the Kubernetes connection (its inline kubeconfig, written to a
    scratch file): a 401 while following the job reads the connection again, where a rotation put the new token,
    not only the scratch file that still holds the old one."""
    import asyncio
    import json as _json

    sys.path.insert(0, str(ROOT / "plugins"))
    from llm_triggers import TrainingJobTrigger

    fake, cfg, spec, gate = _watched_with_a_token(home, kube, monkeypatch)
    script = (f"import pathlib, time\nprint('working', flush=True)\n"
              f"while not pathlib.Path({str(gate)!r}).exists():\n    time.sleep(0.05)\nprint('done', flush=True)")

    def connection(token: str) -> None:
        fake.kubeconfig(home / "conn-kubeconfig", token=token)
        monkeypatch.setenv("AIRFLOW_CONN_KUBERNETES_DEFAULT", _json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config": (home / "conn-kubeconfig").read_text()}}))

    connection("fake-token")
    custom, _ = k8s.api_clients(spec)
    job = _job(spec, [sys.executable, "-c", script])
    assert k8s.submit(custom, job, print) == "created"

    def rotate(line):  # the token expires; the connection (not the task's kubeconfig) gets the new one
        if line == "working":
            fake.tokens = {"token-2"}
            connection("token-2")
            gate.touch()

    fake.on_log = rotate
    trigger = TrainingJobTrigger(kind="trainjob", namespace="llm-pipeline", name=job["metadata"]["name"],
                                 poll_seconds=0.2, kubeconfig="/not/on/the/triggerer", kube_conn_id="kubernetes_default")

    async def first():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(asyncio.wait_for(first(), timeout=120))
    assert event["state"] == "Succeeded" and fake.refused >= 1, event


def test_a_refusal_that_persists_during_the_watch_exits_75_one_line(home, kube, monkeypatch):
    """The token expired and reading the credentials again does not help (the task's kubeconfig still holds the old
    one): a few bounded tries, then exit 75, so that the task's retry resolves its credentials anew; one line, no
    traceback. Refused right at the submit, with credentials read that moment, is the identity's to fix: 2."""
    fake, cfg, spec, gate = _watched_with_a_token(home, kube, monkeypatch)
    reads = []
    real = k8s.api_clients_for
    monkeypatch.setattr(k8s, "api_clients_for", lambda *a: reads.append(a) or real(*a))
    fake.on_log = lambda line: fake.tokens.clear() if line == "working" else None  # expired; no new one anywhere
    with pytest.raises(ranks.TrainError) as e:
        ranks.run_ranks(spec, "m", [], run_id="unit")
    gate.touch()
    assert type(e.value) is ranks.TrainRetry and e.value.exit_code == 75
    assert "\n" not in str(e.value) and "(401 Unauthorized)" in str(e.value), str(e.value)
    assert len(reads) == 1 + k8s.AUTH_TRIES  # the credentials were read again, a bounded number of times

    fake.on_log, fake.tokens = None, {"someone-else"}  # refused at the submit: the configured identity is wrong
    with pytest.raises(ranks.TrainError) as e:
        ranks.run_ranks(spec, "m", [], run_id="unit")
    assert type(e.value) is ranks.TrainError and e.value.exit_code == 2 and "\n" not in str(e.value)


def test_a_stopped_launch_deletes_its_job_in_one_short_try_and_exits_75(home, kube, monkeypatch):
    """SIGTERM to a launch that watches its job (Airflow stopping the task, 10 s before SIGKILL): the job is
    deleted in one short try, not the watch's retries (minutes), and the launch ends as a retryable failure (exit
    75) instead of dying by a KeyboardInterrupt's traceback."""
    import signal
    import threading

    fake, cfg, spec, gate = _watched_with_a_token(home, kube, monkeypatch)
    me = os.getpid()

    def stop_when_created():
        deadline = time.monotonic() + 60
        while not fake.jobs and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(me, signal.SIGTERM)
    threading.Thread(target=stop_when_created, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(k8s.JobFailed, match="stopped .*it was deleted") as e:
        k8s.run_job(spec, "unit", "pipelines.train.trainer", [], log=lambda m: None)
    assert e.value.retryable and time.monotonic() - t0 < 60
    assert any(v == "DELETE" for v, _ in fake.requests) and fake.jobs == {}
