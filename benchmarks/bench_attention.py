#!/usr/bin/env python3
# The one benchmark CLI of flash_attn, following the project's shared BENCHMARKS.md: times flash_attn against torch
# SDPA (each backend forced), FlexAttention and torch's FA2 varlen kernels (fa2_varlen) side by side in one run, for
# training shapes (TFLOP/s, forward and backward) and decode (TB/s of K+V read), checks each implementation against a
# float32 SDPA reference once per shape, prints a table and writes every row with the machine's metadata to
# benchmarks/results/<date>-<device>-<what>.json. Standalone: needs only torch.

import argparse
import contextlib
import datetime
import inspect
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

DEFAULT_HIDDEN = 2048
DEFAULT_HEADDIMS = (64, 128, 256)
DEFAULT_TOKENS = {"cuda": 16384, "cpu": 4096}  # CPU: fewer tokens so a full run takes minutes on 2 cores
DEFAULT_SEQLENS = {"cuda": (512, 1024, 2048, 4096, 8192, 16384), "cpu": (512, 1024, 2048)}
QUICK_HEADDIMS = (64, 128)
QUICK_SEQLENS = (512, 1024)
QUICK_TOKENS = {"cuda": 16384, "cpu": 2048}

DECODE_HEADS_Q = 32
DECODE_HEADS_KV = 8
DECODE_HEADDIM = 128
DECODE_QUERY_LEN = 1
# (batch, kv length) pairs; the CUDA list is the protocol's, the CPU list fits a small machine's memory.
DECODE_SHAPES = {
    "cuda": ((1, 8192), (1, 131072), (16, 8192), (64, 4096), (8, 32768)),
    "cpu": ((1, 8192), (1, 32768), (8, 4096)),
}
QUICK_DECODE_SHAPE_COUNT = 2

# --sweep: the space beyond the standard table, so no choice is tuned to the table alone: every head-dim bucket,
# GQA ratios, each feature against the same call without it, and varlen with many short documents.
SWEEP_HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)
SWEEP_SEQLEN = {"cuda": 4096, "cpu": 512}
SWEEP_HEADS = 32  # query heads of the GQA, feature and varlen shapes (head dim 128)
SWEEP_HEADDIM = 128
SWEEP_GQA_HEADS_K = (8, 4, 1)
SWEEP_FEATURES = ("none", "softcap", "window", "alibi")
SWEEP_DOC_LENGTHS = {"cuda": (128, 512), "cpu": (64, 128)}
SOFTCAP = 50.0
WINDOW_FRACTION = 4  # window left = seqlen / 4 (causal: the key window ends at the diagonal)
ALIBI_SLOPE_EXPONENT = 8.0  # slopes 2^(-8 (i + 1) / nheads), the ALiBi paper's

FLOPS_PER_QK_PV_ELEMENT = 4  # two matmuls (QK^T and PV), two flops per multiply-add
CAUSAL_WORK_FRACTION = 0.5
BWD_FLOPS_PER_FWD_FLOP = 2.5
FLOPS_PER_TFLOP = 1e12
FLOPS_PER_GFLOP = 1e9
BYTES_PER_TB = 1e12
BYTES_PER_GB = 1e9
MS_PER_S = 1e3
KV_TENSOR_COUNT = 2  # K and V
COPY_TRAFFIC_PER_BYTE = 2  # a copy reads and writes every byte

CPU_WARMUP_REPS = 1
DEFAULT_REPS = {"cuda": 100, "cpu": 3}
CUDA_WARMUP_REPS = 10
DO_BENCH_WARMUP_MS = 25
DEFAULT_DO_BENCH_REP_MS = 100

SEED = 0
# max |impl - float32 reference| must stay below TOL * max(1, max |reference|); loose on purpose:
# it catches wrong answers, not last-bit differences in the accumulation order.
CHECK_TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-3}
NOT_CHECKED = "not checked (--no-check)"
ERROR_MESSAGE_MAX_CHARS = 400
TORCH_SOURCE_NOTE = re.compile(r"\(Triggered internally at [^)]*\)")

OURS = "flash_attn"
# The same calls with FLASH_ATTN_HOPPER=force: the Hopper kernels (csrc/sm90/), or an error row where they do not
# serve the call; `flash_attn` runs what dispatch picks by default.
OURS_HOPPER = "flash_attn_hopper"
# And with FLASH_ATTN_HOPPER=0: the portable kernels (csrc/sm80/), to time what the Hopper path replaces.
OURS_PORTABLE = "flash_attn_portable"
OURS_SWITCHED = {OURS_HOPPER: "force", OURS_PORTABLE: "0"}
HOPPER_SWITCH = "FLASH_ATTN_HOPPER"
COPY_CEILING = "copy_ceiling"
# FlashAttention-2's varlen kernels as torch ships them (torch.nn.attention.varlen.varlen_attn, torch >= 2.10): the FA2
# peer of the window and document rows, which SDPA cannot express; equal-length batches run as equal documents.
FA2_VARLEN = "fa2_varlen"
ALL_IMPLS = (OURS, OURS_HOPPER, OURS_PORTABLE, "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "flex",
             FA2_VARLEN)
DEFAULT_IMPLS = {
    "cuda": (OURS, "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex"),
    "cpu": (OURS, "sdpa"),
}


