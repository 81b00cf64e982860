"""QuantizedTensor in the PyTorch ecosystem: copies, pickles and edits of its members
(python/tequant/quantized.py).

- pickle.dumps / pickle.loads round-trips every format bit for bit (torch itself cannot unpickle
  a float8 tensor, so the members travel as their bytes), as do copy.copy, copy.deepcopy and
  torch.save / torch.load(map_location=...); a copy made under torch.compile (config looked up
  lazily) stays lazy.
- Assigning a member (q.data = ..., q.scale_inv = ...) changes what dequantize() and te.ops.gemm
  read, not only what codes() reads; assigning shape updates rows / cols.
- The constructor takes exactly the six members.
References are the original members' bytes and plain torch casts (FP8 codes times scale_inv).
"""
import copy
import io
import pickle

import pytest
import torch

import tequant as te
from tequant.quantized import QuantizedTensor
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t")
# (recipe, role): per-tensor E4M3 / E5M2, block 1x128 / 128x128, MXFP8 1D / 2D, NVFP4 with RHT
# and stochastic rounding (grad_output), 1D (input) and 2D (weight)
CASES = {
    "delayed-e4m3": (DelayedScaling(), "input"),
    "current-e4m3": (Float8CurrentScaling(), "input"),
    "current-e5m2": (Float8CurrentScaling(), "grad_output"),
    "block-1x128": (Float8BlockScaling(), "input"),
    "block-128x128": (Float8BlockScaling(), "weight"),
    "mxfp8": (MXFP8BlockScaling(), "input"),
    "mxfp8-2d": (MXFP8BlockScaling(enable_2d_quantization=True), "weight"),
    "nvfp4-rht-sr": (NVFP4BlockScaling(), "grad_output"),
    "nvfp4-1d": (NVFP4BlockScaling(), "input"),
    "nvfp4-2d": (NVFP4BlockScaling(), "weight"),
}
SHAPES = {"mxfp8": (2, 32, 64), "nvfp4": (48, 80), "other": (3, 200)}  # off block multiples


def shape_for(name):
    return SHAPES["mxfp8" if name.startswith("mxfp8") else
                  "nvfp4" if name.startswith("nvfp4") else "other"]


def quantize(name, shape=None, seed=0, scale=1.0):
    recipe, role = CASES[name]
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape or shape_for(name), generator=g) * scale).to(torch.bfloat16)
    return te.ops.quantize(x, recipe, role, rowwise=True, columnwise=True, rng=(7, 8))


def raw(t):
    return None if t is None else (tuple(t.shape), t.dtype, t.view(torch.uint8).clone())


def assert_same_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got.recipe, got.role) == (want.recipe, want.role)
    assert got.config == want.config
    for name in MEMBERS:
        a, b = raw(getattr(got, name)), raw(getattr(want, name))
        assert (a is None) == (b is None), name
        if a is not None:
            assert a[:2] == b[:2] and torch.equal(a[2], b[2]), name
    for direction in ("rowwise", "columnwise"):  # the values read back, NaN-safe: as int32
        assert torch.equal(got.dequantize_direction(direction).view(torch.int32),
                           want.dequantize_direction(direction).view(torch.int32)), direction
        assert torch.equal(got.codes(direction), want.codes(direction)), direction


def save_load(q, weights_only=False, **kw):
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only, **kw)


@pytest.mark.parametrize("protocol", [pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL, 0])
@pytest.mark.parametrize("name", list(CASES))
def test_pickle_round_trip_is_bit_exact(name, protocol):
    q = quantize(name)
    assert_same_bits(pickle.loads(pickle.dumps(q, protocol=protocol)), q)


@pytest.mark.parametrize("name", list(CASES))
def test_copies_and_torch_save_are_bit_exact(name):
    q = quantize(name)
    want = {n: raw(getattr(q, n)) for n in MEMBERS}
    deep, shallow = copy.deepcopy(q), copy.copy(q)
    for again in (deep, shallow, save_load(q), save_load(q, map_location="cpu")):
        assert_same_bits(again, q)
    for n in MEMBERS:
        a, b = getattr(q, n), getattr(deep, n)
        if a is not None:  # deepcopy owns its memory, copy.copy shares it
            assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), n
            assert a.data_ptr() == getattr(shallow, n).data_ptr(), n
    deep.data.view(torch.uint8).zero_()  # the copy's memory is its own
    assert torch.equal(q.data.view(torch.uint8), want["data"][2])


@pytest.mark.parametrize("name", list(CASES))
def test_torch_load_weights_only_is_bit_exact(name):
    """torch.load's default (weights_only=True): tequant's pickle names are allowlisted."""
    q = quantize(name)
    assert_same_bits(save_load({"q": q}, weights_only=True)["q"], q)
    assert_same_bits(save_load(q, weights_only=True, map_location="cpu"), q)


@pytest.mark.parametrize("name", ["delayed-e4m3", "current-e4m3", "current-e5m2"])
def test_pickled_per_tensor_fp8_dequantizes_as_torch_casts(name):
    """Independent reference: the FP8 codes cast by torch, times the FP32 scale_inv."""
    q = pickle.loads(pickle.dumps(quantize(name, scale=30.0)))
    want = q.data.to(torch.float32) * q.scale_inv
    assert torch.equal(q.dequantize_direction("rowwise").view(torch.int32),
                       want.view(torch.int32))
    want_t = q.data_t.to(torch.float32) * q.scale_inv
    assert torch.equal(q.dequantize_direction("columnwise").view(torch.int32),
                       want_t.view(torch.int32))


