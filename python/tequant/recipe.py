"""tequant.recipe: the quantization recipes a user passes to `tequant.autocast`.

Frozen, hashable dataclasses with TransformerEngine's fields, defaults and checks
(shared/docs/TE_REFERENCE.md section 2). They only describe a recipe: no tensors, no state and
no quantization happen here (the C extension parses a recipe once and keys its quantizers on it).
Tested by tests/test_recipe.py. Environment overrides are read in tequant/_env.py and listed in
docs/environment.md; the parameter types (Format, MMParams, QParams, QuantizerRole) live in
tequant/_recipe_params.py and are re-exported here.

Differences from TE, on purpose: invalid values raise ValueError/TypeError (TE asserts); env
variables are TEQUANT_* and are read when a recipe is built, not at import; the per-role QParams
of the FP8 recipes are constructor fields (TE: class attributes); fp8_dpa/fp8_mha must be False
because tequant has no attention modules.
"""

import dataclasses
import numbers
from typing import Any, Callable, Optional, Union

from . import _env
from ._fields import _check_bool, _check_instance, _check_int, _got, _where
from ._recipe_params import Format, MMParams, QParams, QuantizerRole, _Derived

__all__ = [
    "Format", "MMParams", "QParams", "QuantizerRole", "Recipe", "DelayedScaling",
    "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling",
    "CustomRecipe",
]

_frozen = dataclasses.dataclass(frozen=True)

BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


# ---------------------------------------------------------------------------------------------
# Validation helpers (the generic ones are in _fields.py). Each raises with
# "<Owner>.<field> must be <expected>, got <value>".

def _check_fp8_format(owner: Any, name: str = "fp8_format") -> None:
    value = _check_instance(owner, name, Format)
    why = {Format.E5M2: "Pure E5M2 training is not supported.",
           Format.E2M1: "E2M1 is a 4-bit format, use NVFP4BlockScaling for it."}.get(value)
    if why is not None:
        raise ValueError(f"{_where(owner, name)} must be Format.E4M3 or Format.HYBRID, got "
                         f"{value!r}: {why}")


def _check_exact_format(owner: Any, name: str, expected: "Format") -> None:
    value = _check_instance(owner, name, Format)
    if value is not expected:
        raise ValueError(f"{_where(owner, name)} must be {expected!r}, got {value!r}")


def _check_common(owner: Any) -> None:
    """fp8_dpa, fp8_mha and backward_override, which every recipe has."""
    for name in ("fp8_dpa", "fp8_mha"):
        _check_bool(owner, name)
        if getattr(owner, name):
            raise ValueError(
                f"{_where(owner, name)} must be False, got True: tequant has no attention "
                "modules, so FP8 attention is not supported."
            )
    value = owner.backward_override
    if value not in BACKWARD_OVERRIDES:
        raise ValueError(
            f"{_where(owner, 'backward_override')} must be one of "
            f"{', '.join(repr(v) for v in BACKWARD_OVERRIDES)}, got {value!r}"
        )


def _resolve_qparams(owner: Any, names: tuple, default: "QParams", fp4: bool) -> None:
    """Replace None QParams fields (and ones derived from an earlier recipe's flags, which
    dataclasses.replace() passes on) by `default`; check that explicit ones fit the recipe."""
    for name in names:
        value = getattr(owner, name)
        if value is None or type(value) is _Derived:
            object.__setattr__(owner, name, _Derived(**dataclasses.asdict(default)))
            continue
        q = _check_instance(owner, name, QParams)
        # Options the recipe's quantizers do not implement would be ignored silently; refuse them.
        unused = (
            ("power_2_scale", "amax_epsilon") if fp4
            else ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization")
        )
        for option in unused:
            if getattr(q, option):
                kind = "FP8 per-tensor/block" if fp4 else "NVFP4"
                raise ValueError(
                    f"{_where(owner, name)}.{option} must be off for {type(owner).__name__}, "
                    f"got {getattr(q, option)!r}: it is an option of {kind} recipes only"
                )


