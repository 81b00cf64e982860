"""GPT and Llama transformer blocks fwd+bwd (issue 24): nn bf16 vs te.Linear vs the fused modules.

Not a model: one block on [s, b, d] activations (TransformerEngine's layout), causal attention
through torch's scaled_dot_product_attention, no embeddings. Its test is
tests/test_bench_block.py (the --device cpu quick mode, the kernel-name classifier, the ratio and
target arithmetic).

Blocks (distbench.Block, the blocks bench_distributed.py trains): gpt = LayerNorm, QKV / proj with
biases, LayerNorm, fc1 -> GELU(tanh) -> fc2 with ffn = 4 d; llama = RMSNorm, no biases, SwiGLU
down(silu(gate) * up) with ffn = 3.5 d rounded up to 256 (bench_distributed's 14336 at d = 4096);
eps 1e-5 in every norm; heads of --head-dim. Each block is built three ways on the same weights
(norm parameters and biases random too, so that a path that drops one shows):
  bf16       torch.nn.Linear / LayerNorm / RMSNorm, bf16 parameters and activations;
  te.Linear  te.Linear for each GEMM, torch's norm and activation (the issue's baseline), a recipe;
  fused      te.LayerNormLinear (norm1 + QKV), te.Linear (proj), te.LayerNormMLP (norm2 + fc1 /
             activation / fc2, llama's fc1 = [gate; up] with "swiglu"), a recipe.
A step: clear the grads, y = block(x) under te.autocast(recipe) (the bf16 block outside it),
y.backward(dy), x requiring grad (a block inside a stack computes its input's gradient); eager, or
the block through torch.compile with the autocast outside it (--exec).
Check first: every variant's first step, seeded alike (NVFP4's stochastic rounding draws alike),
is compared with bf16's, tensor by tensor (the block's branch y - x, the input's grad beyond dy,
every parameter's grad): te.Linear's error within the recipe's loose bound, fused's within 1.25x
the te.Linear block's error in that tensor (or 1e-2): the fused block must equal the te.Linear
block up to roundings of its own; its distance to te.Linear's first step is printed too. A
mismatch is printed loudly in the table and fails the run (exit status 1), so a wrong fused path
cannot print a fast number.
Then time: median step of --steps after --warmup (benchutil: CUDA events behind a held-back GPU,
or perf_counter on CPU); eager rows take --rounds - 1 more rounds, the variants of a model and
width in turn, and report the median round (interleaved(): drift hits all alike); peak memory =
torch.cuda.max_memory_allocated over the warm-up and timed steps after a reset, less what was
allocated before the variant was built (the variant alone). Reported: step ms,
tokens/s, vs bf16 (the bf16 block of the same model, d and exec), vs te.Linear (the te.Linear
block of the same recipe), vs eager (the same variant eager), peak GiB and its ratio to the
te.Linear block's; then the issue's targets (eager at d = 4096: gpt fused >= 1.65x / 1.60x /
1.40x bf16 with delayed / current / block, llama >= 1.55x / 1.50x / 1.35x; compiled >= eager;
peak memory <= the te.Linear block's) with what was measured.
--profile: torch.profiler over --profile-steps more steps of each variant, CUDA kernel time per
step by category of the kernel's name (GEMM, quantize (of it the amax passes), attention, norm,
activation, other elementwise; see CATEGORIES), the issue's table. On CPU it is the self time of
torch's ops (tequant's C calls are no torch ops there: unseen), a smoke of the path only.
--time-limit S starts no variant after S seconds (the rest: skipped rows; the tables still print).

Run (GPU machine, after `python3 setup.py build_ext --inplace`; TEQUANT_BENCH_COMMIT=<commit>
where .git is stale): eager and compiled, d = 4096 and 2048, both models, the FP8 recipes, about
5 min on an H100 (--time-limit 240: variants not started by then are listed as skipped), then
the profile (eager, d = 4096):
  PYTHONPATH=$PWD/python python3 benchmarks/bench_block.py --recipes delayed,current,block \
      --exec eager,compile --time-limit 240 --out
  PYTHONPATH=$PWD/python python3 benchmarks/bench_block.py --d 4096 \
      --recipes delayed,current,block --profile --out
  python3 benchmarks/bench_block.py --device cpu     # the quick mode: d = 128, 128 tokens
Options: --models gpt,llama --d 4096,2048 --tokens 8192 --seq 2048 --head-dim 128
  --recipes (benchutil's names; default all) --exec eager[,compile] --compile-backend inductor
  --steps 10 --warmup 3 --rounds 5 (CPU: 2)
  --profile --profile-steps 3 --time-limit S --out [FILE] (appended; alone:
  docs/results/bench_block.md)
"""
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchutil  # noqa: E402
import distbench  # noqa: E402

