"""The CUDA selection that runs under compute-sanitizer (issue 25): every kernel of cuda/*.cu,
for every recipe, at small shapes, plus one CUDA-graph capture and replay per recipe.

Not a correctness test (tests/test_quantize_*.py, test_gemm.py and test_linear*.py compare bits
and tolerances): here the point is to REACH each kernel, and each of its paths (vectorized and
element-wise, small one-CTA and tiled, rowwise / columnwise / both, every input dtype), so that
memcheck, racecheck, initcheck and synccheck see them. The checks are cheap (finite, close to x,
equal to the aligned path) and every quantized member is read whole (_touch), so initcheck flags
any byte a quantizer leaves unwritten. Inputs live in buffers whose padding is never written
(torch.empty): a kernel reading past its view reads uninitialized memory.
Runner: tools/sanitize.sh (make sanitize; docs/sanitize.md). GPU only; skipped without CUDA.
The norm_* and act_* tests named below are in tests/test_sanitize_fused.py (the fused modules'
kernels), the gemm, control_torch_gemm_output and c_api_* tests in tests/test_sanitize_gemm.py;
both import this file's helpers.

Kernel (cuda/*.cu, *.cuh)                launched by (test_... [case])
act_forward.cu act_forward_kernel<f32|bf16|f16, gelu|relu|silu|qgelu|srelu|identity, gated
                                          or not> act_kernels (every activation and dtype;
                                          16-byte and element paths; M = 0 too); <table>
                                          act_table_kernels (bf16 gelu, silu, qgelu, geglu,
                                          swiglu over enough elements: act_table.cuh)
               colt_kernel<bf16|f16, activation, gated or not, table or not>
                                          act_forward_columnwise (y_q_t from shared memory)
act_backward.cu act_backward_kernel<f32|bf16|f16, activation, gated or not, dbias or not>
                                          act_kernels (dh over h too), act_table_kernels
                                          (<table>); <identity, dbias> (no h read) also
                                          quantize_dbias (tq_quantize's dbias pass: DelayedScaling
                                          cast + amax, current scaling's amax after a memset, the
                                          sums alone), linear_step and cuda_graph_step (bias)
               identity_columnwise_kernel<dbias, rows>  quantize_dbias[delayed-grad] (both
                                          directions: DelayedScaling's pass writes the columnwise
                                          codes too; row chunks of 4 rows at these shapes),
                                          quantize_dbias_delayed_groups (16 and 64 rows: the
                                          next rows' loads run ahead, across groups);
                                          <kFinish> with the history's roll after the barrier
                                          (amax_roll.cuh): test_sanitize_fused's
                                          backward_update_in_dy_cast
act_quantize_block.cu, act_quantize_mxfp8.cu: the block / MXFP8 tile kernels with
               ActLoad (forward) and ActGradLoad (backward) loaders, table or not
                                          act_tile_kernels[block|mxfp8] (every activation but the
                                          identity and dtype, rowwise alone and both directions,
                                          rows past M, element loads; bf16 table launches)
amax.cu        amax_kernel<f32|bf16|f16,  amax_paths (all nine); FlatVec also quantize_dequantize
               FlatVec|RowVec|Scalar>     [current-*] (an FP8 current x of more than 64K elements)
amax_update.cu amax_update_kernel<max>    amax_update (600 slots: two launches; a history of
                                          1100 entries: the roll by chunks), linear_step
                                          [delayed-*], cuda_graph_step[delayed] (autocast exit,
                                          end of backward)
               amax_update_kernel<most_recent>  amax_update (with all-reduced amaxes)
codec.cu       codec_kernel<10 codecs>    codecs
column_sums.cuh column_sum_kernel<f32>    norm_kernels, act_kernels (dbias), quantize_dbias,
                                          linear_step[nvfp4-f32]
               column_sum_kernel<bf16|f16>  quantize_dbias (dbias of each dtype), linear_step
                                          (a bias of the case's dtype)
gemm_alpha.cu  alpha_kernel               c_api_gemm_alpha_and_values (tq_gemm_alpha through
                                          ctypes: the extension calls it for CPU operands only)
norm_backward.cu norm_backward_kernel<f32|bf16|f16, kT 32|64 (one chunk each) | 64|128|256 (two or
               four) in registers, 256 re-reading>  norm_kernels (K = 200 / 500 / 1000 / 2000 /
                                          4000 / 8000, 9000 and 30001; aligned and misaligned rows)
               column_partial_kernel<f32|bf16|f16>  norm_kernels (K = 9000, 30001)
norm_forward.cu norm_forward_kernel<f32|bf16|f16, kT 32|64|128|256 in registers, 256 re-reading>
                                          norm_kernels (K = 500 / 1000 / 3000 / 6000 / 12000,
                                          17001; M = 0 too: the one-CTA scale_inv / amax launch)
               fast_kernel<f32|bf16|f16, kT/kC, norm, full or not> (norm_forward_fast.cuh)
                                          norm_forward_fast (every
                                          variant in each output mode; three shapes with several
                                          rows per row group: named barriers reused)
               fast_kernel<bf16|f16, ..., kColT> (y_q_t from shared memory)
                                          norm_forward_columnwise (K = 8 .. 4096, two shapes
                                          with more tiles than CTAs, one M % 32 != 0)
pad.cu         pad_rows_kernel<uint4>     linear_step (51 tokens), cuda_graph_step (50 tokens)
               pad_rows_kernel<uint8_t>   linear_step (third step: an input one element off a
                                          16-byte boundary)
quantize_fp8.cu small_current_kernel      quantize_dequantize[current-*] (<= 64K elements;
                                          row / col / both), linear_step[current-*], graphs
               fused_current_kernel       quantize_dequantize[current-*] (> 64K elements: one
                                          cooperative launch, one tile per CTA),
                                          quantize_current_several_tiles (a CTA's first tile kept
                                          in shared memory, its last in registers, those between
                                          loaded again; each direction alone and both)
               fused_current_kernel<dbias> quantize_dbias_one_launch (bf16 grad_output: the
                                          partials, the CTAs' maxima, the sums finished inside;
                                          one tile per CTA, and up to three loaded again)
               fused_pair_kernel<E4M3|E5M2>  quantize_pair (one tile per CTA; ragged; up to
                                          three per CTA, loaded again),
                                          linear_step[current-*] (x and W)
               delayed_pair_kernel<E4M3|E5M2>  quantize_pair, linear_step[delayed-*] (x and W)
               cast_kernel<delayed=false> quantize_given_amax[current-*] (and x > 16M elements,
                                          after the amax pass: not at these shapes)
               cast_kernel<delayed=true>  quantize_dequantize[delayed-*], linear_step[delayed-*]
               empty_kernel               quantize_empty[current|delayed]
quantize_fp8_dequant.cu dequantize_kernel quantize_dequantize[current-*|delayed-*] (E4M3, E5M2;
                                          f32/bf16/f16 out), dequantize_misaligned_out[current]
quantize_fp8_block.cu quantize_kernel     quantize_dequantize[block-*] (1x128 and 128x128, E4M3
                                          and E5M2, f32/bf16/f16, row / col / both), linear_step
               quantize_pair_kernel<2D x 1D>  quantize_pair[block: x 1x128 with W 128x128, or
                                          two 1x128], linear_step[block-*] (x and W)
               dequantize_kernel          quantize_dequantize[block-*], dequantize_misaligned_out
quantize_mxfp8.cu quantize_kernel         quantize_dequantize[mxfp8-*] (vectorized; element-wise
                                          for the misaligned x; 1x32 and 32x32; E4M3 and E5M2)
               dequantize_kernel          quantize_dequantize[mxfp8-*] (vectorized),
                                          dequantize_misaligned_out[mxfp8] (element-wise)
               values_pair_kernel         gemm[mxfp8] (vectorized; element-wise with a misaligned
                                          operand), linear_step[mxfp8-*], cuda_graph_step[mxfp8]
quantize_nvfp4.cu small_kernel            quantize_dequantize[nvfp4-*] (<= 64K elements: RHT,
                                          2D, SR, 2D+SR, plain), linear_step[nvfp4-*]
               amax_kernel<vec, rht>      quantize_dequantize[nvfp4-*] (> 64K: 16-byte loads,
                                          4-byte loads with the RHT, element loads)
               cast_kernel<rht, 2d, sr>   quantize_dequantize[nvfp4-*] (> 64K), quantize_given_
                                          amax[nvfp4-*]; its rng-from-device-tensor path:
                                          quantize_dequantize[nvfp4-grad] and cuda_graph_step[nvfp4]
transpose.cu   transpose_kernel           transpose (word path: aligned rows; byte path: rows
                                          one byte off, an edge tile of odd width)
quantize_nvfp4_dequant.cu dequantize_kernel<values=false>  quantize_dequantize[nvfp4-*] (vec),
                                          dequantize_misaligned_out[nvfp4] (element-wise)
               dequantize_kernel<values=true>  c_api_gemm_alpha_and_values (tq_gemm_operand_values
                                          through ctypes; the extension asks for it on CPU only)
               values_pair_kernel         gemm[nvfp4] (+ misaligned operand), linear_step[nvfp4-*],
                                          cuda_graph_step[nvfp4]
Every __global__ function is reached, with every loader and the activation tables. Template
instances not reached: 14 of the 20 table instances of each block format's activation tile
pass (the other activations' tables), MXFP8 32x32 with E5M2 (the 2D blocks are for weights, which every recipe
quantizes to E4M3), and some (dtype, direction, E4M3 / E5M2) combinations of the per-tensor
casts, the block / MXFP8 quantize kernels and the dbias passes whose code the reached ones
share (a count against the extension's symbols: twenty-eighth session, NOTES.md).
Launch variants the cases here leave: tests/test_sanitize_more.py (current scaling above 16M
elements: amax pass then cast; E4M3 dbias; 8-row identity chunks; every block pair instance;
misaligned per-tensor pairs), test_sanitize_fused's norm_general_element_paths and
act_element_paths_and_amax_rewalk (monotone_amax_kernel's second walk; identity_columnwise_kernel
without dbias) and test_sanitize_gemm's block_gemm_own_kernel* (gemm_fp8_block.cu's
block_gemm_kernel<0|1|2> with TEQUANT_BLOCK_GEMM=tequant; <3>, E5M2 x E5M2, is refused before
any launch) and gemm_emulated_row_chunks.
"""
import itertools
import os