def test_zero_size_and_one_row_tensors_pickle():
    for name, shape in (("current-e4m3", (0, 64)), ("block-1x128", (1, 130)),
                        ("block-128x128", (64, 0)), ("mxfp8", (0, 64)), ("nvfp4-2d", (0, 32)),
                        ("current-e5m2", (1, 1)), ("delayed-e4m3", (5,))):
        q = quantize(name, shape)
        again = pickle.loads(pickle.dumps(q))
        assert_same_bits(again, q)
        assert again.dequantize().shape == shape


def test_a_lazily_configured_copy_stays_lazy():
    """One made under torch.compile carries (recipe, role), not the config: so does its pickle."""
    q = quantize("mxfp8")
    lazy = QuantizedTensor(None, q.shape, q.dtype, q._members(), q.recipe, q.role)
    again = pickle.loads(pickle.dumps(lazy))
    assert again._config is None
    assert_same_bits(again, q)


@pytest.mark.parametrize("name", ["current-e4m3", "block-1x128", "mxfp8", "nvfp4-1d"])
def test_assigned_members_are_what_dequantize_and_gemm_read(name):
    a, b = quantize(name, (32, 128), seed=1), quantize(name, (32, 128), seed=2, scale=8.0)
    recipe, _ = CASES[name]
    w = te.ops.quantize(torch.randn(32, a.cols, generator=torch.Generator().manual_seed(3)),
                        recipe, "weight")
    for member in MEMBERS:
        setattr(a, member, getattr(b, member))
    assert_same_bits(a, b)
    got = te.ops.gemm(a, w, transpose_b=True, out_dtype=torch.float32)
    want = te.ops.gemm(b, w, transpose_b=True, out_dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    a.data = None  # dropping the rowwise data: dequantize falls back to the columnwise copy
    assert not a.has("rowwise")
    with pytest.raises(ValueError, match="has no rowwise data"):
        te.ops.gemm(a, w, transpose_b=True)
    assert torch.equal(a.dequantize().view(torch.int32),
                       b.dequantize_direction("columnwise").t().contiguous().view(torch.int32))


def test_assigned_shape_updates_rows_and_cols():
    q = quantize("current-e4m3", (4, 6, 32))
    assert (q.rows, q.cols) == (24, 32)
    q.shape = (24, 32)
    assert (q.rows, q.cols) == (24, 32) and q.shape == torch.Size((24, 32))
    q.shape = (2, 12, 32)
    assert q.dequantize().shape == (2, 12, 32)
    p = quantize("current-e4m3", (24, 32))
    p.shape = (32,)  # a different element count: the C layout check refuses the members
    assert (p.rows, p.cols) == (1, 32)
    with pytest.raises(ValueError, match="the layout needs"):
        p.dequantize()


@pytest.mark.parametrize("count", [0, 5, 7])
def test_the_constructor_takes_six_members(count):
    q = quantize("current-e4m3")
    members = (list(q._members()) + [None])[:count]
    with pytest.raises(ValueError, match="members must be the 6 tensors"):
        QuantizedTensor(q.config, q.shape, q.dtype, members)


@pytest.mark.parametrize("shape", [(2, 16, 48), (32, 1, 48), (32 * 48,)])
def test_out_of_a_two_dim_product_must_be_two_dim(shape):
    """A 2-D a (or transpose_a) gives [M, N]; an out of another shape is refused, not written
    and handed back in its own shape (a 3-D a's out must have a's leading dims, as before)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    r = Float8CurrentScaling()
    qx = te.ops.quantize(x, r, rowwise=True, columnwise=True)
    qw = te.ops.quantize(w, r, "weight")
    out = torch.zeros(shape)
    with pytest.raises(ValueError, match=r"out has shape .*; the product is \(32, 48\)"):
        te.ops.gemm(qx, qw, transpose_b=True, out=out)
    assert not out.any()
    qdy = te.ops.quantize(torch.randn(2, 16, 48, generator=g), r, "grad_output", columnwise=True)
    with pytest.raises(ValueError, match=r"the product is \(48, 64\)"):  # wgrad dy.T @ x
        te.ops.gemm(qdy, qx, transpose_a=True, out=torch.zeros(48, 1, 64))
    want = te.ops.gemm(qx, qw, transpose_b=True, out_dtype=torch.float32)
    ok = torch.zeros(32, 48)
    assert te.ops.gemm(qx, qw, transpose_b=True, out=ok) is ok and torch.equal(ok, want)


@pytest.mark.parametrize("call", ["dequantize", "dequantize_direction"])
def test_dequantize_names_a_dtype_it_cannot_write(call):
    q = quantize("current-e4m3")
    args = (torch.float64,) if call == "dequantize" else ("rowwise", torch.float64)
    with pytest.raises(ValueError, match="dtype must be torch.float32, torch.bfloat16 or "
                                         "torch.float16, got torch.float64"):
        getattr(q, call)(*args)
