"""Print where a pipeline run's results are: the registered model version, its metrics and lineage.

    python -m pipelines.summary [--spec configs/demo.yaml]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines import tracking
from pipelines.exit_codes import RETRY
from pipelines.eval.registry import model_id_of
from pipelines.spec import add_spec_args, redact, spec_from_args


def summarize(spec) -> dict:
    from mlflow.exceptions import MlflowException

    c = tracking.client(spec)
    name, alias = spec.registry.model_name, spec.registry.alias
    versions = list(tracking.model_versions(c, f"name='{name}'"))  # every page: the newest may be on any
    if not versions:
        raise LookupError(f"no registered versions of {name!r} in {redact(tracking.tracking_uri(spec))}")
    latest = max(versions, key=lambda v: int(v.version))
    try:
        champ = c.get_model_version_by_alias(name, alias)
    except MlflowException as e:  # no such alias yet: none; the server failing is not "no champion"
        if not tracking.mlflow_answered(e):
            raise
        champ = None
    run = c.get_run(latest.run_id)
    m = run.data.metrics
    return {"tracking_uri": redact(tracking.tracking_uri(spec)), "model": name, "latest_version": int(latest.version),
            "champion_version": int(champ.version) if champ else None, "tags": dict(latest.tags),
            "run_id": latest.run_id, "metrics": m, "prompt": spec.eval.sample_prompt,
            "model_id": model_id_of(latest.source)}


def sample(spec, prompt: str) -> str:
    """A generation from the champion, loaded back from the registry (what a server would answer)."""
    from pipelines.eval.lm import TextModel

    tm = TextModel.open(f"models:/{spec.registry.model_name}@{spec.registry.alias}", tracking.tracking_uri(spec))
    return tm.generate(prompt, spec.eval.sample_max_new_tokens, temperature=0.8, top_k=50,
                                         seed=spec.run.seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.summary", description=__doc__.splitlines()[0])
    add_spec_args(ap)
    args = ap.parse_args(argv)
    spec = spec_from_args(args)
    try:
        s = summarize(spec)
    except LookupError as e:
        print(f"summary: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the tracking server did not answer: 75, one line
        if not tracking.mlflow_outage(e):
            raise
        print(f"summary: the tracking server did not answer ({type(e).__name__}: {str(e)[:300]}); run it again",
              file=sys.stderr)
        return RETRY
    if not print_summary(spec, s):
        print("summary: the tracking server did not answer for the champion's sample; run it again", file=sys.stderr)
        return RETRY
    return 0


def print_summary(spec, s: dict) -> bool:
    """The demo's closing block: what went in and out of each stage, the registered model and how to use it. False
    when the tracking server did not answer for the champion's sample (its line says so)."""
    m, t = s["metrics"], s["tags"]

    def g(k, fmt="{:,.0f}"):
        return fmt.format(m[k]) if k in m else "n/a"

    print("\n=== llm-pipeline results ===")
    print(f"MLflow tracking URI : {s['tracking_uri']}")
    print(f"registered model    : {s['model']} v{s['latest_version']}  "
          f"(alias '{spec.registry.alias}' → v{s['champion_version']})")
    print(f"MLflow run          : {s['run_id']}")
    print(f"docs                : {g('ingest.records')} in → {g('ingest.quarantined')} quarantined, "
          f"{g('dedup.removed')} duplicates, {g('filter.removed')} filtered, {g('decontaminate.removed')} "
          f"contaminated, {g('tokenize.docs')} kept")
    print(f"tokens              : {g('tokenize.train_tokens')} train + {g('tokenize.heldout_tokens')} held-out")
    print(f"preflight           : {g('preflight.world_size')} ranks, all-reduce "
          f"{g('preflight.allreduce_busbw_GBps', '{:.2f}')} GB/s bus bandwidth, {g('preflight.stragglers')} stragglers")
    print(f"training            : {g('train.steps')} steps, final loss {g('train.final_loss', '{:.3f}')}, "
          f"{g('train.tokens_per_s')} tokens/s, {g('train.params')} params")
    print(f"validation          : loss {g('train.val_loss', '{:.4f}')} nats/token, {g('train.val_bpb', '{:.4f}')} "
          f"bits/byte at the last step (every train.eval_every={spec.train.eval_every} steps: val/loss, val/bpb in "
          "the training run; loss_curve.png)")
    print(f"reference set       : {g('evaluate.reference_bpb', '{:.4f}')} bits/byte "
          f"(set {t.get('reference_sha256', 'n/a')[:12]}: {t.get('reference_files', 'n/a')})")
    harness = [k for k in sorted(m) if k.startswith("evaluate.harness.") and not k.endswith("perplexity")]
    print(f"lm-eval (limit {t.get('eval_limit', 'n/a')}) : " + (", ".join(
        f"{k.removeprefix('evaluate.harness.')} {m[k]:.3f}" for k in harness) or "n/a"))
    print(f"held-out (own data) : loss {g('evaluate.heldout_loss', '{:.4f}')} nats/token, "
          f"ppl {g('evaluate.heldout_ppl', '{:.1f}')}, {g('evaluate.heldout_bpb', '{:.4f}')} bits/byte")
    con = {k.removeprefix("contamination."): v for k, v in t.items() if k.startswith("contamination.")}
    print("contamination       : eval items overlapping the training data: " + (", ".join(
        f"{k} {v}" for k, v in con.items()) or "not recorded"))
    print(f"gate                : {t.get('gate', 'n/a')}")
    print(f"logged model        : {s['model_id'] or 'n/a'} (made in run {s['run_id']}, with the eval metrics)")
    print("lineage tags        : " + ", ".join(f"{k}={t[k][:12]}…" for k in
                                             ("data_manifest_hash", "tokenizer_hash", "config_hash") if k in t))
    print(f"checkpoint (L2)     : {t.get('checkpoint_uri', 'n/a')}")
    answered = True
    if s["champion_version"]:
        try:
            text = repr(sample(spec, s["prompt"]))
        except LookupError as e:
            text = f"n/a ({e})"
        except Exception as e:  # noqa: BLE001 - only the tracking server not answering is said here
            if not tracking.mlflow_outage(e):
                raise
            text, answered = f"n/a (the tracking server did not answer: {type(e).__name__})", False
        print(f"champion sample     : {s['prompt']!r} → {text}")
    uri = f"models:/{s['model']}@{spec.registry.alias}"
    b = bin_dir()
    print(f"browse              : {b}/mlflow ui --backend-store-uri {s['tracking_uri']}")
    print(f"serve               : PATH={b}:$PATH MLFLOW_TRACKING_URI={s['tracking_uri']} mlflow models serve -m {uri} "
          "--env-manager local --host 127.0.0.1 --port 5001")
    print(f"export              : {b}/python -m pipelines.eval.export --model {s['model']}@{spec.registry.alias} "
          f"--format hf --out var/export/{s['model']}  (transformers; --format gguf: model.gguf for llama.cpp); "
          f"registered copy: {t.get('export.hf', 'n/a')}")
    print(f"lm-eval             : {b}/llmp-lm-eval --model llm-pipeline --model_args uri={uri},tracking_uri="
          f"{s['tracking_uri']} --include_path pipelines/eval/tasks --tasks llmp_arc_easy,llmp_hellaswag,llmp_lambada_openai --limit 20")
    return answered


def bin_dir() -> str:
    """Where this Python's commands are (``.venv/bin`` in a checkout, the image's own elsewhere), for the hints."""
    d = Path(sys.executable).parent
    return f"$PWD/{d.relative_to(Path.cwd())}" if d.is_relative_to(Path.cwd()) else str(d)


if __name__ == "__main__":
    sys.exit(main())
