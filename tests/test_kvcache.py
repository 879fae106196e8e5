# flash_attn_with_kvcache (Dao-AILab's decoding API) against flash_attn.reference: per-sequence cache
# lengths, in-place append of new keys/values, causal / window alignment to each sequence's end, GQA, ALiBi,
# softcap, cache_batch_idx, return_softmax_lse; unsupported options raise NotImplementedError. The native
# (seqused_k) path: empty to full sequences, GQA decode, split-KV, CUDA-graph capture, no bias built.
import pytest
import torch

import flash_attn
from flash_attn import flash_attn_with_kvcache
from flash_attn.reference import attention_ref
from helpers import assert_close_fa, check_kvcache_cuda_matches_cpu, cuda_kernel_names, randn

CLUSTER_CODE_ARCH = 90  # dispatch/fwd_plan.cpp: sm90 code merges split decode calls in clusters
MAX_CLUSTER_SPLITS = 2  # sm80/fwd_tile_config.h kMaxClusterSplits
KEY_WARPS_WAVE_CTAS = 80  # decode CTAs (sequences x kv heads) that take the key-warps tile on an H200 (67 ... 132)

# A forward-only API (no autograd in Dao's either), so CUDA runs wherever a forward kernel is built. Inputs
# that need no grad take the native path (cache lengths as the op's seqused_k); q requiring grad the bias path.
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


def test_kvcache_append_needs_cache_seqlens():
    q, k_cache, v_cache = randn(1, 1, 2, 16), randn(1, 8, 2, 16), randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, k_cache, v_cache, randn(1, 1, 2, 16), randn(1, 1, 2, 16))


# ---- the native path: cache lengths handed to the kernels as seqused_k ----

# Per-sequence lengths of a 4-entry batch over 48 cache rows: empty, short, mid and full (0 and cache_rows are
# the edge cases of the kernels' key range and of split-KV's empty partials).
NATIVE_ROWS = 48
NATIVE_LENGTHS = [0, 5, 29, NATIVE_ROWS]
NATIVE_FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(causal=True, window_size=(6, -1)),
    "softcap": dict(softcap=4.0),
    "alibi": dict(alibi="H", causal=True),
}


def _native_call(device, dtype, head_dim, seqlen_q, feature, append, nheads=8, nheads_k=2, lengths=None):
    """Runs flash_attn_with_kvcache (no input requires grad: the native path) and returns what _check needs.
    Cache rows past each sequence's length hold NaN: the native path must never read them."""
    require_supported(device, dtype, head_dim)
    lengths = list(NATIVE_LENGTHS if lengths is None else lengths)
    batch = len(lengths)
    kwargs = dict(NATIVE_FEATURES[feature])
    if kwargs.pop("alibi", None):
        kwargs["alibi_slopes"] = torch.rand(nheads, device=device) * 0.5 + 0.05
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=device)
    k_cache = randn(batch, NATIVE_ROWS, nheads_k, head_dim, dtype=dtype, device=device)
    v_cache = randn(batch, NATIVE_ROWS, nheads_k, head_dim, dtype=dtype, device=device)
    new = dict()
    if append:
        lengths = [min(n, NATIVE_ROWS - seqlen_q) for n in lengths]
        new = dict(k=randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype, device=device),
                   v=randn(batch, seqlen_q, nheads_k, head_dim, dtype=dtype, device=device))
    for b, n in enumerate(lengths):
        k_cache[b, n + (seqlen_q if append else 0):] = float("nan")
        v_cache[b, n + (seqlen_q if append else 0):] = float("nan")
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, return_softmax_lse=True,
                                       **new, **kwargs)
    used = [n + (seqlen_q if append else 0) for n in lengths]
    return out, lse, q, k_cache, v_cache, used, kwargs


