"""te.LayerNormMLP's activation as torch runs it: one autograd Function over the activation kernels
(tq_act_forward / tq_act_backward, csrc/include/tequant/tequant.h), their tequant::act_fwd /
act_fwd_delayed / act_bwd ops for torch.compile, and ActInput, fc1's output h that fc2 (a te.Linear)
activates itself, as _norm_fn.NormInput is the input fc1 normalizes.

One definition serves eager and compiled code (as _norm_fn.py): ActFunction calls the ops'
implementations directly in eager mode and the ops (opaque to Dynamo, with fake kernels) while
compiling. Activations as TE defines them (layernorm_mlp.py); the gated ones read h = [first |
second] and give [M, K / 2]. The Function flattens leading dims to [M, K], saves h, and its
backward returns dh in h's dtype (_backward_into). Where the kernels do not run (`refusal`: not a
plain tensor, another dtype than float32 / bfloat16 / float16, torch.autocast, forward AD or
functorch transforms, another device, CUDA without a CUDA build) torch's activation runs.
Fused (ActInput.fused, per-tensor FP8 recipes, the rule of NormInput.fusable): the forward
writes fc2's rowwise FP8 codes of the FP32 activation (not of it rounded to h's dtype), rows
zero-padded to the format's multiple; DelayedScaling casts with fc2's input scale and
max-accumulates the amax into fc2's input history slot (compiled too: tequant::act_fwd_delayed
takes fc2's buffers), Float8CurrentScaling runs an amax pass, then the cast pass.
Fused backward (GradOutput): where fc1 multiplies the norm's fused codes, the backward writes
fc1's grad_output instead of dh: the rowwise FP8 codes of the FP32 dh with fc1's grad_output
quantizer (its DelayedScaling scale and history slot), its amax and dbias (the kernel's
fixed-order FP32 column sums) in the same pass; fc1's backward multiplies those codes
(_dy_given.py: given_dy_backward, tequant::linear_bwd_dy_given, which compiled under
DelayedScaling also accumulates that amax into fc1's history and runs its update in place, as
linear_bwd does).
Fused Float8BlockScaling and MXFP8BlockScaling (1x128 / 1x32 E4M3 input blocks,
_plan.Plan.act_blocks): the forward writes fc2's blocks in both directions from act(h) rounded to h's dtype (TransformerEngine's rule for its
fused block-format casts), the bits te.Linear's own quantization of the kernel's y_hp would give;
where fc1 (on the norm's output, its bias not learning, eager) asked through its GradOutput, the
backward writes fc1's grad_output blocks in both directions from dh rounded to h's dtype (the
bits of fc1's own quantization of dh; _plan.Plan.dy_blocks), else it returns dh.
Compiled, a plain dh is written over dy (tequant::act_bwd_over_dy: dy is the graph's own
intermediate, fc2's input gradient, which Inductor's reinplacing writes in place), or for the
gated activations (dh twice dy's width) over the saved h (tequant::act_bwd_over_h: a graph
input of the backward, which Inductor copies first: one [M, K] pass). fc1's backward on
the grad_output the activation quantized is _dy_given.py's.
Tests: tests/test_fused_act_modules.py, tests/test_fused_dh.py, tests/test_compile_delayed.py,
tests/test_act_block.py, tests/test_act_mxfp8.py, tests/test_backward_memory.py.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import _C, _compile, _operands, _plan
from ._compile_ops import _absent, config_of, fake, op
from ._norm_fn import (PER_TENSOR, codes_returned, fake_fp8_outputs,
                       given_amax, refusal as _norm_refusal)

__all__ = ["ActFunction", "ActInput", "GradOutput", "activate", "kernel_activate", "refusal",
           "torch_activate", "ARITHMETIC_BOUND", "GATED", "beats_torch"]

GATED = ("geglu", "reglu", "swiglu")
# The activations whose kernels compute an expensive exact arithmetic per element (tequant's own
# e^x, two IEEE divisions): torch's activation is faster for the unfused high-precision
# activation (activate), and where the fused pass evaluates act more than a plain pass does
# (Float8CurrentScaling's two runs: amax, then cast; the block formats' tile pass, at fewer
# threads an SM) unless h is bfloat16, whose kernels read act(x) from cuda/act_table.cuh's table.
# H200, 8192x16384 bf16 gelu since the table's cheaper index (docs/results/NOTES.md,
# thirty-ninth and fortieth sessions): fused current 250.1 us forward and 329.8 us backward
# against 312.2 / 431.6 for torch's activation + te.Linear's quantization (before it: 361.7 /
# 440.7, when torch's ran for every dtype); silu 248.9 / 331.8 against 301.3 / 426.7; the
# Float8BlockScaling tile pass forward (both directions) 256.1 against 300.8 (silu 254.5 against
# 291.1; its backward is BLOCK_DH's rule below). float16 and float32 compute the arithmetic per
# element (no table: not measured against torch since, so they keep torch's). Under
# DelayedScaling (one run: 140.3 / 189.3 us for bf16 gelu) the fused pass wins for every dtype.
# qgelu is not one of them: torch runs it as three kernels, slower than the fused current run.
# The gated ones evaluate act on half of h, and relu / srelu run at memory speed, so they win
# everywhere.
ARITHMETIC_BOUND = ("gelu", "silu")
TABLE_DTYPES = (torch.bfloat16,)  # where the ARITHMETIC_BOUND ones read a table


def beats_torch(activation, dtype):
    """Whether the activation's fused kernels write fc2's input for h of `dtype` faster than
    torch's activation + te.Linear's quantization where they evaluate act more than once or in
    the block formats' tile pass (ARITHMETIC_BOUND's rule above)."""
    return activation not in ARITHMETIC_BOUND or dtype in TABLE_DTYPES


# The activations whose backward writes fc1's Float8BlockScaling / MXFP8BlockScaling grad_output
# blocks (GradOutput.ask): those without the bf16 table. H200, bf16, 8192 rows, both directions
# (docs/results/NOTES.md, eighteenth session): relu [8192, 16384] 253.0 us fused against 358.2
# for the kernel's dh + te.ops.quantize, reglu [8192, 28672] 512.9 against 567.5; the table's
# activations lose in the tile pass (lookups latency-bound at its two CTAs per SM): swiglu 978.0
# against 615.3, gelu 470.2 against 355.6 (torch's dh + quantize).
BLOCK_DH = ("relu", "srelu", "reglu")


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


def activate(h, activation, dh=None):
    """TE's activation of h (gated: act(first half) * second half) in h's dtype, as te.LayerNormMLP
    runs it unfused: torch's for an ARITHMETIC_BOUND activation (faster), else kernel_activate.
    dh: the GradOutput of h's producer (its backward then gets its grad_output quantized), or
    None."""
    if activation in ARITHMETIC_BOUND:
        return torch_activate(h, activation)
    return kernel_activate(h, activation, dh)


def kernel_activate(h, activation, dh=None):
    """activate() through the kernels (ActFunction) for every activation, torch's where they do
    not run (refusal): the high-precision twin of the fused forward (its tests' reference)."""
    if refusal(h) is not None:
        return torch_activate(h, activation)
    return _act_apply(h, None, None, activation, True, None, 0, False, *_dh_args(dh))


# ---- the kernels' calls, eager implementations of the ops -----------------------------------

def _forward_into(h, activation, want_hp, recipe_id, scale, padded, amax, columnwise=False):
    """[y_hp if want_hp] + with recipe_id (a per-tensor FP8 recipe: its "input" quantizer)
    [codes [padded, N] (rows past M zero), scale_inv, amax] for h [M, K], in one C call that
    allocates them (_C._act_fwd: DelayedScaling casts in the activation's pass, current scaling
    runs an amax pass first). amax: the tensor to max-accumulate amax(y) into (DelayedScaling's
    history slot, eager), or None for a fresh one. Float8BlockScaling (1x128 blocks, no y_hp):
    [data, scale_inv] + [data_t, scale_inv_t] with columnwise, of y rounded to h's dtype."""
    config = None if recipe_id is None else config_of(recipe_id, "input")
    return _C._act_fwd(h, activation, want_hp, config, scale, amax, padded, columnwise)


@op("tequant::act_fwd", mutates_args=(), kernel=_C.act_fwd_op)
def _act_fwd(h: torch.Tensor, activation: str, want_hp: bool, recipe_id: Optional[str],
             scale: Optional[torch.Tensor], padded: int,
             columnwise: bool = False) -> list[torch.Tensor]:
    """_forward_into with a fresh amax (current scaling's codes, block formats' or none), in C
    (csrc/ext/fused_ops.c, the kernel); its outputs are allocated as any compiled op's (they may
    become a CUDA graph's under reduce-overhead)."""


@op("tequant::act_fwd_delayed", mutates_args=("hist_fwd",), kernel=_C.act_fwd_delayed_op)
def _act_fwd_delayed(h: torch.Tensor, activation: str, want_hp: bool, recipe_id: str,
                     scale_fwd: torch.Tensor, padded: int, columnwise: bool,
                     hist_fwd: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """_forward_into under DelayedScaling on fc2's own buffers, as tequant::norm_fwd_delayed:
    the kernel max-accumulates amax(y) into x's slot of hist_fwd. (y_hp, codes, scale_inv,
    codes transposed), an empty uint8 [0] for y_hp without want_hp and for the transposed codes
    without columnwise (csrc/ext/fused_ops.c, the kernel)."""


def _delayed_tuple(h, outs, want_hp, columnwise):
    """tequant::act_fwd_delayed's fixed tuple from _C._act_fwd's list ([y_hp], codes, scale_inv,
    amax slot[, codes_t]) or the fake's."""
    codes_t = outs[-1] if columnwise else _absent(h)
    at = -4 if columnwise else -3
    return (outs[0] if want_hp else _absent(h), outs[at], outs[at + 1], codes_t)


@fake("tequant::act_fwd")
def _act_fwd_fake(h, activation, want_hp, recipe_id, scale, padded, columnwise=False):
    m, k = h.shape
    n = _cols(activation, k)
    outs = [h.new_empty((m, n))] if want_hp else []
    if recipe_id is not None and _plan.blocks_of(recipe_id)[0]:
        usage = _plan.ROWWISE | (_plan.COLUMNWISE if columnwise else 0)
        layout = _C._quantize_layout(config_of(recipe_id, "input"), int(padded), int(n), usage)
        return outs + [h.new_empty((r, c), dtype=dtype) for r, c, dtype in
                       layout[:4 if columnwise else 2]]
    if recipe_id is not None:
        outs += fake_fp8_outputs(h, recipe_id, "input", padded, n, columnwise)
    return outs


@fake("tequant::act_fwd_delayed")
def _act_fwd_delayed_fake(h, activation, want_hp, recipe_id, scale_fwd, padded, columnwise,
                          hist_fwd):
    outs = _act_fwd_fake(h, activation, want_hp, recipe_id, None, padded, columnwise)
    return _delayed_tuple(h, outs, want_hp, columnwise)


def _backward_into(dy, h, activation, recipe_id, padded, scale, dbias_dtype, slot,
                   columnwise=False):
    """[dh [M, K] (h's dtype)] of h [M, K] from dy [M, N] in h's dtype; with recipe_id (a
    per-tensor FP8 recipe) fc1's grad_output instead (GradOutput): [codes [padded, K] (rows
    past M zero) of its "grad_output" quantizer, scale_inv, amax [1, 1], codes_t [K, padded]
    if columnwise, dbias ([K] of dbias_dtype, fc1's bias dtype: the kernel rounds its float32
    sums to it) if dbias_dtype],
    in one C call that allocates them (_C._act_bwd). slot: the tensor to max-accumulate amax(dh)
    into (DelayedScaling's history slot, eager), or None for a fresh one. Float8BlockScaling /
    MXFP8BlockScaling (_plan.Plan.dy_blocks, no dbias): [data, scale_inv] + [data_t,
    scale_inv_t] with columnwise, of dh rounded to h's dtype."""
    config = None if recipe_id is None else config_of(recipe_id, "grad_output")
    outs = _C._act_bwd(dy, h, activation, config, scale, slot, padded, dbias_dtype, columnwise)
    if config is not None and slot is not None:
        outs[2] = slot.view(1, 1)
    return outs


@op("tequant::act_bwd", mutates_args=(), kernel=_C.act_bwd_op)
def _act_bwd(dy: torch.Tensor, h: torch.Tensor, activation: str, recipe_id: Optional[str],
             padded: int, scale: Optional[torch.Tensor], dbias_dtype: Optional[torch.dtype],
             columnwise: bool = False) -> list[torch.Tensor]:
    """_backward_into with a fresh amax (compiled code max-accumulates it into fc1's history),
    its outputs allocated as act_fwd's (csrc/ext/fused_ops.c, the kernel)."""


@fake("tequant::act_bwd")
def _act_bwd_fake(dy, h, activation, recipe_id, padded, scale, dbias_dtype, columnwise=False):
    if recipe_id is None:
        return [torch.empty_like(h)]
    k = h.shape[1]
    if _plan.blocks_of(recipe_id)[1]:
        return [h.new_empty(shape, dtype=dtype)
                for shape, dtype in _block_shapes(recipe_id, padded, k, columnwise)]
    outs = fake_fp8_outputs(h, recipe_id, "grad_output", padded, k, columnwise)
    return outs + ([h.new_empty((k,), dtype=dbias_dtype)] if dbias_dtype is not None else [])


@op("tequant::act_bwd_over_h", mutates_args=("h",), kernel=_C.act_bwd_over_h_op)
def _act_bwd_over_h(dy: torch.Tensor, h: torch.Tensor, activation: str) -> None:
    """dh written over h (the kernels read each element of h before they write it: the same
    bits as act_bwd's fresh dh), for the gated activations, whose dh does not fit in dy. The
    compiled backward's plain dh: its saved h is dead after the activation's backward, so the
    graph holds one [M, K] buffer there instead of two (the compiled Llama block's peak,
    docs/results/NOTES.md, twenty-seventh session). h is a graph input of the backward, which
    Inductor does not write in place: it copies h first (into h's own buffer where h is dead).
    Compiled code only. The kernel: csrc/ext/fused_ops.c."""


@fake("tequant::act_bwd_over_h")
def _act_bwd_over_h_fake(dy, h, activation):
    return None


@op("tequant::act_bwd_over_dy", mutates_args=("dy",), kernel=_C.act_bwd_over_dy_op)
def _act_bwd_over_dy(dy: torch.Tensor, h: torch.Tensor, activation: str) -> None:
    """dh written over dy (not gated: dh has dy's shape; the kernels read each element of dy
    and h before they write it, one thread an element: act_bwd's bits). dy is fc2's input
    gradient, an intermediate of the compiled backward that is dead after this op, so
    Inductor's reinplacing lets the kernel write it in place (no copy, no new buffer); where dy
    is used again or is a graph input, functionalization copies it first. Compiled code only.
    The kernel: csrc/ext/fused_ops.c."""


@fake("tequant::act_bwd_over_dy")
def _act_bwd_over_dy_fake(dy, h, activation):
    return None


# ---- the Function -----------------------------------------------------------------------------

class ActFunction(torch.autograd.Function):
    """y = act(h) over the last dim through the kernels; with recipe_id also fc2's FP8 codes of
    y (ActInput.fused).

    forward(h, scale, amax, activation, want_hp, recipe_id, padded, columnwise, dh, dh_scale,
    dh_slot, *dh_tokens) returns y alone without recipe_id, else (y, codes, scale_inv, amax or
    None: None where the amax went into the given `amax`, the eager DelayedScaling slot, or
    in compiled code fc2's whole amax_history_fwd, with its whole scale_fwd as `scale`; the
    codes transposed with columnwise, else None);
    Float8BlockScaling: (y, data, scale_inv[, data_t, scale_inv_t with columnwise]). Without want_hp
    y carries only the gradient (an expanded scalar: no [M, N] store): the te.Linear that reads
    the codes returns its input gradient for it. dh ... dh_tokens: a GradOutput's (_dh_args;
    None, None, None: the backward returns dh); with them the backward returns fc1's quantized
    grad_output as the tokens' gradients and a zero placeholder as h's."""

    @staticmethod
    def forward(ctx, h, scale, amax, activation, want_hp, recipe_id, padded, columnwise, dh,
                dh_scale, dh_slot, *dh_tokens):
        k = h.shape[-1]
        h2d = h.reshape(-1, k).contiguous()
        shape = h.shape[:-1] + (_cols(activation, k),)
        args = (h2d, activation, want_hp, recipe_id, scale, padded)
        compiling = torch.compiler.is_compiling()
        if compiling and amax is not None:  # fc2's buffers
            outs = torch.ops.tequant.act_fwd_delayed(*args, columnwise, amax)
            outs = (outs if want_hp else outs[1:])[:None if columnwise else -1]
        elif compiling:
            outs = torch.ops.tequant.act_fwd(*args, columnwise)
        else:
            outs = _forward_into(*args, amax, columnwise)
        it = iter(outs)
        y = next(it).view(shape) if want_hp else h.new_empty(()).expand(shape)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(h2d)
            ctx.activation, ctx.shape = activation, h.shape
            # fc1's grad_output quantizer (recipe id, padded rows) and its DelayedScaling scale
            # and slot, read when backward runs, as te.Linear's backward reads them
            ctx.dh = (dh, dh_scale, dh_slot, _dbias_dtype(dh, dh_tokens)) if dh_tokens else None
        if recipe_id is None:
            return y
        # the codes have no gradient: autograd must not make (and fill) zeros of their shape
        ctx.set_materialize_grads(False)
        ctx.n_tokens = len(dh_tokens)
        if _plan.blocks_of(recipe_id)[0]:  # the members, no amax
            members = tuple(it)
            ctx.mark_non_differentiable(*members)
            return (y,) + members
        return (y,) + codes_returned(ctx, it, amax, columnwise)

    @staticmethod
    @once_differentiable  # the kernels' backward is not differentiable: a clear error
    def backward(ctx, dy, *_):
        if dy is None:  # y took no part in the loss
            return (None,) + _NONE_ARGS + (None,) * ctx.n_tokens
        h2d, = ctx.saved_tensors
        dy2d = dy.reshape(h2d.shape[0], _cols(ctx.activation, h2d.shape[1])).to(
            h2d.dtype).contiguous()
        dh = ctx.dh
        (recipe_id, padded, columnwise), scale, slot, dbias_dtype = dh or (
            (None, 0, False), None, None, None)
        args = (dy2d, h2d, ctx.activation, recipe_id, padded, scale, dbias_dtype)
        compiling = torch.compiler.is_compiling()
        if dh is None and compiling:  # dh over a dead buffer: one buffer less
            if ctx.activation in GATED:
                torch.ops.tequant.act_bwd_over_h(dy2d, h2d, ctx.activation)
                return (h2d.view(ctx.shape),) + _NONE_ARGS
            torch.ops.tequant.act_bwd_over_dy(dy2d, h2d, ctx.activation)
            return (dy2d.view(ctx.shape),) + _NONE_ARGS
        if compiling:
            outs = torch.ops.tequant.act_bwd(*args, columnwise)
        else:
            outs = _backward_into(*args, slot, columnwise)
        if dh is None:
            return (outs[0].view(ctx.shape),) + _NONE_ARGS
        # fc1's backward multiplies the codes (given_dy_backward): h's gradient is a placeholder
        return (h2d.new_zeros(()).expand(ctx.shape),) + _NONE_ARGS + tuple(outs)


_NONE_ARGS = (None,) * 10  # ActFunction's arguments after h up to the tokens
_act_apply = _operands.fast_apply(ActFunction)


# ---- the input of a te.Linear that activates first ----------------------------------------------

class ActInput:
    """h (fc1's output) and the activation te.LayerNormMLP's fc2 applies before its GEMM.
    te.Linear resolves it once it knows the recipe, as a _norm_fn.NormInput: fused() where the
    recipe is per-tensor FP8 (fusable), else high_precision(). dh: fc1's GradOutput (or None),
    which either way has the activation's backward quantize fc1's grad_output where fc1 asked."""

    __slots__ = ("h", "activation", "refusal", "dh")

    def __init__(self, h, activation, dh=None):
        self.h, self.activation, self.dh = h, activation, dh
        self.refusal = refusal(h)

    @property
    def shape(self):
        """The activation's output shape (gated: half of h's features)."""
        h = self.h
        return h.shape[:-1] + (_cols(self.activation, h.shape[-1]),)

    def fusable(self, scaling, backward_override, tp, act_blocks=False):
        """NormInput.fusable's rule: per-tensor FP8, no backward_override, the kernels run, no
        tensor parallelism over several ranks. Float8BlockScaling and MXFP8BlockScaling too
        where their input blocks are 1x128 / 1x32 E4M3 (act_blocks: the recipe's
        _plan.Plan.act_blocks): the activation's pass writes both directions' blocks (H200, 8192
        rows, bf16, docs/results/NOTES.md: swiglu 317.5 us against 327.3 for the kernel's
        activation + te.Linear's quantization, relu 197.1 against 284.9). An ARITHMETIC_BOUND
        activation fuses under Float8CurrentScaling and the block formats only for bfloat16 h
        (beats_torch)."""
        if (self.refusal is not None or backward_override is not None
                or (tp is not None and tp.size != 1)):
            return False
        if scaling == "delayed":
            return True
        fast = beats_torch(self.activation, self.h.dtype)
        if scaling in _plan.BLOCK_FORMATS:
            return act_blocks and fast
        return scaling in PER_TENSOR and fast

    def high_precision(self):
        return activate(self.h, self.activation, self.dh)

    def fused(self, recipe_id, align, scale, amax, columnwise=False):
        """(y carrier, the six members of the quantization te.Linear multiplies), as
        NormInput.fused: per-tensor FP8 codes; Float8BlockScaling's / MXFP8BlockScaling's
        blocks; either with the columnwise ones too where `columnwise` (wgrad will read them),
        written by the activation's pass."""
        h = self.h
        rows = h.numel() // h.shape[-1]
        block = _plan.blocks_of(recipe_id)[0]
        outs = _act_apply(
            h, scale, amax, self.activation, False, recipe_id, _plan.padded(rows, align),
            columnwise, *_dh_args(self.dh))
        if block:
            members = outs[1:] if columnwise else outs[1:] + (None, None)
            return outs[0], members + (None, None)
        y, data, scale_inv, fresh, data_t = outs
        return y, (data, scale_inv, data_t, None, given_amax(amax, fresh), None)


# ---- fc1's grad_output from the activation's backward -------------------------------------------

class GradOutput:
    """fc1's grad_output as te.LayerNormMLP's activation backward writes it, quantized.

    LayerNormMLP hands one to fc1 in its NormInput (NormInput.grad_output) and to the activation
    (ActInput.dh). Where fc1 multiplies the norm's fused codes with grad enabled (linear.py,
    _compile_linear.py: per-tensor FP8, no tensor parallelism, no backward_override) it asks()
    for it: its Function then returns, beside h, `tokens` (placeholders(): expanded scalars of
    the shapes and dtypes of dy's codes, scale_inv, amax, the codes transposed where fc1's
    wgrad runs and, with a bias that learns, dbias),
    which the activation takes as inputs. Its backward returns the real tensors as their
    gradients, so autograd itself carries them to fc1's backward (data flow that Dynamo and AOT
    trace, where a side channel between two backwards would not be); fc1's backward multiplies
    those codes and returns dbias as its bias gradient. Tokens whose gradients do not come
    (torch's activation ran) leave fc1's backward as it was, quantizing its dy itself."""

    __slots__ = ("activation", "dtype", "spec", "scale", "slot", "tokens")

    def __init__(self, activation, dtype=None):
        self.activation, self.dtype = activation, dtype  # dtype: h's (the module input's)
        self.spec = self.scale = self.slot = None
        self.tokens = ()

    def ask(self, recipe_id, padded, state, *, delayed, columnwise=False):
        """fc1's request: its recipe id, the padded rows of its x, and DelayedScaling's
        (scale [1], history slot [1]; None in compiled code: a fresh amax) of its grad_output,
        or (None, None); columnwise: the columnwise codes (per-tensor: the codes transposed,
        in the backward's C call) or Float8BlockScaling's / MXFP8BlockScaling's columnwise
        blocks too (fc1's wgrad reads them). Returns the spec fc1's Function takes (its `dh`),
        or None where the activation's backward would be slower than fc1's own quantization
        (Float8CurrentScaling where not beats_torch: torch runs that activation; block
        formats but for BLOCK_DH)."""
        if not delayed and not beats_torch(self.activation, self.dtype):
            return None
        if (_plan.blocks_of(recipe_id)[1]
                and self.activation not in BLOCK_DH):
            return None
        self.spec = (recipe_id, padded, columnwise)
        self.scale, self.slot = state
        return self.spec

    def received(self, outs):
        """fc1's output from its Function's (h, *tokens)."""
        self.tokens = tuple(outs[1:])
        return outs[0]


def _dbias_dtype(spec, tokens):
    """The dbias dtype of a GradOutput's tokens (the last per-tensor token, after codes,
    scale_inv, amax and, with columnwise, codes_t), or None."""
    if (_plan.blocks_of(spec[0])[1]
            or len(tokens) != 4 + bool(spec[2])):
        return None
    return tokens[-1].dtype


def _block_shapes(recipe_id, padded, n, columnwise):
    """[(shape, dtype)] of the block-format grad_output members the activation's backward
    writes for [padded, n]: data, scale_inv (+ data_t, scale_inv_t with columnwise)."""
    usage = _plan.ROWWISE | (_plan.COLUMNWISE if columnwise else 0)
    layout = _C._quantize_layout(config_of(recipe_id, "grad_output"), int(padded), int(n), usage)
    return [((r, c), dtype) for r, c, dtype in layout[:4 if columnwise else 2]]


def _dh_args(dh):
    """ActFunction's trailing arguments for a GradOutput (or None)."""
    if dh is None or not dh.tokens:
        return (None, None, None)
    return (dh.spec, dh.scale, dh.slot) + dh.tokens


@_compile.constant
def _codes_dtype(recipe_id):
    """The torch dtype of the recipe's grad_output codes (float8_e5m2 for HYBRID)."""
    return _C._quantize_layout(config_of(recipe_id, "grad_output"), 16, 16, _plan.ROWWISE)[0][2]


def placeholders(like, spec, n, dbias_dtype):
    """The tokens fc1's Function returns (GradOutput): one expanded scalar (no storage) per
    tensor the activation's backward makes, of its shape and dtype: codes [padded, n],
    scale_inv and amax [1, 1], with columnwise codes_t [n, padded], then dbias [n] of
    dbias_dtype (fc1's bias dtype, where its bias learns; None: no dbias); block formats: their
    members (_block_shapes), no dbias."""
    recipe_id, padded, columnwise = spec
    if _plan.blocks_of(recipe_id)[1]:
        if dbias_dtype is not None:
            raise ValueError("a block-format grad_output from the activation has no dbias")
        shapes = _block_shapes(recipe_id, padded, n, columnwise)
    else:
        codes = _codes_dtype(recipe_id)
        shapes = ([((padded, n), codes), ((1, 1), torch.float32), ((1, 1), torch.float32)]
                  + ([((n, padded), codes)] if columnwise else [])
                  + ([((n,), dbias_dtype)] if dbias_dtype is not None else []))
    if torch.compiler.is_compiling():  # (outputs that alias each other are AOT's extra work)
        return tuple(like.new_empty((), dtype=dtype).expand(shape) for shape, dtype in shapes)
    bases = {}  # eager: one scalar per dtype (an allocation costs ~3 us on the H200 host)
    for _, dtype in shapes:
        if dtype not in bases:
            bases[dtype] = like.new_empty((), dtype=dtype)
    return tuple([bases[dtype].expand(shape) for shape, dtype in shapes])
