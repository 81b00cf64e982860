"""Copies and pickles of models holding te.Linear (issue 20).

copy.deepcopy, pickle and torch.save / torch.load of a whole model, before any step and after
steps under every recipe (with a cached quantized weight between microbatches), on CPU and CUDA:
the copy trains on bit-identically to the original (gradients, DelayedScaling state),
and its caches are its own (recipe plans rebuilt, the cached weight copied, never shared).
copy.copy gives a module with caches of its own; torch.optim.swa_utils.AveragedModel works on
a te model; QuantizerConfig pickles. The code: python/tequant/linear.py (__getstate__ /
__setstate__) and csrc/ext/registry.c (QuantizerConfig.__reduce__).
"""
import copy
import io
import os
import pickle
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import tequant as te  # noqa: E402
from test_checkpoint import DEVICES, RECIPES, assert_same, train  # noqa: E402

WIDTH = 64


class MLP(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.fc1 = te.Linear(WIDTH, 2 * WIDTH, device=device)
        self.fc2 = te.Linear(2 * WIDTH, WIDTH, device=device)

    def forward(self, x, is_first_microbatch=None):
        h = F.gelu(self.fc1(x, is_first_microbatch=is_first_microbatch))
        return self.fc2(h, is_first_microbatch=is_first_microbatch)


def save_load(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": save_load,
}


def microbatches(model, recipe, device, first, n, seed):
    """n steps of test_checkpoint.train, each one microbatch with is_first_microbatch=first."""
    return train(model, recipe, device, steps=n, seed=seed,
                 step_fn=lambda m, x: m(x, is_first_microbatch=first))


def storages(module):
    return {t.untyped_storage().data_ptr() for t in module._weight_cache[1] if t is not None}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_copy_trains_on_bit_identically(name, how, device):
    recipe, make = RECIPES[name], COPIES[how]
    torch.manual_seed(0)
    model = MLP(device)
    fresh = make(model)  # before any step
    assert_same(microbatches(fresh, recipe, device, None, 1, seed=1),
                microbatches(copy.deepcopy(model), recipe, device, None, 1, seed=1))
    microbatches(model, recipe, device, None, 2, seed=2)  # steps: plans, delayed state
    microbatches(model, recipe, device, True, 1, seed=3)  # the weight cache filled
    twin = make(model)
    plans = {id(p) for p in model.fc1._plans.values()}
    assert not plans & {id(p) for p in twin.fc1._plans.values()}  # rebuilt, not shared
    assert twin.fc1._weight_cache[0] == model.fc1._weight_cache[0]
    assert not storages(twin.fc1) & storages(model.fc1)  # a copy, not shared
    # the cached W is what the next microbatches (False) multiply with, also in the copy
    want = microbatches(model, recipe, device, False, 2, seed=4)
    got = microbatches(twin, recipe, device, False, 2, seed=4)
    assert_same(got, want)
    assert_same(microbatches(twin, recipe, device, None, 1, seed=5),
                microbatches(model, recipe, device, None, 1, seed=5))


@pytest.mark.parametrize("name", ["delayed", "mxfp8"])
def test_continuation_depends_on_the_copied_cache(name):
    """What makes the continuation above a test of the cache: W moved since it was cached
    (an SGD step, and for DelayedScaling the scales too), so a copy that re-quantized W instead
    of copying the cache would compute something else."""
    recipe = RECIPES[name]
    torch.manual_seed(0)
    model = MLP("cpu")
    microbatches(model, recipe, "cpu", True, 1, seed=1)
    twin = copy.deepcopy(model)
    twin.fc1._weight_cache.clear()
    twin.fc2._weight_cache.clear()
    want = microbatches(copy.deepcopy(model), recipe, "cpu", False, 1, seed=2)
    got = microbatches(twin, recipe, "cpu", False, 1, seed=2)
    assert not torch.equal(got[0], want[0])  # x's gradient


def test_shallow_copy_has_caches_of_its_own():
    torch.manual_seed(0)
    model = MLP("cpu")
    microbatches(model, RECIPES["delayed"], "cpu", True, 1, seed=1)
    twin = copy.copy(model.fc1)
    assert twin.weight is model.fc1.weight  # shallow: the same parameters
    assert twin._weight_cache is not model.fc1._weight_cache
    assert twin._plans is not model.fc1._plans
    twin._weight_cache.clear()
    assert model.fc1._weight_cache  # untouched
    x = torch.randn(4, WIDTH)
    with te.autocast(recipe=RECIPES["current"]):
        assert torch.equal(twin(x), model.fc1(x))


def test_averaged_model():
    """torch.optim.swa_utils.AveragedModel deep-copies the model and averages its parameters;
    under te.autocast it computes what a te model holding the averaged weights computes."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    torch.manual_seed(0)
    model = MLP("cpu")
    microbatches(model, RECIPES["current"], "cpu", None, 1, seed=1)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    snapshots = []
    for s in range(2):
        microbatches(model, RECIPES["current"], "cpu", None, 1, seed=2 + s)
        ema.update_parameters(model)
        snapshots.append([p.detach().clone() for p in model.parameters()])
    want = copy.deepcopy(model)
    with torch.no_grad():
        for i, p in enumerate(want.parameters()):
            avg = snapshots[0][i]  # the first update copies, later ones average
            for snap in snapshots[1:]:
                avg = 0.5 * avg + 0.5 * snap[i]
            p.copy_(avg)
    x = torch.randn(2, 19, WIDTH)
    for p, q in zip(ema.module.parameters(), want.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
        q.data.copy_(p)
    for name in ("current", "delayed", "nvfp4"):
        with te.autocast(recipe=RECIPES[name]):
            assert torch.equal(ema(x), want(x)), name


def test_quantizer_config_pickles():
    for recipe in RECIPES.values():
        for role in ("input", "weight", "grad_output"):
            q = te.quantizer_config(recipe, role)
            for again in (pickle.loads(pickle.dumps(q)), copy.deepcopy(q), copy.copy(q)):
                assert again == q and repr(again) == repr(q)
