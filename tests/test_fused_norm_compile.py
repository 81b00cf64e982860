"""torch.compile and CUDA graphs over the modules that run the norm kernels (issue 24):
te.LayerNorm / te.RMSNorm, te.LayerNormLinear and te.LayerNormMLP (python/tequant/_norm_fn.py's
one Function with its tequant::norm_fwd / norm_bwd ops; tequant::linear_fwd_given /
linear_bwd_given in _compile_ops.py; _compile_linear.py).

- fullgraph=True (no graph break); the compiled graphs call tequant::norm_fwd / norm_bwd and, for
  the per-tensor FP8 recipes, tequant::linear_fwd_given / linear_bwd_given (the fused codes),
  never torch's norm.
- Two training steps bit-identical to eager from the same state: outputs, the returned norm
  output, gradients and DelayedScaling state, every recipe, bfloat16, te.autocast inside and
  around the compiled function (aot_eager; inductor for the norms and one fused recipe).
- CUDA graphs (GPU only): a manually captured training step and mode="reduce-overhead" replay
  eager's steps bit for bit.
CPU here; the CUDA cases are marked and skip without a GPU. Eager numerics:
tests/test_fused_norm_modules.py.
"""
import copy

import pytest
import torch
import torch._dynamo.testing

import tequant as te

from test_compile import DEVICES, RECIPES, op_names  # DelayedScaling: 4-row history
from test_linear import one_cpu_thread

assert one_cpu_thread  # the autouse fixture, imported to apply here too
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FUSED = ("delayed", "current")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph_ops(backend):
    """The op names (str(node.target)) in every forward and backward graph AOT recorded."""
    return set(op_names(backend.fw_graphs + backend.bw_graphs))


def _run(step, model, xs, eager_autocast=None):
    """Per step: copies of the output(s), the input gradient and the parameters' gradients (set
    to None before each step: under reduce-overhead a gradient accumulated into a CUDA graph's
    earlier output is an error of cudagraph trees, for torch's own modules too); then the
    buffers."""
    out = []
    for i, x in enumerate(xs):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        torch.manual_seed(100 + i)  # NVFP4's stochastic rounding draws alike
        if eager_autocast is None:
            y = step(model, xi)
        else:
            with te.autocast(recipe=eager_autocast):
                y = step(model, xi)
        ys = y if isinstance(y, tuple) else (y,)
        sum(t.float().square().mean() for t in ys).backward()
        # copies: a later step may overwrite a CUDA graph's outputs; the step's own tensors stay
        # alive into the next step, which frees them (reduce-overhead's cudagraph trees)
        out += [t.detach().clone() for t in ys] + [xi.grad.clone()]
        out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        held = (ys, xi)  # noqa: F841
    return out + [b.clone() for b in model.buffers()]


def _assert_same(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), f"tensor {i}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
def test_norm_modules_compile_bit_identical(cls, backend, device):
    torch.manual_seed(0)
    model = cls(64, zero_centered_gamma=True, params_dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    twin = copy.deepcopy(model)
    xs = [torch.randn(3, 7, 64, dtype=torch.bfloat16, device=device) for _ in range(2)]

    def step(m, x):
        return m(x)
    want = _run(step, model, xs)
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    compiled = torch.compile(step, backend=recorder if backend == "aot_eager" else backend,
                             fullgraph=True)
    _assert_same(_run(compiled, twin, xs), want)
    if backend == "aot_eager":
        ops = _graph_ops(recorder)
        assert {"tequant.norm_fwd.default", "tequant.norm_bwd.default"} <= ops
        assert not any("layer_norm" in op or "rms_norm" in op for op in ops), ops


class Pair(torch.nn.Module):
    """A LayerNormLinear whose norm output is returned (and read by the loss) and a
    LayerNormMLP; bfloat16 parameters."""

    def __init__(self, device, activation="gelu", normalization="LayerNorm"):
        super().__init__()
        self.qkv = te.LayerNormLinear(64, 64, return_layernorm_output=True,
                                      normalization=normalization, params_dtype=torch.bfloat16,
                                      device=device)
        self.mlp = te.LayerNormMLP(64, 96, activation=activation, normalization=normalization,
                                   zero_centered_gamma=True, params_dtype=torch.bfloat16,
                                   device=device)

    def forward(self, x):
        h, ln = self.qkv(x)
        return self.mlp(x + h), ln


def _pair(device, **kw):
    torch.manual_seed(1)
    model = Pair(device, **kw)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.5)
    return model


