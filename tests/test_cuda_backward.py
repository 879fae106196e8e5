# CUDA backward kernels against the fp64 reference under the FlashAttention tolerance rule (3x naive for
# gradients): every head-dim bucket, odd seqlens both ways, GQA/MQA, causal/window/top-left, softcap, ALiBi,
# bias with dbias, dropout (the reference uses the kernel's Philox mask), varlen with empty sequences, dlse,
# deterministic mode (bitwise), rows without keys, 64-bit offsets, and the compact tiles of GPUs below Hopper
# (forced by FLASH_ATTN_BWD_SMEM_LIMIT). Collected only where a GPU and a built backward kernel exist.
import functools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import flash_attn
from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn.interface import attention
from flash_attn.reference import attention_ref, attention_varlen_ref, cu_from_seqlens, dropout_keep_mask
from helpers import CaptureRngState, assert_close_fa, check_output_and_grads, randn, reference_pair

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
LOW = [torch.bfloat16, torch.float16]
UNBOUNDED = -1


def _require(dtype, head_dim):
    if not flash_attn.is_supported("cuda", dtype, head_dim, backward=True):
        pytest.skip(f"no CUDA backward kernel built for {dtype} head_dim={head_dim}")


def _qkv(b, sq, sk, h, hk, d, dtype):
    return (randn(b, sq, h, d, dtype=dtype, device="cuda", requires_grad=True),
            randn(b, sk, hk, d, dtype=dtype, device="cuda", requires_grad=True),
            randn(b, sk, hk, d, dtype=dtype, device="cuda", requires_grad=True))


