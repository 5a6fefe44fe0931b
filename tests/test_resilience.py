"""Training that survives failure (issue 12): real torchrun/gloo processes, real SIGKILLs, a real S3 endpoint.

* kill -9 one rank → torchrun restarts the ranks, they resume; kill the whole launcher → the same command
  resumes: both end bitwise equal (model and optimizer) to the uninterrupted run;
* a corrupt or missing copy → restore falls back L0 → L1 → L2, then to an older step, and says why;
* a promotion killed mid-upload leaves no COMMIT; the next completes it and aborts the leftover parts;
* elastic: 2 → 1 and 1 → 2 ranks (DDP, FSDP2) continue the same global sample order and loss curve;
* loss spikes / non-finite steps roll back, skip the batch, and the run completes;
* retention never removes the newest verified copy; an async save returns before its COMMIT.
"""
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from pipelines.data import tokenize
from pipelines.spec import load_spec
from pipelines.storage.s3 import part_size_used
from pipelines.train.ckpt import protocol as ck
from pipelines.train.ckpt.dcp_read import load_plain_model
from pipelines.train.ckpt import local as ckpt_local
from pipelines.train.ckpt import s3_tier as ckpt_s3
from pipelines.train.ckpt import tiers as ckpt_tiers
from pipelines.train.resilience import SpikeGuard, young_daly_steps

from conftest import ROOT, c4_docs, wait_for
from test_tokenize import _filter_manifest

TINY = ["tokenizer.vocab_size=500", "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=32",
        "train.micro_batch=4", "train.warmup_steps=2", "train.lr=0.01", "train.log_every=5"]


_TOKENIZED: dict[tuple, object] = {}  # sets → the tokenize manifest, one build per test process


def _tok(home, sets=TINY):
    """The tiny corpus tokenized with ``sets``: built once per test process (a worker runs many files) in a folder
    of its own, removed at exit; the tests only read it (``home`` is each test's own state, not used here)."""
    key = tuple(sets)
    if key not in _TOKENIZED:
        where = Path(tempfile.mkdtemp(prefix="llmp-tok-"))
        atexit.register(shutil.rmtree, where, True)
        before = os.environ.get("LLMP_HOME")
        os.environ["LLMP_HOME"] = str(where)  # the stage's relative paths resolve under it
        try:
            docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(c4_docs(120))]
            _TOKENIZED[key] = tokenize.run(load_spec(None, sets, env={}), _filter_manifest(where, docs))
        finally:
            os.environ.pop("LLMP_HOME") if before is None else os.environ.update(LLMP_HOME=before)
    return _TOKENIZED[key]


def _launch_cmd(tok, root: Path, sets: list[str]) -> list[str]:
    """The contract: python -m pipelines.train.launch --tokenize-manifest M --output DIR --set … (all under root)."""
    roots = [f"run.root={root}", f"checkpoint.l0={root}/l0", f"checkpoint.l1={root}/l1"]
    return [sys.executable, "-m", "pipelines.train.launch", "--tokenize-manifest", tok.path, "--output",
            str(root / "train")] + [a for kv in TINY + sets + roots for a in ("--set", kv)]


def _env(**extra) -> dict:
    return {**os.environ, "LLMP_PROGRESS": "0", **extra}


_wait_for = wait_for  # (test_faults imports it from here)


def _commit_of(root: Path, step: int):
    return lambda: next(iter((root / "l0").glob(f"*/*/step-{step:06d}/COMMIT")), None)


def _held_after(step: int, state: Path, rank: int = 1, seconds: float = 60) -> dict:
    """The environment that holds ``rank`` for ``seconds`` after its ``step``-th step, once across torchrun's
    restarts (``state``): a test that acts once a checkpoint appears acts while the run is still there, however
    loaded the machine (the run went on at its pace and could be past the state the test waited for, or done). A
    test that acted before the hold spends it (:func:`_act_on`), so that no restart is held."""
    rule = {"at": "step", "do": "slow", "seconds": seconds, "nth": step, "rank": rank, "times": 1}
    return {"LLMP_FAULTS": json.dumps([rule]), "LLMP_FAULTS_STATE": str(state)}


