"""Tier promotion against a real S3 protocol endpoint (the embedded one, rclone serve s3, on 127.0.0.1)."""
import errno
import json
import os

import pytest

from pipelines.storage.s3 import client
from pipelines.train.ckpt import protocol as ck
from pipelines.train.ckpt import local as ckpt_local
from pipelines.train.ckpt import s3_tier as ckpt_s3
from pipelines.train.ckpt import tiers as ckpt_tiers
from pipelines.spec import load_spec


def _spec(url, **extra):
    sets = [f"services.s3_endpoint_url={url}", "services.s3_bucket=ckpt-test",
            "checkpoint.multipart_threshold_mb=5", "checkpoint.multipart_chunk_mb=5"]
    return load_spec(None, sets + [f"{k}={v}" for k, v in extra.items()], env={})


def _make_ckpt(spec, rel, big_mb=11):
    from pipelines.spec import resolve_path

    final = resolve_path(spec.checkpoint.l0) / rel
    tmp = final.with_name(".tmp")
    tmp.mkdir(parents=True)
    (tmp / "model.pt").write_bytes(os.urandom(big_mb * 1024 * 1024))  # > threshold: multipart upload
    (tmp / "model_args.json").write_text('{"d_model": 8}')
    return ckpt_local.commit_local(tmp, final, meta={"step": 10})


def test_promote_copies_and_verifies_every_tier_then_is_idempotent(home, s3_server):
    spec = _spec(s3_server)
    rel = "run/key/step-000010"
    _make_ckpt(spec, rel)
    rep = ckpt_tiers.promote(spec, rel)
    assert rep["actions"] == {"L1": "copied", "L2": "uploaded"}
    s3 = client(spec)
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="ckpt-test")["Contents"]}
    assert keys == {f"checkpoints/{rel}/{n}" for n in ("model.pt", "model_args.json", "PARTS/part-0.json", "MANIFEST.json",
                                                       "COMMIT")}  # a one-part step of the part protocol
    head = s3.head_object(Bucket="ckpt-test", Key=f"checkpoints/{rel}/model.pt")
    meta = {k.lower(): v for k, v in head["Metadata"].items()}  # (the embedded endpoint capitalises the keys)
    assert meta[ck.PARTS_META].endswith("-3")  # really went multipart (11 MB / 5 MB parts)
    assert ckpt_tiers.promote(spec, rel)["actions"] == {"L1": "already-verified", "L2": "already-verified"}
    tier, local = ckpt_tiers.fetch(spec, rel, cache=home / "cache", prefer=("L2",))
    assert tier == "L2" and (local / "model.pt").read_bytes() == (home / "var/tiers/nvme" / rel / "model.pt").read_bytes()


def test_promote_refuses_a_checkpoint_whose_checksum_does_not_match(home, s3_server):
    spec = _spec(s3_server, **{"services.s3_bucket": "ckpt-corrupt"})
    rel = "run/key/step-000020"
    d = _make_ckpt(spec, rel, big_mb=1)
    with open(d / "model.pt", "r+b") as f:  # flip one byte after the manifest was written
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ck.CheckpointError, match="model.pt sha256 .* does not match"):
        ckpt_tiers.promote(spec, rel)
    assert not (home / "var/tiers/shared" / rel).exists()  # nothing half-promoted at L1


def test_a_copy_without_commit_marker_is_never_taken(home, s3_server):
    spec = _spec(s3_server, **{"services.s3_bucket": "ckpt-partial"})
    rel = "run/key/step-000030"
    d = _make_ckpt(spec, rel, big_mb=1)
    ckpt_tiers.promote(spec, rel)
    s3 = client(spec)
    s3.delete_object(Bucket="ckpt-partial", Key=f"checkpoints/{rel}/COMMIT")  # as if the upload died
    with pytest.raises(ck.CheckpointError, match="no COMMIT marker"):
        ckpt_s3.download_checkpoint(spec, f"s3://ckpt-partial/checkpoints/{rel}", home / "dl")
    (d / "COMMIT").unlink()
    with pytest.raises(ck.CheckpointError, match="incomplete"):
        ck.verify_local(d)
    # restore falls through tiers: L0 is incomplete, L1 still verifies
    tier, _ = ckpt_tiers.fetch(spec, rel)
    assert tier == "L1"


