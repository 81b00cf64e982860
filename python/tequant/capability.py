"""Availability helpers with TransformerEngine's signatures, over te.execution_mode.

A recipe family is available when te.execution_mode gives it "native", "emulated" or
"cpu-reference" on the current device (the CPU when no CUDA device is usable): tequant runs
every recipe somewhere, so only an unsupported GPU makes these False. The reason string is ""
when available, as in TE; te.execution_mode(recipe) says how it runs. Also the deprecated
te.fp8_autocast alias. Tests: tests/test_device.py, tests/test_autocast.py.
"""
import warnings

from . import recipe as _recipe
from ._C import autocast, execution_mode


def _available(recipe, return_reason):
    mode, reason = execution_mode(recipe)
    ok = mode != "unsupported"
    return (ok, "" if ok else reason) if return_reason else ok


def is_fp8_available(return_reason=False):
    """Whether per-tensor FP8 (DelayedScaling, Float8CurrentScaling) can run here."""
    return _available(_recipe.Float8CurrentScaling(), return_reason)


def is_fp8_block_scaling_available(return_reason=False):
    """Whether Float8BlockScaling can run here (Hopper with cuBLASLt >= 12.9, or the CPU)."""
    return _available(_recipe.Float8BlockScaling(), return_reason)


def is_mxfp8_available(return_reason=False):
    """Whether MXFP8BlockScaling can run here (emulated on Hopper: see te.execution_mode)."""
    return _available(_recipe.MXFP8BlockScaling(), return_reason)


def is_nvfp4_available(return_reason=False):
    """Whether NVFP4BlockScaling can run here (emulated on Hopper: see te.execution_mode)."""
    return _available(_recipe.NVFP4BlockScaling(), return_reason)


def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None):
    """Deprecated alias of te.autocast (TransformerEngine's old name and argument names)."""
    warnings.warn("fp8_autocast is deprecated and will be removed in a future release. Use "
                  "te.autocast(enabled=..., calibrating=..., recipe=..., "
                  "amax_reduction_group=...) instead.", DeprecationWarning, stacklevel=2)
    return autocast(enabled, calibrating, fp8_recipe, fp8_group)
