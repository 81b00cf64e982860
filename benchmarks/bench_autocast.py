"""P1: construct + enter + exit of te.autocast(recipe=r) vs Python context managers, same run.

Baselines: an empty Python class context manager (the target: ratio <= 1.0), a
contextlib.contextmanager one, a Python class doing TransformerEngine's autocast bookkeeping
(written here: key string, global-state snapshot and restore, depth, cached support check), and
torch.autocast. Each variant is checked for doing its job first, then all are timed in
interleaved rounds (median ns per cycle over rounds) so drift hits every variant alike.

    python3 benchmarks/bench_autocast.py [--cycles N] [--rounds R] [--out docs/results/FILE.md]
"""
import argparse
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when not run as a script
import benchutil  # noqa: E402

import tequant as te
from tequant.recipe import DelayedScaling, MXFP8BlockScaling


class EmptyCM:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def generator_cm():
    yield


class _TEState:
    """What TE keeps in its global FP8GlobalStateManager for autocast."""
    enabled = False
    calibration = False
    recipe = None
    group = None
    first_module = False
    graph_capturing = False
    depth = 0
    arguments = {}
    support_cache = {}


class TEStyleAutocast:
    """TE's autocast bookkeeping in Python (TE_REFERENCE section 3.3), for comparison."""

    def __init__(self, enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
        self.enabled, self.calibrating = enabled, calibrating
        self.recipe, self.group = recipe, amax_reduction_group
        self._saved = None

    def __enter__(self):
        if self._saved is not None:
            raise RuntimeError("autocast context manager cannot be entered more than once")
        s = _TEState
        if self.enabled:
            kind = type(self.recipe)
            if kind not in s.support_cache:
                s.support_cache[kind] = (True, "")
            ok, reason = s.support_cache[kind]
            if not ok:
                raise RuntimeError(reason)
        self._saved = (s.enabled, s.calibration, s.recipe, s.group, s.first_module,
                       s.graph_capturing)
        key = f"recipe={self.recipe!r},group={id(self.group) if self.group else None}"
        s.arguments[key] = (self.recipe, self.group)
        s.enabled, s.calibration, s.recipe, s.group = (self.enabled, self.calibrating,
                                                       self.recipe, self.group)
        if s.depth == 0:
            s.first_module = True
        s.depth += 1
        return self

    def __exit__(self, *exc):
        s = _TEState
        (s.enabled, s.calibration, s.recipe, s.group, s.first_module,
         s.graph_capturing) = self._saved
        s.depth -= 1
        self._saved = None
        return False


def check(recipe, torch_device):
    with te.autocast(recipe=recipe):
        assert te.is_fp8_enabled() and te.get_fp8_recipe() is recipe
    assert not te.is_fp8_enabled() and te.autocast_depth() == 0
    with TEStyleAutocast(recipe=recipe):
        assert _TEState.enabled and _TEState.recipe is recipe
    assert not _TEState.enabled and _TEState.depth == 0
    with torch.autocast(torch_device):
        assert torch.is_autocast_enabled(torch_device)


def make_loops(recipe, torch_device):
    """name -> function(n) running n cycles; each builds its context manager per cycle."""
    ac = te.autocast

    def empty(n):
        for _ in range(n):
            with EmptyCM():
                pass

    def contextlib_cm(n):
        for _ in range(n):
            with generator_cm():
                pass

    def te_style(n):
        for _ in range(n):
            with TEStyleAutocast(recipe=recipe):
                pass

    def torch_autocast(n):
        for _ in range(n):
            with torch.autocast(torch_device):
                pass

    def tequant(n):
        for _ in range(n):
            with ac(recipe=recipe):
                pass

    def tequant_nested(n):  # two levels, per outer cycle: counts as two cycles
        for _ in range(n // 2):
            with ac(recipe=recipe):
                with ac(enabled=False):
                    pass

    return {"empty Python class CM": empty, "contextlib.contextmanager": contextlib_cm,
            "Python class, TE's bookkeeping": te_style, f"torch.autocast('{torch_device}')":
            torch_autocast, "te.autocast(recipe=r)": tequant,
            "te.autocast nested 2 deep (per level)": tequant_nested}


def run(cycles, rounds, recipe, torch_device):
    loops = make_loops(recipe, torch_device)
    samples = {name: [] for name in loops}
    for fn in loops.values():
        fn(cycles // 10)  # warm-up
    for _ in range(rounds):
        for name, fn in loops.items():
            t0 = time.perf_counter()
            fn(cycles)
            samples[name].append((time.perf_counter() - t0) / cycles * 1e9)
    return {name: statistics.median(v) for name, v in samples.items()}


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = "?"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (f"host CPU: {cpu}; GPU: {gpu}; Python {platform.python_version()}; torch "
            f"{torch.__version__}; commit {commit or '?'}; {datetime.date.today()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", help="also write the table to this Markdown file")
    args = ap.parse_args()
    benchutil.check_args(ap, args)  # --cycles/--rounds >= 1, --out writable, before the timing
    torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = [f"### te.autocast construct + enter + exit ({machine()})", "",
             f"median of {args.rounds} interleaved rounds of {args.cycles} cycles", "",
             "| recipe | context manager | ns / cycle | vs empty Python class CM |",
             "|---|---|---:|---:|"]
    for recipe in (MXFP8BlockScaling(), DelayedScaling()):
        check(recipe, torch_device)
        result = run(args.cycles, args.rounds, recipe, torch_device)
        base = result["empty Python class CM"]
        for name, ns in result.items():
            lines.append(f"| {type(recipe).__name__} | {name} | {ns:.0f} | {ns / base:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
