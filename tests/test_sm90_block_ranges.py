# The Hopper kernels' block ranges (csrc/sm90/block_ranges.h: the key blocks a query tile visits and those it needs no
# mask for, the query blocks a key block visits, the backward's per-pair mask test) against brute force over every
# (query, key) pair, on 600 random shapes with no mask, causal (bottom-right and top-left) and windows, and key blocks
# of every width the kernels use; and the backward's 16-byte dQ reductions against the accumulator's slot layout. CPU
# only: the helpers are host/device, so the checker (tests/cpp/) is compiled by the host C++ compiler here; a range
# that skips a visible key, or calls a block unmasked that holds a masked key, fails.
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "cpp" / "sm90_block_ranges_check.cpp"
COMPILER = shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(COMPILER is None, reason="needs a host C++ compiler")
def test_block_ranges_match_brute_force(tmp_path):
    binary = tmp_path / "sm90_block_ranges_check"
    build = subprocess.run([COMPILER, "-std=c++20", "-O2", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'include'}",
                            str(SOURCE), "-o", str(binary)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "600 cases, 0 failures" in result.stdout
