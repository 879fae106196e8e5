# CUDA forward kernels against the fp64 reference under the FlashAttention tolerance rule: every head-dim
# bucket, odd seqlens both ways, GQA/MQA, causal/window/softcap/ALiBi, varlen with empty sequences, SDPA
# masks, and dropout (the kernel's mask must be the Philox mask of the reference). Collected only where a
# GPU and a built forward kernel exist (flash_attn.is_supported(..., backward=False)).
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import flash_attn
from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn._native import C
from flash_attn.reference import (
    attention_ref,
    attention_varlen_ref,
    cu_from_seqlens,
    dropout_keep_mask,
)
from helpers import CaptureRngState, assert_close_fa, check_kvcache_cuda_matches_cpu, randn

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
LOW = [torch.bfloat16, torch.float16]
# 40, 72, 120, 144, 176 and 200 run in a larger bucket's kernel with columns past head_dim (the whole-tile loads'
# bounded path; at 72 / 144 / 176 a column group of the grouped loads, kernel_common.h GroupedColumnLoads, partly past
# it).
HEAD_DIMS = [32, 40, 64, 72, 96, 120, 128, 144, 160, 176, 192, 200, 256]


def _runs_sm90_code():
    """The kernels carry their sm90 code (TMA loads) here: a Hopper GPU and SASS for sm_90, not compute_80 PTX."""
    return C.loaded_code(torch.cuda.current_device())[0] >= 90


def _require(dtype, head_dim):
    if not flash_attn.is_supported("cuda", dtype, head_dim, backward=False):
        pytest.skip(f"no CUDA forward kernel built for {dtype} head_dim={head_dim}")


def _check(out, ref_fn, inputs, mult=2.0):
    """ours vs fp64 reference, naive = the same reference in the inputs' low precision."""
    truth = ref_fn(*[x.double() for x in inputs], compute_dtype=torch.float64)[0]
    naive = ref_fn(*inputs, compute_dtype=inputs[0].dtype)[0]
    assert_close_fa(out.cpu(), truth.cpu(), naive.cpu(), mult)


def _qkv(b, sq, sk, h, hk, d, dtype):
    return (randn(b, sq, h, d, dtype=dtype, device="cuda"), randn(b, sk, hk, d, dtype=dtype, device="cuda"),
            randn(b, sk, hk, d, dtype=dtype, device="cuda"))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(head_dim, causal, dtype):
    _require(dtype, head_dim)
    q, k, v = _qkv(2, 113, 255, 4, 2, head_dim, dtype)
    out = flash_attn_func(q, k, v, causal=causal)
    _check(out, lambda *x, **kw: attention_ref(*x, causal=causal, **kw), (q, k, v))


