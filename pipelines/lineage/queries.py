"""Lineage queries: the corpus versions under ``run.root`` and what each added, what a registered model saw
(:func:`model_query`), which versions and models hold a doc (:func:`doc_query`) or a source (:func:`source_query`),
and a source taken down (:func:`exclude_source`)."""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq


from pipelines.exit_codes import RETRY, USER_ERROR
from pipelines.lineage.keys import Exclusion, Matcher, source_key
from pipelines.lineage.takedowns import add, read_list, split_by_exclusion, tag_versions
from pipelines.listing import strict_glob
from pipelines.manifest import Manifest, StageError, lineage, load_manifest
from pipelines.spec import JobSpec, resolve_path
from pipelines.storage import oserrors
from pipelines.tracking import mlflow_outage, model_versions


class NothingMatched(StageError):
    """A ``--strict`` query or takedown that no corpus version holds anything of (exit 1)."""

    exit_code = 1


class CorpusNotFound(StageError):
    """A registered version whose corpus version is not under ``run.root`` (exit 2: point run.root at its runs)."""


def storage_error(e: Exception) -> bool:
    """Whether ``e`` is storage's (a retry may read it), not a missing, forged, refused or damaged file's
    (:mod:`pipelines.storage.oserrors`)."""
    return isinstance(e, VersionUnreadable) or oserrors.storage_failing(e)


class VersionUnreadable(StageError):
    """A corpus version's manifest that storage did not return (an I/O error, not a missing or damaged file):
    exit 75 (``RETRY``: orchestrators retry it)."""

    exit_code = RETRY


def corpus_versions(spec: JobSpec) -> list[Manifest]:
    """Every committed tokenize manifest under ``run.root``, oldest version first."""
    found = []
    for p in _manifest_paths(resolve_path(spec.run.root) / "tokenize"):
        try:
            found.append(load_manifest(p))
        except OSError as e:
            if storage_error(e):  # not a missing file: a version that may hold what is asked
                raise VersionUnreadable(f"{p} could not be read now ({e}); run it again") from None
            if oserrors.refused(e):  # a version all the same, which no retry reads: never passed over
                raise StageError(f"{p} cannot be read ({e.strerror}): a corpus version this query must read; give "
                                 "this user read access to it (or remove the version) and run it again") from None
        except ValueError:
            continue  # a half-written or foreign file: not a corpus version
    return sorted(found, key=lambda m: (m.extra.get("corpus", {}).get("version", 0), str(m.path)))


def _manifest_paths(root) -> list:
    """``root/*/manifest.json``; a folder that cannot be listed is never passed over (``Path.glob`` drops the ones
    this user may not read): 75 for storage's error, 2 for a refusal."""
    try:
        return strict_glob("*/manifest.json", root)
    except OSError as e:
        if storage_error(e):
            raise VersionUnreadable(f"{e.filename or root} could not be listed now ({e}); run it again") from None
        raise StageError(f"{e.filename or root} cannot be listed ({e.strerror}): it may hold corpus versions this "
                         "query must read; give this user read access to it and run it again") from None


def chain(tok: Manifest) -> list[Manifest]:
    """``tok`` and the versions it extends, newest first."""
    out, seen = [tok], {str(tok.path)}
    while prev := previous_version(out[-1]):
        if prev in seen:
            break
        seen.add(prev)
        try:
            out.append(load_manifest(prev))
        except (ValueError, OSError) as e:
            if storage_error(e):  # storage, not the corpus
                raise VersionUnreadable(f"{out[-1].path}: the corpus version it extends, {prev}, could not be read "
                                        f"now ({e}); the task's retry reads it again") from None
            raise StageError(f"{out[-1].path}: the corpus version it extends, {prev}, cannot be read ({e})") from None
    return out


