# The representative CUDA subset that tools/sanitize.sh runs under compute-sanitizer's tools: every
# head-dim bucket (backward also with the tiles of an A100 and the compact ones of sm86/sm89), odd sequence lengths,
# GQA, causal and not, varlen with empty sequences and rows past cu_seqlens[-1], a padded head dim, dropout, the wide
# forward tile (and its persistent form), the forward's TMA K/V loads, the row-pair dq accumulator and the stmatrix
# backward stores, the Hopper forward's packed heads over pages read in place, its tall rows, lazy rescaling and
# short-keys tile (carried tiles with two Q slots), malformed cu_seqlens, cache indices and block tables with the host
# checks off (the kernels' clamps); forward, and backward where it is built. Small sizes
# keep the sanitizers' slowdown bearable; each case is also checked against the fp64 reference, so the subset is an
# ordinary part of the CUDA suite as well (marker: sanitize).
import functools

import pytest
import torch

import flash_attn
from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn._native import C
from flash_attn.reference import attention_ref, attention_varlen_ref, cu_from_seqlens
from helpers import check_output_and_grads, randn, reference_pair

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.sanitize]
DTYPE = torch.bfloat16
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
DIRECTIONS = {"fwd": False, "bwd": True}
HOPPER_ARCH = 90


def _require(head_dim, backward):
    if not flash_attn.is_supported("cuda", DTYPE, head_dim, backward=backward):
        pytest.skip(f"no CUDA {'backward' if backward else 'forward'} kernel for {DTYPE} head_dim={head_dim}")


def _run_dense(shape, backward, **kwargs):
    b, sq, sk, h, hk, d = shape
    _require(d, backward)
    q = randn(b, sq, h, d, dtype=DTYPE, device="cuda", requires_grad=backward)
    k = randn(b, sk, hk, d, dtype=DTYPE, device="cuda", requires_grad=backward)
    v = randn(b, sk, hk, d, dtype=DTYPE, device="cuda", requires_grad=backward)
    dout = randn(b, sq, h, d, dtype=DTYPE, device="cuda") if backward else None
    out = flash_attn_func(q, k, v, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dout) if backward else None
    inputs = tuple(t.detach().cpu() for t in (q, k, v))
    ref_kwargs = {key: (val.cpu() if torch.is_tensor(val) else val) for key, val in kwargs.items()
                  if key != "deterministic"}
    truth, naive = reference_pair(functools.partial(attention_ref, **ref_kwargs), inputs,
                                  None if dout is None else dout.cpu())
    check_output_and_grads(out.cpu(), None if grads is None else [g.cpu() for g in grads], truth, naive)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("head_dim", HEAD_DIM_BUCKETS)
def test_head_dim_buckets_causal_gqa(head_dim, direction):
    _run_dense((2, 97, 131, 4, 2, head_dim), DIRECTIONS[direction], causal=True)


@pytest.mark.parametrize("head_dim", HEAD_DIM_BUCKETS)
def test_compact_backward_tiles(head_dim, monkeypatch):
    """The compact backward tiles (what sm86/sm89 GPUs run), forced on any GPU by the launcher's limit; softcap calls
    take the score-mods instantiation of the same tiles (bwd_plain_runs_score_mods)."""
    monkeypatch.setenv("FLASH_ATTN_BWD_SMEM_LIMIT", "101376")
    _run_dense((2, 97, 131, 4, 2, head_dim), True, causal=True)
    if head_dim in (64, 128, 256):
        _run_dense((1, 75, 140, 4, 1, head_dim), True, causal=False, softcap=6.0)


@pytest.mark.parametrize("head_dim, causal", [(h, True) for h in HEAD_DIM_BUCKETS] + [(128, False), (256, False)])
def test_a100_backward_tiles(head_dim, causal, monkeypatch):
    """What an A100 (163 KB of shared memory per block) runs, forced on any GPU by the launcher's limit: the full
    tiles where they fit, else the plain kernel's full tiles with one Q / dO stage (bwd_takes_one_stage_tiles), else
    the compact ones; softcap at hd 128 takes the score-mods instantiation of the same set."""
    monkeypatch.setenv("FLASH_ATTN_BWD_SMEM_LIMIT", "166912")
    _run_dense((2, 97, 131, 4, 2, head_dim), True, causal=causal)
    if head_dim == 128:
        _run_dense((1, 75, 140, 4, 1, head_dim), True, causal=causal, softcap=6.0)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("head_dim", [32, 96, 160, 256])
def test_hopper_kernels_below_their_bucket(head_dim, direction, monkeypatch):
    """The Hopper kernels forced at head dims below their 64-column bucket (32 of 64, 96 of 128, and 160 of the wide
    backward's 256, bwd_wide_kernel.h, beside its full 256): the backward's dq accumulator rows (the head dim rounded
    up to 32) are narrower than the kernel's columns, and the last row's reduction once ran past the workspace (an
    illegal address at hd 32 on the H200). Auto mode sends none of these backward calls to the Hopper kernels, so
    tools/sanitize.sh's Hopper pass sees them only here. Hd 32, 96 and 160 run their own buckets' kernels, which store
    the next whole segment count and run the score GEMMs over their own columns."""
    device = torch.cuda.current_device()
    bucket = next(b for b in (32, 64, 96, 128, 160, 192, 224, 256) if head_dim <= b)
    built = {(k["direction"], k["head_dim"]) for k in flash_attn.built_kernels()
             if k["device"] == "cuda" and k["arch"] == "sm90" and k["dtype"] == "bf16" and k["mask"] == "causal"}
    needed = {("fwd", bucket), ("bwd", bucket)} if DIRECTIONS[direction] else {("fwd", bucket)}
    if C.loaded_code(device)[0] < HOPPER_ARCH or not needed <= built:
        pytest.skip(f"needs sm_90a code and the sm90 bf16 causal {sorted(needed)} kernels")
    monkeypatch.setenv("FLASH_ATTN_HOPPER", "force")
    _run_dense((2, 97, 131, 4, 2, head_dim), DIRECTIONS[direction], causal=True)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("shape", [(1, 1, 77, 2, 2, 64), (2, 131, 17, 4, 1, 128), (1, 65, 65, 2, 2, 60)])
def test_odd_seqlens_and_padded_head_dim(shape, direction):
    _run_dense(shape, DIRECTIONS[direction])


