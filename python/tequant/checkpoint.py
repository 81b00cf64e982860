"""Activation checkpointing with te.Linear: the recompute runs as the forward did.

torch.utils.checkpoint (use_reentrant=True or False), torch's checkpoint_wrapper /
apply_activation_checkpointing and Hugging Face's gradient_checkpointing_enable() recompute a
checkpointed forward during backward: on the autograd thread, outside the user's te.autocast,
and after that autocast's exit has updated DelayedScaling's scales. A te.Linear recomputed as it
stands then would run in high precision or with other scales, and its gradients would differ from
those of the forward that ran (shared/docs/DISTRIBUTED.md 4).

So a checkpointed forward is a region. While it runs, each te.Linear call in it appends a Call to
the region's tape: the recipe it ran with (None: high precision), DelayedScaling's forward scales
as they were and the module list the first module's backward updates. The recompute replays the
tape in order: each te.Linear call takes the next Call and runs exactly as it did, with those
scales, recording no amax (a forward's amaxes are recorded once, when it runs) and registering
with no autocast. Gradients are then those without checkpointing, bit for bit, for every recipe;
NVFP4's stochastic rounding draws from torch's generator, whose state torch's checkpoint restores
for the recompute (preserve_rng_state=True, its default). CustomRecipe quantizers are called
again in the recompute.

torch.utils.checkpoint.checkpoint reaches its two modes through module globals,
CheckpointFunction (reentrant) and _checkpoint_without_reentrant_generator (non-reentrant);
install() wraps both once, when tequant is imported. Code without te.Linear runs as before.
Under torch.compile Dynamo traces a checkpointed function as its own higher-order op and the
recompute is part of the compiled graph, so neither wrapper is involved there.
Regions nest: a call takes its Call from the innermost region being replayed (none: it runs live
and makes one) and appends it to every region being recorded inside that one.
Tests: tests/test_checkpoint.py.
"""
import contextlib
import contextvars

import torch
import torch.utils.checkpoint as _torch_checkpoint

from . import _C

__all__ = ["REGIONS", "Call", "source"]

# The regions around the calling code, outermost first: _Tape while recorded, _Replay while
# replayed; None outside any (the only case te.Linear's forward pays for: one ContextVar read).
REGIONS = contextvars.ContextVar("tequant_checkpoint_regions", default=None)
# True while a region recorded under DelayedScaling is recomputed. Compiled te.Linear code reads
# it (Dynamo guards on it, so a graph traced outside a recompute is not reused inside one) and
# refuses: its forward left no record of the scales it used (_compile_linear._local).
STATEFUL_REPLAY = False
# True while an eagerly checkpointed non-reentrant region is recomputed: compiled te.Linear
# code under a DelayedScaling autocast entered inside the region refuses as well (the region's
# own record says nothing of it; eager calls replay their Calls). Read only on compiled
# DelayedScaling paths, so other graphs do not guard on it.
REPLAYING = False
STATEFUL_REPLAY_ERROR = (
    "te.Linear compiled with torch.compile inside an eager torch.utils.checkpoint region that "
    "ran under DelayedScaling: its recompute cannot quantize as the forward did (the "
    "autocast's exit has updated the module's scales since, and compiled code records no call "
    "with the ones it used). Put the checkpoint inside the compiled code (compile the "
    "checkpointed module or function: the region then runs eagerly and replays its scales), "
    "or use a recipe without state between steps (Float8CurrentScaling, Float8BlockScaling, "
    "MXFP8BlockScaling, NVFP4BlockScaling)")


class Call:
    """What one te.Linear forward ran with; linear.py fills it in while the call runs live."""

    __slots__ = ("module", "recipe", "pending", "scale_fwd")

    def __init__(self, module):
        self.module = module
        self.recipe = None      # None: high precision (no autocast, disabled or calibrating)
        self.pending = None     # DelayedScaling: the modules the first one's backward updates
        self.scale_fwd = None   # DelayedScaling: a copy of the module's forward scales [2]


class _Tape:
    """A region being recorded: its forward's calls in order. trains: the forward counts as a
    training step even where it runs under no_grad (the reentrant mode runs it so). autocast:
    (recipe, amax_reduction_group) of the te.autocast live around the region when its recipe
    keeps no state between steps (all but DelayedScaling), else None: the recompute enters it
    again for te.Linear code compiled with torch.compile inside the region, which reads the
    live autocast (its graph was traced and guarded under it) and not the tape. high_precision:
    no enabled te.autocast was live (none, disabled or calibrating): the recompute runs in a
    disabled one, whatever is live in backward."""

    __slots__ = ("calls", "trains", "autocast", "stateful", "high_precision")

    def __init__(self, trains):
        self.calls = []
        self.trains = trains
        live = _C._live
        recipe = live.recipe if live.enabled and not live.calibrating else None
        self.high_precision = recipe is None
        self.stateful = recipe is not None and recipe.delayed()
        self.autocast = None if recipe is None or self.stateful else \
            (recipe, live.amax_reduction_group)


