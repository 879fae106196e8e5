# Tests of the varlen entry points (flash_attn_varlen_func and its qkv/kv-packed variants): outputs,
# softmax_lse layout, S_dmask padding and gradients against the per-sequence reference, zero-length
# sequences, per-batch ALiBi, GQA, and agreement with the dense path when all lengths are equal.
import functools

import pytest
import torch

from cases import FEATURES, VARLEN_CASES, feature_kwargs
from flash_attn import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flash_attn.reference import attention_varlen_ref, cu_from_seqlens
from helpers import (
    DTYPES,
    assert_close_fa,
    assert_no_nan,
    check_output_and_grads,
    lse_dtype_ok,
    randn,
    reference_pair,
    require_supported,
    varlen_tensors,
)


def _varlen_ref(cu_q, cu_k, **kwargs):
    return functools.partial(attention_varlen_ref, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kwargs)


def _run(seqlens_q, seqlens_k, h, hk, d, dtype, device, **kwargs):
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, h, hk, d, dtype, device, requires_grad=True)
    dout = randn(*q.shape, dtype=dtype, device=device)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), **kwargs)
    assert out.shape == q.shape and out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_no_nan(out, *grads)
    truth, naive = reference_pair(_varlen_ref(cu_q, cu_k, **kwargs), (q, k, v), dout)
    check_output_and_grads(out, grads, truth, naive)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_varlen(case, dtype, causal, device):
    seqlens_q, seqlens_k, h, hk, d = case
    _run(seqlens_q, seqlens_k, h, hk, d, dtype, device, causal=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_varlen_features(feature, dtype, device):
    seqlens_q, seqlens_k, h, hk, d = [40, 0, 77, 9], [64, 5, 30, 9], 4, 2, 48
    kwargs = feature_kwargs(feature, len(seqlens_q), h, device)
    _run(seqlens_q, seqlens_k, h, hk, d, dtype, device, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_varlen_return_attn_probs(dtype, device):
    seqlens_q, seqlens_k, h = [7, 0, 20, 3], [9, 4, 11, 0], 2
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, h, 1, 16, dtype, device)
    out, lse, probs = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 20, 11, causal=True, return_attn_probs=True
    )
    assert lse.shape == (h, sum(seqlens_q)) and lse_dtype_ok(lse.dtype, dtype)
    assert probs.shape == (4, h, 20, 11) and probs.dtype == dtype
    assert_no_nan(out, lse, probs)
    ref_out, ref_lse, ref_probs = attention_varlen_ref(
        q, k, v, cu_q, cu_k, max_seqlen_q=20, max_seqlen_k=11, causal=True, return_probs=True,
        compute_dtype=torch.float64,
    )
    naive_probs = attention_varlen_ref(
        q, k, v, cu_q, cu_k, max_seqlen_q=20, max_seqlen_k=11, causal=True, return_probs=True, compute_dtype=dtype
    )[2]
    assert_close_fa(probs, ref_probs, naive_probs, 2, floor_dtype=torch.float32)
    for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k)):
        assert torch.equal(probs[b, :, sq:], torch.zeros_like(probs[b, :, sq:]))
        assert torch.equal(probs[b, :, :, sk:], torch.zeros_like(probs[b, :, :, sk:]))
    last = slice(sum(seqlens_q[:3]), sum(seqlens_q))
    assert torch.equal(out[last], torch.zeros_like(out[last]))
    assert torch.isinf(lse[:, last]).all() and (lse[:, last] > 0).all()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite.to(lse.device))
    torch.testing.assert_close(lse[finite], ref_lse[finite].float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_dense_for_equal_lengths(causal, dtype, device):
    require_supported(device, dtype, 32)
    batch, seqlen, h, hk, d = 3, 45, 4, 2, 32
    q = randn(batch, seqlen, h, d, dtype=dtype, device=device, requires_grad=True)
    k = randn(batch, seqlen, hk, d, dtype=dtype, device=device, requires_grad=True)
    v = randn(batch, seqlen, hk, d, dtype=dtype, device=device, requires_grad=True)
    dout = randn(batch, seqlen, h, d, dtype=dtype, device=device)
    cu = cu_from_seqlens([seqlen] * batch, device)
    out_dense = flash_attn_func(q, k, v, causal=causal)
    out_var = flash_attn_varlen_func(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, seqlen, seqlen, causal=causal
    )
    torch.testing.assert_close(out_var.view_as(out_dense), out_dense)
    g_dense = torch.autograd.grad(out_dense, (q, k, v), dout)
    g_var = torch.autograd.grad(out_var, (q, k, v), dout.flatten(0, 1))
    for a, b in zip(g_var, g_dense):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_qkvpacked(causal, dtype, device):
    require_supported(device, dtype, 40)
    seqlens = [13, 0, 64, 1]
    cu = cu_from_seqlens(seqlens, device)
    qkv = randn(sum(seqlens), 3, 4, 40, dtype=dtype, device=device, requires_grad=True)
    dout = randn(sum(seqlens), 4, 40, dtype=dtype, device=device)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, max(seqlens), causal=causal)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = qkv.unbind(1)
    truth, naive = reference_pair(_varlen_ref(cu, cu, causal=causal), (q, k, v), dout)
    check_output_and_grads(out, dqkv.unbind(1), truth, naive)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nheads_k", [4, 1])
def test_varlen_kvpacked(nheads_k, dtype, device):
    require_supported(device, dtype, 24)
    seqlens_q, seqlens_k = [5, 31, 0], [17, 8, 3]
    cu_q, cu_k = cu_from_seqlens(seqlens_q, device), cu_from_seqlens(seqlens_k, device)
    q = randn(sum(seqlens_q), 4, 24, dtype=dtype, device=device, requires_grad=True)
    kv = randn(sum(seqlens_k), 2, nheads_k, 24, dtype=dtype, device=device, requires_grad=True)
    dout = randn(*q.shape, dtype=dtype, device=device)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 31, 17, causal=True, softcap=10.0)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    k, v = kv.unbind(1)
    truth, naive = reference_pair(_varlen_ref(cu_q, cu_k, causal=True, softcap=10.0), (q, k, v), dout)
    check_output_and_grads(out, (dq, dkv[:, 0], dkv[:, 1]), truth, naive)


def test_varlen_noncontiguous(device):
    require_supported(device, torch.float32, 32)
    seqlens_q, seqlens_k = [11, 25], [30, 6]
    cu_q, cu_k = cu_from_seqlens(seqlens_q, device), cu_from_seqlens(seqlens_k, device)
    q = randn(4, sum(seqlens_q), 32, device=device).transpose(0, 1)
    kv = randn(sum(seqlens_k), 2, 2, 32, device=device)
    k, v = kv[:, 0], kv[:, 1]
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 25, 30, causal=True)
    out_contig = flash_attn_varlen_func(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, 25, 30, causal=True)
    torch.testing.assert_close(out, out_contig)
    truth, naive = reference_pair(_varlen_ref(cu_q, cu_k, causal=True), (q, k, v))
    assert_close_fa(out, truth[0], naive[0], 2)
