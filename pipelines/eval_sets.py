"""The evaluation sets, read by evaluation and by decontamination alike (so at the root, below both planes): the
reference set's identity (:func:`set_sha256`) and the evaluation tasks, any task lm-evaluation-harness knows, built through its own ``TaskManager`` and task objects.

``eval.tasks`` names tasks, groups or tags of lm-eval's own task folder, of ours (``tasks/*.yaml``) and of the
folders in ``eval.include_path`` (as lm-eval's ``--include_path``; a folder listed later overrides a name listed
earlier). Ours, ``llmp_arc_easy``, ``llmp_hellaswag`` and ``llmp_lambada_openai``, are the prompts and metrics of
upstream's ``arc_easy``, ``hellaswag`` and ``lambada_openai`` on local slices of the same data (``eval.data_dir``, by
default the first 500 items this repo ships in ``data/eval``), under names and versions of their own: a score on a
slice is not upstream's number. They are the offline default.

Tasks are built offline (``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` = 1 unless already set): a task whose data is
neither local nor in the Hugging Face cache cannot be built, and :func:`eval_tasks` (the stages' spec check) says
which and why; a failure of the machine's (a cache file's lock, a disk) is raised as it is, for a retry. Building
the index of lm-eval's own ~15,000 task configs takes seconds, so it is built only when a name is not found among
ours and ``eval.include_path``, and once per process.

A task's identity (:func:`task_digest`) is the sha256 of its items as lm-eval renders them (prompt, choices, correct
answers, in ``eval_docs`` order): the same for the decontaminate stage's record and the evaluation, whatever the
task's data source. The evaluation's stage key also covers the task's settings (:func:`task_settings`: its lm-eval
config and lm-eval's version), which decontamination does not depend on. Light at import: lm_eval is imported by
the functions that need it.
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import inspect
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import httpx
import httpx2

from pipelines.manifest import sha256_file
from pipelines.spec import SpecError, resolve_bundled, resolve_path

TASKS_DIR = Path(__file__).resolve().parent / "eval" / "tasks"
# ours (tasks/*.yaml): name → its file in eval.data_dir (tasks/offline_data.py reads it)
FILES = {"llmp_arc_easy": "arc_easy_test.jsonl", "llmp_hellaswag": "hellaswag_val.jsonl",
         "llmp_lambada_openai": "lambada_openai_test.jsonl"}
TASKS = tuple(FILES)


def offline() -> None:
    """No network for the harness's datasets unless the environment says otherwise (before ``datasets`` loads)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@lru_cache(maxsize=8)
def _manager(include: tuple[str, ...], data_dir: str | None, defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(TASKS_DIR), *include], include_defaults=defaults,
                       metadata={"data_dir": data_dir} if data_dir else None)


def task_manager(data_dir: str | None = None, include_path=(), defaults: bool = False):
    """lm-eval's ``TaskManager`` over ours and ``include_path`` (folders, resolved against the project root), with
    lm-eval's own tasks when ``defaults``; one per process and arguments."""
    dirs = tuple(str(resolve_path(p)) for p in include_path)
    missing = [d for d in dirs if not Path(d).is_dir()]
    if missing:
        raise SpecError(f"eval.include_path: no such folder(s) {missing}; list folders of lm-eval task YAMLs")
    return _manager(dirs, data_dir, defaults)


def manager_for(names, data_dir: str | None = None, include_path=()):
    """The ``TaskManager`` that knows every name: ours and ``include_path`` alone when each name is a task of theirs
    (milliseconds; a group or tag there may list lm-eval's own tasks), else with lm-eval's own tasks (seconds); a name
    none knows is a :class:`SpecError` with the names closest to it."""
    tm = task_manager(data_dir, include_path)
    if all(n in tm.all_subtasks for n in names):
        return tm
    tm = task_manager(data_dir, include_path, defaults=True)
    for n in names:
        if n not in tm.all_tasks and not Path(n).is_file():  # lm-eval also takes a task YAML's path
            close = difflib.get_close_matches(n, tm.all_tasks, n=5, cutoff=0.6)
            raise SpecError(f"eval.tasks: unknown task {n!r}: no lm-eval task, group or tag has that name (lm-eval's "
                            "own, pipelines/eval/tasks, eval.include_path)"
                            + (f"; close matches: {', '.join(close)}" if close else ""))
    return tm


