"""The eval plane on real parts: bits-per-byte by hand, lm-evaluation-harness offline, the gate on a real
MLflow registry (re-scoring the champion), and `mlflow models serve` answering HTTP."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sysconfig
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import numpy as np
import torch
import torch.nn.functional as F

from conftest import c4_docs, free_port, serving, shard_layout, wait_for
from pipelines.data import tokenize
from pipelines.eval import bpb, harness, registry, scorer
from pipelines.eval.lm import TextModel
from pipelines.eval_sets import set_sha256
from pipelines.spec import TokenizerCfg, load_spec
from pipelines.train.model import ModelArgs, Transformer


def _model_dir(d: Path, seed: int, sp_model: Path, seq_len: int = 256) -> Path:
    import sentencepiece as spm

    d.mkdir(parents=True)
    vocab = spm.SentencePieceProcessor(model_file=str(sp_model)).get_piece_size()
    torch.manual_seed(seed)
    a = ModelArgs(vocab_size=vocab, n_layers=1, d_model=32, n_heads=2, seq_len=seq_len)
    torch.save(Transformer(a).state_dict(), d / "model.pt")
    (d / "model_args.json").write_text(json.dumps(a.to_dict()))
    (d / "tokenizer.model").write_bytes(sp_model.read_bytes())
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two small random models (different seeds) sharing a SentencePiece model trained on C4 docs."""
    root = tmp_path_factory.mktemp("models")
    sp = tokenize.train_sentencepiece([tokenize.canonical_text(d["text"]) for d in c4_docs(200)], root / "sp",
                                      TokenizerCfg(vocab_size=400), seed=1)
    return _model_dir(root / "a", 1, sp), _model_dir(root / "b", 2, sp)


@torch.no_grad()
def _hand_nats(tm: TextModel, ids: list[int]) -> tuple[float, int]:
    """The definition, one window and one token at a time."""
    L, nats, scored = tm.seq_len, 0.0, 0
    for start in range(0, len(ids) - 1, L):
        w = ids[start:start + L + 1]
        logp = F.log_softmax(tm.model(torch.tensor([w[:-1]])).float()[0], -1)
        for j in range(1, len(w)):
            nats -= float(logp[j - 1, w[j]])
            scored += 1
    return nats, scored


def test_bits_per_byte_equals_a_hand_computation(models, tmp_path):
    tm = TextModel.load(models[0])
    text = "Ünïcode café\r\nand a second line. " * 50  # NFKC and \r\n normalisation, several windows, a short last one
    f = tmp_path / "t.txt"
    f.write_text(text, encoding="utf-8")
    norm = tokenize.canonical_text(text)
    ids = tm.encode(norm)
    assert len(ids) > 2 * tm.seq_len and (len(ids) - 1) % tm.seq_len  # a shorter last window
    nats, scored = _hand_nats(tm, ids)
    assert scored == len(ids) - 1  # every token but t[0], once
    r = bpb.bits_per_byte(tm, bpb.read_text(f))
    assert r["tokens"] == len(ids) and r["bytes"] == len(norm.encode("utf-8"))
    assert r["nats"] == pytest.approx(nats, rel=1e-5)
    assert r["bits_per_byte"] == pytest.approx(nats / math.log(2) / len(norm.encode("utf-8")), rel=1e-5)
    # the CLI prints the same object
    out = subprocess.run([sys.executable, "-m", "pipelines.eval.bpb", "--model-uri", str(models[0]), "--text-file",
                          str(f)], capture_output=True, text=True, check=True).stdout
    cli = json.loads(out)
    assert set(cli) == {"bits_per_byte", "nats", "tokens", "bytes"}
    assert cli["nats"] == pytest.approx(nats, rel=1e-5) and cli["bytes"] == r["bytes"]


class _Share(scorer.Ranks):
    """One rank's share, not summed: the test adds the ranks' partial sums itself."""

    def sum(self, values: list[float]) -> list[float]:
        return values


def test_heldout_loss_is_the_hand_computation_over_the_stream_whatever_the_shards(models, tmp_path):
    sp_model = models[0] / "tokenizer.model"
    tm = TextModel.load(_model_dir(tmp_path / "m8", 5, sp_model, seq_len=4))  # 4-token windows: several chunks
    rng = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 400, (int(n),), generator=rng).numpy() for n in torch.randint(1, 200, (100,), generator=rng)]
    flat = [int(t) for d in docs for t in d]

    def job(name: str, cuts: list[int]) -> scorer.Job:
        return scorer.Job(model_dir="", heldout=shard_layout(tmp_path / name, docs, cuts),
                          heldout_text_bytes=len(flat) * 3, heldout_tokens=len(flat))

    nats, scored = _hand_nats(tm, flat)
    one, four = job("one", []), job("four", [3, 4, 30])
    assert len(flat) > 2 * tm.seq_len * 1024  # more than two of the scorer's chunks
    for j in (one, four):
        r = scorer.heldout_scores(tm, j, scorer.Ranks(), 16, None)
        assert r["heldout_tokens_scored"] == scored == len(flat) - 1
        assert r["heldout_loss"] == pytest.approx(nats / scored, rel=1e-5)
    shares = [scorer.heldout_scores(tm, four, _Share(r, 2), 16, None)["heldout_loss"] * scored for r in range(2)]
    assert sum(shares) == pytest.approx(nats, rel=1e-5) and all(x > 0 for x in shares)
    capped = scorer.heldout_scores(tm, four, scorer.Ranks(), 16, 1000)
    assert capped["heldout_tokens_scored"] == 1000
    assert capped["heldout_loss"] == pytest.approx(_hand_nats(tm, flat[:1001])[0] / 1000, rel=1e-5)


