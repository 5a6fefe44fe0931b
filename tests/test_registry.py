"""Registration on a real MLflow (SQLite backend, local artifacts)."""
import json
import os

import torch

from pipelines import tracking
from pipelines.eval import registry
from pipelines.spec import load_spec, resolve_path
from pipelines.train.model import ModelArgs, Transformer


def _ckpt(d):
    d.mkdir(parents=True)
    a = ModelArgs(vocab_size=64, n_layers=1, d_model=16, n_heads=2, seq_len=16)
    torch.save(Transformer(a).state_dict(), d / "model.pt")
    (d / "model_args.json").write_text(json.dumps(a.to_dict()))
    (d / "tokenizer.model").write_bytes(b"spm")
    return d


def test_register_tags_lineage_and_the_champion_only_moves_to_no_worse_models(home):
    spec = load_spec(None, ["registry.model_name=reg-test"], env={})
    run_id = tracking.start_run(spec, run_name="t")
    lineage = {"data_manifest_hash": "d" * 64, "tokenizer_hash": "t" * 64, "config_hash": "c" * 64}
    ck = _ckpt(home / "ck")
    r1 = registry.register(spec, ck, run_id, lineage, {"heldout_loss": 5.0, "heldout_bpb": 2.0})
    assert r1["version"] == 1 and r1["alias_moved"]
    c = tracking.client(spec)
    v1 = c.get_model_version("reg-test", "1")
    for k, v in lineage.items():
        assert v1.tags[k] == v
    assert float(v1.tags["heldout_loss"]) == 5.0
    assert resolve_path("var/mlflow.db").is_file()  # the embedded default store

    r2 = registry.register(spec, ck, run_id, lineage, {"heldout_loss": 6.0, "heldout_bpb": 2.5})  # worse
    assert r2["version"] == 2 and not r2["alias_moved"]
    assert str(c.get_model_version_by_alias("reg-test", "champion").version) == "1"

    r3 = registry.register(spec, ck, run_id, lineage, {"heldout_loss": 5.0, "heldout_bpb": 2.0})  # equal
    assert r3["alias_moved"] and str(c.get_model_version_by_alias("reg-test", "champion").version) == "3"

    # the registered model loads back and runs
    import mlflow.pytorch

    with tracking.fluent(spec):
        m = mlflow.pytorch.load_model("models:/reg-test@champion")
    assert "MLFLOW_TRACKING_URI" not in os.environ  # nothing leaks into later subprocesses
    for shape in [(2, 8), (3, 5), (1, 16)]:  # batch and length are dynamic in the export
        assert tuple(m(torch.randint(0, 64, shape)).shape) == (*shape, 64)
