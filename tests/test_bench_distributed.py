"""benchmarks/bench_distributed.py --device cpu: the smoke mode of the multi-GPU benchmark.

Two gloo ranks, tiny sizes, both models, every mode (FSDP2 x TP on a 1 x 2 mesh, asked for by
name), bf16 and Float8CurrentScaling (the CPU reference is slow; every recipe runs with the
script's defaults): a subprocess with a timeout, so a hang fails the test. Its exit status
carries the benchmark's own checks (losses of FSDP2 / TP against the model alone, the quantized
gather's bytes below the bf16 gather's); the test reads the JSON and the Markdown it writes:
every configuration ran, its numbers are positive, the quantized weight gather moves fewer bytes
than the bf16 one, and the tables hold one row per configuration. With torchao installed
(optional: not in the Makefile), its float8 training beside Float8CurrentScaling on the GPT
stack (torch._scaled_mm runs on CPU); without it, or where it does not import, the clean skip
of its rows. The GPU run itself (issue 26) is the command in the benchmark's docstring.
benchmarks/profile_distributed.py: its kernel categories and interval arithmetic on a made-up
trace, and a CPU smoke run (TP, tp_comm_overlap on and off).
"""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_distributed.py")
MODES = ("1gpu", "fsdp", "fsdp-hp", "tp", "tp-overlap", "fsdp-tp")
RECIPES = ("current",)


def _run(tmp_path, args, env=None, timeout=150):
    md, js = str(tmp_path / "bench.md"), str(tmp_path / "bench.json")
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--warmup", "1", "--iters", "1",
           "--out", md, "--json", js, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.load(open(js))["results"], open(md).read()


