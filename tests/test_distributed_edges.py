"""Tensor / sequence parallelism and FSDP2 at their edges (gloo, two CPU ranks spawned by
dist_util.run_ranks): each case gives the bits the plain layout gives, or a clear error.

- Row-parallel sequence-parallel te.Linear whose input needs no gradient (wgrad only): per-tensor
  FP8 gathers grad_output's rowwise codes (the columnwise ones are derived), NVFP4's columnwise
  members count their rows two a byte (csrc/ext/linear.c); dW equals the dx-asking run's.
- NVFP4 column-parallel sequence parallelism at 16 tokens a rank (one scale column each: the
  gathered scale_inv_t made contiguous, distributed/gather_layout.py).
- reduce_sequence_parallel_grads finds the sequence-parallel norm parameters under FSDP2 (by
  name on their modules: FSDP2 replaces the parameters and their attributes).
- FSDP2's quantized all-gather of 1-D NVFP4 weights under activation checkpointing (the
  re-gather holds one amax of the two: either is W's).
- is_first_microbatch on a weight gathered quantized under DelayedScaling: NotImplementedError.
- tequant's ColwiseParallel on a DTensor input with unequal token shards: a ValueError (the
  gathers would differ in size: gloo aborted the ranks).
"""
import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import tequant as te  # noqa: E402
from dist_util import run_ranks  # noqa: E402
from tequant.recipe import (DelayedScaling, Float8CurrentScaling,  # noqa: E402
                            NVFP4BlockScaling)

RECIPES = {"current": Float8CurrentScaling(), "delayed": DelayedScaling(),
           "nvfp4": NVFP4BlockScaling(disable_stochastic_rounding=True)}


def _row_sp_wgrad(rank, world, name):
    g = dist.group.WORLD
    grads = []
    for needs_dx in (True, False):
        torch.manual_seed(0)
        layer = te.Linear(64, 64, tp_group=g, parallel_mode="row", sequence_parallel=True)
        torch.manual_seed(1 + rank)
        x = torch.randn(64, 1, 32).requires_grad_(needs_dx)  # this rank's 32 of 64 features
        dy = torch.randn(32, 1, 64)  # this rank's 32 of 64 tokens
        with te.autocast(recipe=RECIPES[name]):
            y = layer(x)
        y.backward(dy)
        grads.append((layer.weight.grad, layer.bias.grad))
    return all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("name", list(RECIPES))
def test_row_sequence_parallel_wgrad_only(name):
    assert all(run_ranks(_row_sp_wgrad, 2, name))


def _nvfp4_sp_16_tokens(rank, world):
    g = dist.group.WORLD
    torch.manual_seed(0)
    sp = te.Linear(64, 64, tp_group=g, parallel_mode="column", sequence_parallel=True)
    plain = te.Linear(64, 64, tp_group=g, parallel_mode="column")
    plain.load_state_dict(sp.state_dict())
    torch.manual_seed(1 + rank)
    x = torch.randn(16, 1, 64)  # this rank's 16 tokens: one NVFP4 scale column
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    with te.autocast(recipe=recipe):
        y_sp, y_plain = sp(x), plain(torch.cat(parts))
    y_sp.square().sum().backward()  # wgrad reads the gathered x's columnwise members
    y_plain.square().sum().backward()
    return (torch.equal(y_sp, y_plain) and torch.equal(sp.weight.grad, plain.weight.grad)
            and torch.equal(sp.bias.grad, plain.bias.grad))


def test_nvfp4_sequence_parallel_16_tokens_a_rank():
    assert all(run_ranks(_nvfp4_sp_16_tokens, 2))


class _Pair(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.fc1 = te.LayerNormLinear(64, 128, tp_group=group, parallel_mode="column",
                                      sequence_parallel=True)
        self.fc2 = te.Linear(128, 64, tp_group=group, parallel_mode="row", sequence_parallel=True)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _sp_norm_grads_under_fsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    g = dist.group.WORLD
    torch.manual_seed(0)
    ref = _Pair(g)
    with torch.no_grad():
        ref.fc1.layer_norm_weight.normal_()
        ref.fc1.layer_norm_bias.normal_()
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))["dp"])
    torch.manual_seed(4 + rank)
    x = torch.randn(8, 2, 64)
    for m in (model, ref):
        with te.autocast(recipe=Float8CurrentScaling()):
            y = m(x)
        y.square().mean().backward()
        te.distributed.reduce_sequence_parallel_grads(m, g)
    return {n: torch.equal(_local(p.grad), q.grad)
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}


def test_sequence_parallel_norm_grads_are_reduced_under_fsdp2():
    for result in run_ranks(_sp_norm_grads_under_fsdp, 2):
        assert all(result.values()), result


def _fsdp_nvfp4_1d_checkpointed(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    recipe = NVFP4BlockScaling(disable_2d_quantization=True, disable_stochastic_rounding=True)
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(te.Linear(64, 64), te.Linear(64, 64))
        te.distributed.enable_quantized_all_gather(model)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.manual_seed(1 + rank)
        x = torch.randn(32, 64)
        with te.autocast(recipe=recipe):
            y = (torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False) if ckpt
                 else model(x))
        y.square().mean().backward()
        grads.append([_local(p.grad) for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


def test_fsdp2_quantized_gather_of_1d_nvfp4_weights_under_checkpointing():
    assert all(run_ranks(_fsdp_nvfp4_1d_checkpointed, 2))


def _message(call, error):
    """The message of the `error` call() raises (None: it raised none)."""
    try:
        call()
    except error as e:
        return str(e)
    return None


def _delayed_microbatches_on_a_quantized_gather(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    layer = te.Linear(64, 64)
    te.distributed.enable_quantized_all_gather(layer)
    fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))

    def step():
        with te.autocast(recipe=DelayedScaling()):
            layer(torch.randn(8, 64), is_first_microbatch=True)
    return _message(step, NotImplementedError)


def test_delayed_is_first_microbatch_on_a_quantized_gather_raises():
    for message in run_ranks(_delayed_microbatches_on_a_quantized_gather, 2):
        assert message is not None and "is_first_microbatch" in message


def _uneven_dtensor_tokens(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    layer = parallelize_module(te.Linear(32, 64), mesh,
                               te.distributed.ColwiseParallel(input_layouts=Shard(0)))
    x = distribute_tensor(torch.randn(7, 2, 32), mesh, [Shard(0)])  # 4 and 3 tokens
    return _message(lambda: layer(x), ValueError)


def test_uneven_token_shards_of_a_dtensor_input_raise():
    for message in run_ranks(_uneven_dtensor_tokens, 2):
        assert message is not None and "not a multiple of the 2 ranks" in message
