"""te.Linear's DelayedScaling state (NUMERICS.md 2, TE_REFERENCE 6.1; python/tequant/delayed.py).

Over several training steps, the amax histories and scales of every module equal a plain-Python
model of the rules: forward columns (input, weight) updated at the outermost autocast exit,
backward column (grad_output) at the end of the backward of the module that ran first; each
step's output is the GEMM of operands quantized with the scales of the previous update. Also:
state_dict round trip mid-training gives identical next steps, calibration records amaxes
without quantizing, a callable amax algorithm uses TE's unfused rule, CustomRecipe quantizers
drive all three GEMMs, and amax_reduction_group takes the MAX over two gloo ranks
(tests/dist_util.py). CUDA cases are marked gpu.
"""
import numpy as np
import pytest
import torch

import tequant as te
from tequant.recipe import CustomRecipe, DelayedScaling, Format

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])]
F32_MAX = float(np.finfo(np.float32).max)


class SlotModel:
    """One (module, role) of delayed scaling in plain Python: history list and scale."""

    def __init__(self, length, fmax, margin):
        self.h = [0.0] * length
        self.scale = 1.0
        self.scaled_max = np.float32(fmax * 2.0 ** -margin)

    def record(self, t):
        a = float(t.detach().abs().max()) if t.numel() else 0.0
        self.h[0] = max(self.h[0], a)

    def update(self, algo):
        last = self.h[0]
        if last == 0.0:
            return
        window = self.h[1:] + [last]
        self.h = [0.0] + self.h[2:] + [last] if len(self.h) > 1 else [0.0]
        amax = max(window) if algo == "max" else last
        if np.isfinite(amax) and amax > 0:
            s = float(np.float32(self.scaled_max) / np.float32(amax))
            self.scale = F32_MAX if np.isinf(s) else s


def state_of(lin):
    return (lin.delayed_amax_history_fwd.cpu().t().tolist(), lin.delayed_scale_fwd.cpu().tolist(),
            lin.delayed_amax_history_bwd.cpu().t().tolist(), lin.delayed_scale_bwd.cpu().tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 3, 16])
def test_history_and_scales_follow_the_rules_over_steps(device, algo, length):
    recipe = DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=1)
    torch.manual_seed(0)
    l1 = te.Linear(32, 48, device=device)
    l2 = te.Linear(48, 16, device=device)
    e4m3, e5m2 = 448.0, 57344.0
    models = {name: [SlotModel(length, e4m3, 1), SlotModel(length, e4m3, 1),
                     SlotModel(length, e5m2, 1)] for name in ("l1", "l2")}
    opt = torch.optim.SGD(list(l1.parameters()) + list(l2.parameters()), lr=0.05)
    for step in range(5):
        x = torch.randn(24, 32, device=device) * (1 + step)
        g = torch.randn(24, 16, device=device) * 0.5 ** step  # dy of the last layer
        with te.autocast(recipe=recipe):
            h1 = l1(x)
            h1.retain_grad()
            a1 = torch.relu(h1)
            y = l2(a1)
        # forward: the x and W amaxes were recorded; the exit updated the forward columns
        models["l1"][0].record(x), models["l1"][1].record(l1.weight)
        models["l2"][0].record(a1), models["l2"][1].record(l2.weight)
        for name in ("l1", "l2"):
            for m in models[name][:2]:
                m.update(algo)
        (y * g).sum().backward()
        # backward: each dy recorded; l1 ran first in forward, so the end of its backward
        # updated both modules' backward columns
        models["l2"][2].record(g), models["l1"][2].record(h1.grad)
        for name in ("l1", "l2"):
            models[name][2].update(algo)
        opt.step()
        opt.zero_grad()
        for name, lin in (("l1", l1), ("l2", l2)):
            fwd_h, fwd_s, bwd_h, bwd_s = state_of(lin)
            for column in range(2):
                m = models[name][column]
                assert fwd_h[column] == m.h and fwd_s[column] == m.scale, (name, step, column)
            m = models[name][2]
            assert bwd_h[0] == m.h and bwd_s[0] == m.scale, (name, step, "grad_output")


