# Empty inputs behave as in torch: batch 0, seqlen_q 0, seqlen_k 0, no heads, a varlen total of 0 and a varlen
# batch of 0 give outputs, softmax_lse, probabilities and gradients of the right (possibly empty) shapes, through
# every entry point (dense, packed, varlen, SDPA-compatible, kvcache) on CPU and CUDA. Rows that see no key are 0
# with lse +inf, and on CUDA no kernel runs at all.
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import flash_attn
from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flash_attn.reference import cu_from_seqlens
from helpers import randn, require_supported

HEAD_DIM = 64
DENSE_SHAPES = {  # (batch, seqlen_q, seqlen_k, nheads, nheads_k)
    "batch0": (0, 7, 9, 4, 2),
    "seqlen_q0": (2, 0, 9, 4, 2),
    "seqlen_k0": (2, 7, 0, 4, 2),
    "heads0": (2, 7, 9, 0, 0),
}


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _no_kernel_launch(device, fn):
    """Runs fn; on CUDA asserts that it launched no kernel other than torch's fills (zeros / full)."""
    if device != "cuda":
        return fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    ours = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "flash" in e.name.lower()]
    assert not ours, f"flash_attn kernels ran on an empty input: {ours}"
    return result


def _torch_sdpa(query, key, value, **kwargs):
    """torch's own result for the same empty call, NaN (0/0 rows) as 0; None for a batch or head count of 0, where
    torch 2.11's SDPA is no reference (it returned None for batch 0 and died of SIGFPE for 0 heads with enable_gqa)."""
    if query.shape[0] == 0 or query.shape[1] == 0:
        return None
    result = F.scaled_dot_product_attention(query, key, value, enable_gqa=True, **kwargs)
    return None if result is None else result.nan_to_num(0.0)


def _check_no_key_rows(out, lse, q_shape):
    assert out.shape == q_shape
    assert out.numel() == 0 or out.abs().max() == 0
    assert lse.dtype == torch.float32
    assert lse.numel() == 0 or torch.isinf(lse).all() and (lse > 0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", list(DENSE_SHAPES), ids=list(DENSE_SHAPES))
def test_flash_attn_func_empty(shape, causal, device):
    dtype = _dtype(device)
    require_supported(device, dtype, HEAD_DIM)
    b, sq, sk, h, hk = DENSE_SHAPES[shape]
    q = randn(b, sq, h, HEAD_DIM, dtype=dtype, device=device, requires_grad=True)
    k = randn(b, sk, hk, HEAD_DIM, dtype=dtype, device=device, requires_grad=True)
    v = randn(b, sk, hk, HEAD_DIM, dtype=dtype, device=device, requires_grad=True)

    def run():
        out, lse, probs = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return out, lse, probs, grads

    out, lse, probs, grads = _no_kernel_launch(device, run)
    _check_no_key_rows(out, lse, q.shape)
    assert lse.shape == (b, h, sq)
    assert probs.shape == (b, h, sq, sk) and (probs.numel() == 0 or probs.abs().max() == 0)
    for grad, t in zip(grads, (q, k, v)):
        assert grad.shape == t.shape and (grad.numel() == 0 or grad.abs().max() == 0)
    # torch SDPA on the same inputs (its layout); no causal there: with no key or no query both agree on 0.
    expected = _torch_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    if expected is not None:
        torch.testing.assert_close(out, expected.transpose(1, 2))


@pytest.mark.parametrize("shape", list(DENSE_SHAPES), ids=list(DENSE_SHAPES))
def test_packed_and_sdpa_empty(shape, device):
    dtype = _dtype(device)
    require_supported(device, dtype, HEAD_DIM)
    b, sq, sk, h, hk = DENSE_SHAPES[shape]
    q = randn(b, sq, h, HEAD_DIM, dtype=dtype, device=device)
    kv = randn(b, sk, 2, hk, HEAD_DIM, dtype=dtype, device=device)
    out = _no_kernel_launch(device, lambda: flash_attn_kvpacked_func(q, kv, dropout_p=0.1))
    _check_no_key_rows(out, torch.empty(0), q.shape)
    if sq == 0 or b == 0 or h == 0:  # packed q, k, v share one length: empty only where q is
        qkv = randn(b, sq, 3, h, HEAD_DIM, dtype=dtype, device=device)
        out = _no_kernel_launch(device, lambda: flash_attn_qkvpacked_func(qkv, causal=True))
        assert out.shape == (b, sq, h, HEAD_DIM)
    query = q.transpose(1, 2)
    key, value = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}):
        ours = _no_kernel_launch(device, lambda: flash_attn.scaled_dot_product_attention(
            query, key, value, enable_gqa=True, **kwargs))
        assert ours.shape == query.shape and (ours.numel() == 0 or ours.abs().max() == 0)
        theirs = _torch_sdpa(query, key, value, **kwargs)
        if theirs is not None:
            torch.testing.assert_close(ours, theirs)


