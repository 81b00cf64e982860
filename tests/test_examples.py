"""examples/train_fsdp.py under torchrun on CPU (gloo, 2 ranks): FSDP2 + activation
checkpointing + quantized all-gather trains, prints the bytes it gathered per forward (below the
high-precision gather's), saves a distributed checkpoint and resumes from it; with --tp 2 (a
dp x tp mesh, sequence parallel) it trains with quantized all-gathers. A subprocess with a
timeout, so a hang fails the test.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_fsdp.py")


def torchrun(*args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", SCRIPT, "--device", "cpu", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_train_fsdp_example_trains_saves_and_resumes(tmp_path):
    folder = str(tmp_path / "ckpt")
    out = torchrun("--size", "tiny", "--steps", "6", "--recipe", "delayed",
                   "--checkpoint-dir", folder)
    ratio = float(re.search(r"high precision [\d,]+ \(([\d.]+)x\)", out).group(1))
    first = float(re.search(r"final loss ([\d.]+)", out).group(1))
    assert 0 < ratio < 0.6, out
    out = torchrun("--size", "tiny", "--steps", "3", "--recipe", "delayed",
                   "--checkpoint-dir", folder, "--resume")
    resumed = float(re.search(r"final loss ([\d.]+)", out).group(1))
    assert 0 < resumed < first + 1.0, out  # went on from the trained state, not from scratch


def test_train_fsdp_example_with_tensor_parallelism():
    """--tp 2 on 2 ranks (dp 1 x tp 2), sequence parallel: trains, and its column layers'
    all-gathers move the recipe's codes (fewer bytes than in high precision)."""
    out = torchrun("--size", "tiny", "--steps", "6", "--recipe", "current", "--tp", "2")
    losses = [float(v) for v in re.findall(r"loss ([\d.]+)", out)]
    ratio = float(re.search(r"high precision [\d,]+ \(([\d.]+)x\)", out).group(1))
    assert "tp 2" in out and losses[-1] < losses[0] - 0.2, out
    assert 0 < ratio < 0.6, out
