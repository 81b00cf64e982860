"""benchmarks/bench_norm.py --device cpu: the quick mode of the fused norm benchmark (issue 24).

Small shapes through the C reference (both norms, a bf16 shape, an FP32 one and an fp16 one with
K % 8 != 0): a subprocess with a timeout; its exit status carries the benchmark's own correctness
checks (the fused codes against torch's float32 norm). The test reads the Markdown it writes:
one device-copy row per shape and, per shape and norm, torch's norm alone, torch's norm +
te.ops.quantize, and the fused forward with current and with delayed scaling, each with a
positive time and bandwidth and the ratios to torch; then the backward table: per shape and norm,
torch autograd's backward and tequant's (checked against torch's float32 backward first). The
GPU run (CUDA against the reference bit for bit, the timings) is the command in the benchmark's
docstring.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_norm.py")
SHAPES = ("32x1024", "8x4096:fp32", "4x1000:fp16")
IMPLEMENTATIONS = ("torch {name}", "torch {name} + te.ops.quantize (current)",
                   "tequant fused, current (amax run + cast run)",
                   "tequant fused, delayed (one run)")


def number(cell):
    return float(cell.rstrip("x"))


def test_cpu_quick_mode_prints_the_table(tmp_path):
    out = tmp_path / "bench_norm.md"
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--shapes", ",".join(SHAPES),
           "--iters", "2", "--warmup", "1", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    assert text.strip() in done.stdout  # the file holds what was printed
    assert "WRONG" not in text
    forward, _, backward = text.partition("### Norm backward")
    assert backward, text  # the backward table follows the forward one
    rows, back = ([[c.strip() for c in line.strip().strip("|").split("|")]
                   for line in part.splitlines() if re.match(r"\| (LayerNorm|RMSNorm|-) \|", line)]
                  for part in (forward, backward))
    for spec in SHAPES:
        m, _, dtype = spec.partition(":")
        shape = f"{m} {dtype or 'bf16'}"
        copy = [r for r in rows if r[0] == "-" and r[1] == shape]
        assert len(copy) == 1 and number(copy[0][3]) > 0, (shape, copy)
        for norm, name in (("LayerNorm", "layer_norm"), ("RMSNorm", "rms_norm")):
            mine = [r for r in rows if r[0] == norm and r[1] == shape]
            assert [r[2] for r in mine] == [i.format(name=name) for i in IMPLEMENTATIONS], mine
            for r in mine:
                assert number(r[3]) > 0 and number(r[4]) > 0, r  # time us, GB/s moved
                assert number(r[6]) > 0, r                       # vs torch norm
            assert [r[5] == "-" for r in mine] == [True, False, False, False], mine
            assert [r[7] == "-" for r in mine] == [True, False, False, False], mine
            assert mine[0][6] == "1.00x" and mine[1][7] == "1.00x", mine
            grads = "dx, dgamma, dbeta" if norm == "LayerNorm" else "dx, dgamma"
            mine = [r for r in back if r[0] == norm and r[1] == shape]
            assert [r[2] for r in mine] == [f"torch {name} backward (autograd: {grads})",
                                            f"tequant _C._norm_bwd ({grads})"], mine
            for r in mine:
                assert number(r[3]) > 0 and number(r[4]) > 0 and number(r[5]) > 0, r
            assert mine[0][5] == "1.00x", mine


def test_passes_flag_selects_the_tables(tmp_path):
    """--passes backward prints the backward table alone; a wrong value is refused."""
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--shapes", "8x512", "--norms", "RMSNorm",
           "--iters", "1", "--warmup", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd + ["--passes", "backward"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "### Norm backward" in done.stdout and "### Fused norm forward" not in done.stdout
    bad = subprocess.run(cmd + ["--passes", "sideways"], capture_output=True, text=True,
                         timeout=300, env=env, cwd=ROOT)
    assert bad.returncode != 0 and "--passes" in bad.stderr, bad.stderr[-2000:]
