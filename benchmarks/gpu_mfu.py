"""Our training step vs nanoGPT's real recipe on the same model, same process: tokens/s, MFU, peak memory.

Model: ``configs/gpu_350m.yaml`` (24 × 1024, GQA 16/4 heads, seq 2048, vocab 50,304, 369M params) unless
``--spec`` says otherwise. Every row trains the same ``pipelines.train.model.Transformer`` on random tokens
(MFU does not depend on the data) at the spec's micro batch:

* **ours**: the trainer's step as ``pipelines.train.trainer`` runs it on one device: ``apply_parallelism``
  (activation checkpointing / ``torch.compile`` from the spec, the head's loss a chunk of
  ``train.loss_chunk_tokens`` tokens at a time), bf16 autocast, fused AdamW with no decay on norms,
  DTensor-aware grad clipping, batches from a pinned-memory copy;
* **nanoGPT's recipe** (the anchor): what nanoGPT's ``train.py`` does by default, on our model: the whole model
  compiled (``compile = True``: ``torch.compile(model)``), the loss on the full logits (``F.cross_entropy``, as
  nanoGPT's ``GPT.forward``), bf16 autocast where the device has it (``dtype``), its
  ``configure_optimizers`` (decay on every parameter of 2 or more dimensions, none on the others; fused AdamW on
  CUDA), ``clip_grad_norm_(1.0)``, ``zero_grad(set_to_none=True)``;
* **eager** (``--eager-anchor``): the same without compile (the anchor this benchmark used before issue 53);
* **ours with KEY=VALUE** (``--variant KEY=VALUE``, repeatable, one row each): our step with one setting changed,
  e.g. ``train.loss_chunk_tokens=0`` (the full-logits loss): what that setting is worth. Not an anchor.

``ratio`` = our tokens/s ÷ the fastest anchor's (on a GPU, MFU ratio is the same number). nanoGPT's own ``GPT``
class is not run here: the workplace does not let developers commit code fetched from another repository, and its
``model.py`` is not on PyPI; the recipe row is its training loop on our model, at the same size.

MFU = tokens/s × (6N + 12·L·H·d_head·T) FLOPs/token ÷ the detected GPU's dense bf16 peak
(``pipelines.train.plan``: H100 SXM 989 TFLOP/s). Steady state: the first ``--warmup`` steps (compile,
allocator) are excluded; every row starts from a clean slate (no compiled graph or cached memory of the row before;
peak memory reset). Each row is printed and ``var/bench/gpu_mfu.json`` rewritten as soon as it is measured
(``"complete": false`` until the last), so a step cap that kills the run keeps the rows before it. A row that fails
(out of memory, a compile error) is an ``error`` row, the others still run, and the exit status is 1.

``--rounds N`` measures every row N times, odd rounds in the order asked and even ones reversed (ABBA), each row
rebuilt from a clean slate every time: a row's figures are then its medians (``rounds_tokens_per_s``: each round's),
and ``ratio`` is the median of ours ÷ the fastest anchor (by its median) in each round (``ratio_rounds``), so that
a host whose speed drifts during the run (2 shared CPU cores: ±20 % between rows timed a minute apart) weighs on ours
and the anchor alike. A row that fails in any round is an error row (``failed_in_round``).

    python benchmarks/gpu_mfu.py [--spec configs/gpu_350m.yaml] [--steps 30] [--set train.micro_batch=4]
    python benchmarks/gpu_mfu.py --device cpu --set …   # the same rows on CPU (fp32 unless the spec says bf16)
    python benchmarks/gpu_mfu.py --device cpu --rounds 3 --set …   # … three rounds, ABBA: the ratio's median
    python benchmarks/gpu_mfu.py --variant train.loss_chunk_tokens=0   # + a row of ours with that setting
    python benchmarks/gpu_mfu.py --no-compile           # torch.compile unusable: ours and the recipe both eager
    python benchmarks/gpu_mfu.py --cpu-smoke            # a tiny config on CPU: checks the script

Without a CUDA device (and without ``--device cpu`` or ``--cpu-smoke``) it says so and exits 2, writing nothing.
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


ONE_PROCESS = ["launcher.nproc_per_node=1", "parallel.dp_shard=1", "parallel.dp_replicate=1"]


def no_cuda(args, prog: str) -> bool:
    """True, having said so, when the rows are to run on a GPU (not ``--device cpu`` / ``--cpu-smoke``) and there is
    none."""
    import torch

    if torch.cuda.is_available() or args.cpu_smoke or args.device == "cpu":
        return False
    print(f"{prog}: no CUDA device here; run it on a GPU machine (or --device cpu / --cpu-smoke)", file=sys.stderr)
    return True


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


def ours_step(spec, device):
    """Our trainer's step on one device: (step function, mode, tokens per step)."""
    import torch

    from pipelines.train.model import ModelArgs, Transformer
    from pipelines.train.parallel import apply_parallelism, clip_grad_norm
    from pipelines.train.trainer import optimizer

    torch.manual_seed(spec.run.seed)
    args = ModelArgs.from_spec(spec.model, spec.model.vocab_size or spec.tokenizer.vocab_size)
    model, mode = apply_parallelism(Transformer(args).to(device), spec, device)
    t = spec.train
    opt = optimizer(model, spec)
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

    return step, mode, t.micro_batch * t.grad_accum * args.seq_len


