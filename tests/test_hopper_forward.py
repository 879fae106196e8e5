# The Hopper forward path (csrc/sm90/, sm_90a: TMA, wgmma, warp specialisation) against the fp64 reference under the
# FlashAttention rule, with FLASH_ATTN_HOPPER=force so that a call the path does not take fails instead of passing on
# the portable kernels: each built head-dim bucket and head dims below it (32, 96, 160 and 224 store the next whole
# 64-column segment count and run the S GEMM over their own columns), odd sequence lengths both ways, causal
# (bottom-right and top-left through SDPA), sliding windows, GQA / MQA, packed (strided) qkv, rows that see no key,
# large scores, softcap and ALiBi (the general kernels), varlen with empty and ragged sequences, KV-cache lengths over
# NaN-filled cache tails, LSE, and the backward on the Hopper forward's output and LSE. Then the fallbacks: each feature
# the path does not serve runs on the portable kernels under FLASH_ATTN_HOPPER=1 and fails, naming the feature, under
# force. Collected where a Hopper GPU runs sm_90a code of a build with sm90 forward kernels.
import re

import pytest
import torch

import flash_attn
from flash_attn import flash_attn_func, flash_attn_with_kvcache
from flash_attn._native import C
from flash_attn.flash_attn_interface import _flash_attn_forward, _flash_attn_varlen_forward
from flash_attn.reference import attention_ref, attention_varlen_ref
from helpers import assert_close_fa, cuda_kernel_names, randn, reference_pair, varlen_tensors

HOPPER_ARCH = 90
SWITCH = "FLASH_ATTN_HOPPER"
DTYPES = [torch.bfloat16, torch.float16]
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _hopper_buckets():
    """(dtype name, head-dim bucket, mask) of every sm90 forward kernel in this build, where the GPU runs them."""
    if not torch.cuda.is_available() or C.loaded_code(torch.cuda.current_device())[0] < HOPPER_ARCH:
        return set()
    return {(k["dtype"], k["head_dim"], k["mask"]) for k in flash_attn.built_kernels()
            if k["device"] == "cuda" and k["arch"] == "sm90" and k["direction"] == "fwd"}


BUILT = _hopper_buckets()
pytestmark = pytest.mark.skipif(not BUILT, reason="needs a Hopper GPU and a build with sm90 forward kernels")


def _bucket(head_dim):
    """The Hopper bucket of a head dim (dispatch/sm90_policy.h sm90_head_dim_bucket)."""
    return next(b for b in (32, 64, 96, 128, 160, 192, 224, 256) if head_dim <= b)


def _require(dtype, head_dim, mask="none"):
    if (DTYPE_NAMES[dtype], _bucket(head_dim), mask) not in BUILT:
        pytest.skip(f"no sm90 forward kernel for {DTYPE_NAMES[dtype]} head dim {head_dim} mask {mask} in this build")


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv(SWITCH, "force")


def _qkv(b, sq, sk, h, hk, d, dtype, scale=1.0):
    q = randn(b, sq, h, d, dtype=torch.float32, device="cuda") * scale
    return (q.to(dtype), randn(b, sk, hk, d, dtype=dtype, device="cuda"), randn(b, sk, hk, d, dtype=dtype, device="cuda"))


