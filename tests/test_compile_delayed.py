"""DelayedScaling's per-module bookkeeping inside the compiled te.Linear's ops (issue 23): the
forward ops (tequant::linear_fwd in csrc/ext/linear_ops.c, linear_fwd_given in _compile_ops.py)
take the module's amax history and return a copy with x's and W's amaxes max-accumulated into
row 0; the backward ops (linear_bwd, linear_bwd_given, linear_bwd_dy_given in _dy_given.py), under
the fused update rule and without an amax all-reduce, update the module's history and scale
(dy's amax accumulated, then rolled by dy's cast: tq_quantize_args.update, inside the
cooperative dbias pass where that is the cast; test_cuda_backward_update_runs_in_dy_cast), so
the traced code (_compile_linear.py) holds no update.

- The graphs AOT records: the backward of a te.Linear and of a te.LayerNormMLP (the fused codes'
  ops) holds no tequant::amax_update, maximum or cat; a callable amax_compute_algo (TE's unfused
  rule) keeps the traced update.
- Bit-identical to eager over two steps (outputs, gradients, histories, scales): "most_recent",
  a one-row history, another margin, a callable algo, a callable scale rule; inductor for one.
- The ops alone: their copies equal the old outputs accumulated and updated by hand
  (_C._amax_update), the fake kernels promise the real outputs' shapes, and bad histories are
  refused with ValueErrors naming them.
The amax all-reduce over two gloo ranks (the backward update stays traced there):
tests/test_compile.py::test_amax_reduction_group_under_compile_matches_eager.
"""
import copy
import gc
import re

import pytest
import torch
import torch._dynamo.testing

import tequant as te
from tequant import _C, _plan, delayed
from tequant.recipe import DelayedScaling, Float8CurrentScaling, Format

from test_compile import _check, _input, _inside, _model, gpu, op_names
from test_fused_act_modules import _mlp
from test_linear import one_cpu_thread

assert one_cpu_thread  # the autouse fixture, imported to apply here too


def _mean_amax(history):
    return history.mean()


def _half_scale(amax, scale, fmax, recipe):
    return torch.where(amax > 0, fmax / amax / 2, scale)