@pytest.mark.parametrize("feature", list(NATIVE_FEATURES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_q, append", [(1, False), (1, True), (3, False), (3, True)])
@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_native_matches_reference(device, seqlen_q, append, head_dim, feature):
    """GQA 8/2 (single-query decode packs the group on CUDA), lengths 0 ... cache_rows; no NaN anywhere."""
    out, lse, q, k_cache, v_cache, used, kwargs = _native_call(device, torch.bfloat16, head_dim, seqlen_q, feature,
                                                               append)
    assert not torch.isnan(lse).any()
    _check(out, lse, q, k_cache, v_cache, used, range(len(used)), **kwargs)
    empty = [b for b, n in enumerate(used) if n == 0]
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and bool((lse[empty] == float("inf")).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_kvcache_native_cuda_matches_cpu_split_decode(seqlen_q):
    """A long cache and a small grid: the CUDA call splits the keys (split-KV) and the short / empty sequences
    leave whole splits without a key. Same values as the CPU path."""
    require_supported("cuda", torch.bfloat16, 128)
    check_kvcache_cuda_matches_cpu([0, 1, 700, 4096], seqlen_q, rows=4096, nheads=8, nheads_k=2, head_dim=128,
                                   causal=True)


def _splits_meet_in_cluster(num_splits):
    """Whether a small-batch split decode call (the one-warp decode tile) merges its splits in a thread-block cluster
    instead of the combine kernel (dispatch/fwd_plan.cpp fwd_splits_meet_in_cluster): sm90 code and 2 splits."""
    from flash_attn._native import C
    return C.loaded_code(torch.cuda.current_device())[0] >= CLUSTER_CODE_ARCH and num_splits == MAX_CLUSTER_SPLITS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8, 9, 16, 200])
def test_kvcache_num_splits_honoured(num_splits):
    """num_splits as Dao's: 1 never splits, n > 1 splits the keys n ways (at most 128; splits past a short sequence's
    keys weigh nothing): every choice gives the CPU path's values, and the combine kernel runs exactly when the keys
    are split and the splits do not merge in a cluster (sm90, 2 splits)."""
    require_supported("cuda", torch.bfloat16, 128)
    check_kvcache_cuda_matches_cpu([0, 1, 700, 2048], 1, rows=2048, nheads=8, nheads_k=2, head_dim=128, causal=True,
                                   num_splits=num_splits)
    q = randn(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    cache = randn(2, 2048, 2, 128, dtype=torch.bfloat16, device="cuda")
    lengths = torch.tensor([700, 2048], dtype=torch.int32, device="cuda")

    def decode():
        return flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, num_splits=num_splits)

    decode()  # checks values once
    kernels = cuda_kernel_names(decode)
    combined = num_splits > 1 and not _splits_meet_in_cluster(num_splits)
    assert any("combine" in name for name in kernels) == combined, kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_kvcache_split_merge_kernel(num_splits):
    """Head dim 256, the one-warp decode tile: two splits merge in a thread-block cluster on sm90 (no combine kernel),
    others through the combine kernel; the CPU path's values either way."""
    require_supported("cuda", torch.bfloat16, 256)
    check_kvcache_cuda_matches_cpu([0, 1, 700, 2048], 1, rows=2048, nheads=8, nheads_k=2, head_dim=256, causal=True,
                                   num_splits=num_splits)
    q = randn(2, 1, 8, 256, dtype=torch.bfloat16, device="cuda")
    cache = randn(2, 2048, 2, 256, dtype=torch.bfloat16, device="cuda")
    lengths = torch.tensor([700, 2048], dtype=torch.int32, device="cuda")

    def decode():
        return flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, num_splits=num_splits)

    decode()  # checks values once
    kernels = cuda_kernel_names(decode)
    combined = num_splits > 1 and not _splits_meet_in_cluster(num_splits)
    assert any("combine" in name for name in kernels) == combined, kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("batch", [3, 20, 40])
