# Test helpers: dtype lists, support checks, random inputs, the FlashAttention tolerance rule
# (assert_close_fa), runners that evaluate flash_attn.reference as fp64 ground truth and as the
# naive low-precision baseline (outputs and gradients), a dispatch mode that records the
# rng_state an entry point hands to torch.ops.flash_attn.fwd, and the runner of the host C++ checkers (tests/cpp/).
import pathlib
import shutil
import subprocess

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flash_attn

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOST_COMPILER = shutil.which("c++") or shutil.which("g++")
HOST_CHECK_TIMEOUT_S = 300

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
LOW_DTYPES = [torch.float16, torch.bfloat16]
GROUND_TRUTH_DTYPE = torch.float64

# Additive error floor of assert_close_fa, relative to max(max|reference|, 1): inputs are unit normal,
# so 1 is the natural scale of outputs and gradients (and the floor stays > 0 where the true value is 0,
# e.g. dq when each query sees a single key).
REL_FLOOR = {
    torch.float16: 1e-3,
    torch.bfloat16: 1e-3,
    torch.float32: 1e-5,
    torch.float64: 1e-10,
}


def load_module(relative_path):
    """A repository script (benchmarks/, tools/) imported as a module, by its path under the repository root."""
    import importlib.util
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require_supported(device, dtype, headdim, backward=True):
    """Skip the calling test unless flash_attn reports support for (device, dtype, headdim); the forward alone
    with backward=False (inference calls such as flash_attn_with_kvcache)."""
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    if not flash_attn.is_supported(device, dtype, headdim, backward=backward):
        pytest.skip(f"flash_attn does not support {device} {dtype} headdim={headdim}")


def randn(*shape, dtype=torch.float32, device="cpu", requires_grad=False):
    """Random normal tensor (never zeros)."""
    x = torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)
    return x.requires_grad_(requires_grad)


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, device, requires_grad=False):
    """q (B, Sq, H, D), k and v (B, Sk, Hk, D) on a supported (device, dtype, headdim)."""
    require_supported(device, dtype, headdim)
    q = randn(batch, seqlen_q, nheads, headdim, dtype=dtype, device=device, requires_grad=requires_grad)
    k = randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype, device=device, requires_grad=requires_grad)
    v = randn(batch, seqlen_k, nheads_k, headdim, dtype=dtype, device=device, requires_grad=requires_grad)
    return q, k, v


def alibi_slopes_for(shape, device):
    """Positive float32 ALiBi slopes of the given shape ((H,) or (B, H))."""
    return (torch.rand(*shape, device=device) * 0.5 + 0.05).to(torch.float32)


def lse_dtype_ok(lse_dtype, input_dtype):
    """softmax_lse is float32; float64 inputs may keep it in float64 (needed for an fp64-exact backward)."""
    return lse_dtype == torch.float32 or (input_dtype == torch.float64 and lse_dtype == torch.float64)


def assert_no_nan(*tensors):
    for t in tensors:
        if t is not None:
            assert not torch.isnan(t).any(), "NaN in output"


def assert_close_fa(ours, ref, naive, mult, floor_dtype=None):
    """FlashAttention's rule: max|ours - ref| <= mult * max|naive - ref| + floor (max-abs errors).

    ref is the fp64 ground truth, naive the same reference evaluated in ours' dtype. The floor is
    REL_FLOOR[dtype] * max(max|ref|, 1) plus twice the error of rounding ref to ours' dtype; floor_dtype
    (e.g. float32 for values derived from the float32 softmax_lse) can only raise REL_FLOOR.
    """
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert_no_nan(ours)
    if ours.numel() == 0:
        return
    ref64 = ref.detach().to(torch.float64)
    ours64 = ours.detach().to(torch.float64)
    naive64 = naive.detach().to(torch.float64)
    err = (ours64 - ref64).abs().max().item()
    naive_err = (naive64 - ref64).abs().max().item()
    rounding = (ref64.to(ours.dtype).to(torch.float64) - ref64).abs().max().item()
    rel = max(REL_FLOOR[ours.dtype], REL_FLOOR.get(floor_dtype, 0.0))
    floor = rel * max(ref64.abs().max().item(), 1.0) + 2 * rounding
    bound = mult * naive_err + floor
    assert err <= bound, f"max abs error {err:.3e} > {mult} x naive {naive_err:.3e} + floor {floor:.3e}"


def evaluate_ref(ref_fn, inputs, dout, compute_dtype):
    """ref_fn(*inputs cast to compute_dtype, compute_dtype=...) -> (out, lse or None, grads or None)."""
    xs = [x.detach().to(compute_dtype).requires_grad_(dout is not None) for x in inputs]
    result = ref_fn(*xs, compute_dtype=compute_dtype)
    out, lse = result[0], result[1]
    lse = None if lse is None else lse.detach()
    grads = None
    if dout is not None:
        grads = torch.autograd.grad(out, xs, dout.to(compute_dtype), allow_unused=True)
        grads = tuple(torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads))
    return out.detach(), lse, grads


