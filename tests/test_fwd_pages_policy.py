# Which paged-cache calls the CUDA forward reads in place (dispatch/fwd_plan.cpp fwd_reads_pages) and which the API
# gathers first: the host checker tests/cpp/fwd_pages_check.cpp, built by the host C++ compiler here (CPU only; the
# GPU tests in test_kvcache_paged.py run both paths).
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "tests" / "cpp" / "fwd_pages_check.cpp", ROOT / "csrc" / "dispatch" / "fwd_plan.cpp"]
COMPILER = shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(COMPILER is None, reason="needs a host C++ compiler")
def test_paged_calls_read_in_place_or_gathered(tmp_path):
    binary = tmp_path / "fwd_pages_check"
    build = subprocess.run([COMPILER, "-std=c++20", "-O2", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'include'}",
                            *map(str, SOURCES), "-o", str(binary)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "48 cases, 0 failures" in result.stdout
