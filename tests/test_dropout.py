# Dropout tests: the keep mask read from the sign of S_dmask equals the reference Philox4x32-10 mask
# bit for bit (public entry points, with the rng_state they pass to the fwd op, and the raw op with an
# explicit rng_state), outputs/gradients equal the reference computed with that mask, the kept fraction
# is within statistical bounds of 1 - p, and the same seed reproduces everything bit-exactly.
import functools
import math

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn.reference import (
    attention_ref,
    attention_varlen_ref,
    dropout_keep_mask,
    dropout_keep_mask_varlen,
)
from helpers import (
    DTYPES,
    CaptureRngState,
    assert_close_fa,
    check_output_and_grads,
    make_qkv,
    randn,
    reference_pair,
    varlen_tensors,
)


def _keep_from_probs(probs):
    """(keep, informative): keep = S_dmask >= 0, informative where S_dmask != 0."""
    return probs >= 0, probs != 0


def _assert_mask_equal(probs, expected, min_informative=0.5):
    keep, informative = _keep_from_probs(probs)
    expected = expected.to(probs.device)
    assert informative.float().mean().item() >= min_informative
    mismatches = (keep != expected) & informative
    assert not mismatches.any(), f"{int(mismatches.sum())} dropout decisions differ from the Philox reference"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p", [0.17, 0.5, 0.9])
@pytest.mark.parametrize("shape", [(2, 17, 113, 4, 2, 40), (1, 128, 33, 2, 2, 64)])
def test_dropout_mask_matches_philox(shape, p, dtype, device):
    batch, sq, sk, h, hk, d = shape
    q, k, v = make_qkv(batch, sq, sk, h, hk, d, dtype, device)
    with CaptureRngState() as capture:
        out, lse, probs = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    rng_state = capture.last()
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,) and rng_state.device == q.device
    assert probs.shape == (batch, h, sq, sk) and probs.dtype == dtype
    _assert_mask_equal(probs, dropout_keep_mask(rng_state, batch, h, sq, sk, p))
    ref_probs = attention_ref(q, k, v, return_probs=True, compute_dtype=torch.float64)[2]
    naive_probs = attention_ref(q, k, v, return_probs=True, compute_dtype=dtype)[2]
    assert_close_fa(probs.abs(), ref_probs, naive_probs, 2, floor_dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(causal=True), dict(window_size=(10, 3), softcap=5.0, alibi=True)],
    ids=["plain", "causal", "window_softcap_alibi"],
)
def test_dropout_output_and_grads_match_reference(kwargs, dtype, device):
    batch, sq, sk, h, hk, d, p = 2, 45, 77, 4, 1, 32, 0.3
    q, k, v = make_qkv(batch, sq, sk, h, hk, d, dtype, device, requires_grad=True)
    dout = randn(batch, sq, h, d, dtype=dtype, device=device)
    kwargs = dict(kwargs)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(batch, h, device=device) + 0.05
    with CaptureRngState() as capture:
        out = flash_attn_func(q, k, v, dropout_p=p, **kwargs)
    rng_state = capture.last()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = dropout_keep_mask(rng_state, batch, h, sq, sk, p).to(device)
    ref_fn = functools.partial(attention_ref, dropout_mask=keep, dropout_p=p, **kwargs)
    truth, naive = reference_pair(ref_fn, (q, k, v), dout)
    check_output_and_grads(out, grads, truth, naive)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_kept_fraction(p, device):
    batch, h, s = 2, 4, 128
    q, k, v = make_qkv(batch, s, s, h, h, 32, torch.float32, device)
    out, lse, probs = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    keep, informative = _keep_from_probs(probs)
    assert informative.all()
    n = keep.numel()
    frac = keep.float().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(frac - (1 - p)) < 6 * sigma, f"kept fraction {frac:.4f}, expected {1 - p:.4f} +- {6 * sigma:.4f}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dropout_same_seed_reproduces(dtype, device):
    q, k, v = make_qkv(2, 50, 60, 4, 2, 24, dtype, device, requires_grad=True)
    dout = torch.randn_like(q)
    results = []
    for _ in range(2):
        torch.manual_seed(2024)
        out = flash_attn_func(q, k, v, dropout_p=0.4, causal=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_dropout_different_seeds_differ(device):
    q, k, v = make_qkv(1, 40, 40, 2, 2, 16, torch.float32, device)
    torch.manual_seed(1)
    out1, _, probs1 = flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    torch.manual_seed(2)
    out2, _, probs2 = flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    assert not torch.equal(out1, out2)
    assert ((probs1 >= 0) != (probs2 >= 0)).float().mean().item() > 0.3
    out3, _, probs3 = flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    assert not torch.equal(out2, out3)


def test_dropout_zero_equals_no_dropout(device):
    q, k, v = make_qkv(2, 30, 41, 2, 1, 16, torch.float32, device)
    out0 = flash_attn_func(q, k, v, dropout_p=0.0, causal=True)
    out = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out0, out)


