"""The norm kernels inside te.LayerNorm / te.RMSNorm, te.LayerNormLinear and te.LayerNormMLP
(issue 24; python/tequant/_norm_fn.py, norm.py, layernorm_linear.py, layernorm_mlp.py, linear.py).

- te.LayerNorm / te.RMSNorm: output and gradients ARE the kernels' (_C._norm_forward /
  _C._norm_backward run standalone) bit for bit: every dtype, both norms, zero-centered gamma,
  leading dims, parameters of another dtype; within float32-sized tolerances of torch's float32
  norm and autograd; torch's own norm where the kernels do not run (float64, torch.autocast,
  forward AD); a second derivative is refused; 0 tokens.
- LayerNormLinear / LayerNormMLP with DelayedScaling / Float8CurrentScaling (fused): the FP8 codes
  te.Linear multiplies are the standalone kernel's (the cast of the FP32 y with the module's
  scale, or the scale of amax(y)) bit for bit, and te.ops.quantize's of the kernel's float32 y;
  with bfloat16 y they differ from the codes of y rounded to bfloat16 by at most one code step.
  float32 inputs: outputs, gradients and DelayedScaling histories bit-identical to te.LayerNorm +
  te.Linear (test_norm_modules.py compares every recipe too). bfloat16 inputs, every recipe:
  within the recipe's tolerance of torch's norm + te.Linear and as accurate against float32
  math; DelayedScaling records amax(y) of the FP32 y where te.Linear records its input's.
- return_layernorm_output, inference (no_grad), 0 and 21 tokens, activation checkpointing in
  both modes, a hooked fc1 (the unfused route), TE state_dict names, bad inputs.
CPU here; the CUDA cases are marked and skip without a GPU. torch.compile and CUDA graphs:
tests/test_fused_norm_compile.py.
"""
import contextlib
import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import tequant as te
from tequant import _C, _act_fn, _norm_fn

sys.path.insert(0, os.path.dirname(__file__))
from test_compile import DEVICES, RECIPES  # noqa: E402  (DelayedScaling with a 4-row history)
from test_linear import one_cpu_thread  # noqa: E402

assert one_cpu_thread  # the autouse fixture, imported to apply here too
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NORMS = {"LayerNorm": te.LayerNorm, "RMSNorm": te.RMSNorm}
FUSED = ("delayed", "current")
ERR = {"delayed": 0.08, "current": 0.08, "block": 0.08, "mxfp8": 0.08, "nvfp4": 0.35}


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def randomize(module):
    """Non-trivial norm parameters and biases (TE initializes gamma 1, beta and biases 0)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:  # norms' gamma around 1, their beta and the biases around 0
                p.normal_(0, 0.5).add_(1.0 if name.endswith("weight") else 0.0)
    return module


def standalone_norm(x2d, weight, bias, normalization, zc, eps=1e-5):
    """The kernel's y_hp, mean and rstd of x2d, run by hand."""
    m, k = x2d.shape
    y = torch.empty_like(x2d)
    rstd = torch.empty(m, device=x2d.device)
    mean = torch.empty(m, device=x2d.device) if normalization == "LayerNorm" else None
    _C._norm_forward(x2d, weight, normalization, eps=eps, zero_centered_gamma=zc, beta=bias,
                     y_hp=y, mean=mean, rstd=rstd)
    return y, mean, rstd


def standalone_codes(x2d, weight, bias, normalization, zc, recipe, scale=None):
    """(codes, scale_inv, amax) of the kernel run by hand: DelayedScaling casts with `scale`,
    current scaling runs its amax pass, then the cast pass."""
    config = te.quantizer_config(recipe, "input")
    m, k = x2d.shape
    codes = torch.empty(m, k, dtype=torch.uint8, device=x2d.device)
    scale_inv = torch.empty(1, device=x2d.device)
    amax = torch.zeros(1, device=x2d.device)
    kw = dict(zero_centered_gamma=zc, beta=bias)
    if config.scaling == "delayed":
        _C._norm_forward(x2d, weight, normalization, amax=amax, config=config, y_q=codes,
                         scale_inv=scale_inv, scale=scale, **kw)
    else:
        _C._norm_forward(x2d, weight, normalization, amax=amax, **kw)
        _C._norm_forward(x2d, weight, normalization, config=config, y_q=codes,
                         scale_inv=scale_inv, amax_in=amax, **kw)
    return codes, scale_inv, amax


