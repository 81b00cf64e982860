"""NVFP4 quantizer (NUMERICS.md 2 "NVFP4", TE_REFERENCE A.5): round to nearest, 1x16 and 16x16
blocks. The CPU reference (csrc/ref/quantize_nvfp4_ref.c) is compared bit for bit (codes, E4M3
scale bytes, amaxes, dequantized values) with an independent torch reference written here on top
of tests/reference.py; the CUDA kernels (cuda/quantize_nvfp4*.cu) with the CPU reference.
RHT and stochastic rounding: tests/test_quantize_nvfp4_rht_sr.py (it reuses the helpers below).
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import tequant as te  # noqa: E402
from reference import (FLT_MAX, e2m1_codes, e2m1_stochastic, e2m1_values, fp8_bits,  # noqa: E402
                       fp8_values, rht_columnwise, sr_bytes)
from tequant.recipe import NVFP4BlockScaling, QParams  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HAS_CUDA = torch.cuda.is_available()


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")(test))


# ---- the independent torch reference ------------------------------------------------------

F32 = torch.float32
RCP_6 = torch.tensor(1 / 6, dtype=F32)  # RN(1/6): Python's double rounded once to fp32
RCP_2688 = torch.tensor(1 / 2688, dtype=F32)


def nan_abs(v):
    return torch.where(v.isnan(), torch.zeros_like(v), v.abs())


def global_amax(v):
    return nan_abs(v).max() if v.numel() else torch.tensor(0.0)


def s_enc_of(amax):
    s_enc = torch.tensor(2688.0) / amax
    s_enc = torch.clamp(s_enc, max=FLT_MAX)
    if amax == 0 or s_enc == 0:
        s_enc = torch.tensor(1.0)
    return s_enc


def nvfp4_reference(v, amax, two_d=False, u=None):
    """Quantizes the float32 values v [R, C] of one direction with global amax `amax`:
    (codes [R, C], E4M3 scale bytes [R, C/16]); u: random bytes [R, C] for stochastic rounding."""
    rows, cols = v.shape
    s_enc = s_enc_of(amax)
    s_dec = torch.tensor(1.0) / s_enc
    s_enc_div6 = s_enc * RCP_6
    a = nan_abs(v)
    if two_d:
        bamax = a.reshape(rows // 16, 16, cols // 16, 16).amax(dim=(1, 3)).repeat_interleave(16, 0)
    else:
        bamax = a.reshape(rows, cols // 16, 16).amax(dim=-1)
    s_b = fp8_bits(torch.clamp(bamax * s_enc_div6, max=FLT_MAX), "E4M3")
    enc = torch.clamp(torch.ones_like(bamax) / (fp8_values(s_b, "E4M3") * s_dec), max=FLT_MAX)
    scaled = v * enc.repeat_interleave(16, 1)
    codes = e2m1_codes(scaled) if u is None else e2m1_stochastic(scaled, u)
    return codes, s_b


def nvfp4_dequant_reference(codes, s_b, amax):
    dec = (fp8_values(s_b, "E4M3") * amax) * RCP_2688
    return e2m1_values(codes) * dec.repeat_interleave(16, 1)


def direction_values(x, direction, rht):
    """The float32 matrix a direction quantizes: x [M, K], x^T, or RN_bf16(RHT) of x^T."""
    if direction == "rowwise":
        return x.float()
    return rht_columnwise(x) if rht else x.float().t()


# ---- recipes for each combination -----------------------------------------------------------

def recipe_role(rht=False, sr=False, two_d=False):
    """(recipe, role) whose quantizer has exactly these NVFP4 options."""
    if two_d:
        return NVFP4BlockScaling(disable_rht=True, fp4_quant_fwd_weight=QParams(
            fp4_2d_quantization=True, stochastic_rounding=sr)), "weight"
    return NVFP4BlockScaling(disable_rht=not rht, fp4_quant_bwd_grad=QParams(
        random_hadamard_transform=rht, stochastic_rounding=sr)), "grad_output"


def quantize(x, rht=False, sr=False, two_d=False, rowwise=True, columnwise=True, rng=(0, 0)):
    recipe, role = recipe_role(rht, sr, two_d)
    q = te.ops.quantize(x, recipe, role, rowwise=rowwise, columnwise=columnwise, rng=rng)
    cfg = q.config
    assert (cfg.rht, cfg.stochastic_rounding, cfg.two_d) == (rht, sr, two_d)
    return q


def f32_bits(t):
    return t.detach().cpu().float().reshape(-1).view(torch.int32)


def same_values(a, b):
    """Bit-equal, except that any NaN matches any NaN (NaN payloads differ between CPU and GPU)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    int_dtype = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    keep = ~nan_a
    return torch.equal(nan_a, nan_b) and torch.equal(a[keep].view(int_dtype), b[keep].view(int_dtype))


