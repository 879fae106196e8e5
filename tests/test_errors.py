# Input validation tests: every documented bad input (rank, dtype, device, strides, head counts, head
# dim, cu_seqlens, window_size, dropout_p, alibi_slopes, SDPA masks, empty tensors) raises RuntimeError
# or ValueError whose message names the offending argument.
import pytest
import torch

import flash_attn
from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from flash_attn.reference import cu_from_seqlens

ERRORS = (RuntimeError, ValueError)


def _qkv(batch=2, sq=8, sk=8, h=2, hk=2, d=16, dtype=torch.float32):
    return (
        torch.randn(batch, sq, h, d, dtype=dtype),
        torch.randn(batch, sk, hk, d, dtype=dtype),
        torch.randn(batch, sk, hk, d, dtype=dtype),
    )


def _varlen(seqlens_q=(3, 5), seqlens_k=(4, 6), h=2, d=16):
    q = torch.randn(sum(seqlens_q), h, d)
    k = torch.randn(sum(seqlens_k), h, d)
    v = torch.randn(sum(seqlens_k), h, d)
    return q, k, v, cu_from_seqlens(seqlens_q), cu_from_seqlens(seqlens_k)


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("rank", [3, 5])
def test_wrong_rank(which, rank):
    tensors = list(_qkv())
    t = tensors[which]
    tensors[which] = t[0] if rank == 3 else t.unsqueeze(0)
    with pytest.raises(ERRORS, match=r"(?i)\b[qkv]\b|rank|dim|shape"):
        flash_attn_func(*tensors)


def test_varlen_wrong_rank():
    q, k, v, cu_q, cu_k = _varlen()
    with pytest.raises(ERRORS, match=r"(?i)\bq\b|rank|dim|shape"):
        flash_attn_varlen_func(q.unsqueeze(0), k, v, cu_q, cu_k, 5, 6)


@pytest.mark.parametrize("which", [1, 2])
def test_mismatched_dtypes(which):
    tensors = list(_qkv())
    tensors[which] = tensors[which].to(torch.float16)
    with pytest.raises(ERRORS, match=r"(?i)dtype"):
        flash_attn_func(*tensors)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mismatched_devices():
    q, k, v = _qkv()
    with pytest.raises(ERRORS, match=r"(?i)device"):
        flash_attn_func(q, k.cuda(), v)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_unsupported_dtype(dtype):
    q, k, v = (torch.ones(1, 4, 2, 8, dtype=dtype) for _ in range(3))
    with pytest.raises(ERRORS, match=r"(?i)dtype|\bq\b"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_last_dim_stride(which):
    tensors = list(_qkv(d=8, sk=8, sq=8))
    t = tensors[which]
    tensors[which] = t.transpose(1, 3).contiguous().transpose(1, 3)
    assert tensors[which].stride(-1) != 1
    with pytest.raises(ERRORS, match=r"(?i)stride|contiguous"):
        flash_attn_func(*tensors)


def test_varlen_last_dim_stride():
    q, k, v, cu_q, cu_k = _varlen()
    q = q.transpose(0, 2).contiguous().transpose(0, 2)
    with pytest.raises(ERRORS, match=r"(?i)stride|contiguous"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6)


def test_nheads_not_divisible():
    q, k, v = _qkv(h=3, hk=2)
    with pytest.raises(ERRORS, match=r"(?i)head"):
        flash_attn_func(q, k, v)


def test_nheads_k_greater_than_nheads():
    q, k, v = _qkv(h=2, hk=4)
    with pytest.raises(ERRORS, match=r"(?i)head"):
        flash_attn_func(q, k, v)


def test_headdim_too_large():
    q, k, v = _qkv(d=257)
    with pytest.raises(ERRORS, match=r"(?i)head ?dim|head_dim|headdim|256"):
        flash_attn_func(q, k, v)


def test_headdim_mismatch():
    q, k, v = _qkv(d=16)
    with pytest.raises(ERRORS, match=r"(?i)\b[qkv]\b|head ?dim|head_dim|shape"):
        flash_attn_func(q, k[..., :8].contiguous(), v[..., :8].contiguous())


def test_batch_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ERRORS, match=r"(?i)\b[qkv]\b|batch|shape"):
        flash_attn_func(q, k[:1], v[:1])


def test_k_v_seqlen_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ERRORS, match=r"(?i)\b[kv]\b|shape|seqlen"):
        flash_attn_func(q, k, v[:, :5])


