"""te.ops (quantize, dequantize, gemm) and QuantizedTensor under torch.compile(fullgraph=True).

Every result of a compiled function is compared bit for bit with the same function run eagerly
(te.ops' direct C path): QuantizedTensor codes, scales and members, dequantized values, and the
three GEMMs of a linear layer (fprop / dgrad / wgrad, bias, out=, accumulate), for every recipe
kind on CPU and, where available, CUDA. Also: no graph break (fullgraph=True, and
torch._dynamo.explain for NVFP4's step), a new recipe recompiles once and an equal one does not,
DelayedScaling's history slot, stochastic rounding drawn at run time, the eager errors, and where
the tensors a compiled te.Linear's ops return come from (the DLPack allocator until the process
has cudagraph trees, torch.empty after). The ops are python/tequant/_compile_ops.py.
"""
import os
import re
import subprocess
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import tequant as te
from tequant.quantized import QuantizedTensor
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
RECIPES = {
    "delayed": DelayedScaling(),
    "current": Float8CurrentScaling(),
    "block_w2d": Float8BlockScaling(w_block_scaling_dim=2),
    "block_w1d": Float8BlockScaling(w_block_scaling_dim=1),
    "mxfp8": MXFP8BlockScaling(),
    # RHT on the columnwise input and gradient, SR on gradients, 16x16 weight blocks
    "nvfp4": NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False,
                               disable_2d_quantization=False),
}
MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def randn(shape, dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def bits(t):
    """A tensor's raw bits on CPU (torch.equal has no float8 kernels; NaNs compare too)."""
    return t.detach().view(_INT_OF_SIZE[t.element_size()]).cpu()


def assert_same(a, b, what="result"):
    """Bit equality of tensors, or of QuantizedTensors (members, codes, scales, metadata)."""
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, what
        assert torch.equal(bits(a), bits(b)), what
        return
    assert isinstance(b, QuantizedTensor), what
    assert (a.shape, a.dtype, a.recipe, a.role) == (b.shape, b.dtype, b.recipe, b.role), what
    for name in MEMBERS:
        ma, mb = getattr(a, name), getattr(b, name)
        assert (ma is None) == (mb is None), f"{what}.{name}"
        if ma is not None:
            assert_same(ma, mb, f"{what}.{name}")
    for direction in ("rowwise", "columnwise"):
        assert a.has(direction) == b.has(direction), what
        if a.has(direction):
            assert torch.equal(a.codes(direction), b.codes(direction)), f"{what} {direction}"
            assert torch.equal(bits(a.scales(direction)), bits(b.scales(direction))), what
    assert b.config == a.config  # resolved from (recipe, role) outside the compiled region


def assert_all_same(eager, compiled):
    assert len(eager) == len(compiled)
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert_same(a, b, f"output {i}")


def compile_and_compare(fn, make_args, backend="aot_eager"):
    """Runs fn eagerly and compiled (fullgraph) on equal fresh arguments; their results and
    their argument tensors afterwards (out= buffers) must be bit-identical. Returns the
    compiled result and the compiled run's arguments."""
    eager_args, compiled_args = make_args(), make_args()
    eager = fn(*eager_args)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)(*compiled_args)
    assert_all_same(eager, compiled)
    assert_all_same([a for a in eager_args if isinstance(a, torch.Tensor)],
                    [a for a in compiled_args if isinstance(a, torch.Tensor)])
    return compiled, compiled_args


def graph_breaks(fn, *args):
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_break_count


# ---------------------------------------------------------------------------------------------
# A linear layer's quantizations and products, every recipe
# ---------------------------------------------------------------------------------------------

M, K, N = 64, 64, 32  # multiples of 32 (MXFP8) and 16 (NVFP4); M splits into 2 x 32