# ---------------------------------------------------------------------------------------------
# Recipes.

def _assign_id(recipe: "Recipe") -> None:
    """Stores the recipe's registry key as the string attribute `_tequant_id`. torch.compile
    guards on its value (tequant/_compile.py), so equal recipes share compiled code and a
    different one recompiles. Not a field (eq, hash and repr ignore it); pickling drops it, since
    keys belong to one process. Skipped while torch.compile traces a construction."""
    import torch

    if not torch.compiler.is_compiling():
        from . import _C

        object.__setattr__(recipe, "_tequant_id", str(_C.recipe_key(recipe)))


@_frozen
class Recipe:
    """Base class of all recipes. It has no fields; the predicates say which recipe this is."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "Recipe":
        import torch  # built while compiling: no registry id, and Dynamo cannot build MMParams

        if torch.compiler.is_compiling():
            raise TypeError(
                f"{cls.__name__}() built inside the compiled region: te.autocast and te.ops under "
                f"torch.compile take recipes made outside it (tequant needs a recipe built "
                f"outside the compiled code); construct it once, outside, and pass it in")
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check = cls.__dict__.get("__post_init__")
        if check is not None:
            def __post_init__(self: "Recipe", _check: Callable = check) -> None:
                _check(self)
                _assign_id(self)
            cls.__post_init__ = __post_init__

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_tequant_id", None)
        return state

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        _assign_id(self)

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self) -> bool:
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def custom(self) -> bool:
        return isinstance(self, CustomRecipe)


_BACKWARD_OVERRIDE_DOC = """
    backward_override: None (default) quantizes the backward GEMMs as the recipe says;
    "high_precision" runs dgrad/wgrad in the input precision on unquantized operands;
    "dequantized" runs them in high precision on the dequantized forward operands.
    Default from TEQUANT_BACKWARD_OVERRIDE."""

_ENV_NOTE = """
    Defaults marked "env" are read from the environment (tequant/_env.py, docs/environment.md)
    each time a recipe is constructed without that argument."""


@_frozen
class DelayedScaling(Recipe):
    """FP8 with per-tensor FP32 scales taken from a history of amaxes.

    Quantizes forward tensors to E4M3 and backward tensors to E5M2 (HYBRID); one scale per
    tensor, updated after each step from the amax history:
    scale = (fp8_max / amax) / 2**margin.

    margin=0: extra power-of-two headroom in the scale (int >= 0).
    fp8_format=Format.HYBRID (E4M3 also allowed; E5M2 and E2M1 are not).
    amax_history_len=1024: amaxes kept per tensor (int >= 1).
    amax_compute_algo="max": "max" over the history, "most_recent", or a callable
    f(amax_history) -> amax.
    scaling_factor_compute_algo=None: or a callable f(amax, old_scale, fp8_max, recipe) -> scale.
    reduce_amax=True: all-reduce amaxes over the autocast's group before the update.
    fp8_dpa=False, fp8_mha=False: must stay False in tequant.
    backward_override=None: must be None. The delayed update keeps amax histories of the
    backward tensors, which only exist when the backward GEMMs are quantized; TE allows only
    None too. Unlike the other recipes this default does NOT read TEQUANT_BACKWARD_OVERRIDE,
    so that setting the variable does not make DelayedScaling() fail.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        _check_int(self, "margin", 0)
        _check_fp8_format(self)
        _check_int(self, "amax_history_len", 1)
        algo = self.amax_compute_algo
        if isinstance(algo, str):
            if algo not in ("max", "most_recent"):
                raise ValueError(
                    f"{_where(self, 'amax_compute_algo')} must be 'max', 'most_recent' or a "
                    f"callable, got {algo!r}"
                )
        elif not callable(algo):
            raise TypeError(
                f"{_where(self, 'amax_compute_algo')} must be 'max', 'most_recent' or a "
                f"callable, {_got(algo)}"
            )
        algo = self.scaling_factor_compute_algo
        if algo is not None and not callable(algo):
            raise TypeError(
                f"{_where(self, 'scaling_factor_compute_algo')} must be None or a callable, "
                f"{_got(algo)}"
            )
        _check_bool(self, "reduce_amax")
        _check_common(self)
        if self.backward_override is not None:
            raise ValueError(
                f"{_where(self, 'backward_override')} must be None, got "
                f"{self.backward_override!r}: delayed scaling keeps amax histories of the "
                "quantized backward tensors, so its backward GEMMs cannot be overridden."
            )


