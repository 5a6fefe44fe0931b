"""Our model and its tokenizer as one object that scores and writes text.

The reference bits-per-byte (``pipelines.eval.bpb``), the lm-evaluation-harness wrapper
(``pipelines.eval.harness``) and the served pyfunc (``pipelines.eval.serving``) all go through
:class:`TextModel`, so the three cannot disagree about tokenization, truncation or sampling.

* Text is normalised exactly as the tokenize stage does (NFKC, ``\\r\\n`` → ``\\n``) before encoding.
* A request longer than the model's ``seq_len`` keeps its *last* ``seq_len + 1`` tokens: the left context is
  cut first; a continuation longer than that has only its last ``seq_len`` tokens scored (as the harness's
  Hugging Face model does).
* Generation (:meth:`TextModel.generate_batch`) runs a batch of prompts together, left-padded, with a KV cache:
  one forward pass over the prompts, then one token per row per step. Each row samples with its own generator
  (seeded with ``seed``), so a prompt gets the same text alone or in a batch, with or without the cache. When a
  prompt plus ``max_new_tokens`` would pass ``seq_len``, the window slides and every position moves: such a batch
  is generated without the cache (:meth:`TextModel.generate`, which re-reads the last ``seq_len`` tokens each step).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import sentencepiece as spm
import torch
import torch.nn.functional as F

from pipelines.data.text import canonical_text
from pipelines.train.ckpt.dcp_read import load_plain_model


@dataclass
class TextModel:
    model: torch.nn.Module  # pipelines.train.model.Transformer, eval mode
    sp: "object"  # sentencepiece.SentencePieceProcessor
    device: torch.device = torch.device("cpu")

    @classmethod
    def load(cls, model_dir: str | Path, device: str | torch.device = "cpu") -> "TextModel":
        """From a directory holding ``model_args.json``, ``tokenizer.model`` and the weights: a committed
        DCP checkpoint, or a plain ``model.pt`` (what ``checkpoint export`` and the registered model carry)."""
        d = Path(model_dir)
        sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
        dev = torch.device(device)
        return cls(load_plain_model(d).to(dev), sp, dev)

    @classmethod
    def open(cls, uri: str, tracking_uri: str | None = None) -> "TextModel":
        """From a registry URI (``models:/NAME@ALIAS``, ``models:/NAME/V``, ``runs:/…``) or a local model directory."""
        if Path(uri).is_dir():
            return cls.load(uri)
        from pipelines.eval.model_dir import load_registered

        return cls(*load_registered(uri, tracking_uri))

    @property
    def seq_len(self) -> int:
        return self.model.args.seq_len

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(canonical_text(text)) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids.to(self.device)).float()

    @torch.no_grad()
    def continuation_logprobs(self, pairs: Sequence[tuple[list[int], list[int]]],
                              batch_size: int = 16) -> list[tuple[float, bool]]:
        """For each (context ids, continuation ids): (sum of log p(continuation | context), whether greedy
        decoding would have produced the continuation). Longest first, right-padded batches (the model is
        causal, so padding after a row's end changes nothing before it), results in request order."""
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        rows = []
        for i, (ctx, cont) in enumerate(pairs):
            if not cont:
                raise ValueError("an empty continuation has no likelihood to score")
            full = (list(ctx) + list(cont))[-(self.seq_len + 1):]
            if len(full) < 2:  # nothing to condition the only token on
                raise ValueError("a request needs a context: pass the EOS id as context for text that starts a document")
            rows.append((len(full), i, full, min(len(cont), len(full) - 1)))
        rows.sort(key=lambda r: -r[0])
        for b in range(0, len(rows), batch_size):
            chunk = rows[b:b + batch_size]
            width = chunk[0][0] - 1
            inp = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, (n, _, full, _) in enumerate(chunk):
                inp[j, :n - 1] = torch.tensor(full[:-1])
            logp = F.log_softmax(self.logits(inp), dim=-1).cpu()
            for j, (n, i, full, k) in enumerate(chunk):
                lp = logp[j, n - 1 - k:n - 1]  # positions that predict the continuation
                target = torch.tensor(full[-k:])
                out[i] = (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def generate_batch(self, prompts: Sequence[str], max_new_tokens: int = 32, temperature: float = 0.8,
                       top_k: int = 50, seed: int = 0, stop: Iterable[str] = ()) -> list[str]:
        """:meth:`generate` for every prompt, batched with a KV cache (same texts)."""
        from pipelines.train.model import KVCache

        rows = [self.encode(p) or [self.eos_id] for p in prompts]
        n = int(max_new_tokens)
        if not rows or n <= 0:
            return ["" for _ in rows]
        width = max(map(len, rows))
        if width + n > self.seq_len:  # the window would slide: positions move, a cache cannot be reused
            return [self.generate(p, n, temperature, top_k, seed, stop) for p in prompts]
        stop = [s for s in stop if s]
        pad = torch.tensor([width - len(r) for r in rows])
        valid = torch.zeros(len(rows), width + n, dtype=torch.bool)
        for b, p in enumerate(pad.tolist()):
            valid[b, p:width] = True
        tokens = torch.tensor([[self.eos_id] * p + r for p, r in zip(pad.tolist(), rows)], device=self.device)
        cache = KVCache.empty(self.model, len(rows), width + n)
        positions = (torch.arange(width)[None, :] - pad[:, None]).clamp(min=0)
        last = self.model.decode(tokens, cache, positions.to(self.device), valid.to(self.device))[:, -1].cpu()
        gens = [torch.Generator().manual_seed(int(seed)) for _ in rows]
        new: list[list[int]] = [[] for _ in rows]
        done = [False] * len(rows)
        for step in range(n):
            nxt = []
            for b in range(len(rows)):
                t = self.eos_id if done[b] else _sample(last[b], float(temperature), int(top_k), gens[b])
                if not done[b]:
                    done[b] = t == self.eos_id
                    if not done[b]:
                        new[b].append(t)
                        done[b] = bool(stop) and any(s in self._tail(rows[b], new[b]) for s in stop)
                nxt.append(t)
            if all(done) or step == n - 1:
                break
            valid[:, width + step] = True
            pos = (width + step - pad)[:, None].clamp(min=0)
            last = self.model.decode(torch.tensor(nxt, device=self.device)[:, None], cache, pos.to(self.device),
                                     valid.to(self.device))[:, -1].cpu()
        return [self._until(self._tail(r, w), stop) for r, w in zip(rows, new)]

    @staticmethod
    def _until(text: str, stop: Sequence[str]) -> str:
        cut = min([text.find(s) for s in stop if s in text], default=len(text))
        return text[:cut]

    @torch.no_grad()
    def generate(self, prompt: str, max_new_tokens: int = 32, temperature: float = 0.8, top_k: int = 50,
                 seed: int = 0, stop: Iterable[str] = ()) -> str:
        """Sample a continuation of ``prompt`` (``temperature`` 0 = greedy); stops at EOS, after
        ``max_new_tokens``, or before the first of ``stop``. No cache: every step reads the last ``seq_len`` tokens
        (the reference :meth:`generate_batch` is tested against)."""
        gen = torch.Generator().manual_seed(int(seed))
        ids = self.encode(prompt) or [self.eos_id]
        new: list[int] = []
        stop = [s for s in stop if s]
        for _ in range(int(max_new_tokens)):
            last = self.logits(torch.tensor([(ids + new)[-self.seq_len:]]))[0, -1].cpu()
            nxt = _sample(last, float(temperature), int(top_k), gen)
            if nxt == self.eos_id:
                break
            new.append(nxt)
            if stop and any(s in self._tail(ids, new) for s in stop):
                break
        return self._until(self._tail(ids, new), stop)

    def _tail(self, ids: list[int], new: list[int]) -> str:
        """The text ``new`` adds after ``ids``, with the word-boundary space SentencePiece drops when it
        decodes a sequence on its own."""
        head, full = self.decode(ids), self.decode(ids + new)
        return full[len(head):] if full.startswith(head) else self.decode(new)


def _sample(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=gen))
