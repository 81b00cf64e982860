"""The activation kernels inside te.LayerNormMLP (issue 24; python/tequant/_act_fn.py,
layernorm_mlp.py, linear.py, _compile_linear.py).

- _act_fn.activate: forward and backward ARE the kernels' (_C._act_forward / _C._act_backward
  run standalone) bit for bit, every activation and dtype; float32 within tolerance of torch's
  activation (layernorm_mlp.activate) and its autograd; torch's own where the kernels do not run.
- LayerNormMLP with DelayedScaling / Float8CurrentScaling (fused): the codes fc2 multiplies are
  the standalone kernel's (cast with fc2's scale, or the scale of the kernel's amax pass) bit for
  bit; float32: outputs, gradients (but fc1's bias gradient: the fused backward's summation
  order, tests/test_fused_dh.py) and DelayedScaling histories bit-identical to te.LayerNorm +
  te.Linear + the kernel's activation + te.Linear; bfloat16, every recipe: within the recipe's
  tolerance of the composition with torch's activation.
- Outside te.autocast: the exact high-precision composition. Inference, 0 tokens, a hooked fc2
  (unfused), TE state_dict names, torch.compile (aot_eager, inductor) bit-identical to eager,
  CUDA cases marked (reduce-overhead among them) and skipped without a GPU.
"""
import contextlib
import copy
import os
import sys

import pytest
import torch
import torch._dynamo.testing

import tequant as te
from tequant import _C, _act_fn
from tequant.layernorm_mlp import activate as torch_activate

sys.path.insert(0, os.path.dirname(__file__))
from test_compile import DEVICES, RECIPES, op_names  # noqa: E402  (Delayed: 4-row history)
from test_fused_norm_modules import rel, same_bits  # noqa: E402
from test_linear import one_cpu_thread  # noqa: E402

assert one_cpu_thread  # the autouse fixture, imported to apply here too
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ACTS = ["gelu", "relu", "silu", "qgelu", "srelu", "geglu", "reglu", "swiglu"]
GATED = ("geglu", "reglu", "swiglu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FUSED = ("delayed", "current")
ERR = {"delayed": 0.12, "current": 0.12, "block": 0.12, "mxfp8": 0.12, "nvfp4": 0.5}


def _mlp(activation, dtype=torch.bfloat16, device="cpu", **kw):
    torch.manual_seed(4)
    m = te.LayerNormMLP(64, 96, activation=activation, params_dtype=dtype, device=device, **kw)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.5)
    return m


def _composition(m, act=None, recipe_name=None):
    """te.LayerNorm + te.Linear + act + te.Linear with m's parameters; act by default what m runs
    under recipe_name: the kernels' activation where its fused forward writes fc2's codes
    (DelayedScaling: every activation; Float8CurrentScaling: _act_fn.beats_torch, the
    ARITHMETIC_BOUND ones for bfloat16 only), else _act_fn.activate (torch's for
    ARITHMETIC_BOUND, the kernels' for the others)."""
    n = te.LayerNorm(64, params_dtype=m.layer_norm_weight.dtype, device=m.fc1_weight.device)
    with torch.no_grad():
        n.weight.copy_(m.layer_norm_weight)
        n.bias.copy_(m.layer_norm_bias)
    fc1, fc2 = copy.deepcopy(m.fc1), copy.deepcopy(m.fc2)
    fused = recipe_name == "delayed" or (
        recipe_name == "current" and _act_fn.beats_torch(m.activation, m.fc1_weight.dtype))
    act = act or (_act_fn.kernel_activate if fused else _act_fn.activate)
    name = m.activation

    class Composed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n, self.fc1, self.fc2 = n, fc1, fc2

        def forward(self, x):
            return self.fc2(act(self.fc1(self.n(x)), name))
    return Composed()


def assert_same_but_fc1_bias(m, got_grads, want_grads):
    """Parameter gradients of m (the fused module) bit for bit, but fc1's bias gradient, the
    activation backward's fixed-order sum (tests/test_fused_dh.py): within 1e-6."""
    names = [n for n, _ in m.named_parameters()]
    assert len(got_grads) == len(want_grads) == len(names)
    for n, a, b in zip(names, got_grads, want_grads):
        if n == "fc1.bias":
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:
            assert same_bits(a, b), n


