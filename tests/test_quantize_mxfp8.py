"""MXFP8 quantization (NUMERICS.md 2 "MXFP8", TE_REFERENCE A.4): E8M0 block scales rounded up.

The CPU reference (csrc/ref/quantize_mxfp8_ref.c) is compared bit for bit with an independent
torch reference written here (block amax with torch ops, E8M0 through torch.frexp, the elements
through torch's float8 casts, both from tests/reference.py), over shapes, dtypes, value patterns,
directions, E5M2 (HYBRID grads) and 32x32 tiles (enable_2d_quantization, weights); a few values
are also checked against hand-computed exponents. GPU cases (marked gpu) compare the CUDA kernels
(cuda/quantize_mxfp8.cu) with the CPU reference bit for bit, including large, strided, misaligned
and >2^31-element inputs and a non-default stream.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import tequant as te  # noqa: E402
from reference import e8m0_up, fp8_bits, fp8_values  # noqa: E402
from tequant.recipe import Format, MXFP8BlockScaling  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FMAX = {"E4M3": 448.0, "E5M2": 57344.0}
# RN(1/fmax) as TE's kernels hold it: 1/fmax computed in double, rounded once to fp32.
FMAX_RCP = {fmt: torch.tensor(1.0 / v, dtype=torch.float64).float() for fmt, v in FMAX.items()}

E4M3 = MXFP8BlockScaling()
HYBRID = MXFP8BlockScaling(fp8_format=Format.HYBRID)
TWO_D = MXFP8BlockScaling(enable_2d_quantization=True)


# ---- the independent reference ----

def pow2_f32(exponent):
    """2^exponent (int64 tensor) as float32, exactly (through float64)."""
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), exponent.double()).float()


def ref_exponents(x, fmt, two_d):
    """E8M0 exponents [M, K/32] of the rowwise blocks of x (1x32, or the 32x32 tile's)."""
    a = x.float().abs()
    a = torch.where(a.isnan(), torch.zeros_like(a), a)  # amax ignores NaN
    M, K = a.shape
    amax = a.reshape(M, K // 32, 32).amax(-1)
    if two_d:
        amax = amax.reshape(M // 32, 32, K // 32).amax(1).repeat_interleave(32, 0)
    return e8m0_up(amax * FMAX_RCP[fmt])  # one fp32 multiply, as A.4


def ref_rowwise(x, fmt, two_d=False):
    """(codes [M, K], exponents [M, K/32]) of x's rowwise direction."""
    e = ref_exponents(x, fmt, two_d)
    factor = pow2_f32(127 - e.long()).repeat_interleave(32, 1)
    return fp8_bits(x.float() * factor, fmt), e


def ref_columnwise(x, fmt, two_d=False):
    """(codes [K, M], exponents [K, M/32]): quant(x^T) with blocks along M."""
    return ref_rowwise(x.t(), fmt, two_d)


def ref_dequantize(codes, exps, fmt, dtype):
    scale = pow2_f32(exps.long() - 127)
    scale = torch.where(exps == 255, torch.full_like(scale, float("nan")), scale)
    return (fp8_values(codes, fmt) * scale.repeat_interleave(32, 1)).to(dtype)


# ---- helpers ----

def quantize(x, recipe=E4M3, role="input", rowwise=True, columnwise=True):
    return te.ops.quantize(x, recipe, role, rowwise=rowwise, columnwise=columnwise)


def fmt_of(recipe, role):
    return te.quantizer_config(recipe, role).format


def scales(q, direction):
    return q.scales(direction).view(torch.uint8)


def check_against_reference(x, recipe=E4M3, role="input", directions=("rowwise", "columnwise")):
    """Quantizes x (CPU) and compares codes, scales and every dequantization with the reference."""
    cfg = te.quantizer_config(recipe, role)
    q = quantize(x, recipe, role, "rowwise" in directions, "columnwise" in directions)
    xm = x.reshape(-1, x.shape[-1])
    for d in directions:
        codes, e = (ref_rowwise if d == "rowwise" else ref_columnwise)(xm, cfg.format, cfg.two_d)
        assert q.codes(d).dtype == torch.uint8 and q.codes(d).shape == codes.shape, d
        assert torch.equal(q.codes(d), codes), f"{d} codes differ at {mismatch(q.codes(d), codes)}"
        assert torch.equal(scales(q, d), e), f"{d} scales differ at {mismatch(scales(q, d), e)}"
        for dtype in (torch.float32, torch.bfloat16):
            want = ref_dequantize(codes, e, cfg.format, dtype)
            got = q.dequantize_direction(d, dtype)
            assert same_values(got, want), (d, dtype)
    return q


def same_bits(a, b):
    """Bitwise equality of two same-dtype tensors (NaN == NaN when the bits agree)."""
    a, b = a.contiguous(), b.contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_values(a, b):
    """Dequantized values: bitwise equal (so -0.0 != 0.0), NaN in the same places. A NaN's sign
    and payload carry nothing (torch's E4M3 decode keeps the mantissa bits, formats.h gives the
    quiet NaN, the GPU's multiply the canonical one)."""
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    fill = torch.zeros((), dtype=a.dtype)
    return same_bits(torch.where(a.isnan(), fill, a), torch.where(b.isnan(), fill, b))


def mismatch(a, b):
    idx = (a != b).nonzero()
    return idx[:3].tolist()


def values(kind, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    M, K = shape
    if kind == "randn":
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, (M, 1), generator=g).float())
    elif kind == "ramp":
        x = torch.linspace(-3000, 3000, M * K).reshape(shape)
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "negative zeros":
        x = -torch.zeros(shape)
    elif kind == "outlier":
        x = torch.randn(shape, generator=g)
        x[M // 2, K // 3] = 3e4
    elif kind == "nan inf":
        x = torch.randn(shape, generator=g)
        x[0, 1] = float("nan")
        x[M - 1, K - 2] = float("inf")
        x[M // 2, 5] = float("-inf")
        x[M // 3, K // 2] = -float("nan") if M > 1 else x[0, 0]
    elif kind == "all negative":
        x = -torch.rand(shape, generator=g) * 100 - 1e-3
    elif kind == "all max":
        return torch.full(shape, torch.finfo(dtype).max, dtype=dtype)
    elif kind == "tiny":
        x = torch.randn(shape, generator=g) * 1e-30
    elif kind == "subnormal":  # every element (so every block amax) subnormal in x's dtype
        tiny = torch.finfo(dtype).smallest_normal
        x = (torch.rand(shape, generator=g) * 1.8 - 0.9) * tiny
        x = torch.where(x.to(dtype).float().abs() >= tiny, torch.zeros_like(x), x)
    else:
        raise ValueError(kind)
    return x.to(dtype)


KINDS = ["randn", "ramp", "zeros", "negative zeros", "outlier", "nan inf", "all negative",
         "all max", "tiny", "subnormal"]
SHAPES = [(32, 32), (32, 64), (64, 32), (96, 160), (32, 1024), (1024, 32), (128, 128), (256, 288),
          (320, 320), (352, 256)]


# ---- CPU reference vs the torch reference ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_values_match_reference(dtype, kind):
    for shape in [(64, 96), (160, 64)]:
        check_against_reference(values(kind, shape, dtype), E4M3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_shapes_match_reference(dtype, shape):
    check_against_reference(values("randn", shape, dtype, seed=shape[0] + shape[1]))


def test_te_shapes_and_3d_input():
    for shape in [(256, 1024), (1024, 256), (2048, 1024)]:
        check_against_reference(values("randn", shape, torch.bfloat16))
    x = torch.randn(4, 16, 96)  # leading dims flatten to M = 64
    q = check_against_reference(x)
    assert q.dequantize().shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["randn", "nan inf", "all max", "ramp"])
def test_e5m2_for_hybrid_grads(dtype, kind):
    assert fmt_of(HYBRID, "grad_output") == "E5M2" and fmt_of(HYBRID, "grad_input") == "E5M2"
    assert fmt_of(HYBRID, "input") == "E4M3"
    check_against_reference(values(kind, (96, 64), dtype), HYBRID, "grad_output")
    check_against_reference(values(kind, (64, 96), dtype), HYBRID, "grad_input")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 64), (128, 128), (256, 288), (320, 320), (352, 256)])
def test_2d_tiles_match_reference(dtype, shape):
    cfg = te.quantizer_config(TWO_D, "weight")
    assert cfg.two_d and cfg.block == (32, 32)
    for kind in ("randn", "outlier", "nan inf"):
        q = check_against_reference(values(kind, shape, dtype, seed=shape[0]), TWO_D, "weight")
        assert torch.equal(q.codes("columnwise"), q.codes("rowwise").t())
        # one exponent per 32x32 tile, repeated on the tile's rows in both layouts
        e = scales(q, "rowwise")
        assert torch.equal(e, e[::32].repeat_interleave(32, 0))
        assert torch.equal(scales(q, "columnwise"), e[::32].t().repeat_interleave(32, 0))


def test_2d_only_for_weights():
    assert not te.quantizer_config(TWO_D, "input").two_d
    x = values("outlier", (64, 64), torch.float32)
    check_against_reference(x, TWO_D, "input")  # 1D blocks: differs from the tile rule here
    q1, q2 = quantize(x, TWO_D, "input"), quantize(x, TWO_D, "weight")
    assert not torch.equal(scales(q1, "rowwise"), scales(q2, "rowwise"))


def test_strided_rows():
    base = torch.randn(128, 200)
    base[:, 128:] = 1e6  # outside the view: must not leak into any block
    for x in (base[:, :128], base[:, 32:96], base[::2, :64]):
        assert x.stride(0) > x.shape[1]
        check_against_reference(x)
        check_against_reference(x.to(torch.bfloat16))


def test_directions_are_independent():
    x = values("outlier", (64, 64), torch.float32)
    both = quantize(x)
    row = quantize(x, columnwise=False)
    col = quantize(x, rowwise=False)
    assert row.data_t is None and col.data is None
    assert torch.equal(row.codes("rowwise"), both.codes("rowwise"))
    assert torch.equal(col.codes("columnwise"), both.codes("columnwise"))
    assert torch.equal(scales(col, "columnwise"), scales(both, "columnwise"))
    # the outlier's rowwise block and its columnwise block get different exponents than the rest
    assert not torch.equal(both.codes("columnwise").t(), both.codes("rowwise"))


# ---- the rule itself, by hand ----

def single_block(amax_value, rest=1.0, dtype=torch.float32):
    x = torch.full((32, 32), rest, dtype=torch.float32)
    x[0, 0] = amax_value
    return x.to(dtype)


@pytest.mark.parametrize("fmt,recipe,role", [("E4M3", E4M3, "input"), ("E5M2", HYBRID, "grad_output")])
def test_exponent_boundaries_by_hand(fmt, recipe, role):
    fmax = FMAX[fmt]
    up = lambda v: torch.nextafter(torch.tensor(v), torch.tensor(float("inf"))).item()  # noqa: E731
    down = lambda v: torch.nextafter(torch.tensor(v), torch.tensor(0.0)).item()  # noqa: E731
    # e = ceil(log2(RN(amax * RN(1/fmax)))) + 127, worked out by hand (RN(1/fmax) is 3 * 2^-26
    # relatively above 1/fmax, which rounds away at exact powers of two and one ulp below them).
    flt_max = torch.finfo(torch.float32).max
    cases = [(fmax, 127), (up(fmax), 128), (down(fmax), 127), (fmax * 2.0**10, 137),
             (up(fmax * 2.0**-20), 108), (fmax * 2.0**-20, 107), (down(fmax * 2.0**-20), 107),
             (fmax * 1.5, 128), (fmax * 0.75, 127), (fmax * 0.5, 126),
             (fmax * 2.0**-126, 1), (fmax * 2.0**-127, 0), (up(fmax * 2.0**-127), 0), (1e-40, 0),
             (float("inf"), 254), (0.0, 0), (flt_max, 247 if fmt == "E4M3" else 240)]
    for amax_value, want in cases:
        rest = 0.0 if amax_value == 0.0 else min(amax_value, 1.0)
        x = single_block(amax_value, rest)
        q = quantize(x, recipe, role)
        assert scales(q, "rowwise")[0, 0].item() == want, (amax_value, want)
        assert scales(q, "columnwise")[0, 0].item() == want, (amax_value, want)
        check_against_reference(x, recipe, role)
    # amax = fmax: factor 1, codes are the plain casts; the block max maps to the largest code
    q = quantize(single_block(fmax, 3.0), recipe, role)
    assert q.codes("rowwise")[0, 0].item() == (0x7E if fmt == "E4M3" else 0x7B)
    # amax = 500 (E4M3): scale 2, no clipping: 500 / 2 = 250 is representable-ish, never saturated
    if fmt == "E4M3":
        q = quantize(single_block(500.0), recipe, role)
        assert scales(q, "rowwise")[0, 0].item() == 128
        assert fp8_values(q.codes("rowwise")[0, :1], fmt).item() == 256.0  # RN(250) in E4M3


def test_special_values_by_hand():
    x = torch.randn(32, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, :32] = 0.0
    q = quantize(x)
    e = scales(q, "rowwise")
    codes = q.codes("rowwise")
    assert codes[0, 3].item() == 0x7F  # NaN stays NaN
    assert e[0, 0].item() == ref_exponents(x[:1, :32].nan_to_num(0.0), "E4M3", False).item()
    assert e[1, 1].item() == 254 and codes[1, 40].item() == 0x7E  # Inf: e = 254, Inf -> 448
    assert (codes[1, 32:] & 0x7F)[torch.arange(32) != 8].max().item() <= 1  # finite values -> ~0
    assert e[2, 0].item() == 0 and codes[2, :32].eq(0).all()  # all-zero block
    assert scales(q, "columnwise")[40, 0].item() == 254  # the Inf's column block
    neg_nan = torch.zeros(32, 32)
    neg_nan[5, 5] = -float("nan")
    qn = quantize(neg_nan)
    assert qn.codes("rowwise")[5, 5].item() == 0xFF and qn.codes("columnwise")[5, 5].item() == 0xFF


def test_shape_errors():
    for shape in [(16, 32), (32, 48), (65, 96), (1, 16), (32, 1)]:
        with pytest.raises(ValueError, match="MXFP8 needs both dims to be multiples of 32"):
            quantize(torch.randn(shape))


def test_empty():
    q = quantize(torch.randn(0, 64))
    assert q.data.shape == (0, 64) and q.data_t.shape == (64, 0)
    assert q.dequantize().shape == (0, 64)


def test_dequantize_output_dtypes():
    x = values("randn", (64, 96), torch.bfloat16)
    q = quantize(x)
    codes, e = ref_rowwise(x, "E4M3")
    for dtype in DTYPES:
        got = q.dequantize(dtype)
        want = ref_dequantize(codes, e, "E4M3", dtype)
        assert same_values(got, want), dtype
    # faithful: within half an E4M3 step of the block (2^-4 relative, or the subnormal step)
    step = pow2_f32(e.long() - 127 - 9).repeat_interleave(32, 1)
    err = (q.dequantize() - x.float()).abs()
    assert (err <= torch.maximum(x.float().abs() * 2.0**-4, step)).all()


def element_sweep(fmax):
    """Every bf16 pattern, and every fp32 high half with low halves around the rounding points of
    both formats, with |v| <= fmax or NaN, as [rows, 1024] slabs of 32-element blocks whose first
    element is fmax: every block has e = 127 (factor 1), so the other 31 elements go through the
    element conversion as they are."""
    bf16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    high = torch.arange(0, 1 << 16, dtype=torch.int64) << 16
    low = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    fp32 = (high[:, None] | low[None, :]).reshape(-1)
    fp32 = torch.where(fp32 >= 1 << 31, fp32 - (1 << 32), fp32).to(torch.int32).view(torch.float32)
    for v in (bf16, fp32):
        v = v[(v.abs() <= fmax) | v.isnan()]
        v = torch.cat((v, torch.zeros((-v.numel()) % (31 * 32 * 32))))  # whole [32, 1024] slabs
        blocks = torch.cat((torch.full((v.numel() // 31, 1), fmax), v.reshape(-1, 31)), 1)
        yield blocks.reshape(-1, 1024)


SWEEP = [(E4M3, "input", 448.0), (HYBRID, "grad_output", 57344.0)]


@pytest.mark.parametrize("recipe,role,fmax", SWEEP)
def test_element_codes_exhaustive(recipe, role, fmax):
    for x in element_sweep(fmax):
        q = check_against_reference(x, recipe, role, directions=("rowwise",))
        assert scales(q, "rowwise").eq(127).all()


# ---- CUDA kernels vs the CPU reference ----

def check_cuda(x, recipe=E4M3, role="input", rowwise=True, columnwise=True, dequant=True):
    """x on the GPU (any layout): the kernels' outputs equal the CPU reference's bit for bit."""
    qg = quantize(x, recipe, role, rowwise, columnwise)
    qc = quantize(x.cpu(), recipe, role, rowwise, columnwise)
    for d in [d for d, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on]:
        cg, cc = qg.codes(d).cpu(), qc.codes(d)
        assert torch.equal(cg, cc), f"{d} codes differ at {mismatch(cg, cc)}"
        sg, sc = scales(qg, d).cpu(), scales(qc, d)
        assert torch.equal(sg, sc), f"{d} scales differ at {mismatch(sg, sc)}"
        if dequant:
            for dtype in DTYPES:
                a = qg.dequantize_direction(d, dtype).cpu()
                b = qc.dequantize_direction(d, dtype)
                assert same_values(a, b), (d, dtype)
    return qg, qc


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_values_and_shapes(dtype):
    for kind in KINDS:
        for shape in [(64, 96), (160, 64), (32, 32)]:
            check_cuda(values(kind, shape, dtype).cuda())
    for shape in SHAPES + [(256, 1024), (1024, 256), (2048, 1024), (8224, 4064)]:
        check_cuda(values("randn", shape, dtype, seed=shape[0]).cuda(), dequant=shape[0] < 4096)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_recipes_directions_2d(dtype):
    for kind in ("randn", "nan inf", "all max", "ramp", "outlier", "subnormal"):
        x = values(kind, (352, 288), dtype).cuda()
        check_cuda(x, HYBRID, "grad_output")
        check_cuda(x, E4M3, rowwise=False)
        check_cuda(x, E4M3, columnwise=False)
        for rowwise, columnwise in ((True, True), (True, False), (False, True)):
            qg, _ = check_cuda(x, TWO_D, "weight", rowwise, columnwise)
    qg, _ = check_cuda(values("randn", (2048, 1024), dtype).cuda(), TWO_D, "weight")
    assert torch.equal(qg.codes("columnwise"), qg.codes("rowwise").t())


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("recipe,role,fmax", SWEEP)
def test_cuda_exhaustive_element_codes(recipe, role, fmax):
    for x in element_sweep(fmax):
        qg, qc = check_cuda(x.cuda(), recipe, role, columnwise=False, dequant=False)


@gpu
@pytest.mark.gpu
def test_cuda_large():
    x = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    check_cuda(x, dequant=False)
    qg = quantize(x[:4096, :4096])  # a strided view of the same storage
    qc = quantize(x[:4096, :4096].cpu())
    assert torch.equal(qg.codes("columnwise").cpu(), qc.codes("columnwise"))
    codes, e = ref_columnwise(x[:4096, :4096].cpu(), "E4M3")
    assert torch.equal(qg.codes("columnwise").cpu(), codes)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_strided_and_misaligned(dtype):
    base = torch.randn(192, 400, device="cuda").to(dtype)
    base[:, 300:] = 1e4
    for view in (base[:, :288], base[:, 32:96], base[:96, 3:35], base[:128, 1:257], base[:128:2, :64]):
        check_cuda(view)
        check_cuda(view, TWO_D, "weight")
    # misaligned output buffers are not reachable through te.ops; misaligned x is (3 elements in)


@gpu
@pytest.mark.gpu
def test_cuda_int64_offsets():
    """More than 2^31 elements: rows beyond the 2^31st element are quantized like a small copy."""
    try:
        x = torch.empty(65600, 32768, device="cuda", dtype=torch.bfloat16)
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    x.normal_()
    q = quantize(x)
    tail = x[-96:].cpu()
    codes, e = ref_rowwise(tail, "E4M3")
    assert torch.equal(q.codes("rowwise")[-96:].cpu(), codes)
    assert torch.equal(scales(q, "rowwise")[-96:].cpu(), e)
    codes_t, e_t = ref_columnwise(tail, "E4M3")
    assert torch.equal(q.codes("columnwise")[:, -96:].cpu(), codes_t)
    assert torch.equal(scales(q, "columnwise")[:, -3:].cpu(), e_t)
    del q, x
    torch.cuda.empty_cache()


@gpu
@pytest.mark.gpu
def test_cuda_non_default_stream():
    x = torch.randn(4096, 2048, device="cuda").to(torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 4  # queued on s: the quantize below must see it
        q = quantize(y)
        deq = q.dequantize(torch.bfloat16)
    s.synchronize()
    qc = quantize(y.cpu())
    assert torch.equal(q.codes("rowwise").cpu(), qc.codes("rowwise"))
    assert torch.equal(q.codes("columnwise").cpu(), qc.codes("columnwise"))
    assert torch.equal(scales(q, "columnwise").cpu(), scales(qc, "columnwise"))
    assert same_values(deq.cpu(), qc.dequantize(torch.bfloat16))
