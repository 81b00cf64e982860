"""The normalization as torch runs it: one autograd Function over the norm kernels
(tq_norm_forward / tq_norm_backward, csrc/include/tequant/tequant.h), their tequant::norm_fwd /
norm_fwd_delayed / norm_bwd ops for torch.compile, and NormInput, the not yet normalized input that
te.LayerNormLinear and te.LayerNormMLP hand their te.Linear.

One definition serves eager and compiled code: NormFunction calls the ops' implementations
directly in eager mode and the ops (opaque to Dynamo, with fake kernels) while compiling, so both
run the same C calls and give the same bits. The Function flattens any leading dims to [M, K],
saves x, gamma, mean and rstd, and its backward returns dx in x's dtype and dgamma / dbeta (the
kernel's FP32 sums, rounded once by it) in the weight's dtype. Not a kernel: forward-mode AD,
functorch transforms, torch.autocast (which sets a norm's output dtype: float32 for
layer_norm), dtypes other than float32 / bfloat16 / float16, tensor subclasses (DTensor),
devices other than CPU and CUDA and a CUDA tensor in a CPU-only build run torch's norm instead
(`refusal` says why).
Fused (NormInput.fused, per-tensor FP8 recipes): the forward also writes te.Linear's rowwise FP8
codes of the FP32 norm output y (not of y rounded to x's dtype), zero-padded to the format's row
multiple as te.Linear pads its input, and where wgrad runs the same codes transposed (the
kernel stages a tile of rows in shared memory; tq_norm_forward's y_q_t); DelayedScaling casts with the module's scale and
max-accumulates amax(y) into the module's input history slot, as te.Linear's own input
quantization does (compiled too: tequant::norm_fwd_delayed takes the module's buffers);
Float8CurrentScaling runs an amax pass, then the cast pass.
Tests: tests/test_fused_norm_modules.py, tests/test_fused_norm_compile.py,
tests/test_norm_modules.py.
"""
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import _C, _operands, _plan
from ._compile_ops import _absent, config_of, fake, op

__all__ = ["NormFunction", "NormInput", "normalize", "refusal"]

_WITH_CUDA = bool(_C.build_info()["with_cuda"])
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
PER_TENSOR = ("delayed", "current")