def _steps(model, x, recipe, steps=2):
    """Outputs and input grads of `steps` steps, then parameter grads and buffers."""
    outs = []
    for step in range(steps):
        xi = x.clone().requires_grad_()
        torch.manual_seed(50 + step)  # NVFP4's stochastic rounding draws alike
        with te.autocast(recipe=recipe, enabled=recipe is not None):
            y = model(xi)
        y.float().square().sum().backward()
        outs += [y.detach(), xi.grad]
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return outs, grads, [b.clone() for b in model.buffers()]


# ---- the activation ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_activation_is_the_kernel_and_close_to_torch(act, dtype, device):
    torch.manual_seed(0)
    h = (torch.randn(2, 5, 32, device=device) * 2).to(dtype).requires_grad_()
    y = _act_fn.kernel_activate(h, act)
    n = 16 if act in GATED else 32
    dy = torch.randn(2, 5, n, device=device).to(dtype)
    y.backward(dy)
    h2d = h.detach().reshape(-1, 32)
    want = torch.empty(10, n, dtype=dtype, device=device)
    _C._act_forward(h2d, act, y_hp=want)
    dh = torch.empty_like(h2d)
    _C._act_backward(dy.reshape(10, n), h2d, act, dh=dh)
    assert same_bits(y.detach().reshape(10, n), want) and same_bits(h.grad.reshape(10, 32), dh)
    if dtype == torch.float32:
        hr = h.detach().clone().requires_grad_()
        yr = torch_activate(hr, act)
        yr.backward(dy)
        assert rel(y, yr) < 1e-6 and rel(h.grad, hr.grad) < 1e-5


