# torch.library integration tests: torch.library.opcheck on torch.ops.flash_attn.fwd / bwd (schema,
# fake tensors, autograd registration, AOT dispatch) for dense, varlen, dropout, softcap, ALiBi and
# bias configs; the bwd op's dlse semantics; and torch.compile(fullgraph=True) of a module calling
# flash_attn_func, flash_attn_varlen_func and flash_attn.scaled_dot_product_attention (fwd + bwd).
import pytest
import torch

import flash_attn
from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn.reference import attention_ref, cu_from_seqlens
from helpers import randn, require_supported

SCALE = 0.25


def _dtype(device):
    """float32 on CPU; CUDA kernels take only 16-bit inputs, so the CUDA tier runs these checks in bfloat16."""
    return torch.float32 if str(device) == "cpu" else torch.bfloat16


def _fwd_args(q, k, v, cu_q=None, cu_k=None, max_q=0, max_k=0, dropout_p=0.0, window=(-1, -1), bottom_right=True,
              softcap=0.0, alibi=None, bias=None, rng_state=None, return_probs=False, seqused_k=None):
    args = (q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, SCALE, window[0], window[1], bottom_right, softcap, alibi,
            bias, rng_state, return_probs)
    return args if seqused_k is None else (*args, False, seqused_k)


def _configs(device):
    """(name, fwd kwargs builder) pairs of small op configurations."""
    base = _dtype(device)

    def dense(dtype=base, **kw):
        q = randn(2, 9, 4, 16, dtype=dtype, device=device)
        k = randn(2, 11, 2, 16, dtype=dtype, device=device)
        v = randn(2, 11, 2, 16, dtype=dtype, device=device)
        return dict(q=q, k=k, v=v, **kw)

    def varlen(**kw):
        q = randn(8, 4, 16, dtype=base, device=device)
        k = randn(10, 2, 16, dtype=base, device=device)
        v = randn(10, 2, 16, dtype=base, device=device)
        return dict(q=q, k=k, v=v, cu_q=cu_from_seqlens([3, 5], device), cu_k=cu_from_seqlens([4, 6], device),
                    max_q=5, max_k=6, **kw)

    rng = torch.tensor([123456789, 42], dtype=torch.int64, device=device)
    return {
        "dense": lambda: dense(),
        "dense_bf16_causal_probs": lambda: dense(torch.bfloat16, window=(-1, 0), return_probs=True),
        "varlen_causal": lambda: varlen(window=(-1, 0)),
        "dropout": lambda: dense(dropout_p=0.2, rng_state=rng, return_probs=True),
        "varlen_dropout": lambda: varlen(dropout_p=0.3, rng_state=rng),
        "softcap_window": lambda: dense(softcap=5.0, window=(3, 1)),
        "alibi": lambda: dense(alibi=torch.rand(2, 4, device=device) + 0.1, window=(-1, 0)),
        "bias_top_left": lambda: dense(bias=randn(2, 4, 9, 11, dtype=base, device=device), bottom_right=False),
        "seqused_k_causal": lambda: dense(seqused_k=torch.tensor([0, 7], dtype=torch.int32, device=device),
                                          window=(-1, 0)),
    }


CONFIG_NAMES = list(_configs("cpu"))


def _build(name, device):
    require_supported(device, _dtype(device), 16)
    return _configs(device)[name]()


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_opcheck_fwd(name, device):
    cfg = _build(name, device)
    torch.library.opcheck(torch.ops.flash_attn.fwd.default, _fwd_args(**cfg))


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_opcheck_bwd(name, device):
    cfg = _build(name, device)
    if "seqused_k" in cfg:
        pytest.skip("seqused_k is forward-only: the bwd op has no such argument")
    fwd_cfg = dict(cfg, return_probs=False)
    out, lse, _ = torch.ops.flash_attn.fwd(*_fwd_args(**fwd_cfg))
    dout = torch.randn_like(out)
    dlse = torch.zeros_like(lse)
    bias = cfg.get("bias")
    args = (dout, cfg["q"], cfg["k"], cfg["v"], out, lse, dlse, cfg.get("cu_q"), cfg.get("cu_k"), cfg.get("max_q", 0),
            cfg.get("max_k", 0), cfg.get("dropout_p", 0.0), SCALE, cfg.get("window", (-1, -1))[0],
            cfg.get("window", (-1, -1))[1], cfg.get("bottom_right", True), cfg.get("softcap", 0.0), cfg.get("alibi"),
            bias, cfg.get("rng_state"), True, bias is not None)
    torch.library.opcheck(torch.ops.flash_attn.bwd.default, args)
    dq, dk, dv, dbias = torch.ops.flash_attn.bwd(*args)
    assert dq.shape == cfg["q"].shape and dk.shape == cfg["k"].shape and dv.shape == cfg["v"].shape
    if bias is not None:
        assert dbias is not None and dbias.shape == bias.shape


