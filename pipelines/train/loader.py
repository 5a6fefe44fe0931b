"""Deterministic, resumable, DP-sliced sampling over memory-mapped token shards.

* A *sample* is ``seq_len + 1`` consecutive tokens (inputs + shifted targets) of the split's token stream, the
  train shards read back to back in manifest order (:class:`~pipelines.data.shards.TokenStream`): sample i starts
  at token ``i·seq_len`` and there are ``(tokens − 1) // seq_len`` of them. A sample may span two shards, so the
  samples do not depend on how many partitions tokenization ran with.
* The global order for epoch e is a permutation drawn from ``(seed, e)``; global batch k is
  positions ``[k·G, (k+1)·G)`` of the concatenated epoch orders (G = micro × accum × DP).
* Rank r of D takes the contiguous slice ``[r·G/D, (r+1)·G/D)`` of each global batch
  (Megatron style). The whole position is one integer, ``consumed_samples``, so resuming on a
  different DP size keeps the same global sample order.
* :class:`Prefetcher` builds the next steps' micro-batch tensors in a thread while the current step
  computes (pinned memory on CUDA); it reads positions ahead but advances ``consumed_samples`` only
  when the trainer takes a step's batches, so a checkpoint's loader state is exact.
* ``skip``: global batch start positions never trained on (the batches a loss-spike rollback skipped);
  saved with the position, so a resumed run skips them too.
* ``train.mixture`` (:class:`MixtureSamples`, :class:`Blend`, :class:`MixtureSampler`): samples are cut from each
  source's own token stream, and position p draws from the source the blend gives it, still a function of p alone
  (docs/training.md, *Data mixtures*). Without a mixture nothing above changes.
"""
from __future__ import annotations

import fnmatch
import hashlib
import queue
import re
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.data.shards import TokenStream, first_out_of_vocab, out_of_vocab_message
from pipelines.lineage.queries import VersionUnreadable, added_docs, chain
from pipelines.manifest import StageError


class TokenSamples:
    def __init__(self, shard_prefixes: list[Path], seq_len: int):
        self.stream = TokenStream(shard_prefixes)
        self.seq_len = seq_len
        self.count = max(0, (len(self.stream) - 1) // seq_len)
        if self.count == 0:
            raise ValueError(f"no sample of {seq_len + 1} tokens fits in the shards; lower model.seq_len")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.count:
            raise IndexError(f"sample {i} of {self.count}")
        return self.stream.read(i * self.seq_len, (i + 1) * self.seq_len + 1)

    def position(self, i: int, col: int) -> int:
        """Where token ``col`` of sample ``i`` lies in the token stream."""
        return i * self.seq_len + col


class DPSampler:
    """Yields this rank's sample ids per global batch; state is ``consumed_samples``."""

    def __init__(self, num_samples: int, global_batch: int, dp_rank: int, dp_size: int, seed: int):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by DP size {dp_size}")
        self.n, self.G, self.rank, self.D, self.seed = num_samples, global_batch, dp_rank, dp_size, seed
        self.consumed_samples = 0
        self.skip: set[int] = set()
        self._cache: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            self._cache = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return self._cache[epoch]

    def global_batch(self, consumed: int) -> np.ndarray:
        return self.ids_at(np.arange(consumed, consumed + self.G, dtype=np.int64))

    def ids_at(self, pos: np.ndarray) -> np.ndarray:
        """The sample id at each global position."""
        epochs = pos // self.n
        ids = np.empty(self.G, dtype=np.int64)
        for e in np.unique(epochs):  # at most two epochs meet inside one global batch (unless G > n)
            sel = epochs == e
            ids[sel] = self._order(int(e))[pos[sel] % self.n]
        return ids

    def local_at(self, consumed: int) -> np.ndarray:
        """This rank's slice of the global batch that starts at position ``consumed``."""
        per = self.G // self.D
        return self.global_batch(consumed)[self.rank * per:(self.rank + 1) * per]

    def skip_to(self, consumed: int) -> int:
        """The first global batch position at or after ``consumed`` that is not skipped."""
        while consumed in self.skip:
            consumed += self.G
        return consumed

    def next_local(self) -> np.ndarray:
        pos = self.skip_to(self.consumed_samples)
        self.consumed_samples = pos + self.G
        return self.local_at(pos)

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed, "global_batch": self.G,
                "skip": sorted(self.skip)}

    def load_state_dict(self, sd: dict) -> None:
        if sd["global_batch"] != self.G or sd["seed"] != self.seed:
            raise ValueError(f"loader state was saved with global batch {sd['global_batch']} and seed {sd['seed']}, "
                             f"this run has {self.G} and {self.seed}")
        if sd.get("mixture") != self.state_dict().get("mixture"):
            raise ValueError(f"loader state was saved with train.mixture shares {sd.get('mixture')}, this run has "
                             f"{self.state_dict().get('mixture')}")
        self.consumed_samples = int(sd["consumed_samples"])
        self.skip = set(sd.get("skip", []))