def reference_pair(ref_fn, inputs, dout=None):
    """Evaluate ref_fn(*inputs, compute_dtype=...) -> (out, lse, ...) as ground truth and naive.

    Returns (truth, naive), each (out, lse, grads or None); naive uses the dtype of inputs[0].
    """
    truth = evaluate_ref(ref_fn, inputs, dout, GROUND_TRUTH_DTYPE)
    naive = evaluate_ref(ref_fn, inputs, dout, inputs[0].dtype)
    return truth, naive


def check_output_and_grads(out, grads, truth, naive):
    """Tolerance rule on the output (2x) and on each gradient (3x); grads may be None."""
    assert_close_fa(out, truth[0], naive[0], 2)
    if grads is not None:
        for g, gt, gn in zip(grads, truth[2], naive[2]):
            assert g is not None, "missing gradient"
            assert_close_fa(g, gt, gn, 3)


def varlen_tensors(seqlens_q, seqlens_k, nheads, nheads_k, headdim, dtype, device, requires_grad=False):
    """q (total_q, H, D), k/v (total_k, Hk, D) and int32 cu_seqlens for the given lengths."""
    from flash_attn.reference import cu_from_seqlens

    require_supported(device, dtype, headdim)
    total_q, total_k = sum(seqlens_q), sum(seqlens_k)
    q = randn(total_q, nheads, headdim, dtype=dtype, device=device, requires_grad=requires_grad)
    k = randn(total_k, nheads_k, headdim, dtype=dtype, device=device, requires_grad=requires_grad)
    v = randn(total_k, nheads_k, headdim, dtype=dtype, device=device, requires_grad=requires_grad)
    return q, k, v, cu_from_seqlens(seqlens_q, device), cu_from_seqlens(seqlens_k, device)


class CaptureRngState(TorchDispatchMode):
    """Records (a copy of) the rng_state argument of every torch.ops.flash_attn.fwd call made inside it."""

    def __init__(self):
        super().__init__()
        self.rng_states = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.flash_attn.fwd.default:
            names = [a.name for a in func._schema.arguments]
            index = names.index("rng_state")
            value = kwargs.get("rng_state", args[index] if index < len(args) else None)
            self.rng_states.append(None if value is None else value.detach().clone())
        return func(*args, **kwargs)

    def last(self):
        assert self.rng_states and self.rng_states[-1] is not None, "no fwd call with an rng_state was seen"
        return self.rng_states[-1]


def check_kvcache_cuda_matches_cpu(lengths, seqlen_q, rows, nheads, nheads_k, head_dim, **kwargs):
    """flash_attn_with_kvcache on CUDA and on CPU (bf16, the same random inputs, cache_seqlens = lengths): no NaN on
    CUDA, out within 2e-2 and lse within 1e-3 of the CPU path."""
    batch = len(lengths)
    q = randn(batch, seqlen_q, nheads, head_dim, dtype=torch.bfloat16)
    k_cache = randn(batch, rows, nheads_k, head_dim, dtype=torch.bfloat16)
    v_cache = randn(batch, rows, nheads_k, head_dim, dtype=torch.bfloat16)
    results = []
    for device in ("cpu", "cuda"):
        cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        results.append(flash_attn.flash_attn_with_kvcache(q.to(device), k_cache.to(device), v_cache.to(device),
                                                          cache_seqlens=cache_seqlens, return_softmax_lse=True,
                                                          **kwargs))
    (out_cpu, lse_cpu), (out_cuda, lse_cuda) = results
    assert not torch.isnan(out_cuda).any() and not torch.isnan(lse_cuda).any()
    torch.testing.assert_close(out_cuda.cpu().float(), out_cpu.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse_cuda.cpu(), lse_cpu, atol=1e-3, rtol=1e-3)


def cuda_kernel_names(fn):
    """Runs fn once under the torch profiler and returns the names of the CUDA kernels it launched, in order (run it
    once before, so one-time checks and lazy loading stay out of the trace)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        fn()
        torch.cuda.synchronize()
    return [event.name for event in trace.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def no_host_sync(fn):
    """Runs fn with torch's CUDA sync debug mode set to "error": any host synchronisation inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run_host_check(sources, binary):
    """Builds a host C++ checker (tests/cpp/, against csrc/) with the host compiler into `binary`, runs it, and
    returns its stdout; a failed build or a non-zero exit fails the calling test with the tail of the output."""
    build = subprocess.run([HOST_COMPILER, "-std=c++20", "-O2", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'include'}",
                            *map(str, sources), "-o", str(binary)], capture_output=True, text=True,
                           timeout=HOST_CHECK_TIMEOUT_S)
    assert build.returncode == 0, build.stderr[-3000:]
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=HOST_CHECK_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout
