"""Tensor intake (csrc/ext/tensor_view.c) through tequant._C._tensor_view: the 2-D descriptor
(data_ptr, rows, cols, ld, dtype, device, shape, stream) the C code sees for a torch tensor of any
rank, dtype and layout, and the ValueError/TypeError a tensor it cannot take gets. GPU cases
(device ordinal, current stream) are marked gpu and skip without CUDA.
"""

import re

import numpy as np
import pytest
import torch

import tequant as te

view = te._C._tensor_view

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [
    (torch.float32, "float32"),
    (torch.bfloat16, "bfloat16"),
    (torch.float16, "float16"),
    (torch.uint8, "uint8"),
    (torch.int32, "int32"),
    (torch.int64, "int64"),
    (torch.float8_e4m3fn, "float8_e4m3"),
    (torch.float8_e5m2, "float8_e5m2"),
    (torch.float8_e8m0fnu, "float8_e8m0"),
]

# every tequant dtype a torch tensor can carry (packed E2M1 travels as uint8)
ALL_NAMES = "float32, bfloat16, float16, float8_e4m3, float8_e5m2, float8_e8m0, uint8, int32, int64"

LAYOUT_ERROR = ("tequant needs the last dim contiguous (stride 1) and the leading dims mergeable "
                "into rows with one row stride")


def _dims(values):
    return str(tuple(values))  # Python's spelling: (4,) for one dim


def assert_addresses_match(x, d):
    """Independent of how tequant flattens: every element of x, taken in row-major order of its
    leading dims, must sit at data_ptr + (r * ld + c) * itemsize."""
    assert d["rows"] * d["cols"] == x.numel()
    if x.numel() == 0:
        return
    item = x.element_size()
    cols = d["cols"]
    lead = list(x.shape[:-1]) if x.dim() else []
    strides = x.stride()
    for flat in range(x.numel()):
        r, c = divmod(flat, cols)
        idx, rest = [], r
        for size in reversed(lead):
            idx.append(rest % size)
            rest //= size
        idx = list(reversed(idx)) + ([c] if x.dim() else [])
        addr = x.data_ptr() + item * sum(i * s for i, s in zip(idx, strides))
        assert addr == d["data_ptr"] + item * (r * d["ld"] + c), (idx, r, c)


def assert_descriptor(x, d, rows, cols, ld):
    assert d["data_ptr"] == x.data_ptr()
    assert (d["rows"], d["cols"], d["ld"]) == (rows, cols, ld)
    assert d["shape"] == tuple(x.shape)
    assert d["ld"] >= d["cols"]
    assert_addresses_match(x, d)


# ---- dtypes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,name", DTYPES, ids=[n for _, n in DTYPES])
def test_each_supported_dtype_on_cpu(dtype, name):
    x = torch.zeros(3, 5, 7, dtype=dtype)
    d = view(x)
    assert set(d) == {"data_ptr", "rows", "cols", "ld", "dtype", "device", "shape", "stream"}
    assert d["dtype"] == name
    assert d["data_ptr"] == x.data_ptr() != 0
    assert d["shape"] == (3, 5, 7)
    assert (d["rows"], d["cols"]) == (15, 7)
    assert d["ld"] == x.stride(-2) == 7
    assert d["device"] == -1
    assert d["stream"] == 0  # CPU tensors have no stream


@pytest.mark.parametrize("dtype,name", DTYPES, ids=[n for _, n in DTYPES])
def test_dtype_allowed_by_name_list(dtype, name):
    x = torch.zeros(2, 4, dtype=dtype)
    assert view(x, dtypes=[name])["dtype"] == name
    other = "float32" if name != "float32" else "int64"
    with pytest.raises(ValueError, match=rf"^x has dtype {name}; expected one of: {other}$"):
        view(x, dtypes=[other])


# ---- ranks -------------------------------------------------------------------------------------

def test_zero_dim_tensor_is_one_by_one():
    x = torch.tensor(2.5)
    d = view(x)
    assert_descriptor(x, d, 1, 1, 1)
    assert d["shape"] == ()


def test_one_dim_tensor_is_one_row():
    x = torch.arange(9, dtype=torch.float32)
    assert_descriptor(x, view(x), 1, 9, 9)


def test_two_dim_tensor():
    x = torch.randn(6, 10)
    assert_descriptor(x, view(x), 6, 10, 10)


