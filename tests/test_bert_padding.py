# Tests of flash_attn.bert_padding: unpad_input (with and without unused_mask), pad_input and
# index_first_axis (values and autograd), and an end-to-end padded batch -> varlen attention -> padded
# output round trip checked against the per-sequence reference.
import pytest
import torch

from flash_attn import flash_attn_varlen_func
from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
from flash_attn.reference import attention_ref
from helpers import assert_close_fa, randn, require_supported


def _padding_mask(lengths, seqlen, device):
    return torch.arange(seqlen, device=device).view(1, -1) < torch.tensor(lengths, device=device).view(-1, 1)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.int64])
def test_unpad_input(mask_dtype, device):
    lengths, seqlen = [5, 0, 9, 3], 9
    hidden = randn(4, seqlen, 3, 6, device=device)
    mask = _padding_mask(lengths, seqlen, device).to(mask_dtype)
    unpadded, indices, cu_seqlens, max_seqlen, seqused = unpad_input(hidden, mask)
    flat_mask = mask.bool().flatten()
    assert torch.equal(unpadded, hidden.flatten(0, 1)[flat_mask])
    assert torch.equal(indices.long(), flat_mask.nonzero().flatten())
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 5, 5, 14, 17]
    assert isinstance(max_seqlen, int) and max_seqlen == 9
    assert seqused.dtype == torch.int32 and seqused.tolist() == lengths


def test_unpad_input_noncontiguous_mask_positions(device):
    mask = torch.tensor([[1, 0, 1, 1], [0, 1, 0, 0]], device=device, dtype=torch.bool)
    hidden = randn(2, 4, 5, device=device)
    unpadded, indices, cu_seqlens, max_seqlen, seqused = unpad_input(hidden, mask)
    assert indices.tolist() == [0, 2, 3, 5]
    assert torch.equal(unpadded, hidden.flatten(0, 1)[[0, 2, 3, 5]])
    assert cu_seqlens.tolist() == [0, 3, 4] and max_seqlen == 3 and seqused.tolist() == [3, 1]


def test_unpad_input_with_unused_mask(device):
    used, unused_extra, seqlen = [3, 1, 4], [2, 0, 1], 6
    attention_mask = _padding_mask(used, seqlen, device)
    all_mask = _padding_mask([u + e for u, e in zip(used, unused_extra)], seqlen, device)
    unused_mask = all_mask & ~attention_mask
    hidden = randn(3, seqlen, 4, device=device)
    unpadded, indices, cu_seqlens, max_seqlen, seqused = unpad_input(hidden, attention_mask, unused_mask)
    assert torch.equal(unpadded, hidden.flatten(0, 1)[all_mask.flatten()])
    assert torch.equal(indices.long(), all_mask.flatten().nonzero().flatten())
    assert cu_seqlens.tolist() == [0, 5, 6, 11]
    assert max_seqlen == 5
    assert seqused.tolist() == used


def test_pad_input_round_trip(device):
    lengths, seqlen = [2, 7, 0], 7
    hidden = randn(3, seqlen, 2, 3, device=device)
    mask = _padding_mask(lengths, seqlen, device)
    unpadded, indices, _, _, _ = unpad_input(hidden, mask)
    padded = pad_input(unpadded, indices, 3, seqlen)
    assert padded.shape == hidden.shape
    expected = hidden * mask.view(3, seqlen, 1, 1)
    assert torch.equal(padded, expected)


def test_index_first_axis_values_and_grad(device):
    x = randn(10, 3, 4, dtype=torch.float64, device=device, requires_grad=True)
    indices = torch.tensor([7, 0, 3, 9], device=device)
    y = index_first_axis(x, indices)
    assert torch.equal(y, x.detach()[indices])
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, indices), (x,))
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    expected = torch.zeros_like(x)
    expected[indices] = dy
    assert torch.equal(dx, expected)


def test_pad_input_grad(device):
    x = randn(4, 3, dtype=torch.float64, device=device, requires_grad=True)
    indices = torch.tensor([1, 2, 4, 5], device=device)
    assert torch.autograd.gradcheck(lambda t: pad_input(t, indices, 2, 3), (x,))


def test_padded_batch_through_varlen(device):
    dtype, h, d, seqlen = torch.float32, 2, 16, 12
    require_supported(device, dtype, d)
    lengths = [12, 4, 9]
    mask = _padding_mask(lengths, seqlen, device)
    q, k, v = (randn(3, seqlen, h, d, device=device) for _ in range(3))
    q_u, indices, cu, max_s, _ = unpad_input(q, mask)
    k_u = index_first_axis(k.flatten(0, 1), indices)
    v_u = index_first_axis(v.flatten(0, 1), indices)
    out_u = flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s, causal=True)
    out = pad_input(out_u, indices, 3, seqlen)
    for b, n in enumerate(lengths):
        sl = slice(0, n)
        ref = attention_ref(q[b:b + 1, sl], k[b:b + 1, sl], v[b:b + 1, sl], causal=True, compute_dtype=torch.float64)[0]
        naive = attention_ref(q[b:b + 1, sl], k[b:b + 1, sl], v[b:b + 1, sl], causal=True, compute_dtype=dtype)[0]
        assert_close_fa(out[b:b + 1, sl], ref, naive, 2)
        assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:]))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_helpers_accept_int32_and_int64_indices(index_dtype, device):
    """Hugging Face transformers hands int32 indices (cu_seqlens slices) to pad_input; Dao-AILab's helpers take
    both dtypes, forward and backward."""
    batch, seqlen = 3, 5
    hidden = randn(batch * seqlen, 4, 2, device=device, requires_grad=True)
    indices = torch.tensor([0, 2, 3, 7, 11, 14], device=device, dtype=index_dtype)
    gathered = index_first_axis(hidden, indices)
    assert torch.equal(gathered, hidden.detach()[indices.long()])
    (grad,) = torch.autograd.grad(gathered, hidden, torch.ones_like(gathered))
    expected = torch.zeros_like(hidden)
    expected[indices.long()] = 1
    assert torch.equal(grad, expected)
    values = randn(len(indices), 4, 2, device=device, requires_grad=True)
    padded = pad_input(values, indices, batch, seqlen)
    assert padded.shape == (batch, seqlen, 4, 2)
    flat = padded.detach().flatten(0, 1)
    assert torch.equal(flat[indices.long()], values.detach())
    kept = torch.zeros(batch * seqlen, dtype=torch.bool, device=device)
    kept[indices.long()] = True
    assert flat[~kept].abs().max() == 0
    (grad,) = torch.autograd.grad(padded, values, torch.ones_like(padded))
    assert torch.equal(grad, torch.ones_like(values))
