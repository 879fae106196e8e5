# torch.autograd.gradcheck in float64 on tiny shapes: flash_attn_func with causal, window, softcap,
# ALiBi, GQA and dropout (reseeded per call), the packed and varlen entry points, and
# flash_attn.scaled_dot_product_attention with a float mask that requires grad.
import pytest
import torch

import flash_attn
from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
)
from flash_attn.reference import cu_from_seqlens
from helpers import make_qkv, randn, require_supported

F64 = torch.float64


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(causal=True),
        dict(window_size=(1, 0)),
        dict(window_size=(2, 1)),
        dict(softcap=2.0),
        dict(alibi="H", causal=True),
        dict(alibi="BH"),
        dict(softmax_scale=0.9, softcap=1.5, window_size=(3, -1)),
    ],
    ids=["plain", "causal", "window_1_0", "window_2_1", "softcap", "alibi_causal", "alibi_batch", "combo"],
)
@pytest.mark.parametrize("shape", [(1, 3, 4, 2, 2, 3), (2, 5, 3, 4, 2, 4), (1, 4, 4, 2, 1, 5)])
def test_gradcheck_dense(shape, kwargs, device):
    batch, sq, sk, h, hk, d = shape
    q, k, v = make_qkv(batch, sq, sk, h, hk, d, F64, device, requires_grad=True)
    kwargs = dict(kwargs)
    alibi = kwargs.pop("alibi", None)
    if alibi:
        kwargs["alibi_slopes"] = torch.rand((h,) if alibi == "H" else (batch, h), device=device) + 0.1
    assert torch.autograd.gradcheck(lambda a, b, c: flash_attn_func(a, b, c, **kwargs), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_dropout(causal, device):
    q, k, v = make_qkv(1, 4, 5, 2, 1, 3, F64, device, requires_grad=True)

    def fn(a, b, c):
        torch.manual_seed(7)
        return flash_attn_func(a, b, c, dropout_p=0.3, causal=causal)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_packed(device):
    require_supported(device, F64, 4)
    qkv = randn(1, 4, 3, 2, 4, dtype=F64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: flash_attn_qkvpacked_func(t, causal=True), (qkv,))
    q = randn(2, 3, 2, 4, dtype=F64, device=device, requires_grad=True)
    kv = randn(2, 5, 2, 1, 4, dtype=F64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: flash_attn_kvpacked_func(a, b, softcap=3.0), (q, kv))


@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True), dict(window_size=(1, 1), softcap=2.0)])
def test_gradcheck_varlen(kwargs, device):
    require_supported(device, F64, 3)
    seqlens_q, seqlens_k = [2, 0, 3], [3, 2, 1]
    cu_q, cu_k = cu_from_seqlens(seqlens_q, device), cu_from_seqlens(seqlens_k, device)
    q = randn(5, 2, 3, dtype=F64, device=device, requires_grad=True)
    k = randn(6, 1, 3, dtype=F64, device=device, requires_grad=True)
    v = randn(6, 1, 3, dtype=F64, device=device, requires_grad=True)

    def fn(a, b, c):
        return flash_attn_varlen_func(a, b, c, cu_q, cu_k, 3, 3, **kwargs)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("mask_shape", [(3, 4), (2, 1, 3, 4), (1, 2, 1, 4)])
def test_gradcheck_sdpa_float_mask(mask_shape, device):
    require_supported(device, F64, 3)
    q = randn(2, 2, 3, 3, dtype=F64, device=device, requires_grad=True)
    k = randn(2, 2, 4, 3, dtype=F64, device=device, requires_grad=True)
    v = randn(2, 2, 4, 3, dtype=F64, device=device, requires_grad=True)
    mask = randn(*mask_shape, dtype=F64, device=device, requires_grad=True)

    def fn(a, b, c, m):
        return flash_attn.scaled_dot_product_attention(a, b, c, attn_mask=m)

    assert torch.autograd.gradcheck(fn, (q, k, v, mask))


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck_sdpa_gqa(is_causal, device):
    require_supported(device, F64, 4)
    q = randn(1, 4, 3, 4, dtype=F64, device=device, requires_grad=True)
    k = randn(1, 2, 5, 4, dtype=F64, device=device, requires_grad=True)
    v = randn(1, 2, 5, 4, dtype=F64, device=device, requires_grad=True)

    def fn(a, b, c):
        return flash_attn.scaled_dot_product_attention(a, b, c, is_causal=is_causal, scale=0.7, enable_gqa=True)

    assert torch.autograd.gradcheck(fn, (q, k, v))
