"""The LM head and its cross-entropy, a chunk of tokens at a time, gradients computed in the forward.

The plain way (``F.cross_entropy(output(h).float(), targets)``, nanoGPT's) materialises the logits of every token of
the micro batch at full vocabulary, then an fp32 copy, its log-softmax (kept for the backward) and, in the backward,
an fp32 gradient of the same size: at 8 × 2,048 tokens and a 50,304 vocabulary that is 3.3 GB per fp32 copy, read
and written about ten times a step. ``LinearCrossEntropy`` (the idea of Liger-Kernel's fused linear cross-entropy,
written here for our model) instead takes ``chunk`` tokens at a time: their logits (in the autocast dtype), their
log-softmax and the loss in fp32, and at once the gradient of the mean loss with respect to those logits, turned
into the gradients of the hidden states and of the head's weight (summed in fp32); the chunk's logits are then
dropped. The backward only scales the two stored gradients by the incoming one. Loss and gradients equal the plain
way's to float rounding (``tests/test_loss.py``); ``ignore_index`` is -100 as in ``F.cross_entropy``.

The chunk (``train.loss_chunk_tokens``, 'auto': ``plan.loss_chunk``) trades memory (one chunk's logits and their fp32
softmax) against one pass over the head's gradient per chunk. With ``compile`` (``parallel.compile``, as for the
blocks) on a GPU the per-chunk softmax and gradient are compiled (``ce_chunk_pointwise``: a reduction and one pointwise pass
over the logits); eager, ``ce_chunk`` (the fused log-softmax, the gradient made in place). Without
autograd (validation during training) only the losses are computed, still a chunk at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from pipelines.train.plan import loss_chunk

IGNORE = -100  # F.cross_entropy's default ignore_index


def ce_chunk(logits: torch.Tensor, targets: torch.Tensor, inv_n: torch.Tensor,
             lsm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss of one chunk (fp32) and the gradient of the batch's mean loss with respect to its logits (in the
    logits' dtype): (softmax − one-hot) / n for each counted token, 0 for an ignored one. The fp32 log-softmax
    (one kernel; on CPU bf16 logits are first copied to fp32), written into ``lsm`` when given (an fp32 buffer of
    the logits' shape), is turned into the gradient in place."""
    lsm = torch.log_softmax(logits, dim=-1, dtype=torch.float32, out=lsm)
    counted = targets != IGNORE
    t = torch.where(counted, targets, 0)
    rows = torch.arange(lsm.shape[0], device=lsm.device)
    loss = -torch.where(counted, lsm[rows, t], 0.0).sum()
    grad = lsm.exp_()
    grad.index_put_((rows, t), torch.full_like(rows, -1, dtype=grad.dtype), accumulate=True)
    grad.mul_(torch.where(counted, inv_n, 0.0)[:, None])
    return loss, grad.to(logits.dtype)


