"""Errors crossing from C into Python (csrc/ext/errors.c and the checks around it): the
tequant.CudaError type, and the exception type plus message of every failure a CPU machine can
reach for real (bad roles, recipes, tensors and devices). CUDA/cuBLAS, out-of-memory and internal
statuses need a failing GPU call and are not reachable here; they are not faked.
"""

import dataclasses
import pickle

import pytest
import torch

import tequant as te
from tequant import recipe as R

ROLES_LIST = r"'input', 'weight', 'output', 'grad_output', 'grad_input'"


# ---- tequant.CudaError -------------------------------------------------------------------------

def test_cuda_error_is_a_runtime_error_named_tequant_cuda_error():
    err = te.CudaError
    assert isinstance(err, type)
    assert issubclass(err, RuntimeError)
    assert err.__mro__[1] is RuntimeError
    assert not issubclass(err, (ValueError, NotImplementedError, MemoryError))
    assert err.__module__ == "tequant"
    assert err.__name__ == "CudaError"
    assert err.__qualname__ == "CudaError"
    assert f"{err.__module__}.{err.__qualname__}" == "tequant.CudaError"
    assert "CUDA" in err.__doc__ and "cuBLASLt" in err.__doc__
    assert "CudaError" in te.__all__


def test_cuda_error_is_the_extension_type_and_catchable_as_runtime_error():
    assert te.CudaError is te._C.CudaError
    with pytest.raises(RuntimeError, match=r"^cudaMalloc failed: cudaErrorMemoryAllocation$"):
        raise te.CudaError("cudaMalloc failed: cudaErrorMemoryAllocation")
    try:
        raise te.CudaError("boom")
    except RuntimeError as caught:
        assert type(caught) is te.CudaError
        assert repr(caught) == "CudaError('boom')"


def test_cuda_error_pickles_by_its_qualified_name():
    # Importable as tequant.CudaError, so it survives pickling (multiprocessing workers).
    again = pickle.loads(pickle.dumps(te.CudaError("lost device")))
    assert type(again) is te.CudaError
    assert str(again) == "lost device"


# ---- ValueError: invalid arguments -------------------------------------------------------------

@pytest.mark.parametrize("recipe", [
    R.Float8CurrentScaling(), R.DelayedScaling(), R.MXFP8BlockScaling(), R.NVFP4BlockScaling(),
    None,
])
def test_bad_role_is_value_error_listing_the_roles(recipe):
    with pytest.raises(ValueError, match=rf"^role must be one of {ROLES_LIST}; got 'bogus'$"):
        te.quantizer_config(recipe, "bogus")


def test_non_string_role_is_value_error_naming_it():
    with pytest.raises(ValueError, match=rf"^role must be one of {ROLES_LIST}; got 3$"):
        te.quantizer_config(R.Float8CurrentScaling(), 3)
    # Role names are exact: no case folding.
    with pytest.raises(ValueError, match=r"got 'Input'$"):
        te.quantizer_config(None, "Input")


def test_valid_role_does_not_raise():
    # Control for the tests above: the same call with a real role succeeds.
    cfg = te.quantizer_config(R.Float8CurrentScaling(), "weight")
    assert cfg.role == "weight"


def _forced(recipe, **fields):
    """A copy of recipe with fields set past its validation, not yet keyed (a constructed
    recipe is keyed in __post_init__, before any field could be forced)."""
    forced = object.__new__(type(recipe))
    state = recipe.__getstate__()
    state.update(fields)
    for name, value in state.items():
        object.__setattr__(forced, name, value)
    return forced


def test_core_config_check_message_reaches_python_as_value_error():
    # A frozen recipe forced past its own validation: the C core's tq_quant_config_check rejects
    # the parsed config, and its tq_last_error() text is the ValueError's message.
    recipe = _forced(R.DelayedScaling(), amax_history_len=0)
    with pytest.raises(ValueError, match=r"^DelayedScaling gives an invalid input quantizer: "
                       r"delayed scaling needs amax_history_len >= 1 and margin >= 0, "
                       r"got 0 and 0$"):
        te.quantizer_config(recipe, "input")

    recipe = _forced(R.DelayedScaling(), margin=-2)
    with pytest.raises(ValueError, match=rf"got {recipe.amax_history_len} and -2$"):
        te.execution_mode(recipe)


def test_tensor_layout_error_is_value_error():
    with pytest.raises(ValueError, match=r"^x has shape \(3, 2\) and strides \(1, 3\): .*"
                       r"pass x\.contiguous\(\)$"):
        te._C._tensor_view(torch.zeros(2, 3).t())
    with pytest.raises(ValueError, match=r"^x has shape \(4, 3\) and strides \(0, 1\)"):
        te._C._tensor_view(torch.zeros(3).expand(4, 3))


def test_tensor_dtype_error_is_value_error():
    with pytest.raises(ValueError, match=r"^x has dtype float64; expected one of: float32, "
                       r"bfloat16$"):
        te._C._tensor_view(torch.zeros(2, dtype=torch.float64), dtypes=["float32", "bfloat16"])


