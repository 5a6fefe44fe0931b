"""The filter stage beside DataTrove's pipeline of the same rules (``data_bench.py --only filters``), in one run.

* **Corpus**: the growth table's 16× (``--growth-copies`` × 16 copies of the bundled samples, each copy's words
  shuffled per doc), every doc with a URL: its own (C4's, or the WET record's), with ``?copy=N`` after the first
  copy; one doc in 61 on a host of a block list of 50,000 generated domains (the domain itself, ``www.`` or a deeper
  host), one in 89 with a banned word of the bundled list in its path. Ingest and dedup run first, through their
  CLIs, untimed; both sides filter dedup's kept docs (DataTrove reads them re-split into 8 equal parquet files).
* **Ours**: ``python -m pipelines.data.filter`` on ``local[2]``, the steps ``url, gopher_repetition,
  gopher_quality, c4, fineweb`` (the language step off), the generated list as ``data.filters.url_blocklist``
  beside the bundled one, PII replaced in kept docs; kept and removed docs written as parquet.
* **DataTrove 0.10.1**: ``ParquetReader → URLFilter → GopherRepetitionFilter → GopherQualityFilter →
  C4QualityFilter → FineWebQualityFilter → PIIFormatter → ParquetWriter``, each filter with its parquet
  exclusion writer (ours writes its removed docs too), 2 tasks on 2 workers (``LocalPipelineExecutor``); the
  URL filter with the same domains and banned words, its integrated lists off, tldextract's bundled suffix list.
  Its English word tokenizer is spaCy's (``make bench`` installs it).
* Both as a child process, wall seconds from start to exit (imports, JVM or worker start included), peak RSS of
  the process tree; docs/s = docs in / wall s; s/GB = wall s / GB of the JSONL input.
* **Agreement per rule**: the docs each side's step removed (ours: the step of ``filter_reason``; DataTrove: the
  step's exclusion writer), as both / either (Jaccard); then the kept sets.

    python benchmarks/data_bench.py --only filters [--growth-copies 2 | --filter-copies N]   → var/bench/data.json ("filters")
"""
from __future__ import annotations

import os
import random
import string
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("url", "gopher_repetition", "gopher_quality", "c4", "fineweb")
BANNED = ROOT / "pipelines" / "data" / "lists" / "url_banned_words.txt"


def generated_blocklist(path: Path, n: int = 50_000) -> list[str]:
    """``n`` distinct made-up domains (seeded), one per line, as UT1's ``domains`` file."""
    rng, out = random.Random(7), {}
    while len(out) < n:
        name = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(6, 14)))
        out[f"{name}.{rng.choice(('com', 'net', 'org', 'info', 'xyz', 'co.uk'))}"] = None
    path.write_text("".join(f"{d}\n" for d in out), encoding="utf-8")
    return list(out)


def url_maker(blocked: list[str], banned: list[str]):
    def url(n: int, copy: int, original: str) -> str:
        if n % 61 == 0:
            host = ("", "www.", "cdn.media.")[n % 3] + blocked[n % len(blocked)]
            return f"https://{host}/page/{n}"
        if n % 89 == 0:
            return f"https://site{n}.example.org/{banned[n % len(banned)]}-videos/{n}"
        base = original or f"https://example.org/doc/{n}"
        return base if copy == 0 else f"{base}{'&' if '?' in base else '?'}copy={copy}"
    return url


def resplit(src: Path, dest: Path, files: int = 8) -> int:
    """dedup's kept parquet rewritten as ``files`` parquet files of equal rows (DataTrove's tasks split by file)."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    table = ds.dataset(str(src), format="parquet").to_table()
    dest.mkdir(parents=True)
    step = -(-table.num_rows // files)
    for k in range(files):
        pq.write_table(table.slice(k * step, step), dest / f"part-{k}.parquet")
    return table.num_rows


def datatrove_child(src: str, out: str, blocklist: str) -> int:
    """DataTrove's pipeline of the same rules over ``src``; kept docs and each filter's exclusions under ``out``."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter,
                                            GopherRepetitionFilter, URLFilter)
    from datatrove.pipeline.formatters import PIIFormatter
    from datatrove.pipeline.readers import ParquetReader
    from datatrove.pipeline.writers import ParquetWriter
    from tldextract import TLDExtract

    from pipelines.data.urlfilter import read_list

    def excluded(step: str) -> ParquetWriter:
        return ParquetWriter(f"{out}/removed/{step}")

    domains = sorted(read_list(Path(blocklist)) | read_list(ROOT / "pipelines/data/lists/url_blocklist.txt"))
    url = URLFilter(extra_domains=domains, banned_words=sorted(read_list(BANNED)), use_integrated_lists=False,
                    exclusion_writer=excluded("url"))
    url.tldextractor = TLDExtract(suffix_list_urls=())  # the suffix list bundled with tldextract: no download
    pipeline = [ParquetReader(src, glob_pattern="*.parquet"), url,
                GopherRepetitionFilter(exclusion_writer=excluded("gopher_repetition")),
                GopherQualityFilter(exclusion_writer=excluded("gopher_quality")),
                C4QualityFilter(exclusion_writer=excluded("c4")),
                FineWebQualityFilter(exclusion_writer=excluded("fineweb")),
                PIIFormatter(), ParquetWriter(f"{out}/kept")]
    LocalPipelineExecutor(pipeline, tasks=2, workers=2, logging_dir=f"{out}/logs").run()
    return 0


