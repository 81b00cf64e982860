"""te.ops (quantize, dequantize, gemm: python/tequant/ops.py) under CUDA graphs and on side streams.

Every recipe (NVFP4 with and without RHT / stochastic rounding / 16x16 weights, MXFP8 1D and 2D)
and the roles a te.Linear quantizes (input, weight, grad_output):
- calls captured in torch.cuda.graph on static buffers, replayed after new inputs are copied in,
  give the bits of the same calls run eagerly on those inputs (uint8 views: NaN-safe);
- state the caller passes as device tensors is read when the graph runs, not when it was
  captured: DelayedScaling's scale and amax-history slot (max-accumulated at each replay), a
  given amax (current scaling, NVFP4), an rng tensor, bias, out= / accumulate, and the members of
  QuantizedTensors a captured gemm multiplies;
- current scaling computes its amax on the device in each of its launch paths (a host sync would
  make the capture fail);
- stochastic rounding in a graph: an rng tensor is read at each replay, a fixed (seed, offset)
  pair repeats its bits, and without rng each replay draws a fresh pair from torch's graph-safe
  Philox (reproducible under torch.manual_seed), as docs/compile.md and docs/quantization.md say;
  a user generator must be registered with the graph (torch refuses it otherwise);
- on a non-default stream the calls give the default stream's bits, run in that stream's order
  and return without waiting for it; GEMMs on two streams at once do not disturb each other.
GPU only; modelled on tests/test_cuda_graphs.py.
"""
import pytest
import torch

import tequant as te
from tequant.quantized import QuantizedTensor
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.gpu]

DEVICE = "cuda"
RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),  # x, dy 1x128; W 128x128
    "mxfp8": MXFP8BlockScaling(),
    "mxfp8_2d": MXFP8BlockScaling(enable_2d_quantization=True),
    # RHT on the columnwise copies of input and grad_output, SR on grad_output, 16x16 weights
    "nvfp4": NVFP4BlockScaling(disable_rht=False, disable_stochastic_rounding=False,
                               disable_2d_quantization=False),
    "nvfp4_plain": NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                     disable_2d_quantization=True),
}
FP8 = ["delayed", "current", "block"]  # cuBLASLt pairs; the others are emulated
SR = RECIPES["nvfp4"]
ROLES = ["input", "weight", "grad_output"]
MEMBERS = ("data", "scale_inv", "data_t", "scale_inv_t", "amax", "amax_t")
M, K, N = 256, 128, 96  # x [M, K], w [N, K], dy [M, N]: partial FP8 blocks, two emulation chunks
QX_SHAPE = (2, 48, 192)  # M = 96, K = 192
NAN = float("nan")
# (a, a role, b, b role, transpose_a, transpose_b): Linear's three products
PRODUCTS = {
    "fprop": ("x", "input", "w", "weight", False, True),
    "dgrad": ("dy", "grad_output", "w", "weight", False, False),
    "wgrad": ("dy", "grad_output", "x", "input", True, False),
}


# ---- helpers ---------------------------------------------------------------------------------

def randn(shape, seed, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def operands(seed, scale=1.0):
    """(x, w, dy) in bfloat16; scale multiplies x and dy (so per-tensor scales change)."""
    return randn((M, K), seed, scale), randn((N, K), seed + 1), randn((M, N), seed + 2, scale)


def bits(t):
    """A copy of t's bytes (NaN-safe to compare; a replay cannot overwrite it), or None."""
    return None if t is None else t.detach().contiguous().view(torch.uint8).clone()


def snapshot(*items):
    """The bits of QuantizedTensors (their six members) and tensors, flattened in order."""
    out = []
    for item in items:
        if isinstance(item, QuantizedTensor):
            out += [bits(getattr(item, name)) for name in MEMBERS]
        else:
            out.append(bits(item))
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), i
        if g is not None:
            assert g.shape == w.shape, (i, g.shape, w.shape)
            assert torch.equal(g, w), f"item {i}: {int((g != w).sum())} of {g.numel()} bytes differ"