def ce_chunk_pointwise(logits: torch.Tensor, targets: torch.Tensor,
                       inv_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ce_chunk`` written for the compiler: the one-hot as a comparison, so that the gradient is one pointwise
    kernel over the logits after one reduction (no scatter into a materialised fp32 buffer)."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    counted = targets != IGNORE
    t = torch.where(counted, targets, 0)
    loss = torch.where(counted, lse - lf.gather(1, t[:, None]).squeeze(1), 0.0).sum()
    hit = torch.arange(lf.shape[1], device=lf.device)[None, :] == t[:, None]
    grad = (torch.exp(lf - lse[:, None]) - hit.to(lf.dtype)) * torch.where(counted, inv_n, 0.0)[:, None]
    return loss, grad.to(logits.dtype)


def check_targets(targets: torch.Tensor, vocab: int) -> None:
    """A target outside 0..vocab-1 that is not ``IGNORE`` stops the step, as in ``F.cross_entropy`` (the kernels
    above would read a negative one as a column from the end). Asynchronous on a GPU: no wait for the device."""
    torch._assert_async(((targets == IGNORE) | ((targets >= 0) & (targets < vocab))).all(),
                        f"a target outside 0..{vocab - 1} that is not the ignore index {IGNORE}")


def _loss_chunk(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    kind = h.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(h.dtype, weight.dtype)


class Buffers:
    """The chunk's logits and fp32 log-softmax, kept from chunk to chunk and step to step on CPU, where PyTorch has
    no caching allocator: each fresh tensor that large is a fresh mapping whose pages the kernel zeroes on first
    touch (on 2 cores the logits product of a 2,048 × 8,192 fp32 chunk took 72 ms into a new tensor, 53 ms into a
    kept one; its log-softmax 29 and 11 ms). On a GPU the caching allocator already reuses the memory: none kept.
    What is kept lives as long as the loss: one chunk's rows (the micro batch's tokens, at most the chunk) × the
    vocabulary, in the compute dtype and in fp32 — 134 MB at 2,048 tokens × 8,192; at most 2 × 2^27 values at 'auto'
    (1 GiB), the memory the step's loss needs anyway, held also between steps (validation, checkpoint staging)."""

    def __init__(self):
        self.kept: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A (rows, cols) buffer to write into (its contents are garbage), or None off the CPU."""
        if device.type != "cpu":
            return None
        b = self.kept.get(name)
        if b is None or b.shape[0] < rows or b.shape[1] != cols or b.dtype != dtype:
            b = self.kept[name] = torch.empty(rows, cols, dtype=dtype, device=device)
        return b[:rows]


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk, compiled, buffers):
        dt = _compute_dtype(h, weight)
        want_w = ctx.needs_input_grad[1]
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dt), weight.to(dt)
            inv_n = 1.0 / (targets != IGNORE).sum().to(torch.float32)
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(hc)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
            V = wc.shape[0]
            check_targets(targets, V)
            for lo in range(0, hc.shape[0], chunk):
                part, t = hc[lo:lo + chunk], targets[lo:lo + chunk]
                n = part.shape[0]
                logits = torch.mm(part, wc.t(), out=buffers.take("logits", n, V, dt, h.device))
                if compiled is not None:
                    s, g = compiled(logits, t, inv_n)
                else:
                    s, g = ce_chunk(logits, t, inv_n, lsm=buffers.take("lsm", n, V, torch.float32, h.device))
                loss += s
                torch.mm(g, wc, out=grad_h[lo:lo + chunk])
                if want_w and g.dtype == grad_w.dtype:
                    grad_w.addmm_(g.t(), part)  # one product summed into the fp32 gradient, no temporary
                elif want_w:
                    grad_w.add_(g.t() @ part)  # bf16 product (autocast), summed in fp32
                del s, g, logits  # before the next chunk's logits: one chunk's buffers alive at a time
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss * inv_n

    @staticmethod
    @once_differentiable  # the gradients are numbers computed in the forward: no graph for a second derivative
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        dh, dw = ctx.dtypes
        gw = None if grad_w is None else (grad_w * grad_out).to(dw)
        return grad_h.to(dh) * grad_out, gw, None, None, None, None


class LinearCrossEntropy:
    """``loss(h, weight, targets)``: the mean cross-entropy of ``h @ weight.T`` (h: (..., d), weight: (V, d),
    targets: (...)), ``chunk`` tokens at a time."""

    def __init__(self, chunk: int, compile: bool = False):
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1 token, got {chunk}")
        self.chunk = chunk
        # compiled (on a GPU with parallel.compile, as the GPU configs set it) the pointwise form, which fuses; else
        # the fused log-softmax and an in-place gradient (on CPU the compiled kernel was no faster a 2,048 × 8,192
        # chunk, 36-52 vs 33-37 ms, and the step with it 6 % slower)
        self.compiled = torch.compile(ce_chunk_pointwise, dynamic=False) if compile else None
        self.buffers = Buffers()

    def __call__(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h2, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            return _FusedLinearCE.apply(h2, weight, t, self.chunk, self.compiled, self.buffers)
        dt = _compute_dtype(h2, weight)
        wc, total = weight.to(dt), torch.zeros((), dtype=torch.float32, device=h.device)
        for lo in range(0, h2.shape[0], self.chunk):
            total += _loss_chunk(h2[lo:lo + self.chunk].to(dt) @ wc.t(), t[lo:lo + self.chunk])
        return total / (t != IGNORE).sum()


def for_spec(spec, vocab: int, device: torch.device) -> LinearCrossEntropy | None:
    """The trainer's loss on ``device``: ``train.loss_chunk_tokens`` tokens at a time ('auto' by the vocabulary; 0:
    None, the plain full-logits way), its kernel compiled with the model on a GPU."""
    n = loss_chunk(spec.train.loss_chunk_tokens, vocab)
    return LinearCrossEntropy(n, compile=spec.parallel.compile and device.type == "cuda") if n else None