def test_fetch_says_unknown_when_a_tier_did_not_answer_and_refuses_a_path_outside_the_tiers(home, s3_server):
    """Evaluate and register read the promoted step from L2 first: L2 down (or a disk failing) is a retry (75), not
    "no tier holds it" (2, never retried); a step that every tier answered for and none holds stays 2; a step name
    from a manifest that leads outside the tiers is refused, never read."""
    import json as _json

    from pipelines.spec import resolve_path
    from pipelines.storage import faults

    spec = _spec(s3_server, **{"services.s3_bucket": "ckpt-fetch"})
    rel = "run/key/step-000050"
    _make_ckpt(spec, rel, big_mb=1)
    ckpt_tiers.promote(spec, rel)
    faults.load(_json.dumps([{"at": "s3", "do": "s3_down", "times": 0}]))
    try:
        with pytest.raises(ck.TierUnavailable, match="one did not answer") as e:
            ckpt_tiers.fetch(spec, rel, cache=home / "cache", prefer=("L2",))
        assert e.value.exit_code == 75
    finally:
        faults.load("")
    l0 = resolve_path(spec.checkpoint.l0) / rel
    faults.load(_json.dumps([{"at": "read", "do": "eio", "path": str(l0), "times": 0}]))
    try:  # L0's disk failing and L1, L2 without the step: unknown too
        with pytest.raises(ck.TierUnavailable):
            ckpt_tiers.fetch(spec, "run/key/step-000050", prefer=("L0",))
    finally:
        faults.load("")
    with pytest.raises(ck.CheckpointError, match="no tier holds") as e:  # every tier answered: not there
        ckpt_tiers.fetch(spec, "run/key/step-000099", cache=home / "cache")
    assert not isinstance(e.value, ck.TierUnavailable)
    for forged in ("/etc", "../../outside/step-000050", "run/../../x"):
        with pytest.raises(ck.CheckpointError, match="not a plain relative path"):
            ckpt_tiers.fetch(spec, forged)


def test_promote_stage_puts_a_step_whose_l0_is_gone_on_l2_from_l1_part_by_part(home, s3_server):
    """One promotion path: a one-part step is staged and merged on L1 (the part protocol), and a step whose L0 left
    with its pod reaches L2 from its L1 copy as its part, then the step's COMMIT, equal to L1's."""
    spec = _spec(s3_server, **{"services.s3_bucket": "ckpt-from-l1"})
    rel = "run/key/step-000040"
    d = _make_ckpt(spec, rel, big_mb=1)
    assert ckpt_tiers.promote(spec, rel, tiers=("L1",))["actions"] == {"L1": "copied"}
    l1 = home / "var/tiers/shared" / rel
    assert ck.read_local_manifest(l1)["part_of"] == {"model.pt": 0, "model_args.json": 0}
    assert not (l1.parent / ".step-000040.parts").exists()  # the staging went with the merge
    ckpt_local.remove_local(d)  # an emptyDir L0, gone with the pod
    rep = ckpt_tiers.promote(spec, rel)
    assert rep["actions"] == {"L1": "already-verified", "L2": "uploaded"}
    assert rep["l2_commit"] == rep["commit"] == (l1 / "COMMIT").read_text().strip()
    part = client(spec).get_object(Bucket="ckpt-from-l1", Key=f"checkpoints/{rel}/PARTS/part-0.json")["Body"].read()
    assert json.loads(part)["part"] == 0 and set(json.loads(part)["files"]) == {"model.pt", "model_args.json"}
    assert ckpt_tiers.promote(spec, rel)["actions"] == {"L1": "already-verified", "L2": "already-verified"}


