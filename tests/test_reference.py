# Self-tests of flash_attn.reference (the spec the other tests trust): Philox4x32-10 known answers and
# a scalar re-derivation of the keep mask, attention_ref against torch's math SDPA and explicit loops,
# bottom-right vs top-left masks, ALiBi, softcap, empty rows, and the varlen reference per sequence.
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn.reference import (
    alibi_bias,
    attention_ref,
    attention_varlen_ref,
    cu_from_seqlens,
    dropout_keep_mask,
    dropout_keep_mask_varlen,
    dropout_threshold,
    philox4x32_10,
    seqlens_from_cu,
    visible_mask,
)

M32 = 0xFFFFFFFF


def _philox_scalar(counter, key):
    """Plain-int Philox4x32-10, written independently of the vectorised reference."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for rnd in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c3 ^ k1) & M32, p0 & M32
        if rnd < 9:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


@pytest.mark.parametrize(
    "counter, key, expected",
    [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
    ids=["zero", "ones", "pi"],
)
def test_philox_known_answers(counter, key, expected):
    words = philox4x32_10(tuple(torch.tensor(c) for c in counter), key)
    assert tuple(int(w) for w in words) == expected
    assert _philox_scalar(counter, key) == expected


def test_philox_vectorised_matches_scalar():
    gen = torch.Generator().manual_seed(3)
    counters = torch.randint(0, 2**32, (4, 64), generator=gen, dtype=torch.int64)
    key = (0x89ABCDEF, 0x01234567)
    words = philox4x32_10(tuple(counters), key)
    for n in range(64):
        expected = _philox_scalar(tuple(int(c[n]) for c in counters), key)
        assert tuple(int(w[n]) for w in words) == expected


def test_dropout_threshold():
    assert dropout_threshold(0.5) == 2**31
    assert dropout_threshold(0.25) == 3 * 2**30
    assert dropout_threshold(0.1) == math.floor(0.9 * 2**32)


@pytest.mark.parametrize("rng", [(0, 0), (2**62 - 3, 2**33 + 5), (0x1234_5678_9ABC_DEF0 >> 2, 17)])
def test_dropout_keep_mask_elementwise(rng):
    batch, h, sq, sk, p = 2, 3, 5, 11, 0.4
    rng_state = torch.tensor(rng, dtype=torch.int64)
    mask = dropout_keep_mask(rng_state, batch, h, sq, sk, p)
    assert mask.shape == (batch, h, sq, sk) and mask.dtype == torch.bool
    seed, offset = rng
    key = (seed & M32, (seed >> 32) & M32)
    thr = math.floor((1 - p) * 2**32)
    for b in range(batch):
        for hh in range(h):
            for i in range(sq):
                for j in range(sk):
                    words = _philox_scalar((j // 4, i, b * h + hh, offset & M32), key)
                    assert bool(mask[b, hh, i, j]) == (words[j % 4] < thr)


def test_dropout_keep_mask_statistics_and_seeds():
    a = dropout_keep_mask(torch.tensor([1, 0]), 2, 4, 64, 64, 0.3)
    b = dropout_keep_mask(torch.tensor([2, 0]), 2, 4, 64, 64, 0.3)
    c = dropout_keep_mask(torch.tensor([1, 1]), 2, 4, 64, 64, 0.3)
    n = a.numel()
    assert abs(a.float().mean().item() - 0.7) < 6 * math.sqrt(0.21 / n)
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, dropout_keep_mask(torch.tensor([1, 0]), 2, 4, 64, 64, 0.3))
    assert dropout_keep_mask(torch.tensor([1, 0]), 1, 1, 3, 3, 0.0).all()


def test_dropout_keep_mask_varlen_is_padded_dense_mask():
    rng_state = torch.tensor([99, 7])
    mask = dropout_keep_mask_varlen(rng_state, [3, 0, 5], [4, 2, 1], 2, 0.5)
    dense = dropout_keep_mask(rng_state, 3, 2, 5, 4, 0.5)
    assert mask.shape == (3, 2, 5, 4)
    assert torch.equal(mask[0, :, :3, :4], dense[0, :, :3, :4])
    assert not mask[0, :, 3:].any() and not mask[1].any() and not mask[2, :, :, 1:].any()
    assert torch.equal(mask[2, :, :5, :1], dense[2, :, :5, :1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nheads_k", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_ref_matches_torch_sdpa_top_left(causal, nheads_k, dtype):
    q = torch.randn(2, 13, 4, 8, dtype=dtype)
    k = torch.randn(2, 21, nheads_k, 8, dtype=dtype)
    v = torch.randn(2, 21, nheads_k, 8, dtype=dtype)
    out, lse = attention_ref(
        q, k, v, causal=causal, bottom_right=False, compute_dtype=dtype, softmax_scale=0.4
    )
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=0.4,
            enable_gqa=nheads_k != 4,
        ).transpose(1, 2)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_attention_ref_matches_torch_sdpa_masks(mask_kind):
    q, k, v = (torch.randn(2, n, 3, 8, dtype=torch.float64) for n in (9, 14, 14))
    if mask_kind == "bool":
        mask = torch.rand(2, 1, 9, 14) < 0.6
        mask[..., 0] = True
    else:
        mask = torch.randn(1, 3, 9, 14, dtype=torch.float64)
    out, _ = attention_ref(q, k, v, attn_bias=mask, bottom_right=False, compute_dtype=torch.float64)
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_bottom_right_causal_equals_explicit_mask():
    sq, sk = 5, 9
    vis = visible_mask(sq, sk, causal=True)
    for i in range(sq):
        for j in range(sk):
            assert bool(vis[i, j]) == (j <= i + sk - sq)
    vis = visible_mask(9, 5, window_size=(2, 1))
    for i in range(9):
        for j in range(5):
            assert bool(vis[i, j]) == (i + 5 - 9 - 2 <= j <= i + 5 - 9 + 1)
    assert torch.equal(visible_mask(4, 6, window_size=(3, 7), causal=True), visible_mask(4, 6, window_size=(3, 0)))


def test_attention_ref_explicit_loop():
    """Softcap, window and ALiBi against a per-element loop of the spec's formula."""
    batch, sq, sk, h, hk, d = 2, 4, 6, 2, 1, 3
    q, k, v = (torch.randn(batch, n, m, d, dtype=torch.float64) for n, m in ((sq, h), (sk, hk), (sk, hk)))
    slopes = torch.tensor([[0.3, 0.7], [0.1, 0.2]])
    scale, softcap, window = 0.8, 1.5, (2, 1)
    out, lse = attention_ref(
        q, k, v, softmax_scale=scale, softcap=softcap, window_size=window, alibi_slopes=slopes,
        compute_dtype=torch.float64,
    )
    for b in range(batch):
        for hh in range(h):
            for i in range(sq):
                scores, values = [], []
                for j in range(sk):
                    if not (i + sk - sq - window[0] <= j <= i + sk - sq + window[1]):
                        continue
                    s = float(q[b, i, hh] @ k[b, j, hh // (h // hk)]) * scale
                    s = softcap * math.tanh(s / softcap) - float(slopes[b, hh]) * abs(i + sk - sq - j)
                    scores.append(s)
                    values.append(v[b, j, hh // (h // hk)])
                if not scores:
                    assert torch.equal(out[b, i, hh], torch.zeros(d, dtype=torch.float64))
                    assert lse[b, hh, i] == math.inf
                    continue
                m = max(scores)
                z = sum(math.exp(s - m) for s in scores)
                expected = sum(math.exp(s - m) / z * vv for s, vv in zip(scores, values))
                torch.testing.assert_close(out[b, i, hh], expected, rtol=1e-12, atol=1e-12)
                assert abs(float(lse[b, hh, i]) - (m + math.log(z))) < 1e-12


def test_attention_ref_empty_rows_and_grads():
    q, k, v = (torch.randn(1, n, 2, 4, dtype=torch.float64, requires_grad=True) for n in (6, 3, 3))
    out, lse = attention_ref(q, k, v, causal=True, compute_dtype=torch.float64)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.isinf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, :3], torch.zeros_like(grads[0][:, :3]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_ref_low_precision_runs(dtype):
    q, k, v = (torch.randn(1, n, 2, 16).to(dtype).requires_grad_() for n in (7, 9, 9))
    slopes = torch.rand(2)
    out, lse = attention_ref(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes, compute_dtype=dtype)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads)
    truth, _ = attention_ref(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes, compute_dtype=torch.float64)
    assert (out.double() - truth).abs().max() < 0.1


def test_alibi_bias_values():
    bias = alibi_bias(torch.tensor([0.5, 1.0]), 1, 2, 4)
    expected_h0 = -0.5 * torch.tensor([[2, 1, 0, 1], [3, 2, 1, 0]], dtype=torch.float32)
    torch.testing.assert_close(bias[0, 0], expected_h0)
    torch.testing.assert_close(bias[0, 1], 2 * expected_h0)


def test_varlen_ref_matches_dense_per_sequence():
    seqlens_q, seqlens_k = [3, 0, 5, 2], [4, 2, 5, 0]
    cu_q, cu_k = cu_from_seqlens(seqlens_q), cu_from_seqlens(seqlens_k)
    assert cu_q.dtype == torch.int32 and seqlens_from_cu(cu_q) == seqlens_q
    q = torch.randn(sum(seqlens_q), 2, 8, dtype=torch.float64)
    k = torch.randn(sum(seqlens_k), 1, 8, dtype=torch.float64)
    v = torch.randn(sum(seqlens_k), 1, 8, dtype=torch.float64)
    slopes = torch.rand(4, 2)
    out, lse, probs = attention_varlen_ref(
        q, k, v, cu_q, cu_k, causal=True, alibi_slopes=slopes, return_probs=True, compute_dtype=torch.float64
    )
    assert out.shape == q.shape and lse.shape == (2, 10) and probs.shape == (4, 2, 5, 5)
    start_q = start_k = 0
    for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k)):
        qb, kb, vb = q[start_q:start_q + sq][None], k[start_k:start_k + sk][None], v[start_k:start_k + sk][None]
        o, l_, p = attention_ref(
            qb, kb, vb, causal=True, alibi_slopes=slopes[b], return_probs=True, compute_dtype=torch.float64
        )
        torch.testing.assert_close(out[start_q:start_q + sq], o[0])
        torch.testing.assert_close(lse[:, start_q:start_q + sq], l_[0])
        torch.testing.assert_close(probs[b, :, :sq, :sk], p[0])
        start_q += sq
        start_k += sk
    assert torch.equal(out[8:10], torch.zeros_like(out[8:10]))
    assert torch.isinf(lse[:, 8:10]).all()
