"""P4: TFLOP/s of te.ops.gemm vs torch._scaled_mm of the same scaling, and vs bf16 torch.mm.

Fprop y = x W^T (bf16 output) over PERFORMANCE.md's GEMM shapes for every scaling tequant has,
each row checked before it is timed, plus the host time of one cached call (see below).
Run: python3 benchmarks/bench_gemm.py [--quick] [--shapes ...] [--variants ...] [--out FILE]
"""
import math
import os
import sys

import torch

import tequant as te
from tequant.recipe import (Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
                            NVFP4BlockScaling)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when not run as a script
import benchutil  # noqa: E402

# Per shape (SHAPES) and scaling (groups()), correctness first: vs a float64 product of the same
# dequantized operands on --check-rows rows (REF_BOUND; FAST_ACCUM_REF_BOUND), te vs torch on the
# full output (AGREE_BOUND; torch._scaled_mm runs on te's own bits, its blockwise form probed), and
# the error vs the unquantized product in (0, QUANT_BOUND); then timing as bench_quantize.py
# (benchutil.time_cuda) over (x, W) buffers rotated to span >= 4x L2 in bf16 (>= 2x L2 in FP8).
# Host time per cached call: M=N=K=HOST_SIZE, interleaved loops of --host-calls calls
# (benchutil.time_host), te.ops.gemm vs torch._scaled_mm, plus the C entry point _C._gemm called
# with te.ops.gemm's arguments. GEMM ratios are speedups time(baseline) / time(row), P4 target:
# te vs torch._scaled_mm >= 1.0x; host ratios are time(row) / time(baseline). --out appends the
# Markdown to a file (written only then); --device cpu: tiny shapes, C reference (make bench).

BF16 = torch.bfloat16
# name -> (label, M, K, N): y[M, N] = x[M, K] . W[N, K]^T
SHAPES = benchutil.GEMM_SHAPES
GEMM_SET = benchutil.GEMM_SET
# CPU: torch._scaled_mm there is a slow reference loop (~0.1 s at 128^3): keep shapes tiny
DEFAULT_SHAPES = {"cuda": "8192,qkv,proj,fc1,fc2,small", "cpu": "128x128x128,64x256x128"}
QUICK_SHAPES = {"cuda": "8192,small", "cpu": "128x128x128"}
HOST_SIZE = {"cuda": 256, "cpu": 64}
VARIANTS = ("bf16", "fp8-fast", "fp8-split", "rowwise", "block", "mxfp8", "nvfp4")
REF_BOUND = 8e-3     # vs float64 of the same dequantized operands, bf16 output (NUMERICS.md 5)
# Hopper's fast FP8 accumulation loses bits with K (NUMERICS.md bounds it at test sizes); at
# K = 16384 a correct GEMM may pass 8e-3, so those rows get more room and lean on te vs torch.
FAST_ACCUM_REF_BOUND = 2e-2
AGREE_BOUND = 1e-2   # te vs torch._scaled_mm, same bits
# relative Frobenius error vs the unquantized product on randn data must lie in (0, bound)
QUANT_BOUND = {"bf16": 8e-3, "E4M3": 0.1, "E2M1": 0.3}
FP8_MAX = 448.0


rel_err = benchutil.rel_err
parse_shapes = benchutil.parse_shapes


# --- Variants ----------------------------------------------------------------------------------
# prepare(x, w) runs once per rotated buffer (not timed) and returns a dict of operands;
# a call maps those operands to y = x W^T in bf16; ref(ops, rows) gives float64 (x[:rows], W) of
# the values the call multiplies, for the correctness check.

def te_quantize(x, w, recipe, *, rowwise_only=True):
    qx = te.ops.quantize(x, recipe, "input", rowwise=True, columnwise=not rowwise_only)
    qw = te.ops.quantize(w, recipe, "weight", rowwise=True, columnwise=not rowwise_only)
    return qx, qw


def te_ref(ops, rows):
    xd = ops["qx"].dequantize_direction("rowwise", torch.float32)[:rows].double()
    wd = ops["qw"].dequantize_direction("rowwise", torch.float32).double()
    return xd, wd


