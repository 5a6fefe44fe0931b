"""Readers for ingest's input formats, one *chunk* of one file at a time (the unit of a Spark task).

* **JSONL** (plain, ``.gz``, ``.zst``): one record per line. A plain file larger than ``chunk_mb`` is cut into byte
  ranges; a line belongs to the range its first byte falls in (as Hadoop's line chunks). Compressed files are one
  chunk each (a gzip/zstd stream cannot be entered in the middle). A compressed file that is corrupt or truncated
  keeps the records read before the damage; the damage itself is one quarantined record (``bad_compression``, with
  the compressed offset reached), and the rest of the input goes on.
* **Plain text** (``.txt``): the whole file is one document (UTF-8).
* **Parquet** (``.parquet``): each row group is one chunk (the driver reads each file's footer,
  :func:`row_group_cuts`); a row is a record whose columns ``data.input_fields`` maps to text, id, url and date,
  its other columns kept as the doc's ``meta`` (a JSON object). A file whose footer does not read (truncated, not
  Parquet) is one whole-file chunk and one ``bad_parquet`` record; a row group that breaks off keeps the rows read
  before the damage, then one ``bad_parquet`` record, and the other row groups are read. A read that fails (a
  reset, a timeout: :func:`parquet_damage`) is raised, for Spark to retry. A string that is not UTF-8 (Parquet
  does not check) quarantines its row (``invalid_utf8``); the other rows are read.
* **WARC** (``.warc``, ``.warc.gz``; Common Crawl's WET files are WARC too): each gzip member is framed here, so a
  broken member is quarantined with its offset and bytes and reading goes on at the next one; a file that ends
  inside a member is reported, not silently cut. A ``.warc.gz`` larger than ``chunk_mb`` is cut into byte ranges;
  a chunk owns the members from the first whole WARC member at or after its start (:func:`member_boundary`) up to
  the first one at or after its end, so the chunks of a file read exactly the members the whole file holds.
  Plain ``.warc`` files are read whole. Records are parsed by FastWARC. ``response`` records with HTTP 200
  and ``text/html`` are extracted to text (resiliparse's main-content extractor by default, trafilatura on
  request); WET ``conversion`` records already hold text. ``request``, ``warcinfo``, ``metadata`` … records are
  not documents: they are counted by type, never quarantined.

A chunk yields :class:`Row` s: a document (``text`` set) or a quarantined record (``reason`` set). Every document
carries ``url``, ``warc_record_id``, ``date`` and ``meta`` when its format has them. JSONL and Parquet records are
read through one field mapping (``data.input_fields``, :func:`record_doc`).
"""
from __future__ import annotations

import base64
import contextlib
import datetime
import gzip
import hashlib
import io
import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from fastwarc.warc import ArchiveIterator
from resiliparse.extract.html2text import extract_plain_text
from resiliparse.parse.encoding import bytes_to_str, detect_encoding
from resiliparse.parse.html import HTMLTree

from pipelines.spec import InputFieldsCfg
from pipelines.storage.s3 import open_object

WARC_SUFFIXES = (".warc", ".warc.gz", ".wet", ".wet.gz")
_RAW_KEEP = 1 << 20  # quarantined WARC bytes kept inline up to this size (the offset always points at the rest)


def fmt_of(name: str) -> str:
    name = name.lower()
    if name.endswith(WARC_SUFFIXES):
        return "warc"
    return "txt" if name.endswith(".txt") else "parquet" if name.endswith(".parquet") else "jsonl"


@dataclass(frozen=True)
class Chunk:
    """A byte range ``[start, end)`` of one input file (``end`` None: to its end). ``path``: a local path, or an
    s3:// URI that the task reads itself with the S3 client ``settings``. ``group``: the Parquet row group the
    chunk reads (None: all of them); its byte range runs from that row group's first byte to the next one's, so the
    chunks of a file still cover it."""

    no: int
    name: str
    path: str
    fmt: str
    start: int = 0
    end: int | None = None
    size: int = 0
    settings: dict | None = None
    group: int | None = None
    etag: str | None = None  # an S3 object's, as listed: what its reads must answer with


def open_raw(chunk: Chunk) -> BinaryIO:
    """The chunk's file, seekable: the local file or the S3 object (ranged GETs, 8 MB at a time, each of the
    listed version: ``ObjectChanged`` otherwise)."""
    if chunk.settings is None:
        return open(chunk.path, "rb")

    return open_object(chunk.settings, chunk.path, chunk.size, etag=chunk.etag)


