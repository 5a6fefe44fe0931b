"""A pickle stream read as data: the only code it runs is the constructors of the classes it is allowed to build.

``pickle.Unpickler.find_class`` limits which globals a stream may name, but not what the stream does with them: its
BUILD opcode sets attributes on whatever object is on the stack, a class it named included (a stream that sets
``PurePosixPath.is_relative_to`` to ``PurePosixPath`` makes every later containment check in the process pass), and
REDUCE calls whatever it named. Here the stream is decoded by :func:`pickletools.genops` (which runs nothing) and
interpreted by a small stack machine that knows the opcodes plain data and dataclass-like objects use:

* a global is looked up only through the caller's ``allow(module, name)`` (anything it refuses:
  :class:`~pipelines.train.ckpt.protocol.UnsafeCheckpoint`);
* REDUCE and NEWOBJ call or instantiate only what ``allow`` returned, with plain arguments;
* BUILD changes only an object this load created (never a class, a function, an enum member or anything a global
  named), with its own ``__setstate__`` or by setting its ordinary attributes;
* any other opcode (an extension, a persistent id, INST/OBJ's old forms) is refused.
"""
from __future__ import annotations

import enum
import pickletools
from typing import Any, Callable

from pipelines.train.ckpt.protocol import UnsafeCheckpoint

MAX_BYTES = 1 << 30  # a DCP metadata file of a 405 B model is tens of MB

_LITERALS = {"BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4", "BINFLOAT", "FLOAT", "SHORT_BINUNICODE",
             "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING", "SHORT_BINBYTES",
             "BINBYTES", "BINBYTES8"}
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_EMPTY = {"EMPTY_DICT": dict, "EMPTY_LIST": list, "EMPTY_TUPLE": tuple, "EMPTY_SET": set}
_FROM_MARK = {"TUPLE": tuple, "LIST": list, "FROZENSET": frozenset}


def loads(data: bytes, allow: Callable[[str, str], Any]) -> Any:
    """The object ``data`` pickles, built as the module docstring says; ``allow(module, name)`` returns the global
    or raises :class:`UnsafeCheckpoint`."""
    if len(data) > MAX_BYTES:
        raise UnsafeCheckpoint(f"{len(data):,} bytes: more than a checkpoint's metadata holds")
    m = _Machine(allow)
    for op, arg, _ in pickletools.genops(data):
        if op.name == "STOP":
            return m.result()
        m.step(op.name, arg)
    raise UnsafeCheckpoint("the stream has no STOP")


