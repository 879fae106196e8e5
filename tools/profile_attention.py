# Runs a few attention calls of one shape for profilers (ncu/nsys), ours or a torch SDPA backend, forward or
# forward+backward. Batch x heads follow BENCHMARKS.md (16k tokens, hidden 2048). Example:
#   ncu -k regex:bwd_kernel --launch-skip 2 --launch-count 1 python3 tools/profile_attention.py 128 8192 --direction bwd
import argparse

import torch

TOKENS, HIDDEN = 16384, 2048

parser = argparse.ArgumentParser()
parser.add_argument("head_dim", type=int)
parser.add_argument("seqlen", type=int)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
parser.add_argument("--impl", choices=("flash_attn", "sdpa_flash", "sdpa_cudnn"), default="flash_attn")
parser.add_argument("--calls", type=int, default=4)
args = parser.parse_args()

batch, heads = TOKENS // args.seqlen, HIDDEN // args.head_dim
grad = args.direction == "bwd"
q, k, v = (torch.randn(batch, args.seqlen, heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                       requires_grad=grad) for _ in range(3))
dout = torch.randn_like(q)

if args.impl == "flash_attn":
    import flash_attn

    def attention():
        return flash_attn.flash_attn_func(q, k, v, causal=args.causal)
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if args.impl == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION

    def attention():
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=args.causal)
        return out.transpose(1, 2)

for _ in range(args.calls):
    out = attention()
    if grad:
        out.backward(dout)
torch.cuda.synchronize()