RECIPES = {
    "max": DelayedScaling(amax_history_len=4),
    "most_recent": DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent"),
    "one_row": DelayedScaling(amax_history_len=1),
    "margin": DelayedScaling(amax_history_len=3, margin=2, fp8_format=Format.E4M3),
    "callable_algo": DelayedScaling(amax_history_len=3, amax_compute_algo=_mean_amax),
    "callable_scale": DelayedScaling(amax_history_len=4, scaling_factor_compute_algo=_half_scale),
}
TRACED_UPDATE = {"tequant.amax_update.default", "aten.maximum.default", "aten.cat.default"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph_ops(model, recipe, x):
    """The call_function targets of the forward and backward graphs of one compiled step."""
    recorder = torch._dynamo.testing.AotEagerAndRecordGraphs()
    step = torch.compile(_inside(recipe), backend=recorder, fullgraph=True)
    step(model, x.clone().requires_grad_()).float().square().mean().backward()

    return op_names(recorder.fw_graphs), op_names(recorder.bw_graphs)


def test_graphs_update_the_buffers_through_the_ops():
    fw, bw = _graph_ops(_model("mlp", "cpu"), RECIPES["max"], _input("mlp", "cpu"))
    assert bw.count("tequant.linear_bwd_delayed.default") == 2
    assert not TRACED_UPDATE & set(bw), bw
    assert bw.count("aten.copy_.default") == 4  # functionalization's write-back of each buffer
    # forward: no traced accumulation; one update of both modules at the autocast's exit
    assert fw.count("tequant.linear_fwd_delayed.default") == 2
    assert "aten.maximum.default" not in fw and "aten.cat.default" not in fw
    assert fw.count("tequant.amax_update.default") == 1


def test_fused_codes_backward_graph_has_no_traced_update():
    """te.LayerNormMLP: fc1 multiplies the norm's codes and gets dy's codes from the activation
    (linear_bwd_dy_given), fc2 the activation's codes (linear_bwd_given)."""
    x = torch.randn(3, 7, 64).to(torch.bfloat16)
    fw, bw = _graph_ops(_mlp("swiglu"), RECIPES["max"], x)
    assert {"tequant.linear_bwd_dy_given.default", "tequant.linear_bwd_given.default"} <= set(bw)
    assert not TRACED_UPDATE & set(bw), bw
    assert fw.count("tequant.linear_fwd_given.default") == 2
    assert "aten.maximum.default" not in fw and "aten.cat.default" not in fw


def _call_lines(code):
    return code.split("def call(", 1)[1].split("def get_args(", 1)[0].splitlines()


def _untouched_after(lines, at, names):
    """Whether no line after lines[at] reads or writes any of `names` (but `del name`)."""
    after = [line.strip() for line in lines[at + 1:]]
    return all(line == f"del {n}" or not re.search(rf"\b{n}\b", line)
               for n in names for line in after)


@pytest.mark.parametrize("kind", ["linear", "layernorm_mlp"])
def test_inductor_updates_the_buffers_in_place(kind):
    """Inductor's code for a compiled step updates the modules' DelayedScaling buffers through
    the mutating ops themselves (re-inplaced on the graph's inputs): the forward ops accumulate
    into the histories, the update at the autocast's exit (tequant::amax_update) rolls them and
    writes the scales, the backward ops update hist_bwd and scale_bwd, and no kernel copies into
    a buffer after them (before: a copy of each history and scale). te.Linear's own ops, and
    te.LayerNormMLP's on the fused norm's and activation's codes. Against eager: the
    bit-identity tests."""
    from torch._inductor.utils import run_and_get_code
    if kind == "linear":
        model, x, bw_ops = _model("mlp", "cpu"), _input("mlp", "cpu"), ("linear_bwd_delayed",)
    else:
        model, x = _mlp("relu"), torch.randn(3, 7, 64).to(torch.bfloat16)
        bw_ops = ("linear_bwd_given", "linear_bwd_dy_given")
    step = torch.compile(_inside(RECIPES["max"]), backend="inductor", fullgraph=True)
    y, codes = run_and_get_code(lambda: step(model, x.clone().requires_grad_()))
    _, bw_codes = run_and_get_code(lambda: y.float().square().mean().backward())
    forward = [code for code in codes if "torch.ops.tequant.amax_update.default(" in code]
    assert len(forward) == 1
    lines = _call_lines(forward[0])
    at = next(i for i, line in enumerate(lines) if "tequant.amax_update.default(" in line)
    hists, scales = (part.split("]")[0].split(", ") for part in lines[at].split("[")[1:3])
    for names in (hists, scales):  # the graph's inputs: the modules' buffers
        assert len(names) == 2 and all(n.startswith(("primals_", "arg")) for n in names), \
            lines[at]
    assert _untouched_after(lines, at, hists + scales), lines[at:]
    calls = tuple(f"tequant.{op}.default(" for op in bw_ops)
    backward = [code for code in bw_codes if any(c in code for c in calls)]
    assert len(backward) == 1
    lines = _call_lines(backward[0])
    ats = [i for i, line in enumerate(lines) if any(c in line for c in calls)]
    assert len(ats) == 2
    buffers = [n.strip(" )") for i in ats for n in lines[i].split(", ")[-2:]]
    assert all(n.startswith(("primals_", "arg")) for n in buffers), buffers
    assert _untouched_after(lines, ats[-1], buffers), lines[ats[-1]:]


@pytest.mark.parametrize("name", ["callable_algo", "callable_scale"])
def test_unfused_rule_keeps_the_traced_update(name):
    _, bw = _graph_ops(_model("linear", "cpu"), RECIPES[name], _input("linear", "cpu"))
    assert bw.count("tequant.amax_update.default") == 1


@pytest.mark.parametrize("name", [n for n in RECIPES if n != "max"])  # max: test_compile.py
def test_compiled_steps_are_bit_identical_to_eager(name):
    _check(_inside(RECIPES[name]), "mlp", "cpu")


def test_fused_codes_most_recent_bit_identical_to_eager():
    model = _mlp("swiglu")
    twin = copy.deepcopy(model)
    step = _inside(RECIPES["most_recent"])
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for i in range(2):
        x = torch.randn(3, 7, 64).to(torch.bfloat16) * (i + 1)
        outs = []
        for fn, m in ((step, model), (compiled, twin)):
            xi = x.clone().requires_grad_()
            y = fn(m, xi)
            y.float().square().mean().backward()
            outs.append([y, xi.grad] + [p.grad for p in m.parameters()] + list(m.buffers()))
        assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_inductor_most_recent_bit_identical_to_eager():
    _check(_inside(RECIPES["most_recent"]), "linear", "cpu", backend="inductor")


def _ops_inputs(recipe):
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((3, 7, 64), (32, 64), (3, 7, 32)))
    hist_fwd = torch.rand(recipe.amax_history_len, 2, generator=g)
    hist_bwd = torch.rand(recipe.amax_history_len, 1, generator=g)
    hist_fwd[0] = hist_bwd[0] = 0.01  # below this step's amaxes: row 0 takes them
    return x, w, dy, hist_fwd, torch.rand(2, generator=g) + 0.5, hist_bwd, \
        torch.rand(1, generator=g) + 0.5


