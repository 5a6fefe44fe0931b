"""A preemption notice checkpoints the step and exits with the retry code; exit codes mean what happened (issue 44).

* SIGTERM to ``python -m pipelines.train.launch`` (as the operator's stop or a pod eviction sends it) during
  training: the ranks agree on a step, commit it to L1, the stage exits 75; the same command resumes there and
  ends bitwise equal to an uninterrupted run;
* SIGUSR1 to one rank only: both ranks stop at the same step;
* the operators fail a task with a retryable ``AirflowException`` for 75 and ``AirflowFailException`` for 2.
"""
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pipelines.spec import load_spec
from pipelines.launch import outcomes as xc
from pipelines.launch import k8s

from conftest import ROOT, wait_for
from test_resilience import (_assert_bitwise_equal, _commit_of, _env, _final_state, _launch_cmd, _tok,
                             _trainer_ranks)

SETS = ["train.steps=30", "train.ckpt_every=10", "launcher.nproc_per_node=2", "launcher.max_restarts=1"]
DELAY = {"LLMP_FAULT_STEP_DELAY_S": "0.15"}  # so that the notice lands between the checkpoints


def _l1_steps(root: Path) -> list[int]:
    """Steps globally committed on L1 (a COMMIT file in the step directory)."""
    return sorted(int(p.parent.name.split("-")[1]) for p in (root / "l1").glob("*/*/step-*/COMMIT"))


def _stops(out: str) -> tuple[list[int], list[int]]:
    """(the steps done when each rank that got the notice itself got it, the step each rank stopped after):
    every rank prints ``train: preempted (SIGTERM at step 11 | another rank's notice) after step 12; …``."""
    streamed = out.split("train: error: ")[0]  # the error message repeats the last lines
    found = re.findall(r"train: preempted \((?:\w+ at step (\d+)|another rank's notice)\) after step (\d+); "
                       r"committed on L1", streamed)
    return [int(a) for a, _ in found if a], [int(s) for _, s in found]


# every rank pauses 4 s after step 15: the notice sent once step 10's COMMIT is seen lands by then on a busy machine
# (and leaves most of train.preempt_grace_s to commit the step)
HOLD = {"LLMP_FAULTS": json.dumps([{"at": "step", "do": "slow", "seconds": 4, "nth": 15, "times": 1}])}


