"""Build facts and device capability (csrc/core/device.c, csrc/ext/capability.c, capability.py):
te.build_info(), te.execution_mode(recipe, device) for every recipe class, device parsing and the
is_*_available helpers. CPU cases need no GPU; cases marked gpu check Hopper (H100/H200) answers
and skip without CUDA.
"""

import os
import shutil

import pytest
import torch

import tequant as te
from tequant import recipe as R

HAS_CUDA = torch.cuda.is_available()
needs_no_cuda = pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA-device answers")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
needs_hopper = pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.get_device_capability(0) != (9, 0),
    reason="needs an H100/H200 (compute capability 9.0) as cuda:0")

RECIPES = [
    pytest.param(lambda: R.DelayedScaling(), id="DelayedScaling"),
    pytest.param(lambda: R.Float8CurrentScaling(), id="Float8CurrentScaling"),
    pytest.param(lambda: R.Float8BlockScaling(), id="Float8BlockScaling"),
    pytest.param(lambda: R.MXFP8BlockScaling(), id="MXFP8BlockScaling"),
    pytest.param(lambda: R.NVFP4BlockScaling(), id="NVFP4BlockScaling"),
    pytest.param(lambda: R.CustomRecipe(qfactory=lambda role: None), id="CustomRecipe"),
]

AVAILABILITY = [te.is_fp8_available, te.is_fp8_block_scaling_available, te.is_mxfp8_available,
                te.is_nvfp4_available]

BUILD_INFO_TYPES = {
    "with_cuda": bool,
    "cuda_runtime_version": int,
    "cublaslt_header_version": int,
    "device_count": int,
    "capabilities": list,
    "cublaslt_version": int,
}

NO_DEVICE_REASON = "no CUDA device is usable here"


# ---- build_info --------------------------------------------------------------------------------

def test_build_info_keys_and_types():
    info = te.build_info()
    assert isinstance(info, dict)
    assert set(info) == set(BUILD_INFO_TYPES)
    for key, typ in BUILD_INFO_TYPES.items():
        assert type(info[key]) is typ, (key, info[key])
    assert len(info["capabilities"]) == info["device_count"]
    for cap in info["capabilities"]:
        assert isinstance(cap, tuple) and len(cap) == 2
        assert all(type(v) is int for v in cap)


def test_build_info_versions_follow_with_cuda():
    info = te.build_info()
    if info["with_cuda"]:
        # sm_90a kernels need CUDA 12 or newer; CUDART_VERSION is major*1000 + minor*10.
        assert info["cuda_runtime_version"] >= 12000
        assert info["cuda_runtime_version"] % 10 == 0
        assert info["cublaslt_header_version"] >= 120000
    else:
        assert info["cuda_runtime_version"] == 0
        assert info["cublaslt_header_version"] == 0
        assert info["device_count"] == 0
    if info["device_count"] == 0:
        assert info["cublaslt_version"] == 0  # only queried when there is a device


def test_build_info_device_count_agrees_with_torch():
    assert te.build_info()["device_count"] == min(torch.cuda.device_count(), 64)


def test_build_info_returns_a_fresh_dict():
    reference = te.build_info()
    first = te.build_info()
    first["capabilities"].append((1, 0))
    first["device_count"] = 99
    assert te.build_info() == reference


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH: a CPU-only build "
                    "is expected here")
@pytest.mark.skipif(os.environ.get("TEQUANT_CUDA", "").strip() == "0",
                    reason="TEQUANT_CUDA=0 asks for a CPU-only build")
def test_machine_with_nvcc_gets_a_cuda_build():
    # CI has nvcc but no GPU: the CUDA code must still be compiled (and link) there.
    info = te.build_info()
    assert info["with_cuda"] is True, (
        "nvcc is on PATH but tequant._C was built without CUDA; rebuild with "
        "`python3 -m pip install --no-build-isolation --no-deps -e .`")
    assert info["cuda_runtime_version"] > 0


# ---- execution_mode without a CUDA device -----------------------------------------------------

@needs_no_cuda
def test_no_device_means_device_count_zero():
    assert te.build_info()["device_count"] == 0
    assert te.build_info()["capabilities"] == []


@needs_no_cuda
@pytest.mark.parametrize("make", RECIPES)
def test_every_recipe_is_cpu_reference_without_a_device(make):
    result = te.execution_mode(make())
    assert isinstance(result, te.ExecutionMode)
    assert isinstance(result, tuple) and len(result) == 2
    mode, reason = result
    assert (mode, reason) == (result.mode, result.reason)
    assert result[0] == result.mode and result[1] == result.reason
    assert mode == "cpu-reference"
    assert NO_DEVICE_REASON in reason and "reference path" in reason


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), -1])
@pytest.mark.parametrize("make", RECIPES)
def test_cpu_device_is_cpu_reference_everywhere(make, device):
    mode, reason = te.execution_mode(make(), device=device)
    assert mode == "cpu-reference"
    assert "C reference path" in reason


@needs_no_cuda
def test_default_device_and_default_recipe_without_a_device():
    assert te.execution_mode() == te.execution_mode(R.Float8CurrentScaling())
    assert te.execution_mode(None, None).mode == "cpu-reference"


@needs_no_cuda
@pytest.mark.parametrize("device", ["cuda:7", 7, "cuda:0", 0])
def test_cuda_ordinal_without_devices_is_value_error(device):
    index = device if isinstance(device, int) else int(device.split(":")[1])
    with pytest.raises(ValueError, match=rf"^cuda:{index} is not a CUDA device this process can "
                       r"use \(it sees 0\)$"):
        te.execution_mode(R.Float8CurrentScaling(), device=device)


