"""Environment overrides for tequant: the one place that reads TEQUANT_* variables.

This is the table of every variable (VARIABLES) plus the readers that recipe defaults call.
It is not a configuration system: nothing is cached, and only recipe field defaults use it.
Tested by tests/test_recipe.py; the user-facing table is docs/environment.md.

The readers are called from `dataclasses.field(default_factory=...)`, so a variable is read
each time a recipe is constructed without that field (not at import time as TE does). That
lets a test or a launcher change a default with os.environ without reloading the module.
tequant does not read TE's NVTE_* names: one spelling per setting keeps behaviour explicit.
"""

import os
from typing import NamedTuple, Optional, Tuple


class EnvVar(NamedTuple):
    name: str
    kind: str  # "flag" or "text"
    default: Optional[str]
    meaning: str
    te_name: str
    choices: Tuple[str, ...] = ()


# Keep docs/environment.md in step with this table; a test compares the two.
VARIABLES = {
    v.name: v
    for v in (
        EnvVar(
            "TEQUANT_FP8_CURRENT_SCALING_POWER_2_SCALES", "flag", "0",
            "Float8CurrentScaling.use_power_2_scales default: round per-tensor scales "
            "down to a power of two.",
            "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES",
        ),
        EnvVar(
            "TEQUANT_FP8_BLOCK_SCALING_FP32_SCALES", "flag", "0",
            "Float8BlockScaling.use_f32_scales default: keep full FP32 block scales "
            "instead of powers of two.",
            "NVTE_FP8_BLOCK_SCALING_FP32_SCALES",
        ),
        EnvVar(
            "TEQUANT_NVFP4_DISABLE_RHT", "flag", "0",
            "NVFP4BlockScaling.disable_rht default: no random Hadamard transform on the "
            "columnwise copies of inputs and gradients.",
            "NVTE_NVFP4_DISABLE_RHT",
        ),
        EnvVar(
            "TEQUANT_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "flag", "0",
            "NVFP4BlockScaling.disable_stochastic_rounding default: round gradients to "
            "nearest instead of stochastically.",
            "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING",
        ),
        EnvVar(
            "TEQUANT_NVFP4_DISABLE_2D_QUANTIZATION", "flag", "0",
            "NVFP4BlockScaling.disable_2d_quantization default: 1x16 weight blocks "
            "instead of 16x16.",
            "NVTE_NVFP4_DISABLE_2D_QUANTIZATION",
        ),
        EnvVar(
            "TEQUANT_BACKWARD_OVERRIDE", "text", None,
            "backward_override default of every recipe except DelayedScaling "
            "(unset: quantized backward).",
            "NVTE_BACKWARD_OVERRIDE",
            ("high_precision", "dequantized"),
        ),
    )
}

_TRUE = ("1", "true")
_FALSE = ("0", "false")


def _lookup(name: str, kind: str) -> EnvVar:
    var = VARIABLES.get(name)
    if var is None or var.kind != kind:
        raise KeyError(f"{name!r} is not a tequant {kind} environment variable")
    return var


def _raw(var: EnvVar) -> Optional[str]:
    # An empty value counts as unset: `export VAR=` is the common way to clear one.
    value = os.environ.get(var.name, "").strip()
    return value if value else var.default


def flag(name: str) -> bool:
    """Read boolean variable `name`: "1"/"true" or "0"/"false" (any case); unset gives its default."""
    var = _lookup(name, "flag")
    value = _raw(var)
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(
        f"environment variable {name}={value!r} is invalid: expected 1, 0, true or false"
    )


def text(name: str) -> Optional[str]:
    """Read text variable `name`; unset or empty gives its default, other values must be a listed choice."""
    var = _lookup(name, "text")
    value = _raw(var)
    if value is not None and var.choices and value not in var.choices:
        raise ValueError(
            f"environment variable {name}={value!r} is invalid: expected one of "
            f"{', '.join(repr(c) for c in var.choices)} or unset"
        )
    return value


# Zero-argument readers for dataclasses.field(default_factory=...).
def fp8_current_scaling_power_2_scales() -> bool:
    return flag("TEQUANT_FP8_CURRENT_SCALING_POWER_2_SCALES")


def fp8_block_scaling_fp32_scales() -> bool:
    return flag("TEQUANT_FP8_BLOCK_SCALING_FP32_SCALES")


def nvfp4_disable_rht() -> bool:
    return flag("TEQUANT_NVFP4_DISABLE_RHT")


def nvfp4_disable_stochastic_rounding() -> bool:
    return flag("TEQUANT_NVFP4_DISABLE_STOCHASTIC_ROUNDING")


def nvfp4_disable_2d_quantization() -> bool:
    return flag("TEQUANT_NVFP4_DISABLE_2D_QUANTIZATION")


def backward_override() -> Optional[str]:
    return text("TEQUANT_BACKWARD_OVERRIDE")
