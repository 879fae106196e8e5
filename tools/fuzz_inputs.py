"""Malformed-input fuzzer for the flash_attn ops (fwd, bwd, kvcache_append_, kvcache_decode_, rotary) and the
public functions. Each case mutates one or two arguments of a valid call; the call must either succeed with a
finite, correct result (checked against flash_attn.reference where the mutation keeps the call meaningful) or
raise a Python exception. A crash, or (under an ASan build: tools/fuzz_inputs.sh) a read outside a tensor, ends the
process. Usage: python3 tools/fuzz_inputs.py [--cases N] [--seed S] [--device cpu|cuda] [--verbose]."""

from __future__ import annotations

import argparse
import math
import random
import sys
import traceback

import torch

import flash_attn
from flash_attn import reference

# Exceptions a bad argument may raise: anything else (or a crash) is a finding.
EXPECTED = (RuntimeError, ValueError, NotImplementedError, TypeError, IndexError)
HUGE = 1 << 40  # an index or length far past any tensor
# Output tolerances against the fp32 reference: outputs are averages of N(0, 1) values (|out| < ~3), so 16-bit
# rounding of P and O stays well below these, and a wrong mask, row or sequence moves an output by O(1).
LOW_PRECISION_ATOL = 6e-2
FP32_ATOL = 1e-4


class Finding(Exception):
    pass


def _seqlens_to_cu(lens, device):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _bad_index_tensor(rng: random.Random, good: torch.Tensor, high: int) -> torch.Tensor:
    """A mutation of an int32 index tensor: a value out of range, the wrong dtype, shape or stride."""
    kind = rng.choice(["too_big", "negative", "huge", "int64", "float", "strided", "short", "long", "2d", "empty"])
    t = good.clone()
    flat = t.view(-1)
    if kind == "too_big" and t.numel():
        flat[rng.randrange(t.numel())] = high + rng.randint(1, 64)
    elif kind == "negative" and t.numel():
        flat[rng.randrange(t.numel())] = -rng.randint(1, 64)
    elif kind == "huge" and t.numel():
        flat[rng.randrange(t.numel())] = 2**31 - 1
    elif kind == "int64":
        t = t.long()
    elif kind == "float":
        t = t.float()
    elif kind == "strided":
        # good values behind a stride of 2, junk between them: a reader that ignores the stride reads the junk
        junk = torch.full((2 * t.numel(),), 2**30, dtype=t.dtype, device=t.device)
        junk[::2] = flat
        t = junk.as_strided(good.shape, [2 * s for s in good.stride()])
    elif kind == "short":
        t = t[:-1] if t.dim() == 1 else t[:, :-1]
    elif kind == "long":
        t = torch.cat([t, t[-1:]]) if t.dim() == 1 else torch.cat([t, t[:, -1:]], dim=1)
    elif kind == "2d":
        t = t.reshape(1, -1)
    elif kind == "empty":
        t = t[:0]
    return t


def _close(out, ref, atol):
    return torch.isfinite(out).all() and (out.double() - ref.double()).abs().max().item() <= atol


# ---------------------------------------------------------------------------------------------------------------
# fwd / bwd (dense and varlen)


def fwd_case(rng: random.Random, device: str, dtype: torch.dtype):
    varlen = rng.random() < 0.6
    batch = rng.randint(1, 3)
    nheads_k = rng.choice([1, 2])
    nheads = nheads_k * rng.choice([1, 2])
    head_dim = rng.choice([8, 16, 32, 40, 64])
    causal = rng.random() < 0.5
    lens_q = [rng.randint(1, 9) for _ in range(batch)]
    lens_k = [rng.randint(1, 12) for _ in range(batch)]
    if not varlen:
        lens_q = [lens_q[0]] * batch
        lens_k = [lens_k[0]] * batch

    def mk(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    if varlen:
        q, k, v = mk(sum(lens_q), nheads, head_dim), mk(sum(lens_k), nheads_k, head_dim), mk(sum(lens_k), nheads_k,
                                                                                              head_dim)
        cu_q, cu_k = _seqlens_to_cu(lens_q, device), _seqlens_to_cu(lens_k, device)
    else:
        q, k, v = mk(batch, lens_q[0], nheads, head_dim), mk(batch, lens_k[0], nheads_k, head_dim), mk(
            batch, lens_k[0], nheads_k, head_dim)
        cu_q = cu_k = None
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                max_seqlen_k=max(lens_k), dropout_p=0.0, softmax_scale=head_dim**-0.5,
                window_left=-1, window_right=0 if causal else -1, bottom_right=True, softcap=0.0,
                alibi_slopes=None, attn_bias=None, rng_state=None, return_probs=False, deterministic=False,
                seqused_k=None, num_splits=0, block_table=None)
    meta = dict(varlen=varlen, lens_q=lens_q, lens_k=lens_k, batch=batch, nheads=nheads, nheads_k=nheads_k,
                head_dim=head_dim)
    return args, meta


