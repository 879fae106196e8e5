# Backward-pass tests of the dense entry points: gradients of q, k, v (and packed qkv / kv) against
# the fp64 reference under the tolerance rule (3x naive + floor) across shapes, dtypes, causal,
# window, softcap, ALiBi, GQA/MQA, head dims, rows without keys and non-contiguous inputs.
import functools

import pytest
import torch

from cases import FEATURE_DTYPES, FEATURE_SHAPES, FEATURES, HEADDIMS, SHAPES, feature_kwargs
from flash_attn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flash_attn.reference import attention_ref
from helpers import DTYPES, assert_no_nan, check_output_and_grads, make_qkv, randn, reference_pair, require_supported


def _run(q, k, v, dout, **kwargs):
    out = flash_attn_func(q, k, v, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_no_nan(out, *grads)
    truth, naive = reference_pair(functools.partial(attention_ref, **kwargs), (q, k, v), dout)
    check_output_and_grads(out, grads, truth, naive)
    return out, grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_backward_shapes(shape, dtype, causal, device):
    batch, sq, sk, h, hk, d = shape
    q, k, v = make_qkv(batch, sq, sk, h, hk, d, dtype, device, requires_grad=True)
    dout = randn(batch, sq, h, d, dtype=dtype, device=device)
    _run(q, k, v, dout, causal=causal)


@pytest.mark.parametrize("dtype", FEATURE_DTYPES)
@pytest.mark.parametrize("shape", FEATURE_SHAPES)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_backward_features(feature, shape, dtype, device):
    batch, sq, sk, h, hk, d = shape
    q, k, v = make_qkv(batch, sq, sk, h, hk, d, dtype, device, requires_grad=True)
    dout = randn(batch, sq, h, d, dtype=dtype, device=device)
    _run(q, k, v, dout, **feature_kwargs(feature, batch, h, device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("headdim", HEADDIMS)
def test_backward_headdims(headdim, dtype, device):
    q, k, v = make_qkv(2, 57, 40, 4, 2, headdim, dtype, device, requires_grad=True)
    dout = randn(2, 57, 4, headdim, dtype=dtype, device=device)
    _run(q, k, v, dout, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_backward_rows_without_keys(dtype, device):
    sq, sk = 48, 16
    q, k, v = make_qkv(1, sq, sk, 2, 1, 32, dtype, device, requires_grad=True)
    dout = randn(1, sq, 2, 32, dtype=dtype, device=device)
    out, (dq, dk, dv) = _run(q, k, v, dout, causal=True)
    empty = sq - sk
    assert torch.equal(dq[:, :empty], torch.zeros_like(dq[:, :empty]))
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_backward_keys_never_visible(device):
    q, k, v = make_qkv(1, 10, 30, 2, 2, 16, torch.float32, device, requires_grad=True)
    out = flash_attn_func(q, k, v, window_size=(0, 0))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dk[:, :20], torch.zeros_like(dk[:, :20]))
    assert torch.equal(dv[:, :20], torch.zeros_like(dv[:, :20]))
    assert (dv[:, 20:] != 0).any()
    torch.testing.assert_close(out, v[:, 20:].detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_qkvpacked(causal, dtype, device):
    require_supported(device, dtype, 40)
    qkv = randn(2, 63, 3, 2, 40, dtype=dtype, device=device, requires_grad=True)
    dout = randn(2, 63, 2, 40, dtype=dtype, device=device)
    out = flash_attn_qkvpacked_func(qkv, causal=causal, softcap=6.0)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    out_ref = flash_attn_func(q, k, v, causal=causal, softcap=6.0)
    grads = torch.autograd.grad(out_ref, (q, k, v), dout)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(dqkv, torch.stack(grads, dim=2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("nheads_k", [4, 1])
def test_backward_kvpacked(nheads_k, dtype, device):
    require_supported(device, dtype, 24)
    q = randn(2, 33, 4, 24, dtype=dtype, device=device, requires_grad=True)
    kv = randn(2, 45, 2, nheads_k, 24, dtype=dtype, device=device, requires_grad=True)
    dout = randn(2, 33, 4, 24, dtype=dtype, device=device)
    out = flash_attn_kvpacked_func(q, kv, causal=True)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    assert dkv.shape == kv.shape
    q2 = q.detach().clone().requires_grad_()
    k2, v2 = (t.detach().clone().requires_grad_() for t in kv.unbind(2))
    out_ref = flash_attn_func(q2, k2, v2, causal=True)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(out_ref, (q2, k2, v2), dout)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(dq, dq_ref)
    torch.testing.assert_close(dkv, torch.stack((dk_ref, dv_ref), dim=2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_noncontiguous(dtype, device):
    require_supported(device, dtype, 32)
    qkv = randn(2, 39, 3, 4, 32, dtype=dtype, device=device, requires_grad=True)
    q, k, v = qkv.unbind(2)
    dout = randn(2, 4, 39, 32, dtype=dtype, device=device).transpose(1, 2)
    out = flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    truth, naive = reference_pair(functools.partial(attention_ref, causal=True), (q, k, v), dout)
    check_output_and_grads(out, grads, truth, naive)


def test_backward_accumulates_into_leaf_grads(device):
    q, k, v = make_qkv(1, 21, 21, 2, 2, 16, torch.float32, device, requires_grad=True)
    flash_attn_func(q, k, v).sum().backward()
    first = [t.grad.clone() for t in (q, k, v)]
    flash_attn_func(q, k, v).sum().backward()
    for t, g in zip((q, k, v), first):
        torch.testing.assert_close(t.grad, 2 * g)
