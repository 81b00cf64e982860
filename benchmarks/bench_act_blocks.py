"""Fused activation passes into block formats (issue 24): te.LayerNormMLP's activation writing fc2's
input blocks (forward) and fc1's grad_output blocks (backward) under Float8BlockScaling (1x128
E4M3) and MXFP8BlockScaling (1x32 E4M3), both directions, against the unfused pairs.

Per recipe, activation and pass, with CUDA events over rotated input buffers:
  forward   torch's activation + te.ops.quantize (both directions); tequant's activation kernel
            (_C._act_fwd, y in h's dtype) + te.ops.quantize; the fused pass (tq_act_forward with
            the block config) writing both directions, and rowwise only;
  backward  torch autograd's dh (its forward graph made once per buffer) + te.ops.quantize; the activation kernel's dh (tq_act_backward)
            + te.ops.quantize; the fused pass (tq_act_backward with the block config), both
            directions and rowwise only.
Checked first: the fused members equal te.ops.quantize of the kernel's y / dh bit for bit (the
rule: the values rounded to h's dtype). Prints us and the ratios (> 1: the fused pass is faster).
Which activations the modules fuse follows from these rows (_act_fn.ActInput.fusable,
_act_fn.BLOCK_DH). Tests: tests/test_bench_act_blocks.py (the CPU quick mode).
Run: python3 benchmarks/bench_act_blocks.py [--rows 8192] [--width 16384] [--acts ...] [--out FILE]
"""
import os
import sys

import torch
import torch.nn.functional as F

import tequant as te
from tequant import _C
from tequant.recipe import Float8BlockScaling, MXFP8BlockScaling

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when not run as a script
import benchutil  # noqa: E402

RECIPES = {"block": Float8BlockScaling, "mxfp8": MXFP8BlockScaling}
ACTS = ("gelu", "relu", "silu", "qgelu", "srelu", "geglu", "reglu", "swiglu")
GATED = ("geglu", "reglu", "swiglu")
TORCH = {"gelu": lambda v: F.gelu(v, approximate="tanh"), "relu": F.relu, "silu": F.silu,
         "qgelu": lambda v: v * torch.sigmoid(1.702 * v), "srelu": lambda v: F.relu(v).square()}
ROLE = {"forward": "input", "backward": "grad_output"}


def torch_act(act, h):
    if act in GATED:
        a, b = h.chunk(2, -1)
        return TORCH[{"geglu": "gelu", "reglu": "relu", "swiglu": "silu"}[act]](a) * b
    return TORCH[act](h)


def members(q):
    return (q.data, q.scale_inv, q.data_t, q.scale_inv_t)


def runs_of(act, p, recipe, m):
    """[(label, fn(buffer))] of one pass: torch + quantize, kernel + quantize, fused, fused
    rowwise; buffer = (h, dy)."""
    cfg = te.quantizer_config(recipe, ROLE[p])

    def quantize(v):
        return te.ops.quantize(v, recipe, role=ROLE[p], rowwise=True, columnwise=True)
    if p == "forward":
        def kernel(b):
            return _C._act_fwd(b[0], act, True, None, None, None, 0, False)[0]

        def torch_run(b):
            return torch_act(act, b[0])

        def fused(b, col=True):
            return _C._act_fwd(b[0], act, False, cfg, None, None, m, col)
    else:
        def kernel(b):
            return _C._act_bwd(b[1], b[0], act, None, None, None, 0, None, False)[0]

        graphs = {}  # buffer -> (h, y): torch's forward once, its backward timed

        def torch_run(b):
            if id(b) not in graphs:
                h = b[0].detach().requires_grad_()
                graphs[id(b)] = (h, torch_act(act, h))
            h, y = graphs[id(b)]
            return torch.autograd.grad(y, h, b[1], retain_graph=True)[0]

        def fused(b, col=True):
            return _C._act_bwd(b[1], b[0], act, cfg, None, None, m, None, col)
    return [("torch + te.ops.quantize", lambda b: quantize(torch_run(b))),
            ("kernel + te.ops.quantize", lambda b: quantize(kernel(b))),
            ("fused, both directions", fused),
            ("fused, rowwise", lambda b: fused(b, False))], kernel, quantize, fused


def check(kernel, quantize, fused, buffer):
    want = members(quantize(kernel(buffer)))
    for name, got, ref in zip(("data", "scale_inv", "data_t", "scale_inv_t"), fused(buffer),
                              want):
        a, b = got.cpu().view(torch.uint8), ref.cpu().view(torch.uint8)
        if a.shape != b.shape or not torch.equal(a, b):
            raise AssertionError(f"{name} differs from te.ops.quantize of the kernel's output")


def main():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--width", type=int, default=16384,
                    help="the activation's output features (a gated h has twice as many)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--recipes", default="block,mxfp8")
    ap.add_argument("--acts", default=",".join(ACTS))
    ap.add_argument("--passes", default="forward,backward")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--buffers", type=int, default=3, help="input buffers rotated (>= 3)")
    ap.add_argument("--out", help="also write the table to this Markdown file (appended)")
    args = benchutil.parse(ap)
    device, m = args.device, args.rows
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    lists = {}
    for flag, allowed in (("recipes", RECIPES), ("acts", ACTS), ("passes", ROLE)):
        lists[flag] = [v.strip() for v in getattr(args, flag).split(",") if v.strip()]
        bad = [v for v in lists[flag] if v not in allowed]
        if bad:
            raise SystemExit(f"--{flag}: {bad} not among {', '.join(allowed)}")
    timer = benchutil.timer(device)
    lines = [f"### Fused activation passes into block formats ({benchutil.machine(device)})", "",
             f"{m} rows, {args.width} output features ({args.dtype}); median of {args.iters} calls "
             f"after {args.warmup} warmup, {args.buffers} rotated buffers; \"vs\" columns: that "
             "time / this time (> 1: this is faster)", "",
             *benchutil.table_head(["recipe", "act", "pass", "implementation", "time us",
                                    "vs torch + quantize", "vs kernel + quantize"], 4)]
    failures = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for act in lists["acts"]:
        n = args.width
        k = 2 * n if act in GATED else n
        buffers = [((torch.randn(m, k, generator=g) * 2).to(dtype).to(device),
                    torch.randn(m, n, generator=g).to(dtype).to(device))
                   for _ in range(max(args.buffers, 1))]
        for name in lists["recipes"]:
            recipe = RECIPES[name]()
            for p in lists["passes"]:
                runs, kernel, quantize, fused = runs_of(act, p, recipe, m)
                try:
                    check(kernel, quantize, fused, buffers[0])
                except (AssertionError, RuntimeError, ValueError) as e:
                    failures.append(f"{name} {act} {p}: {e}")
                    lines.append(f"| {name} | {act} | {p} | WRONG: {benchutil.one_line(e)} | | | |")
                    continue
                times = [timer(fn, buffers, args.warmup, args.iters) for _, fn in runs]
                for (label, _), us in zip(runs, times):
                    lines.append(f"| {name} | {act} | {p} | {label} | {us:.1f} | "
                                 f"{benchutil.ratio_text(times[0], us)} | "
                                 f"{benchutil.ratio_text(times[1], us)} |")
        del buffers
    return benchutil.finish("\n".join(lines), args.out, failures, "FAILED correctness checks")


if __name__ == "__main__":
    sys.exit(main())
