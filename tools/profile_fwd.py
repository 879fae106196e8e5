# Runs a few forward calls of one shape, for profilers (ncu/nsys): python3 tools/profile_fwd.py HEADDIM SEQLEN [causal]
# Batch x heads follow BENCHMARKS.md (16k tokens, hidden 2048).
import sys

import torch

import flash_attn

TOKENS, HIDDEN, CALLS = 16384, 2048, 5

head_dim, seqlen = int(sys.argv[1]), int(sys.argv[2])
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
batch, heads = TOKENS // seqlen, HIDDEN // head_dim
q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(CALLS):
    flash_attn.flash_attn_func(q, k, v, causal=causal)
torch.cuda.synchronize()
