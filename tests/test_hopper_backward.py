# The Hopper backward path (csrc/sm90/bwd_kernel.h, sm_90a) against the fp64 reference under the FlashAttention rule
# (gradients within 3x the low-precision reference's error), with FLASH_ATTN_HOPPER=force so that a call it does not
# take fails instead of passing on the portable kernels: head dims 64, 96 (its bucket's kernel stores 128 columns and
# runs S^T, dP^T over 96) and 128 (and below their buckets), the wide kernel above 128 (csrc/sm90/bwd_wide_kernel.h:
# 256 stored columns, S^T and dP^T over the bucket's 160, 192, 224 or 256), odd sequence
# lengths both ways (ragged query and key blocks, rows and keys no one sees), causal, windows, GQA / MQA (dK, dV summed
# over a group's query heads in registers), packed qkv strides, varlen with empty sequences, softcap and ALiBi (the
# general kernels), deterministic mode (bitwise repeatable), every sequence's keys in one key block (dQ stored
# directly). Then the fallback: a bias gradient runs on the portable
# kernels under FLASH_ATTN_HOPPER=1 and fails under force, naming the mask. Collected where a Hopper GPU runs sm_90a code of a build with sm90 backward kernels.
import re
import subprocess
import sys

import pytest
import torch

import flash_attn
from flash_attn import flash_attn_func, flash_attn_varlen_func
from flash_attn.interface import attention
from flash_attn._native import C
from flash_attn.reference import attention_ref, attention_varlen_ref
from helpers import assert_close_fa, cuda_kernel_names, randn, reference_pair, varlen_tensors

HOPPER_ARCH = 90
SWITCH = "FLASH_ATTN_HOPPER"
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _hopper_kernels():
    """(direction, dtype name, head-dim bucket, mask) of every sm90 kernel in this build, where the GPU runs them."""
    if not torch.cuda.is_available() or C.loaded_code(torch.cuda.current_device())[0] < HOPPER_ARCH:
        return set()
    return {(k["direction"], k["dtype"], k["head_dim"], k["mask"]) for k in flash_attn.built_kernels()
            if k["device"] == "cuda" and k["arch"] == "sm90"}


BUILT = _hopper_kernels()
pytestmark = pytest.mark.skipif(not any(k[0] == "bwd" for k in BUILT),
                                reason="needs a Hopper GPU and a build with sm90 backward kernels")


def _require(dtype, head_dim, mask="none"):
    bucket = next(b for b in (32, 64, 96, 128, 160, 192, 224, 256) if head_dim <= b)
    for direction in ("fwd", "bwd"):
        if (direction, DTYPE_NAMES[dtype], bucket, mask) not in BUILT:
            pytest.skip(f"no sm90 {direction} kernel for {DTYPE_NAMES[dtype]} head dim {head_dim} mask {mask}")


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv(SWITCH, "force")


def _leaves(*shapes, dtype=torch.bfloat16):
    return [randn(*shape, dtype=dtype, device="cuda").requires_grad_() for shape in shapes]


def _check_grads(out, inputs, dout, ref_fn):
    grads = torch.autograd.grad(out, inputs, dout)
    truth, naive = reference_pair(ref_fn, tuple(x.detach() for x in inputs), dout)
    assert_close_fa(out.detach().cpu(), truth[0].cpu(), naive[0].cpu(), 2.0)
    for name, ours, exact, low in zip("qkv", grads, truth[2], naive[2]):
        try:
            assert_close_fa(ours.cpu(), exact.cpu(), low.cpu(), 3.0)
        except AssertionError as error:
            raise AssertionError(f"d{name}: {error}") from None


def _dense(b, sq, sk, h, hk, d, dtype=torch.bfloat16, **kwargs):
    q, k, v = _leaves((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), dtype=dtype)
    dout = randn(b, sq, h, d, dtype=dtype, device="cuda")
    out = flash_attn_func(q, k, v, **kwargs)
    _check_grads(out, (q, k, v), dout, lambda *x, **kw: attention_ref(*x, **kwargs, **kw))


