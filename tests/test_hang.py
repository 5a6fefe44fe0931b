"""A hung rank is found by its silent heartbeat, named with what it was doing, killed and restarted (issue 44).

* the watcher's decision: a rank silent past its phase's allowance is hung; a beating, finished or exited one is not;
* what it trusts: a beat file with every field of its type, of this host, in a directory of this user's own (else
  no hang detection, said once); never a link; a failed look is said once and the watcher goes on;
* the allowances of the phases with bounded waits (a save, rank 0's MLflow calls, the final close) cover them;
* a watcher reports a silent process with the function it is in (``faulthandler``), says a stopped one cannot
  answer, and kills both;
* a hang past torchrun's restarts: the launcher's error is retryable (75) and names the rank;
* SIGSTOP of one rank of a real 2-rank torchrun run: named within ``train.hang_timeout_s`` (not the 30 min
  collective timeout), killed, torchrun restarts the ranks, the run ends bitwise equal to one without the hang.
"""
import dataclasses
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from pipelines.train import heartbeat as hb

from conftest import ROOT, wait_for
from test_resilience import _assert_bitwise_equal, _commit_of, _env, _final_state, _launch_cmd, _tok

TIMEOUT_S = 6.0
SETS = ["train.steps=20", "train.ckpt_every=5", "launcher.nproc_per_node=2", "launcher.max_restarts=1",
        f"train.hang_timeout_s={TIMEOUT_S:g}"]


def _beat(rank, at, allow_s=5.0, done=False, pid=None):
    return hb.Beat(rank=rank, local_rank=rank, pid=pid or 1000 + rank, restart=0, host="h", phase="forward/backward",
                   step=3, at=at, allow_s=allow_s, done=done)


def test_the_watcher_names_a_rank_silent_past_its_allowance_and_no_other():
    now = 1000.0
    beats = [_beat(0, now - 1), _beat(1, now - 9), _beat(2, now - 6), _beat(3, now - 50, done=True),
             _beat(4, now - 60), _beat(5, now - 60, allow_s=1805.0)]
    got = hb.hung(beats, now, alive=lambda pid: pid != 1004)  # rank 4 exited: torchrun's to handle
    assert [(b.rank, s) for b, s in got] == [(1, 9.0), (2, 6.0)]  # the longest silent first
    assert hb.hung(beats, now, alive=lambda pid: True)[0][0].rank == 4
    assert hb.hung([_beat(0, now - 5)], now, alive=lambda pid: True) == []  # at the bound: not yet


def test_a_closed_heart_leaves_nothing_and_this_hosts_gone_agents_directories_are_swept(tmp_path, monkeypatch):
    d = tmp_path / hb.dir_name("run", os.getpid())
    h = hb.Heart(d, rank=0, local_rank=0, restart=0, timeout_s=1, wait_s=1).start(watch=False)
    assert [b.phase for b in hb.read_beats(d, 0, hb.host())] == ["start"]
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (d / "kill-restart0-rank1-pid1").touch()  # an earlier hang's claim
    h.close()
    assert not d.exists()
    gone, live = tmp_path / hb.dir_name("run", 999999999), tmp_path / hb.dir_name("run", os.getpid())
    # another host's (a shared LLMP_HEARTBEAT_DIR), one whose name begins with this host's: its agent is not ours
    others = [tmp_path / f"{hb.PREFIX}{name}.run-999999999" for name in ("other-node", f"{hb._safe(hb.host())}-2")]
    for x in (gone, live, *others):
        x.mkdir()
        (x / "rank0.json").write_text("{}")
    hb.sweep(tmp_path)
    assert not gone.exists() and live.exists() and all(x.exists() for x in others)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a/../b")
    assert hb.node_dir(tmp_path) == tmp_path / f"{hb.PREFIX}{hb._safe(hb.host())}.a____b-{os.getppid()}"


