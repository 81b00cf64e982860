"""Fused activation kernels (issue 24): tequant's activation + FP8 codes in one kernel vs torch.

Checks first (CUDA bits against the C reference, codes against torch's float32 activation), then
times, per shape and activation, with CUDA events over rotated input buffers:
  forward   torch's activation alone; torch's activation + te.ops.quantize (current scaling)
            (a gated activation's torch rows read gate and up as two contiguous tensors and keep
            their gradients and quantizations apart, as a block with separate gate and up layers
            runs them; before 2026-11-26's sixth session they read chunk views of h and joined
            the gradients with a cat, which overstated torch's cost);
            tequant's fused forward (tq_act_forward through _C._act_forward) with current
            scaling (two runs: the amax run, then the cast run) and with delayed scaling (one run);
  backward  torch's activation backward + dh.sum(0) (the bias gradient); that + te.ops.quantize
            of dh (current, E5M2); tequant's fused backward (tq_act_backward) with current
            scaling (the amax run with dbias, then the cast run) and delayed scaling (one run:
            codes, amax slot and dbias).
Prints us, GB/s and the ratios to torch. Tests: tests/test_bench_act.py (the CPU quick mode).
Run: python3 benchmarks/bench_act.py [--shapes ...] [--acts ...] [--out FILE] (see below)
"""
import os
import sys

import torch
import torch.nn.functional as F

import tequant as te
from tequant import _C
from tequant.recipe import DelayedScaling, Float8CurrentScaling, Format

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when not run as a script
import benchutil  # noqa: E402

# Per shape (MxK:dtype, K = fc1's output features, 2N for a gated activation) and activation:
#   1. correctness first: on CUDA the fused forward and backward equal the C reference bit for
#      bit (codes, scale_inv, amax, dbias) on the first --check-rows rows, and the full-size
#      delayed run's first rows of codes equal them too (current scaling's scale is the whole
#      tensor's); the fused codes dequantize to within the E4M3 / E5M2 bound of torch's float32
#      activation / gradient (any device);
#   2. timing (benchutil.time_cuda: CUDA events, the GPU held back while the calls are queued,
#      --buffers rotated inputs so L2 never holds them).
# Bytes: "moved" = what an implementation reads and writes by design; "in + codes" = the inputs
# read once + the FP8 codes written, the fused task's minimum.
#
#     python3 benchmarks/bench_act.py [--shapes 8192x16384,8192x32768,8192x16384:fp32]
#         [--acts gelu,swiglu,relu] [--passes forward,backward] [--out docs/results/bench_act.md]
#     python3 benchmarks/bench_act.py --device cpu --shapes 32x1024,8x1002:fp32   # quick check

DTYPES = benchutil.FLOAT_DTYPES
bits = benchutil.bits
ACTS = ("gelu", "relu", "silu", "qgelu", "srelu", "geglu", "reglu", "swiglu")
GATED = {"geglu": "gelu", "reglu": "relu", "swiglu": "silu"}
BOUND = {"forward": 0.05, "backward": 0.1}  # relative Frobenius error of E4M3 / E5M2 codes
CURRENT = Float8CurrentScaling()
DELAYED = DelayedScaling()
ROLE = {"forward": "input", "backward": "grad_output"}  # E4M3 forward, E5M2 (HYBRID) backward
TORCH_FWD = {"gelu": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu,
             "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
             "srelu": lambda x: torch.square(F.relu(x))}


def _qgelu_backward(dy, x):
    s = torch.sigmoid(1.702 * x)
    return dy * (s + 1.702 * x * s * (1 - s))


TORCH_BWD = {  # (dy, x) -> dx, torch's own backward ops where it has them
    "gelu": lambda dy, x: torch.ops.aten.gelu_backward(dy, x, approximate="tanh"),
    "relu": lambda dy, x: torch.ops.aten.threshold_backward(dy, x, 0),
    "silu": torch.ops.aten.silu_backward,
    "qgelu": _qgelu_backward,
    "srelu": lambda dy, x: dy * 2 * F.relu(x)}


def split(act, h):
    """What torch's activation reads: (h,), or for a gated one (gate, up) as two contiguous
    tensors, the outputs of a block's separate gate and up layers (the te.Linear Llama block's
    code: no chunk views, no cat of the two gradients)."""
    if act in GATED:
        return tuple(t.contiguous() for t in h.chunk(2, dim=-1))
    return (h,)


def torch_forward(act, parts):
    if act in GATED:
        gate, up = parts
        return TORCH_FWD[GATED[act]](gate) * up
    return TORCH_FWD[act](parts[0])


def torch_backward(act, parts, dy):
    """[gradient per part] and [its column sums: the bias gradients] with torch's ops (a gated
    activation's two gradients stay apart, as autograd gives them to the gate and up layers)."""
    if act in GATED:
        gate, up = parts
        base = GATED[act]
        grads = [TORCH_BWD[base](dy * up, gate), dy * TORCH_FWD[base](gate)]
    else:
        grads = [TORCH_BWD[act](dy, parts[0])]
    return grads, [g.sum(0) for g in grads]


