"""The scalar codecs of formats.h, exhaustively, against torch's own casts (never against formats.h).

Through _C._codec (tq_codec_apply): every one of the 65536 bf16 bit patterns widened to fp32, a
dense fp32 sweep (every sign and exponent, with the top 12 mantissa bits taking all values and the
low 11 bits 0, 1 or all ones: exact values, exact ties and both neighbours of every tie of every
target format), and 2^20 random fp32 patterns, through each encoder; all 256 codes through each
decoder; plus hand-written tables of special values (NaN, +-Inf, -0, subnormals, saturation, ties).
References: FP8 = clamp then torch's float8 cast; bf16 / fp16 = torch's casts; E2M1 and E8M0 =
tests/reference.py (threshold table, frexp). GPU tests run the same patterns through the CUDA
kernel (cuda/codec.cu) and require the CPU reference's bits exactly.
"""
import functools
import math

import pytest
import torch

from reference import e2m1_codes, e2m1_values, e8m0_up, fp8_bits
from tequant import _C

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ENCODERS = ["f32_to_e4m3", "f32_to_e5m2", "f32_to_e2m1", "f32_to_e8m0", "f32_to_bf16", "f32_to_f16"]
DECODERS = ["e4m3_to_f32", "e5m2_to_f32", "e2m1_to_f32", "e8m0_to_f32"]
OUT_DTYPE = {"f32_to_e4m3": torch.uint8, "f32_to_e5m2": torch.uint8, "f32_to_e2m1": torch.uint8,
             "f32_to_e8m0": torch.uint8, "f32_to_bf16": torch.bfloat16, "f32_to_f16": torch.float16}
PATTERN_SETS = ["bf16_all", "f32_dense", "f32_random"]


def codec(name, x, out_dtype=None):
    """_C._codec into a fresh, poisoned output of x's shape and device."""
    if out_dtype is None:
        out_dtype = OUT_DTYPE.get(name, torch.float32)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out.view(torch.uint8).fill_(0xA5)  # a pattern no test expects everywhere
    _C._codec(name, x, out)
    return out


def next_f32(value, toward):
    """The float32 neighbour of float32 `value` in the direction of `toward` (math.nextafter
    would step in double precision)."""
    v = torch.tensor(value, dtype=torch.float32)
    return torch.nextafter(v, torch.tensor(toward, dtype=torch.float32)).item()


