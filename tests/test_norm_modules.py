"""te.LayerNorm, te.RMSNorm, te.LayerNormLinear and te.LayerNormMLP (the fused-modules issue's
module layer; python/tequant/norm.py, layernorm_linear.py, layernorm_mlp.py).

- The norms against the formulas written out here in fp64 torch math (the modules run the norm
  kernels), zero-centered gamma included; TE's parameter names.
- LayerNormLinear / LayerNormMLP outside te.autocast: the exact high-precision composition
  (the norm, the activation written out here as TE defines it, F.linear).
- Inside te.autocast, every recipe: outputs and gradients bit-identical to the composition of
  the norm, te.Linear and the activation with the same parameters (the modules add no
  arithmetic of their own; float32 inputs, so the per-tensor FP8 recipes' fused codes, cast from
  the FP32 norm output, are te.Linear's own: tests/test_fused_norm_modules.py covers bfloat16),
  and within the recipe's quantization error of the high-precision module.
- TE's state_dict names, a TE-named state_dict loads; returns in TE's order; bad arguments
  raise; torch.compile bit-identical to eager.
- LayerNormMLP with set_parallel_mode and sequence parallelism on 2 gloo ranks (one spawn for
  gelu and swiglu) against one process's module: exact in high precision, within the recipe's
  error quantized, the norm's gradient after reduce_sequence_parallel_grads.
"""
import copy
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import tequant as te
from tequant import _act_fn

sys.path.insert(0, os.path.dirname(__file__))
from test_compile import RECIPES  # noqa: E402  (DelayedScaling with a 4-row history)

ERR = {"delayed": 0.08, "current": 0.08, "block": 0.08, "mxfp8": 0.08, "nvfp4": 0.35}
ACT_REF = {
    "gelu": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    "relu": lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
    "silu": lambda x: x / (1 + torch.exp(-x)),
    "qgelu": lambda x: x / (1 + torch.exp(-1.702 * x)),
    "srelu": lambda x: torch.where(x > 0, x * x, torch.zeros_like(x)),
}
GATED_REF = {"geglu": "gelu", "reglu": "relu", "swiglu": "silu"}


def ref_norm(x, normalization, gamma, beta, eps):
    x = x.double()
    if normalization == "LayerNorm":
        mean = x.mean(-1, keepdim=True)
        y = (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps)
        return y * gamma.double() + beta.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gamma.double()


def ref_act(h, activation):
    if activation in GATED_REF:
        a, b = h.chunk(2, dim=-1)
        return ACT_REF[GATED_REF[activation]](a) * b
    return ACT_REF[activation](h)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
def test_norms_match_the_formula(cls, zero_centered):
    torch.manual_seed(0)
    m = cls(48, eps=1e-4, zero_centered_gamma=zero_centered)
    assert torch.equal(m.weight, torch.zeros(48) if zero_centered else torch.ones(48))
    with torch.no_grad():
        m.weight.normal_()
        if m.bias is not None:
            m.bias.normal_()
    x = torch.randn(3, 5, 48) * 4 + 1
    gamma = m.weight + 1 if zero_centered else m.weight
    want = ref_norm(x, m.normalization, gamma, m.bias, 1e-4)
    assert rel(m(x), want) < 1e-6
    names = {"weight", "bias"} if cls is te.LayerNorm else {"weight"}
    assert set(m.state_dict()) == names


def _layernorm_linear(normalization, **kw):
    m = te.LayerNormLinear(64, 32, normalization=normalization, **kw)
    with torch.no_grad():
        m.layer_norm_weight.normal_()
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.normal_()
        m.bias.normal_()
    return m


