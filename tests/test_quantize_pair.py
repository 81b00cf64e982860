"""tq_quantize_pair (csrc/core/quantize.c; cuda/quantize_fp8_pair.cu, cuda/quantize_fp8_block.cu):
two tensors quantized as two tq_quantize calls would, bit for bit, in one launch where both are
bfloat16, both directions, one element format and either Float8CurrentScaling with their own
amax and at most 16M elements each (fused_pair_kernel, cooperative), DelayedScaling with their
state's scale (delayed_pair_kernel) or Float8BlockScaling, each its own block shape
(quantize_pair_kernel); te.Linear's x and W in its forward. Otherwise one after the other. Each
tensor's own quantization is tested against independent references in tests/test_quantize_fp8.py
and tests/test_quantize_fp8_block.py; here the pair's members (and a DelayedScaling amax slot)
must equal the single calls' (every member, every bit), and the profile shows which launches ran.
"""
import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                            MXFP8BlockScaling, NVFP4BlockScaling)
from test_norm_kernels import bits  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
BOTH = 3
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
E4M3 = te.quantizer_config(Float8CurrentScaling(), "input")
E4M3_W = te.quantizer_config(Float8CurrentScaling(), "weight")
E5M2 = te.quantizer_config(Float8CurrentScaling(), "grad_output")  # HYBRID: E5M2 gradients


def randn(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def assert_same(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), (what, i)
        if a is not None:
            a8, b8 = (t.view(torch.uint8) if t.element_size() == 1 else t for t in (a, b))
            assert torch.equal(bits(a8.cpu()), bits(b8.cpu())), (what, i)


def pair_inputs(s0, s1, seed, dtype=BF16, big=0):
    """Two bfloat16 tensors at different scales with a NaN (ignored by amaxes), a -0 (kept) and
    one huge element in tensor `big` (its amax far above the other's)."""
    x0 = randn(s0, dtype, "cuda", seed=seed, scale=3.0)
    x1 = randn(s1, dtype, "cuda", seed=seed + 1, scale=0.02)
    x0[5 % s0[0], 7 % s0[1]], x1[3 % s1[0], 2 % s1[1]] = float("nan"), -0.0
    (x0, x1)[big][-1, -1] = 1e30
    return x0, x1


def kernels_of(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def check_pair(x0, c0, x1, c1):
    got = _C._quantize_pair(x0, c0, x1, c1)
    for x, c, g in ((x0, c0, got[0]), (x1, c1, got[1])):
        assert_same(g, _C._quantize(x, c, BOTH, None, None, None, None), (tuple(x.shape), x.dtype))
    return got


def check_one_launch(x0, c0, x1, c1, kernel):
    """The pair runs as one launch of `kernel` and equals the single calls."""
    _, names = kernels_of(lambda: _C._quantize_pair(x0, c0, x1, c1))
    assert len(names) == 1 and kernel in names[0], names
    return check_pair(x0, c0, x1, c1)


# (x0 shape, x1 shape, dtype, configs): one tile per CTA and several; ragged edges; either first
PAIRS = [
    ((8192, 512), (1536, 512), BF16, (E4M3, E4M3_W)),     # a d=512 te.Linear: one tile per CTA
    ((8192, 2048), (512, 2048), BF16, (E4M3, E4M3_W)),    # more tiles than CTAs
    ((1000, 1000), (333, 1000), BF16, (E4M3, E4M3_W)),    # ragged
    ((3001, 3001), (333, 1000), BF16, (E4M3, E4M3_W)),    # ragged, one or two tiles per CTA
    ((300, 300), (4100, 1030), BF16, (E5M2, E5M2)),       # the larger one second, E5M2
    ((4096, 4096), (4096, 4096), BF16, (E4M3, E4M3_W)),   # 16M elements each (the largest)
    ((128, 256), (256, 256), BF16, (E4M3, E4M3_W)),       # small: one launch, not two single-CTA
    ((100, 100), (512, 512), BF16, (E4M3, E4M3_W)),       # a small x with a medium W
    ((1, 16), (16, 16), BF16, (E5M2, E5M2)),              # one row, part of one tile each
]


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0][0]}x{p[0][1]}+{p[1][0]}x{p[1][1]}")
def test_cuda_pair_is_two_quantizations_in_one_launch(pair):
    s0, s1, dtype, (c0, c1) = pair
    x0, x1 = pair_inputs(s0, s1, seed=1, dtype=dtype)
    check_one_launch(x0, c0, x1, c1, "fused_pair_kernel")


