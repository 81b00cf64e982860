"""te.LayerNormMLP: norm -> fc1 -> activation -> fc2, TransformerEngine's module with its arguments,
activations and state_dict names (layer_norm_weight, layer_norm_bias, fc1_weight, fc1_bias,
fc2_weight, fc2_bias), so a TE model's state_dict loads.

fc1 and fc2 are te.Linear children (their GEMMs quantized inside te.autocast exactly as
te.Linear's, every recipe; compile, CUDA graphs, activation checkpointing and FSDP2's quantized
all-gather as te.Linear). The norm runs through the norm kernels and, for per-tensor FP8 recipes,
writes fc1's input codes itself, as in te.LayerNormLinear (whose docstring states those bits);
fc1 gets the norm's input (_norm_fn.NormInput) while it is a plain te.Linear without hooks
(FSDP2's fully_shard of fc1 alone, a wrapper or a hook get the norm's output instead); state_dict and load_state_dict speak TE's flat names, and the
attributes fc1_weight ... fc2_bias read the children's parameters. With set_parallel_mode=True
fc1 is column- and fc2 row-parallel over tp_group (sequence_parallel: tokens sharded in and
out), as TE. Activations as TE defines them (transformer_engine/common/util/math.h): gelu is the
tanh approximation, qgelu x * sigmoid(1.702 x), srelu relu(x)^2; the gated ones (geglu, reglu,
swiglu) split fc1's output in two halves along features, act(first) * second (fc1 has
2 * ffn_hidden_size outputs; under tensor parallelism each rank's shard holds both halves of its
part, as in TE). The activation runs through the activation kernels (_act_fn.py; torch's
activation where they do not run): fc2 gets fc1's output as an _act_fn.ActInput while it is a
plain te.Linear without hooks, and for per-tensor FP8 recipes (DelayedScaling,
Float8CurrentScaling; no tensor parallelism over several ranks, no backward_override) the
activation kernel writes fc2's input codes itself (of the FP32 activation: with bfloat16 /
float16 h a code can differ by one from te.Linear's codes of the activation rounded to h's dtype;
float32: the same bits); DelayedScaling records its amax in fc2's input history slot. Where fc1
also multiplies the norm's codes and fc2 is plain (no hook: fc2 takes the ActInput), the
activation's backward writes fc1's grad_output codes (of the FP32 dh with fc1's grad_output
quantizer: E5M2 for HYBRID; its DelayedScaling scale, the amax max-accumulated into fc1's
grad_output history slot), and fc1's bias gradient is the kernel's
fixed-order FP32 column sum of dh (then the bias dtype), in the same pass; fc1's backward
multiplies those codes (float32: te.Linear's bits but for dbias's summation order). Under
Float8BlockScaling (1x128 E4M3 input blocks; eager and compiled alike)
the activation's pass writes fc2's blocks in both directions from the activation rounded to h's
dtype, as TE's fused block casts do: te.Linear's bits for the kernel's activation, and no
high-precision [M, N] activation is written (tests/test_act_block.py). gelu and silu
(_act_fn.ARITHMETIC_BOUND) are torch's under block formats and Float8CurrentScaling but for
bfloat16 h (_act_fn.beats_torch): for other dtypes their kernels are bound by their exact
arithmetic and slower than torch (docs/results/bench_act.md). Outside
te.autocast the module is the exact composition of the norm kernel, F.linear and the activation
(the kernel's, torch's for those two). Tests: tests/test_norm_modules.py, tests/test_fused_norm_modules.py,
tests/test_fused_act_modules.py, tests/test_act_block.py.
"""
import torch

from . import _C, _act_fn, norm
from .linear import Linear

__all__ = ["LayerNormMLP", "ACTIVATIONS"]


_ELEMENTWISE, _GATED = _act_fn.TORCH_ELEMENTWISE, _act_fn.TORCH_GATED
ACTIVATIONS = tuple(_ELEMENTWISE) + tuple(_GATED)
activate = _act_fn.torch_activate  # TE's activation in torch ops (the reference)
_TE_NAMES = {"fc1_weight": "fc1.weight", "fc1_bias": "fc1.bias", "fc2_weight": "fc2.weight",
             "fc2_bias": "fc2.bias"}


def _plain(module, delayed):
    """module is a te.Linear called without hooks (module.__call__ is its forward), which runs a
    NormInput or an ActInput; a hook, a subclass (FSDP2's) or a wrapper expects a tensor. Under
    DelayedScaling (delayed) also a module with backward hooks or compiled on its own
    (nn.Module.compile): its frame would hand fc1's grad_output slot and codes across a
    graph's boundary (the amax never reached an eager fc1's history; AOT refused a compiled
    fc1's)."""
    return (type(module) is Linear and not module._forward_pre_hooks
            and not module._forward_hooks and not _global_hooks()
            and not (delayed and (module._backward_pre_hooks or module._backward_hooks
                                  or module._compiled_call_impl is not None)))


def _global_hooks():
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_pre_hooks or hooks._global_forward_hooks)


def _to_te_names(module, state_dict, prefix, local_metadata):
    for te_name, name in _TE_NAMES.items():
        if prefix + name in state_dict:
            state_dict[prefix + te_name] = state_dict.pop(prefix + name)


