"""Soak benchmark (issue 25 item 5): the demo's GPT trained for 10,000 steps per recipe. Each run
must keep torch.cuda.memory_allocated() exactly at its post-warm-up value and the loss finite at
every step. Exit status 1 if a recipe fails either check.

Not a convergence or speed comparison: `python -m tequant.demo` does that. steps/s is here only to
plan runs. Model, data, optimizer and LR schedule come from tequant.demo. The default --size is
"small" (2 blocks, d_model 128): the demo's CPU default, and its smallest size that is not
test-only. Its step is launch-bound on a GPU: about 4 ms by bench_overhead's host times (not yet
measured here), so about a minute per recipe. Test: tests/test_soak.py (a CPU smoke run, and a
run with an injected NaN that must fail).

4 GPUs, every recipe (the lent machine's .git is stale: export TEQUANT_BENCH_COMMIT=<commit>):
  python3 benchmarks/soak.py --gpus 4 --time-limit 300 --out docs/results/soak.md --json soak.json
"""
import argparse
import datetime
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when not run as a script
import benchutil  # noqa: E402
from tequant.demo.data import Corpus, chars_needed  # noqa: E402
from tequant.demo.model import GPT, SIZES  # noqa: E402
from tequant.demo.train import (RECIPES, describe_mode, lr_at, optimizer,  # noqa: E402
                                precision_contexts, training_step)

MIB = 1 << 20


