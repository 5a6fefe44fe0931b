"""Tokenize on Spark: train (or take) a SentencePiece model, then every partition encodes its documents and writes
its own mmap shards.

* Canonical text before tokenization (:func:`pipelines.data.text.canonical_text`): Unicode NFKC, ``\\r\\n``/``\\r`` → ``\\n``. The trained model
  uses SentencePiece's ``identity`` normaliser, keeps whitespace as is, has ``\\n`` as a piece and
  byte fallback, so ``decode(encode(doc)) == canonical_text(doc)`` exactly. ``tokenizer.model_type``: ``bpe`` or
  ``unigram`` (``vocab_size`` pieces), ``char`` (one piece per character of the sample, no fallback: a character
  the sample lacks decodes as ``⁇``), ``byte`` (:func:`byte_model`: the 256 bytes, no training).
* Tokenizer sample: the executors rank every train-split doc by ``sha256(seed:tok:id)``; the ``sample_docs`` smallest
  (Spark's top-k) go to one executor task, which trains on them (:func:`trained_model`: the driver holds neither
  the sample nor the trainer). The same docs give the same sample, whatever the partitioning.
* Split (``tokenizer.heldout``, :class:`Splitter`): ``hash``: a doc goes to ``heldout`` when ``sha256(seed:id)`` falls
  under ``heldout_fraction``, else to ``train`` (stable under corpus growth: a doc never changes split); ``tail``:
  the last ``heldout_fraction`` of each input's docs (by ``idx``), or of its text when the input is one doc (the
  tail becomes a doc ``<id>#tail``). The manifest's ``extra.heldout`` says which.
* Shards: partition ``p`` writes ``shards/{train,heldout}-PPPPP-KKKK.{bin,idx}`` (format in
  ``pipelines.data.shards``, Megatron's ``MMIDIDX``) straight into the output directory, EOS after every doc, a
  new shard every ``shard_tokens`` tokens, and ``….ids.parquet`` with the doc ids in shard order (and each doc's
  ``source``, when the input has a string column of them: what ``train.mixture`` reads). The number of
  partitions (Spark tasks) is ``tokenizer.partitions``, or by default the executors' parallelism, raised so that a
  partition holds about ``shard_tokens`` tokens. The driver plans them from the parquet footers: the docs' row
  groups, in order, cut into partitions of about equal text bytes (a big row group is cut by rows); each task
  reads its own rows with pyarrow, so the text goes from the file to the encoder without a trip through the JVM.
  The split and every doc's token ids do not depend on the partitioning; the shard layout does.

* S3 (``services.shards_uri``): each task uploads the shards it wrote, checked with S3's SHA-256 checksums; after
  the commit the driver checks every output against the manifest, uploads what is missing or different, and
  ``manifest.json`` last (:func:`publish`).

Counts: docs, tokens and text bytes per split; the manifest lists every shard with its split, partition, docs,
tokens and the UTF-8 bytes of its source text (for bits-per-byte), plus ``spark_master`` and ``partitions``.
"""
from __future__ import annotations

import errno
import hashlib
import itertools
import math
import os
import re
import shutil
import stat
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

from pipelines.cli import add_corpus_arg, corpus_arg, run_and_log, stage_dir, stage_main
from pipelines.data.shards import Shard, ShardWriter, token_dtype
from pipelines.data.spark import Piece, piece_batches
from pipelines.data.text import canonical_text
from pipelines.exit_codes import RETRY
from pipelines.lineage.queries import excluded_docs, shards_holding
from pipelines.lineage.takedowns import TakedownList, list_held, read_list, recorded_sha256, split_by_exclusion
from pipelines.manifest import (Manifest, ManifestInvalid, StageError, file_ref, input_ref, lineage, load_manifest,
                                sha256_file, under)
from pipelines.spec import JobSpec, TokenizerCfg, resolve_path
from pipelines.storage.s3 import (DATA_BOUNDS, UPLOAD_PART, S3ConfigError, client_from, client_settings, ensure_bucket,
                                  object_matches, outage, split_uri, unreachable, upload_checked)

SPLITS = ("train", "heldout")


class TokenizeError(StageError):
    pass


class TokenizerRefused(TokenizeError):
    """SentencePiece cannot train the tokenizer the spec asks for on this sample (a vocabulary smaller than the
    characters it must cover, one larger than the sample supports): the spec's to fix, exit 2."""


REQUIRED_CHARS = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")
TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")


def refusal(e: RuntimeError, cfg) -> RuntimeError:
    """SentencePiece's trainer error as the spec key to change, when it is one (else ``e`` itself)."""
    if m := REQUIRED_CHARS.search(str(e)):
        return TokenizerRefused(
            f"tokenizer.vocab_size={m.group(1)} is smaller than the {m.group(2)} pieces it must hold (the sample's "
            f"characters at tokenizer.character_coverage={cfg.character_coverage}, the 256 byte-fallback pieces, the "
            "special ones): raise tokenizer.vocab_size or lower tokenizer.character_coverage")
    if m := TOO_HIGH.search(str(e)):
        return TokenizerRefused(
            f"tokenizer.vocab_size={m.group(1)} is more pieces than the tokenizer's sample yields (at most "
            f"{m.group(2)}): lower tokenizer.vocab_size, or raise tokenizer.sample_docs on a larger corpus")
    return e


class ListChanged(TokenizeError):
    """The takedown list changed while the stage ran: nothing is published; running the stage again (the task's
    retry) applies the current list (exit 75)."""

    exit_code = RETRY


def split_of(doc_id: str, seed: int, heldout_fraction: float) -> str:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()[:8], "big")
    return "heldout" if h / 2**64 < heldout_fraction else "train"