def _from_te_names(module, state_dict, prefix, *args):
    state_dict.pop(prefix + "_extra_state", None)  # TE's FP8 metadata: accepted, unused
    for te_name, name in _TE_NAMES.items():
        if prefix + te_name in state_dict:
            state_dict[prefix + name] = state_dict.pop(prefix + te_name)
    # the post-hook gets no prefix; torch loads depth-first, so this module's post-hook runs
    # before another load_state_dict reaches this module again
    module.__dict__["_tequant_load_prefix"] = prefix


def _report_te_names(module, incompatible_keys):
    """Missing / unexpected keys in TE's names (fc1_weight, not fc1.weight), the names
    state_dict() gives: a strict load's error and a non-strict load's result name the keys of
    the checkpoint format the module speaks."""
    prefix = module.__dict__.pop("_tequant_load_prefix", "")
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        for i, key in enumerate(keys):
            for te_name, name in _TE_NAMES.items():
                if key == prefix + name:
                    keys[i] = prefix + te_name


class LayerNormMLP(torch.nn.Module):
    """y = fc2(act(fc1(norm(x)))), TE's LayerNormMLP.

    Args (TE's names):
        hidden_size, ffn_hidden_size: fc1 is [ffn (x2 gated), hidden], fc2 [hidden, ffn].
        eps, normalization ("LayerNorm" | "RMSNorm"), zero_centered_gamma: the norm's.
        activation: one of ACTIVATIONS (default "gelu").
        bias: fc1 and fc2 biases; return_bias: forward returns fc2's bias unadded.
        init_method / output_layer_init_method: fc1's / fc2's weight initialization.
        params_dtype, device; return_layernorm_output: forward also returns the norm's output.
        tp_group, tp_size, set_parallel_mode, sequence_parallel: TE's tensor parallelism;
            tp_comm_overlap as te.Linear's.

    forward(inp, is_first_microbatch=None) returns out, then fc2's bias with return_bias, then
    the norm's output with return_layernorm_output.
    """

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, sequence_parallel=False,
                 return_bias=False, *, tp_group=None, tp_size=1, init_method=None, bias=True,
                 normalization="LayerNorm", output_layer_init_method=None, params_dtype=None,
                 return_layernorm_output=False, set_parallel_mode=False,
                 zero_centered_gamma=False, device=None, activation="gelu", tp_comm_overlap=False):
        super().__init__()
        norm.check_size("hidden_size", hidden_size)
        norm.check_size("ffn_hidden_size", ffn_hidden_size)
        norm.check_normalization(normalization)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got "
                             f"{activation!r}")
        dtype = norm.params_dtype_of(params_dtype)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization = norm.check_eps(eps), normalization
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.activation = activation
        self.return_bias = bool(return_bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        norm.norm_parameters(self, "layer_norm_", hidden_size, normalization,
                             self.zero_centered_gamma, bool(sequence_parallel), dtype, device)
        parallel = {"tp_group": tp_group, "tp_size": tp_size,
                    "sequence_parallel": sequence_parallel, "tp_comm_overlap": tp_comm_overlap}
        if not set_parallel_mode and (tp_group is not None or tp_size != 1 or sequence_parallel):
            raise ValueError("LayerNormMLP: tp_group / tp_size / sequence_parallel take effect "
                             "with set_parallel_mode=True (fc1 column-, fc2 row-parallel)")
        fc1_out = ffn_hidden_size * (2 if activation in _GATED else 1)
        self.fc1 = Linear(hidden_size, fc1_out, bias, device, params_dtype=dtype,
                          init_method=init_method,
                          **(dict(parallel, parallel_mode="column") if set_parallel_mode else {}))
        self.fc2 = Linear(ffn_hidden_size, hidden_size, bias, device, params_dtype=dtype,
                          init_method=output_layer_init_method, return_bias=self.return_bias,
                          **(dict(parallel, parallel_mode="row") if set_parallel_mode else {}))
        self._register_state_dict_hook(_to_te_names)
        self._register_load_state_dict_pre_hook(_from_te_names, with_module=True)
        self.register_load_state_dict_post_hook(_report_te_names)

    fc1_weight = property(lambda self: self.fc1.weight)
    fc1_bias = property(lambda self: self.fc1.bias)
    fc2_weight = property(lambda self: self.fc2.weight)
    fc2_bias = property(lambda self: self.fc2.bias)

    def reset_parameters(self):
        norm.reset_norm_parameters(self.layer_norm_weight, self.layer_norm_bias,
                                   self.zero_centered_gamma)
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def forward(self, inp, is_first_microbatch=None):
        x = norm.module_input(self, inp, self.hidden_size)
        delayed = _C.is_fp8_enabled() and _C.get_fp8_recipe().delayed()
        fc2_plain = _plain(self.fc2, delayed)
        # fc1's dy: quantized by the activation's backward (h has the input's dtype where it
        # is), where fc2 takes the ActInput; behind a hook on fc2 (a graph break, FSDP2) fc1
        # quantizes its own dy: tokens that cross a hook reached fc1 compiled as zeros
        dh = _act_fn.GradOutput(self.activation, inp.dtype) if fc2_plain else None
        x.grad_output = dh
        h = self.fc1(x if _plain(self.fc1, delayed) else x.high_precision(), is_first_microbatch)
        a = _act_fn.ActInput(h, self.activation, dh)  # fc2 activates h (fused codes where it can)
        out = self.fc2(a if fc2_plain else a.high_precision(), is_first_microbatch)
        if not self.return_layernorm_output:
            return out
        return (*out, x.output) if self.return_bias else (out, x.output)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation}")