def _start(tok, root: Path) -> subprocess.Popen:
    return subprocess.Popen(_launch_cmd(tok, root, SETS), env=_env(**DELAY, **HOLD), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _preempt_and_resume(tok, root: Path, send) -> tuple[int, int, str]:
    """Start the stage, wait for the COMMIT of step 10 on L0 (training is past it), ``send`` the notice; returns
    (the steps done when the first rank got the signal, the step the preemption committed, the stage's output)."""
    p = _start(tok, root)
    try:
        wait_for(_commit_of(root, 10), 240, "the COMMIT of step 10 on L0")
        send(p)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == xc.RETRY, out[-4000:]
    at, stopped = _stops(out)
    assert len(stopped) == 2 and len(set(stopped)) == 1, (stopped, out[-3000:])  # both ranks, the same step
    step, seen = stopped[0], min(at or [-1])
    # the step in flight at the notice, or the next one when the notice came after this step's agreement
    assert 10 <= seen < step <= seen + 2, (at, stopped)
    assert re.search(rf"train: error: preempted \([^)]*\); step {step} is committed on L1", out), out[-3000:]
    assert step in _l1_steps(root) and max(_l1_steps(root)) == step, (step, _l1_steps(root))
    assert f"[preempt] step {step} committed on L1" in out, out[-3000:]
    return seen, step, out


def _rerun(tok, root: Path) -> dict:
    r = subprocess.run(_launch_cmd(tok, root, SETS), env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((root / "train/manifest.json").read_text())


def test_sigterm_to_the_launcher_checkpoints_the_step_exits_75_and_the_rerun_resumes_bitwise(home):
    tok = _tok(home)
    ref, run = home / "ref", home / "pre"
    r = subprocess.run(_launch_cmd(tok, ref, SETS), env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

    seen, step, out = _preempt_and_resume(tok, run, lambda p: p.send_signal(signal.SIGTERM))
    assert f"train: error: preempted (SIGTERM); step {step} is committed on L1" in out, out[-3000:]
    assert step % 10, f"the notice landed on a checkpoint step ({step}): the test shows nothing new"
    m = _rerun(tok, run)
    print(f"SIGTERM to the launcher: step seen at the signal {seen}, committed on L1 {step}, resumed from "
          f"{m['extra']['resumed_from']}")
    assert m["extra"]["resumed_from"]["step"] == step
    _assert_bitwise_equal(_final_state(ref, "step-000030"), _final_state(run, "step-000030"), "final")
    assert json.loads((run / "train/losses.json").read_text()) == json.loads((ref / "train/losses.json").read_text())


def _usr1_to_one_rank(p):
    wait_for(lambda: _trainer_ranks(p)[-1:], 10, "a trainer rank")[0].send_signal(signal.SIGUSR1)


def _term_to_torchrun(p):
    agents = [k for k in psutil.Process(p.pid).children() if "torch.distributed.run" in " ".join(k.cmdline())]
    assert len(agents) == 1, agents
    agents[0].send_signal(signal.SIGTERM)


def _term_to_the_group(p):
    """As the operators' stop (``pipelines.procs.stop_group``) sends it: launcher and torchrun both get it."""
    os.killpg(p.pid, signal.SIGTERM)


@pytest.mark.parametrize("send", [_usr1_to_one_rank, _term_to_torchrun, _term_to_the_group],
                         ids=["usr1-one-rank", "term-torchrun", "term-group"])
def test_a_notice_to_one_rank_torchrun_or_the_group_stops_both_ranks_at_the_same_step(home, send):
    tok = _tok(home)
    run = home / "one"
    seen, step, out = _preempt_and_resume(tok, run, send)
    said = "SIGTERM" if send is _term_to_the_group else "notice to the ranks"
    assert f"train: error: preempted ({said})" in out, out[-3000:]
    if send is _usr1_to_one_rank:
        assert "another rank's notice" in out, out[-3000:]  # rank 0 stopped on rank 1's notice
    m = _rerun(tok, run)
    print(f"{send.__name__}: step seen at the signal {seen}, committed on L1 {step}, resumed from "
          f"{m['extra']['resumed_from']}")
    assert m["extra"]["resumed_from"]["step"] == step and m["counts"]["steps"] == 30


# ---------------------------------------------------------------- exit codes


def _operators():
    sys.path.insert(0, str(ROOT / "plugins"))
    import llm_operators

    return llm_operators


@pytest.mark.parametrize("code, retried", [(xc.RETRY, True), (1, True), (-9, True), (xc.USER_ERROR, False)])
def test_the_operator_fails_a_task_retryably_except_for_a_user_error(code, retried):
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    ops = _operators()
    exc = ops.exit_failure("pipelines.train.launch", code, ["last line"])
    assert isinstance(exc, AirflowException) and "last line" in str(exc)
    assert isinstance(exc, AirflowFailException) is not retried
    assert ops.exit_failure("pipelines.train.launch", 0) is None
    if code == xc.RETRY:  # what the retry resumes from, in the stage's own terms
        assert "newest committed checkpoint" in str(exc)
        assert "left off" in str(ops.exit_failure("pipelines.data.tokenize", code)) \
            and "checkpoint" not in str(ops.exit_failure("pipelines.data.tokenize", code))


class _Log:
    def info(self, *a):
        pass


class _Op:
    log = _Log()
    kill_grace_s = 5.0


@pytest.mark.parametrize("code", [xc.RETRY, xc.USER_ERROR])
def test_run_cli_maps_a_stage_exit_status(tmp_path, home, code):
    """The operators' stage runner on a real process that exits with ``code``."""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    (tmp_path / "llmp_exit_stub.py").write_text("import sys\nprint('stub ran')\nsys.exit(int(sys.argv[1]))\n")
    ops = _operators()
    with pytest.raises(AirflowException) as e:
        ops._run_cli(_Op(), "llmp_exit_stub", [str(code)], env={"PYTHONPATH": str(tmp_path)})
    assert isinstance(e.value, AirflowFailException) is (code == xc.USER_ERROR) and "stub ran" in str(e.value)


def test_rank_failures_are_retried_unless_a_rank_says_the_input_is_wrong(tmp_path):
    assert xc.failed_ranks_code([]) == xc.RETRY  # killed, OOM, lost: nothing said
    xc.write_outcome(tmp_path, 1, xc.RETRY, "storage: EIO")
    assert xc.failed_ranks_code(xc.read_outcomes(tmp_path)) == xc.RETRY
    xc.write_outcome(tmp_path, 0, xc.USER_ERROR, "diverged")
    assert xc.failed_ranks_code(xc.read_outcomes(tmp_path)) == xc.USER_ERROR
    xc.clear_outcome(tmp_path, 0)
    assert [o["rank"] for o in xc.read_outcomes(tmp_path)] == [1]


def test_rendered_jobs_give_the_pods_the_preemption_grace(home):
    for kind in ("trainjob", "pytorchjob"):
        spec = load_spec(None, [f"launcher.kind={kind}", "train.preempt_grace_s=40"], env={})
        job = k8s.RENDER[kind](spec, "unit", [])
        pod = (job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
               ["template"]["spec"]["template"]["spec"] if kind == "trainjob"
               else job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"])
        assert pod["terminationGracePeriodSeconds"] == 45
        cmd = job["spec"]["trainer"]["command"] if kind == "trainjob" else pod["containers"][0]["command"]
        assert cmd[cmd.index("--shutdown-timeout") + 1] == "45" and "SIGUSR1" in cmd[cmd.index("--signals-to-handle") + 1]
        k8s.check_job(job, spec)  # the vendored CRD and the webhook rules accept it
    assert load_spec(None, [], env={}).train.preempt_grace_s == 25  # + 5 = Kubernetes' default 30 s


def test_a_job_failed_by_its_nodes_is_retried_a_refused_one_is_not(home, monkeypatch, tmp_path):
    from pipelines.launch import ranks

    spec = load_spec(None, ["launcher.kind=trainjob"], env={})
    for retryable, want in ((True, ranks.TrainRetry), (False, ranks.TrainError)):
        def fail(*a, _r=retryable, **k):
            raise k8s.JobFailed("TrainJob ns/x failed: node lost", retryable=_r)

        monkeypatch.setattr(ranks, "run_job", fail)
        with pytest.raises(ranks.TrainError) as e:
            ranks.run_ranks(spec, "pipelines.train.trainer", [], run_id="x", work=tmp_path)
        assert type(e.value) is want and e.value.exit_code == (xc.RETRY if retryable else xc.USER_ERROR)
    # a rank that said the input is wrong makes even a failed job a user error
    xc.write_outcome(tmp_path, 0, xc.USER_ERROR, "ValueError: vocab")
    monkeypatch.setattr(ranks, "run_job", lambda *a, **k: (_ for _ in ()).throw(k8s.JobFailed("failed", True)))
    with pytest.raises(ranks.TrainError) as e:
        ranks.run_ranks(spec, "pipelines.train.trainer", [], run_id="x", work=tmp_path)
    assert type(e.value) is ranks.TrainError
