"""te.Linear inside torch.compile: the forward and the autograd Function Dynamo traces, around
the `tequant::linear_fwd` / `linear_bwd` ops, DelayedScaling's `linear_fwd_delayed` /
`linear_bwd_delayed` and `tequant::amax_update` (_compile_ops.py).

Eager te.Linear makes one C call per direction (csrc/ext/linear.c); traced code cannot, so the
same C calls run inside torch.library ops whose schemas carry only tensors, ints and strings
(the recipe as its `_tequant_id`). Ops return fresh tensors; DelayedScaling's take the module's
buffers and update them in place as eager's calls do (forward: the amaxes of x and W
max-accumulated into row 0; backward: dy's, then the roll and scale update), declaring the
mutation, so AOT functionalizes it and Inductor writes the buffers themselves (no copy; CUDA
graphs see ordinary buffer updates). backward_override="dequantized" keeps linear_fwd's members
form, which returns a copy of the history that the traced code writes back. Where the backward
update needs TE's unfused rule (a callable algo) without an all-reduce, the backward op returns
dy's amax instead and the traced code accumulates and updates (tequant::amax_update). With an
amax all-reduce, the in-place op only accumulates dy's amax (needs bit DEFER_UPDATE) and the
module's buffers are queued before it (tequant::amax_defer_queue) for the end of the backward
pass, which reduces and updates every queued module at once, as eager does.
DelayedScaling under compile: the forward update of a module runs at the outermost autocast's
exit (traced, when that autocast is entered in the compiled code; eager, when the compiled code
runs inside an eager te.autocast: the module's buffers register with it after the graph runs);
the backward update of a module runs at the end of its own backward, which gives the eager
values whenever each module runs once per autocast (the case te.Linear supports under compile).
Traced updates all-reduce row 0 over the autocast's amax_reduction_group first (a functional
collective in the graph), as delayed.py's eager update does.
A te.LayerNormLinear (or LayerNormMLP's fc1) hands its input as a _norm_fn.NormInput: where eager
fuses (NormInput.fusable, the same rule), its norm runs as tequant::norm_fwd writing x's codes
(DelayedScaling: norm_fwd_delayed, which puts x's amax into this module's history itself) and
the Function multiplies them through tequant::linear_fwd_given / linear_bwd_given (eager's
bits); elsewhere the norm's output goes through the path above. LayerNormMLP's fc2 gets an
_act_fn.ActInput, its activation run as tequant::act_fwd (act_fwd_delayed) the same way; where
fc1 multiplies the norm's codes, the activation's backward (tequant::act_bwd) quantizes fc1's grad_output, which
reaches fc1's backward as the gradients of the placeholders its Function returns
(_act_fn.GradOutput), multiplied there by tequant::linear_bwd_dy_given.
A weight FSDP2 all-gathered in the recipe's format (distributed/fsdp.py) is traced under the
per-tensor FP8 recipes (a TraceableGatheredWeight: _compile_gathered.py's Function); under the
others the layer runs eagerly behind a graph break (_eager_local).
Tests: tests/test_compile.py, tests/test_compile_delayed.py, tests/test_fused_norm_compile.py,
tests/test_fused_act_modules.py, tests/test_fsdp.py (compile_worker).
"""
import torch
import torch.nn.functional as F

from . import (_C, _act_fn, _compile, _custom_linear, _dy_given, _norm_fn, _override, _plan,
               delayed)
from . import _compile_modules as _modules
from . import checkpoint as _checkpoint
from ._act_fn import ActInput
from ._norm_fn import NormInput
from ._operands import is_dtensor, quantized_weight
from ._plan import DEFER_UPDATE, KEEP_X_ROWWISE, NEED_DGRAD, NEED_WGRAD, PACKED, ROWWISE


@_compile.constant
def info(recipe_id, needs):
    """Compile-time constants of a recipe: (scaling, align, delayed, backward_override,
    history_len, x members kept, w members kept, reduce_amax)."""
    plan = _plan.of_id(recipe_id)
    return (plan.x.scaling, plan.align, plan.delayed, plan.backward_override,
            plan.x.amax_history_len if plan.delayed else 0, _plan.x_kept(plan, needs),
            _plan.w_kept(plan), plan.delayed and plan.recipe.reduce_amax)


