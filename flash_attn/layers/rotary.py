"""flash_attn.layers.rotary: rotary position embeddings with Dao-AILab's functions and signatures (apply_rotary_emb,
apply_rotary_emb_qkv_, apply_rotary_emb_kv_, RotaryEmbedding), on the ops torch.ops.flash_attn.rotary / rotary_ (one
fused CUDA kernel; C++ on CPU), with autograd (the backward rotates the gradient by the opposite angle). x is
(batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens; cos / sin are (seqlen_ro, rotary_dim / 2)
in x's dtype; only the first rotary_dim columns rotate. GPT-NeoX pairs (i, i + rotary_dim / 2) by default, GPT-J
pairs (2i, 2i + 1) with interleaved=True. seqlen_offsets (an int, or a (batch,) tensor) shifts each sequence's
positions; positions past the table are left unrotated (an int offset must keep them inside)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .._native import C as _C  # noqa: F401  (registers the rotary ops)

Offsets = Union[int, torch.Tensor]


@torch.library.register_fake("flash_attn::rotary")
def _rotary_fake(x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate):
    return x.new_empty(x.shape)


@torch.library.register_fake("flash_attn::rotary_")
def _rotary_inplace_fake(x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate):
    return None


def _split_offsets(seqlen_offsets: Offsets):
    """(tensor or None, int) as the ops take them."""
    if isinstance(seqlen_offsets, torch.Tensor):
        return seqlen_offsets, 0
    return None, int(seqlen_offsets)


def apply_rotary(x, cos, sin, seqlen_offsets: Offsets = 0, cu_seqlens=None, max_seqlen=None, interleaved=False,
                 inplace=False, conjugate=False):
    """The op call without autograd: returns the rotated tensor (x itself when inplace)."""
    offsets, offset = _split_offsets(seqlen_offsets)
    if cu_seqlens is not None and max_seqlen is None:
        raise ValueError("apply_rotary: max_seqlen is required with cu_seqlens")
    args = (cos, sin, offsets, offset, cu_seqlens, -1 if max_seqlen is None else int(max_seqlen), bool(interleaved),
            bool(conjugate))
    if inplace:
        torch.ops.flash_attn.rotary_(x, *args)
        return x
    return torch.ops.flash_attn.rotary(x, *args)


class ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved=False, inplace=False, seqlen_offsets: Offsets = 0, cu_seqlens=None,
                max_seqlen=None):
        out = apply_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace)
        offsets, offset = _split_offsets(seqlen_offsets)
        ctx.save_for_backward(cos, sin, cu_seqlens, offsets)
        ctx.options = (offset, max_seqlen, interleaved, inplace)
        if inplace:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, dout):
        cos, sin, cu_seqlens, offsets = ctx.saved_tensors
        offset, max_seqlen, interleaved, inplace = ctx.options
        dx = apply_rotary(dout, cos, sin, offset if offsets is None else offsets, cu_seqlens, max_seqlen, interleaved,
                          conjugate=True)
        return dx, None, None, None, None, None, None, None


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets: Offsets = 0, cu_seqlens=None,
                     max_seqlen=None):
    """x rotated in its first rotary_dim = 2 * cos.shape[1] columns at positions seqlen_offsets + row: x (batch,
    seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens (batch + 1,) int32 and max_seqlen; cos, sin
    (seqlen_ro, rotary_dim / 2). interleaved: GPT-J pairs instead of GPT-NeoX halves. inplace writes into x."""
    return ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


apply_rotary_emb_func = apply_rotary_emb  # Dao's older name


def _qk_views(qkv, num_heads_q):
    """q and k of a packed qkv, as views: (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, num_heads_q + 2 *
    num_heads_k, headdim)."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"apply_rotary_emb_qkv_: qkv must be (batch, seqlen, 3, nheads, headdim); got "
                             f"{tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.dim() != 4 or num_heads_q is None:
        raise ValueError("apply_rotary_emb_qkv_: a 4-D qkv (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) "
                         f"needs num_heads_q; got shape {tuple(qkv.shape)} and num_heads_q={num_heads_q}")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_q + 2 * num_heads_k != qkv.shape[2] or num_heads_k < 1:
        raise ValueError(f"apply_rotary_emb_qkv_: {qkv.shape[2]} heads are not num_heads_q={num_heads_q} plus twice "
                         "a number of k / v heads")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]


def _rotate_qk_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, conjugate):
    q, k = _qk_views(qkv, num_heads_q)
    apply_rotary(q, cos, sin, seqlen_offsets, interleaved=interleaved, inplace=True, conjugate=conjugate)
    apply_rotary(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, seqlen_offsets,
                 interleaved=interleaved, inplace=True, conjugate=conjugate)


