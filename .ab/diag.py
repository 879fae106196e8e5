# Repeats backward calls of the shapes that failed to make TMA maps, counting failures, with pointer alignments.
import os, sys, torch
os.environ["FLASH_ATTN_HOPPER"] = "force"
from flash_attn import flash_attn_func
fails = 0
for trial in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    for (b, sq, sk, h, hk, d, c) in [(2, 17, 1, 2, 2, 64, False), (2, 17, 300, 2, 2, 64, True), (2, 640, 255, 2, 2, 128, False),
                                     (2, 300, 17, 2, 2, 128, True), (2, 113, 255, 4, 2, 32, True), (2, 113, 255, 4, 2, 64, True)]:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = flash_attn_func(q, k, v, causal=c)
        dout = torch.randn_like(out)
        try:
            torch.autograd.grad(out, (q, k, v), dout)
        except Exception as e:
            fails += 1
            print("FAIL", trial, (b, sq, sk, h, hk, d, c), [t.data_ptr() % 256 for t in (q, k, v, out, dout)],
                  dout.stride(), str(e)[:60], flush=True)
print("diag fails", fails)
