"""te.Linear: a torch.nn.Linear whose three GEMMs run quantized inside te.autocast.

Outside te.autocast (or with enabled=False) it is exactly torch.nn.functional.linear. Inside, the
active recipe's quantizers (te.quantizer_config(recipe, role)) quantize x ("input"), W ("weight")
and dy ("grad_output"), and te.ops' GEMM runs fprop y = x W^T (x rowwise, W rowwise), dgrad
dx = dy W (dy rowwise, W columnwise) and wgrad dW = dy^T x (dy columnwise, x columnwise), as
TE_REFERENCE 7.3-7.5 describe. Backward keeps the quantized columnwise x and the quantized W
(through save_for_backward, so activation checkpointing drops and recomputes them; the recompute
replays what the forward ran with, checkpoint.py), not high-precision copies. Any number of
tokens works: rows are zero-padded to the format's multiple (zero rows add nothing to any
product) and the result is exactly the unpadded one. A weight that arrives quantized (FSDP2's
quantized all-gather) is multiplied as it is.
DelayedScaling keeps its amax histories and scales in module buffers (delayed.py). The forward
and the backward are one C call each (csrc/ext/linear.c); this file is the autograd Function,
the module and the recipe plans around them. With no graph to record (torch.no_grad,
inference_mode, nothing requiring grad) forward is the C call alone, without the Function.
Copies and pickles rebuild the plans and carry the cached weight (Linear.__getstate__).
te.LayerNormLinear (and te.LayerNormMLP's fc1) hand forward a _norm_fn.NormInput, x before its
norm: _compute runs the norm, writing x's FP8 codes itself where the recipe is per-tensor
(NormInput.fusable; the Function then multiplies those codes, `given`), else its output.
te.LayerNormMLP's fc2 gets a _act_fn.ActInput (fc1's output before the activation) the same way;
its fc1, fed the norm's codes, also has the activation's backward quantize its grad_output
(_act_fn.GradOutput: the Function then returns placeholders beside y, and its backward
multiplies the codes that arrive as their gradients and returns the dbias that comes with them).
Under Float8BlockScaling / MXFP8BlockScaling its fc1 on the norm's output asks the same for dh's
blocks where its bias does not learn (no dbias in that pass).
Tests: tests/test_linear.py, tests/test_linear_module.py, tests/test_linear_delayed.py,
tests/test_checkpoint.py, tests/test_copy.py, tests/test_act_grad_block.py.
"""
import math

import torch
import torch.nn.functional as F

from . import (_C, _act_fn, _compile_linear, _compile_modules, _custom_linear, _dy_given,
               _norm_fn, _operands, _override, _plan, checkpoint, delayed)
from . import _compile_gathered  # noqa: F401  (registers with _compile_linear)
from ._act_fn import ActInput
from ._norm_fn import NormInput
from ._operands import node_saved as _saved  # (a node's kept operands; tests read them too)
from ._plan import (COLUMNWISE as _COLUMNWISE, KEEP_X_ROWWISE as _KEEP_X_ROWWISE,
                    NEED_DGRAD as _NEED_DGRAD, NEED_WGRAD as _NEED_WGRAD, PACKED as _PACKED,
                    ROWWISE as _ROWWISE)

__all__ = ["Linear"]


