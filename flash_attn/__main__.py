# `python -m flash_attn`: a self-report of this installation. Prints the versions, the kernels that were
# built and the devices here with what flash_attn supports on each; then checks forward and backward
# (dense, seqlen_q < seqlen_k, GQA, varlen; causal and not) against a float32 torch SDPA reference on
# every supported device, and times one shape against torch SDPA. Exits 1 when a check fails or no
# device is supported. Needs only torch; it does not use the repository's benchmarks/ folder.

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import flash_attn
from flash_attn import _native

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
PROBE_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
CHECK_HEAD_DIMS = (64, 128)

# A result passes when max|ours - fp32 ref| <= SLACK * max|torch in the same dtype - fp32 ref|
# + ABS_TOL[dtype] * max(1, max|fp32 ref|): no worse than torch's own rounding, plus a little.
CHECK_SLACK = 2.0
CHECK_ABS_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
SEED = 0


@dataclass(frozen=True)
class CheckCase:
    """One correctness shape: per-sequence lengths (several = varlen packing), query and KV heads."""

    name: str
    seqlens_q: tuple
    seqlens_k: tuple
    nheads: int
    nheads_k: int
    varlen: bool = False


CHECK_CASES = (
    CheckCase("dense", (128, 128), (128, 128), nheads=4, nheads_k=4),
    CheckCase("sq<sk", (64,), (160,), nheads=4, nheads_k=4),
    CheckCase("gqa", (96, 96), (96, 96), nheads=8, nheads_k=2),
    CheckCase("varlen", (37, 128, 61), (53, 128, 90), nheads=4, nheads_k=4, varlen=True),
)


@dataclass(frozen=True)
class BenchShape:
    """The one shape timed per device, flash layout (batch, seqlen, nheads, headdim)."""

    batch: int
    nheads: int
    seqlen: int
    headdim: int


BENCH_SHAPE = {"cpu": BenchShape(1, 8, 1024, 64), "cuda": BenchShape(4, 16, 2048, 128)}
BENCH_DTYPE_PREFERENCE = (torch.bfloat16, torch.float16, torch.float32)
WARMUP_REPS = {"cpu": 1, "cuda": 5}
TIMED_REPS = {"cpu": 5, "cuda": 20}
MS_PER_S = 1e3


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def dtype_label(value) -> str:
    if isinstance(value, torch.dtype):
        return DTYPE_NAMES.get(value, str(value).removeprefix("torch."))
    return str(value)


def head_dim_label(value):
    """A head dim as built_kernels reports it: one number, or a (lowest, highest) range."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return f"{value[0]}..{value[1]}"
    return value


def ordered(values) -> list:
    """Distinct values, numbers first in order, then everything else as sorted text (None included)."""
    distinct = set(values)
    numbers = sorted(v for v in distinct if isinstance(v, (int, float)))
    return numbers + sorted(str(v) for v in distinct if not isinstance(v, (int, float)))


def print_built_kernels():
    kernels = flash_attn.built_kernels()
    print(f"built kernels: {len(kernels)}")
    groups = {}
    for kernel in kernels:
        groups.setdefault((str(kernel.get("device")), str(kernel.get("arch"))), []).append(kernel)
    for (device, arch), group in sorted(groups.items()):
        dtypes = ", ".join(dtype_label(d) for d in ordered(dtype_label(k.get("dtype")) for k in group))
        head_dims = ", ".join(str(h) for h in ordered(head_dim_label(k.get("head_dim")) for k in group))
        directions = ", ".join(str(d) for d in ordered(k.get("direction") for k in group))
        print(f"  {device} {arch}: {len(group)} kernels; dtypes {dtypes}; head dims {head_dims}; {directions}")


def supported_grid(device: torch.device) -> dict:
    """dtype -> head dims (of PROBE_HEAD_DIMS) that flash_attn.is_supported accepts on this device."""
    grid = {}
    for dtype in DTYPE_NAMES:
        try:
            dims = [d for d in PROBE_HEAD_DIMS if flash_attn.is_supported(device, dtype, d)]
        except Exception as exc:  # report a broken capability query instead of dying on it
            print(f"  flash_attn.is_supported({device}, {DTYPE_NAMES[dtype]}, ...) raised {type(exc).__name__}: {exc}")
            dims = []
        if dims:
            grid[dtype] = dims
    return grid


def describe_support(grid: dict) -> str:
    if not grid:
        return "not supported by this build"
    parts = [f"{DTYPE_NAMES[dtype]} (head dims {','.join(map(str, dims))})" for dtype, dims in grid.items()]
    return "supported: " + "; ".join(parts)


def describe_code(index: int) -> str:
    """Which compiled code the driver loaded for this GPU: SASS for its own arch, or PTX it compiled at first use."""
    code, binary = _native.C.loaded_code(index)
    if code == binary:
        return f"; kernels from sm_{binary} SASS"
    return (f"; kernels from compute_{code} PTX, compiled by the driver for sm_{binary} at first use (cached "
            f"between runs)")


def list_devices() -> list:
    """Prints the devices here; returns (device, support grid) for each."""
    print("devices:")
    devices = []
    cpu = torch.device("cpu")
    cpu_grid = supported_grid(cpu)
    print(f"  cpu: {cpu_model()}, {torch.get_num_threads()} torch threads of {os.cpu_count()} cores; "
          f"{describe_support(cpu_grid)}")
    devices.append((cpu, cpu_grid))
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            device = torch.device("cuda", index)
            major, minor = torch.cuda.get_device_capability(index)
            grid = supported_grid(device)
            print(f"  {device}: {torch.cuda.get_device_name(index)}, sm_{major}{minor}; {describe_support(grid)}"
                  f"{describe_code(index) if grid else ''}")
            devices.append((device, grid))
    else:
        print("  cuda: none available")
    return devices


# ---------------------------------------------------------------------------------------------
# Correctness


def sdpa_reference(q, k, v, causal: bool):
    """Attention on the flash layout (batch, seqlen, heads, dim) through torch SDPA, in q's dtype;
    causal is bottom-right aligned as flash_attn defines it."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    mask = None
    if causal:
        mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(seqlen_k - seqlen_q)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def reference_varlen(q, k, v, case: CheckCase, causal: bool):
    """Packed (total, heads, dim) tensors: each sequence through sdpa_reference, concatenated."""
    outs, start_q, start_k = [], 0, 0
    for len_q, len_k in zip(case.seqlens_q, case.seqlens_k):
        outs.append(sdpa_reference(
            q[None, start_q:start_q + len_q], k[None, start_k:start_k + len_k], v[None, start_k:start_k + len_k],
            causal)[0])
        start_q, start_k = start_q + len_q, start_k + len_k
    return torch.cat(outs)