def _run_and_check(q, k, v, ref_kwargs, **kwargs):
    """flash_attn_func(**kwargs) forward + backward vs attention_ref(**ref_kwargs) in fp64 and naive."""
    dout = randn(*q.shape, dtype=q.dtype, device="cuda")
    out = flash_attn_func(q, k, v, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for g in grads:
        assert torch.isfinite(g).all()
    truth, naive = reference_pair(functools.partial(attention_ref, **ref_kwargs), (q, k, v), dout)
    check_output_and_grads(out, grads, truth, naive)
    return grads


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("head_dim", [32, 40, 64, 96, 128, 160, 192, 200, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(head_dim, causal, dtype):
    _require(dtype, head_dim)
    q, k, v = _qkv(2, 113, 255, 4, 2, head_dim, dtype)
    _run_and_check(q, k, v, dict(causal=causal), causal=causal)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2, 2), (2, 17, 1, 4, 1), (1, 1, 1000, 4, 4), (2, 1000, 113, 2, 1),
                                   (1, 257, 257, 8, 2), (3, 255, 128, 4, 4), (1, 128, 1000, 2, 2),
                                   (2, 1000, 1000, 2, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])  # dQ staged (hd 64, causal 128) and from registers
def test_seqlens(head_dim, shape, causal, dtype):
    b, sq, sk, h, hk = shape
    _require(dtype, head_dim)
    q, k, v = _qkv(b, sq, sk, h, hk, head_dim, dtype)
    _run_and_check(q, k, v, dict(causal=causal), causal=causal)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("case", ["dense", "dense_deterministic", "varlen_rows_past_end"])
def test_dq_accumulator_on_dirty_memory(head_dim, case):
    """The dq accumulators come from caching-allocator memory that earlier tensors filled (here with NaN): the
    preprocess must zero every float the main kernel adds to, in its layout (csrc/include/flash_attn/bwd_workspace.h
    DqLayout), including the second row of a pair whose first row ends the rows: an odd total_q (3 x 85 = 255 dense
    rows), or rows past cu_seqlens[-1] (varlen: row 100 ends 101 rows of 108)."""
    _require(torch.bfloat16, head_dim)
    for megabytes in (1, 2, 4, 8):
        torch.full((megabytes << 18,), float("nan"), device="cuda")
    if case != "varlen_rows_past_end":
        q, k, v = _qkv(3, 85, 140, 3, 1, head_dim, torch.bfloat16)
        _run_and_check(q, k, v, {}, deterministic=case == "dense_deterministic")
        return
    seqlens_q, seqlens_k, extra_rows = [37, 0, 64], [53, 9, 70], 7
    rows_q, rows_k = sum(seqlens_q), sum(seqlens_k)
    q = randn(rows_q + extra_rows, 4, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k = randn(rows_k, 2, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    v = randn(rows_k, 2, head_dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    cu_q, cu_k = cu_from_seqlens(seqlens_q, "cuda"), cu_from_seqlens(seqlens_k, "cuda")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    dout = randn(*out.shape, dtype=torch.bfloat16, device="cuda")
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert dq[rows_q:].abs().max() == 0

    def ref(q, k, v, compute_dtype):
        return attention_varlen_ref(q, k, v, cu_q, cu_k, compute_dtype=compute_dtype)

    truth, naive = reference_pair(ref, (q[:rows_q], k, v), dout[:rows_q])
    check_output_and_grads(out[:rows_q], [dq[:rows_q], dk, dv], truth, naive)


FEATURES = {
    "window": dict(window_size=(8, 3)),
    "window_left": dict(window_size=(20, -1)),
    "window_right": dict(window_size=(-1, 7)),
    "window_causal": dict(window_size=(30, 0)),
    "softcap": dict(softcap=5.0),
    "softcap_causal": dict(softcap=30.0, causal=True),
    "alibi": dict(alibi=True, causal=True),
    "alibi_noncausal": dict(alibi=True),
    "scale": dict(softmax_scale=0.3),
    "all": dict(alibi=True, softcap=8.0, window_size=(16, 3), softmax_scale=0.2),
}


# Head dims 80 and 200 (buckets 96 and 224): the general kernel's Q / dO / K / V loads on fewer threads than the CTA
# has (bwd_common.h load_tile), with the columns past the head dim zero-filled. Head dim 32: the score-mods kernel's
# 128 x 128 tile (bwd_common.h bwd_softcap_tanh_first changes its softcap pass).
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 200, 256])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(feature, head_dim, dtype):
    _require(dtype, head_dim)
    kwargs = dict(FEATURES[feature])
    q, k, v = _qkv(2, 100, 140, 4, 2, head_dim, dtype)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(2, 4, device="cuda") * 0.5 + 0.05
    _run_and_check(q, k, v, kwargs, **kwargs)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("window", [(UNBOUNDED, 0), (10, 5)])
@pytest.mark.parametrize("sizes", [(90, 150), (150, 90)])
def test_top_left_alignment(sizes, window, dtype):
    _require(dtype, 64)
    sq, sk = sizes
    q, k, v = _qkv(2, sq, sk, 4, 2, 64, dtype)
    dout = randn(*q.shape, dtype=dtype, device="cuda")
    out, _, _ = attention(q, k, v, window=window, bottom_right=False)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = functools.partial(attention_ref, window_size=window, bottom_right=False)
    truth, naive = reference_pair(ref, (q, k, v), dout)
    check_output_and_grads(out, grads, truth, naive)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("bias_shape", [(2, 4, 77, 130), (1, 4, 1, 130), (2, 1, 77, 130)])
def test_bias_and_dbias(bias_shape, dtype):
    _require(dtype, 64)
    q, k, v = _qkv(2, 77, 130, 4, 2, 64, dtype)
    bias_leaf = randn(*bias_shape, dtype=torch.float32, device="cuda", requires_grad=True)
    dout = randn(*q.shape, dtype=dtype, device="cuda")
    out, _, _ = attention(q, k, v, window=(UNBOUNDED, 0), attn_bias=bias_leaf.expand(2, 4, 77, 130))
    grads = torch.autograd.grad(out, (q, k, v, bias_leaf), dout)

    def ref(q, k, v, bias, compute_dtype):
        return attention_ref(q, k, v, causal=True, attn_bias=bias, compute_dtype=compute_dtype)

    truth, naive = reference_pair(ref, (q, k, v, bias_leaf.detach()), dout)
    check_output_and_grads(out, grads[:3], truth, naive)
    assert grads[3].shape == bias_leaf.shape
    assert_close_fa(grads[3].float(), truth[2][3], naive[2][3].float(), 3, floor_dtype=torch.float32)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("p", [0.17, 0.5])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout(causal, head_dim, p, dtype):
    _require(dtype, head_dim)
    _check_dropout_grads(head_dim, causal, p, dtype)


def _check_dropout_grads(head_dim, causal, p, dtype):
    """Forward + backward with dropout against the reference given the forward's own keep mask."""
    b, sq, sk, h, hk = 2, 77, 140, 4, 2
    q, k, v = _qkv(b, sq, sk, h, hk, head_dim, dtype)
    dout = randn(*q.shape, dtype=dtype, device="cuda")
    with CaptureRngState() as capture:
        out = flash_attn_func(q, k, v, dropout_p=p, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = dropout_keep_mask(capture.last(), b, h, sq, sk, p).to("cuda")
    ref = functools.partial(attention_ref, causal=causal, dropout_mask=keep, dropout_p=p)
    truth, naive = reference_pair(ref, (q, k, v), dout)
    check_output_and_grads(out, grads, truth, naive)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen(head_dim, causal, dtype):
    _require(dtype, head_dim)
    _check_varlen_grads(head_dim, causal, dtype)


def _check_varlen_grads(head_dim, causal, dtype):
    """Varlen forward + backward (empty and one-row sequences among them) against the fp32 reference."""
    seqlens_q, seqlens_k = [37, 0, 128, 1, 200, 5], [53, 9, 128, 0, 70, 300]
    q = randn(sum(seqlens_q), 4, head_dim, dtype=dtype, device="cuda", requires_grad=True)
    k = randn(sum(seqlens_k), 2, head_dim, dtype=dtype, device="cuda", requires_grad=True)
    v = randn(sum(seqlens_k), 2, head_dim, dtype=dtype, device="cuda", requires_grad=True)
    cu_q, cu_k = cu_from_seqlens(seqlens_q, "cuda"), cu_from_seqlens(seqlens_k, "cuda")
    dout = randn(*q.shape, dtype=dtype, device="cuda")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def ref(q, k, v, compute_dtype):
        return attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, compute_dtype=compute_dtype)

    truth, naive = reference_pair(ref, (q, k, v), dout)
    check_output_and_grads(out, grads, truth, naive)


# The portable hd 96 bucket's own paths (the Hopper kernels take these calls on an H200 unless turned off): the
# forward's half-segment swizzled K / V for unmasked calls (sm80/fwd_tile_config.h fwd_swizzles_half_segments) and
# the backward's dK / dV staged through shared memory and stored in 16-byte rows (kBwdStagedDkv)
# (sm80/bwd_common.h bwd_stages_dkv: a key block's rows past the sequence are not stored, head dim 72 leaves
# columns of the bucket unused).
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("head_dim", [72, 96])
@pytest.mark.parametrize("shape", [(2, 113, 255, 4, 2), (1, 300, 129, 2, 1), (3, 64, 127, 2, 2), (1, 200, 1000, 4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_portable_hd96_bucket(head_dim, shape, causal, dtype, portable_kernels):
    _require(dtype, head_dim)
    q, k, v = _qkv(*shape, head_dim, dtype)
    _run_and_check(q, k, v, dict(causal=causal), causal=causal)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("causal", [False, True])
def test_portable_hd96_varlen(causal, dtype, portable_kernels):
    _require(dtype, 96)
    _check_varlen_grads(96, causal, dtype)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("causal", [False, True])
def test_dlse(causal, dtype):
    _require(dtype, 64)
    q, k, v = _qkv(2, 97, 150, 4, 1, 64, dtype)
    dout = randn(*q.shape, dtype=dtype, device="cuda")
    window = (UNBOUNDED, 0) if causal else (UNBOUNDED, UNBOUNDED)
    out, lse, _ = attention(q, k, v, window=window)
    dlse = randn(*lse.shape, dtype=torch.float32, device="cuda")
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))

    def evaluate(compute_dtype):
        xs = [x.detach().to(compute_dtype).requires_grad_() for x in (q, k, v)]
        o, l = attention_ref(*xs, causal=causal, compute_dtype=compute_dtype)
        return torch.autograd.grad((o, l), xs, (dout.to(compute_dtype), dlse.to(l.dtype)))

    truth, naive = evaluate(torch.float64), evaluate(dtype)
    for g, gt, gn in zip(grads, truth, naive):
        assert_close_fa(g, gt, gn, 3, floor_dtype=torch.float32)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", ["dense_gqa_causal", "dense_dropout", "varlen", "mha_long"])
def test_deterministic_bitwise(case, dtype):
    _require(dtype, 128)
    if case == "varlen":
        seqlens = [300, 0, 1000, 17]
        q = randn(sum(seqlens), 8, 128, dtype=dtype, device="cuda", requires_grad=True)
        k = randn(sum(seqlens), 2, 128, dtype=dtype, device="cuda", requires_grad=True)
        v = randn(sum(seqlens), 2, 128, dtype=dtype, device="cuda", requires_grad=True)
        cu = cu_from_seqlens(seqlens, "cuda")

        def call(deterministic=True):
            return flash_attn_varlen_func(q, k, v, cu, cu, max(seqlens), max(seqlens), causal=True,
                                          deterministic=deterministic)
    else:
        shape = {"dense_gqa_causal": (2, 700, 900, 8, 2), "dense_dropout": (2, 300, 300, 4, 4),
                 "mha_long": (1, 2048, 2048, 4, 4)}[case]
        q, k, v = _qkv(*shape, 128, dtype)
        kwargs = dict(causal=case != "dense_dropout", dropout_p=0.2 if case == "dense_dropout" else 0.0)

        def call(deterministic=True):
            torch.manual_seed(123)
            return flash_attn_func(q, k, v, deterministic=deterministic, **kwargs)

    dout = randn(*q.shape, dtype=dtype, device="cuda")
    runs = [torch.autograd.grad(call(), (q, k, v), dout) for _ in range(3)]
    for run in runs[1:]:
        for g0, g in zip(runs[0], run):
            assert torch.equal(g0, g)
    # The deterministic dq path (per-CTA accumulators) must agree with the atomic one up to summation order.
    for g0, g in zip(runs[0], torch.autograd.grad(call(deterministic=False), (q, k, v), dout)):
        torch.testing.assert_close(g0.float(), g.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", LOW)
def test_rows_without_keys(dtype):
    _require(dtype, 64)
    sq, sk = 200, 70
    q, k, v = _qkv(2, sq, sk, 4, 2, 64, dtype)
    grads = _run_and_check(q, k, v, dict(causal=True), causal=True)
    empty = sq - sk
    assert torch.equal(grads[0][:, :empty], torch.zeros_like(grads[0][:, :empty]))
    # window (0, 0) bottom-right with sq < sk: the first sk - sq keys are seen by nobody.
    q, k, v = _qkv(1, 40, 100, 2, 2, 64, dtype)
    grads = _run_and_check(q, k, v, dict(window_size=(0, 0)), window_size=(0, 0))
    assert torch.equal(grads[1][:, :60], torch.zeros_like(grads[1][:, :60]))
    assert torch.equal(grads[2][:, :60], torch.zeros_like(grads[2][:, :60]))


def test_64bit_offsets():
    """q's second batch entry starts 2^31 elements in: base offsets must be 64-bit."""
    _require(torch.bfloat16, 64)
    b, s, h, d = 2, 64, 2, 64
    big = torch.randn(2**31 + s * h * d, dtype=torch.bfloat16, device="cuda")
    q = big.as_strided((b, s, h, d), (2**31, h * d, d, 1)).requires_grad_()
    k, v = (randn(b, s, h, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2))
    dout = randn(b, s, h, d, dtype=torch.bfloat16, device="cuda")
    grads = torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
    q2 = q.detach().contiguous().requires_grad_()
    del big
    grads2 = torch.autograd.grad(flash_attn_func(q2, k, v, causal=True, deterministic=True), (q2, k, v), dout)
    for g, g2 in zip(grads, grads2):
        assert torch.equal(g, g2)


# ---- compact tiles (sm80/bwd_common.h): the kernels GPUs with less shared memory than Hopper run ----
# FLASH_ATTN_BWD_SMEM_LIMIT makes the launcher assume at most this many bytes of shared memory per block, so a
# Hopper GPU runs what an sm86/sm89 GPU (99 KB: compact tiles at every head dim) or an A100 (163 KB: the full tiles
# with one Q / dO stage for plain calls at head dims 64, 96, 128, 192, 224, 256; the full ones, which fit, elsewhere)
# would, with the sm90 code's dQ staging counted.
SMEM_LIMIT_ENV = "FLASH_ATTN_BWD_SMEM_LIMIT"
SM86_SMEM = 101376
A100_SMEM = 166912
# How the profiler may spell a kernel's BwdTiles template argument (as a cast number, qualified, or mangled).
TILE_KERNEL_MARKS = {
    "full": ("BwdTiles)0", "BwdTiles::kFull>", "BwdTiles::kFull,", "BwdTilesE0"),
    "compact": ("BwdTiles)1", "BwdTiles::kCompact", "BwdTilesE1"),
    "one_stage": ("BwdTiles)2", "BwdTiles::kFullOneStage", "BwdTilesE2"),
}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_compact_tiles_head_dims(head_dim, causal, dtype, monkeypatch):
    _require(dtype, head_dim)
    monkeypatch.setenv(SMEM_LIMIT_ENV, str(SM86_SMEM))
    q, k, v = _qkv(2, 113, 257, 4, 2, head_dim, dtype)
    _run_and_check(q, k, v, dict(causal=causal), causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_compact_tiles_a100_class(head_dim, causal, monkeypatch):
    _require(torch.bfloat16, head_dim)
    monkeypatch.setenv(SMEM_LIMIT_ENV, str(A100_SMEM))
    q, k, v = _qkv(2, 257, 113, 4, 1, head_dim, torch.bfloat16)
    _run_and_check(q, k, v, dict(causal=causal), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_one_stage_tiles_varlen_hd192(causal, monkeypatch):
    """hd 192's one-stage tiles (an A100's, and Hopper's for plain calls that are not deterministic since the
    sixty-third session: bwd_common.h bwd_prefers_one_stage_tiles) on ragged, empty and one-row sequences."""
    _require(torch.bfloat16, 192)
    monkeypatch.setenv(SMEM_LIMIT_ENV, str(A100_SMEM))
    _check_varlen_grads(192, causal, torch.bfloat16)


@pytest.mark.parametrize("case", ["softcap", "alibi", "alibi_causal"])
@pytest.mark.usefixtures("portable_kernels")
def test_a100_class_score_mods_hd64(case, monkeypatch):
    """hd 64 softcap / ALiBi calls under an A100's shared memory, where the full set's 128-row kernel does not fit:
    the compact set (causal, softcap) or the one-stage one (bwd_launch.h run_bwd) takes them."""
    _require(torch.bfloat16, 64)
    monkeypatch.setenv(SMEM_LIMIT_ENV, str(A100_SMEM))
    kwargs = {"softcap": dict(softcap=4.0), "alibi": dict(alibi=True), "alibi_causal": dict(alibi=True, causal=True)}
    kwargs = dict(kwargs[case])
    q, k, v = _qkv(2, 150, 211, 4, 2, 64, torch.bfloat16)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(2, 4, device="cuda") * 0.5 + 0.05
    _run_and_check(q, k, v, kwargs, **kwargs)


COMPACT_FEATURES = {
    "softcap_hd128": (128, dict(softcap=5.0, causal=True)),
    "alibi_hd256": (256, dict(alibi=True)),
    "window_hd192": (192, dict(window_size=(20, 3))),
    "all_hd96": (96, dict(alibi=True, softcap=8.0, window_size=(16, 3), softmax_scale=0.2)),
}


@pytest.mark.parametrize("case", list(COMPACT_FEATURES))
def test_compact_tiles_features(case, monkeypatch):
    head_dim, kwargs = COMPACT_FEATURES[case]
    kwargs = dict(kwargs)
    _require(torch.bfloat16, head_dim)
    monkeypatch.setenv(SMEM_LIMIT_ENV, str(SM86_SMEM))
    q, k, v = _qkv(2, 100, 140, 4, 2, head_dim, torch.bfloat16)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(2, 4, device="cuda") * 0.5 + 0.05
    _run_and_check(q, k, v, kwargs, **kwargs)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_compact_tiles_dropout(head_dim, monkeypatch):
    _require(torch.float16, head_dim)
    monkeypatch.setenv(SMEM_LIMIT_ENV, str(SM86_SMEM))
    _check_dropout_grads(head_dim, True, 0.17, torch.float16)


def test_compact_tiles_bias_and_dbias(monkeypatch):
    _require(torch.bfloat16, 160)
    monkeypatch.setenv(SMEM_LIMIT_ENV, str(SM86_SMEM))
    q, k, v = _qkv(2, 77, 130, 4, 2, 160, torch.bfloat16)
    bias_leaf = randn(2, 4, 77, 130, dtype=torch.float32, device="cuda", requires_grad=True)
    dout = randn(*q.shape, dtype=torch.bfloat16, device="cuda")
    out, _, _ = attention(q, k, v, window=(UNBOUNDED, 0), attn_bias=bias_leaf)
    grads = torch.autograd.grad(out, (q, k, v, bias_leaf), dout)

    def ref(q, k, v, bias, compute_dtype):
        return attention_ref(q, k, v, causal=True, attn_bias=bias, compute_dtype=compute_dtype)

    truth, naive = reference_pair(ref, (q, k, v, bias_leaf.detach()), dout)
    check_output_and_grads(out, grads[:3], truth, naive)
    assert_close_fa(grads[3].float(), truth[2][3], naive[2][3].float(), 3, floor_dtype=torch.float32)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_compact_tiles_varlen(head_dim, monkeypatch):
    dtype = torch.bfloat16
    _require(dtype, head_dim)
    monkeypatch.setenv(SMEM_LIMIT_ENV, str(SM86_SMEM))
    _check_varlen_grads(head_dim, True, dtype)


# Under an A100's limit hd 64 and 96 run the one-stage tiles (not the feature kernel) since the thirty-seventh session.
@pytest.mark.parametrize("limit,head_dim", [(SM86_SMEM, 64), (SM86_SMEM, 128), (SM86_SMEM, 256), (A100_SMEM, 64),
                                            (A100_SMEM, 96), (A100_SMEM, 128)])
def test_compact_tiles_deterministic_bitwise(limit, head_dim, monkeypatch):
    dtype = torch.bfloat16
    _require(dtype, head_dim)
    monkeypatch.setenv(SMEM_LIMIT_ENV, str(limit))
    q, k, v = _qkv(2, 700, 900, 8, 2, head_dim, dtype)
    dout = randn(*q.shape, dtype=dtype, device="cuda")

    def grads(deterministic=True):
        return torch.autograd.grad(flash_attn_func(q, k, v, causal=True, deterministic=deterministic), (q, k, v),
                                   dout)

    runs = [grads() for _ in range(2)]
    for g0, g in zip(*runs):
        assert torch.equal(g0, g)
    for g0, g in zip(runs[0], grads(deterministic=False)):
        torch.testing.assert_close(g0.float(), g.float(), atol=2e-2, rtol=2e-2)


def _backward_kernel_names(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if "bwd_kernel" in event.name]


def _require_full_tiles(monkeypatch, head_dim):
    """No shared-memory limit, on a GPU whose shared memory holds the full tiles (Hopper-class, 227 KB per block)."""
    monkeypatch.delenv(SMEM_LIMIT_ENV, raising=False)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if getattr(props, "shared_memory_per_block_optin", 0) < 200 * 1024:
        pytest.skip(f"the full hd {head_dim} tiles need a Hopper-class GPU (227 KB of shared memory per block)")


# The tile set a limit picks: (head dim, limit, call, tiles where the kernels stage dQ (sm90 code), tiles elsewhere).
# Without the staging (below sm90) the plain hd 96 full tile (141 KB) fits an A100 and the hd 32 one-stage tile (95 KB)
# an sm86 GPU. Plain and softcap / ALiBi calls never fall to the feature kernel, whose full tiles fit where the plain
# ones do not (hd 32 / 64 / 96; bwd_launch.h run_bwd): under these limits it would show the full set's mark.
TILES_SELECTED = {
    "hd128_sm86": (128, SM86_SMEM, dict(causal=True), "compact", "compact"),
    "hd128_a100": (128, A100_SMEM, dict(causal=True), "one_stage", "one_stage"),
    "hd128_full": (128, None, dict(causal=True), "full", "full"),
    "hd64_a100": (64, A100_SMEM, dict(causal=True), "one_stage", "one_stage"),
    "hd64_a100_alibi": (64, A100_SMEM, dict(alibi=True), "one_stage", "one_stage"),
    "hd96_a100_softcap": (96, A100_SMEM, dict(softcap=5.0, causal=True), "one_stage", "full"),
    "hd32_sm86_alibi": (32, SM86_SMEM, dict(alibi=True, causal=True), "compact", "one_stage"),
    "hd192_full_causal": (192, None, dict(causal=True), "one_stage", "one_stage"),
    "hd192_full_deterministic": (192, None, dict(deterministic=True), "full", "full"),
    "hd192_full_softcap": (192, None, dict(softcap=5.0), "full", "full"),
}


@pytest.mark.parametrize("case", list(TILES_SELECTED))
@pytest.mark.usefixtures("portable_kernels")
def test_tiles_selected(case, monkeypatch):
    """The limit picks the tile set: compact under 99 KB, one-stage full tiles under an A100's 163 KB where the full
    ones do not fit, the full tiles on the real (Hopper-class) device but for hd 192's plain calls that are not
    deterministic, which take the one-stage ones there too (bwd_common.h bwd_prefers_one_stage_tiles)."""
    head_dim, limit, kwargs, staged_tiles, unstaged_tiles = TILES_SELECTED[case]
    kwargs = dict(kwargs)
    _require(torch.bfloat16, head_dim)
    if limit is None:
        _require_full_tiles(monkeypatch, head_dim)
    else:
        monkeypatch.setenv(SMEM_LIMIT_ENV, str(limit))
    tiles = staged_tiles if torch.cuda.get_device_capability() >= (9, 0) else unstaged_tiles
    q, k, v = _qkv(1, 128, 128, 2, 2, head_dim, torch.bfloat16)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(1, 2, device="cuda") * 0.5 + 0.05
    out = flash_attn_func(q, k, v, **kwargs)
    names = _backward_kernel_names(lambda: out.backward(torch.ones_like(out)))
    assert names, "no backward main kernel seen by the profiler"
    assert all(any(mark in name for mark in TILE_KERNEL_MARKS[tiles]) for name in names), names


# hd 64 softcap / ALiBi calls on a Hopper-class device (bwd_common.h bwd_score_mods_take_compact_tiles): every one
# takes the full set since the sixtieth session (the compact set before for causal and softcap calls).
SCORE_MODS_TILES = {
    "softcap": (dict(softcap=6.0), "full"),
    "alibi_causal": (dict(alibi=True, causal=True), "full"),
    "alibi": (dict(alibi=True), "full"),
}


@pytest.mark.parametrize("case", list(SCORE_MODS_TILES))
@pytest.mark.usefixtures("portable_kernels")
def test_score_mods_tiles_selected(case, monkeypatch):
    _require(torch.bfloat16, 64)
    _require_full_tiles(monkeypatch, 64)
    kwargs, tiles = SCORE_MODS_TILES[case]
    kwargs = dict(kwargs)
    q, k, v = _qkv(2, 131, 200, 4, 2, 64, torch.bfloat16)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(2, 4, device="cuda") * 0.5 + 0.05
    _run_and_check(q, k, v, kwargs, **kwargs)
    out = flash_attn_func(q, k, v, **kwargs)
    names = _backward_kernel_names(lambda: out.backward(torch.ones_like(out)))
    assert names, "no backward main kernel seen by the profiler"
    assert all(any(mark in name for mark in TILE_KERNEL_MARKS[tiles]) for name in names), names


@pytest.mark.parametrize("value", ["4096", "abc"])
@pytest.mark.usefixtures("portable_kernels")
def test_smem_limit_errors(value, monkeypatch):
    """A limit below every kernel's need, or not a number, fails with a message naming the variable."""
    _require(torch.bfloat16, 64)
    monkeypatch.setenv(SMEM_LIMIT_ENV, value)
    q, k, v = _qkv(1, 64, 64, 2, 2, 64, torch.bfloat16)
    out = flash_attn_func(q, k, v)
    with pytest.raises(RuntimeError, match=SMEM_LIMIT_ENV):
        out.backward(torch.ones_like(out))