def test_the_promote_stage_puts_the_runs_term_and_records_on_l2_before_its_step(home, s3_server, tmp_path,
                                                                                 monkeypatch):
    """A forced run (a new generation of its key) whose L2 did not answer to its end put neither its term nor its
    records there (the lineage record, the key's generations record), and the promote stage then put its final step
    on L2 without them: once L1 was lost (a new FSx), the new L1 read no term on L2, took term 1 again, the one
    that committed the step, read no lineage record there, and took the key's old generation for its current one.
    The stage now puts L1's highest term (with its attempt and launch) and both records there before the step; L1
    failing to answer is exit 75, never "no term"."""
    import shutil

    from pipelines.manifest import Manifest
    from pipelines.train import promote as promote_stage
    from pipelines.train.ckpt import fence, fence_l2, history

    spec = _spec(s3_server, **{"services.s3_bucket": "ckpt-carry"})
    down = _spec("http://127.0.0.1:9", **{"checkpoint.s3_connect_timeout_s": 1, "checkpoint.s3_max_attempts": 1})
    (home / "var/tiers/shared/run/key").mkdir(parents=True)  # the key's first generation: L1's record is the record
    gen = ckpt_tiers.generation(down, "run/key", force=True)  # on L1 only: L2 does not answer
    f = fence.Fence.take(fence.fence_dir(spec, gen), "a1", 60, (str(home / "var/tiers/shared" / gen),),
                         log=lambda m: None, launch="launch-1")
    fence.install(f)
    try:  # training's start, L2 down: the record on L1 only
        ckpt_tiers.write_lineage(down, gen, history.resumed(None, "tok", f.term, None), log=lambda m: None)
    finally:
        fence.install(None)
        f.release()
    ckpt_tiers.commit_generation(down, "run/key", gen, log=lambda m: None)
    (fence.fence_dir(spec, gen) / "term-000000002").touch()  # a start that died creating its term: it committed nothing
    rel = f"{gen}/step-000010"
    _make_ckpt(spec, rel, big_mb=1)
    train = Manifest(stage="train", config_hash="c", extra={"checkpoint": rel}, path=str(tmp_path / "m.json"))
    out = promote_stage.run(spec, train)
    assert out.extra["actions"] == {"L1": "copied", "L2": "uploaded"}
    s3 = client(spec)
    body = s3.get_object(Bucket="ckpt-carry", Key=f"checkpoints/{gen}/.fence/term-000000001")["Body"]
    assert json.loads(body.read()) == {"attempt": "a1", "launch": "launch-1"}  # the bytes the promoter puts
    assert fence_l2.recorded_top(spec, gen) == 1  # not the empty term 2: another writer's bytes for a live start's
    # a step the stage promoted before it carried the records: its next run puts them there
    for key in (f"checkpoints/{gen}/.fence/term-000000001", f"checkpoints/{gen}.lineage.json",
                "checkpoints/run/key.generations.json"):
        s3.delete_object(Bucket="ckpt-carry", Key=key)
    assert promote_stage.run(spec, train).path == out.path
    assert fence_l2.recorded_top(spec, gen) == 1
    shutil.rmtree(home / "var/tiers/shared")  # L1 lost
    assert ckpt_tiers.read_generations(spec, "run/key")["current"] == gen  # from L2's copy
    d = fence.fence_dir(spec, gen)
    assert fence.Fence.take(d, "a2", 60, (), log=lambda m: None, floor=fence_l2.floor(spec, d, gen)).term == 2
    assert ckpt_tiers.read_lineage(spec, gen)["cutoffs"] == [[1, None]]  # from L2's copy

    def eio(d):
        raise OSError(errno.EIO, "Input/output error", str(d))

    monkeypatch.setattr(fence_l2, "read_terms", eio)  # an L1 that fails to list the run's terms: unknown, no step put
    with pytest.raises(ck.TierUnavailable, match="cannot be read"):
        fence_l2.carry(spec, gen)

    def eacces(d):
        raise OSError(errno.EACCES, "Permission denied", str(d))

    monkeypatch.setattr(fence_l2, "read_terms", eacces)  # refused to this user: no retry reads it (exit 2)
    with pytest.raises(ck.CheckpointError, match="give this user access") as e:
        fence_l2.carry(spec, gen)
    assert not isinstance(e.value, ck.TierUnavailable) and e.value.exit_code == 2


def test_the_promote_stages_copy_of_the_records_never_replaces_a_newer_one(home, s3_server):
    """What the promote stage copies to L2 (it holds no term): never a lineage record over L2's copy that names a
    newer term, nor a generations record that does not name the promoted generation current (an L1 of another
    cluster, come back after a retry elsewhere wrote newer ones); a torn record on L1 is a line, not a copy; the
    step's own term goes there when its file on L1 is lost."""
    from pipelines.train.ckpt import fence_l2, history

    spec = _spec(s3_server, **{"services.s3_bucket": "ckpt-carry-guard"})
    newer = history.resumed(history.resumed(None, "tok", 1, None), "tok", 5, 20)
    ckpt_tiers.put_l2_record(spec, "run/key", ckpt_tiers.LINEAGE_SUFFIX, json.dumps(newer))
    ckpt_tiers.put_l2_record(spec, "run/key", ckpt_tiers.GENERATIONS_SUFFIX, '{"current": "run/key"}')
    history.write(spec, "run/key", history.resumed(None, "tok", 1, None))  # this L1's: term 1 only
    gens = home / "var/tiers/shared/run/key.generations.json"
    gens.write_text('{"current": "run/key.gen-20261201T000000000000"}')  # another generation is current here
    lines = []
    assert fence_l2.carry(spec, "run/key", step_term=3, log=lines.append) == 3  # no term file on L1: the step's
    assert fence_l2.recorded_top(spec, "run/key") == 3
    assert history.parse(ckpt_tiers.l2_record(spec, "run/key", ckpt_tiers.LINEAGE_SUFFIX), "") == newer
    assert json.loads(ckpt_tiers.l2_record(spec, "run/key", ckpt_tiers.GENERATIONS_SUFFIX)) == {"current": "run/key"}
    history.record_path(spec, "run/key").write_text('{"token": "to')  # torn
    gens.write_text('{"current": "/etc"}')  # refused by read_generations
    fence_l2.carry(spec, "run/key", log=lines.append)
    assert [ln.split(" record")[0] for ln in lines] == ["[promote] warning: the lineage", "[promote] warning: the generations"]
    assert history.parse(ckpt_tiers.l2_record(spec, "run/key", ckpt_tiers.LINEAGE_SUFFIX), "") == newer


