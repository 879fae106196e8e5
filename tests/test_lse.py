# softmax_lse tests: the log-sum-exp returned with return_attn_probs=True equals torch.logsumexp of
# the fp64 reference scores (scale, softcap, mask, ALiBi), is float32 with the documented layouts
# (B, H, Sq) dense and (H, total_q) varlen (float64 allowed for float64 inputs), and is +inf exactly
# on rows without visible keys.
import math

import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn.reference import alibi_bias, visible_mask
from helpers import DTYPES, lse_dtype_ok, make_qkv, varlen_tensors

LSE_RTOL = 1e-5
LSE_ATOL = 1e-4


def _scores(q, k, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """fp64 masked scores (B, H, Sq, Sk) written out independently of attention_ref."""
    batch, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    kk = k.double().repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, batch, sq, sk, dtype=torch.float64)
    vis = visible_mask(sq, sk, window_size, causal, device=q.device)
    return s.masked_fill(~vis, float("-inf")), vis


def _check_lse(lse, scores, vis, dtype):
    expected = torch.logsumexp(scores, dim=-1)
    empty = ~vis.any(-1).expand_as(expected)
    assert lse_dtype_ok(lse.dtype, dtype)
    assert torch.isinf(lse[empty]).all() and (lse[empty] > 0).all()
    assert torch.isfinite(lse[~empty]).all()
    torch.testing.assert_close(lse[~empty].double(), expected[~empty], rtol=LSE_RTOL, atol=LSE_ATOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(causal=True),
        dict(window_size=(7, 2)),
        dict(softcap=3.0),
        dict(softmax_scale=0.7),
        dict(alibi="H", causal=True),
        dict(alibi="BH", window_size=(-1, 4)),
    ],
    ids=["plain", "causal", "window", "softcap", "scale", "alibi_causal", "alibi_batch_window"],
)
@pytest.mark.parametrize("shape", [(2, 33, 70, 4, 2, 40), (1, 96, 25, 2, 1, 128), (2, 1, 255, 2, 2, 64)])
def test_lse_dense(shape, kwargs, dtype, device):
    batch, sq, sk, h, hk, d = shape
    q, k, v = make_qkv(batch, sq, sk, h, hk, d, dtype, device)
    kwargs = dict(kwargs)
    alibi = kwargs.pop("alibi", None)
    if alibi:
        kwargs["alibi_slopes"] = torch.rand((h,) if alibi == "H" else (batch, h), device=device) + 0.05
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    assert lse.shape == (batch, h, sq)
    scores, vis = _scores(q, k, **kwargs)
    _check_lse(lse, scores, vis, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_lse_varlen(dtype, device):
    seqlens_q, seqlens_k, h = [12, 0, 40, 5], [30, 3, 17, 0], 4
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, h, 2, 32, dtype, device)
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True, softcap=5.0, return_attn_probs=True
    )
    assert lse.shape == (h, sum(seqlens_q))
    start_q = start_k = 0
    for sq, sk in zip(seqlens_q, seqlens_k):
        qb = q[start_q:start_q + sq].unsqueeze(0)
        kb = k[start_k:start_k + sk].unsqueeze(0)
        scores, vis = _scores(qb, kb, causal=True, softcap=5.0)
        if sq > 0:
            _check_lse(lse[:, start_q:start_q + sq].unsqueeze(0), scores, vis, dtype)
        start_q += sq
        start_k += sk


def test_lse_large_scores_stable(device):
    q, k, v = make_qkv(1, 20, 30, 2, 2, 16, torch.float32, device)
    q = q * 30
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.isfinite(out).all()
    scores, vis = _scores(q, k)
    _check_lse(lse, scores, vis, torch.float32)
