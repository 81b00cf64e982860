"""benchmarks/bench_act.py --device cpu: the quick mode of the fused activation benchmark
(issue 24).

Small shapes through the C reference (an elementwise and a gated activation, a bf16 shape and an
FP32 one with K % 8 != 0): a subprocess with a timeout; its exit status carries the benchmark's
own correctness checks (the fused codes against torch's float32 activation and gradient). The
test reads the Markdown it writes: per shape, activation and pass, torch alone, torch +
te.ops.quantize, and the fused calls with current and with delayed scaling, each with a positive
time and bandwidth and the ratios to torch. The GPU run (CUDA against the reference bit for bit,
the timings) is the command in the benchmark's docstring.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_act.py")
SHAPES = ("32x1024", "8x1002:fp32")
ACTS = ("gelu", "swiglu")
IMPLEMENTATIONS = {
    "forward": ("torch {act}", "torch {act} + te.ops.quantize (current)",
                "tequant fused, current (amax run + cast run)", "tequant fused, delayed (one run)"),
    "backward": ("torch {act} backward + dbias",
                 "torch {act} backward + dbias + te.ops.quantize (current)",
                 "tequant fused, current (amax + dbias run, cast run)",
                 "tequant fused, delayed (one run with dbias)")}


def number(cell):
    return float(cell.rstrip("x"))


def test_cpu_quick_mode_prints_the_table(tmp_path):
    out = tmp_path / "bench_act.md"
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--shapes", ",".join(SHAPES), "--acts",
           ",".join(ACTS), "--iters", "2", "--warmup", "1", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    assert text.strip() in done.stdout  # the file holds what was printed
    assert "WRONG" not in text
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if re.match(r"\| (" + "|".join(ACTS) + r") \|", line)]
    for spec in SHAPES:
        m, _, dtype = spec.partition(":")
        shape = f"{m} {dtype or 'bf16'}"
        for act in ACTS:
            for p, labels in IMPLEMENTATIONS.items():
                mine = [r for r in rows if r[0] == act and r[1] == p and r[2] == shape]
                assert [r[3] for r in mine] == [i.format(act=act) for i in labels], mine
                for r in mine:
                    assert number(r[4]) > 0 and number(r[5]) > 0, r  # time us, GB/s moved
                    assert number(r[7]) > 0, r                       # vs torch
                assert [r[6] == "-" for r in mine] == [True, False, False, False], mine
                assert [r[8] == "-" for r in mine] == [True, False, False, False], mine
                assert mine[0][7] == "1.00x" and mine[1][8] == "1.00x", mine