def capture(fn, graph=None):
    """(graph, fn's result): fn() captured after one warm-up call on a side stream, as in torch's
    docs and tests/test_cuda_graphs.py. Nothing runs at capture: the result is filled by replays."""
    graph = torch.cuda.CUDAGraph() if graph is None else graph
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def set_pair(held, pair):
    held.copy_(torch.tensor(pair, dtype=torch.int64))


def quantize_and_read(x, recipe, role, rng):
    q = te.ops.quantize(x, recipe, role, rowwise=True, columnwise=True, rng=rng)
    return (q, te.ops.dequantize(q), te.ops.dequantize(q, torch.bfloat16),
            q.dequantize_direction("columnwise", torch.float16))


def products(recipe, x, w, dy, bias, rng, out_dtype, dx_out=None, dw_out=None):
    """te.Linear's quantizations and three GEMMs through te.ops: fprop with bias (and fast
    accumulation, which only per-tensor FP8 pairs use), dgrad (into dx_out when given) and
    wgrad (accumulated into dw_out when given)."""
    qx = te.ops.quantize(x, recipe, "input", rowwise=True, columnwise=True)
    qw = te.ops.quantize(w, recipe, "weight", rowwise=True, columnwise=True)
    qdy = te.ops.quantize(dy, recipe, "grad_output", rowwise=True, columnwise=True, rng=rng)
    y = te.ops.gemm(qx, qw, transpose_b=True, out_dtype=out_dtype, bias=bias,
                    use_split_accumulator=False)
    dx = te.ops.gemm(qdy, qw, out_dtype=out_dtype, out=dx_out)
    dw = te.ops.gemm(qdy, qx, transpose_a=True, out_dtype=out_dtype, out=dw_out,
                     accumulate=dw_out is not None)
    return qx, qw, qdy, y, dx, dw


def out_dtypes(name):
    return [torch.float32, torch.bfloat16] + ([torch.float16] if name in FP8 else [])


GEMM_CASES = [pytest.param(n, d, id=f"{n}-{str(d)[6:]}") for n in RECIPES for d in out_dtypes(n)]


# ---- 1. capture and replay with new inputs: eager's bits ---------------------------------------

@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", RECIPES)
def test_graph_quantize_and_dequantize_replay_like_eager(name, role):
    """Both directions, the members, dequantize in two dtypes and the columnwise values. The
    amax falls from replay to replay, so an amax the graph did not restart would show; the rng
    tensor (read only where the quantizer rounds stochastically) changes each replay."""
    recipe = RECIPES[name]
    static = randn(QX_SHAPE, 0)
    held = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    graph, captured = capture(lambda: quantize_and_read(static, recipe, role, held))
    seen = []
    for i, scale in enumerate((16.0, 1.0, 0.25)):
        x = randn(QX_SHAPE, 10 + i, scale)
        if i == 2:
            x[1, 7, 33] = NAN
        pair = (1000 + i, 8 * i)
        static.copy_(x)
        set_pair(held, pair)
        graph.replay()
        got = snapshot(*captured)
        assert_same(got, snapshot(*quantize_and_read(x, recipe, role, pair)))
        seen.append(got)
    assert not torch.equal(seen[0][0], seen[1][0])  # the replays quantized their own inputs


@pytest.mark.parametrize("name,out_dtype", GEMM_CASES)
def test_graph_gemm_products_replay_like_eager(name, out_dtype):
    """The three products of freshly quantized operands: bias (converted to the epilogue's dtype
    inside the graph where it differs) changed between replays; dgrad into a NaN-filled out=,
    compared with eager's fresh output (no NaN may leak); wgrad accumulating into out= over the
    replays as eager accumulates."""
    recipe = RECIPES[name]
    x, w, dy = operands(0)
    bias = randn((N,), 3, dtype=torch.float32)
    dx = torch.zeros(M, K, dtype=out_dtype, device=DEVICE)
    dw = torch.zeros(N, K, dtype=out_dtype, device=DEVICE)
    held = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    graph, captured = capture(lambda: products(recipe, x, w, dy, bias, held, out_dtype, dx, dw))
    assert captured[4] is dx and captured[5] is dw
    start = randn((N, K), 4, 8.0, dtype=out_dtype)
    dw.copy_(start)  # the warm-up call accumulated into it
    dw_eager = start.clone()
    seen = []
    for i, scale in enumerate((1.0, 8.0)):
        new, pair = operands(20 + 3 * i, scale), (77, 4 * i)
        new_bias = randn((N,), 30 + i, 4.0, torch.float32)
        for dst, src in zip((x, w, dy, bias), new + (new_bias,)):
            dst.copy_(src)
        set_pair(held, pair)
        dx.fill_(NAN)
        graph.replay()
        got = snapshot(*captured)
        want = snapshot(*products(recipe, *new, new_bias, pair, out_dtype, dw_out=dw_eager))
        assert_same(got, want)
        seen.append(got)
    assert not torch.equal(seen[0][18], seen[1][18])  # y (after the 3 x 6 members)
    assert not torch.isnan(dx).any()


