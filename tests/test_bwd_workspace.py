# The CUDA backward's scratch layout (flash_attn/bwd_workspace.h) and the Hopper backward's head splits
# (dispatch/sm90_policy.cpp sm90_bwd_head_splits) on 2,000 random shapes, dense and varlen, deterministic or not:
# the splits divide the query-head group with the smallest divisor that fills the grid; the delta, dq and split dK /
# dV accumulators fit the workspace without overlapping, and the last element a split CTA adds is inside its
# accumulator. CPU only: the checker (tests/cpp/bwd_workspace_check.cpp) is built by the host C++ compiler here.
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "tests" / "cpp" / "bwd_workspace_check.cpp", ROOT / "csrc" / "dispatch" / "sm90_policy.cpp"]
COMPILER = shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(COMPILER is None, reason="needs a host C++ compiler")
def test_workspace_layout_and_head_splits(tmp_path):
    binary = tmp_path / "bwd_workspace_check"
    build = subprocess.run([COMPILER, "-std=c++20", "-O2", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'include'}",
                            *map(str, SOURCES), "-o", str(binary)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2000 cases, 0 failures" in result.stdout