def _check_forward(q, k, v, mult=2.0, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Output and LSE of the forward against the reference (LSE within the fp32 floor: it is computed in fp32)."""
    out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, None, causal, window_size[0], window_size[1], softcap,
                                         alibi_slopes)
    features = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    truth, naive = reference_pair(lambda *x, **kw: attention_ref(*x, **features, **kw), (q, k, v))
    _check_out_lse(out, lse, truth, naive, mult)
    return out


def _check_out_lse(out, lse, truth, naive, mult):
    assert_close_fa(out.cpu(), truth[0].cpu(), naive[0].cpu(), mult)
    empty = torch.isinf(truth[1].cpu())
    assert torch.equal(torch.isinf(lse.cpu()) & (lse.cpu() > 0), empty), "LSE +inf exactly where a row sees no key"
    assert_close_fa(lse.cpu()[~empty], truth[1].cpu()[~empty], naive[1].cpu()[~empty].float(), mult,
                    floor_dtype=torch.float32)


def _check_varlen(seqlens_q, seqlens_k, nheads, nheads_k, causal):
    """A varlen forward at hd 128 against the per-sequence reference."""
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, nheads, nheads_k, 128, torch.bfloat16, "cuda")
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), 0.0, None,
                                                causal, -1, -1)
    truth, naive = reference_pair(
        lambda *x, **kw: attention_varlen_ref(*x, cu_q.cpu(), cu_k.cpu(), causal=causal, **kw),
        (q.cpu(), k.cpu(), v.cpu()))
    _check_out_lse(out, lse, truth, naive, 2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [40, 64, 72, 96, 100, 128, 160, 176, 192, 224, 232, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(forced, head_dim, causal, dtype):
    _require(dtype, head_dim, "causal" if causal else "none")
    _check_forward(*_qkv(2, 113, 255, 4, 2, head_dim, dtype), causal=causal)


@pytest.mark.parametrize("seqlens", [(17, 1), (17, 1000), (1000, 17), (127, 129), (128, 128), (129, 127), (255, 640),
                                     (1000, 1000)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_seqlens(forced, seqlens, causal, head_dim):
    """Ragged last query and key tiles, several key tiles per query tile, and seqlen_q > seqlen_k causal (rows with no
    key: O = 0, LSE = +inf)."""
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    sq, sk = seqlens
    _check_forward(*_qkv(2, sq, sk, 2, 2, head_dim, torch.bfloat16), causal=causal)


@pytest.mark.parametrize("window", [(100, 37), (0, 0), (-1, 20), (300, -1), (5, 200)])
@pytest.mark.parametrize("seqlens", [(300, 517), (517, 300)])
def test_windows(forced, window, seqlens):
    _require(torch.bfloat16, 128, "local")
    sq, sk = seqlens
    _check_forward(*_qkv(2, sq, sk, 4, 4, 128, torch.bfloat16), window_size=window)


@pytest.mark.parametrize("heads", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(forced, heads, causal):
    _require(torch.bfloat16, 128, "causal" if causal else "none")
    h, hk = heads
    _check_forward(*_qkv(2, 333, 333, h, hk, 128, torch.bfloat16), causal=causal)


GQA_PACKED_FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(40, 7)),
    "softcap": dict(softcap=8.0),
}


@pytest.mark.parametrize("feature", list(GQA_PACKED_FEATURES))
@pytest.mark.parametrize("seqlen_q", [17, 40, 100, 333])
@pytest.mark.parametrize("heads", [(8, 2), (16, 2), (8, 1), (32, 1), (12, 4), (12, 2)])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_gqa_packed_rows(forced, head_dim, heads, seqlen_q, feature):
    """Query heads of one KV head packed into a tile's rows (dispatch/sm90_policy.h sm90_fwd_packed_heads: groups of
    2 ... 32 packed whole, a group of 6 in pairs, a group of 3 unpacked): each row's head and query position reach
    the masks and the O / LSE rows; ragged last tiles, and causal rows with no key (seqlen_q > seqlen_k)."""
    kwargs = GQA_PACKED_FEATURES[feature]
    mask = "causal" if kwargs.get("causal") else ("local" if "window_size" in kwargs else "none")
    _require(torch.bfloat16, head_dim, mask)
    h, hk = heads
    _check_forward(*_qkv(2, seqlen_q, 300, h, hk, head_dim, torch.bfloat16), **kwargs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [2, 5, 8, 16])
@pytest.mark.parametrize("heads", [(32, 1), (32, 4), (16, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gqa_packed_few_queries(monkeypatch, head_dim, heads, seqlen_q, causal):
    """Speculative-decoding shapes (2-16 queries, GQA packed): right on whichever path dispatch picks; under force,
    either the Hopper tile serves them (dispatch/sm90_policy.h kSm90PackedFewQueryRows: packed rows enough to take
    it) or the call is declined as decode-shaped, and nothing else."""
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    h, hk = heads
    q, k, v = _qkv(2, seqlen_q, 517, h, hk, head_dim, torch.bfloat16)
    monkeypatch.setenv(SWITCH, "1")
    _check_forward(q, k, v, causal=causal)
    monkeypatch.setenv(SWITCH, "force")
    try:
        _check_forward(q, k, v, causal=causal)
    except RuntimeError as error:
        if "at most 16 query rows" not in str(error):
            raise
        pytest.skip(f"{seqlen_q} queries x {h // hk} heads per KV head stay on the decode kernels")


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("seqlen_q", [2, 4, 16])
def test_paged_few_queries_equal_contiguous(forced, seqlen_q, page_size):
    """Speculative steps (packed heads, causal, 2 key splits) over pages read in place by the Hopper tile: bitwise the
    call over the contiguous cache, with ragged lengths that cross pages."""
    _require(torch.bfloat16, 128, "causal")
    batch, rows, nheads, nheads_k = 3, 768, 16, 4
    lengths = torch.tensor([rows, 1, rows // 2 + 3], dtype=torch.int32, device="cuda")
    q = randn(batch, seqlen_q, nheads, 128, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = (randn(batch, rows, nheads_k, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    pages = rows // page_size
    table = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(page_size)).view(batch, pages)
    k_pool, v_pool = (torch.empty(batch * pages, page_size, nheads_k, 128, dtype=torch.bfloat16, device="cuda")
                      for _ in range(2))
    k_pool[table.view(-1)] = k_cache.reshape(-1, page_size, nheads_k, 128)
    v_pool[table.view(-1)] = v_cache.reshape(-1, page_size, nheads_k, 128)
    kwargs = dict(cache_seqlens=lengths, causal=True, num_splits=2, return_softmax_lse=True)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    paged_out, paged_lse = flash_attn_with_kvcache(q, k_pool, v_pool, block_table=table.to("cuda", torch.int32),
                                                   **kwargs)
    assert torch.equal(out, paged_out) and torch.equal(lse, paged_lse)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens_q", [[30, 1, 77, 5, 64], [3, 1, 16, 0, 9]])
def test_gqa_packed_varlen(forced, causal, seqlens_q):
    """Varlen sequences of few queries, 4 query heads a KV head packed: a packed Q box reads past a short sequence
    into the next one's rows, which must never reach O; at most 16 queries a sequence, a speculative step's varlen
    form (dispatch/sm90_policy.h kSm90PackedFewQueryRows)."""
    _require(torch.bfloat16, 128, "causal" if causal else "none")
    _check_varlen(seqlens_q, [300, 40, 700, 0, 64], 8, 2, causal)


def test_packed_qkv_strides(forced):
    """q, k, v as views of one (b, s, 3, h, d) tensor: row strides of 3 h d elements reach the tensor maps."""
    _require(torch.bfloat16, 128)
    qkv = randn(2, 300, 3, 4, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    _check_forward(q, k, v)


def test_large_scores(forced):
    """Scores near +-1e4 (q scaled by 40): the running max and its rescale must neither overflow nor lose rows."""
    _require(torch.bfloat16, 128, "causal")
    _check_forward(*_qkv(1, 400, 400, 2, 2, 128, torch.bfloat16, scale=40.0), causal=True)


def test_sdpa_top_left_causal(forced):
    """torch SDPA's is_causal is top-left: bottom_right false reaches the kernel's mask offset."""
    _require(torch.bfloat16, 128, "causal")
    q, k, v = (x.transpose(1, 2) for x in _qkv(2, 200, 333, 4, 4, 128, torch.bfloat16))
    out = flash_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    naive = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert_close_fa(out.cpu(), want.cpu(), naive.to(q.dtype).cpu(), 2.0)


@pytest.mark.parametrize("feature", ["softcap", "alibi", "both"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 224, 256])
def test_softcap_and_alibi(forced, feature, causal, head_dim):
    """The general kernels: softcap on the scaled scores, ALiBi by distance from the diagonal, per (batch, head)
    slopes."""
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    q, k, v = _qkv(2, 213, 300, 4, 2, head_dim, torch.bfloat16, scale=3.0)
    softcap = 15.0 if feature in ("softcap", "both") else 0.0
    alibi = torch.rand(2, 4, device="cuda") * 0.3 if feature in ("alibi", "both") else None
    _check_forward(q, k, v, causal=causal, softcap=softcap, alibi_slopes=alibi)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (64, 16)])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192])
def test_varlen(forced, causal, window, head_dim):
    """Packed sequences of ragged lengths, one empty on each side and one longer than a tile on both, seqlen_q !=
    seqlen_k within a sequence: rows past a sequence's end belong to the next one and must not leak into it."""
    if window != (-1, -1) and causal:
        pytest.skip("a window with right 16 is not causal")
    mask = "local" if window != (-1, -1) else "causal" if causal else "none"
    _require(torch.bfloat16, head_dim, mask)
    seqlens_q, seqlens_k = [129, 0, 17, 300, 5], [200, 9, 0, 333, 128]
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, 4, 2, head_dim, torch.bfloat16, "cuda")
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), 0.0, None,
                                                causal, window[0], window[1])
    truth, naive = reference_pair(
        lambda *x, **kw: attention_varlen_ref(*x, cu_q.cpu(), cu_k.cpu(), causal=causal, window_size=window, **kw),
        (q.cpu(), k.cpu(), v.cpu()))
    _check_out_lse(out, lse, truth, naive, 2.0)


