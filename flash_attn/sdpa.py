"""flash_attn.scaled_dot_product_attention: torch.nn.functional.scaled_dot_product_attention's signature and
semantics (layout (batch, nheads, seqlen, headdim), top-left is_causal, boolean or additive attn_mask,
enable_gqa, a value head dim other than the query's) on flash_attn's kernels. Rows that the mask leaves empty give 0
instead of NaN."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .interface import UNBOUNDED, attention

_NAME = "flash_attn.scaled_dot_product_attention"
MAX_HEAD_DIM = 256  # the kernels' largest head dim (the ops reject larger ones)


def _padded_to(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """t with zero columns appended up to head_dim (differentiable: the gradient of the real columns passes)."""
    return t if t.shape[-1] == head_dim else F.pad(t, (0, head_dim - t.shape[-1]))


def _to_additive(attn_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    if attn_mask.dtype not in (dtype, torch.float32):
        raise TypeError(f"{_NAME}: attn_mask must be bool, float32 or the query's dtype ({dtype}); got "
                        f"{attn_mask.dtype}")
    return attn_mask


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Same arguments and result as torch.nn.functional.scaled_dot_product_attention for query and key (B, Hq / Hk,
    L / S, E), value (B, Hk, S, Ev); 3-D inputs (B, L, E) are taken as one head. Ev != E (e.g. multi-head latent
    attention's 192 / 128) runs the kernels at head dim max(E, Ev) on zero-padded copies (zero columns change no
    score, and the output's extra columns are dropped), so it costs the padded call's time; max(E, Ev) <= 256."""
    if query.dim() != key.dim() or query.dim() != value.dim() or query.dim() not in (3, 4):
        raise ValueError(f"{_NAME}: query, key, value must all be 4-D (batch, nheads, seqlen, headdim) or all 3-D "
                         f"(batch, seqlen, headdim); got shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    if query.dim() == 3:
        out = scaled_dot_product_attention(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1),
                                           attn_mask if attn_mask is None or attn_mask.dim() < 3
                                           else attn_mask.unsqueeze(1),
                                           dropout_p, is_causal, scale, enable_gqa)
        return out.squeeze(1)
    if attn_mask is not None and is_causal:
        raise RuntimeError(f"{_NAME}: attn_mask must not be set when is_causal=True (as in torch); fold the causal "
                           "mask into attn_mask instead")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"{_NAME}: query and key must have the same head dim (last dim); got {query.shape[-1]} "
                         f"and {key.shape[-1]}")
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    if value_dim != head_dim:
        padded = max(head_dim, value_dim)
        if padded > MAX_HEAD_DIM:
            raise ValueError(f"{_NAME}: a value head dim ({value_dim}) other than the query's ({head_dim}) runs at "
                             f"head dim max(E, Ev) = {padded}, which must be at most {MAX_HEAD_DIM}")
        scale = head_dim**-0.5 if scale is None else scale  # torch's default: the query's head dim
        out = scaled_dot_product_attention(_padded_to(query, padded), _padded_to(key, padded),
                                           _padded_to(value, padded), attn_mask, dropout_p, is_causal, scale,
                                           enable_gqa)
        return out[..., :value_dim]
    batch, nheads_q, seqlen_q = query.shape[0], query.shape[1], query.shape[2]
    nheads_k, seqlen_k = key.shape[1], key.shape[2]
    if nheads_q != nheads_k and not enable_gqa:
        raise ValueError(f"{_NAME}: query has {nheads_q} heads and key/value have {nheads_k}; pass enable_gqa=True "
                         "for grouped-query attention")
    bias = None
    if attn_mask is not None:
        full = (batch, nheads_q, seqlen_q, seqlen_k)
        try:
            bias = _to_additive(attn_mask, query.dtype).expand(full)
        except RuntimeError as error:
            raise ValueError(f"{_NAME}: attn_mask of shape {tuple(attn_mask.shape)} is not broadcastable to "
                             f"(batch, nheads, L, S) = {full}") from error
    window = (UNBOUNDED, 0) if is_causal else (UNBOUNDED, UNBOUNDED)
    out, _, _ = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=dropout_p,
                          softmax_scale=scale, window=window, bottom_right=False, attn_bias=bias)
    return out.transpose(1, 2)