class Fused:
    """tequant's fused calls of one (activation, shape) with their output buffers, made once (as
    a module would hold them)."""

    def __init__(self, act, m, k, device):
        n = k // 2 if act in GATED else k
        f32 = dict(dtype=torch.float32, device=device)
        self.act = act
        self.y_q = torch.empty(m, n, dtype=torch.uint8, device=device)
        self.dh_q = torch.empty(m, k, dtype=torch.uint8, device=device)
        self.dbias = torch.empty(k, **f32)
        self.scale_inv, self.amax = torch.empty(1, **f32), torch.zeros(1, **f32)
        self.slot, self.scale = torch.zeros(1, **f32), torch.ones(1, **f32)
        self.cfg = {(kind, p): te.quantizer_config(r, ROLE[p]) for kind, r in
                    (("current", CURRENT), ("delayed", DELAYED)) for p in ROLE}

    def forward(self, kind, h):
        if kind == "current":  # the amax (zeroed first), then the cast with its scale
            self.amax.zero_()
            _C._act_forward(h, self.act, amax=self.amax)
            _C._act_forward(h, self.act, config=self.cfg[kind, "forward"], y_q=self.y_q,
                            scale_inv=self.scale_inv, amax_in=self.amax)
        else:
            _C._act_forward(h, self.act, config=self.cfg[kind, "forward"], y_q=self.y_q,
                            scale_inv=self.scale_inv, scale=self.scale, amax=self.slot)

    def backward(self, kind, h, dy):
        if kind == "current":  # dbias in the amax run, then the cast run
            self.amax.zero_()
            _C._act_backward(dy, h, self.act, amax=self.amax, dbias=self.dbias)
            _C._act_backward(dy, h, self.act, config=self.cfg[kind, "backward"], dh_q=self.dh_q,
                             scale_inv=self.scale_inv, amax_in=self.amax)
        else:
            _C._act_backward(dy, h, self.act, config=self.cfg[kind, "backward"], dh_q=self.dh_q,
                             scale_inv=self.scale_inv, scale=self.scale, amax=self.slot,
                             dbias=self.dbias)

    def run(self, p, kind, h, dy):
        """The outputs of one pass and scaling, as CPU tensors by name."""
        self.slot.zero_()
        if p == "forward":
            self.forward(kind, h)
            out = {"codes": self.y_q}
        else:
            self.backward(kind, h, dy)
            out = {"codes": self.dh_q, "dbias": self.dbias}
        out.update(scale_inv=self.scale_inv, amax=self.amax if kind == "current" else self.slot)
        return {n: t.cpu().clone() for n, t in out.items()}


def check(act, p, h, dy, fused, device, check_rows):
    """Raises AssertionError if the fused pass is wrong. Leaves fused.scale at what a
    DelayedScaling history would give (fmax over the amax)."""
    fmax = 448.0 if p == "forward" else 57344.0
    fused.run(p, "current", h, dy)
    fused.scale.fill_(fmax / max(float(fused.amax), 1e-12))
    full = {kind: fused.run(p, kind, h, dy) for kind in ("current", "delayed")}
    if device == "cuda":
        hs, dys = h[:check_rows].contiguous(), dy[:check_rows].contiguous()
        cpu, dev = Fused(act, *hs.shape, "cpu"), Fused(act, *hs.shape, device)
        for f in (cpu, dev):
            f.scale.copy_(fused.scale)
        for kind in ("current", "delayed"):
            want, got = cpu.run(p, kind, hs.cpu(), dys.cpu()), dev.run(p, kind, hs, dys)
            for name in want:
                diff = int((bits(got[name]) != bits(want[name])).sum())
                assert diff == 0, f"{p} {kind} {name}: {diff} differ, CUDA vs the C reference"
            if kind == "delayed":  # the same scale: the full-size run's first rows are these
                a, b = bits(full[kind]["codes"][:check_rows]), bits(want["codes"])
                assert torch.equal(a, b), f"{p} {kind}: the full-size run's first rows differ"
    if p == "forward":
        ref = torch_forward(act, split(act, h.float()))
    else:
        ref = torch.cat(torch_backward(act, split(act, h.float()), dy.float())[0], dim=-1)
    fp8 = torch.float8_e4m3fn if p == "forward" else torch.float8_e5m2
    for kind in ("current", "delayed"):
        deq = full[kind]["codes"].to(h.device).view(fp8).float() * full[kind]["scale_inv"].to(
            h.device)
        err = float((deq.double() - ref.double()).norm() / ref.double().norm())
        assert 0.0 < err < BOUND[p], f"{p} {kind}: relative error {err:.3g} outside (0, {BOUND[p]})"


