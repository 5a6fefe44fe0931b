"""Check that every pin of every lock installs from the public index on every platform the README lists.

For each lock (``requirements*.lock``), platform and Python (each listed one, and a patch release of one where a
marker splits a pin, e.g. 3.11.5), the pins whose environment markers hold there are
handed to pip against the public index only (no wheel folder, no constraints file, no pip configuration):
``pip install --dry-run --no-deps --platform … --python-version … --report``. pip picks, for each pin, the file it
would install there; the check passes when pip found one for every pin and that file's sha256 (as the index
publishes it) is among the pin's hashes. Nothing is installed, and wheels are not downloaded (pip reads their
metadata only); an sdist is fetched to read its metadata.

    python scripts/lock_check.py [LOCK ...] [--platform NAME ...] [--python 3.11 ...]

Exit 0 only when every pin of every lock passes on every platform.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from pip_network import unanswered as unanswered_index  # beside this file (first on sys.path when run as a script)

ROOT = Path(__file__).resolve().parents[1]
INDEX = os.environ.get("LOCK_INDEX", "https://pypi.org/simple")


def manylinux(arch: str, glibc_minor: int = 28) -> list[str]:
    """The tags a glibc 2.<minor> Linux takes (pip expands only the legacy manylinux2014 tag by itself)."""
    return [f"manylinux_2_{m}_{arch}" for m in range(glibc_minor, 16, -1)] + [f"manylinux2014_{arch}"]


# The platforms the README lists: (pip's --platform tags, marker environment); pip expands a macOS tag to the older
# releases by itself.
PLATFORMS = {
    "linux-x86_64": (manylinux("x86_64"), {"sys_platform": "linux", "platform_system": "Linux",
                                               "platform_machine": "x86_64", "os_name": "posix"}),
    "linux-aarch64": (manylinux("aarch64"), {"sys_platform": "linux", "platform_system": "Linux",
                                                 "platform_machine": "aarch64", "os_name": "posix"}),
    "macos-arm64": (["macosx_14_0_arm64"], {"sys_platform": "darwin", "platform_system": "Darwin",
                                          "platform_machine": "arm64", "os_name": "posix"}),
}
PYTHONS = ("3.11", "3.12")


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    marker: str | None
    hashes: frozenset[str]

    def applies(self, env: dict[str, str]) -> bool:
        return self.marker is None or Marker(self.marker).evaluate(env)

    def line(self) -> str:
        return f"{self.name}=={self.version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(self.hashes))


HASH = re.compile(r"\s--hash=sha256:([0-9a-f]{64})(?=\s|$)")
# Pins whose markers hold on no listed platform and Python: other operating systems, and Pythons above the listed
# ones (uv's universal lock covers every Python from 3.11 up). Listed as such, never silently passed over.
UNLISTED = re.compile(r"sys_platform == [\"'](win32|emscripten|cygwin)[\"']|python_full_version (>=|==) [\"']3\.1[3-9]")


def read_lock(path: Path) -> list[Pin]:
    """The pins of a pip requirements file with hashes (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    pins = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        hashes = frozenset(HASH.findall(" " + line))
        req_text = HASH.sub("", " " + line).strip()
        try:
            req = Requirement(req_text)
        except InvalidRequirement as e:
            raise SystemExit(f"{path.name}: not a requirement: {req_text[:120]} ({e})") from None
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==" or "*" in spec[0].version or req.url:
            raise SystemExit(f"{path.name}: not a pinned requirement with hashes: {req_text[:120]}")
        if not hashes:
            raise SystemExit(f"{path.name}: {req.name}=={spec[0].version} has no --hash")
        pins.append(Pin(req.name, spec[0].version, str(req.marker) if req.marker else None, hashes))
    return pins


UNANSWERED = "the index did not answer"  # a check that says so failed for the network, not for the lock (exit 75)


# a marker that compares the full Python version with a patch release (uv's universal lock: soupsieve below and from
# 3.11.5): (operator, version)
BOUNDARY = re.compile(r"python_full_version\s*([<>]=?|[=!]=)\s*[\"'](\d+\.\d+\.\d+)[\"']")


def _sides(op: str, version: str) -> set[str]:
    """The patch releases on the far side of a comparison from the .0 release: ``>= v`` and ``< v`` split at v,
    ``> v`` and ``<= v`` at the next release, ``== v`` and ``!= v`` at v (and, for a .0 release, the next)."""
    major_minor, patch = version.rsplit(".", 1)
    after = f"{major_minor}.{int(patch) + 1}"
    return {">": {after}, "<=": {after}, "==": {version, after}, "!=": {version, after}}.get(op, {version})


def environment(platform: str, python: str) -> dict[str, str]:
    """The marker environment of ``platform`` and ``python`` (``3.11``: 3.11.0; or a full version, ``3.11.5``)."""
    full = python if python.count(".") == 2 else f"{python}.0"
    return {"python_version": ".".join(full.split(".")[:2]), "python_full_version": full,
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "platform_release": "",
            "platform_version": "", "implementation_version": full, "extra": "", **PLATFORMS[platform][1]}


def pythons(pins: list[Pin], listed: tuple[str, ...] | list[str] = PYTHONS) -> list[str]:
    """The Pythons to check ``pins`` on: each listed one (its .0 release), and each patch release within one
    that a marker splits a pin at (``3.11.5``): above it another pin applies, which the .0 release never sees."""
    out = []
    for py in listed:
        cut = {v for p in pins for op, at in BOUNDARY.findall(p.marker or "") for v in _sides(op, at)
               if v.rsplit(".", 1)[0] == py}
        out += [py] + sorted(cut - {f"{py}.0"}, key=Version)
    return out


def pip_choice(pins: list[Pin], platform: str, python: str) -> tuple[dict[str, dict], str]:
    """What pip would install for ``pins`` there: {normalized name: report item}, and pip's error text if any."""
    with tempfile.TemporaryDirectory() as tmp:
        reqs, report = Path(tmp, "reqs.txt"), Path(tmp, "report.json")
        reqs.write_text("".join(p.line() + "\n" for p in pins))
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
        env["PIP_CONFIG_FILE"] = os.devnull  # no wheel folder, extra index or constraints from the machine's pip.conf
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
               "--disable-pip-version-check", "--timeout", "60", "--retries", "3", "--index-url", INDEX, *(f"--platform={tag}" for tag in PLATFORMS[platform][0]),
               "--python-version", python, "--implementation", "cp", "--report", str(report), "-r", str(reqs)]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired:
            return {}, f"{UNANSWERED}: pip did not finish within 30 minutes"
        if done.returncode or not report.exists():
            lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            said = [ln for ln in lines if ln.startswith(("ERROR", "error"))] or lines[-3:] or ["pip failed"]
            offline = unanswered_index(done.stderr)  # the index did not answer: not the lock's fault
            return {}, (f"{UNANSWERED}: " if offline else "") + " / ".join(said)[:2000]
        try:
            items = json.loads(report.read_text())["install"]
            return {canonicalize_name(i["metadata"]["name"]): i for i in items}, ""
        except (ValueError, KeyError, TypeError) as e:
            return {}, f"pip's report is not what this check reads ({e!r})"


