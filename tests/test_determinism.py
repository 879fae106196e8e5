# Determinism tests: with deterministic=True two forward + backward runs on the same inputs give
# bitwise identical outputs and gradients (dense MHA/GQA, varlen, packed, dropout with a fixed seed);
# forward passes are bitwise repeatable in any case.
import pytest
import torch

import flash_attn
from flash_attn import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from helpers import make_qkv, randn, require_supported, varlen_tensors


def _twice(fn, inputs):
    results = []
    for _ in range(2):
        torch.manual_seed(31)
        out = fn()
        dout = torch.ones_like(out) + torch.arange(out.numel(), device=out.device).view_as(out).to(out.dtype) * 1e-3
        results.append((out, *torch.autograd.grad(out, inputs, dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nheads_k", [4, 1])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_deterministic_dense(dropout_p, nheads_k, dtype, device):
    q, k, v = make_qkv(2, 150, 130, 4, nheads_k, 64, dtype, device, requires_grad=True)
    _twice(lambda: flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True, deterministic=True), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_deterministic_varlen(dtype, device):
    seqlens_q, seqlens_k = [60, 0, 130], [70, 20, 100]
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, 4, 2, 32, dtype, device, requires_grad=True)
    _twice(
        lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 130, 100, window_size=(32, 8), deterministic=True),
        (q, k, v),
    )


def test_deterministic_qkvpacked(device):
    require_supported(device, torch.float32, 32)
    qkv = randn(2, 100, 3, 2, 32, device=device, requires_grad=True)
    _twice(lambda: flash_attn_qkvpacked_func(qkv, softcap=5.0, deterministic=True), (qkv,))


def test_sdpa_repeatable(device):
    require_supported(device, torch.float32, 32)
    q = randn(2, 4, 90, 32, device=device, requires_grad=True)
    k = randn(2, 2, 70, 32, device=device, requires_grad=True)
    v = randn(2, 2, 70, 32, device=device, requires_grad=True)
    _twice(lambda: flash_attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), (q, k, v))


def test_forward_repeatable_without_deterministic_flag(device):
    q, k, v = make_qkv(2, 200, 200, 4, 2, 64, torch.float32, device)
    a = flash_attn_func(q, k, v, causal=True)
    b = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(a, b)
