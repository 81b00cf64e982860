"""The tequant::quantize / dequantize / gemm / gemm_out custom ops that torch.compile traces.

Dynamo cannot trace te.ops' C calls, so under torch.compile each one runs as a torch.library
custom op: its real implementation is the same C call as eager (the same bits), its fake
implementation gives the output shapes for tracing. The traced Python that calls the ops is
_compile_trace.py. Importing this module only registers the ops (no torch._dynamo import), so
`import tequant` makes them available, e.g. to load an exported program.

A config travels as two strings, a recipe's registry key `recipe._tequant_id` and the role; the
implementations resolve them with _C._recipe_of_key and _C.quantizer_config (cached).
Rules the ops keep for functionalization: quantize, dequantize and gemm return fresh tensors
(never an input, never each other); gemm_out mutates `out` and returns nothing. DelayedScaling:
quantize takes `scale` read-only and returns the amax of x in a fresh tensor (the traced code
max-accumulates it into the history slot). Stochastic rounding without rng: quantize draws
(seed, offset) from the default generator of x's device when it runs, as each eager call does
(inside a CUDA graph capture, as a device tensor that each replay draws anew: ops._rng_state).
Tests: tests/test_compile_ops.py.
"""
import contextlib
from typing import Optional

import torch

from . import _C
from .quantized import ROWWISE

_CONFIGS = {}  # (recipe_id, role) -> QuantizerConfig
_LIB = torch.library.Library("tequant", "FRAGMENT")


def op(qualname, *, mutates_args, tags=(), kernel=None):
    """Decorator: defines `qualname` (tequant::name) from the function's annotations, with the
    function as its implementation (or `kernel`, a C function of tequant._C taking the same
    arguments: the dispatcher then calls C directly), and returns the op (torch.ops.tequant.name).
    torch.library.custom_op wraps an implementation in autograd and Dynamo-disabling layers
    that cost ~90 us per call with grad mode off (as compiled graphs run), against ~5 us for a
    plain Library op; these ops need no autograd formula (te.Linear's Function owns the
    backward, and te.ops' results are not differentiable in eager either)."""
    name = qualname.split("::")[1]

    def define(fn):
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args), tags=tags)
        _LIB.impl(name, fn if kernel is None else kernel, "CompositeExplicitAutograd")
        return getattr(torch.ops.tequant, name)
    return define


def fake(qualname):
    """Decorator: the fake (meta) implementation of a tequant op."""
    return torch.library.register_fake(qualname, lib=_LIB)


@contextlib.contextmanager
def graph_safe_workspace():
    """An op may run in a CUDA-graph memory pool (reduce-overhead warms up and records in one):
    its GEMMs then keep no cached cuBLASLt workspace past the call."""
    previous = _C._gemm_workspace_per_call(True)
    try:
        yield
    finally:
        _C._gemm_workspace_per_call(previous)


def config_of(recipe_id, role):
    """The QuantizerConfig of the recipe registered under `recipe_id` (a str) for `role`."""
    config = _CONFIGS.get((recipe_id, role))
    if config is None:
        config = _C.quantizer_config(_C._recipe_of_key(int(recipe_id)), role)
        _CONFIGS[(recipe_id, role)] = config
    return config


# ---- quantize --------------------------------------------------------------------------------

def _rows_cols(shape):
    """(M, K) of a [..., K] tensor as concrete ints (the C layout takes ints: a dynamic dim is
    specialized here, i.e. a new size recompiles)."""
    cols = int(shape[-1]) if len(shape) else 1
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows, cols


