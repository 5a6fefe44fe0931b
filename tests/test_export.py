"""Export to the ecosystem: the Hugging Face directory loads with transformers' Auto classes and the GGUF file with
transformers' own GGUF reader, to our token ids, our logits (fp32) and our greedy continuation."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import ROOT, c4_docs
from pipelines.data import tokenize
from pipelines.eval import export
from pipelines.spec import TokenizerCfg
from pipelines.train.model import ModelArgs, Transformer

TEXTS = ["Once upon a time, there was a little girl named Lily. She loved to play outside.",
         "  Two  spaces, a\ttab,\nnew lines\n\nand digits 2024-11-27 cost $3.50 — naïve café, 東京.",
         "ﬁne ｆｕｌｌ－ｗｉｄｔｈ ① x²\r\nWindows line\rold Mac line"]  # NFKC and newlines: the tokenizer's own
ROPE_THETA = 50000.0  # not transformers' default (10,000): a config that loses it gives other logits
TF4 = ROOT / "var" / "tf4"  # transformers 4.x (requirements-tf4.lock), installed there by `make test`


def model_dir(d: Path, sp_model: Path, **kw) -> Path:
    import sentencepiece as spm

    d.mkdir(parents=True)
    torch.manual_seed(0)
    a = ModelArgs(vocab_size=spm.SentencePieceProcessor(model_file=str(sp_model)).get_piece_size(), n_layers=2,
                  d_model=64, n_heads=4, n_kv_heads=2, seq_len=64, **kw)
    m = Transformer(a)
    with torch.no_grad():  # norms away from 1, so a norm weight dropped or misplaced changes the logits
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    torch.save(m.state_dict(), d / "model.pt")
    (d / "model_args.json").write_text(json.dumps(a.to_dict()))
    (d / "tokenizer.model").write_bytes(sp_model.read_bytes())
    return d


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    sp = tokenize.train_sentencepiece([tokenize.canonical_text(d["text"]) for d in c4_docs(200)], root / "sp",
                                      TokenizerCfg(vocab_size=400), seed=1)
    return model_dir(root / "model", sp, rope_theta=ROPE_THETA)


def card(d: Path) -> export.CardInfo:
    return export.CardInfo("t-model", "3", json.loads((d / "model_args.json").read_text()),
                           {"reference_bpb": "1.234500", "contamination.llmp_arc_easy": "2/100",
                            "config_hash": "c" * 64})


def greedy(logits_of, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    for _ in range(n):
        x = torch.cat([x, logits_of(x)[:, -1].argmax(-1, keepdim=True)], 1)
    return x[0, len(ids):].tolist()


def ours_on(model_dir: Path) -> dict:
    """What our own model and SentencePiece give: the reference every consumer is held to."""
    import sentencepiece as spm

    from pipelines.train.ckpt.dcp_read import load_plain_model

    ours, sp = load_plain_model(model_dir), spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    ids = [sp.encode(tokenize.canonical_text(t)) for t in TEXTS]
    with torch.no_grad():
        logits = ours(torch.tensor([ids[0][:48]])).float()[0]
        cont = greedy(lambda t: ours(t), ids[0][:8], 12)
    return {"ids": ids, "logits": logits, "continuation": cont, "sp": sp}


def converter_types(sp) -> list[int]:
    """llama.cpp's convert_hf_to_gguf.py: UNKNOWN 2, CONTROL 3, UNUSED 5, BYTE 6, every other piece NORMAL 1."""
    return [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else 6 if sp.is_byte(i)
            else 1 for i in range(sp.get_piece_size())]


