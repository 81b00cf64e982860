"""Step time of te.Linear models: eager vs torch.compile vs torch.compile(mode="reduce-overhead").

Workloads: a small transformer block (LayerNorm, te.Linear QKV / proj / FC1 / FC2, attention in
torch; 4 x 512 tokens, width 1024), the demo's GPT at its medium size (d=512, 6 layers, 32 x 256
tokens, the loss as output: issue 23's model), the same GPT built from te.LayerNormLinear /
te.LayerNormMLP ("gpt-fused", its rows measured against the gpt's bf16 row, which is plain
torch math) and PERFORMANCE.md's GEMM set (one te.Linear per
shape: QKV, proj, FC1, FC2 at M=15872), per recipe. A step is `with te.autocast(recipe=r): y =
model(x)` then y.backward(dy), with the autocast inside the compiled function; bf16 parameters
and activations. The GPT also runs in bf16 without te.autocast (the "bf16" row: te.Linear's
F.linear path, nn.Linear's work), the baseline of issue 23's targets, which are printed after
the table: every workload and recipe compiled no slower than eager; the GPT compiled >= 0.8x of
compiled bf16's tokens/s and reduce-overhead >= 0.95x of bf16's reduce-overhead. Time: wall microseconds per step in synchronized loops (benchutil.time_host,
interleaved modes, median of rounds), after warm-up steps that compile and record the graphs;
reduce-overhead in a second pass over the rows (passes(): once cudagraph trees exist, tequant's
compiled ops take torch.empty's allocations, so default compile is measured before).
A GPT row also times the bf16 GPT's default-compiled step in the same interleaved loops
(--paired, the default): this host's speed drifts by up to 2x between processes and within one,
so the compiled ratio is taken loop by loop rather than against a bf16 row measured minutes
earlier (reduce-overhead, mostly GPU time, stays against the bf16 row).
Outputs of the three modes are checked equal (bitwise for the GEMM set; the block's torch ops are
fused by inductor, so its check is a relative error < 5e-2).

--profile STEPS adds, per row and mode, what torch.profiler sees over STEPS more steps: host
launches, GPU kernel time and the host ops with the most self CPU time per step (where a
host-bound step's time goes, e.g. compiled DelayedScaling against current scaling).

Run: python3 benchmarks/bench_compile.py [--quick] [--recipes ...] [--workloads block,qkv,...]
         [--profile STEPS] [--out FILE]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchutil  # noqa: E402

import tequant as te  # noqa: E402

WORKLOADS = ("block", "gpt", "gpt-fused") + benchutil.GEMM_SET
MODES = ("eager", "compiled", "reduce-overhead")
profiles = []  # --profile: (workload, recipe, {mode: profile()}) of each row, in order


class Block(torch.nn.Module):
    def __init__(self, width, heads, device):
        super().__init__()
        kw = {"params_dtype": torch.bfloat16, "device": device}
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width, device=device, dtype=torch.bfloat16)
        self.qkv = te.Linear(width, 3 * width, **kw)
        self.proj = te.Linear(width, width, **kw)
        self.norm2 = torch.nn.LayerNorm(width, device=device, dtype=torch.bfloat16)
        self.fc1 = te.Linear(width, 4 * width, **kw)
        self.fc2 = te.Linear(4 * width, width, **kw)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, w))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPTLoss(torch.nn.Module):
    """The demo's GPT with its targets held: forward(idx) is the training loss."""

    def __init__(self, gpt, targets):
        super().__init__()
        self.gpt, self.targets = gpt, targets

    def forward(self, idx):
        return self.gpt(idx, self.targets)


