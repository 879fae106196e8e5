# What the once-per-tensor check of device index values costs (csrc/api/checked_values_cache.h): a model step of
# LAYERS attention calls that share one freshly made index tensor, as Hugging Face does, timed with the checks on
# (one host synchronisation per step) and off (FLASH_ATTN_CHECK_DEVICE_VALUES=0). Two cases: varlen prefill /
# training (cu_seqlens, forward and forward + backward) and decode through flash_attn_with_kvcache (cache_seqlens).
# Usage on a GPU machine: python tools/index_check_cost.py [--layers 32] [--steps 30]
import argparse
import os
import statistics
import time

import torch

from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

CHECK_ENV = "FLASH_ATTN_CHECK_DEVICE_VALUES"
DTYPE = torch.bfloat16


def step_time_us(step, steps, repeats=5):
    """Wall time per step of `steps` steps run back to back (the host may run ahead of the GPU, as in a training or
    serving loop, so a synchronisation inside a step costs what it really costs: the queue drains), in microseconds;
    the median of `repeats` such runs."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / steps)
    return statistics.median(times)


def varlen_step(layers, backward):
    lengths = [512, 1024, 256, 2048, 768, 1536, 384, 1664]  # 8 documents, 8k tokens
    heads, kv_heads, head_dim = 32, 8, 128
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, device="cuda", dtype=DTYPE, requires_grad=backward)
    k = torch.randn(total, kv_heads, head_dim, device="cuda", dtype=DTYPE, requires_grad=backward)
    v = torch.randn(total, kv_heads, head_dim, device="cuda", dtype=DTYPE, requires_grad=backward)
    seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)

    def step():
        # A new cu_seqlens per step (as a model's forward computes it), shared by every layer.
        cu = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
        for _ in range(layers):
            out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
            if backward:
                torch.autograd.grad(out, (q, k, v), out)
    return step


def decode_step(layers):
    batch, heads, kv_heads, head_dim, cache_rows = 16, 32, 8, 128, 4096
    q = torch.randn(batch, 1, heads, head_dim, device="cuda", dtype=DTYPE)
    k_cache = torch.randn(batch, cache_rows, kv_heads, head_dim, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(batch, 1, kv_heads, head_dim, device="cuda", dtype=DTYPE)
    lengths = torch.full((batch,), 2048, device="cuda", dtype=torch.int32)

    def step():
        cache_seqlens = lengths + 1  # a new tensor per decode step, shared by every layer
        for _ in range(layers):
            flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=cache_seqlens, causal=True)
    return step


def main():
    parser = argparse.ArgumentParser(description="Cost of the once-per-tensor index value checks")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    cases = {
        "varlen fwd (8 docs, 8k tokens, GQA 32/8, hd 128)": varlen_step(args.layers, backward=False),
        "varlen fwd+bwd (same)": varlen_step(args.layers, backward=True),
        "kvcache decode (batch 16, 2k of 4k rows, append 1)": decode_step(args.layers),
    }
    print(f"{args.layers} layers per step, {args.steps} steps back to back (median of 5 runs), microseconds per step")
    for name, step in cases.items():
        results = {}
        for label, value in (("checked", None), ("unchecked", "0")):
            if value is None:
                os.environ.pop(CHECK_ENV, None)
            else:
                os.environ[CHECK_ENV] = value
            results[label] = step_time_us(step, args.steps)
        cost = results["checked"] - results["unchecked"]
        print(f"  {name}: checked {results['checked']:.0f}  unchecked {results['unchecked']:.0f}  "
              f"cost {cost:+.0f} ({100 * cost / results['unchecked']:+.1f} %)")
    os.environ.pop(CHECK_ENV, None)


if __name__ == "__main__":
    main()