def test_cu_seqlens_int64():
    q, k, v, cu_q, cu_k = _varlen()
    with pytest.raises(ERRORS, match=r"(?i)cu_seqlens"):
        flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, 5, 6)
    with pytest.raises(ERRORS, match=r"(?i)cu_seqlens"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k.long(), 5, 6)


def test_cu_seqlens_wrong_length():
    q, k, v, cu_q, _ = _varlen()
    cu_k = cu_from_seqlens([4, 3, 3])
    with pytest.raises(ERRORS, match=r"(?i)cu_seqlens"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 4)


def test_cu_seqlens_not_1d():
    q, k, v, cu_q, cu_k = _varlen()
    with pytest.raises(ERRORS, match=r"(?i)cu_seqlens"):
        flash_attn_varlen_func(q, k, v, cu_q.view(1, -1), cu_k, 5, 6)


def test_cu_seqlens_decreasing():
    q, k, v, _, cu_k = _varlen()
    cu_q = torch.tensor([0, 6, 4, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 6, 10], dtype=torch.int32)
    with pytest.raises(ERRORS, match=r"(?i)cu_seqlens"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 4)


@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
def test_max_seqlen_beyond_32_bits(which):
    # The kernels' grids take a sequence's length as 32 bits; a larger bound would wrap the grid.
    q, k, v, cu_q, cu_k = _varlen()
    bounds = {"max_seqlen_q": 5, "max_seqlen_k": 6, which: 2**31}
    with pytest.raises(ERRORS, match=which):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, bounds["max_seqlen_q"], bounds["max_seqlen_k"])


def test_max_seqlen_loose_bound_is_correct():
    # A bound far above the longest sequence (a model's context length, say) is valid: the answer is the tight one's.
    q, k, v, cu_q, cu_k = _varlen()
    tight = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True)
    loose = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2**31 - 1, 2**31 - 1, causal=True)
    torch.testing.assert_close(loose, tight, rtol=0, atol=0)


@pytest.mark.parametrize("which", ["q", "k"])
def test_cu_seqlens_beyond_tensor(which):
    q, k, v, cu_q, cu_k = _varlen()
    if which == "q":
        cu_q = torch.tensor([0, 3, 9], dtype=torch.int32)
    else:
        cu_k = torch.tensor([0, 4, 11], dtype=torch.int32)
    with pytest.raises(ERRORS, match=r"(?i)cu_seqlens"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 7)


@pytest.mark.parametrize("window_size", [(-2, -1), (-1, -2), (-5, 3), (3, -7)])
def test_window_size_below_minus_one(window_size):
    q, k, v = _qkv()
    with pytest.raises(ERRORS, match=r"(?i)window"):
        flash_attn_func(q, k, v, window_size=window_size)


def test_varlen_window_size_below_minus_one():
    q, k, v, cu_q, cu_k = _varlen()
    with pytest.raises(ERRORS, match=r"(?i)window"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, window_size=(-3, 0))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_p_out_of_range(p):
    q, k, v = _qkv()
    with pytest.raises(ERRORS, match=r"(?i)dropout"):
        flash_attn_func(q, k, v, dropout_p=p)


@pytest.mark.parametrize("p", [-0.5, 1.0])
def test_varlen_and_sdpa_dropout_p_out_of_range(p):
    q, k, v, cu_q, cu_k = _varlen()
    with pytest.raises(ERRORS, match=r"(?i)dropout"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, dropout_p=p)
    qs, ks, vs = (t.transpose(1, 2) for t in _qkv())
    with pytest.raises(ERRORS, match=r"(?i)dropout"):
        flash_attn.scaled_dot_product_attention(qs, ks, vs, dropout_p=p)


