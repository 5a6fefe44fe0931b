"""The per-component pass of the dedup job (no Spark): star edges rebuilt from bucket keys, verification,
duplicate components and keepers."""
import numpy as np

from pipelines.data.keepers import hash_set_column, hash_sets, pair_jaccard, resolve_component, star_edges_local


def test_star_edges_rebuilt_from_keys_point_at_each_buckets_first_member():
    # keys[0] is the exact band; then LSH bands. Members in idx order.
    keys = [[10, 1, 2], [11, 1, 3], [12, 4, 3], [10]]  # doc 3: too short to shingle, exact dup of doc 0
    e = star_edges_local(keys)
    # band 0: {0, 3} → (3, 0) exact; band 1: {0, 1} → (1, 0); band 2: {1, 2} → (2, 1)
    assert e == {(3, 0): 1, (1, 0): 0, (2, 1): 0}


def test_star_edge_found_in_the_exact_band_and_an_lsh_band_counts_as_exact():
    assert star_edges_local([[7, 1], [7, 1]]) == {(1, 0): 1}


def _sets(*arrays):
    return [np.asarray(s, dtype=np.int32) for s in arrays]


def test_resolve_component_rejects_low_jaccard_candidates_and_covers_the_rest():
    a = np.arange(0, 100)
    b = np.arange(5, 105)     # J(a,b) = 95/105 = 0.905
    c = np.arange(60, 160)    # J(b,c) = 45/155 = 0.29: an LSH false positive
    keys = [[1, 9], [2, 9], [3, 9]]  # one shared band bucket: edges b→a, c→a
    idx = np.array([4, 8, 15])
    lens = np.array([100, 100, 100])
    comp, size, keeper, jac, n_cand, n_ver, n_exact = resolve_component(
        "cover", 0.8, True, idx, lens, keys, _sets(a, b, c))
    assert n_cand.tolist() == [0, 1, 1] and n_ver.tolist() == [0, 1, 0] and n_exact.sum() == 0
    assert comp.tolist() == [0, 0, 2] and size.tolist() == [2, 2, 1]
    assert keeper.tolist() == [0, 0, 2] and jac[1] == 95 / 105
    # without verification the false positive joins the component; min_idx keeps the first doc
    comp, size, keeper, jac, *_ = resolve_component("min_idx", 0.8, False, idx, lens, keys, _sets(a, b, c))
    assert comp.tolist() == [0, 0, 0] and keeper.tolist() == [0, 0, 0] and jac[2] == 40 / 160


def _random_partition(rng, n_comp=40, bands=6):
    """Components sorted by (cc, idx) like the keeper pass sees them: shared buckets, near and exact
    duplicates, members too short to shingle, LSH false positives."""
    import pyarrow as pa

    cc, idx, lens, keys, shs = [], [], [], [], []
    base_idx = 0
    for c in range(n_comp):
        m = int(rng.integers(1, 9))
        root = rng.integers(0, 2**31, 300)
        for i in range(m):
            idx.append(base_idx + i)
            cc.append(base_idx)
            lens.append(int(rng.integers(50, 60)))
            if rng.random() < 0.15:  # too short to shingle: exact band only, maybe an exact dup of the first
                keys.append([int(rng.integers(0, 3)) + 1000 * c])
                shs.append(None)
                continue
            keep = rng.random(300) < rng.uniform(0.55, 1.0)
            sh = np.unique(np.concatenate([root[keep], rng.integers(0, 2**31, int(rng.integers(0, 60)))]))
            shs.append(sh.astype(np.uint32).view(np.int32))
            keys.append([int(rng.integers(0, 3)) + 1000 * c] + [int(rng.integers(0, 3)) for _ in range(bands)])
        base_idx += m + int(rng.integers(0, 4))
    keys_col = pa.array(keys, pa.list_(pa.int64()))
    sizes = [0 if s is None else s.size for s in shs]
    sh_col = hash_set_column(np.concatenate([s.view(np.uint32) for s in shs if s is not None]),
                             np.r_[0, np.cumsum(sizes)], [s is not None for s in shs])
    return np.array(cc), np.array(idx), np.array(lens), keys_col, sh_col


import pytest  # noqa: E402


