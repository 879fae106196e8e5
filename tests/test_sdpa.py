# Tests of flash_attn.scaled_dot_product_attention, the drop-in for torch's SDPA (layout (B, H, L, E),
# top-left is_causal): outputs and gradients against torch's math backend in fp64 with bool/float masks
# of broadcast shapes, is_causal, scale, enable_gqa, fully masked rows, float-mask gradients and dropout.
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attn
from flash_attn.reference import attention_ref, dropout_keep_mask
from helpers import (
    DTYPES,
    CaptureRngState,
    assert_no_nan,
    check_output_and_grads,
    evaluate_ref,
    randn,
    reference_pair,
    require_supported,
)

# (batch, nheads, nheads_k, seqlen_q, seqlen_k, headdim)
SDPA_SHAPES = [
    (2, 4, 4, 17, 113, 40),
    (1, 4, 2, 128, 33, 64),
    (2, 2, 2, 1, 255, 128),
    (1, 2, 1, 96, 96, 256),
]

MASK_SHAPES = {
    "full": lambda b, h, lq, lk: (b, h, lq, lk),
    "2d": lambda b, h, lq, lk: (lq, lk),
    "batch": lambda b, h, lq, lk: (b, 1, lq, lk),
    "key_padding": lambda b, h, lq, lk: (b, 1, 1, lk),
    "heads": lambda b, h, lq, lk: (1, h, 1, lk),
}


def sdpa_ref(q, k, v, attn_mask=None, *, is_causal=False, scale=None, dropout_mask=None, dropout_p=0.0,
             compute_dtype=torch.float32):
    """SDPA semantics through attention_ref: (B, H, L, E) layout, top-left causal."""
    out, lse = attention_ref(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        softmax_scale=scale,
        window_size=(-1, 0) if is_causal else (-1, -1),
        bottom_right=False,
        attn_bias=attn_mask,
        dropout_mask=dropout_mask,
        dropout_p=dropout_p,
        compute_dtype=compute_dtype,
    )
    return out.transpose(1, 2), lse


def torch_math(q, k, v, attn_mask=None, *, is_causal=False, scale=None, enable_gqa=False,
               compute_dtype=torch.float64):
    """torch's own SDPA (math backend) as the ground truth."""
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype),
            attn_mask=attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.to(compute_dtype),
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        )
    return out, None


def _inputs(shape, dtype, device, requires_grad=True):
    batch, h, hk, lq, lk, e = shape
    require_supported(device, dtype, e)
    q = randn(batch, h, lq, e, dtype=dtype, device=device, requires_grad=requires_grad)
    k = randn(batch, hk, lk, e, dtype=dtype, device=device, requires_grad=requires_grad)
    v = randn(batch, hk, lk, e, dtype=dtype, device=device, requires_grad=requires_grad)
    return q, k, v


def _bool_mask(shape, device):
    """Random boolean mask (True = attend) whose every row keeps at least key 0."""
    mask = torch.rand(shape, device=device) < 0.7
    mask[..., 0] = True
    return mask


def _check_against_torch(q, k, v, attn_mask, dtype, **kwargs):
    out_shape = (*q.shape[:-1], v.shape[-1])
    dout = torch.randn(out_shape, dtype=q.dtype, device=q.device)
    out = flash_attn.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)
    assert out.shape == out_shape and out.dtype == dtype
    inputs = (q, k, v)
    grads = torch.autograd.grad(out, inputs, dout)
    assert_no_nan(out, *grads)
    truth = evaluate_ref(functools.partial(torch_math, attn_mask=attn_mask, **kwargs), inputs, dout, torch.float64)
    ref_kwargs = {key: val for key, val in kwargs.items() if key != "enable_gqa"}
    naive = evaluate_ref(functools.partial(sdpa_ref, attn_mask=attn_mask, **ref_kwargs), inputs, dout, dtype)
    check_output_and_grads(out, grads, truth, naive)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SDPA_SHAPES)
