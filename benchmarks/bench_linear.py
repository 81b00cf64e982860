"""P5-P7: te.Linear fwd+bwd vs torch.nn.Linear bf16, vs the same GEMMs pre-quantized; saved bytes.

Per shape (PERFORMANCE.md's GEMM set QKV, proj, FC1, FC2 at M=15872, plus 8192^3 and the small
M=2048 1024->1024) and recipe, in one run:
- te.Linear fwd+bwd (bf16 params and activations, inside `with te.autocast(recipe=r):`, backward
  outside; is_first_microbatch=None, so W is requantized every step: quantization included) vs
  torch.nn.Linear bf16 with the same weights; both set their grads to None first each step.
- The ceiling: the same three GEMMs on operands quantized once, outside the timed region, with
  te.ops.quantize in the roles and directions te.Linear uses (x "input", W "weight", dy
  "grad_output", each rowwise + columnwise; DelayedScaling with scale fmax / amax), multiplied by
  te.ops.gemm with the recipe's split-accumulator choices (fprop y = x W^T, dgrad dx = dy W,
  wgrad dW = dy^T x, bf16 outputs), vs the three bf16 torch.mm.
- P5 = (nn.Linear time / te.Linear time) / (3 bf16 mm time / 3 pre-quantized GEMMs time), target
  >= 0.95 for the FP8 recipes (delayed, current, block). P6: te.Linear / nn.Linear time for the
  (on Hopper emulated) MXFP8 and NVFP4 recipes, target <= 1.2x. Both over the GEMM-set totals.
- P7: activation bytes a Linear's forward leaves held for its backward, vs nn.Linear bf16 (which
  keeps its input x), target <= 0.55x for the FP8 recipes; see linear_memory.held_bytes() for what is counted.
- Quantization floor (CUDA): the time te.Linear's three quantizations (x, W, dy, both directions
  each) would take moving only their minimal bytes (QUANT_BYTES) at the device-copy bandwidth
  measured in the same run. "bound" in the summary is P5 (P6) with te.Linear = pre-quantized
  GEMMs + that floor: what an unfused Linear can reach at best.
Checked first (one step on the first buffer after one warm-up step): te.Linear's y, dx, dW vs
nn.Linear's, and the pre-quantized GEMMs vs the bf16 ones, relative Frobenius error in (0, bound)
with bound ERR_BOUND of the coarser operand format (y also > QUANTIZED_MIN: it was quantized).
Timing: benchutil.time_cuda (CUDA events behind a sleep kernel, median) over (x, dy) buffers
rotated to span >= 4x L2; wall us/call: interleaved loops of every row (benchutil.time_host,
synchronized at the loop ends), where the small shape shows host overhead. --device cpu: tiny
shapes, te's C reference (make bench without a GPU); the times say nothing about GPU performance.

Run: python3 benchmarks/bench_linear.py [--quick] [--shapes ...] [--recipes ...] [--bias]
         [--iters N] [--out FILE]
"""
import os
import sys

import torch

import tequant as te

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when not run as a script
import benchutil  # noqa: E402
from linear_memory import (alloc_counter, cached_weight_bytes, drop_weight_cache,  # noqa: E402
                           held_bytes)

BF16 = torch.bfloat16
MIB = 2.0 ** 20
DEFAULT_SHAPES = {"cuda": "qkv,proj,fc1,fc2,8192,small", "cpu": "256x256x256,128x512x256"}
QUICK_SHAPES = {"cuda": "proj,small", "cpu": "128x256x256"}
# Relative Frobenius error vs bf16 on randn data, by the coarser operand format of a GEMM (measured
# on CPU: E4M3 x E4M3 ~0.037, E5M2 dy ~0.059, NVFP4 0.15-0.18); y must also exceed QUANTIZED_MIN.
ERR_BOUND = {"E4M3": 0.06, "E5M2": 0.1, "E2M1": 0.25}
QUANTIZED_MIN = 0.01
P5_TARGET, P6_TARGET, P7_TARGET = 0.95, 1.2, 0.55
EMULATED = ("mxfp8", "nvfp4")
# Minimal bytes per element of a quantized operand, both directions: the bf16 reads (one per pass
# over it: current scaling and NVFP4 need an amax pass first) + the codes and scales written.
QUANT_BYTES = {"delayed": 2 + 2, "current": 2 * 2 + 2, "block": 2 + 2 + 2 * 4 / 128,
               "mxfp8": 2 + 2 + 2 / 32, "nvfp4": 2 * 2 + 1 + 2 / 16}
