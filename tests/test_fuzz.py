"""The quick profile of the property-based fuzz (tests/fuzz_tequant.py) inside `make test`: run
as a subprocess, so a crash in C (a segfault, an abort) fails this test with its exit status
instead of taking pytest down; a hang fails it at the timeout. `make fuzz` runs the long profile.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("hypothesis")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_tequant.py")


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzz_quick_profile(seed):
    done = subprocess.run([sys.executable, SCRIPT, "--examples", "400", "--seed", str(seed)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stdout[-4000:] + done.stderr[-4000:])
    assert "no crash, no wrong result" in done.stdout
    assert "quantize" in done.stdout and "linear: matches" in done.stdout