@_frozen
class Float8CurrentScaling(Recipe):
    """FP8 with per-tensor FP32 scales computed from each tensor's own amax.

    Quantizes forward tensors to E4M3 and backward tensors to E5M2 (HYBRID), one scale per
    tensor: scale = fp8_max / amax of this tensor.

    use_power_2_scales=env (TEQUANT_FP8_CURRENT_SCALING_POWER_2_SCALES, else False).
    fp8_format=Format.HYBRID (E4M3 also allowed; E5M2 and E2M1 are not).
    fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad=None: None means
    QParams(power_2_scale=use_power_2_scales, amax_epsilon=0.0); pass a QParams to override one
    role (the NVFP4-only options must stay off).
    fp8_gemm_fprop=MMParams(False) (fast accumulation), fp8_gemm_dgrad=MMParams(True),
    fp8_gemm_wgrad=MMParams(True).
    fp8_dpa=False, fp8_mha=False: must stay False in tequant.
    backward_override=env.
    The None QParams are resolved at construction; `dataclasses.replace(r,
    use_power_2_scales=...)` resolves them again from the new flag (explicit ones stay).
    """

    use_power_2_scales: bool = dataclasses.field(
        default_factory=_env.fp8_current_scaling_power_2_scales)
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: Optional[QParams] = None
    fp8_quant_fwd_weight: Optional[QParams] = None
    fp8_quant_bwd_grad: Optional[QParams] = None
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = dataclasses.field(default_factory=_env.backward_override)

    def __post_init__(self) -> None:
        _check_bool(self, "use_power_2_scales")
        _check_fp8_format(self)
        _resolve_qparams(self, _FP8_QPARAMS,
                         QParams(power_2_scale=self.use_power_2_scales, amax_epsilon=0.0),
                         fp4=False)
        for name in _GEMMS:
            _check_instance(self, name, MMParams)
        _check_common(self)


_FP8_QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
_GEMMS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")


@_frozen
class MXFP8BlockScaling(Recipe):
    """MXFP8: E4M3 elements with one E8M0 (power-of-two) scale per block of 32.

    Forward and backward tensors are E4M3; blocks are 1x32 for the rowwise copy and 32x1 for the
    columnwise copy, the scale being rounded up to a power of two.

    margin=0: accepted for TE compatibility but unused (as in TE); must be an int >= 0.
    fp8_format=Format.E4M3 (HYBRID also allowed; E5M2 and E2M1 are not).
    fp8_dpa=False, fp8_mha=False: must stay False in tequant.
    backward_override=env.
    enable_2d_quantization=False: True uses 32x32 blocks for Linear weights only.
    """

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = dataclasses.field(default_factory=_env.backward_override)
    enable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _check_int(self, "margin", 0)
        _check_fp8_format(self)
        _check_bool(self, "enable_2d_quantization")
        _check_common(self)


