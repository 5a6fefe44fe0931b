"""Validation during training: the loss on a fixed slice of the held-out shards, every ``train.eval_every`` steps
and at the last step.

The slice is the first ``train.eval_tokens`` tokens of the held-out split, in whole windows of ``model.seq_len``
(+1 for the targets), cut from the split's token stream as training samples are: it depends on the corpus version
only, not on the rank layout. Window ``w`` is read by DP rank ``w mod DP`` (the ranks of a TP group read the same
windows); every rank runs the same number of forward passes (a rank whose windows ran out runs a window of weight 0,
so FSDP's and DDP's collectives meet), and the sums of loss × tokens and of tokens are all-reduced. ``loss`` is in
nats per token; ``bpb`` is bits per byte of the held-out text (loss / ln 2 × the split's tokens / its UTF-8 bytes,
as the evaluate stage scores bits per byte).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from pipelines.train.loader import TokenSamples, batch_tensors


class Validator:
    def __init__(self, tok, seq_len: int, eval_every: int, eval_tokens: int, micro_batch: int, last_step: int,
                 dp_rank: int, dp: int, device: torch.device, vocab: int | None = None):
        heldout = [tok.dir / s["prefix"] for s in tok.extra["shards"] if s["split"] == "heldout"]
        self.samples: Optional[TokenSamples] = None
        if eval_every and heldout:
            try:
                self.samples = TokenSamples(heldout, seq_len)
            except ValueError:  # fewer than seq_len + 1 held-out tokens
                self.samples = None
        self.every, self.last, self.micro, self.device, self.seq_len = eval_every, last_step, micro_batch, device, seq_len
        self.vocab = vocab
        self.windows = min(len(self.samples), max(1, eval_tokens // seq_len)) if self.samples else 0
        self.mine = list(range(dp_rank, self.windows, dp))
        self.passes = math.ceil(math.ceil(self.windows / dp) / micro_batch) if self.windows else 0
        c = tok.counts
        self.tokens_per_byte = c.get("heldout_tokens", 0) / max(1, c.get("heldout_text_bytes", 0))

    @property
    def off_reason(self) -> Optional[str]:
        if not self.every:
            return "train.eval_every=0"
        if not self.windows:
            return "the corpus has no held-out window of model.seq_len + 1 tokens (tokenizer.heldout_fraction)"
        return None

    def due(self, step: int) -> bool:
        return self.windows > 0 and (step % self.every == 0 or step == self.last)

    @torch.no_grad()
    def run(self, model: torch.nn.Module, autocast) -> dict:
        """Every rank together: {loss, bpb, tokens} over the slice."""
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss × tokens, tokens
        for p in range(self.passes):
            ids = self.mine[p * self.micro:(p + 1) * self.micro]
            weight = len(ids)
            x, y = batch_tensors(self.samples, np.array(ids or [0]), self.vocab)
            with autocast:
                loss = model(x.to(self.device), y.to(self.device))
            n = weight * y.shape[1]
            total += torch.stack([loss.detach().double() * n, torch.tensor(float(n), dtype=torch.float64,
                                                                           device=self.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        model.train(was_training)
        loss = float(total[0] / total[1])
        return {"loss": loss, "bpb": loss / math.log(2) * self.tokens_per_byte, "tokens": self.windows * self.seq_len}
