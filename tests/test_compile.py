"""torch.compile(fullgraph=True) with te.autocast and te.Linear (issue 6, ARCHITECTURE.md 5).

For every recipe, on CPU (the inductor CPU backend and aot_eager) and CUDA: te.autocast entered
inside the compiled function, around it, and nested with two recipes; a 2-layer MLP and a small
transformer block (attention in torch), and a Linear alone under inductor (the autocast inside,
every recipe; outside: DelayedScaling and NVFP4). Each is traced with 0 graph breaks
(fullgraph=True; counted by torch._dynamo.explain for the nested autocasts), and two training
steps give outputs, gradients and DelayedScaling state BIT-identical to eager from the same
state. Also: recompiles (a new recipe recompiles once, an equal recipe object does not),
enabled=False, calibration, the state readers inside compiled code, backward_override,
DelayedScaling's amax all-reduce over two gloo ranks, and the errors the compiled path raises.
CUDA graphs: tests/test_cuda_graphs.py.
The code under test: python/tequant/_compile.py and python/tequant/_compile_linear.py.
"""
import copy
import dataclasses

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

import tequant as te
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])]
RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),  # RHT, stochastic rounding (seeded per step below), 2D W
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class MLP(torch.nn.Module):
    def __init__(self, width, device):
        super().__init__()
        self.fc1 = te.Linear(width, 2 * width, params_dtype=torch.bfloat16, device=device)
        self.fc2 = te.Linear(2 * width, width, params_dtype=torch.bfloat16, device=device)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(torch.nn.Module):
    """Pre-norm transformer block: te.Linear projections, attention and norms in torch."""

    def __init__(self, width, heads, device):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width, device=device, dtype=torch.bfloat16)
        self.qkv = te.Linear(width, 3 * width, params_dtype=torch.bfloat16, device=device)
        self.proj = te.Linear(width, width, params_dtype=torch.bfloat16, device=device)
        self.norm2 = torch.nn.LayerNorm(width, device=device, dtype=torch.bfloat16)
        self.mlp = MLP(width, device)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, w))
        return x + self.mlp(self.norm2(x))


def _model(kind, device):
    torch.manual_seed(0)
    if kind == "linear":
        return te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    if kind == "mlp":
        return MLP(64, device)
    return Block(64, 2, device)


def _input(kind, device):
    torch.manual_seed(1)
    shape = (2, 24, 64) if kind == "block" else (3, 7, 64)  # token counts no format divides
    return torch.randn(shape, dtype=torch.bfloat16, device=device)


def _inside(recipe):
    def step(model, x):
        with te.autocast(recipe=recipe):
            return model(x)
    return step


def _outside(model, x):
    return model(x)


def _nested(r_outer, r_inner):
    def step(model, x):
        with te.autocast(recipe=r_outer):
            y = model(x)
            with te.autocast(recipe=r_inner):
                y = y + model(x)
        return y
    return step


def _train_steps(step, model, x, eager_autocast, steps=2):
    """Runs `steps` forward+backward passes; returns (outputs, input grads, param grads, buffers)."""
    outs, xgrads = [], []
    for i in range(steps):
        xi = x.clone().requires_grad_()
        torch.manual_seed(100 + i)  # the same stochastic-rounding bits in eager and compiled
        if eager_autocast is not None:
            with te.autocast(recipe=eager_autocast):
                y = step(model, xi)
        else:
            y = step(model, xi)
        y.float().square().mean().backward()
        outs.append(y.detach())
        xgrads.append(xi.grad)
    grads = [p.grad.clone() for p in model.parameters()]
    return outs, xgrads, grads, [b.clone() for b in model.buffers()]


def _assert_bit_identical(eager, compiled):
    for what, a_list, b_list in zip(("output", "input grad", "param grad", "buffer"), eager,
                                    compiled):
        assert len(a_list) == len(b_list), what
        for a, b in zip(a_list, b_list):
            assert a.dtype == b.dtype and a.shape == b.shape, what
            assert torch.equal(a, b), f"{what} differs: max |diff| {(a.float() - b.float()).abs().max()}"


