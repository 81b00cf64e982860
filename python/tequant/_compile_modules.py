"""te.Linear modules as traced code reaches them: a uid per module (register_module, given by
Linear.__init__ and to every copy), by which the trace-time constants that act on the module
itself find it: the creation of its DelayedScaling buffers (ensure_buffers) and the
tensor-parallel group's recipe check (check_tp_recipe). A constant takes strings, not the
module: Dynamo evaluates it once while tracing, and the graph keeps no reference to it.
Tests: tests/test_compile_delayed.py, tests/test_linear_module.py (copies),
tests/test_tensor_parallel.py.
"""
import weakref

from . import _C, _compile, delayed

_MODULES = weakref.WeakValueDictionary()  # uid -> te.Linear


def uid_of(module):
    """The uid register_module gave `module`."""
    uid = module.__dict__.get("_tequant_uid")
    if uid is None:
        raise RuntimeError("te.Linear._tequant_uid missing")  # set in Linear.__init__
    return uid


def register_module(module):
    """Gives a te.Linear the uid the constants below find it by (Linear.__init__, copies)."""
    uid = str(len(_MODULES)) + "." + str(id(module))
    module.__dict__["_tequant_uid"] = uid
    _MODULES[uid] = module


@_compile.constant
def ensure_buffers(uid, length):
    """Creates a module's DelayedScaling buffers for real while Dynamo traces (it runs once,
    at trace time): buffers made inside the graph would be graph outputs, which the backward
    cannot update in place; made here they are ordinary module buffers (graph inputs)."""
    delayed.ensure(_MODULES[uid], length)
    return True


@_compile.constant
def check_tp_recipe(uid, recipe_id):
    """The tensor-parallel group's one-time recipe agreement check (tensor_parallel.py), run
    while Dynamo traces: every rank traces the same code, so every rank takes part."""
    _MODULES[uid]._tp.check_recipe(_C._recipe_of_key(int(recipe_id)), int(recipe_id))
    return True
