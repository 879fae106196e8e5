# Builds the flash_attn extension: the C++ API layer and CPU implementation always; with nvcc present (and
# FLASH_ATTN_SKIP_CUDA unset) also the CUDA kernels that tools/kernel_matrix.py selects under the build knobs.
# Knobs: FLASH_ATTN_CUDA_ARCHS, FLASH_ATTN_HEAD_DIMS, FLASH_ATTN_DTYPES, FLASH_ATTN_MASKS,
# FLASH_ATTN_DIRECTIONS, FLASH_ATTN_SKIP_CUDA, MAX_JOBS (README "Build knobs").
import os
import pathlib
import platform
import re
import shutil
import sys
import time

from setuptools import find_packages, setup

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
import gen_kernels  # noqa: E402
import kernel_matrix  # noqa: E402

# The compiled module: top-level, so that a source checkout on sys.path still finds the installed build
# (flash_attn/_native.py loads it).
EXTENSION_NAME = "flash_attn_C"

# Peak resident memory of one compiler job: a C++ file with torch headers ~1.5 GB, a CUDA kernel TU ~3 GB.
GIB = 1 << 30
MEMORY_PER_CXX_JOB = int(1.5 * GIB)
MEMORY_PER_CUDA_JOB = 3 * GIB


def read_version() -> str:
    text = (ROOT / "flash_attn" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def available_memory() -> int:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GIB


def set_default_max_jobs(has_cuda_units: bool) -> None:
    """MAX_JOBS defaults to what free memory allows, so a build never exhausts RAM."""
    if "MAX_JOBS" in os.environ:
        return
    per_job = MEMORY_PER_CUDA_JOB if has_cuda_units else MEMORY_PER_CXX_JOB
    jobs = max(1, min(os.cpu_count() or 1, available_memory() // per_job))
    os.environ["MAX_JOBS"] = str(jobs)


def locate_cuda_home() -> None:
    """Sets CUDA_HOME to a toolkit that has its headers when it is unset: torch guesses it from the nvcc on
    PATH, which is wrong when that nvcc is a wrapper script outside the toolkit (as on our CI machines)."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    candidates = ([pathlib.Path(nvcc).resolve().parent.parent] if nvcc else []) + [pathlib.Path("/usr/local/cuda")]
    for home in candidates:
        if (home / "include" / "cuda_runtime_api.h").exists():
            os.environ["CUDA_HOME"] = str(home)
            return


def default_archs_from_visible_gpus() -> None:
    """Without FLASH_ATTN_CUDA_ARCHS, a build on a machine with a visible GPU compiles only for that GPU (SASS for
    its capability, or the portable path's PTX for a newer one): on the H200 about half the default build's time.
    Without a visible GPU the default (kernel_matrix.DEFAULT_CUDA_ARCHS) covers every supported GPU."""
    if kernel_matrix.ARCHS_KNOB in os.environ:
        return
    import torch

    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        capabilities = [torch.cuda.get_device_capability(i) for i in range(count)]
    except RuntimeError:
        return
    if not capabilities:
        return
    archs = kernel_matrix.visible_gpu_archs(capabilities)
    os.environ[kernel_matrix.ARCHS_KNOB] = archs
    print(f"flash_attn: {kernel_matrix.ARCHS_KNOB} unset; compiling for the visible GPU(s) "
          f"{sorted(set(capabilities))}: {kernel_matrix.ARCHS_KNOB}='{archs}' (set it to build for other GPUs)")


def want_cuda() -> bool:
    if os.environ.get("FLASH_ATTN_SKIP_CUDA", "0") not in ("", "0"):
        return False
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None


def extension_modules():
    locate_cuda_home()  # before torch.utils.cpp_extension reads CUDA_HOME at import
    import torch  # noqa: F401  (fails early with a clear message when torch is missing)
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    if want_cuda():
        default_archs_from_visible_gpus()
    cuda_units = gen_kernels.generate(ROOT) if want_cuda() else gen_kernels.generate(ROOT, {"FLASH_ATTN_CUDA_ARCHS": ""})
    set_default_max_jobs(bool(cuda_units))
    sources = sorted(str(p.relative_to(ROOT)) for folder in ("csrc/api", "csrc/dispatch", "csrc/cpu")
                     for p in (ROOT / folder).glob("*.cpp"))
    include_dirs = [str(ROOT / "csrc"), str(ROOT / "csrc" / "include")]
    openmp = [] if platform.system() == "Darwin" else ["-fopenmp"]
    cxx_flags = ["-O3", "-std=c++20", "-fno-math-errno", "-fno-trapping-math"] + openmp
    # The extension reports the version it was built from (stringised in C++: a quoted macro would not survive the
    # shell); flash_attn/_native.py refuses a mismatched build.
    version_macro = [("FLASH_ATTN_VERSION", read_version())]
    if not cuda_units:
        print(f"flash_attn: building the CPU implementation only ({'no CUDA kernel selected' if want_cuda() else 'no nvcc/CUDA torch or FLASH_ATTN_SKIP_CUDA set'})")
        return [CppExtension(EXTENSION_NAME, sources, include_dirs=include_dirs, define_macros=version_macro,
                             extra_compile_args={"cxx": cxx_flags}, extra_link_args=openmp)]
    nvcc_flags = ["-O3", "-std=c++20", "--use_fast_math", "--expt-relaxed-constexpr", "-lineinfo"]
    nvcc_flags += kernel_matrix.gencode_flags()
    print(f"flash_attn: building {len(cuda_units)} CUDA kernels with MAX_JOBS={os.environ['MAX_JOBS']}")
    sources += [str(path.relative_to(ROOT)) for _, path in cuda_units]
    # Hand-written CUDA units outside the kernel table (helpers every table kernel shares, test kernels).
    sources += sorted(str(p.relative_to(ROOT)) for folder in ("csrc/dispatch", "csrc/sm80", "csrc/sm90")
                      for p in (ROOT / folder).glob("*.cu"))
    return [CUDAExtension(EXTENSION_NAME, sources, include_dirs=include_dirs,
                          define_macros=[("FLASH_WITH_CUDA", "1")] + version_macro,
                          extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, extra_link_args=openmp)]


def compile_through_cache() -> None:
    """With COMPILE_CACHE_DIR set (tools/ab_bench.sh's variant builds share objects), the ninja compile rules run
    through tools/compile_cache.py: nvcc by PYTORCH_NVCC, the C++ compiler by standing in for torch's choice (CXX would
    change the linker setuptools runs too). COMPILE_CACHE_CXX keeps the real compiler."""
    if not os.environ.get("COMPILE_CACHE_DIR"):
        return
    from torch.utils import cpp_extension

    os.environ.setdefault("COMPILE_CACHE_ROOT", str(ROOT))
    os.environ.setdefault("COMPILE_CACHE_CXX", cpp_extension.get_cxx_compiler())
    os.environ.setdefault("PYTORCH_NVCC", f"{sys.executable} {ROOT / 'tools' / 'compile_cache.py'}")
    wrapper = str(ROOT / "tools" / "cxx_cache.sh")
    cpp_extension.get_cxx_compiler = lambda: wrapper


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    compile_through_cache()

    class TimedBuildExtension(BuildExtension):
        def run(self):
            start = time.time()
            super().run()
            print(f"flash_attn: extension built in {time.time() - start:.1f} s")

    return TimedBuildExtension.with_options(use_ninja=True)


setup(
    name="flash_attn",
    version=read_version(),
    description="Exact FlashAttention for PyTorch (CPU and CUDA), drop-in for flash_attn 2.x and torch SDPA",
    license="BSD-3-Clause",
    packages=find_packages(include=["flash_attn", "flash_attn.*"]),
    python_requires=">=3.9",
    install_requires=["torch"],
    ext_modules=extension_modules(),
    cmdclass={"build_ext": build_ext_class()},
    zip_safe=False,
)
