"""The tequant:: custom ops that torch.compile traces: quantize / dequantize / gemm / gemm_out
(te.ops), linear_fwd / linear_bwd / amax_update (te.Linear), linear_fwd_given / linear_bwd_given
(te.Linear on the fused norm's codes), linear_fwd_wgiven / linear_bwd_wgiven (te.Linear on a
weight FSDP2 gathered in a per-tensor FP8 format) and transpose_codes (the quantized gathers' columnwise
codes). The norm's own ops, norm_fwd / norm_fwd_delayed / norm_bwd, are in _norm_fn.py, beside
their Function (the activation's in _act_fn.py).

Dynamo cannot trace te.ops' C calls, so under torch.compile each one runs as a torch.library
custom op: its real implementation is the same C call as eager (the same bits), its fake
implementation gives the output shapes for tracing. The traced Python that calls the ops is
_compile_trace.py (te.ops) and _compile_linear.py (te.Linear). Importing this module only
registers the ops (no torch._dynamo import), so `import tequant` makes them available, e.g. to
load an exported program.

A config travels as two strings, a recipe's registry key `recipe._tequant_id` and the role; the
implementations resolve them with _C._recipe_of_key and _C.quantizer_config (cached).
Rules the ops keep for functionalization: quantize, dequantize and gemm return fresh tensors
(never an input, never each other); gemm_out mutates `out` and returns nothing. DelayedScaling:
quantize takes `scale` read-only and returns the amax of x in a fresh tensor (the traced code
max-accumulates it into the history slot). te.Linear's ops that take DelayedScaling's buffers
(linear_fwd_delayed / linear_bwd_delayed, the *_given and *_wgiven ops) and amax_update, the
batched roll and scale update, mutate the module's buffers in place as eager's C calls do
(forward: amaxes accumulated into row 0; backward with the fused update rule: also rolled, with
the new scale; backward under an amax all-reduce: accumulated only, the module queued by
amax_defer_queue for the end of the backward pass) and say so in their schemas: AOT
functionalizes them and Inductor re-inplaces them onto the buffers (graph inputs written back at
the graph's end), so nothing is copied.
They return fixed tuples (torch's auto_functionalize takes no Tensor[] return from a mutating
op), an empty uint8 [0] tensor standing for an absent output. linear_fwd / linear_bwd return
lists; given a history they return an updated copy, which the traced code copies into the
buffers (backward_override="dequantized" under DelayedScaling). Stochastic
rounding without rng: quantize draws (seed, offset) from the default generator of x's device
when it runs, as each eager call does (inside a CUDA graph capture, as a device tensor that each
replay draws anew: _rng.py).
Tests: tests/test_compile_ops.py, tests/test_compile.py, tests/test_compile_delayed.py,
tests/test_compile_layout.py.
"""
from typing import Optional

import torch

from . import _C, _plan, delayed
from ._plan import COLUMNWISE, DEFER_UPDATE, NEED_DGRAD, NEED_WGRAD, PACKED, ROWWISE

_CONFIGS = {}  # (recipe_id, role) -> QuantizerConfig
# te.Linear's ops take any layout from Inductor: they make the activation or gradient contiguous
# themselves. Under the default rule (eager's strides) Inductor copied a view fed to them into
# the view's shape, e.g. the qkv gradient (stack, permute, reshape), with index math Triton did
# not vectorize: 24 us instead of 12 at d=512 (H200; tests/test_compile_layout.py).
ANY_LAYOUT = (torch.Tag.flexible_layout,)
_LIB = torch.library.Library("tequant", "FRAGMENT")


