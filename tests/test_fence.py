"""Fencing between attempts (issue 44, item 5): a newer attempt's term supersedes an older one, which then stops
before it commits or deletes anything; a COMMIT a newer term wrote is never deleted by an older one; start-up
cleanup keeps a live attempt's temp files; an attempt whose own lease lapsed fences itself.

The lease/term logic on a directory, the storage functions (L0/L1 commit and removal, L2 COMMIT) under an
installed fence, the checkpointer's start; at the end one real run: two launches of one run, the first frozen
(a zombie) while the second, the retry, runs to the end.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipelines.spec import load_spec
from pipelines.train.ckpt import local as ckpt_local
from pipelines.train.ckpt import tiers as ckpt_tiers
from pipelines.train.ckpt import fence
from pipelines.train.ckpt.protocol import (COMMIT, CheckpointError, L2Unavailable, TierUnavailable,
                                          read_local_manifest, verify_local)

from conftest import ROOT, wait_for


def _take(d: Path, attempt: str, roots=(), lease_s: float = 60.0, launch=None) -> fence.Fence:
    return fence.Fence.take(d, attempt, lease_s, tuple(str(r) for r in roots), log=lambda m: None, launch=launch)


@pytest.fixture
def installed():
    """Install fences for the test; none is left installed after it."""
    made = []

    def put(f: fence.Fence) -> fence.Fence:
        made.append(f)
        fence.install(f)
        return f

    yield put
    fence.install(None)
    for f in made:
        f.release()


def _tmp_step(root: Path, name: str) -> Path:
    tmp = root / f".{name}.tmp-x"
    tmp.mkdir(parents=True)
    (tmp / "w.bin").write_bytes(os.urandom(64))
    return tmp


def test_the_newer_term_wins_and_the_older_stops_before_its_commit(tmp_path, installed):
    d, root = tmp_path / "l1/run/key/.fence", tmp_path / "l0/run/key"
    old = _take(d, "aaaa1111", [root])
    new = _take(d, "bbbb2222", [root])
    assert (old.term, new.term) == (1, 2) and fence.current_term(d) == 2
    new.check("committing")  # the current term may
    with pytest.raises(fence.FencedOut, match=r"\[fence\] attempt aaaa1111 \(term 1\) is superseded by term 2: "
                                              r"stopping before committing step-000020") as e:
        installed(old)
        ckpt_local.commit_local(_tmp_step(root, "step-000020"), root / "step-000020", meta={"term": old.term})
    assert e.value.exit_code == 75  # a retry, not a user error
    assert not (root / "step-000020").exists() and not (root / ".step-000020.tmp-x" / COMMIT).exists()
    with pytest.raises(fence.FencedOut):  # sticky: it stays out
        old.check("anything")


def test_terms_taken_at_once_are_distinct(tmp_path):
    d, got, errors = tmp_path / ".fence", [], []

    def one(i: int) -> None:
        try:
            got.append(_take(d, f"att{i:05d}").term)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and sorted(got) == list(range(1, 13))


def test_a_commit_of_a_newer_term_is_never_deleted_by_an_older_one(tmp_path, installed):
    d, root = tmp_path / "l1/run/key/.fence", tmp_path / "l1/run/key"
    old = _take(d, "aaaa1111", [root])
    new = installed(_take(d, "bbbb2222", [root]))
    older = ckpt_local.commit_local(_tmp_step(root, "step-000010"), root / "step-000010", meta={"term": new.term})
    step = ckpt_local.commit_local(_tmp_step(root, "step-000030"), root / "step-000030", meta={"term": new.term})
    installed(old)
    for deed in (lambda: ckpt_local.remove_local(step),
                 lambda: ckpt_local.commit_local(_tmp_step(root, "step-000030b"), step, meta={"term": 1}),  # replace
                 lambda: ckpt_tiers.prune(load_spec(None, [f"checkpoint.l1={tmp_path}/l1", "checkpoint.keep_l1=1"],
                                                    env={}), "run/key", tiers=("L1",))):  # retention: step 10
        with pytest.raises(fence.FencedOut):
            deed()
        assert [read_local_manifest(s)["term"] for s in (older, step)] == [2, 2]  # untouched
    # the recorded term alone refuses, once the fence knows it (a check that raced past the new term's take)
    raced = fence.Fence(d, "aaaa1111", 1, 60.0, (str(root),))
    raced._why_fenced = lambda: None
    with pytest.raises(fence.FencedOut, match="committed by term 2"):
        raced.guard("removing step-000030", 2)
    new.guard("removing step-000030", 7)  # a term above any taken: from a fence directory that was lost; not refused


def test_a_fence_guards_only_its_own_run(tmp_path, installed):
    d = tmp_path / "l1/run/key/.fence"
    old = _take(d, "aaaa1111", [tmp_path / "l0/run/key"])
    _take(d, "bbbb2222")
    installed(old)
    other = tmp_path / "l0/run/other"
    ckpt_local.commit_local(_tmp_step(other, "step-000010"), other / "step-000010")  # not its run: not fenced
    assert (other / "step-000010" / COMMIT).is_file()
    assert fence.term() == 1 and fence.tmp_tag().startswith("aaaa1111-")


def test_cleanup_keeps_a_live_attempts_temp_files_and_removes_an_expired_ones(tmp_path):
    root, now = tmp_path / "l0", time.time()
    leases = {"live0001": now + 60, "dead0002": now - 1}
    paths = {name: root / name for name in (".step-000020.tmp-live0001", ".step-000020.tmp-dead0002",
                                            ".view-live0001-node0-step-000010", ".view-dead0002-node0-step-000010",
                                            ".step-000020.tmp-0123abcd")}
    for p in paths.values():
        p.mkdir(parents=True)
    staging = tmp_path / "l1" / ".step-000010.parts"  # a part a live attempt staged (its manifest names it)
    (staging / "part-0").mkdir(parents=True)
    (staging / "part-0" / "MANIFEST.json").write_text(json.dumps({"attempt": "live0001"}))
    keep = {n for n, p in paths.items() if not fence.removable(p, leases, lease_s=60)}
    assert keep == {".step-000020.tmp-live0001", ".view-live0001-node0-step-000010",
                    ".step-000020.tmp-0123abcd"}  # no lease names the last one, and it is young
    assert not fence.removable(staging, leases, 60)
    old = now - 120
    os.utime(paths[".step-000020.tmp-0123abcd"], (old, old))
    assert fence.removable(paths[".step-000020.tmp-0123abcd"], leases, 60)  # absent and old


def test_drop_stale_staging_keeps_a_live_attempts_staging(tmp_path):
    spec = load_spec(None, [f"checkpoint.l1={tmp_path}/l1"], env={})
    l1 = tmp_path / "l1/run/key"
    d = fence.fence_dir(spec, "run/key")
    live = _take(d, "live0001")
    ckpt_local.commit_local(_tmp_step(l1, "step-000030"), l1 / "step-000030")
    for who in ("live0001", "dead0002"):
        (l1 / f".step-000020.tmp-{who}-abc").mkdir()
    fence.write_lease(d, "dead0002", 0, time.time() - 1)
    ckpt_tiers.drop_stale_staging(spec, "run/key")
    assert sorted(p.name for p in l1.glob(".step-*")) == [".step-000020.tmp-live0001-abc"]
    live.release()


@pytest.mark.parametrize("l2_busy", [False, True])
def test_a_starting_attempt_takes_the_next_term_and_clears_only_gone_attempts_temp_dirs(home, monkeypatch, l2_busy):
    """The checkpointer's start (a world of one): it takes term 3 after two earlier attempts, removes the dead one's
    temp dirs on L0 and keeps the live one's; at close it gives its lease back and leaves no fence installed, unless
    its L2 thread is still running: then its fence stays installed, released (a late write of that thread is
    refused), and the lease is left to expire. The ranks' failures are told apart by their exception's type."""
    import torch.distributed as dist

    from conftest import free_port
    from pipelines.train.ckpt import protocol as ck
    from pipelines.train.ckpt.checkpointer import Checkpointer
    from pipelines.train.ckpt.promoter import Promoter

    spec = load_spec(None, ["checkpoint.promote_during_run=false"], env={})
    d, l0 = fence.fence_dir(spec, "run/key"), Path(ckpt_tiers.tier_locations(spec, "run/key")["L0"])
    _take(d, "live0001")
    _take(d, "dead0002")
    fence.write_lease(d, "dead0002", 2, time.time() - 1)
    for name in (".step-000010.tmp-live0001", ".view-live0001-node0-step-000010", ".step-000010.tmp-dead0002",
                 ".view-dead0002-node0-step-000010"):
        (l0 / name).mkdir(parents=True)
    if l2_busy:  # finish_l2 gave up on a hung L2 thread: it may still write
        monkeypatch.setattr(Promoter, "finish_l2", lambda self, final, timeout_s: False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ckpt = Checkpointer(spec, "run/key", 0, 1, lambda m: None, files={})
        assert ckpt.fence_info() == {"attempt": ckpt.attempt, "term": 3} and fence.active() is ckpt.fence
        with pytest.raises(fence.FencedOut, match=r"^\[fence\] x$"):
            ckpt._raise_if_any_rank_failed(("FencedOut", "[fence] x"), "closing")
        with pytest.raises(ck.CheckpointError, match=r"^closing on rank 0: OSError: FencedOut: no$"):
            ckpt._raise_if_any_rank_failed(("OSError", "FencedOut: no"), "closing")
        ckpt.close(None)
    finally:
        dist.destroy_process_group()
    try:
        assert sorted(p.name for p in l0.glob(".*") if not p.name.startswith(".probe")) == [
            ".step-000010.tmp-live0001", ".view-live0001-node0-step-000010"]
        assert ckpt.fence.fenced == f"[fence] attempt {ckpt.attempt} (term 3) is released: this attempt has ended"
        expiry = fence.read_leases(d)[ckpt.attempt]
        if l2_busy:
            assert fence.active() is ckpt.fence and expiry > time.time()
            with pytest.raises(fence.FencedOut, match=r"is released: this attempt has ended: stopping before "
                                                      "committing step-000020"):
                ckpt_local.commit_local(_tmp_step(l0, "step-000020"), l0 / "step-000020")
        else:
            assert fence.active() is None and expiry == 0.0
    finally:
        fence.install(None)


def test_a_renewing_node_whose_clock_is_off_by_more_than_the_lease_fences_no_rank_until_renewals_stop(tmp_path):
    """Clock skew on lease expiry (issue 52): the renewing rank's wall clock runs 10 lease_s behind, so every
    expiry it writes is in the past by the other ranks' clocks; they judge the lease by how long they see it
    unchanged (a watcher thread reads it), so renewals keep them going, and once renewals stop, the first check
    after lease_s fences them, however rarely they check."""
    from pipelines.storage import faults

    d = tmp_path / ".fence"
    faults.load(json.dumps([{"at": "clock", "do": "skew", "seconds": -20.0}]))  # this process's wall clock
    try:
        renewer = _take(d, "aaaa1111", lease_s=2.0)
        renewer.start_renewing()
        other = fence.Fence(d, "aaaa1111", renewer.term, 2.0, (), log=lambda m: None)  # a rank on another node
        other.start_watching()
        for _ in range(6):
            assert fence.read_leases(d)["aaaa1111"] < time.time() - 10  # expired by the true clock, and renewed
            other.check("committing")
            time.sleep(0.5)
        renewer.release(give_back=False)  # its renewals stop
        fence.write_lease(d, "aaaa1111", renewer.term, faults.now() + 2.0)  # the last one, after the last check
        time.sleep(4.5)  # no check in between: only a watcher saw the last renewal
        with pytest.raises(fence.FencedOut, match=r"its lease on L1 expired \(not renewed for \d+ s by this node's"):
            other.check("committing")
        other.release()
    finally:
        faults.load("")


def test_a_clock_skew_rule_is_only_a_skew_of_the_clock():
    from pipelines.storage import faults

    for rule in ({"at": "clock", "do": "slow"}, {"at": "write", "do": "skew", "seconds": 5}):
        with pytest.raises(ValueError, match="a clock is skewed"):
            faults.load(json.dumps([rule]))
    faults.load(json.dumps([{"at": "clock", "do": "skew", "seconds": 5, "node": 1}]))  # another node's clock
    try:
        assert abs(faults.now() - time.time()) < 1
    finally:
        faults.load("")


def test_an_attempt_whose_lease_lapsed_fences_itself(tmp_path, monkeypatch):
    d = tmp_path / ".fence"
    quiet = _take(d, "aaaa1111", lease_s=0.3)  # nobody renews it
    time.sleep(0.4)
    with pytest.raises(fence.FencedOut, match="its lease on L1 expired"):
        quiet.check("committing")
    cut_off = _take(d, "bbbb2222", lease_s=0.3)
    monkeypatch.setattr(fence, "write_lease", lambda *a: (_ for _ in ()).throw(OSError("L1 unreachable")))
    cut_off.start_renewing()
    time.sleep(0.5)
    with pytest.raises(fence.FencedOut, match="not renewed for"):
        cut_off.check("committing")
    cut_off.release()


def test_a_renewed_lease_stays_live(tmp_path):
    d = tmp_path / ".fence"
    f = _take(d, "aaaa1111", lease_s=3.0)  # (a renewal's fsync may stall a second on a busy CI disk)
    f.start_renewing()
    time.sleep(4.0)
    f.check("committing")  # renewed every second: live past its first expiry
    f.release()
    assert fence.read_leases(d)["aaaa1111"] == 0.0  # given back: its temp files may go


def test_a_superseded_launch_cannot_come_back_through_a_restart(tmp_path):
    d = tmp_path / ".fence"
    _take(d, "aaaa1111", launch="torchrun-A")
    _take(d, "bbbb2222", launch="torchrun-B")
    with pytest.raises(fence.FencedOut, match="launch torchrun-A is superseded by term 2"):
        _take(d, "cccc3333", launch="torchrun-A")  # torchrun restarting the fenced-out ranks
    assert _take(d, "dddd4444", launch="torchrun-B").term == 3  # the current launch's own restart may
    assert fence.current_term(d) == 3


def test_the_launcher_does_not_commit_a_superseded_attempts_result(tmp_path):
    spec = load_spec(None, [f"checkpoint.l1={tmp_path}/l1"], env={})
    d = fence.fence_dir(spec, "run/key")
    _take(d, "aaaa1111")
    fence.confirm(spec, "run/key", {"attempt": "aaaa1111", "term": 1})
    _take(d, "bbbb2222")
    with pytest.raises(fence.FencedOut, match=r"attempt aaaa1111 \(term 1\) is superseded by term 2"):
        fence.confirm(spec, "run/key", {"attempt": "aaaa1111", "term": 1})
    fence.confirm(spec, "run/key", None)  # an older result names none: nothing to compare


def test_an_older_term_deletes_no_commit_on_l2(home, s3_server, installed):
    from pipelines.train.ckpt import parts as ckpt_parts
    from pipelines.train.ckpt import s3_markers
    from pipelines.train.ckpt import s3_tier as ckpt_s3

    spec = load_spec(None, [f"services.s3_endpoint_url={s3_server}", "services.s3_bucket=fence"], env={})
    rel = "run/key/step-000020"
    locs = ckpt_tiers.tier_locations(spec, rel)
    d = fence.fence_dir(spec, "run/key")
    roots = tuple(ckpt_tiers.tier_locations(spec, "run/key").values())
    old = fence.Fence.take(d, "aaaa1111", 60.0, roots, log=lambda m: None)
    new = installed(fence.Fence.take(d, "bbbb2222", 60.0, roots, log=lambda m: None))
    l1 = ckpt_local.commit_local(_tmp_step(Path(locs["L1"]).parent, "step-000020"), Path(locs["L1"]),
                                 meta={"term": new.term, "attempt": "bbbb2222"})
    ckpt_parts.upload_step(spec, l1, locs["L2"])
    commit = ckpt_s3.commit_at(spec, locs["L2"])
    installed(old)
    for deed in (lambda: s3_markers.remove_step(spec, locs["L2"]),
                 lambda: ckpt_parts.upload_step(spec, l1, locs["L2"])):
        with pytest.raises(fence.FencedOut, match="superseded by term 2"):
            deed()
        assert ckpt_s3.commit_at(spec, locs["L2"]) == commit and ckpt_s3.read_s3_manifest(spec, locs["L2"])["term"] == 2


def test_removing_a_step_on_l2_leaves_what_another_writer_put_after_it_was_listed(home, any_key_s3, monkeypatch):
    """The removal lists the step's objects first and deletes each only while it is the copy listed: a writer that
    paused between its guard and its deletes (the guard stands in for the pause here) leaves the COMMIT and the file
    a newer term put meanwhile, and stops (FencedOut). On moto, which honours If-Match on DeleteObject as AWS does
    (the embedded endpoint, rclone, does not: there the fence checks before each write stay the protection)."""
    import boto3

    from pipelines.train.ckpt import s3_markers

    spec = load_spec(None, [f"services.s3_endpoint_url={any_key_s3}", "services.s3_bucket=fence-rm"], env={})
    s3 = boto3.client("s3", endpoint_url=any_key_s3, region_name="us-east-1")
    s3.create_bucket(Bucket="fence-rm")
    uri, prefix = "s3://fence-rm/ck/run/key/step-000005", "ck/run/key/step-000005"
    for name, body in (("COMMIT", b"old"), ("a.distcp", b"old"), ("MANIFEST.json", b"{}")):
        s3.put_object(Bucket="fence-rm", Key=f"{prefix}/{name}", Body=body)

    def newer_term_writes(what, where, manifest):  # after the listing: a newer term's copy lands
        for name in ("COMMIT", "a.distcp"):
            s3.put_object(Bucket="fence-rm", Key=f"{prefix}/{name}", Body=b"new")
    monkeypatch.setattr(fence, "guard", newer_term_writes)
    with pytest.raises(fence.FencedOut, match="changed since this attempt read it"):
        s3_markers.remove_step(spec, uri)
    left = {k: s3.get_object(Bucket="fence-rm", Key=f"{prefix}/{k}")["Body"].read() for k in ("COMMIT", "a.distcp")}
    assert left == {"COMMIT": b"new", "a.distcp": b"new"}
    monkeypatch.undo()
    s3_markers.remove_step(spec, uri)  # unfenced, nothing changed since the listing: all of it goes
    assert "Contents" not in s3.list_objects_v2(Bucket="fence-rm", Prefix=f"{prefix}/")


def test_a_lost_fence_directory_fences_the_attempt_and_is_not_recreated(tmp_path):
    """The fence directory lost (L1 restored from a backup, a wrong mount): an attempt whose term file is gone stops
    (another attempt would take term 1 in a new directory, unfenced), and renewing its lease does not make the
    directory again."""
    import shutil

    d = tmp_path / "l1/run/key/.fence"
    f = _take(d, "aaaa1111")
    f.check("committing")
    shutil.rmtree(d)
    with pytest.raises(FileNotFoundError):
        fence.write_lease(d, "aaaa1111", 1, time.time() + 60)
    assert not d.exists()
    with pytest.raises(fence.FencedOut, match=r"attempt aaaa1111 \(term 1\): its term file is gone"):
        f.check("committing")
    other = _take(d, "bbbb2222")  # a new directory: term 1 again, named by its own attempt
    (d / "term-000000001").write_text(json.dumps({"attempt": "cccc3333"}))
    with pytest.raises(fence.FencedOut, match="its term file names attempt cccc3333"):
        other.check("committing")


def test_a_lease_read_error_fences_only_once_it_lasts_longer_than_the_lease(tmp_path, monkeypatch):
    import errno

    d = tmp_path / ".fence"
    f = _take(d, "aaaa1111", lease_s=60.0)
    real, fails = fence._expiry, {"n": 0}

    def flaky(p):
        if fails["n"] > 0:
            fails["n"] -= 1
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(p)

    monkeypatch.setattr(fence, "_expiry", flaky)
    fails["n"] = fence.READ_TRIES - 1  # a transient error: read again, the lease is live
    assert fence.read_lease(d, "aaaa1111") > time.time()
    fails["n"] = 10 ** 6  # lasts: raised, not read as expired
    with pytest.raises(OSError):
        fence.read_lease(d, "aaaa1111")
    f.check("committing")  # not fenced while the last good read is younger than lease_s
    assert f.fenced is None
    f.read_ok -= 61  # no good read for longer than lease_s
    with pytest.raises(fence.FencedOut, match=r"its term and lease on L1 could not be read for 6\d s"):
        f.check("committing")


def test_term_files_that_are_not_json_objects_read_as_empty(tmp_path):
    d = tmp_path / ".fence"
    d.mkdir()
    (d / "term-000000001").write_text("null")
    (d / "term-000000002").write_text("[1, 2]")
    (d / "term-xyz").write_text("{}")
    assert fence.read_terms(d) == {1: {}, 2: {}} and fence.current_term(d) == 2
    assert _take(d, "aaaa1111", launch="torchrun-A").term == 3  # no AttributeError on rank 0


def test_a_term_file_l1_fails_to_return_stops_the_take_instead_of_reading_as_nobodys(tmp_path):
    """Launch A's term 1 cannot be read (here a directory where its file was: read_text fails as an EIO would),
    launch B holds term 2. A's restart read term 1 as nobody's, so it was not superseded and took term 3 over B's
    live attempt; now the read error stops the take (the checkpointer's exit 75) and B keeps the newest term."""
    d = tmp_path / ".fence"
    d.mkdir()
    (d / "term-000000001").mkdir()
    (d / "term-000000002").write_text(json.dumps({"attempt": "bbbb2222", "launch": "torchrun-B"}))
    with pytest.raises(OSError):
        _take(d, "aaaa1111", launch="torchrun-A")
    assert fence.current_term(d) == 2


def test_the_launcher_fails_closed_when_the_fence_directory_is_missing_or_empty(tmp_path):
    import shutil

    spec = load_spec(None, [f"checkpoint.l1={tmp_path}/l1"], env={})
    d = fence.fence_dir(spec, "run/key")
    info = {"attempt": "aaaa1111", "term": 1}
    with pytest.raises(fence.FencedOut, match="the fence directory .* is missing or holds no term"):
        fence.confirm(spec, "run/key", info)
    d.mkdir(parents=True)
    with pytest.raises(fence.FencedOut, match="is missing or holds no term"):
        fence.confirm(spec, "run/key", info)
    _take(d, "bbbb2222")
    with pytest.raises(fence.FencedOut, match="its term file is of attempt bbbb2222"):
        fence.confirm(spec, "run/key", info)
    shutil.rmtree(d)
    _take(d, "aaaa1111")
    fence.confirm(spec, "run/key", info)


def test_an_upload_of_many_files_stops_at_the_next_file_once_superseded(tmp_path, monkeypatch, installed):
    """The fence is checked before each file of a part, not only before its COMMIT: a superseded attempt sends no
    more files (fewer writes of an older term that could land after the newer term's)."""
    from pipelines.train.ckpt import s3_tier as ckpt_s3

    spec = load_spec(None, [f"checkpoint.l1={tmp_path}/l1"], env={})
    d = tmp_path / "l1/run/key/.fence"
    installed(_take(d, "aaaa1111", ["s3://bucket/ckpt/run/key"]))
    sent = []

    def upload(s3, bucket, key, path, sha, when):
        sent.append(key)
        _take(d, "bbbb2222")  # a newer attempt takes over while this file is sent

    monkeypatch.setattr(ckpt_s3, "object_matches", lambda s3, bucket, key, *a, **k: key in sent)  # once it is sent
    monkeypatch.setattr(ckpt_s3, "put_file", upload)
    files = {f"f{i}.bin": {"bytes": 1, "sha256": "0" * 64} for i in range(3)}
    with pytest.raises(fence.FencedOut, match=r"superseded by term 2: stopping before uploading f1.bin"):
        ckpt_s3.upload_files(spec, None, "bucket", "ckpt/run/key/step-000010", tmp_path, files, {})
    assert sent == ["ckpt/run/key/step-000010/f0.bin"]


def test_an_s3_write_waits_for_an_abandoned_write_at_the_same_place(tmp_path, monkeypatch, installed):
    """A write or delete given up on after its bound still runs (only its caller is freed) and may land later: under
    a fence, the next S3 write at that object or prefix waits for it (bounded), then is refused; elsewhere it goes."""
    from pipelines.storage import s3

    installed(_take(tmp_path / ".fence", "aaaa1111", ["s3://b/ckpt/run/key"]))
    monkeypatch.setattr(fence, "SETTLE_S3_S", 0.3)
    release = threading.Event()
    with pytest.raises(s3.S3Timeout):
        s3.call_bounded(lambda: release.wait(30), 0.05, "PutObject s3://b/ckpt/run/key/step-000010/COMMIT",
                        "s3://b/ckpt/run/key/step-000010/COMMIT")
    commit = "PutObject s3://b/ckpt/run/key/step-000010/COMMIT"
    assert s3.abandoned_writes("s3://b/ckpt/run/key/step-000010") == [commit]
    with pytest.raises(s3.S3Timeout):  # a read given up on is not a write: never listed
        s3.call_bounded(lambda: release.wait(30), 0.05, "GetObject s3://b/ckpt/run/key/step-000010/x")
    with pytest.raises(CheckpointError, match=r"PutObject s3://b/ckpt/run/key/step-000010/COMMIT was given up on "
                                              r"and still runs: stopping before committing"):
        fence.check("committing", "s3://b/ckpt/run/key/step-000010")
    fence.check("committing", "s3://b/ckpt/run/key/step-000020")  # another step: not held up
    fence.check("committing", "s3://b/ckpt/run/key/step-0000100")
    release.set()
    wait_for(lambda: not s3.abandoned_writes("s3://b"), 5, "the abandoned call to end")
    fence.check("committing", "s3://b/ckpt/run/key/step-000010")


def test_a_run_id_every_job_shares_names_no_launch(monkeypatch):
    """torchrun's default rendezvous id (``none``) is every multi-node job's: as a launch it would make a job
    re-created under its name one launch with its zombie, or be refused for good after another launch's term."""
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for shared in fence.SHARED_RUN_IDS:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", shared)
        assert fence.launch_id() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "llmp-6f1c2a")
    assert fence.launch_id() == "llmp-6f1c2a"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # one node: its agent's host and pid tell two jobs apart
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert fence.launch_id().startswith("none@")


