"""The pipeline image (infra/image/Containerfile, `make image`): built here with podman from a Debian base made by
debootstrap, nothing pulled from a registry, then checked from the inside the way the cluster uses it. The CPU
flavour (TORCH_INDEX, as CI's venv) keeps the build small; the CUDA flavour differs only in torch's wheels.
The whole demo DAG inside the image is `make image-demo` (its wall time is in docs/measured.md)."""
import hashlib
import os
import subprocess

import pytest

from conftest import ROOT

BUILD = ROOT / "infra" / "image" / "build.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def sh(*args: str, timeout: int = 1800, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def image() -> str:
    """The CPU image's id, built (or reused from podman's layer cache) by `make image`'s script."""
    r = sh(str(BUILD), "build", env={"TORCH_INDEX": os.environ.get("TORCH_INDEX") or CPU_INDEX})
    if r.returncode == 2 and "image: " in r.stderr:  # no podman and no way to install it: the user's part
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return (ROOT / "var/image/iid-cpu").read_text().strip()


def run_in(image: str, *cmd: str) -> subprocess.CompletedProcess:
    return sh(str(BUILD), "run", "--rm", "--network", "none", image, *cmd, timeout=600)


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
           '{{index .Labels "io.llm-pipeline.torch"}}', image, env={"CONTAINERS_CONF": str(ROOT / "var/image/containers.conf")})
    assert r.returncode == 0, r.stderr
    revision, lock, flavour = r.stdout.split()
    head = sh("git", "rev-parse", "--short", "HEAD").stdout.strip()
    assert revision.split("-")[0] == head
    assert lock == hashlib.sha256((ROOT / "requirements.lock").read_bytes()).hexdigest()
    assert flavour == "cpu"
    tags = sh("podman", "image", "inspect", "--format", "{{.RepoTags}}", image).stdout
    assert "localhost/llm-pipeline:latest" in tags and f"localhost/llm-pipeline:{revision}" in tags


def test_the_build_ca_stays_out_of_the_image(image):
    """The host's CA bundle is a build secret: present during the build, absent from every layer."""
    r = run_in(image, "sh", "-c", "ls /run/secrets 2>/dev/null | wc -l; env | grep -c PIP_CERT || true")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "0"], r.stdout