@dataclass
class Row:
    loc: int                 # JSONL: line number within the chunk (1-based); WARC: the record's byte offset
    text: str | None = None  # a document …
    id: str | None = None    # None: ingest names it <file>:<line>
    url: str | None = None
    warc_record_id: str | None = None
    date: str | None = None
    meta: str | None = None  # Parquet: the row's other columns, a JSON object
    reason: str | None = None  # … or a quarantined record
    q: dict = field(default_factory=dict)  # the quarantine entry's other fields (detail, raw, …)


def chunkable(name: str, fmt: str) -> bool:
    """Plain JSONL (by lines) and gzipped WARC (by gzip members) can be entered in the middle."""
    name = name.lower()
    if fmt in ("txt", "parquet"):  # Parquet is cut by row groups (row_group_cuts), not by bytes
        return False
    return not name.endswith((".gz", ".zst", ".zstd")) if fmt == "jsonl" else name.endswith(".gz")


def range_sha256(chunk: Chunk, block: int = 8 << 20) -> str:
    """sha256 of the chunk's byte range ``[start, end)``, read by the task: the chunks of a file cover it, so the
    digests of its chunks, in order, identify its bytes."""
    h = hashlib.sha256()
    with open_raw(chunk) as f:
        f.seek(chunk.start)
        left = (chunk.end if chunk.end is not None else chunk.size) - chunk.start
        while left > 0:
            data = f.read(min(block, left))
            if not data:
                break
            h.update(data)
            left -= len(data)
    return h.hexdigest()


def plan_chunks(sources, chunk_mb: int, step: int | None = None) -> list[Chunk]:
    """Every input cut into chunks of ``chunk_mb`` (or ``step`` bytes) where its format allows, a Parquet file into
    its row groups, else whole."""
    out: list[Chunk] = []
    step = step or chunk_mb << 20
    for s in sources:
        fmt, size = fmt_of(s.name), s.size
        cuts = row_group_cuts(s) if fmt == "parquet" else byte_cuts(s.name, fmt, size, step)
        for a, end, group in cuts:
            out.append(Chunk(len(out), s.name, s.location, fmt, a, end, size, s.settings, group,
                             s.etag if s.settings is not None else None))
    return out


def byte_cuts(name: str, fmt: str, size: int, step: int) -> list[tuple[int, int | None, None]]:
    """(start, end, no row group) of each ``step`` bytes of a file its format lets us enter anywhere, else whole."""
    if not (chunkable(name, fmt) and size > step):
        return [(0, None, None)]
    return [(a, min(a + step, size), None) for a in range(0, size, step)]


