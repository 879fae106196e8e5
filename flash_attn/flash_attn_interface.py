"""flash_attn.flash_attn_interface: the module of that name in Dao-AILab's flash_attn (>= 2.6.3), which scripts and
sequence-parallel engines (yunchang, ring-flash-attn) import: the public entry points, and the four private block
functions with their signatures and results. _flash_attn_forward / _flash_attn_varlen_forward return (out,
softmax_lse, S_dmask, rng_state); _flash_attn_backward / _flash_attn_varlen_backward write dq, dk, dv into the
tensors they are given and return softmax_d = rowsum(dout * out). The backward uses the out and softmax_lse it is
handed (an engine's values merged over every key block), so per-block gradients add up to the exact ones. Each is a
torch.library custom op (flash_attn::_flash_attn_forward, ...) with a fake implementation, on CPU and CUDA, also named
_wrapped_flash_attn_forward, ... as in Dao's module (>= 2.7)."""

from __future__ import annotations

from typing import Optional

import torch

from . import dao_binding as flash_attn_gpu  # Dao's extension module's functions (fwd, varlen_fwd, ...) on our ops
from . import ops
from .interface import (  # noqa: F401  (re-exported: the public functions of Dao's module)
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .kvcache import flash_attn_with_kvcache  # noqa: F401
from .ops import new_rng_state
from .paged_kv import paged_keys_values

__all__ = [
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
    "_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward",
    "_wrapped_flash_attn_forward", "_wrapped_flash_attn_backward", "_wrapped_flash_attn_varlen_forward",
    "_wrapped_flash_attn_varlen_backward",
]

# Dao's softmax_d rows are padded to a multiple of this (its kernels' row block); varlen adds one block per sequence.
_SOFTMAX_D_ROW_BLOCK = 128
_RNG_STATE_SIZE = 2  # int64 [seed, offset]


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _scale(softmax_scale, q) -> float:
    return float(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)


def _window(causal: bool, left: int, right: int) -> tuple[int, int]:
    """Dao's rule: causal is a window whose right side is 0."""
    return int(left), 0 if causal else int(right)


def _rng_state(dropout_p: float, device: torch.device) -> torch.Tensor:
    """The [seed, offset] a dropout call draws; zeros (unused) without dropout, as Dao's always returns one."""
    state = new_rng_state(dropout_p, device)
    return torch.zeros(_RNG_STATE_SIZE, dtype=torch.int64, device=device) if state is None else state


def _softmax_d(dout: torch.Tensor, out: torch.Tensor, varlen: bool, batch: int) -> torch.Tensor:
    """rowsum(dout * out) in float32, in Dao's layout: (batch, nheads, seqlen_q rounded up to 128) dense,
    (nheads, total_q + 128 * batch) varlen; the padding is 0."""
    d = (dout.float() * out.float()).sum(-1)
    if varlen:
        d = d.transpose(0, 1)
        padded = torch.zeros(d.shape[0], d.shape[1] + _SOFTMAX_D_ROW_BLOCK * batch, dtype=torch.float32,
                             device=d.device)
        padded[:, :d.shape[1]] = d
        return padded
    d = d.transpose(1, 2)
    padded = torch.zeros(*d.shape[:2], _round_up(d.shape[2], _SOFTMAX_D_ROW_BLOCK), dtype=torch.float32,
                         device=d.device)
    padded[..., :d.shape[2]] = d
    return padded


def _write_grads(targets, grads):
    for target, grad in zip(targets, grads):
        if target is not None:
            target.copy_(grad)


@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                alibi_slopes: Optional[torch.Tensor], return_softmax: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    left, right = _window(causal, window_size_left, window_size_right)
    rng_state = _rng_state(dropout_p, q.device)
    out, lse, probs = ops.fwd_op(q, k, v, None, None, 0, 0, dropout_p, softmax_scale, left, right, True, softcap,
                                 alibi_slopes, None, rng_state, return_softmax, False, None)
    return out, lse, probs, rng_state


@_forward_op.register_fake
def _forward_fake(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                  alibi_slopes, return_softmax):
    batch, seqlen_q, nheads, _ = q.shape
    probs_shape = (batch, nheads, seqlen_q, k.shape[1]) if return_softmax else (0,)
    return (q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32),
            q.new_empty(probs_shape), q.new_empty((_RNG_STATE_SIZE,), dtype=torch.int64))


@torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=())
def _varlen_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                       softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
                       softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
                       block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
                       seqused_k: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Dao's op schema (flash_attn >= 2.7): block_table makes k / v paged caches; leftpad_k / seqused_k are refused.
    _refuse_varlen_extras(leftpad_k, seqused_k)
    if block_table is not None:
        k, v = paged_keys_values("_flash_attn_varlen_forward", k, v, block_table, cu_seqlens_q.shape[0] - 1,
                                 cu_seqlens_k, max_seqlen_k, q.device)
    left, right = _window(causal, window_size_left, window_size_right)
    rng_state = _rng_state(dropout_p, q.device)
    out, lse, probs = ops.fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                 softmax_scale, left, right, True, softcap, alibi_slopes, None, rng_state,
                                 return_softmax, False, None)
    return out, lse, probs, rng_state


