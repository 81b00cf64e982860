"""te.Linear: a torch.nn.Linear whose three GEMMs run quantized inside te.autocast.

Outside te.autocast (or with enabled=False) it is exactly torch.nn.functional.linear. Inside, the
active recipe's quantizers (te.quantizer_config(recipe, role)) quantize x ("input"), W ("weight")
and dy ("grad_output"), and te.ops' GEMM runs fprop y = x W^T (x rowwise, W rowwise), dgrad
dx = dy W (dy rowwise, W columnwise) and wgrad dW = dy^T x (dy columnwise, x columnwise), as
TE_REFERENCE 7.3-7.5 describe. Backward keeps the quantized columnwise x and the quantized W, not
high-precision copies. Any number of tokens works: rows are zero-padded to the format's multiple
(zero rows add nothing to any product) and the result is exactly the unpadded one.
DelayedScaling keeps its amax histories and scales in module buffers (delayed.py). The forward
and the backward are one C call each (csrc/ext/linear.c); this file is the autograd Function,
the module and the recipe plans around them. With no graph to record (torch.no_grad,
inference_mode, nothing requiring grad) forward is the C call alone, without the Function.
Tests: tests/test_linear.py, tests/test_linear_module.py, tests/test_linear_delayed.py.
"""
import math

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.nn.functional as F

from . import _C, _compile_linear, delayed
from .ops import _FAST_ACCUM  # tq_gemm_flags, defined once in ops.py
from .quantized import ROWWISE
from .recipe import QuantizerRole

__all__ = ["Linear"]

# Feature dims must be multiples of these (the quantizers' and cuBLASLt's rules); rows are padded
# to them (FP8 wgrad contracts over rows: cuBLASLt needs K % 16; MXFP8 / NVFP4 quantize 32 / 16).
_ALIGN = {"delayed": 16, "current": 16, "block": 16, "mxfp8": 32, "nvfp4": 16}


class _Plan:
    """What one recipe asks of a Linear, looked up once per recipe and cached on the module."""

    __slots__ = ("recipe", "key", "x", "w", "dy", "align", "flags", "backward_override",
                 "delayed", "c_args")

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
        emulated = self.x.scaling in ("mxfp8", "nvfp4")
        self.c_args = (self.key, self.x, self.w, self.dy, self.align) + self.flags + (emulated,)


_NEED_DGRAD, _NEED_WGRAD, _KEEP_X_ROWWISE, _PACKED = 1, 2, 4, 8  # csrc/ext/linear.c


