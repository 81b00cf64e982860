"""tq_act_backward with a Float8BlockScaling (1x128 E4M3) or MXFP8BlockScaling (1x32 E4M3) config:
the activation's backward writes fc1's grad_output blocks in both directions from dy and h
(csrc/core/act.c, csrc/ref/act_backward_ref.c, cuda/act_grad_load.cuh through
cuda/act_quantize_block.cu / act_quantize_mxfp8.cu, _C._act_bwd, python/tequant/_act_fn.py,
linear.py).

- The members are the independent torch references' (tests/test_quantize_fp8_block.py,
  tests/test_quantize_mxfp8.py: torch casts and math) of dh rounded to h's dtype, zero rows
  appended up to `padded`: torch autograd's dh where it is exact (relu, reglu), else the
  activation kernel's dh (whose arithmetic tests/test_act_kernels.py checks). CPU and CUDA;
  CUDA bit-exact against the CPU reference, every activation and dtype, partial tiles, columns
  off the 16-byte vectors (the element path, a chunk across the gated halves), and the bf16
  table launches with values outside the table's window.
- Bad input: identity, per-tensor outputs or dbias beside a block config, E5M2 / 2D configs:
  clear errors.
- te.LayerNormMLP (fc1 without bias) under both recipes, the activations it fuses for
  (_act_fn.BLOCK_DH): outputs and gradients bit-identical to the same module with the backward
  fusion off, and the activation's backward did write fc1's blocks; with a bias that learns (its
  gradient is te.Linear's) or another activation nothing is asked.
"""
import os
import sys

import pytest
import torch

import tequant as te
from tequant import _C, _act_fn
from tequant.recipe import Float8BlockScaling, Format, MXFP8BlockScaling

sys.path.insert(0, os.path.dirname(__file__))
from test_act_block import ACTS, GATED, _h  # noqa: E402
from test_act_mxfp8 import _assert_members, _reference as mx_reference  # noqa: E402
from test_fused_norm_modules import same_bits  # noqa: E402
from test_linear import one_cpu_thread  # noqa: E402
from test_quantize_fp8_block import reference as block_reference  # noqa: E402

assert one_cpu_thread  # the autouse fixture, imported to apply here too
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
RECIPES = {"block": Float8BlockScaling, "mxfp8": MXFP8BlockScaling}
MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t")


def _config(fmt):
    return te.quantizer_config(RECIPES[fmt](), "grad_output")


def _fused(dy, h, act, padded, fmt, columnwise=True):
    return _C._act_bwd(dy, h, act, _config(fmt), None, None, padded, None, columnwise)


def _dh(dy, h, act):
    """dh in h's dtype: torch autograd's where exact (relu, reglu in float32), else the
    activation kernel's."""
    if act in ("relu", "reglu") and h.dtype == torch.float32:
        hh = h.detach().cpu().clone().requires_grad_()
        a, b = hh.chunk(2, -1) if act == "reglu" else (hh, None)
        y = torch.relu(a) * b if act == "reglu" else torch.relu(a)
        y.backward(dy.cpu())
        return hh.grad
    return _C._act_bwd(dy, h, act, None, None, None, 0, None, False)[0].cpu()


def _reference(d, fmt):
    if fmt == "mxfp8":
        return mx_reference(d)
    return {k: v for k, v in block_reference(d, _config(fmt), True, True).items()}


def _assert(outs, want, fmt, what):
    if fmt == "mxfp8":
        _assert_members(outs, want, what)
        return
    from test_quantize_fp8_block import assert_bits
    for name, got in zip(MEMBERS, outs):
        assert_bits(got, want[name], f"{what} {name}")


def _inputs(m, n, act, dtype, device, seed=0):
    k = 2 * n if act in GATED else n
    g = torch.Generator().manual_seed(seed + 1)
    dy = (torch.randn(m, n, generator=g) * torch.logspace(-2, 2, n)).to(dtype).to(device)
    return dy, _h(m, k, dtype, device, seed)