def recipe_step(spec, device, compile_model: bool = True):
    """nanoGPT's ``train.py`` defaults on our model: ``torch.compile(model)``, its ``configure_optimizers`` (decay on
    parameters of 2+ dimensions), fused AdamW on CUDA, autocast to the spec's dtype, ``clip_grad_norm_``."""
    import torch

    from pipelines.train.model import ModelArgs, Transformer

    torch.manual_seed(spec.run.seed)
    args = ModelArgs.from_spec(spec.model, spec.model.vocab_size or spec.tokenizer.vocab_size)
    model = Transformer(args).to(device)
    t = spec.train
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, fused=device.type == "cuda")
    if compile_model:
        model = torch.compile(model)
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

    return step, "compiled" if compile_model else "eager", t.micro_batch * t.grad_accum * args.seq_len


def eager_step(spec, device):
    return recipe_step(spec, device, compile_model=False)


def _timed(build, spec, device, steps: int, warmup: int) -> dict:
    t0 = time.perf_counter()
    step, mode, tokens = build(spec, device)
    times = timed_steps(step, steps, warmup, device)
    # build + warm-up (the compile): what a row costs before its timed steps, to size gpu_checks.sh's budget
    return {"times": times, "mode": mode, "tokens_per_step": tokens,
            "warmup_s": time.perf_counter() - t0 - sum(times)}


def ours(spec, device, steps: int, warmup: int) -> dict:
    """Our step timed: ``{"times": [...], "tokens_per_step": N, "mode": …}``."""
    return _timed(ours_step, spec, device, steps, warmup)


def nanogpt_recipe(spec, device, steps: int, warmup: int) -> dict:
    return _timed(recipe_step, spec, device, steps, warmup)


def eager(spec, device, steps: int, warmup: int) -> dict:
    return _timed(eager_step, spec, device, steps, warmup)


def profile(build, spec, device, warmup: int, out: Path, label: str, top: int = 15) -> str:
    """Where one step's time goes: ``warmup`` steps, then 3 under ``torch.profiler`` (CPU, and CUDA on a GPU);
    the table of the ops with the most self time is written to ``out`` and returned."""
    import torch
    from torch.profiler import ProfilerActivity

    step, _, _ = build(spec, device)
    for _ in range(warmup):
        step()
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            step()
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=top)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"{label}: 3 steps after {warmup} of warm-up, sorted by {key}\n{table}\n")
    return table


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(ROOT / "configs" / "gpu_350m.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the rows run (default cuda)")
    ap.add_argument("--cpu-smoke", action="store_true", help="Tiny config on CPU: exercise the script, no MFU.")
    ap.add_argument("--eager-anchor", action="store_true", help="Also the recipe without compile (eager).")
    ap.add_argument("--no-compile", action="store_true", help="Where torch.compile fails or is too slow: ours with "
                    "parallel.compile=false and nanoGPT's recipe eager (so labelled), no row compiles.")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                    help="Also our step with this setting changed (one row each; not an anchor).")
    ap.add_argument("--profile", metavar="DIR", help="Also profile 3 steps of each row (torch.profiler): a table of "
                    "the ops with the most self time per row, printed and written under DIR.")
    ap.add_argument("--rounds", type=_positive, default=1, help="Measure every row N times, alternating the "
                    "order (ABBA); a row's figures are its medians and the ratio the median of the rounds' own "
                    "(default 1; use 3 or more where the host's speed drifts, e.g. a shared CPU).")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "gpu_mfu.json"))
    return ap.parse_args(argv)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {n}")
    return n


