"""DelayedScaling state of te.Linear: per-module amax histories and scales, and their update.

Each module holds four float32 buffers (saved by state_dict): `delayed_amax_history_fwd` [L, 2]
and `delayed_scale_fwd` [2] for its input and weight, `delayed_amax_history_bwd` [L, 1] and
`delayed_scale_bwd` [1] for its grad_output. Quantizing casts with the scale and max-accumulates
the tensor's amax into row 0 of its column. The update (NUMERICS.md 2, TE_REFERENCE 6.1) runs for
the forward columns of every module that quantized in an autocast at that autocast's outermost
exit (csrc/ext/autocast.c calls `_update_forward`), and for the backward columns at the end of
the backward of the module that ran first in forward; amaxes are all-reduced (MAX) over the
autocast's amax_reduction_group first. The fused rule runs in one C call per batch of modules
(tq_amax_update); callable amax_compute_algo / scaling_factor_compute_algo use TE's unfused rule
in torch. Compiled te.Linear under an amax reduction group queues its backward update here
(defer_backward, from tequant::amax_defer_queue) for the end of the backward pass, one all-reduce
for every queued module as eager. Tests: tests/test_linear_delayed.py, tests/test_compile.py
(the deferred update), tests/test_compile_delayed.py.
"""
import torch

from . import _C

FORWARD, BACKWARD = "fwd", "bwd"
DIRECTIONS = (FORWARD, BACKWARD)
COLUMNS = {FORWARD: ("x", "w"), BACKWARD: ("dy",)}  # each direction's roles, in column order
BUFFERS = tuple(f"delayed_{kind}_{direction}" for direction in (FORWARD, BACKWARD)
                for kind in ("amax_history", "scale"))


def ensure(module, length):
    """Creates the module's buffers for history length `length` on the weight's device, when
    missing or when the length changed; existing state is kept otherwise."""
    hist = module._buffers.get("delayed_amax_history_fwd")
    device = module.weight.device
    if hist is not None and hist.shape[0] == length and hist.device == device:
        return
    for direction, n in ((FORWARD, 2), (BACKWARD, 1)):
        module.register_buffer(f"delayed_amax_history_{direction}",
                               torch.zeros(length, n, dtype=torch.float32, device=device))
        module.register_buffer(f"delayed_scale_{direction}",
                               torch.ones(n, dtype=torch.float32, device=device))


def restart(module, directions):
    """The module's buffers of `directions` (those it has) as ensure() makes them, in place (the
    views slots() keeps stay valid): zero amax history, unit scale. For state that no longer
    describes the weight (reset_parameters, a loaded weight) or was never written (to_empty)."""
    with torch.no_grad():
        for direction in directions:
            hist = module._buffers.get(f"delayed_amax_history_{direction}")
            scale = module._buffers.get(f"delayed_scale_{direction}")
            if hist is not None and scale is not None:
                hist.zero_()
                scale.fill_(1.0)


def keeping_float32(module, apply):
    """apply() (the module's nn.Module._apply) with its DelayedScaling buffers following a device
    move only: a model's .half(), .bfloat16() or .to(dtype) leaves them float32 (as TE's
    fp8_meta): the kernels read float32, and a float16 scale overflows past 65504."""
    buffers = module._buffers
    before = [(name, buffers.get(name)) for name in BUFFERS]
    out = apply()
    for name, old in before:
        new = buffers.get(name)
        if old is not None and new is not None and new.dtype != old.dtype:
            buffers[name] = old.to(new.device)
    return out


def _kept(module, name, hist, scale, extra, make):
    """make() of a module's buffers hist and scale, kept in module.__dict__[name] while they are
    the same tensors on the same storage (to(), ensure() and load_state_dict(assign=True) replace
    them; `.data =` swaps the storage) and extra is the same object. Views of the buffers cost
    ~2.5 us each on the H200 host, and te.Linear wants four per forward and per update."""
    # kept on modules; _CompiledEntry / _PendingBackward (__slots__) have no __dict__: made each
    # time. Not getattr(module, "__dict__", None): Dynamo of torch 2.11 raises on it for a slots
    # object (a graph break inside te.autocast traces the exit's update over the entries)
    attrs = module.__dict__ if isinstance(module, torch.nn.Module) else None
    kept = attrs.get(name) if attrs is not None else None
    if (kept is not None and kept[0] is hist and kept[1] is scale and kept[2] is extra
            and kept[3] == hist.data_ptr() and kept[4] == scale.data_ptr()):
        return kept[5]
    value = make()
    if attrs is not None:
        attrs[name] = (hist, scale, extra, hist.data_ptr(), scale.data_ptr(), value)
    return value


