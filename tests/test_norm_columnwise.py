"""The norm forward's columnwise codes (issue 24 item 2): tq_norm_forward's y_q_t, the FP8 codes of
the norm output transposed ([K, M], wgrad's operand), written by the norm's own pass.

CPU: the C reference's y_q_t against torch's transpose of its y_q (an independent layout check:
y_q itself is tested against torch's norm + te.ops.quantize in test_norm_kernels.py), with ld > M
and the columns past M untouched; argument errors. GPU (marked): y_q_t bit for bit against the CPU
reference in both forms: fast_kernel's kColT form (16-bit x, M % 32 == 0, K <= 4096, E4M3 codes
without y_hp: delayed scaling's pass and current scaling's cast pass) with more tiles than the
grid holds, and the fallback (a transpose after the norm) for every shape the kColT form does not
take. Module level: te.LayerNormLinear / LayerNormMLP keep their bits (tests/test_fused_norm_modules.py,
test_fused_norm_compile.py compare fused and unfused, eager and compiled), and _C._norm_fwd's
columnwise output is checked here against its rowwise one.
"""
import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import DelayedScaling, Float8CurrentScaling, Format

from test_norm_kernels import assert_same_bits, bits, fast_case, forward, to_cuda

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
NORMS = ["LayerNorm", "RMSNorm"]
CFG_E4M3 = (DelayedScaling(), "input")
PAD = 24  # y_q_t's ld exceeds M by this (a view of a wider buffer)


def with_t(x, gamma, norm, kw, pad=PAD):
    """forward(...) with y_q_t: a poisoned [K, M + pad] buffer whose first M columns are the
    output; returns the outputs and the whole buffer."""
    m, k = x.shape
    buf = torch.full((k, m + pad), 0xAB, dtype=torch.uint8, device=x.device)
    out = forward(x, gamma, norm, **kw, y_q_t=buf[:, :m])
    out["y_q_t"] = buf
    return out


def modes(x, gamma, norm, beta):
    """Delayed scaling's pass (codes + amax, with and without stats) and current scaling's cast
    pass (codes alone, with rstd): the kColT form's write modes; E5M2 and y_hp (fallback)."""
    amax = forward(x.cpu(), gamma.cpu(), norm, beta=None if beta is None else beta.cpu(),
                   want=("amax",))["amax"]
    current = (Float8CurrentScaling(), "input")
    return [
        ("delayed", dict(beta=beta, cfg=CFG_E4M3, scale=torch.tensor([20.0]), amax0=0.5,
                         want=("amax",))),
        ("delayed+stats", dict(beta=beta, cfg=CFG_E4M3, scale=torch.tensor([3.0]),
                               want=("mean", "rstd", "amax"))),
        ("current cast", dict(beta=beta, cfg=current, amax_in=amax, want=())),
        ("current cast+rstd", dict(beta=beta, cfg=current, amax_in=amax, want=("rstd",))),
        ("e5m2", dict(beta=beta, cfg=(DelayedScaling(fp8_format=Format.HYBRID), "grad_output"),
                      scale=torch.tensor([900.0]), want=("rstd",))),
        ("with y_hp", dict(beta=beta, cfg=CFG_E4M3, scale=torch.tensor([20.0]),
                           want=("y_hp", "amax"))),
    ]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("m, k", [(16, 64), (5, 40), (33, 8), (1, 1), (0, 16)])
def test_cpu_y_q_t_is_y_q_transposed(norm, m, k):
    """The reference writes y_q transposed into y_q_t's first M columns and leaves the others."""
    x, gamma, beta = fast_case(m, k, torch.bfloat16, norm, 1)
    for label, kw in modes(x, gamma, norm, beta):
        out = with_t(x, gamma, norm, kw)
        assert torch.equal(out["y_q_t"][:, :m], out["y_q"].t()), label
        assert bool((out["y_q_t"][:, m:] == 0xAB).all()), label
        without = forward(x, gamma, norm, **kw)  # y_q_t changes nothing else
        assert_same_bits(out, without, label)


