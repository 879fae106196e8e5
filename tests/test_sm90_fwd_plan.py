# Which forward calls the Hopper path serves and how it splits their keys (csrc/dispatch/sm90_policy.cpp): KV-cache
# lengths served, appends and packed GQA decode steps declined, the backward declining seqused_k, paged caches only
# where pages fit the key blocks, GQA packing (sm90_fwd_packed_heads), sm90_fwd_num_splits on the H200's SM
# count, the head-dim buckets, tall rows (hd 96 on 192-row tiles under FLASH_ATTN_FWD_TALL_ROWS=1), and calls of 2^31
# query tiles or more declined (the tile walk's divisions hold below that). The host checker
# tests/cpp/sm90_fwd_plan_check.cpp, built by the host C++ compiler here (CPU only; the GPU tests in
# test_hopper_forward.py run these calls).
import pytest

from helpers import HOST_COMPILER, ROOT, run_host_check

SOURCES = [ROOT / "tests" / "cpp" / "sm90_fwd_plan_check.cpp", ROOT / "csrc" / "dispatch" / "sm90_policy.cpp"]


@pytest.mark.skipif(HOST_COMPILER is None, reason="needs a host C++ compiler")
def test_hopper_forward_plan(tmp_path):
    assert "70 cases, 0 failures" in run_host_check(SOURCES, tmp_path / "sm90_fwd_plan_check")
