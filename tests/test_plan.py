"""Parallel layout validation, parameter counts and the memory plan, against hand arithmetic."""
import json

import pytest

from pipelines.spec import SpecError, load_spec
from pipelines.train import plan as P

GIB = 1 << 30


def test_parallel_degrees_must_multiply_to_the_world_size():
    s = load_spec(None, ["launcher.nproc_per_node=4", "parallel.dp_shard=-1"], env={})
    assert s.degrees == {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "pp": 1, "cp": 1, "dp": 4}
    s = load_spec(None, ["launcher.nproc_per_node=4", "parallel.dp_shard=2", "parallel.tp=1"], env={})
    assert s.degrees["dp_replicate"] == 2 and s.degrees["dp"] == 4  # HSDP: replicate takes the rest
    with pytest.raises(SpecError, match=r"2×1×1×1×1 = 2 but the launcher gives world size 4"):
        load_spec(None, ["launcher.nproc_per_node=4", "parallel.dp_replicate=2"], env={})
    with pytest.raises(SpecError, match="not divisible"):
        load_spec(None, ["launcher.nproc_per_node=4", "parallel.tp=3"], env={})
    with pytest.raises(SpecError, match=r"parallel\.pp=2: pipeline parallelism is not implemented"):
        load_spec(None, ["parallel.pp=2"], env={})
    with pytest.raises(SpecError, match=r"parallel\.cp=4: context parallelism is not implemented"):
        load_spec(None, ["parallel.cp=4"], env={})


def test_global_batch_must_equal_micro_times_accum_times_dp():
    ok = load_spec(None, ["train.micro_batch=4", "train.grad_accum=3", "train.global_batch=24"], env={})
    assert ok.global_batch == 24  # 4 × 3 × DP 2 (two local ranks)
    with pytest.raises(SpecError, match=r"train\.global_batch=20 but .* 4 × 3 × 2 = 24"):
        load_spec(None, ["train.micro_batch=4", "train.grad_accum=3", "train.global_batch=20"], env={})


@pytest.mark.parametrize("cfg,params", [("configs/llama3_8b.yaml", 8_030_261_248),
                                        ("configs/llama3_70b.yaml", 70_553_706_496)])
def test_llama3_parameter_counts_match_the_published_shapes(cfg, params):
    s = load_spec(cfg, env={})
    shape = P.model_shape(s)
    assert shape["ffn"] == int(3.5 * shape["d"])  # 14336 / 28672
    assert P.param_count(shape)["total"] == params  # 8.03 B / 70.55 B ("70.6 B")


def test_param_count_formula_matches_the_torch_model():
    import torch  # noqa: F401

    from pipelines.train.model import ModelArgs, Transformer, param_count

    s = load_spec(None, ["model.n_kv_heads=2", "model.tie_embeddings=false", "model.vocab_size=1000"], env={})
    args = ModelArgs.from_spec(s.model, 1000)
    n_torch = sum(p.numel() for p in Transformer(args).parameters())
    assert n_torch == param_count(args) == P.param_count(P.model_shape(s))["total"]


