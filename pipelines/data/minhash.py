"""MinHash signatures and LSH band keys, vectorised with numpy, 64-bit safe.

* Normalisation: Unicode NFKC, lowercase, punctuation removed, whitespace collapsed.
* Shingles: the set of word n-grams; a doc with fewer than n words has none and is never an
  LSH candidate (it would otherwise get the all-max signature and collide with every other such doc).
* Shingle hash (pipeline): ``shingle_hash_batch`` hashes every word of a batch of docs at once (a
  polynomial in its UTF-8 bytes mod 2^64 from one prefix sum, then splitmix64), folds each n-gram's
  word hashes with splitmix64 and keeps 32 bits; no Python loop per word or per shingle
  (``shingle_hash`` gives the same for one shingle string, e.g. as a datasketch ``hashfunc``).
  ``hash_shingles`` is the reference SHA-1 hash (first 4 bytes, little-endian, as datasketch's
  ``sha1_hash32``).
* Signatures of many docs at once: ``signatures`` / ``signatures_flat`` (numba kernel when installed,
  else chunked numpy),
  equal to the per-doc reference ``signature``.
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
import sys
import unicodedata
from functools import lru_cache

import numpy as np

MERSENNE_61 = np.uint64((1 << 61) - 1)
_MASK32 = np.uint64(0xFFFFFFFF)
_MASK29 = np.uint64((1 << 29) - 1)


def _build_punct_set() -> frozenset[str]:
    return frozenset(chr(i) for i in range(sys.maxunicode + 1) if unicodedata.category(chr(i)).startswith("P"))


_PUNCT: frozenset[str] = frozenset()


def normalize(text: str) -> str:
    """NFKC, lowercase, Unicode punctuation (category P) → space, whitespace collapsed.

    Only the punctuation characters present in the text are replaced (``str.replace`` each), which
    is several times faster than a per-character ``str.translate`` over the whole Unicode table.
    """
    global _PUNCT
    if not _PUNCT:
        _PUNCT = _build_punct_set()
    t = unicodedata.normalize("NFKC", text).lower()
    for ch in _PUNCT.intersection(t):
        t = t.replace(ch, " ")
    return " ".join(t.split())


def shingles(text: str, n: int) -> set[str]:
    words = normalize(text).split(" ")
    if len(words) < n or words == [""]:
        return set()
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def hash32(s: str) -> int:
    return int.from_bytes(hashlib.sha1(s.encode("utf-8")).digest()[:4], "little")


def hash_shingles(sh: set[str] | list[str]) -> np.ndarray:
    return np.fromiter((hash32(s) for s in sh), dtype=np.uint64, count=len(sh))


# ---- fast path: every shingle hash of a batch of docs in a few numpy passes -------------------
# A word's hash is a polynomial in its UTF-8 bytes, Σ (byte_i + 1)·P^i mod 2^64, plus its length,
# through the splitmix64 finaliser. Because P is odd it is invertible mod 2^64, so the polynomial of
# every word of a whole batch comes from one prefix sum: (G[end] − G[start])·P^−start. A shingle's
# hash folds its n word hashes left to right with splitmix64 and keeps the low 32 bits.
_P = np.uint64(0x100000001B3)
_P_INV = np.uint64(pow(0x100000001B3, -1, 1 << 64))
_POW_CACHE: list[np.ndarray] = [np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64)]


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(P^k, P^−k) mod 2^64 for k in [0, n], grown on demand and kept for the process."""
    pw, ipw = _POW_CACHE
    if pw.size <= n:
        m = max(n + 1, 2 * pw.size)
        pw = np.empty(m, dtype=np.uint64)
        ipw = np.empty(m, dtype=np.uint64)
        pw[0] = ipw[0] = 1
        np.cumprod(np.full(m - 1, _P), out=pw[1:])        # wraps mod 2^64, as intended
        np.cumprod(np.full(m - 1, _P_INV), out=ipw[1:])
        _POW_CACHE[:] = [pw, ipw]
    return pw, ipw


