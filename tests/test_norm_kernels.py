"""The fused normalization kernels (issue 24, stage 1): tq_norm_forward / tq_norm_backward through
_C._norm_forward / _C._norm_backward.

CPU: the C reference (csrc/ref/norm_forward_ref.c, norm_backward_ref.c) against (a) torch's own
layer_norm / rms_norm and autograd in float64, within fp32-sized tolerances, and (a') an
independent float32 torch emulation of tequant's arithmetic order (tequant.h: chunks of 8 into
256 lanes, the halving fold; the column chunks of the backward), bit for bit; (b) the fused FP8
codes against te.ops.quantize of torch's float32 layer_norm / rms_norm output with the same scale:
equal except rare one-code differences exactly where torch's float32 output differs from ours;
(argument errors and constant rows: tests/test_norm_edges.py). GPU (marked, skipped without CUDA): (c) the kernels (cuda/norm_forward.cu,
norm_backward.cu) against the CPU reference bit for bit: every dtype, both norms, zero-centered
gamma, odd K, ld > K, misaligned rows, M = 0, every kernel variant (the forward's fast kernel in each
of its output modes too), NaN, signed-zero and subnormal inputs.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tequant as te
from tequant import _C
from tequant.recipe import DelayedScaling, Float8CurrentScaling, Format

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NORMS = ["LayerNorm", "RMSNorm"]
EPS = 1e-5
CFG_E4M3 = (DelayedScaling(), "input")
CFG_E5M2 = (DelayedScaling(fp8_format=Format.HYBRID), "grad_output")
NAN_BITS = 0x7FFFFFFF


def make(m, k, dtype, seed=0, device="cpu", gamma_dtype=None, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2 + offset).to(dtype)
    gamma = (torch.rand(k, generator=g) + 0.5).to(gamma_dtype or dtype)
    beta = torch.randn(k, generator=g).to(gamma_dtype or dtype)
    dy = torch.randn(m, k, generator=g).to(dtype)
    return [t.to(device) for t in (x, gamma, beta, dy)]


def forward(x, gamma, norm, beta=None, zc=False, eps=EPS, cfg=None, scale=None, amax_in=None,
            amax0=0.0, want=("y_hp", "mean", "rstd", "amax"), y_q_t=None):
    """Every output asked for, allocated poisoned (NaN / 0xAB) so an unwritten element shows
    (y_q_t: the caller's, passed through)."""
    m, k = x.reshape(-1, x.shape[-1]).shape
    dev = x.device
    out = {}
    if "y_hp" in want:
        out["y_hp"] = torch.full((m, k), float("nan"), dtype=x.dtype, device=dev)
    if "mean" in want and norm == "LayerNorm":
        out["mean"] = torch.full((m,), float("nan"), device=dev)
    if "rstd" in want:
        out["rstd"] = torch.full((m,), float("nan"), device=dev)
    if "amax" in want:
        out["amax"] = torch.full((1,), amax0, device=dev)
    kw = dict(out)
    if cfg is not None:
        kw["config"] = te.quantizer_config(*cfg) if isinstance(cfg, tuple) else cfg
        out["y_q"] = kw["y_q"] = torch.full((m, k), 0xAB, dtype=torch.uint8, device=dev)
        out["scale_inv"] = kw["scale_inv"] = torch.full((1,), float("nan"), device=dev)
        if scale is not None:
            kw["scale"] = scale
        if amax_in is not None:
            kw["amax_in"] = amax_in
        if y_q_t is not None:
            kw["y_q_t"] = y_q_t
    _C._norm_forward(x, gamma, norm, eps=eps, zero_centered_gamma=zc, beta=beta, **kw)
    return out


def backward(dy, x, gamma, norm, mean, rstd, zc=False, want_dbeta=True, grad_dtype=None):
    m, k = x.shape
    dx = torch.full((m, k), float("nan"), dtype=x.dtype, device=x.device)
    dgamma = torch.full((k,), float("nan"), dtype=grad_dtype, device=x.device)
    dbeta = torch.full((k,), float("nan"), dtype=grad_dtype, device=x.device) if (
        norm == "LayerNorm" and want_dbeta) else None
    _C._norm_backward(dy, x, gamma, norm, rstd=rstd, dx=dx, dgamma=dgamma, mean=mean,
                      dbeta=dbeta, zero_centered_gamma=zc)
    return {"dx": dx, "dgamma": dgamma, **({"dbeta": dbeta} if dbeta is not None else {})}


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_same_bits(got, want, what):
    for name in want:
        assert torch.equal(bits(got[name]), bits(want[name])), (what, name)


def gamma_eff(gamma, zc):
    return 1 + gamma.float() if zc else gamma.float()  # RN(1 + gamma) in float32, as the kernel


# ---- (a) against torch in float64 -------------------------------------------------------------

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (8e-3, 8e-3), torch.float16: (1e-3, 2e-3)}