def _six(present, kept):
    it = iter(present)
    return tuple(next(it) if k else None for k in kept)


def _reduced(histories, rows, recipe_id, group):
    """The row-0 amaxes the update takes: `rows` (None: the histories' own row 0, which the
    update reads itself), all-reduced (MAX) over the amax reduction group in one collective
    where it reduces, as delayed._reduce does in eager (traced: Dynamo turns the collective into
    a functional one in the graph)."""
    if not _reduces(recipe_id, group):
        return rows
    if rows is None:
        rows = torch.cat([h[0] for h in histories])
    torch.distributed.all_reduce(rows, op=torch.distributed.ReduceOp.MAX, group=group)
    return rows


def _reduces(recipe_id, group):
    """Whether DelayedScaling's update all-reduces amaxes over `group` first (traced: the checks
    are evaluated while tracing)."""
    return group is not None and info(recipe_id, 0)[7] and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size(group) > 1


@_compile.constant
def _act_blocks(recipe_id):
    """Whether an activation's pass can write the recipe's input blocks (_plan.Plan.act_blocks)."""
    return _plan.of_id(recipe_id).act_blocks


@_compile.constant
def _fused_rule(recipe_id):
    """Whether the recipe's update is the fused rule that the backward ops run themselves."""
    plan = _plan.of_id(recipe_id)
    return plan.delayed and delayed.fused_update(plan, delayed.BACKWARD) is not None


def _op_updates(recipe_id, group):
    """Whether a DelayedScaling module's backward op runs the module's backward update itself:
    the fused rule, and no all-reduce between its amax and the update."""
    return _fused_rule(recipe_id) and not _reduces(recipe_id, group)


def _apply_update(histories, scales, recipe_id, direction, rows=None, group=None):
    """The roll and scale update of histories and scales in place (tequant::amax_update, one
    call for the batch), from `rows` (default: the histories' row 0) after the group's
    all-reduce."""
    reduced = _reduced(histories, rows, recipe_id, group)
    torch.ops.tequant.amax_update(list(histories), list(scales), reduced, recipe_id, direction)


@_compile.at_root_exit
def update_forward(entries):
    """The traced outermost autocast's exit: the forward update of its DelayedScaling modules,
    one op per (recipe, group) as eager batches them."""
    batches = []  # (recipe_id, group, histories, scales)
    for _, history, scale, recipe_id, group in entries:
        for batch in batches:
            if batch[0] == recipe_id and batch[1] is group:
                break
        else:
            batch = (recipe_id, group, [], [])
            batches.append(batch)
        batch[2].append(history)
        batch[3].append(scale)
    for recipe_id, group, histories, scales in batches:
        _apply_update(histories, scales, recipe_id, delayed.FORWARD, group=group)


def register_after_graph(entries):
    """Runs after a compiled graph, inside the eager te.autocast it ran in (the C setter of
    `_C._live.delayed` calls it; wrapped in torch._dynamo.disable once Dynamo loads): records
    each compiled module's forward buffers with that autocast, whose outermost exit updates
    them with the eager modules (delayed.py)."""
    group = _C.get_fp8_group()
    for i in range(0, len(entries), 3):  # flat (history, scale, recipe id) triples
        history, scale, recipe_id = entries[i:i + 3]
        delayed.register_compiled(history, scale, _plan.of_id(recipe_id), group)


def _eager_local(module, inp, weight, bias):
    """Eager te.Linear's local linear (linear.py) on a weight FSDP2 gathered quantized in a
    format Dynamo cannot trace (all but per-tensor FP8: _compile_gathered.py), run outside the
    graph under the eager te.autocast state."""
    return module._compute(inp, weight, bias, None, None, None, False, None)