# ---- JSONL -----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def open_binary(chunk: Chunk) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """Open plain, gzip or zstd files by extension: (a binary line stream, the raw file under it)."""
    name = chunk.name.lower()
    with open_raw(chunk) as raw:
        if name.endswith(".gz"):
            yield gzip.GzipFile(fileobj=raw, mode="rb"), raw
        elif name.endswith(".zst") or name.endswith(".zstd"):
            yield io.BufferedReader(ZstdFrames(raw)), raw
        else:
            yield raw, raw


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every zstd frame in ``raw``, one after another; a file that ends inside a frame
    raises EOFError. (zstandard's stream reader stops quietly at a cut frame, and after the first frame unless
    told: half a file would vanish without a word.)"""

    def __init__(self, raw: BinaryIO, block: int = 1 << 20):
        self.raw, self.block, self.zd = raw, block, zstandard.ZstdDecompressor()
        self.dobj, self.pending, self.out = None, b"", b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.out:
            data, self.pending = self.pending or self.raw.read(self.block), b""
            if not data:
                if self.dobj is not None:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            self.dobj = self.dobj or self.zd.decompressobj()
            self.out = self.dobj.decompress(data)
            if self.dobj.eof:  # a whole frame: what follows it is the next one
                self.pending, self.dobj = self.dobj.unused_data, None
        n = min(len(b), len(self.out))
        b[:n], self.out = self.out[:n], self.out[n:]
        return n


class CompressionError(Exception):
    """A compressed input that does not decompress to its end: ``offset`` is how far into the compressed bytes the
    reader got."""

    def __init__(self, offset: int, detail: str):
        super().__init__(detail)
        self.offset, self.detail = offset, detail


def decompress_errors() -> tuple[type[BaseException], ...]:
    return EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError


def chunk_lines(chunk: Chunk) -> Iterator[bytes]:
    """The lines (newline stripped) whose first byte lies in the chunk. A compressed file that breaks off raises
    :class:`CompressionError` after the lines read before the damage."""
    with open_binary(chunk) as (f, raw):
        if chunk.end is None:
            try:
                for line in f:
                    yield line.rstrip(b"\r\n")
            except decompress_errors() as e:
                raise CompressionError(raw.tell(), f"{type(e).__name__}: {e}") from None
            return
        pos = chunk.start
        if pos:
            f.seek(pos - 1)
            pos += len(f.readline()) - 1  # the rest of the line holding byte start-1 belongs to the chunk before
        while pos < chunk.end:
            line = f.readline()
            if not line:
                return
            pos += len(line)
            yield line.rstrip(b"\r\n")


def classify(line: bytes, text_field: str, min_chars: int) -> tuple[str | None, dict | str]:
    """Return (None, record) for a good line, else (reason, detail)."""
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return "invalid_utf8", f"{e.reason} at byte {e.start}"
    try:
        rec = json.loads(s)
    except json.JSONDecodeError as e:
        return "invalid_json", f"{e.msg} at char {e.pos}"
    if not isinstance(rec, dict):
        return "not_an_object", f"got {type(rec).__name__}"
    reason, detail = text_check(rec, text_field, min_chars)
    return (reason, detail) if reason else (None, rec)


def text_check(rec: dict, text_field: str, min_chars: int) -> tuple[str | None, str]:
    """(reason, detail) when a record's text is missing, null, not a string, empty or not encodable; (None, "")
    when it is a document's. A JSONL object and a Parquet row alike."""
    text = rec.get(text_field)
    if text is None:
        return "missing_text", (f"{text_field!r} is null" if text_field in rec
                                else f"no {text_field!r} field (fields: {sorted(rec)[:8]})")
    if not isinstance(text, str):
        return "text_not_string", f"{text_field!r} is {type(text).__name__}"
    reason = text_problem(text, min_chars)
    return (reason, _TEXT_DETAIL[reason](text)) if reason else (None, "")


def record_doc(loc: int, rec: dict, fields: InputFieldsCfg, meta: bool = False) -> Row:
    """A good record (its text checked) as a document: id, url and date from the fields ``fields`` names; with
    ``meta``, every other field as a JSON object."""
    rid = rec.get(fields.id)
    names = {fields.text, fields.id, fields.url, fields.date}
    rest = {k: v for k, v in rec.items() if k not in names} if meta else {}
    return Row(loc, text=rec[fields.text], id=str(rid) if rid is not None else None, url=as_text(rec.get(fields.url)),
               date=as_text(rec.get(fields.date)), meta=to_json(rest) if rest else None)


def as_text(v: Any) -> str | None:
    """A url or date value as a string: a string as it is, a date or timestamp in ISO 8601; anything else None."""
    if isinstance(v, (datetime.date, datetime.datetime)):
        return v.isoformat()
    return v if isinstance(v, str) else None


def to_json(v: Any) -> str:
    """JSON of a record's values: dates and timestamps in ISO 8601, bytes in base64, a NaN or infinite float null
    (JSON has no such numbers), anything else as its str."""
    def plain(x: Any) -> Any:
        if isinstance(x, (datetime.date, datetime.datetime, datetime.time)):
            return x.isoformat()
        return base64.b64encode(x).decode("ascii") if isinstance(x, bytes) else str(x)

    try:
        return json.dumps(v, ensure_ascii=False, default=plain, allow_nan=False)
    except ValueError:  # a non-finite float somewhere: the rare record pays for the walk
        return json.dumps(finite(v), ensure_ascii=False, default=plain, allow_nan=False)