def test_three_dim_tensor_flattens_leading_dims():
    x = torch.randn(2, 3, 4)
    assert_descriptor(x, view(x), 6, 4, 4)


def test_five_dim_tensor_flattens_leading_dims():
    x = torch.randn(2, 1, 3, 2, 4, dtype=torch.bfloat16)
    d = view(x)
    assert_descriptor(x, d, 12, 4, 4)
    assert d["shape"] == (2, 1, 3, 2, 4)


def test_eight_dims_is_the_limit():
    x = torch.zeros([2, 1, 1, 2, 1, 1, 1, 3])
    assert_descriptor(x, view(x), 4, 3, 3)
    with pytest.raises(ValueError, match=r"^x has 9 dims; tequant takes at most 8$"):
        view(torch.zeros([1] * 9))


# ---- zero-size tensors -------------------------------------------------------------------------

@pytest.mark.parametrize("shape,rows,cols", [
    ((0, 5), 0, 5),
    ((5, 0), 5, 0),
    ((3, 0, 4), 0, 4),
    ((0,), 1, 0),
    ((0, 0), 0, 0),
])
def test_zero_size_tensors(shape, rows, cols):
    x = torch.zeros(shape, dtype=torch.float16)
    d = view(x)
    assert d["data_ptr"] == x.data_ptr()
    assert (d["rows"], d["cols"]) == (rows, cols)
    assert d["ld"] >= cols
    assert d["shape"] == shape


def test_zero_size_slice_of_a_wide_tensor_keeps_row_stride():
    x = torch.zeros(0, 3, 8)[:, :, :2]
    d = view(x)
    assert (d["rows"], d["cols"], d["ld"]) == (0, 2, 8)


def test_zero_size_transposed_view_is_accepted():
    x = torch.zeros(3, 4).t()[:0]
    assert (x.shape, x.stride()) == ((0, 3), (1, 4))
    d = view(x)
    assert (d["rows"], d["cols"]) == (0, 3)


# ---- valid non-contiguous views ----------------------------------------------------------------

def test_row_slice_points_into_the_parent():
    base = torch.randn(5, 8)
    x = base[1:3]
    d = view(x)
    assert_descriptor(x, d, 2, 8, 8)
    assert d["data_ptr"] == base.data_ptr() + 8 * 4


def test_row_step_slice_has_a_larger_ld():
    base = torch.randn(6, 8)
    x = base[::2]
    assert_descriptor(x, view(x), 3, 8, 16)


def test_last_dim_slice_has_ld_greater_than_cols():
    base = torch.randn(4, 8, dtype=torch.float16)
    x = base[:, 2:6]
    d = view(x)
    assert_descriptor(x, d, 4, 4, 8)
    assert d["data_ptr"] == base.data_ptr() + 2 * 2


def test_last_dim_slice_of_contiguous_3d_tensor():
    x = torch.randn(3, 4, 8)[:, :, :6]
    d = view(x)
    assert (d["rows"], d["cols"], d["ld"]) == (12, 6, 8)
    assert_descriptor(x, d, 12, 6, 8)


def test_strided_middle_dim_that_still_merges():
    x = torch.randn(4, 6, 8)[:, ::2, :]  # strides (48, 16, 1): one row stride of 16
    assert_descriptor(x, view(x), 12, 8, 16)


def test_storage_offset_moves_data_ptr():
    base = torch.arange(40, dtype=torch.float32)
    x = base[5:29].view(4, 6)
    assert x.storage_offset() == 5
    d = view(x)
    assert_descriptor(x, d, 4, 6, 6)
    assert d["data_ptr"] == base.data_ptr() + 5 * 4


def test_storage_offset_with_int64_and_column_slice():
    base = torch.arange(60, dtype=torch.int64).view(6, 10)
    x = base[2:5, 3:7]
    d = view(x)
    assert_descriptor(x, d, 3, 4, 10)
    assert d["data_ptr"] == base.data_ptr() + (2 * 10 + 3) * 8


@pytest.mark.parametrize("shape,strides,rows,cols,ld", [
    ((1, 5), (7, 1), 1, 5, 5),              # one row: its stride is irrelevant
    ((4, 1), (3, 5), 4, 1, 3),              # one column: its stride is irrelevant
    ((2, 1, 3, 4), (36, 999, 12, 1), 6, 4, 12),
    ((1, 1, 6), (1000, 3, 1), 1, 6, 6),
    ((3, 1, 1, 4), (4, 77, 1, 1), 3, 4, 4),
])
def test_size_one_dims_with_odd_strides(shape, strides, rows, cols, ld):
    storage = torch.zeros(4096)
    x = storage.as_strided(shape, strides, 16)
    d = view(x)
    assert d["data_ptr"] == storage.data_ptr() + 16 * 4
    assert_descriptor(x, d, rows, cols, ld)


