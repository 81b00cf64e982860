"""te.Linear's backward on a grad_output that arrives quantized: from te.LayerNormMLP's
activation backward (_act_fn.GradOutput: fc1's codes, amax and dbias), eager (given_dy_backward,
linear.py) and compiled (tequant::linear_bwd_dy_given); or, in a compiled te.Linear, from an op
of its own (split_dy_backward: a large block-format grad_output quantized before the dgrad and
wgrad ops, tequant::linear_bwd_part, so that the graph frees dy and its rowwise codes as soon as
they are read).
Tests: tests/test_fused_act_modules.py, tests/test_fused_dh.py, tests/test_compile_delayed.py,
tests/test_backward_memory.py.
"""
from typing import Optional

import torch

from . import _C, _plan
from ._compile_ops import (_absent, _delayed_states, _max_into, _or_absent, _rows_cols, fake,
                           graph_safe_workspace, op)
from ._norm_fn import with_columnwise
from ._operands import TQ_DTYPE

__all__ = ["given_codes_t", "given_dy_backward", "split_dy_backward", "splits_dy"]


def given_codes_t(dy_q):
    """The columnwise codes [N, padded] among a per-tensor grad_output's tensors from the
    activation's backward (codes, scale_inv, amax[, codes_t][, dbias]: codes_t is the one 2-D
    tensor after amax; dbias is 1-D), or None (given_dy_backward transposes the codes then)."""
    return dy_q[3] if len(dy_q) > 3 and dy_q[3] is not None and dy_q[3].dim() == 2 else None


def given_dy_backward(c_args, saved, dy_q, needs, inp_shape, pending, blocks=False):
    """te.Linear's backward (csrc/ext/linear.c linear_backward) on the grad_output the
    activation quantized, dy_q = (codes [padded, N], scale_inv, amax[, codes_t [N, padded]],
    ...), or with blocks
    (Float8BlockScaling / MXFP8BlockScaling) its members (data, scale_inv[, data_t,
    scale_inv_t]), or for wgrad alone just (data_t, scale_inv_t): (dx or None, dW or None);
    the caller takes dbias. saved:
    linear_forward's. linear.c takes a quantized grad_output of the forward's rows only where
    they are already the padded rows (a gathered one's), so the call is made for the padded
    rows (zero codes, which add nothing to dW) and dx keeps the first M of the [padded, K]
    dgrad: the bits of te.Linear's own padding."""
    codes = dy_q[0]
    if blocks and len(dy_q) == 2 and not needs & _plan.NEED_DGRAD:  # the columnwise pair
        members = (None, None, codes, dy_q[1], None, None)
        n, padded = codes.shape
    else:
        if blocks:
            members = (codes, dy_q[1]) + (tuple(dy_q[2:4]) if len(dy_q) >= 4
                                          else (None, None)) + (None, None)
        else:  # the codes transposed: the activation's (its C call), else here
            members = (codes, dy_q[1], given_codes_t(dy_q), None, dy_q[2], None)
            if needs & _plan.NEED_WGRAD:
                members = with_columnwise(members)
        padded, n = codes.shape
    rows, k = saved[2], saved[5]
    dx, dw, _ = _C.linear_backward(c_args, saved[:2] + (padded,) + saved[3:],
                                   (members, (padded, n), saved[6]), needs, None, (padded, k),
                                   None, pending)
    return (None if dx is None else dx[:rows].view(inp_shape)), dw