def _updated_by_hand(rid, hist, scale, amax):
    """(hist, scale) of a module's backward buffers after dy's amax is accumulated into row 0
    and the fused update runs (_C._amax_update, eager's call), on copies."""
    recipe = _plan.of_id(rid).recipe
    hist, scale = hist.clone(), scale.clone()
    hist[0] = torch.maximum(hist[0], amax.view(1))
    scaled = delayed.scaled_maxes(_plan.of_id(rid), delayed.BACKWARD)[0]
    _C._amax_update([(hist, scale, scaled)], recipe.amax_history_len,
                    recipe.amax_compute_algo, None)
    return hist, scale


@pytest.mark.parametrize("name", ["max", "most_recent", "one_row"])
def test_ops_copies_equal_the_old_outputs_updated_by_hand(name):
    """linear_fwd with a history (its copy) and linear_bwd_delayed (in place, on copies of the
    buffers) against the same ops without one (fresh amaxes), whose amaxes are accumulated and
    the backward update run by hand, as the traced code did."""
    recipe = RECIPES[name]
    rid = str(_C.recipe_key(recipe))
    x, w, dy, hist_fwd, scale_fwd, hist_bwd, scale_bwd = _ops_inputs(recipe)
    before = [t.clone() for t in (hist_fwd, scale_fwd, hist_bwd, scale_bwd)]
    fwd, bwd = torch.ops.tequant.linear_fwd, torch.ops.tequant.linear_bwd
    old = fwd(x, w, None, rid, 8 | 3, scale_fwd)
    new = fwd(x, w, None, rid, 8 | 3, scale_fwd, hist_fwd)
    assert len(new) == len(old) - 1
    assert torch.equal(old[0], new[0])  # (the packed buffers hold unwritten alignment bytes)
    want = hist_fwd.clone()
    want[0] = torch.maximum(want[0], torch.cat(old[-2:]).view(2))
    assert torch.equal(new[-1], want) and want[0].min() > 0.01
    args = (rid, 3, [3, 7, 64], x.dtype, w.dtype, None)
    old = bwd(dy, new[1], new[2], *args, scale_bwd)
    hist, scale = hist_bwd.clone(), scale_bwd.clone()
    got = torch.ops.tequant.linear_bwd_delayed(dy, new[1], new[2], *args, scale, hist)
    assert all(torch.equal(a, b) for a, b in zip(old[:-1], got[:2]))
    want_hist, want_scale = _updated_by_hand(rid, hist_bwd, scale_bwd, old[-1])
    assert torch.equal(hist, want_hist) and torch.equal(scale, want_scale)
    assert not torch.equal(scale, scale_bwd)  # the update ran
    after = (hist_fwd, scale_fwd, hist_bwd, scale_bwd)
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # linear_fwd mutates nothing