# ---- tensor types ------------------------------------------------------------------------------

def test_parameter_and_subclass_share_the_table():
    class MyTensor(torch.Tensor):
        pass

    p = torch.nn.Parameter(torch.randn(3, 4))
    t = torch.randn(5, 2)
    s = torch.randn(2, 6).as_subclass(MyTensor)
    # Alternate types so the per-type cache has to switch each time.
    for _ in range(3):
        for x, shape in ((p, (3, 4)), (t, (5, 2)), (s, (2, 6)), (p[:, 1:], (3, 3))):
            d = view(x)
            assert d["data_ptr"] == x.data_ptr()
            assert (d["rows"], d["cols"]) == shape
            assert d["ld"] == x.stride(0)


def test_requires_grad_tensor_is_accepted():
    x = torch.randn(2, 3, requires_grad=True)
    assert_descriptor(x, view(x), 2, 3, 3)


# ---- layout errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.randn(4, 5).t(), id="transposed"),
    pytest.param(lambda: torch.randn(3, 4, 8).transpose(0, 1), id="transposed-leading"),
    pytest.param(lambda: torch.randn(1, 5).expand(4, 5), id="expanded-rows"),
    pytest.param(lambda: torch.randn(4, 1, 8).expand(4, 3, 8), id="expanded-middle"),
    pytest.param(lambda: torch.randn(8, 1).expand(8, 5), id="broadcast-last"),
    pytest.param(lambda: torch.randn(3, 4, 8)[:, :2, :], id="non-mergeable"),
    pytest.param(lambda: torch.randn(8)[::2], id="1d-step"),
    pytest.param(lambda: torch.randn(16).as_strided((3, 4), (2, 1)), id="overlapping-rows"),
    pytest.param(lambda: torch.randn(3, 4, 5, 12)[:, 2], id="index-middle-dim"),
    pytest.param(lambda: torch.randn(2, 3, 8).permute(1, 0, 2), id="permuted"),
])
def test_layout_errors_name_shape_strides_and_the_fix(make):
    x = make()
    expected = (f"x has shape {_dims(x.shape)} and strides {_dims(x.stride())}: {LAYOUT_ERROR}; "
                "pass x.contiguous()")
    with pytest.raises(ValueError, match="^" + re.escape(expected) + "$"):
        view(x)
    # The suggested fix works.
    y = x.contiguous()
    assert_descriptor(y, view(y), y.numel() // y.shape[-1], y.shape[-1], y.shape[-1])


def test_layout_error_uses_the_given_name():
    with pytest.raises(ValueError, match=r"^weight has shape \(5, 4\) and strides \(1, 5\): .*"
                       r"pass weight\.contiguous\(\)$"):
        view(torch.randn(4, 5).t(), name="weight")


def test_transposed_view_exact_message():
    x = torch.randn(4, 5).t()
    with pytest.raises(ValueError) as info:
        view(x)
    assert str(info.value) == (f"x has shape (5, 4) and strides (1, 5): {LAYOUT_ERROR}; "
                               "pass x.contiguous()")


# ---- dtype errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,shown", [
    (torch.float64, "float64"),
    (torch.complex64, "complex64"),
    (torch.bool, "bool"),
    (torch.int8, "int8"),
    (torch.float16, "float16"),  # supported by tequant, but not in this list
])
def test_dtype_not_in_list(dtype, shown):
    x = torch.zeros(2, 2, dtype=dtype)
    with pytest.raises(ValueError,
                       match=rf"^x has dtype {shown}\w*; expected one of: float32, bfloat16$"):
        view(x, dtypes=["float32", "bfloat16"])


@pytest.mark.parametrize("dtype,shown", [
    (torch.float64, "float64"),
    (torch.complex128, "complex128"),
    (torch.bool, "bool"),
    (torch.int16, "int16"),
])
def test_unsupported_dtype_lists_every_supported_one(dtype, shown):
    x = torch.zeros(3, dtype=dtype)
    with pytest.raises(ValueError, match=rf"^grad has dtype {shown}\w*; expected one of: "
                       rf"{ALL_NAMES}$"):
        view(x, name="grad")


