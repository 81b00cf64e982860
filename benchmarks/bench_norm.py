"""Fused norm forward (issue 24): tequant's LayerNorm / RMSNorm + FP8 codes in one kernel vs torch.

Checks first (CUDA bits against the C reference, codes against torch's norm), then times, per shape
and norm, with CUDA events over rotated input buffers: torch's layer_norm / rms_norm alone, torch's
norm followed by te.ops.quantize (current scaling), and tequant's fused forward (tq_norm_forward
through _C._norm_forward) with current scaling (two runs: the amax run, then the cast run) and with
delayed scaling (one run). Prints us, GB/s and the ratios to torch; the fused goal (issue 24) is
>= 2 TB/s on x + codes (<= 100 us at 16384x4096 bf16) for K in 1024..16384. With --passes
backward (default: both), a second table: torch autograd's norm backward (dx, dgamma and, for
LayerNorm, dbeta) against tequant's (tq_norm_backward through _C._norm_bwd), checked first
(CUDA against the C reference bit for bit on the first rows, dx and dgamma against torch's
float32 backward).
Run: python3 benchmarks/bench_norm.py [--shapes ...] [--out FILE] (see below)
"""
import os
import sys

import torch
import torch.nn.functional as F

import tequant as te
from tequant import _C
from tequant.recipe import DelayedScaling, Float8CurrentScaling

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when not run as a script
import benchutil  # noqa: E402

# Per shape (MxK:dtype) and norm (LayerNorm with beta, RMSNorm), same run:
#   1. correctness first: the fused forward on CUDA equals the C reference bit for bit (codes,
#      scale_inv, mean, rstd, amax) on the first --check-rows rows run alone, and the full-size
#      run's first rows equal them too (several rows per row group there); the fused codes
#      dequantize to within the E4M3 bound of torch's float32 norm (any device);
#   2. timing with CUDA events around each call (median of --iters after --warmup), rotating
#      --buffers inputs so L2 never holds x, the GPU held back while the calls are queued
#      (benchutil.time_cuda): y.copy_(x) (the ceiling), torch's norm alone (its output in x's
#      dtype), torch's norm + te.ops.quantize(Float8CurrentScaling) of its output, the fused
#      forward with current scaling (zero the amax, the amax run, the cast run writing codes, mean
#      and rstd) and with delayed scaling (one run: codes, mean, rstd and the history slot's amax).
# Bytes: "moved" = what an implementation reads and writes by design (x read per pass, outputs
# written, an intermediate written and read again); "x + codes" = x read once + the FP8 codes, the
# fused task's minimum (the goal's measure).
#
#     python3 benchmarks/bench_norm.py [--shapes 16384x4096,8192x8192,2048x32768,16384x4096:fp32]
#         [--norms LayerNorm,RMSNorm] [--iters 20] [--out docs/results/bench_norm.md]
#     python3 benchmarks/bench_norm.py --device cpu --shapes 64x1024,16x4096:fp32   # quick check

DTYPES = benchutil.FLOAT_DTYPES
bits = benchutil.bits
EPS = 1e-5
E4M3_BOUND = 0.05  # relative Frobenius error of E4M3 codes against the float32 norm (randn data)
GOAL_GBS = 2000.0  # x + codes, K in 1024..16384 (issue 24)
CURRENT = Float8CurrentScaling()
DELAYED = DelayedScaling()


def torch_norm(x, gamma, beta, norm):
    k = (x.shape[-1],)
    if norm == "LayerNorm":
        return F.layer_norm(x, k, gamma, beta, EPS)
    return F.rms_norm(x, k, gamma, EPS)