def check_reference(x, rht=False, sr=False, two_d=False, rowwise=True, columnwise=True,
                    rng=(1234, 5678), dequant_dtypes=(torch.float32,)):
    """Quantizes x on CPU and checks every member bit for bit against the torch reference."""
    q = quantize(x, rht, sr, two_d, rowwise, columnwise, rng)
    directions = [d for d, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on]
    for direction in directions:
        v = direction_values(x, direction, rht)
        amax = global_amax(v)
        got_amax = q.amax if direction == "rowwise" else q.amax_t
        assert got_amax.shape == (1, 1)
        assert torch.equal(f32_bits(got_amax), f32_bits(amax)), (direction, got_amax, amax)
        u = sr_bytes(rng[0], rng[1], v.numel()).reshape(v.shape) if sr else None
        codes, s_b = nvfp4_reference(v, amax, two_d, u)
        assert torch.equal(q.codes(direction), codes), direction
        assert torch.equal(q.scales(direction).view(torch.uint8), s_b), direction
        want = nvfp4_dequant_reference(codes, s_b, amax)
        for dtype in dequant_dtypes:
            got = q.dequantize_direction(direction, dtype)
            assert same_values(got, want.to(dtype)), (direction, dtype)
    return q


# ---- inputs ---------------------------------------------------------------------------------