def _varlen(seqlens_q, seqlens_k, h, hk, d, causal):
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, h, hk, d, torch.bfloat16, "cuda", requires_grad=True)
    dout = randn(*q.shape, dtype=torch.bfloat16, device="cuda")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=causal)
    _check_grads(out, (q, k, v), dout,
                 lambda *x, **kw: attention_varlen_ref(*x, cu_q.cpu(), cu_k.cpu(), causal=causal, **kw)[:2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 40, 64, 72, 96, 100, 128, 144, 160, 176, 192, 200, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(forced, head_dim, causal, dtype):
    _require(dtype, head_dim, "causal" if causal else "none")
    _dense(2, 113, 255, 4, 2, head_dim, dtype, causal=causal)


@pytest.mark.parametrize("seqlens", [(17, 1), (17, 300), (300, 17), (127, 129), (128, 128), (129, 127), (640, 255)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 224, 256])
def test_seqlens(forced, seqlens, causal, head_dim):
    """Ragged query and key blocks; seqlen_q > seqlen_k causal leaves rows that see no key (LSE +inf: P = 0) and
    seqlen_q < seqlen_k leaves keys that no row sees (dK = dV = 0 there)."""
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    sq, sk = seqlens
    _dense(2, sq, sk, 2, 2, head_dim, causal=causal)


@pytest.mark.parametrize("window", [(100, 37), (0, 0), (-1, 20), (300, -1)])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_windows(forced, window, head_dim):
    _require(torch.bfloat16, head_dim, "local")
    _dense(2, 300, 517, 4, 4, head_dim, window_size=window)


@pytest.mark.parametrize("heads", [(8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 224, 256])
def test_gqa(forced, heads, causal, head_dim):
    """dK, dV summed over a KV head's query heads. Grids this small split the group over CTAs
    (sm90_bwd_head_splits: fp32 accumulators, then a conversion); test_deterministic covers the unsplit sums."""
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    h, hk = heads
    _dense(2, 333, 333, h, hk, head_dim, causal=causal)


def test_packed_qkv_strides(forced):
    _require(torch.bfloat16, 128)
    qkv = randn(2, 300, 3, 4, 128, dtype=torch.bfloat16, device="cuda").requires_grad_()
    dout = randn(2, 300, 4, 128, dtype=torch.bfloat16, device="cuda")
    out = flash_attn_func(*qkv.unbind(2), causal=True)
    (grad,) = torch.autograd.grad(out, qkv, dout)
    leaves = [x.detach().clone().requires_grad_() for x in qkv.unbind(2)]
    truth, naive = reference_pair(lambda *x, **kw: attention_ref(*x, causal=True, **kw), tuple(leaves), dout)
    for i, name in enumerate("qkv"):
        try:
            assert_close_fa(grad[:, :, i].cpu(), truth[2][i].cpu(), naive[2][i].cpu(), 3.0)
        except AssertionError as error:
            raise AssertionError(f"d{name}: {error}") from None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_varlen(forced, causal, head_dim):
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    _varlen([129, 0, 17, 300, 5], [200, 9, 0, 333, 128], 4, 2, head_dim, causal)


# Grids of more CTAs than SMs (several waves, as real batches run; the other tests' grids are one wave or less),
# ragged so that sequences end mid-block: causal with more query rows than keys, a window, GQA, the general kernel,
# and varlen with empty sequences. The thirtieth session's persistent and two-blocks-per-CTA forms ran these too.
@pytest.mark.parametrize("case", ["none", "causal", "causal_long_q", "window", "gqa", "softcap", "varlen"])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_many_key_blocks(forced, case, head_dim):
    mask = {"none": "none", "gqa": "none", "softcap": "none", "window": "local"}.get(case, "causal")
    _require(torch.bfloat16, head_dim, mask)
    if case == "varlen":
        _varlen([257, 0, 31, 300, 129, 5, 200, 64, 1, 290, 17, 133],
                [520, 9, 0, 290, 129, 77, 128, 255, 1, 300, 40, 517], 8, 8, head_dim, True)
        return
    sq = 389 if case == "causal_long_q" else 257
    heads = (16, 4) if case == "gqa" else (8, 8)
    kwargs = {"none": {}, "gqa": {}, "softcap": {"softcap": 30.0}, "window": {"window_size": (100, 37)}}.get(
        case, {"causal": True})
    _dense(24 if case == "gqa" else 12, sq, 520, heads[0], heads[1], head_dim, **kwargs)


def _poison_allocator(*tensors):
    """Frees blocks of these tensors' sizes full of NaN, for the caching allocator to hand to the next outputs: a row
    that a kernel leaves unwritten then reads NaN instead of the zeros fresh memory often holds."""
    poison = [torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device) for t in tensors]
    del poison


# Every sequence's keys in one key block (csrc/sm90/bwd_direct_dq.h): dQ stored by the main kernel, the rows no step
# reaches zeroed there (causal with more queries than keys, a window, sequences with queries and no keys), GQA (query
# heads split over CTAs), the general kernel, deterministic mode, fp16, varlen documents of up to 128 keys.
ONE_KEY_BLOCK_CASES = {
    "causal_long_q": dict(shape=(3, 300, 77), causal=True),
    "window": dict(shape=(2, 250, 128), window=(20, 3)),
    "gqa": dict(shape=(4, 200, 128), heads=(8, 2), causal=True),
    "softcap_alibi": dict(shape=(2, 150, 100), softcap=20.0, alibi=True, causal=True),
    "deterministic": dict(shape=(2, 333, 97), causal=True, deterministic=True),
    "fp16": dict(shape=(2, 190, 128), dtype=torch.float16),
}


@pytest.mark.parametrize("case", list(ONE_KEY_BLOCK_CASES))
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_one_key_block(forced, case, head_dim):
    spec = ONE_KEY_BLOCK_CASES[case]
    causal, window = spec.get("causal", False), spec.get("window", (-1, -1))
    dtype = spec.get("dtype", torch.bfloat16)
    _require(dtype, head_dim, "local" if window != (-1, -1) else "causal" if causal else "none")
    batch, seqlen_q, seqlen_k = spec["shape"]
    h, hk = spec.get("heads", (4, 4))
    kwargs = dict(causal=causal, window_size=window, softcap=spec.get("softcap", 0.0))
    if spec.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(batch, h, device="cuda") * 0.3
    q, k, v = _leaves((batch, seqlen_q, h, head_dim), (batch, seqlen_k, hk, head_dim),
                      (batch, seqlen_k, hk, head_dim), dtype=dtype)
    dout = randn(batch, seqlen_q, h, head_dim, dtype=dtype, device="cuda")
    deterministic = spec.get("deterministic", False)

    def run():
        return flash_attn_func(q, k, v, deterministic=deterministic, **kwargs)

    def ref(*x, **kw):
        return attention_ref(*x, **kwargs, **kw)

    _poison_allocator(q, q, q)
    if deterministic:
        _repeatable_and_correct(run, (q, k, v), dout, ref)
    else:
        _check_grads(run(), (q, k, v), dout, ref)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_one_key_block_varlen(forced, causal, head_dim):
    """Documents of at most 128 keys: empty ones, one with queries and no keys (its dQ rows 0), more queries than
    keys, single rows."""
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    seqlens_q, seqlens_k = [100, 0, 128, 1, 77, 40, 128], [128, 5, 0, 64, 77, 1, 128]
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, 4, 2, head_dim, torch.bfloat16, "cuda",
                                         requires_grad=True)
    dout = randn(*q.shape, dtype=torch.bfloat16, device="cuda")
    _poison_allocator(q, q, q)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=causal)
    _check_grads(out, (q, k, v), dout,
                 lambda *x, **kw: attention_varlen_ref(*x, cu_q.cpu(), cu_k.cpu(), causal=causal, **kw)[:2])


