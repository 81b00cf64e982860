"""FSDP2 with te.Linear weights all-gathered quantized (issue 21; DISTRIBUTED.md 1, 2, 5).

Gloo ranks on CPU (tests/dist_util.py: spawned inside pytest, every join with a timeout), 2 and 4
ranks, and 3 for uneven shards; one CUDA rank with NCCL on the GPU machine. Per recipe, with and
without MixedPrecisionPolicy(param_dtype=bf16), reshard_after_forward True and False, blocks with
and without activation checkpointing:
- the all-gathered weight (te.Linear's GatheredWeight members, both directions) equals
  te.ops.quantize of the whole weight in the forward's dtype, bit for bit;
- each rank's output equals, bit for bit, one process running the same model (not sharded) on
  that rank's data, for three steps; gradients equal the ranks' mean of that process's
  gradients within the reduce-scatter's summation order (NVFP4's stochastic rounding replayed
  from the same generator state);
- bytes all-gathered per forward (torch.distributed's all-gather functions wrapped and counted)
  <= 0.55x of the bf16-parameter gather for the FP8 recipes, <= 0.3x for NVFP4;
- outside te.autocast (before, between and after quantized steps) the gather is high precision
  and the outputs are those of the same model without enable_quantized_all_gather;
- shards that would cut a format's blocks, and uneven shards, gather in high precision (counted)
  or, for per-tensor FP8, quantized with a padded last shard; outputs stay exact;
- the weights change between steps (doubled: a stale amax would saturate codes), and the
  per-tensor recipes reduce the whole weights' amaxes with one all-reduce per fully_shard module
  and forward, not one per weight;
- each block compiled (nn.Module.compile before fully_shard, compile_worker): per-tensor FP8
  (current, delayed) traces the gathered weight with fullgraph=True (no graph break), outputs,
  gradients and DelayedScaling's buffers bit-identical to the eager sharded run over three steps
  with an optimizer step between; MXFP8 runs it eagerly behind a graph break, same bits.
Code: python/tequant/distributed/fsdp.py, gather_layout.py; linear.py's quantized-weight path;
_compile_gathered.py.
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
from tequant.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,  # noqa: E402
                            MXFP8BlockScaling, NVFP4BlockScaling)

RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
}
BYTES_BOUND = {"delayed": 0.55, "current": 0.55, "block": 0.55, "mxfp8": 0.55, "nvfp4": 0.3}


class Block(torch.nn.Module):
    def __init__(self, width, hidden, device):
        super().__init__()
        self.fc1 = te.Linear(width, hidden, device=device)
        self.fc2 = te.Linear(hidden, width, device=device)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Model(torch.nn.Module):
    def __init__(self, device, width=256, hidden=512, checkpointed=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width, hidden, device) for _ in range(2)])
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            x = (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
                 if self.checkpointed else block(x))
        return x


class GatherBytes:
    """Counts the bytes each rank sends through torch.distributed's all-gather functions."""

    NAMES = ("all_gather_into_tensor", "all_gather_single")

    def __init__(self):
        self.sent = 0
        self.saved = {}
        for name in self.NAMES:
            if hasattr(dist, name):
                self.saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(self.saved[name]))

    def _wrap(self, orig):
        def counted(output, inp, *args, **kwargs):
            self.sent += inp.numel() * inp.element_size()
            return orig(output, inp, *args, **kwargs)
        return counted

    def restore(self):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def sharded(model, *, reshard, dtype, enable=True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = copy.deepcopy(model)
    if enable:
        te.distributed.enable_quantized_all_gather(model)
    device_type = next(model.parameters()).device.type  # a CPU model stays on CPU beside a GPU
    kwargs = {"reshard_after_forward": reshard,
              "mesh": init_device_mesh(device_type, (dist.get_world_size(),))}
    if dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def compact(recipe, members, n, k, dtype, direction):
    """(codes, scales) of one direction, compact, as a QuantizedTensor gives them."""
    q = te.QuantizedTensor(te.quantizer_config(recipe, "weight"), (n, k), dtype, tuple(members),
                           recipe, "weight")
    return q.codes(direction), q.scales(direction)


def check_gathered(model, ref, recipe, dtype):
    """reshard_after_forward=False: after a forward, each te.Linear holds its gathered weight."""
    for (name, mod), ref_mod in zip(
            ((n, m) for n, m in model.named_modules() if isinstance(m, te.Linear)),
            (m for m in ref.modules() if isinstance(m, te.Linear))):
        w = mod.weight
        assert isinstance(w, te.distributed.GatheredWeight), (name, type(w))
        full = ref_mod.weight.detach().to(dtype)
        kwargs = {}
        if recipe.delayed():
            kwargs["scale"] = mod.delayed_scale_fwd[1:2]  # what the forward cast W with
        want = te.ops.quantize(full, recipe, "weight", rowwise=True, columnwise=True, **kwargs)
        n, k = full.shape
        for usage, direction in ((1, "rowwise"), (2, "columnwise")):
            got = compact(recipe, w.tq_kept(usage), n, k, dtype, direction)
            for a, b in zip(got, (want.codes(direction), want.scales(direction))):
                assert torch.equal(a, b), (name, direction)


class AllReduces:
    """Counts torch.distributed.all_reduce calls."""

    def __init__(self):
        self.calls, self.saved = 0, dist.all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return self.saved(*args, **kwargs)
        dist.all_reduce = counted

    def restore(self):
        dist.all_reduce = self.saved


def run_steps(rank, world, recipe, model, ref, *, autocast_steps, dtype, counter, check):
    """Steps of model (sharded) and ref (whole) on this rank's data, the weights of both doubled
    after each step (a whole weight's amax moves; codes quantized with a stale one would
    saturate); returns the bytes gathered in each step's forward and the all-reduces each
    forward made."""
    sent, reductions = [], []
    for step, quantized in enumerate(autocast_steps):
        torch.manual_seed(1000 + 17 * step + rank)
        x = torch.randn(2, 24, model.blocks[0].fc1.in_features, dtype=dtype or torch.float32,
                        device=model.blocks[0].fc1.bias.device)
        outs, grads = [], []
        for m in (model, ref):
            torch.manual_seed(5000 + step)  # the same stochastic-rounding draws in both
            counter.sent = 0
            calls = AllReduces()
            try:
                with te.autocast(recipe=recipe) if quantized else te.autocast(enabled=False):
                    y = m(x)
                    if m is model and check is not None and quantized:
                        check(m)  # before the exit moves DelayedScaling's scales
            finally:
                calls.restore()
            if m is model:
                sent.append(counter.sent)
                reductions.append(calls.calls)
            y.float().square().mean().backward()
            outs.append(y.detach())
            grads.append([p.grad for p in m.parameters()])
        assert torch.equal(outs[0], outs[1]), (recipe, step, "forward differs")
        for got, want in zip(*grads):
            want = want.float().clone()
            dist.all_reduce(want)
            want /= world
            got = got.full_tensor().float()
            err = float((got - want).norm() / want.norm().clamp_min(1e-30))
            assert err < (2e-2 if dtype is torch.bfloat16 else 1e-5), (recipe, step, err)
        for m in (model, ref):
            for p in m.parameters():
                p.grad = None
            with torch.no_grad():
                for p in m.parameters():
                    p.mul_(2.0)  # exact in every dtype: the sharded and whole weights stay equal
    return sent, reductions


def fsdp_worker(rank, world, names, configs, device_type, width=256, hidden=512):
    device = torch.device(device_type, rank if device_type == "cuda" else 0)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    counter = GatherBytes()
    report = {}
    try:
        for name in names:
            recipe = RECIPES[name]
            for reshard, dtype, checkpointed in configs:
                torch.manual_seed(0)
                base = Model(device, width=width, hidden=hidden, checkpointed=checkpointed)
                ref = copy.deepcopy(base).to(dtype) if dtype is not None else copy.deepcopy(base)
                model = sharded(base, reshard=reshard, dtype=dtype)
                check = None if reshard else (
                    lambda m, r=ref: check_gathered(m, r, recipe, dtype or torch.float32))
                sent, reductions = run_steps(
                    rank, world, recipe, model, ref, dtype=dtype, counter=counter,
                    autocast_steps=(False, True, True, False, True), check=check)
                report[(name, reshard, str(dtype), checkpointed)] = sent
                # the per-tensor recipes' whole-weight amaxes: one all-reduce per fully_shard
                # module that gathers (the two blocks), none outside te.autocast or on one rank
                per_tensor = name in ("delayed", "current", "nvfp4") and world > 1
                want = [2 if per_tensor and q else 0 for q in (False, True, True, False, True)]
                assert reductions == want, (name, reshard, dtype, reductions)
        report["fallbacks"] = dict(te.distributed.fallbacks)
    finally:
        counter.restore()
    return report


def check_bytes(report, names):
    for key, sent in report.items():
        if key == "fallbacks":
            continue
        name, reshard, dtype = key[:3]
        hp = sent[0]  # outside te.autocast: the parameter dtype
        scale = 0.5 if dtype == "None" else 1.0  # bytes of a bf16 gather
        for quantized in (sent[1], sent[2], sent[4]):
            ratio = quantized / (hp * scale)
            bound = BYTES_BOUND[name] if reshard or name != "mxfp8" else 1.1
            assert ratio <= bound, (key, ratio)
        assert sent[3] == hp, key  # high precision again after quantized steps


def test_fsdp_two_ranks_every_recipe():
    configs = [(True, torch.bfloat16, False), (False, None, False), (True, None, True),
               (False, torch.bfloat16, True)]
    reports = run_ranks(fsdp_worker, 2, list(RECIPES), configs, "cpu", timeout=300)
    check_bytes(reports[0], RECIPES)
    assert reports[0]["fallbacks"] == {}


def test_fsdp_four_ranks():
    configs = [(True, torch.bfloat16, True)]  # the 2-rank test covers the other settings
    reports = run_ranks(fsdp_worker, 4, ["current", "nvfp4"], configs, "cpu", timeout=300)
    check_bytes(reports[0], ["current", "nvfp4"])


def uneven_worker(rank, world):
    """3 ranks: hidden 80 splits 27/27/26 rows (per-tensor FP8 travels quantized from a padded
    last shard), hidden 96 splits 32/32/32 (MXFP8 quantized; FP8 blocks of 128 cut: high
    precision) while the 64-row weights split unevenly (block formats: high precision)."""
    counter = GatherBytes()
    sent = {}
    try:
        for name, hidden in (("current", 80), ("delayed", 80), ("mxfp8", 96), ("block", 96)):
            torch.manual_seed(0)
            base = Model("cpu", width=64, hidden=hidden)
            ref = copy.deepcopy(base)
            model = sharded(base, reshard=True, dtype=None)
            sent[name], _ = run_steps(rank, world, RECIPES[name], model, ref, dtype=None,
                                      counter=counter, autocast_steps=(False, True), check=None)
    finally:
        counter.restore()
    return sent, dict(te.distributed.fallbacks)


def test_fsdp_uneven_shards_three_ranks():
    (sent, fallbacks), *_ = run_ranks(uneven_worker, 3, timeout=240)
    for name in ("current", "delayed"):
        assert sent[name][1] < 0.55 * sent[name][0], (name, sent[name])
    assert any("do not split evenly" in reason for reason in fallbacks), fallbacks
    assert any("cut the format's 128-row blocks" in reason for reason in fallbacks), fallbacks
    assert sent["mxfp8"][1] < sent["mxfp8"][0]  # its 96-row weights travel quantized
    assert sent["block"][1] == sent["block"][0]  # none of its weights can


def compiled_steps(name, fullgraph, reshard, dtype, steps=3, backend="aot_eager", device="cpu",
                   checkpointed=False, amax_group=False):
    """Each block compiled (nn.Module.compile; te.autocast around the model, outside the
    compiled code) with the quantized all-gather, against the same sharded model run eagerly:
    outputs, gradients and buffers (DelayedScaling's histories and scales) bit for bit over
    `steps` steps with an optimizer step between (FSDP2 refills its all-gather buffers and
    unsharded parameters in place). amax_group: DelayedScaling's amaxes all-reduced over the
    ranks (the compiled backward queues its updates for one all-reduce at the end of the
    backward pass, eager's one). Returns Dynamo's graph-break counter."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    recipe = RECIPES[name]
    torch.manual_seed(0)
    base = Model(device, width=64, hidden=256, checkpointed=checkpointed)
    eager = sharded(base, reshard=reshard, dtype=dtype)
    compiled = sharded(base, reshard=reshard, dtype=dtype)
    for block in compiled.blocks:
        block.compile(backend=backend, fullgraph=fullgraph)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, compiled)]
    for step in range(steps):
        outs, grads = [], []
        for model in (eager, compiled):
            torch.manual_seed(100 + 7 * step + dist.get_rank())
            x = torch.randn(2, 24, 64, dtype=dtype or torch.float32, device=device)
            with te.autocast(recipe=recipe,
                             amax_reduction_group=dist.group.WORLD if amax_group else None):
                y = model(x)
            y.float().square().mean().backward()
            outs.append(y.detach())
            grads.append([p.grad.to_local() for p in model.parameters()])
        assert torch.equal(*outs), (name, step)
        for i, (a, b) in enumerate(zip(*grads)):
            assert torch.equal(a, b), (name, step, i)
        buffers = list(zip(eager.named_buffers(), compiled.buffers()))
        assert bool(buffers) == recipe.delayed(), name
        for (bname, a), b in buffers:
            assert torch.equal(a, b), (name, step, bname)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return dict(counters["graph_break"])


def compile_worker(rank, world):
    """Per-tensor FP8 (current, delayed): the gathered weight is traced (fullgraph=True, no
    graph break), with and without resharding after forward, in float32 and bfloat16. MXFP8:
    its gathered weight runs eagerly at a graph break, with eager's bits, and fullgraph=True
    refuses with the reason."""
    for name in ("current", "delayed"):
        for reshard, dtype in ((True, None), (False, torch.bfloat16)):
            breaks = compiled_steps(name, True, reshard, dtype)
            assert breaks == {}, (name, breaks)
    breaks = compiled_steps("delayed", True, True, None, steps=2, amax_group=True)
    assert breaks == {}, breaks
    # each compiled block inside an eager torch.utils.checkpoint (non-reentrant): the
    # recompute re-enters the forward's te.autocast and traces the gathered weight again
    breaks = compiled_steps("current", True, True, None, steps=2, checkpointed=True)
    assert breaks == {}, breaks
    breaks = compiled_steps("mxfp8", False, True, None, steps=2)
    assert any("quantized all-gather" in reason for reason in breaks), breaks
    torch._dynamo.reset()
    strict = sharded(Model("cpu", width=64, hidden=256), reshard=True, dtype=None)
    strict.blocks[0].compile(backend="aot_eager", fullgraph=True)
    try:
        with te.autocast(recipe=RECIPES["mxfp8"]):
            strict(torch.randn(2, 24, 64))
    except Exception as e:  # Dynamo's Unsupported, quoting the reason
        assert "quantized all-gather" in str(e), str(e)[-2000:]
    else:
        raise AssertionError("fullgraph=True compiled a te.Linear on an MXFP8 gathered weight")
    return True


def test_fsdp_compiled_blocks_with_quantized_gather():
    assert run_ranks(compile_worker, 2, timeout=400) == [True] * 2


def fsdp_worker_cuda(rank, world, names, configs):
    return fsdp_worker(rank, world, names, configs, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fsdp_cuda_nccl_one_rank():
    """World size 1 on one GPU with NCCL: the code path on CUDA (the quantized payload, FSDP2's
    one-rank copy of it, the GatheredWeight, te.Linear's use of it), every recipe."""
    configs = [(True, torch.bfloat16, True), (False, None, False)]
    report = run_ranks(fsdp_worker_cuda, 1, list(RECIPES), configs, timeout=300,
                       backend="nccl")[0]
    assert report.pop("fallbacks") == {}
    assert all(sent == [0] * 5 for sent in report.values())  # one rank: FSDP2 gathers nothing


def no_sync_worker(rank, world, names):
    """Training steps of a bf16 model with the quantized gather under CUDA's sync debug mode
    "error": a host-device synchronization anywhere in the forward and backward (an .item(), a
    copy from pageable memory, a list index) raises, naming the op. A sync per module stalls
    FSDP2's prefetch pipeline: the GPU idles while the host queues the next work."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    for name in names:
        torch.manual_seed(0)
        model = sharded(Model(device, width=256, hidden=512), reshard=True, dtype=torch.bfloat16)
        x = torch.randn(64, 256, device=device)
        for step in range(3):  # the first step sets up (plans, buffers) and may synchronize
            torch.cuda.set_sync_debug_mode("error" if step else "default")
            try:
                with te.autocast(recipe=RECIPES[name]):
                    loss = model(x).float().pow(2).mean()
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for p in model.parameters():
                p.grad = None
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quantized_gather_steps_never_synchronize_the_host():
    assert run_ranks(no_sync_worker, 1, ["current", "delayed", "block"], timeout=300,
                     backend="nccl") == [True]


def test_fsdp_one_rank_cpu():
    """World size 1 on CPU: FSDP2 copies the first all-gather input alone; the quantized
    payload's other members travel in the metadata."""
    configs = [(False, None, False)]
    report = run_ranks(fsdp_worker, 1, ["block", "mxfp8", "nvfp4"], configs, "cpu",
                       timeout=120)[0]
    assert report.pop("fallbacks") == {}
