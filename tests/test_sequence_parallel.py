# Sequence-parallel engines on this package, unchanged: yunchang (pinned in .ci/run) with attn_type=AttnType.FA calls
# flash_attn.flash_attn_interface's _flash_attn_forward / _flash_attn_backward per key block and merges the blocks by
# their LSE. Ring (basic and zigzag), Ulysses and the hybrid LongContextAttention run in 2 and 4 processes on the gloo
# backend with CPU tensors in bf16 and fp16, causal and not, GQA; forward and backward of each rank's shard are
# checked against single-process attention with the FA rule (fp64 ground truth, the same naive attention in the
# low precision as the yardstick). On a GPU the same engines run in one process (world size 1, NCCL) on CUDA
# tensors; the README's example (tools/sequence_parallel_example.py) runs under torchrun, and so does the multi-GPU
# benchmark (benchmarks/bench_sequence_parallel.py) on CPU tensors. Not fp32: yunchang's basic ring converts its dq
# buffer with .to(torch.float32), which aliases the buffer when it is fp32 already, so its fp32 backward
# double-counts.
import functools
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flash_attn
from flash_attn.reference import attention_ref
from helpers import assert_close_fa, load_module, randn, reference_pair

ROOT = pathlib.Path(__file__).resolve().parent.parent

yunchang = pytest.importorskip("yunchang")