def refusal(x, weight, bias):
    """Why the norm kernels do not compute this norm, so torch's norm does (None: they do)."""
    for name, t in (("input", x), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if type(t) not in _PLAIN:
            return f"the {name} is a {type(t).__name__}, not a plain tensor"
        if t.dtype not in _FLOATS:
            return f"the {name} is {t.dtype}; the kernels read float32, bfloat16 and float16"
        if t.device != x.device:  # torch's norm raises its own error
            return f"the {name} is on {t.device}, the input on {x.device}"
        if t is not x and not t.is_contiguous():  # (x is made contiguous; gamma and beta not)
            return f"the {name} is not contiguous"
    if bias is not None and bias.dtype != weight.dtype:
        return f"bias is {bias.dtype} and weight {weight.dtype}; the kernels read one dtype"
    device = x.device.type
    if device == "cuda" and not _WITH_CUDA:
        return "tequant was built without CUDA"
    if device not in ("cpu", "cuda"):
        return f"a {device} tensor (the kernels run on CPU and CUDA)"
    if torch.is_autocast_enabled(device):
        return "torch.autocast is on: it sets the norm's output dtype (float32 for layer_norm)"
    if not torch.compiler.is_compiling() and _operands.transformed():
        return "forward-mode AD or a functorch transform (the Function has no jvp or vmap rule)"
    return None


def torch_normalize(x, normalization, weight, bias, eps, zero_centered_gamma):
    """torch's norm of x over its last dim, in x's dtype (gamma and beta cast to it): where the
    kernels do not run (refusal)."""
    if zero_centered_gamma:  # 1 + gamma in at least FP32, as the kernels (and TE) form it: in a
        # bfloat16 / float16 weight's own dtype the sum rounds (up to 2^-9 of gamma), which a
        # float64 input or torch.autocast's float32 norm would then carry into its output
        compute = torch.promote_types(torch.promote_types(weight.dtype, x.dtype), torch.float32)
        gamma = weight.to(compute) + 1
    else:
        gamma = weight
    shape = (x.shape[-1],)
    if normalization == "LayerNorm":
        return torch.nn.functional.layer_norm(x, shape, gamma.to(x.dtype), None if bias is None
                                              else bias.to(x.dtype), eps)
    return torch.nn.functional.rms_norm(x, shape, gamma.to(x.dtype), eps)


def normalize(x, normalization, weight, bias, eps, zero_centered_gamma):
    """LayerNorm ("LayerNorm") or RMSNorm ("RMSNorm") of x over its last dim with gamma = weight
    (1 + weight when zero-centered) and beta = bias (LayerNorm; may be None), in x's dtype: the
    norm kernels through NormFunction, or torch's norm where they do not run (refusal)."""
    if refusal(x, weight, bias) is not None:
        return torch_normalize(x, normalization, weight, bias, eps, zero_centered_gamma)
    return _norm_apply(x, weight, bias, None, None, normalization, eps, zero_centered_gamma,
                       True, None, 0, False)


# ---- the kernels' calls, eager implementations of the ops -----------------------------------

def _forward_into(x, gamma, beta, normalization, eps, zero_centered, want_hp, want_stats,
                  recipe_id, scale, padded, columnwise, amax):
    """[y_hp if want_hp, mean (LayerNorm) and rstd if want_stats] + with recipe_id (a per-tensor
    FP8 recipe: its "input" quantizer) [codes [padded, K] (rows past M zero), scale_inv, amax]
    + with columnwise [the codes transposed, [K, padded], wgrad's operand] for x [M, K], in one
    C call that allocates them (_C._norm_fwd: DelayedScaling casts in the norm's pass,
    Float8CurrentScaling runs an amax pass first; the kernel writes both directions). amax: the
    tensor to max-accumulate amax(y) into (DelayedScaling's history slot, eager), or None for a
    fresh one."""
    config = None if recipe_id is None else config_of(recipe_id, "input")
    return _C._norm_fwd(x, gamma, beta, normalization, eps, zero_centered, want_hp, want_stats,
                        config, scale, amax, padded, columnwise)


def codes_returned(ctx, rest, amax, columnwise):
    """A fused Function's returns after y: (codes, scale_inv, amax, codes_t) from the op outputs
    `rest` (codes_t last where columnwise, else None), none differentiable; the amax is None
    where it went into the caller's history (eager: the slot `amax` came back; compiled: the op
    returned codes and scale_inv only)."""
    rest = tuple(rest)
    codes_t = rest[-1] if columnwise else None
    rest = rest[:-1] if columnwise else rest
    ctx.mark_non_differentiable(*rest, *(() if codes_t is None else (codes_t,)))
    if len(rest) == 2 or rest[2] is amax:
        return rest[:2] + (None, codes_t)
    return rest + (codes_t,)


@op("tequant::norm_fwd", mutates_args=(), kernel=_C.norm_fwd_op)
def _norm_fwd(x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor],
              normalization: str, eps: float, zero_centered: bool, want_hp: bool,
              want_stats: bool, recipe_id: Optional[str], scale: Optional[torch.Tensor],
              padded: int, columnwise: bool) -> list[torch.Tensor]:
    """_forward_into with a fresh amax (current scaling's codes, or none), in C
    (csrc/ext/fused_ops.c, the kernel); its outputs are allocated as any compiled op's (they may
    become a CUDA graph's under reduce-overhead)."""


@fake("tequant::norm_fwd")
def _norm_fwd_fake(x, gamma, beta, normalization, eps, zero_centered, want_hp, want_stats,
                   recipe_id, scale, padded, columnwise):
    m, k = x.shape
    outs = [torch.empty_like(x)] if want_hp else []
    if want_stats:
        outs += [x.new_empty((m,), dtype=torch.float32)
                 for _ in range(2 if normalization == "LayerNorm" else 1)]
    if recipe_id is not None:
        outs += fake_fp8_outputs(x, recipe_id, "input", padded, k, columnwise)
    return outs


