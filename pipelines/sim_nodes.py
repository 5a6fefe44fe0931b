"""Simulated cluster nodes on one machine (for the multi-node tests and benchmarks).

A node is a Linux mount namespace (``unshare --mount``) in which the node-local path (``checkpoint.l0``) is that
node's own disk, a directory bind-mounted at the same path string on every node. Everything else — the shared
filesystem (L1, run.root), loopback (rendezvous, the S3 endpoint) — is common, as on a cluster. Losing a node
kills every process of its namespace; a replacement is a fresh namespace over an empty disk. A supervisor starts
a node's command again when it exits non-zero, as the training operator's ``restartPolicy: OnFailure`` would.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional


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
                 restart_on_failure: bool = True, cwd: Optional[Path] = None):
        self.name, self.disk, self.local_path, self.cmd, self.env, self.log = name, disk, local_path, cmd, env, log
        self.cwd, self.restart_on_failure = cwd, restart_on_failure
        self.disk.mkdir(parents=True, exist_ok=True)
        self.local_path.mkdir(parents=True, exist_ok=True)
        self.codes: list[int] = []
        self.proc: Optional[subprocess.Popen] = None
        self.ns: Optional[str] = None
        self._lost = threading.Event()
        self._start()
        self._thread = threading.Thread(target=self._supervise, daemon=True)
        self._thread.start()

    def _start(self) -> None:
        script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
                                          f"node-{self.name}", str(self.disk), str(self.local_path), *self.cmd],
                                         env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT)
        mine = _mount_ns(os.getpid())
        end = time.time() + 10
        while time.time() < end:  # unshare has exec'ed into the new namespace once its link differs from ours
            ns = _mount_ns(self.proc.pid)
            if ns and ns != mine:
                self.ns = ns
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        raise RuntimeError(f"node {self.name}: no mount namespace (exit {self.proc.poll()}): {self.log.read_text()[-500:]}")

    def _supervise(self) -> None:
        while not self._lost.is_set():
            code = self.proc.wait()
            if self._lost.is_set():
                return
            self.codes.append(code)
            if code == 0 or not self.restart_on_failure:
                return
            with open(self.log, "a") as f:
                f.write(f"\n[harness] node {self.name} exited {code}: starting it again (restartPolicy OnFailure)\n")
            self._start()

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def pids(self) -> list[int]:
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and _mount_ns(int(p)) == self.ns]

    def lose(self) -> None:
        """The host is gone: SIGKILL every process of its namespace."""
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