@op("tequant::quantize", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def quantize_op(x: torch.Tensor, recipe_id: str, role: str, usage: int,
                scale: Optional[torch.Tensor], rng: Optional[list[int]],
                rng_state: Optional[torch.Tensor], draw_site: int) -> list[torch.Tensor]:
    """The members _C._quantize makes (the present ones, in order). Stochastic rounding's rng:
    (seed, offset), or an int64 [2] tensor read when the kernel runs, or neither to draw from
    the default generator of x's device now; draw_site only keeps such calls apart in the graph
    (_compile_trace._draw_site)."""
    config = config_of(recipe_id, role)
    if rng_state is not None:
        chosen = rng_state
    elif rng is not None:
        chosen = tuple(rng)
    elif config.stochastic_rounding:
        from .ops import _rng_state
        chosen = _rng_state(x.device, None)
    else:
        chosen = None
    members = _C._quantize(x, config, usage, scale, None, chosen, None)
    return [m for m in members if m is not None]


@fake("tequant::quantize")
def _quantize_fake(x, recipe_id, role, usage, scale, rng, rng_state, draw_site):
    rows, cols = _rows_cols(x.shape)
    layout = _C._quantize_layout(config_of(recipe_id, role), rows, cols, usage)
    return [x.new_empty((r, c), dtype=dtype) for r, c, dtype in filter(None, layout)]


# ---- dequantize ------------------------------------------------------------------------------

def _dequantized_shape(rows, cols, usage):
    return (rows, cols) if usage == ROWWISE else (cols, rows)


def _device_of(members, usage):
    return members[0 if usage == ROWWISE else 2].device


@op("tequant::dequantize", mutates_args=())
def dequantize_op(members: list[Optional[torch.Tensor]], recipe_id: str, role: str, rows: int,
                  cols: int, usage: int, dtype: torch.dtype) -> torch.Tensor:
    """One direction's values, [rows, cols] rowwise or [cols, rows] columnwise."""
    out = torch.empty(_dequantized_shape(rows, cols, usage), dtype=dtype,
                      device=_device_of(members, usage))
    _C._dequantize(config_of(recipe_id, role), rows, cols, tuple(members), usage, out)
    return out


@fake("tequant::dequantize")
def _dequantize_fake(members, recipe_id, role, rows, cols, usage, dtype):
    return torch.empty(_dequantized_shape(rows, cols, usage), dtype=dtype,
                       device=_device_of(members, usage))


# ---- gemm ------------------------------------------------------------------------------------

def _spec(members, recipe_id, role, rows, cols, usage):
    return (config_of(recipe_id, role), rows, cols, tuple(members), usage)


@op("tequant::gemm", mutates_args=())
def gemm_op(a: list[Optional[torch.Tensor]], a_recipe_id: str, a_role: str, a_rows: int,
            a_cols: int, a_usage: int, b: list[Optional[torch.Tensor]], b_recipe_id: str,
            b_role: str, b_rows: int, b_cols: int, b_usage: int, out_dtype: torch.dtype,
            bias: Optional[torch.Tensor], flags: int) -> torch.Tensor:
    """_C._gemm into a new [M, N] tensor: a, b are one operand's members and key each."""
    with graph_safe_workspace():
        return _C._gemm(_spec(a, a_recipe_id, a_role, a_rows, a_cols, a_usage),
                        _spec(b, b_recipe_id, b_role, b_rows, b_cols, b_usage),
                        None, out_dtype, bias, flags)


@fake("tequant::gemm")
def _gemm_fake(a, a_recipe_id, a_role, a_rows, a_cols, a_usage, b, b_recipe_id, b_role, b_rows,
               b_cols, b_usage, out_dtype, bias, flags):
    m = a_rows if a_usage == ROWWISE else a_cols  # columnwise: the [K, M] operand transposed
    n = b_rows if b_usage == ROWWISE else b_cols
    return torch.empty((m, n), dtype=out_dtype, device=_device_of(a, a_usage))


@op("tequant::gemm_out", mutates_args=("out",))
def gemm_out_op(a: list[Optional[torch.Tensor]], a_recipe_id: str, a_role: str, a_rows: int,
                a_cols: int, a_usage: int, b: list[Optional[torch.Tensor]], b_recipe_id: str,
                b_role: str, b_rows: int, b_cols: int, b_usage: int, out: torch.Tensor,
                bias: Optional[torch.Tensor], flags: int) -> None:
    """_C._gemm writing (or, with the ACCUMULATE flag, adding) into the caller's `out`."""
    with graph_safe_workspace():
        _C._gemm(_spec(a, a_recipe_id, a_role, a_rows, a_cols, a_usage),
                 _spec(b, b_recipe_id, b_role, b_rows, b_cols, b_usage), out, out.dtype, bias,
                 flags)


@fake("tequant::gemm_out")
def _gemm_out_fake(a, a_recipe_id, a_role, a_rows, a_cols, a_usage, b, b_recipe_id, b_role,
                   b_rows, b_cols, b_usage, out, bias, flags):
    return None