@pytest.mark.parametrize("feature", ["softcap", "alibi", "both"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 224, 256])
def test_softcap_and_alibi(forced, feature, causal, head_dim):
    """The general kernels: softcap (its derivative in dS) and ALiBi per (batch, query head) of a GQA group."""
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    kwargs = dict(causal=causal)
    if feature in ("softcap", "both"):
        kwargs["softcap"] = 15.0
    if feature in ("alibi", "both"):
        kwargs["alibi_slopes"] = torch.rand(2, 4, device="cuda") * 0.3
    q, k, v = _leaves((2, 213, 4, head_dim), (2, 300, 2, head_dim), (2, 300, 2, head_dim))
    with torch.no_grad():
        q.mul_(3.0)  # scores large enough for softcap to bend them
    dout = randn(2, 213, 4, head_dim, dtype=torch.bfloat16, device="cuda")
    out = flash_attn_func(q, k, v, **kwargs)
    _check_grads(out, (q, k, v), dout, lambda *x, **kw: attention_ref(*x, **kwargs, **kw))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic(forced, head_dim, causal):
    """deterministic=True: the key blocks add into one dq accumulator in a fixed order per query block
    (csrc/sm90/bwd_ordered_dq.h; above hd 128 the wide kernel's ordered instantiation, kBwdDeterministicDqOrderedWide;
    with it off each CTA owns its dq accumulator and walks its key blocks in order); dq, dk, dv are bitwise equal over
    repeated runs, and correct."""
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    q, k, v = _leaves((2, 700, 4, head_dim), (2, 900, 2, head_dim), (2, 900, 2, head_dim))
    dout = randn(2, 700, 4, head_dim, dtype=torch.bfloat16, device="cuda")
    runs = []
    for _ in range(3):
        out = flash_attn_func(q, k, v, causal=causal, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for later in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], later))
    out = flash_attn_func(q, k, v, causal=causal, deterministic=True)
    _check_grads(out, (q, k, v), dout, lambda *x, **kw: attention_ref(*x, causal=causal, **kw))


