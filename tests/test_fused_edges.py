"""Edge cases of te.LayerNorm, te.RMSNorm, te.LayerNormLinear and te.LayerNormMLP found by an
audit against plain torch compositions (F.layer_norm / F.rms_norm + F.linear + activation):
zero-centered gamma on torch's fallback path (float64 inputs, torch.autocast), non-floating
inputs, eps validation and TE's state_dict names in load_state_dict's key reports.
CPU only; the references are torch ops, never tequant's own code.
"""
import pytest
import torch
import torch.nn.functional as F

import tequant as te
from tequant import recipe as R

LOW = [torch.bfloat16, torch.float16]


def _torch_norm(x, normalization, gamma, beta, eps):
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, beta, eps)
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


def _zero_centered(cls, params_dtype):
    torch.manual_seed(0)
    m = cls(64, params_dtype=params_dtype, zero_centered_gamma=True)
    with torch.no_grad():  # small gammas: 1 + gamma needs more bits than bf16 / fp16 hold
        m.weight.copy_(torch.randn(64) * 0.05)
        if m.bias is not None:
            m.bias.copy_(torch.randn(64) * 0.1)
    return m


@pytest.mark.parametrize("params_dtype", LOW)
@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
def test_zero_centered_gamma_float64_input_is_exact(cls, params_dtype):
    """A float64 input runs torch's norm (the kernels read float32 / bf16 / fp16): 1 + gamma
    must not be rounded to the bf16 / fp16 parameter dtype (it was: errors ~5e-3)."""
    m = _zero_centered(cls, params_dtype)
    x = torch.randn(3, 5, 64, dtype=torch.float64, requires_grad=True)
    y = m(x)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = m.weight.detach().double().requires_grad_()
    b_ref = None if m.bias is None else m.bias.detach().double().requires_grad_()
    y_ref = _torch_norm(x_ref, cls.__name__, w_ref + 1, b_ref, m.eps)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y_ref)
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    # the parameter gradients are rounded once to the parameters' dtype
    torch.testing.assert_close(m.weight.grad, w_ref.grad.to(params_dtype), rtol=0, atol=0)
    if b_ref is not None:
        torch.testing.assert_close(m.bias.grad, b_ref.grad.to(params_dtype), rtol=0, atol=0)


@pytest.mark.parametrize("params_dtype", LOW)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("kind", ["norm", "LayerNormLinear", "LayerNormMLP"])
def test_zero_centered_gamma_under_torch_autocast(kind, normalization, params_dtype):
    """Under torch.autocast the norm is torch's, on the float32 input: its 1 + gamma must be
    the float32 sum the kernels use outside torch.autocast, not gamma's own dtype's."""
    torch.manual_seed(0)
    kw = dict(params_dtype=params_dtype, zero_centered_gamma=True)
    if kind == "norm":
        m = (te.LayerNorm if normalization == "LayerNorm" else te.RMSNorm)(64, **kw)
        weight, bias = m.weight, m.bias
    elif kind == "LayerNormLinear":
        m = te.LayerNormLinear(64, 32, normalization=normalization,
                               return_layernorm_output=True, **kw)
        weight, bias = m.layer_norm_weight, m.layer_norm_bias
    else:
        m = te.LayerNormMLP(64, 32, normalization=normalization, return_layernorm_output=True,
                            **kw)
        weight, bias = m.layer_norm_weight, m.layer_norm_bias
    with torch.no_grad():
        weight.copy_(torch.randn(64) * 0.05)
        if bias is not None:
            bias.copy_(torch.randn(64) * 0.1)
    x = torch.randn(4, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
    ln = out if kind == "norm" else out[-1]
    ref = _torch_norm(x.double(), normalization, weight.detach().double() + 1,
                      None if bias is None else bias.detach().double(), 1e-5)
    assert ln.dtype == torch.float32
    torch.testing.assert_close(ln.double(), ref, rtol=1e-5, atol=1e-5)


BAD_DTYPES = [torch.int64, torch.int32, torch.bool, torch.complex64]


def _modules():
    return {
        "LayerNorm": lambda: te.LayerNorm(64),
        "RMSNorm": lambda: te.RMSNorm(64),
        "LayerNormLinear": lambda: te.LayerNormLinear(64, 32),
        "LayerNormLinear-rms": lambda: te.LayerNormLinear(64, 32, normalization="RMSNorm"),
        "LayerNormMLP": lambda: te.LayerNormMLP(64, 32),
        "LayerNormMLP-rms": lambda: te.LayerNormMLP(64, 32, normalization="RMSNorm",
                                                    activation="swiglu"),
    }


@pytest.mark.parametrize("recipe", [None, R.DelayedScaling, R.Float8CurrentScaling])
@pytest.mark.parametrize("dtype", BAD_DTYPES)
@pytest.mark.parametrize("name", list(_modules()))
def test_non_floating_input_raises_type_error(name, dtype, recipe):
    """Integer, bool and complex inputs raise a TypeError naming the module and dtype (before:
    torch's "LayerNormKernelImpl not implemented" error, and te.RMSNorm returned a complex
    'norm' dividing by the complex mean of x^2)."""
    m = _modules()[name]()
    x = torch.ones(4, 64, dtype=dtype)
    with pytest.raises(TypeError, match="floating-point"):
        if recipe is None:
            m(x)
        else:
            with te.autocast(recipe=recipe()):
                m(x)


@pytest.mark.parametrize("ctor", [
    lambda eps: te.LayerNorm(64, eps=eps),
    lambda eps: te.RMSNorm(64, eps=eps),
    lambda eps: te.LayerNormLinear(64, 32, eps=eps),
    lambda eps: te.LayerNormMLP(64, 32, eps=eps),
])
def test_eps_must_be_finite(ctor):
    """eps = inf zeroed rstd: the norm returned beta and no gradient, silently."""
    with pytest.raises(ValueError, match="eps must be a positive number"):
        ctor(float("inf"))


def test_layernorm_mlp_incompatible_keys_use_te_names():
    """load_state_dict reports missing / unexpected keys in TE's names, the names of the
    state_dict the module saves (it said fc1.weight for a missing fc1_weight)."""
    m = te.LayerNormMLP(64, 32)
    sd = m.state_dict()
    assert {"fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"} <= set(sd)
    del sd["fc1_weight"], sd["fc2_bias"]
    result = m.load_state_dict(sd, strict=False)
    assert sorted(result.missing_keys) == ["fc1_weight", "fc2_bias"]
    assert result.unexpected_keys == []
    with pytest.raises(RuntimeError, match='"fc1_weight"'):
        m.load_state_dict(sd, strict=True)


def test_layernorm_mlp_incompatible_keys_nested():
    """The same inside a container: the keys keep the container's prefix."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(te.LayerNormMLP(64, 32), te.LayerNormMLP(64, 32))
    sd = model.state_dict()
    del sd["1.fc2_weight"]
    sd["0.extra"] = torch.zeros(1)
    result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["1.fc2_weight"]
    assert result.unexpected_keys == ["0.extra"]
    # a full TE-named checkpoint (with TE's _extra_state) still loads strictly, values and all
    src = torch.nn.Sequential(te.LayerNormMLP(64, 32), te.LayerNormMLP(64, 32))
    full = dict(src.state_dict(), **{"0._extra_state": None, "1._extra_state": None})
    assert model.load_state_dict(full, strict=True).missing_keys == []
    x = torch.randn(3, 64)
    torch.testing.assert_close(model(x), src(x), rtol=0, atol=0)
