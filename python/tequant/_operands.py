"""What te.Linear accepts as operands besides plain tensors, and how it reads them.

- A weight that arrives quantized (FSDP2's quantized all-gather, tequant/distributed/fsdp.py) is
  a tensor subclass with tq_recipe_key (the key of the recipe it was quantized under),
  tq_kept(usage) (its six members holding the direction ROWWISE or COLUMNWISE) and
  tq_dequantized() (its values in its dtype, for a te.Linear running in high precision). A
  subclass that wraps the high-precision weight gives it as tq_data.
- A DTensor weight (tensor parallelism through parallelize_module, distributed/dtensor.py).
- An AsyncCollectiveTensor input or output gradient (a functional collective's output, e.g.
  DTensor's to_local after a redistribute), which has no data of its own for C: waited on.
- The quantized operands a te.Linear autograd node kept (split_kept for save_for_backward,
  node_saved to read them back in backward, a weight that came quantized asked again).
tq dtype codes (TQ_DTYPE) name the high-precision dtype of an operand that travels as members.
Tests: tests/test_fsdp.py, tests/test_dtensor_parallel.py, tests/test_tensor_parallel.py.
"""
import sys

import torch
import torch.autograd.forward_ad as _forward_ad

from . import _C

TQ_DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # tq_dtype codes
DTYPE_OF = {code: dtype for dtype, code in TQ_DTYPE.items()}


def quantized_weight(weight):
    """weight, when it arrives quantized; None for an ordinary tensor (the common case costs
    two type checks)."""
    if type(weight) is torch.nn.Parameter or type(weight) is torch.Tensor:
        return None
    return weight if hasattr(weight, "tq_kept") else None


def given_kept(given, plan, usage):
    """The members of a weight that arrived quantized, for `usage`, checked against the plan's
    recipe."""
    if given.tq_recipe_key != plan.key:
        raise RuntimeError(
            f"this te.Linear's weight was quantized (by FSDP2's all-gather) under "
            f"{_C._recipe_of_key(given.tq_recipe_key)!r}, the te.autocast active when it was "
            f"gathered, but the layer runs under {plan.recipe!r}: enter one te.autocast around "
            "the whole FSDP module's forward")
    return given.tq_kept(usage)


def is_dtensor(weight):
    """Without importing torch.distributed.tensor (nothing made a DTensor before it loads)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(weight, module.DTensor)


def transformed():
    """Inside a forward-AD dual level or a functorch transform (vmap, grad, ...): such inputs
    must reach te.Linear's Function, which refuses them clearly (no jvp, no setup_context), not
    its Function-free no-graph path, which would drop a tangent or get a wrapped tensor; the
    norm kernels' Function leaves them to torch's norm (_norm_fn.refusal)."""
    return (getattr(_forward_ad, "_current_level", 0) >= 0
            or torch._C._are_functorch_transforms_active())


def waited(t):
    """t, or the plain tensor an AsyncCollectiveTensor t waits for (in the autograd graph: its
    gradient passes through)."""
    if type(t) is not torch.Tensor and hasattr(type(t), "trigger_wait"):
        return _Passthrough.apply(t, "trigger_wait")
    return t


def fast_apply(function):
    """function.apply less torch's Python wrapper (~4 us of a ~75 us te.Linear forward on the
    H200 host). With no functorch transform active and no setup_context, that wrapper unwraps
    dead functorch wrappers and calls _FunctionBase.apply; this does the same for the first
    three arguments, the caller's tensors (te.Linear's inp, weight, bias; a norm's x, weight,
    bias; an activation's h, scale, amax), each a tensor or None; the Functions take their other
    tensors from tequant itself. Under a transform it is torch's own apply (which raises: these
    Functions define no setup_context), and under torch.compile too (Dynamo traces that one)."""
    raw = torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
    unwrap, active = torch._C._functorch.unwrap_if_dead, torch._C._are_functorch_transforms_active
    compiling = torch.compiler.is_compiling

    def apply(a, b, c, *rest):
        if compiling() or active():
            return function.apply(a, b, c, *rest)
        return raw(unwrap(a), None if b is None else unwrap(b), None if c is None else unwrap(c),
                   *rest)
    apply.raw = raw
    return apply


def dequantized(weight):
    """A quantized-arrived weight's values for a high-precision te.Linear; its gradient passes
    straight to the weight (FSDP2 reduce-scatters it as usual)."""
    return _Passthrough.apply(weight, "tq_dequantized")


class _Passthrough(torch.autograd.Function):
    """t.<method>() forward, the identity on the gradient."""

    @staticmethod
    def forward(ctx, t, method):
        return getattr(t, method)()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def split_kept(kept):
    """(tensors, amaxes) of a kept quantization: a packed pair (buffer, amax) or the six members
    (amaxes last); None for none."""
    if kept is None:
        return (), None
    return (kept[:1], kept[1:]) if len(kept) == 2 else (kept[:4], kept[4:])


def _joined(tensors, amaxes):
    return None if amaxes is None else tuple(tensors) + amaxes


def node_saved(ctx, w_usage=_C.USAGE_COLUMNWISE):
    """(linear_forward's saved, (x, W) kept for backward_override="high_precision" or ()) of a
    linear._QuantizedLinear node (ctx, or the grad_fn of its output). A weight that came
    quantized gives its members for w_usage (0: none needed)."""
    tensors, n_x, n_w = ctx.saved_tensors, ctx.n_x, ctx.n_w
    if ctx.w_given is None:
        w_kept = _joined(tensors[n_x:n_x + n_w], ctx.w_amax)
    else:
        w_kept = given_kept(ctx.w_given, ctx.plan, w_usage) if w_usage else None
    saved = (_joined(tensors[:n_x], ctx.x_amax), w_kept) + ctx.rest
    return saved, tensors[n_x + n_w:]