@dataclass(frozen=True)
class Splitter:
    """Which split a doc (or part of one) goes to (``tokenizer.heldout``): ``hash`` (:func:`split_of`), or ``tail``:
    per input (``source``), its docs from ``cuts[source]`` (an ``idx``) on are held out; an input that is one doc
    (``cuts[source]`` is -1) gives the last ``fraction`` of its text, as a doc ``<id>#tail``."""

    mode: str
    seed: int
    fraction: float
    cuts: dict  # tail: source → the first held-out idx (None: none; -1: the input is one doc, cut its text)

    @property
    def columns(self) -> tuple[str, ...]:
        """What it reads of a doc besides id and text."""
        return ("source", "idx") if self.mode == "tail" else ()

    def is_train(self, doc_id: str, source: str, idx: int) -> bool:
        """Whether the doc (or, for a one-doc input, its head) is training text."""
        if self.mode == "hash":
            return split_of(doc_id, self.seed, self.fraction) == "train"
        cut = self.cuts.get(source)
        return cut is None or cut == -1 or idx < cut

    def parts(self, doc_id: str, source: str, idx: int, text: str) -> list[tuple[str, str, str]]:
        """(split, id, text) of each part of the doc that has text."""
        if self.mode == "hash":
            return [(split_of(doc_id, self.seed, self.fraction), doc_id, text)]
        cut = self.cuts.get(source)
        if cut == -1:
            k = int(len(text) * (1 - self.fraction))
            return [p for p in (("train", doc_id, text[:k]), ("heldout", f"{doc_id}#tail", text[k:])) if p[2]]
        return [("heldout" if cut is not None and idx >= cut else "train", doc_id, text)]


def splitter(docs_path: Path, cfg: TokenizerCfg, seed: int) -> Splitter:
    """The split of the docs at ``docs_path`` (tail: the cut of each input, from its docs' ``idx``, read on the
    driver: two small columns)."""
    if cfg.heldout == "hash" or cfg.heldout_fraction == 0:
        return Splitter("hash", seed, cfg.heldout_fraction, {})
    import pyarrow.dataset as ds

    t = ds.dataset(str(docs_path), format="parquet").to_table(columns=["source", "idx"])
    cuts = {}
    for row in t.group_by("source").aggregate([("idx", "list")]).to_pylist():
        idxs = sorted(row["idx_list"])
        first = len(idxs) - math.floor(len(idxs) * cfg.heldout_fraction + 1e-9)  # an input of < 1/fraction docs: none
        cuts[row["source"]] = -1 if len(idxs) == 1 else (idxs[first] if first < len(idxs) else None)
    return Splitter("tail", seed, cfg.heldout_fraction, cuts)