def test_memory_plan_of_llama3_8b_is_the_hand_arithmetic():
    s = load_spec("configs/llama3_8b.yaml", env={})
    p = P.memory_plan(s, gpu_mem_gb=80)
    n = 8_030_261_248
    assert (p["weights_bytes"], p["grads_bytes"], p["optimizer_bytes"]) == (4 * n, 4 * n, 8 * n)
    assert p["model_states_per_gpu_bytes"] == 16 * n // 8  # FSDP over 8 GPUs
    # activations, by hand: s=8192, b=1, h=4096, f=14336, k=8/32, bf16, selective = 16 of 32 blocks stored
    sbh = 8192 * 4096
    block = 8 * sbh + 2 * sbh * (2 + 2 * 0.25) + 6 * 8192 * 14336
    # the head's loss in chunks of 1,024 tokens ('auto': 1024 · 128,256 ≤ 2^27): one chunk's bf16 logits and fp32
    # softmax, the head's fp32 gradient and the hidden states' bf16 one
    acts = 16 * block + 16 * 2 * sbh + 1024 * 128256 * (2 + 4) + 128256 * 4096 * 4 + sbh * 2
    assert p["activations_bytes"] == int(acts)
    assert p["flops_per_token"] == 6 * (n - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192
    assert p["fits"] and p["per_gpu_bytes"] < 80 * GIB
    assert not P.memory_plan(s, gpu_mem_gb=24)["fits"]


def test_70b_does_not_fit_on_one_node_without_sharding_enough():
    s = load_spec("configs/llama3_70b.yaml", ["launcher.nnodes=1", "parallel.tp=1", "parallel.dp_shard=8",
                                              "train.global_batch=128"], env={})
    p = P.memory_plan(s)
    assert p["model_states_per_gpu_bytes"] == 16 * 70_553_706_496 // 8  # 131 GiB of states per GPU
    assert not p["fits"]


def test_plan_cli_prints_json_with_the_documented_keys(capsys):
    assert P.main(["configs/llama3_70b.yaml", "--json", "--gpu-mem-gb", "80"]) == 0
    out = json.loads(capsys.readouterr().out)
    for k in ("params", "weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "per_gpu_bytes",
              "flops_per_token", "fits", "world_size"):
        assert k in out
    assert out["world_size"] == 64 and out["params"] == 70_553_706_496
    assert P.main(["configs/llama3_8b.yaml", "--set", "parallel.pp=2"]) == 2
    assert "pipeline parallelism is not implemented" in capsys.readouterr().err


def test_tensor_parallel_with_ddp_is_refused_by_the_spec():
    with pytest.raises(SpecError, match=r"parallel\.tp=2 with DDP \(parallel\.dp_replicate=2\): tensor parallel "
                       "combines with FSDP2"):
        load_spec(None, ["launcher.nproc_per_node=4", "parallel.dp_replicate=2", "parallel.tp=2"], env={})
    load_spec(None, ["launcher.nproc_per_node=4", "parallel.dp_shard=2", "parallel.dp_replicate=1", "parallel.tp=2"],
              env={})  # FSDP2 × TP is fine
    load_spec(None, ["parallel.dp_replicate=1", "parallel.tp=2"], env={})  # TP over 2 ranks is fine
    with pytest.raises(SpecError, match=r"parallel\.tp=2 must divide model\.n_heads=4 and the KV heads \(1\)"):
        load_spec(None, ["parallel.dp_replicate=1", "parallel.tp=2", "model.n_kv_heads=1"], env={})


def test_mfu_uses_the_detected_gpus_peak_and_is_absent_on_cpu():
    # 8B on 8 × H100 SXM at 3,000 tokens/s per GPU: 3000 × 57.9 GFLOP / 989 TFLOP/s = 17.6 %
    fpt = P.memory_plan(load_spec("configs/llama3_8b.yaml", env={}))["flops_per_token"]
    u = P.mfu(8 * 3000, fpt, 8, "NVIDIA H100 80GB HBM3")
    assert u == pytest.approx(3000 * fpt / 989e12)
    assert P.peak_flops("NVIDIA H100 PCIe") == 756e12 and P.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert P.mfu(1000, fpt, 1, "cpu") is None and P.peak_flops("Some Future GPU") is None


def _crd():
    from conftest import SHARED

    path = SHARED / "k8s" / "kubeflow.org_pytorchjobs.yaml"
    if not path.exists():
        pytest.skip("../shared/data/k8s (the Kubeflow PyTorchJob CRD) is absent in this checkout")
    return path


@pytest.mark.parametrize("cfg", ["configs/llama3_8b.yaml", "configs/llama3_70b.yaml"])
def test_rendered_pytorchjob_validates_against_the_kubeflow_crd(cfg):
    from pipelines.launch import k8s

    spec = load_spec(cfg, env={})
    job = k8s.render_pytorchjob(spec, "Run_42", ["--spec", "/fsx/s.yaml"])
    assert k8s.validate_job(job, _crd(), spec) == []
    assert job["metadata"]["name"] == f"{spec.run.name}-run-42"  # DNS-1123
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    c = master["containers"][0]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    assert c["command"][:1] == ["torchrun"] and "pipelines.train.trainer" in c["command"]
    assert {"name": "FI_PROVIDER", "value": "efa"} in c["env"]
    assert any(v.get("persistentVolumeClaim") for v in master["volumes"])
    workers = job["spec"]["pytorchReplicaSpecs"].get("Worker", {}).get("replicas", 0)
    assert 1 + workers == spec.launcher.nnodes
    assert ("elasticPolicy" in job["spec"]) == (spec.launcher.min_nodes is not None)


def test_pytorchjob_validation_catches_schema_and_operator_errors():
    from pipelines.launch import k8s

    spec = load_spec("configs/llama3_70b.yaml", env={})
    job = k8s.render_pytorchjob(spec, "r", [])
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "seven"           # schema: integer
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"] = "main"
    errs = k8s.validate_job(job, _crd(), spec)
    assert any("Worker.replicas" in e and "integer" in e for e in errs)
    assert any("no container named 'pytorch'" in e for e in errs)
    assert "the job has 1 nodes, the spec asks for launcher.nnodes=8" in errs  # "seven" is no node count


@pytest.mark.parametrize("cfg", ["configs/llama3_8b.yaml", "configs/llama3_70b.yaml"])
def test_rendered_trainjob_validates_against_trainer_v2s_crd_and_says_what_the_pods_get(cfg):
    """The same spec as a Kubeflow Trainer v2 TrainJob (the CRD of the release infra/terraform installs, shipped in
    infra/k8s/crds): nodes, processes, GPU/EFA per node, the torchrun command, the shared FS and node placement."""
    from pipelines.launch import k8s

    spec = load_spec(cfg, ["launcher.kind=trainjob", "launcher.min_nodes=null"], env={})
    job = k8s.render_trainjob(spec, "Run_42", ["--spec", "/fsx/s.yaml"])
    assert k8s.validate_job(job, k8s.DEFAULT_CRDS["trainjob"], spec) == []
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                                         "kind": "ClusterTrainingRuntime"}
    t = job["spec"]["trainer"]
    assert t["numNodes"] == spec.launcher.nnodes and t["numProcPerNode"] == 8
    assert t["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    assert t["command"][:1] == ["torchrun"] and "pipelines.train.trainer" in t["command"]
    assert {"name": "FI_PROVIDER", "value": "efa"} in t["env"]
    secret = [e for e in t["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in secret} == {"mlflow-client"}
    (node,) = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    assert node["name"] == "node" and pod["containers"][0]["name"] == "node"
    assert any(v.get("persistentVolumeClaim") for v in pod["volumes"]) and pod["nodeSelector"]
    # what the schema cannot say
    job["spec"]["trainer"]["numNodes"] = 3
    pod["containers"][0]["name"] = "main"
    errs = k8s.validate_job(job, k8s.DEFAULT_CRDS["trainjob"], spec)
    assert f"the job has 3 nodes, the spec asks for launcher.nnodes={spec.launcher.nnodes}" in errs
    assert any("patch the 'node' job's 'node' container" in e for e in errs)
    job["spec"]["trainer"]["numNodes"] = "three"
    assert any("numNodes" in e and "integer" in e for e in k8s.validate_job(job, k8s.DEFAULT_CRDS["trainjob"]))


def test_an_elastic_range_needs_the_pytorchjob():
    from pipelines.spec import SpecError

    with pytest.raises(SpecError, match="a TrainJob has no elastic range.*launcher.kind=pytorchjob"):
        load_spec("configs/llama3_70b.yaml", ["launcher.kind=trainjob"], env={})
    assert load_spec("configs/llama3_70b.yaml", env={}).launcher.job_kind == "pytorchjob"
    assert load_spec(None, ["launcher.kind=kubernetes"], env={}).launcher.job_kind == "trainjob"


def test_lr_schedules_warm_up_then_cosine_or_hold_and_decay_to_the_floor():
    from pipelines.train.trainer import lr_at

    base = ["train.steps=100", "train.warmup_steps=10", "train.lr=0.001", "train.min_lr_ratio=0.1"]
    cos = load_spec(None, base, env={})
    wsd = load_spec(None, base + ["train.schedule=wsd", "train.decay_fraction=0.2"], env={})
    for spec in (cos, wsd):
        assert lr_at(0, spec) == pytest.approx(1e-4) and lr_at(9, spec) == pytest.approx(1e-3)  # linear warmup
        assert lr_at(99, spec) == pytest.approx(1e-4, rel=0.01)  # (about) the floor at the last step
    cos_lrs = [lr_at(s, cos) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(cos_lrs, cos_lrs[1:])) and lr_at(55, cos) == pytest.approx(5.5e-4)
    # WSD: flat at the peak through step 79, then linear to the floor over the last 20 steps
    assert all(lr_at(s, wsd) == 1e-3 for s in range(10, 80))
    assert lr_at(89, wsd) == pytest.approx(1e-3 - 0.9e-3 * 10 / 20)
    decay = [lr_at(s, wsd) for s in range(80, 100)]
    assert decay[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(decay, decay[1:]))
    with pytest.raises(SpecError, match="decay_fraction"):
        load_spec(None, ["train.decay_fraction=0"], env={})


def _gpu_mfu(name: str):
    import importlib.util

    from conftest import ROOT

    mod = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "gpu_mfu.py")
    gm = importlib.util.module_from_spec(mod)
    mod.loader.exec_module(gm)
    return gm


def test_gpu_mfu_benchmark_runs_its_cpu_smoke_and_refuses_without_a_gpu(tmp_path, capsys):
    import torch

    gm = _gpu_mfu("gpu_mfu")
    out = tmp_path / "gpu_mfu.json"
    assert gm.main(["--cpu-smoke", "--steps", "3", "--warmup", "2", "--eager-anchor", "--out", str(out),
                    "--variant", "train.loss_chunk_tokens=0", "--variant", "model.n_layers=1"]) == 0
    res = json.loads(out.read_text())
    assert [r["impl"] for r in res["rows"]] == ["ours (trainer step)", "nanoGPT recipe (torch.compile(model))",
                                                "eager (no compile)", "ours with train.loss_chunk_tokens=0",
                                                "ours with model.n_layers=1"]
    fpt = [r["flops_per_token"] for r in res["rows"]]  # each row's MFU from its own model: a model.* variant's
    assert fpt[:4] == [res["flops_per_token"]] * 4 and fpt[4] < fpt[0]
    del res["rows"][4]
    assert [r["mode"] for r in res["rows"][1:3]] == ["compiled", "eager"]  # the anchor as nanoGPT runs: compiled
    assert [r["anchor"] for r in res["rows"]] == [False, True, True, False] and res["loss_chunk_tokens"] == "auto"
    assert [r["loss_chunk_tokens"] for r in res["rows"]] == ["auto", "auto", "auto", 0]  # the variant's own spec
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in res["rows"])  # no MFU on CPU
    fastest = max(res["rows"][1:3], key=lambda r: r["tokens_per_s"])
    assert res["anchor"] == fastest["impl"]  # no speed assertion: the comparison runs, the figures are reported
    assert res["ratio"] == pytest.approx(res["rows"][0]["tokens_per_s"] / fastest["tokens_per_s"])
    assert "vs the fastest anchor" in capsys.readouterr().out
    plan = P.memory_plan(load_spec("configs/gpu_350m.yaml", env={}))
    assert 350e6 <= plan["params"] <= 1e9 and plan["fits"]  # the measured config is in the issue's range
    big = P.memory_plan(load_spec("configs/gpu_1b.yaml", env={}))
    assert 0.85e9 <= big["params"] <= 1.1e9 and big["fits"]  # and the "~1 B config"
    # a variant that is no setting stops before any row runs: one line, exit 2
    assert gm.main(["--cpu-smoke", "--variant", "train.no_such=1", "--out", str(tmp_path / "v.json")]) == 2
    assert "no_such" in capsys.readouterr().err and not (tmp_path / "v.json").exists()
    if not torch.cuda.is_available():
        assert gm.main(["--out", str(tmp_path / "x.json")]) == 2 and not (tmp_path / "x.json").exists()
        assert "no CUDA device here" in capsys.readouterr().err


def test_gpu_mfu_rounds_combine_to_medians_and_a_paired_median_ratio():
    """--rounds N: a row's figures are its medians over the rounds, the ratio the median of each round's own ours ÷
    its fastest anchor (not the ratio of the medians), a row that failed in any round is an error row."""
    gm = _gpu_mfu("gpu_mfu_rounds")

    def row(impl, anchor, tps, mem=None):
        return {"impl": impl, "anchor": anchor, "tokens_per_s": tps, "step_ms": 1e3 / tps, "mfu": None,
                "peak_mem_gib": mem, "warmup_s": 1.0}

    # the host drifts: round 2 is twice as slow, round 3 four times as fast; ours is 1.1× the anchor in each
    rounds = [[row("ours", False, 110.0, 2.0), row("recipe", True, 100.0, 3.0)],
              [row("ours", False, 55.0, 2.5), row("recipe", True, 50.0, 3.0)],
              [row("ours", False, 440.0, 2.0), row("recipe", True, 400.0, 3.5)]]
    rows = gm.combine(rounds)
    assert [r["tokens_per_s"] for r in rows] == [110.0, 100.0] and [r["peak_mem_gib"] for r in rows] == [2.5, 3.5]
    assert rows[0]["rounds_tokens_per_s"] == [110.0, 55.0, 440.0] and rows[0]["mfu"] is None
    res = gm.summarise({}, rows, complete=True, rounds=rounds)
    assert res["ratio_rounds"] == pytest.approx([1.1] * 3) and res["ratio"] == pytest.approx(1.1)
    assert res["anchor"] == "recipe" and "median over 3 rounds" in res["ratio_of"]
    # drift that the medians of each row would misread: the paired ratio is what ours does in the same round
    rounds = [[row("ours", False, 100.0), row("recipe", True, 300.0)],
              [row("ours", False, 200.0), row("recipe", True, 100.0)],
              [row("ours", False, 300.0), row("recipe", True, 200.0)]]
    res = gm.summarise({}, gm.combine(rounds), complete=True, rounds=rounds)
    assert res["ratio"] == pytest.approx(1.5) and res["rows"][0]["tokens_per_s"] == 200.0
    # a row that failed in one round is that round's error row, and there is no ratio without an anchor
    rounds[1][1] = {"impl": "recipe", "anchor": True, "error": "RuntimeError: out of memory"}
    res = gm.summarise({}, gm.combine(rounds), complete=True, rounds=rounds)
    assert res["rows"][1]["error"].startswith("RuntimeError") and res["ratio"] is None and res["anchor"] is None
    assert res["rows"][1]["failed_in_round"] == 2 and res["rows"][1]["rounds_tokens_per_s"] == [300.0, 200.0]
    # a round measured in part (the partial JSON): only the rows measured count, a ratio once both ran in a round
    part = [rounds[0], [None, row("recipe", True, 100.0)]]
    rows = gm.combine(part)
    assert rows[0]["rounds_tokens_per_s"] == [100.0] and rows[1]["tokens_per_s"] == 200.0
    assert gm.summarise({}, rows, complete=False, rounds=part)["ratio_rounds"] == pytest.approx([1 / 3])
    part = [rounds[0], [row("ours", False, 900.0), None]]  # round 2's anchor not yet measured: no pair of it
    assert gm.summarise({}, gm.combine(part), complete=False, rounds=part)["ratio_rounds"] == pytest.approx([1 / 3])
    # two anchors: every round paired with the fastest by its median, not with whichever was ahead in that round
    rounds = [[row("ours", False, 110.0), row("recipe", True, 100.0), row("eager", True, 120.0, 1.0)],
              [row("ours", False, 110.0), row("recipe", True, 100.0), row("eager", True, 90.0)],
              [row("ours", False, 110.0), row("recipe", True, 100.0), row("eager", True, 90.0)]]
    res = gm.summarise({}, gm.combine(rounds), complete=True, rounds=rounds)
    assert res["anchor"] == "recipe" and res["ratio_rounds"] == pytest.approx([1.1] * 3)
    assert res["rows"][2]["peak_mem_gib"] == 1.0  # a figure missing in some rounds: the others'


def test_gpu_mfu_cpu_smoke_over_two_rounds_alternates_the_order(tmp_path, capsys):
    gm = _gpu_mfu("gpu_mfu_two")
    out = tmp_path / "gpu_mfu.json"
    assert gm.main(["--cpu-smoke", "--steps", "2", "--warmup", "1", "--rounds", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["complete"] and res["rounds"] == 2 and len(res["ratio_rounds"]) == 2
    assert [r["impl"] for r in res["rows"]] == ["ours (trainer step)", "nanoGPT recipe (torch.compile(model))"]
    assert all(len(r["rounds_tokens_per_s"]) == 2 for r in res["rows"])
    printed = capsys.readouterr().out
    order = [line.split("| ")[1].strip() for line in printed.splitlines() if line.startswith("gpu_mfu: round")]
    ours, recipe = "ours (trainer step)", "nanoGPT recipe (torch.compile(model))"
    assert order == [ours, recipe, recipe, ours]  # round 2 reversed
    assert "ratio per round" in printed
    with pytest.raises(SystemExit) as stopped:
        gm.main(["--cpu-smoke", "--rounds", "0", "--out", str(tmp_path / "z.json")])
    assert stopped.value.code == 2
    assert "must be 1 or more" in capsys.readouterr().err and not (tmp_path / "z.json").exists()


def test_gpu_mfu_without_compile_and_a_row_that_fails_keeps_the_others(tmp_path, capsys, monkeypatch):
    """--no-compile (gpu_checks.sh's fallback where torch.compile fails): no row compiles, the recipe's says so; a
    row that raises is an error row, the rows measured are written, exit 1."""
    gm = _gpu_mfu("gpu_mfu_nc")
    out = tmp_path / "gpu_mfu.json"
    assert gm.main(["--cpu-smoke", "--no-compile", "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["impl"], r["mode"]) for r in res["rows"]] == [
        ("ours (trainer step)", "single"), ("nanoGPT recipe, eager (--no-compile)", "eager")]
    assert res["complete"] and res["compile"] is False and res["ratio"] > 0

    def broken(spec, device):
        raise RuntimeError("CUDA out of memory (simulated)")
    monkeypatch.setattr(gm, "eager_step", broken)
    assert gm.main(["--cpu-smoke", "--no-compile", "--steps", "2", "--warmup", "1", "--out", str(out)]) == 1
    res = json.loads(out.read_text())
    assert res["rows"][0]["tokens_per_s"] > 0 and res["rows"][1]["error"].startswith("RuntimeError: CUDA out of")
    assert res["ratio"] is None and res["anchor"] is None and res["complete"]
    printed = capsys.readouterr()
    assert "row 1/2" in printed.out and "ratio: none" in printed.out and "1 row(s) failed" in printed.err
