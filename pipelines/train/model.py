"""A Llama-style decoder-only transformer.

RMSNorm (pre-norm), rotary position embeddings, SwiGLU feed-forward, grouped-query attention via
``scaled_dot_product_attention`` (causal). Weights: normal(0, 0.02), with the two residual output
projections (``wo``, ``w2``) scaled by 1/sqrt(2·n_layers) (GPT-2 / Megatron convention); RMSNorm
weights 1; the LM head tied to the token embedding by default.

Parameter count (``param_count``), with d = d_model, L = layers, V = vocab, h_kv = kv heads,
d_h = d / heads, f = SwiGLU hidden::

    V·d (embedding) + [V·d if untied] + L·(2·d·d + 2·d·h_kv·d_h + 3·d·f + 2·d) + d
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipelines.train import plan
from pipelines.train.plan import ffn_hidden


@dataclass
class ModelArgs:
    vocab_size: int
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_mult: float = 8 / 3
    seq_len: int = 128
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return ffn_hidden(self.ffn_mult, self.d_model)

    @classmethod
    def from_spec(cls, model_cfg, vocab_size: int) -> "ModelArgs":
        d = model_cfg.model_dump()
        d["vocab_size"] = model_cfg.vocab_size or vocab_size
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


def param_count(a: ModelArgs) -> int:
    return plan.param_count({"vocab": a.vocab_size, "d": a.d_model, "layers": a.n_layers, "kv_heads": a.kv_heads,
                             "head_dim": a.head_dim, "ffn": a.ffn_hidden, "tied": a.tie_embeddings})["total"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)  # (T, d_h/2)
    return ang.cos(), ang.sin()


def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, d_h), rotating interleaved pairs (x0, x1), (x2, x3), ... by angles whose cos/sin broadcast to
    # (…, T, d_h/2)
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return out.type_as(x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Positions 0 … T-1."""
    return rotate(x, cos[: x.shape[-2]], sin[: x.shape[-2]])


@dataclass
class KVCache:
    """Keys and values of every layer for a batch of rows, ``slots`` positions each (inference only)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    len: int = 0  # slots filled

    @classmethod
    def empty(cls, model: "Transformer", batch: int, slots: int) -> "KVCache":
        a, w = model.args, model.tok_embeddings.weight
        shape = (batch, a.kv_heads, slots, a.head_dim)
        return cls([w.new_zeros(shape) for _ in model.layers], [w.new_zeros(shape) for _ in model.layers])


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = a.n_heads, a.kv_heads, a.head_dim
        self.wq = nn.Linear(a.d_model, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.d_model, a.kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.d_model, a.kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # head counts from the shapes (-1): under tensor parallel each rank holds heads / tp of them
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
               mask: torch.Tensor) -> torch.Tensor:
        """Attention of new tokens ``x`` (B, T) over the cache's slots and themselves; ``cos``/``sin`` per row and
        token (B, 1, T, d_h/2), ``mask`` (B, 1, T, slots so far) what each token may attend to."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        end = cache.len + T
        cache.k[layer][:, :, cache.len:end], cache.v[layer][:, :, cache.len:end] = k, v
        k, v = cache.k[layer][:, :, :end], cache.v[layer][:, :, :end]
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.d_model, a.ffn_hidden, bias=False)
        self.w3 = nn.Linear(a.d_model, a.ffn_hidden, bias=False)
        self.w2 = nn.Linear(a.ffn_hidden, a.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attn_norm = RMSNorm(a.d_model, a.norm_eps)
        self.attn = Attention(a)
        self.ffn_norm = RMSNorm(a.d_model, a.norm_eps)
        self.ffn = FeedForward(a)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.d_model)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.d_model, a.norm_eps)
        self.output = nn.Linear(a.d_model, a.vocab_size, bias=False)
        if a.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(a.seq_len, a.head_dim, a.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # the loss with targets: None = full logits and F.cross_entropy; the trainer sets pipelines.train.loss's
        # chunked LinearCrossEntropy (apply_parallelism)
        self.loss_fn = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.args.n_layers))
            else:
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        if tokens.shape[1] > self.args.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds model.seq_len={self.args.seq_len}")
        h = self.trunk(tokens)
        if targets is not None and self.loss_fn is not None:
            return self.loss_fn(h, self.output.weight, targets)
        logits = self.output(h)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def trunk(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states (normed) of ``tokens``: everything but the head; ``parallel.compile_scope: model``
        compiles this as one graph (``pipelines.train.parallel``)."""
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.norm(x)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Logits (float) of ``tokens`` (B, T) appended to ``cache``: ``positions`` (B, T) are each token's position
        in its own row (rows may be left-padded), ``valid`` (B, slots) marks the slots that hold real tokens. A
        token attends to the valid slots up to its own; a padding slot only to itself (so it stays finite)."""
        B, T = tokens.shape
        end = cache.len + T
        if end > cache.k[0].shape[2] or int(positions.max()) >= self.args.seq_len:
            raise ValueError(f"the cache holds {cache.k[0].shape[2]} slots and the model {self.args.seq_len} positions")
        slots, mine = torch.arange(end, device=tokens.device), torch.arange(cache.len, end, device=tokens.device)
        causal = slots[None, :] <= mine[:, None]
        mask = ((valid[:, None, :end] & causal) | (slots[None, :] == mine[:, None]))[:, None]
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        x = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            x = x + layer.attn.cached(layer.attn_norm(x), cos, sin, cache, i, mask)
            x = x + layer.ffn(layer.ffn_norm(x))
        cache.len = end
        return self.output(self.norm(x)).float()