@_varlen_forward_op.register_fake
def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                         causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None):
    total_q, nheads, _ = q.shape
    probs_shape = (cu_seqlens_q.shape[0] - 1, nheads, max_seqlen_q, max_seqlen_k) if return_softmax else (0,)
    return (q.new_empty(q.shape), q.new_empty((nheads, total_q), dtype=torch.float32), q.new_empty(probs_shape),
            q.new_empty((_RNG_STATE_SIZE,), dtype=torch.int64))


@torch.library.custom_op("flash_attn::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                 dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                 window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                 deterministic: bool, rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    left, right = _window(causal, window_size_left, window_size_right)
    grads = ops.bwd_op(dout, q, k, v, out, softmax_lse, None, None, None, 0, 0, dropout_p, softmax_scale, left, right,
                       True, softcap, alibi_slopes, None, rng_state, deterministic, False)
    _write_grads((dq, dk, dv), grads[:3])
    return _softmax_d(dout, out, varlen=False, batch=q.shape[0])


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
                   window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty((batch, nheads, _round_up(seqlen_q, _SOFTMAX_D_ROW_BLOCK)), dtype=torch.float32)


@torch.library.custom_op("flash_attn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
def _varlen_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                        dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                        max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
                        window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                        rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    left, right = _window(causal, window_size_left, window_size_right)
    grads = ops.bwd_op(dout, q, k, v, out, softmax_lse, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       dropout_p, softmax_scale, left, right, True, softcap, alibi_slopes, None, rng_state,
                       deterministic, False)
    _write_grads((dq, dk, dv), grads[:3])
    return _softmax_d(dout, out, varlen=True, batch=cu_seqlens_q.shape[0] - 1)


@_varlen_backward_op.register_fake
def _varlen_backward_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                          alibi_slopes, deterministic, rng_state=None):
    batch = cu_seqlens_q.shape[0] - 1
    return q.new_empty((q.shape[1], q.shape[0] + _SOFTMAX_D_ROW_BLOCK * batch), dtype=torch.float32)


def _refuse_varlen_extras(leftpad_k, seqused_k):
    for name, value in (("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        if value is not None:
            raise NotImplementedError(f"_flash_attn_varlen_forward: {name} is not supported yet; pass {name}=None "
                                      "(give each sequence's keys through cu_seqlens_k)")


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    """Attention over one block: q (batch, seqlen_q, nheads, headdim), k / v (batch, seqlen_k, nheads_k, headdim).
    Returns (out, softmax_lse (batch, nheads, seqlen_q) float32, S_dmask (empty unless return_softmax),
    rng_state (2,) int64: the dropout [seed, offset] for _flash_attn_backward)."""
    return torch.ops.flash_attn._flash_attn_forward(
        q, k, v, float(dropout_p), _scale(softmax_scale, q), bool(causal), int(window_size_left),
        int(window_size_right), float(softcap or 0.0), alibi_slopes, bool(return_softmax))


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None):
    """The varlen form: q (total_q, nheads, headdim), k / v (total_k, nheads_k, headdim), cu_seqlens int32.
    softmax_lse is (nheads, total_q). With block_table, k and v are paged caches (flash_attn_varlen_func); leftpad_k
    and seqused_k raise NotImplementedError."""
    return torch.ops.flash_attn._flash_attn_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), float(dropout_p),
        _scale(softmax_scale, q), bool(causal), int(window_size_left), int(window_size_right), float(softcap or 0.0),
        alibi_slopes, bool(return_softmax), block_table, leftpad_k, seqused_k)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    """Gradients of one block into dq, dk, dv (each may be None: not written), from the out and softmax_lse given
    (not recomputed). Returns softmax_d = rowsum(dout * out), float32 (batch, nheads, seqlen_q rounded up to 128)."""
    return torch.ops.flash_attn._flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, float(dropout_p), _scale(softmax_scale, q), bool(causal),
        int(window_size_left), int(window_size_right), float(softcap or 0.0), alibi_slopes, bool(deterministic),
        rng_state)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                softcap, alibi_slopes, deterministic, rng_state=None):
    """The varlen form of _flash_attn_backward; softmax_d is (nheads, total_q + 128 * batch)."""
    return torch.ops.flash_attn._flash_attn_varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
        int(max_seqlen_k), float(dropout_p), _scale(softmax_scale, q), bool(causal), int(window_size_left),
        int(window_size_right), float(softcap or 0.0), alibi_slopes, bool(deterministic), rng_state)


# Dao's module (>= 2.7) also names the ops themselves, which engines (e.g. MagiAttention) call directly with a float
# softmax_scale; the same schemas here.
_wrapped_flash_attn_forward = torch.ops.flash_attn._flash_attn_forward
_wrapped_flash_attn_varlen_forward = torch.ops.flash_attn._flash_attn_varlen_forward
_wrapped_flash_attn_backward = torch.ops.flash_attn._flash_attn_backward
_wrapped_flash_attn_varlen_backward = torch.ops.flash_attn._flash_attn_varlen_backward
# Dao's module imported its compiled extension as flash_attn_gpu (>= 2.7.1), before that as flash_attn_cuda.
flash_attn_cuda = flash_attn_gpu