def test_a_heldout_shard_with_an_id_outside_the_vocabulary_stops_scoring_with_one_line_and_exit_2(models, home):
    """A damaged or foreign held-out shard is named (file, id, position) on the host before the model sees it, in
    one process and on the launcher's ranks (their outcome file makes the stage exit 2, not a retry)."""
    from pipelines.eval.evaluate import score_model_dir
    from pipelines.launch.ranks import TrainError

    docs = [np.arange(n, dtype=np.int64) % 400 for n in (300, 500, 700)]
    docs[2][650] = 400  # the first id the 400-piece tokenizer cannot have written, in the last shard
    job = scorer.Job(model_dir=str(models[0]), heldout=shard_layout(home / "h", docs, [1, 2]),
                     heldout_text_bytes=4500, heldout_tokens=1500, parts=["heldout"])
    spec = _spec(home, "vocab", [Path(__file__)])
    where = r"train-00002-0000\.bin holds token id 400 \(held-out token 1450\), outside the model's tokenizer vocab"
    with pytest.raises(scorer.HeldoutShardError, match=where) as e:
        scorer.score(spec, job)
    assert e.value.exit_code == 2
    spec.eval.single_process_max_params = 0
    with pytest.raises(TrainError, match=where) as e:
        score_model_dir(spec, job, home / "ranks", run_id="vocab")
    assert e.value.exit_code == 2
    # a restarted rank (a pod's torchrun on Kubernetes) finds the final stop and does not load the model again
    outcome = json.loads((home / "ranks" / "exit-rank0.json").read_text())
    assert outcome["code"] == 2 and outcome["final"] is True
    assert scorer.main(["--job", "/nonexistent", "--out", str(home / "ranks" / "scores.json")]) == 2


@torch.no_grad()
def _direct_loglikelihood(tm: TextModel, context: str, continuation: str) -> float:
    """log p(continuation | context) from one plain forward pass over the whole encoded pair."""
    whole, ctx = tm.encode(context + continuation), tm.encode(context)
    assert len(whole) <= tm.seq_len + 1  # one plain forward pass, no truncation
    logp = F.log_softmax(tm.model(torch.tensor([whole[:-1]])).float()[0], -1)
    return sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))


def test_harness_runs_the_three_tasks_offline_with_our_loglikelihoods(models):
    from lm_eval import simple_evaluate

    tm = TextModel.load(models[0])
    res = harness.evaluate(tm, list(harness.TASKS), limit=12)
    scores = harness.headline(res)
    for task in harness.TASKS:
        assert 0.0 <= scores[f"harness.{task}.acc"] <= 1.0
        assert res["n-samples"][task]["effective"] == 12
    assert scores["harness.llmp_lambada_openai.perplexity"] > 1.0
    # what the harness recorded for each request equals our direct computation
    out = simple_evaluate(model=harness.PipelineLM(text_model=tm, batch_size=3), tasks=["llmp_arc_easy", "llmp_hellaswag"],
                          limit=4, task_manager=harness.task_manager(), log_samples=True, bootstrap_iters=0)
    checked = 0
    for task, samples in out["samples"].items():
        for s in samples:
            for (ctx, cont), resp in zip(s["arguments"], s["resps"]):
                ctx, cont = (ctx, cont) if isinstance(ctx, str) else (ctx["arg_0"], ctx["arg_1"])
                assert resp[0][0] == pytest.approx(_direct_loglikelihood(tm, ctx, cont), abs=1e-4)
                checked += 1
    assert checked >= 8 * 4 // 2


def _spec(home: Path, name: str, refs: list[Path], **sets):
    return load_spec(None, [f"registry.model_name={name}", f"eval.reference={json.dumps([str(p) for p in refs])}",
                            *[f"{k}={v}" for k, v in sets.items()]], env={})


def _ev_extra(spec, sha: str) -> dict:
    return {"reference_sha256": sha, "reference": {"files": {Path(p).name: {} for p in spec.eval.reference}},
            "tasks": list(spec.eval.tasks), "limit": spec.eval.limit}


