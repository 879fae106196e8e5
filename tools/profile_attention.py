# Runs a few attention calls of one shape for profilers (ncu/nsys), ours, a torch SDPA backend or FA2's varlen kernels
# (fa2_varlen), forward or forward+backward. Batch x heads follow BENCHMARKS.md (16k tokens, hidden 2048;
# --decode-batch: its decode shapes; --doc-len: the 16k tokens as one varlen batch of documents, ours through
# flash_attn_varlen_func, fa2_varlen by its cu_seqlens, flex by a mask).
# Example:
#   ncu -k regex:bwd_kernel --launch-skip 2 --launch-count 1 python3 tools/profile_attention.py 128 8192 --direction bwd
import argparse
import os

import torch

TOKENS, HIDDEN = 16384, 2048
DECODE_HEADS_Q, DECODE_HEADS_K = 32, 8

parser = argparse.ArgumentParser()
parser.add_argument("head_dim", type=int)
parser.add_argument("seqlen", type=int)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
parser.add_argument("--impl", choices=("flash_attn", "flash_attn_hopper", "flash_attn_portable", "sdpa_flash",
                                       "sdpa_cudnn", "fa2_varlen", "flex"), default="flash_attn",
                    help="flash_attn_hopper / _portable: ours with FLASH_ATTN_HOPPER=force / 0; fa2_varlen: FA2's "
                    "varlen kernels through torch's varlen_attn on the same token-major tensors")
parser.add_argument("--calls", type=int, default=4)
parser.add_argument("--decode-batch", type=int, default=0,
                    help="decode shape instead (BENCHMARKS.md): this batch, 1 query, 32 / 8 heads, seqlen = KV length")
parser.add_argument("--window", type=int, default=-1,
                    help="ours only: a sliding window of this many keys on the left (and on the right unless causal), "
                         "as benchmarks/bench_attention.py --feature window")
parser.add_argument("--softcap", type=float, default=0.0, help="ours only: softcap")
parser.add_argument("--doc-len", type=int, default=0,
                    help="one varlen batch of the 16k tokens in documents of this many tokens (as bench_attention.py "
                         "--feature varlen); ours and flex only; seqlen is then ignored")
parser.add_argument("--kernel-times", action="store_true",
                    help="print each GPU kernel's mean time over the calls after the first (torch.profiler) instead of "
                         "running bare for an outside profiler")
args = parser.parse_args()
features = {}
if args.window >= 0:
    features["window_size"] = (args.window, 0 if args.causal else args.window)
if args.softcap > 0:
    features["softcap"] = args.softcap
if args.impl == "fa2_varlen" and (args.decode_batch or args.softcap > 0):
    parser.error("--impl fa2_varlen runs the training shapes, --window and --doc-len only")
if features and not args.impl.startswith("flash_attn") and args.impl not in ("flex", "fa2_varlen"):
    parser.error(f"--window / --softcap run with our kernels only (torch SDPA has neither); got --impl {args.impl}")
if args.doc_len and not (args.impl.startswith("flash_attn") or args.impl in ("flex", "fa2_varlen")):
    parser.error(f"--doc-len runs with our kernels, fa2_varlen or flex only; got --impl {args.impl}")
if args.doc_len and (args.decode_batch or TOKENS % args.doc_len):
    parser.error(f"--doc-len must divide {TOKENS} tokens and excludes --decode-batch; got {args.doc_len}")
if args.impl == "flex" and (features or args.decode_batch):
    parser.error("--impl flex runs the plain, causal and --doc-len calls only")

grad = args.direction == "bwd"
if args.doc_len:
    batch, heads_q, heads_k, seqlen_q = 1, HIDDEN // args.head_dim, HIDDEN // args.head_dim, TOKENS
    args.seqlen = TOKENS
elif args.decode_batch:
    batch, heads_q, heads_k, seqlen_q = args.decode_batch, DECODE_HEADS_Q, DECODE_HEADS_K, 1
else:
    batch, heads_q, heads_k, seqlen_q = TOKENS // args.seqlen, HIDDEN // args.head_dim, HIDDEN // args.head_dim, args.seqlen
q = torch.randn(batch, seqlen_q, heads_q, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
k, v = (torch.randn(batch, args.seqlen, heads_k, args.head_dim, device="cuda", dtype=torch.bfloat16,
                    requires_grad=grad) for _ in range(2))
dout = torch.randn_like(q)

if args.impl.startswith("flash_attn"):
    import flash_attn

    switch = {"flash_attn_hopper": "force", "flash_attn_portable": "0"}.get(args.impl)
    if switch is not None:
        os.environ["FLASH_ATTN_HOPPER"] = switch

    cu_seqlens = torch.arange(0, TOKENS + 1, args.doc_len, device="cuda", dtype=torch.int32) if args.doc_len else None

    def attention():
        if args.doc_len:
            # squeeze, not q[0]: a select's backward zero-fills a full-size gradient and copies into it.
            return flash_attn.flash_attn_varlen_func(q.squeeze(0), k.squeeze(0), v.squeeze(0), cu_seqlens, cu_seqlens,
                                                     args.doc_len, args.doc_len, causal=args.causal, **features)[None]
        return flash_attn.flash_attn_func(q, k, v, causal=args.causal, **features)
elif args.impl == "fa2_varlen":
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    length = args.doc_len or args.seqlen  # equal-length batches run as equal documents
    cu_seqlens = torch.arange(0, batch * seqlen_q + 1, length, device="cuda", dtype=torch.int32)
    # torch >= 2.11 takes the mask as window_size ((-1, 0) causal), 2.10 as is_causal (bench_attention.py too).
    if "window_size" in inspect.signature(varlen_attn).parameters:
        mask = {"window_size": features.get("window_size", (-1, 0 if args.causal else -1))}
    else:
        mask = {"is_causal": args.causal}

    def attention():
        flat = [t.reshape(-1, t.shape[2], args.head_dim) for t in (q, k, v)]
        return varlen_attn(*flat, cu_seqlens, cu_seqlens, length, length, **mask).view(q.shape)
elif args.impl == "flex":
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    doc_len = args.doc_len or args.seqlen

    def visible(b, h, q_idx, kv_idx):
        same_doc = q_idx // doc_len == kv_idx // doc_len
        return same_doc & (q_idx >= kv_idx) if args.causal else same_doc

    block_mask = create_block_mask(visible, B=None, H=None, Q_LEN=seqlen_q, KV_LEN=args.seqlen, device="cuda")

    def attention():
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)
        return out.transpose(1, 2)
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if args.impl == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION

    def attention():
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=args.causal,
                enable_gqa=heads_q != heads_k)
        return out.transpose(1, 2)



def run_calls(calls):
    for _ in range(calls):
        out = attention()
        if grad:  # gradients returned, not accumulated into .grad (which adds an elementwise kernel per input)
            torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()


if args.kernel_times:
    # The first call compiles (flex) and allocates; the profiled calls after it run as a training step does.
    run_calls(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_calls(args.calls)
    totals = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
    print(f"{'us/call':>9} {'launches':>8}  kernel ({args.impl}, hd {args.head_dim}, seqlen {args.seqlen}, doc "
          f"{args.doc_len}, causal {args.causal}, {args.direction})")
    for name, (time_us, count) in sorted(totals.items(), key=lambda item: -item[1][0]):
        print(f"{time_us / args.calls:9.1f} {count:8d}  {name[:150]}")
    print(f"{sum(t for t, _ in totals.values()) / args.calls:9.1f} {'':8}  total")
else:
    run_calls(args.calls)