def check(pins: list[Pin], platform: str, python: str) -> tuple[list[str], list[str]]:
    """(problems, sdists) of ``pins`` on one platform and Python: problems is empty when every pin that applies
    there has a file with a matching hash; sdists names the pins that would be built from source there."""
    wanted = [p for p in pins if p.applies(environment(platform, python))]
    if not wanted:
        return ["no pin of this lock applies here"], []
    chosen, error = pip_choice(wanted, platform, python)
    if error:
        return [f"pip: {error}"], []
    problems = []
    for pin in wanted:
        item = chosen.get(canonicalize_name(pin.name))
        if item is None:
            problems.append(f"{pin.name}=={pin.version}: pip chose no file")
            continue
        info = item.get("download_info", {})
        digest = info.get("archive_info", {}).get("hashes", {}).get("sha256")
        if Version(item["metadata"]["version"]) != Version(pin.version):
            problems.append(f"{pin.name}: pip chose {item['metadata']['version']}, the lock pins {pin.version}")
        elif digest not in pin.hashes:
            problems.append(f"{pin.name}=={pin.version}: {info.get('url', '?').rsplit('/', 1)[-1]} "
                            f"(sha256 {digest}) is not among the lock's hashes")
    return problems, sdists(chosen)


def sdists(chosen: dict[str, dict]) -> list[str]:
    """The pins pip would build from source there (no wheel for that platform): they install, with a compiler."""
    return sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in chosen.values()
                  if not i.get("download_info", {}).get("url", "").endswith(".whl"))


def nowhere(pins: list[Pin]) -> tuple[list[Pin], list[Pin]]:
    """Pins no listed platform and Python installs: (for an unlisted one, for none at all)."""
    unused = [p for p in pins if not any(p.applies(environment(pl, py)) for pl in PLATFORMS for py in pythons(pins))]
    return [p for p in unused if UNLISTED.search(p.marker or "")], [p for p in unused if not UNLISTED.search(p.marker or "")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("locks", nargs="*", type=Path, help="lock files (default: requirements*.lock at the root)")
    ap.add_argument("--platform", action="append", choices=sorted(PLATFORMS), help="default: all")
    ap.add_argument("--python", action="append", choices=PYTHONS, help="default: all")
    args = ap.parse_args(argv)
    locks = args.locks or sorted(ROOT.glob("requirements*.lock"))
    if not locks:
        print(f"lock-check: no requirements*.lock under {ROOT}", file=sys.stderr)
        return 1
    pins = {lock: read_lock(lock) for lock in locks}
    jobs = [(lock, plat, py) for lock in locks for plat in args.platform or PLATFORMS
            for py in pythons(pins[lock], args.python or PYTHONS)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda job: check(pins[job[0]], job[1], job[2]), jobs))
    failed = offline = 0
    print(f"{'lock':<24} {'platform':<14} {'python':<7} {'pins':>5}  result")
    for (lock, plat, py), (problems, built) in zip(jobs, results):
        n = sum(p.applies(environment(plat, py)) for p in pins[lock])
        print(f"{lock.name:<24} {plat:<14} {py:<7} {n:>5}  {'ok' if not problems else f'{len(problems)} FAILED'}"
              + (f" ({len(built)} from source: {', '.join(built)})" if built and not problems else ""))
        for problem in problems:
            print(f"    {problem}")
        failed += bool(problems)
        offline += any(UNANSWERED in p for p in problems)
    for lock in locks:
        unlisted, none = nowhere(pins[lock])
        if unlisted:
            print(f"{lock.name}: not for a listed platform or Python (not checked): "
                  + ", ".join(f"{p.name}=={p.version}" for p in unlisted))
        for p in none:
            print(f"{lock.name}: {p.name}=={p.version} applies nowhere (marker {p.marker}): FAILED")
    unplaced = sum(len(nowhere(pins[lock])[1]) for lock in locks)
    print(f"lock-check: {len(jobs) - failed} of {len(jobs)} passed (index {INDEX})"
          + (f"; {unplaced} pins apply on no platform" if unplaced else ""))
    if failed and failed == offline and not unplaced:  # every failure was the index not answering: try again
        print(f"lock-check: the index did not answer ({failed} checks): exit 75, try again", file=sys.stderr)
        return 75
    return 1 if failed or unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