def test_gate_moves_only_to_no_worse_on_the_same_set_and_rescores_the_champion_on_a_new_one(models, home):
    from pipelines import tracking
    from pipelines.eval.evaluate import reference_files

    ref_a, ref_b = home / "a.txt", home / "b.txt"
    ref_a.write_text("The cat sat on the mat. " * 20)
    ref_b.write_text("A different reference set, with other words in it. " * 20)
    spec = _spec(home, "gate-test", [ref_a])
    sha_a = set_sha256(reference_files(spec))
    run_id = tracking.start_run(spec, run_name="t")
    lineage = {"data_manifest_hash": "d" * 64, "tokenizer_hash": "t" * 64, "config_hash": "c" * 64}
    reg = lambda s, ck, value, sha: registry.register(  # noqa: E731
        s, ck, run_id, lineage, {"reference_bpb": value, "heldout_loss": 5.0}, _ev_extra(s, sha), home / "w")
    c = tracking.client(spec)
    champ = lambda: str(c.get_model_version_by_alias("gate-test", "champion").version)  # noqa: E731

    assert reg(spec, models[0], 2.0, sha_a)["alias_moved"] and champ() == "1"
    v1 = c.get_model_version("gate-test", "1")
    for k, v in {**lineage, "reference_sha256": sha_a, "reference_bpb": "2.000000"}.items():
        assert v1.tags[k] == v
    worse = reg(spec, models[1], 2.5, sha_a)
    assert not worse["alias_moved"] and champ() == "1" and "2.5000 > 'champion' v1's 2.0000" in worse["reason"]
    assert str(c.get_model_version_by_alias("gate-test", "challenger").version) == "2"
    assert reg(spec, models[1], 1.5, sha_a)["alias_moved"] and champ() == "3"

    # a new reference set: the champion (v3 = models[1]) is scored on it before the comparison
    spec_b = _spec(home, "gate-test", [ref_b])
    sha_b = set_sha256(reference_files(spec_b))
    truth = bpb.bits_per_byte(TextModel.load(models[1]), bpb.read_text(ref_b))["bits_per_byte"]
    stays = reg(spec_b, models[0], truth + 0.01, sha_b)
    assert stays["champion_rescored"] and not stays["alias_moved"] and champ() == "3"
    assert stays["previous_value"] == pytest.approx(truth, rel=1e-5)
    assert float(c.get_model_version("gate-test", "3").tags[f"reference_bpb.{sha_b[:12]}"]) == pytest.approx(truth, rel=1e-5)
    moves = reg(spec_b, models[0], truth - 0.01, sha_b)  # the tag is reused, no second re-score
    assert moves["alias_moved"] and not moves["champion_rescored"] and champ() == "5"
    run_tags = c.get_run(run_id).data.tags
    assert run_tags["register.gate"] == moves["reason"]


def test_load_registered_and_mlflow_models_serve_answer_with_generated_text(models, home):
    from pipelines import tracking
    from pipelines.eval import load_registered

    spec = _spec(home, "serve-test", [Path(__file__)])
    run_id = tracking.start_run(spec, run_name="serve")
    registry.register(spec, models[0], run_id, {}, {"reference_bpb": 3.0}, _ev_extra(spec, "s" * 64), home / "w")
    uri, turi = "models:/serve-test@champion", tracking.tracking_uri(spec)
    model, sp = load_registered(uri, turi)
    assert isinstance(model, Transformer) and not model.training and sp.get_piece_size() == model.args.vocab_size
    from pipelines.eval.model_dir import download  # a model small enough to load here carries its input example
    assert (download(uri, turi, home / "dl") / "serving_input_example.json").is_file()
    ref = TextModel.load(models[0])
    for a, b in zip(model.state_dict().values(), ref.model.state_dict().values()):
        assert torch.equal(a, b)
    expect = ref.generate("Once upon a time", max_new_tokens=6, temperature=0.8, top_k=20, seed=3)

    env = {**os.environ, "MLFLOW_TRACKING_URI": turi, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    log = home / "serve.log"

    def start(port: int) -> subprocess.Popen:
        return subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", uri,
                                 "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port), "--workers",
                                 "1"], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    proc, port = serving(start, log.read_text, path="/ping")
    try:
        body = json.dumps({"inputs": ["Once upon a time"],
                           "params": {"max_new_tokens": 6, "temperature": 0.8, "top_k": 20, "seed": 3}}).encode()
        deadline, answer = time.time() + 120, None
        while time.time() < deadline and proc.poll() is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body,
                                             {"Content-Type": "application/json"})
                answer = json.loads(urllib.request.urlopen(req, timeout=30).read())
                break
            except OSError:
                time.sleep(1)
        assert answer is not None, log.read_text()[-20000:] if proc.poll() is not None else "timeout"
        assert answer == {"predictions": [expect]} and expect.strip()
    finally:  # the server and every process it started (uvicorn runs in a session of its own)
        import psutil

        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:
            p.terminate()
        gone, alive = psutil.wait_procs(tree, timeout=30)
        for p in alive:
            p.kill()
        proc.wait(timeout=30)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)