import pytest
import torch

import tequant as te
from tequant import _C
from tequant.quantized import COLUMNWISE, ROWWISE
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                            MXFP8BlockScaling, NVFP4BlockScaling, QParams)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device "
                                 "(run it under compute-sanitizer with tools/sanitize.sh)"),
              pytest.mark.gpu]

DEVICE = torch.device("cuda")
# torch's uncached allocator (set by tools/sanitize.sh for memcheck and initcheck) refuses to
# allocate while a CUDA graph is captured; the script runs the graph tests in a pass of their own.
NO_CACHING = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t")

RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),  # RHT on input / grad columnwise, 2D weights, SR on grads
}

# (recipe, role) per quantizer variant: every scaling, element format and flag combination.
QCASES = {
    "current-input": (RECIPES["current"], "input"),  # E4M3
    "current-grad": (RECIPES["current"], "grad_output"),  # E5M2 (HYBRID)
    "delayed-input": (RECIPES["delayed"], "input"),
    "delayed-grad": (RECIPES["delayed"], "grad_output"),
    "block-input": (RECIPES["block"], "input"),  # 1x128 E4M3
    "block-weight": (RECIPES["block"], "weight"),  # 128x128 E4M3
    "block-grad-e5m2": (Float8BlockScaling(fp8_format=Format.HYBRID), "grad_output"),
    "block-grad-2d-e5m2": (Float8BlockScaling(fp8_format=Format.HYBRID, w_block_scaling_dim=1,
                                              grad_block_scaling_dim=2), "grad_output"),
    "mxfp8-input": (RECIPES["mxfp8"], "input"),
    "mxfp8-weight-2d": (MXFP8BlockScaling(enable_2d_quantization=True), "weight"),
    "mxfp8-grad-e5m2": (MXFP8BlockScaling(fp8_format=Format.HYBRID), "grad_output"),
    "nvfp4-input": (RECIPES["nvfp4"], "input"),  # RHT
    "nvfp4-weight": (RECIPES["nvfp4"], "weight"),  # 16x16
    "nvfp4-grad": (RECIPES["nvfp4"], "grad_output"),  # RHT + SR
    "nvfp4-plain-input": (NVFP4BlockScaling(disable_rht=True), "input"),  # neither
    "nvfp4-plain-grad": (NVFP4BlockScaling(disable_rht=True), "grad_output"),  # SR alone
    "nvfp4-weight-2d-sr": (NVFP4BlockScaling(fp4_quant_fwd_weight=QParams(
        fp4_2d_quantization=True, stochastic_rounding=True)), "weight"),
}

