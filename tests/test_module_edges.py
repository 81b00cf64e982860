"""What users do to modules besides calling them: cast a trained model's dtype, build one with
misaligned features, load a TransformerEngine checkpoint, hand a 0-dim input, give a module
strided parameters.

- .half() / .bfloat16() / .to(dtype) leave DelayedScaling's state float32 and its values intact
  (python/tequant/delayed.py keeping_float32, Linear._apply); the cast model trains on as one
  built in that dtype with the same state.
- A feature count the recipe cannot quantize raises on every call, not only on the first one
  (Linear._plan keeps a plan only once it is checked), te.prepare_state too.
- TE's `_extra_state` entries load (strict) into te.Linear, te.LayerNormLinear, te.LayerNormMLP,
  te.LayerNorm and te.RMSNorm; other unknown keys still fail.
- A 0-dim input inside te.autocast gets a ValueError naming what Linear takes.
- A strided weight Parameter (a transposed tensor) quantizes as its contiguous copy would
  (csrc/ext/linear.c), output and gradients bit for bit; strided norm parameters run torch's norm
  (python/tequant/_norm_fn.py refusal), also inside te.autocast.
"""
import io
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import tequant as te  # noqa: E402
from tequant.recipe import DelayedScaling  # noqa: E402
from test_linear import DEVICES, RECIPES, make_linear, one_cpu_thread, randn  # noqa: E402

assert one_cpu_thread  # the autouse fixture, imported to apply here too

STATE = ("delayed_amax_history_fwd", "delayed_scale_fwd", "delayed_amax_history_bwd",
         "delayed_scale_bwd")


