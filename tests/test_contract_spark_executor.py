"""Spark on Kubernetes' executor contract, executed: a driver in client mode (as in the Airflow worker pod) asks
Spark's own Kubernetes resource manager of our pyspark — ``KubernetesExecutorBuilder`` with the conf our stages give
a ``k8s://`` master (``pipelines.data.spark.kubernetes_conf``) — for the executor pod it would create; the test starts
that pod's container from the pipeline image with exactly its args (``["executor"]``) and its environment (the
kubelet's part — the pod's IP and name from the downward API — filled in as the kubelet would, its emptyDir volumes
as tmpfs); the executor registers with the driver and runs a stage of Python tasks whose results say they ran in the
image. Then the ``driver`` contract (cluster mode's driver pod): the image's ``driver ARGS`` runs a PySpark app.

No Kubernetes API here: the driver's master is a standalone master with no workers, so the only executor is the one
the test started (the registration an executor pod makes is the same RPC for every cluster manager)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyspark
import pytest

from conftest import ROOT, free_port, wait_for
from image_build import Containers, built_image

pytestmark = pytest.mark.spark
BIN = Path(sys.executable).parent

DRIVER = textwrap.dedent('''
    import json, os, sys, time
    from pyspark.sql import SparkSession
    from pipelines.data.spark import kubernetes_conf
    from pipelines.spec import load_spec

    master, spec_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    b = SparkSession.builder.master(master).appName("contract")
    for k, v in {**kubernetes_conf(load_spec(spec_path, env={})), "spark.driver.host": "127.0.0.1",
                 "spark.driver.bindAddress": "127.0.0.1", "spark.executor.memory": "512m",
                 "spark.executor.cores": "1", "spark.ui.enabled": "false"}.items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    sc = spark.sparkContext
    jvm, jsc = sc._jvm, sc._jsc.sc()
    k8s = jvm.org.apache.spark.deploy.k8s
    conf = k8s.KubernetesConf.createExecutorConf(jsc.conf(), "1", sc.applicationId, jvm.scala.Option.empty(), 0)
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    SM = jvm.org.apache.spark.SecurityManager  # a new one with its defaults (SparkEnv's is not reachable by py4j)
    sm = SM(jsc.conf(), getattr(SM, "$lessinit$greater$default$2")(), getattr(SM, "$lessinit$greater$default$3")())
    built = jvm.org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBuilder().buildFromFeatures(
        conf, sm, None, profile)  # no Kubernetes client: no pod template file to read
    pod = json.loads(jvm.io.fabric8.kubernetes.client.utils.Serialization.asJson(built.pod().pod()))
    pod["spec"]["containers"] = [json.loads(jvm.io.fabric8.kubernetes.client.utils.Serialization.asJson(
        built.pod().container()))]
    with open(out + ".pod.tmp", "w") as f:
        json.dump(pod, f)
    os.rename(out + ".pod.tmp", out + ".pod")
    deadline = time.time() + 300
    while len(sc.statusTracker().getExecutorInfos()) < 2:  # the driver + the executor
        assert time.time() < deadline, "no executor registered"
        time.sleep(1)

    def where(x):
        import os, socket
        return (x % 3, (os.path.exists("/entrypoint"), os.getuid(), os.environ.get("SPARK_EXECUTOR_ID")))
    rows = sc.parallelize(range(300), 6).map(where).distinct().collect()
    total = sc.parallelize(range(300), 6).map(lambda x: (x % 3, x)).reduceByKey(lambda a, b: a + b).collect()
    with open(out, "w") as f:
        json.dump({"where": sorted(set(map(lambda r: tuple(r[1]), rows))), "sums": sorted(total)}, f)
    spark.stop()
''')


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    port, ui = free_port(), free_port()
    logs = tmp_path_factory.mktemp("spark-master")
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_HOME": os.path.dirname(pyspark.__file__)}
    p = subprocess.Popen([str(BIN / "spark-class"), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                          "--port", str(port), "--webui-port", str(ui)], env=env,
                         stdout=open(logs / "master.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (logs / "master.log").exists() and "I have been elected leader" in
                 (logs / "master.log").read_text(), 120, "the standalone master", every=0.5)
        yield f"spark://127.0.0.1:{port}"
    finally:
        p.terminate()
        p.wait(timeout=30)


def _spec(tmp: Path) -> Path:
    """A spec whose Spark stages would run on Kubernetes: the conf our stages give a k8s:// master."""
    spec = tmp / "spec.yaml"
    spec.write_text(textwrap.dedent("""\
        run: {name: contract, root: /fsx/llm-pipeline/var/runs}
        data: {inputs: [/fsx/in.jsonl]}
        services: {spark_master: "k8s://https://kubernetes.default.svc", spark_image: "localhost/llm-pipeline:latest",
                   spark_namespace: llm-pipeline, spark_service_account: spark}
        launcher: {shared_fs_claim: fsx-llm-pipeline, shared_fs_mount: /fsx}
        """))
    return spec


