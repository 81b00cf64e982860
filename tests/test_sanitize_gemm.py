"""The GEMM paths under compute-sanitizer: te.ops.gemm for every recipe (fprop with a bias,
dgrad, wgrad accumulating into its output; Float8BlockScaling's padded M; the emulated pairs'
misaligned operand), the control that marks a torch GEMM's output written (initcheck does not
see cuBLAS's stores on Hopper), and the kernels the extension reaches only on the CPU, called
through the C API with ctypes (tq_gemm_alpha, tq_gemm_operand_values). Split from
tests/test_sanitize_kernels.py, whose docstring lists which test reaches which kernel and whose
helpers and rules these use. Runner: tools/sanitize.sh (make sanitize; docs/sanitize.md). GPU
only; skipped without CUDA.
"""
import ctypes
import os
import sys

import pytest
import torch

import tequant as te
from tequant import _C
from tequant.quantized import COLUMNWISE, ROWWISE, QuantizedTensor
from tequant.recipe import Float8BlockScaling, Format

sys.path.insert(0, os.path.dirname(__file__))
from test_sanitize_kernels import (BF16, DEVICE, F16, F32, MEMBERS, RECIPES,  # noqa: E402
                                   _finite, _layout, _misaligned_bytes, _randn)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device "
                                 "(run it under compute-sanitizer with tools/sanitize.sh)"),
              pytest.mark.gpu]

# ---- GEMMs ------------------------------------------------------------------------------------

GEMM_SHAPES = {"delayed": (48, 128, 64), "current": (48, 128, 64), "block": (48, 128, 64),
               "mxfp8": (64, 128, 96), "nvfp4": (48, 128, 80)}


def _with_misaligned_data(q):
    """q with its rowwise codes moved one byte off a 16-byte boundary."""
    members = (_misaligned_bytes(q.data),) + tuple(q._members()[1:])
    return QuantizedTensor(q.config, q.shape, q.dtype, members, q.recipe, q.role)


def _written(t):
    """t, marked written for initcheck: a torch GEMM's output, whose cuBLAS stores the tool does
    not see on Hopper (tequant marks its own GEMM outputs in C; docs/sanitize.md)."""
    _C._sanitizer_mark_written(t.view(torch.uint8))  # bytes: any dtype (float64 too)
    return t


def test_control_torch_gemm_output():
    """Only torch: a bf16 torch.mm on CUDA (cuBLAS), its output read by .float(). Unmarked, initcheck
    reported every element of y as uninitialized (6144 = 64 x 96) although its values are right:
    the tool does not see cuBLAS's stores (docs/sanitize.md, "The control"). Marked written
    through NVTX (tools/sanitize.sh passes --nvtx yes), it must report nothing: the check that
    the marks reach the tool, which tequant's own GEMM outputs rely on."""
    a, b = _randn(64, 128, dtype=BF16, seed=11), _randn(128, 96, dtype=BF16, seed=12)
    y = _written(torch.mm(a, b))
    ref = _written(a.double() @ b.double())
    assert float((y.float().double() - ref).norm()) <= 0.01 * float(ref.norm())


@pytest.mark.parametrize("name", list(RECIPES))
def test_gemm(name):
    recipe = RECIPES[name]
    m, k, n = GEMM_SHAPES[name]
    emulated = name in ("mxfp8", "nvfp4")
    x, w = _randn(m, k, dtype=BF16, seed=7), _randn(n, k, dtype=BF16, seed=8)
    dy, bias = _randn(m, n, dtype=BF16, seed=9), _randn(n, dtype=BF16, seed=10)
    qx, qw, qdy = (te.ops.quantize(t, recipe, role, rowwise=True, columnwise=True)
                   for t, role in ((x, "input"), (w, "weight"), (dy, "grad_output")))
    y = te.ops.gemm(qx, qw, transpose_b=True, bias=bias, out_dtype=BF16)  # fprop
    ref = _written(qx.dequantize() @ qw.dequantize().t()) + bias.float()
    assert float((y.float() - ref).norm()) <= 0.02 * float(ref.norm())
    dx = te.ops.gemm(qdy, qw, out_dtype=F32 if emulated else F16)  # dgrad
    dw = torch.zeros(n, k, device=DEVICE)
    te.ops.gemm(qdy, qx, transpose_a=True, out=dw, accumulate=True)  # wgrad, beta = 1
    _finite(y, dx, dw)
    if name == "block":  # M % 8 != 0: A and its scales padded in scratch, output copied back
        qx44 = te.ops.quantize(x[:44], recipe, "input", rowwise=True)
        qdy44 = te.ops.quantize(dy[:44], recipe, "grad_output", rowwise=True)
        y44 = te.ops.gemm(qx44, qw, transpose_b=True, bias=bias, out_dtype=BF16)
        dx44 = torch.zeros(44, k, device=DEVICE)
        te.ops.gemm(qdy44, qw, out=dx44, accumulate=True)
        _finite(y44, dx44)
    if emulated:  # the dequantizing prologue's element-wise path: the same values and product
        y_mis = te.ops.gemm(_with_misaligned_data(qx), qw, transpose_b=True, bias=bias,
                            out_dtype=BF16)
        torch.testing.assert_close(y_mis, y, rtol=1e-2, atol=1e-2)