@needs_no_cuda
def test_plain_cuda_without_devices_is_value_error():
    with pytest.raises(ValueError, match=r"^device 'cuda': no CUDA device is usable here$"):
        te.execution_mode(R.MXFP8BlockScaling(), device="cuda")


@pytest.mark.parametrize("device", ["tpu", "CPU", "cuda:", "gpu:0", "", "cuda:zero"])
def test_bad_device_string_is_value_error_naming_it(device):
    with pytest.raises(ValueError, match=r"^device must be None, an int, 'cpu', 'cuda', 'cuda:N' "
                       rf"or a torch\.device; got '{device}'$"):
        te.execution_mode(R.Float8CurrentScaling(), device=device)


def test_huge_int_device_is_not_truncated():
    with pytest.raises((ValueError, OverflowError), match=r"4294967296"):
        te.execution_mode(R.Float8CurrentScaling(), device=2**32)


def test_indexed_cpu_torch_device_is_cpu():
    assert te.execution_mode(R.Float8CurrentScaling(), device=torch.device("cpu", 0)).mode == \
        "cpu-reference"


# ---- is_*_available ----------------------------------------------------------------------------

@needs_no_cuda
@pytest.mark.parametrize("fn", AVAILABILITY, ids=lambda f: f.__name__)
def test_availability_on_cpu(fn):
    assert fn() is True
    assert fn(return_reason=True) == (True, "")
    assert fn(True) == (True, "")


def test_availability_matches_execution_mode():
    recipes = [R.Float8CurrentScaling(), R.Float8BlockScaling(), R.MXFP8BlockScaling(),
               R.NVFP4BlockScaling()]
    for fn, recipe in zip(AVAILABILITY, recipes):
        mode, reason = te.execution_mode(recipe)
        ok, why = fn(return_reason=True)
        assert ok == (mode != "unsupported")
        assert why == ("" if ok else reason)


# ---- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_gpu_build_info_matches_torch():
    info = te.build_info()
    assert info["with_cuda"] is True
    assert info["device_count"] == torch.cuda.device_count() > 0
    assert info["capabilities"][0] == torch.cuda.get_device_capability(0)
    for d in range(info["device_count"]):
        assert info["capabilities"][d] == torch.cuda.get_device_capability(d)
    assert info["cublaslt_version"] > 0


@pytest.mark.gpu
@needs_hopper
def test_hopper_cublaslt_supports_block_scaling():
    assert te.build_info()["cublaslt_version"] >= 120900


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("make,expected", [
    (RECIPES[0].values[0], "native"),
    (RECIPES[1].values[0], "native"),
    (RECIPES[2].values[0], "native"),
    (RECIPES[3].values[0], "emulated"),
    (RECIPES[4].values[0], "emulated"),
    (RECIPES[5].values[0], "emulated"),
], ids=[p.id for p in RECIPES])
def test_hopper_execution_modes(make, expected):
    recipe = make()
    with torch.cuda.device(0):
        result = te.execution_mode(recipe)
        assert result == te.execution_mode(recipe, device=0)
        assert result == te.execution_mode(recipe, device="cuda")
        assert result == te.execution_mode(recipe, device="cuda:0")
        assert result == te.execution_mode(recipe, device=torch.device("cuda", 0))
    mode, reason = result
    assert mode == expected, reason
    assert reason
    if isinstance(recipe, (R.MXFP8BlockScaling, R.NVFP4BlockScaling)):
        assert "compute capability 9.0" in reason and "BF16" in reason


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("make", RECIPES)
def test_gpu_machine_cpu_device_is_cpu_reference(make):
    mode, reason = te.execution_mode(make(), device="cpu")
    assert mode == "cpu-reference"
    assert reason.startswith("CPU tensors run through")


@pytest.mark.gpu
@needs_cuda
def test_gpu_ordinal_past_the_last_device_is_value_error():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"^cuda:{n} is not a CUDA device this process can use "
                       rf"\(it sees {n}\)$"):
        te.execution_mode(R.Float8CurrentScaling(), device=f"cuda:{n}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("fn", AVAILABILITY, ids=lambda f: f.__name__)
def test_hopper_availability(fn):
    assert fn() is True
    assert fn(return_reason=True) == (True, "")


# _C._sanitizer_mark_written (csrc/core/sanitizer_marks.c): marks for compute-sanitizer's initcheck.
# Their effect is checked under the tool (tests/test_sanitize_kernels.py, the control test); here
# the entry point's contract: a no-op on CPU and on empty tensors, clear errors otherwise.

def test_sanitizer_mark_written_is_a_no_op_on_cpu():
    from tequant import _C
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert _C._sanitizer_mark_written(x) is None
    assert _C._sanitizer_mark_written(x[:, :2]) is None  # row-strided view
    assert _C._sanitizer_mark_written(torch.empty(0, 5, dtype=torch.bfloat16)) is None
    assert torch.equal(x, torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_sanitizer_mark_written_rejects_bad_arguments():
    from tequant import _C
    with pytest.raises(TypeError, match="t"):
        _C._sanitizer_mark_written("not a tensor")
    with pytest.raises(ValueError, match="t has dtype"):
        _C._sanitizer_mark_written(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="t has shape"):
        _C._sanitizer_mark_written(torch.zeros(4, 6).t())  # last dim not contiguous


@needs_cuda
def test_sanitizer_mark_written_on_cuda_leaves_the_tensor_alone():
    from tequant import _C
    x = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
    before = x.clone()
    _C._sanitizer_mark_written(x)
    _C._sanitizer_mark_written(x[:, 8:40])  # pitched: one range per row
    _C._sanitizer_mark_written(x.view(torch.uint8))
    assert torch.equal(x, before)
