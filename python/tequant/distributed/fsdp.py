"""FSDP2 with te.Linear weights all-gathered in the recipe's quantized format.

`enable_quantized_all_gather(model)` (before fully_shard and before the optimizer is built) wraps
each te.Linear weight in a ShardedWeight: a tensor subclass that behaves as the high-precision
tensor it holds and keeps itself through FSDP2's sharding ops, so that FSDP2 calls its
fsdp_pre_all_gather / fsdp_post_all_gather (torch/distributed/fsdp/_fully_shard/_fsdp_param.py):

- inside an enabled te.autocast whose recipe te.Linear quantizes W with, a rank quantizes its shard
  (in MixedPrecisionPolicy's param_dtype, when set) with the whole weight's per-tensor scale (the
  shards' amaxes all-reduced with MAX; DelayedScaling's module scale, the global W amax recorded
  into its history once per forward) and the all-gather moves codes and scales
  (gather_layout.py); post_all_gather gives the module a GatheredWeight, which te.Linear
  multiplies as it is, with no second quantization. Under per-tensor FP8 (DelayedScaling,
  Float8CurrentScaling; no backward_override) it is a TraceableGatheredWeight, whose rowwise
  codes (a view of the all-gather output), scale_inv and amax are inner tensors that a compiled
  te.Linear traces with no graph break (_compile_gathered.py); under the other recipes compiled
  code runs the layer eagerly behind a graph break (members assembled lazily in Python, which
  Dynamo cannot trace). The gathered members are bit-identical to
  te.ops.quantize of the whole weight. Forward gathers the rowwise direction; backward's
  re-gather (reshard_after_forward=True) the columnwise one where the format cannot derive it
  from the rowwise (MXFP8, 1-D NVFP4; without resharding their forward gathers both).
- otherwise (no autocast, enabled=False, CustomRecipe) the shard travels in high precision and
  FSDP2 behaves as without tequant. So does a weight whose shards would cut the format's blocks
  (gather_layout.fallback_reason), counted in `fallbacks`.

FSDP2 reuses a parameter's all-gather buffers across steps, sized by the first gather; when the
payload changes (autocast on/off, another recipe) the FSDPParam's buffers are dropped so FSDP2
sizes them anew. tequant reaches the FSDPParam that calls its hooks through the caller's frame
(FSDPParam.all_gather_inputs / init_unsharded_param), and keeps its own per-parameter state on it.
Tests: tests/test_fsdp.py (gloo, 2 and 4 ranks; compiled: compile_worker), GPU with NCCL: the
same file.
"""
import collections
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.utils._pytree import tree_map_only

from .. import _C, delayed, ops
from .._operands import is_dtensor
from ..linear import Linear
from ..quantized import COLUMNWISE, ROWWISE
from . import gather_layout

__all__ = ["ShardedWeight", "GatheredWeight", "TraceableGatheredWeight",
           "enable_quantized_all_gather", "fallbacks"]

aten = torch.ops.aten
# What FSDP2 does to a parameter when it shards it, moves it or rebuilds its local tensor: these
# keep the wrapper; every other op runs on the wrapped tensor and returns plain tensors.
_KEEP = {aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.view.default,
         aten._unsafe_view.default, aten.as_strided.default, aten.new_zeros.default,
         aten.clone.default, aten.copy_.default, aten.detach.default, aten.alias.default,
         aten._to_copy.default, aten._pin_memory.default}

fallbacks = collections.Counter()  # reason -> gathers that went in high precision for it


def _wrap_like(cls, t, **extra):
    return torch.Tensor._make_wrapper_subclass(cls, t.shape, strides=t.stride(),
                                               storage_offset=t.storage_offset(), dtype=t.dtype,
                                               layout=t.layout, device=t.device,
                                               requires_grad=t.requires_grad, **extra)


