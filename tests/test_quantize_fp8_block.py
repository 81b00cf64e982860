"""FP8 block scaling (Float8BlockScaling): 1x128 blocks (inputs, grads) and 128x128 tiles (weights).

The CPU reference (csrc/ref/quantize_fp8_block_ref.c) is compared BIT FOR BIT with a reference
written here in torch ops (tests/reference.py codecs: torch's float8 casts, frexp pow2 floor), on
a shape sweep (partial blocks, TE's shapes, strided rows) and a value sweep (randn, TE-style
many-scales ramps, zeros, outliers, NaN/Inf, negatives, all-max, subnormals). Whole members are
compared, scale padding included (it must be 0). The CUDA kernels (cuda/quantize_fp8_block.cu)
are compared bit for bit with the CPU reference on the GPU machine (tests marked gpu).
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import FLT_MAX, fp8_bits, fp8_values, scale_from_amax  # noqa: E402

import tequant as te  # noqa: E402
from tequant.recipe import Float8BlockScaling, Format, QParams  # noqa: E402

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INPUT_MAX = {torch.float32: FLT_MAX, torch.bfloat16: float.fromhex("0x1.FEp127"),
             torch.float16: 65504.0}
B = 128
DEFAULT = Float8BlockScaling()
HYBRID = Float8BlockScaling(fp8_format=Format.HYBRID)
F32_SCALES = Float8BlockScaling(use_f32_scales=True)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The torch references here are small: on the 2-core CI machine under load, torch's
    intra-op threads only contend (about 10x slower). Restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cdiv(a, b):
    return -(-a // b)


def pad4(a):
    return cdiv(a, 4) * 4


def ibits(t):
    return t.detach().cpu().contiguous().view(torch.int32)


# ---------------------------------------------------------------------------------------------
# The independent reference (torch ops only)

def _block_amax(xf, tile_rows, tile_cols):
    """max |x| over tile_rows x tile_cols tiles of float32 xf, NaN ignored, zero padding."""
    m, k = xf.shape
    nm, nk = cdiv(m, tile_rows), cdiv(k, tile_cols)
    a = xf.abs()
    a = torch.where(a.isnan(), torch.zeros_like(a), a)
    a = F.pad(a, (0, nk * tile_cols - k, 0, nm * tile_rows - m))
    return a.reshape(nm, tile_rows, nk, tile_cols).amax(dim=(1, 3))


def scaled(v, s):
    """RN(v * s) with NaN products made the positive NaN, as CUDA's multiply (and formats.h's
    tq_mul) give them: a NaN element's code is 0x7F whatever its sign (TE's GPU result)."""
    p = v * s
    return torch.where(p.isnan(), torch.full_like(p, float("nan")), p)


def _quantize_blocks(xf, tile_rows, tile_cols, fmt, fmax, eps, pow2, vinf):
    """(codes [m, k] uint8, scale_inv [nm, nk] float32) of xf with one scale per tile."""
    m, k = xf.shape
    scale = scale_from_amax(_block_amax(xf, tile_rows, tile_cols), fmax, eps, pow2, vinf)
    full = scale.repeat_interleave(tile_rows, 0).repeat_interleave(tile_cols, 1)[:m, :k]
    return fp8_bits(scaled(xf, full), fmt), torch.ones_like(scale) / scale


def reference(x, config, rowwise, columnwise):
    """The members te.ops.quantize must produce, as a dict, in tequant.h's layouts."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    xf = x2.float().cpu()
    m, k = xf.shape
    args = dict(fmt=config.format, fmax=config.fmax, eps=config.amax_epsilon,
                pow2=config.power_2_scale, vinf=INPUT_MAX[x.dtype])
    out = {}
    if config.two_d:
        codes, s = _quantize_blocks(xf, B, B, **args)  # s: [ceil(m/128), ceil(k/128)]
        nm, nk = s.shape
        if rowwise:
            out["data"] = codes
            out["scale_inv"] = torch.zeros(nm, pad4(nk))
            out["scale_inv"][:, :nk] = s
            out["scales_rowwise"] = s
        if columnwise:
            out["data_t"] = codes.t().contiguous()
            out["scale_inv_t"] = torch.zeros(nk, pad4(nm))
            out["scale_inv_t"][:, :nm] = s.t()
            out["scales_columnwise"] = s.t()
        return out
    if rowwise:
        codes, s = _quantize_blocks(xf, 1, B, **args)  # s: [m, ceil(k/128)]
        out["data"] = codes
        out["scale_inv"] = torch.zeros(cdiv(k, B), pad4(m))
        out["scale_inv"][:, :m] = s.t()
        out["scales_rowwise"] = s
    if columnwise:
        codes_t, s_t = _quantize_blocks(xf.t(), 1, B, **args)  # blocks of 128 rows of x
        out["data_t"] = codes_t
        out["scale_inv_t"] = torch.zeros(cdiv(m, B), pad4(k))
        out["scale_inv_t"][:, :k] = s_t.t()
        out["scales_columnwise"] = s_t
    return out


