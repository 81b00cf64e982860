"""torch.compile and activation checkpointing at their edges (CPU, backend aot_eager): each case
gives eager's bits or a clear error, never other numbers.

- Two recipes in one fullgraph function traced from an empty plan cache (traced code asks
  _plan.blocks_of, a constant, and never reads the cache Dynamo snapshots).
- CustomRecipe under calibrating=True: nothing to record, eager and compiled.
- A DelayedScaling autocast entered inside a compiled function that an eager non-reentrant
  checkpoint recomputes: the documented RuntimeError (reentrant: eager's bits).
- A region that ran in high precision is recomputed in high precision, whatever autocast is
  live in backward (checkpoint._Tape.high_precision).
- Compiled and eager te.Linear in one eager DelayedScaling autocast: the first eager module owns
  the backward update (a compiled module's entry claims none: csrc/ext/state.c); LayerNormMLP
  with one Linear compiled on its own hands it a tensor.
- CustomRecipe with a checkpoint inside fullgraph code once te.prepare_state made its quantizers.
"""
import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import tequant as te
from tequant import _plan
from tequant.recipe import (CustomRecipe, DelayedScaling, Float8CurrentScaling,
                            MXFP8BlockScaling)


class _BF16:
    def quantize(self, t):
        return t.to(torch.bfloat16)

    def dequantize(self, q):
        return q.float()


def _custom():
    return CustomRecipe(qfactory=lambda role: _BF16())


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(te.Linear(64, 64), torch.nn.GELU(), te.Linear(64, 64))


def _state(m):
    return [p.grad for p in m.parameters()] + [b.clone() for b in m.buffers()]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def test_two_recipes_in_one_fullgraph_function_from_an_empty_plan_cache():
    torch._dynamo.reset()
    _plan._BY_ID.clear()  # as in a fresh process: no plan made before the trace
    r1, r2 = Float8CurrentScaling(), MXFP8BlockScaling()
    torch.manual_seed(0)
    m = te.Linear(64, 64, params_dtype=torch.bfloat16)
    x = torch.randn(1, 7, 64, dtype=torch.bfloat16)

    def step(m, x):
        with te.autocast(recipe=r1):
            y = m(x)
        with te.autocast(recipe=r2):
            return m(y)

    got = torch.compile(step, backend="aot_eager", fullgraph=True)(m, x)
    assert torch.equal(got, step(m, x))


@pytest.mark.parametrize("order", ["calibrate_first", "enabled_first", "compiled"])
def test_custom_recipe_under_calibration_records_nothing(order):
    rec = _custom()
    m, x = te.Linear(64, 64), torch.randn(4, 64)
    calibrating = te.autocast(enabled=False, calibrating=True, recipe=rec)
    if order == "compiled":
        with calibrating:
            got = torch.compile(lambda t: m(t), backend="aot_eager", fullgraph=True)(x)
        assert torch.equal(got, torch.nn.functional.linear(x, m.weight, m.bias))
        return
    steps = [calibrating, te.autocast(recipe=rec)]
    for ctx in steps if order == "calibrate_first" else steps[::-1]:
        with ctx:
            m(x)
    assert not hasattr(m, "delayed_amax_history_fwd")


def _delayed_block(m, x):
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        return m(x)


def _train(m, fn, reentrant=None):
    out = []
    for i in range(2):
        torch.manual_seed(i)
        x = torch.randn(2, 7, 64).requires_grad_()
        y = fn(m, x) if reentrant is None else checkpoint(fn, m, x, use_reentrant=reentrant)
        y.square().mean().backward()
        out += [y.detach(), x.grad] + _state(m)
        m.zero_grad(set_to_none=True)
    return out


def test_delayed_autocast_inside_a_recomputed_compiled_function():
    want = _train(_mlp(), _delayed_block)
    compiled = torch.compile(_delayed_block, backend="aot_eager")
    assert _same(_train(_mlp(), compiled, reentrant=True), want)
    with pytest.raises(RuntimeError, match="inside an eager torch.utils.checkpoint region that "
                                           "ran under DelayedScaling"):
        _train(_mlp(), compiled, reentrant=False)


@pytest.mark.parametrize("reentrant", [True, False])
def test_high_precision_region_recomputes_in_high_precision(reentrant):
    def grads(m, ckpt):
        torch.manual_seed(1)
        x = torch.randn(2, 7, 64).requires_grad_()
        with te.autocast(recipe=Float8CurrentScaling()):
            with te.autocast(enabled=False):
                h = checkpoint(m, x, use_reentrant=reentrant) if ckpt else m(x)
            h.square().mean().backward()  # the recompute runs inside the enabled autocast
        return [x.grad] + _state(m)

    want = grads(_mlp(), ckpt=False)
    m = _mlp()
    for linear in (m[0], m[2]):
        linear.compile(backend="aot_eager")
    assert _same(grads(m, ckpt=True), want)


@pytest.mark.parametrize("compiled", ["0", "2", "0,2"])
def test_compiled_and_eager_linears_in_one_delayed_autocast(compiled):
    def train(m):
        out = []
        for i in range(3):
            torch.manual_seed(i)
            x = torch.randn(8, 64).requires_grad_()
            with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
                y = m(x)
            y.square().mean().backward()
            out += [y.detach(), x.grad] + _state(m)
            m.zero_grad(set_to_none=True)
        return out

    m = _mlp()
    want = train(copy.deepcopy(m))
    for i in compiled.split(","):
        m[int(i)].compile(backend="aot_eager")
    assert _same(train(m), want)


@pytest.mark.parametrize("which", ["fc1", "fc2"])
def test_layernorm_mlp_with_one_linear_compiled_under_delayed_scaling(which):
    """The compiled Linear gets a tensor, as a hooked one does: the eager twin with a no-op
    hook on the same Linear gives the same bits."""
    torch.manual_seed(0)
    m = te.LayerNormMLP(64, 64, params_dtype=torch.bfloat16)
    twin = copy.deepcopy(m)
    getattr(twin, which).register_forward_pre_hook(lambda mod, args: None)
    getattr(m, which).compile(backend="aot_eager")

    def train(mm):
        out = []
        for i in range(3):
            torch.manual_seed(i)
            x = torch.randn(1, 7, 64, dtype=torch.bfloat16).requires_grad_()
            with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
                y = mm(x)
            y.float().square().mean().backward()
            out += [y.detach(), x.grad] + _state(mm)
            mm.zero_grad(set_to_none=True)
        return out

    assert _same(train(m), train(twin))


def test_custom_recipe_checkpoint_in_fullgraph_after_prepare_state():
    rec = _custom()
    torch.manual_seed(0)
    m = te.Linear(64, 64)
    te.prepare_state(m, rec)

    def step(x):
        with te.autocast(recipe=rec):
            return checkpoint(m, x, use_reentrant=False)

    x = torch.randn(2, 7, 64)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    with te.autocast(recipe=rec):
        assert torch.equal(got, m(x))
