"""The seeded fault matrix (issue 31): ``make faults [SEEDS=N]`` or ``python tests/fault_matrix.py --seeds N``.

Each seed picks one scenario: a fault kind and where it strikes (a phase of the checkpoint protocol, a tier's
reads or writes, the S3 endpoint's requests), and how often. The run is real: ``python -m pipelines.train.launch``
(torchrun, 2 ranks on one node, an S3 endpoint on loopback) with ``LLMP_FAULTS`` set; a process death is
``os._exit`` at that point, and torchrun restarts the ranks as it would after a lost pod. A fifth of the seeds run
on two simulated nodes (``pipelines.sim_nodes``, as ``tests/test_nodes.py``: a private L0 disk each, L1 shared,
one rank each), where the part protocol's phases are: a rank dies there, or its node is lost there (every process
of the node killed, a replacement started over an empty disk). The same seed replays the same scenario; a tuple of
seeds is one run with all their faults (``make test``'s subset). After each run the invariants are checked:

* I1 the newest step committed on L1 verifies there (and on L2 when L2 says it holds it);
* I2 a resumed run resumed from a whole step of this run (a multiple of ckpt_every, committed before the fault);
* I3 the run ends bitwise equal to the fault-free run, or fails with one ``train: error:`` line naming L1; never
  exit 0 with its final step missing from L1;
* I4 it ends within its bound (no hang);
* I5 L0 (each node's disk that is still in the job) and L1 hold no more steps than their retention keeps (plus the
  newest, which is never deleted; L1 plus the steps it holds back for L2, ``checkpoint.l1_hold_for_l2``);
* I6 (data) a compressed input cut at a seeded byte: every byte read is a doc or a ``bad_compression`` entry;
* I7 (preemption) the stage exits with the retry code (75), L1 holds the step the ranks stopped after, which is no
  older than the step at the signal, and the retry resumes exactly there;
* I8 (fencing) an attempt superseded by a newer one never exits 0, and what the newer one committed (its final
  step's MANIFEST and COMMIT on L1, the stage's manifest) is unchanged after the older one has ended.

The cluster's events (issue 44) are a third of the seeds (``seed % 12`` in 4, 6, 10, 11, so that the seeds of the
``make test`` subset keep their meaning): a preemption notice (SIGTERM to the ranks' torchrun, as a pod eviction
sends it) at a training step or a phase of the protocol; an S3 endpoint that accepts a call and never answers, on
each kind of call; a rank stopped (SIGSTOP) at a step or a phase, which the heartbeat finds; a zombie attempt (the
stage's processes stopped as a partitioned node's, a retry started and finished, then the old attempt let go on);
two launches of the same stage at once. Seeds with ``seed % 24`` in 21 and 13 are storage that lies or stalls (issue
52): EROFS on L1, a pause between a fence check and its act, L2 answering 503 to every listing (21); L1's
``.fence`` lost between two attempts or under a running one, a rename into place that fails after the data is
written, a node's clock off by more than the lease, checkpoint files large enough for multipart uploads with
faults in their parts (13). A run that exits 75 is run again, as the DAG's retries do (at most ``RETRIES``
times).

Prints one row per seed: scenario, seed, outcome, each invariant (ok / n/a / FAIL).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import shutil
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, KEEP, HOLD = 30, 10, 2, 1  # HOLD: steps L1 holds back for an L2 that lags (l1_hold_for_l2)
SETS = ["tokenizer.vocab_size=500", "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=32",
        "train.micro_batch=4", "train.warmup_steps=2", "train.lr=0.01", "train.log_every=5",
        f"train.steps={STEPS}", f"train.ckpt_every={EVERY}", "launcher.nproc_per_node=2", "launcher.max_restarts=3",
        f"checkpoint.keep_l0={KEEP}", f"checkpoint.keep_l1={KEEP}", f"checkpoint.l1_hold_for_l2={HOLD}",
        "checkpoint.collective_timeout_minutes=5"]
SETS += ["train.hang_timeout_s=20", "checkpoint.s3_connect_timeout_s=2", "checkpoint.s3_read_timeout_s=2",
         "checkpoint.s3_max_attempts=2"]  # a hang found in seconds, a hung S3 call ended in seconds
BOUND_S = 600
RETRIES = 2  # the training DAGs' task retries: a run that exits 75 is run again
RETRY = 75
W = 48  # the scenario column
CLUSTER_SEEDS = (4, 6, 10, 11)  # seed % 12: the cluster's events
LIES_SEEDS = (21, 13)  # seed % 24: storage that lies or stalls (issue 52; make test's subset has 181)
PROTOCOL = ("part_committed", "l1_staged", "merge", "l1_committed", "retention")  # one part's phases
S3_CALLS = ("PutObject", "HeadObject", "ListObjectsV2", "GetObject", "DeleteObjects")


def phases_and_kinds() -> set:
    """What the ``make test`` subset must strike at least once: every phase and every kind of fault."""
    sys.path.insert(0, str(ROOT))
    from pipelines.storage import faults

    return set(faults.PHASES) | set(faults.KINDS)


def scenario(seed: int) -> dict:
    """The fault a seed stands for: {name, rules, expect} (expect: "ok" = bitwise equal, "ok|fail" = either is
    right as long as a failure names its tier)."""
    rnd = random.Random(seed)
    if seed % 24 in LIES_SEEDS:
        return (lies_scenario if seed % 24 == LIES_SEEDS[0] else lost_scenario)(rnd)
    if seed % 12 in CLUSTER_SEEDS:
        return cluster_scenario(rnd)
    kind = rnd.choice(["die", "die", "eio", "enospc", "s3_down", "s3_503", "s3_reset", "slow", "data", "nodes", "nodes"])
    if kind == "nodes":
        return nodes_scenario(rnd)
    if kind == "die":
        phase = rnd.choice(["part_committed", "l1_staged", "merge", "l1_committed", "retention"])  # one part
        nth = rnd.randint(1, 3 if phase != "retention" else 2)
        return {"name": f"die at {phase} #{nth}", "rules": [{"at": phase, "do": "die", "nth": nth}], "expect": "ok"}
    if kind in ("eio", "enospc"):
        op = "read" if kind == "eio" else "write"
        tier = rnd.choice(["l0", "l1"])
        times = rnd.choice([1, 2, 0])  # 0: the tier stays broken
        nth = rnd.randint(1, 12)
        if kind == "enospc" and tier == "l0":  # L0 is written once per save (its commit): 3 saves in a run
            nth = 1 + (nth - 1) % 3
        if kind == "eio" and tier == "l1":  # only a restore reads L1: one that cannot read a lost node's part on L0
            return l1_read_scenario(1 + (nth - 1) % 4, times)
        expect = "ok" if times else "fail"
        return {"name": f"{kind} on {tier} {op} #{nth} x{times or 'inf'}",
                "rules": [{"at": op, "do": kind, "path": f"/{tier}/", "nth": nth, "times": times}], "expect": expect}
    if kind == "data":
        return {"name": f"data: truncated {rnd.choice(['zst', 'gz'])}", "data": True,
                "cut": rnd.random(), "expect": "ok"}
    op = rnd.choice(["PutObject", "HeadObject", "ListObjectsV2", "GetObject"])  # the tiny run's files are single-part
    times = rnd.choice([1, 3, 0])
    rule = {"at": "s3", "do": kind if kind != "slow" else "slow", "op": op, "nth": rnd.randint(1, 6), "times": times}
    if kind == "slow":
        rule["seconds"] = 2.0
    # every listing failing from the first on is lies_scenario's "new L1" case: the run's first listing reads L2's
    # terms, and while they are unknown no attempt starts (exit 75 naming L1 and L2, issue 52), never a fresh term
    never_listed = op == "ListObjectsV2" and times == 0 and rule["nth"] == 1 and kind != "slow"
    return {"name": f"{kind} on S3 {op} x{times or 'inf'}", "rules": [rule], "expect": "fail" if never_listed else "ok"}


def lies_scenario(rnd: random.Random) -> dict:
    """Storage that lies or stalls (issue 52): L1 remounted read-only (EROFS) for a while or for good; a writer that
    pauses between its fence check and its act (the fault point ``act``) on any tier; L2 that answers 503 to every
    listing (a new run's L1 cannot learn L2's terms then: no attempt starts, never one over an older term)."""
    kind = rnd.choice(["erofs", "erofs", "pause", "pause", "list503"])
    if kind == "erofs":
        times, nth = rnd.choice([1, 0]), rnd.randint(1, 12)
        return {"name": f"erofs on l1 write #{nth} x{times or 'inf'}",
                "rules": [{"at": "write", "do": "eio", "errno": "EROFS", "path": "/l1/", "nth": nth, "times": times}],
                "expect": "ok" if times else "fail"}
    if kind == "pause":
        nth = rnd.randint(1, 8)
        return {"name": f"pause between check and act #{nth}",
                "rules": [{"at": "act", "do": "slow", "seconds": 3.0, "nth": nth}], "expect": "ok"}
    # a new run's L1 has no term yet: L2's terms are unknown while it cannot list, so no attempt starts (exit 75,
    # one line naming L1 and L2), never a term that an older attempt may hold
    return {"name": "S3 503 on every ListObjectsV2, new L1",
            "rules": [{"at": "s3", "do": "s3_503", "op": "ListObjectsV2", "times": 0}], "expect": "fail"}


MULTIPART_SETS = ["model.d_model=384", "checkpoint.multipart_threshold_mb=5", "checkpoint.multipart_chunk_mb=5"]


def lost_scenario(rnd: random.Random) -> dict:
    """More storage that lies (issue 52): L1's ``.fence`` lost (between two attempts: a preempted one and its retry;
    or under a running attempt, once step 10 is on L1), so the run's terms come from L2's record of them; the
    rename that puts a finished copy in place fails after its data is written (EIO, once, twice or for good); a
    node's wall clock off by 90 s, more than the lease (60 s); a model whose checkpoint files are multipart uploads
    (5 MiB parts), a part's upload failing or hanging."""
    kind = rnd.choice(["fence", "fence", "rename", "rename", "skew", "multipart", "multipart"])
    if kind == "fence":
        when = rnd.choice(["between", "running"])
        rules = [{"at": "step", "do": "preempt", "nth": rnd.randint(11, STEPS - 1)}] if when == "between" else []
        return {"name": f".fence lost on L1 {when} attempts" if when == "between" else ".fence lost on L1 while running",
                "rules": rules, "fence_lost": when, "expect": "ok"}
    if kind == "rename":
        tier, times, nth = rnd.choice(["l0", "l1"]), rnd.choice([1, 2, 0]), rnd.randint(1, 3)
        at = rnd.choice(["rename", "renamed"])  # renamed: the rename was made, the caller told it failed (NFS)
        return {"name": f"eio on {tier} {'rename into place' if at == 'rename' else 'rename, made'} #{nth} "
                        f"x{times or 'inf'}",
                "rules": [{"at": at, "do": "eio", "path": f"/{tier}/", "nth": nth, "times": times}],
                "expect": "ok" if times else "ok|fail"}
    if kind == "skew":
        node, ahead = rnd.choice([(0, -90.0), (1, 90.0)])  # node 0 renews the lease: behind; node 1 reads it: ahead
        return {"name": f"2 nodes: node {node}'s clock {ahead:+.0f} s", "nodes": 2, "expect": "ok",
                "rules": [{"at": "clock", "do": "skew", "seconds": ahead, "node": node}]}
    do, times = rnd.choice(["s3_503", "s3_reset", "s3_hang"]), rnd.choice([1, 3])
    return {"name": f"multipart: {do} on S3 UploadPart x{times}", "sets": MULTIPART_SETS, "expect": "ok",
            "rules": [{"at": "s3", "do": do, "op": "UploadPart", "nth": rnd.randint(1, 8), "times": times}]}


