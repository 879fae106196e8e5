# Which paged-cache calls the CUDA forward reads in place (dispatch/fwd_plan.cpp fwd_reads_pages) and which the API
# gathers first, and the split counts of decode calls on contiguous and paged caches (choose_fwd_num_splits): the host
# checker tests/cpp/fwd_pages_check.cpp, built by the host C++ compiler here (CPU only; the GPU tests in
# test_kvcache_paged.py run both paths).
import pytest

from helpers import HOST_COMPILER, ROOT, run_host_check

SOURCES = [ROOT / "tests" / "cpp" / "fwd_pages_check.cpp", ROOT / "csrc" / "dispatch" / "fwd_plan.cpp"]


@pytest.mark.skipif(HOST_COMPILER is None, reason="needs a host C++ compiler")
def test_paged_calls_read_in_place_or_gathered(tmp_path):
    assert "89 cases, 0 failures" in run_host_check(SOURCES, tmp_path / "fwd_pages_check")
