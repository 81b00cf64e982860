"""benchmarks/soak.py --device cpu: smoke runs of the soak benchmark (issue 25 item 5).

A short CPU run of two recipes must exit 0 with a passing row for each. A run whose loss turns
NaN (the test-only --inject-nan-at) must exit 1, with a failing row that says the loss was not
finite. That run goes through --gpus 1, so the child-process launcher and its JSON merge are
covered too. Memory flatness is judged only on CUDA; the GPU run itself is the command in the
benchmark's docstring. Subprocesses with timeouts, so a hang fails the test.
"""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "soak.py")
SHORT = ["--device", "cpu", "--size", "tiny", "--steps", "30", "--warmup", "5",
         "--sample-every", "10"]


def _soak(*flags):
    # One intra-op thread: faster for the tiny matrices, and steadier on a loaded 2-core box.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, *SHORT, *flags], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


def _row(text, recipe):
    """The table row of `recipe` as a list of its cells."""
    rows = [line for line in text.splitlines() if line.startswith(f"| {recipe} |")]
    assert len(rows) == 1, text
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def test_cpu_run_passes(tmp_path):
    out = tmp_path / "soak.md"
    done = _soak("--recipes", "current,bf16", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for recipe in ("current", "bf16"):
        cells = _row(done.stdout, recipe)
        # steps, max growth, finite every step, pass
        assert cells[1] == "30/30" and cells[4] == "n/a (cpu)", cells
        assert cells[8:] == ["yes", "pass"], cells
        assert float(cells[2]) > 0 and math.isfinite(float(cells[7])), cells
    text = out.read_text()
    assert text.startswith("### Soak: tiny demo GPT") and "torch " in text and "commit " in text
    assert _row(text, "current") == _row(done.stdout, "current")


def test_nonfinite_loss_fails(tmp_path):
    js = tmp_path / "soak.json"
    done = _soak("--recipes", "current", "--inject-nan-at", "12", "--gpus", "1",
                 "--json", str(js))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    cells = _row(done.stdout, "current")
    # The NaN of step 12 is seen at the next sample (step 15), where the run stops.
    assert cells[1] == "15/30" and cells[8:] == ["no", "FAIL"], cells
    assert "SOAK FAILED" in done.stderr and "current: finite False" in done.stderr
    run = json.loads(js.read_text())["runs"][0]
    assert run["finite"] is False and run["pass"] is False
    assert math.isfinite(run["first_loss"]) and math.isnan(run["last_loss"])
