"""fc1's grad_output written by te.LayerNormMLP's activation backward (issue 24, fused dh):
python/tequant/_act_fn.py (GradOutput, the tequant::act_bwd op), _dy_given.py (given_dy_backward,
tequant::linear_bwd_dy_given), linear.py and _compile_linear.py (fc1's side).

- The fused path runs: fc1's C backward gets dy as a quantized tuple holding the activation
  backward's codes (a spy on _C.linear_backward); block / MXFP8 / NVFP4, outside te.autocast, a
  hooked fc1 and torch's activation keep dy in high precision.
- What fc1 receives is the kernel's, run standalone with fc1's scale, bit for bit; float32: the
  codes are te.ops.quantize's of the same dh with the same scale (te.Linear's own grad_output
  quantization), dbias the fixed-order sum (test_norm_kernels.ordered_column_sum) and within
  1e-6 of torch's sum.
- float32, three steps: outputs, input and parameter gradients, DelayedScaling histories and
  scales bit-identical to the unfused composition (te.LayerNorm + te.Linear + the activation
  kernel + te.Linear) but fc1's bias gradient (within tolerance: another summation order);
  bfloat16: fc1's grad_output history holds the kernel's FP32 amax, gradients within tolerance.
- No bias, a frozen weight, an input without gradient; torch.compile (aot_eager and inductor,
  fullgraph) bit-identical to eager, its backward graph running act_bwd and linear_bwd_dy_given.
"""
import contextlib
import copy
import os
import sys

import pytest
import torch
import torch._dynamo.testing

import tequant as te
from tequant import _C, _act_fn, _dy_given
from tequant._act_fn import ARITHMETIC_BOUND
from tequant.recipe import DelayedScaling, Float8CurrentScaling, Format, QParams

sys.path.insert(0, os.path.dirname(__file__))
from test_compile import DEVICES, RECIPES, op_names  # noqa: E402  (Delayed: 4-row history)
from test_fused_act_modules import (  # noqa: E402
    _composition, _mlp, _steps, assert_same_but_fc1_bias)
from test_fused_norm_modules import rel, same_bits  # noqa: E402
from test_linear import one_cpu_thread  # noqa: E402
from test_norm_kernels import ordered_column_sum  # noqa: E402

assert one_cpu_thread  # the autouse fixture, imported to apply here too
FUSED = ("delayed", "current")
ACTS = ["gelu", "srelu", "swiglu", "reglu"]
# (activation, recipe, dtype) where the activation's backward writes fc1's codes: every one
# under DelayedScaling; under current scaling the ARITHMETIC_BOUND ones (gelu) for bfloat16 h
# only (_act_fn.beats_torch: torch's activation for float32 there)
DTYPED_CASES = [(a, n, d) for a in ACTS for n in FUSED for d in (torch.float32, torch.bfloat16)
                if n == "delayed" or _act_fn.beats_torch(a, d)]
CASES = [(a, n) for a, n, d in DTYPED_CASES if d == torch.float32]  # the float32 ones


@contextlib.contextmanager
def spied():
    """Records each activation backward that quantizes fc1's grad_output (its arguments, fc1's
    scale as it was, copies of its outputs) and the dy of every te.Linear backward called from
    Python: a tensor (linear_backward), or the grad_output's codes as the activation returned
    them (given_dy_backward, fc1's C backward on them)."""
    acts, dys = [], []
    into, linear_backward = _act_fn._backward_into, _C.linear_backward
    given = _dy_given.given_dy_backward

    def act_spy(dy, h, activation, recipe_id, padded, scale, dbias_dtype, slot,
                columnwise=False):
        before = None if scale is None else scale.clone()
        outs = into(dy, h, activation, recipe_id, padded, scale, dbias_dtype, slot, columnwise)
        if recipe_id is not None:
            acts.append(dict(dy=dy.clone(), h=h.clone(), act=activation, scale=before,
                             outs=[t.clone() for t in outs], returned=outs))
        return outs

    def c_spy(*args):
        dys.append(args[2])
        return linear_backward(*args)

    def given_spy(*args):
        dys.append(args[2])
        return given(*args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_act_fn, "_backward_into", act_spy)
        mp.setattr(_C, "linear_backward", c_spy)
        mp.setattr(_dy_given, "given_dy_backward", given_spy)
        yield acts, dys