class _Replay:
    """A region being recomputed: hands out its tape's calls in order, from the first."""

    __slots__ = ("tape", "position")

    def __init__(self, tape):
        self.tape = tape
        self.position = 0

    def take(self, module):
        calls, i = self.tape.calls, self.position
        if i >= len(calls) or calls[i].module is not module:
            ran = "no more te.Linear calls" if i >= len(calls) else \
                f"{type(calls[i].module).__name__} {id(calls[i].module):#x}"
            mismatch = (f"the recompute called te.Linear {id(module):#x} as its call #{i + 1}, "
                        f"where the forward made {ran}")
            # Under DelayedScaling a compiled te.Linear's frame, run eagerly in the recompute
            # (_compile_linear._local refuses while tracing), lands here too.
            live = _C._live  # (or a DelayedScaling autocast entered inside the region)
            stateful = self.tape.stateful or (live.enabled and live.recipe.delayed())
            also = f"; or: {STATEFUL_REPLAY_ERROR}" if stateful else ""
            raise RuntimeError(
                f"activation checkpointing: {mismatch}; a checkpointed function must call the "
                f"same te.Linear modules in the same order when it is recomputed{also}")
        self.position = i + 1
        return calls[i]


def source(regions, module):
    """(the Call this te.Linear call replays or None to run live, the tapes that record it)."""
    for i in range(len(regions) - 1, -1, -1):
        if type(regions[i]) is _Replay:
            return regions[i].take(module), regions[i + 1:]
    return None, regions


@contextlib.contextmanager
def _inside(region):
    outer = REGIONS.get()
    token = REGIONS.set((region,) if outer is None else outer + (region,))
    try:
        yield
    finally:
        REGIONS.reset(token)


def _replaying(function, tape):
    """function, run as a recompute of the forward `tape` recorded, inside the te.autocast the
    forward ran in where its recipe is stateless (the eager te.Linear calls replay their Call
    whatever the live state; compiled ones see the same state as in the forward). The same
    quantization of the same inputs gives the same bits; NVFP4's stochastic rounding draws
    from the generator state torch's checkpoint restores."""
    def recompute(*args, **kwargs):
        global STATEFUL_REPLAY, REPLAYING
        outer = REPLAYING
        # non-reentrant only: the reentrant forward runs under no_grad, where compiled code
        # registers no DelayedScaling update, so its recompute is the step's one quantization
        REPLAYING = outer or not tape.trains
        try:
            with _inside(_Replay(tape)):
                if tape.autocast is not None:
                    recipe, group = tape.autocast
                    with _C.autocast(recipe=recipe, amax_reduction_group=group):
                        return function(*args, **kwargs)
                if tape.high_precision:
                    with _C.autocast(enabled=False):
                        return function(*args, **kwargs)
                STATEFUL_REPLAY = True
                try:
                    return function(*args, **kwargs)
                finally:
                    STATEFUL_REPLAY = False
        finally:
            REPLAYING = outer
    return recompute


_TorchCheckpointFunction = _torch_checkpoint.CheckpointFunction
_torch_without_reentrant = _torch_checkpoint._checkpoint_without_reentrant_generator


class CheckpointFunction(_TorchCheckpointFunction):
    """torch's reentrant checkpoint, its forward recorded and its recompute replayed. The forward
    runs run_function once under no_grad inside apply; backward calls ctx.run_function again."""

    @classmethod
    def apply(cls, run_function, preserve_rng_state, *args):
        if not torch.is_grad_enabled():  # no graph, so no recompute
            return super().apply(run_function, preserve_rng_state, *args)
        tape = _Tape(trains=True)
        recompute = _replaying(run_function, tape)
        forward_done = False

        def run(*inputs):
            return recompute(*inputs) if forward_done else run_function(*inputs)

        with _inside(tape):
            out = super().apply(run, preserve_rng_state, *args)
        forward_done = True
        return out


def _checkpoint_without_reentrant_generator(fn, *rest, **kwargs):
    """torch's non-reentrant checkpoint, its forward (run by torch's checkpoint() between the
    generator's two steps) recorded; torch calls fn itself only to recompute."""
    if not torch.is_grad_enabled():  # torch saves nothing then: no recompute
        return (yield from _torch_without_reentrant(fn, *rest, **kwargs))
    tape = _Tape(trains=False)
    with _inside(tape):
        return (yield from _torch_without_reentrant(_replaying(fn, tape), *rest, **kwargs))


def install():
    """Routes torch.utils.checkpoint's two modes through the wrappers above (once)."""
    if _torch_checkpoint.CheckpointFunction is CheckpointFunction:
        return
    _torch_checkpoint.CheckpointFunction = CheckpointFunction
    _torch_checkpoint._checkpoint_without_reentrant_generator = \
        _checkpoint_without_reentrant_generator

