"""The flash_attn 2.x entry points (flash_attn_func and its packed / varlen variants), with Dao-AILab's
names, argument names, defaults and semantics. Each turns its arguments into one call of the
torch.ops.flash_attn.fwd op, whose autograd (flash_attn/ops.py) runs the recomputing backward."""

from __future__ import annotations

from typing import Sequence

import torch

from . import ops
from .ops import new_rng_state
from .paged_kv import paged_keys_values

UNBOUNDED = -1


def _window(window_size: Sequence[int], causal: bool) -> tuple[int, int]:
    """Dao's rule: causal is a window whose right side is 0; -1 means unbounded."""
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right); got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < UNBOUNDED or right < UNBOUNDED:
        raise ValueError(f"window_size entries must be >= -1 (-1 means unbounded); got {tuple(window_size)!r}")
    return left, 0 if causal else right


def _check_dropout(dropout_p: float) -> float:
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    return dropout_p


def _max_seqlen(value) -> int:
    """max_seqlen as a Python int. A tensor (Hugging Face passes cu_seqlens.diff().max() on some paths) is
    read on the host, which synchronises with a CUDA stream: pass an int where that matters (CUDA graphs)."""
    return int(value.item()) if torch.is_tensor(value) else value


def attention(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, dropout_p=0.0,
              softmax_scale=None, window=(UNBOUNDED, UNBOUNDED), bottom_right=True, softcap=0.0,
              alibi_slopes=None, attn_bias=None, deterministic=False, return_attn_probs=False, seqused_k=None,
              num_splits=0, block_table=None):
    """The one call every public entry point makes: returns (out, softmax_lse, probs). seqused_k (int32
    (batch,), dense calls, forward only): sequence b uses only its first seqused_k[b] keys. num_splits: key splits of
    the CUDA forward (0: flash_attn's choice). block_table (int32 (batch, pages), with seqused_k): k / v are page
    pools (num_pages, page_size, nheads_k, headdim) and sequence b's key r is row r % page_size of page
    block_table[b, r // page_size]."""
    dropout_p = _check_dropout(dropout_p)
    if softmax_scale is None:
        # An empty head dim is rejected by the op with a message naming it; keep the default finite here.
        softmax_scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0
    rng_state = new_rng_state(dropout_p, q.device)
    return ops.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, _max_seqlen(max_seqlen_q), _max_seqlen(max_seqlen_k),
                  dropout_p, float(softmax_scale), window[0], window[1], bottom_right, float(softcap), alibi_slopes,
                  attn_bias, rng_state, return_attn_probs, deterministic, seqused_k, int(num_splits), block_table)


def _result(out, lse, probs, return_attn_probs):
    return (out, lse, probs) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Exact attention over q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim).

    nheads % nheads_k == 0 (MQA/GQA). causal and window_size are aligned to the bottom-right corner of the
    score matrix when seqlen_q != seqlen_k; softcap > 0 applies softcap * tanh(scores / softcap);
    alibi_slopes (nheads,) or (batch, nheads), float32, adds -slope * |i + seqlen_k - seqlen_q - j|.
    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse (batch, nheads, seqlen_q) float32,
    S_dmask (batch, nheads, seqlen_q, seqlen_k): probabilities, negated where dropout dropped) when
    return_attn_probs=True."""
    out, lse, probs = attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                                window=_window(window_size, causal), softcap=softcap, alibi_slopes=alibi_slopes,
                                deterministic=deterministic, return_attn_probs=return_attn_probs)
    return _result(out, lse, probs, return_attn_probs)


def _unpack(packed: torch.Tensor, name: str, count: int, dim: int) -> tuple[torch.Tensor, ...]:
    if packed.dim() <= dim or packed.shape[dim] != count:
        raise ValueError(f"{name} must have size {count} in dimension {dim} (packed layout); got shape "
                         f"{tuple(packed.shape)}")
    return packed.unbind(dim)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func with qkv packed as (batch, seqlen, 3, nheads, headdim)."""
    q, k, v = _unpack(qkv, "qkv", 3, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func with kv packed as (batch, seqlen_k, 2, nheads_k, headdim)."""
    k, v = _unpack(kv, "kv", 2, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Attention over a batch of sequences of different lengths, concatenated: q (total_q, nheads, headdim),
    k and v (total_k, nheads_k, headdim); cu_seqlens_* int32 (batch + 1,) prefix sums of the lengths;
    max_seqlen_* the longest length. Masks and ALiBi apply per sequence. softmax_lse is (nheads, total_q).
    cu_seqlens values must start at 0, be non-decreasing, stay within the rows of q / k and have no length above
    max_seqlen_*: checked on CPU, and on CUDA once per tensor version (README, CUDA requirements).
    block_table (batch, max_blocks) int32: k and v are paged caches (num_blocks, page_size, nheads_k, headdim) and
    sequence b's keys are its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows through its pages (chunked prefill
    over a paged cache); gathered into a packed copy for now."""
    if block_table is not None:
        k, v = paged_keys_values("flash_attn_varlen_func", k, v, block_table, cu_seqlens_q.shape[0] - 1, cu_seqlens_k,
                                 _max_seqlen(max_seqlen_k), q.device)
    out, lse, probs = attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                                softmax_scale=softmax_scale, window=_window(window_size, causal), softcap=softcap,
                                alibi_slopes=alibi_slopes, deterministic=deterministic,
                                return_attn_probs=return_attn_probs)
    return _result(out, lse, probs, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func with qkv packed as (total, 3, nheads, headdim)."""
    q, k, v = _unpack(qkv, "qkv", 3, 1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_func with kv packed as (total_k, 2, nheads_k, headdim)."""
    k, v = _unpack(kv, "kv", 2, 1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