def values(kind, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    if kind == "randn":
        x = torch.randn(shape, generator=g) * 3
    elif kind == "ramp":  # many scales: every block has a different amax
        x = torch.linspace(-1, 1, m * k).reshape(shape) * torch.logspace(-6, 4, m * k).reshape(shape)
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "outlier":
        x = torch.randn(shape, generator=g)
        x[m // 3, k // 2] = 3e4
    elif kind == "nan_inf":
        x = torch.randn(shape, generator=g)
        x[0, 1] = float("nan")
        x[m - 1, k - 1] = float("inf")
        x[m // 2, 0] = float("-inf")
    elif kind == "nan":  # NaN without Inf: finite scales, NaN elements encode as +6
        x = torch.randn(shape, generator=g)
        x[0, :3] = float("nan")
        x[m - 1, k // 2] = float("nan")
    elif kind == "negative":
        x = -torch.rand(shape, generator=g) - 0.5
    elif kind == "max":
        x = torch.full(shape, torch.finfo(dtype).max, dtype=dtype)
        x[:, 1::2] *= -1
    elif kind == "tiny":  # tiny block amaxes: E4M3 subnormal and zero block scales
        x = torch.randn(shape, generator=g)
        x[1:] *= 1e-6
    else:
        raise ValueError(kind)
    return x.to(dtype)


KINDS = ["randn", "ramp", "zeros", "outlier", "nan_inf", "nan", "negative", "max", "tiny"]
SHAPES = [(16, 16), (16, 32), (32, 16), (48, 80), (128, 128), (16, 1024), (1024, 16),
          (256, 272), (304, 304), (320, 256)]
# The CUDA quantizer runs a tensor of at most 64K elements in one CTA (both passes in one
# launch) and larger ones in two launches of tiles: the value and layout cases run on both.
PATHS = {"one_cta": (48, 160), "tiled": (272, 272)}


# ---- CPU reference vs torch reference ------------------------------------------------------

@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_matches_torch_reference_randn(shape, dtype, two_d):
    check_reference(values("randn", shape, dtype, seed=shape[0] + shape[1]), two_d=two_d)


@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_matches_torch_reference_values(kind, dtype, two_d):
    x = values(kind, (48, 64), dtype)
    check_reference(x, two_d=two_d, dequant_dtypes=(torch.float32, torch.bfloat16, torch.float16))


@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
def test_cpu_single_direction(usage):
    x = values("randn", (64, 96), torch.bfloat16)
    q = check_reference(x, rowwise=usage == "rowwise", columnwise=usage == "columnwise")
    assert q.has(usage) and not q.has("columnwise" if usage == "rowwise" else "rowwise")


def test_cpu_strided_rows():
    """x[:, :cols] of a wider tensor: row stride > cols."""
    wide = values("randn", (64, 160), torch.bfloat16)
    x = wide[:, :128]
    assert x.stride(0) == 160
    q = check_reference(x)
    q2 = quantize(x.contiguous())
    for member in ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t"):
        assert torch.equal(getattr(q, member).view(torch.uint8), getattr(q2, member).view(torch.uint8))


@pytest.mark.parametrize("rows", [16, 32])
def test_cpu_boundary_linspace(rows):
    """TE's boundary test: a row of linspace(-12, 12) +- 1e-3, repeated."""
    base = torch.linspace(-12, 12, 128)
    x = torch.stack([base + (1e-3 if r % 3 == 0 else -1e-3 if r % 3 == 1 else 0.0)
                     for r in range(rows)])
    for dtype in (torch.float32, torch.bfloat16):
        check_reference(x.to(dtype))
        check_reference(x.to(dtype), two_d=True)


def test_cpu_exact_ties():
    """Global amax 2688 gives S_enc = 1 and blocks of amax 6 an encode factor of exactly 1, so
    E2M1's ties (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) reach the element rounding unchanged and
    must go to the even mantissa."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    block = torch.cat([ties, -ties])
    x = block.repeat(16, 4)
    x[0, :16] = 0.0
    x[0, 0] = 2688.0
    q = check_reference(x, columnwise=False)
    codes = q.codes("rowwise")[1, :16]
    # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, 6->6 (magnitudes), sign in bit 3
    want = torch.tensor([0, 2, 2, 4, 4, 6, 6, 7], dtype=torch.uint8)
    assert torch.equal(codes, torch.cat([want, want | 8]))
    assert float(q.scales("rowwise")[1, 0].float()) == 1.0


def test_cpu_block_scale_formula_is_v2_14():
    """s_b = E4M3(RN(amax_b * RN(S_enc * RN(1/6)))) (TE >= 2.14), not RN(RN(amax_b / 6) * S_enc)
    (TE <= 2.13): these block amaxes (global amax 10) sit where the two formulas land on
    opposite sides of an E4M3 rounding midpoint."""
    amax_bits = [0x39D92492, 0x3A592492, 0x3AD92492, 0x39200000]
    new_rule, old_rule = [10, 18, 26, 4], [9, 17, 25, 3]  # E4M3 bytes of each formula
    x = torch.zeros(16, 80)
    x[0, 0] = 10.0
    for b, bits in enumerate(amax_bits):
        x[:, 16 * (b + 1)] = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    q = check_reference(x, columnwise=False)
    got = q.scales("rowwise").view(torch.uint8)[1, 1:].tolist()
    assert got == new_rule and got != old_rule


def test_2d_directions_are_transposes():
    x = values("randn", (64, 96), torch.float32)
    q = quantize(x, two_d=True)
    assert torch.equal(q.codes("columnwise"), q.codes("rowwise").t())
    s_row = q.scales("rowwise").view(torch.uint8)  # [64, 6], tile scale repeated on 16 rows
    s_col = q.scales("columnwise").view(torch.uint8)  # [96, 4]
    tiles = s_row[::16]  # [4, 6]
    assert torch.equal(s_row, tiles.repeat_interleave(16, 0))
    assert torch.equal(s_col, tiles.t().repeat_interleave(16, 0))
    assert torch.equal(f32_bits(q.amax), f32_bits(q.amax_t))


def test_1d_blocks_differ_from_2d():
    """Guards the 2D flag: on data whose rows differ in scale, 1x16 and 16x16 scales differ."""
    x = values("ramp", (32, 32), torch.float32)
    assert not torch.equal(quantize(x).scales("rowwise").view(torch.uint8),
                           quantize(x, two_d=True).scales("rowwise").view(torch.uint8))


def test_dequantize_is_close_to_input():
    x = values("randn", (128, 256), torch.float32)
    q = quantize(x)
    for direction, ref in (("rowwise", x), ("columnwise", x.t())):
        err = (q.dequantize_direction(direction) - ref).norm() / ref.norm()
        assert 0 < err < 0.15, (direction, err)


@pytest.mark.parametrize("shape", [(15, 16), (16, 24), (8, 8)])
def test_shapes_not_multiple_of_16_are_rejected(shape):
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize(torch.randn(shape))


def test_empty_tensor():
    q = quantize(torch.zeros(0, 32))
    assert q.data.numel() == 0 and float(q.amax) == 0.0
    assert q.codes("columnwise").shape == (32, 0)


# ---- CUDA vs CPU reference ------------------------------------------------------------------

MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t")


def on_cuda(make):
    """make(device) on CPU and on CUDA: the same view (strides, offset) on both devices."""
    return make("cpu"), make("cuda")


def check_cuda_matches_cpu(x_cpu, rht=False, sr=False, two_d=False, rowwise=True,
                           columnwise=True, rng=(99, 7), stream=None, dequant=True, x_gpu=None):
    if x_gpu is None:
        x_gpu = x_cpu.cuda()
    assert x_gpu.stride() == x_cpu.stride() and same_values(x_gpu, x_cpu)
    if stream is None:
        q_gpu = quantize(x_gpu, rht, sr, two_d, rowwise, columnwise, rng)
    else:
        with torch.cuda.stream(stream):
            q_gpu = quantize(x_gpu, rht, sr, two_d, rowwise, columnwise, rng)
        stream.synchronize()
    q_cpu = quantize(x_cpu, rht, sr, two_d, rowwise, columnwise, rng)
    for member in MEMBERS:
        a, b = getattr(q_cpu, member), getattr(q_gpu, member)
        if a is None:
            assert b is None, member
            continue
        assert b.is_cuda
        assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), member
    if dequant:
        for direction in [d for d, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on]:
            for dtype in DTYPES:
                assert same_values(q_gpu.dequantize_direction(direction, dtype),
                                   q_cpu.dequantize_direction(direction, dtype)), (direction, dtype)
    return q_gpu


@gpu
@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(2048, 2048), (1024, 2048), (2048, 1024), (272, 4112)])
def test_cuda_matches_cpu_shapes(shape, dtype, two_d):
    check_cuda_matches_cpu(values("randn", shape, dtype, seed=shape[0]), two_d=two_d)


@gpu
@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", list(PATHS))
def test_cuda_matches_cpu_values(path, kind, dtype, two_d):
    check_cuda_matches_cpu(values(kind, PATHS[path], dtype), two_d=two_d)


@gpu
@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
@pytest.mark.parametrize("path", list(PATHS))
def test_cuda_single_direction(path, usage):
    check_cuda_matches_cpu(values("randn", PATHS[path], torch.bfloat16),
                           rowwise=usage == "rowwise", columnwise=usage == "columnwise")


@gpu
@pytest.mark.parametrize("rows", [48, 272], ids=["one_cta", "tiled"])
def test_cuda_strided_rows_and_stream(rows):
    wide = values("randn", (rows, 400), torch.bfloat16)
    x = wide.cuda()[:, :384]
    q = quantize(x)
    q_ref = quantize(wide[:, :384])
    for member in MEMBERS:
        assert torch.equal(getattr(q, member).cpu().view(torch.uint8),
                           getattr(q_ref, member).view(torch.uint8)), member
    shape = (rows - 16, 512 if rows > 48 else 64)
    check_cuda_matches_cpu(values("randn", shape, torch.float32), stream=torch.cuda.Stream())
    check_cuda_matches_cpu(values("randn", shape, torch.float32), two_d=True,
                           stream=torch.cuda.Stream())


@gpu
def test_cuda_empty():
    q = quantize(torch.zeros(0, 64, device="cuda"))
    assert q.data.numel() == 0 and float(q.amax) == 0.0 and float(q.amax_t) == 0.0


@gpu
@pytest.mark.parametrize("shape,two_d", [((8192, 8192), False), ((4096, 8192), True),
                                         ((8208, 1040), False)])
def test_cuda_large(shape, two_d):
    check_cuda_matches_cpu(values("randn", shape, torch.bfloat16, seed=3), two_d=two_d,
                           dequant=False)