def standalone(dy, h, act, recipe, scale, dbias_dtype=torch.float32):
    """[codes [M, K] (uint8), scale_inv, amax, dbias (dbias_dtype)] of the kernel run by hand
    with fc1's grad_output quantizer."""
    config = te.quantizer_config(recipe, "grad_output")
    m, k = h.shape
    codes = torch.empty(m, k, dtype=torch.uint8, device=h.device)
    scale_inv, amax = torch.empty(1, device=h.device), torch.zeros(1, device=h.device)
    dbias = torch.empty(k, dtype=dbias_dtype, device=h.device)
    if config.scaling == "delayed":
        _C._act_backward(dy, h, act, amax=amax, config=config, dh_q=codes, scale_inv=scale_inv,
                         scale=scale, dbias=dbias)
    else:
        _C._act_backward(dy, h, act, amax=amax, dbias=dbias)
        _C._act_backward(dy, h, act, config=config, dh_q=codes, scale_inv=scale_inv,
                         amax_in=amax)
    return [codes, scale_inv, amax, dbias]


def _train(model, x, recipe, steps=1):
    for _ in range(steps):
        with te.autocast(recipe=recipe, enabled=recipe is not None):
            y = model(x.clone().requires_grad_())
        y.float().square().sum().backward()


# ---- the fused path runs, and only where it should ----------------------------------------------

@pytest.mark.parametrize("name", FUSED)
def test_fc1_multiplies_the_activations_codes(name):
    """Two steps: per step one fused activation backward; fc2's node is the C Function (its
    backward quantizes the tensor dy in C, csrc/ext/linear_ctx.c), fc1's backward multiplies
    the very codes the activation backward returned (no second quantization), rows padded to
    32 (21 tokens)."""
    m = _mlp("swiglu")
    x = (torch.randn(3, 7, 64) * 2).to(torch.bfloat16)
    with te.autocast(recipe=RECIPES[name]):
        y = m(x.clone().requires_grad_())
    assert type(y.grad_fn).__name__ == "_PlainLinearBackward"
    with spied() as (acts, dys):
        _train(m, x, RECIPES[name], steps=2)
    assert len(acts) == 2 and len(dys) == 2
    for step in range(2):
        fc1_dy = dys[step]
        assert type(fc1_dy) is tuple
        assert fc1_dy[0] is acts[step]["returned"][0] and fc1_dy[0].shape == (32, 192)
    # the DelayedScaling update ran on fc1's grad_output history (the amax rolled to the end)
    if name == "delayed":
        assert float(m.fc1.delayed_amax_history_bwd[-1, 0]) > 0


@pytest.mark.parametrize("name", ["block", "mxfp8", "nvfp4", None])
def test_other_recipes_and_outside_autocast_keep_dy_in_high_precision(name):
    m = _mlp("gelu")
    x = (torch.randn(64, 64) * 2).to(torch.bfloat16)
    with spied() as (acts, dys):
        _train(m, x, RECIPES.get(name))
    assert acts == [] and all(isinstance(dy, torch.Tensor) for dy in dys)


@pytest.mark.parametrize("act", ARITHMETIC_BOUND)
def test_arithmetic_bound_activation_under_current_scaling_is_torchs(act):
    """gelu, silu under Float8CurrentScaling with float32 h (no table: the kernels' two
    evaluations lose to torch's activation), fc1 not asking for its grad_output: no activation
    kernel runs, every te.Linear backward gets dy in high precision; the result is the
    composition with torch's activation bit for bit. Under DelayedScaling the same model runs
    the fused path, and so does a bfloat16 one under current scaling."""
    m = _mlp(act, torch.float32)
    x = torch.randn(21, 64)
    ran = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("_act_forward", "_act_backward"):
            mp.setattr(_C, name, lambda *a, _f=getattr(_C, name), **k: ran.append(1) or _f(*a, **k))
        with spied() as (acts, dys):
            got, got_grads, _ = _steps(m, x, RECIPES["current"])
    assert ran == [] and acts == [] and all(isinstance(dy, torch.Tensor) for dy in dys)
    want, want_grads, _ = _steps(_composition(m, _act_fn.torch_activate), x, RECIPES["current"])
    assert all(same_bits(a, b) for a, b in zip(got + got_grads, want + want_grads))
    with spied() as (acts, _):
        _train(m, x, RECIPES["delayed"])
    assert len(acts) == 1
    with spied() as (acts, _):
        _train(_mlp(act), x.to(torch.bfloat16), RECIPES["current"])
    assert len(acts) == 1


