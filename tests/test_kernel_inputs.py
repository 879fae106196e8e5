# The CUDA kernel input contract's per-tensor decision (csrc/api/kernel_inputs.cpp), checked on CPU tensors
# through the extension's kernel_input_action: head dims not a multiple of 8 are padded, tensors with a
# batch/row/head stride not a multiple of 8 or a base address not 16-byte aligned are copied, everything
# else (contiguous tensors, slices of packed qkv / kv, transposed (B, H, S, D) views) is used as it is.
import pytest
import torch

from flash_attn._native import C as _C

DT = torch.bfloat16


def _action(t):
    return _C.kernel_input_action(t)


@pytest.mark.parametrize("head_dim", [8, 64, 128, 200, 256])
def test_contiguous_multiple_of_8_is_used(head_dim):
    assert _action(torch.empty(2, 17, 3, head_dim, dtype=DT)) == "use"
    assert _action(torch.empty(41, 3, head_dim, dtype=DT)) == "use"  # varlen layout


@pytest.mark.parametrize("head_dim", [1, 7, 33, 39, 76, 255])
def test_other_head_dims_are_padded(head_dim):
    assert _action(torch.empty(2, 17, 3, head_dim, dtype=DT)) == "pad"


def test_packed_slices_go_through_without_copy():
    qkv = torch.empty(2, 33, 3, 4, 64, dtype=DT)
    for t in qkv.unbind(2):
        assert _action(t) == "use"
    kv = torch.empty(50, 2, 2, 64, dtype=DT)  # varlen kvpacked (total, 2, nheads_k, headdim)
    for t in kv.unbind(1):
        assert _action(t) == "use"


def test_transposed_bhsd_view_is_used():
    assert _action(torch.empty(2, 4, 45, 64, dtype=DT).transpose(1, 2)) == "use"


def test_head_slice_with_stride_multiple_of_8_is_used():
    wide = torch.empty(2, 45, 8, 64, dtype=DT)
    assert _action(wide[:, :, ::2]) == "use"
    assert _action(wide[:, :, 1::4]) == "use"  # offset 64 elements = 128 bytes: still aligned


def test_row_stride_not_multiple_of_8_is_copied():
    storage = torch.empty(20000, dtype=DT)
    assert _action(storage.as_strided((2, 5, 2, 64), (5 * 132, 132, 64, 1))) == "copy"
    assert _action(storage.as_strided((2, 5, 2, 64), (1000 * 4 + 3, 256, 64, 1))) == "copy"
    assert _action(storage.as_strided((7, 2, 64), (132, 64, 1))) == "copy"


def test_misaligned_base_pointer_is_copied():
    storage = torch.empty(2 * 17 * 3 * 64 + 8, dtype=DT)
    shifted = storage[1:1 + 2 * 17 * 3 * 64].view(2, 17, 3, 64)  # 2 bytes past an aligned start
    assert shifted.is_contiguous()
    assert _action(shifted) == "copy"
    aligned = storage[8:8 + 2 * 17 * 3 * 64].view(2, 17, 3, 64)  # 16 bytes past: aligned again
    assert _action(aligned) == "use"
