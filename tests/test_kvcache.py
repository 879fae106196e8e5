# flash_attn_with_kvcache (Dao-AILab's decoding API) against flash_attn.reference: per-sequence cache
# lengths, in-place append of new keys/values, causal / window alignment to each sequence's end, GQA, ALiBi,
# softcap, cache_batch_idx, return_softmax_lse; unsupported options raise NotImplementedError.
import pytest
import torch

import flash_attn
from flash_attn import flash_attn_with_kvcache
from flash_attn.reference import attention_ref
from helpers import assert_close_fa, randn

# A forward-only API (no autograd in Dao's either), so CUDA runs wherever a forward kernel is built.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def require_supported(device, dtype, head_dim):
    if not flash_attn.is_supported(device, dtype, head_dim, backward=False):
        pytest.skip(f"no {device} forward kernel for {dtype} head_dim={head_dim}")


def _reference(q, k_cache, v_cache, lengths, entries, compute_dtype, **kwargs):
    """Each sequence on its own: its first lengths[b] cache rows, queries aligned to the end (bottom-right)."""
    outs, lses = [], []
    for b, (length, entry) in enumerate(zip(lengths, entries)):
        slopes = kwargs.get("alibi_slopes")
        kw = dict(kwargs)
        if slopes is not None and slopes.dim() == 2:
            kw["alibi_slopes"] = slopes[b]
        out, lse = attention_ref(q[b:b + 1], k_cache[entry:entry + 1, :length], v_cache[entry:entry + 1, :length],
                                 compute_dtype=compute_dtype, **kw)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _check(out, lse, q, k_cache, v_cache, lengths, entries, **kwargs):
    args = (k_cache, v_cache)
    truth = _reference(q.double(), *(t.double() for t in args), lengths, entries, torch.float64, **kwargs)
    naive = _reference(q, *args, lengths, entries, q.dtype, **kwargs)
    assert_close_fa(out, truth[0], naive[0], 2)
    finite = torch.isfinite(truth[1])
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), truth[1][finite], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seqlen_q", [1, 5])
@pytest.mark.parametrize("kwargs", [dict(), dict(causal=True), dict(causal=True, window_size=(3, -1)),
                                    dict(softcap=4.0, causal=True), dict(alibi="BH", causal=True)])
@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_append(kwargs, seqlen_q, dtype, device):
    require_supported(device, dtype, 64)
    batch, cache_rows, nheads, nheads_k = 3, 40, 4, 2
    kwargs = dict(kwargs)
    if kwargs.pop("alibi", None):
        kwargs["alibi_slopes"] = torch.rand(batch, nheads, device=device) * 0.5 + 0.05
    q = randn(batch, seqlen_q, nheads, 64, dtype=dtype, device=device)
    k_cache = randn(batch, cache_rows, nheads_k, 64, dtype=dtype, device=device)
    v_cache = randn(batch, cache_rows, nheads_k, 64, dtype=dtype, device=device)
    k_new = randn(batch, seqlen_q, nheads_k, 64, dtype=dtype, device=device)
    v_new = randn(batch, seqlen_q, nheads_k, 64, dtype=dtype, device=device)
    old = [7, 0, 30]
    cache_seqlens = torch.tensor(old, dtype=torch.int32, device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, start in enumerate(old):
        expected_k[b, start:start + seqlen_q] = k_new[b]
        expected_v[b, start:start + seqlen_q] = v_new[b]
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                       return_softmax_lse=True, **kwargs)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    lengths = [n + seqlen_q for n in old]
    _check(out, lse, q, k_cache, v_cache, lengths, range(batch), **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_without_append_and_batch_idx(device):
    require_supported(device, torch.bfloat16, 64)
    q = randn(2, 3, 2, 64, dtype=torch.bfloat16, device=device)
    k_cache = randn(4, 20, 1, 64, dtype=torch.bfloat16, device=device)
    v_cache = randn(4, 20, 1, 64, dtype=torch.bfloat16, device=device)
    idx = torch.tensor([3, 1], dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=11, cache_batch_idx=idx, causal=True,
                                       return_softmax_lse=True)
    _check(out, lse, q, k_cache, v_cache, [11, 11], [3, 1], causal=True)
    k_cache, v_cache = k_cache[:2], v_cache[:2]
    out_full = flash_attn_with_kvcache(q, k_cache, v_cache)  # no cache_seqlens: every cache row
    _check(out_full, flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True)[1], q, k_cache,
           v_cache, [20, 20], [0, 1])
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flash_attn_with_kvcache(q, k_cache[:1], v_cache[:1])


@pytest.mark.parametrize("name", ["rotary_cos", "rotary_sin", "cache_leftpad", "block_table"])
def test_kvcache_unsupported_options_raise(name):
    q, k_cache, v_cache = randn(1, 1, 2, 16), randn(1, 8, 2, 16), randn(1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match=name):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, **{name: torch.zeros(1)})


def test_kvcache_append_needs_cache_seqlens():
    q, k_cache, v_cache = randn(1, 1, 2, 16), randn(1, 8, 2, 16), randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, k_cache, v_cache, randn(1, 1, 2, 16), randn(1, 1, 2, 16))
