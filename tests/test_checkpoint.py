"""Activation checkpointing with te.Linear (issue 20; shared/docs/DISTRIBUTED.md 4).

torch.utils.checkpoint in both modes and torch's apply_activation_checkpointing (its
checkpoint_wrapper, both implementations) around blocks of te.Linear: three training steps under
te.autocast give inputs' and parameters' gradients and DelayedScaling's buffers bit-identical to
the same steps without checkpointing, for every recipe (NVFP4 with stochastic rounding on its
gradients), on CPU and CUDA; so each forward's amaxes are recorded once and the recompute uses
the scales its forward used. Also: the quantized activations go through save_for_backward (what
checkpointing drops and CPU offloading moves), microbatches with the weight cache, nested
regions with autocast changes and a reused module inside, a recompute that diverges from its
forward, and torch.compile(fullgraph=True) over checkpointed blocks. The code under test:
python/tequant/checkpoint.py and python/tequant/linear.py. Hugging Face models: tests/test_hf.py.
"""
import contextlib
import copy
import functools
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(__file__))
import tequant as te  # noqa: E402
from test_compile import DEVICES, RECIPES  # noqa: E402  (DelayedScaling with a 4-row history)
from test_linear import one_cpu_thread  # noqa: E402

assert one_cpu_thread  # the autouse fixture, imported to apply here too
MODES = ["reentrant", "non_reentrant", "wrapper", "wrapper_reentrant"]
WIDTH, TOKENS = 64, (2, 19)  # 38 tokens: padded to every format's row multiple


class Block(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.fc1 = te.Linear(WIDTH, 2 * WIDTH, device=device)
        self.fc2 = te.Linear(2 * WIDTH, WIDTH, device=device)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Model(torch.nn.Module):
    """Two blocks; `mode` checkpoints each: torch.utils.checkpoint in either mode here, or
    (wrapper*) apply_activation_checkpointing with checkpoint_wrapper."""

    def __init__(self, device):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(device), Block(device)])
        self.mode = None

    def forward(self, x):
        for block in self.blocks:
            if self.mode in ("reentrant", "non_reentrant"):
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
            else:
                x = block(x)
        return x


def checkpointed(model, mode):
    model = copy.deepcopy(model)
    if mode in ("wrapper", "wrapper_reentrant"):
        impl = CheckpointImpl.REENTRANT if mode == "wrapper_reentrant" else \
            CheckpointImpl.NO_REENTRANT
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                           checkpoint_impl=impl),
            check_fn=lambda m: isinstance(m, Block))
    else:
        model.mode = mode
    return model


