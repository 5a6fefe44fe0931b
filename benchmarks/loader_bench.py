"""Loader throughput: our deterministic DP-sliced loader vs nanoGPT's ``get_batch``, same shards, same run.

Both read ``uint16`` token shards through ``np.memmap`` and build (inputs, targets) int64 tensors of
``batch × seq_len``. nanoGPT (karpathy/nanoGPT ``train.py``) re-opens the memmap every call and takes
random offsets anywhere in one file; ours walks a seeded global permutation of fixed sample slots
over all shards, sliced per DP rank (the price of determinism and exact resumption). The table also
puts both beside the rate the last local training run (e.g. ``make demo``) consumed tokens at.

    python benchmarks/loader_bench.py [--tokens 50000000] [--seq-len 1024] [--batch 16] [--seconds 5]

Writes ``var/bench/loader.json`` with ``ratio`` = ours ÷ nanoGPT samples/s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.data.shards import ShardWriter  # noqa: E402
from pipelines.manifest import atomic_write_text  # noqa: E402
from pipelines.train.loader import DPSampler, TokenSamples, batch_tensors  # noqa: E402


def make_shards(d: Path, tokens: int, n_shards: int = 4, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    prefixes = []
    for s in range(n_shards):
        w = ShardWriter(d / f"train-{s:05d}", np.uint16)
        left = tokens // n_shards
        while left > 0:
            n = int(min(left, rng.integers(200, 4000)))
            w.add(rng.integers(0, 32000, n, dtype=np.uint16))
            left -= n
        w.close()
        prefixes.append(d / f"train-{s:05d}")
    return prefixes


def nanogpt_get_batch(path: Path, batch: int, seq_len: int):
    # verbatim in spirit from nanoGPT train.py: new memmap per batch, random offsets
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - seq_len, (batch,))
    x = torch.stack([torch.from_numpy((data[i:i + seq_len]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + seq_len]).astype(np.int64)) for i in ix])
    return x, y


def rate(fn, seconds: float, batch: int) -> float:
    fn()  # warm the page cache path once
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += batch
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=50_000_000)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16, help="Sequences per rank per batch.")
    ap.add_argument("--dp", type=int, default=8, help="DP size our loader slices the global batch for.")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "loader.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        prefixes = make_shards(Path(d), args.tokens)
        samples = TokenSamples(prefixes, args.seq_len)
        sampler = DPSampler(len(samples), args.batch * args.dp, dp_rank=3, dp_size=args.dp, seed=1)
        ours = rate(lambda: batch_tensors(samples, sampler.next_local()), args.seconds, args.batch)
        bin0 = prefixes[0].with_suffix(".bin")
        nano = rate(lambda: nanogpt_get_batch(bin0, args.batch, args.seq_len), args.seconds, args.batch)
    demo_tps = None
    runs = sorted((ROOT / "var" / "runs" / "train").glob("*/result.json"), key=os.path.getmtime)
    if runs:
        demo = json.loads(runs[-1].read_text())
        demo_tps = demo["tokens_per_s"]
    rows = [{"loader": "ours (DPSampler + batch_tensors, rank 3 of 8)", "samples_per_s": round(ours, 1)},
            {"loader": "nanoGPT get_batch (memmap + random offsets)", "samples_per_s": round(nano, 1)}]
    result = {"tokens": args.tokens, "seq_len": args.seq_len, "batch": args.batch, "rows": rows,
              "ratio": round(ours / nano, 3), "machine": {"cpus": os.cpu_count()}}
    print(f"| loader | samples/s (seq {args.seq_len}, batch {args.batch}) | ours ÷ it |")
    print("|---|---|---|")
    print(f"| {rows[0]['loader']} | {ours:,.0f} | — |")
    print(f"| {rows[1]['loader']} | {nano:,.0f} | {ours / nano:.2f} |")
    if demo_tps:  # compare in tokens/s: the demo trains at another seq_len
        need = demo_tps / args.seq_len
        result["trainer_tokens_per_s"] = round(demo_tps, 1)
        result["headroom_vs_trainer"] = round(ours * args.seq_len / demo_tps, 1)
        print(f"| last local training run's consumption ({demo_tps:,.0f} tokens/s) | {need:,.1f} | "
              f"{ours / need:,.0f} |")
    atomic_write_text(args.out, json.dumps(result, indent=2))  # parents made, temp + rename
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
