"""Tokenize: train (or take) a SentencePiece model, encode filtered docs into mmap shards.

* Normalisation before tokenization: Unicode NFKC, ``\\r\\n``/``\\r`` → ``\\n``. The trained model
  uses SentencePiece's ``identity`` normaliser, keeps whitespace as is, has ``\\n`` as a piece and
  byte fallback, so ``decode(encode(doc)) == normalise(doc)`` exactly.
* Split: a doc goes to ``heldout`` when ``sha256(seed:id)`` falls under ``heldout_fraction``,
  else to ``train`` (stable under corpus growth: a doc never changes split).
* Shards: ``shards/{train,heldout}-NNNNN.{bin,idx}`` (format in ``pipelines.data.shards``),
  EOS after every doc, a new shard every ``shard_tokens`` tokens.

Counts: docs and tokens per split; the manifest lists every shard with its token count, doc count
and the UTF-8 bytes of its source text (for bits-per-byte).
"""
from __future__ import annotations

import hashlib
import shutil
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds

from pipelines.data.shards import ShardWriter, token_dtype
from pipelines.cli import run_and_log, stage_dir, stage_main
from pipelines.manifest import Manifest, StageError, file_ref, input_ref, sha256_file
from pipelines.progress import progress
from pipelines.spec import JobSpec, TokenizerCfg, resolve_path

SPLITS = ("train", "heldout")


class TokenizeError(StageError):
    pass


def normalise(text: str) -> str:
    return unicodedata.normalize("NFKC", text).replace("\r\n", "\n").replace("\r", "\n")


def split_of(doc_id: str, seed: int, heldout_fraction: float) -> str:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()[:8], "big")
    return "heldout" if h / 2**64 < heldout_fraction else "train"