def test_hooked_fc1_and_torch_activation_keep_dy_in_high_precision():
    """A hooked fc1 gets the norm's output (no fused codes to ask with); under torch.autocast
    the activation is torch's, so the placeholders get no gradient and fc1 quantizes dy."""
    recipe = RECIPES["current"]
    hooked = _mlp("gelu", torch.float32)
    hooked.fc1.register_forward_pre_hook(lambda mod, args: None)
    x = torch.randn(32, 64)
    with spied() as (acts, dys):
        _train(hooked, x, recipe)
    assert acts == [] and all(isinstance(dy, torch.Tensor) for dy in dys)
    m = _mlp("relu", torch.float32)
    grad_output = _act_fn.GradOutput("relu")
    with te.autocast(recipe=recipe):
        nx = te.norm.module_input(m, x.clone().requires_grad_(), 64)
        nx.grad_output = grad_output
        h = m.fc1(nx)
    assert len(grad_output.tokens) == 5  # fc1 asked: codes, scale_inv, amax, codes_t, dbias
    assert grad_output.tokens[3].shape == grad_output.tokens[0].shape[::-1]  # [N, padded]
    with spied() as (acts, dys), te.autocast(recipe=recipe):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m.fc2(_act_fn.ActInput(h, "relu", grad_output))
        y.float().sum().backward()
    assert acts == [] and all(isinstance(dy, torch.Tensor) for dy in dys)


# ---- the bits fc1 receives ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act,name,dtype", DTYPED_CASES)
def test_codes_amax_and_dbias_are_the_kernels(act, name, dtype, device):
    """Two steps (DelayedScaling's second casts with an updated scale): codes, scale_inv, amax
    and dbias are the kernel's with fc1's scale, rows past 21 zero codes, the columnwise codes
    their transpose (columns past 21 zero); float32: the codes
    are te.ops.quantize's of the same dh (te.Linear's grad_output quantizer), dbias the fixed
    order's sum, and close to torch's."""
    recipe = RECIPES[name]
    m = _mlp(act, dtype, device)
    x = (torch.randn(3, 7, 64, device=device) * 2).to(dtype)
    with spied() as (acts, _):
        _train(m, x, recipe, steps=2)
    assert len(acts) == 2
    for rec in acts:
        codes, scale_inv, amax, codes_t, dbias = rec["outs"]  # codes_t: fc1's wgrad reads them
        assert dbias.dtype == dtype  # stored in fc1's bias dtype by the kernel: no cast after
        want = standalone(rec["dy"], rec["h"], act, recipe, rec["scale"], dtype)
        k = 192 if act in ("swiglu", "reglu") else 96
        assert codes.shape == (32, k) and not codes.view(torch.uint8)[21:].any()
        assert torch.equal(codes_t.view(torch.uint8), codes.view(torch.uint8).t())
        assert torch.equal(codes.view(torch.uint8)[:21], want[0])
        for got, ref in zip((scale_inv, amax, dbias), want[1:]):
            assert same_bits(got.reshape(-1), ref)
        if dtype != torch.float32:  # the kernel's rounding of its float32 sums, as a cast's
            sums = standalone(rec["dy"], rec["h"], act, recipe, rec["scale"])[3]
            assert same_bits(dbias, sums.to(dtype))
            continue
        dh = torch.empty_like(rec["h"])
        _C._act_backward(rec["dy"], rec["h"], act, dh=dh)
        extra = {"scale": rec["scale"]} if name == "delayed" else {}
        q = te.ops.quantize(dh, recipe, "grad_output", **extra)
        assert torch.equal(want[0], q.data.view(torch.uint8))
        assert same_bits(want[1], q.scale_inv.reshape(1))
        assert same_bits(dbias.cpu(), ordered_column_sum(dh.cpu()))
        torch.testing.assert_close(dbias, dh.sum(0), rtol=1e-6, atol=1e-6)
    if name == "delayed":
        assert float(acts[1]["scale"][0]) != 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act,name", [("gelu", "delayed"), ("srelu", "current")])
