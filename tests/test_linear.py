"""te.Linear (issue 5; NUMERICS.md 3.4, 4 and 5, TE_REFERENCE.md 7): the module against references.

For every recipe, y, dx, dW and dbias of a te.Linear under te.autocast are compared with float64
products of operands quantized by te.ops.quantize with the roles and directions of TE_REFERENCE 7.5
(NVFP4's stochastic rounding replayed from the same generator state), then bounded and shown to be
nonzero against an unquantized linear. Also: any token count and 3-D inputs, dtypes, bias and
return_bias, forwards without a graph, misaligned features, the weight cache over microbatches
and delayed-scaling steps. tests/test_linear_module.py imports the helpers here for autocast off /
nested / after an exception, construction and state_dict, backward_override and an MLP training
run. The module lives in python/tequant/linear.py; the GEMM references follow tests/test_gemm.py.
"""
import contextlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import tequant as te
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])]

RECIPES = {
    "delayed": DelayedScaling(),  # HYBRID: E5M2 grad_output; first step scale 1
    "current": Float8CurrentScaling(),  # HYBRID; fast accumulation in fprop
    "block": Float8BlockScaling(),  # x, dy 1x128, W 128x128
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),  # RHT on the wgrad operands, SR on grad_output, 16x16 W
}
NATIVE_FP8 = ("delayed", "current", "block")  # cuBLASLt FP8 on CUDA
FEATURE_MULTIPLE = {"delayed": 16, "current": 16, "block": 16, "mxfp8": 32, "nvfp4": 16}
# Rows the quantizer needs (NUMERICS 3.4): the module pads the tokens with zeros to this multiple.
ROW_MULTIPLE = {"delayed": 1, "current": 1, "block": 1, "mxfp8": 32, "nvfp4": 16}
GEMMS = ("fprop", "dgrad", "wgrad")
ROLES = ("input", "weight", "grad_output")
# Error bound vs an unquantized linear on randn data (NUMERICS 5: FP8 < 5e-2, NVFP4 < 2e-1); a
# product with an E5M2 operand (the HYBRID gradients) keeps one mantissa bit less: twice the bound.
QUANT_BOUND = {"E4M3": 0.05, "E5M2": 0.1, "E2M1": 0.2}
# A quantized result must be this far from the unquantized one: far above bf16 output rounding
# (~1e-3), far below any format's quantization error (>= 2e-2 on randn data).
QUANT_FLOOR = 5e-3


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """Every CPU tensor here is tiny: intra-op threads only contend (10x slower on a busy 2-core
    CI machine), so this file runs with one and restores the setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tol(name, gemm, dtype, device):
    """NUMERICS 5 vs a float64 product of the same dequantized operands: 1e-5 for fp32 output with
    full FP32 accumulation, 8e-3 for bf16 output or fast accumulation. Native FP8 GEMMs on Hopper
    (per-tensor and block pairs on CUDA) keep ~14 accumulator bits inside an MMA even with split
    accumulation (~1.3e-4 measured on an H200), so their fp32 outputs get 1e-3 (docs/gemm.md).
    The CPU path and the emulated MXFP8/NVFP4 GEMMs on CUDA meet 1e-5."""
    if dtype != torch.float32:
        return 8e-3
    if name in NATIVE_FP8 and torch.device(device).type == "cuda":
        split = te.gemm_split_accumulator(RECIPES[name])[GEMMS.index(gemm)]
        return 1e-3 if split else 8e-3
    return 1e-5


# ---- helpers -----------------------------------------------------------------------------------

def randn(*shape, seed, dtype=torch.float32, device="cpu", scale=1.0):
    """randn from its own generator (never the default one, whose state the SR replay saves)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def make_linear(k, n, *, dtype=torch.float32, device="cpu", bias=True, seed=0, **kwargs):
    """A te.Linear with randn weights (std 1/sqrt(k)) and a bias of bf16-representable values, so
    that the epilogue's bias dtype (bf16 for FP8 GEMMs) does not change it."""
    lin = te.Linear(k, n, bias=bias, params_dtype=dtype, device=device, **kwargs)
    with torch.no_grad():
        lin.weight.copy_(randn(n, k, seed=seed, scale=k ** -0.5))
        if bias:
            lin.bias.copy_(randn(n, seed=seed + 1).bfloat16())
    return lin