def row_builds(args, spec_with) -> list[tuple[str, object, object, str]]:
    """(label, step builder, its spec, kind: ours / anchor / variant) of every row asked for, ours first; every
    spec is loaded (and checked) here."""
    spec = spec_with([])
    if args.no_compile:  # nothing compiles: the recipe's row is eager, and says so
        return [("ours (trainer step)", ours_step, spec, "ours"),
                ("nanoGPT recipe, eager (--no-compile)", eager_step, spec, "anchor")] + [
            (f"ours with {kv}", ours_step, spec_with([kv]), "variant") for kv in args.variant]
    rows = [("ours (trainer step)", ours_step, spec, "ours"),
            ("nanoGPT recipe (torch.compile(model))", recipe_step, spec, "anchor")]
    if args.eager_anchor:
        rows.append(("eager (no compile)", eager_step, spec, "anchor"))
    return rows + [(f"ours with {kv}", ours_step, spec_with([kv]), "variant") for kv in args.variant]


def spec_flops(spec) -> tuple[dict, int]:
    """(parameter counts, FLOPs per token) of a spec's model: each row's MFU uses its own (a ``model.*`` variant
    is another model)."""
    from pipelines.train.plan import flops_per_token, model_shape, param_count

    shape = model_shape(spec)
    params = param_count(shape)
    return params, flops_per_token(shape, params)


def measure(builds, device, name: str, args, profile_dir: str | None = None):
    """Each row as it is measured (a generator: the caller prints and writes it at once, so that a row that fails
    or a step cap that kills the process later loses none before it). A row that raises (out of memory, a compile
    that fails) is an ``error`` row; the next row still runs. ``profile_dir``: also profile ours and the anchors
    there."""
    import gc

    import torch

    for label, build, spec, kind in builds:
        # every row from a clean slate: no compiled graph, cached block or tensor of the row before counts here
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = {"impl": label, "anchor": kind == "anchor", "loss_chunk_tokens": spec.train.loss_chunk_tokens}
        try:
            yield {**base, **_row(label, build, spec, device, name, kind, args, profile_dir)}
        except Exception as e:  # noqa: BLE001 - the row failed; it says why and the others still run
            yield {**base, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}


def _row(label: str, build, spec, device, name: str, kind: str, args, profile_dir: str | None) -> dict:
    import torch

    from pipelines.train.plan import mfu

    fpt = spec_flops(spec)[1]
    r = _timed(build, spec, device, args.steps, args.warmup)
    if profile_dir and kind != "variant":  # where the time goes: ours and the anchors
        where = Path(profile_dir) / f"{r['mode']}-{label.split(' ')[0]}.txt"
        try:  # a profiler that fails (CUPTI) costs its table, not the row measured
            print(profile(build, spec, device, args.warmup, where, label))
        except Exception as e:  # noqa: BLE001 - said, the row stands
            print(f"gpu_mfu: no profile of {label}: {type(e).__name__}: {e}", file=sys.stderr)
    tps = r["tokens_per_step"] * len(r["times"]) / sum(r["times"])
    u = mfu(tps, fpt, 1, name, spec.train.dtype) if device.type == "cuda" else None
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"tokens_per_s": tps, "mfu": u, "step_ms": 1e3 * sum(r["times"]) / len(r["times"]), "mode": r["mode"],
            "peak_mem_gib": mem, "warmup_s": r["warmup_s"], "flops_per_token": fpt}


HEADER = ("| impl | tokens/s | step ms | MFU | peak mem GiB | vs the fastest anchor | build + warm-up s |\n"
          "|---|---|---|---|---|---|---|")