WORLD_SIZES = (2, 4)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 8, 4, 32
ROWS_PER_CHUNK = 8  # zigzag cuts the sequence into 2 x ring-degree chunks
# name -> (ulysses degree, ring degree) as functions of the world size, and the ring implementation. Zigzag rings
# balance causal work and refuse non-causal calls, so they run causal only.
ENGINES = {
    "ring_basic": (lambda ws: 1, lambda ws: ws, "basic"),
    "ring_zigzag": (lambda ws: 1, lambda ws: ws, "zigzag"),
    "ulysses": (lambda ws: ws, lambda ws: 1, "basic"),
    "hybrid_basic": (lambda ws: 2 if ws >= 4 else 1, lambda ws: ws // 2 if ws >= 4 else ws, "basic"),
    "hybrid_zigzag": (lambda ws: 2 if ws >= 4 else 1, lambda ws: ws // 2 if ws >= 4 else ws, "zigzag"),
}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attention(engine, world_size, q, k, v, causal):
    """One engine's attention over this rank's shards, through its public entry point."""
    from yunchang import LongContextAttention, UlyssesAttention
    from yunchang.kernels import AttnType
    from yunchang.ring import ring_flash_attn_func, zigzag_ring_flash_attn_func

    kwargs = dict(dropout_p=0.0, causal=causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  deterministic=False, return_attn_probs=False)
    if engine == "ring_basic":
        return ring_flash_attn_func(q, k, v, attn_type=AttnType.FA, **kwargs)
    if engine == "ring_zigzag":
        return zigzag_ring_flash_attn_func(q, k, v, attn_type=AttnType.FA, **kwargs)
    if engine == "ulysses":
        return UlyssesAttention(attn_type=AttnType.FA)(q, k, v, **kwargs)
    ring_impl = ENGINES[engine][2]
    return LongContextAttention(ring_impl_type=ring_impl, attn_type=AttnType.FA)(q, k, v, **kwargs)


def _check_engine(engine, rank, world_size, dtype, causal, device):
    from yunchang import EXTRACT_FUNC_DICT, set_seq_parallel_pg

    ulysses_degree, ring_degree = ENGINES[engine][0](world_size), ENGINES[engine][1](world_size)
    set_seq_parallel_pg(ulysses_degree, ring_degree, rank, world_size)
    extract = functools.partial(EXTRACT_FUNC_DICT[ENGINES[engine][2]], rank=rank, world_size=world_size,
                                rd=ring_degree, ud=ulysses_degree)
    seqlen = 2 * ROWS_PER_CHUNK * world_size
    torch.manual_seed(0)  # every rank draws the same global tensors
    q = randn(BATCH, seqlen, HEADS, HEAD_DIM, dtype=dtype, device=device)
    k = randn(BATCH, seqlen, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v = randn(BATCH, seqlen, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    dout = randn(BATCH, seqlen, HEADS, HEAD_DIM, dtype=dtype, device=device)
    local = [extract(t).detach().clone().requires_grad_() for t in (q, k, v)]
    out = _attention(engine, world_size, *local, causal=causal)
    grads = torch.autograd.grad(out, local, extract(dout))
    truth, naive = reference_pair(functools.partial(attention_ref, causal=causal),
                                  tuple(t.cpu() for t in (q, k, v)), dout.cpu())
    grads = [g.cpu() for g in grads]
    out = out.cpu()
    checks = [("out", out, truth[0], naive[0], 2)] + [
        (f"d{name}", g, gt, gn, 3) for name, g, gt, gn in zip("qkv", grads, truth[2], naive[2])]
    for name, ours, exact, low, mult in checks:
        try:
            assert_close_fa(ours, extract(exact), extract(low), mult)
        except AssertionError as error:
            raise AssertionError(f"{engine} rank {rank}/{world_size} {dtype} causal={causal} {name}: {error}") from None


def _worker(rank, world_size, port, engine, device):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for dtype in DTYPES.values():
            for causal in (True,) if ENGINES[engine][2] == "zigzag" else (False, True):
                _check_engine(engine, rank, world_size, dtype, causal, device)
        dist.barrier()  # no rank tears the groups down while another still communicates
    finally:
        _release_yunchang_groups()
        dist.destroy_process_group()


def _release_yunchang_groups():
    """yunchang keeps its groups in module globals; left for interpreter exit, their gloo threads can abort the
    process (tools/sequence_parallel_example.py, teardown comment). Drop them so destroy_process_group ends them."""
    import gc

    from yunchang.globals import PROCESS_GROUP

    PROCESS_GROUP.ULYSSES_PG = PROCESS_GROUP.RING_PG = None
    gc.collect()


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_yunchang_engine_matches_single_process(world_size, engine):
    mp.spawn(_worker, args=(world_size, _free_port(), engine, "cpu"), nprocs=world_size, join=True)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_yunchang_engine_on_cuda_world_size_1(engine):
    """The same engine calls on CUDA tensors in one process: every block goes through our CUDA kernels."""
    if not (torch.cuda.is_available() and flash_attn.is_supported("cuda", torch.bfloat16, HEAD_DIM)
            and flash_attn.is_supported("cuda", torch.float16, HEAD_DIM)):
        pytest.skip("needs a GPU with bf16 and fp16 CUDA kernels for head dim 32")
    mp.spawn(_worker, args=(1, _free_port(), engine, "cuda"), nprocs=1, join=True)


@pytest.mark.slow
def test_readme_example_runs():
    """README, "Long context across GPUs": the example under torchrun, 2 processes (gloo on CPU here)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # the checkout first
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
               str(_free_port()), str(ROOT / "tools" / "sequence_parallel_example.py"), "--seqlen", "256"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = [float(x) for x in re.findall(r"(?:out|dq|dk|dv) ([0-9.e+-]+)", result.stdout)]
    assert len(errors) == 4 and max(errors) < 5e-2, result.stdout


# benchmarks/bench_sequence_parallel.py, the multi-GPU benchmark (tokens/s, scaling efficiency, peak memory): its whole
# path on CPU tensors under gloo, a torchrun per GPU count and engine, with the FA-rule check of each engine; then the
# parts that only matter on GPUs (a run that dies part-way, the efficiency's baseline) on made-up records.
@pytest.fixture(scope="module")
def bench_seqpar():
    return load_module("benchmarks/bench_sequence_parallel.py")


@pytest.mark.slow
def test_benchmark_runs_on_cpu(tmp_path):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "seqpar.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_sequence_parallel.py"), "--cpu", "--gpus", "1,2",
               "--seqlens", "256,128", "--heads", "4", "--check-seqlen", "128", "--check-heads", "4", "--iters", "1",
               "--json", str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    timed = {(r["engine"], r["gpus"], r["seqlen"]): r for r in data["records"] if r["kind"] == "time"}
    assert set(timed) == {(e, g, s) for e, g in (("single", 1), ("ring", 2), ("ulysses", 2)) for s in (128, 256)}
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in timed.values()), timed
    checks = [r for r in data["records"] if r["kind"] == "check"]
    assert sorted(r["engine"] for r in checks) == ["ring", "single", "ulysses"]
    assert all(row["ok"] for r in checks for row in r["rows"]), checks
    assert {(e["engine"], e["gpus"], e["seqlen"]) for e in data["scaling"]} == {("ring", 2, 256), ("ulysses", 2, 256)}
    assert "scaling efficiency, ring on 2 GPUs at 256 tokens" in result.stdout


def test_benchmark_scaling_and_failed_runs(bench_seqpar):
    ok = lambda engine, gpus, seqlen, tps: {"kind": "time", "engine": engine, "gpus": gpus, "seqlen": seqlen,  # noqa
                                              "status": "ok", "ms": 1.0, "tokens_per_s": tps, "tflops_per_gpu": 1.0,
                                              "peak_gib_per_gpu": 1.0}
    records = [ok("single", 1, 1000, 100.0), ok("single", 1, 2000, 50.0),
               {"kind": "time", "engine": "single", "gpus": 1, "seqlen": 4000, "status": "not run: ..."},
               ok("ring", 2, 2000, 80.0), ok("ring", 2, 4000, 40.0), ok("ulysses", 4, 2000, 150.0)]
    # The baseline is the longest length one GPU ran (2000), not the longest asked for.
    assert bench_seqpar.scaling(records) == [
        {"engine": "ring", "gpus": 2, "seqlen": 2000, "efficiency": 0.8},
        {"engine": "ulysses", "gpus": 4, "seqlen": 2000, "efficiency": 0.75}]
    table = bench_seqpar.summary(records, bench_seqpar.scaling(records))
    assert "| single | 1 | 4,000 | not run: ... |" in table
    assert bench_seqpar.scaling([r for r in records if r["gpus"] > 1]) == []


def test_benchmark_check_fails_wrong_results(bench_seqpar):
    truth = torch.linspace(-1, 1, 64, dtype=torch.float64)
    naive = truth.to(torch.bfloat16)
    error, bound = bench_seqpar.fa_rule_errors(naive, truth, naive, 2.0, torch.bfloat16)
    assert error <= bound
    error, bound = bench_seqpar.fa_rule_errors(naive + 0.1, truth, naive, 2.0, torch.bfloat16)
    assert error > bound
    poisoned = naive.clone()
    poisoned[3] = float("nan")
    error, bound = bench_seqpar.fa_rule_errors(poisoned, truth, naive, 2.0, torch.bfloat16)
    assert error > bound

