# return_attn_probs=True on CUDA (csrc/sm80/probs_kernel.cu) against the CPU path given the same inputs and
# rng_state, and against the fp64 reference: values within one rounding of the output dtype of the CPU path,
# the FlashAttention tolerance rule against the reference, exact zeros where masked, and the dropout sign
# pattern equal to the CPU path's and to the Philox keep mask. Covers causal/window (both alignments),
# softcap, ALiBi, additive bias, GQA/MQA, varlen with empty sequences, odd seqlens, rows without keys.
# Collected only where a GPU and a built forward kernel exist (is_supported(..., backward=False)).
import math

import pytest
import torch

import flash_attn
from flash_attn.reference import (
    attention_ref,
    attention_varlen_ref,
    cu_from_seqlens,
    dropout_keep_mask,
    dropout_keep_mask_varlen,
)
from helpers import assert_close_fa, randn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LOW = [torch.bfloat16, torch.float16]
# Largest gap between two roundings (CUDA, CPU) of nearly equal fp32 values to the output dtype: one step.
ONE_STEP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
# Probabilities above this are far from underflow in every dtype, so both paths must give them non-zero.
CLEARLY_POSITIVE = 1e-6
SEED = 0x1234_5678_9ABC  # above 2**32, so both key words of Philox matter
RNG_OFFSET = 0xDEAD_BEEF


def _require(dtype, head_dim):
    if not flash_attn.is_supported("cuda", dtype, head_dim, backward=False):
        pytest.skip(f"no CUDA forward kernel built for {dtype} head_dim={head_dim}")


def _fwd(q, k, v, *, cu=(None, None), max_seqlen=(0, 0), dropout_p=0.0, scale=None, window=(-1, -1),
         bottom_right=True, softcap=0.0, alibi=None, bias=None, rng_state=None, device="cuda"):
    """The raw op with return_probs=True, every tensor moved to `device`."""
    to = (lambda t: None if t is None else t.to(device))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.flash_attn.fwd(to(q), to(k), to(v), to(cu[0]), to(cu[1]), max_seqlen[0], max_seqlen[1],
                                    dropout_p, scale, window[0], window[1], bottom_right, softcap, to(alibi),
                                    to(bias), to(rng_state), True)


def _rng_state():
    return torch.tensor([SEED, RNG_OFFSET], dtype=torch.int64, device="cuda")


def _check(cuda_result, cpu_result, ref_probs, naive_probs, keep=None):
    """CUDA probs vs the CPU path's (same inputs and rng_state) and the reference (probs before dropout)."""
    probs, probs_cpu = cuda_result[2].cpu(), cpu_result[2]
    assert probs.shape == probs_cpu.shape == ref_probs.shape and probs.dtype == probs_cpu.dtype
    assert not torch.isnan(probs).any()
    torch.testing.assert_close(probs.float(), probs_cpu.float(), rtol=ONE_STEP[probs.dtype], atol=1e-6)
    assert_close_fa(probs.abs(), ref_probs, naive_probs, 2, floor_dtype=torch.float32)
    assert (probs[ref_probs == 0] == 0).all(), "non-zero probability where the key is masked"
    assert (probs[ref_probs > CLEARLY_POSITIVE] != 0).all()
    dropped, dropped_cpu = probs < 0, probs_cpu < 0
    informative = (probs != 0) & (probs_cpu != 0)
    assert torch.equal(dropped[informative], dropped_cpu[informative]), "dropout signs differ from the CPU path"
    if keep is None:
        assert not dropped.any()
    else:
        assert dropped.any()
        assert torch.equal(dropped[informative], ~keep[informative]), "dropout signs differ from the Philox mask"


