"""Our model as an lm-evaluation-harness model, scored offline on our tasks (local files) or any task lm-eval knows.

``PipelineLM`` (``pipelines.eval.lm_eval_model``) subclasses ``lm_eval.api.model.LM``
(``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``, batched) over
:class:`~pipelines.eval.lm.TextModel`, and is registered as ``llm-pipeline`` when that module is imported (the
harness reads no plugin entry points); ``pipelines.eval.lm_eval_cli`` is the harness's own CLI with it registered:

    python -m pipelines.eval.lm_eval_cli --model llm-pipeline --model_args uri=models:/NAME@champion \\
        --include_path pipelines/eval/tasks --tasks llmp_arc_easy,llmp_hellaswag,llmp_lambada_openai --limit 20

``--include_path pipelines/eval/tasks`` adds our three tasks: upstream's prompts and metrics of ``arc_easy``,
``hellaswag`` and ``lambada_openai`` on local slices of their data (``tasks/offline_data.py``), under names and
versions of their own, since their scores are not upstream's numbers. Any other task lm-eval knows runs too (its own,
or a task YAML in an ``--include-path`` folder), offline: its data must be local or in the Hugging Face cache. Or,
with no flags to remember:

    python -m pipelines.eval.harness --model-uri models:/NAME@champion \\
        --tasks llmp_arc_easy,llmp_hellaswag,llmp_lambada_openai --limit 20 --output results.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pipelines.eval.lm_eval_model import PipelineLM
from pipelines.exit_codes import USER_ERROR

# TASKS (ours), TASKS_DIR and task_manager are re-exported: calibrate, the benchmarks and the tests take them from here
from pipelines.eval_sets import TASKS, TASKS_DIR, build_tasks, manager_for, offline, task_manager  # noqa: F401
from pipelines.eval.bpb import model_parser
from pipelines.manifest import atomic_write_text


def evaluate(text_model, tasks: list[str], limit: int | None = None, data_dir: str | None = None,
             batch_size: int = 16, include_path=()) -> dict:
    """lm-eval's results dict (``results.<task>.<metric>,<filter>`` …), JSON-safe; every rank must call it. ``tasks``:
    any names lm-eval knows with ``include_path`` (:func:`pipelines.eval_sets.manager_for`)."""
    offline()
    from lm_eval import simple_evaluate
    from lm_eval.utils import handle_non_serializable

    tm = manager_for(tasks, data_dir, include_path)
    res = simple_evaluate(model=PipelineLM(text_model=text_model, batch_size=batch_size), tasks=list(tasks),
                          limit=limit, task_manager=tm, bootstrap_iters=1000,
                          random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    if res is None:  # ranks other than 0
        return {}
    keep = {k: res[k] for k in ("results", "versions", "n-shot", "higher_is_better", "n-samples") if k in res}
    keep["config"] = {"model": "llm-pipeline", "limit": limit, "data_dir": data_dir,
                      "include_path": [str(p) for p in include_path]}
    return json.loads(json.dumps(keep, default=handle_non_serializable))


def headline(results: dict) -> dict[str, float]:
    """Flat numbers (no stderr) for MLflow metrics and version tags, of every task and group and whatever its metrics:
    lm-eval's ``<metric>,<filter>`` keys as ``harness.<task>.<metric>`` (filter ``none``) or
    ``harness.<task>.<metric>.<filter>`` (``exact_match,strict-match`` → ``exact_match.strict-match``)."""
    out = {}
    for task, r in results.get("results", {}).items():
        for k, v in r.items():
            metric, _, filt = k.partition(",")
            if filt and not metric.endswith("_stderr") and isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"harness.{task}.{metric}" + ("" if filt == "none" else f".{filt}")] = float(v)
    return out


def main(argv: list[str] | None = None) -> int:
    from pipelines.eval.lm import TextModel

    ap = model_parser("pipelines.eval.harness", "Run lm-evaluation-harness tasks offline (local files or the Hugging "
                      "Face cache) on a registered model; writes lm-eval's results dict.")
    ap.add_argument("--tasks", default=",".join(TASKS),
                    help=f"Comma-separated lm-eval task names (ours: {', '.join(TASKS)}).")
    ap.add_argument("--include-path", action="append", default=[], metavar="DIR",
                    help="A folder of lm-eval task YAMLs, as lm-eval's --include_path (repeatable).")
    ap.add_argument("--limit", type=int, default=None, help="First N items of each task (file order).")
    ap.add_argument("--output", required=True, help="Where to write the results JSON.")
    ap.add_argument("--data-dir", default=None, help="Our tasks' files (default: the repo's data/eval slices).")
    args = ap.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]

    try:
        build_tasks(tasks, args.data_dir, args.include_path)  # each task can be built offline, or say which and why
        res = evaluate(TextModel.open(args.model_uri, args.tracking_uri), tasks, args.limit, args.data_dir,
                       args.batch_size, args.include_path)
    except (LookupError, ValueError, FileNotFoundError) as e:
        print(f"harness: {e}", file=sys.stderr)
        return getattr(e, "exit_code", USER_ERROR)  # 75: the tracking server did not answer
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.output, json.dumps(res, indent=2))
    for k, v in headline(res).items():
        print(f"{k:40s} {v:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
