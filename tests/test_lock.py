"""The locks: portable (every listed platform), split runtime / test, consistent with their inputs and the venv.

The full check against the public index is `make lock-check` (minutes of index requests); here the checker itself is
shown to pass a good pin and fail a wrong hash, on one small lock, when the index answers."""
from __future__ import annotations

import importlib.metadata as md
import re
import sys
import urllib.request
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import lock_check  # noqa: E402

RUNTIME, DEV, TF4 = ROOT / "requirements.lock", ROOT / "requirements-dev.lock", ROOT / "requirements-tf4.lock"
TEST_ONLY = {"pytest", "playwright", "python-hcl2", "warcio", "datasketch", "accelerate", "cfn-lint"}  # transformers: runtime (export)


def pins(path: Path) -> dict[str, lock_check.Pin]:
    return {canonicalize_name(p.name): p for p in lock_check.read_lock(path)}


def requirements(path: Path) -> list[Requirement]:
    lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
    return [Requirement(ln) for ln in lines if ln and not ln.startswith("-r")]


def test_the_runtime_lock_holds_no_test_package_and_the_dev_lock_agrees_with_it_on_every_shared_pin():
    run, dev = pins(RUNTIME), pins(DEV)
    assert not TEST_ONLY & set(run), "test-only packages in the runtime lock"
    assert TEST_ONLY - {"cfn-lint"} <= set(dev)
    assert set(run) <= set(dev) and all(dev[n].version == p.version and dev[n].hashes == p.hashes for n, p in run.items())
    assert "pyspark-client" not in dev and run["pyspark"].version == "4.3.0"  # one PySpark
    assert int(run["pandas"].version.split(".")[0]) < 3  # what PySpark 4.3 supports: no pandas warning at import
    # what the cluster's Airflow (the chart's KubernetesExecutor, FAB auth manager, S3 task logs, PostgreSQL) loads
    assert {"apache-airflow-providers-cncf-kubernetes", "apache-airflow-providers-fab", "apache-airflow-providers-amazon",
            "psycopg", "psycopg-binary"} <= set(run)
    assert "pip" not in dev and re.search(r"^PIP_VERSION := \d+\.\d+", (ROOT / "Makefile").read_text(), re.M)