@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_kvcache_decode_one_and_four_warp_tiles(batch, head_dim, num_splits):
    """Decode over 4 kv heads with 3 sequences (12 CTAs: the one-warp tile, split), 20 (80 CTAs, more than half the
    H200's SMs: the key-warps tile, four warps on their own key tiles merged in shared memory; with num_splits=3 its
    merged partials go through the combine kernel) and 40 (160: the one-warp tile), GQA packed, lengths from empty to
    full and not multiples of a key tile: the CPU path's values."""
    require_supported("cuda", torch.bfloat16, head_dim)
    lengths = [(i * 389) % 1501 for i in range(batch)]
    lengths[0], lengths[-1] = 0, 1500
    check_kvcache_cuda_matches_cpu(lengths, 1, rows=1500, nheads=16, nheads_k=4, head_dim=head_dim, causal=True,
                                   num_splits=num_splits)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_splits", [2, 3, 5, 8])
@pytest.mark.parametrize("head_dim,seqlen_q,nheads,nheads_k", [(64, 1, 8, 2), (128, 3, 4, 4), (256, 1, 4, 1),
                                                              (72, 2, 6, 3)])
def test_kvcache_split_decode_every_split_count(num_splits, head_dim, seqlen_q, nheads, nheads_k):
    """Split decode at every cluster size (sm90: the splits merge through distributed shared memory; elsewhere the
    combine kernel): GQA packed and not, several query rows, a head dim below its bucket, an empty sequence (every
    split empty: O = 0, lse +inf), a one-key one and lengths that leave the last splits without keys. Same values as
    the CPU path."""
    require_supported("cuda", torch.bfloat16, head_dim)
    check_kvcache_cuda_matches_cpu([0, 1, 77, 333, 1000], seqlen_q, rows=1000, nheads=nheads, nheads_k=nheads_k,
                                   head_dim=head_dim, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_decode_passes_lengths_through(device, monkeypatch):
    """A decode step with int32 cache_seqlens on q's device and nothing appended hands cache_seqlens itself to the op
    as seqused_k (no conversion launched); int64 lengths go through the conversion; appends run in one op
    (kvcache_decode_), not through attention(), and agree with a plain call over the appended cache."""
    import flash_attn.kvcache as kvcache

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    require_supported(device, dtype, 64)
    seen = []
    attention = kvcache.attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("seqused_k"))
        return attention(*args, **kwargs)

    monkeypatch.setattr(kvcache, "attention", spy)
    q = randn(3, 1, 4, 64, dtype=dtype, device=device)
    k_cache, v_cache = randn(3, 40, 2, 64, dtype=dtype, device=device), randn(3, 40, 2, 64, dtype=dtype, device=device)
    lengths = torch.tensor([0, 17, 40], dtype=torch.int32, device=device)
    direct = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    assert seen[-1] is lengths
    converted = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths.long(), causal=True)
    assert seen[-1] is not lengths and seen[-1].dtype == torch.int32
    assert torch.equal(direct, converted)
    k_new, v_new = randn(3, 1, 2, 64, dtype=dtype, device=device), randn(3, 1, 2, 64, dtype=dtype, device=device)
    short = torch.tensor([0, 17, 39], dtype=torch.int32, device=device)
    appended = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=short, causal=True)
    assert len(seen) == 2
    after = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=short + 1, causal=True)
    torch.testing.assert_close(appended.float(), after.float(), atol=1e-2, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kvcache_decode_launches_only_attention():
    """The decode step of a contiguous cache with int32 lengths launches no elementwise kernel (length conversions,
    aranges) around the attention kernel: issue 21's 29 us against flash_attn_func's 20.7 us came from those."""
    require_supported("cuda", torch.bfloat16, 128)
    q = randn(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    cache = randn(2, 1024, 2, 128, dtype=torch.bfloat16, device="cuda")
    lengths = torch.tensor([700, 1024], dtype=torch.int32, device="cuda")

    def decode():
        return flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, num_splits=1)

    decode()  # checks values once
    kernels = cuda_kernel_names(decode)
    assert kernels and not any("elementwise" in name or "arange" in name for name in kernels), kernels


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_num_splits_checked_and_neutral(device):
    """num_splits must be an int >= 0; on CPU, where nothing splits, every value gives the same result."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = randn(2, 1, 4, 64, dtype=dtype, device=device)
    cache = randn(2, 64, 2, 64, dtype=dtype, device=device)
    lengths = torch.tensor([10, 64], dtype=torch.int32, device=device)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="num_splits"):
            flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, num_splits=bad)
    if device == "cpu":
        base = flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths)
        for num_splits in (1, 4):
            assert torch.equal(flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lengths, num_splits=num_splits),
                               base)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_native_allocates_no_bias(device, monkeypatch):
    """No input requires grad: the lengths reach the op as seqused_k, and no bias tensor is built."""
    import flash_attn.kvcache as kvcache

    def refuse(*args, **kwargs):
        raise AssertionError("the native path built a bias")

    monkeypatch.setattr(kvcache, "_bias", refuse)
    out, lse, q, k_cache, v_cache, used, kwargs = _native_call(device, torch.bfloat16, 64, 1, "causal", True)
    _check(out, lse, q, k_cache, v_cache, used, range(len(used)), **kwargs)


def test_kvcache_grad_falls_back_to_bias():
    """q requiring grad takes the bias path (seqused_k has no backward), and gradients flow."""
    q = randn(2, 2, 4, 16, requires_grad=True)
    k_cache, v_cache = randn(2, 10, 2, 16), randn(2, 10, 2, 16)
    lengths = [3, 10]
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths), causal=True)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with torch.no_grad():
        native = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths), causal=True)
    torch.testing.assert_close(out.detach(), native)


def test_fwd_op_seqused_k_rejections():
    q, k, v = randn(2, 1, 2, 16), randn(2, 6, 2, 16), randn(2, 6, 2, 16)
    args = (None, None, 0, 0, 0.0, 0.25, -1, -1, True, 0.0, None, None, None, False, False)
    with pytest.raises(RuntimeError, match=r"seqused_k\[1\] must be in \[0, seqlen_k = 6\]"):
        torch.ops.flash_attn.fwd(q, k, v, *args, torch.tensor([2, 7], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="seqused_k must have dtype torch.int32"):
        torch.ops.flash_attn.fwd(q, k, v, *args, torch.tensor([2, 3]))
    with pytest.raises(NotImplementedError, match="seqused_k has no backward"):
        flash_attn.ops.fwd(q.requires_grad_(), k, v, *args, torch.tensor([2, 3], dtype=torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fwd_op_seqused_k_clamped_on_cuda():
    """CUDA never reads seqused_k on the host: out-of-range values are clamped to [0, seqlen_k] by the kernel."""
    require_supported("cuda", torch.bfloat16, 64)
    q, k, v = (randn(2, s, 2, 64, dtype=torch.bfloat16, device="cuda") for s in (1, 6, 6))
    args = (None, None, 0, 0, 0.0, 0.125, -1, -1, True, 0.0, None, None, None, False, False)

    def call(lengths):
        return torch.ops.flash_attn.fwd(q, k, v, *args, torch.tensor(lengths, dtype=torch.int32, device="cuda"))

    wild, clamped = call([-3, 99]), call([0, 6])
    assert torch.equal(wild[0], clamped[0]) and torch.equal(wild[1], clamped[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kvcache_native_cuda_graph():
    """Decode step captured in a CUDA graph: the replay reads the new cache_seqlens from device memory."""
    require_supported("cuda", torch.bfloat16, 128)
    batch, rows, nheads, nheads_k, head_dim = 3, 256, 8, 2, 128
    q = randn(batch, 1, nheads, head_dim, dtype=torch.bfloat16, device="cuda")
    k_new = randn(batch, 1, nheads_k, head_dim, dtype=torch.bfloat16, device="cuda")
    v_new = randn(batch, 1, nheads_k, head_dim, dtype=torch.bfloat16, device="cuda")
    k_cache = randn(batch, rows, nheads_k, head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = randn(batch, rows, nheads_k, head_dim, dtype=torch.bfloat16, device="cuda")
    cache_seqlens = torch.tensor([10, 0, 200], dtype=torch.int32, device="cuda")

    def step():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens, causal=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    cache_seqlens.copy_(torch.tensor([100, 7, 255], dtype=torch.int32))
    q.copy_(randn(batch, 1, nheads, head_dim, dtype=torch.bfloat16, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = static_out.clone()
    assert torch.equal(replayed, step())


@pytest.mark.parametrize("name", ["rotary_cos", "rotary_sin"])
def test_kvcache_rotary_needs_both_tables(name):
    """rotary_cos / rotary_sin (tests/test_rotary.py) come as a pair."""
    q, k_cache, v_cache = randn(1, 1, 2, 16), randn(1, 8, 2, 16), randn(1, 8, 2, 16)
    k = randn(1, 1, 2, 16)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must be given together"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, k, cache_seqlens=4, **{name: torch.zeros(8, 8)})


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary", [False, True])
def test_kvcache_leftpad_equals_shifted_cache(rotary, causal, device):
    """cache_leftpad: sequence b's keys start at row cache_leftpad[b]. The same call over a cache with each
    sequence's rows moved to the front (and the lengths and rotary positions counted from there) gives the same
    output bitwise, and the appended rows land after each sequence's own rows."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    require_supported(device, dtype, 64)
    b, sq, new, rows, h, hk, d = 3, 2, 2, 40, 4, 2, 64
    q = randn(b, sq, h, d, dtype=dtype, device=device)
    k_new, v_new = (randn(b, new, hk, d, dtype=dtype, device=device) for _ in range(2))
    k_cache, v_cache = (randn(b, rows, hk, d, dtype=dtype, device=device) for _ in range(2))
    leftpad = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)
    seqlens = torch.tensor([9, 30, 25], dtype=torch.int32, device=device)
    angles = torch.rand(rows, 16) * 6.3
    tables = dict(rotary_cos=angles.cos().to(dtype).to(device), rotary_sin=angles.sin().to(dtype).to(device))
    extra = tables if rotary else {}
    shifted_k, shifted_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for i in range(b):
        pad, end = int(leftpad[i]), int(seqlens[i])
        shifted_k[i, :end - pad], shifted_v[i, :end - pad] = k_cache[i, pad:end], v_cache[i, pad:end]
    kc, vc = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                  causal=causal, **extra)
    expected = flash_attn_with_kvcache(q, shifted_k, shifted_v, k_new, v_new, cache_seqlens=seqlens - leftpad,
                                       causal=causal, **extra)
    assert torch.equal(out, expected)
    for i in range(b):
        pad, end = int(leftpad[i]), int(seqlens[i])
        assert torch.equal(kc[i, pad:end + new], shifted_k[i, :end - pad + new])
        assert torch.equal(vc[i, pad:end + new], shifted_v[i, :end - pad + new])