class ShardedWeight(torch.Tensor):
    """A te.Linear weight (or FSDP2's shard of it) whose all-gather is tequant's."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data):
        return _wrap_like(cls, data)

    def __init__(self, data):
        self._data = data

    def __repr__(self):
        return f"ShardedWeight({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrapped = tree_map_only(ShardedWeight, lambda t: t._data, (args, kwargs or {}))
        out = func(*unwrapped[0], **unwrapped[1])
        if func not in _KEEP:
            return out
        if func is aten.copy_.default:
            return args[0]
        return tree_map_only(torch.Tensor, ShardedWeight, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ShardedWeight(inner["_data"])

    # ---- FSDP2's all-gather extension ------------------------------------------------------

    @property
    def tq_data(self):
        """The high-precision tensor (linear.py hands it to C when no FSDP2 gathered it)."""
        return self._data

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        fsdp_param = _calling_fsdp_param()
        state = fsdp_param.__dict__.setdefault("_tequant_gather", _GatherState())
        n, k = outer_size
        world = mesh.size()
        dtype = mp_policy.param_dtype or self.dtype
        backward = torch._C._current_graph_task_id() != -1
        if not backward:  # backward's re-gather quantizes as the forward did
            state.plan = _plan_for(module, n, world)
        plan = state.plan
        if plan is None:
            usage = 0
        elif gather_layout.derivable(plan.w):
            usage = ROWWISE
        elif backward:
            usage = COLUMNWISE
        else:  # without resharding after forward, backward reads what forward gathered
            usage = ROWWISE | (COLUMNWISE if fsdp_param.post_forward_mesh_info is None else 0)
        signature = (plan.key if plan else None, usage == ROWWISE | COLUMNWISE, dtype)
        if state.signature is not None and state.signature != signature:
            _drop_buffers(fsdp_param)  # sized for another payload
        state.signature = signature
        x = _padded_shard(self._data, -(-n // world), dtype)
        if plan is None:
            return (x,), ("hp",)
        group = mesh.get_group()
        if not backward and plan.w.scaling in _PER_TENSOR_AMAX:
            state.amax_global = _group_amax(fsdp_param, state, group, self._data)
        members = _quantize_shard(state, plan, x, usage, module, group, backward)
        inputs = gather_layout.shard_inputs(members, plan.w, usage)
        # One rank: FSDP2 copies the first input alone (its world-size-1 path); the others are
        # this rank's whole members already, and travel in the metadata.
        local = inputs[1:] if world == 1 else []
        return (tuple(inputs[:1] if world == 1 else inputs),
                ("q", plan, usage, n, k, world, _factors(plan, members, state), state, group,
                 self, local))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if metadata[0] == "hp":
            if out is not None:  # FSDP2 refilled the buffer the parameter views
                return None
            return all_gather_outputs[0], (all_gather_outputs[0],)
        _, plan, usage, n, k, world, factors, state, group, sharded, local = metadata
        outputs = tuple(all_gather_outputs) + tuple(local)
        held = _Held(plan, usage, outputs, n, k, world, factors, state, group, sharded)
        traceable = _traceable(plan)
        if traceable:
            held.assemble()  # the inner tensors: rowwise codes a view of the gathered buffer
        if out is not None:
            # `out` is the unsharded parameter: on a 2-D mesh a DTensor around the GatheredWeight
            # (setting an attribute on the wrapper left the weight computing with the previous
            # gather's members). In place: an alias of it made earlier (to_local, detach) shares
            # the _Held object. A traceable one's inner tensors are rebound on `out` (compiled
            # code flattens the parameter it reads on each call), not written in place: a
            # compiled backward may hold the previous ones, saved (the codes view the gathered
            # buffer, whose refill FSDP2 keeps from bumping its version counter).
            gathered = out._local_tensor if is_dtensor(out) else out
            gathered._held.take(held)
            if traceable:
                gathered._set_inner(held)
            return None
        if traceable:
            return TraceableGatheredWeight(held, param_dtype), all_gather_outputs
        return GatheredWeight(held, param_dtype), all_gather_outputs


def _padded_shard(shard, rows, dtype):
    """A rank's shard [rows, K] in dtype: FSDP2's last shard of an uneven split has fewer rows
    (its padding is zeros, which quantize to zero codes and leave every amax as it is)."""
    x = shard.to(dtype)
    if x.shape[0] < rows:
        x = torch.cat((x, x.new_zeros(rows - x.shape[0], x.shape[1])))
    return x


def _quantize_shard(state, plan, x, usage, module, group, backward):
    """The members of x quantized with the whole weight's per-tensor factors."""
    extra = _per_tensor_factors(state, plan, x, module, group, backward)
    return ops.quantize(x, plan.recipe, "weight", rowwise=bool(usage & ROWWISE),
                        columnwise=bool(usage & COLUMNWISE), **extra)._member_tuple


