"""Lineage: what a registered model saw, and which corpus versions and models hold a doc or a source.

    python -m pipelines.lineage --model NAME@ALIAS|NAME/VERSION [--json]
    python -m pipelines.lineage --doc ID [--json]
    python -m pipelines.lineage --source KEY|URL-PREFIX [--json]
    python -m pipelines.lineage --exclude-source KEY|URL-PREFIX --reason TEXT [--json]

Everything is read from what the stages already record: a registered version's ``data_manifest_hash`` tag is the
digest of the tokenize manifest it was trained on (a *corpus version*); a corpus version names the one it extends
(``extra.corpus.previous``), its stages' manifests (``lineage``) name the ingested inputs (key, size, sha256), the docs
each version added are the decontaminate (or filter) stage's kept docs (with ``source`` and ``url``), and every
shard has its doc ids beside it (``<shard>.ids.parquet``). The corpus versions are those under ``run.root``.

* ``--model``: the corpus version, its inputs (key, bytes, sha256, the version that added it) and docs per source;
* ``--doc ID``: every corpus version that holds the doc, with its shards, and every registered version trained on
  one of them;
* ``--source KEY``: an input's key as ingest records it (``data/sample/c4_en_train_1k.jsonl.gz``), or a URL prefix
  (``https://example.com/``; a plain prefix: end it with ``/`` to mean one host): every corpus version that holds
  docs of it (how many, in which shards) and every registered version trained on one of them.

* ``--exclude-source``: takedown (:mod:`pipelines.data.takedown`): the source goes on the takedown list with its
  reason, the next curation run publishes a corpus version without its docs (rewriting only the shards that held
  them), and every registered version trained on a version that held them is tagged ``takedown.pending``.

A corpus version that cannot be read is listed under ``unreadable`` instead of ending a ``--doc``/``--source`` query.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Iterable, Optional

from pipelines.data import takedown
from pipelines.data.takedown import Matcher
from pipelines.manifest import Manifest, StageError, lineage, load_manifest
from pipelines.spec import JobSpec, add_spec_args, resolve_path, spec_from_args


# -- corpus versions --------------------------------------------------------------------------------------------------

def corpus_versions(spec: JobSpec) -> list[Manifest]:
    """Every committed tokenize manifest under ``run.root``, oldest version first."""
    found = []
    for p in sorted((resolve_path(spec.run.root) / "tokenize").glob("*/manifest.json")):
        try:
            found.append(load_manifest(p))
        except (OSError, ValueError):
            continue  # a half-written or foreign file: not a corpus version
    return sorted(found, key=lambda m: (m.extra.get("corpus", {}).get("version", 0), str(m.path)))


def chain(tok: Manifest) -> list[Manifest]:
    """``tok`` and the versions it extends, newest first."""
    out, seen = [tok], {str(tok.path)}
    while (prev := out[-1].extra.get("corpus", {}).get("previous")) and prev not in seen:
        seen.add(prev)
        try:
            out.append(load_manifest(prev))
        except (OSError, ValueError) as e:
            raise StageError(f"{out[-1].path}: the corpus version it extends, {prev}, cannot be read ({e})") from None
    return out


def _stage(tok: Manifest, stage: str) -> Optional[Manifest]:
    path = lineage(tok.path).get(stage)
    return load_manifest(path) if path else None


def added_docs(tok: Manifest, columns: list[str], where=None):
    """The docs this version added (the decontaminate stage's kept docs, else the filter stage's), as an Arrow table
    of ``columns`` that exist (the rows ``where``, a pyarrow expression, holds for)."""
    import pyarrow.dataset as ds

    up = _stage(tok, "decontaminate") or _stage(tok, "filter")
    if up is None:
        raise StageError(f"{tok.path}: no filter or decontaminate stage in its lineage")
    data = ds.dataset(str(up.output("kept")), format="parquet")
    return data.to_table(columns=[c for c in columns if c in data.schema.names], filter=where)


def inputs_of(tok: Manifest) -> list[dict]:
    """The inputs of the corpus version: each ingested file (key, bytes, sha256) with the version that added it."""
    out, seen = [], set()
    for v in reversed(chain(tok)):
        ing = _stage(v, "ingest")
        for i in ing.inputs if ing else []:
            held = v.extra.get("corpus", {}).get("inputs", [])
            if "stage" in i or i["sha256"] in seen or i["sha256"] not in held:
                continue
            seen.add(i["sha256"])
            out.append({"key": i.get("key") or i["uri"], "bytes": i.get("bytes"), "sha256": i["sha256"],
                        "corpus_version": v.extra["corpus"].get("version")})
    return out


def docs_per_source(tok: Manifest) -> dict[str, int]:
    from collections import Counter

    counts = Counter()
    for v in chain(tok):
        counts.update(added_docs(v, ["source"]).column("source").to_pylist())
    return dict(sorted(counts.items()))


def shards_holding(tok: Manifest, ids: set[str]) -> dict[str, int]:
    """{shard prefix: how many of ``ids`` it holds} over the version's shards (the ones it links from earlier
    versions included)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out = {}
    for sh in tok.extra.get("shards", []):
        col = pq.read_table(tok.dir / (sh["prefix"] + ".ids.parquet"), columns=["id"]).column("id")
        n = int(pc.sum(pc.is_in(col, value_set=_array(ids))).as_py() or 0)
        if n:
            out[sh["prefix"]] = n
    return out


