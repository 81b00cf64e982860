"""DDP and distributed checkpoints with te.Linear (issue 21; DISTRIBUTED.md 1, 2, 5).

Gloo ranks on CPU (tests/dist_util.py, every join with a timeout; one spawn of 2 ranks runs
the 2-rank cases, the checkpoint's loads onto 3 ranks and 1 a spawn each):
- DDP with no_sync gradient accumulation over two microbatches and is_first_microbatch (the
  cached quantized weight): each rank's outputs equal one process running the same model on
  that rank's data, bit for bit, and the gradients the ranks' mean of its accumulated ones;
- DelayedScaling with amax_reduction_group = the data-parallel group: every rank keeps identical
  histories and scales, through one all-reduce per update (the forward update at the autocast's
  exit, the backward update at the end of backward), however many modules;
- torch.distributed.checkpoint save / load (get_/set_model_state_dict, get_/set_optimizer_state_
  dict) of an FSDP2 model with quantized all-gather and DelayedScaling state: two more steps after
  a reload are bit-identical to the uninterrupted run's; the checkpoint of 2 ranks loads onto 3
  (uneven shards) and onto 1 (the whole weights, the DelayedScaling buffers), and training goes
  on there.
Code: python/tequant/distributed/, python/tequant/linear.py, delayed.py.
"""
import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from dist_util import run_ranks  # noqa: E402

import tequant as te  # noqa: E402
from tequant.recipe import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling  # noqa: E402

WIDTH = 64


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = te.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = te.Linear(4 * WIDTH, WIDTH)

    def forward(self, x, is_first_microbatch=None):
        h = F.gelu(self.fc1(x, is_first_microbatch=is_first_microbatch))
        return self.fc2(h, is_first_microbatch=is_first_microbatch)


def data(rank, step, micro):
    g = torch.Generator(torch.get_default_device()).manual_seed(  # (NCCL: the rank's GPU)
        10_000 * rank + 100 * step + micro)
    return torch.randn(3, 17, WIDTH, generator=g)