def previous_version(tok: Manifest) -> Optional[str]:
    """The manifest path of the version ``tok`` extends (None for a first version)."""
    corpus = tok.extra.get("corpus")
    prev = corpus.get("previous") if isinstance(corpus, dict) else None
    if prev is not None and not isinstance(prev, str):
        raise StageError(f"{tok.path}: extra.corpus.previous is {prev!r}, not the path of a manifest")
    return prev


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
    """The inputs of the corpus version: each ingested file (key, bytes, sha256, identity) with the version that
    added it. ``sha256`` is the digest of the bytes ingest's tasks read (``extra.input_sha256``: the file's sha256
    when one task read it, else the sha256 of its ranges' digests in order; None in a manifest without it);
    ``identity`` is what the stage key holds: the sha256 of key, size and mtime or ETag, from the listing."""
    out, seen = [], set()
    for v in reversed(chain(tok)):
        ing = _stage(v, "ingest")
        read = (ing.extra.get("input_sha256") or {}) if ing else {}
        for i in ing.inputs if ing else []:
            held = v.extra.get("corpus", {}).get("inputs", [])
            if "stage" in i or i["sha256"] in seen or i["sha256"] not in held:
                continue
            seen.add(i["sha256"])
            key = i.get("key") or i["uri"]
            out.append({"key": key, "bytes": i.get("bytes"), "sha256": read.get(key), "identity": i["sha256"],
                        "corpus_version": v.extra["corpus"].get("version")})
    return out


def docs_per_source(tok: Manifest) -> dict[str, int]:
    counts = Counter()
    for v in chain(tok):
        counts.update(added_docs(v, ["source"]).column("source").to_pylist())
    return dict(sorted(counts.items()))


def held_in_shards(tok: Manifest, ids: set[str]):
    """(shard prefix, the entries of ``ids`` it holds) for each of the version's shards (the ones it links from
    earlier versions included) that holds any."""
    wanted = pa.array(sorted(ids), pa.string())
    for sh in tok.extra.get("shards", []):
        col = pq.read_table(tok.dir / (sh["prefix"] + ".ids.parquet"), columns=["id"]).column("id")
        got = col.filter(pc.is_in(col, value_set=wanted))
        if len(got):
            yield sh["prefix"], got


def shards_holding(tok: Manifest, ids: set[str]) -> dict[str, int]:
    """{shard prefix: how many of ``ids`` it holds} over the version's shards."""
    return {prefix: len(got) for prefix, got in held_in_shards(tok, ids)}


def with_tails(ids: Iterable[str]) -> set[str]:
    """``ids`` and the ``<id>#tail`` entry each may have in the shards (a one-doc input held out by tail)."""
    ids = set(ids)
    return ids | {f"{i}#tail" for i in ids}


def matching_ids(tok: Manifest, matcher: Matcher) -> list[set[str]]:
    """Per source of ``matcher``, the shard entries of ``tok`` (its chain) it takes (with their ``#tail`` entries):
    each version's added docs read and their keys normalised once for all the sources."""
    out: list[set[str]] = [set() for _ in matcher.keys]
    for v in chain(tok):
        t = added_docs(v, ["id", "source", "url"])
        for ids, hit in zip(out, matcher.masks(t)):
            ids.update(t.filter(hit).column("id").to_pylist())
    return [with_tails(ids) for ids in out]


def excluded_docs(corpus: Manifest, exclusions: tuple[Exclusion, ...]) -> dict[str, int]:
    """The shard entries of a corpus version (its chain) that the takedown list takes out: doc id (and the
    ``<id>#tail`` part of a one-doc input held out by tail) → the index of the first exclusion that takes it."""
    out: dict[str, int] = {}
    for v in chain(corpus):
        for k, part in split_by_exclusion(added_docs(v, ["id", "source", "url"]), exclusions):
            for i in with_tails(part.column("id").to_pylist()):
                out.setdefault(i, k)
    return out


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
    # every version of every model (no filter string: names are data)
    out = [_version_info(client.get_model_version(mv.name, mv.version)) for mv in model_versions(client)
           if (mv.tags or {}).get("data_manifest_hash") in digests] if digests else []
    return sorted(out, key=lambda m: (m["name"], int(m["version"])))