FWD_MUTATIONS = [
    "cu_q", "cu_k", "max_q_small", "max_k_small", "max_big", "max_negative", "seqused", "block_table",
    "alibi", "bias", "rng_state", "window_huge", "window_bad", "scale", "softcap", "dropout", "num_splits",
    "q_strided", "k_expanded", "head_dim", "empty", "probs", "layout",
]


def _same_values_other_layout(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    """t's values in another valid layout: a transposed storage, a slice of a wider packed tensor, a view whose
    batch stride is 0 (when the batch entries are equal) or an odd storage offset."""
    kind = rng.choice(["transposed", "packed", "offset", "broadcast"])
    if kind == "transposed" and t.dim() >= 3:
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)
    if kind == "packed":
        wide = torch.randn(*t.shape[:-2], t.shape[-2], 3, t.shape[-1], dtype=t.dtype, device=t.device)
        wide[..., 1, :] = t
        return wide[..., 1, :]
    if kind == "broadcast" and t.dim() == 4:
        return t[:1].expand(t.shape) if t.shape[0] > 1 else t
    flat = torch.randn(t.numel() + 1, dtype=t.dtype, device=t.device)
    flat[1:] = t.reshape(-1)
    return flat[1:].view(t.shape)



def mutate_fwd(rng: random.Random, args: dict, meta: dict, name: str) -> str:
    """Applies mutation `name`; returns 'bad' when the call must raise, 'ok' when it must give the reference's
    answer, 'maybe' when it may raise but must give the reference's answer if it does not, 'any' when it may raise or
    give any finite answer (never a crash)."""
    device = args["q"].device
    if name in ("cu_q", "cu_k"):
        key = "cu_seqlens_q" if name == "cu_q" else "cu_seqlens_k"
        if args[key] is None:
            return "ok"
        total = args["q" if name == "cu_q" else "k"].shape[0]
        args[key] = _bad_index_tensor(rng, args[key], total)
        return "any"
    if name == "max_q_small":
        if not meta["varlen"]:
            return "ok"
        args["max_seqlen_q"] = max(0, args["max_seqlen_q"] - rng.randint(1, 3))
        return "any"
    if name == "max_k_small":
        if not meta["varlen"]:
            return "ok"
        args["max_seqlen_k"] = max(0, args["max_seqlen_k"] - rng.randint(1, 3))
        return "any"
    if name == "max_big":
        args[rng.choice(["max_seqlen_q", "max_seqlen_k"])] = rng.choice([HUGE, 2**31 - 1, 2**31, 1000])
        return "any"
    if name == "max_negative":
        args[rng.choice(["max_seqlen_q", "max_seqlen_k"])] = -rng.randint(1, 5)
        return "any"
    if name == "seqused":
        if meta["varlen"]:
            return "ok"
        good = torch.tensor([rng.randint(0, meta["lens_k"][0]) for _ in range(meta["batch"])], dtype=torch.int32,
                            device=device)
        args["seqused_k"] = _bad_index_tensor(rng, good, meta["lens_k"][0]) if rng.random() < 0.8 else good
        return "any"
    if name == "block_table":
        # dense q over k / v as pages of 4 rows (with seqused_k), and a table with a bad entry (or a bad form)
        if meta["varlen"] or any(args[t].shape[-1] != meta["head_dim"] for t in ("k", "v")):
            return "ok"  # (new pools would undo an earlier head-dim mutation of k or v)
        page = 4
        pages_per_seq = math.ceil(meta["lens_k"][0] / page)
        num_pages = meta["batch"] * pages_per_seq
        table = torch.randperm(num_pages, device=device).to(torch.int32).reshape(meta["batch"], pages_per_seq)
        shape = (num_pages, page, meta["nheads_k"], meta["head_dim"])
        args["k"] = torch.randn(shape, dtype=args["k"].dtype, device=device)
        args["v"] = torch.randn(shape, dtype=args["k"].dtype, device=device)
        args["seqused_k"] = torch.tensor(meta["lens_k"], dtype=torch.int32, device=device)
        if rng.random() < 0.3:
            args["seqused_k"] = _bad_index_tensor(rng, args["seqused_k"], meta["lens_k"][0])
        else:
            args["block_table"] = _bad_index_tensor(rng, table, num_pages - 1)
        if args["block_table"] is None:
            args["block_table"] = table
        return "any"
    if name == "alibi":
        h, b = meta["nheads"], meta["batch"]
        choice = rng.choice(["shape", "dtype", "strided", "batch", "3d"])
        slopes = torch.rand(b, h, device=device)
        if choice == "shape":
            slopes = torch.rand(h + 1, device=device)
        elif choice == "dtype":
            slopes = slopes.to(torch.float16)
        elif choice == "strided":
            slopes = torch.rand(b, 2 * h, device=device)[:, ::2]
        elif choice == "batch":
            slopes = torch.rand(b + 1, h, device=device)
        elif choice == "3d":
            slopes = slopes.reshape(1, b, h)
        args["alibi_slopes"] = slopes
        return "any"
    if name == "bias":
        if meta["varlen"]:
            args["attn_bias"] = torch.randn(2, 2, device=device, dtype=args["q"].dtype)
            return "any"
        b, h, sq, sk = meta["batch"], meta["nheads"], meta["lens_q"][0], meta["lens_k"][0]
        choice = rng.choice(["short", "long_q", "dtype", "strided", "expanded", "5d", "rank2"])
        shape = [b, h, sq, sk]
        if choice == "short":
            shape[3] -= 1 if shape[3] > 1 else -1
        elif choice == "long_q":
            shape[2] += 1
        bias = torch.randn(*shape, device=device, dtype=args["q"].dtype)
        if choice == "dtype":
            bias = bias.double() if args["q"].dtype != torch.float64 else bias.float()
        elif choice == "strided":
            bias = torch.randn(b, h, sq, 2 * sk, device=device, dtype=args["q"].dtype)[..., ::2]
        elif choice == "expanded":
            bias = torch.randn(1, 1, 1, sk, device=device, dtype=args["q"].dtype).expand(b, h, sq, sk)
        elif choice == "5d":
            bias = bias.unsqueeze(0)
        elif choice == "rank2":
            bias = bias[0, 0]
        args["attn_bias"] = bias
        return "any"
    if name == "rng_state":
        args["dropout_p"] = 0.25
        args["rng_state"] = rng.choice([torch.zeros(1, dtype=torch.int64, device=device),
                                        torch.zeros(2, dtype=torch.int32, device=device),
                                        torch.zeros(4, dtype=torch.int64, device=device)[::2],
                                        torch.zeros(2, 2, dtype=torch.int64, device=device)])
        return "any"
    if name == "window_huge":
        if args["window_left"] < -1 or args["window_right"] < -1:
            return "bad"  # window_bad came first: the huge values would replace its bad one
        args["window_left"] = rng.choice([2**31 - 1, 2**40, 2**62])
        args["window_right"] = rng.choice([2**31 - 1, 2**40, 0])
        return "ok"  # a window wider than any sequence: the reference's answer (unbounded, or causal)
    if name == "window_bad":
        args[rng.choice(["window_left", "window_right"])] = rng.choice([-2, -(2**40)])
        return "bad"
    if name == "scale":
        args["softmax_scale"] = rng.choice([float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e30])
        # 1e30 makes the softmax an argmax, which rounding may break differently from the reference's
        return "any" if args["softmax_scale"] == 1e30 else "maybe"
    if name == "softcap":
        args["softcap"] = rng.choice([float("nan"), float("inf"), -1.0, 1e-30])
        return "maybe"
    if name == "dropout":
        args["dropout_p"] = rng.choice([float("nan"), -0.5, 1.0, 2.0])
        return "bad"
    if name == "num_splits":
        args["num_splits"] = rng.choice([-1, -(2**40), 2**31, 129])
        return "maybe"
    if name == "q_strided":
        q = args["q"]
        wide = torch.randn(*q.shape[:-1], 2 * q.shape[-1], dtype=q.dtype, device=device)
        args["q"] = wide[..., ::2]
        return "bad"
    if name == "k_expanded":
        k = args["k"]
        args["k"] = k[..., :1, :].expand(k.shape) if k.shape[-2] > 1 else k[:1].expand(k.shape)
        return "ok"
    if name == "head_dim":
        which = rng.choice(["q", "k", "v"])
        t = args[which]
        args[which] = torch.randn(*t.shape[:-1], rng.choice([t.shape[-1] + 8, 0, 264, 512]), dtype=t.dtype,
                                  device=device)
        return "bad"
    if name == "empty":
        which = rng.choice(["q", "k", "v"])
        t = args[which]
        args[which] = t[:0] if meta["varlen"] else t[:, :0]
        return "any"
    if name == "probs":
        args["return_probs"] = True
        return "ok"
    if name == "layout":
        for which in ("q", "k", "v"):
            if rng.random() < 0.6 and args[which].stride(-1) == 1:  # a bad layout from another mutation stays
                args[which] = _same_values_other_layout(rng, args[which])
        return "ok"
    raise AssertionError(name)