class Fused:
    """tequant's fused forward of one (norm, gamma, beta) with its output buffers, made once (as
    a module would hold them; outputs reused across calls)."""

    def __init__(self, norm, gamma, beta, m, k, device):
        self.norm, self.gamma, self.beta = norm, gamma, beta if norm == "LayerNorm" else None
        f32 = dict(dtype=torch.float32, device=device)
        self.codes = torch.empty(m, k, dtype=torch.uint8, device=device)
        self.scale_inv = torch.empty(1, **f32)
        self.mean = torch.empty(m, **f32) if norm == "LayerNorm" else None
        self.rstd = torch.empty(m, **f32)
        self.amax = torch.zeros(1, **f32)       # current scaling: the amax run's output
        self.slot = torch.zeros(1, **f32)       # delayed scaling: the history slot
        self.scale = torch.ones(1, **f32)       # delayed scaling: the scale cast with
        self.current_cfg = te.quantizer_config(CURRENT, "input")
        self.delayed_cfg = te.quantizer_config(DELAYED, "input")

    def stats(self):
        return {"rstd": self.rstd, **({"mean": self.mean} if self.mean is not None else {})}

    def current(self, x):
        """Float8CurrentScaling: the amax of y (zeroed first), then the cast with its scale."""
        self.amax.zero_()
        _C._norm_forward(x, self.gamma, self.norm, eps=EPS, beta=self.beta, amax=self.amax)
        _C._norm_forward(x, self.gamma, self.norm, eps=EPS, beta=self.beta, config=self.current_cfg,
                         y_q=self.codes, scale_inv=self.scale_inv, amax_in=self.amax,
                         **self.stats())

    def delayed(self, x):
        """DelayedScaling: the codes with the given scale and the slot's amax in one run."""
        _C._norm_forward(x, self.gamma, self.norm, eps=EPS, beta=self.beta, config=self.delayed_cfg,
                         y_q=self.codes, scale_inv=self.scale_inv, scale=self.scale,
                         amax=self.slot, **self.stats())

    def outputs(self):
        out = {"codes": self.codes, "scale_inv": self.scale_inv, "rstd": self.rstd,
               "amax": self.amax, "slot": self.slot}
        if self.mean is not None:
            out["mean"] = self.mean
        return out


def run_both(fused, x):
    """The fused outputs of current scaling, then of delayed scaling (slot zeroed first), as CPU
    tensors by name ('current codes', 'delayed codes', ...)."""
    out = {}
    fused.current(x)
    out.update({f"current {n}": t.cpu().clone() for n, t in fused.outputs().items()
                if n != "slot"})
    fused.slot.zero_()
    fused.delayed(x)
    out.update({f"delayed {n}": t.cpu().clone() for n, t in fused.outputs().items()
                if n != "amax"})
    return out


def check(x, gamma, beta, norm, fused, device, check_rows):
    """Raises AssertionError if the fused forward is wrong. Leaves fused.scale at what a
    DelayedScaling history would give (the fmax over the amax of y)."""
    xs = x[:check_rows]
    cpu = Fused(norm, gamma.cpu(), None if beta is None else beta.cpu(), *xs.shape, "cpu")
    dev_rows = Fused(norm, gamma, beta, *xs.shape, device)
    fused.current(x)
    fused.scale.fill_(448.0 / max(float(fused.amax), 1e-12))
    for f in (cpu, dev_rows):
        f.scale.copy_(fused.scale)
    full = run_both(fused, x)
    if device == "cuda":
        want = run_both(cpu, xs.cpu())
        got = run_both(dev_rows, xs.contiguous())
        for name in want:
            diff = int((bits(got[name]) != bits(want[name])).sum())
            assert diff == 0, f"{name}: {diff} elements differ between CUDA and the C reference"
        # current scaling's scale comes from the whole tensor's amax, so its codes of the
        # first rows alone differ from the full run's; delayed codes share one scale
        for name in want:
            if name == "delayed codes" or "mean" in name or "rstd" in name:
                a, b = bits(full[name][:check_rows]), bits(want[name])
                assert torch.equal(a, b), f"{name}: the full-size run's first rows differ"
    # the codes against torch's float32 norm (both scalings)
    y32 = torch_norm(x.float(), gamma.float(), None if beta is None else beta.float(), norm)
    for kind in ("current", "delayed"):
        codes = full[f"{kind} codes"].to(x.device).view(torch.float8_e4m3fn)
        deq = codes.float() * full[f"{kind} scale_inv"].to(x.device)
        err = float((deq.double() - y32.double()).norm() / y32.double().norm())
        assert 0.0 < err < E4M3_BOUND, f"{kind}: relative error {err:.3g} outside (0, {E4M3_BOUND})"


BACKWARD_BOUND = 0.01  # relative Frobenius error of dx / dgamma against torch's float32 backward


class Backward:
    """One (norm, shape)'s backward inputs per buffer: x, dy and the forward's mean / rstd (from
    tequant's own forward, as te.LayerNorm saves them), and the two timed calls."""

    def __init__(self, norm, gamma, beta, xs, dys):
        self.norm, self.gamma, self.beta = norm, gamma, beta
        self.items = [(x, dy) + self.stats(x) for x, dy in zip(xs, dys)]
        self.graphs = {}  # id(item) -> (x, params, y): torch's forward made once per item

    def stats(self, x):
        outs = _C._norm_fwd(x, self.gamma, self.beta, self.norm, EPS, False, False, True, None,
                            None, None, 0, False)
        return (outs[0], outs[1]) if self.norm == "LayerNorm" else (None, outs[0])

    def tequant(self, item):
        x, dy, mean, rstd = item
        return _C._norm_bwd(dy, x, self.gamma, mean, rstd, self.norm, False,
                            self.beta is not None, self.gamma.dtype)

    def torch(self, item):
        key = id(item)
        if key not in self.graphs:
            x = item[0].detach().requires_grad_()
            gamma = self.gamma.detach().requires_grad_()
            beta = None if self.beta is None else self.beta.detach().requires_grad_()
            params = [gamma] + ([beta] if beta is not None else [])
            self.graphs[key] = (x, params, torch_norm(x, gamma, beta, self.norm))
        x, params, y = self.graphs[key]
        return torch.autograd.grad(y, [x] + params, item[1], retain_graph=True)