def fake_fp8_outputs(like, recipe_id, role, padded, n, columnwise):
    """Fake [codes [padded, n], scale_inv, amax [1, 1][, codes_t [n, padded]]]: what the C
    calls' tqx_fused_fp8_outputs makes for a per-tensor recipe's `role` quantizer (the norm's,
    the activation's forward and backward)."""
    layout = _C._quantize_layout(config_of(recipe_id, role), int(padded), int(n), _plan.ROWWISE)
    outs = [like.new_empty((r, c), dtype=dtype) for r, c, dtype in layout[:2]]
    outs.append(like.new_empty((1, 1), dtype=torch.float32))
    if columnwise:
        outs.append(like.new_empty((int(n), int(padded)), dtype=layout[0][2]))
    return outs


_FWD_OUTS = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                  torch.Tensor]


@op("tequant::norm_fwd_delayed", mutates_args=("hist_fwd",), kernel=_C.norm_fwd_delayed_op)
def _norm_fwd_delayed(x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor],
                      normalization: str, eps: float, zero_centered: bool, want_hp: bool,
                      want_stats: bool, recipe_id: str, scale_fwd: torch.Tensor, padded: int,
                      columnwise: bool, hist_fwd: torch.Tensor) -> _FWD_OUTS:
    """_forward_into under DelayedScaling on the te.Linear's own buffers, as eager's call:
    x's scale and amax slot are views of its scale_fwd and amax_history_fwd, and the kernel
    max-accumulates amax(y) into the slot (the op mutates hist_fwd). (y_hp, mean, rstd, codes,
    scale_inv, codes transposed), an empty uint8 [0] for each absent one (a mutating op returns
    a fixed tuple; csrc/ext/fused_ops.c, the kernel)."""


@fake("tequant::norm_fwd_delayed")
def _norm_fwd_delayed_fake(x, gamma, beta, normalization, eps, zero_centered, want_hp,
                           want_stats, recipe_id, scale_fwd, padded, columnwise, hist_fwd):
    outs = _norm_fwd_fake(x, gamma, beta, normalization, eps, zero_centered, want_hp,
                          want_stats, recipe_id, None, padded, columnwise)
    del outs[-2 if columnwise else -1]  # no amax: it went into hist_fwd
    it = iter(outs)
    return tuple(next(it) if w else _absent(x)
                 for w in _wanted(want_hp, want_stats, normalization, columnwise))


def _wanted(want_hp, want_stats, normalization, columnwise):
    """Which of (y_hp, mean, rstd, codes, scale_inv, codes transposed)
    tequant::norm_fwd_delayed makes."""
    return (want_hp, want_stats and normalization == "LayerNorm", want_stats, True, True,
            columnwise)


def present_outputs(outs, wanted):
    """The list a fixed-tuple op's outputs stand for: those `wanted`, in order."""
    return [t for t, w in zip(outs, wanted) if w]


def norm_backward(dy: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor,
                  mean: Optional[torch.Tensor], rstd: torch.Tensor, normalization: str,
                  zero_centered: bool, want_dbeta: bool,
                  grad_dtype: torch.dtype) -> list[torch.Tensor]:
    """[dx (x's dtype), dgamma, dbeta if want_dbeta (grad_dtype: the FP32 sums rounded once)] of
    x [M, K] from dy [M, K] in x's dtype and the forward's mean / rstd, allocated by the C call."""
    return _C._norm_bwd(dy, x, gamma, mean, rstd, normalization, zero_centered, want_dbeta,
                        grad_dtype)


@op("tequant::norm_bwd", mutates_args=(), kernel=_C.norm_bwd_op)
def _norm_bwd(dy: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor,
              mean: Optional[torch.Tensor], rstd: torch.Tensor, normalization: str,
              zero_centered: bool, want_dbeta: bool,
              grad_dtype: torch.dtype) -> list[torch.Tensor]:
    """norm_backward, its outputs allocated as norm_fwd's (csrc/ext/fused_ops.c, the
    kernel)."""