@pytest.mark.parametrize("device", DEVICES)
def test_output_uses_the_previous_steps_scales(device):
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(1)
    lin = te.Linear(64, 32, bias=False, device=device)
    for step in range(3):
        x = torch.randn(16, 64, device=device) * (step + 1)
        s_x = lin.delayed_scale_fwd[0:1].clone() if step else None
        s_w = lin.delayed_scale_fwd[1:2].clone() if step else None
        with te.autocast(recipe=recipe):
            y = lin(x)
        qx = te.ops.quantize(x, recipe, "input", scale=s_x)
        qw = te.ops.quantize(lin.weight.detach(), recipe, "weight", scale=s_w)
        want = te.ops.gemm(qx, qw, transpose_b=True, out_dtype=torch.float32)
        assert torch.equal(y.detach(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip_mid_training_gives_identical_next_steps(device):
    recipe = DelayedScaling(amax_history_len=8)
    torch.manual_seed(2)

    def step(lin, x):
        with te.autocast(recipe=recipe):
            y = lin(x)
        y.pow(2).sum().backward()
        with torch.no_grad():
            lin.weight -= 1e-3 * lin.weight.grad
        lin.weight.grad = None
        return y.detach()

    xs = [torch.randn(32, 64, device=device) for _ in range(6)]
    a = te.Linear(64, 32, device=device)
    for x in xs[:3]:
        step(a, x)
    b = te.Linear(64, 32, device=device)
    b.load_state_dict(a.state_dict())
    assert state_of(a) == state_of(b)
    for x in xs[3:]:
        assert torch.equal(step(a, x), step(b, x))
    assert state_of(a) == state_of(b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("swap", ["data", "assign"])
def test_state_follows_buffers_replaced_between_steps(device, swap):
    """The module keeps views of its buffers between calls (delayed.slots): a buffer given new
    storage (`.data =`) or replaced (load_state_dict(assign=True)) must be the one the next
    step reads its scales from and records its amaxes into."""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(3)
    lin = te.Linear(32, 16, bias=False, device=device)
    x = torch.randn(8, 32, device=device)
    with te.autocast(recipe=recipe):
        lin(x).sum().backward()
    scale = torch.tensor([0.5, 0.25], device=device)
    hist = torch.zeros_like(lin.delayed_amax_history_fwd)
    if swap == "data":
        lin.delayed_scale_fwd.data = scale
        lin.delayed_amax_history_fwd.data = hist
    else:
        sd = dict(lin.state_dict(), delayed_scale_fwd=scale, delayed_amax_history_fwd=hist)
        lin.load_state_dict(sd, assign=True)
    x = torch.randn(8, 32, device=device) * 3
    with te.autocast(recipe=recipe):
        y = lin(x)
        # the cast used the new scales (read before the exit updates them)
        qx = te.ops.quantize(x, recipe, "input", scale=scale[0:1].clone())
        qw = te.ops.quantize(lin.weight.detach(), recipe, "weight", scale=scale[1:2].clone())
        want = te.ops.gemm(qx, qw, transpose_b=True, out_dtype=torch.float32)
        assert torch.equal(y.detach(), want)
        # ... and recorded this step's amaxes into the new history's row 0
        amaxes = [float(x.abs().max()), float(lin.weight.detach().abs().max())]
        assert lin.delayed_amax_history_fwd[0].tolist() == amaxes
    # the exit's update rolled the new history (row 0 to the end) and wrote the new scales
    assert lin.delayed_amax_history_fwd[-1].tolist() == amaxes
    assert lin.delayed_scale_fwd.tolist() == [float(np.float32(448.0) / np.float32(a))
                                              for a in amaxes]


def test_calibration_records_amaxes_without_quantizing():
    recipe = DelayedScaling(amax_history_len=4)
    lin = te.Linear(32, 16)
    x = torch.randn(8, 32) * 3
    with te.autocast(enabled=False, calibrating=True, recipe=recipe):
        y = lin(x)
    assert torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
    h = lin.delayed_amax_history_fwd
    assert h[0, 0].item() == x.abs().max().item()
    assert h[0, 1].item() == lin.weight.detach().abs().max().item()
    assert lin.delayed_scale_fwd.tolist() == [1.0, 1.0]  # no update on a calibration exit


def test_callable_amax_algorithm_uses_the_unfused_rule():
    seen = []

    def algo(history):
        seen.append(history.clone())
        return history.amax()

    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=algo, fp8_format=Format.E4M3)
    lin = te.Linear(16, 16, bias=False)
    x = torch.randn(4, 16) * 2
    with te.autocast(recipe=recipe):
        lin(x).sum().backward()
    assert len(seen) == 3  # input, weight, grad_output
    assert lin.delayed_scale_fwd[0].item() == pytest.approx(448.0 / x.abs().max().item(), rel=1e-6)
    assert lin.delayed_amax_history_fwd[:, 0].tolist() == [0.0, 0.0, x.abs().max().item()]


class _Bf16Quantizer:
    def __init__(self, role):
        self.role = role
        self.calls = 0

    def quantize(self, t):
        self.calls += 1
        return t.to(torch.bfloat16)

    def dequantize(self, q):
        return q.float()


def test_custom_recipe_quantizers_drive_the_three_gemms():
    made = {}
    recipe = CustomRecipe(qfactory=lambda role: made.setdefault(role.tensor_type,
                                                                _Bf16Quantizer(role)))
    torch.manual_seed(3)
    lin = te.Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = lin(x)
    g = torch.randn(8, 16)
    (y * g).sum().backward()
    bf = lambda t: t.detach().to(torch.bfloat16).float()  # noqa: E731
    assert torch.allclose(y, bf(x) @ bf(lin.weight).t() + lin.bias, rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad, bf(g) @ bf(lin.weight), rtol=1e-5, atol=1e-5)
    assert torch.allclose(lin.weight.grad, bf(g).t() @ bf(x), rtol=1e-5, atol=1e-5)
    assert sorted(made) == ["grad_output", "input", "weight"]
    assert all(q.calls >= 1 for q in made.values())
    assert not torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_custom_quantizer_without_the_protocol_is_a_type_error():
    recipe = CustomRecipe(qfactory=lambda role: object())
    lin = te.Linear(16, 16)
    with pytest.raises(TypeError, match="quantize"):
        with te.autocast(recipe=recipe):
            lin(torch.randn(2, 16))
    assert te.autocast_depth() == 0


def _reduction_worker(rank, world):
    import torch.distributed as dist
    torch.manual_seed(0)  # same weights on every rank
    lin = te.Linear(16, 16)
    x = torch.full((4, 16), float(rank + 1))  # rank r's input amax is r + 1
    with te.autocast(recipe=DelayedScaling(amax_history_len=2),
                     amax_reduction_group=dist.group.WORLD):
        lin(x).sum().backward()
    return (lin.delayed_scale_fwd.tolist(), lin.delayed_amax_history_fwd[:, 0].tolist())


def test_amaxes_are_all_reduced_over_the_group():
    """Two gloo ranks (tests/dist_util.py) with input amaxes 1 and 2: both take the MAX before
    the update."""
    import os
    import sys
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_util import run_ranks
    results = run_ranks(_reduction_worker, 2, timeout=120)
    assert results[0] == results[1]
    scales, history = results[0]
    assert scales[0] == float(np.float32(448.0) / np.float32(2.0))
    assert history == [0.0, 2.0]