@pytest.mark.parametrize("name", ["max", "most_recent", "one_row"])
@pytest.mark.parametrize("needs", [8 | 3, 8 | 1])  # packed, with and without wgrad
def test_in_place_ops_write_the_copies_into_the_buffers(name, needs):
    """linear_fwd_delayed / linear_bwd_delayed leave in the module's buffers exactly what
    linear_fwd returns as a copy (backward: the update by hand), give the same outputs (an empty
    uint8 [0] for each absent one) and match their fake kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    recipe = RECIPES[name]
    rid = str(_C.recipe_key(recipe))
    x, w, dy, hist_fwd, scale_fwd, hist_bwd, scale_bwd = _ops_inputs(recipe)
    ops = torch.ops.tequant
    copied = ops.linear_fwd(x, w, None, rid, needs, scale_fwd, hist_fwd)
    got = ops.linear_fwd_delayed(x, w, None, rid, needs, scale_fwd, hist_fwd)
    assert torch.equal(hist_fwd, copied[-1]) and torch.equal(got[0], copied[0])
    assert [t.shape for t in got[1:]] == ([copied[1].shape] if needs & 2 else [(0,)]) \
        + [copied[-2].shape]
    empty = torch.empty(0, dtype=torch.uint8)

    def shapes(outs):
        return [(tuple(t.shape), t.stride(), t.dtype) for t in outs]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = ops.linear_fwd_delayed(*(mode.from_tensor(t) for t in (x, w)), None, rid, needs,
                                      *(mode.from_tensor(t) for t in (scale_fwd, hist_fwd)))
    assert shapes(got) == shapes(fake)
    x_kept = got[1] if needs & 2 else None
    args = (rid, needs & 3, [3, 7, 64], x.dtype, w.dtype, torch.float32)
    fresh = ops.linear_bwd(dy, x_kept, got[2], *args, scale_bwd)
    want_hist, want_scale = _updated_by_hand(rid, hist_bwd, scale_bwd, fresh[-1])
    dx, dw, db = ops.linear_bwd_delayed(dy, x_kept, got[2], *args, scale_bwd, hist_bwd)
    assert torch.equal(hist_bwd, want_hist) and torch.equal(scale_bwd, want_scale)
    copied = fresh[:-1]
    assert torch.equal(dx, copied[0]) and torch.equal(db, copied[-1])
    assert torch.equal(dw, copied[1]) if needs & 2 else torch.equal(dw, empty)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = ops.linear_bwd_delayed(mode.from_tensor(dy), x_kept, got[2], *args,
                                      *(mode.from_tensor(t) for t in (scale_bwd, hist_bwd)))
    assert shapes((dx, dw, db)) == shapes(fake)


@pytest.mark.parametrize("name", ["max", "most_recent"])
def test_backward_update_where_no_cast_of_dy_runs(name):
    """needs 0 (only the bias gradient): no quantization of dy runs to carry the update, so
    linear_bwd_delayed runs it alone; the buffers end as linear_bwd's amax updated by hand."""
    recipe = RECIPES[name]
    rid = str(_C.recipe_key(recipe))
    x, w, dy, hist_fwd, scale_fwd, hist_bwd, scale_bwd = _ops_inputs(recipe)
    ops = torch.ops.tequant
    w_kept = ops.linear_fwd_delayed(x, w, None, rid, 8 | 3, scale_fwd, hist_fwd)[2]
    args = (rid, 0, [3, 7, 64], x.dtype, w.dtype, torch.float32)
    fresh = ops.linear_bwd(dy, None, w_kept, *args, scale_bwd)
    want_hist, want_scale = _updated_by_hand(rid, hist_bwd, scale_bwd, fresh[-1])
    before = scale_bwd.clone()
    dx, dw, db = ops.linear_bwd_delayed(dy, None, w_kept, *args, scale_bwd, hist_bwd)
    assert torch.equal(hist_bwd, want_hist) and torch.equal(scale_bwd, want_scale)
    assert not torch.equal(scale_bwd, before)  # the update ran
    assert torch.equal(db, fresh[0]) and dx.numel() == 0 and dw.numel() == 0


