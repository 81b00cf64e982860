"""The fused activation kernels (issue 24): tq_act_forward / tq_act_backward through _C._act_forward
/ _C._act_backward, every activation TE defines (gelu, relu, silu, qgelu, srelu; gated geglu,
reglu, swiglu).

CPU: the C reference (csrc/ref/act_forward_ref.c, act_backward_ref.c) against (a) float64 (the
formula's own accuracy: tequant's e^x and sigmoid, tequant.h) and (a') torch's float32
activations and autograd (independent: torch's exp / tanh / sigmoid), the differences counted
and bounded in ulps; (b) the fused FP8 codes against te.ops.quantize of torch's float32
activation (and of its autograd gradient for dh) with the same scale: equal except rare one-code
differences exactly where the float32 values differ; dbias bit for bit against a torch
emulation of tequant's column order over our FP32 dh; (d) shapes (M = 0, M = 1, odd K, ld > K,
gated with N odd), NaN / Inf / signed zeros, argument errors. GPU (marked, skipped without CUDA):
(c) the kernels (cuda/act_forward.cu, act_backward.cu) against the C reference bit for bit:
every activation, dtype and output mode, contiguous / strided / misaligned rows, dbias over
several row chunks and groups.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tequant as te
from tequant import _C
from tequant.recipe import DelayedScaling, Float8CurrentScaling, Format
from test_norm_kernels import (  # noqa: E402  (tests/ is on sys.path, as for the other files)
    assert_same_bits, bits, code_steps, column_partial_rows, misaligned, ordered_column_sum,
    to_cuda)

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ACTS = ["gelu", "relu", "silu", "qgelu", "srelu", "geglu", "reglu", "swiglu"]
BASE = {"geglu": "gelu", "reglu": "relu", "swiglu": "silu"}
SIGMOID_FAMILY = ["gelu", "silu", "qgelu"]
CFG_E4M3 = (DelayedScaling(), "input")
CFG_E5M2 = (DelayedScaling(fp8_format=Format.HYBRID), "grad_output")
CURRENT = (Float8CurrentScaling(), "input")
NAN_BITS = 0x7FFFFFFF
# TE's float32 constants (transformer_engine/common/util/math.h)
C1, C2, C3, ALPHA = (float(np.float32(c)) for c in (0.79788456, 0.03567741, 0.1070322243, 1.702))


def out_cols(act, k):
    return k // 2 if act in BASE else k


def make(m, k, dtype, seed=0, device="cpu", scale=2.0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(m, k, generator=g) * scale).to(dtype)
    dy = torch.randn(m, out_cols("gelu", k), generator=g).to(dtype)
    dy_gated = torch.randn(m, k // 2, generator=g).to(dtype)
    return h.to(device), dy.to(device), dy_gated.to(device)


def grad_of(act, dy, dy_gated):
    return dy_gated if act in BASE else dy


def strided(t, extra=24):
    """The values of t in a row-strided view (ld > K, rows 16-byte aligned), its padding
    poisoned (NaN, or 0xAB for codes)."""
    m, k = t.shape
    buf = torch.full((m, k + extra), 0xAB if t.dtype == torch.uint8 else float("nan"),
                     dtype=t.dtype, device=t.device)
    buf[:, :k] = t
    return buf[:, :k]


def _poisoned(shape, dtype, device, fill, layout):
    t = torch.full(shape, fill, dtype=dtype, device=device)
    return layout(t) if layout is not None else t


def _fp8_kwargs(out, kw, cfg, shape, device, scale, amax_in, layout, codes_name):
    kw["config"] = te.quantizer_config(*cfg)
    out[codes_name] = kw[codes_name] = _poisoned(shape, torch.uint8, device, 0xAB, layout)
    out["scale_inv"] = kw["scale_inv"] = torch.full((1,), float("nan"), device=device)
    if scale is not None:
        kw["scale"] = scale
    if amax_in is not None:
        kw["amax_in"] = amax_in


def forward(h, act, cfg=None, scale=None, amax_in=None, amax0=0.0, want=("y_hp", "amax"),
            layout=None, y_q_t=None):
    """Every output asked for, allocated poisoned (NaN / 0xAB) so an unwritten element shows
    (y_q_t: the caller's, passed through)."""
    m, k = h.shape
    n, dev = out_cols(act, k), h.device
    out = {}
    if "y_hp" in want:
        out["y_hp"] = _poisoned((m, n), h.dtype, dev, float("nan"), layout)
    if "amax" in want:
        out["amax"] = torch.full((1,), amax0, device=dev)
    kw = dict(out)
    if cfg is not None:
        _fp8_kwargs(out, kw, cfg, (m, n), dev, scale, amax_in, layout, "y_q")
    if y_q_t is not None:
        kw["y_q_t"] = y_q_t
    _C._act_forward(h, act, **kw)
    return out


def backward(dy, h, act, cfg=None, scale=None, amax_in=None, amax0=0.0,
             want=("dh", "amax", "dbias"), layout=None):
    m, k = h.shape
    dev = h.device
    out = {}
    if "dh" in want:
        out["dh"] = _poisoned((m, k), h.dtype, dev, float("nan"), layout)
    if "amax" in want:
        out["amax"] = torch.full((1,), amax0, device=dev)
    if "dbias" in want:
        out["dbias"] = torch.full((k,), float("nan"), device=dev)
    kw = dict(out)
    if cfg is not None:
        _fp8_kwargs(out, kw, cfg, (m, k), dev, scale, amax_in, layout, "dh_q")
    _C._act_backward(dy, h, act, **kw)
    return out


# ---- independent torch references in float32 ----------------------------------------------

# torch's own activations; gelu is TE's tanh approximation x * (0.5 + 0.5 tanh(u)),
# u = sqrt(2/pi) (x + 0.044715 x^3)
TORCH = {"gelu": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu,
         "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
         "srelu": lambda x: torch.square(F.relu(x))}
# The references of the codes and gradient tests: torch's, but gelu as the same function in
# torch's float32 sigmoid, x * sigmoid(2u): F.gelu's 1 + tanh(u) cancels for x < -3 (off by up to
# |x| 2^-24 absolutely, every bit of a small y wrong: test_formula_error_against_torch_float32),
# which E5M2 codes with a large scale resolve.
REF = dict(TORCH, gelu=lambda x: x * torch.sigmoid(2 * (x * (C1 + C2 * (x * x)))))


def torch_act(act, h, funcs=REF):
    """torch's float32 activation of a float32 h (gated: act(first half) * second half)."""
    f = funcs[BASE.get(act, act)]
    if act in BASE:
        a, b = h.chunk(2, dim=-1)
        return f(a) * b
    return f(h)


def torch_dh(act, h, dy):
    """torch autograd of torch_act in float32."""
    hr = h.detach().float().clone().requires_grad_()
    torch_act(act, hr).backward(dy.float())
    return hr.grad


# ---- (a) the formula's accuracy: against float64 and against torch's float32 ---------------

def sweep():
    """Every finite bf16 in [-40, 40], 400k uniform in [-40, 40], 400k normal * 3 (float32)."""
    b = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    b = b[torch.isfinite(b) & (b.abs() <= 40)]
    g = torch.Generator().manual_seed(0)
    return torch.cat([b, torch.rand(400_000, generator=g) * 80 - 40,
                      torch.randn(400_000, generator=g) * 3])


def ulp32(t):
    """The float32 spacing at |t| (2^-149 below the normals), as float64."""
    a = np.abs(np.asarray(t, dtype=np.float64)).astype(np.float32)
    return np.maximum(np.spacing(a).astype(np.float64), 2.0 ** -149)


def truth64(act, x):
    """act(x), act'(x) and the sigmoid's argument z in float64, with TE's float32 constants."""
    x = x.astype(np.float64)
    z = {"gelu": 2 * x * (C1 + C2 * x * x), "silu": x, "qgelu": ALPHA * x}[act]
    with np.errstate(over="ignore"):
        s = 1 / (1 + np.exp(-z))
    slope = {"gelu": 2 * x * (C1 + C3 * x * x), "silu": x, "qgelu": z}[act]
    return x * s, s + slope * s * (1 - s), z, s


def ours(act, x):
    """The C reference's FP32 act(x) and act'(x) (the gradient of dy = 1) of a float32 vector."""
    y = torch.empty(1, x.numel())
    _C._act_forward(x.view(1, -1), act, y_hp=y)
    d = torch.empty(1, x.numel())
    _C._act_backward(torch.ones(1, x.numel()), x.view(1, -1), act, dh=d)
    return y.view(-1), d.view(-1)


@pytest.mark.parametrize("act", SIGMOID_FAMILY)
def test_formula_accuracy_against_float64(act):
    """act(x) within 2.5 (1 + k) ulp of float64, k = |z| (1 - sigmoid(z)) the condition number
    of x * sigmoid(z) in z (z's own rounding, ~1 ulp, is amplified by it: up to ~130 ulp for gelu
    near x = -10, as for any float32 evaluation), where |act(x)| >= 1e-30 (below, values may
    flush to +-0 where E(-z) overflows, as torch's do); act'(x) within 2.5 ulp of max(|act'|, 1).
    Measured on this sweep: value <= 1.92 (1 + k) ulp, derivative <= 1.61 ulp of
    max(|act'|, 1)."""
    x = sweep()
    y, d = ours(act, x)
    y64, d64, z, s = truth64(act, x.numpy())
    kappa = np.abs(z) * (1 - s)
    ok = np.abs(y64) >= 1e-30
    err_y = np.abs(y.numpy().astype(np.float64) - y64) / ulp32(y64)
    err_d = np.abs(d.numpy().astype(np.float64) - d64) / ulp32(np.maximum(np.abs(d64), 1.0))
    worst_y, worst_d = float((err_y / (1 + kappa))[ok].max()), float(err_d.max())
    print(f"{act}: value <= {worst_y:.2f} (1 + k) ulp, derivative <= {worst_d:.2f} ulp")
    assert worst_y <= 2.5 and worst_d <= 2.5
    assert float(err_y[ok & (kappa < 0.5)].max()) <= 3.0  # well-conditioned: a few ulp
    assert not bool(np.isnan(y.numpy()).any() or np.isnan(d.numpy()).any())


# (value bound, derivative bound, share of values differing, share of derivatives differing):
# units of ulp(max(|y|, |x|)) and ulp(max(|act'|, 1)); torch's own gelu (1 + tanh, cancelling
# for x < 0) and its 1 - sigmoid are further from float64 than ours (test above).
TORCH_BOUNDS = {"gelu": (3, 12, 0.45, 0.60), "silu": (3, 12, 0.02, 0.60),
                "qgelu": (3, 12, 0.30, 0.60)}


@pytest.mark.parametrize("act", SIGMOID_FAMILY)
def test_formula_error_against_torch_float32(act):
    """Against torch's float32 activation and autograd (its own exp / tanh / sigmoid), counted:
    measured on this sweep (torch 2.13, AVX2 CPU) values <= 2 ulp of max(|y|, |x|), derivatives
    <= 9 ulp of max(|act'|, 1), differing bits in 35% (gelu), 18% (qgelu), 0.05% (silu) of the
    values and 38-46% of the derivatives (bounds with margin for other CPUs' vector paths)."""
    x = sweep()
    y, d = ours(act, x)
    xr = x.clone().requires_grad_()
    y_t = torch_act(act, xr, TORCH)
    y_t.backward(torch.ones_like(x))
    y_t, d_t = y_t.detach().numpy().astype(np.float64), xr.grad.numpy().astype(np.float64)
    err_y = np.abs(y.numpy() - y_t) / ulp32(np.maximum(np.abs(y_t), np.abs(x.numpy())))
    err_d = np.abs(d.numpy() - d_t) / ulp32(np.maximum(np.abs(d_t), 1.0))
    share_y, share_d = float((y.numpy() != y_t).mean()), float((d.numpy() != d_t).mean())
    print(f"{act}: values <= {err_y.max():.1f} units, {share_y:.2%} differ; derivatives <= "
          f"{err_d.max():.1f} units, {share_d:.2%} differ")
    bound_y, bound_d, max_share_y, max_share_d = TORCH_BOUNDS[act]
    assert err_y.max() <= bound_y and err_d.max() <= bound_d
    assert share_y <= max_share_y and share_d <= max_share_d
    assert share_d > 0  # an independent reference: equal bits everywhere would mean a copy


@pytest.mark.parametrize("act", ["relu", "srelu", "reglu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_family_equals_torch_bit_for_bit(act, dtype):
    """relu / srelu / reglu round once (or not at all): the same bits as torch, -0 included
    (relu(-0) = -0, srelu(-0) = +0), forward and backward (+0 where h <= 0)."""
    h, dy, dy_g = make(37, 64, dtype, seed=4)
    h[0, :6] = torch.tensor([-0.0, 0.0, -1.0, 1e-30, -1e-30, 3.0]).to(dtype)
    g = grad_of(act, dy, dy_g)
    got = forward(h, act)
    assert torch.equal(bits(got["y_hp"]), bits(torch_act(act, h.float()).to(dtype)))
    b = backward(g, h, act)
    assert torch.equal(bits(b["dh"]), bits(torch_dh(act, h, g).to(dtype)))


# ---- (b) the fused FP8 codes against te.ops.quantize of torch's float32 activation -----------

def check_codes(got_codes, want_codes, ours32, torch32, what):
    """At most one code step apart, rarely, and only where the float32 values differ."""
    steps = code_steps(got_codes, want_codes)
    differs = steps != 0
    assert int(steps.max()) <= 1, (what, "a code more than one step away")
    assert int(differs.sum()) <= max(2, differs.numel() // 1000), (what, int(differs.sum()))
    assert bool((ours32[differs] != torch32[differs]).all()), \
        (what, "a code differs where the float32 values are equal")


def quantize_like(v32, scaling, scale, amax):
    if scaling == "current":
        return te.ops.quantize(v32, *CURRENT, amax=amax)
    cfg = CFG_E4M3 if scaling == "delayed-e4m3" else CFG_E5M2
    return te.ops.quantize(v32, cfg[0], cfg[1], scale=scale, amax_history=torch.zeros(1))


def fused_codes(run, scaling, scale):
    """The fused call's codes for scaling: one run (delayed), or the amax run then the cast run
    (current). run(**kw) calls forward / backward."""
    if scaling == "current":
        amax = run(want=("amax",))["amax"]
        return run(cfg=CURRENT, amax_in=amax, want=()), amax
    cfg = CFG_E4M3 if scaling == "delayed-e4m3" else CFG_E5M2
    return run(cfg=cfg, scale=scale, want=("amax",)), None


SCALINGS = {"delayed-e4m3": 37.5, "delayed-e5m2": 3000.0, "current": None}


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_forward_codes_match_quantize_of_torch_act(act, dtype, scaling):
    h, _, _ = make(96, 768, dtype, seed=3)
    scale = None if SCALINGS[scaling] is None else torch.tensor([SCALINGS[scaling]])
    got, amax = fused_codes(lambda **kw: forward(h, act, **kw), scaling, scale)
    y32 = torch_act(act, h.float())
    ours32 = forward(h.float(), act, want=("y_hp",))["y_hp"]  # h widens exactly
    if amax is not None:
        assert float(amax) == pytest.approx(float(y32.abs().max()), rel=1e-6)
        assert float(amax) == float(ours32.abs().max())
    q = quantize_like(y32, scaling, scale, amax)
    assert torch.equal(bits(got["scale_inv"]), bits(q.scale_inv.reshape(1)))
    check_codes(got["y_q"], q.data.view(torch.uint8), ours32, y32, (act, dtype, scaling))
    if scaling == "current":  # a real cast happened (not all zeros / saturated)
        assert len(torch.unique(got["y_q"])) > 50


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_backward_codes_match_quantize_of_torch_grad(act, dtype, scaling):
    h, dy, dy_g = make(96, 768, dtype, seed=5)
    g = grad_of(act, dy, dy_g)
    scale = None if SCALINGS[scaling] is None else torch.tensor([SCALINGS[scaling]])
    got, amax = fused_codes(lambda **kw: backward(g, h, act, **kw), scaling, scale)
    dh32 = torch_dh(act, h, g)
    ours32 = backward(g.float(), h.float(), act, want=("dh",))["dh"]
    if amax is not None:
        assert float(amax) == float(ours32.abs().max())
    q = quantize_like(dh32, scaling, scale, amax)
    assert torch.equal(bits(got["scale_inv"]), bits(q.scale_inv.reshape(1)))
    check_codes(got["dh_q"], q.data.view(torch.uint8), ours32, dh32, (act, dtype, scaling))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_close_to_torch_and_dbias_in_tequant_order(act, dtype):
    """dh within a few float32 ulp of torch autograd (then rounded to h's dtype); dbias bit for
    bit the column order's sum of our FP32 dh (emulated with torch: rows in chunks of R(M, K),
    groups of 32 chunks) and close to torch's dh.sum(0). M = 600: R = 16, 38 partials, 2 groups."""
    h, dy, dy_g = make(600, 48, dtype, seed=7)
    g = grad_of(act, dy, dy_g)
    got = backward(g, h, act)
    dh32 = backward(g.float(), h.float(), act, want=("dh",))["dh"]
    assert torch.equal(bits(got["dh"]), bits(dh32.to(dtype)))
    want = torch_dh(act, h, g)
    torch.testing.assert_close(dh32, want, rtol=2e-6, atol=2e-6 * float(want.abs().max()))
    assert torch.equal(bits(got["dbias"]), bits(ordered_column_sum(dh32)))
    torch.testing.assert_close(got["dbias"], want.sum(0), rtol=1e-4, atol=1e-4)
    assert float(got["amax"]) == float(dh32.abs().max())


def test_dbias_partial_rows_follow_the_norm_order():
    """The workspace of dbias is the norm backward's R(M, K) chunking, one plane."""
    for m, k in [(0, 10), (1, 10), (100, 8), (40000, 40), (65536, 16384), (5, 1 << 23)]:
        want = 0 if m == 0 else -(-m // column_partial_rows(m, k)) * k * 4
        assert _C._act_backward_workspace_size(m, k) == want
        assert _C._act_backward_workspace_size(m, k) == _C._norm_backward_workspace_size(
            "RMSNorm", m, k)


# ---- (d) shapes, special values, the amax slot -----------------------------------------------

@pytest.mark.parametrize("act", ACTS)
def test_shapes_m0_m1_odd_k_strided(act):
    """M = 0 writes scale_inv and max(slot, 0) (and dbias = 0); M = 1; odd K (gated: N odd);
    strided h / dy / outputs give the contiguous call's bits."""
    k = 2 * 13 if act in BASE else 13
    h, dy, dy_g = make(0, k, torch.float32)
    g = grad_of(act, dy, dy_g)
    f = forward(h, act, cfg=CFG_E4M3, scale=torch.tensor([4.0]), amax0=-2.0)
    assert float(f["scale_inv"]) == 0.25 and float(f["amax"]) == 0.0
    assert f["y_q"].shape == (0, out_cols(act, k))
    cur = forward(h, act, cfg=CURRENT, amax_in=torch.tensor([3.5]), want=())
    assert float(cur["scale_inv"]) == float(torch.tensor(1.0) / (torch.tensor(448.0) / 3.5))
    b = backward(g, h, act, cfg=CFG_E5M2, scale=torch.tensor([2.0]), amax0=-1.0)
    assert torch.equal(b["dbias"], torch.zeros(k)) and float(b["amax"]) == 0.0
    assert float(b["scale_inv"]) == 0.5
    for m in (1, 5):
        h, dy, dy_g = make(m, k, torch.bfloat16, seed=m)
        g = grad_of(act, dy, dy_g)
        want_f = forward(h, act, cfg=CFG_E4M3, scale=torch.tensor([8.0]))
        want_b = backward(g, h, act, cfg=CFG_E5M2, scale=torch.tensor([512.0]))
        y32 = torch_act(act, h.float())
        torch.testing.assert_close(want_f["y_hp"].float(), y32, rtol=8e-3, atol=1e-6)
        assert_same_bits(forward(strided(h), act, cfg=CFG_E4M3, scale=torch.tensor([8.0]),
                                 layout=strided), want_f, (act, m, "forward strided"))
        assert_same_bits(backward(strided(g), strided(h), act, cfg=CFG_E5M2,
                                  scale=torch.tensor([512.0]), layout=strided), want_b,
                         (act, m, "backward strided"))


@pytest.mark.parametrize("act", ACTS)
def test_nan_inf_and_signed_zero(act):
    """NaN in h: y and dh NaN (canonical 0x7FFFFFFF in FP32, code 0x7F), amax ignores it; dbias
    of a NaN column is the canonical NaN; +-Inf saturates the codes; -0 follows torch."""
    k = 2 * 8 if act in BASE else 8
    h = torch.tensor([[0.5, -1.5, 2.0, -0.0, 3.0, -3.0, 0.25, 1.0] * (k // 8)] * 3)
    h[1, 2] = float("nan")
    h[2, 4] = float("inf")
    dy = torch.ones(3, out_cols(act, k))
    f = forward(h, act, cfg=CFG_E4M3, scale=torch.tensor([1.0]))
    y = f["y_hp"]
    assert int(bits(y)[1, 2]) == NAN_BITS and int(f["y_q"][1, 2]) == 0x7F
    assert float(f["amax"]) == float(y[~y.isnan()].abs().max())
    b = backward(dy, h, act, cfg=CFG_E5M2, scale=torch.tensor([1.0]))
    assert int(bits(b["dh"])[1, 2]) == NAN_BITS and int(bits(b["dbias"])[2]) == NAN_BITS
    assert int(b["dh_q"][1, 2]) == 0x7F
    assert not bool(b["amax"].isnan().any()) and not bool(f["amax"].isnan().any())
    # the rows without NaN / Inf agree with torch
    torch.testing.assert_close(y[0], torch_act(act, h[:1])[0], rtol=1e-6, atol=1e-6)


def test_delayed_amax_max_accumulates_in_one_pass():
    """Delayed scaling: codes, scale_inv and the history slot's amax in the same call; the slot
    max-accumulates (a larger old value stays, a smaller one, even negative, is replaced)."""
    h, dy, _ = make(20, 300, torch.bfloat16, seed=5)
    scale = torch.tensor([64.0])
    full = forward(h, "gelu", cfg=CFG_E4M3, scale=scale)
    assert float(full["scale_inv"]) == 1 / 64
    y32 = forward(h.float(), "gelu", want=("y_hp",))["y_hp"]
    assert float(full["amax"]) == float(y32.abs().max())
    big = forward(h, "gelu", cfg=CFG_E4M3, scale=scale, amax0=1e6)
    assert float(big["amax"]) == 1e6 and torch.equal(big["y_q"], full["y_q"])
    neg = forward(h, "gelu", amax0=-1.0, want=("amax",))
    assert torch.equal(neg["amax"], full["amax"])
    b = backward(dy, h, "gelu", cfg=CFG_E5M2, scale=torch.tensor([2.0]), amax0=1e6)
    assert float(b["amax"]) == 1e6


# ---- errors -------------------------------------------------------------------------------

def test_errors_forward():
    h = torch.randn(4, 16)
    y = torch.empty(4, 16)
    with pytest.raises(ValueError, match="h has dtype float64; expected one of"):
        _C._act_forward(h.double(), "gelu", y_hp=y)
    with pytest.raises(ValueError, match="act must be one of 'gelu'.*got 'tanh'"):
        _C._act_forward(h, "tanh", y_hp=y)
    with pytest.raises(TypeError, match="must be str"):
        _C._act_forward(h, 3, y_hp=y)
    with pytest.raises(TypeError, match="h must be a torch.Tensor"):
        _C._act_forward([1.0], "gelu")
    with pytest.raises(ValueError, match="h is \\[4, 15\\]; a gated activation splits the "
                                         "features into two halves"):
        _C._act_forward(h[:, :15], "swiglu")
    with pytest.raises(ValueError, match="h is \\[4, 0\\]; the activation needs at least one"):
        _C._act_forward(h[:, :0], "relu")
    with pytest.raises(ValueError, match="y_hp is float32 \\[4, 16\\]; expected float32 "
                                         "\\[4, 8\\] like act\\(h\\)"):
        _C._act_forward(h, "geglu", y_hp=y)
    with pytest.raises(ValueError, match="y_hp is bfloat16 \\[4, 16\\]; expected float32"):
        _C._act_forward(h, "gelu", y_hp=y.bfloat16())
    with pytest.raises(ValueError, match="amax is float32 \\[1, 2\\].*expected 1 contiguous"):
        _C._act_forward(h, "gelu", amax=torch.zeros(2))
    codes, sinv = torch.empty(4, 16, dtype=torch.uint8), torch.empty(1)
    with pytest.raises(ValueError, match="y_q was given, but config is NULL"):
        _C._act_forward(h, "gelu", y_q=codes)
    delayed = te.quantizer_config(*CFG_E4M3)
    with pytest.raises(ValueError, match="delayed scaling needs scale"):
        _C._act_forward(h, "gelu", config=delayed, y_q=codes, scale_inv=sinv)
    current = te.quantizer_config(*CURRENT)
    with pytest.raises(ValueError, match="current scaling needs amax_in"):
        _C._act_forward(h, "gelu", config=current, y_q=codes, scale_inv=sinv)
    a = torch.zeros(1)
    with pytest.raises(ValueError, match="amax and amax_in are the same memory"):
        _C._act_forward(h, "gelu", config=current, y_q=codes, scale_inv=sinv, amax=a, amax_in=a)
    with pytest.raises(ValueError, match="y_q is uint8 \\[4, 15\\]"):
        _C._act_forward(h, "gelu", config=delayed, y_q=codes[:, :15], scale_inv=sinv,
                        scale=torch.ones(1))
    with pytest.raises(ValueError, match="y_q has dtype float32"):
        _C._act_forward(h, "gelu", config=delayed, y_q=y, scale_inv=sinv, scale=torch.ones(1))
    nv = te.quantizer_config(te.recipe.NVFP4BlockScaling(), "input")
    with pytest.raises(NotImplementedError, match="per-tensor FP8"):
        _C._act_forward(h, "gelu", config=nv, y_q=codes, scale_inv=sinv)
    mx = te.quantizer_config(te.recipe.MXFP8BlockScaling(), "input")  # its blocks go to q
    with pytest.raises(ValueError, match="y_q was given, but a block-format config writes q"):
        _C._act_forward(h, "gelu", config=mx, y_q=codes, scale_inv=sinv)
    with pytest.raises(NotImplementedError, match="h is on a meta device"):
        _C._act_forward(torch.empty(4, 16, device="meta"), "gelu")


def test_errors_backward():
    h, dy = torch.randn(4, 16), torch.randn(4, 16)
    with pytest.raises(ValueError, match="dy is float32 \\[4, 16\\] on device -1; expected "
                                         "act\\(h\\)'s: float32 \\[4, 8\\]"):
        _C._act_backward(dy, h, "reglu", dh=torch.empty(4, 16))
    with pytest.raises(ValueError, match="dy is bfloat16 \\[4, 16\\]"):
        _C._act_backward(dy.bfloat16(), h, "gelu", dh=torch.empty(4, 16))
    with pytest.raises(ValueError, match="dh is float32 \\[4, 8\\]; expected float32 \\[4, 16\\] "
                                         "like h"):
        _C._act_backward(dy[:, :8], h, "swiglu", dh=torch.empty(4, 8))
    with pytest.raises(ValueError, match="dbias is float32 \\[1, 8\\].*expected 16 contiguous "
                                         "float32"):
        _C._act_backward(dy[:, :8], h, "swiglu", dbias=torch.empty(8))
    with pytest.raises(ValueError, match="dbias has dtype float64"):  # bf16 / fp16: rounded sums
        _C._act_backward(dy, h, "gelu", dbias=torch.empty(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="dh_q was given, but config is NULL"):
        _C._act_backward(dy, h, "gelu", dh_q=torch.empty(4, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="act must be one of"):
        _C._act_backward(dy, h, "GELU")
    with pytest.raises(TypeError, match="dy must be a torch.Tensor"):
        _C._act_backward(None, h, "gelu")
    with pytest.raises(ValueError, match="h is \\[4, 15\\]; a gated activation"):
        _C._act_backward(dy[:, :7], h[:, :15], "geglu")
    with pytest.raises(ValueError, match="needs rows >= 0 and cols >= 1"):
        _C._act_backward_workspace_size(4, 0)



@gpu
@pytest.mark.gpu
def test_errors_device_mismatch():
    h = torch.randn(4, 16, device="cuda")
    with pytest.raises(ValueError, match="y_hp is on device -1, the input on device 0"):
        _C._act_forward(h, "gelu", y_hp=torch.empty(4, 16))
    with pytest.raises(ValueError, match="dy is float32 \\[4, 16\\] on device -1"):
        _C._act_backward(torch.randn(4, 16), h, "gelu", dh=torch.empty_like(h))
    with pytest.raises(ValueError, match="dbias is on device -1, the input on device 0"):
        _C._act_backward(torch.randn(4, 16, device="cuda"), h, "gelu", dbias=torch.empty(16))


# ---- (c) CUDA against the C reference, bit for bit ------------------------------------------

LAYOUTS = {"contiguous": lambda t: t, "strided": strided, "misaligned": misaligned}
# (M, K): M = 0, one row, K < 8, odd K (non-gated) / odd N (gated), N % 8 == 0 (16-byte path);
# with contiguous rows also a grid-striding size (3000 x 1032: more chunks than a full grid of
# 132 SMs has threads) and, backward, dbias over 625 row chunks of 64 (40000 x 40)
GPU_SHAPES = [(0, 64), (1, 2), (3, 14), (5, 1000), (17, 1030), (6, 2048), (4, 3002)]
BIG_SHAPES = [(3000, 1032)]


def gpu_modes():
    """(label, forward/backward kwargs) of each output mode: everything with E4M3 delayed codes;
    E5M2 codes alone; high precision and amax only (current's amax run)."""
    return [("all+e4m3", dict(cfg=CFG_E4M3, scale=torch.tensor([20.0]), amax0=0.5)),
            ("e5m2", dict(cfg=CFG_E5M2, scale=torch.tensor([900.0]), want=())),
            ("amax", dict(want=("amax",), amax0=-1.0))]


def gpu_inputs(m, k, act, dtype, seed):
    """randn h with edge values in its first rows (signed zeros, subnormals, large values)."""
    h, dy, dy_g = make(m, k, dtype, seed=seed, scale=3.0)
    if m > 2:
        h[1, ::3] = -0.0
        tiny = torch.tensor([2.0 ** -20, -2.0 ** -24, 2.0 ** -130, -2.0 ** -140, 30.0, -30.0])
        n = min(k, len(tiny))
        h[2, :n] = tiny[:n].to(dtype)
    return h, grad_of(act, dy, dy_g)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_forward_matches_cpu_reference(act, dtype, layout):
    lay = LAYOUTS[layout]
    for i, (m, k) in enumerate(GPU_SHAPES + (BIG_SHAPES if layout == "contiguous" else [])):
        k = k if act in BASE else k - i % 2  # odd K for the elementwise ones too
        h, _ = gpu_inputs(m, k, act, dtype, seed=i)
        for label, kw in gpu_modes():
            want = forward(h, act, **kw)
            got = forward(lay(h.cuda()), act, layout=lay if i % 2 else None, **to_cuda(kw))
            assert_same_bits(got, want, (m, k, label))
        amax = forward(h, act, want=("amax",))["amax"]  # current: the cast run
        want = forward(h, act, cfg=CURRENT, amax_in=amax, want=("y_hp",))
        got = forward(lay(h.cuda()), act, cfg=CURRENT, amax_in=amax.cuda(), want=("y_hp",))
        assert_same_bits(got, want, (m, k, "current"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_backward_matches_cpu_reference(act, dtype, layout):
    # dbias over many row chunks and groups: M = 3000 (R = 16, 188 partials), M = 40000 and
    # K = 40 (R = 64: 1250 chunks of 32 would pass 1024)
    lay = LAYOUTS[layout]
    shapes = GPU_SHAPES + (BIG_SHAPES + [(40000, 40)] if layout == "contiguous" else [(300, 40)])
    for i, (m, k) in enumerate(shapes):
        k = k if act in BASE else k - i % 2
        h, g = gpu_inputs(m, k, act, dtype, seed=10 + i)
        for label, kw in gpu_modes():
            kw = dict(kw, want=kw.get("want", ("dh", "amax")) + ("dbias",))
            want = backward(g, h, act, **kw)
            got = backward(lay(g.cuda()), lay(h.cuda()), act, layout=lay if i % 2 else None,
                           **to_cuda(kw))
            assert_same_bits(got, want, (m, k, label))
        amax = backward(g, h, act, want=("amax",))["amax"]
        want = backward(g, h, act, cfg=CURRENT, amax_in=amax, want=("dh",))
        got = backward(lay(g.cuda()), lay(h.cuda()), act, cfg=CURRENT, amax_in=amax.cuda(),
                       want=("dh",))
        assert_same_bits(got, want, (m, k, "current"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_nan_inf_and_sweep(act, dtype):
    """NaN / Inf rows and the accuracy sweep's values (every bf16 in [-40, 40] and more): the
    kernel's tequant e^x gives the C reference's bits everywhere."""
    x = sweep()[: 64 * 4096].to(dtype)
    h = x.view(64, 4096).clone()
    h[3, 7] = float("nan")
    h[10, :] = float("nan")
    h[20, 5] = float("inf")
    h[21, 9] = float("-inf")
    g = torch.randn(64, out_cols(act, 4096), generator=torch.Generator().manual_seed(2)).to(dtype)
    kw = dict(cfg=CFG_E4M3, scale=torch.tensor([16.0]))
    assert_same_bits(forward(h.cuda(), act, **to_cuda(kw)), forward(h, act, **kw), "nan fwd")
    assert_same_bits(backward(g.cuda(), h.cuda(), act, **to_cuda(kw)), backward(g, h, act, **kw),
                     "nan bwd")


@gpu
@pytest.mark.gpu
def test_cuda_runs_on_the_current_stream():
    h, dy, dy_g = make(512, 4096, torch.bfloat16, seed=1, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        h2 = h * 2
        got = forward(h2, "swiglu", cfg=CFG_E4M3, scale=torch.tensor([8.0], device="cuda"))
        b = backward(dy_g, h2, "swiglu")
    s.synchronize()
    want = forward(h2.cpu(), "swiglu", cfg=CFG_E4M3, scale=torch.tensor([8.0]))
    assert_same_bits(got, want, "stream")
    assert_same_bits(b, backward(dy_g.cpu(), h2.cpu(), "swiglu"), "stream backward")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("act", ["gelu", "silu", "qgelu", "geglu", "swiglu"])
def test_cuda_table_path_matches_cpu_reference(act):
    """bf16 gelu / silu / qgelu (and the gated ones over them) over many elements read act(x)
    and act'(x) from a shared-memory table of a window of exponents (cuda/act_table.cuh), x
    outside it computed directly: 2048 x 8192 (16.8M elements, 8.4M gated outputs: above
    tq_act_table::worth_it on a GPU of up to ~350 SMs), the first rows every bf16 bit pattern
    (NaNs, Infs, zeros, subnormals) then the accuracy sweep, the rest randn; forward with codes,
    y and amax, backward with codes, dh, amax and dbias, and current's cast run."""
    m, k = 2048, 8192
    h, dy, dy_g = make(m, k, torch.bfloat16, seed=4, scale=3.0)
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.cat([every, sweep().to(torch.bfloat16)])
    h.view(-1)[: x.numel()] = x
    g = grad_of(act, dy, dy_g)
    kw = dict(cfg=CFG_E4M3, scale=torch.tensor([20.0]), amax0=0.5)
    want = forward(h, act, **kw)
    assert_same_bits(forward(h.cuda(), act, **to_cuda(kw)), want, "table fwd")
    kwb = dict(kw, want=("dh", "amax", "dbias"))
    assert_same_bits(backward(g.cuda(), h.cuda(), act, **to_cuda(kwb)), backward(g, h, act, **kwb),
                     "table bwd")
    amax = torch.tensor([50.0])  # (the amax run's own is Inf here: h holds Inf)
    cur = forward(h, act, cfg=CURRENT, amax_in=amax, want=("y_hp",))
    assert_same_bits(forward(h.cuda(), act, cfg=CURRENT, amax_in=amax.cuda(), want=("y_hp",)),
                     cur, "table current fwd")
