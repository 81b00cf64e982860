"""What the benchmarks in this folder share (bench_gemm.py, bench_quantize.py, bench_linear.py,
bench_overhead.py, bench_norm.py, bench_act.py): `import benchutil`.

Timing (CUDA events behind a sleep kernel, or time.perf_counter on CPU) over rotated buffers sized
against L2, host time per call in interleaved loops, the environment header (GPU, driver, CUDA,
torch, Python, commit, date), PERFORMANCE.md's GEMM shapes, the recipes by short name, the
relative error used by the checks, kernel names sorted into categories (the profiles), Markdown
table text, clearing a step's grads, and the --device / comma-list / --out / exit-status plumbing.
"""
import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import torch


def ceil_div(a, b):
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def time_cuda(fn, buffers, warmup, iters):
    """Median microseconds of fn(buffer) over iters calls, each between two CUDA events; call i
    takes buffers[i % len(buffers)], so a set of buffers larger than L2 is never cached."""
    for i in range(warmup):
        fn(buffers[i % len(buffers)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    # Hold the GPU back (~50 ms) while the calls are queued: the host then runs ahead, so no
    # host time falls between an event pair (small shapes would otherwise time the launch path).
    torch.cuda._sleep(100_000_000)
    for i in range(iters):
        starts[i].record()
        fn(buffers[i % len(buffers)])  # its outputs return to the caching allocator in order
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def time_cpu(fn, buffers, warmup, iters):
    """time_cuda's measure on CPU: each call timed alone with time.perf_counter."""
    for i in range(warmup):
        fn(buffers[i % len(buffers)])
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(buffers[i % len(buffers)])
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def timer(device):
    return time_cuda if device == "cuda" else time_cpu


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def rotated_count(device, minimum, set_bytes, *, l2_multiple=4, most=128):
    """How many buffer sets of set_bytes to rotate: minimum, and on CUDA at least enough to span
    l2_multiple x the L2 cache (but no more than most)."""
    if device != "cuda":
        return minimum
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return min(max(minimum, ceil_div(l2_multiple * l2, set_bytes)), most)


def clear_grads(module, x):
    """Drops x's and the module's grads before a step (no accumulation kernels in the timing)."""
    x.grad = None
    for p in module.parameters():
        p.grad = None


def time_host(fns, device, calls, repeats):
    """Median microseconds per call of each fn() (no argument): repeats rounds, each running a
    loop of calls calls of every fn in turn (interleaved: drift hits all alike), timed with
    time.perf_counter and synchronized around each loop only."""
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, samples):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync(device)
            times.append((time.perf_counter() - t0) * 1e6 / calls)
    return [statistics.median(times) for times in samples]


# ----------------------------------------------------------------------------------------------
# Shapes, recipes, checks
# ----------------------------------------------------------------------------------------------

# PERFORMANCE.md's GEMM shapes: key -> (label, M, K, N), y[M, N] = x[M, K] . W[N, K]^T
GEMM_SHAPES = {
    "8192": ("8192^3", 8192, 8192, 8192),
    "qkv": ("QKV", 15872, 4096, 12288),
    "proj": ("proj", 15872, 4096, 4096),
    "fc1": ("FC1", 15872, 4096, 16384),
    "fc2": ("FC2", 15872, 16384, 4096),
    "small": ("small", 2048, 1024, 1024),
}
GEMM_SET = ("qkv", "proj", "fc1", "fc2")  # TE's published 5B configuration, M = 15872 tokens


def parse_shapes(text, shapes=GEMM_SHAPES):
    """[(key, label, M, K, N)] from a comma list of shapes' keys or MxKxN items (tokens x
    in-features x out-features; key and label are then the item itself)."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item in shapes:
            out.append((item,) + shapes[item])
        else:
            try:
                m, k, n = (int(v) for v in item.split("x"))
            except ValueError:
                m = k = n = 0
            if min(m, k, n) < 1:  # 0 or negative dims used to fail deep inside torch
                named = f"neither one of {', '.join(shapes)} nor " if shapes else "not "
                raise SystemExit(f"--shapes: {item!r} is {named}MxKxN of positive "
                                 "integers (tokens x in-features x out-features)")
            out.append((item, item, m, k, n))
    return out


FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_mk(text):
    """'MxK' or 'MxK:dtype' (bf16, fp16, fp32; default bf16) -> (M, K, dtype name): the shapes
    of the fused norm / activation benchmarks."""
    shape, _, dtype = text.strip().lower().partition(":")
    dtype = dtype or "bf16"
    if dtype not in FLOAT_DTYPES:
        raise SystemExit(f"--shapes: dtype {dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")
    return (*parse_mxk(shape), dtype)


def parse_mxk(text, flag="--shapes"):
    """'MxK' -> (M, K), both positive; else SystemExit naming the flag and the item (a bare
    '256' or 'axb' used to end in a ValueError traceback from the unpacking)."""
    try:
        m, k = (int(v) for v in text.strip().lower().split("x"))
    except ValueError:
        m = k = 0
    if m < 1 or k < 1:
        raise SystemExit(f"{flag}: {text!r} is not MxK (two positive integers, e.g. 256x1024)")
    return m, k


def bits(t):
    """t's bit patterns on the CPU (int32 / int16 / uint8 by element size): bit-exact checks."""
    t = t.detach().cpu().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


# The recipes of tequant.recipe by short name, in table order; FP8_RECIPES are P5's and P7's.
RECIPE_NAMES = ("delayed", "current", "block", "mxfp8", "nvfp4")
FP8_RECIPES = ("delayed", "current", "block")


def make_recipes(text=None):
    """[(name, recipe)] for a comma list of RECIPE_NAMES (default: all), defaults of each."""
    from tequant import recipe as r  # here: benchutil itself does not need tequant
    kinds = {"delayed": r.DelayedScaling, "current": r.Float8CurrentScaling,
             "block": r.Float8BlockScaling, "mxfp8": r.MXFP8BlockScaling,
             "nvfp4": r.NVFP4BlockScaling}
    names = [v.strip() for v in (text or ",".join(RECIPE_NAMES)).split(",") if v.strip()]
    unknown = [v for v in names if v not in kinds]
    if unknown:
        raise SystemExit(f"--recipes: unknown {', '.join(unknown)}; choose from "
                         f"{', '.join(RECIPE_NAMES)}")
    return [(name, kinds[name]()) for name in names]


def category(name, categories, default="other"):
    """The first category of `categories`, (category, lowercase substrings) pairs, with a
    substring in name (case-insensitive), else default: how the profilers sort kernel names."""
    low = name.lower()
    for cat, keys in categories:
        if any(k in low for k in keys):
            return cat
    return default


def rel_err(y, ref, *, dtype=torch.float64):
    """Relative Frobenius error |y - ref| / |ref|, computed in dtype."""
    y, ref = y.detach().to(dtype), ref.detach().to(dtype)
    return float((y - ref).norm() / ref.norm().clamp_min(1e-300))


# ----------------------------------------------------------------------------------------------
# Environment header
# ----------------------------------------------------------------------------------------------

def run_git(*args):
    try:
        res = subprocess.run(["git", *args], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except OSError:
        return ""
    return res.stdout.strip() if res.returncode == 0 else ""


def machine(device, libraries=()):
    """'GPU: ...; driver ...; CUDA ...; <name version>...; torch ...; Python ...; commit ...; date',
    libraries being (name, version) pairs; the commit is marked +dirty when tracked files differ."""
    # TEQUANT_BENCH_COMMIT names the commit where the checkout has no (or a stale) .git, as on
    # the lent GPU machine, whose copy of the working tree keeps an old .git.
    commit = os.environ.get("TEQUANT_BENCH_COMMIT")
    if not commit:
        commit = run_git("rev-parse", "--short", "HEAD") or "?"
        if commit != "?" and run_git("status", "--porcelain", "--untracked-files=no"):
            commit += "+dirty"
    if device == "cuda":
        gpu = torch.cuda.get_device_name()
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                     "--format=csv,noheader"], capture_output=True,
                                    text=True).stdout.split("\n")[0].strip() or "?"
        except OSError:
            driver = "?"
    else:
        gpu, driver = "none (CPU reference)", "-"
    return "; ".join([f"GPU: {gpu}", f"driver {driver}", f"CUDA {torch.version.cuda or '-'}",
                      *(f"{name} {version}" for name, version in libraries),
                      f"torch {torch.__version__}", f"Python {platform.python_version()}",
                      f"commit {commit}", f"{datetime.date.today()}"])