import tequant as te  # noqa: E402

MODELS = ("gpt", "llama")
EXECS = ("eager", "compile")
BLOCKS = ("bf16", "te.Linear", "fused")
EPS = 1e-5
DEFAULT_OUT = "docs/results/bench_block.md"
SIZES = {  # by device: d list, tokens, seq, head dim, warmup, steps, profile steps, rounds
    "cuda": ("4096,2048", 8192, 2048, 128, 3, 10, 3, 5),
    "cpu": ("128", 128, 64, 32, 1, 2, 1, 2),
}
# Issue 24 / PERFORMANCE.md B1, B2: the fused block, eager, d = 4096, vs the bf16 block
TARGET_D = 4096
TARGETS = {"gpt": {"delayed": 1.65, "current": 1.60, "block": 1.40},
           "llama": {"delayed": 1.55, "current": 1.50, "block": 1.35}}
# First-step checks (relative errors per tensor against bf16): the te.Linear block (a wrong
# quantized path is off by ~1), the fused block (fused_bounds)
LOOSE = {"nvfp4": 0.6}
LOOSE_DEFAULT = 0.25
FUSED_FACTOR = 1.25
TIGHT_FLOOR = 1e-2

# ---- kernel names -> categories -----------------------------------------------------------------
# (category, lowercase substrings), first match wins, the rest is "other" (other elementwise).
# Attention before GEMM: cuDNN's and CUTLASS's attention kernels name wgmma / cutlass too.
# tequant's kernels (cuda/*.cu, anonymous namespace): the quantizers' quantize / cast / amax /
# transpose / pad / codec / dequantize kernels, the GEMM's alpha_kernel, delayed scaling's
# amax_update_kernel; its norm kernels norm_forward_kernel, fast_kernel(FwdParams),
# norm_backward_kernel, column_partial_kernel, column_sum_kernel(BwdParams). torch's: flash /
# fmha / cudnn sdpa, cuBLAS(Lt) nvjet / xmma / gemm / splitKreduce, vectorized_layer_norm_kernel,
# layer_norm_grad_input_kernel, GammaBetaBackward..., RowwiseMoments..., GeluCUDAKernelImpl,
# silu_kernel; inductor's triton_* kernels carry the ops they fuse in their names. On CPU, torch's
# op names (aten::mm, aten::native_layer_norm, ...), te.Linear's autograd Function and its
# tequant::linear_* ops counted as GEMM (the C call quantizes and multiplies: no split there).
CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "splitkreduce", "triton_tem",
              "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
              "_quantizedlinear", "tequant::linear_")),
    ("quantize", ("quantize_kernel", "cast_kernel", "amax_kernel", "amax_update_kernel",
                  "codec_kernel", "pad_rows_kernel", "small_kernel", "small_current_kernel",
                  "fused_current_kernel", "fused_pair_kernel", "delayed_pair_kernel",
                  "quantize_pair_kernel",
                  "values_pair_kernel", "alpha_kernel", "transpose_kernel", "empty_kernel")),
    ("norm", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "gammabeta", "rowwisemoments",
              "computeinternalgradients", "computegradientfusedparams", "fwdparams",
              "bwdparams", "norm_forward_kernel", "norm_backward_kernel", "column_partial_kernel",
              "column_sum_kernel")),
    ("activation", ("gelu", "silu", "swiglu", "geglu", "reglu", "swish", "relu")),
)
COLUMNS = ("gemm", "quantize", "attention", "norm", "activation", "other")
AMAX = "amax_kernel"  # the amax passes of per-tensor current scaling (not amax_update_kernel)