class RngReplay:
    """The device's default generator state, saved before a forward, so a reference can quantize
    grad_output with the same stochastic-rounding draws the module's backward took."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.state = torch.cuda.get_rng_state() if self.cuda else torch.get_rng_state()

    def restore(self):
        (torch.cuda.set_rng_state if self.cuda else torch.set_rng_state)(self.state)


class DelayedScales:
    """Expected DelayedScaling scales of one module (NUMERICS 2, fused update, margin 0, 'max'
    over a history longer than the test): every role starts at scale 1; each update appends the
    amax recorded since the last one (none when 0) and sets scale = fmax / max(history) in fp32."""

    def __init__(self, recipe):
        self.fmax = {r: 448.0 if te.quantizer_config(recipe, r).format == "E4M3" else 57344.0
                     for r in ROLES}
        self.history = {r: [] for r in ROLES}
        self.scales = {r: torch.ones(1) for r in ROLES}

    def snapshot(self):
        return dict(self.scales)

    def record(self, role, t):
        amax = t.detach().abs().max().float().cpu()
        if amax > 0:
            self.history[role].append(amax)
            self.scales[role] = (torch.tensor([self.fmax[role]])
                                 / torch.stack(self.history[role]).max()).reshape(1)


def pad_rows(t, multiple):
    m = t.shape[0]
    extra = -m % multiple
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, t.shape[1])])


def quantize(t, name, role, scales=None):
    kwargs = {}
    if scales is not None:
        kwargs["scale"] = scales[role].to(t.device)
    return te.ops.quantize(t, RECIPES[name], role, rowwise=True, columnwise=True, **kwargs)


def values(q, direction):
    """float64 values of one direction: rowwise [M, K], columnwise [K, M]."""
    return q.dequantize_direction(direction, torch.float32).double()


def reference(name, x, w, bias, dy, *, rng=None, scales=None, qw=None):
    """float64 y, dx, dW, db (and the quantized qx, qw, qdy) of a Linear under recipe `name`, as
    TE_REFERENCE 7.5 has them: y = x_row W_row^T + b, dx = dy_row W_col, dW = dy_col^T x_col,
    db = the sum of dy's rows.
    Tokens are padded with zero rows to the quantizer's multiple, as the module does (zeros change
    no amax, block or product; the padding decides the SR counters of NVFP4 gradients).
    rng: restored just before grad_output is quantized. scales: DelayedScaling scales per role.
    qw: a quantized weight to use instead of quantizing w (the microbatch cache)."""
    k, n = x.shape[-1], dy.shape[-1]
    m = x.numel() // k
    multiple = ROW_MULTIPLE[name]
    x2 = pad_rows(x.detach().reshape(m, k), multiple)
    dy2 = dy.detach().reshape(m, n)
    qx = quantize(x2, name, "input", scales)
    if qw is None:
        qw = quantize(w.detach(), name, "weight", scales)
    if rng is not None:
        rng.restore()
    qdy = quantize(pad_rows(dy2, multiple), name, "grad_output", scales)
    y = (values(qx, "rowwise") @ values(qw, "rowwise").t())[:m]
    if bias is not None:
        y = y + bias.detach().double()
    dx = (values(qdy, "rowwise") @ values(qw, "columnwise").t())[:m]
    dw = values(qdy, "columnwise") @ values(qx, "columnwise").t()
    return {"y": y.reshape(*x.shape[:-1], n), "dx": dx.reshape(x.shape), "dw": dw,
            "db": dy2.double().sum(0), "qx": qx, "qw": qw, "qdy": qdy}


def unquantized(x, w, bias, dy):
    """float64 y, dx, dW of the high-precision operands."""
    k, n = x.shape[-1], dy.shape[-1]
    x2, dy2 = x.detach().double().reshape(-1, k), dy.detach().double().reshape(-1, n)
    w = w.detach().double()
    y = x2 @ w.t() + (bias.detach().double() if bias is not None else 0)
    return {"y": y.reshape(*x.shape[:-1], n), "dx": (dy2 @ w).reshape(x.shape), "dw": dy2.t() @ x2}


def rel(got, want):
    got, want = got.detach().double().reshape(want.shape), want.detach().double().to(got.device)
    return float((got - want).norm() / want.norm())


def check(got, want, tol_, *, what="", dtype=None):
    assert got is not None, f"{what}: missing"
    assert tuple(got.shape) == tuple(want.shape), (what, tuple(got.shape), tuple(want.shape))
    if dtype is not None:
        assert got.dtype == dtype, (what, got.dtype)
    assert torch.isfinite(got).all(), f"{what}: not finite"
    err = rel(got, want)
    assert err < tol_, f"{what}: relative error {err:.3g} >= {tol_:g}"
    return err


def step(lin, x, dy, recipe, **kwargs):
    """Forward under te.autocast(recipe=recipe) (recipe None: no autocast), backward with dy.
    Returns (y, x.grad, replay) with replay the generator state saved before the forward."""
    x = x.detach().clone().requires_grad_()
    replay = RngReplay(x.device)
    ctx = te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
    with ctx:
        y = lin(x, **kwargs)
    y.backward(dy)
    return y, x.grad, replay


def check_step(name, lin, x, dy, *, device, dtype=torch.float32, **kwargs):
    """Runs one step of lin under `name`'s recipe and checks y, dx, dW, db against reference()."""
    lin.zero_grad(set_to_none=True)
    y, dx, replay = step(lin, x, dy, RECIPES[name])
    ref = reference(name, x, lin.weight, lin.bias, dy, rng=replay, **kwargs)
    check(y, ref["y"], tol(name, "fprop", dtype, device), what="y", dtype=x.dtype)
    check(dx, ref["dx"], tol(name, "dgrad", dtype, device), what="dx", dtype=x.dtype)
    check(lin.weight.grad, ref["dw"], tol(name, "wgrad", dtype, device), what="dW",
          dtype=lin.weight.dtype)
    if lin.bias is not None:
        check(lin.bias.grad, ref["db"], 1e-5 if dtype == torch.float32 else 8e-3, what="db")
    return y, dx, ref


