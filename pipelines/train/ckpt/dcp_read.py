"""Reading a DCP checkpoint without running code from storage.

torch's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with a plain ``pickle.load`` and its planner loads
every non-tensor value (the optimizer's ``param_groups``: learning rates, betas, flags) with
``torch.load(weights_only=False)``: a ``.metadata`` or a shard rewritten on L1, L2 or a node's disk would run
whatever it names when a restore, an evaluation or a registration reads the step. Here the metadata is unpickled
by an unpickler that builds only the classes a DCP metadata file holds (:data:`ALLOWED`), anything else refused
with :class:`UnsafeCheckpoint`, and each non-tensor value is first loaded with ``weights_only=True`` (plain
containers and numbers), the same bytes then handed to torch's planner. Tensors torch already reads with
``weights_only=True``.
"""
from __future__ import annotations

import io
import json
import pickle
import warnings
from pathlib import Path

import torch

from pipelines.train.ckpt.protocol import CheckpointError, UnsafeCheckpoint

METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # its classes (dataclasses, an enum), all of them
ALLOWED = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},  # where each item lies in which shard file
    "pathlib": {"PosixPath", "PurePosixPath"},  # a shard's relative path
    "torch.serialization": {"_get_layout"},  # a tensor's layout, by name (torch.strided)
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == METADATA_MODULE:
            import torch.distributed.checkpoint.metadata as md

            found = getattr(md, name, None)
            if isinstance(found, type) and found.__module__ == METADATA_MODULE:
                return found
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        elif name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{module}.{name} is not part of a DCP checkpoint's metadata")


def read_metadata(path: Path):
    """The metadata of the DCP checkpoint in directory ``path`` (``torch.distributed.checkpoint.metadata.Metadata``),
    unpickled by :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata

    data = (path / ".metadata").read_bytes()
    try:
        got = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"{path}/.metadata: {e}: refusing this checkpoint (it was not written by DCP, or was "
                               "changed since)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}/.metadata cannot be read as DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(got, Metadata):
        raise UnsafeCheckpoint(f"{path}/.metadata holds a {type(got).__name__}, not DCP metadata")
    return got


def safe_classes() -> tuple[type, type]:
    """(``SafeReader``, ``SafePlanner``): torch's ``FileSystemReader`` whose metadata comes from
    :func:`read_metadata`, and its ``DefaultLoadPlanner`` that loads a non-tensor value only when
    ``weights_only=True`` can (plain containers, numbers, strings, tensors; anything else is
    :class:`UnsafeCheckpoint`). Built on first use: importing ``torch.distributed.checkpoint`` loads packages a
    served model does not declare (sympy, zstandard), and serving never reads a DCP checkpoint."""
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _build_classes()
    return _CLASSES


_CLASSES: tuple[type, type] | None = None


def _build_classes() -> tuple[type, type]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def __init__(self, path: str | Path):
            super().__init__(str(path))
            self.dir = Path(path)

        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(self.dir)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            data = value.read()
            try:
                torch.load(io.BytesIO(data), weights_only=True)
            except pickle.UnpicklingError as e:
                raise UnsafeCheckpoint(f"{read_item.dest_index.fqn}: the value stored for it names what a checkpoint "
                                       f"does not hold ({str(e).splitlines()[0][:200]}); refusing this checkpoint") from None
            super().load_bytes(read_item, io.BytesIO(data))

    return SafeReader, SafePlanner


def load(state: dict, path: Path, **kwargs) -> None:
    """``dcp.load`` of ``state`` from the checkpoint directory ``path`` through the reader and planner of
    :func:`safe_classes` (``kwargs``: ``process_group``, ``no_dist``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    read_metadata(path)  # a forged metadata file refused with its own error, before DCP wraps it
    reader, planner = safe_classes()
    try:
        dcp.load(state, storage_reader=reader(path), planner=planner(), **kwargs)
    except CheckpointException as e:  # a rank's refusal, as itself (the caller's CheckpointError, exit 2)
        unsafe = next((exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeCheckpoint)), None)
        if unsafe is None:
            raise
        raise unsafe from None


def load_plain_model(ckpt_dir: Path):
    """A plain ``Transformer`` (eval mode, CPU) from a committed checkpoint directory: a DCP checkpoint
    (resharded from whatever layout wrote it; no process group needed) or a legacy ``model.pt``."""
    from pipelines.train.model import ModelArgs, Transformer

    model = Transformer(ModelArgs(**json.loads((ckpt_dir / "model_args.json").read_text())))
    if (ckpt_dir / ".metadata").is_file():
        sd = model.state_dict()
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load({"model": sd}, ckpt_dir, no_dist=True)
        model.load_state_dict(sd)  # strict: every name and shape matched
    else:
        model.load_state_dict(torch.load(ckpt_dir / "model.pt", map_location="cpu", weights_only=True))
    return model.eval()
