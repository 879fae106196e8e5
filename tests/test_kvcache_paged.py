# flash_attn_with_kvcache over a paged cache (block_table, any page size >= 1): the same outputs, softmax_lse and cache
# contents as over the contiguous cache the pages spell out, bitwise (the kernel sees the same keys), on CPU and CUDA;
# page sizes 1, 7 (not a power of two), 16, 64 and 256, lengths that are multiples of nothing, pages in shuffled order
# with unused blocks between them, GQA, appends crossing page boundaries, causal and windowed, rotary, decode over
# row-sized pages above head dim 128; bad block indices raise naming the argument.
import pytest
import torch

from flash_attn import flash_attn_with_kvcache
from helpers import cuda_kernel_names, randn, require_supported

HEAD_DIM = 64


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _require_forward(device):
    require_supported(device, _dtype(device), HEAD_DIM, backward=False)


def _paged(contiguous, page_size, spare_blocks, generator):
    """Scatters a contiguous cache (batch, rows, heads, dim) into shuffled pages of a larger pool; returns the pool
    and the block table."""
    batch, rows = contiguous.shape[:2]
    per_sequence = rows // page_size
    pool_blocks = batch * per_sequence + spare_blocks
    order = torch.randperm(pool_blocks, generator=generator)[:batch * per_sequence].view(batch, per_sequence)
    pool = torch.randn(pool_blocks, page_size, *contiguous.shape[2:], generator=generator).to(contiguous)
    pool[order.flatten()] = contiguous.reshape(batch * per_sequence, page_size, *contiguous.shape[2:])
    return pool, order.to(torch.int32).to(contiguous.device)