def train_sentencepiece(texts: list[str], out_prefix: Path, cfg: TokenizerCfg, seed: int) -> Path:
    """A SentencePiece model of ``cfg.model_type`` trained on ``texts`` (bpe / unigram: ``vocab_size`` pieces with
    byte fallback; char: every character of the sample, no fallback), written portable to ``out_prefix.model``."""
    spm.set_random_generator_seed(seed)
    sample = out_prefix.with_suffix(".sample.txt")
    with open(sample, "w", encoding="utf-8") as f:
        for t in texts:
            for line in t.split("\n"):
                if line.strip():
                    f.write(line + "\n")
    char = cfg.model_type == "char"
    kind = {"vocab_size": 1 << 20, "hard_vocab_limit": False, "character_coverage": 1.0, "byte_fallback": False} \
        if char else {"vocab_size": cfg.vocab_size, "character_coverage": cfg.character_coverage, "byte_fallback": True}
    try:
        spm.SentencePieceTrainer.train(
            input=str(sample), model_prefix=str(out_prefix), model_type=cfg.model_type, **kind,
            normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=not char,
            user_defined_symbols=["\n"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=2, input_sentence_size=2_000_000, shuffle_input_sentence=True,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise refusal(e, cfg) from None
    sample.unlink()
    return portable(out_prefix.with_suffix(".model"))


def byte_model(path: Path) -> Path:
    """The byte tokenizer: ``<unk>``, ``<s>``, ``</s>``, then the 256 bytes (id = byte + 3), text as it is (no
    whitespace escape, no prefix): every text encodes to its UTF-8 bytes and decodes back exactly."""
    piece = pb.ModelProto.SentencePiece
    proto = pb.ModelProto()
    for name, kind in (("<unk>", piece.UNKNOWN), ("<s>", piece.CONTROL), ("</s>", piece.CONTROL)):
        proto.pieces.add(piece=name, score=0.0, type=kind)
    for b in range(256):
        proto.pieces.add(piece=f"<0x{b:02X}>", score=0.0, type=piece.BYTE)
    ts, ns = proto.trainer_spec, proto.normalizer_spec
    ts.model_type, ts.vocab_size, ts.byte_fallback = pb.TrainerSpec.BPE, len(proto.pieces), True
    ts.unk_id, ts.bos_id, ts.eos_id, ts.pad_id = 0, 1, 2, -1
    ns.name, ns.add_dummy_prefix, ns.escape_whitespaces, ns.remove_extra_whitespaces = "identity", False, False, False
    path.write_bytes(proto.SerializeToString())
    return path


def portable(model: Path) -> Path:
    """Drop the trainer's file paths from the model, so that the same sample gives the same bytes anywhere."""
    proto = pb.ModelProto()
    proto.ParseFromString(model.read_bytes())
    proto.trainer_spec.ClearField("input")
    proto.trainer_spec.ClearField("model_prefix")
    model.write_bytes(proto.SerializeToString())
    return model


def trained_model(docs, cfg: TokenizerCfg, seed: int, split: Splitter) -> bytes | None:
    """A SentencePiece model trained on the tokenizer's sample in one executor task, so the driver holds neither the
    sample's text nor the trainer (its memory stays flat as the corpus grows): the executors rank every train-split
    doc by id, the top ``sample_docs`` ids are chosen (Spark's top-k: only ids and keys move), only the winners are
    joined back to their text and sent to one task, which puts them in key order (a one-doc input's head only: its
    tail is held out) and trains. Returns the model's bytes; None when the sample is empty."""
    from pyspark.sql import functions as F

    def rank(batches):
        for b in batches:
            cols = [b.column(k).to_pylist() for k in range(b.num_columns)]
            ids = [i for i, src, idx in zip(cols[0], *(cols[1:] or [[None] * b.num_rows] * 2))
                   if split.is_train(i, src, idx)]
            yield pa.RecordBatch.from_arrays([pa.array([hashlib.sha256(f"{seed}:tok:{i}".encode()).digest()
                                                        for i in ids], pa.binary()), pa.array(ids, pa.string())],
                                             names=["key", "id"])

    top = docs.select("id", *split.columns).mapInArrow(rank, "key binary, id string").orderBy("key") \
        .limit(cfg.sample_docs)
    winners = docs.join(F.broadcast(top), "id").select("key", "id", "text", *split.columns)
    got = winners.repartition(1).mapInArrow(_train_task(cfg, seed, split), "model binary, refused string").collect()
    if got and got[0]["refused"]:
        raise TokenizerRefused(got[0]["refused"])
    return got[0]["model"] if got else None


def _train_task(cfg: TokenizerCfg, seed: int, split: Splitter):
    """mapInArrow body, one task over the sample's (key, id, text[, source, idx]) rows → one row: the model's bytes."""
    def fn(batches):
        got = [b for b in batches if b.num_rows]
        if not got:
            return
        t = pa.Table.from_batches(got).sort_by("key")
        cols = [t.column(k).to_pylist() for k in ("id", "text", *split.columns)]
        texts = [next((x for part, _, x in split.parts(i, rest[0] if rest else None, rest[1] if rest else None,
                                                      canonical_text(text or "")) if part == "train"), "")
                 for i, text, *rest in zip(*cols)]
        with tempfile.TemporaryDirectory() as d:
            try:
                model = train_sentencepiece([canonical_text(x) for x in texts], Path(d) / "tokenizer", cfg, seed)
            except TokenizerRefused as e:  # the spec's to fix: a row for the driver, not a task error Spark retries
                yield _model_row(None, str(e))
                return
            yield _model_row(model.read_bytes(), None)
    return fn


def _model_row(model: bytes | None, refused: str | None) -> pa.RecordBatch:
    """The tokenizer task's one row: the model's bytes, or why SentencePiece refused to train it."""
    return pa.RecordBatch.from_arrays([pa.array([model], pa.binary()), pa.array([refused], pa.string())],
                                      names=["model", "refused"])


def tokenizer_model(docs, out: Path, cfg: TokenizerCfg, seed: int, split: Splitter, given: Path | None = None) -> bytes:
    """``out/tokenizer.model``: ``given`` (a corpus version's), tokenizer.model_path, or one trained on the
    deterministic sample; returns its bytes."""
    if given is not None:  # a corpus version's: read as a plain file only (plain_bytes)
        (out / "tokenizer.model").write_bytes(plain_bytes(given, "of the corpus version this one extends"))
    elif cfg.model_path:
        src = resolve_path(cfg.model_path)
        if not src.is_file():
            raise TokenizeError(f"tokenizer.model_path {src} does not exist")
        shutil.copyfile(src, out / "tokenizer.model")
    elif cfg.model_type == "byte":
        byte_model(out / "tokenizer.model")
    else:
        model = trained_model(docs, cfg, seed, split)
        if model is None:
            raise TokenizeError("no training docs left to train a tokenizer on (did every doc get filtered?)")
        (out / "tokenizer.model").write_bytes(model)
    return (out / "tokenizer.model").read_bytes()


class PartitionShards:
    """One partition's shard writers: a new ``{split}-PPPPP-KKKK`` shard every ``shard_tokens`` tokens (a doc never
    straddles two; a doc longer than that gets a shard of its own)."""

    def __init__(self, out: Path, part: int, dtype, shard_tokens: int, rel: str = "shards"):
        self.out, self.part, self.dtype, self.limit, self.rel = out, part, np.dtype(dtype), shard_tokens, rel
        self.open: dict[str, tuple[ShardWriter, list[str], list[int], list]] = {}
        self.count = {s: 0 for s in SPLITS}
        self.done: list[dict] = []

    def writer(self, split: str) -> tuple[ShardWriter, list[str], list[int], list]:
        if split not in self.open:
            name = f"{split}-{self.part:05d}-{self.count[split]:04d}"
            self.open[split] = (ShardWriter(self.out / name, self.dtype), [], [0], [])
            self.count[split] += 1
        return self.open[split]

    def add(self, split: str, doc_ids: list[str], docs: list[list[int]], text_bytes: list[int],
            sources: list) -> None:
        """A batch of one split's docs (token ids, EOS included) and their sources (None where the input has no
        ``source``), written a shard's run of docs at a time."""
        lengths = [len(d) for d in docs]
        i = 0
        while i < len(docs):
            w, ids, nbytes, srcs = self.writer(split)
            j, take = i, 0
            while j < len(docs) and (w.tokens + take + lengths[j] <= self.limit or (not w.lengths and j == i)):
                take += lengths[j]
                j += 1
            if j > i:
                flat = np.fromiter(itertools.chain.from_iterable(docs[i:j]), self.dtype, count=take)
                w.add_many(flat, lengths[i:j])
                ids.extend(doc_ids[i:j])
                srcs.extend(sources[i:j])
                nbytes[0] += sum(text_bytes[i:j])
            if j < len(docs):
                self.close(split)
            i = j

    def close(self, split: str) -> None:
        w, ids, nbytes, srcs = self.open.pop(split)
        w.close()
        write_doc_ids(w.prefix.with_suffix(".ids.parquet"), ids, srcs)
        self.done.append({"split": split, "prefix": f"{self.rel}/{w.prefix.name}", "partition": self.part,
                          "docs": len(w.lengths), "tokens": w.tokens, "text_bytes": nbytes[0]})

    def finish(self) -> list[dict]:
        for split in list(self.open):
            self.close(split)
        return self.done


def write_doc_ids(path: Path, ids: list[str], sources: list) -> None:
    """A shard's ``.ids.parquet``: its docs' ids in shard order and, when the input has them, their ``source`` (null
    for a doc without one; the loader's ``train.mixture`` reads it there instead of looking every id up in the
    lineage)."""
    cols = {"id": pa.array(ids, pa.string())}
    if len(sources) == len(ids) and any(x is not None for x in sources):
        cols["source"] = pa.array(sources, pa.string()).dictionary_encode()
    pq.write_table(pa.table(cols), path)


def read_pieces(pieces: list[Piece], extra: tuple[str, ...] = (), batch_rows: int = 2048):
    """(ids, texts, sources, idxs) batches of a task's rows, read by the task itself (pyarrow, no JVM in the text's
    path); ``source`` and ``idx`` are read when ``extra`` names them, else None each."""
    for b in piece_batches(pieces, ["id", "text", *extra], batch_rows):
        none = [None] * b.num_rows
        cols = {name: b.column(name).to_pylist() for name in b.schema.names}
        yield cols["id"], cols["text"], cols.get("source", none), cols.get("idx", none)


SHARD_FILES = (".bin", ".idx", ".ids.parquet")


@dataclass(frozen=True)
class Upload:
    """Where the result is published on S3: ``s3://bucket/prefix/<file>`` for every file of the stage directory.
    ``settings`` are the S3 client's (plain, so the Spark tasks build their own client)."""

    settings: dict
    bucket: str
    prefix: str

    def put(self, s3, path: Path, rel: str, sha_hex: str) -> bool:
        """Upload one file unless the object already holds its bytes; True if it uploaded."""
        key = f"{self.prefix}/{rel}"
        if object_matches(s3, self.bucket, key, path, sha_hex, UPLOAD_PART):
            return False
        upload_checked(s3, self.bucket, key, path, sha_hex)
        return True


# A task's uploads: 3 attempts (botocore's own default: a blip or a short throttling burst passes in the task), then
# the driver's publish (DATA_BOUNDS: 5 attempts) uploads what is missing. With 5 in the tasks each task spent ~17 s of
# SlowDown backoff on a store that did not answer before leaving its shards to the driver (12 tasks on 2 cores: over
# 2 min before the stage's one line).
TASK_BOUNDS = replace(DATA_BOUNDS, attempts=3)


def upload_shards(up: Upload, out: Path, rows: list[dict]) -> None:
    """A task's shards (its files in ``out``) to S3, each file checked against S3's SHA-256 after upload
    (:data:`TASK_BOUNDS`)."""
    s3 = client_from(up.settings, TASK_BOUNDS)
    for r in rows:
        for ext in SHARD_FILES:
            path = out / (Path(r["prefix"]).name + ext)
            up.put(s3, path, r["prefix"] + ext, sha256_file(path))


def publish(m: Manifest, up: Upload) -> dict:
    """Complete the S3 copy of a committed result: every output checked against the manifest's sha256 (uploaded if
    missing or different), ``manifest.json`` last, so a reader that finds it finds every file."""
    s3 = client_from(up.settings)
    uploaded = sum(up.put(s3, m.dir / o["path"], o["path"], o["sha256"]) for o in m.outputs)
    s3.upload_file(str(m.path), up.bucket, f"{up.prefix}/manifest.json")
    return {"uri": f"s3://{up.bucket}/{up.prefix}", "objects": len(m.outputs) + 1, "uploaded_by_driver": uploaded}


def encoder(model: bytes, out: str, cfg: TokenizerCfg, split: Splitter, up: Upload | None = None, rel: str = "shards",
            extra: tuple[str, ...] = (), keep_sources: bool = False):
    """The Spark task: read a task's pieces (``extra``: the columns besides id and text), encode them (one thread:
    Spark runs a task per core) into its shards (with each doc's source beside its id when ``keep_sources``), in an
    attempt directory of its own under ``out`` (published by the driver); return one row per shard written, each
    with that directory."""
    def fn(part: int, tasks):
        from pipelines.data.spark import attempt_dir, maybe_fail

        sp = spm.SentencePieceProcessor(model_proto=model)
        eos = sp.eos_id()
        mine = attempt_dir(out)
        shards = PartitionShards(mine, part, token_dtype(sp.get_piece_size()), cfg.shard_tokens, rel)
        for pieces in tasks:
            for doc_ids, raw, sources, idxs in read_pieces(pieces, extra):
                parts = [(p, src) for i, t, src, idx in zip(doc_ids, raw, sources, idxs)
                         for p in split.parts(i, src, idx, canonical_text(t or ""))]
                by_split: dict[str, tuple[list, list, list, list]] = {s: ([], [], [], []) for s in SPLITS}
                encoded = sp.encode([p[2] for p, _ in parts], num_threads=1)
                for ((part_split, doc_id, text), src), ids in zip(parts, encoded):
                    ids.append(eos)
                    dest = by_split[part_split]
                    dest[0].append(doc_id)
                    dest[1].append(ids)
                    dest[2].append(len(text.encode("utf-8")))
                    dest[3].append(src if keep_sources else None)
                for name, (ids_, docs, nbytes, srcs) in by_split.items():
                    if docs:
                        shards.add(name, ids_, docs, nbytes, srcs)
        rows = shards.finish()
        if up:
            try:
                upload_shards(up, mine, rows)
            except Exception as e:  # noqa: BLE001 - an endpoint that did not answer, or refused: the driver says so
                if not unreachable(e):
                    raise
                # the driver's publish uploads what is missing, and its failure is one classified line (75 or 2),
                # where a task's raise failed the stage through Spark as a bug does (a traceback and exit 1)
                print(f"[tokenize] task {part}: the shards' upload left to the driver ({type(e).__name__}: "
                      f"{str(e)[:200]})", file=sys.stderr)
        maybe_fail("tokenize-write")
        return iter({**r, "dir": str(mine)} for r in rows)
    return fn


def partitions(spark, groups: list[tuple[str, int, int, int]], cfg: TokenizerCfg, task_mb: int = 128) -> int:
    """tokenizer.partitions, or at most about shard_tokens tokens (~4 bytes each) and ``task_mb`` of text a task,
    in whole waves of the executor cores."""
    from pipelines.data.spark import task_count

    text = sum(g[3] for g in groups)
    return task_count(spark, text, task_mb, cfg.partitions, at_least=math.ceil(text / 4 / cfg.shard_tokens))


def tokenize_docs(spark, docs_path: Path, out: Path, cfg: TokenizerCfg, seed: int, up: Upload | None = None,
                  task_mb: int = 128, model_from: Path | None = None, rel: str = "shards") -> dict:
    """Encode the docs into shards under ``out/rel`` with the tokenizer of ``model_from`` (else tokenizer.model_path,
    else one trained here); returns the counts and the shard rows."""
    split = splitter(docs_path, cfg, seed)
    frame = spark.read.parquet(str(docs_path))
    docs = frame.select("id", "text", *split.columns)
    # what the encoder reads besides id and text: the split's columns, and each doc's source for its shard's ids
    keep_sources = dict(frame.dtypes).get("source") == "string"
    extra = tuple(dict.fromkeys((*split.columns, *(("source",) if keep_sources else ()))))
    model = tokenizer_model(docs, out, cfg, seed, split, model_from)
    sp = spm.SentencePieceProcessor(model_proto=model)
    if sp.eos_id() < 0:
        raise TokenizeError("the tokenizer has no EOS id; documents need an EOS separator")
    from pipelines.data.spark import plan_pieces, prepare_attempts, publish_attempts, row_groups

    groups = row_groups(docs_path, "text")
    tasks = plan_pieces(groups, partitions(spark, groups, cfg, task_mb))
    rows = spark.sparkContext.parallelize(tasks, len(tasks)).mapPartitionsWithIndex(
        encoder(model, prepare_attempts(out / "_shards"), cfg, split, up, rel, extra, keep_sources)).collect()
    publish_attempts(out / "_shards", sorted({r.pop("dir") for r in rows}), {".": out / rel})
    shutil.rmtree(out / "_shards")
    n = len(tasks)
    shards = sorted(rows, key=lambda r: (SPLITS.index(r["split"]), r["prefix"]))
    counts = shard_counts(shards)
    if counts["train_tokens"] == 0 and model_from is None:
        raise TokenizeError("no tokens in the train split: the corpus is empty after filtering")
    return {"counts": counts, "shards": shards, "vocab_size": sp.get_piece_size(), "eos_id": sp.eos_id(),
            "dtype": token_dtype(sp.get_piece_size()).name, "partitions": n,
            "heldout": {"mode": cfg.heldout, "fraction": cfg.heldout_fraction}}


def shard_counts(shards: list[dict]) -> dict:
    """Docs, tokens and text bytes per split, and in all, of these shard rows."""
    counts = {f"{s}_{k}": sum(r[k] for r in shards if r["split"] == s) for s in SPLITS
              for k in ("docs", "tokens", "text_bytes")}
    counts["docs"] = counts["train_docs"] + counts["heldout_docs"]
    counts["tokens"] = counts["train_tokens"] + counts["heldout_tokens"]
    return counts


def read_back(m: Manifest, split: str) -> dict[str, list[int]]:
    """Every doc of a split, id → token ids (EOS included), read from the shards the manifest lists."""
    out: dict[str, list[int]] = {}
    for s in (s for s in m.extra["shards"] if s["split"] == split):
        sh = Shard.open(m.dir / s["prefix"])
        ids = pq.read_table(m.dir / (s["prefix"] + ".ids.parquet")).column("id").to_pylist()
        out.update((i, sh.doc(k).tolist()) for k, i in enumerate(ids))
    return out


def upload_target(spec: JobSpec, name: str) -> Upload | None:
    """services.shards_uri + the stage directory's name, with the bucket made if missing; None when unset."""
    if not spec.services.shards_uri:
        return None

    bucket, prefix = split_uri(spec.services.shards_uri)
    try:
        settings = client_settings(spec)
        ensure_bucket(client_from(settings), bucket, spec.services.s3_region)
    except S3ConfigError as e:
        if outage(e):  # the embedded endpoint down: a retry finds it started (75, stage_main), not a spec to fix
            raise
        raise TokenizeError(f"services.shards_uri={spec.services.shards_uri}: {e}") from None
    return Upload(settings, bucket, f"{prefix}/{name}".strip("/"))


def corpus_record(filt: Manifest, prev: Manifest | None) -> dict:
    """The corpus version a tokenize result is: its number, the identities of every input curated into it, the dedup
    results whose kept docs it holds (what the next version dedups against), and the version before it."""
    lin = lineage(filt.path)  # a filter result made by hand has no ingest or dedup before it
    ing = load_manifest(lin["ingest"]) if "ingest" in lin else None
    ingested = ing.inputs if ing is not None else []
    cut = set(ing.extra.get("cut_inputs", [])) if ing is not None else set()  # max_docs: not read whole
    before = prev.extra["corpus"] if prev is not None else {"version": 0, "inputs": [], "dedup": []}
    return {"version": before["version"] + 1,
            "inputs": before["inputs"] + [i["sha256"] for i in ingested if "stage" not in i and i["sha256"] not in cut],
            "dedup": before["dedup"] + ([lin["dedup"]] if "dedup" in lin else []),
            "previous": prev.path if prev is not None else None}


def contamination_record(filt: Manifest, prev: Manifest | None) -> dict:
    """Per evaluation task, which of its items overlap docs of this corpus version: the items the decontaminate
    stage saw in docs it kept, over every version so far (``complete`` is false when part of the corpus was not
    checked against these same files, e.g. tokenized straight from a filter result)."""
    lin = lineage(filt.path)
    new = load_manifest(lin["decontaminate"]).extra["contamination"] if "decontaminate" in lin else {}
    before = prev.extra.get("contamination", {}) if prev is not None else {}
    out = {}
    for task in sorted(set(new) | set(before)):
        n, b = new.get(task), before.get(task)
        comparable = n is None or b is None or (b["sha256"], b["ngram"]) == (n["sha256"], n["ngram"])
        parts = [r for r in (n, b if comparable else None) if r]
        out[task] = {"sha256": parts[0]["sha256"], "ngram": parts[0]["ngram"], "items": parts[0]["items"],
                     "complete": n is not None and (prev is None or (b is not None and comparable and b["complete"])),
                     "overlapping_kept": sorted(set().union(*(r["overlapping_kept"] for r in parts))),
                     "docs_removed": sum(r["docs_removed"] for r in parts)}
    return out


LINK_REFUSED = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}  # a copy


def plain_file(p: Path, where: str) -> Path:
    """``p``, a file a corpus version's manifest names (``where``: that manifest), when it is a plain file: a symlink,
    a FIFO (which would block its reader), a directory is refused (:class:`ManifestInvalid`: a manifest is data, and
    its directory may be written by anyone who writes the shared FS)."""
    if not stat.S_ISREG(p.lstat().st_mode):
        raise ManifestInvalid(f"manifest {where}: {p} is not a plain file; refusing it")
    return p


def _open_plain(p: Path, where: str) -> tuple[int, os.stat_result]:
    """``p`` opened for reading without following a link (ELOOP: a symlink) nor waiting on a FIFO, and its status,
    when what was opened is a plain file (:func:`plain_file`'s rule, with no moment between the check and the use);
    else refused in one line."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ManifestInvalid(f"manifest {where}: {p} is a symlink, not a plain file; refusing it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ManifestInvalid(f"manifest {where}: {p} is not a plain file; refusing it")
    return fd, st


def plain_bytes(p: Path, where: str) -> bytes:
    """The bytes of ``p``, read only as a plain file (:func:`_open_plain`)."""
    fd, _ = _open_plain(p, where)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def link_shards(prev: Manifest, out: Path, skip: frozenset[str] = frozenset()) -> list[dict]:
    """The previous version's shards (but ``skip``), hard-linked into ``out`` under their own names (copied across
    file systems): byte for byte the same files. Every name is checked before any is linked: one outside the
    version's directory, or not a plain file there (:func:`plain_file`), is refused (:class:`ManifestInvalid`, 2)."""
    rows = [sh for sh in prev.extra["shards"] if sh["prefix"] not in skip]
    pairs = []
    for sh in rows:
        for ext in SHARD_FILES:
            try:
                pairs.append((under(prev.dir, sh["prefix"] + ext), under(out, sh["prefix"] + ext)))
            except ValueError as e:
                raise ManifestInvalid(f"manifest {prev.path}: shard {sh['prefix']!r}: {e}; refusing it") from None
            plain_file(pairs[-1][0], str(prev.path))
    for src, dest in pairs:
        dest.parent.mkdir(parents=True, exist_ok=True)
        _link_checked(src, dest, str(prev.path))
    return rows


