"""What benchmarks/gpu_checks.sh runs on a lent GPU, checked here on CPU: the whole trainer against its own step
(benchmarks/trainer_gpu.py) and the bundle of wheels and corpus carried there (scripts/gpu_bundle.py)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest
import torch

from conftest import ROOT
from test_resilience import _tok


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trainer_gpu():
    return _load(ROOT / "benchmarks" / "trainer_gpu.py")


def test_the_whole_trainer_runs_beside_its_step_benchmark_on_cpu(home, trainer_gpu, tmp_path, capsys):
    tok = _tok(home)
    out = tmp_path / "trainer_gpu.json"
    assert trainer_gpu.main(["--cpu-smoke", "--tokenize-manifest", tok.path, "--steps", "8", "--every", "4",
                             "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    # the trainer ran with checkpoints, validation and MLflow on, and its rates were measured
    assert r["checkpoints"] == 2 and r["evaluations"] == 2 and r["mlflow_run_id"]
    assert r["trainer_step_tokens_per_s"] > 0 and r["trainer_steady_wall_tokens_per_s"] > 0
    assert r["trainer_goodput_tokens_per_s"] > 0 and r["step_bench_tokens_per_s"] > 0
    assert r["step_bench_from"] == "measured here after the trainer"  # no speed assertion: the row is reported
    assert r["world_size"] == 1 and r["ratio"] == pytest.approx(
        r["trainer_steady_wall_tokens_per_s"] / r["step_bench_tokens_per_s"])  # per process: one here
    # the save at step 8 lies in the steady window (after 5 steps): its stall is reported and taken out of the other
    assert 0 < r["steady_stall_s"] <= r["stall_s_max"] and r["ratio_less_stalls"] > r["ratio"]  # step 4's is not
    assert r["ratio_less_stalls"] == pytest.approx(
        r["trainer_steady_wall_less_stalls_tokens_per_s"] / r["step_bench_tokens_per_s"])
    assert r["params"] < 1e6  # the smoke model, at the corpus's vocabulary (500)
    assert "wall ÷ benchmark" in capsys.readouterr().out
    # a folder as --out is refused before anything runs (not after minutes of training)
    assert trainer_gpu.main(["--cpu-smoke", "--tokenize-manifest", tok.path, "--out", str(tmp_path)]) == 2
    if not torch.cuda.is_available():
        assert trainer_gpu.main(["--tokenize-manifest", tok.path, "--out", str(tmp_path / "x.json")]) == 2
        assert "no CUDA device here" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_the_step_figure_is_taken_from_gpu_mfu_only_when_it_measured_the_same_config(trainer_gpu, tmp_path):
    want = {"params": 368_000_000, "micro_batch": 8, "seq_len": 2048, "dtype": "bf16", "compile": True,
            "device_type": "cuda", "loss_chunk_tokens": "auto", "activation_checkpointing": "none"}
    rows = [{"impl": "ours (trainer step)", "tokens_per_s": 170_000.0}, {"impl": "nanoGPT recipe", "tokens_per_s": 1.0}]
    same = tmp_path / "same.json"
    same.write_text(json.dumps({**want, "steps": 50, "rows": rows}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**want, "micro_batch": 4, "rows": rows}))
    measured = []

    def bench():
        measured.append(1)
        return 123.0
    assert trainer_gpu.step_figure(str(same), want, bench)[0] == 170_000.0 and not measured
    assert trainer_gpu.step_figure(str(other), want, bench) == (123.0, "measured here after the trainer")
    assert trainer_gpu.step_figure(str(tmp_path / "absent.json"), want, bench)[0] == 123.0 and len(measured) == 2
    # a CPU figure of the same model is another step; so is a failed row of ours (no figure in it)
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({**want, "device_type": "cpu", "rows": rows}))
    assert trainer_gpu.step_figure(str(cpu), want, bench)[0] == 123.0 and len(measured) == 3
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps({**want, "rows": [{"impl": "ours (trainer step)", "error": "OutOfMemoryError: x"}]}))
    assert trainer_gpu.step_figure(str(failed), want, bench)[0] == 123.0 and len(measured) == 4


def test_the_bundle_takes_what_the_device_lacks_and_leaves_optional_and_own_packages(tmp_path, capsys):
    bundle = _load(ROOT / "scripts" / "gpu_bundle.py")
    # a folder it did not write is not replaced; no corpus is the user's to fix: exit 2 both, nothing touched
    theirs = tmp_path / "theirs"
    (theirs / "wheels").mkdir(parents=True)
    (theirs / "wheels" / "keep.txt").write_text("mine")
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    assert bundle.main(["--out", str(theirs), "--tokenize-manifest", str(manifest)]) == 2
    assert (theirs / "wheels" / "keep.txt").read_text() == "mine" and "not a bundle" in capsys.readouterr().err
    (theirs / "bundle.json").write_text(json.dumps({"made_by": "another tool"}))  # a marker that is not ours
    assert bundle.main(["--out", str(theirs), "--tokenize-manifest", str(manifest)]) == 2
    assert (theirs / "wheels" / "keep.txt").read_text() == "mine" and "did not write" not in capsys.readouterr().out
    assert bundle.main(["--out", str(tmp_path / "new"), "--tokenize-manifest", str(tmp_path / "none.json")]) == 2
    assert "no tokenized corpus" in capsys.readouterr().err and not (tmp_path / "new").exists()
    # the corpus inside the bundle it would replace: refused before anything is removed
    mine = tmp_path / "mine"
    (mine / "tokenize").mkdir(parents=True)
    (mine / "bundle.json").write_text(json.dumps({"made_by": bundle.MADE_BY}))
    (mine / "tokenize" / "manifest.json").write_text("{}")
    assert bundle.main(["--out", str(mine), "--tokenize-manifest", str(mine / "tokenize" / "manifest.json")]) == 2
    assert "one inside the other" in capsys.readouterr().err and (mine / "tokenize" / "manifest.json").exists()
    corpus = tmp_path / "corpus"  # and --out inside the corpus's folder (the copy would copy itself)
    corpus.mkdir()
    (corpus / "manifest.json").write_text("{}")
    assert bundle.main(["--out", str(corpus / "out"), "--tokenize-manifest", str(corpus / "manifest.json")]) == 2
    assert "one inside the other" in capsys.readouterr().err and not (corpus / "out").exists()
    link = tmp_path / "link"  # a link as --out is not replaced (nor what it points to)
    link.symlink_to(mine)
    assert bundle.main(["--out", str(link), "--tokenize-manifest", str(corpus / "manifest.json")]) == 2
    assert link.is_symlink() and (mine / "bundle.json").exists()
    have = bundle.device_has()
    assert {"torch", "numpy", "sentencepiece", "pyarrow"} <= have and "pydantic" not in have
    got = bundle.needed({"pydantic", "torch", "numpy", "pyspark", "mlflow", "pipelines", "json", "botocore"})
    assert {"pydantic", "mlflow-skinny", "botocore"} <= set(got)
    assert not {"torch", "numpy", "pyspark", "mlflow", "llm-pipeline"} & set(got)  # there, optional, or ours
    assert got["pydantic"] == importlib.metadata.version("pydantic")  # the version installed here


def test_a_new_bundle_replaces_the_old_one_whole():
    import tempfile
    from pathlib import Path

    bundle = _load(ROOT / "scripts" / "gpu_bundle.py")
    with tempfile.TemporaryDirectory() as d:
        out, new = Path(d) / ".gpu", Path(d) / ".gpu.tmp-1"
        (out / "wheels").mkdir(parents=True)
        (out / "wheels" / "old-1.0-py3-none-any.whl").write_text("old")
        (new / "wheels").mkdir(parents=True)
        (new / "wheels" / "new-2.0-py3-none-any.whl").write_text("new")
        bundle.swap_in(new, out)
        assert [p.name for p in (out / "wheels").iterdir()] == ["new-2.0-py3-none-any.whl"]
        assert sorted(p.name for p in Path(d).iterdir()) == [".gpu"]  # neither the old one nor the new one's folder


def _fake_wheel(path):
    """A wheel pip installs (one empty module): what the script needs to find in .gpu/wheels."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("llmp_fake/__init__.py", "")
        z.writestr("llmp_fake-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: llmp-fake\nVersion: 1.0\n")
        z.writestr("llmp_fake-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr("llmp_fake-1.0.dist-info/RECORD", "")


def test_gpu_checks_without_the_bundle_or_a_gpu_says_so_in_its_status(tmp_path):
    """The one GPU script: no .gpu/wheels is one line and exit 2 before anything runs; steps that fail (no GPU here)
    or do not fit the budget make the status 1 (never 0 with figures missing), each named in the summary."""
    import os
    import subprocess
    import sys

    tree = tmp_path / "tree"
    tree.mkdir()
    for d in ("benchmarks", "configs", "pipelines"):
        (tree / d).symlink_to(ROOT / d)
    run = lambda **env: subprocess.run(["bash", "benchmarks/gpu_checks.sh"], cwd=tree, capture_output=True,  # noqa: E731
                                       text=True, timeout=300, env={**os.environ, "OUT": str(tmp_path / "out"), **env,
                                                                 "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"})
    bare = run()
    assert bare.returncode == 2 and "make gpu-bundle" in bare.stderr and not (tmp_path / "out").exists()
    (tree / ".gpu" / "wheels").mkdir(parents=True)
    _fake_wheel(tree / ".gpu" / "wheels" / "llmp_fake-1.0-py3-none-any.whl")
    done = run(GPU_CHECKS_BUDGET_S="100")  # the 1B step (120 s minimum) never fits: skipped, whatever the pace
    log = (tmp_path / "out" / "gpu_checks.log").read_text()
    assert done.returncode == 1, log
    summary = log[log.index("### summary"):]
    assert "gpu_mfu (ours vs the compiled recipe): rc=2" in summary  # no CUDA here: its own exit 2
    assert "skipped (budget)" in summary and "a step failed or was skipped" in log


def test_the_bundle_retries_only_an_index_that_did_not_answer(tmp_path, monkeypatch):
    """pip says "from versions: none" both when the index answered with no wheel for the device's Python and
    platform (the pin is the user's to change: 2) and when it did not answer; only its network errors are 75."""
    import subprocess
    from types import SimpleNamespace

    bundle = _load(ROOT / "scripts" / "gpu_bundle.py")
    said = {"no wheel": "ERROR: Could not find a version that satisfies the requirement foo==1.0 (from versions: none)\n"
                        "ERROR: No matching distribution found for foo==1.0",
            "no index": "WARNING: Retrying ... NewConnectionError: Failed to establish a new connection\n"
                        "ERROR: Could not find a version that satisfies the requirement foo==1.0 (from versions: none)"}
    for what, code in (("no wheel", 2), ("no index", 75)):
        monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=1, stderr=said[what]))
        with pytest.raises(bundle.BundleError) as e:
            bundle.download({"foo": "1.0"}, tmp_path / what, "3.12")
        assert e.value.exit_code == code, what