def test_errors_y_q_t():
    x, gamma, _, _ = make_x()
    codes, sinv = torch.empty(4, 16, dtype=torch.uint8), torch.empty(1)
    cfg = te.quantizer_config(*CFG_E4M3)
    with pytest.raises(ValueError, match="y_q_t was given, but it is y_q transposed"):
        _C._norm_forward(x, gamma, "LayerNorm", y_q_t=torch.empty(16, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="a config needs both y_q and scale_inv"):
        _C._norm_forward(x, gamma, "LayerNorm", config=cfg, scale_inv=sinv, scale=torch.ones(1),
                         y_q_t=torch.empty(16, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="y_q_t is uint8 \\[4, 16\\]; expected float8_e4m3 "
                                         "\\[16, 4\\] like x transposed"):
        _C._norm_forward(x, gamma, "LayerNorm", config=cfg, y_q=codes, scale_inv=sinv,
                         scale=torch.ones(1), y_q_t=codes)
    with pytest.raises(ValueError, match="y_q_t has dtype float32; expected one of: float8_e4m3"):
        _C._norm_forward(x, gamma, "LayerNorm", config=cfg, y_q=codes, scale_inv=sinv,
                         scale=torch.ones(1), y_q_t=torch.empty(16, 4))


def make_x():
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 16, generator=g), torch.rand(16, generator=g) + 0.5, None, None


@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("m", [20, 32])
def test_norm_fwd_columnwise_output(scaling, m):
    """_C._norm_fwd(columnwise=True) appends the codes transposed, [K, padded], zero past M, and
    its other outputs keep their bits."""
    x, gamma, beta = fast_case(m, 48, torch.bfloat16, "LayerNorm", 0)
    recipe = DelayedScaling() if scaling == "delayed" else Float8CurrentScaling()
    cfg = te.quantizer_config(recipe, "input")
    scale = torch.tensor([4.0]) if scaling == "delayed" else None
    padded = 32

    def run(columnwise):
        slot = torch.zeros(1) if scaling == "delayed" else None
        return _C._norm_fwd(x, gamma, beta, "LayerNorm", 1e-5, False, False, True, cfg, scale,
                            slot, padded, columnwise)

    plain, both = run(False), run(True)
    assert len(both) == len(plain) + 1
    for a, b in zip(plain, both):  # bits: row 4 holds a NaN
        assert torch.equal(bits(a), bits(b))
    codes, codes_t = both[-4], both[-1]
    assert codes_t.shape == (48, padded) and codes_t.dtype == codes.dtype
    assert torch.equal(bits(codes_t), bits(codes).t())  # rows past M of codes are zero: so are these


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", NORMS)
def test_cuda_kernel_writes_y_q_t(dtype, norm):
    """fast_kernel's kColT form, every row-length variant it takes (K <= 4096, whole and partial
    last chunks of a thread), both scalings' passes, bit for bit against the reference; the
    E5M2 and y_hp modes, K > 4096 and M % 32 != 0 go through the transpose."""
    for i, k in enumerate([8, 512, 1000, 1024, 1536, 2048, 3072, 4096, 6000, 8192]):
        x, gamma, beta = fast_case(64 if i % 4 else 48, k, dtype, norm, i)
        for label, kw in modes(x, gamma, norm, beta):
            want = with_t(x, gamma, norm, kw)
            got = with_t(x.cuda(), gamma.cuda(), norm, to_cuda(kw))
            assert_same_bits(got, want, (k, label))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m, k, dtype, pad", [
    (8192, 512, torch.bfloat16, 0),     # more tiles (512) than a CTA wave at K = 512
    (4096, 4096, torch.bfloat16, 16),   # the largest K the form takes, 128 tiles
    (2048, 3072, torch.float16, 8),     # 64 tiles, partial chunks of a thread
    (2048, 8192, torch.float16, 8),     # K > 4096: transpose
    (112, 1024, torch.bfloat16, 0),     # M % 32 != 0: transpose
    (64, 1024, torch.float32, 0),       # FP32 x: transpose
    (64, 1024, torch.bfloat16, 4),      # ld % 8 != 0: transpose
])
def test_cuda_y_q_t_shapes(m, k, dtype, pad):
    x, gamma, beta = fast_case(m, k, dtype, "LayerNorm", 2)
    for label, kw in modes(x, gamma, "LayerNorm", beta)[:3]:
        want = with_t(x, gamma, "LayerNorm", kw, pad)
        got = with_t(x.cuda(), gamma.cuda(), "LayerNorm", to_cuda(kw), pad)
        assert_same_bits(got, want, (m, k, label))