class TokenOutOfVocab(ValueError):
    """A sample holds a token id outside the tokenizer's vocabulary: shards written by another tokenizer, or
    damaged (exit 2, final: every try would read the same id)."""


def batch_tensors(samples: TokenSamples, ids: np.ndarray, vocab: int | None = None):
    """The samples' inputs and targets, ``(len(ids), seq_len)`` each. With ``vocab``, a token id ≥ it raises
    :class:`TokenOutOfVocab` here, on the host, naming the shard that holds it and the sample (on a GPU the
    embedding or the loss would stop the step with a device-side assert that ends the CUDA context and says nothing of
    the data)."""
    import torch

    arr = np.stack([samples[int(i)] for i in ids])
    bad = first_out_of_vocab(arr, vocab) if vocab is not None else None
    if bad is not None:
        row, col = bad
        shard = samples.stream.shard_at(samples.position(int(ids[row]), col))
        raise TokenOutOfVocab(out_of_vocab_message(shard, int(arr[row, col]), f"sample {int(ids[row])}", vocab,
                                                   "the tokenizer's"))
    t = torch.from_numpy(arr)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class Prefetcher:
    """Yields one step's micro-batches ``[(x, y)] × grad_accum`` for this rank, prepared ``depth`` steps
    ahead in a daemon thread (``depth=0``: built inline). ``sampler.consumed_samples`` moves forward
    by one global batch per :meth:`next_step`, never by what is only prefetched."""

    def __init__(self, samples: TokenSamples, sampler: DPSampler, grad_accum: int, depth: int = 2,
                 pin_memory: bool = False, vocab: int | None = None):
        self.samples, self.sampler, self.accum, self.pin, self.vocab = samples, sampler, grad_accum, pin_memory, vocab
        self.depth = depth
        self.position = -1  # global batch position of the step last handed out
        self._q: "queue.Queue" = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._work, args=(sampler.consumed_samples,), daemon=True,
                                            name="llmp-prefetch")
            self._thread.start()

    def _build(self, consumed: int) -> list:
        micro = self.sampler.local_at(consumed).reshape(self.accum, -1)
        out = []
        for ids in micro:
            x, y = batch_tensors(self.samples, ids, self.vocab)
            if self.pin:
                x, y = x.pin_memory(), y.pin_memory()
            out.append((x, y))
        return out

    def _work(self, consumed: int) -> None:
        while not self._stop.is_set():
            consumed = self.sampler.skip_to(consumed)
            try:
                item = (consumed, self._build(consumed), None)
            except BaseException as e:  # surfaced to the trainer on its next_step
                item = (consumed, None, e)
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            consumed += self.sampler.G

    def next_step(self) -> list:
        pos = self.sampler.skip_to(self.sampler.consumed_samples)
        if self._thread is None:
            batches = self._build(pos)
        else:
            consumed, batches, err = self._q.get()
            if err is not None:
                raise err
            assert consumed == pos, "prefetch position out of step with the sampler"
        self.position = pos
        self.sampler.consumed_samples = pos + self.sampler.G
        return batches

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------- data mixtures
ANY = "*"  # train.mixture's key for every source no other key matches
BLEND_PERIOD = 1 << 16  # positions of one blend block: shares are exact to 1 / BLEND_PERIOD over whole blocks