# The backward recomputes P from the fp32 LSE, which cannot resolve it past |softmax_scale| 256 (params.h
# kMaxBackwardSoftmaxScale): it refuses such calls, naming the argument, where it returned NaN gradients on CUDA at 1e30.
@pytest.mark.parametrize("scale", [1e3, 1e30, -1e30])
def test_backward_refuses_scales_past_its_bound(scale, device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (t.to(device).requires_grad_() for t in _qkv(d=64, dtype=dtype))
    out = flash_attn_func(q, k, v, softmax_scale=scale)
    assert torch.isfinite(out).all()
    with pytest.raises(ERRORS, match=r"softmax_scale.*at most 256.*got"):
        out.sum().backward()
    out = flash_attn_func(q, k, v, softmax_scale=256.0)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize(
    "slopes",
    [
        torch.rand(3),
        torch.rand(1),
        torch.rand(3, 2),
        torch.rand(2, 2, 1),
        torch.rand(2, dtype=torch.float64),
        torch.rand(2, dtype=torch.float16),
        torch.rand(2, 2, dtype=torch.bfloat16),
    ],
    ids=["len3", "len1", "batch3", "rank3", "float64", "float16", "bfloat16"],
)
def test_alibi_slopes_bad(slopes):
    q, k, v = _qkv(batch=2, h=2, hk=2)
    with pytest.raises(ERRORS, match=r"(?i)alibi"):
        flash_attn_func(q, k, v, alibi_slopes=slopes)


def test_varlen_alibi_slopes_bad_batch():
    q, k, v, cu_q, cu_k = _varlen()
    with pytest.raises(ERRORS, match=r"(?i)alibi"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, alibi_slopes=torch.rand(3, 2))


@pytest.mark.parametrize("mask_shape", [(8, 7), (3, 1, 8, 8), (1, 3, 8, 8), (2, 2, 8, 8, 1)])
def test_sdpa_mask_not_broadcastable(mask_shape):
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    with pytest.raises(ERRORS, match=r"(?i)mask"):
        flash_attn.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(mask_shape))


def test_sdpa_mask_with_is_causal():
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    mask = torch.ones(8, 8, dtype=torch.bool)
    with pytest.raises(ERRORS, match=r"(?i)mask|causal"):
        flash_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)


def test_sdpa_wrong_rank():
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    with pytest.raises(ERRORS, match=r"(?i)query|key|value|\b[qkv]\b|rank|dim"):
        flash_attn.scaled_dot_product_attention(q[0, 0], k[0, 0], v[0, 0])


def test_sdpa_mismatched_dtypes():
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    with pytest.raises(ERRORS, match=r"(?i)dtype"):
        flash_attn.scaled_dot_product_attention(q, k.double(), v)


def test_zero_head_dim_rejected():
    """Empty batches, sequences and heads are valid (tests/test_empty_inputs.py); a head dim of 0 is not."""
    q, k, v = _qkv(d=0)
    pattern = r"(?i)head ?dim|head_dim"
    with pytest.raises(ERRORS, match=pattern):
        flash_attn_func(q, k, v)
    with pytest.raises(ERRORS, match=pattern):
        flash_attn.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def test_qkvpacked_wrong_shape():
    qkv = torch.randn(2, 8, 2, 2, 16)
    with pytest.raises(ERRORS, match=r"(?i)qkv|shape|3"):
        flash_attn_qkvpacked_func(qkv)


def test_kvpacked_wrong_shape():
    q = torch.randn(2, 8, 2, 16)
    kv = torch.randn(2, 8, 3, 2, 16)
    with pytest.raises(ERRORS, match=r"(?i)kv|shape|2"):
        flash_attn_kvpacked_func(q, kv)


def test_kvcache_index_values_out_of_range():
    q = torch.randn(3, 1, 2, 16)
    k_cache, v_cache = torch.randn(3, 8, 2, 16), torch.randn(3, 8, 2, 16)
    k_new = torch.randn(3, 1, 2, 16)
    with pytest.raises(RuntimeError, match=r"cache_seqlens\[2\]=8 is outside \[0, 7\]"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=torch.tensor([0, 7, 8]))
    with pytest.raises(RuntimeError, match=r"cache_batch_idx\[0\]=-1 is outside \[0, 2\]"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_batch_idx=torch.tensor([-1, 0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"9 new rows .* do not fit a cache of 8 rows"):
        flash_attn_with_kvcache(q, k_cache, v_cache, torch.randn(3, 9, 2, 16), torch.randn(3, 9, 2, 16),
                                cache_seqlens=0)


def test_varlen_cu_seqlens_values_name_the_argument():
    q, k, v, cu_q, cu_k = _varlen()
    with pytest.raises(RuntimeError, match=r"cu_seqlens_k must be non-decreasing"):
        flash_attn_varlen_func(q, k, v, cu_q, torch.tensor([0, 6, 4], dtype=torch.int32), 5, 6)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_q\[0\] must be 0; got -1"):
        flash_attn_varlen_func(q, k, v, torch.tensor([-1, 3, 8], dtype=torch.int32), cu_k, 5, 6)