class _Machine:
    def __init__(self, allow: Callable[[str, str], Any]):
        self.allow, self.stack, self.marks, self.memo = allow, [], [], {}
        self.made: dict[int, Any] = {}  # what this load created, by id (kept alive): the only objects BUILD changes
        self.globals: set[int] = set()  # ids of what ``allow`` returned: callable by REDUCE / NEWOBJ

    def result(self) -> Any:
        if len(self.stack) != 1 or self.marks:
            raise UnsafeCheckpoint("the stream does not end with one object")
        return self.stack[0]

    def step(self, name: str, arg: Any) -> None:  # noqa: C901 - one branch per opcode, a tested kernel
        s = self.stack
        if name in ("PROTO", "FRAME"):
            return
        if name in _LITERALS:
            s.append(arg)
        elif name in _CONSTANTS:
            s.append(_CONSTANTS[name])
        elif name in _EMPTY:
            s.append(_EMPTY[name]())
        elif name == "MARK":
            self.marks.append(len(s))
        elif name in _FROM_MARK:
            s.append(_FROM_MARK[name](self._to_mark()))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            if len(s) < n:
                raise UnsafeCheckpoint(f"{name} on a stack of {len(s)}")
            items = tuple(s[-n:])
            del s[-n:]
            s.append(items)
        elif name == "DICT":
            s.append(self._pairs(self._to_mark(), {}))
        elif name in ("APPEND", "APPENDS"):
            items = [self._pop()] if name == "APPEND" else self._to_mark()
            self._top(list).extend(items)
        elif name in ("SETITEM", "SETITEMS"):
            items = [self._pop(), self._pop()][::-1] if name == "SETITEM" else self._to_mark()
            self._pairs(items, self._top(dict))
        elif name == "ADDITEMS":
            items = self._to_mark()
            self._top(set).update(items)
        elif name == "MEMOIZE":
            self.memo[len(self.memo)] = self._peek()
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            self.memo[arg] = self._peek()
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if arg not in self.memo:
                raise UnsafeCheckpoint(f"{name} {arg}: nothing stored there")
            s.append(self.memo[arg])
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            module, qual = arg.split(" ", 1) if name == "GLOBAL" else self._pop_two_strings()
            found = self.allow(module, qual)
            self.globals.add(id(found))
            s.append(found)
        elif name == "REDUCE":
            args = self._pop()
            self._push_made(self._callable(self._pop(), name), args, call=True)
        elif name == "NEWOBJ":
            args = self._pop()
            self._push_made(self._callable(self._pop(), name), args, call=False)
        elif name == "BUILD":
            state = self._pop()
            self._build(self._peek(), state)
        else:
            raise UnsafeCheckpoint(f"pickle opcode {name} is not one that plain data uses")

    def _pop(self) -> Any:
        if not self.stack or self.marks and self.marks[-1] >= len(self.stack):
            raise UnsafeCheckpoint("an opcode reads past its mark or an empty stack")
        return self.stack.pop()

    def _peek(self) -> Any:
        if not self.stack:
            raise UnsafeCheckpoint("an opcode reads an empty stack")
        return self.stack[-1]

    def _top(self, kind: type) -> Any:
        top = self._peek()
        if not isinstance(top, kind) or id(top) in self.globals:
            raise UnsafeCheckpoint(f"an opcode fills a {type(top).__name__}, not a {kind.__name__} of this stream")
        return top

    def _to_mark(self) -> list:
        if not self.marks:
            raise UnsafeCheckpoint("an opcode reads to a mark that is not there")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        return items

    def _pop_two_strings(self) -> tuple[str, str]:
        qual, module = self._pop(), self._pop()
        if not isinstance(module, str) or not isinstance(qual, str):
            raise UnsafeCheckpoint("STACK_GLOBAL of what is not two names")
        return module, qual

    @staticmethod
    def _pairs(items: list, into: dict) -> dict:
        if len(items) % 2:
            raise UnsafeCheckpoint("a dict of an odd number of items")
        for k, v in zip(items[::2], items[1::2]):
            into[k] = v
        return into

    def _callable(self, fn: Any, op: str) -> Any:
        if id(fn) not in self.globals or not callable(fn):
            raise UnsafeCheckpoint(f"{op} of {type(fn).__name__}, not of a class or function the stream may name")
        return fn

    def _push_made(self, fn: Any, args: Any, call: bool) -> None:
        if not isinstance(args, tuple):
            raise UnsafeCheckpoint("arguments that are not a tuple")
        if not call and not isinstance(fn, type):
            raise UnsafeCheckpoint("NEWOBJ of what is not a class")
        obj = fn(*args) if call else fn.__new__(fn, *args)
        fresh = isinstance(fn, type) and type(obj) is fn and not isinstance(obj, enum.Enum) \
            and id(obj) not in self.globals
        if fresh:
            self.made[id(obj)] = obj
        self.stack.append(obj)

    def _build(self, obj: Any, state: Any) -> None:
        if id(obj) not in self.made:
            raise UnsafeCheckpoint(f"BUILD of a {type(obj).__name__} this stream did not create")
        own = getattr(type(obj), "__setstate__", None)
        if own is not None:
            own(obj, state)
            return
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        for attrs in (state, slots):
            if attrs is None:
                continue
            # public fields only (DCP's dataclasses have no others): a private slot set from the stream could make
            # an object say one thing and be another (a path whose str() is not where it points)
            if not isinstance(attrs, dict) or not all(isinstance(k, str) and not k.startswith("_") for k in attrs):
                raise UnsafeCheckpoint(f"BUILD of a {type(obj).__name__} with a state of {type(attrs).__name__}")
            for k, v in attrs.items():
                object.__setattr__(obj, k, v)