def torch_forward64(x, gamma, beta, norm, zc):
    x64, g64 = x.double(), gamma_eff(gamma, zc).double()
    k = x.shape[-1]
    if norm == "LayerNorm":
        y = F.layer_norm(x64, (k,), g64, None if beta is None else beta.double(), EPS)
        mean = x64.mean(-1)
        rstd = 1 / torch.sqrt(((x64 - mean[:, None]) ** 2).mean(-1) + EPS)
    else:
        y = F.rms_norm(x64, (k,), g64, EPS)
        mean, rstd = None, 1 / torch.sqrt((x64 ** 2).mean(-1) + EPS)
    return y, mean, rstd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("zc", [False, True])
def test_cpu_reference_close_to_torch_float64(dtype, norm, zc):
    for m, k, with_beta in [(7, 1, False), (5, 37, True), (16, 1024, True), (3, 2049, False)]:
        x, gamma, beta, dy = make(m, k, dtype, seed=k, offset=0.5)
        beta = beta if (with_beta and norm == "LayerNorm") else None
        got = forward(x, gamma, norm, beta=beta, zc=zc)
        y64, mean64, rstd64 = torch_forward64(x, gamma, beta, norm, zc)
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(got["y_hp"].double(), y64.to(dtype).double(), rtol=rtol,
                                   atol=atol)
        torch.testing.assert_close(got["rstd"].double(), rstd64, rtol=1e-5, atol=0)
        if mean64 is not None:
            torch.testing.assert_close(got["mean"].double(), mean64, rtol=1e-5, atol=1e-6)
        assert float(got["amax"]) == pytest.approx(float(y64.abs().max()), rel=1e-5)
        # backward: autograd through torch's norm in float64 on the same inputs
        xr = x.double().requires_grad_()
        gr = gamma_eff(gamma, zc).double().requires_grad_()
        br = beta.double().requires_grad_() if beta is not None else None
        if norm == "LayerNorm":
            y = F.layer_norm(xr, (k,), gr, br, EPS)
        else:
            y = F.rms_norm(xr, (k,), gr, EPS)
        y.backward(dy.double())
        b = backward(dy, x, gamma, norm, got.get("mean"), got["rstd"], zc=zc)
        scale = max(float(xr.grad.abs().max()), 1.0)
        torch.testing.assert_close(b["dx"].double(), xr.grad.to(dtype).double(), rtol=rtol,
                                   atol=max(atol, 1e-5) * scale)
        torch.testing.assert_close(b["dgamma"].double(), gr.grad, rtol=1e-4, atol=1e-4)
        if norm == "LayerNorm":
            torch.testing.assert_close(b["dbeta"].double(), dy.double().sum(0), rtol=1e-4,
                                       atol=1e-4)


# ---- (a') against a float32 torch emulation of tequant's order, bit for bit ------------------

def ordered_sum(t):
    """tequant's row sum S of t [M, K] float32 (tequant.h): chunks of 8 into 256 lanes, each
    lane in index order onto +0, then the halving fold. Adding the zero padding is exact."""
    m, k = t.shape
    n_chunks = (k + 7) // 8
    per_lane = (n_chunks + 255) // 256
    padded = torch.zeros(m, per_lane * 256 * 8)
    padded[:, :k] = t
    chunks = padded.view(m, per_lane, 256, 8)  # [row, round, lane, element]
    lanes = torch.zeros(m, 256)
    for r in range(per_lane):
        for e in range(8):
            lanes = lanes + chunks[:, r, :, e]
    s = 128
    while s >= 1:
        lanes = torch.cat([lanes[:, :s] + lanes[:, s:2 * s], lanes[:, 2 * s:]], 1)
        s //= 2
    return lanes[:, 0]