@pytest.mark.parametrize("seqlens", [(300, 517), (517, 300), (129, 1000)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 224, 256])
def test_persistent_ctas_walk_many_tiles(forced, seqlens, causal, head_dim):
    """More tiles than SMs, so a persistent CTA walks several: each tile's last P.V and epilogue run in the next
    tile's first key block (fwd_tile_config.h fwd_carries_tile_tail), Q alternates between two slots, and causal
    seqlen_q > seqlen_k puts tiles whose rows see no key between carried ones."""
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    sq, sk = seqlens
    _check_forward(*_qkv(3, sq, sk, 48, 8, head_dim, torch.bfloat16), causal=causal)


@pytest.mark.parametrize("shift", [-129, -64, -63, -1, 0, 1, 63, 64, 65, 191])
@pytest.mark.parametrize("mask", ["causal", "local"])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_diagonal_alignments(forced, shift, mask, head_dim):
    """The diagonal shifted by seqlen_k - seqlen_q across every 64-row alignment of the consumers' rows against the
    128-key blocks (hd 64's 192-row tiles put a consumer's rows before, across or past a block's diagonal), with more
    tiles than SMs (carried tiles) and with fewer."""
    _require(torch.bfloat16, head_dim, mask)
    window = (-1, 0) if mask == "causal" else (90, 3)
    for batch, heads, sq in ((3, 16, 450), (1, 2, 1000)):
        sk = max(sq + shift, 1)
        _check_forward(*_qkv(batch, sq, sk, heads, heads // 2, head_dim, torch.bfloat16), causal=mask == "causal",
                       window_size=window if mask == "local" else (-1, -1))


@pytest.mark.parametrize("feature", ["window", "softcap", "alibi"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192])
def test_persistent_ctas_walk_many_tiles_with_features(forced, feature, head_dim):
    """The carrying kernel's local-mask and general (softcap / ALiBi) forms over more tiles than SMs."""
    mask = "local" if feature == "window" else "none"
    _require(torch.bfloat16, head_dim, mask)
    q, k, v = _qkv(3, 300, 517, 48, 8, head_dim, torch.bfloat16, scale=3.0)
    _check_forward(q, k, v, window_size=(100, 37) if feature == "window" else (-1, -1),
                   softcap=15.0 if feature == "softcap" else 0.0,
                   alibi_slopes=torch.rand(3, 48, device="cuda") * 0.3 if feature == "alibi" else None)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_varlen_many_sequences(forced, causal, head_dim):
    """Many ragged sequences (empty ones among them) over 16 heads: more tiles than SMs, walked by persistent CTAs."""
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    seqlens_q = [(37 * i) % 301 for i in range(48)]
    seqlens_k = [(53 * i + 11) % 389 for i in range(48)]
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, 16, 4, head_dim, torch.bfloat16, "cuda")
    out, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), 0.0, None,
                                                causal, -1, -1)
    truth, naive = reference_pair(
        lambda *x, **kw: attention_varlen_ref(*x, cu_q.cpu(), cu_k.cpu(), causal=causal, **kw),
        (q.cpu(), k.cpu(), v.cpu()))
    _check_out_lse(out, lse, truth, naive, 2.0)


