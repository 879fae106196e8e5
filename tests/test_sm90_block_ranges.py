# The Hopper kernels' block ranges (csrc/sm90/block_ranges.h: the key blocks a query tile visits and those it needs no
# mask for, the query blocks a key block visits, the backward's per-pair mask test) against brute force over every
# (query, key) pair, on 600 random shapes with no mask, causal (bottom-right and top-left) and windows, and key blocks
# of every width the kernels use; the backward's 16-byte dQ reductions against the accumulator's slot layout; and the
# ordered backward dQ's order (each adder of a query block waits for a distinct count: 0, 1, 2, ...; the adders a
# fused writer counts, and their closed form in descending order, are exactly the key blocks that walk it). CPU
# only: the helpers are host/device, so the checker (tests/cpp/) is compiled by the host C++ compiler here; a range
# that skips a visible key, or calls a block unmasked that holds a masked key, fails.
import pytest

from helpers import HOST_COMPILER, ROOT, run_host_check

SOURCES = [ROOT / "tests" / "cpp" / "sm90_block_ranges_check.cpp"]


@pytest.mark.skipif(HOST_COMPILER is None, reason="needs a host C++ compiler")
def test_block_ranges_match_brute_force(tmp_path):
    assert "600 cases, 0 failures" in run_host_check(SOURCES, tmp_path / "sm90_block_ranges_check")
