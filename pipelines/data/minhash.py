"""MinHash signatures and LSH band keys, vectorised with numpy, 64-bit safe.

* Normalisation: Unicode NFKC, lowercase, punctuation removed, whitespace collapsed.
* Shingles: the set of word n-grams; a doc with fewer than n words has none and is never an
  LSH candidate (it would otherwise get the all-max signature and collide with every other such doc).
* Shingle hash: the first 4 bytes of SHA-1, little-endian (as datasketch's ``sha1_hash32``).
* Permutations: ``h_i(x) = (a_i·x + b_i) mod (2^61 − 1)`` with (a_i, b_i) drawn exactly as
  datasketch draws them for the same seed. The product ``a_i·x`` (up to 2^93) is computed by
  splitting ``a_i`` into 32-bit halves and folding with 2^61 ≡ 1, so no step exceeds 2^64 and
  nothing wraps (datasketch computes it in uint64 and wraps; see its issue #99).
* Band keys: each band's ``rows`` values are mixed (splitmix64-style) with the band index into one
  signed 64-bit key, so a Spark shuffle moves 16 bytes per (doc, band), not the whole band.
"""
from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from functools import lru_cache

import numpy as np

MERSENNE_61 = np.uint64((1 << 61) - 1)
_MASK32 = np.uint64(0xFFFFFFFF)
_MASK29 = np.uint64((1 << 29) - 1)


def _build_punct_table() -> dict[int, str]:
    import sys

    return {i: " " for i in range(sys.maxunicode + 1) if unicodedata.category(chr(i)).startswith("P")}


_PUNCT_TABLE: dict[int, str] = {}
_WS_RE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """NFKC, lowercase, punctuation → space, whitespace collapsed."""
    global _PUNCT_TABLE
    if not _PUNCT_TABLE:
        _PUNCT_TABLE = _build_punct_table()
    t = unicodedata.normalize("NFKC", text).lower().translate(_PUNCT_TABLE)
    return _WS_RE.sub(" ", t).strip()


def shingles(text: str, n: int) -> set[str]:
    words = normalize(text).split(" ")
    if len(words) < n or words == [""]:
        return set()
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def hash32(s: str) -> int:
    return int.from_bytes(hashlib.sha1(s.encode("utf-8")).digest()[:4], "little")


def hash_shingles(sh: set[str] | list[str]) -> np.ndarray:
    return np.fromiter((hash32(s) for s in sh), dtype=np.uint64, count=len(sh))


@lru_cache(maxsize=16)
def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) as datasketch.MinHash draws them: RandomState(seed), a ∈ [1, p), b ∈ [0, p)."""
    gen = np.random.RandomState(seed)
    p = (1 << 61) - 1
    pairs = np.array(
        [(gen.randint(1, p, dtype=np.uint64), gen.randint(0, p, dtype=np.uint64)) for _ in range(num_perm)],
        dtype=np.uint64,
    ).T
    return pairs[0].copy(), pairs[1].copy()


def mulmod61(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(a · x) mod (2^61 − 1) for a < 2^61, x < 2^32, elementwise with broadcasting, no overflow."""
    a = a.astype(np.uint64, copy=False)
    x = x.astype(np.uint64, copy=False)
    a_hi = a >> np.uint64(32)          # < 2^29
    a_lo = a & _MASK32                 # < 2^32
    lo = (a_lo * x) % MERSENNE_61      # a_lo·x < 2^64
    mid = a_hi * x                     # < 2^61; contributes mid · 2^32
    mid_hi = mid >> np.uint64(29)      # mid·2^32 = mid_hi·2^61 + mid_lo·2^32 ≡ mid_hi + mid_lo·2^32
    mid_lo = mid & _MASK29
    return (lo + mid_hi + (mid_lo << np.uint64(32))) % MERSENNE_61


def signature(hashes: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """MinHash signature (num_perm,) uint64 of one doc's shingle hashes; all-max if none."""
    if hashes.size == 0:
        return np.full(a.shape, MERSENNE_61, dtype=np.uint64)
    ph = (mulmod61(a[:, None], hashes[None, :]) + b[:, None]) % MERSENNE_61
    return ph.min(axis=1)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """One int64 key per band (band index mixed in, so equal keys mean same band, same values)."""
    m = sig[: bands * rows].reshape(bands, rows)
    h = _splitmix64(np.arange(bands, dtype=np.uint64))
    for j in range(rows):
        h = _splitmix64(h ^ m[:, j])
    return h.view(np.int64)


def candidate_probability(s: float, bands: int, rows: int) -> float:
    return 1.0 - (1.0 - s ** rows) ** bands


def _integrate(f, lo: float, hi: float, n: int = 200) -> float:
    xs = np.linspace(lo, hi, n + 1)
    ys = f(xs)
    return float(np.sum((ys[1:] + ys[:-1]) * 0.5 * np.diff(xs)))


@lru_cache(maxsize=64)
def optimal_bands_rows(threshold: float, num_perm: int, fp_weight: float = 0.5,
                       fn_weight: float = 0.5) -> tuple[int, int, float, float]:
    """bands × rows ≤ num_perm minimising fp_weight·FP-area + fn_weight·FN-area of the S-curve.

    FP area = ∫₀ᵗ P(candidate|s) ds, FN area = ∫ₜ¹ 1 − P(candidate|s) ds. Returns (b, r, fp, fn).
    """
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    best = None
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            fp = _integrate(lambda s: candidate_probability(s, b, r), 0.0, threshold)
            fn = _integrate(lambda s: 1 - candidate_probability(s, b, r), threshold, 1.0)
            err = fp_weight * fp + fn_weight * fn
            if best is None or err < best[0] - 1e-12:
                best = (err, b, r, fp, fn)
    _, b, r, fp, fn = best
    return b, r, fp, fn


def doc_band_keys(text: str, n: int, a: np.ndarray, b: np.ndarray, bands: int, rows: int) -> np.ndarray | None:
    """Band keys of a doc, or None when it has no shingles (never a candidate)."""
    sh = shingles(text, n)
    if not sh:
        return None
    return band_keys(signature(hash_shingles(sh), a, b), bands, rows)


def jaccard(a: set, b: set) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def threshold_point(bands: int, rows: int) -> float:
    """The similarity where the S-curve rises fastest, ≈ (1/b)^(1/r)."""
    return math.pow(1.0 / bands, 1.0 / rows)