def finite(v: Any) -> Any:
    """``v`` with every NaN or infinite float in it (in dicts, lists and tuples too) None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    return [finite(x) for x in v] if isinstance(v, (list, tuple)) else v


_TEXT_DETAIL = {"empty_text": lambda t: f"{len(t.strip())} chars after strip",
                "invalid_utf8": lambda t: "lone surrogate in text"}


def text_problem(text: str, min_chars: int) -> str | None:
    if len(text.strip()) < min_chars:
        return "empty_text"
    try:  # lone surrogates (valid JSON escapes, invalid Unicode) cannot be written as UTF-8 later
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "invalid_utf8"
    return None


def jsonl_rows(chunk: Chunk, cfg, fields: InputFieldsCfg) -> Iterator[Row | None]:
    """A Row per non-blank line; None for a blank line (no record, but a line for numbering). A compressed file that
    breaks off ends with one ``bad_compression`` Row."""
    n = 0
    try:
        for n, line in enumerate(chunk_lines(chunk), start=1):
            yield jsonl_row(n, line, cfg, fields)
    except CompressionError as e:
        yield Row(n + 1, reason="bad_compression",
                  q={"uri": chunk.path, "offset": e.offset, "detail": f"{e.detail} (after {n} lines)"})


def txt_rows(chunk: Chunk, cfg, fields: InputFieldsCfg) -> Iterator[Row]:
    """A plain-text file: one document, its whole text."""
    with open_raw(chunk) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        yield Row(1, reason="invalid_utf8", q={"detail": f"{e.reason} at byte {e.start}",
                                               "raw_b64": base64.b64encode(raw[:_RAW_KEEP]).decode("ascii")})
        return
    reason = text_problem(text, cfg.min_chars)
    yield Row(1, reason=reason, q={"detail": _TEXT_DETAIL[reason](text)}) if reason else Row(1, text=text)


def jsonl_row(n: int, line: bytes, cfg, fields: InputFieldsCfg) -> Row | None:
    """Line ``n``: a document, a quarantined record, or None when it is blank."""
    if not line.strip():
        return None
    reason, rec = classify(line, fields.text, cfg.min_chars)
    if reason is not None:
        try:
            raw = {"raw": line.decode("utf-8")}
        except UnicodeDecodeError:
            raw = {"raw_b64": base64.b64encode(line).decode("ascii")}
        return Row(n, reason=reason, q={"detail": rec, **raw})
    return record_doc(n, rec, fields)


# ---- Parquet ---------------------------------------------------------------------------------------------------

PARQUET_BATCH = 1024  # rows decoded at a time: a row group that breaks off keeps the batches read before


def parquet_damage(e: BaseException) -> bool:
    """Is ``e`` pyarrow's word that the bytes are not good Parquet (a footer or page that does not decode: an
    ``ArrowException``, or the plain ``OSError`` without errno it raises for a page header that does not
    deserialize), as opposed to the read itself failing? A file object's error comes through pyarrow as itself: a
    reset connection or a timeout (``ConnectionError``, ``TimeoutError``, the S3 client's
    :class:`~pipelines.storage.s3.S3Timeout`), botocore's and urllib3's errors, a disk's ``OSError`` with its
    errno; and memory running out (``ArrowMemoryError``). Those are no fault of the data: they fail the Spark task
    (or the driver's plan), which is retried, rather than quarantine rows the next try would read."""
    if isinstance(e, MemoryError):
        return False
    return isinstance(e, pa.ArrowException) or type(e) is OSError and e.errno is None


def row_group_cuts(source) -> list[tuple[int, int | None, int | None]]:
    """(start, end, row group) of each row group of a Parquet input, from its footer (the only bytes the driver
    reads: a ranged read for an S3 object). A row group's range runs to the next one's first byte, the first from 0
    and the last to the file's end, so the chunks cover the file and their digests identify it. One whole-file chunk
    (row group None) when the footer does not read (the task quarantines the file), for a single row group, and when
    the row groups do not lie in order in the file. A read that fails (not the data: :func:`parquet_damage`) is
    raised."""
    whole = [(0, None, None)]
    try:
        with open_raw(Chunk(0, source.name, source.location, "parquet", size=source.size,
                            settings=source.settings, etag=source.etag if source.settings else None)) as f:
            md = pq.read_metadata(f)
    except Exception as e:  # noqa: BLE001 - only damage is answered here; anything else is raised
        if not parquet_damage(e):
            raise
        return whole
    starts = [group_start(md.row_group(g)) for g in range(md.num_row_groups)]
    if len(starts) < 2 or starts != sorted(set(starts)) or starts[0] < 4 or starts[-1] >= source.size:
        return whole
    bounds = [0, *starts[1:], None]
    return [(bounds[g], bounds[g + 1], g) for g in range(len(starts))]


def group_start(rg) -> int:
    """The first byte of a row group: the lowest page offset of its column chunks."""
    cols = [rg.column(j) for j in range(rg.num_columns)]
    return min((c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset else
                c.data_page_offset) for c in cols) if cols else -1


def parquet_rows(chunk: Chunk, cfg, fields: InputFieldsCfg) -> Iterator[Row]:
    """A Row per row of the chunk's row group (all of them when ``group`` is None), numbered through the file from
    1; a file whose footer does not read is one ``bad_parquet`` Row. A read that fails is raised."""
    with open_raw(chunk) as raw:
        try:
            pf = pq.ParquetFile(raw)
        except Exception as e:  # noqa: BLE001 - only damage is quarantined; anything else is raised
            if not parquet_damage(e):
                raise
            yield Row(1, reason="bad_parquet", q={"uri": chunk.path, "bytes": chunk.size,
                                                  "detail": f"no readable Parquet footer: {type(e).__name__}: {e}"})
            return
        md = pf.metadata
        before = [0]
        for g in range(md.num_row_groups):
            before.append(before[-1] + md.row_group(g).num_rows)
        for g in [chunk.group] if chunk.group is not None else range(md.num_row_groups):
            yield from row_group_rows(pf, g, before[g], md.row_group(g).num_rows, chunk, cfg, fields)


def row_group_rows(pf, g: int, before: int, want: int, chunk: Chunk, cfg, fields: InputFieldsCfg) -> Iterator[Row]:
    """Row group ``g``'s rows (``before`` rows precede it in the file); one that breaks off keeps the rows decoded
    before the damage and ends with one ``bad_parquet`` Row. A read that fails is raised."""
    n = before
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=[g], use_threads=False):
            for rec, bad in batch_records(batch):
                n += 1
                yield parquet_row(n, g, rec, bad, cfg, fields)
    except Exception as e:  # noqa: BLE001 - only damage is quarantined; anything else is raised
        if not parquet_damage(e):
            raise
        yield Row(n + 1, reason="bad_parquet", q={
            "uri": chunk.path, "row_group": g, "row": n + 1, "rows_unread": want - (n - before),
            "detail": f"row group {g} breaks off after {n - before} of {want} rows: {type(e).__name__}: {e}"})


