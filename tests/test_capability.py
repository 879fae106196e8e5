# Tests of the capability query: flash_attn.is_supported(device, dtype, head_dim) for the CPU path
# (float16/bfloat16/float32/float64, head dims 1..256, torch.device or string) and consistency of
# flash_attn.built_kernels() with what is reported for CUDA.
import pytest
import torch

import flash_attn
from helpers import DTYPES


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_supports_float_dtypes_and_head_dims(dtype, device):
    for head_dim in (1, 8, 33, 64, 128, 200, 256):
        assert flash_attn.is_supported(device, dtype, head_dim) is True


@pytest.mark.parametrize("head_dim", [0, 257, 512])
def test_cpu_rejects_head_dims_out_of_range(head_dim):
    assert flash_attn.is_supported("cpu", torch.float32, head_dim) is False


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_cpu_rejects_non_float_dtypes(dtype):
    assert flash_attn.is_supported("cpu", dtype, 64) is False


def test_built_kernels_is_list_of_dicts():
    kernels = flash_attn.built_kernels()
    assert isinstance(kernels, list)
    assert all(isinstance(entry, dict) for entry in kernels)


def test_cuda_unsupported_without_built_cuda_kernels():
    kernels = flash_attn.built_kernels()
    if not all("device" in entry for entry in kernels):
        pytest.skip("built_kernels() entries do not name their device")
    if any(str(entry["device"]).startswith("cuda") for entry in kernels):
        pytest.skip("CUDA kernels are built")
    for dtype in DTYPES:
        for head_dim in (64, 128, 256):
            assert flash_attn.is_supported("cuda", dtype, head_dim) is False
            assert flash_attn.is_supported(torch.device("cuda", 0), dtype, head_dim) is False