def test_hf_and_gguf_exports_load_in_transformers_to_our_ids_logits_and_greedy_continuation(bpe_model, tmp_path):
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    names = export.export(bpe_model, "hf", out, card(bpe_model))
    assert set(names) == {*export.HF_FILES, "export.json"}
    assert export.export(bpe_model, "gguf", out, card(bpe_model)) == ["model.gguf", "export.json"]  # beside it
    marker = json.loads((out / "export.json").read_text())  # every file, with its digest and where it came from
    assert set(marker) == {*export.HF_FILES, "model.gguf"} and marker["model.gguf"]["format"] == "gguf"
    assert marker["config.json"]["model"] == "t-model/3" and marker["config.json"]["bytes"] == (out / "config.json").stat().st_size
    umask = os.umask(0o022)  # (the test process's own; restored at once)
    os.umask(umask)
    assert {(out / n).stat().st_mode & 0o777 for n in marker} == {0o666 & ~umask}  # weights as readable as the rest
    ref = ours_on(bpe_model)
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]  # raw text: NFKC and CRLF are the tokenizer's
    assert ids == ref["ids"]
    assert tok.decode(ids[0]) == TEXTS[0] and tok.eos_token_id == ref["sp"].eos_id() == 2
    assert json.loads((out / "config.json").read_text())["rope_theta"] == ROPE_THETA  # where 4.x reads it
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    gg = AutoModelForCausalLM.from_pretrained(str(out), gguf_file="model.gguf", dtype=torch.float32).eval()
    x = torch.tensor([ids[0][:48]])
    with torch.no_grad():
        diffs = {"hf": (hf(x).logits[0] - ref["logits"]).abs().max().item(),
                 "gguf": (gg(x).logits[0] - ref["logits"]).abs().max().item()}
        print(f"max |logit difference| vs ours, fp32: {diffs}")
        assert diffs["hf"] < 1e-4 and diffs["gguf"] < 1e-4
        enc = tok(tok.decode(ids[0][:8]), add_special_tokens=False, return_tensors="pt")  # as a user calls generate
        assert set(enc) == {"input_ids", "attention_mask"}
        cont = hf.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)[0, 8:].tolist()
        assert enc["input_ids"][0].tolist() == ids[0][:8] and cont == ref["continuation"]
    reader = gguf.GGUFReader(str(out / "model.gguf"))  # token types as llama.cpp's own converter writes them
    field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    assert types == converter_types(ref["sp"]) and types[ref["sp"].piece_to_id("\n")] == 1
    card_md = (out / "README.md").read_text()
    assert "llmp_arc_easy: 2/100" in card_md and "| reference_bpb | 1.234500 |" in card_md and "c" * 64 in card_md


def test_the_hf_export_loads_and_generates_in_transformers_4(bpe_model, tmp_path):
    """transformers 4.57 (var/tf4, in a subprocess: the venv has 5.x) reads the same directory to our ids, our
    logits (the rope theta from config.json, not its default) and our greedy continuation through
    ``generate(**tok(text))``."""
    if not (TF4 / "transformers").is_dir():
        pytest.skip(f"transformers 4.x is not installed in {TF4}: `make test` installs it (requirements-tf4.lock)")
    import subprocess
    import sys

    out = tmp_path / "out"
    export.export(bpe_model, "hf", out, card(bpe_model))
    (tmp_path / "texts.json").write_text(json.dumps(TEXTS))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TF4), str(ROOT)]), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "hf_export_check.py"), str(out),
                        str(tmp_path / "texts.json"), "8", "12"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got, ref = json.loads(r.stdout.strip().splitlines()[-1]), ours_on(bpe_model)
    print({k: got[k] for k in ("version", "input_keys", "rope_theta")})
    assert got["version"].startswith("4.") and got["rope_theta"] == ROPE_THETA
    assert got["ids"] == ref["ids"] and got["prefix"] == ref["ids"][0][:8]
    assert got["input_keys"] == ["attention_mask", "input_ids"] and got["continuation"] == ref["continuation"]
    assert (torch.tensor(got["logits"]) - ref["logits"]).abs().max().item() < 1e-4


