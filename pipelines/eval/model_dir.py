"""A registered text model's directory (the pyfunc artifact ``model_dir``): what it holds (``model.pt``,
``model_args.json``, ``tokenizer.model``), its download from the registry, and loading it as plain torch
(:func:`load_registered`). The pyfunc that serves it is :mod:`pipelines.eval.serving`; the text model over it is
:mod:`pipelines.eval.lm`.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import mlflow.artifacts
import sentencepiece as spm
import yaml

from pipelines import tracking
from pipelines.exit_codes import RETRY
from pipelines.manifest import plain_rel
from pipelines.spec import redact
from pipelines.train.ckpt.dcp_read import load_plain_model

MODEL_DIR = "model_dir"  # the artifact key
FILES = ("model.pt", "model_args.json", "tokenizer.model")


def params_of(model_dir: Path) -> int:
    """The parameter count of a model directory (or checkpoint), from its ``model_args.json``."""
    from pipelines.train.model import ModelArgs, param_count

    return param_count(ModelArgs(**json.loads((Path(model_dir) / "model_args.json").read_text())))


def loads_here(spec, model_dir: Path) -> bool:
    """Whether this process (the Airflow worker) may load the model: at most ``eval.single_process_max_params``;
    a bigger one is loaded on the launcher's ranks."""
    return params_of(model_dir) <= spec.eval.single_process_max_params


def download(uri: str, tracking_uri: str | None = None, dst: str | Path | None = None) -> Path:
    """Local copy of a logged/registered model (``models:/NAME@ALIAS``, ``models:/NAME/V``, ``runs:/…``)."""
    from mlflow.exceptions import MlflowException

    tracking_uri = tracking_uri or tracking.default_tracking_uri()
    try:
        with tracking.using(tracking_uri):  # models:/ URIs resolve against the process-global registry URI
            local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst) if dst else None)
    except MlflowException as e:
        where = f"{uri} from {redact(tracking_uri or 'the default tracking store')}: {redact(e.message)}"
        if not tracking.mlflow_answered(e):
            raise ModelUnavailable(f"could not load {where} (the tracking server did not answer: run it again)") \
                from None
        raise LookupError(f"cannot load {where}") from None
    return Path(local)


class ModelUnavailable(LookupError):
    """A model the tracking server did not return (down, a 5xx): exit 75 (``exit_code``), not the user's to fix."""

    exit_code = RETRY


def download_model_dir(uri: str, tracking_uri: str | None, dst: str | Path) -> Path:
    """The model directory of a logged/registered model, fetched into ``dst`` without the model's other artifacts
    (the ``hf/`` export logged beside it would double the bytes): its ``MLmodel`` first, then the directory that
    names (where MLflow puts it: under its own path for ``models:/``, by its last name for other URIs)."""
    base = uri.rstrip("/")
    root = download(f"{base}/MLmodel", tracking_uri, dst).parent
    got = download(f"{base}/{model_dir_path(root)}", tracking_uri, dst)
    if not got.resolve().is_relative_to(Path(dst).resolve()):
        raise LookupError(f"{uri}: its model directory was not fetched into {dst} ({got})")
    return checked(got)


def model_dir_path(local: Path) -> str:
    """Where the model directory lies in a pyfunc model (``artifacts/model_dir``), from its ``MLmodel``: a plain
    relative path that stays inside the model."""
    mlmodel = yaml.safe_load((local / "MLmodel").read_text())
    arts = mlmodel.get("flavors", {}).get("python_function", {}).get("artifacts", {})
    if MODEL_DIR not in arts:
        raise LookupError(f"{local} is not an llm-pipeline text model (no '{MODEL_DIR}' artifact in MLmodel); "
                          "versions registered before the pyfunc format carry a pt2 logits export only")
    rel = arts[MODEL_DIR].get("path") if isinstance(arts[MODEL_DIR], dict) else None
    if not plain_rel(rel):
        raise LookupError(f"{local}/MLmodel: the '{MODEL_DIR}' artifact's path {rel!r} is not a plain relative path")
    return rel


def checked(d: Path) -> Path:
    """``d``, a model directory holding every file of :data:`FILES`."""
    missing = [f for f in FILES if not (d / f).is_file()]
    if missing:
        raise LookupError(f"{d}: missing {missing}")
    return d


def load_registered(uri: str, tracking_uri: str | None = None):
    """(``Transformer`` in eval mode, ``SentencePieceProcessor``) of a registered text model."""
    with tempfile.TemporaryDirectory(prefix="llmp-model-") as tmp:  # both read into memory: nothing left behind
        d = download_model_dir(uri, tracking_uri, tmp)
        return load_plain_model(d), spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
