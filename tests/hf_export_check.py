"""Load a Hugging Face export as a transformers user would, in whichever transformers this interpreter imports
(tests/test_export.py runs it with transformers 4.x from var/tf4 first on PYTHONPATH), and print what it gives as
JSON: the version, the ids of each text, the logits of the first text's ids, the greedy continuation of
``generate(**tok(prefix, return_tensors="pt"))`` and the config's rope theta as the model read it.

    python tests/hf_export_check.py DIR TEXTS.json PREFIX_TOKENS NEW_TOKENS
"""
import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(out: str, texts_file: str, prefix: int, new: int) -> dict:
    texts = json.load(open(texts_file))
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    enc = tok(tok.decode(ids[0][:prefix]), add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        logits = model(torch.tensor([ids[0][:48]])).logits[0].tolist()
        cont = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.eos_token_id)
    cfg = model.config
    theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    return {"version": transformers.__version__, "ids": ids, "logits": logits, "input_keys": sorted(enc.keys()),
            "prefix": enc["input_ids"][0].tolist(), "continuation": cont[0, enc["input_ids"].shape[1]:].tolist(),
            "rope_theta": theta}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
