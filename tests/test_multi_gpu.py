"""NCCL, one process per GPU, 2 and 4 GPUs: the distributed suites' checks (issue 26).

Each test spawns one rank per GPU inside pytest (tests/dist_util.run_ranks(..., backend="nccl"):
torch.cuda.set_device(rank), a timeout on the join) and runs there the rank functions of the
gloo tests on CUDA tensors (the rank's GPU as torch's default device), so their checks now hold
over NCCL, every recipe:
- FSDP2 with the quantized all-gather (test_fsdp.fsdp_worker): the gathered weight equals
  te.ops.quantize of the whole weight bit for bit, outputs of quantized and high-precision steps
  equal one process's, gradients its ranks' mean, bytes per forward within the bounds; 4 GPUs:
  width 512 / hidden 1024, so every format's shards hold whole blocks (128 rows per rank);
  compiled blocks (test_fsdp.compiled_steps) trace the per-tensor FP8 gathered weight with no
  graph break, bit-identical to eager;
- TransformerEngine's tensor parallelism (test_tensor_parallel): column output, weight and bias
  gradients bit-identical to one process's shard, row parallel within ROW_BOUND, the
  sequence-parallel quantized all-gathers equal te.ops.quantize of the whole tensor; 2 GPUs: the
  20-step sequence-parallel MLP and one torch.compile graph; 4 GPUs: K=128, N=256, 512 tokens
  (each rank the shapes of 2 ranks at the gloo sizes);
- tequant's DTensor styles bit-identical to TE's form (test_dtensor_parallel.styles_worker);
  4 GPUs: FSDP2 over a (dp 2, tp 2) mesh, with and without the quantized all-gather (not
  DelayedScaling's quantized gather there: see the test);
- DDP (test_ddp_dcp): DelayedScaling's amax reduction (one all-reduce per update, identical
  state), AdamW steps on each rank's own data after which every rank holds the same parameters
  and buffers, bit for bit; 2 GPUs: no_sync microbatches against one process (its second step
  compares bits after an update, exact where the 2-rank sum a + b is: not with 4 ranks).
Each world size is skipped unless torch.cuda.device_count() >= it (the file skips on CPU). NVLink
multicast is off on the lent machines: set in os.environ here, inherited by every spawned rank.
"""
import importlib
import os
import sys

# before anything starts a process (DISTRIBUTED.md 3)
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                  NVSHMEM_DISABLE_NVLS="1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from dist_util import run_ranks  # noqa: E402

import tequant as te  # noqa: E402
from test_fsdp import RECIPES, check_bytes  # noqa: E402
from test_tensor_parallel import MLP_BOUND  # noqa: E402

pytestmark = pytest.mark.gpu
WORLDS = [pytest.param(w, marks=pytest.mark.skipif(torch.cuda.device_count() < w,
                                                    reason=f"needs {w} GPUs"))
          for w in (2, 4)]
NAMES = list(RECIPES)
TIMEOUT = 240


def on_gpu(rank, world, jobs):
    """Runs jobs [(module, function, constants, args)] in order: module.function(rank, world,
    *args) of a gloo test file, on this rank's GPU, with the module's `constants` (sizes)
    replaced in this rank's process meanwhile; returns their results."""
    torch.set_default_device(torch.device("cuda", rank))
    results = []
    for module, name, constants, args in jobs:
        mod = importlib.import_module(module)
        saved = {k: getattr(mod, k) for k in constants}
        for k, v in constants.items():
            setattr(mod, k, v)
        try:
            results.append(getattr(mod, name)(rank, world, *args))
        finally:
            for k, v in saved.items():
                setattr(mod, k, v)
    return results


def nccl(world, jobs):
    return run_ranks(on_gpu, world, jobs, timeout=TIMEOUT, backend="nccl")


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_quantized_all_gather_nccl(world):
    configs = [(True, torch.bfloat16, False), (False, None, False), (True, None, True),
               (False, torch.bfloat16, True)]
    width, hidden = (256, 512) if world == 2 else (512, 1024)
    reports = nccl(world, [("test_fsdp", "fsdp_worker", {},
                            (NAMES, configs, "cuda", width, hidden))])
    for (report,) in reports:
        assert report.pop("fallbacks") == {}
        assert set(report) == {(n, *c[:1], str(c[1]), c[2]) for n in NAMES for c in configs}
        check_bytes(report, NAMES)
        assert all(sent[1] > 0 for sent in report.values())  # the ranks did gather


def compiled_gather_worker(rank, world):
    """test_fsdp's compiled blocks over NCCL on CUDA tensors: per-tensor FP8's gathered weight
    traced with fullgraph=True (no graph break), outputs, gradients and DelayedScaling buffers
    bit-identical to the eager sharded model over 3 SGD steps (aot_eager: the CUDA kernels
    without Inductor's own codegen of the torch ops around them, whose bits may differ)."""
    from test_fsdp import compiled_steps
    for name in ("current", "delayed"):
        for reshard, dtype in ((True, None), (False, torch.bfloat16)):
            breaks = compiled_steps(name, True, reshard, dtype, device="cuda")
            assert breaks == {}, (name, reshard, breaks)
    breaks = compiled_steps("delayed", True, True, None, device="cuda", amax_group=True)
    assert breaks == {}, breaks
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_fsdp_compiled_gather_nccl(world):
    assert nccl(world, [("test_multi_gpu", "compiled_gather_worker", {}, ())]) == [[True]] * world


