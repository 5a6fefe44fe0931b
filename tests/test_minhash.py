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
    fp16 = mh._integrate(lambda s: mh.candidate_probability(s, 16, 8), 0, 0.8)
    fn16 = mh._integrate(lambda s: 1 - mh.candidate_probability(s, 16, 8), 0.8, 1)
    assert fp + fn < fp16 + fn16
    assert 0.7 < mh.threshold_point(b, r) < 0.9
    with pytest.raises(ValueError):
        mh.optimal_bands_rows(1.5, 128)
