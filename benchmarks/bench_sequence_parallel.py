# Long-context attention across GPUs with yunchang on flash_attn: ring attention (zigzag) and Ulysses, causal, forward
# + backward of one sequence of 128k ... 1M tokens in total, split over the ranks; tokens/s, TFLOP/s per GPU and peak
# memory per GPU, and the scaling efficiency against one GPU (flash_attn_func on the whole sequence) at the longest
# length that fits one. Each engine is first checked against single-process attention under the FA rule.
# Run: python3 benchmarks/bench_sequence_parallel.py --gpus 1,2,4 [--seqlens ...] [--json FILE]
# (one torchrun per GPU count and engine, lengths ascending, so that running out of memory ends only that run). By
# estimate (3.5 x 4 s^2 h d / 2 FLOPs at ~450 TFLOP/s), 1M tokens take ~60 s a step on one H200 and the default
# lengths ~4 minutes on one GPU with --iters 2: split the GPU counts over calls where a call's time is bounded.
import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_SEQLENS = (131072, 262144, 524288, 1048576)
# Llama-3-8B's attention shape (32 query heads of 128), MHA so that Ulysses splits every head count it is given.
DEFAULT_HEADS = 32
HEAD_DIM = 128
# The FA rule of tests/helpers.py assert_close_fa: the output within 2x, gradients within 3x the error of plain
# attention in the same low precision, plus a floor: a share of the largest reference value and twice the error of
# rounding the reference to the low precision.
OUT_MULTIPLE, GRAD_MULTIPLE = 2.0, 3.0
REL_FLOOR = 1e-3
RESULT_TAG = "SEQPAR_RESULT "