_FSDP_GATHERED = ("te.Linear's weight arrived through FSDP2's quantized all-gather "
                  "(tequant.distributed.enable_quantized_all_gather) in a format whose gathered "
                  "members Dynamo cannot trace (all but per-tensor FP8 without "
                  "backward_override): the layer runs eagerly. Compile without fullgraph=True, "
                  "or gather in high precision")


@_compile.when_dynamo_loads
def _eager_only():
    global register_after_graph, _eager_local
    register_after_graph = torch._dynamo.disable(register_after_graph)
    _eager_local = torch._dynamo.disable(_eager_local, reason=_FSDP_GATHERED)


class _CompiledLinear(torch.autograd.Function):
    """Linear's quantized forward and backward as Dynamo traces them."""

    @staticmethod
    def forward(ctx, inp, weight, bias, scale_fwd, hist_fwd, scale_bwd, hist_bwd, recipe_id,
                group, x_data=None, x_scale_inv=None, x_amax=None, dh=None, x_data_t=None,
                x_scale_inv_t=None):
        needs = ((NEED_DGRAD if ctx.needs_input_grad[0] else 0)
                 | (NEED_WGRAD if ctx.needs_input_grad[1] else 0))
        scaling, align, is_delayed, override, _, x_kept, w_kept, _ = info(recipe_id, needs)
        ctx.given = x_data is not None
        if ctx.given:
            return _given_forward(ctx, needs, inp, weight, bias, scale_fwd, hist_fwd, scale_bwd,
                                  hist_bwd, recipe_id, group, is_delayed,
                                  (x_data, x_scale_inv, x_data_t, x_scale_inv_t, x_amax), dh)
        if override == "dequantized":  # its backward reads the members of x and W
            c_needs = KEEP_X_ROWWISE
            x_kept = info(recipe_id, c_needs)[5]
            n_x, n_w = sum(x_kept), sum(w_kept)
        else:  # packed: x's columnwise buffer (wgrad) and W's
            c_needs = (needs if override is None else 0) | PACKED
            n_x, n_w = (1 if c_needs & NEED_WGRAD else 0), 1
        if is_delayed and c_needs & PACKED:  # the module's history accumulated in place
            outs = torch.ops.tequant.linear_fwd_delayed(inp, weight, bias, recipe_id, c_needs,
                                                        scale_fwd, hist_fwd)
            x_members, w_members = outs[1:1 + n_x], outs[2:]
        else:
            outs = torch.ops.tequant.linear_fwd(inp, weight, bias, recipe_id, c_needs, scale_fwd,
                                                hist_fwd)
            x_members, w_members = outs[1:1 + n_x], outs[1 + n_x:1 + n_x + n_w]
            if is_delayed:
                _copy_in(hist_fwd, outs[-1])
        ctx.recipe_id, ctx.needs, ctx.override = recipe_id, needs, override
        delayed_ctx(ctx, recipe_id, group, is_delayed)
        ctx.n_x, ctx.shape = n_x, tuple(inp.shape)
        ctx.x_kept, ctx.w_kept, ctx.align = x_kept, w_kept, align
        ctx.x_dtype, ctx.w_dtype = inp.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if override == "high_precision":  # backward multiplies x and W themselves
            ctx.save_for_backward(inp, weight)
            return outs[0]
        ctx.save_for_backward(*x_members, *w_members,
                              *((scale_bwd, hist_bwd) if is_delayed else ()))
        return outs[0]

    @staticmethod
    def backward(ctx, dy, *dy_q):
        if ctx.given:
            return _given_backward(ctx, dy, dy_q)
        saved = ctx.saved_tensors
        needs, n_x = ctx.needs, ctx.n_x
        bias_dtype = ctx.bias_dtype if ctx.needs_input_grad[2] else None
        if ctx.override == "high_precision":
            inp, weight = saved
            dx, dw, db = _high_precision(dy, inp.reshape(-1, inp.shape[-1]), weight, needs,
                                         bias_dtype, ctx)
            return (dx, dw, db) + _NONE_ARGS
        if ctx.override == "dequantized":  # the dequantized forward operands, as in eager
            x2d, weight = _dequantized_operands(ctx, saved, dy.dtype)
            dx, dw, db = _high_precision(dy, x2d, weight, needs, bias_dtype, ctx)
            return (dx, dw, db) + _NONE_ARGS
        if ctx.is_delayed:
            scale_bwd, hist_bwd = saved[-2:]
            saved = saved[:-2]
        else:
            scale_bwd = hist_bwd = None
        x_kept = saved[0] if n_x else None
        if ctx.in_place_bwd:  # the module's buffers updated in place (or queued)
            dx, dw, db = torch.ops.tequant.linear_bwd_delayed(
                dy, x_kept, saved[n_x], ctx.recipe_id, op_needs(ctx, dy, scale_bwd, hist_bwd),
                list(ctx.shape), ctx.x_dtype, ctx.w_dtype, bias_dtype, scale_bwd, hist_bwd)
            return (dx if needs & NEED_DGRAD else None, dw if needs & NEED_WGRAD else None,
                    db if bias_dtype is not None else None) + _NONE_ARGS
        if _dy_given.splits_dy(ctx.recipe_id, dy, needs, bias_dtype, ctx.is_delayed):
            return _dy_given.split_dy_backward(dy, x_kept, saved[n_x], ctx.recipe_id,
                                             list(ctx.shape), ctx.x_dtype,
                                             ctx.w_dtype) + (None,) + _NONE_ARGS
        outs = torch.ops.tequant.linear_bwd(dy, x_kept, saved[n_x], ctx.recipe_id, needs,
                                            list(ctx.shape), ctx.x_dtype, ctx.w_dtype, bias_dtype,
                                            scale_bwd)
        return _grads(ctx, outs, bias_dtype, scale_bwd, hist_bwd)