@pytest.mark.parametrize("fmt", ["block", "mxfp8"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
def test_blocks_are_the_reference_of_dh(act, dtype, device, fmt):
    m, n, padded = 150, 96, 160  # partial tiles; MXFP8: columns and padded rows % 32 == 0
    dy, h = _inputs(m, n, act, dtype, device)
    k = h.shape[1]
    d = torch.zeros(padded, k, dtype=dtype)
    d[:m] = _dh(dy, h, act)
    want = _reference(d, fmt)
    outs = _fused(dy, h, act, padded, fmt)
    assert len(outs) == 4 and all(t.device.type == device for t in outs)
    _assert(outs, want, fmt, f"{act} {dtype}")
    rowwise = _fused(dy, h, act, padded, fmt, columnwise=False)
    assert len(rowwise) == 2
    _assert(rowwise, want, fmt, f"{act} {dtype} (rowwise only)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["block", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 32), (128, 128), (300, 1040), (300, 1036), (1024, 4096)])
def test_cuda_is_the_cpu_reference(shape, act, dtype, fmt):
    m, n = shape
    if fmt == "mxfp8" and (2 * n if act in GATED else n) % 32:
        pytest.skip("MXFP8 quantizes columns in multiples of 32")
    dy, h = _inputs(m, n, act, dtype, "cpu", seed=m)
    padded = -(-m // 32) * 32
    want = _fused(dy, h, act, padded, fmt)
    got = _fused(dy.cuda(), h.cuda(), act, padded, fmt)
    for name, a, b in zip(MEMBERS, got, want):
        assert same_bits(a.cpu(), b), f"{name} {shape} {act} {dtype}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["block", "mxfp8"])
@pytest.mark.parametrize("act", ["gelu", "silu", "qgelu", "geglu", "swiglu"])
def test_cuda_table_launch_is_the_cpu_reference(act, fmt):
    # bf16 sigmoid-family activations over enough elements read act_table.cuh's tables in CTAs
    # that take several tiles each
    dy, h = _inputs(4096, 4096, act, torch.bfloat16, "cpu", seed=7)
    h[1, :6] = torch.tensor([float("inf"), -float("inf"), 300.0, -300.0, 1e-6, -1e-38])
    want = _fused(dy, h, act, 4096, fmt)
    got = _fused(dy.cuda(), h.cuda(), act, 4096, fmt)
    for name, a, b in zip(MEMBERS, got, want):
        assert same_bits(a.cpu(), b), f"{name} {act}"


@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    h, dy = torch.randn(4, 256, device=device), torch.randn(4, 128, device=device)
    block = _config("block")
    with pytest.raises(ValueError, match="TQ_ACT_IDENTITY with a BLOCK config is tq_quantize of dy"):
        _C._act_bwd(dy, dy, "identity", block, None, None, 16, None, True)
    with pytest.raises(ValueError, match="dbias_dtype must be None"):
        _C._act_bwd(dy, h, "swiglu", block, None, None, 16, torch.float32, True)
    hybrid = te.quantizer_config(Float8BlockScaling(fp8_format=Format.HYBRID), "grad_output")
    with pytest.raises(NotImplementedError, match="1x128 blocks of E4M3"):
        _C._act_bwd(dy, h, "swiglu", hybrid, None, None, 16, None, True)
    weight = te.quantizer_config(Float8BlockScaling(), "weight")  # 128x128
    with pytest.raises(NotImplementedError, match="this one has 128x128 blocks"):
        _C._act_bwd(dy, h, "swiglu", weight, None, None, 16, None, True)
    with pytest.raises(ValueError, match="padded=2 must be at least the 4 rows"):
        _C._act_bwd(dy, h, "swiglu", block, None, None, 2, None, True)
    with pytest.raises(ValueError, match="columnwise=True needs a quantizer config"):
        _C._act_bwd(dy, h, "swiglu", None, None, None, 0, None, True)
    # the C API's own check: per-tensor outputs beside a block config
    with pytest.raises(ValueError, match="dh was given, but a block-format config writes q"):
        _C._act_backward(dy, h, "swiglu", dh=torch.empty_like(h), config=block)
    assert len(_fused(dy[:0], h[:0], "swiglu", 0, "block")) == 4  # no rows: empty members


# ---- te.LayerNormMLP ----------------------------------------------------------------------------

def _mlp(act, bias, dtype=torch.bfloat16):
    torch.manual_seed(5)
    return te.LayerNormMLP(128, 256, bias=bias, activation=act, params_dtype=dtype)


def _step(m, x, recipe, fused, monkeypatch):
    """y, x.grad and the parameters' gradients under recipe; fused: the backward's block pass
    on (else off: fc1 asks nothing), and the block-format activation backwards that ran."""
    calls = []
    into = _act_fn._backward_into

    def spy(*args):
        calls.append(args[3])  # recipe_id: fc1's grad_output quantized here
        return into(*args)
    monkeypatch.setattr(_act_fn, "_backward_into", spy)
    if not fused:
        monkeypatch.setattr(_act_fn.GradOutput, "ask", lambda *a, **k: None)
    xi = x.clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = m(xi)
    y.float().square().sum().backward()
    out = [y.detach(), xi.grad] + [p.grad.clone() for p in m.parameters() if p.grad is not None]
    m.zero_grad(set_to_none=True)
    monkeypatch.undo()
    return out, [c for c in calls if c is not None]


@pytest.mark.parametrize("recipe", ["block", "mxfp8"])
@pytest.mark.parametrize("act", _act_fn.BLOCK_DH)
def test_layernorm_mlp_backward_writes_fc1s_blocks(act, recipe, monkeypatch):
    m = _mlp(act, bias=False)
    x = torch.randn(3, 37, 128).to(torch.bfloat16)  # 111 tokens: padded rows
    fused, calls = _step(m, x, RECIPES[recipe](), True, monkeypatch)
    assert calls, "the activation's backward did not write fc1's blocks"
    unfused, off_calls = _step(m, x, RECIPES[recipe](), False, monkeypatch)
    assert not off_calls
    names = ["y", "x.grad"] + [n for n, _ in m.named_parameters()]
    for name, a, b in zip(names, fused, unfused):
        assert same_bits(a, b), f"{act} {recipe} {name}"


@pytest.mark.parametrize("act,bias", [("relu", True), ("gelu", False), ("silu", False),
                                      ("swiglu", False), ("qgelu", False), ("geglu", False)])
def test_layernorm_mlp_not_asked(act, bias, monkeypatch):
    # a learning fc1 bias (its gradient is te.Linear's dy sum), an activation torch computes, or
    # one whose fused pass is slower than fc1's own quantization (the table's: NOTES.md)
    m = _mlp(act, bias=bias)
    x = torch.randn(40, 128).to(torch.bfloat16)
    _, calls = _step(m, x, Float8BlockScaling(), True, monkeypatch)
    assert calls == []


def test_layernorm_mlp_float16_not_asked(monkeypatch):
    # float16's fused pass measured slower than fc1's own quantization (NOTES.md)
    m = _mlp("relu", bias=False, dtype=torch.float16)
    _, calls = _step(m, torch.randn(40, 128).half(), Float8BlockScaling(), True, monkeypatch)
    assert calls == []


def test_layernorm_mlp_frozen_fc1_weight(monkeypatch):
    # no wgrad: the rowwise blocks alone
    m = _mlp("reglu", bias=False)
    m.fc1.weight.requires_grad_(False)
    x = torch.randn(64, 128).to(torch.bfloat16)
    fused, calls = _step(m, x, Float8BlockScaling(), True, monkeypatch)
    assert calls
    unfused, _ = _step(m, x, Float8BlockScaling(), False, monkeypatch)
    for a, b in zip(fused, unfused):
        assert same_bits(a, b)