def fmt(name, role):
    return te.quantizer_config(RECIPES[name], role).format


def bounds(name):
    """The unquantized-error bound of each output: the looser of its two operands' formats."""
    f = {r: QUANT_BOUND[fmt(name, r)] for r in ROLES}
    return {"y": max(f["input"], f["weight"]), "dx": max(f["grad_output"], f["weight"]),
            "dw": max(f["grad_output"], f["input"])}


# ---- every recipe against its quantized reference ----------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(RECIPES))
def test_matches_quantized_reference(name, dtype, device):
    """Delayed scaling's first step uses scale 1 for every tensor: te.ops.quantize's default."""
    m, k, n = 64, 160, 96  # K: a partial 128-block for Float8BlockScaling
    lin = make_linear(k, n, dtype=dtype, device=device, seed=1)
    x = randn(m, k, seed=2, dtype=dtype, device=device)
    dy = randn(m, n, seed=3, dtype=dtype, device=device)
    y, dx, ref = check_step(name, lin, x, dy, device=device, dtype=dtype)
    # the reference is made of quantized values; this proves the module quantized at all
    hp = unquantized(x, lin.weight, lin.bias, dy)
    bound = bounds(name)
    for key, got in (("y", y), ("dx", dx), ("dw", lin.weight.grad)):
        err = rel(got, hp[key])
        assert QUANT_FLOOR < err < bound[key], (key, err)


# Outliers that flush the other elements of their block to zero. NVFP4's E4M3 block scales
# under one global scale span only ~2^17, so there a milder outlier (RHT already makes its two
# directions of x and dy differ).
OUTLIER = {"block": 2.0 ** 22, "mxfp8": 2.0 ** 22, "nvfp4": 2.0 ** 10}