# The portable forward's look-ahead K load at a CTA's first key block (sm80/fwd_tile_config.h fwd_fills_past_kv_range:
# zero-filled copies into the free K slot instead of a branch, hd 96): ranges of one block, of whole and ragged blocks,
# and windows whose first visible block is not block 0, so the fill lands while other ranges still read their keys.
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("head_dim", [32, 96])
@pytest.mark.parametrize("sq, sk", [(1, 1), (64, 64), (65, 130), (113, 1000), (200, 129)])
@pytest.mark.parametrize("window", [(-1, -1), (100, 37), (0, 0), (-1, 0)])
def test_key_loop_look_ahead(head_dim, sq, sk, window, dtype, portable_kernels):
    _require(dtype, head_dim)
    q, k, v = _qkv(2, sq, sk, 4, 2, head_dim, dtype)
    out = flash_attn_func(q, k, v, window_size=window)
    _check(out, lambda *x, **kw: attention_ref(*x, window_size=window, **kw), (q, k, v))


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2, 2), (2, 17, 1, 4, 1), (1, 1, 1000, 4, 4), (2, 1000, 113, 2, 1),
                                   (1, 128, 128, 8, 2), (3, 255, 128, 4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(shape, causal, dtype):
    b, sq, sk, h, hk = shape
    _require(dtype, 64)
    q, k, v = _qkv(b, sq, sk, h, hk, 64, dtype)
    out = flash_attn_func(q, k, v, causal=causal)
    _check(out, lambda *x, **kw: attention_ref(*x, causal=causal, **kw), (q, k, v))


# Shapes that reach each K/V pipeline of the kernel (csrc/sm80/fwd_tile_config.h): the wide 8-warp tile
# (head dim > 128, V awaited before the softmax; non-causal at any length, causal/local from kWideMinKeys = 16384
# keys), the compact 4-warp tile below that (V of the first key tile in its prologue), the one-warp decode tile with its three-stage ring (<= 16 query rows; GQA-packed single-token
# calls; split-KV with ragged splits), and ranges of one or two key tiles where the ring's prologue covers the
# whole visit.
PIPELINE_SHAPES = [
    # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    (1, 300, 4100, 4, 2, 256),
    (1, 150, 16400, 2, 1, 256),
    (2, 130, 4096, 2, 1, 192),
    (1, 200, 4150, 2, 2, 160),
    (1, 300, 1100, 4, 2, 256),
    (1, 200, 1030, 2, 2, 160),
    (1, 1, 5000, 8, 2, 128),
    (3, 16, 777, 2, 2, 128),
    (2, 5, 40, 4, 4, 128),
    (1, 1, 33, 4, 1, 256),
    (2, 64, 64, 2, 2, 64),
    # Split-KV with more splits than the combine kernel loads before its weights (fwd_combine_kernel.h: 94 splits at
    # hd 128, 53 at hd 256, against 64 and 32 prefetched).
    (1, 1, 9000, 4, 1, 128),
    (1, 1, 5000, 2, 1, 256),
]


@pytest.mark.parametrize("shape", PIPELINE_SHAPES)
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_tile_pipelines(shape, mask):
    b, sq, sk, h, hk, d = shape
    _require(torch.bfloat16, d)
    kwargs = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(300, 17))}[mask]
    q, k, v = _qkv(b, sq, sk, h, hk, d, torch.bfloat16)
    out = flash_attn_func(q, k, v, **kwargs)
    _check(out, lambda *x, **kw: attention_ref(*x, **kwargs, **kw), (q, k, v))


FEATURES = {
    "window": dict(window_size=(8, 3)),
    "window_left": dict(window_size=(20, -1)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi=True, causal=True),
    "scale": dict(softmax_scale=0.3),
    "all": dict(alibi=True, softcap=8.0, window_size=(16, 3), softmax_scale=0.2),
}


# Head dims 80 and 200 (buckets 96 and 224): rows of 12 / 28 chunks, which the tile loads split over fewer threads
# than the CTA has (fwd_loads_fixed_columns), and a head dim below its bucket (the columns past it zero-filled). Head
# dim 64: the lean kernel's softcap calls with and without ALiBi (fwd_tile_config.h fwd_score_mods_poly_exp_every).
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 200])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(feature, head_dim, dtype):
    _require(dtype, head_dim)
    kwargs = dict(FEATURES[feature])
    q, k, v = _qkv(2, 100, 140, 4, 2, head_dim, dtype)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(2, 4, device="cuda") * 0.5 + 0.05
    out = flash_attn_func(q, k, v, **kwargs)
    ref_kwargs = {key: (val.cpu() if torch.is_tensor(val) else val) for key, val in kwargs.items()}
    _check(out, lambda *x, **kw: attention_ref(*[t.cpu() for t in x], **ref_kwargs, **kw), (q, k, v))


