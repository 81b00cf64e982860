"""The amax run of gelu / silu / qgelu over bfloat16 h (Float8CurrentScaling's first launch of the
fused activation: _C._act_forward(h, act, amax=...) with no other output), which on CUDA reads h
at memory speed and computes one activation per CTA (cuda/act_forward.cu,
monotone_amax_kernel).

- The property that kernel rests on, over every one of the 65536 bfloat16 values, for the C
  reference's activation (csrc/ref/act_forward_ref.c, the bits the kernels compute): act is
  non-negative and non-decreasing over the non-negative values (+0 to +Inf), and |act| is below
  the kernel's bound over the negative ones (NEG_BOUND; -Inf and NaN give NaN, which amax
  ignores). The same check in torch float64
  of TE's formulas says the property is the functions' own, not an artifact of our arithmetic.
- GPU (skipped without CUDA): the amax bit for bit against the C reference for data where every
  CTA takes the one-activation path, where every CTA recomputes its elements (all |x| small, all
  negative), a mixture, one large value among small ones (one CTA fast, the rest recomputing),
  sparse large values (most threads' own elements below the bound, every CTA's not), NaN / +-Inf
  / -0, a pre-filled slot (max-accumulated), partial chunks, strided and misaligned rows; the
  cast run after it gives the reference's codes.
"""
import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import Float8CurrentScaling
from test_act_kernels import strided
from test_norm_kernels import bits, misaligned

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
ACTS = ["gelu", "silu", "qgelu"]
NEG_BOUND = {"gelu": 0.1875, "silu": 0.3125, "qgelu": 0.1875}  # act_forward.cu's neg_bound


def every_bf16():
    """All 65536 bfloat16 values as float32 (exact), [positive half, negative half]."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def ref_values(act, x32):
    """The C reference's act(x) in float32 (float32 h computes the same function of the value)."""
    y = torch.empty_like(x32)
    _C._act_forward(x32.reshape(-1, 256), act, y_hp=y.reshape(-1, 256))
    return y


def tanh_gelu64(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


FORMULAS64 = {"gelu": tanh_gelu64, "silu": lambda x: x * torch.sigmoid(x),
              "qgelu": lambda x: x * torch.sigmoid(1.702 * x)}


@pytest.mark.parametrize("act", ACTS)
def test_monotone_where_amax_is_decided(act):
    x = every_bf16()
    for y in (ref_values(act, x).double(), FORMULAS64[act](x.double())):
        pos, ypos = x[:32768], y[:32768]  # sign bit clear: +0 .. +Inf, then NaN patterns
        keep = ~torch.isnan(pos)
        order = torch.argsort(pos[keep])
        ys = ypos[keep][order]
        assert bool((ys >= 0).all()), f"{act}: negative over non-negative x"
        assert bool((ys[1:] >= ys[:-1]).all()), f"{act}: decreasing somewhere over x >= 0"
        yneg = y[32768:]
        finite = ~torch.isnan(yneg)
        assert float(yneg[finite].abs().max()) < NEG_BOUND[act]
        # -Inf (0xFF80) and the NaN patterns are the only NaN results
        assert int((~finite).sum()) == 128


def amax_run(h, act, amax0=0.0):
    amax = torch.full((1,), amax0, device=h.device)
    _C._act_forward(h, act, amax=amax)
    return amax


def cases(m, k):
    """(name, float32 values [m, k]) that steer the kernel's two paths."""
    g = torch.Generator().manual_seed(m * 7919 + k)
    normal = torch.randn(m, k, generator=g) * 2
    small = (torch.rand(m, k, generator=g) - 0.5) * 0.5  # every act(x) below the bound
    negative = -torch.rand(m, k, generator=g) * 6
    mixed = small.clone()
    mixed[m // 2:] = normal[m // 2:]
    special = normal.clone()
    flat = special.view(-1)
    for i, v in zip(range(0, flat.numel(), max(1, flat.numel() // 5)),
                    [float("nan"), float("-inf"), -0.0, -3e38, 1e-40]):
        flat[i] = v
    one_large = small.clone()
    one_large.view(-1)[-1] = 40.0
    plus_inf = normal.clone()
    plus_inf.view(-1)[0] = float("inf")
    sparse = small.clone()
    sparse.view(-1)[::997] = 3.0
    return [("normal", normal), ("small", small), ("negative", negative), ("mixed", mixed),
            ("special", special), ("one_large", one_large), ("plus_inf", plus_inf),
            ("sparse_large", sparse)]


LAYOUTS = {"contiguous": lambda t: t, "strided": strided, "misaligned": misaligned}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 8), (3, 14), (5, 1000), (17, 1030), (3000, 1032)])
def test_cuda_amax_run_is_the_reference(act, shape):
    for name, x in cases(*shape):
        h = x.to(torch.bfloat16)
        want = amax_run(h, act)
        for layout, make in LAYOUTS.items():
            got = amax_run(make(h.cuda()), act)
            assert torch.equal(bits(got), bits(want)), (act, shape, name, layout,
                                                         float(got), float(want))
        for amax0 in (7.0, 0.25):  # the slot is max-accumulated
            got = amax_run(h.cuda(), act, amax0)
            assert torch.equal(bits(got), bits(amax_run(h, act, amax0))), (name, amax0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_cuda_current_codes_after_the_amax_run(act):
    cfg = te.quantizer_config(Float8CurrentScaling(), "input")
    for name, x in cases(256, 1024)[:4]:
        h = x.to(torch.bfloat16)
        outs = {}
        for dev in ("cpu", "cuda"):
            hd = h.to(dev)
            amax = amax_run(hd, act)
            codes = torch.empty(h.shape, dtype=torch.uint8, device=dev)
            scale_inv = torch.empty(1, device=dev)
            _C._act_forward(hd, act, config=cfg, y_q=codes, scale_inv=scale_inv, amax_in=amax)
            outs[dev] = (amax, codes, scale_inv)
        for a, b in zip(outs["cuda"], outs["cpu"]):
            assert torch.equal(bits(a), bits(b)), (act, name)