def direction_probe(product, size, outlier, device):
    """x [size, size], W, dy whose outliers make one direction of each operand of `product`
    ('fprop_dgrad' or 'wgrad') lose the small elements of some blocks while the other direction
    keeps them, the outliers themselves meeting zeros in that product. With randn data the two
    directions of an MXFP8 or FP8-block tensor hold almost the same values (power-of-two scales
    do not move a normal E4M3 value), so a swapped direction would go unnoticed.
      fprop_dgrad: x[:, 0] and W[0, :] large with W[:, 0] = 0 and dy[:, 0] = 0, dy[:, h] large
        with W[h, :] = 0: the rowwise blocks of x and dy and the columnwise blocks of W degrade.
      wgrad: x[0, :] large with dy[0, :] = 0, dy[h, :] large with x[h, :] = 0: the columnwise
        blocks of x and dy degrade.
    h = size / 3 puts the two outliers in different blocks and leaves a third 128-block that
    neither degrades, so the product keeps terms in both directions (a 128x128 weight tile
    degrades in both)."""
    x, w = randn(size, size, seed=130), randn(size, size, seed=131, scale=size ** -0.5)
    dy = randn(size, size, seed=132)
    big = outlier * torch.randn(size, generator=torch.Generator().manual_seed(133)).sign()
    h = size // 3
    if product == "fprop_dgrad":
        x[:, 0] = big
        w[0, :] = big
        w[:, 0] = 0
        w[h, :] = 0
        dy[:, 0] = 0
        dy[:, h] = big
    else:
        x[0, :] = big
        dy[0, :] = 0
        dy[h, :] = big
        x[h, :] = 0
    return x.to(device), w.to(device), dy.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("product", ["fprop_dgrad", "wgrad"])
@pytest.mark.parametrize("name", ["block", "mxfp8", "nvfp4"])
def test_each_gemm_reads_its_operand_directions(name, product, device):
    """fprop reads x and W rowwise, dgrad dy rowwise and W columnwise, wgrad dy and x columnwise:
    on direction_probe data the products of the other directions differ from the reference, so a
    swapped direction fails the reference check. (Per-tensor FP8 is left out: its two directions
    hold the same values, as do a 2D-block weight's.)"""
    size = 384
    x, w, dy = direction_probe(product, size, OUTLIER[name], device)
    lin = make_linear(size, size, device=device)
    with torch.no_grad():
        lin.weight.copy_(w)
    _, _, ref = check_step(name, lin, x, dy, device=device)
    qx, qw, qdy = ref["qx"], ref["qw"], ref["qdy"]
    swapped = {"y": values(qx, "columnwise").t() @ values(qw, "columnwise"),
               "dx": values(qdy, "columnwise").t() @ values(qw, "rowwise"),
               "dw": values(qdy, "rowwise").t() @ values(qx, "rowwise")}
    probed = (("y", "fprop"), ("dx", "dgrad")) if product == "fprop_dgrad" else (("dw", "wgrad"),)
    for key, gemm in probed:
        err = rel(swapped[key], ref[key])
        assert err > 10 * tol(name, gemm, torch.float32, device), (key, err)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_error_vs_torch_linear_is_bounded_and_not_zero(name, device):
    m, k, n = 128, 256, 128
    lin = make_linear(k, n, device=device, seed=4)
    ref_lin = torch.nn.Linear(k, n, device=device)
    with torch.no_grad():
        ref_lin.weight.copy_(lin.weight)
        ref_lin.bias.copy_(lin.bias)
    x, dy = randn(m, k, seed=5, device=device), randn(m, n, seed=6, device=device)
    y, dx, _ = step(lin, x, dy, RECIPES[name])
    y_ref, dx_ref, _ = step(ref_lin, x, dy, None)
    bound = bounds(name)
    for key, got, want in (("y", y, y_ref), ("dx", dx, dx_ref),
                           ("dw", lin.weight.grad, ref_lin.weight.grad)):
        err = rel(got, want.double())
        assert QUANT_FLOOR < err < bound[key], (key, err)
    # dbias is a high-precision sum in both
    assert rel(lin.bias.grad, ref_lin.bias.grad.double()) < 1e-5