def runs_of(act, p, fused, sizes):
    """(label, fn(buffer), bytes moved, produces codes) per implementation."""
    h_b, n_b, y_b, codes_n, codes_k = sizes
    if p == "forward":
        return [
            (f"torch {act}", lambda b: torch_forward(act, b[2]), h_b + y_b, False),
            (f"torch {act} + te.ops.quantize (current)",
             lambda b: te.ops.quantize(torch_forward(act, b[2]), CURRENT, "input"),
             h_b + 3 * y_b + codes_n, True),
            ("tequant fused, current (amax run + cast run)",
             lambda b: fused.forward("current", b[0]), 2 * h_b + codes_n, True),
            ("tequant fused, delayed (one run)", lambda b: fused.forward("delayed", b[0]),
             h_b + codes_n, True)]
    return [
        (f"torch {act} backward + dbias", lambda b: torch_backward(act, b[2], b[1]),
         2 * (h_b + n_b) + h_b, False),
        (f"torch {act} backward + dbias + te.ops.quantize (current)",
         lambda b: [te.ops.quantize(g, CURRENT, "grad_output")
                    for g in torch_backward(act, b[2], b[1])[0]],
         3 * (h_b + n_b) + 2 * h_b + codes_k, True),
        ("tequant fused, current (amax + dbias run, cast run)",
         lambda b: fused.backward("current", b[0], b[1]), 2 * (h_b + n_b) + codes_k, True),
        ("tequant fused, delayed (one run with dbias)",
         lambda b: fused.backward("delayed", b[0], b[1]), h_b + n_b + codes_k, True)]


def main():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--shapes", default="8192x16384,8192x32768,8192x16384:fp32",
                    help="comma list of MxK[:bf16|fp16|fp32] (K = h's features; default bf16)")
    ap.add_argument("--acts", default="gelu,swiglu,relu", help=f"comma list of {', '.join(ACTS)}")
    ap.add_argument("--passes", default="forward,backward")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--buffers", type=int, default=3, help="input buffers rotated (>= 3)")
    ap.add_argument("--check-rows", type=int, default=256,
                    help="rows compared CUDA vs the C reference bit for bit")
    ap.add_argument("--out", help="also write the table to this Markdown file (appended)")
    args = benchutil.parse(ap)
    device = args.device
    timer = benchutil.timer(device)
    shapes = [benchutil.parse_mk(s) for s in args.shapes.split(",")]
    acts = [a.strip() for a in args.acts.split(",") if a.strip()]
    passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    for a in acts:
        if a not in ACTS:
            raise SystemExit(f"--acts: {a!r} is not one of {', '.join(ACTS)}")
    for p in passes:
        if p not in ROLE:
            raise SystemExit(f"--passes: {p!r} is neither forward nor backward")
    lines = [f"### Fused activation + FP8 codes vs torch ({benchutil.machine(device)})", "",
             f"median of {args.iters} calls after {args.warmup} warmup, {args.buffers} rotated "
             f"input buffers; \"vs\" columns: that time / this time (> 1: this is faster)", "",
             *benchutil.table_head(["act", "pass", "shape", "implementation", "time us",
                                    "GB/s moved", "GB/s in + codes", "vs torch",
                                    "vs torch + quantize"], 4)]
    failures = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for m, k, dname in shapes:
        dtype = DTYPES[dname]
        shape = f"{m}x{k} {dname}"
        elem = torch.tensor([], dtype=dtype).element_size()
        for act in acts:
            if act in GATED and k % 2:
                failures.append(f"{act} {shape}: a gated activation needs an even K")
                continue
            n = k // 2 if act in GATED else k
            sizes = (m * k * elem, m * n * elem, m * n * elem, m * n, m * k)
            buffers = []  # (h, dy, torch's parts of h)
            for _ in range(max(args.buffers, 1)):
                h = (torch.randn(m, k, generator=g) * 2).to(dtype).to(device)
                buffers.append((h, torch.randn(m, n, generator=g).to(dtype).to(device),
                                split(act, h)))
            fused = Fused(act, m, k, device)
            for p in passes:
                try:
                    check(act, p, *buffers[0][:2], fused, device, min(args.check_rows, m))
                except (AssertionError, RuntimeError, ValueError) as e:
                    failures.append(f"{act} {p} {shape}: {e}")
                    lines.append(f"| {act} | {p} | {shape} | WRONG: {benchutil.one_line(e)} "
                                 f"| | | | | |")
                    continue
                runs = runs_of(act, p, fused, sizes)
                times = [timer(fn, buffers, args.warmup, args.iters) for _, fn, _, _ in runs]
                in_codes = (sizes[0] if p == "forward" else sizes[0] + sizes[1]) + (
                    sizes[3] if p == "forward" else sizes[4])
                for (label, _, moved, codes), us in zip(runs, times):
                    eff = benchutil.num_text(in_codes / us / 1e3) if codes else "-"
                    lines.append(f"| {act} | {p} | {shape} | {label} | {us:.1f} | "
                                 f"{benchutil.num_text(moved / us / 1e3)} | {eff} | "
                                 f"{benchutil.ratio_text(times[0], us)} | "
                                 f"{benchutil.ratio_text(times[1], us) if codes else '-'} |")
            del fused, buffers
    return benchutil.finish("\n".join(lines), args.out, failures, "FAILED correctness checks")


if __name__ == "__main__":
    sys.exit(main())