@dataclass(frozen=True)
class Problem:
    """One attention shape on one device; sequence lengths may differ (decode)."""

    device: str
    dtype: torch.dtype
    batch: int
    nheads: int
    nheads_k: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    causal: bool
    feature: str = "none"  # --sweep: softcap, window, alibi, varlen (documents of doc_len tokens, batch 1)
    doc_len: int = 0

    @property
    def gqa(self) -> bool:
        return self.nheads != self.nheads_k

    @property
    def window_left(self) -> int:
        return self.seqlen_k // WINDOW_FRACTION

    def fwd_flops(self) -> float:
        """Flops of the visible (query, key) pairs: the causal triangle, the window band, or the documents."""
        per_pair = FLOPS_PER_QK_PV_ELEMENT * self.batch * self.nheads * self.headdim
        if self.feature == "varlen":
            docs = self.seqlen_q // self.doc_len
            pairs = docs * self.doc_len * self.doc_len
            return per_pair * (pairs * CAUSAL_WORK_FRACTION if self.causal else pairs)
        if self.feature == "window":
            w = self.window_left
            band = self.seqlen_q * (w + 1) - w * (w + 1) // 2  # causal: keys i - w ... i of each query i
            return per_pair * (band if self.causal else 2 * band - self.seqlen_q)
        work = per_pair * self.seqlen_q * self.seqlen_k
        return work * CAUSAL_WORK_FRACTION if self.causal else work

    def alibi_slopes(self) -> torch.Tensor:
        exponents = torch.arange(1, self.nheads + 1, dtype=torch.float32, device=self.device)
        return 2.0 ** (-ALIBI_SLOPE_EXPONENT * exponents / self.nheads)

    def doc_ids(self) -> torch.Tensor:
        return torch.arange(self.seqlen_q, device=self.device) // self.doc_len

    def kv_bytes(self) -> int:
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        return KV_TENSOR_COUNT * self.batch * self.seqlen_k * self.nheads_k * self.headdim * element_bytes


@dataclass
class Impl:
    """A timed implementation: the layout it reads, how to build its forward, the context it runs in."""

    name: str
    layout: str  # "bshd" (flash_attn's) or "bhsd" (torch SDPA's)
    build: Callable[[Problem], Callable]
    context: Callable[[], contextlib.AbstractContextManager]


# ---------------------------------------------------------------------------------------------
# Implementations