def f32_from_bits(bits):
    """int64 tensor of 32-bit patterns (0..2^32-1) -> float32 with those bits."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def bits32(x):
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


@functools.lru_cache(maxsize=None)
def patterns(which):
    """The fp32 inputs of one pattern set (CPU, 1-D)."""
    if which == "bf16_all":
        return torch.arange(65536, dtype=torch.int64).to(torch.int32).to(torch.int16) \
            .view(torch.bfloat16).float()
    if which == "f32_dense":
        top = torch.arange(4096, dtype=torch.int64) << 11             # mantissa bits 11..22
        low = torch.tensor([0, 1, 0x7FF], dtype=torch.int64)          # bits 0..10
        mant = (top[:, None] | low[None, :]).reshape(-1)
        exp = torch.arange(256, dtype=torch.int64) << 23
        sign = torch.tensor([0, 1 << 31], dtype=torch.int64)
        bits = (sign[:, None, None] | exp[None, :, None] | mant[None, None, :]).reshape(-1)
        return f32_from_bits(bits)
    if which == "f32_random":
        g = torch.Generator().manual_seed(1234)
        return f32_from_bits(torch.randint(0, 2**32, (1 << 20,), dtype=torch.int64, generator=g))
    raise ValueError(which)


def nonnegative(x):
    """E8M0's rule is defined on amaxes (>= 0): clear the sign of finite values (keeping -Inf
    and -NaN, which the rule also names)."""
    keep = x.isnan() | x.isinf()
    return torch.where(keep, x, x.abs())


def assert_same_bits(got, want, x, what):
    """Exact equality of bit patterns; on failure, name the first few inputs that differ."""
    g = got.reshape(-1).view(torch.uint8 if got.element_size() == 1 else torch.int16 if
                             got.element_size() == 2 else torch.int32)
    w = want.reshape(-1).view(g.dtype)
    bad = (g != w).nonzero().reshape(-1)
    if bad.numel():
        i = bad[:8]
        xs = [f"{v:.9g} (0x{b:08x})" for v, b in zip(x.reshape(-1)[i].tolist(),
                                                      bits32(x.reshape(-1)[i]).tolist())]
        pytest.fail(f"{what}: {bad.numel()} mismatches; inputs {xs}: got {g[i].tolist()}, "
                    f"want {w[i].tolist()}")


def assert_same_float16(got, want, x, what):
    """bf16 / fp16 outputs: exact bits, except that NaN results compare by NaN-ness (torch writes
    its own NaN payload, 0xFFFF for bf16 on CPU) while tequant's NaN must keep the input's sign."""
    nan = x.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN-ness differs"
    assert torch.equal(torch.signbit(got[nan]), torch.signbit(x[nan])), f"{what}: NaN sign lost"
    assert_same_bits(got[~nan], want[~nan], x[~nan], what)


def torch_reference(name, x):
    if name == "f32_to_e4m3":
        return fp8_bits(x, "E4M3")
    if name == "f32_to_e5m2":
        return fp8_bits(x, "E5M2")
    if name == "f32_to_e2m1":
        return e2m1_codes(x)
    if name == "f32_to_e8m0":
        return e8m0_up(x)
    if name == "f32_to_bf16":
        return x.to(torch.bfloat16)
    if name == "f32_to_f16":
        return x.to(torch.float16)
    raise ValueError(name)


def encoder_inputs(name, which):
    x = patterns(which)
    return nonnegative(x) if name == "f32_to_e8m0" else x


# ---- encoders vs torch, CPU reference ----

@pytest.mark.parametrize("which", PATTERN_SETS)
@pytest.mark.parametrize("name", ENCODERS)
def test_encoder_matches_torch(name, which):
    x = encoder_inputs(name, which)
    got, want = codec(name, x), torch_reference(name, x)
    if name in ("f32_to_bf16", "f32_to_f16"):
        assert_same_float16(got, want, x, f"{name} on {which}")
    else:
        assert_same_bits(got, want, x, f"{name} on {which}")


def test_dense_sweep_covers_what_it_claims():
    """The dense sweep holds exact ties of every format, their neighbours, NaN, +-Inf, -0 and
    subnormals (a guard against a sweep that silently shrinks)."""
    x = patterns("f32_dense")
    b = bits32(x)
    assert x.numel() == 2 * 256 * 4096 * 3
    assert x.isnan().sum() > 0 and (x == float("inf")).sum() == 1 and (x == -float("inf")).sum() == 1
    assert ((b == 0x80000000)).sum() == 1  # -0.0
    assert ((b & 0x7F800000) == 0).sum() > 20000  # subnormals
    for tie in (1 + 2**-8, 1 + 2**-11, 1 + 2**-4, 1 + 2**-3, 1.25, 2**-7 * 1.5, 65520.0, 464.0):
        for v in (tie, next_f32(tie, 0), next_f32(tie, math.inf)):
            assert (bits32(x) == bits32(torch.tensor([v]))).any(), v


# ---- decoders vs torch, CPU reference ----

ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
TORCH_CODE_DTYPE = {"e4m3_to_f32": torch.float8_e4m3fn, "e5m2_to_f32": torch.float8_e5m2,
                    "e8m0_to_f32": torch.float8_e8m0fnu}


def decoder_reference(name, codes):
    if name == "e2m1_to_f32":
        return e2m1_values(codes & 0xF)  # the low nibble is the code
    return codes.view(TORCH_CODE_DTYPE[name]).float()


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_matches_torch_on_all_256_codes(name):
    got, want = codec(name, ALL_CODES), decoder_reference(name, ALL_CODES)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), name
    if name != "e8m0_to_f32":  # E8M0 has no sign; its NaN (255) is positive
        assert torch.equal(torch.signbit(got[nan]), (ALL_CODES[nan] & 0x80) != 0), name
    assert_same_bits(got[~nan], want[~nan], ALL_CODES[~nan], name)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_round_trip_of_every_finite_code(fmt):
    values = codec(f"{fmt}_to_f32", ALL_CODES)
    finite = ~values.isnan() & ~values.isinf()
    codes = codec(f"f32_to_{fmt}", values[finite])
    assert torch.equal(codes, ALL_CODES[finite])


def test_e2m1_round_trip_and_e8m0_round_trip():
    codes16 = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(codec("f32_to_e2m1", codec("e2m1_to_f32", codes16)), codes16)
    exps = torch.arange(255, dtype=torch.int32).to(torch.uint8)  # 255 is NaN
    assert torch.equal(codec("f32_to_e8m0", codec("e8m0_to_f32", exps)), exps)


# ---- hand-written special values (independent of torch and of formats.h) ----

NAN, INF = float("nan"), float("inf")
SPECIAL = {
    "f32_to_e4m3": [(0.0, 0x00), (-0.0, 0x80), (448.0, 0x7E), (-448.0, 0xFE), (464.0, 0x7E),
                    (1e30, 0x7E), (INF, 0x7E), (-INF, 0xFE), (NAN, 0x7F), (-NAN, 0xFF),
                    (2**-9, 0x01), (2**-10, 0x00), (-2**-10, 0x80), (1.5 * 2**-9, 0x02),
                    (2.5 * 2**-9, 0x02), (7.5 * 2**-9, 0x08), (2**-6, 0x08), (1.0625, 0x38),
                    (1.1875, 0x3A), (400.0, 0x7C), (432.0, 0x7E), (1e-45, 0x00),
                    (next_f32(2**-10, 1), 0x01)],
    "f32_to_e5m2": [(0.0, 0x00), (-0.0, 0x80), (57344.0, 0x7B), (61440.0, 0x7B),
                    (-1e38, 0xFB), (INF, 0x7B), (-INF, 0xFB), (NAN, 0x7F), (-NAN, 0xFF),
                    (2**-16, 0x01), (2**-17, 0x00), (1.5 * 2**-16, 0x02), (2**-14, 0x04),
                    (1.125, 0x3C), (1.375, 0x3E), (next_f32(1.125, 2), 0x3D)],
    "f32_to_e2m1": [(0.0, 0), (-0.0, 8), (0.25, 0), (next_f32(0.25, 1), 1), (-0.1, 8),
                    (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
                    (next_f32(5.0, 6), 7), (6.0, 7), (1e9, 7), (INF, 7), (-INF, 15),
                    (NAN, 7), (-NAN, 7), (-6.0, 15), (-0.3, 9), (-3.0, 13), (1e-45, 0)],
    "f32_to_e8m0": [(0.0, 0), (-0.0, 0), (1.0, 127), (1.5, 128), (0.75, 127), (2**-127, 0),
                    (2**-126, 1), (1.5 * 2**-127, 1), (2**-149, 0), (2.0**127, 254),
                    (1.5 * 2.0**127, 254), (3.4028234663852886e38, 254), (INF, 254),
                    (NAN, 255), (448.0, 136), (next_f32(1.0, 2), 128)],
    "f32_to_bf16": [(1 + 2**-8, 0x3F80), (1 + 3 * 2**-8, 0x3F82),
                    (next_f32(1 + 2**-8, 2), 0x3F81), (3.4028234663852886e38, 0x7F80),
                    (-0.0, 0x8000), (INF, 0x7F80), (-INF, 0xFF80), (1e-45, 0x0000),
                    (2**-133, 0x0001)],
    "f32_to_f16": [(65504.0, 0x7BFF), (65519.0, 0x7BFF), (65520.0, 0x7C00), (-1e6, 0xFC00),
                   (2**-24, 0x0001), (2**-25, 0x0000), (next_f32(2**-25, 1), 0x0001),
                   (3 * 2**-25, 0x0002), (1 + 2**-11, 0x3C00), (1 + 3 * 2**-11, 0x3C02),
                   (-0.0, 0x8000), (2**-14, 0x0400), (INF, 0x7C00)],
}


def _special_cases():
    for name, table in SPECIAL.items():
        for value, want in table:
            yield pytest.param(name, value, want, id=f"{name}-{value!r}")


@pytest.mark.parametrize("name,value,want", list(_special_cases()))
def test_special_value(name, value, want):
    x = torch.tensor([value], dtype=torch.float32)
    out = codec(name, x)
    got = int(out.view(torch.uint8 if out.element_size() == 1 else torch.int16)[0]) & 0xFFFF
    assert got == want, f"{name}({value!r}) = 0x{got:x}, want 0x{want:x}"


def test_nan_to_bf16_and_f16_stays_nan_with_its_sign():
    x = torch.tensor([NAN, -NAN, f32_from_bits(torch.tensor([0x7F800001]))[0].item()])
    for name in ("f32_to_bf16", "f32_to_f16"):
        out = codec(name, x)
        assert out.isnan().all(), name
        assert torch.equal(torch.signbit(out), torch.signbit(x)), name


SPECIAL_DECODE = {
    "e4m3_to_f32": [(0x7E, 448.0), (0xFE, -448.0), (0x01, 2**-9), (0x08, 2**-6), (0x80, -0.0),
                    (0x38, 1.0), (0x7F, NAN), (0xFF, NAN)],
    "e5m2_to_f32": [(0x7B, 57344.0), (0x7C, INF), (0xFC, -INF), (0x01, 2**-16), (0x3C, 1.0),
                    (0x80, -0.0), (0x7D, NAN)],
    "e2m1_to_f32": [(0, 0.0), (1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0), (5, 3.0), (6, 4.0),
                    (7, 6.0), (8, -0.0), (15, -6.0), (0xF7, 6.0), (0x1D, -3.0)],
    "e8m0_to_f32": [(0, 2**-127), (1, 2**-126), (127, 1.0), (254, 2.0**127), (255, NAN)],
}


@pytest.mark.parametrize("name", list(SPECIAL_DECODE))
def test_special_decodes(name):
    codes = torch.tensor([c for c, _ in SPECIAL_DECODE[name]], dtype=torch.uint8)
    want = torch.tensor([v for _, v in SPECIAL_DECODE[name]], dtype=torch.float32)
    got = codec(name, codes)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), got


# ---- the API: shapes, layouts, dtypes, errors ----

def test_strided_rows_and_shapes():
    """in and out with ld > cols: only the view's elements are read and written."""
    base = torch.randn(7, 40) * 300
    x = base[:, 3:33]
    out_base = torch.full((7, 50), 0xA5, dtype=torch.uint8)
    out = out_base[:, 10:40]
    _C._codec("f32_to_e4m3", x, out)
    assert torch.equal(out, fp8_bits(x, "E4M3"))
    assert (out_base[:, :10] == 0xA5).all() and (out_base[:, 40:] == 0xA5).all()
    codes = torch.randint(0, 256, (5, 64), dtype=torch.uint8)[:, 8:40]
    vals = torch.full((5, 48), 7.0)[:, 4:36]
    _C._codec("e5m2_to_f32", codes, vals)
    assert torch.equal(vals.view(torch.int32)[~vals.isnan()],
                       codes.view(torch.float8_e5m2).float().view(torch.int32)[~vals.isnan()])
    for shape in [(0,), (0, 5), (3, 0), (), (2, 3, 4)]:
        x = torch.randn(shape)
        assert torch.equal(codec("f32_to_e2m1", x), e2m1_codes(x))


