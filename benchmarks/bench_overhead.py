"""P2: host time of te.Linear forward and forward+backward vs torch.nn.Linear bf16, tiny shapes.

The GPU stays idle-ish (M=16 and 128 tokens, 256->256, bf16 params and activations, bias as the
modules default), so a loop of calls measures what the host spends per call. Per recipe, in the
same interleaved loops (benchutil.time_host: each loop runs --calls calls of one variant, timed
with time.perf_counter and synchronized at its ends only; median over --repeats rounds, drift
hits every variant alike):
- nn.Linear bf16: the baseline, `y = ref(x)` (and `ref(x).backward(dy)`);
- te.Linear, te.autocast entered once around the loop (the module's own cost per call);
- te.Linear, `with te.autocast(recipe=r):` around each forward, as a user writes a step (the
  backward outside it), so the autocast's construct + enter + exit (and DelayedScaling's update at
  its exit) count too (around the loop, DelayedScaling updates its scales once per loop).
plus, once, te.Linear outside te.autocast (its plain F.linear path). Each step sets the grads of
x and the parameters to None first (no accumulation kernels), baseline alike. The forward runs
with grad enabled (a training forward; the graph is dropped with y). The te.Linear outputs are
checked against nn.Linear's (same weights) before timing. P2 target: te.Linear / nn.Linear
<= 1.2x for fwd and for fwd+bwd. With CUDA, the GPU time per fwd+bwd (CUDA events, benchutil
.time_cuda) is shown beside: the loops are host-bound where us/call exceeds it. --device cpu
times te's C reference arithmetic as well, so its ratios are not the host overhead P2 means.

Run: python3 benchmarks/bench_overhead.py [--quick] [--shapes 16x256x256,...] [--recipes ...]
         [--calls N] [--repeats R] [--out FILE]
"""
import os
import sys

import torch

import tequant as te

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when not run as a script
import benchutil  # noqa: E402

BF16 = torch.bfloat16
DEFAULT_SHAPES = {"cuda": "16x256x256,128x256x256", "cpu": "128x256x256"}
QUICK_SHAPES = "128x256x256"
# te.Linear's y vs nn.Linear's, relative Frobenius error, by the coarser of x's and W's formats
ERR_BOUND = {"E4M3": 0.06, "E5M2": 0.1, "E2M1": 0.25}
P2_TARGET = 1.2


def variants(ref, lin, recipe, x, dy, calls):
    """[(label, fwd loop, fwd+bwd loop, one fwd+bwd)]: a loop runs calls calls."""
    autocast = te.autocast

    def ref_one():
        benchutil.clear_grads(ref, x)
        ref(x).backward(dy)

    def te_one():
        benchutil.clear_grads(lin, x)
        if recipe is None:
            y = lin(x)
        else:
            with autocast(recipe=recipe):
                y = lin(x)
        y.backward(dy)

    def ref_fwd():
        for _ in range(calls):
            ref(x)

    def ref_fwd_bwd():
        for _ in range(calls):
            benchutil.clear_grads(ref, x)
            ref(x).backward(dy)

    def te_fwd_plain():
        for _ in range(calls):
            lin(x)

    def te_fwd_bwd_plain():
        for _ in range(calls):
            benchutil.clear_grads(lin, x)
            lin(x).backward(dy)

    def te_fwd_outer():
        with autocast(recipe=recipe):
            for _ in range(calls):
                lin(x)

    def te_fwd_bwd_outer():
        with autocast(recipe=recipe):
            for _ in range(calls):
                benchutil.clear_grads(lin, x)
                lin(x).backward(dy)

    def te_fwd_each():
        for _ in range(calls):
            with autocast(recipe=recipe):
                lin(x)

    def te_fwd_bwd_each():
        for _ in range(calls):
            benchutil.clear_grads(lin, x)
            with autocast(recipe=recipe):
                y = lin(x)
            y.backward(dy)

    base = [("nn.Linear bf16 (baseline, these loops)", ref_fwd, ref_fwd_bwd, ref_one)]
    if recipe is None:
        return base + [("te.Linear outside te.autocast (F.linear path)", te_fwd_plain,
                        te_fwd_bwd_plain, te_one)]
    return base + [("te.Linear, te.autocast around the loop", te_fwd_outer, te_fwd_bwd_outer,
                    te_one),
                   ("te.Linear, `with te.autocast(recipe=r):` per call", te_fwd_each,
                    te_fwd_bwd_each, te_one)]