def _fwd_reference(args: dict, meta: dict):
    """The reference output of an unmutated (or answer-preserving) call, per sequence."""
    kwargs = {"softmax_scale": args["softmax_scale"], "window_size": (args["window_left"], args["window_right"]),
              "softcap": args["softcap"]}
    outs = []
    if meta["varlen"]:
        cq, ck = args["cu_seqlens_q"].tolist(), args["cu_seqlens_k"].tolist()
        for b in range(meta["batch"]):
            q = args["q"][cq[b]:cq[b + 1]].unsqueeze(0)
            k = args["k"][ck[b]:ck[b + 1]].unsqueeze(0)
            v = args["v"][ck[b]:ck[b + 1]].unsqueeze(0)
            outs.append(reference.attention_ref(q, k, v, **kwargs)[0][0])
        return torch.cat(outs)
    return reference.attention_ref(args["q"], args["k"], args["v"], **kwargs)[0]


def run_fwd(rng: random.Random, device: str, log) -> None:
    dtype = rng.choice([torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16, torch.float16])
    args, meta = fwd_case(rng, device, dtype)
    names = rng.sample(FWD_MUTATIONS, rng.choice([1, 1, 2]))
    expect = "ok"
    order = ["ok", "maybe", "any", "bad"]  # the weakest promise of the call's mutations holds
    for name in names:
        e = mutate_fwd(rng, args, meta, name)
        expect = max(expect, e, key=order.index)
    log(f"fwd {names} varlen={meta['varlen']} dtype={dtype} -> expect {expect}")
    try:
        out, lse, _ = torch.ops.flash_attn.fwd(*args.values())
    except EXPECTED as e:
        log(f"   raised {type(e).__name__}: {str(e)[:160]}")
        if expect == "ok":
            raise Finding(f"fwd {names}: a valid call raised {e!r}") from e
        return
    if expect == "bad":
        raise Finding(f"fwd {names}: the call should have raised")
    if device == "cuda":
        torch.cuda.synchronize()
    if expect in ("ok", "maybe") and args["dropout_p"] == 0.0:
        ref = _fwd_reference(args, meta)
        atol = LOW_PRECISION_ATOL if dtype != torch.float32 else FP32_ATOL
        if not _close(out, ref, atol):
            raise Finding(f"fwd {names}: wrong answer (max err {(out.double() - ref.double()).abs().max().item()})")
    # Whatever was accepted must be a finite answer (rows without keys give 0).
    if not torch.isfinite(out).all():
        raise Finding(f"fwd {names}: accepted call returned a non-finite output")
    # Index values changed behind the version counter (as a raw kernel's write would) after they were checked: on
    # CUDA the host does not read them again, so the kernels' own clamping must keep every access inside the tensors.
    stale = [key for key in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table") if args[key] is not None
             and args[key].dtype == torch.int32 and args[key].numel()]
    if stale and rng.random() < 0.3:
        key = rng.choice(stale)
        index = tuple(rng.randrange(extent) for extent in args[key].shape)
        args[key].data[index] = rng.choice([-(2**31), -7, 2**31 - 1, 1 << 20])
        log(f"   stale {key}: {args[key].tolist()}")
        try:
            again, _, _ = torch.ops.flash_attn.fwd(*args.values())
            if device == "cuda":
                torch.cuda.synchronize()
        except EXPECTED as e:
            log(f"   stale raised {type(e).__name__}: {str(e)[:160]}")
            return
        if not torch.isfinite(again).all():
            raise Finding(f"fwd {names}: stale {key} gave a non-finite output")
        return
    # The backward of an accepted call must not crash either.
    if args["block_table"] is None and args["seqused_k"] is None:
        dout = torch.randn_like(out)
        bwd_args = [dout, args["q"], args["k"], args["v"], out, lse, None, args["cu_seqlens_q"],
                    args["cu_seqlens_k"], args["max_seqlen_q"], args["max_seqlen_k"], args["dropout_p"],
                    args["softmax_scale"], args["window_left"], args["window_right"], args["bottom_right"],
                    args["softcap"], args["alibi_slopes"], args["attn_bias"], args["rng_state"], False, False]
        _checked_backward(lambda: torch.ops.flash_attn.bwd(*bwd_args), device, log, f"bwd after fwd {names}")


