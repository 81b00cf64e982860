"""tp_comm_overlap's forward pipelines (issue 26 item 3; python/tequant/distributed/pipelined.py,
csrc/ext/linear_pieces.c).

- linear_forward's pieces (one process): the fprop GEMM run as row blocks in any order a step
  callable gives equals the one GEMM, bit for bit on CPU; bad pieces, a block out of range, a
  format whose blocks do not share one scale, rows that do not split, and a step that raises
  each give a clear exception.
- Gloo ranks on CPU, 2 and 4, sequence parallel, per-tensor recipes (current, delayed, two
  steps so DelayedScaling's second uses updated scales): a column-parallel layer with
  tp_comm_overlap (its input's token blocks passed along a ring beside the GEMM's row blocks)
  and a row-parallel one (its output reduce-scattered by the ring) give the outputs and
  gradients of the same layers without it: bit for bit where the reduction is one addition per
  element (column layers; row layers on 2 ranks), within fp32 summation order on 4; the rings
  ran (counted). MXFP8 and token counts that do not split into the format's rows keep the plain
  collectives (no ring) with the same results.
- tests/test_multi_gpu.py runs the rank worker over NCCL on 2 and 4 GPUs.
"""
import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from dist_util import run_ranks  # noqa: E402

import tequant as te  # noqa: E402
from tequant import _C  # noqa: E402
from tequant.recipe import Float8CurrentScaling, MXFP8BlockScaling  # noqa: E402
from test_compile import RECIPES  # noqa: E402
from test_tensor_parallel import K, N, full_layer, rel, step, tp_layer  # noqa: E402


def _plan_forward(recipe, x, pieces=None, layer=None):
    layer = layer or te.Linear(x.shape[-1], 32)
    plan = layer._plan(recipe)
    args = (plan.c_args, x, layer.weight, layer.bias, 0, [], None, None, None)
    return _C.linear_forward(*args, *(() if pieces is None else (pieces,)))[0]


def test_pieces_any_order_is_the_one_gemm():
    torch.manual_seed(0)
    layer, x = te.Linear(64, 32), torch.randn(128, 64)
    whole = _plan_forward(Float8CurrentScaling(), x, layer=layer)
    calls = []

    def reversed_order(i, blocks):
        calls.append((i, tuple(blocks.shape)))
        return None if i == 4 else 3 - i
    split = _plan_forward(Float8CurrentScaling(), x, (4, reversed_order, 16), layer)
    assert torch.equal(split, whole)
    assert calls == [(i, (4, 32, 32)) for i in range(5)]


def test_pieces_errors():
    x = torch.randn(64, 64)
    current = Float8CurrentScaling()
    with pytest.raises(TypeError, match="pieces must be None or"):
        _plan_forward(current, x, "pieces")
    with pytest.raises(TypeError, match="pieces must be None or"):
        _plan_forward(current, x, (0, lambda i, b: 0, 0))
    with pytest.raises(TypeError, match="pieces must be None or"):
        _plan_forward(current, x, (2, lambda i, b: 0))  # no SM margin
    with pytest.raises(TypeError, match="SMs to leave free 0..1024"):
        _plan_forward(current, x, (2, lambda i, b: 0, -1))
    with pytest.raises(ValueError, match=r"step\(0\) returned block 5; the blocks are 0 to 1"):
        _plan_forward(current, x, (2, lambda i, b: 5, 0))
    with pytest.raises(ValueError, match="per-tensor FP8 input whose 64 rows split into 3"):
        _plan_forward(current, x, (3, lambda i, b: i, 0))
    with pytest.raises(ValueError, match="per-tensor FP8 input"):
        _plan_forward(MXFP8BlockScaling(), x, (2, lambda i, b: i, 0))

    def broken(i, blocks):
        raise RuntimeError("the ring broke")
    with pytest.raises(RuntimeError, match="the ring broke"):
        _plan_forward(current, x, (2, broken, 0))


