# Per-kernel GPU time of a forward + backward call, ours (default dispatch) against torch SDPA's cuDNN backend, over
# several BENCHMARKS.md shapes in one process (torch.profiler; 16k tokens, hidden 2048): where a gap sits, in the main
# kernel or in the passes around it (preprocess, dQ conversion). One line per shape and implementation.
# Usage: python3 tools/kernel_times.py [--headdims 64,128,256] [--seqlens 512,2048,16384] [--calls 5]
import argparse
import re

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn

TOKENS, HIDDEN = 16384, 2048
# Kernel-name patterns to short labels; the first match names a kernel (cuDNN's backward is "...bprop...").
LABELS = (("bprop|bwd_kernel|bwd_wide", "bwd"), ("fprop|fwd", "fwd"), ("preprocess", "pre"), ("convert", "cvt"),
          ("elementwise|fill|zero", "misc"))


def label(name: str) -> str:
    return next((short for pattern, short in LABELS if re.search(pattern, name)), name[:18])


def kernel_times(attention, inputs, dout, calls: int) -> dict[str, float]:
    """Mean microseconds per call of each kernel label over `calls` forward + backward calls."""
    for _ in range(2):  # allocation and autotuning out of the profiled calls
        torch.autograd.grad(attention(), inputs, dout)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.autograd.grad(attention(), inputs, dout)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            key = label(event.name)
            totals[key] = totals.get(key, 0.0) + event.time_range.elapsed_us() / calls
    return totals


def time_shape(head_dim: int, seqlen: int, causal: bool, calls: int) -> None:
    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def ours():
        return flash_attn.flash_attn_func(q, k, v, causal=causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)

    for name, attention in (("ours", ours), ("cudnn", cudnn)):
        totals = kernel_times(attention, (q, k, v), dout, calls)
        kernels = " ".join(f"{key}:{us:.0f}" for key, us in sorted(totals.items(), key=lambda x: -x[1]))
        print(f"hd{head_dim} L{seqlen} {'causal' if causal else 'plain'} {name:5s} {kernels} "
              f"total:{sum(totals.values()):.0f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,2048,16384")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    for head_dim in map(int, args.headdims.split(",")):
        for causal in (False, True):
            for seqlen in map(int, args.seqlens.split(",")):
                time_shape(head_dim, seqlen, causal, args.calls)


if __name__ == "__main__":
    main()