@fake("tequant::norm_bwd")
def _norm_bwd_fake(dy, x, gamma, mean, rstd, normalization, zero_centered, want_dbeta,
                   grad_dtype):
    k = x.shape[1]
    return [torch.empty_like(x)] + [x.new_empty((k,), dtype=grad_dtype)
                                    for _ in range(2 if want_dbeta else 1)]


# ---- the Function -----------------------------------------------------------------------------

class NormFunction(torch.autograd.Function):
    """y = norm(x) over the last dim through the kernels; with recipe_id also te.Linear's
    rowwise FP8 codes of y (NormInput.fused).

    forward(x, weight, bias, scale, amax, normalization, eps, zero_centered, want_hp, recipe_id,
    padded, columnwise) returns y (x's shape and dtype) alone without recipe_id, else (y, codes,
    scale_inv, amax or None, codes transposed or None): the amax is None where it went into
    the given `amax`: DelayedScaling's slot in eager code, the module's whole amax_history_fwd
    (with its whole scale_fwd as `scale`) in compiled code, tequant::norm_fwd_delayed; the
    transposed codes ([K, padded], wgrad's operand, written by the same kernel) come with
    columnwise. Without want_hp y carries only the gradient (an expanded scalar: no [M, K]
    store): the te.Linear that reads the codes returns its input gradient for it."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, amax, normalization, eps, zero_centered, want_hp,
                recipe_id, padded, columnwise):
        k = x.shape[-1]
        x2d = x.reshape(-1, k).contiguous()
        needs = ctx.needs_input_grad
        want_stats = needs[0] or needs[1] or needs[2]
        columnwise = columnwise and recipe_id is not None
        args = (x2d, weight, bias, normalization, eps, zero_centered, want_hp, want_stats,
                recipe_id, scale, padded, columnwise)
        compiling = torch.compiler.is_compiling()
        if compiling and amax is not None:  # the module's buffers
            outs = present_outputs(torch.ops.tequant.norm_fwd_delayed(*args, amax),
                                   _wanted(want_hp, want_stats, normalization, columnwise))
        elif compiling:
            outs = torch.ops.tequant.norm_fwd(*args)
        else:
            outs = _forward_into(*args, amax)
        it = iter(outs)
        y = next(it).view(x.shape) if want_hp else x.new_empty(()).expand(x.shape)
        mean = next(it) if want_stats and normalization == "LayerNorm" else None
        rstd = next(it) if want_stats else None
        if want_stats:
            ctx.save_for_backward(x2d, weight, mean, rstd)
            ctx.normalization, ctx.zero_centered, ctx.shape = normalization, zero_centered, x.shape
            ctx.bias_dtype = bias.dtype if bias is not None else None
        if recipe_id is None:
            return y
        # the codes have no gradient: autograd must not make (and fill) zeros of their shape
        ctx.set_materialize_grads(False)
        return (y,) + codes_returned(ctx, it, amax, columnwise)

    @staticmethod
    @once_differentiable  # the kernels' backward is not differentiable: a clear error, not a
    def backward(ctx, dy, *_):  # silently missing second derivative
        if dy is None:  # y took no part in the loss
            return (None,) * 12
        x2d, weight, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        want_dbeta = ctx.bias_dtype is not None and needs[2]
        args = (dy.reshape(x2d.shape).contiguous(), x2d, weight, mean, rstd, ctx.normalization,
                ctx.zero_centered, want_dbeta, weight.dtype)  # refusal: bias has weight's dtype
        if torch.compiler.is_compiling():
            outs = torch.ops.tequant.norm_bwd(*args)
        else:
            outs = norm_backward(*args)
        dx = outs[0].view(ctx.shape) if needs[0] else None
        dgamma = outs[1] if needs[1] else None
        dbeta = outs[2] if want_dbeta else None
        return dx, dgamma, dbeta, None, None, None, None, None, None, None, None, None


_norm_apply = _operands.fast_apply(NormFunction)


# ---- the input of a te.Linear that normalizes first --------------------------------------------

class NormInput:
    """x and the norm a te.LayerNormLinear (or te.LayerNormMLP's fc1) applies before its GEMM.
    te.Linear resolves it once it knows the recipe: fused() where the recipe is per-tensor FP8
    (fusable), else high_precision(); either sets `output`, the norm's output in x's dtype, when
    keep_output asks for it (return_layernorm_output). grad_output: te.LayerNormMLP's
    _act_fn.GradOutput, through which the activation's backward hands fc1 its grad_output
    quantized where fc1 multiplies fused codes (else None)."""

    __slots__ = ("x", "weight", "bias", "normalization", "eps", "zero_centered", "keep_output",
                 "output", "refusal", "grad_output")

    def __init__(self, x, weight, bias, normalization, eps, zero_centered, keep_output):
        self.x, self.weight, self.bias = x, weight, bias
        self.normalization, self.eps, self.zero_centered = normalization, eps, zero_centered
        self.keep_output = keep_output
        self.output = self.grad_output = None
        self.refusal = refusal(x, weight, bias)

    @property
    def shape(self):
        """The norm's output shape (x's)."""
        return self.x.shape

    def fusable(self, scaling, backward_override, tp, act_blocks=False):
        """The codes can come from the norm: per-tensor FP8, no backward_override (which reads
        x itself), the kernels run, and no tensor parallelism over several ranks (sequence
        parallelism gathers its own quantized input; a column-parallel layer's input gradient
        is reduced before the norm's backward: both take the high-precision route)."""
        return (self.refusal is None and scaling in PER_TENSOR and backward_override is None
                and (tp is None or tp.size == 1))

    def high_precision(self):
        y = normalize(self.x, self.normalization, self.weight, self.bias, self.eps,
                      self.zero_centered)
        if self.keep_output:
            self.output = y
        return y

    def fused(self, recipe_id, align, scale, amax, columnwise=False):
        """(y, the six members of the rowwise quantization te.Linear multiplies) for the recipe
        registered as recipe_id (per-tensor FP8). scale: DelayedScaling's [1] scale of the
        input; amax: the slot to max-accumulate amax(y) into, or None (a fresh amax, which the
        members then hold); compiled code passes the te.Linear's whole scale_fwd and
        amax_history_fwd instead (NormFunction), and the members hold no amax then.
        columnwise: the members hold the codes transposed too (wgrad's operand, written by the
        norm's kernel). act_blocks (fusable): ActInput's (Float8BlockScaling), unused here."""
        x = self.x
        rows = x.numel() // x.shape[-1]
        y, data, scale_inv, fresh, data_t = _norm_apply(
            x, self.weight, self.bias, scale, amax, self.normalization, self.eps,
            self.zero_centered, self.keep_output, recipe_id, _plan.padded(rows, align),
            columnwise)
        if self.keep_output:
            self.output = y
        return y, (data, scale_inv, data_t, None, given_amax(amax, fresh), None)


def given_amax(amax, fresh):
    """A fused x's amax member: the fresh amax the op returned, else the eager slot it went
    into (compiled code: None, the slot is a view of a buffer the graph mutates)."""
    if fresh is not None or torch.compiler.is_compiling():
        return fresh
    return amax


def resolved(inp):
    """inp as a tensor: a NormInput's high-precision norm output (an _act_fn.ActInput's
    activation)."""
    return inp if isinstance(inp, torch.Tensor) else inp.high_precision()


def with_columnwise(members):
    """Per-tensor FP8 members with the columnwise codes (the rowwise ones transposed, one tiled
    pass: tq_transpose) that wgrad reads; members that have them (the norm's, which its kernel
    writes; a fused activation's Float8BlockScaling blocks) as they are."""
    if members[2] is not None:
        return members
    data = members[0]
    if torch.compiler.is_compiling():
        data_t = torch.ops.tequant.transpose_codes(data)
    else:
        data_t = data.new_empty((data.shape[1], data.shape[0]))
        _C._transpose(data, data_t)
    return members[:2] + (data_t,) + members[3:]