def cluster_scenario(rnd: random.Random) -> dict:
    """What a cluster does to a run (issue 44): a preemption notice, a hung S3 call, a stopped rank (at a training
    step — ``step`` #n is the n-th step done — or a phase of the protocol), a zombie attempt, two launches at once."""
    kind = rnd.choice(["preempt", "preempt", "s3_hang", "s3_hang", "stop", "zombie", "zombie", "twice"])
    if kind in ("preempt", "stop"):
        phase = rnd.choice(("step",) + PROTOCOL)
        nth = rnd.randint(11, STEPS - 1) if phase == "step" else rnd.randint(1, 2)
        what = "preemption notice" if kind == "preempt" else "rank stopped"
        return {"name": f"{what} at {phase} #{nth}", "rules": [{"at": phase, "do": kind, "nth": nth}], "expect": "ok"}
    if kind == "s3_hang":
        op, times = rnd.choice(S3_CALLS), rnd.choice([1, 3, 0])
        return {"name": f"S3 hung on {op} x{times or 'inf'}",
                "rules": [{"at": "s3", "do": "s3_hang", "op": op, "nth": rnd.randint(1, 6), "times": times}],
                "expect": "ok"}
    if kind == "zombie":
        after, until = rnd.choice([10, 20]), rnd.choice(["ends", "runs"])
        lease = rnd.choice([60, 5])  # 5: the stopped attempt's lease has expired when it goes on
        return {"name": f"zombie: stopped after {after}, back while retry {until}", "rules": [],
                "zombie": {"after": after, "until": until}, "sets": [f"checkpoint.lease_s={lease}"], "expect": "ok"}
    gap, output = rnd.choice([0, 1, 3]), rnd.choice(["same", "own"])
    return {"name": f"two launches {gap} s apart, {output} output", "rules": [],
            "twice": {"gap_s": gap, "output": output}, "expect": "ok"}