def _container_args(pod: dict) -> tuple[list[str], list[str]]:
    """podman arguments for the pod's container as the kubelet would start it here, and the container's args."""
    c = pod["spec"]["containers"][0]
    out = ["--network", "host"]
    for e in c.get("env", []):
        ref = (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        value = {"status.podIP": "127.0.0.1", "metadata.name": pod["metadata"].get("name") or "contract-exec-1"
                 }.get(ref, e.get("value", "")) if ref else e.get("value", "")
        assert ref in (None, "status.podIP", "metadata.name"), e
        out += ["-e", f"{e['name']}={value}"]
    for m in c.get("volumeMounts", []):
        if m["mountPath"] == "/fsx":
            continue  # the shared FS: the stage's data; this stage makes its data in the driver
        out += ["--tmpfs", f"{m['mountPath']}:mode=1777"]
    return out, list(c.get("command") or []) + list(c.get("args") or [])


def test_an_executor_pod_spark_would_create_runs_from_the_image(master, tmp_path):
    image = built_image()
    os.chmod(tmp_path, 0o755)
    out = tmp_path / "result.json"
    driver_log = open(tmp_path / "driver.log", "w")
    drv = subprocess.Popen([sys.executable, "-c", DRIVER, master, str(_spec(tmp_path)), str(out)], cwd=ROOT,
                           stdout=driver_log, stderr=subprocess.STDOUT,
                           env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1",
                                "PYSPARK_PYTHON": "python3"})  # the image's, as kubernetes_conf sets it
    boxes = Containers(image)
    try:
        pod_file = Path(str(out) + ".pod")
        wait_for(lambda: pod_file.exists() or drv.poll() is not None, 300, "the driver's executor pod spec", every=1)
        assert pod_file.exists(), (tmp_path / "driver.log").read_text()[-4000:]
        pod = json.loads(pod_file.read_text())
        podman_args, args = _container_args(pod)
        assert args == ["executor"], args  # Spark's contract with its image
        env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
        assert {"SPARK_DRIVER_URL", "SPARK_EXECUTOR_ID", "SPARK_EXECUTOR_CORES", "SPARK_EXECUTOR_MEMORY",
                "SPARK_APPLICATION_ID", "SPARK_EXECUTOR_POD_IP", "SPARK_RESOURCE_PROFILE_ID"} <= env, env
        assert pod["spec"]["containers"][0]["image"] == "localhost/llm-pipeline:latest"
        name = boxes.start(*podman_args, args=args)
        def done():  # the driver's end; the executor ends with it, so its exit alone is no failure
            if drv.poll() is None and not boxes.running(name):
                try:
                    drv.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"the executor exited, the driver did not finish:\n{boxes.logs(name)}")
            return drv.poll() is not None
        wait_for(done, 400, "the driver's stage", every=1)
        assert drv.returncode == 0, (tmp_path / "driver.log").read_text()[-4000:] + boxes.logs(name)
        result = json.loads(out.read_text())
        # every task ran in the image (its /entrypoint), as the image's user, in executor "1"
        assert result["where"] == [[True, 50000, "1"]], result
        assert result["sums"] == [[k, sum(x for x in range(300) if x % 3 == k)] for k in range(3)]
    finally:
        if drv.poll() is None:
            drv.kill()
            drv.wait(timeout=60)
        driver_log.close()
        boxes.close()


def test_a_driver_pod_runs_a_pyspark_app_from_the_image(tmp_path):
    """Cluster mode's driver pod: args ``driver --properties-file … --class … APP`` reach spark-submit in client mode
    with the pod's address as bind address (SPARK_DRIVER_BIND_ADDRESS, which Spark sets from status.podIP)."""
    image = built_image()
    os.chmod(tmp_path, 0o755)
    app = tmp_path / "app.py"
    app.write_text("from pyspark.sql import SparkSession\n"
                   "s = SparkSession.builder.getOrCreate()\n"
                   "print('contract-sum', s.sparkContext.parallelize(range(10), 2).sum())\n"
                   "print('contract-bind', s.conf.get('spark.driver.bindAddress'))\n")
    os.chmod(app, 0o644)
    boxes = Containers(image)
    try:
        r = boxes.run("--network", "host", "-e", "SPARK_DRIVER_BIND_ADDRESS=127.0.0.1", "-v", f"{tmp_path}:/app:ro",
                      args=["driver", "--master", "local[1]", "--conf", "spark.ui.enabled=false", "/app/app.py"],
                      timeout=300)
    finally:
        boxes.close()
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "contract-sum 45" in r.stdout and "contract-bind 127.0.0.1" in r.stdout, r.stdout[-2000:]
    r = Containers(image).run("--network", "none", args=["executor"], timeout=120)
    assert r.returncode == 2 and "SPARK_DRIVER_URL" in r.stderr, r.stderr  # one line naming what is missing