def _raw(**over) -> dict:
    raw = {"rank": 1, "local_rank": 1, "pid": 1001, "restart": 0, "host": hb.host(), "phase": "forward/backward",
           "step": 3, "at": 5.0, "allow_s": 5.0, "done": False}
    return {**raw, **over}


def test_a_beat_is_used_only_when_every_field_has_its_type():
    assert [f.name for f in dataclasses.fields(hb.Beat)] == list(hb.KINDS)
    assert hb.parse_beat(_raw()) == hb.Beat(**_raw())
    assert hb.parse_beat(_raw(step=None, at=5)) == hb.Beat(**_raw(step=None, at=5.0))
    missing = _raw()
    del missing["host"]
    bad = [_raw(at="5"), _raw(at=float("nan")), _raw(at=float("inf")), _raw(rank="../../x"), _raw(rank=True),
           _raw(rank=-1), _raw(rank=1.0), _raw(local_rank=None), _raw(pid=0), _raw(pid="7"), _raw(restart=None),
           _raw(host=1), _raw(phase=None), _raw(step="3"), _raw(step=True), _raw(allow_s=0), _raw(allow_s="5"),
           _raw(done=1), _raw(extra=1), missing, [], "x", None]
    assert [raw for raw in bad if hb.parse_beat(raw) is not None] == []


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_malformed_beat_files_are_ignored_with_one_warning_and_a_failed_look_does_not_stop_the_watcher(tmp_path):
    said: list[str] = []
    h = hb.Heart(tmp_path / "d", rank=0, local_rank=0, restart=0, timeout_s=0.2, wait_s=0.2, log=said.append)
    d, calls, real = h.dir, [], h.check
    h.agent = 0  # this process (silent here) is no rank of an agent: never killed

    def check():  # the third look fails
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a look went wrong")
        return real()

    h.check = check
    h.start()
    try:
        (tmp_path / "elsewhere.json").write_text(json.dumps(_raw(rank=5)))
        (d / "rank1.json").write_text(json.dumps(_raw(at="x")))  # the TypeError that stopped the watcher for good
        (d / "rank2.json").write_text("{not json")
        (d / "rank3.json").write_text(json.dumps(_raw(rank=4)))  # not the file of its rank
        (d / "rank5.json").symlink_to(tmp_path / "elsewhere.json")  # never followed
        wait_for(lambda: len(calls) >= 8, 20, "the watcher going on after a failed look")
        assert [b.rank for b in hb.read_beats(d, 0, hb.host())] == [0]
        assert h._thread.is_alive()
    finally:
        h.close()
    assert len([m for m in said if "is not a heartbeat file" in m]) == 1, said
    assert len([m for m in said if "a look at the heartbeats failed (RuntimeError" in m]) == 1, said
    assert len(said) == 2, said


def test_a_watcher_kills_only_a_silent_rank_of_its_host_and_says_what_was_allowed(tmp_path):
    said: list[str] = []
    h = hb.Heart(tmp_path, rank=0, local_rank=0, restart=0, timeout_s=0.1, wait_s=0.2, log=said.append)
    h.agent = os.getpid()  # the sleepers are "ranks" of this node
    theirs, ours, earlier = _sleeper(), _sleeper(), _sleeper()
    try:
        beats = {1: _raw(rank=1, pid=theirs.pid, host="other-node", at=0.0, allow_s=0.1),  # another host's clock
                 2: _raw(rank=2, pid=earlier.pid, restart=1, at=0.0, allow_s=0.1),  # another torchrun restart's
                 3: _raw(rank=3, pid=ours.pid, at=0.0, allow_s=0.3)}
        for r, raw in beats.items():
            (tmp_path / f"rank{r}.json").write_text(json.dumps(raw))
        assert h.check() == [3]
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert theirs.poll() is None and earlier.poll() is None
    finally:
        for k in (theirs, ours, earlier):
            k.kill()
            k.wait()
    assert "(allowed 0.3 s: train.hang_timeout_s + 1 x checkpoint.collective_timeout_minutes)" in said[0], said