def import_flash_attn():
    """Returns (module, None) or (None, reason); falls back to the repo checkout when not installed."""
    try:
        import flash_attn

        return flash_attn, None
    except ModuleNotFoundError as exc:
        if exc.name != "flash_attn":
            return None, f"ModuleNotFoundError: {exc}"
    except Exception as exc:  # a broken build must not stop the peers from being measured
        return None, f"{type(exc).__name__}: {exc}"
    sys.path.insert(0, str(REPO_ROOT))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]
    try:
        import flash_attn

        return flash_attn, None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def environment_variable(name: str, value: str):
    """Sets os.environ[name] for the block (flash_attn reads its switches on every call), then restores it."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


# The CUDA kernels' head-dim buckets (tools/kernel_matrix.py HEAD_DIM_BUCKETS).
CUDA_HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)


def mask_kind(p: Problem) -> str:
    return "local" if p.feature == "window" else ("causal" if p.causal else "none")


def kernels_built_for(fa_module, p: Problem, backward: bool) -> bool:
    """Whether the build has CUDA kernels of this call's dtype, head-dim bucket and mask kind in each direction it
    runs. is_supported asks for every mask kind, which a build narrowed with FLASH_ATTN_MASKS (tools/ab_bench.sh, to
    compile a third fewer kernels) lacks, though it runs the calls of the kinds it has."""
    bucket = next((b for b in CUDA_HEAD_DIM_BUCKETS if p.headdim <= b), None)
    have = {k["direction"] for k in fa_module.built_kernels()
            if k["device"] == "cuda" and k["dtype"] == DTYPE_NAMES[p.dtype] and k["head_dim"] == bucket
            and k["mask"] == mask_kind(p)}
    return {"fwd", "bwd"} <= have if backward else "fwd" in have


def make_ours(fa_module, fa_error, backward: bool, name: str = OURS, deterministic: bool = False) -> Impl:
    def build(p: Problem):
        if fa_module is None:
            raise RuntimeError(f"flash_attn is not importable: {fa_error}")
        device = torch.device(p.device)
        supported = fa_module.is_supported(device, p.dtype, p.headdim, backward=backward) or (
            device.type == "cuda" and kernels_built_for(fa_module, p, backward))
        if not supported:
            raise RuntimeError(
                f"flash_attn.is_supported({p.device}, {DTYPE_NAMES[p.dtype]}, head_dim={p.headdim}) is False and "
                f"the build has no {mask_kind(p)} kernels of that bucket"
            )
        if p.feature == "varlen":
            cu = torch.arange(0, p.seqlen_q + 1, p.doc_len, dtype=torch.int32, device=p.device)
            # squeeze, not q[0]: the backward of a select builds a zeroed full-size gradient and copies into it
            # (two extra passes over each of dq, dk, dv that a packed-tensor caller never pays).
            return lambda q, k, v: fa_module.flash_attn_varlen_func(
                q.squeeze(0), k.squeeze(0), v.squeeze(0), cu, cu, p.doc_len, p.doc_len, causal=p.causal,
                deterministic=deterministic).unsqueeze(0)
        extra = {"deterministic": True} if deterministic else {}
        if p.feature == "softcap":
            extra["softcap"] = SOFTCAP
        elif p.feature == "window":
            extra["window_size"] = (p.window_left, 0 if p.causal else p.window_left)
        elif p.feature == "alibi":
            extra["alibi_slopes"] = p.alibi_slopes()
        return lambda q, k, v: fa_module.flash_attn_func(q, k, v, causal=p.causal, **extra)

    def context():
        if name in OURS_SWITCHED:
            return environment_variable(HOPPER_SWITCH, OURS_SWITCHED[name])
        return contextlib.nullcontext()

    return Impl(name, "bshd", build, context)


def make_sdpa(name: str, backend_name: Optional[str]) -> Impl:
    def build(p: Problem):
        if p.feature != "none":
            raise RuntimeError(f"torch SDPA has no {p.feature} argument (FlexAttention runs it)")
        extra = {"enable_gqa": True} if p.gqa else {}
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=p.causal, **extra)

    def context():
        if backend_name is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, backend_name))

    return Impl(name, "bhsd", build, context)


def make_fa2_varlen() -> Impl:
    def build(p: Problem):
        if p.device != "cuda":
            raise RuntimeError("torch's varlen_attn runs on CUDA only")
        if p.feature in ("softcap", "alibi"):
            raise RuntimeError(f"torch's varlen_attn has no {p.feature} argument")
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as exc:
            raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)") from exc
        accepts = inspect.signature(varlen_attn).parameters
        extra = {}
        if "window_size" in accepts:  # torch >= 2.11: (left, right), -1 unbounded; (-1, 0) is causal
            left = p.window_left if p.feature == "window" else -1
            extra["window_size"] = (left, 0 if p.causal else left)
        elif p.feature == "window":
            raise RuntimeError(f"torch {torch.__version__}'s varlen_attn has no window_size (torch >= 2.11)")
        else:
            extra["is_causal"] = p.causal
        # Without enable_gqa (torch 2.11) FA2's MHA kernels run on K / V repeated to the query heads inside the call.
        # The backward row (forward + backward less forward) then holds autograd's sum of dK / dV over each group,
        # the reduction FA2's own GQA backward runs on its expanded dK / dV; the forward row also holds the copy
        # (tools/sweep_table.py compares GQA forwards with sdpa_flash only).
        repeat = 1
        if p.gqa:
            if "enable_gqa" in accepts:
                extra["enable_gqa"] = True
            else:
                repeat = p.nheads // p.nheads_k
        length_q = p.doc_len if p.feature == "varlen" else p.seqlen_q
        length_k = p.doc_len if p.feature == "varlen" else p.seqlen_k
        docs = p.batch * p.seqlen_q // length_q
        cu_q = torch.arange(0, docs + 1, dtype=torch.int32, device=p.device) * length_q
        cu_k = torch.arange(0, docs + 1, dtype=torch.int32, device=p.device) * length_k

        def call(q, k, v):
            k_flat, v_flat = (t.reshape(-1, p.nheads_k, p.headdim) for t in (k, v))
            if repeat > 1:
                k_flat, v_flat = (t.repeat_interleave(repeat, dim=1) for t in (k_flat, v_flat))
            out = varlen_attn(q.reshape(-1, p.nheads, p.headdim), k_flat, v_flat, cu_q, cu_k, length_q, length_k,
                              **extra)
            return out.view(q.shape)

        return call

    return Impl(FA2_VARLEN, "bshd", build, contextlib.nullcontext)


def make_flex() -> Impl:
    def build(p: Problem):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

        torch._dynamo.reset()  # one compilation per shape; never hit the recompile limit and fall back to eager
        compiled = torch.compile(flex_attention, dynamic=False)
        offset = p.seqlen_k - p.seqlen_q  # bottom-right aligned, as flash_attn defines causal

        window = p.window_left if p.feature == "window" else None
        docs = p.doc_ids() if p.feature == "varlen" else None

        def visible(b, h, q_idx, kv_idx):
            keep = q_idx + offset >= kv_idx if p.causal else q_idx == q_idx
            if window is not None:
                keep = keep & (q_idx + offset - kv_idx <= window) & (kv_idx - q_idx - offset <= window)
            if docs is not None:
                keep = keep & (docs[q_idx] == docs[kv_idx])
            return keep

        plain = not p.causal and window is None and docs is None
        # Always an explicit mask built for this shape: with block_mask=None, decode (seqlen_q = 1) measured
        # 0.11 TB/s on the H200 (torch 2.11) against 2.8 TB/s with a full mask from create_block_mask.
        block_mask = create_block_mask(
            noop_mask if plain else visible, B=None, H=None, Q_LEN=p.seqlen_q, KV_LEN=p.seqlen_k, device=p.device,
        )
        extra = {"enable_gqa": True} if p.gqa else {}
        if p.feature == "softcap":
            extra["score_mod"] = lambda score, b, h, q_idx, kv_idx: SOFTCAP * torch.tanh(score / SOFTCAP)
        elif p.feature == "alibi":
            slopes = p.alibi_slopes()
            extra["score_mod"] = lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx + offset - kv_idx).abs()
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, **extra)

    return Impl("flex", "bhsd", build, contextlib.nullcontext)


def make_impls(names, fa_module, fa_error, backward: bool, deterministic: bool = False) -> list:
    factories = {
        OURS: lambda: make_ours(fa_module, fa_error, backward, OURS, deterministic),
        OURS_HOPPER: lambda: make_ours(fa_module, fa_error, backward, OURS_HOPPER, deterministic),
        OURS_PORTABLE: lambda: make_ours(fa_module, fa_error, backward, OURS_PORTABLE, deterministic),
        "sdpa": lambda: make_sdpa("sdpa", None),
        "sdpa_flash": lambda: make_sdpa("sdpa_flash", "FLASH_ATTENTION"),
        "sdpa_cudnn": lambda: make_sdpa("sdpa_cudnn", "CUDNN_ATTENTION"),
        "sdpa_efficient": lambda: make_sdpa("sdpa_efficient", "EFFICIENT_ATTENTION"),
        "sdpa_math": lambda: make_sdpa("sdpa_math", "MATH"),
        "flex": make_flex,
        FA2_VARLEN: make_fa2_varlen,
    }
    return [factories[name]() for name in names]


# ---------------------------------------------------------------------------------------------
# Timing


def time_cpu(fn, reps: int) -> float:
    for _ in range(CPU_WARMUP_REPS):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * MS_PER_S)
    return statistics.median(times)


def time_cuda(fn, reps: int, rep_ms: float) -> float:
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=DO_BENCH_WARMUP_MS, rep=rep_ms, return_mode="median"))
    for _ in range(CUDA_WARMUP_REPS):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def timer_description(device: str, args) -> str:
    if device == "cpu":
        return f"time.perf_counter, {CPU_WARMUP_REPS} warm-up, median of {args.reps}"
    try:
        import triton

        budget = f"warmup {DO_BENCH_WARMUP_MS} ms, rep {args.rep_ms} ms"
        return f"triton.testing.do_bench {triton.__version__} ({budget}, median)"
    except ImportError:
        return f"CUDA events, {CUDA_WARMUP_REPS} warm-up, median of {args.reps}"


# ---------------------------------------------------------------------------------------------
# Inputs and correctness


def make_inputs(p: Problem, need_grad: bool) -> dict:
    """Same random values in both layouts (q, k, v, dout), each contiguous in its own layout."""
    q = torch.randn(p.batch, p.seqlen_q, p.nheads, p.headdim, device=p.device, dtype=p.dtype)
    k = torch.randn(p.batch, p.seqlen_k, p.nheads_k, p.headdim, device=p.device, dtype=p.dtype)
    v = torch.randn(p.batch, p.seqlen_k, p.nheads_k, p.headdim, device=p.device, dtype=p.dtype)
    dout = torch.randn(p.batch, p.seqlen_q, p.nheads, p.headdim, device=p.device, dtype=p.dtype)
    bshd = [t.requires_grad_(need_grad) for t in (q, k, v)] + [dout]
    bhsd = [t.detach().transpose(1, 2).contiguous().requires_grad_(need_grad) for t in (q, k, v)]
    bhsd.append(dout.transpose(1, 2).contiguous())
    return {"bshd": bshd, "bhsd": bhsd}


def to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2) if layout == "bshd" else t


def feature_reference(p: Problem, q32, k32, v32):
    """Attention with p's feature written out in float32 (scores materialised): softcap, ALiBi, window, documents."""
    group = p.nheads // p.nheads_k
    k32, v32 = k32.repeat_interleave(group, dim=1), v32.repeat_interleave(group, dim=1)
    if p.feature == "varlen":
        # Equal documents back to back, each attending to itself: batched per document, since the whole sequence's
        # masked scores (32 GiB at 16k tokens and 32 heads) do not fit.
        docs, heads = p.seqlen_q // p.doc_len, q32.shape[1]

        def per_document(t):
            return t.reshape(heads, docs, p.doc_len, p.headdim).transpose(0, 1)

        scores = per_document(q32) @ per_document(k32).transpose(-1, -2) * p.headdim ** -0.5
        if p.causal:
            local = torch.arange(p.doc_len, device=p.device)
            scores = scores.masked_fill(local.view(1, -1) > local.view(-1, 1), float("-inf"))
        out = torch.softmax(scores, dim=-1) @ per_document(v32)
        return out.transpose(0, 1).reshape(1, heads, p.seqlen_q, p.headdim)
    scores = q32 @ k32.transpose(-1, -2) * p.headdim ** -0.5
    rows = torch.arange(p.seqlen_q, device=p.device).view(-1, 1) + (p.seqlen_k - p.seqlen_q)
    cols = torch.arange(p.seqlen_k, device=p.device).view(1, -1)
    keep = cols <= rows if p.causal else torch.ones_like(cols <= rows)
    if p.feature == "softcap":
        scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
    elif p.feature == "alibi":
        scores = scores - p.alibi_slopes().view(-1, 1, 1) * (rows - cols).abs()
    elif p.feature == "window":
        keep = keep & ((rows - cols).abs() <= p.window_left)
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v32


