"""Export a registered model to the ecosystem's formats: a Hugging Face ``LlamaForCausalLM`` directory or a GGUF file.

    python -m pipelines.eval.export --model NAME@ALIAS|NAME/VERSION --format hf|gguf --out DIR [--spec S] [--set K=V]

Our model is a Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention), so nothing is approximated:

* ``hf``: ``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` (fp32, as trained; the rotary rows of
  ``q_proj``/``k_proj`` permuted from our interleaved pairs to Hugging Face's two halves, as Meta's conversion does),
  ``generation_config.json``, the tokenizer (``tokenizer.model``, our SentencePiece model; ``tokenizer.json``, the same
  model converted by transformers' own SentencePiece converter; ``tokenizer_config.json``: ``</s>`` ends a document,
  no ``<s>`` is added, as in training) and ``README.md``, a model card: the corpus version and its sources with their
  document counts (lineage), the contamination record, the evaluation metrics, the training config and its hash.
  ``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load it; the tokenizer is
  checked against SentencePiece on :data:`CHECK_TEXTS` before anything is written, and an export whose ids differ is
  refused (exit 2).
* ``gguf``: ``DIR/model.gguf`` (architecture ``llama``, fp32 or ``--gguf-dtype f16``) with the tokenizer embedded
  (``tokenizer.ggml.model = llama``: SentencePiece pieces, scores and types). llama.cpp's SentencePiece tokenizer
  always writes spaces as ``▁``: the byte tokenizer, which keeps them as bytes, has no GGUF equivalent and is refused.

The register stage writes the ``hf`` directory for every version it registers (up to
``eval.single_process_max_params``) and logs it as the ``hf/`` artifact of the version's model; the version's
``export.hf`` tag is its URI, so ``mlflow artifacts download --artifact-uri <export.hf> --dst-path DIR`` fetches it.
Files are written in a temporary directory inside ``DIR`` and renamed into it; ``DIR/export.json``, written last,
lists every file an export put there (bytes, sha256, model version, format). ``DIR`` may be new, empty or hold
finished exports, nothing else.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sentencepiece as spm
import yaml
from sentencepiece import sentencepiece_model_pb2 as pb

from pipelines import tracking
from pipelines.data.text import canonical_text
from pipelines.eval.model_dir import loads_here
from pipelines.exit_codes import RETRY, USER_ERROR
from pipelines.lineage.queries import CorpusNotFound, model_query, resolve_model
from pipelines.manifest import StageError, read_json_record
from pipelines.spec import add_spec_args, spec_from_args
from pipelines.storage import oserrors
from pipelines.train.ckpt.dcp_read import load_plain_model

HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.model", "tokenizer.json",
            "tokenizer_config.json", "README.md")
GGUF_FILE = "model.gguf"
MARKER = "export.json"  # written last: {file: {bytes, sha256, model, format}} of every file an export put in DIR
PENDING = ".export-pending.json"  # while the files are put in place: the marker to be, so a try cut short is ours
CHECK_TEXTS = ("Once upon a time, there was a little girl named Lily.", "  two  spaces, a\ttab\nand\n\nnew lines ",
               "Numbers 12345 and 3.14159; e-mail a@b.org, URL https://example.com/x?y=1",
               "naïve café — Ünïcödé, 東京, Москва, ελληνικά 🙂", "x",
               "ﬁne ｆｕｌｌ－ｗｉｄｔｈ ①™ Ⅻ x²\r\nCRLF\rCR")  # NFKC and newlines: the exported tokenizer's own


class ExportError(Exception):
    """The model cannot be exported as asked (exit 2): the message says why and what to do."""


# -- weights -------------------------------------------------------------------------------------------------------

def halves(w, heads: int):
    """Rows of each rotary head from our interleaved pairs (x0, x1), (x2, x3)… to Hugging Face's (x0, x2…, x1, x3…)."""
    out, d = w.shape
    return w.reshape(heads, out // heads // 2, 2, d).transpose(1, 2).reshape(out, d)


HF_NAMES = {"attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj", "ffn.w1": "mlp.gate_proj",
            "ffn.w3": "mlp.up_proj", "ffn.w2": "mlp.down_proj", "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm"}


def hf_state_dict(model) -> dict:
    """Our ``Transformer``'s weights under ``LlamaForCausalLM``'s names and layout."""
    a, sd = model.args, model.state_dict()
    new = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"],
           "lm_head.weight": sd["output.weight"]}
    for i in range(a.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        new[theirs + "self_attn.q_proj.weight"] = halves(sd[ours + "attn.wq.weight"], a.n_heads)
        new[theirs + "self_attn.k_proj.weight"] = halves(sd[ours + "attn.wk.weight"], a.kv_heads)
        for k, v in HF_NAMES.items():
            new[f"{theirs}{v}.weight"] = sd[f"{ours}{k}.weight"]
    return new


def hf_llama(model, bos_id: int = 1, eos_id: int = 2):
    """Our ``Transformer`` as an equivalent ``transformers.LlamaForCausalLM`` (eval mode, fp32); ``bos_id``/``eos_id``:
    the tokenizer's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    a = model.args
    cfg = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.d_model, intermediate_size=a.ffn_hidden,
                      num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.kv_heads,
                      head_dim=a.head_dim, max_position_embeddings=a.seq_len, rms_norm_eps=a.norm_eps,
                      rope_theta=a.rope_theta, tie_word_embeddings=a.tie_embeddings, attention_bias=False,
                      mlp_bias=False, hidden_act="silu", bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=None,
                      torch_dtype="float32")
    hf = LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(hf_state_dict(model), strict=True)
    return hf


# -- tokenizer -----------------------------------------------------------------------------------------------------

def sp_proto(sp_model: Path):
    proto = pb.ModelProto()
    proto.ParseFromString(sp_model.read_bytes())
    return proto


def hf_tokenizer(sp_model: Path, seq_len: int):
    """The SentencePiece model as a fast tokenizer, built by transformers' SentencePiece converter (it follows the
    model's own normalizer, dummy prefix, byte fallback and user-defined pieces), with the pipeline's canonical text
    (:func:`pipelines.data.text.canonical_text`: NFKC, ``\\r\\n`` and ``\\r`` → ``\\n``) in front of its normalizer,
    so that raw text gives the ids the model was trained on."""
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="llmp-tok-") as tmp:
        shutil.copy(sp_model, Path(tmp) / "tokenizer.model")
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
             "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
             "model_max_length": seq_len}))
        try:
            tok = AutoTokenizer.from_pretrained(tmp)
        except Exception as e:  # noqa: BLE001 - the converter's refusal, whatever its type, is the reason
            raise ExportError(f"the tokenizer has no Hugging Face equivalent: {type(e).__name__}: {e}") from None
    backend = tok.backend_tokenizer
    canonical = [normalizers.NFKC(), normalizers.Replace("\r\n", "\n"), normalizers.Replace("\r", "\n")]
    backend.normalizer = normalizers.Sequence(canonical + ([backend.normalizer] if backend.normalizer else []))
    return tok


def tokenizer_mismatches(tok, sp) -> list[str]:
    """The check texts on which ``tok`` (a Hugging Face tokenizer, given the raw text) and SentencePiece (given the
    canonical text, as the tokenize stage gives it) give different ids."""
    return [t for t in CHECK_TEXTS if tok(t, add_special_tokens=False)["input_ids"] != sp.encode(canonical_text(t))]


# what transformers 4.4x–4.5x and 5.x both read: no token_type_ids (generate(**tok(text)) refuses them); bos/eos by
# name only (5.x writes them again as an ``extra_special_tokens`` list, which 4.x takes for a dict and fails on)
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
                    "model_input_names": ["input_ids", "attention_mask"]}


def write_tokenizer(sp_model: Path, seq_len: int, out: Path) -> None:
    tok = hf_tokenizer(sp_model, seq_len)
    bad = tokenizer_mismatches(tok, spm.SentencePieceProcessor(model_file=str(sp_model)))
    if bad:
        raise ExportError(f"the Hugging Face tokenizer converted from {sp_model.name} encodes {len(bad)} of "
                          f"{len(CHECK_TEXTS)} check texts differently from SentencePiece (first: {bad[0]!r}): "
                          "no exact Hugging Face equivalent")
    tok.save_pretrained(str(out))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    for k in ("is_local", "local_files_only", "extra_special_tokens", "additional_special_tokens", "backend"):
        cfg.pop(k, None)  # where it was loaded from; 5.x-only keys (above)
    # PreTrainedTokenizerFast reads tokenizer.json in transformers 4 and 5 alike (TokenizersBackend is 5's name)
    cfg.update(TOKENIZER_CONFIG)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.copy(sp_model, out / "tokenizer.model")


# -- formats -------------------------------------------------------------------------------------------------------

def write_hf(model, sp_model: Path, out: Path, card: str) -> list[str]:
    t = sp_proto(sp_model).trainer_spec
    hf = hf_llama(model, t.bos_id, t.eos_id)
    hf.generation_config.update(bos_token_id=t.bos_id, eos_token_id=t.eos_id, pad_token_id=None, do_sample=False)
    hf.save_pretrained(str(out), safe_serialization=True, max_shard_size="10000GB")  # one file: HF_FILES
    cfg = json.loads((out / "config.json").read_text())  # 5.x writes rope_parameters only; 4.x reads rope_theta
    cfg["rope_theta"] = model.args.rope_theta
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    write_tokenizer(sp_model, model.args.seq_len, out)
    (out / "README.md").write_text(card)
    return sorted(p.name for p in out.iterdir())


GGUF_NAMES = {"attn.wq": "attn_q", "attn.wk": "attn_k", "attn.wv": "attn_v", "attn.wo": "attn_output",
              "ffn.w1": "ffn_gate", "ffn.w3": "ffn_up", "ffn.w2": "ffn_down", "attn_norm": "attn_norm",
              "ffn_norm": "ffn_norm"}


def gguf_tensors(model, dtype: str) -> dict:
    """llama.cpp's names; q/k stay in our interleaved rotary layout, which is llama.cpp's (Meta's) own. Norms stay
    fp32 (llama.cpp's rule for 1-D tensors)."""
    a, sd = model.args, {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["tok_embeddings.weight"], "output_norm.weight": sd["norm.weight"]}
    if not a.tie_embeddings:  # absent: the loaders tie the head to the embedding
        out["output.weight"] = sd["output.weight"]
    for i in range(a.n_layers):
        for ours, theirs in GGUF_NAMES.items():
            out[f"blk.{i}.{theirs}.weight"] = sd[f"layers.{i}.{ours}.weight"]
    wide = np.float16 if dtype == "f16" else np.float32
    return {k: (v.astype(wide) if v.ndim > 1 else v) for k, v in out.items()}


def gguf_vocab(proto, vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    """Pieces, scores and types as llama.cpp's converter (``convert_hf_to_gguf.py``) writes a SentencePiece model:
    unknown, control, unused and byte pieces keep their type (SentencePiece's numbers are GGUF's), every other piece
    is NORMAL, user-defined ones (``\\n``) included: llama.cpp splits USER_DEFINED tokens out of the text before its
    SentencePiece pass and puts a space before what follows, so a newline so typed changes every id after it. Rows
    of the embedding past the pieces (none unless the model was padded) are ``[PAD<i>]``, UNUSED, score -10000."""
    if not proto.normalizer_spec.escape_whitespaces:
        raise ExportError("the tokenizer keeps spaces as bytes (tokenizer.model_type=byte), and llama.cpp's "
                          "SentencePiece tokenizer always writes them as '▁': no GGUF equivalent; export --format hf")
    if len(proto.pieces) > vocab_size:
        raise ExportError(f"the tokenizer has {len(proto.pieces)} pieces and the model's embedding {vocab_size} rows: "
                          "ids past the embedding have no weights; export the tokenizer the model was trained with")
    kept = {2, 3, 5, 6}  # UNKNOWN, CONTROL, UNUSED, BYTE
    pieces = list(proto.pieces)
    pad = range(len(pieces), vocab_size)
    return ([p.piece for p in pieces] + [f"[PAD{i}]" for i in pad], [p.score for p in pieces] + [-10000.0] * len(pad),
            [int(p.type) if int(p.type) in kept else 1 for p in pieces] + [5] * len(pad))


def write_gguf(model, sp_model: Path, path: Path, name: str, dtype: str = "f32") -> None:
    import gguf

    a, proto = model.args, sp_proto(sp_model)
    tokens, scores, types = gguf_vocab(proto, a.vocab_size)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(a.seq_len)
    w.add_embedding_length(a.d_model)
    w.add_block_count(a.n_layers)
    w.add_feed_forward_length(a.ffn_hidden)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_layer_norm_rms_eps(a.norm_eps)
    w.add_rope_freq_base(a.rope_theta)
    w.add_rope_dimension_count(a.head_dim)
    w.add_vocab_size(a.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    t = proto.trainer_spec
    w.add_unk_token_id(t.unk_id)
    w.add_bos_token_id(t.bos_id)
    w.add_eos_token_id(t.eos_id)
    w.add_add_bos_token(False)  # documents are separated by </s>; none starts with <s>
    w.add_add_eos_token(False)
    w.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    for k, v in gguf_tensors(model, dtype).items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# -- the model card ------------------------------------------------------------------------------------------------

@dataclass
class CardInfo:
    name: str
    version: str
    args: dict                           # model_args.json
    tags: dict = field(default_factory=dict)   # the registered version's (metrics, contamination, lineage hashes)
    lineage: dict | None = None          # pipelines.lineage's answer for the version
    config: dict | None = None           # the spec it was trained with (model, tokenizer, train, data sections)


def metric_rows(tags: dict) -> list[str]:
    keys = sorted(k for k in tags if k in ("reference_bpb",) or k.startswith(("harness.", "heldout_")))
    return [f"| {k} | {tags[k]} |" for k in keys]


def lineage_lines(lin: dict | None, digest: str | None) -> list[str]:
    if lin is None:
        return [f"Corpus version digest `{digest or 'not recorded'}`: its manifests were not found under `run.root` "
                "when this was exported, so its sources are not listed here (`python -m pipelines.lineage --model …`)."]
    c = lin["corpus"]
    out = [f"Corpus version {c['version']} (tokenize manifest digest `{c['digest']}`): {c['docs']} documents, "
           f"{c['tokens']} tokens.", "", "| source | documents | bytes | sha256 |", "|---|---|---|---|"]
    docs = lin.get("docs_per_source", {})
    out += [f"| `{i['key']}` | {docs.get(i['key'], 0)} | {i['bytes']} | `{(i['sha256'] or 'not recorded')[:12]}` |"
            for i in lin["inputs"]]
    return out


def model_card(info: CardInfo) -> str:
    t, a = info.tags, info.args
    con = sorted((k.removeprefix("contamination."), v) for k, v in t.items() if k.startswith("contamination."))
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags: [llama, llm-pipeline]", "---",
             f"# {info.name} v{info.version}", "",
             f"A Llama-architecture decoder ({a['n_layers']} layers, d_model {a['d_model']}, {a['n_heads']} heads, "
             f"{a.get('n_kv_heads') or a['n_heads']} KV heads, context {a['seq_len']}, vocabulary {a['vocab_size']}) "
             "trained by llm-pipeline; exported by `python -m pipelines.eval.export`. Documents end with `</s>`; no "
             "`<s>` is added.", "", "## Training data", "", *lineage_lines(info.lineage, t.get("data_manifest_hash")),
             "", "## Contamination", "", "Evaluation items that share an n-gram with the training documents "
             "(the decontaminate stage's record):", ""]
    lines += [f"- {k}: {v}" for k, v in con] or ["- not recorded"]
    lines += ["", "## Evaluation", "", "| metric | value |", "|---|---|", *metric_rows(t), "",
              "## Training config", "", f"Config hash `{t.get('config_hash', 'not recorded')}`; tokenizer sha256 "
              f"`{t.get('tokenizer_hash', 'not recorded')}`; checkpoint `{t.get('checkpoint_uri', 'not recorded')}`.",
              ""]
    if info.config is not None:
        lines += ["```yaml", yaml.safe_dump(info.config, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)


def card_config(spec_dict: dict) -> dict:
    """The parts of a spec that shaped the model: model, tokenizer, train and the data inputs."""
    return {k: spec_dict[k] for k in ("model", "tokenizer", "train") if k in spec_dict} | \
        {"data": {"inputs": spec_dict.get("data", {}).get("inputs")}}


# -- one export ----------------------------------------------------------------------------------------------------

def check_out(out: Path) -> dict:
    """``out`` may be new, empty, or hold an earlier export (its :data:`MARKER` lists every file in it; a try cut
    short leaves a ``.export-*`` directory): nothing of anyone else is overwritten; nor below a file, nor where this
    user cannot write (the nearest existing directory). Returns the earlier marker."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: {out} is a file, not a directory: choose a new or empty directory")
    for p in out.parents if not out.exists() else (out,):
        if p.exists():
            if not p.is_dir():
                raise ExportError(f"--out {out}: {p} is a file, not a directory: choose a new or empty directory")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ExportError(f"--out {out}: {p} is not writable by this user: choose another directory")
            break
    names = {p.name for p in out.iterdir() if not p.name.startswith(".export-")} if out.is_dir() else set()
    if not names:
        return {}
    marker = read_json_record(out / MARKER)
    if marker is None:  # an export cut short while it put its files in place: what it was writing
        marker = read_json_record(out / PENDING)
    if not isinstance(marker, dict) or not names - {MARKER} <= set(marker):
        raise ExportError(f"--out {out}: holds files that no finished export wrote ({', '.join(sorted(names)[:5])}): "
                          "choose an empty or new directory, or remove them")
    return marker


def file_entry(path: Path, card: "CardInfo", fmt: str) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest(), "model": f"{card.name}/{card.version}",
            "format": fmt}


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` would change it for every thread a moment)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def export(model_dir: Path, fmt: str, out: Path, card: CardInfo, gguf_dtype: str = "f32") -> list[str]:
    """Write ``fmt`` of the model in ``model_dir`` (``model_args.json``, ``tokenizer.model``, weights) into ``out``;
    returns the file names written. Each file is written in a temporary directory beside ``out``, then renamed."""
    marker = check_out(out)
    model = load_plain_model(model_dir).float().eval()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        if fmt == "hf":
            names = write_hf(model, model_dir / "tokenizer.model", tmp, model_card(card))
        else:
            write_gguf(model, model_dir / "tokenizer.model", tmp / GGUF_FILE, f"{card.name}-v{card.version}", gguf_dtype)
            names = [GGUF_FILE]
        marker.update({n: file_entry(tmp / n, card, fmt) for n in names})
        mode = 0o666 & ~_umask()  # as a plain write would leave it (a library's own temp file may be 0600)
        for n in names:
            os.chmod(tmp / n, mode)
        body = json.dumps(marker, indent=1, sort_keys=True) + "\n"
        (tmp / PENDING).write_text(body)
        os.replace(tmp / PENDING, out / PENDING)  # cut short from here on, a retry knows these files are ours
        (out / MARKER).unlink(missing_ok=True)  # and DIR holds no finished export
        for n in names:
            os.replace(tmp / n, out / n)
        (tmp / MARKER).write_text(body)
        os.replace(tmp / MARKER, out / MARKER)
        (out / PENDING).unlink(missing_ok=True)
        return names + [MARKER]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- at registration -----------------------------------------------------------------------------------------------

def register_hf(spec, client, ckpt_dir: Path, res: dict, work: Path) -> str | None:
    """The ``hf`` directory of a version the register stage created (or found), logged as the ``hf/`` artifact of its
    model and named by the version's ``export.hf`` tag; returns that URI, or None for a model above
    ``eval.single_process_max_params`` (not loaded in the Airflow worker: export it with the CLI)."""
    name, version, model_id = res["model_name"], str(res["version"]), res["model_id"]
    args = json.loads((ckpt_dir / "model_args.json").read_text())
    if model_id is None or not loads_here(spec, ckpt_dir):
        print(f"[register] {name} v{version}: no hf export at registration (model above "
              "eval.single_process_max_params, or no logged model): python -m pipelines.eval.export", flush=True)
        return None
    uri = client.get_logged_model(model_id).artifact_location.rstrip("/") + "/hf"
    if MARKER not in {Path(f.path).name for f in client.list_logged_model_artifacts(model_id, "hf")}:
        card = CardInfo(name, version, args, res["tags"], lineage_of(spec, client, name, version),
                        card_config(spec.model_dump(mode="json")))
        try:
            export(ckpt_dir, "hf", work / "hf", card)
        except ExportError as e:  # the version is registered and servable; only its Hugging Face copy is missing
            print(f"[register] warning: {name} v{version} has no Hugging Face copy: {e}", flush=True)
            client.set_model_version_tag(name, version, "export.hf", f"not exported: {e}"[:4000])
            return None
        marker = work / "hf" / MARKER
        os.replace(marker, work / MARKER)
        client.log_model_artifacts(model_id, str(work / "hf"), "hf")  # a retry uploads again (same names)
        client.log_model_artifact(model_id, str(work / MARKER), "hf")  # last: its presence means complete
    client.set_model_version_tag(name, version, "export.hf", uri)
    return uri


# -- the CLI -------------------------------------------------------------------------------------------------------

def resolve_version(client, ref: str):
    return resolve_model(client, ref.removeprefix("models:/"))


def lineage_of(spec, client, name: str, version: str) -> dict | None:
    """:mod:`pipelines.lineage`'s answer for the version; None when its corpus version is not under ``run.root``.
    A corpus version that storage did not return (75) or that this user may not read (2) is raised: no card says
    "not found" for those."""
    try:
        return model_query(spec, client, f"{name}/{version}")
    except CorpusNotFound:
        return None


def version_card(spec, client, mv, model_dir: Path, tmp: Path) -> CardInfo:
    """What the card says of a registered version: its tags, its lineage, the spec its training run logged."""
    lin = lineage_of(spec, client, mv.name, str(mv.version))
    return CardInfo(mv.name, str(mv.version), json.loads((model_dir / "model_args.json").read_text()),
                    dict(mv.tags or {}), lin, run_spec(client, mv.run_id, tmp))


def run_spec(client, run_id: str, tmp: Path) -> dict | None:
    """The card's view of the spec the training run logged (``spec.yaml``); None when the run has none (MLflow says
    so: no such file, or no such run) or it is not a spec. A spec listed that does not come (the server or the
    artifact store failing) raises: no card leaves it out for that (exit 75 in :func:`main`)."""
    try:
        listed = {Path(f.path).name for f in client.list_artifacts(run_id)}
    except Exception as e:  # noqa: BLE001 - MLflow's answer that the run is gone: the card says so
        if not tracking.mlflow_error(e) or tracking.mlflow_outage(e):
            raise
        return None
    if "spec.yaml" not in listed:
        return None
    local = client.download_artifacts(run_id, "spec.yaml", str(tmp))
    try:
        return card_config(yaml.safe_load(Path(local).read_text(encoding="utf-8")))
    except (yaml.YAMLError, ValueError, TypeError, AttributeError, KeyError):  # not a spec: the card says so
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.eval.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, metavar="NAME@ALIAS|NAME/VERSION", help="the registered version")
    ap.add_argument("--format", required=True, choices=("hf", "gguf"), help="hf: a transformers directory; gguf: "
                    "DIR/model.gguf with the tokenizer embedded")
    ap.add_argument("--out", required=True, metavar="DIR", help="new, empty, or holding an earlier export")
    ap.add_argument("--gguf-dtype", choices=("f32", "f16"), default="f32", help="GGUF matrices (norms stay f32)")
    add_spec_args(ap)
    args = ap.parse_args(argv)
    try:
        check_out(Path(args.out))  # before anything is downloaded (export checks again before it writes)
    except ExportError as e:
        print(f"export: error: {e}", file=sys.stderr)
        return USER_ERROR
    except OSError as e:
        return _os_error(e)
    spec = spec_from_args(args)
    from mlflow.exceptions import MlflowException

    from pipelines.eval.model_dir import download_model_dir

    try:
        client = tracking.client(spec)
        mv = resolve_version(client, args.model)
        with tempfile.TemporaryDirectory(prefix="llmp-export-") as tmp:
            d = download_model_dir(f"models:/{mv.name}/{mv.version}", tracking.tracking_uri(spec), tmp)
            names = export(d, args.format, Path(args.out), version_card(spec, client, mv, d, Path(tmp)),
                           args.gguf_dtype)
    except (ExportError, LookupError, StageError) as e:
        print(f"export: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", USER_ERROR)  # 75: the tracking server did not answer
    except MlflowException as e:  # no such model, version or alias: the user's (2); the server failing: 75
        print(f"export: error: {args.model}: {str(e).splitlines()[0]}", file=sys.stderr)
        return USER_ERROR if tracking.mlflow_answered(e) else RETRY
    except OSError as e:
        return _os_error(e)
    print(f"export: {mv.name} v{mv.version} → {args.out} ({args.format}): {', '.join(names)}")
    return 0


def _os_error(e: OSError) -> int:
    """The model's files or --out: storage failing (75); refused or in the way (2); one line."""
    print(f"export: error: {type(e).__name__}: {e}", file=sys.stderr)
    return USER_ERROR if e.errno in oserrors.ANSWERS or oserrors.refused(e) else RETRY


if __name__ == "__main__":
    sys.exit(main())
