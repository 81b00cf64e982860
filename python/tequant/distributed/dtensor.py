"""te.Linear with DTensor parameters: torch's tensor-parallel styles and tequant's own.

torch's ColwiseParallel / RowwiseParallel / SequenceParallel (parallelize_module) leave DTensor
parameters and inputs; te.Linear runs them as nn.Linear would, on each rank's local tensors
(`run`): column (W Shard(0)) multiplies the replicated input by its rows of W and returns
Shard(-1); row (W Shard(1)) multiplies the input's feature shard and returns Partial sums, plus
the replicated bias as a DTensor add; a replicated W keeps the input's placement (its gradient
Partial where the input is sharded, as torch gives SequenceParallel's parameters). Their
collectives are DTensor's, in high precision: the sequence-parallel all-gather before a column
layer moves bf16 and each rank then quantizes the whole input.

tequant's ColwiseParallel / RowwiseParallel (same arguments as torch's) are the quantized path,
the DTensor face of te.Linear's own tensor parallelism (tensor_parallel.py, TE's parallel_mode):
the style gives the module a TensorParallel on the mesh's group, its hooks hand te.Linear plain
local tensors, and te.Linear's collectives run around its C calls, so sequence parallelism moves
codes + scales (amaxes all-reduced over the group first). ColwiseParallel(input_layouts=Shard(d))
turns on sequence parallelism along d; RowwiseParallel(output_layouts=Shard(d)) likewise. The
parameters stay DTensors (FSDP2 on a 2-D mesh and distributed checkpoints see torch's layout);
a row-parallel bias under sequence parallelism gets a Partial gradient, as torch's styles give.
Tests: tests/test_dtensor_parallel.py.
"""
from functools import partial

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor import parallel as _torch_styles

from .. import _C
from .tensor_parallel import TensorParallel

__all__ = ["ColwiseParallel", "RowwiseParallel", "run"]


def _contiguous_stride(shape):
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= n
    return tuple(reversed(stride))


def _wrap(y, mesh, placement, shape):
    shape = torch.Size(shape)
    return DTensor.from_local(y, mesh, [placement], run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))


def _is_last(placement, ndim):
    return placement.is_shard() and placement.dim % ndim == ndim - 1


def run(module, inp, weight, bias, local):
    """te.Linear's forward with a DTensor weight; local(x, w, b) -> y runs it on this rank's
    tensors (te.Linear._local: quantized inside te.autocast, with the module's own tensor
    parallelism when a tequant style set it)."""
    mesh = weight.device_mesh
    name = type(module).__name__
    if mesh.ndim != 1:
        raise ValueError(f"{name}'s weight is a DTensor on a {mesh.ndim}-D mesh; te.Linear "
                         "runs tensor parallelism on a 1-D mesh (FSDP2 shards the other dim)")
    if module._tp is not None:  # a tequant style: its hooks gave a local input
        if isinstance(inp, DTensor):
            raise TypeError(f"{name} was parallelized with a tequant style, whose hook makes the "
                            "input local; it got a DTensor (call the module, not forward)")
        partial_bias = module._tp.mode == "row" and module._tp.sequence_parallel
        w, b = _LocalParameters.apply(weight, bias, _grad_spec(module, bias, partial_bias))
        return local(inp, w, b)
    if not isinstance(inp, DTensor) or inp.device_mesh != mesh:
        raise TypeError(f"{name}'s weight is a DTensor on {mesh}; its input must be a DTensor on "
                        f"the same mesh (parallelize_module's styles make it one), got "
                        f"{type(inp).__name__}")
    if _C.is_fp8_enabled() and not _C.get_fp8_recipe().custom():  # this rank's W's dims
        module._check_plan(module._plan(_C.get_fp8_recipe()), tuple(weight._local_tensor.shape))
    placement, ndim = weight.placements[0], inp.dim()
    if placement.is_shard() and placement.dim % 2 == 0:  # column: rows of W
        x = inp if inp.placements[0].is_replicate() else inp.redistribute(
            placements=[Replicate()])
        y = local(x.to_local(grad_placements=[Partial()]), weight.to_local(),
                  None if bias is None else bias.to_local())
        return _wrap(y, mesh, Shard(ndim - 1), tuple(inp.shape[:-1]) + (weight.shape[0],))
    if placement.is_shard():  # row: columns of W; the bias is added to the reduced sums
        x = inp if _is_last(inp.placements[0], ndim) else inp.redistribute(
            placements=[Shard(ndim - 1)])
        y = _wrap(local(x.to_local(), weight.to_local(), None), mesh, Partial(),
                  tuple(inp.shape[:-1]) + (weight.shape[0],))
        return y if bias is None else y + bias
    if placement.is_replicate():  # SequenceParallel's replicated W
        at = inp.placements[0]
        if at.is_partial() or _is_last(at, ndim):
            raise ValueError(f"{name} has a replicated weight; its input must be replicated or "
                             f"sharded along a token dim, got {at}")
        grad = [Partial()] if at.is_shard() else None
        y = local(inp.to_local(), weight.to_local(grad_placements=grad),
                  None if bias is None else bias.to_local(grad_placements=grad))
        return _wrap(y, mesh, at, tuple(inp.shape[:-1]) + (weight.shape[0],))
    raise ValueError(f"{name}'s weight has placement {placement}; te.Linear runs Shard(0) "
                     "(ColwiseParallel), Shard(1) (RowwiseParallel) or Replicate()")


