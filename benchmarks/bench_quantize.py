"""P3: achieved bandwidth of every quantizer (bf16 x, rowwise + columnwise) vs a device copy.

For each quantizer (DelayedScaling, Float8CurrentScaling, Float8BlockScaling 1x128 input and
128x128 weight, MXFP8 1x32 input and 32x32 weight, NVFP4 input with RHT, weight 16x16,
grad_output with RHT + stochastic rounding) at 8192x8192 and 16384x4096 bf16 through
te.ops.quantize, same run:
  1. correctness first: the CUDA members equal the CPU reference's bit for bit on a slice of the
     rows (same rng for stochastic rounding), and the full tensor dequantizes to finite values
     close to x (relative Frobenius error above 0 and below the format's bound);
  2. timing with CUDA events around each call (median of --iters after --warmup), rotating
     --buffers input buffers so L2 (50-60 MB) never holds x; the GPU is held back with a sleep
     kernel while the calls are queued, so the events time the kernels, not te.ops.quantize's
     Python/host overhead;
  3. y.copy_(x) timed the same way (device copy bandwidth, bytes read + written).
Bytes: "minimal" = x read once + every member written; "moved" adds the extra reads of x that
the design makes (current scaling and NVFP4: an amax pass, then the cast pass). Target
(PERFORMANCE.md P3): minimal-bytes bandwidth >= 0.85x copy bandwidth.

    python3 benchmarks/bench_quantize.py [--shapes 8192x8192,16384x4096] [--iters 20]
        [--out docs/results/bench_quantize.md]       # the file is written only with --out
    python3 benchmarks/bench_quantize.py --device cpu --shapes 256x256   # quick CPU-side check
"""
import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import tequant as te
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t")
# (label, recipe, role, extra full reads of x the design makes beyond the cast pass)
QUANTIZERS = [
    ("DelayedScaling (E4M3, per tensor)", DelayedScaling(), "input", 0),
    ("Float8CurrentScaling (E4M3, per tensor)", Float8CurrentScaling(), "input", 1),
    ("Float8BlockScaling input (1x128)", Float8BlockScaling(), "input", 0),
    ("Float8BlockScaling weight (128x128)", Float8BlockScaling(), "weight", 0),
    ("MXFP8BlockScaling input (1x32)", MXFP8BlockScaling(), "input", 0),
    ("MXFP8BlockScaling weight (32x32, 2D)", MXFP8BlockScaling(enable_2d_quantization=True),
     "weight", 0),
    ("NVFP4BlockScaling input (1x16, RHT)", NVFP4BlockScaling(), "input", 1),
    ("NVFP4BlockScaling weight (16x16, 2D)", NVFP4BlockScaling(), "weight", 1),
    ("NVFP4BlockScaling grad_output (1x16, RHT + SR)", NVFP4BlockScaling(), "grad_output", 1),
]
ERROR_BOUND = {"E4M3": 0.05, "E5M2": 0.1, "E2M1": 0.2}  # relative Frobenius, randn data
RNG = (1234, 5678)  # fixed (seed, offset) for stochastic rounding: CPU and CUDA draw alike
TARGET = 0.85


def gbs_text(v):
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def parse_shape(text):
    m, k = text.lower().split("x")
    return int(m), int(k)


def member_bytes(q):
    return sum(t.numel() * t.element_size() for t in (getattr(q, n) for n in MEMBERS)
               if t is not None)


_DELAYED_STATE = {}


def quantize(x, recipe, role):
    kwargs = {}
    if isinstance(recipe, DelayedScaling):
        # The scale and history slot a Linear would hold: made once per device, so the timed
        # call launches only the cast (no fill of a fresh scale or amax).
        if x.device not in _DELAYED_STATE:
            _DELAYED_STATE[x.device] = (torch.full((1,), 0.5, device=x.device),
                                        torch.zeros(1, device=x.device))
        kwargs["scale"], kwargs["amax_history"] = _DELAYED_STATE[x.device]
    return te.ops.quantize(x, recipe, role, rowwise=True, columnwise=True, rng=RNG, **kwargs)


def check(x, recipe, role, device, check_rows):
    """Raises AssertionError if the quantizer is wrong; returns the result on the full x."""
    q = quantize(x, recipe, role)
    bound = ERROR_BOUND[q.config.format]
    y = q.dequantize(torch.float32)
    assert y.shape == x.shape and bool(torch.isfinite(y).all()), "non-finite dequantized values"
    err = float((y.double() - x.double()).norm() / x.double().norm())
    assert 0.0 < err < bound, f"relative error {err:.3g} outside (0, {bound})"
    if device == "cuda":
        xs = x[:check_rows].contiguous()
        for _, history_slot in _DELAYED_STATE.values():
            history_slot.zero_()  # both devices accumulate the slice's amax from 0
        q_gpu, q_cpu = quantize(xs, recipe, role), quantize(xs.cpu(), recipe, role)
        for name in MEMBERS:
            a, b = getattr(q_gpu, name), getattr(q_cpu, name)
            assert (a is None) == (b is None), f"{name} present on one device only"
            if a is not None:
                diff = int((a.view(torch.uint8).cpu() != b.view(torch.uint8)).sum())
                assert diff == 0, f"{name}: {diff} bytes differ between CUDA and the CPU reference"
    return q


