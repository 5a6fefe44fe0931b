"""Evaluate: load the promoted checkpoint **from L2** and score the held-out shards.

Metrics:

* ``heldout_loss``: mean next-token cross-entropy (nats) over non-overlapping windows of
  ``seq_len + 1`` tokens covering every held-out shard (each window predicts ``seq_len`` tokens);
* ``heldout_ppl`` = exp(loss);
* ``heldout_bpb`` (bits per UTF-8 byte, comparable across tokenizers) =
  loss / ln 2 × held-out tokens / held-out text bytes.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from pipelines.cli import run_and_log, stage_parser
from pipelines.manifest import Manifest, StageDir, input_ref, load_manifest, write_report
from pipelines.spec import JobSpec, resolve_path, spec_from_args


def heldout_loss(model, shard_prefixes: list[Path], batch_size: int = 16, max_tokens: int | None = None) -> tuple[float, int]:
    """(mean loss in nats, tokens scored) over non-overlapping windows of the shards."""
    import numpy as np
    import torch

    from pipelines.data.shards import Shard

    T = model.args.seq_len
    windows = []
    for p in shard_prefixes:
        toks = Shard.open(p).tokens
        for start in range(0, max(0, toks.size - 1), T):
            w = np.asarray(toks[start:start + T + 1], dtype=np.int64)
            if w.size >= 2:
                windows.append(w)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            chunk = windows[i:i + batch_size]
            # a shard's last window may be shorter: batch equal lengths together
            groups = [[w for w in chunk if w.size == n] for n in sorted({w.size for w in chunk})]
            for g in groups:
                t = torch.from_numpy(np.stack(g))
                logits = model(t[:, :-1])
                nll = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1), reduction="sum")
                total += float(nll)
                count += int(t[:, 1:].numel())
            if max_tokens and count >= max_tokens:
                break
    if count == 0:
        raise ValueError("no held-out tokens to score: raise tokenizer.heldout_fraction")
    return total / count, count


def evaluate(spec: JobSpec, promote: Manifest, tok: Manifest, workdir: Path) -> dict:
    from pipelines.train.checkpoint import fetch, load_plain_model

    tier, ckpt = fetch(spec, promote.extra["checkpoint"], cache=workdir / "checkpoint", prefer=("L2",))
    model = load_plain_model(ckpt)  # the sharded DCP checkpoint, resharded into one plain model
    shards = [tok.dir / s["prefix"] for s in tok.extra["shards"] if s["split"] == "heldout"]
    loss, n = heldout_loss(model, shards, spec.eval.batch_size, spec.eval.max_tokens)
    c = tok.counts
    bpb = loss / math.log(2) * c["heldout_tokens"] / max(1, c["heldout_text_bytes"])
    return {"heldout_loss": loss, "heldout_ppl": math.exp(loss), "heldout_bpb": bpb, "heldout_tokens_scored": n,
            "loaded_from": tier, "checkpoint_uri": promote.extra["l2_uri"]}


def run(spec: JobSpec, promote: Manifest, tok: Manifest, out_dir: str | None = None) -> Manifest:
    sd = StageDir(resolve_path(spec.run.root), "eval", spec.stage_hash("eval"), [input_ref(promote), input_ref(tok)],
                  force=spec.run.force, out_dir=out_dir)

    def body(tmp: Path) -> Manifest:
        import shutil

        res = evaluate(spec, promote, tok, tmp)
        shutil.rmtree(tmp / "checkpoint", ignore_errors=True)  # a cache, not an output
        (tmp / "metrics.json").write_text(json.dumps(res, indent=2))
        return sd.commit({"metrics": "metrics.json"}, counts={"tokens_scored": res["heldout_tokens_scored"]},
                         metrics={k: res[k] for k in ("heldout_loss", "heldout_ppl", "heldout_bpb")},
                         extra={"loaded_from": res["loaded_from"], "checkpoint_uri": res["checkpoint_uri"],
                                "checkpoint": promote.extra["checkpoint"]})

    return run_and_log(spec, sd, body)


def main(argv: list[str] | None = None) -> int:
    ap = stage_parser("pipelines.eval.evaluate",
                      "Held-out loss / perplexity / bits-per-byte of the promoted checkpoint, loaded from L2.",
                      {"--promote-manifest": "Manifest of the promote stage.",
                       "--tokenize-manifest": "Manifest of the tokenize stage (held-out shards)."})
    args = ap.parse_args(argv)
    spec = spec_from_args(args)
    m = run(spec, load_manifest(args.promote_manifest), load_manifest(args.tokenize_manifest), args.output)
    write_report(args.report, m)
    x = m.metrics
    print(f"eval: held-out loss {x['heldout_loss']:.4f} nats/token, ppl {x['heldout_ppl']:.1f}, "
          f"{x['heldout_bpb']:.4f} bits/byte (loaded from {m.extra['loaded_from']}); manifest {m.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
