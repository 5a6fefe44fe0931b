"""Checkpointing: the protocol, its tiers, restore, fences and promotion, one job a module.

| module | job |
|---|---|
| ``protocol`` | a copy valid only when complete (MANIFEST.json, COMMIT last), its verification, step and part names, errors, plain-torch loading |
| ``local`` | the filesystem tiers, L0 node-local and L1 shared: commit, copy verified while read, install by rename, remove COMMIT first |
| ``s3_tier`` | the S3 tier (L2): uploads under conditions, downloads, checks with S3's own SHA-256, removal |
| ``s3_markers`` | COMMIT, MANIFEST and part markers on L2 written and deleted with S3 conditional requests |
| ``parts`` | node parts of a step (node-local L0) and their merge into the global commit on L1 and L2 |
| ``tiers`` | where a step lives on each tier, retention, ``run.force`` generations, promote, fetch |
| ``restore`` | the collective restore: one step chosen by rank 0, each part from its nearest verified tier |
| ``fence``, ``fence_l2`` | terms and leases between attempts on L1; the terms' record on L2 |
| ``history`` | which steps belong to the training being continued (the run's record on L1; its field is ``lineage``) |
| ``checkpointer`` | in-run saves: DCP shards, a commit per node's part, restore into the live model |
| ``promoter`` | promotion while training runs: L0 → L1 → L2 in the part leaders' background threads |

The plain export CLI is :mod:`pipelines.train.checkpoint`; the promote stage :mod:`pipelines.train.promote`. Nothing
here imports the trainer; the trainer imports :mod:`.checkpointer` (which restores through :mod:`.restore`), :mod:`.tiers`,
:mod:`.protocol` and :mod:`.history`.
"""