def clone_quantized(q):
    members = [None if m is None else m.clone() for m in q._members()]
    return QuantizedTensor(q.config, q.shape, q.dtype, members, q.recipe, q.role)


def copy_members(dst, src):
    for name in MEMBERS:
        if getattr(dst, name) is not None:
            getattr(dst, name).view(torch.uint8).copy_(getattr(src, name).view(torch.uint8))


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("name", RECIPES)
def test_graph_gemm_reads_its_operands_members_at_replay(name, product):
    """A captured gemm of two static QuantizedTensors multiplies what their members hold at each
    replay: codes, block scales, per-tensor scale_inv (cuBLASLt reads it through a pointer) and
    NVFP4's amaxes (its alpha is computed on the device). The second operand set is 3x larger,
    so a scale frozen at capture would show."""
    recipe = RECIPES[name]
    a_key, a_role, b_key, b_role, ta, tb = PRODUCTS[product]

    def quantized(seed, scale):
        hp = dict(zip(("x", "w", "dy"), operands(seed, scale)))
        qa = te.ops.quantize(hp[a_key], recipe, a_role, rowwise=not ta, columnwise=ta, rng=(5, 8))
        qb = te.ops.quantize(hp[b_key], recipe, b_role, rowwise=tb, columnwise=not tb, rng=(5, 8))
        return qa, qb

    def run(qa, qb):
        return te.ops.gemm(qa, qb, transpose_a=ta, transpose_b=tb, out_dtype=torch.float32)

    first, second = quantized(0, 1.0), quantized(40, 3.0)
    qa, qb = clone_quantized(first[0]), clone_quantized(first[1])
    graph, y = capture(lambda: run(qa, qb))
    results = []
    for a, b in (second, first, second):
        copy_members(qa, a)
        copy_members(qb, b)
        graph.replay()
        assert_same(snapshot(y), snapshot(run(a, b)))
        results.append(bits(y))
    assert not torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


# ---- 2. DelayedScaling: scale and history slot are device tensors read at replay --------------

def test_graph_delayed_scaling_reads_scale_and_history_slot_at_replay():
    """Scales (one per tensor) and an amax history [length, tensors] the caller owns, as
    DelayedScaling keeps them: each replay casts with the scales the tensors hold then (the same
    x cast with a new scale gives new codes) and max-accumulates x's amax into row 0 of its
    column, exactly as eager calls into a twin history do; the other rows stay zero."""
    recipe = RECIPES["delayed"]
    x, w = randn((M, K), 0), randn((N, K), 1)
    history = torch.zeros(4, 2, device=DEVICE)  # column 0: x, column 1: w
    scales = torch.ones(2, device=DEVICE)

    def fprop(x, w, scales, history):
        qx = te.ops.quantize(x, recipe, "input", columnwise=True, scale=scales[0:1],
                             amax_history=history[0, 0:1])
        qw = te.ops.quantize(w, recipe, "weight", scale=scales[1:2], amax_history=history[0, 1:2])
        return qx, qw, te.ops.gemm(qx, qw, transpose_b=True, out_dtype=torch.float32)

    graph, captured = capture(lambda: fprop(x, w, scales, history))
    qx = captured[0]
    assert qx.amax.data_ptr() == history[0, 0:1].data_ptr()  # the slot itself, not a copy
    history.zero_()  # the warm-up call accumulated into it
    twin = torch.zeros_like(history)
    x0, x1 = randn((M, K), 2), randn((M, K), 3, 0.1)
    seen = []
    for xi, sx, sw in ((x0, 1.0, 1.0), (x0, 4.0, 0.5), (x1, 16.0, 2.0)):
        x.copy_(xi)
        scales.copy_(torch.tensor([sx, sw]))
        graph.replay()
        got = snapshot(*captured) + [bits(history)]
        eager_scales = torch.tensor([sx, sw], device=DEVICE)
        assert_same(got, snapshot(*fprop(xi, w, eager_scales, twin)) + [bits(twin)])
        assert float(qx.scale_inv) == 1.0 / sx
        seen.append(got)
    assert not torch.equal(seen[0][0], seen[1][0])  # same x, new scale: new codes
    assert float(history[0, 0]) == float(x0.float().abs().max())  # the max over the replays
    assert float(history[0, 1]) == float(w.float().abs().max())
    assert not history[1:].any()


