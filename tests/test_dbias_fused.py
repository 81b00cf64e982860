"""dbias summed inside the quantize kernel (GPU only): Float8CurrentScaling's cooperative one-launch
cast (cuda/quantize_fp8.cu, tile_partials) of a bfloat16 grad_output writes the column partials
of fused.h's order itself, so tq_quantize with dbias runs no separate pass there
(csrc/core/quantize_dbias.c); other dtypes and the block recipe keep the pass (the block tile
kernel's summing was measured slower), checked here too. DelayedScaling's pass casts (both
directions: cuda/act_backward.cu's identity_columnwise_kernel, a cooperative launch that
finishes the column sums itself after its grid barrier).

Each shape picks a chunk length R(M, K) (4 .. 128 rows, and 256, where the kernels decline and
the pass runs), a tile layout (one tile per CTA or several; ragged edges) and a dtype. Against
the C reference on the CPU, bit for bit: the codes, scales, amax and dbias; against the same CUDA
call without dbias: the members unchanged; and the profile shows which kernels ran (no
activation-backward pass where the quantize kernel sums, and no column-sum launch either: the
cooperative cast finishes the sums after its grid barrier).
"""
import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format
from test_linear_dbias import _assert_members_equal, _quantize_pair, randn  # noqa: E402
from test_norm_kernels import bits  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CONFIGS = {
    "current": (Float8CurrentScaling(), "grad_output"),                        # E5M2
    "current-e4m3": (Float8CurrentScaling(fp8_format=Format.E4M3), "grad_output"),
    "block": (Float8BlockScaling(), "grad_output"),
    "delayed": (DelayedScaling(), "grad_output"),
}
BOTH = 3
# (M, K, dtype, R(M, K) as fused.h defines it): R = 4 .. 128 fused, 256 declined
SHAPES = [
    (1000, 1000, BF16, 4),      # ragged tiles in both dims
    (3072, 768, BF16, 4),       # a float32 dbias (the dtype follows M % 3)
    (8192, 512, BF16, 8),
    (2048, 2048, F16, 16),      # current: one tile per CTA
    (4096, 4096, BF16, 16),     # current: more tiles than CTAs (each CTA loops)
    (4100, 1030, F32, 16),
    (32768, 512, BF16, 32),     # chunks across warps
    (65536, 256, F16, 64),
    (131072, 128, BF16, 128),   # 16M elements: the cooperative launch's largest x
    (3001, 3001, BF16, 16),     # current: one or two ragged tiles per CTA
]
DECLINED = [(140000, 16, BF16, 256)]  # R > 128: the separate pass


def chunk_rows(m, k):
    """fused.h's R(M, K), written out here from its text."""
    r = 4 if k <= 1024 else 16
    while r < m:
        p = -(-m // r)
        if p <= 1024 and p * k <= 1 << 22:
            break
        r *= 2
    return r


def kernels_of(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES + DECLINED, ids=lambda s: f"{s[0]}x{s[1]}")
def test_cuda_dbias_matches_cpu_reference(name, shape):
    m, k, dtype, r = shape
    assert chunk_rows(m, k) == r
    cfg = te.quantizer_config(*CONFIGS[name])
    x = randn(m, k, seed=m + k, dtype=dtype, scale=3.0)
    x[7, 3] = -0.0
    x[m - 1, k - 1] = float("inf") if name == "block" else 1e4  # block: an Inf in a block
    got = []
    for device in ("cpu", "cuda"):
        plain, fused, dbias = _quantize_pair(x.to(device), cfg, BOTH, (F32, BF16, F16)[m % 3])
        _assert_members_equal(plain, fused, (name, m, k, device))
        got.append((fused, dbias))
    _assert_members_equal(got[0][0], got[1][0], (name, m, k))
    assert torch.equal(bits(got[0][1]), bits(got[1][1].cpu())), (name, m, k)


@pytest.mark.parametrize("name", ["current", "current-e4m3", "delayed"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[4]], ids=lambda s: f"{s[0]}x{s[1]}")
def test_cuda_dbias_nan_and_signed_zeros(name, shape):
    """A NaN in grad_output: the amax ignores it (the CTAs' maxima as the amax pass), its column's
    dbias is the canonical NaN; a column of -0 sums to +0 (partials start at +0); against the C
    reference, bit for bit."""
    m, k, dtype, _ = shape
    cfg = te.quantizer_config(*CONFIGS[name])
    x = randn(m, k, seed=11, dtype=dtype, scale=2.0)
    x[m // 2, 5] = float("nan")
    x[:, 9] = -0.0
    got = []
    for device in ("cpu", "cuda"):
        plain, fused, dbias = _quantize_pair(x.to(device), cfg, BOTH, BF16)
        _assert_members_equal(plain, fused, (name, m, k, device))
        got.append((fused, dbias.cpu()))
    _assert_members_equal(got[0][0], got[1][0], (name, m, k))
    assert torch.equal(bits(got[0][1]), bits(got[1][1])), (name, m, k)
    assert torch.isnan(got[1][1][5]) and bits(got[1][1])[9] == 0


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[3], SHAPES[6]] + DECLINED,
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_cuda_which_kernels_sum(name, shape):
    """Where the quantize kernel sums (current scaling, bfloat16, both directions, R <= 128), no
    activation-backward (identity) pass runs; elsewhere (R > 128, float16, one direction, the
    block recipe, DelayedScaling) the pass does. DelayedScaling's pass with both directions is
    the whole call and finishes the column sums itself; one direction leaves them to a launch."""
    m, k, dtype, r = shape
    cfg = te.quantizer_config(*CONFIGS[name])
    x = randn(m, k, seed=5, dtype=dtype, device="cuda")
    dbias = torch.empty(k, dtype=dtype, device="cuda")
    delayed = name == "delayed"
    declined = r > 128 or name == "block" or dtype != BF16 or delayed
    state = (torch.tensor([0.5], device="cuda"), torch.zeros(1, device="cuda")) if delayed \
        else (None, None)
    for usage in (BOTH, 1):
        names = kernels_of(lambda: _C._quantize(x, cfg, usage, *state, None, None, dbias))
        passes = [n for n in names if "act_backward_kernel" in n or "identity_" in n]
        summed = usage == BOTH and not declined
        assert bool(passes) != summed, (name, m, k, usage, names)
        # the cooperative cast and DelayedScaling's columnwise pass finish the column sums
        # themselves; otherwise the pass leaves them to a launch
        finished = summed or (delayed and usage == BOTH)
        assert any("column_sum_kernel" in n for n in names) != finished, names
        if summed:
            assert len(names) == 1 and "fused_current_kernel" in names[0], names
        if delayed and usage == BOTH:
            assert len(names) == 1 and "identity_columnwise_kernel" in names[0], names
