"""Calibration of our harness wrapper against lm-evaluation-harness's own reference implementation.

Our model is a Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention), so its weights convert to Hugging Face's
``LlamaForCausalLM`` (:func:`pipelines.eval.export.hf_llama`, what ``export --format hf`` writes), and its
SentencePiece model loads as a Hugging Face tokenizer. lm-eval's ``HFLM`` then scores the same task items with its
own code: the context/continuation split, the batching and padding, the log-softmax gather and the greedy check. Our ``llm-pipeline`` wrapper (``PipelineLM`` over ``TextModel``) must give the same log-likelihood
for every request and the same greedy flags, hence the same scores.

    python -m pipelines.eval.calibrate --model-uri models:/NAME@champion [--tasks llmp_arc_easy,…] [--limit 20]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

from pipelines.eval.bpb import model_parser
from pipelines.eval.export import hf_llama
from pipelines.exit_codes import USER_ERROR


def hf_tokenizer(sp_model_path: str):
    """The SentencePiece model as a Hugging Face tokenizer (no BOS: our documents are separated by EOS)."""
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    return SentencePieceBackend(vocab_file=sp_model_path, legacy=True, eos_token="</s>", unk_token="<unk>",
                                bos_token="<s>", pad_token="<unk>", add_bos_token=False)


def compare(text_model, sp_model_path: str, tasks: list[str], limit: int, data_dir: str | None = None) -> dict:
    """Both implementations on the same items: requests, the largest |Δ log p|, greedy flags that differ, scores."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from pipelines.eval.harness import PipelineLM, task_manager

    ref = HFLM(pretrained=hf_llama(text_model.model), tokenizer=hf_tokenizer(sp_model_path), batch_size=8,
               device="cpu", max_length=text_model.seq_len, add_bos_token=False)
    kw = dict(tasks=list(tasks), limit=limit, task_manager=task_manager(data_dir), log_samples=True, bootstrap_iters=0,
              random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    theirs, ours = simple_evaluate(model=ref, **kw), simple_evaluate(model=PipelineLM(text_model=text_model), **kw)
    worst, flips, n = 0.0, 0, 0
    for task, samples in theirs["samples"].items():
        for a, b in zip(samples, ours["samples"][task]):
            for ra, rb in zip(a["resps"], b["resps"]):
                worst, flips, n = max(worst, abs(ra[0][0] - rb[0][0])), flips + (ra[0][1] != rb[0][1]), n + 1

    def scores(res):
        return {t: {k.split(",")[0]: v for k, v in r.items() if k.endswith(",none") and "stderr" not in k}
                for t, r in res["results"].items()}

    return {"requests": n, "max_abs_logprob_diff": worst, "greedy_flags_differing": flips,
            "ours": scores(ours), "lm_eval_hflm": scores(theirs)}


def main(argv: list[str] | None = None) -> int:
    from pipelines.eval.harness import TASKS
    from pipelines.eval.lm import TextModel

    ap = model_parser("pipelines.eval.calibrate", __doc__.splitlines()[0])
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--limit", type=int, default=20)
    args = ap.parse_args(argv)
    try:
        tm = TextModel.open(args.model_uri, args.tracking_uri)
    except LookupError as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return getattr(e, "exit_code", USER_ERROR)  # 75: the tracking server did not answer

    with tempfile.NamedTemporaryFile(suffix=".model") as f:  # the tokenizer the model carries, as a file for HF
        f.write(tm.sp.serialized_model_proto())
        f.flush()
        res = compare(tm, f.name, [t for t in args.tasks.split(",") if t], args.limit)
    print(json.dumps(res, indent=2))
    return 0 if res["max_abs_logprob_diff"] < 1e-3 and not res["greedy_flags_differing"] else 1


if __name__ == "__main__":
    sys.exit(main())
