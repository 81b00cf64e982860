"""benchmarks/bench_compile.py's target table (issue 23): the ratios and their verdicts from given
step times (the benchmark itself runs on the GPU machine; its CPU mode is too slow for the suite)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_compile  # noqa: E402


def _cells(lines, start):
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines
            if line.startswith("| " + start)]


def test_targets_against_bf16_and_eager():
    rows = [("gpt", "bf16", {"eager": 10.0, "compiled": 6.0, "reduce-overhead": 4.0}),
            ("gpt", "current", {"eager": 12.0, "compiled": 8.0, "reduce-overhead": 4.4}),
            ("block", "delayed", {"eager": 3.0, "compiled": 4.0})]
    lines = bench_compile.targets(rows, {})
    got = {c[0]: (c[1], c[3]) for c in _cells(lines, "gpt") + _cells(lines, "block")}
    assert got == {
        "gpt, current: compiled vs eager": ("1.50x", "yes"),
        "gpt, current: compiled vs bf16 compiled": ("0.75x", "NO"),           # 6 / 8 < 0.8
        "gpt, current: reduce-overhead vs bf16 reduce-overhead": ("0.91x", "NO"),  # 4 / 4.4
        "block, delayed: compiled vs eager": ("0.75x", "NO"),
    }


def test_paired_ratios_replace_the_bf16_rows():
    """A row timed beside the bf16 GPT in the same loops is judged by that pair, mode by mode;
    a mode without a pair falls back to the bf16 row; the paired section lists each pair."""
    rows = [("gpt", "bf16", {"eager": 10.0, "compiled": 6.0, "reduce-overhead": 4.0}),
            ("gpt", "current", {"eager": 12.0, "compiled": 8.0, "reduce-overhead": 4.4})]
    pairs = {("gpt", "current"): {"compiled": (8.0, 7.0)}}  # (row, bf16 in the same loops)
    lines = bench_compile.targets(rows, pairs)
    got = {c[0]: (c[1], c[3]) for c in _cells(lines, "gpt")}
    assert got == {
        "gpt, current: compiled vs eager": ("1.50x", "yes"),
        "gpt, current: compiled vs bf16 compiled (same loops)": ("0.88x", "yes"),  # 7 / 8
        "gpt, current: reduce-overhead vs bf16 reduce-overhead": ("0.91x", "NO"),
    }
    cells = _cells(bench_compile.paired_lines(pairs), "gpt")
    assert [c[:3] for c in cells] == [["gpt", "current", "compiled"]] and cells[0][5] == "0.88x"
    assert bench_compile.paired_lines({}) == []


def test_profile_counts_host_ops_per_step():
    """--profile's summary of a CPU step: per-step call counts of its host ops (two torch.mm per
    step here), no launches without CUDA, and the section's row for it."""
    import torch
    a = torch.randn(64, 64)

    def step():
        torch.mm(torch.mm(a, a), a)
    p = bench_compile.profile(step, "cpu", 3)
    assert p["launches"] == 0 and p["gpu_us"] == 0
    calls = {name: count for name, count, _ in p["ops"]}
    assert calls.get("aten::mm") == 2, p["ops"]
    lines = bench_compile.profile_lines([("tiny", "current", {"eager": p})])
    row = _cells(lines, "tiny")[0]
    assert row[:4] == ["tiny", "current", "eager", "0"] and "aten::mm (2," in row[5]


def test_reduce_overhead_runs_in_a_second_pass():
    """Default compile is timed before any cudagraph tree exists (they change tequant's compiled
    allocations for the rest of the process); CPU has no reduce-overhead."""
    assert bench_compile.passes(["eager", "compiled", "reduce-overhead"], "cuda") == [
        ["eager", "compiled"], ["eager", "reduce-overhead"]]
    assert bench_compile.passes(["eager", "compiled", "reduce-overhead"], "cpu") == [
        ["eager", "compiled"]]
    assert bench_compile.passes(["eager", "compiled"], "cuda") == [["eager", "compiled"]]
