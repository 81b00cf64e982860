"""te.Linear (and te.LayerNormLinear / te.LayerNormMLP) with the PyTorch features training code
uses, against independent references: torch.nn.Linear / F.linear outside te.autocast (exact), and
inside it a te.Linear that computes the same thing without the feature (a fresh module holding the
same values: the same quantization, so the same bits).

- deferred init: a model made on the meta device, te.prepare_state, to_empty: DelayedScaling's
  buffers come off meta as a new module's (not uninitialized memory), with or without
  reset_parameters; reset_parameters restarts them; skip_init.
- load_state_dict: a checkpoint without DelayedScaling's buffers (saved before the module first
  ran it, an nn.Linear's) loads strictly into a module that has them, which restart; a load
  drops the weight cached by is_first_microbatch=True.
- weight tying (two te.Linear, an embedding's weight as the LM head), in-place weight changes
  between calls, parametrizations, torch.func.functional_call / refused transforms, hooks,
  microbatch gradient accumulation, torch.autocast, grad modes, exceptions in an autocast body.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from torch.nn.utils import parametrizations

import tequant as te
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling,
           "block": Float8BlockScaling, "mxfp8": MXFP8BlockScaling, "nvfp4": NVFP4BlockScaling}
DELAYED_BUFFERS = ("delayed_amax_history_fwd", "delayed_scale_fwd", "delayed_amax_history_bwd",
                   "delayed_scale_bwd")


def fresh(weight, bias=None):
    """A te.Linear holding weight (and bias): the reference of a feature's composition."""
    m = te.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
        if bias is not None:
            m.bias.copy_(bias)
    return m


def quantized(module, x, recipe, dy=None, seed=0, **kwargs):
    """(y, dx) of module(x) in te.autocast(recipe) (NVFP4's stochastic rounding seeded)."""
    x = x.detach().clone().requires_grad_(dy is not None)
    torch.manual_seed(seed)
    with te.autocast(recipe=recipe):
        y = module(x, **kwargs)
    if dy is not None:
        y.backward(dy)
    return y.detach(), x.grad


def assert_fresh_delayed_state(module):
    for name in DELAYED_BUFFERS:
        buf = getattr(module, name)
        want = torch.ones_like(buf) if "scale" in name else torch.zeros_like(buf)
        assert buf.dtype == torch.float32 and torch.equal(buf, want), name


# ---- deferred init -------------------------------------------------------------------------


def test_to_empty_after_prepare_state_on_meta_then_reset_parameters():
    """The torchtitan / FSDP2 order: build on meta, te.prepare_state (DelayedScaling's buffers, on
    meta), to_empty, reset_parameters. The first step must compute as a module built on CPU (the
    buffers used to be uninitialized memory: NaN outputs)."""
    with torch.device("meta"):
        m = te.Linear(64, 32)
    te.prepare_state(m, DelayedScaling())
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.reset_parameters()
    assert_fresh_delayed_state(m)
    torch.manual_seed(0)
    ref = te.Linear(64, 32)
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    for _ in range(2):  # the second step runs on the first one's updated scales
        y, dx = quantized(m, x, DelayedScaling(), dy)
        y_ref, dx_ref = quantized(ref, x, DelayedScaling(), dy)
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
        assert torch.equal(m.weight.grad, ref.weight.grad)
    for name in DELAYED_BUFFERS:
        assert torch.equal(getattr(m, name), getattr(ref, name)), name


def test_buffers_materialized_off_meta_restart_without_reset_parameters():
    """A model initialized by its own code (or loaded from a checkpoint of weights only) never
    calls reset_parameters: the DelayedScaling buffers leaving the meta device must still hold a
    new module's state. The materializing function here writes NaN (what uninitialized memory may
    hold), so the check does not depend on the allocator."""
    for materialize in (lambda model: model._apply(lambda t: torch.full_like(
                            t, float("nan"), device="cpu")),
                        lambda model: model.to_empty(device="cpu")):  # torch's own path
        with torch.device("meta"):
            model = torch.nn.Sequential(te.Linear(64, 64), te.LayerNormMLP(64, 128))
        te.prepare_state(model, DelayedScaling())
        materialize(model)
        for m in (model[0], model[1].fc1, model[1].fc2):
            assert_fresh_delayed_state(m)


def test_reset_parameters_restarts_delayed_state():
    m = te.Linear(64, 32)
    quantized(m, torch.randn(16, 64), DelayedScaling(), torch.randn(16, 32))
    assert not torch.equal(m.delayed_scale_fwd, torch.ones(2))
    for name in DELAYED_BUFFERS:
        getattr(m, name).fill_(float("nan"))  # to_empty's memory, or a stale state
    m.reset_parameters()
    assert_fresh_delayed_state(m)


