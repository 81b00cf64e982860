"""The activation forward's columnwise codes (issue 24 item 2): tq_act_forward's y_q_t, fc2's FP8
input codes transposed ([N, M], wgrad's operand), written by the activation's own pass.

CPU: the C reference's y_q_t against torch's transpose of its y_q (an independent layout check:
y_q itself is tested against torch's activations + te.ops.quantize in test_act_kernels.py), with
ld > M and the columns past M untouched, every activation; argument errors; _C._act_fwd's
columnwise output against its rowwise one. GPU (marked): y_q_t bit for bit against the CPU
reference in both forms: act_forward.cu's colt_kernel (16-bit h, codes without y_hp, M % 32 == 0,
N % 256 == 0; the table launches of bf16 gelu / silu / qgelu and the plain ones) with several
tiles per CTA, and the transpose after the pass for every other shape. The modules' bits
(te.LayerNormMLP fused vs unfused, eager vs compiled) are tests/test_fused_act_modules.py's.
"""
import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import DelayedScaling, Float8CurrentScaling

from test_act_kernels import ACTS, CFG_E4M3, CFG_E5M2, CURRENT, forward, gpu_inputs, out_cols
from test_norm_kernels import assert_same_bits, bits, to_cuda

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
PAD = 24


def with_t(h, act, kw, pad=PAD):
    """forward(...) with y_q_t: a poisoned [N, M + pad] buffer whose first M columns are the
    output; returns the outputs and the whole buffer."""
    m, n = h.shape[0], out_cols(act, h.shape[1])
    buf = torch.full((n, m + pad), 0xAB, dtype=torch.uint8, device=h.device)
    out = forward(h, act, **kw, y_q_t=buf[:, :m])
    out["y_q_t"] = buf
    return out


def modes(h, act):
    """Delayed scaling's pass (codes + amax), current scaling's cast pass (codes alone): the
    colt form's cases; E5M2 codes, and codes with y_hp (the transpose after the pass)."""
    amax = forward(h.cpu(), act, want=("amax",))["amax"]
    return [("delayed", dict(cfg=CFG_E4M3, scale=torch.tensor([20.0]), amax0=0.5,
                             want=("amax",))),
            ("current cast", dict(cfg=CURRENT, amax_in=amax, want=())),
            ("e5m2", dict(cfg=CFG_E5M2, scale=torch.tensor([900.0]), want=("amax",))),
            ("with y_hp", dict(cfg=CFG_E4M3, scale=torch.tensor([20.0]), want=("y_hp", "amax")))]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("m, k", [(32, 512), (5, 40), (0, 16)])
def test_cpu_y_q_t_is_y_q_transposed(act, m, k):
    h, _ = gpu_inputs(m, k, act, torch.bfloat16, seed=4)
    for label, kw in modes(h, act):
        out = with_t(h, act, kw)
        assert torch.equal(out["y_q_t"][:, :m], out["y_q"].t()), label
        assert bool((out["y_q_t"][:, m:] == 0xAB).all()), label
        assert_same_bits(out, forward(h, act, **kw), label)  # y_q_t changes nothing else


def test_errors_y_q_t():
    h = torch.randn(4, 16)
    cfg = te.quantizer_config(*CFG_E4M3)
    codes, sinv, one = torch.empty(4, 16, dtype=torch.uint8), torch.empty(1), torch.ones(1)
    with pytest.raises(ValueError, match="y_q_t was given, but it is y_q transposed"):
        _C._act_forward(h, "gelu", y_q_t=torch.empty(16, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="y_q_t is uint8 \\[4, 16\\]; expected float8_e4m3 "
                                         "\\[16, 4\\] like act\\(h\\) transposed"):
        _C._act_forward(h, "gelu", config=cfg, y_q=codes, scale_inv=sinv, scale=one,
                        y_q_t=codes)
    with pytest.raises(ValueError, match="y_q_t is uint8 \\[16, 4\\]; expected float8_e4m3 "
                                         "\\[8, 4\\]"):  # gated: N = K / 2
        _C._act_forward(h, "swiglu", config=cfg, y_q=codes[:, :8], scale_inv=sinv, scale=one,
                        y_q_t=torch.empty(16, 4, dtype=torch.uint8))
    block = te.quantizer_config(te.recipe.Float8BlockScaling(), "input")
    with pytest.raises(ValueError, match="y_q_t was given, but a block-format config writes q"):
        q = _C._act_fwd(h, "relu", False, block, None, None, 4, False)
        _C._act_forward(h, "relu", config=block, y_q_t=torch.empty(16, 4, dtype=torch.uint8))
    assert q  # the block path itself runs


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()])
@pytest.mark.parametrize("act", ["relu", "swiglu"])
def test_act_fwd_columnwise_output(recipe, act):
    """_C._act_fwd(columnwise=True) appends the codes transposed, [N, padded], zero past M, and
    its other outputs keep their bits."""
    h, _ = gpu_inputs(20, 64, act, torch.bfloat16, seed=5)
    cfg = te.quantizer_config(recipe, "input")
    scale = torch.tensor([4.0]) if isinstance(recipe, DelayedScaling) else None

    def run(columnwise):
        slot = torch.zeros(1) if scale is not None else None
        return _C._act_fwd(h, act, False, cfg, scale, slot, 32, columnwise)

    plain, both = run(False), run(True)
    assert len(both) == len(plain) + 1
    for a, b in zip(plain, both):
        assert torch.equal(bits(a), bits(b))
    codes, codes_t = both[0], both[-1]
    assert codes_t.shape == (out_cols(act, 64), 32) and codes_t.dtype == codes.dtype
    assert torch.equal(bits(codes_t), bits(codes).t())  # rows past M of codes are zero


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_writes_y_q_t(act, dtype):
    """Shapes the colt form takes (several tiles per CTA at 4096 x 1024 outputs; the table
    launch of bf16 gelu / silu / qgelu at the larger one) and ones it does not (M % 32 != 0,
    N % 256 != 0), every mode, bit for bit against the reference."""
    for m, n in [(64, 256), (4096, 1024), (40, 512), (64, 200)]:
        k = 2 * n if act in ("geglu", "reglu", "swiglu") else n
        h, _ = gpu_inputs(m, k, act, dtype, seed=m + n)
        for label, kw in modes(h, act):
            want = with_t(h, act, kw)
            got = with_t(h.cuda(), act, to_cuda(kw))
            assert_same_bits(got, want, (m, n, label))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("pad", [0, 8, 4])
def test_cuda_y_q_t_ld(pad):
    """y_q_t's row stride: M (contiguous), M + 8, and M + 4 (not 8-byte aligned: the transpose)."""
    h, _ = gpu_inputs(256, 512, "gelu", torch.bfloat16, seed=9)
    for label, kw in modes(h, "gelu")[:2]:
        want = with_t(h, "gelu", kw, pad)
        got = with_t(h.cuda(), "gelu", to_cuda(kw), pad)
        assert_same_bits(got, want, (pad, label))
