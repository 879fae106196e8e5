# Shared pytest fixtures: a fresh seed for every test and the `device` parametrisation
# ("cpu" always; "cuda" collected only when torch sees a GPU and flash_attn.is_supported reports a
# built kernel for it). Per-case dtype/head-dim support is checked by helpers.require_supported.
import random

import pytest
import torch

import flash_attn
from helpers import DTYPES


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