def build(workload, device, small):
    """(model, x, dy, exact, label): the module, its input and output grad, whether the modes must
    agree bit for bit, and the row's name."""
    g = torch.Generator(device=device).manual_seed(0)
    if workload == "block":
        width, batch, seq = (256, 2, 64) if small else (1024, 4, 512)
        model = Block(width, 8, device)
        x = torch.randn(batch, seq, width, generator=g, device=device, dtype=torch.bfloat16)
        return model, x, torch.randn_like(x), False, f"block {batch}x{seq} tokens, width {width}"
    if workload in ("gpt", "gpt-fused"):
        from tequant.demo.model import GPT, SIZES
        cfg = SIZES["tiny" if small else "medium"]
        torch.manual_seed(0)
        gpt = GPT(64, cfg["d_model"], cfg["layers"], cfg["heads"], cfg["seq_len"],
                  fused=workload == "gpt-fused")
        shape = (cfg["batch"], cfg["seq_len"])
        idx, targets = (torch.randint(0, 64, shape, generator=g, device=device) for _ in range(2))
        model = GPTLoss(gpt.to(device=device, dtype=torch.bfloat16), targets)
        return (model, idx, torch.ones((), device=device), False,
                f"GPT d={cfg['d_model']}, {cfg['layers']} layers, {shape[0]}x{shape[1]} tokens")
    label, m, k, n = benchutil.GEMM_SHAPES[workload]
    if small:
        label, m, k, n = "small", 256, 256, 512
    model = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(m, k, generator=g, device=device, dtype=torch.bfloat16)
    dy = torch.randn(m, n, generator=g, device=device, dtype=torch.bfloat16)
    return model, x, dy, True, f"{label} M={m} {k}->{n}"


def steps(model, recipe, device, modes):
    def forward(x):
        if recipe is None:  # the bf16 baseline
            return model(x)
        with te.autocast(recipe=recipe):
            return model(x)

    fns = {"eager": forward}
    if "compiled" in modes:
        fns["compiled"] = torch.compile(forward, fullgraph=True)
    if device == "cuda" and "reduce-overhead" in modes:
        fns["reduce-overhead"] = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    return fns


def passes(modes, device):
    """The modes of each pass over the rows. reduce-overhead makes cudagraph trees, after which
    tequant's compiled ops allocate through torch.empty for the rest of the process, so every
    row's default-compile time is taken first, then every row's reduce-overhead time (eager
    rerun beside it, as the reference its outputs are checked against)."""
    first = [m for m in modes if m != "reduce-overhead"]
    return [first] + ([["eager", "reduce-overhead"]]
                      if "reduce-overhead" in modes and device == "cuda" else [])


def step_fns_of(model, fns, x, dy, outputs):
    """{mode: step()}: one fwd+bwd of `model` through fns[mode], its output kept in outputs."""
    def step_of(mode):
        fn = fns[mode]

        def step():
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            model.zero_grad(set_to_none=True)
            torch.manual_seed(7)  # NVFP4's stochastic rounding: the same bits in every mode
            y = fn(x)
            y.backward(dy)
            outputs[mode] = y.detach().clone()
        return step
    return {mode: step_of(mode) for mode in fns}


def run(workload, name, recipe, args, device, failures, modes):
    """(label, {mode: us per step}, {mode: bf16's us per step in the same loops} or None)."""
    torch._dynamo.reset()
    small = args.quick or device == "cpu"
    model, x, dy, exact, label = build(workload, device, small)
    fns = steps(model, recipe, device, modes)
    outputs = {}
    modes = list(fns)
    step_fns = list(step_fns_of(model, fns, x, dy, outputs).values())
    # A GPT row times the bf16 GPT's compiled mode in the same loops (--paired): the host's
    # speed drifts by up to 2x between and within processes, which a baseline measured minutes
    # earlier in its own row does not share; issue 23's ratios are then taken loop by loop.
    paired = args.paired and recipe is not None and workload in ("gpt", "gpt-fused")
    if paired:
        base_model, base_x, base_dy, _, _ = build("gpt", device, small)
        base_fns = steps(base_model, None, device, modes)
        # compiled only: reduce-overhead's graphs of two models interleaved share cudagraph
        # trees' one pool and tree per device, which moves both rows' times (H200: delayed
        # 3644-3721 us alone, 3966 us beside bf16's), and its step is mostly GPU time anyway.
        base_modes = [m for m in modes if m == "compiled"]
        base_steps = step_fns_of(base_model, {m: base_fns[m] for m in base_modes}, base_x,
                                 base_dy, {})
        step_fns += [base_steps[m] for m in base_modes]
    for step in step_fns:  # compile, record the CUDA graphs, warm up
        for _ in range(3):
            step()
    ref = outputs["eager"]
    for mode in modes[1:]:
        err = benchutil.rel_err(outputs[mode], ref)
        # The block's torch ops are fused by inductor (other roundings), which can move a value
        # across a quantization step: NVFP4's coarse steps give ~2e-2 there.
        if (exact and not torch.equal(outputs[mode], ref)) or err > 5e-2:
            failures.append(f"{workload} {name} {mode}: output differs from eager (rel err {err:.2e})")
    times = benchutil.time_host(step_fns, device, args.calls, args.repeats)
    if args.profile:  # eager once per row (the second pass reruns it only as the reference)
        profiles.append((label, name, {mode: profile(step, device, args.profile)
                                       for mode, step in zip(modes, step_fns)
                                       if mode != "eager" or "reduce-overhead" not in modes}))
    base = dict(zip(base_modes, times[len(modes):])) if paired else None
    return label, dict(zip(modes, times)), base


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def profile(step, device, steps, top=8):
    """torch.profiler over `steps` more steps: per step, the host's launches (kernels, graphs,
    copies, memsets), the GPU's kernel time, and the host ops with the most self CPU time
    (what a host-bound step spends its time on). {launches, gpu_us, ops: [(name, calls, us)]}."""
    acts = [torch.profiler.ProfilerActivity.CPU] + \
        ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    benchutil.sync(device)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        benchutil.sync(device)
    launches, gpu_us, ops = 0, 0.0, []
    for e in prof.key_averages():
        if e.key in LAUNCHES:
            launches += e.count
        gpu_us += getattr(e, "self_device_time_total", 0.0) if e.device_type.name == "CPU" else 0.0
        if e.self_cpu_time_total > 0 and e.key not in LAUNCHES:
            ops.append((e.key, e.count / steps, e.self_cpu_time_total / steps))
    ops.sort(key=lambda o: -o[2])
    return {"launches": launches / steps, "gpu_us": gpu_us / steps, "ops": ops[:top]}