def row_line(r: dict, best: float | None) -> str:
    """One row of the table (``best``: the fastest anchor's tokens/s, None while no anchor is measured)."""
    if "error" in r:
        return f"| {r['impl']} | failed: {r['error']} | | | | | |"
    mfu_s = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "— (CPU)"
    mem_s = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "—"
    vs = f"{r['tokens_per_s'] / best:.3f}" if best else "—"
    return (f"| {r['impl']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {mfu_s} | {mem_s} | {vs} | "
            f"{r['warmup_s']:.0f} |")


def combine(rounds: list[list[dict | None]]) -> list[dict]:
    """One row per row asked for (in the order asked), over the rounds measured so far (``None``: not yet measured
    in that round): the median tokens/s, step time and MFU, the largest peak memory and build + warm-up, and
    ``rounds_tokens_per_s``; a row that failed in any round is that round's error row (``failed_in_round``, with
    the figures of the rounds where it ran)."""
    from statistics import median

    if len(rounds) == 1:
        return [r for r in rounds[0] if r is not None]
    rows = []
    for got in zip(*rounds):
        ran = [r for r in got if r is not None and "error" not in r]
        each = {"rounds_tokens_per_s": [r["tokens_per_s"] for r in ran]}
        failed = next(((k, r) for k, r in enumerate(got) if r is not None and "error" in r), None)
        if failed:
            rows.append({**failed[1], "failed_in_round": failed[0] + 1, **each})
        elif ran:
            rows.append({**ran[0], **{k: _over(median, ran, k) for k in ("tokens_per_s", "step_ms", "mfu")},
                         **{k: _over(max, ran, k) for k in ("peak_mem_gib", "warmup_s")}, **each})
    return rows


def _over(how, rows: list[dict], key: str):
    """``how`` (median, max) of ``key`` over the rows that have a figure for it; None where none has."""
    got = [r[key] for r in rows if r[key] is not None]
    return how(got) if got else None


def paired_ratios(rounds: list[list[dict | None]], anchor: str) -> list[float]:
    """Ours ÷ the anchor named ``anchor`` in each round where both ran (a round measured in part counts once both
    have): rows timed a minute apart, not the host's state at either end of the run."""
    out = []
    for rd in rounds:
        mine, theirs = rd[0], next((r for r in rd if r is not None and r["impl"] == anchor), None)
        if mine is not None and theirs is not None and "error" not in mine and "error" not in theirs:
            out.append(mine["tokens_per_s"] / theirs["tokens_per_s"])
    return out


def summarise(head: dict, rows: list[dict], complete: bool, rounds: list[list[dict | None]] | None = None) -> dict:
    """The result so far: ``head`` (the config) with ``rows``, the fastest anchor measured and the ratio (None while
    ours or every anchor is missing or failed); ``complete`` once every row asked for has run. Over more than one
    of ``rounds`` (``rows`` = ``combine(rounds)``) the ratio is the median of ours ÷ that anchor in each round
    (``ratio_rounds``): rows timed in the same round, so a host that drifts between rounds weighs on both."""
    from statistics import median

    ok = [r for r in rows if "error" not in r]
    anchor = max((r for r in ok if r["anchor"]), key=lambda r: r["tokens_per_s"], default=None)
    mine = rows[0] if rows and "error" not in rows[0] else None
    ratio = mine["tokens_per_s"] / anchor["tokens_per_s"] if mine and anchor else None
    result = {**head, "rows": rows, "complete": complete, "anchor": anchor["impl"] if anchor else None,
              "ratio": ratio,
              "ratio_of": f"tokens/s ours ÷ {anchor['impl']} (the fastest anchor)" if anchor else None}
    if rounds and len(rounds) > 1:
        paired = paired_ratios(rounds, anchor["impl"]) if ratio is not None else []
        result["ratio_rounds"] = paired
        if paired:
            result["ratio"] = median(paired)
            result["ratio_of"] = (f"median over {len(paired)} rounds of tokens/s ours ÷ {anchor['impl']} (the "
                                  "fastest anchor) in the same round")
    return result