@pytest.mark.parametrize("ctor", [lambda: te.Linear(64, 32), lambda: te.LayerNormLinear(64, 32),
                                  lambda: te.LayerNormMLP(64, 128, activation="swiglu")])
def test_meta_init_then_reset_parameters_matches_eager_init(ctor):
    torch.manual_seed(0)
    eager = ctor()
    with torch.device("meta"):
        deferred = ctor()
    deferred.to_empty(device="cpu")
    torch.manual_seed(0)
    deferred.reset_parameters()
    a, b = eager.state_dict(), deferred.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_skip_init():
    m = torch.nn.utils.skip_init(te.Linear, 64, 32)
    assert type(m) is te.Linear and m.weight.shape == (32, 64) and m.bias.shape == (32,)
    m.reset_parameters()
    x = torch.randn(4, 64)
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))


# ---- load_state_dict -----------------------------------------------------------------------


def test_strict_load_of_a_checkpoint_without_delayed_state():
    """A state_dict saved before the module first ran DelayedScaling (early stopping's "best"
    copy at step 0, an nn.Linear's checkpoint) loads strictly; the module then computes as a
    new module that loaded it (its amax history measured the replaced weight)."""
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    m = te.Linear(64, 32)
    initial = copy.deepcopy(m.state_dict())
    quantized(m, x, DelayedScaling(), dy)
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    result = m.load_state_dict(initial)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(m.weight, initial["weight"])
    assert_fresh_delayed_state(m)
    ref = te.Linear(64, 32)
    ref.load_state_dict(initial)
    assert torch.equal(quantized(m, x, DelayedScaling())[0], quantized(ref, x, DelayedScaling())[0])
    plain = torch.nn.Linear(64, 32)
    m.load_state_dict(plain.state_dict())  # strict, from torch's Linear
    assert torch.equal(m(x), plain(x))


def test_load_of_a_checkpoint_with_delayed_state_keeps_it():
    """The round trip keeps DelayedScaling's state (and a partial load, without the weight,
    leaves it alone)."""
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    a, b = te.Linear(64, 32), te.Linear(64, 32)
    for m in (a, b):
        quantized(m, x, DelayedScaling(), dy)
    b.load_state_dict(a.state_dict())
    for name in DELAYED_BUFFERS:
        assert torch.equal(getattr(a, name), getattr(b, name))
    before = {name: getattr(b, name).clone() for name in DELAYED_BUFFERS}
    b.load_state_dict({"bias": torch.zeros(32)}, strict=False)
    for name in DELAYED_BUFFERS:
        assert torch.equal(getattr(b, name), before[name])


@pytest.mark.parametrize("name", list(RECIPES))
def test_load_state_dict_drops_the_cached_weight(name):
    """is_first_microbatch=True caches the quantized W; a load_state_dict replaces W, so the
    next is_first_microbatch=False must multiply the loaded weight, not the cached one."""
    x = torch.randn(16, 64)
    m, other = te.Linear(64, 32), te.Linear(64, 32)
    quantized(m, x, RECIPES[name](), is_first_microbatch=True)
    m.load_state_dict(other.state_dict(), strict=False)
    y = quantized(m, x, RECIPES[name](), is_first_microbatch=False)[0]
    y_ref = quantized(fresh(other.weight.detach(), other.bias.detach()), x, RECIPES[name]())[0]
    assert torch.equal(y, y_ref)


# ---- weight tying and weight changes --------------------------------------------------------


@pytest.mark.parametrize("name", list(RECIPES))
def test_tied_weights_accumulate_both_gradients(name):
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    emb = torch.nn.Embedding(32, 64)
    head, other = te.Linear(64, 32, bias=False), te.Linear(64, 32, bias=False)
    head.weight = other.weight = emb.weight  # LM head tying, twice
    ids = torch.randint(0, 32, (16,))
    torch.manual_seed(1)
    with te.autocast(recipe=RECIPES[name]()):
        h = emb(ids)
        y = head(h) + other(x)
    y.backward(dy)
    w = emb.weight.detach()
    r_head, r_other, h_ref = fresh(w), fresh(w), w[ids].clone().requires_grad_()
    torch.manual_seed(1)
    with te.autocast(recipe=RECIPES[name]()):
        y_ref = r_head(h_ref) + r_other(x)
    y_ref.backward(dy)
    assert torch.equal(y, y_ref)
    want = r_head.weight.grad + r_other.weight.grad
    want.index_add_(0, ids, h_ref.grad)
    torch.testing.assert_close(emb.weight.grad, want)  # (the sums' order is autograd's)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("change", ["mul_", "data", "step"])
