"""benchmarks/bench_act_blocks.py --device cpu: the quick mode of the block-format activation
benchmark (issue 24).

Small shapes through the C reference (an elementwise and a gated activation, both recipes, both
passes): a subprocess with a timeout; its exit status carries the benchmark's own check (the
fused members against te.ops.quantize of the kernel's output, bit for bit). The test reads the
Markdown it writes: every (recipe, activation, pass) has its four rows with positive times and
ratios. The GPU run is the command in the benchmark's docstring.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_act_blocks.py")
LABELS = ("torch + te.ops.quantize", "kernel + te.ops.quantize", "fused, both directions",
          "fused, rowwise")


def test_cpu_quick_mode_prints_the_table(tmp_path):
    out = tmp_path / "bench_act_blocks.md"
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--rows", "64", "--width", "64", "--acts",
           "relu,swiglu", "--iters", "2", "--warmup", "1", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()
            if line.startswith("| block") or line.startswith("| mxfp8")]
    seen = {}
    for cells in rows:
        recipe, act, p, label, us, vs_torch, vs_kernel = (c.strip() for c in cells)
        assert float(us) > 0 and re.fullmatch(r"\d+\.\d+x", vs_torch), cells
        assert re.fullmatch(r"\d+\.\d+x", vs_kernel), cells
        seen.setdefault((recipe, act, p), []).append(label)
    assert set(seen) == {(r, a, p) for r in ("block", "mxfp8") for a in ("relu", "swiglu")
                         for p in ("forward", "backward")}
    assert all(tuple(labels) == LABELS for labels in seen.values())
