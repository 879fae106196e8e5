# benchmarks/bench_attention.py's kernel check for builds narrowed with FLASH_ATTN_MASKS: a call runs where the build
# has its dtype, head-dim bucket and mask kind in each direction it needs, whatever the other mask kinds.
import pytest
import torch

from helpers import load_module


@pytest.fixture(scope="module")
def bench():
    return load_module("benchmarks/bench_attention.py")


class NarrowBuild:
    """A build of bf16 hd 128 kernels with the none and causal masks, the forward only for causal."""

    @staticmethod
    def built_kernels():
        rows = [("none", "fwd"), ("none", "bwd"), ("causal", "fwd")]
        return [{"device": "cuda", "arch": "sm90", "dtype": "bf16", "head_dim": 128, "mask": m, "direction": d}
                for m, d in rows] + [{"device": "cpu", "arch": None, "dtype": "bf16", "head_dim": (1, 256),
                                      "mask": "any", "direction": "fwd"}]


def problem(bench, headdim=128, causal=False, feature="none", dtype=torch.bfloat16):
    return bench.Problem("cuda", dtype, 2, 4, 4, 256, 256, headdim, causal, feature)


def test_runs_the_mask_kinds_it_has(bench):
    assert bench.kernels_built_for(NarrowBuild, problem(bench), backward=True)
    assert bench.kernels_built_for(NarrowBuild, problem(bench, headdim=100), backward=True)  # bucket 128
    assert bench.kernels_built_for(NarrowBuild, problem(bench, causal=True), backward=False)


def test_refuses_what_it_lacks(bench):
    assert not bench.kernels_built_for(NarrowBuild, problem(bench, causal=True), backward=True)
    assert not bench.kernels_built_for(NarrowBuild, problem(bench, feature="window"), backward=False)
    assert not bench.kernels_built_for(NarrowBuild, problem(bench, headdim=64), backward=False)
    assert not bench.kernels_built_for(NarrowBuild, problem(bench, dtype=torch.float16), backward=False)
