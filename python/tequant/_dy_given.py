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
from ._compile_ops import _absent, _rows_cols, fake, op

__all__ = ["given_codes_t", "given_dy_backward", "split_dy_backward", "splits_dy"]


def given_codes_t(dy_q):
    """The columnwise codes [N, padded] among a per-tensor grad_output's tensors from the
    activation's backward (codes, scale_inv, amax[, codes_t][, dbias]: codes_t is the one 2-D
    tensor after amax; dbias is 1-D), or None (given_dy_backward transposes the codes then)."""
    return dy_q[3] if len(dy_q) > 3 and dy_q[3] is not None and dy_q[3].dim() == 2 else None


# te.Linear's backward on a grad_output given quantized: (dx or None, dW or None), in C for eager
# (linear.py) and the ops below alike (csrc/ext/dy_given.c says what dy_q may hold).
given_dy_backward = _C._given_dy_backward


@op("tequant::linear_bwd_dy_given", mutates_args=("scale_bwd", "hist_bwd"),
    kernel=_C.linear_bwd_dy_given_op)
def _linear_bwd_dy_given(dy_q: list[torch.Tensor], x_members: list[Optional[torch.Tensor]],
                         w_kept: torch.Tensor, recipe_id: str, needs: int, inp_shape: list[int],
                         x_dtype: torch.dtype, w_dtype: torch.dtype,
                         scale_bwd: Optional[torch.Tensor] = None,
                         hist_bwd: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW), an empty uint8 [0] for one not asked for, of tequant::linear_bwd_given's
    te.Linear (x as the fused norm's members, W's packed buffer) for the grad_output the
    activation quantized; given DelayedScaling's hist_bwd (and scale_bwd): dy's amax (dy_q[2])
    max-accumulated into its row 0, then the module's update of both in place (linear_bwd's).
    The kernel: csrc/ext/given_ops.c."""


@fake("tequant::linear_bwd_dy_given")
def _linear_bwd_dy_given_fake(dy_q, x_members, w_kept, recipe_id, needs, inp_shape, x_dtype,
                              w_dtype, scale_bwd=None, hist_bwd=None):
    dy, absent = dy_q[0], _absent(dy_q[0])
    return (dy.new_empty(tuple(inp_shape), dtype=x_dtype) if needs & _plan.NEED_DGRAD else absent,
            dy.new_empty((dy.shape[-1], inp_shape[-1]), dtype=w_dtype)
            if needs & _plan.NEED_WGRAD else absent)


def _dy_cols(dy_q, needs, recipe_id):
    """N of the grad_output the given-dy backward multiplies: its rowwise codes' columns, or the
    rows of the columnwise pair's data_t [N, M] (split_dy_backward's wgrad)."""
    columnwise_pair = (len(dy_q) == 2 and not needs & _plan.NEED_DGRAD
                       and _plan.blocks_of(recipe_id)[1])
    return dy_q[0].shape[0] if columnwise_pair else dy_q[0].shape[1]


# ---- a large grad_output quantized in an op of its own (compiled te.Linear) ---------------------

SPLIT_DY_ELEMENTS = 1 << 24  # linear.c's rule for releasing dgrad's codes early (16M elements)


def splits_dy(recipe_id, dy, needs, bias_dtype, is_delayed):
    """Whether a compiled te.Linear backward quantizes its grad_output in an op of its own
    (split_dy_backward): block formats, dgrad and wgrad, no bias, more than SPLIT_DY_ELEMENTS
    elements, rows already the format's multiple. Then the graph frees dy (the gated
    activation's dh, written over h) once its codes exist, before dx and dW are allocated: the
    compiled Llama block's peak (docs/results/NOTES.md, twenty-seventh session)."""
    _, dy_blocks, align = _plan.blocks_of(recipe_id)
    rows, n = _rows_cols(dy.shape)
    both = _plan.NEED_DGRAD | _plan.NEED_WGRAD
    return (dy_blocks and not is_delayed and bias_dtype is None
            and needs & both == both and rows * n > SPLIT_DY_ELEMENTS
            and rows == _plan.padded(rows, align))


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


@op("tequant::linear_bwd_part", mutates_args=(), kernel=_C.linear_bwd_part_op)
def _linear_bwd_part(dy_pair: list[torch.Tensor], x_kept: torch.Tensor, w_kept: torch.Tensor,
                     recipe_id: str, part: int, inp_shape: list[int], x_dtype: torch.dtype,
                     w_dtype: torch.dtype) -> torch.Tensor:
    """dx (part NEED_DGRAD: dy_pair the rowwise data and scale_inv) or dW (NEED_WGRAD: the
    columnwise pair) of a block-format te.Linear from linear_fwd's packed buffers (the kernel:
    csrc/ext/given_ops.c)."""


@fake("tequant::linear_bwd_part")
def _linear_bwd_part_fake(dy_pair, x_kept, w_kept, recipe_id, part, inp_shape, x_dtype, w_dtype):
    if part == _plan.NEED_DGRAD:
        return dy_pair[0].new_empty(tuple(inp_shape), dtype=x_dtype)
    n = _dy_cols(dy_pair, part, recipe_id)
    return dy_pair[0].new_empty((n, inp_shape[-1]), dtype=w_dtype)