LONG = {"long": DelayedScaling(amax_history_len=1025), **RECIPES}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["max", "most_recent", "long"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("needs", [8 | 3, 8 | 1])
def test_cuda_backward_update_runs_in_dy_cast(name, bias, needs):
    """linear_bwd_delayed on CUDA leaves the buffers and gives the bias gradient of the same op
    on the CPU (the C references), bit for bit, with dy's cast running the module's update:
    where the cast is the cooperative dbias pass (a bias, and wgrad: both directions) inside
    that launch, no amax_update_kernel; otherwise the one launch after it. A 1025-row history
    takes the roll's second pass."""
    recipe = LONG[name]
    rid = str(_C.recipe_key(recipe))
    g = torch.Generator().manual_seed(1)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((4, 64, 96), (160, 96), (4, 64, 160)))
    hist_fwd = torch.rand(recipe.amax_history_len, 2, generator=g)
    hist_bwd = torch.rand(recipe.amax_history_len, 1, generator=g)
    hist_bwd[-1] = 40.0  # the window's max until it rolls out: MAX and MOST_RECENT differ
    hist_fwd[0] = hist_bwd[0] = 0.0
    scale_fwd, scale_bwd = torch.rand(2, generator=g) + 0.5, torch.rand(1, generator=g) + 0.5
    ops = torch.ops.tequant
    args = (rid, needs & 3, [4, 64, 96], torch.float32, torch.float32,
            torch.float32 if bias else None)
    results = {}
    for dev in ("cpu", "cuda"):
        t = [v.to(dev, copy=True) for v in (x, w, dy, hist_fwd, scale_fwd, hist_bwd, scale_bwd)]
        _, x_kept, w_kept = ops.linear_fwd_delayed(t[0], t[1], None, rid, needs, t[4], t[3])
        x_kept = x_kept if needs & 2 else None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            outs = ops.linear_bwd_delayed(t[2], x_kept, w_kept, *args, t[6], t[5])
            torch.cuda.synchronize()
        launches = sum(e.name.count("amax_update_kernel") for e in prof.events())
        results[dev] = [o.cpu() for o in (outs[2], t[5], t[6])], launches  # not the GEMMs'
    (cpu, _), (cuda, launches) = results["cpu"], results["cuda"]
    assert all(torch.equal(a, b) for a, b in zip(cpu, cuda))
    assert cpu[-2][-1] == dy.abs().max() and cpu[-2][0] == 0  # rolled: this step's amax last
    assert not torch.equal(cpu[-1], scale_bwd)
    assert launches == (0 if bias and needs & 2 else 1)


def test_in_place_ops_follow_replaced_buffers():
    """The ops keep a module's slot views between calls (linear_ops.c kept_states); a buffer
    swapped for new storage (`.data =`), another scale object and a new history object of the
    same address must each be read and written themselves: every call equals a call on fresh
    copies of what it was given; a history that dies takes its entry with it."""
    recipe = RECIPES["max"]
    rid = str(_C.recipe_key(recipe))
    x, w, dy, hist_fwd, scale_fwd, hist_bwd, scale_bwd = _ops_inputs(recipe)
    ops = torch.ops.tequant

    def fwd_matches_fresh(hist, scale):
        hist_want, scale_want = hist.clone(), scale.clone()
        want = ops.linear_fwd_delayed(x, w, None, rid, 8 | 3, scale_want, hist_want)
        got = ops.linear_fwd_delayed(x, w, None, rid, 8 | 3, scale, hist)
        return torch.equal(got[0], want[0]) and torch.equal(hist, hist_want)

    assert fwd_matches_fresh(hist_fwd, scale_fwd)  # fills the kept entry
    assert fwd_matches_fresh(hist_fwd, scale_fwd)  # uses it
    old_storage = hist_fwd.data
    hist_fwd.data = torch.zeros_like(hist_fwd)
    assert fwd_matches_fresh(hist_fwd, scale_fwd) and hist_fwd[0].min() > 0
    assert not torch.equal(old_storage, hist_fwd)  # the new storage took the amaxes
    assert fwd_matches_fresh(hist_fwd, scale_fwd * 4)  # another scale: y quantized with it
    scale_fwd.data = scale_fwd.data / 8
    assert fwd_matches_fresh(hist_fwd, scale_fwd)
    for _ in range(3):  # new objects, possibly at a freed one's address
        assert fwd_matches_fresh(torch.zeros(recipe.amax_history_len, 2), scale_fwd.clone())
    gc.collect()
    before = _C._kept_delayed_states()
    dead = torch.zeros(recipe.amax_history_len, 2)
    ops.linear_fwd_delayed(x, w, None, rid, 8 | 3, scale_fwd, dead)
    assert _C._kept_delayed_states() == before + 1
    del dead  # its entry goes with it (its views would keep the storage alive)
    assert _C._kept_delayed_states() == before
    kept = ops.linear_fwd_delayed(x, w, None, rid, 8 | 3, scale_fwd, hist_fwd)
    args = (rid, 3, [3, 7, 64], x.dtype, w.dtype, None)
    for replace in (False, True):
        if replace:
            scale_bwd.data = scale_bwd.data * 2
            hist_bwd.data = hist_bwd.data.clone()
        fresh = ops.linear_bwd(dy, kept[1], kept[2], *args, scale_bwd)
        want_hist, want_scale = _updated_by_hand(rid, hist_bwd, scale_bwd, fresh[-1])
        got = ops.linear_bwd_delayed(dy, kept[1], kept[2], *args, scale_bwd, hist_bwd)
        assert torch.equal(got[0], fresh[0]) and torch.equal(hist_bwd, want_hist)
        assert torch.equal(scale_bwd, want_scale)