# ---- 3. Current scaling: the amax is computed on the device, inside the graph ------------------

CURRENT_SHAPES = {  # cuda/quantize_fp8.cu's three launch paths
    "one_cta": (96, 192),  # <= 2^16 elements: one CTA, amax then cast
    "cooperative": (1024, 512),  # <= 2^24: one cooperative launch with grid barriers
    "amax_pass": (4096, 4160),  # > 2^24: an amax kernel (memset + max) before the cast
}


@pytest.mark.parametrize("role", ["input", "grad_output"])  # E4M3, E5M2
@pytest.mark.parametrize("path", CURRENT_SHAPES)
def test_graph_current_scaling_computes_the_amax_on_device(path, role):
    """Capturing must not raise (a host read of the amax would break the capture), and each
    replay scales by the amax of the x it reads: eager's bits, and the amax is max |x|."""
    recipe, shape = RECIPES["current"], CURRENT_SHAPES[path]

    def run(x):
        q = te.ops.quantize(x, recipe, role, rowwise=True, columnwise=True)
        return q, te.ops.dequantize(q)

    static = randn(shape, 0)
    graph, captured = capture(lambda: run(static))
    q = captured[0]
    scale_invs = []
    for i, scale in enumerate((1.0, 1000.0, 1e-3)):
        x = randn(shape, 1 + i, scale)
        static.copy_(x)
        graph.replay()
        assert_same(snapshot(*captured), snapshot(*run(x)))
        assert torch.equal(q.amax.reshape(()), x.float().abs().max())
        scale_invs.append(float(q.scale_inv))
    assert len(set(scale_invs)) == 3


@pytest.mark.parametrize("name", ["current", "nvfp4"])
def test_graph_given_amax_is_read_at_replay(name):
    """quantize(amax=t): the per-tensor scale comes from what t holds at each replay (NVFP4 with
    RHT: rowwise and columnwise amaxes). t = x's own amax gives x's own quantization."""
    recipe = RECIPES[name]
    x = randn((M, K), 0)
    own = te.ops.quantize(x, recipe, "input", rowwise=True, columnwise=True)
    amax = torch.cat([own.amax.reshape(1)] + ([own.amax_t.reshape(1)] if name == "nvfp4" else []))

    def run(a):
        return te.ops.quantize(x, recipe, "input", rowwise=True, columnwise=True, amax=a)

    given = amax.clone()
    graph, q = capture(lambda: run(given))
    seen = []
    for factor in (1.0, 2.0, 8.0):
        given.copy_(amax * factor)
        graph.replay()
        assert_same(snapshot(q), snapshot(run(amax * factor)))
        seen.append(bits(q.scale_inv))
    assert_same(snapshot(own)[:4], snapshot(run(amax))[:4])
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])


# ---- stochastic rounding's rng in graphs ---------------------------------------------------------