def _composed_linear(m):
    """The same computation from te.LayerNorm/RMSNorm + te.Linear holding m's parameters."""
    cls = te.LayerNorm if m.normalization == "LayerNorm" else te.RMSNorm
    n = cls(m.in_features, eps=m.eps, zero_centered_gamma=m.zero_centered_gamma)
    lin = te.Linear(m.in_features, m.out_features)
    with torch.no_grad():
        n.weight.copy_(m.layer_norm_weight)
        if m.layer_norm_bias is not None:
            n.bias.copy_(m.layer_norm_bias)
        lin.weight.copy_(m.weight)
        lin.bias.copy_(m.bias)
    return torch.nn.Sequential(n, lin)


def _fwd_bwd(model, x, recipe, steps=2):
    """Outputs and input grads of `steps` steps (loss: the sum of squares), then the parameter
    grads."""
    outs = []
    for step in range(steps):
        xi = x.clone().requires_grad_()
        torch.manual_seed(50 + step)  # NVFP4's stochastic rounding draws alike
        with te.autocast(recipe=recipe, enabled=recipe is not None):
            y = model(xi)
        y.float().square().sum().backward()
        outs += [y.detach(), xi.grad]
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return outs, grads


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_is_the_composition(normalization, name):
    m = _layernorm_linear(normalization, zero_centered_gamma=name == "block")
    composed = _composed_linear(m)
    x = torch.randn(3, 7, 64)  # 21 tokens: no format's multiple
    got, got_grads = _fwd_bwd(m, x, RECIPES[name])
    want, want_grads = _fwd_bwd(composed, x, RECIPES[name])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    want_named = dict(zip((n for n, _ in composed.named_parameters()), want_grads))
    same = {"weight": "1.weight", "bias": "1.bias", "layer_norm_weight": "0.weight",
            "layer_norm_bias": "0.bias"}
    for (pname, _), g in zip(m.named_parameters(), got_grads):
        assert torch.equal(g, want_named[same[pname]]), pname
    hp, _ = _fwd_bwd(m, x, None, steps=1)
    assert rel(got[0], hp[0]) < ERR[name]


def test_layernorm_linear_high_precision_and_names():
    m = _layernorm_linear("LayerNorm", return_bias=True, return_layernorm_output=True)
    x = torch.randn(4, 64)
    out, bias, ln_out = m(x)
    want_ln = ref_norm(x, "LayerNorm", m.layer_norm_weight, m.layer_norm_bias, 1e-5)
    assert rel(ln_out, want_ln) < 1e-6
    assert torch.equal(out, F.linear(ln_out, m.weight)) and bias is m.bias
    assert list(m.state_dict()) == ["weight", "bias", "layer_norm_weight", "layer_norm_bias"]
    r = te.LayerNormLinear(64, 32, normalization="RMSNorm", bias=False)
    assert list(r.state_dict()) == ["weight", "layer_norm_weight"]
    assert isinstance(m, te.Linear)


@pytest.mark.parametrize("bad, error", [
    (dict(normalization="BatchNorm"), "normalization must be"),
    (dict(parallel_mode="row"), "parallel_mode must be None or 'column'"),
    (dict(eps=0), "eps must be a positive number"),
])
def test_layernorm_linear_bad_arguments(bad, error):
    with pytest.raises(ValueError, match=error):
        te.LayerNormLinear(64, 32, **bad)


def test_layernorm_linear_bad_input():
    m = te.LayerNormLinear(64, 32)
    with pytest.raises(TypeError, match="inp must be a torch.Tensor"):
        m("x")
    with pytest.raises(ValueError, match=r"expected \[..., 64\]"):
        m(torch.randn(4, 32))


def _mlp(activation, normalization="LayerNorm", **kw):
    m = te.LayerNormMLP(64, 96, activation=activation, normalization=normalization, **kw)
    with torch.no_grad():
        for p in (m.layer_norm_weight, m.layer_norm_bias, m.fc1_bias, m.fc2_bias):
            if p is not None:
                p.normal_()
    return m


