"""One rule for what an OSError on a path says (``pipelines.storage.oserrors``), and the stages that decide with it
deciding alike: ingest listing its inputs, lineage reading a corpus version, a restore reading L1."""
from __future__ import annotations

import errno

import pytest

from pathlib import Path

from pipelines.data import sources
from pipelines.eval import tracking_server
from pipelines.exit_codes import RETRY, USER_ERROR
from pipelines.lineage import queries, takedowns
from pipelines.manifest import StageError
from pipelines.storage import oserrors
from pipelines.train.ckpt import restore

# errno → (an answer about the path, a refusal to this user, storage failing)
CASES = {errno.ENOENT: "answer", errno.ELOOP: "answer", errno.ENAMETOOLONG: "answer", errno.EACCES: "refusal",
         errno.EPERM: "refusal", errno.EIO: "failing", errno.ESTALE: "failing", errno.EROFS: "failing",
         errno.EINVAL: "failing", errno.ETIMEDOUT: "failing"}


@pytest.mark.parametrize("code", sorted(CASES), ids=[errno.errorcode[c] for c in sorted(CASES)])
def test_each_stage_reads_an_oserror_as_the_one_rule_says(code, monkeypatch, tmp_path):
    kind = CASES[code]
    e = OSError(code, "x", str(tmp_path / "l1" / "step-000010" / "a.distcp"))
    assert (oserrors.unanswered(e), oserrors.refused(e), oserrors.storage_failing(e)) == \
        {"answer": (False, False, False), "refusal": (True, True, False), "failing": (True, False, True)}[kind]
    # a restore: a copy whose read failed (a refusal too) is unknown, never a bad copy to pass over
    assert (restore.l1_failed(e, tmp_path / "l1") is not None) == (kind != "answer")
    # lineage: only storage failing is a retry; a refusal or an answer is the user's
    assert queries.storage_error(e) == (kind == "failing")

    # ingest listing its inputs: 75 for storage failing (and a file listed, then gone: listed again), 2 for a
    # refusal or the tree's own shape
    def fail(*a, **k):
        raise e

    monkeypatch.setattr(sources, "_local_sources", fail)
    with pytest.raises(sources.IngestError) as got:
        sources.local_sources(str(tmp_path / "in"))
    assert got.value.exit_code == (RETRY if kind == "failing" or code == errno.ENOENT else USER_ERROR), got.value
    assert "Traceback" not in str(got.value)

    # the takedown list: none there excludes nothing; 2 for a refusal; 75 for storage failing or another answer
    monkeypatch.setattr(Path, "read_bytes", fail)
    if code == errno.ENOENT:
        assert takedowns.read_list(tmp_path / "exclusions.jsonl").exclusions == ()
    else:
        with pytest.raises(StageError) as got:
            takedowns.read_list(tmp_path / "exclusions.jsonl")
        assert got.value.exit_code == (USER_ERROR if kind == "refusal" else RETRY), got.value
    monkeypatch.setattr(Path, "read_text", fail)  # the tracking server's backend URI file (a mounted Secret)
    assert tracking_server.main(["--service", "mlflow", "--namespace", "mlflow", "--print",
                                 "--backend-store-uri-file", str(tmp_path / "uri")]) == \
        (RETRY if kind == "failing" else USER_ERROR)


def test_an_oserror_without_errno_is_none_of_them():
    e = OSError("no errno")
    assert not (oserrors.unanswered(e) or oserrors.refused(e) or oserrors.storage_failing(e))
    assert not oserrors.unanswered(ValueError("not an OSError"))
