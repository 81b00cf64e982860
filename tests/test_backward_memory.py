"""The compiled backward's memory: dh written over dy (tequant::act_bwd_over_dy) or, gated, over
h (tequant::act_bwd_over_h, python/tequant/_act_fn.py) and a large grad_output quantized in an op of its own
(_dy_given.split_dy_backward), so the compiled Llama-style block holds neither a second h nor the
bf16 dh next to fc1's dx and dW.

The kernels (cuda/act_backward.cu) and the C reference (csrc/ref/act_backward_ref.c) read each
element of h (and of dy) before the same thread (the same loop step) writes it: in place over
h, or over dy where dh has dy's shape (not gated), they give the bits of a separate dh, for every activation, dtype and row layout (16-byte chunks, element paths,
the bf16 table path). The split backward gives the one-op backward's bits (CPU and CUDA,
Float8BlockScaling and MXFP8BlockScaling, te.Linear and te.LayerNormMLP, the threshold lowered so
small shapes split). GPU: the compiled MLP's backward allocates no buffer of h's size (dh is h's)
and peaks under eager's. GPU cases: `-m gpu`.
"""
import copy

import pytest
import torch
import torch.utils.checkpoint

import tequant as te
from tequant import _C, _dy_given
from tequant.recipe import Float8BlockScaling, MXFP8BlockScaling
from test_compile import op_names
from test_act_kernels import ACTS, BASE, DTYPES, gpu_inputs, make, grad_of
from test_norm_kernels import bits, misaligned

GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])]


def _over_h(dy, h, act, layout):
    """dh computed over (a copy of) h in `layout`; returned contiguous."""
    h_in = layout(h.clone())
    _C._act_backward(dy, h_in, act, dh=h_in)
    return h_in.contiguous()


def _over_dy(dy, h, act, layout):
    """dh computed over (a copy of) dy in `layout` (not gated); returned contiguous."""
    dy_in = layout(dy.clone())
    _C._act_backward(dy_in, h, act, dh=dy_in)
    return dy_in.contiguous()


def _separate(dy, h, act):
    dh = torch.full_like(h, float("nan"))
    _C._act_backward(dy, h, act, dh=dh)
    return dh


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_in_place_bits_equal_a_separate_dh(act, dtype, device):
    # (M, K): one row, odd N (gated) / odd K, 16-byte rows, a misaligned base (element paths)
    for i, (m, k) in enumerate([(1, 2), (3, 14), (17, 1030), (6, 2048), (40, 1000)]):
        k = k if act in BASE else k - i % 2
        h, g = gpu_inputs(m, k, act, dtype, seed=i)
        h, g = h.to(device), g.to(device)
        want = _separate(g, h, act)
        for layout in (lambda t: t, misaligned):
            got = _over_h(g, h, act, layout)
            assert torch.equal(bits(got), bits(want)), (act, dtype, m, k)
            if act not in BASE:  # not gated: dh has dy's shape
                got = _over_dy(g, h, act, layout)
                assert torch.equal(bits(got), bits(want)), ("over dy", act, dtype, m, k)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("act", ["gelu", "silu", "geglu", "swiglu"])
def test_cuda_table_path_in_place(act):
    # bf16 over enough elements for the shared-memory tables (test_act_kernels' table case)
    h, dy, dy_g = make(2048, 8192, torch.bfloat16, seed=4, scale=3.0, device="cuda")
    g = grad_of(act, dy, dy_g)
    want = _separate(g, h, act)
    assert torch.equal(bits(_over_h(g, h, act, lambda t: t)), bits(want))
    if act not in BASE:
        assert torch.equal(bits(_over_dy(g, h, act, lambda t: t)), bits(want))


# ---- the compiled module -----------------------------------------------------------------------

def _mlp(hidden, ffn, device):
    torch.manual_seed(0)
    return te.LayerNormMLP(hidden, ffn, activation="swiglu", normalization="RMSNorm", bias=False,
                           params_dtype=torch.bfloat16, device=device)


def _backward_allocations(model, x, step):
    """(sizes of the allocations the backward makes, its peak over the memory at its start)."""
    y = step(model, x)
    loss = y.float().square().mean()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    try:
        loss.backward()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    sizes = [e["size"] for dev in trace for e in dev if e["action"] == "alloc"]
    return sizes, torch.cuda.max_memory_allocated() - start