def _link_checked(src: Path, dest: Path, where: str) -> None:
    """``src`` hard-linked at ``dest`` (copied where the file system refuses a link), and only the plain file that
    was checked: opened without following a link, and the link's inode compared with it, so an entry swapped in
    between (a symlink leading out) is never linked nor copied."""
    fd, st = _open_plain(src, where)
    try:
        try:
            os.link(src, dest, follow_symlinks=False)
        except OSError as e:  # another file system, or one without hard links: a copy of the file opened
            if e.errno not in LINK_REFUSED:
                raise
            with os.fdopen(os.dup(fd), "rb") as r, open(dest, "xb") as w:
                shutil.copyfileobj(r, w, 16 << 20)
            return
        got = os.lstat(dest)
        if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):  # another entry put in its place meanwhile
            dest.unlink()
            raise ManifestInvalid(f"manifest {where}: {src} changed while it was linked; refusing it")
    finally:
        os.close(fd)


def keep_shards(prev: Manifest, out: Path, rel: str, drop: dict, held: dict) -> tuple[list, list, dict]:
    """The previous version's shards in ``out``, in their order: linked as they are, or (the ``held`` ones, which
    hold entries of ``drop``: id → exclusion index) written again as ``rel/takedown-<split>-NNNNN`` without them (a
    shard left empty is dropped); the entries each exclusion removed, and the shards rewritten (old prefix → new, or
    None)."""
    sp = spm.SentencePieceProcessor(model_proto=plain_bytes(prev.output("tokenizer"), str(prev.path))) \
        if held else None
    linked = {sh["prefix"]: sh for sh in link_shards(prev, out, frozenset(held))}
    removed, rows, rewritten = [0] * (max(drop.values(), default=-1) + 1), [], {}
    for sh in prev.extra["shards"]:
        if sh["prefix"] in linked:
            rows.append(sh)
            continue
        name = f"{rel}/takedown-{sh['split']}-{len(rewritten):05d}"
        new = strip_shard(prev.dir, sh, drop, out, name, prev.extra["dtype"], removed, sp)
        rewritten[sh["prefix"]] = new["prefix"] if new else None
        rows += [new] if new else []
    return rows, removed, rewritten


