"""Training throughput: our trainer (torchrun, loader, logging, checkpoints) vs a nanoGPT-style loop.

Same model config (the demo's Llama-style decoder unless overridden), same global batch, same
machine, one run. The minimal loop is what nanoGPT's ``train.py`` does per step on one process:
``get_batch`` from a memmap at random offsets, forward, backward, clip, AdamW step — no DDP, no
logging, no checkpoints. Ours is ``pipelines.train.launch`` end to end, with its steady-state
tokens/s (first 5 steps excluded, as for the loop); rows for 1 process × 2 threads and DDP 2 × 1.

    python benchmarks/train_bench.py [--tokenize-manifest M] [--steps 60] [--set model.d_model=128 ...]
    python benchmarks/train_bench.py --validation [--eval-every 10] [--repeats 3]   # what validation costs

M defaults to the newest tokenize manifest under var/runs (``make demo`` makes one). Writes
``var/bench/train.json`` with ``ratio`` = ours (1 process) ÷ the minimal loop.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def minimal_loop(spec, tok, steps: int, threads: int) -> float:
    """nanoGPT-style single-process loop over the same train shards; steady tokens/s."""
    import torch

    from pipelines.data.shards import Shard
    from pipelines.train.model import ModelArgs, Transformer

    torch.set_num_threads(threads)
    torch.manual_seed(spec.run.seed)
    shard = Shard.open(tok.dir / next(s["prefix"] for s in tok.extra["shards"] if s["split"] == "train"))
    data = np.asarray(shard.tokens)
    args = ModelArgs.from_spec(spec.model, tok.extra["vocab_size"])
    model = Transformer(args)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, betas=spec.train.betas,
                            weight_decay=spec.train.weight_decay)
    B, T = spec.global_batch, args.seq_len
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        ix = torch.randint(len(data) - T - 1, (B,))
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.detach().item()  # wait for the step, as nanoGPT does when it logs
        times.append(time.perf_counter() - t0)
    steady = times[5:] or times
    return B * T * len(steady) / sum(steady)


def validation_cost(spec_path: str, base: list[str], tok, every: int, repeats: int) -> dict:
    """DDP 2 × 1 without and with validation during training (train.eval_every), ``repeats`` runs of each, taken
    in turn (off, on, off, on …: drift of the machine falls on both): the step time (validation is outside it) and
    the wall time per step, validation included; the median of each."""
    from statistics import median

    from pipelines.spec import load_spec
    from pipelines.train import launch

    runs: dict[int, list[dict]] = {0: [], every: []}
    for _ in range(repeats):
        for e in runs:
            spec = load_spec(spec_path, base + ["launcher.nproc_per_node=2", "launcher.threads_per_proc=1",
                                                f"train.eval_every={e}"], env={})
            result = json.loads(launch.run(spec, tok).output("result").read_text())
            runs[e].append({"tokens_per_s": result["tokens_per_s"], "goodput": result["goodput_tokens_per_s"],
                            "evaluations": len(result.get("val") or [])})
    rows = [{"run": f"eval_every={e}" + (" (anchor)" if e == 0 else ""), "evaluations": rs[0]["evaluations"],
             "tokens_per_s": median(r["tokens_per_s"] for r in rs), "goodput": median(r["goodput"] for r in rs),
             "runs": rs} for e, rs in runs.items()]
    off, on = rows
    print(f"| DDP 2 × 1, median of {repeats} | evaluations | step tokens/s | wall tokens/s (validation included) | "
          "step ÷ anchor | wall ÷ anchor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['evaluations']} | {r['tokens_per_s']:,.0f} | {r['goodput']:,.0f} | "
              f"{r['tokens_per_s'] / off['tokens_per_s']:.3f} | {r['goodput'] / off['goodput']:.3f} |")
    return {"rows": rows, "step_ratio": on["tokens_per_s"] / off["tokens_per_s"],
            "wall_ratio": on["goodput"] / off["goodput"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenize-manifest", default=None)
    ap.add_argument("--spec", default=str(ROOT / "configs" / "demo.yaml"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=None, help="default var/bench/train.json (--validation: train_validation.json)")
    ap.add_argument("--validation", action="store_true", help="measure validation during training instead: "
                    "eval_every=0 against --eval-every")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="--validation: runs of each setting, taken in turn")
    args = ap.parse_args(argv)
    args.out = args.out or str(ROOT / "var" / "bench" / ("train_validation.json" if args.validation else "train.json"))

    from pipelines.manifest import atomic_write_text, load_manifest, newest_manifest
    from pipelines.spec import load_spec
    from pipelines.train import launch

    mpath = args.tokenize_manifest
    if mpath is None:
        found = newest_manifest(ROOT / "var" / "runs", "tokenize")
        if found is None:
            print("train_bench: no tokenize manifest under var/runs; run `make demo` first or pass "
                  "--tokenize-manifest", file=sys.stderr)
            return 2
        mpath = str(found)
    tok = load_manifest(mpath)
    base = [f"train.steps={args.steps}", f"train.ckpt_every={args.steps}", "run.root=var/bench/train-runs",
            "run.force=true", *args.overrides]
    if args.validation:
        result = validation_cost(args.spec, base, tok, args.eval_every, args.repeats)
        atomic_write_text(args.out, json.dumps(result, indent=2))
        print(f"written {args.out}")
        return 0
    rows = []
    layouts = [("ours, 1 process × 2 threads", ["launcher.nproc_per_node=1", "launcher.threads_per_proc=2",
                                                 "train.grad_accum=2"]),
               ("ours, DDP 2 processes × 1 thread", ["launcher.nproc_per_node=2", "launcher.threads_per_proc=1"])]
    spec = None
    for label, extra in layouts:
        spec = load_spec(args.spec, base + extra, env={})
        m = launch.run(spec, tok)
        rows.append({"trainer": label, "tokens_per_s": round(m.metrics["tokens_per_s"], 1),
                     "global_batch": spec.global_batch})
    one = load_spec(args.spec, base + layouts[0][1], env={})
    loop = minimal_loop(one, tok, args.steps, threads=2)
    rows.append({"trainer": "nanoGPT-style loop, 1 process × 2 threads", "tokens_per_s": round(loop, 1),
                 "global_batch": one.global_batch})
    result = {"model": one.model.model_dump(), "steps": args.steps, "rows": rows,
              "ratio": round(rows[0]["tokens_per_s"] / loop, 3), "machine": {"cpus": os.cpu_count()}}
    print(f"| trainer (global batch {one.global_batch} × seq {one.model.seq_len}) | tokens/s | ours ÷ loop |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['trainer']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / loop:.2f} |")
    atomic_write_text(args.out, json.dumps(result, indent=2))  # parents made, temp + rename
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
