"""The torch.library side of the flash_attn ops: loads the extension (which defines the schemas of
torch.ops.flash_attn.fwd / .bwd and their CPU/CUDA kernels in C++) and registers the fake (meta)
implementations and the autograd formula, so opcheck passes and torch.compile traces them without breaks."""

from __future__ import annotations

import torch

from ._native import C as _C  # loading the extension registers the ops' schemas and kernels

fwd_op = torch.ops.flash_attn.fwd.default
bwd_op = torch.ops.flash_attn.bwd.default

# Position of each fwd input, for ctx.needs_input_grad.
_FWD_INPUTS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
               "softmax_scale", "window_left", "window_right", "bottom_right", "softcap", "alibi_slopes",
               "attn_bias", "rng_state", "return_probs", "deterministic", "seqused_k", "num_splits",
               "block_table")
_SEQUSED_K = _FWD_INPUTS.index("seqused_k")
_GRAD_INPUTS = {"q": 0, "k": 1, "v": 2, "attn_bias": _FWD_INPUTS.index("attn_bias")}


@torch.library.register_fake("flash_attn::fwd")
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
              window_left, window_right, bottom_right, softcap, alibi_slopes, attn_bias, rng_state, return_probs,
              deterministic=False, seqused_k=None, num_splits=0, block_table=None):
    nheads = q.shape[-2]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_empty(q.shape)
    if cu_seqlens_q is not None:
        batch = cu_seqlens_q.shape[0] - 1
        lse = q.new_empty((nheads, q.shape[0]), dtype=lse_dtype)
        probs_shape = (batch, nheads, max_seqlen_q, max_seqlen_k)
    else:
        lse = q.new_empty((q.shape[0], nheads, q.shape[1]), dtype=lse_dtype)
        probs_shape = (q.shape[0], nheads, q.shape[1], k.shape[1])
    probs = q.new_empty(probs_shape if return_probs else (0,))
    return out, lse, probs


@torch.library.register_fake("flash_attn::bwd")
def _bwd_fake(dout, q, k, v, out, softmax_lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              dropout_p, softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes, attn_bias,
              rng_state, deterministic, bias_requires_grad):
    grad_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dbias = q.new_empty(attn_bias.shape if bias_requires_grad else (0,), dtype=grad_dtype)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _seqused_k_refusal() -> NotImplementedError:
    return NotImplementedError(
        "flash_attn.fwd: seqused_k has no backward (the backward kernels read every key row); call it under "
        "torch.no_grad() / with inputs that do not require grad, or express the lengths as attn_bias or "
        "cu_seqlens_k when gradients are needed")


def _setup_context(ctx, inputs, output):
    args = dict(zip(_FWD_INPUTS, inputs))
    out, lse, probs = output
    ctx.num_inputs = len(inputs)
    ctx.has_seqused_k = args.get("seqused_k") is not None
    ctx.mark_non_differentiable(probs)
    ctx.save_for_backward(args["q"], args["k"], args["v"], out, lse, args["cu_seqlens_q"], args["cu_seqlens_k"],
                          args["alibi_slopes"], args["attn_bias"], args["rng_state"])
    ctx.options = {name: args[name] for name in ("max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale",
                                                 "window_left", "window_right", "bottom_right", "softcap",
                                                 "deterministic")}


def _backward(ctx, dout, dlse, _dprobs):
    if ctx.has_seqused_k:
        raise _seqused_k_refusal()
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, attn_bias, rng_state = ctx.saved_tensors
    o = ctx.options
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    bias_grad = attn_bias is not None and ctx.needs_input_grad[_GRAD_INPUTS["attn_bias"]]
    dq, dk, dv, dbias = bwd_op(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, o["max_seqlen_q"],
                               o["max_seqlen_k"], o["dropout_p"], o["softmax_scale"], o["window_left"],
                               o["window_right"], o["bottom_right"], o["softcap"], alibi_slopes, attn_bias,
                               rng_state, o["deterministic"], bias_grad)
    grads = [None] * ctx.num_inputs  # fewer than len(_FWD_INPUTS) when a caller leaves the defaulted ones out
    grads[0], grads[1], grads[2] = dq, dk, dv
    if bias_grad:
        grads[_GRAD_INPUTS["attn_bias"]] = dbias.to(attn_bias.dtype)
    return tuple(grads)