# Scales above kMaxFoldedSoftmaxScale (params.h) turn softmax into an argmax; the lean kernels' folded exponent was NaN
# at 1e30. Small-integer q and k make every score exact, so ties are exact too and the answer is the mean of the tied
# rows' values in any precision.
@pytest.mark.parametrize("scale", [1000.0, 1e30])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_scales_past_the_fold(scale, head_dim, causal):
    _require(torch.bfloat16, head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    q, k = (torch.randint(-3, 4, (2, 77, 4, head_dim), generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    v = randn(2, 77, 4, head_dim, dtype=torch.bfloat16, device="cuda")
    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    assert torch.isfinite(out).all()
    truth = attention_ref(*[x.double().cpu() for x in (q, k, v)], softmax_scale=scale, causal=causal,
                          compute_dtype=torch.float64)[0]
    torch.testing.assert_close(out.double().cpu(), truth, atol=1e-2, rtol=1e-2)


def test_lse_and_rows_without_keys():
    _require(torch.bfloat16, 64)
    q, k, v = _qkv(1, 40, 30, 2, 2, 64, torch.bfloat16)
    # window (0, 0) with bottom-right alignment: query i sees only key i - 10, so rows 0..9 see nothing.
    out, lse, _ = torch.ops.flash_attn.fwd(q, k, v, None, None, 0, 0, 0.0, 0.125, 0, 0, True, 0.0, None, None,
                                            None, False)
    assert not torch.isnan(out).any()
    assert out[:, :10].float().abs().max() == 0
    assert torch.isinf(lse[:, :, :10]).all() and (lse[:, :, :10] > 0).all()
    ref_out, ref_lse = attention_ref(*[x.double().cpu() for x in (q, k, v)], softmax_scale=0.125,
                                     window_size=(0, 0), compute_dtype=torch.float64)[:2]
    torch.testing.assert_close(lse[:, :, 10:].cpu().double(), ref_lse[:, :, 10:], atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(causal, dtype):
    _require(dtype, 64)
    seqlens_q, seqlens_k = [37, 0, 128, 1, 200], [53, 9, 128, 0, 70]
    q = randn(sum(seqlens_q), 4, 64, dtype=dtype, device="cuda")
    k = randn(sum(seqlens_k), 2, 64, dtype=dtype, device="cuda")
    v = randn(sum(seqlens_k), 2, 64, dtype=dtype, device="cuda")
    cu_q, cu_k = cu_from_seqlens(seqlens_q, "cuda"), cu_from_seqlens(seqlens_k, "cuda")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=causal)

    def ref(q, k, v, compute_dtype):
        return attention_varlen_ref(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), causal=causal,
                                    compute_dtype=compute_dtype)

    _check(out, ref, (q, k, v))


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa(mask_kind, is_causal):
    _require(torch.bfloat16, 64)
    q = randn(2, 4, 70, 64, dtype=torch.bfloat16, device="cuda")
    k = randn(2, 2, 90, 64, dtype=torch.bfloat16, device="cuda")
    v = randn(2, 2, 90, 64, dtype=torch.bfloat16, device="cuda")
    mask = None
    if not is_causal:
        mask = (torch.rand(1, 4, 70, 90, device="cuda") < 0.7) if mask_kind == "bool" else \
            randn(2, 1, 70, 90, dtype=torch.bfloat16, device="cuda")
        if mask_kind == "bool":
            mask[..., 0] = True
    out = flash_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    truth = torch.nn.functional.scaled_dot_product_attention(
        q.double(), kk.double(), vv.double(), attn_mask=None if mask is None else
        (mask if mask.dtype == torch.bool else mask.double()), is_causal=is_causal)
    naive = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=is_causal)
    assert_close_fa(out.cpu(), truth.cpu(), naive.cpu(), 2)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_mask_is_the_philox_mask(p):
    _require(torch.bfloat16, 64)
    q, k, v = _qkv(2, 77, 90, 4, 2, 64, torch.bfloat16)
    with CaptureRngState() as capture:
        out = flash_attn_func(q, k, v, dropout_p=p, causal=True)
    keep = dropout_keep_mask(capture.last(), 2, 4, 77, 90, p)

    def ref(q, k, v, compute_dtype):
        return attention_ref(q.cpu(), k.cpu(), v.cpu(), causal=True, dropout_mask=keep, dropout_p=p,
                             compute_dtype=compute_dtype)

    _check(out, ref, (q, k, v))


def test_backward_without_kernel_raises_clearly():
    _require(torch.bfloat16, 64)
    if flash_attn.is_supported("cuda", torch.bfloat16, 64):
        pytest.skip("a CUDA backward kernel is built")
    q, k, v = [x.requires_grad_() for x in _qkv(1, 16, 16, 2, 2, 64, torch.bfloat16)]
    out = flash_attn_func(q, k, v)
    with pytest.raises(RuntimeError, match="no CUDA kernel"):
        out.sum().backward()


# ---- tiles of GPUs with less shared memory (csrc/sm80/fwd_tile_config.h fwd_tile_kind) ----
# FLASH_ATTN_FWD_SMEM_LIMIT makes the forward assume at most this many bytes of shared memory per block (per SM,
# that plus 1 KB), so a Hopper GPU runs what an sm86/sm89 GPU (99 KB: the compact 4-warp tiles, the two-stage
# decode tile) or an A100 (163 KB) would; the split-KV planner assumes the same.
FWD_SMEM_LIMIT_ENV = "FLASH_ATTN_FWD_SMEM_LIMIT"
SM86_SMEM = 101376
A100_SMEM = 166912
COMPACT_FWD_MARKS = ("FwdTileKind)2", "FwdTileKind::kCompact", "FwdTileKindE2")
DECODE_COMPACT_FWD_MARKS = ("FwdTileKind)3", "FwdTileKind::kDecodeCompact", "FwdTileKindE3")


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("limit", [SM86_SMEM, A100_SMEM])
@pytest.mark.parametrize("causal", [False, True])
def test_smaller_gpu_tiles(head_dim, limit, causal, dtype, monkeypatch):
    _require(dtype, head_dim)
    monkeypatch.setenv(FWD_SMEM_LIMIT_ENV, str(limit))
    q, k, v = _qkv(2, 131, 1100, 4, 2, head_dim, dtype)
    out = flash_attn_func(q, k, v, causal=causal)
    _check(out, lambda *x, **kw: attention_ref(*x, causal=causal, **kw), (q, k, v))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("shape", [(1, 1, 5000, 8, 2), (3, 16, 777, 2, 2), (2, 1, 40, 4, 4)])
def test_smaller_gpu_decode_tiles(head_dim, shape, monkeypatch):
    """Decode-shaped calls (GQA packing, split-KV) under the sm86/sm89 limit: the two-stage decode tile."""
    _require(torch.bfloat16, head_dim)
    monkeypatch.setenv(FWD_SMEM_LIMIT_ENV, str(SM86_SMEM))
    b, sq, sk, h, hk = shape
    q, k, v = _qkv(b, sq, sk, h, hk, head_dim, torch.bfloat16)
    out = flash_attn_func(q, k, v)
    _check(out, lambda *x, **kw: attention_ref(*x, **kw), (q, k, v))


def _forward_kernel_names(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if "fwd_kernel" in event.name]


# Head dims up to 128 have no separate compact instantiation (their one-stage tiles fit 99 KB; only fewer CTAs per
# SM), so the 64-row tile is checked at head dim 256 and the two-stage decode tile at 128.
@pytest.mark.parametrize("head_dim,seqlen_q,marks", [(256, 256, COMPACT_FWD_MARKS), (128, 1, DECODE_COMPACT_FWD_MARKS)])
@pytest.mark.usefixtures("portable_kernels")
def test_smaller_gpu_tiles_selected(head_dim, seqlen_q, marks, monkeypatch):
    """The sm86/sm89 limit picks the compact tiles; without it a Hopper GPU takes the others (the portable kernels:
    the Hopper forward, which takes the first shape since it splits keys itself, has no compact tiles)."""
    _require(torch.bfloat16, head_dim)
    q, k, v = _qkv(1, seqlen_q, 512, 2, 2, head_dim, torch.bfloat16)
    monkeypatch.delenv(FWD_SMEM_LIMIT_ENV, raising=False)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if getattr(props, "shared_memory_per_block_optin", 0) >= 200 * 1024:
        names = _forward_kernel_names(lambda: flash_attn_func(q, k, v))
        assert names and not any(mark in name for name in names for mark in marks), names
    monkeypatch.setenv(FWD_SMEM_LIMIT_ENV, str(SM86_SMEM))
    names = _forward_kernel_names(lambda: flash_attn_func(q, k, v))
    assert names and all(any(mark in name for mark in marks) for name in names), names


@pytest.mark.parametrize("value", ["4096", "abc"])
@pytest.mark.usefixtures("portable_kernels")
def test_fwd_smem_limit_errors(value, monkeypatch):
    """A limit below every tile's need, or not a number, fails with a message naming the variable."""
    _require(torch.bfloat16, 64)
    monkeypatch.setenv(FWD_SMEM_LIMIT_ENV, value)
    q, k, v = _qkv(1, 64, 64, 2, 2, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match=FWD_SMEM_LIMIT_ENV):
        flash_attn_func(q, k, v)


# The persistent wide kernel (csrc/sm80/fwd_persistent_kernel.h): non-causal calls at head dims 160 and 256 with
# more work items (query tiles x heads x batch) than SMs, so CTAs load their next item during their last key tile.
# Ragged last key and query tiles, GQA; one key tile per item in the third shape (the prefetch follows its first S).
# The fourth shape's head dim is below its bucket (240 -> 256): every tile load has columns to zero-fill. On sm90 the
# head dim 256 bucket loads K and V by TMA at any key length (the last shape: 24 key tiles, a ragged last one).
PERSISTENT_SHAPES = [(4, 1000, 300, 8, 2, 256), (3, 700, 257, 12, 4, 160), (2, 130, 64, 160, 160, 256),
                     (4, 600, 200, 8, 4, 240), (4, 520, 1500, 8, 2, 256)]
WIDE_ROWS = 128  # query rows per work item of the wide tile (fwd_tile_config.h)
PERSISTENT_MAX_KEYS = 512  # longest key range that takes it with cp.async loads (fwd_tile_config.h kPersistentMaxKeys)
TMA_HEAD_DIM = 256  # the bucket whose persistent kernel loads K/V by TMA (fwd_persistent_loads_kv_by_tma), sm90+


def _persistent_items(b, sq, h):
    return b * -(-sq // WIDE_ROWS) * h


def _kernel_names(fn, part):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if part in event.name]


def _require_more_items_than_sms(items):
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if items <= sms:
        pytest.skip(f"{items} work items do not exceed this GPU's {sms} SMs")


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("shape", PERSISTENT_SHAPES)
def test_persistent_wide_tile(shape, dtype):
    b, sq, sk, h, hk, d = shape
    _require(dtype, d)
    _require_more_items_than_sms(_persistent_items(b, sq, h))
    q, k, v = _qkv(b, sq, sk, h, hk, d, dtype)
    out = flash_attn_func(q, k, v)
    _check(out, lambda *x, **kw: attention_ref(*x, **kw), (q, k, v))


def _require_persistent_smem():
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if getattr(props, "shared_memory_per_block_optin", 0) < 210 * 1024:
        pytest.skip("the persistent kernel needs 203 KB of shared memory per block")


@pytest.mark.parametrize("head_dim", [160, 256])
@pytest.mark.usefixtures("portable_kernels")
def test_persistent_wide_tile_selected(head_dim):
    """Taken for a large non-causal call; not for a causal one or one with fewer items than SMs. Past
    PERSISTENT_MAX_KEYS keys only where K/V arrive by TMA (head dim 256 on sm90+)."""
    b, sq, sk, h, hk, d = (4, 1000, 300, 8, 2, head_dim)
    _require(torch.bfloat16, d)
    _require_more_items_than_sms(_persistent_items(b, sq, h))
    _require_persistent_smem()
    q, k, v = _qkv(b, sq, sk, h, hk, d, torch.bfloat16)
    assert _kernel_names(lambda: flash_attn_func(q, k, v), "fwd_persistent_kernel")
    assert not _kernel_names(lambda: flash_attn_func(q, k, v, causal=True), "fwd_persistent_kernel")
    assert not _kernel_names(lambda: flash_attn_func(q[:1, :200], k[:1], v[:1]), "fwd_persistent_kernel")
    _, k_long, v_long = _qkv(b, sq, PERSISTENT_MAX_KEYS + 1, h, hk, d, torch.bfloat16)
    tma = head_dim == TMA_HEAD_DIM and _runs_sm90_code()
    assert bool(_kernel_names(lambda: flash_attn_func(q, k_long, v_long), "fwd_persistent_kernel")) == tma


@pytest.mark.parametrize("head_dim, mask", [(64, "none"), (64, "causal"), (64, "softcap"), (128, "none"),
                                             (128, "causal"), (128, "window"), (128, "causal window"),
                                             (128, "softcap causal")])
@pytest.mark.usefixtures("portable_kernels")
def test_one_item_tma_kernel(head_dim, mask):
    """The one-item kernel with K and V by TMA (sm90; fwd_tile_config.h fwd_loads_kv_by_tma): taken for dense calls,
    causal and windowed ones too (masked key tiles at both ends of the window) and the lean kernel's softcap calls,
    several key tiles with a ragged last one, GQA, seqlen_q != seqlen_k; varlen and seqused_k calls take the cp.async
    kernel. Both match the reference."""
    _require(torch.bfloat16, head_dim)
    if not _runs_sm90_code():
        pytest.skip("TMA loads need kernels compiled for sm90 (not compute_80 PTX)")
    kwargs = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(70, 90)),
              "causal window": dict(causal=True, window_size=(100, 0)), "softcap": dict(softcap=5.0),
              "softcap causal": dict(softcap=5.0, causal=True)}[mask]
    q, k, v = _qkv(2, 150, 333, 4, 2, head_dim, torch.bfloat16)
    call = lambda: flash_attn_func(q, k, v, **kwargs)
    assert _kernel_names(call, "fwd_tma_kernel")
    _check(call(), lambda *x, **kw: attention_ref(*x, **kwargs, **kw), (q, k, v))
    cu_q = torch.tensor([0, 150, 300], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 333, 666], dtype=torch.int32, device="cuda")
    varlen = lambda: flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 150, 333,
                                            **kwargs)
    assert not _kernel_names(varlen, "fwd_tma_kernel")
    torch.testing.assert_close(varlen().view_as(q), call(), atol=1e-2, rtol=1e-2)


