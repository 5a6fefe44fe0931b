"""Local files as the datasets of our offline tasks (``llmp_*``, the harness's standard prompts): no hub, no network.

Each loader returns a ``datasets.DatasetDict`` whose rows have the shape of the hub dataset the harness's
own task config expects, so the standard prompts, targets and metrics apply unchanged. Items stay in file
order (``--limit N`` takes the first N). The directory is the ``data_dir`` metadata (``--metadata
'{"data_dir": "../shared/data/eval"}'`` or ``eval.data_dir``), by default the slices this repo ships in
``data/eval``.

HellaSwag: the local file has ``ctx`` (= the hub's ``ctx_a + " " + ctx_b``) but not its two parts; ``ctx_b``
is taken as the text after the last sentence end, which the harness capitalises as it does on the hub data.
"""
from __future__ import annotations

import re
from pathlib import Path

from pipelines.eval_sets import FILES, read_rows
from pipelines.spec import resolve_bundled


def _rows(task: str, data_dir: str | None) -> list[dict]:
    path = resolve_bundled(Path(data_dir or "data/eval") / FILES[task])
    if not path.is_file():
        raise FileNotFoundError(f"{task}: {path} is missing; set eval.data_dir (or --metadata data_dir=…) to a "
                                f"directory holding {FILES[task]}")
    return read_rows(path)


def _split(rows: list[dict], split: str):
    import datasets

    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})


def arc_easy(data_dir: str | None = None, **_):
    """Official ARC JSONL → the hub's ``allenai/ai2_arc`` rows: question, choices {text, label}, answerKey."""
    rows = [{"id": r["id"], "question": r["question"]["stem"], "answerKey": r["answerKey"],
             "choices": {"text": [c["text"] for c in r["question"]["choices"]],
                         "label": [c["label"] for c in r["question"]["choices"]]}} for r in _rows("llmp_arc_easy", data_dir)]
    return _split(rows, "test")


def _ctx_parts(ctx: str) -> tuple[str, str]:
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s)", ctx)]
    if not ends:
        return ctx, ""
    return ctx[:ends[-1]], ctx[ends[-1]:].strip()


def hellaswag(data_dir: str | None = None, **_):
    """Local HellaSwag → the hub's ``Rowan/hellaswag`` rows (ctx_a, ctx_b, endings, label as a string)."""
    rows = []
    for r in _rows("llmp_hellaswag", data_dir):
        a, b = _ctx_parts(r["ctx"])
        rows.append({"ind": r["idx"], "activity_label": r["activity_label"], "ctx": r["ctx"], "ctx_a": a, "ctx_b": b,
                     "endings": r["endings"], "label": str(r["label"])})
    return _split(rows, "validation")


def hellaswag_process_docs(dataset):
    """The harness's own HellaSwag preprocessing (query = label: ctx_a Ctx_b, bracket artifacts removed)."""
    from lm_eval.tasks.hellaswag.utils import process_docs

    return process_docs(dataset)


def lambada_openai(data_dir: str | None = None, **_):
    return _split([{"text": r["text"]} for r in _rows("llmp_lambada_openai", data_dir)], "test")
