"""te.Linear's packed operands (csrc/ext/packed.c, csrc/ext/linear.c): one allocation per kept
quantization.

What eager te.Linear keeps between forward and backward (linear_forward's saved, rebuilt from
save_for_backward by linear._saved) and across microbatches (the
weight cache) is, per quantized operand, ONE uint8 buffer with the members at 256-byte-aligned
offsets, paired with DelayedScaling's amax history slot (None for the other recipes). Checked
here against te.ops.quantize of the same (zero-padded) operand, byte for byte:
- x keeps only its columnwise part (data_t, scale_inv_t, amax_t; per-tensor FP8's shared
  scale_inv and amax), so the buffer's size is those members' bytes plus the alignment;
- W keeps both directions in one buffer, the cache holds that same pair, and
  is_first_microbatch=False reuses it untouched (outputs bit-identical), also after the weight
  changed, and not under another recipe;
- linear_backward gives bit-identical dx, dW, db from packed pairs and from the member 6-tuples
  torch.compile's ops pass, and raises clearly on a buffer of the wrong size.
Results against independent references: tests/test_linear.py, tests/test_linear_delayed.py.
"""
import pytest
import torch

import tequant as te
from tequant import _C
from tequant.linear import _saved
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])]

RECIPES = {"delayed": DelayedScaling(), "current": Float8CurrentScaling(),
           "block": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling(),
           "nvfp4": NVFP4BlockScaling()}
