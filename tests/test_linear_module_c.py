"""te.Linear.forward's plain call in C (csrc/ext/linear_module.c, _C.linear_module_forward).

A plain call (an exact te.Linear, a torch.Tensor input, an enabled te.autocast with a plan the
module holds, its own Parameter weight, no tensor parallelism, backward_override, activation
checkpointing, torch.autocast or functorch transform) runs from Linear.forward straight into C;
any other returns NotImplemented and takes the Python path. Checked: plain calls never reach
Linear._compute; against the Python path (the C call switched off) on an identical module,
several steps of outputs, gradients and DelayedScaling buffers (histories and scales updated at
each autocast's exit and in backward) are equal bit for bit, with and without grad, under
inference_mode, with return_bias, frozen weights, is_first_microbatch and parameters swapped in
by torch.func.functional_call; every other kind of call reaches _compute;
replaced DelayedScaling buffers are used at once; bad calls raise. Every recipe, CPU and CUDA.
"""
import copy

import pytest
import torch

import tequant as te
from tequant import _C
from tequant import linear as L
from tequant.recipe import CustomRecipe, DelayedScaling, Float8CurrentScaling
from test_linear_alloc import DEVICES, RECIPES  # noqa: E402
from test_linear_ctx import python_function, same_bits  # noqa: E402

K, N = 64, 96


def counting_compute(monkeypatch):
    """Linear._compute, counting its calls (the Python path's)."""
    calls = []
    compute = L.Linear._compute

    def counted(self, *args):
        calls.append(self)
        return compute(self, *args)
    monkeypatch.setattr(L.Linear, "_compute", counted)
    return calls


def python_path(monkeypatch):
    monkeypatch.setattr(L, "_module_forward", lambda *args: NotImplemented)