VARLEN_CASES = {  # (seqlens_q, seqlens_k, extra rows of q, extra rows of k)
    "total_q0": ([0, 0, 0], [3, 5, 2], 0, 0),
    "total_k0": ([4, 1, 6], [0, 0, 0], 0, 0),
    "both0": ([0, 0], [0, 0], 0, 0),
    "batch0_rows_unowned": ([], [], 5, 3),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES), ids=list(VARLEN_CASES))
def test_varlen_empty(case, device):
    dtype = _dtype(device)
    require_supported(device, dtype, HEAD_DIM)
    seqlens_q, seqlens_k, extra_q, extra_k = VARLEN_CASES[case]
    h, hk = 4, 2
    cu_q, cu_k = cu_from_seqlens(seqlens_q, device), cu_from_seqlens(seqlens_k, device)
    total_q, total_k = sum(seqlens_q) + extra_q, sum(seqlens_k) + extra_k
    q = randn(total_q, h, HEAD_DIM, dtype=dtype, device=device, requires_grad=True)
    k = randn(total_k, hk, HEAD_DIM, dtype=dtype, device=device, requires_grad=True)
    v = randn(total_k, hk, HEAD_DIM, dtype=dtype, device=device, requires_grad=True)
    max_q, max_k = max(seqlens_q, default=0), max(seqlens_k, default=0)

    def run():
        out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                 return_attn_probs=True)
        return out, lse, probs, torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    out, lse, probs, grads = _no_kernel_launch(device, run)
    _check_no_key_rows(out, lse, q.shape)
    assert lse.shape == (h, total_q)
    assert probs.shape == (len(seqlens_q), h, max_q, max_k)
    for grad, t in zip(grads, (q, k, v)):
        assert grad.shape == t.shape and (grad.numel() == 0 or grad.abs().max() == 0)
    if seqlens_q == seqlens_k:
        qkv = randn(total_q, 3, h, HEAD_DIM, dtype=dtype, device=device)
        out = _no_kernel_launch(device, lambda: flash_attn_varlen_qkvpacked_func(qkv, cu_q, max_q))
        assert out.shape == (total_q, h, HEAD_DIM) and (out.numel() == 0 or out.abs().max() == 0)
    kv = torch.stack([k.detach(), v.detach()], dim=1)
    out = _no_kernel_launch(device, lambda: flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max_q, max_k))
    assert out.shape == q.shape and (out.numel() == 0 or out.abs().max() == 0)


KVCACHE_SHAPES = {  # (batch, seqlen_q, cache rows, new rows)
    "batch0": (0, 1, 16, 1),
    "seqlen_q0": (2, 0, 16, 0),
    "cache_rows0": (2, 3, 0, 0),
}


@pytest.mark.parametrize("shape", list(KVCACHE_SHAPES), ids=list(KVCACHE_SHAPES))
def test_kvcache_empty(shape, device):
    dtype = _dtype(device)
    require_supported(device, dtype, HEAD_DIM)
    b, sq, rows, new = KVCACHE_SHAPES[shape]
    h, hk = 4, 2
    q = randn(b, sq, h, HEAD_DIM, dtype=dtype, device=device)
    k_cache = randn(b, rows, hk, HEAD_DIM, dtype=dtype, device=device)
    v_cache = randn(b, rows, hk, HEAD_DIM, dtype=dtype, device=device)
    k_new = randn(b, new, hk, HEAD_DIM, dtype=dtype, device=device) if new else None
    v_new = randn(b, new, hk, HEAD_DIM, dtype=dtype, device=device) if new else None
    lengths = torch.zeros(b, dtype=torch.int32, device=device) if new else None
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True,
                                       return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (b, h, sq)
    if rows == 0:
        _check_no_key_rows(out, lse, q.shape)
