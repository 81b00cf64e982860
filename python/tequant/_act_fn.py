"""te.LayerNormMLP's activation as torch runs it: one autograd Function over the activation kernels
(tq_act_forward / tq_act_backward, csrc/include/tequant/tequant.h), their tequant::act_fwd /
tequant::act_bwd ops for torch.compile, and ActInput, fc1's output h that fc2 (a te.Linear)
activates itself, as _norm_fn.NormInput is the input fc1 normalizes.

One definition serves eager and compiled code (as _norm_fn.py): ActFunction calls the ops'
implementations directly in eager mode and the ops (opaque to Dynamo, with fake kernels) while
compiling. Activations as TE defines them (layernorm_mlp.py); the gated ones read h = [first |
second] and give [M, K / 2]. The Function flattens leading dims to [M, K], saves h, and its
backward returns dh in h's dtype (_act_backward). Where the kernels do not run (`refusal`: not a
plain tensor, another dtype than float32 / bfloat16 / float16, torch.autocast, forward AD or
functorch transforms, another device, CUDA without a CUDA build) torch's activation runs.
Fused (ActInput.fused, per-tensor FP8 recipes, the rule of NormInput.fusable): the forward
writes fc2's rowwise FP8 codes of the FP32 activation (not of it rounded to h's dtype), rows
zero-padded to the format's multiple; DelayedScaling casts with fc2's input scale and
max-accumulates the amax into fc2's input history slot, Float8CurrentScaling runs an amax pass,
then the cast pass. Tests: tests/test_fused_act_modules.py.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import _C, _plan
from ._compile_ops import config_of, fake, op
from ._norm_fn import PER_TENSOR, codes_returned, fp8_outputs, refusal as _norm_refusal

__all__ = ["ActFunction", "ActInput", "activate", "refusal", "torch_activate", "GATED"]

GATED = ("geglu", "reglu", "swiglu")


def _cols(activation, k):
    return k // 2 if activation in GATED else k


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return torch.square(F.relu(x))


def _gelu(x):
    return F.gelu(x, approximate="tanh")


TORCH_ELEMENTWISE = {"gelu": _gelu, "relu": F.relu, "silu": F.silu, "qgelu": _qgelu,
                     "srelu": _srelu}
TORCH_GATED = {"geglu": _gelu, "reglu": F.relu, "swiglu": F.silu}


def torch_activate(h, activation):
    """TE's activation of h in torch ops (gated: act(first half) * second half): where the
    kernels do not run, and the tests' reference (layernorm_mlp.activate)."""
    if activation in TORCH_GATED:
        a, b = h.chunk(2, dim=-1)
        return TORCH_GATED[activation](a) * b
    return TORCH_ELEMENTWISE[activation](h)


def refusal(h):
    """Why the activation kernels do not compute act(h), so torch's activation does (None: they
    do): the norm kernels' rule (_norm_fn.refusal) on h."""
    if h.dim() == 0 or h.shape[-1] == 0:
        return "h has no features"
    return _norm_refusal(h, None, None)


def activate(h, activation):
    """TE's activation of h (gated: act(first half) * second half) in h's dtype: the kernels
    through ActFunction, or torch's (torch_activate) where they do not run."""
    if refusal(h) is not None:
        return torch_activate(h, activation)
    return ActFunction.apply(h, None, None, activation, True, None, 0)


# ---- the kernels' calls, eager implementations of the ops -----------------------------------

def _forward_into(h, activation, want_hp, recipe_id, scale, padded, amax):
    """[y_hp if want_hp] + with recipe_id (a per-tensor FP8 recipe: its "input" quantizer)
    [codes [padded, N] (rows past M zero), scale_inv, amax] for h [M, K]. amax: the tensor to
    max-accumulate amax(y) into (DelayedScaling's history slot, eager), or None for a fresh one."""
    m, k = h.shape
    n = _cols(activation, k)
    outs = []
    y_hp = None
    if want_hp:
        y_hp = h.new_empty((m, n))
        outs.append(y_hp)
    if recipe_id is None:
        _C._act_forward(h, activation, y_hp=y_hp)
        return outs
    config, data, scale_inv, amax = fp8_outputs(h, recipe_id, padded, m, n, amax)
    if config.scaling == "delayed":  # one pass: cast with the module's scale, amax alongside
        _C._act_forward(h, activation, y_hp=y_hp, amax=amax, config=config, y_q=data[:m],
                        scale_inv=scale_inv, scale=scale)
    else:  # current scaling: the cast needs the whole tensor's amax first
        _C._act_forward(h, activation, y_hp=y_hp, amax=amax)
        _C._act_forward(h, activation, config=config, y_q=data[:m], scale_inv=scale_inv,
                        amax_in=amax)
    return outs + [data, scale_inv, amax]