def strip_shard(src: Path, row: dict, drop: dict[str, int], dest: Path, prefix: str, dtype: str, removed: list[int],
                sp) -> dict | None:
    """Shard ``row`` of the directory ``src`` written again as ``dest/prefix`` without the entries in ``drop`` (ids
    beside it; ``removed[k]`` counts exclusion k's; the text bytes of each are its tokens decoded by ``sp``, the
    corpus's tokenizer); its new row, or None when no entry is left."""
    for ext in SHARD_FILES:  # read by name: plain files only (a FIFO would block the read for ever)
        plain_file(under(src, row["prefix"] + ext), str(src))
    shard = Shard.open(under(src, row["prefix"]))
    beside = pq.read_table(under(src, row["prefix"] + ".ids.parquet"))
    ids = beside.column("id").to_pylist()
    sources = beside.column("source").to_pylist() if "source" in beside.column_names else []
    kept, gone_bytes = [], 0
    for k, i in enumerate(ids):
        if i in drop:
            removed[drop[i]] += 1
            gone_bytes += len(sp.decode(shard.doc(k)[:-1].tolist()).encode("utf-8"))  # EOS last
        else:
            kept.append(k)
    if not kept:
        return None
    (dest / prefix).parent.mkdir(parents=True, exist_ok=True)
    w = ShardWriter(dest / prefix, np.dtype(dtype))
    for k in kept:
        w.add(shard.doc(k))
    w.close()
    write_doc_ids(dest / (prefix + ".ids.parquet"), [ids[k] for k in kept], [sources[k] for k in kept] if sources else [])
    return {**row, "prefix": prefix, "docs": len(kept), "tokens": w.tokens,
            "text_bytes": max(0, row["text_bytes"] - gone_bytes)}