class ApplyRotaryEmbQKV_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets: Offsets = 0,
                num_heads_q=None):
        _rotate_qk_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, conjugate=False)
        offsets, offset = _split_offsets(seqlen_offsets)
        ctx.save_for_backward(cos, sin, cos_k, sin_k, offsets)
        ctx.options = (offset, interleaved, num_heads_q)
        ctx.mark_dirty(qkv)
        return qkv

    @staticmethod
    def backward(ctx, dqkv):
        cos, sin, cos_k, sin_k, offsets = ctx.saved_tensors
        offset, interleaved, num_heads_q = ctx.options
        dqkv = dqkv.clone()
        _rotate_qk_(dqkv, cos, sin, cos_k, sin_k, interleaved, offset if offsets is None else offsets, num_heads_q,
                    conjugate=True)
        return dqkv, None, None, None, None, None, None, None


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets: Offsets = 0,
                          num_heads_q=None):
    """Rotates q and k of a packed qkv in place (cos_k / sin_k for k when given, e.g. XPos); returns qkv."""
    return ApplyRotaryEmbQKV_.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)


class ApplyRotaryEmbKV_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved=False, seqlen_offsets: Offsets = 0):
        if kv.dim() != 5 or kv.shape[2] != 2:
            raise ValueError(f"apply_rotary_emb_kv_: kv must be (batch, seqlen, 2, nheads, headdim); got "
                             f"{tuple(kv.shape)}")
        apply_rotary(kv[:, :, 0], cos, sin, seqlen_offsets, interleaved=interleaved, inplace=True)
        offsets, offset = _split_offsets(seqlen_offsets)
        ctx.save_for_backward(cos, sin, offsets)
        ctx.options = (offset, interleaved)
        ctx.mark_dirty(kv)
        return kv

    @staticmethod
    def backward(ctx, dkv):
        cos, sin, offsets = ctx.saved_tensors
        offset, interleaved = ctx.options
        dkv = dkv.clone()
        apply_rotary(dkv[:, :, 0], cos, sin, offset if offsets is None else offsets, interleaved=interleaved,
                     inplace=True, conjugate=True)
        return dkv, None, None, None, None


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets: Offsets = 0):
    """Rotates k of a packed kv (batch, seqlen, 2, nheads, headdim) in place; returns kv."""
    return ApplyRotaryEmbKV_.apply(kv, cos, sin, interleaved, seqlen_offsets)


def rotate_half(x, interleaved=False):
    """(-x2, x1) for GPT-NeoX halves, or per GPT-J pair: the 90-degree rotation of the plain-PyTorch formula."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """The plain-PyTorch rotary embedding (a reference): x (batch, seqlen, nheads, headdim), cos / sin (seqlen,
    rotary_dim / 2) or (batch, seqlen, rotary_dim / 2)."""
    rotary_dim = cos.shape[-1] * 2
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotated = x[..., :rotary_dim] * cos + rotate_half(x[..., :rotary_dim], interleaved) * sin
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embeddings (RoFormer), with XPos scaling when scale_base is given. forward(qkv, kv=None,
    seqlen_offset=0, max_seqlen=None, num_heads_q=None) rotates a packed qkv (or q and a packed kv) in place and
    returns it (or (q, kv)). The cos / sin tables are computed in float32 and cached up to the longest length seen;
    with a tensor seqlen_offset pass max_seqlen so the tables cover every position."""

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, device=None):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        self.register_buffer("scale", self._xpos_scale(device) if scale_base is not None else None, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _inv_freq(self, device=None):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _xpos_scale(self, device=None):
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        stale = (seqlen > self._seq_len_cached or self._cos_cached is None or self._cos_cached.device != device
                 or self._cos_cached.dtype != dtype or (self.training and self._cos_cached.is_inference()))
        if not stale:
            return
        self._seq_len_cached = seqlen
        # float32 throughout: positions and inv_freq are large / fine-grained, and a bf16 product would lose the angle.
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._inv_freq(device)
        positions = torch.arange(seqlen, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(device))
        if self.scale is None:
            self._cos_cached, self._sin_cached = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
            return
        scale = self.scale if self.scale.dtype == torch.float32 else self._xpos_scale(device)
        power = (positions - seqlen // 2) / self.scale_base
        factor = scale.to(device) ** power.unsqueeze(-1)
        self._cos_cached, self._sin_cached = (torch.cos(freqs) * factor).to(dtype), (torch.sin(freqs) * factor).to(dtype)
        self._cos_k_cached = (torch.cos(freqs) / factor).to(dtype)
        self._sin_k_cached = (torch.sin(freqs) / factor).to(dtype)

    def forward(self, qkv, kv=None, seqlen_offset: Offsets = 0, max_seqlen: Optional[int] = None,
                num_heads_q: Optional[int] = None):
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        xpos = self.scale is not None
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached,
                                         self._cos_k_cached if xpos else None, self._sin_k_cached if xpos else None,
                                         interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                                         num_heads_q=num_heads_q)
        q = apply_rotary_emb_func(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved, inplace=True,
                                  seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, self._cos_k_cached if xpos else self._cos_cached,
                                  self._sin_k_cached if xpos else self._sin_cached, interleaved=self.interleaved,
                                  seqlen_offsets=seqlen_offset)
        return q, kv