# ---- tequant's own block-scaled GEMM (cuda/gemm_fp8_block.cu, opt-in) ----------------------

BLOCK_GEMM = {"e4m3": Float8BlockScaling(),  # 1x128 x 128x128 weights, E4M3 everywhere
              "hybrid": Float8BlockScaling(fp8_format=Format.HYBRID),  # E5M2 grads
              "grad-2d": Float8BlockScaling(fp8_format=Format.HYBRID, w_block_scaling_dim=1,
                                            grad_block_scaling_dim=2)}  # 2D grads, 1D weights


def _on_hopper():
    return torch.cuda.get_device_capability(DEVICE) == (9, 0)


def _rel_err(y, ref):
    return float((y.double() - ref.double()).norm()) / float(ref.double().norm())


# racecheck does not follow a bulk copy's completion on an mbarrier: it reports the kernel's
# scale-vector copies into shared memory (cp.async.bulk, SASS UBLKCP) against the consumers' loads
# of them (LDS), which wait on that very barrier (docs/sanitize.md, "block_gemm_kernel under
# racecheck"); memcheck, initcheck and synccheck run these tests
NOT_UNDER_RACECHECK = pytest.mark.skipif(
    os.environ.get("SANITIZE_TOOL") == "racecheck",
    reason="racecheck cannot follow cp.async.bulk + mbarrier (docs/sanitize.md)")


@NOT_UNDER_RACECHECK
@pytest.mark.parametrize("name", list(BLOCK_GEMM))
def test_block_gemm_own_kernel(monkeypatch, name):
    """block_gemm_kernel<kPair> (TEQUANT_BLOCK_GEMM=tequant, read at every GEMM; sm_90 only,
    cuBLASLt elsewhere), which the default (cuBLASLt) never launches: fprop with a bias into
    bf16, dgrad with a bias into fp16, wgrad accumulating into fp32 and x^T dy into fp32 (A E4M3,
    B E5M2 under HYBRID); so kPair 0 (E4M3 x E4M3), 1 (E5M2 A) and 2 (E5M2 B), 1x128 and 128x128
    scales on either side. M, N and K off the 128 x 256 tile and 128-deep k block (K = 272, 80,
    144: partial k blocks, TMA zero-fill), a CTA pair's second CTA past M (wgrad's M = 80).
    kPair 3 (E5M2 x E5M2) is refused before any kernel (tq_gemm_query). On sm_90 no cuBLASLt
    plan may be made (the kernel ran)."""
    monkeypatch.setenv("TEQUANT_BLOCK_GEMM", "tequant")
    recipe = BLOCK_GEMM[name]
    m, k, n = 144, 272, 80
    x, w = _randn(m, k, dtype=BF16, seed=40), _randn(n, k, dtype=BF16, seed=41)
    dy = _randn(m, n, dtype=BF16, seed=42)
    qx, qw, qdy = (te.ops.quantize(t, recipe, role, rowwise=True, columnwise=True)
                   for t, role in ((x, "input"), (w, "weight"), (dy, "grad_output")))
    _C._gemm_plan_cache_clear()
    bias = _randn(n, dtype=BF16, seed=43)
    y = te.ops.gemm(qx, qw, transpose_b=True, bias=bias, out_dtype=BF16)  # fprop
    ref = _written(qx.dequantize() @ qw.dequantize().t()) + bias.float()
    assert _rel_err(y, ref) <= 0.02
    dx = te.ops.gemm(qdy, qw, bias=_randn(k, dtype=BF16, seed=44), out_dtype=F16)  # dgrad
    dw = torch.ones(n, k, device=DEVICE)
    te.ops.gemm(qdy, qx, transpose_a=True, out=dw, accumulate=True)  # wgrad, beta = 1
    xt_dy = te.ops.gemm(qx, qdy, transpose_a=True, out_dtype=F32)  # [K, N]: B the grad
    _finite(y, dx, dw, xt_dy)
    ref = _written(qx.dequantize_direction("columnwise", F32)
                   @ qdy.dequantize_direction("columnwise", F32).t())
    assert _rel_err(xt_dy, ref) <= 0.05
    if _on_hopper():
        assert dict(_C._gemm_plan_stats())["plans"] == 0, "cuBLASLt ran instead of the kernel"