def shingle_hash_batch(norms: list[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct 32-bit hashes of the word n-grams of many normalized texts, all at once.

    Returns (``x``, ``offsets``): doc d's hashes, sorted and distinct, are ``x[offsets[d]:offsets[d+1]]``
    (uint64). A doc with fewer than ``n`` words has none. Texts must be ``normalize``d (words separated
    by single spaces, no newline).
    """
    nd = len(norms)
    lens = np.fromiter((len(t) for t in norms), dtype=np.int64, count=nd)
    if lens.sum() > _CHUNK_CHARS:  # keep the working arrays cache-sized: chunks of ≈ _CHUNK_CHARS
        cuts = np.searchsorted(np.cumsum(lens), np.arange(_CHUNK_CHARS, lens.sum(), _CHUNK_CHARS), side="right")
        bounds = [0, *sorted(set(int(c) for c in cuts if 0 < c < nd)), nd]
        parts = [_shingle_hash_chunk(norms[i:j], n) for i, j in zip(bounds[:-1], bounds[1:])]
        offsets = np.zeros(nd + 1, dtype=np.int64)
        base = 0
        for (x, off), i, j in zip(parts, bounds[:-1], bounds[1:]):
            offsets[i + 1:j + 1] = off[1:] + base
            base += x.size
        return np.concatenate([x for x, _ in parts]), offsets
    return _shingle_hash_chunk(norms, n)


_CHUNK_CHARS = 1 << 20


def _shingle_hash_chunk(norms: list[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    nd = len(norms)
    offsets = np.zeros(nd + 1, dtype=np.int64)
    if nd == 0:
        return np.zeros(0, dtype=np.uint64), offsets
    buf = np.frombuffer("\n".join(norms).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    seps = np.flatnonzero((buf == 32) | (buf == 10))
    starts = np.concatenate(([0], seps + 1))
    ends = np.concatenate((seps, [buf.size]))
    doc = np.zeros(starts.size, dtype=np.int64)
    np.cumsum(buf[seps] == 10, out=doc[1:])
    live = ends > starts                                    # an empty doc is one empty segment
    starts, ends, doc = starts[live], ends[live], doc[live]
    pw, ipw = _powers(buf.size)
    g = np.zeros(buf.size + 1, dtype=np.uint64)
    np.cumsum((buf.astype(np.uint64) + np.uint64(1)) * pw[:buf.size], out=g[1:])
    w = _splitmix64((g[ends] - g[starts]) * ipw[starts] + (ends - starts).astype(np.uint64))
    counts = np.bincount(doc, minlength=nd)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    pos = np.arange(w.size) - first[doc]
    s = np.flatnonzero(pos <= counts[doc] - n)             # n-gram starts that fit in their doc
    with np.errstate(over="ignore"):
        h = _splitmix64(w[s])
        for j in range(1, n):
            h = _splitmix64(h ^ w[s + j])
        key = np.sort((doc[s].astype(np.uint64) << np.uint64(32)) | (h & _MASK32))
    if key.size:  # drop repeats (np.unique is many times slower than sort + mask here)
        key = key[np.concatenate(([True], key[1:] != key[:-1]))]
    np.cumsum(np.bincount((key >> np.uint64(32)).astype(np.int64), minlength=nd), out=offsets[1:])
    return key & _MASK32, offsets


# ---- fused path: raw texts → shingle hashes in one compiled pass (numba) -----------------------
# Python does what needs Unicode tables (NFKC, lowercase); the kernel decodes the UTF-8, treats every
# code point that ``normalize`` would turn into a word break (category P or ``str.isspace``) as one,
# hashes the words exactly as ``_shingle_hash_chunk`` does, folds the n-grams and sorts/dedups per
# doc. No normalized string is ever built: the same hashes for ≈ 1/4 of the time.
_SEP_TABLE: np.ndarray | None = None


def separator_table() -> np.ndarray:
    """uint8[0x110000]: 1 where ``normalize`` breaks words (Unicode category P or whitespace)."""
    global _SEP_TABLE
    if _SEP_TABLE is None:
        t = np.zeros(sys.maxunicode + 1, dtype=np.uint8)
        for i in range(sys.maxunicode + 1):
            c = chr(i)
            if c.isspace() or unicodedata.category(c)[0] == "P":
                t[i] = 1
        _SEP_TABLE = t
    return _SEP_TABLE


def _fused_kernel_py(buf, doc_off, n, sep, x, x_off, n_words, exact):  # compiled by numba
    P = np.uint64(0x100000001B3)
    g0, g1, g2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
    s30, s27, s31 = np.uint64(30), np.uint64(27), np.uint64(31)
    m32 = np.uint64(0xFFFFFFFF)
    nd = doc_off.size - 1
    longest = 0
    for d in range(nd):
        longest = max(longest, doc_off[d + 1] - doc_off[d])
    w = np.empty(longest // 2 + 1, dtype=np.uint64)  # ≥ the words of any doc
    tmp = np.empty_like(w)
    cnt = np.empty(256, dtype=np.int64)
    cur = 0
    for d in range(nd):
        i, end = doc_off[d], doc_off[d + 1]
        nw = 0
        h = np.uint64(0)
        pk = np.uint64(1)
        ln = 0
        while i <= end:  # i == end: a break after the last word
            if i == end:
                cp, ln_c = np.int64(32), 1
            elif buf[i] < 0x80:
                cp, ln_c = np.int64(buf[i]), 1
            elif buf[i] < 0xE0:
                cp, ln_c = (np.int64(buf[i] & 0x1F) << 6) | np.int64(buf[i + 1] & 0x3F), 2
            elif buf[i] < 0xF0:
                cp = ((np.int64(buf[i] & 0x0F) << 12) | (np.int64(buf[i + 1] & 0x3F) << 6)
                      | np.int64(buf[i + 2] & 0x3F))
                ln_c = 3
            else:
                cp = ((np.int64(buf[i] & 0x07) << 18) | (np.int64(buf[i + 1] & 0x3F) << 12)
                      | (np.int64(buf[i + 2] & 0x3F) << 6) | np.int64(buf[i + 3] & 0x3F))
                ln_c = 4
            if sep[cp]:
                if ln:
                    z = (h + np.uint64(ln)) + g0
                    z = (z ^ (z >> s30)) * g1
                    z = (z ^ (z >> s27)) * g2
                    w[nw] = z ^ (z >> s31)
                    nw += 1
                    h, pk, ln = np.uint64(0), np.uint64(1), 0
            else:
                for k in range(ln_c):
                    h += (np.uint64(buf[i + k]) + np.uint64(1)) * pk
                    pk *= P
                ln += ln_c
            i += ln_c
        n_words[d] = nw
        e = np.uint64(0x5851F42D4C957F2D)
        for j in range(nw):  # the exact key: the word sequence, i.e. the normalized text
            z = (e ^ w[j]) + g0
            z = (z ^ (z >> s30)) * g1
            z = (z ^ (z >> s27)) * g2
            e = z ^ (z >> s31)
        exact[d] = e ^ np.uint64(nw)
        start = cur
        for s in range(nw - n + 1):
            hh = w[s]
            z = hh + g0
            z = (z ^ (z >> s30)) * g1
            z = (z ^ (z >> s27)) * g2
            hh = z ^ (z >> s31)
            for j in range(1, n):
                z = (hh ^ w[s + j]) + g0
                z = (z ^ (z >> s30)) * g1
                z = (z ^ (z >> s27)) * g2
                hh = z ^ (z >> s31)
            x[cur] = hh & m32
            cur += 1
        if 0 < cur - start < 64:  # few: a comparison sort is quicker than four radix passes
            x[start:cur].sort()
        elif cur > start:
            src, dst = x[start:cur], tmp[:cur - start]
            for shift in range(0, 32, 8):  # LSD radix sort of the doc's 32-bit hashes, 8 bits a pass
                sh = np.uint64(shift)
                cnt[:] = 0
                for j in range(src.size):
                    cnt[(src[j] >> sh) & np.uint64(255)] += 1
                tot = 0
                for j in range(256):
                    c = cnt[j]
                    cnt[j] = tot
                    tot += c
                for j in range(src.size):
                    v = src[j]
                    bkt = (v >> sh) & np.uint64(255)
                    dst[cnt[bkt]] = v
                    cnt[bkt] += 1
                src, dst = dst, src  # after the four passes the sorted hashes are back in x
        if cur > start:  # drop repeats
            k = start + 1
            for j in range(start + 1, cur):
                if x[j] != x[k - 1]:
                    x[k] = x[j]
                    k += 1
            cur = k
        x_off[d + 1] = cur
    return cur


def shingle_hash_texts(texts: list[str], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Raw texts → (``x``, ``offsets``, ``n_words``, ``exact``) without building normalized strings.

    ``x``/``offsets`` are exactly ``shingle_hash_batch([normalize(t) for t in texts], n)``;
    ``n_words`` the number of words of each normalized text (0: empty); ``exact`` (int64) a 64-bit
    hash of each normalized text (its word sequence): equal texts, equal keys. Uses the numba
    kernel; without numba, the same values from ``normalize`` + ``shingle_hash_batch``.
    """
    nd = len(texts)
    pre = [unicodedata.normalize("NFKC", t).lower() for t in texts]
    kern = compiled(_fused_kernel_py)
    if kern is None:
        norms = [normalize(t) for t in texts]
        x, off = shingle_hash_batch(norms, n)
        words = np.array([len(t.split(" ")) if t else 0 for t in norms], dtype=np.int64)
        ex = np.array([_exact_ref(t) for t in norms], dtype=np.uint64)
        return x, off, words, ex.view(np.int64)
    enc = [t.encode("utf-8", "surrogatepass") for t in pre]
    lens = np.fromiter((len(b) for b in enc), dtype=np.int64, count=nd)
    doc_off = np.zeros(nd + 1, dtype=np.int64)
    np.cumsum(lens, out=doc_off[1:])
    buf = np.frombuffer(b"".join(enc), dtype=np.uint8)
    x = np.empty(buf.size // 2 + nd + 1, dtype=np.uint64)  # ≥ words ≥ shingles of every doc
    x_off = np.zeros(nd + 1, dtype=np.int64)
    words = np.zeros(nd, dtype=np.int64)
    ex = np.zeros(nd, dtype=np.uint64)
    used = kern(buf, doc_off, n, separator_table(), x, x_off, words, ex)
    return x[:used].copy(), x_off, words, ex.view(np.int64)


def _exact_ref(norm: str) -> int:
    """The ``exact`` key of one normalized text, in Python (the kernel's reference)."""
    w = _word_hashes(norm.split(" ") if norm else [])
    e = np.uint64(0x5851F42D4C957F2D)
    for h in w:
        e = _splitmix64(np.array([e ^ h], dtype=np.uint64))[0]
    return int(e ^ np.uint64(len(w)))


def _word_hashes(words: list[str]) -> np.ndarray:
    out = np.empty(len(words), dtype=np.uint64)
    mask = (1 << 64) - 1
    for k, wd in enumerate(words):
        h, pk = 0, 1
        for byte in wd.encode("utf-8", "surrogatepass"):
            h = (h + (byte + 1) * pk) & mask
            pk = (pk * 0x100000001B3) & mask
        out[k] = (h + len(wd.encode("utf-8", "surrogatepass"))) & mask
    return _splitmix64(out)


def shingle_hashes(norm: str, n: int) -> np.ndarray:
    """``shingle_hash_batch`` of one normalized text: its distinct 32-bit shingle hashes (sorted uint64)."""
    return shingle_hash_batch([norm], n)[0]


def shingle_hash(shingle: str) -> int:
    """The 32-bit hash the pipeline gives the shingle "w1 w2 … wn" (a datasketch ``hashfunc``)."""
    x, _ = shingle_hash_batch([shingle], len(shingle.split(" ")))
    return int(x[0])


def _signatures_numpy(x: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray,
                      chunk: int = 1024) -> None:
    """numpy kernel: chunks of ≈ ``chunk`` shingles, in-place Mersenne folding, ``minimum.reduceat``."""
    s61, s29, s32 = np.uint64(61), np.uint64(29), np.uint64(32)
    a_hi, a_lo, bb = (a >> s32)[:, None], (a & _MASK32)[:, None], b[:, None]
    nd, d = offsets.size - 1, 0
    while d < nd:
        e = int(np.searchsorted(offsets, offsets[d] + chunk, side="right")) - 1
        e = min(max(e, d + 1), nd)
        xs = x[None, offsets[d]:offsets[e]]
        v = a_lo * xs                                   # a_lo·x < 2^64
        t = v >> s61
        v &= MERSENNE_61
        v += t                                          # ≡ a_lo·x, < 2^61 + 8
        mid = a_hi * xs                                 # < 2^61, stands for mid·2^32 ≡ (mid>>29) + (mid&(2^29−1))·2^32
        v += mid >> s29
        mid &= _MASK29
        mid <<= s32
        v += mid
        v += bb                                         # < 2^63
        t = v >> s61
        v &= MERSENNE_61
        v += t                                          # < 2^61 + 4
        np.minimum(v, v - MERSENNE_61, out=v)           # the one conditional subtraction (v − p wraps when v < p)
        out[d:e] = np.minimum.reduceat(v, offsets[d:e] - offsets[d], axis=1).T
        d = e


def _sig_kernel_py(x, offsets, a, b, out):  # compiled by numba when it is installed
    """Per doc, the min over its shingles of every permutation: the inner loop runs over the permutations (contiguous
    a_lo, a_hi, b and one row of running minima), branch-free (``min(v, v − p)`` is the conditional subtraction),
    both products 32 × 32 → 64-bit, so LLVM vectorises it across permutations (2.4× the shingle-inner order on
    AVX-512)."""
    p = np.uint64((1 << 61) - 1)
    m32 = np.uint64(0xFFFFFFFF)
    m29 = np.uint64((1 << 29) - 1)
    s61, s32, s29 = np.uint64(61), np.uint64(32), np.uint64(29)
    a_lo, a_hi = a & m32, a >> s32
    acc = np.empty(a.size, dtype=np.uint64)
    for d in range(offsets.size - 1):
        acc[:] = p
        for i in range(offsets[d], offsets[d + 1]):
            xi = x[i] & m32
            for k in range(a.size):
                lo = a_lo[k] * xi
                lo = (lo & p) + (lo >> s61)
                mid = a_hi[k] * xi
                v = lo + (mid >> s29) + ((mid & m29) << s32) + b[k]
                v = (v & p) + (v >> s61)
                v = min(v, v - p)
                acc[k] = min(acc[k], v)
        out[d, :] = acc


_COMPILED: dict = {}


def compiled(py_fn):
    """``numba.njit(nogil=True, cache=True)`` of a kernel written in plain Python/numpy, compiled once
    per process (its machine code cached next to the module); None when numba is missing or unusable,
    and callers then take their numpy path, which gives the same values."""
    if py_fn not in _COMPILED:
        try:
            import numba

            _COMPILED[py_fn] = numba.njit(nogil=True, cache=True)(py_fn)
        except Exception:
            _COMPILED[py_fn] = None
    return _COMPILED[py_fn]


def signatures(hash_sets: list[np.ndarray], a: np.ndarray, b: np.ndarray, engine: str = "auto") -> np.ndarray:
    """MinHash signatures (len(hash_sets), num_perm) of many docs at once; every set must be non-empty."""
    offsets = np.zeros(len(hash_sets) + 1, dtype=np.int64)
    np.cumsum([h.size for h in hash_sets], out=offsets[1:])
    x = np.concatenate(hash_sets) if hash_sets else np.zeros(0, dtype=np.uint64)
    return signatures_flat(x, offsets, a, b, engine)


def signatures_flat(x: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray,
                    engine: str = "auto") -> np.ndarray:
    """MinHash signatures (len(offsets) − 1, num_perm) of docs given as one flat array of shingle hashes.

    Doc d's hashes are ``x[offsets[d]:offsets[d+1]]`` (non-empty). Exactly ``signature`` for each doc
    ((a·x + b) mod 2^61 − 1, no wraparound). ``engine``: "numba" (a fused loop), "numpy" (chunked,
    vectorised) or "auto" (numba when importable).
    """
    out = np.empty((offsets.size - 1, a.size), dtype=np.uint64)
    if out.shape[0] == 0:
        return out
    x = x.astype(np.uint64, copy=False)
    offsets = offsets.astype(np.int64, copy=False)
    kern = compiled(_sig_kernel_py) if engine in ("auto", "numba") else None
    if engine == "numba" and kern is None:
        raise RuntimeError("numba is not installed")
    if kern is not None:
        kern(x, offsets, a.astype(np.uint64), b.astype(np.uint64), out)
    else:
        _signatures_numpy(x, offsets, a.astype(np.uint64), b.astype(np.uint64), out)
    return out


def band_keys_batch(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """``band_keys`` of each row of ``sigs`` (n_docs, num_perm) → (n_docs, bands) int64."""
    m = sigs[:, : bands * rows].reshape(sigs.shape[0], bands, rows)
    h = np.broadcast_to(_splitmix64(np.arange(bands, dtype=np.uint64)), (sigs.shape[0], bands))
    for j in range(rows):
        h = _splitmix64(h ^ m[:, :, j])
    return h.view(np.int64)


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
    return band_keys_batch(sig[None, :], bands, rows)[0]


def candidate_probability(s: float, bands: int, rows: int) -> float:
    return 1.0 - (1.0 - s ** rows) ** bands


def integrate(f, lo: float, hi: float, n: int = 200) -> float:
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
            fp = integrate(lambda s: candidate_probability(s, b, r), 0.0, threshold)
            fn = integrate(lambda s: 1 - candidate_probability(s, b, r), threshold, 1.0)
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
    """Jaccard of two sets: the reference the dedup's kernel (``keepers.sorted_jaccard``) and benchmarks score
    against."""
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def threshold_point(bands: int, rows: int) -> float:
    """The similarity where the S-curve rises fastest, ≈ (1/b)^(1/r)."""
    return math.pow(1.0 / bands, 1.0 / rows)