def reference_dequantize(codes, scales_compact, config, dtype):
    """RN(fp8 * scale_inv of the element's block) in float32, then RNE to dtype.
    scales_compact is the direction's compact [rows, blocks] (1D) or [tiles, tiles] (2D)."""
    v = fp8_values(codes.cpu(), config.format)
    r, c = v.shape
    if config.two_d:
        s = scales_compact.repeat_interleave(B, 0).repeat_interleave(B, 1)[:r, :c]
    else:
        s = scales_compact.repeat_interleave(B, 1)[:, :c]
    return scaled(v, s).to(dtype)


def assert_same_values(got, want, what):
    """Bit-equal except NaN, whose payload torch's narrowing does not keep: NaN where want is."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, what
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN positions differ"
    g = torch.where(nan, torch.zeros_like(got), got)
    w = torch.where(nan, torch.zeros_like(want), want)
    int_dtype = torch.int32 if got.dtype == torch.float32 else torch.int16
    bad = (g.view(int_dtype) != w.view(int_dtype)).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}: " \
                             f"got {g[tuple(bad[0])].item()!r}, want {w[tuple(bad[0])].item()!r}"


def assert_bits(got, want, what):
    got, want = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.dtype == torch.float32:
        got, want = got.view(torch.int32), want.view(torch.int32)
    else:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} entries differ, first at {bad[0].tolist()}: " \
                             f"got {got[tuple(bad[0])].item():#x}, want {want[tuple(bad[0])].item():#x}"


def check_against_reference(x, recipe=DEFAULT, role="input", rowwise=True, columnwise=True,
                            dequant_dtypes=(torch.float32,)):
    q = te.ops.quantize(x, recipe, role=role, rowwise=rowwise, columnwise=columnwise)
    want = reference(x, q.config, rowwise, columnwise)
    assert q.amax is None and q.amax_t is None
    for name in ("data", "scale_inv", "data_t", "scale_inv_t"):
        if name in want:
            assert_bits(getattr(q, name), want[name], name)
        else:
            assert getattr(q, name) is None, name
    for direction in ("rowwise", "columnwise"):
        if not q.has(direction):
            continue
        assert_bits(q.scales(direction), want["scales_" + direction], f"scales({direction})")
        codes = want["data" if direction == "rowwise" else "data_t"]
        assert_bits(q.codes(direction), codes, f"codes({direction})")
        for dtype in dequant_dtypes:
            assert_same_values(q.dequantize_direction(direction, dtype),
                               reference_dequantize(codes, want["scales_" + direction], q.config, dtype),
                               f"dequantize {direction} {dtype}")
    return q


# ---------------------------------------------------------------------------------------------
# Inputs

def many_scales(shape, dtype, seed=0, tile_rows=1, tile_cols=B):
    """TE's initialize_for_many_scales in spirit: a ramp scaled per tile by a power of two in
    [2^-24, 2^13], with the tile's extreme exactly at +-8192 * 2^-j somewhere; |x| <= 8192."""
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    ramp = torch.linspace(-1, 1, m * k).reshape(m, k)
    ramp = ramp[torch.randperm(m, generator=g)][:, torch.randperm(k, generator=g)]
    nm, nk = cdiv(m, tile_rows), cdiv(k, tile_cols)
    exps = torch.randint(-24, 14, (nm, nk), generator=g).float()
    factor = torch.exp2(exps).repeat_interleave(tile_rows, 0).repeat_interleave(tile_cols, 1)[:m, :k]
    return (ramp * factor).to(dtype)