def test_fc1_wgrad_takes_the_backwards_columnwise_codes(act, name, device):
    """fc1's wgrad multiplies the codes_t the activation's backward call made: no transpose of
    dy's codes after it (given_dy_backward's with_columnwise keeps them); a frozen fc1 weight
    (no wgrad) asks for none."""
    m = _mlp(act, torch.bfloat16, device)
    x = torch.randn(2, 16, 64, device=device).to(torch.bfloat16)
    calls = []
    with pytest.MonkeyPatch.context() as mp, spied() as (acts, _):
        mp.setattr(_C, "_transpose", lambda *a, _f=_C._transpose: calls.append(1) or _f(*a))
        _train(m, x, RECIPES[name])
    assert len(acts) == 1 and len(acts[0]["outs"]) == 5 and calls == []
    m.fc1.weight.requires_grad_(False)
    with spied() as (acts, _):
        _train(m, x, RECIPES[name])
    assert len(acts[0]["outs"]) == 4  # codes, scale_inv, amax, dbias


@pytest.mark.parametrize("act,name", CASES)
def test_float32_is_the_unfused_composition(act, name):
    """Three steps: outputs, input gradients, every parameter gradient but fc1's bias, and
    DelayedScaling's histories and scales (fc1's grad_output amax among them) bit for bit;
    fc1's bias gradient within 1e-6 (the kernel's summation order, not torch's)."""
    m = _mlp(act, torch.float32)
    composed = _composition(m, recipe_name=name)
    x = torch.randn(3, 37, 64) * 2  # 111 tokens: several row chunks in dbias's order
    with spied() as (acts, _):
        got, got_grads, got_buf = _steps(m, x, RECIPES[name], steps=3)
    assert len(acts) == 3
    want, want_grads, want_buf = _steps(composed, x, RECIPES[name], steps=3)
    assert all(same_bits(a, b) for a, b in zip(got, want))
    assert_same_but_fc1_bias(m, got_grads, want_grads)
    assert len(got_buf) == len(want_buf) == (8 if name == "delayed" else 0)
    assert all(same_bits(a, b) for a, b in zip(got_buf, want_buf))


E4M3_RECIPES = {
    "delayed-e4m3": DelayedScaling(fp8_format=Format.E4M3, amax_history_len=2),
    "current-e4m3-pow2-eps": Float8CurrentScaling(
        fp8_format=Format.E4M3, fp8_quant_bwd_grad=QParams(power_2_scale=True, amax_epsilon=8.0)),
}


@pytest.mark.parametrize("name", list(E4M3_RECIPES))
def test_fc1s_own_grad_output_quantizer(name):
    """E4M3 (not HYBRID), and current scaling's power-of-two scale from an epsilon-raised amax:
    the codes are E4M3 and every gradient but fc1's bias is the composition's bit for bit."""
    recipe = E4M3_RECIPES[name]
    m = _mlp("relu", torch.float32)
    composed = _composition(m, recipe_name=name)
    x = torch.randn(40, 64)
    with spied() as (acts, _):
        _, got_grads, got_buf = _steps(m, x, recipe)
    _, want_grads, want_buf = _steps(composed, x, recipe)
    assert len(acts) == 2 and acts[0]["outs"][0].dtype == torch.float8_e4m3fn
    if name.startswith("current"):
        assert float(acts[0]["outs"][2]) < 8.0  # raised to the epsilon: scale 2^floor(log2
        assert float(acts[0]["outs"][1]) == 1 / 32  # (448 / 8)) = 32
    assert_same_but_fc1_bias(m, got_grads, want_grads)
    assert all(same_bits(a, b) for a, b in zip(got_buf, want_buf))


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_bfloat16_history_holds_the_kernels_amax(act):
    """bfloat16, DelayedScaling: after the step's update fc1's grad_output history holds the
    FP32 amax of dh that the kernel recorded (rolled to the last row); outputs, gradients and
    histories within tolerance of the unfused composition (other codes in its forward, and its
    amax is of dh rounded to bfloat16)."""
    recipe = RECIPES["delayed"]
    m = _mlp(act)
    composed = _composition(m, recipe_name="delayed")
    x = (torch.randn(3, 21, 64) * 2).to(torch.bfloat16)
    with spied() as (acts, _):
        got, got_grads, got_buf = _steps(m, x, recipe)
    want, want_grads, want_buf = _steps(composed, x, recipe)
    for rec in acts:
        assert same_bits(rec["outs"][2].reshape(1), standalone(
            rec["dy"], rec["h"], act, recipe, rec["scale"])[2])
    assert same_bits(m.fc1.delayed_amax_history_bwd[-1], acts[-1]["outs"][2].reshape(1))
    for a, b in zip(got + got_grads + got_buf, want + want_grads + want_buf):
        assert rel(a, b) < 0.12  # (the fused norm and activation codes differ from bfloat16's)


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("case", ["no_bias", "frozen_weight", "input_without_grad"])
def test_partial_gradients(case, name):
    """float32: what is asked for is the unfused composition's bit for bit (fc1's bias within
    1e-6), through the fused path."""
    recipe = RECIPES[name]
    m = _mlp("srelu", torch.float32, bias=case != "no_bias")
    if case == "frozen_weight":
        m.fc1.weight.requires_grad_(False)
    composed = _composition(m, recipe_name=name)
    if case == "input_without_grad":  # and a frozen norm: fc1 runs wgrad alone
        for p in (m.layer_norm_weight, m.layer_norm_bias, *composed.n.parameters()):
            p.requires_grad_(False)
    x = torch.randn(21, 64)
    grads = []
    for model in (m, composed):
        xi = x.clone().requires_grad_(case != "input_without_grad")
        with spied() as (acts, _), te.autocast(recipe=recipe):
            y = model(xi)
            y.square().sum().backward()
        assert len(acts) == (model is m)
        grads.append([("x", xi.grad)] + [(n, p.grad) for n, p in model.named_parameters()])
    assert len(grads[0]) == len(grads[1])
    for (n, a), (_, b) in zip(*grads):
        assert (a is None) == (b is None), n
        if n == "fc1.bias":
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        elif a is not None:
            assert same_bits(a, b), n