# (M, K, dtype, layout, rowwise, columnwise) per family: small (the one-CTA kernels below 64K
# elements) and large (tiled; FP8 current scaling in one cooperative launch), full and partial
# tiles, each dtype, each
# direction alone and both, and each layout (see _layout).
_BOTH, _ROW, _COL = (True, True), (True, False), (False, True)
SHAPES = {
    "fp8": [(64, 128, BF16, "contiguous", *_BOTH), (33, 72, F32, "strided", *_BOTH),
            (257, 300, F16, "misaligned", *_BOTH), (256, 512, BF16, "contiguous", *_ROW),
            (128, 256, F32, "contiguous", *_COL), (16, 48, F16, "contiguous", *_ROW)],
    "mxfp8": [(64, 128, BF16, "contiguous", *_BOTH), (96, 160, F32, "strided", *_BOTH),
              (160, 288, F16, "misaligned", *_BOTH), (256, 384, BF16, "contiguous", *_ROW),
              (128, 64, F32, "contiguous", *_COL)],
    "nvfp4": [(64, 128, BF16, "contiguous", *_BOTH), (48, 80, F32, "strided", *_BOTH),
              (272, 320, F16, "misaligned", *_BOTH), (256, 512, BF16, "contiguous", *_BOTH),
              (144, 480, F32, "misaligned", *_COL), (32, 64, BF16, "contiguous", *_ROW)],
}
FAMILY = {"delayed": "fp8", "current": "fp8", "block": "fp8", "mxfp8": "mxfp8", "nvfp4": "nvfp4"}
# |dequantize(quantize(x)) - x| <= TOL * max|x|: loose bounds for a sanity check only
TOL = {"E4M3": 0.07, "E5M2": 0.13, "E2M1": 0.4}


