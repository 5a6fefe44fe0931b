"""The GGUF export read by real llama.cpp (issue 54): its tokenizer gives our ids, its logits our bits per byte.

llama.cpp is ``llama-cpp-python`` built from its sdist in a throwaway venv (``make export-check`` builds
``var/llama-venv``: a few minutes on two cores; no wheel is used). This script runs twice: in the project's venv it
exports a model directory to GGUF (``pipelines.eval.export``) and scores the reference files as the champion gate
does (``pipelines.eval.bpb``: canonical text, windows of ``seq_len``); then, with ``--llama JOB``, in the llama venv
(no torch there) it loads the GGUF file, tokenizes each file's canonical text with llama.cpp's own tokenizer and
scores *our* ids with llama.cpp's logits over the same windows. Exit 0 only when every file's ids are equal and the
two bits per byte agree to 1e-3 (fp32 weights).

    make export-check                    # builds var/llama-venv once, then runs this on a fresh model
    python benchmarks/llama_cpp_check.py [--model-dir DIR] [--text-file F ...] [--llama-python PY]

Without ``--model-dir`` the model is made here: a SentencePiece model trained as the tokenize stage trains it (on the
bundled C4 sample, ``\\n`` a user-defined piece) and a 2-layer transformer with random weights (seed 0). The ids do
not depend on the weights; the bits per byte then only say that llama.cpp computes what our model computes.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REFERENCE = [ROOT / "data/reference/tinystories_val_tail.txt", ROOT / "data/reference/tinyshakespeare_tail.txt"]
LLAMA_PYTHON = ROOT / "var/llama-venv/bin/python"


def made_model(work: Path) -> Path:
    """A model directory (model.pt, model_args.json, tokenizer.model) of the pipeline's own making."""
    import torch

    from pipelines.data import tokenize
    from pipelines.spec import TokenizerCfg
    from pipelines.train.model import ModelArgs, Transformer

    with gzip.open(ROOT / "data/sample/c4_en_train_1k.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = [tokenize.canonical_text(json.loads(line)["text"]) for line in f]
    sp = tokenize.train_sentencepiece(texts, work / "sp", TokenizerCfg(), seed=1)
    import sentencepiece as spm

    d = work / "model"
    d.mkdir()
    torch.manual_seed(0)
    a = ModelArgs(vocab_size=spm.SentencePieceProcessor(model_file=str(sp)).get_piece_size(), n_layers=2,
                  d_model=128, n_heads=4, n_kv_heads=2, seq_len=256, rope_theta=50000.0)
    torch.save(Transformer(a).state_dict(), d / "model.pt")
    (d / "model_args.json").write_text(json.dumps(a.to_dict()))
    (d / "tokenizer.model").write_bytes(sp.read_bytes())
    return d


def ours(model_dir: Path, files: list[Path], work: Path) -> dict:
    """Export the GGUF file; our ids and bits per byte for each file (the gate's definition)."""
    from pipelines.eval import bpb, export
    from pipelines.eval.lm import TextModel

    card = export.CardInfo("llama-cpp-check", "1", json.loads((model_dir / "model_args.json").read_text()), {})
    export.export(model_dir, "gguf", work / "gguf", card)
    tm = TextModel.load(model_dir)
    out = {"gguf": str(work / "gguf" / "model.gguf"), "seq_len": tm.seq_len, "files": []}
    for f in files:
        text = bpb.read_text(f)
        (work / f"{f.name}.canonical").write_text(text, encoding="utf-8")
        out["files"].append({"name": f.name, "text": str(work / f"{f.name}.canonical"), "ids": tm.encode(text),
                             **bpb.bits_per_byte(tm, text)})
    return out


def llama_side(job: dict) -> dict:
    """In the llama venv: llama.cpp's ids for each text, and its nats on our ids over the gate's windows."""
    import numpy as np
    from llama_cpp import Llama, __version__

    from pipelines.eval.bpb import windows

    n = job["seq_len"]
    llm = Llama(model_path=job["gguf"], n_ctx=n + 1, n_batch=n + 1, logits_all=True, verbose=False, seed=0)
    res = {"llama_cpp_python": __version__, "files": []}
    for f in job["files"]:
        text = Path(f["text"]).read_text(encoding="utf-8")
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        nats = 0.0
        for s, e in windows(len(f["ids"]), n):
            w = f["ids"][s:e]
            llm.reset()
            llm.eval(w[:-1])
            logits = np.asarray(llm.scores[:len(w) - 1], dtype=np.float64)
            top = logits.max(axis=1, keepdims=True)
            logz = (top[:, 0] + np.log(np.exp(logits - top).sum(axis=1)))
            nats += float((logz - logits[np.arange(len(w) - 1), w[1:]]).sum())
        res["files"].append({"name": f["name"], "ids": theirs, "nats": nats})
    return res


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def report(mine: dict, theirs: dict) -> bool:
    print(f"llama-cpp-python {theirs['llama_cpp_python']} (built from its sdist) on {mine['gguf']}")
    print("| file | tokens ours | tokens llama.cpp | first differing id | bits/byte ours | bits/byte llama.cpp "
          "(our ids) | abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ok = True
    for m, t in zip(mine["files"], theirs["files"]):
        diff = first_difference(m["ids"], t["ids"])
        bpb_l = t["nats"] / math.log(2) / m["bytes"]
        delta = abs(bpb_l - m["bits_per_byte"])
        ok &= diff is None and delta < 1e-3
        print(f"| {m['name']} | {len(m['ids']):,} | {len(t['ids']):,} | {'none' if diff is None else diff} | "
              f"{m['bits_per_byte']:.4f} | {bpb_l:.4f} | {delta:.1e} |")
    print("equal ids, equal bits per byte" if ok else "MISMATCH")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, help="A model directory (model.pt, model_args.json, tokenizer.model), "
                    "e.g. a registered version's, as pipelines.eval.model_dir.download fetches it; default: one made here.")
    ap.add_argument("--text-file", type=Path, action="append", help="A reference file (repeatable); default: "
                    "the demo's eval.reference set.")
    ap.add_argument("--llama-python", type=Path, default=LLAMA_PYTHON, help="The llama venv's python.")
    ap.add_argument("--llama", type=Path, help=argparse.SUPPRESS)  # the llama venv's half: a job file
    args = ap.parse_args(argv)
    if args.llama:
        print(json.dumps(llama_side(json.loads(args.llama.read_text()))))
        return 0
    if not args.llama_python.exists():
        print(f"llama_cpp_check: error: {args.llama_python} missing: `make export-check` builds it", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="llmp-llama-") as tmp:
        work = Path(tmp)
        mine = ours(args.model_dir or made_model(work), args.text_file or REFERENCE, work)
        (work / "job.json").write_text(json.dumps(mine))
        r = subprocess.run([str(args.llama_python), __file__, "--llama", str(work / "job.json")], capture_output=True,
                           text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=1800)
        if r.returncode != 0:
            print(f"llama_cpp_check: the llama venv's side failed:\n{r.stderr[-3000:]}", file=sys.stderr)
            return 1
        return 0 if report(mine, json.loads(r.stdout.strip().splitlines()[-1])) else 1


if __name__ == "__main__":
    sys.exit(main())
