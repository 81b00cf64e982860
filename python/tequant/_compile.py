"""What torch.compile sees of te.autocast and its state readers: a Python twin, traced by Dynamo.

Dynamo cannot trace the C autocast or the C state readers, so each is registered with
torch.compiler.substitute_in_graph: eager calls still run the C functions, and only traced code
runs the twins below. The twin keeps the C semantics (shared/docs/ARCHITECTURE.md 5):
- `te.autocast(...)` inside compiled code is a `_TracedAutocast`; its frames stack in
  `_TRACED` while the traced code runs (the list is empty between calls, Dynamo replays the
  balanced pushes and pops), nested over the eager state when the compiled function itself runs
  inside an eager te.autocast;
- outside any traced frame the state comes from `_C._live`, whose attributes read the C state
  afresh; Dynamo guards on their values (enabled, calibrating, the recipe's `_tequant_id`), so
  a compiled function called inside te.autocast recompiles when the recipe changes and never
  runs with a stale one;
- the capability check of an entered recipe runs once at trace time (a compile-time constant).
DelayedScaling's bookkeeping (which modules update at the outermost exit) is in _compile_linear.py.
Tests: tests/test_compile.py.
"""
import importlib.abc
import importlib.util
import sys

import torch

from . import _C

__all__ = ["current", "constant"]

_CONSTANTS = []  # functions Dynamo evaluates at trace time (assume_constant_result)
_ON_DYNAMO = []  # functions called once torch._dynamo is loaded (when_dynamo_loads)
_ROOT_EXIT = []  # fn(delayed entries) called at a traced outermost autocast's exit (at_root_exit)
_REGISTERED = []  # [True] once _register ran


def constant(fn):
    """Marks fn for torch._dynamo.assume_constant_result once Dynamo is loaded
    (register_with_dynamo):
    importing torch._dynamo costs ~1-2 s, which `import tequant` does not impose on eager code."""
    _CONSTANTS.append(fn)
    if "torch._dynamo" in sys.modules and _REGISTERED:
        torch._dynamo.assume_constant_result(fn)
    return fn

def when_dynamo_loads(fn):
    """Calls fn() once torch._dynamo is loaded (now, if it is): for modules that wrap their
    eager-only entry points in torch._dynamo.disable without importing Dynamo themselves."""
    _ON_DYNAMO.append(fn)
    if "torch._dynamo" in sys.modules and _REGISTERED:
        fn()
    return fn


def at_root_exit(fn):
    """Registers fn(entries), called (traced) at the exit of an outermost te.autocast entered in
    compiled code with the DelayedScaling entries its modules appended to `root.delayed`
    (_compile_linear.py registers the forward update). This module imports no other tequant
    module but _C: the ones that trace register with it."""
    _ROOT_EXIT.append(fn)
    return fn


_TRACED = []  # _TracedAutocast frames entered by the code being traced, innermost last
_DEFAULT_RECIPE = _C.get_fp8_recipe()  # outside any autocast: the default recipe object


@constant
def _refusal(recipe_id):
    """Why this machine cannot run the recipe (eager __enter__'s RuntimeError text), or ''."""
    try:
        with _C.autocast(recipe=_C._recipe_of_key(int(recipe_id))):
            pass
    except RuntimeError as e:
        return str(e)
    return ""


def _recipe_id(recipe):
    try:
        return recipe._tequant_id
    except AttributeError:
        raise TypeError(
            f"te.autocast under torch.compile needs a recipe built outside the compiled code "
            f"(got {type(recipe).__name__}); construct it once, outside, and pass it in") from None


def _check_bool(value, name):
    if value is not True and value is not False:
        raise TypeError(f"autocast: {name} must be a bool, got {type(value).__name__}")


