# Forward-pass tests of the dense entry points (flash_attn_func and the packed variants) against
# flash_attn.reference under the FlashAttention tolerance rule: shape/dtype sweeps, causal, window,
# softcap, ALiBi, GQA/MQA, head dims, empty rows, return_attn_probs, non-contiguous inputs.
import functools

import pytest
import torch

from cases import FEATURE_DTYPES, FEATURE_SHAPES, FEATURES, HEADDIMS, SHAPES, feature_kwargs
from flash_attn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flash_attn.reference import attention_ref, visible_mask
from helpers import (
    DTYPES,
    assert_close_fa,
    assert_no_nan,
    lse_dtype_ok,
    make_qkv,
    randn,
    reference_pair,
    require_supported,
)


def _ref_fn(**kwargs):
    return functools.partial(attention_ref, **kwargs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_shapes(shape, dtype, causal, device):
    batch, sq, sk, h, hk, d = shape
    q, k, v = make_qkv(batch, sq, sk, h, hk, d, dtype, device)
    out = flash_attn_func(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    truth, naive = reference_pair(_ref_fn(causal=causal), (q, k, v))
    assert_close_fa(out, truth[0], naive[0], 2)


@pytest.mark.parametrize("dtype", FEATURE_DTYPES)
@pytest.mark.parametrize("shape", FEATURE_SHAPES)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_forward_features(feature, shape, dtype, device):
    batch, sq, sk, h, hk, d = shape
    q, k, v = make_qkv(batch, sq, sk, h, hk, d, dtype, device)
    kwargs = feature_kwargs(feature, batch, h, device)
    out = flash_attn_func(q, k, v, **kwargs)
    truth, naive = reference_pair(_ref_fn(**kwargs), (q, k, v))
    assert_close_fa(out, truth[0], naive[0], 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_forward_headdims(headdim, dtype, device):
    q, k, v = make_qkv(2, 40, 57, 2, 1, headdim, dtype, device)
    out = flash_attn_func(q, k, v, causal=True)
    truth, naive = reference_pair(_ref_fn(causal=True), (q, k, v))
    assert_close_fa(out, truth[0], naive[0], 2)


@pytest.mark.parametrize("nheads_k", [4, 2, 1])
def test_forward_gqa_matches_repeated_kv(nheads_k, device):
    q, k, v = make_qkv(2, 33, 47, 4, nheads_k, 32, torch.float32, device)
    out = flash_attn_func(q, k, v, causal=True)
    group = 4 // nheads_k
    out_mha = flash_attn_func(q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2), causal=True)
    torch.testing.assert_close(out, out_mha, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "kwargs",
    [dict(causal=True), dict(window_size=(2, 0)), dict(window_size=(0, 1)), dict(causal=True, window_size=(3, -1))],
)
def test_rows_without_keys_are_zero(kwargs, dtype, device):
    sq, sk = 50, 20
    q, k, v = make_qkv(2, sq, sk, 2, 2, 16, dtype, device)
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert_no_nan(out, lse, probs)
    rows = ~visible_mask(sq, sk, kwargs.get("window_size", (-1, -1)), kwargs.get("causal", False)).any(-1)
    rows = rows.to(q.device)
    assert rows.any() and not rows.all()
    assert torch.equal(out[:, rows], torch.zeros_like(out[:, rows]))
    assert torch.isinf(lse[:, :, rows]).all() and (lse[:, :, rows] > 0).all()
    assert torch.isfinite(lse[:, :, ~rows]).all()
    assert torch.equal(probs[:, :, rows], torch.zeros_like(probs[:, :, rows]))
    truth, naive = reference_pair(_ref_fn(**kwargs), (q, k, v))
    assert_close_fa(out, truth[0], naive[0], 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs", [dict(), dict(causal=True), dict(window_size=(6, 2), softcap=4.0), dict(alibi="H", causal=True)]
)
def test_return_attn_probs_without_dropout(kwargs, dtype, device):
    batch, sq, sk, h, hk, d = 2, 37, 61, 4, 2, 24
    q, k, v = make_qkv(batch, sq, sk, h, hk, d, dtype, device)
    kwargs = dict(kwargs)
    if kwargs.pop("alibi", None):
        kwargs["alibi_slopes"] = torch.rand(h, device=device) + 0.1
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert out.shape == (batch, sq, h, d)
    assert lse.shape == (batch, h, sq) and lse_dtype_ok(lse.dtype, dtype)
    assert probs.shape == (batch, h, sq, sk) and probs.dtype == dtype
    assert (probs >= 0).all()
    ref_out, ref_lse, ref_probs = attention_ref(q, k, v, return_probs=True, compute_dtype=torch.float64, **kwargs)
    naive_probs = attention_ref(q, k, v, return_probs=True, compute_dtype=dtype, **kwargs)[2]
    assert_close_fa(probs, ref_probs, naive_probs, 2, floor_dtype=torch.float32)
    out_plain = flash_attn_func(q, k, v, **kwargs)
    torch.testing.assert_close(out, out_plain)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_equals_unpacked(causal, dtype, device):
    require_supported(device, dtype, 48)
    qkv = randn(2, 71, 3, 4, 48, dtype=dtype, device=device)
    out_packed = flash_attn_qkvpacked_func(qkv, causal=causal)
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal)
    torch.testing.assert_close(out_packed, out)
    truth, naive = reference_pair(_ref_fn(causal=causal), (q, k, v))
    assert_close_fa(out_packed, truth[0], naive[0], 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nheads_k", [4, 1])
def test_kvpacked_equals_unpacked(nheads_k, dtype, device):
    require_supported(device, dtype, 40)
    q = randn(2, 29, 4, 40, dtype=dtype, device=device)
    kv = randn(2, 53, 2, nheads_k, 40, dtype=dtype, device=device)
    out_packed = flash_attn_kvpacked_func(q, kv, causal=True, window_size=(9, -1))
    k, v = kv.unbind(2)
    out = flash_attn_func(q, k.contiguous(), v.contiguous(), causal=True, window_size=(9, -1))
    torch.testing.assert_close(out_packed, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_noncontiguous_inputs(dtype, device):
    require_supported(device, dtype, 64)
    qkv = randn(2, 45, 3, 4, 64, dtype=dtype, device=device)
    q_t = randn(2, 4, 45, 64, dtype=dtype, device=device).transpose(1, 2)
    kv_wide = randn(2, 45, 8, 64, dtype=dtype, device=device)
    cases = [
        (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]),
        (q_t, qkv[:, :, 1], kv_wide[:, :, ::2]),
        (qkv[:, :, 0], kv_wide[:, :, 1::4], kv_wide[:, :, :2]),
    ]
    for q, k, v in cases:
        assert not q.is_contiguous() or not k.is_contiguous()
        out = flash_attn_func(q, k, v, causal=True)
        out_contig = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
        torch.testing.assert_close(out, out_contig)
        truth, naive = reference_pair(_ref_fn(causal=True), (q, k, v))
        assert_close_fa(out, truth[0], naive[0], 2)


def test_default_scale_and_explicit_scale_agree(device):
    q, k, v = make_qkv(1, 19, 23, 2, 2, 50, torch.float64, device)
    out_default = flash_attn_func(q, k, v)
    out_explicit = flash_attn_func(q, k, v, softmax_scale=50 ** -0.5)
    torch.testing.assert_close(out_default, out_explicit, rtol=1e-12, atol=1e-12)


def test_inputs_not_modified(device):
    q, k, v = make_qkv(2, 31, 31, 2, 1, 16, torch.float32, device)
    copies = [t.clone() for t in (q, k, v)]
    flash_attn_func(q, k, v, causal=True, softcap=3.0)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)