def slots(module, direction):
    """Per column of `direction`, the (scale [1], history row-0 slot [1]) views the quantizer
    casts with and accumulates into (kept on the module, _kept)."""
    buffers = module._buffers
    hist = buffers[f"delayed_amax_history_{direction}"]
    scale = buffers[f"delayed_scale_{direction}"]
    return _kept(module, "_delayed_slots_" + direction, hist, scale, None,
                 lambda: tuple((scale[c:c + 1], hist[0, c:c + 1])
                               for c in range(len(COLUMNS[direction]))))


def replay_slots(scale_fwd):
    """The (scale, amax slot) pairs of x and W for an activation-checkpointing recompute: the
    forward's scales as they were (a copy, checkpoint.Call.scale_fwd) and scratch amax slots, so
    that the recompute quantizes as the forward did and records no amax a second time."""
    amax = torch.zeros(2, dtype=torch.float32, device=scale_fwd.device)
    return tuple((scale_fwd[c:c + 1], amax[c:c + 1]) for c in range(2))


def calibrate(module, length, inp):
    """calibrating=True without quantizing: max-accumulate the amaxes of x and W (TE's
    Float8Quantizer.calibrate) into a history of `length` rows."""
    ensure(module, length)
    hist = module.delayed_amax_history_fwd
    with torch.no_grad():
        for column, t in enumerate((inp, module.weight)):
            amax = t.detach().abs().amax().float() if t.numel() else hist.new_zeros(())
            hist[0, column] = torch.maximum(hist[0, column], amax)


def scaled_maxes(plan, direction):
    """Per column of `direction`, the format's max divided by 2^margin (the scale's numerator)."""
    return [getattr(plan, role).fmax * 2.0 ** -getattr(plan, role).margin
            for role in COLUMNS[direction]]


def slots_of(plan, hist, scale, direction):
    """The (history column, scale element, scaled fmax) slots of one module's buffers."""
    return [(hist[:, column:column + 1], scale[column:column + 1], scaled_max)
            for column, scaled_max in enumerate(scaled_maxes(plan, direction))]


def _unfused(recipe):
    return callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None


def fused_update(plan, direction):
    """(history_len, algo, each column's scaled max) of the fused rule (tq_amax_update) for one
    module's `direction` buffers, or None where the recipe takes TE's unfused rule: what the
    compiled te.Linear's backward op needs to update a module itself (csrc/ext/linear_ops.c)."""
    recipe = plan.recipe
    if _unfused(recipe):
        return None
    return (recipe.amax_history_len, recipe.amax_compute_algo,
            tuple(scaled_maxes(plan, direction)))


def update_slots(slots, recipe, group):
    """All-reduce (MAX over group) then the fused or TE-unfused roll and scale update."""
    reduced = _reduce(slots, recipe, group)
    if _unfused(recipe):
        update_unfused(slots, reduced, recipe)
    else:
        _C._amax_update(slots, recipe.amax_history_len, recipe.amax_compute_algo, reduced)


class _CompiledEntry:
    """A compiled te.Linear's forward buffers, registered with an eager te.autocast (a module
    stand-in for _update; its backward update runs in the compiled backward)."""

    __slots__ = ("_delayed_plan", "_delayed_group", "delayed_amax_history_fwd",
                 "delayed_scale_fwd")

    def __init__(self, hist, scale, plan, group):
        self._delayed_plan, self._delayed_group = plan, group
        self.delayed_amax_history_fwd, self.delayed_scale_fwd = hist, scale


def register_compiled(hist, scale, plan, group):
    """Records a compiled module's forward buffers with the eager outermost te.autocast."""
    _C._delayed_register_forward_only(_CompiledEntry(hist, scale, plan, group))


class _PendingBackward:
    """A compiled te.Linear's backward buffers awaiting the end of the backward pass (a module
    stand-in for _update)."""

    __slots__ = ("_delayed_plan", "_delayed_group", "delayed_amax_history_bwd",
                 "delayed_scale_bwd")

    def __init__(self, hist, scale, plan, group):
        self._delayed_plan, self._delayed_group = plan, group
        self.delayed_amax_history_bwd, self.delayed_scale_bwd = hist, scale


_PENDING = []  # _PendingBackward of the running backward pass