@pytest.mark.parametrize(
    "rng_values",
    [(0, 0), (5, 17), (2**62 - 12345, 2**31 + 99), (0x123456789ABCDEF, 0xFFFFFFFF)],
    ids=["zero", "small", "large", "high_key"],
)
def test_fwd_op_explicit_rng_state(rng_values, device):
    batch, sq, sk, h, d, p = 2, 19, 37, 2, 16, 0.35
    q, k, v = make_qkv(batch, sq, sk, h, h, d, torch.float32, device)
    rng_state = torch.tensor(rng_values, dtype=torch.int64, device=device)
    out, lse, probs = torch.ops.flash_attn.fwd(
        q, k, v, None, None, 0, 0, p, d**-0.5, -1, -1, True, 0.0, None, None, rng_state, True
    )
    expected = dropout_keep_mask(rng_state, batch, h, sq, sk, p)
    _assert_mask_equal(probs, expected, min_informative=0.99)
    ref_out, _ = attention_ref(q, k, v, dropout_mask=expected.to(device), dropout_p=p, compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)


def test_fwd_op_uses_low_32_bits_of_offset(device):
    q, k, v = make_qkv(1, 16, 16, 2, 2, 8, torch.float32, device)
    args = (None, None, 0, 0, 0.5, 8**-0.5, -1, -1, True, 0.0, None, None)
    rng_a = torch.tensor([987654321, 42], dtype=torch.int64, device=device)
    rng_b = torch.tensor([987654321, 42 + 2**32], dtype=torch.int64, device=device)
    out_a = torch.ops.flash_attn.fwd(q, k, v, *args, rng_a, False)[0]
    out_b = torch.ops.flash_attn.fwd(q, k, v, *args, rng_b, False)[0]
    assert torch.equal(out_a, out_b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dropout_varlen(dtype, device):
    seqlens_q, seqlens_k, h, p = [9, 0, 40, 17], [23, 6, 31, 0], 4, 0.25
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, h, 2, 32, dtype, device, requires_grad=True)
    dout = torch.randn_like(q)
    max_q, max_k = max(seqlens_q), max(seqlens_k)
    with CaptureRngState() as capture:
        out, lse, probs = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=p, causal=True, return_attn_probs=True
        )
    rng_state = capture.last()
    assert probs.shape == (len(seqlens_q), h, max_q, max_k)
    keep = dropout_keep_mask_varlen(rng_state, seqlens_q, seqlens_k, h, p)
    _assert_mask_equal(probs, keep, min_informative=0.05)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_fn = functools.partial(
        attention_varlen_ref, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, dropout_mask=keep.to(device),
        dropout_p=p,
    )
    truth, naive = reference_pair(ref_fn, (q, k, v), dout)
    check_output_and_grads(out, grads, truth, naive)
