#!/usr/bin/env python3
# Decode through flash_attn_with_kvcache as serving stacks call it (issue 21's bars): per BENCHMARKS.md decode
# shape, the cache call plain, with a one-token append, with append + rotary, and over paged caches, beside
# flash_attn_func on the same keys (the attention-only floor) and torch SDPA's backends in the same run. Each call is
# timed eager (a small batch's decode is bound by the host's launch work there) and, with --graph, replayed from a
# CUDA graph as serving engines run decode (the device time alone). Prints microseconds and TB/s of K+V read; checks
# every cache call against flash_attn_func; writes a JSON of the rows. --num-splits adds the cache call with each given
# num_splits (kvcache_s<n>), to time the split-KV policy against fixed split counts in one run. --query-len N times
# chunked-prefill calls instead (N new queries per sequence over the cache, non-causal so that SDPA's peers run the
# same call), with TFLOP/s beside the bandwidth; --causal makes every call of ours causal (bottom-right), without
# peers.
import argparse
import json
import warnings
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402  (the protocol's shapes, timer, environment and peers)

PAGE_SIZES = (16, 256)
ROTARY_BASE = 10000.0
US_PER_MS = 1e3
# max |cache call - flash_attn_func|: both are bf16 attention over the same keys; only the accumulation order and
# the one appended key (same values) can differ.
AGREEMENT_TOLERANCE = 2e-2
PEERS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient")
GRAPH_WARMUP_CALLS = 3


def rotary_tables(rows: int, rotary_dim: int, device, dtype):
    inv_freq = 1.0 / ROTARY_BASE ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim)
    angles = torch.outer(torch.arange(rows, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def block_table(batch: int, rows: int, page_size: int, generator: torch.Generator, device) -> torch.Tensor:
    """(batch, pages per sequence) int32: every page of the pool once, in a shuffled order (as a serving pool is)."""
    per_seq = -(-rows // page_size)
    return torch.randperm(batch * per_seq, generator=generator).view(batch, per_seq).to(device, torch.int32)


def paged(cache: torch.Tensor, table: torch.Tensor, page_size: int) -> torch.Tensor:
    """(batch, rows, h, d) -> (num_blocks, page_size, h, d) with row r of sequence b in page table[b, r // page_size]."""
    batch, rows = cache.shape[0], cache.shape[1]
    padded = F.pad(cache, (0, 0, 0, 0, 0, table.shape[1] * page_size - rows))
    pages = torch.empty(table.numel(), page_size, *cache.shape[2:], device=cache.device, dtype=cache.dtype)
    pages[table.view(-1).long()] = padded.reshape(-1, page_size, *cache.shape[2:])
    return pages


def cases(fa, q, k, v, generator, num_splits=(), causal=False, page_sizes=PAGE_SIZES):
    """name -> a zero-argument call; every call attends q over the same kv_len keys k / v (causal: bottom-right)."""
    batch, kv_len = k.shape[0], k.shape[1]
    lengths = torch.full((batch,), kv_len, dtype=torch.int32, device=q.device)
    before = lengths - 1  # the append cases write key kv_len - 1 (the same values) and attend over kv_len keys
    k_new, v_new = k[:, -1:].clone(), v[:, -1:].clone()
    k_cache, v_cache = k.clone(), v.clone()
    cos, sin = rotary_tables(kv_len, q.shape[-1], q.device, q.dtype)
    calls = {
        "func": lambda: fa.flash_attn_func(q, k, v, causal=causal),
        "kvcache": lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=causal),
        "append": lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=before,
                                                     causal=causal),
        "append_rotary": lambda: fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=before,
            rotary_interleaved=False, causal=causal),
    }
    for n in num_splits:  # over k / v themselves: the append cases above rewrite the caches' last row (rotated)
        calls[f"kvcache_s{n}"] = lambda n=n: fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, num_splits=n,
                                                                         causal=causal)
    for page_size in page_sizes:
        table = block_table(batch, kv_len, page_size, generator, q.device)
        k_pages, v_pages = paged(k, table, page_size), paged(v, table, page_size)
        calls[f"paged{page_size}"] = (
            lambda kp=k_pages, vp=v_pages, t=table: fa.flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=lengths, block_table=t, causal=causal))
    return calls


def peer_calls(p, q, k, v):
    bhsd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    calls = {}
    for name in PEERS:
        impl = ba.make_sdpa(name, name.split("_", 1)[1].upper() + "_ATTENTION")
        fn = impl.build(p)

        def call(fn=fn, impl=impl):
            with impl.context():
                return fn(*bhsd)

        calls[name] = call
    return calls


def visible_flops(p) -> float:
    """Forward flops of the (query, key) pairs a call sees; causal: bottom-right, query i sees kv_len - q_len + i + 1
    keys (Problem.fwd_flops halves the square, right only when queries and keys are as many)."""
    if not p.causal:
        return p.fwd_flops()
    q_len, kv_len = p.seqlen_q, p.seqlen_k
    pairs = q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2 if kv_len >= q_len else kv_len * (kv_len + 1) // 2
    return ba.FLOPS_PER_QK_PV_ELEMENT * p.batch * p.nheads * p.headdim * pairs