def reference(p: Problem, inputs: dict, need_grad: bool):
    """float32 SDPA (default backend) on the same values, or the written-out attention for a --sweep feature:
    (out, [dq, dk, dv] or None), layout bhsd."""
    q, k, v, dout = inputs["bhsd"]
    q32, k32, v32 = (t.detach().float().requires_grad_(need_grad) for t in (q, k, v))
    if p.feature != "none":
        out = feature_reference(p, q32, k32, v32)
        grads = list(torch.autograd.grad(out, (q32, k32, v32), dout.float())) if need_grad else None
        return out.detach(), grads
    extra = {"enable_gqa": True} if p.gqa else {}
    mask = None
    if p.causal and p.seqlen_q != p.seqlen_k:
        mask = torch.ones(p.seqlen_q, p.seqlen_k, dtype=torch.bool, device=p.device).tril(p.seqlen_k - p.seqlen_q)
    is_causal = p.causal and mask is None
    out = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask, is_causal=is_causal, **extra)
    grads = list(torch.autograd.grad(out, (q32, k32, v32), dout.float())) if need_grad else None
    return out.detach(), grads


def max_err_and_bound(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype):
    err = (actual.float() - expected).abs().max().item()
    bound = CHECK_TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
    return err, bound


def check_impl(fn, impl: Impl, p: Problem, inputs: dict, ref, need_grad: bool) -> dict:
    """Runs the implementation once (fwd, and bwd when timed) and compares with the reference."""
    q, k, v, dout = inputs[impl.layout]
    out = fn(q, k, v)
    err, bound = max_err_and_bound(to_bhsd(out, impl.layout), ref[0], p.dtype)
    result = {"max_abs_err": err, "check": "pass" if err <= bound else "fail"}
    if need_grad:
        grads = torch.autograd.grad(out, (q, k, v), dout)
        worst = [max_err_and_bound(to_bhsd(g, impl.layout), r, p.dtype) for g, r in zip(grads, ref[1])]
        result["max_abs_err_grad"] = max(e for e, _ in worst)
        result["check_grad"] = "pass" if all(e <= b for e, b in worst) else "fail"
    return result


