# Index values held on the GPU (cu_seqlens_q / cu_seqlens_k, cache_seqlens, cache_batch_idx): invalid ones raise a
# RuntimeError / ValueError naming the argument; the values of one tensor are read on the host once per version (the
# second call with the same tensor does not synchronise, an in-place change is checked again); with the checks off
# (FLASH_ATTN_CHECK_DEVICE_VALUES=0, as under CUDA-graph capture) the kernels clamp whatever they read, so invalid
# values never fault and leave the CUDA context usable. tests/test_cuda_sanitize.py runs the unchecked calls under
# compute-sanitizer's memcheck.
import pytest
import torch

import flash_attn
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn.reference import cu_from_seqlens
from helpers import no_host_sync, randn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPE = torch.bfloat16
HEAD_DIM = 64
ROWS_Q, ROWS_K = 160, 170
# cu_seqlens values the issue reported reading outside the tensors, each with the message that names the fault.
BAD_CU_SEQLENS = {
    "decreasing": ([0, 100, 40, 160], r"cu_seqlens_q must be non-decreasing"),
    "past_rows": ([0, 64, 128, 4000], r"cu_seqlens_q\[-1\]=4000 is beyond the 160 rows of q"),
    "above_max_seqlen": ([0, 10, 150, 160], r"max_seqlen_q=64 is smaller than the longest sequence"),
    "negative_start": ([-50, 20, 90, 160], r"cu_seqlens_q\[0\] must be 0"),
}
MAX_SEQLEN = 64


def _require(backward=False):
    if not flash_attn.is_supported("cuda", DTYPE, HEAD_DIM, backward=backward):
        pytest.skip(f"no CUDA kernel for {DTYPE} head_dim={HEAD_DIM}")


def _varlen_inputs(requires_grad=False):
    q = randn(ROWS_Q, 4, HEAD_DIM, dtype=DTYPE, device="cuda", requires_grad=requires_grad)
    k = randn(ROWS_K, 2, HEAD_DIM, dtype=DTYPE, device="cuda", requires_grad=requires_grad)
    v = randn(ROWS_K, 2, HEAD_DIM, dtype=DTYPE, device="cuda", requires_grad=requires_grad)
    cu_k = cu_from_seqlens([50, 60, 60], "cuda")
    return q, k, v, cu_k


@pytest.mark.parametrize("case", list(BAD_CU_SEQLENS), ids=list(BAD_CU_SEQLENS))
def test_invalid_cu_seqlens_raise_naming_the_argument(case):
    _require()
    values, message = BAD_CU_SEQLENS[case]
    q, k, v, cu_k = _varlen_inputs()
    cu_q = torch.tensor(values, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=message):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, MAX_SEQLEN, MAX_SEQLEN)
    # The same values as cu_seqlens_k name that argument.
    k_rows = torch.tensor(values, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=message.replace("cu_seqlens_q", "cu_seqlens_k").replace(
            "rows of q", "rows of k").replace("max_seqlen_q", "max_seqlen_k").replace("160 rows", "170 rows")):
        flash_attn_varlen_func(q, k, v, cu_from_seqlens([50, 50, 60], "cuda"), k_rows, MAX_SEQLEN, MAX_SEQLEN)
    torch.cuda.synchronize()  # the context is still usable


def test_values_are_read_once_per_tensor_version():
    _require()
    q, k, v, cu_k = _varlen_inputs()
    cu_q = cu_from_seqlens([50, 50, 60], "cuda")
    first = flash_attn_varlen_func(q, k, v, cu_q, cu_k, MAX_SEQLEN, MAX_SEQLEN)  # checks (one synchronisation)
    again = no_host_sync(lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, MAX_SEQLEN, MAX_SEQLEN))
    assert torch.equal(first, again)
    # Another requirement (max_seqlen) is a new check; an in-place change is too, and a bad one is caught.
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, MAX_SEQLEN + 1, MAX_SEQLEN)
    cu_q[1] = 120
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be non-decreasing|longest sequence"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, MAX_SEQLEN, MAX_SEQLEN)


def test_checks_can_be_turned_off(monkeypatch):
    _require()
    q, k, v, cu_k = _varlen_inputs()
    cu_q = cu_from_seqlens([50, 50, 60], "cuda")
    monkeypatch.setenv("FLASH_ATTN_CHECK_DEVICE_VALUES", "0")
    no_host_sync(lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, MAX_SEQLEN, MAX_SEQLEN))


@pytest.mark.parametrize("case", list(BAD_CU_SEQLENS), ids=list(BAD_CU_SEQLENS))
def test_unchecked_invalid_cu_seqlens_stay_inside_the_tensors(case, monkeypatch):
    """Forward and backward with the checks off: the kernels clamp the values; the call completes, nothing is NaN
    and the CUDA context stays usable (memcheck proves the accesses in tests/test_cuda_sanitize.py)."""
    _require(backward=True)
    monkeypatch.setenv("FLASH_ATTN_CHECK_DEVICE_VALUES", "0")
    values, _ = BAD_CU_SEQLENS[case]
    q, k, v, _ = _varlen_inputs(requires_grad=True)
    cu_q = torch.tensor(values, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([max(0, min(x, ROWS_K)) for x in values], dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, MAX_SEQLEN, MAX_SEQLEN, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()
    for t in (out, *grads):
        assert not torch.isnan(t).any()
    bad_k = torch.tensor(values, dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k, v, cu_from_seqlens([50, 50, 60], "cuda"), bad_k, MAX_SEQLEN, MAX_SEQLEN)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()


def _cache(batch=3, rows=32):
    k_cache = randn(batch, rows, 2, HEAD_DIM, dtype=DTYPE, device="cuda")
    v_cache = randn(batch, rows, 2, HEAD_DIM, dtype=DTYPE, device="cuda")
    q = randn(batch, 1, 4, HEAD_DIM, dtype=DTYPE, device="cuda")
    k_new = randn(batch, 1, 2, HEAD_DIM, dtype=DTYPE, device="cuda")
    return q, k_cache, v_cache, k_new, k_new.clone()


@pytest.mark.parametrize("lengths, message", [([3, -1, 5], r"cache_seqlens\[1\]=-1 is outside \[0, 31\]"),
                                              ([3, 32, 5], r"cache_seqlens\[1\]=32 is outside \[0, 31\]")])
def test_invalid_cache_seqlens_raise(lengths, message):
    _require()
    q, k_cache, v_cache, k_new, v_new = _cache()
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=message):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens)
    with pytest.raises(ValueError, match=r"cache_seqlens=40 must be in \[0, 31\]"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=40)
    torch.cuda.synchronize()


def test_invalid_cache_batch_idx_raises():
    _require()
    q, k_cache, v_cache, _, _ = _cache()
    index = torch.tensor([0, 3, 1], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=r"cache_batch_idx\[1\]=3 is outside \[0, 2\]"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.full((3,), 8, device="cuda"),
                                cache_batch_idx=index)
    torch.cuda.synchronize()


def test_unchecked_cache_indices_are_clamped(monkeypatch):
    """With the checks off, out-of-range cache positions and entries are clamped into the caches: no device assert,
    no fault, and the context stays usable."""
    _require()
    monkeypatch.setenv("FLASH_ATTN_CHECK_DEVICE_VALUES", "0")
    q, k_cache, v_cache, k_new, v_new = _cache()
    lengths = torch.tensor([3, 1000, -7], dtype=torch.int32, device="cuda")
    index = torch.tensor([2, 99, -5], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, cache_batch_idx=index)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