def test_export_leaves_others_files_alone_and_refuses_what_has_no_equivalent(bpe_model, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("a user's file")
    with pytest.raises(export.ExportError, match="notes.txt"):
        export.export(bpe_model, "hf", out, card(bpe_model))
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    cut = tmp_path / "cut"  # an export cut short before its export.json: its files are not taken for a finished one
    export.export(bpe_model, "hf", cut, card(bpe_model))
    marker = json.loads((cut / "export.json").read_text())
    (cut / "export.json").unlink()
    with pytest.raises(export.ExportError, match="no finished export wrote"):
        export.export(bpe_model, "hf", cut, card(bpe_model))
    # ... but one killed while it put its files in place left its record of them: a retry finishes it (it was refused
    # for ever, the directory to be cleaned by hand)
    (cut / export.PENDING).write_text(json.dumps(marker))
    export.export(bpe_model, "hf", cut, card(bpe_model))
    assert (cut / "export.json").is_file() and not (cut / export.PENDING).exists()
    assert set(json.loads((cut / "export.json").read_text())) == set(marker)
    import errno

    real = Path.read_text

    def failing(self, *a, **k):  # the directory's disk fails under the record: not "no finished export here" (2)
        if self.name == "export.json":
            raise OSError(errno.EIO, "Input/output error", str(self))
        return real(self, *a, **k)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Path, "read_text", failing)
        with pytest.raises(OSError) as e:
            export.check_out(cut)
        assert e.value.errno == errno.EIO
        assert export.main(["--model", "m/1", "--format", "hf", "--out", str(cut)]) == 75  # one line, a retry
    byte = model_dir(tmp_path / "byte", tokenize.byte_model(tmp_path / "byte.model"), tie_embeddings=False)
    with pytest.raises(export.ExportError, match="no GGUF equivalent"):  # llama.cpp writes spaces as ▁, bytes don't
        export.export(byte, "gguf", tmp_path / "b", card(byte))
    assert not (tmp_path / "b" / "model.gguf").exists()
    export.export(byte, "hf", tmp_path / "b", card(byte))  # as a Hugging Face tokenizer it is exact
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "b"))
    assert tok(TEXTS[1], add_special_tokens=False)["input_ids"] == [b + 3 for b in tokenize.canonical_text(TEXTS[1]).encode()]


def test_the_register_stage_logs_the_hf_directory_with_the_version_once(bpe_model, home):
    import mlflow.artifacts

    from pipelines import tracking
    from pipelines.eval import registry
    from pipelines.spec import load_spec

    ref = home / "ref.txt"
    ref.write_text("The cat sat on the mat. " * 20)
    spec = load_spec(None, ["registry.model_name=export-test", f"eval.reference={json.dumps([str(ref)])}"], env={})
    ev = {"reference_sha256": "s" * 64, "reference": {"files": {"ref.txt": {}}}, "tasks": list(spec.eval.tasks),
          "limit": spec.eval.limit, "contamination": {"llmp_arc_easy": {"items": 100, "items_overlapping": 2,
                                                                         "checked": True}}}
    run_id = tracking.start_run(spec, run_name="export")
    res = registry.register(spec, bpe_model, run_id, {"config_hash": "h" * 64}, {"reference_bpb": 3.0}, ev, home / "w")
    client = tracking.client(spec)
    uri = export.register_hf(spec, client, bpe_model, res, home / "w1")
    assert uri.endswith(f"/{res['model_id']}/artifacts/hf")
    assert client.get_model_version("export-test", res["version"]).tags["export.hf"] == uri
    assert export.register_hf(spec, client, bpe_model, res, home / "w2") == uri and not (home / "w2").exists()  # a retry
    listed = {Path(f.path).name for f in client.list_logged_model_artifacts(res["model_id"], "hf")}
    assert listed == {*export.HF_FILES, "export.json"}
    with tracking.using(tracking.tracking_uri(spec)):
        got = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(home / "dl")))
    assert set(export.HF_FILES) <= {p.name for p in got.iterdir()}
    text = (got / "README.md").read_text()
    assert "export-test v1" in text and "llmp_arc_easy: 2/100" in text and "h" * 64 in text and "not found under `run.root`" in text
    # the model's own directory is fetched without the hf/ export logged beside it (twice the bytes otherwise)
    from pipelines.eval.model_dir import download_model_dir

    logged = client.get_logged_model(res["model_id"]).artifact_location  # file://…: MLflow names it otherwise
    for i, uri in enumerate([f"models:/export-test/{res['version']}", logged, logged.removeprefix("file://")]):
        d = download_model_dir(uri, tracking.tracking_uri(spec), home / f"md{i}")
        assert d.is_relative_to(home / f"md{i}") and {p.name for p in d.iterdir()} >= {"model.pt", "tokenizer.model"}
        assert not list((home / f"md{i}").rglob("config.json"))  # no hf/


