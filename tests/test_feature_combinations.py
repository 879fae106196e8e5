# Random combinations of features that the parametrized tests cover one or two at a time: each case draws an entry
# point (dense, packed, varlen, KV cache with appends / pages / batch indices / left padding), a head dim (any, not only
# the buckets), lengths (empty sequences included), GQA ratio, causal or a window, softcap, ALiBi, key splits and
# dtype, and checks the output (and, where the entry point has a backward, the gradients) against the fp64 reference
# with FlashAttention's rule (helpers.assert_close_fa). On CUDA this walks the dispatch's many paths (Hopper and
# portable kernels, splits, packed GQA, pages in place) in combinations no table lists. The seed names the case.
import math
import random

import pytest
import torch

import flash_attn
from flash_attn.reference import attention_ref
from helpers import assert_close_fa, check_output_and_grads, randn, require_supported

CPU_CASES = 96
CUDA_CASES = 240
HEAD_DIMS = [8, 16, 24, 32, 40, 64, 72, 80, 96, 100, 128, 136, 160, 192, 200, 224, 256]


def _config(seed, device):
    rng = random.Random(seed)
    cuda = device == "cuda"
    long_keys = 1100 if cuda else 160
    c = {
        "rng": rng,
        "dtype": rng.choice([torch.bfloat16, torch.float16] if cuda else [torch.bfloat16, torch.float32]),
        "head_dim": rng.choice(HEAD_DIMS),
        "batch": rng.randint(1, 3),
        "nheads_k": rng.randint(1, 3),
        "entry": rng.choice(["func", "func", "kvpacked", "qkvpacked", "varlen", "varlen", "kvcache", "kvcache"]),
        "mask": rng.choice(["none", "causal", "causal", "window"]),
        "softcap": rng.choice([0.0, 0.0, 0.0, rng.uniform(5.0, 50.0)]),
        "alibi": rng.choice([None, None, None, "heads", "batch_heads"]),
        "deterministic": rng.random() < 0.2,
        "num_splits": rng.choice([0, 0, 1, 2, 3]),
    }
    c["nheads"] = c["nheads_k"] * rng.choice([1, 1, 2, 4])
    c["window"] = (rng.randint(0, 200), rng.randint(0, 64)) if c["mask"] == "window" else (-1, -1)

    def length(upper):
        return rng.choice([1, rng.randint(1, 17), rng.randint(1, upper), upper])

    c["seqlen_q"] = length(long_keys // (4 if c["entry"] == "kvcache" else 1))
    c["seqlen_k"] = c["seqlen_q"] if c["entry"] == "qkvpacked" else length(long_keys)
    return c


def _slopes(c, device):
    if c["alibi"] is None:
        return None
    shape = (c["nheads"],) if c["alibi"] == "heads" else (c["batch"], c["nheads"])
    return (torch.rand(*shape, device=device) * 0.3 + 0.02).float()


def _ref_kwargs(c, slopes):
    return {"causal": c["mask"] == "causal", "window_size": c["window"], "softcap": c["softcap"],
            "alibi_slopes": slopes}


def _dense_case(c, device):
    q = randn(c["batch"], c["seqlen_q"], c["nheads"], c["head_dim"], dtype=c["dtype"], device=device,
              requires_grad=True)
    k = randn(c["batch"], c["seqlen_k"], c["nheads_k"], c["head_dim"], dtype=c["dtype"], device=device,
              requires_grad=True)
    v = randn(c["batch"], c["seqlen_k"], c["nheads_k"], c["head_dim"], dtype=c["dtype"], device=device,
              requires_grad=True)
    slopes = _slopes(c, device)
    kwargs = {"causal": c["mask"] == "causal", "window_size": c["window"], "softcap": c["softcap"],
              "alibi_slopes": slopes, "deterministic": c["deterministic"]}
    if c["entry"] == "func":
        out = flash_attn.flash_attn_func(q, k, v, **kwargs)
    elif c["entry"] == "kvpacked":
        out = flash_attn.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), **kwargs)
    else:
        if c["nheads"] != c["nheads_k"]:
            k = randn(*k.shape[:2], c["nheads"], c["head_dim"], dtype=c["dtype"], device=device, requires_grad=True)
            v = randn(*k.shape, dtype=c["dtype"], device=device, requires_grad=True)
        out = flash_attn.flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), **kwargs)
    inputs = (q, k, v)
    return out, inputs, lambda *xs, compute_dtype: attention_ref(*xs, compute_dtype=compute_dtype,
                                                                 **_ref_kwargs(c, slopes))