def test_sdpa_no_mask(shape, is_causal, dtype, device):
    q, k, v = _inputs(shape, dtype, device)
    _check_against_torch(q, k, v, None, dtype, is_causal=is_causal, enable_gqa=shape[1] != shape[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("mask_shape", list(MASK_SHAPES))
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_sdpa_masks(mask_kind, mask_shape, dtype, device):
    shape = (2, 4, 2, 33, 57, 32)
    q, k, v = _inputs(shape, dtype, device)
    mshape = MASK_SHAPES[mask_shape](shape[0], shape[1], shape[3], shape[4])
    if mask_kind == "bool":
        mask = _bool_mask(mshape, device)
    else:
        mask = randn(*mshape, dtype=dtype, device=device)
    _check_against_torch(q, k, v, mask, dtype, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_sdpa_scale(scale, dtype, device):
    q, k, v = _inputs((2, 2, 2, 40, 30, 16), dtype, device)
    _check_against_torch(q, k, v, None, dtype, scale=scale, is_causal=True)


@pytest.mark.parametrize("nheads_k", [4, 2, 1])
def test_sdpa_enable_gqa(nheads_k, device):
    q, k, v = _inputs((2, 4, nheads_k, 25, 31, 24), torch.float32, device)
    _check_against_torch(q, k, v, None, torch.float32, enable_gqa=True, is_causal=True)


# A value head dim other than the query's (multi-head latent attention: 192 / 128), both ways round, with masks, GQA and
# gradients; the kernels run at the larger head dim on zero-padded copies.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dims", [(192, 128), (48, 32), (32, 80), (24, 8)])
@pytest.mark.parametrize("case", ["causal", "mask", "gqa_scale"])
def test_sdpa_value_head_dim(case, dims, dtype, device):
    head_dim, value_dim = dims
    require_supported(device, dtype, max(dims))
    q = randn(2, 4, 19, head_dim, dtype=dtype, device=device, requires_grad=True)
    k = randn(2, 2 if case == "gqa_scale" else 4, 23, head_dim, dtype=dtype, device=device, requires_grad=True)
    v = randn(*k.shape[:-1], value_dim, dtype=dtype, device=device, requires_grad=True)
    mask = _bool_mask((2, 1, 19, 23), device) if case == "mask" else None
    kwargs = {"is_causal": case == "causal"}
    if case == "gqa_scale":
        kwargs.update(enable_gqa=True, scale=0.3)
    _check_against_torch(q, k, v, mask, dtype, **kwargs)


def test_sdpa_value_head_dim_limit():
    q = torch.randn(1, 1, 4, 64)
    with pytest.raises(ValueError, match="max"):
        flash_attn.scaled_dot_product_attention(q, q, torch.randn(1, 1, 4, 264))
    with pytest.raises(ValueError, match="key"):
        flash_attn.scaled_dot_product_attention(q, torch.randn(1, 1, 4, 32), q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sdpa_noncontiguous_views(dtype, device):
    require_supported(device, dtype, 32)
    qkv = randn(2, 41, 3, 4, 32, dtype=dtype, device=device, requires_grad=True)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    out = flash_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    out_contig = flash_attn.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True)
    torch.testing.assert_close(out, out_contig)
    _check_against_torch(q, k, v, None, dtype, is_causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_sdpa_fully_masked_rows(mask_kind, dtype, device):
    shape = (2, 2, 2, 20, 15, 16)
    q, k, v = _inputs(shape, dtype, device)
    keep = _bool_mask((2, 1, 20, 15), device)
    keep[:, :, 3] = False
    keep[1, :, 11:] = False
    mask = keep if mask_kind == "bool" else torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(
        ~keep, float("-inf")
    )
    dout = torch.randn_like(q)
    out = flash_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_no_nan(out, *grads)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    assert torch.equal(out[1, :, 11:], torch.zeros_like(out[1, :, 11:]))
    assert torch.equal(grads[0][:, :, 3], torch.zeros_like(grads[0][:, :, 3]))
    truth, naive = reference_pair(functools.partial(sdpa_ref, attn_mask=mask), (q, k, v), dout)
    check_output_and_grads(out, grads, truth, naive)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("mask_shape", ["full", "2d", "batch", "key_padding"])
def test_sdpa_float_mask_gradient(mask_shape, dtype, device):
    shape = (2, 2, 2, 19, 27, 16)
    q, k, v = _inputs(shape, dtype, device)
    mshape = MASK_SHAPES[mask_shape](shape[0], shape[1], shape[3], shape[4])
    mask = randn(*mshape, dtype=dtype, device=device, requires_grad=True)
    dout = torch.randn_like(q)
    out = flash_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
    grads = torch.autograd.grad(out, (q, k, v, mask), dout)
    assert grads[3].shape == mask.shape and grads[3].dtype == mask.dtype
    assert_no_nan(out, *grads)
    truth, naive = reference_pair(sdpa_ref, (q, k, v, mask), dout)
    check_output_and_grads(out, grads, truth, naive)


def test_sdpa_float_mask_without_grad_gives_none(device):
    q, k, v = _inputs((1, 2, 2, 9, 9, 8), torch.float32, device)
    mask = randn(9, 9, device=device)
    out = flash_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.sum().backward()
    assert mask.grad is None
    assert q.grad is not None and k.grad is not None and v.grad is not None


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_dropout_matches_philox_reference(is_causal, device):
    batch, h, lq, lk, e, p = 2, 4, 23, 37, 16, 0.3
    q, k, v = _inputs((batch, h, h, lq, lk, e), torch.float32, device)
    dout = torch.randn_like(q)
    with CaptureRngState() as capture:
        out = flash_attn.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal)
    rng_state = capture.last()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = dropout_keep_mask(rng_state, batch, h, lq, lk, p).to(device)
    ref_fn = functools.partial(sdpa_ref, is_causal=is_causal, dropout_mask=keep, dropout_p=p)
    truth, naive = reference_pair(ref_fn, (q, k, v), dout)
    check_output_and_grads(out, grads, truth, naive)


def test_sdpa_dropout_reproducible(device):
    q, k, v = _inputs((1, 2, 2, 30, 30, 16), torch.float32, device, requires_grad=False)
    torch.manual_seed(11)
    a = flash_attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(11)
    b = flash_attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    c = flash_attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_sdpa_signature_matches_torch():
    import inspect

    ours = inspect.signature(flash_attn.scaled_dot_product_attention)
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    assert list(ours.parameters)[: len(names)] == names
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    for name, default in defaults.items():
        assert ours.parameters[name].default == default


def test_sdpa_keyword_arguments(device):
    q, k, v = _inputs((1, 2, 2, 12, 12, 8), torch.float64, device, requires_grad=False)
    out = flash_attn.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True, scale=0.5)
    expected = torch_math(q, k, v, is_causal=True, scale=0.5)[0]
    torch.testing.assert_close(out, expected)