def memory_now(device):
    """(current, peak) bytes. On CUDA: the caching allocator's allocated bytes. On CPU: the
    process's resident set, only a proxy (it includes the interpreter and whatever glibc keeps
    after free), so its flatness is not judged."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak, peak
    return rss, max(peak, rss)  # the kernel updates the high-water mark lazily


def soak_run(name, args, cfg, corpus, init_state, device):
    """Trains one model for args.steps steps with recipe `name`; returns its record."""
    mode, reason = describe_mode(name, device)
    if mode == "unsupported":
        return {"recipe": name, "skipped": f"unsupported here: {reason}"}
    recipe = RECIPES[name]() if RECIPES[name] is not None else None
    gc.collect()  # the previous recipe's model and optimizer must not count in this run's peak
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)  # NVFP4's stochastic rounding draws from the default generator
    model = GPT(corpus.vocab_size, cfg["d_model"], cfg["layers"], cfg["heads"],
                cfg["seq_len"]).to(device)
    model.load_state_dict(init_state)
    opt = optimizer(model, cfg["lr"], device)
    contexts = precision_contexts(recipe, device)
    step = 0
    if args.inject_nan_at:
        # Test-only (--inject-nan-at): the blocks' input turns NaN at that one step. This proves
        # that a non-finite loss is reported as a failure. NaN weights then keep the loss NaN.
        model.tok.register_forward_hook(
            lambda _m, _in, out: out * float("nan") if step == args.inject_nan_at else None)

    # A device flag ANDed with every step's isfinite(loss). Reading it at a sample is the only host
    # sync, so the steps between samples keep the GPU queue full.
    finite = torch.ones((), dtype=torch.bool, device=device)
    samples, first_loss, t_start = [], float("nan"), None
    batches = corpus.train_batches(args.steps, cfg["batch"], cfg["seq_len"], args.seed)
    for step, (x, y) in enumerate(batches, 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, args.steps, cfg["lr"])
        loss = training_step(model, model, opt, contexts, x, y)
        finite &= torch.isfinite(loss)
        if step == 1:
            first_loss = float(loss)  # one sync, inside the warm-up
        if step == args.warmup or (step > args.warmup and (
                (step - args.warmup) % args.sample_every == 0 or step == args.steps)):
            # Each sample is taken at the same point of a step, with the same tensors live (this
            # batch, its loss), so a flat allocator reads exactly the same bytes.
            samples.append((step, memory_now(device)[0]))
            if step == args.warmup:
                benchutil.sync(device.type)  # a str: a torch.device never equals "cuda"
                t_start = time.perf_counter()
            print(f"{name:<8} step {step:>6}/{args.steps}  loss {float(loss):8.4f}  "
                  f"{'allocated' if device.type == 'cuda' else 'rss'} {samples[-1][1] / MIB:9.2f} "
                  f"MiB", file=sys.stderr, flush=True)
            if not bool(finite):
                break  # a NaN never recovers (AdamW's moments keep it): stop, it already failed
    benchutil.sync(device.type)
    elapsed = time.perf_counter() - t_start if t_start is not None else float("nan")
    warm = samples[0][1] if samples else 0
    judged = device.type == "cuda"
    record = {
        "recipe": name, "execution_mode": mode, "steps": step, "steps_planned": args.steps,
        "steps_per_s": (step - args.warmup) / elapsed if step > args.warmup else float("nan"),
        "warmup_bytes": warm, "samples": samples, "memory_judged": judged,
        "max_growth_bytes": max(b - warm for _, b in samples) if samples else None,
        "flat": all(b == warm for _, b in samples) if judged else None,
        "peak_bytes": memory_now(device)[1], "first_loss": first_loss,
        "last_loss": float(loss), "finite": bool(finite),
        "device_name": torch.cuda.get_device_name(device) if judged else "none (CPU)",
    }
    record["pass"] = record["finite"] and step == args.steps and record["flat"] is not False
    del model, opt, loss, x, y
    return record


def run_here(args, device, start):
    """Runs the recipes one after another in this process."""
    cfg = dict(SIZES[args.size])
    corpus = Corpus(chars_needed(args.steps, cfg["batch"], cfg["seq_len"], cap=8_000_000),
                    20_000, args.seed, device)
    torch.manual_seed(args.seed)  # every recipe starts from the same weights, as in the demo
    init_state = GPT(corpus.vocab_size, cfg["d_model"], cfg["layers"], cfg["heads"],
                     cfg["seq_len"]).state_dict()
    runs = []
    for name in args.recipes:
        if args.time_limit and time.monotonic() - start > args.time_limit:
            runs.append({"recipe": name, "skipped": "time limit"})
            continue
        runs.append(soak_run(name, args, cfg, corpus, init_state, device))
    return runs


def run_children(args, start):
    """--gpus N: N child processes, each running one recipe at a time on its own GPU (slot i gets
    CUDA_VISIBLE_DEVICES's i-th entry, round-robin) and writing JSON. The parent merges them and
    never touches CUDA itself."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu_ids = visible.split(",") if visible else [str(i) for i in range(args.gpus)]
    pending, running, results = list(args.recipes), {}, {}
    tmp = tempfile.mkdtemp(prefix="tequant-soak-")
    try:
        while pending or running:
            for slot in range(args.gpus):
                if slot in running or not pending:
                    continue
                name = pending.pop(0)
                if args.time_limit and time.monotonic() - start > args.time_limit:
                    results[name] = {"recipe": name, "skipped": "time limit"}
                    continue
                path = os.path.join(tmp, f"{name}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--recipes", name,
                       "--json", path, *child_flags(args)]
                env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu_ids[slot % len(gpu_ids)])
                proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
                running[slot] = (name, path, proc, time.monotonic())
                print(f"{name}: started on GPU {env['CUDA_VISIBLE_DEVICES']} at "
                      f"{time.monotonic() - start:.0f} s", file=sys.stderr)
            for slot, (name, path, proc, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[slot]
                print(f"{name}: exit status {proc.returncode} after {time.monotonic() - t0:.0f} s",
                      file=sys.stderr)
                try:  # exit status 1 still wrote its JSON (a recipe that failed its checks)
                    with open(path) as f:
                        results[name] = json.load(f)["runs"][0]
                except (OSError, ValueError, IndexError, KeyError):
                    results[name] = {"recipe": name, "error": f"child exited {proc.returncode} "
                                                              "without results (its stderr above)"}
            time.sleep(0.2)
    finally:  # an interrupted parent must not leave children training on the GPUs
        for _name, _path, proc, _t0 in running.values():
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return [results[name] for name in args.recipes]


def child_flags(args):
    flags = ["--steps", args.steps, "--size", args.size, "--device", args.device, "--seed",
             args.seed, "--warmup", args.warmup, "--sample-every", args.sample_every]
    if args.inject_nan_at:
        flags += ["--inject-nan-at", args.inject_nan_at]
    return [str(v) for v in flags]


def report(args, runs, wall_s):
    """(markdown text, failures)."""
    gpus = sorted({r["device_name"] for r in runs if "device_name" in r})
    commit = os.environ.get("TEQUANT_BENCH_COMMIT") or benchutil.run_git(
        "rev-parse", "--short", "HEAD") or "unknown"
    if commit != "unknown" and "TEQUANT_BENCH_COMMIT" not in os.environ and benchutil.run_git(
            "status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    cfg = SIZES[args.size]
    lines = [f"### Soak: {args.size} demo GPT, {args.steps:,} steps per recipe "
             f"(GPU: {', '.join(gpus) or args.device}; torch {torch.__version__}; "
             f"commit {commit}; {datetime.date.today()})", "",
             f"d_model {cfg['d_model']}, blocks {cfg['layers']}, seq {cfg['seq_len']}, batch "
             f"{cfg['batch']}, seed {args.seed}; memory sampled after {args.warmup} warm-up steps, "
             f"then every {args.sample_every}; {args.gpus or 1} recipe(s) at a time, "
             f"{wall_s:.0f} s in all. Pass: every sample equals the warm-up one and the loss was "
             "finite at every step.", ""]
    if args.device == "cpu":
        lines[-1:] = ["MiB columns on CPU: the process's resident set (a proxy, not judged).", ""]
    lines += benchutil.table_head(["recipe", "steps", "steps/s", "warm-up allocated MiB",
                                   "max growth bytes", "peak MiB", "first loss", "last loss",
                                   "finite every step", "pass"], 1)
    failures = []
    for r in runs:
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or r["error"]
            lines.append(f"| {r['recipe']} | - | - | - | - | - | - | - | - | "
                         f"{'skipped' if 'skipped' in r else 'FAIL'}: {why} |")
            if "error" in r:
                failures.append(f"{r['recipe']}: {why}")
            continue
        growth = f"{r['max_growth_bytes']:,}" if r["memory_judged"] else "n/a (cpu)"
        lines.append(
            f"| {r['recipe']} | {r['steps']:,}/{r['steps_planned']:,} | {r['steps_per_s']:.1f} | "
            f"{r['warmup_bytes'] / MIB:.2f} | {growth} | {r['peak_bytes'] / MIB:.1f} | "
            f"{r['first_loss']:.4f} | {r['last_loss']:.4f} | {'yes' if r['finite'] else 'no'} | "
            f"{'pass' if r['pass'] else 'FAIL'} |")
        if not r["pass"]:
            failures.append(f"{r['recipe']}: finite {r['finite']}, memory flat {r['flat']}, "
                            f"{r['steps']} of {r['steps_planned']} steps")
    return "\n".join(lines), failures


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--recipes", default=",".join(RECIPES),
                    help=f"comma list from {','.join(RECIPES)} (default: all)")
    ap.add_argument("--size", choices=list(SIZES), default="small")
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps before the first sample (default 100, a fifth of shorter runs)")
    ap.add_argument("--sample-every", type=int, default=500)
    ap.add_argument("--gpus", type=int, default=0,
                    help="run the recipes as N parallel child processes, one GPU each")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="start no recipe after S seconds (it is marked skipped)")
    ap.add_argument("--out", help="append the table to this Markdown file")
    ap.add_argument("--json", help="write the raw results to this file")
    ap.add_argument("--inject-nan-at", type=int, default=0, metavar="STEP",
                    help="test only: make the blocks' input NaN at this step (the run must FAIL)")
    args = ap.parse_args(argv)
    if args.warmup is None:
        args.warmup = min(100, max(1, args.steps // 5))
    args.recipes = [v.strip() for v in args.recipes.split(",") if v.strip()]
    unknown = [v for v in args.recipes if v not in RECIPES]
    if unknown or not args.recipes:
        ap.error(f"--recipes: unknown {', '.join(unknown) or '(none)'}; from {','.join(RECIPES)}")
    if not 1 <= args.warmup < args.steps or args.sample_every < 1 or args.gpus < 0:
        ap.error("need 1 <= --warmup < --steps, --sample-every >= 1 and --gpus >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is available (use --device cpu)")
    if not -2**63 <= args.seed < 2**64:  # torch.manual_seed's range (else an overflow traceback)
        ap.error(f"--seed {args.seed}: expected an integer from -2**63 to 2**64 - 1")
    benchutil.check_args(ap, args)  # --out / --json writable, before the hours of training
    return args


def main(argv=None):
    args = parse_args(argv)
    start = time.monotonic()
    runs = run_children(args, start) if args.gpus else run_here(args, torch.device(args.device),
                                                                 start)
    text, failures = report(args, runs, time.monotonic() - start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k not in ("out", "json")},
                       "runs": runs}, f, indent=1)
    skipped = [r["recipe"] for r in runs if "skipped" in r]
    if skipped:
        print(f"not run: {', '.join(skipped)}", file=sys.stderr)
    return benchutil.finish(text, args.out, failures, title="SOAK FAILED")


if __name__ == "__main__":
    sys.exit(main())