@NOT_UNDER_RACECHECK
def test_block_gemm_own_kernel_persistent(monkeypatch):
    """block_gemm_kernel with more tile pairs (9 x 8 = 72) than CTA pairs fit at once on a
    132-SM GPU (66): each CTA pair takes a second tile, the 4-stage ring and its barriers
    reused across tiles (memcheck / synccheck); K = 640, five k blocks: the ring wraps
    within a tile."""
    monkeypatch.setenv("TEQUANT_BLOCK_GEMM", "tequant")
    recipe = BLOCK_GEMM["e4m3"]
    qx = te.ops.quantize(_randn(2304, 640, dtype=BF16, seed=45), recipe, "input")
    qw = te.ops.quantize(_randn(2048, 640, dtype=BF16, seed=46), recipe, "weight")
    _C._gemm_plan_cache_clear()
    y = te.ops.gemm(qx, qw, transpose_b=True, out_dtype=F32)
    if _on_hopper():
        assert dict(_C._gemm_plan_stats())["plans"] == 0, "cuBLASLt ran instead of the kernel"
    ref = _written(qx.dequantize() @ qw.dequantize().t())
    assert _rel_err(y, ref) <= 0.01


# At this shape (a chunk of 1024 rows x 64 x K = 16384) cuBLASLt runs the emulated BF16 GEMM
# split-K: its partial sums pass through tequant's GEMM workspace (marked written for initcheck,
# gemm_cublaslt.c), and racecheck reports hazards inside those nvjet *_splitK kernels of cuBLAS
# (H200, docs/sanitize.md); memcheck, initcheck and synccheck run it.
NOT_UNDER_RACECHECK_SPLIT_K = pytest.mark.skipif(
    os.environ.get("SANITIZE_TOOL") == "racecheck",
    reason="racecheck's reports inside cuBLASLt's split-K kernels (docs/sanitize.md)")


@NOT_UNDER_RACECHECK_SPLIT_K
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_gemm_emulated_row_chunks(name):
    """run_emulated (csrc/core/gemm.c) in two row chunks of A: A's BF16 values take at most
    32 MiB, so A [1056, 16384] goes as 1024 rows then 32; the second chunk's values launch
    (values_pair_kernel) has no B to write (B's values are made with the first), its A
    exponents / scales start at row 1024. The one emulated case whose A exceeds 16M elements
    (~34 MB of bf16 x)."""
    recipe = RECIPES[name]
    x = _randn(1056, 16384, dtype=BF16, seed=47)
    w = _randn(64, 16384, dtype=BF16, seed=48)
    qx = te.ops.quantize(x, recipe, "input", rowwise=True)
    qw = te.ops.quantize(w, recipe, "weight", rowwise=True)
    y = te.ops.gemm(qx, qw, transpose_b=True, out_dtype=F32)
    ref = _written(qx.dequantize() @ qw.dequantize().t())
    assert _rel_err(y, ref) <= 0.02
    assert _rel_err(y[1024:], ref[1024:]) <= 0.02  # the second chunk's rows


# ---- the C API through ctypes: kernels the extension reaches only on CPU -----------------------

class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("ld", ctypes.c_int64), ("dtype", ctypes.c_int), ("device", ctypes.c_int)]


class _Config(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("scaling", ctypes.c_int),
                ("elem_dtype", ctypes.c_int), ("scale_dtype", ctypes.c_int),
                ("block_rows", ctypes.c_int32), ("block_cols", ctypes.c_int32),
                ("flags", ctypes.c_uint32), ("fmax", ctypes.c_float),
                ("amax_epsilon", ctypes.c_float), ("margin", ctypes.c_int32),
                ("amax_history_len", ctypes.c_int32), ("amax_algo", ctypes.c_int)]


class _QTensor(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("rows", ctypes.c_int64),
                ("cols", ctypes.c_int64)] + [(name, _Tensor) for name in MEMBERS]


class _Operand(ctypes.Structure):
    _fields_ = [("config", ctypes.POINTER(_Config)), ("q", ctypes.POINTER(_QTensor)),
                ("usage", ctypes.c_uint32)]


# csrc/include/tequant/tequant.h's enums
_SCALING = {"delayed": 1, "current": 2, "block": 3, "mxfp8": 4, "nvfp4": 5}
_ELEM = {"E4M3": 3, "E5M2": 4, "E2M1": 5}
_SCALE = {"float32": 0, "e4m3": 3, "e8m0": 6}
_DTYPE = {F32: 0, BF16: 1, F16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4,
          torch.float8_e8m0fnu: 6, torch.uint8: 7}


