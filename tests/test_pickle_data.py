"""The data-only pickle reader (``pipelines/train/ckpt/pickle_data.py``): plain data and allowed classes read as
``pickle.loads`` reads them (protocols 4 and 5: what DCP writes); a stream that would call, change or name anything else is refused
and changes nothing."""
import collections
import dataclasses
import pickle
import random
from pathlib import PurePosixPath

import pytest

from pipelines.train.ckpt import pickle_data
from pipelines.train.ckpt.protocol import UnsafeCheckpoint


@dataclasses.dataclass
class Chunk:
    offsets: tuple
    sizes: tuple


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str
    n: int = 0


class WithState:
    def __init__(self, v=None):
        self.v = v

    def __getstate__(self):
        return (self.v,)

    def __setstate__(self, state):
        (self.v,) = state


ALLOWED = {(__name__, "Chunk"): Chunk, (__name__, "Frozen"): Frozen, (__name__, "WithState"): WithState,
           ("pathlib", "PurePosixPath"): PurePosixPath, ("collections", "OrderedDict"): collections.OrderedDict}


def allow(module, name):
    if (module, name) in ALLOWED:
        return ALLOWED[(module, name)]
    raise UnsafeCheckpoint(f"{module}.{name} is not allowed")


def _plain(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bytes", "none", "bool"] + (["list", "tuple", "dict", "set"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, 1, -1, 255, 256, 65535, 65536, 2 ** 31, -2 ** 63, 2 ** 100])
    if kind == "float":
        return rng.uniform(-1e9, 1e9)
    if kind == "str":
        return "".join(rng.choice("ab é\u2581\n") for _ in range(rng.randrange(0, 300)))
    if kind == "bytes":
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
    if kind in ("none", "bool"):
        return rng.choice([None, True, False])
    items = [_plain(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    hashable = [i for i in items if isinstance(i, (int, float, str, bytes, type(None)))]
    return set(hashable) if kind == "set" else {str(k): v for k, v in zip(range(len(items)), items)}


@pytest.mark.parametrize("protocol", range(4, pickle.HIGHEST_PROTOCOL + 1))  # DCP writes 4
def test_plain_data_and_allowed_objects_read_as_pickle_reads_them(protocol):
    rng = random.Random(protocol)
    for _ in range(200):
        value = _plain(rng)
        assert pickle_data.loads(pickle.dumps(value, protocol=protocol), allow) == value
    shared = [1, 2]
    value = {"chunks": [Chunk((0, 1), (2, 3)), Chunk((4,), (5,))], "frozen": Frozen("x", 3), "state": WithState(7),
             "path": PurePosixPath("a/b.distcp"), "ordered": collections.OrderedDict(a=1, b=2),
             "same": (shared, shared)}
    got = pickle_data.loads(pickle.dumps(value, protocol=protocol), allow)
    assert got["chunks"] == value["chunks"] and got["frozen"] == value["frozen"] and got["state"].v == 7
    assert got["path"] == value["path"] and got["ordered"] == value["ordered"]
    assert got["same"][0] is got["same"][1]  # the memo: one object, as written


class Runs:
    def __reduce__(self):
        return (print, ("ran",))


def u(text: str) -> bytes:
    """BINUNICODE of ``text``."""
    return b"X" + len(text.encode()).to_bytes(4, "little") + text.encode()


def g(module: str, name: str) -> bytes:
    """GLOBAL ``module.name``."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


P2 = b"\x80\x02"


@pytest.mark.parametrize("stream, why", [
    (pickle.dumps(Runs()), "builtins.print is not allowed"),
    # a class's attribute set through BUILD's slot state: every later containment check would pass
    (P2 + g("pathlib", "PurePosixPath") + b"N}" + u("is_relative_to") + g("pathlib", "PurePosixPath") + b"s\x86b.",
     "BUILD of a type this stream did not create"),
    (P2 + g(__name__, "Chunk") + b"}" + u("offsets") + b"K\x01sb.", "BUILD of a type this stream did not create"),
    (P2 + g("collections", "OrderedDict") + b")R}" + u("__class__") + g("collections", "OrderedDict") + b"sb.",
     "BUILD of a OrderedDict with a state"),
    (P2 + b"]q\x00(K\x01h\x00e.", None),  # a list that holds itself: plain data, allowed
    (P2 + b"K\x01K\x02R.", "REDUCE of int"),
    (P2 + b"P0\n.", "opcode PERSID"),
    (P2 + b"\x82\x01.", "opcode EXT1"),
    (b"(" + u("a") + b"i" + b"pathlib\nPurePosixPath\n.", "opcode INST"),
    (P2 + b"h\x05.", "nothing stored there"),
    (P2 + b"K\x01K\x02.", "does not end with one object"),
    (P2 + g("collections", "OrderedDict") + b"K\x01a.", "fills a type"),
])
def test_a_stream_that_would_call_change_or_name_anything_else_is_refused(stream, why):
    is_relative_to, fields = PurePosixPath.is_relative_to, dict(vars(Chunk))
    if why is None:
        got = pickle_data.loads(stream, allow)
        assert got[1] is got
        return
    with pytest.raises(UnsafeCheckpoint, match=why):
        pickle_data.loads(stream, allow)
    assert PurePosixPath.is_relative_to is is_relative_to and dict(vars(Chunk)) == fields


def test_a_stream_larger_than_any_metadata_is_refused_unread(monkeypatch):
    monkeypatch.setattr(pickle_data, "MAX_BYTES", 100)
    with pytest.raises(UnsafeCheckpoint, match="more than a checkpoint's metadata holds"):
        pickle_data.loads(pickle.dumps("x" * 200), allow)