def _imports():
    try:
        import torchao.float8  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run for the two tests below (each start of the benchmark spawns its ranks):
    both models, every mode, bf16, RECIPES and, where torchao.float8 imports, torchao."""
    recipes = RECIPES + (("torchao",) if _imports() else ())
    return _run(tmp_path_factory.mktemp("bench"), ["--modes", ",".join(MODES),
                                                   "--recipes", ",".join(recipes)])


def test_cpu_smoke_tables_and_numbers(smoke):
    results, text = smoke
    results = [r for r in results if r["recipe"] != "torchao"]  # test_cpu_smoke_torchao_...
    got = {(r["model"], r["mode"], r["recipe"]): r for r in results}
    want = {(m, mode, rc) for m in ("gpt", "llama") for mode in MODES
            for rc in ("bf16", *RECIPES) if not (mode == "fsdp-hp" and rc == "bf16")}
    assert set(got) == want and len(results) == len(want), sorted(set(got) ^ want)
    for key, r in got.items():
        assert "error" not in r and "skipped" not in r, (key, r)
        for field in ("tokens_per_s_per_gpu", "step_ms", "peak_gib", "loss"):
            assert r[field] > 0, (key, field, r[field])
        assert (r["gathered_bytes"] > 0) == (key[1] != "1gpu"), (key, r["gathered_bytes"])
    for model in ("gpt", "llama"):
        bf16 = got[(model, "fsdp", "bf16")]["gathered_bytes"]
        for recipe in RECIPES:
            assert got[(model, "fsdp", recipe)]["gathered_bytes"] < 0.6 * bf16, (model, recipe)
            assert got[(model, "fsdp-hp", recipe)]["gathered_bytes"] == bf16, (model, recipe)
        for recipe in ("bf16", *RECIPES):  # tp_comm_overlap moves no other bytes
            on, off = got[(model, "tp-overlap", recipe)], got[(model, "tp", recipe)]
            assert on["gathered_bytes"] == off["gathered_bytes"], (model, recipe)
            # the stack's tensor-parallel layers have it on, and only in tp-overlap
            assert on["overlapped_layers"] > 0 and off["overlapped_layers"] == 0, (model, recipe)
    assert "GPU: none (CPU reference)" in text and "torch " in text and "commit " in text
    labels = {"1gpu": "1 GPU alone", "fsdp": "FSDP2 dp=2", "fsdp-hp": "FSDP2 dp=2",
              "tp": "TP+SP tp=2", "tp-overlap": "TP+SP tp=2, tp_comm_overlap",
              "fsdp-tp": "FSDP2 dp=1 x TP+SP tp=2"}
    for model in ("gpt", "llama"):
        table = text.split(f"### {model}, eager")[1].split("###")[0]
        rows = [line for line in table.splitlines() if line.startswith("| ") and
                not line.startswith("| mode") and "| torchao |" not in line]
        assert len(rows) == len(want) // 2, table
        for (m, mode, recipe) in (k for k in want if k[0] == model):
            row = next((line for line in rows if line.startswith(
                f"| {labels[mode]} | {recipe} |")), None)
            assert row is not None, (model, mode, recipe, table)
            speed = float(row.split("|")[4].replace(",", ""))
            assert speed > 0, row
            if mode != "1gpu":  # scaling efficiency against the 1-GPU row
                assert float(row.split("|")[10]) > 0, row
        assert re.search(r"\| FSDP2 dp=2 \| current \| quantized \| [\d,]+ \| [\d.]+x \|", table)


def test_cpu_smoke_torchao_against_current(smoke):
    """torchao.float8 (convert_to_float8_training, tensorwise) beside Float8CurrentScaling on
    the GPT and Llama stacks: measured in 1gpu, fsdp (its float8 all-gather) and fsdp-hp,
    skipped with a reason in tp and fsdp-tp; its loss near bf16's and current's, its float8
    gather counted."""
    pytest.importorskip("torchao.float8")
    results, text = smoke
    for model in ("gpt", "llama"):
        rows = [r for r in results if r["model"] == model]
        got = {(r["mode"], r["recipe"]): r for r in rows}
        want = {(mode, rc) for mode in MODES for rc in ("bf16", "current", "torchao")
                if not (mode == "fsdp-hp" and rc == "bf16")}
        assert set(got) == want and len(rows) == len(want), sorted(set(got) ^ want)
        for key, r in got.items():
            assert "error" not in r, (model, key, r)
            if key[1] == "torchao" and key[0] in ("tp", "fsdp-tp"):
                assert r["skipped"].startswith("not measured: torchao's TP"), r
                continue
            assert "skipped" not in r and r["step_ms"] > 0 and r["loss"] > 0, (model, key, r)
        bf16 = got[("fsdp", "bf16")]["gathered_bytes"]
        assert 0 < got[("fsdp", "torchao")]["gathered_bytes"] < 0.6 * bf16, model
        assert got[("fsdp-hp", "torchao")]["gathered_bytes"] == bf16, model
        assert got[("1gpu", "torchao")]["gathered_bytes"] == 0, model
        for mode in ("1gpu", "fsdp", "fsdp-hp"):
            loss = got[(mode, "torchao")]["loss"]
            for other in (got[("fsdp" if mode == "fsdp-hp" else mode, "bf16")],
                          got[(mode, "current")]):
                assert abs(loss - other["loss"]) < 0.05 * other["loss"], (model, mode, loss,
                                                                          other)
        table = text.split(f"### {model}, eager")[1].split("###")[0]
        assert re.search(r"\| FSDP2 dp=2 \| torchao \| quantized \| [\d,]+ \| [\d.]+x \|", table)
        assert re.search(r"\| FSDP2 dp=2 \| torchao \| bf16 \| [\d,]+ \| [\d.]+x \|", table)
        assert "| TP+SP | torchao | not measured: torchao's TP" in table


def test_cpu_torchao_missing_is_skipped(tmp_path, monkeypatch):
    """--recipes torchao where torchao does not import: its rows are skipped with the import
    error, the bf16 rows still run, exit status 0; not in the default recipes then."""
    fake = tmp_path / "fake"
    (fake / "torchao").mkdir(parents=True)
    (fake / "torchao" / "__init__.py").write_text("raise ImportError('no torchao here')\n")
    path = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH")) if p)
    results, text = _run(tmp_path, ["--models", "gpt", "--modes", "1gpu,fsdp",
                                    "--recipes", "torchao"], env={"PYTHONPATH": path})
    got = {(r["mode"], r["recipe"]): r for r in results}
    assert set(got) == {(m, rc) for m in ("1gpu", "fsdp") for rc in ("bf16", "torchao")}
    for mode in ("1gpu", "fsdp"):
        assert got[(mode, "bf16")]["step_ms"] > 0
        why = got[(mode, "torchao")]["skipped"]
        assert why.startswith("not measured: torchao does not import") and "no torchao" in why
    assert "| 1 GPU alone | torchao | not measured: torchao does not import" in text
    # the default recipes (parse_args, here in-process): torchao among them exactly when
    # torchao_error() finds none; that function's verdict on the failing package is what the
    # skipped rows above carry
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the module sets NCCL variables
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["bench_distributed.py", "--device", "cpu"])
    import bench_distributed
    for error in ("ImportError: no torchao here", bench_distributed.torchao_error()):
        with monkeypatch.context() as m:
            m.setattr(bench_distributed, "torchao_error", lambda: error)
            recipes = bench_distributed.parse_args().recipes
        assert "current" in recipes and ("torchao" in recipes) == (error is None), recipes
    assert (bench_distributed.torchao_error() is None) == _imports()


PROFILE = os.path.join(ROOT, "benchmarks", "profile_distributed.py")


def test_profile_categories_and_intervals():
    """profile_distributed's arithmetic on a made-up trace: kernel names to categories, the sum
    per category equal to the kernel total, busy as the union of compute intervals, overlap as
    the NCCL time beside compute."""
    sys.path.insert(0, os.path.dirname(PROFILE))
    import profile_distributed as prof
    assert prof.category("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert prof.category("nvjet_sm90_tst_256x128_64x4") == "gemm"
    assert prof.category("void quantize_kernel<128>") == "quantize"
    assert prof.category("void at::native::vectorized_layer_norm_kernel") == "norm"
    assert prof.category("elementwise_kernel") == "other"
    assert prof.union_length([(0, 10), (5, 12), (20, 25)]) == 17
    events = [  # us: compute 0-100 and 150-200, NCCL 80-180 (50 us of it beside compute)
        {"cat": "kernel", "name": "nvjet_gemm", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "cast_kernel", "ts": 150, "dur": 50},
        {"cat": "kernel", "name": "ncclDevKernel_ReduceScatter", "ts": 80, "dur": 100},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
    ]
    row = prof.summarize(events, steps=1, step_ms=0.3)
    assert (row["gemm"], row["quantize"], row["nccl"]) == (0.1, 0.05, 0.1)
    assert abs(row["kernels"] - sum(row[c] for c in ("gemm", "quantize", "nccl", "attention",
                                                     "norm", "other"))) < 1e-12
    assert abs(row["busy"] - 0.15) < 1e-12 and abs(row["idle"] - 0.15) < 1e-12
    assert abs(row["overlap"] - 0.05) < 1e-12
    table = prof.top_kernels(events, steps=2).splitlines()
    assert table[1].split()[:3] == ["0.05", "0.5", "gemm"], table  # the most GPU time first
    assert len(table) == 4 and "aten::mm" not in "".join(table)  # kernels only


def test_profile_idle_waits():
    """idle_waits on a made-up trace: a gap whose kernel was launched late is the host's, one
    whose kernel was queued earlier is put down to the other stream's work that ended last
    before it (an all-gather here), and a gap with nothing ending in it says so."""
    sys.path.insert(0, os.path.dirname(PROFILE))
    import profile_distributed as prof

    def kernel(name, ts, dur, stream, corr):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream, "correlation": corr}}

    def launch(ts, corr):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2,
                "args": {"correlation": corr}}
    events = [  # us; compute on stream 7, NCCL on stream 20
        kernel("nvjet_a", 0, 100, 7, 1), launch(0, 1),
        kernel("ncclDevKernel_AllGather_RING_LL(x)", 50, 100, 20, 2), launch(40, 2),
        kernel("void cast_kernel<1>(p)", 160, 40, 7, 3), launch(10, 3),  # waited: 100 -> 160
        kernel("nvjet_b", 230, 20, 7, 4), launch(225, 4),  # launched late: 200 -> 230
        kernel("nvjet_c", 300, 10, 7, 5), launch(240, 5),  # 250 -> 300, nothing ended
    ]
    table = prof.idle_waits(events, steps=1).splitlines()
    assert table[1].split()[:2] == ["0.06", "1.0"] and "nccl: ncclDevKernel_AllGather" in table[1]
    assert table[2].split()[:2] == ["0.05", "1.0"] and "no other GPU work" in table[2]
    assert table[3].split()[:2] == ["0.03", "1.0"] and table[3].endswith("during the gap")
    assert len(table) == 4
    # the late launch's CPU ops on its thread name where the host was (outermost > innermost)
    for e in events:
        if e["cat"] == "cuda_runtime":
            e["tid"] = 1
    cpu_ops = (("ProfilerStep#3", 0, 400, 1), ("autograd::engine", 205, 30, 1),
               ("tequant::linear_bwd", 220, 10, 1), ("other", 220, 10, 2))
    events += [{"cat": "cpu_op", "name": n, "ts": ts, "dur": dur, "tid": tid}
               for n, ts, dur, tid in cpu_ops]
    host = prof.idle_waits(events, steps=1).splitlines()[3]
    assert host.endswith("during the gap, in autograd::engine > tequant::linear_bwd"), host


def test_profile_cpu_smoke(tmp_path):
    """Two gloo ranks, TP, bf16 and current with tp_comm_overlap on and off: one row each, from
    rank 1's trace (--rank)."""
    out = str(tmp_path / "prof.md")
    cmd = [sys.executable, PROFILE, "--device", "cpu", "--mode", "tp", "--recipes", "current",
           "--overlap", "on,off", "--steps", "1", "--warmup", "1", "--iters", "1", "--waits",
           "--rank", "1", "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = open(out).read()
    assert "ms per step, rank 1" in text
    rows = [line for line in text.splitlines()
            if re.match(r"\| (bf16|current) \| (on|off) \|", line)]
    assert len(rows) == 4, rows
    bad = subprocess.run(cmd[:-2] + ["--rank", "2"], capture_output=True, text=True, timeout=60,
                         env=env, cwd=ROOT)
    assert bad.returncode == 2 and "--rank 2: the ranks are 0 to 1" in bad.stderr
