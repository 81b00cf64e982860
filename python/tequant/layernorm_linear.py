"""te.LayerNormLinear: a LayerNorm or RMSNorm followed by a te.Linear, TransformerEngine's module
(its arguments and parameter names: layer_norm_weight, layer_norm_bias, weight, bias), so a TE
model's state_dict loads.

It is a te.Linear (a torch.nn.Linear) whose forward normalizes first, through the norm kernels
(norm.py states their numerics): outside te.autocast it is the exact high-precision composition
of that norm and F.linear. Inside te.autocast with a per-tensor FP8 recipe (DelayedScaling,
Float8CurrentScaling) the norm kernel writes the GEMM's FP8 input codes itself, rowwise and,
where wgrad runs, columnwise (_norm_fn.NormInput.fused): these are the cast
of the FP32 norm output y, where te.LayerNorm + te.Linear cast y rounded to x's dtype, so with
bfloat16 / float16 inputs a code can differ by one where that rounding moves y across a rounding
boundary (float32 inputs: the same bits). DelayedScaling records amax(y) in the input's history
slot where te.Linear records its input's amax. The high-precision norm output is written only
for return_layernorm_output. Other recipes quantize the norm's output as te.Linear does; tensor
parallelism over several ranks, backward_override, torch.autocast and inputs the kernels refuse
take that route too. Everything te.Linear supports carries over: every recipe, torch.compile,
CUDA graphs, activation checkpointing, FSDP2's quantized weight all-gather, column tensor
parallelism with sequence parallelism (the norm runs on this rank's tokens, its output is
gathered quantized).
Tests: tests/test_norm_modules.py, tests/test_fused_norm_modules.py.
"""
from . import norm
from .linear import Linear

__all__ = ["LayerNormLinear"]


class LayerNormLinear(Linear):
    """y = Linear(norm(x)), TE's LayerNormLinear.

    Args (TE's names; the Linear ones as te.Linear takes them):
        in_features, out_features: the weight is [out_features, in_features].
        eps: the norm's epsilon (default 1e-5).
        normalization: "LayerNorm" (parameters layer_norm_weight, layer_norm_bias) or "RMSNorm"
            (layer_norm_weight).
        zero_centered_gamma: the norm multiplies by 1 + layer_norm_weight (initialized to 0).
        return_layernorm_output: forward also returns the norm's output (last).
        bias, init_method, return_bias, params_dtype, device, tp_group, tp_size,
        parallel_mode (None or "column"), sequence_parallel, tp_comm_overlap: as te.Linear.

    forward(inp, is_first_microbatch=None) returns out, then the bias with return_bias, then
    the norm's output with return_layernorm_output.
    """

    def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False, *,
                 tp_group=None, tp_size=1, init_method=None, bias=True,
                 normalization="LayerNorm", return_bias=False, params_dtype=None,
                 parallel_mode=None, return_layernorm_output=False, zero_centered_gamma=False,
                 device=None, tp_comm_overlap=False):
        norm.check_normalization(normalization)
        if parallel_mode not in (None, "column"):
            raise ValueError(f"LayerNormLinear's parallel_mode must be None or 'column' (a "
                             f"row-parallel layer's input is sharded along features, which a "
                             f"norm cannot normalize locally), got {parallel_mode!r}")
        eps = norm.check_eps(eps)
        super().__init__(in_features, out_features, bias, device, params_dtype=params_dtype,
                         init_method=init_method, return_bias=return_bias, tp_group=tp_group,
                         tp_size=tp_size, parallel_mode=parallel_mode,
                         sequence_parallel=sequence_parallel, tp_comm_overlap=tp_comm_overlap)
        self.eps, self.normalization = eps, normalization
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output = bool(return_layernorm_output)
        norm.norm_parameters(self, "layer_norm_", in_features, normalization,
                             self.zero_centered_gamma, bool(sequence_parallel),
                             self.weight.dtype, self.weight.device)

    def reset_parameters(self):
        super().reset_parameters()
        if "layer_norm_weight" in self._parameters:  # (Linear.__init__ calls this first)
            norm.reset_norm_parameters(self.layer_norm_weight, self.layer_norm_bias,
                                       self.zero_centered_gamma)

    def forward(self, inp, is_first_microbatch=None):
        x = norm.module_input(self, inp, self.in_features)
        out = super().forward(x, is_first_microbatch)  # te.Linear runs the norm (NormInput)
        if not self.return_layernorm_output:
            return out
        return (*out, x.output) if self.return_bias else (out, x.output)

    def extra_repr(self):
        return (f"{super().extra_repr()}, normalization={self.normalization}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")