def op(qualname, *, mutates_args, tags=(), kernel=None):
    """Decorator: defines `qualname` (tequant::name) from the function's annotations, with the
    function as its implementation (or `kernel`, a C function of tequant._C taking the same
    arguments: the dispatcher then calls C directly), and returns the op (torch.ops.tequant.name).
    torch.library.custom_op wraps an implementation in autograd and Dynamo-disabling layers
    that cost ~90 us per call with grad mode off (as compiled graphs run), against ~5 us for a
    plain Library op; these ops need no autograd formula (te.Linear's Function owns the
    backward, and te.ops' results are not differentiable in eager either)."""
    name = qualname.split("::")[1]

    def define(fn):
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args), tags=tags)
        _LIB.impl(name, fn if kernel is None else kernel, "CompositeExplicitAutograd")
        return getattr(torch.ops.tequant, name)
    return define


def fake(qualname):
    """Decorator: the fake (meta) implementation of a tequant op."""
    return torch.library.register_fake(qualname, lib=_LIB)


def config_of(recipe_id, role):
    """The QuantizerConfig of the recipe registered under `recipe_id` (a str) for `role`."""
    config = _CONFIGS.get((recipe_id, role))
    if config is None:
        config = _C.quantizer_config(_C._recipe_of_key(int(recipe_id)), role)
        _CONFIGS[(recipe_id, role)] = config
    return config


# ---- quantize --------------------------------------------------------------------------------

def _rows_cols(shape):
    """(M, K) of a [..., K] tensor as concrete ints (the C layout takes ints: a dynamic dim is
    specialized here, i.e. a new size recompiles)."""
    cols = int(shape[-1]) if len(shape) else 1
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows, cols


_C._set_op_config_of(config_of)


@op("tequant::quantize", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,),
    kernel=_C.quantize_op)
def quantize_op(x: torch.Tensor, recipe_id: str, role: str, usage: int,
                scale: Optional[torch.Tensor], rng: Optional[list[int]],
                rng_state: Optional[torch.Tensor], draw_site: int) -> list[torch.Tensor]:
    """The members _C._quantize makes (the present ones, in order). Stochastic rounding's rng:
    (seed, offset), or an int64 [2] tensor read when the kernel runs, or neither to draw from
    the default generator of x's device now; draw_site only keeps such calls apart in the graph
    (_compile_trace._draw_site). The kernel: csrc/ext/functional_ops.c."""


@fake("tequant::quantize")
def _quantize_fake(x, recipe_id, role, usage, scale, rng, rng_state, draw_site):
    rows, cols = _rows_cols(x.shape)
    layout = _C._quantize_layout(config_of(recipe_id, role), rows, cols, usage)
    return [x.new_empty((r, c), dtype=dtype) for r, c, dtype in filter(None, layout)]


# ---- dequantize ------------------------------------------------------------------------------

def _dequantized_shape(rows, cols, usage):
    return (rows, cols) if usage == ROWWISE else (cols, rows)


def _device_of(members, usage):
    return members[0 if usage == ROWWISE else 2].device


@op("tequant::dequantize", mutates_args=(), kernel=_C.dequantize_op)
def dequantize_op(members: list[Optional[torch.Tensor]], recipe_id: str, role: str, rows: int,
                  cols: int, usage: int, dtype: torch.dtype) -> torch.Tensor:
    """One direction's values, [rows, cols] rowwise or [cols, rows] columnwise (the kernel:
    csrc/ext/functional_ops.c)."""


@fake("tequant::dequantize")
def _dequantize_fake(members, recipe_id, role, rows, cols, usage, dtype):
    return torch.empty(_dequantized_shape(rows, cols, usage), dtype=dtype,
                       device=_device_of(members, usage))


# ---- gemm ------------------------------------------------------------------------------------

@op("tequant::gemm", mutates_args=(), kernel=_C.gemm_op)
def gemm_op(a: list[Optional[torch.Tensor]], a_recipe_id: str, a_role: str, a_rows: int,
            a_cols: int, a_usage: int, b: list[Optional[torch.Tensor]], b_recipe_id: str,
            b_role: str, b_rows: int, b_cols: int, b_usage: int, out_dtype: torch.dtype,
            bias: Optional[torch.Tensor], flags: int) -> torch.Tensor:
    """_C._gemm into a new [M, N] tensor: a, b are one operand's members and key each (the
    kernel: csrc/ext/functional_ops.c)."""


