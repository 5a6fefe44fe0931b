"""Simulated cluster nodes on one machine (for the multi-node tests and benchmarks).

A node is a Linux mount namespace (``unshare --mount``) in which the node-local path (``checkpoint.l0``) is that
node's own disk, a directory bind-mounted at the same path string on every node. Everything else — the shared
filesystem (L1, run.root), loopback (rendezvous, the S3 endpoint) — is common, as on a cluster. Losing a node
kills every process of its namespace; a replacement is a fresh namespace over an empty disk. A supervisor starts
a node's command again when it exits non-zero, as the training operator's ``restartPolicy: OnFailure`` would.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

from pipelines.procs import free_port


def namespaces_permitted() -> Optional[str]:
    """None when this user may create mount namespaces with bind mounts, else the reason."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run(["unshare", "--mount", "--", "sh", "-c", "mount --bind / /mnt 2>&1 || exit 3"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a mount namespace with a bind mount here (root needed): {probe.stdout.strip()[:200]}"
    return None


def _mount_ns(pid: int) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


class Node:
    """One host: ``cmd`` runs in a namespace of its own where ``local_path`` is ``disk``."""

    def __init__(self, name: str, disk: Path, local_path: Path, cmd: list[str], env: dict, log: Path,
                 restart_on_failure: bool = True, cwd: Optional[Path] = None, backoff_limit: Optional[int] = None,
                 more_binds: tuple[tuple[Path, Path], ...] = ()):
        self.name, self.disk, self.local_path, self.cmd, self.env, self.log = name, disk, local_path, cmd, env, log
        self.cwd, self.restart_on_failure = cwd, restart_on_failure
        self.backoff_limit = backoff_limit  # restarts after a failure before the node gives up (None: no limit)
        # (this node's directory, the path it is seen at); the others before the node-local path, which may hide them
        self.binds = (*more_binds, (disk, local_path))
        for src, dest in self.binds:
            src.mkdir(parents=True, exist_ok=True)
            dest.mkdir(parents=True, exist_ok=True)
        self.codes: list[int] = []
        self.proc: Optional[subprocess.Popen] = None
        self.ns: Optional[str] = None
        self._lost = threading.Event()
        self._restarting = threading.Lock()  # a restart and a loss never interleave (a lost node never comes back)
        self._start()
        self._thread = threading.Thread(target=self._supervise, daemon=True)
        self._thread.start()

    def _start(self) -> None:
        script = 'while [ "$1" != -- ]; do mount --rbind "$1" "$2" || exit 98; shift 2; done; shift; exec "$@"'
        binds = [str(x) for pair in self.binds for x in pair]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
                                          f"node-{self.name}", *binds, "--", *self.cmd],
                                         env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT)
        mine = _mount_ns(os.getpid())
        end = time.monotonic() + 10
        while time.monotonic() < end:  # unshare has exec'ed into the new namespace once its link differs from ours
            ns = _mount_ns(self.proc.pid)
            if ns and ns != mine:
                self.ns = ns
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        if self.proc.poll() is None:  # not left running outside any node
            self.proc.kill()
            self.proc.wait(timeout=30)
        raise RuntimeError(f"node {self.name}: no mount namespace (exit {self.proc.poll()}): {self.log.read_text()[-500:]}")

    def _supervise(self) -> None:
        while not self._lost.is_set():
            code = self.proc.wait()
            with self._restarting:
                if self._lost.is_set():
                    return
                self.codes.append(code)
                if code == 0 or not self.restart_on_failure or \
                        (self.backoff_limit is not None and len(self.codes) > self.backoff_limit):
                    return
                with open(self.log, "a") as f:
                    f.write(f"\n[harness] node {self.name} exited {code}: starting it again (restartPolicy OnFailure)\n")
                self._start()

    @property
    def finished(self) -> bool:
        """Its command ended for good: exit 0, a failure not started again, or the node lost."""
        return not self._thread.is_alive()

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def pids(self) -> list[int]:
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and _mount_ns(int(p)) == self.ns]

    def lose(self) -> None:
        """The host is gone: SIGKILL every process of its namespace (after a restart under way, of the new one)."""
        with self._restarting:
            self._lost.set()
        for _ in range(20):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        self.proc.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        """The final exit code (after any restarts)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"node {self.name} still running after {timeout} s; its log: {self.log}")
        return self.codes[-1] if self.codes else self.proc.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def under_tmp() -> list[Path]:
    """The project checkout and the Python environment, where they lie under /tmp (a node's /tmp is its own)."""
    tmp = Path("/tmp")
    found = sorted({p for p in (Path(__file__).resolve().parents[1], Path(sys.prefix).resolve())
                    if p.is_relative_to(tmp) and p != tmp})
    return [p for p in found if not any(p != q and p.is_relative_to(q) for q in found)]


class SparkCluster:
    """A Spark standalone master and ``workers`` workers of ``cores`` cores each, every worker a node of its own
    (:class:`Node`): a private ``/tmp`` (its work and shuffle directories) and a private, empty ``private_dirs``
    (e.g. the project's ``var/``), sharing only what lies elsewhere (``run.root`` and the inputs on a shared
    directory, which must not be under ``/tmp``) and loopback. ``root`` (this machine's bookkeeping: the nodes'
    directories, logs) must not be under ``/tmp`` either. ``pin``: node i's processes run on CPUs
    ``[i·cores, (i+1)·cores)`` only (a machine of its own, for benchmarks). ``master_url`` is what the stages take
    as ``services.spark_master``."""

    def __init__(self, root: Path, workers: int = 2, cores: int = 1, memory: str = "2g",
                 private_dirs: tuple[Path, ...] = (), pin: bool = False):
        self.root = root
        bin_dir = Path(sys.executable).parent
        env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
        self.port, self.ui = free_port(), free_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        (root / "logs").mkdir(parents=True, exist_ok=True)
        self.master = subprocess.Popen([str(bin_dir / "spark-class"), "org.apache.spark.deploy.master.Master",
                                        "--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(self.ui)],
                                       env=env, stdout=open(root / "logs" / "master.log", "w"),
                                       stderr=subprocess.STDOUT)
        self.nodes = []
        try:  # a node that fails to start stops the master and the nodes before it
            self._start_nodes(workers, cores, memory, private_dirs, pin, env, bin_dir)
            self.wait_alive(workers)
        except BaseException:
            self.stop()
            raise

    def _start_nodes(self, workers: int, cores: int, memory: str, private_dirs: tuple[Path, ...], pin: bool,
                     env: dict, bin_dir: Path) -> None:
        root = self.root
        for i in range(workers):
            cpus = ",".join(str(i * cores + c) for c in range(cores))  # pin: node i gets CPUs of its own
            cmd = ["taskset", "-c", cpus] if pin else []
            cmd += [str(bin_dir / "spark-class"), "org.apache.spark.deploy.worker.Worker", self.master_url,
                   "--host", "127.0.0.1", "--cores", str(cores), "--memory", memory,
                   "--webui-port", str(free_port()), "--work-dir", "/tmp/spark-work"]
            binds = tuple((root / f"node{i}" / d.name, d) for d in private_dirs)
            # what the node must still see under /tmp (a checkout there, its venv) is carried into its own /tmp
            binds += tuple((p, root / f"node{i}" / "tmp" / p.relative_to("/tmp")) for p in under_tmp())
            self.nodes.append(Node(f"spark{i}", root / f"node{i}" / "tmp", Path("/tmp"), cmd,
                                   {**env, "SPARK_WORKER_DIR": "/tmp/spark-work"}, root / "logs" / f"worker{i}.log",
                                   restart_on_failure=False, more_binds=binds))

    def state(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui}/json/", timeout=5) as r:  # noqa: S310 - loopback
            return json.loads(r.read())

    def wait_alive(self, workers: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if self.state().get("aliveworkers") == workers:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{workers} Spark workers not alive after {timeout} s; logs in {self.root / 'logs'}")

    def stop(self) -> None:
        for n in self.nodes:
            n.lose()
        self.master.terminate()
        self.master.wait(timeout=30)

    def __enter__(self) -> "SparkCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
