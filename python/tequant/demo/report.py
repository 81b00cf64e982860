"""The demo's outputs: the Markdown table (printed and written to results.md), the loss-curve
plot (loss.png, matplotlib) and every number in results.json.

Gaps and speedups are against the baseline run (bf16 on CUDA, fp32 on CPU) when it ran. Values
that are not finite are written to JSON as null (JSON has no NaN).
Tests: tests/test_demo.py.
"""
import json
import math
import os

from .train import TARGET_PCT

_LABELS = {"bf16": "bf16 (baseline)", "delayed": "DelayedScaling", "current":
           "Float8CurrentScaling", "block": "Float8BlockScaling", "mxfp8": "MXFP8BlockScaling",
           "nvfp4": "NVFP4BlockScaling"}


def run_label(run, device_type):
    if run["name"] == "bf16" and device_type == "cpu":
        return "high precision (fp32 on CPU)"
    return _LABELS[run["name"]]


def summarize(runs):
    """Adds gap_pct, speedup, target_pct and within_target to each run (None without a baseline
    or a finite number to compare)."""
    base = next((r for r in runs if r["name"] == "bf16"), None)
    for r in runs:
        target = TARGET_PCT.get(r["name"])
        r["target_pct"], r["gap_pct"], r["speedup"], r["within_target"] = target, None, None, None
        if base is None or r is base:
            continue
        b, v = base["final_val_loss"], r["final_val_loss"]
        if math.isfinite(b) and math.isfinite(v) and b > 0:
            r["gap_pct"] = 100.0 * (v - b) / b
            r["within_target"] = r["gap_pct"] <= target
        if base["tokens_per_s"] > 0:
            r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
    return runs


def _memory(run):
    b = run["peak_memory_bytes"]
    return "n/a" if b is None else f"{b / 2**20:,.0f} MiB"


def _mode(run):
    mode = run["execution_mode"]
    if run["compile_error"]:
        return mode + ", eager (torch.compile failed)"
    if not run["compiled"]:
        return mode
    breaks = run.get("graph_breaks")
    return mode + (", compiled" if not breaks else f", compiled ({breaks} graph breaks)")


def table(result):
    """The Markdown results table with a one-paragraph legend under it."""
    device_type = result["config"]["device"]
    lines = ["| recipe | execution mode | final val loss | gap to baseline | target | tokens/s "
             "| speedup vs baseline | peak memory |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["runs"]:
        loss = f"{r['final_val_loss']:.4f}" if math.isfinite(r["final_val_loss"]) else "non-finite"
        gap = "-" if r["gap_pct"] is None else f"{r['gap_pct']:+.2f}%"
        target = "-" if r["target_pct"] is None else f"<= {r['target_pct']:g}%"
        if r["within_target"] is not None:
            target += " met" if r["within_target"] else " MISSED"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(f"| {run_label(r, device_type)} | {_mode(r)} | {loss} | {gap} | {target} | "
                     f"{r['tokens_per_s']:,.0f} | {speed} | {_memory(r)} |")
    cfg, data = result["config"], result["data"]
    memory = ("torch.cuda.max_memory_allocated per run" if device_type == "cuda" else
              "n/a on CPU (the process's max RSS only grows, so no per-run peak)")
    lines += ["", f"{cfg['size']} GPT (d_model {cfg['d_model']}, {cfg['layers']} layers, "
              f"{cfg['heads']} heads, seq {cfg['seq_len']}, batch {cfg['batch']}), {cfg['steps']} "
              f"steps, seed {cfg['seed']}, on {result['environment']['device_name']}. Loss: "
              f"validation cross-entropy in nats per character (unigram entropy of the corpus: "
              f"{data['unigram_entropy']:.3f}). Gap: relative to the baseline's final loss. "
              f"tokens/s: training steps only, first steps and evaluation excluded. Peak memory: "
              f"{memory}."]
    return "\n".join(lines) + "\n"


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def write_json(result, path):
    with open(path, "w") as f:
        json.dump(_finite_or_none(result), f, indent=1, allow_nan=False)
        f.write("\n")


def _smooth(values):
    """Centered moving average over ~3% of the steps: readable curves from noisy losses, with
    no lag against the validation points (an exponential average would trail them)."""
    half = max(1, len(values) // 60)
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half):i + half + 1]
        out.append(sum(window) / len(window))
    return out


def write_plot(result, path):
    """Writes loss.png; returns None, or why it could not (matplotlib missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on servers; must precede pyplot's import
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return (f"loss.png not written: the Python package 'matplotlib' is missing ({exc}); "
                f"install it with `python3 -m pip install matplotlib` (make deps does)")
    device_type = result["config"]["device"]
    runs = result["runs"]
    from matplotlib.ticker import FuncFormatter
    fig, (ax, ax_gap) = plt.subplots(1, 2, figsize=(13, 5), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    base = next((r for r in runs if r["name"] == "bf16"), None)
    for i, r in enumerate(runs):
        color, label = colors[i % len(colors)], run_label(r, device_type)
        steps = range(1, len(r["train_loss"]) + 1)
        ax.plot(steps, _smooth(r["train_loss"]), color=color, lw=1.2, label=label + " (train)")
        if r["val_loss"]:
            vs, vl = zip(*r["val_loss"])
            ax.plot(vs, vl, "o", color=color, ms=4)
        if base is not None and r is not base and r["val_loss"] and base["val_loss"]:
            ref = dict(base["val_loss"])
            pts = [(s, 100 * (v - ref[s]) / ref[s]) for s, v in r["val_loss"] if s in ref]
            if pts:
                ax_gap.plot(*zip(*pts), "o-", color=color, ms=4, label=label)
    ax.axhline(result["data"]["unigram_entropy"], color="gray", ls="--", lw=1,
               label="unigram entropy")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 2, 3, 4 rather than 2x10^0
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char), log scale")
    ax.set_title("training loss (smoothed; dots: validation)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax_gap.axhline(0, color="gray", lw=1)
    ax_gap.set_xlabel("step")
    ax_gap.set_ylabel("validation loss vs baseline (%)")
    ax_gap.set_title("gap to the baseline")
    ax_gap.grid(True, alpha=0.3)
    if base is not None and len(runs) > 1:
        ax_gap.legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"tequant demo: {cfg['size']} GPT, {cfg['steps']} steps, "
                 f"{result['environment']['device_name']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_all(result, out_dir):
    """results.md, results.json and loss.png under out_dir; returns (table text, plot error)."""
    os.makedirs(out_dir, exist_ok=True)
    text = table(result)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text)
    plot_error = write_plot(result, os.path.join(out_dir, "loss.png"))
    result["plot"] = "loss.png" if plot_error is None else plot_error
    write_json(result, os.path.join(out_dir, "results.json"))
    return text, plot_error