def _repeatable_and_correct(run, inputs, dout, ref_fn):
    runs = [torch.autograd.grad(run(), inputs, dout) for _ in range(3)]
    for later in runs[1:]:
        for name, a, b in zip("qkv", runs[0], later):
            assert torch.equal(a, b), f"d{name} differs between deterministic runs"
    _check_grads(run(), inputs, dout, ref_fn)


# The ordered dQ's orders (csrc/sm90/bwd_cta.h; arrival order up to 16 key blocks, of 128 keys up to hd 128 and of 64
# above, descending beyond): arrival order with rotated walks (unmasked) and under a window, more key blocks than
# query blocks (ties at a step), more query blocks than key blocks (causal), the descending order under a window, and
# more key blocks per head than the GPU has SMs. test_deterministic_varlen: causal varlen with empty and ragged
# sequences. The wide buckets (192, 256) take these orders through kBwdDeterministicDqOrderedWide (on).
ORDER_CASES = {
    "window": dict(shape=(2, 700, 900), window=(100, 50)),
    "keys_past_queries": dict(shape=(2, 130, 2000)),
    "queries_past_keys": dict(shape=(1, 1500, 300), causal=True),
    "descending_window": dict(shape=(1, 600, 3000), window=(700, 300)),
    "more_key_blocks_than_sms": dict(shape=(1, 200, 128 * 140 + 5)),
}


@pytest.mark.parametrize("case", list(ORDER_CASES))
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_deterministic_orders(forced, case, head_dim):
    spec = ORDER_CASES[case]
    causal = spec.get("causal", False)
    window = spec.get("window", (-1, -1))
    _require(torch.bfloat16, head_dim, "local" if window != (-1, -1) else "causal" if causal else "none")
    batch, seqlen_q, seqlen_k = spec["shape"]
    q, k, v = _leaves((batch, seqlen_q, 4, head_dim), (batch, seqlen_k, 2, head_dim), (batch, seqlen_k, 2, head_dim))
    dout = randn(batch, seqlen_q, 4, head_dim, dtype=torch.bfloat16, device="cuda")
    kwargs = dict(causal=causal, window_size=window)
    _repeatable_and_correct(lambda: flash_attn_func(q, k, v, deterministic=True, **kwargs), (q, k, v), dout,
                            lambda *x, **kw: attention_ref(*x, **kwargs, **kw))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_deterministic_varlen(forced, head_dim):
    _require(torch.bfloat16, head_dim, "causal")
    seqlens_q, seqlens_k = [300, 0, 517, 64], [260, 40, 700, 1]
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, 4, 2, head_dim, torch.bfloat16, "cuda",
                                         requires_grad=True)
    dout = randn(*q.shape, dtype=torch.bfloat16, device="cuda")
    _repeatable_and_correct(
        lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True,
                                       deterministic=True),
        (q, k, v), dout,
        lambda *x, **kw: attention_varlen_ref(*x, cu_q.cpu(), cu_k.cpu(), causal=True, **kw)[:2])