def graphed(call):
    """The call captured in a CUDA graph (after warm-up on a side stream, as torch's docs prescribe): replay runs it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(GRAPH_WARMUP_CALLS):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def run(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=sorted(ba.DTYPES))
    parser.add_argument("--shapes", default=None, help="batch:kv_len comma list (default: BENCHMARKS.md's decode)")
    parser.add_argument("--rep-ms", type=float, default=ba.DEFAULT_DO_BENCH_REP_MS)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--graph", action="store_true", help="also time every call replayed from a CUDA graph")
    parser.add_argument("--headdim", type=int, default=ba.DECODE_HEADDIM,
                        help=f"head dim of q, k and v (default BENCHMARKS.md's {ba.DECODE_HEADDIM}; e.g. 256 for "
                        "Gemma-class models)")
    parser.add_argument("--query-len", type=int, default=ba.DECODE_QUERY_LEN,
                        help="queries per sequence (default 1: decode; e.g. 512 for chunked prefill over the cache)")
    parser.add_argument("--causal", action="store_true",
                        help="causal calls (bottom-right, as serving aligns new queries to the cache's end); SDPA's "
                        "causal is top-left when queries and keys differ in number, so its peers are not timed")
    parser.add_argument("--num-splits", default="",
                        help="comma list of num_splits values: also time the cache call with each (kvcache_s<n>)")
    parser.add_argument("--page-sizes", default=",".join(map(str, PAGE_SIZES)),
                        help="comma list of page sizes: the cache call over a paged cache of each (paged<n>)")
    parser.add_argument("--impls", default="",
                        help="comma list of the calls to time (e.g. kvcache,paged16,sdpa_cudnn; default: all)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    num_splits = [int(n) for n in args.num_splits.split(",") if n.strip()]
    page_sizes = [int(n) for n in args.page_sizes.split(",") if n.strip()]
    chosen = {name.strip() for name in args.impls.split(",") if name.strip()}
    warnings.filterwarnings("ignore", category=UserWarning)  # SDPA backends explain each refusal
    args.reps = args.reps or ba.DEFAULT_REPS[args.device]
    fa, fa_error = ba.import_flash_attn()
    if fa is None:
        raise SystemExit(f"flash_attn is not importable: {fa_error}")
    shapes = ([tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")] if args.shapes
              else list(ba.DECODE_SHAPES[args.device]))
    dtype = ba.DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(ba.SEED)
    rows = []
    with torch.no_grad():
        for batch, kv_len in shapes:
            p = ba.Problem(args.device, dtype, batch, ba.DECODE_HEADS_Q, ba.DECODE_HEADS_KV, args.query_len,
                           kv_len, args.headdim, args.causal)
            q = torch.randn(batch, args.query_len, p.nheads, p.headdim, device=p.device, dtype=dtype)
            k = torch.randn(batch, kv_len, p.nheads_k, p.headdim, device=p.device, dtype=dtype)
            v = torch.randn_like(k)
            ours = cases(fa, q, k, v, generator, num_splits, args.causal, page_sizes)
            expected = ours["func"]()
            line = [f"b{batch:<3} kv{kv_len:<7}" + (f" q{args.query_len}" if args.query_len > 1 else "")]
            peers = {} if args.causal else peer_calls(p, q, k, v)
            for name, call in {**ours, **peers}.items():
                if chosen and name not in chosen:
                    continue
                for mode in ("eager", "graph") if args.graph else ("eager",):
                    row = {"impl": name, "mode": mode, "batch": batch, "kv_len": kv_len, "headdim": args.headdim,
                           "query_len": args.query_len, "ms": None, "tbps": None, "tflops": None, "error": None}
                    try:
                        timed = call if mode == "eager" else graphed(call)
                        if mode == "eager" and name in ours and name not in ("func", "append_rotary"):
                            diff = (call().float() - expected.float()).abs().max().item()
                            row["max_abs_diff_vs_func"] = diff
                            if not diff <= AGREEMENT_TOLERANCE:
                                row["error"] = f"differs from flash_attn_func by {diff:.3g}"
                        ms = ba.measure(timed, p.device, args)
                        row.update(ms=ms, tbps=p.kv_bytes() / (ms / ba.MS_PER_S) / ba.BYTES_PER_TB,
                                   tflops=visible_flops(p) / (ms / ba.MS_PER_S) / ba.FLOPS_PER_TFLOP)
                        tag = name if mode == "eager" else f"{name}@graph"
                        speed = f"{row['tflops']:.0f}TF" if args.query_len > 1 else f"{row['tbps']:.2f}"
                        line.append(f"{tag} {ms * US_PER_MS:.1f}us/{speed}" + ("!" if row["error"] else ""))
                    except Exception as exc:
                        row["error"] = ba.short_error(exc, [])
                        line.append(f"{name}@{mode} error")
                    rows.append(row)
            print("  ".join(line), flush=True)
            del ours
            ba.free_device_memory(p.device)
    out = Path(args.out) if args.out else ba.RESULTS_DIR / f"{ba.datetime.date.today().isoformat()}-kvcache.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": ba.environment(args, fa, fa_error), "rows": rows}, indent=1))
    bad = [r for r in rows if r["error"] and r["impl"] not in PEERS]
    for r in bad:
        print(f"ERROR {r['impl']} ({r['mode']}) b{r['batch']} kv{r['kv_len']}: {r['error']}")
    return rows


if __name__ == "__main__":
    run()