def run_steps(lin, recipe, xs, dys, *, grad, first_microbatch):
    """Forward (and backward where grad) of each x; NVFP4's rounding draws from a fixed seed."""
    results = []
    for i, (x, dy) in enumerate(zip(xs, dys)):
        torch.manual_seed(11 + i)
        x = x.clone().requires_grad_(grad is True)
        with torch.set_grad_enabled(grad is True), te.autocast(recipe=recipe):
            if grad == "inference":
                with torch.inference_mode():
                    y = lin(x, is_first_microbatch=first_microbatch[i]).clone()
            else:
                y = lin(x, is_first_microbatch=first_microbatch[i])
        out = y[0] if isinstance(y, tuple) else y
        if isinstance(y, tuple):
            assert y[1] is lin.bias
        if grad is True:
            out.backward(dy)
        results.append((out.detach(), x.grad))
    grads = [p.grad for p in lin.parameters()]
    return results, grads, [b.clone() for b in lin.buffers()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["grad", "no_grad", "inference", "return_bias",
                                  "frozen_weight", "first_microbatch", "3d"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_c_forward_matches_the_python_path(name, case, device, monkeypatch):
    torch.manual_seed(0)
    lin = te.Linear(K, N, params_dtype=torch.bfloat16, device=device,
                    return_bias=case == "return_bias")
    if case == "frozen_weight":
        lin.weight.requires_grad_(False)
    ref = copy.deepcopy(lin)
    shape = (2, 21, K) if case == "3d" else (40, K)
    xs = [torch.randn(shape, dtype=torch.bfloat16, device=device) * (1 + i) for i in range(3)]
    dys = [torch.randn(shape[:-1] + (N,), dtype=torch.bfloat16, device=device) for _ in xs]
    first = [True, False, False] if case == "first_microbatch" else [None] * 3
    grad = {"no_grad": False, "inference": "inference"}.get(case, True)
    recipe = RECIPES[name]

    calls = counting_compute(monkeypatch)
    got = run_steps(lin, recipe, xs, dys, grad=grad, first_microbatch=first)
    assert calls == [lin]  # the first call made the plan; the other two ran in C
    python_path(monkeypatch)
    want = run_steps(ref, recipe, xs, dys, grad=grad, first_microbatch=first)
    assert len(calls) == 4
    for (y, dx), (y_ref, dx_ref) in zip(got[0], want[0]):
        assert same_bits(y, y_ref)
        assert same_bits(dx, dx_ref)
    for a, b in zip(got[1] + got[2], want[1] + want[2]):
        assert same_bits(a, b)
    if name == "delayed":  # amaxes recorded; with grad, registered and updated at the exits
        hist_fwd, scale_fwd = got[2][0], got[2][1]
        assert hist_fwd.abs().sum() > 0
        assert torch.equal(scale_fwd, torch.ones_like(scale_fwd)) != (grad is True)


def _subclass():
    class Sub(te.Linear):
        pass
    return Sub


@pytest.mark.parametrize("device", DEVICES)
def test_other_calls_take_the_python_path(device, monkeypatch):
    """Each of these reaches Linear._compute (or the compiled path's checks) as before."""
    recipe = Float8CurrentScaling()
    torch.manual_seed(0)
    lin = te.Linear(K, N, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(8, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    with te.autocast(recipe=recipe):
        lin(x)
    calls = counting_compute(monkeypatch)
    with te.autocast(recipe=recipe):
        lin(x)
    assert calls == []

    def reaches_python(fn):
        del calls[:]
        fn()
        assert calls, fn.__name__

    def outside_autocast():
        lin(x)

    def disabled_autocast():
        with te.autocast(enabled=False):
            lin(x)

    def custom_recipe():
        with te.autocast(recipe=CustomRecipe(qfactory=lambda role: None)):
            with pytest.raises(TypeError):
                lin(x)

    def backward_override():
        with te.autocast(recipe=Float8CurrentScaling(backward_override="high_precision")):
            lin(x)
            lin(x)

    def checkpointed():
        with te.autocast(recipe=recipe):
            torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=False).sum().backward()

    def torch_autocast():
        with te.autocast(recipe=recipe), torch.autocast(device, dtype=torch.bfloat16):
            lin(x.float())

    def subclass():
        sub = _subclass()(K, N, params_dtype=torch.bfloat16, device=device)
        with te.autocast(recipe=recipe):
            sub(x)
            sub(x)

    def forward_ad():
        import torch.autograd.forward_ad as fwad
        with fwad.dual_level(), te.autocast(recipe=recipe):
            with pytest.raises(RuntimeError):
                lin(fwad.make_dual(x.detach(), torch.ones_like(x)))

    def vmap():
        with te.autocast(recipe=recipe), pytest.raises(RuntimeError):
            torch.vmap(lin)(x.detach().unsqueeze(0))

    def features_mismatch():
        with te.autocast(recipe=recipe), pytest.raises(ValueError, match="features in its"):
            lin(x[:, :32])

    def not_a_tensor():
        with te.autocast(recipe=recipe), pytest.raises(TypeError, match="inp must be"):
            lin(x.tolist())
        calls.append("raised before _compute")

    def bad_first_microbatch():
        with te.autocast(recipe=recipe), pytest.raises(TypeError, match="is_first_microbatch"):
            lin(x, is_first_microbatch=1)
        calls.append("raised before _compute")

    def weight_not_a_parameter():
        other = te.Linear(K, N, params_dtype=torch.bfloat16, device=device)
        w = other.weight.detach().clone()
        del other.weight
        other.weight = w  # a plain attribute now (as old-style weight_norm makes)
        with te.autocast(recipe=recipe):
            other(x)
            other(x)

    for fn in (outside_autocast, disabled_autocast, custom_recipe, backward_override,
               checkpointed, torch_autocast, subclass, forward_ad, vmap, features_mismatch,
               not_a_tensor, bad_first_microbatch, weight_not_a_parameter):
        reaches_python(fn)


@pytest.mark.parametrize("device", DEVICES)
def test_replaced_delayed_buffers_are_used_at_once(device, monkeypatch):
    """The C calls reuse delayed.slots' kept views only while they view the module's buffers:
    a scale replaced (or changed in place through .data) quantizes the next call, forward (x
    and W) and backward (dy); the reference is the Python Function on both sides."""
    recipe = DelayedScaling()
    torch.manual_seed(0)
    lin = te.Linear(K, N, params_dtype=torch.bfloat16, device=device)
    ref = copy.deepcopy(lin)
    x = torch.randn(16, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(16, N, dtype=torch.bfloat16, device=device) * 1e3
    outs = []
    for i, module in enumerate((lin, ref)):
        if i == 1:
            python_function(monkeypatch)
        got = []
        for scale_fwd, scale_bwd, replace in (([4.0, 2.0], [3.0], True),
                                              ([0.5, 8.0], [0.25], False)):
            x.grad = None
            with te.autocast(recipe=recipe):
                module(x).backward(dy)  # the kept views made; scales updated at the exits
            scale_fwd = torch.tensor(scale_fwd, device=device)
            scale_bwd = torch.tensor(scale_bwd, device=device)
            if replace:
                module.delayed_scale_fwd, module.delayed_scale_bwd = scale_fwd, scale_bwd
            else:
                module.delayed_scale_fwd.data, module.delayed_scale_bwd.data = scale_fwd, scale_bwd
            x.grad = None
            with te.autocast(recipe=recipe):
                y = module(x)
            y.backward(dy)
            got += [y.detach(), x.grad.clone()]
        outs.append(got)
    for a, b in zip(*outs):
        assert same_bits(a, b)
    assert not torch.equal(outs[0][0], outs[0][2]) and not torch.equal(outs[0][1], outs[0][3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["current", "delayed"])
def test_functional_call_swapped_parameters(name, device, monkeypatch):
    """torch.func.functional_call puts plain tensors into _parameters: the C call multiplies
    those, as the Python path does."""
    torch.manual_seed(0)
    lin = te.Linear(K, N, params_dtype=torch.bfloat16, device=device)
    ref = copy.deepcopy(lin)
    swapped = {"weight": torch.randn(N, K, dtype=torch.bfloat16, device=device),
               "bias": torch.randn(N, dtype=torch.bfloat16, device=device)}
    x = torch.randn(24, K, dtype=torch.bfloat16, device=device)
    outs = []
    for i, module in enumerate((lin, ref)):
        if i == 1:
            python_path(monkeypatch)
        with te.autocast(recipe=RECIPES[name]):
            module(x)
            outs.append(torch.func.functional_call(module, swapped, (x,)))
            outs.append(module(x))
    assert same_bits(outs[0], outs[2]) and same_bits(outs[1], outs[3])
    assert not torch.equal(outs[0], outs[1])


def test_bad_calls_raise():
    with pytest.raises(TypeError, match="3 arguments"):
        _C.linear_module_forward(None)
    with pytest.raises(TypeError, match="_linear_module_setup takes"):
        _C._linear_module_setup(None)
    lin = te.Linear(K, N)
    with te.autocast(recipe=Float8CurrentScaling()):
        assert _C.linear_module_forward(lin, "x", None) is NotImplemented
        assert _C.linear_module_forward(object(), torch.zeros(1, K), None) is NotImplemented