@pytest.mark.parametrize("activation", list(ACT_REF) + list(GATED_REF))
def test_layernorm_mlp_high_precision_matches_te_activations(activation):
    torch.manual_seed(1)
    m = _mlp(activation, "RMSNorm" if activation in ("silu", "swiglu") else "LayerNorm")
    x = torch.randn(5, 64, dtype=torch.float64).float()
    ln = ref_norm(x, m.normalization, m.layer_norm_weight, m.layer_norm_bias, 1e-5)
    h = ln @ m.fc1_weight.double().t() + m.fc1_bias.double()
    want = ref_act(h, activation) @ m.fc2_weight.double().t() + m.fc2_bias.double()
    assert m.fc1_weight.shape == (96 * (2 if activation in GATED_REF else 1), 64)
    assert rel(m(x), want) < 1e-5


@pytest.mark.parametrize("name", list(RECIPES))
def test_layernorm_mlp_is_the_composition(name):
    torch.manual_seed(2)
    m = _mlp("swiglu" if name in ("current", "nvfp4") else "gelu",
             "RMSNorm" if name == "current" else "LayerNorm")
    cls = te.LayerNorm if m.normalization == "LayerNorm" else te.RMSNorm
    n = cls(64)
    with torch.no_grad():
        n.weight.copy_(m.layer_norm_weight)
        if n.bias is not None:
            n.bias.copy_(m.layer_norm_bias)
    fc1, fc2 = copy.deepcopy(m.fc1), copy.deepcopy(m.fc2)
    act = m.activation
    activate = _act_fn.kernel_activate if name == "delayed" else _act_fn.activate

    class Composed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n, self.fc1, self.fc2 = n, fc1, fc2

        def forward(self, x):
            h = self.fc1(self.n(x))  # the activation kernel's float32 output (_act_fn.py; its
            return self.fc2(activate(h, act))  # fused codes: the same bits), torch's where unfused

    x = torch.randn(2, 9, 64)
    got, got_grads = _fwd_bwd(m, x, RECIPES[name])
    want, want_grads = _fwd_bwd(Composed(), x, RECIPES[name])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(got_grads, want_grads):  # norm, fc1, fc2 in both
        assert torch.equal(a, b)
    hp, _ = _fwd_bwd(m, x, None, steps=1)
    assert rel(got[0], hp[0]) < ERR[name] * 2  # two quantized GEMMs in a row


def test_layernorm_mlp_te_state_dict_names_load():
    m = _mlp("gelu", return_bias=True, return_layernorm_output=True)
    sd = m.state_dict()
    te_names = ["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight",
                "fc2_bias"]
    assert sorted(sd) == sorted(te_names)
    fresh = te.LayerNormMLP(64, 96)
    assert not torch.equal(fresh.fc1_weight, m.fc1_weight)
    fresh.load_state_dict({k: v.clone() for k, v in sd.items()})  # strict: every name known
    for k in te_names:
        assert torch.equal(getattr(fresh, k), getattr(m, k)), k
    out, bias, ln = m(torch.randn(3, 64))
    assert bias is m.fc2_bias and ln.shape == (3, 64)
    with pytest.raises(RuntimeError, match="fc1_weightt"):
        fresh.load_state_dict(dict(sd, fc1_weightt=sd["fc1_weight"]))


@pytest.mark.parametrize("bad, error", [
    (dict(activation="tanh"), "activation must be one of"),
    (dict(normalization="rms"), "normalization must be"),
    (dict(tp_size=2), "set_parallel_mode=True"),
    (dict(ffn_hidden_size=0), "ffn_hidden_size must be a positive int"),
])
def test_layernorm_mlp_bad_arguments(bad, error):
    kwargs = dict(hidden_size=64, ffn_hidden_size=96)
    kwargs.update(bad)
    with pytest.raises(ValueError, match=error):
        te.LayerNormMLP(**kwargs)


