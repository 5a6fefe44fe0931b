"""The pipeline image as the tests build and run it (tests/test_image.py and the contract tests): built once by
`make image`'s script with the CPU torch (TORCH_INDEX, as CI's venv), under a file lock so that two test files on
two workers never build at the same time (the second reuses podman's layer cache), and run with this machine's
podman settings."""
import fcntl
import os
import signal
import subprocess
import uuid

import pytest

from conftest import ROOT, TEST_LIMIT_S, bound_test

BUILD = ROOT / "infra" / "image" / "build.sh"
BUILD_S = 1800  # a build's bound (a first one, debootstrap and all, took 6 min on a loaded 2-core machine)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CONF = {"CONTAINERS_CONF": str(ROOT / "var/image/containers.conf")}


def sh(*args: str, timeout: int = 1800, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run to completion within ``timeout``; on timeout the whole process group is killed (a build's children too)."""
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(args, p.returncode, out, err)


def built_image() -> str:
    """The CPU image's id, built (or reused from podman's layer cache) by `make image`'s script; skips where this
    machine cannot build images."""
    (ROOT / "var/image").mkdir(parents=True, exist_ok=True)
    # a build that failed or ran out of time in this test run fails the next file at once (each would try again
    # for up to 30 min); named for the test run (conftest's LLMP_TEST_RUN)
    failed = ROOT / "var/image" / f"failed-{os.environ['LLMP_TEST_RUN']}"
    bound_test(2 * BUILD_S + TEST_LIMIT_S)  # the other worker's build, then this one's, then the test
    with open(ROOT / "var/image/build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if failed.is_file():
            pytest.fail(f"the image build failed earlier in this test run: {failed.read_text()[-3000:]}")
        try:
            r = sh(str(BUILD), "build", timeout=BUILD_S,
                   env={"TORCH_INDEX": os.environ.get("TORCH_INDEX") or CPU_INDEX})
        except subprocess.TimeoutExpired as e:
            failed.write_text(f"{e}")
            raise
        # no podman and no way to install it, or no root for the base: this machine's limit, not the image's fault
        if r.returncode == 2 and ("image: missing tools" in r.stderr or "needs root" in r.stderr):
            pytest.skip(r.stderr.strip().splitlines()[-1])
        if r.returncode != 0:
            failed.write_text(out := r.stdout[-3000:] + r.stderr[-3000:])
            pytest.fail(out)
        return (ROOT / "var/image/iid-cpu").read_text().strip()


def run_in(image: str, *cmd: str) -> subprocess.CompletedProcess:
    """``cmd`` in a fresh container of ``image`` with no network; the container is removed whatever happens."""
    return Containers(image).run("--network", "none", args=list(cmd))


def podman(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return sh("podman", *args, timeout=timeout, env=CONF)


class Containers:
    """Detached containers of one test, each named, all removed by ``close()`` (a fixture's teardown)."""

    def __init__(self, image: str):
        self.image, self.names = image, []

    def start(self, *podman_args: str, args: list[str]) -> str:
        """``podman run -d PODMAN_ARGS IMAGE ARGS``: ARGS go to the image's entrypoint, as a pod's ``args`` do."""
        name = f"llmp-contract-{uuid.uuid4().hex[:12]}"
        self.names.append(name)
        r = podman("run", "-d", "--name", name, *podman_args, self.image, *args)
        assert r.returncode == 0, r.stderr[-3000:]
        return name

    def run(self, *podman_args: str, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
        """A container run to its end (a Job's pod), removed after."""
        name = f"llmp-contract-{uuid.uuid4().hex[:12]}"
        try:
            return podman("run", "--rm", "--name", name, *podman_args, self.image, *args, timeout=timeout)
        finally:
            podman("rm", "-f", "--ignore", name, timeout=120)

    def exec(self, name: str, argv: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
        """A probe's ``exec`` command, in the running container as the kubelet runs it."""
        return podman("exec", name, *argv, timeout=timeout)

    def running(self, name: str) -> bool:
        return podman("inspect", "--format", "{{.State.Running}}", name, timeout=120).stdout.strip() == "true"

    def alive(self, name: str, check):
        """``check()``'s value while the container runs; fails at once, with its log, when it has exited."""
        got = check()
        if not got and not self.running(name):
            pytest.fail(f"container {name} exited:\n{self.logs(name)}")
        return got

    def logs(self, name: str) -> str:
        r = podman("logs", name, timeout=120)
        return (r.stdout + r.stderr)[-4000:]

    def close(self) -> None:
        for name in self.names:
            podman("rm", "-f", "-t", "5", "--ignore", name, timeout=120)
