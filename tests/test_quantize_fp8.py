"""FP8 per-tensor quantizers (DelayedScaling, Float8CurrentScaling) through te.ops.quantize.

CPU: the C reference (csrc/ref/quantize_fp8_ref.c) against an independent torch reference
written here from tests/reference.py (torch's own float8 casts), bit for bit: codes of both
directions, scale_inv, amax, and dequantized values. GPU (marked, skipped without CUDA): the
kernels (cuda/quantize_fp8.cu) against the CPU reference bit for bit, on the same sweep plus
large, strided, misaligned and non-default-stream cases. Rules: NUMERICS.md 2, TE_REFERENCE A.1,
A.2; multiplies are formats.h's tq_mul: a NaN product is the canonical +NaN (code 0x7F).
"""
import os
import sys

import pytest
import torch

import tequant as te
from tequant.recipe import DelayedScaling, Float8CurrentScaling, Format, QParams

sys.path.insert(0, os.path.dirname(__file__))
from reference import FLT_MAX, fp8_bits, fp8_values, scale_from_amax  # noqa: E402

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CURRENT, DELAYED = Float8CurrentScaling(), DelayedScaling()
NAN = float("nan")

# Below one tile, one tile, non-multiples, tall/skinny, and TE's shapes (TE_REFERENCE 10) that fit
# a CPU budget: 128x256 is TE's current-scaling exact test, the others its block/NVFP4 sweeps.
SHAPES = [(1, 1), (1, 7), (3, 5), (16, 16), (128, 128), (127, 129), (129, 257), (1, 1000),
          (1000, 1), (5, 3000), (128, 256), (256, 272), (303, 300), (2, 3, 33)]


# ---- the independent reference (torch ops only) ----------------------------------------------

def torch_amax(x2d):
    """max |x| in float32 with NaN elements dropped (0 for an empty or all-NaN tensor)."""
    v = x2d.float().abs().flatten()
    v = v[~v.isnan()]
    return v.max().reshape(1) if v.numel() else torch.zeros(1)


def signed_bits_max(old, new):
    """The history slot rule: the larger as signed int bits (float max for values >= 0)."""
    return torch.where(new.view(torch.int32) > old.view(torch.int32), new, old)


def reference(x, cfg, scale=None, old_amax=None):
    """(codes [M, K] uint8, scale_inv [1], amax [1]) per A.1 (current) or A.2 (delayed)."""
    x2d = x.reshape(-1, x.shape[-1]).float().cpu()
    amax = torch_amax(x2d)
    if cfg.scaling == "current":
        s = scale_from_amax(amax, cfg.fmax, cfg.amax_epsilon, cfg.power_2_scale, FLT_MAX)
        amax_out = amax
    else:
        s = (torch.ones(1) if scale is None else scale.float().cpu().reshape(1))
        amax_out = signed_bits_max(torch.zeros(1) if old_amax is None else old_amax.cpu().reshape(1), amax)
    prod = x2d * s
    prod = torch.where(prod.isnan(), torch.full_like(prod, NAN), prod)  # NaN products: +NaN
    return fp8_bits(prod, cfg.format), torch.ones(1) / s, amax_out


