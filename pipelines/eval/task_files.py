"""Our offline evaluation tasks: their names, their files and the text of their items (light: no lm_eval import).

The tasks are lm-evaluation-harness tasks of our own (``tasks/*.yaml``): the prompts and metrics of upstream's
``arc_easy``, ``hellaswag`` and ``lambada_openai``, on local slices of the same data (``eval.data_dir``, by default
the first 500 items this repo ships in ``data/eval``). They carry names of their own, ``llmp_<upstream>``, and a
version that says slice and source, because a score on 100 or 500 items of a slice is not upstream's number.

``item_texts`` gives what the decontamination stage looks for in the training data: the text a model would have to
have seen to be advantaged on an item (question and correct answer; context and correct ending; the passage), and the
part of it that also gives the item away on its own (the question; the context), since a copy on the web often puts a
label between the two ("Q: … A: …").
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


class Layout(str):
    """An item's text as the evaluation shows it to the model (the task's prompt with the correct answer): looked for
    whatever its length, since its labels ("Question: … Answer: …") make even a short item a distinctive run."""


@dataclass(frozen=True)
class OfflineTask:
    name: str          # ours, as --tasks and eval.tasks take it
    upstream: str      # the lm-evaluation-harness task whose prompts and metrics it uses
    file: str          # in eval.data_dir
    item_text: Callable[[dict], list[str]]  # an item's texts: the whole of it, then a part that may appear alone


def _arc(r: dict) -> list[str]:
    q = r["question"]
    answer = next((c["text"] for c in q["choices"] if c["label"] == r["answerKey"]), "")
    return [f"{q['stem']} {answer}", q["stem"], Layout(f"Question: {q['stem']}\nAnswer: {answer}")]  # llmp_arc_easy.yaml


def _hellaswag(r: dict) -> list[str]:
    ending = r["endings"][int(r["label"])]
    # the harness's query is "<activity_label>: <ctx>" (then the ending): the label is part of what the model sees
    return [f"{r['ctx']} {ending}", r["ctx"], Layout(f"{r['activity_label']}: {r['ctx']} {ending}")]


TASKS: dict[str, OfflineTask] = {t.name: t for t in (
    OfflineTask("llmp_arc_easy", "arc_easy", "arc_easy_test.jsonl", _arc),
    OfflineTask("llmp_hellaswag", "hellaswag", "hellaswag_val.jsonl", _hellaswag),
    OfflineTask("llmp_lambada_openai", "lambada_openai", "lambada_openai_test.jsonl", lambda r: [Layout(r["text"])]),
)}
FILES = {name: t.file for name, t in TASKS.items()}


def unknown_tasks(names) -> str:
    """'' when every name is one of ours, else the message that says what to write instead."""
    bad = [n for n in names if n not in TASKS]
    if not bad:
        return ""
    hints = [f"{n} → llmp_{n}" for n in bad if f"llmp_{n}" in TASKS]
    return (f"unknown task(s) {bad}: the offline tasks are {list(TASKS)}"
            + (f" (upstream's names are the full hub sets; ours are local slices: {', '.join(hints)})" if hints else ""))


def read_rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def item_texts(task: str, path: Path) -> list[list[str]]:
    """The items of ``task`` in file order (item i = line i, the order ``--limit`` takes them in), each as its texts."""
    return [TASKS[task].item_text(r) for r in read_rows(path)]


def reference_items(paths: list[Path]) -> list[list[str]]:
    """The reference set as items: each paragraph (blank-line separated) of a text file, each record of a JSONL file."""
    out: list[str] = []
    for p in paths:
        if p.suffix == ".jsonl":
            out += [r.get("text", "") for r in read_rows(p)]
        else:
            out += [b for b in p.read_text(encoding="utf-8").replace("\r\n", "\n").split("\n\n") if b.strip()]
    return [[t] for t in out]


def _require(files: list[Path], message: str) -> list[Path]:
    from pipelines.spec import SpecError

    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise SpecError(message.format(missing=missing))
    return files


def reference_files(spec) -> list[str]:
    """The reference set's files (``eval.reference``), each checked to exist."""
    from pipelines.spec import resolve_bundled

    files = _require([resolve_bundled(p) for p in spec.eval.reference],
                     "eval.reference: no such file(s) {missing}; list UTF-8 text or JSONL files")
    return [str(p) for p in files]


def task_files(spec) -> list[Path]:
    """The files of ``eval.tasks`` in ``eval.data_dir``, each checked to exist."""
    from pipelines.spec import resolve_bundled

    d = resolve_bundled(spec.eval.data_dir)
    return _require([d / FILES[t] for t in spec.eval.tasks],
                    f"eval.data_dir: {d} lacks {{missing}} (the repo ships data/eval; ../shared/data/eval has the "
                    "full sets); or drop the task from eval.tasks")