# ---------------------------------------------------------------------------------------------
# One shape, all implementations


def short_error(exc: BaseException, caught) -> str:
    text = f"{type(exc).__name__}: {str(exc).strip()}"
    reasons = [TORCH_SOURCE_NOTE.sub("", str(w.message)).strip() for w in caught]
    reasons = list(dict.fromkeys(reason for reason in reasons if reason))
    if reasons:
        text += " | warnings: " + " ; ".join(reasons)
    text = re.sub(r"\s+", " ", text)
    return text[:ERROR_MESSAGE_MAX_CHARS]


def base_row(impl_name: str, p: Problem, direction: str) -> dict:
    return {
        "impl": impl_name,
        "dtype": DTYPE_NAMES[p.dtype],
        "headdim": p.headdim,
        "seqlen": p.seqlen_k,
        "seqlen_q": p.seqlen_q,
        "batch": p.batch,
        "nheads": p.nheads,
        "nheads_k": p.nheads_k,
        "causal": p.causal,
        "feature": p.feature,
        "doc_len": p.doc_len,
        "direction": direction,
        "ms": None,
        "tflops": None,
        "tbps": None,
        "max_abs_err": None,
        "check": None,
        "error": None,
    }


def free_device_memory(device: str):
    if device == "cuda":
        torch.cuda.empty_cache()


def measure(fn, device: str, args) -> float:
    if device == "cuda":
        return time_cuda(fn, args.reps, args.rep_ms)
    return time_cpu(fn, args.reps)


def bench_shape(p: Problem, impls, directions, args, decode: bool) -> list:
    need_grad = "bwd" in directions
    rows = []
    inputs = make_inputs(p, need_grad)
    if args.no_check:
        ref, ref_error = None, NOT_CHECKED
    else:
        try:
            ref = reference(p, inputs, need_grad)
            ref_error = None
        except Exception as exc:
            ref, ref_error = None, f"reference failed: {short_error(exc, [])}"
            free_device_memory(p.device)
    for impl in impls:
        fwd_row = base_row(impl.name, p, "fwd")
        bwd_row = base_row(impl.name, p, "bwd")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with impl.context():
                    fn = impl.build(p)
                    q, k, v, dout = inputs[impl.layout]
                    if ref is not None:
                        checked = check_impl(fn, impl, p, inputs, ref, need_grad)
                        fwd_row.update(max_abs_err=checked["max_abs_err"], check=checked["check"])
                        if need_grad:
                            bwd_row.update(
                                max_abs_err=checked["max_abs_err_grad"], check=checked["check_grad"]
                            )
                    else:
                        fwd_row["check"] = bwd_row["check"] = ref_error
                        # The check's call was the first one (plans, caches, lazy loading): keep it out of the timing.
                        out = fn(q, k, v)
                        if need_grad:
                            torch.autograd.grad(out, (q, k, v), dout)
                    ms_fwd = measure(lambda: fn(q, k, v), p.device, args)
                    fwd_row["ms"] = ms_fwd
                    if decode:
                        fwd_row["tbps"] = p.kv_bytes() / (ms_fwd / MS_PER_S) / BYTES_PER_TB
                    else:
                        fwd_row["tflops"] = p.fwd_flops() / (ms_fwd / MS_PER_S) / FLOPS_PER_TFLOP
                    if need_grad:
                        ms_both = measure(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout), p.device, args)
                        ms_bwd = ms_both - ms_fwd
                        bwd_row.update(ms=ms_bwd, ms_fwd_bwd=ms_both)
                        if ms_bwd > 0:
                            bwd_flops = BWD_FLOPS_PER_FWD_FLOP * p.fwd_flops()
                            bwd_row["tflops"] = bwd_flops / (ms_bwd / MS_PER_S) / FLOPS_PER_TFLOP
            except Exception as exc:
                reason = short_error(exc, caught)
                for row in (fwd_row, bwd_row):
                    if row["ms"] is None:
                        row["error"] = reason
                free_device_memory(p.device)
        rows.append(fwd_row)
        if need_grad:
            rows.append(bwd_row)
    if decode:
        rows.append(copy_ceiling_row(p, args))
    return rows


