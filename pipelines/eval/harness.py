"""Our model as an lm-evaluation-harness model, and the standard tasks read from local files.

``PipelineLM`` subclasses ``lm_eval.api.model.LM`` (``loglikelihood``, ``loglikelihood_rolling``,
``generate_until``, batched) over :class:`~pipelines.eval.lm.TextModel`, and is registered as
``llm-pipeline``. The installed package registers it in every interpreter (``pipelines.eval.lm_eval_plugin``),
so the harness's own CLI finds it:

    lm_eval --model llm-pipeline --model_args uri=models:/NAME@champion \\
        --include_path pipelines/eval/tasks --tasks arc_easy,hellaswag,lambada_openai --limit 20

``--include_path pipelines/eval/tasks`` swaps the hub datasets of those three tasks for the local files
(same prompts and metrics; see ``tasks/offline_data.py``). Or, with no flags to remember:

    python -m pipelines.eval.harness --model-uri models:/NAME@champion \\
        --tasks arc_easy,hellaswag,lambada_openai --limit 20 --output results.json

Tokenization follows the harness's Hugging Face model: trailing spaces of a context move to the
continuation, the pair is encoded as a whole and split where the context's encoding ends; an empty context
is the EOS token (the document boundary the model was trained on). Under ``torch.distributed`` (the
evaluate stage's ranks) every rank takes a share of the requests and the harness gathers them.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
# the offline tasks and their files in eval.data_dir (the loaders: tasks/offline_data.py)
FILES = {"arc_easy": "arc_easy_test.jsonl", "hellaswag": "hellaswag_val.jsonl", "lambada_openai": "lambada_openai_test.jsonl"}
TASKS = tuple(FILES)


@register_model("llm-pipeline")
class PipelineLM(LM):
    def __init__(self, uri: str | None = None, tracking_uri: str | None = None, text_model=None,
                 batch_size: int | str | None = 16, device: str | None = None, **_ignored):
        super().__init__()
        import torch.distributed as dist

        from pipelines.eval.bpb import load_text_model

        if text_model is None:
            if not uri:
                raise ValueError("llm-pipeline needs --model_args uri=models:/NAME@ALIAS (or a local model directory)")
            text_model = load_text_model(str(uri), tracking_uri)
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
        out = []
        for r in requests:
            context, kw = r.args
            kw = dict(kw or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample", False) else 0.0
            text = self.tm.generate(context, int(kw.get("max_gen_toks", 256)), temperature,
                                    int(kw.get("top_k", 0) or 0), int(kw.get("seed", 0) or 0), stop=until)
            self.cache_hook.add_partial("generate_until", r.args, text)
            out.append(text)
        return out

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


def task_manager(data_dir: str | None = None):
    """The three tasks from local files only (the harness's hub-backed defaults are not indexed)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                       metadata={"data_dir": data_dir} if data_dir else None)


def evaluate(text_model, tasks: list[str], limit: int | None = None, data_dir: str | None = None,
             batch_size: int = 16) -> dict:
    """lm-eval's results dict (``results.<task>.<metric>,none`` …), JSON-safe; every rank must call it."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable

    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}: offline tasks are {list(TASKS)}")
    res = simple_evaluate(model=PipelineLM(text_model=text_model, batch_size=batch_size), tasks=list(tasks),
                          limit=limit, task_manager=task_manager(data_dir), bootstrap_iters=1000,
                          random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    if res is None:  # ranks other than 0
        return {}
    keep = {k: res[k] for k in ("results", "versions", "n-shot", "higher_is_better", "n-samples") if k in res}
    keep["config"] = {"model": "llm-pipeline", "limit": limit, "data_dir": data_dir}
    return json.loads(json.dumps(keep, default=handle_non_serializable))


def headline(results: dict) -> dict[str, float]:
    """Flat ``harness.<task>.<metric>`` numbers (no stderr) for MLflow metrics and version tags."""
    out = {}
    for task, r in results.get("results", {}).items():
        for k, v in r.items():
            if k.endswith(",none") and "stderr" not in k and isinstance(v, (int, float)):
                out[f"harness.{task}.{k.split(',')[0]}"] = float(v)
    return out


def main(argv: list[str] | None = None) -> int:
    from pipelines.eval.bpb import load_text_model, model_parser

    ap = model_parser("pipelines.eval.harness", "Run lm-evaluation-harness tasks offline (local files) on a registered "
                      "model; writes lm-eval's results dict.")
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"Comma-separated, of {', '.join(TASKS)}.")
    ap.add_argument("--limit", type=int, default=None, help="First N items of each task (file order).")
    ap.add_argument("--output", required=True, help="Where to write the results JSON.")
    ap.add_argument("--data-dir", default=None, help="Task files (default: the repo's data/eval slices).")
    args = ap.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    from pipelines.manifest import atomic_write_text

    try:
        res = evaluate(load_text_model(args.model_uri, args.tracking_uri), tasks, args.limit, args.data_dir,
                       args.batch_size)
    except (LookupError, ValueError, FileNotFoundError) as e:
        print(f"harness: {e}", file=sys.stderr)
        return 2
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.output, json.dumps(res, indent=2))
    for k, v in headline(res).items():
        print(f"{k:40s} {v:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