def category(name):
    return benchutil.category(name, CATEGORIES)


def summarize(times, steps):
    """ms per step by category (COLUMNS, "kernels" = their sum, "amax" = the amax passes within
    quantize) from (name, microseconds) pairs gathered over `steps` steps."""
    out = dict.fromkeys(COLUMNS + ("kernels", "amax"), 0.0)
    for name, us in times:
        cat = category(name)
        out[cat] += us / 1e3 / steps
        out["kernels"] += us / 1e3 / steps
        if AMAX in name.lower():
            out["amax"] += us / 1e3 / steps
    return out


def kernel_times(prof, device):
    """(name, us) of each CUDA kernel in the profile (its Chrome trace, as profile_distributed.py
    reads it), or on CPU of each torch op's self time."""
    if device != "cuda":
        return [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [(e["name"], e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e]


# ---- blocks -------------------------------------------------------------------------------------

def ffn_of(model, d):
    return 4 * d if model == "gpt" else benchutil.ceil_div(7 * d, 2 * 256) * 256


class FusedBlock(torch.nn.Module):
    """distbench.Block from TE's fused modules: attn.qkv = te.LayerNormLinear (norm1 + QKV),
    attn.proj = te.Linear, mlp = te.LayerNormMLP (norm2 + fc1 / act / fc2)."""

    def __init__(self, model, d, ffn, heads, device):
        super().__init__()
        gpt = model == "gpt"
        normalization = "LayerNorm" if gpt else "RMSNorm"
        self.attn = distbench.Attention(d, heads, gpt, "meta", {})  # its core; layers replaced
        self.attn.qkv = te.LayerNormLinear(d, 3 * d, eps=EPS, bias=gpt, device=device,
                                           normalization=normalization)
        self.attn.proj = te.Linear(d, d, bias=gpt, device=device)
        self.mlp = te.LayerNormMLP(d, ffn, eps=EPS, bias=gpt, normalization=normalization,
                                   activation="gelu" if gpt else "swiglu", device=device)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


# distbench.Block's names -> FusedBlock's (llama's gate and up stack into mlp.fc1.weight)
FUSED_NAMES = {"norm1.weight": "attn.qkv.layer_norm_weight",
               "norm1.bias": "attn.qkv.layer_norm_bias",
               "norm2.weight": "mlp.layer_norm_weight", "norm2.bias": "mlp.layer_norm_bias",
               "fc1.weight": "mlp.fc1.weight", "fc1.bias": "mlp.fc1.bias",
               "fc2.weight": "mlp.fc2.weight", "fc2.bias": "mlp.fc2.bias",
               "down.weight": "mlp.fc2.weight"}


def to_fused(tensors):
    """{distbench.Block name: tensor} (weights or grads) -> {FusedBlock name: tensor}."""
    out = {FUSED_NAMES.get(k, k): v for k, v in tensors.items() if k not in ("gate.weight",
                                                                             "up.weight")}
    if "gate.weight" in tensors:
        out["mlp.fc1.weight"] = torch.cat([tensors["gate.weight"], tensors["up.weight"]])
    return out


def base_weights(model, d, heads, device):
    """The weights every variant of (model, d) loads: distbench.Block's te.Linear init (seed 0),
    norm weights 1 + N(0, 0.1), biases N(0, 0.1); bf16, on CPU."""
    torch.manual_seed(0)
    block = distbench.Block(model, d, ffn_of(model, d), heads, device, {})
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.startswith("norm") and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return {k: v.detach().to("cpu", torch.bfloat16) for k, v in block.state_dict().items()}


def build(model, d, heads, kind, weights, device):
    ffn = ffn_of(model, d)
    if kind == "fused":
        block = FusedBlock(model, d, ffn, heads, device)
        block.load_state_dict(to_fused(weights), strict=True)
    else:
        linear = torch.nn.Linear if kind == "bf16" else te.Linear
        block = distbench.Block(model, d, ffn, heads, device, {}, linear=linear)
        block.load_state_dict(weights, strict=True)
        block.norm1.eps = block.norm2.eps = EPS  # torch's RMSNorm default is the dtype's eps
    return block.to(torch.bfloat16)


# ---- one variant --------------------------------------------------------------------------------

def make_step(block, recipe, x, dy, backend):
    """step(_) -> y: one fwd+bwd (the argument: benchutil's timers pass the buffer, x here);
    backend: torch.compile's, or None for eager."""
    fn = torch.compile(block, backend=backend) if backend else block

    def step(_=None):
        benchutil.clear_grads(block, x)
        with te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
            y = fn(x)
        y.backward(dy)
        return y
    return step


def first_step(step, block, x, dy, fused):
    """The first step's branch (y - x, float32), input grad beyond dy and parameter grads, on
    the device, every variant in FusedBlock's names; NVFP4's draws seeded alike."""
    torch.manual_seed(7)
    y = step()
    out = {"y - x": y.detach().float() - x.detach().float(),
           "x.grad - dy": x.grad.float() - dy.float()}
    grads = {n: p.grad.detach() for n, p in block.named_parameters() if p.grad is not None}
    out.update(grads if fused else to_fused(grads))
    return out


def errors(got, ref):
    """{name: relative error of got[name] against ref[name]} over ref's names (missing: inf),
    computed on got's device (ref may be on the CPU)."""
    return {name: benchutil.rel_err(got[name], r.to(got[name].device)) if name in got
            else float("inf") for name, r in ref.items()}


def run_variant(args, model, d, ex, kind, recipe_name, recipe, weights, refs):
    """One row: builds, checks the first step against its reference in refs (and keeps this
    variant's first step there, on the CPU), warms up, times and (--profile) profiles."""
    device = args.device
    heads = d // args.head_dim
    base = torch.cuda.memory_allocated() if device == "cuda" else 0  # live earlier variants
    if ex == "compile":
        torch._dynamo.reset()
    block = build(model, d, heads, kind, weights, device)
    if recipe is not None:
        te.prepare_state(block, recipe)
    g = torch.Generator(device=device).manual_seed(1)
    b = args.tokens // args.seq
    x = torch.randn(args.seq, b, d, generator=g, device=device, dtype=torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn(args.seq, b, d, generator=g, device=device, dtype=torch.bfloat16)
    step = make_step(block, recipe, x, dy, args.compile_backend if ex == "compile" else None)
    row = {"model": model, "d": d, "exec": ex, "block": kind, "recipe": recipe_name,
           "tokens": args.tokens}
    out = first_step(step, block, x, dy, kind == "fused")
    row["check"], row["check_ok"], errs = check(refs, model, d, ex, kind, recipe_name, out)
    refs[(model, d, ex, kind, recipe_name)] = ({k: v.cpu() for k, v in out.items()}, errs)
    del out  # before the peak's reset: the check's tensors are not the variant's
    benchutil.sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    us = benchutil.timer(device)(step, [x], args.warmup, args.steps)
    row["step_ms"] = us / 1e3
    row["tokens_per_s"] = args.tokens / (us / 1e6)
    row["peak_gib"] = ((torch.cuda.max_memory_allocated() - base) / 2**30
                       if device == "cuda" else None)
    row["rounds_us"] = [us]
    if ex == "eager" and args.rounds > 1:
        row["_step"] = (step, x)  # for interleaved(), then dropped
    if args.profile:
        acts = [torch.profiler.ProfilerActivity.CPU] + \
            ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.profile_steps):
                step()
            benchutil.sync(device)
        times = kernel_times(prof, device)
        row["profile"] = summarize(times, args.profile_steps)
        row["other_kernels"] = top_other(times, args.profile_steps)
    return row


def check(refs, model, d, ex, kind, recipe_name, out):
    """(cell text, ok, errors against bf16) of a variant's first step `out`: bf16 is the
    reference; te.Linear within LOOSE of it; fused within fused_bounds (of the te.Linear block's
    own errors against bf16)."""
    if kind == "bf16":
        return "reference", True, {}
    base = refs.get((model, d, ex, "bf16", "bf16"))
    if base is None:
        return "no bf16 reference", True, {}
    errs = errors(out, base[0])
    if kind == "te.Linear":
        bound = LOOSE.get(recipe_name, LOOSE_DEFAULT)
        ok, worst = verdict(errs, dict.fromkeys(errs, bound))
        return f"{'ok' if ok else 'MISMATCH'}: {errs[worst]:.1e} vs bf16 ({worst})", ok, errs
    lin = refs.get((model, d, ex, "te.Linear", recipe_name))
    if lin is None:
        return "no te.Linear reference", True, errs
    ok, worst = verdict(errs, fused_bounds(lin[1]))
    apart = errors(out, lin[0])
    far = max(apart, key=lambda n: apart[n] if apart[n] == apart[n] else float("inf"))
    x_err = errs[worst] / max(lin[1].get(worst, 0.0), 1e-30)
    return (f"{'ok' if ok else 'MISMATCH'}: {x_err:.2f}x te.Linear's error ({worst}); "
            f"{apart[far]:.1e} from te.Linear", ok, errs)


def fused_bounds(linear_vs_bf16):
    """Per tensor, the fused block's bound on its first-step error against bf16: FUSED_FACTOR x
    the te.Linear block's error there, at least TIGHT_FLOOR. The same quantized computation is
    as far from bf16 as the te.Linear block (its own roundings: llama's fused fc1 quantizes
    [gate; up] with one scale where the te.Linear block has two; 1.00-1.08x measured); a wrong
    path (a norm, bias or activation dropped or wrong) adds an error of its own."""
    return {name: max(TIGHT_FLOOR, FUSED_FACTOR * err) for name, err in linear_vs_bf16.items()}


def verdict(errs, bounds):
    """(every error within its bound (NaN is not), the name of the largest error / bound)."""
    bounds = {n: bounds.get(n, TIGHT_FLOOR) for n in errs}
    worst = max(errs, key=lambda n: errs[n] / bounds[n] if errs[n] == errs[n] else float("inf"))
    return all(errs[n] <= bounds[n] for n in errs), worst


def top_other(times, steps, limit=6):
    per = {}
    for name, us in times:
        if category(name) == "other":
            per[name] = per.get(name, 0.0) + us / 1e3 / steps
    return sorted(per.items(), key=lambda kv: -kv[1])[:limit]


# ---- ratios, targets, tables --------------------------------------------------------------------

def key(r, **change):
    k = {f: r[f] for f in ("model", "d", "exec", "block", "recipe")}
    k.update(change)
    return tuple(k[f] for f in ("model", "d", "exec", "block", "recipe"))


def ratio(num, den):
    return num / den if num and den else None


def ratios(results):
    """Adds to each measured row: vs_bf16 (its speed over the bf16 block of the same model, d
    and exec), vs_linear (over the te.Linear block of the same recipe, exec), vs_eager (over
    itself eager; compile rows only), peak_vs_linear (its peak over that te.Linear block's)."""
    done = {key(r): r for r in results if "step_ms" in r}
    for r in done.values():
        bf16 = done.get(key(r, block="bf16", recipe="bf16"))
        lin = done.get(key(r, block="te.Linear"))
        eager = done.get(key(r, exec="eager")) if r["exec"] != "eager" else None
        r["vs_bf16"] = ratio(r["tokens_per_s"], bf16 and bf16["tokens_per_s"])
        r["vs_linear"] = ratio(r["tokens_per_s"], lin and lin["tokens_per_s"])
        r["vs_eager"] = ratio(r["tokens_per_s"], eager and eager["tokens_per_s"])
        r["peak_vs_linear"] = ratio(r["peak_gib"], lin and lin["peak_gib"])
    return results


def targets(results):
    """[(what, measured or None, goal text, met or None)] for the issue's targets, from rows
    with ratios(): the fused block eager at d = TARGET_D vs bf16 (TARGETS), every fused row
    compiled vs eager (>= 1), every fused row's peak vs the te.Linear block's (<= 1). Met is
    judged on the ratio as printed (3 decimals)."""
    out = []
    fused = [r for r in results if r["block"] == "fused" and "step_ms" in r]
    for r in fused:
        goal = TARGETS.get(r["model"], {}).get(r["recipe"])
        if r["exec"] == "eager" and r["d"] == TARGET_D and goal is not None:
            v = r["vs_bf16"]
            out.append((f"{r['model']} d={r['d']} eager {r['recipe']}: fused vs bf16", v,
                        f">= {goal:.2f}x", None if v is None else round(v, 3) >= goal))
    for r in fused:
        if r["exec"] != "eager":
            v = r["vs_eager"]
            out.append((f"{r['model']} d={r['d']} {r['recipe']}: fused {r['exec']} vs eager",
                        v, ">= 1.00x", None if v is None else round(v, 3) >= 1.0))
    for r in fused:
        v = r["peak_vs_linear"]
        if r["peak_gib"] is not None:
            out.append((f"{r['model']} d={r['d']} {r['exec']} {r['recipe']}: fused peak vs "
                        f"te.Linear", v, "<= 1.00x", None if v is None else round(v, 3) <= 1.0))
    return out


def x_text(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}x"


def tables(results, args):
    lines = []
    cols = ["exec", "block", "recipe", "step ms", "tokens/s", "vs bf16", "vs te.Linear",
            "vs eager", "peak GiB", "peak vs te.Linear", "first step check"]
    for d in args.d:
        for model in args.models:
            rows = [r for r in results if r["model"] == model and r["d"] == d]
            if not rows:
                continue
            b = args.tokens // args.seq
            lines += [f"### {model} block, d={d}, ffn={ffn_of(model, d)}, "
                      f"{d // args.head_dim} heads, [s, b] = [{args.seq}, {b}] "
                      f"({args.tokens} tokens), fwd+bwd", "", *benchutil.table_head(cols, 3)]
            for r in rows:
                head = [r["exec"], r["block"], r["recipe"]]
                if "step_ms" not in r:
                    why = r.get("error") or r.get("skipped")
                    lines.append("| " + " | ".join(head + [why] + [""] * (len(cols) - 4)) +
                                 " |")
                    continue
                peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
                check = r["check"] if r["check_ok"] else f"**{r['check']}**"
                lines.append("| " + " | ".join(head + [
                    f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:,.0f}", x_text(r["vs_bf16"]),
                    x_text(r["vs_linear"]), x_text(r["vs_eager"]), peak,
                    x_text(r["peak_vs_linear"]), check]) + " |")
            lines.append("")
    goals = targets(results)
    lines += ["Targets (issue 24; PERFORMANCE.md B1 / B2), measured in this run:", "",
              *benchutil.table_head(["target", "measured", "goal", "met"], 1)]
    for what, v, goal, met in goals:
        lines.append(f"| {what} | {x_text(v, 3)} | {goal} | "
                     f"{'-' if met is None else ('yes' if met else 'NO')} |")
    if not any(g[0].endswith("fused vs bf16") for g in goals):
        lines.append(f"| fused vs bf16 targets | not measured (eager, d={TARGET_D}, "
                     f"delayed / current / block) | | |")
    lines.append("")
    return lines


def profile_table(results, device):
    unit = "CUDA kernel ms" if device == "cuda" else "CPU self ms of torch ops (smoke only)"
    cols = ["model", "d", "exec", "block", "recipe", "step ms", "total", "GEMM", "quantize",
            "attention", "norm", "activation", "other elementwise"]
    lines = [f"Where the time goes ({unit} per fwd+bwd step, torch.profiler):", "",
             *benchutil.table_head(cols, 5)]
    other = {}
    for r in results:
        p = r.get("profile")
        if p is None:
            continue
        quant = f"{p['quantize']:.2f}" + (f" ({p['amax']:.2f} amax)" if p["amax"] else "")
        cells = [r["model"], str(r["d"]), r["exec"], r["block"], r["recipe"],
                 f"{r['step_ms']:.2f}", f"{p['kernels']:.2f}", f"{p['gemm']:.2f}", quant,
                 *(f"{p[c]:.2f}" for c in ("attention", "norm", "activation", "other"))]
        lines.append("| " + " | ".join(cells) + " |")
        for name, ms in r["other_kernels"]:
            other[name] = max(other.get(name, 0.0), ms)
    lines += ["", "Largest kernels counted as other elementwise (ms per step, the most in any "
              "row; check the classification):", ""]
    for name, ms in sorted(other.items(), key=lambda kv: -kv[1])[:10]:
        lines.append(f"- {ms:.3f} {benchutil.one_line(name, 150)}")
    lines.append("")
    return lines


# ---- command line -------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = benchutil.parser(__doc__)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--d", help="comma list of widths (default 4096,2048; CPU 128)")
    ap.add_argument("--recipes", help="comma list of " + ", ".join(benchutil.RECIPE_NAMES) +
                    " (default: all)")
    ap.add_argument("--exec", default="eager", help="eager, compile or eager,compile")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile's backend (the CPU test's quick mode: aot_eager)")
    for name in ("tokens", "seq", "head-dim", "warmup", "steps", "profile-steps", "rounds"):
        ap.add_argument("--" + name, type=int)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--time-limit", type=float, default=0.0)
    ap.add_argument("--out", nargs="?", const=DEFAULT_OUT,
                    help=f"append the tables to FILE (alone: {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is available")
    names = ("d", "tokens", "seq", "head_dim", "warmup", "steps", "profile_steps", "rounds")
    for name, default in zip(names, SIZES[args.device]):
        if getattr(args, name) is None:
            setattr(args, name, default)
    benchutil.check_args(ap, args)  # counts and sizes >= 1 (warmup >= 0), --out writable
    d = [v.strip() for v in str(args.d).split(",") if v.strip()]
    if not d or not all(v.isdigit() and int(v) > 0 for v in d):  # was a ValueError traceback
        ap.error(f"--d {args.d!r}: expected a comma list of positive widths")
    args.d = [int(v) for v in d]
    args.models = benchutil.listed(ap, "--models", args.models, MODELS)
    args.exec = benchutil.listed(ap, "--exec", args.exec, EXECS)
    args.recipes = benchutil.make_recipes(args.recipes)
    if args.tokens % args.seq:
        ap.error(f"--tokens {args.tokens} is not a multiple of --seq {args.seq}")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    bad = [d for d in args.d if d % args.head_dim]
    if bad:
        ap.error(f"--d {bad}: not multiples of --head-dim {args.head_dim}")
    return args