@_frozen
class Float8BlockScaling(Recipe):
    """FP8 with FP32 scales per block: 1x128 blocks for inputs and gradients, 128x128 for weights.

    Forward and backward tensors are E4M3 by default; scales are powers of two unless
    use_f32_scales is True.

    use_f32_scales=env (TEQUANT_FP8_BLOCK_SCALING_FP32_SCALES, else False).
    fp8_format=Format.E4M3 (HYBRID also allowed; E5M2 and E2M1 are not).
    fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad=None: None means
    QParams(power_2_scale=not use_f32_scales, amax_epsilon=0.0); pass a QParams to override one
    role (the NVFP4-only options must stay off).
    x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1: 1 means 1x128
    blocks, 2 means 128x128. No GEMM may pair two 2D operands: (x, w) meet in fprop, (w, grad) in
    dgrad, (x, grad) in wgrad.
    fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad=MMParams(True): split accumulation is
    required for all three.
    fp8_dpa=False, fp8_mha=False: must stay False.
    backward_override=env.
    The None QParams are resolved at construction (see Float8CurrentScaling about replace()).
    """

    use_f32_scales: bool = dataclasses.field(default_factory=_env.fp8_block_scaling_fp32_scales)
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: Optional[QParams] = None
    fp8_quant_fwd_weight: Optional[QParams] = None
    fp8_quant_bwd_grad: Optional[QParams] = None
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = dataclasses.field(default_factory=_env.backward_override)

    def __post_init__(self) -> None:
        _check_bool(self, "use_f32_scales")
        _check_fp8_format(self)
        _resolve_qparams(self, _FP8_QPARAMS,
                         QParams(power_2_scale=not self.use_f32_scales, amax_epsilon=0.0),
                         fp4=False)
        dims = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
        for name in dims:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{_where(self, name)} must be 1 or 2, {_got(value)}")
            if value not in (1, 2):
                raise ValueError(f"{_where(self, name)} must be 1 or 2, got {value!r}")
            object.__setattr__(self, name, int(value))
        # cuBLASLt has no FP8 GEMM with 128x128 blocks on both operands.
        for a, b, gemm in (("x", "w", "fprop"), ("w", "grad", "dgrad"), ("x", "grad", "wgrad")):
            da, db = getattr(self, f"{a}_block_scaling_dim"), getattr(self, f"{b}_block_scaling_dim")
            if da == 2 and db == 2:
                raise ValueError(
                    f"{type(self).__name__}: {a}_block_scaling_dim=2 with {b}_block_scaling_dim=2 "
                    f"is not supported: the {gemm} GEMM would pair two 128x128-block (2D) "
                    "operands; make one of them 1"
                )
        for name, gemm in zip(_GEMMS, ("fprop", "dgrad", "wgrad")):
            mm = _check_instance(self, name, MMParams)
            if not mm.use_split_accumulator:
                raise ValueError(
                    f"{_where(self, name)}.use_split_accumulator must be True, got False: "
                    f"Split accumulator required for {gemm}."
                )
        _check_common(self)