# Fused dQ (csrc/sm90/bwd_ordered_dq.h, under FLASH_ATTN_BWD_FUSED_DQ=1): a query block's first adder stores its tiles
# into the fp32 accumulator (no zeroing pass; a sequence's last, partial box is added into rows the preprocess zeroed),
# its last adder loads the sum back and stores dq (no conversion pass), an only adder stores dq from its own tiles, and
# the preprocess writes dq = 0 in rows that see no key. Cases: arrival order with rotated walks, causal with more
# queries than keys (query blocks no key block walks), a window, the descending order (more than 16 key blocks), GQA
# on a grid large enough not to split its heads, fp16, deterministic, the switch's descending order on short calls,
# and varlen documents of several key blocks with empty ones, partial boxes and queries without keys. dq and the
# workspace start as NaN, so a row no one writes fails.
FUSED = "FLASH_ATTN_BWD_FUSED_DQ"
FUSED_CASES = {
    "none": dict(shape=(2, 700, 900)),
    "causal": dict(shape=(2, 700, 900), causal=True),
    "causal_long_q": dict(shape=(1, 1500, 300), causal=True),
    "window": dict(shape=(2, 640, 1000), window=(100, 50)),
    "descending": dict(shape=(1, 300, 128 * 20 + 7)),
    "descending_causal": dict(shape=(1, 2600, 128 * 20 + 7), causal=True),
    "gqa": dict(shape=(16, 300, 1100), heads=(8, 4)),
    "fp16": dict(shape=(2, 500, 600), causal=True, dtype=torch.float16),
    "deterministic": dict(shape=(2, 700, 900), causal=True, deterministic=True),
    "switch_descending": dict(shape=(2, 700, 900), causal=True, switch="descending"),
    "switch_descending_unmasked": dict(shape=(2, 300, 1000), switch="descending"),
}


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv(SWITCH, "force")
    monkeypatch.setenv(FUSED, "1")


def _no_dq_conversion(call):
    call()
    names = cuda_kernel_names(call)
    assert any("sm90::" in name for name in names), names
    assert not any("bwd_convert_dq_kernel" in name for name in names), names