def test_the_promote_stage_refuses_a_checkpoint_path_that_leaves_the_tiers(home, tmp_path):
    """The train manifest's extra.checkpoint is data: one that leads outside the tiers (absolute, ``..``) is refused
    (exit 2) before any tier is touched; it was copied, written and uploaded wherever it led."""
    from types import SimpleNamespace

    from pipelines.manifest import StageError
    from pipelines.train import promote as promote_stage

    spec = load_spec(None, [], env={})
    for forged in ("../../../outside/step-000010", "/etc/step-000010", None):
        train = SimpleNamespace(extra={"checkpoint": forged}, path=str(tmp_path / "train/manifest.json"))
        with pytest.raises(StageError, match="not a plain relative path") as e:
            promote_stage.run(spec, train)
        assert getattr(e.value, "exit_code", 2) == 2
    assert not (home / "var/runs/promote").exists()


def test_an_object_store_refusing_these_credentials_is_the_users_to_fix_where_only_l2_answers(home, tmp_path,
                                                                                             monkeypatch):
    """An S3 endpoint refusing these credentials (a wrong key, a bucket policy: 401/403) was read as L2 not
    answering wherever only L2 could answer: the promote stage, the term floor of a new L1 and a restore whose steps
    are only on L2 exited 75, and Airflow spent its retries on what no retry mends. Now it is ``L2Refused``: still L2
    unusable where another tier serves (an ``L2Unavailable``), exit 2 with the key to fix where only L2 answers; an
    expired session token or an endpoint down stays a retry's (75)."""
    from types import SimpleNamespace

    from botocore.exceptions import ClientError

    from pipelines.manifest import Manifest
    from pipelines.storage.s3 import serving
    from pipelines.train import promote as promote_stage
    from pipelines.train.ckpt import fence, fence_l2
    from pipelines.train.ckpt import restore as rs

    with serving(tmp_path / "store", auth=True) as url:  # a key of its own: this process's credentials are refused
        spec = _spec(url, **{"checkpoint.s3_max_attempts": 1})
        rel = "run/key/step-000010"
        _make_ckpt(spec, rel, big_mb=1)
        train = Manifest(stage="train", config_hash="c", extra={"checkpoint": rel}, path=str(tmp_path / "m.json"))
        with pytest.raises(ck.L2Refused, match=r"refused the request \(ClientError: .*\(403\).*check "
                                               r"services.s3_endpoint_url") as e:
            promote_stage.run(spec, train)
        assert e.value.exit_code == 2 and isinstance(e.value, ck.L2Unavailable)  # (training: L2 skipped, as down)
        with pytest.raises(ck.L2Refused):  # a new L1's first term: unknown, and no retry reads it
            fence_l2.floor(spec, fence.fence_dir(spec, "run/other"), "run/other")
        monkeypatch.setattr(rs, "_bcast", lambda obj: obj)  # one rank: rank 0's answer is every rank's
        rank0 = SimpleNamespace(rank=0, spec=spec, rel_root="run/key", rec=None, log=lambda m: None)
        with pytest.raises(ck.L2Refused, match="cannot list this run's checkpoints"):  # the steps only L2 holds
            rs._choose(rank0, {}, None, set())
        import torch.distributed as dist

        from pipelines.procs import free_port
        from pipelines.train.ckpt.checkpointer import Checkpointer

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        try:  # a training start on a new L1: its term floor is L2's to tell, and every rank stops with 2
            with pytest.raises(ck.L2Refused, match="L2, which does, refused: .*the object store refused the request"):
                Checkpointer(spec, "run/third", 0, 1, lambda m: None, files={})
            from pipelines.train.trainer import Trainer

            floor = fence.fence_dir(spec, "run/fourth") / fence.FLOOR_FILE  # a new L1 that read L2's terms once:
            floor.parent.mkdir(parents=True, exist_ok=True)  # the line's record is L2's copy, and L2 refuses it
            floor.write_text('{"l2_top": 3}')
            start = Trainer.__new__(Trainer)
            start.rank, start.spec, start.rel_root, start.log = 0, spec, "run/fourth", lambda m: None
            with pytest.raises(ck.L2Refused, match="the lineage record cannot be read .*L2Refused") as e:
                start._find_restore()  # every rank stops with 2 (not TierUnavailable's 75)
            assert e.value.exit_code == 2
        finally:
            dist.destroy_process_group()
    expired = ClientError({"Error": {"Code": "ExpiredToken"}, "ResponseMetadata": {"HTTPStatusCode": 400}}, "GetObject")
    skewed = ClientError({"Error": {"Code": "RequestTimeTooSkewed"}, "ResponseMetadata": {"HTTPStatusCode": 403}},
                         "GetObject")  # the node's clock, not who signed
    down = ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "GetObject")
    for e in (expired, skewed, down):
        assert type(ckpt_s3.unusable("s3://b/k", e)) is ck.L2Unavailable and ckpt_s3.unusable("", e).exit_code == 75


