"""The stage table: every stage of the pipeline declared once.

From each entry come the stage's config hash (the spec sections it reads), its CLI (``python -m <module>``
with one ``--<upstream>-manifest`` flag per upstream stage, :func:`pipelines.cli.stage_main`), its Airflow
task (task id = stage name = the manifest's ``stage``; ``plugins/llm_dags.py``), the DAG it belongs to, and
the README's stage table (``python -m pipelines.stages``). Adding or removing a stage is one entry here plus
its module.

Light on purpose: the DAG files import it at parse time.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str                     # = task id = manifest "stage"
    module: str                   # python -m <module>
    sections: tuple[str, ...]     # spec sections whose values are part of the stage's config hash
    upstream: tuple[str, ...]     # stages whose manifests it reads, in CLI/argument order
    engine: str                   # python | spark | ranks (torchrun or a PyTorchJob) | mlflow
    outputs: tuple[str, ...]      # named outputs in its manifest
    dag: str                      # the Asset-linked DAG that runs it
    summary: str                  # one line: the CLI description and the docs table
    timeout_hours: float = 6.0    # the Airflow task's execution_timeout
    incremental: bool = False     # takes --corpus-manifest: the corpus version its run adds to
    also_from: tuple[str, ...] = ()  # earlier stages whose result its CLI also takes in place of its upstream's

    @property
    def flag(self) -> str:
        """The CLI flag a downstream stage takes this stage's manifest with."""
        return f"--{self.name}-manifest"


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("ingest", "pipelines.data.ingest", ("data.ingest", "data.input_fields"), (), "spark",
          ("docs", "quarantine"), "data_curation",
          "Read JSONL (plain/.gz/.zst), Parquet, WARC (HTML extracted to text) and WET, local or s3://, on Spark into "
          "docs/; bad records go to quarantine/ with a reason.", incremental=True),
    Stage("dedup", "pipelines.data.dedup", ("data.dedup", "data.task_mb"), ("ingest",), "spark",
          ("clusters", "kept", "removed", "signatures", "stats", "cluster_sizes_plot"), "data_curation",
          "MinHash-LSH near-duplicate removal on Spark (exact duplicates first, connected components); with "
          "--against-manifest, also against the docs kept earlier.", incremental=True),
    Stage("filter", "pipelines.data.filter", ("data.filters", "data.task_mb"), ("dedup",), "spark",
          ("kept", "removed"), "data_curation",
          "Language ID + Gopher/C4/FineWeb quality filters on Spark; removed docs keep a filter_reason."),
    Stage("decontaminate", "pipelines.data.decontaminate", ("data.decontaminate", "data.task_mb", "eval.tasks"),
          ("filter",), "spark", ("kept", "removed"), "data_curation",
          "Remove (or cut) docs that share a word n-gram (13) with an evaluation item (eval.tasks' items read "
          "through lm-eval's task objects, the reference set); removed docs keep filter_reason "
          "contamination:<task>; per-task counts in the manifest."),
    Stage("tokenize", "pipelines.data.tokenize", ("tokenizer", "run.seed", "data.task_mb"), ("decontaminate",), "spark",
          ("tokenizer", "<split>-<partition>-NNNN.bin/.idx"), "data_curation",
          "Train or take a SentencePiece model; every Spark partition writes its own mmap token shards "
          "(train + held-out); the result is a corpus version.", incremental=True, also_from=("filter",)),
    Stage("preflight", "pipelines.train.preflight", ("model", "train", "parallel", "launcher", "run.seed"),
          ("tokenize",), "ranks", ("report",), "training",
          "All-reduce bandwidth, straggler screen and smoke steps on the ranks the training run will use.", 1.0),
    Stage("train", "pipelines.train.launch", ("model", "train", "parallel", "launcher", "run.seed"),
          ("tokenize",), "ranks", ("losses", "result", "loss_curve", "spec"), "training",
          "Train on the token shards on every rank (torchrun, or a PyTorchJob); resumes from its checkpoints.",
          24.0 * 7),
    Stage("promote", "pipelines.train.promote", ("checkpoint",), ("train",), "python",
          ("tiers",), "training",
          "Promote the final checkpoint L0 → L1 → L2 (S3), verifying checksums at every tier, COMMIT last."),
    Stage("evaluate", "pipelines.eval.evaluate", ("eval", "model"), ("promote", "tokenize"), "ranks",
          ("metrics", "harness"), "evaluation",
          "Reference bits-per-byte, lm-evaluation-harness tasks (offline) and held-out loss of the promoted "
          "checkpoint, loaded from L2."),
    Stage("register", "pipelines.eval.register", ("registry",), ("evaluate", "train", "tokenize"), "mlflow",
          ("registration", "report", "report_png"), "evaluation",
          "Log the model as a servable pyfunc, register a version with lineage tags, and move the champion "
          "alias only if it is no worse on the same reference set."),
)}

# The Asset-linked DAGs, in order: each runs its stages and its last task (publish) emits the DAG's Asset, on
# which the next DAG is scheduled; "schedule" names the spec key of a time schedule instead. (``llm_pipeline``
# runs all of them in one DAG.)
DAGS: dict[str, dict] = {
    "data_curation": {"asset": "curated_shards", "schedule": "data.schedule", "incremental": True,
                      "doc": "ingest → dedup → filter → decontaminate → tokenize, on a cron schedule (data.schedule), each run adding "
                             "the inputs not curated yet to the last corpus version."},
    "training": {"asset": "checkpoint", "doc": "preflight → train → promote, when new curated shards land."},
    "evaluation": {"asset": "champion", "doc": "evaluate → register, when a new checkpoint is promoted; emits "
                                               "'champion' when the new version takes the champion alias."},
}


def stage(name: str) -> Stage:
    try:
        return STAGES[name]
    except KeyError:
        raise KeyError(f"no stage {name!r}; the stages are {', '.join(STAGES)}") from None


def of_dag(dag: str) -> list[Stage]:
    return [s for s in STAGES.values() if s.dag == dag]


def markdown_table() -> str:
    """The README's stage table."""
    rows = ["| stage (= task id) | module | engine | reads (spec) | upstream | outputs |",
            "|---|---|---|---|---|---|"]
    for s in STAGES.values():
        rows.append(f"| {s.name} | `{s.module}` | {s.engine} | {', '.join(f'`{x}`' for x in s.sections)} | "
                    f"{', '.join(s.upstream) or '–'} | {', '.join(f'`{o}`' for o in s.outputs)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table() if sys.argv[1:] != ["--names"] else " ".join(STAGES))