def reference_dequantized(codes, fmt, scale_inv, dtype):
    v = fp8_values(codes, fmt) * scale_inv.reshape(1, 1)
    return v.to(dtype)


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_values(a, b):
    """Bitwise equal except that any NaN equals any NaN (torch's own NaN patterns vary)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(bits(a)[keep], bits(b)[keep])


def quantize(x, recipe, role="input", rowwise=True, columnwise=True, **kw):
    return te.ops.quantize(x, recipe, role, rowwise=rowwise, columnwise=columnwise, **kw)


def check_against_reference(x, recipe, role="input", rowwise=True, columnwise=True, scale=None,
                            amax_history=None, dequant_dtypes=(torch.float32,)):
    old = None if amax_history is None else amax_history.clone()
    q = quantize(x, recipe, role, rowwise, columnwise, scale=scale, amax_history=amax_history)
    cfg = q.config
    codes, scale_inv, amax = reference(x, cfg, scale, old)
    dtype = fp8_bits(torch.zeros(1), cfg.format).dtype  # uint8
    assert codes.dtype == dtype
    assert q.data is None if not rowwise else same_bits(q.codes("rowwise"), codes)
    assert q.data_t is None if not columnwise else same_bits(q.codes("columnwise"), codes.t().contiguous())
    assert same_bits(q.scale_inv.reshape(1), scale_inv), (q.scale_inv, scale_inv)
    assert same_bits(q.amax.reshape(1), amax), (q.amax, amax)
    for direction in [d for d, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on]:
        c = codes if direction == "rowwise" else codes.t()
        for dt in dequant_dtypes:
            got = q.dequantize_direction(direction, dt)
            assert same_values(got, reference_dequantized(c, cfg.format, scale_inv, dt)), (direction, dt)
    return q


def value_cases(dtype, shape=(37, 53)):
    g = torch.Generator().manual_seed(1)
    finfo = torch.finfo(dtype)
    cases = {
        "randn": torch.randn(shape, generator=g),
        "ramp": torch.linspace(-3, 5, shape[0] * shape[1]).reshape(shape),
        "zeros": torch.zeros(shape),
        "negative zeros": -torch.zeros(shape),
        "all negative": -torch.rand(shape, generator=g) - 0.5,
        "tiny": torch.randn(shape, generator=g) * 1e-4,
    }
    x = torch.randn(shape, generator=g)
    x[5, 7] = 3e4
    cases["one huge outlier"] = x
    x = torch.randn(shape, generator=g)
    x[3, 4], x[10, 1], x[0, 0] = NAN, -NAN, float("inf")
    cases["NaN and Inf"] = x
    x = torch.randn(shape, generator=g)
    x[2, 2] = float("-inf")
    cases["-Inf"] = x
    cases["all NaN"] = torch.full(shape, NAN)
    out = {name: v.to(dtype) for name, v in cases.items()}
    out["all max"] = torch.full(shape, finfo.max, dtype=dtype)
    out["all -max"] = torch.full(shape, -finfo.max, dtype=dtype)
    return out


# ---- CPU reference vs the torch reference ------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_current_scaling_shapes(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    check_against_reference(x, CURRENT, "input")
    check_against_reference(x, CURRENT, "grad_output", dequant_dtypes=())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[::2], ids=str)
def test_delayed_scaling_shapes(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape) + 1)
    x = (torch.randn(shape, generator=g) * 30).to(dtype)
    check_against_reference(x, DELAYED, "input", scale=torch.tensor([3.7]))
    check_against_reference(x, DELAYED, "grad_output", scale=torch.tensor([1024.0]),
                            amax_history=torch.tensor([0.5]), dequant_dtypes=())


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_cases(dtype):
    for name, x in value_cases(dtype).items():
        for recipe, kw in ((CURRENT, {}), (DELAYED, {"scale": torch.tensor([0.125])})):
            for role in ("input", "grad_output"):
                try:
                    check_against_reference(x, recipe, role, dequant_dtypes=DTYPES, **kw)
                except AssertionError as e:
                    raise AssertionError(f"{name}, {type(recipe).__name__}, {role}: {e}") from e


def codec_sweep():
    """fp32 inputs for the FP8 codec: every bf16 pattern, its +-1 ulp fp32 neighbours (ties and
    near-ties of both formats, subnormals, saturation, Inf, NaN) and 2^20 random patterns."""
    b = torch.arange(65536, dtype=torch.int32) << 16
    g = torch.Generator().manual_seed(7)
    rand = torch.randint(-2**31, 2**31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    return torch.cat([b, b + 1, b - 1, rand]).view(torch.float32).reshape(-1, 1024)


def test_codec_sweep_with_scale_one():
    x = codec_sweep()
    for role in ("input", "grad_output"):  # E4M3 and E5M2
        check_against_reference(x, DELAYED, role, columnwise=False, scale=torch.ones(1))


def test_directions_and_transpose():
    x = torch.randn(70, 45)
    for rowwise, columnwise in ((True, False), (False, True), (True, True)):
        q = check_against_reference(x, CURRENT, rowwise=rowwise, columnwise=columnwise)
        assert q.has("rowwise") == rowwise and q.has("columnwise") == columnwise
    q = quantize(x, CURRENT)
    assert torch.equal(q.codes("columnwise"), q.codes("rowwise").t())
    assert q.data.shape == (70, 45) and q.data_t.shape == (45, 70)
    assert q.scale_inv.shape == (1, 1) and q.scale_inv_t is None and q.amax.shape == (1, 1)
    assert torch.equal(q.dequantize(), q.dequantize_direction("columnwise").t())


def test_strided_rows_and_3d_input():
    wide = torch.randn(40, 100) * 4
    wide[:, 61:] = 1e5  # outside the view: must not reach amax or the codes
    for x in (wide[:, :61], wide[:, 3:61], wide.bfloat16()[:, :61]):
        assert x.stride(0) == 100
        check_against_reference(x, CURRENT)
        check_against_reference(x, DELAYED, scale=torch.tensor([2.0]))
    x = torch.randn(3, 4, 33)
    q = check_against_reference(x, CURRENT)
    assert q.dequantize().shape == x.shape


def test_hybrid_and_e4m3_formats():
    x = torch.randn(8, 8)
    for recipe in (CURRENT, DELAYED):
        for role, fmt, dtype in (("input", "E4M3", torch.float8_e4m3fn),
                                 ("weight", "E4M3", torch.float8_e4m3fn),
                                 ("output", "E4M3", torch.float8_e4m3fn),
                                 ("grad_output", "E5M2", torch.float8_e5m2),
                                 ("grad_input", "E5M2", torch.float8_e5m2)):
            q = quantize(x, recipe, role)
            assert q.config.format == fmt and q.data.dtype == dtype and q.data_t.dtype == dtype
    for recipe in (Float8CurrentScaling(fp8_format=Format.E4M3), DelayedScaling(fp8_format=Format.E4M3)):
        q = check_against_reference(x * 1000, recipe, "grad_output")
        assert q.config.format == "E4M3" and q.data.dtype == torch.float8_e4m3fn
    # the two formats give different codes (the test would see a wrong fmax or codec)
    a, b = quantize(x, CURRENT, "input"), quantize(x, CURRENT, "grad_output")
    assert not torch.equal(a.codes(), b.codes())
    assert a.scale_inv.item() == pytest.approx(x.abs().max().item() / 448, rel=1e-6)
    assert b.scale_inv.item() == pytest.approx(x.abs().max().item() / 57344, rel=1e-6)


def test_current_scaling_scale_rules():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, 65, generator=g) * 3
    pow2 = Float8CurrentScaling(use_power_2_scales=True)
    assert te.quantizer_config(pow2, "input").power_2_scale
    for role in ("input", "grad_output"):
        q = check_against_reference(x, pow2, role)
        s = 1 / q.scale_inv.item()
        assert s == 2.0 ** round(torch.tensor(s).log2().item())  # a power of two
        assert q.scale_inv.item() != quantize(x, CURRENT, role).scale_inv.item()
    eps = Float8CurrentScaling(fp8_quant_fwd_inp=QParams(amax_epsilon=1.0))
    assert te.quantizer_config(eps, "input").amax_epsilon == 1.0
    small = x * 1e-3  # amax < eps: the scale is 448 / eps
    q = check_against_reference(small, eps, "input")
    assert q.scale_inv.item() == pytest.approx(1 / 448, rel=1e-7)
    assert q.amax.item() == small.abs().max().item()  # amax itself is the raw value
    q = check_against_reference(x, eps, "input")  # amax > eps: no effect
    assert q.scale_inv.item() == quantize(x, CURRENT).scale_inv.item()
    # zeros, Inf and NaN-only inputs give scale 1; FLT_MAX replaces an Inf scale
    for special in (torch.zeros(4, 4), torch.full((4, 4), float("inf")), torch.full((4, 4), NAN)):
        q = check_against_reference(special, CURRENT)
        assert q.scale_inv.item() == 1.0
    tiny = torch.full((2, 2), 1e-45)  # 448 / 1e-45 overflows
    q = check_against_reference(tiny, CURRENT)
    assert q.scale_inv.item() == (torch.ones(1) / FLT_MAX).item() > 0


def test_delayed_scaling_accumulates_into_the_history_slot():
    x = torch.randn(50, 20, generator=torch.Generator().manual_seed(4))
    amax = x.abs().max().item()
    history = torch.zeros(4, 3)
    history[0, 1] = 100.0  # bigger old value stays
    history[1:] = 7.0
    q = check_against_reference(x, DELAYED, scale=torch.tensor([2.0]), amax_history=history[0, 1:2])
    assert history[0, 1].item() == 100.0 and q.amax.data_ptr() == history[0, 1:2].data_ptr()
    history[0, 1] = 0.25  # smaller old value is replaced by max|x|
    check_against_reference(x, DELAYED, scale=torch.tensor([2.0]), amax_history=history[0, 1:2])
    assert history[0, 1].item() == amax
    history[0, 1] = -5.0  # a negative slot (never produced by tequant) is replaced too
    check_against_reference(x, DELAYED, scale=torch.tensor([2.0]), amax_history=history[0, 1:2])
    assert history[0, 1].item() == amax
    assert torch.equal(history[1:], torch.full((3, 3), 7.0)) and history[0, 0] == 0 and history[0, 2] == 0
    fresh = quantize(x, DELAYED)  # no slot: a fresh one starting at 0; no scale: 1.0
    assert fresh.amax.item() == amax and fresh.scale_inv.item() == 1.0
    assert same_bits(fresh.codes(), fp8_bits(x, "E4M3"))


def test_delayed_scaling_uses_the_given_scale():
    x = torch.randn(30, 40)
    for s in (1.0, 0.3, 448.0 / 3, 2.0**-20, 65536.0):
        q = check_against_reference(x, DELAYED, scale=torch.tensor([s]))
        assert q.scale_inv.item() == (torch.ones(1) / torch.tensor([s])).item()
    x = (torch.rand(30, 40) + 0.5) * torch.randn(30, 40).sign()
    big = quantize(x, DELAYED, scale=torch.tensor([1e6]))  # everything saturates to +-448
    assert set(big.codes().unique().tolist()) == {0x7E, 0xFE}


def test_empty_tensors():
    for shape in ((0, 5), (4, 0)):
        x = torch.zeros(shape)
        q = quantize(x, CURRENT)
        assert q.data.shape == shape and q.data_t.shape == shape[::-1]
        assert q.amax.item() == 0.0 and q.scale_inv.item() == 1.0
        slot = torch.tensor([3.0])
        q = quantize(x, DELAYED, scale=torch.tensor([4.0]), amax_history=slot)
        assert slot.item() == 3.0 and q.scale_inv.item() == 0.25


# ---- CUDA kernels vs the CPU reference ---------------------------------------------------------

def check_cuda_vs_cpu(x_cpu, recipe, role="input", rowwise=True, columnwise=True, scale=None,
                      history=None, x_cuda=None, dequant=True):
    """Quantizes the same values on CUDA (x_cuda, default x_cpu.cuda()) and CPU; all bits equal."""
    x_cuda = x_cpu.cuda() if x_cuda is None else x_cuda
    kw_cpu, kw_gpu = {}, {}
    if scale is not None:
        kw_cpu["scale"], kw_gpu["scale"] = scale, scale.cuda()
    if history is not None:
        kw_cpu["amax_history"], kw_gpu["amax_history"] = history.clone(), history.cuda()
    qc = quantize(x_cpu, recipe, role, rowwise, columnwise, **kw_cpu)
    qg = quantize(x_cuda, recipe, role, rowwise, columnwise, **kw_gpu)
    for name in ("data", "data_t", "scale_inv", "amax"):
        a, b = getattr(qc, name), getattr(qg, name)
        assert (a is None) == (b is None), name
        assert a is None or (b.is_cuda and same_bits(a, b)), name
    if dequant:
        for direction in [d for d, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on]:
            for dt in DTYPES:
                assert same_bits(qc.dequantize_direction(direction, dt),
                                 qg.dequantize_direction(direction, dt)), (direction, dt)
    return qc, qg


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_shapes_and_values(dtype):
    for shape in SHAPES + [(4096, 17), (17, 4096), (1, 70000), (70000, 1)]:
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 3).to(dtype)
        for rw, cw in ((True, True), (True, False), (False, True)):
            check_cuda_vs_cpu(x, CURRENT, "input", rw, cw, dequant=rw and cw)
            check_cuda_vs_cpu(x, DELAYED, "grad_output", rw, cw, scale=torch.tensor([123.0]),
                              history=torch.tensor([0.5]), dequant=False)
    for name, x in value_cases(dtype, (257, 131)).items():
        for role in ("input", "grad_output"):
            check_cuda_vs_cpu(x, CURRENT, role)
            check_cuda_vs_cpu(x, DELAYED, role, scale=torch.tensor([0.37]), history=torch.tensor([2.0]))
            check_cuda_vs_cpu(x, Float8CurrentScaling(use_power_2_scales=True), role, dequant=False)


@gpu
@pytest.mark.gpu
def test_cuda_codec_sweep_with_scale_one():
    """The kernels' hardware cvt against formats.h's codec (the CPU reference) on every pattern."""
    x = codec_sweep()
    for role in ("input", "grad_output"):
        check_cuda_vs_cpu(x, DELAYED, role, scale=torch.ones(1))
        check_cuda_vs_cpu(x, DELAYED, role, scale=torch.tensor([3.0]), dequant=False)


@gpu
@pytest.mark.gpu
def test_cuda_tile_edges_strides_and_alignment():
    g = torch.Generator().manual_seed(5)
    for rows, cols in ((128, 128), (255, 129), (129, 255), (256, 8), (8, 256), (144, 136),
                       (130, 16), (16, 130), (33, 1), (1, 33)):
        for dtype in DTYPES:
            x = (torch.randn(rows, cols, generator=g) * 5).to(dtype)
            check_cuda_vs_cpu(x, CURRENT, dequant=False)
    # strided rows: a pitch that keeps 16-byte row alignment, one that breaks it (fp32: 999 % 4),
    # a misaligned base, and a sub-block
    wide = torch.randn(300, 1040, generator=g) * 2
    views = (lambda t: t[:, :1000], lambda t: t[:, :999], lambda t: t[:, 1:1000],
             lambda t: t[:250, 7:500])
    for dtype in DTYPES:
        w = wide.to(dtype)
        wc = w.cuda()
        for view in views:
            check_cuda_vs_cpu(view(w), CURRENT, x_cuda=view(wc))
            check_cuda_vs_cpu(view(w), DELAYED, scale=torch.tensor([5.0]), x_cuda=view(wc),
                              dequant=False)
    oddc = torch.randn(64, 333, device="cuda")  # pitch 333: rows not 16-byte aligned
    check_cuda_vs_cpu(oddc[:, :300].cpu(), CURRENT, x_cuda=oddc[:, :300])


@gpu
@pytest.mark.gpu
def test_cuda_large():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8192, 8192, generator=g).bfloat16()
    x[1234, 4321] = 77.0
    check_cuda_vs_cpu(x, CURRENT, dequant=False)
    check_cuda_vs_cpu(x, DELAYED, "grad_output", scale=torch.tensor([300.0]),
                      history=torch.tensor([1.0]), dequant=False)
    x = torch.randn(4999, 3001, generator=g) * 100  # non-multiple of the tile, fp32
    x[4998, 3000] = -1e4
    check_cuda_vs_cpu(x, CURRENT, dequant=False)
    check_cuda_vs_cpu(x.half(), DELAYED, scale=torch.tensor([0.01]), history=torch.tensor([0.0]))
    x = torch.randn(16384, 4096, generator=g).bfloat16()
    check_cuda_vs_cpu(x, CURRENT, "grad_output", dequant=False)


@gpu
@pytest.mark.gpu
def test_cuda_delayed_accumulation_and_empty():
    x = torch.randn(300, 200).cuda()
    amax = x.abs().max()
    history = torch.zeros(2, 3, device="cuda")
    history[0, 1] = 100.0
    quantize(x, DELAYED, scale=torch.tensor([2.0], device="cuda"), amax_history=history[0, 1:2])
    assert history[0, 1].item() == 100.0
    history[0, 1] = 0.5
    quantize(x, DELAYED, scale=torch.tensor([2.0], device="cuda"), amax_history=history[0, 1:2])
    assert history[0, 1].item() == amax.item() and history[0, 0] == 0 and history[0, 2] == 0
    history[0, 1] = -3.0
    quantize(torch.zeros(300, 200, device="cuda"), DELAYED, amax_history=history[0, 1:2])
    assert bits(history[0, 1:2]).item() == 0  # a zero tensor still replaces a negative slot
    for shape in ((0, 5), (4, 0)):
        e = torch.zeros(shape, device="cuda")
        q = quantize(e, CURRENT)
        assert q.amax.item() == 0.0 and q.scale_inv.item() == 1.0
        slot = torch.tensor([3.0], device="cuda")
        q = quantize(e, DELAYED, scale=torch.tensor([4.0], device="cuda"), amax_history=slot)
        assert slot.item() == 3.0 and q.scale_inv.item() == 0.25


@gpu
@pytest.mark.gpu
def test_cuda_runs_on_the_current_stream():
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x = torch.randn(2048, 3072, device="cuda")
        x.mul_(3)  # queued on s; the quantizer must be ordered after it on s
        q1 = quantize(x, CURRENT)
        x2 = x * 2
        q2 = quantize(x2, CURRENT)
        qd = quantize(x2, DELAYED, scale=torch.tensor([0.5], device="cuda"))
        d = q2.dequantize()
    s.synchronize()
    ref = quantize(x.cpu(), CURRENT)
    assert same_bits(q1.data, ref.data) and same_bits(q1.data_t, ref.data_t)
    assert same_bits(q1.amax, ref.amax) and same_bits(q2.amax, ref.amax * 2)
    assert torch.equal(q2.codes(), q1.codes())  # scaling by 2 changes the scale, not the codes
    assert same_bits(qd.amax.cpu(), ref.amax * 2)
    assert same_bits(d, quantize(x2.cpu(), CURRENT).dequantize())


# Float8CurrentScaling by size (quantize_fp8.cu): <= 64K elements one single-CTA launch, <= 16M
# one cooperative launch (amax, grid barrier, cast), above that the amax kernel then the cast.
# In the cooperative launch a CTA with one tile keeps it in registers across the barrier; with
# more it keeps its last there and its first in shared memory, and loads any between again after
# it. On an H100 / H200 (4 bf16 CTAs per SM, 2 float32) 3001 x 3001 gives bf16 CTAs one or two
# ragged tiles and float32 CTAs two or three, 129 x 124000 bf16 CTAs three or four.
FUSED_SIZES = [((256, 256), torch.bfloat16), ((257, 256), torch.bfloat16),
               ((1, 65537), torch.float32), ((65537, 1), torch.float16),
               ((515, 259), torch.float32), ((999, 1000), torch.bfloat16),
               ((2048, 8192), torch.bfloat16), ((2049, 8192), torch.bfloat16),
               ((3001, 3001), torch.bfloat16), ((3001, 3001), torch.float32),
               ((3001, 3001), torch.float16), ((129, 124000), torch.bfloat16)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", FUSED_SIZES, ids=str)
def test_cuda_current_scaling_either_side_of_the_launch_bounds(shape, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])) * 4).to(dtype)
    x.view(-1)[x.numel() // 3] = 300.0  # one CTA's tile holds the amax
    for rw, cw in ((True, True), (True, False), (False, True)):
        check_cuda_vs_cpu(x, CURRENT, "input", rw, cw, dequant=False)
    check_cuda_vs_cpu(x, CURRENT, "grad_output", dequant=False)  # E5M2
    check_cuda_vs_cpu(x, Float8CurrentScaling(use_power_2_scales=True), dequant=False)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_one_launch_current_scaling_values(dtype):
    """NaN, Inf, all-NaN, +-max and zeros through the cooperative launch (> 64K elements)."""
    for name, x in value_cases(dtype, (515, 259)).items():
        for role in ("input", "grad_output"):
            check_cuda_vs_cpu(x, CURRENT, role, dequant=role == "input")


@gpu
@pytest.mark.gpu
def test_cuda_one_launch_current_scaling_in_a_cuda_graph_and_two_streams():
    """The cooperative launch is captured and replayed (new values: a new amax each replay), and
    two of them on two streams at once (each waits for room on the GPU) give the CPU's bits."""
    base = torch.randn(1024, 1536, generator=torch.Generator().manual_seed(3)).bfloat16()
    x = base.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        quantize(x, CURRENT)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = quantize(x, CURRENT)
    for factor in (1.0, 7.0, 0.125):
        x.copy_(base.cuda() * factor)
        graph.replay()
        ref = quantize(x.cpu(), CURRENT)
        for name in ("data", "data_t", "scale_inv", "amax"):
            assert same_bits(getattr(q, name), getattr(ref, name)), (factor, name)
    streams = [torch.cuda.Stream() for _ in range(2)]
    xs = [x * 3, x[:700] * 0.5]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    qs = []
    for s, xi in zip(streams, xs):
        with torch.cuda.stream(s):
            qs.append([quantize(xi, CURRENT) for _ in range(4)])
    torch.cuda.synchronize()
    for xi, q4 in zip(xs, qs):
        ref = quantize(xi.cpu(), CURRENT)
        for qi in q4:
            assert same_bits(qi.data, ref.data) and same_bits(qi.amax, ref.amax)


