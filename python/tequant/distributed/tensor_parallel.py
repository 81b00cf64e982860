"""Tensor and sequence parallelism inside te.Linear, with TransformerEngine's parallel_mode.

te.Linear(in_features, out_features, ..., tp_group, tp_size, parallel_mode, sequence_parallel)
takes the global sizes and holds its rank's shard (shared/docs/DISTRIBUTED.md 3):
- "column": W [out/tp, in], bias [out/tp]; the output is this rank's slice of the features. The
  input is the whole input, or, with sequence_parallel, this rank's tokens (split along the
  sequence dim, 0 for TE's [s, b, h]; the DTensor styles may pick another), all-gathered first;
  backward all-reduces the input gradient (reduce-scatters it along the sequence dim).
- "row": W [out, in/tp], bias [out]; the input is this rank's slice of the features; the output
  partial sums are all-reduced (reduce-scattered along the sequence dim with sequence_parallel)
  and the bias is added once, after; with sequence_parallel backward all-gathers the output
  gradient.
The all-gathers of sequence parallelism move the recipe's codes and scales: each rank quantizes
its tokens with the whole tensor's per-tensor scale (the amaxes all-reduced (MAX) over tp_group
first; DelayedScaling casts with the module's scale and records the gathered tensor's amax), so
the gathered operand is te.ops.quantize of the whole one, bit for bit (gather_layout.py), and
te.Linear multiplies it as it is. They move high precision where a shard would cut the format's
blocks, for NVFP4 gradients rounded stochastically (a shard cannot draw the whole tensor's bits),
and outside te.autocast; those are counted in `fallbacks`. A row-parallel bias under
sequence_parallel gets the gradient of this rank's tokens, as in TransformerEngine: its
`sequence_parallel` attribute is set, and reduce_sequence_parallel_grads sums such gradients
over the group. Tests: tests/test_tensor_parallel.py.
"""
import collections
import hashlib
import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from .. import _C, ops
from .._operands import TQ_DTYPE
from ..quantized import COLUMNWISE, ROWWISE
from . import gather_layout

__all__ = ["TensorParallel", "reduce_sequence_parallel_grads", "fallbacks"]

fallbacks = collections.Counter()  # reason -> all-gathers of SP that went in high precision
_ROLES = {"input": "x", "grad_output": "dy"}


