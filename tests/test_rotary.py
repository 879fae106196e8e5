# flash_attn.layers.rotary (Dao-AILab's module) and flash_attn_with_kvcache's rotary_cos / rotary_sin, on CPU and
# CUDA, against a plain-PyTorch rotation built here from the definition (per-position cos / sin gathered, GPT-NeoX
# halves or GPT-J pairs): every dtype, rotary_dim < headdim, int and per-sequence offsets (positions past the table
# unrotated), varlen, in place, the packed qkv / kv forms (GQA too), RotaryEmbedding with and without XPos, gradients
# (float64 gradcheck on CPU; the reference's gradients elsewhere), the ops' opcheck and their refusals.
import pytest
import torch

import flash_attn

from flash_attn import flash_attn_with_kvcache
from flash_attn.layers.rotary import (
    RotaryEmbedding,
    apply_rotary_emb,
    apply_rotary_emb_kv_,
    apply_rotary_emb_qkv_,
)
from flash_attn.reference import cu_from_seqlens
from helpers import randn, require_supported

def _cuda_build():
    return torch.cuda.is_available() and any(k["device"] == "cuda" for k in flash_attn.built_kernels())


# The rotary kernel needs no attention kernel: CUDA runs wherever the build has CUDA code, whatever its table holds.
@pytest.fixture(params=["cpu"] + (["cuda"] if _cuda_build() else []))
def device(request):
    return request.param


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _dtypes(device):
    return [torch.float32, torch.bfloat16, torch.float16] + ([torch.float64] if device == "cpu" else [])


def _tables(rows, rotary_dim, dtype, device):
    angles = torch.rand(rows, rotary_dim // 2, dtype=torch.float64) * 6.3
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def _rotate_ref(x, cos, sin, positions, interleaved):
    """x (batch, seqlen, heads, dim) rotated row by row at positions (batch, seqlen) (rows outside the table kept),
    in float64."""
    rotary_dim = cos.shape[1] * 2
    x64 = x.double()
    out = x64.clone()
    inside = (positions >= 0) & (positions < cos.shape[0])
    index = positions.clamp(0, cos.shape[0] - 1)
    c = torch.where(inside.unsqueeze(-1), cos.double()[index], torch.ones((), dtype=torch.float64, device=x.device))
    s = torch.where(inside.unsqueeze(-1), sin.double()[index], torch.zeros((), dtype=torch.float64, device=x.device))
    c, s = c.unsqueeze(2), s.unsqueeze(2)
    if interleaved:
        x1, x2 = x64[..., 0:rotary_dim:2], x64[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2], out[..., 1:rotary_dim:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        half = rotary_dim // 2
        x1, x2 = x64[..., :half], x64[..., half:rotary_dim]
        out[..., :half], out[..., half:rotary_dim] = x1 * c - x2 * s, x1 * s + x2 * c
    return out


def _positions(batch, seqlen, offsets, device):
    base = torch.arange(seqlen, device=device).view(1, -1)
    offsets = torch.as_tensor(offsets, device=device).view(-1, 1) if torch.is_tensor(offsets) else offsets
    return (base + offsets).expand(batch, seqlen)


def _close(ours, ref, dtype):
    if ref.numel() == 0:
        return
    tol = TOL[dtype] * max(1.0, ref.abs().max().item())
    assert (ours.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("offsets", ["zero", "int", "tensor"])
def test_apply_rotary_emb(offsets, rotary_dim, interleaved, device):
    for dtype in _dtypes(device):
        b, s, h, d = 3, 11, 4, 64
        x = randn(b, s, h, d, dtype=dtype, device=device, requires_grad=True)
        cos, sin = _tables(24, rotary_dim, dtype, device)
        offset = {"zero": 0, "int": 7, "tensor": torch.tensor([0, 5, 20], device=device, dtype=torch.int32)}[offsets]
        out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offset)
        ref = _rotate_ref(x.detach(), cos, sin, _positions(b, s, offset, device), interleaved)
        _close(out, ref, dtype)  # offset 20 + 10 rows reach past the 24-row table: those rows stay unrotated
        dout = randn(b, s, h, d, dtype=dtype, device=device)
        (dx,) = torch.autograd.grad(out, x, dout)
        x64 = x.detach().double().requires_grad_()
        (dref,) = torch.autograd.grad(_rotate_ref(x64, cos, sin, _positions(b, s, offset, device), interleaved), x64,
                                      dout.double())
        _close(dx, dref, dtype)


# The CUDA kernel moves rows in 16-byte vectors where a row allows them and element by element otherwise: a rotary_dim
# that is no multiple of a vector pair (20), and x starting one element past an aligned address (a view into a
# wider tensor), take the element loop; the same call in place too.
@pytest.mark.parametrize("case", ["vectors", "odd_rotary_dim", "misaligned"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_rotary_row_forms(case, interleaved, device):
    for dtype in _dtypes(device):
        b, s, h, d = 2, 5, 3, 64
        rotary_dim = 20 if case == "odd_rotary_dim" else 32
        wide = randn(b, s, h, d + 8, dtype=dtype, device=device)
        x = wide[..., 1:d + 1] if case == "misaligned" else wide[..., :d]
        cos, sin = _tables(16, rotary_dim, dtype, device)
        offsets = torch.tensor([3, 9], device=device, dtype=torch.int32)  # rows past the 16-row table: unrotated
        ref = _rotate_ref(x, cos, sin, _positions(b, s, offsets, device), interleaved)
        _close(apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets), ref, dtype)
        inplace = x.clone() if case != "misaligned" else x
        apply_rotary_emb(inplace, cos, sin, interleaved=interleaved, seqlen_offsets=offsets, inplace=True)
        _close(inplace, ref, dtype)


def test_gradcheck_float64_cpu():
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64, requires_grad=True)
    cos, sin = _tables(9, 12, torch.float64, "cpu")
    offsets = torch.tensor([1, 4])
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, cos, sin, seqlen_offsets=offsets), (x,))
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, cos, sin, interleaved=True), (x,))


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_varlen_and_inplace(interleaved, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    seqlens = [5, 0, 9, 3]
    total, h, d = sum(seqlens) + 2, 4, 32  # two rows past cu_seqlens[-1]: left as they are
    x = randn(total, h, d, dtype=dtype, device=device)
    cu = cu_from_seqlens(seqlens, device)
    cos, sin = _tables(16, d, dtype, device)
    offsets = torch.tensor([2, 0, 1, 6], device=device)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets, cu_seqlens=cu,
                           max_seqlen=max(seqlens))
    for i, n in enumerate(seqlens):
        start = sum(seqlens[:i])
        piece = x[start:start + n].unsqueeze(0)
        ref = _rotate_ref(piece, cos, sin, _positions(1, n, int(offsets[i]), device), interleaved)
        _close(out[start:start + n].unsqueeze(0), ref, dtype)
    assert torch.equal(out[sum(seqlens):], x[sum(seqlens):])
    y = x.clone()
    returned = apply_rotary_emb(y, cos, sin, interleaved=interleaved, inplace=True, seqlen_offsets=offsets,
                                cu_seqlens=cu, max_seqlen=max(seqlens))
    assert returned.data_ptr() == y.data_ptr() and torch.equal(y[:sum(seqlens)], out[:sum(seqlens)])