@pytest.mark.parametrize("page_size", [1, 7, 16, 64, 256])
@pytest.mark.parametrize("window", ["causal", "local", "none"])
def test_paged_equals_contiguous(page_size, window, device):
    _require_forward(device)
    dtype = _dtype(device)
    generator = torch.Generator().manual_seed(page_size)
    batch, seqlen_q, new, h, hk = 3, 2, 3, 4, 2
    rows = page_size * max(1, 300 // page_size)
    lengths = torch.tensor([rows - new, 5, rows // 3 + 1], dtype=torch.int32, device=device)
    q = randn(batch, seqlen_q, h, HEAD_DIM, dtype=dtype, device=device)
    k_new, v_new = (randn(batch, new, hk, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))
    k_cache, v_cache = (randn(batch, rows, hk, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))
    k_pool, table = _paged(k_cache, page_size, 5, generator)
    v_pool = torch.empty_like(k_pool)
    v_pool[table.long().flatten()] = v_cache.reshape(-1, page_size, hk, HEAD_DIM)
    kwargs = {"causal": dict(causal=True), "local": dict(window_size=(17, 0)), "none": {}}[window]
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                       return_softmax_lse=True, **kwargs)
    paged_out, paged_lse = flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lengths,
                                                   block_table=table, return_softmax_lse=True, **kwargs)
    assert torch.equal(out, paged_out) and torch.equal(lse, paged_lse)
    assert torch.equal(k_pool[table.long()].flatten(1, 2), k_cache)
    assert torch.equal(v_pool[table.long()].flatten(1, 2), v_cache)


WIDE_HEAD_DIMS = [160, 192, 224, 256]
DECODE_WAVE_CTAS = 80  # decode CTAs (sequences x kv heads) that take the key-warps tile on an H200, as in test_kvcache.py


@pytest.mark.parametrize("head_dim", WIDE_HEAD_DIMS)
@pytest.mark.parametrize("page_size", [16, 7])
@pytest.mark.parametrize("sequences", ["few", "wave"])
def test_decode_over_row_pages_wide_head_dims(head_dim, page_size, sequences):
    """Decode (one query row, GQA 8 / 2) over pages smaller than a key tile (loaded row by row) above head dim 128,
    where the row-paged loads unroll kPagedRowsUnrollWide copies at a time (csrc/sm80/fwd_kernel.h): the output and
    lse of the contiguous cache, for few sequences (split tiles) and a wave of them, lengths around the key-tile edges
    and one not a multiple of the page. Bitwise for few sequences; a wave of pages of 16 or more parts its keys
    differently from the contiguous call (1 ulp apart on the H200), so there within bf16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    require_supported("cuda", torch.bfloat16, head_dim, backward=False)
    dtype, h, hk = torch.bfloat16, 8, 2
    generator = torch.Generator().manual_seed(head_dim + page_size)
    rows = page_size * (1040 // page_size)
    edges = [0, 1, 63, 64, 129, 1001, rows - 1]
    batch = len(edges) if sequences == "few" else DECODE_WAVE_CTAS // hk
    lengths = torch.tensor([edges[i % len(edges)] for i in range(batch)], dtype=torch.int32, device="cuda")
    q = randn(batch, 1, h, head_dim, dtype=dtype, device="cuda")
    k_cache, v_cache = (randn(batch, rows, hk, head_dim, dtype=dtype, device="cuda") for _ in range(2))
    k_pool, table = _paged(k_cache, page_size, 3, generator)
    v_pool = torch.empty_like(k_pool)
    v_pool[table.long().flatten()] = v_cache.reshape(-1, page_size, hk, head_dim)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                       return_softmax_lse=True)
    paged, paged_lse = flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths, block_table=table,
                                               causal=True, return_softmax_lse=True)
    assert not torch.isnan(paged).any() and not torch.isnan(paged_lse).any()
    if sequences == "few":
        assert torch.equal(out, paged) and torch.equal(lse, paged_lse)
    else:
        torch.testing.assert_close(paged.float(), out.float(), atol=1e-2, rtol=0)
        torch.testing.assert_close(paged_lse, lse, atol=1e-4, rtol=0)


def test_paged_with_rotary(device):
    _require_forward(device)
    dtype = _dtype(device)
    generator = torch.Generator().manual_seed(0)
    batch, rows, page_size, h, hk = 2, 48, 16, 4, 2
    q = randn(batch, 1, h, HEAD_DIM, dtype=dtype, device=device)
    k_new, v_new = (randn(batch, 1, hk, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))
    k_cache, v_cache = (randn(batch, rows, hk, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))
    k_pool, table = _paged(k_cache, page_size, 2, generator)
    v_pool = torch.empty_like(k_pool)
    v_pool[table.long().flatten()] = v_cache.reshape(-1, page_size, hk, HEAD_DIM)
    angles = torch.rand(rows, 16) * 6.3
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    lengths = torch.tensor([31, 16], dtype=torch.int32, device=device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, cache_seqlens=lengths, causal=True)
    paged = flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cos, sin, cache_seqlens=lengths,
                                    block_table=table, causal=True)
    assert torch.equal(out, paged)
    assert torch.equal(k_pool[table.long()].flatten(1, 2), k_cache)


def test_block_table_refusals(device):
    _require_forward(device)
    dtype = _dtype(device)
    q = randn(2, 1, 4, HEAD_DIM, dtype=dtype, device=device)
    pool = randn(6, 16, 2, HEAD_DIM, dtype=dtype, device=device)
    lengths = torch.tensor([3, 9], dtype=torch.int32, device=device)
    bad = torch.tensor([[0, 1], [2, 6]], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=r"block_table\[3\]=6 is outside \[0, 5\]"):
        flash_attn_with_kvcache(q, pool, pool, cache_seqlens=lengths, block_table=bad)
    with pytest.raises(ValueError, match="block_table must be"):
        flash_attn_with_kvcache(q, pool, pool, cache_seqlens=lengths, block_table=bad[:1])
    with pytest.raises(ValueError, match="cannot be combined"):
        flash_attn_with_kvcache(q, pool, pool, cache_seqlens=lengths, block_table=bad.clamp(max=5),
                                cache_batch_idx=torch.tensor([0, 1], device=device))


@pytest.mark.parametrize("page_size", [1, 7, 16, 256])
def test_varlen_over_paged_cache_equals_packed(page_size, device):
    """flash_attn_varlen_func(block_table=...) (chunked prefill over a paged cache): the same output and LSE as the
    packed keys, bitwise; also through flash_attn_interface._flash_attn_varlen_forward."""
    _require_forward(device)
    from flash_attn import flash_attn_varlen_func
    from flash_attn.flash_attn_interface import _flash_attn_varlen_forward
    from flash_attn.reference import cu_from_seqlens

    dtype = _dtype(device)
    generator = torch.Generator().manual_seed(page_size)
    seqlens_q, seqlens_k, h, hk = [5, 3, 20, 13], [37, 0, 100, 13], 4, 2
    blocks = -(-max(seqlens_k) // page_size)
    padded = randn(len(seqlens_k), blocks * page_size, 2, hk, HEAD_DIM, dtype=dtype, device=device)
    k_pool, table = _paged(padded[:, :, 0].contiguous(), page_size, 3, generator)
    v_pool = torch.empty_like(k_pool)
    v_pool[table.long().flatten()] = padded[:, :, 1].reshape(-1, page_size, hk, HEAD_DIM)
    k = torch.cat([padded[b, :n, 0] for b, n in enumerate(seqlens_k)])
    v = torch.cat([padded[b, :n, 1] for b, n in enumerate(seqlens_k)])
    q = randn(sum(seqlens_q), h, HEAD_DIM, dtype=dtype, device=device)
    cu_q, cu_k = cu_from_seqlens(seqlens_q, device), cu_from_seqlens(seqlens_k, device)
    args = (cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    out, lse, _ = flash_attn_varlen_func(q, k, v, *args, causal=True, return_attn_probs=True)
    paged, paged_lse, _ = flash_attn_varlen_func(q, k_pool, v_pool, *args, causal=True, return_attn_probs=True,
                                                 block_table=table)
    assert torch.equal(out, paged) and torch.equal(lse, paged_lse)
    private, private_lse, _, _ = _flash_attn_varlen_forward(q, k_pool, v_pool, *args, 0.0, None, True,
                                                            block_table=table)
    assert torch.equal(out, private) and torch.equal(lse, private_lse)
    with pytest.raises(ValueError, match="exceeds the"):
        flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(seqlens_q), blocks * page_size + 1,
                               block_table=table)


@pytest.mark.parametrize("page_size", [16, 5])
def test_serving_loop_over_paged_cache(page_size, device):
    """An engine's loop: prompts of different lengths written into shuffled pages, a causal varlen prefill over the
    paged cache (flash_attn_varlen_func with block_table), then 200 decode steps, each appending one token per
    sequence through flash_attn_with_kvcache(k=..., v=..., cache_seqlens=..., block_table=...). Every step's output
    matches attention over the whole history kept densely beside it (the FA rule, fp64 ground truth), and the pages
    end up holding that history."""
    _require_forward(device)
    from flash_attn import flash_attn_varlen_func
    from flash_attn.reference import attention_ref, cu_from_seqlens
    from helpers import assert_close_fa

    dtype = _dtype(device)
    generator = torch.Generator().manual_seed(page_size)
    prompts, steps, h, hk = [37, 5, 70], 200, 4, 2
    batch = len(prompts)
    capacity = -(-(max(prompts) + steps) // page_size) * page_size
    history_k = randn(batch, capacity, hk, HEAD_DIM, dtype=dtype, device=device)
    history_v = randn(batch, capacity, hk, HEAD_DIM, dtype=dtype, device=device)
    k_pool, table = _paged(torch.zeros_like(history_k), page_size, 4, generator)
    v_pool = torch.zeros_like(k_pool)
    rows = torch.arange(capacity, device=device)
    for b, n in enumerate(prompts):  # the engine's cache write of each prompt
        page, offset = table[b].long()[rows[:n] // page_size], rows[:n] % page_size
        k_pool[page, offset] = history_k[b, :n]
        v_pool[page, offset] = history_v[b, :n]

    def check(out, q, b, length):
        """Row(s) q of sequence b, the last q.shape[0] positions of its first `length` tokens, against the reference."""
        def ref(*x, **kw):
            return attention_ref(*x, causal=True, **kw)
        inputs = (q.unsqueeze(0), history_k[b:b + 1, :length], history_v[b:b + 1, :length])
        truth = ref(*[x.double() for x in inputs], compute_dtype=torch.float64)[0]
        naive = ref(*inputs, compute_dtype=dtype)[0]
        assert_close_fa(out.unsqueeze(0).cpu(), truth.cpu(), naive.cpu(), 2.0)

    q = randn(sum(prompts), h, HEAD_DIM, dtype=dtype, device=device)
    cu = cu_from_seqlens(prompts, device)
    out = flash_attn_varlen_func(q, k_pool, v_pool, cu, cu, max(prompts), max(prompts), causal=True,
                                 block_table=table)
    for b, n in enumerate(prompts):
        check(out[cu[b]:cu[b + 1]], q[cu[b]:cu[b + 1]], b, n)

    lengths = torch.tensor(prompts, dtype=torch.int32, device=device)
    for step in range(steps):
        position = lengths.long()
        k_new = history_k[torch.arange(batch, device=device), position].unsqueeze(1)
        v_new = history_v[torch.arange(batch, device=device), position].unsqueeze(1)
        q = randn(batch, 1, h, HEAD_DIM, dtype=dtype, device=device)
        out = flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lengths, block_table=table,
                                      causal=True)
        lengths += 1
        for b in range(batch):
            check(out[b], q[b], b, prompts[b] + step + 1)
    for b, n in enumerate(prompts):
        page, offset = table[b].long()[rows[:n + steps] // page_size], rows[:n + steps] % page_size
        assert torch.equal(k_pool[page, offset], history_k[b, :n + steps])
        assert torch.equal(v_pool[page, offset], history_v[b, :n + steps])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [16, 5])
def test_paged_decode_step_in_cuda_graph(page_size):
    """A serving engine's captured decode step over a paged cache (issue 21): one CUDA graph holds
    flash_attn_with_kvcache with an append, cache_seqlens and block_table read from device memory; replayed for 50
    steps with the lengths, the new token and the query updated in place, each replay equals the eager call on a
    copy of the pages, and the pages end up equal too."""
    _require_forward("cuda")
    generator = torch.Generator().manual_seed(page_size)
    batch, h, hk, rows = 3, 8, 2, page_size * (300 // page_size)
    k_pool, table = _paged(randn(batch, rows, hk, HEAD_DIM, dtype=torch.bfloat16, device="cuda"), page_size, 4,
                           generator)
    v_pool = randn(*k_pool.shape, dtype=torch.bfloat16, device="cuda")
    lengths = torch.tensor([10, 0, 200], dtype=torch.int32, device="cuda")
    q, k_new, v_new = (randn(batch, 1, n, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for n in (h, hk, hk))
    eager_k, eager_v = k_pool.clone(), v_pool.clone()

    def step(k_cache, v_cache):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table,
                                       causal=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(k_pool.clone(), v_pool.clone())  # warm-up on scratch pages: the captured step appends to k_pool
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(k_pool, v_pool)
    k_pool.copy_(eager_k)  # capture does not run the kernels, but keep the pools equal whatever the backend does
    v_pool.copy_(eager_v)
    for _ in range(50):
        q.copy_(randn(batch, 1, h, HEAD_DIM, dtype=torch.bfloat16, device="cuda"))
        k_new.copy_(randn(batch, 1, hk, HEAD_DIM, dtype=torch.bfloat16, device="cuda"))
        v_new.copy_(randn(batch, 1, hk, HEAD_DIM, dtype=torch.bfloat16, device="cuda"))
        graph.replay()
        expected = step(eager_k, eager_v)
        assert torch.equal(static_out, expected)
        lengths += 1
    assert torch.equal(k_pool, eager_k) and torch.equal(v_pool, eager_v)


@pytest.mark.parametrize("page_size", [1, 16, 48, 64, 256])
@pytest.mark.parametrize("shape", ["gqa_decode", "mha_decode", "mqa_decode", "speculative", "softcap", "splits"])
def test_paged_decode_equals_contiguous(page_size, shape, device, monkeypatch):
    """Decode over pages read in place (CUDA decode tiles with pages of whole 32-key blocks: GQA-packed single tokens,
    MHA, speculative 4-token steps, forced key splits) or gathered by the op (CPU; pages of 1, 16 or 48 rows; MQA 32/1,
    whose packed rows exceed the decode tile; softcap): bitwise the call over the contiguous cache, at head dim 128,
    with ragged lengths that cross pages. Both calls take the same key splits: by default a paged call may split
    more (dispatch/fwd_plan.cpp split_ctas_per_sm plans every resident CTA for pages, two per SM for contiguous
    caches), which changes the sums' order. The portable kernels only: on a Hopper GPU the speculative steps' packed
    heads take the Hopper tile where its pages fit (test_hopper_forward.py test_paged_few_queries_equal_contiguous),
    and the decode tiles where they do not (pages of 1), so the two calls would differ in kernel, not in memory."""
    monkeypatch.setenv("FLASH_ATTN_HOPPER", "0")
    dtype = _dtype(device)
    require_supported(device, dtype, 128, backward=False)
    generator = torch.Generator().manual_seed(page_size)
    h, hk, seqlen_q = {"gqa_decode": (32, 8, 1), "mha_decode": (8, 8, 1), "mqa_decode": (32, 1, 1),
                       "speculative": (16, 4, 4), "softcap": (16, 4, 1), "splits": (16, 4, 1)}[shape]
    kwargs = {"softcap": dict(softcap=30.0), "splits": dict(num_splits=3),
              "speculative": dict(causal=True)}.get(shape, {})
    kwargs.setdefault("num_splits", 2)
    batch, rows = 3, page_size * max(1, 700 // page_size)
    lengths = torch.tensor([rows, 1, rows // 2 + 3], dtype=torch.int32, device=device)
    q = randn(batch, seqlen_q, h, 128, dtype=dtype, device=device)
    k_cache, v_cache = (randn(batch, rows, hk, 128, dtype=dtype, device=device) for _ in range(2))
    k_pool, table = _paged(k_cache, page_size, 3, generator)
    v_pool = torch.empty_like(k_pool)
    v_pool[table.long().flatten()] = v_cache.reshape(-1, page_size, hk, 128)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, return_softmax_lse=True, **kwargs)
    paged_out, paged_lse = flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths, block_table=table,
                                                   return_softmax_lse=True, **kwargs)
    assert torch.equal(out, paged_out) and torch.equal(lse, paged_lse)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("page_size", [32, 256])
def test_paged_decode_reads_pages_in_place(page_size):
    """A decode step over a paged cache launches the attention kernel (and the split combine) only: no gather of
    the pages into a contiguous copy (issue 21: at batch 16 x 8k that copy took 3x the attention's time)."""
    require_supported("cuda", torch.bfloat16, 128, backward=False)
    generator = torch.Generator().manual_seed(page_size)
    batch, rows, h, hk = 2, 4096, 32, 8
    k_pool, table = _paged(randn(batch, rows, hk, 128, dtype=torch.bfloat16, device="cuda"), page_size, 2, generator)
    v_pool = randn(*k_pool.shape, dtype=torch.bfloat16, device="cuda")
    q = randn(batch, 1, h, 128, dtype=torch.bfloat16, device="cuda")
    lengths = torch.tensor([4000, 1234], dtype=torch.int32, device="cuda")

    def decode():
        return flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths, block_table=table)

    decode()  # checks values once
    kernels = cuda_kernel_names(decode)
    assert kernels and all("flash" in name for name in kernels), kernels
