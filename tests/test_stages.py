"""The stage table: one declaration per stage gives the config hash, the CLI, the DAG tasks and the docs table;
re-runs reuse work, force recomputes, changed inputs invalidate (even with --output); lineage for Asset hand-offs."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT, write_jsonl
from pipelines.stages import STAGES, markdown_table


def test_every_stage_cli_comes_from_its_table_entry():
    import importlib

    for s in STAGES.values():
        mod = importlib.import_module(s.module)
        with pytest.raises(SystemExit) as e:
            mod.main(["--help"])
        assert e.value.code == 0
    out = subprocess.run([sys.executable, "-m", "pipelines.eval.register", "--help"], capture_output=True, text=True,
                         cwd=ROOT).stdout
    assert STAGES["register"].summary.split()[0] in out
    for up in STAGES["register"].upstream:
        assert f"--{up}-manifest" in out


def test_the_readme_stage_table_is_the_generated_one():
    assert markdown_table() in (ROOT / "README.md").read_text(), "regenerate it: python -m pipelines.stages"


def test_a_missing_upstream_manifest_is_a_user_error_without_traceback(home):
    r = subprocess.run([sys.executable, "-m", "pipelines.data.filter", "--dedup-manifest", str(home / "nope")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "filter: error: --dedup-manifest" in r.stderr and "no manifest at" in r.stderr


def _ingest(home, *more):
    cmd = [sys.executable, "-m", "pipelines.data.ingest", "--input", str(home / "in.jsonl"), "--output",
           str(home / "out"), "--report", str(home / "r.json"), *more]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r.stdout, json.loads((home / "out" / "manifest.json").read_text())


def test_rerun_reuses_force_recomputes_and_a_changed_input_invalidates_even_with_output(home):
    write_jsonl(home / "in.jsonl", [{"text": "one two three"}, {"text": "four five six"}])
    out1, m1 = _ingest(home)
    out2, m2 = _ingest(home)
    assert "up to date" in out2 and m2["finished"] == m1["finished"]
    out3, m3 = _ingest(home, "--set", "run.force=true")
    assert "up to date" not in out3 and m3["finished"] != m1["finished"]
    write_jsonl(home / "in.jsonl", [{"text": "one two three"}, {"text": "something else"}])
    out4, m4 = _ingest(home)  # same --output directory, new input: recomputed
    assert "up to date" not in out4 and m4["inputs"][0]["sha256"] != m1["inputs"][0]["sha256"]
    assert json.loads((home / "r.json").read_text())["stage"] == "ingest"


def test_lineage_follows_inputs_and_refuses_a_rewritten_upstream(home, spark, monkeypatch):
    sys.path.insert(0, str(ROOT / "plugins"))
    from llm_operators import AirflowFailException, upstream_manifests

    from pipelines.cli import stage_dir
    from pipelines.data import ingest
    from pipelines.manifest import StageError, input_ref, lineage
    from pipelines.spec import load_spec

    write_jsonl(home / "in.jsonl", [{"text": "one two three"}])
    spec = load_spec(None, [f"data.inputs=[{home / 'in.jsonl'}]"], env={})
    ing = ingest.run(spec, spark=spark)
    sd = stage_dir(spec, "dedup", [input_ref(ing)])
    with sd:
        (sd.tmp / "x").write_text("x")
        dd = sd.commit({"x": "x"})
    assert lineage(dd.path) == {"dedup": dd.path, "ingest": ing.path}
    event = SimpleNamespace(extra={"manifest": dd.path})
    assert upstream_manifests("a", "dedup", ["ingest", "dedup"], None, [], [event]) == {"ingest": ing.path,
                                                                                       "dedup": dd.path}
    assert upstream_manifests("a", "dedup", ["dedup"], dd.path, [], [])["dedup"] == dd.path  # the param wins
    with pytest.raises(AirflowFailException, match="no 'a' Asset event yet"):
        upstream_manifests("a", "dedup", ["dedup"], None, [], [])
    doc = json.loads((home / "var/runs/ingest").glob("*/manifest.json").__next__().read_text())
    doc["outputs"][0]["sha256"] = "0" * 64  # the ingest result was rewritten after dedup used it
    (home / "var/runs/ingest").glob("*/manifest.json").__next__().write_text(json.dumps(doc))
    with pytest.raises(StageError, match="re-run from ingest"):
        lineage(dd.path)
    # storage failing under a manifest is the task's retry (AirflowException), a refusal the user's (no retry)
    import errno

    from llm_operators import AirflowException

    from pipelines import manifest

    for error, final in ((OSError(errno.EIO, "Input/output error", dd.path), False),
                         (PermissionError(errno.EACCES, "Permission denied", dd.path), True)):
        monkeypatch.setattr(manifest, "lineage", lambda path, _e=error: (_ for _ in ()).throw(_e))
        with pytest.raises(AirflowException, match="dedup manifest") as e:
            upstream_manifests("a", "dedup", ["dedup"], dd.path, [], [])
        assert isinstance(e.value, AirflowFailException) == final, e.value


def _ingest_then_dedup(spec):
    """Two committed stages, the second made from the first (its manifest records the first's as its input)."""
    from pipelines.cli import stage_dir
    from pipelines.manifest import input_ref

    up = stage_dir(spec, "ingest", [])
    with up:
        (up.tmp / "x").write_text("x")
        ing = up.commit({"x": "x"})
    down = stage_dir(spec, "dedup", [input_ref(ing)])
    with down:
        (down.tmp / "y").write_text("y")
        return ing, down.commit({"y": "y"})


def test_lineage_follows_inputs_under_a_run_root_with_a_space_and_non_ascii(home):
    """input_ref records an upstream manifest as a file URI, which percent-encodes a space or an é: read back
    undecoded, every stage that follows its inputs (tokenize's corpus record, the Asset hand-off) failed on a
    run.root such as /mnt/fsx/LLM runs."""
    from pipelines.manifest import input_ref, lineage
    from pipelines.spec import load_spec

    spec = load_spec(None, [f"run.root={home / 'LLM runs' / 'été'}"], env={})
    ing, dd = _ingest_then_dedup(spec)
    assert "%20" in input_ref(ing)["uri"]
    assert lineage(dd.path) == {"dedup": dd.path, "ingest": ing.path}


def test_forged_or_dangling_upstream_manifests_are_refused_in_one_line_not_a_traceback(home):
    """An output without a name or checksum (KeyError in its digest), an upstream result deleted since (a bare
    FileNotFoundError) and a manifest that names itself as its input (RecursionError) were each a traceback and
    exit 1 in every stage that follows inputs; each is now a StageError (exit 2) naming the manifest."""
    from pipelines.manifest import ManifestInvalid, StageError, input_ref, lineage, load_manifest
    from pipelines.spec import load_spec

    spec = load_spec(None, [], env={})
    ing, dd = _ingest_then_dedup(spec)
    raw = json.loads(open(ing.path).read())
    nameless = home / "nameless" / "manifest.json"
    nameless.parent.mkdir()
    nameless.write_text(json.dumps({**raw, "outputs": [{"path": "x", "sha256": "0" * 64}]}))
    with pytest.raises(ManifestInvalid, match="not a manifest") as e:
        load_manifest(nameless)
    assert e.value.exit_code == 2
    loop = home / "loop" / "manifest.json"
    loop.parent.mkdir()
    loop.write_text(json.dumps({**raw, "inputs": []}))
    me = load_manifest(loop)
    loop.write_text(json.dumps({**raw, "inputs": [input_ref(me)]}))  # its digest does not cover its inputs
    with pytest.raises(ManifestInvalid, match="its own upstream"):
        lineage(loop)
    for f in (home / "var" / "runs" / "ingest").rglob("*"):
        if f.is_file():
            f.unlink()
    with pytest.raises(StageError, match="which is gone: re-run from ingest") as e:
        lineage(dd.path)
    assert e.value.exit_code == 2


def test_a_stage_meeting_a_failing_disk_exits_75_and_a_refused_path_2_each_in_one_line(capsys):
    """An OSError no stage classified itself (hashing outputs, the key lock, linking shards): storage failing
    (EIO, ESTALE, ENOSPC) is 75 and a path refused to this user 2, each one line; they were a traceback and 1,
    which Airflow retried (a refusal for ever)."""
    import errno

    from pipelines.cli import stage_main

    for error, code in ((OSError(errno.EIO, "Input/output error", "/runs/x"), 75),
                        (OSError(errno.ESTALE, "Stale file handle", "/runs/x"), 75),
                        (PermissionError(errno.EACCES, "Permission denied", "/runs/.k.lock"), 2)):
        def run(spec, *ups, out_dir=None, _e=error):
            raise _e

        assert stage_main("dedup", run, str, argv=[], inputs_required=False) == code
        err = capsys.readouterr().err
        assert err.startswith("dedup: error: ") and len(err.strip().splitlines()) == 1 and "/runs/" in err, err
    with pytest.raises(FileNotFoundError):  # an answer about a path no stage expected: a bug's traceback
        stage_main("dedup", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError(2, "No such file", "/x")), str,
                   argv=[], inputs_required=False)


