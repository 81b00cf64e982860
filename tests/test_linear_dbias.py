"""te.Linear's bias gradient from tequant's core (issue 24, item 2): tq_quantize's dbias output
(csrc/core/quantize_dbias.c, csrc/ext/linear_dbias.c), which sums grad_output's columns in the
pass that quantizes it where the scaling allows (DelayedScaling: the cast; Float8CurrentScaling:
the amax pass), through the activation backward kernel's TQ_ACT_IDENTITY instance.

CPU: (a) the identity instance (_C._act_backward(dy, dy, "identity")) against torch: dh is dy,
dbias bit for bit a torch emulation of tequant's column order (test_norm_kernels's
ordered_column_sum) rounded to dbias's dtype, its FP8 codes those of _C._quantize; (b) _C._quantize
with a dbias for every recipe's configs, usage and dtype: the members (and a DelayedScaling
history slot) bit-identical to the same call without dbias, dbias in the column order; NaN / Inf
/ -0, M = 0, errors; (c) te.Linear under every recipe: the bias gradient within a tight bound of
torch's FP32 sum and bit for bit the column order over grad_output padded to the format's rows
(any leading shape, no tokens, one token, float32 / bfloat16 / float16, a float32 bias under
torch.autocast), dx and dW bit-identical to the same layer without a bias (grad_output's codes
are unchanged), the bias gradient alone, and under torch.compile the eager bits.
GPU (marked, skipped without CUDA): the same calls on CUDA against the C reference, bit for bit,
and a CUDA-graph replay of a te.Linear step.
"""
import copy

import pytest
import torch

import tequant as te
from tequant import _C
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                            MXFP8BlockScaling, NVFP4BlockScaling)
from test_norm_kernels import bits, misaligned, ordered_column_sum  # noqa: E402 (tests/ on path)

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = [F32, BF16, F16]
RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),  # grad_output: RHT on the columnwise copy, stochastic rounding
}
ROW_MULTIPLE = {"delayed": 1, "current": 1, "block": 1, "mxfp8": 32, "nvfp4": 16}
# (recipe, role) per quantizer family and flag set the dbias path takes apart
CONFIGS = {
    "delayed-grad": (RECIPES["delayed"], "grad_output"),  # E5M2
    "delayed-input": (RECIPES["delayed"], "input"),  # E4M3
    "current-grad": (RECIPES["current"], "grad_output"),
    "current-e4m3": (Float8CurrentScaling(fp8_format=Format.E4M3), "grad_output"),
    "block-grad": (RECIPES["block"], "grad_output"),
    "mxfp8-grad": (RECIPES["mxfp8"], "grad_output"),
    "nvfp4-grad": (RECIPES["nvfp4"], "grad_output"),
    "nvfp4-plain": (NVFP4BlockScaling(disable_rht=True), "input"),
}
# shapes each family takes (MXFP8: multiples of 32; NVFP4: of 16); 1000 rows: 63 row chunks, two
# groups of the column order
SHAPES = {
    "fp8": [(0, 16), (1, 8), (33, 72), (1000, 48)],
    "mxfp8": [(0, 32), (64, 96), (1024, 64)],
    "nvfp4": [(0, 16), (48, 32), (1008, 48)],
}
FAMILY = {"delayed": "fp8", "current": "fp8", "block": "fp8", "mxfp8": "mxfp8", "nvfp4": "nvfp4"}
USAGES = {"row": 1, "col": 2, "both": 3}
MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t")
NAN32 = 0x7FFFFFFF