# ---------------------------------------------------------------- a real zombie: two launches of one run
def _launch(tok, home: Path, out: str, **env) -> subprocess.Popen:
    """The train stage of one run (the same checkpoints: l0, l1, run name and stage key ``train``) with its own
    output dir, so its own stage lock: as a launch whose lock was lost with its node."""
    from test_resilience import TINY, _env

    sets = TINY + ["train.steps=30", "train.ckpt_every=10", "launcher.nproc_per_node=2", "launcher.max_restarts=1",
                   f"run.root={home}", f"checkpoint.l0={home}/l0", f"checkpoint.l1={home}/l1"]
    cmd = [sys.executable, "-m", "pipelines.train.launch", "--tokenize-manifest", tok.path, "--output",
           str(home / out / "train")] + [a for kv in sets for a in ("--set", kv)]
    return subprocess.Popen(cmd, env=_env(**env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _signal_tree(p: subprocess.Popen, sig: int) -> list:
    import psutil

    procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return procs


def test_a_zombie_attempt_stops_before_committing_and_the_retry_keeps_its_steps(home):
    """Launch A trains; once it committed step 10 it is frozen (SIGSTOP: a partitioned node, thought dead) and
    launch B, the retry, runs to the end. A wakes up: it stops at its next save, exit 75, no stage manifest; every
    step after 10 on L0 and L1 is B's, with B's term."""
    from test_resilience import _act_on, _commit_of, _held_after, _tok

    tok = _tok(home)
    # A is held 30 s after step 12, so it is frozen before its save of step 20 however loaded the machine
    zombie = _launch(tok, home, "a", LLMP_FAULT_STEP_DELAY_S="0.2", **_held_after(12, home / "state", seconds=30))
    retry = None
    try:
        wait_for(_commit_of(home, 10), 240, "launch A's COMMIT of step 10 on L0")
        frozen = _signal_tree(zombie, signal.SIGSTOP)  # the ranks too: torchrun starts them in sessions of their own
        _act_on(home / "state")  # (a hold not begun never begins)
        retry = _launch(tok, home, "b")
        said, _ = retry.communicate(timeout=240)
        for proc in frozen:
            proc.send_signal(signal.SIGCONT)
        out, _ = zombie.communicate(timeout=120)
    finally:
        for p in (zombie, retry):
            if p is not None and p.poll() is None:
                for proc in _signal_tree(p, signal.SIGCONT):
                    proc.kill()
    assert retry.returncode == 0, said[-3000:]
    assert "still holds a lease" in said and "takes over with term 2" in said, said[-3000:]
    assert zombie.returncode == 75, out[-3000:]
    assert re.search(r"train: error: \[fence\] attempt \w+ \(term 1\) is superseded by term 2: stopping before", out), \
        out[-3000:]
    assert "this restart stops before touching the checkpoints" in out, out[-3000:]  # torchrun's restart of it
    assert not (home / "a/train/manifest.json").exists()  # the zombie's result is never the stage's
    mine = json.loads((home / "b/train/result.json").read_text())["fence"]
    assert mine["term"] == 2 and fence.current_term(home / "l1/llm-pipeline/train/.fence") == 2, mine
    # each attempt's cutoff, recorded before its first save: A resumed from nothing, B from A's step 10; a step
    # that A could still land above 10 counts nowhere
    rec = json.loads((home / "l1/llm-pipeline/train.lineage.json").read_text())
    assert rec["cutoffs"] == [[1, None], [2, 10]], rec
    for tier in ("l0", "l1"):
        steps = {p.parent.name: read_local_manifest(p.parent)
                 for p in (home / tier).glob("*/train/step-*/COMMIT")}
        later = {n: (m["attempt"], m["term"]) for n, m in steps.items() if m["step"] > 10}
        assert "step-000030" in later and set(later.values()) == {(mine["attempt"], 2)}, (tier, later)


# ---------------------------------------------------------------- issue 52: fences enforced by L2 itself


def _part(root: Path, step: int, attempt: str, pad: int = 0) -> Path:
    from pipelines.train.ckpt import protocol as ck

    tmp = root / f".tmp-{step}"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(f"step {step} of attempt {attempt}".encode() + bytes(pad))
    return ckpt_local.commit_local(tmp, root / ck.step_name(step), {"step": step, "part": 0, "parts": 1,
                                                                    "attempt": attempt})


def _b_commits_at_the_first_act(monkeypatch, spec, part: Path, uri: str, supersede: Path | None = None) -> list:
    """The fault point ``act`` (between a writer's check and its act) patched: the first time it is reached, attempt
    B uploads ``part`` and commits it, while the writer (attempt A) waits there; with ``supersede`` (A's fence
    directory), B's commit is a newer term's. Returns the list that records it."""
    from pipelines.storage import faults
    from pipelines.train.ckpt import parts as ckpt_parts
    from pipelines.train.ckpt import s3_tier as ckpt_s3

    paused = []

    def point(phase, **where):
        if phase == faults.ACT and not paused:
            paused.append(phase)
            held = fence.active()
            fence.install(None)  # B's writes are B's (this process holds A's fence)
            ckpt_parts.upload_part(spec, part, uri)
            assert ckpt_parts.merge_parts_s3(spec, uri, 1, "b")
            assert ckpt_s3.read_s3_manifest(spec, uri)["attempt"] == "b"
            if supersede is not None:
                _take(supersede, "bbbb2222")
            fence.install(held)

    monkeypatch.setattr(faults, "point", point)
    return paused


@pytest.mark.parametrize("server", ["any_key_s3", "s3_server"], ids=["moto-honours-conditions", "rclone-ignores-them"])
def test_a_writer_paused_between_its_check_and_its_l2_commit_cannot_land_over_a_newer_one(home, request, server,
                                                                                         monkeypatch, capsys):
    """Attempt A checked its fence and is about to write step 10's MANIFEST and COMMIT on L2 when it pauses (the
    fault point ``act``); meanwhile attempt B puts its own part of step 10 and commits it. When A resumes, an
    endpoint that honours conditional writes (AWS S3, moto) answers 412: A stops with FencedOut (exit 75) and B's
    commit stays. The embedded endpoint (rclone) ignores the conditions: that is said once, in one line."""
    from pipelines.train.ckpt import parts as ckpt_parts
    from pipelines.train.ckpt import s3_tier as ckpt_s3
    from pipelines.train.ckpt import s3_markers as ckpt_s3_cond

    enforced = server == "any_key_s3"
    bucket = f"ck-pause-{'moto' if enforced else 'rclone'}"
    spec = load_spec(None, [f"services.s3_endpoint_url={request.getfixturevalue(server)}",
                            f"services.s3_bucket={bucket}"], env={})
    uri = f"s3://{bucket}/run/key/step-000010"
    old, new = _part(home / "a", 10, "a"), _part(home / "b", 10, "b")
    ckpt_parts.upload_part(spec, old, uri)
    paused = _b_commits_at_the_first_act(monkeypatch, spec, new, uri)
    if enforced:
        with pytest.raises(fence.FencedOut) as e:
            ckpt_parts.merge_parts_s3(spec, uri, 1, "a")
        assert e.value.exit_code == 75 and "changed since this attempt read it" in str(e.value)
        assert ckpt_s3.read_s3_manifest(spec, uri)["attempt"] == "b"  # the newer commit stays, whole
        ckpt_s3.verify_s3(spec, uri)
    else:
        ckpt_parts.merge_parts_s3(spec, uri, 1, "a")  # lands: only the client's checks protect here
        assert "ignores conditional writes" in capsys.readouterr().out
    from pipelines.storage.s3 import client

    assert paused and ckpt_s3_cond.supported(client(spec), bucket) is enforced


@pytest.mark.parametrize("pad", [0, 6 << 20], ids=["one-put", "multipart"])
def test_a_writer_paused_before_a_data_object_cannot_spoil_a_newer_terms_files(home, any_key_s3, monkeypatch, pad,
                                                                               installed):
    """Attempt A decided to upload its part of step 10 (nothing there yet) and pauses right before its first data
    object (the fault point ``act``); meanwhile attempt B uploads and commits its own. A's put (or its multipart
    upload's completion) expects the object still absent: S3 answers 412, and A, superseded, stops with FencedOut;
    B's files stay whole (before: A's bytes replaced B's, and B's committed step no longer verified)."""
    from pipelines.train.ckpt import parts as ckpt_parts
    from pipelines.train.ckpt import s3_tier as ckpt_s3

    bucket = f"ck-pause-data-{pad}"
    spec = load_spec(None, [f"services.s3_endpoint_url={any_key_s3}", f"services.s3_bucket={bucket}",
                            "checkpoint.multipart_threshold_mb=5", "checkpoint.multipart_chunk_mb=5"], env={})
    uri = f"s3://{bucket}/run/key/step-000010"
    old, new = _part(home / "a", 10, "a", pad), _part(home / "b", 10, "b", pad)
    d = home / "l1/run/key/.fence"
    installed(_take(d, "aaaa1111", [f"s3://{bucket}/run/key"]))  # A: term 1
    paused = _b_commits_at_the_first_act(monkeypatch, spec, new, uri, supersede=d)  # B: term 2
    with pytest.raises(fence.FencedOut, match=r"superseded by term 2: stopping before uploading __0_0.distcp: s3://"):
        ckpt_parts.upload_part(spec, old, uri)
    assert paused and ckpt_s3.read_s3_manifest(spec, uri)["attempt"] == "b"
    ckpt_s3.verify_s3(spec, uri)  # B's files, whole


def test_an_object_of_an_older_writer_that_appeared_meanwhile_is_retried_and_then_replaced_whole(home, any_key_s3,
                                                                                                    monkeypatch):
    """Without a newer term (no fence says A is superseded), another writer's object that appeared while A waited
    makes A's upload retryable (L2Unavailable, exit 75 at worst), not FencedOut; A's next upload takes the step's
    COMMIT away first (a committed step is never left describing other bytes), then replaces the object under its
    condition."""
    from pipelines.train.ckpt import parts as ckpt_parts
    from pipelines.train.ckpt import s3_tier as ckpt_s3

    spec = load_spec(None, [f"services.s3_endpoint_url={any_key_s3}", "services.s3_bucket=ck-older-writer"], env={})
    uri = "s3://ck-older-writer/run/key/step-000010"
    old, new = _part(home / "a", 10, "a"), _part(home / "b", 10, "b")
    _b_commits_at_the_first_act(monkeypatch, spec, new, uri)
    with pytest.raises(L2Unavailable, match="another writer's object is there"):
        ckpt_parts.upload_part(spec, old, uri)
    assert ckpt_s3.read_s3_manifest(spec, uri)["attempt"] == "b"
    ckpt_s3.verify_s3(spec, uri)  # B's step, whole
    assert ckpt_parts.upload_part(spec, old, uri) == "uploaded"  # the retry
    assert ckpt_s3.read_s3_manifest(spec, uri) is None  # B's COMMIT taken away before its files were replaced
    assert ckpt_parts.merge_parts_s3(spec, uri, 1, "a")
    ckpt_s3.verify_s3(spec, uri)


def test_own_conditional_writes_retried_after_a_lost_answer_are_not_a_newer_writer(home, any_key_s3):
    """botocore retries a put whose answer was lost; the object is then already ours and the retry's condition
    fails (412): that is not another writer."""
    from pipelines.storage.s3 import client
    from pipelines.train.ckpt import s3_markers as ckpt_s3_cond, s3_tier

    spec = load_spec(None, [f"services.s3_endpoint_url={any_key_s3}", "services.s3_bucket=ck-own-retry"], env={})
    s3 = client(spec)
    s3.create_bucket(Bucket="ck-own-retry")
    ckpt_s3_cond.put(s3, "ck-own-retry", "k/COMMIT", b"abc", None, True, "t")
    ckpt_s3_cond.put(s3, "ck-own-retry", "k/COMMIT", b"abc", None, True, "t")  # the retry: ours, accepted
    with pytest.raises(fence.FencedOut):
        ckpt_s3_cond.put(s3, "ck-own-retry", "k/COMMIT", b"xyz", None, True, "t")  # someone else's: refused
    tag = s3_tier.object_etag(s3, "ck-own-retry", "k/COMMIT")
    ckpt_s3_cond.delete(s3, "ck-own-retry", "k/COMMIT", tag, True, "t")
    ckpt_s3_cond.delete(s3, "ck-own-retry", "k/COMMIT", tag, True, "t")  # gone already: our own retried delete


@pytest.mark.parametrize("deed", ["remove", "replace", "install"])
def test_a_writer_paused_between_its_check_and_its_act_on_l1_cannot_touch_a_newer_terms_copy(tmp_path, installed,
                                                                                            monkeypatch, deed):
    """Attempt A (term 1) passed its checks and pauses right before its act (the fault point ``act``); meanwhile
    term 2 commits step 30 at the same place. A then removes it (retention), replaces it, or puts its own copy
    where there was none: each act is a rename that is checked where the copy lands (moved aside, its term read there)
    or cannot land over a directory: A stops with FencedOut and term 2's copy stays, whole."""
    from pipelines.storage import faults

    d, root = tmp_path / "l1/run/key/.fence", tmp_path / "l1/run/key"
    _take(d, "aaaa1111", [root])
    new = _take(d, "bbbb2222", [root])
    step = root / "step-000030"
    if deed != "install":  # an older copy of A's there, which A means to remove or replace
        ckpt_local.commit_local(_tmp_step(root, "step-000030"), step, meta={"term": 1})
    stale = fence.Fence(d, "aaaa1111", 1, 60.0, (str(root),))
    stale._why_fenced = lambda: None  # its checks raced past term 2's take: only the storage can stop it now
    installed(stale)
    acted = []

    def point(phase, **where):  # term 2 commits step 30 while A waits between its check and its act
        if phase == faults.ACT and not acted:
            acted.append(phase)
            fence.install(None)
            if step.exists():
                ckpt_local.remove_local(step)
            ckpt_local.commit_local(_tmp_step(root, "step-000030n"), step, meta={"term": new.term})
            fence.install(stale)

    monkeypatch.setattr(faults, "point", point)
    with pytest.raises(fence.FencedOut):
        if deed == "remove":
            ckpt_local.remove_local(step)
        else:
            ckpt_local.commit_local(_tmp_step(root, "step-000030a"), step, meta={"term": 1})
    assert acted and read_local_manifest(step)["term"] == 2
    verify_local(step)


# ---------------------------------------------------------------- a stale writer landing a step no one else wrote


def test_a_takeovers_cutoff_counts_no_step_an_older_term_lands_above_it():
    """An attempt that took over at step 10 (term 2) records its cutoff: a step term 1 commits above 10 from then
    on (a writer paused between its check and its COMMIT, with nothing at that key for S3 to compare) counts
    nowhere; term 1's steps up to 10, term 2's own, and steps saved before terms (no term) still count. A fork
    keeps the cutoffs; a record without them (an older version's) still reads; a forged one does not."""
    from pipelines.train.ckpt import history

    rec = history.resumed(None, "tok", 2, 10)
    assert rec["accept"][0] == [history.ANY, None] and rec["cutoffs"] == [[2, 10]] and history.top_term(rec) == 2
    # what a version before ANY reads in it: its own steps and those saved before any record, so a rollback resumes
    assert rec["accept"][1:] == [["tok", None], [None, None]]
    assert not history.accepts(rec, 20, "other", 1) and not history.accepts(rec, 11, None, 1)
    assert history.accepts(rec, 10, "other", 1) and history.accepts(rec, 20, "tok", 2)
    assert history.accepts(rec, 20, None, None) and history.accepts(rec, 30, "tok", 3)
    nothing = history.resumed(rec, "tok", 3, None)  # term 3 resumed from nothing: no older term's step counts
    assert not history.accepts(nothing, 0, "tok", 2) and history.accepts(nothing, 5, "tok", 3)
    forked = history.fork(rec, "new", 10)
    assert forked["cutoffs"] == [[2, 10]] and not history.accepts(forked, 20, "tok", 1)
    assert history.fresh("newer", forked)["cutoffs"] == [[2, 10]]  # a new line: the terms named stay taken
    assert history.parse(json.dumps({"token": "t", "lineage": "t", "accept": [["t", None]]}), "old")
    for bad in ([["2", 10]], [[2, "10"]], [[2]], {"2": 10}):
        with pytest.raises(ValueError, match="not a lineage record"):
            history.parse(json.dumps({**rec, "cutoffs": bad}), "forged")


def _committed(root: Path, step: int, term: int, attempt: str = "a", staged: bool = False) -> None:
    """Step ``step`` (one part) of ``term`` committed under ``root``; ``staged``: its part in L1's staging."""
    from pipelines.train.ckpt import protocol as ck

    tmp = root / f".tmp-{step}-{term}"
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(f"step {step} of term {term}".encode())
    dest = root / f".{ck.step_name(step)}.parts" / "part-0" if staged else root / ck.step_name(step)
    dest.parent.mkdir(parents=True, exist_ok=True)
    ckpt_local.commit_local(tmp, dest, {"step": step, "part": 0, "parts": 1, "attempt": attempt, "term": term})


def test_a_step_an_older_term_landed_after_a_takeover_is_restored_kept_and_pruned_by_no_one(tmp_path):
    """L1 holds step 10 of term 1, the step term 2 resumed from; step 20 of term 1 landed after (the stale
    writer), as did a part of step 40 staged on L1, and term 2 committed step 30. Restore takes 30, then 10, never
    20 nor 40; retention (keep_l1=1) counts 10 and 30 only: it removes 10, never 30, and leaves 20 alone (not this
    line's). Before the cutoff, restore offered 40 and 20 before 10 and retention counted 20."""
    from types import SimpleNamespace

    from pipelines.train.ckpt import history
    from pipelines.train.ckpt import restore as ckpt_restore

    spec = load_spec(None, [f"checkpoint.l1={tmp_path}/l1", "checkpoint.keep_l1=1"], env={})
    l1 = tmp_path / "l1/run/key"
    _committed(l1, 10, 1)
    rec = history.resumed(None, "tok", 2, 10)
    _committed(l1, 20, 1)  # landed after the takeover
    _committed(l1, 40, 1, staged=True)  # a part of step 40 staged on L1 after it (one part of one: whole)
    ckpt = SimpleNamespace(spec=spec, rel_root="run/key", rec=rec, log=lambda m: None)
    assert [c["step"] for c in ckpt_restore.candidates(ckpt, {}, None)] == [10]
    assert [c["step"] for c in ckpt_restore.candidates(ckpt, {0: {20: (0, 1, "a", None, 1)}}, None)] == [10]
    _committed(l1, 30, 2, "b")
    assert [c["step"] for c in ckpt_restore.candidates(ckpt, {}, None)] == [30, 10]
    by_tier = ckpt_tiers.list_steps(spec, "run/key", ("L1",))
    assert by_tier == {"L1": [10, 20, 30]}
    assert ckpt_tiers.accepted_steps(spec, "run/key", by_tier, rec) == {"L1": [10, 30]}
    assert ckpt_tiers.prune(spec, "run/key", tiers=("L1",), rec=rec, log=lambda m: None) == {"L1": [10]}
    assert sorted(p.name for p in l1.glob("step-*")) == ["step-000020", "step-000030"]
    assert [c["step"] for c in ckpt_restore.candidates(SimpleNamespace(**{**vars(ckpt), "rec": None}), {}, None)] \
        == [40, 30, 20]  # without the record, every step counts, as before


def test_a_term_taken_again_after_the_fence_directory_was_lost_is_above_every_cutoff(home):
    """The run's ``.fence`` on L1 is lost while its lineage record stays (a restore of L1 from a backup, an
    operator's cleanup): terms would start again at 1, below the record's cutoff of term 3, and every step this
    attempt saves would be an older term's above that cutoff, counted nowhere. The checkpointer takes its term above
    every term a cutoff names."""
    import shutil

    import torch.distributed as dist

    from conftest import free_port
    from pipelines.train.ckpt import history
    from pipelines.train.ckpt.checkpointer import Checkpointer

    spec = load_spec(None, ["checkpoint.promote_during_run=false"], env={})
    d = fence.fence_dir(spec, "run/key")
    for n in range(3):
        _take(d, f"old0000{n}")
    history.write(spec, "run/key", history.resumed(None, "tok", 3, 20))
    shutil.rmtree(d)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ckpt = Checkpointer(spec, "run/key", 0, 1, lambda m: None, files={})
        assert ckpt.fence_info()["term"] == 4
        ckpt.close(None)
        # a train.resume=never start of term 7 wrote its record (no cutoff of its own yet) and died; then .fence is
        # lost again: the next term is above the record's, or its own record would not be the one read
        fence.install(_Checked(7))
        history.write(spec, "run/key", history.fresh("tok7", history.read(spec, "run/key")))
        fence.install(None)
        shutil.rmtree(d)
        ckpt = Checkpointer(spec, "run/key", 0, 1, lambda m: None, files={})
        assert ckpt.fence_info()["term"] == 8
        ckpt.close(None)
    finally:
        dist.destroy_process_group()
        fence.install(None)


def test_an_attempt_of_a_replaced_generation_takes_no_term_and_leaves_nothing_there(home):
    """A restart of the ranks of a generation already replaced (torchrun's, a pod of the old job on a partitioned
    node: its --ckpt-root names the old generation) would take term 1 in a fence its retirement removed and write
    steps nobody retires. The checkpointer takes its term, reads the key's record, and stops (FencedOut: 75) with
    what it made removed; the current generation and a root of no recorded key take terms as before."""
    import torch.distributed as dist

    from conftest import free_port
    from pipelines.train.ckpt.checkpointer import Checkpointer

    spec = load_spec(None, ["checkpoint.promote_during_run=false"], env={})
    base = "run/key"
    old, new = f"{base}.gen-20261201T000000000000", f"{base}.gen-20261202T000000000000"
    record = Path(ckpt_tiers.tier_locations(spec, base)["L1"] + ".generations.json")
    record.parent.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ckpt = Checkpointer(spec, old, 0, 1, lambda m: None, files={})  # no record yet: a root of no recorded key
        assert ckpt.fence_info()["term"] == 1
        ckpt.close(None)
        refused = rf"^\[fence\] {re.escape(old)} is a retired generation of run/key \(current: {re.escape(new)}\)"
        # being retired while an attempt of it still runs (term 2): the refused start's term 3 stays, leaseless, above
        # it (taking it back would let that attempt commit again); only its lease goes
        zombie = _take(fence.fence_dir(spec, old), "zombie02")
        record.write_text(json.dumps({"current": new, "pending": None, "retiring": [old]}))
        with pytest.raises(fence.FencedOut, match=refused):
            Checkpointer(spec, old, 0, 1, lambda m: None, files={})
        d = fence.fence_dir(spec, old)
        assert sorted(fence.read_terms(d)) == [1, 2, 3] and set(fence.read_leases(d)) <= {"zombie02", ckpt.attempt}
        with pytest.raises(fence.FencedOut, match=r"attempt zombie02 \(term 2\) is superseded by term 3"):
            zombie.check("committing step-000030")
        # retired: its records and directories gone, the record as a key's first record reads (only `current` left)
        shutil.rmtree(ckpt_tiers.tier_locations(spec, old)["L1"])
        record.write_text(json.dumps({"current": base, "pending": None, "retiring": []}))
        with pytest.raises(fence.FencedOut, match=rf"^\[fence\] {re.escape(old)} is a retired generation of "
                                                  r"run/key \(current: run/key\)"):
            Checkpointer(spec, old, 0, 1, lambda m: None, files={})
        assert not Path(ckpt_tiers.tier_locations(spec, old)["L1"]).exists()  # nothing made again
        record.write_text("not json{")  # a record that cannot be read: no verdict, later (75), nothing made
        with pytest.raises(TierUnavailable, match=r"the record of this key's generations cannot be read: .*not JSON"):
            Checkpointer(spec, old, 0, 1, lambda m: None, files={})
        assert not Path(ckpt_tiers.tier_locations(spec, old)["L1"]).exists()
        record.write_text(json.dumps({"current": new, "pending": None, "retiring": []}))
        with pytest.raises(fence.FencedOut, match=r"run/key is a retired generation of run/key"):
            Checkpointer(spec, base, 0, 1, lambda m: None, files={})  # the key's first generation, replaced too
        ckpt = Checkpointer(spec, new, 0, 1, lambda m: None, files={})
        assert ckpt.fence_info()["term"] == 1
        ckpt.close(None)
        pending = f"{base}.gen-20261203T000000000000"  # run.force's next generation, before it commits
        record.write_text(json.dumps({"current": new, "pending": pending, "retiring": []}))
        ckpt = Checkpointer(spec, pending, 0, 1, lambda m: None, files={})
        assert ckpt.fence_info()["term"] == 1
        ckpt.close(None)
    finally:
        dist.destroy_process_group()
        fence.install(None)


def test_an_l1_that_holds_nothing_of_the_key_reads_its_generations_record_on_l2_as_the_launcher_does(home, s3_server):
    """L1 lost (a new FSx) while L2 keeps the key's record naming a newer generation current: an attempt of the key's
    replaced first generation on the new L1 reads L2's copy, as the launcher reads it to choose the generation, and
    stops; where L1 holds the key (its directory, here with an earlier attempt's term) the launcher chose from L1
    and so does the attempt: no start waits on L2 for it."""
    import torch.distributed as dist

    from conftest import free_port
    from pipelines.storage import faults
    from pipelines.train.ckpt.checkpointer import Checkpointer

    spec = load_spec(None, ["checkpoint.promote_during_run=false", f"services.s3_endpoint_url={s3_server}",
                            "services.s3_bucket=fence-generations"], env={})
    base, new = "run/key", "run/key.gen-20261202T000000000000"
    ckpt_tiers.put_l2_record(spec, base, ckpt_tiers.GENERATIONS_SUFFIX,
                             json.dumps({"current": new, "pending": None, "retiring": []}))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(fence.FencedOut, match=r"run/key is a retired generation of run/key \(current: "):
            Checkpointer(spec, base, 0, 1, lambda m: None, files={})
        assert not Path(ckpt_tiers.tier_locations(spec, base)["L1"]).exists()
        _take(fence.fence_dir(spec, base), "earlier1")  # the key's directory on this L1, as a launch finds it
        faults.load(json.dumps([{"at": "s3", "do": "s3_down", "times": 0}]))  # this process only
        try:
            ckpt = Checkpointer(spec, base, 0, 1, lambda m: None, files={})
        finally:
            faults.load("")
        assert ckpt.fence_info()["term"] == 2
        ckpt.close(None)
    finally:
        dist.destroy_process_group()
        fence.install(None)


class _Checked:
    """An attempt's fence whose check passed: the attempt paused right after it while a newer term took over (the
    fault point ``act``)."""

    def __init__(self, term: int):
        self.term = term

    def covers(self, where) -> bool:
        return True

    def check(self, what: str) -> None:
        pass


def test_a_lineage_record_an_older_term_writes_after_a_newer_one_drops_nothing(home):
    """Attempt 2 paused between its fence check and its lineage record write (a fork at step 5) while attempt 3
    took over and wrote its record (its cutoff [3, 10]). Attempt 2's write then lands, under its own term: the
    record read is still attempt 3's, whose cutoff and line of training stay (on one shared file the older write
    replaced it). A newer term's write removes the older terms' records; without a fence the copy is written and
    read where no term wrote one."""
    from pipelines.train.ckpt import history

    spec = load_spec(None, [], env={})
    base = history.resumed(None, "tok", 1, None)
    try:
        fence.install(_Checked(3))
        history.write(spec, "run/key", history.resumed(base, "tok", 3, 10))
        fence.install(_Checked(2))
        history.write(spec, "run/key", history.resumed(history.fork(base, "other", 5), "other", 2, 5))
        rec = history.read(spec, "run/key")
        assert (rec["token"], rec["cutoffs"]) == ("tok", [[1, None], [3, 10]])
        assert history.top_term(ckpt_tiers.read_lineage(spec, "run/key")) == 3
        fence.install(_Checked(4))
        history.write(spec, "run/key", history.resumed(rec, "tok", 4, 12))
        d = history.terms_dir(spec, "run/key")
        assert sorted(os.listdir(d)) == ["4.json"]
        assert json.loads(history.record_path(spec, "run/key").read_text())["cutoffs"][-1] == [4, 12]
        (d / "09.json").write_text("{}")  # not a term's name (nor "-1.json", "x.json"): never read
        assert history.read(spec, "run/key")["cutoffs"][-1] == [4, 12]
        # a rolled-back image (the version before) ran term 5 and wrote the copy alone: read over the records
        older = history.resumed(history.fork(rec, "rolled-back", 12), "rolled-back", 5, 12)
        history.record_path(spec, "run/key").write_text(json.dumps(older))
        assert history.read(spec, "run/key") == older
        fence.install(_Checked(3))  # a writer of term 3 paused after its check: the newer copy stays
        history.write(spec, "run/key", history.resumed(base, "tok", 3, 11))
        assert history.read(spec, "run/key") == older
        fence.install(_Checked(6))
        history.write(spec, "run/key", history.resumed(older, "rolled-back", 6, 14))
        assert history.read(spec, "run/key")["cutoffs"][-2:] == [[5, 12], [6, 14]]
        history.record_path(spec, "run/key").write_text('{"token": "to')  # a torn copy: the records are read
        assert history.read(spec, "run/key")["cutoffs"][-1] == [6, 14]
        big = history.resumed(history.read(spec, "run/key"), "rolled-back", 7, 15)
        big["cutoffs"] = [[1, st] for st in range(3000)] + big["cutoffs"][-1:]  # ~100 KiB: many attempts
        fence.install(_Checked(7))
        history.write(spec, "run/key", big)
        assert history.read(spec, "run/key")["cutoffs"][-1] == [7, 15]
        assert (history.terms_dir(spec, "run/key") / "7.json").stat().st_size > 1 << 16
    finally:
        fence.install(None)
    with pytest.raises(CheckpointError, match="kept per term"):  # no fence: it would not be read
        history.write(spec, "run/key", base)
    history.write(spec, "run/other", base)  # no fence, no record per term: the copy alone, read as the record
    assert not history.terms_dir(spec, "run/other").exists() and history.read(spec, "run/other") == base
    elsewhere = home / "elsewhere"
    elsewhere.mkdir()
    history.terms_dir(spec, "run/linked").symlink_to(elsewhere)
    with pytest.raises(OSError, match="a link"):
        history.read(spec, "run/linked")


def test_a_record_put_by_a_writer_paused_after_its_check_cannot_land_over_a_newer_copy(home, any_key_s3,
                                                                                        monkeypatch):
    """The run's records on L2 (the lineage record with its cutoffs, a term, the generations record) are put on the
    condition read before the fence check: a writer that pauses there (the fault point ``act``) while a newer term
    puts its copy stops with FencedOut (exit 75), and the newer copy stays. Without a pause the copy is replaced."""
    from pipelines.storage import faults
    from pipelines.storage.s3 import client, split_uri

    spec = load_spec(None, [f"services.s3_endpoint_url={any_key_s3}", "services.s3_bucket=ck-records",
                            f"checkpoint.l1={home}/l1"], env={})
    bucket, key = split_uri(ckpt_tiers.tier_locations(spec, "run/key")["L2"] + ".lineage.json")
    ckpt_tiers.put_l2_record(spec, "run/key", ".lineage.json", "first")
    ckpt_tiers.put_l2_record(spec, "run/key", ".lineage.json", "second")  # replaced: nobody wrote in between
    assert ckpt_tiers.l2_record(spec, "run/key", ".lineage.json") == "second"
    paused = []

    def point(phase, **where):
        if phase == faults.ACT and not paused:
            paused.append(phase)
            client(spec).put_object(Bucket=bucket, Key=key, Body=b"newer")

    monkeypatch.setattr(faults, "point", point)
    with pytest.raises(fence.FencedOut, match="changed since this attempt read it") as e:
        ckpt_tiers.put_l2_record(spec, "run/key", ".lineage.json", "stale")
    assert e.value.exit_code == 75 and paused
    assert ckpt_tiers.l2_record(spec, "run/key", ".lineage.json") == "newer"


def test_the_promote_stages_copies_are_put_only_over_the_copy_they_decided_on(home, any_key_s3, monkeypatch):
    """The promote stage (it holds no term) copies L1's records to L2 only over what it read there: a newer lineage
    copy put between its read and its put stays (FencedOut, exit 75, out of ``carry`` too, not a warning); a
    generations copy naming a newer generation current (another cluster's later run) stays with one line, while an
    older one, or one L1's record retires, is replaced."""
    from pipelines.storage.s3 import client, split_uri
    from pipelines.train.ckpt import fence_l2, history

    spec = load_spec(None, [f"services.s3_endpoint_url={any_key_s3}", "services.s3_bucket=ck-copies",
                            f"checkpoint.l1={home}/l1"], env={})
    base, g2, g3 = "run/key", "run/key.gen-20261201T000000000000", "run/key.gen-20261202T000000"
    history.write(spec, g2, history.resumed(None, "tok", 1, None))
    newer = json.dumps(history.resumed(history.resumed(None, "tok", 1, None), "tok", 4, 20))
    bucket, key = split_uri(ckpt_tiers.tier_locations(spec, g2)["L2"] + ckpt_tiers.LINEAGE_SUFFIX)
    client(spec).create_bucket(Bucket=bucket)
    read = ckpt_tiers.l2_record_read

    def read_then_another_writer_puts(spec_, rel, suffix):
        got = read(spec_, rel, suffix)
        if suffix == ckpt_tiers.LINEAGE_SUFFIX:
            client(spec).put_object(Bucket=bucket, Key=key, Body=newer.encode())
        return got

    monkeypatch.setattr(ckpt_tiers, "l2_record_read", read_then_another_writer_puts)
    with pytest.raises(fence.FencedOut) as e:
        fence_l2.carry(spec, g2, log=pytest.fail)
    assert e.value.exit_code == 75 and ckpt_tiers.l2_record(spec, g2, ckpt_tiers.LINEAGE_SUFFIX) == newer
    monkeypatch.setattr(ckpt_tiers, "l2_record_read", read)

    gens = Path(ckpt_tiers.tier_locations(spec, base)["L1"] + ckpt_tiers.GENERATIONS_SUFFIX)
    gens.write_text(json.dumps({"current": g2, "pending": None, "retiring": []}))
    for on_l2, replaced in (({"current": g3, "retiring": [g2]}, False), ({"current": base}, True),
                            ({"current": g3}, True)):
        if on_l2["current"] == g3 and replaced:  # this L1 retired g3 (a pending run it did not adopt)
            gens.write_text(json.dumps({"current": g2, "pending": None, "retiring": [g3]}))
        ckpt_tiers.put_l2_record(spec, base, ckpt_tiers.GENERATIONS_SUFFIX, json.dumps(on_l2))
        lines = []
        fence_l2.carry(spec, g2, log=lines.append)
        got = json.loads(ckpt_tiers.l2_record(spec, base, ckpt_tiers.GENERATIONS_SUFFIX))
        assert (got["current"] == g2) == replaced, (on_l2, got)
        assert [bool(re.search(r"generations record .* not copied to L2: L2's copy names a newer generation", ln))
                for ln in lines] == ([] if replaced else [True]), lines
    assert ckpt_tiers.l2_record(spec, g2, ckpt_tiers.LINEAGE_SUFFIX) == newer  # never replaced by the older
    monkeypatch.setattr(history, "RECORD_LIMIT", len(newer) - 1)  # a record past its bound is not read: one line
    with pytest.raises(CheckpointError, match=rf"{len(newer)} bytes, more than the {len(newer) - 1} a record may"):
        ckpt_tiers.l2_record(spec, g2, ckpt_tiers.LINEAGE_SUFFIX)


def test_a_conditional_write_that_meets_another_in_flight_is_sent_again_and_its_end_decides(home, any_key_s3,
                                                                                          monkeypatch):
    """AWS answers 409 to a conditional put while another to the same key is in flight (every node's leader puts
    the same term record at its first promotion; botocore does not send it again). The put is sent again: the same
    bytes landed by the other node are ours (done, where it was "L2 unavailable, later" before), another writer's
    stop this one (FencedOut), and a conflict that outlasts every wait is L2Unavailable (75, the step later)."""
    from botocore.exceptions import ClientError

    from pipelines.storage.s3 import client
    from pipelines.train.ckpt import s3_markers

    spec = load_spec(None, [f"services.s3_endpoint_url={any_key_s3}", "services.s3_bucket=ck-conflict",
                            f"checkpoint.l1={home}/l1"], env={})
    s3 = client(spec)
    s3.create_bucket(Bucket="ck-conflict")
    conflict = ClientError({"Error": {"Code": "ConditionalRequestConflict"},
                            "ResponseMetadata": {"HTTPStatusCode": 409}}, "PutObject")
    monkeypatch.setattr(s3_markers, "CONFLICT_WAITS_S", (0.0, 0.0))

    class InFlight:
        """The other writer's put of ``theirs`` is in flight at our first try (409 while it lands)."""

        def __init__(self, theirs, conflicts=1):
            self.theirs, self.left, self.tries = theirs, conflicts, 0

        def put_object(self, **kw):
            self.tries += 1
            if self.left:
                self.left -= 1
                s3.put_object(Bucket=kw["Bucket"], Key=kw["Key"], Body=self.theirs)
                raise conflict
            return s3.put_object(**kw)

        def __getattr__(self, name):
            return getattr(s3, name)

    cond = s3_markers.supported(s3, "ck-conflict")
    assert cond  # moto honours If-None-Match, as AWS does
    same = InFlight(b"term 3")
    s3_markers.put(same, "ck-conflict", "a/term-3", b"term 3", None, cond, "recording term 3")
    assert same.tries == 2 and s3.get_object(Bucket="ck-conflict", Key="a/term-3")["Body"].read() == b"term 3"
    with pytest.raises(fence.FencedOut, match="changed since this attempt read it"):
        s3_markers.put(InFlight(b"another"), "ck-conflict", "a/rec", b"ours", None, cond, "putting a/rec")
    assert s3.get_object(Bucket="ck-conflict", Key="a/rec")["Body"].read() == b"another"
    stuck = InFlight(b"x", conflicts=99)
    with pytest.raises(L2Unavailable, match=r"409\) each of 3 times") as e:
        s3_markers.put(stuck, "ck-conflict", "a/stuck", b"ours", None, cond, "putting a/stuck")
    assert stuck.tries == 3 and e.value.exit_code == 75
    once = InFlight(b"x", conflicts=99)  # an unconditional put is never sent again: nothing would stop it late
    with pytest.raises(L2Unavailable, match=r"409\) \(not sent again"):
        s3_markers.put(once, "ck-conflict", "a/once", b"ours", None, False, "putting a/once")
    assert once.tries == 1

    class DeleteInFlight(InFlight):
        """Another writer's delete of the same copy is in flight at our first delete (409 while it lands)."""

        def delete_object(self, **kw):
            self.tries += 1
            if self.left:
                self.left -= 1
                s3.delete_object(Bucket=kw["Bucket"], Key=kw["Key"])
                raise conflict
            return s3.delete_object(**kw)

    tag = s3.put_object(Bucket="ck-conflict", Key="a/gone", Body=b"old")["ETag"]
    both = DeleteInFlight(b"")
    s3_markers.delete(both, "ck-conflict", "a/gone", tag, cond, "removing a/gone")  # gone: as ours
    assert both.tries == 2 and s3_markers.object_etag(s3, "ck-conflict", "a/gone") is None


def test_a_lease_that_cannot_be_read_is_live_and_nothing_of_its_attempt_is_removed(tmp_path, monkeypatch):
    """A lease file whose read failed (EIO, ESTALE on L1's file system: no answer) counted as expired: start-up
    cleanup then removed a running attempt's temp entries, and a new attempt's ``take`` deleted its lease. Now a
    read still failing after its retries is a live lease; a file that answered but is not a lease still expired."""
    import errno
    import math

    d = tmp_path / ".fence"
    _take(d, "busy0001").release()  # a lease file of its own, then one that answers garbage
    fence.write_lease(d, "busy0001", 1, time.time() - 3600)  # expired long ago by its content
    (d / f"{fence.LEASE_PREFIX}torn0001").write_text("{not json")
    (d / f"{fence.LEASE_PREFIX}dirs0001").mkdir()  # a path that answers: no lease (EISDIR), so expired
    real = fence._expiry
    tries = []

    def eio(p):
        if p.name.endswith("busy0001"):
            tries.append(p.name)
            raise OSError(errno.EIO, "Input/output error", str(p))
        return real(p)

    monkeypatch.setattr(fence, "_expiry", eio)
    leases = fence.read_leases(d)
    assert leases == {"busy0001": math.inf, "torn0001": 0.0, "dirs0001": 0.0} and len(tries) == fence.READ_TRIES
    stale = tmp_path / "l0" / ".step-000010.tmp-busy0001"
    stale.mkdir(parents=True)
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert not fence.removable(stale, leases, lease_s=60.0)  # its attempt may be running
    logs = []
    f = fence.Fence.take(d, "next0001", 60.0, (), log=logs.append)
    assert (d / f"{fence.LEASE_PREFIX}busy0001").exists() and "busy0001's lease cannot be read" in " ".join(logs)
    f.release()
    monkeypatch.setattr(fence, "_expiry", real)
    assert fence.read_leases(d)["busy0001"] < time.time() and fence.removable(stale, fence.read_leases(d), 60.0)
