"""Bits per byte of a text under a model: the tokenizer-independent number the champion gate compares.

Definition (a contract: outside checks recompute it):

* the file's text is read as UTF-8 and normalised as the tokenize stage does (NFKC, ``\\r\\n`` → ``\\n``);
  a ``.jsonl`` file's text is its records' ``text`` fields, each normalised, joined by a blank line;
* ``bytes`` = the UTF-8 length of that text;
* the text is encoded as one sequence of ids ``t[0..n)``, without BOS or EOS; ``tokens`` = n;
* window k is ``t[k·L : k·L + L + 1]`` with L = the model's ``seq_len`` (windows start every L tokens, so
  neighbours share one token); each window predicts its tokens after the first from the ones before it, so
  every token except ``t[0]`` is scored exactly once; the last window may be shorter;
* ``nats`` = the summed negative log-likelihood, ``bits_per_byte`` = nats / ln 2 / bytes.

A reference *set* (``eval.reference``: several files) is scored file by file and summed: its
``bits_per_byte`` = Σ nats / ln 2 / Σ bytes. Its identity is :func:`pipelines.eval_sets.set_sha256` (over the files'
contents and names), which the gate requires to be equal before it compares two numbers.

    python -m pipelines.eval.bpb --model-uri models:/NAME@ALIAS --text-file FILE [--tracking-uri URI]

prints ``{"bits_per_byte", "nats", "tokens", "bytes"}`` as one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from pipelines.data.text import canonical_text
from pipelines.exit_codes import USER_ERROR


def read_text(path: str | Path) -> str:
    """A reference file's text, normalised (see the module docstring)."""
    p = Path(path)
    raw = p.read_text(encoding="utf-8")
    if p.suffix == ".jsonl":
        return "\n\n".join(canonical_text(json.loads(line)["text"]) for line in raw.splitlines() if line.strip())
    return canonical_text(raw)


def windows(n: int, seq_len: int) -> list[tuple[int, int]]:
    """(start, end) of every window over ``n`` ids: ``[k·L, min(k·L + L + 1, n))`` with at least two ids."""
    return [(s, min(s + seq_len + 1, n)) for s in range(0, max(0, n - 1), seq_len)]


def window_nats(tm, ids: Sequence[int], rank: int = 0, world: int = 1, batch_size: int = 16) -> float:
    """Summed NLL (nats) of this rank's windows (k ≡ rank mod world); the ranks' sums add up to the text's."""
    import torch
    import torch.nn.functional as F

    arr = np.asarray(ids, dtype=np.int64)
    mine = [w for k, w in enumerate(windows(len(arr), tm.seq_len)) if k % world == rank]
    total = 0.0
    for b in range(0, len(mine), batch_size):
        chunk = mine[b:b + batch_size]
        for n in sorted({e - s for s, e in chunk}):  # the last window may be shorter: equal lengths together
            t = torch.from_numpy(np.stack([arr[s:e] for s, e in chunk if e - s == n]))
            logits = tm.logits(t[:, :-1]).cpu()
            total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1), reduction="sum"))
    return total


def bits_per_byte(tm, text: str, batch_size: int = 16, rank: int = 0, world: int = 1,
                  total: Callable[[float], float] = lambda x: x) -> dict:
    """The contract's numbers for one (already normalised) text. On several ranks each scores its share of the
    windows and ``total`` sums the shares (an all-reduce)."""
    ids = tm.encode(text)
    nbytes = len(text.encode("utf-8"))
    if len(ids) < 2 or nbytes == 0:
        raise ValueError("the text is too short to score: it needs at least two tokens")
    nats = total(window_nats(tm, ids, rank, world, batch_size))
    return {"bits_per_byte": nats / math.log(2) / nbytes, "nats": nats, "tokens": len(ids), "bytes": nbytes}


def combine(per_file: dict[str, dict]) -> dict:
    """Set-level numbers from per-file ones (nats and bytes add; so do tokens)."""
    nats = sum(r["nats"] for r in per_file.values())
    nbytes = sum(r["bytes"] for r in per_file.values())
    return {"bits_per_byte": nats / math.log(2) / nbytes, "nats": nats,
            "tokens": sum(r["tokens"] for r in per_file.values()), "bytes": nbytes}


def model_parser(module: str, description: str) -> argparse.ArgumentParser:
    """A CLI over one registered model: ``--model-uri``, ``--tracking-uri``, ``--batch-size``."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    ap.add_argument("--model-uri", required=True, help="models:/NAME@ALIAS, models:/NAME/VERSION, runs:/ID/model, "
                    "or a local model directory.")
    ap.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, "
                    "else the spec's default store).")
    ap.add_argument("--batch-size", type=int, default=16)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = model_parser("pipelines.eval.bpb", "Bits per byte of a text file under a registered model (definition: "
                      "pipelines/eval/bpb.py). Prints one JSON object.")
    ap.add_argument("--text-file", required=True, help="UTF-8 text file (or .jsonl with a `text` field).")
    args = ap.parse_args(argv)
    if not Path(args.text_file).is_file():
        print(f"bpb: --text-file {args.text_file}: no such file", file=sys.stderr)
        return USER_ERROR
    try:
        from pipelines.eval.lm import TextModel

        tm = TextModel.open(args.model_uri, args.tracking_uri)
        res = bits_per_byte(tm, read_text(args.text_file), args.batch_size)
    except (LookupError, ValueError) as e:
        print(f"bpb: {e}", file=sys.stderr)
        return getattr(e, "exit_code", USER_ERROR)  # 75: the tracking server did not answer
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