def _act_on(state: Path) -> None:
    """The test acts now: the hold of :func:`_held_after` is spent, whether or not it began."""
    from pipelines.storage import faults

    faults.spend(state, 0)


def _rank(proc: subprocess.Popen, rank: int) -> psutil.Process:
    """Trainer rank ``rank`` of the launch ``proc`` (its RANK)."""
    def found():
        try:
            return [k for k in _trainer_ranks(proc) if k.environ().get("RANK") == str(rank)]
        except psutil.Error:  # one that ended while it was looked at
            return []
    return _wait_for(found, 10, f"trainer rank {rank}")[0]


def _trainer_ranks(proc: subprocess.Popen) -> list[psutil.Process]:
    kids = psutil.Process(proc.pid).children(recursive=True)
    return [k for k in kids if "pipelines.train.trainer" in " ".join(k.cmdline()) and "torch.distributed.run"
            not in " ".join(k.cmdline())]


def _final_state(root: Path, name: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step_dir = next((root / "l0").glob(f"*/*/{name}"))
    ck.verify_local(step_dir)
    dcp_to_torch_save(step_dir, root / "final.pt")
    return torch.load(root / "final.pt", weights_only=False)


def _assert_bitwise_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def test_kill_a_rank_or_the_whole_launcher_and_resume_to_the_same_bits(home):
    tok = _tok(home)
    sets = ["train.steps=60", "train.ckpt_every=10", "launcher.nproc_per_node=2", "launcher.max_restarts=2"]
    ref, killed_rank, killed_all = home / "ref", home / "rank", home / "all"
    assert subprocess.run(_launch_cmd(tok, ref, sets), env=_env(), cwd=ROOT, capture_output=True).returncode == 0

    # 1. kill -9 one trainer rank after the first COMMIT: torchrun restarts both ranks, they resume
    p = subprocess.Popen(_launch_cmd(tok, killed_rank, sets), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env=_env(LLMP_FAULT_STEP_DELAY_S="0.05", **_held_after(12, home / "state-rank")))
    _wait_for(_commit_of(killed_rank, 10), 120, "the first COMMIT")
    _act_on(home / "state-rank")
    _rank(p, 1).send_signal(signal.SIGKILL)  # the held one, or the one that would be
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-3000:]
    assert "exitcode: -9" in out or "Signals.SIGKILL" in out  # torchrun saw the kill and restarted the ranks
    resumed = json.loads((killed_rank / "train/manifest.json").read_text())["extra"]["resumed_from"]
    assert resumed["tier"] == "L0" and resumed["step"] >= 10

    # 2. kill -9 the whole process tree (launcher, torchrun, ranks), then re-run the same command (an Airflow retry)
    cmd = _launch_cmd(tok, killed_all, sets)
    p = subprocess.Popen(cmd, env=_env(LLMP_FAULT_STEP_DELAY_S="0.05", **_held_after(22, home / "state-all")),
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_for(_commit_of(killed_all, 20), 120, "the COMMIT of step 20")
    _act_on(home / "state-all")
    tree = [psutil.Process(p.pid)] + psutil.Process(p.pid).children(recursive=True)
    for proc in tree:
        proc.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    psutil.wait_procs(tree, timeout=30)
    assert not (killed_all / "train/manifest.json").exists()
    rerun = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "resumed from step" in rerun.stdout
    m = json.loads((killed_all / "train/manifest.json").read_text())
    assert m["extra"]["resumed_from"]["step"] >= 20 and m["extra"]["checkpoint"].endswith("step-000060")

    want = _final_state(ref, "step-000060")
    assert set(want) == {"model", "optim"} and want["optim"]["state"]
    print(f"kill one rank: resumed from {resumed}; kill the launcher tree + re-run: resumed from "
          f"{m['extra']['resumed_from']}; comparing {len(want['model'])} model tensors and "
          f"{sum(len(v) for v in want['optim']['state'].values())} optimizer state tensors bitwise")
    for run in (killed_rank, killed_all):
        _assert_bitwise_equal(want, _final_state(run, "step-000060"), run.name)
        assert json.loads((run / "train/losses.json").read_text()) == json.loads((ref / "train/losses.json").read_text())


def _trained_with_tiers(home, s3_server, bucket: str):
    """20 steps, 2 ranks, checkpoints at the probe step (10) and the end (the Young/Daly interval for a
    5,000 h MTBF is far beyond the run), promoted to L1 and L2 during the run."""
    from pipelines.train import launch

    sets = TINY + ["train.steps=20", "train.ckpt_every=auto", "launcher.nproc_per_node=2",
                   f"services.s3_endpoint_url={s3_server}", f"services.s3_bucket={bucket}"]
    spec = load_spec(None, sets, env={})
    m = launch.run(spec, _tok(home))
    return spec, m, m.extra["checkpoint"].rsplit("/", 1)[0]


def _restore(spec, rel_root: str):
    """One rank's collective restore (a world of one), as the trainer runs it: (Restored or None, log lines)."""
    import tempfile

    import torch.distributed as dist

    from pipelines.train.ckpt.checkpointer import Checkpointer

    logs: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", store=dist.FileStore(f"{d}/store", 1), rank=0, world_size=1)
        try:
            ckpt = Checkpointer(spec, rel_root, 0, 1, logs.append, files={})
            try:
                return ckpt.restore(), logs
            finally:
                ckpt.close(None)
        finally:
            dist.destroy_process_group()


def test_restore_falls_back_tier_by_tier_then_to_an_older_step(home, s3_server):
    spec, m, rel_root = _trained_with_tiers(home, s3_server, "ckpt-restore")
    assert m.extra["promoted_during_run"] == {"10": {"L1": "copied", "L2": "committed"},
                                              "20": {"L1": "copied", "L2": "committed"}}
    assert ckpt_tiers.list_steps(spec, rel_root) == {"L0": [10, 20], "L1": [10, 20], "L2": [10, 20]}
    from pipelines import tracking

    hist = tracking.client(spec).get_metric_history(m.extra["mlflow_run_id"], "ckpt/interval_steps")
    assert [h.value for h in hist] == [20.0]  # Young/Daly, clamped to the run length
    stalls = tracking.client(spec).get_metric_history(m.extra["mlflow_run_id"], "ckpt/stall_s")
    assert sorted(h.step for h in stalls) == [10, 20]

    def flip(path: Path):
        with open(path, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))

    locs = ckpt_tiers.tier_locations(spec, f"{rel_root}/step-000020")
    flip(Path(locs["L0"]) / "__1_0.distcp")
    rp, logs = _restore(spec, rel_root)  # the trainer's own restore (pipelines.train.ckpt.restore), as one rank
    assert (rp.step, rp.tier) == (20, "L1")
    assert any("skipped step-000020 L0" in line and "__1_0.distcp" in line for line in logs), logs

    ckpt_local.remove_local(Path(locs["L1"]))
    rp, logs = _restore(spec, rel_root)
    assert (rp.step, rp.tier, rp.parts) == (20, "L2", {0: "L2"})
    ck.verify_local(Path(locs["L1"]))  # staged from L2 and committed on L1 again

    from pipelines.storage.s3 import client, split_uri

    bucket, prefix = split_uri(locs["L2"])
    client(spec).put_object(Bucket=bucket, Key=f"{prefix}/__0_0.distcp", Body=b"not the shard")
    flip(Path(locs["L1"]) / "__0_0.distcp")
    rp, logs = _restore(spec, rel_root)
    assert (rp.step, rp.tier) == (10, "L0"), logs
    assert any("skipped step-000020 L1" in line for line in logs) and \
        any("part-0 of step-000020" in line for line in logs), logs
    assert (Path(locs["L1"]) / ck.COMMIT).is_file()  # a copy that fails keeps its COMMIT until a whole one comes

    # the promote stage finds the final checkpoint that the run promoted already
    ckpt_local.remove_local(Path(locs["L0"]))
    with pytest.raises(ck.CheckpointError, match="L0 copy .* is gone"):
        ckpt_tiers.promote(spec, f"{rel_root}/step-000020")
    rep = ckpt_tiers.promote(spec, f"{rel_root}/step-000010")
    assert rep["actions"] == {"L1": "already-verified", "L2": "already-verified"}