def model_query(spec: JobSpec, client, ref: str) -> dict:
    mv = resolve_model(client, ref)
    info = _version_info(mv)
    tok = next((v for v in corpus_versions(spec) if v.digest == info["corpus_digest"]), None)
    try:
        return _model_answer(info, tok, spec, ref)
    except (OSError, KeyError, ValueError) as e:
        raise (VersionUnreadable if storage_error(e) else StageError)(
            f"{ref}: its corpus version cannot be read ({e})") from None


def _model_answer(info: dict, tok: Optional[Manifest], spec: JobSpec, ref: str) -> dict:
    if tok is None:
        raise CorpusNotFound(f"{ref}: its corpus version (tokenize manifest digest {str(info['corpus_digest'])[:12]}) is not "
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
            unreadable.append({"manifest": str(tok.path), "error": str(e).splitlines()[0] if str(e) else repr(e),
                               "storage": storage_error(e)})
            continue
        if r is not None:
            found.append({**_corpus_info(tok), **r})
    return found, unreadable


def _digests(versions: list[dict]) -> set[str]:
    return {v["digest"] for v in versions}


def doc_query(spec: JobSpec, client, doc_id: str) -> dict:
    def holds(tok):
        shards = shards_holding(tok, with_tails({doc_id}))
        return {"shards": sorted(shards)} if shards else None

    versions, unreadable = _each_version(spec, holds)
    return {"doc": doc_id, "corpus_versions": versions, "models": models_trained_on(client, _digests(versions)),
            "unreadable": unreadable}


def _source_key(source: str, flag: str) -> str:
    try:
        return source_key(source)
    except ValueError as e:
        raise StageError(f"{flag}: {e}") from None


def source_holders(spec: JobSpec, key: str) -> tuple[list[dict], list[dict]]:
    """The corpus versions that hold docs of ``key`` (a :func:`source_key`), and those that cannot be read."""
    matcher = Matcher([key])

    def holds(tok):
        shards = shards_holding(tok, matching_ids(tok, matcher)[0])  # a version it was taken out of: none
        return {"source_docs": sum(shards.values()), "shards": shards} if shards else None

    return _each_version(spec, holds)


def source_query(spec: JobSpec, client, source: str) -> dict:
    """``source`` (a key or URL prefix as given) normalised; the answer names the key it compared (``source``)."""
    key = _source_key(source, "--source")
    versions, unreadable = source_holders(spec, key)
    return {"source": key, "corpus_versions": versions, "models": models_trained_on(client, _digests(versions)),
            "unreadable": unreadable}


def pending_takedowns(spec: JobSpec, digest: str | None, tok: Optional[Manifest] = None) -> Optional[list[Exclusion]]:
    """The exclusions of the takedown list whose docs the corpus version ``digest`` (the tokenize manifest ``tok``
    when the caller holds it, wherever it lives) still holds; None when there are exclusions and no manifest was
    given and that version is not under run.root (nothing can be said)."""
    exclusions = read_list(resolve_path(spec.data.exclusions)).exclusions
    if not exclusions:
        return []
    if tok is None:
        tok = next((v for v in corpus_versions(spec) if v.digest == digest), None) if digest else None
    if tok is None:
        return None
    per = matching_ids(tok, Matcher(exclusions))
    held = set().union(*(got.to_pylist() for _, got in held_in_shards(tok, set().union(*per))))
    return [e for e, ids in zip(exclusions, per) if not held.isdisjoint(ids)]


def exclude_source(spec: JobSpec, client, source: str, reason: str, strict: bool = False) -> dict:
    """Add ``source`` to the takedown list (``data.exclusions``) and tag every registered version trained on a corpus
    version that holds it; the next curation run publishes a version without its docs. ``strict``: a source that no
    corpus version holds is not recorded (:class:`NothingMatched`)."""
    path = resolve_path(spec.data.exclusions)
    key = _source_key(source, "--exclude-source")
    held = source_holders(spec, key) if strict else None
    if held is not None and not held[0] and held[1]:  # what it could not look into may hold it: not "nothing"
        code, what = _not_looked_into(held[1])
        raise (VersionUnreadable if code == RETRY else StageError)(
            f"--exclude-source {key!r} --strict: nothing recorded: no corpus version it could look into holds docs of "
            f"it, and {what}: " + ("run it again" if code == RETRY else "the version must be repaired first"))
    if held is not None and not held[0]:
        raise NothingMatched(f"--exclude-source {key!r}: no corpus version under run.root={spec.run.root} holds docs "
                             f"of it{_unread_note(held[1])}; nothing recorded (--strict)")
    try:
        rec, added = add(path, key, reason)
    except ValueError as e:
        raise StageError(f"--exclude-source {key!r}: {e}") from None
    try:
        versions, unreadable = held if held is not None else source_holders(spec, rec.source)
        tagged = tag_versions(client, models_trained_on(client, _digests(versions)), rec)
    except Exception as e:  # noqa: BLE001 - MLflow or a corpus version: the exclusion itself is recorded
        again = storage_error(e) or mlflow_outage(e)  # the server or storage: a retry tags
        raise (VersionUnreadable if again else StageError)(
            f"the exclusion of {rec.source!r} is recorded in {path}, but tagging the registered versions that saw it "
            f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); run the same command again to "
            "tag them") from None
    if unread := [u for u in unreadable if u["storage"]]:  # the models trained on them are not tagged yet
        raise VersionUnreadable(f"the exclusion of {rec.source!r} is recorded in {path}, but {len(unread)} corpus "
                                f"version(s) could not be read now ({unread[0]['error']}); run the same command again "
                                "to tag the registered versions trained on them")
    return {"exclusion": {**rec.__dict__, "list": str(path), "added": added}, "corpus_versions": versions,
            "models_tagged": [{k: m[k] for k in ("name", "version")} for m in tagged], "unreadable": unreadable}