# ---- shapes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 7, 1000])
@pytest.mark.parametrize("name", list(RECIPES))
def test_any_token_count(name, m, device):
    k, n = 64, 32
    lin = make_linear(k, n, device=device, seed=m)
    x, dy = randn(m, k, seed=m + 1, device=device), randn(m, n, seed=m + 2, device=device)
    y, dx, _ = check_step(name, lin, x, dy, device=device)
    assert y.shape == (m, n) and dx.shape == (m, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_three_dim_input(name, device):
    k, n = 64, 32
    lin = make_linear(k, n, device=device, seed=7)
    x, dy = randn(2, 5, k, seed=8, device=device), randn(2, 5, n, seed=9, device=device)  # M = 10
    y, dx, _ = check_step(name, lin, x, dy, device=device)
    assert y.shape == (2, 5, n) and dx.shape == (2, 5, k)
    # non-contiguous views of x and dy ([5, 2, .] transposed), on a fresh module (DelayedScaling
    # moved the scales of this one)
    x_t = randn(5, 2, k, seed=8, device=device).transpose(0, 1)
    dy_t = randn(5, 2, n, seed=9, device=device).transpose(0, 1)
    assert not x_t.is_contiguous() and not dy_t.is_contiguous()
    lin = make_linear(k, n, device=device, seed=7)
    x_t = x_t.requires_grad_()
    replay = RngReplay(device)
    with te.autocast(recipe=RECIPES[name]):
        y = lin(x_t)
    y.backward(dy_t)
    ref = reference(name, x_t, lin.weight, lin.bias, dy_t, rng=replay)
    check(y, ref["y"], tol(name, "fprop", torch.float32, device), what="y")
    check(x_t.grad, ref["dx"], tol(name, "dgrad", torch.float32, device), what="dx")
    check(lin.weight.grad, ref["dw"], tol(name, "wgrad", torch.float32, device), what="dW")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(RECIPES))
def test_one_dim_input_matches_one_row(name, dtype, device):
    """x [K] (one token, no leading dims) gives exactly the results of x [1, K]: out, dx, dW and
    the bias grad (which then sums nothing and is dy itself in the bias's dtype)."""
    k, n = 64, 32
    results = []
    for shape in [(k,), (1, k)]:
        lin = make_linear(k, n, dtype=dtype, device=device, seed=3)
        x = randn(*shape, seed=4, dtype=dtype, device=device).requires_grad_()
        dy = randn(*shape[:-1], n, seed=5, dtype=dtype, device=device)
        torch.manual_seed(6)  # the same stochastic-rounding draws for both shapes
        if device == "cuda":
            torch.cuda.manual_seed(6)
        with te.autocast(recipe=RECIPES[name]):
            y = lin(x)
        y.backward(dy)
        assert y.shape == shape[:-1] + (n,) and lin.bias.grad.dtype == dtype
        results.append([y.reshape(-1), x.grad.reshape(-1), lin.weight.grad, lin.bias.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["current", "mxfp8", "nvfp4"])
def test_without_bias(name, device):
    lin = make_linear(64, 32, device=device, bias=False, seed=10)
    assert lin.bias is None and [p for p, _ in lin.named_parameters()] == ["weight"]
    x, dy = randn(48, 64, seed=11, device=device), randn(48, 32, seed=12, device=device)
    check_step(name, lin, x, dy, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["current", "block", "nvfp4", None])
def test_return_bias(name, device):
    """return_bias=True returns (out, bias) with the bias not added, in and out of autocast."""
    k, n = 64, 32
    lin = make_linear(k, n, device=device, seed=13, return_bias=True)
    x = randn(48, k, seed=14, device=device)
    with te.autocast(recipe=RECIPES[name]) if name else contextlib.nullcontext():
        result = lin(x)
    assert isinstance(result, tuple) and len(result) == 2
    y, b = result
    assert torch.equal(b, lin.bias) and b.dtype == lin.bias.dtype
    if name is None:
        assert torch.equal(y, F.linear(x, lin.weight))
    else:
        want = reference(name, x, lin.weight, None, torch.zeros(48, n, device=device))["y"]
        check(y, want, tol(name, "fprop", torch.float32, device), what="y")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_forward_without_a_graph_has_the_training_forwards_bits(mode, name, device):
    """With no graph to record, forward skips the autograd.Function (and x's columnwise copy):
    its output must still be the training forward's, bit for bit, and DelayedScaling must
    record the same amaxes."""
    k, n = 64, 32
    lin = make_linear(k, n, device=device, seed=21)
    x = randn(3, 17, k, seed=22, device=device)  # 51 tokens: padded rows for MXFP8 / NVFP4
    recipe = RECIPES[name]
    with te.autocast(recipe=recipe):
        want = lin(x.clone().requires_grad_())
    if name == "delayed":  # back to the first step's state: scales 1, an empty history
        recorded = lin.delayed_amax_history_fwd[-1].clone()  # the exit rolled row 0 to the end
        lin.delayed_scale_fwd.fill_(1.0)
        lin.delayed_amax_history_fwd.zero_()
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "nothing_requires_grad": contextlib.nullcontext}[mode]
    if mode == "nothing_requires_grad":
        for p in lin.parameters():
            p.requires_grad_(False)
    with context(), te.autocast(recipe=recipe):
        got = lin(x)
    assert not got.requires_grad and got.shape == want.shape
    assert torch.equal(got, want.detach())
    if name == "delayed":  # recorded the same amaxes; grad mode on: updated at the exit
        row = -1 if mode == "nothing_requires_grad" else 0
        assert torch.equal(lin.delayed_amax_history_fwd[row], recorded)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("grad_mode", [True, False])
