# The attention spec of flash_attn written in plain PyTorch: attention_ref (dense, flash layout
# (B, S, H, D), GQA, causal/window/softcap/ALiBi/bias/dropout), attention_varlen_ref, the Philox4x32-10
# generator and the dropout keep masks the kernels must reproduce bit-exactly.
# Used by the tests as ground truth (compute_dtype float32/float64) and as the "naive low precision"
# baseline (compute_dtype = input dtype). Depends on torch only, never on the compiled extension.
import math

import torch

MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10


def _mulhilo32(a, b):
    """(high, low) 32-bit halves of the 64-bit product of the constant a and the int64 tensor b < 2**32."""
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    p_lo = a * b_lo
    p_hi = a * b_hi
    t = p_lo + ((p_hi & 0xFFFF) << 16)
    return (p_hi >> 16) + (t >> 32), t & MASK32


def philox4x32_10(counter_words, key_words):
    """Philox4x32-10 on int64 tensors holding 32-bit words.

    counter_words: 4 broadcastable int64 tensors (c0, c1, c2, c3); key_words: 2 int64 tensors or ints.
    Returns the 4 output words as int64 tensors with values in [0, 2**32).
    """
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & MASK32 for c in counter_words)
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64, device=c0.device) & MASK32 for k in key_words)
    for rnd in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if rnd < PHILOX_ROUNDS - 1:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def dropout_threshold(p):
    """Integer threshold: a Philox word r keeps its element iff r < threshold."""
    return int(math.floor((1.0 - p) * 4294967296.0))


def dropout_keep_mask(rng_state, batch, nheads_q, seqlen_q, seqlen_k, p):
    """Boolean keep mask (batch, nheads_q, seqlen_q, seqlen_k) for dropout probability p.

    rng_state: int64 tensor [2] = (seed, offset). Element (b, h, i, j) uses counter
    (j // 4, i, b * nheads_q + h, offset & 0xffffffff), key (seed low, seed high), word j % 4.
    """
    rng = rng_state.detach().to("cpu", torch.int64)
    seed, offset = int(rng[0]), int(rng[1])
    if p <= 0.0:
        return torch.ones(batch, nheads_q, seqlen_q, seqlen_k, dtype=torch.bool)
    b = torch.arange(batch, dtype=torch.int64).view(-1, 1, 1, 1)
    h = torch.arange(nheads_q, dtype=torch.int64).view(1, -1, 1, 1)
    i = torch.arange(seqlen_q, dtype=torch.int64).view(1, 1, -1, 1)
    j4 = torch.arange((seqlen_k + 3) // 4, dtype=torch.int64).view(1, 1, 1, -1)
    words = philox4x32_10(
        (j4, i, b * nheads_q + h, torch.tensor(offset & MASK32)),
        (seed & MASK32, (seed >> 32) & MASK32),
    )
    r = torch.stack(words, dim=-1).flatten(-2)[..., :seqlen_k]
    return r < dropout_threshold(p)


def dropout_keep_mask_varlen(rng_state, seqlens_q, seqlens_k, nheads_q, p, max_seqlen_q=None, max_seqlen_k=None):
    """Keep mask (batch, nheads_q, max_seqlen_q, max_seqlen_k) for varlen; False beyond each sequence."""
    seqlens_q, seqlens_k = list(seqlens_q), list(seqlens_k)
    max_q = max(seqlens_q) if max_seqlen_q is None else max_seqlen_q
    max_k = max(seqlens_k) if max_seqlen_k is None else max_seqlen_k
    mask = dropout_keep_mask(rng_state, len(seqlens_q), nheads_q, max_q, max_k, p)
    for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k)):
        mask[b, :, sq:, :] = False
        mask[b, :, :, sk:] = False
    return mask