def delayed_ctx(ctx, recipe_id, group, is_delayed):
    """A Function's DelayedScaling backward plan on ctx: whether its backward op updates the
    module (fused_update), or the name of the amax reduction group when the update waits for
    the end of the backward pass (group_name; Dynamo evaluates c10d's group lookups as
    constants: a process group itself is no op argument); in_place_bwd: either, i.e. the op
    takes the module's buffers."""
    ctx.group, ctx.is_delayed = group, is_delayed
    ctx.fused_update = is_delayed and _op_updates(recipe_id, group)
    ctx.group_name = None
    if is_delayed and _reduces(recipe_id, group):
        from torch.distributed import distributed_c10d as c10d
        ctx.group_name = c10d._resolve_group_name_by_ranks_and_tag(
            c10d.get_process_group_ranks(group), c10d._get_group_tag(group))
    ctx.in_place_bwd = ctx.fused_update or ctx.group_name is not None


def op_needs(ctx, grad, scale_bwd, hist_bwd):
    """The needs of an in-place backward op: ctx.needs, plus DEFER_UPDATE where the update waits
    for the end of the backward pass, after queueing the module's buffers for it. The queue op
    runs before the op that accumulates into them, so it reads the graph's own inputs (at run
    time the buffers themselves, whatever functionalization does with the op's mutation); it
    returns nothing and is kept as a side effect (_compile_ops.amax_defer_queue). grad: a
    gradient this backward received, which ties the queue op to the backward graph."""
    if ctx.group_name is None:
        return ctx.needs
    torch.ops.tequant.amax_defer_queue(grad, hist_bwd, scale_bwd, ctx.recipe_id, ctx.group_name)
    return ctx.needs | DEFER_UPDATE


def _op_hist(ctx, hist_bwd):
    """hist_bwd for a backward op that takes the module's buffers, else None (it returns dy's
    amax and _grads updates)."""
    return hist_bwd if ctx.in_place_bwd else None


def _copy_in(buffer, new):
    """buffer = new as one whole-tensor write (an in-place write through a view of a Function's
    input is not functionalized)."""
    with torch.no_grad():
        buffer.copy_(new)


