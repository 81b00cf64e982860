"""Inductor hands te.Linear's ops their inputs in any layout (_compile_ops.ANY_LAYOUT).

The ops that take the activation or its gradient (linear_fwd / linear_bwd, their DelayedScaling
forms, linear_bwd_given of te.LayerNormLinear) carry torch.Tag.flexible_layout: Inductor may pass
a view of a buffer it already has, strided as it likes, and the op makes it contiguous itself.
Tested on CPU with the inductor backend: a module whose te.Linear takes a transposed in-graph
tensor and whose gradient reaches it through unbind -> permute -> view (in the backward: stack,
permute, reshape, the qkv projection's under attention) trains bit-identically to eager; and
Inductor's backward code passes that gradient as a view of the buffer its producer wrote
(reinterpret_tensor) rather than copying it into a buffer of the view's shape, the copy whose
index math Triton did not vectorize on the GPU (24 us instead of 12 at d=512 on an H200;
docs/results/NOTES.md, twenty-ninth session).
"""
import copy
import os
import sys

import pytest
import torch

import tequant as te
from tequant.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

# test_compile's training steps and bit-for-bit check; its autouse fixture resets Dynamo here too
sys.path.insert(0, os.path.dirname(__file__))
from test_compile import _assert_bit_identical, _fresh_dynamo, _train_steps  # noqa: E402, F401

RECIPES = {
    "current": Float8CurrentScaling(),
    "delayed": DelayedScaling(amax_history_len=4),
    "mxfp8": MXFP8BlockScaling(),
}
BACKWARD_OPS = {"linear": {"delayed": "linear_bwd_delayed"}, "layernorm_linear": {}}


class Views(torch.nn.Module):
    """A projection to three heads' q / k / v, read back through views: its input is a
    transposed in-graph tensor, its output is split by unbind after a permute."""

    def __init__(self, kind):
        super().__init__()
        if kind == "linear":
            self.fc = te.Linear(64, 96, params_dtype=torch.bfloat16)
        else:
            self.fc = te.LayerNormLinear(64, 96, params_dtype=torch.bfloat16)

    def forward(self, x):  # x [3, 7, 64]
        h = self.fc((2 * x).transpose(0, 1))  # [7, 3, 96]
        q, k, v = h.view(7, 3, 3, 2, 16).permute(2, 1, 3, 0, 4).unbind(0)  # [3, 2, 7, 16] each
        return torch.cat([2 * q, k, v], dim=-1)


def _setup(kind, name):
    torch.manual_seed(0)
    model = Views(kind)
    x = torch.randn(3, 7, 64).to(torch.bfloat16)

    def step(m, xi):
        with te.autocast(recipe=RECIPES[name]):
            return m(xi)
    return model, x, step


@pytest.mark.parametrize("kind", ["linear", "layernorm_linear"])
@pytest.mark.parametrize("name", RECIPES)
def test_strided_inputs_train_bit_identically(kind, name):
    model, x, step = _setup(kind, name)
    twin = copy.deepcopy(model)
    eager = _train_steps(step, model, x, None)
    compiled = _train_steps(torch.compile(step, backend="inductor", fullgraph=True), twin, x, None)
    _assert_bit_identical(eager, compiled)


@pytest.mark.parametrize("kind", ["linear", "layernorm_linear"])
@pytest.mark.parametrize("name", ["current", "delayed"])
def test_gradient_view_is_passed_not_copied(kind, name):
    import torch._inductor.config
    from torch._inductor.utils import run_and_get_code
    model, x, step = _setup(kind, name)
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True):  # this tree's tags, not a cache's
        y = compiled(model, x.clone().requires_grad_())
        _, codes = run_and_get_code(lambda: y.float().square().mean().backward())
    default = "linear_bwd" if kind == "linear" else "linear_bwd_given"
    call = f"torch.ops.tequant.{BACKWARD_OPS[kind].get(name, default)}.default("
    lines = [line.strip() for code in codes for line in code.splitlines() if call in line]
    assert len(lines) == 1, (call, lines)
    first_arg = lines[0].split(call, 1)[1]
    assert first_arg.startswith("reinterpret_tensor("), lines[0]