def rsqrt_rn(t):
    """RN(1 / RN(sqrt(t))) in float32. numpy's float32 sqrt is IEEE's correctly rounded one;
    torch's CPU float32 sqrt is not (it differs in the last bit on ~20% of random inputs)."""
    return 1 / torch.from_numpy(np.sqrt(t.numpy()))


def emulated_forward(x, gamma, beta, norm, zc):
    v = x.float()
    k = v.shape[1]
    g = gamma_eff(gamma, zc)
    kf = torch.tensor(float(k))
    if norm == "LayerNorm":
        m0 = ordered_sum(v) / kf
        e = v - m0[:, None]
        c = ordered_sum(e) / kf
        mean = m0 + c
        var = (ordered_sum(e * e) / kf - c * c).clamp_min(0)
        d = v - mean[:, None]
        rstd = rsqrt_rn(var + torch.tensor(EPS, dtype=torch.float32))
        y = (d * rstd[:, None]) * g
        if beta is not None:
            y = y + beta.float()
    else:
        mean = None
        rstd = rsqrt_rn(ordered_sum(v * v) / kf + torch.tensor(EPS, dtype=torch.float32))
        y = (v * rstd[:, None]) * g
    return y, mean, rstd


def column_partial_rows(m, k):
    r = 4 if k <= 1024 else 16
    while r < m and not (-(-m // r) <= 1024 and -(-m // r) * k <= 1 << 22):
        r *= 2
    return r


def ordered_column_sum(t):
    """tequant's column order: rows in chunks of R(M, K), each in order onto +0; partials in
    groups of 32 in order; the group sums in order."""
    m, k = t.shape
    r = column_partial_rows(m, k)
    n_parts = -(-m // r)
    padded = torch.zeros(n_parts * r, k)
    padded[:m] = t
    chunks = padded.view(n_parts, r, k)
    partials = torch.zeros(n_parts, k)
    for i in range(r):
        partials = partials + chunks[:, i]
    total = torch.zeros(k)
    for g0 in range(0, n_parts, 32):
        group = torch.zeros(k)
        for p in range(g0, min(g0 + 32, n_parts)):
            group = group + partials[p]
        total = total + group
    return total


def emulated_backward(dy, x, gamma, norm, mean, rstd, zc):
    k = x.shape[1]
    kf = torch.tensor(float(k))
    v, dyv, g = x.float(), dy.float(), gamma_eff(gamma, zc)
    xhat = (v - mean[:, None]) * rstd[:, None] if norm == "LayerNorm" else v * rstd[:, None]
    dyg = dyv * g
    c1 = ordered_sum(dyg * xhat) / kf
    t = xhat * c1[:, None]
    if norm == "LayerNorm":
        t = t + (ordered_sum(dyg) / kf)[:, None]
    dx = (dyg - t) * rstd[:, None]
    out = {"dx": dx.to(x.dtype), "dgamma": ordered_column_sum(dyv * xhat)}
    if norm == "LayerNorm":
        out["dbeta"] = ordered_column_sum(dyv)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_cpu_reference_matches_emulated_order_bit_for_bit(dtype, norm):
    # K past 2048 (two chunks per lane), odd K, one element; M past 16 rows (several column
    # chunks) and past 32 chunks (two groups: M = 600 -> R = 16, 38 partials).
    for m, k, zc in [(3, 1, False), (9, 13, True), (4, 2100, False), (40, 64, True),
                     (600, 24, False)]:
        x, gamma, beta, dy = make(m, k, dtype, seed=m + k)
        beta = beta if norm == "LayerNorm" else None
        got = forward(x, gamma, norm, beta=beta, zc=zc)
        y, mean, rstd = emulated_forward(x, gamma, beta, norm, zc)
        want = {"y_hp": y.to(dtype), "rstd": rstd}
        if mean is not None:
            want["mean"] = mean
        assert_same_bits(got, want, (m, k, zc))
        b = backward(dy, x, gamma, norm, got.get("mean"), got["rstd"], zc=zc)
        assert_same_bits(b, emulated_backward(dy, x, gamma, norm, got.get("mean"), got["rstd"],
                                              zc), (m, k, zc))


# ---- (b) the fused FP8 codes against te.ops.quantize of torch's float32 norm ------------------

def code_steps(a, b):
    """|ordinal(a) - ordinal(b)| of FP8 codes (uint8), the ordinal running -127..127 over the
    value grid (+0 and -0 share 0); NaN codes never occur here."""
    def ordinal(c):
        c = c.to(torch.int32)
        mag = c & 0x7F
        return torch.where((c & 0x80) != 0, -mag, mag)
    return (ordinal(a) - ordinal(b)).abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("scaling", ["delayed-e4m3", "delayed-e5m2", "current"])
def test_fp8_codes_match_quantize_of_torch_norm(dtype, norm, scaling):
    m, k = 96, 768
    x, gamma, beta, _ = make(m, k, dtype, seed=3, offset=0.25)
    beta = beta if norm == "LayerNorm" else None
    k_shape = (k,)
    y32 = (F.layer_norm(x.float(), k_shape, gamma.float(), None if beta is None else
                        beta.float(), EPS) if norm == "LayerNorm"
           else F.rms_norm(x.float(), k_shape, gamma.float(), EPS))
    if scaling == "current":
        first = forward(x, gamma, norm, beta=beta, want=("amax",))
        amax = first["amax"]
        got = forward(x, gamma, norm, beta=beta, cfg=(Float8CurrentScaling(), "input"),
                      amax_in=amax, want=())
        q = te.ops.quantize(y32, Float8CurrentScaling(), "input", amax=amax)
        assert float(amax) == pytest.approx(float(y32.abs().max()), rel=1e-6)
    else:
        cfg = CFG_E4M3 if scaling == "delayed-e4m3" else CFG_E5M2
        scale = torch.tensor([37.5 if scaling == "delayed-e4m3" else 3000.0])
        got = forward(x, gamma, norm, beta=beta, cfg=cfg, scale=scale, want=())
        q = te.ops.quantize(y32, cfg[0], cfg[1], scale=scale, amax_history=torch.zeros(1))
    want_codes = q.data.view(torch.uint8)
    assert torch.equal(bits(got["scale_inv"]), bits(q.scale_inv.reshape(1)))
    steps = code_steps(got["y_q"], want_codes)
    # ours in float32 (the fused kernel widens x exactly, so an fp32 copy of x gives its y)
    y_ours = forward(x.float(), gamma, norm, beta=beta, want=("y_hp",))["y_hp"]
    differs = steps != 0
    assert int(steps.max()) <= 1, "a code more than one step away from quantize(torch's norm)"
    assert int(differs.sum()) <= max(2, differs.numel() // 1000), int(differs.sum())
    assert bool((y_ours[differs] != y32[differs]).all()), \
        "a code differs where the float32 outputs are equal"
    # torch's float32 norm differs from ours by rounding only (its own order and formula)
    torch.testing.assert_close(y_ours, y32, rtol=1e-5, atol=1e-6 * float(y32.abs().max()))
    if scaling == "current":  # sanity: a real cast happened (not all zeros / saturated)
        assert len(torch.unique(got["y_q"])) > 50


def test_empty_x_still_writes_scale_inv_and_amax():
    """M = 0: no row, but scale_inv is RN(1 / scale) and the slot takes max(slot, 0)."""
    x, gamma, _, _ = make(0, 24, torch.float32)
    got = forward(x, gamma, "RMSNorm", cfg=CFG_E4M3, scale=torch.tensor([4.0]), amax0=-2.0)
    assert float(got["scale_inv"]) == 0.25 and float(got["amax"]) == 0.0
    cur = forward(x, gamma, "RMSNorm", cfg=(Float8CurrentScaling(), "input"),
                  amax_in=torch.tensor([3.5]), want=())
    assert float(cur["scale_inv"]) == float(torch.tensor(1.0) / (torch.tensor(448.0) / 3.5))
    b = backward(x, x, gamma, "RMSNorm", None, got["rstd"])
    assert b["dx"].shape == (0, 24) and torch.equal(b["dgamma"], torch.zeros(24))


def test_fp8_codes_and_amax_of_delayed_scaling_in_one_pass():
    """Delayed scaling: the codes, scale_inv and the history slot's amax in the same call; the
    slot max-accumulates (a larger old value stays, a smaller one is replaced)."""
    x, gamma, beta, _ = make(20, 300, torch.bfloat16, seed=5)
    scale = torch.tensor([64.0])
    full = forward(x, gamma, "LayerNorm", beta=beta, cfg=CFG_E4M3, scale=scale)
    y = full["y_hp"].float()
    assert float(full["scale_inv"]) == 1 / 64
    assert float(full["amax"]) >= float(y.abs().max()) * (1 - 2 ** -8)
    big = forward(x, gamma, "LayerNorm", beta=beta, cfg=CFG_E4M3, scale=scale, amax0=1e6)
    assert float(big["amax"]) == 1e6
    assert torch.equal(big["y_q"], full["y_q"])
    neg = forward(x, gamma, "LayerNorm", beta=beta, amax0=-1.0, want=("amax",))
    assert torch.equal(neg["amax"], full["amax"])


# ---- (c) CUDA against the CPU reference, bit for bit ------------------------------------------

def strided(t, extra=24):
    """The values of t in a row-strided view (ld > K, rows 16-byte aligned)."""
    m, k = t.shape
    buf = torch.full((m, k + extra), float("nan"), dtype=t.dtype, device=t.device)
    buf[:, :k] = t
    return buf[:, :k]


def misaligned(t):
    """The values of t contiguous but one element past a 16-byte boundary (element paths)."""
    m, k = t.shape
    buf = torch.empty(m * k + 8, dtype=t.dtype, device=t.device)
    view = buf[1:1 + m * k].view(m, k)
    view.copy_(t)
    return view


LAYOUTS = {"contiguous": lambda t: t, "strided": strided, "misaligned": misaligned}
# K per kernel variant: forward kT = 32 / 64 / 128 / 256 in registers, then 256 re-reading the
# row (K > 16384); backward kT = 32 .. 256 (K <= 1024 .. 8192), past 8192 re-reading the row with
# the partials from column_partial_kernel; odd K and K < 8 throughout.
GPU_SHAPES = [(0, 64), (1, 1), (3, 7), (5, 1000), (17, 1031), (6, 2048), (4, 3001), (3, 6000),
              (2, 12007), (2, 16384), (2, 17001), (70, 100), (300, 33)]


def gpu_case(m, k, dtype, norm, zc, layout, gamma_dtype=None, seed=0):
    x, gamma, beta, dy = make(m, k, dtype, seed=seed, gamma_dtype=gamma_dtype)
    beta = beta if norm == "LayerNorm" and seed % 2 == 0 else None
    return x, gamma, beta, dy


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_forward_matches_cpu_reference(dtype, norm, layout):
    for i, (m, k) in enumerate(GPU_SHAPES):
        zc = i % 2 == 1
        gamma_dtype = [None, torch.float32, torch.bfloat16][i % 3]
        x, gamma, beta, _ = gpu_case(m, k, dtype, norm, zc, layout, gamma_dtype, seed=i)
        for cfg, scale in [(None, None), (CFG_E4M3, 20.0), (CFG_E5M2, 900.0)]:
            s = None if scale is None else torch.tensor([scale])
            want = forward(x, gamma, norm, beta=beta, zc=zc, cfg=cfg, scale=s, amax0=0.5)
            xd = LAYOUTS[layout](x.cuda())
            got = forward(xd, gamma.cuda(), norm, beta=None if beta is None else beta.cuda(),
                          zc=zc, cfg=cfg, scale=None if s is None else s.cuda(), amax0=0.5)
            assert_same_bits(got, want, (m, k, layout, cfg))
        # current scaling: the second pass with the first pass's amax
        amax = want["amax"]
        want = forward(x, gamma, norm, beta=beta, zc=zc, cfg=(Float8CurrentScaling(), "input"),
                       amax_in=amax, want=("rstd",))
        got = forward(LAYOUTS[layout](x.cuda()), gamma.cuda(), norm,
                      beta=None if beta is None else beta.cuda(), zc=zc,
                      cfg=(Float8CurrentScaling(), "input"), amax_in=amax.cuda(), want=("rstd",))
        assert_same_bits(got, want, (m, k, layout, "current"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_backward_matches_cpu_reference(dtype, norm, layout):
    # plus: several column chunks and groups (M = 3000: R = 16, 188 partials), R > 16
    # (M = 40000, K = 40: 1250 chunks of 32 would pass 1024), long rows over several chunks,
    # and K 1025..2048 over many 16-row chunks (16-bit aligned rows: the next-but-one row
    # through shared memory, its last chunk partial); K <= 512 (the 32-thread instance) with
    # a short last chunk at R = 16, 8 and 4 (8197, 4101 and 1021 rows)
    shapes = GPU_SHAPES + [(3000, 40), (40000, 40), (5, 30001), (40, 9001), (3, 8192),
                           (300, 1536), (4101, 256), (8197, 512), (1021, 512)]
    for i, (m, k) in enumerate(shapes):
        zc = i % 2 == 0
        x, gamma, beta, dy = gpu_case(m, k, dtype, norm, zc, layout, [None, torch.float16,
                                      torch.float32][i % 3], seed=i)
        f = forward(x, gamma, norm, beta=beta, zc=zc, want=("mean", "rstd"))
        want = backward(dy, x, gamma, norm, f.get("mean"), f["rstd"], zc=zc,
                        want_dbeta=i % 3 != 2)
        cuda = {n: (None if t is None else t.cuda()) for n, t in f.items()}
        got = backward(LAYOUTS[layout](dy.cuda()), LAYOUTS[layout](x.cuda()), gamma.cuda(), norm,
                       cuda.get("mean"), cuda["rstd"], zc=zc, want_dbeta=i % 3 != 2)
        assert_same_bits(got, want, (m, k, layout))


# cuda/norm_forward.cu's fast_kernel takes K % 8 == 0, K <= 16384 with aligned rows; its variants by
# K (16-bit x: kT / kC = 32 / 4 up to K = 1024, 32 / 8 to 2048, 64 / 8 to 4096, 128 / 8 to 8192,
# 256 / 8 to 16384; FP32: 32 / 4, 64 / 4, 128 / 4, 256 / 4, 256 / 8 at the same bounds), each at its
# bound (every row exactly kT * kC chunks: the kernel without bounds checks) and below it (some of
# a thread's chunks past the row).
FAST_K = [8, 1000, 1024, 1536, 2048, 3072, 4096, 6000, 8192, 12288, 16384]


def fast_modes(x, gamma, norm, beta, zc):
    """(label, kwargs of forward) for each output mode of fast_kernel: everything (its generic
    mode), delayed scaling's E4M3 codes with the slot's amax (with and without mean / rstd),
    current scaling's amax run and its cast run (codes alone), E5M2 codes without y_hp (generic)."""
    common = dict(beta=beta, zc=zc)
    amax = forward(x.cpu(), gamma.cpu(), norm, beta=None if beta is None else beta.cpu(), zc=zc,
                   want=("amax",))["amax"]
    current = (Float8CurrentScaling(), "input")
    return [
        ("all", dict(common, amax0=0.5)),
        ("all+codes", dict(common, cfg=CFG_E4M3, scale=torch.tensor([20.0]), amax0=0.5)),
        ("delayed", dict(common, cfg=CFG_E4M3, scale=torch.tensor([20.0]), amax0=0.5,
                         want=("amax",))),
        ("delayed+stats", dict(common, cfg=CFG_E4M3, scale=torch.tensor([3.0]),
                               want=("mean", "rstd", "amax"))),
        ("current amax", dict(common, want=("amax",), amax0=-1.0)),
        ("current cast", dict(common, cfg=current, amax_in=amax, want=())),
        ("current cast+rstd", dict(common, cfg=current, amax_in=amax, want=("rstd",))),
        ("e5m2", dict(common, cfg=CFG_E5M2, scale=torch.tensor([900.0]), want=("rstd",))),
    ]


def to_cuda(kw):
    return {n: (v.cuda() if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}


def fast_case(m, k, dtype, norm, i):
    """Inputs with edge values: gamma of both signs; row 1 constant (LayerNorm: 1.0, so d = +0
    exactly; RMSNorm: zeros), so y is a signed zero (the fast kernel adds -0 where there is no
    beta); row 2 with -0 inputs; row 3 with subnormal values; row 4 with a NaN."""
    gamma_dtype = [None, torch.float32, torch.bfloat16, torch.float16][i % 4]
    x, gamma, beta, _ = make(m, k, dtype, seed=100 + i, gamma_dtype=gamma_dtype)
    sign = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0).to(gamma.dtype)
    gamma = gamma * sign
    if m > 1:
        x[1] = 1.0 if norm == "LayerNorm" else 0.0
    if m > 2:
        x[2, ::2] = -0.0
    if m > 3:
        tiny = torch.tensor([2.0 ** -20, -2.0 ** -24, 2.0 ** -130, -2.0 ** -140])[:k]
        x[3, :len(tiny)] = tiny.to(dtype)
    if m > 4:
        x[4, k // 2] = float("nan")
    beta = beta if norm == "LayerNorm" and i % 2 == 0 else None
    return x, gamma, beta


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_cuda_fast_kernel_matches_cpu_reference(dtype, norm):
    """Every fast_kernel variant (FAST_K) in every output mode, bit for bit against the C
    reference, with and without beta, zero-centered gamma, every gamma dtype."""
    for i, k in enumerate(FAST_K):
        zc = i % 3 == 2
        x, gamma, beta = fast_case(6, k, dtype, norm, i)
        for label, kw in fast_modes(x, gamma, norm, beta, zc):
            want = forward(x, gamma, norm, **kw)
            got = forward(x.cuda(), gamma.cuda(), norm, **to_cuda(kw))
            assert_same_bits(got, want, (k, label))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m, k, dtype, norm", [(9000, 1024, torch.bfloat16, "LayerNorm"),
                                               (3000, 4096, torch.float16, "RMSNorm"),
                                               (1200, 8192, torch.float32, "RMSNorm"),
                                               (600, 16384, torch.float32, "LayerNorm")])
def test_cuda_fast_kernel_several_rows_per_group(m, k, dtype, norm):
    """More rows than the grid has row groups (on 132 SMs: 4224 warps of 32 for K = 1024, 2112
    groups of 64 for 4096, 528 of 256 for FP32 8192, 264 for FP32 16384), so every group runs
    several rows: its fold buffers and named barrier are reused from row to row."""
    x, gamma, beta = fast_case(m, k, dtype, norm, 0)
    for label, kw in fast_modes(x, gamma, norm, beta, False):
        if label in ("all", "delayed", "current cast"):
            want = forward(x, gamma, norm, **kw)
            got = forward(x.cuda(), gamma.cuda(), norm, **to_cuda(kw))
            assert_same_bits(got, want, (m, k, label))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_cuda_nan_inputs_and_amax(dtype, norm):
    """Rows holding NaN / Inf: NaN outputs are the canonical +NaN on both sides, and amax ignores
    them (the finite rows' max, accumulated into the slot)."""
    x, gamma, beta, dy = make(40, 300, dtype, seed=9)
    x[3, 7] = float("nan")
    x[10, :] = float("nan")
    x[20, 5] = float("inf")
    beta = beta if norm == "LayerNorm" else None
    want = forward(x, gamma, norm, beta=beta, cfg=CFG_E4M3, scale=torch.tensor([16.0]))
    got = forward(x.cuda(), gamma.cuda(), norm, beta=None if beta is None else beta.cuda(),
                  cfg=CFG_E4M3, scale=torch.tensor([16.0], device="cuda"))
    assert_same_bits(got, want, "nan")
    y = want["y_hp"].float()
    assert bool(y[3].isnan().all()) and bool(y[10].isnan().all())
    finite = y[torch.isfinite(y)]
    # amax is of the FP32 y; y_hp is y rounded to x's dtype, and rounding is monotonic, so the
    # rounded amax is the max of |y_hp| over the finite rows
    amax_rounded = want["amax"].to(dtype).float()
    assert float(amax_rounded) == float(finite.abs().max())
    assert int(want["y_q"][3, 0]) == 0x7F  # NaN codes as quantize writes them
    b_want = backward(dy, x, gamma, norm, want.get("mean"), want["rstd"])
    b_got = backward(dy.cuda(), x.cuda(), gamma.cuda(), norm,
                     None if "mean" not in got else got["mean"], got["rstd"])
    assert_same_bits(b_got, b_want, "nan backward")
    assert int(bits(b_want["dgamma"])[0]) == NAN_BITS


@gpu
@pytest.mark.gpu
def test_cuda_runs_on_the_current_stream():
    x, gamma, beta, dy = make(512, 4096, torch.bfloat16, seed=1, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x2 = x * 2
        got = forward(x2, gamma, "LayerNorm", beta=beta, cfg=CFG_E4M3,
                      scale=torch.tensor([8.0], device="cuda"))
        b = backward(dy, x2, gamma, "LayerNorm", got["mean"], got["rstd"])
    s.synchronize()
    want = forward(x2.cpu(), gamma.cpu(), "LayerNorm", beta=beta.cpu(), cfg=CFG_E4M3,
                   scale=torch.tensor([8.0]))
    assert_same_bits(got, want, "stream")
    assert_same_bits(b, backward(dy.cpu(), x2.cpu(), gamma.cpu(), "LayerNorm", want["mean"],
                                 want["rstd"]), "stream backward")