def _steps(step, model, x, n=2):
    outs = []
    for _ in range(n):
        xi = x.clone().requires_grad_()
        y = step(model, xi)
        y.float().square().mean().backward()
        outs += [y.detach(), xi.grad]
    return outs + [p.grad for p in model.parameters()] + [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_modules_compile_bit_identical(name):
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        te.LayerNormLinear(64, 32),
        te.LayerNormMLP(32, 48, activation="swiglu", normalization="RMSNorm"))
    twin = copy.deepcopy(model)
    x = torch.randn(2, 8, 64)
    recipe = RECIPES[name]

    def step(m, x):
        with te.autocast(recipe=recipe):
            return m(x)
    got = _steps(step, model, x)
    want = _steps(torch.compile(step, backend="aot_eager", fullgraph=True), twin, x)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def tp_worker(rank, world, activation):
    """LayerNormMLP with set_parallel_mode and sequence parallelism on `world` gloo ranks against
    one process's module with the same parameters: out and dx on this rank's tokens (row
    parallel sums partial products: fp32 order in high precision, the recipe's error quantized),
    and the norm's gradient after reduce_sequence_parallel_grads."""
    import torch.distributed as dist
    torch.manual_seed(4)
    whole = _mlp(activation)
    tp = te.LayerNormMLP(64, 96, activation=activation, set_parallel_mode=True,
                         sequence_parallel=True, tp_group=dist.group.WORLD, tp_size=world)
    gated = activation in GATED_REF
    with torch.no_grad():
        tp.layer_norm_weight.copy_(whole.layer_norm_weight)
        tp.layer_norm_bias.copy_(whole.layer_norm_bias)
        halves = whole.fc1_weight.chunk(2 if gated else 1, 0)  # each rank: its part of each half
        tp.fc1_weight.copy_(torch.cat([h.chunk(world, 0)[rank] for h in halves]))
        bias_halves = whole.fc1_bias.chunk(2 if gated else 1, 0)
        tp.fc1_bias.copy_(torch.cat([h.chunk(world, 0)[rank] for h in bias_halves]))
        tp.fc2_weight.copy_(whole.fc2_weight.chunk(world, 1)[rank])
        tp.fc2_bias.copy_(whole.fc2_bias)
    x = torch.randn(16, 2, 64)
    errors = {}
    for name in (None, "current"):
        recipe = RECIPES.get(name)
        want, _ = _fwd_bwd(whole, x, recipe, steps=1)
        got, _ = _fwd_bwd(tp, x.chunk(world, 0)[rank].contiguous(), recipe, steps=1)
        errors[name] = [rel(a, b.chunk(world, 0)[rank]) for a, b in zip(got, want)]
    xi = x.chunk(world, 0)[rank].contiguous()
    tp(xi).square().sum().backward()
    te.distributed.reduce_sequence_parallel_grads(tp, dist.group.WORLD)
    whole.zero_grad()
    whole(x).square().sum().backward()
    errors["norm grad"] = rel(tp.layer_norm_weight.grad, whole.layer_norm_weight.grad)
    return errors


TP_ACTIVATIONS = ("gelu", "swiglu")


def tp_cases(rank, world):
    """tp_worker for each activation in one spawn (starting the ranks costs more than a case)."""
    return {activation: tp_worker(rank, world, activation) for activation in TP_ACTIVATIONS}


@pytest.fixture(scope="module")
def tp_two_ranks():
    from dist_util import run_ranks
    import tequant.distributed  # noqa: F401  (te.distributed)
    return run_ranks(tp_cases, 2, timeout=240)


@pytest.mark.parametrize("activation", TP_ACTIVATIONS)
def test_layernorm_mlp_tensor_parallel_two_ranks(activation, tp_two_ranks):
    for results in tp_two_ranks:
        errors = results[activation]
        assert max(errors[None]) < 1e-5, errors
        assert max(errors["current"]) < ERR["current"] * 2, errors
        assert errors["norm grad"] < 1e-5, errors