_ORDER_SCRIPT = """
import sys, torch, tequant as te
from tequant.recipe import Float8CurrentScaling
x = torch.randn(515, 259, generator=torch.Generator().manual_seed(5)).bfloat16()  # > 64K: one launch
cases = [(dtype, role, rw, cw) for dtype in (torch.float32, torch.bfloat16)
         for role in ("input", "grad_output") for rw, cw in ((True, False), (False, True), (True, True))]
if sys.argv[1] == "reversed":
    cases.reverse()
for dtype, role, rw, cw in cases:
    xs = x.to(dtype)
    q = te.ops.quantize(xs.cuda(), Float8CurrentScaling(), role=role, rowwise=rw, columnwise=cw)
    ref = te.ops.quantize(xs, Float8CurrentScaling(), role=role, rowwise=rw, columnwise=cw)
    for name in ("data", "data_t", "amax"):
        a, b = getattr(q, name), getattr(ref, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(
            a.cpu().view(torch.uint8), b.view(torch.uint8))), (dtype, role, rw, cw, name)
print("ok")
"""


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_cuda_one_launch_variants_in_either_order(order):
    """Each instance of the cooperative kernel sizes its grid from its own occupancy: a cache
    shared by the instances (they have one function type) once gave a heavier instance a lighter
    one's CTA count and cudaErrorCooperativeLaunchTooLarge, depending on which ran first in the
    process. A fresh process per order, every dtype x role x direction."""
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _ORDER_SCRIPT, order], env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
