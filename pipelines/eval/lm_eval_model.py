"""``llm-pipeline``: our model as an lm-evaluation-harness ``LM`` (in a module of its own, never run as
``__main__``, so the harness's registry holds exactly one class under that name).

Tokenization follows the harness's Hugging Face model: trailing spaces of a context move to the
continuation, the pair is encoded as a whole and split where the context's encoding ends; an empty context
is the EOS token (the document boundary the model was trained on). Under ``torch.distributed`` (the
evaluate stage's ranks) every rank takes a share of the requests and the harness gathers them.
"""
from __future__ import annotations

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model


@register_model("llm-pipeline")
class PipelineLM(LM):
    def __init__(self, uri: str | None = None, tracking_uri: str | None = None, text_model=None,
                 batch_size: int | str | None = 16, device: str | None = None, **_ignored):
        super().__init__()
        import torch.distributed as dist

        from pipelines.eval.lm import TextModel

        if text_model is None:
            if not uri:
                raise ValueError("llm-pipeline needs --model_args uri=models:/NAME@ALIAS (or a local model directory)")
            text_model = TextModel.open(str(uri), tracking_uri)
            _to_device(text_model, device)
        self.tm = text_model
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16
        self._device = self.tm.device
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    # -- requests ------------------------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            return [self.tm.eos_id], self.tm.encode(continuation)
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        whole, ctx = self.tm.encode(context + continuation), self.tm.encode(context)
        if len(whole) <= len(ctx):  # the continuation merged into the context's last piece
            return whole[:-1] or [self.tm.eos_id], whole[-1:]
        return ctx, whole[len(ctx):]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*r.args) for r in requests]
        out = self.tm.continuation_logprobs(pairs, self.batch_size)
        for r, o in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", r.args, o)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for r in requests:
            wins = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tm.encode(r.args[0]), prefix_token=self.tm.eos_id,
                max_seq_len=self.tm.seq_len, context_len=1)]
            total = sum(lp for lp, _ in self.tm.continuation_logprobs(wins, self.batch_size)) if wins else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation settings go through :meth:`TextModel.generate_batch` together
        (``batch_size`` at a time, KV cache); results in request order."""
        groups: dict[str, list[int]] = {}
        settings = [self._settings(r.args[1]) for r in requests]
        for i, st in enumerate(settings):
            groups.setdefault(repr(st), []).append(i)
        out: list[str | None] = [None] * len(requests)
        for idx in groups.values():
            n, temperature, top_k, seed, until = settings[idx[0]]
            for b in range(0, len(idx), self.batch_size):
                chunk = idx[b:b + self.batch_size]
                texts = self.tm.generate_batch([requests[i].args[0] for i in chunk], n, temperature, top_k, seed, until)
                for i, text in zip(chunk, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]

    @staticmethod
    def _settings(kw) -> tuple:
        kw = dict(kw or {})
        until = kw.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample", False) else 0.0
        return int(kw.get("max_gen_toks", 256)), temperature, int(kw.get("top_k", 0) or 0), int(kw.get("seed", 0) or 0), until

    # -- data parallel under torch.distributed --------------------------------------------------------
    def all_gather(self, tensor):
        import torch
        import torch.distributed as dist

        if self.world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.cat([p.reshape(-1) if p.dim() == 0 else p for p in parts])

    def gather_object(self, obj, dst=0):
        import torch.distributed as dist

        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.world_size > 1:
            dist.barrier()


def _to_device(tm, device: str | None) -> None:
    """The harness CLI asks for ``cuda`` by default: honour it when there is one, else stay on the CPU."""
    import torch

    if not device or device == "cpu" or (device.startswith("cuda") and not torch.cuda.is_available()):
        return
    tm.model.to(device)
    tm.device = torch.device(device)