def cumulative(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def make_case_inputs(case: CheckCase, head_dim: int, device):
    """float32 q, k, v, dout: packed (total, h, d) for varlen, else (batch, seqlen, h, d)."""
    if case.varlen:
        shapes_q = (sum(case.seqlens_q), case.nheads, head_dim)
        shapes_k = (sum(case.seqlens_k), case.nheads_k, head_dim)
    else:
        shapes_q = (len(case.seqlens_q), case.seqlens_q[0], case.nheads, head_dim)
        shapes_k = (len(case.seqlens_k), case.seqlens_k[0], case.nheads_k, head_dim)
    return tuple(torch.randn(shape, device=device) for shape in (shapes_q, shapes_k, shapes_k, shapes_q))


def run_attention(kind: str, case: CheckCase, q, k, v, dout, causal: bool):
    """Forward and backward of one implementation; returns [out, dq, dk, dv]."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if kind == "ours" and case.varlen:
        device = q.device
        out = flash_attn.flash_attn_varlen_func(
            q, k, v, cumulative(case.seqlens_q, device), cumulative(case.seqlens_k, device),
            max(case.seqlens_q), max(case.seqlens_k), causal=causal)
    elif kind == "ours":
        out = flash_attn.flash_attn_func(q, k, v, causal=causal)
    elif case.varlen:
        out = reference_varlen(q, k, v, case, causal)
    else:
        out = sdpa_reference(q, k, v, causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return [out.detach(), *grads]


def check_case(case: CheckCase, device, dtype, head_dim: int, causal: bool):
    """Returns (passed, fwd error, bwd error, message)."""
    q, k, v, dout = (t.to(dtype) for t in make_case_inputs(case, head_dim, device))
    exact = run_attention("torch", case, q.float(), k.float(), v.float(), dout.float(), causal)
    try:
        torch_lowp = run_attention("torch", case, q, k, v, dout, causal)
    except RuntimeError:  # torch lacks this dtype here: judge by the absolute tolerance alone
        torch_lowp = exact
    try:
        ours = run_attention("ours", case, q, k, v, dout, causal)
    except Exception as exc:
        return False, None, None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    errors, passed = [], True
    for mine, theirs, ref in zip(ours, torch_lowp, exact):
        err = (mine.float() - ref).abs().max().item()
        torch_err = (theirs.float() - ref).abs().max().item()
        bound = CHECK_SLACK * torch_err + CHECK_ABS_TOL[dtype] * max(1.0, ref.abs().max().item())
        errors.append(err)
        passed = passed and err <= bound
    message = "" if passed else "max abs error out/dq/dk/dv " + " / ".join(f"{e:.2e}" for e in errors)
    return passed, errors[0], max(errors[1:]), message


def check_device(device, grid: dict) -> bool:
    all_passed = True
    for dtype, dims in grid.items():
        head_dims = [d for d in CHECK_HEAD_DIMS if d in dims] or dims[:1]
        for head_dim in head_dims:
            count, failures, worst_fwd, worst_bwd = 0, [], 0.0, 0.0
            for case in CHECK_CASES:
                for causal in (False, True):
                    torch.manual_seed(SEED)
                    passed, err_fwd, err_bwd, message = check_case(case, device, dtype, head_dim, causal)
                    count += 1
                    if err_fwd is not None:
                        worst_fwd, worst_bwd = max(worst_fwd, err_fwd), max(worst_bwd, err_bwd)
                    if not passed:
                        failures.append(f"{case.name} causal={causal}: {message}")
            verdict = "PASS" if not failures else "FAIL"
            print(f"  {verdict} {device} {DTYPE_NAMES[dtype]} head_dim={head_dim}: "
                  f"{count - len(failures)}/{count} cases; max abs error fwd {worst_fwd:.2e}, bwd {worst_bwd:.2e}")
            for failure in failures:
                print(f"       {failure}")
            all_passed = all_passed and not failures
    return all_passed


# ---------------------------------------------------------------------------------------------
# Speed


def median_ms(fn, device) -> float:
    kind = device.type
    for _ in range(WARMUP_REPS[kind]):
        fn()
    if kind == "cuda":
        with torch.cuda.device(device):
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(TIMED_REPS[kind])]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(TIMED_REPS[kind])]
            for start, end in zip(starts, ends):
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    times = []
    for _ in range(TIMED_REPS[kind]):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * MS_PER_S)
    return statistics.median(times)


def bench_device(device, grid: dict):
    shape = BENCH_SHAPE[device.type]
    dtype = next((d for d in BENCH_DTYPE_PREFERENCE if shape.headdim in grid.get(d, ())), None)
    if dtype is None:
        print(f"  {device}: head_dim {shape.headdim} not supported; skipped")
        return
    torch.manual_seed(SEED)
    dims = (shape.batch, shape.seqlen, shape.nheads, shape.headdim)
    q, k, v, dout = (torch.randn(dims, device=device, dtype=dtype) for _ in range(4))
    flash = [t.requires_grad_() for t in (q, k, v)]
    torch_layout = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    dout_torch = dout.transpose(1, 2).contiguous()
    print(f"  {device} {DTYPE_NAMES[dtype]} B={shape.batch} H={shape.nheads} S={shape.seqlen} "
          f"D={shape.headdim} (ms, median; ratio = torch SDPA time / flash_attn time):")
    for causal in (False, True):
        def ours():
            return flash_attn.flash_attn_func(*flash, causal=causal)

        def theirs():
            return F.scaled_dot_product_attention(*torch_layout, is_causal=causal)

        timings = {
            "fwd": (median_ms(ours, device), median_ms(theirs, device)),
            "fwd+bwd": (
                median_ms(lambda: torch.autograd.grad(ours(), flash, dout), device),
                median_ms(lambda: torch.autograd.grad(theirs(), torch_layout, dout_torch), device),
            ),
        }
        for direction, (ms_ours, ms_torch) in timings.items():
            print(f"    causal={str(causal):5} {direction:7}  flash_attn {ms_ours:8.2f}  "
                  f"torch SDPA {ms_torch:8.2f}  ratio {ms_torch / ms_ours:5.2f}x")


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flash_attn",
        description="Report this flash_attn installation, check it against torch and time it against torch SDPA.",
    )
    parser.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    parser.add_argument("--no-bench", action="store_true", help="skip the speed comparison")
    args = parser.parse_args(argv)

    print(f"flash_attn {flash_attn.__version__} ({Path(flash_attn.__file__).parent}; extension "
          f"{_native.C.__file__})")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, Python {platform.python_version()}")
    print_built_kernels()
    devices = [(device, grid) for device, grid in list_devices() if grid]
    if not devices:
        print("no device here is supported by this build of flash_attn")
        return 1

    status = 0
    if not args.no_check:
        print("correctness (forward and backward vs float32 torch SDPA):")
        for device, grid in devices:
            if not check_device(device, grid):
                status = 1
    if not args.no_bench:
        print("speed vs torch SDPA:")
        for device, grid in devices:
            try:
                bench_device(device, grid)
            except Exception as exc:
                print(f"  {device}: benchmark failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}")
    print("all checks passed" if status == 0 and not args.no_check else
          ("checks skipped" if args.no_check else "SOME CHECKS FAILED"))
    return status


if __name__ == "__main__":
    sys.exit(main())