def l1_read_scenario(nth: int, times: int) -> dict:
    """EIO on L1 reads where L1 is read: two nodes, node 1 lost after its second part's commit; the node that
    restores reads L1 for the lost part and its reads fail (``times`` 0: always), so the part comes from L2 or the
    step before."""
    return {"name": f"2 nodes: eio on l1 read #{nth} x{times or 'inf'} after a loss",
            "rules": [{"at": "part_committed", "do": "lose", "node": 1, "nth": 2},
                      {"at": "read", "do": "eio", "path": "/l1/", "nth": nth, "times": times}],
            "nodes": 2, "expect": "ok" if times else "fail"}


def nodes_scenario(rnd: random.Random) -> dict:
    """Two simulated nodes (a private L0 disk each): a rank dies, or its whole node is lost (a replacement starts
    over an empty disk), at a phase of the part protocol. Rank 0's node alone merges and commits on L1. A restore
    stages parts again only when a step was left uncommitted, so a fault there follows a death before the merge."""
    phase = rnd.choice(["part_committed", "l1_staged", "merge", "l1_committed", "retention", "restage"])
    node = 0 if phase in ("merge", "l1_committed") else rnd.randint(0, 1)
    do, nth = rnd.choice(["die", "lose"]), rnd.randint(1, 2)
    rules = [{"at": phase, "do": do, "node": node, "nth": nth}]
    if phase == "restage":
        rules = [{"at": "l1_staged", "do": "die", "node": 0, "nth": nth}, rules[0] | {"nth": 1}]
    return {"name": f"2 nodes: {do} node {node} at {phase} #{nth}", "rules": rules, "nodes": 2, "expect": "ok"}


def _env(**extra) -> dict:
    return {**os.environ, "LLMP_PROGRESS": "0", **extra}


def prepare(base: Path, stack: contextlib.ExitStack) -> dict:
    """The shared inputs: a tokenized corpus, an S3 endpoint (stopped with ``stack``), the fault-free reference run's
    final state."""
    sys.path.insert(0, str(ROOT / "tests"))
    os.environ["LLMP_HOME"] = str(base)
    from pipelines.storage.s3 import serving
    from test_resilience import _tok

    url = stack.enter_context(serving(base / "s3-store"))  # the embedded endpoint's server, in the matrix's folder
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    tok = _tok(base)
    ctx = {"tok": tok.path, "s3": url, "base": base}
    ref = run_one(ctx, "reference", None)
    assert ref["rc"] == 0, ref["out"][-3000:]
    ctx["ref"] = ref
    return ctx


def _where(ctx: dict, name: str, base_sets: list[str], run_root: str = "") -> tuple[Path, list[str]]:
    """A run's folder and its spec: its own tiers under the folder, its own bucket on the shared endpoint."""
    root = ctx["base"] / name.replace(" ", "_").replace("#", "n").replace(":", "")
    return root, base_sets + [f"run.root={root}{run_root}", f"checkpoint.l0={root}/l0", f"checkpoint.l1={root}/l1",
                              f"services.s3_endpoint_url={ctx['s3']}",
                              f"services.s3_bucket=faults-{abs(hash(name)) % 10**8}"]


def _launch(ctx: dict, root: Path, sets: list[str]) -> list[str]:
    return [sys.executable, "-m", "pipelines.train.launch", "--tokenize-manifest", ctx["tok"], "--output",
            str(root / "train")] + [a for kv in sets for a in ("--set", kv)]


def _fault_env(root: Path, rules) -> dict:
    return _env(LLMP_FAULTS=json.dumps(rules), LLMP_FAULTS_STATE=str(root / "faults")) if rules else _env()


def _attempt(cmd: list[str], env: dict, bound: float) -> tuple[object, str]:
    """One launch to its end: (exit status or "hang", output)."""
    try:
        r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, bound))
        return r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else str(e.stdout or "")
        return "hang", out


def run_one(ctx: dict, name: str, rules, extra_sets: tuple = (), fence_lost: str = "") -> dict:
    """One launch on one node, run again while it exits 75 (as the DAG's retries do), within ``BOUND_S`` in all.
    ``fence_lost``: L1's ``.fence`` is removed ``between`` the first attempt and its retry, or while the first
    attempt is ``running`` (once step 10 is committed on L1)."""
    root, sets = _where(ctx, name, SETS + list(extra_sets))
    cmd, env = _launch(ctx, root, sets), _fault_env(root, rules)
    t0 = time.monotonic()
    rcs, outs = [], []
    while len(rcs) <= RETRIES:
        losing = _losing_fence(root) if fence_lost == "running" and not rcs else contextlib.nullcontext()
        with losing:
            rc, out = _attempt(cmd, env, BOUND_S - (time.monotonic() - t0))
        rcs.append(rc)
        outs.append(out)
        if rc != RETRY:
            break
        if fence_lost == "between" and len(rcs) == 1:
            _drop_fence(root)
    return {"rc": rcs[-1], "rcs": rcs, "out": "\n".join(outs), "outs": outs, "root": root, "sets": sets,
            "s": time.monotonic() - t0}


def _drop_fence(root: Path) -> list[Path]:
    """L1's fence directories of the run (its terms and leases) removed: a new FSx, a restore from backup. Recorded
    as the scenario's firing (``faults/rule-harness-fence-lost-fired-0``)."""
    gone = list((root / "l1").glob("*/*/.fence"))
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    if gone:
        (root / "faults").mkdir(parents=True, exist_ok=True)
        (root / "faults" / "rule-harness-fence-lost-fired-0").touch()
    return gone


@contextlib.contextmanager
def _losing_fence(root: Path, after: int = EVERY):
    """While the block runs: once step ``after`` is committed on L1, its ``.fence`` is removed (once)."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            if list((root / "l1").glob(f"*/*/step-{after:06d}/COMMIT")) and _drop_fence(root):
                return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def reference_state(ctx: dict, run: dict, sc: dict) -> dict:
    """The fault-free run's final state for this run's model: one node's, two nodes', or (a scenario with sets of
    its own, e.g. a larger model) a reference run with those sets, made once."""
    if "disks" in run:
        return ctx["ref2_state"]
    if not sc.get("sets") or sc.get("zombie"):
        return ctx["ref_state"]
    key = "ref " + " ".join(sc["sets"])
    if key not in ctx:
        from pipelines.train.ckpt import protocol as ck

        ref = run_one(ctx, f"reference {len(ctx)}", None, tuple(sc["sets"]))
        assert ref["rc"] == 0, ref["out"][-3000:]
        rel = next((ref["root"] / "l1").glob("*/*/step-*/COMMIT")).parent.parent
        ctx[key] = final_state(rel / ck.step_name(STEPS))
    return ctx[key]


def _final_commit(root: Path, stage: bool = True) -> dict[str, bytes]:
    """What a finished attempt committed: its final step's MANIFEST and COMMIT on L1 (and the stage's manifest)."""
    found = {}
    step = [*(root / "l1").glob(f"*/*/step-{STEPS:06d}/MANIFEST*"), *(root / "l1").glob(f"*/*/step-{STEPS:06d}/COMMIT")]
    for f in step + ([root / "train" / "manifest.json", root / "b" / "train" / "manifest.json"] if stage else []):
        if f.is_file():
            found[str(f.relative_to(root))] = f.read_bytes()
    return found


def _spawn(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _signal_tree(p: subprocess.Popen, sig: int) -> None:
    """``sig`` to the process and every descendant (torchrun and its ranks run in process groups of their own)."""
    import psutil

    try:
        procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    except psutil.Error:
        return
    for q in procs:
        with contextlib.suppress(psutil.Error):
            q.send_signal(sig)


def _wait_all(procs: list[subprocess.Popen], deadline: float, on_first=None) -> None:
    """Wait for every process, at most until ``deadline`` (then the rest are killed); ``on_first`` is called once,
    when the first of them has ended with status 0."""
    called = False
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if on_first and not called and any(p.poll() == 0 for p in procs):
            on_first()
            called = True
        time.sleep(0.1)
    if on_first and not called and any(p.poll() == 0 for p in procs):
        on_first()
    for p in procs:
        if p.poll() is None:
            _signal_tree(p, signal.SIGCONT)
            _signal_tree(p, signal.SIGKILL)
            p.wait(30)


def _own_output(cmd: list[str], root: Path) -> list[str]:
    """The command with ``--output`` in a folder of its own (``b/train``: the same last name, so the same checkpoint
    root on every tier, and a stage lock of its own)."""
    return [str(root / "b" / "train") if a == str(root / "train") else a for a in cmd]


def run_zombie(ctx: dict, name: str, sc: dict) -> dict:
    """Attempt A stopped, every process of it (a partitioned node), once step ``after`` is committed on L0; the retry
    B, on its own ``--output`` (A's launcher holds the stage's lock, as a worker thought dead would on its node),
    runs to its end or until it has committed a step of its own; then A goes on. B's commit must stand, A must
    neither exit 0 nor commit a stage."""
    root, sets = _where(ctx, name, SETS + sc.get("sets", []))
    root.mkdir(parents=True, exist_ok=True)
    cmd, z = _launch(ctx, root, sets), sc["zombie"]
    retry = _own_output(cmd, root)
    t0, deadline = time.monotonic(), time.monotonic() + BOUND_S
    a = _spawn(cmd, _env(LLMP_FAULT_STEP_DELAY_S="0.1"), root / "attempt-a.log")
    while not list((root / "l0").glob(f"*/*/step-{z['after']:06d}/COMMIT")) and a.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    _signal_tree(a, signal.SIGSTOP)
    snap: dict = {}
    b = _spawn(retry, _env(), root / "attempt-b.log")
    try:
        if z["until"] == "ends":
            _wait_all([b], deadline)
            snap = _final_commit(root) if b.returncode == 0 else {}
        else:  # A goes on once B has committed a step of its own on L0
            while b.poll() is None and "committed to L0" not in (root / "attempt-b.log").read_text() \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        _signal_tree(a, signal.SIGCONT)
    _wait_all([a, b], deadline, on_first=lambda: snap.update(snap or (_final_commit(root) if b.poll() == 0 else {})))
    return {"rc": b.returncode if b.returncode is not None else "hang", "rcs": [b.returncode],
            "zombie_rc": a.returncode, "zombie_stage": (root / "train" / "manifest.json").is_file(),
            "out": (root / "attempt-a.log").read_text() + "\n" + (root / "attempt-b.log").read_text(),
            "root": root, "sets": sets, "s": time.monotonic() - t0, "snap": snap, "after": _final_commit(root)}


def run_twice(ctx: dict, name: str, sc: dict) -> dict:
    """The same stage launched twice, ``gap_s`` apart: to the same ``--output`` (the stage's lock makes the second
    wait, then find it done), or each to its own (as if the lock were lost: the newer attempt's term supersedes the
    older one's, and the older one stops before it commits)."""
    root, sets = _where(ctx, name, SETS)
    root.mkdir(parents=True, exist_ok=True)
    cmd = _launch(ctx, root, sets)
    other = cmd if sc["twice"]["output"] == "same" else _own_output(cmd, root)
    t0 = time.monotonic()
    a = _spawn(cmd, _env(), root / "attempt-a.log")
    time.sleep(sc["twice"]["gap_s"])
    b = _spawn(other, _env(), root / "attempt-b.log")
    snap: dict = {}
    # the stage's manifest is not compared: the later attempt, which started before the stage was done, commits too
    _wait_all([a, b], t0 + BOUND_S, on_first=lambda: snap.update(_final_commit(root, stage=False)))
    rcs = [p.returncode for p in (a, b)]
    return {"rc": 0 if 0 in rcs else ("hang" if None in rcs else rcs[-1]), "rcs": rcs, "zombie_rc": None,
            "out": (root / "attempt-a.log").read_text() + "\n" + (root / "attempt-b.log").read_text(),
            "root": root, "sets": sets, "s": time.monotonic() - t0, "snap": snap, "after": _final_commit(root)}


NODE_SETS = [kv for kv in SETS if not kv.startswith("launcher.")] + ["launcher.nproc_per_node=1", "launcher.nnodes=2"]
BACKOFF = 4  # a node's restarts after failures before it gives up, as a PyTorchJob's backoffLimit
SUB = "run/key"  # the two-node runs' checkpoint root under each tier (--ckpt-root <l0>/run/key)


def run_two(ctx: dict, name: str, rules) -> dict:
    """A run on two simulated nodes (``pipelines.sim_nodes``: a mount namespace each, a private disk at
    ``checkpoint.l0``), each torchrun with one rank as a PyTorchJob replica runs it, started again when it exits
    non-zero. A ``lose`` fault leaves its mark in the state folder: this harness then kills every process of that
    node and starts a replacement over a new, empty disk."""
    from pipelines.sim_nodes import Node, free_port
    from pipelines.spec import load_spec

    root, sets = _where(ctx, name, NODE_SETS, "/run")
    state = root / "faults"
    root.mkdir(parents=True)
    (root / "spec.yaml").write_text(load_spec(None, sets, env={}).to_yaml())
    port = free_port()
    env = _env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               **({"LLMP_FAULTS": json.dumps(rules), "LLMP_FAULTS_STATE": str(state)} if rules else {}))
    disks: list[Path] = []

    def start(rank: int) -> Node:
        """A node (``rank``: its place in the harness; torchrun's c10d rendezvous gives group ranks by its own
        order, so a rule's ``node`` is a group rank and a loss names the simulated node, ``LLMP_SIM_NODE``)."""
        disks.append(root / "disks" / f"disk-{len(disks) + 1}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
               str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
               "--rdzv-conf", "last_call_timeout=3,join_timeout=120", "--max-restarts", "3", "-m",
               "pipelines.train.trainer", "--spec", str(root / "spec.yaml"), "--tokenize-manifest", ctx["tok"],
               "--out", str(root / "train"), "--ckpt-root", f"{root}/l0/{SUB}"]
        return Node(f"{rank}", disks[-1], root / "l0", cmd, {**env, "LLMP_SIM_NODE": str(len(disks))},
                    root / f"node-{len(disks)}-rank{rank}.log", cwd=ROOT, backoff_limit=BACKOFF)

    t0 = time.monotonic()
    nodes: dict[int, Node] = {}
    everyone: list[Node] = []  # every node started, in order: node i's disk is disks[i]
    try:
        for r in (0, 1):
            nodes[r] = start(r)
            everyone.append(nodes[r])
        while not all(n.finished for n in nodes.values()) and time.monotonic() - t0 <= BOUND_S:
            if any(n.finished and n.codes and n.codes[-1] != 0 for n in nodes.values()):
                break  # a node gave up (its backoff limit): the job has failed, its other pods are stopped
            for mark in sorted(state.glob("lose-*")):  # lose-<i>: the i-th node started (1-based) is lost
                i = int(mark.name.split("-", 1)[1]) - 1
                mark.rename(state / f"lost-{i + 1}")
                r = next((r for r, n in nodes.items() if n is everyone[i]), None)
                if r is not None:  # a node already replaced is not lost twice
                    everyone[i].lose()
                    nodes[r] = start(r)
                    everyone.append(nodes[r])
            time.sleep(0.1)
    finally:
        hang = time.monotonic() - t0 > BOUND_S
        for n in everyone:
            if not n.finished and not n.lost:
                n.lose()
    codes = [n.codes[-1] if n.codes else n.proc.returncode for n in nodes.values() if not n.lost]  # not stopped by us
    rc = "hang" if hang else next((c for c in codes if c), 0)
    out = "\n".join(n.output() for n in everyone)
    kept = [disks[everyone.index(n)] for n in nodes.values()]
    return {"rc": rc, "out": out, "root": root, "sets": sets, "s": time.monotonic() - t0, "disks": kept}