def test_the_tf4_lock_pins_what_it_shares_with_the_runtime_lock_as_the_runtime_lock_does():
    """var/tf4 goes first on the export test's PYTHONPATH: every package it carries besides the three it exists to
    differ on (Makefile's TF4_OWN) is the venv's own version, so torch and the rest never import another numpy."""
    own = set(re.search(r"^TF4_OWN := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split("|"))
    run, tf4 = pins(RUNTIME), pins(TF4)
    assert own == {"transformers", "huggingface-hub", "tokenizers"} and tf4["transformers"].version.startswith("4.")
    assert {n: p.version for n, p in tf4.items() if n not in own} == {n: run[n].version for n in tf4 if n not in own}


def test_every_pin_has_a_hash_for_each_listed_platform_family():
    """A portable lock has more than this machine's file: torch has wheels for Linux x86_64 and aarch64 and macOS
    (public index hashes, not a local CPU build's), and its CUDA libraries are marked Linux-only."""
    run = pins(RUNTIME)
    assert len(run["torch"].hashes) >= 6 and run["torch"].marker is None
    assert "6746dbcb" not in RUNTIME.read_text()  # the local torch-2.13.0+cpu wheel's hash of the old lock
    cuda = [p for n, p in run.items() if n.startswith("nvidia-")]
    assert cuda and all('sys_platform == "linux"' in (p.marker or "") for p in cuda)  # packaging's quotes


def test_each_lock_satisfies_its_inputs():
    """requirements*.in and their locks agree (a stale lock after an edited .in fails here; `make lock` fixes it)."""
    for src, lock in (("requirements.in", RUNTIME), ("requirements-dev.in", DEV), ("requirements-tf4.in", TF4)):
        have = pins(lock)
        for req in requirements(ROOT / src):
            pin = have.get(canonicalize_name(req.name))
            assert pin is not None, f"{req.name} of {src} is not in {lock.name}: run make lock"
            assert req.specifier.contains(pin.version, prereleases=True), (src, req, pin.version)


def test_the_venv_is_the_lock():
    env = default_environment()
    for name, pin in pins(DEV).items():
        if not pin.applies(env) or (name in {"torch"} or name.startswith(("nvidia-", "cuda-", "triton"))):
            continue  # torch may come from TORCH_INDEX (a CPU build, with no CUDA libraries)
        assert md.version(name) == pin.version, name
    assert md.version("torch").split("+")[0] == pins(DEV)["torch"].version
    with pytest.raises(md.PackageNotFoundError):
        md.distribution("pyspark-client")


def test_lock_check_parses_markers_and_multi_line_pins(tmp_path):
    lock = tmp_path / "requirements-x.lock"
    lock.write_text("six==1.17.0 \\\n    --hash=sha256:" + "a" * 64 + " \\\n    --hash=sha256:" + "b" * 64 +
                    "\n    # via x\nnvidia-nccl-cu13==2.29.7 ; sys_platform == 'linux' \\\n    --hash=sha256:" +
                    "c" * 64 + "\n")
    six, nccl = lock_check.read_lock(lock)
    assert (six.name, six.version, six.hashes) == ("six", "1.17.0", frozenset({"a" * 64, "b" * 64}))
    assert nccl.applies(lock_check.environment("linux-aarch64", "3.12"))
    assert not nccl.applies(lock_check.environment("macos-arm64", "3.11"))
    lock.write_text("six>=1.0 --hash=sha256:" + "a" * 64 + "\n")
    with pytest.raises(SystemExit, match="not a pinned requirement"):
        lock_check.read_lock(lock)
    # markers with '-' in their values, and the pins no listed platform installs
    lock.write_text("a==1 ; extra == 'foo-bar' --hash=sha256:" + "a" * 64 + "\n"
                    "pywin32==312 ; sys_platform == 'win32' --hash=sha256:" + "b" * 64 + "\n"
                    "c==1 ; platform_release >= '5.10.0-1057' and sys_platform == 'aix' --hash=sha256:" + "c" * 64 + "\n")
    a, pywin, c = lock_check.read_lock(lock)
    assert a.marker == 'extra == "foo-bar"' and c.marker.startswith('platform_release >= "5.10.0-1057"')
    assert lock_check.nowhere([a, pywin, c]) == ([pywin], [a, c])


def test_lock_check_checks_the_patch_release_a_pin_is_split_at():
    """uv splits soupsieve at 3.11.5: 3.11.0's environment sees only the lower pin, so the upper one was checked for
    3.12 alone (and a lock of 3.11 only would have called it "applies nowhere"). The split's release is a Python of
    its own in the check."""
    split = lock_check.read_lock(ROOT / "requirements-dev.lock")
    low, high = sorted((p for p in split if p.name == "soupsieve"), key=lambda p: Version(p.version))
    assert lock_check.pythons([low, high], ["3.11"]) == ["3.11", "3.11.5"]
    assert lock_check.pythons([low, high]) == ["3.11", "3.11.5", "3.12"]
    at = {py: [p.version for p in (low, high) if p.applies(lock_check.environment("linux-x86_64", py))]
          for py in lock_check.pythons([low, high])}
    assert at == {"3.11": [low.version], "3.11.5": [high.version], "3.12": [high.version]}
    assert lock_check.environment("macos-arm64", "3.11.5")["python_version"] == "3.11"
    assert lock_check.nowhere([low, high]) == ([], [])
    # "> v" and "<= v" split at the next release: a pin above 3.11.5 only is checked on 3.11.6
    above = lock_check.Pin("x", "1", "python_full_version > '3.11.5'", frozenset())
    assert lock_check.pythons([above], ["3.11"]) == ["3.11", "3.11.6"]
    assert above.applies(lock_check.environment("linux-x86_64", "3.11.6")) and lock_check.nowhere([above]) == ([], [])


def _index_answers() -> bool:
    try:
        urllib.request.urlopen(lock_check.INDEX + "/six/", timeout=20).close()
        return True
    except OSError:
        return False


def test_lock_check_passes_a_published_hash_and_fails_another(tmp_path):
    if not _index_answers():
        pytest.skip(f"the package index {lock_check.INDEX} does not answer from here")
    six = pins(DEV)["six"]
    good = lock_check.Pin("six", six.version, None, six.hashes)
    assert lock_check.check([good], "macos-arm64", "3.12") == ([], [])
    bad = lock_check.Pin("six", six.version, None, frozenset({"0" * 64}))
    (problem,), _ = lock_check.check([bad], "linux-x86_64", "3.11")
    # pip refuses the file itself when it fetches it, or the checker finds the index's hash not among the lock's
    assert "DO NOT MATCH THE HASHES" in problem or ("is not among the lock's hashes" in problem and "six-" in problem)
    missing = lock_check.Pin("six", "0.0.999", None, frozenset({"0" * 64}))
    assert lock_check.check([missing], "linux-aarch64", "3.11")[0][0].startswith("pip: ")
    assert lock_check.check([], "linux-aarch64", "3.11")[0] == ["no pin of this lock applies here"]


def test_lock_check_says_75_when_the_index_did_not_answer(tmp_path, monkeypatch, capsys):
    """An index that does not answer is the network's failure, not the lock's: exit 75 (retry), not 1."""
    lock = tmp_path / "requirements-mini.lock"
    lock.write_text("six==1.17.0 \\\n    --hash=sha256:4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274\n")
    monkeypatch.setattr(lock_check, "INDEX", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    platform = sorted(lock_check.PLATFORMS)[0]
    assert lock_check.main([str(lock), "--platform", platform, "--python", lock_check.PYTHONS[0]]) == 75
    assert "the index did not answer" in capsys.readouterr().err