def _grads(ctx, outs, bias_dtype, scale_bwd, hist_bwd):
    """_CompiledLinear.backward's result from a backward op's [dx?, dW?, db?, then amax dy where
    the op did not take the module's buffers (TE's unfused rule, no all-reduce)], after that
    DelayedScaling backward update of the module."""
    it = iter(outs)
    dx = next(it) if ctx.needs & NEED_DGRAD else None
    dw = next(it) if ctx.needs & NEED_WGRAD else None
    db = next(it) if bias_dtype is not None else None
    if ctx.is_delayed and not ctx.in_place_bwd:  # dy's amax with row 0, as the update's
        _apply_update((hist_bwd,), (scale_bwd,), ctx.recipe_id, delayed.BACKWARD,
                      torch.maximum(hist_bwd[0], next(it).view(-1)))
    return (dx, dw, db) + _NONE_ARGS


_NONE_ARGS = (None,) * 12  # _CompiledLinear's arguments after the bias


def _as_bytes(t):
    """t, or a uint8 view of it where it holds E8M0 exponents (the C side reads either)."""
    return t.view(torch.uint8) if t is not None and t.dtype == torch.float8_e8m0fnu else t


def _given_forward(ctx, needs, inp, weight, bias, scale_fwd, hist_fwd, scale_bwd, hist_bwd,
                   recipe_id, group, is_delayed, x, dh):
    """_CompiledLinear's forward for an x given quantized by the fused norm or activation
    (inp carries only the gradient): x = (data [padded rows, K], scale_inv, data_t,
    scale_inv_t, amax): per-tensor codes (data_t: the norm's transposed codes, None from the
    activation) with current scaling's amax (None for DelayedScaling: the norm's or
    activation's op put it into hist_fwd's x slot); or Float8BlockScaling's blocks (data_t
    given where wgrad needs it, no amax; MXFP8BlockScaling's alike). Backward keeps x's
    columnwise members (per-tensor: data_t, else the codes transposed here, as eager's
    with_columnwise) and W's packed buffer. dh: the activation
    writes dy's codes (_act_fn.GradOutput): (y, *placeholders)."""
    x_data, x_scale_inv, x_data_t, x_scale_inv_t, x_amax = x
    # MXFP8's E8M0 exponents enter the (mutating, so auto-functionalized) ops as uint8 views:
    # with float8_e8m0fnu arguments inductor's decompose_auto_functionalized pass (torch 2.11,
    # 2.13) leaves the node in place and fails ("auto_functionalized_v2 was not removed")
    x_scale_inv, x_scale_inv_t = _as_bytes(x_scale_inv), _as_bytes(x_scale_inv_t)
    members = [x_data, x_scale_inv, x_data_t, x_scale_inv_t, x_amax, None]
    outs = torch.ops.tequant.linear_fwd_given(members, list(inp.shape), inp.dtype, weight, bias,
                                              recipe_id, needs, scale_fwd, hist_fwd)
    x_kept = ()
    ctx.x_blocks = x_scale_inv_t is not None
    if needs & NEED_WGRAD:
        if x_data_t is None:  # per-tensor codes the norm's kernel did not transpose
            x_data_t = torch.ops.tequant.transpose_codes(x_data)
        x_kept = ((x_data_t, x_scale_inv_t) if ctx.x_blocks else
                  (x_data_t, x_scale_inv, x_amax))
    ctx.recipe_id, ctx.needs = recipe_id, needs
    delayed_ctx(ctx, recipe_id, group, is_delayed)
    ctx.shape, ctx.x_dtype, ctx.w_dtype = tuple(inp.shape), inp.dtype, weight.dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(*x_kept, outs[1], *((scale_bwd, hist_bwd) if is_delayed else ()))
    if dh is None:
        return outs[0]
    ctx.set_materialize_grads(False)  # tokens without gradients: dy is quantized here
    return (outs[0],) + _act_fn.placeholders(
        outs[0], dh, outs[0].shape[-1], ctx.bias_dtype if ctx.needs_input_grad[2] else None)