def randn(*shape, seed, dtype=F32, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def column_sums(x, dtype):
    """tequant's column order over the float32 x, rounded once to dtype (torch's own RNE)."""
    return ordered_column_sum(x.detach().float().cpu()).to(dtype)


def assert_same(got, want, what):
    """Bit for bit, except that a NaN only needs to be a NaN (torch's NaN bits are its own)."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, what
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan), what
    assert torch.equal(bits(got)[~nan], bits(want)[~nan]), what


def pad_rows(t, multiple):
    extra = -t.shape[0] % multiple
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, t.shape[1])])


# ---- (a) the identity instance of the activation backward kernel -----------------------------

@pytest.mark.parametrize("dbias_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_identity_backward_is_dy_and_dbias_in_tequant_order(dtype, dbias_dtype):
    """dh = dy exactly (signed zeros included); dbias = the column order's FP32 sums of dy rounded
    once to dbias's dtype; h is not read (a NaN h changes nothing); 40000 x 40: 625 row chunks of
    64, 20 groups."""
    for i, (m, k) in enumerate([(0, 8), (1, 5), (17, 33), (300, 64), (40000, 40)]):
        dy = randn(m, k, seed=i, dtype=dtype)
        if m > 2:
            dy[2, ::2] = -0.0
        dh, dbias = torch.empty_like(dy), torch.full((k,), 7.0, dtype=dbias_dtype)
        _C._act_backward(dy, torch.full_like(dy, float("nan")), "identity", dh=dh, dbias=dbias)
        assert torch.equal(bits(dh), bits(dy)), (m, k)
        assert_same(dbias, column_sums(dy, dbias_dtype), (m, k))
    y = torch.empty_like(dy)
    _C._act_forward(dy, "identity", y_hp=y)
    assert torch.equal(bits(y), bits(dy))


@pytest.mark.parametrize("name", ["delayed-grad", "delayed-input", "current-grad"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_identity_codes_are_quantize_codes(name, dtype):
    """The identity instance's FP8 codes, scale_inv and amax are _C._quantize's of dy (DELAYED:
    the given scale, max |dy| max-accumulated; CURRENT: the amax run, then the cast run)."""
    cfg = te.quantizer_config(*CONFIGS[name])
    dy = randn(45, 40, seed=3, dtype=dtype, scale=30.0)
    delayed = cfg.scaling == "delayed"
    scale = torch.tensor([0.75]) if delayed else None
    slot = torch.tensor([0.5])
    want = _C._quantize(dy, cfg, 1, scale, slot.clone() if delayed else None, None, None)
    codes, sinv, amax = torch.empty(45, 40, dtype=torch.uint8), torch.empty(1), slot.clone()
    if delayed:
        _C._act_backward(dy, dy, "identity", amax=amax, config=cfg, dh_q=codes, scale_inv=sinv,
                         scale=scale)
    else:
        amax.zero_()
        _C._act_backward(dy, dy, "identity", amax=amax)
        _C._act_backward(dy, dy, "identity", config=cfg, dh_q=codes, scale_inv=sinv,
                         amax_in=amax)
    assert torch.equal(codes, want[0].view(torch.uint8))
    assert torch.equal(bits(sinv), bits(want[1].reshape(1)))
    assert torch.equal(bits(amax), bits(want[4].reshape(1)))


# ---- (b) tq_quantize with dbias ---------------------------------------------------------------

def _quantize_pair(x, cfg, usage, dbias_dtype, amax_in=None):
    """(members without dbias, members with, dbias): the same call twice, DelayedScaling from the
    same history slot and scale, NVFP4's stochastic rounding from the same (seed, offset)."""
    delayed = cfg.scaling == "delayed"
    scale = torch.tensor([0.5], device=x.device) if delayed else None
    rng = (1234, 64) if cfg.stochastic_rounding else None
    slots = [torch.tensor([0.25], device=x.device) if delayed else None for _ in range(2)]
    plain = _C._quantize(x, cfg, usage, scale, slots[0], rng, amax_in)
    dbias = torch.full((x.shape[1],), float("nan"), dtype=dbias_dtype, device=x.device)
    fused = _C._quantize(x, cfg, usage, scale, slots[1], rng, amax_in, dbias)
    return plain, fused, dbias


def _assert_members_equal(plain, fused, what):
    for name, a, b in zip(MEMBERS, plain, fused):
        assert (a is None) == (b is None), (what, name)
        if a is not None:
            assert torch.equal(bits(a.view(torch.uint8) if a.element_size() == 1 else a),
                               bits(b.view(torch.uint8) if b.element_size() == 1 else b)), \
                (what, name)


@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_quantize_dbias_keeps_the_codes_and_sums_in_tequant_order(name, usage):
    cfg = te.quantizer_config(*CONFIGS[name])
    family = FAMILY[name.split("-")[0]]
    for i, (m, k) in enumerate(SHAPES[family]):
        dtype, dbias_dtype = DTYPES[i % 3], DTYPES[(i + USAGES[usage]) % 3]
        x = randn(m, k, seed=10 + i, dtype=dtype, scale=4.0)
        if m > 3:
            x[3] = -0.0
        plain, fused, dbias = _quantize_pair(x, cfg, USAGES[usage], dbias_dtype)
        _assert_members_equal(plain, fused, (m, k))
        assert_same(dbias, column_sums(x, dbias_dtype), (m, k))


def test_quantize_dbias_with_a_given_amax():
    """Current scaling with a given (all-reduced) amax: the pass only sums; the cast uses the
    given amax as without dbias."""
    cfg = te.quantizer_config(*CONFIGS["current-grad"])
    x = randn(70, 48, seed=5, dtype=BF16)
    plain, fused, dbias = _quantize_pair(x, cfg, 3, F32, amax_in=torch.tensor([9.0]))
    _assert_members_equal(plain, fused, "given amax")
    assert fused[4].item() == 9.0
    assert_same(dbias, column_sums(x, F32), "given amax")


@pytest.mark.parametrize("name", ["delayed-grad", "current-grad", "block-grad"])
def test_quantize_dbias_nan_inf_and_signed_zero(name):
    """A NaN column sums to the canonical NaN (float32 0x7FFFFFFF), an Inf one to Inf, a column of
    -0 to +0 (the order adds onto +0); the codes stay those of the plain quantize."""
    cfg = te.quantizer_config(*CONFIGS[name])
    x = randn(40, 32, seed=6)
    x[5, 1] = float("nan")
    x[7, 2] = float("inf")
    x[:, 3] = -0.0
    plain, fused, dbias = _quantize_pair(x, cfg, 3, F32)
    _assert_members_equal(plain, fused, name)
    assert bits(dbias)[1].item() == NAN32 and dbias[2].item() == float("inf")
    assert bits(dbias)[3].item() == 0
    assert_same(dbias, column_sums(x, F32), name)


def test_quantize_dbias_errors():
    cfg = te.quantizer_config(*CONFIGS["current-grad"])
    x = randn(4, 8, seed=0)
    with pytest.raises(ValueError, match="quantize: dbias is float32 \\[1, 7\\] \\(ld 7\\); "
                                         "expected 8 contiguous float32/bfloat16/float16"):
        _C._quantize(x, cfg, 3, None, None, None, None, torch.empty(7))
    with pytest.raises(ValueError, match="dbias has dtype float64"):
        _C._quantize(x, cfg, 3, None, None, None, None, torch.empty(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="takes 7 or 8 arguments"):
        _C._quantize(x, cfg, 3, None, None, None, None, None, None)
    with pytest.raises(ValueError, match="act must be one of .*'identity', got 'Identity'"):
        _C._act_backward(x, x, "Identity")


# ---- (c) te.Linear ----------------------------------------------------------------------------

def make_linear(k, n, dtype, seed=0, bias=True):
    lin = te.Linear(k, n, bias=bias, params_dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(randn(n, k, seed=seed, scale=k ** -0.5))
        if bias:
            lin.bias.copy_(randn(n, seed=seed + 1))
    return lin


def run_linear(lin, x, dy, recipe, seed=7):
    """forward + backward(dy) under te.autocast; the same stochastic-rounding draws per seed."""
    torch.manual_seed(seed)
    with te.autocast(recipe=recipe):
        y = lin(x)
    y.backward(dy)
    return y


def check_bias_grad(db, dy2d, multiple, what):
    """Within a tight bound of torch's FP32 sum rounded to the bias's dtype (1e-6 of the sum of
    |dy| for the different summation order, plus one step of the dtype where the two FP32 sums
    round apart), and bit for bit tequant's column order over dy zero-padded to the format's
    rows."""
    db, dy32 = db.detach().cpu(), dy2d.detach().cpu().float()
    want = dy32.sum(0).to(db.dtype).float()
    bound = torch.finfo(db.dtype).eps * want.abs() + 1e-6 * dy32.abs().sum(0)
    assert bool(((db.float() - want).abs() <= bound).all()), what
    assert_same(db, column_sums(pad_rows(dy32, multiple), db.dtype), what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_bias_grad_is_the_fp32_sum_for_every_recipe(name, dtype):
    """Leading dims (3, 17): 51 tokens, padded to 64 for MXFP8 and NVFP4; 2 x 40 tokens; 5 x 321
    (101 row chunks: the order's float32 bits differ from torch's sum in 60 of 96 columns); no
    tokens (dbias 0); one token without leading dims."""
    k, n = 64, 96
    for i, shape in enumerate([(3, 17, k), (2, 40, k), (5, 321, k), (0, k), (k,)]):
        lin = make_linear(k, n, dtype, seed=i)
        x = randn(*shape, seed=20 + i, dtype=dtype).requires_grad_()
        dy = randn(*shape[:-1], n, seed=30 + i, dtype=dtype)
        run_linear(lin, x, dy, RECIPES[name])
        assert lin.bias.grad.dtype == dtype and lin.bias.grad.shape == (n,)
        check_bias_grad(lin.bias.grad, dy.reshape(-1, n), ROW_MULTIPLE[name], (shape, dtype))
        if shape[0] == 0:
            assert not lin.bias.grad.any()


@pytest.mark.parametrize("name", ["delayed", "current", "mxfp8"])
def test_float32_bias_from_bfloat16_grad_output_under_torch_autocast(name):
    """torch.autocast: dy bfloat16, the bias float32: the sums are stored in float32."""
    lin = make_linear(64, 32, F32, seed=4)
    x = randn(5, 13, 64, seed=5).requires_grad_()
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=BF16), te.autocast(recipe=RECIPES[name]):
        y = lin(x)
    assert y.dtype == BF16
    dy = randn(5, 13, 32, seed=6, dtype=BF16)
    y.backward(dy)
    assert lin.bias.grad.dtype == F32
    check_bias_grad(lin.bias.grad, dy.reshape(-1, 32), ROW_MULTIPLE[name], name)


@pytest.mark.parametrize("name", list(RECIPES))
def test_dx_and_dw_are_those_of_the_layer_without_bias(name):
    """grad_output's codes are unchanged by the fused sums: dx, dW (and DelayedScaling's backward
    amax history) equal, bit for bit, those of the same layer without a bias."""
    results = []
    for bias in (True, False):
        lin = make_linear(64, 32, BF16, seed=8, bias=bias)
        for step in range(2):  # DelayedScaling: the second step casts with updated scales
            x = randn(3, 17, 64, seed=40 + step, dtype=BF16).requires_grad_()
            dy = randn(3, 17, 32, seed=50 + step, dtype=BF16)
            lin.zero_grad(set_to_none=True)
            run_linear(lin, x, dy, RECIPES[name], seed=step)
        results.append([x.grad, lin.weight.grad] + [b.clone() for b in lin.buffers()])
    for a, b in zip(*results):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("name", list(RECIPES))
def test_bias_grad_alone(name):
    """Only the bias needs a gradient (frozen weight, x without grad): no GEMM runs, the sums
    run alone and give the same bits as with dx and dW."""
    grads = []
    for alone in (True, False):
        lin = make_linear(64, 32, BF16, seed=9)
        lin.weight.requires_grad_(not alone)
        x = randn(3, 17, 64, seed=60, dtype=BF16).requires_grad_(not alone)
        run_linear(lin, x, randn(3, 17, 32, seed=61, dtype=BF16), RECIPES[name])
        assert (lin.weight.grad is None) == alone
        grads.append(lin.bias.grad)
    assert torch.equal(bits(grads[0]), bits(grads[1]))


@pytest.mark.parametrize("name", list(RECIPES))
def test_compiled_bias_grad_is_eager_bits(name):
    """torch.compile (aot_eager, fullgraph) runs the same C backward: the same bias grad bits."""
    torch._dynamo.reset()
    lin = make_linear(64, 64, BF16, seed=11)
    twin = copy.deepcopy(lin)
    x = randn(3, 7, 64, seed=70, dtype=BF16)
    dy = randn(3, 7, 64, seed=71, dtype=BF16)

    def step(module, inp):
        with te.autocast(recipe=RECIPES[name]):
            return module(inp)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for fn, module in ((step, lin), (compiled, twin)):
        torch.manual_seed(3)
        fn(module, x.clone().requires_grad_()).backward(dy)
    torch._dynamo.reset()
    assert torch.equal(bits(lin.bias.grad), bits(twin.bias.grad))
    check_bias_grad(twin.bias.grad, dy.reshape(-1, 64), ROW_MULTIPLE[name], name)


# ---- GPU: CUDA against the C reference, bit for bit -----------------------------------------

LAYOUTS = {"contiguous": lambda t: t, "misaligned": misaligned,
           "strided": lambda t: torch.cat([t, t], 1)[:, :t.shape[1]]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES)
@gpu
@pytest.mark.gpu
def test_cuda_identity_backward_matches_cpu_reference(dtype, layout):
    """dh, delayed codes + amax + scale_inv and dbias of every dtype; 40000 x 40 and 3000 x 1032
    (more work than a full grid: grid-striding)."""
    cfg = te.quantizer_config(*CONFIGS["delayed-grad"])
    for i, (m, k) in enumerate([(0, 64), (1, 2), (17, 1030), (40000, 40), (3000, 1032)]):
        dy = randn(m, k, seed=80 + i, dtype=dtype, scale=8.0)
        if m > 5:
            dy[5, 0] = float("nan")
        outs = []
        for device in ("cpu", "cuda"):
            d = LAYOUTS[layout](dy.to(device))
            o = {"dh": torch.empty(m, k, dtype=dtype, device=device),
                 "dh_q": torch.empty(m, k, dtype=torch.uint8, device=device),
                 "scale_inv": torch.empty(1, device=device),
                 "amax": torch.tensor([0.5], device=device),
                 "dbias": torch.empty(k, dtype=DTYPES[i % 3], device=device)}
            _C._act_backward(d, d, "identity", config=cfg, scale=torch.tensor([0.5], device=device),
                             **o)
            outs.append(o)
        for key in outs[0]:
            assert torch.equal(bits(outs[0][key]), bits(outs[1][key])), (m, k, key)


@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("name", list(CONFIGS))
@gpu
@pytest.mark.gpu
def test_cuda_quantize_dbias_matches_cpu_reference(name, usage):
    """Per-tensor FP8 also at row chunks of 8 rows (K <= 1024 and more than 4096 rows:
    DelayedScaling's pass writes the columnwise codes of chunks of 4 or 8 rows itself), one of
    them ragged."""
    cfg = te.quantizer_config(*CONFIGS[name])
    family = FAMILY[name.split("-")[0]]
    extra = [(4096, 256)] + ([(5003, 40), (8192, 512)] if family == "fp8" else [])
    for i, (m, k) in enumerate(SHAPES[family] + extra):
        x = randn(m, k, seed=90 + i, dtype=DTYPES[i % 3], scale=3.0)
        got = []
        for device in ("cpu", "cuda"):
            _, fused, dbias = _quantize_pair(x.to(device), cfg, USAGES[usage], DTYPES[(i + 1) % 3])
            got.append((fused, dbias))
        _assert_members_equal(got[0][0], got[1][0], (name, m, k))
        assert torch.equal(bits(got[0][1]), bits(got[1][1])), (name, m, k)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("name", list(RECIPES))
@gpu
@pytest.mark.gpu
def test_cuda_linear_bias_grad_matches_cpu(name, dtype):
    """The bias grad depends on grad_output alone: CUDA's equals the CPU reference's bits."""
    grads = []
    for device in ("cpu", "cuda"):
        lin = make_linear(64, 96, dtype, seed=12).to(device)
        x = randn(3, 17, 64, seed=13, dtype=dtype, device=device).requires_grad_()
        run_linear(lin, x, randn(3, 17, 96, seed=14, dtype=dtype, device=device), RECIPES[name])
        grads.append(lin.bias.grad.cpu())
    assert torch.equal(bits(grads[0]), bits(grads[1]))


@pytest.mark.parametrize("name", list(RECIPES))
@gpu
@pytest.mark.gpu
def test_cuda_graph_replays_the_bias_grad(name):
    """A captured fwd+bwd of a te.Linear (workspace from the graph's pool, no host sync): each
    replay's bias grad equals an eager step's bits on the same grad_output."""
    lin = make_linear(64, 32, BF16, seed=15).cuda()
    x = randn(50, 64, seed=16, dtype=BF16, device="cuda")
    dy = randn(50, 32, seed=17, dtype=BF16, device="cuda")
    recipe = RECIPES[name]

    def step():
        lin.bias.grad = None
        with te.autocast(recipe=recipe):
            y = lin(x)
        y.backward(dy)
        return lin.bias.grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            eager = step().clone()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out), bits(eager))
    check_bias_grad(out, dy, ROW_MULTIPLE[name], name)