def profile_lines(profiles):
    """The --profile section: per row and mode, launches and GPU kernel time per step, then the
    host ops with the most self CPU time per step."""
    lines = ["", "Per step under torch.profiler (--profile): host launches (kernels, graphs, copies,"
             " memsets), GPU kernel time, and the host ops with the most self CPU time (calls, us);"
             " profiler overhead included, so read the shares, not the totals.", ""]
    lines += benchutil.table_head(["workload", "recipe", "mode", "launches", "GPU kernel us",
                                   "top host ops (calls, self us)"], 3)
    for where, name, by_mode in profiles:
        for mode, p in by_mode.items():
            ops = "; ".join(f"{benchutil.one_line(k, 48)} ({c:.0f}, {us:.0f})" for k, c, us in p["ops"])
            lines.append(f"| {where} | {name} | {mode} | {p['launches']:.0f} | "
                         f"{p['gpu_us']:.0f} | {ops} |")
    return lines


def main():
    ap = benchutil.parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="small shapes, fewer calls")
    ap.add_argument("--recipes", help="comma list of " + ", ".join(benchutil.RECIPE_NAMES))
    ap.add_argument("--workloads", help="comma list of " + ", ".join(WORKLOADS))
    ap.add_argument("--calls", type=int, default=None, help="steps per timed loop")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma list of " + ", ".join(MODES) + " (eager always runs: the reference)."
                         " reduce-overhead runs in a second pass over the rows: once it has run,"
                         " the process has cudagraph trees and tequant's compiled ops allocate"
                         " through torch.empty (as a user's process would)")
    ap.add_argument("--paired", action=argparse.BooleanOptionalAction, default=True,
                    help="time the bf16 GPT's compiled step in the same loops as each GPT row's"
                         " (issue 23's compiled ratio taken loop by loop; --no-paired: against"
                         " the bf16 row only)")
    ap.add_argument("--out", help="append the Markdown table to this file")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS steps of each mode (torch.profiler): launches, GPU "
                         "kernel time and the top host ops per step")
    args = benchutil.parse(ap)
    device = args.device
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in MODES for m in args.modes):
        ap.error(f"--modes: expected a comma list of {', '.join(MODES)}, got {args.modes}")
    if args.calls is None:
        args.calls = 5 if (args.quick or device == "cpu") else 20
    workloads = [w.strip() for w in (args.workloads or ",".join(WORKLOADS)).split(",") if w.strip()]
    # NVFP4's stochastic rounding draws its (seed, offset) on the host, which a CUDA graph
    # cannot capture (README: limitations): every mode runs NVFP4 without it here.
    recipes = [(name + " (no SR)", te.recipe.NVFP4BlockScaling(disable_stochastic_rounding=True))
               if name == "nvfp4" else (name, r) for name, r in benchutil.make_recipes(args.recipes)]
    failures, found, pairs = [], {}, {}
    for modes in passes(args.modes, device):
        for workload in workloads:
            for name, recipe in ([("bf16", None)] if workload == "gpt" else []) + recipes:
                if workload == "gpt-fused":  # the same label: gpt's bf16 row is its baseline
                    name += " (fused modules)"
                try:
                    where, t, base = run(workload, name, recipe, args, device, failures, modes)
                except Exception as e:  # noqa: BLE001  (a row that fails is reported, not fatal)
                    failures.append(f"{workload} {name}: "
                                    f"{benchutil.one_line(benchutil.exc_text(e))}")
                    continue
                row = found.setdefault((where, name), {})
                row.update({m: v for m, v in t.items() if m not in row})
                if base:
                    pairs.setdefault((where, name), {}).update(
                        {m: (t[m], v) for m, v in base.items()})
    rows = [(where, name, t) for (where, name), t in found.items()]
    columns = ["workload", "recipe"] + [f"{m} us/step" for m in MODES] + \
        ["compiled vs eager", "reduce-overhead vs eager"]
    lines = [f"## {benchutil.machine(device)}", "",
             "wall us per fwd+bwd step (autocast inside the compiled function); ratio = eager "
             "time / mode time (> 1: faster than eager)", ""]
    lines += benchutil.table_head(columns, 2)
    for where, name, t in rows:
        cells = [benchutil.num_text(t[m]) if m in t else "-" for m in MODES]
        ratios = [benchutil.ratio_text(t["eager"], t.get(m)) for m in MODES[1:]]
        lines.append("| " + " | ".join([where, name] + cells + ratios) + " |")
    lines += paired_lines(pairs) + targets(rows, pairs)
    if profiles:
        lines += profile_lines(profiles)
    return benchutil.finish("\n".join(lines), args.out, failures)