# ---- helpers ----------------------------------------------------------------------------------

def _randn(*shape, dtype=F32, seed=0):
    """Normal values made on the CPU (no torch RNG kernel under the sanitizer), on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def _layout(x, layout):
    """The values of contiguous 2-D x in `layout`: 'contiguous' (x), 'strided' (rows 16-byte
    aligned, ld > K) or 'misaligned' (contiguous, one element past a 16-byte boundary: the
    element-wise paths). The buffers' other elements are never written."""
    m, k = x.shape
    if layout == "contiguous":
        return x
    if layout == "strided":
        buf = torch.empty(m, (k + 7) // 8 * 8 + 16, dtype=x.dtype, device=x.device)
        view = buf[:, :k]
    else:
        buf = torch.empty(m * k + 16, dtype=x.dtype, device=x.device)
        view = buf[1:1 + m * k].view(m, k)
    view.copy_(x)
    return view


def _misaligned_bytes(t):
    """A copy of a 1-byte-element tensor whose data starts one byte past a 16-byte boundary."""
    n = t.numel()
    buf = torch.empty(n + 16, dtype=torch.uint8, device=t.device)
    view = buf[1:1 + n]
    view.copy_(t.reshape(-1).view(torch.uint8))
    return view.view(t.dtype).view(t.shape)


def _touch_bytes(*ts):
    """Reads every byte of each tensor given (None skipped; initcheck: a byte no kernel wrote is
    an error)."""
    for t in ts:
        if t is not None and t.numel():
            torch.sum(t.contiguous().view(torch.uint8), dtype=torch.int64)


def _touch(q):
    """Reads every byte of every member of q."""
    _touch_bytes(*(getattr(q, name) for name in MEMBERS))


def _finite(*ts):
    for t in ts:
        assert bool(torch.isfinite(t).all()), "non-finite values"


def _check_values(q, x, direction):
    """The direction's values are finite and (unless RHT-transformed) close to x."""
    v = q.dequantize_direction(direction, F32)
    _finite(v)
    if direction == "columnwise" and q.config.rht:
        return
    ref = x.float() if direction == "rowwise" else x.float().t()
    err = float((v - ref).abs().max())
    assert err <= TOL[q.config.format] * float(ref.abs().max()), (direction, err)


def _extra(recipe, role, i):
    """te.ops.quantize's extra arguments: DelayedScaling's scale and amax slot; for stochastic
    rounding the default generator, a (seed, offset) pair or a device tensor in turn."""
    cfg = te.quantizer_config(recipe, role)
    if cfg.scaling == "delayed":
        return {"scale": torch.full((1,), 0.5, device=DEVICE),
                "amax_history": torch.zeros(1, device=DEVICE)}
    if cfg.stochastic_rounding:
        return [{}, {"rng": (7, 64 * i)},
                {"rng": torch.tensor([3, 4 + i], dtype=torch.int64, device=DEVICE)}][i % 3]
    return {}


# ---- amax, codecs, amax update ----------------------------------------------------------------

def test_amax_paths():
    for dtype in (F32, BF16, F16):
        x = _randn(39, 101, dtype=dtype, seed=1)  # 39 * 101: a tail after the 16-byte vectors
        want = x.float().abs().max()
        for layout in ("contiguous", "strided", "misaligned"):  # FlatVec, RowVec, Scalar
            out = torch.empty(1, device=DEVICE)
            _C._amax(_layout(x, layout), out)
            assert torch.equal(out[0], want), (dtype, layout)
    out = torch.empty(1, device=DEVICE)
    _C._amax(torch.empty(0, 8, device=DEVICE), out)  # nothing to launch: the zeroed output
    assert float(out) == 0.0


def test_transpose():
    """Both paths of the byte transpose, into outputs whose bytes start uninitialized: every
    byte of out must be written (initcheck), nothing outside the views touched (memcheck)."""
    codes = torch.arange(131 * 300, device=DEVICE).remainder(251).to(torch.uint8).view(131, 300)
    for layout in ("contiguous", "misaligned"):  # 4-byte words; bytes one off a word boundary
        x = _layout(codes, layout)
        out = torch.empty(x.shape[1], x.shape[0], dtype=torch.uint8, device=DEVICE)
        _C._transpose(x, out)
        assert torch.equal(out, x.t()), layout


CODECS = [("f32_to_e4m3", F32, torch.uint8), ("f32_to_e5m2", F32, torch.uint8),
          ("f32_to_e2m1", F32, torch.uint8), ("f32_to_e8m0", F32, torch.uint8),
          ("f32_to_bf16", F32, BF16), ("f32_to_f16", F32, F16),
          ("e4m3_to_f32", torch.uint8, F32), ("e5m2_to_f32", torch.uint8, F32),
          ("e2m1_to_f32", torch.uint8, F32), ("e8m0_to_f32", torch.uint8, F32)]


def test_codecs():
    values = _randn(24, 40, seed=2) * 10
    codes = torch.arange(24 * 40, device=DEVICE).remainder(256).to(torch.uint8).view(24, 40)
    for i, (name, src, dst) in enumerate(CODECS):
        x = values if src == F32 else codes
        x = _layout(x, "strided") if i % 2 else x  # row strides differ from the output's
        out = torch.empty(x.shape, dtype=dst, device=DEVICE)
        _C._codec(name, x, out)
        if name in ("f32_to_bf16", "f32_to_f16"):
            assert torch.equal(out, x.to(dst)), name
        elif name in ("e4m3_to_f32", "e5m2_to_f32"):
            fp8 = torch.float8_e4m3fn if name.startswith("e4m3") else torch.float8_e5m2
            torch.testing.assert_close(out, x.contiguous().view(fp8).float(), rtol=0, atol=0,
                                       equal_nan=True)
        else:  # read it all (initcheck)
            torch.sum(out.view(torch.uint8) if dst == torch.uint8 else out.nan_to_num())


def test_amax_update():
    n, length = 600, 4  # more slots than one launch takes (512)
    hist = _randn(length, n, seed=3).abs()
    scale = torch.ones(n, device=DEVICE)
    slots = [(hist[:, j:j + 1], scale[j:j + 1], 448.0) for j in range(n)]
    _C._amax_update(slots, length, "max", None)
    reduced = torch.rand(3, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    _C._amax_update(slots[:3], length, "most_recent", reduced)
    _finite(hist, scale)
    assert bool((scale > 0).all())
    # a history longer than the kernel holds in registers (1024): the roll by chunks
    long_hist, long_scale = _randn(1100, 2, seed=5).abs(), torch.ones(2, device=DEVICE)
    _C._amax_update([(long_hist[:, j:j + 1], long_scale[j:j + 1], 448.0) for j in range(2)], 1100,
                    "max", None)
    _finite(long_hist, long_scale)


# ---- quantize / dequantize --------------------------------------------------------------------

@pytest.mark.parametrize("name", list(QCASES))
def test_quantize_dequantize(name):
    recipe, role = QCASES[name]
    cfg = te.quantizer_config(recipe, role)
    for i, (m, k, dtype, layout, rowwise, columnwise) in enumerate(SHAPES[FAMILY[cfg.scaling]]):
        x = _randn(m, k, dtype=dtype, seed=100 + i)
        q = te.ops.quantize(_layout(x, layout), recipe, role, rowwise=rowwise,
                            columnwise=columnwise, **_extra(recipe, role, i))
        _touch(q)
        for direction, present in (("rowwise", rowwise), ("columnwise", columnwise)):
            if not present:
                continue
            _check_values(q, x, direction)
            if i == 0:  # the 16-bit outputs once per direction
                _finite(q.dequantize_direction(direction, BF16),
                        q.dequantize_direction(direction, F16))


@pytest.mark.parametrize("shape,dtype", [((8192, 2048), BF16), ((3001, 3001), F32)],
                         ids=["bf16-two-tiles-per-cta", "f32-up-to-three-ragged"])
def test_quantize_current_several_tiles(shape, dtype):
    # current scaling's cooperative cast where CTAs hold several tiles (H100 / H200: 4 bf16 CTAs
    # per SM, 2 float32): the stash of shared memory and the tiles loaded again after the barrier
    x = _randn(*shape, dtype=dtype, seed=13)
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        q = te.ops.quantize(x, RECIPES["current"], "input", rowwise=rowwise, columnwise=columnwise)
        _touch(q)
        _check_values(q, x, "rowwise" if rowwise else "columnwise")


@pytest.mark.parametrize("name", ["delayed-grad", "current-grad", "block-grad-e5m2",
                                  "mxfp8-grad-e5m2", "nvfp4-grad"])
def test_quantize_dbias(name):
    """tq_quantize with a dbias (csrc/core/quantize_dbias.c; tests/test_linear_dbias.py checks the
    bits): the identity pass (DelayedScaling: codes of both directions, amax and sums; current
    scaling: amax and sums after the memset, then the cast from that amax; the block formats:
    the sums alone, then their quantizer), dbias in float32 / bfloat16 / float16, every shape,
    layout and direction of the family, and M = 0."""
    recipe, role = QCASES[name]
    cfg = te.quantizer_config(recipe, role)
    for i, (m, k, dtype, layout, rowwise, columnwise) in enumerate(
            SHAPES[FAMILY[cfg.scaling]] + [(0, 64, BF16, "contiguous", *_BOTH)]):
        x = _layout(_randn(m, k, dtype=dtype, seed=300 + i), layout)
        delayed = cfg.scaling == "delayed"
        dbias = torch.empty(k, dtype=(F32, BF16, F16)[i % 3], device=DEVICE)
        members = _C._quantize(x, cfg, int(rowwise) | int(columnwise) << 1,
                               torch.full((1,), 0.5, device=DEVICE) if delayed else None,
                               torch.zeros(1, device=DEVICE) if delayed else None,
                               (9, 64 * i) if cfg.stochastic_rounding else None, None, dbias)
        _finite(dbias)
        for t in members:
            if t is not None and t.numel():
                torch.sum(t.contiguous().view(torch.uint8), dtype=torch.int64)


GIVEN = {"current-input": ("current", "input"), "current-grad": ("current", "grad_output"),
         "nvfp4-input": ("nvfp4", "input"), "nvfp4-weight": ("nvfp4", "weight"),
         "nvfp4-grad": ("nvfp4", "grad_output")}


@pytest.mark.parametrize("shapes", [((256, 512), (384, 512)), ((1000, 700), (333, 700)),
                                    ((8192, 2048), (512, 2048))],
                         ids=["one-tile-per-cta", "ragged", "up-to-three-tiles-per-cta"])
def test_quantize_pair(shapes):
    # two tensors' current scaling in one cooperative launch, delayed scaling in one launch with
    # the states' scales and slots, block scaling (x 1x128 with W 128x128, or two 1x128) in one
    # launch (tq_quantize_pair)
    x0, x1 = (_randn(*shape, dtype=BF16, seed=i) for i, shape in enumerate(shapes))
    for name, role in itertools.product(("current", "delayed", "block"), ("input", "grad_output")):
        config = te.quantizer_config(RECIPES[name], role)
        states = () if name != "delayed" else tuple(
            (torch.full((1,), s, device=DEVICE), torch.zeros(1, device=DEVICE)) for s in (2., 4.))
        w_config = te.quantizer_config(RECIPES[name], "weight") if role == "input" else config
        for members in _C._quantize_pair(x0, config, x1, w_config, *states):
            for m in members:
                if m is not None:  # every byte read (initcheck)
                    torch.sum(m.contiguous().view(torch.uint8), dtype=torch.int64).item()


def _dbias_cast(shape, name, seed, state=(None, None)):
    """A bf16 grad_output's cast with dbias (tq_quantize), every member and dbias read whole."""
    x = _randn(*shape, dtype=BF16, seed=seed)
    dbias = torch.empty(shape[1], dtype=BF16, device=DEVICE)
    cfg = te.quantizer_config(RECIPES[name], "grad_output")
    members = _C._quantize(x, cfg, 3, *state, None, None, dbias)
    _finite(dbias)
    for t in members:
        if t is not None:
            torch.sum(t.contiguous().view(torch.uint8), dtype=torch.int64).item()


@pytest.mark.parametrize("shape", [(256, 512), (1000, 700), (8192, 2048)],
                         ids=["one-tile-per-cta", "ragged", "up-to-three-tiles-per-cta"])
def test_quantize_dbias_one_launch(shape):
    # current scaling's cooperative cast of a bf16 grad_output that sums dbias itself
    _dbias_cast(shape, "current", seed=11)


@pytest.mark.parametrize("shape", [(3000, 1032), (300, 8000), (40000, 40)],
                         ids=["rows-16-ragged", "rows-16-wide", "rows-64"])
def test_quantize_dbias_delayed_groups(shape):
    # DelayedScaling's dbias pass with row chunks of 16 and 64 rows (groups of 16 and 32): a
    # lane's next four rows load while it converts the current ones, up to its chunk's end
    _dbias_cast(shape, "delayed", seed=12,
                state=(torch.full((1,), 0.5, device=DEVICE), torch.zeros(1, device=DEVICE)))


@pytest.mark.parametrize("name", list(GIVEN))
def test_quantize_given_amax(name):
    # a given amax skips the amax pass and the one-CTA kernel: the tiled cast alone
    recipe, role = RECIPES[GIVEN[name][0]], GIVEN[name][1]
    x = _randn(64, 128, dtype=BF16, seed=5)
    kw = {"rng": (5, 6)} if te.quantizer_config(recipe, role).stochastic_rounding else {}
    q = te.ops.quantize(x, recipe, role, rowwise=True, columnwise=True, **kw)
    amax = q.amax.reshape(1)
    if q.amax_t is not None:
        amax = torch.cat([amax, q.amax_t.reshape(1)])
    again = te.ops.quantize(x, recipe, role, rowwise=True, columnwise=True, amax=amax, **kw)
    _touch(again)
    for member in ("data", "data_t", "scale_inv", "scale_inv_t"):
        a, b = getattr(q, member), getattr(again, member)
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8)), member