# Shapes under SMALL_FLOPS (fwd+bwd) on CUDA get SMALL_SCALE x the timed steps and wall calls.
SMALL_FLOPS, SMALL_SCALE = 1e11, 3  # 60 steps x ~0.5 ms host fit the sleep kernel


# --- Modules and steps ---------------------------------------------------------------------------

def make_modules(k, n, bias, device, seed):
    torch.manual_seed(seed)
    lin = te.Linear(k, n, bias=bias, params_dtype=BF16, device=device)
    ref = torch.nn.Linear(k, n, bias=bias, dtype=BF16, device=device)
    with torch.no_grad():
        ref.weight.copy_(lin.weight)
        if bias:
            lin.bias.copy_(ref.bias)  # nn.Linear's uniform init, not te's zeros: a real bias
    return lin, ref


def ref_step(ref):
    def step(buf):
        x, dy = buf
        benchutil.clear_grads(ref, x)
        ref(x).backward(dy)
    return step


def te_step(lin, recipe):
    autocast = te.autocast

    def step(buf):
        x, dy = buf
        benchutil.clear_grads(lin, x)
        with autocast(recipe=recipe):
            y = lin(x)
        y.backward(dy)
    return step


def run_step(step_module, x, dy, recipe=None):
    """(y, dx, dW) of one fwd+bwd step."""
    benchutil.clear_grads(step_module, x)
    if recipe is None:
        y = step_module(x)
    else:
        with te.autocast(recipe=recipe):
            y = step_module(x)
    y.backward(dy)
    return y.detach(), x.grad, step_module.weight.grad


def bounds(recipe):
    """Error bounds of (y, dx, dW): the coarser format of each GEMM's operands."""
    fmt = {role: te.quantizer_config(recipe, role).format
           for role in ("input", "weight", "grad_output")}

    def worst(*roles):
        return max(ERR_BOUND.get(fmt[r], max(ERR_BOUND.values())) for r in roles)
    return worst("input", "weight"), worst("grad_output", "weight"), worst("grad_output", "input")


def check_errors(name, errs, bnds):
    """None, or why (y, dx, dW) errors fail their bounds."""
    bad = [f"{what} error {e:.3g} outside ({lo}, {b})"
           for what, e, b, lo in zip(("y", "dx", "dW"), errs, bnds, (QUANTIZED_MIN, 0, 0))
           if not (lo < e < b)]
    return f"WRONG ({name}): " + "; ".join(bad) if bad else None


# --- The ceiling: three GEMMs on pre-quantized operands ------------------------------------------

def quantize_like_linear(t, recipe, role):
    """t quantized in both directions with the quantizer te.Linear uses for role; DelayedScaling
    casts with fmax / amax(t) (te.Linear's scale after a step of history)."""
    t = t.detach()
    config = te.quantizer_config(recipe, role)
    kw = {}
    if config.scaling == "delayed":
        amax = t.abs().amax().float().clamp_min(1e-12)
        kw["scale"] = (config.fmax * 2.0 ** -config.margin / amax).reshape(1)
    return te.ops.quantize(t, recipe, role, rowwise=True, columnwise=True, **kw)


def prequantize(buffers, weight, recipe):
    qw = quantize_like_linear(weight, recipe, "weight")
    return [(quantize_like_linear(x, recipe, "input"), qw,
             quantize_like_linear(dy, recipe, "grad_output")) for x, dy in buffers]


def qgemm_call(recipe):
    split = te.gemm_split_accumulator(recipe)  # fprop, dgrad, wgrad, as te.Linear takes them
    gemm = te.ops.gemm

    def call(ops):
        qx, qw, qdy = ops
        return (gemm(qx, qw, transpose_b=True, out_dtype=BF16, use_split_accumulator=split[0]),
                gemm(qdy, qw, out_dtype=BF16, use_split_accumulator=split[1]),
                gemm(qdy, qx, transpose_a=True, out_dtype=BF16, use_split_accumulator=split[2]))
    return call


def mm_call(weight):
    w = weight.detach()

    def call(buf):
        x, dy = buf[0].detach(), buf[1]
        return torch.mm(x, w.t()), torch.mm(dy, w), torch.mm(dy.t(), x)
    return call


# --- One shape -----------------------------------------------------------------------------------