def _checked_backward(call, device: str, log, what: str, finite: bool = True):
    """Runs a backward call: a refusal is logged and gives None; an accepted call's dq / dk / dv must be finite."""
    try:
        grads = call()
    except EXPECTED as e:
        log(f"   {what} raised {type(e).__name__}: {str(e)[:160]}")
        return None
    if device == "cuda":
        torch.cuda.synchronize()
    if finite and any(g.numel() and not torch.isfinite(g).all() for g in grads[:3]):
        raise Finding(f"{what}: accepted call returned a non-finite gradient")
    return grads


BWD_MUTATIONS = ["lse_shape", "lse_dtype", "lse_strided", "out_shape", "dout_strided", "dlse", "cu_mismatch",
                 "max_small", "layout"]
# Gradients of the same call with inputs in other layouts: equal up to the order of the dQ adds (atomic on CUDA).
LAYOUT_GRAD_ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def run_bwd(rng: random.Random, device: str, log) -> None:
    dtype = rng.choice([torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16, torch.float16])
    args, meta = fwd_case(rng, device, dtype)
    out, lse, _ = torch.ops.flash_attn.fwd(*args.values())
    dout = torch.randn_like(out)
    name = rng.choice(BWD_MUTATIONS)
    dlse = None
    cu_q, cu_k, max_q = args["cu_seqlens_q"], args["cu_seqlens_k"], args["max_seqlen_q"]
    if name == "lse_shape":
        lse = torch.zeros(*lse.shape[:-1], lse.shape[-1] + rng.choice([-1, 1]), dtype=lse.dtype, device=device) \
            if lse.shape[-1] > 1 else lse.new_zeros(lse.shape[:-1] + (2,))
    elif name == "lse_dtype":
        lse = lse.to(torch.float16)
    elif name == "lse_strided":
        wide = torch.zeros(*lse.shape[:-1], 2 * lse.shape[-1], dtype=lse.dtype, device=device)
        wide[..., ::2] = lse
        lse = wide[..., ::2]
    elif name == "out_shape":
        out = out[..., :-1] if out.shape[-1] > 8 else torch.cat([out, out], dim=-1)
    elif name == "dout_strided":
        wide = torch.zeros(*dout.shape[:-1], 2 * dout.shape[-1], dtype=dout.dtype, device=device)
        dout = wide[..., ::2]
    elif name == "dlse":
        dlse = torch.zeros(*lse.shape[:-1], lse.shape[-1] + 3, dtype=lse.dtype, device=device)
    elif name == "cu_mismatch" and cu_q is not None:
        cu_q = _bad_index_tensor(rng, cu_q, args["q"].shape[0])
    elif name == "max_small" and cu_k is not None:
        max_q = max(0, max_q - 1)
    tensors = {"dout": dout, "q": args["q"], "k": args["k"], "v": args["v"], "out": out}
    if name == "layout":
        tensors = {key: _same_values_other_layout(rng, t) if rng.random() < 0.6 else t for key, t in tensors.items()}
    log(f"bwd {name} varlen={meta['varlen']} dtype={dtype}")

    def backward(t):
        return torch.ops.flash_attn.bwd(t["dout"], t["q"], t["k"], t["v"], t["out"], lse, dlse, cu_q, cu_k, max_q,
                                        args["max_seqlen_k"], 0.0, args["softmax_scale"], args["window_left"],
                                        args["window_right"], True, 0.0, None, None, None, False, False)

    # lse_strided hands the kernels a log-sum-exp they may read as junk: any finite or non-finite answer then
    grads = _checked_backward(lambda: backward(tensors), device, log, f"bwd {name}", name != "lse_strided")
    if grads is not None and name == "layout":
        contiguous = backward({key: t.contiguous() for key, t in tensors.items()})
        for which, ours, theirs in zip("qkv", grads[:3], contiguous[:3]):
            if not _close(ours, theirs, LAYOUT_GRAD_ATOL[dtype]):
                raise Finding(f"bwd layout: d{which} differs from the contiguous inputs' gradient")