_PROMOTE = """
import sys
from pipelines.spec import load_spec
from pipelines.train.ckpt import tiers as ckpt_tiers
ckpt_tiers.promote(load_spec(None, sys.argv[2:], env={}), sys.argv[1])
"""
# the file's upload is not completed while the test looks: its completion waits (until the client gives up on the
# call, after its bound of some 25 s, and aborts the upload) and the test kills the process as soon as the upload is
# open (the endpoint's probe of conditional writes, on a key of its own, goes on)
_UNCOMPLETED = json.dumps([{"at": "s3", "do": "slow", "op": "CompleteMultipartUpload", "path": ".distcp",
                            "seconds": 600, "times": 0}])


def test_a_promotion_killed_mid_upload_leaves_no_commit_and_the_next_completes_it(home, s3_server):
    sets = [f"services.s3_endpoint_url={s3_server}", "services.s3_bucket=ckpt-killed",
            "checkpoint.multipart_threshold_mb=5", "checkpoint.multipart_chunk_mb=5"]
    spec = load_spec(None, sets, env={})
    rel = "run/key/step-000010"
    tmp = home / "staged"
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(os.urandom(16 * 1024 * 1024))  # multipart: 4 parts of 5 MB
    ckpt_local.commit_local(tmp, Path(ckpt_tiers.tier_locations(spec, rel)["L0"]), meta={"step": 10})
    p = subprocess.Popen([sys.executable, "-c", _PROMOTE, rel] + sets, cwd=ROOT,
                         env=_env(LLMP_HOME=str(home), LLMP_FAULTS=_UNCOMPLETED))
    from pipelines.storage.s3 import client, split_uri

    s3 = client(spec)
    bucket, prefix = split_uri(ckpt_tiers.tier_locations(spec, rel)["L2"])
    _wait_for(lambda: bucket in {b["Name"] for b in s3.list_buckets()["Buckets"]}
              and ckpt_s3.multipart_uploads(s3, bucket, prefix), 60, "the multipart upload to start")
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert ckpt_s3.s3_commit_body(s3, bucket, prefix) is None  # no committed copy at L2
    assert len(ckpt_s3.multipart_uploads(s3, bucket, prefix)) == 1  # the leftover
    with pytest.raises(ck.CheckpointError, match="no COMMIT"):
        ckpt_s3.verify_s3(spec, f"s3://{bucket}/{prefix}")
    rep = ckpt_tiers.promote(spec, rel)
    assert rep["actions"] == {"L1": "already-verified", "L2": "uploaded"}
    assert not ckpt_s3.multipart_uploads(s3, bucket)  # aborted
    ckpt_s3.verify_s3(spec, f"s3://{bucket}/{prefix}")
    got = ckpt_s3.download_checkpoint(spec, f"s3://{bucket}/{prefix}", home / "back")
    assert (got / "__0_0.distcp").read_bytes() == (tmp.parent / "var/tiers/nvme" / rel / "__0_0.distcp").read_bytes()

    # a multipart object of the same size but other bytes (another attempt's upload) is seen by content, not size
    (home / "other").write_bytes(os.urandom(16 * 1024 * 1024))
    s3.upload_file(str(home / "other"), bucket, f"{prefix}/__0_0.distcp", ExtraArgs={"ChecksumAlgorithm": "SHA256"})
    # (S3: its composite checksum differs; an endpoint without checksums, the embedded one: its downloaded bytes)
    with pytest.raises(ck.CheckpointError, match="part checksums are not those of this file|bytes' sha256 differs"):
        ckpt_s3.verify_s3(spec, f"s3://{bucket}/{prefix}")