class Row:
    def __init__(self, name, recipe):
        self.name, self.recipe = name, recipe  # recipe None: the bf16 baseline
        self.status = ""       # "" when measured, else why not
        self.errs = None       # (y, dx, dW) relative errors vs nn.Linear
        self.us = None         # fwd+bwd, GPU events (CPU: perf_counter) median
        self.gemm_us = None    # the three GEMMs (pre-quantized / bf16 torch.mm)
        self.wall_us = None    # wall time per call in the interleaved loops
        self.act = None        # (allocator, graph) activation bytes held for backward
        self.wside = None      # (allocator, graph) weight-side bytes held (quantized W)
        self.floor_us = None   # te.Linear's quantizations at copy bandwidth (minimal bytes)


def run_shape(shape, recipes, args, device, notes, failures):
    key, label, m, k, n = shape
    named = key in benchutil.GEMM_SHAPES
    shape_label = f"{label} M={m} {k}->{n}" if named else f"M={m} {k}->{n}"
    timer = benchutil.timer(device)
    scale = SMALL_SCALE if device == "cuda" and 6.0 * m * k * n < SMALL_FLOPS else 1
    iters, wall_calls = args.iters * scale, args.wall_calls * scale
    g = torch.Generator(device=device).manual_seed(1234)
    nbuf = benchutil.rotated_count(device, args.buffers, (m * k + m * n) * 2)
    buffers = [(torch.randn(m, k, generator=g, device=device).to(BF16).requires_grad_(),
                torch.randn(m, n, generator=g, device=device).to(BF16)) for _ in range(nbuf)]
    lin, ref = make_modules(k, n, args.bias, device, seed=4321)
    counter = alloc_counter(device)
    base = Row("bf16", None)
    rows = [base] + [Row(name, r) for name, r in recipes]
    if args.copy_bytes_per_us:
        for row in rows[1:]:
            row.floor_us = (m * k + n * k + m * n) * QUANT_BYTES[row.name] / args.copy_bytes_per_us

    # References: nn.Linear's step and the three bf16 GEMMs on the first buffer.
    x0, dy0 = buffers[0]
    ref_out = run_step(ref, x0, dy0)
    ref_out = tuple(t.clone() for t in ref_out)
    mm = mm_call(ref.weight)
    mm_out = mm(buffers[0])  # also the reference of the pre-quantized GEMMs (no bias)
    mm_vs_nn = (mm_out[0] + ref.bias.detach() if args.bias else mm_out[0],) + mm_out[1:]
    base.errs = tuple(benchutil.rel_err(a, b, dtype=torch.float32)
                      for a, b in zip(mm_vs_nn, ref_out))
    del mm_vs_nn
    steps = {}
    for row in rows[1:]:
        try:
            te_step(lin, row.recipe)(buffers[-1])  # warm-up (DelayedScaling: a step of history)
            out = run_step(lin, x0, dy0, row.recipe)
            row.errs = tuple(benchutil.rel_err(a, b, dtype=torch.float32)
                             for a, b in zip(out, ref_out))
            del out
            why = check_errors("te.Linear vs nn.Linear", row.errs, bounds(row.recipe))
        except Exception as e:  # noqa: BLE001 (one recipe must not stop the others)
            why = f"error: {benchutil.one_line(benchutil.exc_text(e))}"
            if device == "cuda":
                torch.cuda.empty_cache()
        if why:
            row.status = why
            failures.append(f"{shape_label} {row.name}: {why}")
        else:
            steps[row.name] = te_step(lin, row.recipe)
    benchutil.clear_grads(lin, x0)
    benchutil.clear_grads(ref, x0)

    # P7: bytes held for backward (after the warm-up: one-time allocations are not counted).
    base.act = held_bytes(ref, x0, dy0, counter)
    base.wside = (0 if counter else None, 0)
    for row in rows[1:]:
        if row.name not in steps:
            continue
        try:
            drop_weight_cache(lin, row.recipe, x0)
            full = held_bytes(lin, x0, dy0, counter, row.recipe)
            with torch.no_grad(), te.autocast(recipe=row.recipe):  # caches the quantized W
                lin(x0[:16].detach(), is_first_microbatch=True)
            qw = cached_weight_bytes(lin)
            act = held_bytes(lin, x0, dy0, counter, row.recipe, is_first_microbatch=False)
            drop_weight_cache(lin, row.recipe, x0)
            # allocator: the cached-W run holds activations only; the default run adds W's side.
            # graph: the default run's graph minus W quantized the same way (the cached one).
            row.act = (act[0], full[1] - qw)
            row.wside = (None if counter is None else full[0] - act[0], qw)
        except Exception as e:  # noqa: BLE001
            notes.append(f"{shape_label} {row.name}: bytes held not measured: "
                         f"{benchutil.exc_text(e)}")
    if device == "cuda":
        torch.cuda.empty_cache()

    # Timing: GPU events per step, then the three GEMMs (bf16 and pre-quantized).
    base.us = timer(ref_step(ref), buffers, args.warmup, iters)
    base.gemm_us = timer(mm, buffers, args.warmup, iters)
    calls = {"bf16": ref_step(ref)}
    for row in rows[1:]:
        if row.name not in steps:
            continue
        try:
            row.us = timer(steps[row.name], buffers, args.warmup, iters)
        except Exception as e:  # noqa: BLE001
            row.status = f"error (timing): {benchutil.one_line(benchutil.exc_text(e))}"
            failures.append(f"{shape_label} {row.name}: timing: {benchutil.exc_text(e)}")
            continue
        calls[row.name] = steps[row.name]
        try:
            ops = prequantize(buffers, lin.weight, row.recipe)
            qcall = qgemm_call(row.recipe)
            errs = tuple(benchutil.rel_err(a, b, dtype=torch.float32)
                         for a, b in zip(qcall(ops[0]), mm_out))
            why = check_errors("pre-quantized GEMMs vs bf16", errs, bounds(row.recipe))
            if why:
                notes.append(f"{shape_label} {row.name}: {why}")
                failures.append(f"{shape_label} {row.name}: {why}")
            else:
                row.gemm_us = timer(qcall, ops, args.warmup, iters)
            del ops
        except Exception as e:  # noqa: BLE001
            notes.append(f"{shape_label} {row.name}: pre-quantized GEMMs: "
                         f"{benchutil.exc_text(e)}")
            failures.append(f"{shape_label} {row.name}: pre-quantized GEMMs: "
                            f"{benchutil.exc_text(e)}")
        if device == "cuda":
            torch.cuda.empty_cache()

    # Wall time per call: interleaved loops of every row, synchronized at the loop ends.
    counters = {}

    def looped(name, step, bufs):
        def fn():
            i = counters[name] = counters.get(name, -1) + 1
            step(bufs[i % len(bufs)])
        return fn

    names = list(calls)
    walls = benchutil.time_host([looped(nm, calls[nm], buffers) for nm in names], device,
                                wall_calls, args.wall_repeats)
    for row in rows:
        if row.name in calls:
            row.wall_us = walls[names.index(row.name)]
    del buffers, ref_out, mm_out
    del lin, ref
    if device == "cuda":
        torch.cuda.empty_cache()
    return shape_label, (m, k, n), rows