def parquet_row(n: int, g: int, rec: dict, bad: tuple | None, cfg, fields: InputFieldsCfg) -> Row:
    """Row ``n`` (of row group ``g``): a document, or quarantined with the row as JSON; ``bad``: its first value
    that is not UTF-8 (column, the value's bytes, the error) or None."""
    q = {"row": n, "row_group": g}
    if bad is not None:
        col, value, e = bad
        b64 = {"raw_b64": base64.b64encode(value).decode("ascii")} if isinstance(value, bytes) else {}
        return Row(n, reason="invalid_utf8", q={**q, "column": col, "raw": to_json(rec), **b64,
                                                "detail": f"{col!r} is not UTF-8: {e.reason} at byte {e.start}"})
    reason, detail = text_check(rec, fields.text, cfg.min_chars)
    if reason:
        return Row(n, reason=reason, q={**q, "detail": detail, "raw": to_json(rec)})
    return record_doc(n, rec, fields, meta=True)


def batch_records(batch) -> Iterator[tuple[dict, tuple | None]]:
    """(row, None) for each row of a record batch; a batch holding a string that is not UTF-8 (Parquet does not
    check) row by row, with the row's first undecodable value (:func:`utf8_records`)."""
    try:
        recs = batch.to_pylist()
    except UnicodeDecodeError:
        yield from utf8_records(batch)
        return
    for rec in recs:
        yield rec, None


def utf8_records(batch) -> Iterator[tuple[dict, tuple | None]]:
    """Each row of a batch some string of which is not UTF-8: the row, each value that does not decode kept as its
    bytes (:func:`as_bytes`), and (column, bytes, the ``UnicodeDecodeError``) of the first such value, else None."""
    names = batch.schema.names
    plain, strict = {}, {}
    for name, col in zip(names, batch.columns):
        try:
            plain[name] = col.to_pylist()
        except UnicodeDecodeError:
            strict[name] = col  # read value by value
    for i in range(batch.num_rows):
        rec, bad = {}, None
        for name in names:
            if name in plain:
                rec[name] = plain[name][i]
                continue
            try:
                rec[name] = strict[name][i].as_py()
            except UnicodeDecodeError as e:
                rec[name] = as_bytes(strict[name], i)
                bad = bad or (name, rec[name], e)
        yield rec, bad