def test_a_beat_directory_not_this_users_own_is_refused_and_training_goes_on_unwatched(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv(hb.ENV_DIR, str(tmp_path / "base"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    elsewhere, d = tmp_path / "elsewhere", hb.node_dir()
    elsewhere.mkdir()
    d.parent.mkdir()
    d.symlink_to(elsewhere)  # its name is predictable: someone made it first
    assert hb.start(1.0, 1.0) is None
    hb.beat("forward/backward", 1)  # a no-op
    out = capsys.readouterr().out
    assert out.count("[hang] warning") == 1 and "refused" in out and "hangs are not detected" in out, out
    assert list(elsewhere.iterdir()) == []
    d.unlink()
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(hb.UnsafeDir):
        hb.own_dir(d)  # others may write it
    if os.getuid() == 0:
        os.chmod(d, 0o700)
        os.chown(d, 65534, 65534)
        with pytest.raises(hb.UnsafeDir):
            hb.own_dir(d)  # another user's
    fresh = tmp_path / "base" / "fresh"
    hb.own_dir(fresh)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


def test_heartbeat_files_are_never_written_or_read_through_a_link(tmp_path):
    d, victim = tmp_path / "d", tmp_path / "victim"
    hb.own_dir(d)
    victim.write_text("keep")
    for name in ("stack-rank0.txt", ".rank0.json.tmp", "stack-rank3.txt"):
        (d / name).symlink_to(victim)
    (d / "kill-restart0-rank1-pid7").symlink_to(tmp_path / "nowhere")  # a claim made already
    h = hb.Heart(d, rank=0, local_rank=0, restart=0, timeout_s=1, wait_s=2).start(watch=False)
    kid = _sleeper()
    try:
        h.beat("evaluation", 4, waits=3.5)
        assert victim.read_text() == "keep" and not (d / "stack-rank0.txt").is_symlink()
        assert json.loads((d / "rank0.json").read_text())["allow_s"] == 1 + 3.5 * 2
        assert not h._claim(hb.Beat(**_raw(rank=1, pid=7)))
        assert hb._faulthandler_dump(kid.pid, d / "stack-rank3.txt", 0.1) == ""  # no SIGUSR2 for a link's sake
        time.sleep(0.2)
        assert kid.poll() is None, "SIGUSR2 ends a process without a handler"
    finally:
        kid.kill()
        kid.wait()
        h.close()


def test_the_allowances_cover_a_saves_wait_rank_0s_mlflow_calls_and_the_final_close(monkeypatch):
    """Each wait bounded by checkpoint.collective_timeout_minutes is allowed one (heartbeat's ``waits``)."""
    from pipelines.train import trainer as tr

    beats, words = [], []
    monkeypatch.setattr(tr.heartbeat, "beat", lambda phase, step=None, waits=0: beats.append((phase, waits)))
    monkeypatch.setattr(tr.dist, "broadcast_object_list", lambda box, src: words.append((beats[-1][0], src)))
    t = object.__new__(tr.Trainer)
    t.prog, t.cold, t.rank, t.world = tr.Progress(), set(), 1, 2
    assert t._mlflow(lambda: 1 / 0) is None  # not rank 0: it waits for rank 0's word
    t.rank = 0
    assert t._mlflow(lambda: "logged") == "logged"
    assert beats == [(tr.MLFLOW, 1)] * 2 and words == [(tr.MLFLOW, 0)] * 2  # over for every rank together
    t.spec = SimpleNamespace(train=SimpleNamespace(ckpt_every=5, steps=20))
    t.ckpt, t.model, t.opt = SimpleNamespace(save=lambda *a: 0.0), None, None
    t.faults = SimpleNamespace(exit_at_step=None)
    t._state = dict
    t._save()
    assert beats[-1] == ("checkpoint save", 1)  # the save in flight first: not only after a start

    def close(step):
        raise InterruptedError

    t.ckpt = SimpleNamespace(close=close)
    with pytest.raises(InterruptedError):
        t.finish()
    # Checkpointer.close: the save in flight, the promotions' drain, the final step promoted again, L2 for half
    assert beats[-1][0].startswith("close") and beats[-1][1] >= 1 + 1 + 1 + 0.5, beats[-1]


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from pipelines.train.heartbeat import Heart

    h = Heart(Path(sys.argv[1]), rank=int(sys.argv[2]), local_rank=int(sys.argv[2]), restart=0, timeout_s=0.3,
              wait_s=0.3).start(watch=False)
    h.beat("storage read", step=7)

    def waiting_on_storage():
        time.sleep(60)

    waiting_on_storage()
""")


def _child(d: Path, rank: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(d), str(rank)], cwd=ROOT)


def test_a_watcher_dumps_the_stack_of_a_silent_rank_says_a_stopped_one_cannot_answer_and_kills_both(tmp_path):
    """Two "ranks" (children of this process, its agent here) that beat once and go silent; one is SIGSTOPped."""
    said: list[str] = []
    watcher = hb.Heart(tmp_path, rank=9, local_rank=9, restart=0, timeout_s=0.3, wait_s=0.3, log=said.append)
    watcher.agent = os.getpid()
    kids = [_child(tmp_path, 1), _child(tmp_path, 2)]
    try:
        wait_for(lambda: [b.phase for b in hb.read_beats(tmp_path, 0, hb.host())] == ["storage read"] * 2, 30,
                 "both children's beats")
        kids[1].send_signal(signal.SIGSTOP)
        wait_for(lambda: hb.proc_state(kids[1].pid)[0] == "T", 10, "the child stopped")
        wait_for(lambda: len(hb.hung(hb.read_beats(tmp_path, 0, hb.host()), time.monotonic(), watcher.alive)) == 2, 10,
                 "both children silent past 0.3 s")
        assert sorted(watcher.check()) == [1, 2]
        assert [k.wait(timeout=10) for k in kids] == [-signal.SIGKILL] * 2
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
    text = "\n".join(said)
    running, stopped = (text.split(f"[hang] rank {r} ")[1].split("[hang] rank ")[0] for r in (1, 2))
    assert f"(pid {kids[0].pid}," in running and "in 'storage read' at step 7" in running, text
    assert "waiting_on_storage" in running, text  # faulthandler's dump names the function it is in
    assert f"(pid {kids[1].pid}," in stopped and "stopped (SIGSTOP): it cannot answer" in stopped, text
    assert watcher.check() == []  # a killed rank is gone: nothing more to do


STUB = textwrap.dedent("""
    import os, time
    from pipelines.train import heartbeat

    def blocked_in_storage():
        time.sleep(20)  # the main thread silent, the process alive (its own watcher too)

    heartbeat.start(1.0, 1.0)
    for i in range(400):  # 20 s at most
        heartbeat.beat("stub work", step=i)
        if os.environ["RANK"] == "1":
            blocked_in_storage()
        time.sleep(0.05)
    heartbeat.stop()
""")


def test_a_hang_past_torchruns_restarts_exits_75_naming_the_rank(tmp_path, home, capsys):
    """torchrun with no restarts left: the stage's error is retryable (75) and names the hung rank."""
    from pipelines.spec import load_spec
    from pipelines.launch import ranks

    (tmp_path / "llmp_hang_stub.py").write_text(STUB)
    spec = load_spec(None, ["launcher.nproc_per_node=2", "launcher.max_restarts=0"], env={})
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "LLMP_HEARTBEAT_DIR": str(tmp_path / "hb")}
    t0, err = time.monotonic(), None
    try:
        ranks.run_torchrun(spec, [], module="llmp_hang_stub", env_extra=env)
    except ranks.TrainError as e:
        err = e
    took = time.monotonic() - t0
    assert type(err) is ranks.TrainRetry and err.exit_code == 75, err
    first = str(err).splitlines()[0]
    assert first.startswith("[hang] rank 1 (pid ") and "in 'stub work' at step 0" in first, err
    assert "torchrun's restarts are used up" in first and took < 20, (took, err)
    assert "in blocked_in_storage" in capsys.readouterr().out  # its stack, streamed


def _brief(out: str) -> str:
    """For a failure's message: the streamed output without the stacks, then the stage's error's first line."""
    streamed, _, error = out.partition("train: error: ")
    lines = [x for x in streamed.splitlines() if not x.startswith("[hang]   ")]
    return "\n".join(lines[-120:] + ["train: error: " + error.split("\n")[0]])


def _rank_beat(root: Path, rank: int) -> dict:
    found = list((root / "hb").glob(f"llmp-heartbeat-*/rank{rank}.json"))
    return json.loads(found[0].read_text()) if found else {}


def _start(cmd: list[str], env: dict, out=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)


def _read(p: subprocess.Popen) -> tuple[list[str], threading.Thread]:
    """``p``'s output lines, read as they come (never a full pipe; a failure's message can show them)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    return lines, reader


def _kill_tree(p: subprocess.Popen) -> None:
    """The launcher, torchrun and the ranks (each rank is in a session of its own)."""
    if p.poll() is not None:
        return
    for proc in psutil.Process(p.pid).children(recursive=True) + [psutil.Process(p.pid)]:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    p.wait(timeout=30)


def _wait(pred, timeout: float, what: str, lines: list[str]):
    try:
        return wait_for(pred, timeout, what)
    except AssertionError:
        raise AssertionError(f"timed out waiting for {what}; the output:\n{_brief(''.join(lines))}") from None


def test_sigstop_of_one_rank_is_named_killed_and_the_restarted_run_ends_bitwise_equal(home):
    """The reference run (no hang) runs beside the one whose rank 1 stops (SIGSTOP, a ``stop`` fault rule) after
    its 7th step, once: in a step's phase whatever the machine's pace (a signal sent by the test once it saw the
    COMMIT of step 5 could land in a save, whose allowance is minutes). Saves are synchronous, so step 5 is
    committed on L0 by then (rank 0 commits it before step 6's all-reduce)."""
    tok = _tok(home)
    ref, run, state = home / "ref", home / "hang", home / "faults"
    sets = SETS + ["checkpoint.async_mode=sync"]
    # a home of its own: two runs creating one MLflow database at the same time collide in its migrations
    p_ref = _start(_launch_cmd(tok, ref, sets), _env(LLMP_HOME=str(home / "ref-home")), subprocess.DEVNULL)
    stop = {"at": "step", "do": "stop", "rank": 1, "nth": 7, "times": 1}
    p = _start(_launch_cmd(tok, run, sets), _env(LLMP_FAULT_STEP_DELAY_S="0.1", LLMP_HEARTBEAT_DIR=str(run / "hb"),
                                                 LLMP_FAULTS=json.dumps([stop]), LLMP_FAULTS_STATE=str(state)))
    lines, reader = _read(p)
    try:
        _wait(lambda: "this rank stops here, SIGSTOP" in "".join(lines) or p.poll() is not None, 240,
              "rank 1's stop after its 7th step", lines)
        assert p.poll() is None, _brief("".join(lines))
        pid = int(re.search(r"this rank stops here, SIGSTOP \(pid (\d+)\)", "".join(lines)).group(1))
        stopped_at = time.monotonic()
        wait_for(lambda: hb.proc_state(pid) is None or hb.proc_state(pid)[0] == "T", 10, "rank 1 stopped")
        assert _commit_of(run, 5)(), _brief("".join(lines))
        last = _rank_beat(run, 1)  # frozen now: what the log must name
        _wait(lambda: p.poll() is not None, 120, "the end of the run", lines)
        took = time.monotonic() - stopped_at
        assert p_ref.wait(timeout=120) == 0
    finally:
        for q in (p, p_ref):
            _kill_tree(q)
    reader.join(timeout=10)
    out = "".join(lines)
    assert p.returncode == 0, _brief(out)
    line = next((x for x in out.splitlines() if x.startswith(f"[hang] rank 1 (pid {pid},")), None)
    assert line is not None, _brief(out)
    # "silent for 6.1 s in …", or, when another rank's beat is older, "silent too, since 0.4 s after rank 0 (…), for …"
    silent = float(re.search(r" for (\d+(?:\.\d+)?) s in ", line).group(1))
    print(f"SIGSTOP of rank 1 in {last['phase']!r} at step {last['step']}: {line}; the run ended {took:.1f} s after "
          "the stop")
    assert f"in '{last['phase']}' at step {last['step']}" in line and "(1 restart(s) left)" in line, line
    assert "[hang]   (no stack: stopped (SIGSTOP): it cannot answer" in out or shutil.which("py-spy"), out[-4000:]
    assert TIMEOUT_S <= silent < TIMEOUT_S + 3, line  # found by the heartbeat, not the 30 min collective timeout
    assert took < 90, took
    m = json.loads((run / "train/manifest.json").read_text())
    assert m["extra"]["resumed_from"]["step"] >= 5 and m["counts"]["steps"] == 20
    _assert_bitwise_equal(_final_state(ref, "step-000020"), _final_state(run, "step-000020"), "final")
    assert json.loads((run / "train/losses.json").read_text()) == json.loads((ref / "train/losses.json").read_text())


def test_the_launcher_reads_every_nodes_output_all_along_so_no_node_stops_on_a_full_pipe():
    """Local torchrun, one per node: node 1 writes far more than a pipe holds (64 KiB) before it ends, and names its
    error. The launcher read only node 0's pipe until the end, so node 1 stopped in its write and the launch never
    ended (on a cluster node 0 then waits in its collectives). Now every pipe is read as it fills, and node 1's error
    line reaches the failure's message."""
    from pipelines.launch.ranks import _stream

    talk = "import sys\nfor i in range(20000): print('promotion line', i, 'x' * 60)\n" \
           "print('train: error: node 1 says why', flush=True)\nsys.exit(2)"
    procs = [subprocess.Popen([sys.executable, "-c", c], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in ("print('node 0 done')", talk)]
    box = []
    t = threading.Thread(target=lambda: box.append(_stream(procs)), daemon=True)
    try:
        t.start()
        t.join(timeout=120)
        assert box, "the launch did not end: node 1 is stopped on its full pipe"
        codes, tail, errors = box[0]
        assert codes == [0, 2] and errors == ["train: error: node 1 says why\n"]
        assert tail[-1] == "train: error: node 1 says why\n"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_launcher_waits_for_torchrun_not_for_a_rank_left_holding_its_output(monkeypatch):
    """A rank torchrun left behind (in a session of its own, as torchrun starts them) keeps the output pipe open:
    the launcher used to read until every holder closed it, i.e. forever. Now it waits for torchrun, gives the pipe
    PIPE_GRACE_S, then kills what it saw under torchrun; past launcher.timeout_minutes it stops with TrainRetry."""
    from pipelines.launch import ranks
    from pipelines.procs import start_time

    monkeypatch.setattr(ranks, "PIPE_GRACE_S", 1.0)
    leaver = ("import subprocess, sys, time\n"
              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
              "print('rank', g.pid, flush=True); time.sleep(2); sys.exit(0)")
    p = subprocess.Popen([sys.executable, "-c", leaver], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, int] = {}
    t0 = time.monotonic()
    codes, tail, _ = ranks._stream([p], seen)
    rank = int(tail[0].split()[1])
    assert codes == [0] and time.monotonic() - t0 < 30 and rank in seen
    assert start_time(rank) is None or _zombie(rank), "the rank left behind still runs"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        with pytest.raises(ranks.TrainRetry, match="launcher.timeout_minutes"):
            ranks._stream([sleeper], {}, deadline=time.monotonic() + 1)
    finally:
        sleeper.kill()
        sleeper.wait()


def _zombie(pid: int) -> bool:
    from pipelines.procs import state

    return state(pid) == "Z"
