"""The pipeline image (infra/image/Containerfile, `make image`): built here with podman from a Debian base made by
debootstrap, nothing pulled from a registry, then checked from the inside the way the cluster uses it. The CPU
flavour (TORCH_INDEX, as CI's venv) keeps the build small; the CUDA flavour differs only in torch's wheels.
The whole demo DAG inside the image is `make image-demo` (its wall time is in docs/measured.md)."""
import hashlib
import os
from pathlib import Path

import pytest

from conftest import ROOT
from image_build import CONF, built_image, run_in, sh



@pytest.fixture(scope="module")
def image() -> str:
    return built_image()


def test_image_lists_the_pipeline_dags(image):
    r = run_in(image, "airflow", "dags", "list", "--output", "plain")
    assert r.returncode == 0, r.stderr[-3000:]
    dags = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
    assert {"llm_pipeline", "data_curation", "training", "evaluation"} <= dags, r.stdout


def test_image_runs_torch_spark_mlflow_and_java_17_as_a_non_root_user(image):
    r = run_in(image, "sh", "-c", "python -c 'import torch, pyspark, mlflow, pipelines.stages; print(torch.__version__)'"
                                  " && java -version 2>&1 | head -1 && id -u")
    assert r.returncode == 0, r.stderr[-3000:]
    torch_version, java, uid = r.stdout.strip().splitlines()[-3:]
    assert torch_version.startswith("2.13.0"), torch_version
    assert '"17.' in java, java
    assert uid == "50000"


def test_image_labels_name_the_revision_and_the_lock(image):
    r = sh("podman", "image", "inspect", "--format",
           '{{index .Labels "org.opencontainers.image.revision"}} {{index .Labels "io.llm-pipeline.lock.sha256"}} '
           '{{index .Labels "io.llm-pipeline.torch"}}', image, env=CONF)
    assert r.returncode == 0, r.stderr
    revision, lock, flavour = r.stdout.split()
    head = sh("git", "rev-parse", "--short", "HEAD").stdout.strip()
    assert revision.split("-")[0] == head
    assert lock == hashlib.sha256((ROOT / "requirements.lock").read_bytes()).hexdigest()
    assert flavour == "cpu"
    tags = sh("podman", "image", "inspect", "--format", "{{.RepoTags}}", image).stdout
    assert "localhost/llm-pipeline:latest" in tags and f"localhost/llm-pipeline:{revision}" in tags


def test_no_build_secret_and_no_generated_airflow_secret_is_in_the_image(image):
    """The host's CA bundle is a build secret: no file of the image has its bytes, no layer's command names it. The
    airflow.cfg that the build's `db migrate` wrote (a fresh fernet key and JWT secret) is not kept: each container
    makes its own."""
    ca = Path(os.environ.get("HOST_CA", "/etc/ssl/certs/ca-certificates.crt"))
    if not ca.is_file():
        pytest.skip(f"no CA bundle at {ca} was passed to the build")
    digest, size = hashlib.sha256(ca.read_bytes()).hexdigest(), ca.stat().st_size
    r = run_in(image, "sh", "-c", f"find / -xdev -type f -size {size}c -exec sha256sum {{}} + 2>/dev/null; "
                                  "ls var/airflow; env")
    assert r.returncode == 0, r.stderr[-3000:]
    assert digest not in r.stdout, "the build's CA bundle was copied into the image"
    assert "airflow.cfg" not in r.stdout and "PIP_CERT" not in r.stdout, r.stdout[-2000:]
    # the layers' commands name the secret's mount point (/run/secrets/hostca), never the host's file; the image's
    # environment has no certificate setting of the build
    history = sh("podman", "history", "--no-trunc", "--format", "{{.CreatedBy}}", image, env=CONF)
    assert history.returncode == 0 and "/run/secrets/hostca" in history.stdout, history.stderr
    assert str(ca) not in history.stdout
    config_env = sh("podman", "image", "inspect", "--format", "{{.Config.Env}}", image, env=CONF).stdout
    assert "PIP_CERT" not in config_env and "hostca" not in config_env, config_env


def test_the_entrypoint_gives_another_uid_a_home_keeps_airflow_words_and_no_setuid_file(image):
    """/entrypoint as pods meet it: a uid with no passwd entry (group 0) gets one, with a writable HOME; a first word
    that is an Airflow group (`users`, also a program on PATH) is Airflow's; no file of the image is setuid or
    setgid, so the group-writable /etc/passwd is no way to root."""
    from image_build import Containers

    boxes = Containers(image)
    # --passwd=false: as Kubernetes' runtimes, podman adds no passwd entry for the uid (by default it would)
    r = boxes.run("--network", "none", "--passwd=false", "--user", "12345:0", args=[
        "sh", "-c", "id -un; echo \"$HOME\"; touch \"$HOME/w\" && echo writable; "
                    "find / -xdev -type f -perm /6000 2>/dev/null | wc -l"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # sh is a program on PATH: run as it is, after the entrypoint's passwd entry
    name, home, writable, setuid = r.stdout.split()[-4:]
    assert (name, home, writable, setuid) == ("default", "/home/airflow", "writable", "0"), r.stdout
    r = boxes.run("--network", "none", "-e", "CONNECTION_CHECK_MAX_COUNT=0", args=["users", "--help"], timeout=300)
    assert r.returncode == 0 and "airflow users" in r.stdout, (r.stdout + r.stderr)[-2000:]
    r = boxes.run("--network", "none", "-e", "CONNECTION_CHECK_MAX_COUNT=x", args=["airflow", "version"], timeout=300)
    assert r.returncode == 2 and "CONNECTION_CHECK_MAX_COUNT=x is not a whole number" in r.stderr, r.stderr[-2000:]