@pytest.mark.parametrize("name", ["max", "callable_algo"])
def test_deferred_backward_op_only_accumulates(name):
    """linear_bwd_delayed with needs bit DEFER_UPDATE (an amax all-reduce comes first, at the end
    of the backward pass): dy's amax max-accumulated into row 0 of hist_bwd, nothing rolled, the
    scale untouched, for the fused and TE's unfused rule alike; the same gradients as linear_bwd.
    The copying op refuses the bit."""
    recipe = RECIPES[name]
    rid = str(_C.recipe_key(recipe))
    x, w, dy, hist_fwd, scale_fwd, hist_bwd, scale_bwd = _ops_inputs(recipe)
    ops = torch.ops.tequant
    kept = ops.linear_fwd(x, w, None, rid, 8 | 3, scale_fwd)
    args = (rid, 3, [3, 7, 64], x.dtype, w.dtype, None)
    fresh = ops.linear_bwd(dy, kept[1], kept[2], *args, scale_bwd)
    want = hist_bwd.clone()
    want[0] = torch.maximum(want[0], fresh[-1].view(1))
    scale_before = scale_bwd.clone()
    defer = 3 | _plan.DEFER_UPDATE
    got = ops.linear_bwd_delayed(dy, kept[1], kept[2], rid, defer, *args[2:], scale_bwd, hist_bwd)
    assert torch.equal(hist_bwd, want) and torch.equal(scale_bwd, scale_before)
    assert torch.equal(got[0], fresh[0]) and torch.equal(got[1], fresh[1])
    with pytest.raises(ValueError, match="needs bit 16 .* linear_bwd_delayed"):
        ops.linear_bwd(dy, kept[1], kept[2], rid, defer, *args[2:], scale_bwd)