def values(kind, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    finfo = torch.finfo(dtype)
    if kind == "randn":
        return torch.randn(shape, generator=g).to(dtype)
    if kind == "ramp":
        return torch.linspace(-3, 5, m * k).reshape(shape).to(dtype)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "negative":
        return (-torch.rand(shape, generator=g) * 100 - 1e-3).to(dtype)
    if kind == "all max":
        return torch.full(shape, finfo.max, dtype=dtype)
    if kind == "outlier":
        x = torch.randn(shape, generator=g).to(dtype)
        x[m // 2, k // 3] = finfo.max / 2
        return x
    if kind == "nan inf":
        x = torch.randn(shape, generator=g)
        n = m * k
        idx = torch.randperm(n, generator=g)[: max(3, n // 50)]
        flat = x.view(-1)
        flat[idx[0::3]] = float("nan")
        flat[idx[1::3]] = float("inf")
        flat[idx[2::3]] = float("-inf")
        flat[idx[0]] = -float("nan")
        return x.to(dtype)
    if kind == "subnormal":  # amax so small that fmax / amax overflows: value_for_inf
        x = torch.randn(shape, generator=g) * finfo.smallest_normal / 8
        return x.to(dtype)
    if kind == "many scales":
        return many_scales(shape, dtype, seed)
    raise ValueError(kind)


SHAPES = [(1, 1), (1, 129), (129, 1), (7, 50), (128, 128), (127, 129), (130, 256), (256, 272),
          (303, 300), (305, 256), (1024, 4), (3, 1000)]
VALUE_KINDS = ["randn", "ramp", "zeros", "negative", "all max", "outlier", "nan inf", "subnormal",
               "many scales"]


# ---------------------------------------------------------------------------------------------
# CPU reference vs the torch reference

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("role", ["input", "weight"])  # 1x128 and 128x128
def test_shapes(shape, dtype, role):
    x = many_scales(shape, dtype, seed=shape[0] * 7 + shape[1],
                    tile_rows=B if role == "weight" else 1)
    check_against_reference(x, role=role)
    check_against_reference(values("randn", shape, dtype), role=role)


@pytest.mark.parametrize("kind", VALUE_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("role", ["input", "weight"])
def test_values(kind, dtype, role):
    x = values(kind, (200, 300), dtype)
    check_against_reference(x, role=role, dequant_dtypes=DTYPES)


@pytest.mark.parametrize("kind", ["randn", "many scales", "subnormal", "all max", "zeros"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("role", ["input", "weight"])
def test_fp32_scales(kind, dtype, role):
    """use_f32_scales: the scale keeps its mantissa; value_for_inf then differs per dtype."""
    q = check_against_reference(values(kind, (130, 260), dtype), F32_SCALES, role,
                                dequant_dtypes=DTYPES)
    assert not q.config.power_2_scale


def test_value_for_inf_is_the_input_dtype_max():
    """A tiny block: fmax / amax overflows and the scale is the input dtype's max (fp32 scales)."""
    for dtype, want in ((torch.float32, FLT_MAX), (torch.bfloat16, float.fromhex("0x1.FEp127"))):
        x = torch.full((1, 128), 1e-40).to(dtype)
        q = te.ops.quantize(x, F32_SCALES)
        assert q.scales().item() == (1 / torch.tensor(want, dtype=torch.float32)).item()
    q = te.ops.quantize(torch.full((1, 128), 1e-40), DEFAULT)  # pow2: 2^127
    assert q.scales().item() == 2.0**-127


@pytest.mark.parametrize("role", ["grad_output", "grad_input", "input"])
@pytest.mark.parametrize("kind", ["randn", "many scales", "nan inf", "all max"])
def test_hybrid_e5m2(role, kind):
    q = check_against_reference(values(kind, (150, 400), torch.bfloat16), HYBRID, role)
    assert q.config.format == ("E4M3" if role == "input" else "E5M2")


def test_hybrid_weight_stays_e4m3_2d():
    q = check_against_reference(values("randn", (300, 200), torch.float32), HYBRID, "weight")
    assert q.config.format == "E4M3" and q.config.two_d


def test_amax_epsilon():
    eps = 0.5
    recipe = Float8BlockScaling(fp8_quant_fwd_inp=QParams(power_2_scale=False, amax_epsilon=eps),
                                fp8_quant_fwd_weight=QParams(power_2_scale=True, amax_epsilon=eps))
    x = values("randn", (140, 300), torch.float32) * 0.01
    x[:, 128:256] = 0
    q = check_against_reference(x, recipe, "input")
    assert q.config.amax_epsilon == eps
    # zero blocks: amax raised to eps, scale 448 / 0.5 = 896
    assert torch.all(q.scales()[:, 1] == 1 / 896.0)
    check_against_reference(x, recipe, "weight")


@pytest.mark.parametrize("role", ["input", "weight"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_rows(role, dtype):
    wide = values("many scales", (260, 411), dtype)
    x = wide[:, 3:300]  # row stride 411 > cols, unaligned start
    assert x.stride(0) == 411 and not x.is_contiguous()
    q = check_against_reference(x, role=role)
    q_contig = te.ops.quantize(x.contiguous(), role=role, recipe=DEFAULT, rowwise=True, columnwise=True)
    for name in ("data", "scale_inv", "data_t", "scale_inv_t"):
        assert torch.equal(getattr(q, name).view(torch.uint8), getattr(q_contig, name).view(torch.uint8))


@pytest.mark.parametrize("role", ["input", "weight"])
def test_single_direction(role):
    x = values("many scales", (200, 333), torch.bfloat16)
    check_against_reference(x, role=role, rowwise=True, columnwise=False)
    check_against_reference(x, role=role, rowwise=False, columnwise=True)
    q = te.ops.quantize(x, DEFAULT, role=role, rowwise=False, columnwise=True)
    # dequantize() falls back to the columnwise data, transposed back
    assert torch.equal(q.dequantize(), q.dequantize_direction("columnwise").t())


def test_directions_are_independent_1d_and_shared_2d():
    x = values("many scales", (256, 256), torch.float32)
    q1 = te.ops.quantize(x, DEFAULT, "input", rowwise=True, columnwise=True)
    q2 = te.ops.quantize(x, DEFAULT, "weight", rowwise=True, columnwise=True)
    assert q1.scales("rowwise").shape == (256, 2) and q1.scales("columnwise").shape == (256, 2)
    assert not torch.equal(q1.scales("rowwise"), q1.scales("columnwise"))
    assert not torch.equal(q1.codes("rowwise"), q1.codes("columnwise").t())
    assert q2.scales("rowwise").shape == (2, 2)
    assert torch.equal(q2.scales("columnwise"), q2.scales("rowwise").t())
    assert torch.equal(q2.codes("columnwise"), q2.codes("rowwise").t())


def test_te_shapes_large():
    """A few of TE's larger shapes (TE_REFERENCE 10.3) within the CPU budget."""
    for shape, role in (((2000, 1024), "input"), ((2048, 2000), "weight"), ((1024, 256), "input")):
        check_against_reference(many_scales(shape, torch.bfloat16, seed=shape[1],
                                            tile_rows=B if role == "weight" else 1), role=role)


def test_leading_dims_and_empty():
    x = values("randn", (6, 200), torch.bfloat16).reshape(2, 3, 200)
    q = te.ops.quantize(x, DEFAULT, rowwise=True, columnwise=True)
    assert q.data.shape == (6, 200) and q.data_t.shape == (200, 6)
    assert q.dequantize().shape == x.shape
    assert_bits(q.data, reference(x, q.config, True, True)["data"], "data")
    for shape in ((0, 200), (200, 0)):
        for role in ("input", "weight"):
            q = te.ops.quantize(torch.zeros(shape), DEFAULT, role, rowwise=True, columnwise=True)
            assert q.data.shape == shape and q.data_t.shape == shape[::-1]


@pytest.mark.parametrize("shape", [(0, 200), (200, 0)])
@pytest.mark.parametrize("role", ["input", "weight"])
def test_dequantize_empty(shape, role):
    q = te.ops.quantize(torch.zeros(shape), DEFAULT, role, rowwise=True, columnwise=True)
    assert q.dequantize().shape == shape
    assert q.dequantize_direction("columnwise").shape == shape[::-1]


def test_quantization_is_not_trivial():
    """Guards the reference itself: values change under quantization and scales vary."""
    x = values("many scales", (128, 512), torch.float32)
    q = te.ops.quantize(x, DEFAULT, rowwise=True, columnwise=True)
    assert len(torch.unique(q.scales())) > 2
    deq = q.dequantize()
    assert not torch.equal(deq, x)
    rel = ((deq - x).abs() / x.abs().clamp_min(1e-30)).max().item()
    assert 0 < rel <= 2.0**-4  # E4M3: half an ulp of 3 mantissa bits, normal range


# ---------------------------------------------------------------------------------------------
# CUDA kernels vs the CPU reference (GPU machine)

def check_cuda(x, recipe=DEFAULT, role="input", rowwise=True, columnwise=True, stream=None,
               dequant_dtypes=(torch.float32, torch.bfloat16)):
    """CUDA members == CPU reference members bit for bit; dequantize CUDA == CPU."""
    xc = x.cuda()
    if stream is None:
        qc = te.ops.quantize(xc, recipe, role=role, rowwise=rowwise, columnwise=columnwise)
    else:
        with torch.cuda.stream(stream):
            qc = te.ops.quantize(xc, recipe, role=role, rowwise=rowwise, columnwise=columnwise)
        stream.synchronize()
    q = te.ops.quantize(x.cpu(), recipe, role=role, rowwise=rowwise, columnwise=columnwise)
    for name in ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t"):
        a, b = getattr(qc, name), getattr(q, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.is_cuda
            assert_bits(a, b, f"cuda {name}")
    for direction in ("rowwise", "columnwise"):
        if q.has(direction):
            for dtype in dequant_dtypes:  # NaN payloads included: both use tq_mul
                assert_bits(qc.dequantize_direction(direction, dtype).view(torch.uint8),
                            q.dequantize_direction(direction, dtype).view(torch.uint8),
                            f"cuda dequantize {direction} {dtype}")
    return qc


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(2000, 1024), (2048, 2000), (16, 4096)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("role", ["input", "weight"])
def test_cuda_shapes(shape, dtype, role):
    check_cuda(many_scales(shape, dtype, seed=shape[0] + shape[1],
                           tile_rows=B if role == "weight" else 1), role=role)
    check_cuda(values("randn", shape, dtype), role=role, rowwise=True, columnwise=False)
    check_cuda(values("randn", shape, dtype), role=role, rowwise=False, columnwise=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", VALUE_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("recipe", ["default", "f32_scales", "hybrid"])
def test_cuda_values(kind, dtype, recipe):
    r = {"default": DEFAULT, "f32_scales": F32_SCALES, "hybrid": HYBRID}[recipe]
    for role in ("weight", "grad_output"):
        check_cuda(values(kind, (200, 300), dtype), r, role, dequant_dtypes=DTYPES)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("role", ["input", "weight"])
def test_cuda_strided_and_unaligned(dtype, role):
    wide = values("many scales", (300, 517), dtype)
    check_cuda(wide[:, 5:400], role=role)        # odd start, odd stride: scalar loads
    wide = values("many scales", (300, 1024), dtype)
    check_cuda(wide[:, 256:900], role=role)      # aligned stride > cols: vector loads
    check_cuda(values("randn", (264, 200), dtype), role=role)  # M % 16 != 0 / K % 8 == 0 mixes
    check_cuda(values("randn", (272, 203), dtype), role=role)


def conversion_sweep(rows=2048):
    """fp32 [rows, 128] whose every 1x128 block, 128x1 block and 128x128 tile holds +Inf, so each
    scale is 1 (amax Inf) and q = cvt8(x) exactly: the sweep covers every bf16 pattern widened, E4M3
    and E5M2 rounding ties and their neighbours, subnormals, saturation, NaN of both signs, and
    random fp32 patterns."""
    g = torch.Generator().manual_seed(5)
    parts = [torch.arange(0, 1 << 16, dtype=torch.int32) << 16]  # every bf16 pattern
    for mant_bits in (3, 2):  # E4M3 / E5M2 ties: the half-way points and one fp32 ulp around
        e = torch.arange(-30, 20, dtype=torch.int32)
        m = torch.arange(0, 1 << mant_bits, dtype=torch.int32)
        base = ((e[:, None] + 127) << 23) | (m[None, :] << (23 - mant_bits))
        tie = base | (1 << (22 - mant_bits))
        for d in (-1, 0, 1):
            parts.append((tie + d).flatten())
    parts.append(torch.randint(-2**31, 2**31 - 1, (rows * 127 // 2,), generator=g, dtype=torch.int32))
    bits = torch.cat(parts)
    bits = torch.cat([bits, bits ^ (1 << 31)])[: rows * 127]  # both signs
    bits = torch.cat([bits, torch.randint(-2**31, 2**31 - 1, (rows * 127 - bits.numel(),), generator=g,
                                          dtype=torch.int32)])
    x = torch.empty(rows, 128)
    x[:, 1:] = bits.view(torch.float32).reshape(rows, 127)
    x[:, 0] = float("inf")
    x[::128, :] = float("inf")
    return x


@pytest.mark.parametrize("recipe, role", [(DEFAULT, "input"), (HYBRID, "grad_output"),
                                          (DEFAULT, "weight")])
def test_conversion_sweep(recipe, role):
    x = conversion_sweep(256)
    q = check_against_reference(x, recipe, role)
    assert torch.all(q.scales() == 1.0) and torch.all(q.scales("columnwise") == 1.0)
    fmt = q.config.format
    assert torch.equal(q.codes()[:, 1:], fp8_bits(scaled(x[:, 1:], 1.0), fmt))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("recipe, role", [(DEFAULT, "input"), (HYBRID, "grad_output"),
                                          (DEFAULT, "weight")])
def test_cuda_conversion_sweep(recipe, role):
    """The kernel's hardware FP8 cast against formats.h's rule on a dense fp32 sweep."""
    check_cuda(conversion_sweep(), recipe, role)


@gpu
@pytest.mark.gpu
def test_cuda_amax_epsilon():
    recipe = Float8BlockScaling(fp8_quant_fwd_inp=QParams(power_2_scale=False, amax_epsilon=0.5),
                                fp8_quant_fwd_weight=QParams(power_2_scale=True, amax_epsilon=0.5))
    x = values("randn", (140, 300), torch.float32) * 0.01
    x[:, 128:256] = 0
    check_cuda(x, recipe, "input")
    check_cuda(x, recipe, "weight")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("role", ["input", "weight"])
def test_cuda_large(role):
    x = many_scales((8192, 8192), torch.bfloat16, seed=1, tile_rows=B if role == "weight" else 1)
    check_cuda(x, role=role, dequant_dtypes=(torch.bfloat16,))
    x = values("randn", (4099, 8200), torch.float32)  # non-multiple large shape
    check_cuda(x, role=role, dequant_dtypes=(torch.float32,))


@gpu
@pytest.mark.gpu
def test_cuda_non_default_stream():
    stream = torch.cuda.Stream()
    x = values("many scales", (1024, 1000), torch.bfloat16)
    for role in ("input", "weight"):
        check_cuda(x, role=role, stream=stream)


@gpu
@pytest.mark.gpu
def test_cuda_scale_padding_is_written():
    """The members come from torch.empty: poison the caching allocator with NaN-filled blocks of
    the same sizes first, so padding the kernel forgets to write would show up."""
    x = values("randn", (130, 258), torch.bfloat16).cuda()
    for role in ("input", "weight"):
        for _ in range(3):
            junk = [torch.full((n,), float("nan"), device="cuda") for n in (12, 264, 1040, 520)]
            del junk
            q = check_cuda(x.cpu(), role=role)
            assert not q.scale_inv.isnan().any() and not q.scale_inv_t.isnan().any()
