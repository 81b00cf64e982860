"""NVFP4 with the random Hadamard transform (columnwise copy only) and reproducible stochastic
rounding (NUMERICS.md 2 "RHT", 3.2, 3.3). Bits of the CPU reference are compared with the torch
reference of tests/test_quantize_nvfp4.py (on tests/reference.py's rht_columnwise, sr_bytes and
e2m1_stochastic); the CUDA kernels with the CPU reference; plus the statistics that make SR and
the RHT useful: SR is unbiased and beats RN on the mean of many draws, and the transform cancels
in the wgrad product.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import tequant as te  # noqa: E402
from reference import rht_columnwise, rht_matrix  # noqa: E402
from tequant.recipe import NVFP4BlockScaling  # noqa: E402
from test_quantize_nvfp4 import (DTYPES, MEMBERS, PATHS, SHAPES, check_cuda_matches_cpu,  # noqa: E402
                                 check_reference, f32_bits, gpu, on_cuda, quantize, values)

MODES = {  # name: (rht, sr, two_d)
    "rht": (True, False, False),
    "sr": (False, True, False),
    "rht_sr": (True, True, False),
    "2d_sr": (False, True, True),
}


def mode(name):
    rht, sr, two_d = MODES[name]
    return dict(rht=rht, sr=sr, two_d=two_d)


# ---- CPU reference vs torch reference ------------------------------------------------------

@pytest.mark.parametrize("name", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_matches_torch_reference(shape, dtype, name):
    x = values("randn", shape, dtype, seed=shape[0] * 7 + shape[1])
    check_reference(x, rng=(shape[0] * 1000 + shape[1], 2**40 + 17), **mode(name))


@pytest.mark.parametrize("name", list(MODES))
@pytest.mark.parametrize("kind", ["ramp", "zeros", "outlier", "nan_inf", "nan", "negative",
                                  "max", "tiny"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_matches_torch_reference_values(dtype, kind, name):
    check_reference(values(kind, (48, 64), dtype), rng=(7, 11), **mode(name),
                    dequant_dtypes=(torch.float32, torch.bfloat16))


def test_cpu_rht_boundary_linspace_and_strided():
    base = torch.linspace(-12, 12, 128)
    x = torch.stack([base + (1e-3 if r % 2 else -1e-3) for r in range(32)]).bfloat16()
    check_reference(x, rht=True)
    check_reference(x, rht=True, sr=True, rng=(5, 6))
    wide = values("randn", (64, 176), torch.bfloat16)
    check_reference(wide[:, :160], rht=True, sr=True, rng=(1, 2))


@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
def test_cpu_rht_single_direction(usage):
    x = values("randn", (64, 48), torch.bfloat16)
    check_reference(x, rht=True, sr=True, rowwise=usage == "rowwise",
                    columnwise=usage == "columnwise")


def test_default_recipe_roles():
    """NVFP4BlockScaling() defaults: input = RHT columnwise, weight = 2D, grad_output = RHT+SR."""
    recipe = NVFP4BlockScaling()
    x = values("randn", (64, 64), torch.bfloat16)
    cfg = {role: te.quantizer_config(recipe, role) for role in ("input", "weight", "grad_output")}
    assert (cfg["input"].rht, cfg["input"].stochastic_rounding, cfg["input"].two_d) == (True, False, False)
    assert (cfg["weight"].rht, cfg["weight"].stochastic_rounding, cfg["weight"].two_d) == (False, False, True)
    assert (cfg["grad_output"].rht, cfg["grad_output"].stochastic_rounding) == (True, True)
    for role, opts in (("input", mode("rht")), ("grad_output", mode("rht_sr")),
                       ("weight", dict(rht=False, sr=False, two_d=True))):
        q = te.ops.quantize(x, recipe, role, rowwise=True, columnwise=True, rng=(3, 4))
        ref = check_reference(x, rng=(3, 4), **opts)
        for member in MEMBERS:
            assert torch.equal(getattr(q, member).view(torch.uint8),
                               getattr(ref, member).view(torch.uint8)), (role, member)


# ---- RHT properties -------------------------------------------------------------------------

def test_rht_only_on_columnwise():
    x = values("randn", (64, 96), torch.bfloat16)
    plain, rht = quantize(x), quantize(x, rht=True)
    for member in ("data", "scale_inv", "amax"):  # rowwise never transformed
        assert torch.equal(getattr(plain, member).view(torch.uint8), getattr(rht, member).view(torch.uint8))
    assert not torch.equal(plain.data_t, rht.data_t)
    assert float(rht.amax_t) != float(rht.amax)  # post-RHT amax
    # The columnwise values are the transform of x^T: R is orthogonal, so applying R^T along M
    # to the dequantized columnwise copy gives back approximately x^T.
    r = rht_matrix()
    deq_t = rht.dequantize_direction("columnwise")  # [K, M]
    back = (deq_t.reshape(96, -1, 16) @ r.t()).reshape(96, 64)
    err = (back - x.float().t()).norm() / x.float().norm()
    assert err < 0.15, err


def test_rht_rounds_fp32_and_fp16_inputs_to_bf16():
    x = values("randn", (64, 64), torch.float32)
    from_bf16 = quantize(x.bfloat16(), rht=True, rowwise=False)
    for dtype in (torch.float32, torch.float16):
        q = quantize(x.to(dtype), rht=True, rowwise=False)
        if dtype == torch.float32:
            assert torch.equal(q.data_t, from_bf16.data_t)
            assert torch.equal(f32_bits(q.amax_t), f32_bits(from_bf16.amax_t))
        assert torch.equal(f32_bits(q.amax_t), f32_bits(rht_columnwise(x.to(dtype)).abs().max()))


def rht_sequential(x):
    """The transform summed in index order (tequant's definition before the butterfly): used
    only to show that the order is observable and that tequant follows the butterfly."""
    r = rht_matrix()
    xt = x.float().t().reshape(x.shape[1], -1, 16).to(torch.bfloat16).float()
    out = torch.zeros_like(xt)
    for i in range(16):
        out = out + xt[..., i:i + 1] * r[i]
    return out.to(torch.bfloat16).float().reshape(x.shape[1], x.shape[0])


def test_rht_butterfly_is_the_matrix():
    """Where every partial sum is exact (small integers), the butterfly equals x^T R exactly."""
    g = torch.Generator().manual_seed(8)
    x = torch.randint(-64, 65, (64, 48), generator=g).float()
    exact = (x.t().reshape(48, -1, 16) @ rht_matrix()).reshape(48, 64)
    assert torch.equal(rht_columnwise(x), exact.bfloat16().float())
    q = quantize(x.bfloat16(), rht=True, rowwise=False)
    assert torch.equal(f32_bits(q.amax_t), f32_bits(exact.bfloat16().float().abs().max()))


def test_rht_follows_the_butterfly_order():
    """The fp32 summation order is observable: on this group (found by search: seed 67, column
    308 of wide-range bf16 data) the largest bf16 output is 69.0 in butterfly order and 69.5
    summed in index order; the quantizer's post-RHT amax is the butterfly's."""
    g = torch.Generator().manual_seed(67)
    x = (torch.randn(16, 4096, generator=g) *
         torch.exp2(torch.randint(-8, 8, (16, 4096), generator=g).float())).bfloat16()
    x = x[:, 308:309].repeat(1, 16)  # one group, 16 identical columns
    assert float(rht_columnwise(x).abs().max()) == 69.0
    assert float(rht_sequential(x).abs().max()) == 69.5
    q = check_reference(x, rht=True, sr=True, rng=(1, 2))
    assert float(q.amax_t) == 69.0


def wgrad_error(rht, seed=0, m=512, k=64, n=48):
    g = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
    recipe = NVFP4BlockScaling(disable_rht=not rht, disable_stochastic_rounding=True)
    xq = te.ops.quantize(x, recipe, "input", rowwise=False, columnwise=True)
    dyq = te.ops.quantize(dy, recipe, "grad_output", rowwise=False, columnwise=True)
    assert xq.config.rht == rht and dyq.config.rht == rht
    x_t, dy_t = xq.dequantize_direction("columnwise"), dyq.dequantize_direction("columnwise")
    assert x_t.shape == (k, m) and dy_t.shape == (n, m)
    exact = x.t().double() @ dy.double()
    err = (x_t.double() @ dy_t.double().t() - exact).norm() / exact.norm()
    mixed = (x_t.double() @ dy.t().double().t() - exact).norm() / exact.norm()  # only x transformed
    return float(err), float(mixed)


def test_rht_cancels_in_wgrad():
    err_rht, mixed = wgrad_error(rht=True)
    err_plain, _ = wgrad_error(rht=False)
    # NVFP4 on randn: ~9% relative error per operand, ~13% on the product over M = 512 (both
    # operands' errors add); with the RHT the same (the transform cancels: R R^T = I).
    assert 0 < err_rht < 0.2 and 0 < err_plain < 0.2, (err_rht, err_plain)
    assert err_rht < 1.5 * err_plain, (err_rht, err_plain)
    assert mixed > 0.5, mixed  # one transformed operand alone does not cancel


# ---- stochastic rounding ---------------------------------------------------------------------

def test_sr_reproducible_with_rng_and_differs_across_offsets():
    x = values("randn", (64, 64), torch.float32)
    a, b = quantize(x, sr=True, rng=(10, 20)), quantize(x, sr=True, rng=(10, 20))
    c, d = quantize(x, sr=True, rng=(10, 21)), quantize(x, sr=True, rng=(11, 20))
    assert torch.equal(a.data, b.data) and torch.equal(a.data_t, b.data_t)
    assert not torch.equal(a.data, c.data) and not torch.equal(a.data, d.data)
    assert not torch.equal(a.data_t, c.data_t)
    assert torch.equal(a.scale_inv, c.scale_inv)  # SR touches elements only


def _signed(v):
    return v - 2**64 if v >= 2**63 else v


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
@pytest.mark.parametrize("name", ["sr", "rht_sr", "2d_sr"])
def test_sr_rng_tensor_gives_the_bits_of_the_same_ints(device, name):
    """rng as an int64 device tensor (read by the kernel when it runs, for CUDA graphs) rounds
    exactly as the same (seed, offset) passed as ints, including values past 2**63."""
    x = values("randn", (48, 80), torch.bfloat16, seed=3).to(device)
    for seed, offset in [(10, 20), (2**64 - 5, 2**63 + 9), (0, 2**40 + 1)]:
        held = torch.tensor([_signed(seed), _signed(offset)], dtype=torch.int64, device=device)
        a = quantize(x, rng=(seed, offset), **mode(name))
        b = quantize(x, rng=held, **mode(name))
        for m in MEMBERS:
            assert torch.equal(getattr(a, m), getattr(b, m)), (seed, offset, m)


def test_sr_rng_tensor_errors():
    x = torch.randn(32, 32)
    recipe = NVFP4BlockScaling(disable_rht=True)
    for bad in (torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int64),
                torch.zeros(2, dtype=torch.int64, device="meta")):
        with pytest.raises(ValueError, match="two int64 .seed, offset. on x's device"):
            te.ops.quantize(x, recipe, "grad_output", rng=bad)
    # The core refuses a run-time rng for a quantizer that does not round stochastically.
    config = te._C.quantizer_config(recipe, "input")
    assert not config.stochastic_rounding
    with pytest.raises(ValueError, match="rng_state is set but the config does not round"):
        te._C._quantize(x, config, 1, None, None, torch.zeros(2, dtype=torch.int64), None)


def _sr_generator_draws(device):
    x = values("randn", (64, 64), torch.float32).to(device)
    recipe = NVFP4BlockScaling(disable_rht=True)  # grad_output: SR on, RHT off
    torch.manual_seed(1234)
    a = te.ops.quantize(x, recipe, "grad_output", rowwise=True, columnwise=True)
    b = te.ops.quantize(x, recipe, "grad_output", rowwise=True, columnwise=True)
    torch.manual_seed(1234)
    a2 = te.ops.quantize(x, recipe, "grad_output", rowwise=True, columnwise=True)
    assert a.config.stochastic_rounding
    assert not torch.equal(a.data, b.data), "the generator must advance between calls"
    assert torch.equal(a.data, a2.data) and torch.equal(a.data_t, a2.data_t), "manual_seed reproduces"


def test_sr_default_generator_cpu():
    _sr_generator_draws("cpu")


def sr_draws(x, draws, direction, rht=False, device="cpu"):
    xd = x.to(device)
    total = torch.zeros_like(x, dtype=torch.float64) if direction == "rowwise" else \
        torch.zeros_like(x.t(), dtype=torch.float64)
    for i in range(draws):
        q = quantize(xd, rht=rht, sr=True, rowwise=direction == "rowwise",
                     columnwise=direction == "columnwise", rng=(42, 1000 + i))
        total += q.dequantize_direction(direction).double().cpu()
    return total / draws


def sr_expectation(target, dec):
    """E[SR(v)] in x's units for v = |target| / dec in the format's range: between the grid
    neighbours lo < v < lo + step, SR (NUMERICS 3.2) rounds up for the u in 0..255 with
    u/256 >= 1 - f, f = (v - lo) / step, i.e. with probability floor(256 f) / 256 (8 random
    bits: a bias toward zero of step/512 on average, part of the rule)."""
    v = target.abs() / dec
    step = torch.where(v < 2, 0.5, torch.where(v < 4, 1.0, 2.0))
    lo = torch.floor(v / step) * step
    f = (v - lo) / step
    return torch.sign(target) * (lo + step * torch.floor(256 * f) / 256) * dec, step * dec


def sr_bias_z(mean, target, dec, draws):
    """Standardized sum of signed errors of a mean of SR draws against SR's expectation, over
    the elements that do not saturate; each draw's variance is at most (step * dec)^2 / 4."""
    inside = target.abs() / dec <= 6 * (1 - 1e-6)
    expected, step = sr_expectation(target, dec)
    err = ((mean - expected) * torch.sign(target))[inside]
    var = (step[inside] ** 2 / 4) / draws
    return float(err.sum() / var.sum().sqrt()), int(inside.sum())


@pytest.mark.parametrize("direction,rht", [("rowwise", False), ("columnwise", False),
                                           ("columnwise", True)])
def test_sr_unbiased_and_beats_rn(direction, rht):
    """TE's SR test: the RMSE of the mean of many SR draws is below RN's RMSE. And the mean
    matches SR's expectation (unbiased up to the rule's 8-bit resolution) where the format does
    not clip: a block's largest elements can scale past 6 (the E4M3 block scale is rounded to
    nearest, possibly down) and saturate in any rounding mode, so they are left out."""
    x = values("randn", (128, 256), torch.float32, seed=5)
    target = x.double() if direction == "rowwise" else x.double().t()
    if rht:
        target = rht_columnwise(x).double()  # columnwise values are RN_bf16(RHT(x^T))
    draws = 48
    mean = sr_draws(x, draws, direction, rht)
    q_rn = quantize(x, rht=rht, rowwise=direction == "rowwise", columnwise=direction == "columnwise")
    rn = q_rn.dequantize_direction(direction).double()
    rmse_sr = (mean - target).pow(2).mean().sqrt()
    rmse_rn = (rn - target).pow(2).mean().sqrt()
    assert rmse_sr < 0.5 * rmse_rn, (float(rmse_sr), float(rmse_rn))
    amax = float(q_rn.amax if direction == "rowwise" else q_rn.amax_t)
    dec = q_rn.scales(direction).double().repeat_interleave(16, 1) * amax / 2688
    z, n_inside = sr_bias_z(mean, target, dec, draws)
    assert n_inside > 0.8 * target.numel()
    assert abs(z) < 4, z
    # The statistic can fail: RN in place of the SR mean, or SR with a truncated u, is far off.
    z_rn, _ = sr_bias_z(rn, target, dec, draws)
    assert abs(z_rn) > 10, z_rn
    z_shift, _ = sr_bias_z(mean - torch.sign(target) * dec / 64, target, dec, draws)
    assert abs(z_shift) > 10, z_shift


# ---- CUDA vs CPU reference ------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("name", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(2048, 2048), (1024, 2048), (272, 4112)])
def test_cuda_matches_cpu(shape, dtype, name):
    x = values("randn", shape, dtype, seed=shape[1])
    check_cuda_matches_cpu(x, rng=(shape[0], 2**33 + shape[1]), **mode(name))


@gpu
@pytest.mark.parametrize("name", list(MODES))
@pytest.mark.parametrize("kind", ["ramp", "zeros", "outlier", "nan_inf", "nan", "negative",
                                  "max", "tiny"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", list(PATHS))
def test_cuda_matches_cpu_values(path, dtype, kind, name):
    check_cuda_matches_cpu(values(kind, PATHS[path], dtype), **mode(name))


@gpu
@pytest.mark.parametrize("tall", [1, 96], ids=["one_cta", "tiled"])
def test_cuda_rht_strided_single_direction_stream(tall):
    """Each case at its own rows (one CTA) and at 96 times as many (> 64K elements: tiled)."""
    def views(shape, dtype, cols=None, offset=None):
        shape = (shape[0] * tall, shape[1])

        def make(device):
            base = values("randn", shape, dtype).to(device)
            if offset is not None:  # a flat slice whose first element is not 16-byte aligned
                return base.reshape(-1)[offset:offset + 32 * tall * 32].reshape(32 * tall, 32)
            return base[:, :cols]
        return on_cuda(make)

    x, x_gpu = views((96, 200), torch.bfloat16, cols=176)
    for usage in ("rowwise", "columnwise"):
        check_cuda_matches_cpu(x, rht=True, sr=True, rowwise=usage == "rowwise",
                               columnwise=usage == "columnwise", x_gpu=x_gpu)
    x, x_gpu = views((64, 33), torch.bfloat16, cols=32)  # rows only 2-byte aligned
    check_cuda_matches_cpu(x, rht=True, sr=True, x_gpu=x_gpu)
    check_cuda_matches_cpu(x, two_d=True, x_gpu=x_gpu)
    x, x_gpu = views((48, 17), torch.float32, cols=16)  # rows 4- but not 16-byte aligned
    check_cuda_matches_cpu(x, rht=True, x_gpu=x_gpu)
    check_cuda_matches_cpu(x, two_d=True, sr=True, x_gpu=x_gpu)
    x, x_gpu = views((32, 40), torch.float16, offset=4)  # base 8 bytes past 16-byte alignment
    assert x_gpu.data_ptr() % 16 == 8
    check_cuda_matches_cpu(x, rht=True, sr=True, x_gpu=x_gpu)
    check_cuda_matches_cpu(x, x_gpu=x_gpu)
    check_cuda_matches_cpu(values("randn", (512, 256), torch.bfloat16), rht=True, sr=True,
                           stream=torch.cuda.Stream())


def e2m1_sweep(rows=2048, cols=4096):
    """fp32 x whose row blocks quantize with encode factor exactly 1 (global amax 2688 gives
    S_enc = 1, a block amax of 6 gives s_b = 1): element 0 of each block is 6, the other 15 walk
    the fp32 patterns of [0, 6] (every 137th, alternating signs), so the kernel's E2M1
    conversion (RN and SR) meets ~8M distinct values, ties and subnormals included."""
    n = rows * cols
    bits = (torch.arange(n, dtype=torch.int64) * 137 % 0x40C00001).to(torch.int32)
    x = bits.view(torch.float32).reshape(rows, cols).clone()
    x[:, 1::2] *= -1
    x[:, 0::16] = 6.0
    x[0, 0] = 2688.0
    x[0, 1:16] = 0.0
    return x


@gpu
@pytest.mark.parametrize("name", ["rn", "sr"])
def test_cuda_e2m1_conversion_sweep(name):
    x = e2m1_sweep()
    q = check_cuda_matches_cpu(x, sr=name == "sr", rng=(77, 3), dequant=False)
    assert float(q.scales("rowwise")[5, 3].float()) == 1.0  # the sweep really has scale 1


@gpu
def test_sr_default_generator_cuda():
    _sr_generator_draws("cuda")


@gpu
@pytest.mark.parametrize("shape,name", [((8192, 5120), "rht_sr"), ((8192, 8192), "rht"),
                                        ((5120, 8192), "sr")])
def test_cuda_large(shape, name):
    check_cuda_matches_cpu(values("randn", shape, torch.bfloat16, seed=11), dequant=False,
                           **mode(name))
