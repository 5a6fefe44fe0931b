import numpy as np
import pytest

from pipelines.data import minhash as mh


def test_mulmod61_is_exact_against_python_big_ints():
    rng = np.random.default_rng(0)
    p = (1 << 61) - 1
    a = rng.integers(1, p, size=2000, dtype=np.uint64)
    x = rng.integers(0, 1 << 32, size=2000, dtype=np.uint64)
    a[:3] = [p - 1, p - 1, 1]
    x[:3] = [(1 << 32) - 1, 0, (1 << 32) - 1]
    got = mh.mulmod61(a, x)
    want = [(int(ai) * int(xi)) % p for ai, xi in zip(a, x)]
    assert [int(g) for g in got] == want


def test_permutations_are_datasketch_legacy_for_the_same_seed():
    from datasketch import MinHash

    a, b = mh.permutations(128, 7)
    ds = MinHash(num_perm=128, seed=7, scheme="legacy")  # datasketch < 2.0 draws
    assert np.array_equal(a, ds.permutations[0]) and np.array_equal(b, ds.permutations[1])


def test_signature_estimates_jaccard():
    words = [f"w{i}" for i in range(400)]
    a_text = " ".join(words)
    b_text = " ".join(words[:300] + [f"x{i}" for i in range(100)])
    sa, sb = mh.shingles(a_text, 5), mh.shingles(b_text, 5)
    true_j = mh.jaccard(sa, sb)
    pa, pb = mh.permutations(256, 1)
    est = np.mean(mh.signature(mh.hash_shingles(sa), pa, pb) == mh.signature(mh.hash_shingles(sb), pa, pb))
    assert abs(est - true_j) < 0.08, (est, true_j)


def test_normalisation_and_short_docs():
    assert mh.normalize("Ｈｅｌｌｏ,   WORLD!\n\tfoo—bar") == "hello world foo bar"
    assert mh.shingles("only four words here", 5) == set()  # too short: never a candidate
    a, b = mh.permutations(16, 1)
    assert mh.doc_band_keys("one two three", 5, a, b, 4, 4) is None


def test_optimal_bands_rows_minimises_error_area():
    b, r, fp, fn = mh.optimal_bands_rows(0.8, 128)
    assert b * r <= 128
    # the chosen pair beats the common 16×8 (which admits many J≈0.6 pairs) on the weighted error
    fp16 = mh.integrate(lambda s: mh.candidate_probability(s, 16, 8), 0, 0.8)
    fn16 = mh.integrate(lambda s: 1 - mh.candidate_probability(s, 16, 8), 0.8, 1)
    assert fp + fn < fp16 + fn16
    assert 0.7 < mh.threshold_point(b, r) < 0.9
    with pytest.raises(ValueError):
        mh.optimal_bands_rows(1.5, 128)


TEXTS = ["The quick brown fox jumps over the lazy dog, again and again, said the Fox.",
         "", "too short", "Ünïcödé ｔｅｘｔ — with punctuation; and repeated words words words words words words",
         "the quick brown fox jumps over the lazy dog again and again said the fox"]


def test_batch_shingle_hashes_equal_per_doc_and_per_shingle_string():
    norms = [mh.normalize(t) for t in TEXTS] * 3
    x, off = mh.shingle_hash_batch(norms, 3)
    assert off[0] == 0 and off[-1] == x.size and np.all(np.diff(off) >= 0)
    for d, t in enumerate(norms):
        got = x[off[d]:off[d + 1]]
        assert np.array_equal(got, mh.shingle_hashes(t, 3))
        assert np.all(np.diff(got.astype(np.int64)) > 0)  # sorted, distinct
        # the same value from each shingle string: what a datasketch hashfunc sees
        assert set(got.tolist()) == {mh.shingle_hash(s) for s in mh.shingles(t, 3)}
    assert off[2] - off[1] == 0 and off[3] - off[2] == 0  # empty and too-short docs have none
    # chunked processing (long batches) gives identical output
    old = mh._CHUNK_CHARS
    try:
        mh._CHUNK_CHARS = 40
        x2, off2 = mh.shingle_hash_batch(norms, 3)
    finally:
        mh._CHUNK_CHARS = old
    assert np.array_equal(x, x2) and np.array_equal(off, off2)