def _check(step, kind, device, eager_autocast=None, backend="aot_eager"):
    model = _model(kind, device)
    twin = copy.deepcopy(model)
    x = _input(kind, device)
    eager = _train_steps(step, model, x, eager_autocast)
    compiled_step = torch.compile(step, backend=backend, fullgraph=True)
    compiled = _train_steps(compiled_step, twin, x, eager_autocast)
    _assert_bit_identical(eager, compiled)
    return model, x


def op_names(graphs):
    """The call_function targets of AOT-recorded graphs, in order, as names; an op that mutates
    its arguments (DelayedScaling's in-place ops) is named as the op auto_functionalized wraps."""
    def name(node):
        if "auto_functionalized" in str(node.target):
            return str(node.args[0])
        return str(node.target)
    return [name(n) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


def _graph_breaks(step, model, x, eager_autocast=None):
    explain = torch._dynamo.explain(step)
    if eager_autocast is None:
        return explain(model, x).graph_break_count
    with te.autocast(recipe=eager_autocast):
        return explain(model, x).graph_break_count


# _check compiles with fullgraph=True, which raises at any graph break: every compiled test
# here asserts 0 graph breaks by passing. torch._dynamo.explain counts them again in
# test_nested_autocasts_with_two_recipes (the autocasts' enter / exit traced inside and across).


# The models: the MLP (a te.Linear on the graph's input, GELU, a te.Linear giving the graph's
# output, on the same odd token count) holds what a Linear alone would test; the block adds
# attention and norms in bf16 around them. A te.Linear alone, every recipe, is compiled with
# inductor in test_inductor_backend_is_bit_identical.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_autocast_inside_compiled_function(kind, name, device):
    _check(_inside(RECIPES[name]), kind, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", RECIPES)
def test_compiled_function_inside_autocast(name, device):
    _check(_outside, "mlp", device, eager_autocast=RECIPES[name])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("outer,inner", [("current", "mxfp8"), ("delayed", "nvfp4"),
                                         ("block", "current")])
def test_nested_autocasts_with_two_recipes(outer, inner, device):
    # The inner block runs the module again: with DelayedScaling outside, the module quantizes
    # under two recipes in one outermost autocast (state kept per module, as in eager).
    step = _nested(RECIPES[outer], RECIPES[inner])
    model, x = _check(step, "mlp", device)
    assert _graph_breaks(step, model, x) == 0


@pytest.mark.parametrize("name", RECIPES)
def test_inductor_backend_is_bit_identical(name):
    # Inductor's own codegen for torch ops (GELU's backward, LayerNorm) rounds differently from
    # eager's kernels, so the bit-for-bit check under inductor is on te.Linear alone; the
    # aot_eager tests above cover the models (same graphs, torch ops run as in eager). The
    # autocast outside the compiled function (the same te.Linear ops in the graph, the autocast's
    # exit eager): DelayedScaling (its scale update at that exit) and NVFP4 (its generator).
    _check(_inside(RECIPES[name]), "linear", "cpu", backend="inductor")
    if name in ("delayed", "nvfp4"):
        _check(_outside, "linear", "cpu", eager_autocast=RECIPES[name], backend="inductor")


def test_recipe_change_recompiles_once_and_equal_recipes_share_code():
    model, x = _model("linear", "cpu"), _input("linear", "cpu")
    counter = torch._dynamo.testing.CompileCounter()
    step = torch.compile(_outside, backend=counter, fullgraph=True)
    sequence = [Float8CurrentScaling(), Float8CurrentScaling(), MXFP8BlockScaling(),
                MXFP8BlockScaling(), Float8CurrentScaling()]
    counts = []
    for recipe in sequence:
        with te.autocast(recipe=recipe):
            step(model, x)
        counts.append(counter.frame_count)
    assert counts == [1, 1, 2, 2, 2]
    inside = torch.compile(lambda m, x, r: _inside(r)(m, x), backend=counter, fullgraph=True)
    before = counter.frame_count
    for recipe in (DelayedScaling(), DelayedScaling(), DelayedScaling(margin=1)):
        inside(model, x, recipe)
    assert counter.frame_count - before == 2


def test_enabled_false_and_outside_autocast_are_plain_linear():
    model, x = _model("linear", "cpu"), _input("linear", "cpu")
    expected = F.linear(x, model.weight, model.bias)

    def off(m, x):
        with te.autocast(enabled=False, recipe=RECIPES["mxfp8"]):
            return m(x), te.is_fp8_enabled(), te.autocast_depth()

    y, enabled, depth = torch.compile(off, backend="aot_eager", fullgraph=True)(model, x)
    assert torch.equal(y, expected) and enabled is False and depth == 1
    assert torch.equal(torch.compile(_outside, backend="aot_eager", fullgraph=True)(model, x),
                       expected)


def test_state_readers_inside_compiled_code_match_eager():
    recipe = NVFP4BlockScaling()

    def readers():
        return (te.is_fp8_enabled(), te.is_fp8_calibration(), te.get_fp8_recipe(),
                te.autocast_depth())

    def traced(x):
        outside = readers()
        with te.autocast(recipe=recipe):
            with te.autocast(enabled=False, calibrating=True, recipe=recipe) as ac:
                inner = readers()
        return x + 1, outside, inner, ac.active

    _, outside, inner, active = torch.compile(traced, backend="eager", fullgraph=True)(
        torch.zeros(1))
    with te.autocast(recipe=recipe):
        with te.autocast(enabled=False, calibrating=True, recipe=recipe):
            eager_inner = readers()
    assert outside == readers() and inner == eager_inner and active is False
    with te.autocast(recipe=recipe):  # compiled inside an eager autocast: depth 2 inside
        _, outside, inner, _ = torch.compile(traced, backend="eager", fullgraph=True)(
            torch.zeros(1))
        assert outside[0] is True and outside[3] == 1 and inner[3] == 3


def test_calibration_under_compile_matches_eager():
    recipe = RECIPES["delayed"]

    def calibrate(m, x):
        with te.autocast(enabled=False, calibrating=True, recipe=recipe):
            return m(x)

    model, x = _model("linear", "cpu"), _input("linear", "cpu")
    twin = copy.deepcopy(model)
    calibrate(model, x)
    torch.compile(calibrate, backend="aot_eager", fullgraph=True)(twin, x)
    assert torch.equal(model.delayed_amax_history_fwd, twin.delayed_amax_history_fwd)
    assert model.delayed_amax_history_fwd[0].min() > 0


def test_delayed_module_twice_in_one_compiled_autocast_is_refused():
    model, x = _model("linear", "cpu"), _input("linear", "cpu")

    def twice(m, x):
        with te.autocast(recipe=RECIPES["delayed"]):
            return m(x) + m(x)

    with pytest.raises(Exception, match="can run once per te.autocast"):
        torch.compile(twice, backend="aot_eager", fullgraph=True)(model, x)


def test_weight_cache_under_compile_is_refused_clearly():
    model, x = _model("linear", "cpu"), _input("linear", "cpu")

    def cached(m, x):
        with te.autocast(recipe=RECIPES["current"]):
            return m(x, is_first_microbatch=True)

    with pytest.raises(Exception, match="is_first_microbatch"):
        torch.compile(cached, backend="aot_eager", fullgraph=True)(model, x)


@pytest.mark.parametrize("make", [DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
                                  MXFP8BlockScaling, NVFP4BlockScaling])
def test_recipe_built_inside_compiled_code_is_refused_clearly(make):
    """Every recipe (the ones with MMParams defaults too: Dynamo cannot build those and said
    only "Unexpected type in sourceless builder" before Recipe.__new__ refused first)."""
    model, x = _model("linear", "cpu"), _input("linear", "cpu")

    def inline(m, x):
        with te.autocast(recipe=make()):
            return m(x)

    with pytest.raises(Exception, match="needs a recipe built outside the compiled code"):
        torch.compile(inline, backend="aot_eager", fullgraph=True)(model, x)


def test_import_leaves_dynamo_unloaded_and_registers_when_it_loads():
    # `import tequant` must not cost eager users torch._dynamo's import; the twins and the
    # trace-time constants register when torch.compile loads it.
    import os
    import subprocess
    import sys
    code = (
        "import sys, torch, tequant as te\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "r = te.recipe.Float8CurrentScaling()\n"
        "m = te.Linear(32, 16)\n"
        "def f(x):\n"
        "    with te.autocast(recipe=r):\n"
        "        return m(x)\n"
        "x = torch.randn(4, 32)\n"
        "y = torch.compile(f, backend='eager', fullgraph=True)(x)\n"
        "assert torch.equal(y, f(x))\n"
        "assert te._compile._REGISTERED\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
@pytest.mark.parametrize("name", ["current", "mxfp8", "nvfp4"])
def test_backward_override_under_compile_matches_eager(name, override):
    recipe = dataclasses.replace(RECIPES[name], backward_override=override)
    _check(_inside(recipe), "mlp", "cpu")  # fullgraph=True: no graph break


def _compiled_reduction_worker(rank, world, wheres):
    """Per `where` (te.autocast inside or outside the compiled function): the buffers of a
    compiled te.Linear equal to an eager one's after two steps, and the amax history."""
    import torch.distributed as dist
    results = {}
    for where in wheres:
        torch._dynamo.reset()
        recipe = RECIPES["delayed"]
        torch.manual_seed(0)  # same weights on every rank
        eager = te.Linear(16, 16)
        compiled_model = copy.deepcopy(eager)
        group = dist.group.WORLD

        def inside(m, x):
            with te.autocast(recipe=recipe, amax_reduction_group=group):
                return m(x)

        step = torch.compile(inside if where == "inside" else _outside, backend="aot_eager",
                             fullgraph=True)
        for i in range(2):
            x = torch.full((4, 16), float(rank + 1 + i))  # rank r's input amax differs
            inside(eager, x).mul(rank + 1).sum().backward()  # dy amax differs per rank too
            if where == "inside":
                step(compiled_model, x).mul(rank + 1).sum().backward()
            else:
                with te.autocast(recipe=recipe, amax_reduction_group=group):
                    y = step(compiled_model, x)
                y.mul(rank + 1).sum().backward()
        results[where] = [torch.equal(a, b) for a, b in zip(eager.buffers(),
                                                           compiled_model.buffers())] + \
            [eager.delayed_amax_history_fwd[:, 0].tolist()]
    return results


@pytest.fixture(scope="module")
def compiled_reduction_two_ranks():
    """Two gloo ranks (tests/dist_util.py), spawned once for both placements of te.autocast."""
    import os
    import sys
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_util import run_ranks
    return run_ranks(_compiled_reduction_worker, 2, ["inside", "outside"], timeout=300)


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_amax_reduction_group_under_compile_matches_eager(where, compiled_reduction_two_ranks):
    """Two gloo ranks: the compiled module all-reduces its amaxes (MAX) like the eager one."""
    results = [r[where] for r in compiled_reduction_two_ranks]
    for rank in range(2):
        assert results[rank][:4] == [True] * 4
    assert results[0][4] == results[1][4] and max(results[0][4]) == 3.0  # rank 1's last amax


def _one_backward_reduction_worker(rank, world, kind="linear"):
    """Three compiled te.Linear (kind "linear"), or a te.LayerNormMLP whose fc1 and fc2 multiply
    the fused norm's and activation's codes (kind "layernorm_mlp": the in-place *_given ops),
    under DelayedScaling with an amax reduction group (te.autocast outside the compiled code):
    their backward graphs hold no collective, each module's backward queues its update
    (tequant::amax_defer_queue, handed the module's buffers themselves, before the in-place op
    accumulates dy's amax into the history), and the end of the
    backward pass runs one all-reduce for all (as eager: a collective per module would be a
    point where every rank waits for the slowest); the buffers equal an eager model's after
    three steps."""
    import torch.distributed as dist
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from tequant import delayed
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)
    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=keep)
    torch._dynamo.reset()
    recipe, group = RECIPES["delayed"], dist.group.WORLD
    torch.manual_seed(0)
    if kind == "linear":
        eager, shape = torch.nn.Sequential(*(te.Linear(16, 16) for _ in range(3))), (4, 16)
    else:
        from test_fused_act_modules import _mlp
        eager, shape = _mlp("swiglu", dtype=torch.float32), (4, 64)
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(_outside, backend=backend, fullgraph=True)
    reductions = []
    reduce = delayed._reduce

    def counting(slots, recipe, group):
        reductions.append(len(slots))
        return reduce(slots, recipe, group)
    delayed._reduce = counting
    try:
        counts = []
        for i in range(3):
            x = torch.linspace(-1, 1, shape[0] * shape[1]).view(shape) * (rank + 1 + i)
            for model in (eager, compiled_model):
                with te.autocast(recipe=recipe, amax_reduction_group=group):
                    y = step(model, x) if model is compiled_model else model(x)
                before = len(reductions)
                y.mul(rank + 1).sum().backward()
                counts.append(reductions[before:])
    finally:
        delayed._reduce = reduce
    same = [torch.equal(a, b) for a, b in zip(eager.buffers(), compiled_model.buffers())]
    return counts, same, graphs


def _inductor_reduction_worker(rank, world):
    """Two compiled te.Linear under DelayedScaling with an amax reduction group, Inductor (which
    re-inplaces the backward op's accumulation onto the history and must keep the queue op,
    which has no output): buffers and gradients equal an eager model's after two steps."""
    import torch.distributed as dist
    torch._dynamo.reset()
    recipe, group = RECIPES["delayed"], dist.group.WORLD
    torch.manual_seed(0)
    eager = torch.nn.Sequential(te.Linear(16, 16), te.Linear(16, 16))
    compiled_model = copy.deepcopy(eager)
    step = torch.compile(_outside, backend="inductor", fullgraph=True)
    for i in range(2):
        x = torch.linspace(-1, 1, 64).view(4, 16) * (rank + 1 + i)
        for model in (eager, compiled_model):
            with te.autocast(recipe=recipe, amax_reduction_group=group):
                y = step(model, x) if model is compiled_model else model(x)
            y.mul(rank + 1).sum().backward()
    return ([torch.equal(a, b) for a, b in zip(eager.buffers(), compiled_model.buffers())]
            + [torch.equal(a.grad, b.grad) for a, b in zip(eager.parameters(),
                                                           compiled_model.parameters())])


def test_compiled_backward_reduction_inductor():
    import os
    import sys
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_util import run_ranks
    assert run_ranks(_inductor_reduction_worker, 2, timeout=300) == [[True] * 12] * 2


def test_deferred_backward_update_survives_a_failed_pass():
    """delayed.defer_backward's queue: a backward pass that raises after queueing runs no
    end-of-pass callback; its module is then updated at the end of the next pass, with that
    pass's module (a flag per pass would have left both waiting forever)."""
    from tequant import _plan, delayed
    recipe = DelayedScaling(amax_history_len=4)
    plan = _plan.of_id(str(te._C.recipe_key(recipe)))
    hists = [torch.zeros(4, 1), torch.zeros(4, 1)]
    scales = [torch.ones(1), torch.ones(1)]
    hists[0][0, 0], hists[1][0, 0] = 2.0, 4.0

    class Defer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, i, fail):
            ctx.i, ctx.fail = i, fail
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            delayed.defer_backward(hists[ctx.i], scales[ctx.i], plan, None)
            if ctx.fail:
                raise RuntimeError("backward failed on purpose")
            return g, None, None
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="on purpose"):
        Defer.apply(x, 0, True).sum().backward()
    assert hists[0][0, 0] == 2.0 and scales[0].item() == 1.0  # its pass ended without the update
    Defer.apply(x, 1, False).sum().backward()
    fmax = delayed.scaled_maxes(plan, delayed.BACKWARD)[0]
    for i, amax in enumerate((2.0, 4.0)):
        assert hists[i][:, 0].tolist() == [0.0, 0.0, 0.0, amax], i  # rolled: row 0 to the end
        assert scales[i].item() == fmax / amax, i
    assert delayed._PENDING == []