def interleaved(rows, args):
    """The eager rows of one (model, d) timed in args.rounds - 1 more rounds, every variant in
    turn (drift then hits all alike); step_ms: the median round. Compiled rows keep their one
    round (each variant's torch._dynamo.reset() would make an earlier one recompile here)."""
    live = [r for r in rows if "_step" in r]
    for _ in range(args.rounds - 1):
        for r in live:
            step, x = r["_step"]
            r["rounds_us"].append(benchutil.timer(args.device)(step, [x], 1, args.steps))
    for r in live:
        us = statistics.median(r["rounds_us"])
        r["step_ms"], r["tokens_per_s"] = us / 1e3, args.tokens / (us / 1e6)
        del r["_step"]


def configurations(args):
    """(model, d, exec, block, recipe name, recipe) in run order: per exec and d (eager and the
    first d first: a time limit cuts compile and the later widths), per model the bf16 block,
    then per recipe the te.Linear block and the fused one (each fused row after its
    reference)."""
    out = []
    for ex in args.exec:
        for d in args.d:
            for model in args.models:
                out.append((model, d, ex, "bf16", "bf16", None))
                for name, recipe in args.recipes:
                    out += [(model, d, ex, kind, name, recipe) for kind in BLOCKS[1:]]
    return out


def main(argv=None):
    args = parse_args(argv)
    results, refs, weights, start = [], {}, {}, time.monotonic()
    configs = configurations(args)
    for i, (model, d, ex, kind, name, recipe) in enumerate(configs):
        row = {"model": model, "d": d, "exec": ex, "block": kind, "recipe": name}
        if args.time_limit and time.monotonic() - start > args.time_limit:
            results.append(dict(row, skipped="time limit"))
        else:
            try:
                if (model, d) not in weights:  # (on the CPU)
                    weights[(model, d)] = base_weights(model, d, d // args.head_dim, args.device)
                row = run_variant(args, model, d, ex, kind, name, recipe, weights[(model, d)],
                                  refs)
            except Exception as e:  # noqa: BLE001  (a variant that fails is reported, not fatal)
                row["error"] = benchutil.one_line(benchutil.exc_text(e), 240)
            results.append(row)
            print(f"[{time.monotonic() - start:6.0f} s] {model} d={d} {ex} {kind} {name}: " +
                  (f"{row['step_ms']:.2f} ms, {row['check']}" if "step_ms" in row
                   else row.get("error", "")), file=sys.stderr, flush=True)
        for k in [k for k in refs if k[:3] != (model, d, ex)]:
            del refs[k]  # references of the rows of (model, d, exec) only
        if configs[i + 1:i + 2] != [] and configs[i + 1][:3] == (model, d, ex):
            continue  # the (model, d, exec) group's variants stay built for interleaved()
        interleaved([r for r in results if (r["model"], r["d"], r["exec"]) == (model, d, ex)],
                    args)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    ratios(results)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (reference)"
    text = [f"## bench_block: {device}, {', '.join(args.models)}, d {args.d}, "
            f"{', '.join(args.exec)}, {time.monotonic() - start:.0f} s", "",
            benchutil.machine(args.device), "",
            f"median step of {args.steps} after {args.warmup} warm-up (eager rows: the median "
            f"of {args.rounds} such rounds, the variants of a model and width taking turns in "
            "each round); vs bf16 / vs te.Linear "
            "/ vs eager: tokens/s over that row's (> 1: faster); peak: "
            "torch.cuda.max_memory_allocated of the variant alone. First step check, relative "
            "errors against the bf16 block over the branch y - x, the input grad beyond dy and "
            "every parameter grad: te.Linear's largest (bound: "
            f"{LOOSE_DEFAULT:g}, nvfp4 {LOOSE['nvfp4']:g}); fused: its largest error over the "
            f"te.Linear block's in the same tensor (bound: {FUSED_FACTOR:g}x, or "
            f"{TIGHT_FLOOR:g} absolute), then its largest relative difference from the "
            "te.Linear block's first step", ""]
    text += tables(results, args)
    if args.profile:
        text += profile_table(results, args.device)
    failures = [f"{r['model']} d={r['d']} {r['exec']} {r['block']} {r['recipe']}: {r['error']}"
                for r in results if "error" in r]
    failures += [f"{r['model']} d={r['d']} {r['exec']} {r['block']} {r['recipe']}: {r['check']}"
                 for r in results if not r.get("check_ok", True)]
    return benchutil.finish("\n".join(text), args.out, failures)


if __name__ == "__main__":
    sys.exit(main())