# --- Output --------------------------------------------------------------------------------------

def mib(v):
    return "-" if v is None else "0" if v == 0 else benchutil.num_text(v / MIB)


def speedup(num, den):
    return num / den if num and den else None


def p5_of(base, row, lin_us=None):
    s_lin = speedup(base.us, row.us if lin_us is None else lin_us)
    s_gemm = speedup(base.gemm_us, row.gemm_us)
    return s_lin / s_gemm if s_lin and s_gemm else None


def floor_total(row):
    """Pre-quantized GEMMs + quantization floor: the best an unfused te.Linear step can take."""
    return row.gemm_us + row.floor_us if row.gemm_us and row.floor_us else None


def p5_bound(base, row):
    best = floor_total(row)
    return p5_of(base, row, best) if best else None


def copy_bytes_per_us(device, args):
    """Device-copy bandwidth (bytes read + written per us) of y.copy_(x), 256 MiB bf16, rotated."""
    if device != "cuda":
        return None
    bufs = [torch.randn(2 ** 27, device=device).to(BF16) for _ in range(2)]
    out = torch.empty_like(bufs[0])
    us = benchutil.time_cuda(lambda b: out.copy_(b), bufs, args.warmup, args.iters)
    nbytes = 2 * bufs[0].numel() * bufs[0].element_size()
    del bufs, out
    torch.cuda.empty_cache()
    return nbytes / us


def fmt(v, spec=".2f", suffix=""):
    return "-" if v is None else f"{v:{spec}}{suffix}"