def visible_mask(seqlen_q, seqlen_k, window_size=(-1, -1), causal=False, bottom_right=True, device=None):
    """Boolean (seqlen_q, seqlen_k): key j visible to query i under the causal/window rule."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    diag = i + (seqlen_k - seqlen_q if bottom_right else 0)
    vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        vis &= j >= diag - left
    if right >= 0:
        vis &= j <= diag + right
    return vis


def alibi_bias(alibi_slopes, batch, seqlen_q, seqlen_k, bottom_right=True, dtype=torch.float32):
    """ALiBi bias −slope·|i + offset − j| broadcast to (batch, H, seqlen_q, seqlen_k)."""
    slopes = alibi_slopes.to(dtype)
    slopes = slopes.view(1, -1, 1, 1) if slopes.dim() == 1 else slopes.view(batch, -1, 1, 1)
    i = torch.arange(seqlen_q, device=slopes.device).view(-1, 1)
    j = torch.arange(seqlen_k, device=slopes.device).view(1, -1)
    dist = (i + (seqlen_k - seqlen_q if bottom_right else 0) - j).abs().to(dtype)
    return -slopes * dist


def attention_ref(
    q,
    k,
    v,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_mask=None,
    dropout_p=0.0,
    attn_bias=None,
    bottom_right=True,
    compute_dtype=torch.float32,
    return_probs=False,
):
    """Dense attention on the flash layout: q (B, Sq, H, D), k/v (B, Sk, Hk, D), H % Hk == 0.

    attn_bias: float (additive) or bool (True = attend), broadcastable to (B, H, Sq, Sk).
    dropout_mask: bool keep mask (B, H, Sq, Sk) applied after softmax with 1/(1-dropout_p) scaling.
    Returns (out (B, Sq, H, D), lse (B, H, Sq)) in compute_dtype, plus probs (B, H, Sq, Sk) before
    dropout when return_probs. Rows with no visible key give out 0, lse +inf, probs 0, zero gradients.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if nheads % nheads_k != 0:
        raise ValueError("nheads of q must be a multiple of nheads of k")
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    group = nheads // nheads_k
    kc = kc.repeat_interleave(group, dim=2)
    vc = vc.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", qc, kc) * scale
    if softcap > 0.0:
        scores = torch.tanh(scores / softcap) * softcap
    vis = visible_mask(seqlen_q, seqlen_k, window_size, causal, bottom_right, q.device)
    vis = vis.expand(batch, nheads, seqlen_q, seqlen_k)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, batch, seqlen_q, seqlen_k, bottom_right, compute_dtype)
    if attn_bias is not None:
        if attn_bias.dtype == torch.bool:
            vis = vis & attn_bias
        else:
            scores = scores + attn_bias.to(compute_dtype)
    scores = scores.masked_fill(~vis, float("-inf"))
    row_max = scores.detach().amax(dim=-1, keepdim=True) if seqlen_k > 0 else scores.new_zeros(
        batch, nheads, seqlen_q, 1
    )
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    expo = torch.exp(scores - row_max)
    denom = expo.sum(dim=-1, keepdim=True)
    empty = denom == 0
    safe_denom = torch.where(empty, torch.ones_like(denom), denom)
    probs = expo / safe_denom
    lse = torch.where(empty, torch.full_like(denom, float("inf")), torch.log(safe_denom) + row_max).squeeze(-1)
    weights = probs
    if dropout_mask is not None:
        weights = weights.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    out = torch.einsum("bhij,bjhd->bihd", weights, vc)
    if return_probs:
        return out, lse, probs
    return out, lse


def seqlens_from_cu(cu_seqlens):
    """Per-sequence lengths (python ints) from an int32 cu_seqlens tensor."""
    cu = cu_seqlens.detach().to("cpu", torch.int64).tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def cu_from_seqlens(seqlens, device="cpu"):
    """int32 cu_seqlens (len(seqlens) + 1,) starting at 0."""
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def attention_varlen_ref(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q=None,
    max_seqlen_k=None,
    alibi_slopes=None,
    dropout_mask=None,
    return_probs=False,
    **kwargs,
):
    """Varlen attention: q (total_q, H, D), k/v (total_k, Hk, D), each sequence attended on its own.

    alibi_slopes (H,) or (batch, H); dropout_mask (batch, H, max_seqlen_q, max_seqlen_k) padded keep mask.
    Other keyword arguments go to attention_ref. Returns (out (total_q, H, D), lse (H, total_q)) and,
    when return_probs, probs padded to (batch, H, max_seqlen_q, max_seqlen_k) with zeros.
    """
    cu_q = cu_seqlens_q.detach().to("cpu", torch.int64).tolist()
    cu_k = cu_seqlens_k.detach().to("cpu", torch.int64).tolist()
    batch = len(cu_q) - 1
    nheads = q.shape[1]
    lens_q = [cu_q[b + 1] - cu_q[b] for b in range(batch)]
    lens_k = [cu_k[b + 1] - cu_k[b] for b in range(batch)]
    max_q = max(lens_q, default=0) if max_seqlen_q is None else max_seqlen_q
    max_k = max(lens_k, default=0) if max_seqlen_k is None else max_seqlen_k
    compute_dtype = kwargs.get("compute_dtype", torch.float32)
    outs, lses = [], []
    probs_all = q.new_zeros(batch, nheads, max_q, max_k, dtype=compute_dtype)
    for b in range(batch):
        qb = q[cu_q[b]:cu_q[b + 1]].unsqueeze(0)
        kb = k[cu_k[b]:cu_k[b + 1]].unsqueeze(0)
        vb = v[cu_k[b]:cu_k[b + 1]].unsqueeze(0)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        mask = None
        if dropout_mask is not None:
            mask = dropout_mask[b:b + 1, :, :lens_q[b], :lens_k[b]]
        out, lse, probs = attention_ref(
            qb, kb, vb, alibi_slopes=slopes, dropout_mask=mask, return_probs=True, **kwargs
        )
        outs.append(out[0])
        lses.append(lse[0])
        probs_all[b, :, :lens_q[b], :lens_k[b]] = probs[0].detach()
    out = torch.cat(outs, dim=0)
    lse = torch.cat(lses, dim=1)
    if return_probs:
        return out, lse, probs_all
    return out, lse
