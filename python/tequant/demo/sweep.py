"""`python -m tequant.demo --sweep`: training throughput per recipe against model width.

Where does FP8 start to pay? Small models are bound by the host (kernel launches, Python) and by
memory traffic outside the GEMMs, so quantizing costs more than the faster GEMMs save; as the
width grows the GEMMs dominate and FP8's twice-as-fast tensor cores show. For each width d the
sweep builds the demo's GPT (--sweep-layers blocks, head dim 128 (64 below d=512), seq 256,
batch 32: 8192 tokens per step), trains it a few warm-up steps and then times three windows
of --sweep-steps steps (the best counts) of the demo's training step (bf16 autocast on CUDA,
te.autocast, backward, gradient clipping, AdamW, fused on CUDA) on random tokens, per recipe, and
writes a table (sweep.md, printed), the numbers (sweep.json) and a plot of tokens/s and
speedup over bf16 against width (sweep.png). Tests: tests/test_demo.py.
"""
import gc
import json
import os
import sys
import time

import torch

from .model import GPT
from .report import _LABELS, _finite_or_none
from .train import RECIPES, describe_mode, optimizer, precision_contexts, training_step

DEFAULT_WIDTHS = (512, 1024, 2048, 3072, 4096)
SEQ, BATCH, VOCAB = 256, 32, 64
WARMUP, WINDOWS = 5, 3


def head_dim(width):
    """The head dim the sweep gives a model of this width (parse_args checks --widths with it)."""
    return 128 if width >= 512 else 64


def _heads(width):
    hd = head_dim(width)
    if width % hd:
        raise ValueError(f"--widths: {width} is not a multiple of {hd} (the head dim)")
    return width // hd


def time_width(name, width, layers, steps, device, use_compile):
    """(tokens/s, peak memory bytes or None) of one recipe at one width."""
    recipe = RECIPES[name]() if RECIPES[name] is not None else None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = GPT(VOCAB, width, layers, _heads(width), SEQ).to(device)
    opt = optimizer(model, 1e-4, device)
    forward = model
    if use_compile:
        torch._dynamo.reset()
        forward = torch.compile(model)
    contexts = precision_contexts(recipe, device)
    g = torch.Generator(device=device).manual_seed(0)
    x, y = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g, device=device) for _ in range(2))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(WARMUP):
        training_step(model, forward, opt, contexts, x, y)
    elapsed = float("inf")
    for _ in range(WINDOWS):  # the best window: a stray host stall does not decide the point
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            loss = training_step(model, forward, opt, contexts, x, y)
        sync()
        elapsed = min(elapsed, time.perf_counter() - start)
    if not torch.isfinite(loss):
        raise RuntimeError(f"--sweep: {name} at width {width} gave a non-finite loss")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return steps * BATCH * SEQ / elapsed, peak


def run_sweep(args, device, environment):
    """Times every (width, recipe), prints and writes the outputs; returns the exit status."""
    widths = args.widths or DEFAULT_WIDTHS
    for w in widths:
        _heads(w)
    print(f"tequant demo --sweep: GPT of {args.sweep_layers} layers, {BATCH}x{SEQ} tokens per "
          f"step, widths {', '.join(map(str, widths))}, {args.sweep_steps} timed steps per "
          f"point on {environment['device_name']}", file=sys.stderr)
    modes = {name: describe_mode(name, device) for name in args.recipes}
    # As the training demo does (main): a recipe this device cannot run is named up front, not
    # met as an error from inside te.Linear after the widths before it were timed.
    for name, (mode, reason) in modes.items():
        if mode == "unsupported":
            print(f"{name}: unsupported here ({reason}); leave it out of --recipes",
                  file=sys.stderr)
            return 2
    points = []
    for width in widths:
        for name in args.recipes:
            tok_s, peak = time_width(name, width, args.sweep_layers, args.sweep_steps, device,
                                     args.compile)
            points.append({"width": width, "recipe": name, "tokens_per_s": tok_s,
                           "peak_memory_bytes": peak})
            print(f"  d={width:<5} {name:<8} {tok_s:>12,.0f} tok/s", file=sys.stderr, flush=True)
    result = {"config": {"widths": list(widths), "layers": args.sweep_layers, "seq_len": SEQ,
                         "batch": BATCH, "timed_steps": args.sweep_steps, "windows": WINDOWS,
                         "warmup": WARMUP,
                         "compile": args.compile, "device": device.type,
                         "recipes": args.recipes},
              "execution_modes": {n: {"mode": m, "reason": r} for n, (m, r) in modes.items()},
              "environment": environment, "points": points}
    text = sweep_table(result)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(_finite_or_none(result), f, indent=1)
    plot_error = write_sweep_plot(result, os.path.join(args.out, "sweep.png"))
    if plot_error:
        print(plot_error, file=sys.stderr)
    print(f"wrote {os.path.join(args.out, 'sweep.md')}, sweep.json"
          f"{'' if plot_error else ', sweep.png'}", file=sys.stderr)
    return 0


