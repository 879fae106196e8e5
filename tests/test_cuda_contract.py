# CUDA-only checks of the host side of a CUDA call: the kernel input contract (head dims padded to a multiple
# of 8 and sliced back, misaligned / oddly strided tensors copied, qualifying views such as slices of a packed
# qkv passed with no copy), no host synchronisation in any call once its cu_seqlens were checked (torch's sync
# debug mode set to "error"), and the errors for what CUDA does not take (float32 / float64 inputs, head dims
# above 256).
import functools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import flash_attn
from flash_attn import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from flash_attn.reference import attention_ref, attention_varlen_ref, cu_from_seqlens
from helpers import assert_close_fa, no_host_sync, randn, reference_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPE = torch.bfloat16


def _require(head_dim, backward=False):
    if not flash_attn.is_supported("cuda", DTYPE, head_dim, backward=backward):
        pytest.skip(f"no CUDA {'backward' if backward else 'forward'} kernel for {DTYPE} head_dim={head_dim}")


def _ops_run(fn):
    """Names of the aten ops fn dispatches (CPU-side profiler events)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return {event.name for event in prof.events()}


COPY_OPS = {"aten::copy_", "aten::clone", "aten::constant_pad_nd"}


def test_packed_qkv_slices_run_without_copies():
    _require(64)
    qkv = randn(2, 77, 3, 4, 64, dtype=DTYPE, device="cuda")
    assert not (_ops_run(lambda: flash_attn_qkvpacked_func(qkv, causal=True)) & COPY_OPS)
    q_t = randn(2, 4, 77, 64, dtype=DTYPE, device="cuda").transpose(1, 2)  # (B, H, S, D) storage
    assert not (_ops_run(lambda: flash_attn_func(q_t, q_t, q_t)) & COPY_OPS)


def test_misaligned_input_is_copied_and_correct():
    _require(64)
    storage = randn(2 * 50 * 2 * 64 + 1, dtype=DTYPE, device="cuda")
    q = storage[1:].view(2, 50, 2, 64)  # 2 bytes past an aligned address
    k, v = randn(2, 60, 2, 64, dtype=DTYPE, device="cuda"), randn(2, 60, 2, 64, dtype=DTYPE, device="cuda")
    assert "aten::copy_" in _ops_run(lambda: flash_attn_func(q, k, v))
    out = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, flash_attn_func(q.clone(), k, v, causal=True), rtol=0, atol=0)


def test_row_stride_not_multiple_of_8_is_copied_and_correct():
    _require(64)
    storage = randn(2 * 40 * 132, dtype=DTYPE, device="cuda")
    q = storage.as_strided((2, 40, 2, 64), (40 * 132, 132, 64, 1))
    k, v = randn(2, 40, 2, 64, dtype=DTYPE, device="cuda"), randn(2, 40, 2, 64, dtype=DTYPE, device="cuda")
    assert "aten::copy_" in _ops_run(lambda: flash_attn_func(q, k, v))
    torch.testing.assert_close(flash_attn_func(q, k, v), flash_attn_func(q.contiguous(), k, v), rtol=0, atol=0)


@pytest.mark.parametrize("head_dim", [1, 20, 33, 60, 100, 127, 250])
def test_head_dim_not_multiple_of_8_is_padded(head_dim):
    _require(head_dim)
    q = randn(2, 57, 4, head_dim, dtype=DTYPE, device="cuda")
    k = randn(2, 70, 2, head_dim, dtype=DTYPE, device="cuda")
    v = randn(2, 70, 2, head_dim, dtype=DTYPE, device="cuda")
    assert "aten::constant_pad_nd" in _ops_run(lambda: flash_attn_func(q, k, v))
    out, lse, _ = torch.ops.flash_attn.fwd(q, k, v, None, None, 0, 0, 0.0, head_dim ** -0.5, -1, 0, True, 0.0,
                                            None, None, None, False)
    assert out.shape == q.shape and out.is_contiguous()
    truth, naive = reference_pair(functools.partial(attention_ref, causal=True), (q.cpu(), k.cpu(), v.cpu()))
    assert_close_fa(out.cpu(), truth[0], naive[0], 2)
    # The default scale is taken from the caller's head dim, not the padded one.
    torch.testing.assert_close(flash_attn_func(q, k, v, causal=True), out, rtol=0, atol=0)


@pytest.mark.parametrize("head_dim", [20, 60, 100])
def test_head_dim_padding_backward(head_dim):
    _require(head_dim, backward=True)
    q, k, v = (randn(2, 45, 2, head_dim, dtype=DTYPE, device="cuda", requires_grad=True) for _ in range(3))
    dout = randn(2, 45, 2, head_dim, dtype=DTYPE, device="cuda")
    out = flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    truth, naive = reference_pair(functools.partial(attention_ref, causal=True),
                                  tuple(t.detach().cpu() for t in (q, k, v)), dout.cpu())
    for g, gt, gn in zip(grads, truth[2], naive[2]):
        assert g.shape == q.shape and g.is_contiguous()
        assert_close_fa(g.cpu(), gt, gn, 3)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_no_host_sync_dense_and_varlen(dropout_p):
    _require(64)
    q = randn(2, 70, 4, 64, dtype=DTYPE, device="cuda")
    k, v = randn(2, 90, 2, 64, dtype=DTYPE, device="cuda"), randn(2, 90, 2, 64, dtype=DTYPE, device="cuda")
    no_host_sync(lambda: flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True))
    cu_q, cu_k = cu_from_seqlens([30, 0, 33], "cuda"), cu_from_seqlens([50, 7, 40], "cuda")
    qv, kv, vv = q.view(140, 4, 64), k.view(180, 2, 64), v.view(180, 2, 64)
    # The first call with these cu_seqlens checks their values (one synchronisation per tensor version,
    # tests/test_cuda_index_values.py); every later call with them runs without one.
    flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 33, 50, dropout_p=dropout_p)
    out = no_host_sync(lambda: flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 33, 50, dropout_p=dropout_p))
    assert out[63:].abs().max() == 0  # rows past cu_seqlens_q[-1] = 63 are zero-initialised
    if dropout_p == 0.0:
        ref = attention_varlen_ref(qv.cpu(), kv.cpu(), vv.cpu(), cu_q.cpu(), cu_k.cpu(), compute_dtype=torch.float64)
        naive = attention_varlen_ref(qv.cpu(), kv.cpu(), vv.cpu(), cu_q.cpu(), cu_k.cpu(), compute_dtype=DTYPE)
        assert_close_fa(out[:63].cpu(), ref[0][:63], naive[0][:63], 2)


def test_varlen_call_with_remembered_cu_seqlens_fills_nothing():
    """Once cu_seqlens were checked, a varlen call no longer reads them on the host; the rows past cu_seqlens[-1] are
    zeroed on the device (their count read there), so a call whose rows are all owned writes no zero-filled outputs:
    zero-filling out, dq, dk, dv cost 4 passes over them per step (H200, documents of 128, forty-second session)."""
    _require(64, backward=True)
    cu = cu_from_seqlens([30, 0, 33, 7], "cuda")
    q, k, v = (randn(70, 4, 64, dtype=DTYPE, device="cuda", requires_grad=True) for _ in range(3))
    dout = randn(70, 4, 64, dtype=DTYPE, device="cuda")

    def step():
        out = flash_attn_varlen_func(q, k, v, cu, cu, 33, 33, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    step()  # reads and remembers cu's values
    assert not (_ops_run(step) & {"aten::zeros", "aten::zero_"})  # lse (rows past the end: +inf) is aten::full


@pytest.mark.parametrize("host_reads", [True, False], ids=["values_read", "values_remembered"])
def test_varlen_unowned_rows_zero_in_reused_memory(host_reads):
    """Rows past cu_seqlens[-1] of out, dq, dk, dv are 0 even where the caching allocator hands the outputs memory
    full of NaN: whether the host read cu_seqlens in this call or remembered them."""
    _require(64, backward=True)
    cu_q, cu_k = cu_from_seqlens([30, 0, 33], "cuda"), cu_from_seqlens([50, 7, 40], "cuda")
    q = randn(140, 4, 64, dtype=DTYPE, device="cuda", requires_grad=True)
    k, v = (randn(180, 2, 64, dtype=DTYPE, device="cuda", requires_grad=True) for _ in range(2))
    dout = randn(140, 4, 64, dtype=DTYPE, device="cuda")
    if not host_reads:
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 50)
    torch.cuda.synchronize()
    # Freed blocks of the outputs' sizes, full of NaN, for the allocator to reuse.
    poison = [torch.full(t.shape, float("nan"), dtype=DTYPE, device="cuda") for t in (q, q, k, k, k, k)]
    del poison
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 50)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for name, t, owned in (("out", out, 63), ("dq", dq, 63), ("dk", dk, 97), ("dv", dv, 97)):
        assert torch.isfinite(t[:owned]).all(), name
        assert t[owned:].abs().max() == 0, f"{name}: rows past cu_seqlens[-1] must be 0"


def test_no_host_sync_backward():
    _require(64, backward=True)
    q, k, v = (randn(2, 70, 2, 64, dtype=DTYPE, device="cuda", requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, dropout_p=0.1, causal=True)
    dout = torch.randn_like(out)
    no_host_sync(lambda: torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp32_fp64_rejected_with_dtype_requirement(dtype):
    assert not flash_attn.is_supported("cuda", dtype, 64)
    q = torch.randn(1, 8, 2, 64, dtype=dtype, device="cuda")
    with pytest.raises(RuntimeError, match=r"CUDA tensors must be float16 or bfloat16.*to\(torch.bfloat16\)"):
        flash_attn_func(q, q, q)


def test_head_dim_above_256_rejected():
    assert not flash_attn.is_supported("cuda", DTYPE, 264)
    q = torch.randn(1, 8, 2, 264, dtype=DTYPE, device="cuda")
    with pytest.raises(RuntimeError, match=r"head dim .* must be in \[1, 256\]; got 264"):
        flash_attn_func(q, q, q)


def test_cu_seqlens_on_host_rejected_for_cuda_inputs():
    q = torch.randn(10, 2, 64, dtype=DTYPE, device="cuda")
    cu = cu_from_seqlens([4, 6])
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be on the same device as q"):
        flash_attn_varlen_func(q, q, q, cu, cu, 6, 6)
