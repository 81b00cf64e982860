"""te.Linear's autograd Function forward in C for plain calls (csrc/ext/linear_ctx.c,
linear._PlainLinear).

A plain call (a tensor input, the module's own weight, no tensor parallelism, no fused norm or
activation codes, no backward_override) runs _PlainLinear, whose forward is the C call; any other
keeps the Python _QuantizedLinear. Both share the backward, so the C forward must leave the same
ctx. Checked against the Python Function on an identical module and input (same seed, same
autocast): output, input / weight / bias gradients and DelayedScaling's buffers bit for bit, the
saved operands' buffers and every ctx field the backward reads; every recipe, CPU and CUDA,
3-D inputs, padded token counts, frozen weights and inputs without grad. Results against
independent references: tests/test_linear.py.
"""
import copy
import weakref

import pytest
import torch

import tequant as te
from tequant import _C
from tequant import linear as L
from tequant.recipe import Float8CurrentScaling
from test_linear_alloc import DEVICES, RECIPES  # noqa: E402

K, N = 64, 96
FIELDS = ("n_x", "n_w", "needs", "shape", "dtype", "bias_dtype", "weight_dtype", "rest",
          "w_given", "tp")


def same_bits(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def python_function(monkeypatch):
    """Plain calls through the Python Function (the reference path; Linear.forward's C call
    off too, as it holds _PlainLinear's apply itself)."""
    monkeypatch.setattr(L, "_module_forward", lambda *args: NotImplemented)
    monkeypatch.setattr(L, "_plain_linear",
                        lambda inp, w, b, mod, plan, first, pending, states, given=None:
                        L._quantized_linear(inp, w, b, mod, plan, first, pending, states, None,
                                            given, None))


def step(lin, x, recipe, dy, seed):
    """One forward (kept node) and backward; NVFP4's stochastic rounding draws from the seed."""
    torch.manual_seed(seed)
    with te.autocast(recipe=recipe):
        y = lin(x)
    node = y.grad_fn
    saved = L._saved(node, L._COLUMNWISE)[0] if node is not None else None
    fields = {f: getattr(node, f) for f in FIELDS} if node is not None else None
    amaxes = (node.x_amax, node.w_amax) if node is not None else None
    if y.requires_grad:
        y.backward(dy)
    return y, type(node).__name__, saved, fields, amaxes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["2d", "3d_padded", "frozen_weight", "no_input_grad",
                                  "no_bias", "fp32"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_c_forward_matches_the_python_function(name, case, device, monkeypatch):
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    lin = te.Linear(K, N, bias=case != "no_bias", params_dtype=dtype, device=device)
    if case == "frozen_weight":
        lin.weight.requires_grad_(False)
    ref = copy.deepcopy(lin)
    shape = (2, 37, K) if case == "3d_padded" else (48, K)
    x = torch.randn(shape, dtype=dtype, device=device) * 2
    x_ref = x.clone()
    if case != "no_input_grad":
        x.requires_grad_(True)
        x_ref.requires_grad_(True)
    dy = torch.randn(shape[:-1] + (N,), dtype=dtype, device=device)
    recipe = RECIPES[name]

    got = step(lin, x, recipe, dy, seed=5)
    python_function(monkeypatch)
    want = step(ref, x_ref, recipe, dy, seed=5)

    assert got[1] == "_PlainLinearBackward" and want[1] == "_QuantizedLinearBackward"
    assert same_bits(got[0], want[0])
    for a, b in ((x, x_ref), (lin.weight, ref.weight), (lin.bias, ref.bias)):
        if a is not None:
            assert same_bits(a.grad, b.grad)
    for key, buf in lin.named_buffers():
        assert same_bits(buf, dict(ref.named_buffers())[key]), key
    g_saved, w_saved = got[2], want[2]
    assert len(g_saved) == len(w_saved)
    for g, w in zip(g_saved[:2], w_saved[:2]):  # x's and W's kept quantizations: the same
        assert (g is None) == (w is None)        # buffers (their alignment gaps are not set;
        for gt, wt in zip(g or (), w or ()):     # the gradients above read their contents)
            assert (gt is None) == (wt is None)
            if gt is not None:
                assert (gt.dtype, gt.shape, gt.device) == (wt.dtype, wt.shape, wt.device)
    assert got[3] == want[3]
    for g, w in zip(got[4], want[4]):
        assert (g is None) == (w is None)
        for gt, wt in zip(g or (), w or ()):
            assert same_bits(gt, wt)


def fused_step(module, x, recipe, dy, seed):
    """One fwd + bwd of a fused module: y, the grad_fn's ctx fields and saved kept members of
    the te.Linear node that multiplied the fused codes (fc2 / the LayerNormLinear's linear)."""
    torch.manual_seed(seed)
    with te.autocast(recipe=recipe):
        y = module(x)
    node = y.grad_fn
    fields = {f: getattr(node, f) for f in FIELDS}
    saved = L._saved(node, L._COLUMNWISE)[0][:2]
    y.backward(dy)
    return y.detach(), type(node).__name__, fields, saved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("name", ["delayed", "current"])
def test_c_forward_of_fused_codes_matches_the_python_function(name, kind, device, monkeypatch):
    """x's codes from the fused norm (LayerNormLinear) or activation (LayerNormMLP's fc2, relu:
    fused under both recipes): the C Function's output, gradients, DelayedScaling buffers and
    ctx fields equal the Python Function's."""
    torch.manual_seed(0)
    module = (te.LayerNormLinear(K, N, params_dtype=torch.bfloat16, device=device)
              if kind == "LayerNormLinear" else
              te.LayerNormMLP(K, N, params_dtype=torch.bfloat16, device=device,
                              activation="relu"))
    ref = copy.deepcopy(module)
    x = torch.randn(2, 19, K, dtype=torch.bfloat16, device=device) * 2
    x_ref = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    dy = torch.randn(2, 19, N if kind == "LayerNormLinear" else K, dtype=torch.bfloat16,
                     device=device)
    got = fused_step(module, x, RECIPES[name], dy, seed=3)
    python_function(monkeypatch)
    want = fused_step(ref, x_ref, RECIPES[name], dy, seed=3)
    assert got[1] == "_PlainLinearBackward" and want[1] == "_QuantizedLinearBackward"
    assert same_bits(got[0], want[0]) and same_bits(x.grad, x_ref.grad)
    assert got[2] == want[2]
    assert type(got[2]["shape"]) is tuple  # (a torch.Size: x was not given as codes)
    for (ka, a), (kb, b) in zip(module.named_parameters(), ref.named_parameters()):
        assert same_bits(a.grad, b.grad), ka
    for (ka, a), (kb, b) in zip(module.named_buffers(), ref.named_buffers()):
        assert same_bits(a, b), ka
    for g, w in zip(got[3], want[3]):
        assert len(g) == len(w)
        assert all((gt is None) == (wt is None) for gt, wt in zip(g, w))


@pytest.mark.parametrize("device", DEVICES)
def test_calls_that_are_not_plain_keep_the_python_function(device):
    lin = te.Linear(K, N, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(8, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    with te.autocast(recipe=Float8CurrentScaling()):
        plain = lin(x)
    with te.autocast(recipe=Float8CurrentScaling(backward_override="high_precision")):
        override = lin(x)
    assert type(plain.grad_fn).__name__ == "_PlainLinearBackward"
    assert type(override.grad_fn).__name__ == "_QuantizedLinearBackward"


def test_the_saved_operands_go_with_the_graph():
    """The node holds x's and W's kept buffers through save_for_backward only: dropping the
    output frees them (no reference left in C), and backward frees them too."""
    lin = te.Linear(K, N, params_dtype=torch.bfloat16)
    x = torch.randn(16, K, dtype=torch.bfloat16, requires_grad=True)
    for drop in ("output", "backward"):
        with te.autocast(recipe=Float8CurrentScaling()):
            y = lin(x)
        refs = [weakref.ref(t) for kept in L._saved(y.grad_fn)[0][:2] for t in kept
                if isinstance(t, torch.Tensor)]
        assert refs
        if drop == "backward":
            y.sum().backward()
        del y
        assert all(r() is None for r in refs), drop


def test_bad_calls_raise():
    with pytest.raises(TypeError, match="9 or 10 arguments"):
        _C.linear_ctx_forward(None, None)
    lin = te.Linear(K, N, params_dtype=torch.bfloat16)
    plan = lin._plan(Float8CurrentScaling())
    x = torch.randn(4, K, dtype=torch.bfloat16)

    class Ctx:
        needs_input_grad = (False, True, True)

        def save_for_backward(self, *tensors):
            self.to_save = tensors

    with pytest.raises(TypeError, match="states must be None or"):
        _C.linear_ctx_forward(Ctx(), x, lin.weight, lin.bias, lin, plan, None, None, (1,))

    class NoGrads(Ctx):
        needs_input_grad = None

    with pytest.raises(TypeError, match="needs_input_grad"):
        _C.linear_ctx_forward(NoGrads(), x, lin.weight, lin.bias, lin, plan, None, None, None)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        _C.linear_ctx_forward(Ctx(), "x", lin.weight, lin.bias, lin, plan, None, None, None)
    with pytest.raises(TypeError, match="given must be the six members"):
        _C.linear_ctx_forward(Ctx(), x, lin.weight, lin.bias, lin, plan, None, None, None, (1,))


class _AsyncGrad(torch.autograd.Function):
    """Identity whose backward hands on its gradient as an AsyncCollectiveTensor, as a
    functional collective after the layer would."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        return AsyncCollectiveTensor(dy)


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_c_backward_waits_for_an_async_collective_grad(name, monkeypatch):
    torch.manual_seed(0)
    lin = te.Linear(K, N, params_dtype=torch.bfloat16)
    ref = copy.deepcopy(lin)
    x = torch.randn(24, K, dtype=torch.bfloat16)
    dy = torch.randn(24, N, dtype=torch.bfloat16)
    grads = []
    for i, module in enumerate((lin, ref)):
        if i == 1:
            python_function(monkeypatch)
        xi = x.clone().requires_grad_(True)
        with te.autocast(recipe=RECIPES[name]):
            y = module(xi)
        assert type(y.grad_fn).__name__ == ("_PlainLinearBackward", "_QuantizedLinearBackward")[i]
        _AsyncGrad.apply(y).backward(dy)
        grads.append((xi.grad, module.weight.grad, module.bias.grad))
    for a, b in zip(*grads):
        assert same_bits(a, b)


def test_bad_backward_calls_raise():
    with pytest.raises(TypeError, match="2 arguments"):
        _C.linear_ctx_backward(None)

    class Empty:
        pass

    with pytest.raises(AttributeError):
        _C.linear_ctx_backward(Empty(), torch.zeros(2, 2))
