# Runs a few attention calls of one shape for profilers (ncu/nsys), ours or a torch SDPA backend, forward or
# forward+backward. Batch x heads follow BENCHMARKS.md (16k tokens, hidden 2048; --decode-batch: its decode shapes).
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
                                       "sdpa_cudnn"), default="flash_attn",
                    help="flash_attn_hopper / _portable: ours with FLASH_ATTN_HOPPER=force / 0")
parser.add_argument("--calls", type=int, default=4)
parser.add_argument("--decode-batch", type=int, default=0,
                    help="decode shape instead (BENCHMARKS.md): this batch, 1 query, 32 / 8 heads, seqlen = KV length")
parser.add_argument("--window", type=int, default=-1,
                    help="ours only: a sliding window of this many keys on the left (and on the right unless causal), "
                         "as benchmarks/bench_attention.py --feature window")
parser.add_argument("--softcap", type=float, default=0.0, help="ours only: softcap")
args = parser.parse_args()
features = {}
if args.window >= 0:
    features["window_size"] = (args.window, 0 if args.causal else args.window)
if args.softcap > 0:
    features["softcap"] = args.softcap
if features and not args.impl.startswith("flash_attn"):
    parser.error(f"--window / --softcap run with our kernels only (torch SDPA has neither); got --impl {args.impl}")

grad = args.direction == "bwd"
if args.decode_batch:
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

    def attention():
        return flash_attn.flash_attn_func(q, k, v, causal=args.causal, **features)
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if args.impl == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION

    def attention():
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=args.causal,
                enable_gqa=heads_q != heads_k)
        return out.transpose(1, 2)

for _ in range(args.calls):
    out = attention()
    if grad:
        out.backward(dout)
torch.cuda.synchronize()
