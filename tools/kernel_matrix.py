# The one table of compiled attention kernels: archs x dtypes x head-dim buckets x mask kinds x directions.
# setup.py reads it (through selected_kernels) to generate the CUDA translation units and the C++ dispatch
# table; flash_attn.built_kernels() reports what the compiled extension registered from it. Nothing else
# keeps a list of kernels.
from __future__ import annotations

import dataclasses
import os

# Head-dim buckets of the CUDA kernels: a call's head dim is rounded up to the next bucket (the kernel pads).
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
DTYPES = ("fp16", "bf16")
MASKS = ("none", "causal", "local")
DIRECTIONS = ("fwd", "bwd")
# arch name -> (compute capability for -gencode, directory of its hand-written code)
ARCHS = {
    "sm80": ("80", "csrc/sm80"),
    "sm90": ("90a", "csrc/sm90"),
}
DEFAULT_CUDA_ARCHS = "80;90"

# (arch, direction) -> header that defines the launch template for that pair. A pair appears here only
# once its kernel exists; until then a CUDA call fails with a message naming what is missing.
KERNEL_SOURCES: dict[tuple[str, str], str] = {}

# The CPU implementation is one generic code path (csrc/cpu/), built always, for these dtypes and head dims.
CPU_DTYPES = ("fp16", "bf16", "fp32", "fp64")
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    arch: str
    dtype: str
    head_dim: int
    mask: str
    direction: str

    @property
    def name(self) -> str:
        return f"{self.direction}_{self.arch}_{self.dtype}_hd{self.head_dim}_{self.mask}"


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.replace(",", ";").split(";") if item.strip()]


def _parse_archs(value: str) -> list[str]:
    archs = []
    for item in _split(value):
        name = "sm" + item.lower().removeprefix("sm").removesuffix("a")
        if name not in ARCHS:
            raise ValueError(
                f"FLASH_ATTN_CUDA_ARCHS: unknown arch {item!r}; choose from "
                f"{';'.join(a.removeprefix('sm') for a in ARCHS)} (e.g. FLASH_ATTN_CUDA_ARCHS='80;90')")
        archs.append(name)
    return archs


def _parse_choice(knob: str, value: str, allowed: tuple, convert=str) -> list:
    chosen = []
    for item in _split(value):
        try:
            converted = convert(item)
        except ValueError:
            converted = None
        if converted not in allowed:
            raise ValueError(f"{knob}: {item!r} is not one of {', '.join(map(str, allowed))}")
        chosen.append(converted)
    return chosen


def selected_kernels(environ=os.environ) -> list[KernelSpec]:
    """The kernels this build compiles, after the build knobs:
    FLASH_ATTN_CUDA_ARCHS ('80;90'), FLASH_ATTN_HEAD_DIMS ('64;128'), FLASH_ATTN_DTYPES ('bf16'),
    FLASH_ATTN_MASKS ('none;causal'), FLASH_ATTN_DIRECTIONS ('fwd')."""
    archs = _parse_archs(environ.get("FLASH_ATTN_CUDA_ARCHS", DEFAULT_CUDA_ARCHS))
    head_dims = _parse_choice("FLASH_ATTN_HEAD_DIMS", environ.get("FLASH_ATTN_HEAD_DIMS", ""),
                              HEAD_DIM_BUCKETS, int) or list(HEAD_DIM_BUCKETS)
    dtypes = _parse_choice("FLASH_ATTN_DTYPES", environ.get("FLASH_ATTN_DTYPES", ""), DTYPES) or list(DTYPES)
    masks = _parse_choice("FLASH_ATTN_MASKS", environ.get("FLASH_ATTN_MASKS", ""), MASKS) or list(MASKS)
    directions = _parse_choice("FLASH_ATTN_DIRECTIONS", environ.get("FLASH_ATTN_DIRECTIONS", ""),
                               DIRECTIONS) or list(DIRECTIONS)
    return [
        KernelSpec(arch, dtype, head_dim, mask, direction)
        for arch in archs for direction in directions if (arch, direction) in KERNEL_SOURCES
        for dtype in dtypes for head_dim in head_dims for mask in masks
    ]
