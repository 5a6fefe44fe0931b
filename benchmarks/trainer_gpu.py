"""The whole trainer against its own step: what the loader, logging, MLflow and async checkpoints cost on a GPU.

Runs ``pipelines.train.trainer`` end to end (``pipelines.train.launch``: torchrun, tokenized shards, the prefetching
loader, checkpoints every ``--every`` steps promoted L0 → L1, validation every ``--every`` steps, MLflow logging to
the spec's tracking store) on ``configs/gpu_350m.yaml`` unless ``--spec`` says otherwise, then the step benchmark
(``benchmarks/gpu_mfu.py``'s ``ours``: the same step on random tokens, nothing around it) on the same config — or
takes that figure from ``--step-json`` (a ``gpu_mfu.json`` of the same session and config) instead of measuring
it again. The row:

* the trainer's **step** rate (``tokens_per_s``: steady steps, loader wait, clipping and optimizer included);
* its **steady wall** rate (``steady_wall_tokens_per_s``: after the first 5 steps, everything but validation —
  logging, MLflow, checkpoint stalls, the background saves and promotions competing for the machine);
* the same less the **save stalls** in that window (``steady_wall_less_stalls_tokens_per_s``: the seconds each
  checkpoint blocked training taken out, whatever runs in the background left in). A stall's share of the wall is
  set by the cadence: the bench saves every ``--every`` steps, a real run every ``train.ckpt_every`` (Young/Daly:
  hours apart); the stall itself has its own benchmark and target (``ckpt_bench.py --only stall``);
* its **goodput** (the whole fit's wall rate: compile, validation and all);
* ``ratio`` = steady wall per process ÷ the step benchmark (one process; data parallel: every process trains
  the step's batch; issue 53 asks ≥ 0.95 on a GPU), and ``ratio_less_stalls`` the same without the save stalls.

    python benchmarks/trainer_gpu.py --tokenize-manifest M [--steps 60] [--every 20] [--step-json J] [--set k=v]
    python benchmarks/trainer_gpu.py --cpu-smoke --tokenize-manifest M    # a tiny config on CPU: checks the script

``M`` defaults to ``.gpu/tokenize/manifest.json`` (``make gpu-bundle`` puts a tokenized corpus there for the device
machine, which has no Spark), else the newest under ``var/runs``. Writes ``var/bench/trainer_gpu.json``. Without a
CUDA device (and without ``--device cpu`` or ``--cpu-smoke``) it says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_mfu  # noqa: E402  (benchmarks/, beside this file)

BUNDLED = ROOT / ".gpu" / "tokenize" / "manifest.json"
# what makes a gpu_mfu.json the same config (a CPU figure, another loss or recompute setting is another step)
MATCH = ("params", "micro_batch", "seq_len", "dtype", "compile", "device_type", "loss_chunk_tokens",
         "activation_checkpointing")


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(ROOT / "configs" / "gpu_350m.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--tokenize-manifest", default=None, help="default .gpu/tokenize, else the newest under var/runs")
    ap.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    ap.add_argument("--every", type=int, default=20, help="a checkpoint and a validation every N steps (default 20)")
    ap.add_argument("--step-json", default=None, help="take the step benchmark from this gpu_mfu.json (same config)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--cpu-smoke", action="store_true", help="Tiny config on CPU: exercise the script.")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "trainer_gpu.json"))
    return ap.parse_args(argv)


def tokenize_manifest(given: str | None) -> str | None:
    if given:
        return given
    if BUNDLED.is_file():
        return str(BUNDLED)
    from pipelines.manifest import newest_manifest

    found = newest_manifest(ROOT / "var" / "runs", "tokenize")
    return str(found) if found else None


def step_figure(path: str | None, want: dict, run_bench) -> tuple[float, str]:
    """(tokens/s of the step benchmark, where it came from): ``ours`` of ``path`` when it measured this config,
    else measured now by ``run_bench()``."""
    if path and Path(path).is_file():
        got = json.loads(Path(path).read_text())
        same = all(got.get(k) == want[k] for k in MATCH)
        ours = next((r for r in got.get("rows", []) if r.get("impl", "").startswith("ours (") and "error" not in r),
                    None)
        if same and ours:
            rounds = f", the median of {got['rounds']} rounds" if (got.get("rounds") or 1) > 1 else ""
            return ours["tokens_per_s"], f"{path} (ours, {got.get('steps')} steps{rounds})"
        print(f"trainer_gpu: {path} measured another config "
              f"({ {k: got.get(k) for k in MATCH} } vs { {k: want[k] for k in MATCH} }); measuring the step here")
    return run_bench(), "measured here after the trainer"


def specs(args, vocab_of_corpus: int):
    """(the trainer's spec, the step benchmark's: the same model on one process, its vocabulary made explicit)."""
    from pipelines.spec import load_spec

    smoke = [s for s in gpu_mfu.SMOKE if "vocab_size" not in s] + ["model.vocab_size=null"]  # the corpus's vocab
    sets = (smoke if args.cpu_smoke else []) + args.overrides + [
        f"train.steps={args.steps}", f"train.ckpt_every={args.every}", f"train.eval_every={args.every}",
        # a lineage of its own, started afresh (not a resume of an interrupted earlier run: the rates would be of fewer
        # steps)
        "run.name=bench-trainer-gpu", "run.root=var/bench/trainer-gpu", "run.force=true", "train.resume=never"]
    spec = load_spec(args.spec, sets, env={})
    vocab = spec.model.vocab_size or vocab_of_corpus  # the trainer's model, whatever the spec leaves open
    return spec, load_spec(args.spec, sets + [f"model.vocab_size={vocab}", *gpu_mfu.ONE_PROCESS], env={})


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)

    import torch

    from pipelines.manifest import atomic_write_text
    from pipelines.train.plan import model_shape, param_count

    if gpu_mfu.no_cuda(args, "trainer_gpu"):
        return 2
    mpath = tokenize_manifest(args.tokenize_manifest)
    if args.steps <= 5 or args.every < 1 or mpath is None or Path(args.out).is_dir():
        print("trainer_gpu: --steps must be more than 5 (the warm-up steps), --every at least 1 and --out a file, with "
              "a tokenized corpus (--tokenize-manifest, `make gpu-bundle` or `make demo`)", file=sys.stderr)
        return 2
    on_cpu = args.cpu_smoke or args.device == "cpu"
    ran = run_trainer(args, mpath, on_cpu)
    if isinstance(ran, int):
        return ran
    res, spec, bench_spec = ran
    device = torch.device("cpu") if on_cpu else torch.device("cuda:0")

    def run_bench() -> float:
        r = gpu_mfu.ours(bench_spec, device, steps=min(30, args.steps), warmup=5)
        return r["tokens_per_step"] * len(r["times"]) / sum(r["times"])

    want = {"params": param_count(model_shape(bench_spec))["total"], "micro_batch": spec.train.micro_batch,
            "seq_len": spec.model.seq_len, "dtype": spec.train.dtype, "compile": spec.parallel.compile,
            "device_type": device.type, "loss_chunk_tokens": spec.train.loss_chunk_tokens,
            "activation_checkpointing": spec.parallel.activation_checkpointing}
    bench, source = step_figure(None if args.cpu_smoke else args.step_json, want, run_bench)
    result = {**summary(args, mpath, res, bench, source), "torch": torch.__version__, **want}
    report(result)
    atomic_write_text(args.out, json.dumps(result, indent=2))  # parents made, temp + rename
    print(f"wrote {args.out}")
    return 0


def run_trainer(args, mpath: str, on_cpu: bool):
    """The trainer end to end on the tokenized corpus: (its result.json, its spec, the step benchmark's spec), or
    the exit code when the input or the trainer failed (2, or 75 to retry)."""
    from pipelines.manifest import StageError, load_manifest
    from pipelines.spec import SpecError
    from pipelines.train import launch

    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        tok = load_manifest(mpath)
        if not isinstance(tok.extra.get("vocab_size"), int):
            raise StageError(f"{mpath} is not a tokenize stage's manifest (no vocab_size)")
        spec, bench_spec = specs(args, tok.extra["vocab_size"])
        if on_cpu:  # the trainer's ranks on the CPU too, as the step benchmark
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        res = json.loads(launch.run(spec, tok).output("result").read_text())
    except (SpecError, StageError, FileNotFoundError) as e:
        print(f"trainer_gpu: {type(e).__name__}: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    finally:  # as it was, for whatever runs in this process next
        os.environ.pop("CUDA_VISIBLE_DEVICES", None) if hidden is None else os.environ.update(
            CUDA_VISIBLE_DEVICES=hidden)
    return res, spec, bench_spec


def summary(args, mpath: str, res: dict, bench: float | None, source: str) -> dict:
    """The row: the trainer's figures (its steady wall per process) beside the step benchmark's, and their ratios."""
    world = res.get("world_size") or 1
    wall = res["steady_wall_tokens_per_s"] / world if res.get("steady_wall_tokens_per_s") else None  # a process's
    less = res.get("steady_wall_less_stalls_tokens_per_s")
    less = less / world if less else None
    return {"spec": args.spec, "overrides": args.overrides, "tokenize_manifest": mpath, "device": res.get("device"),
            "steps": args.steps, "every": args.every, "parallel": res.get("parallel"),
            "world_size": res.get("world_size"), "trainer_step_tokens_per_s": res.get("tokens_per_s"),
            "trainer_steady_wall_tokens_per_s": res.get("steady_wall_tokens_per_s"),
            "trainer_steady_wall_less_stalls_tokens_per_s": res.get("steady_wall_less_stalls_tokens_per_s"),
            "trainer_goodput_tokens_per_s": res.get("goodput_tokens_per_s"),
            "step_bench_tokens_per_s": bench, "step_bench_from": source,
            "ratio": wall / bench if wall and bench else None,
            "ratio_of": "trainer's steady wall tokens/s per process ÷ the step benchmark's (one process)",
            "ratio_less_stalls": less / bench if less and bench else None,
            "checkpoints": res.get("ckpt", {}).get("saves"), "stall_s_max": res.get("ckpt", {}).get("stall_s_max"),
            "steady_stall_s": res.get("steady_stall_s"),
            "evaluations": len(res.get("val") or []), "mlflow_run_id": res.get("mlflow_run_id")}


def report(r: dict) -> None:
    print(f"trainer_gpu: {r['device']}, {r['params'] / 1e6:,.1f}M params, batch {r['micro_batch']} × {r['seq_len']}, "
          f"{r['dtype']}, {r['steps']} steps ({r['parallel']}, {r['world_size']} rank(s)), a checkpoint and a "
          f"validation every {r['every']} ({r['checkpoints']} saves, stall max {r['stall_s_max'] or 0:.2f} s; "
          f"{r['evaluations']} validations), MLflow run {r['mlflow_run_id']}")
    print("| the whole trainer | step tokens/s | steady wall tokens/s | less the save stalls | goodput tokens/s | "
          "step benchmark tokens/s | wall ÷ benchmark | less the stalls ÷ benchmark |\n|---|---|---|---|---|---|---|---|")
    fmt = lambda v: f"{v:,.0f}" if v else "—"  # noqa: E731
    ratio = lambda v: f"{v:.3f}" if v else "—"  # noqa: E731
    print(f"| torchrun, loader, checkpoints, validation, MLflow | {fmt(r['trainer_step_tokens_per_s'])} | "
          f"{fmt(r['trainer_steady_wall_tokens_per_s'])} | {fmt(r['trainer_steady_wall_less_stalls_tokens_per_s'])} | "
          f"{fmt(r['trainer_goodput_tokens_per_s'])} | {fmt(r['step_bench_tokens_per_s'])} | {ratio(r['ratio'])} | "
          f"{ratio(r['ratio_less_stalls'])} |")
    if r["steady_stall_s"] is not None:
        print(f"save stalls in the steady window: {r['steady_stall_s']:.2f} s")
    print(f"step benchmark from: {r['step_bench_from']}")


if __name__ == "__main__":
    sys.exit(main())