def test_compiled_backward_one_amax_reduction_per_pass():
    import os
    import sys
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_util import run_ranks
    for counts, same, graphs in run_ranks(_one_backward_reduction_worker, 2, timeout=300):
        assert counts == [[3]] * 6, counts  # eager and compiled: one all-reduce of 3 rows
        assert same == [True] * 12, same
        assert graphs and all("all_reduce" not in g for g in graphs), graphs
        assert sum(g.count("tequant.amax_defer_queue") for g in graphs) == 3, graphs


def test_compiled_fused_codes_one_amax_reduction_per_pass():
    """The same for te.LayerNormMLP's fused-codes ops (linear_bwd_dy_given, linear_bwd_given),
    which declare hist_bwd and scale_bwd mutated: the deferred update must still reach the
    module's own buffers (it fails when the queue is handed functionalization's copies, as it
    would be after the op under aot_eager)."""
    import os
    import sys
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_util import run_ranks
    for counts, same, graphs in run_ranks(_one_backward_reduction_worker, 2, "layernorm_mlp",
                                          timeout=300):
        assert counts == [[2]] * 6, counts  # fc1 and fc2: one all-reduce of 2 rows
        assert len(same) == 8 and all(same), same
        assert graphs and all("all_reduce" not in g for g in graphs), graphs
        assert sum(g.count("tequant.amax_defer_queue") for g in graphs) == 2, graphs
        assert any("linear_bwd_dy_given" in g for g in graphs), graphs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("needs", [3, 1, 2, 8 | 3, 8 | 1, 8])
