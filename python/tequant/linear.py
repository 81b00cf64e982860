"""te.Linear: a torch.nn.Linear whose three GEMMs run quantized inside te.autocast.

Outside te.autocast (or with enabled=False) it is exactly torch.nn.functional.linear. Inside, the
active recipe's quantizers (te.quantizer_config(recipe, role)) quantize x ("input"), W ("weight")
and dy ("grad_output"), and te.ops' GEMM runs fprop y = x W^T (x rowwise, W rowwise), dgrad
dx = dy W (dy rowwise, W columnwise) and wgrad dW = dy^T x (dy columnwise, x columnwise), as
TE_REFERENCE 7.3-7.5 describe. Backward keeps the quantized columnwise x and the quantized W, not
high-precision copies. Any number of tokens works: rows are zero-padded to the format's multiple
(zero rows add nothing to any product) and the result is exactly the unpadded one.
DelayedScaling keeps its amax histories and scales in module buffers (delayed.py). This version
drives the C extension's quantize and GEMM calls from Python; the single C call per direction
arrives with the rest of issue 5.
Tests: tests/test_linear.py.
"""
import math

import torch
import torch.nn.functional as F

from . import _C, delayed
from .ops import _rng_state
from .quantized import COLUMNWISE, ROWWISE
from .recipe import QuantizerRole

__all__ = ["Linear"]

_ACCUMULATE, _FAST_ACCUM = 1, 2  # tq_gemm_flags
# Feature dims must be multiples of these (the quantizers' and cuBLASLt's rules); rows are padded
# to them (FP8 wgrad contracts over rows: cuBLASLt needs K % 16; MXFP8 / NVFP4 quantize 32 / 16).
_ALIGN = {"delayed": 16, "current": 16, "block": 16, "mxfp8": 32, "nvfp4": 16}


class _Plan:
    """What one recipe asks of a Linear, looked up once per recipe and cached on the module."""

    __slots__ = ("recipe", "key", "x", "w", "dy", "align", "flags", "backward_override",
                 "delayed")

    def __init__(self, recipe):
        self.recipe = recipe
        self.key = _C.recipe_key(recipe)
        self.x = _C.quantizer_config(recipe, "input")
        self.w = _C.quantizer_config(recipe, "weight")
        self.dy = _C.quantizer_config(recipe, "grad_output")
        self.align = _ALIGN.get(self.x.scaling)
        split = _C.gemm_split_accumulator(recipe)
        self.flags = tuple(0 if s else _FAST_ACCUM for s in split)  # fprop, dgrad, wgrad
        self.backward_override = getattr(recipe, "backward_override", None)
        self.delayed = self.x.scaling == "delayed"


def _gemm(a, b, out_dtype, bias, flags, plan):
    """_C._gemm, writing float16 results of emulated pairs through float32 (the BF16 GEMM has no
    float16 output)."""
    if out_dtype == torch.float16 and plan.x.scaling in ("mxfp8", "nvfp4"):
        return _C._gemm(a, b, None, torch.float32, bias, flags).to(torch.float16)
    return _C._gemm(a, b, None, out_dtype, bias, flags)


def _quantize(x2d, config, usage, state=(None, None)):
    """Members of x2d quantized with config; state = DelayedScaling's (scale, amax slot)."""
    seed = offset = 0
    if config.stochastic_rounding:
        seed, offset = _rng_state(x2d.device, None)
    return _C._quantize(x2d, config, usage, state[0], state[1], seed, offset)