@pytest.mark.parametrize("name", list(RECIPES))
def test_quantize_empty(name):
    recipe = RECIPES[name]
    for shape in ((0, 64), (32, 0)):
        x = torch.empty(shape, dtype=BF16, device=DEVICE)
        q = te.ops.quantize(x, recipe, "input", rowwise=True, columnwise=True,
                            **_extra(recipe, "input", 0))
        _touch(q)
        if q.scale_inv is not None and q.config.scaling in ("current", "delayed"):
            _finite(q.scale_inv)


MISALIGNED = {"current": ("current", "input"), "block-1d": ("block", "input"),
              "block-2d": ("block", "weight"), "mxfp8": ("mxfp8", "input"),
              "nvfp4": ("nvfp4", "input")}


@pytest.mark.parametrize("name", list(MISALIGNED))
def test_dequantize_misaligned_out(name):
    # an output one element off a 16-byte boundary: the element-wise stores, same values
    recipe, role = RECIPES[MISALIGNED[name][0]], MISALIGNED[name][1]
    q = te.ops.quantize(_randn(64, 128, dtype=BF16, seed=6), recipe, role, rowwise=True,
                        columnwise=True)
    for direction, usage in (("rowwise", ROWWISE), ("columnwise", COLUMNWISE)):
        shape = (q.rows, q.cols) if usage == ROWWISE else (q.cols, q.rows)
        for dtype in (F32, BF16):
            want = q.dequantize_direction(direction, dtype)
            out = _layout(torch.zeros(shape, dtype=dtype, device=DEVICE), "misaligned")
            _C._dequantize(q.config, q.rows, q.cols, q._members(), usage, out)
            assert torch.equal(out, want), (direction, dtype)


