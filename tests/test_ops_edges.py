"""te.ops at its edges: pairs and arguments the functional API must refuse, and inputs it must
read as torch does (python/tequant/ops.py, python/tequant/quantized.py, csrc/core/gemm.c,
csrc/ext/gemm.c, csrc/ext/quantize.c).

- NVFP4: a Hadamard-transformed operand (input / grad_output read columnwise) times a plain one
  is refused (the transform cancels only between two transformed operands); wgrad's pairing
  still multiplies.
- A bias is one row of N ([N] or [1, N]); [N, 1] or [2, N / 2] are refused, not broadcast.
- A tensor with torch's lazy negation bit quantizes as its values (the sign kept).
- codes() of an NVFP4 tensor with no rows or no columns; a 1-D `a` gives a 1-D product; wrong
  argument types and out-of-range internal arguments get TypeError / ValueError.
"""
import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import Float8CurrentScaling, NVFP4BlockScaling

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]


def _rel(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_transformed_times_plain_is_refused(device):
    g = torch.Generator().manual_seed(0)
    dy = torch.randn(256, 64, generator=g).to(device)
    x = torch.randn(256, 32, generator=g).to(device)
    r = NVFP4BlockScaling()
    qdy = te.ops.quantize(dy, r, "grad_output", rowwise=True, columnwise=True, rng=(1, 0))
    qx = te.ops.quantize(x, r, "input", rowwise=False, columnwise=True)
    qx_plain = te.ops.quantize(x, r, "weight", rowwise=False, columnwise=True)
    wgrad = te.ops.gemm(qdy, qx, transpose_a=True, out_dtype=torch.float32)  # both transformed
    assert _rel(wgrad, dy.t() @ x) < 0.3
    with pytest.raises(NotImplementedError, match="Hadamard-transformed operand"):
        te.ops.gemm(qdy, qx_plain, transpose_a=True, out_dtype=torch.float32)
    w = torch.randn(64, 32, generator=g).to(device)
    qw_input_role = te.ops.quantize(w, r, "input", rowwise=False, columnwise=True)
    with pytest.raises(NotImplementedError, match="Hadamard-transformed operand"):
        te.ops.gemm(qdy, qw_input_role, out_dtype=torch.float32)  # dgrad: dy rowwise, plain


@pytest.mark.parametrize("device", DEVICES)
def test_bias_is_one_row_of_n(device):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(32, 64, generator=g).to(device), torch.randn(32, 64, generator=g).to(device)
    bias = torch.randn(32, generator=g).to(device)
    r = Float8CurrentScaling()
    qx, qw = te.ops.quantize(x, r), te.ops.quantize(w, r, "weight")
    want = te.ops.gemm(qx, qw, transpose_b=True, out_dtype=torch.float32, bias=bias)
    got = te.ops.gemm(qx, qw, transpose_b=True, out_dtype=torch.float32, bias=bias[None])
    assert torch.equal(got, want)
    for bad in (bias.reshape(32, 1), bias.reshape(2, 16)):
        with pytest.raises(ValueError, match=r"takes a bias of shape \[N\] = \[32\]"):
            te.ops.gemm(qx, qw, transpose_b=True, out_dtype=torch.float32, bias=bad)


@pytest.mark.parametrize("device", DEVICES)
def test_lazily_negated_input_keeps_its_sign(device):
    g = torch.Generator().manual_seed(2)
    z = torch.randn(16, 32, dtype=torch.complex64, generator=g).to(device)
    x = z.conj().imag  # values -z.imag through torch's negation bit
    assert x.is_neg()
    got = te.ops.quantize(x, Float8CurrentScaling())
    want = te.ops.quantize(x.resolve_neg().clone(), Float8CurrentScaling())
    assert torch.equal(got.codes(), want.codes())
    assert torch.equal(got.scales(), want.scales())


def test_nvfp4_codes_of_empty_directions():
    q = te.ops.quantize(torch.randn(0, 32), NVFP4BlockScaling(), columnwise=True)
    assert q.codes("rowwise").shape == (0, 32) and q.codes("columnwise").shape == (32, 0)
    q = te.ops.quantize(torch.randn(32, 0), NVFP4BlockScaling(), columnwise=True)
    assert q.codes("rowwise").shape == (32, 0) and q.codes("columnwise").shape == (0, 32)


def test_one_dim_a_gives_a_one_dim_product():
    g = torch.Generator().manual_seed(3)
    r = Float8CurrentScaling()
    a, w = torch.randn(64, generator=g), torch.randn(48, 64, generator=g)
    qa, qa2, qw = te.ops.quantize(a, r), te.ops.quantize(a[None], r), te.ops.quantize(w, r, "weight")
    y = te.ops.gemm(qa, qw, transpose_b=True, out_dtype=torch.float32)
    assert y.shape == (48,)
    assert torch.equal(y, te.ops.gemm(qa2, qw, transpose_b=True, out_dtype=torch.float32)[0])
    out = torch.empty(48)
    assert te.ops.gemm(qa, qw, transpose_b=True, out=out) is out and torch.equal(out, y)


def test_wrong_argument_types_and_ranges():
    x = torch.randn(32, 64)
    r = Float8CurrentScaling()
    with pytest.raises(TypeError, match="generator must be a torch.Generator, got int"):
        te.ops.quantize(x, NVFP4BlockScaling(), "grad_output", generator=5)
    qx, qw = te.ops.quantize(x, r), te.ops.quantize(x, r, "weight")
    with pytest.raises(TypeError, match="out must be a torch.Tensor, got list"):
        te.ops.gemm(qx, qw, transpose_b=True, out=[0.0] * 1024)
    config = _C.quantizer_config(r, "input")
    with pytest.raises(ValueError, match="usage must be 1 .* got 1099511627777"):
        _C._quantize(x, config, 2 ** 40 + 1, None, None, None, None)
    with pytest.raises(ValueError, match=r"shape must be non-negative; got \[-1, 64\]"):
        _C._quantize_layout(config, -1, 64, 1)
    with pytest.raises(ValueError, match="usage must be 1"):
        _C._quantize_layout(config, 32, 64, 0)