def _by_width(result):
    table = {}
    for p in result["points"]:
        table.setdefault(p["width"], {})[p["recipe"]] = p["tokens_per_s"]
    return table


def sweep_table(result):
    """Markdown: one row per width, tokens/s per recipe and, beside each, its ratio to bf16."""
    cfg, env = result["config"], result["environment"]
    names = cfg["recipes"]
    base = "bf16" if "bf16" in names else None
    labels = {n: ("fp32 (CPU baseline)" if n == "bf16" and cfg["device"] == "cpu"
                  else _LABELS[n]) for n in names}
    head = "| d_model | " + " | ".join(labels[n] + " tok/s" for n in names) + " |"
    lines = [f"### Training tokens/s against width ({env['device_name']}; torch {env['torch']}; "
             f"commit {env.get('commit')}; {cfg['layers']} layers, {cfg['batch']}x"
             f"{cfg['seq_len']} tokens, {'torch.compile' if cfg['compile'] else 'eager'})", "",
             head, "|---:|" + "---:|" * len(names)]
    for width, row in sorted(_by_width(result).items()):
        cells = []
        for n in names:
            v = row.get(n)
            cell = f"{v:,.0f}"
            if base and n != base and row.get(base):
                cell += f" ({v / row[base]:.2f}x)"
            cells.append(cell)
        lines.append(f"| {width} | " + " | ".join(cells) + " |")
    modes = result["execution_modes"]
    emulated = [n for n in names if modes[n]["mode"] == "emulated"]
    lines += ["", f"Ratios are against {labels.get('bf16', 'bf16')} at the same width. A full "
              "training step each (forward, backward, gradient clipping, AdamW (fused on CUDA)), fp32 "
              "master weights."]
    if emulated:
        lines.append("Emulated here (" + ", ".join(_LABELS[n] for n in emulated) + "): real "
                     "quantized bits, GEMMs as BF16 on dequantized operands, so slower than "
                     "bf16 by design on this GPU; they gain on GPUs with their block-scaled "
                     "tensor cores (Blackwell).")
    return "\n".join(lines)


def write_sweep_plot(result, path):
    """sweep.png: tokens/s and speedup over bf16 against width; returns an error text when
    matplotlib is missing, else None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no sweep.png (pip install matplotlib)"
    by_width = _by_width(result)
    widths = sorted(by_width)
    names = result["config"]["recipes"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in names:
        ax1.plot(widths, [by_width[w][n] for w in widths], marker="o", label=_LABELS[n])
        if n != "bf16" and "bf16" in names:
            ax2.plot(widths, [by_width[w][n] / by_width[w]["bf16"] for w in widths], marker="o",
                     label=_LABELS[n])
    ax1.set(xlabel="d_model", ylabel="training tokens/s", title="throughput")
    ax2.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax2.set(xlabel="d_model", ylabel="speedup over bf16", title="speedup over bf16")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