# ---- te.LayerNorm / te.RMSNorm ----------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_module_is_the_kernel(dtype, normalization, zc, device):
    """Forward and backward of the module are the kernels' own bits; the parameters are of
    another dtype than x but for float16 (the kernels read gamma in its own dtype) and their
    gradients come back in it; leading dims flatten to rows."""
    torch.manual_seed(0)
    params_dtype = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float32,
                    torch.float16: torch.float16}[dtype]
    m = randomize(NORMS[normalization](80, zero_centered_gamma=zc, params_dtype=params_dtype,
                                       device=device))
    x = (torch.randn(2, 5, 80, device=device) * 3 + 1).to(dtype).requires_grad_()
    dy = torch.randn(2, 5, 80, device=device).to(dtype)
    y = m(x)
    y.backward(dy)
    x2d = x.detach().reshape(-1, 80)
    want, mean, rstd = standalone_norm(x2d, m.weight.detach(), None if m.bias is None
                                       else m.bias.detach(), normalization, zc)
    assert same_bits(y.detach().reshape(-1, 80), want)
    dx = torch.empty_like(x2d)
    dgamma = torch.empty(80, device=device)
    dbeta = torch.empty(80, device=device) if m.bias is not None else None
    _C._norm_backward(dy.reshape(-1, 80), x2d, m.weight.detach(), normalization, rstd=rstd,
                      dx=dx, dgamma=dgamma, mean=mean, dbeta=dbeta, zero_centered_gamma=zc)
    assert same_bits(x.grad.reshape(-1, 80), dx)
    assert same_bits(m.weight.grad, dgamma.to(m.weight.dtype))
    if m.bias is not None:
        assert same_bits(m.bias.grad, dbeta.to(m.bias.dtype))


TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (8e-3, 8e-3), torch.float16: (1e-3, 1e-3)}


@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_module_close_to_torch_float32(dtype, normalization, zc):
    """Against torch's norm and autograd in float32 on the same values: within one rounding of
    the output dtype (float32: a few ulps; the summation orders differ), and the gradients
    within float32 sums' tolerance."""
    torch.manual_seed(1)
    m = randomize(NORMS[normalization](96, zero_centered_gamma=zc, params_dtype=dtype))
    x = (torch.randn(4, 33, 96) * 2 + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(4, 33, 96).to(dtype)
    y = m(x)
    y.backward(dy)
    xr = x.detach().float().requires_grad_()
    gr = m.weight.detach().float().requires_grad_()
    br = m.bias.detach().float().requires_grad_() if m.bias is not None else None
    gamma = gr + 1 if zc else gr
    if normalization == "LayerNorm":
        ref = F.layer_norm(xr, (96,), gamma, br, 1e-5)
    else:
        ref = F.rms_norm(xr, (96,), gamma, 1e-5)
    ref.backward(dy.float())
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref.to(dtype).float(), rtol=rtol, atol=atol)
    scale = float(xr.grad.abs().max())
    torch.testing.assert_close(x.grad.float(), xr.grad.to(dtype).float(), rtol=rtol,
                               atol=max(atol, 1e-5) * scale)
    torch.testing.assert_close(m.weight.grad.float(), gr.grad.to(dtype).float(), rtol=rtol,
                               atol=1e-4 * float(gr.grad.abs().max()))
    if br is not None:
        torch.testing.assert_close(m.bias.grad.float(), br.grad.to(dtype).float(), rtol=rtol,
                                   atol=1e-4 * float(br.grad.abs().max()))