def report(result: dict) -> None:
    print(f"gpu_mfu: {result['device']}, {result['params'] / 1e6:,.1f}M params, "
          f"{result['flops_per_token'] / 1e9:.3f} GFLOP/token, batch {result['micro_batch']} × {result['seq_len']}, "
          f"{result['dtype']}, torch {result['torch']}")
    print(HEADER)
    best = max((r["tokens_per_s"] for r in result["rows"] if r["anchor"] and "error" not in r), default=None)
    for r in result["rows"]:
        print(row_line(r, best))
    if result["ratio"] is not None:
        print(f"ratio ({result['ratio_of']}): {result['ratio']:.3f}")
        if result.get("ratio_rounds"):
            print("ratio per round: " + ", ".join(f"{r:.3f}" for r in result["ratio_rounds"]) + " (the table's "
                  "column: each row's median ÷ the anchor's median, which a drifting host can move apart)")
    else:
        print("ratio: none (ours or every anchor failed)")


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)

    import torch

    from pipelines.spec import SpecError, load_spec

    if no_cuda(args, "gpu_mfu"):
        return 2
    on_cpu = args.cpu_smoke or args.device == "cpu"
    overrides = (SMOKE if args.cpu_smoke else []) + args.overrides + (
        ["parallel.compile=false"] if args.no_compile else [])

    def spec_with(extra: list[str]):
        return load_spec(args.spec, overrides + extra + ONE_PROCESS, env={})

    try:  # a spec or a variant that does not hold says so before anything runs
        builds = row_builds(args, spec_with)
    except SpecError as e:
        print(f"gpu_mfu: {e}", file=sys.stderr)
        return 2
    device = torch.device("cpu") if on_cpu else torch.device("cuda:0")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    head = config_of(builds[0][2], device, args, overrides)
    out = Path(args.out)
    rounds = measure_rounds(builds, device, head, args, out)
    rows = combine(rounds)
    result = summarise(head, rows, complete=True, rounds=rounds)
    report(result)
    print(f"wrote {out}")
    failed = [r["impl"] for r in rows if "error" in r]
    if failed:
        print(f"gpu_mfu: {len(failed)} row(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def measure_rounds(builds, device, head: dict, args, out: Path) -> list[list[dict | None]]:
    """Every row, ``args.rounds`` times: odd rounds in the order asked, even ones reversed (ABBA: a host that
    speeds up or slows down during the run weighs alike on ours and the anchors); profiles only in the first.
    Each row is printed and ``out`` rewritten as soon as it is measured. Returns the rounds, rows in the order
    asked."""
    n = len(builds)
    rounds: list[list[dict | None]] = []
    for k in range(args.rounds):
        order = list(range(n)) if k % 2 == 0 else list(range(n - 1, -1, -1))
        rounds.append([None] * n)
        got = measure([builds[i] for i in order], device, head["device"], args, args.profile if k == 0 else None)
        for j, (i, r) in enumerate(zip(order, got)):
            rounds[-1][i] = r
            where = f"round {k + 1}/{args.rounds}, row {j + 1}/{n}" if args.rounds > 1 else f"row {j + 1}/{n}"
            print(f"gpu_mfu: {where}: " + row_line(r, None), flush=True)
            last = k == args.rounds - 1 and j == n - 1
            write(out, summarise(head, combine(rounds), complete=last, rounds=rounds))  # kept at once
    return rounds


def config_of(spec, device, args, overrides: list[str]) -> dict:
    """What the rows measured (ours' spec as given): the fields ``trainer_gpu.py`` matches a step figure on."""
    import torch

    from pipelines.train.plan import peak_flops

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    params, fpt = spec_flops(spec)
    return {"device": name, "device_type": device.type,
            "peak_flops": peak_flops(name, spec.train.dtype) if device.type == "cuda" else None,
            "spec": args.spec, "overrides": overrides, "params": params["total"], "flops_per_token": fpt,
            "micro_batch": spec.train.micro_batch, "seq_len": spec.model.seq_len, "dtype": spec.train.dtype,
            "compile": spec.parallel.compile, "activation_checkpointing": spec.parallel.activation_checkpointing,
            "loss_chunk_tokens": spec.train.loss_chunk_tokens, "steps": args.steps, "warmup": args.warmup,
            "rounds": args.rounds, "torch": torch.__version__}


def write(out: Path, result: dict) -> None:
    from pipelines.manifest import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