def test_a_model_above_the_single_process_limit_is_scored_on_the_launcher_ranks(models, home):
    from pipelines.eval.evaluate import reference_files, score_model_dir
    from pipelines.eval.scorer import Job, score

    ref = home / "r.txt"
    ref.write_text(" ".join(d["text"] for d in c4_docs(5)))
    spec = _spec(home, "ranks", [ref], **{"eval.limit": 6, "eval.tasks": '["llmp_arc_easy","llmp_lambada_openai"]'})
    job = Job(model_dir=str(models[0]), reference=reference_files(spec), parts=["reference", "harness"])
    one = score(spec, job)
    spec.eval.single_process_max_params = 0
    two = score_model_dir(spec, job, home / "ranks", run_id="t")
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert two["reference"]["nats"] == pytest.approx(one["reference"]["nats"], rel=1e-6)
    assert two["harness"]["scores"] == pytest.approx(one["harness"]["scores"], rel=1e-6)


def test_the_harness_own_command_line_finds_llm_pipeline(models, tmp_path):
    """The harness's own CLI (every `lm_eval` flag) with `--model llm-pipeline`, in a fresh interpreter: the module
    registers our model where the harness runs, with no hook in site-packages."""
    site = Path(sysconfig.get_paths()["purelib"])
    assert not [p.name for p in site.glob("*.pth") if "site_hooks" in p.read_text()]
    r = subprocess.run([sys.executable, "-m", "pipelines.eval.lm_eval_cli", "--model", "llm-pipeline", "--model_args", f"uri={models[0]}", "--include_path",
                        str(harness.TASKS_DIR), "--tasks", "llmp_arc_easy", "--limit", "3", "--output_path", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    assert results["results"]["llmp_arc_easy"]["acc,none"] in (0.0, 1 / 3, 2 / 3, 1.0)


def test_the_harness_cli_writes_lm_evals_results_dict(models, tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "pipelines.eval.harness", "--model-uri", str(models[0]), "--tasks",
                        "llmp_arc_easy,llmp_hellaswag,llmp_lambada_openai", "--limit", "4", "--output", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert set(res) == set(harness.TASKS) and all("acc,none" in res[t] for t in res)


def test_the_gate_fails_closed_and_a_retried_register_makes_one_version(models, home):
    """An unreadable champion fails the registration and moves no alias; the same registration twice is one
    version; a held-out gate across corpora is refused."""
    from pipelines import tracking
    from pipelines.eval.evaluate import reference_files

    ref_a, ref_b = home / "a.txt", home / "b.txt"
    ref_a.write_text("The cat sat on the mat. " * 20)
    ref_b.write_text("Another set of words for the reference. " * 20)
    spec = _spec(home, "closed", [ref_a])
    sha_a = set_sha256(reference_files(spec))
    run_id = tracking.start_run(spec, run_name="t")
    lineage = {"data_manifest_hash": "d" * 64, "config_hash": "c" * 64}
    c = tracking.client(spec)
    versions = lambda: sorted(int(v.version) for v in c.search_model_versions("name = 'closed'"))  # noqa: E731

    first = registry.register(spec, models[0], run_id, lineage, {"reference_bpb": 2.0, "heldout_loss": 5.0},
                              _ev_extra(spec, sha_a), home / "w")
    again = registry.register(spec, models[0], run_id, lineage, {"reference_bpb": 2.0, "heldout_loss": 5.0},
                              _ev_extra(spec, sha_a), home / "w")  # a retry after the version was made
    assert versions() == [1] and again["reused_version"] and not first["reused_version"]
    assert again["alias_moved"] and str(c.get_model_version_by_alias("closed", "champion").version) == "1"

    # the champion's artifact cannot be read: re-scoring it on a new reference set fails, nothing moves or appears
    art = Path(urllib.parse.urlparse(c.get_logged_model(first["model_id"]).artifact_location).path)
    for f in art.rglob("model.pt"):
        f.write_bytes(b"not a state dict")
    spec_b = _spec(home, "closed", [ref_b])
    sha_b = set_sha256(reference_files(spec_b))
    for _ in range(2):  # the task's retries meet the same failure
        with pytest.raises(registry.GateError, match="could not be re-scored"):
            registry.register(spec_b, models[1], run_id, lineage, {"reference_bpb": 0.5}, _ev_extra(spec_b, sha_b),
                              home / "w2")
    assert versions() == [1] and str(c.get_model_version_by_alias("closed", "champion").version) == "1"
    # the register CLI turns it into exit 1 (retried), not 2
    assert registry.GateError.exit_code == 1 and registry.NotComparable.exit_code == 2

    # heldout_* across corpora is refused; on the same corpus it compares
    held = _spec(home, "closed", [ref_a], **{"registry.gate_metric": "heldout_loss"})
    with pytest.raises(registry.NotComparable, match="trained on other data"):
        registry.register(held, models[1], run_id, {**lineage, "data_manifest_hash": "e" * 64},
                          {"reference_bpb": 1.0, "heldout_loss": 4.0}, _ev_extra(held, sha_a), home / "w3")
    same = registry.register(held, models[1], run_id, lineage, {"reference_bpb": 1.0, "heldout_loss": 4.0},
                             _ev_extra(held, sha_a), home / "w3")
    assert same["alias_moved"] and "heldout_loss 4.0000 ≤ 'champion' v1's 5.0000 on the same data" in same["reason"]


def test_two_registrations_of_one_model_take_turns_from_the_gate_to_the_alias(models, home, capsys):
    """Each registration reads the champion, then moves the alias on what it read: two at once (the evaluation DAG
    and llm_pipeline, a CLI run) each took the alias on a champion the other was replacing, and the last to set it
    won, however it compared. They now take turns on the model's lock (under run.root/register): the second waits while
    the first holds it, then gates against what the first registered."""
    import threading

    from pipelines import tracking
    from pipelines.eval.evaluate import reference_files

    ref = home / "a.txt"
    ref.write_text("The cat sat on the mat. " * 20)
    spec = _spec(home, "turns", [ref])
    sha = set_sha256(reference_files(spec))
    run_id = tracking.start_run(spec, run_name="t")
    c = tracking.client(spec)
    got = {}

    def second():
        got["r"] = registry.register(spec, models[1], run_id, {"data_manifest_hash": "d" * 64, "config_hash": "c" * 64},
                                     {"reference_bpb": 3.0}, _ev_extra(spec, sha), home / "w2")

    with registry.model_lock(spec, "turns"):  # a registration of this model in progress elsewhere
        t = threading.Thread(target=second, daemon=True)
        t.start()
        wait_for(lambda: "another registration of turns holds" in capsys.readouterr().out, 120,
                 "the second registration waiting for the lock")
        assert t.is_alive() and not list(c.search_model_versions("name = 'turns'"))  # nothing gated or made
    t.join(300)
    assert not t.is_alive() and got["r"]["alias_moved"] and got["r"]["version"] == 1
    worse = registry.register(spec, models[0], run_id, {"data_manifest_hash": "e" * 64, "config_hash": "c" * 64},
                              {"reference_bpb": 4.0}, _ev_extra(spec, sha), home / "w3")
    assert not worse["alias_moved"] and str(c.get_model_version_by_alias("turns", "champion").version) == "1"
    assert list(home.rglob("register/.model-turns-*.lock"))  # under run.root, where every register of a cluster looks


def test_a_champion_that_cannot_be_read_or_rescored_says_whose_it_is_to_fix():
    """The gate never fails open; how it fails says who acts: what did not answer (MLflow, the artifact store, a
    disk, the ranks' infrastructure) is 75; a champion no retry can re-score (not an llm-pipeline model, ranks that
    rejected it, a file or a registry that refuses this identity) is 2 (it was 1, retried twice, a large champion re-scored
    on GPU ranks each time); anything else stays 1. A stage meeting MLflow down anywhere else exits 75 in one line."""
    import errno

    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, TEMPORARILY_UNAVAILABLE

    from pipelines.cli import stage_main
    from pipelines.eval.model_dir import ModelUnavailable
    from pipelines.launch.ranks import TrainError, TrainRetry

    down = MlflowException("the tracking server is restarting", error_code=TEMPORARILY_UNAVAILABLE)
    cases = [(down, 75), (ModelUnavailable("models:/x/1: not returned"), 75), (TrainRetry("ranks lost"), 75),
             (OSError(errno.EIO, "Input/output error"), 75), (LookupError("not an llm-pipeline text model"), 2),
             (TrainError("the ranks rejected the model"), 2), (RuntimeError("a bug"), 1),
             (PermissionError(errno.EACCES, "Permission denied"), 2)]
    for e, code in cases:
        got = registry.unscored("'champion' v1 could not be re-scored", e)
        assert got.exit_code == code, (e, got)
        assert isinstance(got, registry.NotComparable if code == 2 else registry.GateError), (e, got)

    class Registry:
        def __init__(self, error):
            self.error = error

        def get_registered_model(self, name):
            raise self.error

    with pytest.raises(registry.GateError) as e:
        registry.current_champion(Registry(down), "m", "champion")
    assert e.value.exit_code == 75
    with pytest.raises(registry.NotComparable):
        registry.current_champion(Registry(MlflowException("no", error_code=PERMISSION_DENIED)), "m", "champion")

    def run(spec, *ups, out_dir=None):
        raise down

    assert stage_main("register", run, str, argv=[], inputs_required=False) == 75


def test_the_version_is_a_logged_model_of_the_training_run_with_its_metrics_on_datasets(models, home):
    from pipelines import tracking
    from pipelines.eval.evaluate import reference_files

    ref = home / "r.txt"
    ref.write_text("Some reference text to score. " * 30)
    spec = _spec(home, "lineage", [ref])
    sha = set_sha256(reference_files(spec))
    c = tracking.client(spec)
    train_run = tracking.start_run(spec, run_name="train")
    for step, loss in enumerate([5.0, 4.0, 3.5]):
        c.log_metric(train_run, "train/loss", loss, step=step)
    eval_run = tracking.start_run(spec, run_name="eval")
    extra = {**_ev_extra(spec, sha), "task_sha256": {"llmp_arc_easy": "a" * 64}}
    res = registry.register(spec, models[0], train_run, {"data_manifest_hash": "d" * 64},
                            {"reference_bpb": 2.5, "harness.llmp_arc_easy.acc": 0.3}, extra, home / "w",
                            eval_run_id=eval_run)
    mv = c.get_model_version("lineage", str(res["version"]))
    assert mv.source == f"models:/{res['model_id']}" and res["model_id"].startswith("m-")
    lm = c.get_logged_model(res["model_id"])
    assert lm.source_run_id == train_run
    metrics = {m.key: m for m in lm.metrics}
    assert metrics["reference_bpb"].value == pytest.approx(2.5)
    assert metrics["reference_bpb"].dataset_name == "reference" and metrics["reference_bpb"].dataset_digest == sha[:12]
    assert metrics["harness.llmp_arc_easy.acc"].dataset_name == "llmp_arc_easy"
    assert metrics["harness.llmp_arc_easy.acc"].dataset_digest == "a" * 12
    # from the version, one hop to the training run's loss curve; the evaluation run hangs under it
    assert [m.value for m in c.get_metric_history(mv.run_id, "train/loss")] == [5.0, 4.0, 3.5]
    assert c.get_run(eval_run).data.tags["mlflow.parentRunId"] == train_run
    assert {d.dataset.name for d in c.get_run(eval_run).inputs.dataset_inputs} == {"reference", "llmp_arc_easy"}


def test_batched_generation_with_the_kv_cache_equals_generation_without_it(models):
    tm = TextModel.load(models[0])
    prompts = ["Once upon a time", "The", "A longer prompt about the weather in the old city of", "x y z"]
    for temperature, top_k in ((0.0, 0), (0.9, 20), (1.2, 0)):
        plain = [tm.generate(p, 40, temperature, top_k, seed=3) for p in prompts]
        assert tm.generate_batch(prompts, 40, temperature, top_k, seed=3) == plain
        assert [tm.generate_batch([p], 40, temperature, top_k, seed=3)[0] for p in prompts] == plain
    assert tm.generate_batch(prompts, 12, 0.8, 20, seed=1, stop=["e"]) == \
        [tm.generate(p, 12, 0.8, 20, seed=1, stop=["e"]) for p in prompts]
    # past seq_len the window slides: the batch falls back to the uncached path, same text
    long = ["word " * (tm.seq_len - 10)]
    assert tm.generate_batch(long, 30, 0.8, 20, seed=2) == [tm.generate(long[0], 30, 0.8, 20, seed=2)]


def test_the_served_model_refuses_max_new_tokens_above_its_cap_with_400(models, home):
    from fastapi.testclient import TestClient
    from mlflow.pyfunc import load_model, scoring_server

    from pipelines import tracking

    spec = _spec(home, "cap-test", [Path(__file__)], **{"eval.max_new_tokens": 16})
    run_id = tracking.start_run(spec, run_name="cap")
    registry.register(spec, models[0], run_id, {}, {"reference_bpb": 3.0}, _ev_extra(spec, "s" * 64), home / "w")
    with tracking.fluent(spec):
        app = scoring_server.init(load_model("models:/cap-test@champion"))
    client = TestClient(app)
    ok = client.post("/invocations", json={"inputs": ["Once upon a time", "The"], "params": {"max_new_tokens": 16}})
    assert ok.status_code == 200 and len(ok.json()["predictions"]) == 2
    too_many = client.post("/invocations", json={"inputs": ["Once"], "params": {"max_new_tokens": 17}})
    assert too_many.status_code == 400 and "max_new_tokens=17" in too_many.text


def test_our_harness_wrapper_agrees_with_lm_evals_own_hf_implementation_on_the_same_items(models):
    """Calibration: the same weights as a Hugging Face Llama, scored by lm-eval's HFLM, give our log-likelihoods."""
    from pipelines.eval import calibrate, export

    tm = TextModel.load(models[0])
    import torch

    ids = torch.tensor([tm.encode("A short text to compare the two models on, token by token.")])
    assert torch.allclose(export.hf_llama(tm.model)(ids).logits, tm.model(ids), atol=1e-5)
    res = calibrate.compare(tm, str(models[0] / "tokenizer.model"), list(harness.TASKS), limit=6)
    assert res["requests"] >= 6 * 3 + 6 * 4 + 6  # ARC-Easy: 3-5 choices an item, HellaSwag 4, LAMBADA 1
    assert res["max_abs_logprob_diff"] < 1e-3 and res["greedy_flags_differing"] == 0
    assert set(res["ours"]) == set(harness.TASKS)
    for task, scores in res["ours"].items():
        assert scores == pytest.approx(res["lm_eval_hflm"][task], rel=1e-3)  # perplexity: exp of a summed logp


def test_register_of_a_model_above_the_single_process_limit_does_not_load_it_in_the_worker(models, home, monkeypatch):
    import shutil

    from pipelines import tracking
    from pipelines.eval import serving
    from pipelines.train.ckpt import dcp_read as checkpoint
    from pipelines.train.ckpt import local as ckpt_local

    tmp = home / "ckpt.tmp"
    shutil.copytree(models[0], tmp)
    ckpt = ckpt_local.commit_local(tmp, home / "step-000010", meta={"step": 10})
    spec = _spec(home, "big", [Path(__file__)], **{"eval.single_process_max_params": 0})
    run_id = tracking.start_run(spec, run_name="big")

    loads = []

    def refuse(*a, **k):  # recorded too: MLflow turns a failed input-example check into a warning
        loads.append(a)
        raise AssertionError("the model was loaded in the registering process")

    from pipelines.eval import export, model_dir
    from pipelines.train import checkpoint as train_checkpoint

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "load_plain_model", refuse)
        # each module's own name for it, imported before the patch: a module first imported under the patch would
        # keep `refuse` after it (a later test of the same worker then failed to export)
        for mod in (serving, export, model_dir, train_checkpoint):
            m.setattr(mod, "load_plain_model", refuse)
        m.setattr(TextModel, "load", refuse)  # the pyfunc's own load (MLflow validates an input example with it)
        res = registry.register(spec, ckpt, run_id, {}, {"reference_bpb": 3.0}, _ev_extra(spec, "s" * 64), home / "w")
    assert not loads
    from pipelines.eval import load_registered

    model, _ = load_registered(f"models:/big/{res['version']}", tracking.tracking_uri(spec))
    ref = TextModel.load(models[0]).model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


def _stock_mlflow_server(tmp_path: Path, port: int) -> subprocess.Popen:
    """``mlflow server`` from the venv's site-packages under ``python -S`` (no ``.pth`` file runs: nothing of this
    project on its path), outside the checkout, with a SQLite backend and artifacts it serves over HTTP."""
    site = sysconfig.get_paths()["purelib"]
    boot = f"import sys; sys.path.append({site!r}); sys.argv[0] = 'mlflow'; from mlflow.cli import cli; cli()"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "MLFLOW_"))}
    srv = tmp_path / "server"
    srv.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-S", "-c", boot, "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{srv / 'mlflow.db'}", "--artifacts-destination",
                             str(srv / "artifacts"), "--workers", "1"], cwd=srv, env=env, start_new_session=True,
                            stdout=open(srv / "log", "w"), stderr=subprocess.STDOUT)


