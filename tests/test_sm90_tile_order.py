# The order in which the Hopper forward's persistent CTAs walk masked tiles (csrc/sm90/tile_order.h): on 600 random
# launches and six of the benchmark's, both orders (longest first across every head; chunks of two rounds of the
# head-major order) take every tile exactly once, keep the busiest CTA within one longest tile (or 1 %) of the mean,
# and the chunks stay within a run of head-batches as short as their tiles allow. CPU only: the order is host/device,
# so the checker (tests/cpp/) is compiled by the host C++ compiler here.
import pytest

from helpers import HOST_COMPILER, ROOT, run_host_check

SOURCES = [ROOT / "tests" / "cpp" / "sm90_tile_order_check.cpp"]


@pytest.mark.skipif(HOST_COMPILER is None, reason="needs a host C++ compiler")
def test_masked_tile_order(tmp_path):
    assert "600 cases, 0 failures" in run_host_check(SOURCES, tmp_path / "sm90_tile_order_check")