def te_call(*, split):
    def call(ops):
        return te.ops.gemm(ops["qx"], ops["qw"], transpose_b=True, out_dtype=BF16,
                           use_split_accumulator=split)
    return call


def prepare_bf16(x, w):
    return {"x": x, "w": w}


def bf16_ref(ops, rows):
    return ops["x"][:rows].double(), ops["w"].double()


def bf16_call(ops):
    return torch.mm(ops["x"], ops["w"].t())


def prepare_per_tensor(x, w):
    qx, qw = te_quantize(x, w, Float8CurrentScaling())
    # torch._scaled_mm's operands are te's own bits: data [M, K] row-major, W data [N, K] seen
    # as the column-major [K, N] it wants; scale_inv is the dequantizing factor torch multiplies.
    return {"qx": qx, "qw": qw, "a": qx.data, "b": qw.data.t(),
            "sa": qx.scale_inv.reshape(()), "sb": qw.scale_inv.reshape(())}


def torch_tensorwise_call(*, fast_accum):
    def call(ops):
        return torch._scaled_mm(ops["a"], ops["b"], scale_a=ops["sa"], scale_b=ops["sb"],
                                out_dtype=BF16, use_fast_accum=fast_accum)
    return call


def rowwise_quantize(t):
    """E4M3 with one FP32 scale per row (torch only; tequant has no row-wise recipe)."""
    amax = t.float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    q = (t.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, (1.0 / scale).contiguous()


def prepare_rowwise(x, w):
    xq, sx = rowwise_quantize(x)       # [M, K], [M, 1]
    wq, sw = rowwise_quantize(w)       # [N, K], [N, 1]
    return {"xq": xq, "wq": wq, "a": xq, "b": wq.t(), "sa": sx, "sb": sw.reshape(1, -1)}


def rowwise_ref(ops, rows):
    return ((ops["xq"][:rows].double() * ops["sa"][:rows].double()),
            ops["wq"].double() * ops["sb"].reshape(-1, 1).double())


def torch_rowwise_call(ops):
    return torch._scaled_mm(ops["a"], ops["b"], scale_a=ops["sa"], scale_b=ops["sb"],
                            out_dtype=BF16, use_fast_accum=True)


def prepare_block(x, w):
    qx, qw = te_quantize(x, w, Float8BlockScaling())
    m, kb = qx.rows, benchutil.ceil_div(qx.cols, 128)
    # te layouts (tequant.h): x 1x128 scale_inv [ceil(K/128), pad4(M)] with M contiguous; W
    # 128x128 scale_inv [ceil(N/128), pad4(ceil(K/128))]. torch wants scale_a [M, K/128] with
    # strides (1, M), and scale_b [K/128, N/128] with strides (1, K/128) (torch._scaled_mm checks
    # scale_b.t() against W [N, K]); torch.nn.functional.scaled_mm of some versions wants the
    # padded [pad4(K/128), N/128] instead: the stored W scales transposed, as they are.
    sa = qx.scale_inv[:, :m].contiguous().t()
    sb = qw.scale_inv[:, :kb].contiguous().t()
    return {"qx": qx, "qw": qw, "a": qx.data, "b": qw.data.t(), "sa": sa, "sb": sb,
            "sb_padded": qw.scale_inv.t()}


def torch_block_candidates(ops):
    """The ways this torch may take 1x128 x 128x128 FP8, tried in order (first correct wins)."""
    cands = [("torch._scaled_mm", lambda o: torch._scaled_mm(
        o["a"], o["b"], scale_a=o["sa"], scale_b=o["sb"], out_dtype=BF16, use_fast_accum=False))]
    fn = getattr(torch.nn.functional, "scaled_mm", None)
    kinds = getattr(torch.nn.functional, "ScalingType", None)
    if fn is not None and kinds is not None:
        a_kind, b_kind = kinds.BlockWise1x128, kinds.BlockWise128x128
        cands.append(("torch.nn.functional.scaled_mm", lambda o: fn(
            o["a"], o["b"], o["sa"], a_kind, o["sb"], b_kind, output_dtype=BF16)))
        if ops["sb_padded"].shape != ops["sb"].shape:  # K/128 not a multiple of 4
            cands.append(("torch.nn.functional.scaled_mm (padded scale_b)", lambda o: fn(
                o["a"], o["b"], o["sa"], a_kind, o["sb_padded"], b_kind, output_dtype=BF16)))
    return cands


def probe_torch_block(ops, ref_pair, *, rows):
    """(name, call, y, reasons): the first candidate that runs and passes the check, else
    (None, None, None, reasons) with why each failed; nothing is assumed to work."""
    reasons = []
    for name, cand in torch_block_candidates(ops):
        try:
            y, _ = check_call(cand, ops, ref_pair, rows=rows)
        except Exception as e:  # noqa: BLE001 (each reason is reported)
            reasons.append(f"{name}: {benchutil.one_line(benchutil.exc_text(e), 300)}")
            continue
        return name, cand, y, reasons
    return None, None, None, reasons


def prepare_mxfp8(x, w):
    qx, qw = te_quantize(x, w, MXFP8BlockScaling())
    return {"qx": qx, "qw": qw}


def prepare_nvfp4(x, w):
    qx, qw = te_quantize(x, w, NVFP4BlockScaling())
    return {"qx": qx, "qw": qw}


# A group shares one prepared operand set between its torch and te rows.
# (key, scaling label, prepare, ref, element format, torch row (label, call | None), te row)
def groups():
    return [
        ("bf16", "bf16", prepare_bf16, bf16_ref, "bf16",
         ("torch.mm (baseline)", bf16_call), None),
        ("fp8-fast", "FP8 per-tensor, fast accum", prepare_per_tensor, te_ref, "E4M3",
         ("torch._scaled_mm tensor-wise, use_fast_accum=True",
          torch_tensorwise_call(fast_accum=True)),
         ("te.ops.gemm Float8CurrentScaling, use_split_accumulator=False", te_call(split=False))),
        ("fp8-split", "FP8 per-tensor, split accum", prepare_per_tensor, te_ref, "E4M3",
         ("torch._scaled_mm tensor-wise, use_fast_accum=False",
          torch_tensorwise_call(fast_accum=False)),
         ("te.ops.gemm Float8CurrentScaling, use_split_accumulator=True", te_call(split=True))),
        ("rowwise", "FP8 row-wise [M,1] x [1,N] (reference, torch only)", prepare_rowwise,
         rowwise_ref, "E4M3",
         ("torch._scaled_mm row-wise, use_fast_accum=True", torch_rowwise_call), None),
        ("block", "FP8 block 1x128 x 128x128", prepare_block, te_ref, "E4M3",
         ("torch._scaled_mm blockwise (probed)", None),
         ("te.ops.gemm Float8BlockScaling", te_call(split=True))),
        ("mxfp8", "MXFP8 1x32 (emulated)", prepare_mxfp8, te_ref, "E4M3", None,
         ("te.ops.gemm MXFP8BlockScaling", te_call(split=True))),
        ("nvfp4", "NVFP4 1x16 / 16x16 (emulated)", prepare_nvfp4, te_ref, "E2M1", None,
         ("te.ops.gemm NVFP4BlockScaling", te_call(split=True))),
    ]


def cublaslt_version():
    try:
        return te.build_info().get("cublaslt_version") or "-"
    except Exception:  # noqa: BLE001 (the header must not stop the benchmark)
        return "?"


# --- GEMM table --------------------------------------------------------------------------------

class Row:
    def __init__(self, shape_key, shape_label, scaling, impl, who):
        self.shape_key, self.shape_label = shape_key, shape_label
        self.scaling, self.impl, self.who = scaling, impl, who  # who: "torch" or "te"
        self.us = None        # median microseconds when timed
        self.status = ""      # "" (timed), "n/a: ..." or "WRONG: ..." / "error: ..."
        self.err_ref = None   # rel. Frobenius error vs float64 of the same dequantized operands
        self.err_bf16 = None  # rel. Frobenius error vs the unquantized product (rows sliced)


def check_call(call, ops, ref_pair, *, rows, bound=REF_BOUND):
    """Runs call on the first buffer; returns (y, error vs the float64 reference on rows)."""
    y = call(ops)
    if y.shape != (ops_rows(ops), ref_pair[1].shape[0]):
        raise AssertionError(f"result shape {tuple(y.shape)}, expected "
                             f"{(ops_rows(ops), ref_pair[1].shape[0])}")
    if y.dtype != BF16:
        raise AssertionError(f"result dtype {y.dtype}, expected {BF16}")
    xd, wd = ref_pair
    ref = xd @ wd.t()
    err = rel_err(y[:rows], ref)
    if not (err < bound):
        raise AssertionError(f"relative error {err:.3g} vs float64 of the same dequantized "
                             f"operands, bound {bound}")
    return y, err


def ops_rows(ops):
    for key in ("qx", "x", "xq"):
        if key in ops:
            t = ops[key]
            return t.rows if hasattr(t, "rows") else t.shape[0]
    raise KeyError("operands without x")


def run_shape(shape, variants, args, device, timer, notes, failures):
    key, label, m, k, n = shape
    shape_label = f"{label} M={m} {k}->{n}" if key in SHAPES else f"M={m} {k}->{n}"
    rows_out = []
    g = torch.Generator(device=device).manual_seed(1234)
    pair_bytes = (m * k + n * k) * 2
    nbuf = benchutil.rotated_count(device, args.buffers, pair_bytes)
    buffers = [(torch.randn(m, k, generator=g, device=device).to(BF16),
                torch.randn(n, k, generator=g, device=device).to(BF16)) for _ in range(nbuf)]
    check_rows = min(args.check_rows, m)
    # unquantized product on the checked rows, for the "quantization happened" sanity bound
    x0, w0 = buffers[0]
    exact = x0[:check_rows].double() @ w0.double().t()
    for gkey, scaling, prepare, ref_fn, fmt, torch_row, te_row in groups():
        if gkey not in variants:
            continue
        planned = []
        if torch_row is not None:
            planned.append(Row(key, shape_label, scaling, torch_row[0], "torch"))
        if te_row is not None:
            planned.append(Row(key, shape_label, scaling, te_row[0], "te"))
        rows_out.extend(planned)
        try:
            ops_list = [prepare(x, w) for x, w in buffers]
        except (NotImplementedError, ValueError) as e:  # a shape the format cannot take
            for r in planned:
                r.status = f"n/a: {benchutil.one_line(e)}"
            continue
        except Exception as e:  # noqa: BLE001 (one variant must not stop the others)
            for r in planned:
                r.status = f"error (quantize): {benchutil.one_line(benchutil.exc_text(e))}"
            failures.append(f"{shape_label} {scaling}: quantize: {benchutil.exc_text(e)}")
            continue
        ref_pair = ref_fn(ops_list[0], check_rows)
        results = {}
        calls = {}
        for r in planned:
            if r.who == "torch" and torch_row[1] is None:   # block: probe this torch
                name, cand, y, reasons = probe_torch_block(ops_list[0], ref_pair,
                                                           rows=check_rows)
                if cand is not None:
                    r.impl = f"{name} blockwise 1x128 x 128x128"
                    calls[r.who], results[r.who] = cand, y
                    r.err_ref = rel_err(y[:check_rows], ref_pair[0] @ ref_pair[1].t())
                if reasons:
                    notes.append(f"{shape_label}, torch block FP8: " + "; ".join(reasons))
                if r.who not in calls:
                    r.status = ("n/a: this torch runs no blockwise FP8 GEMM here (tried "
                                f"{len(reasons)} ways; see notes)")
                continue
            call = torch_row[1] if r.who == "torch" else te_row[1]
            fast = gkey in ("fp8-fast", "rowwise")
            try:
                y, r.err_ref = check_call(call, ops_list[0], ref_pair, rows=check_rows,
                                          bound=FAST_ACCUM_REF_BOUND if fast else REF_BOUND)
            except NotImplementedError as e:
                r.status = f"n/a: {benchutil.one_line(e)}"
                continue
            except AssertionError as e:
                r.status = f"WRONG: {benchutil.one_line(e)}"
                failures.append(f"{shape_label} {r.impl}: {e}")
                continue
            except Exception as e:  # noqa: BLE001
                text = benchutil.one_line(benchutil.exc_text(e))
                if r.who == "torch":  # a reference torch lacks: not tequant's failure
                    r.status = f"n/a: {text}"
                    notes.append(f"{shape_label}, {r.impl}: {benchutil.exc_text(e)}")
                else:
                    r.status = f"error: {text}"
                    failures.append(f"{shape_label} {r.impl}: {benchutil.exc_text(e)}")
                continue
            calls[r.who], results[r.who] = call, y
        if "te" in results and "torch" in results:
            # full outputs (up to 15872 x 16384): float32 keeps the transient memory at 3 GB
            agree = rel_err(results["te"], results["torch"], dtype=torch.float32)
            if not (agree < AGREE_BOUND):
                te_r = next(r for r in planned if r.who == "te")
                te_r.status = (f"WRONG: differs from torch._scaled_mm on the same bits by "
                               f"{agree:.3g} (bound {AGREE_BOUND})")
                failures.append(f"{shape_label} {te_r.impl}: {te_r.status}")
                calls.pop("te")
        bound = QUANT_BOUND[fmt]
        for r in planned:
            if r.who not in calls:
                continue
            err = rel_err(results[r.who][:check_rows], exact)
            r.err_bf16 = err
            if gkey != "bf16" and not (0.0 < err < bound):
                r.status = (f"WRONG: error vs the unquantized product {err:.3g} outside "
                            f"(0, {bound})")
                failures.append(f"{shape_label} {r.impl}: {r.status}")
                calls.pop(r.who)
        del results, ref_pair
        for r in planned:
            if r.who not in calls:
                continue
            try:
                r.us = timer(calls[r.who], ops_list, args.warmup, args.iters)
            except Exception as e:  # noqa: BLE001
                r.status = f"error (timing): {benchutil.one_line(benchutil.exc_text(e))}"
                failures.append(f"{shape_label} {r.impl}: timing: {benchutil.exc_text(e)}")
        del ops_list
    del buffers, exact
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows_out, (m, k, n)


def gemm_table(all_rows, dims):
    lines = benchutil.table_head(["shape", "scaling", "variant", "time us", "TFLOP/s",
                                  "vs torch._scaled_mm (same scaling)", "vs bf16 torch.mm",
                                  "rel err: same bits fp64 / unquantized"], 3)
    for shape_key, rows in all_rows:
        m, k, n = dims[shape_key]
        flops = 2.0 * m * n * k
        bf16_us = next((r.us for r in rows if r.scaling == "bf16" and r.us), None)
        torch_us = {r.scaling: r.us for r in rows if r.who == "torch" and r.us}
        for r in rows:
            err = " / ".join("-" if e is None else f"{e:.2g}" for e in (r.err_ref, r.err_bf16))
            err = "" if r.err_ref is None and r.err_bf16 is None else err
            if r.us is None:
                lines.append(f"| {r.shape_label} | {r.scaling} | {r.impl} | {r.status} | | | | "
                             f"{err} |")
                continue
            has_torch_row = any(o.who == "torch" and o.scaling == r.scaling for o in rows)
            vs_torch = ("(reference)" if r.who == "torch" else
                        benchutil.ratio_text(torch_us.get(r.scaling), r.us) if r.scaling in torch_us
                        else "n/a" if has_torch_row else "-")
            if r.scaling == "bf16":
                vs_torch = "-"
            lines.append(f"| {r.shape_label} | {r.scaling} | {r.impl} | {r.us:.1f} | "
                         f"{benchutil.num_text(flops / r.us / 1e6)} | {vs_torch} | "
                         f"{benchutil.ratio_text(bf16_us, r.us)} | {err} |")
    return lines


def summaries(all_rows):
    """P4 per scaling (min and max te/torch over shapes) and the GEMM-set totals."""
    lines = []
    p4, unmeasured = {}, set()
    for _, rows in all_rows:
        torch_us = {r.scaling: r.us for r in rows if r.who == "torch" and r.us}
        torch_rows = {r.scaling for r in rows if r.who == "torch"}
        for r in rows:
            if r.who == "te" and r.us and r.scaling in torch_us:
                p4.setdefault(r.scaling, []).append(torch_us[r.scaling] / r.us)
            elif r.who == "te" and r.scaling in torch_rows:
                unmeasured.add(r.scaling)
    for scaling, ratios in p4.items():
        # Both call the same cuBLASLt kernels: the verdict is on the geometric mean over the
        # shapes; the range shows the per-shape spread (run-to-run noise is about +-1%).
        geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        verdict = "meets" if geomean >= 1.0 else "MISSES"
        lines.append(f"- P4 {scaling}: te.ops.gemm vs torch._scaled_mm geometric mean "
                     f"{geomean:.3f}x, range {min(ratios):.3f}x-{max(ratios):.3f}x over "
                     f"{len(ratios)} shapes ({verdict} >= 1.0x)")
    for scaling in sorted(unmeasured - set(p4)):
        lines.append(f"- P4 {scaling}: not measured (no torch reference or te row failed; see "
                     "the table and notes)")
    by_shape = dict(all_rows)
    if all(s in by_shape for s in GEMM_SET):
        totals = {}
        for s in GEMM_SET:
            for r in by_shape[s]:
                totals.setdefault((r.scaling, r.impl), []).append(r.us)
        base = totals.get(("bf16", "torch.mm (baseline)"))
        if base and all(base):
            for (scaling, impl), us in totals.items():
                if scaling != "bf16" and all(us):
                    lines.append(f"- GEMM set (fprop of QKV, proj, FC1, FC2), {impl}: "
                                 f"{sum(us):.0f} us, {sum(base) / sum(us):.2f}x bf16")
    return lines


# --- Host time per cached call -----------------------------------------------------------------

def capture_c_gemm(call, ops):
    """(fn, None) calling tequant._C._gemm with exactly the arguments te.ops.gemm passes it (the
    C-level cost without the Python wrapper), or (None, reason)."""
    real = getattr(te._C, "_gemm", None)
    if real is None:
        return None, "tequant._C has no _gemm"
    captured = []

    def spy(*a, **kw):
        captured.append((a, kw))
        return real(*a, **kw)

    try:
        te._C._gemm = spy
    except (AttributeError, TypeError) as e:
        return None, f"cannot intercept _C._gemm ({e})"
    try:
        call(ops)
    finally:
        te._C._gemm = real
    if not captured:
        return None, "te.ops.gemm did not call tequant._C._gemm through the module attribute"
    a, kw = captured[-1]
    return (lambda _ops: real(*a, **kw)), None


def plan_stats():
    fn = getattr(te._C, "_gemm_plan_stats", None)
    try:
        return fn() if fn is not None else None
    except Exception:  # noqa: BLE001
        return None


def host_section(args, device, notes, failures):
    m = n = k = HOST_SIZE[device]
    g = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(m, k, generator=g, device=device).to(BF16)
    w = torch.randn(n, k, generator=g, device=device).to(BF16)
    entries = []  # (scaling, label, fn, who)
    ops_bf16 = prepare_bf16(x, w)
    entries.append(("bf16", "torch.mm bf16", lambda: bf16_call(ops_bf16), "base"))
    try:
        pt = prepare_per_tensor(x, w)
        fast_torch, fast_te = torch_tensorwise_call(fast_accum=True), te_call(split=False)
        entries.append(("FP8 per-tensor, fast accum", "torch._scaled_mm tensor-wise",
                        lambda: fast_torch(pt), "torch"))
        entries.append(("FP8 per-tensor, fast accum", "te.ops.gemm",
                        lambda: fast_te(pt), "te"))
        raw, why = capture_c_gemm(fast_te, pt)
        if raw is not None:
            entries.append(("FP8 per-tensor, fast accum", "tequant._C._gemm (direct)",
                            lambda: raw(pt), "te"))
        else:
            notes.append(f"host time: _C._gemm not timed: {why}")
    except Exception as e:  # noqa: BLE001
        failures.append(f"host time, per-tensor: {benchutil.exc_text(e)}")
        notes.append(f"host time, per-tensor FP8 skipped: {benchutil.exc_text(e)}")
    try:
        blk = prepare_block(x, w)
        name, cand, _, reasons = probe_torch_block(blk, te_ref(blk, m), rows=m)
        if cand is not None:
            entries.append(("FP8 block", f"{name} blockwise", lambda: cand(blk), "torch"))
        else:
            notes.append("host time, torch block FP8 not timed: " + "; ".join(reasons))
        block_te = te_call(split=True)
        entries.append(("FP8 block", "te.ops.gemm", lambda: block_te(blk), "te"))
    except Exception as e:  # noqa: BLE001
        notes.append(f"host time, block FP8 skipped: {benchutil.exc_text(e)}")
    try:
        mx = prepare_mxfp8(x, w)
        mx_te = te_call(split=True)
        entries.append(("MXFP8 (emulated)", "te.ops.gemm", lambda: mx_te(mx), "te"))
    except Exception as e:  # noqa: BLE001
        notes.append(f"host time, MXFP8 skipped: {benchutil.exc_text(e)}")

    usable = []
    for entry in entries:
        try:
            for _ in range(3 if device == "cpu" else 20):  # plans, heuristics, allocator
                entry[2]()
            benchutil.sync(device)
            usable.append(entry)
        except Exception as e:  # noqa: BLE001
            notes.append(f"host time, {entry[0]} {entry[1]}: {benchutil.exc_text(e)}")
            if entry[3] == "te":
                failures.append(f"host time, {entry[0]} {entry[1]}: {benchutil.exc_text(e)}")
    calls = args.host_calls
    stats_before = plan_stats()
    med = dict(zip(map(id, usable), benchutil.time_host([e[2] for e in usable], device, calls,
                                                        args.host_repeats)))
    stats_after = plan_stats()
    gpu_us = {}
    if device == "cuda":
        for entry in usable:
            gpu_us[id(entry)] = benchutil.time_cuda(lambda _b, f=entry[2]: f(), [None], 5, 50)
    lines = [f"Host time per cached call, M=N=K={m}, bf16 output: median over "
             f"{args.host_repeats} interleaved loops of {calls} calls (time.perf_counter, "
             "synchronize at the end only); ratios here are time(row) / time(baseline), lower "
             "is better. The loop is host-bound where us/call exceeds the GPU time per call.", ""]
    if stats_before is not None and stats_after is not None:
        queries = stats_after.get("heuristic_queries", 0) - stats_before.get("heuristic_queries", 0)
        hits = stats_after.get("cache_hits", 0) - stats_before.get("cache_hits", 0)
        lines += [f"tequant GEMM plan cache during the loops: {queries} heuristic queries, "
                  f"{hits} cache hits ({stats_after.get('plans', '?')} plans held).", ""]
    lines += benchutil.table_head(["scaling", "call", "us/call",
                                   "time / torch._scaled_mm (same scaling)",
                                   "time / torch.mm bf16", "GPU us/call (events)"], 2)
    base = {}
    for e in usable:
        if e[3] in ("torch", "base"):
            base[e[0]] = med[id(e)]
    bf16_us = base.get("bf16")
    for e in usable:
        us = med[id(e)]
        vs_torch = ("(reference)" if e[3] == "torch" else "-" if e[3] == "base" else
                    benchutil.ratio_text(us, base[e[0]]) if e[0] in base else "n/a")
        vs_bf16 = benchutil.ratio_text(us, bf16_us)
        gpu = f"{gpu_us[id(e)]:.1f}" if id(e) in gpu_us else "-"
        lines.append(f"| {e[0]} | {e[1]} | {us:.2f} | {vs_torch} | {vs_bf16} | {gpu} |")
    return lines


def main():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--quick", action="store_true",
                    help="few shapes (8192^3 and small on CUDA), fewer iterations and host calls")
    ap.add_argument("--shapes", help="comma list of " + ", ".join(SHAPES) + " or MxKxN "
                    "(tokens x in x out); default: all on CUDA, two tiny ones on CPU")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--iters", type=int, help="timed calls per row (default 30, quick 10)")
    ap.add_argument("--warmup", type=int, help="untimed calls first (default 5, quick 3)")
    ap.add_argument("--buffers", type=int, default=3,
                    help="minimum (x, W) buffers rotated; CUDA adds more until >= 4x L2")
    ap.add_argument("--check-rows", type=int, default=256,
                    help="rows of y compared with the float64 reference")
    ap.add_argument("--host-calls", type=int, help="calls per host-time loop (default 2000, "
                    "quick 500, CPU 20)")
    ap.add_argument("--host-repeats", type=int, default=5)
    ap.add_argument("--skip-host", action="store_true", help="skip the host-time section")
    ap.add_argument("--out", help="also write the Markdown to this file (appended)")
    args = benchutil.parse(ap)
    device = args.device
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    quick = args.quick
    if args.iters is None:
        args.iters = 3 if device == "cpu" else 10 if quick else 30
    if args.warmup is None:
        args.warmup = 1 if device == "cpu" else 3 if quick else 5
    if args.host_calls is None:
        args.host_calls = 20 if device == "cpu" else 500 if quick else 2000
    if device == "cpu":
        args.host_repeats = min(args.host_repeats, 3)
    shapes = parse_shapes(args.shapes or (QUICK_SHAPES if quick else DEFAULT_SHAPES)[device])
    timer = benchutil.timer(device)

    notes, failures = [], []
    host_lines = [] if args.skip_host else host_section(args, device, notes, failures)
    all_rows, dims = [], {}
    for shape in shapes:
        try:
            rows, dims[shape[0]] = run_shape(shape, variants, args, device, timer, notes,
                                             failures)
        except Exception as e:  # noqa: BLE001 (e.g. out of memory making buffers)
            failures.append(f"{shape[1]}: {benchutil.exc_text(e)}")
            notes.append(f"{shape[1]} skipped: {benchutil.exc_text(e)}")
            if device == "cuda":
                torch.cuda.empty_cache()
            continue
        all_rows.append((shape[0], rows))

    mode = ("CPU MODE: te.ops.gemm runs the C reference (dequantize + fp32 torch matmul); these "
            "times say nothing about GPU performance. " if device == "cpu" else "")
    rotation = ("(x, W) buffers rotated (>= 4x L2 in bf16)" if device == "cuda" else
                f"{args.buffers} (x, W) buffers rotated")
    env = benchutil.machine(device, [("cuBLASLt", cublaslt_version())])
    lines = [f"### P4: GEMM TFLOP/s, te.ops.gemm vs torch._scaled_mm and bf16 torch.mm, fprop "
             f"y = x W^T, bf16 output ({env})", "",
             f"{mode}median of {args.iters} calls after {args.warmup} warmup; {rotation}; "
             "torch._scaled_mm runs on the bits te quantized "
             "(row-wise: torch-quantized); checked first (vs float64 of the same dequantized "
             f"operands < {REF_BOUND}, fast accumulation < {FAST_ACCUM_REF_BOUND}; te vs torch "
             f"< {AGREE_BOUND}). Ratios are speedups "
             "time(baseline) / time(row); P4 target: >= 1.0x vs torch._scaled_mm.", ""]
    if host_lines:
        lines += host_lines + [""]
    summary = summaries(all_rows)
    if summary:
        lines += ["Summary:"] + summary + [""]
    if notes:
        lines += ["Notes:"] + [f"- {benchutil.one_line(t, 1200)}" for t in notes] + [""]
    lines += gemm_table(all_rows, dims)
    return benchutil.finish("\n".join(lines), args.out, failures)


if __name__ == "__main__":
    sys.exit(main())