def totals(results, keys):
    """A Row per recipe summing us and bytes over the shapes keys (None where any is missing)."""
    chosen = [rows for skey, _, _, rows in results if skey in keys]
    out = []
    for i, row in enumerate(chosen[0]):
        t = Row(row.name, row.recipe)
        group = [rows[i] for rows in chosen]
        for attr in ("us", "gemm_us", "wall_us", "floor_us"):
            vals = [getattr(r, attr) for r in group]
            setattr(t, attr, sum(vals) if all(v is not None for v in vals) else None)
        for attr in ("act", "wside"):
            pairs = [getattr(r, attr) for r in group]
            if all(p is not None for p in pairs):
                setattr(t, attr, tuple(None if any(p[j] is None for p in pairs)
                                       else sum(p[j] for p in pairs) for j in range(2)))
        t.status = next((r.status for r in group if r.status), "")
        out.append(t)
    return out


def time_table(results, set_rows, flops_set):
    lines = benchutil.table_head(
        ["shape", "recipe", "fwd+bwd us", "TFLOP/s", "speedup vs nn.Linear bf16",
         "3 GEMMs us (pre-quantized / bf16 mm)", "GEMM speedup vs bf16", "P5 (ratio of speedups)",
         "te.Linear - GEMMs us", "quantization floor us", "P5 bound",
         "wall us/call (loop)", "rel err y / dx / dW"], 2)
    entries = [(label, flops, rows) for _, label, (m, k, n), rows in results
               for flops in (6.0 * m * k * n,)]
    if set_rows:
        entries.append(("GEMM set total (QKV+proj+FC1+FC2)", flops_set, set_rows))
    for label, flops, rows in entries:
        base = rows[0]
        for r in rows:
            name = "nn.Linear bf16 / torch.mm (baseline)" if r.recipe is None else r.name
            err = "-" if r.errs is None else " / ".join(f"{e:.2g}" for e in r.errs)
            if r.us is None:
                lines.append(f"| {label} | {name} | {r.status or 'not measured'} | | | | | | | "
                             f"| | | {err} |")
                continue
            lines.append(
                f"| {label} | {name} | {r.us:.1f} | {benchutil.num_text(flops / r.us / 1e6)} | "
                f"{benchutil.ratio_text(base.us, r.us)} | {fmt(r.gemm_us, '.1f')} | "
                f"{benchutil.ratio_text(base.gemm_us, r.gemm_us)} | "
                f"{'-' if r.recipe is None else fmt(p5_of(base, r), '.3f')} | "
                f"{fmt(r.us - r.gemm_us if r.gemm_us else None, '.1f')} | "
                f"{fmt(r.floor_us, '.1f')} | "
                f"{'-' if r.recipe is None else fmt(p5_bound(base, r), '.3f')} | "
                f"{fmt(r.wall_us, '.1f')} | {err if r.recipe else '(mm vs nn) ' + err} |")
    return lines


def mem_table(results, set_rows):
    lines = benchutil.table_head(
        ["shape", "recipe", "activations held MiB (allocator)", "(graph)",
         "vs nn.Linear bf16", "quantized W held MiB (allocator / graph)"], 2)
    entries = [(label, rows) for _, label, _, rows in results]
    if set_rows:
        entries.append(("GEMM set total (QKV+proj+FC1+FC2)", set_rows))
    for label, rows in entries:
        base = rows[0]
        for r in rows:
            name = "nn.Linear bf16 (baseline)" if r.recipe is None else r.name
            if r.act is None:
                lines.append(f"| {label} | {name} | {r.status or 'not measured'} | | | |")
                continue
            ratio = act_ratio(base, r)
            lines.append(f"| {label} | {name} | {mib(r.act[0])} | {mib(r.act[1])} | "
                         f"{fmt(ratio, '.3f', 'x')} | {mib(r.wside[0])} / {mib(r.wside[1])} |")
    return lines


def act_ratio(base, row):
    """Activation bytes vs bf16: the allocator's count where there is one, else the graph's."""
    if base.act is None or row.act is None:
        return None
    j = 0 if base.act[0] is not None and row.act[0] is not None else 1
    return row.act[j] / base.act[j] if base.act[j] else None