def as_bytes(col, i: int) -> Any:
    """Value ``i`` of an Arrow column with every string in it as its bytes (:func:`binary_type`); None for a type
    Arrow does not cast so (a union …)."""
    try:
        return col.slice(i, 1).cast(binary_type(col.type))[0].as_py()
    except (UnicodeDecodeError, pa.ArrowException):
        return None


def binary_type(t):
    """Arrow type ``t`` with each string type in it (also in lists, structs, maps and dictionaries) binary."""
    swap = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary(), pa.string_view(): pa.binary_view()}
    if t in swap:
        return swap[t]
    if pa.types.is_dictionary(t):
        return binary_type(t.value_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        item = t.value_field.with_type(binary_type(t.value_type))
        return pa.large_list(item) if pa.types.is_large_list(t) else pa.list_(item, getattr(t, "list_size", -1))
    if pa.types.is_struct(t):
        return pa.struct([t.field(j).with_type(binary_type(t.field(j).type)) for j in range(t.num_fields)])
    if pa.types.is_map(t):
        return pa.map_(binary_type(t.key_type), binary_type(t.item_type))
    return t


# ---- WARC ------------------------------------------------------------------------------------------------------


def member_at(f: BinaryIO, off: int, piece: int = 1 << 16) -> tuple[int, bytes | None]:
    """(bytes used, decompressed bytes) of the gzip member at ``off``. Not a whole member: (-1, None) when it does
    not decompress, (bytes left, None) when the file ends inside it, (0, None) at the file's end."""
    f.seek(off)
    d, out, n = zlib.decompressobj(wbits=31), [], 0
    try:
        while not d.eof:
            chunk = f.read(piece)
            if not chunk:
                break
            n += len(chunk)
            out.append(d.decompress(chunk))
    except zlib.error:
        return -1, None
    if not d.eof:
        return n, None
    return n - len(d.unused_data), b"".join(out)


def gzip_members(f: BinaryIO, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, int, bytes | None]]:
    """(offset, length, decompressed bytes or None when broken) for each gzip member from ``start`` up to the first
    one at or after ``stop``, streamed: a Common Crawl WARC holds one record per member. A member that does not
    decompress ends at the next gzip magic (resync)."""
    off = start
    while stop is None or off < stop:
        n, data = member_at(f, off)
        if n < 0:
            nxt = next_magic(f, off + 1)
            yield off, nxt - off, None
            off = nxt
            continue
        if n == 0:
            return
        yield off, n, data
        if data is None:  # the file ends inside this member
            return
        off += n


def member_boundary(f: BinaryIO, pos: int) -> int:
    """The first offset at or after ``pos`` where a whole gzip member holding a WARC record starts (or the file's
    end): where a chunk of a .warc.gz begins, and where the chunk before it ends. A gzip magic inside compressed
    data is skipped, since it does not decompress to a WARC record; both neighbours compute the same offset."""
    if pos == 0:
        return 0
    while True:
        cand = next_magic(f, pos)
        n, data = member_at(f, cand)
        if n == 0 or data is not None and data.startswith(b"WARC/"):
            return cand
        pos = cand + 1


def next_magic(f: BinaryIO, start: int, block: int = 1 << 20) -> int:
    """The offset of the next gzip member header at or after start, or the file's end."""
    f.seek(start)
    pos, tail = start, b""
    while True:
        data = f.read(block)
        if not data:
            return pos + len(tail)
        buf = tail + data
        i = buf.find(b"\x1f\x8b\x08")
        if i >= 0:
            return pos + i
        pos, tail = pos + len(buf) - 2, buf[-2:]


def raw_at(chunk: Chunk, off: int, length: int) -> dict:
    with open_raw(chunk) as f:
        f.seek(off)
        raw = f.read(min(length, _RAW_KEEP))
    return {"raw_b64": base64.b64encode(raw).decode("ascii"), "bytes": length}


