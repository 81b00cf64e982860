"""NaN and Inf through te.Linear, per recipe: what one non-finite element of x or dy does to the
output, the gradients, DelayedScaling's history and scale, and the next finite step
(docs/nonfinite.md states the same table; NUMERICS.md's rules imply it).

The expectations come from the quantization rules, not from running the code: FP8 casts keep
NaN and saturate Inf (so an Inf in x leaves every product finite under the per-tensor and FP8
block recipes, and a NaN poisons the products that read it: y's row, dW's column); per-tensor
and block amaxes ignore NaN, and an Inf amax gives scale 1 (current, block); MXFP8's block scale
is NaN (E8M0 255) for a NaN amax and 2^127 for an Inf one, so the element's block reads back
NaN / Inf; NVFP4 encodes a NaN element as +6 (nothing non-finite survives) while an Inf makes the
global amax Inf and with it the GEMM's alpha (every output non-finite). DelayedScaling: an
Inf amax in the window keeps the previous scale (TE's rule) until it rolls out; a NaN is never
recorded. In every case the next finite step is finite. CPU (the C reference); the CUDA kernels
implement the same rules and are checked bit for bit against it elsewhere.
"""
import pytest
import torch

import tequant as te
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

HISTORY = 3
RECIPES = {
    "delayed": DelayedScaling(amax_history_len=HISTORY),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
}
ROW, COL, TOKENS, K, N = 5, 7, 32, 64, 64

# x[ROW, COL] non-finite: (rows of y that are non-finite, dW non-finite) per recipe and value
X_EFFECT = {
    ("delayed", "nan"): ("row", True), ("delayed", "inf"): ("none", False),
    ("current", "nan"): ("row", True), ("current", "inf"): ("none", False),
    ("block", "nan"): ("row", True), ("block", "inf"): ("none", False),
    ("mxfp8", "nan"): ("row", True), ("mxfp8", "inf"): ("row", True),
    ("nvfp4", "nan"): ("none", False), ("nvfp4", "inf"): ("all", True),
}


def _step(m, recipe, bad_x=None, bad_dy=None):
    x = torch.randn(TOKENS, K)
    dy = torch.randn(TOKENS, N)
    if bad_x is not None:
        x[ROW, COL] = bad_x
    if bad_dy is not None:
        dy[ROW, COL] = bad_dy
    x.requires_grad_()
    with te.autocast(recipe=recipe):
        y = m(x)
    y.backward(dy)
    grads = (x.grad, m.weight.grad, m.bias.grad)
    m.weight.grad = m.bias.grad = None
    return x, y.detach(), grads


def _bad_rows(t):
    return (~torch.isfinite(t)).any(dim=1)


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_nonfinite_input_element(name, value):
    torch.manual_seed(0)
    recipe = RECIPES[name]
    m = te.Linear(K, N)
    _step(m, recipe)
    x, y, (dx, dw, db) = _step(m, recipe, bad_x=float(value))
    rows, dw_bad = X_EFFECT[(name, value)]
    want_rows = torch.zeros(TOKENS, dtype=torch.bool)
    if rows == "row":
        want_rows[ROW] = True
    elif rows == "all":
        want_rows[:] = True
    assert torch.equal(_bad_rows(y), want_rows), _bad_rows(y).nonzero().flatten().tolist()
    assert bool((~torch.isfinite(dw)).any()) == dw_bad
    if dw_bad and rows == "row":  # dW = dy^T x: only the column x's element feeds
        assert torch.equal((~torch.isfinite(dw)).any(dim=0).nonzero().flatten(),
                           torch.tensor([COL]))
    assert torch.isfinite(dx).all() and torch.isfinite(db).all()  # x feeds neither
    _, y_next, grads_next = _step(m, recipe)
    assert torch.isfinite(y_next).all() and all(torch.isfinite(g).all() for g in grads_next)


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_nonfinite_grad_output_element(name, value):
    """A non-finite dy element reaches dx's row and db's column (db is summed in high
    precision); the next step is finite."""
    torch.manual_seed(1)
    recipe = RECIPES[name]
    m = te.Linear(K, N)
    _step(m, recipe)
    _, y, (dx, dw, db) = _step(m, recipe, bad_dy=float(value))
    assert torch.isfinite(y).all()  # the forward saw nothing
    assert not torch.isfinite(db[COL]) and torch.isfinite(db[torch.arange(N) != COL]).all()
    _, y_next, grads_next = _step(m, recipe)
    assert torch.isfinite(y_next).all() and all(torch.isfinite(g).all() for g in grads_next)


def test_delayed_inf_keeps_the_scale_for_the_window_and_nan_is_not_recorded():
    torch.manual_seed(2)
    recipe = RECIPES["delayed"]
    m = te.Linear(K, N)
    _step(m, recipe)
    before = m.delayed_scale_fwd.clone()
    x, _, _ = _step(m, recipe, bad_x=float("inf"))
    assert torch.isinf(m.delayed_amax_history_fwd[:, 0]).any()  # recorded, rolled into the window
    kept = [m.delayed_scale_fwd.clone()]
    for _ in range(HISTORY - 1):
        _step(m, recipe)
        kept.append(m.delayed_scale_fwd.clone())
    for scale in kept:  # x's scale kept while the Inf is in the window; W's updates as usual
        assert scale[0] == before[0] and torch.isfinite(scale).all()
    _step(m, recipe)  # the Inf has rolled out
    assert m.delayed_scale_fwd[0] != before[0] and torch.isfinite(m.delayed_scale_fwd).all()
    assert torch.isfinite(m.delayed_amax_history_fwd).all()

    m = te.Linear(K, N)
    _step(m, recipe)
    x, _, _ = _step(m, recipe, bad_x=float("nan"))
    finite_amax = x.detach().abs().nan_to_num(0.0).max()
    history = m.delayed_amax_history_fwd[:, 0]
    assert torch.isfinite(history).all() and (history == finite_amax).any()
    assert torch.isfinite(m.delayed_scale_fwd).all() and torch.isfinite(m.delayed_scale_bwd).all()


def test_delayed_nonfinite_grad_output_keeps_the_backward_scale():
    torch.manual_seed(3)
    recipe = RECIPES["delayed"]
    m = te.Linear(K, N)
    _step(m, recipe)
    before = m.delayed_scale_bwd.clone()
    _step(m, recipe, bad_dy=float("inf"))
    assert torch.equal(m.delayed_scale_bwd, before)
    assert torch.isinf(m.delayed_amax_history_bwd).any()