def _torchrun_trainer(spec_file, tok, out: Path, ckpt_root: Path, nproc: int, env=None):
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "pipelines.train.trainer", "--spec", str(spec_file), "--tokenize-manifest", tok.path,
           "--out", str(out), "--ckpt-root", str(ckpt_root)]
    return subprocess.run(cmd, env=_env(**(env or {})), cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("layout,before,after", [("ddp", 2, 1), ("fsdp2", 1, 2), ("fsdp2", 2, 1)])
def test_elastic_resume_on_another_world_size_keeps_the_sample_order_and_the_loss(home, layout, before, after):
    """A job that lost (or gained) a node: the same spec, torchrun gives another world size. Degrees resolve
    against it, DCP reshards, grad accumulation keeps the global batch of 8, the loader continues."""
    tok = _tok(home)
    par = ["parallel.dp_shard=-1"] if layout == "fsdp2" else []
    spec = load_spec(None, TINY + par + ["train.steps=20", "train.ckpt_every=10", "train.global_batch=8",
                                         "launcher.nproc_per_node=2", "train.grad_accum=1"], env={})
    spec_file = home / "spec.yaml"
    spec_file.write_text(spec.to_yaml())
    l0 = home / "var/tiers/nvme"
    ref = _torchrun_trainer(spec_file, tok, home / "ref", l0 / "ref", 2)
    assert ref.returncode == 0, ref.stderr[-3000:]
    first = _torchrun_trainer(spec_file, tok, home / "a", l0 / "elastic", before, {"LLMP_FAULT_EXIT_AT_STEP": "10"})
    assert first.returncode != 0 and "exiting every rank after step 10" in first.stdout
    second = _torchrun_trainer(spec_file, tok, home / "b", l0 / "elastic", after)
    assert second.returncode == 0, second.stderr[-3000:]
    res, want = (json.loads((home / d / "result.json").read_text()) for d in ("b", "ref"))
    assert res["resumed_from"] == {"step": 10, "tier": "L0"} and res["world_size"] == after
    assert res["global_batch"] == 8 and res["grad_accum"] == 2 // after
    assert res["parallel"] == ("single" if after == 1 else {"ddp": "ddp", "fsdp2": "fsdp2"}[layout])
    assert res["consumed_samples"] == want["consumed_samples"] == 20 * 8
    got, ref_losses = (np.array(json.loads((home / d / "losses.json").read_text())) for d in ("b", "ref"))
    assert got.shape == (20, 2) and np.array_equal(got[:, 0], np.arange(1, 21))
    np.testing.assert_allclose(got[:, 1], ref_losses[:, 1], rtol=0, atol=2e-4)  # the curve continues


def test_spikes_and_non_finite_steps_roll_back_skip_the_batch_and_the_run_completes(home):
    from pipelines import tracking
    from pipelines.launch import ranks
    from pipelines.train import launch

    tok = _tok(home)
    G = 8
    sets = TINY + ["train.steps=30", "train.ckpt_every=5", "launcher.nproc_per_node=2", "train.spike_min_history=5",
                   "launcher.max_restarts=0"]
    env = {"LLMP_FAULT_BAD_BATCH": f"{G * 12}:spike,{G * 21}:nan"}
    os.environ.update(env)
    try:
        m = launch.run(load_spec(None, sets, env={}), tok)
        res = json.loads(m.output("result").read_text())
        assert res["rollbacks"] == 2 and res["skipped_batches"] == [G * 12, G * 21]
        assert res["consumed_samples"] == (30 + 2) * G and m.counts["steps"] == 30
        losses = json.loads(m.output("losses").read_text())
        assert [s for s, _ in losses] == list(range(1, 31)) and all(np.isfinite([x for _, x in losses]))
        state = json.loads((home / "var/tiers/nvme" / m.extra["checkpoint"] / "trainer_state.json").read_text())
        assert state["loader"]["skip"] == [G * 12, G * 21]  # a resume skips them too
        hist = tracking.client(load_spec(None, sets, env={})).get_metric_history(m.extra["mlflow_run_id"],
                                                                                 "train/rollbacks")
        assert [h.value for h in hist] == [1.0, 2.0]
        # one rollback allowed, two bad batches: the run fails and says what to do
        with pytest.raises(ranks.TrainError, match=r"train\.max_rollbacks"):
            launch.run(load_spec(None, sets + ["train.max_rollbacks=1"], env={}), tok)
    finally:
        for k in env:
            os.environ.pop(k)


def test_retention_keeps_windows_and_never_removes_the_newest_verified_copy(home):
    spec = load_spec(None, ["checkpoint.keep_l0=2"], env={})
    assert ckpt_tiers.retention_plan({"L0": [10, 20, 30, 40], "L1": [10, 20, 30], "L2": [10, 20, 30, 40, 50]},
                             {"L0": 2, "L1": 5, "L2": 1}, 20) == {"L0": [10, 20], "L1": [], "L2": [10, 30]}
    rel_root = "run/key"
    for s in (10, 20, 30, 40, 50):
        tmp = home / f"t{s}"
        tmp.mkdir()
        (tmp / "__0_0.distcp").write_bytes(os.urandom(1000))
        (tmp / "trainer_state.json").write_text(json.dumps({"step": s}))
        ckpt_local.commit_local(tmp, Path(ckpt_tiers.tier_locations(spec, f"{rel_root}/step-0000{s}")["L0"]),
                                meta={"step": s})
    for s in (40, 50):  # the two newest are corrupt: step 30 is the newest that verifies
        (Path(ckpt_tiers.tier_locations(spec, f"{rel_root}/step-0000{s}")["L0"]) / "__0_0.distcp").write_bytes(b"x")
    deleted = ckpt_tiers.prune(spec, rel_root, tiers=("L0",))
    assert deleted == {"L0": [10, 20]}
    assert ckpt_tiers.list_steps(spec, rel_root, ("L0",)) == {"L0": [30, 40, 50]}
    assert _restore(spec, rel_root)[0].step == 30


def test_retention_keeps_each_tiers_own_newest_verified_copy(home):
    """L1's newest step does not verify (its COMMIT is there, a file rotted) while the node's L0 copy of it does:
    L1 keeps its newest copy that verifies, step 10. The guard was one step for every tier pruned (the newest that
    verified anywhere: L0's 20), so L1 kept only its corrupt 20, and losing the node left no step that restores."""
    spec = load_spec(None, ["checkpoint.keep_l0=1", "checkpoint.keep_l1=1"], env={})
    rel_root = "run/key"
    for s in (10, 20):
        for tier in ("L0", "L1"):
            tmp = home / f"t{s}{tier}"
            tmp.mkdir()
            (tmp / "__0_0.distcp").write_bytes(os.urandom(1000))
            (tmp / "trainer_state.json").write_text(json.dumps({"step": s}))
            ckpt_local.commit_local(tmp, Path(ckpt_tiers.tier_locations(spec, f"{rel_root}/step-0000{s}")[tier]),
                                    meta={"step": s})
    (Path(ckpt_tiers.tier_locations(spec, f"{rel_root}/step-000020")["L1"]) / "__0_0.distcp").write_bytes(b"x")
    assert ckpt_tiers.prune(spec, rel_root, tiers=("L0", "L1")) == {"L0": [10], "L1": []}
    assert ckpt_tiers.list_steps(spec, rel_root, ("L0", "L1")) == {"L0": [20], "L1": [10, 20]}
    ckpt_local.remove_local(Path(ckpt_tiers.tier_locations(spec, f"{rel_root}/step-000020")["L0"]))  # the node lost
    assert _restore(spec, rel_root)[0].step == 10


def test_a_stager_that_cannot_reuse_its_buffers_costs_a_warning_not_the_run(home, monkeypatch):
    """torch 2.11's DCP stager fails on its second stage() (KeyError: <class 'type'>, seen on an H100 with the
    machine's own torch): every later save gets a new stager, and every step still commits."""
    import torch.distributed as dist

    from conftest import free_port
    from pipelines.train.ckpt import checkpointer
    from pipelines.train.model import ModelArgs, Transformer

    real, made = checkpointer.new_stager, []

    def once_only():  # the stager of torch 2.11: its buffers cannot be staged into a second time
        st = real()
        stage, used = st.stage, []

        def stage_once(sd, **kw):
            if used:
                raise KeyError(type)
            used.append(1)
            return stage(sd, **kw)

        st.stage = stage_once
        made.append(st)
        return st

    monkeypatch.setattr(checkpointer, "new_stager", once_only)
    spec = load_spec(None, ["checkpoint.promote_during_run=false"], env={})
    logs: list[str] = []
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = Transformer(ModelArgs(vocab_size=300, n_layers=2, d_model=64, n_heads=4, seq_len=16))
        opt = torch.optim.AdamW(model.parameters())
        saver = checkpointer.Checkpointer(spec, "run/key", 0, 1, logs.append, files={})
        for step in (1, 2, 3):
            saver.save(step, model, opt, {"step": step})
            saver.wait()
        saver.close(None)
    finally:
        dist.destroy_process_group()
    assert [ck.verify_local(saver.path(s))["step"] for s in (1, 2, 3)] == [1, 2, 3]
    assert len(made) == 3 and sum("cannot reuse its buffers" in m for m in logs) == 1


def test_async_save_returns_before_the_commit_and_keeps_the_state_of_its_step(home, monkeypatch):
    import threading

    import torch.distributed as dist

    from conftest import free_port
    from pipelines.train.ckpt import checkpointer
    from pipelines.train.model import ModelArgs, Transformer

    spec = load_spec(None, ["checkpoint.promote_during_run=false"], env={})
    gate = threading.Event()
    real_commit = ckpt_local.commit_local
    monkeypatch.setattr(ckpt_local, "commit_local", lambda *a, **k: gate.wait(30) and real_commit(*a, **k))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = Transformer(ModelArgs(vocab_size=300, n_layers=2, d_model=64, n_heads=4, seq_len=16))
        opt = torch.optim.AdamW(model.parameters())
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
        opt.step()
        saver = checkpointer.Checkpointer(spec, "run/key", 0, 1, print, files={"model_args.json": json.dumps(
            model.args.to_dict()).encode()})
        before = {k: v.clone() for k, v in model.state_dict().items()}
        stall = saver.save(7, model, opt, {"step": 7})
        final = saver.path(7)
        assert not (final / "COMMIT").exists()  # save returned; persistence has not ended
        with torch.no_grad():  # training goes on and changes the weights
            for p in model.parameters():
                p.add_(1.0)
        gate.set()
        saver.wait()
        assert (final / "COMMIT").exists() and ck.verify_local(final)["step"] == 7 and stall < 5
        saver.close(None)
    finally:
        dist.destroy_process_group()
    assert ckpt_local.missing_shards(final) == []
    partial = home / "partial"  # as if a shard had been written on another node's disk
    import shutil

    shutil.copytree(final, partial)
    (partial / "__0_0.distcp").unlink()
    assert ckpt_local.missing_shards(partial) == ["__0_0.distcp"]
    restored = load_plain_model(final).state_dict()
    for k, v in before.items():
        assert torch.equal(restored[k], v), k  # the state of step 7, not the weights changed afterwards


def test_young_daly_interval_and_spike_guard_and_the_real_part_size():
    # τ = √(2·C·MTBF_job): C = 0.5 s, 5,000 h per node over 2 nodes → 3,000 s; at 0.1 s per step, 30,000 steps
    assert young_daly_steps(0.5, 5000, 2, 0.1, 10 ** 9) == 30000
    assert young_daly_steps(0.5, 5000, 2, 0.1, 500) == 500
    g = SpikeGuard(window=10, sigma=3, min_history=5)
    for x in (4.0, 4.1, 3.9, 4.0, 4.05):
        assert g.check(x, 1.0) is None
        g.accept(x)
    assert g.check(4.2, 1.0) is None and "spike" in g.check(9.0, 1.0) and "non-finite" in g.check(4.0, float("inf"))
    # s3transfer raises an 8 MB chunk to 32 MB for a 200 GB file (≤ 10,000 parts): verification must follow
    assert part_size_used(200 << 30, 8 << 20) == 32 << 20 and part_size_used(100 << 20, 8 << 20) == 8 << 20


def test_young_daly_interval_inside_the_run_is_the_same_on_every_rank(home):
    """A short MTBF puts the Young/Daly interval inside the run: rank 0's interval is every rank's (a rank that
    saved alone would wait in the save's collectives forever)."""
    from pipelines import tracking
    from pipelines.train import launch

    sets = TINY + ["train.steps=24", "train.ckpt_every=auto", "checkpoint.probe_step=4", "checkpoint.mtbf_hours=0.0001",
                   "launcher.nproc_per_node=2", "launcher.max_restarts=0"]
    spec = load_spec(None, sets, env={})
    m = launch.run(spec, _tok(home))
    res = json.loads(m.output("result").read_text())
    hist = tracking.client(spec).get_metric_history(m.extra["mlflow_run_id"], "ckpt/interval_steps")
    intervals = [int(h.value) for h in sorted(hist, key=lambda h: h.step)]
    assert len(intervals) >= 2 and all(1 <= i < 20 for i in intervals)  # √(2·C·0.36 s) ≈ a few steps here
    assert res["ckpt"]["saves"] == len(intervals) + 1  # the probe, then one per interval, and the final step