@_frozen
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 elements, one E4M3 scale per block of 16, plus one FP32 scale per tensor.

    Forward and backward tensors are E2M1. Inputs and gradients use 1x16 blocks; weights use
    16x16 (2D) blocks. Defaults: a random Hadamard transform (RHT) on the columnwise copies of
    inputs and gradients (the wgrad operands), stochastic rounding on gradients, round to nearest
    elsewhere.

    disable_rht=env (TEQUANT_NVFP4_DISABLE_RHT, else False).
    disable_stochastic_rounding=env (TEQUANT_NVFP4_DISABLE_STOCHASTIC_ROUNDING, else False).
    disable_2d_quantization=env (TEQUANT_NVFP4_DISABLE_2D_QUANTIZATION, else False).
    fp4_format=Format.E2M1 and fp8_format=Format.E4M3 (the block-scale format): the only values.
    fp8_dpa=False, fp8_mha=False: must stay False in tequant.
    backward_override=env.
    fp4_quant_fwd_inp, fp4_quant_fwd_weight, fp4_quant_bwd_grad=None: None resolves from the
    disable_* flags to
      inputs:  QParams(random_hadamard_transform=not disable_rht)
      weights: QParams(fp4_2d_quantization=not disable_2d_quantization)
      grads:   QParams(random_hadamard_transform=not disable_rht,
                       stochastic_rounding=not disable_stochastic_rounding)
    An explicit QParams wins over the flags. power_2_scale/amax_epsilon must stay off, weights
    may not use RHT (dgrad would pair a transformed weight with an untransformed gradient), and
    inputs and gradients must agree on RHT (they meet in wgrad).
    TE's row_scaled_activation and 4over6 options (nvfp4_4over6*) are not supported and are
    not fields here.
    """

    disable_rht: bool = dataclasses.field(default_factory=_env.nvfp4_disable_rht)
    disable_stochastic_rounding: bool = dataclasses.field(
        default_factory=_env.nvfp4_disable_stochastic_rounding)
    disable_2d_quantization: bool = dataclasses.field(
        default_factory=_env.nvfp4_disable_2d_quantization)
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = dataclasses.field(default_factory=_env.backward_override)
    fp4_quant_fwd_inp: Optional[QParams] = None
    fp4_quant_fwd_weight: Optional[QParams] = None
    fp4_quant_bwd_grad: Optional[QParams] = None

    def __post_init__(self) -> None:
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            _check_bool(self, name)
        _check_exact_format(self, "fp4_format", Format.E2M1)
        _check_exact_format(self, "fp8_format", Format.E4M3)
        rht = not self.disable_rht
        _resolve_qparams(self, ("fp4_quant_fwd_inp",), QParams(
            random_hadamard_transform=rht, stochastic_rounding=False,
            fp4_2d_quantization=False), fp4=True)
        _resolve_qparams(self, ("fp4_quant_fwd_weight",), QParams(
            random_hadamard_transform=False, stochastic_rounding=False,
            fp4_2d_quantization=not self.disable_2d_quantization), fp4=True)
        _resolve_qparams(self, ("fp4_quant_bwd_grad",), QParams(
            random_hadamard_transform=rht,
            stochastic_rounding=not self.disable_stochastic_rounding,
            fp4_2d_quantization=False), fp4=True)
        if self.fp4_quant_fwd_weight.random_hadamard_transform:
            raise ValueError(
                f"{_where(self, 'fp4_quant_fwd_weight')}.random_hadamard_transform must be "
                "False, got True: the weight's columnwise copy feeds dgrad with an "
                "untransformed gradient, so the product would be wrong"
            )
        inp, grad = self.fp4_quant_fwd_inp, self.fp4_quant_bwd_grad
        if inp.random_hadamard_transform != grad.random_hadamard_transform:
            raise ValueError(
                f"{_where(self, 'fp4_quant_fwd_inp')}.random_hadamard_transform="
                f"{inp.random_hadamard_transform} and {_where(self, 'fp4_quant_bwd_grad')}"
                f".random_hadamard_transform={grad.random_hadamard_transform} must be equal: "
                "both columnwise copies meet in the wgrad GEMM, where the transform cancels "
                "only if it is applied to both"
            )
        _check_common(self)


@_frozen
class CustomRecipe(Recipe):
    """A recipe whose quantizers come from a user factory.

    What it quantizes, and how, is whatever the quantizers returned by
    qfactory(role: QuantizerRole) do (one call per quantizer slot).

    qfactory: required callable.
    fp8_format=Format.HYBRID: only read by internals that need a forward/backward format.
    fp8_dpa=False, fp8_mha=False: must stay False in tequant.
    backward_override=env.
    quantization_alignment=128: the row multiple tensors are padded to (int > 0).
    """

    qfactory: Callable
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = dataclasses.field(default_factory=_env.backward_override)
    quantization_alignment: int = 128

    def __post_init__(self) -> None:
        if not callable(self.qfactory):
            raise TypeError(
                f"{_where(self, 'qfactory')} must be a callable taking a QuantizerRole, "
                f"{_got(self.qfactory)}"
            )
        _check_instance(self, "fp8_format", Format)
        _check_int(self, "quantization_alignment", 1)
        _check_common(self)


# Shared paragraphs appended once here rather than repeated in each docstring.
for _cls in (Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling,
             CustomRecipe):
    if _cls.__doc__:  # None under python -OO
        _cls.__doc__ += _BACKWARD_OVERRIDE_DOC + "\n" + _ENV_NOTE
del _cls