@fake("tequant::gemm")
def _gemm_fake(a, a_recipe_id, a_role, a_rows, a_cols, a_usage, b, b_recipe_id, b_role, b_rows,
               b_cols, b_usage, out_dtype, bias, flags):
    m = a_rows if a_usage == ROWWISE else a_cols  # columnwise: the [K, M] operand transposed
    n = b_rows if b_usage == ROWWISE else b_cols
    return torch.empty((m, n), dtype=out_dtype, device=_device_of(a, a_usage))


@op("tequant::gemm_out", mutates_args=("out",), kernel=_C.gemm_out_op)
def gemm_out_op(a: list[Optional[torch.Tensor]], a_recipe_id: str, a_role: str, a_rows: int,
                a_cols: int, a_usage: int, b: list[Optional[torch.Tensor]], b_recipe_id: str,
                b_role: str, b_rows: int, b_cols: int, b_usage: int, out: torch.Tensor,
                bias: Optional[torch.Tensor], flags: int) -> None:
    """_C._gemm writing (or, with the ACCUMULATE flag, adding) into the caller's `out` (the
    kernel: csrc/ext/functional_ops.c)."""


@fake("tequant::gemm_out")
def _gemm_out_fake(a, a_recipe_id, a_role, a_rows, a_cols, a_usage, b, b_recipe_id, b_role,
                   b_rows, b_cols, b_usage, out, bias, flags):
    return None


# ---- te.Linear ---------------------------------------------------------------------------------
@op("tequant::transpose_codes", mutates_args=(), kernel=_C.transpose_codes_op)
def transpose_codes(x: torch.Tensor) -> torch.Tensor:
    """x.t().contiguous() for a 2-D tensor of one-byte codes (uint8, float8_e4m3fn, float8_e5m2,
    float8_e8m0fnu), in one tiled pass (tq_transpose; the kernel: csrc/ext/ops.c): the
    columnwise codes of a gathered per-tensor FP8 or 2-D-block operand
    (distributed/gather_layout.py). An op, not a C call, so that traced code (the quantized
    sequence-parallel gather under torch.compile) reaches it."""


@fake("tequant::transpose_codes")
def _transposed_like(x):
    if x.dim() != 2:
        raise ValueError(f"transpose_codes: x must be 2-D, got shape {tuple(x.shape)}")
    return x.new_empty((x.shape[1], x.shape[0]))


# The compiled te.Linear (_compile_linear.py) runs linear.c's forward and backward as these ops,
# whose kernels are C functions of tequant._C (csrc/ext/linear_ops.c): the dispatcher calls them
# with no Python frame in between. linear_ops.c asks for a recipe id's entry once.

def _linear_entry(recipe_id):
    """What linear_ops.c asks of a recipe id once: (the plan tuple linear.c takes, DelayedScaling's
    backward update for the ops that update a module themselves: delayed.fused_update, None for
    TE's unfused rule or another recipe)."""
    plan = _plan.of_id(recipe_id)
    return plan.c_args, delayed.fused_update(plan, delayed.BACKWARD) if plan.delayed else None


_C._set_linear_plan_of(_linear_entry)