def test_unknown_device_string_is_value_error_naming_it():
    with pytest.raises(ValueError, match=r"^device must be None, an int, 'cpu', 'cuda', 'cuda:N' "
                       r"or a torch\.device; got 'tpu:0'$"):
        te.execution_mode(R.Float8CurrentScaling(), device="tpu:0")
    with pytest.raises(ValueError, match=r"got 'cuda:x'$"):
        te.execution_mode(R.Float8CurrentScaling(), device="cuda:x")
    with pytest.raises(ValueError, match=r"got 2\.5$"):
        te.execution_mode(R.Float8CurrentScaling(), device=2.5)


def test_missing_cuda_device_is_value_error():
    n = te.build_info()["device_count"]
    with pytest.raises(ValueError, match=rf"^cuda:{n + 3} is not a CUDA device this process can "
                       rf"use \(it sees {n}\)$"):
        te.execution_mode(R.MXFP8BlockScaling(), device=f"cuda:{n + 3}")


# ---- TypeError / NotImplementedError: wrong or unsupported recipes ------------------------------

@dataclasses.dataclass(frozen=True)
class _UnknownRecipe(R.Recipe):
    """A Recipe subclass tequant has no kind for."""


@pytest.mark.parametrize("call", [
    pytest.param(lambda r: te.execution_mode(r), id="execution_mode"),
    pytest.param(lambda r: te.quantizer_config(r, "input"), id="quantizer_config"),
    pytest.param(lambda r: te.recipe_key(r), id="recipe_key"),
    pytest.param(lambda r: te.autocast(recipe=r), id="autocast"),
])
def test_unknown_recipe_subclass_is_not_implemented(call):
    with pytest.raises(NotImplementedError, match=r"^recipe type _UnknownRecipe is not supported; "
                       r"expected one of DelayedScaling, Float8CurrentScaling, Float8BlockScaling, "
                       r"MXFP8BlockScaling, NVFP4BlockScaling, CustomRecipe$"):
        call(_UnknownRecipe())


@pytest.mark.parametrize("bad,type_name", [("fp8", "str"), (42, "int"), (object(), "object")])
def test_non_recipe_is_type_error(bad, type_name):
    with pytest.raises(TypeError, match=r"^recipe must be a tequant\.recipe\.Recipe \(for example "
                       rf"Float8CurrentScaling\(\)\) or None, got {type_name}$"):
        te.execution_mode(bad)


def test_non_tensor_is_type_error():
    with pytest.raises(TypeError, match=r"^weight must be a torch\.Tensor, got list$"):
        te._C._tensor_view([[1.0]], name="weight")


def test_failed_calls_leave_no_pending_error():
    # After each failure, the next good call works and returns a normal result.
    for bad in (lambda: te.quantizer_config(None, "bogus"),
                lambda: te._C._tensor_view(torch.zeros(2, 3).t()),
                lambda: te.execution_mode(None, device="tpu")):
        with pytest.raises(ValueError):
            bad()
        assert te.execution_mode(None, device="cpu").mode == "cpu-reference"


# ---- wrong argument types in the module API: TypeError naming the argument ----------------------

@pytest.mark.parametrize("inside_autocast", [False, True])
@pytest.mark.parametrize("bad", ["x", 3, [1.0] * 32, None])
def test_linear_forward_non_tensor_is_type_error(bad, inside_autocast):
    m = te.Linear(32, 32)
    with te.autocast(recipe=R.Float8CurrentScaling(), enabled=inside_autocast):
        with pytest.raises(TypeError, match=f"Linear: inp must be a torch.Tensor, got "
                                            f"{type(bad).__name__}"):
            m(bad)
    assert te.autocast_depth() == 0


def test_linear_is_first_microbatch_must_be_bool_or_none():
    with pytest.raises(TypeError, match="is_first_microbatch must be None, True or False, got str"):
        te.Linear(32, 32)(torch.randn(2, 32), "a")


@pytest.mark.parametrize("name", ["bias", "return_bias", "sequence_parallel"])
def test_linear_flags_must_be_bools(name):
    with pytest.raises(TypeError, match=f"{name} must be a bool, got str"):
        te.Linear(4, 4, **{name: "yes"})


@pytest.mark.parametrize("call, message", [
    (lambda: te.prepare_state("model", R.DelayedScaling()),
     "te.prepare_state takes a torch.nn.Module, got str"),
    (lambda: te.prepare_state(te.Linear(16, 16), "delayed"),
     "recipe must be a tequant.recipe.Recipe, got str"),
    (lambda: te.distributed.enable_quantized_all_gather("model"),
     "enable_quantized_all_gather takes a torch.nn.Module, got str"),
    (lambda: te.distributed.reduce_sequence_parallel_grads("model", None),
     "reduce_sequence_parallel_grads takes a torch.nn.Module, got str"),
    (lambda: te.LayerNorm(8)("x"), "LayerNorm: inp must be a torch.Tensor, got str"),
    (lambda: te.LayerNormMLP(16, 16)(3), "LayerNormMLP: inp must be a torch.Tensor, got int"),
])
def test_module_helpers_name_the_wrong_argument(call, message):
    import tequant.distributed  # noqa: F401
    with pytest.raises(TypeError, match=message):
        call()


def test_quantize_of_a_0d_tensor_is_value_error():
    with pytest.raises(ValueError, match="0-d tensor; quantize takes"):
        te.ops.quantize(torch.tensor(1.5))