class _LocalParameters(torch.autograd.Function):
    """(W, b) DTensors -> their local tensors; backward wraps the local gradients as DTensors
    of the parameters' layout (b's: bias_spec). What to_local does for each, in one node, and
    without to_local's from_local in backward (most of a tequant-style call's host overhead)."""

    @staticmethod
    def forward(ctx, weight, bias, bias_spec):
        ctx.specs = (weight._spec, bias_spec)
        w = weight._local_tensor.view_as(weight._local_tensor)  # a fresh tensor for autograd
        b = None if bias is None else bias._local_tensor.view_as(bias._local_tensor)
        return w, b

    @staticmethod
    def backward(ctx, dw, db):
        w_spec, b_spec = ctx.specs
        return (None if dw is None else DTensor(dw, w_spec, requires_grad=False),
                None if db is None else DTensor(db, b_spec, requires_grad=False), None)


def _grad_spec(module, bias, partial):
    """The layout of b's gradient: b's own, or Partial (a row-parallel bias under sequence
    parallelism: each rank's tokens' part), made once per bias."""
    if bias is None or not partial:
        return None if bias is None else bias._spec
    cached = module.__dict__.get("_tq_bias_grad_spec")
    if cached is None or cached[0] is not bias._spec:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        spec = DTensorSpec(bias._spec.mesh, (Partial(),), tensor_meta=bias._spec.tensor_meta)
        cached = module.__dict__["_tq_bias_grad_spec"] = (bias._spec, spec)
    return cached[1]


# ---- tequant's styles --------------------------------------------------------------------------

def _sequence_dim(placement, what, style):
    """None for Replicate(); d for Shard(d) along a token dim; errors otherwise."""
    if placement.is_replicate():
        return None
    if placement.is_shard() and placement.dim != -1:
        return placement.dim
    raise ValueError(f"te.distributed.{style}: {what} must be Replicate() or Shard(d) along a "
                     f"token dim (sequence parallelism), got {placement}")


def _setup(module, mesh, mode, dim, style):
    """The module's TensorParallel on the mesh's group (checked like te.Linear's arguments)."""
    from ..linear import Linear
    if not isinstance(module, Linear):
        raise TypeError(f"te.distributed.{style} parallelizes te.Linear, got "
                        f"{type(module).__name__} (torch's {style} handles torch.nn modules)")
    if mesh.ndim != 1:
        raise ValueError(f"te.distributed.{style} needs a 1-D mesh (the tensor-parallel dim, "
                         f"e.g. mesh['tp']), got a {mesh.ndim}-D one")
    if module._tp is not None or isinstance(module.weight, DTensor):
        raise ValueError(f"te.distributed.{style}: this te.Linear is already tensor parallel")
    group = mesh.get_group()
    tp = TensorParallel.make(module.in_features, module.out_features, group, 1, mode,
                             dim is not None)[0]
    tp.dtensor = True
    if dim is not None:
        tp.dim = dim
    module._tp = tp  # also te.Linear's tp_group, tp_size, parallel_mode, sequence_parallel
    return tp


