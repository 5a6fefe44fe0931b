"""Lineage and takedown: what a registered model saw, which corpus versions and models hold a doc or a source, and the
takedown list that no new corpus version may hold a source of. ``python -m pipelines.lineage`` is the CLI.

Everything is read from what the stages already record: a registered version's ``data_manifest_hash`` tag is the
digest of the tokenize manifest it was trained on (a *corpus version*); a corpus version names the one it extends
(``extra.corpus.previous``), its stages' manifests (``lineage``) name the ingested inputs (key, size, sha256), the docs
each version added are the decontaminate (or filter) stage's kept docs (with ``source`` and ``url``), and every
shard has its doc ids beside it (``<shard>.ids.parquet``). The corpus versions are those under ``run.root``.

**Keys.** A source is an input's key as ingest records it (a doc's ``source``: its path under the project root, its
absolute path elsewhere, its ``s3://`` URI) or a URL prefix. Both sides are compared normalised (:func:`input_key`,
:func:`url_key`, :func:`source_key`): Unicode NFC; a local path given by the user resolved as ingest resolves it
(``./x.jsonl``, the absolute path and ``x.jsonl`` are one key); a URL as the WHATWG URL parser reads it, the parser
the URL filter and browsers use (:func:`whatwg_key`: the host a browser would connect to, the path with dot segments
resolved and unreserved characters' %-escapes decoded). A URL prefix takes the URLs (and ``s3://`` keys) at or under
it, at a host or path boundary: ``https://a.example`` takes ``https://a.example/x``, never
``https://a.example.evil.org/``; ``https://a.example/take`` takes ``…/take`` and ``…/take/x``, never
``…/takeover``; a local directory's key takes the files under it. A table's keys are normalised once per distinct
value and compared vectorised (:meth:`Matcher.masks`).

**The takedown list** (``data.exclusions``, one JSON object a line: ``source``, ``reason``, ``added_at``; a missing
file is an empty list): a stage reads it once (:func:`read_list`: the exclusions and the sha256 of exactly the bytes
read) and records that digest; the tokenize stage publishes a corpus version only while the list is the one it
applied (:func:`list_held`: a shared lock beside the list, taken for the final rename only, that :func:`add` waits
for). Every wait for the lock is bounded (:data:`LOCK_WAIT_S`), and a lock that cannot be taken fails the command
(:class:`ListUnavailable`, exit 75), never skips it: the list's directory must support ``flock``.

| module | job |
|---|---|
| ``keys`` | source keys (inputs, docs' sources, URLs) and :class:`~pipelines.lineage.keys.Matcher` |
| ``takedowns`` | the takedown list: read, locked, added to, applied; the tag on affected registered versions |
| ``queries`` | corpus versions and what each added; what a model saw; who holds a doc or a source; taking one down |
| ``__main__`` | the CLI, ``python -m pipelines.lineage`` |

Lineage here means the data's: what a model was trained on. Which checkpoint steps belong to the training being
continued is :mod:`pipelines.train.ckpt.history`; a stage's own inputs are its manifest's ``lineage`` field.
"""