def copy_ceiling_row(p: Problem, args) -> dict:
    """Device-to-device copy of as many bytes as K+V: the bandwidth roof for decode (read + written)."""
    row = base_row(COPY_CEILING, p, "fwd")
    try:
        src = torch.empty(p.kv_bytes(), dtype=torch.uint8, device=p.device)
        dst = torch.empty_like(src)
        ms = measure(lambda: dst.copy_(src), p.device, args)
        row.update(ms=ms, tbps=COPY_TRAFFIC_PER_BYTE * p.kv_bytes() / (ms / MS_PER_S) / BYTES_PER_TB)
    except Exception as exc:
        row["error"] = short_error(exc, [])
    return row


# ---------------------------------------------------------------------------------------------
# Shapes


def parse_list(text: str, convert=int) -> list:
    return [convert(item) for item in text.split(",") if item.strip()]


def training_problems(args) -> list:
    problems = []
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for dtype_name in args.dtypes:
        for headdim in args.headdims:
            if args.hidden % headdim:
                raise SystemExit(f"--hidden {args.hidden} must be a multiple of every --headdim; got {headdim}")
            nheads = args.hidden // headdim
            nheads_k = args.heads_k if args.heads_k else nheads
            if nheads % nheads_k:
                raise SystemExit(f"--heads-k {nheads_k} must divide the {nheads} query heads of head dim {headdim}")
            for causal in causal_values:
                for seqlen in args.seqlens:
                    batch = args.batch if args.batch else max(1, args.tokens // seqlen)
                    if args.doc_len:  # one varlen batch of the same tokens, in documents of doc_len
                        tokens = batch * seqlen
                        problems.append(
                            Problem(args.device, DTYPES[dtype_name], 1, nheads, nheads_k, tokens, tokens, headdim,
                                    causal, feature="varlen", doc_len=args.doc_len)
                        )
                        continue
                    problems.append(
                        Problem(args.device, DTYPES[dtype_name], batch, nheads, nheads_k, seqlen, seqlen, headdim,
                                causal, feature=args.feature)
                    )
    return problems


def sweep_problems(args) -> list:
    """--sweep: each head-dim bucket, GQA ratios, each feature and the same call without it, short documents."""
    seqlen = args.seqlens[0] if args.seqlens_given else SWEEP_SEQLEN[args.device]
    batch = args.batch if args.batch else max(1, args.tokens // seqlen)
    causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    problems = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for causal in causal_values:
            for headdim in (args.headdims if args.headdims_given else SWEEP_HEADDIMS):
                nheads = max(1, args.hidden // headdim)
                problems.append(Problem(args.device, dtype, batch, nheads, nheads, seqlen, seqlen, headdim, causal))
            for heads_k in SWEEP_GQA_HEADS_K:
                problems.append(Problem(args.device, dtype, batch, SWEEP_HEADS, heads_k, seqlen, seqlen,
                                        SWEEP_HEADDIM, causal))
            for feature in SWEEP_FEATURES:
                problems.append(Problem(args.device, dtype, batch, SWEEP_HEADS, SWEEP_HEADS, seqlen, seqlen,
                                        SWEEP_HEADDIM, causal, feature=feature))
            for doc_len in SWEEP_DOC_LENGTHS[args.device]:
                tokens = batch * seqlen
                problems.append(Problem(args.device, dtype, 1, SWEEP_HEADS, SWEEP_HEADS, tokens, tokens,
                                        SWEEP_HEADDIM, causal, feature="varlen", doc_len=doc_len))
    return problems


def decode_problems(args) -> list:
    if args.seqlens_given:
        shapes = [(args.batch or 1, seqlen) for seqlen in args.seqlens]
    else:
        shapes = list(DECODE_SHAPES[args.device])
        if args.quick:
            shapes = shapes[:QUICK_DECODE_SHAPE_COUNT]
    return [
        Problem(
            args.device, DTYPES[dtype_name], batch, DECODE_HEADS_Q, DECODE_HEADS_KV,
            DECODE_QUERY_LEN, kv_len, DECODE_HEADDIM, False,
        )
        for dtype_name in args.dtypes
        for batch, kv_len in shapes
    ]


# ---------------------------------------------------------------------------------------------
# Environment and output


def git_output(*cmd) -> Optional[str]:
    try:
        done = subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
        return done.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else cpu_model()


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def environment(args, fa_module, fa_error) -> dict:
    status = git_output("status", "--porcelain")
    env = {
        # FLASH_ATTN_COMMIT: set where the checkout travels without its history (a copied working tree).
        "commit": os.environ.get("FLASH_ATTN_COMMIT") or git_output("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": args.device,
        "device_name": device_name(args.device),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "python_version": platform.python_version(),
        "flash_attn_version": getattr(fa_module, "__version__", None),
        "flash_attn_path": getattr(fa_module, "__file__", None),
        "flash_attn_import_error": fa_error,
        "timer": timer_description(args.device, args),
        "protocol": "BENCHMARKS.md",
    }
    if args.device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        env["capability"] = f"sm_{major}{minor}"
    try:
        import triton

        env["triton_version"] = triton.__version__
    except ImportError:
        env["triton_version"] = None
    return env


def default_out_path(args, name: str) -> Path:
    what = "decode" if args.decode else ("sweep" if args.sweep else "attention")
    if args.quick:
        what += "-quick"
    stem = f"{datetime.date.today().isoformat()}-{slug(name)}-{what}"
    path = RESULTS_DIR / f"{stem}.json"
    index = 2
    while path.exists():
        path = RESULTS_DIR / f"{stem}-{index}.json"
        index += 1
    return path


def json_args(args) -> dict:
    return {key: value for key, value in vars(args).items() if key not in ("seqlens_given", "headdims_given")}


# ---------------------------------------------------------------------------------------------
# Table


def rate_unit(device: str, decode: bool):
    """(label, multiplier from the JSON's TFLOP/s or TB/s) for the table."""
    if decode:
        return ("TB/s", 1.0) if device == "cuda" else ("GB/s", BYTES_PER_TB / BYTES_PER_GB)
    return ("TFLOP/s", 1.0) if device == "cuda" else ("GFLOP/s", FLOPS_PER_TFLOP / FLOPS_PER_GFLOP)


def rate_of(row: dict) -> Optional[float]:
    return row["tbps"] if row["tbps"] is not None else row["tflops"]


def format_rate(row: Optional[dict], scale: float) -> str:
    if row is None:
        return "-"
    rate = rate_of(row)
    if rate is None:
        return "n/a"
    return f"{rate * scale:.1f}" + ("!" if row.get("check") == "fail" else "")


def ratio_to_best_peer(rows: list) -> Optional[float]:
    """Our default dispatch against the best of the other libraries (not against our own switched rows)."""
    ours = next((rate_of(r) for r in rows if r["impl"] == OURS), None)
    peers = [rate_of(r) for r in rows
             if r["impl"] not in (OURS, *OURS_SWITCHED, COPY_CEILING) and rate_of(r) is not None]
    if ours is None or not peers:
        return None
    return ours / max(peers)


class Table:
    """Prints one line per shape as results arrive; cells are 'fwd/bwd' rates, '!' marks a failed check."""

    CELL_WIDTH = 15  # wider where an implementation's name is longer (one space between columns)

    def __init__(self, impl_names, directions, device: str, decode: bool):
        self.impl_names = list(impl_names) + ([COPY_CEILING] if decode else [])
        self.directions = directions
        self.decode = decode
        self.unit, self.scale = rate_unit(device, decode)
        self.notes = {}
        self.widths = {name: max(self.CELL_WIDTH, len(name) + 1) for name in self.impl_names}

    def header(self):
        what = "/".join(self.directions) if not self.decode else "decode, K+V bytes read once"
        print(f"\nrates in {self.unit} ({what}); ratio = {OURS} / best peer; '!' = failed correctness check")
        shape = f"{'dtype':>5} {'hdim':>4} {'causal':>6} {'B':>4} {'Hq/Hk':>6} {'seqlen':>7}"
        cells = "".join(f"{name:>{self.widths[name]}}" for name in self.impl_names)
        print(shape + cells + f"{'ratio':>{self.CELL_WIDTH}}", flush=True)

    def add(self, p: Problem, rows: list):
        shape = (
            f"{DTYPE_NAMES[p.dtype]:>5} {p.headdim:>4} {str(p.causal):>6} {p.batch:>4} "
            f"{f'{p.nheads}/{p.nheads_k}':>6} {p.seqlen_k:>7}"
        )
        if p.feature != "none":
            shape += f" {p.feature}{f' docs of {p.doc_len}' if p.feature == 'varlen' else ''}"
        cells = []
        for name in self.impl_names:
            parts = []
            for direction in self.directions:
                row = next((r for r in rows if r["impl"] == name and r["direction"] == direction), None)
                parts.append(format_rate(row, self.scale))
                if row is not None and row["error"]:
                    self.notes.setdefault(name, []).append(row["error"])
            cells.append(f"{'/'.join(parts):>{self.widths[name]}}")
        ratios = []
        for direction in self.directions:
            ratio = ratio_to_best_peer([r for r in rows if r["direction"] == direction])
            ratios.append("-" if ratio is None else f"{ratio:.2f}")
        print(shape + "".join(cells) + f"{'/'.join(ratios):>{self.CELL_WIDTH}}", flush=True)

    def footer(self):
        if not self.notes:
            return
        print("\nnot measured (every reason is in the JSON rows):")
        for name, reasons in self.notes.items():
            others = len(set(reasons)) - 1
            more = f" (+{others} other reasons)" if others else ""
            print(f"  {name}, {len(reasons)} shape/direction cells: {reasons[0]}{more}")


# ---------------------------------------------------------------------------------------------
# CLI


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Benchmark flash_attn against torch SDPA backends and FlexAttention (BENCHMARKS.md protocol).",
    )
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device)
    parser.add_argument("--dtype", default="bf16", help="comma list of bf16,fp16,fp32 (default bf16)")
    parser.add_argument("--headdim", default=None, help="comma list (default 64,128,256; --quick: 64,128)")
    parser.add_argument(
        "--seqlen", default=None,
        help="comma list (default CUDA 512..16384, CPU 512,1024,2048; with --decode: KV lengths)",
    )
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--direction", choices=("fwd", "bwd", "both"), default="both")
    parser.add_argument("--batch", type=int, default=None, help="fixed batch (default tokens // seqlen)")
    parser.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN, help="nheads = hidden / headdim")
    parser.add_argument(
        "--heads-k", type=int, default=None,
        help="KV heads of the training shapes (GQA / MQA; default: as many as query heads)",
    )
    parser.add_argument(
        "--tokens", type=int, default=None,
        help=f"batch = tokens // seqlen (default CUDA {DEFAULT_TOKENS['cuda']}, CPU {DEFAULT_TOKENS['cpu']})",
    )
    parser.add_argument(
        "--reps", type=int, default=None,
        help=f"timed repetitions, median taken (default CPU {DEFAULT_REPS['cpu']}; CUDA without triton "
        f"{DEFAULT_REPS['cuda']})",
    )
    parser.add_argument(
        "--rep-ms", type=float, default=DEFAULT_DO_BENCH_REP_MS, help="CUDA with triton: do_bench time budget"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument(
        "--decode", action="store_true",
        help=f"decode protocol: 1 query token, GQA {DECODE_HEADS_Q}/{DECODE_HEADS_KV}, hdim {DECODE_HEADDIM}, TB/s",
    )
    parser.add_argument(
        "--impls", default=None,
        help=f"comma list from {','.join(ALL_IMPLS)} (default CUDA {','.join(DEFAULT_IMPLS['cuda'])}; "
        f"CPU {','.join(DEFAULT_IMPLS['cpu'])})",
    )
    parser.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/<date>-<device>-<what>.json)"
    )
    parser.add_argument("--no-save", action="store_true", help="print the table only")
    parser.add_argument(
        "--no-check", action="store_true",
        help="skip the fp32 reference and the correctness check (each call still runs once before it is timed): for "
        "repeated rounds of shapes an earlier run checked (tools/ab_bench.sh AB_CHECK_ROUNDS)",
    )
    parser.add_argument(
        "--deterministic", action="store_true",
        help="flash_attn's calls with deterministic=True (the backward's fixed-order dQ; peers unchanged)",
    )
    parser.add_argument(
        "--feature", choices=SWEEP_FEATURES, default="none",
        help="the training shapes with softcap, a window or ALiBi (as --sweep adds them; SDPA peers run none)",
    )
    parser.add_argument(
        "--doc-len", type=int, default=0,
        help="the training shapes as one varlen batch of the same tokens in documents of this many tokens (as "
        "--sweep's varlen rows, at any --headdim; SDPA peers run none)",
    )
    parser.add_argument("--quick", action="store_true", help="a few shapes, for a smoke test")
    parser.add_argument(
        "--sweep", action="store_true",
        help="beyond the standard table: every head-dim bucket, GQA 32/8, 32/4, 32/1, softcap / window / ALiBi "
        "against the same call without them, varlen with short documents (one --seqlen, default CUDA 4096)",
    )
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here; use --device cpu")
    if args.doc_len < 0 or (args.doc_len and args.feature != "none"):
        parser.error(f"--doc-len must be positive and without --feature; got --doc-len {args.doc_len} "
                     f"--feature {args.feature}")
    args.dtypes = parse_list(args.dtype, str)
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"--dtype: unknown {unknown}; choose from {','.join(DTYPES)}")
    args.headdims_given = args.headdim is not None
    args.headdims = parse_list(args.headdim) if args.headdim else list(
        QUICK_HEADDIMS if args.quick else DEFAULT_HEADDIMS
    )
    args.seqlens_given = args.seqlen is not None
    args.seqlens = parse_list(args.seqlen) if args.seqlen else list(
        QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS[args.device]
    )
    if args.tokens is None:
        args.tokens = (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)[args.device]
    if args.reps is None:
        args.reps = DEFAULT_REPS[args.device]
    args.impls = parse_list(args.impls, str) if args.impls else list(DEFAULT_IMPLS[args.device])
    unknown = [name for name in args.impls if name not in ALL_IMPLS]
    if unknown:
        parser.error(f"--impls: unknown {unknown}; choose from {','.join(ALL_IMPLS)}")
    return args