def _given_backward(ctx, dy, dy_q):
    saved = ctx.saved_tensors
    needs = ctx.needs
    x_members = [None] * 6
    if needs & NEED_WGRAD and ctx.x_blocks:
        x_members[2], x_members[3] = saved[:2]
        saved = saved[2:]
    elif needs & NEED_WGRAD:
        x_members[2], x_members[1], x_members[4] = saved[:3]
        saved = saved[3:]
        if x_members[4] is None:  # DelayedScaling's x: no GEMM reads its amax, which went
            x_members[4] = x_members[1]  # into the history; linear.c takes a [1, 1] float32
    scale_bwd = hist_bwd = None
    if ctx.is_delayed:
        scale_bwd, hist_bwd = saved[1:3]
    bias_dtype = ctx.bias_dtype if ctx.needs_input_grad[2] else None
    hist = _op_hist(ctx, hist_bwd)
    codes = dy_q and dy_q[0] is not None  # dy's codes, amax and dbias from the activation
    if hist is not None:
        needs = op_needs(ctx, dy_q[0] if codes else dy, scale_bwd, hist)
    if codes:
        codes_t = _dy_given.given_codes_t(dy_q)
        dx, dw = torch.ops.tequant.linear_bwd_dy_given(
            list(dy_q[:3]) + ([codes_t] if codes_t is not None else []), x_members, saved[0],
            ctx.recipe_id, needs, list(ctx.shape), ctx.x_dtype, ctx.w_dtype, scale_bwd, hist)
        outs = (dx, dw, dy_q[-1] if bias_dtype is not None else None,
                dy_q[2] if ctx.is_delayed and hist is None else None)
        return _grads(ctx, present(ctx, outs, bias_dtype), bias_dtype, scale_bwd, hist_bwd)
    outs = torch.ops.tequant.linear_bwd_given(dy, x_members, saved[0], ctx.recipe_id, needs,
                                              list(ctx.shape), ctx.x_dtype, ctx.w_dtype,
                                              bias_dtype, scale_bwd, hist)
    return _grads(ctx, present(ctx, outs, bias_dtype), bias_dtype, scale_bwd, hist_bwd)


def present(ctx, outs, bias_dtype):
    """A fixed-arity backward op's (dx, dW, db, amax dy) as _grads reads them: the outputs
    asked for, in order (an absent one is an empty placeholder); amax dy where the op did not
    take the module's buffers."""
    wanted = (ctx.needs & NEED_DGRAD, ctx.needs & NEED_WGRAD, bias_dtype is not None,
              ctx.is_delayed and not ctx.in_place_bwd)
    return [t for t, w in zip(outs, wanted) if w]


def _dequantized_operands(ctx, saved, dtype):
    """backward_override="dequantized": the rowwise x [rows, K] and W [N, K] the forward
    quantized, dequantized in dy's dtype (linear.py _high_precision_backward in eager)."""
    n_x = ctx.n_x
    x_six = list(_six(saved[:n_x], ctx.x_kept))
    w_six = list(_six(saved[n_x:n_x + sum(ctx.w_kept)], ctx.w_kept))
    k = ctx.shape[-1]
    rows = 1
    for d in ctx.shape[:-1]:
        rows *= d
    padded = _plan.padded(rows, ctx.align)
    n = w_six[0].shape[0]
    x2d = torch.ops.tequant.dequantize(x_six, ctx.recipe_id, "input", padded, k, ROWWISE, dtype)
    weight = torch.ops.tequant.dequantize(w_six, ctx.recipe_id, "weight", n, k, ROWWISE, dtype)
    return x2d[:rows], weight


def _high_precision(dy, x2d, weight, needs, bias_dtype, ctx):
    return _override.grads(dy.reshape(-1, dy.shape[-1]), x2d, weight, needs, bias_dtype,
                           ctx.shape, ctx.x_dtype, ctx.w_dtype)