# ---- te.Linear under te.autocast, and CUDA graphs ---------------------------------------------

LINEAR = {"delayed-bf16": ("delayed", BF16), "current-bf16": ("current", BF16),
          "current-f16": ("current", F16), "block-bf16": ("block", BF16),
          "mxfp8-bf16": ("mxfp8", BF16), "mxfp8-f16": ("mxfp8", F16),
          "nvfp4-bf16": ("nvfp4", BF16), "nvfp4-f32": ("nvfp4", F32)}


@pytest.mark.parametrize("case", list(LINEAR))
def test_linear_step(case):
    name, dtype = LINEAR[case]
    recipe = RECIPES[name]
    torch.manual_seed(0)
    layer = te.Linear(128, 96, bias=True, params_dtype=dtype, device=DEVICE)
    # 51 tokens: padded to the format's multiple; the third input starts one element off a
    # 16-byte boundary (the pad kernel's byte path); DelayedScaling updates after each step
    for step, layout in enumerate(("contiguous", "contiguous", "misaligned")):
        x = _layout(_randn(51, 128, dtype=dtype, seed=20 + step), layout)
        x = x.view(3, 17, 128).detach().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with te.autocast(recipe=recipe):
            y = layer(x)
        y.float().square().mean().backward()
        assert y.shape == (3, 17, 96)
        _finite(y, x.grad, layer.weight.grad, layer.bias.grad)
    if name == "delayed":
        _finite(layer.delayed_scale_fwd, layer.delayed_scale_bwd)


@pytest.mark.parametrize("name", list(RECIPES))
def test_cuda_graph_step(name):
    if NO_CACHING:
        pytest.skip("torch's uncached allocator cannot allocate during a capture "
                    "(tools/sanitize.sh runs the graph tests with caching on)")
    recipe = RECIPES[name]  # NVFP4 with stochastic rounding: the rng is drawn inside the graph
    torch.manual_seed(0)
    layer = te.Linear(128, 64, params_dtype=BF16, device=DEVICE)
    opt = torch.optim.SGD(layer.parameters(), lr=0.01)
    static_x = _randn(50, 128, dtype=BF16, seed=30)

    def step():
        opt.zero_grad(set_to_none=True)
        with te.autocast(recipe=recipe):
            y = layer(static_x)
        y.float().square().mean().backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(2):
        static_x.copy_(_randn(50, 128, dtype=BF16, seed=31 + i))
        graph.replay()
    torch.cuda.synchronize()
    _finite(*layer.parameters())
