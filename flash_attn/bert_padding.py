"""Padding helpers between a padded batch (batch, seqlen, ...) and the packed varlen layout (total, ...),
with the names and results of Dao-AILab flash_attn.bert_padding that Hugging Face transformers uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _long(indices: torch.Tensor) -> torch.Tensor:
    """Indices as int64: index_copy_ takes no other dtype, and callers pass int32 too (Hugging Face transformers
    hands cu_seqlens slices to pad_input), as Dao-AILab's helpers accept."""
    return indices if indices.dtype == torch.int64 else indices.long()


class IndexFirstAxis(torch.autograd.Function):
    """x[indices] along the first axis, with a backward that scatters into zeros."""

    @staticmethod
    def forward(ctx, x, indices):
        indices = _long(indices)
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = x.shape[0]
        return torch.index_select(x, 0, indices)

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        grad = grad_output.new_zeros((ctx.first_axis_dim, *grad_output.shape[1:]))
        grad.index_copy_(0, indices, grad_output)
        return grad, None


class IndexPutFirstAxis(torch.autograd.Function):
    """A zero tensor of first-axis size first_axis_dim with `values` written at `indices`."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        indices = _long(indices)
        ctx.save_for_backward(indices)
        out = values.new_zeros((first_axis_dim, *values.shape[1:]))
        out.index_copy_(0, indices, values)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return torch.index_select(grad_output, 0, indices), None, None


index_first_axis = IndexFirstAxis.apply
index_put_first_axis = IndexPutFirstAxis.apply


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen) with 1/True for real tokens.
    unused_mask (batch, seqlen), optional: tokens that are kept in the packed output but not counted as used.
    Returns (hidden_states (total, ...), indices (total,), cu_seqlens (batch + 1,) int32, max_seqlen_in_batch,
    seqused (batch,) int32: the used tokens per sequence). As in Dao-AILab's version, max_seqlen_in_batch is a
    Python int and the packed size depends on the mask, so on CUDA this synchronises with the host (keep it
    outside a captured CUDA graph)."""
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    """Inverse of unpad_input: hidden_states (total, ...) back to (batch, seqlen, ...), zeros at padding."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