def test_torch_norm_where_the_kernels_do_not_run():
    """float64, torch.autocast and forward-mode AD run torch's norm (refusal says why), with its
    results; the kernels' path is not torch's (a test that could not tell them apart proves
    nothing)."""
    torch.manual_seed(2)
    m = randomize(te.LayerNorm(64))
    x = torch.randn(7, 64) * 3
    want = _norm_fn.torch_normalize(x, "LayerNorm", m.weight, m.bias, 1e-5, False)
    assert not torch.equal(m(x), want)  # the kernel's order differs from torch's somewhere
    m64 = copy.deepcopy(m).double()
    assert "float64" in _norm_fn.refusal(x.double(), m64.weight, m64.bias)
    assert torch.equal(m64(x.double()), _norm_fn.torch_normalize(
        x.double(), "LayerNorm", m64.weight, m64.bias, 1e-5, False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "torch.autocast" in _norm_fn.refusal(x, m.weight, m.bias)
        got = m(x)
        want = _norm_fn.torch_normalize(x, "LayerNorm", m.weight, m.bias, 1e-5, False)
    assert got.dtype == want.dtype and torch.equal(got, want)
    import torch.autograd.forward_ad as fwAD
    tangent = torch.randn_like(x)
    with fwAD.dual_level():
        out = fwAD.unpack_dual(m(fwAD.make_dual(x, tangent)))
    _, jvp = torch.func.jvp(lambda t: F.layer_norm(t, (64,), m.weight, m.bias), (x,), (tangent,))
    assert out.tangent is not None and torch.equal(out.primal, want)
    torch.testing.assert_close(out.tangent, jvp)  # (forward AD's formula, not jvp's order)


def test_norm_second_derivative_is_refused_and_zero_tokens_work():
    m = te.RMSNorm(16)
    x = torch.randn(4, 16, requires_grad=True)
    (g,) = torch.autograd.grad(m(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()
    x0 = torch.randn(0, 3, 16, requires_grad=True)
    y = m(x0)
    assert y.shape == (0, 3, 16)
    y.sum().backward()
    assert x0.grad.shape == x0.shape and torch.equal(m.weight.grad, torch.zeros(16))


@pytest.mark.parametrize("bad, error, exc", [
    ("x", "inp must be a torch.Tensor", TypeError),
    (torch.randn(4, 32), "features in its last dim", ValueError),
    (torch.tensor(1.0), "features in its last dim", ValueError),
])
def test_norm_module_bad_inputs(bad, error, exc):
    with pytest.raises(exc, match=error):
        te.LayerNorm(16)(bad)


# ---- LayerNormLinear / LayerNormMLP: the fused codes ------------------------------------------

def _lnl(normalization="LayerNorm", dtype=torch.bfloat16, device="cpu", **kw):
    torch.manual_seed(3)
    return randomize(te.LayerNormLinear(64, 96, normalization=normalization,
                                       params_dtype=dtype, device=device, **kw))


@contextlib.contextmanager
def captured_codes():
    """Records what each fused norm hands te.Linear: (x, scale given, members)."""
    seen = []
    fused = _norm_fn.NormInput.fused

    def spy(self, recipe_id, align, scale, amax, **kw):
        s = None if scale is None else scale.clone()
        y, members = fused(self, recipe_id, align, scale, amax, **kw)
        seen.append((self.x.detach(), s, members))
        return y, members
    _norm_fn.NormInput.fused = spy
    try:
        yield seen
    finally:
        _norm_fn.NormInput.fused = fused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_codes_are_the_standalone_kernels(dtype, name, normalization, zc, device):
    """Two steps (DelayedScaling's second casts with an updated scale), 21 tokens (padded to 32
    rows of zero codes): the codes and scale_inv te.Linear multiplies are the kernel's run by
    hand. float32: also te.ops.quantize's of the kernel's y. bfloat16: the codes of y rounded to
    bfloat16 (te.LayerNorm + te.Linear's) are at most one code step away."""
    recipe = RECIPES[name]
    m = _lnl(normalization, dtype, device, zero_centered_gamma=zc)
    x = (torch.randn(3, 7, 64, device=device) * 2 + 0.5).to(dtype)
    with captured_codes() as seen:
        for _ in range(2):
            with te.autocast(recipe=recipe):
                m(x.clone().requires_grad_()).float().square().sum().backward()
    assert len(seen) == 2
    for x_seen, scale, members in seen:
        x2d = x_seen.reshape(-1, 64)
        codes, scale_inv, _ = standalone_codes(x2d, m.layer_norm_weight.detach(), None if
                                               m.layer_norm_bias is None else
                                               m.layer_norm_bias.detach(), normalization, zc,
                                               recipe, scale)
        data = members[0]
        assert data.shape == (32, 64) and torch.equal(data.view(torch.uint8)[:21], codes)
        assert not data.view(torch.uint8)[21:].any()
        assert same_bits(members[1].reshape(1), scale_inv)
        y_hp, _, _ = standalone_norm(x2d, m.layer_norm_weight.detach(), None if
                                     m.layer_norm_bias is None else m.layer_norm_bias.detach(),
                                     normalization, zc)
        extra = {"scale": scale} if name == "delayed" else {}
        q = te.ops.quantize(y_hp, recipe, "input", **extra)
        mine, theirs = codes.int(), q.data.view(torch.uint8).int()
        if dtype == torch.float32:
            assert torch.equal(mine, theirs)
        else:  # one code step at most: the ordered (sign-magnitude) codes differ by 0 or 1
            def order(c):
                return torch.where(c >= 128, -(c - 128), c)
            diff = (order(mine) - order(theirs)).abs()
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.1
    if name == "delayed":
        assert float(seen[1][1]) != 1.0  # the second step cast with an updated scale


def _composition(module, norm_cls=None):
    """module's norm (te.LayerNorm / RMSNorm, or torch's with norm_cls) and te.Linear with its
    parameters: (model, {module's parameter name: model's})."""
    n = module.in_features
    if norm_cls is None:
        norm = NORMS[module.normalization](n, zero_centered_gamma=module.zero_centered_gamma,
                                          params_dtype=module.weight.dtype)
    else:
        norm = norm_cls(n, eps=1e-5, dtype=module.weight.dtype)
    lin = te.Linear(n, module.out_features, params_dtype=module.weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(module.layer_norm_weight + (1 if norm_cls and
                                                      module.zero_centered_gamma else 0))
        if module.layer_norm_bias is not None:
            norm.bias.copy_(module.layer_norm_bias)
        lin.weight.copy_(module.weight)
        lin.bias.copy_(module.bias)

    class Composed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = norm, lin

        def forward(self, x):
            ln = self.norm(x)
            return self.lin(ln), ln
    names = {"weight": "lin.weight", "bias": "lin.bias", "layer_norm_weight": "norm.weight",
             "layer_norm_bias": "norm.bias"}
    return Composed(), names


def _steps(model, x, recipe, steps=2, use_ln=True):
    """Outputs, norm outputs and input grads of `steps` steps (the loss reads the norm output
    too), then parameter grads by name and buffers."""
    outs = []
    for step in range(steps):
        xi = x.clone().requires_grad_()
        torch.manual_seed(50 + step)  # NVFP4's stochastic rounding draws alike
        with te.autocast(recipe=recipe, enabled=recipe is not None):
            y, ln = model(xi)
        loss = y.float().square().sum() + (ln.float().sum() if use_ln else 0)
        loss.backward()
        outs += [y.detach(), ln.detach(), xi.grad]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return outs, grads, [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("normalization", NORMS)
def test_fused_float32_is_the_composition_with_its_history(normalization, name):
    """float32 inputs: y_hp is the FP32 y, so the fused codes are the composition's: outputs,
    the returned norm output, every gradient and DelayedScaling's histories and scales after
    three steps are te.LayerNorm + te.Linear's bit for bit."""
    m = _lnl(normalization, torch.float32, return_layernorm_output=True)
    composed, names = _composition(m)
    x = torch.randn(3, 7, 64) * 2
    got, got_grads, got_buffers = _steps(m, x, RECIPES[name], steps=3)
    want, want_grads, want_buffers = _steps(composed, x, RECIPES[name], steps=3)
    assert all(same_bits(a, b) for a, b in zip(got, want))
    for pname, g in got_grads.items():
        assert same_bits(g, want_grads[names[pname]]), pname
    assert len(got_buffers) == len(want_buffers) == (4 if name == "delayed" else 0)
    assert all(same_bits(a, b) for a, b in zip(got_buffers, want_buffers))


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("normalization", NORMS)
def test_bfloat16_within_tolerance_of_torch_norm_and_te_linear(normalization, name):
    """bfloat16, every recipe: outputs and gradients within the recipe's tolerance of torch's
    norm + te.Linear (per-tensor FP8: codes of the FP32 y, not of y rounded to bfloat16), and
    as close to float32 math as that composition (the fused codes lose nothing)."""
    m = _lnl(normalization, torch.bfloat16, return_layernorm_output=True)
    cls = torch.nn.LayerNorm if normalization == "LayerNorm" else torch.nn.RMSNorm
    composed, names = _composition(m, cls)
    x = (torch.randn(3, 21, 64) * 2 + 0.5).to(torch.bfloat16)
    got, got_grads, _ = _steps(m, x, RECIPES[name], use_ln=False)
    want, want_grads, _ = _steps(composed, x, RECIPES[name], use_ln=False)
    for a, b in zip(got, want):
        assert rel(a, b) < ERR[name]
    for pname, g in got_grads.items():
        assert rel(g, want_grads[names[pname]]) < ERR[name], pname
    hp, _, _ = _steps(copy.deepcopy(m).float(), x.float(), None, steps=1, use_ln=False)
    for a, b, h in zip(got[:3], want[:3], hp):
        assert 0 < rel(a, h) < max(1.15 * rel(b, h), 1e-2)  # quantized, and no less accurate
    if name in FUSED:
        assert rel(got[0], want[0]) > 0  # the codes of FP32 y: not the composition's bits


@pytest.mark.parametrize("normalization", NORMS)
def test_delayed_records_the_fp32_amax_where_te_linear_does(normalization):
    """Inside the autocast, after the forward, row 0 of the input's history column holds
    amax(y) of the FP32 y (the standalone kernel's amax), W's column te.Linear's amax of W;
    the composition's input amax (of y rounded to bfloat16) is within one bfloat16 rounding."""
    m = _lnl(normalization, torch.bfloat16)
    composed, _ = _composition(m)
    x = (torch.randn(40, 64) * 3).to(torch.bfloat16)
    recipe = RECIPES["delayed"]
    with te.autocast(recipe=recipe):
        m(x)
        got = m.delayed_amax_history_fwd[0].clone()
        composed(x)
        want = composed.lin.delayed_amax_history_fwd[0].clone()
    bias = None if m.layer_norm_bias is None else m.layer_norm_bias.detach()
    _, _, amax = standalone_codes(x, m.layer_norm_weight.detach(), bias, normalization, False,
                                  recipe, torch.ones(1))
    assert same_bits(got[0:1], amax) and same_bits(got[1:2], want[1:2])
    assert abs(float(got[0]) - float(want[0])) <= float(got[0]) * 2 ** -8


def test_inference_zero_tokens_and_return_layernorm_output():
    """no_grad gives the training forward's bits; the returned norm output is te.LayerNorm's;
    0 tokens work fused (both recipes)."""
    m = _lnl("LayerNorm", torch.bfloat16, return_layernorm_output=True, return_bias=True)
    x = (torch.randn(21, 64) * 2).to(torch.bfloat16)
    norm, _ = _composition(m)
    for name in FUSED:
        with torch.no_grad(), te.autocast(recipe=RECIPES[name]):
            out, bias, ln = m(x)
        with te.autocast(recipe=RECIPES[name]):
            out2, _, ln2 = m(x.clone().requires_grad_())
        assert torch.equal(out, out2) and torch.equal(ln, ln2) and bias is m.bias
        assert same_bits(ln, norm.norm(x))
        with te.autocast(recipe=RECIPES[name]):
            out0, _, ln0 = m(torch.randn(0, 64, dtype=torch.bfloat16, requires_grad=True))
        assert out0.shape == (0, 96) and ln0.shape == (0, 64)
        (out0.sum() + ln0.sum()).backward()


# ---- LayerNormMLP, checkpointing, hooks, names -------------------------------------------------

def _mlp(activation="gelu", normalization="LayerNorm", dtype=torch.bfloat16, **kw):
    torch.manual_seed(4)
    return randomize(te.LayerNormMLP(64, 96, activation=activation, normalization=normalization,
                                     params_dtype=dtype, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FUSED)
def test_layernorm_mlp_fused_is_its_parts(name, dtype):
    """LayerNormMLP = LayerNormLinear (fc1, same parameters) + the fused activation into
    te.Linear (fc2; tests/test_fused_act_modules.py tests that route), fused: outputs and the
    norm output bit for bit; float32: gradients and state too, fc1's bias within 1e-6 (the
    fused dh's dbias: tests/test_fused_dh.py); bfloat16 within 5% (fc1's E5M2 codes are of the
    FP32 dh: one step, up to 25%, where they differ from those of bfloat16's; measured ~1%)."""
    m = _mlp("swiglu", "RMSNorm", dtype, return_layernorm_output=True)
    fc1 = te.LayerNormLinear(64, 192, normalization="RMSNorm", params_dtype=dtype,
                             return_layernorm_output=True)
    fc2 = copy.deepcopy(m.fc2)
    with torch.no_grad():
        fc1.weight.copy_(m.fc1_weight)
        fc1.bias.copy_(m.fc1_bias)
        fc1.layer_norm_weight.copy_(m.layer_norm_weight)

    class Parts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = fc1, fc2

        def forward(self, x):
            h, ln = self.fc1(x)  # fc2 activates h as LayerNormMLP's does (_act_fn.py)
            return self.fc2(_act_fn.ActInput(h, "swiglu")), ln
    x = (torch.randn(2, 9, 64) * 2).to(dtype)
    got, got_grads, got_buf = _steps(m, x, RECIPES[name])
    want, want_grads, want_buf = _steps(Parts(), x, RECIPES[name])
    exact = dtype == torch.float32
    for i, (a, b) in enumerate(zip(got, want)):  # per step: y, ln, the input's gradient
        assert same_bits(a, b) if exact or i % 3 < 2 else rel(a, b) < 0.05
    assert all(same_bits(a, b) if exact else rel(a, b) < 0.05 for a, b in zip(got_buf, want_buf))
    for ours in ("layer_norm_weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        a, b = got_grads[ours], want_grads[ours.replace("layer_norm", "fc1.layer_norm")]
        assert same_bits(a, b) if exact and ours != "fc1.bias" else \
            rel(a, b) < (1e-6 if exact else 0.05), ours


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_activation_checkpointing_gives_the_gradients(name, mode):
    """Blocks of LayerNormLinear + LayerNormMLP, each checkpointed: three steps give the same
    gradients, parameters and DelayedScaling state as without checkpointing, bit for bit (the
    recompute's norm casts with the forward's scale and records no amax)."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = te.LayerNormLinear(64, 64, params_dtype=torch.bfloat16)
            self.mlp = te.LayerNormMLP(64, 96, params_dtype=torch.bfloat16)

        def forward(self, x):
            x = x + self.attn(x)
            return x + self.mlp(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])
            self.mode = None

        def forward(self, x):
            for b in self.blocks:
                x = b(x) if self.mode is None else checkpoint(
                    b, x, use_reentrant=self.mode == "reentrant")
            return x

    torch.manual_seed(5)
    model = randomize(Model())
    twin = copy.deepcopy(model)
    twin.mode = mode

    def train(mdl):
        torch.manual_seed(6)
        out = []
        for _ in range(3):
            x = (torch.randn(2, 19, 64)).to(torch.bfloat16).requires_grad_()
            with te.autocast(recipe=RECIPES[name]):
                y = mdl(x)
            y.float().square().mean().backward()
            out += [x.grad] + [p.grad.clone() for p in mdl.parameters()]
            with torch.no_grad():
                for p in mdl.parameters():
                    p -= 0.05 * p.grad
                    p.grad = None
        return out + [b.clone() for b in mdl.buffers()]
    got, want = train(twin), train(model)
    assert len(got) == len(want)
    assert all(same_bits(a, b) for a, b in zip(got, want))


def test_hooked_fc1_gets_the_norm_output():
    """A forward pre-hook on fc1 (as FSDP2's fully_shard of fc1 alone, or any hook) sees a
    tensor: fc1 then quantizes the norm's output itself (float32: the same bits as fused)."""
    m = _mlp(dtype=torch.float32)
    twin = copy.deepcopy(m)
    seen = []
    twin.fc1.register_forward_pre_hook(lambda mod, args: seen.append(type(args[0])))
    x = torch.randn(5, 64)
    with te.autocast(recipe=RECIPES["current"]):
        assert torch.equal(m(x), twin(x))
    assert seen == [torch.Tensor]


def test_te_state_dict_names_load_into_the_fused_module():
    m = _lnl("LayerNorm", torch.bfloat16)
    sd = m.state_dict()
    assert sorted(sd) == ["bias", "layer_norm_bias", "layer_norm_weight", "weight"]
    fresh = te.LayerNormLinear(64, 96, params_dtype=torch.bfloat16)
    fresh.load_state_dict({k: v.clone() for k, v in sd.items()})
    x = torch.randn(21, 64, dtype=torch.bfloat16)
    for name in FUSED:
        with te.autocast(recipe=RECIPES[name]):
            assert torch.equal(m(x), fresh(x))
    mlp = _mlp()
    mlp_sd = mlp.state_dict()
    fresh_mlp = te.LayerNormMLP(64, 96, params_dtype=torch.bfloat16)
    fresh_mlp.load_state_dict({k: v.clone() for k, v in mlp_sd.items()})
    with te.autocast(recipe=RECIPES["delayed"]):
        assert torch.equal(mlp(x), fresh_mlp(x))


@pytest.mark.parametrize("bad, error, exc", [
    ("x", "inp must be a torch.Tensor", TypeError),
    (torch.randn(4, 32), r"expected \[..., 64\]", ValueError),
    (torch.tensor(1.0), r"expected \[..., 64\]", ValueError),
])
def test_fused_modules_bad_inputs(bad, error, exc):
    for module in (te.LayerNormLinear(64, 32), te.LayerNormMLP(64, 32)):
        with te.autocast(recipe=RECIPES["current"]):
            with pytest.raises(exc, match=error):
                module(bad)
    with pytest.raises(TypeError, match="is_first_microbatch"):
        te.LayerNormLinear(64, 32)(torch.randn(2, 64), is_first_microbatch=1)


# ---- FSDP2 (2 gloo ranks) ----------------------------------------------------------------------

def fsdp_worker(rank, world):
    """LayerNormLinear + LayerNormMLP under FSDP2 with the weights all-gathered quantized
    (MixedPrecisionPolicy bfloat16): the norm writes the codes from the gathered norm
    parameters, and each rank's outputs equal one process's unsharded model on that rank's data
    bit for bit, three steps, the gradients the ranks' mean of its gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = te.LayerNormLinear(64, 64)
            self.mlp = te.LayerNormMLP(64, 128, normalization="RMSNorm", activation="swiglu")

        def forward(self, x):
            x = x + self.attn(x)
            return x + self.mlp(x)
    fused_calls = []
    fused = _norm_fn.NormInput.fused
    _norm_fn.NormInput.fused = lambda self, *a, **k: fused_calls.append(1) or fused(self, *a, **k)
    for name in FUSED:
        torch.manual_seed(0)
        base = randomize(Model())
        ref = copy.deepcopy(base).to(torch.bfloat16)
        model = te.distributed.enable_quantized_all_gather(copy.deepcopy(base))
        kw = {"mesh": init_device_mesh("cpu", (world,)),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
        fully_shard(model.attn, **kw)
        fully_shard(model.mlp, **kw)
        fully_shard(model, **kw)
        for step in range(3):
            torch.manual_seed(100 * step + rank)
            x = torch.randn(2, 11, 64, dtype=torch.bfloat16)
            outs, grads = [], []
            for m in (model, ref):
                with te.autocast(recipe=RECIPES[name]):
                    y = m(x)
                y.float().square().mean().backward()
                outs.append(y.detach())
                grads.append([p.grad for p in m.parameters()])
            assert torch.equal(outs[0], outs[1]), (name, step)
            for got, want in zip(*grads):
                want = want.float().clone()
                dist.all_reduce(want)
                want /= world
                assert rel(got.full_tensor().float(), want) < 2e-2, (name, step)
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
    return len(fused_calls)


def test_fsdp_quantized_all_gather_two_ranks():
    from dist_util import run_ranks
    import tequant.distributed  # noqa: F401  (te.distributed)
    calls = run_ranks(fsdp_worker, 2, timeout=300)
    assert all(n == 2 * 3 * 2 * 2 for n in calls), calls  # 2 recipes, 3 steps, 2 norms, 2 models
