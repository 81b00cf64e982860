"""The fused normalization kernels' edges (split from tests/test_norm_kernels.py, whose helpers
it uses): rows of equal values, which LayerNorm's mean correction (csrc/include/tequant/fused.h)
normalizes to exactly beta on CPU and CUDA, and the argument errors of _C._norm_forward /
_C._norm_backward with the backward's workspace size.
"""
import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import Float8CurrentScaling

from test_norm_kernels import (CFG_E4M3, DTYPES, bits, column_partial_rows, forward, gpu,
                               make)


CONSTANT_ROWS = [0.1, -3.7, 1000.3, 1e-3, 0.7, 12345.6]


def constant_rows(k, dtype, device="cpu"):
    """Rows of equal values whose mean S's rounding misses (0.1 at K = 1000 sums to 100.00001):
    LayerNorm must still give d = 0 exactly, as torch's layer_norm does."""
    return torch.tensor(CONSTANT_ROWS).to(dtype)[:, None].expand(-1, k).contiguous().to(device)


def check_constant_rows(k, dtype, device):
    x = constant_rows(k, dtype, device)
    _, gamma, beta, _ = make(len(CONSTANT_ROWS), k, dtype, seed=9)
    gamma, beta = gamma.to(device), beta.to(device)
    got = forward(x, gamma, "LayerNorm", beta=beta)
    assert torch.equal(got["mean"].cpu(), x[:, 0].float().cpu()), "the mean of equal values"
    assert torch.equal(bits(got["y_hp"].cpu()), bits(beta.expand_as(x).cpu())), "y = beta"
    assert float(got["amax"]) == float(beta.float().abs().max())
    # an all-constant tensor without beta under current scaling: amax 0, every code a zero
    first = forward(x, gamma, "LayerNorm", want=("amax", "y_hp"))
    assert float(first["amax"]) == 0.0 and not bool(first["y_hp"].any())
    cur = forward(x, gamma, "LayerNorm", cfg=(Float8CurrentScaling(), "input"),
                  amax_in=first["amax"], want=())
    assert not bool((cur["y_q"] & 0x7F).any()), "codes of a constant tensor are zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [8, 300, 1000, 4096])
def test_constant_rows_normalize_to_beta_exactly(dtype, k):
    """The mean's correction pass (fused.h): without it 0.1 at K = 1000 gave mean 0.10000001,
    y = beta + ~2e-5 * g, and an all-constant tensor quantized to +-448 under current scaling."""
    check_constant_rows(k, dtype, "cpu")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [8, 300, 1000, 4096, 20000])
def test_cuda_constant_rows_normalize_to_beta_exactly(dtype, k):
    """Both kernels (300: the general one; 20000: its uncached form; else fast_kernel)."""
    check_constant_rows(k, dtype, "cuda")


# ---- (d) errors --------------------------------------------------------------------------------

def test_errors_forward():
    x, gamma, beta, _ = make(4, 16, torch.float32)
    y = torch.empty(4, 16)
    with pytest.raises(ValueError, match="x has dtype float64; expected one of"):
        _C._norm_forward(x.double(), gamma, "LayerNorm", y_hp=y)
    with pytest.raises(ValueError, match="norm must be 'LayerNorm' or 'RMSNorm'"):
        _C._norm_forward(x, gamma, "BatchNorm", y_hp=y)
    with pytest.raises(ValueError, match="gamma is float32 \\[1, 15\\].*expected 16 contiguous"):
        _C._norm_forward(x, gamma[:15], "LayerNorm", y_hp=y)
    with pytest.raises(ValueError, match="beta was given, but RMSNorm has no beta"):
        _C._norm_forward(x, gamma, "RMSNorm", beta=beta, y_hp=y)
    with pytest.raises(ValueError, match="mean was given, but RMSNorm has no mean"):
        _C._norm_forward(x, gamma, "RMSNorm", mean=torch.empty(4))
    with pytest.raises(ValueError, match="y_hp is bfloat16 \\[4, 16\\]; expected float32"):
        _C._norm_forward(x, gamma, "LayerNorm", y_hp=y.bfloat16())
    with pytest.raises(ValueError, match="rstd is float32 \\[1, 3\\].*expected 4 contiguous"):
        _C._norm_forward(x, gamma, "LayerNorm", rstd=torch.empty(3))
    with pytest.raises(ValueError, match="eps=-1 must be finite and >= 0"):
        _C._norm_forward(x, gamma, "LayerNorm", eps=-1.0, y_hp=y)
    with pytest.raises(ValueError, match="x is \\[4, 0\\]; the norm runs over the last dim"):
        _C._norm_forward(x[:, :0], gamma[:0], "LayerNorm")
    codes, sinv = torch.empty(4, 16, dtype=torch.uint8), torch.empty(1)
    with pytest.raises(ValueError, match="y_q was given, but config is NULL"):
        _C._norm_forward(x, gamma, "LayerNorm", y_q=codes)
    delayed = te.quantizer_config(*CFG_E4M3)
    with pytest.raises(ValueError, match="delayed scaling needs scale"):
        _C._norm_forward(x, gamma, "LayerNorm", config=delayed, y_q=codes, scale_inv=sinv)
    current = te.quantizer_config(Float8CurrentScaling(), "input")
    with pytest.raises(ValueError, match="current scaling needs amax_in"):
        _C._norm_forward(x, gamma, "LayerNorm", config=current, y_q=codes, scale_inv=sinv)
    a = torch.zeros(1)
    with pytest.raises(ValueError, match="amax and amax_in are the same memory"):
        _C._norm_forward(x, gamma, "LayerNorm", config=current, y_q=codes, scale_inv=sinv,
                         amax=a, amax_in=a)
    with pytest.raises(ValueError, match="a config needs both y_q and scale_inv"):
        _C._norm_forward(x, gamma, "LayerNorm", config=delayed, y_q=codes, scale=torch.ones(1))
    with pytest.raises(ValueError, match="y_q is uint8 \\[4, 15\\]"):
        _C._norm_forward(x, gamma, "LayerNorm", config=delayed, y_q=codes[:, :15],
                         scale_inv=sinv, scale=torch.ones(1))
    mx = te.quantizer_config(te.recipe.MXFP8BlockScaling(), "input")
    with pytest.raises(NotImplementedError, match="per-tensor FP8"):
        _C._norm_forward(x, gamma, "LayerNorm", config=mx, y_q=codes, scale_inv=sinv)
    with pytest.raises(TypeError, match="gamma must be a torch.Tensor"):
        _C._norm_forward(x, [1.0] * 16, "LayerNorm", y_hp=y)