def _two_node_reference(ctx: dict) -> dict:
    from pipelines.train.ckpt import protocol as ck

    ref = run_two(ctx, "reference 2 nodes", None)
    assert ref["rc"] == 0, ref["out"][-3000:]
    return final_state(ref["root"] / "l1" / SUB / ck.step_name(STEPS))


def final_state(step_dir: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(step_dir, Path(d) / "s.pt")
        return torch.load(Path(d) / "s.pt", weights_only=False)


def equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return a == b


def check(ctx: dict, sc: dict, run: dict) -> dict:
    """The invariants of one run: {I1..I5: ok / n/a / FAIL: why}."""
    from pipelines.spec import load_spec
    from pipelines.train.ckpt import protocol as ck
    from pipelines.train.ckpt import tiers as ckpt_tiers

    inv = {}
    root = run["root"]
    inv["I4"] = "FAIL: no end within the bound" if run["rc"] == "hang" else "ok"
    spec = load_spec(None, run["sets"], env={})
    l1_roots = [p.parent.parent for p in (root / "l1").glob("*/*/step-*/COMMIT")]
    rel_root = l1_roots[0].relative_to(root / "l1").as_posix() if l1_roots else None
    steps = ckpt_tiers.list_steps(spec, rel_root, ("L0", "L1")) if rel_root else {"L0": [], "L1": []}
    newest = max(steps["L1"], default=None)
    try:
        if newest is not None:
            ck.verify_local(root / "l1" / rel_root / ck.step_name(newest))
        inv["I1"] = "ok"
    except ck.CheckpointError as e:
        inv["I1"] = f"FAIL: newest L1 step does not verify: {e}"
    final_ok = newest == STEPS
    if run["rc"] == 0:
        if not final_ok:
            inv["I3"] = "FAIL: exit 0 without the final step on L1"
        else:
            same = equal(reference_state(ctx, run, sc), final_state(root / "l1" / rel_root / ck.step_name(STEPS)))
            inv["I3"] = "ok" if same else "FAIL: final state differs from the fault-free run"
    elif run["rc"] != "hang":
        lines = [ln for ln in run["out"].splitlines() if "train: error:" in ln]
        named = lines and any(t in lines[-1] for t in ("L0", "L1", "L2", "/l0/", "/l1/"))
        inv["I3"] = "ok" if named and "fail" in sc["expect"].split("|") else \
            f"FAIL: exit {run['rc']}: {(lines or run['out'].splitlines()[-1:] or [''])[-1][:160]}"
    else:
        inv["I3"] = "n/a"
    result = root / "train" / "result.json"  # the ranks' own (launch keeps a copy in the stage's output)
    resumed = json.loads(result.read_text()).get("resumed_from") if result.is_file() else None
    stops = preempted_steps(run.get("outs", [run["out"]])[0])
    whole = resumed is not None and (resumed["step"] % EVERY == 0 or resumed["step"] in stops.get("stopped", []))
    inv["I2"] = "n/a" if resumed is None else ("ok" if whole else f"FAIL: resumed {resumed}")
    inv["I7"] = preemption_held(sc, run, stops, resumed)
    inv["I8"] = fencing_held(run)
    for i, disk in enumerate(run.get("disks", [])):  # each node's own L0 (a lost node's disk left with it)
        node_spec = load_spec(None, run["sets"] + [f"checkpoint.l0={disk}"], env={})
        steps[f"L0 of node disk {i}"] = ckpt_tiers.list_steps(node_spec, SUB, ("L0",))["L0"]
    over = {t: v for t, v in steps.items() if len(v) > KEEP + 1 + (HOLD if t == "L1" else 0)}
    inv["I5"] = f"FAIL: {over}" if over else "ok"
    return inv


def preempted_steps(out: str) -> dict:
    """From a preempted attempt's output: the steps done when ranks got the signal themselves, and the step each
    rank stopped after (every rank prints ``train: preempted (SIGTERM at step 11 | another rank's notice) after step
    12; committed on L1``)."""
    streamed = out.split("train: error: ")[0]  # the error line repeats the last lines
    found = re.findall(r"train: preempted \((?:\w+ at step (\d+)|another rank's notice)\) after step (\d+)", streamed)
    return {"signal": [int(a) for a, _ in found if a], "stopped": [int(b) for _, b in found]} if found else {}


def preemption_held(sc: dict, run: dict, stops: dict, resumed) -> str:
    """I7: a preempted attempt exits 75 with the step the ranks stopped after on L1 (no older than the step at the
    signal), and the retry resumes there."""
    if not any(r["do"] == "preempt" for r in sc.get("rules", [])):
        return "n/a"
    if not stops:
        # no rank saw it between steps: it came once training was done (the ranks closing, torchrun ending)
        return "n/a: the notice came after the last step"
    stopped, seen = set(stops["stopped"]), min(stops["signal"] or [-1])
    if run.get("rcs", [run["rc"]])[0] != RETRY:
        return f"FAIL: the preempted attempt exited {run['rcs'][0]}, not {RETRY}"
    if len(stopped) != 1 or not seen <= min(stopped) <= seen + 2:
        return f"FAIL: ranks stopped after {sorted(stopped)}, the signal came at step {seen}"
    step = stopped.pop()
    if resumed is None or resumed["step"] != step:
        return f"FAIL: stopped after step {step} but the retry resumed from {resumed}"
    return "ok"


def fencing_held(run: dict) -> str:
    """I8: a superseded attempt never exits 0, and what the attempt that finished first committed stands."""
    if "snap" not in run:
        return "n/a"
    if run.get("zombie_rc") == 0 or run.get("zombie_stage"):
        return f"FAIL: the zombie attempt exited {run['zombie_rc']}, its stage committed: {run.get('zombie_stage')}"
    if not run["snap"]:
        return "FAIL: no attempt finished with its final step committed"
    changed = [k for k, v in run["snap"].items() if run["after"].get(k) != v]
    return f"FAIL: changed after the first finish: {changed}" if changed else "ok"


def data_scenario(sc: dict, base: Path) -> dict:
    """I6 on the reader: a compressed JSONL (or WARC) input cut at a seeded point; every record read is a doc or a
    quarantine entry, and the cut is a ``bad_compression`` entry."""
    import gzip

    import zstandard

    from pipelines.data import formats
    from pipelines.spec import load_spec

    cfg = load_spec(None, [], env={}).data.ingest
    lines = "".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(3000)).encode()
    kind = sc["name"].rsplit(" ", 1)[-1]
    data = zstandard.ZstdCompressor().compress(lines) if kind == "zst" else gzip.compress(lines)
    cut = max(1, int(len(data) * min(0.98, sc["cut"])))
    path = base / f"cut.jsonl.{kind}"
    path.write_bytes(data[:cut])
    chunk = formats.Chunk(no=0, name=path.name, path=str(path), fmt="jsonl", size=cut)
    rows = [r for r in formats.rows(chunk, cfg) if isinstance(r, formats.Row)]
    docs = sum(1 for r in rows if r.text is not None)
    bad = [r for r in rows if r.reason == "bad_compression"]
    whole = _readable_lines(data[:cut], kind)  # every line that the cut prefix holds whole
    ok = len(bad) == 1 and docs == whole and len(rows) == docs + 1
    return {"I6": "ok" if ok else f"FAIL: {docs} docs of {whole} whole lines, {len(bad)} bad_compression of a cut "
                                  f"at {cut}/{len(data)}"}


