"""The parameter types tequant.recipe's recipes are built from, re-exported there: Format (the
element formats), MMParams (a GEMM's options), QParams (a role's quantizer options; a recipe's
QParams derived from its flags are _Derived, which dataclasses.replace() re-derives) and
QuantizerRole (what a CustomRecipe's qfactory is asked for). Tested by tests/test_recipe.py.
"""

import dataclasses
import enum
import math
import numbers

from ._fields import _check_bool, _check_instance, _got, _where

_frozen = dataclasses.dataclass(frozen=True)


class Format(enum.Enum):
    """Element format of quantized tensors.

    E2M1: FP4 (max 6). E4M3: FP8 (max 448). E5M2: FP8 (max 57344).
    HYBRID: E4M3 for forward tensors (input, weight, output), E5M2 for backward tensors
    (grad_output, grad_input).
    """

    E2M1 = "E2M1"
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def max_fwd(self) -> float:
        """Largest finite value of the forward tensors' format."""
        return _FORMAT_MAX[self][0]

    @property
    def max_bwd(self) -> float:
        """Largest finite value of the backward tensors' format."""
        return _FORMAT_MAX[self][1]

    def __repr__(self) -> str:
        # Short form so that recipe reprs read like the code that built them.
        return f"Format.{self.name}"


_FORMAT_MAX = {
    Format.E2M1: (6.0, 6.0),
    Format.E4M3: (448.0, 448.0),
    Format.E5M2: (57344.0, 57344.0),
    Format.HYBRID: (448.0, 57344.0),
}


@_frozen
class MMParams:
    """GEMM options. use_split_accumulator=False lets cuBLASLt use fast (lower-precision) FP8
    accumulation; True (default) keeps full FP32 accumulation."""

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        _check_bool(self, "use_split_accumulator")


@_frozen
class QParams:
    """Per-role quantizer options.

    power_2_scale: round scales down to a power of two (FP8 recipes).
    amax_epsilon: amax below this is raised to it before the scale is computed (FP8 recipes).
    random_hadamard_transform, stochastic_rounding, fp4_2d_quantization: NVFP4 only.
    Defaults: all off, amax_epsilon 0.0.
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self) -> None:
        for name in ("power_2_scale", "random_hadamard_transform", "stochastic_rounding",
                     "fp4_2d_quantization"):
            _check_bool(self, name)
        eps = self.amax_epsilon
        expected = "a finite real number >= 0"
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
            raise TypeError(f"{_where(self, 'amax_epsilon')} must be {expected}, {_got(eps)}")
        if not math.isfinite(eps) or eps < 0:
            raise ValueError(f"{_where(self, 'amax_epsilon')} must be {expected}, got {eps!r}")
        # 0 and 0.0 already compare and hash equal; a float keeps the repr uniform.
        object.__setattr__(self, "amax_epsilon", float(eps))

    def __eq__(self, other):  # a recipe's derived QParams (below) equals the same values
        if not isinstance(other, QParams):
            return NotImplemented
        return dataclasses.astuple(self) == dataclasses.astuple(other)

    def __hash__(self):
        return hash(dataclasses.astuple(self))


class _Derived(QParams):
    """A QParams a recipe derived from its flags (its field was None). dataclasses.replace()
    hands it back to the new recipe, which derives it again from its own flags."""

    def __repr__(self):
        return QParams.__repr__(self).replace("_Derived", "QParams", 1)


@_frozen
class QuantizerRole:
    """What a quantizer is for, as passed to a CustomRecipe's qfactory.

    module_type: e.g. "linear". tensor_type: "input", "weight", "output", "grad_output" or
    "grad_input" (free text is allowed; consumers fall back to the slot position).
    name: the module's name, if known. All default to "".
    """

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        for name in ("module_type", "tensor_type", "name"):
            _check_instance(self, name, str)
