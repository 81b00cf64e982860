"""benchmarks/bench_block.py (issue 24): its --device cpu quick mode, its kernel-name classifier,
its ratio / target arithmetic and its first-step check.

The quick mode runs in a subprocess with a timeout (both models, every recipe, eager, --profile;
and a compile run of one recipe): its exit status carries the benchmark's own first-step checks,
and the test reads the Markdown it writes (one row per block and recipe in order, positive
numbers, the baselines' ratios 1.00x, every check ok, a profile row per variant whose categories
add up to its total). In-process: a deliberately wrong fused block (GELU swapped for ReLU) must
fail the run with a MISMATCH row; the classifier on kernel names as torch, cuBLAS and tequant
name them; ratios() against hand-made rows. The GPU run is the command in the benchmark's
docstring.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_block.py")
RECIPES = ("delayed", "current", "block", "mxfp8", "nvfp4")
sys.path.insert(0, os.path.dirname(SCRIPT))
import bench_block  # noqa: E402


def _run(tmp_path, *args, timeout=300):
    out = tmp_path / "bench_block.md"
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--out", str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    assert text.strip() in done.stdout  # the file holds what was printed
    return text


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(text):
    """{(model, d): [row cells]} of the timing tables."""
    out, current = {}, None
    for line in text.splitlines():
        m = re.match(r"### (\w+) block, d=(\d+),", line)
        if m:
            current = out.setdefault((m.group(1), int(m.group(2))), [])
        elif line.startswith("| eager") or line.startswith("| compile"):
            current.append(_cells(line))
        elif not line.strip().startswith("|"):
            current = None if line.strip() else current
    return out


def _x(cell):
    return float(cell.rstrip("x"))


def test_cpu_quick_mode_rows_and_profile(tmp_path):
    text = _run(tmp_path, "--profile")
    tables = _tables(text)
    assert set(tables) == {("gpt", 128), ("llama", 128)}
    want = [("eager", "bf16", "bf16")] + [("eager", kind, r) for r in RECIPES
                                          for kind in ("te.Linear", "fused")]
    for rows in tables.values():
        assert [tuple(r[:3]) for r in rows] == want
        for r in rows:
            assert float(r[3]) > 0 and float(r[4].replace(",", "")) > 0, r  # step ms, tokens/s
            assert r[10].startswith("ok") or r[10] == "reference", r
            assert r[7] == "-" and r[8] == "-" and r[9] == "-", r  # eager; no peak on CPU
        assert rows[0][5] == "1.00x" and rows[0][6] == "-"
        for r in rows[1:]:
            assert _x(r[5]) > 0
            if r[1] == "te.Linear":
                assert r[6] == "1.00x", r
    assert "MISMATCH" not in text and "FAILED" not in text
    prof = [_cells(line) for line in text.splitlines()
            if re.match(r"\| (gpt|llama) \| 128 \|", line)]
    assert [(r[0], r[3], r[4]) for r in prof] == [(m, k, r) for m in ("gpt", "llama")
                                                  for _, k, r in want]
    for r in prof:
        total = float(r[6])
        parts = [float(r[7]), float(r[8].split()[0])] + [float(c) for c in r[9:]]
        assert total > 0 and abs(sum(parts) - total) <= 0.01 * len(parts), r
        assert float(r[7]) > 0, r  # the GEMMs (aten::mm, te.Linear's Function) are seen
    assert "| fused vs bf16 targets | not measured" in text


def test_cpu_quick_mode_compile(tmp_path):
    # aot_eager: the bench's compile path and tables without Inductor's C++ builds (~35 s on two
    # cores); the GPU runs use inductor
    text = _run(tmp_path, "--models", "gpt", "--recipes", "current", "--exec", "eager,compile",
                "--compile-backend", "aot_eager", timeout=400)
    rows = _tables(text)[("gpt", 128)]
    assert [tuple(r[:3]) for r in rows] == [
        (ex, kind, r) for ex in ("eager", "compile")
        for kind, r in (("bf16", "bf16"), ("te.Linear", "current"), ("fused", "current"))]
    for r in rows[3:]:
        assert _x(r[7]) > 0, r  # vs eager
        assert r[10] == "reference" or r[10].startswith("ok"), r
    targets = [_cells(line) for line in text.splitlines() if "compile vs eager" in line]
    assert len(targets) == 1 and targets[0][2] == ">= 1.00x", targets
    assert targets[0][3] == ("yes" if _x(targets[0][1]) >= 1 else "NO")


def test_a_wrong_fused_block_fails_the_run(monkeypatch, capsys):
    built = bench_block.build

    def wrong(model, d, heads, kind, weights, device):
        block = built(model, d, heads, kind, weights, device)
        if kind == "fused":
            block.mlp.activation = "relu"  # GELU in the te.Linear block
        return block
    monkeypatch.setattr(bench_block, "build", wrong)
    status = bench_block.main(["--device", "cpu", "--models", "gpt", "--recipes", "current",
                               "--steps", "1", "--warmup", "0"])
    out = capsys.readouterr()
    assert status == 1
    rows = [_cells(line) for line in out.out.splitlines() if line.startswith("| eager | fused")]
    assert len(rows) == 1 and rows[0][10].startswith("**MISMATCH"), rows
    assert "MISMATCH" in out.err  # listed under FAILED


@pytest.mark.parametrize("name, cat", [
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT", "gemm"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_cublas",
     "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn>(x)",
     "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(p)", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, "
     "false, cutlass::bfloat16_t>, false, true>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("fmha_cutlassB_bf16_aligned_128x64_k128_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128", "attention"),
    ("void (anonymous namespace)::cast_kernel<__nv_bfloat16, true>(CastParams)", "quantize"),
    ("void (anonymous namespace)::quantize_kernel<__nv_bfloat16, 128>(BlockParams)", "quantize"),
    ("void (anonymous namespace)::amax_update_kernel(SlotBatch, float const*)", "quantize"),
    ("void (anonymous namespace)::fused_pair_kernel<tq_fp::Bf16, false>(tq_fp8cast::CastParams, "
     "tq_fp8cast::CastParams, float*, float*)", "quantize"),
    ("void (anonymous namespace)::alpha_kernel(float const*, float const*, float*, int)",
     "quantize"),
    ("void (anonymous namespace)::fast_kernel<__nv_bfloat16, 32, 4, false, true, 512>("
     "(anonymous namespace)::FwdParams)", "norm"),
    ("void (anonymous namespace)::column_sum_kernel(float const*, long, long)", "norm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, "
     "float, false>(int, float, c10::BFloat16 const*)", "norm"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16,"
     " float, 32u, 1u, 32u, true, false>(long, long)", "norm"),
    ("triton_per_fused_add_native_layer_norm_native_layer_norm_backward_3", "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl("
     "at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}>(int)", "activation"),
    ("void at::native::(anonymous namespace)::silu_backward_kernel(at::TensorIteratorBase&)",
     "activation"),
    ("triton_poi_fused_mul_silu_2", "activation"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<"
     "c10::BFloat16>, std::array<char*, 3ul> >(int)", "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, sum_functor>>(x)",
     "other"),
    ("aten::mm", "gemm"), ("aten::addmm", "gemm"), ("_QuantizedLinear", "gemm"),
    ("aten::native_layer_norm_backward", "norm"), ("aten::gelu", "activation"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"), ("aten::add", "other"),
])
def test_kernel_categories(name, cat):
    assert bench_block.category(name) == cat


def test_summarize_per_step_and_the_amax_passes():
    times = [("nvjet_a", 3000.0), ("void (anonymous namespace)::amax_kernel<float>(p)", 400.0),
             ("void (anonymous namespace)::cast_kernel<float>(p)", 600.0),
             ("void (anonymous namespace)::amax_update_kernel(p)", 200.0),
             ("triton_poi_fused_gelu_0", 100.0), ("elementwise_add", 50.0)]
    p = bench_block.summarize(times, steps=2)
    assert p["gemm"] == 1.5 and p["quantize"] == 0.6 and p["amax"] == 0.2  # not amax_update
    assert p["activation"] == 0.05 and p["other"] == 0.025
    assert abs(p["kernels"] - sum(p[c] for c in bench_block.COLUMNS)) < 1e-12
    assert bench_block.top_other(times, steps=1) == [("elementwise_add", 0.05)]


def _row(model, d, ex, block, recipe, ms, peak):
    return {"model": model, "d": d, "exec": ex, "block": block, "recipe": recipe,
            "step_ms": ms, "tokens_per_s": 8192 / (ms / 1e3), "peak_gib": peak}


def test_ratios_pick_the_right_baselines():
    rows = [_row("gpt", 4096, "eager", "bf16", "bf16", 15.0, 10.0),
            _row("gpt", 4096, "eager", "te.Linear", "current", 10.0, 8.0),
            _row("gpt", 4096, "eager", "fused", "current", 9.0, 7.0),
            _row("gpt", 4096, "eager", "te.Linear", "delayed", 12.0, 9.0),
            _row("gpt", 4096, "eager", "fused", "delayed", 8.0, 9.5),
            _row("gpt", 4096, "compile", "bf16", "bf16", 12.0, 9.0),
            _row("gpt", 4096, "compile", "te.Linear", "current", 9.0, 8.0),
            _row("gpt", 4096, "compile", "fused", "current", 10.0, 6.0),
            _row("llama", 4096, "eager", "bf16", "bf16", 30.0, 20.0),
            _row("llama", 4096, "eager", "fused", "current", 20.0, 15.0),
            {"model": "gpt", "d": 2048, "exec": "eager", "block": "fused", "recipe": "block",
             "skipped": "time limit"}]
    r = {bench_block.key(x): x for x in bench_block.ratios(rows) if "step_ms" in x}
    fused_cur = r[("gpt", 4096, "eager", "fused", "current")]
    assert fused_cur["vs_bf16"] == pytest.approx(15.0 / 9.0)
    assert fused_cur["vs_linear"] == pytest.approx(10.0 / 9.0)
    assert fused_cur["peak_vs_linear"] == pytest.approx(7.0 / 8.0)
    assert fused_cur["vs_eager"] is None
    assert r[("gpt", 4096, "eager", "fused", "delayed")]["vs_linear"] == pytest.approx(1.5)
    comp = r[("gpt", 4096, "compile", "fused", "current")]
    assert comp["vs_bf16"] == pytest.approx(12.0 / 10.0)   # the compiled bf16 block's
    assert comp["vs_linear"] == pytest.approx(0.9)         # the compiled te.Linear block's
    assert comp["vs_eager"] == pytest.approx(0.9)          # itself eager
    llama = r[("llama", 4096, "eager", "fused", "current")]
    assert llama["vs_bf16"] == pytest.approx(1.5) and llama["vs_linear"] is None
    assert r[("gpt", 4096, "eager", "bf16", "bf16")]["vs_bf16"] == pytest.approx(1.0)

    goals = {what: (v, goal, met) for what, v, goal, met in bench_block.targets(rows)}
    assert goals["gpt d=4096 eager current: fused vs bf16"] == (
        pytest.approx(15.0 / 9.0), ">= 1.60x", True)
    assert goals["gpt d=4096 eager delayed: fused vs bf16"] == (
        pytest.approx(1.875), ">= 1.65x", True)
    assert goals["llama d=4096 eager current: fused vs bf16"] == (
        pytest.approx(1.5), ">= 1.50x", True)  # the goal met exactly
    assert "llama d=4096 eager current: fused peak vs te.Linear" not in goals or \
        goals["llama d=4096 eager current: fused peak vs te.Linear"][2] is None


def test_targets_thresholds():
    rows = [_row("gpt", 4096, "eager", "bf16", "bf16", 16.5, 10.0),
            _row("gpt", 4096, "eager", "te.Linear", "delayed", 12.0, 9.0),
            _row("gpt", 4096, "eager", "fused", "delayed", 10.0, 9.0),    # 1.65x exactly
            _row("gpt", 4096, "eager", "te.Linear", "block", 12.0, 9.0),
            _row("gpt", 4096, "eager", "fused", "block", 12.0, 9.5),      # 1.375x < 1.40x
            _row("gpt", 4096, "compile", "fused", "block", 12.5, 9.0),    # slower than eager
            _row("gpt", 2048, "eager", "bf16", "bf16", 10.0, 5.0),
            _row("gpt", 2048, "eager", "fused", "delayed", 5.0, 4.0)]     # d=2048: no B1 row
    goals = {what: (v, goal, met) for what, v, goal, met in
             bench_block.targets(bench_block.ratios(rows))}
    assert goals["gpt d=4096 eager delayed: fused vs bf16"][2] is True
    assert goals["gpt d=4096 eager block: fused vs bf16"][2] is False
    assert goals["gpt d=4096 block: fused compile vs eager"] == (
        pytest.approx(12.0 / 12.5), ">= 1.00x", False)
    assert goals["gpt d=4096 eager delayed: fused peak vs te.Linear"][2] is True   # equal
    assert goals["gpt d=4096 eager block: fused peak vs te.Linear"][2] is False
    assert goals["gpt d=4096 compile block: fused peak vs te.Linear"] == (None, "<= 1.00x", None)
    assert not any(w.startswith("gpt d=2048") and w.endswith("vs bf16") for w in goals)


def test_fused_check_bounds_and_names():
    lin = {"y - x": 0.04, "mlp.fc1.weight": 0.001}
    bounds = bench_block.fused_bounds(lin)
    assert bounds == {"y - x": pytest.approx(0.05), "mlp.fc1.weight": 0.01}
    assert bench_block.verdict({"y - x": 0.049, "mlp.fc1.weight": 0.009}, bounds) == (
        True, "y - x")
    assert bench_block.verdict({"y - x": 0.01, "mlp.fc1.weight": 0.02}, bounds) == (
        False, "mlp.fc1.weight")
    assert bench_block.verdict({"y - x": float("nan"), "mlp.fc1.weight": 0.0}, bounds) == (
        False, "y - x")
    gate, up = torch.ones(3, 2), 2 * torch.ones(3, 2)
    fused = bench_block.to_fused({"gate.weight": gate, "up.weight": up, "norm2.weight": 1,
                                  "down.weight": 2, "attn.qkv.weight": 3})
    assert set(fused) == {"mlp.fc1.weight", "mlp.layer_norm_weight", "mlp.fc2.weight",
                          "attn.qkv.weight"}
    assert torch.equal(fused["mlp.fc1.weight"], torch.cat([gate, up]))  # swiglu: act(gate) * up
    assert bench_block.ffn_of("llama", 4096) == 14336 and bench_block.ffn_of("gpt", 2048) == 8192
    args = bench_block.parse_args(["--device", "cpu", "--out"])
    assert args.out == "docs/results/bench_block.md" and args.d == [128]


def test_interleaved_rounds_take_the_median_and_drop_the_steps():
    """interleaved(): every kept step is timed again rounds - 1 times, the variants in turn; the
    row reports the median round; compiled rows (no kept step) keep their one round."""
    calls = []

    def step_of(name):
        return lambda x: calls.append(name)

    args = bench_block.parse_args(["--device", "cpu", "--rounds", "3", "--steps", "2"])
    rows = [{"_step": (step_of(n), None), "rounds_us": [us], "step_ms": us / 1e3}
            for n, us in (("a", 1e9), ("b", 1e9))]
    compiled = {"rounds_us": [7.0], "step_ms": 7e-3}
    bench_block.interleaved(rows + [compiled], args)
    assert calls == (["a"] * 3 + ["b"] * 3) * 2  # warm-up 1 + 2 steps, a then b, two rounds
    for r in rows:
        assert "_step" not in r and len(r["rounds_us"]) == 3
        assert r["step_ms"] == sorted(r["rounds_us"])[1] / 1e3 < 1e6  # not the slow first
    assert compiled == {"rounds_us": [7.0], "step_ms": 7e-3}
    with pytest.raises(SystemExit):
        bench_block.parse_args(["--device", "cpu", "--rounds", "0"])
