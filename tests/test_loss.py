"""The chunked LM head + cross-entropy (pipelines/train/loss.py) against the plain full-logits way."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from pipelines.spec import SpecError, load_spec
from pipelines.train import plan
from pipelines.train.loss import IGNORE, LinearCrossEntropy, ce_chunk, ce_chunk_pointwise, for_spec
from pipelines.train.model import ModelArgs, Transformer

CPU = torch.device("cpu")


def _inputs(n=300, d=16, v=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (0.3 * torch.randn(v, d, generator=g)).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = IGNORE
    return h, w, t


def _grads(loss_of, h, w, t, scale=1.0):
    h.grad = w.grad = None
    loss = loss_of(h, w, t)
    (loss * scale).backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


def _plain(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t)


@pytest.mark.parametrize("chunk", [1, 64, 299, 300, 1000])
def test_loss_and_gradients_equal_the_full_logits_way_whatever_the_chunk(chunk):
    h, w, t = _inputs()
    ref = _grads(_plain, h, w, t, scale=3.0)  # the incoming gradient (1 / grad_accum, a loss scale) is applied
    got = _grads(LinearCrossEntropy(chunk), h, w, t, scale=3.0)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(got[1][::7]) == 0  # an ignored target's hidden state gets no gradient


def test_an_ignored_target_contributes_nothing():
    h, w, t = _inputs(n=10)
    t[:] = IGNORE
    t[3] = 5
    _, gh, _ = _grads(LinearCrossEntropy(4), h, w, t)
    assert torch.count_nonzero(gh.sum(1)) == 1 and gh[3].abs().sum() > 0
    loss = LinearCrossEntropy(4)(h, w, t)
    torch.testing.assert_close(loss, F.cross_entropy((h[3:4] @ w.t()).float(), t[3:4]))


@pytest.mark.parametrize("bad", [-1, -99, 97])
def test_a_target_outside_the_vocabulary_is_refused_as_f_cross_entropy_refuses_it(bad):
    h, w, t = _inputs(n=10)  # vocabulary 97
    t[4] = bad
    with pytest.raises((RuntimeError, IndexError)):
        _plain(h, w, t)
    with pytest.raises(RuntimeError, match="outside 0..96"):
        LinearCrossEntropy(4)(h, w, t)


def test_without_autograd_only_the_loss_is_computed_and_it_is_the_same():
    h, w, t = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(LinearCrossEntropy(50)(h, w, t), _plain(h, w, t), rtol=1e-6, atol=1e-6)


def test_under_bf16_autocast_the_logits_are_bf16_like_the_plain_way_and_the_gradients_are_fp32():
    h, w, t = _inputs(n=512, d=32, v=211)

    def auto(fn):
        def run(h, w, t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(h, w, t)
        return run

    ref, got = _grads(auto(_plain), h, w, t), _grads(auto(LinearCrossEntropy(128)), h, w, t)
    assert got[1].dtype == got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)  # the same bf16 logits, fp32 softmax
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-2 * ref[1].abs().max().item())
    # the head's gradient: bf16 products summed chunk by chunk (fp32) instead of one bf16 product
    torch.testing.assert_close(got[2], ref[2], rtol=0, atol=2e-2 * ref[2].abs().max().item())


def _model(loss_fn):
    torch.manual_seed(0)
    m = Transformer(ModelArgs(vocab_size=300, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, seq_len=16))
    m.loss_fn = loss_fn
    return m


def test_the_model_with_tied_embeddings_trains_the_same_with_the_chunked_loss():
    x = torch.randint(0, 300, (4, 17), generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (None, LinearCrossEntropy(24)):
        m = _model(fn)
        m(x[:, :-1], x[:, 1:]).backward()
        grads.append({k: p.grad for k, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-6, msg=k)


def test_no_full_vocabulary_logits_are_kept_for_the_backward():
    """What autograd saves for the backward, measured: the plain way keeps logit-sized tensors (tokens × vocab),
    the chunked one only the gradients of the hidden states and of the head."""
    x = torch.randint(0, 300, (4, 17), generator=torch.Generator().manual_seed(1))
    saved = {}
    for name, fn in (("plain", None), ("chunked", LinearCrossEntropy(16))):
        m, sizes = _model(fn), []

        def pack(t, sizes=sizes):
            sizes.append(t.numel())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = m.norm(m.tok_embeddings(x[:, :-1]))  # the head and its loss only
            (m.loss_fn or (lambda h, w, y: F.cross_entropy(m.output(h).flatten(0, 1), y.flatten())))(
                h, m.output.weight, x[:, 1:])
        saved[name] = max(sizes)
    logits = 4 * 16 * 300
    assert saved["plain"] >= logits and saved["chunked"] < logits, saved


def test_bf16_parameters_without_autocast_give_bf16_gradients_summed_in_fp32():
    """FSDP2's mixed precision: the unsharded weight and the hidden states are bf16 and autocast is off."""
    h, w, t = _inputs(n=512, d=32, v=211)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    ref, got = _grads(_plain, hb, wb, t), _grads(LinearCrossEntropy(100), hb, wb, t)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=0, atol=1e-2 * ref[1].abs().max().item())
    torch.testing.assert_close(got[2].float(), ref[2].float(), rtol=0, atol=1e-2 * ref[2].abs().max().item())