def _raw_texts() -> list[str]:
    import gzip
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with gzip.open(root / "data" / "sample" / "cc_wet_2019_30_sample.jsonl.gz", "rt", encoding="utf-8") as fh:
        cc = [json.loads(line).get("text") or "" for line in fh][:150]  # many languages and scripts
    edge = ["", "   ", "a", "¡Hola!", "x\ud800y z", "Ｆｕｌｌ　ｗｉｄｔｈ — dash…", "İstanbul ǅ ß ﬁ", "a\u2028b\x1cc d",
            "tab\tsep\u00a0nbsp\u3000ideo", "emoji 🙂 stays 🙂 a word"]
    return TEXTS + edge + cc


@pytest.mark.parametrize("n", [1, 3, 5])
def test_fused_raw_text_path_equals_normalise_then_hash(n):
    """The compiled path (raw text → shingle hashes, no normalised strings) gives exactly the hashes of
    normalize + shingle_hash_batch, word counts, and exact keys that match equality of normalised text."""
    pytest.importorskip("numba")
    texts = _raw_texts()
    norms = [mh.normalize(t) for t in texts]
    x0, off0 = mh.shingle_hash_batch(norms, n)
    x1, off1, words, exact = mh.shingle_hash_texts(texts, n)
    assert np.array_equal(off0, off1) and np.array_equal(x0, x1)
    assert words.tolist() == [len(t.split(" ")) if t else 0 for t in norms]
    assert [int(v) for v in exact[:40].view(np.uint64)] == [mh._exact_ref(t) for t in norms[:40]]
    same_text = {(i, j) for i in range(len(norms)) for j in range(len(norms)) if norms[i] == norms[j]}
    same_key = {(i, j) for i in range(len(norms)) for j in range(len(norms)) if exact[i] == exact[j]}
    assert same_text == same_key and len(same_text) > len(norms)  # TEXTS has two docs that normalize equal


@pytest.mark.parametrize("engine", ["numpy", "numba"])
def test_batch_signatures_equal_the_exact_reference(engine):
    if engine == "numba":
        pytest.importorskip("numba")
    rng = np.random.default_rng(3)
    sets = [np.unique(rng.integers(0, 1 << 32, size=n, dtype=np.uint64)) for n in (1, 5, 300, 2000, 17)]
    sets[1][:] = (1 << 32) - 1 - np.arange(5, dtype=np.uint64)[::-1]  # the largest hash values
    a, b = mh.permutations(64, 11)
    got = mh.signatures(sets, a, b, engine=engine)
    p = (1 << 61) - 1
    for row, hs in zip(got, sets):
        assert np.array_equal(row, mh.signature(hs, a, b))
        want = [min((int(ak) * int(x) + int(bk)) % p for x in hs) for ak, bk in zip(a, b)]  # Python big ints
        assert [int(v) for v in row] == want


def test_datasketch_legacy_equivalence_is_documented_exactly():
    """Same seeds, same shingle hashes: datasketch's legacy MinHash equals the same formula computed in
    uint64 with wraparound (a·x + b can exceed 2^64) and cut to 32 bits; ours is the exact value."""
    from datasketch import MinHash

    norm = mh.normalize(TEXTS[0] + " " + TEXTS[3])
    shingle_strs = sorted(mh.shingles(norm, 3))
    ds = MinHash(num_perm=32, seed=5, scheme="legacy", hashfunc=lambda s: mh.shingle_hash(s.decode()))
    for s in shingle_strs:
        ds.update(s.encode())
    a, b = mh.permutations(32, 5)
    hs = mh.shingle_hashes(norm, 3)
    p, m64 = (1 << 61) - 1, (1 << 64) - 1
    wrapped = [min((((int(ak) * int(x) + int(bk)) & m64) % p) & 0xFFFFFFFF for x in hs) for ak, bk in zip(a, b)]
    exact = [min((int(ak) * int(x) + int(bk)) % p for x in hs) for ak, bk in zip(a, b)]
    assert [int(v) for v in ds.hashvalues] == wrapped
    assert [int(v) for v in mh.signatures([hs], a, b)[0]] == exact
    assert wrapped != exact  # the products do overflow uint64: datasketch issue #99
