"""CUDA graphs with te.autocast and te.Linear (issue 6): manual torch.cuda.CUDAGraph capture of a
whole training step (forward, backward, optimizer) and torch.compile(mode="reduce-overhead"),
for every recipe. Ten replays must give the parameters (and DelayedScaling histories and scales)
of ten eager steps, bit for bit. NVFP4 runs without stochastic rounding here: its (seed, offset)
is drawn on the host, so a replay reuses the captured bits (README: limitations).
GPU only. The code under test: python/tequant/linear.py, _compile.py, _compile_linear.py.
"""
import copy

import pytest
import torch

import tequant as te
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.gpu]

RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True),
}
STEPS, WARMUP = 10, 3


class TwoLinear(torch.nn.Module):
    """Only te.Linear inside, so compiled graphs hold nothing but tequant's ops."""

    def __init__(self):
        super().__init__()
        self.fc1 = te.Linear(128, 256, params_dtype=torch.bfloat16, device="cuda")
        self.fc2 = te.Linear(256, 64, params_dtype=torch.bfloat16, device="cuda")

    def forward(self, x):
        return self.fc2(self.fc1(x))


def _setup():
    torch.manual_seed(0)
    model = TwoLinear()
    data = [torch.randn(4, 50, 128, dtype=torch.bfloat16, device="cuda")
            for _ in range(WARMUP + STEPS)]
    return model, data


def _state(model):
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), f"max |diff| {(x.float() - y.float()).abs().max()}"


def _eager_run(model, data, recipe):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data:
        opt.zero_grad(set_to_none=True)
        with te.autocast(recipe=recipe):
            y = model(x)
        y.float().square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    return _state(model)


@pytest.mark.parametrize("name", RECIPES)
def test_manual_capture_of_a_training_step_replays_like_eager(name):
    recipe = RECIPES[name]
    model, data = _setup()
    twin = copy.deepcopy(model)
    expected = _eager_run(twin, data, recipe)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    static_x = data[0].clone()

    def step():
        opt.zero_grad(set_to_none=True)
        with te.autocast(recipe=recipe):
            y = model(static_x)
        y.float().square().mean().backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps (real ones, as in the eager run)
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
    _assert_same(expected, _state(model))


@pytest.mark.parametrize("where", ["inside", "outside"])
@pytest.mark.parametrize("name", RECIPES)
def test_reduce_overhead_training_steps_match_eager(name, where):
    torch._dynamo.reset()
    recipe = RECIPES[name]
    model, data = _setup()
    twin = copy.deepcopy(model)
    expected = _eager_run(twin, data, recipe)

    if where == "inside":
        def forward(x):
            with te.autocast(recipe=recipe):
                return model(x)
    else:
        def forward(x):
            return model(x)
    compiled = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data:
        opt.zero_grad(set_to_none=True)
        if where == "inside":
            y = compiled(x)
        else:
            with te.autocast(recipe=recipe):
                y = compiled(x)
        y.float().square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    _assert_same(expected, _state(model))
    torch._dynamo.reset()


def test_stochastic_rounding_inside_a_capture_is_refused_clearly():
    recipe = NVFP4BlockScaling()  # stochastic rounding on grad_output
    model, data = _setup()
    x = data[0]
    with te.autocast(recipe=recipe):  # warm up eagerly: plans, buffers
        model(x).float().square().mean().backward()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="disable_stochastic_rounding=True"):
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            with te.autocast(recipe=recipe):
                y = model(x)
            y.float().square().mean().backward()
    torch.cuda.synchronize()
