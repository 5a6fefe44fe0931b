"""Generation throughput: batched generation with a KV cache (``TextModel.generate_batch``, what the served pyfunc and
the harness's ``generate_until`` use) vs nanoGPT's ``generate`` (one sequence at a time, the whole window through the
model for every new token: our ``TextModel.generate``, its reference), same model, same prompts, same run.

The outputs are compared too: the two must produce the same texts (greedy and sampled, each prompt seeded alike).

    python benchmarks/generate_bench.py [--prompts 16] [--new-tokens 64] [--d-model 256] [--layers 4]

Writes ``var/bench/generate.json`` with ``ratio`` = ours ÷ anchor new tokens/s.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines.data import tokenize  # noqa: E402
from pipelines.eval.lm import TextModel  # noqa: E402
from pipelines.manifest import atomic_write_text  # noqa: E402
from pipelines.spec import TokenizerCfg  # noqa: E402
from pipelines.train.model import ModelArgs, Transformer, param_count  # noqa: E402


def text_model(d: Path, args: argparse.Namespace) -> TextModel:
    import sentencepiece as spm

    with gzip.open(ROOT / "data/sample/c4_en_train_1k.jsonl.gz", "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f][:400]
    sp_path = tokenize.train_sentencepiece([tokenize.canonical_text(t) for t in docs], d / "sp",
                                           TokenizerCfg(vocab_size=args.vocab), seed=1)
    torch.manual_seed(0)
    a = ModelArgs(vocab_size=args.vocab, n_layers=args.layers, d_model=args.d_model, n_heads=args.d_model // 64,
                  seq_len=args.seq_len)
    return TextModel(Transformer(a).eval(), spm.SentencePieceProcessor(model_file=str(sp_path)))


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tm = text_model(Path(tmp), args)
    prompts = [f"Prompt number {i}: once upon a time, in a city by the sea, there lived" + " and" * (i % 5)
               for i in range(args.prompts)]
    rows = []
    for temperature in (0.0, 0.8):
        n = args.new_tokens
        ta, ref = timed(lambda: [tm.generate(p, n, temperature, 50, seed=1) for p in prompts])
        tb, ours = timed(lambda: tm.generate_batch(prompts, n, temperature, 50, seed=1))
        assert ours == ref, "batched generation with the cache differs from the reference"
        toks = sum(len(tm.encode(t)) for t in ours) or 1
        rows.append({"temperature": temperature, "new_tokens": toks, "ours_s": tb, "anchor_s": ta,
                     "ours_tok_s": toks / tb, "anchor_tok_s": toks / ta, "ratio": ta / tb})
    print(f"model: {param_count(tm.model.args):,} params (d_model {args.d_model}, {args.layers} layers, seq_len "
          f"{args.seq_len}); {args.prompts} prompts × {args.new_tokens} new tokens; 1 CPU thread")
    print("| decoding | ours: batched, KV cache (tokens/s) | nanoGPT-style generate, no cache (tokens/s) | ours / anchor | same texts |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {'greedy' if r['temperature'] == 0 else 'T=0.8, top-k 50'} | {r['ours_tok_s']:,.0f} | "
              f"{r['anchor_tok_s']:,.0f} | {r['ratio']:.2f}× | yes |")
    out = ROOT / "var" / "bench" / "generate.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({"rows": rows, "ratio": min(r["ratio"] for r in rows), "args": vars(args)},
                                      indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