def forward(module, inp, is_first_microbatch):
    """te.Linear.forward as Dynamo traces it (linear.py calls it while compiling). Tensor
    parallelism (te.Linear's own, or tequant's DTensor styles) wraps the local linear in
    functional collectives; its sequence-parallel all-gathers move high precision here (each
    rank then quantizes the whole tensor: the eager quantized gather's bits)."""
    weight, bias = module.weight, None if module.return_bias else module.bias
    tp = module._tp
    if tp is not None and (tp.size > 1 or is_dtensor(weight)):
        inp = _norm_fn.resolved(inp)  # (eager's rule: NormInput.fusable, linear.py _run)
    if tp is None:
        if is_dtensor(weight):
            raise NotImplementedError(
                "te.Linear parallelized with torch's ColwiseParallel / RowwiseParallel under "
                "torch.compile: use te.distributed.ColwiseParallel / RowwiseParallel (same "
                "arguments), which compile")
        return _local(module, inp, weight, bias, is_first_microbatch)
    row = tp.mode == "row" and tp.size > 1  # the bias after the reduction (one rank: in GEMM)
    if is_dtensor(weight):  # a tequant style: the parameters' local shards
        from torch.distributed.tensor import Partial
        weight = weight.to_local()
        if bias is not None:
            bias = bias.to_local(grad_placements=[Partial()] if tp.mode == "row"
                                 and tp.sequence_parallel else None)
    state = _compile.current()
    if state.enabled and not state.recipe.custom():
        _modules.check_tp_recipe(_modules.uid_of(module), state.recipe_id)
    out = tp.linear_hp(inp, lambda x: _local(module, x, weight, None if row else bias,
                                             is_first_microbatch))
    return out + bias.to(out.dtype) if row and bias is not None else out


def _local(module, inp, weight, bias, is_first_microbatch):
    """The linear on this rank's tensors (all of a non-parallel layer's)."""
    if _checkpoint.STATEFUL_REPLAY:
        raise RuntimeError(_checkpoint.STATEFUL_REPLAY_ERROR)
    state = _compile.current()
    recipe_id = state.recipe_id
    norm_in = None  # a NormInput / ActInput whose norm / activation writes x's codes
    if type(inp) is NormInput or type(inp) is ActInput:
        if state.enabled and not state.recipe.custom() and inp.fusable(
                info(recipe_id, 0)[0], info(recipe_id, 0)[3], module._tp,
                _act_blocks(recipe_id)):
            norm_in = inp
        else:
            inp = inp.high_precision()
    if not state.enabled:
        if state.calibrating and not state.recipe.custom() and info(recipe_id, 0)[2]:
            delayed.calibrate(module, info(recipe_id, 0)[4], inp)
        return F.linear(inp, weight, bias)
    if is_first_microbatch is not None:
        raise NotImplementedError("te.Linear(is_first_microbatch=...) caches the quantized weight "
                                  "between calls, which torch.compile does not trace; pass None "
                                  "(the default) inside compiled code")
    gathered = _gathered.traceable(weight)
    if gathered or quantized_weight(weight) is not None:
        # FSDP2 gathered W in the recipe's format (distributed/fsdp.py). Per-tensor FP8 (a
        # TraceableGatheredWeight): traced, its members multiplied by _compile_gathered's
        # Function. Other formats: its members are assembled in Python when first read, which
        # Dynamo cannot trace, so this layer runs eagerly (a graph break; fullgraph=True
        # refuses it). Both with eager's bits (but a fused norm's: its output in high precision,
        # then te.Linear's own quantization).
        inp, norm_in = _norm_fn.resolved(inp), None
        if not gathered:
            return _eager_local(module, inp, weight, bias)
        _gathered.check_recipe(weight, recipe_id)
    n, k = weight.shape
    if inp.shape[-1] != k:
        raise ValueError(f"input has {inp.shape[-1]} features in its last dim; this Linear "
                         f"takes {k}")
    if norm_in is None and torch.is_autocast_enabled(inp.device.type):
        inp = inp.to(torch.get_autocast_dtype(inp.device.type))
    if state.recipe.custom():
        return _custom_linear.apply(inp, weight, bias,
                                    _custom_linear.quantizers(module, state.recipe))
    scaling, align, is_delayed, _, history_len, _, _, _ = info(recipe_id, 0)
    if is_delayed and _checkpoint.REPLAYING:  # a DelayedScaling autocast inside the region
        raise RuntimeError(_checkpoint.STATEFUL_REPLAY_ERROR)
    for name, dim, local in (("in_features", module.in_features, k),
                             ("out_features", module.out_features, n)):
        if local % align:
            shard = f" (this rank's {local} of {dim})" if local != dim else ""
            raise ValueError(f"{name}={dim}{shard} must be a multiple of {align} for {scaling} "
                             "scaling (te.Linear inside te.autocast)")
    scale_fwd = hist_fwd = scale_bwd = hist_bwd = None
    if is_delayed and _in_checkpoint():
        # DelayedScaling inside torch.utils.checkpoint: AOTAutograd's recompute would read the
        # forward scales after the autocast's exit has updated them in place (other gradients
        # than without checkpointing). A graph break runs this checkpointed region eagerly,
        # where tequant/checkpoint.py replays the scales the forward used; with
        # fullgraph=True it is an error.
        torch._dynamo.graph_break()
    if is_delayed:
        _modules.ensure_buffers(_modules.uid_of(module), history_len)
        scale_fwd, hist_fwd = module.delayed_scale_fwd, module.delayed_amax_history_fwd
        scale_bwd, hist_bwd = module.delayed_scale_bwd, module.delayed_amax_history_bwd
        if torch.is_grad_enabled():
            _register_delayed(module, state, hist_fwd, scale_fwd, recipe_id)
    group = state.group if is_delayed else None
    if gathered:
        return _gathered.GatheredLinear.apply(inp, weight, bias, scale_fwd, hist_fwd, scale_bwd,
                                              hist_bwd, recipe_id, group)
    if norm_in is not None:  # x's codes from the norm (DelayedScaling: its amax into hist_fwd)
        carrier, x = norm_in.fused(recipe_id, align, scale_fwd, hist_fwd,
                                   columnwise=torch.is_grad_enabled() and weight.requires_grad)
        dh = None  # LayerNormMLP's fc1: dy's codes from the activation's backward (eager's rule)
        if type(norm_in) is NormInput and norm_in.grad_output is not None \
                and torch.is_grad_enabled():
            dh = norm_in.grad_output.ask(recipe_id, x[0].shape[0],
                                         (scale_bwd[0:1], None) if is_delayed else (None, None),
                                         delayed=is_delayed, columnwise=weight.requires_grad)
        out = _CompiledLinear.apply(carrier, weight, bias, scale_fwd, hist_fwd, scale_bwd,
                                    hist_bwd, recipe_id, group, x[0], x[1], x[4], dh, x[2], x[3])
        return out if dh is None else norm_in.grad_output.received(out)
    return _CompiledLinear.apply(inp, weight, bias, scale_fwd, hist_fwd, scale_bwd,
                                 hist_bwd, recipe_id, group)


