"""Reading a DCP checkpoint without running code from storage.

torch's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with a plain ``pickle.load`` and its planner loads
every non-tensor value (the optimizer's ``param_groups``: learning rates, betas, flags) with
``torch.load(weights_only=False)``: a ``.metadata`` or a shard rewritten on L1, L2 or a node's disk would run
whatever it names when a restore, an evaluation or a registration reads the step. Here the metadata is read as
data (:mod:`pipelines.train.ckpt.pickle_data`: only the classes a DCP metadata file holds, :data:`ALLOWED`, are
built, nothing else is called or changed; anything else is :class:`UnsafeCheckpoint`) and every shard it names
must lie in the checkpoint's directory; each non-tensor value is loaded with ``weights_only=True`` (plain
containers and numbers) and handed to torch's planner as our own serialization of what that load built. Tensors
torch already reads with ``weights_only=True``.
"""
from __future__ import annotations

import importlib
import io
import json
import warnings
from pathlib import Path

import torch

from pipelines.manifest import plain_rel
from pipelines.train.ckpt import pickle_data
from pipelines.train.ckpt.protocol import CheckpointError, UnsafeCheckpoint

METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # its classes (dataclasses, an enum), all of them
ALLOWED = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},  # where each item lies in which shard file
    "pathlib": {"PosixPath", "PurePosixPath"},  # a shard's relative path
    "torch.serialization": {"_get_layout"},  # a tensor's layout, by name (torch.strided)
    "collections": {"OrderedDict"},
}


def allow(module: str, name: str):
    """The globals a DCP metadata file may name (:mod:`pipelines.train.ckpt.pickle_data`'s ``allow``)."""
    if module == METADATA_MODULE:
        import torch.distributed.checkpoint.metadata as md

        found = getattr(md, name, None)
        if isinstance(found, type) and found.__module__ == METADATA_MODULE:
            return found
    elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
        return getattr(torch, name)
    elif name in ALLOWED.get(module, ()):
        return getattr(importlib.import_module(module), name)
    raise UnsafeCheckpoint(f"{module}.{name} is not part of a DCP checkpoint's metadata")


def read_metadata(path: Path):
    """The metadata of the DCP checkpoint in directory ``path`` (``torch.distributed.checkpoint.metadata.Metadata``),
    read as data (:mod:`pipelines.train.ckpt.pickle_data`), each shard it names checked to lie in ``path``."""
    from torch.distributed.checkpoint.metadata import Metadata

    where = path / ".metadata"
    with open(where, "rb") as f:
        data = f.read(pickle_data.MAX_BYTES + 1)
    try:
        got = pickle_data.loads(data, allow)
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"{where}: {e}: refusing this checkpoint (it was not written by DCP, or was changed "
                               "since)") from None
    except Exception as e:  # noqa: BLE001 - a file that does not decode, or arguments its classes refuse
        raise CheckpointError(f"{where} cannot be read as DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(got, Metadata):
        raise UnsafeCheckpoint(f"{where} holds a {type(got).__name__}, not DCP metadata")
    check_storage(got, where)
    return got


def check_storage(metadata, where: Path) -> None:
    """Every item's place: a shard file in the checkpoint's own directory (a plain relative name), a non-negative
    offset and length, no transform (DCP writes none unless asked: a stream to decompress could be made to grow
    without bound)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    data = metadata.storage_data
    if not isinstance(data, dict):
        raise UnsafeCheckpoint(f"{where}: storage_data is a {type(data).__name__}, not DCP's")
    for info in data.values():
        # a str as DCP writes it: an object whose str() differs from the path it joins to (a path with a forged
        # private slot) would pass the name check and open another file
        ok = isinstance(info, _StorageInfo) and type(info.relative_path) is str and plain_rel(info.relative_path) \
            and all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)) \
            and not getattr(info, "transform_descriptors", None)
        if not ok:
            raise UnsafeCheckpoint(f"{where}: an item's place ({info!r:.200}) is not a shard file of this checkpoint")


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
            try:
                plain = torch.load(value, weights_only=True)
            except Exception as e:  # noqa: BLE001 - whatever the weights-only loader refuses (names, formats)
                raise UnsafeCheckpoint(f"{read_item.dest_index.fqn}: the value stored for it is not plain data "
                                       f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                                       "refusing this checkpoint") from None
            ours = io.BytesIO()  # what torch's planner loads is our serialization of what the safe load built
            torch.save(plain, ours)
            ours.seek(0)
            super().load_bytes(read_item, ours)

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