def summaries(results, set_rows, device):
    lines = []
    # CPU times are the C reference's: no verdict on them (P7's byte counts still hold).
    def timed_verdict(ok, target):
        if device != "cuda":
            return "CPU: no verdict"
        return ("meets " if ok else "MISSES ") + target
    if set_rows:
        scope, rows = "GEMM set (QKV, proj, FC1, FC2 at M=15872) totals", set_rows
    else:
        scope, rows = None, None
        lines.append("- The GEMM set was not run in full (--shapes/--quick): P5-P7 verdicts below "
                     "are per shape, for orientation only.")
    groups = [(scope, rows)] if rows else [(label, rws) for _, label, _, rws in results]
    for where, rws in groups:
        base = rws[0]
        for r in rws[1:]:
            if r.name in benchutil.FP8_RECIPES:
                p5 = p5_of(base, r)
                if p5 is not None:
                    verdict = timed_verdict(p5 >= P5_TARGET, f">= {P5_TARGET}")
                    bound = p5_bound(base, r)
                    bound_text = f"; bound {bound:.3f}" if bound else ""
                    lines.append(f"- P5 {r.name}, {where}: te.Linear "
                                 f"{speedup(base.us, r.us):.2f}x nn.Linear, pre-quantized GEMMs "
                                 f"{speedup(base.gemm_us, r.gemm_us):.2f}x bf16 mm: {p5:.3f} "
                                 f"({verdict}){bound_text}")
                else:
                    lines.append(f"- P5 {r.name}, {where}: not measured "
                                 f"({r.status or 'see notes'})")
            if r.name in EMULATED:
                if r.us and base.us:
                    t = r.us / base.us
                    verdict = timed_verdict(t <= P6_TARGET, f"<= {P6_TARGET}x")
                    best = floor_total(r)
                    bound_text = f"; bound {best / base.us:.2f}x" if best else ""
                    lines.append(f"- P6 {r.name}, {where}: te.Linear time {t:.2f}x nn.Linear bf16 "
                                 f"({verdict}){bound_text}")
                else:
                    lines.append(f"- P6 {r.name}, {where}: not measured "
                                 f"({r.status or 'see notes'})")
            if r.name in benchutil.FP8_RECIPES:
                ratio = act_ratio(base, r)
                if ratio is not None:
                    verdict = "meets" if ratio <= P7_TARGET else "MISSES"
                    lines.append(f"- P7 {r.name}, {where}: activations held for backward "
                                 f"{ratio:.3f}x nn.Linear bf16 ({verdict} <= {P7_TARGET}x)")
    return lines