def _inputs(device, n=2):
    torch.manual_seed(2)
    return [(torch.randn(3, 7, 64, device=device) * 2).to(torch.bfloat16) for _ in range(n)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["inside", "outside"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_fused_modules_compile_bit_identical(name, where, device):
    """21 tokens (padded rows), both norms, te.autocast inside the compiled function or around
    it: compiled steps are eager's bit for bit, and the per-tensor FP8 recipes' graphs run the
    fused codes."""
    recipe = RECIPES[name]
    model = _pair(device, activation="swiglu" if name == "current" else "gelu",
                  normalization="RMSNorm" if name in ("current", "mxfp8") else "LayerNorm")
    twin = copy.deepcopy(model)
    xs = _inputs(device)

    def inside(m, x):
        with te.autocast(recipe=recipe):
            return m(x)

    def outside(m, x):
        return m(x)
    want = _run(inside, model, xs)
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    compiled = torch.compile(inside if where == "inside" else outside, backend=recorder,
                             fullgraph=True)
    _assert_same(_run(compiled, twin, xs, None if where == "inside" else recipe), want)
    ops = _graph_ops(recorder)
    # DelayedScaling: the norm's and activation's ops max-accumulate x's amax into the
    # te.Linear's history themselves, as eager's calls (the buffers are compared above)
    norm_fwd = "norm_fwd_delayed" if name == "delayed" else "norm_fwd"
    assert {f"tequant.{norm_fwd}.default", "tequant.norm_bwd.default"} <= ops
    assert ("tequant.act_fwd_delayed.default" in ops) == (name == "delayed")
    fused = {"tequant.linear_fwd_given.default", "tequant.linear_bwd_given.default"}
    given = op_names(recorder.fw_graphs).count("tequant.linear_fwd_given.default")
    if name in FUSED:  # qkv's and fc1's x from the norms, fc2's from the activation
        assert fused <= ops and given == 3
    elif name in ("block", "mxfp8"):  # bf16 gelu writes fc2's blocks; the norms' do not fuse
        assert given == 1
    else:  # NVFP4: nothing fuses
        assert not fused & ops


def test_fused_modules_inductor_bit_identical():
    """inductor (its own code for the residual add and the activation around the same ops):
    eager's bits, with relu, whose inductor code rounds as eager's."""
    recipe = RECIPES["delayed"]
    model = _pair("cpu", activation="relu")
    twin = copy.deepcopy(model)
    xs = _inputs("cpu")

    def step(m, x):
        with te.autocast(recipe=recipe):
            return m(x)
    want = _run(step, model, xs)
    _assert_same(_run(torch.compile(step, fullgraph=True), twin, xs), want)


def test_compiled_high_precision_and_no_grad():
    """Outside te.autocast the compiled modules are eager's high-precision ones; under no_grad
    (no backward saved) the fused forward gives the training forward's output."""
    model = _pair("cpu")
    xs = _inputs("cpu", 1)

    def step(m, x):
        return m(x)
    want = _run(step, copy.deepcopy(model), xs)
    _assert_same(_run(torch.compile(step, backend="aot_eager", fullgraph=True),
                      copy.deepcopy(model), xs), want)

    def infer(m, x):
        with torch.no_grad(), te.autocast(recipe=RECIPES["current"]):
            return m(x)
    eager = infer(model, xs[0])
    compiled = torch.compile(infer, backend="aot_eager", fullgraph=True)(model, xs[0])
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


# ---- CUDA graphs (GPU only) -------------------------------------------------------------------

CUDA_GRAPH_RECIPES = ["delayed", "current", None]
STEPS, WARMUP = 6, 3


def _eager_steps(model, data, recipe):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data:
        opt.zero_grad(set_to_none=True)
        with te.autocast(recipe=recipe, enabled=recipe is not None):
            y, ln = model(x)
        (y.float().square().mean() + ln.float().mean()).backward()
        opt.step()
    torch.cuda.synchronize()
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", CUDA_GRAPH_RECIPES)
def test_cuda_graph_capture_replays_like_eager(name):
    """A whole training step (norm kernels' forward and backward, fused codes, the GEMMs, SGD)
    captured once: its replays give eager's parameters and DelayedScaling state bit for bit."""
    recipe = RECIPES.get(name)
    model = _pair("cuda")
    data = _inputs("cuda", WARMUP + STEPS)
    want = _eager_steps(copy.deepcopy(model), data, recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    static_x = data[0].clone()

    def step():
        opt.zero_grad(set_to_none=True)
        with te.autocast(recipe=recipe, enabled=recipe is not None):
            y, ln = model(static_x)
        (y.float().square().mean() + ln.float().mean()).backward()
        opt.step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in data[:WARMUP]:
            static_x.copy_(x)
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for x in data[WARMUP:]:
        static_x.copy_(x)
        graph.replay()
    torch.cuda.synchronize()
    got = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    _assert_same(got, want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", FUSED)
def test_reduce_overhead_bit_identical(name):
    """mode="reduce-overhead" (cudagraph trees) over the fused modules' forward, autocast
    inside: outputs and gradients of eager, step after step."""
    recipe = RECIPES[name]
    model = _pair("cuda")
    twin = copy.deepcopy(model)
    xs = _inputs("cuda", 4)

    def step(m, x):
        with te.autocast(recipe=recipe):
            return m(x)
    want = _run(step, model, xs)
    _assert_same(_run(torch.compile(step, mode="reduce-overhead", fullgraph=True), twin, xs),
                 want)
