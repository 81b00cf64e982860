"""tq_act_forward with an MXFP8BlockScaling config (1x32 E4M3 blocks, E8M0 exponents): the
activation's pass writes fc2's MXFP8 blocks in both directions (csrc/core/act.c,
csrc/ref/act_forward_ref.c, cuda/act_quantize_mxfp8.cu with cuda/act_load.cuh's loader,
_C._act_fwd, python/tequant/_act_fn.py).

- The members are the independent torch reference's (tests/test_quantize_mxfp8.py: torch casts
  and math) of the activation rounded to h's dtype, zero rows appended up to `padded`: torch's
  own activation where it is exact (relu, srelu, reglu), else the activation kernel's y_hp (whose
  arithmetic tests/test_act_kernels.py checks). CPU and CUDA; CUDA bit-exact against the CPU
  reference, every activation and dtype, partial tiles, and the bf16 table launches (several
  tiles per CTA) with values outside the table's window.
- Bad input: 2D or E5M2 configs, columns or padded rows off the multiple of 32, unaligned
  members through the C API: clear errors.
- te.LayerNormMLP under MXFP8BlockScaling: eager fused against unfused in test_act_block.py;
  compiled (aot_eager, fullgraph) bit-identical to eager here.
"""
import os
import sys

import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import Format, MXFP8BlockScaling

sys.path.insert(0, os.path.dirname(__file__))
from test_act_block import ACTS, GATED, TORCH_EXACT, _act_hp, _h, _mlp, _run  # noqa: E402
from test_fused_norm_modules import same_bits  # noqa: E402
from test_linear import one_cpu_thread  # noqa: E402
from test_quantize_mxfp8 import ref_columnwise, ref_rowwise  # noqa: E402

assert one_cpu_thread  # the autouse fixture, imported to apply here too
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t")


def _config():
    return te.quantizer_config(MXFP8BlockScaling(), "input")


def _fused(h, act, padded, columnwise=True, config=None):
    return _C._act_fwd(h, act, False, config or _config(), None, None, padded, columnwise)


def _reference(y):
    """The four raw members of y's MXFP8 quantization: codes [M, N] and [N, M], exponents
    block-major as stored ([N/32, M] and [M/32, N])."""
    data, e = ref_rowwise(y, "E4M3")
    data_t, e_t = ref_columnwise(y, "E4M3")
    return {"data": data, "scale_inv": e.t().contiguous(), "data_t": data_t,
            "scale_inv_t": e_t.t().contiguous()}


def _assert_members(outs, want, what):
    for name, got in zip(MEMBERS, outs):
        w = want[name]
        got = got.cpu().view(torch.uint8)
        assert got.shape == w.shape, f"{what} {name}: {tuple(got.shape)} != {tuple(w.shape)}"
        bad = (got != w).nonzero()
        assert bad.numel() == 0, f"{what} {name} differs at {bad[:3].tolist()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
def test_members_are_the_reference_of_the_activation(act, dtype, device):
    m, n = 150, 160  # partial 128x128 tiles both ways; padded rows past m
    k = 2 * n if act in GATED else n
    h = _h(m, k, dtype, device)
    padded = 160
    outs = _fused(h, act, padded)
    y = torch.zeros(padded, n, dtype=dtype)
    y[:m] = _act_hp(h, act).cpu()
    want = _reference(y)
    assert len(outs) == 4 and all(o.device.type == device for o in outs)
    _assert_members(outs, want, f"{act} {dtype}")
    rowwise = _fused(h, act, padded, columnwise=False)
    assert len(rowwise) == 2
    _assert_members(rowwise, want, f"{act} {dtype} (rowwise only)")


@pytest.mark.parametrize("act", ["relu", "srelu", "reglu"])
def test_exact_activations_against_torch_in_half_precision(act):
    h = _h(64, 512 if act in GATED else 256, torch.bfloat16, "cpu", seed=3)
    y = TORCH_EXACT[act](h.float()).to(torch.bfloat16)  # one rounding, as the kernel's
    _assert_members(_fused(h, act, 64), _reference(y), act)


def test_the_members_are_te_ops_quantize_of_y_hp():
    # the same bits as te.Linear's own quantization of the unfused activation's output
    h = _h(96, 384, torch.bfloat16, "cpu", seed=5)
    y = _act_hp(h, "swiglu")
    q = te.ops.quantize(y, MXFP8BlockScaling(), "input", rowwise=True, columnwise=True)
    outs = _fused(h, "swiglu", 96)
    assert torch.equal(outs[0].view(torch.uint8), q.codes("rowwise"))
    assert torch.equal(outs[2].view(torch.uint8), q.codes("columnwise"))
    assert torch.equal(outs[1].view(torch.uint8).t(), q.scales("rowwise").view(torch.uint8))
    assert torch.equal(outs[3].view(torch.uint8).t(), q.scales("columnwise").view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 32), (128, 128), (300, 1056), (1024, 4096)])
def test_cuda_is_the_cpu_reference(shape, act, dtype):
    m, n = shape
    k = 2 * n if act in GATED else n
    h = _h(m, k, dtype, "cpu", seed=m)
    padded = -(-m // 32) * 32
    want = _fused(h, act, padded)
    got = _fused(h.cuda(), act, padded)
    for name, a, b in zip(MEMBERS, got, want):
        assert same_bits(a.cpu(), b), f"{name} {shape}"


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
        assert same_bits(a.cpu(), b), f"{name} {act}"


@pytest.mark.parametrize("device", DEVICES)
def test_errors(device):
    h = torch.randn(4, 256, device=device)
    hybrid = te.quantizer_config(MXFP8BlockScaling(fp8_format=Format.HYBRID), "grad_output")
    with pytest.raises(NotImplementedError, match="fused as 1x32 blocks of E4M3"):
        _fused(h, "gelu", 32, config=hybrid)
    two_d = te.quantizer_config(MXFP8BlockScaling(enable_2d_quantization=True), "weight")
    with pytest.raises(NotImplementedError, match="an MXFP8 config is fused as 1x32"):
        _fused(h, "gelu", 32, config=two_d)
    with pytest.raises(ValueError, match="multiples of 32"):
        _fused(h, "gelu", 20)  # padded rows off the multiple
    with pytest.raises(ValueError, match="multiples of 32"):
        _fused(torch.randn(4, 80, device=device), "gelu", 32)
    with pytest.raises(ValueError, match="TQ_ACT_IDENTITY with an MXFP8 config"):
        _fused(h, "identity", 32)
    with pytest.raises(ValueError, match="padded=2 must be at least the 4 rows"):
        _fused(h, "gelu", 2)
    assert len(_fused(h[:0], "gelu", 0)) == 4  # no rows: empty members


# ---- te.LayerNormMLP (eager: test_act_block.test_layernorm_mlp_fused_blocks) ------------------

@pytest.mark.parametrize("act", ["swiglu", "relu"])
def test_compiled_layernorm_mlp_is_eager(act, monkeypatch):
    torch._dynamo.reset()
    m = _mlp(act, "cpu")
    x = torch.randn(2, 40, 128).to(torch.bfloat16)
    eager = _run(m, x, True, monkeypatch, MXFP8BlockScaling())
    compiled = _run(m, x, True, monkeypatch, MXFP8BlockScaling(), compiled=True)
    names = ["y", "x.grad"] + [n for n, _ in m.named_parameters()]
    for name, a, b in zip(names, compiled, eager):
        assert same_bits(a, b), f"{act} {name}"