class _TracedAutocast:
    """te.autocast as Dynamo traces it; the attributes match tequant.Autocast's."""

    def __init__(self, enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
        _check_bool(enabled, "enabled")
        _check_bool(calibrating, "calibrating")
        self.enabled, self.calibrating = enabled, calibrating
        self.recipe = _DEFAULT_RECIPE if recipe is None else recipe
        self.recipe_id = _recipe_id(self.recipe)
        self.amax_reduction_group = amax_reduction_group
        self.active = False
        self.depth = 0
        self.root = None      # the outermost traced frame, or None below an eager autocast
        self.delayed = None   # on a traced root: DelayedScaling entries (_compile_linear.py)

    def __enter__(self):
        if self.active:
            raise RuntimeError("autocast context manager cannot be entered more than once "
                               "concurrently; create a new te.autocast(...) for each with-block")
        if self.enabled:
            refusal = _refusal(self.recipe_id)
            if refusal:
                raise RuntimeError(refusal)
        if _TRACED:
            outer = _TRACED[-1]
            self.depth, self.root = outer.depth + 1, outer.root
        else:
            eager_depth = _C._live.depth
            self.depth = eager_depth + 1
            self.root = self if eager_depth == 0 else None
        if self.root is self:
            self.delayed = []
        _TRACED.append(self)
        self.active = True
        return self

    def __exit__(self, *exc):
        _TRACED.pop()
        self.active = False
        if self.root is self and self.delayed:
            for fn in _ROOT_EXIT:
                fn(self.delayed)
        return False


class State:
    """The innermost autocast state as traced code sees it."""

    __slots__ = ("enabled", "calibrating", "recipe", "recipe_id", "group", "root")

    def __init__(self, enabled, calibrating, recipe, group, root):
        self.enabled, self.calibrating, self.recipe = enabled, calibrating, recipe
        self.recipe_id = recipe._tequant_id
        self.group, self.root = group, root


def current():
    """The state a traced te.Linear runs under: the innermost traced frame, else the eager one
    (root None: DelayedScaling modules register with the eager outermost autocast)."""
    if _TRACED:
        f = _TRACED[-1]
        return State(f.enabled, f.calibrating, f.recipe, f.amax_reduction_group, f.root)
    live = _C._live
    return State(live.enabled, live.calibrating, live.recipe, live.amax_reduction_group, None)


def _register():
    """Tells Dynamo about tequant: the twins of the C entry points, the trace-time constants,
    and the eager-only bookkeeping it must not compile."""
    _REGISTERED.append(True)
    for fn in _CONSTANTS:
        torch._dynamo.assume_constant_result(fn)
    for fn in _ON_DYNAMO:
        fn()
    sub = torch.compiler.substitute_in_graph

    @sub(_C.autocast)
    def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
        return _TracedAutocast(enabled, calibrating, recipe, amax_reduction_group)

    @sub(_C.is_fp8_enabled)
    def is_fp8_enabled():
        return current().enabled

    @sub(_C.is_fp8_calibration)
    def is_fp8_calibration():
        return current().calibrating

    @sub(_C.get_fp8_recipe)
    def get_fp8_recipe():
        return current().recipe

    @sub(_C.get_fp8_group)
    def get_fp8_group():
        return current().group

    @sub(_C.autocast_depth)
    def autocast_depth():
        return _TRACED[-1].depth if _TRACED else _C._live.depth

    @sub(_C.recipe_key)
    def recipe_key(recipe):
        return int(_recipe_id(_DEFAULT_RECIPE if recipe is None else recipe))


class _DynamoWatcher(importlib.abc.MetaPathFinder):
    """Runs _register right after torch._dynamo is imported (by torch.compile, usually)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)  # once; the regular finders locate the package
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()
        spec.loader.exec_module = exec_then_register
        return spec


def register_with_dynamo():
    """Registers with Dynamo now if it is loaded, else right after it loads (tequant/__init__
    calls this last, once every module it registers exists)."""
    if "torch._dynamo" in sys.modules:
        _register()
    else:
        sys.meta_path.insert(0, _DynamoWatcher())

