"""Our model as an lm-evaluation-harness model, and the standard tasks read from local files.

``PipelineLM`` (``pipelines.eval.lm_eval_model``) subclasses ``lm_eval.api.model.LM``
(``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``, batched) over
:class:`~pipelines.eval.lm.TextModel`, and is registered as ``llm-pipeline`` when that module is imported (the
harness reads no plugin entry points); ``pipelines.eval.lm_eval_cli`` is the harness's own CLI with it registered:

    python -m pipelines.eval.lm_eval_cli --model llm-pipeline --model_args uri=models:/NAME@champion \\
        --include_path pipelines/eval/tasks --tasks llmp_arc_easy,llmp_hellaswag,llmp_lambada_openai --limit 20

``--include_path pipelines/eval/tasks`` adds our three tasks: upstream's prompts and metrics of ``arc_easy``,
``hellaswag`` and ``lambada_openai`` on local slices of their data (``tasks/offline_data.py``), under names and
versions of their own, since their scores are not upstream's numbers. Or, with no flags to remember:

    python -m pipelines.eval.harness --model-uri models:/NAME@champion \\
        --tasks llmp_arc_easy,llmp_hellaswag,llmp_lambada_openai --limit 20 --output results.json
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from pipelines.eval.lm_eval_model import PipelineLM

from pipelines.eval.task_files import TASKS as OFFLINE, unknown_tasks

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
TASKS = tuple(OFFLINE)  # ours: llmp_arc_easy, llmp_hellaswag, llmp_lambada_openai (pipelines.eval.task_files)


def task_manager(data_dir: str | None = None):
    """Our three tasks, from local files only (the harness's hub-backed defaults are not indexed)."""
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

    if unknown_tasks(tasks):
        raise ValueError(unknown_tasks(tasks))
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
    from pipelines.eval.bpb import model_parser
    from pipelines.eval.lm import TextModel

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
        res = evaluate(TextModel.open(args.model_uri, args.tracking_uri), tasks, args.limit, args.data_dir,
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