def test_unknown_dtype_name_in_list():
    with pytest.raises(ValueError, match=r"^unknown dtype name 'float128'$"):
        view(torch.zeros(2), dtypes=["float32", "float128"])


def test_dtypes_must_be_a_sequence():
    with pytest.raises(TypeError, match=r"dtypes must be a sequence of dtype names"):
        view(torch.zeros(2), dtypes=5)


# ---- not a tensor / unusable device ------------------------------------------------------------

@pytest.mark.parametrize("obj,type_name", [
    ([1.0, 2.0], "list"),
    (np.zeros((2, 3), dtype=np.float32), "numpy.ndarray"),
    (None, "NoneType"),
    (3.0, "float"),
    ("tensor", "str"),
])
def test_non_tensor_is_type_error(obj, type_name):
    with pytest.raises(TypeError, match=rf"^x must be a torch\.Tensor, got {type_name}$"):
        view(obj)
    with pytest.raises(TypeError, match=rf"^bias must be a torch\.Tensor, got {type_name}$"):
        view(obj, name="bias")


def test_non_tensor_does_not_poison_the_type_cache():
    x = torch.randn(2, 3)
    assert view(x)["rows"] == 2
    with pytest.raises(TypeError):
        view([1, 2])
    assert view(x)["data_ptr"] == x.data_ptr()


def test_meta_tensor_raises_and_leaves_intake_usable():
    x = torch.empty(3, 4, device="meta")
    with pytest.raises((RuntimeError, NotImplementedError, ValueError)):
        view(x)
    y = torch.randn(3, 4)
    assert view(y)["data_ptr"] == y.data_ptr()


def test_meta_tensor_gets_a_clear_error():
    x = torch.empty(3, 4, device="meta")
    with pytest.raises(NotImplementedError, match=r"^x is on a meta device.*CPU and CUDA"):
        view(x)


# ---- CUDA --------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
def test_cuda_tensor_reports_device_and_current_stream():
    x = torch.randn(4, 6, 8, device="cuda", dtype=torch.bfloat16)
    d = view(x)
    assert d["device"] == x.device.index == torch.cuda.current_device()
    assert d["data_ptr"] == x.data_ptr()
    assert (d["rows"], d["cols"], d["ld"]) == (24, 8, 8)
    assert d["dtype"] == "bfloat16"
    assert d["stream"] == torch.cuda.current_stream().cuda_stream


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensor_reports_the_stream_in_a_stream_context():
    x = torch.randn(16, 32, device="cuda")
    s = torch.cuda.Stream()
    assert s.cuda_stream != torch.cuda.current_stream().cuda_stream
    with torch.cuda.stream(s):
        d = view(x)
        assert d["stream"] == s.cuda_stream != 0
        assert d["stream"] == torch.cuda.current_stream().cuda_stream
    # Back outside, the stream is the default one again.
    assert view(x)["stream"] == torch.cuda.current_stream().cuda_stream != s.cuda_stream


@pytest.mark.gpu
@needs_cuda
def test_cuda_slices_and_layout_errors():
    base = torch.randn(4, 16, device="cuda", dtype=torch.float16)
    x = base[1:, 4:12]
    d = view(x)
    assert (d["rows"], d["cols"], d["ld"]) == (3, 8, 16)
    assert d["data_ptr"] == base.data_ptr() + (16 + 4) * 2
    with pytest.raises(ValueError, match=r"^x has shape \(16, 4\) and strides \(1, 16\)"):
        view(base.t())
    q = torch.zeros(8, 32, device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert view(q)["dtype"] == "float8_e4m3"


@pytest.mark.gpu
@needs_cuda
def test_pinned_host_tensor_is_a_cpu_tensor():
    x = torch.arange(32, dtype=torch.float32).view(4, 8).pin_memory()
    assert x.is_pinned()
    d = view(x)
    assert d["device"] == -1
    assert d["stream"] == 0
    assert_descriptor(x, d, 4, 8, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
def test_second_cuda_device_reports_its_ordinal_and_stream():
    x = torch.randn(4, 4, device="cuda:1")
    s1 = torch.cuda.Stream(device=1)
    with torch.cuda.stream(s1):
        d = view(x)
    assert d["device"] == 1
    assert d["stream"] == s1.cuda_stream