def one_step(module, x, dy, recipe):
    benchutil.clear_grads(module, x)
    if recipe is None:
        y = module(x)
    else:
        with te.autocast(recipe=recipe):
            y = module(x)
    y.backward(dy)
    return y.detach()


def check(ref, lin, recipe, x, dy):
    """None, or why te.Linear's y differs from nn.Linear's beyond the format bound."""
    y_ref = one_step(ref, x, dy, None)
    y = one_step(lin, x, dy, recipe)  # after a warm-up step (DelayedScaling's first scale)
    err = benchutil.rel_err(y, y_ref)
    if recipe is None:
        return None if err == 0 else f"WRONG: outside te.autocast y differs by {err:.3g}"
    bound = max(ERR_BOUND.get(te.quantizer_config(recipe, role).format, 0.25)
                for role in ("input", "weight"))
    return None if 0 < err < bound else f"WRONG: y error {err:.3g} outside (0, {bound})"


def run_shape(shape, recipes, args, device, failures):
    _, _, m, k, n = shape
    g = torch.Generator(device=device).manual_seed(1234)
    x = torch.randn(m, k, generator=g, device=device).to(BF16).requires_grad_()
    dy = torch.randn(m, n, generator=g, device=device).to(BF16)
    torch.manual_seed(4321)
    lin = te.Linear(k, n, params_dtype=BF16, device=device)
    ref = torch.nn.Linear(k, n, dtype=BF16, device=device)
    with torch.no_grad():
        ref.weight.copy_(lin.weight)
        lin.bias.copy_(ref.bias)
    out = []  # (group, label, fwd us, fwd ratio, fb us, fb ratio, gpu us, status)
    for name, recipe in [("none", None)] + recipes:
        group = "- (no te.autocast)" if recipe is None else name
        try:
            one_step(lin, x, dy, recipe)  # warm-up: plans, DelayedScaling's first scales
            why = check(ref, lin, recipe, x, dy)
        except Exception as e:  # noqa: BLE001 (one recipe must not stop the others)
            why = f"error: {benchutil.one_line(benchutil.exc_text(e))}"
        if why:
            failures.append(f"M={m} {k}->{n} {group}: {why}")
            out.append((group, "te.Linear", None, None, None, None, None, why))
            continue
        rows = variants(ref, lin, recipe, x, dy, args.calls)
        loops = [loop for _, fwd, fb, _ in rows for loop in (fwd, fb)]
        for loop in loops:  # warm-up, one loop each
            loop()
        per_loop = benchutil.time_host(loops, device, 1, args.repeats)
        per_call = [t / args.calls for t in per_loop]
        gpu = [None] * len(rows)
        if device == "cuda":  # GPU time of one fwd+bwd: is the loop host-bound?
            for i, (_, _, _, one) in enumerate(rows):
                gpu[i] = benchutil.time_cuda(lambda _b, f=one: f(), [None], 5, 50)
        base_fwd, base_fb = per_call[0], per_call[1]
        for i, (label, _, _, _) in enumerate(rows):
            fwd, fb = per_call[2 * i], per_call[2 * i + 1]
            out.append((group, label, fwd, fwd / base_fwd, fb, fb / base_fb, gpu[i], ""))
        benchutil.clear_grads(lin, x)
    return out


