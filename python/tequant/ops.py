"""te.ops: the stateless functional API (quantize, dequantize; gemm arrives with the GEMM issue).

For users who want no module state: `q = te.ops.quantize(x, recipe, role="input")` quantizes
with exactly the quantizer a te.Linear would use for that role under that recipe, on CPU (the C
reference) or CUDA (the kernels), and `te.ops.dequantize(q)` reads it back.
Tests: tests/test_ops.py and tests/test_quantize_*.py.
"""
import torch

from . import _C
from .quantized import COLUMNWISE, ROWWISE, QuantizedTensor

__all__ = ["quantize", "dequantize"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _rng_state(device, generator):
    """(seed, offset) for stochastic rounding from `generator` or the device's default one,
    advancing it so successive calls draw different bits (NUMERICS.md 3.2)."""
    if device.type == "cuda":
        gen = generator or torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()]
        offset = gen.get_offset()
        gen.set_offset(offset + 4)
        return gen.initial_seed(), offset
    # The CPU generator (mt19937) has no Philox offset: draw the offset from it instead, which
    # advances it and stays reproducible under torch.manual_seed.
    gen = generator or torch.default_generator
    offset = int(torch.randint(0, 2**62, (), generator=gen))
    return gen.initial_seed(), offset


def _checked_rng(rng):
    try:
        seed, offset = (int(v) for v in rng)
    except (TypeError, ValueError):
        raise ValueError(f"rng must be a (seed, offset) pair of ints, got {rng!r}") from None
    if not (0 <= seed < 2**64 and 0 <= offset < 2**64):
        raise ValueError(f"rng=(seed, offset) must both be in [0, 2**64), got {rng!r}")
    return seed, offset


def quantize(x, recipe=None, role="input", rowwise=True, columnwise=False, *, scale=None,
             amax_history=None, generator=None, rng=None):
    """Quantizes x with the quantizer `recipe` (None: Float8CurrentScaling()) gives `role`.

    Args:
        x: a float32, bfloat16 or float16 tensor on CPU or CUDA, [..., K] with the last dim
            contiguous; its leading dims are flattened into M rows.
        recipe, role: which quantizer ('input', 'weight', 'output', 'grad_output', 'grad_input').
        rowwise: produce data [M, K] with blocks along K.
        columnwise: produce data_t [K, M] (the physical transpose, blocks along M; NVFP4 with RHT
            applies the transform here, and only here).
        scale: DelayedScaling only: the float32 [1] scale to cast with (default 1.0).
        amax_history: DelayedScaling only: a float32 [1] view (a history row's slot) that the
            amax of x is max-accumulated into; default a fresh tensor returned as q.amax.
        generator: the torch.Generator that seeds stochastic rounding (default: the device's).
        rng: (seed, offset) to use instead of a generator, to reproduce exact bits.

    Returns a QuantizedTensor. MXFP8 needs M and K multiples of 32, NVFP4 of 16 (ValueError
    otherwise); per-tensor and block FP8 take any shape.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"x has dtype {x.dtype}; expected torch.float32, torch.bfloat16 or "
                         "torch.float16")
    if not (rowwise or columnwise):
        raise ValueError("rowwise and columnwise are both False: ask for at least one direction")
    config = _C.quantizer_config(recipe, role)
    if config.scaling == "custom":
        raise NotImplementedError(
            "CustomRecipe quantizers are user objects: call the quantizer its qfactory returns "
            "for this role directly")
    if config.scaling == "none":
        raise ValueError(f"the recipe does not quantize the {role!r} role")
    if config.scaling != "delayed" and (scale is not None or amax_history is not None):
        raise ValueError("scale and amax_history apply to DelayedScaling only; this recipe's "
                         f"{role!r} quantizer uses {config.scaling} scaling")
    for name, t in (("scale", scale), ("amax_history", amax_history)):
        if t is not None and not (isinstance(t, torch.Tensor) and t.dtype == torch.float32
                                  and t.numel() == 1 and t.device == x.device):
            got = (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"{name} must be a float32 tensor of one element on x's device "
                             f"({x.device}), e.g. a view history[0, i:i+1]; got {got}")
    if generator is not None and generator.device.type != x.device.type:
        raise ValueError(f"generator is on {generator.device}, x on {x.device}: stochastic "
                         "rounding draws from a generator of x's device")
    seed = offset = 0
    if config.stochastic_rounding:
        if rng is not None:
            seed, offset = _checked_rng(rng)
        else:
            seed, offset = _rng_state(x.device, generator)
    usage = (ROWWISE if rowwise else 0) | (COLUMNWISE if columnwise else 0)
    members = _C._quantize(x, config, usage, scale, amax_history, seed, offset)
    return QuantizedTensor(config, x.shape, x.dtype, members)


def dequantize(q, dtype=torch.float32):
    """The high-precision values of a QuantizedTensor in its logical shape (see
    QuantizedTensor.dequantize); dtype is torch.float32, torch.bfloat16 or torch.float16."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a tequant.QuantizedTensor, got {type(q).__name__}")
    if dtype not in _FLOATS:
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    return q.dequantize(dtype)
