"""Export to the ecosystem: the Hugging Face directory loads with transformers' Auto classes and the GGUF file with
transformers' own GGUF reader, to our token ids, our logits (fp32) and our greedy continuation."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import c4_docs
from pipelines.data import tokenize
from pipelines.eval import export
from pipelines.spec import TokenizerCfg
from pipelines.train.model import ModelArgs, Transformer

TEXTS = ["Once upon a time, there was a little girl named Lily. She loved to play outside.",
         "  Two  spaces, a\ttab,\nnew lines\n\nand digits 2024-11-27 cost $3.50 — naïve café, 東京."]


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
    return model_dir(root / "model", sp)


def card(d: Path) -> export.CardInfo:
    return export.CardInfo("t-model", "3", json.loads((d / "model_args.json").read_text()),
                           {"reference_bpb": "1.234500", "contamination.llmp_arc_easy": "2/100",
                            "config_hash": "c" * 64})


def greedy(logits_of, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    for _ in range(n):
        x = torch.cat([x, logits_of(x)[:, -1].argmax(-1, keepdim=True)], 1)
    return x[0, len(ids):].tolist()


def test_hf_and_gguf_exports_load_in_transformers_to_our_ids_logits_and_greedy_continuation(bpe_model, tmp_path):
    import sentencepiece as spm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelines.train.checkpoint import load_plain_model

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
    ours, sp = load_plain_model(bpe_model), spm.SentencePieceProcessor(model_file=str(bpe_model / "tokenizer.model"))
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert ids == [sp.encode(tokenize.canonical_text(t)) for t in TEXTS]
    assert tok.decode(ids[0]) == TEXTS[0] and tok.eos_token_id == sp.eos_id() == 2
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    gg = AutoModelForCausalLM.from_pretrained(str(out), gguf_file="model.gguf", dtype=torch.float32).eval()
    x = torch.tensor([ids[0][:48]])
    with torch.no_grad():
        ref = ours(x).float()
        diffs = {"hf": (hf(x).logits - ref).abs().max().item(), "gguf": (gg(x).logits - ref).abs().max().item()}
        print(f"max |logit difference| vs ours, fp32: {diffs}")
        assert diffs["hf"] < 1e-4 and diffs["gguf"] < 1e-4
        cont = hf.generate(x[:, :8], max_new_tokens=12, do_sample=False)[0, 8:].tolist()
        assert cont == greedy(lambda t: ours(t), ids[0][:8], 12)
    card_md = (out / "README.md").read_text()
    assert "llmp_arc_easy: 2/100" in card_md and "| reference_bpb | 1.234500 |" in card_md and "c" * 64 in card_md


def test_export_leaves_others_files_alone_and_refuses_what_has_no_equivalent(bpe_model, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("a user's file")
    with pytest.raises(export.ExportError, match="notes.txt"):
        export.export(bpe_model, "hf", out, card(bpe_model))
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    cut = tmp_path / "cut"  # an export cut short before its export.json: its files are not taken for a finished one
    export.export(bpe_model, "hf", cut, card(bpe_model))
    (cut / "export.json").unlink()
    with pytest.raises(export.ExportError, match="no finished export wrote"):
        export.export(bpe_model, "hf", cut, card(bpe_model))
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


def test_an_out_path_under_a_file_or_that_is_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    """--out that cannot be a directory is the user's to fix: one line, exit 2, before the registry is asked."""
    from pipelines.eval import export

    afile = tmp_path / "model.bin"
    afile.write_text("x")
    for out in (afile, afile / "hf"):
        assert export.main(["--model", "m@champion", "--format", "hf", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"export: error: --out {out}: {afile} is a file"), err
