"""Evaluate: load the promoted checkpoint **from L2** and score it on fixed, versioned sets.

* ``reference_bpb``: bits per UTF-8 byte on ``eval.reference``, a fixed set of text files
  (definition in ``pipelines.eval.bpb``; the set's sha256 travels with the number). Comparable across
  corpora and tokenizers, so it is what the champion gate compares.
* ``harness.<task>.<metric>``: lm-evaluation-harness tasks (``eval.tasks``: by default our ARC-Easy, HellaSwag
  and LAMBADA slices, read from ``eval.data_dir``; any task lm-eval knows, with ``eval.include_path``), built
  offline, with lm-eval's own prompts and metrics, the first ``eval.limit`` items of each.
* ``heldout_loss`` / ``heldout_ppl`` / ``heldout_bpb``: next-token loss on the run's own held-out
  shards. A diagnostic: another corpus or tokenizer scores other text.
* a sample generation from ``eval.sample_prompt``.

A model above ``eval.single_process_max_params`` is scored on the launcher's ranks
(``pipelines.eval.scorer`` under torchrun, or a PyTorchJob on Kubernetes), not in the Airflow worker.
The reference files, each task's items (their digest) and each task's settings (its lm-eval config: prompt, metrics,
``num_fewshot`` …, and lm-eval's version) are inputs of the stage key: change one and the stage re-runs. A task
lm-eval cannot build offline fails the stage before anything runs (exit 2, the task and why).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from pipelines.cli import run_and_log, stage_dir, stage_main
from pipelines.eval.model_dir import loads_here, params_of
from pipelines.eval.scorer import Job, score
from pipelines.eval_sets import eval_tasks, reference_files, set_sha256, task_digest, task_ref, task_settings
from pipelines.launch.ranks import run_ranks
from pipelines.manifest import Manifest, file_ref, input_ref, uri_path
from pipelines.spec import JobSpec
from pipelines.train.ckpt.tiers import fetch


def score_model_dir(spec: JobSpec, job: Job, work: Path, run_id: str) -> dict:
    """Score in this process, or on the launcher's ranks when the model is above
    ``eval.single_process_max_params`` (each rank loads it on its own device)."""
    if loads_here(spec, Path(job.model_dir)):
        return score(spec, job)

    work.mkdir(parents=True, exist_ok=True)
    spec.write_work_file(work / "spec.yaml")
    (work / "job.json").write_text(json.dumps(job.__dict__))
    out = work / "scores.json"
    print(f"[eval] {params_of(Path(job.model_dir)):,} params > eval.single_process_max_params: scoring on "
          f"{spec.world_size} ranks ({spec.launcher.kind})", flush=True)
    run_ranks(spec, "pipelines.eval.scorer", ["--spec", str(work / "spec.yaml"), "--job", str(work / "job.json"),
                                              "--out", str(out)], run_id=run_id, restarts=False, work=work)
    return json.loads(out.read_text())


def flat_metrics(scores: dict) -> dict[str, float]:
    """The numbers the manifest, MLflow and the version tags carry."""
    m = {}
    if "reference" in scores:
        m["reference_bpb"] = scores["reference"]["bits_per_byte"]
    m.update({k: v for k, v in scores.get("heldout", {}).items() if k != "heldout_tokens_scored"})
    m.update(scores.get("harness", {}).get("scores", {}))
    return m


def task_inputs(spec: JobSpec) -> tuple[dict[str, str], list[dict]]:
    """({task: its items' digest}, the tasks as inputs of the stage key: items and settings) for every task of
    eval.tasks (a group's each), built offline by lm-eval. The items' digests are the decontaminate record's; the
    key also changes with a task's settings (``num_fewshot``, metrics, prompt …) and lm-eval's version."""
    tasks = eval_tasks(spec)
    digests = {name: task_digest(task) for name, task in tasks.items()}
    return digests, [task_ref(name, digests[name], task_settings(task)) for name, task in tasks.items()]


def model_contamination(spec: JobSpec, tok: Manifest, digests: dict[str, str]) -> dict:
    """Per scored task (and ``reference``): how many of its items overlap training data that reached the model (the
    corpus version's record, kept by the decontaminate stage), of them how many are among the scored items, or
    ``checked: false`` when the corpus was not checked against these very items (``digests``: :func:`task_inputs`)."""
    record = tok.extra.get("contamination", {})
    current = {**digests, "reference": set_sha256(reference_files(spec))}
    out = {}
    for task, sha in current.items():
        r = record.get(task)
        if r is None or r["sha256"] != sha:
            out[task] = {"checked": False}
            continue
        limit = None if task == "reference" else spec.eval.limit
        idx = r["overlapping_kept"]
        out[task] = {"checked": r["complete"], "items": r["items"], "items_overlapping": len(idx),
                     "scored_overlapping": sum(1 for i in idx if limit is None or i < limit),
                     "docs_removed": r["docs_removed"], "ngram": r["ngram"]}
    return out


def contamination_line(con: dict) -> str:
    """``llmp_arc_easy 0/500, …`` (items overlapping the training data / items; ``unchecked`` when unknown)."""
    return ", ".join(f"{t} {r['items_overlapping']}/{r['items']}" + ("" if r["checked"] else " (partly unchecked)")
                     if "items" in r else f"{t} unchecked" for t, r in con.items())


def evaluate(spec: JobSpec, promote: Manifest, tok: Manifest, workdir: Path) -> dict:
    tier, ckpt = fetch(spec, promote.extra["checkpoint"], cache=workdir / "checkpoint", prefer=("L2",))
    c = tok.counts
    job = Job(model_dir=str(ckpt), reference=reference_files(spec),
              heldout=[str(tok.dir / s["prefix"]) for s in tok.extra["shards"] if s["split"] == "heldout"],
              heldout_text_bytes=c["heldout_text_bytes"], heldout_tokens=c["heldout_tokens"])
    scores = score_model_dir(spec, job, workdir / "ranks", run_id=f"eval-{promote.digest[:8]}")
    return {**scores, "loaded_from": tier, "checkpoint_uri": promote.extra["l2_uri"]}


def run(spec: JobSpec, promote: Manifest, tok: Manifest, out_dir: str | None = None) -> Manifest:
    refs = [file_ref(p) for p in reference_files(spec)]
    digests, task_refs = task_inputs(spec)  # lm-eval builds eval.tasks here: one it cannot fails the spec (exit 2)
    sd = stage_dir(spec, "evaluate", [input_ref(promote), input_ref(tok), *refs, *task_refs], out_dir)

    def body(tmp: Path) -> Manifest:
        res = evaluate(spec, promote, tok, tmp)
        shutil.rmtree(tmp / "checkpoint", ignore_errors=True)  # a cache, not an output
        shutil.rmtree(tmp / "ranks", ignore_errors=True)
        harness = res.pop("harness", {"results": {}, "scores": {}})
        (tmp / "harness.json").write_text(json.dumps(harness["results"], indent=2))
        (tmp / "metrics.json").write_text(json.dumps({**res, "harness": harness["scores"]}, indent=2))
        ref = res["reference"]
        return sd.commit(
            {"metrics": "metrics.json", "harness": "harness.json"},
            counts={"tokens_scored": res["heldout"]["heldout_tokens_scored"], "reference_bytes": ref["bytes"]},
            metrics=flat_metrics({**res, "harness": harness}),
            extra={"loaded_from": res["loaded_from"], "checkpoint_uri": res["checkpoint_uri"],
                   "checkpoint": promote.extra["checkpoint"], "reference_sha256": ref["sha256"],
                   "reference": {k: v for k, v in ref.items() if k != "sha256"}, "tasks": list(spec.eval.tasks),
                   "limit": spec.eval.limit, "sample": res.get("sample"), "scored_on_ranks": res["world_size"],
                   "params": res["params"], "contamination": model_contamination(spec, tok, digests),
                   "files": {uri_path(r["uri"]).name: r["sha256"] for r in refs}, "task_sha256": digests})

    return run_and_log(spec, sd, body, artifacts=["harness"])


def summary(m: Manifest) -> str:
    x = m.metrics
    scores = ", ".join(f"{k.removeprefix('harness.')} {v:.3f}" for k, v in x.items() if k.startswith("harness.")
                       and not k.endswith("perplexity"))
    lines = [f"evaluate: reference {x['reference_bpb']:.4f} bits/byte (set {m.extra['reference_sha256'][:12]}); "
             f"held-out loss {x['heldout_loss']:.4f} nats/token, {x['heldout_bpb']:.4f} bits/byte; "
             f"loaded from {m.extra['loaded_from']}; manifest {m.path}"]
    if scores:
        lines.append(f"evaluate: harness (limit {m.extra['limit']}): {scores}")
    if m.extra.get("contamination"):
        lines.append(f"evaluate: eval items overlapping the training data: {contamination_line(m.extra['contamination'])}")
    if m.extra.get("sample"):
        lines.append(f"evaluate: sample: {m.extra['sample']['prompt']!r} → {m.extra['sample']['text']!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return stage_main("evaluate", run, summary, argv)


if __name__ == "__main__":
    sys.exit(main())