def _dense_case(dtype, head_dim, b=2, sq=113, sk=255, h=4, hk=2, causal=False, window=(-1, -1),
                bottom_right=True, softcap=0.0, alibi=None, bias=None, dropout_p=0.0, scale=None):
    _require(dtype, head_dim)
    q = randn(b, sq, h, head_dim, dtype=dtype, device="cuda")
    k = randn(b, sk, hk, head_dim, dtype=dtype, device="cuda")
    v = randn(b, sk, hk, head_dim, dtype=dtype, device="cuda")
    window = (window[0], 0) if causal else window
    rng_state = _rng_state() if dropout_p > 0 else None
    kwargs = dict(dropout_p=dropout_p, scale=scale, window=window, bottom_right=bottom_right, softcap=softcap,
                  alibi=alibi, bias=bias, rng_state=rng_state)
    cuda_result = _fwd(q, k, v, **kwargs)
    cpu_result = _fwd(q, k, v, device="cpu", **kwargs)
    ref_kwargs = dict(softmax_scale=scale, window_size=window, bottom_right=bottom_right, softcap=softcap,
                      alibi_slopes=None if alibi is None else alibi.cpu(),
                      attn_bias=None if bias is None else bias.cpu(), return_probs=True)
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    ref = attention_ref(qc.double(), kc.double(), vc.double(), compute_dtype=torch.float64, **ref_kwargs)[2]
    naive = attention_ref(qc, kc, vc, compute_dtype=dtype, **ref_kwargs)[2]
    keep = dropout_keep_mask(rng_state, b, h, sq, sk, dropout_p) if dropout_p > 0 else None
    _check(cuda_result, cpu_result, ref, naive, keep)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_probs_head_dims(head_dim, causal, dtype):
    _dense_case(dtype, head_dim, causal=causal)