def _varlen_case(c, device):
    rng = c["rng"]
    lens_q = [rng.choice([0, rng.randint(1, c["seqlen_q"]), c["seqlen_q"]]) for _ in range(c["batch"])]
    lens_k = [rng.choice([rng.randint(1, c["seqlen_k"]), c["seqlen_k"]]) for _ in range(c["batch"])]
    if rng.random() < 0.2:
        lens_k[0] = 0
    q = randn(sum(lens_q), c["nheads"], c["head_dim"], dtype=c["dtype"], device=device, requires_grad=True)
    k = randn(sum(lens_k), c["nheads_k"], c["head_dim"], dtype=c["dtype"], device=device, requires_grad=True)
    v = randn(sum(lens_k), c["nheads_k"], c["head_dim"], dtype=c["dtype"], device=device, requires_grad=True)
    cu_q = torch.tensor([0] + list(_prefix(lens_q)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(_prefix(lens_k)), dtype=torch.int32, device=device)
    slopes = _slopes(c, device)
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                            causal=c["mask"] == "causal", window_size=c["window"],
                                            softcap=c["softcap"], alibi_slopes=slopes,
                                            deterministic=c["deterministic"])

    def ref(qx, kx, vx, compute_dtype):
        outs = []
        for b in range(c["batch"]):
            sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
            sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
            seq_slopes = slopes if slopes is None or slopes.dim() == 1 else slopes[b:b + 1]
            o, _ = attention_ref(qx[sq].unsqueeze(0), kx[sk].unsqueeze(0), vx[sk].unsqueeze(0),
                                 compute_dtype=compute_dtype, **_ref_kwargs(c, seq_slopes))
            outs.append(o[0])
        return torch.cat(outs), None

    return out, (q, k, v), ref


def _prefix(values):
    total = 0
    for value in values:
        total += value
        yield total