def test_persistent_tma_packed_qkv():
    """K and V as slices of one packed (batch, seqlen, 3, heads, head dim) tensor: the TMA tensor maps take their
    strides as they are (no copy), and the result matches the reference."""
    b, s, h, d = 2, 1030, 16, TMA_HEAD_DIM
    _require(torch.bfloat16, d)
    _require_more_items_than_sms(_persistent_items(b, s, h))
    qkv = randn(b, s, 3, h, d, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(2)
    out = flash_attn.flash_attn_qkvpacked_func(qkv)
    _check(out, lambda *x, **kw: attention_ref(*x, **kw), (q, k, v))


@pytest.mark.parametrize("head_dim", [160, TMA_HEAD_DIM])
def test_persistent_tile_ignores_cache_rows_past_seqused(head_dim):
    """K/V cache rows past cache_seqlens hold NaN: the persistent kernel (cp.async at hd 160, which zero-fills them)
    and the one-item kernel that hd 256 calls with seqused_k take instead of the TMA one (whose zero fill stops only at
    the cache's end) never let them into the output, which equals the calls on each entry's used rows alone."""
    _require(torch.bfloat16, head_dim)
    lengths, seqlen_q, rows, nheads, nheads_k = [300, 1, 129, 64], 300, 320, 16, 4
    _require_more_items_than_sms(_persistent_items(len(lengths), seqlen_q, nheads))
    q = randn(len(lengths), seqlen_q, nheads, head_dim, dtype=torch.bfloat16, device="cuda")
    k_cache = randn(len(lengths), rows, nheads_k, head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = randn(len(lengths), rows, nheads_k, head_dim, dtype=torch.bfloat16, device="cuda")
    for i, n in enumerate(lengths):
        k_cache[i, n:] = float("nan")
        v_cache[i, n:] = float("nan")
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens)
    assert not torch.isnan(out).any()
    for i, n in enumerate(lengths):
        alone = flash_attn_func(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n])
        torch.testing.assert_close(out[i:i + 1], alone, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [160, TMA_HEAD_DIM])
def test_persistent_wide_tile_empty_key_ranges(head_dim):
    """seqused_k (cache lengths) of 0 leave items without keys between items with keys: those never prefetch the
    next item, and their rows are 0 with lse inf. Same values as the CPU path. (Head dim 256 with seqused_k takes
    the one-item kernel on sm90, where its persistent kernel loads by TMA.)"""
    _require(torch.bfloat16, head_dim)
    lengths = [0, 1, 300, 33, 0, 512]
    batch, seqlen_q, rows, nheads, nheads_k = len(lengths), 200, 512, 16, 4
    _require_more_items_than_sms(_persistent_items(batch, seqlen_q, nheads))
    check_kvcache_cuda_matches_cpu(lengths, seqlen_q, rows, nheads, nheads_k, head_dim)