def test_torch_activation_where_the_kernels_do_not_run():
    h = torch.randn(4, 32, dtype=torch.float64)
    assert "float64" in _act_fn.refusal(h)
    assert torch.equal(_act_fn.activate(h, "swiglu"), torch_activate(h, "swiglu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert "torch.autocast" in _act_fn.refusal(h.float())
    with pytest.raises(RuntimeError):  # the kernels' backward is not differentiable
        hh = torch.randn(4, 32, requires_grad=True)
        g, = torch.autograd.grad(_act_fn.activate(hh, "srelu").sum(), hh, create_graph=True)
        g.sum().backward()
    for act in _act_fn.ARITHMETIC_BOUND:  # torch's: faster there (the kernels' exact arithmetic)
        assert torch.equal(_act_fn.activate(hh, act), torch_activate(hh, act))


# ---- fused codes into fc2 -------------------------------------------------------------------

@contextlib.contextmanager
def captured_codes():
    """Records what each fused activation hands fc2: (h, scale given, members)."""
    seen = []
    fused = _act_fn.ActInput.fused

    def spy(self, recipe_id, align, scale, amax, **kw):
        s = None if scale is None else scale.clone()
        y, members = fused(self, recipe_id, align, scale, amax, **kw)
        seen.append((self.h.detach(), s, members))
        return y, members
    _act_fn.ActInput.fused = spy
    try:
        yield seen
    finally:
        _act_fn.ActInput.fused = fused


def standalone_codes(h2d, act, recipe, scale=None):
    config = te.quantizer_config(recipe, "input")
    m, k = h2d.shape
    n = k // 2 if act in GATED else k
    codes = torch.empty(m, n, dtype=torch.uint8, device=h2d.device)
    scale_inv = torch.empty(1, device=h2d.device)
    amax = torch.zeros(1, device=h2d.device)
    if config.scaling == "delayed":
        _C._act_forward(h2d, act, amax=amax, config=config, y_q=codes, scale_inv=scale_inv,
                        scale=scale)
    else:
        _C._act_forward(h2d, act, amax=amax)
        _C._act_forward(h2d, act, config=config, y_q=codes, scale_inv=scale_inv, amax_in=amax)
    return codes, scale_inv, amax


# (activation, recipe, dtype) where the activation writes fc2's codes: every one under
# DelayedScaling; under current scaling the ARITHMETIC_BOUND ones for bfloat16 h only (torch's
# activation and te.Linear's quantize for the others: _act_fn.beats_torch)
FUSED_CASES = [(a, n, d) for a in ACTS for n in FUSED for d in (torch.float32, torch.bfloat16)
               if n == "delayed" or _act_fn.beats_torch(a, d)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act,name,dtype", FUSED_CASES)
def test_fused_codes_are_the_standalone_kernels(act, name, dtype, device):
    """Two steps, 21 tokens (padded to 32 rows of zero codes): fc2's codes and scale_inv are
    the kernel's run by hand; float32: te.ops.quantize's of the kernel's activation too."""
    recipe = RECIPES[name]
    m = _mlp(act, dtype, device)
    x = (torch.randn(3, 7, 64, device=device) * 2).to(dtype)
    with captured_codes() as seen:
        for _ in range(2):
            with te.autocast(recipe=recipe):
                m(x.clone().requires_grad_()).float().square().sum().backward()
    assert len(seen) == 2
    for h, scale, members in seen:
        h2d = h.reshape(-1, h.shape[-1])
        codes, scale_inv, _ = standalone_codes(h2d, act, recipe, scale)
        data = members[0]
        assert data.shape == (32, 96) and torch.equal(data.view(torch.uint8)[:21], codes)
        assert not data.view(torch.uint8)[21:].any()
        assert same_bits(members[1].reshape(1), scale_inv)
        if dtype == torch.float32:
            extra = {"scale": scale} if name == "delayed" else {}
            q = te.ops.quantize(_act_fn.kernel_activate(h2d, act), recipe, "input", **extra)
            assert torch.equal(codes, q.data.view(torch.uint8))
    if name == "delayed":
        assert float(seen[1][1][0]) != 1.0  # the second step cast with an updated scale


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("act", ACTS)
def test_float32_is_the_composition_with_its_history(act, name):
    """float32: outputs, gradients and DelayedScaling's histories and scales after three steps
    are te.LayerNorm + te.Linear + the kernel's activation + te.Linear's bit for bit, but fc1's
    bias gradient, the activation backward's fixed-order sum (test_fused_dh.py): within 1e-6."""
    m = _mlp(act, torch.float32)
    composed = _composition(m, recipe_name=name)
    x = torch.randn(3, 7, 64) * 2
    got, got_grads, got_buf = _steps(m, x, RECIPES[name], steps=3)
    want, want_grads, want_buf = _steps(composed, x, RECIPES[name], steps=3)
    assert all(same_bits(a, b) for a, b in zip(got, want))
    assert_same_but_fc1_bias(m, got_grads, want_grads)
    assert len(got_buf) == len(want_buf) == (8 if name == "delayed" else 0)
    assert all(same_bits(a, b) for a, b in zip(got_buf, want_buf))


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("act", ["gelu", "srelu", "swiglu", "geglu"])
def test_bfloat16_within_tolerance_of_torch_activation(act, name):
    """bfloat16, every recipe: outputs and gradients within the recipe's tolerance of the
    composition with torch's activation."""
    m = _mlp(act)
    composed = _composition(m, torch_activate)
    x = (torch.randn(3, 21, 64) * 2).to(torch.bfloat16)
    got, got_grads, _ = _steps(m, x, RECIPES[name])
    want, want_grads, _ = _steps(composed, x, RECIPES[name])
    for a, b in zip(got + got_grads, want + want_grads):
        assert rel(a, b) < ERR[name]


@pytest.mark.parametrize("act", ["gelu", "reglu"])
def test_delayed_records_the_fp32_amax_in_fc2s_slot(act):
    """bfloat16: fc2's input history row 0 holds the kernel's amax of the FP32 activation."""
    m = _mlp(act)
    x = (torch.randn(40, 64) * 3).to(torch.bfloat16)
    recipe = RECIPES["delayed"]
    with captured_codes() as seen, te.autocast(recipe=recipe):
        m(x)
        got = m.fc2.delayed_amax_history_fwd[0, 0:1].clone()
    h = seen[0][0]
    _, _, amax = standalone_codes(h, act, recipe, torch.ones(1))
    assert same_bits(got, amax)


# ---- high precision, inference, hooks, names ------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
def test_outside_autocast_exact_high_precision(act, dtype):
    """Outputs and every gradient: the norm kernel, F.linear, the activation (activate(): the
    kernel's, torch's for ARITHMETIC_BOUND), F.linear."""
    m = _mlp(act, dtype)
    composed = _composition(m)
    x = (torch.randn(3, 7, 64) * 2).to(dtype)
    got, got_grads, _ = _steps(m, x, None)
    want, want_grads, _ = _steps(composed, x, None)
    assert all(same_bits(a, b) for a, b in zip(got + got_grads, want + want_grads))


def test_inference_zero_tokens_and_hooked_fc2():
    m = _mlp("swiglu")
    x = (torch.randn(21, 64) * 2).to(torch.bfloat16)
    for name in FUSED:
        with torch.no_grad(), te.autocast(recipe=RECIPES[name]):
            out = m(x)
        with te.autocast(recipe=RECIPES[name]):
            out2 = m(x.clone().requires_grad_())
            out0 = m(torch.randn(0, 64, dtype=torch.bfloat16, requires_grad=True))
        assert torch.equal(out, out2) and out0.shape == (0, 64)
        out0.sum().backward()
    seen = []  # float32: fc1's fused norm codes are te.LayerNorm + te.Linear's
    m, x = _mlp("swiglu", torch.float32), x.float()
    hooked = copy.deepcopy(m)
    hooked.fc2.register_forward_pre_hook(lambda mod, args: seen.append(type(args[0])))
    composed = _composition(m, recipe_name="current")
    with te.autocast(recipe=RECIPES["current"]):
        assert torch.equal(hooked(x), composed(x))  # fc2 got the activation's output
    assert seen == [torch.Tensor]


def test_te_state_dict_names_load():
    m = _mlp("geglu", return_bias=True)
    sd = m.state_dict()
    assert sorted(sd) == ["fc1_bias", "fc1_weight", "fc2_bias", "fc2_weight", "layer_norm_bias",
                          "layer_norm_weight"]
    fresh = te.LayerNormMLP(64, 96, activation="geglu", params_dtype=torch.bfloat16,
                            return_bias=True)
    fresh.load_state_dict({k: v.clone() for k, v in sd.items()})
    x = torch.randn(21, 64, dtype=torch.bfloat16)
    for name in FUSED:
        with te.autocast(recipe=RECIPES[name]):
            assert torch.equal(m(x)[0], fresh(x)[0])


# ---- torch.compile, CUDA graphs -----------------------------------------------------------------

@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(step, model, xs):
    """Per step: copies of the output, the input gradient and the parameters' gradients (set to
    None before each step: under reduce-overhead a gradient accumulated into a CUDA graph's
    earlier output is an error of cudagraph trees, for torch's own modules too); then the
    buffers. Each step's tensors stay alive into the next (the trees free them then)."""
    out = []
    for i, x in enumerate(xs):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = step(model, xi)
        y.float().square().mean().backward()
        out += [y.detach().clone(), xi.grad.clone()]
        out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        held = (y, xi)  # noqa: F841
    return out + [b.clone() for b in model.buffers()]


def _assert_same(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert same_bits(a, b), f"tensor {i}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act,name", [("gelu", "delayed"), ("swiglu", "delayed"),
                                      ("swiglu", "current"), ("srelu", "current"),
                                      ("swiglu", "block"), ("reglu", "block"),
                                      ("gelu", "block"), ("swiglu", None), ("srelu", None)])
def test_compile_bit_identical(act, name, device, fresh_dynamo):
    """aot_eager, fullgraph, autocast inside, 21 tokens: eager's bits; the graphs call
    tequant::act_fwd (act_fwd_delayed under DelayedScaling) and, for the backward, act_bwd where it quantizes fc1's grad_output
    (GradOutput), else act_bwd_over_dy (dh written over dy) or, gated, act_bwd_over_h (over the
    saved h); the fused recipes
    linear_fwd_given twice: fc1 and fc2; block scaling once: fc2, whose blocks the activation
    writes, as in eager."""
    model = _mlp(act, device=device)
    twin = copy.deepcopy(model)
    torch.manual_seed(2)
    xs = [(torch.randn(3, 7, 64, device=device) * 2).to(torch.bfloat16) for _ in range(2)]

    def step(m, x):
        with te.autocast(recipe=RECIPES.get(name), enabled=name is not None):
            return m(x)
    want = _run(step, model, xs)
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    _assert_same(_run(torch.compile(step, backend=recorder, fullgraph=True), twin, xs), want)
    ops = set(op_names(recorder.fw_graphs + recorder.bw_graphs))
    grad_output = name in ("delayed", "current")  # fc1 on the norm's codes asks for them
    over = "over_h" if act in ("swiglu", "reglu", "geglu") else "over_dy"
    backward = "tequant.act_bwd.default" if grad_output else f"tequant.act_bwd_{over}.default"
    act_fwd = "act_fwd_delayed" if name == "delayed" else "act_fwd"  # amax into fc2's history
    assert {f"tequant.{act_fwd}.default", backward} <= ops, ops
    if name == "block":
        assert op_names(recorder.fw_graphs).count("tequant.linear_fwd_given.default") == 1
    assert not any(a in op for op in ops for a in ("gelu", "silu", "relu", "sigmoid")), ops


def test_inductor_writes_dh_over_dy_without_a_copy(fresh_dynamo):
    """Inductor, block scaling, gelu: the compiled backward writes the plain dh over dy, fc2's
    input gradient (an intermediate that Inductor reinplaces), with no copy kernel before it
    (over the saved h, a graph input, Inductor copied h first: a [M, ffn] pass a layer); the
    bits are eager's."""
    from torch._inductor.utils import run_and_get_code
    model = _mlp("gelu")
    twin = copy.deepcopy(model)
    xs = [(torch.randn(21, 64) * 2).to(torch.bfloat16) for _ in range(2)]

    def step(m, x):
        with te.autocast(recipe=RECIPES["block"]):
            return m(x)
    want = _run(step, model, xs)
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    got, codes = run_and_get_code(_run, compiled, twin, xs)
    _assert_same(got, want)
    backward = [c for c in codes if "act_bwd_over" in c]
    assert backward and all("act_bwd_over_dy" in c for c in backward), codes
    assert not any("clone" in c for c in backward), backward


def _hook_fc2(model, graph_break):
    """A forward pre-hook on fc2 (fc2 then takes the activation's high-precision output), that
    breaks Dynamo's graph there or does nothing."""
    def hook(module, args):
        if graph_break:
            torch._dynamo.graph_break()
    model.fc2.register_forward_pre_hook(hook)
    return model


@pytest.mark.parametrize("act", ["gelu", "silu", "relu", "swiglu"])
@pytest.mark.parametrize("name", FUSED + ("block", "mxfp8"))  # block formats: relu's blocks dh
@pytest.mark.parametrize("graph_break", [False, True])
def test_compiled_hooked_fc2_gives_eager_gradients(act, name, graph_break, fresh_dynamo):
    """With a hook on fc2 (fc2 then takes the activation's high-precision output) fc1 quantizes
    its own grad_output. It used to ask the activation's backward for it (GradOutput) there
    too; gelu and silu then ran torch's activation, whose backward delivers no tokens, and
    compiled, fc1's backward read zeros (zero gradients for fc1 and the input); with a graph
    break at the hook every activation failed to compile (delayed) or summed FP8 tokens
    (current). Now compiled (a whole graph, or a graph break at the hook) gives eager's bits,
    and the gradients are not zero."""
    model = _hook_fc2(_mlp(act), graph_break)
    twin = _hook_fc2(copy.deepcopy(_mlp(act)), graph_break)
    xs = [(torch.randn(21, 64) * 2).to(torch.bfloat16) for _ in range(2)]

    def step(m, x):
        with te.autocast(recipe=RECIPES[name]):
            return m(x)
    want = _run(step, model, xs)
    got = _run(torch.compile(step, backend="aot_eager", fullgraph=not graph_break), twin, xs)
    _assert_same(got, want)
    n_params = sum(1 for _ in model.parameters())
    first_grads = got[1:2 + n_params]  # the first step's input and parameter gradients
    assert all(float(t.float().abs().max()) > 0 for t in first_grads)


@pytest.mark.parametrize("name", ["delayed", "block", "mxfp8"])  # mxfp8: E8M0 members (ops)
def test_inductor_bit_identical(name, fresh_dynamo):
    model = _mlp("geglu")
    twin = copy.deepcopy(model)
    xs = [(torch.randn(21, 64) * 2).to(torch.bfloat16) for _ in range(2)]

    def step(m, x):
        with te.autocast(recipe=RECIPES[name]):
            return m(x)
    want = _run(step, model, xs)
    _assert_same(_run(torch.compile(step, backend="inductor", fullgraph=True), twin, xs), want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", FUSED + ("block", "mxfp8"))  # swiglu: the block formats fused too
def test_reduce_overhead_bit_identical(name, fresh_dynamo):
    model = _mlp("swiglu", device="cuda")
    twin = copy.deepcopy(model)
    xs = [(torch.randn(21, 64, device="cuda") * 2).to(torch.bfloat16) for _ in range(4)]

    def step(m, x):
        with te.autocast(recipe=RECIPES[name]):
            return m(x)
    want = _run(step, model, xs)
    _assert_same(_run(torch.compile(step, mode="reduce-overhead", fullgraph=True), twin, xs),
                 want)