@pytest.mark.parametrize("policy", ["cover", "min_idx", "longest"])
@pytest.mark.parametrize("verify", [True, False])
def test_compiled_keeper_pass_equals_the_python_reference(policy, verify):
    pytest.importorskip("numba")
    from pipelines.data.keepers import resolve_partition

    rng = np.random.default_rng(7)
    cc, idx, lens, keys_col, sh_col = _random_partition(rng)
    ref = resolve_partition(cc, idx, lens, keys_col, sh_col, policy, 0.8, verify, engine="python")
    got = resolve_partition(cc, idx, lens, keys_col, sh_col, policy, 0.8, verify, engine="numba")
    for name, r, g in zip(("comp", "size", "keeper", "jac", "n_cand", "n_ver", "n_exact"), ref, got):
        np.testing.assert_allclose(g, r, err_msg=name)
    assert ref[4].sum() > ref[5].sum() > 0 or not verify  # some candidates rejected, some kept
    assert (ref[2] != np.arange(len(cc))).sum() > 10      # many docs removed


def test_hash_set_column_round_trips_through_arrow_slices_and_nulls():
    rng = np.random.default_rng(1)
    sets = [np.unique(rng.integers(0, 2**32, int(rng.integers(1, 50)), dtype=np.uint64)) for _ in range(9)]
    valid = [i % 4 != 2 for i in range(9)]
    sets = [s if v else np.zeros(0, np.uint64) for s, v in zip(sets, valid)]
    col = hash_set_column(np.concatenate(sets), np.r_[0, np.cumsum([s.size for s in sets])], valid)
    assert col.null_count == 2
    off, vals, ok = hash_sets(col.slice(3, 5))  # a slice, as the keeper pass's batches are
    assert ok.tolist() == valid[3:8]
    for k in range(5):
        assert np.array_equal(vals[off[k]:off[k + 1]], sets[3 + k])
    j = pair_jaccard(col.slice(0, 2), col.slice(0, 2))
    assert j.tolist() == [1.0, 1.0]
    a, b = sets[0], sets[1]
    expect = np.intersect1d(a, b).size / np.union1d(a, b).size
    assert pair_jaccard(col.slice(0, 1), col.slice(1, 1))[0] == expect


def test_bucket_stars_streamed_in_small_batches_equal_the_star_edges_of_the_keys():
    """The Spark job's star pass gets each partition's bucket entries sorted by (band, key, idx) in Arrow batches of
    any size: a bucket cut across batches still points every member at its first one, and the edges, merged across
    bands, are the reference's."""
    import pyarrow as pa

    from pipelines.data.dedup import bucket_stars

    rng = np.random.default_rng(5)
    keys = [[int(rng.integers(0, 4))] + [int(v) for v in rng.integers(0, 3, size=3)] for _ in range(40)]
    keys += [[99]]  # too short to shingle: the exact band only
    rows = sorted((band, k, i) for i, ks in enumerate(keys) for band, k in enumerate(ks))
    cols = [np.array(c, dtype=np.int64) for c in zip(*rows)]
    for size in (1, 3, 7, len(rows)):
        batches = [pa.RecordBatch.from_arrays([pa.array(c[s:s + size]) for c in cols], names=["band", "key", "idx"])
                   for s in range(0, len(rows), size)]
        got: dict = {}
        for b in bucket_stars(iter(batches)):
            for u, v, x in zip(*(b.column(i).to_pylist() for i in range(3))):
                got[(u, v)] = max(got.get((u, v), 0), x)
        assert got == star_edges_local(keys), size


def test_one_task_components_are_the_components_of_docs_sharing_a_bucket():
    """The one-task path (keys of every doc → stars → components, with sizes) against a union-find over the docs
    that share any (band, key); a doc with null keys (empty text) and a doc alone in its buckets are no members; the
    rows may come in several batches, in any order."""
    import pyarrow as pa

    from pipelines.data.dedup import one_task_components

    rng = np.random.default_rng(11)
    keys = [[int(rng.integers(0, 30))] + [int(v) for v in rng.integers(0, 40, size=3)] for _ in range(60)]
    keys += [[1000], None]
    idx = rng.permutation(len(keys)) * 3 + 7  # sparse, unordered
    parent = list(range(len(keys)))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    first: dict = {}
    for i, ks in enumerate(keys):
        for band, k in enumerate(ks or []):
            j = first.setdefault((band, k), i)
            parent[find(i)] = find(j)
    groups: dict = {}
    for i in range(len(keys)):
        groups.setdefault(find(i), []).append(int(idx[i]))
    want = {m: (min(g), len(g)) for g in groups.values() if len(g) > 1 for m in g}
    t = pa.table({"idx": pa.array(idx, pa.int64()), "keys": pa.array(keys, pa.list_(pa.int64()))})
    out = list(one_task_components(iter(t.to_batches(max_chunksize=7))))
    got = {i: (c, n) for b in out for i, c, n in zip(*(b.column(k).to_pylist() for k in range(3)))}
    assert got == want and len(want) > 10 and any(n > 2 for _, n in want.values())
    assert list(one_task_components(iter([]))) == []
