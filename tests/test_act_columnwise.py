"""The activation backward's columnwise codes (tq_act_backward's dh_q_t): the transpose of its
rowwise FP8 codes, which the identity (tq_quantize's DelayedScaling dbias pass, te.Linear's
grad_output) writes in its own pass and the activations by a transpose after it.

CPU: the C reference's dh_q_t is dh_q transposed byte for byte (torch's .t(), independent of the
C code), dh_q and the other outputs unchanged by asking for it, for every activation and the
identity, delayed E4M3 / E5M2 and current codes, a strided dh_q_t (its padding untouched);
argument errors. GPU (marked, skipped without CUDA): the kernels against the reference bit for
bit over the row groupings the identity's pass has (dbias row chunks of 4, 8, 16, 32 and 64
rows, no dbias, rows not a multiple of 16, aligned and strided dh_q_t), and tq_quantize with
dbias against tq_quantize without.
"""
import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import DelayedScaling
from test_act_kernels import (ACTS, CFG_E4M3, CFG_E5M2, CURRENT, _fp8_kwargs, _poisoned,
                              backward, gpu_inputs, strided)
from test_norm_kernels import assert_same_bits, to_cuda

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
MODES = {"delayed-e4m3": dict(cfg=CFG_E4M3, scale=torch.tensor([20.0])),
         "delayed-e5m2": dict(cfg=CFG_E5M2, scale=torch.tensor([900.0]))}


def with_columnwise(dy, h, act, cfg, scale=None, amax_in=None, want=("dh", "amax", "dbias"),
                    layout_t=None):
    """test_act_kernels.backward() with dh_q_t [K, M] too: every output poisoned (NaN / 0xAB),
    dh_q_t optionally a strided view."""
    m, k = h.shape
    dev = h.device
    out = {"dh": _poisoned((m, k), h.dtype, dev, float("nan"), None)} if "dh" in want else {}
    if "amax" in want:
        out["amax"] = torch.zeros(1, device=dev)
    if "dbias" in want:
        out["dbias"] = torch.full((k,), float("nan"), device=dev)
    out["dh_q_t"] = _poisoned((k, m), torch.uint8, dev, 0xAB, layout_t)
    kw = dict(out)
    _fp8_kwargs(out, kw, cfg, (m, k), dev, scale, amax_in, None, "dh_q")
    _C._act_backward(dy, h, act, **kw)
    return out


def inputs(m, k, act, dtype, seed):
    """(h, dy); the identity reads dy alone (h is dy)."""
    h, dy = gpu_inputs(m, k, "gelu" if act == "identity" else act, dtype, seed=seed)
    return (dy, dy) if act == "identity" else (h, dy)


def current_kwargs(dy, h, act):
    amax = backward(dy, h, act, want=("amax",))["amax"]
    return dict(cfg=CURRENT, amax_in=amax, want=("dh",))