def _array(ids: Iterable[str]):
    import pyarrow as pa

    return pa.array(sorted(ids), pa.string())


# -- registered versions ----------------------------------------------------------------------------------------------

def _version_info(mv) -> dict:
    return {"name": mv.name, "version": str(mv.version), "aliases": list(getattr(mv, "aliases", []) or []),
            "run_id": mv.run_id, "corpus_digest": (mv.tags or {}).get("data_manifest_hash")}


def resolve_model(client, ref: str):
    """``NAME@ALIAS`` or ``NAME/VERSION`` → the model version."""
    if "@" in ref:
        name, alias = ref.rsplit("@", 1)
        return client.get_model_version_by_alias(name, alias)
    if "/" in ref:
        name, version = ref.rsplit("/", 1)
        return client.get_model_version(name, version)
    raise StageError(f"--model {ref!r}: write NAME@ALIAS (e.g. llm-pipeline-demo@champion) or NAME/VERSION")


def models_trained_on(client, digests: set[str]) -> list[dict]:
    """Every registered version whose corpus version is one of ``digests``."""
    out, token = [], None
    while True:  # every version of every model, a page at a time (no filter string: names are data)
        page = client.search_model_versions(max_results=1000, page_token=token)
        for mv in page:
            if (mv.tags or {}).get("data_manifest_hash") in digests:
                out.append(_version_info(client.get_model_version(mv.name, mv.version)))
        token = page.token
        if not token:
            return sorted(out, key=lambda m: (m["name"], int(m["version"])))


# -- the three questions ----------------------------------------------------------------------------------------------

def model_query(spec: JobSpec, client, ref: str) -> dict:
    mv = resolve_model(client, ref)
    info = _version_info(mv)
    tok = next((v for v in corpus_versions(spec) if v.digest == info["corpus_digest"]), None)
    try:
        return _model_answer(info, tok, spec, ref)
    except (OSError, KeyError, ValueError) as e:
        raise StageError(f"{ref}: its corpus version cannot be read ({e})") from None


def _model_answer(info: dict, tok: Optional[Manifest], spec: JobSpec, ref: str) -> dict:
    if tok is None:
        raise StageError(f"{ref}: its corpus version (tokenize manifest digest {str(info['corpus_digest'])[:12]}) is not "
                         f"under run.root={spec.run.root}; point --set run.root=… at the runs that trained it")
    return {"model": info, "corpus": _corpus_info(tok), "inputs": inputs_of(tok), "docs_per_source": docs_per_source(tok)}


