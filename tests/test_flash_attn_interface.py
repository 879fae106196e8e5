# flash_attn.flash_attn_interface, Dao-AILab's module of that name (>= 2.6.3): the public functions re-exported, and
# the four private block functions that sequence-parallel engines call, on CPU and CUDA: their results against
# flash_attn_func / flash_attn_varlen_func (outputs, LSE, gradients, dropout through rng_state), Dao's return shapes
# (softmax_d, rng_state), gradients written into the given buffers, the backward using the out and LSE it is handed
# (two key blocks merged by LSE give the exact gradients), torch.library.opcheck of the custom ops, the refusals, Dao's
# _wrapped_* op names and its compiled extension's functions (flash_attn_gpu).

import pytest
import torch

import flash_attn
from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn import flash_attn_interface as fai
from flash_attn.reference import attention_ref
from helpers import assert_close_fa, randn, reference_pair, require_supported, varlen_tensors

HEAD_DIM = 64


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _qkv(device, b=2, sq=37, sk=45, h=4, hk=2):
    dtype = _dtype(device)
    require_supported(device, dtype, HEAD_DIM)
    return tuple(randn(b, s, n, HEAD_DIM, dtype=dtype, device=device)
                 for s, n in ((sq, h), (sk, hk), (sk, hk)))


def test_public_functions_are_reexported():
    for name in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
                 "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"):
        assert getattr(fai, name) is getattr(flash_attn, name)


@pytest.mark.parametrize("window", [(-1, -1), (8, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_match_the_public_functions(causal, window, device):
    q, k, v = _qkv(device)
    out, lse, probs, rng_state = fai._flash_attn_forward(q, k, v, 0.0, None, causal, window[0], window[1], 0.0,
                                                         None, False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse, _ = flash_attn_func(*leaves, causal=causal, window_size=window, return_attn_probs=True)
    assert torch.equal(out, ref_out.detach()) and torch.equal(lse, ref_lse.detach())
    assert probs.numel() == 0 and rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    softmax_d = fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, None, causal, window[0], window[1],
                                         0.0, None, False, None)
    for ours, theirs in zip((dq, dk, dv), torch.autograd.grad(ref_out, leaves, dout)):
        assert torch.equal(ours, theirs)
    b, sq, h, _ = q.shape
    assert softmax_d.shape == (b, h, 128) and softmax_d.dtype == torch.float32
    expected = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[..., :sq], expected)
    assert softmax_d[..., sq:].abs().max() == 0


def test_varlen_forward_and_backward_match_the_public_function(device):
    dtype = _dtype(device)
    require_supported(device, dtype, HEAD_DIM)
    seqlens_q, seqlens_k = [17, 0, 40], [23, 5, 31]
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, 4, 2, HEAD_DIM, dtype, device)
    args = (cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, *args, 0.0, None, True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse, _ = flash_attn_varlen_func(*leaves, *args, causal=True, return_attn_probs=True)
    assert torch.equal(out, ref_out.detach()) and torch.equal(lse, ref_lse.detach())
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    softmax_d = fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, *args, 0.0, None, True, -1, -1,
                                                0.0, None, False, None)
    for ours, theirs in zip((dq, dk, dv), torch.autograd.grad(ref_out, leaves, dout)):
        assert torch.equal(ours, theirs)
    assert softmax_d.shape == (4, q.shape[0] + 128 * len(seqlens_q))


def test_backward_uses_the_out_and_lse_it_is_handed(device):
    """Ring attention's contract: keys split into two blocks, each block's backward run with the out and LSE of
    the whole row (merged over both blocks) gives dq contributions that add up to the exact dq, and each block's
    dk / dv exactly; a backward that recomputed a block-local LSE would get neither."""
    q, k, v = _qkv(device, sq=40, sk=64)
    split = 29
    out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0, None, False)
    dout = torch.randn_like(out)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = [], []
    for block in (slice(0, split), slice(split, None)):
        kb, vb = k[:, block].contiguous(), v[:, block].contiguous()
        grads = [torch.empty_like(t) for t in (q, kb, vb)]
        fai._flash_attn_backward(dout, q, kb, vb, out, lse, *grads, 0.0, None, False, -1, -1, 0.0, None, False, None)
        dq += grads[0].float()
        dk.append(grads[1])
        dv.append(grads[2])
    truth, naive = reference_pair(attention_ref, (q, k, v), dout)
    assert_close_fa(dq.to(q.dtype), truth[2][0], naive[2][0], 3)
    assert_close_fa(torch.cat(dk, 1), truth[2][1], naive[2][1], 3)
    assert_close_fa(torch.cat(dv, 1), truth[2][2], naive[2][2], 3)