def test_a_report_failing_after_the_commit_credentials_refused_and_an_unparsable_spec_are_each_one_line(
        capsys, monkeypatch, tmp_path):
    """Three failures that were a traceback and exit 1: the report's write failing after the stage committed (EIO:
    75, a retry reuses the commit), an object store refusing these credentials (403, no credentials at all: 2),
    credentials that lapsed (an expired session token, a provider that did not answer: 75) and a spec or a --set
    value that is not YAML, or a file that is not text (2)."""
    import errno
    from types import SimpleNamespace

    from botocore.exceptions import ClientError, NoCredentialsError

    from pipelines import cli

    def failing_report(path, payload):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(cli, "write_report", failing_report)
    done = SimpleNamespace(stage="dedup", path="/runs/dedup/k")
    assert cli.stage_main("dedup", lambda *a, **k: done, str, argv=["--report", "/r.json"],
                          inputs_required=False) == 75
    err = capsys.readouterr().err
    assert err.startswith("dedup: error: storage: ") and "/r.json" in err and len(err.splitlines()) == 1, err
    monkeypatch.undo()
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"},
                          "ResponseMetadata": {"HTTPStatusCode": 403}}, "PutObject")
    for error in (denied, NoCredentialsError()):
        def run(spec, *ups, out_dir=None, _e=error):
            raise _e

        assert cli.stage_main("dedup", run, str, argv=[], inputs_required=False) == 2
        err = capsys.readouterr().err
        assert err.startswith("dedup: error: the object store refused the request: ") and \
            len(err.strip().splitlines()) == 1, err
    from botocore.exceptions import CredentialRetrievalError

    expired = ClientError({"Error": {"Code": "ExpiredToken"}, "ResponseMetadata": {"HTTPStatusCode": 400}}, "GetObject")
    for error in (CredentialRetrievalError(provider="container-role", error_msg="timed out"), expired):
        def flaky(spec, *ups, out_dir=None, _e=error):
            raise _e

        # not the user's to fix: a retry gets fresh credentials (75; a traceback and exit 1 until 2026-12-03)
        assert cli.stage_main("dedup", flaky, str, argv=[], inputs_required=False) == 75
        err = capsys.readouterr().err
        assert err.startswith("dedup: error: the credentials lapsed ") and len(err.strip().splitlines()) == 1, err
    (tmp_path / "torn.yaml").write_text("train: [1\n")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00binary")
    for argv in (["--set", "train.steps=[1"], ["--spec", str(tmp_path / "torn.yaml")],
                 ["--spec", str(tmp_path / "binary.yaml")], ["--set", "services.s3_endpoint_url=minio:9000"]):
        with pytest.raises(SystemExit) as e:
            cli.stage_main("dedup", lambda *a, **k: done, str, argv=argv, inputs_required=False)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("spec: error: ") and "Traceback" not in err, (argv, err)
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://minio:9000")
    (tmp_path / "empty.yaml").write_text("services:\n")
    assert cli.spec_from_args(SimpleNamespace(spec=str(tmp_path / "empty.yaml"), overrides=[])) \
        .services.s3_endpoint_url == "http://minio:9000"


