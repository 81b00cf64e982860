"""te.LayerNorm and te.RMSNorm: TransformerEngine's normalization modules (its arguments and
parameter names), and the norm input te.LayerNormLinear / te.LayerNormMLP hand their te.Linear.

Both compute in high precision in every mode (TE's too: a norm's output is quantized only where a
GEMM reads it, inside LayerNormLinear / LayerNormMLP), through the norm kernels
(tq_norm_forward / tq_norm_backward via _norm_fn.NormFunction: one forward pass writing y, mean
and rstd, one backward pass for dx, dgamma and dbeta), or torch's norm where the kernels do not
run (_norm_fn.refusal: float64, torch.autocast, forward AD / functorch, DTensors, other devices).
Numerics: the kernels compute each row in FP32 with a fixed summation order (tequant.h), then
round y to x's dtype once; torch's norm sums in another order, so the two agree to a few FP32
ulps before that rounding (an output of x's dtype differs by at most one of its ulps, at rare
elements; float32 outputs by a few ulps). gamma is read in its own dtype (torch's path casts it to
x's first) and RN(1 + gamma) is formed in FP32 for zero_centered_gamma; dgamma and dbeta are FP32
sums (the kernel's fixed order) rounded once to the parameters' dtype. The kernel results are
bit-identical across eager, torch.compile and CUDA graphs, and CPU equals CUDA.
zero_centered_gamma stores gamma - 1 (the weight starts at 0 and the norm multiplies by
1 + weight), as TE does. sequence_parallel marks the parameters (`param.sequence_parallel = True`)
so that reduce_sequence_parallel_grads sums their gradients over the tensor-parallel group, as
Megatron-LM does for TE's modules.
Tests: tests/test_norm_modules.py, tests/test_fused_norm_modules.py.
"""
import math
import numbers

import torch

from ._norm_fn import NormInput, normalize

__all__ = ["LayerNorm", "RMSNorm", "normalize", "NORMALIZATIONS"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def module_input(module, inp, features):
    """The input of a LayerNormLinear / LayerNormMLP (after checking inp) with the norm it
    applies first (its layer_norm_weight, layer_norm_bias, eps, normalization,
    zero_centered_gamma), for its te.Linear to run (_norm_fn.NormInput)."""
    name = type(module).__name__
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name}: inp must be a torch.Tensor, got {type(inp).__name__}")
    if inp.dim() == 0 or inp.shape[-1] != features:
        raise ValueError(f"{name}: inp has shape {tuple(inp.shape)}; expected [..., {features}]")
    check_floating(name, inp)
    return NormInput(inp, module.layer_norm_weight, module.layer_norm_bias, module.normalization,
                     module.eps, module.zero_centered_gamma, module.return_layernorm_output)


def check_floating(name, inp):
    """A norm reads real floating-point values: torch's fallback would raise its own kernel's
    error for integers and, for RMSNorm, silently normalize a complex input by mean(x^2)."""
    if not inp.is_floating_point():
        raise TypeError(f"{name}: inp must be a floating-point tensor, got {inp.dtype}")


def check_normalization(normalization):
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")


def check_eps(eps):
    # finite too: eps = inf zeroes rstd, so the norm would return beta and no gradient
    if (isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0
            or not math.isfinite(eps)):
        raise ValueError(f"eps must be a positive number (finite), got {eps!r}")
    return float(eps)


def params_dtype_of(params_dtype):
    dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                         f"got {dtype}")
    return dtype


def check_size(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def norm_parameters(module, prefix, hidden_size, normalization, zero_centered_gamma,
                    sequence_parallel, dtype, device):
    """Registers `<prefix>weight` (and `<prefix>bias` for LayerNorm) on module, initialized as
    TE does (gamma 1, i.e. weight 0 when zero-centered; bias 0)."""
    weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
    module.register_parameter(prefix + "weight", weight)
    bias = None
    if normalization == "LayerNorm":
        bias = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
    module.register_parameter(prefix + "bias", bias)
    reset_norm_parameters(weight, bias, zero_centered_gamma)
    for p in (weight, bias):
        if p is not None and sequence_parallel:
            p.sequence_parallel = True
    if sequence_parallel:  # by name too: FSDP2 replaces the parameters and their attributes
        module._sequence_parallel_params = getattr(module, "_sequence_parallel_params", ()) + \
            tuple(prefix + name for name, p in (("weight", weight), ("bias", bias))
                  if p is not None)


def reset_norm_parameters(weight, bias, zero_centered_gamma):
    with torch.no_grad():
        (weight.zero_() if zero_centered_gamma else weight.fill_(1.0))
        if bias is not None:
            bias.zero_()


class _Norm(torch.nn.Module):
    normalization = None

    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=False, params_dtype=None,
                 zero_centered_gamma=False, device=None):
        super().__init__()
        check_size("hidden_size", hidden_size)
        self.hidden_size = hidden_size
        self.eps = check_eps(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sequence_parallel = bool(sequence_parallel)
        norm_parameters(self, "", hidden_size, self.normalization, self.zero_centered_gamma,
                        self.sequence_parallel, params_dtype_of(params_dtype), device)

    def reset_parameters(self):
        reset_norm_parameters(self.weight, self.bias, self.zero_centered_gamma)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(prefix + "_extra_state", None)  # TE's operation metadata: accepted, unused
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, inp):
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: inp must be a torch.Tensor, got "
                            f"{type(inp).__name__}")
        if inp.shape[-1:] != (self.hidden_size,):
            raise ValueError(f"{type(self).__name__}: inp has {inp.shape[-1] if inp.dim() else 0}"
                             f" features in its last dim; this norm takes {self.hidden_size}")
        check_floating(type(self).__name__, inp)
        return normalize(inp, self.normalization, self.weight, self.bias, self.eps,
                         self.zero_centered_gamma)

    def extra_repr(self):
        return (f"{self.hidden_size}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last dim (TE's te.LayerNorm:
    hidden_size, eps, sequence_parallel, params_dtype, zero_centered_gamma, device; parameters
    `weight` and `bias`)."""

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * gamma over the last dim (TE's te.RMSNorm; parameter
    `weight`)."""

    normalization = "RMSNorm"