def ids(folder: Path) -> set[str]:
    import pyarrow.dataset as ds

    if not folder.exists():  # a step that removed nothing wrote nothing
        return set()
    return {str(x) for x in ds.dataset(str(folder), format="parquet").to_table(columns=["id"]).column("id").to_pylist()}


def agreement(ours: Path, theirs: Path) -> dict:
    """Per step, the docs removed by ours and by DataTrove, both and either; then the kept docs."""
    import pyarrow.dataset as ds

    removed = ds.dataset(str(ours / "removed"), format="parquet").to_table(columns=["id", "filter_reason"])
    ours_by = {s: set() for s in STEPS}
    for i, reason in zip(removed.column("id").to_pylist(), removed.column("filter_reason").to_pylist()):
        ours_by.setdefault(reason.split(".")[0].split(":")[0], set()).add(str(i))
    rows = {}
    for step in STEPS:
        a, b = ours_by[step], ids(theirs / "removed" / step)
        rows[step] = {"ours": len(a), "datatrove": len(b), "both": len(a & b), "either": len(a | b)}
    a, b = ids(ours / "kept"), ids(theirs / "kept")
    rows["kept"] = {"ours": len(a), "datatrove": len(b), "both": len(a & b), "either": len(a | b)}
    return rows


def run(args, work: Path, jsonl_corpus, measured_run, run_stages) -> dict:
    """Corpus, ingest and dedup (untimed), then our filter stage and DataTrove's pipeline, one after the other."""
    from pipelines.manifest import load_manifest

    os.sched_setaffinity(0, {0, 1} & os.sched_getaffinity(0) or os.sched_getaffinity(0))  # the same cores both
    data, home = work / "jsonl", work / "home"
    data.mkdir(parents=True)
    home.mkdir()
    blocked = generated_blocklist(work / "blocklist.txt")
    copies = args.filter_copies or args.growth_copies * 16
    docs = jsonl_corpus(data, copies, unique=True, urls=url_maker(blocked, sorted(_banned())))
    gb = sum(f.stat().st_size for f in data.iterdir()) / 1e9
    env = {**os.environ, "LLMP_HOME": str(home), "LLMP_PROGRESS": "0"}
    sets = ["--set", "services.spark_master=local[2]"]
    run_stages(("ingest", "dedup"), data, home, sets, env, "filters")
    prev = home / "out" / "dedup"
    n_in = resplit(load_manifest(prev / "manifest.json").output("kept"), work / "dt-in")
    ours = home / "out" / "filter"
    cmd = [sys.executable, "-m", "pipelines.data.filter", "--output", str(ours), "--input-manifest",
           str(prev / "manifest.json"), *sets, "--set", f"data.filters.steps=[{','.join(STEPS)}]",
           "--set", f"data.filters.url_blocklist={work / 'blocklist.txt'}"]
    res = {"corpus": {"copies": copies, "docs": docs, "gb": round(gb, 4), "docs_in": n_in},
           "cpus": sorted(os.sched_getaffinity(0))}
    res["ours"] = measured_run(cmd, env)
    print(f"filters: ours {res['ours']}", flush=True)
    theirs = work / "dt-out"
    res["datatrove"] = measured_run([sys.executable, __file__, "--datatrove-child", str(work / "dt-in"), str(theirs),
                                     str(work / "blocklist.txt")], env)
    print(f"filters: datatrove {res['datatrove']}", flush=True)
    res["agreement"] = agreement(ours, theirs)
    return res


def _banned() -> set[str]:
    from pipelines.data.urlfilter import read_list

    return read_list(BANNED)


def table(r: dict) -> str:
    c, o, d = r["corpus"], r["ours"], r["datatrove"]
    ours_rate, dt_rate = c["docs_in"] / o["s"], c["docs_in"] / d["s"]
    lines = [f"Filter stage on {c['docs_in']:,} docs (dedup's kept of {c['docs']:,}: {c['copies']} copies of the "
             f"samples, {c['gb'] * 1000:.0f} MB of JSONL), the language step off on both sides, on CPUs {r['cpus']}, "
             "one run. PII: ours e-mail, IP and phone numbers, DataTrove's formatter e-mail and IP only:", "",
             "| measure | ours (filter stage, local[2]) | DataTrove 0.10.1 (2 tasks, 2 workers) | ours / DataTrove | "
             "target |", "|---|---|---|---|---|",
             f"| wall s | {o['s']} | {d['s']} | | |",
             f"| docs/s | {ours_rate:,.0f} | {dt_rate:,.0f} | {ours_rate / dt_rate:.2f}× | ≥ 4× |",
             f"| s per GB of input | {o['s'] / c['gb']:,.0f} | {d['s'] / c['gb']:,.0f} | | ours ≤ 400 |",
             f"| peak RSS MB (driver / JVM / workers) | {o['driver_mb']} / {o['jvm_mb']} / {o['workers_mb']} | "
             f"{d['driver_mb']} / — / {d['workers_mb']} | | |", "",
             "| step | removed by ours | by DataTrove | both | either | agreement (both / either) |",
             "|---|---|---|---|---|---|"]
    for step, a in r["agreement"].items():
        label = "**kept**" if step == "kept" else step
        lines.append(f"| {label} | {a['ours']:,} | {a['datatrove']:,} | {a['both']:,} | {a['either']:,} | "
                     f"{a['both'] / max(1, a['either']):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--datatrove-child"]:
        sys.path.insert(0, str(ROOT))
        sys.exit(datatrove_child(*sys.argv[2:5]))
    sys.exit("run it as: python benchmarks/data_bench.py --only filters")