def test_an_experiment_the_tracking_server_will_not_create_says_why(monkeypatch):
    """Creating the run's experiment, any failure was taken for "created meanwhile by another task" and the lookup
    after it (None) ended the stage in ``AttributeError: 'NoneType' …``, hiding the server's own answer (a refusal,
    an outage the stage would retry). The server's error is raised as it came; one created meanwhile is used."""
    from types import SimpleNamespace

    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, TEMPORARILY_UNAVAILABLE

    from pipelines import tracking
    from pipelines.spec import load_spec

    class Server:
        def __init__(self, error, meanwhile=None):
            self.error, self.meanwhile, self.asked = error, meanwhile, 0

        def get_experiment_by_name(self, name):
            self.asked += 1
            return self.meanwhile if self.asked > 1 else None

        def create_experiment(self, name, artifact_location=None):
            raise self.error

    spec = load_spec(None, [], env={})
    down = MlflowException("the server is restarting", error_code=TEMPORARILY_UNAVAILABLE)
    monkeypatch.setattr(tracking, "client", lambda spec: Server(down))
    with pytest.raises(MlflowException, match="restarting") as e:
        tracking.experiment_id(spec)
    assert tracking.mlflow_outage(e.value)  # what the stage classifies: 75
    taken = MlflowException("already exists", error_code=RESOURCE_ALREADY_EXISTS)
    monkeypatch.setattr(tracking, "client", lambda spec: Server(taken, SimpleNamespace(experiment_id="7")))
    assert tracking.experiment_id(spec) == "7"


def test_the_readme_is_short_shows_the_two_commands_and_every_doc_it_links_exists():
    import re

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "make demo" in text and "make test" in text and "make airflow" in text
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert {"docs/data.md", "docs/evaluation.md", "docs/training.md"} <= set(links)
    for page in links:
        assert (ROOT / page).exists(), page
    for page in (ROOT / "docs").glob("*.md"):  # and the pages' own relative links
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / link).exists(), (page.name, link)

