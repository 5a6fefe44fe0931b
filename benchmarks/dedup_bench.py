"""Near-duplicate detection benchmark: our Spark MinHash-LSH dedup beside datasketch, rensa and DataTrove.

One run, one machine, the same corpus, the same shingling (our normalisation + word 5-grams) and
128 permutations for every tool:

* **Corpus** (seeded): the C4 sample's docs, plus injected near-duplicates of known exact Jaccard
  (variants made by word deletions / insertions / substitutions, sentence swaps and appended
  boilerplate, target J spread uniformly over 0.5–1.0, a quarter of them variants of variants, so
  transitive chains exist), exact duplicates, and docs shorter than the shingle size (all distinct).
* **Scale k×**: k disjoint copies of that corpus (copy c ≥ 1 suffixes every normalised word with a
  copy tag, so shingles never cross copies and each copy's Jaccard structure is that of copy 0).
* **Ground truth**: exact Jaccard of every pair of shingle sets (sparse matrix product), no sampling.
* **Metrics** at J ≥ 0.8: pairwise precision / recall of "same cluster", recall per Jaccard bin,
  doc-level removal precision (a removed doc still has a kept doc with J ≥ 0.8) and removal recall
  (against the most removals that can all be correct: per component of the J ≥ 0.8 graph, its size
  minus a minimum dominating set), and docs/s.

Run ``python benchmarks/dedup_bench.py`` (``make bench`` installs the anchors first); it prints the
table and writes it as JSON to ``var/bench/dedup.json``.
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.data.minhash import jaccard, normalize, shingles  # noqa: E402
from pipelines.manifest import atomic_write_text  # noqa: E402

SHARED_C4 = ROOT.parent / "shared" / "data" / "corpus" / "c4_en_train_1k.jsonl"
BUNDLED_C4 = ROOT / "data" / "sample" / "c4_en_train_1k.jsonl.gz"
NGRAM, NUM_PERM, SEED, THRESHOLD = 5, 128, 42, 0.8
BOILERPLATE = [
    "Click here to subscribe to our newsletter and get the latest news delivered to your inbox every week.",
    "This article was originally published on our blog. All rights reserved. Terms of use and privacy policy.",
    "Share this post on Facebook, Twitter and Pinterest. Leave a comment below and tell us what you think.",
    "Copyright 2019 by the authors. Please do not reproduce without permission from the editorial team.",
]
J_BINS = [(0.8, 0.85), (0.85, 0.9), (0.9, 0.95), (0.95, 1.0), (1.0, 1.01)]


# ----------------------------------------------------------------------------------------- corpus
@dataclass
class Corpus:
    ids: list[str]
    texts: list[str]
    kinds: list[str]
    # pairs (i < j) with exact Jaccard ≥ 0.5, and their Jaccard
    pi: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pj: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pjac: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __len__(self) -> int:
        return len(self.ids)


def _sentences(text: str) -> list[str]:
    out, cur = [], []
    for w in text.split(" "):
        cur.append(w)
        if w.endswith((".", "!", "?")):
            out.append(" ".join(cur))
            cur = []
    if cur:
        out.append(" ".join(cur))
    return out


def make_variant(text: str, target: float, rng: random.Random, vocab: list[str]) -> str:
    """Edit ``text`` until the Jaccard of its 5-gram shingles to the original falls to ≈ ``target``."""
    base = shingles(text, NGRAM)
    words = text.split()
    if target >= 0.999 or not base:
        return text
    boiler_done = False
    step = max(1, len(words) // 150)
    cur = text
    for _ in range(2000):
        op = rng.random()
        if op < 0.08 and not boiler_done:
            words = words + rng.choice(BOILERPLATE).split()
            boiler_done = True
        elif op < 0.16:
            sents = _sentences(" ".join(words))
            if len(sents) >= 3:
                a, b = rng.sample(range(len(sents)), 2)
                sents[a], sents[b] = sents[b], sents[a]
                words = " ".join(sents).split()
        else:
            for _ in range(step):
                if len(words) <= NGRAM + 1:
                    break
                i = rng.randrange(len(words))
                r = rng.random()
                if r < 0.34:
                    del words[i]
                elif r < 0.67:
                    words.insert(i, rng.choice(vocab))
                else:
                    words[i] = rng.choice(vocab)
        nxt = " ".join(words)
        j = jaccard(base, shingles(nxt, NGRAM))
        if j < target:
            # overshoot: keep whichever of before/after is closer to the target
            return nxt if abs(j - target) < abs(jaccard(base, shingles(cur, NGRAM)) - target) else cur
        cur = nxt
    return cur


def build_corpus(path: Path | None = None, seed: int = SEED, n_sources: int = 400, n_exact: int = 60,
                 n_short: int = 40) -> Corpus:
    path = path or (SHARED_C4 if SHARED_C4.exists() else BUNDLED_C4)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        base = [json.loads(line)["text"] for line in f if line.strip()]
    rng = random.Random(seed)
    vocab = sorted({w for t in base[:200] for w in t.split() if w.isalpha()})
    docs: list[tuple[str, str]] = [(t, "original") for t in base]
    variants: list[str] = []
    for src in rng.sample(range(len(base)), min(n_sources, len(base))):
        for _ in range(rng.choice([1, 1, 2])):
            parent = base[src]
            if variants and rng.random() < 0.25:  # variant of a variant: transitive chains
                parent = rng.choice(variants)
            v = make_variant(parent, rng.uniform(0.5, 1.0), rng, vocab)
            variants.append(v)
            docs.append((v, "variant"))
    for t, _ in rng.sample(docs, n_exact):
        docs.append((t, "exact"))
    for _ in range(n_short):
        docs.append((" ".join(rng.choice(vocab) for _ in range(rng.randint(1, NGRAM - 1))), "short"))
    rng.shuffle(docs)
    c = Corpus([f"d{i:06d}" for i in range(len(docs))], [t for t, _ in docs], [k for _, k in docs])
    c.pi, c.pj, c.pjac = similar_pairs(c.texts, 0.5)
    return c


def similar_pairs(texts: list[str], min_j: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All pairs (i < j) with exact Jaccard ≥ min_j, by a sparse doc × shingle product."""
    from scipy import sparse

    vocab: dict[str, int] = {}
    indptr, indices = [0], []
    for t in texts:
        indices.extend(vocab.setdefault(s, len(vocab)) for s in shingles(t, NGRAM))
        indptr.append(len(indices))
    m = sparse.csr_matrix((np.ones(len(indices), np.int32), indices, indptr), shape=(len(texts), len(vocab)))
    sizes = np.diff(m.indptr)
    inter = sparse.triu(m @ m.T, k=1).tocoo()
    jac = inter.data / (sizes[inter.row] + sizes[inter.col] - inter.data)
    keep = jac >= min_j
    return inter.row[keep].astype(np.int64), inter.col[keep].astype(np.int64), jac[keep]