ROW_MULTIPLE = {"delayed": 16, "current": 16, "block": 16, "mxfp8": 32, "nvfp4": 16}
ALIGN = 256
ROW, COL = 1, 2
# Member order of a 6-tuple: data, scale_inv, data_t, scale_inv_t, amax, amax_t; their direction
DIRECTION = (ROW, ROW, COL, COL, ROW, COL)
K, N = 64, 32


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def randn(*shape, seed, dtype=torch.float32, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def make_linear(name, *, dtype, device, bias=True, seed=0):
    lin = te.Linear(K, N, bias=bias, params_dtype=dtype, device=device)
    with torch.no_grad():
        lin.weight.copy_(randn(N, K, seed=seed, scale=K ** -0.5))
        if bias:
            lin.bias.copy_(randn(N, seed=seed + 1))
    return lin


def padded_2d(x, name):
    x2 = x.detach().reshape(-1, x.shape[-1])
    extra = -x2.shape[0] % ROW_MULTIPLE[name]
    return torch.cat([x2, x2.new_zeros(extra, x2.shape[1])]) if extra else x2


def kept_members(name, role, members, parts):
    """The (index, tensor) members a buffer holding `parts` of a rowwise + columnwise quantization
    keeps: each member's direction, per-tensor FP8's one scale_inv and amax in the columnwise part
    (they serve both), DelayedScaling's amax in none (it is the module's history slot)."""
    scaling = te.quantizer_config(RECIPES[name], role).scaling
    out = []
    for i, m in enumerate(members):
        if m is None or (scaling == "delayed" and i == 4):
            continue
        part = COL if scaling in ("delayed", "current") and i in (1, 4) else DIRECTION[i]
        if part & parts:
            out.append((i, m))
    return out


def check_packed(buf, members):
    """buf holds each member's bytes at the next 256-byte boundary, in member order, and nothing
    after the last one."""
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    offset = 0
    for i, m in members:
        raw = m.contiguous().view(torch.uint8).reshape(-1)
        if raw.numel():
            offset = -(-offset // ALIGN) * ALIGN
        assert torch.equal(buf[offset:offset + raw.numel()], raw), f"member {i}"
        offset += raw.numel()
    assert buf.numel() == offset
    size = sum(m.numel() * m.element_size() for _, m in members)
    assert size <= buf.numel() < size + ALIGN * len(members)


def saved_of(y):
    """linear_forward's saved tuple, as the backward of y's te.Linear node rebuilds it."""
    return _saved(y.grad_fn)[0]


def same(kept, other):
    """kept and other hold the same tensor objects (the amax: the same view of the history)."""
    return len(kept) == len(other) and all(
        a is b or (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr())
        for a, b in zip(kept, other))


def forward(lin, name, x, **kwargs):
    with te.autocast(recipe=RECIPES[name]):
        return lin(x, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(7, K), (K,), (2, 24, K)], ids=["m7", "one_dim", "m48"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(RECIPES))
def test_backward_keeps_x_columnwise_in_one_buffer(name, dtype, shape, device):
    """ctx.saved[0] is (buffer, amax): the buffer holds x's columnwise members exactly as
    te.ops.quantize makes them from the zero-padded x (first step: DelayedScaling's scale 1), and
    no rowwise byte; amax is the module's forward history slot for DelayedScaling, else None.
    M = 7, 1 (a 1-D input) and 48 are off every recipe's row multiple but 16's."""
    lin = make_linear(name, dtype=dtype, device=device, seed=1)
    x = randn(*shape, seed=2, dtype=dtype, device=device).requires_grad_()
    y = forward(lin, name, x)
    kept = saved_of(y)[0]
    assert isinstance(kept, tuple) and len(kept) == 2
    buf, amax = kept
    ref = te.ops.quantize(padded_2d(x, name), RECIPES[name], "input", rowwise=True,
                          columnwise=True)
    check_packed(buf, kept_members(name, "input", ref._members(), COL))
    if name == "delayed":
        hist = lin.delayed_amax_history_fwd
        assert amax.data_ptr() == hist[0, 0:1].data_ptr() and amax.numel() == 1
    else:
        assert amax is None
    y.backward(torch.ones_like(y))  # the kept part is what wgrad reads: backward still runs
    assert x.grad is not None and lin.weight.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_padding_rows_are_zero_in_reused_memory(name, device):
    """The rows te.Linear pads x and dy with (csrc/core/pad.c) are zeroed, not left as whatever
    the allocator hands back: blocks of the padded size are filled with NaN and freed first, so
    the padded copies most likely land on them. The kept x then equals te.ops.quantize of the
    zero-padded x byte for byte, and every gradient is finite."""
    lin = make_linear(name, dtype=torch.bfloat16, device=device, seed=5)
    x = randn(7, K, seed=6, dtype=torch.bfloat16, device=device).requires_grad_()
    rows = -(-7 // ROW_MULTIPLE[name]) * ROW_MULTIPLE[name]
    for cols in (K, N):
        poison = [torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device=device)
                  for _ in range(4)]
        del poison
    y = forward(lin, name, x)
    ref = te.ops.quantize(padded_2d(x, name), RECIPES[name], "input", rowwise=True,
                          columnwise=True)
    check_packed(saved_of(y)[0][0], kept_members(name, "input", ref._members(), COL))
    for cols in (K, N):
        poison = [torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device=device)
                  for _ in range(4)]
        del poison
    y.backward(randn(7, N, seed=7, dtype=torch.bfloat16, device=device))
    for grad in (x.grad, lin.weight.grad, lin.bias.grad):
        assert torch.isfinite(grad).all()


def at_odd_address(t):
    """t's values in a contiguous tensor whose data starts one element past an allocation's
    start (2 bytes for bf16: not 16-byte aligned)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_misaligned_inputs_pad_like_aligned_ones(name, device):
    """x and dy at odd addresses with M = 7 rows (padded for every recipe: the core copies them
    with its byte-wise path) give y, dx, dW and db bit-identical to the same values at aligned
    addresses."""
    results = []
    for place in (lambda t: t.clone(), at_odd_address):
        lin = make_linear(name, dtype=torch.bfloat16, device=device, seed=8)
        x = place(randn(7, K, seed=9, dtype=torch.bfloat16, device=device)).requires_grad_()
        dy = place(randn(7, N, seed=10, dtype=torch.bfloat16, device=device))
        torch.manual_seed(11)  # NVFP4's stochastic rounding of dy draws from torch's generator
        y = forward(lin, name, x)
        y.backward(dy)
        results.append((y.detach(), x.grad, lin.weight.grad, lin.bias.grad))
    for aligned, odd in zip(*results):
        assert torch.equal(aligned, odd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_without_wgrad_nothing_of_x_is_kept(name, device):
    lin = make_linear(name, dtype=torch.float32, device=device, seed=3)
    lin.weight.requires_grad_(False)
    x = randn(20, K, seed=4, device=device).requires_grad_()
    y = forward(lin, name, x)
    assert saved_of(y)[0] is None
    y.backward(torch.ones_like(y))
    assert x.grad is not None and lin.weight.grad is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(RECIPES))
def test_weight_cache_holds_one_buffer_and_reuses_it(name, dtype, bias, device):
    """is_first_microbatch=True caches (buffer, amax) with W's two directions in the buffer (as
    te.ops.quantize makes them) and saves that same pair for backward; False reuses it untouched
    after the weight changed (y bit-identical, inside one autocast so DelayedScaling's scales
    stay); None requantizes the new weight and empties the cache."""
    lin = make_linear(name, dtype=dtype, device=device, bias=bias, seed=5)
    x = randn(40, K, seed=6, dtype=dtype, device=device)
    w_ref = te.ops.quantize(lin.weight.detach(), RECIPES[name], "weight", rowwise=True,
                            columnwise=True)
    with te.autocast(recipe=RECIPES[name]):
        y_first = lin(x, is_first_microbatch=True)
        assert len(lin._weight_cache) == 2
        kept = lin._weight_cache[1]
        assert same(saved_of(y_first)[1], kept)
        buf, amax = kept
        check_packed(buf, kept_members(name, "weight", w_ref._members(), ROW | COL))
        if name == "delayed":
            assert amax.data_ptr() == lin.delayed_amax_history_fwd[0, 1:2].data_ptr()
        else:
            assert amax is None
        bytes_before = buf.clone()
        with torch.no_grad():
            lin.weight.add_(randn(N, K, seed=7, dtype=dtype, device=device, scale=K ** -0.5))
        y_cached = lin(x, is_first_microbatch=False)
        assert lin._weight_cache[1] is kept and same(saved_of(y_cached)[1], kept)
        assert torch.equal(buf, bytes_before)
        y_new = lin(x, is_first_microbatch=None)
        assert lin._weight_cache == []
    assert torch.equal(y_cached, y_first)
    assert not torch.equal(y_new, y_first)


@pytest.mark.parametrize("device", DEVICES)
def test_weight_cache_of_another_recipe_is_not_reused(device):
    """A cache made under one recipe is requantized, not read, under another with
    is_first_microbatch=False: the output equals a fresh quantization's (None)."""
    lin = make_linear("current", dtype=torch.float32, device=device, seed=8)
    x = randn(64, K, seed=9, device=device)
    forward(lin, "current", x, is_first_microbatch=True)
    current_kept = lin._weight_cache[1]
    y_reused = forward(lin, "mxfp8", x, is_first_microbatch=False)
    assert lin._weight_cache[1] is not current_kept
    assert lin._weight_cache[0] == _C.recipe_key(RECIPES["mxfp8"])
    y_fresh = forward(lin, "mxfp8", x, is_first_microbatch=None)
    assert torch.equal(y_reused, y_fresh)