def _lib():
    lib = ctypes.CDLL(_C.__file__)  # the loaded extension: its tq_* C API is exported
    lib.tq_last_error.restype = ctypes.c_char_p
    return lib


def _c_tensor(t, packed_e2m1=False):
    if t is None:
        return _Tensor()
    ld = t.stride(0) if t.dim() == 2 else t.shape[-1]
    rows, cols = (t.shape[0], t.shape[1]) if t.dim() == 2 else (1, t.numel())
    dtype, scale = (5, 2) if packed_e2m1 else (_DTYPE[t.dtype], 1)  # two E2M1 codes per byte
    device = -1 if t.device.type == "cpu" else t.device.index
    return _Tensor(t.data_ptr(), rows, cols * scale, ld * scale, dtype, device)


def _c_operand(q, usage, alive):
    """The tq_gemm_operand of one direction of q; what keeps it valid (its structs, q's tensors)
    goes into the list `alive`."""
    c = q.config
    block = c.block or (0, 0)
    flags = ((1 if c.power_2_scale else 0) | (2 if c.rht else 0)
             | (4 if c.stochastic_rounding else 0) | (8 if c.two_d else 0))
    config = _Config(ctypes.sizeof(_Config), _SCALING[c.scaling], _ELEM[c.format],
                     _SCALE[c.scale_dtype], block[0], block[1], flags, c.fmax, c.amax_epsilon,
                     c.margin or 0, c.amax_history_len or 0, 0)
    packed = c.format == "E2M1"
    qt = _QTensor(ctypes.sizeof(_QTensor), q.rows, q.cols,
                  *[_c_tensor(getattr(q, name), packed and name in ("data", "data_t"))
                    for name in MEMBERS])
    alive += [config, qt, q]
    return _Operand(ctypes.pointer(config), ctypes.pointer(qt), usage)


def _check_call(lib, fn, *args):
    """lib.fn(*args by reference, the current stream of DEVICE) must return TQ_SUCCESS."""
    stream = None
    if DEVICE.type == "cuda":
        stream = ctypes.c_void_p(torch.cuda.current_stream(DEVICE).cuda_stream)
    status = getattr(lib, fn)(*[ctypes.byref(a) for a in args], stream)
    assert status == 0, f"{fn}: {lib.tq_last_error().decode()}"


def test_c_api_gemm_alpha_and_values():
    lib = _lib()
    nvfp4, current = RECIPES["nvfp4"], RECIPES["current"]
    qx = te.ops.quantize(_randn(48, 128, dtype=BF16, seed=11), nvfp4, "input", rowwise=True,
                         columnwise=True)
    qw = te.ops.quantize(_randn(80, 128, dtype=BF16, seed=12), nvfp4, "weight")
    alive = []
    a, b = _c_operand(qx, ROWWISE, alive), _c_operand(qw, ROWWISE, alive)
    alpha = torch.full((1, 1), -1.0, device=DEVICE)
    alpha_c = _c_tensor(alpha)
    _check_call(lib, "tq_gemm_alpha", a, b, alpha_c)
    want = (qx.amax * qw.amax) * torch.tensor(1 / 7225344, device=DEVICE)
    torch.testing.assert_close(alpha, want.reshape(1, 1), rtol=1e-6, atol=0)
    # a per-tensor FP8 pair: alpha = 1 (the kernel's no-amax branch)
    pa = _c_operand(te.ops.quantize(_randn(48, 128, seed=13), current, "input"), ROWWISE, alive)
    pb = _c_operand(te.ops.quantize(_randn(64, 128, seed=14), current, "weight"), ROWWISE, alive)
    _check_call(lib, "tq_gemm_alpha", pa, pb, alpha_c)
    assert float(alpha) == 1.0
    # NVFP4 GEMM values (e2m1 * s_b, no global factor): bf16 vectorized, fp32 element-wise
    for direction, usage, amax in (("rowwise", ROWWISE, qx.amax),
                                   ("columnwise", COLUMNWISE, qx.amax_t)):
        op = _c_operand(qx, usage, alive)
        deq = qx.dequantize_direction(direction, F32)
        for dtype, layout in ((BF16, "contiguous"), (F32, "misaligned")):
            out = _layout(torch.zeros(deq.shape, dtype=dtype, device=DEVICE), layout)
            out_c = _c_tensor(out)
            _check_call(lib, "tq_gemm_operand_values", op, out_c)
            torch.testing.assert_close(out.float() * amax.reshape(()) / 2688, deq, rtol=1e-5,
                                       atol=1e-30)