def sr_chain(dy, qx, **rng):
    """grad_output quantized with RHT + SR, its values and the wgrad it feeds."""
    qdy = te.ops.quantize(dy, SR, "grad_output", rowwise=True, columnwise=True, **rng)
    return qdy, te.ops.dequantize(qdy), te.ops.gemm(qdy, qx, transpose_a=True,
                                                    out_dtype=torch.float32)


def sr_operands():
    assert te.quantizer_config(SR, "grad_output").stochastic_rounding
    qx = te.ops.quantize(randn((M, K), 1), SR, "input", rowwise=False, columnwise=True)
    return randn((M, N), 0), qx


def two_replays(graph, captured, reseed):
    reseed()
    out = []
    for _ in range(2):
        graph.replay()
        out.append(snapshot(*captured))
    return out


def check_fresh_draws(first, second):
    """SR changes codes (both directions) and what they feed, never the scales or amaxes."""
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[2], second[2])
    assert_same(first[1::2][:3], second[1::2][:3])  # scale_inv, scale_inv_t, amax_t
    assert torch.equal(first[4], second[4])  # amax
    assert not torch.equal(first[6], second[6])  # the dequantized values
    assert not torch.equal(first[7], second[7])  # the wgrad


def test_graph_stochastic_rounding_draws_fresh_reproducible_bits_per_replay():
    """Without rng, a capture draws (seed, offset) inside the graph from the device's default
    generator (docs/compile.md): each replay rounds anew, torch.manual_seed reproduces the
    replays, and each replay's pair is torch's next Philox draw: eager calls with those pairs
    give its bits, the first replay's and the second's."""
    dy, qx = sr_operands()
    graph, captured = capture(lambda: sr_chain(dy, qx))
    first, second = two_replays(graph, captured, lambda: torch.manual_seed(5))
    check_fresh_draws(first, second)
    again = two_replays(graph, captured, lambda: torch.manual_seed(5))
    assert_same(again[0] + again[1], first + second)
    torch.manual_seed(5)
    for got in (first, second):
        pair = torch.empty(2, dtype=torch.int64, device=DEVICE).random_()
        assert_same(got, snapshot(*sr_chain(dy, qx, rng=pair)))


def test_graph_stochastic_rounding_with_a_fixed_rng_pair_repeats_its_bits():
    """rng=(seed, offset) reproduces exact bits (docs/quantization.md); in a graph the pair is
    part of the captured call, so every replay rounds with it: eager's bits with the same pair,
    for the static input's current values. (Not stated for graphs in the docs; the only reading
    consistent with "reproduce exact bits".)"""
    dy, qx = sr_operands()
    graph, captured = capture(lambda: sr_chain(dy, qx, rng=(123, 8)))
    first, second = two_replays(graph, captured, lambda: torch.manual_seed(1))
    want = snapshot(*sr_chain(dy, qx, rng=(123, 8)))
    assert_same(first, want)
    assert_same(second, want)
    new = randn((M, N), 9)
    dy.copy_(new)
    graph.replay()
    assert_same(snapshot(*captured), snapshot(*sr_chain(new, qx, rng=(123, 8))))
    assert not torch.equal(bits(captured[0].data), want[0])


@pytest.mark.skipif(not hasattr(torch.cuda.CUDAGraph, "register_generator_state"),
                    reason="torch without CUDAGraph.register_generator_state")
def test_graph_stochastic_rounding_with_a_registered_generator():
    """generator= a CUDA generator registered with the graph (torch's graph-safe RNG): replays
    draw fresh pairs from it, reproducibly under its manual_seed, the pairs eager draws of it
    give. (Not covered by tequant's docs; the behaviour torch's registration promises.)"""
    dy, qx = sr_operands()
    gen = torch.Generator(device=DEVICE)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(gen)
    graph, captured = capture(lambda: sr_chain(dy, qx, generator=gen), graph)
    first, second = two_replays(graph, captured, lambda: gen.manual_seed(11))
    check_fresh_draws(first, second)
    gen.manual_seed(11)
    for got in (first, second):
        pair = torch.empty(2, dtype=torch.int64, device=DEVICE).random_(generator=gen)
        assert_same(got, snapshot(*sr_chain(dy, qx, rng=pair)))


# ---- 4. side streams -------------------------------------------------------------------------