def _factors(plan, members, state):
    """What the gathered members need besides the gathered bytes: (scale_inv, amax) of a
    per-tensor format, NVFP4's (amax, amax_t), None for the other block formats."""
    if plan.w.scaling in gather_layout.PER_TENSOR:
        return members[1], state.amax_global
    if plan.w.scaling == "nvfp4":  # a weight's two amaxes are both W's: either stands in
        amax = members[4] if members[4] is not None else members[5]
        return amax, amax if members[5] is None else members[5]
    return None


class _GatherState:
    """tequant's per-parameter state, kept on FSDP2's FSDPParam (its local tensor object can be
    replaced, the FSDPParam stays)."""

    __slots__ = ("plan", "signature", "amax_global", "scale", "pending")

    def __init__(self):
        self.plan = self.signature = self.amax_global = self.scale = self.pending = None


def _calling_fsdp_param():
    """The FSDPParam whose all-gather calls these hooks (the nearest caller frame's self)."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, FSDPParam):
            return owner
        frame = frame.f_back
    raise RuntimeError("tequant's FSDP2 all-gather hooks were called from outside FSDP2's "
                       "FSDPParam; this torch version's fully_shard is not one tequant supports")


def _drop_buffers(fsdp_param):
    """Makes FSDP2 size the parameter's all-gather buffers and unsharded parameter anew."""
    fsdp_param.all_gather_outputs = []
    fsdp_param._unsharded_inner_tensors = []
    fsdp_param.__dict__.pop("_unsharded_param", None)


def _plan_for(module, rows, world):
    """The te.Linear plan the forward will quantize W with, or None to gather in high precision
    (no te.Linear, no enabled te.autocast, a CustomRecipe, or a shape the format cannot shard)."""
    if not isinstance(module, Linear) or not _C.is_fp8_enabled():
        return None
    recipe = _C.get_fp8_recipe()
    if recipe.custom():
        return None
    plan = module._plan(recipe)
    reason = gather_layout.fallback_reason(plan.w, rows, world)
    if reason is not None:
        fallbacks[reason] += 1
        return None
    return plan


_PER_TENSOR_AMAX = ("delayed", "current", "nvfp4")  # scalings whose W factor is its amax


