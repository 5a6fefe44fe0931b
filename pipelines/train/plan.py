"""Memory and compute plan of a job spec, before any GPU is touched.

``python -m pipelines.train.plan SPEC.yaml [--gpu-mem-gb 80] [--json]`` prints, per GPU for the
spec's parallel layout (``parallel`` × ``launcher``), what the model states and activations take and
whether they fit, plus the FLOPs per token that MFU is measured against.

Model states (mixed precision as the trainer runs it: fp32 master weights, fp32 gradients, AdamW's
two fp32 moments, bf16 compute copies gathered per block): 4 + 4 + 8 = 16 bytes per parameter, divided
by the sharding degree (``dp_shard`` × ``tp`` for FSDP2 + TP; DDP replicates them). FSDP2 also holds
the bf16 unsharded parameters of the block being computed and of the one prefetched: 2 × 2 bytes × the
largest block's parameters.

Activations per micro-batch, counted from the tensors autograd keeps for one of our blocks (no
dropout; SDPA/flash attention, so no s² score matrix; 16-bit under bf16, doubled in fp32), for
sequence s, micro-batch b, hidden h, SwiGLU width f, KV share k = kv_heads / heads and TP degree t:

* not split by TP: the two RMSNorm inputs and the attention and MLP inputs: 8·s·b·h bytes;
* split by TP: Q, K, V and the attention output, 2·s·b·h·(2 + 2k), and the SwiGLU's w1 and w3
  outputs and their product, 6·s·b·f: divided by t.

``selective`` checkpointing recomputes every other block (torchtitan's layer-selective mode, frequency
2): those keep only their 16-bit input (2·s·b·h); ``full`` keeps only the inputs of every block plus
one block's full set during its recompute. The logits add s·b·V·(2 + 4) bytes (16-bit logits and the
fp32 softmax the loss keeps) with the full-logits loss; with the chunked one (``train.loss_chunk_tokens``) one
chunk's c·V·(2 + 4), plus the gradients it keeps for the backward: the head's V·h·4 and the hidden states' s·b·h·2. The method follows Korthikanti et al. ("Reducing Activation
Recomputation in Large Transformer Models", 2022), whose GPT count is s·b·h·(10 + 24/t) with dropout.

FLOPs per token (PaLM appendix B, as the issue and torchtitan count them): ``6·N + 12·L·H·d_head·T``,
N the parameters that take part in matmuls (all but the input embedding; a tied head counts once),
L layers, H heads, d_head head size, T the sequence length.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from pipelines.exit_codes import USER_ERROR
from pipelines.spec import JobSpec, SpecError, load_spec

GIB = 1 << 30


def ffn_hidden(ffn_mult: float, d_model: int) -> int:
    """SwiGLU width: ffn_mult × d_model rounded up to a multiple of 32 (3.5 × 4096 = 14336)."""
    return int(math.ceil(ffn_mult * d_model / 32) * 32)


def model_shape(spec: JobSpec) -> dict:
    m = spec.model
    vocab = m.vocab_size or spec.tokenizer.planned_vocab
    d, heads = m.d_model, m.n_heads
    kv = m.n_kv_heads or heads
    return {"vocab": vocab, "d": d, "layers": m.n_layers, "heads": heads, "kv_heads": kv, "head_dim": d // heads,
            "ffn": ffn_hidden(m.ffn_mult, d), "seq": m.seq_len, "tied": m.tie_embeddings}


def param_count(shape: dict) -> dict:
    """Parameters of the Llama-style model (``pipelines.train.model.param_count`` uses this; a test
    checks it against the torch module's own count)."""
    d, L, V, f = shape["d"], shape["layers"], shape["vocab"], shape["ffn"]
    kvd = shape["kv_heads"] * shape["head_dim"]
    block = 2 * d * d + 2 * d * kvd + 3 * d * f + 2 * d
    emb = V * d
    head = 0 if shape["tied"] else V * d
    total = emb + head + L * block + d
    return {"total": total, "embedding": emb, "head": head, "block": block,
            "matmul": total if shape["tied"] else total - emb}  # all but the input embedding's lookup


def flops_per_token(shape: dict, params: dict) -> int:
    return 6 * params["matmul"] + 12 * shape["layers"] * shape["heads"] * shape["head_dim"] * shape["seq"]


# Dense peak FLOP/s per GPU from the vendors' datasheets (no sparsity), by compute dtype.
PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100 SXM": {"bf16": 989e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835e12, "fp32": 60e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
    "A10G": {"bf16": 70e12, "fp32": 31.2e12},
}


def peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """Peak FLOP/s of a GPU named as ``torch.cuda.get_device_name`` names it; None when unknown (or CPU)."""
    n = device_name.upper()
    if "H100" in n:
        key = "H100 PCIe" if "PCIE" in n else "H100 NVL" if "NVL" in n else "H100 SXM"
    else:
        key = next((k for k in PEAK_FLOPS if k.upper() in n), None)
    return PEAK_FLOPS[key][dtype] if key else None