def warc_rows(chunk: Chunk, cfg, fields: InputFieldsCfg) -> Iterator[Row | str]:
    """A Row per document-like record; the record type's name for a record that is not a document."""
    if not chunk.name.lower().endswith(".gz"):  # plain WARC: FastWARC streams it; a bad record ends the file
        pos = 0
        try:
            with open_raw(chunk) as f:
                for rec in ArchiveIterator(f, parse_http=False, fsspec_args=False, stream_detect=False):
                    pos = rec.stream_pos
                    yield from warc_record(rec, pos, cfg)
        except OSError as e:
            yield Row(pos, reason="bad_record", q={"offset": pos, "detail": f"WARC parse error: {e}",
                                                   **raw_at(chunk, pos, chunk.size - pos)})
        return
    with open_raw(chunk) as f:
        start = member_boundary(f, chunk.start)
        stop = member_boundary(f, chunk.end) if chunk.end is not None else None
        for off, length, data in gzip_members(f, start, stop):
            if data is None:
                yield Row(off, reason="bad_compression", q={"offset": off, **raw_at(chunk, off, length),
                                                            "detail": "gzip member is truncated or corrupt"})
                continue
            n, problem = 0, "no WARC record in this gzip member"
            try:
                for rec in ArchiveIterator(io.BytesIO(data), parse_http=False, fsspec_args=False,
                                           stream_detect=False):
                    n += 1
                    yield from warc_record(rec, off, cfg)
            except OSError as e:  # FastWARC: a bad header
                n, problem = 0, f"WARC parse error: {e}"
            if n == 0:
                yield Row(off, reason="bad_record", q={"offset": off, **raw_at(chunk, off, length), "detail": problem})


_DOC_TYPES = ("response", "conversion", "resource")


def warc_record(rec, off: int, cfg) -> Iterator[Row | str]:
    kind = str(rec.record_type)
    if kind == "unknown":  # a header block without a WARC-Type FastWARC knows: keep what it holds
        body = rec.reader.read()[:_RAW_KEEP]
        yield Row(off, reason="bad_record", q={"offset": off, "detail": "no known WARC-Type in the record header",
                                               "headers": [list(h) for h in rec.headers.items()],
                                               "raw_b64": base64.b64encode(body).decode("ascii")})
        return
    if kind not in _DOC_TYPES:
        yield kind
        return
    meta = {"url": rec.headers.get("WARC-Target-URI"), "warc_record_id": rec.record_id,
            "date": rec.headers.get("WARC-Date")}
    q = {"offset": off, **meta}
    if kind == "conversion":  # WET: text already extracted
        return (yield text_row(off, rec.reader.read().decode("utf-8", "replace"), meta, q, cfg))
    if kind == "response":
        try:
            rec.parse_http()
        except OSError as e:
            return (yield Row(off, reason="bad_http", q={**q, "detail": f"HTTP headers: {e}"}))
        status = rec.http_headers.status_code if rec.http_headers is not None else None
        if status != 200:
            return (yield Row(off, reason="http_status", q={**q, "detail": f"HTTP {status}"}))
    ctype = (rec.http_content_type if kind == "response" else rec.headers.get("Content-Type")) or ""
    if "html" not in ctype.lower():
        return (yield Row(off, reason="not_html", q={**q, "detail": f"content type {ctype or 'missing'!r}"}))
    body = rec.reader.read()
    try:
        text = extract(body, rec.http_charset if kind == "response" else None, cfg.extractor)
    except Exception as e:  # noqa: BLE001 - an extractor's failure on one page quarantines that page only
        return (yield Row(off, reason="extract_failed", q={**q, "detail": f"{type(e).__name__}: {e}",
                                                        "raw_b64": base64.b64encode(body[:_RAW_KEEP]).decode()}))
    yield text_row(off, text, meta, {**q, "raw_b64": base64.b64encode(body[:_RAW_KEEP]).decode()}, cfg)


def text_row(off: int, text: str, meta: dict, q: dict, cfg) -> Row:
    reason = text_problem(text, cfg.min_chars)
    if reason:
        return Row(off, reason=reason, q={**q, "detail": _TEXT_DETAIL[reason](text)})
    return Row(off, text=text, id=meta["warc_record_id"], **meta)


def extract(body: bytes, charset: str | None, extractor: str) -> str:
    """HTML bytes → main-content text."""
    html = bytes_to_str(body, charset or detect_encoding(body))
    if extractor == "trafilatura":
        import trafilatura

        return trafilatura.extract(html, include_comments=False, include_tables=True) or ""

    return extract_plain_text(HTMLTree.parse(html), main_content=True)


def rows(chunk: Chunk, cfg, fields: InputFieldsCfg | None = None) -> Iterator[Row | str | None]:
    """The chunk's rows; ``cfg``: data.ingest, ``fields``: data.input_fields (None: FineWeb's names)."""
    read = {"warc": warc_rows, "txt": txt_rows, "jsonl": jsonl_rows, "parquet": parquet_rows}[chunk.fmt]
    return read(chunk, cfg, fields or InputFieldsCfg())