def takedown_record(applied: TakedownList, removed: list[int], rewritten: dict, by_filter: dict, late: dict) -> dict:
    """``extra.takedown``: the list applied (its sha256), each exclusion with its reason, the shard entries of earlier
    versions it removed here (``docs_removed``) and the new docs it kept out (``new_docs_removed``: the filter
    stage's count, from ``by_filter``, its record, null where it did not count them, plus those this stage left out
    itself, ``late``: id → exclusion, when the filter stage applied another list), and the shards rewritten."""
    gone = removed + [0] * (len(applied.exclusions) - len(removed))
    per = {x.get("source"): x.get("docs_removed") for x in by_filter.get("by_exclusion", [])}
    if recorded_sha256(by_filter) == applied.sha256:
        new = [per.get(e.source) for e in applied.exclusions]
    else:
        here = Counter(late.values())
        new = [(per.get(e.source) or 0) + here[k] for k, e in enumerate(applied.exclusions)]
    return {"list_sha256": applied.sha256,
            "exclusions": [{**e.__dict__, "docs_removed": n, "new_docs_removed": f}
                           for e, n, f in zip(applied.exclusions, gone, new)],
            "docs_removed": sum(gone), "new_docs_removed": by_filter.get("removed", 0) + len(late),
            "new_docs_removed_by_tokenize": len(late), "shards_rewritten": rewritten}


