"""te.Linear under DTensor tensor parallelism: torch's styles and tequant's (issue 22 item 2).

Gloo ranks on CPU (tests/dist_util.py, every join with a timeout; one spawn of 2 ranks and one
of 4 run every case of the file). A column-then-row pair of te.Linear, parallelized with
parallelize_module, against the same pair in TransformerEngine's form (te.Linear(tp_group,
parallel_mode, sequence_parallel), itself tested against one process in
tests/test_tensor_parallel.py), every recipe and high precision, without sequence parallelism
and with it along dim 0 ([s, b, h]) and dim 1 ([b, s, h]) (without it the sequence dim plays no
part: tested once); two steps for DelayedScaling (the second on updated scales):
- tequant's ColwiseParallel / RowwiseParallel: output, input gradient and every parameter
  gradient bit-identical (the same quantized collectives: codes + scales move);
- torch's styles (their collectives in high precision, te.Linear on the local tensors): the same
  within fp32 summation order (the row bias is a DTensor add);
- torch's SequenceParallel on a te.Linear: one process's output per token shard, Partial
  parameter gradients;
- a 2-D mesh (dp 2 x tp 2, 4 ranks): FSDP2 over tequant's styles, with and without the quantized
  all-gather, forward bit-identical to the TP-only pair on the rank's batch, gradients the dp
  mean of the TP-only pair's;
- TransformerEngine's form under FSDP2: reduce_sequence_parallel_grads sums the row bias's
  DTensor gradient (found through its module: FSDP2 replaces the parameter);
- clear errors: a module that is not te.Linear, a 2-D mesh, a feature-sharded column input, a
  Partial output layout, a layer parallelized twice.
Code: python/tequant/distributed/dtensor.py, tensor_parallel.py, linear.py.
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
from test_compile import RECIPES  # noqa: E402  (DelayedScaling with a 4-row history)

K, N, TOKENS = 64, 128, 256  # 2 ranks: runs of 128 tokens, whole 1-D FP8 blocks


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


class Pair(torch.nn.Module):
    """fc1 (column) then fc2 (row); kw: TransformerEngine's TP arguments for both, or none."""

    def __init__(self, **kw):
        super().__init__()
        self.fc1 = te.Linear(K, N, **({**kw, "parallel_mode": "column"} if kw else {}))
        self.fc2 = te.Linear(N, K, **({**kw, "parallel_mode": "row"} if kw else {}))

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def whole_pair(seed=0):
    torch.manual_seed(seed)
    pair = Pair()
    with torch.no_grad():
        pair.fc1.bias.normal_()
        pair.fc2.bias.normal_()
    return pair


def te_mode_pair(whole, rank, world, sp, dim):
    pair = Pair(tp_group=dist.group.WORLD, sequence_parallel=sp)
    for layer in (pair.fc1, pair.fc2):
        layer._tp.dim = dim  # TE's [s, b, h] splits dim 0; the styles may pick another
    with torch.no_grad():
        pair.fc1.weight.copy_(whole.fc1.weight.chunk(world, 0)[rank])
        pair.fc1.bias.copy_(whole.fc1.bias.chunk(world, 0)[rank])
        pair.fc2.weight.copy_(whole.fc2.weight.chunk(world, 1)[rank])
        pair.fc2.bias.copy_(whole.fc2.bias)
    return pair


def styled_pair(whole, mesh, styles, sp, dim):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module
    if styles == "tequant":
        col, row = te.distributed.ColwiseParallel, te.distributed.RowwiseParallel
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel as col
        from torch.distributed.tensor.parallel import RowwiseParallel as row
    plan = ({"fc1": col(input_layouts=Shard(dim)), "fc2": row(output_layouts=Shard(dim))}
            if sp else {"fc1": col(), "fc2": row()})
    return parallelize_module(copy.deepcopy(whole), mesh, plan)


def local(t):
    """A gradient's local tensor (Partial ones summed: what the optimizer applies)."""
    if t is None or not hasattr(t, "placements"):
        return t
    return t.full_tensor() if t.placements[0].is_partial() else t.to_local()


