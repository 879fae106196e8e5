"""Dao-AILab's compiled extension interface (flash_attn_2_cuda, imported in its flash_attn_interface as flash_attn_gpu,
earlier flash_attn_cuda): fwd, varlen_fwd, bwd, varlen_bwd and fwd_kvcache with that extension's positional
signatures and results, on this package's ops (CPU and CUDA). Scripts call it directly, and some clients (Unsloth)
import it to decide whether flash_attn is usable. Differences: gen_ (a torch.Generator) is not used (dropout draws its
seed from torch's default generator, as every entry point here does), and seqused_k / leftpad_k of varlen_fwd raise
NotImplementedError as in _flash_attn_varlen_forward."""

from __future__ import annotations

import torch

from .kvcache import flash_attn_with_kvcache


def _into(out_, result):
    """Dao writes into a given out_ and returns it; otherwise the result itself."""
    if out_ is None:
        return result
    out_.copy_(result)
    return out_


def fwd(q, k, v, out_, alibi_slopes_, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right,
        softcap, return_softmax, gen_=None):
    """-> [out, softmax_lse (batch, nheads, seqlen_q), p (probabilities if return_softmax), rng_state]."""
    out, lse, p, rng_state = torch.ops.flash_attn._flash_attn_forward(
        q, k, v, float(p_dropout), float(softmax_scale), bool(is_causal), int(window_size_left),
        int(window_size_right), float(softcap), alibi_slopes_, bool(return_softmax))
    return [_into(out_, out), lse, p, rng_state]


def varlen_fwd(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k_, block_table_, alibi_slopes_,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, return_softmax, gen_=None):
    """-> [out, softmax_lse (nheads, total_q), p, rng_state]; zero_tensors zeroes the rows of out past the last
    sequence (Dao's kernels leave them as they were otherwise)."""
    out, lse, p, rng_state = torch.ops.flash_attn._flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), float(p_dropout),
        float(softmax_scale), bool(is_causal), int(window_size_left), int(window_size_right), float(softcap),
        alibi_slopes_, bool(return_softmax), block_table_, leftpad_k_, seqused_k)
    if zero_tensors:
        out[int(cu_seqlens_q[-1]):].zero_()
    return [_into(out_, out), lse, p, rng_state]


def _grad_buffers(q, k, v, dq_, dk_, dv_):
    return (torch.empty_like(q) if dq_ is None else dq_, torch.empty_like(k) if dk_ is None else dk_,
            torch.empty_like(v) if dv_ is None else dv_)


def bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, alibi_slopes_, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, deterministic, gen_=None, rng_state=None):
    """-> [dq, dk, dv, softmax_d]: the gradients written into dq_ / dk_ / dv_ where given."""
    dq, dk, dv = _grad_buffers(q, k, v, dq_, dk_, dv_)
    softmax_d = torch.ops.flash_attn._flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, float(p_dropout), float(softmax_scale), bool(is_causal),
        int(window_size_left), int(window_size_right), float(softcap), alibi_slopes_, bool(deterministic), rng_state)
    return [dq, dk, dv, softmax_d]


def varlen_bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k, alibi_slopes_,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, deterministic, gen_=None, rng_state=None):
    """-> [dq, dk, dv, softmax_d] of a varlen call; zero_tensors zeroes the gradient rows past the last sequence."""
    dq, dk, dv = _grad_buffers(q, k, v, dq_, dk_, dv_)
    softmax_d = torch.ops.flash_attn._flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
        int(max_seqlen_k), float(p_dropout), float(softmax_scale), bool(is_causal), int(window_size_left),
        int(window_size_right), float(softcap), alibi_slopes_, bool(deterministic), rng_state)
    if zero_tensors:
        dq[int(cu_seqlens_q[-1]):].zero_()
        dk[int(cu_seqlens_k[-1]):].zero_()
        dv[int(cu_seqlens_k[-1]):].zero_()
    return [dq, dk, dv, softmax_d]


def fwd_kvcache(q, kcache, vcache, k_, v_, seqlens_k_, rotary_cos_, rotary_sin_, cache_batch_idx_, leftpad_k_,
                block_table_, alibi_slopes_, out_, softmax_scale, is_causal, window_size_left, window_size_right,
                softcap, is_rotary_interleaved, num_splits):
    """-> [out, softmax_lse]: flash_attn_with_kvcache (new k_ / v_ appended to the caches in place)."""
    out, lse = flash_attn_with_kvcache(
        q, kcache, vcache, k_, v_, rotary_cos=rotary_cos_, rotary_sin=rotary_sin_, cache_seqlens=seqlens_k_,
        cache_batch_idx=cache_batch_idx_, cache_leftpad=leftpad_k_, block_table=block_table_,
        softmax_scale=float(softmax_scale), causal=bool(is_causal),
        window_size=(int(window_size_left), int(window_size_right)), softcap=float(softcap),
        rotary_interleaved=bool(is_rotary_interleaved), alibi_slopes=alibi_slopes_, num_splits=int(num_splits),
        return_softmax_lse=True)
    return [_into(out_, out), lse]