def incomplete(res: dict) -> Optional[tuple[int, str]]:
    """An answer (of :func:`doc_query`, :func:`source_query`, :func:`exclude_source`) that could not look into every
    corpus version: (exit code, one line) — 75 when storage did not return one (a retry reads it), 2 when one is
    damaged (its shards or lineage do not read: the user's to repair); None when it looked into every one."""
    unread = res.get("unreadable") or []
    if not unread:
        return None
    code, what = _not_looked_into(unread)
    left = ("the exclusion is recorded, but the registered versions trained on it are not tagged" if "exclusion" in res
            else "the answer above leaves it out")
    return code, f"{what}: {left}; " + ("run it again" if code == RETRY else
                                        "the version must be repaired (or moved out of run.root) before the answer "
                                        "is whole")


def _not_looked_into(unread: list[dict]) -> tuple[int, str]:
    """(75 when storage was a reason, else 2; "N corpus version(s) could not be read now / cannot be looked into
    (the first's manifest: error and N more)")."""
    first = f"{unread[0]['manifest']}: {unread[0]['error']}" + (f" and {len(unread) - 1} more" if len(unread) > 1
                                                                  else "")
    if any(u["storage"] for u in unread):
        return RETRY, f"{len(unread)} corpus version(s) could not be read now ({first})"
    return USER_ERROR, f"{len(unread)} corpus version(s) cannot be looked into ({first})"


def _unread_note(unreadable: list[dict]) -> str:
    return f" ({len(unreadable)} corpus version(s) could not be read)" if unreadable else ""


def nothing_matched(res: dict, root: str) -> Optional[str]:
    """The warning for an answer (of :func:`doc_query`, :func:`source_query`, :func:`exclude_source`) that no corpus
    version holds anything of; None when one does."""
    if "model" in res or res["corpus_versions"]:
        return None
    what = f"doc {res['doc']!r}" if "doc" in res else f"docs of {(res.get('exclusion') or res)['source']!r}"
    note = ("; the exclusion is recorded all the same (docs of it ingested later are removed)" if "exclusion" in res
            else "")
    return f"no corpus version under run.root={root} holds {what}{_unread_note(res['unreadable'])}{note}"