def check_backward(bwd, device, check_rows):
    """Raises AssertionError if tequant's backward is wrong: on CUDA the first check_rows rows
    equal the C reference's bits (every output), and on any device dx / dgamma are within
    BACKWARD_BOUND of torch's float32 backward."""
    x, dy, mean, rstd = bwd.items[0]
    got = bwd.tequant(bwd.items[0])
    if device == "cuda":
        r = check_rows
        small = Backward(bwd.norm, bwd.gamma, bwd.beta, [x[:r].contiguous()], [dy[:r].contiguous()])
        cpu = Backward(bwd.norm, bwd.gamma.cpu(), None if bwd.beta is None else bwd.beta.cpu(),
                       [x[:r].cpu()], [dy[:r].cpu()])
        for i, (a, b) in enumerate(zip(small.tequant(small.items[0]), cpu.tequant(cpu.items[0]))):
            diff = int((bits(a.cpu()) != bits(b)).sum())
            assert diff == 0, f"backward output {i}: {diff} elements differ from the C reference"
    ref = Backward(bwd.norm, bwd.gamma.float(), None if bwd.beta is None else bwd.beta.float(),
                   [x.float()], [dy.float()])
    want = ref.torch(ref.items[0])
    for name, a, b in (("dx", got[0], want[0]), ("dgamma", got[1], want[1])):
        err = float((a.double() - b.double()).norm() / b.double().norm())
        assert err < BACKWARD_BOUND, f"{name}: relative error {err:.3g} >= {BACKWARD_BOUND}"


def backward_rows(norm, shape, bwd, timer, args, x_bytes):
    """The backward table's rows of one (norm, shape): torch autograd, then tequant."""
    name = "layer_norm" if norm == "LayerNorm" else "rms_norm"
    grads = "dx, dgamma, dbeta" if bwd.beta is not None else "dx, dgamma"
    runs = [(f"torch {name} backward (autograd: {grads})", bwd.torch),
            (f"tequant _C._norm_bwd ({grads})", bwd.tequant)]
    times = [timer(fn, bwd.items, args.warmup, args.iters) for _, fn in runs]
    return [f"| {norm} | {shape} | {label} | {us:.1f} | "
            f"{benchutil.num_text(3 * x_bytes / us / 1e3)} | {benchutil.ratio_text(times[0], us)} |"
            for (label, _), us in zip(runs, times)]


