# The CUDA backward's scratch layout (flash_attn/bwd_workspace.h) and the Hopper backward's head splits
# (dispatch/sm90_policy.cpp sm90_bwd_head_splits) on 2,000 random shapes, dense and varlen, deterministic or not:
# the splits divide the query-head group with the smallest divisor that fills the grid; the delta, dq and split dK /
# dV accumulators fit the workspace without overlapping, and the last element a split CTA adds is inside its
# accumulator. CPU only: the checker (tests/cpp/bwd_workspace_check.cpp) is built by the host C++ compiler here.
import pytest

from helpers import HOST_COMPILER, ROOT, run_host_check

SOURCES = [ROOT / "tests" / "cpp" / "bwd_workspace_check.cpp", ROOT / "csrc" / "dispatch" / "sm90_policy.cpp"]


@pytest.mark.skipif(HOST_COMPILER is None, reason="needs a host C++ compiler")
def test_workspace_layout_and_head_splits(tmp_path):
    assert "2000 cases, 0 failures" in run_host_check(SOURCES, tmp_path / "bwd_workspace_check")
