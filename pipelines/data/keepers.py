"""Per-component work of the dedup job, on executors: exact Jaccard, verification, keepers.

The Spark job (``pipelines.data.dedup``) hands each connected component of candidate edges, whole and
sorted by idx, to :func:`resolve_partition`: star edges rebuilt from the members' bucket keys, every
pair's exact Jaccard on their shingle-hash sets, LSH edges below the threshold rejected (``verify``),
duplicate components from the rest, and a keeper per duplicate component (``cover`` / ``min_idx`` /
``longest``). :func:`resolve_component` is the readable Python reference; ``_resolve_kernel_py``,
compiled by numba, does the same for a whole partition in one call (tests hold them equal).

Shingle-hash sets travel as one Arrow ``binary`` value per doc (:func:`hash_set_column`).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipelines.data.minhash import compiled


def hash_set_column(x, offsets, valid):
    """Per-doc sorted uint32 hash sets as one Arrow ``binary`` column (little-endian uint32s), built
    from the flat array without a Python loop. Binary, not ``array<int>``: Spark moves it between
    the JVM and Python (and caches it) as one block of bytes, not element by element."""
    n = offsets.size - 1
    byte_off = (np.asarray(offsets, dtype=np.int64) * 4).astype(np.int32)
    bitmap = pa.py_buffer(np.packbits(np.asarray(valid, dtype=bool), bitorder="little").tobytes())
    return pa.Array.from_buffers(pa.binary(), n, [bitmap, pa.py_buffer(byte_off.tobytes()),
                                                  pa.py_buffer(np.asarray(x).astype("<u4").tobytes())],
                                 null_count=int(n - np.count_nonzero(valid)))


def hash_sets(col):
    """An Arrow ``binary`` column of :func:`hash_set_column` → (offsets int64 from 0, uint32 values,
    valid mask): zero-copy views, slices honoured."""
    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    n = len(arr)
    bufs = arr.buffers()
    off = np.frombuffer(bufs[1], dtype=np.int32)[arr.offset:arr.offset + n + 1].astype(np.int64)
    data = np.frombuffer(bufs[2], dtype=np.uint8)[off[0]:off[-1]] if bufs[2] is not None else np.zeros(0, np.uint8)
    valid = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    return (off - off[0]) // 4, data.view("<u4"), valid


def sorted_jaccard(a, b) -> float:
    """Exact Jaccard of two sorted arrays of distinct hashes (both empty: 1.0): the one kernel the keepers and the
    distributed verification use (``minhash.jaccard`` is its reference on Python sets)."""
    if a.size > b.size:
        a, b = b, a
    if not b.size:
        return 1.0
    pos = np.searchsorted(b, a)
    pos[pos == b.size] = 0
    inter = int(np.count_nonzero(b[pos] == a))
    return inter / (a.size + b.size - inter)


def jaccard_matrix(exact, shs):
    """All-pairs exact Jaccard of one component's members (identical normalized text: 1.0).

    ``shs``: each member's distinct shingle hashes, sorted as unsigned 32-bit (int32 views of them
    are fine), or None when it has none."""
    n = len(exact)
    jm = np.eye(n)
    u = [None if h is None else h.view(np.uint32) if h.dtype.itemsize == 4 else h for h in shs]
    for i in range(n):
        for j in range(i + 1, n):
            if exact[i] == exact[j]:
                jac = 1.0
            elif u[i] is None or u[j] is None:
                jac = 0.0
            else:
                jac = sorted_jaccard(u[i], u[j])
            jm[i, j] = jm[j, i] = jac
    return jm


def greedy_cover(jm, threshold: float):
    """Positions of the keeper of each member: a greedy dominating set of the graph J ≥ threshold.

    Greedy: keep the member whose closed neighbourhood covers the most still-uncovered members (ties:
    the earliest position); at the end every removed member goes to the kept neighbour it is most
    similar to. Every removed doc thus has a kept doc with J ≥ threshold.
    """
    adj = jm >= threshold
    np.fill_diagonal(adj, True)
    n = adj.shape[0]
    kept = np.zeros(n, dtype=bool)
    uncovered = np.ones(n, dtype=bool)
    while uncovered.any():
        k = int(np.argmax((adj & uncovered[None, :]).sum(axis=1)))  # first maximum = earliest
        kept[k] = True
        uncovered &= ~adj[k]
    keeper = np.arange(n)
    for m in np.flatnonzero(~kept):
        cands = np.flatnonzero(kept & adj[m])
        keeper[m] = cands[np.argmax(jm[m, cands])]
    return keeper


def choose_keepers(policy: str, threshold: float, idx, lens, jm):
    """One cluster of duplicates (members sorted by idx, ``jm`` their all-pairs Jaccard) → the
    keeper position of each member."""
    if policy == "cover":
        return greedy_cover(jm, threshold)
    if policy == "longest":
        return np.full(len(idx), int(np.lexsort((idx, -np.asarray(lens)))[0]))
    return np.zeros(len(idx), dtype=np.int64)  # min_idx


def star_edges_local(keys) -> dict[tuple[int, int], int]:
    """The candidate star edges among one component's members, rebuilt from their bucket keys.

    Every bucket's members are joined by its star, so they all lie in one component, and its
    smallest idx (the star centre) is the first of them in idx order: the component alone gives
    back exactly the edges Spark built. Returns {(member, centre): x} in positions, x = 1 when the
    pair shares the exact band (position 0)."""
    n = len(keys)
    width = max(len(k) for k in keys)
    km = np.zeros((n, width), dtype=np.int64)
    valid = np.zeros((n, width), dtype=bool)
    for i, k in enumerate(keys):
        km[i, :len(k)] = k
        valid[i, :len(k)] = True
    same = (km[:, None, :] == km[None, :, :]) & valid[:, None, :] & valid[None, :, :]
    centre = same.argmax(axis=0)  # (member, band) → first member sharing its bucket (itself if none)
    mem, band = np.nonzero(valid & (centre != np.arange(n)[:, None]))
    edges: dict[tuple[int, int], int] = {}
    for m, p, c in zip(mem.tolist(), band.tolist(), centre[mem, band].tolist()):
        edges[(m, c)] = max(edges.get((m, c), 0), int(p == 0))
    return edges


def resolve_component(policy: str, threshold: float, verify: bool, idx, lens, keys, shs):
    """One connected component of candidate edges → per member: (component position, component size,
    keeper position, Jaccard to the keeper, candidate/verified/exact edges out of it).

    Candidate edges are rebuilt (:func:`star_edges_local`) and scored on the all-pairs exact Jaccard;
    with ``verify`` only exact-band edges and LSH edges with J ≥ threshold stay; the docs they join
    are the *duplicate components* (smallest member = ``component``), and the keeper policy runs on
    each (``cover`` on all its pairs' exact J)."""
    n = len(idx)
    exact = [int(k[0]) for k in keys]
    jm = jaccard_matrix(exact, shs)
    edges = star_edges_local(keys)
    n_cand, n_ver, n_exact = (np.zeros(n, dtype=np.int64) for _ in range(3))
    parent = list(range(n))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for (s, d), x in edges.items():
        if x:
            n_exact[s] += 1
        else:
            n_cand[s] += 1
            if verify and jm[s, d] < threshold:
                continue
            n_ver[s] += 1
        rs, rd = find(s), find(d)
        if rs != rd:
            parent[max(rs, rd)] = min(rs, rd)
    comp = np.array([find(i) for i in range(n)])  # the smallest position of each duplicate component
    size = np.bincount(comp, minlength=n)[comp]
    keeper = np.arange(n)
    for c in np.flatnonzero(np.bincount(comp, minlength=n) > 1):
        mem = np.flatnonzero(comp == c)
        keeper[mem] = mem[choose_keepers(policy, threshold, idx[mem], lens[mem], jm[np.ix_(mem, mem)])]
    return comp, size, keeper, jm[np.arange(n), keeper], n_cand, n_ver, n_exact


POLICY_CODES = {"min_idx": 0, "cover": 1, "longest": 2}


def _resolve_kernel_py(starts, lens, k_off, k_val, s_off, s_val, has_sh, policy, threshold, verify,
                       comp, size, keeper, jac, n_cand, n_ver, n_exact):  # compiled by numba
    """:func:`resolve_component` for every component of a partition at once (positions are global).

    ``starts``: the first row of each component (plus the end); keys and shingle hashes (uint32,
    sorted) as flat values with offsets. Same results as the Python reference, member for member."""
    n_comp = starts.size - 1
    for c in range(n_comp):
        a, e = starts[c], starts[c + 1]
        m = e - a
        jm = np.eye(m)
        for i in range(m):
            for j in range(i + 1, m):
                ri, rj = a + i, a + j
                if k_val[k_off[ri]] == k_val[k_off[rj]]:
                    v = 1.0
                elif not has_sh[ri] or not has_sh[rj]:
                    v = 0.0
                else:
                    p, q, pe, qe, inter = s_off[ri], s_off[rj], s_off[ri + 1], s_off[rj + 1], 0
                    while p < pe and q < qe:
                        if s_val[p] == s_val[q]:
                            inter += 1
                            p += 1
                            q += 1
                        elif s_val[p] < s_val[q]:
                            p += 1
                        else:
                            q += 1
                    v = inter / (s_off[ri + 1] - s_off[ri] + s_off[rj + 1] - s_off[rj] - inter)
                jm[i, j] = v
                jm[j, i] = v
        # candidate star edges: member j → the first member sharing its bucket, per band; 2 = exact band
        em = np.zeros((m, m), dtype=np.int8)
        width = 0
        for i in range(m):
            width = max(width, k_off[a + i + 1] - k_off[a + i])
        for b in range(width):
            for j in range(m):
                rj = a + j
                if k_off[rj + 1] - k_off[rj] <= b:
                    continue
                kj = k_val[k_off[rj] + b]
                for i in range(j):
                    ri = a + i
                    if k_off[ri + 1] - k_off[ri] > b and k_val[k_off[ri] + b] == kj:
                        em[j, i] = max(em[j, i], 2 if b == 0 else 1)
                        break
        parent = np.arange(m)
        for j in range(m):
            for i in range(j):
                x = em[j, i]
                if x == 0:
                    continue
                if x == 2:
                    n_exact[a + j] += 1
                else:
                    n_cand[a + j] += 1
                    if verify and jm[j, i] < threshold:
                        continue
                    n_ver[a + j] += 1
                ra, rb = j, i
                while parent[ra] != ra:
                    ra = parent[ra]
                while parent[rb] != rb:
                    rb = parent[rb]
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
        root = np.empty(m, dtype=np.int64)
        cnt = np.zeros(m, dtype=np.int64)
        for i in range(m):
            r = i
            while parent[r] != r:
                r = parent[r]
            root[i] = r
            cnt[r] += 1
        for i in range(m):
            comp[a + i] = a + root[i]
            size[a + i] = cnt[root[i]]
            keeper[a + i] = a + i
        for r in range(m):
            if cnt[r] < 2:
                continue
            mem = np.empty(cnt[r], dtype=np.int64)
            k = 0
            for i in range(m):
                if root[i] == r:
                    mem[k] = i
                    k += 1
            if policy == 0:
                for i in mem:
                    keeper[a + i] = a + mem[0]
            elif policy == 2:
                best = mem[0]
                for i in mem:
                    if lens[a + i] > lens[a + best]:
                        best = i
                for i in mem:
                    keeper[a + i] = a + best
            else:  # greedy dominating set of J ≥ threshold, then each removed doc to its most similar keeper
                nm = mem.size
                kept = np.zeros(nm, dtype=np.bool_)
                unc = np.ones(nm, dtype=np.bool_)
                left = nm
                while left > 0:
                    best, best_n = 0, -1
                    for u in range(nm):
                        cn = 0
                        for w in range(nm):
                            if unc[w] and (u == w or jm[mem[u], mem[w]] >= threshold):
                                cn += 1
                        if cn > best_n:
                            best, best_n = u, cn
                    kept[best] = True
                    for w in range(nm):
                        if unc[w] and (w == best or jm[mem[best], mem[w]] >= threshold):
                            unc[w] = False
                            left -= 1
                for u in range(nm):
                    if kept[u]:
                        continue
                    bk, bj = -1, -1.0
                    for w in range(nm):
                        if kept[w] and jm[mem[u], mem[w]] >= threshold and jm[mem[u], mem[w]] > bj:
                            bk, bj = w, jm[mem[u], mem[w]]
                    keeper[a + mem[u]] = a + mem[bk]
        for i in range(m):
            jac[a + i] = jm[i, keeper[a + i] - a]


def resolve_partition(cc, idx, lens, keys_col, sh_col, policy: str, threshold: float, verify: bool,
                      engine: str = "auto"):
    """Every component of a batch sorted by (cc, idx) → (comp, size, keeper, jac, n_cand, n_ver,
    n_exact) as global positions/arrays. ``keys_col``: Arrow list<int64>, ``sh_col``: Arrow binary
    (:func:`hash_set_column`). ``engine``:
    "numba", "python" (:func:`resolve_component` per component) or "auto"."""
    n = len(cc)
    starts = np.flatnonzero(np.r_[True, cc[1:] != cc[:-1]]) if n else np.zeros(0, dtype=np.int64)
    starts = np.r_[starts, n].astype(np.int64)
    kern = compiled(_resolve_kernel_py) if engine in ("auto", "numba") else None
    if engine == "numba" and kern is None:
        raise RuntimeError("numba is not installed")
    comp, size, keeper, n_cand, n_ver, n_exact = (np.zeros(n, dtype=np.int64) for _ in range(6))
    jac = np.zeros(n)
    if kern is not None:
        k_off, k_val, _ = list_flat(keys_col, np.int64)
        s_off, s_val, has = hash_sets(sh_col)
        kern(starts, np.asarray(lens, dtype=np.int64), k_off, k_val, s_off, s_val, has, POLICY_CODES[policy],
             float(threshold), bool(verify), comp, size, keeper, jac, n_cand, n_ver, n_exact)
        return comp, size, keeper, jac, n_cand, n_ver, n_exact
    keys = _list_slices(keys_col)
    s_off, s_val, has = hash_sets(sh_col)
    sh = [s_val[s_off[i]:s_off[i + 1]] if has[i] else None for i in range(n)]
    for a, e in zip(starts[:-1], starts[1:]):
        out = resolve_component(policy, threshold, verify, idx[a:e], lens[a:e], keys[a:e], sh[a:e])
        for arr, v, shift in zip((comp, size, keeper, jac, n_cand, n_ver, n_exact), out, (a, 0, a, 0, 0, 0, 0)):
            arr[a:e] = v + shift
    return comp, size, keeper, jac, n_cand, n_ver, n_exact


def list_flat(col, dtype):
    """An Arrow list column → (offsets int64 from 0, values as ``dtype``, valid mask)."""
    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    off = arr.offsets.to_numpy().astype(np.int64)
    vals = arr.values.to_numpy(zero_copy_only=False)[off[0]:off[-1]].astype(dtype, copy=False)
    valid = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    return off - off[0], vals, valid


def _list_slices(col) -> list:
    """An Arrow list column → one numpy view per row (None where null), without Python ints."""
    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    off = arr.offsets.to_numpy()
    vals = arr.values.to_numpy(zero_copy_only=False)
    valid = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    return [vals[off[i]:off[i + 1]] if valid[i] else None for i in range(len(arr))]


def pair_jaccard(a_col, b_col):
    """Exact Jaccard of row-aligned pairs of hash sets (two Arrow binary columns)."""
    ao, av, _ = hash_sets(a_col)
    bo, bv, _ = hash_sets(b_col)
    return np.array([sorted_jaccard(av[ao[r]:ao[r + 1]], bv[bo[r]:bo[r + 1]]) for r in range(ao.size - 1)])