@pytest.mark.parametrize("shape", [(1, 1, 1, 2, 2), (2, 17, 1, 4, 1), (1, 1, 300, 4, 4), (2, 255, 113, 2, 1),
                                   (3, 128, 128, 8, 2), (1, 77, 90, 6, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_probs_seqlens_and_gqa(shape, causal):
    b, sq, sk, h, hk = shape
    _dense_case(torch.bfloat16, 64, b=b, sq=sq, sk=sk, h=h, hk=hk, causal=causal)


def _alibi(*shape):
    return torch.rand(*shape, device="cuda") * 0.5 + 0.05


def _bias(b, h, sq, sk, dtype, broadcast_batch=False):
    bias = randn(1 if broadcast_batch else b, h, sq, sk, dtype=dtype, device="cuda")
    bias[..., 3] = float("-inf")  # a key every row has masked out by the bias
    return bias.expand(b, h, sq, sk)


FEATURES = {
    "window": lambda: dict(window=(8, 3)),
    "window_left": lambda: dict(window=(20, -1)),
    "window_top_left": lambda: dict(window=(5, 7), bottom_right=False),
    "causal_top_left": lambda: dict(causal=True, bottom_right=False),
    "softcap": lambda: dict(softcap=5.0),
    "scale": lambda: dict(scale=0.3),
    "alibi": lambda: dict(alibi=_alibi(4), causal=True),
    "alibi_per_batch": lambda: dict(alibi=_alibi(2, 4)),
    "bias_fp32": lambda: dict(bias=_bias(2, 4, 113, 255, torch.float32)),
    "bias_bf16_broadcast": lambda: dict(bias=_bias(2, 4, 113, 255, torch.bfloat16, broadcast_batch=True)),
    "all": lambda: dict(alibi=_alibi(4), softcap=8.0, window=(16, 3), scale=0.2,
                        bias=_bias(2, 4, 113, 255, torch.float32)),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_probs_features(feature):
    _dense_case(torch.bfloat16, 128, **FEATURES[feature]())


@pytest.mark.parametrize("window", [(0, 0), (2, 0), (0, 1)])
def test_probs_rows_without_keys_are_zero(window):
    # sq > sk with bottom-right alignment: the first rows see no key at all (lse = +inf).
    _dense_case(torch.bfloat16, 64, b=1, sq=40, sk=30, h=2, hk=2, window=window)


@pytest.mark.parametrize("dropout_p", [0.17, 0.5])
@pytest.mark.parametrize("extra", ["plain", "causal", "all"])
def test_probs_dropout_signs(dropout_p, extra):
    kwargs = {"plain": {}, "causal": dict(causal=True),
              "all": dict(alibi=_alibi(4), softcap=8.0, window=(16, 3), bias=_bias(2, 4, 113, 255, torch.float32))}
    _dense_case(torch.bfloat16, 64, dropout_p=dropout_p, **kwargs[extra])


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("causal", [False, True])
def test_probs_varlen(causal, dropout_p):
    _require(torch.bfloat16, 64)
    seqlens_q, seqlens_k = [37, 0, 128, 1, 200], [53, 9, 128, 0, 70]
    h, hk = 4, 2
    # max_seqlen above the longest sequence: the probs tensor gets padding rows/columns that must stay 0.
    max_q, max_k = max(seqlens_q) + 5, max(seqlens_k) + 3
    q = randn(sum(seqlens_q), h, 64, dtype=torch.bfloat16, device="cuda")
    k = randn(sum(seqlens_k), hk, 64, dtype=torch.bfloat16, device="cuda")
    v = randn(sum(seqlens_k), hk, 64, dtype=torch.bfloat16, device="cuda")
    cu = (cu_from_seqlens(seqlens_q, "cuda"), cu_from_seqlens(seqlens_k, "cuda"))
    alibi = _alibi(5, h)
    rng_state = _rng_state() if dropout_p > 0 else None
    kwargs = dict(cu=cu, max_seqlen=(max_q, max_k), dropout_p=dropout_p, window=(-1, 0 if causal else -1),
                  alibi=alibi, rng_state=rng_state)
    cuda_result = _fwd(q, k, v, **kwargs)
    cpu_result = _fwd(q, k, v, device="cpu", **kwargs)

    def ref(compute_dtype, *tensors):
        return attention_varlen_ref(*[t.cpu() for t in tensors], cu[0].cpu(), cu[1].cpu(), max_seqlen_q=max_q,
                                    max_seqlen_k=max_k, causal=causal, alibi_slopes=alibi.cpu(), return_probs=True,
                                    compute_dtype=compute_dtype)[2]

    truth = ref(torch.float64, q.double(), k.double(), v.double())
    naive = ref(torch.bfloat16, q, k, v)
    keep = None
    if dropout_p > 0:
        keep = dropout_keep_mask_varlen(rng_state, seqlens_q, seqlens_k, h, dropout_p, max_q, max_k)
    _check(cuda_result, cpu_result, truth, naive, keep)


def test_probs_do_not_change_out_and_lse():
    _require(torch.bfloat16, 64)
    q, k, v = (randn(2, 70, 4, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    out, lse, probs = _fwd(q, k, v, window=(-1, 0))
    out_plain, lse_plain, empty = torch.ops.flash_attn.fwd(q, k, v, None, None, 0, 0, 0.0, 0.125, -1, 0, True, 0.0,
                                                           None, None, None, False)
    assert empty.numel() == 0 and probs.shape == (2, 4, 70, 70)
    torch.testing.assert_close(out, out_plain, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_plain, rtol=0, atol=0)


def test_sign_check_tells_rng_states_apart():
    # The comparison above can fail: the CPU path run with the next Philox offset must be rejected.
    _require(torch.bfloat16, 64)
    q, k, v = (randn(1, 64, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    other = _rng_state()
    other[1] += 1
    cuda_result = _fwd(q, k, v, dropout_p=0.5, rng_state=_rng_state())
    cpu_result = _fwd(q, k, v, dropout_p=0.5, rng_state=other, device="cpu")
    ref = attention_ref(q.cpu().double(), k.cpu().double(), v.cpu().double(), return_probs=True,
                        compute_dtype=torch.float64)[2]
    with pytest.raises(AssertionError):
        _check(cuda_result, cpu_result, ref, ref.to(torch.bfloat16), dropout_keep_mask(other, 1, 2, 64, 64, 0.5))