def test_returned_probabilities(forced):
    """return_attn_probs=True: the probabilities kernel recomputes P from q, k and the Hopper forward's LSE."""
    _require(torch.bfloat16, 128, "causal")
    q, k, v = _qkv(2, 150, 190, 4, 2, 128, torch.bfloat16)
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    truth = attention_ref(q.double(), k.double(), v.double(), causal=True, compute_dtype=torch.float64,
                          return_probs=True)
    naive = attention_ref(q, k, v, causal=True, compute_dtype=torch.bfloat16, return_probs=True)
    assert_close_fa(out.cpu(), truth[0].cpu(), naive[0].cpu(), 2.0)
    assert_close_fa(probs.cpu(), truth[2].cpu(), naive[2].cpu(), 2.0)


def test_backward_on_hopper_forward(forced):
    """The portable backward reads the Hopper forward's output and LSE (same natural-log convention)."""
    _require(torch.bfloat16, 128, "causal")
    if not flash_attn.is_supported("cuda", torch.bfloat16, 128, backward=True):
        pytest.skip("no CUDA backward kernel for bf16 head dim 128 in this build")
    q, k, v = (x.requires_grad_() for x in _qkv(2, 257, 300, 4, 2, 128, torch.bfloat16))
    dout = randn(2, 257, 4, 128, dtype=torch.bfloat16, device="cuda")
    out = flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    truth, naive = reference_pair(lambda *x, **kw: attention_ref(*x, causal=True, **kw),
                                  tuple(x.detach() for x in (q, k, v)), dout)
    assert_close_fa(out.detach().cpu(), truth[0].cpu(), naive[0].cpu(), 2.0)
    for ours, exact, low in zip(grads, truth[2], naive[2]):
        assert_close_fa(ours.cpu(), exact.cpu(), low.cpu(), 3.0)


