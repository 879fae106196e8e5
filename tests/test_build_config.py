# The build's arch selection (tools/kernel_matrix.py) and the extension loader (flash_attn/_native.py), without a GPU:
# FLASH_ATTN_CUDA_ARCHS entries become SASS / PTX -gencode flags, the default embeds compute_80 PTX for GPUs newer
# than the SASS, a visible GPU narrows the default to its own arch; a source tree without (or with a mismatched)
# compiled extension raises an ImportError that says what to run; generated kernel units independent of the kernel set.
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import kernel_matrix  # noqa: E402


def _flags(archs):
    return kernel_matrix.gencode_flags({kernel_matrix.ARCHS_KNOB: archs})


def test_default_archs_embed_portable_ptx():
    flags = kernel_matrix.gencode_flags({})
    assert "-gencode=arch=compute_80,code=sm_80" in flags
    assert "-gencode=arch=compute_80,code=compute_80" in flags
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags  # wgmma / setmaxnreg exist only in sm_90a code
    assert not any("[" in flag for flag in flags)  # nothing a shell could glob


@pytest.mark.parametrize("archs, expected", [
    ("90", ["-gencode=arch=compute_90a,code=sm_90a"]),
    ("sm_90a", ["-gencode=arch=compute_90a,code=sm_90a"]),
    ("90+PTX", ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90a,code=compute_90a"]),
    ("8.6", ["-gencode=arch=compute_86,code=sm_86"]),
    ("compute_80", ["-gencode=arch=compute_80,code=compute_80"]),
    ("80+PTX", ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_80,code=compute_80"]),
    ("90;compute_80", ["-gencode=arch=compute_80,code=compute_80", "-gencode=arch=compute_90a,code=sm_90a"]),
])
def test_arch_entries(archs, expected):
    assert _flags(archs) == expected


def test_ptx_only_build_selects_the_portable_kernels():
    environ = {kernel_matrix.ARCHS_KNOB: "compute_80", "FLASH_ATTN_HEAD_DIMS": "64", "FLASH_ATTN_DTYPES": "bf16"}
    specs = kernel_matrix.selected_kernels(environ)
    assert specs and {spec.arch for spec in specs} == {"sm80"}


def test_hopper_kernels_take_the_whole_segment_buckets():
    """The sm90 forward and backward are compiled for the head-dim buckets that are whole 64-column TMA segments (the
    backward's buckets above 128 all run its wide kernel), and for 32, 96, 160 and 224 too (stored in whole
    segments); every bucket keeps its portable kernels (the fallback)."""
    specs = kernel_matrix.selected_kernels({kernel_matrix.ARCHS_KNOB: "90", "FLASH_ATTN_DTYPES": "bf16",
                                            "FLASH_ATTN_MASKS": "none"})
    hopper = {(spec.direction, spec.head_dim) for spec in specs if spec.arch == "sm90"}
    assert hopper == {(direction, head_dim) for direction in ("fwd", "bwd")
                      for head_dim in (32, 64, 96, 128, 160, 192, 224, 256)}
    portable = {spec.head_dim for spec in specs if spec.arch == "sm80" and spec.direction == "fwd"}
    assert portable == set(kernel_matrix.HEAD_DIM_BUCKETS)


def test_generated_units_do_not_depend_on_the_kernel_set(tmp_path):
    """A generated kernel unit is the same text whatever else the build knobs select, and does not include the kernel
    table (which lists the whole set): changing FLASH_ATTN_HEAD_DIMS recompiles only the units it adds and the two
    files that include the table, and tools/ab_bench.sh's narrowed variants reuse the first variant's objects."""
    import gen_kernels
    knobs = {kernel_matrix.ARCHS_KNOB: "90", "FLASH_ATTN_DTYPES": "bf16", "FLASH_ATTN_MASKS": "causal"}
    wide = {path.name: path.read_text()
            for _, path in gen_kernels.generate(tmp_path / "wide", {**knobs, "FLASH_ATTN_HEAD_DIMS": "64;96;128"})}
    narrow = {path.name: path.read_text()
              for _, path in gen_kernels.generate(tmp_path / "narrow", {**knobs, "FLASH_ATTN_HEAD_DIMS": "96"})}
    assert narrow and set(narrow) < set(wide)
    for name, text in narrow.items():
        assert text == wide[name]
        assert "kernel_table.h" not in text
    table = (tmp_path / "wide" / gen_kernels.GENERATED_DIR / "kernel_table.h").read_text()
    assert all(name.removesuffix(".cu") in table for name in wide)


def test_generated_wgmma_header_is_current():
    """csrc/include/flash_attn/ptx/wgmma_sm90_generated.h is what tools/gen_wgmma.py writes today."""
    import gen_wgmma

    assert gen_wgmma.OUTPUT.read_text() == gen_wgmma.render(), "run python tools/gen_wgmma.py and commit the header"


@pytest.mark.parametrize("archs", ["75", "compute_70", "sm_100", "abc"])
def test_unknown_arch_names_the_knob(archs):
    with pytest.raises(ValueError, match=kernel_matrix.ARCHS_KNOB):
        _flags(archs)


@pytest.mark.parametrize("capabilities, expected", [
    ([(9, 0)], "90"),
    ([(8, 0), (8, 6)], "80;86"),
    ([(10, 0)], "compute_80"),
    ([(12, 0), (9, 0)], "90;compute_80"),
    ([(7, 5)], ""),
])
def test_visible_gpu_archs(capabilities, expected):
    assert kernel_matrix.visible_gpu_archs(capabilities) == expected


def _import_in_subprocess(prelude):
    """Imports flash_attn from this source tree in a fresh interpreter after `prelude`; returns (exit code, stderr)."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); {prelude}; import flash_attn"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return result.returncode, result.stderr


def test_source_tree_without_extension_says_what_to_run():
    code, stderr = _import_in_subprocess("sys.modules['flash_attn_C'] = None")
    assert code != 0
    assert "ImportError" in stderr and "pip install --no-build-isolation ." in stderr
    assert "is not installed" in stderr


def test_extension_from_another_version_is_refused():
    code, stderr = _import_in_subprocess(
        "import types; fake = types.ModuleType('flash_attn_C'); fake.__version__ = '0.0.1'; "
        "fake.__file__ = 'elsewhere'; sys.modules['flash_attn_C'] = fake")
    assert code != 0
    assert "was built from flash_attn 0.0.1" in stderr and "pip install --no-build-isolation ." in stderr


def test_source_tree_finds_the_installed_extension():
    code, stderr = _import_in_subprocess("pass")
    assert code == 0, stderr