def ddp_worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    results = {}
    for name, recipe in (("current", Float8CurrentScaling()), ("nvfp4", NVFP4BlockScaling()),
                         ("delayed", DelayedScaling(amax_history_len=4))):
        torch.manual_seed(0)
        ref = MLP()
        model = DDP(copy.deepcopy(ref))
        group = dist.group.WORLD if name == "delayed" else None
        for step in range(2):
            outs, grads = [], []
            for m in (model, ref):
                torch.manual_seed(77 + step)  # the same stochastic-rounding draws in both
                ys = []
                for micro in range(2):  # gradient accumulation: no all-reduce on the first
                    with (model.no_sync() if m is model and micro == 0 else _null()):
                        with te.autocast(recipe=recipe, amax_reduction_group=group if m is model
                                         else None):
                            y = m(data(rank, step, micro), is_first_microbatch=micro == 0)
                        y.square().mean().backward()
                    ys.append(y.detach())
                outs.append(ys)
                grads.append([p.grad for p in m.parameters()])
            for want in grads[1]:  # what DDP does to the model's: the ranks' mean
                dist.all_reduce(want)
                want /= world
            if name != "delayed":  # the model's scales are reduced over the ranks, ref's not
                for a, b in zip(*outs):
                    assert torch.equal(a, b), (name, step)
                for got, want in zip(*grads):
                    err = float((got - want).norm() / want.norm())
                    assert err < 1e-6, (name, step, err)
            for m in (model, ref):
                with torch.no_grad():
                    for p in m.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
        results[name] = True
    return results


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def two_rank_cases(rank, world, folder):
    """Every 2-rank case of this file in one spawn (starting the ranks, importing torch and
    init_process_group cost more than a case): DDP, the DelayedScaling reduction, and the
    checkpoint saved for the loads onto 3 ranks and 1 (which need spawns of their own)."""
    return {"ddp": ddp_worker(rank, world),
            "delayed": delayed_reduction_worker(rank, world),
            "dcp_saved": dcp_save_worker(rank, world, folder)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    return folder, run_ranks(two_rank_cases, 2, folder, timeout=300)


def test_ddp_no_sync_microbatches_two_ranks(two_ranks):
    results = [r["ddp"] for r in two_ranks[1]]
    assert all(r == {"current": True, "nvfp4": True, "delayed": True} for r in results)


def delayed_reduction_worker(rank, world):
    """Each rank sees other data; with the group every rank's DelayedScaling state is the same
    after each step, and each update is one all-reduce (counted by wrapping it)."""
    calls = []
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(MLP(), MLP(), MLP())  # six modules, two updates a step
        recipe = DelayedScaling(amax_history_len=4)
        per_step = []
        for step in range(3):
            calls.clear()
            x = data(rank, step, 0) * (1 + rank)  # other amaxes on each rank
            with te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                y = model(x)
            y.square().mean().backward()
            per_step.append(list(calls))
            model.zero_grad(set_to_none=True)
    finally:
        dist.all_reduce = original
    state = torch.cat([b.reshape(-1) for b in model.buffers()])
    every = [torch.empty_like(state) for _ in range(world)]
    dist.all_gather(every, state)
    return per_step, all(torch.equal(s, state) for s in every)


def test_delayed_scaling_amax_reduction_one_collective_per_update(two_ranks):
    for per_step, same in (r["delayed"] for r in two_ranks[1]):
        assert same, "DelayedScaling state differs across ranks"
        # forward update: 6 modules x (x, w) = 12 amaxes; backward: 6 grad_output amaxes
        assert per_step == [[12, 6]] * 3, per_step


# ---- distributed checkpoints ---------------------------------------------------------------

RECIPE = DelayedScaling(amax_history_len=4)


def fsdp_model(seed=0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = torch.nn.Sequential(MLP(), MLP())
    te.distributed.enable_quantized_all_gather(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # CPU also beside a GPU
    for mlp in model:
        fully_shard(mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def fsdp_steps(model, opt, rank, first, count):
    losses = []
    for step in range(first, first + count):
        with te.autocast(recipe=RECIPE, amax_reduction_group=dist.group.WORLD):
            loss = model(data(rank, step, 0)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def full_state(model):
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def dcp_save_worker(rank, world, folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict)
    model, opt = fsdp_model()
    fsdp_steps(model, opt, rank, 0, 2)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=folder)
    saved = full_state(model)
    uninterrupted = fsdp_steps(model, opt, rank, 2, 2) + [full_state(model)]
    fresh, fresh_opt = fsdp_model(seed=123)  # other weights: the load must replace them all
    te.prepare_state(fresh, RECIPE)  # DelayedScaling's buffers, for DCP to load into
    state = {"model": get_model_state_dict(fresh),
             "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    reloaded = full_state(fresh)
    for k in saved:
        assert torch.equal(reloaded[k], saved[k]), k
    resumed = fsdp_steps(fresh, fresh_opt, rank, 2, 2) + [full_state(fresh)]
    for a, b in zip(resumed[:2], uninterrupted[:2]):
        assert torch.equal(a, b), "losses after the reload differ"
    for k in resumed[2]:
        assert torch.equal(resumed[2][k], uninterrupted[2][k]), k
    assert any(k.endswith("delayed_scale_fwd") for k in saved)
    return {k: v for k, v in saved.items()}


def dcp_load_worker(rank, world, folder, saved):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    model, opt = fsdp_model(seed=321)
    te.prepare_state(model, RECIPE)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    loaded = full_state(model)
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), (world, k)
    losses = fsdp_steps(model, opt, rank, 2, 1)
    assert torch.isfinite(losses[0])
    return True


def test_dcp_resume_bit_identical_and_other_world_sizes(two_ranks):
    folder, results = two_ranks  # saved by dcp_save_worker, which checked the resume
    saved = results[0]["dcp_saved"]
    for world in (3, 1):  # 3: uneven shards (64 and 256 rows over 3 ranks)
        assert all(run_ranks(dcp_load_worker, world, folder, saved, timeout=180))