# KV-cache lengths (seqused_k) over 640 cache rows: empty, one key, ragged and whole last key blocks of 64 / 128 keys,
# and the full cache. Rows past a length hold NaN, which must never reach O.
KV_CACHE_ROWS = 640
KV_CACHE_LENGTHS = [0, 1, 77, 128, 129, 300, 640]
KV_CACHE_FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(50, -1)),
    "softcap": dict(softcap=8.0),
    "alibi": dict(alibi=True, causal=True),
}


def _kvcache_reference(q, k_cache, v_cache, lengths, **kwargs):
    """Each sequence on its own: its first lengths[b] cache rows, queries aligned to the end (bottom-right)."""
    def ref(q, k, v, compute_dtype):
        parts = [attention_ref(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], compute_dtype=compute_dtype, **kwargs)
                 for b, n in enumerate(lengths)]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
    return reference_pair(ref, (q, k_cache, v_cache))


@pytest.mark.parametrize("feature", list(KV_CACHE_FEATURES))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 224, 256])
@pytest.mark.parametrize("seqlen_q", [17, 200])
def test_kvcache_lengths(forced, seqlen_q, head_dim, feature):
    """flash_attn_with_kvcache with more than 16 query rows runs the Hopper forward with seqused_k: each sequence's
    keys end at its length (masks and ALiBi aligned there), and the NaN past it never reaches O (the kernel zeroes the
    V rows of the last key block past the length)."""
    kwargs = dict(KV_CACHE_FEATURES[feature])
    mask = "causal" if kwargs.get("causal") and "window_size" not in kwargs else (
        "local" if "window_size" in kwargs else "none")
    _require(torch.bfloat16, head_dim, mask)
    batch, nheads, nheads_k = len(KV_CACHE_LENGTHS), 8, 2
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(nheads, device="cuda") * 0.3 + 0.01
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = (randn(batch, KV_CACHE_ROWS, nheads_k, head_dim, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))
    for b, n in enumerate(KV_CACHE_LENGTHS):
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    lengths = torch.tensor(KV_CACHE_LENGTHS, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, return_softmax_lse=True, **kwargs)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    truth, naive = _kvcache_reference(q, k_cache, v_cache, KV_CACHE_LENGTHS, **kwargs)
    _check_out_lse(out, lse, truth, naive, 2.0)


