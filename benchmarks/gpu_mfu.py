"""MFU on one GPU: our training step vs a nanoGPT-style step on the same ~350M model, same run.

Model: ``configs/gpu_350m.yaml`` (24 × 1024, GQA 16/4 heads, seq 2048, vocab 50,304, 369M params) unless
``--spec`` says otherwise. Both sides train the same ``pipelines.train.model.Transformer`` on random tokens
(MFU does not depend on the data) at the spec's micro batch:

* **ours**: the trainer's step as ``pipelines.train.trainer`` runs it on one GPU: ``apply_parallelism``
  (activation checkpointing / ``torch.compile`` per block from the spec), bf16 autocast, fused AdamW with
  no decay on norms, DTensor-aware grad clipping, batches from a pinned-memory copy;
* **anchor (nanoGPT-style)**: the same model, plain ``torch.autocast(bf16)``, ``torch.optim.AdamW``
  (fused, as nanoGPT picks on CUDA), ``clip_grad_norm_``, no per-block compile.

MFU = tokens/s × (6N + 12·L·H·d_head·T) FLOPs/token ÷ the detected GPU's dense bf16 peak
(``pipelines.train.plan``: H100 SXM 989 TFLOP/s). Steady state: the first ``--warmup`` steps (compile,
allocator) are excluded. Writes ``var/bench/gpu_mfu.json`` with ``ratio`` = our MFU ÷ the anchor's.

    python benchmarks/gpu_mfu.py [--spec configs/gpu_350m.yaml] [--steps 30] [--set train.micro_batch=4]
    python benchmarks/gpu_mfu.py --cpu-smoke   # a tiny config on CPU: checks the script, no MFU

Without a CUDA device (and without ``--cpu-smoke``) it says so and exits 2, writing nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOKE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.seq_len=64",
         "model.vocab_size=512", "tokenizer.vocab_size=512", "train.micro_batch=2", "parallel.compile=false",
         "train.dtype=fp32"]


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, steps: int, warmup: int, device) -> list[float]:
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def ours(spec, device, steps: int, warmup: int) -> dict:
    import torch

    from pipelines.train.model import ModelArgs, Transformer
    from pipelines.train.parallel import apply_parallelism, clip_grad_norm
    from pipelines.train.trainer import param_groups

    torch.manual_seed(spec.run.seed)
    args = ModelArgs.from_spec(spec.model, spec.model.vocab_size or spec.tokenizer.vocab_size)
    model, mode = apply_parallelism(Transformer(args).to(device), spec, device)
    t = spec.train
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=t.betas, fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.dtype == "bf16")
    batch = torch.randint(0, args.vocab_size, (t.micro_batch, args.seq_len + 1))
    if device.type == "cuda":
        batch = batch.pin_memory()

    def step():
        for _ in range(t.grad_accum):
            xy = batch.to(device, non_blocking=True)
            with autocast:
                loss = model(xy[:, :-1], xy[:, 1:]) / t.grad_accum
            loss.backward()
        clip_grad_norm(model, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"times": timed_steps(step, steps, warmup, device), "mode": mode,
            "tokens_per_step": t.micro_batch * t.grad_accum * args.seq_len}


def nanogpt_style(spec, device, steps: int, warmup: int) -> dict:
    import torch

    from pipelines.train.model import ModelArgs, Transformer

    torch.manual_seed(spec.run.seed)
    args = ModelArgs.from_spec(spec.model, spec.model.vocab_size or spec.tokenizer.vocab_size)
    model = Transformer(args).to(device)
    t = spec.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay,
                            fused=device.type == "cuda")
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.dtype == "bf16")
    x = torch.randint(0, args.vocab_size, (t.micro_batch, args.seq_len + 1), device=device)

    def step():
        for _ in range(t.grad_accum):
            with ctx:
                loss = model(x[:, :-1], x[:, 1:]) / t.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"times": timed_steps(step, steps, warmup, device), "mode": "single",
            "tokens_per_step": t.micro_batch * t.grad_accum * args.seq_len}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(ROOT / "configs" / "gpu_350m.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--cpu-smoke", action="store_true", help="Tiny config on CPU: exercise the script, no MFU.")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "gpu_mfu.json"))
    args = ap.parse_args(argv)

    import torch

    from pipelines.manifest import atomic_write_text
    from pipelines.spec import load_spec
    from pipelines.train.plan import flops_per_token, mfu, model_shape, param_count, peak_flops

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("gpu_mfu: no CUDA device here; run it on a GPU machine (or --cpu-smoke to check the script)",
              file=sys.stderr)
        return 2
    overrides = (SMOKE if args.cpu_smoke else []) + args.overrides
    spec = load_spec(args.spec, overrides + ["launcher.nproc_per_node=1", "parallel.dp_shard=1",
                                             "parallel.dp_replicate=1"], env={})
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda:0")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shape = model_shape(spec)
    params = param_count(shape)
    fpt = flops_per_token(shape, params)

    rows = []
    for label, fn in (("ours (trainer step)", ours), ("nanoGPT-style step", nanogpt_style)):
        r = fn(spec, device, args.steps, args.warmup)
        tps = r["tokens_per_step"] * len(r["times"]) / sum(r["times"])
        u = mfu(tps, fpt, 1, name, spec.train.dtype) if device.type == "cuda" else None
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        rows.append({"impl": label, "tokens_per_s": tps, "mfu": u, "step_ms": 1e3 * sum(r["times"]) / len(r["times"]),
                     "mode": r["mode"], "peak_mem_gib": mem})
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    ratio = rows[0]["mfu"] / rows[1]["mfu"] if rows[0]["mfu"] and rows[1]["mfu"] else \
        rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    result = {"device": name, "peak_flops": peak_flops(name, spec.train.dtype) if device.type == "cuda" else None,
              "spec": args.spec, "overrides": overrides, "params": params["total"], "flops_per_token": fpt,
              "micro_batch": spec.train.micro_batch, "seq_len": spec.model.seq_len, "dtype": spec.train.dtype,
              "compile": spec.parallel.compile, "activation_checkpointing": spec.parallel.activation_checkpointing,
              "steps": args.steps, "warmup": args.warmup, "rows": rows, "ratio": ratio,
              "ratio_of": "MFU ours ÷ nanoGPT-style" if device.type == "cuda" else "tokens/s ours ÷ nanoGPT-style (CPU)",
              "torch": torch.__version__}
    print(f"gpu_mfu: {name}, {params['total'] / 1e6:,.0f}M params, {fpt / 1e9:.2f} GFLOP/token, "
          f"batch {spec.train.micro_batch} × {spec.model.seq_len}, {spec.train.dtype}")
    print(f"| impl | tokens/s | step ms | MFU | peak mem GiB |\n|---|---|---|---|---|")
    for r in rows:
        mfu_s = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "— (CPU)"
        mem_s = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "—"
        print(f"| {r['impl']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {mfu_s} | {mem_s} |")
    print(f"ratio ({result['ratio_of']}): {ratio:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