@op("tequant::linear_bwd_dy_given", mutates_args=("scale_bwd", "hist_bwd"))
def _linear_bwd_dy_given(dy_q: list[torch.Tensor], x_members: list[Optional[torch.Tensor]],
                         w_kept: torch.Tensor, recipe_id: str, needs: int, inp_shape: list[int],
                         x_dtype: torch.dtype, w_dtype: torch.dtype,
                         scale_bwd: Optional[torch.Tensor] = None,
                         hist_bwd: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW), an empty uint8 [0] for one not asked for, of tequant::linear_bwd_given's
    te.Linear (x as the fused norm's members, W's packed buffer) for the grad_output the
    activation quantized; given DelayedScaling's hist_bwd (and scale_bwd): dy's amax (dy_q[2])
    max-accumulated into its row 0, then the module's update of both in place (linear_bwd's)."""
    plan = _plan.of_id(recipe_id)
    state = None
    if plan.delayed and hist_bwd is not None:
        state = _delayed_states(recipe_id, needs, hist_bwd, scale_bwd, dy_q[0])[0]
        _max_into(state[1], dy_q[2])
    grads = _dy_given_grads(plan, dy_q, tuple(x_members), w_kept, recipe_id, needs, inp_shape,
                            x_dtype, w_dtype)
    if state is not None and not needs & _plan.DEFER_UPDATE:  # the module's update, as linear_bwd's
        _C._linear_delayed_update(recipe_id, hist_bwd, scale_bwd)
    return tuple(_or_absent(g, dy_q[0]) for g in grads)


def _dy_given_grads(plan, dy_q, x_kept, w_kept, recipe_id, needs, inp_shape, x_dtype, w_dtype):
    """given_dy_backward's (dx, dW) for the ops' arguments: x_kept its six members or its packed
    buffer (a tensor: linear_fwd's, split_dy_backward)."""
    rows, k = _rows_cols(inp_shape)
    if isinstance(x_kept, torch.Tensor):
        x_kept = (x_kept, None)
    saved = (x_kept, (w_kept, dy_q[2] if plan.delayed else None), rows,
             _plan.padded(rows, plan.align), _dy_cols(dy_q, needs, recipe_id), k,
             TQ_DTYPE[x_dtype], TQ_DTYPE[w_dtype])
    with graph_safe_workspace():
        return given_dy_backward(plan.c_args, saved, dy_q, needs & ~_plan.DEFER_UPDATE,
                                 tuple(inp_shape), None, plan.dy.scaling in _plan.BLOCK_FORMATS)


def _dy_cols(dy_q, needs, recipe_id):
    """N of the grad_output the given-dy backward multiplies: its rowwise codes' columns, or the
    rows of the columnwise pair's data_t [N, M] (split_dy_backward's wgrad)."""
    columnwise_pair = (len(dy_q) == 2 and not needs & _plan.NEED_DGRAD
                       and _plan.of_id(recipe_id).dy.scaling in _plan.BLOCK_FORMATS)
    return dy_q[0].shape[0] if columnwise_pair else dy_q[0].shape[1]


@fake("tequant::linear_bwd_dy_given")
def _linear_bwd_dy_given_fake(dy_q, x_members, w_kept, recipe_id, needs, inp_shape, x_dtype,
                              w_dtype, scale_bwd=None, hist_bwd=None):
    dy, absent = dy_q[0], _absent(dy_q[0])
    return (dy.new_empty(tuple(inp_shape), dtype=x_dtype) if needs & _plan.NEED_DGRAD else absent,
            dy.new_empty((dy.shape[-1], inp_shape[-1]), dtype=w_dtype)
            if needs & _plan.NEED_WGRAD else absent)


# ---- a large grad_output quantized in an op of its own (compiled te.Linear) ---------------------

SPLIT_DY_ELEMENTS = 1 << 24  # linear.c's rule for releasing dgrad's codes early (16M elements)


def splits_dy(recipe_id, dy, needs, bias_dtype, is_delayed):
    """Whether a compiled te.Linear backward quantizes its grad_output in an op of its own
    (split_dy_backward): block formats, dgrad and wgrad, no bias, more than SPLIT_DY_ELEMENTS
    elements, rows already the format's multiple. Then the graph frees dy (the gated
    activation's dh, written over h) once its codes exist, before dx and dW are allocated: the
    compiled Llama block's peak (docs/results/NOTES.md, twenty-seventh session)."""
    plan = _plan.of_id(recipe_id)
    rows, n = _rows_cols(dy.shape)
    both = _plan.NEED_DGRAD | _plan.NEED_WGRAD
    return (plan.dy.scaling in _plan.BLOCK_FORMATS and not is_delayed and bias_dtype is None
            and needs & both == both and rows * n > SPLIT_DY_ELEMENTS
            and rows == _plan.padded(rows, plan.align))


def split_dy_backward(dy, x_kept, w_kept, recipe_id, inp_shape, x_dtype, w_dtype):
    """(dx, dW) of tequant::linear_bwd's te.Linear as three ops: tequant::quantize of dy with
    the grad_output quantizer (both directions: the codes linear_bwd would make), then
    linear_bwd_part for dgrad on the rowwise pair and for wgrad on the columnwise pair, so the
    graph frees dy after the first and the rowwise codes after the second (as linear_bwd
    releases them before dW). The same bits."""
    dy2d = dy.reshape(-1, dy.shape[-1]).contiguous()
    dy_q = torch.ops.tequant.quantize(dy2d, recipe_id, "grad_output",
                                      _plan.ROWWISE | _plan.COLUMNWISE, None, None, None, 0)
    return tuple(torch.ops.tequant.linear_bwd_part(pair, x_kept, w_kept, recipe_id, part,
                                                   inp_shape, x_dtype, w_dtype)
                 for pair, part in ((dy_q[:2], _plan.NEED_DGRAD), (dy_q[2:4], _plan.NEED_WGRAD)))


@op("tequant::linear_bwd_part", mutates_args=())
def _linear_bwd_part(dy_pair: list[torch.Tensor], x_kept: torch.Tensor, w_kept: torch.Tensor,
                     recipe_id: str, part: int, inp_shape: list[int], x_dtype: torch.dtype,
                     w_dtype: torch.dtype) -> torch.Tensor:
    """dx (part NEED_DGRAD: dy_pair the rowwise data and scale_inv) or dW (NEED_WGRAD: the
    columnwise pair) of a block-format te.Linear from linear_fwd's packed buffers."""
    grads = _dy_given_grads(_plan.of_id(recipe_id), dy_pair, x_kept, w_kept, recipe_id, part,
                            inp_shape, x_dtype, w_dtype)
    return grads[0] if part == _plan.NEED_DGRAD else grads[1]


@fake("tequant::linear_bwd_part")
def _linear_bwd_part_fake(dy_pair, x_kept, w_kept, recipe_id, part, inp_shape, x_dtype, w_dtype):
    if part == _plan.NEED_DGRAD:
        return dy_pair[0].new_empty(tuple(inp_shape), dtype=x_dtype)
    n = _dy_cols(dy_pair, part, recipe_id)
    return dy_pair[0].new_empty((n, inp_shape[-1]), dtype=w_dtype)
