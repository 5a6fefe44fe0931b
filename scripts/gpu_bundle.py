"""Gather into ``.gpu/`` what the lent GPU machine lacks for ``bash benchmarks/gpu_checks.sh`` (ignored by git: name
``.gpu`` in the device tool's ``carry``).

That machine (CPython 3.12 with torch, numpy, pyarrow, sentencepiece … : ``benchmarks/device_packages.txt``) has no
Java, so no Spark, and reaches no package index. This writes:

* ``.gpu/wheels/``: a wheel of every distribution that the trainer, its launcher (torchrun), MLflow's sqlite store and
  the benchmarks import here and that machine's image lacks, at the version installed here, for CPython 3.12 on
  manylinux x86-64. Which ones is found by running: ``benchmarks/trainer_gpu.py --cpu-smoke`` (the whole trainer
  under torchrun, checkpoints, validation, MLflow) and ``benchmarks/gpu_mfu.py --cpu-smoke`` with every Python
  process recording the modules it imported (a ``sitecustomize`` on ``PYTHONPATH``);
* ``.gpu/tokenize/``: a tokenized corpus, a copy of the tokenize stage's directory (``--tokenize-manifest``, default the
  newest under ``var/runs``: ``make demo`` makes one), for ``benchmarks/trainer_gpu.py``.

    python scripts/gpu_bundle.py [--tokenize-manifest M] [--out .gpu]     # make gpu-bundle

Built aside and swapped in whole (a failed run leaves the last bundle as it was); an ``--out`` that holds anything
but a bundle of this script is refused. Exit 2 when there is no tokenized corpus, ``--out`` is not ours or the index
has no wheel of a pin; 75 when the index or the disk did not answer (try again); a failed smoke run's own code
when it is 2 or 75, else 1.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # also when a test loads this file by its path

from pip_network import unanswered as unanswered_index  # noqa: E402  (beside this file)
from pipelines.manifest import newest_manifest  # noqa: E402  (this checkout's package, run as a script)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(5, 40)] + ["manylinux2014_x86_64", "manylinux2010_x86_64",
                                                                     "manylinux1_x86_64"]
# imported here but not needed there: each is imported by a package only when it is installed
NOT_NEEDED = {
    "pyspark": "Spark: the data stages' engine; mlflow.types imports it when present",
    "py4j": "Spark's bridge to the JVM (with pyspark)",
    "mlflow": "mlflow-skinny and mlflow-tracing hold the client and the sqlite store; the full package adds the UI",
    "zstandard": "urllib3 decodes zstd responses with it when present",
    "brotli": "urllib3 decodes brotli responses with it when present",
}
RECORDER = """import atexit, os, sys
def _dump(d=os.environ["LLMP_IMPORTS_DIR"]):
    with open(os.path.join(d, f"{os.getpid()}.txt"), "w") as f:
        f.write("\\n".join(sorted({m.split(".")[0] for m in list(sys.modules)})))
atexit.register(_dump)
"""


MARK = "bundle.json"
MADE_BY = "scripts/gpu_bundle.py"  # the marker's "made_by": only a folder that says so is replaced


class BundleError(RuntimeError):
    def __init__(self, why: str, exit_code: int):
        super().__init__(why)
        self.exit_code = exit_code


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


SMOKE_TIMEOUT_S = 900  # each smoke run (the trainer under torchrun, the step benchmark) on this machine's CPUs
CARRY_WARN_MIB = 56  # the device tool carries at most 64 MiB of ignored paths: say so before a session is spent


def device_has() -> set[str]:
    lines = (ROOT / "benchmarks" / "device_packages.txt").read_text().splitlines()
    return {canonical(x.strip()) for x in lines if x.strip() and not x.startswith("#")}


def imported_modules(tok_manifest: Path) -> set[str]:
    """Top-level modules imported by every Python process of the two smoke runs."""
    with tempfile.TemporaryDirectory() as site, tempfile.TemporaryDirectory() as dump:
        Path(site, "sitecustomize.py").write_text(RECORDER)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               "LLMP_IMPORTS_DIR": dump, "LLMP_PROGRESS": "0"}
        bench = ROOT / "var" / "bench" / "gpu-bundle"
        runs = [["benchmarks/trainer_gpu.py", "--cpu-smoke", "--steps", "8", "--every", "4", "--tokenize-manifest",
                 str(tok_manifest), "--out", str(bench / "trainer_gpu.json")],
                ["benchmarks/gpu_mfu.py", "--cpu-smoke", "--steps", "2", "--warmup", "1", "--out",
                 str(bench / "gpu_mfu.json")]]
        for argv in runs:
            try:
                r = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                                   timeout=SMOKE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise BundleError(f"{argv[0]} --cpu-smoke did not finish within {SMOKE_TIMEOUT_S} s (a hung "
                                  "rendezvous or rank?); try again", 75) from None
            if r.returncode != 0:
                raise BundleError(f"{argv[0]} --cpu-smoke failed ({r.returncode}):\n{r.stdout[-2000:]}"
                                  f"{r.stderr[-3000:]}", r.returncode if r.returncode in (2, 75) else 1)
        return {m for f in Path(dump).glob("*.txt") for m in f.read_text().split()}


def needed(modules: set[str]) -> dict[str, str]:
    """{distribution: version installed here} of the imported modules that the device machine's image lacks."""
    own = {canonical(d) for d in md.packages_distributions().get("pipelines", [])}
    have = device_has()
    out = {}
    for m in modules:
        for dist in md.packages_distributions().get(m, []):
            c = canonical(dist)
            if c not in have and c not in own and c not in NOT_NEEDED:
                out[c] = md.version(dist)
    return dict(sorted(out.items()))