# ---------------------------------------------------------------------------------------------------------------
# KV cache ops


def kvcache_case(rng: random.Random, device: str, dtype: torch.dtype):
    batch = rng.randint(1, 3)
    nheads_k = rng.choice([1, 2])
    nheads = nheads_k * rng.choice([1, 2])
    head_dim = rng.choice([8, 16, 32, 64])
    seqlen_cache = rng.randint(4, 24)
    new = rng.randint(1, 3)

    def mk(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    k_cache, v_cache = mk(batch, seqlen_cache, nheads_k, head_dim), mk(batch, seqlen_cache, nheads_k, head_dim)
    seqlens = torch.tensor([rng.randint(0, seqlen_cache - new) for _ in range(batch)], dtype=torch.int32,
                           device=device)
    return dict(q=mk(batch, rng.randint(1, 3), nheads, head_dim), k_cache=k_cache, v_cache=v_cache,
                k=mk(batch, new, nheads_k, head_dim), v=mk(batch, new, nheads_k, head_dim), cache_seqlens=seqlens,
                seqlen_cache=seqlen_cache, batch=batch, head_dim=head_dim)


KV_MUTATIONS = ["seqlens", "seqlens_full", "batch_idx", "leftpad", "block_table", "rotary_short", "rotary_odd",
                "rotary_dtype", "k_long", "cache_strided", "k_heads"]


def run_kvcache(rng: random.Random, device: str, log) -> None:
    dtype = rng.choice([torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16, torch.float16])
    c = kvcache_case(rng, device, dtype)
    name = rng.choice(KV_MUTATIONS)
    batch_idx = leftpad = block_table = cos = sin = None
    k_cache, v_cache, k, v, seqlens = c["k_cache"], c["v_cache"], c["k"], c["v"], c["cache_seqlens"]
    rows = c["seqlen_cache"]
    if name == "seqlens":
        seqlens = _bad_index_tensor(rng, seqlens, rows - k.shape[1])
    elif name == "seqlens_full":
        seqlens = torch.full_like(seqlens, rows - k.shape[1] + 1)
    elif name == "batch_idx":
        batch_idx = _bad_index_tensor(rng, torch.arange(c["batch"], dtype=torch.int32, device=device),
                                      c["batch"] - 1)
    elif name == "leftpad":
        leftpad = _bad_index_tensor(rng, torch.zeros(c["batch"], dtype=torch.int32, device=device), rows)
    elif name == "block_table":
        page = 4
        pages = math.ceil(rows / page)
        shape = (c["batch"] * pages, page) + k_cache.shape[2:]
        k_cache = torch.randn(shape, dtype=dtype, device=device)
        v_cache = torch.randn(shape, dtype=dtype, device=device)
        seqlens = seqlens.clamp(max=pages * page - k.shape[1])
        table = torch.arange(c["batch"] * pages, dtype=torch.int32, device=device).reshape(c["batch"], pages)
        block_table = _bad_index_tensor(rng, table, c["batch"] * pages - 1)
    elif name.startswith("rotary"):
        rot = c["head_dim"] if name != "rotary_odd" else c["head_dim"] // 2 + 1
        length = rows if name != "rotary_short" else rng.randint(0, rows - 1)
        cos = torch.randn(length, rot // 2 if name != "rotary_odd" else rot, device=device,
                          dtype=dtype if name != "rotary_dtype" else torch.float64)
        sin = torch.randn_like(cos)
        if name == "rotary_odd":
            cos = cos[:, : rng.choice([c["head_dim"], c["head_dim"] + 2])]
            sin = sin[:, : cos.shape[1]]
    elif name == "k_long":
        k = torch.randn(c["batch"], rows + 1, *k.shape[2:], dtype=dtype, device=device)
        v = torch.randn_like(k)
    elif name == "cache_strided":
        wide = torch.randn(*k_cache.shape[:-1], 2 * c["head_dim"], dtype=dtype, device=device)
        k_cache = wide[..., ::2]
    elif name == "k_heads":
        k = torch.randn(*k.shape[:2], k.shape[2] + 1, c["head_dim"], dtype=dtype, device=device)
    op = rng.choice(["append", "decode"])
    log(f"kvcache {op} {name} dtype={dtype}")
    try:
        if op == "append":
            torch.ops.flash_attn.kvcache_append_(k_cache, v_cache, k, v, seqlens, batch_idx, block_table, leftpad,
                                                 cos, sin, True, c["q"] if cos is not None else None, True)
        else:
            out, _ = torch.ops.flash_attn.kvcache_decode_(c["q"], k_cache, v_cache, k, v, seqlens, block_table, cos,
                                                          sin, True, c["head_dim"] ** -0.5, -1, 0, 0.0, None, 0)
            if device == "cuda":
                torch.cuda.synchronize()
            if not torch.isfinite(out).all():
                raise Finding(f"kvcache_decode_ {name}: accepted call returned a non-finite output")
    except EXPECTED as e:
        log(f"   raised {type(e).__name__}: {str(e)[:160]}")
    # The public function too: its own checks, then the same ops.
    try:
        flash_attn.flash_attn_with_kvcache(c["q"], k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=seqlens, cache_batch_idx=batch_idx, cache_leftpad=leftpad,
                                           block_table=block_table, causal=True)
    except EXPECTED as e:
        log(f"   public raised {type(e).__name__}: {str(e)[:160]}")


# ---------------------------------------------------------------------------------------------------------------
# rotary


def run_rotary(rng: random.Random, device: str, log) -> None:
    dtype = rng.choice([torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16, torch.float16])
    batch, seqlen, nheads, head_dim = rng.randint(1, 3), rng.randint(1, 9), rng.randint(1, 2), rng.choice([8, 16, 32])
    rot = rng.choice([head_dim, head_dim // 2])
    x = torch.randn(batch, seqlen, nheads, head_dim, dtype=dtype, device=device)
    cos = torch.randn(seqlen + rng.randint(0, 4), rot // 2, dtype=dtype, device=device)
    sin = torch.randn_like(cos)
    offsets, offset, cu, max_seqlen = None, 0, None, 0
    name = rng.choice(["offsets", "offset", "cu", "cos_short", "cos_wide", "cos_strided", "x_strided"])
    if name == "offsets":
        offsets = _bad_index_tensor(rng, torch.zeros(batch, dtype=torch.int32, device=device),
                                    cos.shape[0] - seqlen)
    elif name == "offset":
        offset = rng.choice([-1, cos.shape[0], HUGE, -HUGE])
    elif name == "cu":
        x = x.reshape(batch * seqlen, nheads, head_dim)
        good = _seqlens_to_cu([seqlen] * batch, device)
        cu = _bad_index_tensor(rng, good, batch * seqlen)
        max_seqlen = rng.choice([seqlen, seqlen - 1, HUGE, -1])
    elif name == "cos_short":
        cos, sin = cos[: rng.randint(0, seqlen - 1)], sin[: rng.randint(0, seqlen - 1)]
    elif name == "cos_wide":
        cos = torch.randn(cos.shape[0], head_dim, dtype=dtype, device=device)
        sin = torch.randn_like(cos)
    elif name == "cos_strided":
        cos = torch.randn(cos.shape[0], 2 * cos.shape[1], dtype=dtype, device=device)[:, ::2]
    elif name == "x_strided":
        x = torch.randn(batch, seqlen, nheads, 2 * head_dim, dtype=dtype, device=device)[..., ::2]
    log(f"rotary {name} dtype={dtype}")
    for op in (torch.ops.flash_attn.rotary, torch.ops.flash_attn.rotary_):
        try:
            op(x.clone() if op is torch.ops.flash_attn.rotary_ else x, cos, sin, offsets, offset, cu, max_seqlen,
               rng.random() < 0.5, False)
            if device == "cuda":
                torch.cuda.synchronize()
        except EXPECTED as e:
            log(f"   raised {type(e).__name__}: {str(e)[:160]}")


# ---------------------------------------------------------------------------------------------------------------
# public functions with autograd: varlen over paged caches, SDPA masks


def run_public(rng: random.Random, device: str, log) -> None:
    dtype = rng.choice([torch.float32, torch.bfloat16] if device == "cpu" else [torch.bfloat16, torch.float16])
    args, meta = fwd_case(rng, device, dtype)
    name = rng.choice(["varlen_paged", "sdpa_mask", "grad_bias", "packed"])
    log(f"public {name} dtype={dtype}")
    try:
        if name == "varlen_paged":
            page = rng.choice([1, 3, 4])
            batch = meta["batch"]
            lens_k = [rng.randint(1, 12) for _ in range(batch)]
            pages = [math.ceil(n / page) for n in lens_k]
            num_pages = sum(pages) + 1
            shape = (num_pages, page, meta["nheads_k"], meta["head_dim"])
            k_cache = torch.randn(shape, dtype=dtype, device=device)
            v_cache = torch.randn(shape, dtype=dtype, device=device)
            table = torch.zeros(batch, max(pages), dtype=torch.int32, device=device)
            start = 0
            for b, n in enumerate(pages):
                table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
                start += n
            if rng.random() < 0.7:
                table = _bad_index_tensor(rng, table, num_pages - 1)
            lens_q = [rng.randint(1, 5) for _ in range(batch)]
            q = torch.randn(sum(lens_q), meta["nheads"], meta["head_dim"], dtype=dtype, device=device)
            cu_k = _seqlens_to_cu(lens_k, device)
            if rng.random() < 0.3:
                cu_k = _bad_index_tensor(rng, cu_k, num_pages * page)
            flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, _seqlens_to_cu(lens_q, device), cu_k,
                                              max(lens_q), max(lens_k), causal=True, block_table=table)
        elif name == "sdpa_mask":
            b, h, sq, sk, d = meta["batch"], meta["nheads"], rng.randint(1, 9), rng.randint(1, 9), meta["head_dim"]
            q = torch.randn(b, h, sq, d, dtype=dtype, device=device)
            k = torch.randn(b, h, sk, d, dtype=dtype, device=device)
            v = torch.randn(b, h, sk, d, dtype=dtype, device=device)
            shape = rng.choice([(sq, sk), (1, sk), (b, 1, 1, sk), (h, sq, sk), (b, h, sq, sk), (sq + 1, sk),
                                (b, h, sq, 1), (2 * b, h, sq, sk), (sk,)])
            mask = torch.rand(*shape, device=device) < 0.7 if rng.random() < 0.5 else torch.randn(
                *shape, device=device, dtype=dtype)
            if mask.dim() >= 2 and rng.random() < 0.3:
                mask = mask.transpose(-1, -2).contiguous().transpose(-1, -2)
            out = flash_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                   attn_mask=mask if mask.dtype == torch.bool
                                                                   else mask.float())
            finite = torch.isfinite(ref)
            if not torch.equal(finite, torch.isfinite(out)) and not (~finite).any():
                raise Finding(f"sdpa mask {shape}: non-finite output")
            atol = LOW_PRECISION_ATOL if dtype != torch.float32 else FP32_ATOL
            if finite.all() and (out.float() - ref).abs().max().item() > atol:
                raise Finding(f"sdpa mask {shape}: wrong answer")
        elif name == "grad_bias":
            if meta["varlen"]:
                return
            b, h, sq, sk = meta["batch"], meta["nheads"], meta["lens_q"][0], meta["lens_k"][0]
            shape = rng.choice([(1, 1, sq, sk), (b, 1, 1, sk), (1, h, sq, 1), (b, h, sq, sk)])
            bias = torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)
            q = args["q"].clone().requires_grad_()
            out, _, _ = torch.ops.flash_attn.fwd(q, args["k"], args["v"], None, None, 0, 0, 0.0,
                                                 meta["head_dim"] ** -0.5, -1, -1, True, 0.0, None,
                                                 bias.expand(b, h, sq, sk), None, False)
            out.sum().backward()
            if not torch.isfinite(bias.grad).all() or not torch.isfinite(q.grad).all():
                raise Finding(f"bias gradient {shape}: non-finite")
        elif name == "packed":
            qkv = torch.randn(meta["batch"] * 5, 3, meta["nheads"], meta["head_dim"], dtype=dtype, device=device)
            cu = _seqlens_to_cu([5] * meta["batch"], device)
            if rng.random() < 0.7:
                cu = _bad_index_tensor(rng, cu, meta["batch"] * 5)
            flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, rng.choice([5, 4, 2**31, 0]), causal=True)
    except EXPECTED as e:
        log(f"   raised {type(e).__name__}: {str(e)[:160]}")
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    runners = [run_fwd] * 5 + [run_bwd] * 2 + [run_kvcache] * 2 + [run_rotary] + [run_public] * 2
    findings = []
    log_lines: list[str] = []

    def log(line):
        log_lines.append(line)
        if args.verbose:
            print(line, flush=True)

    for i in range(args.cases):
        runner = rng.choice(runners)
        case_rng = random.Random(rng.getrandbits(64))
        log(f"[{i}]")
        try:
            runner(case_rng, args.device, log)
        except Finding as f:
            findings.append(f"[{i}] {f}")
            print(f"FINDING [{i}] {f}", flush=True)
        except Exception:  # an exception type no bad argument should raise
            findings.append(f"[{i}] unexpected:\n{traceback.format_exc()}")
            print("\n".join(log_lines[-3:]), flush=True)
            print(f"FINDING [{i}] unexpected exception:\n{traceback.format_exc()}", flush=True)
    print(f"fuzz_inputs: {args.cases} cases (seed {args.seed}, {args.device}), {len(findings)} findings")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