def test_the_kept_cpu_buffers_carry_nothing_from_one_call_to_the_next():
    """On CPU the chunk's logits and log-softmax buffers are kept between calls (no caching allocator there): a
    second call on other inputs gives its own numbers, the first call's gradients are not overwritten by it, and a
    larger call after a smaller one (and the short last chunk) gets buffers of its own size."""
    fn = LinearCrossEntropy(64)
    h1, w1, t1 = _inputs(n=150, d=16, v=97, seed=5)  # chunks of 64, 64, 22
    h2, w2, t2 = _inputs(n=40, d=16, v=97, seed=6)  # one chunk of 40 (a slice of the kept buffer)
    loss1 = fn(h1, w1, t1)
    loss1.backward()
    first = (loss1.detach(), h1.grad, w1.grad)  # the tensors themselves, not copies
    kept = {k: b.data_ptr() for k, b in fn.buffers.kept.items()}
    assert set(kept) == {"logits", "lsm"}
    second = _grads(fn, h2, w2, t2)
    assert {k: b.data_ptr() for k, b in fn.buffers.kept.items()} == kept  # reused, not reallocated
    for got, (h, w, t) in ((second, (h2, w2, t2)), (first, (h1, w1, t1))):
        ref = (_plain(h.detach(), w.detach(), t), *torch.autograd.grad(_plain(h, w, t), (h, w)))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    big = LinearCrossEntropy(256)
    _grads(big, h2, w2, t2)
    got = _grads(big, h1, w1, t1)  # 150 rows after 40: a new, larger buffer
    assert big.buffers.kept["logits"].shape == (150, 97)
    for a, b in zip(got, _grads(_plain, h1, w1, t1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_second_derivative_is_refused_not_silently_wrong():
    h, w, t = _inputs(n=20)
    scale = torch.tensor(2.0, requires_grad=True)  # the incoming gradient depends on it: a graph to differentiate
    (gh,) = torch.autograd.grad(LinearCrossEntropy(8)(h, w, t) * scale, h, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gh.sum().backward()


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor on CPU needs a C++ compiler "
                    "(make test installs g++)")
def test_the_compiled_kernel_gives_the_eager_numbers_with_a_short_last_chunk():
    h, w, t = _inputs(n=100, d=8, v=40)  # chunks of 32, 32, 32 and 4
    ref = _grads(LinearCrossEntropy(32), h, w, t)
    got = _grads(LinearCrossEntropy(32, compile=True), h, w, t)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_two_kernels_agree_on_bf16_logits_and_ignored_targets():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3)).bfloat16()
    t = torch.randint(0, 50, (64,), generator=torch.Generator().manual_seed(4))
    t[::5] = IGNORE
    inv = torch.tensor(1 / 51.0)
    (l1, g1), (l2, g2) = ce_chunk(logits.clone(), t, inv), ce_chunk_pointwise(logits.clone(), t, inv)
    assert g1.dtype == g2.dtype == torch.bfloat16 and torch.count_nonzero(g1[::5]) == 0
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(g1.float(), g2.float(), rtol=0, atol=1e-4)
    ref = F.cross_entropy(logits.float(), t, reduction="sum")
    torch.testing.assert_close(l1, ref, rtol=1e-6, atol=1e-5)


def test_the_spec_chooses_the_chunk_which_is_not_part_of_the_stage_key():
    spec = load_spec("configs/gpu_350m.yaml", [], env={})
    assert spec.train.loss_chunk_tokens == "auto" and for_spec(spec, 50_304, CPU).chunk == 2048  # 2048·50304 ≤ 2^27
    assert for_spec(spec, 8192, CPU).chunk == 16384 and for_spec(spec, 10**9, CPU).chunk == 64
    assert for_spec(load_spec(None, ["train.loss_chunk_tokens=0"], env={}), 50_304, CPU) is None
    assert for_spec(load_spec(None, ["train.loss_chunk_tokens=512"], env={}), 50_304, CPU).chunk == 512
    # with parallel.compile (gpu_350m's) the kernel is compiled on a GPU, eager on CPU (where it is the faster)
    assert for_spec(spec, 50_304, CPU).compiled is None
    assert for_spec(spec, 50_304, torch.device("cuda")).compiled is not None
    # the same loss to float rounding: a running training can change it and resume in the same stage directory
    keys = {load_spec(None, [f"train.loss_chunk_tokens={v}"], env={}).stage_hash("train") for v in ("auto", 0, 4096)}
    assert len(keys) == 1
    for bad in ("-1", "1", "true", "lots"):
        with pytest.raises(SpecError, match="loss_chunk_tokens"):
            load_spec(None, [f"train.loss_chunk_tokens={bad}"], env={})
    with pytest.raises(ValueError):
        LinearCrossEntropy(0)


def test_the_memory_plan_counts_one_chunk_of_logits_not_all_of_them():
    full = plan.memory_plan(load_spec("configs/gpu_350m.yaml", ["train.loss_chunk_tokens=0"], env={}))
    chunked = plan.memory_plan(load_spec("configs/gpu_350m.yaml", [], env={}))
    saved = full["activations_bytes"] - chunked["activations_bytes"]
    # 8 × 2048 tokens × 50,304 × 6 bytes of logits and fp32 softmax, less one chunk of 2,048 and the saved gradients
    expect = (16384 - 2048) * 50304 * 6 - 50304 * 1024 * 4 - 16384 * 1024 * 2
    assert saved == expect
