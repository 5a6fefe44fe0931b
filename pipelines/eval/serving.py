"""The registered model: an MLflow pyfunc that takes text and returns generated text.

Artifacts (one directory, ``artifacts/model_dir``): ``model.pt`` (the plain state dict that
``Transformer.load_state_dict`` takes strictly), ``model_args.json``, ``tokenizer.model``. The code
is this package (``code/pipelines``), so the model loads wherever torch, sentencepiece and numpy are.

    mlflow models serve -m models:/NAME@champion --env-manager local --host 127.0.0.1 --port 5001
    (with the venv's bin on PATH: the server starts ``uvicorn`` from it)
    curl -s 127.0.0.1:5001/invocations -H 'Content-Type: application/json' \\
         -d '{"inputs": ["Once upon a time"], "params": {"max_new_tokens": 32, "temperature": 0.8}}'

Input: strings (one prompt each). Output: one generated continuation per prompt, generated as one batch with a KV
cache (``TextModel.generate_batch``). Params: ``max_new_tokens`` (32; at most the cap the model was registered with,
``eval.max_new_tokens``, 256 by default: more is refused with HTTP 400), ``temperature`` (0.8; 0 = greedy),
``top_k`` (50; 0 = all), ``seed`` (0).

``pipelines.eval.model_dir.load_registered(uri)`` is the plain torch path: (``Transformer`` in eval mode,
SentencePiece processor), without going through pyfunc.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import mlflow.pyfunc
import pandas as pd

import pipelines
from pipelines.eval.model_dir import MODEL_DIR, loads_here, params_of
from pipelines.train.ckpt.dcp_read import load_plain_model

PARAMS = {"max_new_tokens": 32, "temperature": 0.8, "top_k": 50, "seed": 0}
LIMITS = "serving.json"  # {"max_new_tokens": cap}, written at registration from eval.max_new_tokens


class TextGenerator(mlflow.pyfunc.PythonModel):
    """pyfunc: prompts in, generated text out."""

    def load_context(self, context):
        from pipelines.eval.lm import TextModel

        d = Path(context.artifacts[MODEL_DIR])
        self.tm = TextModel.load(d)
        self.max_new_tokens = json.loads((d / LIMITS).read_text())["max_new_tokens"] if (d / LIMITS).is_file() else None

    # The explicit signature below validates the input (a one-column DataFrame by then). The hint is one MLflow
    # infers no schema from: a list[str] hint would take MLflow's type-hint path, which drops the params, and no
    # hint at all makes MLflow warn on every import.
    def predict(self, context, model_input: pd.DataFrame, params=None):
        p = {**PARAMS, **(params or {})}
        check_limits(p, self.max_new_tokens)
        return self.tm.generate_batch(_prompts(model_input), int(p["max_new_tokens"]), float(p["temperature"]),
                                      int(p["top_k"]), int(p["seed"]))


def check_limits(params: dict, cap: int | None) -> None:
    """A request over the cap is the client's error: MLflow's scoring server answers it with HTTP 400."""
    from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException

    n = int(params["max_new_tokens"])
    if n < 0 or (cap is not None and n > cap):
        raise MlflowException(f"max_new_tokens={n} is outside 0..{cap} (the cap this model was registered with, "
                              "eval.max_new_tokens)", error_code=INVALID_PARAMETER_VALUE)


def _prompts(model_input) -> list[str]:
    """A DataFrame (first column), a list, or one string → list of prompts."""
    if hasattr(model_input, "iloc"):
        return [str(x) for x in model_input.iloc[:, 0].tolist()]
    if isinstance(model_input, str):
        return [model_input]
    return [str(x) for x in model_input]


def signature():
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec(k, "long" if isinstance(v, int) else "double", v) for k, v in PARAMS.items()]))


def write_model_dir(model, ckpt_dir: Path, out: Path) -> Path:
    """The artifact directory: the plain state dict of ``model`` plus the checkpoint's args and tokenizer."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "model.pt")
    return _copy_side_files(ckpt_dir, out)


def _copy_side_files(ckpt_dir: Path, out: Path) -> Path:
    for name in ("model_args.json", "tokenizer.model"):
        shutil.copyfile(ckpt_dir / name, out / name)
    return out


def model_dir_for(spec, ckpt_dir: Path, out: Path) -> Path:
    """The artifact directory of a committed checkpoint. A model above ``eval.single_process_max_params`` is not
    loaded here (the Airflow worker): its weights are exported on the launcher's first rank
    (``python -m pipelines.train.checkpoint export``, torchrun or a PyTorchJob)."""
    if loads_here(spec, ckpt_dir):
        return write_model_dir(load_plain_model(ckpt_dir), ckpt_dir, out)

    print(f"[register] {params_of(ckpt_dir):,} params > eval.single_process_max_params: exporting the weights on the launcher's "
          f"first rank ({spec.launcher.kind})", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    from pipelines.launch.ranks import run_ranks  # lazy: the served model imports this module; its requirements
    from pipelines.train import checkpoint as checkpoint_cli  # lazy: (serving.pip_requirements) have no launcher

    run_ranks(spec, checkpoint_cli.__name__, ["export", str(ckpt_dir), str(out / "model.pt")],
              run_id=f"export-{out.parent.name}"[:40], restarts=False)
    return _copy_side_files(ckpt_dir, out)


def log_text_model(model_dir: Path, name: str = "model", max_new_tokens: int | None = None, example: bool = True):
    """Log the pyfunc into the active MLflow run (this package's code travels with it, no caches);
    returns MLflow's ``ModelInfo``. With ``example``, an input example is logged too, and MLflow checks it by
    loading the model here and generating: pass ``example=False`` for a model this process must not load."""
    import torch

    if max_new_tokens is not None:
        (model_dir / LIMITS).write_text(json.dumps({"max_new_tokens": int(max_new_tokens)}))
    sample = (["Once upon a time"], {"max_new_tokens": min(8, max_new_tokens or 8)}) if example else None
    with tempfile.TemporaryDirectory(prefix="llmp-code-") as tmp:
        code = Path(tmp) / "pipelines"
        shutil.copytree(Path(pipelines.__file__).parent, code, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        return mlflow.pyfunc.log_model(
            name=name, python_model=TextGenerator(), artifacts={MODEL_DIR: str(model_dir)},
            code_paths=[str(code)], signature=signature(), input_example=sample,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "sentencepiece", "numpy", "pyarrow",
                              "pydantic", "pyyaml"])
