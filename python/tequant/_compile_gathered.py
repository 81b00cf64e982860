"""Compiled te.Linear on a weight FSDP2 all-gathered in a per-tensor FP8 format
(distributed/fsdp.py TraceableGatheredWeight): the autograd Function Dynamo traces, around
tequant::linear_fwd_wgiven / linear_bwd_wgiven (_compile_ops.py), with no graph break.

The weight's inner tensors (rowwise codes, a view of FSDP2's all-gather output; scale_inv;
amax) go to the ops as W's members, as eager te.Linear hands them to C (linear.py
_operands.given_kept): the same bits. Backward derives W's columnwise codes with
tequant::transpose_codes (gather_layout.derive_columnwise in eager) and returns a plain
gradient for W, which FSDP2 reduce-scatters. DelayedScaling: W's amax went into the module's
history at the gather (fsdp.py, eager, outside the graph); the forward op accumulates x's into
the history in place (declared: Inductor writes the buffer itself), and backward updates as
_CompiledLinear does.
Other recipes (block formats, backward_override) keep the graph break of _compile_linear._local.
Tests: tests/test_fsdp.py (compile_worker, traced_worker).
"""
import sys

import torch

from . import _compile_linear as _cl
from ._plan import NEED_DGRAD, NEED_WGRAD

_NONE_ARGS = (None,) * 6  # GatheredLinear's arguments after the bias


def traceable(weight):
    """Whether `weight` goes through GatheredLinear: a TraceableGatheredWeight (per-tensor FP8,
    no backward_override: fsdp._traceable). (An isinstance check: Dynamo reads neither hasattr
    nor type() of such a parameter as eager does.)"""
    fsdp = sys.modules.get("tequant.distributed.fsdp")
    return fsdp is not None and isinstance(weight, fsdp.TraceableGatheredWeight)


def check_recipe(weight, recipe_id):
    """eager's given_kept check: W gathered under the recipe the layer runs under."""
    if weight._key != int(recipe_id):
        raise RuntimeError(
            "this te.Linear's weight was quantized (by FSDP2's all-gather) under another recipe "
            "than the te.autocast the layer runs under: enter one te.autocast around the whole "
            "FSDP module's forward")


class GatheredLinear(torch.autograd.Function):
    """y = x W^T + b for a high-precision x and W given as its members."""

    @staticmethod
    def forward(ctx, inp, weight, bias, scale_fwd, hist_fwd, scale_bwd, hist_bwd, recipe_id,
                group):
        needs = ((NEED_DGRAD if ctx.needs_input_grad[0] else 0)
                 | (NEED_WGRAD if ctx.needs_input_grad[1] else 0))
        is_delayed = _cl.info(recipe_id, needs)[2]
        w_members = [weight._data, weight._scale_inv, None, None, weight._amax, None]
        outs = torch.ops.tequant.linear_fwd_wgiven(inp, w_members, weight.dtype, bias, recipe_id,
                                                   needs, scale_fwd, hist_fwd)
        x_kept = (outs[1],) if needs & NEED_WGRAD else ()
        w_kept = (w_members[0], w_members[1], w_members[4]) if needs & NEED_DGRAD else ()
        ctx.recipe_id, ctx.needs = recipe_id, needs
        _cl.delayed_ctx(ctx, recipe_id, group, is_delayed)
        ctx.shape, ctx.x_dtype, ctx.w_dtype = tuple(inp.shape), inp.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(*x_kept, *w_kept, *((scale_bwd, hist_bwd) if is_delayed else ()))
        return outs[0]

    @staticmethod
    def backward(ctx, dy):
        saved = list(ctx.saved_tensors)
        needs = ctx.needs
        x_kept = saved.pop(0) if needs & NEED_WGRAD else None
        w_members = [None] * 6
        if needs & NEED_DGRAD:  # the columnwise codes, as eager's derive_columnwise
            data, scale_inv, amax = saved[:3]
            saved = saved[3:]
            w_members = [data, scale_inv, torch.ops.tequant.transpose_codes(data), None, amax,
                         None]
        scale_bwd = hist_bwd = None
        if ctx.is_delayed:
            scale_bwd, hist_bwd = saved[:2]
        bias_dtype = ctx.bias_dtype if ctx.needs_input_grad[2] else None
        hist = _cl._op_hist(ctx, hist_bwd)
        if hist is not None:
            needs = _cl.op_needs(ctx, dy, scale_bwd, hist)
        outs = torch.ops.tequant.linear_bwd_wgiven(dy, x_kept, w_members, ctx.recipe_id, needs,
                                                   list(ctx.shape), ctx.x_dtype, ctx.w_dtype,
                                                   bias_dtype, scale_bwd, hist)
        return _cl._grads(ctx, _cl.present(ctx, outs, bias_dtype), bias_dtype, scale_bwd,
                          hist_bwd)[:3] + _NONE_ARGS


_cl.register_gathered(sys.modules[__name__])