def _pad_rows(x2d, multiple):
    rows = x2d.shape[0]
    padded = -(-rows // multiple) * multiple
    if padded == rows:
        return x2d
    out = x2d.new_zeros((padded, x2d.shape[1]))
    out[:rows].copy_(x2d)
    return out


def _rowwise_only(members):
    return members[:2] + (None, None) + members[4:]


def _columnwise_only(members, config):
    """The columnwise members; per-tensor FP8's one scale_inv serves both directions."""
    shared = members[1] if config.scaling in ("delayed", "current") else None
    return (None, shared) + members[2:]


class _QuantizedLinear(torch.autograd.Function):
    """y = x W^T + b with quantized GEMMs; backward per the same plan."""

    @staticmethod
    def forward(ctx, inp, weight, bias, module, plan, is_first_microbatch, pending):
        k, n = weight.shape[1], weight.shape[0]
        x2d = inp.reshape(-1, k)
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        rows = x2d.shape[0]
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        override = plan.backward_override
        xp = _pad_rows(x2d, plan.align)
        padded = xp.shape[0]
        x_usage = ROWWISE | (COLUMNWISE if need_wgrad and override is None else 0)
        qx = _quantize(xp, plan.x, x_usage,
                       delayed.slot(module, delayed.FORWARD, 0) if plan.delayed else (None, None))
        qw = module._quantized_weight(weight, plan, is_first_microbatch)
        out = _gemm((plan.x, padded, k, qx, ROWWISE), (plan.w, n, k, qw, ROWWISE), inp.dtype,
                    bias, plan.flags[0], plan)
        ctx.plan, ctx.shape, ctx.rows, ctx.padded = plan, inp.shape, rows, padded
        ctx.module, ctx.pending = module, pending
        ctx.dtype = inp.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if override == "high_precision":
            ctx.save_for_backward(x2d, weight)
        elif override == "dequantized":
            ctx.quantized = (_rowwise_only(qx), _rowwise_only(qw))
        else:  # the columnwise x for wgrad, and W (its columnwise direction serves dgrad)
            ctx.quantized = (_columnwise_only(qx, plan.x) if need_wgrad else None, qw)
        ctx.weight_dtype = weight.dtype
        return out[:rows].view(*inp.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        n, k = dy.shape[-1], ctx.shape[-1]
        dy2d = dy.reshape(-1, n)
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = db = None
        if plan.backward_override is not None:
            dx, dw = _high_precision_backward(ctx, dy2d, need_dgrad, need_wgrad)
        else:
            qx, qw = ctx.quantized
            dyp = _pad_rows(dy2d, plan.align)
            padded = dyp.shape[0]
            usage = (ROWWISE if need_dgrad else 0) | (COLUMNWISE if need_wgrad else 0)
            if usage:
                state = (delayed.slot(ctx.module, delayed.BACKWARD, 0) if plan.delayed
                         else (None, None))
                qdy = _quantize(dyp, plan.dy, usage, state)
            if need_dgrad:  # dx = dy W: dy rowwise [M, N], W columnwise [K, N]
                dx = _gemm((plan.dy, padded, n, qdy, ROWWISE), (plan.w, n, k, qw, COLUMNWISE),
                           ctx.dtype, None, plan.flags[1], plan)[:ctx.rows]
            if need_wgrad:  # dW = dy^T x: dy columnwise [N, M], x columnwise [K, M]
                dw = _gemm((plan.dy, padded, n, qdy, COLUMNWISE),
                           (plan.x, padded, k, qx, COLUMNWISE), ctx.weight_dtype, None,
                           plan.flags[2], plan)
        if dx is not None:
            dx = dx.view(ctx.shape)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2d.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        if ctx.pending is not None:  # first in forward, so last in backward: update them all
            delayed.update_backward(ctx.pending)
        return dx, dw, db, None, None, None, None


def _high_precision_backward(ctx, dy2d, need_dgrad, need_wgrad):
    """backward_override: "high_precision" multiplies the unquantized x and W, "dequantized"
    the dequantized forward operands, both in dy's precision."""
    plan, rows = ctx.plan, ctx.rows
    if plan.backward_override == "high_precision":
        x2d, weight = ctx.saved_tensors
    else:
        qx, qw = ctx.quantized
        k, n = ctx.shape[-1], dy2d.shape[1]
        x2d = _dequantized(plan.x, ctx.padded, k, qx, dy2d.dtype)[:rows]
        weight = _dequantized(plan.w, n, k, qw, dy2d.dtype)
    dx = (dy2d @ weight.to(dy2d.dtype)).to(ctx.dtype) if need_dgrad else None
    dw = (dy2d.t() @ x2d.to(dy2d.dtype)).to(ctx.weight_dtype) if need_wgrad else None
    return dx, dw


def _dequantized(config, rows, cols, members, dtype):
    out = torch.empty((rows, cols), dtype=dtype, device=members[0].device)
    _C._dequantize(config, rows, cols, members, ROWWISE, out)
    return out


class _CustomLinear(torch.autograd.Function):
    """CustomRecipe: each role's quantizer (from the recipe's qfactory) quantizes, and the GEMMs
    multiply the dequantized values in the activation dtype (the quantizer protocol is in
    Linear's docstring)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, quantizers):
        qx, qw, qdy = quantizers
        x_q, w_q = qx.quantize(inp.detach()), qw.quantize(weight.detach())
        x_hat = qx.dequantize(x_q).to(inp.dtype)
        w_hat = qw.dequantize(w_q).to(inp.dtype)
        ctx.save_for_backward(x_hat, w_hat)
        ctx.qdy, ctx.weight_dtype = qdy, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return F.linear(x_hat, w_hat, None if bias is None else bias.to(inp.dtype))

    @staticmethod
    def backward(ctx, dy):
        x_hat, w_hat = ctx.saved_tensors
        dy_hat = ctx.qdy.dequantize(ctx.qdy.quantize(dy)).to(dy.dtype)
        dy2d, x2d = dy_hat.reshape(-1, dy.shape[-1]), x_hat.reshape(-1, x_hat.shape[-1])
        dx = (dy_hat @ w_hat).to(x_hat.dtype) if ctx.needs_input_grad[0] else None
        dw = (dy2d.t() @ x2d).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        db = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None


class Linear(torch.nn.Module):
    """y = x W^T + b, with its GEMMs quantized inside te.autocast (FP8, MXFP8, NVFP4).

    Args:
        in_features, out_features: the weight is [out_features, in_features].
        bias: learn an additive bias [out_features] (initialized to 0).
        params_dtype: dtype of the parameters (default torch.get_default_dtype()).
        device: where to create the parameters (default: the current default device).
        init_method: callable initializing the weight in place (default: torch.nn.Linear's
            Kaiming-uniform initialization).
        return_bias: forward returns (out, bias) and does not add the bias.

    forward(inp, is_first_microbatch=None): inp is [..., in_features] on CPU (the C reference
    path) or CUDA. is_first_microbatch: True quantizes the weight and caches it, False reuses the
    cached quantized weight (gradient accumulation over microbatches), None quantizes every call.
    Inside te.autocast the feature dims must be multiples of 16 (FP8 recipes, NVFP4) or 32
    (MXFP8); any number of tokens works.

    CustomRecipe(qfactory): qfactory(QuantizerRole(module_type="linear", tensor_type=role)) is
    called once per module for the roles "input", "weight" and "grad_output"; each returns a
    quantizer with `quantize(tensor) -> q` (any object) and `dequantize(q) -> tensor` (the
    values, same shape). The three GEMMs multiply the dequantized values in the activation
    dtype, so a research format needs only those two methods.
    """

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None,
                 init_method=None, return_bias=False):
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.in_features, self.out_features = in_features, out_features
        self.return_bias = bool(return_bias)
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"params_dtype must be torch.float32, torch.bfloat16 or "
                             f"torch.float16, got {dtype}")
        factory = {"dtype": dtype, "device": device}
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, **factory)) if bias else None
        if init_method is not None:
            init_method(self.weight)
        else:
            torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self._plans = {}           # recipe key -> _Plan
        self._weight_cache = None  # (recipe key, weight members) for is_first_microbatch=False

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dtype={self.weight.dtype}")

    def _plan(self, recipe):
        key = _C.recipe_key(recipe)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(recipe)
            self._check_plan(plan)
        return plan

    def _check_plan(self, plan):
        if plan.x.scaling == "custom":
            return
        for name, dim in (("in_features", self.in_features), ("out_features", self.out_features)):
            if dim % plan.align:
                raise ValueError(f"{name}={dim} must be a multiple of {plan.align} for "
                                 f"{plan.x.scaling} scaling (te.Linear inside te.autocast)")

    def _custom_quantizers(self, recipe):
        """The (input, weight, grad_output) quantizers of a CustomRecipe's qfactory, made once
        per recipe and module."""
        key = _C.recipe_key(recipe)
        quantizers = self._plans.get(key)
        if quantizers is None:
            quantizers = tuple(recipe.qfactory(QuantizerRole(module_type="linear", tensor_type=r))
                               for r in ("input", "weight", "grad_output"))
            for role, q in zip(("input", "weight", "grad_output"), quantizers):
                if not (callable(getattr(q, "quantize", None))
                        and callable(getattr(q, "dequantize", None))):
                    raise TypeError(f"CustomRecipe.qfactory returned {type(q).__name__} for the "
                                    f"{role!r} role: a quantizer needs quantize(tensor) and "
                                    "dequantize(quantized) methods")
            self._plans[key] = quantizers
        return quantizers

    def _quantized_weight(self, weight, plan, is_first_microbatch):
        cache = self._weight_cache
        if (is_first_microbatch is False and cache is not None and cache[0] == plan.key
                and cache[1][0].device == weight.device):  # .to() moves the weight, not this
            return cache[1]
        state = delayed.slot(self, delayed.FORWARD, 1) if plan.delayed else (None, None)
        members = _quantize(weight, plan.w, ROWWISE | COLUMNWISE, state)
        self._weight_cache = (plan.key, members) if is_first_microbatch is not None else None
        return members

    def forward(self, inp, is_first_microbatch=None):
        bias = None if self.return_bias else self.bias
        if not _C.is_fp8_enabled():
            if _C.is_fp8_calibration():
                plan = self._plan(_C.get_fp8_recipe())
                if plan.delayed:
                    delayed.calibrate(self, plan, inp)
            out = F.linear(inp, self.weight, bias)
        else:
            if inp.shape[-1] != self.in_features:
                raise ValueError(f"input has {inp.shape[-1]} features in its last dim; this "
                                 f"Linear takes {self.in_features}")
            if torch.is_autocast_enabled(inp.device.type):
                inp = inp.to(torch.get_autocast_dtype(inp.device.type))
            recipe = _C.get_fp8_recipe()
            if recipe.custom():
                out = _CustomLinear.apply(inp, self.weight, bias, self._custom_quantizers(recipe))
                return (out, self.bias) if self.return_bias else out
            plan = self._plan(recipe)
            pending = None
            if plan.delayed:
                delayed.ensure(self, plan)
                self._delayed_plan, self._delayed_group = plan, _C.get_fp8_group()
                if torch.is_grad_enabled():
                    modules, first = _C._delayed_register(self)
                    pending = modules if first else None
            out = _QuantizedLinear.apply(inp, self.weight, bias, self, plan, is_first_microbatch,
                                         pending)
        return (out, self.bias) if self.return_bias else out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # DelayedScaling buffers exist once a module quantized with it: create them from a
        # checkpoint that has them, so a fresh module restores the state exactly.
        for direction in (delayed.FORWARD, delayed.BACKWARD):
            for name in (f"delayed_amax_history_{direction}", f"delayed_scale_{direction}"):
                saved = state_dict.get(prefix + name)
                if saved is not None and getattr(self, name, None) is None:
                    self.register_buffer(name, torch.empty_like(saved, device=self.weight.device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