def linear_step(x, w, dy, bias, dw, y_out, recipe):
    """fprop y = x W^T (+ bias), dgrad dx = dy W, wgrad dW += dy^T x, and dequantizations."""
    qx = te.ops.quantize(x, recipe, "input", rowwise=True, columnwise=True)
    qw = te.ops.quantize(w, recipe, "weight", rowwise=True, columnwise=True)
    qdy = te.ops.quantize(dy, recipe, "grad_output", rowwise=True, columnwise=True, rng=(7, 40))
    y = te.ops.gemm(qx, qw, transpose_b=True, bias=bias)
    te.ops.gemm(qx, qw, transpose_b=True, out=y_out)  # [2, 32, N]: out= with leading dims
    dx = te.ops.gemm(qdy, qw)
    te.ops.gemm(qdy, qx, transpose_a=True, out=dw, accumulate=True)
    return (qx, qw, qdy, y, dx, te.ops.dequantize(qx), qw.dequantize_direction("columnwise"),
            qdy.dequantize(torch.bfloat16))


def linear_args(device):
    def make():
        return (randn((2, M // 2, K), seed=1, device=device), randn((N, K), seed=2, device=device),
                randn((2, M // 2, N), seed=3, device=device), randn((N,), seed=4, device=device),
                randn((N, K), torch.float32, seed=5, device=device),
                torch.empty(2, M // 2, N, dtype=torch.bfloat16, device=device))
    return make


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_step_is_bit_identical_and_has_no_graph_break(name, device):
    recipe = RECIPES[name]
    args = linear_args(device)
    compile_and_compare(lambda *t: linear_step(*t, recipe), args)  # fullgraph=True: no break
    if name == "nvfp4":  # and counted by explain once (RHT, stochastic rounding, 2-D blocks)
        assert graph_breaks(linear_step, *args(), recipe) == 0


@pytest.mark.parametrize("backend,name", [("inductor", "current"), ("inductor", "mxfp8"),
                                          ("inductor", "nvfp4"), ("eager", "block_w2d"),
                                          ("eager", "delayed")])
def test_other_backends(backend, name):
    recipe = RECIPES[name]
    compile_and_compare(lambda *t: linear_step(*t, recipe), linear_args(DEVICES[-1]), backend)


def test_import_registers_the_ops_and_leaves_the_traced_code_for_later():
    """`import tequant` registers the ops (an exported program can use them) but does not load
    _compile_trace.py, which needs torch._dynamo (about a second to import)."""
    code = ("import sys, torch, tequant; "
            "assert 'tequant._compile_trace' not in sys.modules; "
            "print(torch.ops.tequant.quantize, torch.ops.tequant.gemm_out)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "tequant.quantize" in done.stdout and "tequant.gemm_out" in done.stdout


def test_recipe_configs_are_the_advertised_ones():
    nvfp4 = RECIPES["nvfp4"]
    assert te.quantizer_config(nvfp4, "input").rht
    assert te.quantizer_config(nvfp4, "grad_output").stochastic_rounding
    assert te.quantizer_config(nvfp4, "weight").two_d
    assert te.quantizer_config(RECIPES["block_w2d"], "weight").two_d
    assert not te.quantizer_config(RECIPES["block_w1d"], "weight").two_d


# ---------------------------------------------------------------------------------------------
# Guards: recompilation follows the recipe's value, not its identity
# ---------------------------------------------------------------------------------------------

def test_a_new_recipe_recompiles_once_and_an_equal_one_does_not():
    def fn(x, recipe):
        return te.ops.quantize(x, recipe, "input").dequantize()

    counter = CompileCounter()
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    x = randn((32, 64))
    for recipe, frames in [(MXFP8BlockScaling(), 1), (MXFP8BlockScaling(), 1),
                           (Float8CurrentScaling(), 2), (Float8CurrentScaling(), 2),
                           (Float8CurrentScaling(fp8_format=te.recipe.Format.E4M3), 3),
                           (MXFP8BlockScaling(), 3), (None, 4), (None, 4)]:
        assert torch.equal(compiled(x, recipe), fn(x, recipe))
        assert counter.frame_count == frames, recipe


def test_a_new_shape_recompiles_with_the_right_layout():
    def fn(x):
        q = te.ops.quantize(x, RECIPES["mxfp8"], "input", columnwise=True)
        return q, q.dequantize()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for rows in (32, 64, 96, 160):  # the second shape makes Dynamo try a dynamic dim
        x = randn((rows, 64), seed=rows)
        assert_all_same(fn(x), compiled(x))


# ---------------------------------------------------------------------------------------------
# State: DelayedScaling's scale and history slot, stochastic rounding
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slot_amax", [0.5, 100.0])  # below and above the amax of x
def test_delayed_scaling_scale_and_history_slot(device, slot_amax):
    recipe = RECIPES["delayed"]

    def fn(x, scale, history):
        q = te.ops.quantize(x, recipe, "input", columnwise=True, scale=scale,
                            amax_history=history[0, 1:2])
        return q, q.dequantize()

    def make():
        history = torch.zeros(3, 4, device=device)
        history[0, 1] = slot_amax
        return randn((2, 16, 64), seed=8, device=device), torch.tensor([4.0], device=device), history

    (q, _), (x, _, history) = compile_and_compare(fn, make)
    want = max(slot_amax, x.float().abs().max().item())
    assert q.amax.shape == (1,) and q.amax.item() == want and history[0, 1].item() == want
    assert history.count_nonzero() == 1  # only the slot was written


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_draws_from_the_default_generator_at_run_time(device):
    recipe = RECIPES["nvfp4"]
    x = randn((64, 64), torch.float32, seed=9, device=device)

    def fn(x):
        a = te.ops.quantize(x, recipe, "grad_output", columnwise=True)
        b = te.ops.quantize(x, recipe, "grad_output", columnwise=True)  # not merged with a
        return a, b

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    eager = fn(x) + fn(x)
    torch.manual_seed(3)
    runs = compiled(x) + compiled(x)  # each run draws anew, as each eager call does
    assert_all_same(eager, runs)
    assert not torch.equal(runs[0].data, runs[1].data)
    assert not torch.equal(runs[0].data, runs[2].data)


def test_stochastic_roundings_stay_apart_in_a_training_graph():
    """AOT's partitioner runs CSE on a graph with a backward: two identical calls without rng=
    must still draw twice."""
    recipe = RECIPES["nvfp4"]
    x = randn((64, 64), torch.float32, seed=9)

    def fn(x, p):
        a = te.ops.quantize(x, recipe, "grad_output")
        b = te.ops.quantize(x, recipe, "grad_output")
        return a.data, b.data, (p * p).sum()

    p = torch.ones(4, requires_grad=True)
    torch.manual_seed(4)
    eager = fn(x, p)
    torch.manual_seed(4)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager_decomp_partition")(x, p)
    compiled[2].backward()
    assert_all_same(eager[:2], compiled[:2])
    assert not torch.equal(compiled[0], compiled[1])


def test_explicit_rng_is_reproducible_under_compile():
    recipe = RECIPES["nvfp4"]

    def fn(x, seed):
        return te.ops.quantize(x, recipe, "grad_output", rng=(seed, 2**64 - 16))

    x = randn((32, 64), torch.float32, seed=10)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for seed in (1, 2**63 + 5):  # the upper half of uint64 crosses the op schema's int64
        assert_same(fn(x, seed), compiled(x, seed))


# ---------------------------------------------------------------------------------------------
# QuantizedTensors crossing the compiled region's boundary
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "block_w2d"])
def test_eager_quantized_tensors_as_inputs(name):
    recipe = RECIPES[name]
    qx = te.ops.quantize(randn((64, 64), seed=11), recipe, "input")
    qw = te.ops.quantize(randn((32, 64), seed=12), recipe, "weight")
    assert qx._config is not None  # eager: the config from the direct C path

    def fn(qx, qw, bias, out):
        te.ops.gemm(qx, qw, transpose_b=True, bias=bias, out=out, accumulate=True)
        y = te.ops.gemm(qx, qw, transpose_b=True, out_dtype=torch.float32)
        return y, qx.codes(), qx.scales(), qw.dequantize(torch.float16)

    def make():
        return qx, qw, randn((32,), seed=13), randn((64, 32), torch.float32, seed=14)

    compile_and_compare(fn, make, backend="inductor" if name == "mxfp8" else "aot_eager")
    assert graph_breaks(fn, *make()) == 0


def test_inputs_requiring_grad_give_results_that_do_not():
    recipe = RECIPES["current"]

    def fn(x, w, bias):
        y = te.ops.gemm(te.ops.quantize(x, recipe), te.ops.quantize(w, recipe, "weight"),
                        transpose_b=True, bias=bias)
        return y, y.requires_grad

    def make():
        return tuple(randn(s, torch.float32, seed=15).requires_grad_() for s in
                     [(32, 64), (16, 64), (16,)])

    eager_args = make()
    y, requires_grad = torch.compile(fn, fullgraph=True, backend="aot_eager")(*make())
    assert not requires_grad and not y.requires_grad
    assert_same(fn(*eager_args)[0], y)


def test_a_quantized_tensor_built_from_a_config_alone_is_refused():
    config = te.quantizer_config(None, "input")
    data = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    one = torch.ones(1, 1)
    q = QuantizedTensor(config, (16, 16), torch.float32, [data, one, None, None, one, None])
    assert torch.equal(torch.compile(lambda q: q.dequantize(), backend="aot_eager")(q),
                       q.dequantize())  # without fullgraph: the graph break runs eager
    torch._dynamo.reset()
    with pytest.raises(Exception, match="built from a QuantizerConfig alone"):
        torch.compile(lambda q: q.dequantize(), fullgraph=True, backend="aot_eager")(q)


# ---------------------------------------------------------------------------------------------
# Errors: eager's exception and message
# ---------------------------------------------------------------------------------------------

X, X_T, X_30 = randn((32, 64)), randn((64, 32)).t(), randn((30, 64))
CUSTOM = te.recipe.CustomRecipe(qfactory=lambda role: None)
ERRORS = {  # raised in traced Python: exact without fullgraph, Dynamo's report with it
    "dtype": lambda: te.ops.quantize(X.int()),
    "no_direction": lambda: te.ops.quantize(X, rowwise=False),
    "role": lambda: te.ops.quantize(X, RECIPES["mxfp8"], "bias"),
    "recipe_type": lambda: te.ops.quantize(X, "mxfp8"),
    "scale": lambda: te.ops.quantize(X, RECIPES["mxfp8"], scale=torch.ones(1)),
    "history": lambda: te.ops.quantize(X, RECIPES["delayed"], amax_history=torch.ones(2)),
    "custom": lambda: te.ops.quantize(X, CUSTOM),
    "missing_direction": lambda: te.ops.gemm(te.ops.quantize(X), te.ops.quantize(X)),
    "dequantize_dtype": lambda: te.ops.dequantize(te.ops.quantize(X), torch.int8),
}
RUNTIME_ERRORS = {  # raised by the C call as the op runs: exact even with fullgraph
    "gemm_k": lambda: te.ops.gemm(te.ops.quantize(X), te.ops.quantize(X[:, :32], None, "weight"),
                                  transpose_b=True),
    "non_contiguous": lambda: te.ops.quantize(X_T),
    "out_shape": lambda: te.ops.gemm(te.ops.quantize(X), te.ops.quantize(X, None, "weight"),
                                     transpose_b=True, out=torch.empty(32, 31)),
}


def eager_error(fn):
    with pytest.raises(Exception) as info:
        fn()
    return info.value


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_raised_before_the_ops(case):
    fn = ERRORS[case]
    want = eager_error(fn)
    with pytest.raises(type(want), match=re.escape(str(want))):
        torch.compile(fn, backend="aot_eager")()  # the graph break runs eager's code
    torch._dynamo.reset()
    with pytest.raises(Exception, match=re.escape(str(want))):
        torch.compile(fn, fullgraph=True, backend="aot_eager")()


@pytest.mark.parametrize("case", list(RUNTIME_ERRORS))
def test_errors_raised_by_the_ops_at_run_time(case):
    fn = RUNTIME_ERRORS[case]
    want = eager_error(fn)
    with pytest.raises(type(want), match=re.escape(str(want))):
        torch.compile(fn, fullgraph=True, backend="aot_eager")()


def test_layout_errors_come_from_the_fake_implementation():
    def fn():
        return te.ops.quantize(X_30, RECIPES["mxfp8"])

    want = eager_error(fn)
    assert isinstance(want, ValueError) and "multiples of 32" in str(want)
    with pytest.raises(Exception, match=re.escape(str(want))):
        torch.compile(fn, fullgraph=True, backend="aot_eager")()


def test_a_generator_cannot_be_traced():
    generator = torch.Generator()

    def fn(x):
        return te.ops.quantize(x, RECIPES["nvfp4"], "grad_output", generator=generator)

    generator.manual_seed(1)
    eager = fn(X)
    generator.manual_seed(1)
    assert_same(eager, torch.compile(fn, backend="aot_eager")(X))  # graph break: eager code
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"generator= cannot be traced .* pass rng="):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(X)


def test_a_recipe_built_inside_the_compiled_region_is_refused():
    def fn(x):
        return te.ops.quantize(x, MXFP8BlockScaling()).data

    with pytest.raises(Exception, match="built inside the compiled region"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(X)


_ALLOCATION_SCRIPT = """
import copy, sys, torch, tequant as te
from tequant.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

def storages(recipe, model, x):
    def step(inp):
        with te.autocast(recipe=recipe):
            return model(inp)
    xc = x.detach().clone().requires_grad_()
    y = torch.compile(step, backend="aot_eager", fullgraph=True)(xc)
    y.sum().backward()
    return y, y.untyped_storage().resizable(), xc.grad.untyped_storage().resizable()

import torch._inductor.cudagraph_trees as trees  # imported, no tree yet: still the fast path
cases = []
for recipe, make in ((DelayedScaling(amax_history_len=4), te.Linear),
                     (Float8CurrentScaling(), te.Linear), (Float8BlockScaling(), te.Linear),
                     (DelayedScaling(amax_history_len=4), te.LayerNormLinear),
                     (Float8CurrentScaling(), te.LayerNormMLP)):  # their norm / act ops' C calls
    torch.manual_seed(0)
    model = make(64, 32)
    twin = copy.deepcopy(model)  # DelayedScaling: each module sees one step
    x = torch.randn(16, 64, requires_grad=True)
    with te.autocast(recipe=recipe):
        y_eager = copy.deepcopy(model)(x)
    assert not y_eager.untyped_storage().resizable()  # eager: the DLPack allocator
    assert not te._C._cudagraph_trees_seen()
    y, *resizable = storages(recipe, model, x)
    assert resizable == [False, False] and torch.equal(y, y_eager), resizable
    cases.append((recipe, twin, x, y_eager))
import threading
def in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]
assert not in_thread(te._C._cudagraph_trees_seen)  # a thread without trees (no TLS entry)
assert not te._C._cudagraph_trees_seen()
trees.get_container(0)  # what mode="reduce-overhead" does first (no CUDA needed)
assert te._C._cudagraph_trees_seen()  # this thread's containers (its TLS) ...
assert in_thread(te._C._cudagraph_trees_seen)  # ... and from then on every thread (sticky)
for recipe, twin, x, y_eager in cases:
    y, *resizable = storages(recipe, twin, x)
    assert resizable == [True, True] and torch.equal(y, y_eager), resizable
trees.reset_cudagraph_trees()  # emptied again: the answer stays (sticky)
assert te._C._cudagraph_trees_seen()
print("ok")
"""


def test_compiled_outputs_are_torch_allocations_once_cudagraph_trees_exist():
    """Tensors tequant's ops return inside a compiled graph come from the DLPack allocator eager
    te.Linear uses (a fixed storage) until the process has cudagraph trees; from then on from
    torch.empty (a resizable storage with the caching allocator's own deleter), because the
    trees free a graph output the caller still holds through that deleter and refuse any other
    ("Expected standard deleter", seen on an H100 under mode="reduce-overhead"). The CPU shows
    the split through resizable(); a fresh process, as the answer is sticky. The check reads the
    calling thread's TLS, where torch keeps the trees' containers (a plain thread has none). The CUDA case:
    tests/test_cuda_graphs.py (mode="reduce-overhead")."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _ALLOCATION_SCRIPT], env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