@pytest.mark.parametrize("seqlen_q", [40, 150, 300])
@pytest.mark.parametrize("page_size", [16, 48, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 224, 256])
def test_kvcache_pages(forced, page_size, causal, head_dim, seqlen_q):
    """A paged cache (block_table over a shuffled pool with spare pages) and 40 queries per sequence of 2 packed heads
    (one query tile per KV head, a split plan of 20 query tiles), 150 (2-3 tiles: pages of 64 still in place) or 300
    (several tiles a KV head): the pages read in place where they fit the key blocks and the call
    (dispatch/sm90_policy.cpp fwd_pages_fit_call), else a gathered copy; NaN in every row no sequence uses, spare
    pages included."""
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    lengths, nheads, nheads_k = [0, 1, 77, 300, 640], 4, 2
    pages_per_seq = -(-KV_CACHE_ROWS // page_size)
    rows = pages_per_seq * page_size
    spare = 3
    dense_k, dense_v = (randn(len(lengths), rows, nheads_k, head_dim, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))
    for b, n in enumerate(lengths):
        dense_k[b, n:] = float("nan")
        dense_v[b, n:] = float("nan")
    generator = torch.Generator().manual_seed(page_size + head_dim)
    order = torch.randperm(len(lengths) * pages_per_seq + spare, generator=generator)
    table = order[:len(lengths) * pages_per_seq].view(len(lengths), pages_per_seq).to("cuda", torch.int32)
    k_pages, v_pages = (torch.full((order.numel(), page_size, nheads_k, head_dim), float("nan"), dtype=torch.bfloat16,
                                   device="cuda") for _ in range(2))
    k_pages[table.view(-1).long()] = dense_k.reshape(-1, page_size, nheads_k, head_dim)
    v_pages[table.view(-1).long()] = dense_v.reshape(-1, page_size, nheads_k, head_dim)
    q = randn(len(lengths), seqlen_q, nheads, head_dim, dtype=torch.bfloat16, device="cuda")
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=cache_seqlens, block_table=table,
                                       causal=causal, return_softmax_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    truth, naive = _kvcache_reference(q, dense_k, dense_v, lengths, causal=causal)
    _check_out_lse(out, lse, truth, naive, 2.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_append_then_lengths(forced, dtype):
    """New rows appended in the call (the append op first, then the Hopper forward over lengths + new rows), causal,
    with NaN past every sequence's new end."""
    _require(dtype, 128, "causal")
    lengths, new_rows, nheads, nheads_k = [0, 40, 300, 600], 33, 8, 4
    q = randn(len(lengths), new_rows, nheads, 128, dtype=dtype, device="cuda")
    k_cache, v_cache = (randn(len(lengths), KV_CACHE_ROWS, nheads_k, 128, dtype=dtype, device="cuda")
                        for _ in range(2))
    k_new, v_new = (randn(len(lengths), new_rows, nheads_k, 128, dtype=dtype, device="cuda") for _ in range(2))
    for b, n in enumerate(lengths):
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens, causal=True,
                                       return_softmax_lse=True)
    used = [n + new_rows for n in lengths]
    for b, n in enumerate(lengths):
        assert torch.equal(k_cache[b, n:n + new_rows], k_new[b]) and torch.equal(v_cache[b, n:n + new_rows], v_new[b])
    truth, naive = _kvcache_reference(q, k_cache, v_cache, used, causal=True)
    _check_out_lse(out, lse, truth, naive, 2.0)


@pytest.mark.parametrize("feature", list(KV_CACHE_FEATURES))
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
def test_key_splits_chosen(forced, head_dim, feature):
    """Few query tiles over many keys: the Hopper plan splits the keys (sm90_fwd_num_splits; 2 x 2 heads x 1 tile over
    5000 keys) and the combine kernel merges the fp32 partials; causal rows with no key stay O = 0, LSE = +inf."""
    kwargs = dict(KV_CACHE_FEATURES[feature])
    mask = "causal" if kwargs.get("causal") and "window_size" not in kwargs else (
        "local" if "window_size" in kwargs else "none")
    _require(torch.bfloat16, head_dim, mask)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(2, 2, device="cuda") * 0.3 + 0.01
    q, k, v = _qkv(2, 100, 5000, 2, 2, head_dim, torch.bfloat16)
    _check_forward(q, k, v, **kwargs)


@pytest.mark.parametrize("num_splits", [2, 3, 7, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_key_splits_asked_over_kvcache(forced, num_splits, causal):
    """num_splits as asked, over KV-cache lengths from 0 to the full cache with NaN past them: splits past a
    sequence's keys, or more splits than key blocks, write empty partials the combine kernel weights 0."""
    _require(torch.bfloat16, 128, "causal" if causal else "none")
    batch, nheads, nheads_k = len(KV_CACHE_LENGTHS), 4, 2
    q = randn(batch, 40, nheads, 128, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache = (randn(batch, KV_CACHE_ROWS, nheads_k, 128, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))
    for b, n in enumerate(KV_CACHE_LENGTHS):
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    lengths = torch.tensor(KV_CACHE_LENGTHS, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=causal,
                                       num_splits=num_splits, return_softmax_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    truth, naive = _kvcache_reference(q, k_cache, v_cache, KV_CACHE_LENGTHS, causal=causal)
    _check_out_lse(out, lse, truth, naive, 2.0)


@pytest.mark.parametrize("causal", [False, True])
def test_key_splits_varlen(forced, causal):
    """Varlen sequences of few queries over many keys (the plan splits them), one of them without keys."""
    _require(torch.bfloat16, 128, "causal" if causal else "none")
    seqlens_q, seqlens_k = [30, 1, 77, 5], [3000, 0, 4100, 700]
    _check_varlen(seqlens_q, seqlens_k, 4, 2, causal)


def _dense_call(seqlen_q=200, **kwargs):
    q, k, v = _qkv(2, seqlen_q, 200, 4, 4, 128, torch.bfloat16)
    return lambda: flash_attn_func(q, k, v, **kwargs)


def _sdpa_mask_call():
    q, k, v = (randn(2, 4, 200, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    mask = randn(2, 4, 200, 200, dtype=torch.bfloat16, device="cuda")
    return lambda: flash_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _kvcache_mqa_decode_call():
    """One query per sequence over 32 query heads of one KV head: 32 packed rows, still a decode call."""
    q = randn(2, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    cache = randn(2, 512, 1, 128, dtype=torch.bfloat16, device="cuda")
    lengths = torch.tensor([100, 512], dtype=torch.int32, device="cuda")
    return lambda: flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, num_splits=1)


# Forward calls the Hopper path does not serve yet: feature (as its force error names it) -> a maker of the call.
FALLBACK_CALLS = {
    "decode": lambda: _dense_call(seqlen_q=1),
    "dropout": lambda: _dense_call(dropout_p=0.1),
    "attn_mask": lambda: _sdpa_mask_call(),
    "GQA group packed": _kvcache_mqa_decode_call,
}


@pytest.mark.parametrize("feature", list(FALLBACK_CALLS))
def test_fallback_runs_and_force_names_the_feature(monkeypatch, feature):
    """Under FLASH_ATTN_HOPPER=1 a call the path does not serve runs (on the portable kernels); under force it fails
    with a message that names what the path lacks and how to let it run."""
    _require(torch.bfloat16, 128)
    call = FALLBACK_CALLS[feature]()
    monkeypatch.setenv(SWITCH, "1")
    out = call()
    assert torch.isfinite(out).all()
    monkeypatch.setenv(SWITCH, "force")
    with pytest.raises(RuntimeError, match=f"{SWITCH}=force.*(?i:{feature})"):
        call()


def test_switch_off_and_bad_value(monkeypatch):
    _require(torch.bfloat16, 128)
    q, k, v = _qkv(1, 100, 100, 2, 2, 128, torch.bfloat16)
    monkeypatch.setenv(SWITCH, "0")
    off = flash_attn_func(q, k, v)
    monkeypatch.setenv(SWITCH, "force")
    forced_out = flash_attn_func(q, k, v)
    assert (off.float() - forced_out.float()).abs().max().item() < 2e-2
    monkeypatch.setenv(SWITCH, "sometimes")
    with pytest.raises((RuntimeError, ValueError), match=SWITCH):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("causal,seqlen,hopper", [(False, 1024, True), (True, 1024, False), (True, 2048, True)])
def test_auto_takes_small_head_dims_where_they_pay(monkeypatch, causal, seqlen, hopper):
    """Under FLASH_ATTN_HOPPER=1 unmasked hd 32 calls of 512+ keys run the Hopper forward (the 32 bucket's three
    consumer warpgroups beat the portable kernel there), causal ones from 2k keys, shorter causal ones the portable
    kernel (sm90_policy.cpp sm90_fwd_pays)."""
    mask = "causal" if causal else "none"
    _require(torch.bfloat16, 32, mask)
    portable = {(k["arch"], k["head_dim"], k["mask"]) for k in flash_attn.built_kernels()
                if k["device"] == "cuda" and k["dtype"] == "bf16" and k["direction"] == "fwd"}
    if ("sm80", 32, mask) not in portable:
        pytest.skip("needs the portable bf16 hd 32 forward too (dispatch checks both paths)")
    # Enough query tiles that the plan does not split the keys (choose_fwd_num_splits): a split call runs the portable
    # kernels, whatever the head dim (1 x 4 heads x 1k did, in the twenty-ninth session's first run of this test).
    q, k, v = _qkv(4, seqlen, seqlen, 16, 16, 32, torch.bfloat16)
    monkeypatch.setenv(SWITCH, "1")
    call = lambda: flash_attn_func(q, k, v, causal=causal)
    call()
    names = cuda_kernel_names(call)
    assert any("sm90::" in name for name in names) == hopper, names


# Tall rows (csrc/sm90/fwd_tile_config.h kFwdTallTile; FLASH_ATTN_FWD_TALL_ROWS unset or 1, 0 turns them off): the
# hd 96 bucket on 192-row tiles of three consumer warpgroups from 4096 queries, a second instantiation beside the
# 128-row tile. Each case checks the tile the call launched (the kernel's template arguments) and the output and LSE
# against the reference: carried tiles (a CTA per SM), causal rows that see no key, softcap, hd 80 (below the
# bucket), GQA packed into the tall rows (4 heads of 48 queries a tile), key splits over few tiles, fp16, varlen
# picked by its longest sequence; 4095 queries, windows and the switch at 0 keep the 128-row tile; unset takes them.
TALL = "FLASH_ATTN_FWD_TALL_ROWS"
TALL_CASES = {
    "none": dict(shape=(2, 4096, 4096), tall=True),
    "causal_rows_without_keys": dict(shape=(1, 4133, 3000), causal=True, tall=True),
    "softcap": dict(shape=(1, 4100, 1000), softcap=20.0, tall=True),
    "hd80": dict(shape=(1, 4096, 2000), head_dim=80, tall=True),
    "gqa_packed": dict(shape=(1, 4096, 1500), heads=(8, 2), tall=True),
    "key_splits": dict(shape=(1, 4096, 40000), heads=(1, 1), tall=True),
    "fp16": dict(shape=(1, 4096, 700), dtype=torch.float16, causal=True, tall=True),
    "short": dict(shape=(2, 4095, 4095), tall=False),
    "window": dict(shape=(1, 5000, 5000), window=(300, 0), tall=False),
    "switch_unset": dict(shape=(1, 4096, 3000), causal=True, tall=True, switch=None),
    "switch_off": dict(shape=(1, 4096, 3000), causal=True, tall=False, switch="0"),
}
TALL_KERNEL = re.compile(r"fwd_kernel<[^>]*\b192, 112, 2\b")


def _launched_tile(call, kernel):
    """Whether `call` ran a Hopper forward kernel whose template arguments match `kernel` (a tile's pattern)."""
    call()
    names = [name for name in cuda_kernel_names(call) if "sm90::fwd_kernel" in name]
    assert names, "no Hopper forward kernel ran"
    return any(kernel.search(name) for name in names)


def _launched_tall(call):
    return _launched_tile(call, TALL_KERNEL)


@pytest.mark.parametrize("case", list(TALL_CASES))
def test_tall_rows(forced, monkeypatch, case):
    spec = TALL_CASES[case]
    dtype, head_dim = spec.get("dtype", torch.bfloat16), spec.get("head_dim", 96)
    causal, window = spec.get("causal", False), spec.get("window", (-1, -1))
    _require(dtype, head_dim, "local" if window != (-1, -1) else "causal" if causal else "none")
    switch = spec.get("switch", "1")
    if switch is None:
        monkeypatch.delenv(TALL, raising=False)
    else:
        monkeypatch.setenv(TALL, switch)
    batch, seqlen_q, seqlen_k = spec["shape"]
    h, hk = spec.get("heads", (4, 4))
    q, k, v = _qkv(batch, seqlen_q, seqlen_k, h, hk, head_dim, dtype)
    softcap = spec.get("softcap", 0.0)
    assert _launched_tall(lambda: flash_attn_func(q, k, v, causal=causal, window_size=window,
                                                  softcap=softcap)) == spec["tall"]
    _check_forward(q, k, v, causal=causal, window_size=window, softcap=softcap)


def test_tall_rows_varlen(forced, monkeypatch):
    _require(torch.bfloat16, 96, "causal")
    monkeypatch.setenv(TALL, "1")
    seqlens_q, seqlens_k = [4500, 0, 300, 1, 4096], [4000, 50, 300, 0, 4200]
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, 4, 2, 96, torch.bfloat16, "cuda")
    call = lambda: _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), 0.0, None, True,
                                              -1, -1)
    assert _launched_tall(call)
    out, lse, _, _ = call()
    truth, naive = reference_pair(
        lambda *x, **kw: attention_varlen_ref(*x, cu_q.cpu(), cu_k.cpu(), causal=True, **kw),
        (q.cpu(), k.cpu(), v.cpu()))
    _check_out_lse(out, lse, truth, naive, 2.0)