def train_sentencepiece(texts: list[str], out_prefix: Path, cfg: TokenizerCfg, seed: int) -> Path:
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    sample = out_prefix.with_suffix(".sample.txt")
    with open(sample, "w", encoding="utf-8") as f:
        for t in texts:
            for line in t.split("\n"):
                if line.strip():
                    f.write(line + "\n")
    spm.SentencePieceTrainer.train(
        input=str(sample), model_prefix=str(out_prefix), vocab_size=cfg.vocab_size,
        model_type=cfg.model_type, character_coverage=cfg.character_coverage, byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        user_defined_symbols=["\n"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=2, input_sentence_size=2_000_000, shuffle_input_sentence=True,
        minloglevel=2,
    )
    sample.unlink()
    return out_prefix.with_suffix(".model")


def _iter_docs(path: Path):
    for batch in ds.dataset(str(path), format="parquet").to_batches(columns=["idx", "id", "text"],
                                                                     batch_size=1024):
        yield from zip(batch.column(1).to_pylist(), batch.column(2).to_pylist())


def tokenize_docs(docs_path: Path, out: Path, cfg: TokenizerCfg, seed: int) -> dict:
    import sentencepiece as spm

    # 1. tokenizer: given, or trained on a deterministic sample of the train split
    if cfg.model_path:
        src = resolve_path(cfg.model_path)
        if not src.is_file():
            raise TokenizeError(f"tokenizer.model_path {src} does not exist")
        shutil.copyfile(src, out / "tokenizer.model")
    else:
        ranked = sorted(
            ((hashlib.sha256(f"{seed}:tok:{i}".encode()).digest(), t) for i, t in _iter_docs(docs_path)
             if split_of(i, seed, cfg.heldout_fraction) == "train"),
            key=lambda x: x[0])[: cfg.sample_docs]
        if not ranked:
            raise TokenizeError("no training docs left to train a tokenizer on (did every doc get filtered?)")
        model = train_sentencepiece([normalise(t) for _, t in ranked], out / "tokenizer", cfg, seed)
        for extra in (out / "tokenizer.vocab",):
            extra.unlink(missing_ok=True)
        assert model == out / "tokenizer.model"
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    vocab, eos = sp.get_piece_size(), sp.eos_id()
    if eos < 0:
        raise TokenizeError("the tokenizer has no EOS id; documents need an EOS separator")
    dtype = token_dtype(vocab)

    # 2. encode into shards
    (out / "shards").mkdir()
    counts = {f"{s}_{k}": 0 for s in SPLITS for k in ("docs", "tokens", "text_bytes")}
    shards: list[dict] = []
    writers: dict[str, ShardWriter | None] = {s: None for s in SPLITS}
    shard_no = {s: 0 for s in SPLITS}
    shard_bytes = {s: 0 for s in SPLITS}

    def close(split: str) -> None:
        w = writers[split]
        if w is not None:
            w.close()
            shards.append({"split": split, "prefix": f"shards/{w.prefix.name}", "docs": len(w.lengths),
                           "tokens": w.tokens, "text_bytes": shard_bytes[split]})
            writers[split] = None
            shard_no[split] += 1
            shard_bytes[split] = 0

    buf: list[tuple[str, str]] = []

    def flush() -> None:
        texts = [normalise(t) for _, t in buf]
        encoded = sp.encode(texts, num_threads=2)
        for (doc_id, _), text, ids in zip(buf, texts, encoded):
            split = split_of(doc_id, seed, cfg.heldout_fraction)
            w = writers[split]
            if w is not None and w.tokens + len(ids) + 1 > cfg.shard_tokens and w.lengths:
                close(split)
                w = None
            if w is None:
                w = writers[split] = ShardWriter(out / "shards" / f"{split}-{shard_no[split]:05d}", dtype)
            w.add(np.append(np.asarray(ids, dtype=np.int64), eos))
            nbytes = len(text.encode("utf-8"))
            shard_bytes[split] += nbytes
            counts[f"{split}_docs"] += 1
            counts[f"{split}_tokens"] += len(ids) + 1
            counts[f"{split}_text_bytes"] += nbytes
        bar.update(len(buf))
        buf.clear()

    with progress(desc="tokenize", unit="doc") as bar:
        for doc_id, text in _iter_docs(docs_path):
            buf.append((doc_id, text))
            if len(buf) >= 1024:
                flush()
        if buf:
            flush()
    for s in SPLITS:
        close(s)
    if counts["train_tokens"] == 0:
        raise TokenizeError("no tokens in the train split: the corpus is empty after filtering")
    counts["docs"] = counts["train_docs"] + counts["heldout_docs"]
    counts["tokens"] = counts["train_tokens"] + counts["heldout_tokens"]
    return {"counts": counts, "shards": shards, "vocab_size": vocab, "eos_id": eos, "dtype": dtype.name}


def run(spec: JobSpec, filt: Manifest, out_dir: str | None = None) -> Manifest:
    cfg = spec.tokenizer
    inputs = [input_ref(filt)]
    if cfg.model_path:
        inputs.append(file_ref(resolve_path(cfg.model_path)))
    sd = stage_dir(spec, "tokenize", inputs, out_dir)

    def body(tmp: Path) -> Manifest:
        r = tokenize_docs(filt.output("kept"), tmp, cfg, spec.run.seed)
        outputs = {"tokenizer": "tokenizer.model"}
        for sh in r["shards"]:
            outputs[f"{sh['prefix']}.bin"] = f"{sh['prefix']}.bin"
            outputs[f"{sh['prefix']}.idx"] = f"{sh['prefix']}.idx"
        return sd.commit(outputs, counts=r["counts"], extra={
            "shards": r["shards"], "vocab_size": r["vocab_size"], "eos_id": r["eos_id"], "dtype": r["dtype"],
            "tokenizer_sha256": sha256_file(tmp / "tokenizer.model"),
        })

    return run_and_log(spec, sd, body)


def summary(m: Manifest) -> str:
    c = m.counts
    return (f"tokenize: {c['docs']} docs → {c['train_tokens']:,} train + {c['heldout_tokens']:,} held-out tokens "
            f"in {len(m.extra['shards'])} shards (vocab {m.extra['vocab_size']}); manifest {m.path}")


def main(argv: list[str] | None = None) -> int:
    return stage_main("tokenize", run, summary, argv)


if __name__ == "__main__":
    sys.exit(main())