def test_errors_backward():
    x, gamma, beta, dy = make(4, 16, torch.float32)
    f = forward(x, gamma, "LayerNorm", beta=beta)
    out = dict(dx=torch.empty(4, 16), dgamma=torch.empty(16))
    with pytest.raises(TypeError, match="missing required keyword argument 'rstd'"):
        _C._norm_backward(dy, x, gamma, "LayerNorm", mean=f["mean"], **out)
    with pytest.raises(ValueError, match="LayerNorm needs the forward's mean"):
        _C._norm_backward(dy, x, gamma, "LayerNorm", rstd=f["rstd"], **out)
    with pytest.raises(ValueError, match="dy is bfloat16 \\[4, 16\\].*expected x's dtype"):
        _C._norm_backward(dy.bfloat16(), x, gamma, "LayerNorm", rstd=f["rstd"], mean=f["mean"],
                          **out)
    with pytest.raises(ValueError, match="dbeta was given, but RMSNorm has no beta"):
        _C._norm_backward(dy, x, gamma, "RMSNorm", rstd=f["rstd"], dbeta=torch.empty(16), **out)
    with pytest.raises(ValueError, match="dgamma has dtype int32"):
        _C._norm_backward(dy, x, gamma, "LayerNorm", rstd=f["rstd"], mean=f["mean"],
                          dx=out["dx"], dgamma=torch.empty(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="dbeta is float32 .* expected 16 contiguous bfloat16"):
        _C._norm_backward(dy, x, gamma, "LayerNorm", rstd=f["rstd"], mean=f["mean"],
                          dx=out["dx"], dgamma=torch.empty(16, dtype=torch.bfloat16),
                          dbeta=torch.empty(16))


def test_workspace_size():
    # R(M, K): 4 (K <= 1024) or 16 rows per partial, doubled until at most 1024 partials and
    # 2^22 partial elements
    assert _C._norm_backward_workspace_size("LayerNorm", 0, 10) == 0
    assert _C._norm_backward_workspace_size("RMSNorm", 1, 10) == 10 * 4
    assert _C._norm_backward_workspace_size("LayerNorm", 100, 8) == 25 * 8 * 4 * 2  # R = 4
    assert _C._norm_backward_workspace_size("RMSNorm", 40000, 40) == 625 * 40 * 4  # R = 64
    assert _C._norm_backward_workspace_size("RMSNorm", 8192, 512) == 1024 * 512 * 4  # R = 8
    assert _C._norm_backward_workspace_size("RMSNorm", 8192, 2048) == 512 * 2048 * 4  # R = 16
    assert _C._norm_backward_workspace_size("RMSNorm", 65536, 16384) == 256 * 16384 * 4
    for m, k in [(1, 1), (17, 5), (40000, 40), (65536, 16384), (5, 1 << 23), (8192, 1024),
                 (8192, 1025)]:
        r = column_partial_rows(m, k)
        assert _C._norm_backward_workspace_size("RMSNorm", m, k) == -(-m // r) * k * 4