def test_dropout_round_trip_through_rng_state(device):
    q, k, v = _qkv(device)
    torch.manual_seed(7)
    out, lse, _, rng_state = fai._flash_attn_forward(q, k, v, 0.25, None, True, -1, -1, 0.0, None, False)
    torch.manual_seed(7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = flash_attn_func(*leaves, dropout_p=0.25, causal=True)
    assert torch.equal(out, ref_out.detach())
    dout = torch.randn_like(out)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    fai._flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.25, None, True, -1, -1, 0.0, None, False, rng_state)
    for ours, theirs in zip(grads, torch.autograd.grad(ref_out, leaves, dout)):
        assert torch.equal(ours, theirs)


def test_buffers_may_be_omitted(device):
    q, k, v = _qkv(device)
    out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, None, False)
    dk = torch.empty_like(k)
    fai._flash_attn_backward(torch.randn_like(out), q, k, v, out, lse, None, dk, None, 0.0, None, False, -1, -1, 0.0,
                             None, False)
    assert not torch.isnan(dk).any()


def test_wrapped_ops_take_daos_schema(device):
    # Dao's module (>= 2.7) names the ops _wrapped_flash_attn_*; engines call them with keywords and a float scale,
    # the varlen forward with block_table (paged k / v) and the backward without rng_state.
    q, k, v = _qkv(device)
    out, lse, _, _ = fai._wrapped_flash_attn_forward(q, k, v, 0.0, 0.125, True, -1, -1, 0.0, None, False)
    assert torch.equal(out, flash_attn_func(q, k, v, softmax_scale=0.125, causal=True))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    fai._wrapped_flash_attn_backward(torch.randn_like(out), q, k, v, out, lse, dq, dk, dv, dropout_p=0.0,
                                     softmax_scale=0.125, causal=True, window_size_left=-1, window_size_right=-1,
                                     softcap=0.0, alibi_slopes=None, deterministic=False)
    assert not dq.isnan().any()
    dtype = _dtype(device)
    qv, kv, vv, cu_q, cu_k = varlen_tensors([5, 9], [7, 12], 4, 2, HEAD_DIM, dtype, device)
    dense, _, _, _ = fai._wrapped_flash_attn_varlen_forward(qv, kv, vv, cu_q, cu_k, 9, 12, 0.0, 0.125, causal=True)
    page, pages = 4, 3
    pool_k = randn(2 * pages + 1, page, 2, HEAD_DIM, dtype=dtype, device=device)
    pool_v = randn(*pool_k.shape, dtype=dtype, device=device)
    table = torch.tensor([[6, 0, 2], [1, 3, 5]], dtype=torch.int32, device=device)
    for b, (start, length) in enumerate(((0, 7), (7, 12))):
        rows = torch.arange(length, device=device)
        pool_k[table[b].long()[rows // page], rows % page] = kv[start:start + length]
        pool_v[table[b].long()[rows // page], rows % page] = vv[start:start + length]
    paged, _, _, _ = fai._wrapped_flash_attn_varlen_forward(qv, pool_k, pool_v, cu_q, cu_k, 9, 12, 0.0, 0.125,
                                                            causal=True, block_table=table)
    assert torch.equal(paged, dense)


@pytest.mark.parametrize("name", ["leftpad_k", "seqused_k"])
def test_varlen_extras_refused(name):
    q, k, v, cu_q, cu_k = varlen_tensors([5, 7], [6, 8], 2, 2, 16, torch.float32, "cpu")
    extra = {name: torch.zeros(2, dtype=torch.int32)}
    with pytest.raises(NotImplementedError, match=f"{name} is not supported yet"):
        fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 7, 8, 0.0, None, False, **extra)


def test_custom_ops_pass_opcheck():
    q, k, v = (randn(2, 9, 2, 16) for _ in range(3))
    out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, None, True)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    cases = [
        (torch.ops.flash_attn._flash_attn_forward.default, (q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False)),
        (torch.ops.flash_attn._flash_attn_backward.default,
         (torch.randn_like(out), q, k, v, out, lse, *grads, 0.0, 0.25, True, -1, -1, 0.0, None, False, None)),
    ]
    qv, kv, vv, cu_q, cu_k = varlen_tensors([4, 5], [6, 3], 2, 2, 16, torch.float32, "cpu")
    vout, vlse, _, _ = fai._flash_attn_varlen_forward(qv, kv, vv, cu_q, cu_k, 5, 6, 0.0, None, False)
    vgrads = [torch.empty_like(t) for t in (qv, kv, vv)]
    cases += [
        (torch.ops.flash_attn._flash_attn_varlen_forward.default,
         (qv, kv, vv, cu_q, cu_k, 5, 6, 0.0, 0.25, False, -1, -1, 0.0, None, False)),
        (torch.ops.flash_attn._flash_attn_varlen_backward.default,
         (torch.randn_like(vout), qv, kv, vv, vout, vlse, *vgrads, cu_q, cu_k, 5, 6, 0.0, 0.25, False, -1, -1, 0.0,
          None, False, None)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_dao_extension_functions(device):
    # flash_attn_gpu / flash_attn_cuda: Dao's compiled extension's positional signatures (fwd, varlen_fwd, bwd,
    # varlen_bwd, fwd_kvcache) on our ops, results against the public functions; Unsloth imports it as a usability
    # check.
    assert fai.flash_attn_cuda is fai.flash_attn_gpu
    ext = fai.flash_attn_gpu
    q, k, v = _qkv(device)
    out_buf = torch.empty_like(q)
    out, lse, p, rng_state = ext.fwd(q, k, v, out_buf, None, 0.0, 0.125, True, -1, -1, 0.0, False, None)
    assert out is out_buf and torch.equal(out, flash_attn_func(q, k, v, softmax_scale=0.125, causal=True))
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and p.numel() == 0 and rng_state.shape == (2,)
    dout = torch.randn_like(out)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(flash_attn_func(*leaves, softmax_scale=0.125, causal=True), leaves, dout)
    dq, dk, dv, softmax_d = ext.bwd(dout, q, k, v, out, lse, None, None, None, None, 0.0, 0.125, True, -1, -1, 0.0,
                                    False, None, None)
    for ours, theirs in zip((dq, dk, dv), expected):
        assert torch.equal(ours, theirs)
    assert softmax_d.shape == (q.shape[0], q.shape[2], 128)

    dtype = _dtype(device)
    qv, kv, vv, cu_q, cu_k = varlen_tensors([5, 9], [7, 12], 4, 2, HEAD_DIM, dtype, device)
    qv = torch.cat([qv, randn(3, 4, HEAD_DIM, dtype=dtype, device=device)])  # rows past the last sequence
    vout, vlse, _, _ = ext.varlen_fwd(qv, kv, vv, None, cu_q, cu_k, None, None, None, None, 9, 12, 0.0, 0.125, True,
                                      True, -1, -1, 0.0, False, None)
    assert torch.equal(vout[:14], flash_attn_varlen_func(qv[:14], kv, vv, cu_q, cu_k, 9, 12, softmax_scale=0.125,
                                                         causal=True))
    assert vout[14:].abs().max() == 0 and vlse.shape == (4, qv.shape[0])
    grads = ext.varlen_bwd(torch.randn_like(vout), qv, kv, vv, vout, vlse, None, None, None, cu_q, cu_k, None, 9, 12,
                           0.0, 0.125, True, True, -1, -1, 0.0, False, None, None)
    assert grads[0][14:].abs().max() == 0 and not any(g.isnan().any() for g in grads[:3])
    with pytest.raises(NotImplementedError, match="seqused_k"):
        ext.varlen_fwd(qv, kv, vv, None, cu_q, cu_k, torch.tensor([7, 12], dtype=torch.int32, device=device), None,
                       None, None, 9, 12, 0.0, 0.125, False, True, -1, -1, 0.0, False, None)

    k_cache = randn(2, 20, 2, HEAD_DIM, dtype=dtype, device=device)
    v_cache = randn(2, 20, 2, HEAD_DIM, dtype=dtype, device=device)
    q1 = randn(2, 1, 4, HEAD_DIM, dtype=dtype, device=device)
    k_new = randn(2, 1, 2, HEAD_DIM, dtype=dtype, device=device)
    v_new = randn(2, 1, 2, HEAD_DIM, dtype=dtype, device=device)
    lengths = torch.tensor([5, 11], dtype=torch.int32, device=device)
    kc, vc = k_cache.clone(), v_cache.clone()
    expected_out, expected_lse = flash_attn.flash_attn_with_kvcache(q1, kc, vc, k_new, v_new, cache_seqlens=lengths,
                                                                    causal=True, return_softmax_lse=True)
    kout, klse = ext.fwd_kvcache(q1, k_cache, v_cache, k_new, v_new, lengths, None, None, None, None, None, None,
                                 None, HEAD_DIM ** -0.5, True, -1, -1, 0.0, True, 0)
    assert torch.equal(kout, expected_out) and torch.equal(klse, expected_lse)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)  # the new rows appended in place
