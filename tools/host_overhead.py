# Host cost per call against device time for the decode shapes (BENCHMARKS.md, or --seqlens), ours and SDPA's side by
# side: host = perf_counter time to enqueue one call (back-to-back loop), stream = CUDA-event time per call of that loop,
# bench = the benchmark's timer (do_bench median, L2 flushed per call). host near or above bench: the entry is host-bound.
# Usage (GPU machine, repo root): python3 tools/host_overhead.py [--impls a,b] [--seqlens 8192 --batch 1] [--calls 200]
#   --doc-len N [--headdim 64 --hidden 2048 --causal]: the forward of one varlen batch of 16k tokens in documents of N
#   (bench_attention.py --doc-len's shape) instead of the decode shapes.
# Without a GPU it times the CPU decode shapes (host column only), as a smoke test.
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_attention as bench  # noqa: E402  (the benchmark's shapes, inputs, implementations and timer)

US_PER_S = 1e6
US_PER_MS = 1e3
WARMUP_CALLS = 20


def per_call_host_us(fn, q, k, v, calls: int, device: str) -> float:
    for _ in range(WARMUP_CALLS):
        fn(q, k, v)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(q, k, v)
    host = (time.perf_counter() - start) / calls * US_PER_S
    if device == "cuda":
        torch.cuda.synchronize()
    return host


def per_call_stream_us(fn, q, k, v, calls: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(calls):
        fn(q, k, v)
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / calls * US_PER_MS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--impls", default="flash_attn,sdpa_flash,sdpa_cudnn")
    parser.add_argument("--seqlens", default=None, help="KV lengths (default: the protocol's decode shapes)")
    parser.add_argument("--batch", type=int, default=None, help="batch for --seqlens (default 1)")
    parser.add_argument("--calls", type=int, default=200, help="calls per back-to-back loop (below the launch queue)")
    parser.add_argument("--rep-ms", type=float, default=30.0, help="do_bench budget for the bench column")
    parser.add_argument("--doc-len", type=int, default=0, help="varlen documents of this many tokens instead")
    parser.add_argument("--headdim", type=int, default=64, help="with --doc-len")
    parser.add_argument("--hidden", type=int, default=bench.DEFAULT_HIDDEN,
                        help="with --doc-len: heads = hidden / headdim")
    parser.add_argument("--causal", action="store_true", help="with --doc-len")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = args.impls.split(",")
    if device == "cpu":
        names = [n for n in names if n in (bench.OURS, "sdpa")] or [bench.OURS]
    shape_args = argparse.Namespace(
        device=device, dtypes=["bf16"], quick=False, batch=args.batch,
        seqlens_given=args.seqlens is not None,
        seqlens=[int(s) for s in args.seqlens.split(",")] if args.seqlens else None,
    )
    fa_module, fa_error = bench.import_flash_attn()
    impls = bench.make_impls(names, fa_module, fa_error, backward=False)
    print(f"{'batch x kv':>12} {'impl':>15} {'host us':>9} {'stream us':>10} {'bench us':>9}")
    if args.doc_len:
        tokens = bench.DEFAULT_TOKENS[device]
        if tokens % args.doc_len or args.hidden % args.headdim:
            raise SystemExit(f"--doc-len must divide {tokens} and --headdim must divide --hidden; got {args.doc_len}, "
                             f"{args.headdim}, {args.hidden}")
        heads = args.hidden // args.headdim
        problems = [bench.Problem(device, torch.bfloat16, 1, heads, heads, tokens, tokens, args.headdim, args.causal,
                                  feature="varlen", doc_len=args.doc_len)]
    else:
        problems = bench.decode_problems(shape_args)
    for p in problems:
        inputs = bench.make_inputs(p, need_grad=False)
        for impl in impls:
            q, k, v, _ = inputs[impl.layout]
            try:
                with impl.context(), torch.no_grad():
                    fn = impl.build(p)
                    host = per_call_host_us(fn, q, k, v, args.calls, device)
                    if device == "cuda":
                        stream = per_call_stream_us(fn, q, k, v, args.calls)
                        timed = bench.time_cuda(lambda: fn(q, k, v), 0, args.rep_ms) * US_PER_MS
                        print(f"{p.batch:>5} x {p.seqlen_k:<6} {impl.name:>15} {host:9.1f} {stream:10.1f} {timed:9.1f}")
                    else:
                        print(f"{p.batch:>5} x {p.seqlen_k:<6} {impl.name:>15} {host:9.1f} {'-':>10} {'-':>9}")
            except Exception as exc:  # one implementation's failure must not hide the others
                print(f"{p.batch:>5} x {p.seqlen_k:<6} {impl.name:>15} failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