def train(model, recipe, device, steps=3, step_fn=None, seed=1234):
    """Gradients of x and of every parameter after each of `steps` SGD steps, each in its own
    te.autocast (recipe None: none), then the buffers; the same data and generator seed for
    every model. step_fn(model, x) -> y: the forward (default model(x))."""
    torch.manual_seed(seed)
    out = []
    for s in range(steps):
        x = torch.randn(*TOKENS, WIDTH, device=device).requires_grad_()
        with te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
            y = model(x) if step_fn is None else step_fn(model, x)
        (y.float().square().mean() + y.float().sum() * 1e-2).backward()
        out += [x.grad] + [p.grad.clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
                p.grad = None
    return out + [b.clone() for b in model.buffers()]


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and torch.equal(a, b), f"tensor {i} differs"


def base_model(device):
    torch.manual_seed(0)
    return Model(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(RECIPES))
def test_gradients_bit_identical_to_no_checkpointing(name, mode, device):
    model = base_model(device)
    want = train(copy.deepcopy(model), RECIPES[name], device)
    got = train(checkpointed(model, mode), RECIPES[name], device)
    assert_same(got, want)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_delayed_amaxes_recorded_once(mode):
    """After a checkpointed forward and backward inside one autocast, each module's history row
    0 holds this step's forward amaxes once (max-accumulated, not from a second forward in
    another state) and the backward's, exactly as without checkpointing; the recompute ran
    after the autocast's exit rolled the forward history."""
    recipe = RECIPES["delayed"]
    model = base_model("cpu")
    twin = checkpointed(model, mode)
    x = torch.randn(*TOKENS, WIDTH, requires_grad=True)
    for m in (model, twin):
        with te.autocast(recipe=recipe):
            y = m(x)
        y.sum().backward()
    for a, b in zip(model.buffers(), twin.buffers()):
        assert torch.equal(a, b)
    fc1 = twin.blocks[0].fc1
    assert fc1.delayed_amax_history_fwd[0].abs().sum() == 0  # rolled at the exit, not refilled
    assert fc1.delayed_amax_history_fwd[-1, 0] == x.detach().abs().max()


def test_quantized_activations_go_through_save_for_backward():
    """te.Linear saves its quantized operands (x's columnwise part, W) with save_for_backward,
    so checkpointing drops them and torch.autograd.graph hooks (CPU offloading) see them."""
    lin = te.Linear(WIDTH, WIDTH)
    x = torch.randn(32, WIDTH, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.autocast(recipe=RECIPES["current"]):
            y = lin(x)
    assert [t.dtype for t in packed] == [torch.uint8, torch.uint8]
    # x columnwise: 32x64 codes + scale_inv; W both directions: 2 x 64x64 codes + scale_inv
    assert packed[0].numel() >= 32 * WIDTH and packed[1].numel() >= 2 * WIDTH * WIDTH
    y.sum().backward()
    with torch.autograd.graph.save_on_cpu():
        with te.autocast(recipe=RECIPES["mxfp8"]):
            y = lin(x)
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("name", ["delayed", "nvfp4"])
def test_microbatches_with_the_weight_cache(name, mode):
    """is_first_microbatch True then False over three microbatches, each in its own autocast
    (DelayedScaling's scales move between them, the cached W keeps the first one's)."""
    def step_fn(model, x):
        return model(x)

    class Cached(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = te.Linear(WIDTH, WIDTH)
            self.mode = None
            self.first = True

        def forward(self, x):
            fn = functools.partial(self.fc, is_first_microbatch=self.first)
            if self.mode is None:
                return fn(x)
            return checkpoint(fn, x, use_reentrant=self.mode == "reentrant")

    def run(mode):
        torch.manual_seed(0)
        model = Cached()
        model.mode = mode
        out = []
        for mb in range(3):
            model.first = mb == 0
            out += train(model, RECIPES[name], "cpu", steps=1, step_fn=step_fn)
        return out

    assert_same(run(mode), run(None))


def _nested_step(mode_inner, mode_outer):
    def step_fn(model, x):
        m = model.layers

        def inner(h):
            h = F.gelu(m[1](h))
            with te.autocast(enabled=False):
                h = m[2](h)
            return m[1](h)  # the same module twice in one region

        def outer(h):
            h = m[0](h)
            h = inner(h) if mode_inner is None else checkpoint(
                inner, h, use_reentrant=mode_inner == "reentrant")
            with te.autocast(recipe=RECIPES["mxfp8"]):
                h = m[2](h)
            return m[0](h)

        return outer(x) if mode_outer is None else checkpoint(
            outer, x, use_reentrant=mode_outer == "reentrant")
    return step_fn


@pytest.mark.parametrize("outer", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("inner", [None, "reentrant", "non_reentrant"])
@pytest.mark.parametrize("name", ["delayed", "nvfp4"])
def test_nested_regions_autocast_changes_and_reused_modules(name, inner, outer):
    torch.manual_seed(3)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([te.Linear(WIDTH, WIDTH) for _ in range(3)])
    want = train(copy.deepcopy(model), RECIPES[name], "cpu", step_fn=_nested_step(None, None))
    got = train(copy.deepcopy(model), RECIPES[name], "cpu", step_fn=_nested_step(inner, outer))
    assert_same(got, want)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_recompute_that_diverges_raises(mode):
    a, b = te.Linear(WIDTH, WIDTH), te.Linear(WIDTH, WIDTH)
    calls = []

    def fn(x):
        calls.append(1)
        return (a if len(calls) == 1 else b)(x)  # the recompute calls another module

    x = torch.randn(16, WIDTH, requires_grad=True)
    with te.autocast(recipe=RECIPES["current"]):
        y = checkpoint(fn, x, use_reentrant=mode == "reentrant")
    with pytest.raises(RuntimeError, match="same te.Linear modules in the same order"):
        y.sum().backward()


def test_outside_autocast_and_without_grad_checkpointing_is_plain():
    """No te.autocast: the checkpointed blocks are F.linear, bit-identical to no checkpoint.
    Under no_grad checkpoint() runs its function once and no region is opened."""
    model = base_model("cpu")
    x = torch.randn(*TOKENS, WIDTH)
    want = train(copy.deepcopy(model), None, "cpu", steps=1,
                 step_fn=lambda m, x: m(x))
    for mode in ("reentrant", "non_reentrant"):
        regions = []

        def probe(h):
            regions.append(te.checkpoint.REGIONS.get())
            return h

        got = train(checkpointed(model, mode), None, "cpu", steps=1,
                    step_fn=lambda m, x: m(checkpoint(probe, x, use_reentrant=False)))
        assert_same(got, want)
        assert regions[0] is not None and len(regions[0]) == 1  # a region while recorded
        with torch.no_grad():
            checkpoint(probe, x, use_reentrant=mode == "reentrant")
        assert regions[-1] is None


# Every recipe in non-reentrant mode; reentrant mode (which Dynamo traces into the same
# checkpoint op, so the same graphs) with NVFP4 (stochastic rounding: the generator's replay)
# and DelayedScaling (its own eager path). Each recipe's compiled step against eager:
# tests/test_compile.py; each recipe under reentrant checkpointing in eager:
# test_gradients_bit_identical_to_no_checkpointing above.
COMPILED_CASES = [(name, "non_reentrant") for name in RECIPES] + [("nvfp4", "reentrant"),
                                                                  ("delayed", "reentrant")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, mode", COMPILED_CASES)
def test_compiled_checkpointed_blocks(name, mode, device):
    """torch.compile over checkpointed blocks (Dynamo traces either mode as its checkpoint op)
    with te.autocast inside the compiled function: gradients and buffers bit-identical to the
    compiled model without checkpointing (fullgraph=True). DelayedScaling: the checkpointed
    regions run eagerly (a graph break; AOTAutograd's recompute would read scales the autocast's
    exit already updated), bit-identical to eager without checkpointing; fullgraph=True then
    refuses, also with Dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint set."""
    import torch._dynamo
    recipe = RECIPES[name]
    model = base_model(device)

    def compiled(m, fullgraph):
        torch._dynamo.reset()

        @torch.compile(fullgraph=fullgraph)
        def step(x):
            with te.autocast(recipe=recipe):
                return m(x)
        return lambda model, x: step(x)

    delayed = name == "delayed"
    plain = copy.deepcopy(model)
    want = train(plain, recipe, device, steps=2,
                 step_fn=None if delayed else compiled(plain, True))
    ckpt = checkpointed(model, mode)
    got = train(ckpt, recipe, device, steps=2, step_fn=compiled(ckpt, not delayed))
    assert_same(got, want)
    if delayed:
        for flag in (False, True):
            ckpt = checkpointed(model, mode)
            with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=flag):
                with pytest.raises(Exception, match="graph break|graph_break"):
                    train(ckpt, recipe, device, steps=1, step_fn=compiled(ckpt, True))
    torch._dynamo.reset()


def _compile_blocks(model, fullgraph=False):
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=fullgraph)
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("name", [n for n in RECIPES if n != "delayed"])
def test_compiled_blocks_inside_eager_checkpoint(name, mode, device):
    """The other nesting: each block compiled (nn.Module.compile), checkpointed eagerly around
    it, te.autocast outside both. The recompute runs on the autograd thread outside the user's
    te.autocast; it enters the autocast the forward ran in (a stateless recipe), so the compiled
    graphs see the state they were traced under: gradients bit-identical to eager without
    checkpointing (before: the recompute ran in high precision; non-reentrant mode then refused
    its saved tensors, reentrant mode gave high-precision gradients)."""
    recipe = RECIPES[name]
    model = base_model(device)
    want = train(copy.deepcopy(model), recipe, device, steps=2)
    got = train(_compile_blocks(checkpointed(model, mode)), recipe, device, steps=2)
    assert_same(got, want)
    assert te.autocast_depth() == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_compiled_delayed_blocks_inside_eager_checkpoint_refuse(mode):
    """DelayedScaling, the same nesting: the compiled forward keeps no record of the scales it
    used and the autocast's exit has updated them before the recompute, so the recompute raises
    saying so and what to do, instead of running in high precision (reentrant mode gave wrong
    gradients silently before)."""
    recipe = RECIPES["delayed"]
    model = _compile_blocks(checkpointed(base_model("cpu"), mode))
    with pytest.raises(RuntimeError, match="inside an eager torch.utils.checkpoint region that "
                       "ran under DelayedScaling"):
        train(model, recipe, "cpu", steps=1)
    assert te.autocast_depth() == 0
    from tequant import checkpoint as te_checkpoint
    assert te_checkpoint.STATEFUL_REPLAY is False
    torch._dynamo.reset()
