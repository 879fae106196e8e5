#!/usr/bin/env python3
# One warmed-up run of each named flash_attn_with_kvcache call of benchmarks/bench_kvcache.py (kvcache, append,
# append_rotary, paged16, paged256, func) for one decode shape, inside cudaProfilerStart / Stop, so that
# `ncu --profile-from-start off` (tools/ncu_kvcache.sh) sees only those calls' kernels, each call's in turn.
# Usage: tools/profile_kvcache.py BATCH KV_LEN [--calls kvcache,paged256,...]
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_attention as ba  # noqa: E402
import bench_kvcache as bk  # noqa: E402

WARMUP_CALLS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("batch", type=int)
    parser.add_argument("kv_len", type=int)
    parser.add_argument("--calls", default="kvcache,append,append_rotary,paged256,paged16")
    args = parser.parse_args()
    fa, error = ba.import_flash_attn()
    if fa is None:
        raise SystemExit(f"flash_attn is not importable: {error}")
    dtype = torch.bfloat16
    q = torch.randn(args.batch, 1, ba.DECODE_HEADS_Q, ba.DECODE_HEADDIM, device="cuda", dtype=dtype)
    k = torch.randn(args.batch, args.kv_len, ba.DECODE_HEADS_KV, ba.DECODE_HEADDIM, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    calls = bk.cases(fa, q, k, v, torch.Generator().manual_seed(ba.SEED))
    names = args.calls.split(",")
    with torch.no_grad():
        for name in names:
            for _ in range(WARMUP_CALLS):
                calls[name]()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for name in names:
            torch.cuda.nvtx.range_push(name)
            calls[name]()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(names))


if __name__ == "__main__":
    main()