def download(dists: dict[str, str], into: Path, python: str) -> None:
    """pip download each pin as a wheel for CPython ``python`` on manylinux x86-64; BundleError naming the pins it
    could not get: exit 2 when the index has no such wheel (another version or platform is the user's to choose),
    75 when the index did not answer (try again)."""
    into.mkdir(parents=True, exist_ok=True)
    missing, unanswered, absent = [], False, False
    for name, version in dists.items():
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               python, "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(into),
               f"{name}=={version}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            # "from versions: none" is what pip says both when the index did not answer and when it answered with no
            # wheel for this Python and platform: only pip's own network errors make it a retry
            offline = unanswered_index(r.stderr)
            unanswered, absent = unanswered or offline, absent or not offline
            missing.append(f"{name}=={version}: {last}")
    if missing:  # a pin the index has no wheel for is the user's to change, whatever else went wrong
        raise BundleError("no wheel for:\n  " + "\n  ".join(missing), 75 if unanswered and not absent else 2)


def build(tok: Path, into: Path, python: str) -> dict:
    """Everything in ``into`` (a new folder): the wheels, the corpus, the marker last; returns the marker."""
    dists = needed(imported_modules(tok))
    print(f"gpu_bundle: {len(dists)} distributions the device lacks: {', '.join(f'{k}=={v}' for k, v in dists.items())}")
    download(dists, into / "wheels", python)
    shutil.copytree(tok.parent, into / "tokenize")
    mark = {"made_by": MADE_BY, "wheels": dists, "tokenize": str(tok), "python": python}
    (into / MARK).write_text(json.dumps(mark, indent=2))
    return mark


def ours(out: Path) -> bool:
    """Whether ``out`` is a bundle this script wrote (its marker says so)."""
    try:
        return json.loads((out / MARK).read_text()).get("made_by") == MADE_BY
    except (OSError, ValueError, AttributeError):
        return False


def refusal(tok: Path | None, raw_out: Path) -> str | None:
    """Why this run must not go ahead (the user's to fix), or None."""
    if tok is None or not tok.is_file():
        return "no tokenized corpus: run `make demo` first or pass --tokenize-manifest"
    out = raw_out.resolve()
    if raw_out.is_symlink() or (out.exists() and not (out.is_dir() and (ours(out) or not any(out.iterdir())))):
        return (f"{raw_out} is not a bundle this script wrote (a folder with the {MARK} of {MADE_BY}); refusing to "
                "replace it: pass another --out (or delete it, if it is a bundle of an older version of this script)")
    corpus = tok.parent.resolve()
    if corpus.is_relative_to(out) or out.is_relative_to(corpus):
        return f"the corpus {corpus} and --out {out} lie one inside the other: pass a corpus from var/runs"
    return None


def swap_in(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; the bundle there before is moved aside first and removed last."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        old.rmdir()
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenize-manifest", default=None, help="default: the newest under var/runs/tokenize")
    ap.add_argument("--out", default=str(ROOT / ".gpu"))
    ap.add_argument("--python-version", default="3.12", help="the device machine's CPython (default 3.12)")
    args = ap.parse_args(argv)
    tok = Path(args.tokenize_manifest) if args.tokenize_manifest else newest_manifest(ROOT / "var" / "runs", "tokenize")
    why = refusal(tok, Path(args.out))
    if why:
        print(f"gpu_bundle: {why}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()  # '.', '..' made plain: the folder built aside is a sibling, never inside it
    tmp = None
    try:  # built aside, then swapped in: a failed run leaves the last good bundle as it was
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
        build(tok, tmp, args.python_version)
        swap_in(tmp, out)
    except (BundleError, OSError) as e:  # OSError: the disk here: 2 when refused (permissions), else 75 (try again)
        print(f"gpu_bundle: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2 if isinstance(e, PermissionError) else 75)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"gpu_bundle: wrote {out} ({size / 2**20:.1f} MiB: {len(list((out / 'wheels').iterdir()))} wheels, the corpus "
          f"of {tok.parent.name}); carry it: run(carry=['.gpu'], command='bash benchmarks/gpu_checks.sh')")
    if size > CARRY_WARN_MIB * 2**20:
        print(f"gpu_bundle: warning: {size / 2**20:.0f} MiB is near or over what the device tool carries (64 MiB of "
              "ignored paths): use a smaller corpus (--tokenize-manifest)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
