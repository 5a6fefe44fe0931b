"""Lineage: what a registered model saw, and which corpus versions and models hold a doc or a source.

    python -m pipelines.lineage --model NAME@ALIAS|NAME/VERSION [--json]
    python -m pipelines.lineage --doc ID [--json] [--strict]
    python -m pipelines.lineage --source KEY|URL-PREFIX [--json] [--strict]
    python -m pipelines.lineage --exclude-source KEY|URL-PREFIX --reason TEXT [--json] [--strict]

The command line of :mod:`pipelines.lineage` (its modules: where lineage and takedown live):

* ``--model``: the corpus version, its inputs (key, bytes, sha256 of the bytes read, the listing identity the stage
  key holds, the version that added it) and docs per source;
* ``--doc ID``: every corpus version that holds the doc, with its shards, and every registered version trained on
  one of them;
* ``--source KEY``: an input's key as ingest records it (``data/sample/c4_en_train_1k.jsonl.gz``; ``./…``, the
  absolute path or another Unicode spelling name the same key), or a URL prefix (``https://example.com/``: the URLs
  at or under it, at a host or path boundary): every corpus version that holds docs of it (how many, in which
  shards) and every registered version trained on one of them;
* ``--exclude-source``: takedown: the source goes on the takedown list with its reason, the next curation run
  publishes a corpus version without its docs (rewriting only the shards that held them), and every registered
  version trained on a version that held them is tagged ``takedown.pending``.

A query or takedown that no corpus version holds anything of prints a warning and exits 0; with ``--strict`` it exits
1 (a takedown is then not recorded). A bad source or reason, an unknown model: exit 2 with one line. A takedown list
whose lock is still held after ``LOCK_WAIT_S`` (a line names the holder), or that cannot be locked, read or written:
exit 75 with one line, nothing recorded (run it again). A corpus version that cannot be looked into is listed under
``unreadable``, the rest of the answer printed, and the command ends with one line naming it: exit 75 when storage did
not return it (run it again), 2 when it is damaged (its shards or lineage do not read): never 0 over a version it
could not look into (a takedown is recorded all the same, and the registered versions trained on it are not tagged).
"""
from __future__ import annotations

import argparse
import json
import sys

from pipelines.exit_codes import RETRY, USER_ERROR
from pipelines.lineage.queries import (NothingMatched, doc_query, exclude_source, incomplete, model_query,
                                      nothing_matched, source_query)
from pipelines.lineage.takedowns import TAG
from pipelines.manifest import StageError
from pipelines.spec import add_spec_args, spec_from_args
from pipelines.tracking import client, mlflow_answered, mlflow_error


def _text(res: dict) -> str:
    lines = []
    if "model" in res:
        m, c = res["model"], res["corpus"]
        lines.append(f"{m['name']} v{m['version']} {m['aliases']} ← corpus v{c['version']} ({c['docs']} docs, "
                     f"{c['tokens']} tokens) {c['manifest']}")
        lines += [f"  input {i['key']} ({i['bytes']} bytes, sha256 {(i['sha256'] or 'not recorded')[:12]}, "
                  f"corpus v{i['corpus_version']})" for i in res["inputs"]]
        lines += [f"  {n:>8} docs from {s}" for s, n in res["docs_per_source"].items()]
        return "\n".join(lines)
    if "exclusion" in res:
        e = res["exclusion"]
        lines.append(f"{e['source']}: {'excluded' if e['added'] else 'excluded already'} ({e['reason']}; {e['list']}); "
                     f"held by {len(res['corpus_versions'])} corpus version(s); the next curation run publishes a "
                     "version without its docs")
        lines += [f"  tagged {TAG}: {m['name']} v{m['version']}" for m in res["models_tagged"]]
        lines += [f"  unreadable: {u['manifest']}: {u['error']}" for u in res.get("unreadable", [])]
        return "\n".join(lines)
    what = res.get("doc") or res.get("source")
    lines.append(f"{what}: in {len(res['corpus_versions'])} corpus version(s), {len(res['models'])} registered model "
                 f"version(s)")
    lines += [f"  corpus v{v['version']} {v['manifest']}: shards {', '.join(v['shards'])}" for v in res["corpus_versions"]]
    lines += [f"  model {m['name']} v{m['version']} {m['aliases']}" for m in res["models"]]
    lines += [f"  unreadable: {u['manifest']}: {u['error']}" for u in res.get("unreadable", [])]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pipelines.lineage", description=__doc__.split("\n\n")[0])
    q = ap.add_mutually_exclusive_group(required=True)
    q.add_argument("--model", metavar="NAME@ALIAS|NAME/VERSION", help="what a registered version was trained on")
    q.add_argument("--doc", metavar="ID", help="the corpus versions, shards and models that hold a doc")
    q.add_argument("--source", metavar="KEY|URL-PREFIX", help="the corpus versions, shards and models that hold a source")
    q.add_argument("--exclude-source", metavar="KEY|URL-PREFIX", help="takedown: the next curation run publishes a "
                   f"corpus version without this source's docs; registered versions that saw them are tagged {TAG}")
    ap.add_argument("--reason", metavar="TEXT", help="why the source is excluded (required with --exclude-source)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--strict", action="store_true", help="exit 1 when no corpus version holds the doc or source (a "
                    "takedown is then not recorded); without it, a warning and exit 0")
    add_spec_args(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.exclude_source is not None and not (args.reason or "").strip():
        ap.error("--exclude-source needs --reason TEXT (the takedown list keeps why each source left the corpus)")
    spec = spec_from_args(args)

    try:
        c = client(spec)
        res = (model_query(spec, c, args.model) if args.model is not None
               else doc_query(spec, c, args.doc) if args.doc is not None
               else source_query(spec, c, args.source) if args.source is not None
               else exclude_source(spec, c, args.exclude_source, args.reason, strict=args.strict))
    except NothingMatched as e:
        print(f"lineage: {e}", file=sys.stderr)
        return 1
    except StageError as e:  # 2: the source, reason or model must be fixed; 75: the takedown list is busy (retry)
        print(f"lineage: error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # MLflow: no such model / alias (2), or the server did not answer (75)
        if not mlflow_error(e):
            raise
        print(f"lineage: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return USER_ERROR if mlflow_answered(e) else RETRY
    print(json.dumps(res, indent=1) if args.json else _text(res))
    warning = nothing_matched(res, spec.run.root)
    if warning:
        print(f"lineage: warning: {warning}", file=sys.stderr)
    if short := incomplete(res):  # not 0 over a version it could not look into
        print(f"lineage: error: {short[1]}", file=sys.stderr)
        return short[0]
    return 1 if warning and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
