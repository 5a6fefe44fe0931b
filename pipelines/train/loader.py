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
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipelines.data.shards import TokenStream


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
        pos = np.arange(consumed, consumed + self.G, dtype=np.int64)
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
        self.consumed_samples = int(sd["consumed_samples"])
        self.skip = set(sd.get("skip", []))


def batch_tensors(samples: TokenSamples, ids: np.ndarray):
    import torch

    arr = np.stack([samples[int(i)] for i in ids])
    t = torch.from_numpy(arr)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class Prefetcher:
    """Yields one step's micro-batches ``[(x, y)] × grad_accum`` for this rank, prepared ``depth`` steps
    ahead in a daemon thread (``depth=0``: built inline). ``sampler.consumed_samples`` moves forward
    by one global batch per :meth:`next_step`, never by what is only prefetched."""

    def __init__(self, samples: TokenSamples, sampler: DPSampler, grad_accum: int, depth: int = 2,
                 pin_memory: bool = False):
        import queue
        import threading

        self.samples, self.sampler, self.accum, self.pin = samples, sampler, grad_accum, pin_memory
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
            x, y = batch_tensors(self.samples, ids)
            if self.pin:
                x, y = x.pin_memory(), y.pin_memory()
            out.append((x, y))
        return out

    def _work(self, consumed: int) -> None:
        import queue

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
