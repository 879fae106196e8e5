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
# Capabilities FLASH_ATTN_CUDA_ARCHS may name. `NN` compiles SASS for sm_NN; `compute_NN` embeds PTX only, which the
# driver compiles at first use for any GPU of capability NN or newer (sm_100, sm_120: the portable path's PTX);
# `NN+PTX` does both. The default embeds compute_80 PTX beside the SASS so GPUs newer than the SASS get a kernel.
KNOWN_CAPABILITIES = (80, 86, 89, 90)
DEFAULT_CUDA_ARCHS = "80+PTX;90"
ARCHS_KNOB = "FLASH_ATTN_CUDA_ARCHS"


# (arch, direction) -> header that defines the launch template for that pair. A pair appears here only
# once its kernel exists; until then a CUDA call fails with a message naming what is missing.
KERNEL_SOURCES: dict[tuple[str, str], str] = {
    ("sm80", "fwd"): "csrc/sm80/fwd_launch.h",
    ("sm80", "bwd"): "csrc/sm80/bwd_launch.h",
    ("sm90", "fwd"): "csrc/sm90/fwd_launch.h",
    ("sm90", "bwd"): "csrc/sm90/bwd_launch.h",
}
# Head-dim buckets an (arch, direction) pair compiles where it is not all of HEAD_DIM_BUCKETS. The Hopper kernels
# move whole 64-column TMA segments and read MN-major operands as 64-column blocks: a bucket that is no multiple of 64
# stores the next multiple's columns and runs its score GEMMs over its own (csrc/sm90/fwd_tile_config.h
# fwd_storage_dim); the backward's buckets above 128 run its wide kernel, S^T / dP^T over their own columns
# (csrc/sm90/bwd_tile_config.h). Since the forty-fifth session the Hopper kernels exist for every bucket.
PAIR_HEAD_DIMS: dict[tuple[str, str], tuple[int, ...]] = {
    ("sm90", "fwd"): (32, 64, 96, 128, 160, 192, 224, 256),
    ("sm90", "bwd"): (32, 64, 96, 128, 160, 192, 224, 256),
}
# Capabilities whose SASS and PTX are compiled for the architecture-specific feature set ("sm_90a"): wgmma and
# setmaxnreg exist only there. Code for sm_90a runs on sm_90 GPUs only, which is every GPU the sm90 path serves.
ARCH_SPECIFIC = {90: "a"}

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


@dataclasses.dataclass(frozen=True)
class ArchTarget:
    """One compute capability and what to embed for it: SASS, PTX or both."""

    capability: int
    sass: bool
    ptx: bool


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.replace(",", ";").split(";") if item.strip()]


def _capability(item: str, text: str) -> int:
    digits = text.lower().removeprefix("sm").removeprefix("_").removesuffix("a").replace(".", "")
    if not digits.isdigit() or int(digits) not in KNOWN_CAPABILITIES:
        raise ValueError(
            f"{ARCHS_KNOB}: unknown arch {item!r}; use a capability from {';'.join(map(str, KNOWN_CAPABILITIES))} "
            f"for SASS, compute_NN for PTX only, or NN+PTX for both (e.g. {ARCHS_KNOB}='{DEFAULT_CUDA_ARCHS}')")
    return int(digits)


def parse_arch_targets(value: str) -> list[ArchTarget]:
    """FLASH_ATTN_CUDA_ARCHS ('80+PTX;90', 'sm_90', '9.0', 'compute_80') -> targets sorted by capability."""
    sass: set[int] = set()
    ptx: set[int] = set()
    for item in _split(value):
        text = item.strip()
        if text.lower().startswith("compute_"):
            ptx.add(_capability(item, text[len("compute_"):]))
        elif text.upper().endswith("+PTX"):
            cap = _capability(item, text[:-len("+PTX")])
            sass.add(cap)
            ptx.add(cap)
        else:
            sass.add(_capability(item, text))
    return [ArchTarget(cap, cap in sass, cap in ptx) for cap in sorted(sass | ptx)]


def parse_capabilities(value: str) -> list[int]:
    """The compute capabilities FLASH_ATTN_CUDA_ARCHS compiles for (SASS or PTX), sorted."""
    return [target.capability for target in parse_arch_targets(value)]


def gencode_flags(environ=os.environ) -> list[str]:
    """nvcc -gencode flags: SASS and/or PTX per requested capability (one flag each: no brackets, which a shell
    could glob)."""
    flags = []
    for target in parse_arch_targets(environ.get(ARCHS_KNOB, DEFAULT_CUDA_ARCHS)):
        arch = f"{target.capability}{ARCH_SPECIFIC.get(target.capability, '')}"
        codes = ([f"sm_{arch}"] if target.sass else []) + ([f"compute_{arch}"] if target.ptx else [])
        flags += [f"-gencode=arch=compute_{arch},code={code}" for code in codes]
    return flags


def visible_gpu_archs(capabilities: list[tuple[int, int]]) -> str:
    """The FLASH_ATTN_CUDA_ARCHS value for the GPUs visible at build time: SASS for each known capability, the
    portable path's PTX for newer ones (e.g. sm_100, sm_120); '' when none is sm80 or newer."""
    items = []
    oldest = min(KNOWN_CAPABILITIES)
    for major, minor in sorted(set(capabilities)):
        cap = major * 10 + minor
        if cap in KNOWN_CAPABILITIES:
            items.append(str(cap))
        elif cap > oldest:
            items.append(f"compute_{oldest}")
    return ";".join(dict.fromkeys(items))


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
    FLASH_ATTN_CUDA_ARCHS ('80+PTX;90'), FLASH_ATTN_HEAD_DIMS ('64;128'), FLASH_ATTN_DTYPES ('bf16'),
    FLASH_ATTN_MASKS ('none;causal'), FLASH_ATTN_DIRECTIONS ('fwd')."""
    caps = set(parse_capabilities(environ.get(ARCHS_KNOB, DEFAULT_CUDA_ARCHS)))
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
        for dtype in dtypes for head_dim in head_dims
        if head_dim in PAIR_HEAD_DIMS.get((arch, direction), HEAD_DIM_BUCKETS)
        for mask in masks
    ]