def _kvcache_case(c, device):
    """flash_attn_with_kvcache, forward only: new rows appended (sometimes), pages (sometimes), cache_batch_idx or
    cache_leftpad (sometimes); the reference attends over each sequence's rows after the append."""
    rng = c["rng"]
    batch, hk, d, dtype = c["batch"], c["nheads_k"], c["head_dim"], c["dtype"]
    new = rng.choice([0, 0, 1, rng.randint(1, 8)])
    rows = c["seqlen_k"] + new
    lengths = [rng.randint(0, c["seqlen_k"]) for _ in range(batch)]
    layout = rng.choice(["contiguous", "paged", "batch_idx", "leftpad"])
    q = randn(batch, c["seqlen_q"], c["nheads"], d, dtype=dtype, device=device)
    k_new = randn(batch, new, hk, d, dtype=dtype, device=device) if new else None
    v_new = randn(batch, new, hk, d, dtype=dtype, device=device) if new else None
    leftpad = None
    if layout == "leftpad":
        leftpad = [rng.randint(0, length) for length in lengths]
    k_seq = randn(batch, rows, hk, d, dtype=dtype, device=device)  # each sequence's cache, logical order
    v_seq = randn(batch, rows, hk, d, dtype=dtype, device=device)
    kwargs = {"causal": c["mask"] == "causal", "window_size": c["window"], "softcap": c["softcap"],
              "alibi_slopes": _slopes(c, device), "num_splits": c["num_splits"],
              "cache_seqlens": torch.tensor(lengths, dtype=torch.int32, device=device)}
    if leftpad is not None:
        kwargs["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device=device)
    if layout == "paged":
        page = rng.choice([1, 4, 16, 32, 64, 128, 256])
        pages = math.ceil(rows / page)
        order = torch.randperm(batch * pages + 1, device=device)[: batch * pages]
        table = order.to(torch.int32).reshape(batch, pages)
        k_pool = randn(batch * pages + 1, page, hk, d, dtype=dtype, device=device)
        v_pool = randn(batch * pages + 1, page, hk, d, dtype=dtype, device=device)
        padded = pages * page
        k_pad = torch.cat([k_seq, k_seq.new_zeros(batch, padded - rows, hk, d)], dim=1)
        v_pad = torch.cat([v_seq, v_seq.new_zeros(batch, padded - rows, hk, d)], dim=1)
        k_pool[table.long().reshape(-1)] = k_pad.reshape(batch * pages, page, hk, d)
        v_pool[table.long().reshape(-1)] = v_pad.reshape(batch * pages, page, hk, d)
        k_cache, v_cache = k_pool, v_pool
        kwargs["block_table"] = table
    elif layout == "batch_idx":
        spare = rng.randint(0, 2)
        perm = torch.randperm(batch + spare, device=device)[:batch]
        k_cache = randn(batch + spare, rows, hk, d, dtype=dtype, device=device)
        v_cache = randn(batch + spare, rows, hk, d, dtype=dtype, device=device)
        k_cache[perm.long()] = k_seq
        v_cache[perm.long()] = v_seq
        kwargs["cache_batch_idx"] = perm.to(torch.int32)
    else:
        k_cache, v_cache = k_seq.clone(), v_seq.clone()
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)

    def ref(qx, compute_dtype):
        outs = []
        for b in range(batch):
            start = 0 if leftpad is None else leftpad[b]
            keys = [k_seq[b, start:lengths[b]]] + ([k_new[b]] if new else [])
            values = [v_seq[b, start:lengths[b]]] + ([v_new[b]] if new else [])
            slopes = kwargs["alibi_slopes"]
            seq_slopes = slopes if slopes is None or slopes.dim() == 1 else slopes[b:b + 1]
            o, _ = attention_ref(qx[b:b + 1], torch.cat(keys).unsqueeze(0).to(compute_dtype),
                                 torch.cat(values).unsqueeze(0).to(compute_dtype), compute_dtype=compute_dtype,
                                 **_ref_kwargs(c, seq_slopes))
            outs.append(o)
        return torch.cat(outs), None

    return out, (q,), ref


def _check(seed, device):
    c = _config(seed, device)
    require_supported(device, c["dtype"], c["head_dim"], backward=c["entry"] != "kvcache")
    if c["entry"] == "kvcache":
        out, inputs, ref = _kvcache_case(c, device)
        truth = ref(inputs[0].to(torch.float64), compute_dtype=torch.float64)[0]
        naive = ref(inputs[0], compute_dtype=c["dtype"])[0]
        assert_close_fa(out, truth, naive, 2)
        return
    out, inputs, ref = _varlen_case(c, device) if c["entry"] == "varlen" else _dense_case(c, device)
    dout = randn(*out.shape, dtype=out.dtype, device=device)
    grads = torch.autograd.grad(out, inputs, dout)
    truth_inputs = [x.detach().to(torch.float64).requires_grad_() for x in inputs]
    naive_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    results = []
    for xs, dtype in ((truth_inputs, torch.float64), (naive_inputs, c["dtype"])):
        ref_out = ref(*xs, compute_dtype=dtype)[0]
        ref_grads = torch.autograd.grad(ref_out, xs, dout.to(dtype), allow_unused=True)
        results.append((ref_out.detach(), None, tuple(torch.zeros_like(x) if g is None else g
                                                      for x, g in zip(xs, ref_grads))))
    check_output_and_grads(out, grads, results[0], results[1])


@pytest.mark.parametrize("seed", range(CPU_CASES))
def test_feature_combination_cpu(seed):
    _check(seed, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", range(CUDA_CASES))
def test_feature_combination_cuda(seed):
    _check(seed, "cuda")
