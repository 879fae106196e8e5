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
# Code paths -> the compute capabilities each runs on. The portable sm80 path also serves later GPUs
# (and is the Hopper fallback); the sm90 path uses Hopper-only instructions.
ARCH_PATHS = {
    "sm80": (80, 86, 89, 90),
    "sm90": (90,),
}
# Capabilities FLASH_ATTN_CUDA_ARCHS may name (each compiled to its own SASS).
KNOWN_CAPABILITIES = (80, 86, 89, 90)
DEFAULT_CUDA_ARCHS = "80;90"

# (arch, direction) -> header that defines the launch template for that pair. A pair appears here only
# once its kernel exists; until then a CUDA call fails with a message naming what is missing.
KERNEL_SOURCES: dict[tuple[str, str], str] = {
    ("sm80", "fwd"): "csrc/sm80/fwd_launch.h",
    ("sm80", "bwd"): "csrc/sm80/bwd_launch.h",
}

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


def parse_capabilities(value: str) -> list[int]:
    """FLASH_ATTN_CUDA_ARCHS ('80;90', 'sm_90', '9.0') -> sorted compute capabilities."""
    caps = set()
    for item in _split(value):
        digits = item.lower().removeprefix("sm").removeprefix("_").removesuffix("a").replace(".", "")
        if not digits.isdigit() or int(digits) not in KNOWN_CAPABILITIES:
            raise ValueError(
                f"FLASH_ATTN_CUDA_ARCHS: unknown arch {item!r}; choose from "
                f"{';'.join(map(str, KNOWN_CAPABILITIES))} (e.g. FLASH_ATTN_CUDA_ARCHS='80;90')")
        caps.add(int(digits))
    return sorted(caps)


def gencode_flags(environ=os.environ) -> list[str]:
    """nvcc -gencode flags: SASS for every requested capability."""
    caps = parse_capabilities(environ.get("FLASH_ATTN_CUDA_ARCHS", DEFAULT_CUDA_ARCHS))
    return [f"-gencode=arch=compute_{cap},code=sm_{cap}" for cap in caps]


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
    caps = set(parse_capabilities(environ.get("FLASH_ATTN_CUDA_ARCHS", DEFAULT_CUDA_ARCHS)))
    archs = [path for path, runs_on in ARCH_PATHS.items() if caps & set(runs_on)]
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
