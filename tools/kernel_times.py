# Per-kernel GPU time of a forward + backward call, ours against peers, over several BENCHMARKS.md shapes in one
# process (torch.profiler; 16k tokens): where a gap sits, in the main kernel or in the passes around it (preprocess,
# dQ conversion). One line per shape and implementation (--impls, described by --help).
# Usage: python3 tools/kernel_times.py [--headdims 64,128,256] [--seqlens 512,2048,16384] [--calls 5]
#        [--impls ours,cudnn] [--hidden 2048]
import argparse
import inspect
import os
import re

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn

TOKENS = 16384
# Kernel-name patterns to short labels; the first match names a kernel (cuDNN's backward is "...bprop...", FA2's
# "flash_bwd_dq_dk_dv...", its dot(dO, O) pass "flash_bwd_dot_do_o", its dQ conversion "flash_bwd_convert_dq").
LABELS = (("dot_do_o|preprocess", "pre"), ("convert", "cvt"), ("bprop|bwd_kernel|bwd_wide|flash_bwd", "bwd"),
          ("fprop|fwd", "fwd"), ("elementwise|fill|zero|copy", "misc"))


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


def time_shape(head_dim: int, seqlen: int, causal: bool, calls: int, impls: list[str], hidden: int) -> None:
    batch, heads = TOKENS // seqlen, hidden // head_dim
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def ours():
        return flash_attn.flash_attn_func(q, k, v, causal=causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)

    def fa2():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)

    cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * seqlen

    def fa2_varlen():
        from torch.nn.attention.varlen import varlen_attn

        flat = [t.reshape(-1, heads, head_dim) for t in (q, k, v)]
        # torch >= 2.11 takes the mask as window_size ((-1, 0) causal), 2.10 as is_causal (bench_attention.py too).
        if "window_size" in inspect.signature(varlen_attn).parameters:
            mask = {"window_size": (-1, 0 if causal else -1)}
        else:
            mask = {"is_causal": causal}
        return varlen_attn(*flat, cu, cu, seqlen, seqlen, **mask).view(q.shape)

    head_major = [t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v)]
    dout_head_major = dout.transpose(1, 2).contiguous()

    def fa2_bhsd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*head_major, is_causal=causal)

    token_major = ((q, k, v), dout)
    runs = {"ours": (ours, token_major), "portable": (ours, token_major), "cudnn": (cudnn, token_major),
            "fa2": (fa2, token_major), "fa2_bhsd": (fa2_bhsd, (head_major, dout_head_major)),
            "fa2_varlen": (fa2_varlen, token_major)}
    for name in impls:
        attention, (inputs, grad) = runs[name]
        # The dispatcher reads FLASH_ATTN_HOPPER at every call, the backward's too: set for the whole measurement.
        if name == "portable":
            os.environ["FLASH_ATTN_HOPPER"] = "0"
        try:
            totals = kernel_times(attention, inputs, grad, calls)
        finally:
            if name == "portable":
                os.environ.pop("FLASH_ATTN_HOPPER")
        kernels = " ".join(f"{key}:{us:.0f}" for key, us in sorted(totals.items(), key=lambda x: -x[1]))
        print(f"hd{head_dim} L{seqlen} {'causal' if causal else 'plain'} {name:10s} {kernels} "
              f"total:{sum(totals.values()):.0f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,2048,16384")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--impls", default="ours,cudnn",
                        help="ours (default dispatch), portable (FLASH_ATTN_HOPPER=0), cudnn and fa2 (SDPA backends "
                        "on views of the same (batch, seqlen, heads, dim) tensors), fa2_bhsd (FA2 through SDPA on "
                        "head-major contiguous tensors, as bench_attention.py's sdpa_flash runs it), fa2_varlen (FA2's "
                        "varlen kernels through torch's varlen_attn)")
    parser.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head dim")
    args = parser.parse_args()
    impls = args.impls.split(",")
    choices = {"ours", "portable", "cudnn", "fa2", "fa2_bhsd", "fa2_varlen"}
    unknown = set(impls) - choices
    if unknown:
        parser.error(f"--impls: unknown {sorted(unknown)}; choose among {sorted(choices)}")
    for head_dim in map(int, args.headdims.split(",")):
        for causal in (False, True):
            for seqlen in map(int, args.seqlens.split(",")):
                time_shape(head_dim, seqlen, causal, args.calls, impls, args.hidden)


if __name__ == "__main__":
    main()
