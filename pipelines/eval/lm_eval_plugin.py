"""Makes ``lm_eval --model llm-pipeline`` work from the harness's own command line.

lm-evaluation-harness finds models only in its registry, which it fills when ``lm_eval.models`` is first
imported; it reads no plugin entry points. ``install()`` writes ``llm_pipeline_lm_eval.pth`` into
site-packages (``make`` does it; or ``python -c "from pipelines.eval.lm_eval_plugin import install; install()"``). At interpreter
start that file calls :func:`hook`, which imports nothing: it puts one finder on ``sys.meta_path`` that
waits for ``lm_eval.models`` and, once it has run, registers ``llm-pipeline`` as a lazy entry
(``pipelines.eval.lm_eval_model:PipelineLM``), so our module loads only when someone asks for that model.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import sysconfig
from pathlib import Path

NAME = "llm-pipeline"
TARGET = "pipelines.eval.lm_eval_model:PipelineLM"
WATCH = "lm_eval.models"
PTH = "llm_pipeline_lm_eval.pth"
PTH_LINE = 'import sys; exec("try:\\n import pipelines.eval.lm_eval_plugin as p; p.hook()\\nexcept Exception: pass")\n'


def register() -> None:
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target=TARGET)


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != WATCH:
            return None
        sys.meta_path.remove(self)  # once; and find the real spec without us in the way
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            register()

        spec.loader.exec_module = exec_module
        return spec


def hook() -> None:
    if WATCH in sys.modules:
        register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def install(site_dir: str | None = None) -> Path:
    path = Path(site_dir or sysconfig.get_paths()["purelib"]) / PTH
    path.write_text(PTH_LINE)
    return path