@_compile.constant
def _in_checkpoint():
    """True while Dynamo traces the body of a torch.utils.checkpoint call (its higher-order
    op's subgraph tracer; tracers from torch 2.11 on carry that description); False outside
    tracing."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tracer = InstructionTranslator.current_tx().output.current_tracer
    except Exception:  # not tracing: an eager call of this function
        return False
    while tracer is not None:
        if str(getattr(tracer, "description", None)).startswith("torch.utils.checkpoint"):
            return True
        tracer = tracer.parent
    return False


def _register_delayed(module, state, hist_fwd, scale_fwd, recipe_id):
    root = state.root
    if root is None:  # Dynamo replays this store after the graph, on every call
        _C._live.delayed = _C._live.delayed + (hist_fwd, scale_fwd, recipe_id)
        return
    for entry in root.delayed:
        if entry[0] is module:
            raise NotImplementedError(
                "under torch.compile a DelayedScaling te.Linear can run once per te.autocast "
                "(eager updates a repeated module once, after all its uses)")
    root.delayed.append((module, hist_fwd, scale_fwd, recipe_id, state.group))


_gathered = None  # _compile_gathered, once imported (linear.py imports it; it imports this module)


def register_gathered(module):
    """_compile_gathered registers itself: the Function of a traced FSDP2-gathered weight."""
    global _gathered
    _gathered = module