def time_cuda(fn, buffers, warmup, iters):
    """Median microseconds of fn(buffer) over iters calls, each between two CUDA events."""
    for i in range(warmup):
        fn(buffers[i % len(buffers)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    # Hold the GPU back (~50 ms) while the calls are queued: the host then runs ahead, so no
    # host time falls between an event pair.
    torch.cuda._sleep(100_000_000)
    for i in range(iters):
        starts[i].record()
        fn(buffers[i % len(buffers)])  # its outputs return to the caching allocator in order
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def time_cpu(fn, buffers, warmup, iters):
    for i in range(warmup):
        fn(buffers[i % len(buffers)])
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(buffers[i % len(buffers)])
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run_git(*args):
    try:
        res = subprocess.run(["git", *args], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except OSError:
        return ""
    return res.stdout.strip() if res.returncode == 0 else ""


def machine(device):
    commit = run_git("rev-parse", "--short", "HEAD") or "?"
    if commit != "?" and run_git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    if device == "cuda":
        gpu = torch.cuda.get_device_name()
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                     "--format=csv,noheader"], capture_output=True,
                                    text=True).stdout.split("\n")[0].strip() or "?"
        except OSError:
            driver = "?"
    else:
        gpu, driver = "none (CPU reference)", "-"
    return (f"GPU: {gpu}; driver {driver}; CUDA {torch.version.cuda or '-'}; torch "
            f"{torch.__version__}; Python {platform.python_version()}; commit {commit}; "
            f"{datetime.date.today()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="8192x8192,16384x4096")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--buffers", type=int, default=3, help="input buffers rotated (>= 3)")
    ap.add_argument("--check-rows", type=int, default=256,
                    help="rows of x compared CUDA vs CPU reference bit for bit")
    ap.add_argument("--only", default="", help="run quantizers whose label contains this")
    ap.add_argument("--out", help="also write the table to this Markdown file (appended)")
    args = ap.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is available")
    timer = time_cuda if device == "cuda" else time_cpu
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    lines = [f"### P3: quantize bandwidth vs device copy, bf16, rowwise + columnwise "
             f"({machine(device)})", "",
             f"median of {args.iters} calls after {args.warmup} warmup, {args.buffers} rotated "
             f"input buffers; target: minimal-bytes ratio >= {TARGET}x copy", "",
             "| quantizer | shape | time us | GB/s (minimal) | vs copy (minimal) | "
             "GB/s (moved) | vs copy (moved) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    failures = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for m, k in shapes:
        shape = f"{m}x{k}"
        buffers = [torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
                   for _ in range(max(args.buffers, 1))]
        x_bytes = m * k * buffers[0].element_size()
        outs = [torch.empty_like(b) for b in buffers]
        copy_us = timer(lambda b: outs[0].copy_(b), buffers, args.warmup, args.iters)
        copy_gbs = 2 * x_bytes / copy_us / 1e3
        lines.append(f"| y.copy_(x) (device copy) | {shape} | {copy_us:.1f} | {gbs_text(copy_gbs)} "
                     f"| 1.00x | {gbs_text(copy_gbs)} | 1.00x |")
        for label, recipe, role, extra_reads in QUANTIZERS:
            if args.only and args.only not in label:
                continue
            try:
                q = check(buffers[0], recipe, role, device, args.check_rows)
            except NotImplementedError as e:
                lines.append(f"| {label} | {shape} | n/a: {e} | | | | |")
                continue
            except (AssertionError, ValueError, RuntimeError) as e:
                failures.append(f"{label} {shape}: {e}")
                lines.append(f"| {label} | {shape} | WRONG: {e} | | | | |")
                continue
            minimal = x_bytes + member_bytes(q)
            moved = minimal + extra_reads * x_bytes
            del q
            us = timer(lambda b: quantize(b, recipe, role), buffers, args.warmup, args.iters)
            gbs, gbs_moved = minimal / us / 1e3, moved / us / 1e3
            lines.append(f"| {label} | {shape} | {us:.1f} | {gbs_text(gbs)} | "
                         f"{gbs / copy_gbs:.2f}x | {gbs_text(gbs_moved)} | "
                         f"{gbs_moved / copy_gbs:.2f}x |")
        del buffers, outs
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            f.write(table + "\n\n")
    if failures:
        print("\nFAILED correctness checks:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