def run_benchmark(argv=None) -> list:
    """Runs the benchmark described by command-line arguments; returns every row."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    fa_module, fa_error = import_flash_attn()
    env = environment(args, fa_module, fa_error)
    decode = args.decode
    directions = ["fwd"] if decode or args.direction == "fwd" else (
        ["bwd"] if args.direction == "bwd" else ["fwd", "bwd"]
    )
    impls = make_impls(
        args.impls, fa_module, fa_error, backward="bwd" in directions, deterministic=args.deterministic
    )
    problems = decode_problems(args) if decode else (sweep_problems(args) if args.sweep else training_problems(args))

    print(
        f"{env['device_name']} | torch {env['torch_version']} | CUDA {env['cuda_version']} | "
        f"threads {env['threads']} | flash_attn {env['flash_attn_version'] or 'not importable: ' + str(fa_error)}"
    )
    print(f"timer: {env['timer']}; {len(problems)} shapes; commit {env['commit'] or 'none'}")
    table = Table(args.impls, directions, args.device, decode)
    table.header()
    rows = []
    out = None if args.no_save else (Path(args.out) if args.out else default_out_path(args, env["device_name"]))

    def save(complete: bool):
        # Written after every shape, so a run cut off by a device call's time limit keeps the shapes it finished.
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {**env, "args": json_args(args), "complete": complete, "rows": rows}
        out.write_text(json.dumps(record, indent=1) + "\n")

    for p in problems:
        # "bwd" alone still needs the forward time: backward = time(fwd + bwd) - time(fwd).
        measured = ["fwd", "bwd"] if "bwd" in directions else ["fwd"]
        shape_rows = bench_shape(p, impls, measured, args, decode)
        shape_rows = [r for r in shape_rows if r["direction"] in directions]
        table.add(p, shape_rows)
        rows.extend(shape_rows)
        if out is not None:
            save(complete=False)
        free_device_memory(p.device)
    table.footer()

    if out is not None:
        save(complete=True)
        print(f"\nwrote {out}")
    return rows


if __name__ == "__main__":
    run_benchmark()