def _readable_lines(prefix: bytes, kind: str) -> int:
    """Complete lines in what a tolerant decoder gets out of a cut stream (the reference for I6)."""
    import zlib

    import zstandard

    if kind == "zst":
        out = zstandard.ZstdDecompressor().decompressobj().decompress(prefix)
    else:
        out = zlib.decompressobj(wbits=31).decompress(prefix)
    return out.count(b"\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="make faults", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20, help="how many seeds (scenarios) to run")
    ap.add_argument("--first", type=int, default=0, help="the first seed")
    ap.add_argument("--seed", type=int, action="append", help="run exactly these seeds (repeatable)")
    a = ap.parse_args(argv)
    seeds = a.seed or list(range(a.first, a.first + a.seeds))
    rows = run_matrix(seeds, Path(tempfile.mkdtemp(prefix="llmp-faults-")))
    print(summary(rows))
    return 0 if all(r["ok"] for r in rows) else 1


def summary(rows: list[dict]) -> str:
    """The table's last lines: how many held every invariant, by outcome, and how many faults never struck (the
    run ended before the rule's nth hit: that row checks the fault-free path)."""
    from collections import Counter

    ok = sum(r["ok"] for r in rows)
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(Counter(r["outcome"] for r in rows).items()))
    idle = [str(r["seed"]) for r in rows if r["unfired"]]
    two = sum(bool(r["scenario"].get("nodes")) for r in rows)
    return (f"{ok} of {len(rows)} scenarios held every invariant ({outcomes}); {two} on two nodes; "
            f"{len(idle)} whose fault never struck: {' '.join(idle) or '-'}")


def combined(seeds: tuple[int, ...]) -> dict:
    """Several seeds' faults in one run (the ``make test`` subset: every kind and phase in fewer runs): their
    rules together, each firing as its own seed says. The seeds must all be runs on the same number of nodes."""
    scs = [scenario(s) for s in seeds]
    if len({sc.get("nodes", 1) for sc in scs}) != 1 or (len(scs) > 1 and any(sc.get("data") for sc in scs)):
        raise ValueError(f"seeds {seeds}: only runs on the same number of nodes combine")
    if len(scs) == 1:
        return scs[0]
    return {"name": " + ".join(sc["name"].removeprefix("2 nodes: ") for sc in scs),
            "rules": [r for sc in scs for r in sc["rules"]], "expect": "ok",
            **({"nodes": 2} if scs[0].get("nodes") else {})}


INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8")


def start_run(ctx: dict, name: str, sc: dict) -> dict:
    if sc.get("zombie"):
        return run_zombie(ctx, name, sc)
    if sc.get("twice"):
        return run_twice(ctx, name, sc)
    if sc.get("nodes"):
        return run_two(ctx, name, sc["rules"])
    return run_one(ctx, name, sc["rules"], tuple(sc.get("sets", ())), sc.get("fence_lost", ""))


def _outcome(sc: dict, run: dict) -> str:
    """``exit 75→0``: a retry after the first attempt; ``exit 0|75``: the two launches' statuses; ``zombie 75``."""
    word = lambda rc: "hang" if rc in ("hang", None) else str(rc)  # noqa: E731
    if sc.get("twice"):
        return "exit " + "|".join(word(rc) for rc in run["rcs"])
    text = "exit " + "→".join(word(rc) for rc in run.get("rcs", [run["rc"]]))
    return text + (f", zombie {word(run['zombie_rc'])}" if sc.get("zombie") else "")


def _note(sc: dict, run) -> str:
    """The row's last column: for a preemption, the step at the signal → the step committed → the step resumed."""
    if run is None or not any(r["do"] == "preempt" for r in sc.get("rules", [])):
        return ""
    stops = preempted_steps(run.get("outs", [run["out"]])[0])
    result = run["root"] / "train" / "result.json"
    resumed = (json.loads(result.read_text()).get("resumed_from") or {}).get("step") if result.is_file() else None
    if not stops:
        return "  (no notice before the end)"
    return f"  signal at step {min(stops['signal'] or [-1])} → committed {max(stops['stopped'])} → resumed {resumed}"


def run_matrix(seeds: list, base: Path, log=print) -> list[dict]:
    """One run per seed, or per tuple of seeds (:func:`combined`)."""
    sys.path.insert(0, str(ROOT))

    scs = {s: combined(s if isinstance(s, tuple) else (s,)) for s in seeds}
    with contextlib.ExitStack() as stack:  # the S3 server stops whatever happens
        return _rows(scs, base, stack, log)


def _rows(scs: dict, base: Path, stack: contextlib.ExitStack, log) -> list[dict]:
    from pipelines.sim_nodes import namespaces_permitted
    from pipelines.storage import faults
    from pipelines.train.ckpt import protocol as ck

    ctx = None
    rows = []
    log(f"{'scenario':{W}} {'seed':>8} {'fired':>5} {'outcome':16} " + " ".join(f"{k:4}" for k in INVARIANTS) + "  s")
    for seed, sc in scs.items():
        label = "+".join(map(str, seed)) if isinstance(seed, tuple) else str(seed)
        unfired: list[int] = []
        if sc.get("nodes") and (why := namespaces_permitted()) is not None:
            log(f"{sc['name'][:W]:{W}} {label:>8}  left out: simulated nodes need mount namespaces ({why})")
            rows.append({"seed": seed, "scenario": sc, "outcome": "left out", "inv": {}, "ok": True, "fired": 0,
                         "unfired": []})
            continue
        run = None
        if sc.get("data"):
            inv, outcome, secs, fired = data_scenario(sc, base), "read", 0.0, 1
        else:
            if ctx is None:
                ctx = prepare(base, stack)
                rel = next((ctx["ref"]["root"] / "l1").glob("*/*/step-*/COMMIT")).parent.parent
                ctx["ref_state"] = final_state(rel / ck.step_name(STEPS))
            if sc.get("nodes") and "ref2_state" not in ctx:
                ctx["ref2_state"] = _two_node_reference(ctx)
            run = start_run(ctx, f"s{label}", sc)
            inv, secs = check(ctx, sc, run), run["s"]
            names = faults.fired(run["root"] / "faults")
            fired = sum(n.startswith("rule-") for n in names)  # 0: the run never reached the fault's nth hit
            unfired = [i for i in range(len(sc["rules"])) if not any(n.startswith(f"rule-{i}-") for n in names)]
            outcome = _outcome(sc, run)
            if any(v.startswith("FAIL") for v in inv.values()):
                (base / f"s{label}.log").write_text(run["out"])
        short = {k: ("ok" if v == "ok" else "n/a" if v.startswith("n/a") else "FAIL") for k, v in inv.items()}
        ok = not any(v.startswith("FAIL") for v in inv.values())
        log(f"{sc['name'][:W]:{W}} {label:>8} {fired:>5} {outcome:16} "
            + " ".join(f"{short.get(k, 'n/a'):4}" for k in INVARIANTS) + f"  {secs:.0f}" + _note(sc, run))
        for k, v in inv.items():
            if v.startswith("FAIL"):
                log(f"    {k}: {v} (log: {base / f's{label}.log'})")
        rows.append({"seed": seed, "scenario": sc, "outcome": outcome, "inv": inv, "ok": ok, "fired": fired,
                     "unfired": unfired})
    return rows


if __name__ == "__main__":
    sys.exit(main())
