"""tequant: low-precision (FP8, MXFP8, NVFP4) training for PyTorch, written in C.

    import tequant as te
    from tequant.recipe import MXFP8BlockScaling
    with te.autocast(recipe=MXFP8BlockScaling()):
        y = model(x)

This package is thin: te.autocast, the state readers, the recipe registry and tensor intake are
the C extension tequant._C (csrc/ext); recipes are frozen dataclasses (recipe.py). Tests: tests/.
"""
import torch  # noqa: F401  (loads the CUDA/cuBLAS libraries the extension shares with torch)

from . import checkpoint, ops, recipe
from ._C import (
    Autocast,
    CudaError,
    ExecutionMode,
    QuantizerConfig,
    autocast,
    autocast_depth,
    build_info,
    execution_mode,
    gemm_split_accumulator,
    get_fp8_group,
    get_fp8_recipe,
    is_first_fp8_module,
    is_fp8_calibration,
    is_fp8_enabled,
    quantizer_config,
    recipe_key,
)
from .quantized import QuantizedTensor
from .linear import Linear
from .norm import LayerNorm, RMSNorm
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .capability import (
    fp8_autocast,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)

from .convert import convert, prepare_state
from . import _compile

checkpoint.install()  # te.Linear under torch.utils.checkpoint recomputes as it ran

_compile.register_with_dynamo()  # torch.compile support, without importing torch._dynamo now

__version__ = "0.1.0"


def __getattr__(name):
    # te.distributed is imported on first use: it loads torch.distributed's FSDP2, which eager
    # single-process code does not need (and the core never imports it).
    if name == "distributed":
        import importlib
        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module 'tequant' has no attribute {name!r}")

__all__ = [
    "Autocast", "convert", "CudaError", "ExecutionMode", "QuantizerConfig", "autocast", "autocast_depth", "build_info",
    "execution_mode", "fp8_autocast", "gemm_split_accumulator", "get_fp8_group", "get_fp8_recipe",
    "is_first_fp8_module", "is_fp8_available", "LayerNorm", "LayerNormLinear", "LayerNormMLP",
    "Linear", "RMSNorm", "is_fp8_block_scaling_available",
    "is_fp8_calibration", "is_fp8_enabled", "is_mxfp8_available", "is_nvfp4_available",
    "ops", "prepare_state", "QuantizedTensor", "quantizer_config", "recipe", "recipe_key",
]