def main():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--shapes", default="16384x4096,8192x8192,2048x32768,16384x4096:fp32",
                    help="comma list of MxK[:bf16|fp16|fp32] (default dtype bf16)")
    ap.add_argument("--norms", default="LayerNorm,RMSNorm")
    ap.add_argument("--passes", default="forward,backward", help="forward, backward or both")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--buffers", type=int, default=3, help="input buffers rotated (>= 3)")
    ap.add_argument("--check-rows", type=int, default=256,
                    help="rows of x compared CUDA vs the C reference bit for bit")
    ap.add_argument("--out", help="also write the table to this Markdown file (appended)")
    args = benchutil.parse(ap)
    device = args.device
    timer = benchutil.timer(device)
    shapes = [benchutil.parse_mk(s) for s in args.shapes.split(",")]
    norms = [n.strip() for n in args.norms.split(",") if n.strip()]
    for n in norms:
        if n not in ("LayerNorm", "RMSNorm"):
            raise SystemExit(f"--norms: {n!r} is neither LayerNorm nor RMSNorm")
    passes = [q.strip() for q in args.passes.split(",") if q.strip()]
    if not passes or any(q not in ("forward", "backward") for q in passes):
        raise SystemExit(f"--passes: {args.passes!r}: expected forward, backward or both")
    lines = [f"### Fused norm forward + FP8 codes vs torch ({benchutil.machine(device)})", "",
             f"median of {args.iters} calls after {args.warmup} warmup, {args.buffers} rotated "
             f"input buffers; goal (issue 24): the fused forward >= {GOAL_GBS / 1000:.1f} TB/s on "
             f"x + codes for K in 1024..16384, and no slower than torch's norm alone; "
             f"\"vs\" columns: that time / this time (> 1: this is faster)", "",
             *benchutil.table_head(["norm", "shape", "implementation", "time us", "GB/s moved",
                                    "GB/s x + codes", "vs torch norm", "vs torch + quantize"],
                                   3)]
    failures, back = [], []
    g = torch.Generator(device="cpu").manual_seed(0)
    for m, k, dname in shapes:
        dtype = DTYPES[dname]
        shape = f"{m}x{k} {dname}"
        elem = torch.tensor([], dtype=dtype).element_size()
        x_bytes, y_bytes, codes_bytes = m * k * elem, m * k * elem, m * k
        buffers = [(torch.randn(m, k, generator=g) * 2 + 0.5).to(dtype).to(device)
                   for _ in range(max(args.buffers, 1))]
        gamma = (torch.rand(k, generator=g) + 0.5).to(dtype).to(device)
        beta = torch.randn(k, generator=g).to(dtype).to(device)
        if "backward" in passes:
            dys = [torch.randn(m, k, generator=g).to(dtype).to(device) for _ in buffers]
            for norm in norms:
                try:
                    bwd = Backward(norm, gamma, beta if norm == "LayerNorm" else None, buffers,
                                   dys)
                    check_backward(bwd, device, min(args.check_rows, m))
                except (AssertionError, RuntimeError, ValueError) as e:
                    failures.append(f"{norm} {shape} backward: {e}")
                    back.append(f"| {norm} | {shape} | WRONG: {benchutil.one_line(e)} | | | |")
                    continue
                back += backward_rows(norm, shape, bwd, timer, args, x_bytes)
                del bwd
            del dys
        if "forward" not in passes:
            continue
        out = torch.empty_like(buffers[0])
        copy_us = timer(lambda b: out.copy_(b), buffers, args.warmup, args.iters)
        lines.append(f"| - | {shape} | y.copy_(x) (device copy) | {copy_us:.1f} | "
                     f"{benchutil.num_text(2 * x_bytes / copy_us / 1e3)} | - | - | - |")
        del out
        for norm in norms:
            b = beta if norm == "LayerNorm" else None
            stats_bytes = m * 4 * (2 if norm == "LayerNorm" else 1)
            fused = Fused(norm, gamma, b, m, k, device)
            try:
                check(buffers[0], gamma, b, norm, fused, device, min(args.check_rows, m))
            except (AssertionError, RuntimeError, ValueError) as e:
                failures.append(f"{norm} {shape}: {e}")
                lines.append(f"| {norm} | {shape} | WRONG: {benchutil.one_line(e)} "
                             f"| | | | | |")
                continue
            name = "layer_norm" if norm == "LayerNorm" else "rms_norm"
            runs = [  # label, fn, bytes moved, produces codes
                (f"torch {name}", lambda x: torch_norm(x, gamma, b, norm), x_bytes + y_bytes,
                 False),
                (f"torch {name} + te.ops.quantize (current)",
                 lambda x: te.ops.quantize(torch_norm(x, gamma, b, norm), CURRENT, "input"),
                 x_bytes + 3 * y_bytes + codes_bytes, True),
                ("tequant fused, current (amax run + cast run)", fused.current,
                 2 * x_bytes + codes_bytes + stats_bytes, True),
                ("tequant fused, delayed (one run)", fused.delayed,
                 x_bytes + codes_bytes + stats_bytes, True),
            ]
            times = [timer(fn, buffers, args.warmup, args.iters) for _, fn, _, _ in runs]
            torch_us, quant_us = times[0], times[1]
            for (label, _, moved, codes), us in zip(runs, times):
                eff = benchutil.num_text((x_bytes + codes_bytes) / us / 1e3) if codes else "-"
                lines.append(f"| {norm} | {shape} | {label} | {us:.1f} | "
                             f"{benchutil.num_text(moved / us / 1e3)} | {eff} | "
                             f"{benchutil.ratio_text(torch_us, us)} | "
                             f"{benchutil.ratio_text(quant_us, us) if codes else '-'} |")
            del fused
        del buffers
    if "forward" not in passes:
        lines = []
    if "backward" in passes:
        lines += ([""] if lines else []) + [
            f"### Norm backward vs torch autograd ({benchutil.machine(device)})", "",
            f"median of {args.iters} calls after {args.warmup} warmup, {args.buffers} rotated "
            f"(x, dy) buffers; GB/s moved: x and dy read, dx written (3 M K elements); torch's "
            f"forward graph made once per buffer, its backward timed; \"vs\": torch's time / "
            f"this time (> 1: this is faster)", "",
            *benchutil.table_head(["norm", "shape", "implementation", "time us", "GB/s moved",
                                   "vs torch backward"], 3), *back]
    return benchutil.finish("\n".join(lines), args.out, failures, "FAILED correctness checks")


if __name__ == "__main__":
    sys.exit(main())