def test_linear_op_kernels_match_their_fake_shapes(name, needs, device):
    """The C kernels of tequant::linear_fwd / linear_bwd (csrc/ext/linear_ops.c) give exactly
    the outputs their fake implementations promise (count, shape, dtype): packed buffers (needs
    bit 8) and member tensors alike; an odd token count exercises the padded rows."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    recipe = RECIPES[name]
    recipe_id = str(te._C.recipe_key(recipe))
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 7, 64, generator=g, device=device)
    w = torch.randn(32, 64, generator=g, device=device)
    b = torch.randn(32, generator=g, device=device)
    scale = torch.ones(3, device=device) if name == "delayed" else None
    fwd, bwd = torch.ops.tequant.linear_fwd, torch.ops.tequant.linear_bwd

    def shapes(outs):
        return [(tuple(t.shape), t.dtype) for t in outs]
    torch.manual_seed(5)
    real = fwd(x, w, b, recipe_id, needs, scale)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = fwd(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b), recipe_id,
                   needs, None if scale is None else mode.from_tensor(scale))
    assert shapes(real) == shapes(fake)
    assert torch.equal(real[0], _eager_linear(recipe, x, w, b))  # eager te.Linear's bits
    if not needs & 8:
        return
    n_x = 1 if needs & 2 else 0
    dy = torch.randn(3, 7, 32, generator=g, device=device)
    args = (recipe_id, needs & 3, [3, 7, 64], x.dtype, w.dtype, b.dtype, scale)
    grads = bwd(dy, real[1] if n_x else None, real[1 + n_x], *args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = bwd(mode.from_tensor(dy), None if not n_x else mode.from_tensor(real[1]),
                   mode.from_tensor(real[1 + n_x]), *args[:-1],
                   None if scale is None else mode.from_tensor(scale))
    assert shapes(grads) == shapes(fake)
    assert len(grads) == bin(needs & 3).count("1") + 1 + (name == "delayed")


def _eager_linear(recipe, x, w, b):
    lin = te.Linear(64, 32, device=x.device)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    torch.manual_seed(5)
    with te.autocast(recipe=recipe):
        return lin(x).detach()


def test_linear_op_kernels_refuse_bad_arguments():
    recipe_id = str(te._C.recipe_key(DelayedScaling()))
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match="DelayedScaling needs scale_fwd"):
        torch.ops.tequant.linear_fwd(x, w, None, recipe_id, 8 | 3, None)
    with pytest.raises(TypeError, match="takes 6 or 7 arguments"):
        te._C.linear_fwd_op(x, w)
    with pytest.raises(ValueError, match="x_dtype and w_dtype"):
        torch.ops.tequant.linear_bwd(x, None, torch.empty(8, dtype=torch.uint8), recipe_id, 1,
                                     [16, 32], torch.int32, torch.float32, None, torch.ones(3))