@pytest.mark.parametrize("layout", ["qkv5", "qkv4_gqa", "kv"])
def test_packed_forms(layout, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, s, d, hq, hk = 2, 7, 32, 4, 2
    cos, sin = _tables(12, 16, dtype, device)
    offsets = torch.tensor([3, 1], device=device)
    positions = _positions(b, s, offsets, device)
    if layout == "qkv5":
        packed = randn(b, s, 3, hq, d, dtype=dtype, device=device, requires_grad=True)
        views = lambda t: (t[:, :, 0], t[:, :, 1], t[:, :, 2])  # noqa: E731
        run = lambda t: apply_rotary_emb_qkv_(t, cos, sin, seqlen_offsets=offsets)  # noqa: E731
    elif layout == "qkv4_gqa":
        packed = randn(b, s, hq + 2 * hk, d, dtype=dtype, device=device, requires_grad=True)
        views = lambda t: (t[:, :, :hq], t[:, :, hq:hq + hk], t[:, :, hq + hk:])  # noqa: E731
        run = lambda t: apply_rotary_emb_qkv_(t, cos, sin, seqlen_offsets=offsets, num_heads_q=hq)  # noqa: E731
    else:
        packed = randn(b, s, 2, hk, d, dtype=dtype, device=device, requires_grad=True)
        views = lambda t: (None, t[:, :, 0], t[:, :, 1])  # noqa: E731
        run = lambda t: apply_rotary_emb_kv_(t, cos, sin, seqlen_offsets=offsets)  # noqa: E731
    source = packed.detach().clone()
    out = run(packed.clone())
    for got, original, rotated in zip(views(out), views(source), (True, True, False)):
        if original is None:
            continue
        ref = _rotate_ref(original, cos, sin, positions, False) if rotated else original.double()
        _close(got, ref, dtype)
    dout = randn(*packed.shape, dtype=dtype, device=device)
    (grad,) = torch.autograd.grad(out, packed, dout)
    for got, upstream, rotated in zip(views(grad), views(dout), (True, True, False)):
        if upstream is None:
            continue
        ref = _rotate_ref(upstream, cos, -sin, positions, False) if rotated else upstream.double()
        _close(got, ref, dtype)


@pytest.mark.parametrize("scale_base", [None, 512])
def test_rotary_embedding_module(scale_base, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    b, s, h, d = 2, 9, 4, 32
    module = RotaryEmbedding(d, scale_base=scale_base, device=device)
    qkv = randn(b, s, 3, h, d, dtype=dtype, device=device)
    out = module(qkv.clone(), seqlen_offset=4)
    positions = torch.arange(s + 4, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)))
    cos, sin = freqs.cos(), freqs.sin()
    cos_k, sin_k = cos, sin
    if scale_base is not None:
        scale = (torch.arange(0, d, 2, device=device, dtype=torch.float32) + 0.4 * d) / (1.4 * d)
        factor = scale ** ((positions - (s + 4) // 2) / scale_base).unsqueeze(-1)
        cos, sin, cos_k, sin_k = cos * factor, sin * factor, cos / factor, sin / factor
    pos = _positions(b, s, 4, device)
    _close(out[:, :, 0], _rotate_ref(qkv[:, :, 0], cos.to(dtype), sin.to(dtype), pos, False), dtype)
    _close(out[:, :, 1], _rotate_ref(qkv[:, :, 1], cos_k.to(dtype), sin_k.to(dtype), pos, False), dtype)
    assert torch.equal(out[:, :, 2], qkv[:, :, 2])
    q, kv = module(qkv[:, :, 0].clone(), qkv[:, :, 1:].clone(), seqlen_offset=4)
    torch.testing.assert_close(q, out[:, :, 0])
    torch.testing.assert_close(kv[:, :, 0], out[:, :, 1])


def test_refusals():
    x = torch.randn(1, 4, 2, 16)
    cos, sin = _tables(6, 16, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"positions 3 \.\.\. 6 .* must lie in the 6 rows of cos / sin"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=3)
    with pytest.raises(RuntimeError, match="cos must have x's dtype"):
        apply_rotary_emb(x, cos.double(), sin.double())
    with pytest.raises(RuntimeError, match=r"rotary_dim \(2 x cos.shape\[1\] = 32\) must be at most the head dim 16"):
        apply_rotary_emb(x, *_tables(6, 32, torch.float32, "cpu"))


def test_ops_pass_opcheck():
    x = torch.randn(2, 5, 3, 16)
    cos, sin = _tables(8, 8, torch.float32, "cpu")
    offsets = torch.tensor([1, 2])
    torch.library.opcheck(torch.ops.flash_attn.rotary.default, (x, cos, sin, offsets, 0, None, -1, False, False))
    torch.library.opcheck(torch.ops.flash_attn.rotary_.default, (x.clone(), cos, sin, None, 2, None, -1, True, True))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_kvcache_rotary(causal, interleaved, device):
    """flash_attn_with_kvcache rotates the new keys (written rotated into the cache) and the queries as Dao's does:
    compared with rotating them here and calling it without rotary."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    require_supported(device, dtype, 64, backward=False)
    b, sq, new, rows, h, hk, d = 3, 2, 2, 40, 4, 2, 64
    q = randn(b, sq, h, d, dtype=dtype, device=device)
    k_cache, v_cache = (randn(b, rows, hk, d, dtype=dtype, device=device) for _ in range(2))
    k, v = (randn(b, new, hk, d, dtype=dtype, device=device) for _ in range(2))
    lengths = torch.tensor([5, 0, 30], dtype=torch.int32, device=device)
    cos, sin = _tables(rows, 32, dtype, device)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths,
                                  causal=causal, rotary_interleaved=interleaved)
    offsets = lengths.long()
    k_rot = _rotate_ref(k, cos, sin, _positions(b, new, offsets, device), interleaved).to(dtype)
    q_positions = _positions(b, sq, offsets, device) if causal else offsets.view(-1, 1).expand(b, sq)
    q_rot = _rotate_ref(q, cos, sin, q_positions, interleaved).to(dtype)
    kr, vr = k_cache.clone(), v_cache.clone()
    expected = flash_attn_with_kvcache(q_rot, kr, vr, k_rot, v, cache_seqlens=lengths, causal=causal)
    torch.testing.assert_close(kc, kr, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out, expected, atol=4 * TOL[dtype], rtol=4 * TOL[dtype])
    with pytest.raises(ValueError, match="rotary_cos / rotary_sin need the new k and v"):
        flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths)