def test_kvcache_leftpad_refusals():
    q, cache = randn(2, 1, 2, 16), randn(2, 8, 2, 16)
    with pytest.raises(RuntimeError, match=r"cache_leftpad\[1\]=9 is outside \[0, 8\]"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=4, cache_leftpad=torch.tensor([0, 9]))
    with pytest.raises(NotImplementedError, match="cache_leftpad together with block_table"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=4, cache_leftpad=torch.tensor([0, 1]),
                                block_table=torch.zeros(2, 1, dtype=torch.int32))


# ---- the fused append (torch.ops.flash_attn.kvcache_append_) against the torch indexing the grad path keeps ----

APPEND_LAYOUTS = ["contiguous", "batch_idx", "leftpad", "paged"]


def _append_inputs(layout, new_rows, device, dtype):
    """A call's tensors for `layout`: 3 sequences of 7, 0 and 30 rows before the new ones, GQA 4/2, head dim 64."""
    batch, rows, nheads, nheads_k, head_dim = 3, 40, 4, 2, 64
    q = randn(batch, 2, nheads, head_dim, dtype=dtype, device=device)
    k_new, v_new = (randn(batch, new_rows, nheads_k, head_dim, dtype=dtype, device=device) for _ in range(2))
    lengths = torch.tensor([7, 0, 30], dtype=torch.int32, device=device)
    extra = {}
    entries = rows_of = batch
    if layout == "batch_idx":
        entries = 5
        extra["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int64, device=device)
    elif layout == "leftpad":
        extra["cache_leftpad"] = torch.tensor([3, 0, 10], dtype=torch.int32, device=device)
    elif layout == "paged":
        page_size = 7  # not a power of two: appends cross page boundaries
        pages_per_sequence = -(-rows // page_size)
        entries, rows_of = batch * pages_per_sequence + 2, page_size
        order = torch.randperm(entries, generator=torch.Generator().manual_seed(3))[:batch * pages_per_sequence]
        extra["block_table"] = order.view(batch, pages_per_sequence).to(torch.int32).to(device)
    shape = (entries, rows if layout != "paged" else rows_of, nheads_k, head_dim)
    k_cache, v_cache = (randn(*shape, dtype=dtype, device=device) for _ in range(2))
    return q, k_cache, v_cache, k_new, v_new, lengths, extra


# rotary case -> (rotary_dim, interleaved, causal): the fused kernel's 16-byte vectors (half-split and GPT-J pairs,
# queries per row when causal, at one position otherwise) and its element loop (rotary_dim 20 takes no vectors).
APPEND_ROTARY = {"none": None, "half": (32, False, True), "interleaved": (32, True, False), "odd": (20, False, False)}


@pytest.mark.parametrize("rotary", list(APPEND_ROTARY))
@pytest.mark.parametrize("new_rows", [1, 3])
@pytest.mark.parametrize("layout", APPEND_LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_fused_append_matches_indexing(layout, new_rows, rotary, device):
    """The same call without gradients (the fused append op, which also rotates q) and with q requiring grad (torch
    indexing and the rotary op, the bias path): equal caches (the new rows and every other row) and outputs within
    the kernels' rounding."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    require_supported(device, dtype, 64)
    q, k_cache, v_cache, k_new, v_new, lengths, extra = _append_inputs(layout, new_rows, device, dtype)
    causal = True
    if APPEND_ROTARY[rotary] is not None:
        rotary_dim, interleaved, causal = APPEND_ROTARY[rotary]
        angles = torch.rand(64, rotary_dim // 2) * 6.3
        extra.update(rotary_cos=angles.cos().to(dtype).to(device), rotary_sin=angles.sin().to(dtype).to(device),
                     rotary_interleaved=interleaved)
    fused_k, fused_v = k_cache.clone(), v_cache.clone()
    with torch.no_grad():
        fused = flash_attn_with_kvcache(q, fused_k, fused_v, k_new, v_new, cache_seqlens=lengths, causal=causal,
                                        **extra)
    indexed_k, indexed_v = k_cache.clone(), v_cache.clone()
    indexed = flash_attn_with_kvcache(q.clone().requires_grad_(), indexed_k, indexed_v, k_new, v_new,
                                      cache_seqlens=lengths, causal=causal, **extra)
    assert torch.equal(fused_v, indexed_v)
    if rotary != "none" and device == "cuda":
        torch.testing.assert_close(fused_k, indexed_k, atol=1e-2, rtol=0)
    else:
        assert torch.equal(fused_k, indexed_k)
    assert not torch.equal(fused_k, k_cache)  # the rows were written
    torch.testing.assert_close(fused, indexed.detach(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@pytest.mark.parametrize("rotary", list(APPEND_ROTARY))
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("new_rows", [1, 2])
@pytest.mark.parametrize("sequences", ["few", "wave"])
def test_kvcache_decode_append_in_kernel(sequences, new_rows, heads, page_size, num_splits, rotary):
    """One query per sequence with new rows appended, on CUDA: the append and the attention in one op
    (kvcache_decode_), the decode kernel writing the new rows and rotating its own queries where
    dispatch/fwd_plan.cpp lets it (kDecodeWritesAppendedRows; the append op before the attention otherwise). Lengths
    around the key-tile edges, contiguous and paged (whole blocks and rows of pages), GQA and MHA, forced and chosen
    splits (one new row: written by the split holding its tile; two: by the append kernel where a forced split plan
    may part them), few sequences (the one-warp tile) and a wave of 80 CTAs (the key-warps tile, whose warps part a
    CTA's keys like splits): the caches equal the gradient path's (torch indexing, the rotary op, a bias) and the
    outputs and lse agree within the kernels' rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    require_supported("cuda", torch.bfloat16, 128)
    dtype, head_dim, rows = torch.bfloat16, 128, 2048
    nheads, nheads_k = heads
    edges = [0, 1, 127, 128, 1001, rows - 2]
    batch = len(edges) if sequences == "few" else KEY_WARPS_WAVE_CTAS // nheads_k
    lengths = torch.tensor([edges[i % len(edges)] for i in range(batch)], dtype=torch.int32, device="cuda")
    q = randn(batch, 1, nheads, head_dim, dtype=dtype, device="cuda")
    k_new, v_new = (randn(batch, new_rows, nheads_k, head_dim, dtype=dtype, device="cuda") for _ in range(2))
    extra = {"num_splits": num_splits}
    if APPEND_ROTARY[rotary] is not None:
        rotary_dim, interleaved, _ = APPEND_ROTARY[rotary]
        angles = torch.rand(rows, rotary_dim // 2, generator=torch.Generator().manual_seed(5)) * 6.3
        extra.update(rotary_cos=angles.cos().to(dtype).cuda(), rotary_sin=angles.sin().to(dtype).cuda(),
                     rotary_interleaved=interleaved)
    if page_size is None:
        k_cache, v_cache = (randn(batch, rows, nheads_k, head_dim, dtype=dtype, device="cuda") for _ in range(2))
    else:
        per_sequence = rows // page_size
        order = torch.randperm(batch * per_sequence, generator=torch.Generator().manual_seed(7))
        extra["block_table"] = order.view(batch, per_sequence).to(torch.int32).cuda()
        k_cache, v_cache = (randn(batch * per_sequence, page_size, nheads_k, head_dim, dtype=dtype, device="cuda")
                            for _ in range(2))
    fused_k, fused_v = k_cache.clone(), v_cache.clone()
    with torch.no_grad():
        fused, fused_lse = flash_attn_with_kvcache(q, fused_k, fused_v, k_new, v_new, cache_seqlens=lengths,
                                                   return_softmax_lse=True, **extra)
    indexed_k, indexed_v = k_cache.clone(), v_cache.clone()
    indexed, indexed_lse = flash_attn_with_kvcache(q.clone().requires_grad_(), indexed_k, indexed_v, k_new, v_new,
                                                   cache_seqlens=lengths, return_softmax_lse=True, **extra)
    assert torch.equal(fused_v, indexed_v)
    torch.testing.assert_close(fused_k, indexed_k, atol=1e-2 if rotary != "none" else 0, rtol=0)
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, indexed.detach(), atol=2e-2, rtol=0)
    torch.testing.assert_close(fused_lse, indexed_lse.detach(), atol=1e-3, rtol=0)


def test_kvcache_append_op_clamps_indices():
    """Index values outside their ranges (which the Python entry point rejects, except under CUDA-graph capture)
    are clamped by the op: writes stay inside the caches and the key counts inside [0, cache rows]."""
    k_cache, v_cache = torch.zeros(2, 8, 1, 4), torch.zeros(2, 8, 1, 4)
    k, v = torch.ones(2, 2, 1, 4), torch.full((2, 2, 1, 4), 2.0)
    used, _ = torch.ops.flash_attn.kvcache_append_(k_cache, v_cache, k, v, torch.tensor([-5, 99]),
                                                   torch.tensor([7, -1]), None, None, None, None, False, None, False)
    assert used.tolist() == [2, 8]
    # Sequence 0 (length clamped to 0) went to entry 1 (7 clamped), rows 0-1; sequence 1 (99 -> 6) to entry 0, rows 6-7.
    assert k_cache[1, :2].eq(1).all() and k_cache[0, 6:].eq(1).all() and v_cache[0, 6:].eq(2).all()
    assert k_cache[1, 2:].eq(0).all() and k_cache[0, :6].eq(0).all()
    pool, pool_v = torch.zeros(3, 4, 1, 4), torch.zeros(3, 4, 1, 4)
    table = torch.tensor([[9, -2]], dtype=torch.int32)  # pages 2 and 0 after clamping
    used, _ = torch.ops.flash_attn.kvcache_append_(pool, pool_v, k[:1], v[:1], torch.tensor([3], dtype=torch.int32),
                                                   None, table, None, None, None, False, None, False)
    assert used.tolist() == [5]
    assert pool[2, 3].eq(1).all() and pool[0, 0].eq(1).all() and pool[1].eq(0).all()


def test_kvcache_decode_op_passes_opcheck():
    """kvcache_decode_ (the append and the attention in one op) on CPU, where it appends and then attends."""
    k_cache, v_cache = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    k, v = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    angles = torch.rand(12, 4)
    q = torch.randn(2, 1, 4, 16)
    for tables in ((None, None), (angles.cos(), angles.sin())):
        args = (q, k_cache, v_cache, k, v, torch.tensor([1, 5], dtype=torch.int32), None, *tables, True, 0.25, -1, 0,
                0.0, None, 0)
        torch.library.opcheck(torch.ops.flash_attn.kvcache_decode_.default, args)


def test_kvcache_append_op_passes_opcheck():
    k_cache, v_cache = torch.randn(3, 10, 2, 16), torch.randn(3, 10, 2, 16)
    k, v = torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
    angles = torch.rand(12, 4)
    q = torch.randn(2, 3, 4, 16)
    for rotated_q, per_row in ((None, False), (q, False), (q, True)):
        args = (k_cache, v_cache, k, v, torch.tensor([1, 5], dtype=torch.int32), torch.tensor([2, 0]), None, None,
                angles.cos(), angles.sin(), True, rotated_q, per_row)
        torch.library.opcheck(torch.ops.flash_attn.kvcache_append_.default, args)
    with pytest.raises(RuntimeError, match="rotary_cos and rotary_sin must be given together"):
        torch.ops.flash_attn.kvcache_append_(k_cache, v_cache, k, v, torch.tensor([1, 5]), torch.tensor([2, 0]), None,
                                             None, angles.cos(), None, False, None, False)
    with pytest.raises(RuntimeError, match="q is rotated here only with rotary_cos / rotary_sin"):
        torch.ops.flash_attn.kvcache_append_(k_cache, v_cache, k, v, torch.tensor([1, 5]), torch.tensor([2, 0]), None,
                                             None, None, None, False, q, False)
    with pytest.raises(RuntimeError, match="k must have the cache's heads and head dim"):
        torch.ops.flash_attn.kvcache_append_(k_cache, v_cache, k[..., :8], v[..., :8], torch.tensor([1, 5]), None,
                                             None, None, None, None, False, None, False)