def run(spec: JobSpec, filt: Manifest, out_dir: str | None = None, spark=None,
        corpus: Manifest | None = None) -> Manifest:
    """Tokenize the decontaminated (or filtered) docs into a corpus version: with ``corpus`` (the version before),
    only the new docs are encoded, with its tokenizer, into ``shards/vNNNN/``, and its shards are kept as they are,
    but those that hold docs of the takedown list (``data.exclusions``), which are written again without them; when
    no new doc arrived and nothing is taken down, ``corpus`` itself is the answer."""
    if corpus is not None and "corpus" not in corpus.extra:
        raise TokenizeError(f"--corpus-manifest {corpus.path}: not a corpus version (a tokenize result of this "
                            "version)")
    applied = read_list(resolve_path(spec.data.exclusions))  # read once: what this version applies and records
    by_filter = filter_takedown(filt)
    late = late_takedown(filt, applied, by_filter)
    drop, held = taken_down(corpus, applied.exclusions)
    if corpus is not None and not new_docs(filt, late) and not held:
        print(f"tokenize: no new docs; corpus version {corpus.extra['corpus']['version']} stands ({corpus.path})")
        return corpus
    inputs = [input_ref(filt), *([input_ref(corpus)] if corpus is not None else [])]
    if spec.tokenizer.model_path and corpus is None:
        inputs.append(file_ref(resolve_path(spec.tokenizer.model_path)))
    if applied.exclusions:
        inputs.append(applied.ref())  # a new exclusion is a changed input
    sd = stage_dir(spec, "tokenize", inputs, out_dir)
    up = upload_target(spec, sd.final.name)

    def body(tmp: Path) -> Manifest:
        s = spark
        if s is None and encodes_on_spark(filt, corpus, late):  # before the kept shards are linked: a run that
            from pipelines.data.spark import spec_session      # refuses Spark stops here

            s = spec_session(spec, "llm-pipeline-tokenize")
        record = corpus_record(filt, corpus)
        rel = "shards" if corpus is None else f"shards/v{record['version']:04d}"
        old, removed, rewritten = keep_shards(corpus, tmp, rel, drop, held) if corpus is not None else ([], [], {})
        r = encode_new(spec, filt, corpus, tmp, rel, s, up, late)
        shards = old + r["shards"]
        if shard_counts(shards)["train_tokens"] == 0:
            raise TokenizeError("no tokens left in the train split" + (" after the takedown" if drop else ""))
        outputs = {"tokenizer": "tokenizer.model"}
        outputs.update((sh["prefix"] + ext, sh["prefix"] + ext) for sh in shards for ext in SHARD_FILES)
        extra = {"shards": shards, "tokenizer_sha256": sha256_file(tmp / "tokenizer.model"), "corpus": record,
                 **{k: r[k] for k in ("vocab_size", "eos_id", "dtype", "spark_master", "partitions", "heldout")},
                 "contamination": contamination_record(filt, corpus)}
        if applied.exclusions:
            extra["takedown"] = takedown_record(applied, removed, rewritten, by_filter, late)
        ready = sd.prepare(outputs, counts={**shard_counts(shards), "new_docs": r["counts"]["docs"],
                                            "new_tokens": r["counts"]["tokens"]}, extra=extra)  # hashed unlocked
        with list_held(applied.path) as now:  # the rename only: an --exclude-source meanwhile waits for it
            check_still_current(applied, now)
            return sd.publish(ready)

    m = run_and_log(spec, sd, body)
    if up:
        got = publish(m, up)
        print(f"tokenize: published to {got['uri']}/ ({got['objects']} objects, each checked against its sha256; "
              f"{got['uploaded_by_driver']} uploaded by the driver: the tokenizer and any the Spark tasks had not)", flush=True)
    return m


def new_docs(filt: Manifest, late: dict) -> bool:
    """Whether the filter's kept docs hold any doc that ``late`` (taken down since) does not take."""
    return filt.counts.get("kept", 0) > len(late)