def _step(module, x, recipe, seed=0):
    """One forward and backward under recipe (SR's draws seeded); returns y and the grads of x
    and of every parameter."""
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = module(x)
    y.float().square().sum().backward()
    grads = [x.grad] + [p.grad for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return y.detach(), grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cast", ["half", "bfloat16", "to"])
def test_dtype_cast_keeps_delayed_state_float32(cast, device):
    lin = make_linear(32, 32, device=device, seed=1)
    x = randn(8, 32, seed=2, device=device, scale=1e-3)  # scale_fwd of x ~1e5: > float16's max
    for _ in range(2):
        _step(lin, x, DelayedScaling())
    before = {name: getattr(lin, name).clone() for name in STATE}
    assert before["delayed_scale_fwd"][0] > 65504
    if cast == "to":
        lin.to(device, torch.bfloat16)
    else:
        getattr(lin, cast)()
    for name in STATE:
        assert getattr(lin, name).dtype == torch.float32, name
        assert torch.equal(getattr(lin, name), before[name]), name
    dtype = lin.weight.dtype
    fresh = te.Linear(32, 32, params_dtype=dtype, device=device)
    fresh.load_state_dict(lin.state_dict())  # the same parameters and float32 state
    got, want = _step(lin, x.to(dtype), DelayedScaling()), _step(fresh, x.to(dtype),
                                                                 DelayedScaling())
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
    for name in STATE:
        assert torch.equal(getattr(lin, name), getattr(fresh, name)), name


def test_dtype_cast_of_a_fused_module_keeps_its_linears_state():
    mlp = te.LayerNormMLP(32, 64)
    _step(mlp, randn(4, 32, seed=3), DelayedScaling())
    mlp.bfloat16()
    assert mlp.fc1.weight.dtype == torch.bfloat16
    for fc in (mlp.fc1, mlp.fc2):
        assert all(getattr(fc, name).dtype == torch.float32 for name in STATE)
    y, _ = _step(mlp, randn(4, 32, seed=4, dtype=torch.bfloat16), DelayedScaling())
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


@pytest.mark.parametrize("name", list(RECIPES))
def test_misaligned_features_raise_on_every_call(name):
    align = 32 if name == "mxfp8" else 16
    lin = te.Linear(64, 64 + align // 2)
    x = torch.randn(4, 64, requires_grad=True)
    for grad in (False, False, True, True):
        with torch.set_grad_enabled(grad), te.autocast(recipe=RECIPES[name]):
            with pytest.raises(ValueError, match=rf"out_features={64 + align // 2} must be a "
                                                 rf"multiple of {align}"):
                lin(x)
    assert not lin._plans  # nothing kept that would skip the check
    for _ in range(2):
        with pytest.raises(ValueError, match="out_features"):
            te.prepare_state(torch.nn.Sequential(lin), RECIPES[name])


def _modules():
    return {
        "Linear": lambda: te.Linear(32, 48),
        "LayerNormLinear": lambda: te.LayerNormLinear(32, 48),
        "LayerNormMLP": lambda: te.LayerNormMLP(32, 64),
        "LayerNorm": lambda: te.LayerNorm(32),
        "RMSNorm": lambda: te.RMSNorm(32),
    }


@pytest.mark.parametrize("extra", ["bytes", "tensor", "none"])
@pytest.mark.parametrize("kind", list(_modules()))
def test_transformer_engine_extra_state_loads(kind, extra):
    """TE writes `<prefix>_extra_state` for each module (its FP8 metadata: a BytesIO, a uint8
    tensor or None by version); a strict load accepts it, at the top level and nested."""
    payload = {"bytes": io.BytesIO(b"fp8 meta"), "tensor": torch.zeros(3, dtype=torch.uint8),
               "none": None}[extra]
    src, dst = _modules()[kind](), _modules()[kind]()
    sd = dict(src.state_dict(), _extra_state=payload)
    dst.load_state_dict(sd)
    for a, b in zip(src.state_dict().values(), dst.state_dict().values()):
        assert torch.equal(a, b)
    outer = torch.nn.Sequential(_modules()[kind]())
    outer.load_state_dict({**{f"0.{k}": v for k, v in src.state_dict().items()},
                           "0._extra_state": payload})
    with pytest.raises(RuntimeError, match="_extra_statee"):
        dst.load_state_dict(dict(sd, _extra_statee=payload))


def test_zero_dim_input_raises_inside_autocast():
    lin = te.Linear(64, 32)
    with te.autocast(recipe=RECIPES["current"]):
        with pytest.raises(ValueError, match=r"0-dim tensor; this Linear takes \[\.\.\., 64\]"):
            lin(torch.tensor(1.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_strided_weight_quantizes_as_its_contiguous_copy(name, device):
    dense = make_linear(64, 32, device=device, seed=5)
    strided = make_linear(64, 32, device=device, seed=5)
    strided.weight = torch.nn.Parameter(dense.weight.detach().t().contiguous().t())
    assert not strided.weight.is_contiguous()
    x = randn(2, 5, 64, seed=6, device=device)
    for _ in range(2):  # DelayedScaling's second step uses the first one's scales
        got, want = _step(strided, x, RECIPES[name]), _step(dense, x, RECIPES[name])
        assert torch.equal(got[0], want[0])
        for a, b in zip(got[1], want[1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_strided_norm_parameters_run_torch_norm(normalization, device):
    x = randn(4, 6, 32, seed=7, device=device).requires_grad_()
    gamma = torch.nn.Parameter(randn(64, seed=8, device=device)[::2])
    beta = torch.nn.Parameter(randn(64, seed=9, device=device)[::2])
    norm = getattr(te, normalization)(32, device=device)
    norm.weight = gamma
    if normalization == "LayerNorm":
        norm.bias = beta
        want = F.layer_norm(x, (32,), gamma, beta, eps=norm.eps)
    else:
        want = F.rms_norm(x, (32,), gamma, eps=norm.eps)
    assert torch.equal(norm(x), want)
    # te.LayerNormLinear inside te.autocast: torch's norm, then the Linear quantizes its output
    lnl = te.LayerNormLinear(32, 48, normalization=normalization, device=device)
    lnl.layer_norm_weight = gamma
    with te.autocast(recipe=RECIPES["current"]):
        y = lnl(x)
        ref = te.Linear(32, 48, device=device)
        ref.load_state_dict({"weight": lnl.weight, "bias": lnl.bias})
        want = ref(F.layer_norm(x, (32,), gamma, lnl.layer_norm_bias, eps=lnl.eps)
                   if normalization == "LayerNorm" else F.rms_norm(x, (32,), gamma, eps=lnl.eps))
    assert torch.equal(y, want)


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_backward_update_runs_when_the_first_module_is_frozen(device):
    """A frozen first te.Linear fed an input without grad records no backward, so it must not
    take the role of running the backward update (TE gives it to the first module whose inputs
    need grad): the next module's grad_output history rolls and its scale follows, as when the
    first module trains."""
    results = []
    for frozen in (False, True):
        a, b = make_linear(32, 32, device=device, seed=10), make_linear(32, 32, device=device,
                                                                          seed=11)
        a.requires_grad_(not frozen)
        for step in range(3):
            x = randn(8, 32, seed=12 + step, device=device)
            with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
                y = b(a(x))
            (y * 1e-7).sum().backward()
        results.append((b.delayed_amax_history_bwd.clone(), b.delayed_scale_bwd.clone(),
                        b.weight.grad.clone()))
    for want, got in zip(*results):
        assert torch.equal(got, want)
    assert results[1][1].item() > 1e6  # the scale left 1.0 (history rolled)
