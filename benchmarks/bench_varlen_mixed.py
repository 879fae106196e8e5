"""Forward speed of varlen batches that mix one long document with many short ones (packed training batches), where a
per-call plan chosen by the longest sequence (e.g. the hd 96 Hopper forward's tall rows from 4096 queries) also runs
the short documents. Each batch is timed once per --env setting in the same process, so a run-time switch is an A/B.
Usage: python3 benchmarks/bench_varlen_mixed.py [--headdim 96] [--heads 32] [--env FLASH_ATTN_FWD_TALL_ROWS=1
       --env FLASH_ATTN_FWD_TALL_ROWS=0] [--batches "8192+32x256;4096+48x256;4x4096;16384"]
"""
import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flash_attn import flash_attn_varlen_func  # noqa: E402


def parse_batch(text: str) -> list:
    """'8192+32x256' -> [8192, 256 x 32]: '+'-separated terms, each LENGTH or COUNTxLENGTH."""
    lengths = []
    for term in text.split("+"):
        count, _, length = term.rpartition("x")
        lengths += [int(length)] * (int(count) if count else 1)
    return lengths


def tflops(seqlens, heads, head_dim, causal, rep_ms):
    total = sum(seqlens)
    q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
    call = lambda: flash_attn_varlen_func(q, k, v, cu, cu, max(seqlens), max(seqlens), causal=causal)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    reps = max(1, int(rep_ms / max(start.elapsed_time(end), 1e-3)))
    start.record()
    for _ in range(reps):
        call()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / reps
    # Causal rows see half their square (the same convention as bench_attention.py).
    flops = sum(4 * n * n * head_dim * heads / (2 if causal else 1) for n in seqlens)
    return flops / ms / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--headdim", type=int, default=96)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--batches", default="8192+32x256;4096+48x256;4x4096;16384")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE, one timing per occurrence")
    parser.add_argument("--rep-ms", type=float, default=30.0)
    args = parser.parse_args()
    settings = [tuple(e.split("=", 1)) for e in args.env] or [(None, None)]
    header = " | ".join(f"{name}={value}" if name else "default" for name, value in settings)
    print(f"batch | causal | {header} (TFLOP/s)")
    for text in args.batches.split(";"):
        for causal in (False, True):
            row = []
            for name, value in settings:
                if name:
                    os.environ[name] = value
                row.append(tflops(parse_batch(text), args.heads, args.headdim, causal, args.rep_ms))
            print(f"{text} | {causal} | " + " | ".join(f"{x:.1f}" for x in row))


if __name__ == "__main__":
    main()