SLEEP_CYCLES = 500_000_000  # ~0.25 s of GPU time: the side stream lags far behind the host


def delayed_copy(side, dsts, srcs):
    """On stream `side`, after what the current stream queued: a ~0.25 s sleep, then dsts <-
    srcs; work queued on `side` afterwards runs after both."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)


@pytest.mark.parametrize("name", RECIPES)
def test_cuda_side_stream_gives_default_stream_bits_in_stream_order(name):
    """The same calls queued on a side stream behind a long sleep and the copies of their inputs
    (zeros until then): a kernel launched on any other stream would read zeros. The calls
    return before the stream has run them (no host sync), and what they produce, read after
    wait_stream, has the default stream's bits."""
    recipe = RECIPES[name]
    inputs = operands(0) + (randn((N,), 3, dtype=torch.float32),)
    want = snapshot(*products(recipe, *inputs, (31, 4), torch.bfloat16))  # loads every kernel
    staged = [torch.zeros_like(t) for t in inputs]
    side = torch.cuda.Stream()
    delayed_copy(side, staged, inputs)
    with torch.cuda.stream(side):
        got = products(recipe, *staged, (31, 4), torch.bfloat16)
        values = te.ops.dequantize(got[2])
    assert not side.query(), "a te.ops call waited for the side stream"
    torch.cuda.current_stream().wait_stream(side)
    assert_same(snapshot(*got), want)
    torch.cuda.synchronize()
    assert torch.equal(bits(values), bits(te.ops.dequantize(got[2])))


@pytest.mark.parametrize("name", RECIPES)
def test_cuda_gemms_on_two_streams_at_once_match_serial_results(name):
    """Two streams run the products on different operands concurrently, three times each
    (cuBLASLt workspaces are per stream, emulation scratch per call): each result keeps the
    bits the same products have when run alone."""
    recipe = RECIPES[name]
    sets = [operands(10 * i) + (randn((N,), 10 * i + 3, dtype=torch.float32),) for i in range(2)]
    want = [snapshot(*products(recipe, *s, (7, 0), torch.float32)) for s in sets]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    assert streams[0].cuda_stream != streams[1].cuda_stream
    got = [[], []]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                got[i].append(products(recipe, *sets[i], (7, 0), torch.float32))
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    for i in range(2):
        for result in got[i]:
            assert_same(snapshot(*result), want[i])


def test_graph_replayed_on_a_side_stream_follows_that_streams_order():
    """A graph of te.ops calls replayed on a side stream, after a sleep and the copy of its new
    input there, runs in that order: eager's bits on the new input."""
    recipe = RECIPES["mxfp8"]
    inputs = list(operands(0)) + [randn((N,), 3, dtype=torch.float32)]
    graph, captured = capture(lambda: products(recipe, *inputs, (1, 2), torch.float32))
    new = operands(50, 2.0) + (randn((N,), 53, dtype=torch.float32),)
    side = torch.cuda.Stream()
    delayed_copy(side, inputs, new)
    with torch.cuda.stream(side):
        graph.replay()
    torch.cuda.current_stream().wait_stream(side)
    assert_same(snapshot(*captured), snapshot(*products(recipe, *new, (1, 2), torch.float32)))


# ---- 5. misuse under capture -----------------------------------------------------------------

def test_graph_capture_with_an_unregistered_generator_raises():
    """te.ops.quantize(generator=g) draws from g inside the capture; torch refuses a CUDA
    generator that is not registered with the graph (a RuntimeError naming the generator)
    instead of freezing a pair into it. Eager use of the same generator is fine."""
    dy, _ = sr_operands()
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    te.ops.quantize(dy, SR, "grad_output", generator=gen)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="(?i)generator"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            te.ops.quantize(dy, SR, "grad_output", generator=gen)
    torch.cuda.synchronize()
    # the process stays usable: a capture after it works
    graph, q = capture(lambda: te.ops.quantize(dy, SR, "grad_output", rng=(3, 4)))
    graph.replay()
    assert_same(snapshot(q), snapshot(te.ops.quantize(dy, SR, "grad_output", rng=(3, 4))))