def encodes_on_spark(filt: Manifest, corpus: Manifest | None, late: dict) -> bool:
    """Whether :func:`encode_new` encodes on Spark: a new doc, or a first version that no takedown emptied."""
    return new_docs(filt, late) or (corpus is None and not late)


def encode_new(spec: JobSpec, filt: Manifest, corpus: Manifest | None, tmp: Path, rel: str, spark, up,
               late: dict) -> dict:
    """The new docs (but ``late``'s) encoded into shards under ``tmp/rel`` (with ``corpus``'s tokenizer) on
    ``spark``; with no new doc (a takedown alone) no Spark: the tokenizer copied, no shard."""
    if not encodes_on_spark(filt, corpus, late):
        if corpus is None:
            raise TokenizeError(f"no docs left: the takedown list takes every one of the {len(late)} docs")
        (tmp / "tokenizer.model").write_bytes(plain_bytes(corpus.output("tokenizer"), str(corpus.path)))
        return {"shards": [], "counts": {"docs": 0, "tokens": 0}, "partitions": 0, "spark_master": "none (no new docs)",
                **{k: corpus.extra.get(k) for k in ("vocab_size", "eos_id", "dtype", "heldout")}}
    docs = without_docs(filt.output("kept"), late, tmp / "takedown-docs") if late else filt.output("kept")
    r = tokenize_docs(spark, docs, tmp, spec.tokenizer, spec.run.seed, up, spec.data.task_mb,
                      corpus.output("tokenizer") if corpus is not None else None, rel)  # read by plain_bytes
    if late:
        shutil.rmtree(docs)  # not an output: the filter stage's docs less the ones left out
    return {**r, "spark_master": spark.sparkContext.master}


def without_docs(src: Path, ids, dest: Path) -> Path:
    """The docs of the parquet directory ``src`` but ``ids``, in their order, written to ``dest``."""
    import pyarrow.dataset as ds

    data = ds.dataset(str(src), format="parquet")
    keep = ~ds.field("id").isin(pa.array(sorted(ids), pa.string()))
    ds.write_dataset(data.scanner(filter=keep), str(dest), format="parquet", preserve_order=True)
    return dest


def _short(sha: str | None) -> str:
    return sha[:12] if sha else "none (no exclusion)"


def filter_takedown(filt: Manifest) -> dict:
    """The ``extra.takedown`` of the filter stage of ``filt``'s run ({} when it recorded none)."""
    at = filt.path if filt.stage == "filter" else lineage(filt.path).get("filter")
    return load_manifest(at).extra.get("takedown", {}) if at else {}


def late_takedown(filt: Manifest, applied: TakedownList, by_filter: dict) -> dict[str, int]:
    """The new docs that ``applied`` takes when the filter stage of the run applied another list (an exclusion
    landed between the two stages), id → exclusion index: this stage leaves them out itself, so the version it
    records ``applied`` for holds none of it (and a retry of this stage alone needs no new filter result); {} when
    the filter stage applied this list."""
    if not applied.exclusions or recorded_sha256(by_filter) == applied.sha256:
        return {}
    import pyarrow.dataset as ds

    data = ds.dataset(str(filt.output("kept")), format="parquet")
    t = data.to_table(columns=[c for c in ("id", "source", "url") if c in data.schema.names])
    late = {i: k for k, part in split_by_exclusion(t, applied.exclusions) for i in part.column("id").to_pylist()}
    print(f"tokenize: data.exclusions ({applied.path}) changed after the filter stage applied it (sha256 "
          f"{_short(recorded_sha256(by_filter))} there, {_short(applied.sha256)} now): this stage applies the "
          f"current list to the new docs itself, {len(late)} left out", flush=True)
    return late


def check_still_current(applied: TakedownList, now: str | None) -> None:
    """The list this stage applied must still be the list when its corpus version is published."""
    if now != applied.sha256:
        raise ListChanged(f"data.exclusions ({applied.path}) changed while the tokenize stage ran (sha256 "
                          f"{_short(applied.sha256)} applied, {_short(now)} now): this corpus version could hold docs "
                          "of the new exclusion, so nothing is published; run the stage again (the task's retry "
                          "does, exit 75): it applies the current list")


def taken_down(corpus: Manifest | None, exclusions: tuple) -> tuple[dict, dict]:
    """The shard entries of ``corpus`` that the takedown list takes out (id → exclusion), and the shards that still
    hold any ({prefix: entries})."""
    if corpus is None or not exclusions:
        return {}, {}
    drop = excluded_docs(corpus, exclusions)
    return drop, (shards_holding(corpus, set(drop)) if drop else {})


def summary(m: Manifest) -> str:
    c = m.counts
    return (f"tokenize: {c['docs']} docs → {c['train_tokens']:,} train + {c['heldout_tokens']:,} held-out tokens "
            f"in {len(m.extra['shards'])} shards from {m.extra['partitions']} Spark partition(s) on "
            f"{m.extra['spark_master']} (vocab {m.extra['vocab_size']}); corpus version {m.extra['corpus']['version']} "
            f"({c['new_docs']} new docs{takedown_note(m)}); manifest {m.path}")


def takedown_note(m: Manifest) -> str:
    t, parts = m.extra.get("takedown") or {}, []
    if t.get("docs_removed"):
        parts.append(f"{t['docs_removed']} taken down: "
                     + ", ".join(f"{e['source']} {e['docs_removed']}" for e in t["exclusions"] if e["docs_removed"])
                     + f"; {len(t['shards_rewritten'])} shard(s) rewritten")
    if t.get("new_docs_removed"):
        parts.append(f"{t['new_docs_removed']} new doc(s) of excluded sources removed by the filter stage")
    return "".join(f", {p}" for p in parts)


def main(argv: list[str] | None = None) -> int:
    return stage_main("tokenize", run, summary, argv, add_args=add_corpus_arg,
                      call=lambda spec, args, ups: run(spec, *ups, out_dir=args.output, corpus=corpus_arg(args)))


if __name__ == "__main__":
    sys.exit(main())