def test_forward_mode_ad_and_vmap_are_refused(grad_mode):
    """te.Linear has no jvp and no vmap rule: a dual or batched input must raise in every grad
    mode (the no-graph forward would return the primal alone, silently losing the tangent)."""
    lin = make_linear(32, 16, seed=23)
    x, t = randn(4, 32, seed=24), randn(4, 32, seed=25)
    with fwAD.dual_level(), te.autocast(recipe=RECIPES["current"]), \
            torch.set_grad_enabled(grad_mode), pytest.raises(NotImplementedError, match="jvp"):
        lin(fwAD.make_dual(x, t))
    # vmap likewise gets torch's "setup_context" refusal, not an error from the C call
    with te.autocast(recipe=RECIPES["current"]), torch.set_grad_enabled(grad_mode), \
            pytest.raises(RuntimeError, match="setup_context"):
        torch.vmap(lin)(x.reshape(2, 2, 32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["current", "mxfp8", "nvfp4"])
def test_frozen_weight_and_inference(name, device):
    """A frozen weight still gets dx (and no dW); under torch.no_grad the output is the same."""
    k, n = 64, 32
    lin = make_linear(k, n, device=device, seed=18)
    lin.weight.requires_grad_(False)
    x, dy = randn(48, k, seed=19, device=device), randn(48, n, seed=20, device=device)
    y, dx, replay = step(lin, x, dy, RECIPES[name])
    ref = reference(name, x, lin.weight, lin.bias, dy, rng=replay)
    check(y, ref["y"], tol(name, "fprop", torch.float32, device), what="y")
    check(dx, ref["dx"], tol(name, "dgrad", torch.float32, device), what="dx")
    assert lin.weight.grad is None
    check(lin.bias.grad, ref["db"], 1e-5, what="db")
    lin.weight.requires_grad_(True)
    with torch.no_grad(), te.autocast(recipe=RECIPES[name]):
        y_inference = lin(x)
    assert not y_inference.requires_grad
    check(y_inference, ref["y"], tol(name, "fprop", torch.float32, device), what="y (no_grad)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["in", "out"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_misaligned_features_raise(name, which, device):
    """in/out features off the format's multiple raise ValueError naming the dim and the multiple
    under autocast; outside autocast the same module is an ordinary linear."""
    multiple = FEATURE_MULTIPLE[name]
    bad = multiple * 3 // 2 if multiple == 32 else multiple + 8  # 48 for 32, 24 for 16
    k, n = (bad, 64) if which == "in" else (64, bad)
    lin = make_linear(k, n, device=device, seed=15)
    x = randn(32, k, seed=16, device=device)
    with pytest.raises(ValueError) as info:
        with te.autocast(recipe=RECIPES[name]):
            lin(x)
    message = str(info.value)
    assert str(bad) in message and str(multiple) in message, message
    assert te.autocast_depth() == 0
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["current", "mxfp8", "nvfp4"])
def test_output_dtype_follows_input(name, device):
    """fp32 params with a bf16 input: y and dx are bf16, dW fp32 (the weight's)."""
    k, n = 64, 32
    lin = make_linear(k, n, device=device, seed=17)
    x = randn(32, k, seed=18, device=device, dtype=torch.bfloat16)
    dy = randn(32, n, seed=19, device=device, dtype=torch.bfloat16)
    y, dx, _ = step(lin, x, dy, RECIPES[name])
    assert y.dtype == dx.dtype == torch.bfloat16 and lin.weight.grad.dtype == torch.float32
    hp = unquantized(x, lin.weight, lin.bias, dy)
    bound = bounds(name)
    for key, got in (("y", y), ("dx", dx), ("dw", lin.weight.grad)):
        assert QUANT_FLOOR < rel(got, hp[key]) < bound[key], key


# ---- microbatches and delayed scaling ----------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_microbatches_reuse_the_cached_weight(name, device):
    """is_first_microbatch True then False twice: the False calls reuse the weight quantized by
    the True call even though weight.data changed after it (fprop and dgrad), wgrads accumulate;
    a following None call requantizes and sees the new weight. DelayedScaling's scales move
    between microbatches (each its own autocast) and are tracked by DelayedScales."""
    m, k, n = 48, 64, 32
    lin = make_linear(k, n, device=device, seed=20)
    scales = DelayedScales(RECIPES[name]) if name == "delayed" else None
    dw_sum = db_sum = qw = None
    for i, first in enumerate((True, False, False, None)):
        if i == 3:
            lin.zero_grad(set_to_none=True)
        x, dy = randn(m, k, seed=21 + i, device=device), randn(m, n, seed=31 + i, device=device)
        snapshot = scales.snapshot() if scales else None
        y, dx, replay = step(lin, x, dy, RECIPES[name], is_first_microbatch=first)
        cached = qw if first is False else None
        ref = reference(name, x, lin.weight, lin.bias, dy, rng=replay, scales=snapshot, qw=cached)
        if scales:
            scales.record("input", x)
            if cached is None:
                scales.record("weight", lin.weight)
            scales.record("grad_output", dy)
        check(y, ref["y"], tol(name, "fprop", torch.float32, device), what=f"y[{i}]")
        check(dx, ref["dx"], tol(name, "dgrad", torch.float32, device), what=f"dx[{i}]")
        if i < 3:
            dw_sum = ref["dw"] if dw_sum is None else dw_sum + ref["dw"]
            db_sum = ref["db"] if db_sum is None else db_sum + ref["db"]
            check(lin.weight.grad, dw_sum, tol(name, "wgrad", torch.float32, device),
                  what=f"sum dW[{i}]")
            check(lin.bias.grad, db_sum, 1e-5, what=f"sum db[{i}]")
        else:
            check(lin.weight.grad, ref["dw"], tol(name, "wgrad", torch.float32, device),
                  what="dW[3]")
        if i == 0:
            qw = ref["qw"]
            with torch.no_grad():  # not seen by the cached calls, seen by the None call
                lin.weight.data.add_(randn(n, k, seed=41, device=device, scale=k ** -0.5))
        if i == 3:  # the new weight is really different: the cached one would fail the check
            stale = reference(name, x, lin.weight, lin.bias, dy, scales=snapshot, qw=qw)["y"]
            assert rel(y, stale) > 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_scales_follow_the_amax_history(device):
    """Step t uses scales from the amaxes of steps < t: forward roles updated at the autocast
    exit, grad_output at the end of backward. The weight changes between steps."""
    m, k, n = 64, 64, 32
    lin = make_linear(k, n, device=device, seed=50)
    scales = DelayedScales(RECIPES["delayed"])
    for t in range(3):
        x = randn(m, k, seed=51 + t, device=device, scale=1.0 + t)  # growing amaxes
        dy = randn(m, n, seed=61 + t, device=device, scale=0.5 + t)
        snapshot = scales.snapshot()
        y, _, ref = check_step("delayed", lin, x, dy, device=device, scales=snapshot)
        if t > 0:  # the scales moved off 1: the first-step reference no longer fits
            first_step = reference("delayed", x, lin.weight, lin.bias, dy)
            assert rel(y, first_step["y"]) > 1e-3
        for role, t_ in (("input", x), ("weight", lin.weight), ("grad_output", dy)):
            scales.record(role, t_)
        with torch.no_grad():
            lin.weight.add_(randn(n, k, seed=71 + t, device=device, scale=0.3 * k ** -0.5))