@gpu
@pytest.mark.gpu
def test_compiled_backward_holds_no_second_h():
    """Float8BlockScaling's swiglu returns a plain dh: compiled, the backward makes no buffer of
    h's size (eager makes one: its dh), and its peak over its start is under eager's (it was
    over it with a separate dh: the peak moves to fc1's backward)."""
    torch._dynamo.reset()
    hidden, ffn, tokens = 256, 8192, 4096
    model = _mlp(hidden, ffn, "cuda")
    twin = copy.deepcopy(model)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    h_bytes = tokens * 2 * ffn * 2

    recipe = Float8BlockScaling()

    def step(m, x):
        with te.autocast(recipe=recipe):
            return m(x)
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):  # compile, then the allocator's steady state
        compiled(twin, x).float().square().mean().backward()
    step(model, x).float().square().mean().backward()
    eager_sizes, eager_peak = _backward_allocations(model, x, step)
    sizes, peak = _backward_allocations(twin, x, compiled)
    assert h_bytes in eager_sizes  # the test sees dh where it is a buffer of its own
    assert h_bytes not in sizes, sorted(sizes)[-6:]
    assert peak < eager_peak, (peak, eager_peak)  # (before act_bwd_over_h: 168.8 vs 166.7 MB)
    torch._dynamo.reset()


@pytest.fixture
def fresh_dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def split_everything(monkeypatch, fresh_dynamo_reset):
    monkeypatch.setattr(_dy_given, "SPLIT_DY_ELEMENTS", 0)


def _grads(model, x, step):
    model.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    y = step(model, xi)
    y.float().square().mean().backward()
    return [y.detach(), xi.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", [Float8BlockScaling(), MXFP8BlockScaling()],
                         ids=["block", "mxfp8"])
@pytest.mark.parametrize("kind", ["linear", "mlp", "checkpointed mlp"])
def test_split_backward_is_the_one_op_backward(kind, recipe, device, split_everything):
    """Compiled with dh over h and the split backward, eager's bits; also inside
    torch.utils.checkpoint, whose recompute the backward graph holds."""
    torch.manual_seed(1)
    if kind != "linear":
        model = _mlp(64, 192, device)
    else:
        model = te.Linear(64, 96, bias=False, params_dtype=torch.bfloat16, device=device)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 32, 64, device=device).to(torch.bfloat16)  # 64 rows: both formats' multiple

    def step(m, x):
        with te.autocast(recipe=recipe):
            if kind == "checkpointed mlp":
                return torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)
            return m(x)
    want = _grads(model, x, step)
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    got = _grads(twin, x, torch.compile(step, backend=recorder, fullgraph=True))
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
    ops = op_names(recorder.bw_graphs)
    assert "tequant.quantize.default" in ops, ops  # then dgrad and wgrad, one op each
    assert ops.count("tequant.linear_bwd_part.default") == 2, ops
    assert "tequant.linear_bwd.default" not in ops, ops


def test_small_or_biased_backward_stays_one_op(split_everything, monkeypatch):
    # the default threshold: a small grad_output keeps tequant::linear_bwd; so does a bias
    model = te.Linear(64, 96, bias=True, params_dtype=torch.bfloat16)
    recipe = Float8BlockScaling()

    def step(m, x):
        with te.autocast(recipe=recipe):
            return m(x)
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    _grads(model, torch.randn(64, 64).to(torch.bfloat16),
           torch.compile(step, backend=recorder, fullgraph=True))
    assert "tequant.linear_bwd.default" in op_names(recorder.bw_graphs)


@gpu
@pytest.mark.gpu
def test_split_backward_under_cuda_graphs(split_everything):
    """reduce-overhead (cudagraph trees): the split backward and dh over h, eager's bits over
    steps (each step's tensors kept into the next, as the trees require)."""
    model = _mlp(64, 192, "cuda")
    twin = copy.deepcopy(model)
    recipe = Float8BlockScaling()

    def step(m, x):
        with te.autocast(recipe=recipe):
            return m(x)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for i in range(4):
        x = torch.randn(64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        x = x.to(torch.bfloat16)
        want = [t.clone() for t in _grads(model, x, step)]
        got = [t.clone() for t in _grads(twin, x, compiled)]
        for j, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (i, j)


def test_h_read_after_the_activation_backward_is_kept(fresh_dynamo_reset):
    """A forward hook on fc1 hands h to the loss as well, so the compiled backward reads h after
    the activation's backward: functionalization must give act_bwd_over_h a copy. The loss's own
    term is Inductor's arithmetic (not eager's bits), so the check is a tolerance an h
    overwritten with dh would miss by orders of magnitude."""
    torch.manual_seed(0)
    model = _mlp(64, 192, "cpu")
    twin = copy.deepcopy(model)
    recipe = Float8BlockScaling()

    def hooked(m):
        store = []
        m.fc1.register_forward_hook(lambda mod, inp, out: store.append(out))
        return store

    def step(m, x, store):
        with te.autocast(recipe=recipe):
            y = m(x)
        return y.float().square().mean() + store.pop().float().square().mean()

    x = torch.randn(64, 64).to(torch.bfloat16)
    out = []
    for m, fn, store in ((model, step, hooked(model)),
                         (twin, torch.compile(step, fullgraph=True), hooked(twin))):
        xi = x.clone().requires_grad_()
        fn(m, xi, store).backward()
        out.append([xi.grad] + [p.grad for p in m.parameters()])
    for got, want in zip(out[1], out[0]):
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err < 5e-2, err