class MixtureError(ValueError):
    """A ``train.mixture`` this corpus cannot have; the message names the key (or source) to fix."""


def mixture_weights(mixture: dict[str, float], sources: list[str]) -> dict[str, float]:
    """Each source's weight under ``train.mixture``: its own key, else the one glob (fnmatch, case-sensitive) that
    matches it, else ``"*"``. A key that matches no source, a source that two globs match or that nothing weighs,
    and a mixture of weights all 0 are refused."""
    known = set(sources)
    exact = {k: w for k, w in mixture.items() if k in known}
    globs = {k: {s for s in sources if fnmatch.fnmatchcase(s, k)} for k in mixture if k != ANY and k not in known}
    for k, hits in globs.items():
        if not hits:
            raise MixtureError(f"train.mixture: key {k!r} matches no source of the corpus's train split "
                               f"({_listed(sources)}): fix the key or remove it")
    out = {}
    for s in sources:
        keys = [k for k, hits in globs.items() if s in hits]
        if s not in exact and len(keys) > 1:
            raise MixtureError(f"train.mixture: source {s!r} matches both {keys[0]!r} and {keys[1]!r}: give it a key "
                               "of its own")
        if s not in exact and not keys and ANY not in mixture:
            raise MixtureError(f"train.mixture: source {s!r} has no weight: name it, match it with a glob, or add "
                               f"'{ANY}': 1 (or 0, to leave it out) for every source not named")
        out[s] = float(exact[s] if s in exact else mixture[keys[0]] if keys else mixture[ANY])
    if not any(w > 0 for w in out.values()):
        raise MixtureError("train.mixture: every source has weight 0; give one a weight > 0")
    return out