class _QuantizedLinear(torch.autograd.Function):
    """y = x W^T + b with quantized GEMMs: one C call forward (csrc/ext/linear.c
    linear_forward), one backward (linear_backward)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, module, plan, is_first_microbatch, pending, states, tp,
                given=None, dh=None):
        needs = ((_NEED_DGRAD if ctx.needs_input_grad[0] else 0)
                 | (_NEED_WGRAD if ctx.needs_input_grad[1] else 0))
        override = plan.backward_override
        # packed: what backward keeps and the weight cache are one buffer per quantized operand
        # (few allocations); "dequantized" reads the member tensors of x and W in Python instead
        c_needs = (needs | _PACKED if override is None
                   else _KEEP_X_ROWWISE if override == "dequantized" else _PACKED)
        if given is None:
            inp = inp.contiguous()
        else:  # the fused norm's codes of x (_norm_fn.NormInput): inp only carries the gradient
            inp = (_norm_fn.with_columnwise(given) if needs & _NEED_WGRAD else given,
                   tuple(inp.shape), _operands.TQ_DTYPE[inp.dtype])
        ctx.tp = tp
        if tp is not None:  # tensor parallelism: the collectives around the C calls
            if plan.delayed and states is None:
                states = delayed.slots(module, delayed.FORWARD)
            inp = tp.gather_input(inp, plan, states, needs & _NEED_WGRAD, override is None)
        out, saved = _forward(inp, weight, bias, module, plan, is_first_microbatch, c_needs,
                              states)
        if tp is not None:
            out = tp.reduce_output(out)
        # The quantized operands go through save_for_backward, so activation checkpointing can
        # drop them and have them recomputed; their amaxes stay on ctx: DelayedScaling's are
        # views of the module's history, which the autocast's exit updates in place before
        # backward, and no GEMM reads an amax. A weight that came quantized is asked again in
        # backward for the direction dgrad reads (FSDP2 may have gathered it anew).
        ctx.w_given = _operands.quantized_weight(weight)
        x_tensors, ctx.x_amax = _operands.split_kept(saved[0])
        w_tensors, ctx.w_amax = _operands.split_kept(saved[1] if ctx.w_given is None
                                                       else None)
        ctx.n_x, ctx.n_w = len(x_tensors), len(w_tensors)
        kept = (inp, weight) if override == "high_precision" else ()
        ctx.save_for_backward(*x_tensors, *w_tensors, *kept)
        quantized_x = type(inp) is tuple  # (members, shape, dtype): gathered quantized
        ctx.plan, ctx.rest, ctx.needs = plan, saved[2:], needs
        ctx.shape = inp[1] if quantized_x else inp.shape
        ctx.module, ctx.pending = module, pending
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.dtype = _operands.DTYPE_OF[inp[2]] if quantized_x else inp.dtype
        ctx.weight_dtype = weight.dtype
        if dh is None:
            return out
        ctx.set_materialize_grads(False)  # tokens without gradients: dy is quantized here
        return (out,) + _act_fn.placeholders(
            out, dh, out.shape[-1], ctx.bias_dtype if ctx.needs_input_grad[2] else None)

    @staticmethod
    def backward(ctx, dy, *dy_q):
        plan, needs = ctx.plan, ctx.needs
        saved, kept = _saved(ctx, _ROWWISE if plan.backward_override == "dequantized"
                             else _COLUMNWISE if needs & _NEED_DGRAD else 0)
        if dy_q and dy_q[0] is not None:  # dy's codes from the activation (_act_fn.GradOutput)
            blocks = plan.dy.scaling in _plan.BLOCK_FORMATS  # (no dbias: not asked with a bias)
            dx, dw = _dy_given.given_dy_backward(plan.c_args, saved, dy_q, needs, ctx.shape,
                                               ctx.pending, blocks)
            db = dy_q[-1] if ctx.needs_input_grad[2] and not blocks else None  # the last token
            return dx, dw, db, None, None, None, None, None, None, None, None
        dy = _operands.waited(dy).contiguous()  # a collective's output (DTensor's)
        bias_dtype = ctx.bias_dtype if ctx.needs_input_grad[2] else None
        tp = ctx.tp
        state = delayed.slots(ctx.module, delayed.BACKWARD)[0] if plan.delayed else None
        if tp is not None:
            dy = tp.gather_grad_output(dy, plan, state, needs, plan.backward_override is None)
        if plan.backward_override is not None:
            dx, dw, db = _override.backward(ctx, saved, kept, dy.reshape(-1, dy.shape[-1]),
                                            needs, bias_dtype)
        else:  # ctx.pending: first in forward, so last in backward: it updates them all
            after_dgrad = None if tp is None else tp.grad_input_overlap(needs & _NEED_WGRAD)
            dx, dw, db = _C.linear_backward(plan.c_args, saved, dy, needs, state, ctx.shape,
                                            bias_dtype, ctx.pending, after_dgrad)
        if tp is not None:
            dx = tp.reduce_grad_input(dx)
        return dx, dw, db, None, None, None, None, None, None, None, None


def _forward(inp, weight, bias, module, plan, is_first_microbatch, c_needs, states=None):
    """linear_forward's (out, saved) for a contiguous inp. states: DelayedScaling's (scale, amax
    slot) pairs of x and W (None: the module's own). A weight that arrives quantized goes to C
    as it is (rowwise), with no second quantization."""
    if plan.delayed:
        x_state, w_state = states or delayed.slots(module, delayed.FORWARD)
    else:
        x_state = w_state = None
    if type(weight) is not torch.nn.Parameter and type(weight) is not torch.Tensor:
        if hasattr(weight, "tq_kept"):
            if plan.delayed and is_first_microbatch is not None:
                raise NotImplementedError(
                    "te.Linear(is_first_microbatch=...) on a weight FSDP2 all-gathered in the "
                    "recipe's format under DelayedScaling: each microbatch's gather quantizes W "
                    "with the scale as updated since the first one. Pass None (FSDP2 gathers W "
                    "for every microbatch anyway) or gather in high precision")
            weight = (_operands.given_kept(weight, plan, _ROWWISE), weight.shape[0],
                      weight.shape[1], _operands.TQ_DTYPE[weight.dtype])
        else:  # a wrapper of the high-precision weight (tequant.distributed.ShardedWeight)
            weight = getattr(weight, "tq_data", weight)
    return _C.linear_forward(plan.c_args, inp, weight, bias, c_needs, module._weight_cache,
                             is_first_microbatch, x_state, w_state)


_quantized_linear = _operands.fast_apply(_QuantizedLinear)


class _PlainLinear(_QuantizedLinear):
    """_QuantizedLinear for a plain call (a tensor input or x's fused codes `given` as a tenth
    argument, the module's own weight, no tensor parallelism, no grad_output codes asked of the
    activation, no backward_override): its forward and backward in C, no Python frame
    (csrc/ext/linear_ctx.c), the same ctx fields."""

    forward = staticmethod(_C.linear_ctx_forward)
    backward = staticmethod(_C.linear_ctx_backward)


_plain_linear = _operands.fast_apply(_PlainLinear)


class Linear(torch.nn.Linear):
    """y = x W^T + b, with its GEMMs quantized inside te.autocast (FP8, MXFP8, NVFP4).

    A torch.nn.Linear (isinstance-based tools such as PEFT's LoRA, FSDP and tensor-parallel
    styles and weight-init code see one), with torch.nn.Linear's constructor and TE's extra
    keyword arguments.

    Args:
        in_features, out_features: the weight is [out_features, in_features].
        bias: learn an additive bias [out_features] (initialized to 0, as TE does).
        device: where to create the parameters (default: the current default device).
        dtype / params_dtype: dtype of the parameters, float32, bfloat16 or float16 (default
            torch.get_default_dtype()); params_dtype is TE's name, dtype torch.nn.Linear's.
        init_method: callable initializing the weight in place, also in reset_parameters()
            (default: torch.nn.Linear's Kaiming-uniform initialization). It is kept on the
            module, so pickling the module pickles it (a lambda cannot be).
        return_bias: forward returns (out, bias) and does not add the bias.
        tp_group, tp_size, parallel_mode, sequence_parallel: TE's tensor parallelism
            (distributed/tensor_parallel.py). tp_comm_overlap: a column-parallel layer starts
            its input gradient's reduction as soon as dgrad is done, so it runs beside the wgrad
            GEMM (also a settable attribute). Off by default: on 4 H100s (TP=4, d=4096) it
            changed the step by -17% to +16% by recipe, within the run-to-run spread
            (docs/results/profile_distributed.md).

    forward(inp, is_first_microbatch=None): inp is [..., in_features] on CPU (the C reference
    path) or CUDA. is_first_microbatch: True quantizes the weight and caches it, False reuses the
    cached quantized weight (gradient accumulation over microbatches), None quantizes every call.
    Inside te.autocast the feature dims must be multiples of 16 (FP8 recipes, NVFP4) or 32
    (MXFP8); any number of tokens works. Under activation checkpointing (torch.utils.checkpoint,
    either mode) the recompute runs exactly as the forward did (checkpoint.py).

    CustomRecipe(qfactory): qfactory(QuantizerRole(module_type="linear", tensor_type=role)) is
    called once per module for the roles "input", "weight" and "grad_output"; each returns a
    quantizer with `quantize(tensor) -> q` (any object) and `dequantize(q) -> tensor` (the
    values, same shape). The three GEMMs multiply the dequantized values in the activation
    dtype, so a research format needs only those two methods.

    copy.copy, copy.deepcopy, pickle and torch.save of a module (or of a model holding it) work
    before and after steps under every recipe: recipe plans are rebuilt, the cached quantized
    weight is copied with the module, and DelayedScaling's state is its buffers.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *,
                 params_dtype=None, init_method=None, return_bias=False, tp_group=None,
                 tp_size=1, parallel_mode=None, sequence_parallel=False, tp_comm_overlap=False):
        torch.nn.Module.__init__(self)  # not nn.Linear's: it would initialize twice
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name, v in (("bias", bias), ("return_bias", return_bias),
                        ("sequence_parallel", sequence_parallel)):
            if type(v) is not bool:
                raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
        if dtype is not None and params_dtype is not None and dtype != params_dtype:
            raise ValueError(f"dtype={dtype} and params_dtype={params_dtype} disagree; pass one")
        dtype = params_dtype if params_dtype is not None else dtype
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"params_dtype must be torch.float32, torch.bfloat16 or "
                             f"torch.float16, got {dtype}")
        if init_method is not None and not callable(init_method):
            raise TypeError(f"init_method must be callable, got {type(init_method).__name__}")
        self.in_features, self.out_features = in_features, out_features
        tp, in_local, out_local = None, in_features, out_features
        if parallel_mode is not None or tp_group is not None or tp_size != 1 or sequence_parallel:
            # imported here: single-device code never loads tequant.distributed
            from .distributed.tensor_parallel import TensorParallel
            tp, in_local, out_local = TensorParallel.make(in_features, out_features, tp_group,
                                                          tp_size, parallel_mode,
                                                          sequence_parallel, tp_comm_overlap)
        factory = {"dtype": dtype, "device": device}
        self.weight = torch.nn.Parameter(torch.empty(out_local, in_local, **factory))
        if bias:  # row parallel: whole, added after the reduction; column: this rank's slice
            self.bias = torch.nn.Parameter(torch.empty(
                out_features if parallel_mode == "row" else out_local, **factory))
            if parallel_mode == "row" and sequence_parallel:
                self.bias.sequence_parallel = True  # its gradient: this rank's tokens' part
        else:
            self.register_parameter("bias", None)
        self._adopt(self, return_bias=return_bias, init_method=init_method, tp=tp)
        self.reset_parameters()

    @staticmethod
    def _adopt(module, *, return_bias=False, init_method=None, tp=None):
        """The te.Linear state of a module whose parameters are in place (also te.convert's
        swap of a torch.nn.Linear)."""
        module.return_bias = bool(return_bias)
        module.init_method = init_method
        module._tp = tp  # tensor parallelism (distributed/tensor_parallel.py), or None
        module._plans = {}           # recipe key -> _plan.Plan (or a CustomRecipe's quantizers)
        module._weight_cache = []    # [recipe key, quantized W] for is_first_microbatch=False
        _compile_modules.register_module(module)

    # TransformerEngine's tensor-parallel attributes, read from the setting (a copy of the module
    # shares its process group: TensorParallel.__deepcopy__)
    tp_group = property(lambda self: None if self._tp is None else self._tp.group)
    tp_size = property(lambda self: 1 if self._tp is None else self._tp.size)
    parallel_mode = property(lambda self: None if self._tp is None else self._tp.mode)
    sequence_parallel = property(lambda self: self._tp is not None and self._tp.sequence_parallel)

    @property
    def tp_comm_overlap(self):
        """Whether the input gradient's reduction runs beside the wgrad GEMM (column parallel;
        settable)."""
        return self._tp is not None and self._tp.overlap

    @tp_comm_overlap.setter
    def tp_comm_overlap(self, value):
        if type(value) is not bool:
            raise TypeError(f"tp_comm_overlap must be a bool, got {type(value).__name__}")
        if self._tp is not None:
            self._tp.overlap = value

    def reset_parameters(self):
        """init_method(weight) (default: torch.nn.Linear's Kaiming-uniform) and a zero bias.
        DelayedScaling's state, where the module has it, restarts as a new module's: its amaxes
        measured the replaced weight, and after to_empty it is uninitialized memory."""
        with torch.no_grad():
            if self.init_method is not None:
                self.init_method(self.weight)
            else:
                torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            if self.bias is not None:
                self.bias.zero_()
        self._weight_cache = []
        delayed.restart(self, delayed.DIRECTIONS)

    # ---- copies and pickles ------------------------------------------------------------------

    def __getstate__(self):
        """nn.Module's state less what is rebuilt (plans, DelayedScaling's kept views, the
        compile registration) and with the weight cache keyed by its recipe, not by this
        process's recipe key."""
        state = super().__getstate__()
        for name in [n for n in state if n.startswith("_delayed_")] + ["_tequant_uid"]:
            state.pop(name, None)  # views of the buffers, plans, process groups: rebuilt
        state["_plans"] = {}
        cache = state.pop("_weight_cache", [])
        state["_weight_cache"] = []
        if cache:
            state["_weight_cache_recipe"] = (_C._recipe_of_key(cache[0]), cache[1])
        return state

    def __setstate__(self, state):
        state = dict(state)
        cached = state.pop("_weight_cache_recipe", None)
        super().__setstate__(state)
        _compile_modules.register_module(self)  # a copy (deepcopy, pickle) is a module of its own
        if cached is not None:
            recipe, kept = cached
            if self._plan(recipe).delayed:  # its amax is this module's history slot, not a copy
                amax = delayed.slots(self, delayed.FORWARD)[1][1]
                kept = (kept[0], amax) if len(kept) == 2 else kept[:4] + (amax,) + kept[5:]
            self._weight_cache = [_C.recipe_key(recipe), kept]

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dtype={self.weight.dtype}")

    # ---- recipes ------------------------------------------------------------------------------

    def _plan(self, recipe):
        key = _C.recipe_key(recipe)
        plan = self._plans.get(key)
        if plan is None:  # checked before it is kept: a kept plan skips the check (C path)
            plan = _plan.Plan(recipe)
            self._check_plan(plan)
            self._plans[key] = plan
        return plan

    def _check_plan(self, plan, shape=None):
        """shape: this rank's (out, in) of W (default: what the features and tp_size give)."""
        if plan.x.scaling == "custom":
            return
        tp = self._tp
        out_local, in_local = shape or (
            self.out_features // (tp.size if tp is not None and tp.mode == "column" else 1),
            self.in_features // (tp.size if tp is not None and tp.mode == "row" else 1))
        for name, dim, local in (("in_features", self.in_features, in_local),
                                 ("out_features", self.out_features, out_local)):
            if local % plan.align:
                shard = f" (this rank's {local} of {dim})" if local != dim else ""
                raise ValueError(f"{name}={dim}{shard} must be a multiple of {plan.align} for "
                                 f"{plan.x.scaling} scaling (te.Linear inside te.autocast)")

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, inp, is_first_microbatch=None):
        """y = inp W^T + b for inp [..., in_features]: quantized inside te.autocast, exactly
        F.linear outside. is_first_microbatch: see the class docstring. Returns y, or (y, bias)
        with return_bias=True."""
        compiling = torch.compiler.is_compiling()
        if not compiling:  # a plain call: all of it in C (linear_module.c)
            out = _module_forward(self, inp, is_first_microbatch)
            if out is not NotImplemented:
                return out
        if not isinstance(inp, torch.Tensor) and type(inp) is not NormInput \
                and type(inp) is not ActInput:
            raise TypeError(f"{type(self).__name__}: inp must be a torch.Tensor, got "
                            f"{type(inp).__name__}")
        if is_first_microbatch is not None and type(is_first_microbatch) is not bool:
            raise TypeError(f"is_first_microbatch must be None, True or False, got "
                            f"{type(is_first_microbatch).__name__}")
        if compiling:
            out = _compile_linear.forward(self, inp, is_first_microbatch)
        else:
            regions = checkpoint.REGIONS.get()
            out = (self._run(inp, is_first_microbatch) if regions is None
                   else self._run_checkpointed(inp, is_first_microbatch, regions))
        return (out, self.bias) if self.return_bias else out

    def _run_checkpointed(self, inp, is_first_microbatch, regions):
        """Inside activation-checkpointed code (checkpoint.py): replays the Call the forward
        recorded, or runs live and records one."""
        call, tapes = checkpoint.source(regions, self)
        if call is None:
            call = checkpoint.Call(self)
            out = self._run(inp, is_first_microbatch, record=call,
                            trains=any(tape.trains for tape in tapes))
        else:  # with True the recompute caches W again: the forward's bits (same W, scales)
            out = self._run(inp, is_first_microbatch, replay=call)
        for tape in tapes:
            tape.calls.append(call)
        return out

    def _run(self, inp, is_first_microbatch, record=None, replay=None, trains=False):
        """The forward without return_bias's tuple: live, or replaying `replay` (a recorded
        checkpoint.Call); a live call fills `record` in when given. trains: register with
        DelayedScaling's update even under no_grad (a reentrant checkpoint's forward).
        A DTensor weight (parallelize_module) runs on the local tensors (distributed/dtensor.py)."""
        weight, bias = self.weight, None if self.return_bias else self.bias
        if (type(weight) is not torch.nn.Parameter and type(weight) is not torch.Tensor
                and _operands.is_dtensor(weight)):
            from .distributed import dtensor
            inp = _norm_fn.resolved(inp)  # (the DTensor face runs the norm's output)
            return dtensor.run(self, inp, weight, bias, lambda x, w, b: self._local(
                x, w, b, is_first_microbatch, record, replay, trains))
        return self._local(inp, weight, bias, is_first_microbatch, record, replay, trains)

    def _local(self, inp, weight, bias, is_first_microbatch, record, replay, trains):
        """Row-parallel layers add the bias once, after the reduction (as TransformerEngine); a
        group of one rank reduces nothing and adds it in the GEMM, as a plain layer."""
        tp = self._tp
        if tp is not None and tp.mode == "row" and tp.size > 1:
            out = self._compute(inp, weight, None, is_first_microbatch, record, replay, trains,
                                tp)
            return out if bias is None else out + bias.to(out.dtype)
        return self._compute(inp, weight, bias, is_first_microbatch, record, replay, trains, tp)

    def _compute(self, inp, weight, bias, is_first_microbatch, record, replay, trains, tp):
        if replay is not None:
            recipe = replay.recipe
        elif _C.is_fp8_enabled():
            recipe = _C.get_fp8_recipe()
        else:
            recipe = None
            if _C.is_fp8_calibration() and not _C.get_fp8_recipe().custom():
                plan = self._plan(_C.get_fp8_recipe())  # (a CustomRecipe has nothing to record)
                if plan.delayed:
                    inp = _norm_fn.resolved(inp)
                    delayed.calibrate(self, plan.x.amax_history_len, inp)
        norm_in = None  # a NormInput / ActInput whose norm / activation writes x's codes
        block_dh = None  # LayerNormMLP's fc1 on the norm's output: its GradOutput (block formats)
        custom, plan = recipe is not None and recipe.custom(), None
        if type(inp) is NormInput or type(inp) is ActInput:
            plan = None if recipe is None or custom else self._plan(recipe)
            if plan is not None and inp.fusable(plan.x.scaling, plan.backward_override, tp,
                                                plan.act_blocks):
                norm_in = inp
            else:
                if type(inp) is NormInput and plan is not None and plan.dy_blocks:
                    block_dh = inp.grad_output
                inp = inp.high_precision()
        if recipe is None:
            if _operands.quantized_weight(weight) is not None:
                weight = _operands.dequantized(weight)
            if tp is not None:
                return tp.linear_hp(inp, lambda x: F.linear(x, weight, bias), weight, bias)
            return F.linear(inp, weight, bias)
        if record is not None:
            record.recipe = recipe
        if not inp.shape:  # (inp: a tensor, a NormInput or an ActInput)
            raise ValueError(f"input is a 0-dim tensor; this Linear takes [..., "
                             f"{weight.shape[1]}]")
        if inp.shape[-1] != weight.shape[1]:
            raise ValueError(f"input has {inp.shape[-1]} features in its last dim; this "
                             f"Linear takes {weight.shape[1]}")
        if norm_in is None:  # (fused: a plain tensor's norm, no torch.autocast)
            inp = _operands.waited(inp)  # a collective's output, not yet waited on
            if torch.is_autocast_enabled(inp.device.type):
                inp = inp.to(torch.get_autocast_dtype(inp.device.type))
        if custom:
            quantizers = _custom_linear.quantizers(self, recipe)
            if tp is not None:
                return tp.linear_hp(inp, lambda x: _custom_linear.apply(x, weight, bias,
                                                                        quantizers))
            return _custom_linear.apply(inp, weight, bias, quantizers)
        plan = plan or self._plan(recipe)
        if tp is not None:
            tp.check_recipe(recipe, plan.key)
        pending = states = None
        if plan.delayed:
            if replay is not None:
                pending, states = replay.pending, delayed.replay_slots(replay.scale_fwd)
            else:
                delayed.ensure(self, plan.x.amax_history_len)
                attrs = self.__dict__  # plain attributes: nn.Module.__setattr__ costs ~2 us each
                attrs["_delayed_plan"], attrs["_delayed_group"] = plan, _C.get_fp8_group()
                if trains or (torch.is_grad_enabled() and (  # (a NormInput / ActInput: True)
                        getattr(inp, "requires_grad", True) or weight.requires_grad
                        or (bias is not None and bias.requires_grad))):
                    modules, first = _C._delayed_register(self)  # a backward will run
                    pending = modules if first else None
                elif torch.is_grad_enabled():  # no backward here (frozen, no input grad):
                    _C._delayed_register_forward_only(self)  # not the backward update's owner
                if record is not None:
                    record.pending = pending
                    record.scale_fwd = self._buffers["delayed_scale_fwd"].clone()
        given = None
        if norm_in is not None:  # x's codes from the norm, its amax in x's slot (DelayedScaling)
            if plan.delayed and states is None:
                states = delayed.slots(self, delayed.FORWARD)
            x_state = states[0] if plan.delayed else (None, None)
            inp, given = norm_in.fused(plan.recipe._tequant_id, plan.align, *x_state,
                                       columnwise=torch.is_grad_enabled()
                                       and weight.requires_grad)
        if (torch.is_grad_enabled() and (inp.requires_grad or weight.requires_grad or (
                bias is not None and bias.requires_grad))) or _operands.transformed() \
                or tp is not None:
            dh = None  # LayerNormMLP's fc1: dy's codes from the activation's backward
            source = None
            if (given is not None and type(norm_in) is NormInput
                    and norm_in.grad_output is not None):
                source = norm_in.grad_output
                dh = source.ask(plan.recipe._tequant_id, given[0].shape[0],
                                delayed.slots(self, delayed.BACKWARD)[0] if plan.delayed
                                else (None, None), delayed=plan.delayed,
                                columnwise=weight.requires_grad)
            elif (block_dh is not None and tp is None and plan.backward_override is None
                  and (bias is None or not bias.requires_grad) and inp.dtype == torch.bfloat16):
                # Float8BlockScaling / MXFP8BlockScaling: dh's blocks from the activation's
                # backward (no bias gradient there), x quantized here as without it; bfloat16
                # only (float16's pass measured 1.7x slower than unfused: NOTES.md)
                source = block_dh
                dh = source.ask(plan.recipe._tequant_id,
                                _plan.padded(inp.numel() // inp.shape[-1], plan.align),
                                (None, None), delayed=False, columnwise=weight.requires_grad)
            if (dh is None and tp is None and plan.backward_override is None
                    and (type(weight) is torch.nn.Parameter or type(weight) is torch.Tensor)):
                if plan.delayed and states is None:
                    states = delayed.slots(self, delayed.FORWARD)
                if given is None:
                    return _plain_linear(inp, weight, bias, self, plan, is_first_microbatch,
                                         pending, states)
                return _plain_linear(inp, weight, bias, self, plan, is_first_microbatch, pending,
                                     states, given)
            out = _quantized_linear(inp, weight, bias, self, plan, is_first_microbatch, pending,
                                    states, tp, given, dh)
            return out if dh is None else source.received(out)
        # no graph to record (eval, inference): the C forward alone, x rowwise only
        x = inp.contiguous() if given is None else (given, tuple(inp.shape),
                                                    _operands.TQ_DTYPE[inp.dtype])
        return _forward(x, weight, bias, self, plan, is_first_microbatch, _PACKED, states)[0]

    def _apply(self, fn, recurse=True):
        # .half(), .bfloat16(), .to(dtype) cast parameters; DelayedScaling's state stays float32.
        # Its buffers brought off the meta device (to_empty after te.prepare_state on a meta
        # model) hold uninitialized memory, NaN scales at worst: they restart as a new module's,
        # whether or not reset_parameters runs (custom init, a weights-only checkpoint).
        on_meta = [d for d in delayed.DIRECTIONS
                   if getattr(self._buffers.get(f"delayed_scale_{d}"), "is_meta", False)]
        out = delayed.keeping_float32(self, lambda: super(Linear, self)._apply(fn, recurse))
        delayed.restart(self, [d for d in on_meta
                                if not self._buffers[f"delayed_scale_{d}"].is_meta])
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # TransformerEngine's modules save their FP8 metadata as `_extra_state`: accepted, unused
        # (DelayedScaling's history starts afresh, as in a new module)
        state_dict.pop(prefix + "_extra_state", None)
        absent = []  # directions whose DelayedScaling state the module has, the checkpoint not
        for direction in delayed.DIRECTIONS:
            names = (f"delayed_amax_history_{direction}", f"delayed_scale_{direction}")
            if all(prefix + name not in state_dict for name in names):
                if self._buffers.get(names[0]) is not None:
                    absent.append(direction)
                continue
            # DelayedScaling buffers exist once a module quantized with it: create them from a
            # checkpoint that has them, so a fresh module restores the state exactly.
            for name in names:
                saved = state_dict.get(prefix + name)
                if saved is not None and getattr(self, name, None) is None:
                    self.register_buffer(name, torch.empty_like(saved, device=self.weight.device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # A checkpoint saved before the module first ran DelayedScaling (or a torch.nn.Linear's)
        # lacks those buffers, which a new module lacks too: not missing. With the weight it
        # loads, the module restarts them as a new module that loaded it (their amaxes measured
        # the replaced weight); a load without the weight leaves them.
        gone = {f"{prefix}delayed_{kind}_{d}" for d in absent
                for kind in ("amax_history", "scale")}
        missing_keys[:] = [key for key in missing_keys if key not in gone]
        if prefix + "weight" in state_dict:
            delayed.restart(self, absent)
            self._weight_cache = []  # is_first_microbatch=False must not multiply the old W


_module_forward = _C.linear_module_forward  # what it reads, handed over once:
_C._linear_module_setup(Linear, torch.nn.Parameter, torch.Tensor, _plain_linear.raw,
                        checkpoint.REGIONS, torch._C._functorch.unwrap_if_dead,
                        torch._C._are_functorch_transforms_active, _operands._forward_ad,
                        delayed.slots, torch.is_grad_enabled, torch._C._is_any_autocast_enabled,
                        _operands.waited, _norm_fn.with_columnwise)
