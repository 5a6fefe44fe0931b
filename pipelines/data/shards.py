"""Sharded, memory-mapped token files.

Each shard is a pair:

* ``NAME.bin``: the token ids of every document back to back, little-endian, ``uint16`` when the
  vocabulary has < 65,536 ids, else ``uint32``; every document ends with the EOS id.
* ``NAME.idx``: Megatron-LM's ``MMIDIDX`` index layout, so Megatron/NeMo can read our shards::

      b"MMIDIDX\\x00\\x00"  magic (9 bytes)
      <Q version = 1
      <B dtype code (8 = uint16; 4 = int32, used for our uint32 ids, which are < 2^31)
      <Q sequence count N (one sequence per document)
      <Q document-index count N + 1
      int32[N]  sequence lengths (tokens, EOS included)
      int64[N]  sequence pointers (byte offsets into .bin)
      int64[N+1] document indices 0..N

Readers memory-map both files; nothing reads a whole shard into memory.
"""
from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
_CODES = {np.dtype(np.uint16): 8, np.dtype(np.uint32): 4, np.dtype(np.int32): 4}
_FROM_CODE = {8: np.uint16, 4: np.uint32, 5: np.int64, 1: np.uint8}


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)


class ShardWriter:
    """Append documents (token id arrays) to ``NAME.bin`` and write ``NAME.idx`` on close."""

    def __init__(self, path_prefix: Path, dtype: np.dtype):
        self.prefix = Path(path_prefix)
        self.dtype = np.dtype(dtype)
        self._bin = open(self.prefix.with_suffix(".bin"), "wb")
        self.lengths: list[int] = []
        self.tokens = 0

    def add(self, ids: np.ndarray) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self.lengths.append(int(arr.size))
        self.tokens += int(arr.size)

    def add_many(self, flat: np.ndarray, lengths: list[int]) -> None:
        """Documents back to back in ``flat`` (already of this shard's dtype), one length each."""
        self._bin.write(flat.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self.lengths.extend(lengths)
        self.tokens += int(flat.size)

    def close(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        write_index(self.prefix.with_suffix(".idx"), np.array(self.lengths, dtype=np.int32), self.dtype)


def write_index(path: Path, lengths: np.ndarray, dtype: np.dtype) -> None:
    n = int(lengths.size)
    pointers = np.zeros(n, dtype=np.int64)
    if n:
        pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", _CODES[np.dtype(dtype)]))
        f.write(struct.pack("<Q", n))
        f.write(struct.pack("<Q", n + 1))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(np.arange(n + 1, dtype="<i8").tobytes())
        f.flush()
        os.fsync(f.fileno())


@dataclass
class Shard:
    """A read-only, memory-mapped shard."""

    bin_path: Path
    tokens: np.ndarray      # memmap over .bin
    lengths: np.ndarray     # memmap over the idx's lengths
    pointers: np.ndarray    # byte offsets

    @classmethod
    def open(cls, prefix: str | Path, dtype: np.dtype | None = None) -> "Shard":
        prefix = Path(prefix)
        if prefix.suffix in (".bin", ".idx"):
            prefix = prefix.with_suffix("")
        idx_path, bin_path = prefix.with_suffix(".idx"), prefix.with_suffix(".bin")
        with open(idx_path, "rb") as f:
            if f.read(9) != MAGIC:
                raise ValueError(f"{idx_path} is not an MMIDIDX index")
            (version,) = struct.unpack("<Q", f.read(8))
            (code,) = struct.unpack("<B", f.read(1))
            (n,) = struct.unpack("<Q", f.read(8))
            (_ndoc,) = struct.unpack("<Q", f.read(8))
            offset = f.tell()
        if version != 1:
            raise ValueError(f"{idx_path}: unsupported index version {version}")
        idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        lengths = np.frombuffer(idx, dtype="<i4", count=n, offset=offset)
        pointers = np.frombuffer(idx, dtype="<i8", count=n, offset=offset + 4 * n)
        dt = np.dtype(dtype) if dtype is not None else np.dtype(_FROM_CODE[code])
        size = bin_path.stat().st_size
        tokens = np.memmap(bin_path, mode="r", dtype=dt.newbyteorder("<"), shape=(size // dt.itemsize,)) \
            if size else np.zeros(0, dtype=dt)
        return cls(bin_path, tokens, lengths, pointers)

    @property
    def num_docs(self) -> int:
        return int(self.lengths.size)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    def doc(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.tokens.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.lengths[i])])


def first_out_of_vocab(ids: np.ndarray, vocab: int) -> Optional[tuple[int, ...]]:
    """The index of the first token id ≥ ``vocab`` in ``ids`` (any shape, row-major order); None when every id is
    below it."""
    if not ids.size or int(ids.max()) < vocab:
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(ids >= vocab)), ids.shape))


def out_of_vocab_message(shard: "Shard", token: int, where: str, vocab: int, whose: str) -> str:
    """One line for a token id outside a vocabulary: the shard that holds it, where it is read, what to do."""
    return (f"{shard.bin_path} holds token id {token} ({where}), outside {whose} vocabulary of {vocab}: that shard was "
            "written by another tokenizer or is damaged; re-run the tokenize stage (a shard that fails its checksum "
            "is written again; run.force=true writes them all)")


class TokenStream:
    """A split's shards, in manifest order, read as one token sequence.

    Training samples and held-out windows are cut from this sequence, so they depend on the documents and their
    order only, not on where tokenization's partitions cut the shards (``local[1]`` and ``local[16]`` train alike).
    """

    def __init__(self, prefixes: list[str | Path]):
        self.shards = [Shard.open(p) for p in prefixes]
        self.starts = [0]
        for s in self.shards:
            self.starts.append(self.starts[-1] + s.num_tokens)

    def __len__(self) -> int:
        return self.starts[-1]

    def shard_at(self, pos: int) -> Shard:
        """The shard that holds token ``pos`` of the stream."""
        return self.shards[bisect.bisect_right(self.starts, pos) - 1]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` as int64 (clipped to the end), across shard boundaries."""
        stop = min(int(stop), len(self))
        if start >= stop:
            return np.zeros(0, dtype=np.int64)
        k = bisect.bisect_right(self.starts, start) - 1
        if stop <= self.starts[k + 1]:  # the common case: inside one shard
            return np.asarray(self.shards[k].tokens[start - self.starts[k]:stop - self.starts[k]], dtype=np.int64)
        parts = []
        while start < stop:
            lo, hi = start - self.starts[k], min(stop, self.starts[k + 1]) - self.starts[k]
            parts.append(self.shards[k].tokens[lo:hi])
            start, k = start + hi - lo, k + 1
        return np.concatenate(parts).astype(np.int64)