def test_float8_dtypes_are_accepted_on_the_code_side():
    x = patterns("bf16_all")
    for name, dtype, fmt in [("f32_to_e4m3", torch.float8_e4m3fn, "E4M3"),
                             ("f32_to_e5m2", torch.float8_e5m2, "E5M2")]:
        out = codec(name, x, dtype)
        assert torch.equal(out.view(torch.uint8), fp8_bits(x, fmt))
        back = codec(name.replace("f32_to_", "") + "_to_f32", out)
        assert torch.equal(back.isnan(), out.float().isnan())
    e = codec("f32_to_e8m0", nonnegative(x), torch.float8_e8m0fnu)
    assert torch.equal(e.view(torch.uint8), e8m0_up(nonnegative(x)))


def test_errors_name_the_problem():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="unknown codec 'f32_to_e3m4'"):
        _C._codec("f32_to_e3m4", x, torch.empty(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="name must be a str"):
        _C._codec(3, x, torch.empty(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match=r"takes 3 arguments \(2 given\)"):
        _C._codec("f32_to_e4m3", x)
    with pytest.raises(ValueError, match="x has dtype float64"):
        _C._codec("f32_to_e4m3", x.double(), torch.empty(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="x has dtype bfloat16"):
        _C._codec("f32_to_e4m3", x.bfloat16(), torch.empty(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out has dtype float32"):
        _C._codec("f32_to_e4m3", x, torch.empty(4))
    with pytest.raises(ValueError, match=r"codec f32_to_e2m1: out has dtype float8_e4m3; expected uint8"):
        _C._codec("f32_to_e2m1", x, torch.empty(4, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"codec e4m3_to_f32: in has dtype float8_e5m2; expected "
                                         r"uint8 or float8_e4m3"):
        _C._codec("e4m3_to_f32", torch.zeros(4, dtype=torch.float8_e5m2), x)
    with pytest.raises(ValueError, match=r"codec f32_to_bf16: out has dtype float16"):
        _C._codec("f32_to_bf16", x, torch.empty(4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"in is \[1, 4\] but out is \[1, 5\]"):
        _C._codec("f32_to_e4m3", x, torch.empty(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"in is \[2, 2\] but out is \[1, 4\]"):
        _C._codec("f32_to_e4m3", x.reshape(2, 2), torch.empty(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        _C._codec("f32_to_e4m3", [0.0], torch.empty(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\.contiguous\(\)"):
        _C._codec("f32_to_e4m3", torch.zeros(3, 4).t(), torch.empty(4, 3, dtype=torch.uint8))


# ---- CUDA kernel == CPU reference, bit for bit ----

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("which", PATTERN_SETS)
@pytest.mark.parametrize("name", ENCODERS)
def test_cuda_encoder_matches_cpu(name, which):
    x = encoder_inputs(name, which)
    got = codec(name, x.cuda())
    assert_same_bits(got.cpu(), codec(name, x), x, f"CUDA {name} on {which}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", DECODERS)
def test_cuda_decoder_matches_cpu(name):
    codes = ALL_CODES.repeat(1000)  # several blocks, every code in every position class
    got = codec(name, codes.cuda())
    assert_same_bits(got.cpu(), codec(name, codes), codes, f"CUDA {name}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", SPECIAL)
def test_cuda_special_values(name):
    x = torch.tensor([v for v, _ in SPECIAL[name]], dtype=torch.float32)
    assert_same_bits(codec(name, x.cuda()).cpu(), codec(name, x), x, name)


@gpu
@pytest.mark.gpu
def test_cuda_strided_empty_large_and_stream():
    base = (torch.randn(300, 1000, device="cuda") * 100)
    x = base[:, 100:613]
    out_base = torch.full((300, 700), 0xA5, dtype=torch.uint8, device="cuda")
    out = out_base[:, 50:563]
    _C._codec("f32_to_e4m3", x, out)
    assert torch.equal(out.cpu(), codec("f32_to_e4m3", x.cpu()))
    assert (out_base[:, :50] == 0xA5).all() and (out_base[:, 563:] == 0xA5).all()
    for shape in [(0,), (0, 7), (5, 0)]:
        assert codec("f32_to_bf16", torch.empty(shape, device="cuda")).shape == shape
    big = torch.randn(8192, 8192, device="cuda") * 64
    assert torch.equal(codec("f32_to_e4m3", big).cpu(), codec("f32_to_e4m3", big.cpu()))
    big = torch.randn(8192, 8193, device="cuda")  # > 2^26 elements, odd row length
    assert torch.equal(codec("f32_to_e2m1", big).cpu(), codec("f32_to_e2m1", big.cpu()))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = torch.randn(4096, 4096, device="cuda")
        out = torch.empty(y.shape, dtype=torch.uint8, device="cuda")
        _C._codec("f32_to_e5m2", y, out)  # must run on s, after y's fill on s
        back = torch.empty(y.shape, device="cuda")
        _C._codec("e5m2_to_f32", out, back)
    s.synchronize()
    assert torch.equal(out.cpu(), fp8_bits(y.cpu(), "E5M2"))
    assert torch.equal(back.cpu(), fp8_bits(y.cpu(), "E5M2").view(torch.float8_e5m2).float())


@gpu
@pytest.mark.gpu
def test_cuda_device_mismatch_is_an_error():
    with pytest.raises(ValueError, match="in is on device 0, out on device -1"):
        _C._codec("f32_to_e4m3", torch.zeros(4, device="cuda:0"), torch.empty(4, dtype=torch.uint8))
