"""Float8BlockScaling's GEMM of our own for Hopper (cuda/gemm_fp8_block.cu) and its CPU reference
(csrc/ref/gemm_fp8_block_ref.c).

CPU (every machine with gcc): tests/c/test_gemm_block_ref.c checks the reference against a
float64 product of independently decoded operands, and a reference with its block scales dropped
must fail that program. GPU (marked gpu; on an sm_90 device the kernel runs, elsewhere
cuBLASLt): the three te.Linear products of both block recipes at shapes off every tile edge
(M, N and K not multiples of 128, N across the kernel's two 128-column halves, K one block or
many), every output dtype, bias and accumulate, against the float64 product of the dequantized
operands (test_gemm.py's reference) at NUMERICS 5's Hopper tolerance, with TEQUANT_BLOCK_GEMM=
tequant (the kernel; csrc/core/gemm.c reads the variable at every call); that on sm_90 the kernel
makes no cuBLASLt plan and TEQUANT_BLOCK_GEMM=cublaslt does (the switch works); and that the two
agree.
"""
import pathlib
import shutil
import subprocess

import pytest
import torch

from tequant import _C
from test_gemm import (HOPPER_FP8_TOL, bias_epilogue_dtype, check, gemm, operands, plan_stats,
                       quantize_for, reference)

REPO = pathlib.Path(__file__).resolve().parents[1]
REF_TEST = REPO / "tests" / "c" / "test_gemm_block_ref.c"
SOURCES = sorted((REPO / "csrc" / "core").glob("*.c")) + sorted((REPO / "csrc" / "ref").glob("*.c"))
GCC = shutil.which("gcc")
FLAGS = ["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-ffp-contract=off",
         f"-I{REPO / 'csrc' / 'include'}", f"-I{REPO / 'csrc' / 'core'}", f"-I{REPO / 'csrc' / 'ref'}",
         f"-I{REPO / 'tests' / 'c'}"]
needs_gcc = pytest.mark.skipif(GCC is None, reason="gcc is not on PATH")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _ref_program(tmp_path, sources, name):
    exe = tmp_path / name
    build = subprocess.run([GCC, *FLAGS, str(REF_TEST), *map(str, sources), "-lm", "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)


@needs_gcc
def test_reference_against_float64(tmp_path):
    proc = _ref_program(tmp_path, SOURCES, "test_gemm_block_ref")
    assert proc.returncode == 0, proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert last.endswith(" 0 failed") and int(last.split()[0]) >= 26, proc.stdout


@needs_gcc
def test_reference_without_its_scales_fails(tmp_path):
    src = (REPO / "csrc" / "ref" / "gemm_fp8_block_ref.c").read_text()
    line = "acc = fmaf(part, s, acc);"
    assert line in src, "gemm_fp8_block_ref.c changed; update this negative control"
    broken = tmp_path / "gemm_fp8_block_ref.c"
    broken.write_text(src.replace(line, "acc = fmaf(part, s > 0.0f ? 1.0f : s, acc);"))
    sources = [broken if p.name == broken.name else p for p in SOURCES]
    proc = _ref_program(tmp_path, sources, "test_gemm_block_ref_broken")
    assert proc.returncode != 0 and " 0 failed" not in proc.stdout.splitlines()[-1], proc.stdout


def hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def ours(monkeypatch):
    monkeypatch.setenv("TEQUANT_BLOCK_GEMM", "tequant")


# (M, K, N) of x [M, K] and w [N, K]: fprop [M, N] (K contracted), dgrad [M, K] (N contracted),
# wgrad [N, K] (M contracted): each a multiple of 16 (FP8), none of 128 but one
SHAPES = [(304, 400, 272), (16, 128, 144), (144, 1040, 400), (1008, 144, 32)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("product", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("name", ["block", "block_hybrid"])
def test_products_off_the_tile_edges(ours, name, product, shape, out_dtype):
    M, K, N = shape
    hp = operands(M, K, N, seed=M + K)
    qa, qb = quantize_for(name, product, hp, device="cuda")
    want = reference(qa, qb, product)
    tol = HOPPER_FP8_TOL if out_dtype == torch.float32 else 8e-3
    check(gemm(qa, qb, product, out_dtype=out_dtype), want, tol, shape=want.shape, dtype=out_dtype)
    g = torch.Generator().manual_seed(5)
    start = (torch.randn(want.shape, generator=g) * 4).to("cuda", out_dtype)
    bias = torch.randn(want.shape[1], generator=g).to("cuda")
    out = start.clone()
    gemm(qa, qb, product, out_dtype=out_dtype, out=out, accumulate=True, bias=bias)
    bias_used = bias.to(bias_epilogue_dtype(name, out_dtype)).double()
    check(out, start.double() + want + bias_used, tol)


@gpu
@pytest.mark.gpu
def test_long_contraction(ours):
    hp = operands(256, 8192, 384, seed=3)
    qa, qb = quantize_for("block", "fprop", hp, device="cuda")
    check(gemm(qa, qb, "fprop", out_dtype=torch.float32), reference(qa, qb, "fprop"), HOPPER_FP8_TOL)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("product", ["fprop", "dgrad", "wgrad"])
def test_the_switch_and_agreement_with_cublaslt(monkeypatch, product):
    qa, qb = quantize_for("block", product, operands(144, 272, 208, seed=6), device="cuda")
    runs = {}
    for path in ("cublaslt", "tequant"):
        monkeypatch.setenv("TEQUANT_BLOCK_GEMM", path)
        _C._gemm_plan_cache_clear()
        runs[path] = gemm(qa, qb, product, out_dtype=torch.float32)
        made_plan = plan_stats()["plans"] == 1
        assert made_plan == (path == "cublaslt" or not hopper()), path
    check(runs["tequant"], runs["cublaslt"].double(), HOPPER_FP8_TOL)
    check(runs["tequant"], reference(qa, qb, product), HOPPER_FP8_TOL)


@gpu
@pytest.mark.gpu
def test_linear_training_step_on_either_gemm(monkeypatch):
    """A te.Linear step under Float8BlockScaling (fprop, dgrad, wgrad with bias) on the kernel and
    on cuBLASLt: the same outputs and gradients up to the order of FP32 sums (BF16 roundings)."""
    import tequant as te
    from tequant.recipe import Float8BlockScaling

    torch.manual_seed(0)
    lin = te.Linear(384, 272, device="cuda", params_dtype=torch.bfloat16)
    x0 = torch.randn(300, 384, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(300, 272, device="cuda", dtype=torch.bfloat16)
    results = {}
    for path in ("cublaslt", "tequant"):
        monkeypatch.setenv("TEQUANT_BLOCK_GEMM", path)
        lin.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        with te.autocast(recipe=Float8BlockScaling()):
            y = lin(x)
        y.backward(dy)
        results[path] = [y.detach(), x.grad, lin.weight.grad, lin.bias.grad]
    for ours_t, theirs in zip(results["tequant"], results["cublaslt"]):
        check(ours_t, theirs.double(), 8e-3)
    x = x0.double()
    ref = x @ lin.weight.double().t() + lin.bias.double()
    assert 1e-3 < float((results["tequant"][0].double() - ref).norm() / ref.norm()) < 5e-2