@pytest.mark.parametrize("world", WORLDS)
def test_compiled_delayed_one_backward_reduction_nccl(world):
    """test_compile's check over NCCL on CUDA: compiled DelayedScaling modules under an amax
    reduction group queue their backward updates for one all-reduce at the end of the backward
    pass, and their buffers equal an eager model's."""
    for ((counts, same, graphs),) in nccl(world, [("test_compile",
                                                   "_one_backward_reduction_worker", {}, ())]):
        assert counts == [[3]] * 6 and same == [True] * 12, (counts, same)
        assert sum(g.count("tequant.amax_defer_queue") for g in graphs) == 3, graphs


@pytest.mark.parametrize("world", WORLDS)
def test_tensor_parallel_nccl(world):
    sizes = {} if world == 2 else {"K": 128, "N": 256, "TOKENS": 512}
    jobs = [("test_tensor_parallel", "column_worker", sizes, (NAMES,)),
            ("test_tensor_parallel", "row_worker", sizes, (NAMES,)),
            ("test_tensor_parallel", "gather_worker", sizes, ())]
    if world == 2:
        jobs += [("test_tensor_parallel", "mlp_all_worker", {}, ()),
                 ("test_tensor_parallel", "compile_worker", {}, ([("current", True, "te")],))]
    for results in nccl(world, jobs):
        column, row_errors, fallbacks = results[:3]
        assert column is True
        assert set(row_errors) == {(n, sp) for n in NAMES for sp in (False, True)}
        assert all(err > 0 for err in row_errors.values())  # quantized, not exact
        assert any("stochastic rounding" in reason for reason in fallbacks), fallbacks
        assert not any("cut the format" in reason or "not a multiple" in reason
                       for reason in fallbacks), fallbacks
        if world == 2:
            for name, losses in results[3].items():
                assert losses[-1][1] < 0.75 * losses[0][1], (name, losses)
                worst = max(abs(tp_loss - one) / one for tp_loss, one in losses)
                assert worst < MLP_BOUND[name], (name, worst, losses)
            assert results[4] is True


@pytest.mark.parametrize("world", WORLDS)
def test_dtensor_styles_and_2d_mesh_nccl(world):
    sizes = {} if world == 2 else {"TOKENS": 512}
    jobs = [("test_dtensor_parallel", "styles_worker", sizes, (["fp32", *NAMES],))]
    if world == 4:  # a (dp 2, tp 2) mesh; shards of 128 rows for FP8 blocks
        jobs += [("test_dtensor_parallel", "fsdp_tp_worker", {"K": 256, "N": 512}, (name, q))
                 for name in NAMES for q in (False, True)]
    for results in nccl(world, jobs):
        errors = results[0]  # torch's own styles against TE's form
        assert errors and all(err < 1e-6 for err in errors.values())
        assert all(r is True for r in results[1:])


def ddp_agree_worker(rank, world, names):
    """Three AdamW steps of DDP(MLP) on each rank's own data per recipe (DelayedScaling with
    the amax reduction over the ranks): every rank ends with the same parameters and buffers,
    bit for bit, and they moved."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from test_ddp_dcp import MLP, data
    agree = {}
    for name in names:
        recipe = RECIPES[name]
        torch.manual_seed(0)
        model = DDP(MLP())
        start = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        group = dist.group.WORLD if recipe.delayed() else None
        for step in range(3):
            with te.autocast(recipe=recipe, amax_reduction_group=group):
                loss = model(data(rank, step, 0)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        state = [t.detach().reshape(-1).float() for t in (*model.parameters(), *model.buffers())]
        flat = torch.cat(state)
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        moved = all(not torch.equal(p, s) for p, s in zip(model.parameters(), start))
        agree[name] = (all(torch.equal(e, flat) for e in every), moved,
                       bool(torch.isfinite(flat).all()))
    return agree


@pytest.mark.parametrize("world", WORLDS)
def test_ddp_nccl(world):
    jobs = [("test_ddp_dcp", "delayed_reduction_worker", {}, ()),
            ("test_multi_gpu", "ddp_agree_worker", {}, (NAMES,))]
    if world == 2:  # its second step is bit-exact only where a sum does not depend on order
        jobs.append(("test_ddp_dcp", "ddp_worker", {}, ()))
    for (per_step, same), agree, *ddp in nccl(world, jobs):
        assert same and per_step == [[12, 6]] * 3, per_step
        assert agree == {name: (True, True, True) for name in NAMES}, agree
        assert ddp == ([{"current": True, "nvfp4": True, "delayed": True}] if world == 2
                       else [])