def causal_flops(seqlen: int, heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention over one sequence: 4 s^2 h d / 2 forward, 2.5x that backward."""
    return 3.5 * 4.0 * seqlen * seqlen * heads * head_dim / 2.0


# ---------------------------------------------------------------------------------------------------------------------
# Worker: one engine on the ranks of one torchrun.


def engine_groups(engine: str, world: int) -> tuple[int, int]:
    """(Ulysses degree, ring degree) of an engine on `world` ranks."""
    return {"single": (1, 1), "ring": (1, world), "ulysses": (world, 1)}[engine]


# yunchang's token layout of each engine: the zigzag ring balances the causal work over the ranks; Ulysses
# (UlyssesAttention) takes contiguous shards.
RING_KIND = {"ring": "zigzag", "ulysses": "basic"}


def make_attention(engine: str):
    from flash_attn import flash_attn_func

    if engine == "single":
        return lambda q, k, v: flash_attn_func(q, k, v, causal=True)
    from yunchang import LongContextAttention, UlyssesAttention
    from yunchang.kernels import AttnType

    if engine == "ulysses":
        layer = UlyssesAttention(attn_type=AttnType.FA)  # all-to-all over every rank, then one call a head group
    else:
        layer = LongContextAttention(ring_impl_type=RING_KIND[engine], attn_type=AttnType.FA)
    return lambda q, k, v: layer(q, k, v, causal=True)


def shard_of(tensor, engine: str, rank: int, world: int):
    """This rank's tokens of a (batch, seqlen, heads, dim) tensor, in the engine's layout (RING_KIND)."""
    if engine == "single":
        return tensor
    from yunchang import EXTRACT_FUNC_DICT

    ud, rd = engine_groups(engine, world)
    return EXTRACT_FUNC_DICT[RING_KIND[engine]](tensor, rank, world_size=world, rd=rd, ud=ud).contiguous()


def fa_rule_errors(ours, truth, naive, multiple, dtype):
    """(error, bound) of the FA rule: max |ours - truth| against multiple x max |naive - truth| + floor; a NaN error
    fails."""
    truth = truth.double()
    error = (ours.double() - truth).abs().max().item()
    yardstick = (naive.double() - truth).abs().max().item()
    rounding = (truth.to(dtype).double() - truth).abs().max().item()
    floor = REL_FLOOR * max(truth.abs().max().item(), 1.0) + 2 * rounding
    return (error if error == error else float("inf")), multiple * yardstick + floor


def check_engine(engine, attention, args, rank, world, device, dtype):
    """The engine's output and gradients on --check-seqlen tokens against fp64 attention on one process (FA rule)."""
    import torch.distributed as dist

    from flash_attn.reference import attention_ref

    generator = torch.Generator(device="cpu").manual_seed(20261205)
    shape = (1, args.check_seqlen, args.check_heads, HEAD_DIM)
    full = [torch.randn(shape, generator=generator).to(device, dtype) for _ in range(4)]
    q, k, v, dout = full
    local = [shard_of(t, engine, rank, world).detach().requires_grad_() for t in (q, k, v)]
    out = attention(*local)
    out.backward(shard_of(dout, engine, rank, world))
    ours = [out.detach()] + [t.grad for t in local]

    def reference(compute_dtype):
        leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]  # gradients in compute_dtype
        o, _ = attention_ref(*leaves, causal=True, compute_dtype=compute_dtype)
        o.backward(dout.to(o.dtype))
        return [shard_of(x, engine, rank, world) for x in [o.detach()] + [t.grad for t in leaves]]

    truth, naive = reference(torch.float64), reference(dtype)
    rows = []
    for name, mine, exact, low in zip(("out", "dq", "dk", "dv"), ours, truth, naive):
        error, bound = fa_rule_errors(mine, exact, low, OUT_MULTIPLE if name == "out" else GRAD_MULTIPLE, dtype)
        worst = torch.tensor([error - bound, error, bound], dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        rows.append({"tensor": name, "error": worst[1].item(), "bound": worst[2].item(), "ok": worst[0].item() <= 0})
    return rows


def time_step(attention, engine, seqlen, args, rank, world, device, dtype):
    """Seconds of one forward + backward over `seqlen` tokens (the slowest rank's mean over --iters) and peak bytes."""
    import torch.distributed as dist

    tokens = seqlen // world
    local = [torch.randn(1, tokens, args.heads, HEAD_DIM, device=device, dtype=dtype).requires_grad_()
             for _ in range(3)]
    dout = torch.randn(1, tokens, args.heads, HEAD_DIM, device=device, dtype=dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if world > 1:
            dist.barrier()

    def step():
        for t in local:
            t.grad = None
        attention(*local).backward(dout)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync()
    start = time.perf_counter()
    for _ in range(args.iters):
        step()
    sync()
    seconds = (time.perf_counter() - start) / args.iters
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    totals = torch.tensor([seconds, float(peak)], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    return totals[0].item(), int(totals[1].item())


def worker(args):
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not args.cpu
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before NCCL's initialisation, which binds the rank to the current device
    if world > 1 or args.engine != "single":
        dist.init_process_group("nccl" if cuda else "gloo")
    dtype = torch.bfloat16
    if args.engine != "single":
        from yunchang import set_seq_parallel_pg

        set_seq_parallel_pg(*engine_groups(args.engine, world), rank, world)
    attention = make_attention(args.engine)

    def emit(record):
        if rank == 0:
            print(RESULT_TAG + json.dumps(record), flush=True)

    if args.check_seqlen > 0:
        emit({"kind": "check", "engine": args.engine, "gpus": world, "seqlen": args.check_seqlen,
              "heads": args.check_heads, "rows": check_engine(args.engine, attention, args, rank, world, device, dtype)})
    for seqlen in args.seqlens:
        if seqlen % (2 * world) != 0:
            emit({"kind": "time", "engine": args.engine, "gpus": world, "seqlen": seqlen,
                  "status": f"skipped: not a multiple of 2 x {world} ranks (the zigzag chunks)"})
            continue
        seconds, peak = time_step(attention, args.engine, seqlen, args, rank, world, device, dtype)
        flops = causal_flops(seqlen, args.heads, HEAD_DIM)
        emit({"kind": "time", "engine": args.engine, "gpus": world, "seqlen": seqlen, "status": "ok",
              "ms": seconds * 1e3, "tokens_per_s": seqlen / seconds, "tflops_per_gpu": flops / seconds / world / 1e12,
              "peak_gib_per_gpu": peak / 2**30})
    if dist.is_initialized():
        dist.barrier()
        if args.engine != "single":
            import gc

            from yunchang.globals import PROCESS_GROUP

            PROCESS_GROUP.ULYSSES_PG = PROCESS_GROUP.RING_PG = None
            gc.collect()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# Driver: a torchrun per (GPU count, engine), the records gathered, the efficiency worked out.


def run_workers(args) -> list[dict]:
    records = []
    for gpus in args.gpus:
        for engine in (["single"] if gpus == 1 else args.engines):
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                       str(pathlib.Path(__file__).resolve()), "--worker", "--engine", engine,
                       "--seqlens", ",".join(map(str, args.seqlens)), "--heads", str(args.heads),
                       "--iters", str(args.iters), "--warmup", str(args.warmup),
                       "--check-seqlen", str(args.check_seqlen), "--check-heads", str(args.check_heads)]
            if args.cpu:
                command.append("--cpu")
            started = time.time()
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
            got = [json.loads(line[len(RESULT_TAG):]) for line in done.stdout.splitlines()
                   if line.startswith(RESULT_TAG)]
            timed = {r["seqlen"] for r in got if r["kind"] == "time"}
            for seqlen in args.seqlens:
                if seqlen not in timed:  # the run ended before it: out of memory, or an error (its log below)
                    got.append({"kind": "time", "engine": engine, "gpus": gpus, "seqlen": seqlen,
                                "status": f"not run: the run ended with code {done.returncode}"})
            if done.returncode != 0:
                tail = (done.stdout + done.stderr)[-3000:]
                print(f"--- {engine} on {gpus} GPU(s) ended with code {done.returncode}:\n{tail}", file=sys.stderr)
            print(f"{engine} on {gpus} GPU(s): {time.time() - started:.0f} s", file=sys.stderr)
            records += got
    return records


def scaling(records: list[dict]) -> list[dict]:
    """Per engine and GPU count, throughput / (GPUs x one GPU's) at the longest length one GPU ran."""
    single = {r["seqlen"]: r for r in records if r["kind"] == "time" and r["gpus"] == 1 and r["status"] == "ok"}
    if not single:
        return []
    longest = max(single)
    rows = []
    for r in records:
        if r["kind"] == "time" and r["gpus"] > 1 and r["seqlen"] == longest and r["status"] == "ok":
            rows.append({"engine": r["engine"], "gpus": r["gpus"], "seqlen": longest,
                         "efficiency": r["tokens_per_s"] / (r["gpus"] * single[longest]["tokens_per_s"])})
    return rows


def summary(records: list[dict], efficiency: list[dict]) -> str:
    lines = ["| engine | GPUs | tokens | ms / step | tokens/s | TFLOP/s per GPU | peak GiB per GPU |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in records if r["kind"] == "time"), key=lambda r: (r["engine"], r["gpus"], r["seqlen"])):
        if r["status"] == "ok":
            lines.append(f"| {r['engine']} | {r['gpus']} | {r['seqlen']:,} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                         f"{r['tflops_per_gpu']:.0f} | {r['peak_gib_per_gpu']:.1f} |")
        else:
            lines.append(f"| {r['engine']} | {r['gpus']} | {r['seqlen']:,} | {r['status']} | | | |")
    for e in efficiency:
        lines.append(f"scaling efficiency, {e['engine']} on {e['gpus']} GPUs at {e['seqlen']:,} tokens: "
                     f"{e['efficiency']:.2f}")
    for r in records:
        if r["kind"] == "check":
            verdict = ", ".join(f"{x['tensor']} {x['error']:.2e} / {x['bound']:.2e}" + ("" if x["ok"] else " FAIL")
                                for x in r["rows"])
            lines.append(f"check, {r['engine']} on {r['gpus']} GPU(s), {r['seqlen']:,} tokens (error / FA-rule bound): "
                         f"{verdict}")
    return "\n".join(lines)


def metadata(args) -> dict:
    import flash_attn

    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "flash_attn": getattr(flash_attn, "__version__", "?"), "heads": args.heads, "head_dim": HEAD_DIM,
            "dtype": "bf16", "causal": True, "batch": 1, "iters": args.iters,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.cpu else "cpu"}
    try:
        import yunchang

        meta["yunchang"] = yunchang.__version__
    except ImportError:
        meta["yunchang"] = None
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=ROOT).stdout.strip()
    except OSError:
        meta["commit"] = None
    return meta


def main():
    parser = argparse.ArgumentParser(description=__doc__ or "sequence-parallel attention benchmark")
    parser.add_argument("--gpus", default="1,2", help="GPU counts, each a torchrun (1: flash_attn_func alone)")
    parser.add_argument("--engines", default="ring,ulysses", help="yunchang engines on more than one GPU")
    parser.add_argument("--seqlens", default=",".join(map(str, DEFAULT_SEQLENS)), help="total tokens, ascending")
    parser.add_argument("--heads", type=int, default=DEFAULT_HEADS)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--check-seqlen", type=int, default=8192, help="tokens of the FA-rule check (0: none)")
    parser.add_argument("--check-heads", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for each torchrun")
    parser.add_argument("--json", type=pathlib.Path, help="where to write the records")
    parser.add_argument("--cpu", action="store_true", help="CPU tensors and gloo (to try the harness without GPUs)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="single", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seqlens = sorted(int(s) for s in str(args.seqlens).split(","))
    if args.worker:
        worker(args)
        return
    args.gpus = [int(g) for g in args.gpus.split(",")]
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = set(args.engines) - {"ring", "ulysses"}
    if unknown:
        parser.error(f"--engines: {sorted(unknown)} not among ring, ulysses")
    records = run_workers(args)
    efficiency = scaling(records)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": metadata(args), "records": records, "scaling": efficiency}, indent=1))
    print(summary(records, efficiency))
    failed = [x for r in records if r["kind"] == "check" for x in r["rows"] if not x["ok"]]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
