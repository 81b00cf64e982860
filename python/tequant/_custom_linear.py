"""te.Linear under a CustomRecipe: the (input, weight, grad_output) quantizers its qfactory makes
for a module, and the autograd Function whose GEMMs multiply their dequantized values in the
activation dtype. Eager (linear.py) and compiled (_compile_linear.py) te.Linear both run it.
Tests: tests/test_linear_module.py (CustomRecipe), tests/test_compile.py.
"""
import torch
import torch.nn.functional as F

from . import _C
from .recipe import QuantizerRole


def quantizers(module, recipe):
    """The (input, weight, grad_output) quantizers of a CustomRecipe's qfactory, made once
    per recipe and module."""
    key = _C.recipe_key(recipe)
    found = module._plans.get(key)
    if found is not None:
        return found
    made = tuple(recipe.qfactory(QuantizerRole(module_type="linear", tensor_type=r))
                 for r in ("input", "weight", "grad_output"))
    for role, q in zip(("input", "weight", "grad_output"), made):
        if not (callable(getattr(q, "quantize", None))
                and callable(getattr(q, "dequantize", None))):
            raise TypeError(f"CustomRecipe.qfactory returned {type(q).__name__} for the "
                            f"{role!r} role: a quantizer needs quantize(tensor) and "
                            "dequantize(quantized) methods")
    module._plans[key] = made
    return made


class _CustomLinear(torch.autograd.Function):
    """CustomRecipe: each role's quantizer (from the recipe's qfactory) quantizes, and the GEMMs
    multiply the dequantized values in the activation dtype (the quantizer protocol is in
    Linear's docstring)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, quantizers):
        qx, qw, qdy = quantizers
        x_q, w_q = qx.quantize(inp.detach()), qw.quantize(weight.detach())
        x_hat = qx.dequantize(x_q).to(inp.dtype)
        w_hat = qw.dequantize(w_q).to(inp.dtype)
        ctx.save_for_backward(x_hat, w_hat)
        ctx.qdy, ctx.weight_dtype = qdy, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return F.linear(x_hat, w_hat, None if bias is None else bias.to(inp.dtype))

    @staticmethod
    def backward(ctx, dy):
        x_hat, w_hat = ctx.saved_tensors
        dy_hat = ctx.qdy.dequantize(ctx.qdy.quantize(dy)).to(dy.dtype)
        dy2d, x2d = dy_hat.reshape(-1, dy.shape[-1]), x_hat.reshape(-1, x_hat.shape[-1])
        dx = (dy_hat @ w_hat).to(x_hat.dtype) if ctx.needs_input_grad[0] else None
        dw = (dy2d.t() @ x2d).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        db = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None


apply = _CustomLinear.apply
