"""P3: achieved bandwidth of every quantizer (bf16 x, rowwise + columnwise) vs a device copy.

Checks each tequant.recipe quantizer (CUDA bits vs the CPU reference, dequantization error), then
times te.ops.quantize against y.copy_(x); P3 target: minimal-bytes bandwidth >= 0.85x copy.
Run: python3 benchmarks/bench_quantize.py [--shapes 8192x8192,16384x4096] [--out FILE] (see below)
"""
import os
import sys

import torch

import tequant as te
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when not run as a script
import benchutil  # noqa: E402

# For each quantizer (DelayedScaling, Float8CurrentScaling, Float8BlockScaling 1x128 input and
# 128x128 weight, MXFP8 1x32 input and 32x32 weight, NVFP4 input with RHT, weight 16x16,
# grad_output with RHT + stochastic rounding) at 8192x8192 and 16384x4096 bf16 through
# te.ops.quantize, same run:
#   1. correctness first: the CUDA members equal the CPU reference's bit for bit on a slice of the
#      rows (same rng for stochastic rounding), and the full tensor dequantizes to finite values
#      close to x (relative Frobenius error above 0 and below the format's bound);
#   2. timing with CUDA events around each call (median of --iters after --warmup), rotating
#      --buffers input buffers so L2 (50-60 MB) never holds x; the GPU is held back with a sleep
#      kernel while the calls are queued, so the events time the kernels, not te.ops.quantize's
#      Python/host overhead (benchutil.time_cuda);
#   3. y.copy_(x) timed the same way (device copy bandwidth, bytes read + written).
# Bytes: "minimal" = x read once + every member written; "moved" adds the extra reads of x that
# the design makes (current scaling and NVFP4: an amax pass, then the cast pass). Target
# (PERFORMANCE.md P3): minimal-bytes bandwidth >= 0.85x copy bandwidth.
#
#     python3 benchmarks/bench_quantize.py [--shapes 8192x8192,16384x4096] [--iters 20]
#         [--out docs/results/bench_quantize.md]       # the file is written only with --out
#     python3 benchmarks/bench_quantize.py --device cpu --shapes 256x256   # quick CPU-side check

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


def parse_shape(text):
    return benchutil.parse_mxk(text)


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


def main():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--shapes", default="8192x8192,16384x4096")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--buffers", type=int, default=3, help="input buffers rotated (>= 3)")
    ap.add_argument("--check-rows", type=int, default=256,
                    help="rows of x compared CUDA vs CPU reference bit for bit")
    ap.add_argument("--only", default="", help="run quantizers whose label contains this")
    ap.add_argument("--out", help="also write the table to this Markdown file (appended)")
    args = benchutil.parse(ap)
    device = args.device
    timer = benchutil.timer(device)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    lines = [f"### P3: quantize bandwidth vs device copy, bf16, rowwise + columnwise "
             f"({benchutil.machine(device)})", "",
             f"median of {args.iters} calls after {args.warmup} warmup, {args.buffers} rotated "
             f"input buffers; target: minimal-bytes ratio >= {TARGET}x copy", "",
             *benchutil.table_head(["quantizer", "shape", "time us", "GB/s (minimal)",
                                    "vs copy (minimal)", "GB/s (moved)", "vs copy (moved)"], 2)]
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
        copy_text = benchutil.num_text(copy_gbs)
        lines.append(f"| y.copy_(x) (device copy) | {shape} | {copy_us:.1f} | {copy_text} "
                     f"| 1.00x | {copy_text} | 1.00x |")
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
            lines.append(f"| {label} | {shape} | {us:.1f} | {benchutil.num_text(gbs)} | "
                         f"{gbs / copy_gbs:.2f}x | {benchutil.num_text(gbs_moved)} | "
                         f"{gbs_moved / copy_gbs:.2f}x |")
        del buffers, outs
    return benchutil.finish("\n".join(lines), args.out, failures,
                            "FAILED correctness checks")


if __name__ == "__main__":
    sys.exit(main())