def paired_lines(pairs):
    """The --paired section: each GPT row's compiled modes beside the bf16 GPT's in the same
    timed loops."""
    if not pairs:
        return []
    lines = ["", "Paired (--paired): the bf16 GPT's compiled step timed in the same interleaved"
             " loops as each row's (us per step); ratio = bf16 time / row time (>= 1: as fast as"
             " bf16)", ""]
    lines += benchutil.table_head(["workload", "recipe", "mode", "us/step", "bf16 us/step (same "
                                   "loops)", "vs bf16"], 3)
    for (where, name), by_mode in pairs.items():
        for mode, (t, b) in by_mode.items():
            lines.append(f"| {where} | {name} | {mode} | {benchutil.num_text(t)} | "
                         f"{benchutil.num_text(b)} | {benchutil.ratio_text(b, t)} |")
    return lines


def targets(rows, pairs):
    """Issue 23's targets over the measured rows: [Markdown lines]. A row's ratio to bf16 is its
    paired one where it has one, else against the bf16 row."""
    lines = ["", "Targets (issue 23), measured in this run:", ""]
    lines += benchutil.table_head(["target", "measured", "goal", "met"], 1)
    bf16 = {where: t for where, name, t in rows if name == "bf16"}

    def row(text, value, goal):
        lines.append(f"| {text} | {value:.2f}x | >= {goal:.2f}x | {'yes' if value >= goal else 'NO'} |")
    for where, name, t in rows:
        if name == "bf16":
            continue
        if "compiled" in t:
            row(f"{where}, {name}: compiled vs eager", t["eager"] / t["compiled"], 1.0)
        paired = pairs.get((where, name), {})
        base = bf16.get(where)
        for mode, goal in (("compiled", 0.8), ("reduce-overhead", 0.95)):
            if mode in paired:
                mine, theirs = paired[mode]
                row(f"{where}, {name}: {mode} vs bf16 {mode} (same loops)", theirs / mine, goal)
            elif base is not None and mode in t and mode in base:
                row(f"{where}, {name}: {mode} vs bf16 {mode}", base[mode] / t[mode], goal)
    return lines


if __name__ == "__main__":
    sys.exit(main())