@pytest.mark.parametrize("case", list(FUSED_CASES))
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_fused_dq(fused, monkeypatch, case, head_dim):
    spec = FUSED_CASES[case]
    if "switch" in spec:  # FLASH_ATTN_BWD_FUSED_DQ=descending: the adds in descending order at every length
        monkeypatch.setenv(FUSED, spec["switch"])
    causal, window = spec.get("causal", False), spec.get("window", (-1, -1))
    dtype = spec.get("dtype", torch.bfloat16)
    _require(dtype, head_dim, "local" if window != (-1, -1) else "causal" if causal else "none")
    batch, seqlen_q, seqlen_k = spec["shape"]
    h, hk = spec.get("heads", (4, 4))
    q, k, v = _leaves((batch, seqlen_q, h, head_dim), (batch, seqlen_k, hk, head_dim),
                      (batch, seqlen_k, hk, head_dim), dtype=dtype)
    dout = randn(batch, seqlen_q, h, head_dim, dtype=dtype, device="cuda")
    kwargs = dict(causal=causal, window_size=window)
    deterministic = spec.get("deterministic", False)

    def run():
        return flash_attn_func(q, k, v, deterministic=deterministic, **kwargs)

    def ref(*x, **kw):
        return attention_ref(*x, **kwargs, **kw)

    _poison_allocator(q, q, q, q)
    out = run()
    _no_dq_conversion(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    _poison_allocator(q, q, q, q)
    if deterministic:
        _repeatable_and_correct(run, (q, k, v), dout, ref)
    else:
        _check_grads(run(), (q, k, v), dout, ref)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_fused_dq_varlen(fused, causal, head_dim):
    _require(torch.bfloat16, head_dim, "causal" if causal else "none")
    seqlens_q = [257, 0, 31, 300, 129, 5, 200, 64, 1, 290, 17, 133]
    seqlens_k = [520, 9, 0, 290, 129, 77, 128, 255, 1, 300, 40, 517]
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, 8, 8, head_dim, torch.bfloat16, "cuda",
                                         requires_grad=True)
    dout = randn(*q.shape, dtype=torch.bfloat16, device="cuda")
    run = lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=causal)
    out = run()
    _no_dq_conversion(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    _poison_allocator(q, q, q, q)
    _check_grads(run(), (q, k, v), dout,
                 lambda *x, **kw: attention_varlen_ref(*x, cu_q.cpu(), cu_k.cpu(), causal=causal, **kw)[:2])


def test_fused_dq_switch_rejects_other_values(monkeypatch):
    _require(torch.bfloat16, 128)
    q, k, v = _leaves((1, 300, 2, 128), (1, 300, 2, 128), (1, 300, 2, 128))
    monkeypatch.setenv(SWITCH, "force")
    monkeypatch.setenv(FUSED, "yes")
    out = flash_attn_func(q, k, v)
    with pytest.raises((RuntimeError, ValueError), match=FUSED):
        torch.autograd.grad(out.sum(), (q, k, v))


# D = rowsum(dO o O) in the kernel (csrc/sm90/bwd_step_delta.h, under FLASH_ATTN_BWD_D_IN_KERNEL=1, calls of at most
# 8 key blocks at hd <= 128): with a gradient through the LSE as well (dlse enters D), on both sides of the threshold
# (100 keys: one key block, direct dQ; 300 and 700: D in the kernel; 2300: the preprocess's D), in the lean kernels
# alone, with fused dQ, deterministic, and in the general kernels (softcap + ALiBi); fp16; varlen with empty
# documents and rows past each document's end in the same tiles (their D must stay 0).
DELTA = "FLASH_ATTN_BWD_D_IN_KERNEL"
# The preprocess of calls whose kernel sums D: LSE and dlse only, a thread a row (csrc/sm80/bwd_preprocess_kernel.h).
DELTA_PREPROCESS = re.compile(r"bwd_preprocess_kernel<[^>]*, true>")
D_IN_KERNEL_MAX_KEYS = 8 * 128  # kBwdDInKernelMaxKeyBlocks key blocks of 128 keys (hd <= 128)
DELTA_VARIANTS = {
    "lean": {},
    "fused": dict(env={FUSED: "1"}),
    "deterministic": dict(deterministic=True),
    "softcap_alibi": dict(softcap=20.0, alibi=True),
    "fp16": dict(dtype=torch.float16),
}


@pytest.mark.parametrize("variant", list(DELTA_VARIANTS))
@pytest.mark.parametrize("seqlen_k", [100, 300, 700, 2300])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_delta_in_kernel(monkeypatch, variant, seqlen_k, head_dim):
    spec = DELTA_VARIANTS[variant]
    dtype = spec.get("dtype", torch.bfloat16)
    _require(dtype, head_dim, "causal")
    monkeypatch.setenv(SWITCH, "force")
    monkeypatch.setenv(DELTA, "1")
    for name, value in spec.get("env", {}).items():
        monkeypatch.setenv(name, value)
    batch, seqlen_q, h, hk = 2, 203, 8, 2
    q, k, v = _leaves((batch, seqlen_q, h, head_dim), (batch, seqlen_k, hk, head_dim), (batch, seqlen_k, hk, head_dim),
                      dtype=dtype)
    kwargs = dict(causal=True, softcap=spec.get("softcap", 0.0))
    if spec.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(batch, h, device="cuda") * 0.3
    dout = randn(batch, seqlen_q, h, head_dim, dtype=dtype, device="cuda")
    deterministic = spec.get("deterministic", False)
    window = (-1, 0)

    def run():
        out, lse, _ = attention(q, k, v, window=window, softcap=kwargs["softcap"],
                                alibi_slopes=kwargs.get("alibi_slopes"), deterministic=deterministic)
        return out, lse

    out, lse = run()
    dlse = randn(*lse.shape, dtype=torch.float32, device="cuda")
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    names = cuda_kernel_names(lambda: torch.autograd.grad(run(), (q, k, v), (dout, dlse)))
    assert any(DELTA_PREPROCESS.search(n) for n in names) == (seqlen_k <= D_IN_KERNEL_MAX_KEYS), names
    if deterministic:
        for _ in range(2):
            again = torch.autograd.grad(run(), (q, k, v), (dout, dlse))
            for name, a, b in zip("qkv", grads, again):
                assert torch.equal(a, b), f"d{name} differs between deterministic runs"

    def evaluate(compute_dtype):
        xs = [x.detach().to(compute_dtype).requires_grad_() for x in (q, k, v)]
        o, l = attention_ref(*xs, compute_dtype=compute_dtype, **kwargs)
        return torch.autograd.grad((o, l), xs, (dout.to(compute_dtype), dlse.to(l.dtype)))

    truth, naive = evaluate(torch.float64), evaluate(dtype)
    for name, g, gt, gn in zip("qkv", grads, truth, naive):
        try:
            assert_close_fa(g.cpu(), gt.cpu(), gn.cpu(), 3.0, floor_dtype=torch.float32)
        except AssertionError as error:
            raise AssertionError(f"d{name}: {error}") from None


@pytest.mark.parametrize("fused_dq", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_delta_in_kernel_varlen(monkeypatch, fused_dq, head_dim):
    _require(torch.bfloat16, head_dim, "causal")
    monkeypatch.setenv(SWITCH, "force")
    monkeypatch.setenv(DELTA, "1")
    monkeypatch.setenv(FUSED, "1" if fused_dq else "0")
    seqlens_q, seqlens_k = [257, 0, 31, 300, 129, 5, 64, 1, 290, 17], [520, 9, 0, 290, 129, 77, 255, 1, 300, 40]
    q, k, v, cu_q, cu_k = varlen_tensors(seqlens_q, seqlens_k, 4, 2, head_dim, torch.bfloat16, "cuda",
                                         requires_grad=True)
    dout = randn(*q.shape, dtype=torch.bfloat16, device="cuda")
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True)
    call = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    call()
    assert any(DELTA_PREPROCESS.search(n) for n in cuda_kernel_names(call))
    _check_grads(out, (q, k, v), dout,
                 lambda *x, **kw: attention_varlen_ref(*x, cu_q.cpu(), cu_k.cpu(), causal=True, **kw)[:2])


def test_first_backward_of_a_process(forced):
    """A fresh process's first backward calls run on torch's autograd device thread, whose first CUDA work is the
    Hopper backward's TMA map encoding: the driver's encoder needs the context bound there first
    (csrc/include/flash_attn/tensor_map_sm90.h encode_in_context). Without it the first calls failed with "could not
    make TMA tensor maps" (forty-ninth session)."""
    _require(torch.bfloat16, 64)
    code = (
        "import torch\n"
        "from flash_attn import flash_attn_func\n"
        "for sq, sk in ((17, 1), (17, 300), (200, 200)):\n"
        "    q, k, v = (torch.randn(2, n, 2, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
        "               for n in (sq, sk, sk))\n"
        "    out = flash_attn_func(q, k, v)\n"
        "    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))\n"
        "    assert all(torch.isfinite(g).all() for g in grads)\n"
        "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


# Backward calls the Hopper backward does not serve yet: feature (as its force error names it) -> flash_attn_func
# keyword arguments. The bias gradient (SDPA's attn_mask with requires_grad) is the one left.
FALLBACKS = {
    "bias": "attn_mask",
}


@pytest.mark.parametrize("feature", list(FALLBACKS))
def test_fallback_runs_and_force_names_the_feature(monkeypatch, feature):
    """An additive mask that requires grad: its forward is not served either, so force fails at the forward, naming
    the mask; under FLASH_ATTN_HOPPER=1 the portable kernels run both directions."""
    _require(torch.bfloat16, 128)
    q, k, v = (randn(2, 4, 200, 128, dtype=torch.bfloat16, device="cuda").requires_grad_() for _ in range(3))
    mask = randn(2, 4, 200, 200, dtype=torch.bfloat16, device="cuda").requires_grad_()
    monkeypatch.setenv(SWITCH, "1")
    out = flash_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v, mask))
    assert all(torch.isfinite(g).all() for g in grads)
    monkeypatch.setenv(SWITCH, "force")
    with pytest.raises(RuntimeError, match=f"{SWITCH}=force.*{FALLBACKS[feature]}"):
        flash_attn.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("causal,seqlen,hopper", [(False, 1024, True), (True, 1024, False), (True, 2048, True)])