def _corpus_info(tok: Manifest) -> dict:
    return {"manifest": str(tok.path), "version": tok.extra.get("corpus", {}).get("version"),
            "digest": tok.digest, "docs": tok.counts.get("docs"), "tokens": tok.counts.get("tokens")}


def _each_version(spec: JobSpec, fn) -> tuple[list[dict], list[dict]]:
    """``fn(tok)`` (a dict, or None when the version does not hold what is asked) for every corpus version; a version
    that cannot be read is listed as unreadable instead of ending the query."""
    found, unreadable = [], []
    for tok in corpus_versions(spec):
        try:
            r = fn(tok)
        except (StageError, OSError, KeyError, ValueError) as e:
            unreadable.append({"manifest": str(tok.path), "error": str(e).splitlines()[0] if str(e) else repr(e)})
            continue
        if r is not None:
            found.append({**_corpus_info(tok), **r})
    return found, unreadable


def doc_query(spec: JobSpec, client, doc_id: str) -> dict:
    def holds(tok):
        shards = shards_holding(tok, with_tails({doc_id}))
        return {"shards": sorted(shards)} if shards else None

    versions, unreadable = _each_version(spec, holds)
    return {"doc": doc_id, "corpus_versions": versions,
            "models": models_trained_on(client, {v["digest"] for v in versions}) if versions else [],
            "unreadable": unreadable}


def with_tails(ids: set[str]) -> set[str]:
    """``ids`` and the ``<id>#tail`` entry each may have in the shards (a one-doc input held out by tail)."""
    return ids | {f"{i}#tail" for i in ids}


def matching_ids(tok: Manifest, matcher: Matcher) -> set[str]:
    """Shard entries of ``tok`` (its chain) that ``matcher`` takes: docs of an excluded source, or under a URL
    prefix (with their ``#tail`` entries)."""
    ids: set[str] = set()
    for v in chain(tok):
        t = added_docs(v, ["id", "source", "url"])
        ids.update(t.filter(matcher.mask(t)).column("id").to_pylist())
    return with_tails(ids)


def source_query(spec: JobSpec, client, source: str) -> dict:
    def holds(tok):
        shards = shards_holding(tok, matching_ids(tok, Matcher([source])))  # a version it was taken out of: none
        return {"source_docs": sum(shards.values()), "shards": shards} if shards else None

    versions, unreadable = _each_version(spec, holds)
    return {"source": source, "corpus_versions": versions,
            "models": models_trained_on(client, {v["digest"] for v in versions}) if versions else [],
            "unreadable": unreadable}


def pending_takedowns(spec: JobSpec, digest: str | None) -> Optional[list[takedown.Exclusion]]:
    """The exclusions of the takedown list whose docs the corpus version ``digest`` still holds; None when there are
    exclusions but that version is not under run.root (nothing can be said)."""
    exclusions = takedown.load(resolve_path(spec.data.exclusions))
    if not exclusions:
        return []
    tok = next((v for v in corpus_versions(spec) if v.digest == digest), None) if digest else None
    if tok is None:
        return None
    return [e for e in exclusions if shards_holding(tok, matching_ids(tok, Matcher([e])))]