def main():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="M=128 only, fewer calls and repeats")
    ap.add_argument("--shapes", help=f"comma list of MxKxN (default {DEFAULT_SHAPES['cuda']}; "
                    f"CPU {DEFAULT_SHAPES['cpu']})")
    ap.add_argument("--recipes", help="comma list of " + ", ".join(benchutil.RECIPE_NAMES) +
                    " (default: all)")
    ap.add_argument("--calls", type=int, help="calls per loop (default 200, quick 50, CPU 10)")
    ap.add_argument("--repeats", type=int, help="interleaved rounds (default 7, quick/CPU 3)")
    ap.add_argument("--out", help="also write the Markdown to this file (appended)")
    args = benchutil.parse(ap)
    device = args.device
    if device == "cpu":  # torch's thread pool on a small shared VM stalls for scheduler quanta
        torch.set_num_threads(1)
    if args.calls is None:
        args.calls = 10 if device == "cpu" else 50 if args.quick else 200
    if args.repeats is None:
        args.repeats = 3 if device == "cpu" or args.quick else 7
    shapes = benchutil.parse_shapes(args.shapes or (QUICK_SHAPES if args.quick
                                                    else DEFAULT_SHAPES[device]), shapes={})
    recipes = benchutil.make_recipes(args.recipes)

    failures, results, notes = [], [], []
    for shape in shapes:
        try:
            results.append((shape, run_shape(shape, recipes, args, device, failures)))
        except Exception as e:  # noqa: BLE001
            failures.append(f"{shape[1]}: {benchutil.exc_text(e)}")
            notes.append(f"{shape[1]} skipped: {benchutil.exc_text(e)}")

    worst = {}  # (group, label) -> [max fwd ratio, max fwd+bwd ratio] over shapes
    for _, rows in results:
        for group, label, _, rf, _, rb, _, status in rows:
            if rf is not None and not label.startswith("nn.Linear"):
                w = worst.setdefault((group, label), [0.0, 0.0])
                w[0], w[1] = max(w[0], rf), max(w[1], rb)
    summary = []
    for (group, label), (rf, rb) in worst.items():
        if device == "cuda":
            verdict = ("meets" if max(rf, rb) <= P2_TARGET else "MISSES") + f" <= {P2_TARGET}x"
        else:
            verdict = "CPU: no verdict"
        summary.append(f"- P2 {group}, {label}: worst over shapes fwd {rf:.2f}x, fwd+bwd "
                       f"{rb:.2f}x nn.Linear ({verdict})")

    mode = ("CPU MODE (torch on one thread): te.Linear runs the C reference quantizers and "
            "GEMMs, whose arithmetic "
            "these times include; they say nothing about the GPU host path P2 measures. "
            if device == "cpu" else "")
    lines = [f"### P2: host time per call, te.Linear vs nn.Linear bf16, tiny shapes "
             f"({benchutil.machine(device)})", "",
             f"{mode}bf16 params and activations, bias=True; median over {args.repeats} "
             f"interleaved rounds of loops of {args.calls} calls each (time.perf_counter, "
             "synchronized at the loop ends only), per recipe (each recipe's loops have their "
             "own baseline row); ratios are time(row) / time(nn.Linear), lower is better, target "
             f"<= {P2_TARGET}x. GPU us: one fwd+bwd between CUDA events behind a sleep kernel.",
             ""]
    if summary:
        lines += ["Summary:"] + summary + [""]
    if notes:
        lines += ["Notes:"] + [f"- {benchutil.one_line(t, 1200)}" for t in notes] + [""]
    lines += benchutil.table_head(["shape", "recipe", "variant", "fwd us/call",
                                   "fwd vs nn.Linear", "fwd+bwd us/call", "fwd+bwd vs nn.Linear",
                                   "fwd+bwd GPU us (events)"], 3)
    for (_, _, m, k, n), rows in results:
        for group, label, fwd, rf, fb, rb, gpu, status in rows:
            if fwd is None:
                lines.append(f"| M={m} {k}->{n} | {group} | {label} | {status} | | | | |")
                continue
            lines.append(f"| M={m} {k}->{n} | {group} | {label} | {fwd:.1f} | {rf:.2f}x | "
                         f"{fb:.1f} | {rb:.2f}x | {'-' if gpu is None else f'{gpu:.1f}'} |")
    return benchutil.finish("\n".join(lines), args.out, failures)


if __name__ == "__main__":
    sys.exit(main())