def test_an_out_path_under_a_file_or_that_is_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    """--out that cannot be a directory is the user's to fix: one line, exit 2, before the registry is asked."""
    from pipelines.eval import export

    afile = tmp_path / "model.bin"
    afile.write_text("x")
    for out in (afile, afile / "hf"):
        assert export.main(["--model", "m@champion", "--format", "hf", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"export: error: --out {out}: {afile} is a file"), err


def test_the_card_leaves_out_a_spec_the_run_does_not_have_never_one_that_did_not_come(tmp_path, monkeypatch):
    """The card of an exported version says what its training run logged: a run without ``spec.yaml`` (or gone, or
    a file that is not a spec) gets a card that says so; a spec the run lists that does not come (MLflow down, the
    artifact store failing: MLflow wraps the file's EIO in INTERNAL_ERROR) stops the export, 75, instead of a card
    with the spec left out and exit 0."""
    from types import SimpleNamespace

    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INTERNAL_ERROR, RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

    from pipelines import tracking

    monkeypatch.setattr(export, "lineage_of", lambda *a: None)
    (tmp_path / "model_args.json").write_text(json.dumps({"d_model": 8}))
    mv = SimpleNamespace(name="m", version=3, run_id="r", tags={"gate": "passed"})
    spec_file = tmp_path / "got" / "spec.yaml"
    spec_file.parent.mkdir()

    def card(listed=("spec.yaml",), listing=None, fetch=None, text="model: {d_model: 8}\ntrain: {steps: 5}\n"):
        def list_artifacts(run_id):
            if listing:
                raise listing
            return [SimpleNamespace(path=n) for n in listed]

        def download(run_id, path, dst):
            if fetch:
                raise fetch
            spec_file.write_text(text)
            return str(spec_file)
        client = SimpleNamespace(list_artifacts=list_artifacts, download_artifacts=download)
        return export.version_card(None, client, mv, tmp_path, tmp_path)

    assert card().config == {"model": {"d_model": 8}, "train": {"steps": 5}, "data": {"inputs": None}}
    assert card(listed=("MLmodel",)).config is None  # the run logged no spec
    assert card(listing=MlflowException("run r not found", error_code=RESOURCE_DOES_NOT_EXIST)).config is None
    assert card(text="a: [").config is None and card(text="- a list").config is None  # not a spec: said too
    eio = MlflowException("The following failures occurred while downloading one or more artifacts from "
                          "file:///mlruns/1/r/artifacts:\n##### File spec.yaml #####\n[Errno 5] Input/output error",
                          error_code=INTERNAL_ERROR)
    refused = MlflowException(eio.message.replace("[Errno 5] Input/output error", "PermissionError: [Errno 13] "
                              "Permission denied"), error_code=INTERNAL_ERROR)
    assert not tracking.mlflow_answered(eio) and tracking.mlflow_answered(refused)
    for down in (dict(fetch=eio), dict(listing=MlflowException("restarting", error_code=TEMPORARILY_UNAVAILABLE)),
                 dict(fetch=MlflowException("API request to http://mlflow:5000/api/2.0/mlflow-artifacts/artifacts/x "
                                            "failed with exception HTTPConnectionPool(host='mlflow', port=5000)"))):
        with pytest.raises(MlflowException) as e:
            card(**down)
        assert tracking.mlflow_outage(e.value), down  # main() ends 75 for it


def test_the_card_says_a_corpus_is_not_found_only_when_it_is_not_there(monkeypatch):
    """The card's lineage: a corpus version not under run.root is said on the card (None); one storage did not
    return (75) or this user may not read (2) stops the export: no card says "not found" for those."""
    from pipelines.lineage.queries import CorpusNotFound, VersionUnreadable
    from pipelines.manifest import StageError

    for error in (CorpusNotFound("not under run.root"), VersionUnreadable("EIO"), StageError("Permission denied")):
        def query(spec, client, ref, _e=error):
            raise _e

        monkeypatch.setattr(export, "model_query", query)
        if isinstance(error, CorpusNotFound):
            assert export.lineage_of(None, None, "m", "1") is None
        else:
            with pytest.raises(type(error)):
                export.lineage_of(None, None, "m", "1")


def test_gguf_types_pad_the_embedding_and_refuse_pieces_past_it(bpe_model):
    """Rows of the embedding past the tokenizer's pieces are llama.cpp's converter's ``[PAD<i>]`` (UNUSED, score
    -10000); a tokenizer with more pieces than the embedding has rows is refused (those ids have no weights)."""
    proto = export.sp_proto(bpe_model / "tokenizer.model")
    n = len(proto.pieces)
    tokens, scores, types = export.gguf_vocab(proto, n + 2)
    assert tokens[n:] == [f"[PAD{n}]", f"[PAD{n + 1}]"] and scores[n:] == [-10000.0] * 2 and types[n:] == [5, 5]
    with pytest.raises(export.ExportError, match=f"{n} pieces and the model's embedding {n - 1} rows"):
        export.gguf_vocab(proto, n - 1)
