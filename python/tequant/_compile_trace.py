"""What te.ops and QuantizedTensor run while torch.compile traces them.

ops.py and quantized.py import this module inside their `torch.compiler.is_compiling()`
branches (it needs torch._dynamo, which `import tequant` should not load); it imports neither. The traced code
cannot read a QuantizerConfig (a C object): it names a config by the recipe's registry key
`recipe._tequant_id` (Dynamo guards on the string's value, so an equal recipe reuses the compiled
code and another one recompiles) and the role, and learns what it needs (scaling, which members
exist, ...) from `assume_constant_result` functions of those strings, evaluated at trace time.
The kernels run as the custom ops of _compile_ops.py.

Errors: a constant function reports an error as a value and the traced code raises it, so a bad
argument raises eager's exception and message (with fullgraph=True Dynamo reports it as an
"Observed exception" quoting the message; without, the graph break runs eager's code). MXFP8 /
NVFP4 shape errors come from the quantize op's fake implementation (a TorchRuntimeError quoting
eager's message); errors the C call meets as it runs are eager's exception itself.
Tests: tests/test_compile_ops.py.
"""
import weakref

import torch

from . import _C, _compile_ops
from .recipe import Recipe

_ERRORS = {"TypeError": TypeError, "ValueError": ValueError, "KeyError": KeyError}


@torch.compiler.assume_constant_result
def _recipe_error(recipe):
    """The (exception name, message) te.ops raises for `recipe`, which is not a Recipe."""
    try:
        _C.quantizer_config(recipe, "input")
    except (TypeError, ValueError) as e:
        return (type(e).__name__, str(e))
    return ("TypeError", f"recipe {recipe!r} cannot be used under torch.compile")


@torch.compiler.assume_constant_result
def _config_info(recipe_id, role, usage):
    """(recipe_id, scaling, stochastic_rounding, present, error) for a recipe_id (None: the
    default recipe) and role: `present` says which of the 6 members quantize makes for usage
    (0: none asked), `error` is None or the (exception name, message) eager would raise."""
    try:
        if recipe_id is None:
            recipe_id = str(_C.recipe_key(None))
        if not isinstance(role, str):
            _C.quantizer_config(None, role)  # raises eager's ValueError
        config = _compile_ops.config_of(recipe_id, role)
        present = ()
        if usage and config.scaling not in ("none", "custom"):
            present = tuple(m is not None for m in _C._quantize_layout(config, 0, 0, usage))
        return (recipe_id, config.scaling, config.stochastic_rounding, present, None)
    except (TypeError, ValueError, KeyError) as e:
        return (recipe_id, None, False, (), (type(e).__name__, str(e)))


@torch.compiler.assume_constant_result
def _config_fields(recipe_id, role):
    """(format, scaling, block, two_d) of a config, for QuantizedTensor.codes() / scales()."""
    config = _compile_ops.config_of(recipe_id, role)
    return (config.format, config.scaling, config.block, config.two_d)


_DRAW_SITES = weakref.WeakKeyDictionary()  # TracingContext -> stochastic-rounding calls traced


@torch.compiler.assume_constant_result
def _draw_site():
    """0, 1, 2, ...: the stochastic-rounding quantize calls without rng= in the graph being
    traced, passed to the op so that no graph pass (AOT's CSE) merges two of them: each draws
    its own bits at run time, as each eager call does. Counted per trace, so a retrace gives
    the same graph (compile caches keep working)."""
    context = torch._guards.TracingContext.try_get()
    if context is None:
        return 0
    site = _DRAW_SITES.get(context, 0)
    _DRAW_SITES[context] = site + 1
    return site


def resolve(recipe, role, usage=0):
    """(recipe_id, scaling, stochastic_rounding, present) of (recipe, role), raising the error
    eager te.ops raises for a bad recipe or role."""
    recipe_id = None
    if recipe is not None:
        if not isinstance(recipe, Recipe):
            kind, message = _recipe_error(recipe)
            raise _ERRORS[kind](message)
        recipe_id = getattr(recipe, "_tequant_id", None)
        if recipe_id is None:
            raise ValueError(f"{type(recipe).__name__} was built inside the compiled region, "
                             "where it gets no registry key: build recipes outside it")
    recipe_id, scaling, stochastic_rounding, present, error = _config_info(recipe_id, role, usage)
    if error is not None:
        raise _ERRORS[error[0]](error[1])
    return recipe_id, scaling, stochastic_rounding, present


def _key_of(q):
    """(recipe_id, role) of a QuantizedTensor."""
    if q.role is None:
        raise ValueError("this QuantizedTensor was built from a QuantizerConfig alone; under "
                         "torch.compile it needs the recipe and role te.ops.quantize records")
    return resolve(q.recipe, q.role)[0], q.role


def config_fields(q):
    """(format, scaling, block, two_d) of q's config."""
    return _config_fields(*_key_of(q))


def _signed64(v):
    """An unsigned 64-bit rng value as the int64 an op schema carries (C masks it back)."""
    return v - 2**64 if v >= 2**63 else v


def quantize(x, recipe, recipe_id, role, usage, scale, amax_history, rng, stochastic, present):
    """te.ops.quantize's C call through tequant::quantize: the six members (None where absent)
    that te.ops.quantize wraps in a QuantizedTensor. The op returns a fresh amax; a
    DelayedScaling history slot takes max(slot, amax), as the kernel does."""
    draw_site, rng_state = 0, None
    if isinstance(rng, torch.Tensor):
        rng, rng_state = None, rng
    elif rng is not None:
        rng = [_signed64(rng[0]), _signed64(rng[1])]
    elif stochastic:
        draw_site = _draw_site()
    # detach: eager's members never require grad (the C call reads x's data)
    found = iter(_compile_ops.quantize_op(x.detach(), recipe_id, role, usage, scale, rng,
                                          rng_state, draw_site))
    members = tuple(next(found) if p else None for p in present)
    if amax_history is not None:
        amax = members[4]
        amax_history.copy_(torch.maximum(amax_history, amax.reshape(amax_history.shape)))
        members = members[:4] + (amax_history, members[5])
    return members


def dequantize(q, usage, dtype):
    """QuantizedTensor.dequantize_direction through tequant::dequantize."""
    recipe_id, role = _key_of(q)
    return _compile_ops.dequantize_op(list(q._member_tuple), recipe_id, role, q.rows, q.cols,
                                      usage, dtype)


def _bytes(member):
    """An E8M0 scale member as its uint8 bytes, which the C core takes for any 8-bit member:
    Inductor's pass that lowers a mutating op (gemm_out) skips any op with an E8M0 operand."""
    if member is not None and member.dtype == torch.float8_e8m0fnu:
        return member.view(torch.uint8)
    return member


def operand(q, usage):
    """The op arguments of one GEMM operand (members, recipe_id, role, rows, cols, usage), the
    counterpart of ops._operand's (config, rows, cols, members, usage)."""
    recipe_id, role = _key_of(q)
    return ([_bytes(m) for m in q._member_tuple], recipe_id, role, q.rows, q.cols, usage)


def gemm(spec_a, spec_b, out, out_dtype, bias, flags):
    """ops.gemm's _C._gemm call through tequant::gemm or tequant::gemm_out."""
    if bias is not None:
        bias = bias.detach()  # as in eager, the product does not require grad
    if out is None:
        return _compile_ops.gemm_op(*spec_a, *spec_b, out_dtype, bias, flags)
    _compile_ops.gemm_out_op(*spec_a, *spec_b, out, bias, flags)
    return out