class TensorParallel:
    """A te.Linear's tensor-parallel setting and the collectives around its C calls (the hooks
    linear._QuantizedLinear calls: gather_input, reduce_output, gather_grad_output,
    reduce_grad_input). A group of one rank has nothing to exchange: its hooks pass tensors
    through (as TransformerEngine's collectives do)."""

    __slots__ = ("group", "size", "mode", "sequence_parallel", "dim", "checked", "dtensor",
                 "overlap")

    def __init__(self, group, size, mode, sequence_parallel, dim=0, overlap=False):
        self.group, self.size, self.mode = group, size, mode
        self.sequence_parallel = sequence_parallel
        self.dim = dim  # the sequence dim sequence parallelism splits (0: TE's [s, b, h])
        self.checked = set()  # recipe keys whose agreement across the group was checked
        self.dtensor = False  # set by tequant's DTensor styles (dtensor.py): DTensor parameters
        self.overlap = overlap  # te.Linear's tp_comm_overlap

    def __deepcopy__(self, memo):
        """A copied te.Linear shares the process group (a communicator is not copied)."""
        tp = TensorParallel(self.group, self.size, self.mode, self.sequence_parallel, self.dim,
                            self.overlap)
        tp.checked, tp.dtensor = set(self.checked), self.dtensor
        return tp

    def __reduce__(self):
        raise TypeError("a tensor-parallel te.Linear holds its process group, which cannot be "
                        "pickled: save the model's state_dict (torch.distributed.checkpoint for "
                        "DTensor parameters) and build the model again on load")

    @staticmethod
    def make(in_features, out_features, tp_group, tp_size, parallel_mode, sequence_parallel,
             overlap=False):
        """The setting, validated, or None without tensor parallelism; and the shard's
        (in, out)."""
        if not isinstance(overlap, bool):
            raise TypeError(f"tp_comm_overlap must be a bool, got {type(overlap).__name__}")
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"parallel_mode must be None, 'column' or 'row', got "
                             f"{parallel_mode!r}")
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool, got "
                            f"{type(sequence_parallel).__name__}")
        if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
            raise TypeError(f"tp_group must be a torch.distributed.ProcessGroup (or None), got "
                            f"{type(tp_group).__name__}")
        if tp_group is not None:
            size = dist.get_world_size(tp_group)
            if tp_size not in (1, size):
                raise ValueError(f"tp_size={tp_size} but tp_group has {size} ranks")
        else:
            size = tp_size
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
            if size > 1:
                raise ValueError(f"tp_size={size} needs tp_group, the tensor-parallel group")
        if sequence_parallel and (tp_group is None or parallel_mode is None):
            raise ValueError("sequence_parallel=True needs tp_group and parallel_mode "
                             "('column' or 'row')")
        if parallel_mode is None:
            return None, in_features, out_features
        dims = {"column": ("out_features", out_features), "row": ("in_features", in_features)}
        name, dim = dims[parallel_mode]
        if dim % size:
            raise ValueError(f"{name}={dim} is not divisible by the {size} ranks of the "
                             f"tensor-parallel group ({parallel_mode} parallel splits it)")
        tp = TensorParallel(tp_group, size, parallel_mode, bool(sequence_parallel), 0, overlap)
        if parallel_mode == "column":
            return tp, in_features, out_features // size
        return tp, in_features // size, out_features

    # ---- the recipe every rank runs ---------------------------------------------------------

    def check_recipe(self, recipe, key):
        """Once per recipe: every rank of the group runs the same one (a one-element all-reduce
        of its fingerprint, MIN and MAX; a mismatch raises on every rank, no rank hangs)."""
        if key in self.checked or self.group is None or self.size == 1:
            return
        digest = hashlib.sha256(repr(recipe).encode()).digest()
        value = int.from_bytes(digest[:7], "little")
        both = torch.tensor([value, -value], dtype=torch.int64, device=_device(self.group))
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if int(both[0]) != value or int(both[1]) != -value:
            raise RuntimeError(f"the ranks of this te.Linear's tensor-parallel group run different "
                               f"recipes (this rank: {recipe!r}); every rank must enter "
                               "te.autocast with an equal recipe")
        self.checked.add(key)

    # ---- high precision (no te.autocast, CustomRecipe) --------------------------------------

    def linear_hp(self, inp, linear, weight=None, bias=None):
        """linear(x) -> y of one rank with this setting's collectives as autograd Functions.
        Given the weight and bias of a plain F.linear, a column-parallel layer with
        tp_comm_overlap overlaps its input gradient's reduction with the wgrad product, as the
        quantized path does (not under torch.autocast, whose casts F.linear's autograd owns)."""
        if self.size == 1:
            return linear(inp)
        if self.mode == "column" and weight is not None and self.overlap and not self.dtensor \
                and not torch.compiler.is_compiling() \
                and not torch.is_autocast_enabled(inp.device.type):
            return _ColumnLinear.apply(inp, weight, bias, self)
        if self.mode == "column":
            x = (_GatherTokens.apply(inp, self.group, self.dim) if self.sequence_parallel
                 else _ReduceGrad.apply(inp, self.group, 0))
            return linear(x)
        y = linear(inp)
        return (_ScatterTokens.apply(y, self.group, self.dim) if self.sequence_parallel
                else _ReduceOutput.apply(y, self.group, 0))

    # ---- hooks of the quantized Function ----------------------------------------------------

    def gather_input(self, inp, plan, states, needs_wgrad, quantized):
        """Column, sequence parallel: the whole input from this rank's tokens, quantized
        ((members, shape, dtype) for C) or in high precision where it cannot be (or where the
        recipe's backward_override reads it, quantized=False)."""
        if self.mode != "column" or not self.sequence_parallel or self.size == 1:
            return inp
        if not quantized:
            return _gather_tokens(inp, self.group, self.dim)
        usage = ROWWISE | (COLUMNWISE if needs_wgrad else 0)
        state = states[0] if states else None
        return _gather_quantized(inp, plan, "input", usage, self, state)

    def reduce_output(self, out):
        if self.mode != "row" or self.size == 1:
            return out
        return _scatter_tokens(out, self.group, self.dim) if self.sequence_parallel else \
            _all_reduce(out, self.group)

    def gather_grad_output(self, dy, plan, state, needs, quantized):
        """Row, sequence parallel: the whole output gradient from this rank's tokens (needs:
        linear.c's bits, 1 dgrad, 2 wgrad)."""
        if self.mode != "row" or not self.sequence_parallel or self.size == 1:
            return dy
        usage = (ROWWISE if needs & 1 else 0) | (COLUMNWISE if needs & 2 else 0)
        if not usage or not quantized:
            return _gather_tokens(dy, self.group, self.dim)
        return _gather_quantized(dy, plan, "grad_output", usage, self, state)

    def reduce_grad_input(self, dx):
        if type(dx) is _Reducing:  # started by start_grad_input_reduction
            return dx.wait()
        if self.mode != "column" or dx is None or self.size == 1:
            return dx
        return _scatter_tokens(dx, self.group, self.dim) if self.sequence_parallel else \
            _all_reduce(dx, self.group)

    def grad_input_overlap(self, wgrad):
        """What linear_backward calls on dx between its dgrad and wgrad GEMMs
        (start_grad_input_reduction: the reduction then runs beside the wgrad GEMM, as
        TransformerEngine's bulk dgrad overlap), or None where nothing overlaps it (no wgrad,
        tp_comm_overlap=False, or inside a compiled graph, whose collectives are functional)."""
        if not self.overlap or not wgrad or self.mode != "column" or self.size == 1 \
                or torch.compiler.is_compiling():
            return None
        return self.start_grad_input_reduction

    def start_grad_input_reduction(self, dx):
        """dx's reduce-scatter (sequence parallel) or all-reduce, started on the collective's
        stream; reduce_grad_input waits for it."""
        if self.sequence_parallel:
            return _Reducing(*_scatter_tokens(dx, self.group, self.dim, async_op=True))
        dx = dx.contiguous()
        return _Reducing(dx, dist.all_reduce(dx, group=self.group, async_op=True))