@CUDA
@pytest.mark.gpu
def test_cuda_pair_of_zeros_and_of_one_constant():
    """All-zero x: amax 0 (the scale's epsilon rule); a constant W: every code the same."""
    x0 = torch.zeros(2048, 512, dtype=BF16, device="cuda")
    x1 = torch.full((512, 512), -0.375, dtype=BF16, device="cuda")
    check_pair(x0, E4M3, x1, E4M3_W)


# pairs that are not one launch's: quantized one after the other, the same bits
DECLINED = [
    ((8192, 512), F32, (512, 512), F32, E4M3, E4M3_W, "float32"),
    ((8192, 512), F16, (512, 512), F16, E4M3, E4M3_W, "float16"),
    ((8192, 512), BF16, (512, 512), F16, E4M3, E4M3_W, "two dtypes"),
    ((8192, 4096), BF16, (512, 512), BF16, E4M3, E4M3_W, "32M elements (the amax pass)"),
    ((8192, 512), BF16, (512, 512), BF16, E4M3, E5M2, "two element formats"),
]


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("case", DECLINED, ids=lambda c: c[-1])
def test_cuda_declined_pairs_run_one_after_the_other(case):
    s0, d0, s1, d1, c0, c1, _ = case
    x0, x1 = randn(s0, d0, "cuda", seed=3), randn(s1, d1, "cuda", seed=4)
    _, names = kernels_of(lambda: _C._quantize_pair(x0, c0, x1, c1))
    assert not any("fused_pair_kernel" in n for n in names), names
    check_pair(x0, c0, x1, c1)


D_IN = te.quantizer_config(DelayedScaling(), "input")
D_W = te.quantizer_config(DelayedScaling(), "weight")
D_DY = te.quantizer_config(DelayedScaling(), "grad_output")  # HYBRID: E5M2


def delayed_state(scale, amax):
    return (torch.tensor([scale], dtype=F32, device="cuda"),
            torch.tensor([amax], dtype=F32, device="cuda"))


def check_delayed_pair(x0, c0, x1, c1, states):
    """The pair against two _quantize calls with copies of the states: members and amax slots."""
    copies = [tuple(t.clone() for t in st) for st in states]
    got = _C._quantize_pair(x0, c0, x1, c1, *states)
    for x, c, g, (scale, amax) in ((x0, c0, got[0], copies[0]), (x1, c1, got[1], copies[1])):
        want = _C._quantize(x, c, BOTH, scale, amax, None, None)
        assert_same(g, want, (tuple(x.shape), "delayed"))
    for st, cp in zip(states, copies):
        assert torch.equal(bits(st[1].cpu()), bits(cp[1].cpu()))  # the slots, max-accumulated
    return got


# (x0 shape, x1 shape, configs, states): a d=512 te.Linear; ragged; tiny; E5M2; a slot above
DELAYED_PAIRS = [
    ((8192, 512), (1536, 512), (D_IN, D_W), ((3.5, 0.0), (900.0, 0.0))),
    ((1000, 1000), (333, 1000), (D_IN, D_W), ((0.25, 0.0), (1.0, 0.0))),
    ((16, 32), (48, 32), (D_IN, D_W), ((1.0, 0.0), (2.0, 0.0))),
    ((300, 300), (4100, 1030), (D_DY, D_DY), ((1e-3, 0.0), (57.0, 0.0))),
    ((8192, 512), (512, 512), (D_IN, D_W), ((1.0, 1e6), (1.0, 0.5))),  # x's slot stays above
]


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("pair", DELAYED_PAIRS,
                         ids=lambda p: f"{p[0][0]}x{p[0][1]}+{p[1][0]}x{p[1][1]}")
def test_cuda_delayed_pair_is_two_quantizations_in_one_launch(pair):
    s0, s1, (c0, c1), (st0, st1) = pair
    x0, x1 = pair_inputs(s0, s1, seed=11, big=1)  # x1's 1e30 saturates (satfinite)
    states = (delayed_state(*st0), delayed_state(*st1))
    _, names = kernels_of(lambda: _C._quantize_pair(x0, c0, x1, c1, *states))
    assert len(names) == 1 and "delayed_pair_kernel" in names[0], names
    check_delayed_pair(x0, c0, x1, c1, (delayed_state(*st0), delayed_state(*st1)))


