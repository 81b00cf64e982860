"""te.ops: the stateless functional API: quantize, dequantize and gemm.

For users who want no module state: `q = te.ops.quantize(x, recipe, role="input")` quantizes
with exactly the quantizer a te.Linear would use for that role under that recipe, on CPU (the C
reference) or CUDA (the kernels), `te.ops.dequantize(q)` reads it back, and
`te.ops.gemm(qa, qb, ...)` multiplies two quantized tensors as Linear's GEMMs do.
Under torch.compile the same functions trace (_compile_trace.py): the C calls become the
tequant:: custom ops of _compile_ops.py. Eager calls go to C directly.
Tests: tests/test_ops.py, tests/test_quantize_*.py, tests/test_gemm.py and
tests/test_compile_ops.py.
"""
import torch

from . import _C, _compile_ops  # noqa: F401  (registers the tequant:: ops)
from ._rng import checked_rng, rng_state
from .quantized import COLUMNWISE, ROWWISE, QuantizedTensor

__all__ = ["quantize", "dequantize", "gemm"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def quantize(x, recipe=None, role="input", rowwise=True, columnwise=False, *, scale=None,
             amax_history=None, generator=None, rng=None, amax=None):
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
        generator: the torch.Generator that seeds stochastic rounding (default: the device's;
            torch.compile cannot trace one: pass rng there).
        rng: (seed, offset) to use instead of a generator, to reproduce exact bits; or an int64
            tensor of two elements (seed, offset as their 64 bits) on x's device, which the
            kernel reads when it runs: a CUDA graph then rounds with whatever it holds at each
            replay. Without either, a CUDA graph capture draws the pair inside the graph, so
            each replay rounds with new bits (reproducible under torch.manual_seed).
        amax: Float8CurrentScaling and NVFP4 only: the float32 amax (a tensor of one element on
            x's device; NVFP4 also two: rowwise, columnwise) that the per-tensor scale is computed
            from instead of x's own. A shard of a tensor passes the amax all-reduced (MAX) over
            the shards and gets exactly the shard of the whole tensor's quantization (rows of
            the rowwise data; per-block formats need the shard aligned to their blocks). NVFP4
            with RHT needs the columnwise (transformed) amax too when columnwise=True.

    Returns a QuantizedTensor. MXFP8 needs M and K multiples of 32, NVFP4 of 16 (ValueError
    otherwise); per-tensor and block FP8 take any shape.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"x has dtype {x.dtype}; expected torch.float32, torch.bfloat16 or "
                         "torch.float16")
    if x.dim() == 0:
        raise ValueError("x is a 0-d tensor; quantize takes [..., K] (at least one dim): "
                         "x.reshape(1) for a scalar")
    if not (rowwise or columnwise):
        raise ValueError("rowwise and columnwise are both False: ask for at least one direction")
    usage = (ROWWISE if rowwise else 0) | (COLUMNWISE if columnwise else 0)
    compiling = torch.compiler.is_compiling()
    if not compiling and x.is_neg():  # a lazy negation (z.conj().imag): DLPack hands C the
        x = x.resolve_neg()           # unnegated memory (compiled graphs pass dense tensors)
    if compiling:  # the config is a C object: trace with its key and facts instead
        from . import _compile_trace as traced
        recipe_id, scaling, stochastic, present = traced.resolve(recipe, role, usage)
    else:
        config = _C.quantizer_config(recipe, role)
        scaling, stochastic = config.scaling, config.stochastic_rounding
    if scaling == "custom":
        raise NotImplementedError(
            "CustomRecipe quantizers are user objects: call the quantizer its qfactory returns "
            "for this role directly")
    if scaling == "none":
        raise ValueError(f"the recipe does not quantize the {role!r} role")
    if amax is not None:
        if scaling not in ("current", "nvfp4"):
            raise ValueError(f"amax applies to Float8CurrentScaling and NVFP4 (a per-tensor scale "
                             f"from an amax); this recipe's {role!r} quantizer uses {scaling} "
                             "scaling")
        if not (isinstance(amax, torch.Tensor) and amax.dtype == torch.float32
                and amax.device == x.device and amax.numel() in ((1, 2) if scaling == "nvfp4"
                                                                 else (1,))):
            got = (f"{amax.dtype} {tuple(amax.shape)} on {amax.device}"
                   if isinstance(amax, torch.Tensor) else type(amax).__name__)
            raise ValueError(f"amax must be a float32 tensor of one element (NVFP4: one or two) "
                             f"on x's device ({x.device}); got {got}")
        if compiling:
            raise NotImplementedError("te.ops.quantize(amax=...) is not supported under "
                                      "torch.compile yet")
        amax = amax.contiguous()
    if scaling != "delayed" and (scale is not None or amax_history is not None):
        raise ValueError("scale and amax_history apply to DelayedScaling only; this recipe's "
                         f"{role!r} quantizer uses {scaling} scaling")
    for name, t in (("scale", scale), ("amax_history", amax_history)):
        if t is not None and not (isinstance(t, torch.Tensor) and t.dtype == torch.float32
                                  and t.numel() == 1 and t.device == x.device):
            got = (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"{name} must be a float32 tensor of one element on x's device "
                             f"({x.device}), e.g. a view history[0, i:i+1]; got {got}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator is not None and generator.device.type != x.device.type:
        raise ValueError(f"generator is on {generator.device}, x on {x.device}: stochastic "
                         "rounding draws from a generator of x's device")
    chosen = None  # the rng C reads: (seed, offset) or a device tensor
    if stochastic:
        if rng is not None:
            chosen = checked_rng(rng, x.device)
        elif not compiling:
            chosen = rng_state(x.device, generator)
        elif generator is not None:
            raise ValueError("generator= cannot be traced by torch.compile: pass rng=(seed, "
                             "offset), or neither to draw from the device's default generator")
    if compiling:
        members = traced.quantize(x, recipe, recipe_id, role, usage, scale, amax_history,
                                  chosen, stochastic, present)
        return QuantizedTensor(None, x.shape, x.dtype, members, recipe, role)
    members = _C._quantize(x, config, usage, scale, amax_history, chosen, amax)
    return QuantizedTensor(config, x.shape, x.dtype, members, recipe, role)


def dequantize(q, dtype=torch.float32):
    """The high-precision values of a QuantizedTensor in its logical shape (see
    QuantizedTensor.dequantize); dtype is torch.float32, torch.bfloat16 or torch.float16."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a tequant.QuantizedTensor, got {type(q).__name__}")
    if dtype not in _FLOATS:
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    return q.dequantize(dtype)


def _operand(q, usage, name, compiling):
    """The (config, rows, cols, members, usage) spec _C._gemm takes for one direction of q
    (under torch.compile: the tequant::gemm arguments, _compile_trace.operand)."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"{name} must be a tequant.QuantizedTensor, got {type(q).__name__}")
    members = q._member_tuple
    if members[0 if usage == ROWWISE else 2] is None:
        direction = "rowwise" if usage == ROWWISE else "columnwise"
        raise ValueError(f"{name} has no {direction} data, which this product reads "
                         f"(quantize {name} with {direction}=True)")
    if compiling:
        from . import _compile_trace
        return _compile_trace.operand(q, usage)
    return (q.config, q.rows, q.cols, members, usage)


def gemm(a, b, *, transpose_a=False, transpose_b=False, out_dtype=None, bias=None, out=None,
         accumulate=False, use_split_accumulator=True):
    """op(a) @ op(b) (+ bias) for two QuantizedTensors, as te.Linear's GEMMs compute it.

    op transposes its operand when transpose_a / transpose_b is set. The direction each operand
    must have been quantized with follows: a rowwise (columnwise when transpose_a), b columnwise
    (rowwise when transpose_b). Linear's three products:

        fprop  y  = x @ W.T   gemm(qx, qw, transpose_b=True)     TE layout "TN"
        dgrad  dx = dy @ W    gemm(qdy, qw)                      TE layout "NN"
        wgrad  dW = dy.T @ x  gemm(qdy, qx, transpose_a=True)    TE layout "NT"

    Args:
        a: [..., K] (leading dims kept in the result) or, with transpose_a, a 2-D [K', M] view
            whose rows are contracted.
        b: [K, N], or [N, K] with transpose_b.
        out_dtype: torch.float32, bfloat16 or float16 (FP8 pairs) / float32 or bfloat16
            (MXFP8, NVFP4); default a.dtype, the dtype a was quantized from.
        bias: [N], added in the GEMM's epilogue after converting it to the dtype the epilogue
            takes (FP8: bfloat16, or float16 beside a float16 output; MXFP8/NVFP4: out_dtype).
        out: a contiguous result tensor to write (of out_dtype when given).
        accumulate: add the product into out (gradient accumulation); needs out.
        use_split_accumulator: False selects Hopper's FP8 fast accumulation (per-tensor FP8
            pairs only; block-scaled, MXFP8 and NVFP4 GEMMs always accumulate in full FP32).

    Pairs: FP8 per-tensor x FP8 per-tensor (delayed and current mix), FP8 block 1x128 x 1x128 or
    x 128x128, MXFP8 x MXFP8, NVFP4 x NVFP4. On CUDA the FP8 pairs run natively in cuBLASLt and
    MXFP8/NVFP4 are emulated exactly (BF16 dequantization, BF16 GEMM, NVFP4's global factor as
    alpha); on CPU the dequantized values are multiplied in float32. Other pairs, E5M2 x E5M2
    and two 128x128-block operands raise NotImplementedError; FP8 needs K % 16 == 0 (ValueError).
    """
    usage_a = COLUMNWISE if transpose_a else ROWWISE
    usage_b = ROWWISE if transpose_b else COLUMNWISE
    compiling = torch.compiler.is_compiling()
    spec_a = _operand(a, usage_a, "a", compiling)
    spec_b = _operand(b, usage_b, "b", compiling)
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else a.dtype
    elif out is not None and out.dtype != out_dtype:
        raise ValueError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
    if accumulate and out is None:
        raise ValueError("accumulate=True adds the product into out: pass out=")
    lead = a.shape[:-1] if not transpose_a and len(a.shape) != 2 else None  # 1-D a: [N] out
    out_2d = out
    if out is not None and lead is not None:
        if out.shape[:-1] != lead:
            raise ValueError(f"out has shape {tuple(out.shape)}; the product is "
                             f"{tuple(lead) + (out.shape[-1],)}")
        out_2d = out.view(-1, out.shape[-1])
    elif out is not None and out.dim() != 2:
        # the product of a 2-D a (or of transpose_a) is [M, N]: C would take any out whose
        # leading dims merge to M and hand it back in a shape the product does not have
        m = a.cols if transpose_a else a.rows
        n = b.rows if transpose_b else b.cols
        raise ValueError(f"out has shape {tuple(out.shape)}; the product is ({m}, {n})")
    flags = ((_C.GEMM_ACCUMULATE if accumulate else 0)
             | (0 if use_split_accumulator else _C.GEMM_FAST_ACCUM))
    if compiling:
        from . import _compile_trace
        result = _compile_trace.gemm(spec_a, spec_b, out_2d, out_dtype, bias, flags)
    else:
        result = _C._gemm(spec_a, spec_b, out_2d, out_dtype, bias, flags)
    if out is not None:
        return out
    return result.view(*lead, result.shape[-1]) if lead is not None else result
