"""The embedded S3 endpoint as its store grows: time to answer after a start, and the server's memory.

Ours is ``rclone serve s3`` over ``var/s3/store`` (objects are files, served from disk). The anchor is the endpoint
we had before: moto's S3 server, which keeps objects in memory, so a start puts the whole store back into it (the
old ``load``: every object uploaded again). For each store size both are started over the same store; we measure

* **start**: seconds from launch until every object is listed by the server after a restart (moto: until its store
  is back in); for ours also the seconds until it answers, and the first listing of a store it has never listed
  (every file hashed once for its ETag);
* **RSS**: the server's resident memory after the start, and its peak while a workload runs (list everything, read
  back 1 GB, write a 256 MB checkpoint file by multipart upload); rclone's whole process, moto's server thread's
  process less what the same Python had before the server started.

Targets (issue 31): start ≤ 5 s and peak RSS < 500 MB with 10 GB stored. moto is measured only at the sizes
given by ``--anchor-gb`` (at 10 GB it would need more than 10 GB of memory).

    python benchmarks/s3_endpoint_bench.py [--sizes-gb 0.85,10] [--anchor-gb 0.85] [--work DIR]

Writes ``var/bench/s3_endpoint.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK = 64 << 20


def fill(store: Path, gb: float) -> tuple[int, int]:
    """A store of ``gb`` GB shaped like L2: per step, a few large part files plus manifests and COMMIT markers."""
    block = os.urandom(BLOCK)
    total, n, step = int(gb * (1 << 30)), 0, 0
    written = 0
    while written < total:
        d = store / "llm-pipeline" / "checkpoints" / "run" / "key" / f"step-{step:06d}"
        d.mkdir(parents=True, exist_ok=True)
        for part in range(4):
            size = min(BLOCK * 2, total - written)
            if size <= 0:
                break
            with open(d / f"__{part}_0.distcp", "wb") as f:
                f.write(step.to_bytes(8, "little") + part.to_bytes(8, "little"))  # no two files alike
                left = size - 16
                while left > 0:
                    f.write(block[:min(left, BLOCK)])
                    left -= BLOCK
            written += size
            n += 1
        for small in ("MANIFEST.json", "COMMIT", "PARTS/part-0.json"):
            (d / small).parent.mkdir(parents=True, exist_ok=True)
            (d / small).write_text(hashlib.sha256(f"{step}{small}".encode()).hexdigest())
            n += 1
        step += 1
    return n, written


class Sampler:
    """The peak of ``rss()`` sampled every 50 ms while the block runs."""

    def __init__(self, rss):
        self.rss, self.peak, self._stop = rss, 0, threading.Event()

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.05)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.rss())


def workload(s3, n_objects: int, scratch: Path) -> None:
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="llm-pipeline")
            for o in page.get("Contents", [])]
    assert len(keys) == n_objects, (len(keys), n_objects)
    read = 0
    for k in keys:
        if read >= 1 << 30:
            break
        for chunk in s3.get_object(Bucket="llm-pipeline", Key=k)["Body"].iter_chunks(1 << 20):
            read += len(chunk)
    big = scratch / "upload.bin"
    with open(big, "wb") as f:
        f.write(os.urandom(256 << 20))
    from boto3.s3.transfer import TransferConfig

    s3.upload_file(str(big), "llm-pipeline", "checkpoints/run/key/new/__0_0.distcp",
                   Config=TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20))
    big.unlink()


def client(url: str):
    import boto3

    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="bench",
                        aws_secret_access_key="bench")


def _listed(s3) -> int:
    return sum(len(p.get("Contents", [])) for p in s3.get_paginator("list_objects_v2").paginate(Bucket="llm-pipeline"))


def ours(store: Path, n: int, scratch: Path) -> dict:
    """Two starts over the store: the first lists it with no ETags known yet (rclone hashes every file once and
    keeps the MD5s beside the store), the second is a restart, measured until every object is listed."""
    import psutil

    from pipelines.storage.s3 import launch_server  # what `python -m pipelines.storage.s3 start` runs

    out = {}
    for start in ("first", "restart"):
        t0 = time.monotonic()
        proc, url = launch_server(store, open(os.devnull, "wb"), auth=False, wait_s=120)
        answers = time.monotonic() - t0
        s3 = client(url)
        listed = _listed(s3)
        out[start] = {"answers_s": answers, "start_s": time.monotonic() - t0}
        ps = psutil.Process(proc.pid)
        after = ps.memory_info().rss
        try:
            if start == "restart":
                with Sampler(lambda: ps.memory_info().rss) as smp:
                    workload(s3, listed, scratch)
                s3.delete_object(Bucket="llm-pipeline", Key="checkpoints/run/key/new/__0_0.distcp")
        finally:
            proc.terminate()
            proc.wait(30)
    return {"start_s": out["restart"]["start_s"], "answers_s": out["restart"]["answers_s"],
            "first_listing_s": out["first"]["start_s"], "rss_after_start_mb": after / 2**20,
            "rss_peak_mb": smp.peak / 2**20, "objects": listed}


def anchor(store: Path, n: int, scratch: Path) -> dict:
    """moto's server with the old start: every stored object uploaded into it before it is ready."""
    import psutil
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import free_port

    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request would bury the table
    me = psutil.Process()
    base = me.memory_info().rss
    port = free_port()
    t0 = time.monotonic()
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    s3 = client(f"http://127.0.0.1:{port}")
    s3.create_bucket(Bucket="llm-pipeline")
    for f in sorted(p for p in (store / "llm-pipeline").rglob("*") if p.is_file()):
        s3.upload_file(str(f), "llm-pipeline", f.relative_to(store / "llm-pipeline").as_posix())
    start_s = time.monotonic() - t0
    after = me.memory_info().rss - base
    try:
        with Sampler(lambda: me.memory_info().rss - base) as smp:
            workload(s3, n, scratch)
    finally:
        srv.stop()
    return {"start_s": start_s, "rss_after_start_mb": after / 2**20, "rss_peak_mb": smp.peak / 2**20, "objects": n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-gb", default="0.85,10", help="store sizes to measure (GB, comma-separated)")
    ap.add_argument("--anchor-gb", default="0.85", help="the sizes at which moto is measured too")
    ap.add_argument("--work", default=str(ROOT / "var" / "bench" / "s3-endpoint"), help="scratch folder (removed)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    anchors = {float(x) for x in args.anchor_gb.split(",") if x}
    rows = []
    print(f"{'store':>8} {'objects':>8} {'server':<22} {'start s':>8} {'RSS start MB':>13} {'RSS peak MB':>12}"
          f" {'answers s':>10} {'1st listing s':>14}")
    for gb in (float(x) for x in args.sizes_gb.split(",")):
        shutil.rmtree(work, ignore_errors=True)
        store, scratch = work / "store", work / "scratch"
        scratch.mkdir(parents=True)
        n, size = fill(store, gb)
        for name, fn in (("rclone serve s3 (ours)", ours), ("moto, loaded (anchor)", anchor)):
            if fn is anchor and gb not in anchors:
                continue
            r = {"store_gb": size / 2**30, "server": name, **fn(store, n, scratch)}
            rows.append(r)
            print(f"{r['store_gb']:>7.2f}G {r['objects']:>8} {name:<22} {r['start_s']:>8.2f} "
                  f"{r['rss_after_start_mb']:>13.0f} {r['rss_peak_mb']:>12.0f}"
                  + (f" {r['answers_s']:>10.2f} {r['first_listing_s']:>14.2f}" if "answers_s" in r else ""), flush=True)
        ours_r = [r for r in rows if r["store_gb"] == size / 2**30 and "ours" in r["server"]][0]
        anc = [r for r in rows if r["store_gb"] == size / 2**30 and "anchor" in r["server"]]
        if anc:
            print(f"{'':>8} ratio ours/anchor: start {ours_r['start_s'] / anc[0]['start_s']:.3f}, "
                  f"peak RSS {ours_r['rss_peak_mb'] / max(anc[0]['rss_peak_mb'], 1):.3f}")
    shutil.rmtree(work, ignore_errors=True)
    out = ROOT / "var" / "bench" / "s3_endpoint.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