def _serving_stock_mlflow(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """The stock server, answering /health on a port its own process listens on (``conftest.serving``)."""
    return serving(lambda port: _stock_mlflow_server(tmp_path, port), lambda: (tmp_path / "server/log").read_text())


def test_a_stock_mlflow_server_over_http_gets_the_same_lineage(models, home, tmp_path):
    """The pipeline registers to a stock MLflow server over HTTP; read back in a process where no .pth runs, the
    champion's source is the LoggedModel, which holds the eval metrics (no import-time patch on either side)."""
    from pipelines import procs, tracking
    from pipelines.eval.evaluate import reference_files

    server, port = _serving_stock_mlflow(tmp_path)
    try:
        ref = home / "r.txt"
        ref.write_text("Some reference text to score over HTTP. " * 30)
        spec = _spec(home, "stock", [ref], **{"services.mlflow_tracking_uri": f"http://127.0.0.1:{port}"})
        sha = set_sha256(reference_files(spec))
        run_id = tracking.start_run(spec, run_name="train")
        res = registry.register(spec, models[0], run_id, {"data_manifest_hash": "d" * 64}, {"reference_bpb": 2.5},
                                _ev_extra(spec, sha), home / "w")
        assert res["model_id"].startswith("m-") and res["alias_moved"]
        site = sysconfig.get_paths()["purelib"]
        probe = (f"import sys; sys.path.append({site!r}); import json; from mlflow import MlflowClient; "
                 f"c = MlflowClient('http://127.0.0.1:{port}'); v = c.get_model_version_by_alias('stock', 'champion'); "
                 "m = c.get_logged_model(v.source.removeprefix('models:/')); "
                 "print(json.dumps({'source': v.source, 'metrics': {x.key: x.value for x in m.metrics}, "
                 "'pipelines': 'pipelines' in sys.modules}))")
        r = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert r.returncode == 0, r.stderr[-3000:]
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen["source"] == f"models:/{res['model_id']}" and not seen["pipelines"]
        assert seen["metrics"]["reference_bpb"] == pytest.approx(2.5)
    finally:
        procs.stop_group(server.pid, grace_s=10, reap=server.pid)


def test_a_register_that_died_before_the_metrics_reached_the_logged_model_is_completed_by_its_retry(
        models, home, monkeypatch):
    from pipelines import tracking
    from pipelines.eval.evaluate import reference_files

    ref = home / "r.txt"
    ref.write_text("Reference text for the retried registration. " * 30)
    spec = _spec(home, "retried", [ref])
    sha = set_sha256(reference_files(spec))
    run_id = tracking.start_run(spec, run_name="train")
    args = (spec, models[0], run_id, {"data_manifest_hash": "d" * 64}, {"reference_bpb": 2.5}, _ev_extra(spec, sha),
            home / "w")
    real = registry.log_eval_metrics

    def dies(*a, **k):
        raise SystemExit("killed after create_model_version")

    monkeypatch.setattr(registry, "log_eval_metrics", dies)
    with pytest.raises(SystemExit):
        registry.register(*args)
    monkeypatch.setattr(registry, "log_eval_metrics", real)
    res = registry.register(*args)
    assert res["reused_version"] and res["version"] == 1
    metrics = {m.key: m.value for m in tracking.client(spec).get_logged_model(res["model_id"]).metrics}
    assert metrics == {"reference_bpb": pytest.approx(2.5)}


def test_a_model_the_tracking_server_did_not_return_is_a_retry_and_a_missing_one_the_users(tmp_path, monkeypatch,
                                                                                         capsys):
    """Every MLflow error loading a model was "cannot load" and exit 2 (never retried), a server that is down too;
    now only MLflow's answers about the request (no such model, a bad name) are 2, a server that did not answer 75."""
    from pipelines.eval import model_dir

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(model_dir.ModelUnavailable, match="tracking server did not answer") as e:
        model_dir.download("models:/m/1", down)
    assert e.value.exit_code == 75
    with pytest.raises(LookupError, match="cannot load models:/m/1") as e:
        model_dir.download("models:/m/1", f"sqlite:///{tmp_path}/mlflow.db")  # answered: no such model
    assert not isinstance(e.value, model_dir.ModelUnavailable)
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import ENDPOINT_NOT_FOUND, RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

    from pipelines.tracking import mlflow_answered

    no_answer = [MlflowException("API request to http://m/api/2.0/x failed with exception ConnectionError(…)"),
                 MlflowException("API request to endpoint /api/2.0/x failed with error code 503 != 200. Response …"),
                 MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE)]
    answers = [MlflowException("Registered Model with name=m not found", error_code=RESOURCE_DOES_NOT_EXIST),
               MlflowException("API request to endpoint /api/2.0/x failed with error code 404 != 200."),
               MlflowException("Detected out-of-date database schema"),  # INTERNAL_ERROR, the user's to migrate
               MlflowException("no", error_code=ENDPOINT_NOT_FOUND)]
    assert [mlflow_answered(e) for e in no_answer + answers] == [False] * 3 + [True] * 4
    text = tmp_path / "t.txt"
    text.write_text("some text")
    assert bpb.main(["--model-uri", "models:/m/1", "--tracking-uri", down, "--text-file", str(text)]) == 75
    assert "tracking server did not answer" in capsys.readouterr().err
    from pipelines import summary  # the run's summary: a server down is not "no registered versions" (1)

    assert summary.main(["--set", f"services.mlflow_tracking_uri={down}"]) == 75
    assert "summary: the tracking server did not answer" in capsys.readouterr().err
    # the server answered the summary's reads, then not the champion's sample: that line says so, and exit 75
    # (was a traceback and 1)
    told = {"metrics": {}, "tags": {}, "tracking_uri": down, "model": "m", "latest_version": 2, "champion_version": 1,
            "run_id": "r", "prompt": "Once", "model_id": None}
    monkeypatch.setattr(summary, "summarize", lambda spec: told)

    def busy(spec, prompt):
        raise MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE)

    monkeypatch.setattr(summary, "sample", busy)
    assert summary.main([]) == 75
    out, err = capsys.readouterr()
    assert "champion sample     : 'Once' → n/a (the tracking server did not answer: MlflowException)" in out
    assert err.strip() == "summary: the tracking server did not answer for the champion's sample; run it again"