# ----------------------------------------------------------------------------------------------
# Markdown text
# ----------------------------------------------------------------------------------------------

def table_head(columns, left):
    """A Markdown table's header lines: the first `left` columns left-aligned, the rest right."""
    return ["| " + " | ".join(columns) + " |",
            "|" + "---|" * left + "---:|" * (len(columns) - left)]


def num_text(v):
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def ratio_text(num, den):
    if not (num and den):
        return "-"
    r = num / den
    return f"{r:.2f}x" if 0.1 <= r < 100 else f"{r:.2g}x"


def one_line(text, limit=160):
    """text on one line for a table cell; over limit, its head and tail (torch's scaling errors
    end with the shapes and strides it got)."""
    text = " ".join(str(text).split()).replace("|", "/")
    if len(text) <= limit:
        return text
    head = min(100, limit // 3)
    return text[:head] + " ... " + text[len(text) - (limit - head - 5):]


def exc_text(e):
    return f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def parser(doc):
    """An ArgumentParser described by doc's first line, with --device (cuda when there is one)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    return ap


def listed(ap, flag, text, allowed):
    """The items of a comma list given to flag, each one of allowed (else ap.error)."""
    items = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        ap.error(f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    return items


# The count and size flags the benchmarks share, with their least valid value. Each used to pass
# argparse as any int: 0 iterations then ended in statistics' "no median for empty data" or a
# ZeroDivisionError after the setup, a 0 that a benchmark reads as "default" (`args.calls or
# 200`) was silently replaced, and a negative size failed inside torch.
MIN_VALUE = {"iters": 1, "warmup": 0, "buffers": 1, "check_rows": 1, "calls": 1, "repeats": 1,
             "rounds": 1, "cycles": 1, "steps": 1, "profile_steps": 1, "wall_calls": 1,
             "wall_repeats": 1, "host_calls": 1, "host_repeats": 1, "tokens": 1, "seq": 1,
             "head_dim": 1, "width": 1, "ffn": 1, "llama_ffn": 1, "batch": 1, "layers": 1,
             "heads": 1, "tp": 1, "rows": 1}
OUTPUT_FLAGS = ("out", "json")


def check_args(ap, args):
    """ap.error (exit status 2, the flag named) for a count or size flag of MIN_VALUE below its
    least value, or an --out / --json file that cannot be written. Called before any work: the
    outputs are written only at the end, so an unwritable path used to cost the whole run and
    end in a traceback."""
    for name, least in MIN_VALUE.items():
        value = getattr(args, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < least:
            ap.error(f"--{name.replace('_', '-')} {value}: expected an integer >= {least}")
    for name in OUTPUT_FLAGS:
        path = getattr(args, name, None)
        if isinstance(path, str):
            problem = unwritable(path)
            if problem:
                ap.error(f"--{name} {path!r}: {problem}; expected a writable file path")


def unwritable(path):
    """Why the file path cannot be written (appended to or created), or None. Creates its folder
    as finish() would; leaves no file behind."""
    if os.path.isdir(path):
        return "is a folder"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent!r} is a file, not a folder"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.exists(path):
            with open(path, "a"):
                pass
        else:
            with open(path, "x"):
                pass
            os.remove(path)
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc})"
    return None


def parse(ap):
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is available")
    check_args(ap, args)
    return args


def finish(text, out, failures, title="FAILED"):
    """Prints text and appends it to the file out (when given); returns the exit status: 1 after
    listing failures on stderr under title, 0 when there are none."""
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "a") as f:
            f.write(text + "\n\n")
    if failures:
        print(f"\n{title}:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0