def main():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--quick", action="store_true",
                    help="proj and small only on CUDA (no GEMM-set totals), fewer iterations")
    ap.add_argument("--shapes", help="comma list of " + ", ".join(benchutil.GEMM_SHAPES) +
                    " or MxKxN (tokens x in x out); default: all on CUDA, two tiny ones on CPU")
    ap.add_argument("--recipes", help="comma list of " + ", ".join(benchutil.RECIPE_NAMES) +
                    " (default: all)")
    ap.add_argument("--bias", action="store_true",
                    help="Linears with bias (default none: the ceiling's GEMMs have no bias)")
    ap.add_argument("--iters", type=int, help="timed steps per row (default 20, quick 10, CPU 3; "
                    f"x{SMALL_SCALE} on shapes under {SMALL_FLOPS:g} flops)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 5, quick 3, CPU 1)")
    ap.add_argument("--buffers", type=int, default=2,
                    help="minimum (x, dy) buffers rotated; CUDA adds more until >= 4x L2")
    ap.add_argument("--wall-calls", type=int, help="steps per wall-time loop (default 10, CPU 3; "
                    f"x{SMALL_SCALE} on shapes under {SMALL_FLOPS:g} flops)")
    ap.add_argument("--wall-repeats", type=int, default=3)
    ap.add_argument("--out", help="also write the Markdown to this file (appended)")
    args = benchutil.parse(ap)
    device = args.device
    if device == "cpu":  # torch's thread pool on a small shared VM stalls for scheduler quanta
        torch.set_num_threads(1)
    quick = args.quick
    if args.iters is None:
        args.iters = 3 if device == "cpu" else 10 if quick else 20
    if args.warmup is None:
        args.warmup = 1 if device == "cpu" else 3 if quick else 5
    if args.wall_calls is None:
        args.wall_calls = 3 if device == "cpu" else 10
    shapes = benchutil.parse_shapes(args.shapes or (QUICK_SHAPES if quick else
                                                    DEFAULT_SHAPES)[device])
    recipes = benchutil.make_recipes(args.recipes)
    args.copy_bytes_per_us = copy_bytes_per_us(device, args)

    notes, failures, results = [], [], []
    for shape in shapes:
        try:
            results.append((shape[0],) + run_shape(shape, recipes, args, device, notes, failures))
        except Exception as e:  # noqa: BLE001 (e.g. out of memory making buffers)
            failures.append(f"{shape[1]}: {benchutil.exc_text(e)}")
            notes.append(f"{shape[1]} skipped: {benchutil.exc_text(e)}")
            if device == "cuda":
                torch.cuda.empty_cache()
    done = {r[0] for r in results}
    set_rows = flops_set = None
    if all(s in done for s in benchutil.GEMM_SET):
        set_rows = totals(results, benchutil.GEMM_SET)
        flops_set = sum(6.0 * m * k * n for key, (_, m, k, n) in benchutil.GEMM_SHAPES.items()
                        if key in benchutil.GEMM_SET)

    override = {name: r.backward_override for name, r in recipes
                if getattr(r, "backward_override", None)}
    mode = ("CPU MODE (torch on one thread): te.Linear and te.ops.gemm run the C reference "
            "(dequantize + fp32 matmul); "
            "these times say nothing about GPU performance; bytes held: graph count only. "
            if device == "cpu" else "")
    env = benchutil.machine(device)
    small_iters = small_calls = ""
    if device == "cuda":
        small_iters = f" ({args.iters * SMALL_SCALE} on shapes under {SMALL_FLOPS:g} flops)"
        small_calls = f" ({args.wall_calls * SMALL_SCALE} there)"
    lines = [f"### P5-P7: te.Linear fwd+bwd vs nn.Linear bf16 and vs pre-quantized GEMMs; "
             f"activation bytes held for backward ({env})", "",
             f"{mode}bf16 params and activations, bias={args.bias}, is_first_microbatch=None "
             "(W requantized each step); fwd+bwd: median of "
             f"{args.iters} steps{small_iters} after {args.warmup} warm-up ("
             f"{'CUDA events, ' if device == 'cuda' else ''}(x, dy) buffers rotated"
             f"{' to >= 4x L2' if device == 'cuda' else ''}); 3 GEMMs: fprop + dgrad + wgrad, "
             "operands quantized once by te.ops.quantize in te.Linear's roles, te.ops.gemm, vs "
             "3 bf16 torch.mm; speedups are time(baseline) / time(row); P5 = te.Linear speedup / "
             "GEMM speedup (target >= 0.95, FP8 recipes); P6 = te.Linear / nn.Linear time "
             f"(target <= 1.2x, MXFP8/NVFP4); wall: median of {args.wall_repeats} interleaved "
             f"loops of {args.wall_calls} steps{small_calls}, synchronized at the loop ends. "
             + (f"Quantization floor: minimal bytes (x, W, dy, both directions) at the device "
                f"copy's {args.copy_bytes_per_us / 1e3:.0f} GB/s (this run); bound = P5 / P6 "
                "with te.Linear = pre-quantized GEMMs + floor. " if args.copy_bytes_per_us else "")
             + "Checked first: "
             "y / dx / dW vs nn.Linear within "
             + ", ".join(f"{k} {v}" for k, v in ERR_BOUND.items()) + " (coarser operand).", ""]
    if override:
        lines += [f"backward_override set (environment?): {override}", ""]
    summary = summaries(results, set_rows, device)
    if summary:
        lines += ["Summary:"] + summary + [""]
    if notes:
        lines += ["Notes:"] + [f"- {benchutil.one_line(t, 1200)}" for t in notes] + [""]
    lines += time_table(results, set_rows, flops_set) + [""]
    lines += ["P7, bytes a forward leaves held for its backward besides its output, the caller "
              "having dropped x: nn.Linear keeps x (bf16); te.Linear keeps its quantized "
              "columnwise x (activations) and its quantized W (weight side, per step: the bf16 W "
              "is a parameter either way). Allocator: torch's requested-bytes count (CUDA) "
              "after - before the forward + x - y, activations from a forward reusing a cached "
              "W (is_first_microbatch=False), weight side = the default forward's count - that; "
              "graph: distinct storages reachable from y's autograd graph, less parameters, "
              "buffers and (te) the quantized W te.Linear caches (both directions, one "
              "buffer).", ""]
    lines += mem_table(results, set_rows)
    return benchutil.finish("\n".join(lines), args.out, failures)


if __name__ == "__main__":
    sys.exit(main())
