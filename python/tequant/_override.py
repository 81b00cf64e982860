"""backward_override's backward of te.Linear: dgrad and wgrad in dy's precision, on the
unquantized x and W ("high_precision") or on the dequantized forward operands ("dequantized"),
for the eager Function (linear.py) and the compiled op's backward (_compile_linear.py).
Tests: tests/test_linear_module.py (test_backward_override), tests/test_compile.py.
"""
import torch

from . import _C
from ._plan import NEED_DGRAD, NEED_WGRAD, ROWWISE


def grads(dy2d, x2d, weight, needs, bias_dtype, x_shape, x_dtype, w_dtype):
    """(dx, dW, db) from dy [rows, N], x [rows, K] and W [N, K] in dy's precision; None where
    not needed."""
    dx = dw = db = None
    if needs & NEED_DGRAD:
        dx = (dy2d @ weight.to(dy2d.dtype)).to(x_dtype).view(x_shape)
    if needs & NEED_WGRAD:
        dw = (dy2d.t() @ x2d.to(dy2d.dtype)).to(w_dtype)
    if bias_dtype is not None:
        db = dy2d.sum(0, dtype=torch.float32).to(bias_dtype)
    return dx, dw, db


def backward(ctx, saved, kept, dy2d, needs, bias_dtype):
    """The eager Function's: "high_precision" multiplies the unquantized x and W (kept; a
    weight that came quantized, dequantized), "dequantized" the rowwise x and W of saved."""
    plan = ctx.plan
    if plan.backward_override == "high_precision":
        inp, weight = kept
        if ctx.w_given is not None:
            weight = ctx.w_given.tq_dequantized()
        x2d = inp.reshape(-1, inp.shape[-1])
    else:
        qx, qw, rows, padded, n, k = saved[:6]
        x2d = _dequantized(plan.x, padded, k, qx, dy2d.dtype)[:rows]
        weight = _dequantized(plan.w, n, k, qw, dy2d.dtype)
    return grads(dy2d, x2d, weight, needs, bias_dtype, ctx.shape, ctx.dtype, ctx.weight_dtype)


def _dequantized(config, rows, cols, members, dtype):
    out = torch.empty((rows, cols), dtype=dtype, device=members[0].device)
    _C._dequantize(config, rows, cols, members, ROWWISE, out)
    return out