def _group_amax(fsdp_param, state, group, shard):
    """The whole weight's amax ([1, 1] float32, of the shards in the gather's dtype) for this
    parameter's forward gather. The weights FSDP2 gathers in one call (one fully_shard module)
    get theirs from one MAX all-reduce: the first of them to quantize computes every one's shard
    amax and reduces them together; the others take their value from that call. A collective per
    weight, each holding its weight's quantize and gather back, cost 6-9 ms of idle GPU time per
    step on 4 H100s (docs/results/profile_distributed.md)."""
    caller = _gathering_call(fsdp_param)
    if state.pending is not None and state.pending[0] is caller[0]:
        amax, state.pending = state.pending[1], None
        return amax
    batch = [fsdp_param] + [p for p in caller[1] if p is not fsdp_param and _needs_amax(p)]
    local = torch.zeros(len(batch), dtype=torch.float32, device=shard.device)
    dtypes = []
    for i, p in enumerate(batch):  # (offloaded to the CPU, a shard comes to the gather's device)
        data = shard if i == 0 else p._sharded_local_tensor._data.to(shard.device)
        if data.numel():
            _C._amax(data, local[i:i + 1])
        dtypes.append(p.param_dtype or data.dtype)
    # The amax of the shard cast to the gather's dtype is the cast of its amax (rounding is
    # monotonic and symmetric), so the high-precision shard is read once, with no cast copy.
    # Slices, not a list index: indexing a CUDA tensor with a Python list copies the index from
    # pageable memory, which waits for the GPU (a host sync per module and forward; 10-15 ms of
    # idle GPU per step at 8 layers on 4 H100s, docs/results/profile_distributed.md).
    if len(set(dtypes)) == 1:
        if dtypes[0] != torch.float32:
            local.copy_(local.to(dtypes[0]))
    else:
        for i, dtype in enumerate(dtypes):
            if dtype != torch.float32:
                local[i:i + 1].copy_(local[i:i + 1].to(dtype))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    for i, p in enumerate(batch[1:], 1):
        other = p.__dict__.setdefault("_tequant_gather", _GatherState())
        other.pending = (caller[0], local[i:i + 1].view(1, 1))
    return local[0:1].view(1, 1)


def _gathering_call(fsdp_param):
    """(a token of FSDP2's current gather call, the FSDPParams it gathers): the frame of
    _get_param_all_gather_inputs(fsdp_params) above the hooks (or this parameter alone when
    another caller gathers it). Holding the frame keeps it alive, so its identity names this
    call and no later one."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        params = frame.f_locals.get("fsdp_params")
        if isinstance(params, list) and any(p is fsdp_param for p in params):
            return frame, params
        frame = frame.f_back
    return object(), [fsdp_param]


def _needs_amax(fsdp_param):
    """Whether this FSDPParam's forward gather will quantize its weight with a per-tensor factor
    (the same decision its fsdp_pre_all_gather makes)."""
    if not hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"):
        return False
    module = fsdp_param._module_info.module
    if not isinstance(module, Linear) or not _C.is_fp8_enabled():
        return False
    recipe = _C.get_fp8_recipe()
    if recipe.custom():
        return False
    n = fsdp_param._orig_size[0]
    plan = module._plan(recipe)
    world = fsdp_param.shard_mesh_from_root.size()
    return (plan.w.scaling in _PER_TENSOR_AMAX
            and gather_layout.fallback_reason(plan.w, n, world) is None)


def _per_tensor_factors(state, plan, x, module, group, backward):
    """te.ops.quantize's scale (DelayedScaling) or amax (current, NVFP4) for this shard: the whole
    weight's, which the forward's _group_amax gave (DelayedScaling records it into the module's
    history); backward reuses the forward's."""
    scaling = plan.w.scaling
    if scaling not in _PER_TENSOR_AMAX:
        return {}
    if not backward:
        local = state.amax_global.view(1)
        if scaling == "delayed":  # W's (scale, history slot): the module's kept views
            delayed.ensure(module, plan.x.amax_history_len)
            scale, slot = delayed.slots(module, delayed.FORWARD)[1]
            with torch.no_grad():
                torch.maximum(slot, local, out=slot)
            state.scale = scale.clone()
    if scaling == "delayed":
        return {"scale": state.scale}
    return {"amax": state.amax_global.view(1)}