@CUDA
@pytest.mark.gpu
def test_cuda_delayed_pairs_declined():
    """float32, a missing state (a scale of 1 made for the call) and a DelayedScaling x with a
    current-scaling W run one after the other, with the same bits."""
    x0, x1 = randn((2048, 512), BF16, "cuda", 13), randn((512, 512), BF16, "cuda", 14)
    states = (delayed_state(2.0, 0.0), delayed_state(4.0, 0.0))
    cases = [(x0.float(), D_IN, x1.float(), D_W, states), (x0, D_IN, x1, D_W, (None, None)),
             (x0, D_IN, x1, E4M3_W, (states[0], None))]
    for a0, c0, a1, c1, sts in cases:
        _, names = kernels_of(lambda: _C._quantize_pair(a0, c0, a1, c1, *sts))
        assert not any("pair_kernel" in n for n in names), names
    check_delayed_pair(x0.float(), D_IN, x1.float(), D_W,
                       (delayed_state(2.0, 0.0), delayed_state(4.0, 0.0)))


@CUDA
@pytest.mark.gpu
def test_cuda_other_recipes_pair_as_two_calls():
    """DelayedScaling without states (a scale of 1 made per call) and the emulated formats."""
    x0, x1 = randn((4096, 512), BF16, "cuda", 5), randn((512, 512), BF16, "cuda", 6)
    for recipe in (DelayedScaling(), MXFP8BlockScaling()):
        c0, c1 = te.quantizer_config(recipe, "input"), te.quantizer_config(recipe, "weight")
        _, names = kernels_of(lambda: _C._quantize_pair(x0, c0, x1, c1))
        assert not any("pair_kernel" in n for n in names), names
        check_pair(x0, c0, x1, c1)


B_IN = te.quantizer_config(Float8BlockScaling(), "input")    # 1x128 blocks
B_W = te.quantizer_config(Float8BlockScaling(), "weight")    # 128x128 blocks (2D)
B_DY = te.quantizer_config(Float8BlockScaling(fp8_format=Format.HYBRID), "grad_output")  # E5M2
BLOCK_PAIRS = [
    ((8192, 512), (1536, 512), (B_IN, B_W)),     # a d=512 te.Linear
    ((1000, 1000), (333, 1000), (B_IN, B_W)),    # ragged
    ((16, 32), (48, 32), (B_W, B_IN)),           # tiny, the 2D one first
    ((300, 300), (4100, 1030), (B_IN, B_IN)),    # both 1x128
    ((256, 384), (128, 256), (B_W, B_W)),        # both 2D
    ((640, 256), (256, 256), (B_DY, B_DY)),      # E5M2
]


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("pair", BLOCK_PAIRS, ids=lambda p: f"{p[0][0]}x{p[0][1]}+{p[1][0]}x{p[1][1]}")
def test_cuda_block_pair_is_two_quantizations_in_one_launch(pair):
    s0, s1, (c0, c1) = pair
    x0, x1 = pair_inputs(s0, s1, seed=21, big=1)
    check_one_launch(x0, c0, x1, c1, "quantize_pair_kernel")


@CUDA
@pytest.mark.gpu
def test_cuda_block_pairs_declined():
    """float32, two element formats (E5M2 grad_output, E4M3 W), an empty x: one after the
    other, the same bits."""
    x0, x1 = randn((2048, 512), BF16, "cuda", 23), randn((512, 512), BF16, "cuda", 24)
    for a0, c0, a1, c1 in ((x0.float(), B_IN, x1.float(), B_W), (x0, B_DY, x1, B_W),
                           (x0[:0], B_IN, x1, B_W)):
        _, names = kernels_of(lambda: _C._quantize_pair(a0, c0, a1, c1))
        assert not any("pair_kernel" in n for n in names), names
        check_pair(a0, c0, a1, c1)


@CUDA
@pytest.mark.gpu
def test_cuda_linear_forward_quantizes_x_and_w_in_one_launch():
    """te.Linear's training forward under Float8CurrentScaling: x and W in the pair's launch
    (no single cast of either), and the same output as with W cached from before (W then
    quantized alone the step before, x alone now)."""
    torch.manual_seed(0)
    lin = te.Linear(512, 1536, params_dtype=BF16, device="cuda")
    x = torch.randn(4096, 512, dtype=BF16, device="cuda", requires_grad=True)
    recipe = Float8CurrentScaling()

    def fwd(first=None):
        with te.autocast(recipe=recipe):
            return lin(x, is_first_microbatch=first)

    y, names = kernels_of(fwd)
    assert sum("fused_pair_kernel" in n for n in names) == 1, names
    assert not any("fused_current_kernel" in n for n in names), names
    fwd(first=True)                       # W quantized and kept (alone or with x)
    y_cached, names = kernels_of(lambda: fwd(first=False))
    assert not any("fused_pair_kernel" in n for n in names), names  # x alone
    assert torch.equal(y, y_cached)


