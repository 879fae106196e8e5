# The multiply-and-shift division of the Hopper forward's tile walk (csrc/include/flash_attn/common/fast_divmod.h)
# against `/` and `%`: every divisor up to 4096, powers of two and their neighbours, 2,000 random divisors below 2^31,
# numerators around their multiples and around 2^31 - 1, and every numerator below 2^20 for seven divisors. CPU only:
# the helper is host/device, so the checker (tests/cpp/) is compiled by the host C++ compiler here.
import pytest

from helpers import HOST_COMPILER, ROOT, run_host_check

SOURCES = [ROOT / "tests" / "cpp" / "fast_divmod_check.cpp"]


@pytest.mark.skipif(HOST_COMPILER is None, reason="needs a host C++ compiler")
def test_fast_divmod(tmp_path):
    assert ", 0 failures" in run_host_check(SOURCES, tmp_path / "fast_divmod_check")