class _Reducing:
    """A collective in flight: its output and its work handle."""
    __slots__ = ("out", "work")

    def __init__(self, out, work):
        self.out, self.work = out, work

    def wait(self):
        self.work.wait()  # the current stream waits for the collective's
        return self.out


def _device(group):
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else \
        torch.device("cpu")


# ---- collectives along the sequence dim (tokens) ----------------------------------------------

# Under torch.compile the collectives are functional collectives (traceable ops that return new
# tensors); eager code calls the in-place c10d ones, cheaper on the host.

def _all_reduce(t, group):
    if torch.compiler.is_compiling():
        return funcol.all_reduce(t, "sum", group)
    t = t.contiguous()
    dist.all_reduce(t, group=group)
    return t


def _gather_tokens(t, group, dim=0):
    """The ranks' t concatenated along dim (one copy besides the gather where dim > 0)."""
    t, dim = t.contiguous(), dim % t.dim()
    size = dist.get_world_size(group)
    if torch.compiler.is_compiling():  # along dim 0: torch 2.11's funcol cannot trace others
        out = funcol.all_gather_tensor(t, 0, group)
    else:
        out = t.new_empty((size * t.shape[0],) + tuple(t.shape[1:]))
        dist.all_gather_into_tensor(out, t, group=group)
    if dim == 0:
        return out
    shape = t.shape[:dim] + (size * t.shape[dim],) + t.shape[dim + 1:]
    return out.view((size,) + tuple(t.shape)).movedim(0, dim).reshape(shape)


