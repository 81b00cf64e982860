"""tq_act_forward with a Float8BlockScaling config (1x128 E4M3 blocks): the activation's pass
writes fc2's blocks in both directions (csrc/core/act.c, csrc/ref/act_forward_ref.c,
cuda/act_quantize_block.cu, _C._act_fwd, python/tequant/_act_fn.py).

- The blocks are the independent torch reference's (tests/test_quantize_fp8_block.py: torch
  casts and math) of the activation rounded to h's dtype, zero rows appended up to `padded`:
  torch's own activation where it is exact (relu, srelu, reglu; float32 and every dtype), else
  the activation kernel's y_hp (whose arithmetic tests/test_act_kernels.py checks). CPU and CUDA,
  CUDA bit-exact against the CPU reference, every activation and dtype, partial blocks, and the
  bf16 table launches (several tiles per CTA) with values outside the table's window.
- Bad input: a config of another block shape or format, identity, y_hp, no q: clear errors.
- te.LayerNormMLP under Float8BlockScaling and MXFP8BlockScaling (eager): outputs and gradients
  bit-identical to the same module with the fusion off (the activation kernel's y_hp quantized
  by fc2's te.Linear); gelu / silu fuse for bfloat16 h only (their table: _act_fn.beats_torch),
  float32 ones stay torch's activation and fc2's quantization.
"""
import os
import sys

import pytest
import torch

import tequant as te
from tequant import _C, _act_fn
from tequant.recipe import DelayedScaling, Float8BlockScaling, Format, MXFP8BlockScaling

sys.path.insert(0, os.path.dirname(__file__))
from test_quantize_fp8_block import assert_bits, reference  # noqa: E402
from test_fused_norm_modules import same_bits  # noqa: E402
from test_linear import one_cpu_thread  # noqa: E402

assert one_cpu_thread  # the autouse fixture, imported to apply here too
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ACTS = ["gelu", "relu", "silu", "qgelu", "srelu", "geglu", "reglu", "swiglu"]
GATED = ("geglu", "reglu", "swiglu")
TORCH_EXACT = {"relu": torch.relu, "srelu": lambda v: torch.relu(v).square(),
               "reglu": lambda v: torch.relu(v.chunk(2, -1)[0]) * v.chunk(2, -1)[1]}
MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t")


def _config():
    return te.quantizer_config(Float8BlockScaling(), "input")


def _h(m, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, k, generator=g) * 3
    h[0, :7] = torch.tensor([0.0, -0.0, 1e-30, -1e4, 6e4, 0.5, -3.0])  # zeros, tiny, large
    # blocks of very different magnitudes: each 1x128 / 128x1 block gets its own scale
    h = h * torch.logspace(-3, 3, k).repeat(m, 1)[:, torch.randperm(k, generator=g)]
    return h.to(dtype).to(device)


def _act_hp(h, act):
    """act(h) in h's dtype: torch's where exact, else the activation kernel's y_hp."""
    if act in TORCH_EXACT and h.dtype == torch.float32:  # on the CPU: torch's CUDA relu
        return TORCH_EXACT[act](h.cpu())  # may turn -0 into +0, its CPU one keeps it (as ours)
    return _C._act_fwd(h, act, True, None, None, None, 0, False)[0]


def _fused(h, act, padded, columnwise=True):
    return _C._act_fwd(h, act, False, _config(), None, None, padded, columnwise)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
def test_blocks_are_the_reference_of_the_activation(act, dtype, device):
    m, n = 150, 200  # partial blocks both ways
    k = 2 * n if act in GATED else n
    h = _h(m, k, dtype, device)
    padded = 160
    outs = _fused(h, act, padded)
    y = torch.zeros(padded, n, dtype=dtype)
    y[:m] = _act_hp(h, act).cpu()
    want = reference(y, _config(), True, True)
    assert len(outs) == 4
    for name, got in zip(MEMBERS, outs):
        assert got.device.type == device
        assert_bits(got, want[name], f"{act} {dtype} {name}")
    rowwise = _fused(h, act, padded, columnwise=False)
    assert len(rowwise) == 2
    for name, got in zip(MEMBERS, rowwise):
        assert_bits(got, want[name], f"{act} {dtype} {name} (rowwise only)")


@pytest.mark.parametrize("act", ["relu", "srelu", "reglu"])
def test_exact_activations_against_torch_in_half_precision(act):
    h = _h(64, 512 if act in GATED else 256, torch.bfloat16, "cpu", seed=3)
    y = TORCH_EXACT[act](h.float()).to(torch.bfloat16)  # one rounding, as the kernel's
    want = reference(y, _config(), True, True)
    for name, got in zip(MEMBERS, _fused(h, act, 64)):
        assert_bits(got, want[name], name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 8), (128, 128), (300, 1030), (1024, 4096)])