class _Held:
    """What a GatheredWeight holds: the gathered buffers of one all-gather and how to read them."""

    __slots__ = ("plan", "usage", "outputs", "n", "k", "world", "factors", "state", "group",
                 "sharded", "members")

    def __init__(self, plan, usage, outputs, n, k, world, factors, state, group, sharded):
        self.plan, self.usage, self.outputs = plan, usage, outputs
        self.n, self.k, self.world, self.factors = n, k, world, factors
        self.state, self.group, self.sharded = state, group, sharded
        self.members = None

    def take(self, other):
        """Becomes `other` (a later all-gather into the same unsharded parameter)."""
        for name in self.__slots__:
            setattr(self, name, getattr(other, name))

    def assemble(self):
        """The six members of the gathered directions (assembled once, views of the buffers)."""
        if self.members is None:
            plan, n, k = self.plan, self.n, self.k
            dtypes = [m[2] if m else None for m in _C._quantize_layout(plan.w, n, k, 3)[:4]]
            self.members = gather_layout.assemble(plan.w, self.outputs, self.usage, n,
                                                  self.world, dtypes, self.factors)
        return self.members


def _traceable(plan):
    """Whether the gathered weight is a TraceableGatheredWeight: per-tensor FP8 (its columnwise
    codes derive from the rowwise ones) and no backward_override (compiled te.Linear's
    _compile_gathered.py). Other recipes keep the lazily assembled GatheredWeight, which
    compiled code runs eagerly behind a graph break."""
    return plan.w.scaling in gather_layout.PER_TENSOR and plan.backward_override is None