@op("tequant::linear_fwd", mutates_args=(), tags=ANY_LAYOUT, kernel=_C.linear_fwd_op)
def linear_fwd(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe_id: str,
               needs: int, scale_fwd: torch.Tensor | None,
               hist_fwd: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[y, what backward keeps] (+ for DelayedScaling: [hist_fwd's copy with x's and W's amaxes
    max-accumulated into row 0] given hist_fwd, else [amax x, amax W]): with needs bit 8
    (packed) x's columnwise buffer when wgrad runs and W's buffer, else the kept members of x
    and W (csrc/ext/linear_ops.c, the kernel)."""


def _fake_members(config, rows, cols, usage, kept, device):
    layout = _C._quantize_layout(config, int(rows), int(cols), usage)
    return [torch.empty(r, c, dtype=d, device=device)
            for (r, c, d), k in zip((m or (0, 0, None) for m in layout), kept) if k]


def _fake_buffer(config, rows, cols, parts, like):
    """A packed buffer of `parts` of an [rows, cols] tensor quantized in both directions."""
    size = _C._packed_bytes(config, int(rows), int(cols), ROWWISE | COLUMNWISE, parts)
    return like.new_empty((size,), dtype=torch.uint8)


@fake("tequant::linear_fwd")
def _linear_fwd_fake(inp, weight, bias, recipe_id, needs, scale_fwd, hist_fwd=None):
    plan = _plan.of_id(recipe_id)
    n, k = weight.shape
    rows = inp.numel() // k
    padded = _plan.padded(rows, plan.align)
    result = [inp.new_empty(tuple(inp.shape[:-1]) + (n,))]
    if needs & PACKED:
        if needs & NEED_WGRAD:
            result.append(_fake_buffer(plan.x, padded, k, COLUMNWISE, inp))
        result.append(_fake_buffer(plan.w, n, k, ROWWISE | COLUMNWISE, inp))
    else:
        x_usage = ROWWISE | (COLUMNWISE if needs & NEED_WGRAD else 0)  # linear.c's rule
        result += _fake_members(plan.x, padded, k, x_usage, _plan.x_kept(plan, needs),
                                inp.device)
        result += _fake_members(plan.w, n, k, ROWWISE | COLUMNWISE, _plan.w_kept(plan),
                                inp.device)
    return result + _delayed_fake(plan, inp, hist_fwd, 2)


def _delayed_fake(plan, like, hist, n_amax):
    """The trailing DelayedScaling outputs: the history's copy, or n amaxes."""
    if not plan.delayed:
        return []
    if hist is not None:
        return [torch.empty_like(hist)]
    return [like.new_empty((1, 1), dtype=torch.float32) for _ in range(n_amax)]


@op("tequant::linear_bwd", mutates_args=(), tags=ANY_LAYOUT, kernel=_C.linear_bwd_op)
def linear_bwd(dy: torch.Tensor, x_kept: torch.Tensor | None, w_kept: torch.Tensor,
               recipe_id: str, needs: int, inp_shape: list[int], x_dtype: torch.dtype,
               w_dtype: torch.dtype, bias_dtype: torch.dtype | None,
               scale_bwd: torch.Tensor | None) -> list[torch.Tensor]:
    """[dx if dgrad, dW if wgrad, db if bias_dtype] from the packed buffers linear_fwd kept, +
    [amax dy] under DelayedScaling (csrc/ext/linear_ops.c, the kernel; linear_bwd_delayed
    updates the module's buffers itself)."""


@fake("tequant::linear_bwd")
def _linear_bwd_fake(dy, x_kept, w_kept, recipe_id, needs, inp_shape, x_dtype, w_dtype,
                     bias_dtype, scale_bwd):
    result = []
    if needs & NEED_DGRAD:
        result.append(dy.new_empty(tuple(inp_shape), dtype=x_dtype))
    if needs & NEED_WGRAD:
        result.append(dy.new_empty((dy.shape[-1], inp_shape[-1]), dtype=w_dtype))
    if bias_dtype is not None:
        result.append(dy.new_empty((dy.shape[-1],), dtype=bias_dtype))
    return result + _delayed_fake(_plan.of_id(recipe_id), dy, None, 1)


# DelayedScaling with the module's buffers: the same C calls, the buffers updated in place as
# eager's are (no copy of a history or scale, Inductor re-inplaces the mutation onto the module's
# buffers). A mutating op must return fixed Tensors (torch's auto_functionalize takes no list),
# so an absent output is an empty uint8 [0] tensor.

@op("tequant::linear_fwd_delayed", mutates_args=("hist_fwd",), tags=ANY_LAYOUT,
    kernel=_C.linear_fwd_delayed_op)
def linear_fwd_delayed(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       recipe_id: str, needs: int, scale_fwd: torch.Tensor,
                       hist_fwd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x's packed columnwise buffer or an empty tensor without wgrad, W's packed buffer) with
    x's and W's amaxes max-accumulated into row 0 of hist_fwd in place (needs: packed)."""


@fake("tequant::linear_fwd_delayed")
def _linear_fwd_delayed_fake(inp, weight, bias, recipe_id, needs, scale_fwd, hist_fwd):
    outs = _linear_fwd_fake(inp, weight, bias, recipe_id, needs, scale_fwd, hist_fwd)[:-1]
    x_buf = outs[1] if len(outs) == 3 else _absent(inp)
    return outs[0], x_buf, outs[-1]


@op("tequant::linear_bwd_delayed", mutates_args=("scale_bwd", "hist_bwd"), tags=ANY_LAYOUT,
    kernel=_C.linear_bwd_delayed_op)
def linear_bwd_delayed(dy: torch.Tensor, x_kept: torch.Tensor | None, w_kept: torch.Tensor,
                       recipe_id: str, needs: int, inp_shape: list[int], x_dtype: torch.dtype,
                       w_dtype: torch.dtype, bias_dtype: torch.dtype | None,
                       scale_bwd: torch.Tensor,
                       hist_bwd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW, db), an empty tensor for each one not asked for, with dy's amax max-accumulated
    into row 0 of hist_bwd and the module's update of hist_bwd and scale_bwd in place (the fused
    update rule, no amax reduction)."""


@fake("tequant::linear_bwd_delayed")
def _linear_bwd_delayed_fake(dy, x_kept, w_kept, recipe_id, needs, inp_shape, x_dtype, w_dtype,
                             bias_dtype, scale_bwd, hist_bwd):
    it = iter(_linear_bwd_fake(dy, x_kept, w_kept, recipe_id, needs, inp_shape, x_dtype,
                               w_dtype, bias_dtype, scale_bwd))  # (its trailing amax unread)
    wanted = (needs & NEED_DGRAD, needs & NEED_WGRAD, bias_dtype is not None)
    return tuple(next(it) if w else _absent(dy) for w in wanted)


# The fused norm's codes (_norm_fn.NormInput) reach te.Linear already quantized: these two run
# linear.c's calls on such an x (its six members, rows zero-padded to the format's multiple), the
# eager calls' bits, through C kernels as linear_fwd / linear_bwd of a high-precision x.

@op("tequant::linear_fwd_given", mutates_args=("hist_fwd",), kernel=_C.linear_fwd_given_op)
def linear_fwd_given(x_members: list[Optional[torch.Tensor]], x_shape: list[int],
                     x_dtype: torch.dtype, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     recipe_id: str, needs: int, scale_fwd: Optional[torch.Tensor],
                     hist_fwd: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, W's packed buffer) of y = x W^T + b for x given as its members (needs: linear.c's
    bits, packed; x's own members are not returned: the caller holds them). DelayedScaling:
    W's amax max-accumulated into row 0 of hist_fwd in place (x's is there already: the norm's
    or activation's op put it there; x_members[4] is None). The kernel: csrc/ext/given_ops.c."""


@fake("tequant::linear_fwd_given")
def _linear_fwd_given_fake(x_members, x_shape, x_dtype, weight, bias, recipe_id, needs,
                           scale_fwd, hist_fwd=None):
    plan = _plan.of_id(recipe_id)
    n, k = weight.shape
    like = weight if x_members[0] is None else x_members[0]
    return (like.new_empty(tuple(x_shape[:-1]) + (n,), dtype=x_dtype),
            _fake_buffer(plan.w, n, k, ROWWISE | COLUMNWISE, like))


_GRADS = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@op("tequant::linear_bwd_given", mutates_args=("scale_bwd", "hist_bwd"), tags=ANY_LAYOUT,
    kernel=_C.linear_bwd_given_op)
def linear_bwd_given(dy: torch.Tensor, x_members: list[Optional[torch.Tensor]],
                     w_kept: torch.Tensor, recipe_id: str, needs: int, inp_shape: list[int],
                     x_dtype: torch.dtype, w_dtype: torch.dtype, bias_dtype: torch.dtype | None,
                     scale_bwd: torch.Tensor | None,
                     hist_bwd: torch.Tensor | None = None) -> _GRADS:
    """linear_bwd for an x that came as members (x_members: its six, the columnwise ones for
    wgrad) and W's packed buffer: (dx, dW, db, DelayedScaling's amax of dy without hist_bwd), an
    empty uint8 [0] tensor for each absent one; given hist_bwd, dy's amax goes into its row 0
    and the module's update runs on hist_bwd and scale_bwd in place (unless needs defers it).
    The kernel: csrc/ext/given_ops.c."""


def _absent(like):
    """The empty uint8 [0] tensor that stands for an absent output of a fixed-arity op."""
    return like.new_empty((0,), dtype=torch.uint8)


def _backward_given_fake(dy, recipe_id, needs, inp_shape, x_dtype, w_dtype, bias_dtype, hist_bwd):
    absent = _absent(dy)
    return (dy.new_empty(tuple(inp_shape), dtype=x_dtype) if needs & NEED_DGRAD else absent,
            dy.new_empty((dy.shape[-1], inp_shape[-1]), dtype=w_dtype) if needs & NEED_WGRAD
            else absent,
            dy.new_empty((dy.shape[-1],), dtype=bias_dtype) if bias_dtype is not None else absent,
            dy.new_empty((1, 1), dtype=torch.float32)
            if _plan.of_id(recipe_id).delayed and hist_bwd is None else absent)


@fake("tequant::linear_bwd_given")
def _linear_bwd_given_fake(dy, x_members, w_kept, recipe_id, needs, inp_shape, x_dtype, w_dtype,
                           bias_dtype, scale_bwd, hist_bwd=None):
    return _backward_given_fake(dy, recipe_id, needs, inp_shape, x_dtype, w_dtype, bias_dtype,
                                hist_bwd)


# A weight FSDP2 all-gathered in a per-tensor FP8 format (distributed/fsdp.py
# TraceableGatheredWeight) reaches te.Linear as its members: these two run linear.c's calls on
# such a W (eager's bits: linear.py hands C the same members) and a high-precision x.

@op("tequant::linear_fwd_wgiven", mutates_args=("hist_fwd",), tags=ANY_LAYOUT,
    kernel=_C.linear_fwd_wgiven_op)
def linear_fwd_wgiven(inp: torch.Tensor, w_members: list[Optional[torch.Tensor]],
                      w_dtype: torch.dtype, bias: Optional[torch.Tensor], recipe_id: str,
                      needs: int, scale_fwd: Optional[torch.Tensor],
                      hist_fwd: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, x's packed columnwise buffer, or an empty uint8 [0] tensor without wgrad) of
    y = x W^T + b for W given as its six members (rowwise); DelayedScaling: x's amax
    max-accumulated into row 0 of hist_fwd in place (W's went into it at the gather). The
    kernel: csrc/ext/given_ops.c."""


@fake("tequant::linear_fwd_wgiven")
def _linear_fwd_wgiven_fake(inp, w_members, w_dtype, bias, recipe_id, needs, scale_fwd,
                            hist_fwd=None):
    plan = _plan.of_id(recipe_id)
    n, k = w_members[0].shape
    if needs & NEED_WGRAD:
        padded = _plan.padded(inp.numel() // k, plan.align)
        x_buf = _fake_buffer(plan.x, padded, k, COLUMNWISE, inp)
    else:
        x_buf = _absent(inp)
    return inp.new_empty(tuple(inp.shape[:-1]) + (n,)), x_buf


@op("tequant::linear_bwd_wgiven", mutates_args=("scale_bwd", "hist_bwd"), tags=ANY_LAYOUT,
    kernel=_C.linear_bwd_wgiven_op)
def linear_bwd_wgiven(dy: torch.Tensor, x_kept: Optional[torch.Tensor],
                      w_members: list[Optional[torch.Tensor]], recipe_id: str, needs: int,
                      inp_shape: list[int], x_dtype: torch.dtype, w_dtype: torch.dtype,
                      bias_dtype: Optional[torch.dtype], scale_bwd: Optional[torch.Tensor],
                      hist_bwd: Optional[torch.Tensor] = None) -> _GRADS:
    """linear_bwd for x's packed columnwise buffer (linear_fwd_wgiven's, None without wgrad) and
    W's six members (its columnwise codes for dgrad): (dx, dW, db, amax dy) as linear_bwd_given's
    (csrc/ext/given_ops.c, the kernel)."""


@fake("tequant::linear_bwd_wgiven")
def _linear_bwd_wgiven_fake(dy, x_kept, w_members, recipe_id, needs, inp_shape, x_dtype,
                            w_dtype, bias_dtype, scale_bwd, hist_bwd=None):
    return _backward_given_fake(dy, recipe_id, needs, inp_shape, x_dtype, w_dtype, bias_dtype,
                                hist_bwd)


_UPDATES = {}  # (recipe_id, direction, columns) -> the fused update's argument, or None


@op("tequant::amax_update", mutates_args=("histories", "scales"))
def amax_update(histories: list[torch.Tensor], scales: list[torch.Tensor],
                reduced: Optional[torch.Tensor], recipe_id: str, direction: str) -> None:
    """DelayedScaling's roll and scale update of n modules' [L, c] histories and [c] scales in
    place, in one batch as eager's update runs (delayed.update_slots); reduced: None, or the
    n * c row-0 amaxes all-reduced over the amax reduction group (they replace row 0)."""
    columns = sum(h.shape[1] for h in histories)
    key = (recipe_id, direction, columns)
    update = _UPDATES.get(key)
    if update is None and key not in _UPDATES:
        fused = delayed.fused_update(_plan.of_id(recipe_id), direction)  # None: TE's unfused
        update = _UPDATES[key] = None if fused is None else \
            fused[:2] + (fused[2] * (columns // len(fused[2])),)
    if update is not None:  # every module's columns in one C call
        _C._amax_update_buffers(histories, scales, update, reduced)
        return
    plan = _plan.of_id(recipe_id)
    slots = [slot for h, s in zip(histories, scales)
             for slot in delayed.slots_of(plan, h, s, direction)]
    delayed.update_unfused(slots, reduced, plan.recipe)


@fake("tequant::amax_update")
def _amax_update_fake(histories, scales, reduced, recipe_id, direction):
    return None


@op("tequant::amax_defer_queue", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def amax_defer_queue(grad: torch.Tensor, hist_bwd: torch.Tensor, scale_bwd: torch.Tensor,
                     recipe_id: str, group_name: str) -> None:
    """Queues a module's DelayedScaling backward buffers for the end of the backward pass, whose
    one all-reduce (MAX over the process group named group_name) and update run on every queued
    module (delayed.defer_backward). The traced code calls it before the in-place op that
    accumulates dy's amax into hist_bwd (needs bit DEFER_UPDATE), so it is handed the graph's
    inputs, the buffers themselves. grad (a gradient the backward received) is not read: it
    keeps the op in the backward graph, where AOT's partitioner would otherwise move an op that
    reads only forward values into the forward. It returns nothing and mutates nothing:
    registered as a side effect below, so that FX and Inductor keep it; unsafe to record in a
    CUDA graph, whose replay would skip it."""
    group = torch.distributed.distributed_c10d._resolve_process_group(group_name)
    delayed.defer_backward(hist_bwd, scale_bwd, _plan.of_id(recipe_id), group)


torch.fx.node.has_side_effect(amax_defer_queue.default)


@fake("tequant::amax_defer_queue")
def _amax_defer_queue_fake(grad, hist_bwd, scale_bwd, recipe_id, group_name):
    return None