def test_cuda_is_the_cpu_reference(shape, act, dtype):
    m, n = shape
    k = 2 * n if act in GATED else n
    h = _h(m, k, dtype, "cpu", seed=m)
    padded = -(-m // 16) * 16
    want = _fused(h, act, padded)
    got = _fused(h.cuda(), act, padded)
    for name, a, b in zip(MEMBERS, got, want):
        assert_bits(a, b, f"{name} {shape}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("act", ["gelu", "silu", "qgelu", "geglu", "swiglu"])
def test_cuda_table_launch_is_the_cpu_reference(act):
    # bf16 sigmoid-family activations over enough elements read act_table.cuh's table, in CTAs
    # that take several tiles each (16.8M elements: 1024 tiles)
    m, n = 4096, 4096
    h = _h(m, 2 * n if act in GATED else n, torch.bfloat16, "cpu", seed=7)
    h[1, :6] = torch.tensor([float("inf"), -float("inf"), 300.0, -300.0, 1e-6, -1e-38])
    want = _fused(h, act, m)
    got = _fused(h.cuda(), act, m)
    for name, a, b in zip(MEMBERS, got, want):
        assert_bits(a, b, f"{name} {act}")


@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    h = torch.randn(4, 256, device=device)
    hybrid = te.quantizer_config(Float8BlockScaling(fp8_format=Format.HYBRID), "grad_output")
    with pytest.raises(NotImplementedError, match="1x128 blocks of E4M3"):
        _C._act_fwd(h, "gelu", False, hybrid, None, None, 16, True)
    weight = te.quantizer_config(Float8BlockScaling(), "weight")  # 128x128
    with pytest.raises(NotImplementedError, match="this one has 128x128 blocks of float8_e4m3"):
        _C._act_fwd(h, "gelu", False, weight, None, None, 16, True)
    with pytest.raises(ValueError, match="TQ_ACT_IDENTITY with a BLOCK config"):
        _C._act_fwd(h, "identity", False, _config(), None, None, 16, True)
    with pytest.raises(ValueError, match="y_hp was given, but a block-format config writes q"):
        _C._act_fwd(h, "gelu", True, _config(), None, None, 16, True)
    with pytest.raises(ValueError, match="padded=2 must be at least the 4 rows"):
        _C._act_fwd(h, "gelu", False, _config(), None, None, 2, True)
    # the C API's own checks of q (no allocating caller gets these wrong)
    out = torch.empty(4, 256, device=device)
    with pytest.raises(ValueError, match="y_hp was given"):
        _C._act_forward(h, "gelu", y_hp=out, config=_config())
    assert len(_fused(h[:0], "gelu", 0)) == 4  # no rows: empty members


# ---- te.LayerNormMLP ----------------------------------------------------------------------------

def _mlp(activation, device, dtype=torch.bfloat16):
    torch.manual_seed(4)
    m = te.LayerNormMLP(128, 256, activation=activation, params_dtype=dtype, device=device)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.5)
    return m


def _run(m, x, fused, monkeypatch, recipe=None, compiled=False):
    """y, x's and the parameters' gradients of m(x) under recipe (Float8BlockScaling), with the
    activation's block-format pass or (not fused) without it, fc2 then quantizing the
    activation kernel's output (torch's runs gelu / silu unfused); compiled: aot_eager,
    fullgraph."""
    recipe = recipe or Float8BlockScaling()
    if not fused:
        off = te.quantizer_config(recipe, "input").scaling
        monkeypatch.setattr(_act_fn.ActInput, "fusable",
                            lambda self, scaling, *a, **k: False if scaling == off else None)
        monkeypatch.setattr(_act_fn.ActInput, "high_precision",
                            lambda self: _act_fn.kernel_activate(self.h, self.activation, self.dh))
    xi = x.clone().requires_grad_()
    fn = torch.compile(m, backend="aot_eager", fullgraph=True) if compiled else m
    with te.autocast(recipe=recipe):
        y = fn(xi)
    y.float().square().sum().backward()
    grads = [y.detach(), xi.grad] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    monkeypatch.undo()
    return grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("recipe", [Float8BlockScaling, MXFP8BlockScaling])
def test_layernorm_mlp_fused_blocks(recipe, act, device, monkeypatch):
    m = _mlp(act, device)
    x = torch.randn(3, 37, 128, device=device).to(torch.bfloat16)  # 111 tokens: padded rows
    calls = []
    real = _act_fn._act_apply  # (ActFunction's apply, as the module calls it)
    monkeypatch.setattr(_act_fn, "_act_apply", lambda *a: calls.append(a[5]) or real(*a))
    fused = _run(m, x, True, monkeypatch, recipe())
    assert calls and calls[0] is not None, "the activation did not write fc2's blocks"
    unfused = _run(m, x, False, monkeypatch, recipe())
    names = ["y", "x.grad"] + [n for n, _ in m.named_parameters()]
    for name, a, b in zip(names, fused, unfused):
        assert same_bits(a, b), f"{act} {name}"


@pytest.mark.parametrize("act", _act_fn.ARITHMETIC_BOUND)
@pytest.mark.parametrize("recipe", [Float8BlockScaling, MXFP8BlockScaling])
def test_float32_arithmetic_bound_activations_stay_torchs(recipe, act, monkeypatch):
    """float32 h has no table: torch's gelu / silu, then fc2's own quantization (faster)."""
    m = _mlp(act, "cpu", torch.float32)
    x = torch.randn(2, 24, 128)
    calls = []
    real = _act_fn._act_apply
    monkeypatch.setattr(_act_fn, "_act_apply", lambda *a: calls.append(a[5]) or real(*a))
    with te.autocast(recipe=recipe()):
        m(x).sum().backward()
    assert calls == [], f"float32 {act} ran the activation kernels under {recipe.__name__}"


def test_layernorm_mlp_other_recipes_and_no_grad_unchanged():
    m = _mlp("swiglu", "cpu")
    x = torch.randn(20, 128).to(torch.bfloat16)
    with torch.no_grad(), te.autocast(recipe=Float8BlockScaling()):
        y = m(x)  # inference: the rowwise blocks only
    with te.autocast(recipe=Float8BlockScaling()):
        y2 = m(x)
    assert same_bits(y, y2)
    with te.autocast(recipe=DelayedScaling()):
        assert m(x).shape == y.shape