torch.library.register_autograd("flash_attn::fwd", _backward, setup_context=_setup_context)


class _FwdFunction(torch.autograd.Function):
    """The same autograd formula as the registration above, for eager calls. torch.library's generic wrapper
    rebuilds the op's schema argument list on every call (utils.fill_defaults): 130-170 us of host time per
    forward with inputs that require grad, measured on our CPU; on the H200 that made 512-token forwards
    host-bound (79 vs 184 TFLOP/s for FA2, hd 128 causal)."""

    @staticmethod
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = fwd_op(*args)
        _setup_context(ctx, args, output)
        ctx.set_materialize_grads(False)  # an unused lse output then costs the backward nothing
        return output

    @staticmethod
    def backward(ctx, dout, dlse, dprobs):
        if dout is None:
            dout = torch.zeros_like(ctx.saved_tensors[0])
        return _backward(ctx, dout, dlse, dprobs)


def fwd(*args):
    """torch.ops.flash_attn.fwd with autograd, its arguments positional (see _FWD_INPUTS; seqused_k, num_splits and
    block_table, the last three, may be left out; block_table comes only with seqused_k). Traced calls
    (torch.compile) use the op and its registered formula; eager calls that need gradients use _FwdFunction.
    seqused_k is forward-only: eager calls that need gradients with it raise NotImplementedError here, traced ones
    when their backward runs."""
    if torch.compiler.is_compiling():
        return fwd_op(*args)
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        if len(args) > _SEQUSED_K and args[_SEQUSED_K] is not None:
            raise _seqused_k_refusal()
        return _FwdFunction.apply(*args)
    with torch._C._AutoDispatchBelowAutograd():  # nothing to record: skip the autograd wrapper (~7 us)
        return fwd_op(*args)


def new_rng_state(dropout_p: float, device: torch.device) -> torch.Tensor | None:
    """[seed, offset] for one dropout call, drawn from torch's generator of `device` (so torch.manual_seed
    reproduces it, and CUDA graph capture records it); None when there is no dropout."""
    if dropout_p == 0.0:
        return None
    seed_bound = 1 << 62
    offset_bound = 1 << 32
    seed = torch.randint(0, seed_bound, (1,), dtype=torch.int64, device=device)
    offset = torch.randint(0, offset_bound, (1,), dtype=torch.int64, device=device)
    return torch.cat([seed, offset])


def check_index_values(op: str, name: str, tensor: torch.Tensor, low: int, high: int) -> None:
    """Every value of an index tensor in [low, high], or an error naming op, name and the first bad entry: on CPU
    always, on CUDA once per tensor version (one host synchronisation the first time a tensor is seen; none under
    CUDA-graph capture, where callers clamp instead). Not while torch.compile traces (values unknown)."""
    if not torch.compiler.is_compiling():
        _C.check_index_values(tensor, op, name, low, high)


def built_kernels() -> list[dict]:
    """Every kernel this build compiled (CPU implementation entries included), as dicts with keys
    device, arch, dtype, head_dim, mask, direction, name."""
    return list(_C.built_kernels())


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def is_supported(device, dtype: torch.dtype, head_dim: int, backward: bool = True) -> bool:
    """Whether flash_attn runs the forward, and the backward unless backward=False, for every mask kind on
    this device, dtype and head dim."""
    device = torch.device(device)
    if dtype not in _DTYPE_NAMES:
        return False
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        return bool(_C.is_supported("cuda", index, _DTYPE_NAMES[dtype], int(head_dim), backward))
    return bool(_C.is_supported(device.type, 0, _DTYPE_NAMES[dtype], int(head_dim), backward))