def test_sm_margin_setting():
    import subprocess
    code = "import tequant.distributed.pipelined as p; print(p.SM_MARGIN)"
    env = dict(os.environ, TEQUANT_TP_OVERLAP_SM_MARGIN="24")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "24", out.stderr[-2000:]
    env["TEQUANT_TP_OVERLAP_SM_MARGIN"] = "many"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "must be a number of SMs from 0 to 1024, got 'many'" in out.stderr


def pipelined_worker(rank, world, names, tokens=(256, 2)):
    """For each recipe and layer kind: (name, mode, tokens) -> (ring steps run, worst relative
    difference of y, dx, dW, db with tp_comm_overlap against without, over two steps)."""
    from tequant.distributed import pipelined
    counts = {"GatherRing": 0, "ScatterRing": 0}
    originals = {cls: cls.__call__ for cls in (pipelined.GatherRing, pipelined.ScatterRing)}

    def counting(cls):
        def call(self, i, blocks):
            counts[cls.__name__] += 1
            return originals[cls](self, i, blocks)
        return call
    for cls in originals:
        cls.__call__ = counting(cls)
    results = {}
    try:
        for s, b in (tokens, (9, 2)):  # 9 x 2 tokens a rank: not the format's 16-row multiple
            torch.manual_seed(5)
            x = torch.randn(s * world, b, K)
            for name in names:
                for mode in ("column", "row"):
                    off = tp_layer(mode, True, rank, world, full_layer())
                    on = copy.deepcopy(off)
                    on.tp_comm_overlap = True
                    if mode == "column":
                        x_in = x.chunk(world, 0)[rank].contiguous()
                        dy = torch.randn(s * world, b, N // world)
                    else:
                        x_in = x.chunk(world, 2)[rank].contiguous()
                        dy = torch.randn(s, b, N)
                    for c in counts:
                        counts[c] = 0
                    worst = 0.0
                    for i in range(2):
                        a = step(on, x_in, dy, RECIPES[name], seed=80 + i)
                        ran = dict(counts)
                        z = step(off, x_in, dy, RECIPES[name], seed=80 + i)
                        assert counts == ran, (name, mode, "the ring ran without overlap")
                        worst = max([worst] + [rel(u, v) for u, v in zip(a, z)])
                        for layer in (on, off):
                            for p in layer.parameters():
                                p.grad = None
                    results[(name, mode, s)] = (sum(counts.values()), worst)
    finally:
        for cls, call in originals.items():
            cls.__call__ = call
    return results


def check(results, world, names, exact):
    for name in names:
        per_tensor = name in ("current", "delayed")
        for mode in ("column", "row"):
            steps, worst = results[(name, mode, 256)]
            assert steps == (2 * (world + 1) if per_tensor else 0), (name, mode, steps)
            same = exact and (mode == "column" or world == 2)
            assert worst == 0.0 if same else worst < 1e-5, (name, mode, worst)
            steps, worst = results[(name, mode, 9)]  # plain collectives
            assert steps == 0 and worst == 0.0, (name, mode, steps, worst)


NAMES = ["current", "delayed", "mxfp8"]


@pytest.mark.parametrize("world", [2, 4])
def test_rings_give_the_plain_collectives_results(world):
    names = NAMES if world == 2 else ["current"]
    for results in run_ranks(pipelined_worker, world, names, timeout=240):
        check(results, world, names, exact=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pieces_leave_sms_on_cuda():
    """On CUDA the blocks' GEMMs plan for the SMs less the margin: a plan of their own (the SM
    count is in cuBLASLt's plan key), and the product of the one GEMM (another kernel may
    accumulate in another order: within fp32 rounding)."""
    torch.manual_seed(0)
    layer = te.Linear(1024, 512, device="cuda")
    x = torch.randn(4096, 1024, device="cuda")
    whole = _plan_forward(Float8CurrentScaling(), x, layer=layer)
    plans = dict(_C._gemm_plan_stats())["plans"]
    for margin in (16, 0):
        split = _plan_forward(Float8CurrentScaling(), x, (2, lambda i, b: None if i == 2 else i,
                                                          margin), layer)
        assert rel(split, whole) < 1e-6, margin
    # blocks of 2048 rows: one plan with the margin, one without
    assert dict(_C._gemm_plan_stats())["plans"] == plans + 2
