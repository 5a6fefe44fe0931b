"""Score one model directory: reference bits-per-byte, held-out diagnostics, harness tasks, a sample.

Runs in one process (the evaluate stage, a small model) or on every rank of the launcher
(``python -m pipelines.eval.scorer`` under torchrun or a PyTorchJob, a model above
``eval.single_process_max_params``): each rank loads the model onto its device, takes every
world-th window and every world-th harness request; sums are all-reduced and rank 0 writes the
result. The numbers do not depend on the number of ranks (up to float summation order).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipelines.data.shards import TokenStream, first_out_of_vocab, out_of_vocab_message
from pipelines.eval.bpb import bits_per_byte, combine, read_text, window_nats, windows
from pipelines.eval_sets import set_sha256
from pipelines.launch import outcomes as xc
from pipelines.manifest import StageError, atomic_write_text
from pipelines.procs import main_bounded
from pipelines.spec import add_spec_args, spec_from_args

PARTS = ("reference", "heldout", "harness", "sample")


@dataclass
class Job:
    """What to score; the evaluate stage builds it, the ranks read it back from JSON."""
    model_dir: str
    reference: list[str] = field(default_factory=list)  # files (resolved)
    heldout: list[str] = field(default_factory=list)  # held-out shard prefixes
    heldout_text_bytes: int = 0
    heldout_tokens: int = 0
    parts: list[str] = field(default_factory=lambda: list(PARTS))


class Ranks:
    """This process's rank and the world, and sums across them (a no-op in one process)."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
        return t.cpu().tolist()


def reference_scores(tm, files: list[str], ranks: Ranks, batch_size: int) -> dict:
    per = {Path(f).name: bits_per_byte(tm, read_text(f), batch_size, ranks.rank, ranks.world,
                                       lambda x: ranks.sum([x])[0]) for f in files}
    return {**combine(per), "sha256": set_sha256(files), "files": per}


class HeldoutShardError(StageError):
    """A held-out shard holds a token id outside the model's tokenizer: written by another tokenizer, or damaged
    (exit 2: every try reads the same id; the embedding would fail with an index error, on a GPU a device-side
    assert that names nothing)."""


def checked_tokens(stream: TokenStream, start: int, stop: int, vocab: int) -> "np.ndarray":
    """Tokens ``[start, stop)`` of ``stream``; raises :class:`HeldoutShardError` naming the shard and the position of
    the first id ≥ ``vocab``."""
    ids = stream.read(start, stop)
    bad = first_out_of_vocab(ids, vocab)
    if bad is not None:
        at = start + bad[0]
        raise HeldoutShardError(out_of_vocab_message(stream.shard_at(at), int(ids[bad[0]]), f"held-out token {at}",
                                                     vocab, "the model's tokenizer"))
    return ids


def heldout_scores(tm, job: Job, ranks: Ranks, batch_size: int, max_tokens: int | None) -> dict:
    """Mean next-token loss over the non-overlapping windows of the held-out token stream (the held-out shards back
    to back, so the windows do not depend on how tokenization cut the shards). A diagnostic: it scores the run's
    own corpus, so it compares runs of the same data only. The stream is read a chunk of 1,024 whole windows at a time
    (each rank scores its share of every chunk's windows), so memory stays flat however large the split."""
    stream = TokenStream(job.heldout)
    n = min(len(stream), max_tokens + 1) if max_tokens else len(stream)
    chunk, vocab = tm.seq_len * 1024, tm.sp.get_piece_size()
    nats = sum(window_nats(tm, checked_tokens(stream, a, min(a + chunk + 1, n), vocab), ranks.rank, ranks.world,
                           batch_size) for a in range(0, max(0, n - 1), chunk))
    nats = ranks.sum([nats])[0]
    count = sum(e - s - 1 for s, e in windows(n, tm.seq_len))
    if count == 0:
        raise ValueError("no held-out tokens to score: raise tokenizer.heldout_fraction")
    loss = nats / count
    bpb = loss / math.log(2) * job.heldout_tokens / max(1, job.heldout_text_bytes)
    return {"heldout_loss": loss, "heldout_ppl": math.exp(loss), "heldout_bpb": bpb, "heldout_tokens_scored": count}


def score(spec, job: Job, ranks: Ranks | None = None, device: str = "cpu") -> dict:
    """Everything ``job.parts`` asks for; complete on rank 0 (other ranks get their partial view)."""
    from pipelines.eval.lm import TextModel

    ranks = ranks or Ranks()
    tm = TextModel.load(job.model_dir, device)
    E = spec.eval
    out: dict = {"params": sum(p.numel() for p in tm.model.parameters()), "world_size": ranks.world}
    if "reference" in job.parts:
        out["reference"] = reference_scores(tm, job.reference, ranks, E.batch_size)
    if "heldout" in job.parts and job.heldout:
        out["heldout"] = heldout_scores(tm, job, ranks, E.batch_size, E.max_tokens)
    if "harness" in job.parts and E.tasks:
        from pipelines.eval.harness import evaluate, headline

        res = evaluate(tm, list(E.tasks), E.limit, E.data_dir, E.batch_size, tuple(E.include_path))
        out["harness"] = {"scores": headline(res), "results": res}
    if "sample" in job.parts and ranks.rank == 0:
        out["sample"] = {"prompt": E.sample_prompt, "text": tm.generate(
            E.sample_prompt, E.sample_max_new_tokens, temperature=0.8, top_k=50, seed=spec.run.seed)}
    return out


def main(argv: list[str] | None = None) -> int:
    """One rank of a multi-rank scoring run (what the evaluate stage launches for a big model)."""
    ap = argparse.ArgumentParser(prog="python -m pipelines.eval.scorer", description=__doc__.splitlines()[0])
    add_spec_args(ap)
    ap.add_argument("--job", required=True, help="JSON of a scorer.Job.")
    ap.add_argument("--out", required=True, help="Rank 0 writes the scores here; a rank that stops for the data "
                                                 "writes its outcome file (exit-rank<R>.json) beside it.")
    args = ap.parse_args(argv)
    from pipelines.train.trainer import init_distributed

    work = Path(args.out).parent
    stopped = xc.final_stop(work)
    if stopped is not None:  # a restart (a pod's torchrun) of ranks that would stop the same way: not loaded again
        print(f"scorer: error: rank {stopped.get('rank')} of this launch stopped for the data "
              f"({work}/{xc.outcome_name(stopped.get('rank'), stopped.get('attempt'))}): {stopped.get('reason')}; "
              "not scoring again",
              file=sys.stderr)
        return xc.USER_ERROR
    spec = spec_from_args(args)
    rank, world, device = init_distributed(spec)
    xc.clear_outcome(work, rank)
    job = Job(**json.loads(Path(args.job).read_text()))
    try:
        res = score(spec, job, Ranks(rank, world), str(device))
    except StageError as e:  # the data or the spec: one line, and the launcher reads exit 2 from the outcome file
        print(f"scorer: error: {e}", file=sys.stderr, flush=True)
        xc.write_outcome(work, rank, e.exit_code, str(e), final=e.exit_code == xc.USER_ERROR)
        return e.exit_code
    if rank == 0:
        atomic_write_text(args.out, json.dumps(res, indent=2))
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main_bounded(main)  # a thread stuck in I/O at the end keeps the process at most procs.EXIT_GRACE_S