def test_the_promote_stage_never_records_a_promotion_without_its_commit_nor_reads_l1_failing_as_no_manifest(
        home, s3_server, tmp_path, monkeypatch, capsys):
    """A COMMIT removed from L2 between the upload and its read-back was recorded as ``commit: null`` and exit 0,
    and every later run compared null with null and said "up to date" while L2 held no COMMIT. And on that path an
    L1 that failed to answer for the step's manifest (EIO) read as "no manifest", so the step's own term was not
    carried to L2. Now the first is a retry (75), a manifest that recorded no COMMIT is redone, and L1's failure is
    75 (a refusal to this user 2), never {}."""
    from pipelines.manifest import Manifest
    from pipelines.train import promote as promote_stage

    spec = _spec(s3_server, **{"services.s3_bucket": "ckpt-commit"})
    rel = "run/key/step-000010"
    _make_ckpt(spec, rel, big_mb=1)
    train = Manifest(stage="train", config_hash="c", extra={"checkpoint": rel}, path=str(tmp_path / "m.json"))
    real = ckpt_tiers.commit_at
    monkeypatch.setattr(ckpt_tiers, "commit_at", lambda spec, uri: None)  # gone right after the upload verified
    with pytest.raises(ck.L2Unavailable, match="its COMMIT is gone right after the upload") as e:
        promote_stage.run(spec, train)
    assert e.value.exit_code == 75 and not list((home / "var").rglob("promote/*/manifest.json"))
    monkeypatch.setattr(ckpt_tiers, "commit_at", real)
    old = promote_stage.promote
    monkeypatch.setattr(promote_stage, "promote", lambda *a, **k: {**old(*a, **k), "l2_commit": None})  # as before
    assert promote_stage.run(spec, train).extra["commit"] is None  # a manifest of the old code: no COMMIT recorded
    monkeypatch.setattr(promote_stage, "promote", old)
    client(spec).delete_object(Bucket="ckpt-commit", Key=f"checkpoints/{rel}/COMMIT")  # and none on L2: null = null
    capsys.readouterr()
    done = promote_stage.run(spec, train)
    assert done.extra["commit"] == real(spec, done.extra["l2_uri"]) and "up to date" not in capsys.readouterr().out
    assert done.extra["commit"] is not None
    assert promote_stage.run(spec, train).path == done.path and "up to date" in capsys.readouterr().out

    def failing(code):
        def read(d):
            raise OSError(code, os.strerror(code), str(d / ck.CKPT_MANIFEST))
        return read

    monkeypatch.setattr(promote_stage, "read_local_manifest", failing(errno.EIO))
    with pytest.raises(ck.TierUnavailable, match=r"L1: the manifest of run/key/step-000010 cannot be read") as e:
        promote_stage.run(spec, train)
    assert e.value.exit_code == 75
    monkeypatch.setattr(promote_stage, "read_local_manifest", failing(errno.EACCES))
    with pytest.raises(ck.CheckpointError, match="give this user access") as e:
        promote_stage.run(spec, train)
    assert e.value.exit_code == 2
    monkeypatch.setattr(promote_stage, "read_local_manifest", failing(errno.ENOENT))  # gone by retention: L1's term
    assert promote_stage.run(spec, train).path == done.path


