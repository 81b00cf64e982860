"""te.convert: turn a model's torch.nn.Linear layers into te.Linear, in place.

Each converted layer stays the same Python object with the same parameter tensors (its class
becomes te.Linear, a torch.nn.Linear subclass, as FSDP2 does with its own classes), so optimizer
state, tied weights, hooks and every reference to the layer keep working. Only layers whose type
is exactly torch.nn.Linear are converted: a subclass may have a forward of its own, or not be
called at all (torch.nn.MultiheadAttention reads its out_proj's weight directly). Layers whose
feature dims miss the alignment a recipe's format needs (16, 32 for MXFP8) or whose dtype is
not float32 / bfloat16 / float16 stay as they are and are reported in one warning, as torchao's
convert_to_float8_training skips them. te.prepare_state (here beside convert, as another walk
over a model's te.Linear layers) makes the state a first forward would. Tests:
tests/test_convert.py, tests/test_linear_module.py (prepare_state).
"""
import warnings

import torch

from . import _C, _custom_linear, delayed
from ._plan import ALIGN as _ALIGN
from .linear import Linear
from .recipe import Recipe

__all__ = ["convert", "prepare_state"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _alignment(recipe):
    """The feature multiple te.Linear needs under `recipe` (None: under every built-in one)."""
    if recipe is None:
        return max(_ALIGN.values())
    if recipe.custom():
        return 1
    return _ALIGN[_C.quantizer_config(recipe, "input").scaling]


def _why_not(layer, align):
    """Why `layer` (a torch.nn.Linear) cannot be a te.Linear, or None."""
    for name in ("in_features", "out_features"):
        dim = getattr(layer, name)
        if dim <= 0:
            return f"{name}={dim} (te.Linear needs at least one feature)"
        if dim % align:
            return f"{name}={dim} is not a multiple of {align}"
    if layer.weight.dtype not in _DTYPES:
        return f"dtype {layer.weight.dtype} is not float32, bfloat16 or float16"
    return None


def convert(module, filter_fn=None, *, recipe=None):
    """Converts, in place, every torch.nn.Linear inside `module` (itself included) to te.Linear,
    keeping its parameter tensors, and returns `module`.

    Args:
        module: any torch.nn.Module.
        filter_fn: filter_fn(layer, fqn) -> bool chooses the layers to convert (fqn: the name
            in module.named_modules(), "" for module itself); default: all of them.
        recipe: the recipe the model will run (its format's alignment decides which layers can
            convert); None: every built-in recipe (dims multiples of 32).

    Layers left as they are because of their dims or dtype are named in one UserWarning.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"te.convert takes a torch.nn.Module, got {type(module).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable as filter_fn(module, fqn), got "
                        f"{type(filter_fn).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a tequant recipe or None, got {type(recipe).__name__}")
    align = _alignment(recipe)
    skipped = []
    for fqn, layer in module.named_modules():
        if type(layer) is not torch.nn.Linear or (filter_fn is not None
                                                   and not filter_fn(layer, fqn)):
            continue
        reason = _why_not(layer, align)
        if reason is not None:
            skipped.append(f"{fqn or '<root>'} ({reason})")
            continue
        layer.__class__ = Linear
        Linear._adopt(layer)
    if skipped:
        warnings.warn(f"te.convert: {len(skipped)} torch.nn.Linear layer(s) stay in high "
                      f"precision: {'; '.join(skipped)}", UserWarning, stacklevel=2)
    return module


def prepare_state(model, recipe):
    """Creates the state te.Linear keeps between steps under `recipe` (DelayedScaling's amax
    histories and scales; a CustomRecipe's quantizers) in every te.Linear of `model` lacking it,
    as the first forward would; returns model. Needed before torch.distributed.checkpoint loads
    into a fresh model (it reads only entries the model has), and under a CustomRecipe before
    torch.compile(fullgraph=True) traces a checkpointed region (made there, the quantizers would
    change the module inside torch's checkpoint operator)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"te.prepare_state takes a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a tequant.recipe.Recipe, got {type(recipe).__name__}")
    for module in model.modules():
        if isinstance(module, Linear) and recipe.custom():
            _custom_linear.quantizers(module, recipe)
        elif isinstance(module, Linear):
            plan = module._plan(recipe)
            if plan.delayed:
                delayed.ensure(module, plan.x.amax_history_len)
    return model