def test_auto_takes_head_dim_32_where_it_pays(monkeypatch, causal, seqlen, hopper):
    """Under FLASH_ATTN_HOPPER=1 the hd 32 backward runs on the Hopper kernels unmasked and causal from 2k keys, shorter
    causal calls on the portable kernels (sm90_policy.cpp sm90_bwd_pays); the gradients pass either way."""
    mask = "causal" if causal else "none"
    _require(torch.bfloat16, 32, mask)
    if not any(k["arch"] == "sm80" and k["head_dim"] == 32 and k["mask"] == mask and k["dtype"] == "bf16"
               and k["direction"] == "bwd" for k in flash_attn.built_kernels() if k["device"] == "cuda"):
        pytest.skip("needs the portable bf16 hd 32 backward too (dispatch checks both paths)")
    q, k, v = _leaves((2, seqlen, 8, 32), (2, seqlen, 8, 32), (2, seqlen, 8, 32))
    dout = randn(2, seqlen, 8, 32, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setenv(SWITCH, "1")
    out = flash_attn_func(q, k, v, causal=causal)
    call = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    call()
    names = cuda_kernel_names(call)
    assert any("sm90::" in name for name in names) == hopper, names
    _check_grads(out, (q, k, v), dout, lambda *x, **kw: attention_ref(*x, causal=causal, **kw))