def test_promote_refuses_one_part_of_a_step_that_l1_does_not_hold(home, s3_server):
    spec = _spec(s3_server, **{"services.s3_bucket": "ckpt-one-part"})
    rel = "run/key/step-000050"
    final = home / "var/tiers/nvme" / rel
    tmp = final.with_name(".tmp")
    tmp.mkdir(parents=True)
    (tmp / "__1_0.distcp").write_bytes(b"x" * 100)
    ckpt_local.commit_local(tmp, final, meta={"step": 50, "part": 1, "parts": 2, "attempt": "a"})
    with pytest.raises(ck.CheckpointError, match="only part 1 of 2"):
        ckpt_tiers.promote(spec, rel)
    assert not (home / "var/tiers/shared" / rel).exists()


def test_an_l2_part_manifest_that_is_not_the_part_its_key_names_is_not_merged(home, s3_server):
    """Hostile L2: PARTS/part-1.json that says it is part 0 must not let its files skip the check."""
    from pipelines.train.ckpt import parts as ckpt_parts

    spec = _spec(s3_server, **{"services.s3_bucket": "ckpt-liar"})
    uri = "s3://ckpt-liar/run/key/step-000060"
    s3 = client(spec)
    s3.create_bucket(Bucket="ckpt-liar")
    body = json.dumps({"files": {}, "part": 0, "parts": 2, "attempt": "a"}).encode()
    for k in (0, 1):
        s3.put_object(Bucket="ckpt-liar", Key=f"run/key/step-000060/PARTS/part-{k}.json", Body=body)
    with pytest.raises(ck.CheckpointError, match="describes part 0 of 2, not part 1 of 2"):
        ckpt_parts.merge_parts_s3(spec, uri, 2, "a", checked=frozenset({0}))
    assert ckpt_s3.read_s3_manifest(spec, uri) is None


def test_a_restore_from_the_nodes_disks_says_that_l2_was_not_consulted(home):
    """L1 holds no global commit of the newest step the nodes' disks offer: the restore takes it without listing L2,
    which may hold a newer step; one line says so (none when L1 holds that step)."""
    from types import SimpleNamespace

    from pipelines.train.ckpt import restore

    logs = []
    ckpt = SimpleNamespace(spec=load_spec(None, [], env={}), rel_root="run/key", rec=None, log=logs.append)
    got = restore.candidates(ckpt, {0: {10: (0, 1, "aaaa1111", None, None)}}, None)
    assert [c["step"] for c in got] == [10] and not got[0]["l1"]
    assert len(logs) == 1 and logs[0].startswith("[ckpt] restore: L2 not consulted: step 10 can be restored from "
                                                 "the nodes' disks"), logs
    restore.candidates(ckpt, {0: {10: (0, 1, "aaaa1111", None, None)}}, 10)  # a step asked for by name: nothing to say
    assert len(logs) == 1


def test_what_a_commit_vouches_for_is_on_the_disk_before_the_commit(home, monkeypatch):
    """Every file of a copy and its directories are fsync'd before its COMMIT is written, on L0 (commit_local) and on
    L1 (copy_local), and the rename that puts the copy in place is made durable in its parent: a node that crashes
    right after a commit must not leave a COMMIT over data still in its page cache."""
    import pathlib

    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    spec = _spec("http://127.0.0.1:9")
    rel = "run/key/step-000010"
    l0 = _make_ckpt(spec, rel, big_mb=1)
    l1 = pathlib.Path(ckpt_tiers.tier_locations(spec, rel)["L1"])

    def durable_before_commit(copy):
        first_commit = next(i for i, p in enumerate(synced) if "COMMIT" in pathlib.Path(p).name)
        for name in ("model.pt", "model_args.json"):
            assert any(pathlib.Path(p).name == name for p in synced[:first_commit]), (copy, synced)
        assert str(copy.parent) in synced[first_commit:], synced  # the rename into place, made durable

    synced.clear()
    ckpt_local.copy_local(l0, l1)  # L1
    durable_before_commit(l1)
    synced.clear()
    durable_before_commit(_make_ckpt(spec, "run/key/step-000020", big_mb=1))  # L0
