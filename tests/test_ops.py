"""te.ops.quantize / te.ops.dequantize and QuantizedTensor: the API surface.

Error paths (TypeError / ValueError / NotImplementedError with messages that name the problem)
run everywhere and need no quantizer kernel. Positive paths (member shapes and dtypes per the
layouts documented in csrc/include/tequant/tequant.h, logical shape kept by dequantize, strided
rows, DelayedScaling's scale and history slot, stochastic-rounding reproducibility) run every
quantizer on CPU and, where available, CUDA. Bit-exactness of each quantizer against an independent
reference lives in tests/test_quantize_*.py; here only API-level equalities are checked.
"""
import pytest
import torch

import tequant as te
from tequant.quantized import QuantizedTensor
from tequant.recipe import (CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


RECIPES = {
    "delayed": DelayedScaling(),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "mxfp8_2d": MXFP8BlockScaling(enable_2d_quantization=True),
    "nvfp4": NVFP4BlockScaling(),
}
ROLES = ["input", "weight", "grad_output"]
ELEM_DTYPES = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2, "E2M1": torch.uint8}
CASES = [pytest.param(r, role, id=f"{r}-{role}") for r in RECIPES for role in ROLES]


def cdiv(a, b):
    return -(-a // b)


def pad4(a):
    return cdiv(a, 4) * 4


def expected_members(config, m, k, rowwise, columnwise):
    """{member: (shape, dtype) or None} from the layouts documented in tequant.h."""
    f32 = torch.float32
    elem = ELEM_DTYPES[config.format]
    packed = 2 if config.format == "E2M1" else 1
    want = {"data": ((m, k // packed), elem) if rowwise else None,
            "data_t": ((k, m // packed), elem) if columnwise else None,
            "scale_inv": None, "scale_inv_t": None, "amax": None, "amax_t": None}
    if config.scaling in ("delayed", "current"):
        want["scale_inv"] = ((1, 1), f32)  # shared by both directions
        want["amax"] = ((1, 1), f32)
    elif config.scaling == "block":
        if config.two_d:
            row, col = (cdiv(m, 128), pad4(cdiv(k, 128))), (cdiv(k, 128), pad4(cdiv(m, 128)))
        else:
            row, col = (cdiv(k, 128), pad4(m)), (cdiv(m, 128), pad4(k))
        want["scale_inv"] = (row, f32) if rowwise else None
        want["scale_inv_t"] = (col, f32) if columnwise else None
    elif config.scaling == "mxfp8":
        want["scale_inv"] = ((k // 32, m), torch.float8_e8m0fnu) if rowwise else None  # block-major
        want["scale_inv_t"] = ((m // 32, k), torch.float8_e8m0fnu) if columnwise else None
    elif config.scaling == "nvfp4":
        want["scale_inv"] = ((m, k // 16), torch.float8_e4m3fn) if rowwise else None
        want["scale_inv_t"] = ((k, m // 16), torch.float8_e4m3fn) if columnwise else None
        want["amax"] = ((1, 1), f32) if rowwise else None
        want["amax_t"] = ((1, 1), f32) if columnwise else None
    return want


def compact_scale_shape(config, m, k):
    """QuantizedTensor.scales() of the direction whose data is [m, k]."""
    if config.block is None:
        return (1, 1)
    if config.scaling == "block":
        return (cdiv(m, 128), cdiv(k, 128)) if config.two_d else (m, cdiv(k, 128))
    return (m, k // config.block[1])


def randn(shape, dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def member_bits(q):
    return {name: None if getattr(q, name) is None else getattr(q, name).view(torch.uint8).cpu()
            for name in ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t")}


def assert_same_members(a, b):
    ba, bb = member_bits(a), member_bits(b)
    for name in ba:
        assert (ba[name] is None) == (bb[name] is None), name
        if ba[name] is not None:
            assert torch.equal(ba[name], bb[name]), name


# ---------------------------------------------------------------------------------------------
# Error paths: no kernel runs before these are raised
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("x", [[1.0, 2.0], 3.0, None, "x"])
def test_x_must_be_a_tensor(x):
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got"):
        te.ops.quantize(x)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool,
                                   torch.float64, torch.complex64])
def test_non_float_dtypes_are_refused(dtype):
    x = torch.zeros(32, 32, dtype=dtype)
    with pytest.raises(ValueError, match=rf"x has dtype {dtype}; expected torch.float32, "
                                         r"torch.bfloat16 or torch.float16"):
        te.ops.quantize(x)


def test_no_direction_is_refused():
    with pytest.raises(ValueError, match="rowwise and columnwise are both False"):
        te.ops.quantize(torch.zeros(32, 32), rowwise=False, columnwise=False)


@pytest.mark.parametrize("recipe,align,shape,dim,value", [
    (MXFP8BlockScaling(), 32, (32, 48), "cols", 48),
    (MXFP8BlockScaling(), 32, (48, 64), "rows", 48),
    (MXFP8BlockScaling(), 32, (2, 5, 64), "rows", 10),
    (MXFP8BlockScaling(enable_2d_quantization=True), 32, (64, 16), "cols", 16),
    (NVFP4BlockScaling(), 16, (16, 24), "cols", 24),
    (NVFP4BlockScaling(), 16, (8, 32), "rows", 8),
    (NVFP4BlockScaling(), 16, (3, 5, 32), "rows", 15),
])
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (True, True)])
def test_misaligned_shapes_name_the_dim(recipe, align, shape, dim, value, rowwise, columnwise):
    x = torch.zeros(shape, dtype=torch.bfloat16)
    for role in ROLES:
        with pytest.raises(ValueError, match=rf"multiples of {align}.*\({dim}={value} is not\)"):
            te.ops.quantize(x, recipe, role, rowwise=rowwise, columnwise=columnwise)


@pytest.mark.parametrize("make", [lambda: torch.zeros(64, 32).t(),
                                  lambda: torch.zeros(4, 64, 32).transpose(0, 1),
                                  lambda: torch.zeros(32, 64)[:, ::2],
                                  lambda: torch.zeros(1, 32).expand(32, 32)],
                         ids=["transposed", "3d-transposed", "step-2-cols", "expanded"])
def test_non_contiguous_inputs_ask_for_contiguous(make):
    with pytest.raises(ValueError, match=r"x has shape .* and strides .*pass x\.contiguous\(\)"):
        te.ops.quantize(make(), Float8CurrentScaling())


@pytest.mark.parametrize("name", [n for n in RECIPES if n != "delayed"])
def test_scale_and_history_only_for_delayed(name):
    x = torch.zeros(64, 64)
    with pytest.raises(ValueError, match="scale and amax_history apply to DelayedScaling only"):
        te.ops.quantize(x, RECIPES[name], scale=torch.ones(1))
    with pytest.raises(ValueError, match="scale and amax_history apply to DelayedScaling only"):
        te.ops.quantize(x, RECIPES[name], amax_history=torch.zeros(1))


@pytest.mark.parametrize("role", ["foo", "Input", "", None, 3, "weights"])
def test_bad_role_names(role):
    with pytest.raises(ValueError, match="role must be one of 'input', 'weight', 'output', "
                                         "'grad_output', 'grad_input'"):
        te.ops.quantize(torch.zeros(32, 32), Float8CurrentScaling(), role)


def test_bad_recipe_type():
    with pytest.raises(TypeError, match="recipe must be a tequant.recipe.Recipe"):
        te.ops.quantize(torch.zeros(32, 32), "fp8")


def test_custom_recipe_is_not_implemented():
    recipe = CustomRecipe(qfactory=lambda role: None)
    with pytest.raises(NotImplementedError, match="CustomRecipe quantizers are user objects"):
        te.ops.quantize(torch.zeros(32, 32), recipe)


def test_meta_tensors_are_refused():
    with pytest.raises(NotImplementedError, match="x is on a meta device"):
        te.ops.quantize(torch.empty(32, 32, device="meta"))


def fake_quantized(recipe, role, m, k, rowwise, columnwise):
    """A QuantizedTensor with members laid out as tequant.h says (contents zero), built without
    running a quantizer: for the error paths of the accessors."""
    config = te.quantizer_config(recipe, role)
    want = expected_members(config, m, k, rowwise, columnwise)
    members = [None if want[n] is None else torch.zeros(want[n][0], dtype=want[n][1])
               for n in ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t")]
    return QuantizedTensor(config, (m, k), torch.bfloat16, members)


@pytest.mark.parametrize("name", list(RECIPES))
def test_accessors_of_a_missing_direction(name):
    q = fake_quantized(RECIPES[name], "input", 64, 64, rowwise=True, columnwise=False)
    assert q.has("rowwise") and not q.has("columnwise")
    with pytest.raises(ValueError, match="has no columnwise data; quantize with columnwise=True"):
        q.dequantize_direction("columnwise")
    with pytest.raises(ValueError, match="has no columnwise data"):
        q.codes("columnwise")
    with pytest.raises(ValueError, match="has no columnwise data"):
        q.scales("columnwise")
    q = fake_quantized(RECIPES[name], "input", 64, 64, rowwise=False, columnwise=True)
    with pytest.raises(ValueError, match="has no rowwise data; quantize with rowwise=True"):
        q.dequantize_direction("rowwise")
    for bad in ("both", "row", None, 1):
        with pytest.raises(ValueError, match="direction must be 'rowwise' or 'columnwise'"):
            q.has(bad)


def test_fake_layout_accessors_give_compact_forms():
    """codes() unpacks E2M1 nibbles (even column low); scales() of 1x128 blocks transposes the
    cuBLASLt layout back to [rows, blocks]."""
    q = fake_quantized(NVFP4BlockScaling(), "input", 32, 64, rowwise=True, columnwise=False)
    q.data[0, 0] = 0x3A  # codes 0xA (col 0) and 0x3 (col 1)
    codes = q.codes("rowwise")
    assert codes.shape == (32, 64) and codes.dtype == torch.uint8
    assert codes[0, :3].tolist() == [0xA, 0x3, 0]
    q = fake_quantized(Float8BlockScaling(), "input", 200, 300, rowwise=True, columnwise=True)
    q.scale_inv[2, 199] = 5.0  # block kb=2 of row 199
    assert q.scales("rowwise").shape == (200, 3) and q.scales("rowwise")[199, 2] == 5.0
    assert q.scales("columnwise").shape == (300, 2)


def test_dequantize_argument_errors():
    with pytest.raises(TypeError, match="q must be a tequant.QuantizedTensor, got Tensor"):
        te.ops.dequantize(torch.zeros(4))
    q = fake_quantized(Float8CurrentScaling(), "input", 32, 32, rowwise=True, columnwise=False)
    for dtype in (torch.float64, torch.int32, torch.float8_e4m3fn, "float32"):
        with pytest.raises(ValueError, match="dtype must be torch.float32, torch.bfloat16 or "
                                             "torch.float16"):
            te.ops.dequantize(q, dtype)


@gpu
@pytest.mark.gpu
def test_delayed_scale_on_another_device_is_refused():
    x = torch.zeros(16, 16, device="cuda")
    with pytest.raises(ValueError, match="scale must be a float32 tensor of one element on x's device"):
        te.ops.quantize(x, DelayedScaling(), scale=torch.ones(1))


# ---------------------------------------------------------------------------------------------
# Positive paths
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(64, 96), (256, 160)])
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("recipe,role", CASES)
def test_member_shapes_and_dtypes(recipe, role, rowwise, columnwise, shape):
    m, k = shape
    x = randn((m, k))
    q = te.ops.quantize(x, RECIPES[recipe], role, rowwise=rowwise, columnwise=columnwise)
    config = te.quantizer_config(RECIPES[recipe], role)
    assert q.config == config and q.shape == x.shape and q.dtype == x.dtype
    want = expected_members(config, m, k, rowwise, columnwise)
    for name, spec in want.items():
        got = getattr(q, name)
        if spec is None:
            assert got is None, name
        else:
            assert got is not None, name
            assert (tuple(got.shape), got.dtype) == spec, name
            assert got.is_contiguous() and got.device == x.device, name
    assert q.has("rowwise") == rowwise and q.has("columnwise") == columnwise
    for direction, dm, dk in (("rowwise", m, k), ("columnwise", k, m)):
        if not q.has(direction):
            continue
        codes = q.codes(direction)
        assert codes.shape == (dm, dk) and codes.dtype == torch.uint8
        if config.format == "E2M1":
            assert int(codes.max()) <= 15
        assert tuple(q.scales(direction).shape) == compact_scale_shape(config, dm, dk)
        assert tuple(q.dequantize_direction(direction).shape) == (dm, dk)
    assert "QuantizedTensor(shape=" in repr(q) and config.format in repr(q)


def rel_error(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# Frobenius error bounds on randn data (NUMERICS 5 gives FP8 < 5e-2, NVFP4 < 2e-1 for outputs).
BOUND = {"E4M3": 0.05, "E5M2": 0.1, "E2M1": 0.2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe,role", CASES)
def test_dequantize_keeps_the_logical_shape_and_values(recipe, role, dtype):
    x = randn((2, 32, 96), dtype, seed=1)  # 3-D: M = 64 rows, K = 96
    q = te.ops.quantize(x, RECIPES[recipe], role, rowwise=True, columnwise=True)
    config = q.config
    assert q.rows == 64 and q.cols == 96
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        y = te.ops.dequantize(q, out_dtype)
        assert y.shape == x.shape and y.dtype == out_dtype
        assert torch.isfinite(y).all()
        err = rel_error(y.float(), x.float())
        assert 0 < err < BOUND[config.format], (out_dtype, err)  # 0 would mean no quantization
    y_col = q.dequantize_direction("columnwise")
    assert y_col.shape == (96, 64)
    if not config.rht:  # with RHT the columnwise copy holds RHT(x^T), not x^T
        assert 0 < rel_error(y_col, x.reshape(64, 96).t().float()) < BOUND[config.format]
        q_col = te.ops.quantize(x, RECIPES[recipe], role, rowwise=False, columnwise=True,
                                rng=(7, 8))
        y = q_col.dequantize()  # from the columnwise data, transposed back
        assert y.shape == x.shape and 0 < rel_error(y, x.float()) < BOUND[config.format]


@pytest.mark.parametrize("recipe,role", CASES)
def test_strided_rows_give_the_bits_of_the_contiguous_copy(recipe, role):
    base = randn((64, 160), torch.float32, seed=2) * 3
    x = base[:, :128]  # ld = 160 > cols = 128
    assert not x.is_contiguous()
    kw = dict(rowwise=True, columnwise=True, rng=(11, 12))
    q_view = te.ops.quantize(x, RECIPES[recipe], role, **kw)
    q_copy = te.ops.quantize(x.contiguous(), RECIPES[recipe], role, **kw)
    assert_same_members(q_view, q_copy)
    # The elements outside the view must not take part: change them and nothing moves.
    base[:, 128:] = 1e4
    assert_same_members(te.ops.quantize(x, RECIPES[recipe], role, **kw), q_copy)


def test_delayed_scaling_uses_the_scale_and_accumulates_into_the_history_slot():
    x = torch.tensor([[1.0, -3.0], [2.0, 0.5]])
    history = torch.zeros(4, 1)
    slot = history[0]  # a [1] view into row 0 of a history
    q = te.ops.quantize(x, DelayedScaling(), scale=torch.tensor([2.0]), amax_history=slot)
    assert q.amax is slot and history[0, 0] == 3.0 and (history[1:] == 0).all()
    assert q.scale_inv.item() == 0.5
    assert torch.equal(q.dequantize(), x)  # 2x is exact in E4M3
    te.ops.quantize(x / 4, DelayedScaling(), amax_history=slot)
    assert history[0, 0] == 3.0  # max-accumulated, not overwritten
    te.ops.quantize(x * 4, DelayedScaling(), amax_history=slot)
    assert history[0, 0] == 12.0
    q = te.ops.quantize(x, DelayedScaling())  # no scale: 1; a fresh amax
    assert q.scale_inv.item() == 1.0 and q.amax.item() == 3.0


def test_stochastic_rounding_is_reproducible():
    recipe = NVFP4BlockScaling()
    assert te.quantizer_config(recipe, "grad_output").stochastic_rounding
    x = randn((64, 128), torch.float32, seed=3)
    a = te.ops.quantize(x, recipe, "grad_output", rng=(1, 2))
    b = te.ops.quantize(x, recipe, "grad_output", rng=(1, 2))
    c = te.ops.quantize(x, recipe, "grad_output", rng=(1, 3))
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)
    torch.manual_seed(5)
    d = te.ops.quantize(x, recipe, "grad_output")
    e = te.ops.quantize(x, recipe, "grad_output")  # the generator advanced: new bits
    torch.manual_seed(5)
    f = te.ops.quantize(x, recipe, "grad_output")
    assert torch.equal(d.data, f.data) and not torch.equal(d.data, e.data)
    g = torch.Generator().manual_seed(5)
    h = te.ops.quantize(x, recipe, "grad_output", generator=g)
    assert h.data.shape == a.data.shape


@pytest.mark.parametrize("name", ["current", "block", "mxfp8"])
def test_empty_inputs(name):
    for shape in [(0, 128), (128, 0) if name != "mxfp8" else (0, 64), (0, 0)]:
        q = te.ops.quantize(torch.empty(shape), RECIPES[name], rowwise=True, columnwise=True)
        assert q.data.shape == shape and q.data_t.shape == shape[::-1]
        assert te.ops.dequantize(q).shape == shape


def test_missing_direction_of_a_real_quantized_tensor():
    q = te.ops.quantize(randn((32, 32)), MXFP8BlockScaling(), rowwise=True, columnwise=False)
    with pytest.raises(ValueError, match="has no columnwise data; quantize with columnwise=True"):
        q.dequantize_direction("columnwise")
    assert q.dequantize().shape == (32, 32)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("recipe,role", CASES)
def test_cuda_members_match_the_cpu_reference(recipe, role):
    x = randn((256, 384), torch.bfloat16, seed=4)
    kw = dict(rowwise=True, columnwise=True, rng=(21, 22))
    q_gpu = te.ops.quantize(x.cuda(), RECIPES[recipe], role, **kw)
    q_cpu = te.ops.quantize(x, RECIPES[recipe], role, **kw)
    assert q_gpu.device.type == "cuda"
    for name, t in member_bits(q_gpu).items():
        if t is not None:
            assert getattr(q_gpu, name).device.type == "cuda", name
    assert_same_members(q_gpu, q_cpu)
    for direction in ("rowwise", "columnwise"):
        got = q_gpu.dequantize_direction(direction).cpu()
        assert torch.equal(got.view(torch.int32), q_cpu.dequantize_direction(direction).view(torch.int32))


def test_delayed_scaling_state_tensors_are_checked():
    x = randn((64, 64))
    for kw, what in [(dict(scale=torch.ones(2)), "scale"),
                     (dict(scale=torch.ones(1, dtype=torch.float64)), "scale"),
                     (dict(amax_history=torch.zeros(2)), "amax_history"),
                     (dict(scale=[1.0]), "scale"),
                     (dict(amax_history=torch.zeros(1, dtype=torch.int32)), "amax_history"),
                     (dict(amax_history=[0.0]), "amax_history")]:
        with pytest.raises(ValueError, match=f"{what} must be a float32 tensor of one element"):
            te.ops.quantize(x, DelayedScaling(), **kw)


@pytest.mark.parametrize("rng", [(1,), (1, 2, 3), ("a", 1), (-1, 5), (0, 2**64), 7])
def test_bad_rng_is_rejected(rng):
    with pytest.raises(ValueError, match="rng"):
        te.ops.quantize(randn((64, 64)), NVFP4BlockScaling(), role="grad_output", rng=rng)


@gpu
@pytest.mark.gpu
def test_generator_of_another_device_is_rejected():
    with pytest.raises(ValueError, match="generator is on cpu, x on cuda"):
        te.ops.quantize(randn((64, 64)).cuda(), NVFP4BlockScaling(), role="grad_output",
                        generator=torch.Generator())


def test_quantized_tensor_records_recipe_and_role_and_looks_its_config_up():
    recipe = MXFP8BlockScaling()
    q = te.ops.quantize(randn((32, 64)), recipe, "weight")
    assert q.recipe is recipe and q.role == "weight"
    assert te.ops.quantize(randn((32, 64))).recipe is None  # the default recipe
    lazy = QuantizedTensor(None, q.shape, q.dtype, q._members(), recipe, "weight")
    assert lazy.config == q.config == te.quantizer_config(recipe, "weight")
    assert torch.equal(lazy.dequantize(), q.dequantize())
    assert torch.equal(lazy.scales().view(torch.uint8), q.scales().view(torch.uint8))