def _why(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def build_tasks(names, data_dir: str | None = None, include_path=()) -> dict:
    """{name: lm-eval task object} for every task ``names`` stand for (a group or tag gives its tasks), built offline
    as the evaluation builds them; a task that cannot be, for a reason of the spec's (:func:`spec_fault`), is a
    :class:`SpecError` naming it and saying why; any other failure (a cache file's lock, a disk) is raised as it is,
    so the stage fails and is retried."""
    offline()
    tm = manager_for(names, data_dir, include_path)
    out: dict = {}
    for n in names:
        try:
            out.update(tm.load([n])["tasks"])
        except Exception as e:  # noqa: BLE001 - spec_fault says whose it is; the machine's is raised
            if not spec_fault(e):
                raise
            hint = f"; llmp_{n} is its local slice" if f"llmp_{n}" in FILES else ""
            raise SpecError(f"eval.tasks: task {n!r} cannot be used offline: {_why(e)}{hint} (put its data in the "
                            "Hugging Face cache, or a task YAML over local files in eval.include_path)") from None
    return out


def spec_fault(e: BaseException) -> bool:
    """Is a failure to build a task the spec's to fix: a task YAML or setting lm-eval refuses, a data file that is
    not there (``FileNotFoundError``, also the hub's "no such dataset"), a dataset neither local nor in the Hugging
    Face cache while offline (``ConnectionError`` with ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` on)? Not when
    it, or an error it was raised from, is another ``OSError`` (a file lock of ``datasets`` that times out, a cache
    on a full or failing disk, the hub unreachable while online: an ``httpx2`` transport error too, which is no
    ``OSError``) or a ``MemoryError``: the machine's, retryable. The chain is followed by cause and by context (the
    hub raises its "not found locally" from inside the handler of the transport error)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemoryError) or isinstance(e, OSError) and not (
                isinstance(e, FileNotFoundError) or isinstance(e, ConnectionError) and hub_offline()):
            return False
        if _transport_error(e) and not hub_offline():
            return False
        e = e.__cause__ or e.__context__
    return True


def _transport_error(e: BaseException) -> bool:
    """Is ``e`` an HTTP client's failure to reach a server (a timeout, a refused or reset connection):
    ``httpx2.TransportError`` (huggingface_hub's client) or ``httpx.TransportError``?"""
    return isinstance(e, (httpx.TransportError, httpx2.TransportError))


def hub_offline() -> bool:
    """Does the environment keep ``datasets`` and the hub offline (:func:`offline`, unless the user said otherwise)?"""
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def eval_tasks(spec) -> dict:
    """``eval.tasks`` as lm-eval task objects (:func:`build_tasks`): the stages' spec check."""
    return build_tasks(list(spec.eval.tasks), spec.eval.data_dir, tuple(spec.eval.include_path))


def rendered(task, doc) -> dict:
    """An item as lm-eval's requests show it: the prompt (``doc_to_text``), the choices (``doc_to_choice``, or None)
    and the correct continuation(s) (``doc_to_target``: a choice's index, a text, or a list of them)."""
    prompt, target = task.doc_to_text(doc), task.doc_to_target(doc)
    choices = task.doc_to_choice(doc) if task.config.doc_to_choice is not None else None
    if isinstance(prompt, int):  # several inputs (winogrande): the choices are the prompts, the target follows each
        return {"prompt": choices[prompt], "choices": choices, "answers": [str(target)]}
    targets = target if isinstance(target, list) else [target]
    answers = [choices[t] if choices is not None and isinstance(t, int) else str(t) for t in targets]
    return {"prompt": str(prompt), "choices": choices, "answers": answers}


def task_digest(task, items: list[dict] | None = None) -> str:
    """sha256 of the task's items as rendered (``items``: :func:`rendered` of each of its ``eval_docs``, in order;
    rendered here when not given) and its target delimiter."""
    h = hashlib.sha256(json.dumps(task.config.target_delimiter).encode())
    for r in items if items is not None else (rendered(task, doc) for doc in task.eval_docs):
        h.update(b"\n" + json.dumps(r, sort_keys=True, default=str).encode())
    return h.hexdigest()


def task_settings(task) -> str:
    """What the evaluation does with a task beyond its items, as text that is the same in every process: the task's
    config as lm-eval holds it (``dump_config()``: prompt, metrics, ``num_fewshot``, few-shot settings, filters,
    generation kwargs …; a function as its source) in sorted JSON, and lm-eval's version. The YAML's location
    (``metadata.config_source``) is left out: a moved file is the same task."""
    import lm_eval

    cfg = dict(task.dump_config())
    if isinstance(cfg.get("metadata"), dict):
        cfg["metadata"] = {k: v for k, v in cfg["metadata"].items() if k != "config_source"}
    return json.dumps({"lm_eval": lm_eval.__version__, "config": cfg}, sort_keys=True, default=settings_value)


def settings_value(v) -> str:
    """A config value JSON has no type for: a function's (or class's) source, else its ``str`` without memory
    addresses (``<function f at 0x7f…>`` differs from one process to the next)."""
    if callable(v):
        with contextlib.suppress(TypeError, OSError):
            return inspect.getsource(v)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(v))


def task_ref(name: str, digest: str, settings: str | None = None) -> dict:
    """A task as an input of a stage's key (beside the reference files): its items' digest (decontaminate: the
    items it checks the corpus against), or with ``settings`` (:func:`task_settings`) the digest of both (evaluate:
    the items and how it scores them, so a changed ``num_fewshot`` or metric re-runs it)."""
    if settings is None:
        return {"uri": f"lm-eval:{name}", "sha256": digest}
    both = hashlib.sha256(f"{digest}\n{settings}".encode()).hexdigest()
    return {"uri": f"lm-eval:{name}", "sha256": both, "items_sha256": digest,
            "settings_sha256": hashlib.sha256(settings.encode()).hexdigest()}


def read_rows(path: Path) -> list[dict]:
    """The records of a JSONL file; a line that is not a JSON object, or a file that is not UTF-8, is
    :class:`SpecError` naming the file and the line."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise SpecError(f"{path}:{no}: not JSON ({e.__class__.__name__}: {e}); fix or remove the line") \
                        from None
                if not isinstance(row, dict):
                    raise SpecError(f"{path}:{no}: a record must be a JSON object, got {type(row).__name__}")
                rows.append(row)
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text (byte {e.start}); list UTF-8 text or JSONL files") from None
    return rows


def reference_items(paths: list[Path]) -> list[list[str]]:
    """The reference set as items: each paragraph (blank-line separated) of a text file, each record of a JSONL file
    (its ``text``, a non-empty string: a record without one would check nothing); a file that cannot be read as
    such is :class:`SpecError` (``eval.reference``)."""
    out: list[str] = []
    for p in paths:
        if p.suffix == ".jsonl":
            for no, r in enumerate(read_rows(p), 1):
                if not isinstance(r.get("text"), str) or not r["text"].strip():
                    raise SpecError(f"eval.reference: {p}: record {no} has no text (a non-empty \"text\" string)")
                out.append(r["text"])
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise SpecError(f"eval.reference: {p}: not UTF-8 text (byte {e.start})") from None
        out += [b for b in text.replace("\r\n", "\n").split("\n\n") if b.strip()]
    return [[t] for t in out]


def reference_files(spec) -> list[str]:
    """The reference set's files (``eval.reference``), each checked to exist."""
    files = [resolve_bundled(p) for p in spec.eval.reference]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise SpecError(f"eval.reference: no such file(s) {missing}; list UTF-8 text or JSONL files")
    return [str(p) for p in files]


def set_sha256(files: Sequence[str | Path]) -> str:
    """Identity of a reference set: sha256 of its ``sha256sum``-style listing (file digest, two spaces, name),
    in the order given."""
    listing = "".join(f"{sha256_file(p)}  {Path(p).name}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()
