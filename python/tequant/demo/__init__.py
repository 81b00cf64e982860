"""`python -m tequant.demo` (`make demo`): train a small GPT once per recipe and once in high
precision, then compare them.

The model's projections are te.Linear (model.py), the data is a generated character-level
corpus (data.py), each run has a progress bar (train.py), and the end writes a table, a
loss-curve PNG and a JSON file of the numbers under --out (report.py). main(argv) returns the
exit status: 1 when a run's loss went non-finite. Tests: tests/test_demo.py.
"""
import argparse
import datetime
import os
import platform
import subprocess
import sys
import time

import torch

from .data import Corpus, chars_needed
from .model import GPT, SIZES
from .report import summarize, write_all
from .train import RECIPES, describe_mode, train_run

__all__ = ["main"]


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seed(text):
    """argparse type: an integer torch's generators accept (-2**63 .. 2**64 - 1); beyond that
    torch.manual_seed raised "Overflow when unpacking long long" after the corpus was built."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -2**63 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer from -2**63 to 2**64 - 1, got "
                                         f"{value}")
    return value


def _width_list(text):
    try:
        widths = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        widths = []
    if not widths or any(w <= 0 or w % 64 for w in widths):
        raise argparse.ArgumentTypeError(
            f"expected a comma list of positive multiples of 64, got {text!r}")
    return sorted(set(widths))


def _recipe_list(text):
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in RECIPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown recipe(s) {', '.join(unknown) or '(none given)'}; choose a comma list "
            f"from {','.join(RECIPES)}")
    return [n for n in RECIPES if n in names]  # table order, no duplicates


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m tequant.demo",
        description="Train a small GPT (te.Linear projections) on a generated character corpus "
                    "once per recipe and once in high precision; write a table, a loss plot "
                    "and a JSON file under --out.")
    parser.add_argument("--recipes", type=_recipe_list, default=list(RECIPES),
                        help=f"comma list from {','.join(RECIPES)} (default: all)")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="training steps per run (default: the size's)")
    parser.add_argument("--size", choices=list(SIZES), default=None,
                        help="tiny (tests), small (CPU default), medium, large (GPU default: where "
                             "FP8 pays off on an H100)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--compile", action="store_true",
                        help="wrap each model in torch.compile (falls back to eager, recorded, "
                             "when compilation fails)")
    parser.add_argument("--out", default="demo_out", help="output folder (default ./demo_out)")
    parser.add_argument("--seed", type=_seed, default=0, help="data, init and rounding seed")
    parser.add_argument("--sweep", action="store_true",
                        help="instead of training: time training tokens/s per recipe against "
                             "model width (--widths) and write sweep.md / .json / .png")
    parser.add_argument("--widths", type=_width_list, default=None,
                        help="--sweep's d_model values, comma list (default "
                             "512,1024,2048,3072,4096)")
    parser.add_argument("--sweep-layers", type=_positive_int, default=2,
                        help="--sweep's number of blocks (default 2)")
    parser.add_argument("--sweep-steps", type=_positive_int, default=20,
                        help="--sweep's timed steps per point (default 20)")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu)")
    if args.size is None:
        args.size = "large" if args.device == "cuda" else "small"
    if args.sweep and args.widths:
        # The sweep's head dim is 128 from d=512 up (sweep._heads): a width such as 576 passes
        # the multiple-of-64 check above but cannot be split into heads. Said here, before any
        # work, rather than as a ValueError traceback from inside the sweep.
        from .sweep import head_dim
        bad = [w for w in args.widths if w % head_dim(w)]
        if bad:
            parser.error(f"argument --widths: {', '.join(map(str, bad))} not a multiple of the "
                         f"head dim (128 for widths >= 512, 64 below)")
    _check_out_dir(parser, args.out)
    return args


def _check_out_dir(parser, out):
    """Creates --out and proves a file can be written in it, before any training: the outputs
    are written only at the end, so an unwritable folder (a file of that name, no permission, a
    read-only filesystem) would otherwise cost the whole run and end in a traceback."""
    existing = os.path.abspath(out)  # the folder itself or its nearest existing parent
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "" if existing == os.path.abspath(out) else f" (in its path, {existing!r})"
        parser.error(f"argument --out: {out!r}: a file{where} is in the way; expected a folder "
                     f"path (created if missing)")
    probe = os.path.join(out, f".tequant-demo-write-test-{os.getpid()}")
    try:
        os.makedirs(out, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        parser.error(f"argument --out: cannot write to the folder {out!r} "
                     f"({exc.strerror or exc}); expected a writable folder path")


def _commit():
    """The git commit of the source tree (+dirty when tracked files differ), or the one named by
    TEQUANT_BENCH_COMMIT where the checkout has no usable .git (the lent GPU machine)."""
    commit = os.environ.get("TEQUANT_BENCH_COMMIT")
    if commit:
        return commit
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        try:
            res = subprocess.run(["git", *args], capture_output=True, text=True, cwd=here,
                                 timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return res.stdout.strip() if res.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return commit or None


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load():
    """The 1-minute load average (CPU timings mean little on a loaded machine), or None."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _environment(device):
    from .. import __version__
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({_cpu_model()}, {os.cpu_count()} cores)"
    return {"device_name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "tequant": __version__, "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(), "load_average_start": _load(),
            "commit": _commit(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    if args.sweep:
        from .sweep import run_sweep
        return run_sweep(args, device, _environment(device))
    cfg = dict(SIZES[args.size])
    cfg["steps"] = args.steps or cfg["steps"]
    t0 = time.perf_counter()
    # Training text: one pass over the sampled windows, capped (generation is ~3 M chars/s).
    train_chars = chars_needed(cfg["steps"], cfg["batch"], cfg["seq_len"], cap=8_000_000)
    val_batches_n = {"tiny": 2, "small": 4, "medium": 8, "large": 8}[args.size]
    corpus = Corpus(train_chars, max(20_000, 2 * val_batches_n * cfg["batch"] * cfg["seq_len"]),
                    args.seed, device)
    val_batches = corpus.val_batches(val_batches_n, cfg["batch"], cfg["seq_len"])
    torch.manual_seed(args.seed)
    init_state = GPT(corpus.vocab_size, cfg["d_model"], cfg["layers"], cfg["heads"],
                     cfg["seq_len"]).state_dict()
    env = _environment(device)
    print(f"tequant demo: {args.size} GPT (d_model {cfg['d_model']}, {cfg['layers']} layers, "
          f"seq {cfg['seq_len']}, batch {cfg['batch']}), {cfg['steps']} steps x "
          f"{len(args.recipes)} runs on {env['device_name']}; corpus {corpus.train.numel():,} "
          f"chars, unigram entropy {corpus.unigram_entropy:.3f} nats/char", file=sys.stderr)
    for name in args.recipes:
        mode, reason = describe_mode(name, device)
        if mode == "unsupported":
            print(f"{name}: unsupported here ({reason}); leave it out of --recipes",
                  file=sys.stderr)
            return 2
    runs = [train_run(name, cfg, corpus, init_state, device, use_compile=args.compile,
                      seed=args.seed, val_batches=val_batches) for name in args.recipes]
    result = {
        "config": {"size": args.size, **cfg, "device": device.type, "compile": args.compile,
                   "seed": args.seed, "recipes": args.recipes, "optimizer":
                   "AdamW(betas=(0.9, 0.95), weight_decay=0.1), warmup 10% then cosine to 10%, "
                   "grad clip 1.0"},
        "environment": env,
        "data": {"train_chars": corpus.train.numel(), "val_chars": corpus.val.numel(),
                 "vocab_size": corpus.vocab_size, "unigram_entropy": corpus.unigram_entropy},
        "runs": runs,
        "total_wall_s": None,
    }
    summarize(runs)
    result["total_wall_s"] = time.perf_counter() - t0
    env["load_average_end"] = _load()
    text, plot_error = write_all(result, args.out)
    print(text)
    if plot_error:
        print(plot_error, file=sys.stderr)
    print(f"wrote {os.path.join(args.out, 'results.md')}, results.json"
          f"{'' if plot_error else ', loss.png'} ({result['total_wall_s']:.0f} s)",
          file=sys.stderr)
    bad = [r["name"] for r in runs if not r["finite"]]
    if bad:
        print(f"non-finite loss in: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0