@op("tequant::act_fwd", mutates_args=())
def _act_fwd(h: torch.Tensor, activation: str, want_hp: bool, recipe_id: Optional[str],
             scale: Optional[torch.Tensor], padded: int) -> list[torch.Tensor]:
    """_forward_into with a fresh amax (the op mutates nothing: compiled code max-accumulates
    the returned amax into DelayedScaling's history)."""
    return _forward_into(h, activation, want_hp, recipe_id, scale, padded, None)


@fake("tequant::act_fwd")
def _act_fwd_fake(h, activation, want_hp, recipe_id, scale, padded):
    m, k = h.shape
    n = _cols(activation, k)
    outs = [h.new_empty((m, n))] if want_hp else []
    if recipe_id is not None:
        layout = _C._quantize_layout(config_of(recipe_id, "input"), int(padded), int(n),
                                     _plan.ROWWISE)
        outs += [h.new_empty((r, c), dtype=dtype) for r, c, dtype in layout[:2]]
        outs.append(h.new_empty((1, 1), dtype=torch.float32))
    return outs


def act_backward(dy: torch.Tensor, h: torch.Tensor, activation: str) -> torch.Tensor:
    """dh [M, K] (h's dtype) of h [M, K] from dy [M, N] in h's dtype."""
    dh = torch.empty_like(h)
    _C._act_backward(dy, h, activation, dh=dh)
    return dh


op("tequant::act_bwd", mutates_args=())(act_backward)


@fake("tequant::act_bwd")
def _act_bwd_fake(dy, h, activation):
    return torch.empty_like(h)


# ---- the Function -----------------------------------------------------------------------------

class ActFunction(torch.autograd.Function):
    """y = act(h) over the last dim through the kernels; with recipe_id also fc2's rowwise FP8
    codes of y (ActInput.fused).

    forward(h, scale, amax, activation, want_hp, recipe_id, padded) returns y alone without
    recipe_id, else (y, codes, scale_inv, amax or None: None where the amax went into the given
    `amax`, the eager DelayedScaling slot). Without want_hp y carries only the gradient (an
    expanded scalar: no [M, N] store): the te.Linear that reads the codes returns its input
    gradient for it."""

    @staticmethod
    def forward(ctx, h, scale, amax, activation, want_hp, recipe_id, padded):
        k = h.shape[-1]
        h2d = h.reshape(-1, k).contiguous()
        shape = h.shape[:-1] + (_cols(activation, k),)
        args = (h2d, activation, want_hp, recipe_id, scale, padded)
        if torch.compiler.is_compiling():
            outs = torch.ops.tequant.act_fwd(*args)
        else:
            outs = _forward_into(*args, amax)
        it = iter(outs)
        y = next(it).view(shape) if want_hp else h.new_empty(()).expand(shape)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(h2d)
            ctx.activation, ctx.shape = activation, h.shape
        if recipe_id is None:
            return y
        return (y,) + codes_returned(ctx, it, amax)

    @staticmethod
    @once_differentiable  # the kernels' backward is not differentiable: a clear error
    def backward(ctx, dy, *_):
        h2d, = ctx.saved_tensors
        dy2d = dy.reshape(h2d.shape[0], _cols(ctx.activation, h2d.shape[1])).to(
            h2d.dtype).contiguous()
        if torch.compiler.is_compiling():
            dh = torch.ops.tequant.act_bwd(dy2d, h2d, ctx.activation)
        else:
            dh = act_backward(dy2d, h2d, ctx.activation)
        return dh.view(ctx.shape), None, None, None, None, None, None


# ---- the input of a te.Linear that activates first ----------------------------------------------

class ActInput:
    """h (fc1's output) and the activation te.LayerNormMLP's fc2 applies before its GEMM.
    te.Linear resolves it once it knows the recipe, as a _norm_fn.NormInput: fused() where the
    recipe is per-tensor FP8 (fusable), else high_precision()."""

    __slots__ = ("h", "activation", "refusal")

    def __init__(self, h, activation):
        self.h, self.activation = h, activation
        self.refusal = refusal(h)

    @property
    def shape(self):
        """The activation's output shape (gated: half of h's features)."""
        h = self.h
        return h.shape[:-1] + (_cols(self.activation, h.shape[-1]),)

    def fusable(self, scaling, backward_override, tp):
        """NormInput.fusable's rule: per-tensor FP8, no backward_override, the kernels run, no
        tensor parallelism over several ranks."""
        return (self.refusal is None and scaling in PER_TENSOR and backward_override is None
                and (tp is None or tp.size == 1))

    def high_precision(self):
        return activate(self.h, self.activation)

    def fused(self, recipe_id, align, scale, amax):
        """(y carrier, the six members of the rowwise quantization te.Linear multiplies), as
        NormInput.fused."""
        h = self.h
        rows = h.numel() // h.shape[-1]
        y, data, scale_inv, fresh = ActFunction.apply(
            h, scale, amax, self.activation, False, recipe_id, _plan.padded(rows, align))
        return y, (data, scale_inv, None, None, amax if fresh is None else fresh, None)