def test_bwd_op_dlse(device):
    """bwd's dlse is the gradient flowing into softmax_lse: grads of sum(out*dout) + sum(lse*dlse)."""
    require_supported(device, torch.float64, 8)
    q = randn(1, 6, 2, 8, dtype=torch.float64, device=device)
    k = randn(1, 7, 2, 8, dtype=torch.float64, device=device)
    v = randn(1, 7, 2, 8, dtype=torch.float64, device=device)
    out, lse, _ = torch.ops.flash_attn.fwd(*_fwd_args(q, k, v, softcap=4.0))
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.ops.flash_attn.bwd(dout, q, k, v, out, lse, dlse, None, None, 0, 0, 0.0, SCALE, -1, -1, True, 4.0,
                                     None, None, None, True, False)[:3]
    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*xs, softmax_scale=SCALE, softcap=4.0, compute_dtype=torch.float64)
    loss = (ref_out * dout).sum() + (ref_lse * dlse.double()).sum()
    for g, r in zip(grads, torch.autograd.grad(loss, xs)):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


class _Model(torch.nn.Module):
    def __init__(self, max_q, max_k):
        super().__init__()
        self.max_q, self.max_k = max_q, max_k

    def forward(self, q, k, v, qv, kv, vv, cu_q, cu_k, qs, ks, vs, mask):
        dense = flash_attn_func(q, k, v, causal=True, softcap=10.0)
        var = flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, self.max_q, self.max_k, causal=True)
        sdpa = flash_attn.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        return dense, var, sdpa


def _model_inputs(device):
    seqlens_q, seqlens_k = [5, 0, 7], [9, 3, 6]
    leaf = dict(dtype=_dtype(device), device=device, requires_grad=True)
    return (
        randn(2, 13, 4, 32, **leaf), randn(2, 17, 2, 32, **leaf), randn(2, 17, 2, 32, **leaf),
        randn(12, 2, 32, **leaf), randn(18, 2, 32, **leaf), randn(18, 2, 32, **leaf),
        cu_from_seqlens(seqlens_q, device), cu_from_seqlens(seqlens_k, device),
        randn(2, 4, 10, 32, **leaf), randn(2, 2, 12, 32, **leaf), randn(2, 2, 12, 32, **leaf),
        randn(10, 12, device=device, requires_grad=True),
    ), max(seqlens_q), max(seqlens_k)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph(backend, device):
    require_supported(device, _dtype(device), 32)
    torch._dynamo.reset()
    inputs, max_q, max_k = _model_inputs(device)
    model = _Model(max_q, max_k)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    leaves = [t for t in inputs if t.requires_grad]
    eager_outs = model(*inputs)
    douts = [torch.randn_like(o) for o in eager_outs]
    eager_grads = torch.autograd.grad(eager_outs, leaves, douts)
    outs = compiled(*inputs)
    grads = torch.autograd.grad(outs, leaves, douts)
    for a, b in zip(outs, eager_outs):
        torch.testing.assert_close(a, b)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_compile_no_graph_breaks_with_explain(device):
    require_supported(device, _dtype(device), 32)
    torch._dynamo.reset()
    inputs, max_q, max_k = _model_inputs(device)
    explanation = torch._dynamo.explain(_Model(max_q, max_k))(*inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