def defer_backward(hist, scale, plan, group):
    """A compiled module's backward update with an amax all-reduce: queued for the end of the
    backward pass, where every queued module is updated at once with one all-reduce per
    (recipe, group), as eager's update at the end of the backward of the module that ran first
    in forward. A per-module all-reduce inside the compiled backward graphs would be a
    collective per te.Linear, each one a point where every rank waits for the slowest. Outside
    a backward pass (no autograd engine to call back) the module is updated at once."""
    _PENDING.append(_PendingBackward(hist, scale, plan, group))
    # A callback per module, not per pass: the first one flushes every module queued by then and
    # the others find nothing. A backward pass that raised runs no callback; its modules are
    # then flushed by the next pass's instead of waiting forever behind a flag.
    try:
        torch.autograd.Variable._execution_engine.queue_callback(_flush_backward)
    except RuntimeError:  # not inside a backward pass
        _flush_backward()


def _flush_backward():
    if not _PENDING:
        return
    modules = _PENDING[:]
    _PENDING.clear()
    _update(modules, BACKWARD)


def _buffers_of(module, direction):
    """(history, scale) of a module or a _CompiledEntry (no backward buffers: (None, None));
    nn.Module's _buffers dict first, its __getattr__ costs ~1 us per read on the H200 host."""
    names = f"delayed_amax_history_{direction}", f"delayed_scale_{direction}"
    buffers = getattr(module, "_buffers", None)
    if buffers is None:
        return getattr(module, names[0], None), getattr(module, names[1], None)
    return buffers.get(names[0]), buffers.get(names[1])


def _update(modules, direction):
    seen, batches = set(), {}
    for module in modules:
        hist, scale = _buffers_of(module, direction)
        if hist is None or id(hist) in seen:  # once per module; compiled entries: forward only
            continue
        seen.add(id(hist))
        plan, group = module._delayed_plan, module._delayed_group
        recipe = plan.recipe
        batches.setdefault((plan.x.amax_history_len, id(recipe), id(group)), (recipe, group, []))[2] \
            .append((module, plan, hist, scale))
    for recipe, group, members in batches.values():
        slots = []
        for module, plan, hist, scale in members:
            slots += _kept(module, "_delayed_update_" + direction, hist, scale, plan,
                           lambda: slots_of(plan, hist, scale, direction))
        update_slots(slots, recipe, group)


def _reduce(slots, recipe, group):
    """The slots' row-0 amaxes all-reduced (MAX) over group, or None without a reduction."""
    if not (recipe.reduce_amax and group is not None and torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size(group) > 1):
        return None
    amaxes = torch.cat([hist[0] for hist, _, _ in slots]).contiguous()
    torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
    return amaxes


def update_unfused(slots, reduced, recipe):
    """TE's unfused update (quantization.py): reduced amaxes into row 0, amax from the callable
    (or max / most recent), roll by one with row 0 zeroed, scale from the callable or
    (fmax / amax) / 2^margin kept where amax is not finite and positive, Inf -> FLT_MAX."""
    algo, scale_algo = recipe.amax_compute_algo, recipe.scaling_factor_compute_algo
    flt_max = torch.finfo(torch.float32).max
    with torch.no_grad():
        for i, (hist, scale, scaled_max) in enumerate(slots):
            h = hist[:, 0]
            if reduced is not None:
                h[0] = reduced[i]
            if callable(algo):
                amax = torch.as_tensor(algo(h.clone()), dtype=torch.float32, device=h.device)
            else:
                amax = h.amax() if algo == "max" else h[0]
            h.copy_(torch.roll(h, -1))
            h[0] = 0
            if scale_algo is not None:
                fmax = scaled_max * 2.0 ** recipe.margin
                new = torch.as_tensor(scale_algo(amax, scale.clone(), fmax, recipe),
                                      dtype=torch.float32, device=h.device).reshape(1)
            else:
                new = (scaled_max * 2.0 ** recipe.margin / amax) / 2.0 ** recipe.margin
                new = torch.where(torch.isfinite(amax) & (amax > 0), new, scale[0]).reshape(1)
            scale.copy_(torch.where(torch.isinf(new), torch.full_like(new, flt_max), new))


def _update_forward(modules):
    """Called by the outermost te.autocast's exit with the modules that quantized in it (only
    modules whose forward ran with grad enabled register: TE updates for training steps)."""
    _update(modules, FORWARD)


def update_backward(modules):
    """Called by linear_backward (csrc/ext/linear.c) at the end of the backward of the module
    that ran first in forward."""
    _update(modules, BACKWARD)


_C._set_delayed_update(_update_forward, update_backward)