def _first(inputs, fn):
    return (fn(inputs[0]),) + tuple(inputs[1:])


def _output(out, fn):
    return (fn(out[0]),) + tuple(out[1:]) if isinstance(out, tuple) else fn(out)


class ColwiseParallel(_torch_styles.ColwiseParallel):
    """torch's ColwiseParallel for te.Linear with te.Linear's own collectives: input_layouts
    Shard(d) (d a token dim) all-gathers the input quantized (codes + scales) instead of in
    high precision. Same arguments as torch's."""

    def _apply(self, module, device_mesh):
        dim = _sequence_dim(self.input_layouts[0], "input_layouts", "ColwiseParallel")
        _setup(module, device_mesh, "column", dim, "ColwiseParallel")
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(_column_input, self.input_layouts[0]),
            partial(_column_output, self.output_layouts[0], self.use_local_output))


def _column_input(layout, module, inputs, mesh):
    def local(x):
        if isinstance(x, DTensor):
            if x.placements[0] != layout:
                x = x.redistribute(placements=[layout])
            size = mesh.size()
            if isinstance(layout, Shard) and x.shape[layout.dim] % size:
                # ranks with unequal token shards: the sequence-parallel gathers would differ
                # in size (gloo aborts the process, NCCL would hang)
                raise ValueError(
                    f"ColwiseParallel(input_layouts=Shard({layout.dim})): the input's dim "
                    f"{layout.dim} has {x.shape[layout.dim]} entries, not a multiple of the "
                    f"{size} ranks; sequence parallelism needs equal shards (pad the sequence)")
            return x.to_local()
        return x
    return _first(inputs, local)


def _column_output(layout, use_local_output, module, out, mesh):
    def wrapped(y):
        if use_local_output and _is_last(layout, y.dim()):
            return y
        shape = tuple(y.shape[:-1]) + (module.out_features,)
        d = _wrap(y, mesh, Shard(y.dim() - 1), shape)
        if not _is_last(layout, y.dim()):
            d = d.redistribute(placements=[layout])
        return d.to_local() if use_local_output else d
    return _output(out, wrapped)


class RowwiseParallel(_torch_styles.RowwiseParallel):
    """torch's RowwiseParallel for te.Linear with te.Linear's own collectives:
    output_layouts Shard(d) (d a token dim) reduce-scatters the output and all-gathers its
    gradient quantized in backward. Same arguments as torch's."""

    def _apply(self, module, device_mesh):
        into = self.input_layouts[0]
        if into.is_partial():
            raise ValueError("te.distributed.RowwiseParallel: input_layouts must be Shard(d) or "
                             f"Replicate(), got {into}")
        dim = _sequence_dim(self.output_layouts[0], "output_layouts", "RowwiseParallel")
        _setup(module, device_mesh, "row", dim, "RowwiseParallel")
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(_row_input, into),
            partial(_row_output, self.output_layouts[0], self.use_local_output))


def _row_input(layout, module, inputs, mesh):
    def local(x):
        if not isinstance(x, DTensor):
            if _is_last(layout, x.dim()):
                return x
            x = DTensor.from_local(x, mesh, [layout], run_check=False)
        if not _is_last(x.placements[0], x.dim()):
            x = x.redistribute(placements=[Shard(x.dim() - 1)])
        return x.to_local()
    return _first(inputs, local)


def _row_output(layout, use_local_output, module, out, mesh):
    def wrapped(y):
        if use_local_output:
            return y
        shape = list(y.shape)
        if layout.is_shard():
            shape[layout.dim % y.dim()] *= mesh.size()
        return _wrap(y, mesh, layout, shape)
    return _output(out, wrapped)