@pytest.mark.parametrize("causal", [False, True])
def test_wide_forward_tile(causal):
    """The 8-warp 128-row forward tile (head dims above 128; non-causal at any length, causal from 16384 keys),
    whose V wait sits before the softmax; ragged last key tile and GQA."""
    _run_dense((1, 130, 16400 if causal else 4100, 2, 1, 256), False, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_tall_rows_forward(causal):
    """The hd 96 Hopper forward on 192-row tiles of three consumer warpgroups (from 4096 queries, sm90): a ragged last
    row tile and key block, GQA."""
    _run_dense((1, 4100, 300, 2, 1, 96), False, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_lazy_rescale_softcap_forward(causal):
    """The Hopper forward's general kernels with lazy rescaling (hd 128 softcap, sm90): the first key block sets each
    row's max and the later ones mostly stay within the lazy threshold (the warp-wide skip of O's rescale), a ragged
    last key block."""
    _run_dense((1, 200, 700, 2, 2, 128), False, causal=causal, softcap=30.0)


@pytest.mark.parametrize("head_dim, causal", [(64, False), (64, True), (128, False)])
def test_one_item_tma_forward(head_dim, causal):
    """The one-item forward kernel whose K and V arrive by TMA on sm90 (mbarrier waits, swizzled tiles): several key
    tiles, the last one ragged, GQA."""
    _run_dense((2, 150, 333, 4, 2, head_dim), False, causal=causal)


@pytest.mark.parametrize("head_dim, keys", [(256, 70), (256, 300), (160, 300)])
def test_persistent_forward_tile(head_dim, keys):
    """The persistent wide forward kernel (non-causal, head dim above 128, more work items than SMs): each CTA loads its
    next item's Q and first K during its last key tile; two or five key tiles per item, the last one ragged. On sm90
    head dim 256 loads K and V by TMA into swizzled tiles (mbarrier waits), 160 by cp.async."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    heads = sms  # two query tiles per head: 2 x sms items
    _run_dense((1, 200, keys, heads, heads, head_dim), False)


@pytest.mark.parametrize("head_dim", [160, 256])
def test_row_pair_dq_backward(head_dim):
    """Non-causal backward above head dim 128, whose dQ reductions go to a dq accumulator in row pairs: several key
    blocks, ragged last query blocks, GQA (two heads per walk) and an odd total of query rows (3 x 67)."""
    _run_dense((3, 67, 150, 4, 2, head_dim), True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_stmatrix_backward_stores(head_dim):
    """Non-causal backward at hd <= 128, whose P^T / dS^T stores are stmatrix on sm90: full and partial blocks."""
    _run_dense((1, 200, 260, 2, 2, head_dim), True)


@pytest.mark.parametrize("head_dim, causal", [(64, False), (128, True), (192, True), (256, False)])
def test_deterministic_backward(head_dim, causal):
    """deterministic=True: on the Hopper path the ordered dQ (writer warps, counters in the workspace, rotated walks
    when unmasked; above hd 128 the wide kernel's ordered instantiation, whose consumers hand their staged dQ boxes to
    the writers); GQA, ragged blocks, several key blocks."""
    _run_dense((2, 131, 300, 4, 2, head_dim), True, causal=causal, deterministic=True)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_window_softcap(direction):
    _run_dense((1, 90, 70, 4, 2, 64), DIRECTIONS[direction], window_size=(9, 4), softcap=5.0)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_alibi_softcap(head_dim, direction):
    """Softcap and ALiBi without bias or dropout: the lean forward's and the plain backward's score-mods
    instantiations on the portable path (fwd_lean_runs_score_mods, bwd_plain_runs_score_mods), causal, odd lengths."""
    slopes = torch.rand(4, device="cuda") * 0.5 + 0.05
    _run_dense((1, 131, 150, 4, 2, head_dim), DIRECTIONS[direction], causal=True, softcap=7.0, alibi_slopes=slopes)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_dropout_runs_clean(direction):
    backward = DIRECTIONS[direction]
    _require(64, backward)
    q, k, v = (randn(2, 70, 2, 64, dtype=DTYPE, device="cuda", requires_grad=backward) for _ in range(3))
    out = flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    assert torch.isfinite(out).all()
    if backward:
        assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), (q, k, v)))


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_varlen_causal_gqa(direction):
    backward = DIRECTIONS[direction]
    _require(64, backward)
    seqlens_q, seqlens_k = [37, 0, 65, 1], [53, 9, 64, 0]
    extra_rows = 5  # rows past cu_seqlens[-1]: never read or written by the kernels
    q = randn(sum(seqlens_q) + extra_rows, 4, 64, dtype=DTYPE, device="cuda", requires_grad=backward)
    k = randn(sum(seqlens_k) + extra_rows, 2, 64, dtype=DTYPE, device="cuda", requires_grad=backward)
    v = randn(sum(seqlens_k) + extra_rows, 2, 64, dtype=DTYPE, device="cuda", requires_grad=backward)
    cu_q, cu_k = cu_from_seqlens(seqlens_q, "cuda"), cu_from_seqlens(seqlens_k, "cuda")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True)
    rows_q, rows_k = sum(seqlens_q), sum(seqlens_k)
    assert out[rows_q:].abs().max() == 0
    dout = randn(*out.shape, dtype=DTYPE, device="cuda") if backward else None
    grads = torch.autograd.grad(out, (q, k, v), dout) if backward else None
    if backward:
        assert grads[0][rows_q:].abs().max() == 0 and grads[1][rows_k:].abs().max() == 0
    ref = functools.partial(attention_varlen_ref, cu_seqlens_q=cu_q.cpu(), cu_seqlens_k=cu_k.cpu(), causal=True)
    inputs = (q.detach()[:rows_q].cpu(), k.detach()[:rows_k].cpu(), v.detach()[:rows_k].cpu())
    truth, naive = reference_pair(ref, inputs, None if dout is None else dout[:rows_q].cpu())
    check_output_and_grads(out[:rows_q].cpu(),
                           None if grads is None else [grads[0][:rows_q].cpu(), grads[1][:rows_k].cpu(),
                                                       grads[2][:rows_k].cpu()], truth, naive)


# cu_seqlens_q values that once read outside the tensors (decreasing, past the rows, above max_seqlen, a negative
# start), run with the host checks off so that the kernels see them: their clamps must keep every access inside.
MALFORMED_CU_SEQLENS = {"decreasing": [0, 100, 40, 160], "past_rows": [0, 64, 128, 4000],
                        "above_max_seqlen": [0, 10, 150, 160], "negative_start": [-50, 20, 90, 160]}


@pytest.mark.parametrize("case", list(MALFORMED_CU_SEQLENS))
@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_malformed_cu_seqlens_unchecked(case, direction, monkeypatch):
    backward = DIRECTIONS[direction]
    _require(64, backward)
    monkeypatch.setenv("FLASH_ATTN_CHECK_DEVICE_VALUES", "0")
    values = MALFORMED_CU_SEQLENS[case]
    q = randn(160, 4, 64, dtype=DTYPE, device="cuda", requires_grad=backward)
    k = randn(170, 2, 64, dtype=DTYPE, device="cuda", requires_grad=backward)
    v = randn(170, 2, 64, dtype=DTYPE, device="cuda", requires_grad=backward)
    bad = torch.tensor(values, dtype=torch.int32, device="cuda")
    good_q, good_k = cu_from_seqlens([50, 50, 60], "cuda"), cu_from_seqlens([50, 60, 60], "cuda")
    for cu_q, cu_k in ((bad, good_k), (good_q, bad)):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, causal=True)
        if backward:
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()


def test_malformed_cache_indices_unchecked(monkeypatch):
    _require(64, False)
    monkeypatch.setenv("FLASH_ATTN_CHECK_DEVICE_VALUES", "0")
    k_cache, v_cache = (randn(3, 32, 2, 64, dtype=DTYPE, device="cuda") for _ in range(2))
    q = randn(3, 1, 4, 64, dtype=DTYPE, device="cuda")
    k_new, v_new = (randn(3, 1, 2, 64, dtype=DTYPE, device="cuda") for _ in range(2))
    lengths = torch.tensor([3, 1000, -7], dtype=torch.int32, device="cuda")
    index = torch.tensor([2, 99, -5], dtype=torch.int32, device="cuda")
    flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                       cache_batch_idx=index)
    torch.cuda.synchronize()


@pytest.mark.parametrize("page_size", [16, 64])
def test_malformed_block_table_unchecked(page_size, monkeypatch):
    """Pages past the pool, negative pages and lengths past a sequence's pages, with the host checks off: the append
    and the attention clamp every page they write or read (the decode kernel reads pages of 64 rows as whole key
    blocks and pages of 16 row by row, a tile's pages looked up by lanes)."""
    _require(64, False)
    monkeypatch.setenv("FLASH_ATTN_CHECK_DEVICE_VALUES", "0")
    k_pool, v_pool = (randn(6, page_size, 2, 64, dtype=DTYPE, device="cuda") for _ in range(2))
    table = torch.tensor([[0, 99], [-5, 3], [2, 1_000_000]], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([2 * page_size - 1, 5000, -3], dtype=torch.int32, device="cuda")
    q = randn(3, 1, 4, 64, dtype=DTYPE, device="cuda")
    k_new, v_new = (randn(3, 1, 2, 64, dtype=DTYPE, device="cuda") for _ in range(2))
    flash_attn.flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lengths, block_table=table)
    out = flash_attn.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths, block_table=table)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("page_size, seqlen_q", [(16, 4), (64, 4), (64, 150)])
def test_paged_packed_heads(page_size, seqlen_q):
    """Where the GPU takes the Hopper forward: 4 query heads a KV head packed into a tile's rows, 4 queries (a 16-row
    tile, speculative decoding) or 150 (3 tiles), over pages smaller than a key block read in place by the producer
    warp (page numbers a block ahead), sequences of 640 and 333 keys; elsewhere the same call on the portable path."""
    _require(128, False)
    batch, nheads, nheads_k, head_dim, rows = 2, 8, 2, 128, 640
    pages_per_seq = rows // page_size
    dense_k, dense_v = (randn(batch, rows, nheads_k, head_dim, dtype=DTYPE, device="cuda") for _ in range(2))
    generator = torch.Generator().manual_seed(page_size + seqlen_q)
    table = torch.randperm(batch * pages_per_seq, generator=generator).view(batch, pages_per_seq)
    k_pool, v_pool = (torch.empty(batch * pages_per_seq, page_size, nheads_k, head_dim, dtype=DTYPE, device="cuda")
                      for _ in range(2))
    k_pool[table.view(-1)] = dense_k.reshape(-1, page_size, nheads_k, head_dim)
    v_pool[table.view(-1)] = dense_v.reshape(-1, page_size, nheads_k, head_dim)
    lengths = [rows, 333]
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=DTYPE, device="cuda")
    out = flash_attn.flash_attn_with_kvcache(q, k_pool, v_pool, block_table=table.to("cuda", torch.int32),
                                             cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device="cuda"))

    def ref(q, k, v, compute_dtype):
        parts = [attention_ref(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], compute_dtype=compute_dtype)
                 for b, n in enumerate(lengths)]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])

    truth, naive = reference_pair(ref, tuple(t.cpu() for t in (q, dense_k, dense_v)))
    check_output_and_grads(out.cpu(), None, truth, naive)
