"""Training on several nodes whose L0 disks are private (issue 22), on one machine.

Each node is a mount namespace where ``checkpoint.l0`` is the node's own disk (``tests/nodes.py``); L1 is a
directory every node shares, L2 the S3 endpoint on loopback; each node runs torchrun as a PyTorchJob replica does
(c10d rendezvous on 127.0.0.1), started again when it exits non-zero. Lose a host = SIGKILL every process of its
namespace; a replacement = a fresh namespace over an empty disk.
"""
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.spec import load_spec
from pipelines.storage import faults
from pipelines.train.ckpt import protocol as ck
from pipelines.train.ckpt import local as ckpt_local
from pipelines.train.ckpt import s3_tier as ckpt_s3
from pipelines.train.ckpt import tiers as ckpt_tiers

from conftest import ROOT, free_port
from pipelines.sim_nodes import Node, namespaces_permitted
from test_resilience import TINY, _assert_bitwise_equal, _tok, _wait_for

why = namespaces_permitted()
pytestmark = pytest.mark.skipif(why is not None, reason=f"simulated nodes need mount namespaces: {why}")

STEPS = 150
SUB = "run/key"


class Cluster:
    """One training job's world: the shared directory, the nodes' disks, the job's spec and token shards."""

    def __init__(self, base: Path, tok, s3: str, bucket: str, sets=()):
        self.base, self.tok = base, tok
        self.l0 = base / "l0"  # the same path on every node; each node mounts its own disk here
        self.shared = base / "shared"
        self.out = self.shared / "out"
        self.spec_sets = TINY + [f"train.steps={STEPS}", "train.ckpt_every=10", "launcher.nproc_per_node=1", "launcher.nnodes=2",
                                 f"checkpoint.l0={self.l0}", f"checkpoint.l1={self.shared}/l1",
                                 f"run.root={self.shared}/root", f"services.s3_endpoint_url={s3}",
                                 f"services.s3_bucket={bucket}", *sets]
        self.spec = load_spec(None, self.spec_sets, env={})
        self.spec_file = self.shared / "spec.yaml"
        self.shared.mkdir(parents=True, exist_ok=True)
        self.spec_file.write_text(self.spec.to_yaml())
        self.port = free_port()
        self.disks = 0
        self.nodes: list[Node] = []

    def new_disk(self) -> Path:
        self.disks += 1
        return self.base / "disks" / f"disk-{self.disks}"

    def cmd(self, nnodes: str, rank: int, extra=()) -> list[str]:
        """The contract: torchrun … -m pipelines.train.trainer --spec S --tokenize-manifest M --out DIR --ckpt-root."""
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
                "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                "--rdzv-id", "job", "--rdzv-conf", "last_call_timeout=3,join_timeout=120", "--max-restarts", "5",
                "-m", "pipelines.train.trainer", "--spec", str(self.spec_file), "--tokenize-manifest", self.tok.path,
                "--out", str(self.out), "--ckpt-root", str(self.l0 / SUB), *extra]

    def start(self, rank: int, disk: Path, nnodes: str = "2", delay: float = 0.0, extra=(), env=None) -> Node:
        env = {**os.environ, "LLMP_PROGRESS": "0", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LLMP_FAULT_STEP_DELAY_S": str(delay), **(env or {})}
        log = self.base / f"node-{len(self.nodes)}-rank{rank}.log"
        node = Node(f"{rank}", disk, self.l0, self.cmd(nnodes, rank, extra), env, log, cwd=ROOT)
        self.nodes.append(node)
        return node

    def l1_committed(self, step: int) -> bool:
        return (self.shared / "l1" / SUB / ck.step_name(step) / ck.COMMIT).is_file()

    def newest_l1(self) -> int:
        return max(ckpt_tiers.list_steps(self.spec, SUB, ("L1",))["L1"], default=0)

    def finish(self, timeout: float = 300) -> dict:
        for n in self.nodes:
            if not n.lost:
                assert n.wait(timeout) == 0, n.output()[-4000:]
        return json.loads((self.out / "result.json").read_text())

    def logs(self) -> str:
        return "\n".join(n.output() for n in self.nodes)

    def final_state(self, step: int = STEPS) -> dict:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        d = self.shared / "l1" / SUB / ck.step_name(step)
        ck.verify_local(d)
        dcp_to_torch_save(d, self.base / "final.pt")
        return torch.load(self.base / "final.pt", weights_only=False)  # our own test file, just written

    def close(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.lose()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    home = tmp_path_factory.mktemp("tok")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMP_HOME", str(home))
        return _tok(home)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tok, s3_server):
    """The uninterrupted 2-node run with node-local L0: 150 steps, a checkpoint every 10."""
    c = Cluster(tmp_path_factory.mktemp("ref"), tok, s3_server, "nodes-ref")
    try:
        for r in (0, 1):
            c.start(r, c.new_disk())
        res = c.finish()
        return c, res, c.final_state()
    finally:
        c.close()


def test_two_nodes_with_node_local_l0_complete_and_commit_globally_on_l1_and_l2(reference, tmp_path):
    c, res, state = reference
    assert res["steps"] == STEPS and res["world_size"] == 2 and res["resumed_from"] is None
    logs = c.logs()
    assert "L0 is node-local: 2 nodes each commit and promote their own part" in logs
    # each disk holds only its own node's part: rank r's shard on disk r, never the other's
    disks = sorted((c.base / "disks").iterdir())
    parts = {}
    for d in disks:
        man = ck.verify_local(d / SUB / ck.step_name(STEPS))
        parts[man["part"]] = set(man["files"])
        assert man["parts"] == 2
    assert "__0_0.distcp" in parts[0] and "__1_0.distcp" not in parts[0]
    assert parts[1] == {"__1_0.distcp"}
    # globally committed on L1 (all parts, merged manifest) and on L2; retention kept the windows
    final = c.shared / "l1" / SUB / ck.step_name(STEPS)
    man = ck.verify_local(final)
    assert man["parts"] == 2 and man["part_of"]["__1_0.distcp"] == 1 and ckpt_local.missing_shards(final) == []
    uri = ckpt_tiers.tier_locations(c.spec, f"{SUB}/{ck.step_name(STEPS)}")["L2"]
    assert ckpt_s3.verify_s3(c.spec, uri)["files"] == man["files"]
    steps = ckpt_tiers.list_steps(c.spec, SUB)
    assert steps["L1"][-1] == STEPS and len(steps["L1"]) == c.spec.checkpoint.keep_l1 and STEPS in steps["L2"]
    assert sorted(p.name for p in (disks[1] / SUB).iterdir() if not p.name.startswith(".")) == \
        ["step-000140", "step-000150"]  # keep_l0 = 2 on each node's own disk
    # the export contract reads the L1 step directory
    from pipelines.train.checkpoint import main as ck_main

    assert ck_main(["export", str(final), str(tmp_path / "w.pt")]) == 0
    assert set(torch.load(tmp_path / "w.pt", weights_only=True)) == set(state["model"])


@pytest.mark.parametrize("lost", [1, 0])
def test_lose_a_node_get_a_replacement_with_an_empty_disk_and_lose_no_step(reference, tok, s3_server,
                                                                         tmp_path, lost):
    _, ref_res, want = reference
    c = Cluster(tmp_path, tok, s3_server, f"nodes-lost{lost}")
    try:
        nodes = [c.start(r, c.new_disk(), delay=0.04) for r in (0, 1)]
        _wait_for(lambda: c.l1_committed(10), 120, "the first COMMIT on L1")
        nodes[lost].lose()
        c.start(lost, c.new_disk(), delay=0.0)  # another host, an empty L0
        res = c.finish()
    finally:
        c.close()
    logs = c.logs()
    assert res["resumed_from"]["step"] >= 10, logs[-3000:]
    # the replacement read everything from L1; the surviving node read its own part from its L0 (unless it was
    # restarted by the harness after losing the rendezvous store, with its disk kept)
    assert res["resumed_from"]["parts"][str(lost)] == "L1"
    assert "part-1 from L1" in logs or "part-0 from L1" in logs
    _assert_bitwise_equal(want, c.final_state(), f"lost node {lost}")
    assert res["consumed_samples"] == ref_res["consumed_samples"]


def _corrupt(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(64)
        b = f.read(1)
        f.seek(64)
        f.write(bytes([b[0] ^ 0xFF]))


def test_restore_takes_each_part_from_its_nearest_tier(reference, tok, s3_server, tmp_path):
    """A corrupt part on one node's L0 → that part from L1, the other from its node's L0; every L0 lost → L1;
    L1 removed too → every node downloads its own part from L2. The run still ends bitwise equal."""
    _, _, want = reference
    c = Cluster(tmp_path, tok, s3_server, "nodes-tiers", sets=["checkpoint.l2_prefix=ckpts/tiers"])
    disks = [c.new_disk(), c.new_disk()]
    try:
        def run_until_committed(step: int, fresh: bool) -> None:
            for r in (0, 1):
                c.start(r, c.new_disk() if fresh else disks[r], delay=0.04)
            _wait_for(lambda: c.l1_committed(step), 120, f"step {step} committed on L1")
            for n in c.nodes[-2:]:
                n.lose()  # both hosts down at once

        run_until_committed(20, fresh=False)
        newest = c.newest_l1()
        for d in disks:  # node 1's parts (its own disk) of every step from the newest globally committed one
            for step_dir in (d / SUB).glob("step-*"):
                if ck.read_local_manifest(step_dir)["part"] == 1 and ck.parse_step(step_dir.name) >= newest:
                    _corrupt(step_dir / "__1_0.distcp")
        run_until_committed(newest + 20, fresh=False)
        logs = c.logs()
        assert f"{ck.step_name(newest)}: part-0 from L0, part-1 from L1" in logs, logs[-4000:]
        assert "__1_0.distcp sha256" in logs  # the corrupt part was seen and skipped

        second = c.newest_l1()  # every L0 gone: fresh disks, restore from L1
        run_until_committed(second + 20, fresh=True)
        assert f"{ck.step_name(second)}: part-0 from L1, part-1 from L1" in c.logs()

        # L1 removed too: each node downloads its own part of the newest step on L2 (L2's merge follows L1's, so
        # the newest L1 step may not have reached L2 when the hosts went down)
        third = max(ckpt_tiers.list_steps(c.spec, SUB, ("L2",))["L2"])
        assert third >= second
        shutil.rmtree(c.shared / "l1")
        for r in (0, 1):
            c.start(r, c.new_disk())
        res = c.finish()
        logs = c.logs()
        assert f"{ck.step_name(third)}: part-0 from L2, part-1 from L2" in logs
        assert res["resumed_from"] == {"step": third, "tier": "L2", "parts": {"0": "L2", "1": "L2"}}
    finally:
        c.close()
    _assert_bitwise_equal(want, c.final_state(), "after every tier fallback")


def test_elastic_two_nodes_to_one_and_back_keep_the_global_batch(reference, tok, s3_server, tmp_path):
    _, ref_res, _ = reference
    c = Cluster(tmp_path, tok, s3_server, "nodes-elastic", sets=["train.global_batch=8", "train.grad_accum=1"])
    try:
        # node a alone is held 30 s after its 20th step on one node (a one-shot rule of the job's one-rank phase):
        # the returning node (a Python start, torch's import, the rendezvous) joins before a could end alone
        state = tmp_path / "faults"
        hold = {"at": "step", "do": "slow", "seconds": 30, "nth": 20, "world": 1, "times": 1}
        a = c.start(0, c.new_disk(), nnodes="1:2", delay=0.05,
                    env={"LLMP_FAULTS": json.dumps([hold]), "LLMP_FAULTS_STATE": str(state)})
        b = c.start(1, c.new_disk(), nnodes="1:2", delay=0.05)
        _wait_for(lambda: c.l1_committed(20), 120, "step 20 committed on L1")
        b.lose()  # the job shrinks to one node and goes on
        _wait_for(lambda: "grad_accum 2 keeps the global batch of 8" in a.output(), 120, "the shrink")
        _wait_for(lambda: faults.fired(state), 120, "20 steps on one node")
        c.start(1, c.new_disk(), nnodes="1:2", delay=0.05)  # a node comes back: the job grows again
        res = c.finish()
    finally:
        c.close()
    assert res["world_size"] == 2 and res["global_batch"] == 8 and res["grad_accum"] == 1
    assert res["consumed_samples"] == STEPS * 8
    got = np.array(json.loads((c.out / "losses.json").read_text()))
    ref = np.array(json.loads((reference[0].out / "losses.json").read_text()))
    assert np.array_equal(got[:, 0], np.arange(1, STEPS + 1))
    np.testing.assert_allclose(got[:, 1], ref[:, 1], rtol=0, atol=5e-4)  # same samples, the same curve