def c_forward(lin, name, x, needs, states):
    plan = lin._plan(RECIPES[name])
    with te.autocast(recipe=RECIPES[name]):
        return _C.linear_forward(plan.c_args, x, lin.weight, lin.bias, needs, [], None,
                                 *states)


def c_backward(lin, name, saved, dy, x_shape, state, seed):
    torch.manual_seed(seed)  # the same stochastic-rounding draws (NVFP4's grad_output) each time
    if dy.is_cuda:
        torch.cuda.manual_seed(seed)
    plan = lin._plan(RECIPES[name])
    return _C.linear_backward(plan.c_args, saved, dy, 3, state, x_shape, lin.bias.dtype, None)


def delayed_states(name, device):
    """(x_state, w_state, dy_state): fresh (scale 1, amax slot) pairs for DelayedScaling."""
    if name != "delayed":
        return None, None, None
    return tuple((torch.ones(1, device=device), torch.zeros(1, device=device)) for _ in range(3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(7, K), (K,), (3, 32, K)], ids=["m7", "one_dim", "m96"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(RECIPES))
def test_backward_reads_packed_pairs_and_member_tuples_alike(name, dtype, shape, device):
    """linear_forward with and without the packed bit (8) gives the same output; linear_backward
    gives bit-identical dx, dW, db from the packed pairs, from the member 6-tuples (what
    torch.compile's ops pass) and from a mix of the two."""
    lin = make_linear(name, dtype=dtype, device=device, seed=10)
    x = randn(*shape, seed=11, dtype=dtype, device=device)
    dy = randn(*shape[:-1], N, seed=12, dtype=dtype, device=device)
    x_state, w_state, dy_state = delayed_states(name, device)
    out_p, saved_p = c_forward(lin, name, x, 3 | 8, (x_state, w_state))
    out_m, saved_m = c_forward(lin, name, x, 3, (x_state, w_state))
    assert torch.equal(out_p, out_m)
    assert all(len(kept) == 2 for kept in saved_p[:2]) and len(saved_m[1]) == 6
    grads = [c_backward(lin, name, saved, dy, x.shape, dy_state, seed=13)
             for saved in (saved_p, saved_m, (saved_p[0], saved_m[1]) + saved_p[2:],
                           (saved_m[0], saved_p[1]) + saved_p[2:])]
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)
    hp_dx = dy.reshape(-1, N).double() @ lin.weight.detach().double()
    assert torch.isfinite(grads[0][0]).all() and grads[0][0].abs().sum() > 0
    assert float((grads[0][0].double().reshape(hp_dx.shape) - hp_dx).norm() / hp_dx.norm()) < 0.3