@pytest.mark.parametrize("act", ACTS + ["identity"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_columnwise_is_the_rowwise_transposed(act, dtype):
    for i, (m, k) in enumerate([(1, 8), (17, 40), (33, 66), (300, 40)]):
        h, dy = inputs(m, k, act, dtype, seed=i)
        for label, kw in dict(MODES, current=current_kwargs(dy, h, act)).items():
            plain = backward(dy, h, act, **kw)
            both = with_columnwise(dy, h, act, layout_t=strided if i % 2 else None, **kw)
            assert torch.equal(both["dh_q_t"], both["dh_q"].t()), (act, m, k, label)
            assert_same_bits({n: both[n] for n in plain}, plain, (act, m, k, label))
            if i % 2:  # the strided view's padding is untouched
                t = both["dh_q_t"]
                whole = t.as_strided((k, t.stride(0)), (t.stride(0), 1))
                assert bool((whole[:, m:] == 0xAB).all()), (act, m, k, label)


def test_columnwise_errors():
    h, dy = gpu_inputs(8, 16, "gelu", torch.float32, seed=0)
    cfg = te.quantizer_config(*CFG_E4M3)
    kw = dict(config=cfg, scale_inv=torch.empty(1), scale=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="needs both dh_q"):  # no rowwise codes
        _C._act_backward(dy, h, "gelu", dh_q_t=torch.empty(16, 8, dtype=torch.uint8), **kw)
    with pytest.raises(ValueError, match="dh_q_t"):  # not transposed
        _C._act_backward(dy, h, "gelu", dh_q=torch.empty(8, 16, dtype=torch.uint8),
                         dh_q_t=torch.empty(8, 16, dtype=torch.uint8), **kw)
    with pytest.raises(ValueError, match="dh_q_t"):  # no config
        _C._act_backward(dy, h, "gelu", dh=torch.empty(8, 16),
                         dh_q_t=torch.empty(16, 8, dtype=torch.uint8))


# The identity pass's row groupings: dbias row chunks R(M, K) = 4 ((17, 40), (40, 64)) and 8
# (5000 x 40): transposed after the pass; 16 ((3000, 1032), (300, 8000)), 32 (2800 x 24576: 175
# chunks of 16 x K would pass 2^22 partials), 64 (40000 x 40): in the pass; without dbias,
# groups of 32 rows.
GPU_SHAPES = [(0, 64), (1, 8), (17, 40), (40, 64), (5000, 40), (3000, 1032), (300, 8000),
              (40000, 40), (2800, 24576)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("act", ["identity", "gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_columnwise_matches_reference(act, dtype):
    for i, (m, k) in enumerate(GPU_SHAPES):
        if m * k > 8_000_000 and (act != "identity" or dtype != torch.bfloat16):
            continue  # the C reference is slow: the biggest shape for the identity pass
        h, dy = inputs(m, k, act, dtype, seed=20 + i)
        lay = strided if i % 3 == 2 else None
        for label, kw in dict(MODES, current=current_kwargs(dy, h, act)).items():
            for want_dbias in (True, False):
                want = tuple(w for w in kw.get("want", ("dh", "amax")) if w != "dbias")
                kw = dict(kw, want=want + (("dbias",) if want_dbias else ()))
                ref = with_columnwise(dy, h, act, layout_t=lay, **kw)
                got = with_columnwise(dy.cuda(), h.cuda(), act, layout_t=lay, **to_cuda(kw))
                assert_same_bits(got, ref, (act, m, k, label, want_dbias))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 4096), (1000, 3000), (16, 40), (48, 1024)])
def test_cuda_quantize_dbias_pass_gives_both_directions(shape):
    """DelayedScaling's dbias pass writes data_t itself: the members of tq_quantize without
    dbias, data_t the transpose of data."""
    cfg = te.quantizer_config(DelayedScaling(), "grad_output")
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    scale = torch.tensor([0.5], device="cuda")
    plain = _C._quantize(x, cfg, 3, scale, torch.zeros(1, device="cuda"), None, None)
    dbias = torch.empty(shape[1], device="cuda", dtype=torch.bfloat16)
    fused = _C._quantize(x, cfg, 3, scale, torch.zeros(1, device="cuda"), None, None, dbias)
    for a, b in zip(plain[:5], fused[:5]):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(fused[2].view(torch.uint8), fused[0].view(torch.uint8).t())
    torch.testing.assert_close(dbias.float(), x.float().sum(0), rtol=1e-2, atol=0.5)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("act", ["gelu", "relu", "silu", "qgelu", "srelu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_activation_columnwise_every_launch(act, dtype):
    """dh_q_t of every not gated activation, both 16-bit dtypes, with and without dbias, the
    table launch of bf16 gelu / silu / qgelu at 3072 x 2048, row chunks of 4 and 16, M % 8 != 0,
    aligned and strided dh_q_t: bit for bit against the reference."""
    for i, (m, k) in enumerate([(3072, 2048), (64, 512), (200, 1032), (44, 1024)]):
        h, dy = inputs(m, k, act, dtype, seed=40 + i)
        lay = strided if i % 2 else None
        for want_dbias in (True, False):
            kw = dict(MODES["delayed-e4m3"], want=("amax",) + (("dbias",) if want_dbias else ()))
            ref = with_columnwise(dy, h, act, layout_t=lay, **kw)
            got = with_columnwise(dy.cuda(), h.cuda(), act, layout_t=lay, **to_cuda(kw))
            assert_same_bits(got, ref, (act, m, k, want_dbias))