def exclude_source(spec: JobSpec, client, source: str, reason: str) -> dict:
    """Add ``source`` to the takedown list (``data.exclusions``) and tag every registered version trained on a corpus
    version that holds it; the next curation run publishes a version without its docs."""
    path = resolve_path(spec.data.exclusions)
    try:
        rec, added = takedown.add(path, source, reason)
    except ValueError as e:
        raise StageError(f"--exclude-source {source!r}: {e}") from None
    try:
        held = source_query(spec, client, rec.source)
        tagged = takedown.tag_versions(client, held["models"], rec)
    except Exception as e:  # noqa: BLE001 - MLflow or a corpus version: the exclusion itself is recorded
        raise StageError(f"the exclusion of {rec.source!r} is recorded in {path}, but tagging the registered versions "
                         f"that saw it failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); run "
                         "the same command again to tag them") from None
    return {"exclusion": {**rec.__dict__, "list": str(path), "added": added}, "corpus_versions": held["corpus_versions"],
            "models_tagged": [{k: m[k] for k in ("name", "version")} for m in tagged], "unreadable": held["unreadable"]}


# -- CLI --------------------------------------------------------------------------------------------------------------

def _text(res: dict) -> str:
    lines = []
    if "model" in res:
        m, c = res["model"], res["corpus"]
        lines.append(f"{m['name']} v{m['version']} {m['aliases']} ← corpus v{c['version']} ({c['docs']} docs, "
                     f"{c['tokens']} tokens) {c['manifest']}")
        lines += [f"  input {i['key']} ({i['bytes']} bytes, sha256 {i['sha256'][:12]}, corpus v{i['corpus_version']})"
                  for i in res["inputs"]]
        lines += [f"  {n:>8} docs from {s}" for s, n in res["docs_per_source"].items()]
        return "\n".join(lines)
    if "exclusion" in res:
        e = res["exclusion"]
        lines.append(f"{e['source']}: {'excluded' if e['added'] else 'excluded already'} ({e['reason']}; {e['list']}); "
                     f"held by {len(res['corpus_versions'])} corpus version(s); the next curation run publishes a "
                     "version without its docs")
        lines += [f"  tagged {takedown.TAG}: {m['name']} v{m['version']}" for m in res["models_tagged"]]
        return "\n".join(lines)
    what = res.get("doc") or res.get("source")
    lines.append(f"{what}: in {len(res['corpus_versions'])} corpus version(s), {len(res['models'])} registered model "
                 f"version(s)")
    lines += [f"  corpus v{v['version']} {v['manifest']}: shards {', '.join(v['shards'])}" for v in res["corpus_versions"]]
    lines += [f"  model {m['name']} v{m['version']} {m['aliases']}" for m in res["models"]]
    lines += [f"  unreadable: {u['manifest']}: {u['error']}" for u in res.get("unreadable", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.lineage", description=__doc__.split("\n\n")[0])
    q = ap.add_mutually_exclusive_group(required=True)
    q.add_argument("--model", metavar="NAME@ALIAS|NAME/VERSION", help="what a registered version was trained on")
    q.add_argument("--doc", metavar="ID", help="the corpus versions, shards and models that hold a doc")
    q.add_argument("--source", metavar="KEY|URL-PREFIX", help="the corpus versions, shards and models that hold a source")
    q.add_argument("--exclude-source", metavar="KEY|URL-PREFIX", help="takedown: the next curation run publishes a "
                   "corpus version without this source's docs; registered versions that saw them are tagged "
                   f"{takedown.TAG}")
    ap.add_argument("--reason", metavar="TEXT", help="why the source is excluded (required with --exclude-source)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    add_spec_args(ap)
    args = ap.parse_args(argv)
    if args.exclude_source is not None and not (args.reason or "").strip():
        ap.error("--exclude-source needs --reason TEXT (the takedown list keeps why each source left the corpus)")
    spec = spec_from_args(args)
    from pipelines.tracking import client

    try:
        c = client(spec)
        res = (model_query(spec, c, args.model) if args.model else doc_query(spec, c, args.doc) if args.doc
               else source_query(spec, c, args.source) if args.source is not None
               else exclude_source(spec, c, args.exclude_source, args.reason))
    except StageError as e:
        print(f"lineage: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # MLflow: no such model / alias
        if type(e).__name__ != "MlflowException":
            raise
        print(f"lineage: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1) if args.json else _text(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