class _QuantizedLinear(torch.autograd.Function):
    """y = x W^T + b with quantized GEMMs: one C call forward (csrc/ext/linear.c
    linear_forward), one backward (linear_backward)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, module, plan, is_first_microbatch, pending):
        needs = ((_NEED_DGRAD if ctx.needs_input_grad[0] else 0)
                 | (_NEED_WGRAD if ctx.needs_input_grad[1] else 0))
        override = plan.backward_override
        # packed: ctx.saved and the weight cache hold one buffer per quantized operand (few
        # allocations); "dequantized" reads the member tensors of x and W in Python instead
        c_needs = (needs | _PACKED if override is None
                   else _KEEP_X_ROWWISE if override == "dequantized" else _PACKED)
        inp = inp.contiguous()
        out, saved = _forward(inp, weight, bias, module, plan, is_first_microbatch, c_needs)
        ctx.plan, ctx.saved, ctx.needs, ctx.shape = plan, saved, needs, inp.shape
        ctx.module, ctx.pending = module, pending
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.dtype, ctx.weight_dtype = inp.dtype, weight.dtype
        if override == "high_precision":
            ctx.save_for_backward(inp, weight)
        return out

    @staticmethod
    def backward(ctx, dy):
        plan, needs = ctx.plan, ctx.needs
        dy = dy.contiguous()
        bias_dtype = ctx.bias_dtype if ctx.needs_input_grad[2] else None
        if plan.backward_override is not None:
            dx, dw, db = _high_precision_backward(ctx, dy.reshape(-1, dy.shape[-1]), needs,
                                                  bias_dtype)
        else:  # ctx.pending: first in forward, so last in backward: it updates them all
            state = delayed.slots(ctx.module, delayed.BACKWARD)[0] if plan.delayed else None
            dx, dw, db = _C.linear_backward(plan.c_args, ctx.saved, dy, needs, state, ctx.shape,
                                            bias_dtype, ctx.pending)
        return dx, dw, db, None, None, None, None


def _forward(inp, weight, bias, module, plan, is_first_microbatch, c_needs):
    """linear_forward's (out, saved) for a contiguous inp, with DelayedScaling's slots."""
    if plan.delayed:
        x_state, w_state = delayed.slots(module, delayed.FORWARD)
    else:
        x_state = w_state = None
    return _C.linear_forward(plan.c_args, inp, weight, bias, c_needs, module._weight_cache,
                             is_first_microbatch, x_state, w_state)


def _transformed():
    """Inside a forward-AD dual level or a functorch transform (vmap, grad, ...): such inputs
    must reach the Function, which refuses them clearly (no jvp, no setup_context), not the
    Function-free no-graph path, which would drop a tangent or get a wrapped tensor."""
    return (getattr(_forward_ad, "_current_level", 0) >= 0
            or torch._C._are_functorch_transforms_active())


def _fast_apply(function):
    """function.apply less torch's Python wrapper (~4 us of a ~75 us forward on the H200 host).
    With no functorch transform active and no setup_context, that wrapper unwraps dead functorch
    wrappers and calls _FunctionBase.apply; this does the same for the three tensor arguments
    (inp, weight, bias). Under a transform it is torch's own apply (which raises: these
    Functions define no setup_context)."""
    raw = torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
    unwrap, active = torch._C._functorch.unwrap_if_dead, torch._C._are_functorch_transforms_active

    def apply(inp, weight, bias, *rest):
        if active():
            return function.apply(inp, weight, bias, *rest)
        return raw(unwrap(inp), unwrap(weight), None if bias is None else unwrap(bias), *rest)
    return apply


_quantized_linear = _fast_apply(_QuantizedLinear)


def _high_precision_backward(ctx, dy2d, needs, bias_dtype):
    """backward_override: "high_precision" multiplies the unquantized x and W, "dequantized"
    the dequantized forward operands (rowwise x and W), both in dy's precision."""
    plan = ctx.plan
    if plan.backward_override == "high_precision":
        inp, weight = ctx.saved_tensors
        x2d = inp.reshape(-1, inp.shape[-1])
    else:
        qx, qw, rows, padded, n, k = ctx.saved[:6]
        x2d = _dequantized(plan.x, padded, k, qx, dy2d.dtype)[:rows]
        weight = _dequantized(plan.w, n, k, qw, dy2d.dtype)
    dx = dw = None
    if needs & _NEED_DGRAD:
        dx = (dy2d @ weight.to(dy2d.dtype)).to(ctx.dtype).view(ctx.shape)
    if needs & _NEED_WGRAD:
        dw = (dy2d.t() @ x2d.to(dy2d.dtype)).to(ctx.weight_dtype)
    db = dy2d.sum(0, dtype=torch.float32).to(bias_dtype) if bias_dtype is not None else None
    return dx, dw, db


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
        _compile_linear.register_module(self)
        self._plans = {}           # recipe key -> _Plan
        self._weight_cache = []    # [recipe key, quantized W] for is_first_microbatch=False

    def __setstate__(self, state):
        super().__setstate__(state)
        _compile_linear.register_module(self)  # a copy (deepcopy, pickle) is a module of its own

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

    def forward(self, inp, is_first_microbatch=None):
        """y = inp W^T + b for inp [..., in_features]: quantized inside te.autocast, exactly
        F.linear outside. is_first_microbatch: see the class docstring. Returns y, or (y, bias)
        with return_bias=True."""
        if torch.compiler.is_compiling():
            out = _compile_linear.forward(self, inp, is_first_microbatch)
            return (out, self.bias) if self.return_bias else out
        bias = None if self.return_bias else self.bias
        if not _C.is_fp8_enabled():
            if _C.is_fp8_calibration():
                plan = self._plan(_C.get_fp8_recipe())
                if plan.delayed:
                    delayed.calibrate(self, plan.x.amax_history_len, inp)
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
                delayed.ensure(self, plan.x.amax_history_len)
                attrs = self.__dict__  # plain attributes: nn.Module.__setattr__ costs ~2 us each
                attrs["_delayed_plan"], attrs["_delayed_group"] = plan, _C.get_fp8_group()
                if torch.is_grad_enabled():
                    modules, first = _C._delayed_register(self)
                    pending = modules if first else None
            weight = self.weight
            if (torch.is_grad_enabled() and (inp.requires_grad or weight.requires_grad or (
                    bias is not None and bias.requires_grad))) or _transformed():
                out = _quantized_linear(inp, weight, bias, self, plan, is_first_microbatch,
                                        pending)
            else:  # no graph to record (eval, inference): the C forward alone, x rowwise only
                out = _forward(inp.contiguous(), weight, bias, self, plan, is_first_microbatch,
                               _PACKED)[0]
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