def scale_corpus(c: Corpus, k: int) -> Corpus:
    """k disjoint copies: copy c ≥ 1 tags every normalised word, so no shingle crosses copies."""
    ids, texts, kinds = list(c.ids), list(c.texts), list(c.kinds)
    for copy in range(1, k):
        tag = "q" + "".join(chr(97 + int(d)) for d in str(copy))
        ids += [f"{i}~{copy}" for i in c.ids]
        texts += [" ".join(w + tag for w in normalize(t).split(" ") if w) for t in c.texts]
        kinds += c.kinds
    n = len(c)
    off = np.repeat(np.arange(k, dtype=np.int64) * n, len(c.pi))
    return Corpus(ids, texts, kinds, np.tile(c.pi, k) + off, np.tile(c.pj, k) + off, np.tile(c.pjac, k))


# ---------------------------------------------------------------------------------------- metrics
def _min_dominating_set_size(nodes: list[int], adj: dict[int, set[int]], exact_upto: int = 16) -> tuple[int, bool]:
    """Size of a minimum dominating set of the subgraph on ``nodes`` (exact up to 16 nodes, else greedy)."""
    closed = {v: (adj.get(v, set()) & set(nodes)) | {v} for v in nodes}
    if len(nodes) <= exact_upto:
        for k in range(1, len(nodes) + 1):
            for combo in itertools.combinations(nodes, k):
                if set().union(*(closed[v] for v in combo)) >= set(nodes):
                    return k, True
    left, size = set(nodes), 0
    while left:
        v = max(sorted(nodes), key=lambda u: len(closed[u] & left))
        left -= closed[v]
        size += 1
    return size, False