def test_in_place_ops_refuse_what_they_cannot_update():
    rid = str(_C.recipe_key(RECIPES["max"]))
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    ops = torch.ops.tequant
    with pytest.raises(ValueError, match="in-place op is for DelayedScaling .* packed form"):
        ops.linear_fwd_delayed(x, w, None, rid, 3, torch.ones(2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="hist_fwd is for DelayedScaling only"):
        ops.linear_fwd_delayed(x, w, None, str(_C.recipe_key(Float8CurrentScaling())), 8 | 3,
                               torch.ones(2), torch.zeros(4, 2))
    outs = ops.linear_fwd(x, w, None, rid, 8 | 3, torch.ones(2))
    args = (rid, 3, [16, 32], x.dtype, w.dtype, None)
    unfused = str(_C.recipe_key(RECIPES["callable_algo"]))
    with pytest.raises(ValueError, match="fused update rule"):
        ops.linear_bwd_delayed(torch.randn(16, 16), outs[1], outs[2], unfused, *args[1:],
                               torch.ones(1), torch.zeros(3, 1))


def test_ops_with_histories_match_their_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    recipe = RECIPES["max"]
    rid = str(_C.recipe_key(recipe))
    x, w, dy, hist_fwd, scale_fwd, hist_bwd, scale_bwd = _ops_inputs(recipe)
    fwd, bwd = torch.ops.tequant.linear_fwd, torch.ops.tequant.linear_bwd

    def shapes(outs):
        return [(tuple(t.shape), t.stride(), t.dtype) for t in outs]
    for needs in (8 | 3, 3):  # packed, and the members (the amax members copied out)
        real = fwd(x, w, None, rid, needs, scale_fwd, hist_fwd)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = fwd(*(mode.from_tensor(t) for t in (x, w)), None, rid, needs,
                       mode.from_tensor(scale_fwd), mode.from_tensor(hist_fwd))
        assert shapes(real) == shapes(fake)
        aliased = {t.untyped_storage().data_ptr() for t in real}
        assert len(aliased) == len(real)  # op outputs alias nothing
    real = fwd(x, w, None, rid, 8 | 3, scale_fwd, hist_fwd)
    args = (rid, 3, [3, 7, 64], x.dtype, w.dtype, torch.float32)
    got = bwd(dy, real[1], real[2], *args, scale_bwd)  # + dy's amax
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = bwd(mode.from_tensor(dy), real[1], real[2], *args, mode.from_tensor(scale_bwd))
    assert shapes(got) == shapes(fake)


def test_ops_refuse_bad_histories():
    rid = str(_C.recipe_key(RECIPES["max"]))  # a 4-row history
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    fwd, bwd = torch.ops.tequant.linear_fwd, torch.ops.tequant.linear_bwd
    two, four_two = torch.ones(2), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="hist_fwd has dtype float64"):
        fwd(x, w, None, rid, 8 | 3, two, four_two.double())
    with pytest.raises(ValueError, match=r"hist_fwd must be float32 \[history_len, 2\]"):
        fwd(x, w, None, rid, 8 | 3, two, torch.zeros(4, 3))
    with pytest.raises(ValueError, match="hist_fwd must be"):
        fwd(x, w, None, rid, 8 | 3, two, torch.zeros(8))
    with pytest.raises(ValueError, match=r"scale_fwd float32 \[2\]; got .* 3 elements"):
        fwd(x, w, None, rid, 8 | 3, torch.ones(3), four_two)
    with pytest.raises(ValueError, match="hist_fwd is for DelayedScaling only"):
        fwd(x, w, None, str(_C.recipe_key(Float8CurrentScaling())), 8 | 3, None, four_two)
    outs = fwd(x, w, None, rid, 8 | 3, two)
    args = (rid, 3, [16, 32], x.dtype, w.dtype, None)
    dy = torch.randn(16, 16)
    bwd = torch.ops.tequant.linear_bwd_delayed
    with pytest.raises(ValueError, match=r"hist_bwd must be float32 \[4, 1\]"):
        bwd(dy, outs[1], outs[2], *args, torch.ones(1), torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"scale_bwd float32 \[1\]"):
        bwd(dy, outs[1], outs[2], *args, torch.ones(2), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="in-place op is for DelayedScaling"):
        bwd(dy, outs[1], outs[2], str(_C.recipe_key(Float8CurrentScaling())), *args[1:],
            torch.ones(1), torch.zeros(4, 1))
    unfused = str(_C.recipe_key(RECIPES["callable_algo"]))
    outs = fwd(x, w, None, unfused, 8 | 3, two)
    with pytest.raises(ValueError, match="fused update rule"):
        bwd(dy, outs[1], outs[2], unfused, *args[1:], torch.ones(1), torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"hist_bwd must be float32 \[4, 1\]"):
        torch.ops.tequant.linear_bwd_given(dy, [None] * 6, outs[2], *args, torch.ones(1),
                                           torch.zeros(4, 2))


@gpu
@pytest.mark.gpu
def test_ops_refuse_a_history_on_another_device():
    rid = str(_C.recipe_key(RECIPES["max"]))
    x, w = torch.randn(16, 32, device="cuda"), torch.randn(16, 32, device="cuda")
    with pytest.raises(ValueError, match="must be on the input's device, cuda:0"):
        torch.ops.tequant.linear_fwd(x, w, None, rid, 8 | 3, torch.ones(2, device="cuda"),
                                     torch.zeros(4, 2))
