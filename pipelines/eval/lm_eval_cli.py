"""lm-evaluation-harness's own command line, with our model registered as ``llm-pipeline``.

The harness finds models only in its registry and reads no plugin entry points, so its ``lm_eval`` script cannot
know ours; this module imports :mod:`pipelines.eval.lm_eval_model` (which registers ``llm-pipeline``) and hands
every flag to the harness's CLI unchanged:

    python -m pipelines.eval.lm_eval_cli --model llm-pipeline --model_args uri=models:/NAME@champion \\
        --include_path pipelines/eval/tasks --tasks llmp_arc_easy --limit 20
"""
from __future__ import annotations

import pipelines.eval.lm_eval_model  # noqa: F401 - registers llm-pipeline


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