def evaluate(c: Corpus, cluster: np.ndarray, removed: np.ndarray, threshold: float = THRESHOLD) -> dict:
    """Quality of a dedup result: ``cluster[i]`` a label per doc, ``removed[i]`` True if doc i was dropped."""
    sel = c.pjac >= threshold
    ti, tj, tjac = c.pi[sel], c.pj[sel], c.pjac[sel]
    same = cluster[ti] == cluster[tj]
    _, counts = np.unique(cluster, return_counts=True)
    pred_pairs = int((counts * (counts - 1) // 2).sum())
    tp = int(same.sum())
    out = {
        "pairs_true": int(len(ti)), "pairs_predicted": pred_pairs,
        "pair_precision": tp / pred_pairs if pred_pairs else 1.0,
        "pair_recall": tp / len(ti) if len(ti) else 1.0,
        "recall_by_j": {},
    }
    for lo, hi in J_BINS:
        m = (tjac >= lo - 1e-12) & (tjac < hi)
        key = "1.0" if lo == 1.0 else f"{lo:.2f}-{hi:.2f}"
        out["recall_by_j"][key] = float(same[m].mean()) if m.any() else None
    below = (c.pjac >= 0.5) & (c.pjac < threshold)
    out["co_clustered_0.5-0.8"] = float((cluster[c.pi[below]] == cluster[c.pj[below]]).mean()) if below.any() else 0.0
    # doc-level removal quality
    adj: dict[int, set[int]] = {}
    for a, b in zip(ti.tolist(), tj.tolist()):
        adj.setdefault(a, set()).add(b)
        adj.setdefault(b, set()).add(a)
    rem = np.flatnonzero(removed)
    good = sum(1 for r in rem.tolist() if any(not removed[v] for v in adj.get(r, ())))
    # the most removals that can all be correct: per component, size − minimum dominating set
    seen, best, approx = set(), 0, 0
    for s in adj:
        if s in seen:
            continue
        comp, stack = [], [s]
        seen.add(s)
        while stack:
            u = stack.pop()
            comp.append(u)
            for v in adj[u]:
                if v not in seen:
                    seen.add(v)
                    stack.append(v)
        mds, exact = _min_dominating_set_size(comp, adj)
        best += len(comp) - mds
        approx += 0 if exact else 1
    out.update({
        "removed": int(len(rem)), "removed_correct": good, "removable_max": best,
        "removal_precision": good / len(rem) if len(rem) else 1.0,
        "removal_recall": good / best if best else 1.0,
        "components_greedy_mds": approx,
    })
    return out


class UnionFind:
    def __init__(self, n: int):
        self.p = np.arange(n)

    def find(self, x: int) -> int:
        p = self.p
        root = x
        while p[root] != root:
            root = p[root]
        while p[x] != root:
            p[x], x = root, p[x]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            lo, hi = min(ra, rb), max(ra, rb)
            self.p[hi] = lo  # the smaller index is the root: "keep the smallest id"

    def labels(self) -> np.ndarray:
        return np.array([self.find(i) for i in range(len(self.p))])


def _min_id_result(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return labels, labels != np.arange(len(labels))


# ----------------------------------------------------------------------------------------- runners
def run_exact_oracle(c: Corpus) -> tuple[np.ndarray, np.ndarray]:
    """Connected components of the true J ≥ 0.8 graph, smallest id kept: LSH with no error."""
    uf = UnionFind(len(c))
    sel = c.pjac >= THRESHOLD
    for a, b in zip(c.pi[sel].tolist(), c.pj[sel].tolist()):
        uf.union(a, b)
    return _min_id_result(uf.labels())


def run_datasketch(c: Corpus, params: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM, params=params)
    mhs = []
    for i, t in enumerate(c.texts):
        m = MinHash(num_perm=NUM_PERM, seed=SEED)
        m.update_batch([s.encode("utf-8") for s in shingles(t, NGRAM)])
        lsh.insert(i, m)
        mhs.append(m)
    uf = UnionFind(len(c))
    for i, m in enumerate(mhs):
        for j in lsh.query(m):
            uf.union(i, j)
    return _min_id_result(uf.labels())


def run_rensa(c: Corpus, bands: int = 16) -> tuple[np.ndarray, np.ndarray]:
    from rensa import RMinHash, RMinHashLSH

    mhs = RMinHash.from_token_sets([list(shingles(t, NGRAM)) for t in c.texts], NUM_PERM, SEED)
    lsh = RMinHashLSH(THRESHOLD, NUM_PERM, bands)
    lsh.insert_many(mhs, 0)
    uf = UnionFind(len(c))
    for i, cands in enumerate(lsh.query_all(mhs)):
        for j in cands:
            uf.union(i, int(j))
    return _min_id_result(uf.labels())


def _datatrove_tokenizer():
    from datatrove.utils.word_tokenizers import WordTokenizer

    class SplitTokenizer(WordTokenizer):
        """Whitespace split: DataTrove's default English tokenizer (nltk) needs punkt data fetched at run time."""

        def word_tokenize(self, text):
            return text.split()

        def sent_tokenize(self, text):
            return [text]

        def span_tokenize(self, text):
            return [(0, len(text))]

    return SplitTokenizer("en")


def run_datatrove(c: Corpus, work: Path, workers: int = 2, bands: int = 16,
                  rows: int = 8) -> tuple[np.ndarray, np.ndarray]:
    import logging

    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                                  MinhashDedupFilter, MinhashDedupSignature)
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers.jsonl import JsonlWriter
    from datatrove.utils.hashing import HashConfig
    from loguru import logger

    logger.remove()
    logging.getLogger("datatrove").setLevel(logging.WARNING)
    inp = work / "input"
    inp.mkdir(parents=True)
    tasks = workers
    per = -(-len(c) // tasks)
    for t in range(tasks):  # one input file per task, so doc order is known
        with open(inp / f"{t:03d}.jsonl", "w") as f:
            for i in range(t * per, min(len(c), (t + 1) * per)):
                f.write(json.dumps({"id": str(i), "text": c.texts[i]}) + "\n")
    cfg = MinhashConfig(n_grams=NGRAM, num_buckets=bands, hashes_per_bucket=rows, seed=SEED,
                        hash_config=HashConfig(precision=64, hash_fc="sha1"))
    tok = _datatrove_tokenizer()
    logs = str(work / "logs")
    t0 = time.perf_counter()
    LocalPipelineExecutor([JsonlReader(str(inp)), MinhashDedupSignature(str(work / "sigs"), config=cfg, language=tok)],
                          tasks=tasks, workers=workers, logging_dir=f"{logs}/1").run()
    LocalPipelineExecutor([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=cfg)],
                          tasks=bands, workers=workers, logging_dir=f"{logs}/2").run()
    LocalPipelineExecutor([MinhashDedupCluster(str(work / "buckets"), str(work / "rm"), config=cfg, save_cluster_id=True)],
                          tasks=1, logging_dir=f"{logs}/3").run()
    LocalPipelineExecutor([JsonlReader(str(inp)),
                           MinhashDedupFilter(str(work / "rm"), exclusion_writer=JsonlWriter(str(work / "removed")),
                                              load_cluster_ids=True),
                           JsonlWriter(str(work / "kept"))], tasks=tasks, workers=workers,
                          logging_dir=f"{logs}/4").run()
    run_datatrove.seconds = time.perf_counter() - t0
    cluster, removed = np.arange(len(c)), np.zeros(len(c), bool)
    for sub, is_removed in (("kept", False), ("removed", True)):
        for f in sorted((work / sub).glob("*")):
            with (gzip.open(f, "rt") if f.suffix == ".gz" else open(f)) as fh:
                for line in fh:
                    d = json.loads(line)
                    i = int(d["id"])
                    removed[i] = is_removed
                    cid = d.get("metadata", {}).get("minhash_cluster_id", -1)
                    if cid >= 0:
                        cluster[i] = -1 - cid  # negative labels never clash with singletons' own index
    return cluster, removed


def start_spark():
    from pipelines.data.spark import get_spark

    t0 = time.perf_counter()
    s = get_spark("local[2]", "dedup-bench", "6g", shuffle_partitions=8)
    s.range(1).count()
    return s, time.perf_counter() - t0


def write_docs_parquet(c: Corpus, path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.mkdir(parents=True)
    pq.write_table(pa.table({"idx": pa.array(range(len(c)), pa.int64()), "id": c.ids, "text": c.texts,
                             "source": ["bench"] * len(c)}), path / "part-0.parquet",
                   row_group_size=2048)  # as pipelines.data.ingest writes docs.parquet


def run_ours(spark, c: Corpus, work: Path, **overrides) -> tuple[np.ndarray, np.ndarray, dict]:
    import pyarrow.dataset as ds

    from pipelines.data.dedup import dedup_docs
    from pipelines.spec import DedupCfg

    docs = work / "docs"
    write_docs_parquet(c, docs)
    cfg = DedupCfg(ngram=NGRAM, num_perm=NUM_PERM, threshold=THRESHOLD, seed=SEED, **overrides)
    t0 = time.perf_counter()
    stats = dedup_docs(spark, docs, work / "out", cfg)
    run_ours.seconds = time.perf_counter() - t0
    t = ds.dataset(str(work / "out" / "clusters"), format="parquet").to_table(columns=["idx", "cluster"])
    cluster = np.arange(len(c))
    cluster[np.asarray(t["idx"])] = np.asarray(t["cluster"])
    removed = np.zeros(len(c), bool)
    r = ds.dataset(str(work / "out" / "removed"), format="parquet").to_table(columns=["idx"])
    removed[np.asarray(r["idx"])] = True
    return cluster, removed, stats


# ------------------------------------------------------------------------------------------- main
def run_tool(tool: str, spark, c: Corpus):
    """One timed run of ``tool`` on ``c``: ((clusters, removed, our stats or None), seconds)."""
    work = Path(tempfile.mkdtemp(prefix=f"dedup-bench-{tool}-"))
    try:
        if tool in ("ours", "ours_min_idx"):
            res = run_ours(spark, c, work, **({"keeper": "min_idx"} if tool == "ours_min_idx" else {}))
            return res, run_ours.seconds
        fns = {"datasketch": lambda: run_datasketch(c), "datasketch_16x8": lambda: run_datasketch(c, (16, 8)),
               "rensa": lambda: run_rensa(c), "datatrove": lambda: run_datatrove(c, work),
               "oracle": lambda: run_exact_oracle(c)}
        if tool not in fns:
            raise SystemExit(f"unknown tool {tool!r}")
        (cl, rm), secs = _timed(fns[tool])
        return (cl, rm, None), run_datatrove.seconds if tool == "datatrove" else secs
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _timed(fn, *a, **kw):
    t0 = time.perf_counter()
    res = fn(*a, **kw)
    return res, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="1,4,16", help="Corpus multiples to run (default 1,4,16).")
    ap.add_argument("--tools", default="ours,datasketch,rensa,datatrove,oracle",
                    help="Comma list of: ours, ours_min_idx, datasketch, datasketch_16x8, rensa, datatrove, oracle.")
    ap.add_argument("--quality-scales", default="1", help="Scales at which quality is also computed for anchors.")
    ap.add_argument("--repeat", type=int, default=3,
                    help="Timed runs of every tool at every scale; the table gives the median (default 3).")
    ap.add_argument("--out", default=str(ROOT / "var" / "bench" / "dedup.json"))
    ap.add_argument("--corpus", default=None, help="C4 JSONL (default ../shared/data/corpus/c4_en_train_1k.jsonl).")
    args = ap.parse_args(argv)
    scales = [int(s) for s in args.scales.split(",")]
    tools = args.tools.split(",")

    t0 = time.perf_counter()
    base = build_corpus(Path(args.corpus) if args.corpus else None)
    kinds = {k: base.kinds.count(k) for k in sorted(set(base.kinds))}
    hist = np.histogram(base.pjac, bins=[0.5, 0.6, 0.7, 0.8, 0.9, 1.0001])[0].tolist()
    print(f"corpus 1×: {len(base)} docs {kinds}; pairs with J in [.5,.6,.7,.8,.9,1]: {hist} "
          f"(built in {time.perf_counter() - t0:.1f} s)", flush=True)

    spark, spark_start = (None, 0.0)
    if any(t.startswith("ours") for t in tools):
        spark, spark_start = start_spark()
        print(f"spark local[2] session start: {spark_start:.1f} s", flush=True)
        # warm-up on a small slice so the first measured run does not pay Python worker start-up
        with tempfile.TemporaryDirectory() as d:
            small = Corpus(base.ids[:200], base.texts[:200], base.kinds[:200])
            run_ours(spark, small, Path(d))
    rows = []
    for k in scales:
        c = scale_corpus(base, k)
        for tool in tools:
            times, extra = [], {}
            for _ in range(args.repeat):
                (cl, rm, st), secs = run_tool(tool, spark, c)
                times.append(secs)
                if st is not None:
                    extra.setdefault("phases_s", []).append(st["seconds"])
                    extra.update({k2: st[k2] for k2 in ("bands", "rows", "candidate_edges", "rejected_edges")})
            secs = float(np.median(times))
            if len(times) > 1:
                extra["runs_s"] = [round(t, 2) for t in times]
            q = evaluate(c, cl, rm) if (str(k) in args.quality_scales.split(",") or tool == "ours") else {}
            row = {"tool": tool, "scale": k, "docs": len(c), "seconds": round(secs, 2),
                   "docs_per_s": round(len(c) / secs, 1), **q, **extra}
            rows.append(row)
            print(_fmt_row(row), flush=True)
    result = {"machine": {"cpus": os.cpu_count()}, "corpus": {"docs_1x": len(base), "kinds": kinds,
              "pairs_hist_0.5_to_1": hist}, "spark_session_start_s": round(spark_start, 1),
              "num_perm": NUM_PERM, "ngram": NGRAM, "threshold": THRESHOLD, "rows": rows}
    print()
    print(table(result))
    atomic_write_text(args.out, json.dumps(result, indent=2))  # parents made, temp + rename
    print(f"\nwritten {args.out}")
    if spark is not None:
        spark.stop()
    return 0


LABELS = {"ours": "ours (Spark, LSH 0.6 + verify + cover)", "ours_min_idx": "ours, keeper min id",
          "datasketch": "datasketch MinHashLSH (opt. b×r)", "datasketch_16x8": "datasketch 16×8",
          "rensa": "rensa RMinHashLSH 16×8", "datatrove": "DataTrove MinHash 16×8",
          "oracle": "exact J≥0.8 components, min id"}


def _fmt_row(r: dict) -> str:
    q = (f" P={r['pair_precision']:.3f} R={r['pair_recall']:.3f} remP={r['removal_precision']:.3f} "
         f"remR={r['removal_recall']:.3f}") if "pair_precision" in r else ""
    return f"  {r['tool']:<16} {r['scale']:>3}× {r['docs']:>7} docs {r['seconds']:>8.2f} s {r['docs_per_s']:>9.0f} docs/s{q}"


def table(result: dict) -> str:
    rows = result["rows"]
    ours = {r["scale"]: r for r in rows if r["tool"] == "ours"}
    lines = ["| tool | scale | docs | docs/s | ours ÷ tool (docs/s) | pair P | pair R | R@.80-.85 | "
             "removal P | removal R |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o = ours.get(r["scale"])
        ratio = f"{o['docs_per_s'] / r['docs_per_s']:.2f}" if o and r["tool"] != "ours" else "—"
        if "pair_precision" in r:
            q = (f"{r['pair_precision']:.3f} | {r['pair_recall']:.3f} | "
                 f"{(r['recall_by_j'].get('0.80-0.85') or 0):.3f} | {r['removal_precision']:.3f} | "
                 f"{r['removal_recall']:.3f}")
        else:
            q = " | | | | "
        lines.append(f"| {LABELS.get(r['tool'], r['tool'])} | {r['scale']}× | {r['docs']:,} | "
                     f"{r['docs_per_s']:,.0f} | {ratio} | {q} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
