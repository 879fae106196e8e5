# Malformed inputs through every op and the public functions (tools/fuzz_inputs.py): each case either raises a Python
# exception or returns a finite answer, the reference's where its mutation keeps the call meaningful. The fuzzer runs
# in a subprocess so that a crash (or, on CUDA, an illegal address that poisons the context) fails this test instead
# of the session. tools/fuzz_inputs.sh runs it under AddressSanitizer for silent out-of-bounds reads on the CPU path.
import subprocess
import sys

import pytest
import torch

from helpers import ROOT

FUZZER = ROOT / "tools" / "fuzz_inputs.py"
TIMEOUT_S = 600


def _run(device, cases, seed):
    result = subprocess.run([sys.executable, str(FUZZER), "--device", device, "--cases", str(cases), "--seed",
                             str(seed)], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    tail = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, f"fuzz_inputs.py --device {device} --seed {seed} failed:\n{tail}"
    assert f"{cases} cases" in result.stdout and "0 findings" in result.stdout, tail


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fuzz_cpu(seed):
    _run("cpu", 600, seed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", [0, 1])
def test_fuzz_cuda(seed):
    _run("cuda", 400, seed)