def fwd_bwd(model, x, dy, recipe, seed):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    with te.autocast(recipe=recipe) if recipe is not None else te.autocast(enabled=False):
        y = model(x)
    y.backward(dy)
    if model.fc2.sequence_parallel:  # TE's form needs it, and the styles' biases it leaves
        te.distributed.reduce_sequence_parallel_grads(model, dist.group.WORLD)
    grads = [local(p.grad) for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return [y.detach(), x.grad] + grads


def styles_worker(rank, world, names):
    """Per recipe: without sequence parallelism (the sequence dim plays no part there, so once,
    [s, b, h]), and with it along dim 0 and along dim 1. Two steps for DelayedScaling (the
    second uses the scales the first updated); the other recipes keep no state between steps
    (the weights do not change here), so one."""
    from torch.distributed.device_mesh import init_device_mesh
    from tequant.distributed import tensor_parallel
    mesh = init_device_mesh(torch.get_default_device().type, (world,))  # (NCCL: cuda)
    whole = whole_pair()
    errors = {}
    for dim in (0, 1):
        torch.manual_seed(5 + dim)
        shape = (TOKENS, 2, K) if dim == 0 else (2, TOKENS, K)
        x, dy = torch.randn(shape), torch.randn(shape)
        for name in names:
            recipe = RECIPES.get(name)
            for sp in ((False, True) if dim == 0 else (True,)):
                x_in = x.chunk(world, dim)[rank].contiguous() if sp else x
                dy_in = dy.chunk(world, dim)[rank].contiguous() if sp else dy
                for styles in ("tequant", "torch"):
                    reference = te_mode_pair(whole, rank, world, sp, dim)
                    model = styled_pair(whole, mesh, styles, sp, dim)
                    before = sum(tensor_parallel.fallbacks.values())
                    for s in range(2 if name == "delayed" else 1):
                        got = fwd_bwd(model, x_in, dy_in, recipe, seed=70 + s)
                        want = fwd_bwd(reference, x_in, dy_in, recipe, seed=70 + s)
                        for i, (a, b) in enumerate(zip(got, want)):
                            what = (dim, name, sp, styles, s, i)
                            assert a.shape == b.shape, (what, a.shape, b.shape)
                            if styles == "tequant":
                                assert torch.equal(a, b), (what, rel(a, b))
                            else:
                                errors[what] = rel(a, b)
                                assert errors[what] < 1e-6, (what, errors[what])
                    if styles == "tequant" and world == 2 and name not in ("fp32", "nvfp4"):
                        assert sum(tensor_parallel.fallbacks.values()) == before, name
    return errors


# ---- the spawns: one per world size -------------------------------------------------------
# Starting the ranks (a process each, `import torch`, init_process_group) costs more than most
# cases, so each world size is spawned once per session and runs every case of this file for
# it, in order; the tests below check their parts of the results. A rank that raises fails each
# test of its spawn with the rank's traceback (the assertion messages name the case).

FOUR_RANK_FSDP = [("current", False), ("mxfp8", False),
                  # DelayedScaling's scale changes between the steps: what caught a stale
                  # quantized gather
                  ("current", True), ("delayed", True), ("mxfp8", True)]


def two_rank_cases(rank, world):
    return {"styles": styles_worker(rank, world, ["fp32", *RECIPES]),
            "sequence_parallel": sequence_parallel_worker(rank, world),
            "fsdp_te_form": fsdp_te_form_worker(rank, world),
            "errors": errors_worker(rank, world)}  # last: its cases leave modules half set up


def four_rank_cases(rank, world):
    results = {"styles": styles_worker(rank, world, ["current", "nvfp4"])}
    for name, quantized_gather in FOUR_RANK_FSDP:
        results[name, quantized_gather] = fsdp_tp_worker(rank, world, name, quantized_gather)
    return results


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(two_rank_cases, 2, timeout=400)


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(four_rank_cases, 4, timeout=500)


@pytest.mark.parametrize("world", [2, 4])
def test_styles_match_transformer_engine_form(world, request):
    # every recipe and fp32 on 2 ranks; 4 ranks: shards of 64 tokens, current and nvfp4
    for results in request.getfixturevalue("two_ranks" if world == 2 else "four_ranks"):
        errors = results["styles"]  # torch's own styles against TE's form (tequant's: exact)
        assert errors and all(err < 1e-6 for err in errors.values()), errors


def fsdp_tp_worker(rank, world, name, quantized_gather):
    """FSDP2 over dp x TP styles on a 2x2 mesh against the TP-only pair on this dp rank's
    batch: forward bit-identical, gradients the mean over dp, also after the weights change
    (each step's gather brings that step's weight)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(torch.get_default_device().type, (2, 2),
                            mesh_dim_names=("dp", "tp"))  # (NCCL: cuda)
    dp_rank, tp_rank = rank // 2, rank % 2
    recipe = RECIPES.get(name)
    whole = whole_pair()
    model = styled_pair(whole, mesh["tp"], "tequant", True, 0)
    if quantized_gather:
        te.distributed.enable_quantized_all_gather(model)
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    seen = []  # the type of the weight's local tensor fc1 computes with
    model.fc1.register_forward_pre_hook(
        lambda m, args: seen.append(type(m.weight._local_tensor).__name__))
    reference = styled_pair(whole, mesh["tp"], "tequant", True, 0)
    torch.manual_seed(9)
    x, dy = torch.randn(2, TOKENS, 2, K), torch.randn(2, TOKENS, 2, K)
    x_in = x[dp_rank].chunk(2, 0)[tp_rank].contiguous()
    dy_in = dy[dp_rank].chunk(2, 0)[tp_rank].contiguous()
    for s in range(2):
        if s:  # new weights, as an optimizer step gives: the next gather must carry them
            with torch.no_grad():
                for p in (*model.parameters(), *reference.parameters()):
                    p.mul_(1.5)
        got = fwd_bwd(model, x_in, dy_in, recipe, seed=80 + s)
        want = fwd_bwd(reference, x_in, dy_in, recipe, seed=80 + s)
        assert torch.equal(got[0], want[0]), (name, s, rel(got[0], want[0]))
        assert torch.equal(got[1], want[1]), (name, s, "dx")
        for i, (a, b) in enumerate(zip(got[2:], want[2:])):
            b = b.clone()
            dist.all_reduce(b, group=mesh["dp"].get_group())
            b /= 2
            b = b.chunk(2, 0)[dp_rank]  # FSDP2's dp shard of it
            assert rel(a, b) < 1e-6, (name, s, i, rel(a, b))
    # per-tensor FP8: the subclass torch.compile traces (fsdp.TraceableGatheredWeight)
    gathered = ("Tensor" if not quantized_gather else "TraceableGatheredWeight"
                if name in ("current", "delayed") else "GatheredWeight")
    assert seen == [gathered] * 2 and not te.distributed.fallbacks, (seen, te.distributed.fallbacks)
    return True


@pytest.mark.parametrize("quantized_gather", [False, True])
def test_fsdp2_over_tensor_parallel_2d_mesh(quantized_gather, four_ranks):
    cases = [(n, q) for n, q in FOUR_RANK_FSDP if q == quantized_gather]
    assert len(cases) == (3 if quantized_gather else 2)
    for results in four_ranks:
        assert all(results[case] is True for case in cases), results


def sequence_parallel_worker(rank, world):
    """torch's SequenceParallel on a te.Linear (a replicated W on token-sharded input): each
    rank's output is one process's te.Linear on its tokens, the gradients of W and b Partial,
    summing to the ranks' sum."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    x, dy = torch.randn(TOKENS, 2, K), torch.randn(TOKENS, 2, N)
    x_local, dy_local = x.chunk(world, 0)[rank], dy.chunk(world, 0)[rank]
    for recipe in (None, RECIPES["current"], RECIPES["mxfp8"]):
        one = whole_pair().fc1
        layer = parallelize_module(copy.deepcopy(one), mesh, SequenceParallel(sequence_dim=0))
        with te.autocast(recipe=recipe) if recipe is not None else te.autocast(enabled=False):
            y = layer(x_local)
            y_one = one(x_local)
        assert y.placements[0].is_shard(0) and torch.equal(y.to_local(), y_one)
        y.to_local().backward(dy_local)
        y_one.backward(dy_local)
        for p, q in zip(layer.parameters(), one.parameters()):
            assert p.grad.placements[0].is_partial()
            dist.all_reduce(q.grad)
            assert rel(p.grad.full_tensor(), q.grad) < 1e-6
    return True


def test_torch_sequence_parallel_style(two_ranks):
    assert all(results["sequence_parallel"] is True for results in two_ranks)


def fsdp_te_form_worker(rank, world):
    """TransformerEngine's form with sequence parallelism under FSDP2 (a 1 x 2 mesh): the
    row-parallel bias's gradient, a DTensor, is summed by reduce_sequence_parallel_grads like a
    plain one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    whole = whole_pair()
    model = te_mode_pair(whole, rank, world, True, 0)
    reference = te_mode_pair(whole, rank, world, True, 0)
    fully_shard(model, mesh=mesh["dp"])
    torch.manual_seed(4)
    x, dy = torch.randn(TOKENS // world, 2, K), torch.randn(TOKENS // world, 2, K)
    got = fwd_bwd(model, x, dy, RECIPES["current"], seed=90)
    want = fwd_bwd(reference, x, dy, RECIPES["current"], seed=90)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (i, rel(a, b))
    return True


def test_fsdp2_over_transformer_engine_form(two_ranks):
    assert all(results["fsdp_te_form"] is True for results in two_ranks)


def errors_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    raised = []
    cases = [
        (TypeError, torch.nn.Linear(K, N), te.distributed.ColwiseParallel(), mesh),
        (ValueError, te.Linear(K, N), te.distributed.ColwiseParallel(),
         init_device_mesh("cpu", (1, world))),
        (ValueError, te.Linear(K, N), te.distributed.ColwiseParallel(input_layouts=Shard(-1)),
         mesh),
        (ValueError, te.Linear(K, N), te.distributed.RowwiseParallel(output_layouts=Partial()),
         mesh),
        (ValueError, te.Linear(K, N + 1), te.distributed.ColwiseParallel(), mesh),
        (ValueError, te.Linear(K, N, tp_group=dist.group.WORLD, parallel_mode="column"),
         te.distributed.RowwiseParallel(), mesh),
    ]
    for error, module, style, on in cases:
        with pytest.raises(error) as info:
            parallelize_module(module, on, style)
        raised.append(str(info.value))
    return raised


def test_bad_styles_raise_clearly(two_ranks):
    raised = two_ranks[0]["errors"]
    assert "parallelizes te.Linear, got Linear" in raised[0]
    assert "needs a 1-D mesh" in raised[1]
    assert "input_layouts must be Replicate() or Shard(d)" in raised[2]
    assert "output_layouts must be Replicate() or Shard(d)" in raised[3]
    assert "not divisible by the 2 ranks" in raised[4]
    assert "already tensor parallel" in raised[5]
