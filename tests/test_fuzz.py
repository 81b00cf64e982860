"""The quick profile of the property-based fuzz (tests/fuzz_tequant.py) inside `make test`: run
as a subprocess, so a crash in C (a segfault, an abort) fails this test with its exit status
instead of taking pytest down; a hang fails it at the timeout. One seed, 400 cases (every
property of the script; starting the process costs about as much as the cases, so one process);
`make fuzz` runs the long profile (100,000 cases, docs/results/fuzz.md) for the other seeds.
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("hypothesis")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_tequant.py")


def test_fuzz_quick_profile():
    done = subprocess.run([sys.executable, SCRIPT, "--examples", "400", "--seed", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stdout[-4000:] + done.stderr[-4000:])
    assert "no crash, no wrong result" in done.stdout
    for prop, cases in (("quantize", 219), ("gemm", 37), ("linear", 73), ("autocast", 37),
                        ("distributed", 37)):
        assert f"{prop}: {cases} cases" in done.stdout, done.stdout[-2000:]
    assert "bit-exact" in done.stdout and "linear: matches" in done.stdout
    assert "distributed: matches" in done.stdout