@pytest.mark.parametrize("name", ["current", "nvfp4"])
def test_bad_packed_input_raises(name):
    lin = make_linear(name, dtype=torch.float32, device="cpu", seed=14)
    x, dy = randn(16, K, seed=15), randn(16, N, seed=16)
    _, saved = c_forward(lin, name, x, 3 | 8, (None, None))
    buf, amax = saved[0]
    short = ((buf[:-1], amax),) + saved[1:]
    with pytest.raises(ValueError, match="packed buffer has"):
        c_backward(lin, name, short, dy, x.shape, None, seed=0)
    with pytest.raises(TypeError, match="6-tuple"):
        c_backward(lin, name, ([buf, amax],) + saved[1:], dy, x.shape, None, seed=0)
    floats = ((buf.float(), amax),) + saved[1:]
    with pytest.raises(ValueError):
        c_backward(lin, name, floats, dy, x.shape, None, seed=0)
    with pytest.raises(ValueError, match="exclude each other"):
        c_forward(lin, name, x, 3 | 4 | 8, (None, None))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["delayed", "current", "block"])
def test_backward_releases_dgrad_codes_before_wgrad(name):
    """A grad_output of more than 16M elements is quantized into two scratch parts, and the
    rowwise one (dgrad's) is released once dgrad is queued, before dW is allocated: the
    backward's peak is max(both directions + dx, columnwise + dx + dW), not their sum."""
    m, k, n = 4096, 1024, 8192  # dy [m, n]: 32M elements
    recipe = RECIPES[name]
    lin = te.Linear(k, n, bias=False, device="cuda", params_dtype=torch.bfloat16)
    te.prepare_state(lin, recipe)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # the second step: the state and caches as in training
        x.grad = lin.weight.grad = None
        with te.autocast(recipe=recipe):
            y = lin(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        y.backward(dy)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
        del y
    codes, dx, dw = m * n, m * k * 2, n * k * 2  # one direction's codes; bf16 dx, dW
    slack = 4 << 20  # scales, amax, the allocator's rounding
    assert peak >= 2 * codes + dx, peak  # both directions were quantized
    assert peak <= max(2 * codes + dx, codes + dx + dw) + slack, (peak, 2 * codes + dx + dw)
    assert lin.weight.grad.shape == (n, k) and x.grad.shape == (m, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["current", "block"])
def test_backward_with_dy_in_two_parts_matches_reference(name, device):
    """A grad_output of more than 16M elements (quantized into two scratch parts, the rowwise
    one released after dgrad) gives the quantized reference's dx and dW (test_linear.py)."""
    from test_linear import check_step, make_linear as make_lin
    m, k, n = 16400, 16, 1040  # dy: 17.1M elements
    lin = make_lin(k, n, dtype=torch.bfloat16, device=device, bias=False, seed=21)
    x = randn(m, k, seed=22, dtype=torch.bfloat16, device=device)
    dy = randn(m, n, seed=23, dtype=torch.bfloat16, device=device)
    check_step(name, lin, x, dy, device=device, dtype=torch.bfloat16)