def _scatter_tokens(t, group, dim=0, async_op=False):
    """The sum over the ranks of t, split along dim: this rank's part ((part, work) with
    async_op)."""
    size, dim = dist.get_world_size(group), dim % t.dim()
    if t.shape[dim] % size:
        raise ValueError(f"sequence parallelism splits dim {dim} of a {list(t.shape)} tensor "
                         f"over {size} ranks: it must be a multiple of {size}")
    part = t.shape[:dim] + (t.shape[dim] // size,) + t.shape[dim + 1:]
    stacked = t.reshape(t.shape[:dim] + (size, t.shape[dim] // size) + t.shape[dim + 1:])
    stacked = stacked.movedim(dim, 0).contiguous()  # the ranks' parts, stacked
    stacked = stacked.view((size * part[0],) + part[1:])
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(stacked, "sum", 0, group)
    out = t.new_empty(part)
    work = dist.reduce_scatter_tensor(out, stacked, group=group, async_op=async_op)
    return (out, work) if async_op else out


def _mirrored(name, forward_op, backward_op):
    """An autograd Function running forward_op(t, group, dim) and, on the gradient,
    backward_op(grad, group, dim) (a collective and its transpose)."""
    def forward(ctx, t, group, dim):
        ctx.group, ctx.dim = group, dim
        return forward_op(t, group, dim)

    def backward(ctx, grad):
        return backward_op(grad, ctx.group, ctx.dim), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                     "backward": staticmethod(backward)})


def _identity(t, group, dim):
    return t.view_as(t)


def _reduced_copy(t, group, dim):
    return _all_reduce(t.clone(), group)


# column parallel: the input gradient is summed over the ranks; row: the output
_ReduceGrad = _mirrored("_ReduceGrad", _identity, _reduced_copy)
_ReduceOutput = _mirrored("_ReduceOutput", _reduced_copy, _identity)
# sequence parallel: tokens gathered before a column layer, scattered after a row layer
_GatherTokens = _mirrored("_GatherTokens", _gather_tokens, _scatter_tokens)
_ScatterTokens = _mirrored("_ScatterTokens", _scatter_tokens, _gather_tokens)


class _ColumnLinear(torch.autograd.Function):
    """A column-parallel F.linear (the tokens all-gathered first under sequence parallelism)
    whose backward starts the input gradient's reduction between the dgrad and wgrad products."""

    @staticmethod
    def forward(ctx, inp, weight, bias, tp):
        x = _gather_tokens(inp, tp.group, tp.dim) if tp.sequence_parallel else inp
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.has_bias = tp, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = ctx.tp.start_grad_input_reduction(dy.matmul(weight))
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = dy2.t().matmul(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return None if dx is None else dx.wait(), dw, db, None


# ---- the quantized all-gather --------------------------------------------------------------------

def _fallback(config, rows, run, plan):
    """Why this rank's `rows` tokens, in runs of `run` consecutive ones along the sequence dim,
    cannot travel quantized (None: they can)."""
    if config.stochastic_rounding:
        return ("NVFP4's stochastic rounding of a shard cannot draw the whole tensor's bits "
                "(gathered in high precision, then rounded)")
    if rows % plan.align:
        return f"{rows} tokens per rank are not a multiple of the format's {plan.align}"
    block = gather_layout.block_rows(config)
    if run % block:
        return (f"runs of {run} tokens per rank along the sequence dim would cut the format's "
                f"{block}-token blocks")
    return None


def _gather_quantized(t, plan, role, usage, tp, state):
    """t [..., s, ..., K] of this rank -> the whole [..., size * s, ..., K] along tp.dim,
    quantized with the whole tensor's factors as (members, shape, tq dtype); or gathered in high
    precision (counted) where it cannot be. state: DelayedScaling's (scale, amax slot)."""
    config = getattr(plan, _ROLES[role])
    t = t.contiguous()
    group, size, dim = tp.group, tp.size, tp.dim % t.dim()
    x = t.reshape(-1, t.shape[-1])
    outer = math.prod(t.shape[:dim])  # runs of consecutive tokens per rank
    reason = _fallback(config, x.shape[0], x.shape[0] // outer, plan)
    if reason is not None:
        fallbacks[reason] += 1
        return _gather_tokens(t, group, dim)
    extra = _factors(x, plan.recipe, role, config, usage, group, state)
    per_tensor = config.scaling in gather_layout.PER_TENSOR
    # per-tensor formats gather the rowwise codes and derive the columnwise ones from them
    members = ops.quantize(x, plan.recipe, role, rowwise=bool(usage & ROWWISE) or per_tensor,
                           columnwise=bool(usage & COLUMNWISE) and not per_tensor,
                           **extra)._member_tuple
    gathered_usage = ROWWISE if per_tensor else usage
    outputs = []
    for inp in gather_layout.shard_inputs(members, config, gathered_usage):
        out = inp.new_empty((size * inp.shape[0],) + tuple(inp.shape[1:]))
        dist.all_gather_into_tensor(out, inp.contiguous(), group=group)
        outputs.append(out)
    rows = size * x.shape[0]
    dtypes = [m[2] if m else None for m in _C._quantize_layout(config, rows, x.shape[1], 3)[:4]]
    factors = ((members[1], members[4]) if config.scaling in gather_layout.PER_TENSOR
               else (members[4], members[5]) if config.scaling == "nvfp4" else None)
    whole = gather_layout.assemble(config, outputs, gathered_usage, rows, size, dtypes, factors)
    if outer > 1:
        whole = gather_layout.interleave(config, whole, size, outer)
    if usage & COLUMNWISE and config.scaling in gather_layout.PER_TENSOR:
        whole = gather_layout.derive_columnwise(config, whole, rows, x.shape[1])
    shape = t.shape[:dim] + (size * t.shape[dim],) + t.shape[dim + 1:]
    return tuple(whole), shape, TQ_DTYPE[t.dtype]


def _factors(x, recipe, role, config, usage, group, state):
    """te.ops.quantize's scale (DelayedScaling: the module's; the gathered tensor's amax, the
    shards' all-reduced, is recorded in its history slot) or amax (current scaling; NVFP4 with
    its transformed columnwise one) of the whole tensor, for this shard."""
    scaling = config.scaling
    if scaling not in ("delayed", "current", "nvfp4"):
        return {}
    local = torch.zeros(2, dtype=torch.float32, device=x.device)
    _C._amax(x, local[0:1])
    if scaling == "nvfp4" and config.rht and usage & COLUMNWISE:  # the transformed values' amax
        local[1] = ops.quantize(x, recipe, role, rowwise=False, columnwise=True).amax_t.view(())
    else:
        local[1] = local[0]
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    if scaling == "delayed":
        scale, slot = state
        with torch.no_grad():
            slot.copy_(torch.maximum(slot, local[0:1]))
        return {"scale": scale}
    return {"amax": local if scaling == "nvfp4" else local[0:1]}


def reduce_sequence_parallel_grads(model, group):
    """Sums over `group` the gradients of the row-parallel te.Linear biases under sequence
    parallelism (each rank's holds its tokens' part) and of any parameter whose
    `sequence_parallel` attribute is set, as Megatron-LM does for TransformerEngine's modules.
    Call it between backward and the optimizer step. The biases and the sequence-parallel norms'
    parameters are found through their modules too (FSDP2 replaces parameter objects, and their
    attributes with them)."""
    from ..linear import Linear
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"reduce_sequence_parallel_grads takes a torch.nn.Module, got "
                        f"{type(model).__name__}")
    params = {id(p): p for p in model.parameters() if getattr(p, "sequence_parallel", False)}
    for module in model.modules():
        for name in getattr(module, "_sequence_parallel_params", ()):
            p = getattr(module, name)
            params[id(p)] = p
        tp = getattr(module, "_tp", None) if isinstance(module, Linear) else None
        if tp is not None and tp.mode == "row" and tp.sequence_parallel and not tp.dtensor \
                and module.bias is not None:  # (a DTensor style's bias has a Partial gradient)
            params[id(module.bias)] = module.bias
    grads = [p.grad for p in params.values() if p.grad is not None]
    # FSDP2's gradients are DTensors: their local tensors (views) are what this rank holds
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