def mfu(tokens_per_s: float, flops_per_token: float, n_gpus: int, device_name: str, dtype: str = "bf16") -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all GPUs (None when the peak is unknown)."""
    peak = peak_flops(device_name, dtype)
    return None if peak is None else tokens_per_s * flops_per_token / (peak * n_gpus)


LOSS_CHUNK_VALUES = 2 ** 27  # 'auto' loss chunk: logits of at most this many values (512 MiB in fp32)


def loss_chunk(setting: int | str, vocab: int) -> int:
    """Tokens per chunk of the head's loss (``train.loss_chunk_tokens``; 0 = the full logits): 'auto' is the largest
    power of two ≤ LOSS_CHUNK_VALUES / vocab, at least 64 (so above 2^21 entries a chunk holds more)."""
    if setting != "auto":
        return int(setting)
    return max(64, 1 << max(0, (LOSS_CHUNK_VALUES // max(1, vocab)).bit_length() - 1))


def activation_bytes(shape: dict, micro_batch: int, tp: int, mode: str, bytes_per: int, chunk: int = 0) -> int:
    s, b, h, f, L, V = shape["seq"], micro_batch, shape["d"], shape["ffn"], shape["layers"], shape["vocab"]
    k = shape["kv_heads"] / shape["heads"]
    scale = bytes_per / 2                              # the counts below are for 16-bit tensors
    block = (8 * s * b * h + (2 * s * b * h * (2 + 2 * k) + 6 * s * b * f) / tp) * scale
    block_input = 2 * s * b * h * scale
    if mode == "full":
        layers = L * block_input + block
    elif mode == "selective":                          # every other block recomputed
        layers = (L - L // 2) * block + (L // 2) * block_input
    else:
        layers = L * block
    if chunk:  # one chunk's logits and fp32 softmax, the saved head and hidden-state gradients
        logits = min(chunk, s * b) * V * (bytes_per + 4) + V * h * 4 + s * b * h * bytes_per
    else:
        logits = s * b * V * (bytes_per + 4)
    return int(layers + logits)


def memory_plan(spec: JobSpec, gpu_mem_gb: float = 80.0) -> dict:
    shape = model_shape(spec)
    p = param_count(shape)
    deg = spec.degrees
    n = p["total"]
    bf16 = spec.train.dtype == "bf16"
    shard = deg["dp_shard"] * deg["tp"]
    weights, grads, optim = 4 * n, 4 * n, 8 * n
    states = (weights + grads + optim) / shard
    gathered = 2 * 2 * (p["block"] / deg["tp"]) if deg["dp_shard"] > 1 else 0  # FSDP2 unsharded bf16 blocks
    acts = activation_bytes(shape, spec.train.micro_batch, deg["tp"], spec.parallel.activation_checkpointing,
                            2 if bf16 else 4, loss_chunk(spec.train.loss_chunk_tokens, shape["vocab"]))
    per_gpu = int(states + gathered + acts)
    limit = int(gpu_mem_gb * GIB)
    return {
        "params": n, "params_matmul": p["matmul"], "world_size": spec.world_size, "degrees": deg,
        "precision": "bf16 compute / fp32 master" if bf16 else "fp32",
        "weights_bytes": weights, "grads_bytes": grads, "optimizer_bytes": optim,
        "model_states_per_gpu_bytes": int(states), "fsdp_gathered_bytes": int(gathered),
        "activations_bytes": acts, "per_gpu_bytes": per_gpu, "gpu_mem_bytes": limit,
        "fits": per_gpu <= limit, "headroom_bytes": limit - per_gpu,
        "flops_per_token": flops_per_token(shape, p),
        "tokens_per_step": spec.global_batch * shape["seq"], "global_batch": spec.global_batch,
        "activation_checkpointing": spec.parallel.activation_checkpointing, "shape": shape,
    }


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f} GiB"


def format_plan(plan: dict) -> str:
    d = plan["degrees"]
    lines = [
        f"model: {plan['params']:,} parameters ({plan['params'] / 1e9:.2f} B), {plan['precision']}",
        f"world {plan['world_size']} = dp_replicate {d['dp_replicate']} × dp_shard {d['dp_shard']} × tp {d['tp']}"
        f" × pp {d['pp']} × cp {d['cp']}; global batch {plan['global_batch']} seqs = {plan['tokens_per_step']:,} tokens",
        f"  weights (fp32)          {_gib(plan['weights_bytes'])} total",
        f"  gradients (fp32)        {_gib(plan['grads_bytes'])} total",
        f"  AdamW moments (fp32)    {_gib(plan['optimizer_bytes'])} total",
        f"  model states per GPU    {_gib(plan['model_states_per_gpu_bytes'])} (÷ {d['dp_shard'] * d['tp']} sharding)",
        f"  FSDP gathered blocks    {_gib(plan['fsdp_gathered_bytes'])}",
        f"  activations per GPU     {_gib(plan['activations_bytes'])} (checkpointing: {plan['activation_checkpointing']})",
        f"  total per GPU           {_gib(plan['per_gpu_bytes'])} of {_gib(plan['gpu_mem_bytes'])}: "
        + ("fits" if plan["fits"] else f"DOES NOT FIT (short by {_gib(-plan['headroom_bytes'])})"),
        f"FLOPs per token: {plan['flops_per_token']:,} (6·N + 12·L·H·d_head·T)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.train.plan",
                                 description="Memory plan (per GPU) and FLOPs per token of a job spec.")
    ap.add_argument("spec", help="Job spec YAML (e.g. configs/llama3_8b.yaml).")
    ap.add_argument("--gpu-mem-gb", type=float, default=80.0, help="GPU memory to fit in, GiB (default 80).")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="Override a spec value, e.g. --set parallel.dp_shard=8 (repeatable).")
    ap.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")
    args = ap.parse_args(argv)
    try:
        spec = load_spec(args.spec, args.overrides)
    except SpecError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return USER_ERROR
    if not (spec.model.vocab_size or spec.tokenizer.vocab_size):
        print("plan: error: set model.vocab_size (or tokenizer.vocab_size)", file=sys.stderr)
        return USER_ERROR
    plan = memory_plan(spec, args.gpu_mem_gb)
    print(json.dumps(plan) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
