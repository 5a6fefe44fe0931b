"""Hooks that run in every interpreter of the project's venv (a ``.pth`` file in site-packages), importing nothing
until the module they fix is imported.

* **lm-evaluation-harness**: ``lm_eval --model llm-pipeline`` works from the harness's own command line. The harness
  finds models only in its registry, which it fills when ``lm_eval.models`` is first imported, and it reads no plugin
  entry points: once that module has run, ``llm-pipeline`` is registered as a lazy entry
  (``pipelines.eval.lm_eval_model:PipelineLM``), so our module loads only when someone asks for that model.
* **MLflow's SQL model registry** (3.17) accepts ``model_id`` in ``create_model_version`` but has no column for it, so
  every version read back says ``model_id=None`` although its ``source`` is ``models:/<model_id>`` (how the MLflow UI
  finds the LoggedModel). Once ``mlflow.store.model_registry.dbmodels.models`` is imported, a version read from
  the database gets its ``model_id`` back from that source (nothing is written; other sources are left alone).

``install()`` writes ``llm_pipeline_hooks.pth`` (``make`` does it; or ``python -c "from pipelines.site_hooks import
install; install()"``).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import sysconfig
from pathlib import Path
from typing import Callable

LM_NAME = "llm-pipeline"
LM_TARGET = "pipelines.eval.lm_eval_model:PipelineLM"
PTH = "llm_pipeline_hooks.pth"
OLD_PTH = "llm_pipeline_lm_eval.pth"
PTH_LINE = 'import sys; exec("try:\\n import pipelines.site_hooks as h; h.hook()\\nexcept Exception: pass")\n'


def register_lm() -> None:
    from lm_eval.api.registry import model_registry

    if LM_NAME not in model_registry:
        model_registry.register(LM_NAME, target=LM_TARGET)


def model_id_of(source: str | None) -> str | None:
    """``m-…`` of a ``models:/m-…`` source (a LoggedModel), else None (``models:/NAME/V``, ``runs:/…``, a path)."""
    rest = (source or "").removeprefix("models:/")
    return rest if rest != source and rest.startswith("m-") and "/" not in rest else None


def patch_sql_versions() -> None:
    from mlflow.store.model_registry.dbmodels.models import SqlModelVersion

    to_entity = SqlModelVersion.to_mlflow_entity
    if getattr(to_entity, "llmp_patched", False):
        return

    def to_mlflow_entity(self):
        mv = to_entity(self)
        if mv.model_id is None:
            mv._model_id = model_id_of(mv.source)
        return mv

    to_mlflow_entity.llmp_patched = True
    SqlModelVersion.to_mlflow_entity = to_mlflow_entity


HOOKS: dict[str, Callable[[], None]] = {
    "lm_eval.models": register_lm,
    "mlflow.store.model_registry.dbmodels.models": patch_sql_versions,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then`` right after module ``name`` has been executed (once)."""

    def __init__(self, name: str, then: Callable[[], None]):
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once; and find the real spec without us in the way
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run, then = spec.loader.exec_module, self.then

        def exec_module(module):
            run(module)
            then()

        spec.loader.exec_module = exec_module
        return spec


def hook() -> None:
    for name, then in HOOKS.items():
        if name in sys.modules:
            then()
        elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport(name, then))


def install(site_dir: str | None = None) -> Path:
    site = Path(site_dir or sysconfig.get_paths()["purelib"])
    (site / OLD_PTH).unlink(missing_ok=True)  # the hook's earlier name (lm-eval only)
    path = site / PTH
    path.write_text(PTH_LINE)
    return path