@CUDA
@pytest.mark.gpu
def test_cuda_linear_forward_block_quantizes_x_and_w_in_one_launch():
    """Float8BlockScaling: x (1x128) and W (128x128) in one quantize_pair_kernel, no single
    quantize launch, the output that of W kept from before."""
    torch.manual_seed(0)
    lin = te.Linear(512, 1536, params_dtype=BF16, device="cuda")
    x = torch.randn(4096, 512, dtype=BF16, device="cuda", requires_grad=True)
    with te.autocast(recipe=Float8BlockScaling()):
        y, names = kernels_of(lambda: lin(x, is_first_microbatch=True))
        assert sum("quantize_pair_kernel" in n for n in names) == 1, names
        assert not any("quantize_kernel" in n and "pair" not in n for n in names), names
        y_cached, names = kernels_of(lambda: lin(x, is_first_microbatch=False))
        assert not any("pair_kernel" in n for n in names), names
    assert torch.equal(y, y_cached)


@CUDA
@pytest.mark.gpu
def test_cuda_linear_forward_delayed_quantizes_x_and_w_in_one_launch():
    """The same under DelayedScaling (one autocast: one scale for both calls): x and W in one
    delayed_pair_kernel and no single cast, the output equal to the next call's, which quantizes
    x alone and multiplies the W the first call kept."""
    torch.manual_seed(0)
    lin = te.Linear(512, 1536, params_dtype=BF16, device="cuda")
    x = torch.randn(4096, 512, dtype=BF16, device="cuda")
    with te.autocast(recipe=DelayedScaling()):  # a first step: the scales move off 1
        lin(x)
    with te.autocast(recipe=DelayedScaling()):
        y, names = kernels_of(lambda: lin(x, is_first_microbatch=True))
        assert sum("delayed_pair_kernel" in n for n in names) == 1, names
        assert not any("cast_kernel" in n for n in names), names
        y_cached, names = kernels_of(lambda: lin(x, is_first_microbatch=False))
        assert not any("pair_kernel" in n for n in names), names  # x alone
    assert torch.equal(y, y_cached)


def test_cpu_pair_is_two_quantizations():
    x0, x1 = randn((64, 64), BF16, "cpu", 7, 2.0), randn((32, 64), BF16, "cpu", 8)
    for c0, c1 in ((E4M3, E4M3_W), (E5M2, E5M2)):
        check_pair(x0, c0, x1, c1)
    # every other recipe's quantizers (deterministic roles) pair as two calls too
    for recipe in (DelayedScaling(), Float8BlockScaling(), MXFP8BlockScaling(),
                   NVFP4BlockScaling()):
        check_pair(x0, te.quantizer_config(recipe, "input"), x1,
                   te.quantizer_config(recipe, "weight"))


def test_pair_errors():
    x = torch.randn(8, 8)
    with pytest.raises(TypeError, match="takes 4 or 6 arguments"):
        _C._quantize_pair(x, E4M3, x)
    with pytest.raises(TypeError, match="x1 must be a torch.Tensor"):
        _C._quantize_pair(x, E4M3, "not a tensor", E4M3_W)
    with pytest.raises(ValueError, match="x1 has dtype"):
        _C._quantize_pair(x, E4M3, torch.ones(8, 8, dtype=torch.int64), E4M3_W)
    with pytest.raises(TypeError):
        _C._quantize_pair(x, "not a config", x, E4M3_W)
    with pytest.raises(TypeError, match=r"state0 must be None or a \(scale, amax\) tuple"):
        _C._quantize_pair(x, D_IN, x, D_W, (torch.ones(1),), None)
    with pytest.raises(TypeError, match=r"state1 must be None or a \(scale, amax\) tuple"):
        _C._quantize_pair(x, D_IN, x, D_W, None, [torch.ones(1), torch.zeros(1)])
    with pytest.raises(TypeError, match="scale must be a torch.Tensor"):
        _C._quantize_pair(x, D_IN, x, D_W, ("no", torch.zeros(1)), None)