# ---- torch.compile ------------------------------------------------------------------------------

@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_run(model, xs, recipe, backend):
    def step(m, x):
        with te.autocast(recipe=recipe):
            return m(x)
    fn = step if backend is None else torch.compile(step, backend=backend, fullgraph=True)
    out = []
    for x in xs:
        xi = x.clone().requires_grad_()
        y = fn(model, xi)
        y.float().square().mean().backward()
        out += [y.detach().clone(), xi.grad]
    return out + [p.grad for p in model.parameters()] + [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("act,name", [("gelu", "delayed"), ("swiglu", "delayed"),
                                      ("swiglu", "current")])
def test_compile_bit_identical_with_the_fused_backward(act, name, fresh_dynamo):
    """aot_eager, fullgraph, two steps of 21 tokens: eager's bits (eager fused: counted); the
    backward graph runs act_bwd and linear_bwd_dy_given (fc1) beside linear_bwd_given (fc2), and
    fc1's grad_output codes are not transposed by a call of their own (act_bwd returns them
    columnwise too)."""
    recipe = RECIPES[name]
    model = _mlp(act)
    twin = copy.deepcopy(model)
    xs = [(torch.randn(3, 7, 64) * 2).to(torch.bfloat16) for _ in range(2)]
    with spied() as (acts, _):
        want = _compiled_run(model, xs, recipe, None)
    assert len(acts) == 2
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    transposes = []  # fc1's codes_t come from act_bwd: linear_bwd_dy_given transposes nothing
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_C, "_transpose", lambda *a, _f=_C._transpose: transposes.append(1) or _f(*a))
        got = _compiled_run(twin, xs, recipe, recorder)
    assert transposes == []
    assert len(got) == len(want)
    assert all(same_bits(a, b) for a, b in zip(got, want))
    ops = set(op_names(recorder.bw_graphs))
    assert {"tequant.act_bwd.default", "tequant.linear_bwd_dy_given.default",
            "tequant.linear_bwd_given.default"} <= ops


def test_inductor_bit_identical_with_the_fused_backward(fresh_dynamo):
    recipe = RECIPES["current"]
    model = _mlp("srelu")
    twin = copy.deepcopy(model)
    xs = [(torch.randn(21, 64) * 2).to(torch.bfloat16) for _ in range(2)]
    with spied() as (acts, _):
        want = _compiled_run(model, xs, recipe, None)
    assert len(acts) == 2
    got = _compiled_run(twin, xs, recipe, "inductor")
    assert all(same_bits(a, b) for a, b in zip(got, want))