class GatheredWeight(torch.Tensor):
    """The unsharded te.Linear weight FSDP2 gives the module after a quantized all-gather: a
    [N, K] tensor of the parameter dtype whose values are the recipe's quantization of W. te.Linear
    reads its members (tq_kept, linear.py); anything else must not compute with it."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, held, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, (held.n, held.k), dtype=dtype,
                                                   device=held.outputs[0].device)

    def __init__(self, held, dtype):
        self._held = held

    def __repr__(self):
        return (f"GatheredWeight(shape={tuple(self.shape)}, recipe={self._held.plan.recipe!r}, "
                f"dtype={self.dtype})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        me = args[0]
        if func in (aten.detach.default, aten.alias.default) or (
                func in (aten.as_strided.default, aten.view.default)
                and tuple(args[1]) == tuple(me.shape)):
            # FSDP2 wrapping it in a Parameter; DTensor's to_local (tensor parallelism)
            return me._alias()
        raise NotImplementedError(
            f"{func} on a te.Linear weight that FSDP2 all-gathered in the recipe's quantized "
            "format: only te.Linear computes with it (use the module, or gather outside "
            "te.autocast)")

    def _alias(self):
        return GatheredWeight(self._held, self.dtype)

    @property
    def tq_recipe_key(self):
        return self._held.plan.key

    def tq_kept(self, usage):
        """The members holding `usage` (linear.py's quantized-weight protocol)."""
        held = self._held
        plan, n, k = held.plan, held.n, held.k
        members = held.assemble()
        index = 0 if usage == ROWWISE else 2
        if members[index] is None:
            if gather_layout.derivable(plan.w):
                held.members = members = gather_layout.derive_columnwise(plan.w, members, n, k)
            else:  # a direction this all-gather did not bring (an activation recompute)
                members = _gather_now(held, usage)
        return tuple(members)

    def tq_dequantized(self):
        held = self._held
        kept = self.tq_kept(ROWWISE)
        out = torch.empty(held.n, held.k, dtype=self.dtype, device=self.device)
        _C._dequantize(held.plan.w, held.n, held.k, kept, ROWWISE, out)
        return out


class TraceableGatheredWeight(GatheredWeight):
    """A GatheredWeight of a per-tensor FP8 recipe that torch.compile traces: its rowwise codes
    (a view of FSDP2's all-gather output), scale_inv and amax are inner tensors
    (__tensor_flatten__; metadata: the recipe key and W's dtype), which compiled te.Linear
    multiplies (_compile_gathered.py) with no graph break; eager te.Linear reads it as any
    GatheredWeight. Made at fsdp_post_all_gather; FSDP2's in-place refill rebinds the inner
    tensors (_set_inner)."""

    @staticmethod
    def __new__(cls, held, dtype, inner=None, key=None):
        data = inner[0] if inner is not None else held.members[0]
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype,
                                                   device=data.device)

    def __init__(self, held, dtype, inner=None, key=None):
        self._held = held
        if inner is None:
            self._set_inner(held)
        else:
            self._data, self._scale_inv, self._amax = inner
            self._key = key

    def _set_inner(self, held):
        members = held.members
        self._data, self._scale_inv, self._amax = members[0], members[1], members[4]
        self._key = held.plan.key

    def _alias(self):
        return TraceableGatheredWeight(self._held, self.dtype,
                                       (self._data, self._scale_inv, self._amax), self._key)

    def __repr__(self):
        return f"TraceableGatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv", "_amax"], (self._key, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return TraceableGatheredWeight(None, meta[1], (inner["_data"], inner["_scale_inv"],
                                                       inner["_amax"]), meta[0])

    @property
    def tq_recipe_key(self):
        return self._key


def _gather_now(held, usage):
    """The members of one direction gathered outside FSDP2 (a synchronous all-gather of the shards
    quantized again with the forward's factors): an activation recompute in backward reading the
    rowwise MXFP8 / 1-D NVFP4 weight after FSDP2 gathered the columnwise one."""
    plan = held.plan
    x = _padded_shard(held.sharded._data, -(-held.n // held.world), held.state.signature[2])
    members = _quantize_shard(held.state, plan, x, usage, None, held.group, backward=True)
    outputs = []
    for inp in gather_layout.shard_inputs(members, plan.w, usage):
        out = inp.new_empty((held.world * inp.shape[0],) + tuple(inp.shape[1:]))
        dist.all_gather_into_tensor(out, inp.contiguous(), group=held.group)
        outputs.append(out)
    dtypes = [m[2] if m else None for m in _C._quantize_layout(plan.w, held.n, held.k, 3)[:4]]
    gathered = gather_layout.assemble(plan.w, outputs, usage, held.n, held.world, dtypes,
                                      held.factors)
    return [g if g is not None else m for g, m in zip(gathered, held.members)]


def _plain_state_dict_hook(module, state_dict, prefix, local_metadata):
    """state_dict entries of plain tensors (DTensor with plain local tensors) for ShardedWeight
    weights: checkpoints hold ordinary tensors and load into any model."""
    from torch.distributed.tensor import DTensor
    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and isinstance(value._local_tensor, ShardedWeight):
        state_dict[key] = DTensor.from_local(value._local_tensor._data, value.device_mesh,
                                             value.placements, run_check=False,
                                             shape=value.shape, stride=value.stride())
    elif isinstance(value, ShardedWeight):
        state_dict[key] = value._data


def enable_quantized_all_gather(model):
    """Makes FSDP2 all-gather every te.Linear weight in `model` in the recipe's quantized format
    inside te.autocast (and in high precision outside). Call it before fully_shard and before
    building the optimizer: each weight becomes a new Parameter (a ShardedWeight). Returns model."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable_quantized_all_gather takes a torch.nn.Module, got "
                        f"{type(model).__name__}")
    for module in model.modules():
        if not isinstance(module, Linear) or isinstance(module.weight, ShardedWeight):
            continue
        weight = module.weight
        if is_dtensor(weight):  # tensor parallel (a 2-D mesh): the local shard is wrapped
            from torch.distributed.tensor import DTensor
            data = DTensor.from_local(ShardedWeight(weight._local_tensor.detach()),
                                      weight.device_mesh, weight.placements, run_check=False,
                                      shape=weight.shape, stride=weight.stride())
        else:
            data = ShardedWeight(weight.data)
        module.weight = torch.nn.Parameter(data, requires_grad=weight.requires_grad)
        module._register_state_dict_hook(_plain_state_dict_hook)
    return model