def _listed(names: list[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def source_spans(stream: TokenStream, doc_sources: list) -> tuple[list[str], list[np.ndarray]]:
    """The sources (sorted) and each one's runs of consecutive docs in the token stream, as ``(start, tokens)`` rows
    in stream order; ``doc_sources``: per shard, the source of each of its docs."""
    if len(doc_sources) != len(stream.shards):
        raise ValueError(f"doc sources for {len(doc_sources)} shards, the stream has {len(stream.shards)}")
    for shard, src in zip(stream.shards, doc_sources):
        if len(src) != shard.num_docs:
            raise ValueError(f"{shard.bin_path}: {len(src)} doc sources for its {shard.num_docs} docs")
    lengths = np.concatenate([s.lengths for s in stream.shards]).astype(np.int64)
    if lengths.sum() != len(stream) or not lengths.size:
        raise ValueError("the shards' document lengths do not add up to their tokens")
    names, codes = source_codes(doc_sources)
    starts = np.cumsum(lengths) - lengths
    first = np.concatenate([[0], np.flatnonzero(np.diff(codes)) + 1])  # the first doc of each run of one source
    runs, owner = np.stack([starts[first], np.add.reduceat(lengths, first)], axis=1), codes[first]
    grouped = runs[np.argsort(owner, kind="stable")]  # each source's runs together, in stream order
    return names, np.split(grouped, np.cumsum(np.bincount(owner, minlength=len(names)))[:-1])


def source_codes(doc_sources: list) -> tuple[list[str], np.ndarray]:
    """The sources that have docs (sorted) and each doc's index among them, over every shard in order; a shard's
    sources are a list of names or an Arrow (dictionary) array: a doc costs an int32, not its source's name."""
    enc = [c if pa.types.is_dictionary(c.type) else c.dictionary_encode()
           for c in (s if isinstance(s, pa.Array) else pa.array(s, pa.string()) for s in doc_sources)]
    if any(c.null_count for c in enc):
        raise ValueError("a doc without a source")
    names = sorted({v for c in enc for v in c.dictionary.to_pylist()})
    at = {n: i for i, n in enumerate(names)}
    codes = np.concatenate([np.array([at[v] for v in c.dictionary.to_pylist()], dtype=np.int32)[
        c.indices.to_numpy(zero_copy_only=False)] for c in enc])
    present = np.bincount(codes, minlength=len(names)) > 0  # a source of the dictionary may have no doc here
    return [n for n, keep in zip(names, present) if keep], (np.cumsum(present) - 1).astype(np.int32)[codes]


class MixtureSamples:
    """The train samples by source (``train.mixture``): a sample of source k is ``seq_len + 1`` consecutive tokens of
    k's own token stream (its docs in stream order, back to back: every token of it is k's); its ids are
    ``offsets[k] … offsets[k + 1] − 1``. ``shares``: each source's target share of the samples (weights
    normalised; 0 leaves it out)."""

    def __init__(self, shard_prefixes: list[Path], seq_len: int, doc_sources: list, mixture: dict[str, float]):
        self.stream = TokenStream(shard_prefixes)
        self.seq_len = seq_len
        self.names, self.spans = source_spans(self.stream, doc_sources)
        weights = mixture_weights(mixture, self.names)
        self.tokens = np.array([int(sp[:, 1].sum()) for sp in self.spans], dtype=np.int64)
        self.sizes = np.maximum(0, (self.tokens - 1) // seq_len)
        for name, n, t in zip(self.names, self.sizes, self.tokens):
            if weights[name] > 0 and n == 0:
                raise MixtureError(f"train.mixture: source {name!r} has {t} train tokens, no sample of {seq_len + 1}: "
                                   "give it weight 0 or lower model.seq_len")
        total = sum(weights.values())
        self.shares = np.array([weights[n] / total for n in self.names])
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.cum = [np.concatenate([[0], np.cumsum(sp[:, 1])]) for sp in self.spans]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        j = i - int(self.offsets[k])
        return self.read(k, j * self.seq_len, (j + 1) * self.seq_len + 1)

    def position(self, i: int, col: int) -> int:
        """Where token ``col`` of sample ``i`` lies in the token stream (of every source)."""
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        t = (i - int(self.offsets[k])) * self.seq_len + col
        r = int(np.searchsorted(self.cum[k], t, side="right")) - 1
        return int(self.spans[k][r, 0] + t - self.cum[k][r])

    def read(self, k: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of source k's stream, across its runs."""
        cum, spans = self.cum[k], self.spans[k]
        r = int(np.searchsorted(cum, start, side="right")) - 1
        parts = []
        while start < stop:
            lo, take = int(spans[r, 0] + start - cum[r]), int(min(stop, cum[r + 1]) - start)
            parts.append(self.stream.read(lo, lo + take))
            start, r = start + take, r + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class Blend:
    """Which source global position p draws from, and its how-many-th draw of that source: a function of p alone.
    Every block of :data:`BLEND_PERIOD` positions holds ``quota[k]`` draws of source k (the shares apportioned by
    largest remainder, a source with a share > 0 at least one); inside a block the draws of each source are spread
    evenly (draw j of k at (j + ½) / quota[k] of the block), so after any p positions every source is within one draw
    of its share of the block."""

    def __init__(self, shares: np.ndarray):
        self.quota = apportion(shares, BLEND_PERIOD)
        k = np.repeat(np.arange(len(shares)), self.quota)
        j = np.concatenate([np.arange(q) for q in self.quota])
        order = np.lexsort((k, (j + 0.5) / self.quota[k]))
        self.source, self.rank = k[order], j[order]

    def draws(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        block, off = np.divmod(pos, BLEND_PERIOD)
        src = self.source[off]
        return src, block * self.quota[src] + self.rank[off]

    def counts(self, p: int) -> np.ndarray:
        """Draws of each source among positions ``[0, p)``."""
        block, off = divmod(int(p), BLEND_PERIOD)
        return block * self.quota + np.bincount(self.source[:off], minlength=len(self.quota))


def apportion(shares: np.ndarray, total: int) -> np.ndarray:
    """Integers summing to ``total`` in proportion to ``shares`` (largest remainder; a share > 0 gets at least 1)."""
    raw = np.asarray(shares, dtype=np.float64) * total
    q = np.floor(raw).astype(np.int64)
    q[np.argsort(-(raw - q), kind="stable")[:total - int(q.sum())]] += 1
    for k in np.flatnonzero((q == 0) & (raw > 0)):
        q[np.argmax(q)] -= 1
        q[k] = 1
    return q


class MixtureSampler(DPSampler):
    """:class:`DPSampler` over :class:`MixtureSamples`: global position p draws from the source :class:`Blend` gives
    it; a source's draws walk its samples in a permutation per pass over them (its epoch), drawn from
    ``(seed, source name, epoch)``. Still a function of the position only: ``consumed_samples`` stays the whole
    state, so resuming (on any DP size) draws the same windows."""

    def __init__(self, samples: MixtureSamples, global_batch: int, dp_rank: int, dp_size: int, seed: int):
        super().__init__(len(samples), global_batch, dp_rank, dp_size, seed)
        self.samples, self.blend = samples, Blend(samples.shares)
        self.tags = [int.from_bytes(hashlib.sha256(n.encode()).digest()[:8], "big") for n in samples.names]
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def _perm(self, k: int, epoch: int) -> np.ndarray:
        if self._perms.get(k, (None,))[0] != epoch:
            size = int(self.samples.sizes[k])
            self._perms[k] = (epoch, np.random.default_rng([self.seed, self.tags[k], epoch]).permutation(size))
        return self._perms[k][1]

    def ids_at(self, pos: np.ndarray) -> np.ndarray:
        src, draw = self.blend.draws(pos)
        size = self.samples.sizes[src]
        epoch, within = draw // size, draw % size
        ids = np.empty(pos.size, dtype=np.int64)
        for k, e in sorted(set(zip(src.tolist(), epoch.tolist()))):
            sel = (src == k) & (epoch == e)
            ids[sel] = self.samples.offsets[k] + self._perm(k, e)[within[sel]]
        return ids

    def state_dict(self) -> dict:
        return {**super().state_dict(), "mixture": dict(zip(self.samples.names, self.samples.shares.tolist()))}

    def trained(self, consumed: int) -> np.ndarray:
        """Samples drawn from each source over positions ``[0, consumed)``, less the skipped global batches."""
        got = self.blend.counts(consumed)
        for s in self.skip:
            if s < consumed:
                got = got - (self.blend.counts(s + self.G) - self.blend.counts(s))
        return got

    def report(self, consumed: int) -> dict:
        """Target and achieved shares, samples and epochs (passes over its samples) per source, over the samples
        trained on up to ``consumed``: ``{"target", "achieved", "samples", "epochs"}``, each ``{source: value}``."""
        n, names = self.trained(consumed), self.samples.names
        total = max(1, int(n.sum()))
        return {"target": dict(zip(names, self.samples.shares.tolist())),
                "achieved": {s: int(c) / total for s, c in zip(names, n)},
                "samples": {s: int(c) for s, c in zip(names, n)},
                "epochs": {s: int(c) / int(z) if z else 0.0 for s, c, z in zip(names, n, self.samples.sizes)}}


def train_doc_sources(tok) -> list:
    """The source (input key) of every doc of a corpus version's train shards, shard by shard in manifest order: the
    ``source`` column tokenize writes beside each shard's doc ids (``<shard>.ids.parquet``), else (a shard written
    before that column, or by hand) the shard's ids looked up among the docs its versions added (the decontaminate
    or filter stage's kept docs, which carry their ``source``; ``pipelines.lineage``), read only if a shard needs it."""
    out, lineage = [], None
    for sh in (s for s in tok.extra["shards"] if s["split"] == "train"):
        path = tok.dir / (sh["prefix"] + ".ids.parquet")
        if "source" in pq.read_schema(path).names:  # the sources alone: no rank reads the ids
            src = pq.read_table(path, columns=["source"]).column("source").cast(pa.string()).combine_chunks()
            if src.null_count:
                lost = pq.read_table(path, columns=["id"]).column("id").filter(src.is_null())[0].as_py()
                raise MixtureError(f"train.mixture: doc {lost!r} of shard {sh['prefix']} has no source")
            out.append(src.dictionary_encode())
            continue
        lineage = lineage or lineage_sources(tok)
        ids = pq.read_table(path, columns=["id"]).column("id").combine_chunks()
        at = pc.index_in(ids, value_set=lineage[0])
        if at.null_count:
            lost = ids.filter(pc.is_null(at))[0].as_py()
            raise MixtureError(f"train.mixture: doc {lost!r} of shard {sh['prefix']} is not among the docs of "
                               f"{tok.path}'s lineage: its source is unknown")
        out.append(pc.take(lineage[1], at))
    return out


def lineage_sources(tok) -> tuple:
    """(ids, sources) of every doc a corpus version's lineage added, sources dictionary-encoded."""
    try:  # a lineage the user must mend (missing, rewritten, no filter stage); storage's errors: raised, retryable
        known = pa.concat_tables([added_docs(v, ["id", "source"]) for v in chain(tok)], promote_options="permissive")
    except VersionUnreadable:
        raise
    except (StageError, FileNotFoundError) as e:
        raise MixtureError(f"train.mixture: the sources of {tok.path}'s docs cannot be read: {e}") from None
    if "source" not in known.column_names:
        raise MixtureError(f"train.mixture: the docs of {tok.path}'s lineage have no source column")
    return known.column("id").combine_chunks(), known.column("source").combine_chunks().dictionary_encode()


def train_samples(tok, seq_len: int, mixture: dict[str, float]):
    """A corpus version's train samples: :class:`TokenSamples` (no mixture: the stream as it is), else
    :class:`MixtureSamples`."""
    shards = [tok.dir / s["prefix"] for s in tok.extra["shards"] if s["split"] == "train"]
    if not mixture:
        return TokenSamples(shards, seq_len)
    return MixtureSamples(shards, seq_len, train_doc_sources(tok), mixture)


def sampler_for(samples, global_batch: int, dp_rank: int, dp_size: int, seed: int) -> DPSampler:
    if isinstance(samples, MixtureSamples):
        return MixtureSampler(samples, global_batch, dp_rank, dp_size, seed)
    return DPSampler(len(samples), global_batch, dp_rank, dp_size, seed)


METRIC_NAME_MAX = 250  # MLflow's limit on a metric's name


def mixture_metrics(report: dict) -> dict[str, float]:
    """MLflow metrics of a :meth:`MixtureSampler.report`: ``mixture/{target,achieved,epochs}/<key>``, each source's
    key from :func:`mixture_keys` (unique, and every name within MLflow's 250 characters)."""
    keys = mixture_keys(list(report["target"]))
    return {f"mixture/{kind}/{keys[s]}": v for kind in ("target", "achieved", "epochs")
            for s, v in report[kind].items()}


def mixture_keys(sources: list[str]) -> dict[str, str]:
    """{source: its key in MLflow metric names}: the source with each run of characters MLflow refuses as ``_``;
    where that key is too long for a name, only dots, or shared by two sources (``a/b_c`` and ``a_b/c``), it is cut
    to fit and ends in ``-`` and 12 hex digits of the source's sha256. The full names are in the report
    (``result.json``, the manifest's ``extra.mixture``, MLflow's ``train/mixture.json``)."""
    room = METRIC_NAME_MAX - len("mixture/achieved/")
    plain = {s: re.sub(r"[^A-Za-z0-9_.-]+", "_", s) for s in sources}
    seen = Counter(plain.values())

    def hashed(s: str) -> str:
        return f"{plain[s][:room - 13]}-{hashlib.sha256(s.encode()).hexdigest()[:12]}"

    keys = {s: k if seen[k] == 1 and len(k) <= room and k.strip(".") else hashed(s) for s, k in plain.items()}
    if len(set(keys.values())) < len(keys):  # a source named like another's hashed key
        keys = {s: hashed(s) for s in sources}
    return keys
