"""The byte transpose of gathered codes: tequant::transpose_codes (cuda/transpose.cu) against
torch's x.t().contiguous() and a same-size device copy, one-byte E4M3 codes.

derive_columnwise (python/tequant/distributed/gather_layout.py) runs it on every weight FSDP2
gathers quantized (per-tensor FP8, 2-D blocks) and on each sequence-parallel input wgrad reads.
Checks the bits against torch first, then times each with CUDA events (median of --iters after
--warmup, rotated input buffers so L2 never holds x; benchutil.time_cuda). Bytes: read + written.
Run: python3 benchmarks/bench_transpose.py [--shapes 4096x16384,16384x4096] [--out FILE]
     python3 benchmarks/bench_transpose.py --device cpu --shapes 512x768   # quick CPU check
"""
import os
import sys

import torch

import tequant  # noqa: F401  (registers tequant::transpose_codes)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when not run as a script
import benchutil  # noqa: E402

# FSDP2's weights at d=4096 (qkv, proj, fc1, fc2) and a [8192, 4096] token activation.
SHAPES = "12288x4096,4096x4096,16384x4096,4096x16384,8192x4096"


def main():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--buffers", type=int, default=3, help="input buffers rotated (>= 3)")
    ap.add_argument("--out", help="also write the table to this Markdown file (appended)")
    args = benchutil.parse(ap)
    device = args.device
    timer = benchutil.timer(device)
    op = torch.ops.tequant.transpose_codes
    lines = [f"### Byte transpose of E4M3 codes ({benchutil.machine(device)})", "",
             f"median of {args.iters} calls after {args.warmup} warmup, {args.buffers} rotated "
             "input buffers; GB/s = bytes read + written per second", "",
             *benchutil.table_head(["shape", "copy us", "copy GB/s", "torch .t().contiguous() us",
                                    "torch GB/s", "transpose_codes us", "transpose_codes GB/s",
                                    "speedup vs torch"], 1)]
    failures = []
    g = torch.Generator().manual_seed(0)
    for text in args.shapes.split(","):
        m, k = benchutil.parse_mxk(text)
        buffers = [torch.randint(0, 256, (m, k), generator=g, dtype=torch.uint8)
                   .view(torch.float8_e4m3fn).to(device) for _ in range(max(args.buffers, 1))]
        if not torch.equal(op(buffers[0]).view(torch.uint8),
                           buffers[0].t().contiguous().view(torch.uint8)):
            failures.append(f"{text}: transpose_codes differs from torch's transpose")
            lines.append(f"| {text} | WRONG | | | | | | |")
            continue
        out = torch.empty_like(buffers[0])
        moved = 2 * m * k / 1e3  # bytes / 1e3: GB/s from microseconds
        copy_us = timer(lambda b: out.copy_(b), buffers, args.warmup, args.iters)
        torch_us = timer(lambda b: b.t().contiguous(), buffers, args.warmup, args.iters)
        ours_us = timer(op, buffers, args.warmup, args.iters)
        lines.append(f"| {text} | {copy_us:.1f} | {benchutil.num_text(moved / copy_us)} | "
                     f"{torch_us:.1f} | {benchutil.num_text(moved / torch_us)} | {ours_us:.1f} | "
                     f"{benchutil.num_text(moved / ours_us)} | {torch_us / ours_us:.2f}x |")
        del buffers, out
    return benchutil.finish("\n".join(lines), args.out, failures, "FAILED correctness checks")


if __name__ == "__main__":
    sys.exit(main())