def test_weight_changed_between_calls_is_used(name, change):
    """Without is_first_microbatch, every call quantizes the weight it sees, in one autocast."""
    x = torch.randn(16, 64)
    m = te.Linear(64, 32)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    with te.autocast(recipe=RECIPES[name]()):
        m(x).sum().backward()
        if change == "mul_":
            with torch.no_grad():
                m.weight.mul_(2)
        elif change == "data":
            m.weight.data = torch.randn(32, 64)
        else:
            opt.step()
        torch.manual_seed(0)
        y = m(x)
    y_ref = quantized(fresh(m.weight.detach(), m.bias.detach()), x, RECIPES[name]())[0]
    assert torch.equal(y, y_ref)


# ---- parametrizations, torch.func, hooks ----------------------------------------------------


class _Double(torch.nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize("kind", ["custom", "weight_norm", "orthogonal"])
@pytest.mark.parametrize("name", [None] + list(RECIPES))
def test_parametrized_weight(kind, name):
    torch.manual_seed(0)
    m = te.Linear(64, 32)
    ref = torch.nn.Linear(64, 32)
    ref.load_state_dict(m.state_dict())
    for module in (m, ref):
        torch.manual_seed(3)
        if kind == "custom":
            parametrize.register_parametrization(module, "weight", _Double())
        else:
            getattr(parametrizations, kind)(module)
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    if name is None:  # outside te.autocast: exactly torch's
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, y_ref = m(xa), ref(xb)
        y.backward(dy), y_ref.backward(dy)
        assert torch.equal(y, y_ref) and torch.equal(xa.grad, xb.grad)
        for (_, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
            assert torch.equal(p.grad, q.grad)
        return
    y, dx = quantized(m, x, RECIPES[name](), dy)
    f = fresh(m.weight.detach(), m.bias.detach())
    y_ref, dx_ref = quantized(f, x, RECIPES[name](), dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    # the parametrization's chain rule on top of te.Linear's dW
    w_in = next(p for n, p in m.named_parameters() if n.startswith("parametrizations"))
    assert w_in.grad is not None and torch.isfinite(w_in.grad).all()


@pytest.mark.parametrize("name", [None] + list(RECIPES))
def test_functional_call_uses_the_substituted_parameters(name):
    m = te.LayerNormLinear(64, 32)
    w, g = torch.randn(32, 64, requires_grad=True), torch.rand(64) + 0.5
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    ref = copy.deepcopy(m)
    with torch.no_grad():
        ref.weight.copy_(w)
        ref.layer_norm_weight.copy_(g)
    torch.manual_seed(0)
    with te.autocast(recipe=RECIPES[name]() if name else None, enabled=name is not None):
        y = torch.func.functional_call(m, {"weight": w, "layer_norm_weight": g}, (x,))
    y.backward(dy)
    torch.manual_seed(0)
    with te.autocast(recipe=RECIPES[name]() if name else None, enabled=name is not None):
        y_ref = ref(x)
    y_ref.backward(dy)
    assert torch.equal(y, y_ref) and torch.equal(w.grad, ref.weight.grad)
    assert m.weight.grad is None


@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp"])
def test_func_transforms_are_exact_outside_and_refused_inside(transform):
    m = te.Linear(64, 32)
    x = torch.randn(2, 8, 64)
    runs = {"vmap": lambda: torch.func.vmap(m)(x),
            "grad": lambda: torch.func.grad(lambda t: m(t).sum())(x),
            "jvp": lambda: torch.func.jvp(m, (x,), (torch.ones_like(x),))[1]}
    refs = {"vmap": lambda: F.linear(x, m.weight, m.bias),
            "grad": lambda: torch.ones(2, 8, 32) @ m.weight,
            "jvp": lambda: torch.ones_like(x) @ m.weight.t()}
    assert torch.equal(runs[transform]().detach(), refs[transform]().detach())
    with te.autocast(recipe=Float8CurrentScaling()), pytest.raises(RuntimeError,
                                                                    match="setup_context"):
        runs[transform]()


@pytest.mark.parametrize("name", list(RECIPES))
def test_hooks(name):
    """A pre-hook that changes the input, a full backward hook, a tensor hook on W that scales
    its gradient."""
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    m = te.Linear(64, 32)
    seen = []
    m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    m.register_full_backward_hook(lambda mod, gi, go: seen.append((gi[0], go[0])))
    m.weight.register_hook(lambda g: 3 * g)
    y, dx = quantized(m, x, RECIPES[name](), dy)
    f = fresh(m.weight.detach(), m.bias.detach())
    y_ref, dx_ref = quantized(f, 2 * x, RECIPES[name](), dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, 2 * dx_ref)
    assert torch.equal(seen[0][0], dx_ref) and torch.equal(seen[0][1], dy)
    assert torch.equal(m.weight.grad, 3 * f.weight.grad)


# ---- gradient accumulation, dtypes, grad modes, exceptions ---------------------------------


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("set_to_none", [True, False])
def test_microbatch_accumulation(name, set_to_none):
    xs, dys = torch.randn(3, 16, 64), torch.randn(3, 16, 32)
    m = te.Linear(64, 32)
    f = fresh(m.weight.detach(), m.bias.detach())
    m.weight.grad = torch.ones_like(m.weight)
    m.zero_grad(set_to_none=set_to_none)
    for i in range(3):
        quantized(m, xs[i], RECIPES[name](), dys[i], seed=i, is_first_microbatch=i == 0)
        quantized(f, xs[i], RECIPES[name](), dys[i], seed=i)
    assert torch.equal(m.weight.grad, f.weight.grad) and torch.equal(m.bias.grad, f.bias.grad)
    m.weight.requires_grad_(False)  # frozen for a step: dx only, no dW
    m.weight.grad = None
    quantized(m, xs[0], RECIPES[name](), dys[0])
    assert m.weight.grad is None


@pytest.mark.parametrize("name", [None] + list(RECIPES))
@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16])
def test_torch_autocast_inside_and_outside(name, params_dtype):
    """torch.autocast("cpu", bfloat16) with te.autocast in either order: the output is
    bfloat16 and, for bfloat16 parameters, te.Linear's bits on the cast input."""
    m = te.Linear(64, 32, params_dtype=params_dtype)
    ref = torch.nn.Linear(64, 32, dtype=params_dtype)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(16, 64)
    te_ctx = lambda: te.autocast(recipe=RECIPES[name]() if name else None,  # noqa: E731
                                 enabled=name is not None)
    outs = []
    for outer_torch, layer in ((True, m), (False, copy.deepcopy(m))):  # (DelayedScaling's state)
        torch.manual_seed(0)
        if outer_torch:
            with torch.autocast("cpu", dtype=torch.bfloat16), te_ctx():
                outs.append(layer(x))
        else:
            with te_ctx(), torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(layer(x))
    assert all(o.dtype == torch.bfloat16 for o in outs) and torch.equal(outs[0], outs[1])
    if name is None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(outs[0], ref(x))
    elif params_dtype == torch.bfloat16:
        assert torch.equal(outs[0], quantized(fresh(m.weight.detach(), m.bias.detach()),
                                              x.bfloat16(), RECIPES[name]())[0])


@pytest.mark.parametrize("name", list(RECIPES))
def test_grad_modes_nested_in_autocast(name):
    x = torch.randn(16, 64)
    m = te.Linear(64, 32)
    y_ref = quantized(fresh(m.weight.detach(), m.bias.detach()), x, RECIPES[name]())[0]
    for mode in (torch.no_grad, torch.inference_mode):
        torch.manual_seed(0)
        with te.autocast(recipe=RECIPES[name]()), mode():
            y = m(x)
        assert not y.requires_grad
        if name != "delayed":  # (DelayedScaling's scales move with each quantization)
            assert torch.equal(y, y_ref)
    torch.manual_seed(0)
    with te.autocast(recipe=RECIPES[name]()), torch.no_grad(), torch.enable_grad():
        y = m(x)
    assert y.requires_grad


@pytest.mark.parametrize("name", list(RECIPES))
def test_exception_in_autocast_body_leaves_clean_state(name):
    x = torch.randn(16, 64)
    m = te.Linear(64, 32)
    with pytest.raises(ValueError):
        with te.autocast(recipe=RECIPES[name]()):
            m(x)
            with te.autocast(recipe=Float8CurrentScaling()):
                m(x)
                raise ValueError("boom")
    assert not te.is_fp8_enabled() and te.autocast_depth() == 0
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
    with pytest.raises(ValueError):
        with te.autocast(recipe=RECIPES[name]()):
            m(torch.randn(16, 48))  # the layer's own error
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
