# Shared pytest fixtures: a fresh seed for every test and the `device` parametrisation
# ("cpu" always; "cuda" collected only when torch sees a GPU and flash_attn.is_supported reports a
# built kernel for it). Per-case dtype/head-dim support is checked by helpers.require_supported.
import os
import random

import pytest
import torch

import flash_attn
from helpers import DTYPES

# Under pytest-xdist every worker would otherwise run one torch thread per core over the CPU references: 8 workers on
# the H200 machine's 16 cores made 128 threads, and one varlen reference's einsum took over 60 s there (fiftieth
# session). Each worker takes its share of the cores, unless OMP_NUM_THREADS already says how many.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _XDIST_WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))


def _cuda_has_kernels():
    if not torch.cuda.is_available():
        return False
    return any(flash_attn.is_supported("cuda", dtype, d) for dtype in DTYPES for d in (32, 64, 128, 256))


DEVICES = ["cpu"] + (["cuda"] if _cuda_has_kernels() else [])


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)
    random.seed(0)
    yield


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def portable_kernels(monkeypatch):
    """For tests of the portable (sm80) path's own choices (tiles, kernels, shared-memory knobs): the Hopper kernels
    would otherwise take their calls on an H200 (FLASH_ATTN_HOPPER is read at every call)."""
    monkeypatch.setenv("FLASH_ATTN_HOPPER", "0")
